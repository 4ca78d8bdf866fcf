"""Tensors derived from a module's parameters (stacked or re-laid-out weights, other-precision
copies), cached until their sources change: :class:`DerivedWeights` (the flow estimators' fused
projections, the HiFT F0 predictor's float64 weights)."""

from __future__ import annotations

import torch


class DerivedWeights:
    """Tensors derived from parameters (fused or re-laid-out weights), built on first use and
    rebuilt when a source parameter was replaced, moved or modified in place (its storage
    pointer or version counter changed; parameters created in inference mode have no version
    counter, so only replacing or moving those is noticed). Built outside inference mode, so
    they are plain tensors."""

    def __init__(self):
        self._store: dict = {}

    def get(self, name: str, sources: tuple, build):
        key = tuple((p.data_ptr(), 0 if p.is_inference() else p._version, p.dtype, p.device) for p in sources)
        hit = self._store.get(name)
        if hit is None or hit[0] != key:
            with torch.inference_mode(False), torch.no_grad():
                hit = (key, build())
            self._store[name] = hit
        return hit[1]

"""Repetition-aware sampling (RAS) of speech tokens.

Algorithm: VALL-E 2 (Chen et al., 2024, https://arxiv.org/abs/2406.05370), as used by
CosyVoice2 (upstream ``cosyvoice/utils/common.py``: ``ras_sampling``,
``nucleus_sampling``, ``random_sampling``):

1. nucleus sampling: sort the distribution (stable, descending), keep the most probable
   tokens while their running probability sum is below ``top_p`` and fewer than
   ``top_k`` are kept, sample one of them in proportion to its probability;
2. if the sampled token occurs at least ``win_size * tau_r`` times among the last
   ``win_size`` decoded tokens, forbid it and sample again from the full distribution.

:class:`UpstreamSampler` reproduces upstream's random-number consumption exactly
(``Tensor.multinomial(1, replacement=True)`` on the nucleus, then on the full softmax),
so a ``torch.Generator`` seeded with ``s`` gives upstream's tokens after
``torch.manual_seed(s)``. The running sum is accumulated sequentially in float32 and
compared with ``top_p`` in float32, as upstream's Python loop does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .config import SamplingConfig


class UpstreamSampler:
    """Per-step RAS sampler for one request; draws from a (CPU) ``torch.Generator``.

    ``sample(logp, decoded, generator, ignore_eos)``: ``logp`` is the float32
    log-probability vector ``[S+3]`` of one step, ``decoded`` the tokens emitted so far.
    Returns the sampled id (an ``int``). ``ignore_eos`` masks ``eos_id`` (only that id,
    as upstream) before sampling. ``logp`` is not modified.
    """

    def __init__(self, cfg: SamplingConfig, eos_id: int):
        self.cfg = cfg
        self.eos_id = eos_id
        self._top_p32 = torch.tensor(cfg.top_p, dtype=torch.float32).item()

    def nucleus(self, scores: torch.Tensor, generator: torch.Generator | None) -> int:
        probs = scores.softmax(dim=0)
        sorted_p, sorted_idx = probs.sort(descending=True, stable=True)
        head = sorted_p[: self.cfg.top_k].double().cpu().tolist()
        # Sequential float32 running sum, compared in float32 (upstream's Python loop).
        import numpy as np

        cum = np.float32(0.0)
        n = 0
        thr = np.float32(self._top_p32)
        for p in head:
            if cum < thr and n < self.cfg.top_k:
                cum = np.float32(cum + np.float32(p))
                n += 1
            else:
                break
        chosen = sorted_p[:n].clone()
        pick = chosen.multinomial(1, replacement=True, generator=generator)
        return int(sorted_idx[pick].item())

    def sample(
        self,
        logp: torch.Tensor,
        decoded: Sequence[int],
        generator: torch.Generator | None = None,
        ignore_eos: bool = False,
    ) -> int:
        scores = logp.detach().float().clone()
        if ignore_eos:
            scores[self.eos_id] = -float("inf")
        tok = self.nucleus(scores, generator)
        window = decoded[-self.cfg.win_size:] if self.cfg.win_size > 0 else []
        reps = sum(1 for t in window if t == tok)
        if reps >= self.cfg.win_size * self.cfg.tau_r:
            scores[tok] = -float("inf")
            tok = int(scores.softmax(dim=0).multinomial(1, replacement=True, generator=generator).item())
        return tok

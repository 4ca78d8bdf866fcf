"""Per-item views of batch tensors: merging the runs of them that lie back to back in one storage.

Batched streaming steps (the DiT flow's :meth:`~cosyserve.models.dit_flow.DitFlowModel.forward_items`,
:func:`~cosyserve.models.hift.hift_stream_step_batch`) hand every stream views of one batch tensor;
when the next batch concatenates those per-stream tensors again, :func:`cat_adjacent` turns each run
of adjacent views back into one view first (metadata only), so the host issues one copy per run
instead of one per stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["cat_adjacent", "merge_adjacent"]


def merge_adjacent(tensors: Sequence[Tensor], dim: int) -> list[Tensor]:
    """``tensors`` with every run of consecutive tensors that lie back to back along ``dim`` in one
    storage (same dtype, strides and other sizes; each one starting where the previous one ends)
    replaced by a single view covering the run. The per-item views that one batch hands out
    (:meth:`~cosyserve.models.dit_flow.DitFlowModel.forward_items`, the HiFT streaming step) are such
    runs when the next batch takes the same streams in the same order, so concatenating them again
    copies per run instead of per item. Only metadata is
    read (no tensor operation, no device synchronisation); ``torch.cat(result, dim)`` equals
    ``torch.cat(tensors, dim)``. Tensors of size 0 along ``dim`` are dropped (unless all are)."""
    out: list[Tensor] = []
    head, key, n, nxt = None, None, 0, 0
    for t in tensors:
        size = t.shape[dim]
        if size == 0:
            continue
        st = t.stride()
        k = (t.untyped_storage().data_ptr(), st, t.shape[:dim], t.shape[dim + 1:], t.dtype, t.device)
        off = t.storage_offset()
        if head is not None and k == key and off == nxt:
            n += size
            nxt += size * st[dim]
            continue
        if head is not None:
            out.append(head if n == head.shape[dim] else
                       head.as_strided((*key[2], n, *key[3]), key[1], head.storage_offset()))
        head, key, n, nxt = t, k, size, off + size * st[dim]
    if head is not None:
        out.append(head if n == head.shape[dim] else
                   head.as_strided((*key[2], n, *key[3]), key[1], head.storage_offset()))
    return out or list(tensors[:1])


def cat_adjacent(tensors: Sequence[Tensor], dim: int) -> Tensor:
    """``torch.cat(tensors, dim)`` over :func:`merge_adjacent` runs; a single run is returned as is
    (a view: callers only read it)."""
    parts = merge_adjacent(tensors, dim)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)

"""Per-item views of batch tensors: merging the runs of them that lie back to back in one storage,
and copying strided caches in wide words (:func:`copy_wide_`).

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

__all__ = ["cat_adjacent", "merge_adjacent", "copy_wide_", "cat_wide"]


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


def _words(t: Tensor) -> Tensor:
    """``t`` viewed as 8-byte words along its last dim (``Tensor.view(torch.int64)``: raises
    RuntimeError unless that dim is contiguous and its bytes, every other stride's bytes and the
    storage offset's are whole words)."""
    return t.view(torch.int64)


def copy_wide_(dst: Tensor, src: Tensor) -> Tensor:
    """``dst.copy_(src)`` for tensors of one dtype (narrower than 8 bytes) and shape, moved as
    8-byte words where both layouts allow it (:func:`_words`): bit for bit the same result. PyTorch
    copies a non-contiguous destination with its generic element-wise kernel, one element per thread
    step; for the DiT's estimator caches (bfloat16, runs of ``frames x 128`` elements in a larger
    buffer) that took 173 µs per stream and solve on an H100 at 400 cached frames, as 8-byte words 90 µs
    (docs/perf.md "Session 32"). Falls back to ``dst.copy_(src)`` otherwise (other layouts, dtype
    conversions, broadcasting). Costs the host two tensor views more than ``copy_``. Returns ``dst``."""
    if dst.dtype == src.dtype and dst.element_size() < 8 and dst.shape == src.shape:
        try:
            d, s = _words(dst), _words(src)
        except RuntimeError:  # a layout that cannot be viewed as words
            return dst.copy_(src)
        d.copy_(s)
        return dst
    return dst.copy_(src)


def cat_wide(tensors: Sequence[Tensor], dim: int) -> Tensor:
    """``torch.cat(tensors, dim)`` (one dtype narrower than 8 bytes, ``dim`` not the last) as 8-byte
    words where the layouts allow it (see :func:`copy_wide_`); otherwise ``torch.cat``."""
    ts = list(tensors)
    if ts and ts[0].element_size() < 8 and dim % ts[0].dim() != ts[0].dim() - 1 \
            and all(t.dtype == ts[0].dtype for t in ts):
        try:
            words = [_words(t) for t in ts]
        except RuntimeError:  # a layout that cannot be viewed as words
            return torch.cat(ts, dim)
        return torch.cat(words, dim).view(ts[0].dtype)
    return torch.cat(ts, dim)

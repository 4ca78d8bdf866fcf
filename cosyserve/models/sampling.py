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

import numpy as np
import torch

from .config import SamplingConfig


def eos_span(eos_id: "int | range") -> slice:
    """The ids a min-length mask covers: one id (upstream: ``LLMConfig.min_len_mask_id``) or a
    ``range`` of ids (``--strict-min-len``: every stop id)."""
    if isinstance(eos_id, range):
        if eos_id.step != 1:
            raise ValueError("an eos range must be contiguous")
        return slice(eos_id.start, eos_id.stop)
    return slice(int(eos_id), int(eos_id) + 1)


class UpstreamSampler:
    """Per-step RAS sampler for one request; draws from a (CPU) ``torch.Generator``.

    ``sample(logp, decoded, generator, ignore_eos)``: ``logp`` is the float32
    log-probability vector ``[S+E]`` of one step, ``decoded`` the tokens emitted so far.
    Returns the sampled id (an ``int``). ``ignore_eos`` masks ``eos_id`` (only that id,
    as upstream) before sampling: pass ``LLMConfig.min_len_mask_id`` (upstream masks index
    ``speech_token_size``: CosyVoice2's eos, CosyVoice3's sos), or a ``range`` of ids
    (:func:`eos_span`). ``logp`` is not modified.
    """

    def __init__(self, cfg: SamplingConfig, eos_id: "int | range"):
        self.cfg = cfg
        self.eos_id = eos_id
        self._eos = eos_span(eos_id)
        self._top_p32 = torch.tensor(cfg.top_p, dtype=torch.float32).item()

    def nucleus(self, scores: torch.Tensor, generator: torch.Generator | None) -> int:
        probs = scores.softmax(dim=0)
        sorted_p, sorted_idx = probs.sort(descending=True, stable=True)
        head = sorted_p[: self.cfg.top_k].double().cpu().tolist()
        # Sequential float32 running sum, compared in float32 (upstream's Python loop).
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
            scores[self._eos] = -float("inf")
        tok = self.nucleus(scores, generator)
        window = decoded[-self.cfg.win_size:] if self.cfg.win_size > 0 else []
        reps = sum(1 for t in window if t == tok)
        if reps >= self.cfg.win_size * self.cfg.tau_r:
            scores[tok] = -float("inf")
            tok = int(scores.softmax(dim=0).multinomial(1, replacement=True, generator=generator).item())
        return tok

    def sample_batch(
        self,
        logp: torch.Tensor,
        decoded: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        ignore_eos: Sequence[bool],
    ) -> list[int]:
        """:meth:`sample` for ``B`` requests at once: the same tokens and the same random-number
        consumption as ``B`` calls of :meth:`sample` (row ``b`` with ``decoded[b]``,
        ``generators[b]``, ``ignore_eos[b]``), at a fraction of the host time.

        ``logp``: float ``[B, S+E]`` log-probabilities (CPU). The softmax is taken over the
        whole batch (bitwise equal to per-row softmax on the CPU) and the nucleus is found with
        ``topk`` instead of a full sort: the ``top_k`` largest probabilities, ordered by value
        descending then index ascending, are exactly the head of the stable descending sort
        unless probabilities equal to the ``top_k``-th one also exist outside the ``topk``
        result; such rows fall back to the full stable sort. The running float32 sum is a
        ``numpy`` cumulative sum (sequential, as the loop). The multinomial draws and the
        repetition check stay per row, each with its request's generator.
        Raises ValueError if the argument lengths differ from ``B``.
        """
        bsz = logp.shape[0]
        if not (len(decoded) == len(generators) == len(ignore_eos) == bsz):
            raise ValueError("decoded, generators and ignore_eos need one entry per row of logp")
        if bsz == 0:
            return []
        k = min(self.cfg.top_k, logp.shape[1])
        scores = logp.detach().float().clone()
        masked = [b for b, f in enumerate(ignore_eos) if f]
        if masked:
            scores[masked, self._eos] = -float("inf")
        probs = scores.softmax(dim=1)
        vals, idx = probs.topk(k, dim=1, largest=True, sorted=True)
        # order ties by index (the stable sort's order): by index, then stably by value
        by_index = idx.argsort(dim=1, stable=True)
        vals, idx = vals.gather(1, by_index), idx.gather(1, by_index)
        by_value = vals.argsort(dim=1, descending=True, stable=True)
        vals, idx = vals.gather(1, by_value), idx.gather(1, by_value)
        boundary = vals[:, k - 1: k]
        spill = (probs == boundary).sum(dim=1) > (vals == boundary).sum(dim=1)
        for b in spill.nonzero().flatten().tolist():  # a tie crosses the top-k boundary: sort fully
            sp, si = probs[b].sort(descending=True, stable=True)
            vals[b], idx[b] = sp[:k], si[:k]
        head = vals.numpy()
        cum = np.cumsum(head, axis=1, dtype=np.float32)
        before = np.concatenate([np.zeros((bsz, 1), np.float32), cum[:, :-1]], axis=1)
        n_keep = (before < np.float32(self._top_p32)).sum(axis=1)
        out = []
        for b in range(bsz):
            n = int(n_keep[b])
            pick = vals[b, :n].clone().multinomial(1, replacement=True, generator=generators[b])
            tok = int(idx[b, int(pick)])
            window = decoded[b][-self.cfg.win_size:] if self.cfg.win_size > 0 else []
            if sum(1 for t in window if t == tok) >= self.cfg.win_size * self.cfg.tau_r:
                row = scores[b].clone()
                row[tok] = -float("inf")
                tok = int(row.softmax(dim=0).multinomial(1, replacement=True, generator=generators[b]).item())
            out.append(tok)
        return out


_MASK64 = (1 << 64) - 1


def _i64(v: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    v &= _MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def counter_uniform(seed: torch.Tensor, step: torch.Tensor, stream: int, index: torch.Tensor) -> torch.Tensor:
    """Counter-based uniform random numbers in (0, 1), float32, from integer keys.

    ``seed``, ``step``: int64 ``[B]``; ``index``: int64 ``[N]``; ``stream`` a small int (which
    draw). Returns ``[B, N]``: a pure function of (seed, step, stream, index) — SplitMix64's
    finaliser (Steele et al., 2014) over the combined key, 24 bits per number — so a request's
    draws do not depend on what else is in its batch, and no generator state exists. int64
    arithmetic wraps (two's complement), as the algorithm needs.
    """
    key = seed[:, None] * _GOLDEN + (step[:, None] * 1_000_003 + stream) * _MIX2 + index[None, :] * _MIX1
    z = key + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return (_shr(z, 40).float() + 0.5) * (1.0 / (1 << 24))


def ras_sample_device(logp: torch.Tensor, recent: torch.Tensor, seed: torch.Tensor, step: torch.Tensor,
                      ignore_eos: torch.Tensor, cfg: SamplingConfig, eos_id: "int | range") -> torch.Tensor:
    """Repetition-aware sampling for a batch on the device, without host synchronisation.

    The rule of :class:`UpstreamSampler` (nucleus of at most ``top_k`` tokens whose running
    probability before each token is below ``top_p``; if the pick occurs ``>= win_size * tau_r``
    times among the last ``win_size`` tokens, a draw from the full distribution without it;
    ``ignore_eos`` masks ``eos_id``), with counter-based randomness (:func:`counter_uniform`)
    instead of a generator: categorical draws are exponential races (``argmax p_i / E_i``,
    ``E_i = -log U_i``), keyed by the request's seed and its token index, so seeded requests
    are reproducible and independent of batching. It does not reproduce upstream's random
    stream (:class:`UpstreamSampler` does, on the host).

    Args: ``logp`` float ``[B, V]`` log-probabilities; ``recent`` int64 ``[B, win_size]`` the
    last decoded tokens (``-1`` where fewer exist); ``seed``, ``step`` int64 ``[B]`` (step =
    tokens decoded so far); ``ignore_eos`` bool ``[B]``. Returns int64 ``[B]`` token ids.
    """
    v = logp.shape[1]
    sp = eos_span(eos_id)
    ids = torch.arange(v, device=logp.device)
    scores = logp.float().masked_fill(ignore_eos[:, None] & ((ids >= sp.start) & (ids < sp.stop))[None, :],
                                      float("-inf"))
    probs = scores.softmax(dim=1)
    k = min(cfg.top_k, v)
    vals, idx = probs.topk(k, dim=1, largest=True, sorted=True)
    before = vals.cumsum(dim=1) - vals
    keep = before < cfg.top_p  # compared in float32, as upstream's loop
    keep[:, 0] = True
    ar_k = torch.arange(k, device=logp.device)
    race = vals / -torch.log(counter_uniform(seed, step, 0, ar_k))
    pick = race.masked_fill(~keep, -1.0).argmax(dim=1, keepdim=True)
    tok = idx.gather(1, pick)[:, 0]
    if cfg.win_size > 0:
        reps = (recent[:, -cfg.win_size:] == tok[:, None]).sum(dim=1)
        repeat = reps >= cfg.win_size * cfg.tau_r
        full = probs.scatter(1, tok[:, None], 0.0)
        race2 = full / -torch.log(counter_uniform(seed, step, 1, torch.arange(v, device=logp.device)))
        tok = torch.where(repeat, race2.argmax(dim=1), tok)
    return tok

"""CUDA graphs for the launch-bound hot paths: the LM decode step, single-sequence prefill,
the flow solve and the HiFT decoder.

At serving batch sizes both are bound by kernel launches, not arithmetic (measured on an
H100: one eager Qwen2-0.5B decode step takes ~18 ms at batch 1 and at batch 64; one
10-step flow solve ~300 ms at batch 1 and at batch 32). Replaying a captured graph removes
the launch cost. Graphs need static shapes, so inputs are padded to buckets:

* :class:`GraphedDecoder` — batch buckets (1, 2, 4, ..., max) x KV-length buckets (512,
  1024, ..., cache length). Padding rows read/write a reserved *scratch* KV slot and are
  discarded. Attention covers the bucket's KV length with a mask (positions <= each row's
  position), so results equal :meth:`SpeechLM.forward_cached`'s.
* :class:`GraphedFlowSolver` — batch buckets x frame buckets (multiples of 64 frames).
  Padded frames have mask 0, exactly like shorter items in an eager batch, so valid frames
  are unchanged (the flow's batched path is padding-safe and tested to be).

Graphs are captured lazily on first use of a bucket (a few hundred ms each) into one shared
memory pool; ``warmup()`` captures them ahead of time. Capture checks only the capturing
thread (``capture_error_mode="thread_local"``): the engine's token2wav thread captures flow
graphs while the scheduler thread keeps decoding (and synchronising) on its own stream.
"""

from __future__ import annotations

import math

import torch

from .llm import KVCache, SpeechLM


def _pow2_buckets(max_value: int) -> list[int]:
    out, b = [], 1
    while b < max_value:
        out.append(b)
        b *= 2
    out.append(max_value)
    return out


def _capture_graph(run, pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """Warm ``run`` up twice on a side stream (lazy initialisation, cuFFT/cuBLAS plans), then
    capture it into a CUDA graph in ``pool``; returns ``(graph, run's output)``. Only the
    capturing thread is checked (``capture_error_mode="thread_local"``)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
        out = run()
    return g, out


def _pick(buckets: list[int], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


class GraphedDecoder:
    """One LM decode step (embed -> Qwen2 -> ``llm_decoder`` -> log-softmax) as CUDA graphs.

    ``cache`` must have one more slot than the engine uses: its last slot is the scratch
    slot for padding rows. Call with CPU or device tensors ``tokens [B]``, ``slots [B]``,
    ``start [B]`` (the position each row writes); returns float32 log-probabilities
    ``[B, S+3]`` on the device (a view into a static buffer: copy before the next call).
    """

    def __init__(self, lm: SpeechLM, cache: KVCache, max_batch: int, kv_buckets: list[int] | None = None):
        self.lm = lm
        self.cache = cache
        self.scratch = cache.n_slots - 1
        self.device = cache.k.device
        self.batch_buckets = _pow2_buckets(max_batch)
        if kv_buckets is None:
            kv_buckets = [b for b in (256, 512, 1024, 2048, 4096, 8192) if b < cache.max_len] + [cache.max_len]
        self.kv_buckets = kv_buckets
        self.pool = torch.cuda.graph_pool_handle()
        self._bufs: dict[int, dict[str, torch.Tensor]] = {}
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _buffers(self, bb: int) -> dict[str, torch.Tensor]:
        if bb not in self._bufs:
            d = self.device
            self._bufs[bb] = {"tokens": torch.zeros(bb, dtype=torch.long, device=d),
                              "slots": torch.full((bb,), self.scratch, dtype=torch.long, device=d),
                              "start": torch.zeros(bb, dtype=torch.long, device=d)}
        return self._bufs[bb]

    def _step(self, buf: dict[str, torch.Tensor], kv_len: int) -> torch.Tensor:
        emb = self.lm.embed_speech(buf["tokens"][:, None])
        h = self.lm.forward_cached(emb, self.cache, buf["slots"], buf["start"], kv_len=kv_len)[:, -1]
        return self.lm.logprobs(h)

    @torch.inference_mode()
    def _capture(self, bb: int, kvb: int):
        buf = self._buffers(bb)
        buf["slots"].fill_(self.scratch)
        buf["start"].zero_()
        g, out = _capture_graph(lambda: self._step(buf, kvb), self.pool)
        self._graphs[(bb, kvb)] = (g, out)
        return g, out

    def warmup(self) -> None:
        for bb in self.batch_buckets:
            for kvb in self.kv_buckets:
                if (bb, kvb) not in self._graphs:
                    self._capture(bb, kvb)

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, slots: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        n = int(tokens.numel())
        kv_need = int(start.max()) + 1
        bb = _pick(self.batch_buckets, n)
        kvb = _pick(self.kv_buckets, kv_need)
        buf = self._buffers(bb)
        g_out = self._graphs.get((bb, kvb)) or self._capture(bb, kvb)
        buf["tokens"][:n].copy_(tokens.reshape(-1), non_blocking=True)
        buf["slots"][:n].copy_(slots.reshape(-1), non_blocking=True)
        buf["start"][:n].copy_(start.reshape(-1), non_blocking=True)
        if n < bb:
            buf["slots"][n:].fill_(self.scratch)
            buf["start"][n:].zero_()
        g, out = g_out
        g.replay()
        return out[:n]


class GraphedPrefill:
    """Prefill of a single sequence (a newcomer admitted alone, the one-stream case) as CUDA
    graphs, one per length bucket (multiples of ``bucket`` positions up to ``max_len``).

    ``__call__(embeds [1, T, H], slot)`` writes positions ``0 .. T-1`` of ``slot`` in ``cache``
    and returns the final hidden states ``[1, T, H]`` (a view into a static buffer: use it
    before the next call), or None when ``T`` exceeds the largest bucket (prefill eagerly).
    The padded positions ``T .. bucket-1`` are written with junk K/V past the sequence, which
    decoding overwrites before any query can attend to them (causal attention), as in the
    engine's padded batched prefill.
    """

    def __init__(self, lm: SpeechLM, cache: KVCache, bucket: int = 64, max_len: int = 1024, pool=None):
        self.lm, self.cache = lm, cache
        self.buckets = list(range(bucket, min(max_len, cache.max_len) + 1, bucket))
        self.scratch = cache.n_slots - 1
        self.device = cache.k.device
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self._graphs: dict[int, tuple] = {}

    @torch.inference_mode()
    def _capture(self, tb: int):
        lm = self.lm
        dtype = lm.llm_decoder.weight.dtype
        bufs = {"emb": torch.zeros(1, tb, lm.qwen_config.hidden_size, device=self.device, dtype=dtype),
                "slot": torch.full((1,), self.scratch, dtype=torch.long, device=self.device),
                "start": torch.zeros(1, dtype=torch.long, device=self.device)}

        def run():
            return lm.forward_cached(bufs["emb"], self.cache, bufs["slot"], bufs["start"], kv_len=tb)

        g, out = _capture_graph(run, self.pool)
        self._graphs[tb] = (g, bufs, out)
        return self._graphs[tb]

    def warmup(self) -> None:
        for tb in self.buckets:
            if tb not in self._graphs:
                self._capture(tb)

    @torch.inference_mode()
    def __call__(self, embeds: torch.Tensor, slot: int) -> torch.Tensor | None:
        t = embeds.shape[1]
        if embeds.shape[0] != 1 or not self.buckets or t > self.buckets[-1]:
            return None
        tb = _pick(self.buckets, t)
        g, bufs, out = self._graphs.get(tb) or self._capture(tb)
        bufs["emb"][:, :t].copy_(embeds)
        if t < tb:
            bufs["emb"][:, t:].zero_()
        bufs["slot"].fill_(int(slot))
        g.replay()
        return out[:, :t]


class GraphedHiFTDecoder:
    """:meth:`HiFTGenerator.decode` (conv stack + source STFT + iSTFT, deterministic and free of
    host synchronisation) as CUDA graphs per batch bucket x frame bucket.

    ``__call__(mel [B, C, T], source [B, 1, T*spf], lengths [B])`` takes ``decode``'s padded-batch
    arguments and returns the speech ``[B, T*spf]`` (a fresh tensor). Padding rows and frames are
    handled by ``decode``'s own per-item lengths (padding rows get length 1), so valid samples
    equal the eager result up to float rounding of differently shaped kernels. F0 prediction and
    the excitation (random draws from each request's generator) stay eager.
    """

    def __init__(self, hift, max_batch: int, frame_bucket: int = 32, max_graphs: int = 256, pool=None):
        self.hift = hift
        self.batch_buckets = _pow2_buckets(max_batch)
        self.frame_bucket = frame_bucket
        self.max_graphs = max_graphs
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int], tuple] = {}

    @torch.inference_mode()
    def _capture(self, bb: int, tb: int, like: torch.Tensor):
        spf = self.hift.samples_per_frame
        d, dt = like.device, like.dtype
        bufs = {"mel": torch.zeros(bb, like.shape[1], tb, device=d, dtype=dt),
                "source": torch.zeros(bb, 1, tb * spf, device=d, dtype=dt),
                "lengths": torch.full((bb,), tb, dtype=torch.long, device=d)}

        def run():
            return self.hift.decode(bufs["mel"], bufs["source"], bufs["lengths"])

        g, out = _capture_graph(run, self.pool)
        if len(self._graphs) >= self.max_graphs:  # bound memory: drop the oldest graph
            self._graphs.pop(next(iter(self._graphs)))
        self._graphs[(bb, tb)] = (g, bufs, out)
        return self._graphs[(bb, tb)]

    @torch.inference_mode()
    def __call__(self, mel: torch.Tensor, source: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        b, _, t = mel.shape
        spf = self.hift.samples_per_frame
        if b > self.batch_buckets[-1]:
            return self.hift.decode(mel, source, lengths)
        bb = _pick(self.batch_buckets, b)
        tb = int(math.ceil(t / self.frame_bucket) * self.frame_bucket)
        g, bufs, out = self._graphs.get((bb, tb)) or self._capture(bb, tb, mel)
        bufs["mel"].zero_()
        bufs["mel"][:b, :, :t].copy_(mel)
        bufs["source"].zero_()
        bufs["source"][:b, :, : t * spf].copy_(source)
        bufs["lengths"].fill_(1)
        bufs["lengths"][:b].copy_(lengths)
        g.replay()
        return out[:b, : t * spf].clone()


class GraphedFlowSolver:
    """The flow's Euler/CFG solve (``CausalFlowMatching.solve``) as CUDA graphs.

    ``__call__(mu, mask, spks, cond, streaming)`` takes the eager solver's arguments
    (``[B, n_mels, T]``, ``[B, 1, T]``, ``[B, n_mels]``, ``[B, n_mels, T]``, ``[B]`` bool)
    and returns ``[B, n_mels, T]`` float32 (a fresh tensor).
    """

    def __init__(self, decoder, max_batch: int, frame_bucket: int = 64, max_graphs: int = 512):
        self.decoder = decoder
        self.batch_buckets = _pow2_buckets(max_batch)
        self.frame_bucket = frame_bucket
        self.max_graphs = max_graphs
        self.pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int], tuple] = {}

    @torch.inference_mode()
    def _capture(self, bb: int, tb: int, like: torch.Tensor):
        n_mels = like.shape[1]
        d, dt = like.device, like.dtype
        bufs = {"mu": torch.zeros(bb, n_mels, tb, device=d, dtype=dt),
                "mask": torch.zeros(bb, 1, tb, device=d, dtype=dt),
                "spks": torch.zeros(bb, n_mels, device=d, dtype=dt),
                "cond": torch.zeros(bb, n_mels, tb, device=d, dtype=dt),
                "streaming": torch.zeros(bb, dtype=torch.bool, device=d)}
        bufs["mask"][:, :, :1] = 1  # a valid frame per row during warm-up/capture

        def run():
            return self.decoder.solve(bufs["mu"], bufs["mask"], bufs["spks"], bufs["cond"], bufs["streaming"])

        g, out = _capture_graph(run, self.pool)
        if len(self._graphs) >= self.max_graphs:  # bound memory: drop the oldest graph
            self._graphs.pop(next(iter(self._graphs)))
        self._graphs[(bb, tb)] = (g, bufs, out)
        return self._graphs[(bb, tb)]

    @torch.inference_mode()
    def __call__(self, mu, mask, spks, cond, streaming) -> torch.Tensor:
        b, _, t = mu.shape
        bb = _pick(self.batch_buckets, b)
        tb = int(math.ceil(t / self.frame_bucket) * self.frame_bucket)
        if tb > self.decoder.rand_noise.size(-1):
            return self.decoder.solve(mu, mask, spks, cond, streaming)
        g, bufs, out = self._graphs.get((bb, tb)) or self._capture(bb, tb, mu)
        for k, v in (("mu", mu), ("mask", mask), ("cond", cond)):
            bufs[k].zero_()
            bufs[k][:b, :, :t].copy_(v)
        bufs["mask"][b:, :, :1] = 1
        bufs["spks"].zero_()
        bufs["spks"][:b].copy_(spks)
        bufs["streaming"].zero_()
        bufs["streaming"][:b].copy_(streaming)
        g.replay()
        return out[:b, :, :t].clone()

"""CUDA graphs for the launch-bound hot paths: the LM decode step, single-sequence prefill,
the flow (encoder + solve) and the HiFT decoder.

At serving batch sizes both are bound by kernel launches, not arithmetic (measured on an
H100: one eager Qwen2-0.5B decode step takes ~18 ms at batch 1 and at batch 64; one
10-step flow solve ~300 ms at batch 1 and at batch 32). Replaying a captured graph removes
the launch cost. Graphs need static shapes, so inputs are padded to buckets:

* :class:`GraphedDecoder` — batch buckets (1, 2, 4, ..., max) x KV-length buckets (512,
  1024, ..., cache length). Padding rows read/write a reserved *scratch* KV slot and are
  discarded. Attention covers the bucket's KV length with a mask (positions <= each row's
  position), so results equal :meth:`SpeechLM.forward_cached`'s.
* :class:`GraphedFlow` — encoder + solve, batch buckets x token buckets (multiples of 32
  tokens = 64 frames). Padded tokens and frames are masked, exactly like shorter items in an
  eager batch, so valid frames are unchanged (the flow's batched path is padding-safe and
  tested to be).

Graphs are captured lazily on first use of a bucket (a few hundred ms each) into one shared
memory pool; ``warmup()`` captures them ahead of time. Capture checks only the capturing
thread (``capture_error_mode="thread_local"``): the engine's token2wav thread captures flow
graphs while the scheduler thread keeps decoding (and synchronising) on its own stream.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from .llm import KVCache, SpeechLM
from .sampling import ras_sample_device
from .transfer import to_device


def _pow2_buckets(max_value: int) -> list[int]:
    out, b = [], 1
    while b < max_value:
        out.append(b)
        b *= 2
    out.append(max_value)
    return out


log = logging.getLogger(__name__)


def _capture_graph(run, pool, what: str = "graph", level: int = logging.DEBUG) -> tuple[torch.cuda.CUDAGraph, object]:
    """Warm ``run`` up twice on a side stream (lazy initialisation, cuFFT/cuBLAS plans), then
    capture it into a CUDA graph in ``pool``; returns ``(graph, run's output)``. Only the
    capturing thread is checked (``capture_error_mode="thread_local"``). Logs ``what`` and the
    time taken at ``level`` (buckets captured on first use: a capture while serving delays every
    stream by that much)."""
    t0 = time.perf_counter()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
        out = run()
    log.log(level, "captured %s in %.0f ms", what, (time.perf_counter() - t0) * 1e3)
    return g, out


def _remember(graphs: dict, key, entry, max_graphs: int):
    """Store a captured bucket's ``entry`` under ``key``, first dropping the oldest bucket when
    ``max_graphs`` are held (bounds graph memory); returns ``entry``."""
    if len(graphs) >= max_graphs:
        graphs.pop(next(iter(graphs)))
    graphs[key] = entry
    return entry


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

    With ``sampling`` (a :class:`~cosyserve.models.config.SamplingConfig`) the graph also
    samples the next token of every row (:func:`~cosyserve.models.sampling.ras_sample_device`);
    call :meth:`sample` with the rows' recent tokens, seeds, steps and EOS masks to get
    ``(log-probs, tokens [B] int64)``.
    """

    def __init__(self, lm: SpeechLM, cache: KVCache, max_batch: int, kv_buckets: list[int] | None = None,
                 sampling=None, eos_id: int | None = None):
        self.lm = lm
        self.sampling, self.eos_id = sampling, eos_id
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
            if self.sampling is not None:
                w = max(1, self.sampling.win_size)
                self._bufs[bb].update(recent=torch.full((bb, w), -1, dtype=torch.long, device=d),
                                      seed=torch.zeros(bb, dtype=torch.long, device=d),
                                      step=torch.zeros(bb, dtype=torch.long, device=d),
                                      ignore_eos=torch.zeros(bb, dtype=torch.bool, device=d))
        return self._bufs[bb]

    def _step(self, buf: dict[str, torch.Tensor], kv_len: int):
        emb = self.lm.embed_speech(buf["tokens"][:, None])
        h = self.lm.forward_cached(emb, self.cache, buf["slots"], buf["start"], kv_len=kv_len)[:, -1]
        logp = self.lm.logprobs(h)
        if self.sampling is None:
            return logp
        return logp, ras_sample_device(logp, buf["recent"], buf["seed"], buf["step"], buf["ignore_eos"],
                                       self.sampling, self.eos_id)

    @torch.inference_mode()
    def _capture(self, bb: int, kvb: int):
        buf = self._buffers(bb)
        buf["slots"].fill_(self.scratch)
        buf["start"].zero_()
        g, out = _capture_graph(lambda: self._step(buf, kvb), self.pool, f"LM decode graph batch {bb} x {kvb} KV")
        self._graphs[(bb, kvb)] = (g, out)
        return g, out

    def warmup(self) -> None:
        for bb in self.batch_buckets:
            for kvb in self.kv_buckets:
                if (bb, kvb) not in self._graphs:
                    self._capture(bb, kvb)

    @torch.inference_mode()
    def sample(self, tokens: torch.Tensor, slots: torch.Tensor, start: torch.Tensor, recent: torch.Tensor,
               seed: torch.Tensor, step: torch.Tensor, ignore_eos: torch.Tensor):
        """One step that also samples: ``recent [B, win_size]`` int64 (-1 padded), ``seed``,
        ``step`` int64 ``[B]``, ``ignore_eos`` bool ``[B]`` (CPU or device) -> ``(log-probs
        [B, S+3], tokens [B])``, views into static buffers."""
        if self.sampling is None:
            raise RuntimeError("this GraphedDecoder was built without sampling")
        n = int(tokens.numel())
        buf = self._buffers(_pick(self.batch_buckets, n))
        for name, val in (("recent", recent), ("seed", seed), ("step", step), ("ignore_eos", ignore_eos)):
            buf[name][:n].copy_(val, non_blocking=True)
        logp, toks = self._run(tokens, slots, start)
        return logp[:n], toks[:n]

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, slots: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        out = self._run(tokens, slots, start)
        return (out[0] if self.sampling is not None else out)[: int(tokens.numel())]

    def _run(self, tokens: torch.Tensor, slots: torch.Tensor, start: torch.Tensor):
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
        return out


class GraphedPrefill:
    """Prefill of newcomers as CUDA graphs, one per (batch bucket, length bucket): batches of
    ``1, 2, 4, ... max_batch`` sequences x multiples of ``bucket`` positions up to ``max_len``.

    ``__call__(embeds [B, T, H], slots [B])`` writes positions ``0 .. T-1`` of each row's slot
    in ``cache`` and returns the final hidden states ``[B, T, H]`` (a view into a static
    buffer: use it before the next call), or None when the batch or ``T`` exceeds the largest
    bucket (prefill eagerly). Rows are right-padded as in the engine's eager batched prefill:
    positions past a row's length get junk K/V past the sequence, which decoding overwrites
    before any query can attend to them (causal attention); padding rows of a batch bucket
    read and write the scratch slot. Single-sequence graphs are captured by :meth:`warmup`,
    batched ones on first use (at most ``max_graphs`` kept).
    """

    def __init__(self, lm: SpeechLM, cache: KVCache, bucket: int = 64, max_len: int = 1024, pool=None,
                 max_batch: int = 1, max_graphs: int = 64):
        self.lm, self.cache = lm, cache
        self.buckets = list(range(bucket, min(max_len, cache.max_len) + 1, bucket))
        self.batch_buckets = _pow2_buckets(max(1, max_batch))
        self.max_graphs = max(max_graphs, len(self.buckets))
        self.scratch = cache.n_slots - 1
        self.device = cache.k.device
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int], tuple] = {}

    @torch.inference_mode()
    def _capture(self, bb: int, tb: int):
        lm = self.lm
        dtype = lm.llm_decoder.weight.dtype
        bufs = {"emb": torch.zeros(bb, tb, lm.qwen_config.hidden_size, device=self.device, dtype=dtype),
                "slot": torch.full((bb,), self.scratch, dtype=torch.long, device=self.device),
                "start": torch.zeros(bb, dtype=torch.long, device=self.device)}

        def run():
            return lm.forward_cached(bufs["emb"], self.cache, bufs["slot"], bufs["start"], kv_len=tb)

        g, out = _capture_graph(run, self.pool, f"LM prefill graph batch {bb} x {tb} positions",
                                logging.INFO if bb > 1 else logging.DEBUG)
        return _remember(self._graphs, (bb, tb), (g, bufs, out), self.max_graphs)

    def warmup(self) -> None:
        for tb in self.buckets:
            if (1, tb) not in self._graphs:
                self._capture(1, tb)

    @torch.inference_mode()
    def __call__(self, embeds: torch.Tensor, slots) -> torch.Tensor | None:
        n, t = embeds.shape[:2]
        if not self.buckets or t > self.buckets[-1] or n > self.batch_buckets[-1]:
            return None
        bb, tb = _pick(self.batch_buckets, n), _pick(self.buckets, t)
        g, bufs, out = self._graphs.get((bb, tb)) or self._capture(bb, tb)
        bufs["emb"][:n, :t].copy_(embeds)
        if t < tb:
            bufs["emb"][:n, t:].zero_()
        bufs["slot"][:n].copy_(to_device(torch.as_tensor(slots, dtype=torch.long).reshape(-1), self.device))
        if n < bb:
            bufs["slot"][n:].fill_(self.scratch)
        g.replay()
        return out[:n, :t]


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

        g, out = _capture_graph(run, self.pool, f"HiFT decoder graph batch {bb} x {tb} frames", logging.INFO)
        return _remember(self._graphs, (bb, tb), (g, bufs, out), self.max_graphs)

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


class GraphedFlow:
    """The whole flow of a token2wav batch — token embedding, conformer encoder, projections and
    the 10-step CFG Euler solve — as CUDA graphs per batch bucket x token bucket (multiples of
    ``token_bucket`` tokens; mel frames = ``token_mel_ratio`` x tokens): one *begin* graph
    (:meth:`FlowModel.encode` + ``CausalFlowMatching.begin``) and one *step* graph (one Euler
    step, in place) replayed ``n_timesteps`` times.

    Why a graph per step rather than one for the whole solve: a graph of ~11 000 kernels does not
    fit the stream's launch queue, so ``cudaGraphLaunch`` would hold the calling thread until
    the GPU had worked through most of it (measured: 85 ms of host time for a 16-item batch,
    docs/perf.md run 10); issued step by step, the caller never waits.

    :meth:`start` takes a :class:`~cosyserve.models.flow.FlowInputs` (host tensors) and returns
    a :class:`~cosyserve.models.flow.FlowRun` (or None when the batch exceeds every bucket: run
    it eagerly). Padding is exactly the eager batch's: padded tokens, positions and frames are
    masked per item (the encoder and estimator are padding-safe, tested), so valid frames equal
    the eager result up to float rounding of differently shaped kernels; padding rows hold one
    token. Inputs reach the graph's buffers through pinned memory (no host waits). One batch per
    bucket may be in flight at a time (the buffers are the bucket's).
    """

    def __init__(self, flow, max_batch: int, token_bucket: int = 32, max_graphs: int = 256, pool=None):
        self.flow = flow
        self.batch_buckets = _pow2_buckets(max_batch)
        self.token_bucket = token_bucket
        self.max_graphs = max_graphs
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int], tuple] = {}

    @torch.inference_mode()
    def _capture(self, bb: int, lb: int):
        flow = self.flow
        bufs = flow_buffers(flow, bb, lb, flow.encoder_proj.weight.device)
        g_begin, state = _capture_graph(lambda: flow_begin_from_buffers(flow, bufs), self.pool,
                                        f"flow begin graph batch {bb} x {lb} tokens", logging.INFO)
        g_begin.replay()  # real values in the state before the step is warmed up and captured
        g_step, _ = _capture_graph(lambda: flow.decoder.step(state), self.pool,
                                   f"flow step graph batch {bb} x {lb} tokens", logging.INFO)
        return _remember(self._graphs, (bb, lb), (g_begin, g_step, bufs, state), self.max_graphs)

    def buckets(self, n_items: int, n_tokens: int) -> tuple[int, int] | None:
        """The (batch, tokens) bucket of a batch, or None if it is larger than any bucket
        (or than the fixed noise buffer): such batches run eagerly."""
        if n_items > self.batch_buckets[-1]:
            return None
        lb = int(math.ceil(n_tokens / self.token_bucket) * self.token_bucket)
        if self.flow.token_mel_ratio * lb > self.flow.rand_noise.size(-1):
            return None
        return _pick(self.batch_buckets, n_items), lb

    @torch.inference_mode()
    def start(self, inputs):
        """Fill the bucket's buffers and replay its begin graph; None if no bucket fits."""
        from .flow import FlowRun

        key = self.buckets(*inputs.ids.shape)
        if key is None:
            return None
        g_begin, g_step, bufs, state = self._graphs.get(key) or self._capture(*key)
        fill_flow_buffers(bufs, inputs, self.flow.token_mel_ratio)
        g_begin.replay()
        return FlowRun(g_step.replay, state, inputs)

    @torch.inference_mode()
    def __call__(self, inputs) -> torch.Tensor:
        """All steps at once: ``[B, n_mels, T]`` float32 (``T`` = the bucket's frames; eager
        beyond the buckets)."""
        run = self.start(inputs)
        if run is None:
            return self.flow.solve(self.flow.condition_inputs(inputs))
        while run.steps_left:
            run.step()
        return run.state.mels(inputs.ids.shape[0])


def flow_buffers(flow, bb: int, lb: int, device) -> dict[str, torch.Tensor]:
    """Static inputs of a :class:`GraphedFlow` bucket: ``bb`` rows of ``lb`` tokens
    (``token_mel_ratio * lb`` frames), on ``device``."""
    t = flow.token_mel_ratio * lb
    lengths = torch.ones(3, bb, dtype=torch.long, device=device)
    lengths[2] = flow.token_mel_ratio
    return {"ids": torch.zeros(bb, lb, dtype=torch.long, device=device), "lengths": lengths,
            "streaming": torch.zeros(bb, dtype=torch.bool, device=device),
            "embeddings": torch.zeros(bb, flow.cfg.spk_embed_dim, device=device),
            "feats": torch.zeros(bb, t, flow.n_mels, device=device)}


def fill_flow_buffers(bufs: dict[str, torch.Tensor], inputs, ratio: int) -> None:
    """Copy a :class:`~cosyserve.models.flow.FlowInputs` batch into bucket buffers (pinned,
    asynchronous); rows past the batch become one-token padding items (1 token, 1 encoder
    position, ``ratio`` frames), positions past each item are zero and masked."""
    b, n_tok = inputs.ids.shape
    d = bufs["ids"].device
    bufs["ids"].zero_()
    bufs["ids"][:b, :n_tok].copy_(to_device(inputs.ids, d))
    bufs["lengths"].fill_(1)
    bufs["lengths"][2].fill_(ratio)
    bufs["lengths"][:, :b].copy_(to_device(inputs.lengths, d))
    bufs["streaming"].zero_()
    bufs["streaming"][:b].copy_(to_device(inputs.streaming, d))
    bufs["embeddings"].zero_()
    bufs["embeddings"][:b].copy_(to_device(inputs.embeddings, d))
    bufs["feats"].zero_()
    bufs["feats"][:b, : inputs.feats.shape[1]].copy_(to_device(inputs.feats, d))


def flow_begin_from_buffers(flow, bufs: dict[str, torch.Tensor]):
    """What a :class:`GraphedFlow` begin graph computes: :meth:`FlowModel.encode` over the whole
    bucket (``max_encoder_len`` = the bucket's tokens) and the solver's set-up -> its
    :class:`~cosyserve.models.flow.SolverState`."""
    _, mu, spks, cond, mask = flow.encode(bufs["ids"], bufs["lengths"], bufs["streaming"], bufs["embeddings"],
                                          bufs["feats"], bufs["ids"].shape[1])
    return flow.decoder.begin(mu, mask, spks, cond, bufs["streaming"])


def flow_from_buffers(flow, bufs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Begin + all Euler steps over bucket buffers (eagerly) -> ``[bb, n_mels, T]`` float32: what
    the graphs of a :class:`GraphedFlow` bucket compute together."""
    state = flow_begin_from_buffers(flow, bufs)
    for _ in range(state.n):
        flow.decoder.step(state)
    return state.mels()

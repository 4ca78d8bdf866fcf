"""CUDA graphs for the launch-bound hot paths: the LM decode step and prefill, the flow
(encoder + solve) and the HiFT decoder.

At serving batch sizes these are bound by kernel launches, not arithmetic (measured on an
H100: one eager Qwen2-0.5B decode step takes ~18 ms at batch 1 and at batch 64; one
10-step flow solve ~300 ms at batch 1 and at batch 32). Replaying a captured graph removes
the launch cost. Graphs need static shapes, so inputs are padded to buckets:

* :class:`GraphedDecoder` — batch buckets (1, 2, 4, ..., max) x KV-length buckets (256, 512,
  ..., cache length). Row ``r`` of a bucket decodes KV slot ``r`` (the cache is read as a
  view, not gathered); rows of slots not decoding are idle and discarded. Attention covers
  the bucket's KV length with a mask (positions <= each row's position), so results equal
  :meth:`SpeechLM.forward_cached`'s.
* :class:`GraphedPrefill`, :class:`GraphedFlow`, :class:`GraphedHiFTDecoder` — a
  :class:`BucketGrid` each: batch buckets x length buckets (:func:`length_buckets`: fine
  steps for short inputs, then ~1.25x apart). Padded positions, frames and rows are masked,
  exactly like shorter items in an eager batch, so valid outputs are unchanged (the batched
  paths are padding-safe and tested to be).

A capture costs 0.1-0.4 s of host time; a full-size grid took ~136 s to capture before the
server was ready (docs/perf.md, run 36). So by default the engine captures in the background
(:class:`BackgroundCapturer`, one thread, started when the engine starts serving): every batch
whose bucket has no published graph yet runs eagerly, with the same numerics, and each graph is
published atomically once complete (:class:`_GraphStage`); the LM decode graphs come first. No
capture ever happens on a serving thread then. ``graph_capture="startup"`` captures everything
before serving instead (``warmup()``: the grids are bounded by the engine's per-batch budgets,
:meth:`BucketGrid.reachable`); a bucket used before it was captured when nothing captures in the
background (``--lazy-graphs``) is captured then, on the serving thread (the 0.1-0.4 s stall).
All graphs of one stage share a memory pool. Capture checks only the capturing thread
(``capture_error_mode="thread_local"``) on non-blocking capture streams, so other threads keep
launching and replaying meanwhile.
"""

from __future__ import annotations

import collections
import logging
import math
import sys
import threading
import time
from dataclasses import replace

import numpy as np
import torch

from . import fused
from .capture import CAPTURE_LOCK, end_failed_capture, live_pool
from .llm import DecodeState, KVCache, SpeechLM
from .transfer import to_device


def _pow2_buckets(max_value: int) -> list[int]:
    out, b = [], 1
    while b < max_value:
        out.append(b)
        b *= 2
    out.append(max_value)
    return out


def half_octave_buckets(max_value: int) -> list[int]:
    """Batch buckets ``1, 2, 4, 6, 8, 12, 16, 24, ...``: the powers of two and, from 6 on, 1.5x
    a power of two, ending with ``max_value``. A batch past 4 rows is padded to less than 1.5x its
    rows (powers of two alone: almost 2x, e.g. 9 jobs in a 16-row bucket), for about 1.6x as many
    buckets. The token2wav stages use these: their cost grows with the padded rows, and their
    batches of offline utterances rarely fill a power of two (docs/perf.md, run 34)."""
    if max_value < 1:
        raise ValueError("max_value must be positive")
    out, b = [], 1
    while b < max_value:
        out.append(b)
        if b >= 4 and b * 3 // 2 < max_value:
            out.append(b * 3 // 2)
        b *= 2
    out.append(max_value)
    return out


log = logging.getLogger(__name__)


def length_buckets(step: int, max_len: int, growth: float = 1.25, fine: int = 8) -> list[int]:
    """Length buckets: the first ``fine`` multiples of ``step``, then each bucket about ``growth``
    times the previous one (rounded up to a multiple of ``step``), ending with ``max_len``
    rounded up to ``step``. Padding to the next bucket wastes at most ``growth - 1`` of the
    work past the fine range, while the number of buckets (graphs to capture) grows only
    logarithmically with ``max_len``."""
    if step < 1 or max_len < 1:
        raise ValueError("step and max_len must be positive")
    out, b = [], step
    top = -(-max_len // step) * step
    while b < top:
        out.append(b)
        b = b + step if len(out) < fine else max(-(-int(b * growth) // step) * step, b + step)
    out.append(top)
    return out


def within_budgets(rows: int, length: int, max_area: int | None = None, max_quad: int | None = None) -> bool:
    """``rows x length <= max_area`` and ``rows x length² <= max_quad`` (attention memory);
    ``None``: no bound. The batch budgets of the engine and of :class:`BucketGrid`."""
    return (max_area is None or rows * length <= max_area) and (max_quad is None or rows * length * length <= max_quad)


class BucketGrid:
    """The static shapes of a graphed stage: batch buckets x length buckets.

    :meth:`pick` maps a batch of ``n`` rows of length ``t`` to the smallest bucket holding it;
    :meth:`fits` says whether that bucket is within the budgets: ``rows x length <= max_area``
    and ``rows x length² <= max_quad`` (attention memory) for the padded shape, or one row of
    any length. :meth:`reachable` lists the buckets that fit — what ``warmup`` captures, so
    that no graph is captured while serving batches that the caller keeps within
    :meth:`fits`.
    """

    def __init__(self, batches: list[int], lengths: list[int], max_area: int | None = None,
                 max_quad: int | None = None):
        self.batches, self.lengths, self.max_area, self.max_quad = list(batches), list(lengths), max_area, max_quad

    def pick(self, n: int, t: int) -> tuple[int, int] | None:
        """``(batch bucket, length bucket)`` of ``n`` rows x ``t`` positions; None beyond the grid."""
        if n > self.batches[-1] or t > self.lengths[-1]:
            return None
        return _pick(self.batches, n), _pick(self.lengths, t)

    def within(self, bb: int, lb: int) -> bool:
        """Is a bucket (padded shape) within the budgets? One row always is."""
        return bb == 1 or within_budgets(bb, lb, self.max_area, self.max_quad)

    def fits(self, n: int, t: int) -> bool:
        """Does a batch of ``n`` rows x ``t`` land in a bucket within the budgets?"""
        key = self.pick(n, t)
        return key is not None and self.within(*key)

    def length(self, t: int) -> int:
        """The length bucket of ``t`` (``t`` itself beyond the grid)."""
        return _pick(self.lengths, t) if t <= self.lengths[-1] else t

    def reachable(self) -> list[tuple[int, int]]:
        """Every bucket within the budgets (:meth:`within`)."""
        return [(bb, lb) for bb in self.batches for lb in self.lengths if self.within(bb, lb)]


    def max_units(self) -> int:
        """The largest ``batch x length`` of a reachable bucket (what shared buffers hold)."""
        return max(bb * lb for bb, lb in self.reachable())


class SharedBuffers:
    """Static tensors shared by every bucket of one graphed stage.

    Each named buffer is one flat allocation sized for the stage's largest bucket
    (``max_units`` = batch x length, :meth:`BucketGrid.max_units`); a bucket's tensor is a view
    of its start, so graph inputs, the state kept between graphs and graph outputs cost the
    largest bucket's memory once instead of once per bucket (a full flow grid would otherwise
    hold ~3 GB of them). Safe because a stage runs one batch at a time, in stream order.
    """

    def __init__(self, max_units: int, device):
        self.max_units, self.device = max_units, device
        self._flat: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape, dtype: torch.dtype, units: int) -> torch.Tensor:
        """A zeroed-at-allocation view ``shape`` of buffer ``name`` for a bucket of ``units``
        (batch x length; sizes scale with it). A tensor that does not fit (another dtype, or
        a shape not proportional to ``units``) gets its own allocation."""
        numel = math.prod(shape)
        flat = self._flat.get(name)
        if flat is None:
            cap = max(numel, -(-numel * self.max_units // max(1, units)))
            flat = self._flat[name] = torch.zeros(cap, dtype=dtype, device=self.device)
        if flat.dtype != dtype or numel > flat.numel():
            return torch.zeros(shape, dtype=dtype, device=self.device)
        return flat[:numel].view(shape)

    def share(self, name: str, t: torch.Tensor, units: int) -> torch.Tensor:
        """``t`` copied into buffer ``name`` (see :meth:`take`); returns the view."""
        out = self.take(name, t.shape, t.dtype, units)
        out.copy_(t)
        return out

    @property
    def nbytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self._flat.values())


def capture_stream(device, non_blocking: bool = False) -> torch.cuda.Stream:
    """A CUDA stream of its own for capturing one stage's graphs.

    Graphs captured on the same stream by the same thread share torch's cuBLAS workspace (it
    is kept per (cuBLAS handle, stream), and a captured GEMM keeps its address). Replayed
    concurrently on different streams — the LM's graphs on the LM stream, the flow's and
    HiFT's on the token2wav stream — such graphs race on that workspace: at full size the GPU
    stopped (docs/perf-history.md run 21 and "Runs 23–26"; pytorch/pytorch#193402 describes the same sharing).
    So every graphed stage captures on a stream of its own. ``torch.cuda.Stream()`` hands out
    streams from a pool of 32 round-robin, so two stages could get the same one; the stream
    is created with ``cudaStreamCreate`` instead (``torch.cuda.Stream()`` only where the
    runtime binding is missing).

    ``non_blocking``: create it with ``cudaStreamNonBlocking``, so it never synchronises
    implicitly with the legacy default stream. The graphed stages capture on such streams: a
    capture runs in a background thread while serving threads may launch work on the legacy
    default stream, and that implicit synchronisation with a capturing stream would invalidate
    the capture (``cudaErrorStreamCaptureImplicit``)."""
    import ctypes

    device = torch.device(device)
    try:
        handle = ctypes.c_void_p()
        with torch.cuda.device(device):
            rt = torch.cuda.cudart()
            if not non_blocking:
                torch.cuda.check_error(rt.cudaStreamCreate(ctypes.addressof(handle)))
            elif hasattr(rt, "cudaStreamCreateWithFlags"):  # a torch build that binds it
                torch.cuda.check_error(rt.cudaStreamCreateWithFlags(ctypes.addressof(handle), 1))
            else:  # 1 = cudaStreamNonBlocking
                err = _loaded_cudart().cudaStreamCreateWithFlags(ctypes.byref(handle), ctypes.c_uint(1))
                if err != 0:
                    raise OSError(f"cudaStreamCreateWithFlags failed with CUDA error {err}")
        return torch.cuda.ExternalStream(handle.value, device=device)
    except (AttributeError, TypeError, OSError):
        # torch's pool streams are non-blocking too, but handed out round-robin (see above)
        log.warning("cudaStreamCreate%s not available: capture stream from torch's stream pool",
                    "WithFlags" if non_blocking else "")
        return torch.cuda.Stream(device=device)


def _loaded_cudart():
    """The CUDA runtime shared library this process has loaded (torch's: a stream must belong
    to its context), through ctypes. Raises AttributeError when none is loaded (a statically
    linked runtime) and OSError when it cannot be opened."""
    import ctypes

    with open("/proc/self/maps") as maps:
        paths = sorted({ln.split()[-1] for ln in maps if "/libcudart.so" in ln})
    if not paths:
        raise AttributeError("no shared CUDA runtime library is loaded")
    return ctypes.CDLL(paths[0])


def _capture_graph(run, pool, stream: torch.cuda.Stream, what: str = "graph",
                   level: int = logging.DEBUG) -> tuple[torch.cuda.CUDAGraph, object]:
    """Run ``run`` once on ``stream`` (lazy initialisation: cuFFT/cuBLAS plans, derived and
    fused weights), then capture it on ``stream`` (the stage's own: :func:`capture_stream`)
    into a CUDA graph in ``pool``; returns ``(graph, run's output)``. Only the capturing
    thread is checked (``capture_error_mode="thread_local"``). Logs ``what`` and the time
    taken at ``level`` (a capture while serving delays every stream by that much: INFO for
    buckets captured on first use)."""
    t0 = time.perf_counter()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    prev = torch.cuda.current_stream(stream.device)
    try:
        with torch.cuda.graph(g, pool=pool, stream=stream, capture_error_mode="thread_local"):
            out = run()
    except BaseException:
        torch.cuda.set_stream(prev)  # torch.cuda.graph's exit raised before leaving ``stream``
        end_failed_capture(stream.device, pool)  # else every later capture into ``pool`` fails
        raise
    log.log(level, "captured %s in %.0f ms", what, (time.perf_counter() - t0) * 1e3)
    return g, out


def _record(run, pool, stream, settle_first: bool = True) -> tuple:
    """Capture ``run`` into a CUDA graph in ``pool`` on ``stream`` without running it; returns
    ``(graph, run's output)`` (static tensors the replays rewrite). Only the capturing thread is
    checked (``capture_error_mode="thread_local"``), so other threads keep launching eager work
    and replaying graphs on their own streams during the capture.

    ``settle_first``: first wait for the whole device and return cached memory to the driver,
    as ``torch.cuda.graph`` does (captures before serving). A background capture skips both: a
    device-wide wait would only delay the capture, but emptying the allocator's cache would make
    the serving threads' next allocations ``cudaMalloc`` again (a stall on their side).
    A run that raises ends the capture (its error is the one raised); a capture that CUDA reports
    invalid at its end (e.g. another thread synchronised the device meanwhile) raises too, and in both
    cases :func:`~cosyserve.models.capture.end_failed_capture` retires the pool (stages then capture
    into its successor, :func:`~cosyserve.models.capture.live_pool`) and restores the default
    generator."""
    if settle_first:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        if hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        g.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            out = run()
        except BaseException:
            try:
                g.capture_end()
            except Exception:  # noqa: BLE001 - the capture is invalid anyway; report run's error
                end_failed_capture(stream.device, pool)
            raise
        try:
            g.capture_end()
        except BaseException:  # invalidated meanwhile: the pool must stop recording all the same
            end_failed_capture(stream.device, pool)
            raise
    return g, out


#: one capture at a time in the process (stages may share a memory pool; a capture before serving
#: empties the allocator's cache, which torch forbids while any thread captures; other threads ask it
#: whether a capture is under way): :mod:`~cosyserve.models.capture`. Every capture in cosyserve holds it.
_CAPTURE_LOCK = CAPTURE_LOCK


class _GraphStage:
    """The bucket table of one graphed stage and how a bucket gets captured and published.

    A bucket's graph is captured by :meth:`capture`: an eager *warm-up* run of the bucket's
    shapes on private, freshly allocated inputs (lazy initialisation: cuBLAS/cuDNN plans, fused
    kernels compiled for the shapes; it never writes a tensor that a published graph or the
    serving path uses), then the *recording* (nothing runs) on the stage's capture stream over
    the stage's static buffers, then a wait for the capturing thread's streams, and only then
    is the graph *published*: one dict assignment, atomic for the serving thread, which uses a
    bucket's graph only once it is in the table and runs that batch eagerly otherwise (the
    same numerics: graphs pad exactly as eager batches do). Warm-ups run on the capturing
    thread's current stream, never on the capture stream: torch keeps one cuBLAS workspace per
    (thread's handle, stream), captured GEMMs keep its address, and a warm-up there would race
    with replays of the stage's graphs. Only a thread's first capture of the stage runs one
    warm-up of the smallest bucket on the capture stream, before any graph of that thread uses
    it, so that the workspace is created outside a capture.

    ``capture_on_use``: a bucket used before it was captured is captured then, on the serving
    thread (``--lazy-graphs``; the 0.1-0.4 s stall). False while a
    :class:`BackgroundCapturer` owns the stage: such batches run eagerly. A bucket whose
    capture raised is *disabled* (:meth:`disable`): its batches always run eagerly.
    Subclasses implement :meth:`keys`, :meth:`_warm_up` and :meth:`_record_entry`."""

    name = "stage"
    #: a BackgroundCapturer may capture the buckets serving runs eagerly before the planned order
    #: (False where the capture order sizes memory, e.g. storage that grows with each larger bucket)
    demand_first = True

    def _init_stage(self, device, pool=None) -> None:
        self.device = torch.device(device)
        self._pool = pool
        self._stream = None
        self._stream_ready: set[int] = set()  # threads that initialised the capture stream
        self._warmed: set = set()  # buckets warmed up already (BackgroundCapturer's priming)
        self._graphs: dict = {}
        self._failed: dict = {}  # key -> the capture's error text
        self.capture_on_use = True
        self.capture_s = 0.0  # seconds spent in captures (warm-up + recording + settling)
        # eager runs per bucket not captured yet (lookup misses), which a BackgroundCapturer
        # captures first; counted by the serving threads without a lock (approximate is enough)
        self.misses: collections.Counter = collections.Counter()

    @property
    def pool(self):
        """The stage's CUDA graph memory pool (created on first use; None off CUDA)."""
        if self._pool is None and self.device.type == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
        self._pool = live_pool(self._pool)  # a fresh one after a failed capture (capture.end_failed_capture)
        return self._pool

    @property
    def stream(self) -> torch.cuda.Stream:
        """The stage's capture stream (:func:`capture_stream`, non-blocking; never shared; None
        off CUDA)."""
        if self._stream is None and self.device.type == "cuda":
            self._stream = capture_stream(self.device, non_blocking=True)
        return self._stream

    def keys(self) -> list:
        """Every bucket the stage captures when warmed up."""
        raise NotImplementedError

    def order(self, keys: list) -> list:
        """``keys`` in capture order (default: as given)."""
        return list(keys)

    def pending(self) -> list:
        """Buckets neither captured nor disabled, in capture order."""
        return [k for k in self.order(self.keys()) if k not in self._graphs and k not in self._failed]

    def _warm_up(self, *key) -> None:
        raise NotImplementedError

    def _record_entry(self, key, background: bool) -> tuple:
        raise NotImplementedError

    def capture(self, key, background: bool = False, level: int = logging.DEBUG):
        """Capture and publish the graph(s) of bucket ``key`` (see the class doc); returns the
        table entry. ``background``: serving goes on meanwhile (no device-wide wait, no cache
        emptying: :func:`_record`). Raises whatever the warm-up or the capture raised (the
        bucket is then not published)."""
        with _CAPTURE_LOCK:
            got = self._graphs.get(key)
            if got is not None:
                return got
            t0 = time.perf_counter()
            if self.device.type == "cuda":
                cur = torch.cuda.current_stream(self.device)
                me = threading.get_ident()
                if me not in self._stream_ready:
                    # this thread's first use of the capture stream: torch creates the cuBLAS
                    # workspace of (this thread's handle, the stream) now, outside any capture and
                    # before any graph of it exists; the smallest bucket keeps that cheap
                    self.stream.wait_stream(cur)
                    with torch.cuda.stream(self.stream):
                        self._warm_up(*min(self.keys() or [key], key=self._size))
                    cur.wait_stream(self.stream)
                    self._stream_ready.add(me)
                if key not in self._warmed:  # primed buckets are warm already
                    self._warm_up(*key)  # on this thread's stream, whose cached blocks the next one reuses
                entry = self._record_entry(key, background)
                cur.synchronize()  # every input written before anyone replays the graph
            else:  # CPU: the bookkeeping only (tests substitute _record)
                if key not in self._warmed:
                    self._warm_up(*key)
                entry = self._record_entry(key, background)
            self._graphs[key] = entry  # published
            dt = time.perf_counter() - t0
            self.capture_s += dt
        log.log(level, "captured %s graph %s in %.0f ms", self.name, "x".join(map(str, key)), dt * 1e3)
        return entry

    def _size(self, key) -> float:
        """The work of a bucket (rows x length), which orders captures."""
        return math.prod(key)

    def lookup(self, key):
        """The published entry of ``key``; None when it is not (yet) captured: run eagerly.
        With :attr:`capture_on_use` a bucket not disabled is captured now (logged at INFO)."""
        got = self._graphs.get(key)
        if got is None:
            if self.capture_on_use and key not in self._failed:
                return self.capture(key, level=logging.INFO)
            self.misses[key] += 1
        return got

    def disable(self, key, error: BaseException | str) -> None:
        """Never capture ``key`` (its capture failed with ``error``): its batches run eagerly."""
        self._failed[key] = str(error)

    def warmup(self) -> None:
        """Capture every pending bucket now, in :meth:`order`; logs the count, the seconds taken
        and the device memory the graphs hold. A failing capture raises."""
        todo = self.pending()
        if not todo:
            return
        t0 = time.perf_counter()
        m0 = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0
        for key in todo:
            self.capture(key)
        m1 = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0
        log.info("captured %d %s graph buckets in %.1f s (device memory reserved +%.2f GB)", len(todo), self.name,
                 time.perf_counter() - t0, (m1 - m0) / 2**30)

    @property
    def n_graphs(self) -> int:
        """Buckets captured so far."""
        return len(self._graphs)

    @property
    def n_failed(self) -> int:
        """Buckets disabled because their capture failed."""
        return len(self._failed)


class BackgroundCapturer:
    """Captures the pending buckets of graphed stages (:class:`_GraphStage`) in one thread of
    its own while the engine serves, so the server is ready before its graphs are.

    Order: first, before every capture, the pending bucket that serving has run eagerly most
    often so far (:attr:`_GraphStage.misses`; stages with ``demand_first``), so what the traffic
    of the moment uses gets its graph first (measured on the H100: the eager flow of the first
    requests competed with the capture thread's compiles for the GIL, docs/perf.md "Session 24");
    then the plan: ``groups`` one after the other (the engine: the LM decode step first, since every
    token runs it, then prefill, HiFT and flow); within a group the stages take turns, each in
    its own :meth:`_GraphStage.order` (the largest bucket first, for memory, then the buckets a
    lone stream uses: few rows, short lengths). Each capture publishes its bucket atomically
    when it is complete (:meth:`_GraphStage.capture`); until then the serving threads run that
    bucket's batches eagerly — :meth:`start` turns the stages' ``capture_on_use`` off, so no
    capture ever happens on a serving thread. A capture that raises is logged and disables that
    bucket only (:meth:`_GraphStage.disable`); the others go on.

    Fused kernels (:mod:`~cosyserve.models.fused`): while the thread runs, it alone compiles and
    runs them (:func:`~cosyserve.models.fused.compile_only_on`); serving threads run their eager
    formulas, so they never stall on a compile (seconds) nor synchronise the device under a capture.
    Each variant is compiled by the warm-up of the first bucket that needs it. *Priming*
    (``prime=True``; the engine primes with ``--graph-priming``): first one eager warm-up of the smallest bucket with one
    and with two rows per stage, which compiles the fused kernels (one variant for one row, one for
    more; those buckets' captures then skip their warm-up); :meth:`wait_primed` waits for it, so
    that nothing compiles once serving starts (shorter first chunks right after ready, ~20 s later
    ready on an H100: docs/perf.md "Session 24"; without it the demand-first order below keeps the
    first chunks at most ~3 s).

    Concurrency with serving (what CUDA and torch allow next to a capture in another thread):
    captures use ``capture_error_mode="thread_local"`` on non-blocking capture streams
    (:func:`capture_stream`), never wait for the whole device nor empty the allocator's cache
    (:func:`_record`), and warm up on private inputs (:class:`_GraphStage`), so the serving
    threads' eager work, graph replays and host waits are unaffected. The serving path must not
    draw from torch's default CUDA generator (a capture registers it); cosyserve's does not.

    GIL: while the thread runs, the interpreter's switch interval is :attr:`switch_interval_s`
    (0.2 ms instead of 5 ms), so a serving thread that released the GIL around a torch op or a graph
    replay gets it back quickly while this thread runs Python (Dynamo, Inductor, capture bookkeeping).

    ``pause_s``: a sleep between captures (gives the GIL and the GPU back to serving; 0 = none).
    Counts: :attr:`captured`, :attr:`failed`, :attr:`pending`, :attr:`capture_s` (seconds in
    captures), :attr:`wall_s` (first capture to last, once done). Source: the design of
    issue 18 (start-up <= 30 s); CUDA's stream-capture modes (CUDA programming guide, "CUDA
    Graphs"; torch.cuda.graph's ``capture_error_mode``).
    """

    #: consecutive failed captures after which the loop gives up (a sticky CUDA error fails them all)
    max_failures_in_a_row = 5
    #: the interpreter's GIL switch interval (seconds) while the thread runs (see ``_main``)
    switch_interval_s = 2e-4

    def __init__(self, groups: list[list[_GraphStage]], device=None, pause_s: float = 0.0, prime: bool = False):
        self.groups = [list(g) for g in groups if g]
        self.stages = [s for g in self.groups for s in g]
        self.device = None if device is None else torch.device(device)
        self.pause_s, self.prime = pause_s, prime
        self._stop = threading.Event()
        self._primed = threading.Event()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_done: list = []
        self._on_done_lock = threading.Lock()
        self.failed = 0
        #: the error that ended the capture early (it raised, or ``max_failures_in_a_row`` captures
        #: failed: the last one's), else None; read it in a :meth:`when_done` callback
        self.error: BaseException | None = None
        self.demanded = 0  # captures taken out of plan order because serving ran the bucket eagerly
        self.capture_s = 0.0
        self.wall_s: float | None = None
        self.started_at: float | None = None

    # ------------------------------------------------------------------ plan and counts
    def plan(self) -> list[tuple[_GraphStage, tuple]]:
        """``(stage, bucket)`` pairs in capture order (see the class doc)."""
        out = []
        for group in self.groups:
            queues = [[(s, k) for k in s.pending()] for s in group]
            while any(queues):
                for q in queues:
                    if q:
                        out.append(q.pop(0))
        return out

    @property
    def captured(self) -> int:
        """Buckets captured so far (by anyone) across the stages."""
        return sum(s.n_graphs for s in self.stages)

    @property
    def pending(self) -> int:
        """Buckets neither captured nor disabled."""
        return sum(len(s.pending()) for s in self.stages)

    @property
    def started(self) -> bool:
        """True once :meth:`start` was called."""
        return self._thread is not None

    @property
    def done(self) -> bool:
        """True once the capture loop has ended (all captured, or stopped)."""
        return self._done.is_set()

    # ------------------------------------------------------------------ control
    def start(self) -> None:
        """Start the capture thread (once); the stages stop capturing on use."""
        if self._thread is not None:
            return
        for s in self.stages:
            s.capture_on_use = False
        self._thread = threading.Thread(target=self._main, name="cosyserve-graph-capture", daemon=True)
        # serving threads run fused ops eagerly from now on (the thread claims compiling for itself
        # first thing, and gives it back when it ends: however soon that is)
        fused.compile_only_on(fused.NO_THREAD)
        self._thread.start()

    def run(self) -> None:
        """Capture everything pending on the calling thread, before serving (torch.cuda.graph's
        device wait and cache emptying included)."""
        self._loop(background=False)

    def wait_primed(self, timeout: float | None = None) -> bool:
        """Wait until priming is done (or the loop ended); False on timeout."""
        return self._primed.wait(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the capture loop has ended; False on timeout."""
        return self._done.wait(timeout)

    def when_done(self, fn) -> None:
        """Call ``fn()`` once the capture loop has ended (on the capture thread), or now (on the
        calling thread) if it already has. An exception ``fn`` raises is logged, not raised."""
        with self._on_done_lock:
            if not self._done.is_set():
                self._on_done.append(fn)
                return
        _call_logged(fn)

    def _finished(self) -> None:
        with self._on_done_lock:
            self._done.set()
            todo, self._on_done = self._on_done, []
        for fn in todo:
            _call_logged(fn)

    def stop(self, timeout: float | None = None) -> bool:
        """Ask the thread to stop after the capture in progress and wait up to ``timeout``
        seconds; True if it has ended. Buckets not captured stay eager."""
        self._stop.set()
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ------------------------------------------------------------------ the thread
    def _main(self) -> None:
        fused.compile_only_on(threading.get_ident())  # this thread alone compiles fused kernels meanwhile
        # This thread's compiles and captures are long stretches of Python; each time a serving thread
        # releases the GIL (every torch op, every graph replay) it would wait up to the interpreter's
        # switch interval (5 ms) to get it back, per op. A short interval bounds that wait (process-wide,
        # restored at the end unless someone else changed it meanwhile).
        switch = shorten_switch_interval(self.switch_interval_s)
        try:
            if self.device is not None and self.device.type == "cuda":
                if self.device.index is not None:  # a new thread starts on device 0
                    torch.cuda.set_device(self.device)
                # this thread's own work (buffers, settling) never touches the legacy default stream
                torch.cuda.set_stream(capture_stream(self.device, non_blocking=True))
            self._loop(background=True)
        except BaseException as exc:  # noqa: BLE001 - a bug here must not take the server down: stay eager
            self.error = exc
            log.exception("background CUDA graph capture stopped")
        finally:
            restore_switch_interval(switch)
            if fused._compile_thread in (threading.get_ident(), fused.NO_THREAD):
                fused.compile_only_on(None)  # every thread compiles (and runs compiled) again
            self._primed.set()
            self._finished()

    def _prime(self) -> None:
        for stage in self.stages:
            if self._stop.is_set():
                return
            keys = sorted(stage.keys(), key=lambda k: (k[0], k[1:]))
            rows = sorted({k[0] for k in keys})[:2]
            for bb in rows:
                key = min(k for k in keys if k[0] == bb)
                try:
                    with torch.inference_mode():
                        stage._warm_up(*key)  # on this thread's stream: private inputs
                    stage._warmed.add(key)  # its capture skips the warm-up
                except Exception as exc:  # noqa: BLE001 - its capture will report (and disable) it
                    log.warning("priming %s at %s failed: %s: %s", stage.name, key, type(exc).__name__, exc)

    def _demanded(self) -> tuple | None:
        """The pending bucket that serving ran eagerly most often so far (``_GraphStage.misses``)
        among stages that allow it (``demand_first``), or None: capture in plan order."""
        best = None
        for stage in self.stages:
            if not stage.demand_first or not stage.misses:
                continue
            used = list(stage.misses.items())  # one C-level copy: serving threads keep counting
            pending = set(stage.pending())
            for key, count in used:
                if key in pending and (best is None or count > best[0]):
                    best = (count, stage, key)
        return None if best is None else best[1:]

    def _loop(self, background: bool) -> None:
        if self.prime and background:
            t0 = time.perf_counter()
            self._prime()
            log.info("graph capture primed (fused kernels compiled, %d stages) in %.1f s; serving eagerly while "
                     "%d graph buckets are captured in the background", len(self.stages), time.perf_counter() - t0,
                     self.pending)
        self._primed.set()
        todo = iter(self.plan())
        cuda = self.device is not None and self.device.type == "cuda"
        m0 = torch.cuda.memory_reserved(self.device) if cuda else 0
        t0 = self.started_at = time.perf_counter()
        n = streak = 0
        last_error = None
        while True:
            got = self._demanded() if background else None
            if got is None:
                got = next(todo, None)
                if got is None:
                    break
            else:
                self.demanded += 1
            stage, key = got
            if self._stop.is_set():
                break
            if streak >= self.max_failures_in_a_row:  # something is broken for good (a CUDA error)
                log.error("%d graph captures in a row failed: capturing nothing more (the rest runs eagerly)", streak)
                self.error = last_error
                break
            if key in stage._graphs or key in stage._failed:
                continue
            c0 = time.perf_counter()
            try:
                stage.capture(key, background=background)
                n += 1
                streak = 0
            except Exception as exc:  # noqa: BLE001 - that bucket runs eagerly; the others go on
                stage.disable(key, f"{type(exc).__name__}: {exc}")
                last_error = exc
                self.failed += 1
                streak += 1
                log.warning("capturing the %s graph %s failed (%s: %s); that bucket runs eagerly", stage.name,
                            "x".join(map(str, key)), type(exc).__name__, exc)
            self.capture_s += time.perf_counter() - c0
            if self.pause_s and background:
                time.sleep(self.pause_s)
        self.wall_s = time.perf_counter() - t0
        m1 = m2 = torch.cuda.memory_reserved(self.device) if cuda else 0
        if background and cuda:
            # the warm-ups' private tensors are cached on this thread's streams, which nothing
            # else allocates from: hand them back once (under the capture lock: torch's allocator
            # asserts that no capture is under way when its cache is emptied)
            with _CAPTURE_LOCK:
                torch.cuda.empty_cache()
            m2 = torch.cuda.memory_reserved(self.device)
        per_stage = ", ".join(f"{s.name} {s.n_graphs} ({s.capture_s:.1f} s)" for s in self.stages)
        log.info("captured %d CUDA graph buckets in %.1f s%s (%.1f s in captures; %s; %d failed, %d left, %d first "
                 "because serving ran them eagerly%s); device memory reserved %+.2f GB (%+.2f GB after emptying the "
                 "cache)", n, self.wall_s, " in the background" if background else "", self.capture_s, per_stage,
                 self.failed, self.pending, self.demanded,
                 ": stopped" if self._stop.is_set() else "", (m1 - m0) / 2**30, (m2 - m0) / 2**30)


def _call_logged(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - a listener's bug must not stop the capture thread's clean-up
        log.exception("a graph-capture listener failed")


def shorten_switch_interval(seconds: float) -> tuple[float, float] | None:
    """Set the interpreter's GIL switch interval (process-wide) to ``seconds`` when it is longer, so a
    thread that released the GIL around a torch op gets it back within that much instead of up to the
    default 5 ms. Returns what :func:`restore_switch_interval` needs (the previous interval and the
    new one as the interpreter stores it: whole microseconds, 2e-4 reads back as 1.9999...e-4), or
    None when nothing changed (setting a value it has already would round it down further)."""
    prev = sys.getswitchinterval()
    if prev <= seconds:
        return None
    sys.setswitchinterval(seconds)
    return prev, sys.getswitchinterval()


def restore_switch_interval(token: tuple[float, float] | None) -> None:
    """Undo :func:`shorten_switch_interval` (``token`` its result), unless the interval was changed
    again meanwhile."""
    if token is not None and sys.getswitchinterval() == token[1]:
        sys.setswitchinterval(token[0])


def _pick(buckets: list[int], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


class SlotRows:
    """Inputs of a slot-ordered decode step (:class:`GraphedDecoder`), packed on the host.

    ``batch_buckets``: the graphs' batch sizes; ``idle_pos``: the KV position idle rows write.
    :meth:`pack` builds one int64 tensor ``[len(FIELDS), bb]`` that reaches the device in one
    transfer; row ``r`` of it belongs to KV slot ``r``."""

    FIELDS = ("start", "seed", "step", "ignore_eos", "active", "tokens", "order")

    def __init__(self, batch_buckets: list[int], idle_pos: int):
        self.batch_buckets = batch_buckets
        self.idle_pos = idle_pos

    def field(self, packed: torch.Tensor, name: str) -> torch.Tensor:
        """Row ``name`` of a packed tensor (a view)."""
        return packed[self.FIELDS.index(name)]

    def _idle_rows(self, bb: int) -> np.ndarray:
        rows = np.zeros((len(self.FIELDS), bb), dtype=np.int64)
        rows[self.FIELDS.index("start")] = self.idle_pos
        return rows

    def idle(self, bb: int) -> torch.Tensor:
        """``bb`` idle rows: ``start`` = ``idle_pos``, inactive, every other field 0."""
        return torch.from_numpy(self._idle_rows(bb))

    def pack(self, slots: torch.Tensor, start: torch.Tensor, **fields: torch.Tensor) -> tuple[int, torch.Tensor, int]:
        """``(bb, packed, kv_need)`` for a step over ``slots`` (CPU int64 ``[B]``): ``bb`` the
        smallest batch bucket above the highest slot; row ``slots[i]`` of ``packed`` gets
        ``start[i]`` and each named field's ``[i]`` (``seed``, ``step``, ``ignore_eos``,
        ``tokens``) and is active; ``order[:B] = slots`` reads results back in call order;
        ``kv_need`` = the longest active sequence after the step (positions).
        Raises ValueError for no slots, repeated slots or a slot beyond the largest bucket."""
        sl = slots.reshape(-1).tolist()
        n = len(sl)
        if n == 0:
            raise ValueError("a decode step needs at least one slot")
        if len(set(sl)) != n or min(sl) < 0:
            raise ValueError(f"decode step slots must be distinct and non-negative: {sl}")
        bb = _pick(self.batch_buckets, max(sl) + 1)
        # packed in numpy: a decode step's host work, half the time of torch's indexed writes on CPU
        # tensors (one step every few ms on the scheduler thread)
        rows = self.FIELDS
        a = self._idle_rows(bb)
        idx = np.asarray(sl, dtype=np.int64)
        st = start.reshape(-1).to("cpu", torch.long).numpy()
        a[rows.index("start"), idx] = st
        a[rows.index("active"), idx] = 1
        for name, val in fields.items():
            a[rows.index(name), idx] = val.reshape(-1).to("cpu", torch.long).numpy()
        a[rows.index("order"), :n] = idx
        return bb, torch.from_numpy(a), int(st.max()) + 1


class GraphedDecoder(_GraphStage):
    """One LM decode step (embed -> Qwen2 -> ``llm_decoder`` -> log-softmax) as CUDA graphs.

    Rows are slots: the graph of batch bucket ``bb`` decodes slots ``0 .. bb-1``, row ``r``
    slot ``r``, reading and writing the KV cache through views of those slots (no gather of
    the cache into batch order, which cost a quarter of the decode step: docs/perf.md
    "Runs 31–32"). A call names the slots that decode (any subset, in any order); the
    smallest bucket covering the highest of them is replayed, and the rows of the other
    slots in it are *idle*: computed, discarded, their KV written at the slot's last
    position (``rows.idle_pos``) — which a sequence only reads after writing it itself —
    and their :class:`~cosyserve.models.llm.DecodeState` left unchanged. Idle rows cost
    little (a step of 8 rows and one of 64 differ by ~10 % on an H100), and the engine hands
    out the lowest free slot.

    Call with CPU tensors ``tokens [B]``, ``slots [B]`` (distinct, below the largest batch
    bucket), ``start [B]`` (the position each row writes); returns float32 log-probabilities
    ``[B, S+3]`` on the device, in the order of ``slots``.

    With ``sampling`` (a :class:`~cosyserve.models.config.SamplingConfig`) and ``state`` (a
    :class:`~cosyserve.models.llm.DecodeState`) the graph is :meth:`SpeechLM.decode_sample`:
    each row's input token and repetition window come from ``state`` and its sampled token is
    appended there, on the device; call :meth:`sample` with the rows' slots, positions, seeds,
    steps and EOS masks to get ``(log-probs, tokens [B] int64)``.

    ``cache`` needs at least ``max_batch`` slots (the engine keeps one more, a scratch slot
    for :class:`GraphedPrefill`'s padding rows).
    """

    def __init__(self, lm: SpeechLM, cache: KVCache, max_batch: int, kv_buckets: list[int] | None = None,
                 sampling=None, eos_id: int | None = None, state: DecodeState | None = None):
        if (sampling is None) != (state is None):
            raise ValueError("device sampling needs both `sampling` and a DecodeState")
        if max_batch > cache.n_slots:
            raise ValueError(f"max_batch {max_batch} exceeds the KV cache's {cache.n_slots} slots")
        self.lm = lm
        self.sampling, self.eos_id, self.state = sampling, eos_id, state
        self.cache = cache
        self.device = cache.k.device
        self.batch_buckets = _pow2_buckets(max_batch)
        if kv_buckets is None:
            kv_buckets = [b for b in (256, 512, 1024, 2048, 4096, 8192) if b < cache.max_len] + [cache.max_len]
        self.kv_buckets = kv_buckets
        #: the packed step inputs; idle rows write their key/value at a slot's last position
        self.rows = SlotRows(self.batch_buckets, min(cache.max_len, lm.max_positions or cache.max_len) - 1)
        self._init_stage(self.device)

    name = "LM decode"

    def keys(self) -> list[tuple[int, int]]:
        """Every (batch bucket, KV-length bucket)."""
        return [(bb, kvb) for bb in self.batch_buckets for kvb in self.kv_buckets]

    def order(self, keys: list) -> list:
        """Fewest rows x KV positions first (the steps of a few short sequences come first)."""
        return sorted(keys, key=lambda k: (k[0] * k[1], k[0]))

    def _step(self, packed: torch.Tensor, slots, kv_len: int, state):
        f = lambda name: self.rows.field(packed, name)  # noqa: E731
        if self.sampling is not None:
            return self.lm.decode_sample(self.cache, state, slots, f("start"), f("seed"), f("step"),
                                         f("ignore_eos") != 0, self.sampling, self.eos_id, kv_len=kv_len,
                                         active=f("active") != 0)
        emb = self.lm.embed_speech(f("tokens")[:, None])
        h = self.lm.forward_cached(emb, self.cache, slots, f("start"), kv_len=kv_len)[:, -1]
        return self.lm.logprobs(h)

    @torch.inference_mode()
    def _warm_up(self, bb: int, kvb: int) -> None:
        # every row idle, on a private DecodeState; rows name the scratch slot (the engine's
        # extra slot, junk by design) when there is one, so a warm-up next to serving writes no
        # key/value of a live slot (read through a gather instead of views: the same GEMM and
        # attention shapes, which is what a warm-up is for)
        packed = self.rows.idle(bb).to(self.device)
        scratch = self.cache.n_slots - 1
        slots = torch.full((bb,), scratch, dtype=torch.long, device=self.device) if scratch >= bb else slice(0, bb)
        state = None
        if self.sampling is not None:
            state = DecodeState.allocate(self.cache.n_slots, self.state.recent.shape[1], self.device)
        self._step(packed, slots, kvb, state)

    @torch.inference_mode()
    def _record_entry(self, key, background: bool):
        bb, kvb = key
        packed = self.rows.idle(bb).to(self.device)  # per bucket: no capture touches what a replay reads
        g, out = _record(lambda: self._step(packed, slice(0, bb), kvb, self.state), self.pool, self.stream,
                         settle_first=not background)
        return g, out, packed

    @torch.inference_mode()
    def sample(self, slots: torch.Tensor, start: torch.Tensor, seed: torch.Tensor, step: torch.Tensor,
               ignore_eos: torch.Tensor):
        """One step with device sampling over ``state``: ``slots``, ``start``, ``seed``, ``step``
        int64 ``[B]``, ``ignore_eos`` bool ``[B]`` (CPU tensors) -> ``(log-probs [B, S+3],
        tokens [B])`` on the device, in the order of ``slots``."""
        if self.sampling is None:
            raise RuntimeError("this GraphedDecoder was built without sampling")
        logp, toks, order = self._run(slots, start, seed=seed, step=step, ignore_eos=ignore_eos)
        return logp.index_select(0, order), toks.index_select(0, order)

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, slots: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        if self.sampling is not None:
            raise RuntimeError("this GraphedDecoder samples on the device: call sample()")
        logp, order = self._run(slots, start, tokens=tokens)
        return logp.index_select(0, order)

    def _run(self, slots: torch.Tensor, start: torch.Tensor, **fields: torch.Tensor):
        bb, host, kv_need = self.rows.pack(slots, start, **fields)
        kvb = _pick(self.kv_buckets, kv_need)
        entry = self.lookup((bb, kvb))
        if entry is None:  # not captured yet: the same step eagerly (same rows, same KV length)
            packed = to_device(host, self.device)
            out = self._step(packed, slice(0, bb), kvb, self.state)
        else:
            g, out, packed = entry
            packed.copy_(host, non_blocking=True)
            g.replay()
        order = self.rows.field(packed, "order")[: int(slots.numel())]
        return (*out, order) if isinstance(out, tuple) else (out, order)


class _BucketGraphs(_GraphStage):
    """Graphs of one stage per :class:`BucketGrid` bucket, in one memory pool, all buckets'
    static tensors views of :class:`SharedBuffers`: :meth:`warmup` (or a
    :class:`BackgroundCapturer`) captures every reachable bucket; see :class:`_GraphStage` for
    capture, publication and the eager fallback."""

    #: frames at which a bucket's quadratic (attention) memory matches its linear memory;
    #: orders the captures (0: no attention)
    quadratic_len = 0

    def __init__(self, grid: BucketGrid, device, pool=None):
        self.grid = grid
        self._init_stage(device, pool)
        self.shared = SharedBuffers(grid.max_units(), device)

    def keys(self) -> list[tuple[int, int]]:
        """:meth:`BucketGrid.reachable`."""
        return self.grid.reachable()

    def _size(self, key) -> float:
        q = self.quadratic_len
        return key[0] * key[1] * (1 + (key[1] / q if q else 0))

    def order(self, keys: list) -> list:
        """The largest bucket first while the stage has no graph, then smallest first.

        The largest first: a capture's freed intermediates stay in the stage's pool, where a
        larger free block can serve a smaller bucket's request but not the other way round
        (captured smallest first, a full flow grid reserved 38 GB; largest first is vLLM's
        order), and the shared buffers get their size from the first bucket taking them. After
        it, every capture fits in what that one left, so the rest go by likely use: few rows and
        short lengths first (what a lone stream needs)."""
        keys = sorted(keys, key=lambda k: (self._size(k), k))
        if keys and not self._graphs:
            keys.insert(0, keys.pop())
        return keys


class GraphedPrefill(_BucketGraphs):
    """Prefill of newcomers as CUDA graphs, one per (batch bucket, length bucket): batches of
    ``1, 2, 4, ... max_batch`` sequences x multiples of ``bucket`` positions up to ``max_len``;
    :meth:`warmup` captures the buckets that prefills of at most ``max_tokens`` padded tokens
    (rows x longest prefix, the engine's prefill budget) reach.

    ``__call__(embeds [B, T, H], slots [B])`` writes positions ``0 .. T-1`` of each row's slot
    in ``cache`` and returns the final hidden states ``[B, T, H]`` (a view into a static
    buffer: use it before the next call), or None when the batch or ``T`` exceeds the largest
    bucket (prefill eagerly). Rows are right-padded as in the engine's eager batched prefill:
    positions past a row's length get junk K/V past the sequence, which decoding overwrites
    before any query can attend to them (causal attention); padding rows of a batch bucket
    read and write the scratch slot.
    """

    name = "LM prefill"

    def __init__(self, lm: SpeechLM, cache: KVCache, bucket: int = 64, max_len: int = 1024, pool=None,
                 max_batch: int = 1, max_tokens: int | None = None):
        top = min(max_len, cache.max_len) // bucket * bucket
        super().__init__(BucketGrid(_pow2_buckets(max(1, max_batch)), list(range(bucket, top + 1, bucket)) or [bucket],
                                    max_tokens), cache.k.device, pool)
        self.lm, self.cache = lm, cache
        self.scratch = cache.n_slots - 1
        self.device = cache.k.device
        self._usable = top >= bucket

    @torch.inference_mode()
    def _warm_up(self, bb: int, tb: int) -> None:
        lm = self.lm
        emb = torch.zeros(bb, tb, lm.qwen_config.hidden_size, dtype=lm.llm_decoder.weight.dtype, device=self.device)
        slot = torch.full((bb,), self.scratch, dtype=torch.long, device=self.device)  # junk by design
        lm.forward_cached(emb, self.cache, slot, torch.zeros(bb, dtype=torch.long, device=self.device), kv_len=tb)

    @torch.inference_mode()
    def _record_entry(self, key, background: bool):
        bb, tb = key
        lm = self.lm
        dtype = lm.llm_decoder.weight.dtype
        shape = (bb, tb, lm.qwen_config.hidden_size)
        bufs = {"emb": self.shared.take("emb", shape, dtype, bb * tb),
                "slot": torch.full((bb,), self.scratch, dtype=torch.long, device=self.device),
                "start": torch.zeros(bb, dtype=torch.long, device=self.device)}
        out = self.shared.take("out", shape, dtype, bb * tb)

        def run():
            return out.copy_(lm.forward_cached(bufs["emb"], self.cache, bufs["slot"], bufs["start"], kv_len=tb))

        g, out = _record(run, self.pool, self.stream, settle_first=not background)
        return g, bufs, out

    @torch.inference_mode()
    def __call__(self, embeds: torch.Tensor, slots) -> torch.Tensor | None:
        n, t = embeds.shape[:2]
        key = self.grid.pick(n, t) if self._usable else None
        if key is None:
            return None
        bb, tb = key
        entry = self.lookup(key)
        if entry is None:
            return None
        g, bufs, out = entry
        bufs["emb"][:n, :t].copy_(embeds)
        if t < tb:
            bufs["emb"][:n, t:].zero_()
        bufs["slot"][:n].copy_(to_device(torch.as_tensor(slots, dtype=torch.long).reshape(-1), self.device))
        if n < bb:
            bufs["slot"][n:].fill_(self.scratch)
        g.replay()
        return out[:n, :t]


class GraphedHiFTDecoder(_BucketGraphs):
    """:meth:`HiFTGenerator.decode` (conv stack + source STFT + iSTFT, deterministic and free of
    host synchronisation) as CUDA graphs per batch bucket (:func:`half_octave_buckets`) x frame
    bucket (:func:`length_buckets` of ``frame_bucket`` up to ``max_frames``); :meth:`warmup`
    captures those that batches of at most ``max_area`` frames (items x longest) reach.

    ``__call__(mel [B, C, T], source [B, 1, T*spf], lengths [B])`` takes ``decode``'s padded-batch
    arguments and returns the speech ``[B, T*spf]`` (a fresh tensor); beyond the grid it runs
    ``decode`` eagerly. Padding rows and frames are handled by ``decode``'s own per-item lengths
    (padding rows get length 1), so valid samples equal the eager result up to float rounding
    of differently shaped kernels. F0 prediction and the excitation (random draws from each
    request's generator) stay eager.
    """

    name = "HiFT decoder"

    def __init__(self, hift, max_batch: int, max_frames: int = 1024, max_area: int | None = None,
                 frame_bucket: int = 32, pool=None):
        super().__init__(BucketGrid(half_octave_buckets(max_batch), length_buckets(frame_bucket, max_frames),
                                    max_area),
                         next(hift.parameters()).device, pool)
        self.hift = hift

    @torch.inference_mode()
    def _warm_up(self, bb: int, tb: int) -> None:
        w = next(self.hift.parameters())
        mel = torch.zeros(bb, self.hift.cfg.in_channels, tb, dtype=w.dtype, device=w.device)
        source = torch.zeros(bb, 1, tb * self.hift.samples_per_frame, dtype=w.dtype, device=w.device)
        self.hift.decode(mel, source, torch.full((bb,), tb, dtype=torch.long, device=w.device))

    @torch.inference_mode()
    def _record_entry(self, key, background: bool):
        bb, tb = key
        spf = self.hift.samples_per_frame
        w = next(self.hift.parameters())
        d, dt = w.device, w.dtype
        units = bb * tb
        bufs = {"mel": self.shared.take("mel", (bb, self.hift.cfg.in_channels, tb), dt, units),
                "source": self.shared.take("source", (bb, 1, tb * spf), dt, units),
                "lengths": torch.full((bb,), tb, dtype=torch.long, device=d)}
        out = self.shared.take("out", (bb, tb * spf), dt, units)

        def run():
            return out.copy_(self.hift.decode(bufs["mel"], bufs["source"], bufs["lengths"]))

        g, out = _record(run, self.pool, self.stream, settle_first=not background)
        return g, bufs, out

    @torch.inference_mode()
    def __call__(self, mel: torch.Tensor, source: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        b, _, t = mel.shape
        spf = self.hift.samples_per_frame
        key = self.grid.pick(b, t)
        if key is None:
            return self.hift.decode(mel, source, lengths)
        entry = self.lookup(key)
        if entry is None:  # not captured yet
            return self.hift.decode(mel, source, lengths)
        g, bufs, out = entry
        bufs["mel"].zero_()
        bufs["mel"][:b, :, :t].copy_(mel)
        bufs["source"].zero_()
        bufs["source"][:b, :, : t * spf].copy_(source)
        bufs["lengths"].fill_(1)
        bufs["lengths"][:b].copy_(lengths)
        g.replay()
        return out[:b, : t * spf].clone()


class GraphedCausalHiFTTrunk(_BucketGraphs):
    """CosyVoice3's causal HiFT after ``conv_pre`` — the upsampling trunk and the inverse STFT,
    :meth:`CausalHiFTGenerator._trunk_istft <cosyserve.models.hift.CausalHiFTGenerator._trunk_istft>`
    (deterministic, free of host synchronisation) — as CUDA graphs per batch bucket
    (:func:`half_octave_buckets`) x frame bucket (:func:`length_buckets` of ``frame_bucket`` up to
    ``max_frames``); :meth:`warmup` captures those that batches of at most ``max_area`` frames
    (items x longest) reach. F0, the excitation, the source STFT and ``conv_pre`` (per item: right
    context, reflection at each item's end) stay eager in
    :meth:`~cosyserve.models.hift.CausalHiFTGenerator.decode_batch`, which calls this.

    ``__call__(x [B, base, T], s_stft [B, n_fft+2, T*up+1], n_frames [B])`` returns the float32
    speech ``[B, hop*up*T]`` (a fresh tensor) or None beyond the grid (run eagerly). Padding: the
    trunk is causal, so frames past ``T`` never reach valid ones, and ``n_frames`` limits each
    item's overlap-add; padding rows get zeros and one STFT frame. Valid samples therefore equal
    the eager call's up to float rounding of differently shaped kernels (checked on CPU with the
    same function over padded inputs, and on CUDA by the GPU tests).
    """

    name = "causal HiFT trunk"

    def __init__(self, hift, max_batch: int, max_frames: int = 1024, max_area: int | None = None,
                 frame_bucket: int = 32, pool=None):
        super().__init__(BucketGrid(half_octave_buckets(max_batch), length_buckets(frame_bucket, max_frames),
                                    max_area), next(hift.parameters()).device, pool)
        self.hift = hift

    def _shapes(self, bb: int, tb: int) -> tuple[tuple, tuple]:
        up = math.prod(self.hift.cfg.upsample_rates)
        return (bb, self.hift.conv_pre.out_channels, tb), (bb, self.hift.n_fft + 2, up * tb + 1)

    def bucket(self, bb: int, tb: int, shared: "SharedBuffers | None" = None):
        """``(run, bufs, out)`` of bucket ``(bb, tb)``: the static inputs ``bufs`` (``x``, ``s``,
        ``n``; views of ``shared``, default this stage's), the output buffer and ``run`` — what a
        capture records and a replay recomputes (callable eagerly on any device)."""
        h = self.hift
        shared = self.shared if shared is None else shared
        d, tdt = next(h.parameters()).device, h.trunk_dtype
        units = bb * tb
        xs, ss = self._shapes(bb, tb)
        bufs = {"x": shared.take("x", xs, tdt, units).zero_(),
                "s": shared.take("s", ss, tdt, units).zero_(),
                "n": torch.ones(bb, dtype=torch.long, device=d)}
        up = math.prod(h.cfg.upsample_rates)
        out = shared.take("out", (bb, h.hop * up * tb), torch.float32, units)

        def run():
            return out.copy_(h._trunk_istft(bufs["x"], bufs["s"], torch.float32, bufs["n"]))

        return run, bufs, out

    @torch.inference_mode()
    def _warm_up(self, bb: int, tb: int) -> None:
        """One eager run on private inputs (nothing serving reads is written)."""
        h = self.hift
        d, tdt = next(h.parameters()).device, h.trunk_dtype
        xs, ss = self._shapes(bb, tb)
        h._trunk_istft(torch.zeros(xs, dtype=tdt, device=d), torch.zeros(ss, dtype=tdt, device=d), torch.float32,
                       torch.ones(bb, dtype=torch.long, device=d))

    @torch.inference_mode()
    def _record_entry(self, key, background: bool):
        run, bufs, _ = self.bucket(*key)
        g, out = _record(run, self.pool, self.stream, settle_first=not background)
        return g, bufs, out

    @torch.inference_mode()
    def __call__(self, x: torch.Tensor, s_stft: torch.Tensor, n_frames: torch.Tensor) -> torch.Tensor | None:
        b, _, t = x.shape
        key = self.grid.pick(b, t)
        if key is None:
            return None
        entry = self.lookup(key)
        if entry is None:  # not captured yet: the caller runs eagerly
            return None
        g, bufs, out = entry
        bufs["x"].zero_()
        bufs["x"][:b, :, :t].copy_(x)
        bufs["s"].zero_()
        bufs["s"][:b, :, : s_stft.shape[-1]].copy_(s_stft)
        bufs["n"].fill_(1)
        bufs["n"][:b].copy_(n_frames)
        g.replay()
        up = math.prod(self.hift.cfg.upsample_rates)
        return out[:b, : self.hift.hop * up * t].clone()


class GraphedFlow(_BucketGraphs):
    """The whole flow of a token2wav batch — token embedding, conformer encoder, projections and
    the 10-step CFG Euler solve — as CUDA graphs per batch bucket (:func:`half_octave_buckets`) x
    token bucket (:func:`length_buckets` of ``token_bucket`` up to ``max_tokens``, and no
    longer than the fixed noise buffer; mel frames = ``token_mel_ratio`` x tokens): one *begin*
    graph (:meth:`FlowModel.encode` + ``CausalFlowMatching.begin``) and one *step* graph (one
    Euler step, in place) replayed ``n_timesteps`` times. :meth:`warmup` captures the buckets
    that batches of at most ``max_area`` tokens (items x longest, the engine's token2wav
    budget) reach.

    Why a graph per step rather than one for the whole solve: a graph of ~11 000 kernels does not
    fit the stream's launch queue, so ``cudaGraphLaunch`` would hold the calling thread until
    the GPU had worked through most of it (measured: 85 ms of host time for a 16-item batch,
    docs/perf-history.md run 10); issued step by step, the caller never waits.

    :meth:`start` takes a :class:`~cosyserve.models.flow.FlowInputs` (host tensors) and returns
    a :class:`~cosyserve.models.flow.FlowRun` (or None when the batch exceeds every bucket: run
    it eagerly). Padding is exactly the eager batch's: padded tokens, positions and frames are
    masked per item (the encoder and estimator are padding-safe, tested), so valid frames equal
    the eager result up to float rounding of differently shaped kernels; padding rows hold one
    token. Inputs reach the graph's buffers through pinned memory (no host waits). One batch
    may be in flight at a time (all buckets share their buffers, :class:`SharedBuffers`).
    """

    name = "flow"
    quadratic_len = 512  # the estimator's [2B, 1, T, T] bias vs its [2B, T, 4C] feed-forward

    def __init__(self, flow, max_batch: int, max_tokens: int = 1024, max_area: int | None = None,
                 token_bucket: int = 32, pool=None, max_quad: int | None = None):
        noise_tokens = flow.rand_noise.size(-1) // flow.token_mel_ratio // token_bucket * token_bucket
        top = max(token_bucket, min(max_tokens, noise_tokens))
        super().__init__(BucketGrid(half_octave_buckets(max_batch), length_buckets(token_bucket, top), max_area,
                                    max_quad), flow._model_device(), pool)
        self.flow = flow
        self._state_shapes: dict = {}  # bucket -> its solver state's shared tensors' (shape, dtype)

    @staticmethod
    def _state_buffers(st) -> dict[str, torch.Tensor]:
        """The solver-state tensors of the begin graph that live in the shared buffers (the
        estimator's attention plan, named as :func:`_share_plan` names them, and ``xt``/``inp``)."""
        named: dict[str, torch.Tensor] = {}
        _share_plan(st.plan, lambda name, t: named.setdefault(name, t))
        named.update(xt=st.xt, inp=st.inp)
        return named

    @torch.inference_mode()
    def _warm_up(self, bb: int, lb: int) -> None:
        flow = self.flow
        st = flow_begin_from_buffers(flow, flow_buffers(flow, bb, lb, self.device))  # private inputs
        flow.decoder.step(st)
        # the state's shapes: the capture takes its shared buffers before recording (a first take
        # allocates, which must not happen inside a capture), in capture order, so the first
        # (largest) bucket sizes them
        self._state_shapes[(bb, lb)] = {name: (t.shape, t.dtype) for name, t in self._state_buffers(st).items()}

    @torch.inference_mode()
    def _record_entry(self, key, background: bool):
        bb, lb = key
        flow = self.flow
        for name, (shape, dtype) in self._state_shapes.pop(key, {}).items():
            self.shared.take(name, shape, dtype, bb * lb)
        bufs = flow_buffers(flow, bb, lb, self.device, self.shared)

        def begin():  # the solver state the step graph works on, in the shared buffers
            return shared_solver_state(flow_begin_from_buffers(flow, bufs), self.shared, bb * lb)

        settle = not background
        g_begin, state = _record(begin, self.pool, self.stream, settle_first=settle)
        g_step, _ = _record(lambda: flow.decoder.step(state), self.pool, self.stream, settle_first=settle)
        return g_begin, g_step, bufs, state

    def buckets(self, n_items: int, n_tokens: int) -> tuple[int, int] | None:
        """The (batch, tokens) bucket of a batch, or None if it is larger than any bucket
        (or than the fixed noise buffer): such batches run eagerly."""
        return self.grid.pick(n_items, n_tokens)

    @torch.inference_mode()
    def start(self, inputs):
        """Fill the bucket's buffers and replay its begin graph; None if no bucket fits."""
        from .flow import FlowRun

        key = self.buckets(*inputs.ids.shape)
        if key is None:
            return None
        entry = self.lookup(key)
        if entry is None:  # not captured yet: the caller runs it eagerly
            return None
        g_begin, g_step, bufs, state = entry
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


class GraphedPrefixEncoder(_BucketGraphs):
    """The encoder half of prefixed flow solves (:mod:`~cosyserve.models.flow_prefix`) as CUDA graphs, one
    per ``(rows, tokens)`` bucket of :class:`GraphedFlow`'s grid: :func:`prefix_encode_into` from the bucket's
    :func:`flow_buffers` into the shared fixed buffers (:func:`prefix_fixed_buffers`) that
    :class:`GraphedPrefixSolver` reads (``--flow-stream-cache prefix``, the default with CUDA graphs)."""

    name = "flow prefix encoder"
    quadratic_len = 512

    def __init__(self, flow, fixed: dict, grid: BucketGrid, pool=None):
        super().__init__(grid, flow._model_device(), pool)
        self.flow, self.fixed = flow, fixed

    @torch.inference_mode()
    def _warm_up(self, bb: int, lb: int) -> None:  # private inputs; never writes the fixed buffers
        encode_buffers(self.flow, flow_buffers(self.flow, bb, lb, self.device))

    @torch.inference_mode()
    def _record_entry(self, key, background: bool):
        bb, lb = key
        bufs = flow_buffers(self.flow, bb, lb, self.device, self.shared)
        g, _ = _record(lambda: prefix_encode_into(self.flow, bufs, self.fixed), self.pool, self.stream,
                       settle_first=not background)
        return g, bufs


class GraphedPrefixSolver(_BucketGraphs):
    """The solver half of prefixed flow solves as CUDA graphs, per ``(rows, new frames)`` bucket: a *begin*
    graph (:func:`prefix_begin_from_fixed`: the rows' frames after their prefixes gathered from the fixed
    buffers, the :class:`~cosyserve.models.flow_prefix.PrefixPlan`, the solver's set-up) and a *step* graph
    (one Euler step reading the prefix pool at the plan's device step counter), replayed ``n`` times. As in
    :class:`GraphedFlow`, the solver state (``xt``, ``inp``, the plan's tensors) lives in the stage's
    :class:`SharedBuffers`, sized by the first (largest) bucket. Not measured on a GPU yet."""

    name = "flow prefix solver"
    quadratic_len = 512

    def __init__(self, flow, fixed: dict, prefix_pool, grid: BucketGrid, pool=None):
        super().__init__(grid, flow._model_device(), pool)
        self.flow, self.fixed, self.prefix_pool = flow, fixed, prefix_pool
        self._state_shapes: dict = {}  # bucket -> its solver state's shared tensors' (shape, dtype)

    @torch.inference_mode()
    def _warm_up(self, bb: int, nb: int) -> None:  # private fixed buffers and plan; reads the prefix pool
        fixed = prefix_fixed_buffers(self.flow, bb, nb, self.device)
        st = prefix_begin_from_fixed(self.flow, fixed, self.prefix_pool, bb, nb)
        self.flow.decoder.step(st)
        self._state_shapes[(bb, nb)] = {name: (t.shape, t.dtype)
                                        for name, t in GraphedFlow._state_buffers(st).items()}

    @torch.inference_mode()
    def _record_entry(self, key, background: bool):
        bb, nb = key
        flow, settle = self.flow, not background
        for name, (shape, dtype) in self._state_shapes.pop(key, {}).items():
            self.shared.take(name, shape, dtype, bb * nb)

        def begin():  # the solver state in the shared buffers
            return shared_solver_state(prefix_begin_from_fixed(flow, self.fixed, self.prefix_pool, bb, nb),
                                       self.shared, bb * nb)

        g_begin, state = _record(begin, self.pool, self.stream, settle_first=settle)
        g_step, _ = _record(lambda: flow.decoder.step(state), self.pool, self.stream, settle_first=settle)
        return g_begin, g_step, state


class GraphedPrefixFlow:
    """Prefixed flow solves (``--flow-stream-cache prefix``) as CUDA graphs: a :class:`GraphedPrefixEncoder`
    over ``(rows, tokens)`` buckets and a :class:`GraphedPrefixSolver` over ``(rows, new frames)`` buckets (the
    frame buckets: ``token_mel_ratio`` x the token buckets), joined by fixed-layout buffers, so a chunk whose
    voice's prefix covers most of its frames replays a short solve. :meth:`start` returns a
    :class:`~cosyserve.models.flow.FlowRun`, or None where a bucket is missing (the caller runs eagerly).
    ``grid``: the ``(rows, tokens)`` buckets, those of the flow's :class:`GraphedFlow` (``flow.graph.grid``), so
    that every batch the engine forms for that grid has its buckets here too. :attr:`stages` are what the engine
    captures. Not measured on a GPU yet."""

    def __init__(self, flow, prefix_pool, grid: BucketGrid, pool=None):
        ratio = flow.token_mel_ratio
        rows, lengths = grid.batches, grid.lengths
        self.flow, self.ratio, self.prefix_pool = flow, ratio, prefix_pool
        self.fixed = prefix_fixed_buffers(flow, rows[-1], ratio * lengths[-1], flow._model_device())
        self.encoder = GraphedPrefixEncoder(flow, self.fixed, grid, pool)
        area, quad = grid.max_area, grid.max_quad
        frame_grid = BucketGrid(rows, [ratio * n for n in lengths], None if area is None else ratio * area,
                                None if quad is None else ratio * ratio * quad)
        self.solver = GraphedPrefixSolver(flow, self.fixed, prefix_pool, frame_grid, self.encoder.pool)
        self.stages = [self.encoder, self.solver]

    @torch.inference_mode()
    def start(self, inputs, slots, starts):
        """Fill the buffers and replay the encoder graph and the solver's begin graph of ``inputs`` (a
        :class:`~cosyserve.models.flow.FlowInputs`) with per item prefix ``slots`` / ``starts`` (host ints, as
        :meth:`~cosyserve.models.flow.FlowModel.start_prefixed` checked them); None if a bucket is missing."""
        from .flow import FlowRun

        b, n_tok = inputs.ids.shape
        t_new = max(m - s for m, s in zip(inputs.mel_lengths, starts))
        if not (self.encoder.grid.fits(b, n_tok) and self.solver.grid.fits(b, t_new)):
            return None
        key_e, key_s = self.encoder.grid.pick(b, n_tok), self.solver.grid.pick(b, t_new)
        enc, sol = self.encoder.lookup(key_e), self.solver.lookup(key_s)
        if enc is None or sol is None:
            return None
        g_enc, bufs = enc
        g_begin, g_step, state = sol
        fill_flow_buffers(bufs, inputs, self.ratio)
        fill_prefix_rows(self.fixed, slots, starts)
        g_enc.replay()
        g_begin.replay()
        return FlowRun(g_step.replay, state, inputs, list(starts))


def shared_solver_state(st, shared: SharedBuffers, units: int):
    """``st`` (a :class:`~cosyserve.models.flow.SolverState`) with ``xt``, ``inp`` and its plan's tensors
    (:func:`_share_plan`) copied into ``shared`` (a bucket of ``units``): what a begin graph leaves for its
    step graph, the same buffers for every bucket of a stage."""
    share = shared.share
    plan = _share_plan(st.plan, lambda name, t: share(name, t, units))
    return replace(st, xt=share("xt", st.xt, units), inp=share("inp", st.inp, units), plan=plan)


def _share_plan(plan, share):
    """The estimator's attention plan (a dataclass: CosyVoice2's
    :class:`~cosyserve.models.flow_estimator.AttentionPlan`, CosyVoice3's
    :class:`~cosyserve.models.cv3_flow.DiTPlan`) with every tensor field, and every tensor in a
    list field, replaced by ``share(name, tensor)`` (a copy in a graph's static buffers); buffer
    names: the field's name, ``mask{d}`` for the entries of a list field ``masks``, else
    ``{field}{d}``."""
    import dataclasses

    changes = {}
    for f in dataclasses.fields(plan):
        v = getattr(plan, f.name)
        if isinstance(v, torch.Tensor):
            changes[f.name] = share(f.name, v)
        elif isinstance(v, (list, tuple)) and v and all(isinstance(x, torch.Tensor) for x in v):
            stem = "mask" if f.name == "masks" else f.name
            changes[f.name] = type(v)(share(f"{stem}{d}", x) for d, x in enumerate(v))
    return replace(plan, **changes)


def flow_buffers(flow, bb: int, lb: int, device, shared: SharedBuffers | None = None) -> dict[str, torch.Tensor]:
    """Static inputs of a :class:`GraphedFlow` bucket: ``bb`` rows of ``lb`` tokens
    (``token_mel_ratio * lb`` frames), on ``device``, each holding one-token items (zeros); with
    ``shared``, the large ones are views of its buffers, left as they are (zero when first
    allocated: :func:`fill_flow_buffers` clears them before use)."""
    t = flow.token_mel_ratio * lb

    def zeros(name, shape, dtype=torch.float32):
        if shared is None:
            return torch.zeros(shape, dtype=dtype, device=device)
        # a view, not cleared (zero when first allocated): a bucket captured next to serving
        # must not write what another bucket's replay reads; fill_flow_buffers clears it
        return shared.take(name, shape, dtype, bb * lb)

    lengths = torch.ones(3, bb, dtype=torch.long, device=device)
    lengths[2] = flow.token_mel_ratio
    return {"ids": zeros("ids", (bb, lb), torch.long), "lengths": lengths,
            "streaming": torch.zeros(bb, dtype=torch.bool, device=device),
            "embeddings": torch.zeros(bb, flow.cfg.spk_embed_dim, device=device),
            "feats": zeros("feats", (bb, t, flow.n_mels))}


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
    _, mu, spks, cond, mask = encode_buffers(flow, bufs)
    return flow.decoder.begin(mu, mask, spks, cond, bufs["streaming"])


def encode_buffers(flow, bufs: dict[str, torch.Tensor]):
    """:meth:`~cosyserve.models.flow.FlowModel.encode` over a :func:`flow_buffers` bucket (``max_encoder_len`` =
    the bucket's tokens): ``(encoder_out, mu, spks, cond, mask)``."""
    return flow.encode(bufs["ids"], bufs["lengths"], bufs["streaming"], bufs["embeddings"], bufs["feats"],
                       bufs["ids"].shape[1])


def prefix_fixed_buffers(flow, max_batch: int, max_frames: int, device) -> dict[str, torch.Tensor]:
    """The fixed-layout tensors between the two halves of a prefixed flow solve in CUDA graphs (issue 17:
    :mod:`~cosyserve.models.flow_prefix`): the encoder graphs of buckets ``(rows, tokens)`` write each row's
    conditioning here (:func:`prefix_encode_into`), the solver graphs of buckets ``(rows, new frames)`` read
    it (:func:`prefix_begin_from_fixed`), so the two bucket grids are independent. ``mu``, ``cond`` ``[R,
    n_mels, F]`` and ``spks [R, n_mels]`` (model dtype), ``mel_len`` / ``slots`` / ``starts`` int64 ``[R]``,
    ``streaming`` bool ``[R]`` (``R = max_batch``, ``F = max_frames``); zero-initialised (a frame no encoder
    wrote is zero: finite, as :meth:`~cosyserve.models.flow.FlowModel.begin_after_prefix` needs)."""
    dtype, n_mels = flow._model_dtype(), flow.n_mels
    return {"mu": torch.zeros(max_batch, n_mels, max_frames, device=device, dtype=dtype),
            "cond": torch.zeros(max_batch, n_mels, max_frames, device=device, dtype=dtype),
            "spks": torch.zeros(max_batch, n_mels, device=device, dtype=dtype),
            "mel_len": torch.ones(max_batch, dtype=torch.long, device=device),
            "slots": torch.zeros(max_batch, dtype=torch.long, device=device),
            "starts": torch.zeros(max_batch, dtype=torch.long, device=device),
            "streaming": torch.zeros(max_batch, dtype=torch.bool, device=device)}


def prefix_encode_into(flow, bufs: dict[str, torch.Tensor], fixed: dict[str, torch.Tensor]) -> None:
    """The encoder half of a prefixed solve (capturable): :meth:`~cosyserve.models.flow.FlowModel.encode`
    over a :func:`flow_buffers` bucket of ``bb`` rows and ``lb`` tokens, its conditioning copied into rows
    ``[0, bb)`` and frames ``[0, ratio * lb)`` of :func:`prefix_fixed_buffers` (the rows' frame counts and
    streaming flags too)."""
    bb = bufs["ids"].shape[0]
    _, mu, spks, cond, _ = encode_buffers(flow, bufs)
    t = mu.size(-1)
    fixed["mu"][:bb, :, :t].copy_(mu)
    fixed["cond"][:bb, :, :t].copy_(cond)
    fixed["spks"][:bb].copy_(spks)
    fixed["mel_len"][:bb].copy_(bufs["lengths"][2])
    fixed["streaming"][:bb].copy_(bufs["streaming"])


def fill_prefix_rows(fixed: dict[str, torch.Tensor], slots, starts) -> None:
    """The rows' prefix slots and starts (host ints, one per item) into :func:`prefix_fixed_buffers`
    (asynchronous copies); later rows (bucket padding) get none."""
    d = fixed["slots"].device
    fixed["slots"].zero_()
    fixed["starts"].zero_()
    idx = to_device(torch.tensor([list(slots), list(starts)], dtype=torch.long), d)
    fixed["slots"][: idx.shape[1]].copy_(idx[0])
    fixed["starts"][: idx.shape[1]].copy_(idx[1])


def prefix_begin_from_fixed(flow, fixed: dict[str, torch.Tensor], pool, bb: int, t_new: int):
    """The solver half of a prefixed solve (capturable) for a bucket of ``bb`` rows and ``t_new`` new
    frames: :meth:`~cosyserve.models.flow.FlowModel.begin_after_prefix` over rows ``[0, bb)`` of
    :func:`prefix_fixed_buffers` -> its :class:`~cosyserve.models.flow.SolverState`."""
    return flow.begin_after_prefix(fixed["mu"][:bb], fixed["spks"][:bb], fixed["cond"][:bb], fixed["mel_len"][:bb],
                                   fixed["streaming"][:bb], pool, fixed["slots"][:bb], fixed["starts"][:bb], t_new)


def flow_from_buffers(flow, bufs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Begin + all Euler steps over bucket buffers (eagerly) -> ``[bb, n_mels, T]`` float32: what
    the graphs of a :class:`GraphedFlow` bucket compute together."""
    state = flow_begin_from_buffers(flow, bufs)
    for _ in range(state.n):
        flow.decoder.step(state)
    return state.mels()

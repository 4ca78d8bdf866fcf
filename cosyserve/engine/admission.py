"""Stall-free admission: how many streams the engine can keep real time, and who starts next.

A streaming client plays audio at 1x; once the engine holds more streams than it can feed
at that rate, *every* stream falls behind (the LM advances all running streams one token
per step, so a slower step slows everyone), not only the newest. Admission control keeps
the number of admitted (active) requests at or below the engine's **real-time capacity**
and lets the rest wait in the bounded queue, where only their own first-chunk latency grows.

Capacity model (:class:`CapacityEstimator`; units: seconds, streams, speech tokens). With
``b`` admitted streams each stream needs ``R`` speech tokens per second of wall time (``R`` =
the model's ``token_frame_rate``, 25/s for CosyVoice2) and one second of audio from token2wav:

* the LM advances every running stream by one token per step, so it needs ``R`` steps per
  second; a step over ``b`` rows costs ``L(b) = a + c*b`` seconds, fitted by exponentially
  weighted least squares over the steps the engine ran (prefills included, as they occur);
* a token2wav batch that makes ``x`` seconds of audio costs ``T(x) = a_t + k*x`` seconds (a
  fixed part per batch — launches, set-up work, kernels whose time hardly depends on the rows —
  and a part per audio second), fitted like ``L(b)`` over the batches the engine ran. Batches are
  formed from whatever chunks are ready, so with more streams they grow rather than multiply: the
  fixed part is budgeted once per :data:`T2W_PERIOD_S` (the batch period the admitted streams may
  grow the batches to), ``P = a_t / T2W_PERIOD_S``, not per stream. (The first model, a ratio
  of batch time to audio at the batch sizes of the moment, charged the fixed part to every
  stream: at light load it priced a stream at up to twice its marginal cost and held admission
  at the level being run — 32 streams where one H100 kept 45 stall-free, docs/perf.md "Session
  25". With batches of hardly varying audio the fit is that ratio again: ``a_t = 0``). Backends
  whose chunks cost more the longer a stream runs (the CosyVoice2/3 flows re-run the prompt and
  every token so far: a batch's time follows its streams' lengths, not its audio) are fitted
  against the flow input they ran instead (``t2w_price="cost"``: ``T(u) = a_t + k_u*u``, ``u`` =
  the jobs' :meth:`~cosyserve.engine.token2wav.Token2WavBackend.cost_tokens`) and priced per audio
  second at the cost units the streams' chunks have needed per audio second lately,
  ``k = k_u * Σu / Σx`` (the fit against audio let the CosyVoice2 flow's admitted streams stall at
  2x overload, docs/perf.md "Session 26"; their ratio ``Σ time / Σ audio``, the first model, then
  charged the fixed part to every stream again and held an H100 at 27-42 of the 68 listening
  streams it kept stall-free, "Session 34");
* the share of a resource that ``b`` streams need is
  ``U(b) = S*R*L(b) + P + b*k*(1 + (S-1)*f)``:
  the LM advances every stream at once, so it must keep the pace ``S*R`` of the newest stream;
  token2wav work is per stream and issued earliest-deadline-first as soon as a chunk's tokens
  exist (the LM runs ahead of playback), so the ``S``-fold pace binds only streams whose early,
  closely spaced deadlines are still ahead: ``f`` is the fraction of the admitted streams (the
  newcomer included) that have sent fewer than :data:`START_CHUNKS` chunks (1 before any
  stream was admitted: a burst is budgeted at ``S`` for every stream, as the first model did); with
  ``start_cost`` (``--admission-start-cost``, cost-priced flows) a starting stream's chunks are priced at
  what they were measured to cost per audio second relative to the average, ``r``
  (:attr:`CapacityEstimator.start_cost_ratio`): ``b*k*(1 + (S*r-1)*f)`` (from a voice prompt prefix
  a CosyVoice2 stream's first chunks solve few frames, docs/perf.md "Session 36");
* the capacity is the largest ``b`` with ``U(b) <= target`` (``target`` < 1 leaves headroom
  for jitter, the prefills of newcomers and batching effects);
* latency: a stream's second chunk must be out before its first chunk has played (``D1``
  seconds), and besides its tokens it waits for the token2wav batch in flight and then runs in its
  own (``L``, two batch durations): so the LM must make the next hop's tokens within ``D1 - L``,
  i.e. at ``S*R * D1/(D1 - L)`` (:func:`latency_pace`). The engine passes that pace, averaged over
  time (:class:`PaceAverage`: under load the batches alternate large and small, and the pace of the
  moment swung the estimate by tens of streams within a second, docs/perf.md "Session 42"), to
  :meth:`CapacityEstimator.capacity`, which admits the smaller of the two estimates; once the
  batches alone outlast ``D1``, no new stream starts while one runs. (Throughput alone admitted
  CosyVoice3 and DiT streams that stalled on their second chunks at 2x overload: docs/perf.md
  "Session 27".)

The resources are the scheduler thread (host wall time of the LM step including its waits,
and of the token2wav work issued from that thread: on CPU everything runs there) and, on
CUDA, the device (device time of the prefill/decode and flow/HiFT stages): the capacity is
the smaller of the two. ``U(b)`` counts every admitted stream as still generating (the worst
case, e.g. after a burst: charging the LM only for the streams generating at the moment, tried in
session 34, admitted ~170 DiT streams at 2x overload on an H100 and stalled 37 of 1,440, where this
model stalled none, docs/perf.md "Session 34") and the two resources as not overlapping their own
parts (on CUDA the LM and token2wav streams run concurrently, so this errs on the safe side). On the
device, an LM step that runs beside a flow batch also waits for the flow's kernels, which the token2wav
term already charges: with ``lm_alone`` (``--admission-lm-alone``; on by default) the device
prices the LM at the steps that ran alone (once enough of them were seen: their decode fitted apart from
the prefills that rode in them, the prefills priced per generated token) and checks the LM's pace
separately against the steps as they ran (:class:`_Resource`; the fit over every step priced an H100's
UNet LM at 7x its own per-row cost, docs/perf.md "Session 36"). With ``contention_fit`` (off by default) both
resources fit the steps as they ran against their rows and whether token2wav ran beside them
(:class:`_ContentionFit`): in a burst of starting streams the steps with more rows are also those beside more
first-chunk flow work, which the fit against rows alone reads as a steeper cost per row (docs/perf.md "Session 40";
on an H200's first ramp token2wav ran beside nearly every step, so it had nothing to tell apart, "Session 41").
Instead (``alone_floor``, on by default) the fit of every step's time is held at no less than the fixed part of the
steps that ran alone (:meth:`_Resource.floor`): contention only adds to a step, and the confounded fit read a fixed
part at half the steps-alone one with twice the steady state's slope ("Session 41").

Feedback (:class:`SlackGuard`): the model above prices what it measured, and it can be wrong — on an
H100 with device memory no longer binding, it read 146-156 DiT streams where 88 stayed real time
(docs/perf.md "Session 30"). So the engine also watches the outcome itself: every streaming chunk after
the first is due when the audio before it has played (its *slack* is that deadline minus the moment it
is emitted). A chunk with less than ``margin_s`` of slack caps admission at the streams active then,
minus one (a late chunk: 0.9 x them), at most once per ``hold_s`` (the time a cut takes to show); the
cap then rises by one stream per ``recover_s`` without a close call, and is dropped once it no longer
binds. In auto mode admission takes the smaller of the estimate and this cap.

Extrapolation is bounded ("slow start"): before any measurement the capacity is
``initial``; after, it is at most ``growth`` x the largest number of streams measured
admitted at once, plus one, so the linear model is never trusted far beyond what was seen
(on a GPU the step cost is flat at small batches and bends upwards later). Older
measurements fade with ``half_life_s``. With fewer than two distinct batch sizes the step
cost is taken as proportional to the rows (``a = 0``: pessimistic where a fixed part
exists), which the next measurements at other sizes correct.

Trace and replay (:class:`AdmissionTrace`, :func:`replay_admission_trace`): with ``--admission-trace FILE`` the
estimator writes every measurement it is fed and every capacity it computes, with its clock, as JSON lines;
replayed into an estimator of other settings the same history gives what that estimator would have read at
each moment (open loop: the engine's admissions, hence the streams that ran, stay those of the recording). A
replay with the recording's own settings reproduces its capacities exactly (tested), so a model change can be
judged offline against a GPU run's ramps and overloads before it is measured.

:class:`AdmissionPolicy` is the ``--admission`` option: ``auto`` (the estimate), ``off`` (only
``max_active``; the estimate is still computed and reported) or a fixed number of streams.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

log = logging.getLogger(__name__)

#: a stream counts as starting (its token2wav work budgeted at the schedule's speed-up ``S``)
#: until it has sent this many chunks: the first hops have the tightest deadlines (session 21:
#: the flat ``S*U(b)`` model held the UNet path at 30 streams, below the 32-64 measured stall-free)
START_CHUNKS = 2

#: :func:`chunk_speedup` looks at the chunks of this many speech tokens (10 s at 25/s): later
#: hops of a long utterance matter less (the LM usually finishes first) and none is infinite
SPEEDUP_HORIZON_TOKENS = 250

#: the token2wav batch period (seconds) the capacity model budgets a batch's fixed part for (module
#: doc, ``P``): batches grow with the streams until one lasts about this long, so a first chunk
#: waits at most about two periods for its batch
T2W_PERIOD_S = 0.25


class DeviceMemory:
    """What a CUDA device's memory holds for everything but the streams' own caches to come, for
    the engine's memory bound on admission (:meth:`~cosyserve.engine.core.EngineCore._memory_limit`).

    :meth:`held` is ``(held bytes, total bytes)``: the peak of the caching allocator's *allocated*
    bytes (live tensors: weights, KV cache, graph buffers, streams' caches, a batch's transient
    tensors) over the current and the previous window of ``window_s`` seconds, plus the free bytes
    inside CUDA-graph memory pools (:func:`~cosyserve.models.capture.graph_pool_free_bytes`: it lists
    every segment and block, so it is re-read at most every ``pool_refresh_s`` seconds, and only when
    the allocator's reservation changed since — a capture adds pool segments; in steady state it is
    read once). The default pool's cached free blocks
    are not held: the allocator reuses them, and returns them to the driver before it reports
    running out of memory. (Counting the whole reservation, the first bound, tightened as the
    allocator cached blocks: it held an H100 at 33 streams, docs/perf.md "Session 25".)

    Plus what the device holds outside this process's allocator — other processes on the same GPU
    (``serve --workers M`` or ``--llm-workers N`` on one device: an LLM worker's KV cache, another
    token2wav worker's streams) and this process's CUDA context: ``total - device_free() - reserved()``,
    re-read once per window (without it each worker would budget the whole device for its own streams).

    ``allocated_peak()`` (bytes allocated at most since the last ``reset_peak()``), ``reset_peak()``,
    ``pool_free()`` (bytes), ``reserved()`` (bytes), ``device_free()`` (bytes free per the driver) and
    ``total`` (bytes) default to ``device``'s (``torch.cuda``); tests pass their own (without
    ``device_free``, nothing outside the allocator is counted). Raises ValueError with neither a
    device nor the first five.
    """

    def __init__(self, device=None, window_s: float = 2.0, pool_refresh_s: float = 10.0, clock=time.monotonic,
                 allocated_peak=None, reset_peak=None, pool_free=None, reserved=None, total: int | None = None,
                 device_free=None):
        fns = (allocated_peak, reset_peak, pool_free, reserved, total)
        if device is not None and any(f is None for f in fns):
            import torch

            from ..models.capture import graph_pool_free_bytes

            allocated_peak = allocated_peak or (lambda: int(torch.cuda.max_memory_allocated(device)))
            reset_peak = reset_peak or (lambda: torch.cuda.reset_peak_memory_stats(device))
            pool_free = pool_free or (lambda: graph_pool_free_bytes(device))
            reserved = reserved or (lambda: int(torch.cuda.memory_reserved(device)))
            total = total if total is not None else int(torch.cuda.get_device_properties(device).total_memory)
            device_free = device_free or (lambda: int(torch.cuda.mem_get_info(device)[0]))
        if any(f is None for f in (allocated_peak, reset_peak, pool_free, reserved, total)):
            raise ValueError("DeviceMemory needs a CUDA device or all of allocated_peak, reset_peak, pool_free, "
                             "reserved, total")
        self.window_s, self.pool_refresh_s, self.clock = window_s, pool_refresh_s, clock
        self._peak, self._reset, self._pool_free, self.total = allocated_peak, reset_peak, pool_free, int(total)
        self._reserved, self._device_free = reserved, device_free
        self.outside = 0  #: bytes held outside this process's allocator (other processes, the CUDA context)
        self._window_t0: float | None = None
        self._prev_peak = 0
        self._pool: tuple[float, int, int] | None = None  # (when read, reservation then, pools' free bytes)
        self.pool_reads = 0  #: how often the pools were read (each lists every segment)

    def held(self) -> tuple[int, int]:
        """``(held bytes, total bytes)`` (see the class doc)."""
        now = self.clock()
        peak = self._peak()
        if self._window_t0 is None or now - self._window_t0 >= self.window_s:
            held = max(peak, self._prev_peak)
            self._prev_peak = peak
            self._reset()
            self._window_t0 = now
            if self._device_free is not None:
                self.outside = max(0, self.total - int(self._device_free()) - int(self._reserved()))
        else:
            held = max(peak, self._prev_peak)
        if self._pool is None or now - self._pool[0] >= self.pool_refresh_s:
            res = int(self._reserved())
            if self._pool is None or res != self._pool[1]:
                self._pool = (now, res, int(self._pool_free()))
                self.pool_reads += 1
            else:
                self._pool = (now, res, self._pool[2])
        return held + self._pool[2] + self.outside, self.total


def latency_pace(first_hop_s: float, batch_latency_s: float) -> float:
    """``D1 / (D1 - L)``: how much faster than the chunk schedule's speed-up the LM must produce a
    stream's second hop when its chunk also spends ``batch_latency_s`` (``L``: waiting for the
    token2wav batch in flight, then its own) before it is out, all within ``first_hop_s`` (``D1``: the
    first chunk's playback, seconds). 1 with no latency; ``inf`` when ``L >= D1``. Raises ValueError
    for a non-positive ``first_hop_s`` or a negative latency."""
    if not first_hop_s > 0 or not batch_latency_s >= 0:
        raise ValueError(f"latency_pace needs first_hop_s > 0 and batch_latency_s >= 0, got {first_hop_s}, "
                         f"{batch_latency_s}")
    room = first_hop_s - batch_latency_s
    return math.inf if room <= 0 else first_hop_s / room


def chunk_speedup(policy, horizon_tokens: int = SPEEDUP_HORIZON_TOKENS) -> float:
    """How many times faster than real time a stream with chunk ``policy`` (a
    :class:`~cosyserve.engine.chunking.ChunkPolicy`) must be computed so that no chunk arrives
    after the audio before it has played, over its first ``horizon_tokens`` tokens (>= 1).

    With hops ``h1, h2, ...``: playback starts when chunk 1 arrives; chunk ``k+1`` needs
    ``h2 + ... + h(k+1)`` more tokens (the look-ahead is common to both) while ``h1 + ... + hk``
    tokens of audio play. Upstream's first-hop alignment padding is left out (prompt of 0
    tokens: the largest ratio).
    """
    sched = policy.start(0)
    hops, total = [], 0
    while total < horizon_tokens and len(hops) < 1000:
        hops.append(sched.hop)
        total += sched.hop
        sched.advance()
    s, played = 1.0, 0
    for k in range(len(hops) - 1):
        played += hops[k]
        s = max(s, sum(hops[1:k + 2]) / played)
    return s


@dataclass(frozen=True)
class AdmissionPolicy:
    """How many requests may be active at once, beyond ``EngineConfig.max_active``.

    ``mode``: ``"auto"`` (the :class:`CapacityEstimator`'s real-time capacity), ``"off"``
    (``max_active`` only) or ``"fixed"`` (``streams``). Parse ``--admission`` with :meth:`parse`.
    """

    mode: str = "off"
    streams: int | None = None

    def __post_init__(self):
        if self.mode not in ("auto", "off", "fixed"):
            raise ValueError(f"unknown admission mode {self.mode!r} (auto, off or a number of streams)")
        if (self.mode == "fixed") != (self.streams is not None) or (self.streams is not None and self.streams < 1):
            raise ValueError("a fixed admission limit needs a number of streams >= 1")

    @classmethod
    def parse(cls, spec: "str | int | AdmissionPolicy") -> "AdmissionPolicy":
        """``"auto"``, ``"off"`` or a positive integer (``"8"`` / ``8``); raises ValueError
        naming the problem for anything else."""
        if isinstance(spec, AdmissionPolicy):
            return spec
        if isinstance(spec, int) and not isinstance(spec, bool):
            return cls("fixed", spec)
        text = str(spec).strip().lower()
        if text in ("auto", "off"):
            return cls(text)
        try:
            n = int(text)
        except ValueError:
            raise ValueError(f"--admission must be 'auto', 'off' or a number of streams >= 1, got {spec!r}") from None
        if n < 1:
            raise ValueError(f"--admission must be 'auto', 'off' or a number of streams >= 1, got {spec!r}")
        return cls("fixed", n)

    def __str__(self) -> str:
        return str(self.streams) if self.mode == "fixed" else self.mode


class _LinearFit:
    """Exponentially weighted least squares of ``y = a + c*x`` (sums decayed by the caller)."""

    def __init__(self):
        self.w = self.x = self.y = self.xx = self.xy = 0.0

    def decay(self, f: float) -> None:
        self.w *= f
        self.x *= f
        self.y *= f
        self.xx *= f
        self.xy *= f

    def add(self, x: float, y: float) -> None:
        self.w += 1.0
        self.x += x
        self.y += y
        self.xx += x * x
        self.xy += x * y

    def ratio(self) -> tuple[float, float] | None:
        """``(0, mean y / mean x)``: the cost per unit at the sizes of the moment; None without data."""
        if self.w < 1e-6 or self.x <= 0:
            return None
        return 0.0, self.y / self.x

    def solve(self, floor: float | None = None) -> tuple[float, float] | None:
        """``(a, c)`` with ``a, c >= 0``; None without data. With (nearly) one batch size the
        cost is taken as proportional to it (``a = 0``). ``floor`` (seconds): the least fixed part the data may
        have (:meth:`_Resource.lm_fit`: what a step costs alone); a fit whose fixed part falls below it is
        refitted through ``(0, floor)`` (least squares of the slope alone), unless the mean ``y`` is no more than
        ``floor`` (then the floor is not credible for these data and the free fit stands)."""
        if self.w < 1e-6 or self.x <= 0:
            return None
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if var < 0.1:  # rows hardly varied: no slope can be told apart from the fixed part
            return self.ratio()
        c = (self.xy / self.w - mx * my) / var
        a = my - c * mx
        if c < 0:  # cost falling with rows: noise; flat
            return my, 0.0
        if floor is not None and a < floor < my:
            return floor, (self.xy - floor * self.x) / self.xx
        if a < 0:  # through the origin
            return 0.0, self.xy / self.xx
        return a, c


class _ContentionFit(_LinearFit):
    """Exponentially weighted least squares of ``y = a + c*x + d*z`` (sums decayed by the caller): an LM step's
    time against its rows ``x`` and whether token2wav work ran beside it ``z`` (0/1). In a burst of starting streams
    the steps with more rows are also those beside more first-chunk flow work, so the fit of ``y`` against ``x``
    alone reads that contention as a cost per row (session 40: the slope of every step's device time tripled over
    an H200's first ramp and the pace bound fell to 28 streams where 96 listening clients stayed real time); with
    ``z`` as a regressor the per-row cost comes from steps of like contention. :meth:`solve` gives the LM's step
    cost at the contention of the moment: ``(a + d*p, c)`` with ``p`` the recent share of steps beside token2wav."""

    def __init__(self):
        super().__init__()
        self.z = self.xz = self.zz = self.zy = 0.0

    def decay(self, f: float) -> None:
        super().decay(f)
        self.z *= f
        self.xz *= f
        self.zz *= f
        self.zy *= f

    def add(self, x: float, y: float, z: float) -> None:  # (the rows-only sums, and z's)
        super().add(x, y)
        self.z += z
        self.xz += x * z
        self.zz += z * z
        self.zy += z * y

    def solve(self) -> tuple[float, float] | None:
        """``(a + d*p, c)`` (seconds per step, seconds per row) with ``a, c, d >= 0``; None where the sums do not
        tell the three apart (too few steps, rows or contention hardly varied within the data, a negative part):
        the caller then keeps the fit against rows alone."""
        if self.w < 1e-6:
            return None
        w = self.w
        mx, mz, my = self.x / w, self.z / w, self.y / w
        sxx, szz, sxz = self.xx / w - mx * mx, self.zz / w - mz * mz, self.xz / w - mx * mz
        sxy, szy = self.xy / w - mx * my, self.zy / w - mz * my
        det = sxx * szz - sxz * sxz
        # rows must vary, and contention must vary apart from the rows (both within the data)
        if sxx < 0.1 or szz < 1e-3 or det < 1e-3 * sxx * szz:
            return None
        c = (sxy * szz - szy * sxz) / det
        d = (szy * sxx - sxy * sxz) / det
        a = my - c * mx - d * mz
        if c < 0 or d < 0 or a < 0:
            return None
        return a + d * mz, c


#: token2wav prices (:class:`CapacityEstimator` ``t2w_price``): a batch's time fitted against the
#: audio seconds it made, or against its flow input (cost units) and priced per audio second at the
#: cost units per audio second the streams' chunks needed lately (module doc)
T2W_PRICES = ("audio", "cost")


#: LM steps (decayed weight) that ran alone on the device before their fit prices the LM's share of the
#: device (:class:`_Resource`): fewer, and the steps' times under contention price it
ALONE_MIN_STEPS = 8.0


class _Resource:
    """One resource's cost model: LM step seconds vs rows, token2wav batch seconds vs the audio
    seconds it made, or vs its cost units (``t2w_price``; both ``a + c*x``).

    The device resource also fits ``lm_alone``: the LM steps no token2wav batch ran beside (the engine
    tells, :meth:`CapacityEstimator.observe_lm_device`). An LM step's device time while a flow batch runs
    on the other stream includes waiting for the flow's kernels, time the token2wav term already charges:
    on an H100 the UNet path's steps fitted 1.65 ms + 0.17 ms per row at 2-9 rows, where the graphed step
    alone costs ~2.0 ms + 0.025 ms per row (docs/perf.md "Session 36"); extrapolated to the ~35 streams
    the model counts as generating, that counts the flow's time twice (the estimate read 31-38 streams where
    ramp-end peaks of 60-70 stayed real time without admission).
    So the device's ``U(b)`` prices the LM at the steps that ran alone (once :data:`ALONE_MIN_STEPS` of
    them are in the fit, and only where that admits more than all steps do), and the LM's pace is checked
    on its own against the steps as they ran, contention included: ``rate * L(b) <= target``
    (``price_lm_alone``; ``EngineConfig.admission_lm_alone``, on by default; off: every step's time prices the
    LM)."""

    def __init__(self, t2w_price: str = "audio", price_lm_alone: bool = False, contention_fit: bool = False,
                 alone_floor: bool = False):
        if t2w_price not in T2W_PRICES:
            raise ValueError(f"t2w_price must be one of {T2W_PRICES}, got {t2w_price!r}")
        #: the fit of every step's time is floored at the fixed part of the steps that ran alone (:meth:`lm_fit`)
        self.alone_floor = alone_floor
        self.contention_fit = contention_fit
        self.t2w_price = t2w_price
        self.price_lm_alone = price_lm_alone
        self.forget()

    def forget(self) -> None:
        """Drop every measurement (the fits and sums; the settings stay)."""
        self.lm = _LinearFit()
        #: the steps' time against rows and token2wav beside them (:class:`_ContentionFit`; priced with
        #: ``contention_fit``, fed either way)
        self.lm_contention = _ContentionFit()
        self.lm_alone = _LinearFit()
        self.t2w = _LinearFit()
        self.prefill_s = self.decode_rows = 0.0  # decayed sums over the steps that told their prefill apart

    def decay(self, f: float) -> None:
        self.lm.decay(f)
        self.lm_contention.decay(f)
        self.lm_alone.decay(f)
        self.t2w.decay(f)
        self.prefill_s *= f
        self.decode_rows *= f

    @property
    def prefill_per_row(self) -> float:
        """Prefill seconds per decode row (per speech token generated) lately, over the steps that told their
        prefill apart (:meth:`CapacityEstimator.observe_lm_device`); 0 without such steps."""
        return self.prefill_s / self.decode_rows if self.decode_rows > 1e-9 else 0.0

    def terms(self, rate: float, audio: bool, t2w_factor: float = 1.0,
              cost_per_audio_s: float = 1.0, lm: "_LinearFit | None" = None,
              lm_extra_per_row: float = 0.0) -> dict[str, float] | None:
        """The parts of ``U(b)`` (module doc; shares of the resource): ``lm_fixed`` = ``rate*a``,
        ``lm_per_stream`` = ``rate*(c + lm_extra_per_row)``, ``t2w_fixed`` = ``a_t/T2W_PERIOD_S``,
        ``t2w_per_stream`` = ``k*t2w_factor`` (``rate`` already scaled by the speed-up; token2wav only with
        ``audio``; ``k`` = the fitted cost per unit x ``cost_per_audio_s`` with ``t2w_price="cost"``, else per
        audio second; ``lm``: the LM fit, default every step's; ``lm_extra_per_row``: seconds per row priced
        besides the fit, :meth:`alone_terms`' prefill); None without LM data, or without token2wav data when
        ``audio``."""
        fit = lm.solve() if lm is not None else self.lm_fit()
        t2w = self.t2w.solve() if audio else (0.0, 0.0)
        if fit is None or t2w is None:
            return None
        (a, c), (a_t, k) = fit, t2w
        if audio and self.t2w_price == "cost":
            k *= cost_per_audio_s
        return {"lm_fixed": rate * a, "lm_per_stream": rate * (c + lm_extra_per_row),
                "t2w_fixed": a_t / T2W_PERIOD_S, "t2w_per_stream": k * t2w_factor}

    def lm_fit(self) -> tuple[float, float] | None:
        """The LM step's ``(fixed seconds, seconds per row)`` as the steps ran: with ``contention_fit`` from
        :class:`_ContentionFit` where it tells rows and contention apart, else (and as before) every step's time
        against its rows, with ``alone_floor`` floored at :meth:`floor`."""
        if self.contention_fit:
            fit = self.lm_contention.solve()
            if fit is not None:
                return fit
        return self.lm.solve(self.floor() if self.alone_floor else None)

    def floor(self) -> float | None:
        """The fixed part (seconds per step) of the steps that ran alone (``lm_alone``: on the device the steps no
        token2wav batch ran beside, their decode; on the host the steps no token2wav batch was in flight during),
        once :data:`ALONE_MIN_STEPS` of them were fitted with their rows varying; else None. A step as it ran costs
        at least what it costs alone (contention only adds), so the fit of every step's time against its rows is
        held at no less than this fixed part (``alone_floor``): on a fresh server's first ramp the steps with more
        rows are also those beside more first-chunk flow work, and the free fit read a fixed part at half the
        steps-alone one with twice the steady state's slope, a pace bound of 31 where the streams ran at 44
        (docs/perf.md "Session 41")."""
        if self.lm_alone.w < ALONE_MIN_STEPS:
            return None
        fit = self.lm_alone.solve()
        return None if fit is None or fit[0] <= 0 else fit[0]

    def alone_terms(self, rate: float, audio: bool, t2w_factor: float = 1.0,
                    cost_per_audio_s: float = 1.0) -> dict[str, float] | None:
        """:meth:`terms` with the LM priced at the steps that ran alone on the device: their decode (the rows
        a step advances) fitted apart from the prefills that rode in them, the prefills priced per row at
        :attr:`prefill_per_row` (a prefill is once per stream, not a per-row cost of a step: fitted with the
        step, each newcomer's ~4 ms prefill, one row, steepened the UNet path's per-row slope ~4x, docs/perf.md
        "Session 37"); None before :data:`ALONE_MIN_STEPS` of them (or without the other data), or unless
        ``price_lm_alone``."""
        if not self.price_lm_alone or self.lm_alone.w < ALONE_MIN_STEPS:
            return None
        return self.terms(rate, audio, t2w_factor, cost_per_audio_s, lm=self.lm_alone,
                          lm_extra_per_row=self.prefill_per_row)

    def capacity(self, rate: float, target: float, audio: bool, t2w_factor: float = 1.0,
                 cost_per_audio_s: float = 1.0) -> float | None:
        """Largest real number of streams ``b`` with ``U(b) <= target`` (:meth:`terms`,
        :func:`_streams`); with steps that ran alone (:meth:`alone_terms`) the larger of that with their LM
        price and with every step's, at most the LM's pace bound (every step's ``rate * L(b) <= target``,
        :func:`_pace_streams`); None without the data :meth:`terms` needs; ``inf`` if nothing grows with ``b``."""
        t = self.terms(rate, audio, t2w_factor, cost_per_audio_s)
        if t is None:
            return None
        return _capacity(t, self.alone_terms(rate, audio, t2w_factor, cost_per_audio_s), target)


def _capacity(terms: dict[str, float], alone: dict[str, float] | None, target: float) -> float:
    """:meth:`_Resource.capacity` from its :meth:`~_Resource.terms` and :meth:`~_Resource.alone_terms`."""
    b = _streams(terms, target)
    if alone is not None:
        b = min(max(b, _streams(alone, target)), _pace_streams(terms, target))
    return b


def _pace_streams(terms: dict[str, float], target: float) -> float:
    """The largest real ``b`` whose LM steps, as they ran (:meth:`_Resource.terms`' ``lm_fixed`` +
    ``b * lm_per_stream``), keep the required pace within ``target`` of the wall time; ``inf`` if they
    do not grow with ``b``, 0 if the fixed part alone exceeds ``target``."""
    room = target - terms["lm_fixed"]
    if room <= 0:
        return 0.0
    return math.inf if terms["lm_per_stream"] <= 0 else room / terms["lm_per_stream"]


def _streams(terms: dict[str, float], target: float) -> float:
    """The largest real ``b`` with ``U(b) = fixed parts + b * per-stream parts <= target`` for the parts
    ``terms`` (:meth:`_Resource.terms`); ``inf`` if nothing grows with ``b``, 0 if the fixed parts alone
    exceed ``target``."""
    per_stream = terms["lm_per_stream"] + terms["t2w_per_stream"]
    room = target - terms["lm_fixed"] - terms["t2w_fixed"]
    if room <= 0:
        return 0.0
    return math.inf if per_stream <= 0 else room / per_stream


#: the version of :class:`AdmissionTrace`'s records (its ``init`` record says it)
TRACE_VERSION = 1
#: records an :class:`AdmissionTrace` writes at most by default (~500 per second on a busy GPU server: hours;
#: ~100 bytes each before gzip)
TRACE_MAX_RECORDS = 10_000_000


class AdmissionTrace:
    """A :class:`CapacityEstimator`'s inputs and outputs as JSON lines (``path``; gzip-compressed when it ends in
    ``.gz``), for :func:`replay_admission_trace` (module doc). Records (``op``; ``t``: the estimator's clock,
    seconds): ``init`` (its constructor's settings, ``version`` :data:`TRACE_VERSION`, ``wall``: the Unix time at
    that clock reading, to line the trace up with a benchmark's log), ``lm`` / ``lmd`` /
    ``t2w`` (the arguments of :meth:`~CapacityEstimator.observe_lm`, :meth:`~CapacityEstimator.observe_lm_device`,
    :meth:`~CapacityEstimator.observe_t2w`), ``set`` (the pricing settings, when they change: ``target``,
    ``start_cost``, ``lm_alone``, ``contention_fit``), ``cap`` (one :meth:`~CapacityEstimator.capacity` call:
    ``pace``, the speed-up ``S``, the starting fraction ``f``, ``audio``, the result ``cap``, and what the caller
    noted, e.g. the engine's active ``a`` and waiting ``w`` requests) and ``slack`` (the engine's close calls:
    ``s`` seconds of slack, ``a`` streams active, ``cut``), ``cal`` (:attr:`CapacityEstimator.calibrating` set
    to ``on``), ``reset`` (:meth:`CapacityEstimator.reset`). Floats are written exactly (``repr``; numpy / torch
    scalars as Python floats). Thread-safe (a lock per record); :meth:`close` flushes. Raises OSError where
    ``path`` cannot be opened; a record that cannot be written later (a full disk) stops the recording with one
    logged warning (:attr:`failed`) instead of failing the engine's step, as does reaching ``max_records``
    (default :data:`TRACE_MAX_RECORDS`: a server left recording does not fill its disk)."""

    def __init__(self, path: str | Path, max_records: int = 0):
        self.path = Path(path)
        self.max_records = int(max_records) or TRACE_MAX_RECORDS
        self._f = gzip.open(self.path, "wt", encoding="utf-8") if self.path.suffix == ".gz" \
            else open(self.path, "w", encoding="utf-8")
        self._lock = threading.Lock()
        self.records = 0
        #: why the recording stopped early (None: it did not)
        self.failed: str | None = None

    def write(self, op: str, t: float, **fields) -> None:
        """One record ``{"op": op, "t": t, **fields}``; a no-op once closed or failed."""
        with self._lock:
            if self._f is None:
                return
            try:
                if self.records >= self.max_records:
                    raise OSError(f"the trace reached its limit of {self.max_records} records")
                self._f.write(json.dumps({"op": op, "t": t, **fields}, separators=(",", ":"), default=float) + "\n")
            except (OSError, TypeError, ValueError) as exc:
                self.failed = f"{type(exc).__name__}: {exc}"
                log.warning("admission trace %s stopped after %d records: %s", self.path, self.records, self.failed)
                try:
                    self._f.close()
                except OSError:
                    pass
                self._f = None
                return
            self.records += 1

    def close(self) -> None:
        """Flush and close the file (idempotent)."""
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None


def read_admission_trace(path: str | Path) -> Iterator[dict]:
    """The records of an :class:`AdmissionTrace` file (gzip by its ``.gz`` suffix), in order. Raises ValueError
    for a file that does not start with an ``init`` record of a known version, or for a line that is not JSON
    (a trace cut short in its last line, or a gzip file never closed, ends there instead)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        try:
            for n, line in enumerate(f, 1):
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    if line.endswith("\n"):
                        raise ValueError(f"{path}: line {n} is not JSON") from None
                    return  # the writer was stopped mid-line
                if n == 1 and (rec.get("op") != "init" or rec.get("version") != TRACE_VERSION):
                    raise ValueError(f"{path}: not an admission trace of version {TRACE_VERSION} (first record: "
                                     f"{str(rec)[:80]})")
                yield rec
        except EOFError:  # a gzip file its writer never closed (the server killed): what was flushed
            return


def replay_admission_trace(records: Iterable[dict], on_cap=None, **overrides) -> Iterator[tuple[dict, int]]:
    """Feed an :class:`AdmissionTrace`'s records (:func:`read_admission_trace`) to a new
    :class:`CapacityEstimator` built with the recording's settings, ``overrides`` replacing any of its
    constructor's keyword arguments (``target``, ``lm_alone``, ``start_cost``, ``contention_fit``, ``alone_floor``,
    ``half_life_s``, ``growth``, ``initial``, ``max_streams``, ``t2w_price``); the recording's later ``set`` records
    apply only to settings not overridden. Yields ``(cap record, replayed capacity)`` for every ``cap`` record (its
    ``cap`` field: what the recording computed); ``on_cap(record, estimator)``, if given, is called first (to read the
    estimator's :meth:`~CapacityEstimator.terms` at that moment). Open loop (module doc). Raises ValueError without
    a leading ``init`` record."""
    it = iter(records)
    init = next(it, None)
    if init is None or init.get("op") != "init":
        raise ValueError("an admission trace starts with its init record")
    now = [init["t"]]
    kwargs = {k: init[k] for k in ("target", "max_streams", "initial", "growth", "half_life_s", "t2w_price",
                                   "lm_alone", "start_cost")}
    kwargs["contention_fit"] = init.get("contention_fit", False)
    kwargs["alone_floor"] = init.get("alone_floor", False)  # (traces before session 41: no floor)
    kwargs.update(overrides)
    m = CapacityEstimator(init["token_rate"], clock=lambda: now[0], **kwargs)
    for rec in it:
        now[0] = rec["t"]
        op = rec["op"]
        if op == "lm":
            m.observe_lm(rec["rows"], rec["host_s"], rec["admitted"], rec.get("beside"))
        elif op == "lmd":
            pre = rec["prefill"]
            m.observe_lm_device(rec["rows"], rec["device_s"], rec["alone"], None if pre is None else tuple(pre))
        elif op == "t2w":
            start = rec["start"]
            m.observe_t2w(rec["audio_s"], rec["host_s"], rec["device_s"], rec["cost"],
                          None if start is None else tuple(start))
        elif op == "cal":
            m.calibrating = rec["on"]
        elif op == "reset":
            m.reset()
        elif op == "set":
            if "target" not in overrides:
                m.target = rec["target"]
            if "start_cost" not in overrides:
                m.start_cost = rec["start_cost"]
            if "lm_alone" not in overrides:
                m.device.price_lm_alone = rec["lm_alone"]
            if "contention_fit" not in overrides:
                m.contention_fit = rec.get("contention_fit", False)
        elif op == "cap":
            m.speedup, m.starting_fraction, m.audio = rec["S"], rec["f"], rec["audio"]
            cap = m.capacity(rec["pace"])
            if on_cap is not None:
                on_cap(rec, m)
            yield rec, cap


class CapacityEstimator:
    """Real-time capacity in streams, measured continuously (see the module doc).

    ``token_rate``: speech tokens per second of audio (the model's ``token_frame_rate``);
    ``target``: the share of each resource the admitted streams may need (0 < target <= 1);
    ``max_streams``: upper clamp (``EngineConfig.max_active``); ``initial``: the capacity
    before any measurement; ``growth``: the estimate is at most ``growth`` x the most
    streams measured admitted at once, + 1; ``half_life_s``: the weight of a measurement
    halves every this many seconds (an idle gap counts as at most 5 half-lives); ``clock``:
    the time source (seconds; tests pass their own); ``t2w_price``: ``"audio"`` fits token2wav
    batches as a fixed part + a part per audio second, ``"cost"`` as a fixed part + a part per cost
    unit (the jobs' flow input, ``observe_t2w(cost=...)``), priced per audio second at the cost units
    per audio second measured lately (module doc; for flows whose chunks cost more the longer a
    stream runs, where a batch's time follows its streams' lengths rather than its audio); ``lm_alone``: the
    device prices the LM at the steps that ran alone on it (:class:`_Resource`; the steps are fitted either way);
    ``start_cost``: a starting stream's token2wav is priced at :attr:`start_cost_ratio` x the schedule's speed-up
    (``t2w_price="cost"`` only; the ratio is measured either way); ``contention_fit``: both resources price the LM
    steps as they ran by their time against rows *and* whether token2wav ran beside them (:class:`_ContentionFit`,
    :attr:`contention_fit`; off: against rows alone); ``alone_floor``: that fit (against rows alone) has a fixed
    part of at least the steps-alone one (:meth:`_Resource.floor`). :attr:`trace`: an :class:`AdmissionTrace`
    that records what the estimator is fed and computes (None: off; :meth:`start_trace`).
    Raises ValueError for settings out of range. Not thread-safe: fed and read by the engine thread (readers elsewhere read
    :attr:`last` / :attr:`last_estimate`, plain attributes).
    """

    def __init__(self, token_rate: float, target: float = 0.8, max_streams: int = 1 << 30, initial: int = 2,
                 growth: float = 1.5, half_life_s: float = 10.0, clock=time.monotonic, t2w_price: str = "audio",
                 lm_alone: bool = False, start_cost: bool = False, contention_fit: bool = False,
                 alone_floor: bool = True):
        if not (token_rate > 0 and 0 < target <= 1 and max_streams >= 1 and initial >= 1 and growth >= 1
                and half_life_s > 0):
            raise ValueError("invalid capacity estimator settings")
        self.rate, self.target, self.max_streams = float(token_rate), float(target), int(max_streams)
        self.initial, self.growth, self.half_life_s = int(initial), float(growth), float(half_life_s)
        self.clock = clock
        self.host = _Resource(t2w_price, contention_fit=contention_fit, alone_floor=alone_floor)
        self.device = _Resource(t2w_price, lm_alone, contention_fit=contention_fit, alone_floor=alone_floor)
        self.start_cost = bool(start_cost)
        self._forget_estimates()
        self.trace: AdmissionTrace | None = None
        self._traced_settings: tuple | None = None
        self._calibrating = False

    def _forget_estimates(self) -> None:
        """The estimator's own sums and what follows from the measurements, as before the first (the resources'
        fits: :meth:`_Resource.forget`)."""
        self._cost = self._audio = 0.0  # decayed sums of token2wav cost units and audio seconds
        self._start_cost = self._start_audio = 0.0  # the same for the chunks of starting streams
        self.seen = 0  #: the most streams admitted at once while the LM was measured
        #: the chunk schedules' speed-up ``S`` (module doc) that the capacity is computed for
        self.speedup = 1.0
        #: ``f``: the share of admitted streams still starting (module doc; 1 = all, the safe default)
        self.starting_fraction = 1.0
        #: whether the streams make audio (token2wav's cost counts; LM-only requests: no)
        self.audio = True
        self._t = None
        #: the latest :meth:`capacity` (streams) and raw :meth:`estimate` (None: no data yet)
        self.last: int = min(self.initial, self.max_streams)
        self.last_estimate: float | None = None
        #: the latest :meth:`latency_estimate` (None: not computed yet)
        self.last_latency_estimate: float | None = None

    def reset(self) -> None:
        """Forget every measurement (the capacity is ``initial`` again, slow start from scratch), keeping the
        settings and the trace (a ``reset`` record): a fresh server's state without a restart
        (``POST /admin/admission/reset``; e.g. to measure several first ramps on one server start)."""
        self.record("reset")
        self.host.forget()
        self.device.forget()
        self._forget_estimates()

    def start_trace(self, trace: AdmissionTrace, **caller) -> None:
        """Record from now on into ``trace`` (its ``init`` record: this estimator's settings, as its constructor
        takes them, and ``caller``'s fields: the engine's settings around the estimator, e.g. its pace
        averaging, which replays do not feed the estimator; a trace started after measurements cannot be replayed
        exactly, so the engine starts it at once)."""
        self.trace, self._traced_settings = trace, None  # (the first estimate records the settings in force)
        trace.write("init", self.clock(), **caller, version=TRACE_VERSION, wall=time.time(), token_rate=self.rate,
                    target=self.target, max_streams=self.max_streams, initial=self.initial, growth=self.growth,
                    half_life_s=self.half_life_s, t2w_price=self.t2w_price, lm_alone=self.device.price_lm_alone,
                    start_cost=self.start_cost, contention_fit=self.contention_fit, alone_floor=self.alone_floor)

    @property
    def t2w_price(self) -> str:
        """The token2wav price (``"audio"`` or ``"cost"``; class doc)."""
        return self.host.t2w_price

    @property
    def alone_floor(self) -> bool:
        """Whether every step's fit is floored at the steps-alone fixed part (:meth:`_Resource.floor`)."""
        return self.host.alone_floor

    @property
    def contention_fit(self) -> bool:
        """Whether the LM steps as they ran are priced by :class:`_ContentionFit` (class doc; settable)."""
        return self.host.contention_fit

    @contention_fit.setter
    def contention_fit(self, on: bool) -> None:
        self.host.contention_fit = self.device.contention_fit = bool(on)

    @property
    def calibrating(self) -> bool:
        """While True (a start-up calibration: :meth:`cosyserve.engine.async_engine.AsyncEngine.calibrate_admission`)
        the LM steps fed to :meth:`observe_lm` / :meth:`observe_lm_device` go only to the fits of the steps that ran
        alone (the host's ``beside=False``, the device's ``alone``: the LM's own cost, the floor of every step's fit
        and the device's LM price, :class:`_Resource`), not to the fits of every step (which price the LM's pace as
        the served steps ran, contention included), the prefill price or :attr:`seen` (slow start). On a fresh
        server the steps alone were otherwise only the start-up probes' 1-3 rows, whose slope, extrapolated to the
        first ramp's 30-40 streams, read 2-3x the one measured later (docs/perf.md "Session 41"). Settable; a
        trace records each change (``cal``)."""
        return self._calibrating

    @calibrating.setter
    def calibrating(self, on: bool) -> None:
        on = bool(on)
        if on != self._calibrating:
            self.record("cal", on=on)
        self._calibrating = on

    def record(self, op: str, **fields) -> float:
        """The clock, read once per measurement, and the record ``op`` with ``fields`` written to :attr:`trace`
        at that time when tracing (the observations' own records; the engine's ``slack`` records)."""
        now = self.clock()
        if self.trace is not None:
            self.trace.write(op, now, **fields)
        return now

    def _decay(self, now: float) -> None:
        """Age the sums before a new measurement taken at ``now`` (:attr:`clock`); an idle gap counts as at most
        5 half-lives (the old measurements then weigh 1/32 of a new one's, and never underflow to none)."""
        if self._t is not None and now > self._t:
            f = 0.5 ** min(5.0, (now - self._t) / self.half_life_s)
            self.host.decay(f)
            self.device.decay(f)
            self._cost *= f
            self._start_cost *= f
            self._start_audio *= f
            self._audio *= f
        self._t = now

    def observe_lm(self, rows: int, host_s: float, admitted: int | None = None, beside: bool | None = None) -> None:
        """One LM step over ``rows`` running segments (prefill + decode) took ``host_s``
        seconds of the scheduler thread, waits for the device included; ``admitted``:
        requests admitted at the time (default ``rows``); ``beside``: whether a token2wav batch was in flight
        during the step (None: not known; :class:`_ContentionFit`)."""
        now = self.record("lm", rows=rows, host_s=host_s, admitted=admitted, beside=beside)
        if rows < 1 or not host_s >= 0:
            return
        self._decay(now)
        if beside is False:  # (the host's steps alone: only its floor, :meth:`_Resource.floor`)
            self.host.lm_alone.add(rows, host_s)
        if self._calibrating:  # (only the steps alone: :attr:`calibrating`)
            return
        self.host.lm.add(rows, host_s)
        if beside is not None:
            self.host.lm_contention.add(rows, host_s, float(beside))
        self.seen = max(self.seen, rows if admitted is None else admitted)

    def observe_lm_device(self, rows: int, device_s: float, alone: bool = False,
                          prefill: tuple[int, float] | None = None) -> None:
        """The device time (CUDA events) of one LM step's prefill + decode over ``rows`` rows; ``alone``:
        no token2wav work ran on the device beside it (its time is the LM's own work, :class:`_Resource`);
        ``prefill``: ``(rows, seconds)`` of the step's prefill, included in ``rows`` and ``device_s`` (the
        steps alone are then fitted on their decode only and the prefill priced per decode row,
        :meth:`_Resource.alone_terms`; None: the step's rows and time as one)."""
        now = self.record("lmd", rows=rows, device_s=device_s, alone=alone,
                          prefill=None if prefill is None else [int(prefill[0]), float(prefill[1])])
        if rows < 1 or not device_s >= 0:
            return
        self._decay(now)
        if not self._calibrating:  # (only the steps alone: :attr:`calibrating`)
            self.device.lm.add(rows, device_s)
            self.device.lm_contention.add(rows, device_s, 0.0 if alone else 1.0)
        dec_rows, dec_s = rows, device_s
        if prefill is not None:
            n_pre, s_pre = int(prefill[0]), max(0.0, min(float(prefill[1]), device_s))
            dec_rows, dec_s = rows - n_pre, device_s - s_pre
            if not self._calibrating:
                self.device.prefill_s += s_pre
                self.device.decode_rows += max(0, dec_rows)
        if alone and dec_rows >= 1:
            self.device.lm_alone.add(dec_rows, dec_s)

    def observe_t2w(self, audio_s: float, host_s: float, device_s: float | None = None,
                    cost: float | None = None, start: tuple[float, float] | None = None) -> None:
        """A token2wav batch produced ``audio_s`` seconds of audio for ``host_s`` seconds of
        the scheduler thread (``device_s`` of device time on CUDA); ``cost``: its jobs' cost units
        (``t2w_price="cost"``; None: the audio seconds); ``start``: ``(cost units, audio seconds)`` of its
        jobs that were chunks of starting streams (:attr:`start_cost_ratio`)."""
        now = self.record("t2w", audio_s=audio_s, host_s=host_s, device_s=device_s, cost=cost,
                          start=None if start is None else [float(start[0]), float(start[1])])
        if not audio_s > 0 or not host_s >= 0:
            return
        self._decay(now)
        x = audio_s
        if self.t2w_price == "cost":
            x = audio_s if cost is None or not cost > 0 else float(cost)
            self._cost += x
            self._audio += audio_s
            if start is not None and start[1] > 0 and start[0] >= 0:
                self._start_cost += float(start[0])
                self._start_audio += float(start[1])
        self.host.t2w.add(x, host_s)
        if device_s is not None and device_s >= 0:
            self.device.t2w.add(x, device_s)

    @property
    def cost_per_audio_s(self) -> float:
        """Token2wav cost units per audio second over the recent batches (``t2w_price="cost"``;
        1.0 before any or with the audio price)."""
        return self._cost / self._audio if self._audio > 1e-9 else 1.0

    @property
    def start_cost_ratio(self) -> float:
        """Cost units per audio second of the starting streams' chunks over the streams' average, lately
        (``t2w_price="cost"``; 1.0 before both were measured or with the audio price). A CosyVoice2 stream's
        first chunks re-run the whole prompt (computed for the benchmark's request: ~1.1); from a voice prompt
        prefix they solve a few frames (~0.6)."""
        if self._start_audio < 1e-9 or self._start_cost <= 0 or self._audio < 1e-9 or self._cost <= 0:
            return 1.0
        return (self._start_cost / self._start_audio) / (self._cost / self._audio)

    def _scaled(self, lm_pace: float) -> tuple[float, float]:
        """``(rate, t2w_factor)``: the LM's steps per second at the speed-up and ``lm_pace``, and the
        starting streams' token2wav factor ``1 + (S-1)*f`` (module doc); with ``start_cost``
        ``1 + (S*r - 1)*f``, ``r`` = :attr:`start_cost_ratio` (the starting streams need their chunks at ``S``
        x real time, at ``r`` x the average cost per audio second)."""
        s = max(1.0, self.speedup)
        f = min(1.0, max(0.0, self.starting_fraction))
        r = self.start_cost_ratio if self.start_cost and self.t2w_price == "cost" else 1.0
        return self.rate * s * lm_pace, 1.0 + (s * r - 1.0) * f

    def _estimate(self, lm_pace: float) -> float | None:
        rate, t2w_factor = self._scaled(lm_pace)
        caps = [c for c in (r.capacity(rate, self.target, self.audio, t2w_factor, self.cost_per_audio_s)
                            for r in (self.host, self.device)) if c is not None]
        return min(caps) if caps else None

    def terms(self, lm_pace: float = 1.0) -> dict:
        """What the estimate is made of, for the logs (rounded): per measured resource (``host``,
        ``device``) the parts of ``U(b)`` (:meth:`_Resource.terms`) and its capacity in streams, and the
        inputs ``speedup`` (S), ``starting_fraction`` (f), ``lm_pace`` and ``cost_per_audio_s``."""
        rate, t2w_factor = self._scaled(lm_pace)
        out: dict = {"speedup": round(max(1.0, self.speedup), 3), "starting_fraction": round(self.starting_fraction, 3),
                     "lm_pace": round(lm_pace, 3), "cost_per_audio_s": round(self.cost_per_audio_s, 2),
                     "start_cost_ratio": round(self.start_cost_ratio, 3)}
        for name, r in (("host", self.host), ("device", self.device)):
            t = r.terms(rate, self.audio, t2w_factor, self.cost_per_audio_s)
            if t is not None:
                out[name] = {k: round(v, 5) for k, v in t.items()}
                alone = r.alone_terms(rate, self.audio, t2w_factor, self.cost_per_audio_s)
                if alone is not None:  # the LM priced at the steps that ran alone, and the pace bound
                    out[name].update(lm_alone_fixed=round(alone["lm_fixed"], 5),
                                     lm_alone_per_stream=round(alone["lm_per_stream"], 5),
                                     prefill_per_stream=round(rate * r.prefill_per_row, 5),
                                     pace_streams=round(min(_pace_streams(t, self.target), 1e9), 1))
                cf = r.lm_contention.solve()  # (logged whether priced or not: contention_fit)
                if cf is not None:
                    out[name].update(contention_fixed=round(rate * cf[0], 5),
                                     contention_per_stream=round(rate * cf[1], 5))
                fl = r.floor() if r.alone_floor else None
                if fl is not None:  # (the least fixed part every step's fit may have)
                    out[name]["lm_floor"] = round(rate * fl, 5)
                out[name]["streams"] = round(min(_capacity(t, alone, self.target), 1e9), 1)
        return out

    def estimate(self) -> float | None:
        """The model's capacity in streams (a real number, unbounded by slow start and
        ``max_streams``), the smaller over the measured resources; None before the LM (and,
        with :attr:`audio`, token2wav) was measured."""
        self.last_estimate = self._estimate(1.0)
        return self.last_estimate

    def latency_estimate(self, lm_pace: float) -> float | None:
        """:meth:`estimate` with the LM's required pace multiplied by ``lm_pace`` (>= 1,
        :func:`latency_pace`: the part of the first chunk's playback that token2wav batch latency
        leaves the LM for the next hop's tokens); 0 for an infinite pace (the batches alone outlast
        the first chunk's playback). The estimate budgets throughput only; on an H100 it admitted
        121-127 DiT streams where ~70 stayed real time, and CosyVoice3 streams at twice what stayed
        real time, the stalls falling on second chunks (docs/perf.md "Session 27"); logged beside
        it, this one read 10-27 CosyVoice3 streams where 14-16 stayed real time ("Session 28"), so
        :meth:`capacity` takes the smaller. Stored in :attr:`last_latency_estimate`."""
        self.last_latency_estimate = self._estimate(max(1.0, lm_pace)) if math.isfinite(lm_pace) else 0.0
        return self.last_latency_estimate

    def capacity(self, lm_pace: float = 1.0, note: dict | None = None) -> int:
        """Streams that may be admitted now: ``initial`` before any measurement, else the
        estimate — the smaller of :meth:`estimate` and the :meth:`latency_estimate` at ``lm_pace`` — rounded
        down, at most ``growth`` x the most streams seen + 1, at least 1, at most ``max_streams``. ``note``:
        fields added to the :attr:`trace`'s ``cap`` record (JSON values; unused otherwise)."""
        cap = self._capacity(lm_pace)
        if self.trace is not None:
            now = self.clock()
            settings = (self.target, self.start_cost, self.device.price_lm_alone, self.contention_fit)
            if settings != self._traced_settings:
                self.trace.write("set", now, target=settings[0], start_cost=settings[1], lm_alone=settings[2],
                                 contention_fit=settings[3])
                self._traced_settings = settings
            self.trace.write("cap", now, pace=lm_pace, S=self.speedup, f=self.starting_fraction, audio=self.audio,
                             cap=cap, **(note or {}))
        return cap

    def _capacity(self, lm_pace: float) -> int:
        est = self.estimate()
        if est is not None:
            est = min(est, self.latency_estimate(lm_pace))
        if est is None:
            cap = self.initial
        else:
            bound = max(self.initial, int(self.growth * self.seen) + 1)
            cap = min(bound, int(est) if math.isfinite(est) else bound)
        self.last = max(1, min(cap, self.max_streams))
        return self.last


class PaceAverage:
    """The batch-latency pace (:func:`latency_pace`) the capacity is read at, averaged over time: each reading
    weighs ``1 - 0.5 ** (dt / half_life_s)`` against the average, ``dt`` the seconds since the previous one (so
    irregular readings weigh by the time they cover). ``half_life_s`` 0: each reading stands. An infinite pace
    (the token2wav batches alone outlast the first chunk's playback: no stream may start) is returned at once, and
    the average restarts from the next finite reading. Why: the pace of the moment follows the last few batches,
    which under load alternate large and small; on an H200 it moved 1.5 <-> 2.4 within a second and swung the
    UNet estimate 29-56 streams, its dips holding a ramp's queue and its peaks admitting ~70 streams in an
    overload where ~50 stayed real time (docs/perf.md "Session 42"). Raises ValueError for a negative or infinite
    half-life. Not thread-safe (the engine thread reads it)."""

    def __init__(self, half_life_s: float = 1.0):
        if not 0 <= half_life_s < math.inf:
            raise ValueError(f"PaceAverage needs a finite half_life_s >= 0, got {half_life_s}")
        self.half_life_s = float(half_life_s)
        self.reset()

    def reset(self) -> None:
        """Forget the average (the next reading stands alone)."""
        self._t: float | None = None
        self.value: float | None = None  #: the last average (None before any reading)

    def update(self, pace: float, now: float) -> float:
        """Average in the reading ``pace`` (>= 1, or ``inf``) taken at ``now`` (seconds; a clock that does not go
        back) and return the average."""
        prev = self.value
        if self.half_life_s > 0 and prev is not None and math.isfinite(prev) and math.isfinite(pace):
            w = 0.5 ** (max(0.0, now - self._t) / self.half_life_s)
            pace = w * prev + (1.0 - w) * pace
        self._t, self.value = now, pace
        return pace


class SlackGuard:
    """Admission cap from the streams' own chunk deadlines (module doc, "Feedback"; AIMD as in TCP
    congestion control: cut at once on a sign of overload, grow back slowly).

    :meth:`observe` takes each streaming chunk's slack (seconds: its playback deadline minus the
    time it was emitted, negative = the client's playback ran dry) and the number of streams active
    then; :meth:`limit` is the cap on active streams now (None: no cap). ``margin_s``: slack below this
    is a close call (cap = active - 1); below 0 a late chunk (cap = ``cut`` x active); ``hold_s``: after
    a cut, further close calls within this many seconds do not cut again (their streams were admitted
    before the cut took effect); ``recover_s``: seconds per stream the cap grows back; ``settle_s``: the cap is
    dropped once it has stayed above the other bounds (:meth:`limit`'s ``ceiling``) this many seconds in a row
    (0: at once); ``clock``: time source (seconds). Counts: :attr:`close_calls`, :attr:`late`, :attr:`cuts`.
    Raises ValueError for settings out of range. Not thread-safe (the engine thread feeds and reads it)."""

    def __init__(self, margin_s: float = 0.05, hold_s: float = 1.0, recover_s: float = 0.5, cut: float = 0.9,
                 settle_s: float = 5.0, clock=time.monotonic):
        if not (margin_s >= 0 and hold_s >= 0 and recover_s > 0 and 0 < cut < 1 and 0 <= settle_s < math.inf):
            raise ValueError("SlackGuard needs margin_s >= 0, hold_s >= 0, recover_s > 0, 0 < cut < 1 and a finite "
                             "settle_s >= 0")
        self.margin_s, self.hold_s, self.recover_s, self.cut, self.clock = margin_s, hold_s, recover_s, cut, clock
        self.settle_s = settle_s
        self._cap: float | None = None
        self._above: float | None = None  # since when the cap has been above the ceiling (limit())
        self._t = 0.0  # when _cap was last updated (growth is counted from here)
        self._last_cut: float | None = None
        self.close_calls = self.late = self.cuts = 0

    def release(self) -> None:
        """Drop the cap (the counts stay): the next close call cuts afresh. For a change of the admission
        settings, which the cap measured under the old ones should not hold back."""
        self._cap, self._last_cut, self._above = None, None, None

    def observe(self, slack_s: float, active: int) -> bool:
        """One streaming chunk (after a stream's first) was emitted ``slack_s`` seconds before its
        deadline with ``active`` streams active; True if this lowered the cap."""
        if slack_s >= self.margin_s:
            return False
        late = slack_s < 0
        self.late += late
        self.close_calls += not late
        now = self.clock()
        if self._last_cut is not None and now - self._last_cut < self.hold_s:
            return False
        new = max(1.0, math.floor(self.cut * active) if late else active - 1.0)
        cap = self.limit()
        if cap is not None and cap <= new:
            return False
        self._cap, self._t, self._last_cut, self._above = new, now, now, None
        self.cuts += 1
        return True

    def limit(self, ceiling: int | None = None) -> int | None:
        """The cap on active streams now (the last cut plus one stream per ``recover_s`` since), or
        None when there is none; a cap that has stayed above ``ceiling`` (the other bounds, read at each call)
        for ``settle_s`` is dropped (until then it is returned, though it does not bind)."""
        if self._cap is None:
            return None
        now = self.clock()
        if now > self._t:
            self._cap += (now - self._t) / self.recover_s
            self._t = now
        if ceiling is not None and self._cap > ceiling:
            if self._above is None:
                self._above = now
            if now - self._above >= self.settle_s:
                self._cap, self._above = None, None
                return None
        else:
            self._above = None
        return int(self._cap)


__all__ = ["AdmissionPolicy", "AdmissionTrace", "CapacityEstimator", "PaceAverage", "SlackGuard", "chunk_speedup",
           "latency_pace", "read_admission_trace", "replay_admission_trace",
           "SPEEDUP_HORIZON_TOKENS", "START_CHUNKS", "T2W_PERIOD_S"]

"""The engine core: one scheduler that owns the models and batches every request's work.

:class:`EngineCore` is a synchronous state machine (no threads, no I/O): callers add
requests, then call :meth:`EngineCore.step` repeatedly; each step returns the events it
produced (:class:`~cosyserve.engine.request.AudioChunk`,
:class:`~cosyserve.engine.request.RequestFinished`). The CLI steps it directly; servers
run it in a background thread (:mod:`cosyserve.engine.async_engine`).

One step:

1. **Commands and expiry** — aborted or timed-out requests free their KV slot and caches
   before any compute (a disconnected client costs nothing after this point).
2. **Admission** — queued requests become active, strictly in arrival order, while fewer
   than the admission limit are: ``max_active``, or less with admission control
   (``EngineConfig.admission``: the real-time capacity measured by
   :class:`~cosyserve.engine.admission.CapacityEstimator`, or a fixed number), so admitted
   streams stay real time and the others wait. Beyond the limit + ``max_queue`` requests,
   :meth:`add_request` refuses at once (:class:`QueueFullError`): the queue is bounded.
3. **LM** (continuous batching) — text segments whose turn has come get a KV-cache slot
   and are prefilled (at most ``max_prefill_tokens`` padded positions per step, at least one segment, so
   newcomers never stall running streams for long); then every running segment advances
   one token in ONE batched decode step over the slots; requests join and leave between
   steps. Sampling is per request (upstream repetition-aware sampling with the request's
   own generator), so a request samples what it would sample alone.
4. **token2wav** — every stream whose next chunk is ready (chunk schedule) or whose LM
   has finished contributes one job; the jobs run as one flow batch + one HiFT batch
   (:class:`~cosyserve.engine.token2wav.Token2Wav`), each with its own caches. On CUDA the
   batch runs on a side stream while LM decoding continues; one batch is in flight at a
   time. Jobs are picked earliest-deadline-first: a stream's deadline is when its client
   runs out of audio (first chunks: the request's arrival, i.e. now), an offline request's
   ``t2w_gather_s`` + ``t2w_slack_s`` after its audio became ready. While the LM is busy, a
   batch is launched only once a job is due within ``t2w_slack_s`` or ``t2w_batch_target``
   jobs are ready (launching costs host time the LM then waits for, and a larger batch costs
   less per job: offline utterances gather into full batches). The batch's length (and so its cost) is set by the
   most urgent job; longer jobs join only when they are due within
   ``EngineConfig.t2w_slack_s``, so a whole-utterance recompute does not delay a batch of
   first chunks, and only while the padded batch stays within ``max_t2w_tokens``.
   LM-only requests (``SynthesisParams.lm_only``) skip this stage: they finish as soon as
   their last segment's LM stops, and their ``RequestFinished`` carries the tokens.

Failures are isolated: an exception in a batch is retried per request, and only the
request that fails is finished with an error.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import threading
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

from ..errors import CosyServeError, InvalidInputError
from ..models.graphs import within_budgets
from ..models.hift import DEFAULT_MEL_CACHE_LEN
from ..models.llm import DecodeState, KVCache, SilentTokenFilter
from ..models.loader import CosyVoice2Models
from ..models.sampling import UpstreamSampler, ras_sample_device
from ..models.transfer import to_device
from .admission import (START_CHUNKS, AdmissionPolicy, AdmissionTrace, CapacityEstimator, DeviceMemory, PaceAverage,
                        SlackGuard, latency_pace)
from .chunking import ChunkPolicy, default_chunk_policy
from .request import (
    AudioChunk,
    EngineRequest,
    Outcome,
    RequestFinished,
    RequestState,
    SegmentState,
    TokensGenerated,
)
from .token2wav import Token2WavJob, Token2WavWorker

log = logging.getLogger(__name__)


class QueueFullError(CosyServeError):
    """The engine already holds ``max_active + max_queue`` requests (HTTP 429)."""


#: mel frames (50/s) of a voice's prompt prefix kept with ``--flow-stream-cache prefix`` unless
#: ``--flow-stream-cache-frames`` says otherwise: the complete chunks of prompts up to ~6 s
#: (2.19 MiB per frame at full size in bf16: 0.64 GiB per voice)
FLOW_PREFIX_FRAMES = 300

#: ``EngineConfig.t2w_queue_s`` "auto" with ``flow_stream_cache`` off: the queued flow steps' device time (s); a
#: launch then holds the scheduler for at most about that long, less than an LM step at a hundred streams plus a
#: flow step (docs/perf.md "Session 44")
T2W_QUEUE_S = 0.025


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler limits.

    ``max_active``: requests processed concurrently (= KV-cache slots); ``max_queue``:
    requests that may wait beyond those; ``kv_max_len``: positions per KV slot (prompt
    prefix + generated tokens of one segment); ``max_prefill_tokens``: prefill budget per
    step (padded: newcomers x the longest prefix); ``max_t2w_batch``: token2wav jobs per batch
    (default: ``max_active``); ``max_t2w_tokens``: flow input tokens per token2wav batch, padded
    (jobs x the longest job's prompt + speech tokens; a longer job runs alone) — bounds the
    flow batch's device time and memory and the CUDA-graph buckets captured at start-up; the
    batch's attention (jobs x longest², quadratic in memory) is bounded too, to
    ``max_t2w_tokens x T2W_ATTENTION_LEN`` (by default: 16 jobs of 1024 tokens, 64 of 512);
    ``t2w_batch_target``: while the LM is busy, jobs not yet due (offline utterances, later
    chunks well ahead of their playback) gather until this many are ready, then run as one
    batch of at most this many (with the jobs that are due): a flow/HiFT batch costs a fixed
    part plus a part per job, so a full batch costs less per job (docs/perf-history.md run 23); a batch
    bucket (:func:`~cosyserve.models.graphs.half_octave_buckets`: 8, 12, 16, 24, ...) is filled
    exactly; ``t2w_gather_s``: the longest an offline
    utterance waits for others to join its batch (its deadline is this plus ``t2w_slack_s``
    after its audio is ready); ``t2w_length_window``: jobs not yet due join a batch only if
    they need more than this fraction of its flow length (the most urgent job's length bucket),
    or to fill rows of its CUDA-graph batch bucket that would otherwise be padding: a job much
    shorter than the batch would pay for the batch's length (every row is computed at the
    padded length), so it waits for a batch of its own length (0: any shorter job joins;
    docs/perf-history.md run 35);
    ``t2w_slack_s``: seconds before its deadline a job longer than the batch's most urgent
    one is added anyway (see the module doc); ``None``: adaptive, three times the recent
    token2wav batch duration (a job left out now runs after the batch in flight and the next
    one), between ``T2W_SLACK_MIN_S`` and ``T2W_SLACK_MAX_S`` (measured: lower first-chunk
    latency at 32 streams but stalled streams, docs/perf-history.md run 18; not the default);
    ``cuda_graphs``: LM decode and prefill, flow and HiFT as CUDA graphs on CUDA devices;
    ``graph_warmup``: capture every LM prefill bucket the limits above can reach when the engine
    starts (~6 s at full size; a capture while serving stalls every stream for 0.1-0.4 s,
    docs/perf-history.md run 20), otherwise on first use; ``t2w_graph_warmup``: the same for the flow
    and HiFT grids (~100 s at full size on an H100), done by :meth:`EngineCore.warmup` (or the first step) before any
    request's work; ``graph_capture``: how the warmed grids (and the LM decode graphs) are
    captured — ``"startup"`` (default): before serving (decode and prefill graphs when the engine
    is built, flow and HiFT in :meth:`EngineCore.warmup`); ``"background"``
    (``--background-graphs``): by a :class:`~cosyserve.models.graphs.BackgroundCapturer` thread
    started (primed with ``graph_priming``) by :meth:`EngineCore.start_graph_capture`
    (``AsyncEngine`` calls it; the first step otherwise) while the engine serves, each bucket
    running eagerly until its graph is published (ready in ~20-40 s instead of ~143 s at full size
    on an H100: docs/perf.md, "Session 24"); ``graph_priming`` (background only): compile the fused
    kernels before ready (True) or let the capture thread compile each variant while serving (False,
    the default: ready in ~20 s instead of ~44 s on an H100 restart, docs/perf.md "Session 24"; see
    :class:`~cosyserve.models.graphs.BackgroundCapturer`). ``cosyserve serve`` defaults to
    ``"background"``, the engine (and ``bench --in-process``) to ``"startup"``. Grids
    not warmed (``graph_warmup``/``t2w_graph_warmup`` False, ``--lazy-graphs``) are captured on
    first use either way. Every stage captures on a CUDA stream of its own
    (:func:`~cosyserve.models.graphs.capture_stream`: graphs sharing a capture stream share a
    cuBLAS workspace, and replayed concurrently they stopped the GPU, docs/perf-history.md "Runs 23–26");
    ``t2w_thread``: run token2wav on its own thread
    (:class:`~cosyserve.engine.token2wav.Token2WavWorker`; off by default: measured slower on
    an H100 because both threads contend for the GIL, docs/perf-history.md runs 5 and 11);
    ``t2w_queue_steps``: a token2wav batch on the side stream is issued a few flow steps at a
    time, between LM steps, keeping at most this many unfinished on the GPU (``None``: the
    whole batch at once, which can hold the scheduler in the driver until the GPU has worked
    through most of it, docs/perf-history.md run 10); ``t2w_queue_s`` (seconds; ``None``: no
    bound): beyond the first, a step is queued only while the unfinished steps' device time,
    measured per batch shape (:class:`~cosyserve.engine.token2wav.FlowStepTimes`), stays within
    it — a large batch's long steps then go one at a time and cannot hold the scheduler in
    ``cudaGraphLaunch`` while a full launch queue drains, a lone stream's short ones up to
    ``t2w_queue_steps`` ahead; ``"auto"`` (default): :data:`T2W_QUEUE_S` where the flow recomputes
    every chunk's history (``flow_stream_cache`` off: its steps grow with the streams), else
    ``None`` (:meth:`EngineCore._resolve_queue_bound`, docs/perf.md "Session 44");
    ``device_sampling`` (``None``: on when the LM is on CUDA): rows with the default sampler draw
    their next token on the device, inside the decode step
    (:func:`~cosyserve.models.sampling.ras_sample_device`: the same RAS rule with counter-based
    randomness keyed by the request's seed and token index — reproducible per seed and
    independent of batching, but not upstream's random stream; the first token of each segment,
    sampled from the prefill, and rows with their own sampler stay on the host);
    ``lm_stream_priority``: on CUDA the LM runs on a high-priority stream, so its short
    step-by-step kernels are scheduled ahead of a token2wav batch's when both wait for the GPU
    (the LM is the serial chain every stream's next token waits for);
    ``pipeline_decode`` (``None``: on CUDA; needs device sampling): issue each LM step before
    reading the previous one's tokens (they stay on the device, :class:`DecodeState`), so the
    GPU decodes while the host hands out tokens, checks stops and feeds token2wav; a segment
    that stopped costs one extra row-step, whose token is dropped (docs/perf-history.md run 24);
    ``decode_lookahead``: with pipelined decoding, how many LM steps are issued beyond the one
    whose tokens the host reads next (1: the next step, as measured so far; N > 1 keeps the
    GPU decoding while the scheduler is held up for longer than a step, e.g. issuing a
    token2wav batch, at the cost of N dropped row-steps per stopped segment and the host
    learning each token N steps after it was sampled; experimental: 2 measured no better
    than 1 on an H100, where the GPU is busy while the scheduler waits, docs/perf-history.md run 33);
    ``admission``: how many requests are active at once below ``max_active`` (``--admission``,
    :class:`~cosyserve.engine.admission.AdmissionPolicy`): ``"auto"`` = the real-time capacity
    the engine measures (:class:`~cosyserve.engine.admission.CapacityEstimator`), ``"off"`` =
    ``max_active`` only, N = at most N; ``None`` (default): ``auto`` on CUDA, ``off`` on CPU (CPU
    serving is for development and tests, whose batching should not depend on how busy the
    machine is; the estimate is still measured and reported); ``admission_target``: the share
    of the scheduler thread / device the admitted streams may need (headroom for jitter and
    prefills; the capacity is the most streams whose modelled need stays below it);
    ``admission_start_share``: ``auto`` admission also keeps the streams still in their first
    ``START_CHUNKS`` chunks (whose second chunk is due within the first chunk's playback, ~0.6 s)
    to at most this share of the admission limit (at least ``MIN_STARTING_STREAMS``), so that a
    burst of arrivals starts in waves instead of all in phase (1.0: no such bound). On an H100
    (docs/perf.md "Session 31") ~100 DiT streams started within 0.6 s at the 2x overload and the
    last third missed their second chunk by up to 40 ms, while ~57 starting at once (the capacity
    levels) never did.
    ``admission_lm_alone``: the capacity model prices the LM's share of the device at the LM steps that
    ran without a token2wav batch beside them (and bounds its pace by every step's time), instead of at every
    step's time (:class:`~cosyserve.engine.admission._Resource`; on by default: on an H100 it raised the UNet
    path's capacity 71 -> 84 streams with ``admission_start_cost`` and the DiT's with back-to-back clients
    97 -> 150 without their 38 stalls at 240 clients, docs/perf.md "Session 37"; on an H200 the DiT's 240
    listening clients and 2x overload stayed stall-free with it, "Session 38").
    ``admission_start_cost``: flows priced per cost unit price a starting stream's token2wav at the cost units
    per audio second its first chunks were measured to need (:attr:`~cosyserve.engine.admission.
    CapacityEstimator.start_cost_ratio`: with voice prompt prefixes they solve few frames) rather than at
    the streams' average (on by default; measured with ``admission_lm_alone``, "Sessions 37-38").
    ``admission_slack_margin_s``: ``auto`` admission's feedback from the streams' chunk deadlines
    (:class:`~cosyserve.engine.admission.SlackGuard`): a streaming chunk emitted (or delivered) with less
    than this many seconds of slack before its playback deadline is a close call, which caps admission at the
    streams active then minus one (a late chunk, slack < 0: at 0.9 x them); 0: only late chunks cut (default
    0.05 s: on an H200 single close calls at 71-73 ms in the UNet's ramp-end burst held its queue ~1 s with 0.1,
    failing the first-chunk p99 at 84-96 listening clients that passed with 0.05, "Session 38").
    ``admission_slack_recover_s``: after a cut the cap grows back by one stream per this many seconds without a
    close call (default 0.5 s per stream; larger = slower recovery).
    ``admission_contention_fit``: the capacity model prices the LM steps as they ran by their time against their
    rows and whether token2wav ran beside them, so that a burst's first-chunk flow work is not read as a cost per
    row (:class:`~cosyserve.engine.admission._ContentionFit`; off by default: not measured yet, docs/perf.md
    "Session 40").
    ``admission_pace_half_life_s``: the batch-latency pace the capacity estimate is read at (each second chunk
    waits up to two token2wav batches within the first chunk's playback,
    :func:`~cosyserve.engine.admission.latency_pace`) is averaged over time with this half-life
    (:class:`~cosyserve.engine.admission.PaceAverage`; seconds; 0: the pace of the moment). The pace of the moment
    follows the last few batches, which under load alternate between large and small: on an H200 the UNet
    estimate swung 29-56 streams within one second, its dips holding the queue in a ramp (p99 576 ms at 96
    listening clients) and its peaks admitting ~70 streams in an overload where ~50 stayed real time (default
    1.0 s; docs/perf.md "Session 42"). An infinite pace (the batches alone outlast the playback) is taken at once.
    ``admission_trace``: a file the capacity model records its measurements and estimates into (JSON lines,
    gzip with a ``.gz`` name; :class:`~cosyserve.engine.admission.AdmissionTrace`), for replaying them into other
    settings offline (``benchmarks/admission_replay.py``); None (default): no recording.
    ``strict_min_len``: before a segment's ``min_len`` mask every stop id, not only upstream's
    one id (``LLMConfig.min_len_mask_id``; CosyVoice3 masks its sos there, so with random weights
    a stop id ends most utterances after a few tokens): for random-weight benchmarks that pin the
    length with the token/text ratios; off by default (upstream's numerics).
    ``flow_stream_cache``: streaming chunks compute only the flow frames after the stream's
    complete static chunks, reusing per-stream caches of the rest (issue 17 part 3 for the
    CosyVoice2 U-Net: :class:`~cosyserve.models.flow.FlowStreamCache`; CosyVoice3's DiT:
    :class:`~cosyserve.engine.token2wav_cv3.Cv3FlowCacheSlot`; both kept per segment and passed in
    its jobs); ``None`` (default, auto): ``"prefix"`` for CosyVoice2 with CUDA graphs, else on while the flow is
    not CUDA-graphed (cached chunks run eagerly) (:meth:`EngineCore._resolve_flow_stream_cache`),
    ``True``/``False``: on/off (``--flow-stream-cache``); ``"prefix"``: no per-stream caches, but every
    non-final streaming chunk of the CosyVoice2 U-Net starts from its voice's prompt prefix, kept for
    ``flow_prefix_slots`` voices in a device pool allocated at start
    (:class:`~cosyserve.engine.token2wav.VoicePrefixPool`; fixed shapes, for CUDA graphs), a prefix needed while
    serving built on a worker thread of its own (``flow_prefix_build="background"``, default) or on the engine
    thread (``"engine"``: every stream waits for the eager build);
    ``flow_stream_cache_frames``: at most this
    many mel frames cached per stream (None: the segment's length bounds it; 2.2 MiB per frame at
    full size in bf16 for CosyVoice2, whose later frames are then recomputed every chunk; 1.8 MB
    for CosyVoice3, whose stream then drops its cache and recomputes its chunks); with ``"prefix"`` the
    frames per voice prefix (default :data:`FLOW_PREFIX_FRAMES`).
    ``stream_chunk_policy``: the chunk policy spec streams use by default (the server's
    ``--chunk-policy``; None: :func:`~cosyserve.engine.chunking.default_chunk_policy` of the
    token2wav path); with a Step-Audio2 DiT token2wav directory the solve graphs captured before
    serving are the buckets streams of this policy reach (:meth:`EngineCore.plan_stream_prompts`);
    ``stream_prompt_s``: the prompt lengths (seconds, min and max) those graphs are planned for
    until the engine is told its voices' (:meth:`EngineCore.plan_stream_prompts`);
    ``dit_graph_memory``: the share of the device's memory the DiT solve graphs' shared buffers may
    take (they hold a batch's copy of its streams' caches, so the share bounds the rows of a chunk
    batch, ``GraphedDiTSolve.max_rows``; what they do not take is left to the streams' own caches);
    ``hift_f0``: ``batched`` (default: one masked float64 F0 pass per token2wav batch, ~120 fewer
    host operators per stream; a stream's F0 is the same whatever its batch-mates, and it is the
    float64 F0, ~1e-7 from the float32 one, so the two modes' speech differ by ~1e-4 over seconds;
    on the H100 it took the DiT path's scheduler thread from 42 % to 24 % issuing token2wav batches
    and, with the heap frozen after the graph capture, its capacity from 72 to 120 streams,
    docs/perf.md "Session 30") or ``per-item`` (each stream's F0 in float32 item by item, as
    upstream computes it; :data:`HIFT_F0_MODES`). ValueError for values out of range, naming them.
    """

    max_active: int = 16
    max_queue: int = 64
    kv_max_len: int = 4096
    max_prefill_tokens: int = 4096
    max_t2w_batch: int | None = None
    max_t2w_tokens: int = 16384
    t2w_batch_target: int = 16
    t2w_gather_s: float = 1.0
    t2w_slack_s: float | None = 1.0
    t2w_length_window: float = 0.75
    cuda_graphs: bool = True
    graph_warmup: bool = True
    t2w_graph_warmup: bool = True
    graph_capture: str = "startup"
    graph_priming: bool = False
    t2w_thread: bool = False
    t2w_queue_steps: int | None = 4
    t2w_queue_s: float | str | None = "auto"
    device_sampling: bool | None = None
    lm_stream_priority: bool = True
    pipeline_decode: bool | None = None
    decode_lookahead: int = 1
    admission: AdmissionPolicy | str | int | None = None
    admission_target: float = 0.8
    admission_start_share: float = 0.45
    admission_lm_alone: bool = True
    admission_start_cost: bool = True
    admission_slack_margin_s: float = 0.05
    admission_slack_recover_s: float = 0.5
    admission_contention_fit: bool = False
    admission_pace_half_life_s: float = 1.0
    admission_trace: str | None = None
    strict_min_len: bool = False
    flow_stream_cache: bool | str | None = None
    flow_stream_cache_frames: int | None = None
    flow_prefix_slots: int = 4
    flow_prefix_build: str = "background"
    stream_chunk_policy: str | None = None
    stream_prompt_s: tuple[float, float] = (2.0, 10.0)
    dit_graph_memory: float = 0.25
    hift_f0: str = "batched"

    def __post_init__(self):
        if self.max_t2w_batch is None:
            object.__setattr__(self, "max_t2w_batch", self.max_active)
        if self.admission is not None:
            object.__setattr__(self, "admission", AdmissionPolicy.parse(self.admission))
        if not 0 < self.admission_target <= 1:
            raise ValueError("admission_target must be in (0, 1]")
        if not 0 < self.admission_start_share <= 1:
            raise ValueError("admission_start_share must be in (0, 1]")
        if not 0 <= self.admission_slack_margin_s < math.inf:
            raise ValueError(f"admission_slack_margin_s must be >= 0 seconds, got {self.admission_slack_margin_s}")
        if not 0 <= self.admission_pace_half_life_s < math.inf:
            raise ValueError(f"admission_pace_half_life_s must be >= 0 seconds, got {self.admission_pace_half_life_s}")
        if not 0 < self.admission_slack_recover_s < math.inf:
            raise ValueError(f"admission_slack_recover_s must be > 0 seconds per stream, "
                             f"got {self.admission_slack_recover_s}")
        bad = [name for name, ok in (
            ("max_active >= 1", self.max_active >= 1), ("max_queue >= 0", self.max_queue >= 0),
            ("kv_max_len >= 64", self.kv_max_len >= 64), ("max_t2w_batch >= 1", self.max_t2w_batch >= 1),
            ("max_t2w_tokens >= 1", self.max_t2w_tokens >= 1), ("t2w_batch_target >= 1", self.t2w_batch_target >= 1),
            ("t2w_gather_s >= 0", self.t2w_gather_s >= 0), ("0 <= t2w_length_window < 1", 0 <= self.t2w_length_window < 1),
            ("t2w_slack_s >= 0", self.t2w_slack_s is None or self.t2w_slack_s >= 0),
            ("t2w_queue_steps >= 1", self.t2w_queue_steps is None or self.t2w_queue_steps >= 1),
            ("t2w_queue_s 'auto' or > 0", self.t2w_queue_s in (None, "auto")
             or (isinstance(self.t2w_queue_s, (int, float)) and not isinstance(self.t2w_queue_s, bool)
                 and self.t2w_queue_s > 0)),
            ("decode_lookahead >= 1", self.decode_lookahead >= 1),
            ("flow_stream_cache_frames >= 0", self.flow_stream_cache_frames is None or self.flow_stream_cache_frames >= 0),
            ("flow_stream_cache in (None, True, False, 'prefix')",
             self.flow_stream_cache in (None, True, False, "prefix")),
            ("flow_prefix_slots >= 1", self.flow_prefix_slots >= 1),
            ("0 < dit_graph_memory < 1", 0 < self.dit_graph_memory < 1))
            if not ok]
        if bad:
            raise ValueError(f"invalid engine limits: need {', '.join(bad)}")
        if self.flow_prefix_build not in ("background", "engine"):
            raise ValueError(f"flow_prefix_build must be 'background' or 'engine', got {self.flow_prefix_build!r}")
        if self.hift_f0 not in HIFT_F0_MODES:
            raise ValueError(f"hift_f0 must be one of {', '.join(HIFT_F0_MODES)}, got {self.hift_f0!r}")
        if self.graph_capture not in GRAPH_CAPTURE_MODES:
            raise ValueError(f"graph_capture must be one of {', '.join(GRAPH_CAPTURE_MODES)}, "
                             f"got {self.graph_capture!r}")
        if self.stream_chunk_policy is not None:
            ChunkPolicy.parse(self.stream_chunk_policy)  # ValueError naming the bad spec
        lo, hi = self.stream_prompt_s
        if not 0 < lo <= hi:
            raise ValueError("stream_prompt_s must be (min, max) seconds with 0 < min <= max, "
                             f"got {self.stream_prompt_s}")


GRAPH_CAPTURE_MODES = ("background", "startup")  #: see ``EngineConfig.graph_capture``
T2W_ATTENTION_LEN = 1024  #: see ``EngineConfig.max_t2w_tokens``: the attention budget's unit length
#: the Step-Audio2 DiT solve graphs plan offline utterances (no cache) in solves of up to this many (the
#: DiT backend splits larger groups: 4 x 2048 frames keep the largest graph's activations below the
#: streaming buckets'; 16 cost ~7 GB more of graph pool on an H100, docs/perf.md "Session 26"),
#: with up to this many seconds of target speech (longer ones run eagerly)
DIT_OFFLINE_ROWS = 4
DIT_OFFLINE_MAX_S = 30.0
#: admission's memory bound (:meth:`EngineCore._memory_limit`): device memory kept free, as a share of
#: the device's (the copies of a stream's caches each further stream is budgeted for are the backend's
#: :attr:`~cosyserve.engine.token2wav.Token2WavBackend.stream_state_copies`)
MEMORY_RESERVE_SHARE = 0.05
#: ``auto`` admission lets at least this many streams be in their first chunks at once
#: (``EngineConfig.admission_start_share``)
MIN_STARTING_STREAMS = 4
#: what may hold the queue's head (``EngineStats.admission_held_s``, ``cosyserve_admission_held_seconds_total``):
#: ``capacity`` the capacity model's estimate (``auto``), ``slack`` the cap from late or close chunks
#: (:class:`~cosyserve.engine.admission.SlackGuard`) below it, ``memory`` the device-memory bound, ``starting``
#: the bound on streams in their first chunks (``admission_start_share``), ``fixed`` ``--admission N``,
#: ``max_active`` the engine's ``max_active`` (KV-cache slots)
ADMISSION_HOLDS = ("capacity", "slack", "memory", "starting", "fixed", "max_active")
#: the admission settings :meth:`EngineCore.set_admission` changes while serving (``GET/PATCH /admin/admission``),
#: by their short names, and the :class:`EngineConfig` fields they are
ADMISSION_SETTINGS = {"mode": "admission", "target": "admission_target", "start_share": "admission_start_share",
                      "lm_alone": "admission_lm_alone", "start_cost": "admission_start_cost",
                      "slack_margin": "admission_slack_margin_s", "slack_recover": "admission_slack_recover_s",
                      "contention_fit": "admission_contention_fit", "pace_half_life": "admission_pace_half_life_s"}
#: the numeric ones among them, with what :meth:`EngineCore.set_admission`'s type error says they must be
_NUMBER_SETTINGS = {"target": "a number in (0, 1]", "start_share": "a number in (0, 1]",
                    "slack_margin": "a number of seconds >= 0", "slack_recover": "a number of seconds per stream > 0",
                    "pace_half_life": "a number of seconds >= 0"}
#: ``EngineConfig.hift_f0``: the CosyVoice2 HiFT's F0 item by item in float32 (bit-identical to a stream's F0
#: run alone) or in one masked float64 pass per batch (:attr:`~cosyserve.models.hift.HiFTGenerator.batched_f0`)
HIFT_F0_MODES = ("per-item", "batched")
T2W_SLACK_MIN_S = 0.15  #: adaptive ``t2w_slack_s``: lower bound (seconds)
T2W_SLACK_MAX_S = 1.0  #: adaptive ``t2w_slack_s``: upper bound (seconds)


class EngineObserver:
    """Hooks for metrics; the default does nothing. Called from the engine thread.

    ``stage(name, batch_size, seconds)`` reports the device time of one batched stage:
    ``prefill`` (one padded prefill forward of ``batch_size`` newcomers), ``decode`` (one LM
    decode step over ``batch_size`` sequences), ``flow`` (encoder + 10-step CFG solve of one
    token2wav batch), ``hift`` (the vocoder over the same batch). Measured with CUDA events
    on CUDA (so overlapped stages do not count each other's time), the host clock on CPU.
    """

    def lm_step(self, batch_size: int, prefill_tokens: int, seconds: float) -> None: ...

    def stage(self, name: str, batch_size: int, seconds: float) -> None: ...

    def token2wav_step(self, batch_size: int, seconds: float) -> None: ...

    def admitted(self, request_id: str, waited_s: float, in_order: bool) -> None:
        """A queued request became active after ``waited_s`` seconds; ``in_order``: no request
        that arrived later was admitted before it."""

    def capacity_changed(self, streams: int, estimate: float | None) -> None:
        """The admission limit changed materially (``estimate``: the raw model, streams)."""

    def admission_held(self, bound: str, seconds: float) -> None:
        """The queue's head waited ``seconds`` more because of ``bound`` (:data:`ADMISSION_HOLDS`)."""

    def host(self, phase: str, seconds: float) -> None:
        """Scheduler-thread time spent in ``phase`` (see :attr:`EngineStats.host_s`)."""

    def chunk(self, chunk: AudioChunk, latency_s: float | None) -> None: ...

    def finished(self, event: RequestFinished) -> None: ...


@dataclass
class EngineStats:
    """Step and batch-size counters (live occupancy: ``EngineCore.active_count``,
    ``queue_depth``, ``kv_slots_used``)."""

    steps: int = 0
    last_lm_batch: int = 0
    last_t2w_batch: int = 0
    lm_batches: dict = field(default_factory=dict)
    t2w_batches: dict = field(default_factory=dict)
    #: host (scheduler-thread) seconds per phase, cumulative: ``prefill`` / ``decode`` (issuing
    #: the LM work), ``lm_sync`` (waiting for the step's log-probs), ``sampling``, ``t2w_launch``
    #: (issuing a token2wav batch), ``t2w_sync`` (blocked on a token2wav batch), ``emit``
    #: (handing out its chunks). Where the scheduler's time goes when the GPU is not the limit.
    host_s: dict = field(default_factory=dict)
    #: requests admitted (queued -> active), and those admitted after a later arrival
    admitted: int = 0
    admitted_out_of_order: int = 0
    #: seconds the queue's head waited while it could have been admitted but for one bound, per bound
    #: (:data:`ADMISSION_HOLDS`), cumulative: which bound makes the queue wait
    admission_held_s: dict = field(default_factory=dict)

    def add_host(self, phase: str, seconds: float) -> None:
        self.host_s[phase] = self.host_s.get(phase, 0.0) + seconds


class _Marks:
    """Device-side timestamps of enqueued work: CUDA events on CUDA, the host clock on CPU
    (where work runs synchronously)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self, stream=None):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    @staticmethod
    def seconds(a, b) -> float:
        """Between two marks whose work has completed."""
        return a.elapsed_time(b) / 1000.0 if isinstance(a, torch.cuda.Event) else b - a


@dataclass
class _LMTicket:
    """One issued LM step whose results the host has not read yet: its ``rows`` (request,
    segment) in order; ``tokens`` int64 ``[rows]`` (CPU, filled by an asynchronous copy) sampled
    on the device, or None; ``host_rows``, the rows sampled on the host, with their log-probs
    ``logp_host [len(host_rows), V]`` (CPU, asynchronous copy); ``event``, the mark after those
    copies (a CUDA event, or a host timestamp on CPU); ``spans``, the stage marks to report;
    ``t2w_busy`` / ``t2w_epoch``: whether a token2wav batch was in flight when the step was issued, and
    how many batches had been launched by then (the step ran alone on the device if neither says otherwise
    when it is read)."""

    rows: list
    tokens: torch.Tensor | None
    host_rows: list
    logp_host: torch.Tensor | None
    event: object
    spans: list
    t2w_busy: bool = False
    t2w_epoch: int = 0


class EngineCore:
    """Continuous-batching scheduler over the speech LM and token2wav (see module doc)."""

    def __init__(self, models: CosyVoice2Models, config: EngineConfig = EngineConfig(),
                 observer: EngineObserver | None = None):
        if models.llm is None or (models.flow is None) != (models.hift is None):
            raise ValueError("the engine needs the LM, and the flow and HiFT together (or neither: LM only)")
        self.models = models
        self.cfg = config
        self.observer = observer or EngineObserver()
        self.lm = models.llm
        self.sample_rate = models.cfg.sample_rate
        from .token2wav import make_token2wav  # CosyVoice2 / CosyVoice3 / DiT (--token2wav-dir)

        #: the token2wav backend; None for an LM-only engine (``serve --llm-only``: no flow or HiFT
        #: loaded, only ``SynthesisParams.lm_only`` requests accepted)
        self.t2w = make_token2wav(models) if models.flow is not None else None
        self._marks = _Marks(self.lm.llm_decoder.weight.is_cuda)
        if self.lm.max_positions < config.kv_max_len:
            self.lm.setup_rope(config.kv_max_len)
        use_graphs = config.cuda_graphs and self.lm.llm_decoder.weight.is_cuda
        config = self.cfg = self._resolve_queue_bound(self._resolve_flow_stream_cache(config, graphed=use_graphs))
        self._device_sampling = self.lm.llm_decoder.weight.is_cuda if config.device_sampling is None \
            else config.device_sampling
        # with CUDA graphs, one extra (scratch) slot absorbs the padding rows of a bucket
        self.cache = KVCache.allocate(self.lm, config.max_active + int(use_graphs), config.kv_max_len)
        # device sampling: each slot's last token and repetition window live on the device, so on
        # CUDA the next decode step is issued before the host has read this one's tokens
        self._state = DecodeState.allocate(self.cache.n_slots, models.cfg.llm.sampling.win_size,
                                           self.cache.k.device) if self._device_sampling else None
        self._pipeline = (self.cache.k.is_cuda if config.pipeline_decode is None else config.pipeline_decode) \
            and self._device_sampling
        #: pipelined decoding: the steps in flight whose tokens the host has not read, oldest first
        self._lm_pending: deque[_LMTicket] = deque()
        self.decoder = self.prefill_graphs = None
        self._pending_warmup: list = []  # graph grids the first step() captures (see t2w_graph_warmup)
        self.graph_capturer = None  # background capture of the warmed grids (graph_capture="background")
        self._t2w_stages: list = []  # the token2wav stages' bucketed CUDA graphs (_t2w_graphs)
        background = config.graph_capture == "background"
        if use_graphs:
            from ..models.graphs import GraphedDecoder, GraphedPrefill

            sampling = models.cfg.llm.sampling if self._device_sampling else None
            self.decoder = GraphedDecoder(self.lm, self.cache, config.max_active, sampling=sampling,
                                          eos_id=self._min_len_mask, state=self._state)
            if not background:
                self.decoder.warmup()  # capture every (batch, KV length) bucket now, not mid-request
            self.prefill_graphs = GraphedPrefill(self.lm, self.cache, pool=self.decoder.pool,
                                                 max_batch=config.max_active, max_tokens=config.max_prefill_tokens)
            self._t2w_stages = self._t2w_graphs(models, config) if self.t2w is not None else []
            t2w = self._t2w_stages if config.t2w_graph_warmup else []
            if background:  # decode first (every token), then prefill, HiFT and flow taking turns
                from ..models.graphs import BackgroundCapturer

                rest = ([self.prefill_graphs] if config.graph_warmup else []) + t2w
                self.graph_capturer = BackgroundCapturer([[self.decoder], rest], device=self.cache.k.device,
                                                         prime=config.graph_priming)
            else:
                if config.graph_warmup:  # every reachable prefill bucket now, none while serving
                    self.prefill_graphs.warmup()
                # captured by warmup() or the first step(), on the stepping thread
                self._pending_warmup = t2w[::-1]
        self._set_flow_stream_cache(models, config)
        self._set_hift_f0(models, config)
        self._free_slots = list(range(config.max_active))
        # on CUDA, token2wav batches run on their own CUDA stream while LM decoding continues;
        # launched from this thread (default) or from a worker thread (EngineConfig.t2w_thread)
        self._t2w_stream = torch.cuda.Stream(device=self.cache.k.device) if self.cache.k.is_cuda else None
        self._lm_stream = None
        if self.cache.k.is_cuda and config.lm_stream_priority:
            # the lowest number is the highest priority; out-of-range values are clamped to it
            self._lm_stream = torch.cuda.Stream(device=self.cache.k.device, priority=-100)
            self._lm_stream.wait_stream(torch.cuda.current_stream(self.cache.k.device))  # set-up work above
        self._batch_s = None  # moving average of a token2wav batch's duration (adaptive slack)
        self._worker = None
        if config.t2w_thread and self.t2w is not None:
            self._worker = Token2WavWorker(self.t2w, self._t2w_stream, self._marks)
            weakref.finalize(self, self._worker.stop)  # an engine dropped without close() frees its thread
        if self.graph_capturer is not None:  # likewise the capture thread
            weakref.finalize(self, self.graph_capturer.stop, 60)
        self._inflight = None
        self._stop_ids = frozenset(models.cfg.llm.stop_token_ids)
        self._sampler = self._new_sampler()  # batched sampling for rows with the default sampler
        self._waiting: OrderedDict[str, RequestState] = OrderedDict()
        self._active: OrderedDict[str, RequestState] = OrderedDict()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._n_requests = 0  # waiting + active + not yet processed adds
        self._ids: set[str] = set()  # their request ids (an id may be in progress only once)
        self.stats = EngineStats()
        self._init_admission(models, config, self.cache.k.device)

    def _init_admission(self, models, config: EngineConfig, device: torch.device) -> None:
        """Admission control's state (module doc, step 2): the policy (``auto`` on CUDA, else
        ``off``, unless ``config.admission`` says), the capacity model (always fed, so the
        estimate is reported in every mode), the memory bound (CUDA, auto mode) and the limit in
        effect. ``device``: where the token2wav stage's stream states live (the memory bound reads
        it). Needs ``self.t2w`` (its ``chunk_cost_grows`` picks the token2wav price: per cost unit,
        ``cost_tokens``, where chunks cost more the longer a stream runs, else per audio second)."""
        self._state_device = device
        self.admission = config.admission or AdmissionPolicy("auto" if device.type == "cuda" else "off")
        self.capacity_model = CapacityEstimator(models.cfg.token_frame_rate, target=config.admission_target,
                                                max_streams=config.max_active, lm_alone=config.admission_lm_alone,
                                                start_cost=config.admission_start_cost,
                                                contention_fit=config.admission_contention_fit,
                                                t2w_price="cost" if getattr(self.t2w, "chunk_cost_grows", True)
                                                else "audio")
        if config.admission_trace:
            self.capacity_model.start_trace(AdmissionTrace(config.admission_trace),
                                            pace_half_life_s=config.admission_pace_half_life_s,
                                            slack_margin_s=config.admission_slack_margin_s,
                                            slack_recover_s=config.admission_slack_recover_s)
            log.info("admission trace: recording the capacity model's inputs and estimates into %s",
                     config.admission_trace)
        self._t2w_host_s = 0.0  # scheduler-thread token2wav seconds since the last batch was emitted
        self._t2w_epoch = 0  # token2wav batches launched (an LM step ran alone if none was launched meanwhile)
        # the feedback cap from chunk deadlines (auto admission)
        self.slack_guard = SlackGuard(margin_s=config.admission_slack_margin_s,
                                      recover_s=config.admission_slack_recover_s)
        #: the latency pace the capacity is read at, averaged over time (``admission_pace_half_life_s``)
        self.pace_average = PaceAverage(config.admission_pace_half_life_s)
        self._last_admitted_arrival = float("-inf")
        self._logged_capacity: int | None = None
        self._memory_bound_logged = False
        self._memory_cap: int | None = None  # the latest memory bound on active streams (auto admission)
        self._memory: DeviceMemory | None = None  # created on first use (CUDA only)
        self._memory_logged: int | None = None  # the memory bound last logged
        self._limit_reason = "max_active"  # the bound that set self._limit (ADMISSION_HOLDS)
        self._held: tuple[str, float] | None = None  # (bound, since when) while the queue's head waits
        self._limit = self._admission_limit()

    def _t2w_graphs(self, models, config: EngineConfig) -> list:
        """Build the token2wav stages' CUDA graphs (not captured yet) on the models, as the
        budgets of ``config`` bound them: the flow (CosyVoice2 U-Net and CosyVoice3 DiT through
        :class:`~cosyserve.models.graphs.GraphedFlow`; the Step-Audio2 DiT's whole-solve graphs,
        :class:`~cosyserve.models.dit_flow.GraphedDiTSolve`, for the buckets its streams reach:
        :meth:`_plan_dit_graphs`), HiFT's decoder (CosyVoice2) or causal trunk (CosyVoice3). Returns
        the bucketed stages (captured ahead of use with ``t2w_graph_warmup``, else on first use)."""
        from ..models.graphs import GraphedFlow, GraphedHiFTDecoder

        ratio = models.cfg.token_mel_ratio
        dit = getattr(models, "dit", None)
        cv3 = getattr(models.cfg, "is_cosyvoice3", False) and dit is None
        if cv3:  # CosyVoice3: its DiT flow through the same GraphedFlow grid, the causal HiFT's trunk graphed
            log.info("CosyVoice3: the flow (DiT) and the causal HiFT's trunk run as CUDA graphs (HiFT over a "
                     "bounded window per chunk)")
        if dit is not None:  # Step-Audio2: whole-solve graphs for the buckets its streams reach
            if models.flow.graph is None:
                models.flow.enable_cuda_graphs()
            lo, hi = config.stream_prompt_s
            rate = models.cfg.token_frame_rate
            self._plan_dit_graphs(models.flow.graph, range(max(1, round(lo * rate)), max(1, round(hi * rate)) + 1),
                                  models, config)
            # as the grids' buckets outside what is warmed: eager, unless --lazy-graphs (captured on use)
            models.flow.graph.capture_on_use = not config.t2w_graph_warmup
        elif dit is None and getattr(models.flow, "graph", None) is None:
            models.flow.graph = GraphedFlow(models.flow, config.max_t2w_batch, max_tokens=config.kv_max_len,
                                            max_area=config.max_t2w_tokens,
                                            max_quad=config.max_t2w_tokens * T2W_ATTENTION_LEN)
            if config.flow_stream_cache == "prefix" and getattr(self.t2w, "supports_prompt_prefixes", False):
                from ..models.graphs import GraphedPrefixFlow  # prefixed streaming solves: their own graphs

                self._enable_prompt_prefixes(config)
                models.flow.prefix_graph = GraphedPrefixFlow(models.flow, self.t2w.prefix_pool.pool,
                                                             models.flow.graph.grid)
        on_cuda = next(models.hift.parameters()).is_cuda
        if cv3 and getattr(models.hift, "graph_trunk", 1) is None and on_cuda:
            from ..models.graphs import GraphedCausalHiFTTrunk  # HiFT input per job: window + new frames

            look = sum(models.hift.stream_margins)
            models.hift.graph_trunk = GraphedCausalHiFTTrunk(
                models.hift, config.max_t2w_batch, max_frames=ratio * config.kv_max_len + look,
                max_area=ratio * config.max_t2w_tokens + look * config.max_t2w_batch)
        if not cv3 and models.hift.graph_decode is None and on_cuda:
            # HiFT input per job: the chunk's new frames plus the stream's mel overlap
            extra = DEFAULT_MEL_CACHE_LEN
            models.hift.graph_decode = GraphedHiFTDecoder(
                models.hift, config.max_t2w_batch, max_frames=ratio * config.kv_max_len + extra,
                max_area=ratio * config.max_t2w_tokens + extra * config.max_t2w_batch)
        prefix = getattr(getattr(models.flow, "prefix_graph", None), "stages", [])
        return [g for g in (getattr(models.hift, "graph_decode", None), getattr(models.hift, "graph_trunk", None),
                            getattr(models.flow, "graph", None), *prefix) if g is not None and hasattr(g, "pending")]

    @staticmethod
    def _plan_dit_graphs(graph, prompt_tokens, models, config: EngineConfig) -> int:
        """Add to the Step-Audio2 DiT solve stage ``graph`` the buckets that streams with flow
        prompts of ``prompt_tokens`` tokens (an iterable of ints) reach under
        ``config.stream_chunk_policy`` (None: the DiT default): per prompt length the set-up and
        every chunk's (frames, cache) of :func:`~cosyserve.models.dit_flow.stream_solve_shapes`
        over the policy's hops for segments of up to ``kv_max_len`` tokens, and offline utterances
        (prompt + up to ``DIT_OFFLINE_MAX_S`` of target tokens in one pass, batches of up to
        ``DIT_OFFLINE_ROWS``), then
        :meth:`~cosyserve.models.dit_flow.GraphedDiTSolve.plan` (rows up to ``max_t2w_batch``
        within the scheduler's ``max_t2w_tokens`` budgets; every frames x cache pair, since a mixed
        batch pads to the largest of each). Returns the stage's planned bucket count (logged when
        it changed)."""
        from ..models.dit_flow import TRIM_KEEP, stream_solve_shapes

        flow = models.flow
        spec = config.stream_chunk_policy or default_chunk_policy(dit=True)
        policy = ChunkPolicy.parse(spec, lookahead=flow.pre_lookahead_len)
        setups: set = set()
        chunks: set = set()
        ps = sorted({int(n) for n in prompt_tokens if int(n) >= 1})
        for p in ps:
            s, c = stream_solve_shapes(p, policy.hops(p, config.kv_max_len), flow.pre_lookahead_len, flow.up_rate,
                                       TRIM_KEEP)
            setups |= s
            chunks |= c
        before = len(graph.keys())
        budget = config.max_t2w_tokens  # the scheduler's batch budget (_t2w_fits without a grid)
        dev = graph.device
        # no bucket whose buffers (held once captured) exceed the configured share of the device's memory
        # (at full size a 64-row bucket of 75 frames + 640 cached is 28 GB)
        max_bytes = int(config.dit_graph_memory * torch.cuda.get_device_properties(dev).total_memory) \
            if dev.type == "cuda" else None
        # offline utterances: one pass over prompt + every target token (up to DIT_OFFLINE_MAX_S), no cache
        longest = min(config.kv_max_len, round(DIT_OFFLINE_MAX_S * models.cfg.token_frame_rate))
        offline = set(range(flow.up_rate * (min(ps) + 1), flow.up_rate * (max(ps) + longest) + 1,
                            flow.up_rate)) if ps else set()
        n = graph.plan(setups, chunks, config.max_t2w_batch, up_rate=flow.up_rate, max_bytes=max_bytes,
                       fits=lambda rows, tokens: within_budgets(rows, tokens, budget, budget * T2W_ATTENTION_LEN),
                       offline=offline, offline_rows=DIT_OFFLINE_ROWS)
        # chunk batches stay within the rows whose buffers fit at the largest chunk frames and cache
        # planned: a larger batch would run eagerly on fresh buffers of its bucket (tens of GB at full
        # size: the H100 ran out of memory at ~96 streams, docs/perf.md "Session 25")
        chunk_keys = [k for k in graph.keys() if k[2] > 0]
        if max_bytes is not None and chunk_keys:
            fmax, cmax = max(k[1] for k in chunk_keys), max(k[2] for k in chunk_keys)
            fitting = [r for r in graph.rows_buckets(config.max_t2w_batch)
                       if graph.buffer_bytes((r, fmax, cmax)) <= max_bytes]
            graph.max_rows = max(fitting, default=1)
        if n != before:
            top = max(graph.buffer_bytes(k) for k in graph.keys()) if n and graph.flow is not None else 0
            log.info("DiT solve graphs: %d buckets planned (chunk policy %s; %d set-up and %d chunk shapes, offline "
                     "utterances up to %d frames; rows up to %d within --max-t2w-tokens %d); shared buffers %.2f GB "
                     "(the largest bucket's)", n, spec, len(setups), len(chunks), max(offline, default=0),
                     config.max_t2w_batch, budget, top / 2**30)
        return n

    def plan_stream_prompts(self, prompt_tokens) -> int:
        """Tell the engine the flow prompt lengths (tokens, an iterable of ints) of the voices it
        will serve, e.g. the registered voices'. With a Step-Audio2 DiT token2wav directory and
        CUDA graphs, the solve buckets their streams reach are planned (the first non-empty call
        replaces the default plan for prompts of ``stream_prompt_s``; later calls add), which
        :meth:`warmup` or the background capturer capture: call it before
        :meth:`start_graph_capture` (buckets planned after a background capture started stay
        eager). Returns the number of planned DiT buckets (0 without DiT solve graphs)."""
        from ..models.dit_flow import GraphedDiTSolve

        graph = getattr(self.models.flow, "graph", None)
        if not isinstance(graph, GraphedDiTSolve) or not any(g is graph for g in self._t2w_stages):
            return 0
        prompt_tokens = [int(n) for n in prompt_tokens]
        if prompt_tokens:
            # the first voices told replace the default plan (prompts of stream_prompt_s): a server
            # whose voices are known captures only what they reach (fewer graphs, faster start-up)
            graph.replace_default_plan()
        n = self._plan_dit_graphs(graph, prompt_tokens, self.models, self.cfg)
        if self.cfg.t2w_graph_warmup and self.graph_capturer is None and graph.pending() \
                and not any(g is graph for g in self._pending_warmup):
            self._pending_warmup.append(graph)  # captured by the next warmup() / first step()
        return n

    def _resolve_flow_stream_cache(self, config: EngineConfig, graphed: bool) -> EngineConfig:
        """``config`` with ``flow_stream_cache`` auto (None) resolved for this engine's token2wav path
        (:attr:`t2w`, set before; ``graphed``: its token2wav stages run as CUDA graphs): ``"prefix"`` for a
        graphed CosyVoice2 U-Net (measured on an H200 in sessions 38-40: 90-96 listening streams and 68-ms first
        chunks against 77-80 streams without; docs/perf.md), ``True`` (per-stream caches) where the flow runs
        eagerly, ``False`` for other graphed flows (no per-stream caches with graphs). An explicit mode is kept."""
        if config.flow_stream_cache is not None or self.t2w is None:
            return config
        if graphed and getattr(self.t2w, "supports_prompt_prefixes", False):
            mode = "prefix"
        else:
            mode = not graphed
        return dataclasses.replace(config, flow_stream_cache=mode)

    @staticmethod
    def _resolve_queue_bound(config: EngineConfig) -> EngineConfig:
        """``config`` with ``t2w_queue_s`` "auto" resolved (after ``flow_stream_cache``): :data:`T2W_QUEUE_S`
        when the flow recomputes each chunk's whole history (``flow_stream_cache`` False), else None. Measured
        on an H200 (session 44): with recomputation the bound took the UNet from 80 to 96 streams, 40 scheduler
        gaps of >= 100 ms to 1 and an overload from 11 stalled to 0, the one-stream first chunk unchanged; with
        prompt prefixes (short steps, few gaps) it gained nothing (1 + 2 stalls against 0 at 104 clients)."""
        if config.t2w_queue_s != "auto":
            return config
        return dataclasses.replace(config, t2w_queue_s=T2W_QUEUE_S if config.flow_stream_cache is False else None)

    def _set_flow_stream_cache(self, models, config: EngineConfig) -> None:
        """Per-stream flow caches (``EngineConfig.flow_stream_cache``, auto resolved by
        :meth:`_resolve_flow_stream_cache`), after the graphs were set up: with a backend that supports them
        (CosyVoice2's U-Net, CosyVoice3's DiT) each streaming segment gets one from
        ``t2w.new_flow_cache`` at its first chunk (``SegmentState.flow_cache``, passed in its jobs,
        freed at its final chunk): :attr:`_flow_stream_cache`."""
        if config.flow_stream_cache == "prefix":
            self._flow_stream_cache = False
            if getattr(self.t2w, "supports_prompt_prefixes", False):
                self._enable_prompt_prefixes(config)
            else:
                log.info("flow prompt prefixes: not supported by this token2wav path (off)")
            return
        on = bool(config.flow_stream_cache)  # (auto was resolved: _resolve_flow_stream_cache)
        supported = bool(getattr(self.t2w, "supports_flow_cache", False))
        #: streaming segments carry per-stream flow caches
        self._flow_stream_cache = supported and on
        if supported:
            family = "CosyVoice3" if getattr(models.cfg, "is_cosyvoice3", False) else "CosyVoice2"
            log.info("%s flow stream cache: %s", family, "on" if on else "off")

    def _enable_prompt_prefixes(self, config: EngineConfig) -> None:
        """``--flow-stream-cache prefix``: the voices' prompt prefix pool on the token2wav backend (once)."""
        if getattr(self.t2w, "prefix_pool", None) is not None:
            return
        self.t2w.enable_prompt_prefixes(config.flow_prefix_slots, config.flow_stream_cache_frames or FLOW_PREFIX_FRAMES,
                                        background=config.flow_prefix_build == "background")
        log.info("CosyVoice2 flow: voice prompt prefixes for %d voices (%d frames each, %.2f GB)",
                 config.flow_prefix_slots, self.t2w.prefix_pool.pool.max_frames, self.t2w.prefix_pool.nbytes() / 1e9)

    def prebuild_prompt_prefixes(self, voices: list) -> bool:
        """(Thread-safe.) With ``--flow-stream-cache prefix``: build the voice prompt prefixes of ``voices``
        (:class:`~cosyserve.frontend.voice.Voice`, most likely used first; as many as the pool has free slots) on
        the engine thread before its next step, so that the first streams of these voices do not pay the eager
        build while others stream (:meth:`~cosyserve.engine.token2wav.VoicePrefixPool.prebuild`). For a server's
        registered voices at start-up. Returns False (nothing queued) where the mode is off or the token2wav path
        has no prompt prefixes."""
        if getattr(self.t2w, "prefix_pool", None) is None or not voices:
            return False
        self._inbox.put(("prefixes", list(voices)))
        return True

    def _prebuild_prompt_prefixes(self, voices: list) -> None:
        t0 = time.perf_counter()
        built = self.t2w.prefix_pool.prebuild(voices)
        log.info("prebuilt %d voice prompt prefixes of %d voices in %.2f s", built, len(voices),
                 time.perf_counter() - t0, extra={"event": "prefix_prebuild", "built": built, "voices": len(voices)})

    def _set_hift_f0(self, models, config: EngineConfig) -> None:
        """``EngineConfig.hift_f0`` onto the vocoder: ``batched`` sets
        :attr:`~cosyserve.models.hift.HiFTGenerator.batched_f0` (the CosyVoice2 HiFT, which the DiT
        token2wav uses too; CosyVoice3's causal HiFT predicts F0 per item in float64 either way)."""
        hift = getattr(models, "hift", None)
        if hift is not None and hasattr(hift, "batched_f0") and not getattr(hift.cfg, "causal", False):
            hift.batched_f0 = config.hift_f0 == "batched"
            if hift.batched_f0:
                log.info("HiFT F0: one masked float64 pass per token2wav batch (--hift-f0 batched)")

    # ------------------------------------------------------------------ public API
    def _new_sampler(self) -> UpstreamSampler:
        return UpstreamSampler(self.models.cfg.llm.sampling, eos_id=self._min_len_mask)

    @property
    def _min_len_mask(self) -> "int | range":
        """The ids masked before a segment's ``min_len``: upstream's one id, or with
        ``strict_min_len`` every stop id (see :class:`EngineConfig`)."""
        c = self.models.cfg.llm
        if self.cfg.strict_min_len:
            stops = c.stop_token_ids
            return range(min(stops), max(stops) + 1)
        return c.min_len_mask_id

    def prefix_len(self, req: EngineRequest, seg_ids: torch.Tensor) -> int:
        v = req.voice
        return 2 + v.prompt_text_ids.numel() + seg_ids.numel() + v.llm_speech_token.numel()

    def add_request(self, req: EngineRequest) -> RequestState:
        """Queue a request (thread-safe). Raises :class:`QueueFullError` when the engine is
        full and :class:`InvalidInputError` when a segment cannot fit the KV cache or a request
        with the same id is still in progress (it would take over that request's state)."""
        if self.t2w is None and not req.params.lm_only:
            raise InvalidInputError("this engine runs the speech LM only (no token2wav loaded, serve --llm-only): "
                                    "it serves speech-token requests, not audio", field="model")
        for i, ids in enumerate(req.segments):
            room = self.cfg.kv_max_len - self.prefix_len(req, ids)
            if room < max(1, req.params.token_bounds(int(ids.numel()))[0]) + 1:
                raise InvalidInputError(
                    f"text segment {i} with this prompt needs more than the {self.cfg.kv_max_len} positions of the "
                    "KV cache; use a shorter prompt or text", field="input")
        st = RequestState.create(req, self.models.cfg.llm.speech_token_size, self._new_sampler)
        for seg in st.segments:
            seg.silent = SilentTokenFilter.for_config(self.models.cfg.llm)  # one per segment (upstream llm_job)
            seg.max_len = min(seg.max_len, self.cfg.kv_max_len - self.prefix_len(req, seg.text_ids))
        with self._lock:
            if req.request_id in self._ids:
                raise InvalidInputError(f"request id {req.request_id!r} is already in progress", field="id")
            limit = self._limit  # set by the engine thread; an int, read atomically
            if self._n_requests >= limit + self.cfg.max_queue:
                raise QueueFullError(
                    f"server busy: {self._n_requests} requests in progress or queued "
                    f"(admitting {limit} at once, max_queue={self.cfg.max_queue})")
            self._n_requests += 1
            self._ids.add(req.request_id)
        self._inbox.put(("add", st))
        return st

    def abort(self, request_id: str, outcome: Outcome = Outcome.ABORTED) -> None:
        """Cancel a request (thread-safe); its slot and caches are freed at the next step."""
        self._inbox.put(("abort", request_id, outcome))

    def reset_capacity_model(self) -> None:
        """(Thread-safe.) Forget what the capacity model measured (:meth:`~cosyserve.engine.admission.CapacityEstimator
        .reset`: ``initial`` streams and slow start again, as on a fresh server) and drop the slack guard's cap, on
        the engine thread before its next step (in order with later requests and :meth:`set_calibrating`); the
        streams admitted already keep running. ``POST /admin/admission/reset``."""
        self._inbox.put(("reset_capacity",))

    def set_calibrating(self, on: bool) -> None:
        """(Thread-safe.) Set the capacity model's :attr:`~cosyserve.engine.admission.CapacityEstimator.calibrating`
        on the engine thread before its next step (in order with the requests added after: the LM steps of
        requests added after ``on`` and finished before ``off`` feed only its fits of the steps alone).
        :meth:`cosyserve.engine.async_engine.AsyncEngine.calibrate_admission` brackets its requests with it."""
        self._inbox.put(("calibrate", bool(on)))

    def admission_settings(self) -> dict:
        """(Thread-safe read.) The admission settings in effect, under the names :meth:`set_admission` takes:
        ``mode`` (``"auto"``, ``"off"`` or the fixed number of streams as text), ``target``, ``start_share``,
        ``lm_alone``, ``start_cost``, ``slack_margin`` (seconds), ``slack_recover`` (seconds per stream),
        ``contention_fit``, ``pace_half_life`` (seconds) (the ``--admission*`` options)."""
        return {key: str(self.admission) if key == "mode" else getattr(self.cfg, name)
                for key, name in ADMISSION_SETTINGS.items()}

    def set_admission(self, **changes) -> dict:
        """(Thread-safe.) Change admission settings while serving, keeping what the capacity model has measured:
        ``mode`` (``"auto"``, ``"off"`` or a number of streams), ``target`` (0-1], ``start_share`` (0-1],
        ``lm_alone``, ``start_cost`` (bools), ``slack_margin`` (seconds >= 0), ``slack_recover`` (seconds per stream,
        > 0), ``contention_fit`` (bool), ``pace_half_life`` (seconds >= 0) — the ``--admission``,
        ``--admission-target``, ``--admission-start-share``, ``--admission-lm-alone``, ``--admission-start-cost``,
        ``--admission-slack-margin``, ``--admission-slack-recover`` (the slack guard's close-call margin and recovery
        rate), ``--admission-contention-fit``, ``--admission-pace-half-life`` options. Checked at once
        (raises :class:`~cosyserve.errors.InvalidInputError` naming the setting: unknown, wrong type or out of
        range); applied by the engine thread before its next step, so the streams admitted already keep running
        and the next admission decision uses the new settings (the slack guard's cap, measured under the old
        ones, is dropped). Returns the settings as they will be (what
        :meth:`admission_settings` reads once applied). For operators tuning a live server and for benchmarks
        that compare settings without a restart (the graphs' capture makes one ~3.5 min on an H100)."""
        names = ADMISSION_SETTINGS
        fields = {}
        for key, value in changes.items():
            if key not in names:
                raise InvalidInputError(f"unknown admission setting {key!r} (one of {', '.join(names)})", key)
            if key in ("lm_alone", "start_cost", "contention_fit") and not isinstance(value, bool):
                raise InvalidInputError(f"admission setting {key!r} must be true or false, got {value!r}", key)
            if key in _NUMBER_SETTINGS and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise InvalidInputError(f"admission setting {key!r} must be {_NUMBER_SETTINGS[key]}, got {value!r}", key)
            if key == "mode":
                try:
                    value = AdmissionPolicy.parse(value)
                except ValueError as exc:
                    raise InvalidInputError(f"admission mode: {exc}", key) from None
            fields[names[key]] = value
        for key in changes:  # EngineConfig's own checks, each field on its own (the error names its setting)
            try:
                dataclasses.replace(self.cfg, **{names[key]: fields[names[key]]})
            except ValueError as exc:
                raise InvalidInputError(f"admission setting {key!r}: {exc}", key) from None
        self._inbox.put(("admission", fields))  # only the fields named: two quick changes both hold
        out = self.admission_settings()
        out.update({key: str(fields[names[key]]) if key == "mode" else fields[names[key]] for key in changes})
        return out

    def _apply_admission(self, fields: dict) -> None:
        """(Engine thread.) :meth:`set_admission`'s settings take effect: the policy, the capacity model's target
        and prices (its measurements kept), the starting streams' share, the slack guard's margin and recovery
        rate, the latency pace's averaging half-life (its average kept); the slack guard's cap is dropped (the next close
        call cuts afresh); the limit is recomputed at once."""
        before = self.admission_settings()
        cfg = self.cfg = dataclasses.replace(self.cfg, **fields)
        if cfg.admission is not None:
            self.admission = cfg.admission
        m = self.capacity_model
        m.target, m.start_cost = cfg.admission_target, cfg.admission_start_cost
        m.device.price_lm_alone = cfg.admission_lm_alone  # (the host fits its steps as they ran)
        m.contention_fit = cfg.admission_contention_fit
        self.slack_guard.margin_s = cfg.admission_slack_margin_s
        self.slack_guard.recover_s = cfg.admission_slack_recover_s
        self.pace_average.half_life_s = cfg.admission_pace_half_life_s
        self.slack_guard.release()  # a cap from close calls under the old settings starts over
        self._limit = self._admission_limit()
        after = self.admission_settings()
        log.info("admission settings changed: %s", ", ".join(f"{k} {before[k]} -> {v}" for k, v in after.items()
                                                               if before[k] != v) or "no change",
                 extra={"event": "admission_settings", **{f"admission_{k}": v for k, v in after.items()}})

    def close(self) -> None:
        """Stop the graph capture thread (after the capture in progress) and the token2wav
        thread (after its batch in flight); the engine is unusable after."""
        if self.graph_capturer is not None:
            self.graph_capturer.stop(timeout=60)
        if self._worker is not None:
            self._worker.close()
        if getattr(self.t2w, "prefix_pool", None) is not None:
            self.t2w.prefix_pool.close()
        if self.capacity_model.trace is not None:
            self.capacity_model.trace.close()

    def has_work(self) -> bool:
        return bool(self._active or self._waiting or self._inflight is not None or self._lm_pending
                    or not self._inbox.empty())

    @property
    def n_requests(self) -> int:
        """Requests accepted and not yet finished (queued + active)."""
        return self._n_requests

    @property
    def queue_depth(self) -> int:
        """Requests accepted but not yet active (waiting for capacity)."""
        return self._n_requests - len(self._active)

    @property
    def active_count(self) -> int:
        return len(self._active)

    @property
    def kv_slots_used(self) -> int:
        return self.cfg.max_active - len(self._free_slots)

    @property
    def admission_limit(self) -> int:
        """Requests that may be active at once now (``max_active``, or less with admission control)."""
        return self._limit

    @property
    def capacity_streams(self) -> float:
        """The real-time capacity in streams as admission sees it: the estimate (with slow
        start; at most the device-memory bound, :meth:`_memory_limit`) in ``auto`` mode, N in fixed mode; in ``off`` mode the estimate, not enforced
        (NaN before anything was measured). Capped at ``max_active``."""
        if self.admission.mode == "fixed":
            return float(min(self.admission.streams, self.cfg.max_active))
        if self.admission.mode == "auto":
            mem, cap = self._memory_cap, self._slack_capped(self.capacity_model.last)
            return float(cap if mem is None else max(1, min(cap, mem)))
        est = self.capacity_model.last_estimate
        return float("nan") if est is None else float(max(1, min(int(min(est, 1e9)), self.cfg.max_active)))

    @property
    def load_ratio(self) -> float:
        """Admitted streams / :attr:`capacity_streams` (> 1: more admitted than can stay real time)."""
        cap = self.capacity_streams
        return float("nan") if not cap > 0 else len(self._active) / cap

    # ------------------------------------------------------------------ step
    def warmup(self) -> None:
        """Capture every CUDA graph still pending now and return when they are all captured:
        with ``graph_capture="startup"`` the flow/HiFT grids (~100 s at full size), on the
        calling thread; with ``"background"`` the capture thread is started (if it was not) and
        waited for. Benchmarks call it for graphs from the first request; the server does not
        (:meth:`start_graph_capture`). Nothing to do on CPU or once everything is captured."""
        pending, self._pending_warmup = self._pending_warmup, []
        for graphs in pending:
            graphs.warmup()
        if self.graph_capturer is not None:
            self.start_graph_capture()
            self.graph_capturer.wait()

    def start_graph_capture(self, wait_primed: bool = True) -> None:
        """Begin capturing the pending CUDA graphs: ``"startup"`` mode captures the flow/HiFT
        grids now (:meth:`warmup`); ``"background"`` mode starts the capture thread and, with
        ``wait_primed``, waits for its priming (the fused kernels compiled: seconds), after which
        requests are served eagerly until their buckets' graphs are published. ``AsyncEngine``
        calls it on its thread before serving; :meth:`step` does otherwise."""
        if self.graph_capturer is None:
            self.warmup()
            return
        self.graph_capturer.start()
        if wait_primed:
            self.graph_capturer.wait_primed()

    def when_graphs_captured(self, fn) -> None:
        """Call ``fn()`` once the background capture has ended (on its thread), or now when there is
        none or it has already ended. The server re-freezes the heap then (the capture leaves its
        compiled graphs' objects behind: :mod:`~cosyserve.engine.gc_pauses`)."""
        if self.graph_capturer is None:
            fn()
        else:
            self.graph_capturer.when_done(fn)

    def graph_counts(self) -> dict[str, float]:
        """CUDA graph buckets ``captured``, ``pending`` (neither captured nor disabled, in the
        warmed grids and the decode grid), ``failed`` (disabled after a failed capture) and
        ``capture_seconds`` (spent in captures); all 0 without graphs. Thread-safe reads."""
        stages = [(g, warm) for g, warm in ((self.decoder, True), (self.prefill_graphs, self.cfg.graph_warmup))
                  if g is not None]
        stages += [(g, self.cfg.t2w_graph_warmup) for g in self._t2w_stages]  # the DiT solve stage included
        if self.graph_capturer is not None:  # whatever else it captures
            known = {id(g) for g, _ in stages}
            stages += [(g, True) for g in self.graph_capturer.stages if id(g) not in known]
        return {"captured": float(sum(g.n_graphs for g, _ in stages)),
                "pending": float(sum(len(g.pending()) for g, warm in stages if warm)),
                "failed": float(sum(g.n_failed for g, _ in stages)),
                "capture_seconds": float(sum(g.capture_s for g, _ in stages))}

    def step(self) -> list:
        """Advance every request by at most one LM token and one audio chunk; return events."""
        if self._pending_warmup:  # before any request's work
            self.warmup()
        if self.graph_capturer is not None and not self.graph_capturer.started:
            self.start_graph_capture(wait_primed=False)
        if self._lm_stream is None:
            return self._step()
        with torch.cuda.stream(self._lm_stream):
            return self._step()

    def slack_s(self) -> float:
        """Seconds before its deadline a token2wav job must be launched (``EngineConfig.t2w_slack_s``,
        or adaptive: 3x the moving average of recent batch durations, clamped)."""
        if self.cfg.t2w_slack_s is not None:
            return self.cfg.t2w_slack_s
        if self._batch_s is None:
            return T2W_SLACK_MAX_S
        return min(T2W_SLACK_MAX_S, max(T2W_SLACK_MIN_S, 3.0 * self._batch_s))

    def _step(self) -> list:
        events: list = []
        self._drain_inbox(events)
        self._expire(events)
        self._admit()
        if self._active:
            t_lm = time.perf_counter()
            # beside: a token2wav batch in flight during the step (its waits for the device then include the flow's)
            busy, epoch = self._inflight is not None, self._t2w_epoch
            lm_rows = self._lm_step(events)
            self.capacity_model.observe_lm(lm_rows, time.perf_counter() - t_lm, admitted=len(self._active),
                                           beside=busy or epoch != self._t2w_epoch or self._inflight is not None)
            if not lm_rows and self._inflight is not None:
                self._collect(events, wait=True)  # nothing else to do: block (GIL released)
            self._t2w_step(events, lm_busy=lm_rows > 0)
        else:
            self._lm_pending.clear()  # their requests are gone (aborted): nobody reads their tokens
            if self._inflight is not None:
                self._collect(events, wait=True)
        self.stats.steps += 1
        return events

    # ------------------------------------------------------------------ bookkeeping
    def _host(self, phase: str, seconds: float) -> None:
        if phase in ("t2w_launch", "emit"):
            self._t2w_host_s += seconds
        self.stats.add_host(phase, seconds)
        self.observer.host(phase, seconds)

    def _drain_inbox(self, events: list) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                st = cmd[1]
                late = bool(self._waiting) and next(reversed(self._waiting.values())).req.arrival > st.req.arrival
                self._waiting[st.request_id] = st
                if late:  # added after a request that arrived later (threads): keep arrival order
                    self._waiting = OrderedDict(sorted(self._waiting.items(), key=lambda kv: kv[1].req.arrival))
            elif cmd[0] == "slack":
                self._observe_slack(cmd[1], delivered=True)
            elif cmd[0] == "admission":
                self._apply_admission(cmd[1])
            elif cmd[0] == "prefixes":
                self._prebuild_prompt_prefixes(cmd[1])
            elif cmd[0] == "calibrate":
                self.capacity_model.calibrating = cmd[1]
            elif cmd[0] == "reset_capacity":
                self.capacity_model.reset()
                self.slack_guard.release()
                self.pace_average.reset()
                self._limit = self._admission_limit()
                log.info("admission: the capacity model's measurements were reset (capacity %d streams)", self._limit,
                         extra={"event": "admission_reset", "capacity_streams": self._limit})
            else:
                _, rid, outcome = cmd
                st = self._active.get(rid) or self._waiting.get(rid)
                if st is not None:
                    st.aborted = outcome

    def _expire(self, events: list) -> None:
        now = time.monotonic()
        for st in list(self._waiting.values()) + list(self._active.values()):
            if st.aborted is None and st.deadline is not None and now > st.deadline:
                st.aborted = Outcome.TIMEOUT
            if st.aborted is not None:
                err = TimeoutError(f"request timed out after {st.req.params.timeout_s} s") \
                    if st.aborted is Outcome.TIMEOUT else None
                self._finish(st, events, st.aborted, err)

    def _deadline(self, st: RequestState, now: float) -> float:
        """When this request's next audio is due (monotonic seconds): a stream's first chunk at
        its arrival (at once), later chunks at its playback end; an offline request (whose
        client waits for the whole utterance anyway) ``t2w_gather_s`` + ``t2w_slack_s`` after
        its audio became ready, so that while the LM is busy finished utterances gather into
        larger batches (launched once ``t2w_batch_target`` are ready, or this one is due)."""
        if not st.req.params.stream:
            return (st.t_ready or now) + self.cfg.t2w_gather_s + self.slack_s()
        if st.first_chunk_at is None:
            return st.req.arrival
        return st.first_chunk_at + st.audio_samples / self.sample_rate

    def _admission_limit(self) -> int:
        """The number of requests that may be active now (see :attr:`admission_limit`); logs
        material changes of the capacity estimate."""
        model = self.capacity_model
        head = next(iter(self._waiting.values()), None)
        states = list(self._active.values()) + ([head] if head is not None else [])
        model.speedup = max([st.speedup for st in states], default=1.0)
        # streams that have not sent START_CHUNKS chunks yet (the queue head counts as one):
        # their token2wav work is budgeted at the schedule's speed-up (admission module doc)
        streaming = [st for st in states if st.speedup > 1.0]
        model.starting_fraction = (sum(st.chunks < START_CHUNKS for st in streaming) / len(streaming)
                                   if streaming else 1.0)
        model.audio = not states or any(not st.req.params.lm_only for st in states)
        # the LM's pace if each second chunk also waits two token2wav batches, within the shortest
        # first chunk's playback (admission module doc: latency)
        hops = [st.first_hop_tokens for st in states if st.first_hop_tokens > 0]
        pace = self.pace_average.update(latency_pace(min(hops) / model.rate, 2.0 * self._batch_s)
                                        if hops and self._batch_s is not None and model.audio else 1.0,
                                        time.monotonic())
        cap = model.capacity(pace) if model.trace is None else \
            model.capacity(pace, note={"a": len(self._active), "w": len(self._waiting)})
        if self._logged_capacity is None or abs(cap - self._logged_capacity) >= max(2, 0.1 * self._logged_capacity):
            est, lat = model.last_estimate, model.last_latency_estimate
            if self._logged_capacity is not None or est is not None:
                log.info("real-time capacity estimate: %d streams (throughput %s, with batch latency %s, admission %s)", cap,
                         "unmeasured" if est is None else f"{est:.1f}", "-" if lat is None else f"{lat:.1f}",
                         self.admission,
                         extra={"event": "capacity", "capacity_streams": cap,
                                "estimate": None if est is None else round(min(est, 1e9), 2),
                                "latency_estimate": None if lat is None else round(min(lat, 1e9), 2),
                                # the parts of the latency-aware estimate, per resource (admission module doc)
                                "terms": model.terms(pace)})
                hook = getattr(self.observer, "capacity_changed", None)  # observers may be duck-typed
                if hook is not None:
                    hook(cap, est)
            self._logged_capacity = cap
        if self.admission.mode == "auto":
            mem = self._memory_limit() if self._waiting else self._memory_cap
            self._memory_cap = mem  # streams (the gauge's bound)
            # an offline request holds no stream caches: the memory bound does not hold it back, and
            # active ones count on top of the streams that fit (their batches' transient tensors are
            # in the measured peak)
            offline_head = head is not None and not head.req.params.stream
            if offline_head and not any(st.req.params.stream for st in self._active.values()):
                # offline work alone: no playback deadline to protect, so the real-time capacity does
                # not bind; offline throughput needs many rows per LM step and full token2wav batches
                # (CosyVoice3 on an H100: held at ~27 rows by the estimate, docs/perf.md "Session 28").
                # A stream that arrives meanwhile waits until the active requests fit its estimate.
                self._limit_reason = "max_active"
                return self.cfg.max_active
            guarded = self._slack_capped(cap)  # late chunks seen lately
            self._limit_reason = "slack" if guarded < cap else "capacity"
            cap = guarded
            if mem is not None and not offline_head:
                limit = mem + sum(1 for st in self._active.values() if not st.req.params.stream)
                if limit < min(cap, self.cfg.max_active):
                    if not self._memory_bound_logged:
                        log.warning("admission bounded by device memory: %d streams (per-stream caches %.0f MB; "
                                    "real-time capacity estimate %d)", mem, self.t2w.stream_state_bytes() / 1e6,
                                    cap, extra={"event": "memory_bound", "streams": mem})
                        self._memory_bound_logged = True
                    self._limit_reason = "memory"
                    return max(1, limit)
            if self.cfg.max_active < cap:
                self._limit_reason = "max_active"
            return min(cap, self.cfg.max_active)
        if self.admission.mode == "fixed":
            self._limit_reason = "fixed" if self.admission.streams < self.cfg.max_active else "max_active"
            return min(self.admission.streams, self.cfg.max_active)
        self._limit_reason = "max_active"
        return self.cfg.max_active

    def _device_memory(self) -> tuple[int, int] | None:
        """``(bytes held on the engine's device, the device's total bytes)``
        (:class:`~cosyserve.engine.admission.DeviceMemory`); None on CPU."""
        if self._state_device.type != "cuda":
            return None
        if self._memory is None:
            self._memory = DeviceMemory(self._state_device)
        return self._memory.held()

    def _memory_limit(self) -> int | None:
        """Streaming requests that may be active so that every one's per-stream token2wav caches fit
        in device memory (offline requests hold none: :meth:`_admission_limit` counts the active
        ones on top) (``auto`` admission on CUDA; None where the backend's streams hold little,
        :meth:`~cosyserve.engine.token2wav.Token2WavBackend.stream_state_bytes`, or on CPU): the
        device's memory less a reserve of ``MEMORY_RESERVE_SHARE`` and less what the rest holds
        (:meth:`_device_memory`: the recent peak of live tensors plus the graph pools' free blocks plus
        what the device holds outside this process's allocator — other workers on the same GPU —,
        minus what the active streams' caches hold now, the backend's ``state_bytes``), divided by
        the backend's ``stream_state_copies`` x the largest per-stream state seen (what each stream,
        active or not, may grow to). Without it the capacity estimate, which models time, not memory,
        admitted 106-128 DiT streams on an H100 (CUDA out of memory, docs/perf.md "Session 25")."""
        per = self.t2w.stream_state_bytes() if self.t2w is not None else 0
        mem = self._device_memory() if per > 0 else None
        if mem is None:
            return None
        held, total = mem
        streams = sum(self.t2w.state_bytes(seg.hift_state, seg.flow_cache) for st in self._active.values()
                      if st.req.params.stream for seg in st.segments)
        room = (1.0 - MEMORY_RESERVE_SHARE) * total - (held - streams)
        limit = max(0, int(room // (self.t2w.stream_state_copies * per)))
        logged = self._memory_logged
        if logged is None or abs(limit - logged) >= max(4, 0.1 * logged):  # material changes only
            outside = self._memory.outside if self._memory is not None else 0
            log.info("memory bound: %d streams (%d active; held %.1f GB: recent peak of live tensors + graph "
                     "pools' free blocks + %.1f GB outside this process's allocator; per-stream caches %.0f MB)",
                     limit, len(self._active), held / 1e9, outside / 1e9, per / 1e6,
                     extra={"event": "memory_limit", "streams": limit, "held_gb": round(held / 1e9, 2),
                            "outside_gb": round(outside / 1e9, 2)})
            self._memory_logged = limit
        return limit

    def _admit(self) -> None:
        """Activate queued requests in arrival order while fewer than the admission limit are
        active (the head of the queue is never passed over). The limit is recomputed when the head
        changes between a streaming and an offline request (the memory bound holds back streams only)
        and, under ``auto`` admission, after each stream admitted (its starting chunks lower the estimate
        the next head is admitted on)."""
        self._limit = self._admission_limit()
        now = time.monotonic()
        kind = None
        starting = None  # streams in their first START_CHUNKS chunks (auto admission)
        held = None  # the bound that holds the queue's head, if one does
        while self._waiting:
            head = next(iter(self._waiting.values()))
            if kind is not None and head.req.params.stream != kind:
                self._limit = self._admission_limit()
            kind = head.req.params.stream
            if len(self._active) >= self._limit:
                held = self._limit_reason
                break
            if head.req.params.streams_audio and self.admission.mode == "auto":
                if starting is None:
                    starting = sum(1 for st in self._active.values()
                                   if st.req.params.streams_audio and st.chunks < START_CHUNKS)
                if starting >= self._starting_limit():
                    held = "starting"
                    break  # a wave is starting: the next one once its second chunks are out
                starting += 1
            rid, st = self._waiting.popitem(last=False)
            self._active[rid] = st
            in_order = st.req.arrival >= self._last_admitted_arrival
            self._last_admitted_arrival = max(self._last_admitted_arrival, st.req.arrival)
            self.stats.admitted += 1
            self.stats.admitted_out_of_order += not in_order
            hook = getattr(self.observer, "admitted", None)
            if hook is not None:
                hook(rid, now - st.req.arrival, in_order)
            if self.admission.mode == "auto" and st.req.params.streams_audio and self._waiting:
                # the next head is priced with this newcomer among the starting streams: on one limit, computed
                # while few streams were starting, a burst from a full queue filled it and then started all at
                # once, ~15 streams over what their mix kept real time (docs/perf.md "Session 38")
                self._limit = self._admission_limit()
        self._account_hold(held, now)

    def _account_hold(self, held: str | None, now: float) -> None:
        """Charge the time since the previous :meth:`_admit` to the bound that held the queue's head then
        (``EngineStats.admission_held_s``, the observer's ``admission_held(bound, seconds)``), and note
        ``held`` (None: the queue's head is not held, or there is none) from ``now`` (monotonic seconds)."""
        if self._held is not None:
            bound, since = self._held
            sec = max(0.0, now - since)
            if sec > 0:
                self.stats.admission_held_s[bound] = self.stats.admission_held_s.get(bound, 0.0) + sec
                hook = getattr(self.observer, "admission_held", None)  # observers may be duck-typed
                if hook is not None:
                    hook(bound, sec)
        self._held = None if held is None else (held, now)

    def _starting_limit(self) -> int:
        """Streams that may be in their first ``START_CHUNKS`` chunks at once under ``auto``
        admission: ``admission_start_share`` of the admission limit, at least
        ``MIN_STARTING_STREAMS`` (:class:`EngineConfig`)."""
        return max(MIN_STARTING_STREAMS, math.ceil(self.cfg.admission_start_share * self._limit))

    def _release_slot(self, seg: SegmentState) -> None:
        if seg.slot is not None:
            self._free_slots.append(seg.slot)
            self._free_slots.sort()
            seg.slot = None

    def _finish(self, st: RequestState, events: list, outcome: Outcome, error: Exception | None = None) -> None:
        for seg in st.segments:
            self._release_slot(seg)
            seg.hift_state = type(seg.hift_state)()
            seg.flow_cache = None  # frees the stream's flow cache (an in-flight job keeps its own reference)
        self._active.pop(st.request_id, None)
        self._waiting.pop(st.request_id, None)
        with self._lock:
            self._n_requests -= 1
            self._ids.discard(st.request_id)
        now = time.monotonic()
        ev = RequestFinished(
            request_id=st.request_id, outcome=outcome, error=error,
            n_tokens=sum(len(s.tokens) for s in st.segments),
            audio_s=st.audio_samples / self.sample_rate,
            first_chunk_s=None if st.first_chunk_at is None else st.first_chunk_at - st.req.arrival,
            total_s=now - st.req.arrival, seed=st.seed, tokens=[list(s.tokens) for s in st.segments],
            stop_reasons=[s.stop_reason for s in st.segments], first_chunk_breakdown=st.first_chunk_breakdown(),
        )
        events.append(ev)
        self.observer.finished(ev)

    def _fail(self, st: RequestState, events: list, exc: Exception) -> None:
        log.error("request %s failed: %s", st.request_id, exc, exc_info=not isinstance(exc, CosyServeError))
        if st.request_id in self._active or st.request_id in self._waiting:
            self._finish(st, events, Outcome.ERROR, exc)

    # ------------------------------------------------------------------ LM
    def _lm_finish_segment(self, st: RequestState, seg: SegmentState, reason: str) -> None:
        seg.lm_done = True
        seg.stop_reason = reason
        if not st.req.params.lm_only:
            # offline: fork HiFT's generator now, before the next segment samples
            st.hift_generator(seg, self.t2w.hift_device)
        self._release_slot(seg)
        st.lm_segment += 1

    @torch.inference_mode()
    def _lm_step(self, events: list) -> int:
        """Issue one LM step — prefill of newcomers and one decode step over the running
        segments — and hand out the tokens of the previous step (pipelined: on CUDA with device
        sampling the GPU runs this step while the host reads the last one's tokens, stops
        finished segments and feeds token2wav) or of this one. Returns the rows issued (0: the
        LM had nothing to do)."""
        ticket = self._issue_lm(events)
        if not self._pipeline:
            if ticket is not None:
                self._process_lm(ticket, events)
        else:  # read the oldest step once `decode_lookahead` newer ones are issued, or nothing new was
            if ticket is not None:
                self._lm_pending.append(ticket)
            if self._lm_pending and (ticket is None or len(self._lm_pending) > self.cfg.decode_lookahead):
                self._process_lm(self._lm_pending.popleft(), events)
        return 0 if ticket is None else len(ticket.rows)

    def _on_device(self, seg: SegmentState) -> bool:
        """Does the segment sample on the device (device sampling and the default sampler)?"""
        return self._device_sampling and self._default_sampler(seg)

    def _issue_lm(self, events: list) -> "_LMTicket | None":
        """Enqueue the prefill of newcomers (bounded) and one decode step; no host sync."""
        t0 = time.perf_counter()
        lm = self.lm
        host = self._host
        rows: list[tuple[RequestState, SegmentState]] = []
        toks: list[torch.Tensor] = []   # device-sampled tokens, one per row (device sampling)
        logps: list[torch.Tensor] = []  # log-probs, one row per row
        spans = []
        # 1. prefill newcomers (bounded), all in one padded forward
        prefill_tokens = longest = 0
        new: list[tuple[RequestState, SegmentState, torch.Tensor]] = []
        for st in list(self._active.values()):
            seg = st.next_lm_segment()
            if seg is None or seg.prefilled or not self._free_slots:
                continue
            n = self.prefix_len(st.req, seg.text_ids)
            if new and not self._prefill_fits(len(new) + 1, max(longest, n)):
                break
            try:
                v = st.req.voice
                prefix = lm.embed_prefix(seg.text_ids, v.prompt_text_ids, v.llm_speech_token)
            except Exception as exc:  # noqa: BLE001 - isolate the failing request
                self._fail(st, events, exc)
                continue
            seg.slot = self._free_slots.pop(0)
            prefill_tokens += n
            longest = max(longest, n)
            new.append((st, seg, prefix))
        if new:
            t_pre = time.monotonic()
            for st, _, _ in new:
                if st.t_prefill is None:
                    st.t_prefill = t_pre
            m0 = self._marks.mark()
            try:
                h = self._prefill([seg.slot for _, seg, _ in new], [p for _, _, p in new])
            except Exception:  # noqa: BLE001 - one at a time, to find the request that fails
                h, keep = [], []
                for st, seg, p in new:
                    try:
                        h.append(self._prefill([seg.slot], [p]))
                        keep.append((st, seg, p))
                    except Exception as exc:  # noqa: BLE001
                        self._fail(st, events, exc)
                new = keep
                h = torch.cat(h) if h else None
            if new:
                logp = lm.logprobs(h)
                for st, seg, p in new:
                    seg.length = p.shape[0]
                    seg.prefilled = True
                    seg.issued = 1  # the first token, sampled from the prefill
                    rows.append((st, seg))
                logps.append(logp)
                if self._device_sampling:  # first tokens on the device too (host rows override)
                    dev = logp.device
                    slots = to_device(torch.tensor([seg.slot for _, seg, _ in new]), dev)
                    seed, _, ignore = (to_device(k, dev) for k in self._sampling_keys([(st, seg) for st, seg, _ in new], 0))
                    tok = ras_sample_device(logp, self._state.recent.new_full((len(new), self._state.recent.shape[1]), -1),
                                            seed, torch.zeros_like(seed), ignore, self._sampler.cfg, self._sampler.eos_id)
                    self._state.restart(slots, tok)
                    toks.append(tok)
                spans.append(("prefill", len(new), m0, self._marks.mark()))
        t1 = time.perf_counter()
        host("prefill", t1 - t0)
        # 2. one batched decode step for running segments: a row on the device sampler whenever
        # it has tokens left to generate (its input token is on the device, maybe not yet on the
        # host); a row sampled on the host once its last token is known there
        running = []
        for st in self._active.values():
            seg = st.next_lm_segment()
            if seg is None or not seg.prefilled or seg.lm_done or not 1 <= seg.issued < seg.max_len:
                continue
            if self._on_device(seg) or seg.issued == len(seg.tokens):
                running.append((st, seg))
        if running:
            slots = torch.tensor([seg.slot for _, seg in running])
            start = torch.tensor([seg.length for _, seg in running])
            m0 = self._marks.mark()
            try:
                if self._device_sampling:
                    host_rows = [(seg.slot, seg.tokens) for _, seg in running if not self._on_device(seg)]
                    if host_rows:  # their last token came from the host: put it where the step reads it
                        self._state.load([s for s, _ in host_rows], [t for _, t in host_rows])
                    seed, step, ignore = self._sampling_keys(running)
                    if self.decoder is not None:
                        h, tok = self.decoder.sample(slots, start, seed, step, ignore)  # CUDA graph
                    else:
                        dev = self.cache.k.device
                        h, tok = lm.decode_sample(self.cache, self._state, to_device(slots, dev), to_device(start, dev),
                                                  to_device(seed, dev), to_device(step, dev), to_device(ignore, dev),
                                                  self._sampler.cfg, self._sampler.eos_id, kv_len=int(start.max()) + 1)
                    toks.append(tok)
                else:
                    last = torch.tensor([[seg.tokens[-1]] for _, seg in running])
                    if self.decoder is not None:
                        h = self.decoder(last.reshape(-1), slots, start)  # log-probs, CUDA graph
                    else:
                        h = lm.logprobs(lm.forward_cached(lm.embed_speech(last), self.cache, slots, start)[:, -1])
            except Exception as exc:  # noqa: BLE001
                for st, _ in running:
                    self._fail(st, events, exc)
            else:
                spans.append(("decode", len(running), m0, self._marks.mark()))
                for _, seg in running:
                    seg.length += 1
                    seg.issued += 1
                rows.extend(running)
                logps.append(h)
        host("decode", time.perf_counter() - t1)
        if not rows:
            return None
        # 3. the step's results towards the host, without waiting for them
        need = [i for i, (_, seg) in enumerate(rows) if not self._on_device(seg)]
        tokens = torch.cat(toks).to("cpu", non_blocking=True) if toks else None
        logp_host = None
        if need:
            logp_all = torch.cat(logps)
            if len(need) < len(rows):
                logp_all = logp_all[to_device(torch.tensor(need), logp_all.device)]
            logp_host = logp_all.to("cpu", non_blocking=True)
        event = self._marks.mark()
        dt = time.perf_counter() - t0
        self.stats.last_lm_batch = len(rows)
        self.stats.lm_batches[len(rows)] = self.stats.lm_batches.get(len(rows), 0) + 1
        self.observer.lm_step(len(rows), prefill_tokens, dt)
        return _LMTicket(rows, tokens, need, logp_host, event, spans, self._inflight is not None, self._t2w_epoch)

    def _process_lm(self, tk: "_LMTicket", events: list) -> None:
        """Wait for a step's results and hand them out: next tokens of the rows still running,
        stop / length checks (a row stopped by the step before is skipped: its extra token,
        computed while the host did not know yet, is dropped)."""
        t2 = time.perf_counter()
        if isinstance(tk.event, torch.cuda.Event):
            tk.event.synchronize()  # the GIL is released while waiting
        t3 = time.perf_counter()
        self._host("lm_sync", t3 - t2)
        lm_device = pre_s = 0.0
        pre_rows = 0
        for name, n, a, b in tk.spans:
            sec = self._marks.seconds(a, b)
            lm_device += sec
            if name == "prefill":
                pre_rows, pre_s = pre_rows + n, pre_s + sec
            self.observer.stage(name, n, sec)
        if self._marks.cuda:  # device time of the step: the capacity model's device resource
            # alone: no token2wav batch on the device from its issue to now (its time is the LM's own work)
            alone = not tk.t2w_busy and tk.t2w_epoch == self._t2w_epoch
            self.capacity_model.observe_lm_device(len(tk.rows), lm_device, alone=alone, prefill=(pre_rows, pre_s))
        t_tok = time.monotonic()
        host_rows = set(tk.host_rows)
        sampled = {} if tk.tokens is None else {
            i: t for i, t in enumerate(tk.tokens.tolist()) if i not in host_rows}
        logp = None
        if tk.host_rows:
            logp = torch.zeros(len(tk.rows), tk.logp_host.shape[1])
            logp[tk.host_rows] = tk.logp_host.float()
        live = [(i, st, seg) for i, (st, seg) in enumerate(tk.rows)
                if st.request_id in self._active and not seg.lm_done and seg.slot is not None]
        tokens = self._sample_host(live, logp, sampled)
        streamed: dict[str, TokensGenerated] = {}  # LM-only streaming requests: tokens as they come
        for i, st, seg in live:
            tok = tokens[i]
            reason = self._take_token(st, seg, tok, t_tok)
            if reason != "stop" and st.req.params.lm_only and st.req.params.stream:
                streamed.setdefault(st.request_id, TokensGenerated(st.request_id, seg.index, [])).tokens.append(tok)
            if reason is not None:
                self._lm_finish_segment(st, seg, reason)
        events.extend(streamed.values())
        self._host("sampling", time.perf_counter() - t3)

    def _take_token(self, st: RequestState, seg: SegmentState, tok: int, t_tok: float) -> str | None:
        """Hand one speech token of ``seg``'s LM to the request (its token list, and token2wav's
        unless the silent-token rule drops it); returns why the segment's LM ends now — ``"stop"``
        (a stop token, not kept), ``"length"`` (``max_len`` reached) — or None. The caller finishes
        the segment (:meth:`_lm_finish_segment`). Shared by the local LM and remote token sources."""
        if tok in self._stop_ids:
            return "stop"
        seg.tokens.append(tok)
        if seg.silent is None or seg.silent.keep(tok):
            seg.t2w_tokens.append(tok)
        if st.t_first_token is None:
            st.t_first_token = t_tok
        return "length" if len(seg.tokens) >= seg.max_len else None

    def _sample_host(self, live: list, logp: torch.Tensor, sampled: dict[int, int]) -> dict[int, int]:
        """Tokens for the live rows: those sampled on the device as given; the others with
        upstream RAS and each request's generator — rows with the default sampler in one batched
        call (same tokens as per row, see :meth:`UpstreamSampler.sample_batch`), others one by one."""
        tokens = dict(sampled)
        default = [(i, seg) for i, _, seg in live if i not in sampled and self._default_sampler(seg)]
        if default:
            tokens.update(zip([i for i, _ in default], self._sampler.sample_batch(
                logp[[i for i, _ in default]], [seg.tokens for _, seg in default],
                [seg.lm_gen for _, seg in default], [len(seg.tokens) < seg.min_len for _, seg in default])))
        for i, _, seg in live:
            if i not in tokens:
                tokens[i] = seg.sampler.sample(logp[i], seg.tokens, seg.lm_gen,
                                               ignore_eos=len(seg.tokens) < seg.min_len)
        return tokens

    def _default_sampler(self, seg: SegmentState) -> bool:
        """The segment samples with the engine's default RAS settings (batched / on the device)."""
        s = seg.sampler
        return type(s) is UpstreamSampler and s.cfg == self._sampler.cfg and s.eos_id == self._sampler.eos_id

    def _sampling_keys(self, rows: list, step: int | None = None) -> tuple[torch.Tensor, ...]:
        """Inputs of :func:`~cosyserve.models.sampling.ras_sample_device` for the rows (CPU
        tensors): seed keys (request seed and segment), token indices (``step``, default each
        segment's tokens issued so far) and EOS masks (token index below the segment's
        ``min_len``); the repetition window is on the device (:class:`DecodeState`)."""
        seed = torch.tensor([(st.seed & 0xFFFFFFFF) | (seg.index << 32) for st, seg in rows], dtype=torch.long)
        idx = [seg.issued if step is None else step for _, seg in rows]
        return seed, torch.tensor(idx, dtype=torch.long), torch.tensor([i < seg.min_len for i, (_, seg) in zip(idx, rows)])

    def _prefill_fits(self, rows: int, longest: int) -> bool:
        """Is a prefill of ``rows`` prefixes, the longest ``longest`` positions, within
        ``max_prefill_tokens`` (rows x longest; the graph bucket's padded shape with CUDA graphs,
        exactly the buckets captured at start-up)?"""
        if self.prefill_graphs is not None and self.prefill_graphs.grid.pick(rows, longest) is not None:
            return self.prefill_graphs.grid.fits(rows, longest)
        return within_budgets(rows, longest, self.cfg.max_prefill_tokens)

    def _prefill(self, slots: list[int], prefixes: list[torch.Tensor]) -> torch.Tensor:
        """Prefill several prefixes (right-padded into one forward); last hidden per row.

        Padded positions write K/V past each row's length; decoding overwrites them before
        any query can attend to them (attention only reaches positions <= the query's).
        """
        lm = self.lm
        lengths = [p.shape[0] for p in prefixes]
        if len(prefixes) == 1:
            emb = prefixes[0][None]
        else:
            emb = prefixes[0].new_zeros(len(prefixes), max(lengths), prefixes[0].shape[-1])
            for i, p in enumerate(prefixes):
                emb[i, : p.shape[0]] = p
        h = None
        if self.prefill_graphs is not None:
            h = self.prefill_graphs(emb, slots)
        if h is None:
            h = lm.forward_cached(emb, self.cache, torch.tensor(slots), torch.zeros(len(slots), dtype=torch.long))
        return self._last_positions(h, lengths)

    @staticmethod
    def _last_positions(h: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """``h[b, lengths[b] - 1]`` for every row of ``h [B, T, H]`` -> ``[B, H]``; the index goes to the
        device through pinned memory (a pageable copy would wait for the prefill just queued)."""
        idx = to_device(torch.tensor(lengths) - 1, h.device)
        return h[torch.arange(len(lengths), device=h.device), idx]

    # ------------------------------------------------------------------ token2wav
    def _next_chunk(self, st: RequestState) -> tuple[SegmentState, int, bool] | None:
        """The request's next token2wav job if it is ready, as ``(segment, tokens the flow
        takes, final)``, without building it; skips segments that generated nothing."""
        while st.out_segment < len(st.segments):
            seg = st.segments[st.out_segment]
            if seg.lm_done and not seg.t2w_tokens:  # nothing was generated: the segment is silent
                seg.t2w_done = True
                st.out_segment += 1
                continue
            if seg.stream and seg.schedule.ready(len(seg.t2w_tokens)):
                return seg, seg.schedule.chunk_end(), False
            if seg.lm_done:
                return seg, len(seg.t2w_tokens), True
            return None
        return None

    def _make_job(self, st: RequestState, seg: SegmentState, n_tokens: int, final: bool) -> Token2WavJob:
        """The :class:`Token2WavJob` of a chunk found by :meth:`_next_chunk`."""
        tokens = torch.tensor(seg.t2w_tokens[:n_tokens])
        if not final:
            if seg.flow_cache is None and self._flow_stream_cache:
                seg.flow_cache = self.t2w.new_flow_cache(self.cfg.flow_stream_cache_frames)
            return Token2WavJob(st.req.voice, tokens, seg.schedule.token_offset, False, True, seg.hift_state,
                                st.hift_generator(seg, self.t2w.hift_device), flow_cache=seg.flow_cache)
        seg.flow_cache = None  # the final call attends to everything (full recomputation): free it
        offset = seg.schedule.token_offset if seg.stream else 0
        return Token2WavJob(st.req.voice, tokens, offset, True, False, seg.hift_state,
                            st.hift_generator(seg, self.t2w.hift_device), speed=st.req.params.speed)

    def _t2w_step(self, events: list, lm_busy: bool = False) -> None:
        idle = self._collect(events, wait=False)  # one token2wav batch in flight at a time
        now = time.monotonic()
        cands = []
        for st in list(self._active.values()):
            if st.req.params.lm_only:  # LM-only: done once every segment's LM has finished
                if st.lm_segment >= len(st.segments):
                    self._finish(st, events, Outcome.OK)
                continue
            nxt = self._next_chunk(st)
            if nxt is not None:
                if st.t_ready is None and st.first_chunk_at is None:
                    st.t_ready = now
                if idle:
                    seg = nxt[0]
                    offset = seg.schedule.token_offset if seg.stream else 0
                    n_tok = self.t2w.cost_tokens(int(st.req.voice.flow_speech_token.numel()), nxt[1], offset)
                    cands.append((self._deadline(st, now), n_tok, st, nxt[0], nxt))
            elif idle and st.out_segment >= len(st.segments):
                self._finish(st, events, Outcome.OK)
        if not cands or not self._launch_now(cands, now, lm_busy):
            return
        # jobs (token tensors, generators) are built only for the chunks that run now
        picked = [(st, seg, self._make_job(st, *spec)) for st, seg, spec in self._pick_t2w_batch(cands, now)]
        t0 = time.perf_counter()
        for st, _, _ in picked:
            if st.t_launch is None and st.first_chunk_at is None:
                st.t_launch = now
        jobs = [j for _, _, j in picked]
        try:
            self._launch(picked, jobs, events, t0)
        finally:
            self._host("t2w_launch", time.perf_counter() - t0)

    def _launch(self, picked: list, jobs: list, events: list, t0: float) -> None:
        """Issue the picked batch: hand it to the worker thread, or enqueue it on the side
        CUDA stream (in flight until :meth:`_collect`); on CPU run it and emit at once."""
        self._t2w_epoch += 1  # LM steps issued before now no longer ran alone on the device
        if self._worker is not None:
            self._worker.submit(jobs)
            self._inflight = (picked, t0, None)  # the LM keeps decoding while the worker runs it
            return
        try:
            pending = self.t2w.launch(jobs, stream=self._t2w_stream, marks=self._marks,
                                      queue_steps=self.cfg.t2w_queue_steps, queue_s=self.cfg.t2w_queue_s)
        except Exception:  # noqa: BLE001 - find the culprit, keep the others
            self._emit(picked, self.t2w.run_each(jobs), events, t0)
            return
        if self._t2w_stream is None:  # CPU: the work is already done
            self._emit(picked, self.t2w.finish(pending), events, t0, pending.marks)
        else:
            self._inflight = (picked, t0, pending)  # the LM keeps decoding while the GPU runs it

    def _launch_now(self, cands: list, now: float, lm_busy: bool) -> bool:
        """Launch a token2wav batch now, or let ready jobs accumulate into a larger batch?

        Launching costs host time that LM decoding then waits for, and a batch costs a fixed
        part plus a part per job, so while the LM is busy a batch is launched only when a job
        is due within ``t2w_slack_s`` (first chunks are due at once, offline utterances
        ``t2w_gather_s`` after they are ready) or ``t2w_batch_target`` jobs are ready. With
        the LM idle the GPU would idle too: launch at once.
        """
        if not lm_busy or len(cands) >= min(self.cfg.t2w_batch_target, self.cfg.max_t2w_batch):
            return True
        return min(c[0] for c in cands) <= now + self.slack_s()

    def _pick_t2w_batch(self, cands: list, now: float) -> list:
        """Earliest deadline first; the most urgent job sets the batch's flow length (its
        bucket, :meth:`Token2Wav.length_bucket`), longer jobs join only when due within
        ``t2w_slack_s`` (they would make every job in the batch pay for their length); jobs
        not due within ``t2w_slack_s`` join only while the batch has fewer than
        ``t2w_batch_target`` jobs (the rest gather into the next batch), and only if longer
        than ``t2w_length_window`` x the batch's length — shorter ones then fill the rows the
        batch's CUDA-graph bucket would pad, longest first; jobs join while the padded batch
        (jobs x longest) stays within ``max_t2w_tokens`` and its attention (jobs x longest²)
        within ``max_t2w_tokens x T2W_ATTENTION_LEN``."""
        cands.sort(key=lambda c: c[0])
        horizon = now + self.slack_s()
        window = self.cfg.t2w_length_window
        limit = None
        longest = 0
        picked, short = [], []
        for deadline, n_tok, st, seg, job in cands:
            if len(picked) >= self.cfg.max_t2w_batch:
                break
            if deadline > horizon and (len(picked) >= self.cfg.t2w_batch_target
                                       or (limit is not None and n_tok > limit)):
                continue
            if deadline > horizon and limit is not None and n_tok <= window * limit:
                short.append((n_tok, st, seg, job))
                continue
            if picked and not self._t2w_fits(len(picked) + 1, max(longest, n_tok)):
                continue
            longest = max(longest, n_tok)
            limit = max(limit or 0, self.t2w.length_bucket(n_tok))
            picked.append((st, seg, job))
        # the shorter jobs left out fill the rows the batch bucket pads anyway, longest first
        rows = min(self.t2w.batch_bucket(len(picked)), self.cfg.t2w_batch_target, self.cfg.max_t2w_batch)
        for n_tok, st, seg, job in sorted(short, key=lambda c: -c[0]):
            if len(picked) >= rows:
                break
            if self._t2w_fits(len(picked) + 1, longest):
                picked.append((st, seg, job))
        return picked

    def _t2w_fits(self, rows: int, n_tokens: int) -> bool:
        """Is a token2wav batch of ``rows`` jobs, the longest taking ``n_tokens`` flow input
        tokens, within ``max_t2w_tokens`` (rows x tokens) and its attention budget (rows x
        tokens², ``max_t2w_tokens x T2W_ATTENTION_LEN``)? Padded shapes with CUDA graphs (the
        flow graph's bucket: what runs, and exactly the buckets captured at start-up)."""
        graph = getattr(self.models.flow, "graph", None)
        grid = getattr(graph, "grid", None)  # the DiT's step graphs have none
        if grid is not None:
            return grid.fits(rows, n_tokens)
        max_rows = getattr(graph, "max_rows", None)  # the DiT solve: rows whose buffers fit in memory
        if max_rows is not None and rows > max_rows and rows > 1:
            return False
        budget = self.cfg.max_t2w_tokens
        return within_budgets(rows, n_tokens, budget, budget * T2W_ATTENTION_LEN)

    def _collect(self, events: list, wait: bool) -> bool:
        """Emit the in-flight token2wav batch if it is done (or, with ``wait``, once it is).
        Returns True if nothing is in flight any more."""
        if self._inflight is None:
            return True
        picked, t0, pending = self._inflight
        t_wait = time.perf_counter()
        if pending is None:  # on the worker thread
            out = self._worker.poll(wait)
            if out is None:
                return False
            results, marks = out
        else:  # on the side CUDA stream
            if not pending.issued:  # issue the next flow steps (then HiFT) that fit the queue
                t_issue = time.perf_counter()
                try:
                    if wait:
                        pending.advance(None)
                    else:
                        pending.advance(self.cfg.t2w_queue_steps, self.cfg.t2w_queue_s)
                except Exception:  # noqa: BLE001 - find the culprit, keep the others
                    self._inflight = None
                    self._emit(picked, self.t2w.run_each(pending.jobs), events, t0)
                    return True
                finally:
                    t_wait = time.perf_counter()
                    self._host("t2w_launch", t_wait - t_issue)
            if not wait and not pending.done():
                return False
            try:
                results, marks = self.t2w.finish(pending), pending.marks
            except Exception as exc:  # noqa: BLE001 - an asynchronous failure fails the batch
                results, marks = [exc] * len(picked), ()
        self._inflight = None
        t_emit = time.perf_counter()
        self._host("t2w_sync", t_emit - t_wait)
        self._emit(picked, results, events, t0, marks)
        self._host("emit", time.perf_counter() - t_emit)
        return True

    def _emit(self, picked, results, events: list, t0: float, marks: tuple = ()) -> None:
        """Hand out one finished batch: ``results`` per job (a Token2WavResult or the exception
        that job raised)."""
        dt = time.perf_counter() - t0
        self._batch_s = dt if self._batch_s is None else 0.8 * self._batch_s + 0.2 * dt
        device_s = None
        if marks:
            a, b, c = marks
            self.observer.stage("flow", len(picked), self._marks.seconds(a, b))
            self.observer.stage("hift", len(picked), self._marks.seconds(b, c))
            if self._marks.cuda:
                device_s = self._marks.seconds(a, c)
        # the capacity model: token2wav seconds per audio second (on CPU the batch ran on this
        # thread, launch to emit; on CUDA the host time issuing/handing it out, and device time)
        audio_s = sum(int(r.speech.shape[0]) for r in results if not isinstance(r, BaseException)) / self.sample_rate
        cost = start = None  # the jobs' cost units, for a price per cost unit only (keep the DiT's path lean)
        if self.capacity_model.t2w_price == "cost":
            # the flow input each job solved (a voice prefix or stream cache spares the rest); and what the
            # chunks of starting streams (fewer than START_CHUNKS sent) needed: (cost units, audio seconds)
            cost, start = 0, [0, 0.0]
            for (st, _, job), r in zip(picked, results):
                if isinstance(r, BaseException):
                    continue
                units = self.t2w.cost_tokens(int(st.req.voice.flow_speech_token.numel()), int(job.tokens.shape[0]),
                                             job.token_offset) - r.saved_tokens
                cost += units
                if st.req.params.stream and st.chunks < START_CHUNKS:
                    start[0] += units
                    start[1] += int(r.speech.shape[0]) / self.sample_rate
        host_s = dt if not self._marks.cuda and self._worker is None else self._t2w_host_s
        self._t2w_host_s = 0.0
        self.capacity_model.observe_t2w(audio_s, host_s, device_s, cost=cost,
                                        start=None if start is None else tuple(start))
        self.stats.last_t2w_batch = len(picked)
        self.stats.t2w_batches[len(picked)] = self.stats.t2w_batches.get(len(picked), 0) + 1
        self.observer.token2wav_step(len(picked), dt)
        now = time.monotonic()
        for (st, seg, job), res in zip(picked, results):
            if isinstance(res, BaseException):
                self._fail(st, events, res)
                continue
            if st.request_id not in self._active:
                continue
            seg.hift_state = res.hift_state
            if job.finalize:
                n_tok = len(seg.t2w_tokens) - job.token_offset
                seg.t2w_done = True
                st.out_segment += 1
                self._skip_silent_segments(st)
            else:
                n_tok = seg.schedule.hop
                seg.schedule.advance()
            last = st.out_segment >= len(st.segments)
            chunk = AudioChunk(st.request_id, st.chunks, seg.index, res.speech.numpy(), self.sample_rate, n_tok,
                               final=last, emitted_at=now)
            if st.first_chunk_at is not None and st.req.params.stream:  # due when the audio so far has played
                chunk.slack_s = st.first_chunk_at + st.audio_samples / self.sample_rate - now
                self._observe_slack(chunk.slack_s)
            st.chunks += 1
            st.audio_samples += chunk.samples.shape[0]
            latency = None
            if st.first_chunk_at is None:
                st.first_chunk_at = now
                latency = now - st.req.arrival
            events.append(chunk)
            self.observer.chunk(chunk, latency)
            if last:
                self._finish(st, events, Outcome.OK)

    def _slack_capped(self, cap: int) -> int:
        """``cap`` (streams), or the :class:`~cosyserve.engine.admission.SlackGuard`'s cap where that is
        lower (it is dropped once it has stayed above ``cap`` and ``max_active`` for the guard's ``settle_s``)."""
        guard = self.slack_guard.limit(min(cap, self.cfg.max_active))
        return cap if guard is None else min(cap, guard)

    def observe_delivered_slack(self, slack_s: float) -> None:
        """(Thread-safe; a server calls it.) A streaming chunk was sent to its client ``slack_s``
        seconds before the deadline the client sees: the engine's own slack at emission
        (:attr:`~cosyserve.engine.request.AudioChunk.slack_s`) less how much longer this chunk than
        the stream's first took from emission to the response (event loop, encoding). Feeds the
        same :class:`~cosyserve.engine.admission.SlackGuard` as the engine's own slack, so that
        delivery delays in bursts also hold admission back (docs/perf.md "Session 31": chunks
        emitted >= 100 ms early reached clients up to 41 ms late). Cheap: only values below the
        guard's margin are queued."""
        if slack_s < self.slack_guard.margin_s:
            self._inbox.put(("slack", float(slack_s)))

    def _observe_slack(self, slack_s: float, delivered: bool = False) -> None:
        """A streaming chunk left ``slack_s`` seconds before its deadline (when emitted, or with
        ``delivered`` when its server sent it: :meth:`observe_delivered_slack`): feed the admission's
        :class:`~cosyserve.engine.admission.SlackGuard` (auto mode); log when it cuts the cap."""
        if self.admission.mode != "auto" or slack_s >= self.slack_guard.margin_s:
            return
        active = sum(1 for st in self._active.values() if st.req.params.stream)
        cut = self.slack_guard.observe(slack_s, active)
        self.capacity_model.record("slack", s=slack_s, a=active, cut=cut)
        if cut:
            cap = self.slack_guard.limit()
            log.warning("a chunk %s %.0f ms before its deadline with %d streams active: admission capped at %d "
                        "streams until none comes that close (+1 per %.1f s)",
                        "was sent to its client" if delivered else "left", slack_s * 1e3, active, cap,
                        self.slack_guard.recover_s,
                        extra={"event": "slack_cut", "slack_ms": round(slack_s * 1e3, 1), "streams": cap,
                               "active": active, "delivered": delivered})

    def _skip_silent_segments(self, st: RequestState) -> None:
        while st.out_segment < len(st.segments):
            seg = st.segments[st.out_segment]
            if seg.lm_done and not seg.t2w_tokens:
                seg.t2w_done = True
                st.out_segment += 1
            else:
                return

    # ------------------------------------------------------------------ convenience
    def run_to_completion(self, req: EngineRequest):
        """Add ``req`` and step until it finishes; yields its events (single-user helper)."""
        self.add_request(req)
        while True:
            for ev in self.step():
                if ev.request_id != req.request_id:
                    continue
                yield ev
                if isinstance(ev, RequestFinished):
                    return

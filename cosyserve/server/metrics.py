"""Prometheus metrics (``GET /metrics``), fed by the protocol adapters and the engine.

Per request (label ``protocol``: ``openai``, ``kserve_http``, ``kserve_grpc``):
``cosyserve_requests_total{protocol,outcome}``, ``cosyserve_first_chunk_latency_seconds``,
``cosyserve_request_latency_seconds``, ``cosyserve_rtf`` (compute time / audio duration),
``cosyserve_audio_seconds_total``. Engine (updated every scheduler step):
``cosyserve_queue_depth``, ``cosyserve_active_streams``, ``cosyserve_kv_slots_used``,
``cosyserve_kv_slots_total``, ``cosyserve_lm_batch_size``, ``cosyserve_token2wav_batch_size``,
``cosyserve_lm_step_seconds``, ``cosyserve_token2wav_step_seconds``; admission control
(:mod:`cosyserve.engine.admission`): ``cosyserve_capacity_streams`` (the real-time capacity
admission works with: the estimate in ``auto`` mode, N with ``--admission N``, the estimate,
not enforced, with ``off``), ``cosyserve_admitted_streams`` (requests admitted now),
``cosyserve_load_ratio`` (admitted / capacity), ``cosyserve_capacity_estimate_streams`` (the
capacity model itself, whatever the mode; NaN before it has measured anything),
``cosyserve_admissions_total`` and ``cosyserve_admissions_out_of_order_total`` (admitted
before a request that arrived earlier), ``cosyserve_admission_held_seconds_total{bound}`` (seconds the
queue's head waited because of ``bound``: ``capacity``, ``slack``, ``memory``, ``starting``, ``fixed``,
``max_active``; :data:`~cosyserve.engine.core.ADMISSION_HOLDS`); device time per batched
stage ``cosyserve_stage_seconds{stage}`` and items per stage ``cosyserve_stage_items_total{stage}`` (``prefill``, ``decode``, ``flow``, ``hift``; see
:class:`~cosyserve.engine.core.EngineObserver`) and where first-chunk latency goes,
``cosyserve_first_chunk_phase_seconds{phase}`` (``queue``, ``prefill``, ``decode``, ``t2w_wait``,
``token2wav``; see :class:`~cosyserve.engine.request.RequestFinished`). Process:
``cosyserve_gc_pause_seconds{generation}`` (see :mod:`cosyserve.engine.gc_pauses`). Start-up:
``cosyserve_graphs_captured`` (CUDA graph buckets captured so far), ``cosyserve_graphs_pending``
(buckets still to capture; their batches run eagerly meanwhile: 0 once the background capture
is done), ``cosyserve_graphs_failed`` (buckets whose capture failed: always eager),
``cosyserve_graph_capture_seconds`` (time spent capturing; see
:class:`~cosyserve.models.graphs.BackgroundCapturer`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from ..engine.core import EngineObserver

LATENCY_BUCKETS = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30, 60)
RTF_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 5, 10)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics(EngineObserver):
    """All cosyserve metrics in a private registry."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("cosyserve_requests", "Requests by protocol and outcome", ["protocol", "outcome"],
                                registry=r)
        self.first_chunk = Histogram("cosyserve_first_chunk_latency_seconds", "Arrival to first audio chunk",
                                     ["protocol"], buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("cosyserve_request_latency_seconds", "Arrival to last audio chunk", ["protocol"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.rtf = Histogram("cosyserve_rtf", "Real-time factor: processing time / audio duration", ["protocol"],
                             buckets=RTF_BUCKETS, registry=r)
        self.audio = Counter("cosyserve_audio_seconds", "Audio produced (seconds)", ["protocol"], registry=r)
        self.queue_depth = Gauge("cosyserve_queue_depth", "Requests waiting for a slot", registry=r)
        self.active = Gauge("cosyserve_active_streams", "Requests being processed", registry=r)
        self.kv_used = Gauge("cosyserve_kv_slots_used", "KV-cache slots in use", registry=r)
        self.kv_total = Gauge("cosyserve_kv_slots_total", "KV-cache slots", registry=r)
        self.lm_batch = Histogram("cosyserve_lm_batch_size", "Sequences per LM step", buckets=BATCH_BUCKETS,
                                  registry=r)
        self.t2w_batch = Histogram("cosyserve_token2wav_batch_size", "Chunks per token2wav batch",
                                   buckets=BATCH_BUCKETS, registry=r)
        self.lm_step_seconds = Histogram("cosyserve_lm_step_seconds", "Duration of an LM step (prefill + decode)",
                                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1), registry=r)
        self.t2w_step_seconds = Histogram("cosyserve_token2wav_step_seconds", "Duration of a token2wav batch",
                                  buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5), registry=r)
        self.stage_seconds = Histogram(
            "cosyserve_stage_seconds", "Device time of one batched engine stage", ["stage"],
            buckets=(0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1, 2), registry=r)
        self.stage_items = Counter("cosyserve_stage_items", "Sequences or chunks processed by a batched stage",
                                   ["stage"], registry=r)
        self.first_chunk_phase = Histogram(
            "cosyserve_first_chunk_phase_seconds", "First-chunk latency by scheduler phase", ["phase"],
            buckets=(0.001, 0.005, 0.01, 0.025) + LATENCY_BUCKETS, registry=r)
        self.host_seconds = Counter(
            "cosyserve_scheduler_host_seconds", "Scheduler-thread time by phase (prefill, decode, lm_sync, sampling, "
            "t2w_launch, t2w_sync, emit)", ["phase"], registry=r)
        self.capacity = Gauge("cosyserve_capacity_streams", "Real-time capacity admission works with (streams)",
                              registry=r)
        self.admitted_streams = Gauge("cosyserve_admitted_streams", "Streams currently admitted", registry=r)
        self.load_ratio = Gauge("cosyserve_load_ratio", "Admitted streams / real-time capacity", registry=r)
        self.capacity_estimate = Gauge("cosyserve_capacity_estimate_streams",
                                       "The capacity model's estimate of real-time streams (any admission mode)",
                                       registry=r)
        self.admissions = Counter("cosyserve_admissions", "Requests admitted from the queue", registry=r)
        self.admission_held_seconds = Counter("cosyserve_admission_held_seconds",
                                              "Seconds the queue's head waited, by the admission bound that held it",
                                              ["bound"], registry=r)
        self.admissions_out_of_order = Counter("cosyserve_admissions_out_of_order",
                                               "Requests admitted after one that arrived later", registry=r)
        for g in (self.capacity, self.load_ratio, self.capacity_estimate):
            g.set(float("nan"))
        self.ready = Gauge("cosyserve_ready", "1 when models are loaded and warmed up", registry=r)
        self.delivery_lag = Histogram(
            "cosyserve_chunk_delivery_lag_seconds", "Streaming chunks: engine emission to the response handler",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1), registry=r)
        self.gc_pause = Histogram(
            "cosyserve_gc_pause_seconds", "Python garbage-collection pauses (all threads stop)", ["generation"],
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1), registry=r)
        self.graphs_captured = Gauge("cosyserve_graphs_captured", "CUDA graph buckets captured", registry=r)
        self.graphs_pending = Gauge("cosyserve_graphs_pending",
                                    "CUDA graph buckets not captured yet (served eagerly meanwhile)", registry=r)
        self.graphs_failed = Gauge("cosyserve_graphs_failed", "CUDA graph buckets whose capture failed (eager)",
                                   registry=r)
        self.graph_capture_seconds = Gauge("cosyserve_graph_capture_seconds", "Seconds spent capturing CUDA graphs",
                                           registry=r)
        self._core = None

    def gc_observed(self, generation: int, seconds: float) -> None:
        """A garbage collection of ``generation`` took ``seconds``."""
        self.gc_pause.labels(str(generation)).observe(seconds)

    def attach(self, core) -> None:
        """Read queue/slot gauges from ``core`` (an EngineCore) after every step."""
        self._core = core
        self.kv_total.set(core.cfg.max_active)

    def _gauges(self) -> None:
        c = self._core
        if c is not None:
            self.queue_depth.set(c.queue_depth)
            self.active.set(c.active_count)
            self.kv_used.set(c.kv_slots_used)
            self.capacity.set(c.capacity_streams)
            self.admitted_streams.set(c.active_count)
            self.load_ratio.set(c.load_ratio)
            est = c.capacity_model.last_estimate
            self.capacity_estimate.set(float("nan") if est is None else min(est, 1e9))

    # EngineObserver hooks (engine thread)
    def lm_step(self, batch_size: int, prefill_tokens: int, seconds: float) -> None:
        self.lm_batch.observe(batch_size)
        self.lm_step_seconds.observe(seconds)
        self._gauges()

    def token2wav_step(self, batch_size: int, seconds: float) -> None:
        self.t2w_batch.observe(batch_size)
        self.t2w_step_seconds.observe(seconds)
        self._gauges()

    def stage(self, name: str, batch_size: int, seconds: float) -> None:
        self.stage_seconds.labels(name).observe(seconds)
        self.stage_items.labels(name).inc(batch_size)

    def capacity_changed(self, streams: int, estimate: float | None) -> None:
        self._gauges()

    def admitted(self, request_id: str, waited_s: float, in_order: bool) -> None:
        self.admissions.inc()
        if not in_order:
            self.admissions_out_of_order.inc()

    def admission_held(self, bound: str, seconds: float) -> None:
        self.admission_held_seconds.labels(bound).inc(seconds)

    def host(self, phase: str, seconds: float) -> None:
        self.host_seconds.labels(phase).inc(seconds)

    def finished(self, event) -> None:
        for phase, sec in (event.first_chunk_breakdown or {}).items():
            self.first_chunk_phase.labels(phase).observe(sec)
        self._gauges()

    # protocol hooks (event loop)
    def record(self, protocol: str, outcome: str, first_chunk_s: float | None, total_s: float, audio_s: float) -> None:
        self.requests.labels(protocol, outcome).inc()
        if first_chunk_s is not None:
            self.first_chunk.labels(protocol).observe(first_chunk_s)
        if outcome == "ok":
            self.latency.labels(protocol).observe(total_s)
            if audio_s > 0:
                self.rtf.labels(protocol).observe(total_s / audio_s)
        self.audio.labels(protocol).inc(audio_s)

    def _graph_gauges(self) -> None:
        """The CUDA graph gauges from the engine (at scrape time only: counting pending buckets
        walks the grids, too slow for every scheduler step)."""
        c = self._core
        counts = c.graph_counts() if c is not None and hasattr(c, "graph_counts") else None
        if counts is not None:
            self.graphs_captured.set(counts["captured"])
            self.graphs_pending.set(counts["pending"])
            self.graphs_failed.set(counts["failed"])
            self.graph_capture_seconds.set(counts["capture_seconds"])

    def render(self) -> bytes:
        self._gauges()
        self._graph_gauges()
        return generate_latest(self.registry)

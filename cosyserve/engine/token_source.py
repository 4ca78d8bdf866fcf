"""Where the engine's speech tokens come from: the token-source seam (disaggregated serving).

The engine's LM stage (``EngineCore._lm_step``) is the one place that turns a request's text
segments into speech tokens: it advances every active segment, appends the new tokens to
``SegmentState.tokens`` / ``t2w_tokens`` and ends a segment with a stop reason
(``_lm_finish_segment``). Everything after it — the chunk schedule, token2wav's cross-request
batching, admission, events — reads only that per-segment state. Two sources fill it:

* **local** (:class:`~cosyserve.engine.core.EngineCore` itself): the speech LM on this
  process's device, continuous batching over KV slots (today's engine);
* **remote** (:class:`RemoteLMEngine`, ``cosyserve serve --llm-url URL``): each segment's tokens
  are streamed from an OpenAI-compatible completions server serving the speech LM
  (``cosyserve serve --llm-only``, or vLLM / SGLang / trtllm-serve serving the
  ``cosyserve convert-llm`` checkpoint) by :class:`RemoteTokenSource`; no LM weights are
  loaded. Its LM stage drains the tokens that arrived since the last step into the same
  segment state, so token2wav consumes remote tokens exactly as it consumes local ones.

:class:`RemoteTokenSource` runs the HTTP streams (``httpx``, asyncio) on an event loop of its
own, in a daemon thread, so it works under the server's loop and the CLI alike; per segment a
:class:`SegmentStream` mailbox (explicit state, lock-protected) carries tokens, the finish
reason or the error from that loop to the engine thread. A remote failure (connection refused,
HTTP error, timeout, a stream cut when the LLM server dies) ends only that request, with a
:class:`~cosyserve.client.remote_lm.RemoteLMError` naming the LLM server (HTTP 502, gRPC
UNAVAILABLE); a request that ends for any other reason (finished, aborted, timed out) closes
its stream, so the LLM server frees its slot.

Seeds: segment ``i`` of a request is sent ``seed + i``; a single-segment request therefore
samples exactly the tokens the all-in-one server samples for that seed (same sampler, same
generator; on the native LLM server). Offline requests' HiFT noise, which the local engine
forks from the LM's generator after sampling, is seeded from the request's seed instead
(streaming requests use a seed-derived generator in both modes: identical audio).

Admission without local LM timings: the capacity model (:class:`~cosyserve.engine.admission.
CapacityEstimator`) is fed, for the LM stage, the scheduler-thread time spent handing out
remote tokens per step (rows = segments streaming) and, on CUDA, zero device time, so the
estimate is set by token2wav's measured costs (host and device) — the remote LLM server's own
capacity is its business (its 429 / errors end the affected requests with a clear error).

On CUDA the flow and HiFT run as CUDA graphs as in the all-in-one engine (the same grids,
captured before serving); token2wav batches run on their side stream.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import OrderedDict, deque

import torch

from ..client.remote_lm import RemoteLMError, StreamingCompletionsLM
from ..models.export import SpeechVocab
from ..models.loader import CosyVoice2Models
from .core import EngineConfig, EngineCore, EngineObserver, EngineStats, _Marks
from .request import EngineRequest, Outcome, RequestState, SegmentState

log = logging.getLogger(__name__)

SEED_MASK = (1 << 63) - 1  #: segment seeds stay within the non-negative int64 range


class SegmentStream:
    """One segment's remote generation as the engine thread sees it (thread-safe mailbox).

    Filled on the source's event loop (:meth:`push`, :meth:`end`), drained by the engine thread
    (:meth:`take`). ``error`` is a :class:`RemoteLMError`; ``finish_reason`` ``stop`` /
    ``length``."""

    def __init__(self):
        self._lock = threading.Lock()
        self._tokens: deque[int] = deque()
        self.finish_reason: str | None = None
        self.error: Exception | None = None
        self.future = None  # concurrent.futures.Future of the streaming task

    def push(self, tokens: list[int], finish_reason: str | None) -> None:
        with self._lock:
            self._tokens.extend(tokens)
            if finish_reason and self.finish_reason is None:
                self.finish_reason = finish_reason

    def end(self, error: Exception | None) -> None:
        with self._lock:
            if error is not None and self.finish_reason is None:
                self.error = error

    def take(self) -> tuple[list[int], str | None, Exception | None]:
        """Tokens that arrived since the last call, and the finish reason / error once known
        (after the last tokens)."""
        with self._lock:
            out = list(self._tokens)
            self._tokens.clear()
            return out, self.finish_reason, self.error


class RemoteTokenSource:
    """Streams speech tokens from a completions server (``client``) on a private event loop.

    :meth:`start` opens one streaming completion and returns its :class:`SegmentStream`;
    :meth:`cancel` closes it; :attr:`wakeup` is set whenever any stream receives something
    (the engine thread waits on it instead of spinning); :meth:`close` ends everything.
    Thread-safe."""

    def __init__(self, client: StreamingCompletionsLM):
        self.client = client
        self.wakeup = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cosyserve-remote-lm", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return self.client.base

    def start(self, prompt_ids: list[int], min_tokens: int, max_tokens: int, seed: int | None) -> SegmentStream:
        s = SegmentStream()
        s.future = asyncio.run_coroutine_threadsafe(self._run(s, prompt_ids, min_tokens, max_tokens, seed), self._loop)
        return s

    async def _run(self, s: SegmentStream, prompt_ids, min_tokens, max_tokens, seed) -> None:
        err = None
        try:
            async for d in self.client.stream(prompt_ids, min_tokens, max_tokens, seed):
                s.push(d.tokens, d.finish_reason)
                self.wakeup.set()
        except asyncio.CancelledError:
            raise
        except RemoteLMError as exc:
            err = exc
        except Exception as exc:  # noqa: BLE001 - anything else is still this request's failure only
            err = RemoteLMError(f"LLM server {self.url}: {type(exc).__name__}: {exc}")
        finally:
            s.end(err)
            self.wakeup.set()

    def cancel(self, s: SegmentStream) -> None:
        """Stop a stream (its HTTP connection is closed: the LLM server aborts the request)."""
        if s.future is not None and not s.future.done():
            s.future.cancel()

    def check(self, timeout_s: float = 10.0) -> str:
        """Resolve the served model name now (``GET /v1/models`` unless given); raises
        :class:`RemoteLMError` naming the server when it cannot be reached."""
        if self.client.model is not None:
            return self.client.model
        fut = asyncio.run_coroutine_threadsafe(self.client.discover_model(), self._loop)
        try:
            return fut.result(timeout_s)
        except TimeoutError:
            fut.cancel()
            raise RemoteLMError(f"LLM server {self.url}: no answer to GET /v1/models within {timeout_s:g} s") from None

    def close(self) -> None:
        if not self._loop.is_running():
            return

        async def _shutdown():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.client.aclose()

        try:
            asyncio.run_coroutine_threadsafe(_shutdown(), self._loop).result(5)
        except Exception:  # noqa: BLE001 - closing anyway
            log.debug("remote LM source: shutdown incomplete", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def remote_source_for(models: CosyVoice2Models, text_vocab_size: int, url: str, model: str | None = None,
                      api_key: str | None = None, timeout_s: float = 60.0,
                      checkpoint: str | None = None) -> RemoteTokenSource:
    """A :class:`RemoteTokenSource` for ``models``' speech LM served at ``url``: the exported
    vocabulary of ``cosyserve convert-llm`` (``text_vocab_size``: the frontend tokenizer's
    size), the yaml's top-p / top-k, stop ids as ``stop_token_ids``, special tokens kept.
    ``timeout_s``: the longest wait for the next piece of a stream. ``checkpoint``: the
    ``convert-llm`` folder an external server (vLLM, SGLang, trtllm-serve) serves: its
    vocabulary is used and its decoder bias sent as ``logit_bias`` (the native server has the
    bias built in: give none). Raises :class:`RemoteLMError` for a malformed URL or a folder
    that is not a ``convert-llm`` checkpoint (or disagrees with the model's speech tokens)."""
    from ..client.remote_lm import load_checkpoint_info, logit_bias_map, speech_vocab

    cfg = models.cfg
    sv: SpeechVocab = speech_vocab(text_vocab_size, cfg.llm.speech_token_size, cfg.model_family)
    bias = None
    if checkpoint is not None:
        ck, raw = load_checkpoint_info(checkpoint)
        if ck.speech_token_size != sv.speech_token_size or ck.speech_token_offset != sv.speech_token_offset:
            raise RemoteLMError(f"{checkpoint}: speech tokens at {ck.speech_token_offset}+{ck.speech_token_size}, "
                                f"the model's at {sv.speech_token_offset}+{sv.speech_token_size}")
        sv, bias = ck, (logit_bias_map(ck, raw) if raw is not None else None)
    s = cfg.llm.sampling
    client = StreamingCompletionsLM(url, sv, model=model, api_key=api_key, top_p=s.top_p, top_k=s.top_k,
                                    logit_bias=bias,
                                    extra={"skip_special_tokens": False, "stop_token_ids": list(sv.stop_token_ids)},
                                    timeout_s=timeout_s)
    return RemoteTokenSource(client)


class RemoteLMEngine(EngineCore):
    """:class:`~cosyserve.engine.core.EngineCore` whose LM stage is a :class:`RemoteTokenSource`
    (see the module doc): ``models`` needs the flow and HiFT only (``models.llm`` may be None);
    scheduling of token2wav, admission, events and failure isolation are EngineCore's.

    ``idle_wait_s``: when a step found nothing to do, the next one first waits this long at
    most for remote tokens (woken at once when any arrive, or a request is added/aborted).
    Raises ValueError without flow/HiFT."""

    def __init__(self, models: CosyVoice2Models, source: RemoteTokenSource,
                 config: EngineConfig = EngineConfig(), observer: EngineObserver | None = None,
                 idle_wait_s: float = 0.02):
        if models.flow is None or models.hift is None:
            raise ValueError("the engine needs the flow and HiFT")
        from .token2wav import Token2WavWorker, make_token2wav

        # EngineCore.__init__ builds the LM's KV cache, graphs and samplers; none exist here.
        # The attributes below are the ones its request, admission and token2wav code read.
        self.models = models
        self.cfg = config
        self.observer = observer or EngineObserver()
        self.lm = None
        self.source = source
        self.sv = source.client.sv
        self.idle_wait_s = idle_wait_s
        self.sample_rate = models.cfg.sample_rate
        self.t2w = make_token2wav(models)
        device = next(models.flow.parameters()).device
        cuda = device.type == "cuda"
        config = self.cfg = self._resolve_flow_stream_cache(config, graphed=cuda and config.cuda_graphs)
        self._marks = _Marks(cuda)
        self._device_sampling = self._pipeline = False
        self._state = self.cache = self.decoder = self.prefill_graphs = None
        self._lm_pending = deque()
        self._pending_warmup = []
        self._free_slots = []  # no KV slots: kv_slots_used counts the open remote streams instead
        self._t2w_stream = torch.cuda.Stream(device=device) if cuda else None
        self._lm_stream = None
        self._batch_s = None
        self._worker = Token2WavWorker(self.t2w, self._t2w_stream, self._marks) if config.t2w_thread else None
        self._inflight = None
        self._stop_ids = frozenset(models.cfg.llm.stop_token_ids)
        self._sampler = self._new_sampler()
        self._waiting, self._active = OrderedDict(), OrderedDict()
        self._inbox = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._n_requests = 0
        self._ids = set()
        self.stats = EngineStats()
        self._init_admission(models, config, device)
        self.graph_capturer = None
        self._t2w_stages = []
        if cuda and config.cuda_graphs:  # EngineCore's token2wav graphs, captured by warmup() / the first step
            self._t2w_stages = self._t2w_graphs(models, config)
            self._pending_warmup = self._t2w_stages[::-1] if config.t2w_graph_warmup else []
        self._set_flow_stream_cache(models, config)
        self._set_hift_f0(models, config)
        self._streams: dict[str, SegmentStream] = {}  # request id -> its current segment's stream
        self._progress = True  # the last step did something (else the next waits for remote tokens)
        self._got = False  # this step's LM stage received something

    # ------------------------------------------------------------------ public API
    @property
    def kv_slots_used(self) -> int:
        """Remote LM streams open (this engine holds no KV cache)."""
        return len(self._streams)

    def add_request(self, req: EngineRequest) -> RequestState:
        st = super().add_request(req)
        self.source.wakeup.set()
        return st

    def abort(self, request_id: str, outcome: Outcome = Outcome.ABORTED) -> None:
        super().abort(request_id, outcome)
        self.source.wakeup.set()

    def close(self) -> None:
        super().close()
        self.source.close()

    def step(self) -> list:
        """As :meth:`EngineCore.step`; waits up to ``idle_wait_s`` for remote tokens first when
        the previous step did nothing (no busy loop while every stream waits on the LLM)."""
        if not self._progress and self._inflight is None:
            self.source.wakeup.wait(self.idle_wait_s)
        self.source.wakeup.clear()  # before draining: what arrives from now on wakes the next wait
        self._got = False
        events = super().step()
        self._progress = bool(events) or self._got
        return events

    # ------------------------------------------------------------------ the LM stage
    def _lm_step(self, events: list) -> int:
        """Start the remote stream of every active request's current segment, hand out the
        tokens that arrived (stop / length rules as the local LM's), end segments whose stream
        finished, fail requests whose stream failed. Returns the segments still generating."""
        rows = 0
        t_tok = time.monotonic()
        for st in list(self._active.values()):
            seg = st.next_lm_segment()
            if seg is None:
                continue
            s = self._streams.get(st.request_id)
            if s is None:
                s = self._open(st, seg, events)
                if s is None:
                    continue
            tokens, reason, error = s.take()
            if error is not None and not tokens:
                self._streams.pop(st.request_id, None)
                self._fail(st, events, error)
                continue
            self._got |= bool(tokens) or reason is not None or error is not None
            for tok in tokens:
                ended = self._take_token(st, seg, tok, t_tok)
                if ended is not None:
                    reason = ended
                    break
            if reason is not None:
                self.source.cancel(self._streams.pop(st.request_id))
                self._lm_finish_segment(st, seg, reason)
            elif error is None:
                rows += 1
            # else: tokens came before the failure; they are handed out, the request fails next step
        if rows and self._marks.cuda:  # no LM device work here: admission sees token2wav's cost only
            self.capacity_model.observe_lm_device(rows, 0.0)
        return rows

    def _open(self, st: RequestState, seg: SegmentState, events: list) -> SegmentStream | None:
        v = st.req.voice
        try:
            ids = self.sv.prompt_ids(seg.text_ids.tolist(), v.prompt_text_ids.reshape(-1).tolist(),
                                     v.llm_speech_token.reshape(-1).tolist())
        except Exception as exc:  # noqa: BLE001 - isolate the failing request
            self._fail(st, events, exc)
            return None
        if st.t_prefill is None:
            st.t_prefill = time.monotonic()
        s = self.source.start(ids, seg.min_len, seg.max_len, (st.seed + seg.index) & SEED_MASK)
        self._streams[st.request_id] = s
        return s

    def _finish(self, st: RequestState, events: list, outcome: Outcome, error: Exception | None = None) -> None:
        s = self._streams.pop(st.request_id, None)
        if s is not None:  # aborted, timed out or failed while streaming: the LLM server frees it
            self.source.cancel(s)
        super()._finish(st, events, outcome, error)


__all__ = ["RemoteLMEngine", "RemoteTokenSource", "SegmentStream", "remote_source_for"]

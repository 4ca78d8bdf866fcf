"""token2wav backend for a Step-Audio2 DiT token2wav directory (``--token2wav-dir``).

Same job/launch/finish interface as :class:`cosyserve.engine.token2wav.Token2Wav`, so the engine
(:class:`~cosyserve.engine.core.EngineCore`) and ``cosyserve batch`` drive it unchanged. What differs
is the flow: the DiT flow streams with **per-stream caches** (:mod:`cosyserve.models.dit_flow`)
instead of recomputing the whole utterance per chunk, so a chunk costs only its new frames.

Per job (one ``Token2WavJob``):

* the stream's state rides in ``job.hift_state`` / ``Token2WavResult.hift_state`` as a
  :class:`~cosyserve.models.dit_token2wav.DitT2WStreamState` (flow caches + HiFT cache); an empty state
  (the engine's initial ``HiFTStreamState()``, or ``DitT2WStreamState()``) means "not started";
* streaming chunk (``streaming`` or a final job of a started stream): the new tokens are
  ``job.tokens[job.token_offset:]`` (for a non-final chunk they end with the 3 look-ahead tokens,
  which the next chunk sends again, as Step-Audio2's drivers do). A stream's first job first runs the
  prompt set-up (prompt tokens + three silence tokens, the voice's prompt mel and speaker embedding);
  the set-ups of all new streams of a batch run as one pass, then all chunks as one pass;
* offline job (``finalize`` and not ``streaming`` with an empty state): flow ``inference`` over prompt
  + all tokens, in the same pass as the chunks;
* then one HiFT batch for every job (8-frame mel / 3840-sample caches, Hamming cross-fade, held-back
  tail; 3840 leading zeros before a stream's first non-final chunk, as ``Token2wav.stream``).

Set-ups depend only on the prompt (the noise is fixed), so the set-up states of the last
``setup_cache_size`` prompts are kept (keyed by the voice's flow prompt content,
:meth:`~cosyserve.engine.token2wav.PromptPrefixes.key`, hashed once per voice; states are immutable, so
streams share them safely): a stream of a voice seen recently starts without the prompt pass. A set-up
state holds the prompt's DiT keys/values for every Euler step (full size, bfloat16: about 0.65 MB per
prompt frame, ~200 MB for a 6 s prompt), hence the small default.

Voices are the CosyVoice2 frontend's (the same S3Tokenizer v2 tokens, CAM++ embedding and 24 kHz
prompt mel); the prompt mel is replicate-padded/cropped to 2 frames per prompt token.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F

from ..models.dit_flow import TRIM_KEEP, CacheWriteBack, DitItem
from ..models.dit_token2wav import DitT2WStreamState, DitToken2Wav
from ..models.hift import HiFTStreamState, hift_stream_step_batch
from .token2wav import PromptPrefixes, Token2WavBackend, _null, copy_to_pinned_host
from .token2wav import Token2WavJob, Token2WavResult, make_token2wav  # noqa: F401  (re-exported)


def _stream_state(state) -> DitT2WStreamState:
    if isinstance(state, DitT2WStreamState):
        return state
    if isinstance(state, HiFTStreamState) and state.empty:
        return DitT2WStreamState()
    raise TypeError(f"a DiT token2wav job needs a DitT2WStreamState, got {type(state).__name__}")


class _Done:
    """A finished (or, on CUDA, enqueued) batch: the :class:`PendingToken2Wav` interface the engine polls."""

    def __init__(self, jobs, speech, states, event, stamps, keep=()):
        self.jobs, self.speech, self.states, self.event, self.stamps = jobs, speech, states, event, stamps
        self.issued = True
        self.keep = keep

    @property
    def marks(self) -> tuple:
        return tuple(self.stamps)

    def advance(self, queue_steps=None, queue_s=None) -> bool:
        return True

    def done(self) -> bool:
        return self.event is None or self.event.query()


class DitToken2WavBackend(Token2WavBackend):
    """Batched DiT flow + HiFT over :class:`~cosyserve.engine.token2wav.Token2WavJob` (see module doc)."""

    def __init__(self, t2w: DitToken2Wav, setup_cache_size: int = 4):
        self.t2w = t2w
        self.flow = t2w.flow
        self.hift = t2w.hift
        self.setup_cache_size = setup_cache_size
        self._setups: OrderedDict[bytes, object] = OrderedDict()  # flow prompt content key -> DitStreamState
        self.setup_hits = 0
        self._state_bytes = 0  # the largest per-stream flow state seen (stream_state_bytes)

    chunk_cost_grows = False  # a chunk computes its new frames against a bounded cache
    #: a stream's estimator caches (~97 % of its state) are written in place into one store allocated at
    #: its first chunk (DitItem.in_place); only the encoder and conv caches (~3 %) are made anew per chunk
    stream_state_copies = 1.05

    def state_bytes(self, state, flow_cache=None) -> int:
        """Bytes of a stream's DiT flow caches (its whole estimator store once it has one)."""
        flow = state.flow if isinstance(state, DitT2WStreamState) else None
        return 0 if flow is None else flow.nbytes()

    def stream_state_bytes(self) -> int:
        """The largest per-stream DiT flow state seen (encoder and per-step estimator caches, at
        full size ~180 MB in bf16 once trimmed to ``P + TRIM_KEEP`` frames); 0 before any chunk."""
        return self._state_bytes

    def cost_tokens(self, prompt_tokens: int, end: int, token_offset: int) -> int:
        """A stream's first job runs the prompt set-up too (``prompt + end``); a later chunk computes
        only its new tokens and attends to a cache bounded at ``P + TRIM_KEEP`` mel frames, so it
        costs its new tokens plus the cache's length in tokens (not the whole utterance)."""
        if token_offset == 0:
            return prompt_tokens + end
        cache = min(prompt_tokens + token_offset, prompt_tokens + -(-TRIM_KEEP // self.flow.up_rate))
        return (end - token_offset) + cache

    def length_bucket(self, n_tokens: int) -> int:
        return -(-n_tokens // 32) * 32

    def batch_bucket(self, n_jobs: int) -> int:
        return n_jobs

    @property
    def hift_device(self) -> torch.device:
        return next(self.hift.parameters()).device

    def _prompt(self, job: Token2WavJob):
        v = job.voice
        pt, pm = self.t2w.prompt(v.flow_speech_token.reshape(-1), v.speech_feat)
        return pt, pm, v.flow_embedding.reshape(-1)

    def _forward_items(self, items: list[DitItem], offline: list[bool], write_back: CacheWriteBack) -> list:
        """:meth:`DitFlowModel.forward_items` of a batch's items (trimmed states, none for final
        items), results in item order; the chunks' new caches are left in ``write_back`` (the
        caller commits it). With solve graphs that plan offline utterances
        (:attr:`GraphedDiTSolve.offline_rows`), offline items run in groups of at most that many,
        longest first (similar lengths pad little), before one pass of the chunks (last: its
        write-back reads the solve buffers the next pass would rewrite): a larger batch of whole
        utterances would run eagerly (~230 ms of host time per solve at full size) and its graph
        would need several times the memory of the streaming buckets'."""
        flow = self.flow
        rows = getattr(flow.graph, "offline_rows", None)  # (None without graphs)
        off = [i for i, o in enumerate(offline) if o]
        if rows is None or len(off) <= rows:
            return flow.forward_items(items, trim_keep=TRIM_KEEP, final_states=False, write_back=write_back)
        res: list = [None] * len(items)
        rest = [i for i, o in enumerate(offline) if not o]
        off.sort(key=lambda i: -items[i].tokens.numel())
        for group in [off[k: k + rows] for k in range(0, len(off), rows)] + ([rest] if rest else []):
            for i, r in zip(group, flow.forward_items([items[i] for i in group], trim_keep=TRIM_KEEP,
                                                      final_states=False, write_back=write_back)):
                res[i] = r
        return res

    @torch.inference_mode()
    def launch(self, jobs: list[Token2WavJob], stream=None, marks=None, queue_steps=None, queue_s=None) -> _Done:
        """Run ``jobs`` (set-ups, then flow, then HiFT), on ``stream`` when given; never waits for the
        GPU (speech is copied to pinned host buffers and an event marks completion)."""
        stamps: list = []
        if not jobs:
            return _Done(jobs, [], [], None, stamps)
        ctx = torch.cuda.stream(stream) if stream is not None else _null()
        write_back = CacheWriteBack()
        try:
            with ctx:
                return self._launch(jobs, stream, marks, stamps, write_back)
        finally:
            write_back.discard()  # (a no-op after the commit) a failed batch leaves every old state valid

    def _launch(self, jobs, stream, marks, stamps, write_back: CacheWriteBack) -> _Done:
        """:meth:`launch`'s body, inside the stream context; commits ``write_back`` as its last step."""
        if marks is not None:
            stamps.append(marks.mark(stream))
        states = [_stream_state(j.hift_state) for j in jobs]
        flow = self.flow
        offline = [j.finalize and not j.streaming and s.flow is None for j, s in zip(jobs, states)]
        # 1. set-ups of streams starting now, as one pass
        new = [i for i, j in enumerate(jobs) if not offline[i] and states[i].flow is None]
        todo: dict[str, list[int]] = {}
        prompts = {}
        for i in new:
            # the set-up is a function of the voice's flow prompt: keyed by its content (computed once per voice)
            key = PromptPrefixes.key(jobs[i].voice) if self.setup_cache_size > 0 else str(i)
            cached = self._setups.get(key)
            if cached is not None:
                self._setups.move_to_end(key)
                self.setup_hits += 1
                states[i] = DitT2WStreamState(flow=cached)
            else:
                todo.setdefault(key, []).append(i)
                if key not in prompts:
                    prompts[key] = self._prompt(jobs[i])
        if todo:
            keys = list(todo)
            set_up = flow.forward_items([flow.setup_item(*prompts[k]) for k in keys])
            for k, r in zip(keys, set_up):
                for i in todo[k]:
                    states[i] = DitT2WStreamState(flow=r.state)
                if self.setup_cache_size > 0:
                    self._setups[k] = r.state
                    while len(self._setups) > self.setup_cache_size:
                        self._setups.popitem(last=False)
        # 2. every chunk and offline utterance, as one pass
        items, prompt_frames = [], []
        for j, s, off in zip(jobs, states, offline):
            if off:
                pt, pm, emb = self._prompt(j)
                items.append(flow.prompt_item(pt, pm, emb, j.tokens, last=True))
                prompt_frames.append(pm.shape[0])
            else:
                # in place: the stream's caches live in one store, overwritten chunk after chunk
                items.append(DitItem(tokens=j.tokens[j.token_offset:], spk=s.flow.spk, last=j.finalize,
                                     state=s.flow, in_place=True))
                prompt_frames.append(0)
        res = self._forward_items(items, offline, write_back)
        if marks is not None:
            stamps.append(marks.mark(stream))
        dev = self.hift_device
        mels, hstates = [], []
        for j, s, off, r, p in zip(jobs, states, offline, res, prompt_frames):
            m = r.mel[:, :, p:] if p else r.mel
            if m.device != dev or m.dtype != torch.float32:
                m = m.to(dev, torch.float32)
            if j.finalize and j.speed != 1.0 and s.hift.empty:
                m = F.interpolate(m, size=max(1, int(m.shape[2] / j.speed)), mode="linear")
            mels.append(m)
            hstates.append(s.hift)
        out = hift_stream_step_batch(self.hift, hstates, mels, [j.finalize for j in jobs],
                                     [j.generator for j in jobs], self.t2w.mel_cache_len,
                                     self.t2w.source_cache_len)
        speech, new_states = [], []
        for j, s, off, r, (sp, hs) in zip(jobs, states, offline, res, out):
            if not j.finalize and not s.started:
                sp = torch.cat([sp.new_zeros(1, self.t2w.source_cache_len), sp], dim=1)
            sp = sp[0]
            speech.append(sp if sp.dtype == torch.float32 else sp.float())
            if j.finalize:
                new_states.append(DitT2WStreamState())  # stream over: drop the caches
            else:
                # r.state is trimmed already (forward_items with trim_keep=TRIM_KEEP)
                new_states.append(DitT2WStreamState(flow=r.state, hift=hs, started=True))
                self._state_bytes = max(self._state_bytes, r.state.nbytes())
        if marks is not None:
            stamps.append(marks.mark(stream))
        event = None
        if stream is not None:
            keep = (speech, mels)
            speech, event = copy_to_pinned_host(speech, stream)
        else:
            keep = ()
        # last, once nothing can fail any more: the chunks' new caches into their streams' stores
        # (before this, a failed batch is re-run job by job from the old states)
        write_back.commit()
        return _Done(jobs, speech, new_states, event, stamps, keep)

    def finish(self, pending: _Done) -> list[Token2WavResult]:
        """Wait for ``pending`` and return its results (speech on the CPU)."""
        if pending.event is not None:
            pending.event.synchronize()
        return [Token2WavResult(s.cpu() if s.device.type != "cpu" else s, st)
                for s, st in zip(pending.speech, pending.states)]

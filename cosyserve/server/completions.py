"""OpenAI-compatible completions over the native speech LM (``cosyserve serve --llm-only``).

``POST /v1/completions`` speaks the exported vocabulary of ``cosyserve convert-llm``
(:mod:`cosyserve.models.export`), so that ``cosyserve batch --llm-url`` — or any tool
written for vLLM/SGLang/trtllm-serve serving that checkpoint — can use the native engine
instead: the same continuous batching over KV slots, the model's own decoder (its bias
included) and upstream's repetition-aware sampling.

Request fields:

* ``model``: the served name (``cosyvoice2``; see ``GET /v1/models``).
* ``prompt``: token ids ``[<|sos|>] + text ids + [<|task_id|>] + speech ids`` (a list of
  integers), or a string in which ``<|sos|>``, ``<|task_id|>`` and ``<|s_N|>`` are written
  out and the rest is text; or a list of such prompts (one choice each).
* ``max_tokens`` (default 16, as OpenAI), ``min_tokens`` (default 0; end-of-speech is
  masked before that, as upstream's ``min_len``), ``seed`` (reproducible sampling).
* ``temperature`` (0 = greedy), ``top_p``, ``top_k`` (default: the model's RAS settings),
  ``logit_bias`` (``{"id": value}`` over speech/stop ids, added to the log-probabilities).
* ``return_token_ids`` (also vLLM's name): add the generated ids to each choice.
* Accepted and ignored: ``skip_special_tokens``, ``spaces_between_special_tokens``,
  ``stop_token_ids``, ``allowed_token_ids``, ``user``. Refused with 400:
  ``n`` > 1, ``echo``, ``logprobs``, ``best_of`` > 1, ``suffix``, string ``stop`` sequences.

Response: OpenAI's ``text_completion`` object; each choice's ``text`` is the generated
``<|s_N|>`` tokens, ``finish_reason`` is ``stop`` (end-of-speech sampled) or ``length``.

``stream: true``: OpenAI server-sent events, sent as the engine samples the tokens (one event
per prompt and engine step that produced tokens; tokens of several steps that are already queued
when an event is written go out in one, and ``--llm-stream-interval S`` spaces a prompt's events at
least S seconds apart, gathering its tokens meanwhile: each event costs the receiver ~0.1 ms of
Python, docs/perf.md "Session 30"): ``data: {text_completion chunk}`` whose
choice ``text`` is the new ``<|s_N|>`` tokens (``token_ids`` too with ``return_token_ids``)
and ``finish_reason`` null; then one event per prompt with its ``finish_reason`` and empty
text; with ``stream_options: {"include_usage": true}`` a usage chunk (no choices); then
``data: [DONE]``. Errors found before the response starts are HTTP 4xx (429 when the engine
is full); a request that fails later gets an ``{"error": {...}}`` event and the stream ends.
A client that disconnects aborts its requests (their KV slots are freed at the next step).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from dataclasses import replace

import torch
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..engine.request import EngineRequest, RequestFinished, SynthesisParams, TokensGenerated
from ..errors import CosyServeError, InvalidInputError
from ..frontend.voice import Voice
from ..models.export import SpeechVocab
from ..models.sampling import UpstreamSampler
from .state import ServerState

router = APIRouter()

_PROMPT_TOKEN_RE = re.compile(r"<\|(sos|task_id|s_\d+|eos1|eos2|fill)\|>")


class CompletionRequest(BaseModel):
    """Body of ``POST /v1/completions`` (see module docstring)."""

    model_config = ConfigDict(extra="forbid")
    model: str
    prompt: list[int] | str | list[list[int]] | list[str]
    max_tokens: int | None = Field(16, ge=1)
    min_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool = False
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    stop: str | list[str] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


class CompletionSampler:
    """Per-request sampler: the model's RAS sampler with request overrides.

    ``logp`` ``[S+3]`` (native speech ids) gets ``bias`` added, is divided by
    ``temperature`` (0: greedy argmax), then sampled by upstream's RAS with ``top_p`` /
    ``top_k`` replaced where given.
    """

    def __init__(self, base: UpstreamSampler, temperature: float, top_p: float | None, top_k: int | None,
                 bias: torch.Tensor | None):
        cfg = base.cfg
        if top_p is not None:
            cfg = replace(cfg, top_p=float(top_p))
        if top_k is not None and top_k > 0:
            cfg = replace(cfg, top_k=int(top_k))
        self.inner = UpstreamSampler(cfg, eos_id=base.eos_id)
        self.eos_id = base.eos_id
        self.temperature = temperature
        self.bias = bias

    def sample(self, logp: torch.Tensor, decoded, generator=None, ignore_eos: bool = False) -> int:
        scores = logp.detach().float()
        if self.bias is not None:
            scores = scores + self.bias
        if self.temperature == 0.0:
            scores = scores.clone()
            if ignore_eos:
                scores[self.eos_id] = -float("inf")
            return int(scores.argmax().item())
        if self.temperature != 1.0:
            scores = scores / self.temperature
        return self.inner.sample(scores, decoded, generator, ignore_eos)


def served_vocab(state: ServerState) -> SpeechVocab:
    """The exported-vocabulary layout of the served model (as ``convert-llm`` writes it)."""
    from ..client.remote_lm import speech_vocab

    synth = state.synth
    return speech_vocab(len(synth.frontend.tokenizer), synth.cfg.llm.speech_token_size, synth.cfg.model_family)


def prompt_ids_from(prompt, state: ServerState, sv: SpeechVocab) -> list[int]:
    """Token ids of one prompt (ids as given, or a string with the special tokens written out)."""
    if isinstance(prompt, list):
        return [int(i) for i in prompt]
    ids: list[int] = []
    pos = 0
    tok = state.synth.frontend.tokenizer
    for m in _PROMPT_TOKEN_RE.finditer(prompt):
        if m.start() > pos:
            ids += tok.encode(prompt[pos:m.start()])
        name = m.group(1)
        if name == "sos":
            ids.append(sv.sos_token_id)
        elif name == "task_id":
            ids.append(sv.task_id_token_id)
        elif name.startswith("s_"):
            t = int(name[2:])
            if t >= sv.speech_token_size:
                raise InvalidInputError(f"prompt: <|{name}|> is not a speech token (0..{sv.speech_token_size - 1})",
                                        field="prompt")
            ids.append(sv.speech_to_id(t))
        else:
            raise InvalidInputError(f"prompt: <|{name}|> (a stop token) cannot appear in a prompt", field="prompt")
        pos = m.end()
    if pos < len(prompt):
        ids += tok.encode(prompt[pos:])
    return ids


def split_prompt(ids: list[int], sv: SpeechVocab) -> tuple[torch.Tensor, torch.Tensor]:
    """``[<|sos|>] + text + [<|task_id|>] + speech`` -> ``(text_ids, speech_tokens)``.

    Raises :class:`InvalidInputError` naming what is wrong with the layout.
    """
    if not ids:
        raise InvalidInputError("prompt is empty", field="prompt")
    if ids[0] != sv.sos_token_id:
        raise InvalidInputError(f"prompt must start with <|sos|> (id {sv.sos_token_id}); the layout is "
                                "[<|sos|>] + text ids + [<|task_id|>] + speech ids", field="prompt")
    try:
        k = ids.index(sv.task_id_token_id)
    except ValueError:
        raise InvalidInputError(f"prompt has no <|task_id|> (id {sv.task_id_token_id}) after the text",
                                field="prompt") from None
    text, speech = ids[1:k], ids[k + 1:]
    if not text:
        raise InvalidInputError("prompt has no text tokens between <|sos|> and <|task_id|>", field="prompt")
    bad = [i for i in text if not 0 <= i < sv.speech_token_offset]
    if bad:
        raise InvalidInputError(f"prompt: id {bad[0]} between <|sos|> and <|task_id|> is not a text token "
                                f"(0..{sv.speech_token_offset - 1})", field="prompt")
    toks = [sv.id_to_speech(i) for i in speech]
    if any(t is None for t in toks):
        i = speech[[t is None for t in toks].index(True)]
        raise InvalidInputError(f"prompt: id {i} after <|task_id|> is not a speech token "
                                f"({sv.speech_token_offset}..{sv.speech_token_offset + sv.speech_token_size - 1})",
                                field="prompt")
    return torch.tensor(text, dtype=torch.long), torch.tensor(toks, dtype=torch.int32)


def _lm_voice(speech: torch.Tensor) -> Voice:
    """A voice that carries only the LM prompt speech tokens (the text is in the segment)."""
    empty = torch.zeros(0, dtype=torch.int32)
    return Voice("completion", "", empty, speech, empty, torch.zeros(0, 80), torch.zeros(192), torch.zeros(192))


def _check_unsupported(body: CompletionRequest) -> None:
    if body.n != 1:
        raise InvalidInputError("only n=1 is supported", field="n")
    if body.echo:
        raise InvalidInputError("echo is not supported", field="echo")
    if body.logprobs is not None:
        raise InvalidInputError("logprobs are not supported", field="logprobs")
    if body.best_of not in (None, 1):
        raise InvalidInputError("best_of must be 1", field="best_of")
    if body.suffix:
        raise InvalidInputError("suffix is not supported", field="suffix")
    if body.stop:
        raise InvalidInputError("stop strings are not supported: generation stops at end-of-speech", field="stop")
    if body.presence_penalty or body.frequency_penalty:
        raise InvalidInputError("presence/frequency penalties are not supported (the sampler is upstream's "
                                "repetition-aware sampling)", field="presence_penalty")
    if body.max_tokens is not None and body.min_tokens > body.max_tokens:
        raise InvalidInputError("min_tokens must not exceed max_tokens", field="min_tokens")


def _bias_tensor(logit_bias: dict[str, float] | None, sv: SpeechVocab, n_rows: int) -> torch.Tensor | None:
    if not logit_bias:
        return None
    bias = torch.zeros(n_rows)
    for k, v in logit_bias.items():
        try:
            i = int(k)
        except ValueError:
            raise InvalidInputError(f"logit_bias key {k!r} is not a token id", field="logit_bias") from None
        if not -100.0 <= float(v) <= 100.0:
            raise InvalidInputError(f"logit_bias value for {k} must be in [-100, 100]", field="logit_bias")
        j = i - sv.speech_token_offset
        if 0 <= j < n_rows:
            bias[j] += float(v)
        # ids outside the speech/stop range are never sampled by the speech LM: nothing to bias
    return bias


def _engine_request(state: ServerState, body: CompletionRequest, prompt, sv: SpeechVocab,
                    seed: int | None) -> tuple[EngineRequest, int]:
    """The LM-only engine request of one prompt and the prompt's length in tokens; raises
    :class:`InvalidInputError` naming what is wrong (before anything is queued)."""
    ids = prompt_ids_from(prompt, state, sv)
    text, speech = split_prompt(ids, sv)
    core = state.engine.core
    cfg = state.synth.cfg.llm
    bias = _bias_tensor(body.logit_bias, sv, cfg.num_speech_rows)
    base = UpstreamSampler(cfg.sampling, eos_id=cfg.min_len_mask_id)

    def factory():
        return CompletionSampler(base, body.temperature, body.top_p, body.top_k, bias)

    room = core.cfg.kv_max_len - (2 + len(text) + len(speech))
    max_tokens = body.max_tokens if body.max_tokens is not None else room
    if room < 2:
        raise InvalidInputError(f"prompt of {len(ids)} tokens leaves no room in the KV cache "
                                f"({core.cfg.kv_max_len} positions)", field="prompt")
    max_tokens = min(max_tokens, room - 1)
    min_tokens = min(body.min_tokens, max_tokens)
    params = SynthesisParams(seed=seed, stream=body.stream, lm_only=True, min_tokens=min_tokens,
                             max_tokens=max_tokens, sampler_factory=factory, timeout_s=state.config.request_timeout_s)
    return EngineRequest("cmpl-" + uuid.uuid4().hex, [text], _lm_voice(speech), params), len(ids)


def _outcome_error(finished: RequestFinished | None) -> Exception | None:
    if finished is None:
        return CosyServeError("the request ended without a result")
    if finished.error is not None:
        return finished.error
    if finished.outcome.value != "ok":
        return CosyServeError(f"request {finished.outcome.value}")
    return None


async def _complete_one(state: ServerState, req: EngineRequest, n_prompt: int):
    t0 = time.monotonic()
    outcome, finished = "error", None
    try:
        async for ev in state.engine.generate(req):
            if isinstance(ev, RequestFinished):
                finished = ev
        outcome = "error" if finished is None else finished.outcome.value
        err = _outcome_error(finished)
        if err is not None:
            raise err
    except (asyncio.CancelledError, GeneratorExit):
        outcome = "cancelled"
        raise
    finally:
        state.metrics.record("completions", outcome, None, time.monotonic() - t0, 0.0)
    tokens = finished.tokens[0] if finished.tokens else []
    reason = (finished.stop_reasons[0] if finished.stop_reasons else None) or "length"
    return n_prompt, tokens, reason


def _choice(index: int, tokens: list[int], reason: str | None, sv: SpeechVocab, with_ids: bool) -> dict:
    c = {"index": index, "text": "".join(f"<|s_{t}|>" for t in tokens), "logprobs": None, "finish_reason": reason}
    if with_ids:
        c["token_ids"] = [sv.speech_to_id(t) for t in tokens]
    return c


def _sse(payload) -> bytes:
    return b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n"


async def _stream_events(state: ServerState, body: CompletionRequest, reqs: list, queues: list, sv: SpeechVocab):
    """OpenAI completion chunks (server-sent events) of the submitted requests ``reqs`` (their
    engine queues ``queues``), tokens as the engine produces them; ``data: [DONE]`` last. A
    failure after the first event is reported in-band (an ``error`` event, then ``[DONE]``).
    Leaving early (the client disconnected) aborts the requests still running: their KV slots
    are freed at the engine's next step."""
    cid = "cmpl-" + uuid.uuid4().hex
    created = int(time.time())
    merged: asyncio.Queue = asyncio.Queue()
    t0 = time.monotonic()
    done = [False] * len(reqs)
    n_out = 0
    interval = state.config.llm_stream_interval_s
    held: list = []  # an event taken while gathering tokens, handled next
    last_sent = [float("-inf")] * len(reqs)  # when each prompt's last token event went out (monotonic s)

    async def pump(i: int, q: asyncio.Queue):
        while True:
            ev = await q.get()
            await merged.put((i, ev))
            if isinstance(ev, RequestFinished):
                return

    pumps = [asyncio.create_task(pump(i, q)) for i, q in enumerate(queues)]
    try:
        left = len(reqs)
        while left:
            i, ev = held.pop() if held else await merged.get()
            chunk = {"id": cid, "object": "text_completion", "created": created, "model": body.model}
            if isinstance(ev, TokensGenerated):
                tokens = list(ev.tokens)
                wait = last_sent[i] + interval - time.monotonic()
                if wait > 0:  # the interval since this prompt's last event: gather what comes meanwhile
                    await asyncio.sleep(wait)
                while not merged.empty():  # the tokens of later steps already here go in this event
                    nxt = merged.get_nowait()
                    if nxt[0] != i or not isinstance(nxt[1], TokensGenerated):
                        held.append(nxt)
                        break
                    tokens += nxt[1].tokens
                n_out += len(tokens)
                chunk["choices"] = [_choice(i, tokens, None, sv, body.return_token_ids)]
                last_sent[i] = time.monotonic()
                yield _sse(chunk)
                continue
            if not isinstance(ev, RequestFinished):
                continue
            done[i] = True
            left -= 1
            state.metrics.record("completions", ev.outcome.value, None, time.monotonic() - t0, 0.0)
            err = _outcome_error(ev)
            if err is not None:
                yield _sse({"error": {"message": str(err), "type": "server_error", "param": None, "code": None}})
                break
            reason = (ev.stop_reasons[0] if ev.stop_reasons else None) or "length"
            chunk["choices"] = [_choice(i, [], reason, sv, body.return_token_ids)]
            yield _sse(chunk)
        else:
            if body.stream_options and body.stream_options.get("include_usage"):
                n_in = sum(n for _, n in reqs)
                yield _sse({"id": cid, "object": "text_completion", "created": created, "model": body.model,
                            "choices": [], "usage": {"prompt_tokens": n_in, "completion_tokens": n_out,
                                                     "total_tokens": n_in + n_out}})
        yield _sse(b"[DONE]")
    finally:
        for t in pumps:
            t.cancel()
        for (req, _), d in zip(reqs, done):
            if not d:  # the client went away (or another prompt failed): free its slot
                state.engine.abort(req.request_id)
                state.metrics.record("completions", "cancelled", None, time.monotonic() - t0, 0.0)


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request):
    from .openai_api import openai_error

    st: ServerState = request.app.state.cosyserve
    if not st.config.llm_only:
        return openai_error(404, "this server synthesizes speech; the speech LM's completions endpoint is served "
                                 "by 'cosyserve serve --llm-only'", None, "not_found")
    st.require_ready()
    if body.model not in st.config.served_models:
        return openai_error(404, f"model {body.model!r} is not served here; use one of "
                                 f"{', '.join(st.config.served_models)}", "model", "model_not_found")
    _check_unsupported(body)
    sv = served_vocab(st)
    prompts = body.prompt if (isinstance(body.prompt, list) and body.prompt and
                              isinstance(body.prompt[0], (list, str))) else [body.prompt]
    if not prompts or len(prompts) > 256:
        raise InvalidInputError("give 1 to 256 prompts", field="prompt")
    seeds = [None if body.seed is None else body.seed + i for i in range(len(prompts))]
    # every prompt is checked before any is queued
    reqs = [_engine_request(st, body, p, sv, s) for p, s in zip(prompts, seeds)]
    if body.stream:
        queues = []
        try:
            for req, _ in reqs:
                queues.append(st.engine.submit(req))  # QueueFullError (429) before the response starts
        except BaseException:
            for req, _ in reqs[:len(queues)]:
                st.engine.abort(req.request_id)
            raise
        return StreamingResponse(_stream_events(st, body, reqs, queues, sv), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    results = await asyncio.gather(*[_complete_one(st, req, n) for req, n in reqs])
    choices, n_prompt, n_out = [], 0, 0
    for i, (n_in, tokens, reason) in enumerate(results):
        n_prompt += n_in
        n_out += len(tokens)
        choices.append(_choice(i, tokens, reason, sv, body.return_token_ids))
    return {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()),
            "model": body.model, "choices": choices,
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}}

"""The speech LM behind an OpenAI-compatible **completions** server.

``cosyserve convert-llm`` writes the speech LM as a plain ``Qwen2ForCausalLM`` whose
vocabulary is the text vocabulary followed by the speech tokens (layout in
:mod:`cosyserve.models.export`). Any server that serves such a checkpoint through
``POST /v1/completions`` — vLLM, SGLang, ``trtllm-serve``, or ``cosyserve serve
--llm-only`` — can then generate the speech tokens of a request:

* **prompt**: token ids ``[<|sos|>] + text(prompt_text + text) + [<|task_id|>] +
  [offset + t for t in prompt_speech_tokens]`` (:meth:`SpeechVocab.prompt_ids`), sent as a
  list of integers (every server above accepts token-id prompts);
* **length**: ``min_tokens`` / ``max_tokens`` = ``int(n_text * min/max_token_text_ratio)``,
  where ``n_text`` counts the tokens of the text to speak only (upstream's rule);
* **stop**: the checkpoint's ``eos_token_id`` list (``<|eos1|>``, ``<|eos2|>``, ``<|fill|>``),
  also sent as ``stop_token_ids`` (vLLM/SGLang/trtllm-serve) for servers that ignore the
  generation config;
* **sampling**: ``top_p``/``top_k`` of the model's yaml (the checkpoint's
  ``generation_config.json`` has the same defaults). Upstream's repetition-aware
  re-sampling exists only in the native server; other servers sample plain top-k/top-p.
* **output**: the returned ``text`` is parsed for ``<|s_N|>`` tokens (whitespace between
  them and any other text are tolerated; parsing stops at a stop token). Because the
  speech tokens are *special* tokens of the exported tokenizer, vLLM and SGLang must be
  told ``skip_special_tokens: false`` (sent by default); when a server returns the
  generated ids (vLLM's ``return_token_ids``, cosyserve's ``token_ids``), those are used
  instead of the text.
* **logit bias** (optional): upstream's ``llm_decoder`` has a bias that Qwen2's ``lm_head``
  cannot hold, so the export writes it to ``speech_logit_bias.safetensors``. A server
  serving the exported checkpoint samples from slightly different logits unless the
  bias is sent as the OpenAI ``logit_bias`` map (one entry per speech/stop id, clamped to
  ±100; vLLM and SGLang accept maps of this size). The native server already has the
  bias inside its decoder: do not send it there.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CosyServeError
from ..models.export import BIAS_FILE, VOCAB_ALIGN, SpeechVocab

SPEECH_TOKEN_RE = re.compile(r"<\|(s_(\d+)|eos1|eos2|fill)\|>")


class RemoteLMError(CosyServeError):
    """The completions server failed or answered something that is not speech tokens."""


def speech_vocab(text_vocab_size: int, speech_token_size: int, family: str = "cosyvoice2") -> SpeechVocab:
    """The exported-vocabulary layout of a model whose text tokenizer has
    ``text_vocab_size`` ids (151663 for CosyVoice2, 151924 for CosyVoice3) and
    ``speech_token_size`` speech tokens (6561): the same numbers ``cosyserve convert-llm``
    writes into ``config.json``. ``family``: ``"cosyvoice2"`` / ``"cosyvoice3"``."""
    n_new = speech_token_size + (200 if family == "cosyvoice3" else 3 + 2)
    vocab = -(-(text_vocab_size + n_new) // VOCAB_ALIGN) * VOCAB_ALIGN
    return SpeechVocab(text_vocab_size, speech_token_size, vocab, family)


def load_checkpoint_info(checkpoint_dir: str | Path) -> tuple[SpeechVocab, list[float] | None]:
    """``(SpeechVocab, bias)`` of a ``convert-llm`` output folder.

    ``bias`` is the ``[S+3]`` speech-logit bias (a list of floats) or ``None`` when the folder
    has no ``speech_logit_bias.safetensors``. Raises :class:`RemoteLMError` for a folder
    that is not a ``convert-llm`` checkpoint.
    """
    d = Path(checkpoint_dir)
    try:
        cfg = json.loads((d / "config.json").read_text(encoding="utf-8"))
        sv = SpeechVocab.from_config(cfg)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RemoteLMError(f"{d} is not a 'cosyserve convert-llm' checkpoint (config.json with a "
                            f"'cosyserve' section): {exc}") from None
    bias = None
    if (d / BIAS_FILE).is_file():
        from safetensors.torch import load_file

        bias = load_file(str(d / BIAS_FILE))["bias"].float().tolist()
    return sv, bias


def logit_bias_map(sv: SpeechVocab, bias: list[float]) -> dict[str, float]:
    """OpenAI ``logit_bias`` (``{"id": value}``) adding ``bias[i]`` to exported id
    ``offset + i``; values are clamped to the API's [-100, 100]."""
    return {str(sv.speech_token_offset + i): max(-100.0, min(100.0, float(b))) for i, b in enumerate(bias)}


class SpeechTokenParser:
    """Incremental parser of one completion choice's output into speech tokens.

    Feed it the choice's ``text`` pieces (:meth:`feed_text`, e.g. the deltas of a streamed
    completion, split anywhere: a ``<|...|>`` token cut between two pieces is completed by the
    next) or its generated ids (:meth:`feed_ids`, exported-vocabulary ids); each call returns
    the new speech tokens (ints in ``[0, speech_token_size)``). Parsing stops at the first stop
    token (``<|eos1|>``, ``<|eos2|>``, ``<|fill|>``, CosyVoice3's ``<|s_N|>`` with N >= S, or
    their ids): :attr:`stopped` is then True and later input is ignored. :attr:`ignored`
    counts what was skipped (text ids, out-of-range tokens, runs of stray characters other
    than whitespace).
    """

    def __init__(self, sv: SpeechVocab):
        self.sv = sv
        self.stopped = False
        self.ignored = 0
        self._buf = ""
        self._stops = frozenset(sv.stop_token_ids)

    def feed_ids(self, token_ids) -> list[int]:
        out: list[int] = []
        for i in token_ids:
            if self.stopped:
                break
            if int(i) in self._stops:
                self.stopped = True
                break
            t = self.sv.id_to_speech(int(i))
            if t is None:
                self.ignored += 1
            else:
                out.append(t)
        return out

    def feed_text(self, text: str | None, final: bool = False) -> list[int]:
        out: list[int] = []
        if self.stopped:
            return out
        text = self._buf + (text or "")
        pos = 0
        for m in SPEECH_TOKEN_RE.finditer(text):
            if text[pos:m.start()].strip():
                self.ignored += 1
            pos = m.end()
            if m.group(2) is None:  # a stop token
                self.stopped = True
                self._buf = ""
                return out
            t = int(m.group(2))
            if t < self.sv.speech_token_size:
                out.append(t)
            elif self.sv.is_cosyvoice3:  # <|s_N|>, N >= S: one of CosyVoice3's 200 stop ids
                self.stopped = True
                self._buf = ""
                return out
            else:
                self.ignored += 1
        rest = text[pos:]
        cut = rest.rfind("<")
        if not final and cut >= 0 and "|>" not in rest[cut:]:  # a token may continue in the next piece
            rest, self._buf = rest[:cut], rest[cut:]
        else:
            self._buf = ""
        if rest.strip():
            self.ignored += 1
        return out


def parse_speech_tokens(text: str | None, token_ids: list[int] | None, sv: SpeechVocab) -> tuple[list[int], int]:
    """Speech tokens of one completion choice; returns ``(tokens, n_ignored)``.

    Uses ``token_ids`` (exported-vocabulary ids) when given, else ``<|s_N|>`` tokens in
    ``text``. Stops at the first stop token. ``n_ignored`` counts what was skipped (text ids,
    out-of-range tokens, stray characters other than whitespace). See :class:`SpeechTokenParser`.
    """
    p = SpeechTokenParser(sv)
    out = p.feed_ids(token_ids) if token_ids else p.feed_text(text, final=True)
    return out, p.ignored


@dataclass
class LMResult:
    """Speech tokens of one prompt, with the server's finish reason and the call's latency (s)."""

    tokens: list[int]
    finish_reason: str | None
    latency_s: float
    ignored: int = 0


def completions_base_url(url: str) -> str:
    """``url`` without a trailing ``/`` or ``/v1``; raises :class:`RemoteLMError` unless it is an
    ``http://`` or ``https://`` URL with a host."""
    base = str(url).strip().rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    if not base.startswith(("http://", "https://")) or not base.split("://", 1)[1].split("/", 1)[0]:
        raise RemoteLMError(f"--llm-url must be http://HOST:PORT or https://..., got {url!r}")
    return base


@dataclass
class CompletionsSettings:
    """What a request to an OpenAI-compatible completions server serving the speech LM is made
    of (shared by the blocking :class:`CompletionsLM` and the streaming :class:`StreamingCompletionsLM`).

    ``url``: the server's base URL (``http://host:port``; a trailing ``/v1`` is accepted).
    ``model``: the served model name (``None``: the first of ``GET /v1/models``).
    ``sv``: the exported-vocabulary layout. ``top_p``/``top_k``/``temperature``: sampling.
    ``logit_bias``: optional OpenAI ``logit_bias`` map (see module docstring).
    ``extra``: more request fields, merged into every body (default
    ``{"skip_special_tokens": False}``; ``cosyserve batch`` adds ``stop_token_ids``).
    ``timeout_s``: per call (streaming: the longest wait for the next bytes of the stream).
    Raises :class:`RemoteLMError` for a URL that is not ``http(s)://``.
    """

    url: str
    sv: SpeechVocab
    model: str | None = None
    api_key: str | None = None
    top_p: float | None = None
    top_k: int | None = None
    temperature: float = 1.0
    logit_bias: dict[str, float] | None = None
    extra: dict = field(default_factory=lambda: {"skip_special_tokens": False})
    timeout_s: float = 600.0

    def __post_init__(self):
        self.base = completions_base_url(self.url)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, prompt_ids: list[int], min_tokens: int, max_tokens: int, seed: int | None,
             stream: bool = False) -> dict:
        """The JSON body of one completion (``stream``: OpenAI server-sent events)."""
        b = {"model": self.model, "prompt": list(prompt_ids), "max_tokens": int(max_tokens),
             "min_tokens": int(min_tokens), "temperature": self.temperature, "n": 1, "stream": bool(stream)}
        if self.top_p is not None:
            b["top_p"] = self.top_p
        if self.top_k is not None:
            b["top_k"] = self.top_k
        if seed is not None:
            b["seed"] = int(seed)
        if self.logit_bias:
            b["logit_bias"] = self.logit_bias
        b.update(self.extra)
        return b

    def _models_error(self, exc) -> RemoteLMError:
        return RemoteLMError(f"cannot list the models of {self.base} (GET /v1/models): {exc}; pass --llm-model")


@dataclass
class CompletionsLM(CompletionsSettings):
    """Blocking client (one thread per call in flight) of a completions server that serves the
    speech LM; fields: :class:`CompletionsSettings`."""

    def __post_init__(self):
        import httpx

        super().__post_init__()
        self._http = httpx.Client(base_url=self.base, headers=self.headers, timeout=self.timeout_s)
        if self.model is None:
            self.model = self.discover_model()

    def close(self) -> None:
        self._http.close()

    def discover_model(self) -> str:
        """The first model id of ``GET /v1/models``."""
        import httpx

        try:
            r = self._http.get("/v1/models")
            r.raise_for_status()
            data = r.json().get("data") or []
            return str(data[0]["id"])
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise self._models_error(exc) from None

    def generate(self, prompt_ids: list[int], min_tokens: int, max_tokens: int, seed: int | None = None) -> LMResult:
        """One completion; raises :class:`RemoteLMError` on an HTTP error or a malformed answer."""
        import httpx

        t0 = time.perf_counter()
        try:
            r = self._http.post("/v1/completions", json=self.body(prompt_ids, min_tokens, max_tokens, seed))
        except httpx.HTTPError as exc:
            raise RemoteLMError(f"completions request to {self.base} failed: {exc}") from None
        dt = time.perf_counter() - t0
        if r.status_code != 200:
            raise RemoteLMError(f"completions server answered HTTP {r.status_code}: {r.text[:500]}")
        try:
            choice = r.json()["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            raise RemoteLMError(f"malformed completions response: {r.text[:500]}") from None
        ids = choice.get("token_ids")
        tokens, ignored = parse_speech_tokens(choice.get("text"), ids if isinstance(ids, list) else None, self.sv)
        return LMResult(tokens, choice.get("finish_reason"), dt, ignored)

    def generate_many(self, jobs: list[tuple[list[int], int, int, int | None]], concurrency: int,
                      on_done=None) -> list[LMResult]:
        """Run ``jobs`` (``(prompt_ids, min_tokens, max_tokens, seed)``) with at most
        ``concurrency`` requests in flight; results in job order. ``on_done(i)`` is called
        as each finishes."""
        results: list[LMResult | None] = [None] * len(jobs)
        with cf.ThreadPoolExecutor(max(1, concurrency)) as ex:
            futs = {ex.submit(self.generate, *job): i for i, job in enumerate(jobs)}
            for f in cf.as_completed(futs):
                results[futs[f]] = f.result()
                if on_done is not None:
                    on_done(futs[f])
        return results  # type: ignore[return-value]


@dataclass
class StreamDelta:
    """New speech tokens of a streamed completion; ``finish_reason`` (``stop``/``length``) is set
    on the last delta only."""

    tokens: list[int]
    finish_reason: str | None = None


@dataclass
class StreamingCompletionsLM(CompletionsSettings):
    """Asynchronous **streaming** client (``stream: true``, OpenAI server-sent events) of a
    completions server that serves the speech LM: tokens are handed out as the server sends
    them. Fields: :class:`CompletionsSettings`, plus ``connect_timeout_s`` (connecting to the
    server). ``timeout_s`` bounds the wait for each next piece of the stream, not the whole
    completion. One :class:`httpx.AsyncClient` (connection pool) per instance, created on the
    event loop that first uses it; call :meth:`aclose` on that loop.

    Every failure raises :class:`RemoteLMError` naming the server's URL and what went wrong
    (refused connection, HTTP status and body, timeout, a stream cut before its end, a
    malformed event, an error event)."""

    connect_timeout_s: float = 10.0

    def __post_init__(self):
        super().__post_init__()
        self._http = None

    def _client(self):
        if self._http is None:
            import httpx

            self._http = httpx.AsyncClient(
                base_url=self.base, headers=self.headers,
                timeout=httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def discover_model(self) -> str:
        """The first model id of ``GET /v1/models`` (also sets :attr:`model`)."""
        import httpx

        try:
            r = await self._client().get("/v1/models")
            r.raise_for_status()
            self.model = str((r.json().get("data") or [])[0]["id"])
            return self.model
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise self._models_error(exc) from None

    async def stream(self, prompt_ids: list[int], min_tokens: int, max_tokens: int, seed: int | None = None):
        """Async iterator of :class:`StreamDelta` for one completion of ``prompt_ids``
        (exported-vocabulary ids, :meth:`SpeechVocab.prompt_ids`) with ``min_tokens`` /
        ``max_tokens`` speech tokens and ``seed``; the last delta has the finish reason.
        Leaving the iteration early closes the connection (the server frees the request)."""
        import httpx

        if self.model is None:
            await self.discover_model()
        where = f"LLM server {self.base}"
        try:
            body = self.body(prompt_ids, min_tokens, max_tokens, seed, stream=True)
            async with self._client().stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode("utf-8", "replace")[:500]
                    raise RemoteLMError(f"{where} answered HTTP {r.status_code}: {text}")
                parser = SpeechTokenParser(self.sv)
                async for line in r.aiter_lines():
                    line = line.strip()
                    if not line.startswith("data:"):  # blank separators, comments, 'event:' lines
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        yield StreamDelta([], "length")  # ended without a finish reason
                        return
                    try:
                        ev = json.loads(data)
                        choices = ev.get("choices") or []
                    except (ValueError, AttributeError):
                        raise RemoteLMError(f"{where} sent a malformed stream event: {data[:200]!r}") from None
                    if not choices:
                        if isinstance(ev.get("error"), (dict, str)):
                            err = ev["error"]
                            msg = err.get("message", err) if isinstance(err, dict) else err
                            raise RemoteLMError(f"{where} reported an error mid-stream: {msg}")
                        continue  # e.g. a usage-only chunk
                    ch = choices[0] if isinstance(choices[0], dict) else {}
                    ids = ch.get("token_ids")
                    new = parser.feed_ids(ids) if isinstance(ids, list) and ids else parser.feed_text(ch.get("text"))
                    reason = "stop" if parser.stopped else ch.get("finish_reason")
                    if new or reason:
                        yield StreamDelta(new, reason)
                    if reason:
                        return
                raise RemoteLMError(f"{where} ended the stream before its finish_reason")
        except httpx.TimeoutException as exc:
            raise RemoteLMError(f"{where}: timed out ({type(exc).__name__}; nothing received for {self.timeout_s:g} s, "
                                f"or no connection within {self.connect_timeout_s:g} s)") from None
        except httpx.HTTPError as exc:
            raise RemoteLMError(f"{where}: {type(exc).__name__}: {exc or 'connection failed'}") from None

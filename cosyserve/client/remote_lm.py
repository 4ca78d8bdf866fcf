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


def parse_speech_tokens(text: str | None, token_ids: list[int] | None, sv: SpeechVocab) -> tuple[list[int], int]:
    """Speech tokens of one completion choice; returns ``(tokens, n_ignored)``.

    Uses ``token_ids`` (exported-vocabulary ids) when given, else ``<|s_N|>`` tokens in
    ``text``. Stops at the first stop token. ``n_ignored`` counts what was skipped (text ids,
    out-of-range tokens, stray characters other than whitespace).
    """
    out: list[int] = []
    ignored = 0
    if token_ids:
        stops = set(sv.stop_token_ids)
        for i in token_ids:
            if int(i) in stops:
                break
            t = sv.id_to_speech(int(i))
            if t is None:
                ignored += 1
            else:
                out.append(t)
        return out, ignored
    text = text or ""
    pos = 0
    for m in SPEECH_TOKEN_RE.finditer(text):
        if text[pos:m.start()].strip():
            ignored += 1
        pos = m.end()
        if m.group(2) is None:  # a stop token
            return out, ignored
        t = int(m.group(2))
        if t < sv.speech_token_size:
            out.append(t)
        elif sv.is_cosyvoice3:  # <|s_N|>, N >= S: one of CosyVoice3's 200 stop ids
            return out, ignored
        else:
            ignored += 1
    if text[pos:].strip():
        ignored += 1
    return out, ignored


@dataclass
class LMResult:
    """Speech tokens of one prompt, with the server's finish reason and the call's latency (s)."""

    tokens: list[int]
    finish_reason: str | None
    latency_s: float
    ignored: int = 0


@dataclass
class CompletionsLM:
    """Client of an OpenAI-compatible completions server that serves the speech LM.

    ``url``: the server's base URL (``http://host:port``; a trailing ``/v1`` is accepted).
    ``model``: the served model name (``None``: the first of ``GET /v1/models``).
    ``sv``: the exported-vocabulary layout. ``top_p``/``top_k``/``temperature``: sampling.
    ``logit_bias``: optional OpenAI ``logit_bias`` map (see module docstring).
    ``extra``: more request fields, merged into every body (default
    ``{"skip_special_tokens": False}``; ``cosyserve batch`` adds ``stop_token_ids``).
    ``timeout_s``: per call.
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
        import httpx

        base = self.url.rstrip("/")
        if base.endswith("/v1"):
            base = base[:-3]
        if not base.startswith(("http://", "https://")):
            raise RemoteLMError(f"--llm-url must be http://HOST:PORT or https://..., got {self.url!r}")
        self.base = base
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._http = httpx.Client(base_url=base, headers=headers, timeout=self.timeout_s)
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
            raise RemoteLMError(f"cannot list the models of {self.base} (GET /v1/models): {exc}; "
                                "pass --llm-model") from None

    def body(self, prompt_ids: list[int], min_tokens: int, max_tokens: int, seed: int | None) -> dict:
        b = {"model": self.model, "prompt": list(prompt_ids), "max_tokens": int(max_tokens),
             "min_tokens": int(min_tokens), "temperature": self.temperature, "n": 1, "stream": False}
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

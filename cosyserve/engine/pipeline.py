"""The synthesis pipeline: text + voice -> engine request -> audio.

:class:`Synthesizer` owns the models and the frontend of one model directory: it
normalises and splits the text, tokenises it, resolves the voice (a registered voice id,
or a reference recording + transcript turned into a voice on the fly) and builds
:class:`~cosyserve.engine.request.EngineRequest` objects for the engine. CLI and servers
use it; it knows nothing about HTTP.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..errors import InvalidInputError
from ..frontend.frontend import DEFAULT_MAX_TEXT_CHARS, Frontend
from ..frontend.tokenizer import ENDOFPROMPT
from ..frontend.voice import Voice, VoiceStore
from ..models.demo import is_demo_model, is_random_weights_dir, random_weights_seed
from ..models.loader import CosyVoice2Models, build_random, load_models, open_model_dir
from .core import EngineConfig, EngineCore
from .request import AudioChunk, EngineRequest, RequestFinished, SynthesisParams

log = logging.getLogger(__name__)


@dataclass
class SynthesisResult:
    """A finished request: the audio (mono float32) and timings in seconds."""

    audio: torch.Tensor
    sample_rate: int
    chunks: list[AudioChunk] = field(default_factory=list)
    finished: RequestFinished | None = None
    first_chunk_s: float | None = None
    total_s: float = 0.0

    @property
    def duration_s(self) -> float:
        return self.audio.numel() / self.sample_rate

    @property
    def rtf(self) -> float:
        """Real-time factor: compute time / audio duration."""
        return self.total_s / self.duration_s if self.duration_s > 0 else float("inf")


#: precision names accepted by the CLI / server / bench options, as torch dtypes
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_hift_dtype(name: str | torch.dtype, device: str | torch.device, dtype: torch.dtype) -> torch.dtype:
    """HiFT's trunk precision for ``name`` (see :class:`Synthesizer`); raises ValueError for
    an unknown name."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        half = dtype in (torch.float16, torch.bfloat16)
        return torch.float16 if half and torch.device(device).type == "cuda" else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"hift dtype must be auto, float32, float16 or bfloat16, not {name!r}") from None


def _frontend_device(models: CosyVoice2Models, device) -> torch.device:
    """The device of the loaded networks (``device`` if they have no parameters)."""
    for m in (models.llm, models.flow, models.hift):
        p = next(m.parameters(), None) if m is not None else None
        if p is not None:
            return p.device
    return torch.device(device)


class Synthesizer:
    """Frontend + models of one CosyVoice2 model directory.

    Args:
      model_dir: the official layout (see :mod:`cosyserve.models.loader`), or a random-weights
        directory (:func:`cosyserve.models.demo.prepare_random_weights_dir`), whose networks are
        built from its yaml with random weights.
      device, dtype: where the LM and flow run, and their precision (ignored with ``models``,
        which are used where they are).
      hift_dtype: precision of HiFT's convolution trunk (:meth:`HiFTGenerator.set_trunk_dtype`;
        F0, excitation and the STFTs stay float32): ``float32``, ``float16``, ``bfloat16``, or
        ``auto`` (default): float16 on CUDA when ``dtype`` is a half type, else float32
        (docs/perf.md documents the error against float32).
      voices_dir: voice store directory (optional).
      normalizer: ``auto`` / ``wetext`` / ``rules`` / ``none`` (see :mod:`cosyserve.frontend.text`).
      models: already loaded networks (e.g. :func:`cosyserve.models.loader.build_random`).
      max_text_chars: longest accepted input text.
      token2wav_dir: a Step-Audio2 token2wav directory (``flow.yaml``, ``flow.pt``, ``hift.pt``, ...):
        its DiT flow + HiFT replace the model directory's flow + HiFT (which are then not loaded);
        the LM, frontend and voices stay those of ``model_dir``
        (:mod:`cosyserve.engine.token2wav_dit`).
      tokenizer_backend: speech tokenizer backend (``auto``: PyTorch on the networks' device when
        that is CUDA and ``speech_tokenizer_v2.onnx`` has the real structure, else onnxruntime;
        ``torch``; ``onnxruntime``).
      load_llm: load the speech LM (False: its tokens come from a remote completions server,
        :mod:`cosyserve.engine.token_source`; the LM weights need not be in the directory).
      load_token2wav: load the flow and HiFT (or ``token2wav_dir``'s DiT token2wav); False for an
        LM-only process (``serve --llm-only``: its engine serves speech tokens, not audio, and
        neither holds the token2wav weights nor captures their CUDA graphs).
    Raises :class:`~cosyserve.errors.ModelDirError` for an unusable model directory.
    """

    def __init__(
        self,
        model_dir: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        voices_dir: str | Path | None = None,
        normalizer: str = "auto",
        models: CosyVoice2Models | None = None,
        onnx_providers: list[str] | None = None,
        max_text_chars: int = DEFAULT_MAX_TEXT_CHARS,
        hift_dtype: str | torch.dtype = "auto",
        token2wav_dir: str | Path | None = None,
        tokenizer_backend: str = "auto",
        load_llm: bool = True,
        load_token2wav: bool = True,
    ):
        if not (load_llm or load_token2wav):
            raise ValueError("load_llm and load_token2wav cannot both be False")
        if not load_token2wav:
            token2wav_dir = None  # not loaded: its DiT replaces nothing
        random_dir = models is None and is_random_weights_dir(model_dir)
        need = ("llm", "onnx", "qwen") if token2wav_dir is not None or not load_token2wav \
            else ("llm", "flow", "hift", "onnx", "qwen")
        if not load_llm:  # the LM runs elsewhere (serve --llm-url): its weights need not be there
            need = tuple(n for n in need if n != "llm")
        md = open_model_dir(model_dir, need=("onnx", "qwen") if models is not None else need)
        self.is_demo = is_demo_model(md.root)
        if self.is_demo:
            log.warning("%s is a DEMO model with random weights: its audio is noise", md.root)
        parts = ("llm",) if token2wav_dir is not None or not load_token2wav else ("llm", "flow", "hift")
        if not load_llm:
            parts = tuple(p for p in parts if p != "llm")
        if random_dir:  # a --random-weights directory: full-size networks from the yaml alone
            models = build_random(md.yaml, device=device, dtype=dtype, seed=random_weights_seed(md.root),
                                  components=parts)
        self.models = models or load_models(md.root, device=device, dtype=dtype, components=parts)
        if token2wav_dir is not None:
            from ..models.loader import attach_dit_token2wav

            attach_dit_token2wav(self.models, token2wav_dir, device=device, dtype=dtype)
        if self.models.hift is not None:
            # "auto" follows where the networks are, also for models passed in (device/dtype unused then)
            ref = next((m for m in (self.models.flow, self.models.llm) if m is not None), None)
            p = next(ref.parameters(), None) if ref is not None else None
            run_device, run_dtype = (p.device, p.dtype) if p is not None else (device, dtype)
            self.models.hift.set_trunk_dtype(resolve_hift_dtype(hift_dtype, run_device, run_dtype))
        self.cfg = self.models.cfg
        # the PyTorch speech tokenizer (real-structure ONNX) runs where the networks run
        self.frontend = Frontend(md, self.cfg, normalizer, onnx_providers, max_text_chars,
                                 device=_frontend_device(self.models, device), tokenizer_backend=tokenizer_backend)
        self.voices = VoiceStore(voices_dir) if voices_dir is not None else None

    @property
    def sample_rate(self) -> int:
        return self.cfg.sample_rate

    def new_engine(self, config: EngineConfig = EngineConfig(), observer=None) -> EngineCore:
        return EngineCore(self.models, config, observer)

    def make_voice(self, voice_id: str, audio, transcript: str, meta: dict | None = None) -> Voice:
        """See :meth:`cosyserve.frontend.frontend.Frontend.make_voice`."""
        return self.frontend.make_voice(voice_id, audio, transcript, meta)

    def get_voice(self, voice_id: str) -> Voice:
        """A registered voice; raises :class:`~cosyserve.errors.VoiceNotFoundError`."""
        if self.voices is None:
            raise InvalidInputError(f"unknown voice {voice_id!r}: no voice store is configured", field="voice")
        return self.voices.get(voice_id)

    def build_request(self, text: str, voice: Voice, params: SynthesisParams = SynthesisParams(),
                      request_id: str | None = None) -> EngineRequest:
        """Normalise, split and tokenise ``text`` for ``voice``.

        CosyVoice3 cross-lingual input (upstream ``inference_cross_lingual``): a ``text`` holding
        ``<|endofprompt|>`` (``"You are a helpful assistant.<|endofprompt|>Text to speak"``) is
        spoken with the voice's cross-lingual form (no LM prompt text / prompt speech; the flow keeps
        the prompt), and the instruction up to ``<|endofprompt|>`` is put before every text segment
        (upstream without a text normaliser keeps the whole input as one segment; with one, later
        segments would lack the marker). Raises :class:`InvalidInputError` for bad text, and for a
        marker in the input of an instruct2 voice (the instruction is already its prompt)."""
        rid = request_id or uuid.uuid4().hex
        if self.frontend.requires_endofprompt and ENDOFPROMPT in text:
            if voice.meta.get("mode") == "instruct2":
                raise InvalidInputError(f"the input must not hold {ENDOFPROMPT} together with instructions",
                                        field="input")
            instr, body = text.split(ENDOFPROMPT, 1)
            instr += ENDOFPROMPT
            prefix = torch.tensor(self.frontend.tokenizer.encode(self.frontend.text.prompt(instr)), dtype=torch.long)
            voice = self.frontend.cross_lingual_voice(voice)
            segs = [torch.cat([prefix, ids]) for ids in self.frontend.token_ids(body)]
            self.frontend.check_lm_input(voice, segs)
            return EngineRequest(rid, segs, voice, params)
        return EngineRequest(rid, self.frontend.token_ids(text, voice), voice, params)

    def synthesize(self, text: str, voice: Voice, params: SynthesisParams = SynthesisParams(),
                   engine: EngineCore | None = None, on_chunk=None) -> SynthesisResult:
        """Run one request to completion on ``engine`` (a private one by default).

        ``on_chunk(chunk)`` is called as each audio chunk arrives (streaming output).
        Raises the request's error (e.g. :class:`InvalidInputError`) if it fails.
        """
        own = engine is None
        engine = engine or self.new_engine(EngineConfig(max_active=1, max_queue=0))
        req = self.build_request(text, voice, params)
        chunks: list[AudioChunk] = []
        finished = None
        try:
            for ev in engine.run_to_completion(req):
                if isinstance(ev, AudioChunk):
                    chunks.append(ev)
                    if on_chunk is not None:
                        on_chunk(ev)
                else:
                    finished = ev
        finally:
            if own:
                engine.close()
        if finished is not None and finished.error is not None:
            raise finished.error
        audio = torch.from_numpy(np.concatenate([c.samples for c in chunks]) if chunks else np.zeros(0, np.float32))
        return SynthesisResult(audio, self.sample_rate, chunks, finished,
                               finished.first_chunk_s if finished else None,
                               finished.total_s if finished else 0.0)

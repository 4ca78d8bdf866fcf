"""The request frontend of one model directory: text -> token ids, audio -> voice.

:class:`Frontend` bundles the text tokenizer (``CosyVoice-BlankEN``), text normalisation
and splitting (:mod:`cosyserve.frontend.text`) and prompt extraction from a reference
recording (:mod:`cosyserve.frontend.prompt`: resampling, prompt mel, S3Tokenizer and
CAM++ ONNX models). It needs no network weights, so voice management can run without
loading the LM, flow or HiFT.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..errors import InvalidInputError
from ..models.config import CosyVoice2Config, load_config
from ..models.loader import ModelDir, open_model_dir
from .audio import AudioSource, load_audio
from .prompt import PromptExtractor, PromptFeatures
from .text import TextFrontend
from .tokenizer import ENDOFPROMPT, TextTokenizer
from .voice import Voice, validate_voice_id

DEFAULT_MAX_TEXT_CHARS = 5000


class Frontend:
    """Text and voice preprocessing for one model directory.

    Args:
      model_dir: an official-layout model directory (only the yaml, ``CosyVoice-BlankEN/``
        and the two ONNX files are used).
      normalizer: ``auto`` / ``wetext`` / ``rules`` / ``none``.
      onnx_providers: onnxruntime providers for the speech tokenizer and CAM++.
      max_text_chars: longest accepted input text (characters).
      device, tokenizer_backend: where the PyTorch speech tokenizer runs and which backend
        runs it (see :class:`~cosyserve.frontend.prompt.PromptExtractor`).
    Raises :class:`~cosyserve.errors.ModelDirError` if files are missing.
    """

    def __init__(self, model_dir: str | Path | ModelDir, cfg: CosyVoice2Config | None = None,
                 normalizer: str = "auto", onnx_providers: list[str] | None = None,
                 max_text_chars: int = DEFAULT_MAX_TEXT_CHARS, device=None, tokenizer_backend: str = "auto"):
        self.model_dir = model_dir if isinstance(model_dir, ModelDir) else open_model_dir(
            model_dir, need=("onnx", "qwen"))
        self.cfg = cfg or load_config(self.model_dir.yaml)
        self.tokenizer = TextTokenizer(self.model_dir.qwen, version=self.cfg.model_family)
        self.text = TextFrontend(lambda s: len(self.tokenizer.encode(s)), normalizer)
        self.prompts = PromptExtractor(self.model_dir.root, self.cfg, providers=onnx_providers, device=device,
                                       tokenizer_backend=tokenizer_backend)
        self.max_text_chars = max_text_chars

    def warmup(self) -> None:
        """Load normaliser grammars and run both ONNX models once, so that the first request
        does not pay for initialisation."""
        self.text.warmup()
        self.text.split("你好。Hello.")
        wav = torch.zeros(1, self.cfg.sample_rate * 2)
        wav[0, ::50] = 0.1
        self.prompts.extract(wav, self.cfg.sample_rate)

    def make_voice(self, voice_id: str, audio: AudioSource | tuple[torch.Tensor, int], transcript: str,
                   meta: dict | None = None) -> Voice:
        """Compute a zero-shot voice from a reference recording and its transcript.

        ``audio``: a path, bytes, a binary file, or ``(waveform [C, N] float32, sample_rate)``.
        Raises :class:`InvalidInputError` for bad audio (undecodable, shorter than 1 s,
        longer than 30 s, ...), an invalid id or an empty transcript.
        """
        self.check_voice_request(voice_id, transcript)
        return self.voice_from_prompt(voice_id, transcript, self.prompts.extract(*self.prompt_input(audio)), meta)

    def check_voice_request(self, voice_id: str, transcript: str) -> None:
        """The checks of :meth:`make_voice` that need no audio (InvalidInputError)."""
        validate_voice_id(voice_id, "name")
        if not isinstance(transcript, str) or not transcript.strip():
            raise InvalidInputError("the transcript of the reference audio (prompt text) is empty",
                                    field="prompt_text")
        if self.requires_endofprompt and ENDOFPROMPT not in transcript:
            raise InvalidInputError(
                f"CosyVoice3 prompt text must contain {ENDOFPROMPT} after the instruction, e.g. "
                f"'You are a helpful assistant.{ENDOFPROMPT}' followed by the transcript", field="prompt_text")

    def prompt_input(self, audio: AudioSource | tuple[torch.Tensor, int]) -> tuple[torch.Tensor, int]:
        """``(waveform, sample_rate)`` of ``audio`` (decoded if it is not a tuple already)."""
        if isinstance(audio, tuple):
            return audio[0], int(audio[1])
        return load_audio(audio, max_seconds=self.prompts.max_seconds + 1.0)

    def voice_from_prompt(self, voice_id: str, transcript: str, feats: PromptFeatures,
                          meta: dict | None = None) -> Voice:
        """The voice of already extracted prompt features (tokenises the transcript)."""
        ids = torch.tensor(self.tokenizer.encode(self.text.prompt(transcript)), dtype=torch.int32)
        info = {"created": time.time(), "source": "zero-shot", **(meta or {})}
        return Voice.from_features(voice_id, transcript.strip(), ids, feats.speech_token, feats.speech_feat,
                                   feats.embedding, info)

    @property
    def requires_endofprompt(self) -> bool:
        """CosyVoice3: the LM input (prompt text + text) must hold ``<|endofprompt|>``."""
        return self.cfg.llm.requires_endofprompt

    def check_lm_input(self, voice: Voice, segments: list[torch.Tensor]) -> None:
        """Refuse what upstream ``CosyVoice3LM`` asserts against: for CosyVoice3 every segment's
        LM text (``voice.prompt_text_ids`` + the segment's ids) must contain ``<|endofprompt|>``
        (in the voice's prompt text / instruction, or, for a cross-lingual voice, in the input).
        Raises :class:`InvalidInputError` (field ``input``); does nothing for CosyVoice2."""
        if not self.requires_endofprompt:
            return
        eop = self.tokenizer.token_id(ENDOFPROMPT)
        if bool((voice.prompt_text_ids == eop).any()):
            return
        if any(not bool((s == eop).any()) for s in segments):
            raise InvalidInputError(
                f"CosyVoice3 needs {ENDOFPROMPT} in the LM text: voice {voice.id!r} has none in its prompt text, "
                f"so the input must start with an instruction ending in {ENDOFPROMPT}, e.g. "
                f"'You are a helpful assistant.{ENDOFPROMPT}...'", field="input")

    def cross_lingual_voice(self, voice: Voice, voice_id: str | None = None) -> Voice:
        """The cross-lingual form of ``voice`` (upstream ``frontend_cross_lingual``: no prompt text and
        no LM prompt speech; the flow keeps the prompt). For CosyVoice3 the input text must then hold
        ``<|endofprompt|>`` (:meth:`check_lm_input`)."""
        return voice.as_cross_lingual(voice_id)

    def instruct2_voice(self, voice: Voice, instruct_text: str, voice_id: str | None = None) -> Voice:
        """The instruct form of ``voice`` (upstream ``frontend_instruct2``): the LM gets
        ``instruct_text`` as its prompt text and no prompt speech; the flow keeps the prompt.
        CosyVoice3 instructions must end in ``<|endofprompt|>`` (e.g. ``'You are a helpful
        assistant. 请用广东话表达。<|endofprompt|>'``). Raises :class:`InvalidInputError`
        (field ``instructions``) for an empty instruction or a missing ``<|endofprompt|>``."""
        if not isinstance(instruct_text, str) or not instruct_text.strip():
            raise InvalidInputError("the instruction is empty", field="instructions")
        if self.requires_endofprompt and ENDOFPROMPT not in instruct_text:
            raise InvalidInputError(f"CosyVoice3 instructions must end with {ENDOFPROMPT}, e.g. "
                                    f"'You are a helpful assistant. 请用广东话表达。{ENDOFPROMPT}'", field="instructions")
        ids = torch.tensor(self.tokenizer.encode(self.text.prompt(instruct_text)), dtype=torch.int32)
        return voice.as_instruct2(instruct_text, ids, voice_id)

    def segments(self, text: str) -> list[str]:
        """Normalised text segments to speak in order; raises :class:`InvalidInputError`
        for empty, too long, or unspeakable (punctuation-only) text."""
        if not isinstance(text, str) or not text.strip():
            raise InvalidInputError("the text is empty", field="input")
        if len(text) > self.max_text_chars:
            raise InvalidInputError(f"the text has {len(text)} characters; the limit is {self.max_text_chars}",
                                    field="input")
        segs = self.text.split(text)
        if not segs:
            raise InvalidInputError("the text has nothing to speak (only punctuation or symbols)", field="input")
        return segs

    def token_ids(self, text: str, voice: Voice | None = None) -> list[torch.Tensor]:
        """Token ids (1-D long tensors) of each normalised segment of ``text``; with ``voice``,
        also checked with :meth:`check_lm_input`."""
        ids = [torch.tensor(self.tokenizer.encode(s), dtype=torch.long) for s in self.segments(text)]
        ids = [t for t in ids if t.numel()]
        if not ids:
            raise InvalidInputError("the text has nothing to speak", field="input")
        if voice is not None:
            self.check_lm_input(voice, ids)
        return ids

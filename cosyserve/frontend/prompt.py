"""Zero-shot prompt features: one reference recording -> what the LLM and flow condition on.

:class:`PromptExtractor` reproduces the audio half of upstream
``CosyVoiceFrontEnd.frontend_zero_shot`` for CosyVoice2:

1. average the channels to mono; check 1 s <= duration <= 30 s (parameters);
2. resample (torchaudio ``Resample`` semantics) to 16 kHz and to the model rate
   (``cfg.sample_rate``, 24 kHz);
3. ``speech_feat``: prompt mel of the model-rate audio (``feat_extractor`` of the yaml),
   ``[1, T_mel, 80]`` at 50 frames/s;
4. ``speech_token``: whisper 128-bin log-mel of the 16 kHz audio -> ``speech_tokenizer_v2``
   (CosyVoice3: ``speech_tokenizer_v3``), ``[1, T_tok]`` at 25 tokens/s;
5. ``embedding``: Kaldi fbank (minus mean) of the 16 kHz audio -> CAM++, ``[1, 192]``;
6. alignment: ``token_len = min(T_mel // token_mel_ratio, T_tok)``; keep the first
   ``token_len`` tokens and the first ``token_mel_ratio * token_len`` mel frames, so that
   the flow sees exactly ``token_mel_ratio`` frames per prompt token.

Upstream reads the prompt file three times (once per feature) and resamples each time;
here it is decoded once and resampled once per target rate, which gives identical tensors.

Batching: extraction is split into :meth:`PromptExtractor.prepare` (per request: checks,
resampling, the three feature extractions; a :class:`PromptInput`) and
:meth:`PromptExtractor.finish` (a list of prepared prompts: ONE speech-tokenizer call for all
of them — one padded forward with the PyTorch tokenizer — and CAM++ for each item, on a few
threads while the tokenizer runs), so concurrent
requests can share the network calls (:class:`~cosyserve.frontend.prompt_batch.PromptBatcher`).
Results equal those of :meth:`PromptExtractor.extract`, which is ``finish([prepare(...)])``.
The prompt *text* is tokenised separately (:class:`~cosyserve.frontend.tokenizer.TextTokenizer`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InvalidInputError, ModelDirError
from ..models.config import MODEL_FAMILIES, CosyVoice2Config, load_config
from .audio import (
    DEFAULT_FIELD,
    PROMPT_MIN_SAMPLE_RATE,
    AudioSource,
    check_waveform,
    load_audio,
    resample,
    to_mono,
)
from .features import SPEAKER_FBANK, SPEECH_TOKENIZER_MEL, PromptMelExtractor, speaker_fbank, whisper_log_mel
from .speech_models import (
    CAMPPLUS_FILE,
    SPEECH_TOKENIZER_FILES,
    TOKENIZER_MAX_SECONDS,
    SpeakerEncoder,
    open_speech_tokenizer,
    speaker_providers,
)

#: Default accepted prompt durations, seconds.
PROMPT_MIN_SECONDS = 1.0
PROMPT_MAX_SECONDS = TOKENIZER_MAX_SECONDS


@dataclass
class PromptFeatures:
    """Speaker/prompt conditioning of one zero-shot voice (upstream ``frontend_zero_shot`` output).

    Attributes:
        speech_feat: float32 ``[1, T, 80]`` natural-log mel of the prompt at 50 frames/s
            (``prompt_speech_feat``; flow input ``prompt_feat``), ``T = token_mel_ratio * L``.
        speech_token: int32 ``[1, L]`` speech tokens at 25/s (``llm_/flow_prompt_speech_token``).
        embedding: float32 ``[1, 192]`` CAM++ x-vector (``llm_/flow_embedding``; unnormalised).
    """

    speech_feat: torch.Tensor
    speech_token: torch.Tensor
    embedding: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.speech_token.shape[1])

    @property
    def num_frames(self) -> int:
        return int(self.speech_feat.shape[1])

    def to(self, device) -> "PromptFeatures":
        return PromptFeatures(self.speech_feat.to(device), self.speech_token.to(device), self.embedding.to(device))


@dataclass
class PromptInput:
    """One prompt after the per-request part of extraction (:meth:`PromptExtractor.prepare`).

    Attributes:
        speech_feat: float32 ``[1, T_mel, 80]`` prompt mel (not yet cut to the tokens).
        log_mel: float32 ``[1, 128, T_w]`` whisper log-mel of the 16 kHz audio (tokenizer input).
        fbank: float32 ``[1, T_f, 80]`` mean-normalised Kaldi fbank (CAM++ input).
    """

    speech_feat: torch.Tensor
    log_mel: torch.Tensor
    fbank: torch.Tensor


class PromptExtractor:
    """Compute :class:`PromptFeatures` from a prompt recording.

    Args:
        model_dir: a CosyVoice2 / CosyVoice3 model directory (``campplus.onnx``,
            ``speech_tokenizer_v2.onnx`` / ``_v3.onnx``, ``cosyvoice2.yaml`` / ``cosyvoice3.yaml``).
        cfg: the parsed config; ``None`` loads the directory's yaml. Its ``feat`` (prompt
            mel), ``sample_rate``, ``token_mel_ratio`` and ``model_family`` (which speech
            tokenizer file) are used.
        providers: onnxruntime providers for the two ONNX models (default CPU; e.g.
            ``"cuda"``); ``num_threads``: intra-op threads per ONNX session.
        device: where the PyTorch speech tokenizer runs (default CPU).
        tokenizer_backend: ``auto`` (PyTorch on a CUDA ``device`` for a real-structure
            ``speech_tokenizer_v2.onnx``, else onnxruntime), ``torch`` or ``onnxruntime``
            (:func:`~cosyserve.frontend.speech_models.open_speech_tokenizer`).
        min_seconds, max_seconds: accepted prompt durations (default 1 s .. 30 s; the
            speech tokenizer cannot take more than 30 s).
        min_sample_rate: lowest input rate accepted when resampling is needed (upstream
            ``load_wav`` asserts 16 kHz).
        speaker_threads: threads that run CAM++ for the items of a :meth:`finish` batch, while
            the calling thread runs the speech tokenizer (default ``min(8, CPU cores)``; 1: CAM++
            in the calling thread after the tokenizer).

    Raises:
        ModelDirError: a model file is missing or unusable.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        cfg: CosyVoice2Config | None = None,
        *,
        providers=None,
        num_threads: int = 1,
        min_seconds: float = PROMPT_MIN_SECONDS,
        max_seconds: float = PROMPT_MAX_SECONDS,
        min_sample_rate: int = PROMPT_MIN_SAMPLE_RATE,
        device=None,
        tokenizer_backend: str = "auto",
        speaker_threads: int | None = None,
    ):
        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise ModelDirError(f"model directory not found: '{self.model_dir}'")
        if cfg is None:
            yamls = [self.model_dir / m["yaml"] for m in MODEL_FAMILIES.values() if (self.model_dir / m["yaml"]).is_file()]
            if not yamls:
                raise ModelDirError(f"'{self.model_dir}' has no {' or '.join(m['yaml'] for m in MODEL_FAMILIES.values())}")
            cfg = load_config(yamls[0])
        self.cfg = cfg
        if not (0 < min_seconds <= max_seconds):
            raise ValueError(f"bad prompt duration limits {min_seconds}..{max_seconds} s")
        self.min_seconds = float(min_seconds)
        self.max_seconds = float(max_seconds)
        self.min_sample_rate = int(min_sample_rate)
        self.token_mel_ratio = int(self.cfg.token_mel_ratio)
        self.sample_rate = int(self.cfg.feat.sampling_rate)
        self.mel = PromptMelExtractor(self.cfg.feat)
        # the tokenizer keeps its own 30 s limit (a model property) whatever max_seconds says
        self.speech_tokenizer = open_speech_tokenizer(self.model_dir / SPEECH_TOKENIZER_FILES[self.cfg.model_family],
                                                      backend=tokenizer_backend, device=device,
                                                      providers=providers, num_threads=num_threads)
        self.speaker_threads = max(1, int(speaker_threads if speaker_threads is not None
                                          else min(8, os.cpu_count() or 1)))
        self._speaker_pool = None
        self.speaker_encoder = SpeakerEncoder(self.model_dir / CAMPPLUS_FILE,
                                              providers=speaker_providers(device, providers),
                                              num_threads=num_threads)

    # ---------------------------------------------------------------- entry points

    def extract_file(self, src: AudioSource, *, field: str = DEFAULT_FIELD) -> PromptFeatures:
        """Decode ``src`` (path / bytes / stream, see :func:`~cosyserve.frontend.audio.load_audio`) and extract."""
        wav, sr = load_audio(src, max_seconds=self.max_seconds + 1.0, field=field)
        return self.extract(wav, sr, field=field)

    def extract(self, wav: torch.Tensor, sr: int, *, field: str = DEFAULT_FIELD) -> PromptFeatures:
        """Prompt features of a waveform (``finish([prepare(wav, sr)])[0]``, errors raised)."""
        out = self.finish([self.prepare(wav, sr, field=field)])[0]
        if isinstance(out, BaseException):
            raise out
        return out

    def prepare_file(self, src: AudioSource, *, field: str = DEFAULT_FIELD) -> PromptInput:
        """Decode ``src`` (see :meth:`extract_file`) and :meth:`prepare` it."""
        wav, sr = load_audio(src, max_seconds=self.max_seconds + 1.0, field=field)
        return self.prepare(wav, sr, field=field)

    def prepare(self, wav: torch.Tensor, sr: int, *, field: str = DEFAULT_FIELD) -> PromptInput:
        """The per-request part of extraction: checks, resampling and the three feature
        extractions (CPU or ``wav``'s device); see :meth:`finish` for the rest.

        Args:
            wav: float ``[C, N]`` or ``[N]`` in [-1, 1] at ``sr`` Hz (any device).
            sr: sample rate in Hz.

        Raises:
            InvalidInputError: bad waveform (see
                :func:`~cosyserve.frontend.audio.check_waveform`), duration outside
                [``min_seconds``, ``max_seconds``], or a rate below ``min_sample_rate``
                that would need resampling.
        """
        wav = to_mono(check_waveform(wav, sr, field=field))
        sr = int(sr)
        seconds = wav.shape[1] / sr
        if seconds < self.min_seconds:
            raise InvalidInputError(
                f"prompt audio too short: {seconds:.2f} s; at least {self.min_seconds:g} s is required", field=field
            )
        if seconds > self.max_seconds:
            raise InvalidInputError(
                f"prompt audio too long: {seconds:.2f} s; at most {self.max_seconds:g} s is accepted", field=field
            )
        targets = {SPEECH_TOKENIZER_MEL.sample_rate, SPEAKER_FBANK.sample_rate, self.sample_rate}
        if sr < self.min_sample_rate and any(t != sr for t in targets):
            raise InvalidInputError(
                f"prompt audio sample rate {sr} Hz is too low; at least {self.min_sample_rate} Hz is required",
                field=field,
            )
        wav = wav.float() if wav.dtype != torch.float32 else wav
        wav_16k = resample(wav, sr, SPEECH_TOKENIZER_MEL.sample_rate)
        wav_model = resample(wav, sr, self.sample_rate)
        return self.prepare_resampled(wav_16k, wav_model)

    def prepare_resampled(self, wav_16k: torch.Tensor, wav_model: torch.Tensor) -> PromptInput:
        """:class:`PromptInput` of already-resampled mono audio: ``wav_16k`` float32 ``[1, N16]``
        at 16 kHz (speech tokenizer, speaker model), ``wav_model`` float32 ``[1, N]`` at the model
        rate (``cfg.sample_rate``, prompt mel). Raises InvalidInputError for too little audio."""
        return PromptInput(self.mel(wav_model), whisper_log_mel(wav_16k), speaker_fbank(wav_16k))

    def extract_resampled(self, wav_16k: torch.Tensor, wav_model: torch.Tensor) -> PromptFeatures:
        """Prompt features from already-resampled mono audio (see :meth:`prepare_resampled`)."""
        out = self.finish([self.prepare_resampled(wav_16k, wav_model)])[0]
        if isinstance(out, BaseException):
            raise out
        return out

    def finish(self, inputs: list[PromptInput]) -> list[PromptFeatures | Exception]:
        """The network part of extraction for several prompts: ONE speech-tokenizer call for all
        (one padded forward with the PyTorch backend), CAM++ for each, then :meth:`align`.

        Returns one entry per input, in order: its :class:`PromptFeatures`, or the exception
        that item raised (a failing item does not fail the others: when the batched tokenizer
        call fails, the items are retried one at a time). Results equal single-item calls.
        """
        if not inputs:
            return []
        # CAM++ (one item per onnxruntime call, one core each) runs on the speaker threads while
        # this thread runs the tokenizer: the two overlap, and the items spread over the cores
        pool = self._speaker_executor() if self.speaker_threads > 1 else None
        embs = [pool.submit(self.speaker_encoder, p.fbank) for p in inputs] if pool is not None else None
        try:
            tokens: list = list(self.speech_tokenizer.tokenize([p.log_mel for p in inputs]))
        except Exception:  # noqa: BLE001 - retried per item so the error lands on the item causing it
            tokens = []
            for p in inputs:
                try:
                    tokens.append(self.speech_tokenizer(p.log_mel))
                except Exception as exc:  # noqa: BLE001
                    tokens.append(exc)
        out: list[PromptFeatures | Exception] = []
        for i, (p, tok) in enumerate(zip(inputs, tokens)):
            try:
                emb = embs[i].result() if embs is not None else None  # [1, 192]
                if isinstance(tok, Exception):
                    out.append(tok)
                    continue
                if emb is None:
                    emb = self.speaker_encoder(p.fbank)
                out.append(self.align(p.speech_feat, tok.to(p.speech_feat.device), emb))
            except Exception as exc:  # noqa: BLE001
                out.append(exc)
        return out

    def _speaker_executor(self):
        if self._speaker_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._speaker_pool = ThreadPoolExecutor(self.speaker_threads, thread_name_prefix="campplus")
        return self._speaker_pool

    def align(self, speech_feat: torch.Tensor, speech_token: torch.Tensor, embedding: torch.Tensor) -> PromptFeatures:
        """Cut mel and tokens to ``token_mel_ratio`` frames per token (upstream ``frontend_zero_shot``)."""
        r = self.token_mel_ratio
        token_len = min(speech_feat.shape[1] // r, speech_token.shape[1])
        return PromptFeatures(
            speech_feat=speech_feat[:, : r * token_len].contiguous(),
            speech_token=speech_token[:, :token_len].to(torch.int32).contiguous(),
            embedding=embedding.to(torch.float32),
        )

"""The two ONNX models of a CosyVoice2 model directory, run with onnxruntime.

* :class:`SpeakerEncoder` wraps ``campplus.onnx`` (CAM++ speaker verification model):
  mean-normalised 80-bin Kaldi fbank ``[1, T, 80]`` (100 frames/s, 16 kHz audio) ->
  one 192-dimensional x-vector ``[1, 192]`` (unnormalised, as upstream passes it on).
* :class:`SpeechTokenizer` wraps ``speech_tokenizer_v2.onnx`` (CosyVoice3:
  ``speech_tokenizer_v3.onnx``, same inputs and outputs) (the S3 supervised
  semantic tokenizer with an FSQ codebook of 3**8 = 6561 entries): whisper 128-bin
  log-mel ``[1, 128, T]`` (100 frames/s) plus its length -> speech tokens
  ``[1, ceil(T / 4)]`` at 25 tokens/s.

Calling conventions follow upstream ``CosyVoiceFrontEnd._extract_spk_embedding`` /
``_extract_speech_token``: inputs are addressed by position (their names differ between
exports), the first output is used, and the tokenizer refuses audio longer than 30 s
(upstream asserts it; the model's positional range ends there).

Sessions use the CPU execution provider unless CUDA is asked for and available, full
graph optimisation, and ``intra_op_num_threads=1`` by default (upstream's choice; many
concurrent requests then scale across cores instead of fighting over them).
``InferenceSession.run`` is thread-safe, so one instance can serve concurrent callers.

Batches: both models take several utterances at once (``tokenize`` / ``embed_many``).
:func:`open_speech_tokenizer` picks the tokenizer's backend: on a CUDA serving device a file
with the real S3 tokenizer v2 structure runs in PyTorch (:class:`TorchSpeechTokenizer`: one
padded forward for the whole batch), a stand-in (demo / reference fixtures) — and any file on
the CPU, where onnxruntime is faster — through onnxruntime, item by item. CAM++ always runs through onnxruntime, items back to back (its statistics
pooling and convolution edges make padding inexact), on the CUDA execution provider when the
serving device is CUDA and onnxruntime-gpu is installed (:func:`speaker_providers`).
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..errors import InvalidInputError, ModelDirError
from .features import SPEAKER_FBANK, SPEECH_TOKENIZER_MEL

log = logging.getLogger(__name__)

CAMPPLUS_FILE = "campplus.onnx"
SPEECH_TOKENIZER_FILE = "speech_tokenizer_v2.onnx"
#: the speech tokenizer of each model family (upstream ``CosyVoice2`` / ``CosyVoice3`` constructors)
SPEECH_TOKENIZER_FILES = {"cosyvoice2": SPEECH_TOKENIZER_FILE, "cosyvoice3": "speech_tokenizer_v3.onnx"}

#: Speaker embedding size of CAM++ as used by CosyVoice2 (``spk_embed_dim``).
SPEAKER_EMBED_DIM = 192
#: Longest audio the speech tokenizer accepts (upstream assertion), seconds.
TOKENIZER_MAX_SECONDS = 30.0
#: Mel frames per speech token (100 frames/s -> 25 tokens/s).
TOKENIZER_FRAMES_PER_TOKEN = 4
#: Size of the S3 tokenizer v2 codebook (FSQ, 8 digits of base 3).
SPEECH_CODEBOOK_SIZE = 6561

_PROVIDER_ALIASES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "gpu": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}


def resolve_providers(providers: str | Sequence | None) -> list:
    """Turn a provider request into an onnxruntime provider list.

    ``None`` -> ``["CPUExecutionProvider"]``. Otherwise a name or a list of names
    (``"cpu"``, ``"cuda"``, full onnxruntime names, or ``(name, options)`` tuples);
    providers this onnxruntime build lacks are dropped with a warning, and the CPU
    provider is always appended as the fallback.
    """
    import onnxruntime as ort

    if providers is None:
        return ["CPUExecutionProvider"]
    if isinstance(providers, str):
        providers = [providers]
    available = set(ort.get_available_providers())
    out: list = []
    for p in providers:
        name, opts = (p if isinstance(p, tuple) else (p, None))
        name = _PROVIDER_ALIASES.get(str(name).lower(), name)
        if name not in available:
            log.warning("onnxruntime provider %s is not available here (have %s); skipping it",
                        name, sorted(available))
            continue
        out.append((name, opts) if opts else name)
    if not any((q[0] if isinstance(q, tuple) else q) == "CPUExecutionProvider" for q in out):
        out.append("CPUExecutionProvider")
    return out


class _OnnxModel:
    """An onnxruntime session with path checks and input-count validation."""

    file_hint = "model"
    n_inputs = 1

    def __init__(self, onnx_path: str | os.PathLike, providers=None, num_threads: int = 1):
        import onnxruntime as ort

        path = Path(onnx_path)
        if not path.is_file():
            raise ModelDirError(f"{self.file_hint} not found: '{path}'")
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.intra_op_num_threads = max(1, int(num_threads))
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        self.path = path
        self.providers = resolve_providers(providers)
        try:
            self.session = ort.InferenceSession(str(path), sess_options=opts, providers=self.providers)
        except Exception as exc:  # onnxruntime raises its own pybind exception types
            raise ModelDirError(f"'{path}' is not a loadable ONNX model ({self.file_hint}): "
                                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}") from None
        self.inputs = self.session.get_inputs()
        self.outputs = self.session.get_outputs()
        if len(self.inputs) != self.n_inputs or not self.outputs:
            raise ModelDirError(
                f"'{path}' has {len(self.inputs)} inputs and {len(self.outputs)} outputs; "
                f"{self.file_hint} must have {self.n_inputs} input(s) and at least one output"
            )

    def _run(self, feeds: list[np.ndarray]) -> np.ndarray:
        out = self.session.run([self.outputs[0].name], {i.name: a for i, a in zip(self.inputs, feeds)})
        return out[0]


def speaker_providers(device: str | torch.device | None, providers=None):
    """onnxruntime providers for CAM++: ``providers`` when given; otherwise CUDA (with CPU
    fallback) when ``device`` is a CUDA device and this onnxruntime has the CUDA execution
    provider (the ``onnxruntime-gpu`` package), else CPU."""
    if providers is not None:
        return providers
    if device is not None and torch.device(device).type == "cuda":
        import onnxruntime as ort

        if "CUDAExecutionProvider" in ort.get_available_providers():
            index = torch.device(device).index
            return [("CUDAExecutionProvider", {"device_id": int(index or 0)})]
    return None


class SpeakerEncoder(_OnnxModel):
    """CAM++ speaker embedding model (``campplus.onnx``).

    ``__call__(fbank)``: ``fbank`` float ``[1, T, 80]`` (or ``[T, 80]``), the output of
    :func:`~cosyserve.frontend.features.speaker_fbank` of 16 kHz audio; returns float32
    ``[1, 192]`` on ``fbank``'s device.

    Raises:
        ModelDirError: file missing or not a loadable ONNX model with one input.
        InvalidInputError: no frames.
    """

    file_hint = f"speaker model {CAMPPLUS_FILE}"
    n_inputs = 1

    def __call__(self, fbank: torch.Tensor) -> torch.Tensor:
        if fbank.dim() == 2:
            fbank = fbank.unsqueeze(0)
        if fbank.dim() != 3 or fbank.shape[0] != 1 or fbank.shape[2] != SPEAKER_FBANK.num_mel_bins:
            raise ValueError(f"SpeakerEncoder expects fbank [1, T, {SPEAKER_FBANK.num_mel_bins}], "
                             f"got {tuple(fbank.shape)}")
        if fbank.shape[1] == 0:
            raise InvalidInputError("audio too short for a speaker embedding (no fbank frames)", field="prompt_wav")
        feats = fbank.detach().to("cpu", torch.float32).contiguous().numpy()
        emb = np.asarray(self._run([feats]), dtype=np.float32).reshape(1, -1)
        return torch.from_numpy(emb).to(fbank.device)

    def embed_many(self, fbanks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Embeddings ``[1, 192]`` of several fbanks (each as in ``__call__``), run back to back
        (one session, no padding: results equal single calls)."""
        return [self(f) for f in fbanks]


class SpeechTokenizer(_OnnxModel):
    """S3 speech tokenizer v2 / v3 (``speech_tokenizer_v2.onnx``, ``speech_tokenizer_v3.onnx``: the
    same calling convention): 25 speech tokens per second.

    ``__call__(feats)``: ``feats`` float ``[1, 128, T]`` whisper log-mel of 16 kHz audio
    (:func:`~cosyserve.frontend.features.whisper_log_mel`, 100 frames/s); the model gets
    it as float32 together with ``feats_length`` int32 ``[T]`` (inputs by position).
    Returns int32 ``[1, ceil(T / 4)]`` token ids in ``[0, 6561)`` on ``feats``' device.

    Raises:
        ModelDirError: file missing or not a loadable ONNX model with two inputs.
        InvalidInputError: more than ``max_seconds`` (30 s) of audio, or no frames.
    """

    file_hint = f"speech tokenizer {SPEECH_TOKENIZER_FILE}"
    n_inputs = 2
    backend = "onnxruntime"

    def __init__(self, onnx_path, providers=None, num_threads: int = 1, max_seconds: float = TOKENIZER_MAX_SECONDS):
        self.file_hint = f"speech tokenizer {Path(onnx_path).name}"
        super().__init__(onnx_path, providers, num_threads)
        self.max_seconds = float(max_seconds)

    @property
    def max_frames(self) -> int:
        return int(math.floor(self.max_seconds * SPEECH_TOKENIZER_MEL.frame_rate))

    def __call__(self, feats: torch.Tensor) -> torch.Tensor:
        feats = _check_log_mel(feats, self.max_frames, self.max_seconds)
        frames = int(feats.shape[2])
        x = feats.detach().to("cpu", torch.float32).contiguous().numpy()
        tokens = self._run([x, np.array([frames], dtype=np.int32)])
        tokens = np.asarray(tokens).reshape(1, -1).astype(np.int32)
        return torch.from_numpy(tokens).to(feats.device)

    def tokenize(self, feats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Tokens ``[1, T'_i]`` of several log-mels (each as in ``__call__``), run back to back
        (stand-in graphs take one utterance at a time)."""
        return [self(f) for f in feats]


def _check_log_mel(feats: torch.Tensor, max_frames: int, max_seconds: float) -> torch.Tensor:
    """``feats`` as ``[1, n_mels, T]``; ValueError for a wrong shape, InvalidInputError for no
    frames or more than ``max_frames``."""
    if feats.dim() == 2:
        feats = feats.unsqueeze(0)
    if feats.dim() != 3 or feats.shape[0] != 1 or feats.shape[1] != SPEECH_TOKENIZER_MEL.n_mels:
        raise ValueError(f"SpeechTokenizer expects log-mel [1, {SPEECH_TOKENIZER_MEL.n_mels}, T], "
                         f"got {tuple(feats.shape)}")
    frames = int(feats.shape[2])
    if frames == 0:
        raise InvalidInputError("audio too short for speech tokens (no log-mel frames)", field="prompt_wav")
    if frames > max_frames:
        raise InvalidInputError(
            f"audio of {frames / SPEECH_TOKENIZER_MEL.frame_rate:.2f} s is too long for the speech tokenizer; "
            f"at most {max_seconds:g} s is supported",
            field="prompt_wav",
        )
    return feats


class TorchSpeechTokenizer:
    """S3 speech tokenizer v2 in PyTorch (:mod:`cosyserve.frontend.s3tokenizer`), batched.

    Same calling convention as :class:`SpeechTokenizer`: ``__call__(feats)`` with ``feats``
    float ``[1, 128, T]`` -> int32 ``[1, ceil(T / 4)]`` on ``feats``' device; ``tokenize(list)``
    runs all items in ONE padded forward on ``device`` (per-item masks; each item's tokens equal
    its single-item tokens) and returns them on the CPU.

    On CUDA the forward runs on a stream of its own (:func:`~cosyserve.models.graphs.capture_stream`,
    default priority): not the legacy default stream, which would synchronise with the engine's
    streams, and not one from torch's round-robin pool, which could be the token2wav stream and
    queue the tokenizer behind a flow batch. The LM's high-priority stream keeps precedence.

    Args:
        model: the loaded network (:func:`~cosyserve.frontend.s3tokenizer.load_s3_tokenizer_v2`).
        path: the ONNX file it came from (for messages).
        max_seconds: longest accepted audio (30 s, the model's positional range upstream).

    Raises (calls): InvalidInputError for no frames or more than ``max_seconds``; ValueError for
    a tensor of the wrong shape.
    """

    backend = "torch"

    def __init__(self, model, path: str | os.PathLike, max_seconds: float = TOKENIZER_MAX_SECONDS):
        self.model = model
        self.path = Path(path)
        self.max_seconds = float(max_seconds)
        self._stream = None

    @property
    def device(self) -> torch.device:
        return self.model.conv1.weight.device

    @property
    def max_frames(self) -> int:
        return int(math.floor(self.max_seconds * SPEECH_TOKENIZER_MEL.frame_rate))

    def __call__(self, feats: torch.Tensor) -> torch.Tensor:
        return self.tokenize([feats])[0].to(feats.device)

    def tokenize(self, feats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        checked = [_check_log_mel(f, self.max_frames, self.max_seconds)[0] for f in feats]
        if not checked:
            return []
        if self.device.type != "cuda":
            return self._run(checked)
        if self._stream is None:
            from ..models.graphs import capture_stream

            self._stream = capture_stream(self.device)
        with torch.cuda.stream(self._stream):
            return self._run(checked)

    def _run(self, checked: list[torch.Tensor]) -> list[torch.Tensor]:
        out = self.model.tokenize(checked)
        lengths = [o.shape[1] for o in out]
        flat = torch.cat([o[0] for o in out]).cpu()  # one device-to-host copy (and stream sync) for the batch
        return [t.view(1, -1) for t in flat.split(lengths)]


#: tokenizer backends accepted by :func:`open_speech_tokenizer`
TOKENIZER_BACKENDS = ("auto", "torch", "onnxruntime")


def open_speech_tokenizer(onnx_path: str | os.PathLike, *, backend: str = "auto", device=None, providers=None,
                          num_threads: int = 1, max_seconds: float = TOKENIZER_MAX_SECONDS):
    """The speech tokenizer of ``onnx_path`` with the backend ``backend``.

    ``auto``: PyTorch (:class:`TorchSpeechTokenizer` on ``device``) when ``device`` is a CUDA
    device and the file has the real S3 tokenizer v2 structure, else onnxruntime
    (:class:`SpeechTokenizer` with ``providers``; on the CPU onnxruntime is the faster one:
    613 ms against 927 ms for a 4 s prompt on one thread, full size, benchmarks/prompt_probe.py);
    ``torch``: PyTorch on ``device`` (default CPU), which requires the real structure;
    ``onnxruntime``: always the session. Raises :class:`ModelDirError` for a missing / unusable file, ``torch`` with a
    stand-in, or an unknown backend.
    """
    from .s3tokenizer import load_s3_tokenizer_v2

    if backend not in TOKENIZER_BACKENDS:
        raise ModelDirError(f"unknown speech tokenizer backend {backend!r}; use one of {', '.join(TOKENIZER_BACKENDS)}")
    path = Path(onnx_path)
    on_cuda = device is not None and torch.device(device).type == "cuda"
    if backend == "torch" or (backend == "auto" and on_cuda):
        if not path.is_file():
            raise ModelDirError(f"speech tokenizer {SPEECH_TOKENIZER_FILE} not found: '{path}'")
        model = load_s3_tokenizer_v2(path, device=device or "cpu")
        if model is not None:
            log.info("speech tokenizer %s: PyTorch S3 tokenizer v2 on %s (%d layers, width %d)", path,
                     model.conv1.weight.device, model.dims.n_layer, model.dims.n_state)
            return TorchSpeechTokenizer(model, path, max_seconds)
        if backend == "torch":
            raise ModelDirError(f"'{path}' does not have the S3 tokenizer v2 structure (a stand-in?); "
                                "the torch backend cannot run it")
    return SpeechTokenizer(path, providers=providers, num_threads=num_threads, max_seconds=max_seconds)

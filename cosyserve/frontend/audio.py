"""Audio input for the frontend: decoding, down-mixing and sample-rate conversion.

Everything here reproduces what upstream CosyVoice does to a prompt before any feature
is computed (``cosyvoice.utils.file_utils.load_wav``), without torchaudio:

* :func:`load_audio` decodes a file / bytes / binary stream with libsndfile (the
  ``soundfile`` package) exactly like torchaudio's ``soundfile`` backend with
  ``normalize=True``: float32 samples, integer PCM scaled by ``1 / 2**(bits-1)``
  (16-bit PCM divided by 32768), float files passed through unchanged, channels first.
* :func:`to_mono` averages the channels (``wav.mean(dim=0, keepdim=True)``).
* :func:`resample` is ``torchaudio.transforms.Resample`` with its defaults
  (``sinc_interp_hann``, ``lowpass_filter_width=6``, ``rolloff=0.99``): a polyphase
  windowed-sinc FIR whose kernel is built for the gcd-reduced rate pair and applied with
  a strided ``conv1d``; the output length is ``ceil(new * N / orig)``. The kernel
  arithmetic follows torchaudio's own (float64 kernel whose per-phase offsets are
  rounded to float32 first, stored as float32); on CPU the output is bit-identical to
  torchaudio 2.11 (checked on the reference prompts and on random signals at 8 to 96 kHz).
  On CUDA the convolution runs in float64 because cuDNN's default TF32 mode would cost
  ~2e-4 relative error (torchaudio on CUDA has that error); there the result is within
  ~1e-7 of torchaudio on CPU.
* :func:`load_prompt_wav` = upstream ``load_wav(src, target_sr)``.

User-caused problems (missing file, undecodable bytes, empty audio, NaN/inf samples,
absurd or too-low sample rates) raise :class:`cosyserve.errors.InvalidInputError` with
``field`` set (default ``"prompt_wav"``); no soundfile/numpy exception escapes.

One deliberate extension over torchaudio: a rate pair whose gcd-reduced polyphase
kernel would be huge (e.g. 44101 Hz -> 16000 Hz reduces to 44101:16000 and would need a
16000 x 44119 kernel, ~5.6 GB in float64) is evaluated tap by tap around each output
sample instead (:func:`_resample_direct`). The taps it skips are those torchaudio clamps
to the window edge, whose weight is ``cos(pi/2)**2 * sinc(...)`` < 1e-30, so the result
equals torchaudio's to float32 rounding; memory stays proportional to the output.
"""

from __future__ import annotations

import functools
import io
import math
import os
from pathlib import Path
from typing import BinaryIO, Union

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import InvalidInputError

AudioSource = Union[str, os.PathLike, bytes, bytearray, memoryview, BinaryIO]

#: Sample rates outside this closed range (Hz) are refused as absurd by :func:`load_audio`.
MIN_SAMPLE_RATE = 1000
MAX_SAMPLE_RATE = 768_000

#: Upstream ``load_wav`` refuses to resample audio recorded below this rate (Hz).
PROMPT_MIN_SAMPLE_RATE = 16000

#: torchaudio ``transforms.Resample`` defaults.
LOWPASS_FILTER_WIDTH = 6
ROLLOFF = 0.99

#: Above this many kernel elements (phases x taps) :func:`resample` switches to the
#: tap-by-tap evaluation (same result, memory proportional to the output).
MAX_POLYPHASE_KERNEL_ELEMENTS = 1 << 22

DEFAULT_FIELD = "prompt_wav"


# --------------------------------------------------------------------------------------
# decoding
# --------------------------------------------------------------------------------------


def _describe(src) -> str:
    if isinstance(src, (str, os.PathLike)):
        return f"'{os.fspath(src)}'"
    if isinstance(src, (bytes, bytearray, memoryview)):
        return f"audio bytes ({len(src)} bytes)"
    return "audio stream"


def _open_source(src: AudioSource, field: str):
    """Return something ``soundfile.SoundFile`` can open, or raise InvalidInputError."""
    if isinstance(src, (str, os.PathLike)):
        path = Path(src)
        if not path.exists():
            raise InvalidInputError(f"audio file not found: '{path}'", field=field)
        if not path.is_file():
            raise InvalidInputError(f"audio path is not a regular file: '{path}'", field=field)
        return str(path)
    if isinstance(src, (bytes, bytearray, memoryview)):
        data = bytes(src)
        if len(data) == 0:
            raise InvalidInputError("audio data is empty (0 bytes)", field=field)
        return io.BytesIO(data)
    if hasattr(src, "read"):
        seekable = getattr(src, "seekable", None)
        if callable(seekable) and seekable():
            return src
        try:
            data = src.read()
        except (OSError, ValueError) as exc:
            raise InvalidInputError(f"cannot read audio stream: {exc}", field=field) from None
        if not isinstance(data, (bytes, bytearray)) or len(data) == 0:
            raise InvalidInputError("audio stream is empty or not binary", field=field)
        return io.BytesIO(bytes(data))
    raise InvalidInputError(
        f"unsupported audio source of type {type(src).__name__}; expected a path, bytes or a binary stream",
        field=field,
    )


def load_audio(
    src: AudioSource,
    *,
    max_seconds: float | None = None,
    field: str = DEFAULT_FIELD,
) -> tuple[torch.Tensor, int]:
    """Decode an audio file like torchaudio's soundfile backend (``normalize=True``).

    Args:
        src: a filesystem path, the encoded file as bytes, or a binary file-like object.
            Any container/codec libsndfile reads (WAV, FLAC, OGG/Vorbis, ... ) works.
        max_seconds: if given, refuse audio longer than this many seconds *before*
            decoding it (protects servers from huge uploads).
        field: request field named in errors.

    Returns:
        ``(wav, sample_rate)``: ``wav`` float32 ``[C, N]`` (channels first), integer PCM
        scaled to [-1, 1) (16-bit divided by 32768), float files as stored; ``sample_rate``
        in Hz.

    Raises:
        InvalidInputError: file missing or not a file, bytes/stream not decodable,
            zero channels, zero samples, sample rate outside
            [``MIN_SAMPLE_RATE``, ``MAX_SAMPLE_RATE``], NaN/inf samples, or longer than
            ``max_seconds``.
    """
    what = _describe(src)
    handle = _open_source(src, field)
    try:
        import soundfile as sf

        with sf.SoundFile(handle, "r") as f:
            sr = int(f.samplerate)
            channels = int(f.channels)
            frames = int(f.frames)
            if channels <= 0:
                raise InvalidInputError(f"{what} has no audio channels", field=field)
            if not (MIN_SAMPLE_RATE <= sr <= MAX_SAMPLE_RATE):
                raise InvalidInputError(
                    f"{what} has an unsupported sample rate of {sr} Hz "
                    f"(accepted: {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz)",
                    field=field,
                )
            if max_seconds is not None and frames > 0 and frames / sr > max_seconds:
                raise InvalidInputError(
                    f"{what} is {frames / sr:.2f} s long; at most {max_seconds:g} s is accepted", field=field
                )
            data = f.read(dtype="float32", always_2d=True)
    except InvalidInputError:
        raise
    except (RuntimeError, ValueError, TypeError, OSError, EOFError) as exc:
        # soundfile.LibsndfileError / SoundFileError derive from RuntimeError.
        msg = str(exc).split(": ", 1)[-1] if str(exc) else type(exc).__name__
        raise InvalidInputError(f"cannot decode {what} as audio: {msg}", field=field) from None
    if data.shape[0] == 0:
        raise InvalidInputError(f"{what} contains no audio samples (empty audio)", field=field)
    if not np.isfinite(data).all():
        raise InvalidInputError(f"{what} contains NaN or infinite samples", field=field)
    wav = torch.from_numpy(np.ascontiguousarray(data.T))
    return wav, sr


def check_waveform(wav: torch.Tensor, sample_rate: int, *, field: str = DEFAULT_FIELD) -> torch.Tensor:
    """Validate an in-memory waveform and return it as a floating ``[C, N]`` tensor.

    Accepts ``[N]`` (mono) or ``[C, N]``; integer tensors are refused (scale them first).

    Raises:
        InvalidInputError: wrong rank or dtype, zero channels or samples, NaN/inf
            samples, sample rate outside [``MIN_SAMPLE_RATE``, ``MAX_SAMPLE_RATE``].
    """
    if not isinstance(wav, torch.Tensor):
        if isinstance(wav, np.ndarray):
            wav = torch.from_numpy(np.ascontiguousarray(wav))
        else:
            raise InvalidInputError(f"waveform must be a tensor, got {type(wav).__name__}", field=field)
    if not wav.is_floating_point():
        raise InvalidInputError(f"waveform must hold float samples in [-1, 1], got {wav.dtype}", field=field)
    if wav.dim() == 1:
        wav = wav.unsqueeze(0)
    if wav.dim() != 2:
        raise InvalidInputError(f"waveform must be [N] or [channels, N], got shape {tuple(wav.shape)}", field=field)
    if wav.shape[0] == 0:
        raise InvalidInputError("waveform has no channels", field=field)
    if wav.shape[1] == 0:
        raise InvalidInputError("waveform contains no samples (empty audio)", field=field)
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)) or not (
        MIN_SAMPLE_RATE <= int(sample_rate) <= MAX_SAMPLE_RATE
    ):
        raise InvalidInputError(
            f"unsupported sample rate {sample_rate!r} (accepted: integer {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz)",
            field=field,
        )
    if not torch.isfinite(wav).all():
        raise InvalidInputError("waveform contains NaN or infinite samples", field=field)
    return wav


def to_mono(wav: torch.Tensor) -> torch.Tensor:
    """Average the channels: ``[C, N]`` -> ``[1, N]`` (``[N]`` -> ``[1, N]``), same dtype/device.

    This is upstream's ``speech.mean(dim=0, keepdim=True)``.
    """
    if wav.dim() == 1:
        return wav.unsqueeze(0)
    if wav.dim() != 2:
        raise ValueError(f"to_mono expects [N] or [C, N], got shape {tuple(wav.shape)}")
    if wav.shape[0] == 1:
        return wav
    return wav.mean(dim=0, keepdim=True)


# --------------------------------------------------------------------------------------
# resampling (torchaudio.transforms.Resample, sinc_interp_hann)
# --------------------------------------------------------------------------------------


def _reduced(orig_sr: int, new_sr: int) -> tuple[int, int]:
    g = math.gcd(orig_sr, new_sr)
    return orig_sr // g, new_sr // g


def _kernel_width(orig: int, new: int, lowpass_filter_width: int, rolloff: float) -> tuple[float, int]:
    base_freq = min(orig, new) * rolloff
    width = math.ceil(lowpass_filter_width * orig / base_freq)
    return base_freq, width


def _sinc_hann(t: torch.Tensor, base_freq: float, orig: int, lowpass_filter_width: int) -> torch.Tensor:
    """Windowed-sinc weights at offsets ``t`` (input-sample units / orig), float64 in/out.

    h(t) = sinc(pi * b t) * cos^2(pi * b t / (2 w)) * b / orig with b t clamped to [-w, w],
    b = base_freq (reduced units), w = lowpass_filter_width (torchaudio sinc_interp_hann).
    """
    t = (t * base_freq).clamp(-lowpass_filter_width, lowpass_filter_width)
    window = torch.cos(t * (math.pi / lowpass_filter_width / 2)) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / t)
    return sinc * window * (base_freq / orig)


def _phase_offset(phase: torch.Tensor, new: int) -> torch.Tensor:
    """``phase / new`` rounded to float32 exactly as torchaudio's CPU division does, as float64.

    torchaudio divides in the default dtype (float32); that rounding shifts the taps of
    large-``orig`` kernels measurably (~1e-3 of a weight for 44101:16000), so it is kept.
    The quotient is formed in float64 and rounded once to float32, which equals the
    correctly rounded float32 division on every device (CUDA divides by a scalar through
    its reciprocal, which would not).
    """
    return (phase.to(torch.float64) / new).to(torch.float32).to(torch.float64)


@functools.lru_cache(maxsize=32)
def _polyphase_kernel_cpu(orig: int, new: int, lowpass_filter_width: int, rolloff: float) -> tuple[torch.Tensor, int]:
    """The ``[new, 1, 2*width + orig]`` float32 kernel for a gcd-reduced rate pair (CPU)."""
    base_freq, width = _kernel_width(orig, new, lowpass_filter_width, rolloff)
    idx = torch.arange(-width, width + orig, dtype=torch.float64)[None, None] / orig
    # torchaudio computes the per-phase offsets -p/new in the default dtype (float32)
    # before adding the float64 tap positions; keep that rounding for bit-level parity.
    phase = -_phase_offset(torch.arange(new), new)[:, None, None]
    kernel = _sinc_hann(phase + idx, base_freq, orig, lowpass_filter_width)
    return kernel.to(torch.float32), width


_DEVICE_KERNELS: dict = {}


def _polyphase_kernel(orig, new, lowpass_filter_width, rolloff, device, dtype):
    kernel, width = _polyphase_kernel_cpu(orig, new, lowpass_filter_width, rolloff)
    if device.type == "cpu" and dtype == torch.float32:
        return kernel, width
    key = (orig, new, lowpass_filter_width, rolloff, str(device), dtype)
    k = _DEVICE_KERNELS.get(key)
    if k is None:
        if len(_DEVICE_KERNELS) > 32:
            _DEVICE_KERNELS.clear()
        k = _DEVICE_KERNELS[key] = kernel.to(device=device, dtype=dtype)
    return k, width


def _target_length(orig: int, new: int, length: int) -> int:
    # torchaudio: torch.ceil(torch.as_tensor(new * length / orig)) -- the quotient passes
    # through the default dtype (float32) before the ceiling; reproduce that exactly.
    return int(math.ceil(float(np.float32(new * length / orig))))


def _resample_direct(
    x: torch.Tensor, orig: int, new: int, lowpass_filter_width: int, rolloff: float, chunk: int = 8192
) -> torch.Tensor:
    """Same filter as the polyphase path, evaluated only on the taps inside its support.

    Output sample n sits at input position n * orig / new; it uses the input samples m
    with |m/orig - n/new| * base_freq < lowpass_filter_width (outside, torchaudio's weight is
    the window's clamped edge, < 1e-30). ``x`` is ``[B, L]``; returns ``[B, target]``.
    """
    base_freq, width = _kernel_width(orig, new, lowpass_filter_width, rolloff)
    num, length = x.shape
    target = _target_length(orig, new, length)
    taps = 2 * width + 2
    xp = F.pad(x, (width + 1, width + 2 + orig))  # input index m lives at m + width + 1
    out = x.new_empty((num, target))
    for start in range(0, target, chunk):
        n = torch.arange(start, min(start + chunk, target), dtype=torch.int64, device=x.device)
        block, phase = n // new, n % new
        first = block * orig + (phase * orig) // new - width  # first input index of the support
        m = first[:, None] + torch.arange(taps, device=x.device)[None, :]  # [n, taps]
        # offset (m - block*orig)/orig - phase/new, with the phase term rounded like torchaudio's
        t = (m - block[:, None] * orig).to(torch.float64) / orig - _phase_offset(phase, new)[:, None]
        w = _sinc_hann(t, base_freq, orig, lowpass_filter_width).to(x.dtype)
        gathered = xp[:, (m + width + 1).reshape(-1)].reshape(num, m.shape[0], taps)
        out[:, start : start + m.shape[0]] = (gathered * w[None]).sum(-1)
    return out


def resample(
    wav: torch.Tensor,
    orig_sr: int,
    new_sr: int,
    *,
    lowpass_filter_width: int = LOWPASS_FILTER_WIDTH,
    rolloff: float = ROLLOFF,
) -> torch.Tensor:
    """Band-limited resampling, identical to ``torchaudio.transforms.Resample(orig_sr, new_sr)``.

    Args:
        wav: floating tensor ``[..., N]`` (any leading dims; e.g. ``[C, N]``) on any device.
        orig_sr, new_sr: integer sample rates in Hz (> 0).
        lowpass_filter_width, rolloff: windowed-sinc parameters (torchaudio defaults).

    Returns:
        ``[..., ceil(new_sr * N / orig_sr)]`` in the input's dtype and device; ``wav``
        itself when the rates are equal (as torchaudio).

    Algorithm (torchaudio ``_get_sinc_resample_kernel`` / ``_apply_sinc_resample_kernel``):
    reduce the rates by their gcd to ``orig:new``; cutoff ``base = min(orig, new) * rolloff``;
    ``width = ceil(lowpass_filter_width * orig / base)``; phase ``p`` of ``new`` uses taps
    ``h((k - width)/orig - p/new)`` for ``k in [0, 2 width + orig)`` with
    ``h`` = Hann-windowed sinc (see :func:`_sinc_hann`); the input is zero-padded by
    ``(width, width + orig)`` and convolved with stride ``orig``; the interleaved phases are
    cut to ``ceil(new * N / orig)`` samples.

    Raises:
        ValueError: non-integer or non-positive rates, non-floating input.
    """
    if not wav.is_floating_point():
        raise ValueError(f"resample expects a floating waveform, got {wav.dtype}")
    if int(orig_sr) != orig_sr or int(new_sr) != new_sr or orig_sr <= 0 or new_sr <= 0:
        raise ValueError(f"sample rates must be positive integers, got {orig_sr} -> {new_sr}")
    orig_sr, new_sr = int(orig_sr), int(new_sr)
    if orig_sr == new_sr:
        return wav
    orig, new = _reduced(orig_sr, new_sr)
    shape = wav.shape
    x = wav.reshape(-1, shape[-1])
    _, width = _kernel_width(orig, new, lowpass_filter_width, rolloff)
    if new * (2 * width + orig) > MAX_POLYPHASE_KERNEL_ELEMENTS:
        y = _resample_direct(x, orig, new, lowpass_filter_width, rolloff)
    else:
        # On CUDA, cuDNN may run float32 convolutions in TF32 (torch's default), which costs
        # ~2e-4 relative error; the convolution is tiny, so it runs in float64 there.
        work = torch.float64 if (x.device.type != "cpu" and x.dtype == torch.float32) else x.dtype
        kernel, width = _polyphase_kernel(orig, new, lowpass_filter_width, float(rolloff), x.device, work)
        length = x.shape[-1]
        xp = F.pad(x.to(work), (width, width + orig))
        y = F.conv1d(xp[:, None], kernel, stride=orig)  # [B, new, blocks]
        y = y.transpose(1, 2).reshape(x.shape[0], -1)[..., : _target_length(orig, new, length)].to(x.dtype)
    return y.reshape(shape[:-1] + y.shape[-1:])


def load_prompt_wav(
    src: AudioSource,
    target_sr: int,
    *,
    min_sr: int = PROMPT_MIN_SAMPLE_RATE,
    max_seconds: float | None = None,
    field: str = DEFAULT_FIELD,
) -> torch.Tensor:
    """Upstream ``load_wav``: decode, average to mono, resample to ``target_sr``.

    Returns float32 ``[1, N']`` at ``target_sr`` Hz (``N' = ceil(target_sr * N / sr)``).

    Raises:
        InvalidInputError: anything :func:`load_audio` refuses, or a file whose rate
            differs from ``target_sr`` and is below ``min_sr`` Hz (upstream asserts
            ``sample_rate >= 16000`` before resampling).
    """
    wav, sr = load_audio(src, max_seconds=max_seconds, field=field)
    wav = to_mono(wav)
    if sr != target_sr:
        if sr < min_sr:
            raise InvalidInputError(
                f"audio sample rate {sr} Hz is too low; at least {min_sr} Hz is required", field=field
            )
        wav = resample(wav, sr, target_sr)
    return wav

"""Acoustic features of a prompt, in plain torch (no librosa / whisper / torchaudio).

Three feature extractors feed CosyVoice2's three consumers:

=========================  ==========================  =====================================
extractor                  consumer                    definition reproduced
=========================  ==========================  =====================================
:class:`PromptMelExtractor` flow (prompt_feat), HiFT    ``matcha.utils.audio.mel_spectrogram``
:func:`whisper_log_mel`    ``speech_tokenizer_v2.onnx`` ``whisper.log_mel_spectrogram(n_mels=128)``
:func:`kaldi_fbank` /      ``campplus.onnx`` (CAM++)    ``torchaudio.compliance.kaldi.fbank``
:func:`speaker_fbank`                                   (defaults, 80 bins, dither 0) minus mean
=========================  ==========================  =====================================

The prompt mel's parameters come from the model's yaml (:class:`~cosyserve.models.config.MelConfig`);
the two 16 kHz front ends are fixed properties of the ONNX models and are collected in
:data:`SPEECH_TOKENIZER_MEL` and :data:`SPEAKER_FBANK` below (the only place they are set).

Filter matrices are computed from their published formulas on first use and cached per
(parameters, device, dtype):

* :func:`slaney_mel_filters` is ``librosa.filters.mel(htk=False, norm="slaney")``: Slaney
  mel scale (linear below 1 kHz at 200/3 Hz per mel, logarithmic above with step
  ln(6.4)/27), ``n_mels + 2`` band edges evenly spaced in mel between ``fmin`` and
  ``fmax``, triangles over the FFT bin frequencies ``k * sr / n_fft``, each scaled by
  ``2 / (f[i+2] - f[i])`` (equal area). Arithmetic follows librosa (float64 triangles
  stored to float32, then scaled), so the matrices equal librosa's to ~1 ulp. Whisper's
  ``mel_filters.npz['mel_128']`` asset is this function at (16000, 400, 128, 0, 8000).
* :func:`kaldi_mel_banks` is ``torchaudio.compliance.kaldi.get_mel_banks`` without VTLN:
  Kaldi mel scale ``1127 ln(1 + f/700)``, triangles evaluated at the FFT bin centres in
  float32 (as torchaudio does), no area normalisation, a zero column for the Nyquist bin.

All extractors accept a batch ``[B, N]`` (or a single ``[N]``), keep the input's device
and floating dtype (float32 gives the reference numerics; on CPU the outputs are
bit-identical to the reference), and on CUDA compute the filter-bank products in float64
so that a process-wide TF32 setting cannot degrade them (CUDA vs CPU ~1e-7..1e-6). They raise
:class:`~cosyserve.errors.InvalidInputError` when the audio is too short for one frame.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import InvalidInputError
from ..models.config import MelConfig

# --------------------------------------------------------------------------------------
# Fixed front ends of the two ONNX models (16 kHz input)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WhisperMelSpec:
    """``whisper.log_mel_spectrogram``: input of the S3 speech tokenizer (100 frames/s)."""

    sample_rate: int = 16000  # Hz
    n_fft: int = 400  # samples (25 ms), periodic Hann window of the same length
    hop_length: int = 160  # samples (10 ms)
    n_mels: int = 128
    log_floor: float = 1e-10  # clamp before log10
    dynamic_range: float = 8.0  # log10 units below the maximum kept (80 dB)

    @property
    def frame_rate(self) -> float:
        return self.sample_rate / self.hop_length


@dataclass(frozen=True)
class KaldiFbankSpec:
    """``torchaudio.compliance.kaldi.fbank`` defaults as CosyVoice calls it for CAM++."""

    sample_rate: int = 16000  # Hz
    frame_length_ms: float = 25.0
    frame_shift_ms: float = 10.0
    num_mel_bins: int = 80
    low_freq: float = 20.0  # Hz
    high_freq: float = 0.0  # Hz; <= 0 means offset from Nyquist
    preemphasis: float = 0.97
    povey_power: float = 0.85  # povey window = symmetric Hann ** 0.85
    remove_dc_offset: bool = True
    round_to_power_of_two: bool = True

    @property
    def window_size(self) -> int:
        return int(self.sample_rate * self.frame_length_ms * 0.001)

    @property
    def window_shift(self) -> int:
        return int(self.sample_rate * self.frame_shift_ms * 0.001)

    @property
    def padded_window_size(self) -> int:
        w = self.window_size
        return 1 << (w - 1).bit_length() if self.round_to_power_of_two else w


#: The speech tokenizer's front end (speech_tokenizer_v2.onnx expects exactly this).
SPEECH_TOKENIZER_MEL = WhisperMelSpec()
#: The speaker model's front end (campplus.onnx expects exactly this).
SPEAKER_FBANK = KaldiFbankSpec()

#: Kaldi's log floor: ``std::numeric_limits<float>::epsilon()``.
FLOAT_EPS = float(torch.finfo(torch.float32).eps)


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def _as_batch(wav: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(wav, torch.Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, got {type(wav).__name__}")
    if wav.dim() == 1:
        wav = wav.unsqueeze(0)
    if wav.dim() != 2:
        raise ValueError(f"{what} expects a waveform [N] or [B, N], got shape {tuple(wav.shape)}")
    if not wav.is_floating_point():
        raise ValueError(f"{what} expects float samples, got {wav.dtype}")
    return wav


def _too_short(what: str, n: int, need: int, sr: int) -> InvalidInputError:
    return InvalidInputError(
        f"audio too short for {what}: {n} samples ({n / sr * 1000:.1f} ms at {sr} Hz); "
        f"at least {need} samples needed",
        field="prompt_wav",
    )


def _filter_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for the filter-bank products, immune to TF32 on accelerators.

    On CPU this is a plain float32 matmul (bit-identical to the reference). On CUDA a
    float32 matmul may run in TF32 when the process enables it
    (``torch.set_float32_matmul_precision("high")``, common in model code), costing
    ~1e-3 relative error; these products are small, so they run in float64 there.
    """
    if a.device.type != "cpu" and a.dtype == torch.float32:
        return torch.matmul(a.double(), b.double()).float()
    return torch.matmul(a, b)


_DEVICE_CACHE: dict = {}


def _on(key: tuple, make, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Cache ``make()`` (a CPU tensor) moved to ``device``/``dtype``."""
    full = key + (str(device), dtype)
    t = _DEVICE_CACHE.get(full)
    if t is None:
        if len(_DEVICE_CACHE) > 64:
            _DEVICE_CACHE.clear()
        t = _DEVICE_CACHE[full] = make().to(device=device, dtype=dtype)
    return t


# --------------------------------------------------------------------------------------
# filter banks
# --------------------------------------------------------------------------------------


# Slaney mel scale: linear below 1 kHz (200/3 Hz per mel), logarithmic above.
_SLANEY_F_SP = 200.0 / 3
_SLANEY_MIN_LOG_HZ = 1000.0
_SLANEY_MIN_LOG_MEL = _SLANEY_MIN_LOG_HZ / _SLANEY_F_SP
_SLANEY_LOGSTEP = np.log(6.4) / 27.0


def _hz_to_mel_slaney(f: np.ndarray) -> np.ndarray:
    f = np.asarray(f, dtype=np.float64)
    linear = f / _SLANEY_F_SP
    with np.errstate(divide="ignore", invalid="ignore"):
        log = _SLANEY_MIN_LOG_MEL + np.log(f / _SLANEY_MIN_LOG_HZ) / _SLANEY_LOGSTEP
    return np.where(f >= _SLANEY_MIN_LOG_HZ, log, linear)


def _mel_to_hz_slaney(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    linear = _SLANEY_F_SP * m
    log = _SLANEY_MIN_LOG_HZ * np.exp(_SLANEY_LOGSTEP * (m - _SLANEY_MIN_LOG_MEL))
    return np.where(m >= _SLANEY_MIN_LOG_MEL, log, linear)


@functools.lru_cache(maxsize=16)
def _slaney_mel_np(sr: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> np.ndarray:
    n_bins = n_fft // 2 + 1
    fft_freqs = np.arange(n_bins) * (1.0 / (n_fft * (1.0 / sr)))  # numpy rfftfreq arithmetic
    edges = _mel_to_hz_slaney(np.linspace(_hz_to_mel_slaney(fmin), _hz_to_mel_slaney(fmax), n_mels + 2))
    widths = np.diff(edges)
    ramps = edges[:, None] - fft_freqs[None, :]
    rising = -ramps[:-2] / widths[:-1, None]
    falling = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling)).astype(np.float32)
    area_norm = 2.0 / (edges[2:] - edges[:-2])
    weights = (weights * area_norm[:, None]).astype(np.float32)  # librosa scales the float32 array in place
    weights.setflags(write=False)
    return weights


def slaney_mel_filters(sr: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None) -> torch.Tensor:
    """Slaney-scale, Slaney-normalised mel filter bank (``librosa.filters.mel`` defaults).

    Args:
        sr: sample rate in Hz; n_fft: FFT size in samples; n_mels: number of filters;
        fmin, fmax: band edges in Hz (``fmax=None`` means ``sr / 2``).

    Returns:
        float32 ``[n_mels, n_fft // 2 + 1]`` (a fresh CPU tensor): weight of FFT bin k
        (frequency ``k * sr / n_fft`` Hz) in filter i; ``mel = filters @ |STFT|``.
    """
    if fmax is None:
        fmax = sr / 2.0
    if not (n_fft > 0 and n_mels > 0 and sr > 0 and 0.0 <= fmin < fmax):
        raise ValueError(f"bad mel filter parameters sr={sr} n_fft={n_fft} n_mels={n_mels} fmin={fmin} fmax={fmax}")
    return torch.from_numpy(_slaney_mel_np(int(sr), int(n_fft), int(n_mels), float(fmin), float(fmax)).copy())


def _kaldi_mel_scale(f):
    if isinstance(f, torch.Tensor):
        return 1127.0 * (1.0 + f / 700.0).log()
    return 1127.0 * math.log(1.0 + f / 700.0)


@functools.lru_cache(maxsize=8)
def _kaldi_mel_banks_cpu(num_bins: int, padded_window_size: int, sample_rate: float, low_freq: float,
                         high_freq: float) -> torch.Tensor:
    nyquist = 0.5 * sample_rate
    if high_freq <= 0.0:
        high_freq += nyquist
    if not (num_bins > 3 and padded_window_size % 2 == 0 and 0.0 <= low_freq < high_freq <= nyquist):
        raise ValueError(f"bad Kaldi mel bank options: bins={num_bins} low={low_freq} high={high_freq} nyq={nyquist}")
    fft_bin_width = sample_rate / padded_window_size
    mel_low = _kaldi_mel_scale(low_freq)
    mel_high = _kaldi_mel_scale(high_freq)
    delta = (mel_high - mel_low) / (num_bins + 1)
    # float32 arithmetic throughout, in torchaudio's order of operations
    i = torch.arange(num_bins).unsqueeze(1)
    left = mel_low + i * delta
    center = mel_low + (i + 1.0) * delta
    right = mel_low + (i + 2.0) * delta
    mel = _kaldi_mel_scale(fft_bin_width * torch.arange(padded_window_size / 2)).unsqueeze(0)
    up = (mel - left) / (center - left)
    down = (right - mel) / (right - center)
    banks = torch.max(torch.zeros(1), torch.min(up, down))
    return F.pad(banks, (0, 1)).to(torch.float32)  # Nyquist bin gets weight 0


def kaldi_mel_banks(spec: KaldiFbankSpec = SPEAKER_FBANK) -> torch.Tensor:
    """Kaldi triangular mel banks, float32 ``[num_mel_bins, padded_window_size // 2 + 1]``.

    ``torchaudio.compliance.kaldi.get_mel_banks`` (no VTLN warp) with a zero column
    appended for the Nyquist bin, as ``kaldi.fbank`` pads it. Weights apply to the power
    spectrum of a ``padded_window_size``-point FFT at ``spec.sample_rate`` Hz.
    """
    return _kaldi_mel_banks_cpu(spec.num_mel_bins, spec.padded_window_size, float(spec.sample_rate),
                                float(spec.low_freq), float(spec.high_freq)).clone()


# --------------------------------------------------------------------------------------
# prompt mel (flow / HiFT), 24 kHz, parameters from the yaml
# --------------------------------------------------------------------------------------


class PromptMelExtractor:
    """``matcha.utils.audio.mel_spectrogram`` with the yaml's ``feat_extractor`` arguments.

    For CosyVoice2 (``cfg``: n_fft 1920, hop 480, win 1920, 80 mels, fmin 0, fmax 8000,
    center False, 24 kHz) it yields 50 frames/s and ``N / 480`` frames for ``N`` samples
    (``N`` a multiple of 480).

    Steps: reflect-pad ``(n_fft - hop) // 2`` samples on both sides; ``torch.stft`` with a
    periodic Hann window of ``win_size`` (``center=cfg.center``, one-sided, unnormalised);
    magnitude ``sqrt(re^2 + im^2 + 1e-9)``; Slaney mel filters (:func:`slaney_mel_filters`);
    natural log of ``clamp(mel, 1e-5)``.

    Call with float ``[B, N]`` (or ``[N]``) at ``cfg.sampling_rate`` Hz on any device;
    returns ``[B, T, num_mels]`` (frames first, as CosyVoice's ``speech_feat``) in the
    input's dtype/device.
    """

    MAG_EPS = 1e-9
    LOG_CLAMP = 1e-5

    def __init__(self, cfg: MelConfig):
        self.cfg = cfg
        self.pad = int((cfg.n_fft - cfg.hop_size) / 2)

    @property
    def sample_rate(self) -> int:
        return self.cfg.sampling_rate

    @property
    def frame_rate(self) -> float:
        """Frames per second."""
        return self.cfg.sampling_rate / self.cfg.hop_size

    def filters(self, device=None, dtype=torch.float32) -> torch.Tensor:
        c = self.cfg
        return _on(
            ("slaney", c.sampling_rate, c.n_fft, c.num_mels, c.fmin, c.fmax),
            lambda: slaney_mel_filters(c.sampling_rate, c.n_fft, c.num_mels, c.fmin, c.fmax),
            torch.device(device or "cpu"),
            dtype,
        )

    def __call__(self, wav: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        y = _as_batch(wav, "PromptMelExtractor")
        need = max(self.pad + 1, c.n_fft - 2 * self.pad)
        if y.shape[-1] < need:
            raise _too_short("the prompt mel spectrogram", y.shape[-1], need, c.sampling_rate)
        window = _on(("hann", c.win_size), lambda: torch.hann_window(c.win_size), y.device, y.dtype)
        y = F.pad(y.unsqueeze(1), (self.pad, self.pad), mode="reflect").squeeze(1)
        spec = torch.stft(y, c.n_fft, hop_length=c.hop_size, win_length=c.win_size, window=window,
                          center=c.center, pad_mode="reflect", normalized=False, onesided=True,
                          return_complex=True)
        spec = torch.view_as_real(spec)
        mag = torch.sqrt(spec.pow(2).sum(-1) + self.MAG_EPS)  # [B, F, T]
        mel = _filter_product(self.filters(y.device, y.dtype), mag)  # [B, n_mels, T]
        return torch.log(torch.clamp(mel, min=self.LOG_CLAMP)).transpose(1, 2)


# --------------------------------------------------------------------------------------
# whisper log-mel (speech tokenizer), 16 kHz
# --------------------------------------------------------------------------------------


def whisper_log_mel(wav16k: torch.Tensor, n_mels: int = SPEECH_TOKENIZER_MEL.n_mels,
                    spec: WhisperMelSpec = SPEECH_TOKENIZER_MEL) -> torch.Tensor:
    """``whisper.log_mel_spectrogram(wav16k, n_mels)``: input of the S3 speech tokenizer.

    Args:
        wav16k: float ``[B, N]`` or ``[N]`` at 16 kHz, any device.
        n_mels: 128 for ``speech_tokenizer_v2`` (80 for older whisper-style models).

    Returns:
        ``[B, n_mels, N // 160]`` (100 frames/s): STFT (n_fft 400, hop 160, periodic Hann,
        ``center=True`` with reflect padding) with the last frame dropped; power
        ``|X|^2``; Slaney mel filters (librosa ``filters.mel(16000, 400, n_mels)``);
        ``log10(clamp(., 1e-10))``; floored at ``max - 8``; then ``(x + 4) / 4``.

    The ``max`` of the floor is taken per utterance (whisper takes it over the whole
    tensor; identical for ``B = 1``, which is how CosyVoice calls it).
    """
    x = _as_batch(wav16k, "whisper_log_mel")
    if x.shape[-1] <= spec.n_fft // 2:
        raise _too_short("the speech tokenizer's log-mel", x.shape[-1], spec.n_fft // 2 + 1, spec.sample_rate)
    window = _on(("hann", spec.n_fft), lambda: torch.hann_window(spec.n_fft), x.device, x.dtype)
    stft = torch.stft(x, spec.n_fft, spec.hop_length, window=window, return_complex=True)
    power = stft[..., :-1].abs() ** 2
    filters = _on(
        ("slaney", spec.sample_rate, spec.n_fft, n_mels, 0.0, spec.sample_rate / 2.0),
        lambda: slaney_mel_filters(spec.sample_rate, spec.n_fft, n_mels),
        x.device,
        x.dtype,
    )
    log_spec = torch.clamp(_filter_product(filters, power), min=spec.log_floor).log10()
    peak = log_spec.amax(dim=(-2, -1), keepdim=True)
    log_spec = torch.maximum(log_spec, peak - spec.dynamic_range)
    return (log_spec + 4.0) / 4.0


# --------------------------------------------------------------------------------------
# Kaldi fbank (speaker model), 16 kHz
# --------------------------------------------------------------------------------------


def _kaldi_fbank_batch(x: torch.Tensor, spec: KaldiFbankSpec) -> torch.Tensor:
    """``[B, N]`` -> ``[B, T, num_mel_bins]`` log mel energies (see :func:`kaldi_fbank`)."""
    size, shift, padded = spec.window_size, spec.window_shift, spec.padded_window_size
    if x.shape[-1] < size:
        raise _too_short("the speaker fbank", x.shape[-1], size, spec.sample_rate)
    frames = x.unfold(-1, size, shift)  # [B, T, size]; snip_edges: only whole frames
    if spec.remove_dc_offset:
        frames = frames - frames.mean(dim=-1, keepdim=True)
    if spec.preemphasis != 0.0:
        previous = torch.cat([frames[..., :1], frames[..., :-1]], dim=-1)  # x[max(0, j-1)]
        frames = frames - spec.preemphasis * previous
    window = _on(
        ("povey", size, spec.povey_power),
        lambda: torch.hann_window(size, periodic=False).pow(spec.povey_power),
        x.device,
        x.dtype,
    )
    frames = frames * window
    if padded != size:
        frames = F.pad(frames, (0, padded - size))
    power = torch.fft.rfft(frames).abs().pow(2.0)  # [B, T, padded // 2 + 1]
    banks = _on(
        ("kaldi", spec.num_mel_bins, padded, spec.sample_rate, spec.low_freq, spec.high_freq),
        lambda: kaldi_mel_banks(spec),
        x.device,
        x.dtype,
    )
    energies = _filter_product(power, banks.T)
    eps = torch.tensor(FLOAT_EPS, device=x.device, dtype=x.dtype)
    return torch.max(energies, eps).log()


def kaldi_fbank(wav16k: torch.Tensor, spec: KaldiFbankSpec = SPEAKER_FBANK) -> torch.Tensor:
    """``torchaudio.compliance.kaldi.fbank(wav16k, num_mel_bins=80, dither=0, sample_frequency=16000)``.

    Args:
        wav16k: one waveform, float ``[1, N]`` or ``[N]`` at 16 kHz, any device.

    Returns:
        ``[T, 80]`` natural-log mel energies, ``T = 1 + (N - 400) // 160`` (100 frames/s,
        ``snip_edges``). Per 25 ms frame: remove the DC offset, pre-emphasis 0.97
        (first sample against itself), povey window (symmetric Hann ** 0.85), zero-pad
        to 512, power spectrum ``|rfft|^2``, Kaldi mel banks (20 Hz .. 8 kHz,
        :func:`kaldi_mel_banks`), ``log(max(., float32 eps))``.

    Raises:
        ValueError: more than one waveform (use :func:`speaker_fbank` for batches).
        InvalidInputError: fewer than 400 samples.
    """
    x = _as_batch(wav16k, "kaldi_fbank")
    if x.shape[0] != 1:
        raise ValueError(f"kaldi_fbank takes one waveform [1, N]; got {tuple(x.shape)} (use speaker_fbank)")
    return _kaldi_fbank_batch(x, spec)[0]


def speaker_fbank(wav16k: torch.Tensor, spec: KaldiFbankSpec = SPEAKER_FBANK) -> torch.Tensor:
    """The CAM++ input: :func:`kaldi_fbank` minus its mean over time.

    ``[B, N]`` (or ``[N]``) 16 kHz float -> ``[B, T, 80]``; each utterance is normalised
    by its own time-mean (upstream: ``feat - feat.mean(dim=0, keepdim=True)``).
    """
    fb = _kaldi_fbank_batch(_as_batch(wav16k, "speaker_fbank"), spec)
    return fb - fb.mean(dim=1, keepdim=True)

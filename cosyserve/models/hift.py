"""HiFT vocoder of CosyVoice2: 80-bin natural-log mel (50 frames/s) -> 24 kHz waveform.

Algorithm
---------
HiFT is HiFTNet (Li et al., "HiFTNet: A Fast High-Quality Neural Vocoder with Harmonic-plus-Noise
Filter and Inverse Short Time Fourier Transform", https://arxiv.org/abs/2309.09493): a HiFi-GAN style
upsampling generator whose output layer predicts an iSTFT spectrum (iSTFTNet) and which is driven by a
neural-source-filter (NSF, Wang & Yamagishi, https://arxiv.org/abs/1904.12088; hn-NSF,
https://arxiv.org/abs/1908.10256) excitation:

1. **F0.** A five-layer Conv1d/ELU stack plus a linear head (upstream ``ConvRNNF0Predictor``) maps the
   mel ``[B, 80, T]`` to a fundamental frequency ``[B, T]`` in Hz (absolute value of the head output).
2. **Excitation** (upstream ``SourceModuleHnNSF`` with ``SineGen2``, non-causal, the 24 kHz variant).
   F0 is nearest-upsampled to the sample rate (``samples_per_frame`` = 480 samples per mel frame at
   24 kHz). For harmonics ``k = 1 .. H+1`` (H = ``nb_harmonics``) the per-sample phase increment
   ``(k*f0/sr) mod 1`` (cycles) is linearly resampled down to the frame rate, integrated by a cumulative
   sum over frames, scaled to radians and linearly resampled back up (times ``samples_per_frame``),
   which yields smooth sine phases. Random initial phases are added to the first sample's increments
   of the overtones (because of the frame-rate resampling that sample never reaches the output,
   but the draw still happens). Sines (amplitude ``nsf_alpha``) are gated by the voiced flag
   ``f0 > nsf_voiced_threshold``; Gaussian noise of std ``nsf_sigma`` (voiced) or ``nsf_alpha/3``
   (unvoiced) is added; a ``Linear(H+1, 1)`` + ``tanh`` merges the harmonics into one excitation
   channel ``[B, 1, T*samples_per_frame]``.
3. **Filter / decoder.** ``conv_pre`` (k=7) then, per upsampling stage, LeakyReLU, a transposed conv,
   fusion with the downsampled STFT of the excitation (n_fft 16, hop 4, periodic Hann, centred with
   reflect padding) through a strided conv + Snake ResBlock, and the average of the multi-receptive-
   field Snake ResBlocks. A final LeakyReLU (torch's default slope 0.01, not ``lrelu_slope`` — as
   upstream), ``conv_post`` to ``n_fft + 2`` channels: ``exp`` of the first ``n_fft/2+1`` is the
   magnitude (clipped at 100), ``sin`` of the rest is the phase; an inverse STFT (n_fft 16, hop 4)
   gives ``T*samples_per_frame`` samples, clamped to ``±audio_limit``.

CosyVoice3 (:class:`CausalHiFTGenerator`, :func:`parse_causal_hift`): the same family with causal
convolutions (left zero padding; ``conv_pre`` and the F0 predictor's first convolution read right
context), nearest-upsampling convolutions instead of transposed ones, the excitation phase
upsampled with "nearest", the F0 predictor in float64 and the excitation noise fixed at
construction (:class:`CausalSourceNoise`); upstream ``CausalHiFTGenerator`` and
``CausalConvRNNF0Predictor`` (``cosyvoice/hifigan/f0_predictor.py``), ``CausalConv1d*`` in
``cosyvoice/transformer/convolution.py``. Its streaming re-runs it over the whole accumulated mel
(:mod:`cosyserve.engine.token2wav_cv3`); the CosyVoice2 stream cache below does not apply.

Upstream reference: ``cosyvoice/hifigan/generator.py`` (``HiFTGenerator``, ``ResBlock``,
``SineGen2``, ``SourceModuleHnNSF``), ``cosyvoice/hifigan/f0_predictor.py``,
``cosyvoice/transformer/activation.py`` (``Snake``) and the streaming glue of
``cosyvoice/cli/model.py`` (``CosyVoice2Model.token2wav``), FunAudioLLM/CosyVoice commit ace7c47.
This file is an independent implementation; module and parameter names follow upstream only so that
``state_dict()`` keys are exactly those of the official ``hift.pt``.

Numerical parity
----------------
The single-item path (:meth:`HiFTGenerator.predict_f0`, :meth:`~HiFTGenerator.excitation`,
:meth:`~HiFTGenerator.decode`, :meth:`~HiFTGenerator.inference`) performs the same floating-point
operations in the same order and memory layouts as upstream, so on the same platform it reproduces
upstream bit for bit, including the random excitation when given a generator seeded like upstream's
global generator: the random draws are, in order, ``rand(B, H+1)`` (initial phases, column 0 zeroed),
``normal_`` on a ``[B, H+1, N]`` tensor viewed as ``[B, N, H+1]`` (exactly what upstream's
``randn_like(sine_waves)`` does: that tensor is a transposed view, and torch's CPU ``normal_`` yields
different numbers for a non-contiguous layout than ``randn(B, N, H+1)``), and a ``[B, N, 1]``
standard-normal draw that upstream makes for its (unused) noise branch and discards. Draws are always
made in float32 (as upstream) whatever the model dtype, so the generator state advances identically.

The inverse STFT is computed without ``torch.istft`` (whose window-envelope check does a host
synchronisation) as irfft -> window -> overlap-add (``aten.unfold_backward``) -> divide by the
overlap-added squared window, which is the same sequence of kernels ``torch.istft`` runs and gives
identical bits. STFT and inverse STFT run in at least float32 (FFTs have no bfloat16 kernels), as does
the excitation phase; the rest of the network runs in the module's dtype, except the convolution
trunk of :meth:`~HiFTGenerator.decode`, which runs in :attr:`~HiFTGenerator.trunk_dtype`
(:meth:`~HiFTGenerator.set_trunk_dtype`, e.g. float16 on a GPU). Nothing in
:meth:`~HiFTGenerator.predict_f0` / :meth:`~HiFTGenerator.decode` synchronises with the host.

Observed (reference data: torch 2.13 CPU, one thread): F0, decode, the seeded inference and the
seeded stream are bit-exact with one torch thread; with more threads the convs sum in another order
(~3e-7 relative). The excitation is very sensitive to F0 rounding: its phase is the running sum of F0
over the utterance, so a 1e-7 relative F0 difference becomes a ~1e-3 relative difference of a 2 s
source (seen on an H200 with TF32 off; with PyTorch's default TF32 convolutions F0 differs by ~3e-5
and a seeded source by ~4e-2). Seeded excitation therefore only reproduces upstream on the same
platform; ``decode(mel, source)`` is well conditioned (~4e-7 on the H200 with TF32 off, ~3e-4 with
TF32 convolutions).

Batching
--------
:meth:`HiFTGenerator.inference_batch` runs items of different lengths in one padded pass and returns
what the single-item calls would return (to float rounding of differently blocked conv/GEMM kernels,
~3e-7 relative on the speech, <1e-7 on the excitation). F0 is computed item by item with the
single-item kernels (see :class:`HiFTGenerator` for why); everything else is one padded pass. Padding
cannot leak into valid samples: every conv input is zeroed beyond the item's end (upstream's zero
padding), the phase upsampling is clamped at the item's own last frame (upstream's interpolation
clamps at the end of the tensor), the source STFT reflect-pads at the item's own end, and the inverse
STFT's overlap-add and window envelope only count the item's own frames. Each item draws its random
numbers from its own generator with the shapes of a single-item call (items in order).

Streaming
---------
:class:`HiFTStreamState` and :func:`hift_stream_step` reproduce the HiFT part of upstream
``CosyVoice2Model.token2wav``: the last ``mel_cache_len`` (8) mel frames of a chunk are prepended to the
next chunk, the last ``source_cache_len`` (8 * 480 = 3840) excitation samples replace the start of the
next chunk's excitation, the first ``source_cache_len`` output samples are cross-faded with the held
back tail of the previous chunk using ``numpy.hamming(2 * source_cache_len)`` (computed in float64,
the products and the sum in float64, the result rounded to the speech dtype, exactly as upstream's
``fade_in_out`` does when multiplying a float32 tensor by a float64 numpy window), and a non-final
chunk holds back its last ``source_cache_len`` samples.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from .config import HiFTConfig
from .derived import DerivedWeights
from .fused import FusedOp
from .transfer import to_device
from .views import cat_adjacent, merge_adjacent

__all__ = [
    "HiFTGenerator",
    "HiFTStreamState",
    "hift_stream_step",
    "hift_stream_step_batch",
    "stream_hift_input",
    "stream_hift_output",
    "fade_in_with_cache",
    "load_hift",
    "DEFAULT_MEL_CACHE_LEN",
    "CausalHiFTGenerator",
    "CausalHiFTCarry",
    "CausalSourceNoise",
    "parse_causal_hift",
]

#: Mel frames carried over between streaming chunks (upstream ``CosyVoice2Model.mel_cache_len``).
DEFAULT_MEL_CACHE_LEN = 8

_SNAKE_EPS = 1e-9  # upstream Snake.no_div_by_zero
_MAG_MAX = 1e2  # magnitude clip before the inverse STFT


# ----------------------------------------------------------------------------------------------
# small helpers
# ----------------------------------------------------------------------------------------------


def _zero_outside(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``x`` with time steps where ``mask`` ([B, 1, T] bool) is False set to 0; identity if mask is None."""
    if mask is None:
        return x
    return x.masked_fill(~mask, 0.0)


def _frame_major(x: torch.Tensor) -> torch.Tensor:
    """``x [B, C, T]`` with frame-major memory (``[B, T, C]`` contiguous, viewed as ``[B, C, T]``)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _time_mask(valid: torch.Tensor, size: int) -> torch.Tensor:
    """[B, 1, size] bool: ``t < valid[b]`` (``valid`` an int tensor [B], on the target device)."""
    return (torch.arange(size, device=valid.device)[None, :] < valid[:, None])[:, None, :]


def _int_tensor(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """int64 tensor of host ints on ``device`` (no host synchronisation on CUDA)."""
    return to_device(torch.tensor(list(values), dtype=torch.int64), device)


def _hann_periodic(n: int) -> np.ndarray:
    """Periodic Hann window of length n as float32, computed in float64 like ``scipy.signal.get_window``."""
    fac = np.linspace(-np.pi, np.pi, n + 1)
    w = np.zeros(n + 1)
    w += 0.5 * np.cos(0.0 * fac)
    w += 0.5 * np.cos(fac)
    return w[:n].astype(np.float32)


@functools.lru_cache(maxsize=8)
def _hamming_f64(n: int) -> np.ndarray:
    """``numpy.hamming(n)`` (float64), the streaming fade window; read-only."""
    w = np.hamming(n)
    w.setflags(write=False)
    return w


def _padding(kernel: int, dilation: int = 1) -> int:
    return (kernel * dilation - dilation) // 2


def _left_pad(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x [B, C, T]`` with ``n`` zeros prepended in time (identity for n == 0)."""
    return F.pad(x, (n, 0)) if n else x


# ----------------------------------------------------------------------------------------------
# building blocks
# ----------------------------------------------------------------------------------------------


class Snake(nn.Module):
    """Snake activation ``x + sin(alpha*x)^2 / (alpha + 1e-9)`` with one ``alpha`` per channel.

    Ziyin et al., https://arxiv.org/abs/2006.08195 (linear-scale alpha, as in BigVGAN/HiFT).
    Input/output ``[B, C, T]``, any floating dtype. Note ``Snake(0) == 0``.
    """

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x [B, C, T]`` -> Snake(x), zero where ``mask`` ([B, 1, T] bool, optional) is False.
        One fused kernel on CUDA (:mod:`cosyserve.models.fused`), the upstream op sequence elsewhere."""
        return _snake(x, self.alpha, mask)


def _snake_eager(x: torch.Tensor, alpha: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    a = alpha[None, :, None]
    return _zero_outside(x + (1.0 / (a + _SNAKE_EPS)) * torch.pow(torch.sin(x * a), 2), mask)


def _bias_snake_eager(x: torch.Tensor, bias: torch.Tensor, alpha: torch.Tensor,
                      mask: torch.Tensor | None) -> torch.Tensor:
    return _snake_eager(x + bias[None, :, None], alpha, mask)


def _bias_residual_eager(y: torch.Tensor, bias: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return y + bias[None, :, None] + x


_snake = FusedOp(_snake_eager, "snake")
#: ``Snake(x + bias)``: the bias of the convolution before it, one kernel with the activation
_bias_snake = FusedOp(_bias_snake_eager, "bias_snake")
#: ``y + bias + x``: a convolution's bias and the residual add after it, one kernel
_bias_residual = FusedOp(_bias_residual_eager, "bias_residual")


def _conv_without_bias(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """``conv(x)`` before its bias is added (cuDNN adds a bias as a kernel of its own, which
    the fused activation or residual add after the convolution absorbs instead)."""
    return F.conv1d(x, conv.weight, None, conv.stride, conv.padding, conv.dilation, conv.groups)


class _SnakeResBlock(nn.Module):
    """HiFi-GAN/BigVGAN residual block: per dilation d, ``x += conv_1(snake(conv_d(snake(x))))``.

    ``convs1[i]`` has dilation ``dilations[i]``, ``convs2[i]`` dilation 1; both keep the length
    ("same" zero padding) and are weight-normalised. ``mask`` ([B, 1, T] bool or None) zeroes every
    conv input beyond each item's end, so padded batches equal single-item runs.
    """

    def __init__(self, channels: int, kernel_size: int, dilations: Sequence[int], causal: bool = False):
        super().__init__()
        # causal (CosyVoice3): no padding inside the convs, ``(k - 1) * d`` zeros on the left instead
        # (upstream ``CausalConv1d(causal_type='left')``)
        self.causal = causal
        self.left1 = [(kernel_size - 1) * d if causal else 0 for d in dilations]
        self.left2 = [(kernel_size - 1) if causal else 0 for _ in dilations]
        self.convs1 = nn.ModuleList(
            weight_norm(nn.Conv1d(channels, channels, kernel_size, 1, dilation=d,
                                  padding=0 if causal else _padding(kernel_size, d)))
            for d in dilations
        )
        self.convs2 = nn.ModuleList(
            weight_norm(nn.Conv1d(channels, channels, kernel_size, 1, dilation=1,
                                  padding=0 if causal else _padding(kernel_size)))
            for _ in dilations
        )
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x [B, C, T]`` -> ``[B, C, T]``. Each convolution's bias is added by the fused op that
        follows it (``convs1``' by the second Snake, ``convs2``' by the residual add): the same
        sums as upstream's ``conv(x) + bias`` then Snake / ``+ x``, two kernels fewer per dilation."""
        for c1, c2, a1, a2, l1, l2 in zip(self.convs1, self.convs2, self.activations1, self.activations2,
                                          self.left1, self.left2):
            y = _bias_snake(_conv_without_bias(c1, _left_pad(a1(x, mask), l1)), c1.bias, a2.alpha, mask)
            x = _bias_residual(_conv_without_bias(c2, _left_pad(y, l2)), c2.bias, x)
        return x


class _F0Predictor(nn.Module):
    """Upstream ``ConvRNNF0Predictor``: 5 x (weight-normed Conv1d k=3 + ELU), then Linear; ``|.|``.

    ``[B, in_channels, T]`` log-mel -> ``[B, T]`` F0 in Hz (``num_class`` must be 1 for HiFT).
    """

    def __init__(self, in_channels: int, cond_channels: int, num_class: int):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            layers.append(weight_norm(nn.Conv1d(in_channels if i == 0 else cond_channels, cond_channels, 3, padding=1)))
            layers.append(nn.ELU())
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, num_class)

    def forward(self, mel: torch.Tensor, mask: torch.Tensor | None = None,
                weights: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
        """``weights`` (optional): (weight, bias) of each conv, then of the classifier, used instead of
        the module's own (:meth:`HiFTGenerator.predict_f0_batched` passes float64 copies)."""
        *convs, (wc, bc) = self.weights_as() if weights is None else weights
        x = mel
        for w, b in convs:  # the k=3 convs with padding 1 and ELU (alpha 1) of ``condnet``
            x = F.elu(F.conv1d(_zero_outside(x, mask), w, b, padding=w.shape[-1] // 2))
        return torch.abs(F.linear(x.transpose(1, 2), wc, bc).squeeze(-1))

    def weights_as(self, dtype: torch.dtype | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(weight, bias) of each conv (the weight-norm parametrization evaluated as the module does,
        in its own dtype), then of the classifier, cast to ``dtype`` (None: as they are): the
        ``weights`` of :meth:`forward`."""
        convs = [m for m in self.condnet if isinstance(m, nn.Conv1d)]
        pairs = [(m.weight, m.bias) for m in (*convs, self.classifier)]
        return pairs if dtype is None else [(w.detach().to(dtype), b.detach().to(dtype)) for w, b in pairs]


class _CausalConv1d(nn.Conv1d):
    """Length-preserving causal convolution (upstream ``CausalConv1d``, stride 1).

    ``right=False``: ``(k - 1) * dilation`` zeros are prepended (output ``t`` reads inputs ``<= t``).
    ``right=True``: the ``(k - 1) * dilation`` frames after the input are read instead — the given
    ``context`` ``[B, C, k - 1]`` (a non-final streaming chunk's look-ahead frames) or zeros.
    ``[B, C_in, T] -> [B, C_out, T]``.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1,
                 right: bool = False):
        super().__init__(in_channels, out_channels, kernel_size, 1, padding=0, dilation=dilation)
        self.pad_len = (kernel_size - 1) * dilation
        self.right = right

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        if self.right:
            if context is not None:
                if context.shape[-1] != self.pad_len:
                    raise ValueError(f"right context must have {self.pad_len} frames, got {context.shape[-1]}")
                x = torch.cat([x, context], dim=2)
            else:
                x = F.pad(x, (0, self.pad_len))
        else:
            x = _left_pad(x, self.pad_len)
        return super().forward(x)


class _CausalUpsampleConv(nn.Conv1d):
    """Nearest-neighbour upsampling by ``stride``, ``kernel - 1`` zeros on the left, conv
    (upstream ``CausalConv1dUpsample``): ``[B, C_in, T] -> [B, C_out, stride * T]``."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__(in_channels, out_channels, kernel_size, 1, padding=0)
        self.up_stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(x, scale_factor=float(self.up_stride), mode="nearest")
        return super().forward(_left_pad(x, self.kernel_size[0] - 1))


class _CausalDownsampleConv(nn.Conv1d):
    """``stride - 1`` zeros on the left, then a strided conv (upstream ``CausalConv1dDownSample``):
    ``[B, C_in, T] -> [B, C_out, floor((T + stride - 1 - kernel) / stride) + 1]``."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(_left_pad(x, self.stride[0] - 1))


class _CausalF0Predictor(nn.Module):
    """Upstream ``CausalConvRNNF0Predictor``: weight-normed causal convs (the first of kernel 4
    reading 3 frames of right context, then four of kernel 3 reading the past) each followed by
    ELU, then Linear; ``|.|``. ``[B, in_channels, T]`` log-mel -> ``[B, T]`` Hz
    (``finalize=True``: zeros as right context) or ``[B, T - 3]`` (``finalize=False``: the last
    3 frames are only right context). Runs in the dtype of its parameters (float64 in
    :class:`CausalHiFTGenerator`)."""

    def __init__(self, in_channels: int, cond_channels: int, num_class: int):
        super().__init__()
        layers: list[nn.Module] = [weight_norm(_CausalConv1d(in_channels, cond_channels, 4, right=True)), nn.ELU()]
        for _ in range(4):
            layers += [weight_norm(_CausalConv1d(cond_channels, cond_channels, 3)), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, num_class)

    @property
    def lookahead(self) -> int:
        """Right-context frames of the first convolution (3)."""
        return self.condnet[0].pad_len

    def forward(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        la = self.lookahead
        if finalize:
            x = self.condnet[0](mel)
        else:
            x = self.condnet[0](mel[:, :, :-la], mel[:, :, -la:])
        for layer in list(self.condnet)[1:]:
            x = layer(x)
        return torch.abs(self.classifier(x.transpose(1, 2)).squeeze(-1))


class _HarmonicSource(nn.Module):
    """Holds the harmonic-merge layer ``l_linear`` (upstream ``SourceModuleHnNSF``); no forward."""

    def __init__(self, n_harmonics_total: int):
        super().__init__()
        self.l_linear = nn.Linear(n_harmonics_total, 1)


# ----------------------------------------------------------------------------------------------
# the generator
# ----------------------------------------------------------------------------------------------


class HiFTGenerator(nn.Module):
    """HiFTNet generator (NSF excitation + iSTFTNet decoder) as used by CosyVoice2 at 24 kHz.

    Built from :class:`~cosyserve.models.config.HiFTConfig` (``load_config(yaml).hift``); every size
    comes from it. ``state_dict()`` keys, order and shapes equal the official ``hift.pt``
    (weight-normalised convs use ``torch.nn.utils.parametrizations.weight_norm``:
    ``<m>.parametrizations.weight.original0`` = g, ``original1`` = v). Load checkpoints with
    :func:`cosyserve.models.checkpoint.normalize_weight_norm_keys` (``strip_prefix="generator."``) and
    :func:`~cosyserve.models.checkpoint.load_strict`, then optionally :meth:`remove_weight_norm`.

    Units: mel frames at 50 frames/s (``sampling_rate / samples_per_frame``), F0 in Hz, waveforms at
    ``sampling_rate`` (24 kHz), ``samples_per_frame`` (480) samples per mel frame. Works for any
    floating dtype and device; the excitation phase is computed in at least float32.

    Batched inference (:meth:`inference_batch`) computes F0 item by item with exactly the
    single-item kernels, and everything else in one padded pass. Reason: the excitation phase is the
    running integral of F0 (about ``2*pi*f0*t`` radians), so a last-bit F0 difference (conv and GEMM
    kernels round differently for batch 1 and batch B; seen ~1e-7 relative on CPU) becomes a phase
    error growing linearly with time (~2e-5 relative on the source after 2 s, ~1e-3 after 10 s);
    with identical F0 the batched source and speech stay within ~1e-7 of single-item runs at any
    length. The F0 predictor is a small frame-rate network, but its per-item loop is host work: ~120
    operators per item, on an H100 server ~13 % of the scheduler thread's busy time streaming the DiT
    path (docs/perf.md "Session 27"). :attr:`batched_f0` (off by default) predicts the F0 of the whole
    batch in one masked float64 pass instead (:meth:`predict_f0_batched`): an item's F0 is then the
    same whatever its batch-mates (float64 rounding is far below float32's), but it is the float64
    F0, ~1e-7 from the float32 F0 of the per-item mode, so the two modes' speech differ by ~1e-4.

    Raises :class:`ValueError` from the public methods on inconsistent shapes.
    """

    def __init__(self, cfg: HiFTConfig):
        super().__init__()
        self.cfg = cfg
        self.samples_per_frame = cfg.samples_per_frame
        self.n_fft = cfg.istft_n_fft
        self.hop = cfg.istft_hop_len
        self.num_kernels = len(cfg.resblock_kernel_sizes)
        self.num_upsamples = len(cfg.upsample_rates)
        #: optional CUDA-graph replacement of :meth:`decode` for padded batches on CUDA
        #: (:class:`cosyserve.models.graphs.GraphedHiFTDecoder`), used by :meth:`inference_batch`
        self.graph_decode = None
        #: :meth:`inference_batch` predicts F0 in one padded float64 pass over the batch
        #: (:meth:`predict_f0_batched`, also for a batch of one) instead of item by item in float32:
        #: ~120 fewer host operators per item, and an item's F0 still does not depend on its
        #: batch-mates. Off on the model; the engine turns it on by default (``EngineConfig.hift_f0``,
        #: ``serve --hift-f0 per-item`` leaves it off; docs/perf.md "Session 28", "Session 30")
        self.batched_f0 = False
        self._derived = DerivedWeights()  # the F0 predictor's float64 weights (predict_f0_batched)
        #: experimental, off: :meth:`decode` lays its trunk inputs out frame-major (``[B, C, T]``
        #: views of ``[B, T, C]`` memory, the layout cuDNN's NHWC half-precision convolutions read);
        #: same values, but measured no faster: cuDNN still transposes (``benchmarks/hift_probe.py
        #: --frame-major``, docs/perf-history.md "Runs 33–36")
        self.frame_major = False
        n_src = self.n_fft + 2  # real + imaginary STFT bins of the excitation
        base = cfg.base_channels

        causal = cfg.causal
        self.m_source = _HarmonicSource(cfg.nb_harmonics + 1)
        if causal:
            self.conv_pre = weight_norm(_CausalConv1d(cfg.in_channels, base, cfg.conv_pre_look_right + 1, right=True))
        else:
            self.conv_pre = weight_norm(nn.Conv1d(cfg.in_channels, base, 7, 1, padding=3))

        self.ups = nn.ModuleList(
            weight_norm(_CausalUpsampleConv(base // 2**i, base // 2 ** (i + 1), k, u) if causal else
                        nn.ConvTranspose1d(base // 2**i, base // 2 ** (i + 1), k, u, padding=(k - u) // 2))
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes))
        )

        # Stage i fuses the excitation STFT (hop-rate frames) downsampled to that stage's rate:
        # stride = product of the upsample rates of the stages after i.
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        rates = list(cfg.upsample_rates)
        for i, (k, d) in enumerate(zip(cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilation_sizes)):
            ch = base // 2 ** (i + 1)
            stride = math.prod(rates[i + 1:])
            if stride == 1:
                self.source_downs.append(nn.Conv1d(n_src, ch, 1, 1))
            elif causal:
                self.source_downs.append(_CausalDownsampleConv(n_src, ch, stride * 2, stride))
            else:
                self.source_downs.append(nn.Conv1d(n_src, ch, stride * 2, stride, padding=stride // 2))
            self.source_resblocks.append(_SnakeResBlock(ch, k, d, causal=causal))

        self.resblocks = nn.ModuleList()
        for i in range(self.num_upsamples):
            ch = base // 2 ** (i + 1)
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes):
                self.resblocks.append(_SnakeResBlock(ch, k, d, causal=causal))

        if causal:
            self.conv_post = weight_norm(_CausalConv1d(ch, n_src, 7))
            self.f0_predictor = _CausalF0Predictor(cfg.f0_in_channels, cfg.f0_cond_channels, cfg.f0_num_class)
        else:
            self.conv_post = weight_norm(nn.Conv1d(ch, n_src, 7, 1, padding=3))
            self.f0_predictor = _F0Predictor(cfg.f0_in_channels, cfg.f0_cond_channels, cfg.f0_num_class)

        # Constant, not part of the checkpoint; created on CPU explicitly so that building the module
        # under a meta-device context still yields a usable window.
        self.register_buffer(
            "stft_window", torch.tensor(_hann_periodic(self.n_fft), dtype=torch.float32, device="cpu"),
            persistent=False,
        )

    # ------------------------------------------------------------------ weights

    def remove_weight_norm(self) -> None:
        """Fold every weight-norm parametrization ``g * v / ||v||`` into a plain ``weight``.

        Call after loading a checkpoint, for inference. Outputs are unchanged (the folded weight is
        the tensor the parametrization computed). Afterwards ``state_dict()`` uses plain
        ``<m>.weight`` keys, so checkpoints can no longer be loaded into this instance.
        """
        for m in self.modules():
            if parametrize.is_parametrized(m, "weight"):
                parametrize.remove_parametrizations(m, "weight", leave_parametrized=True)

    #: the convolution trunk (``decode`` minus the source STFT and the inverse STFT)
    TRUNK = ("conv_pre", "ups", "source_downs", "source_resblocks", "resblocks", "conv_post")

    def set_trunk_dtype(self, dtype: torch.dtype) -> "HiFTGenerator":
        """Run :meth:`decode`'s convolution trunk (conv_pre, upsampling, source convs, Snake
        ResBlocks, conv_post) in ``dtype`` (e.g. ``torch.float16``), keeping the F0 predictor,
        the excitation, the STFTs and the ``exp``/``sin`` of the iSTFT input in the dtype of
        the rest of the module; :meth:`decode` still takes and returns that dtype. Half-precision
        tensor-core convolutions; the error against float32 is measured by the GPU tests and
        documented in docs/perf.md. The cast rounds the trunk's weights: casting back to
        float32 keeps the rounded values (load the checkpoint again for exact float32).
        Returns ``self``."""
        for name in self.TRUNK:
            getattr(self, name).to(dtype)
        return self

    @property
    def trunk_dtype(self) -> torch.dtype:
        """The dtype :meth:`decode`'s convolution trunk runs in (see :meth:`set_trunk_dtype`)."""
        return self.conv_pre.bias.dtype

    # ------------------------------------------------------------------ F0

    def predict_f0(self, mel: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """F0 from mel: ``[B, in_channels, T]`` natural-log mel (float) -> ``[B, T]`` Hz, same dtype.

        ``lengths`` (optional int tensor [B], mel frames, on ``mel.device``) marks each item's valid
        frames of a padded batch; frames beyond are ignored (zeroed before every conv) and returned as 0.
        Raises ValueError if ``mel`` is not ``[B, in_channels, T]``.
        """
        self._check_mel(mel)
        mask = None if lengths is None else _time_mask(lengths, mel.shape[-1])
        f0 = self.f0_predictor(_zero_outside(mel, mask), mask)
        return f0 if mask is None else f0.masked_fill(~mask[:, 0], 0.0)

    def predict_f0_batched(self, mel: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """F0 of a padded batch in one masked pass, computed in float64 and rounded to ``mel.dtype``.

        ``mel`` ``[B, in_channels, T]`` natural-log mel, ``lengths`` int tensor ``[B]`` (valid frames
        per item, on ``mel.device``) -> ``[B, T]`` Hz, 0 beyond each item's length. Why float64: the
        batch's conv kernels sum in another order than an item's own pass (batch size and length
        choose the blocking), ~1e-7 relative in float32, which the excitation phase integrates into
        ~1e-4 of the speech over seconds (class doc). In float64 that difference is ~1e-16, so after
        rounding to float32 an item's F0 is the same whatever its batch-mates, except for a value
        within ~1e-16 of a float32 rounding boundary (about one in 10^8), which then moves by one
        ulp at one frame (no drift). Against upstream's float32 F0 it is as close as float32 is
        (its own rounding, ~1e-7: tests/test_hift.py). The weights are the module's own (weight norm
        evaluated in its dtype, as upstream does) copied to float64 on first use and again whenever
        they change (load, ``.to(device)``, :meth:`remove_weight_norm`); the copies are no
        parameters or buffers (``state_dict()`` is unchanged).
        Raises ValueError if ``mel`` is not ``[B, in_channels, T]`` or ``lengths`` is not ``[B]``, and
        on the causal (CosyVoice3) HiFT, whose F0 predictor runs per item in float64 anyway.
        """
        if self.cfg.causal:
            raise ValueError("the causal (CosyVoice3) HiFT predicts F0 per item in float64 (upstream): "
                             "predict_f0_batched is for the CosyVoice2 HiFT")
        self._check_mel(mel)
        if lengths.dim() != 1 or lengths.shape[0] != mel.shape[0]:
            raise ValueError(f"lengths must be [{mel.shape[0]}], got {tuple(lengths.shape)}")
        mask = _time_mask(lengths, mel.shape[-1])
        mel64 = mel.to(torch.float64)
        f0 = self.f0_predictor(mel64, mask, self._f0_weights64())
        return f0.masked_fill(~mask[:, 0], 0.0).to(mel.dtype)

    def _f0_weights64(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Float64 copies of the F0 predictor's weights (see :meth:`predict_f0_batched`), rebuilt
        when a parameter changes; not in the module's registries (``state_dict()``, ``.to()``)."""
        return self._derived.get("f0_64", tuple(self.f0_predictor.parameters()),
                                 lambda: self.f0_predictor.weights_as(torch.float64))

    # ------------------------------------------------------------------ excitation

    def upsample_f0(self, f0: torch.Tensor) -> torch.Tensor:
        """Nearest-neighbour upsampling of F0 to the sample rate: ``[B, T]`` Hz -> ``[B, T*spf, 1]`` Hz.

        Same kernel call as upstream (``nn.Upsample(scale_factor=samples_per_frame)``).
        """
        up = F.interpolate(f0[:, None], scale_factor=float(self.samples_per_frame), mode="nearest")
        return up.transpose(1, 2)

    def draw_excitation_noise(
        self, batch: int, n_samples: int, generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The random numbers of one excitation call, consumed exactly as upstream consumes them.

        Returns ``rand_ini`` float32 ``[batch, H+1]`` (initial phases in cycles, uniform [0, 1), column 0
        set to 0) and ``std_noise`` float32 ``[batch, n_samples, H+1]`` standard normal with the memory
        layout of a transposed ``[batch, H+1, n_samples]`` tensor; a third draw of ``[batch,
        n_samples, 1]`` standard normals (upstream's discarded noise branch) is made and dropped.
        Draws come from ``generator`` (on its device) or, if None, from torch's default generator of
        ``device`` (CPU if None); results are on the generator's device.
        """
        dev = generator.device if generator is not None else torch.device(device or "cpu")
        h = self.cfg.nb_harmonics + 1
        rand_ini = torch.rand(batch, h, generator=generator, device=dev)
        rand_ini[:, 0] = 0
        std_noise = torch.empty(batch, h, n_samples, device=dev).transpose(1, 2).normal_(generator=generator)
        torch.empty(batch, n_samples, 1, device=dev).normal_(generator=generator)  # upstream's unused noise
        return rand_ini, std_noise

    def source_from_draws(
        self, f0_up: torch.Tensor, rand_ini: torch.Tensor, std_noise: torch.Tensor,
        frame_lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # (causal HiFT: ``std_noise`` is the fixed uniform ``sine_waves`` tensor and the phase is
        # upsampled with "nearest" instead of "linear", as upstream SineGen2(causal=True))
        """Deterministic part of the excitation (SineGen2 + harmonic merge) given the random draws.

        ``f0_up`` ``[B, N, 1]`` Hz at the sample rate (N = frames * spf), ``rand_ini`` ``[B, H+1]``
        cycles, ``std_noise`` ``[B, N, H+1]`` standard normal. Returns ``(sine_waves [B, N, H+1],
        uv [B, N, 1] (1.0 voiced / 0.0), source [B, 1, N])``, computed in
        ``promote_types(f0_up.dtype, float32)``; ``source`` is cast to ``f0_up.dtype``.
        ``frame_lengths`` (int tensor [B], frames) clamps the phase interpolation at each item's own
        last frame (padded batches). Raises ValueError if N is not a multiple of ``samples_per_frame``.
        """
        spf = self.samples_per_frame
        out_dtype = f0_up.dtype
        work = torch.promote_types(f0_up.dtype, torch.float32)
        if f0_up.dim() != 3 or f0_up.shape[2] != 1 or f0_up.shape[1] % spf:
            raise ValueError(f"f0_up must be [B, frames*{spf}, 1], got {tuple(f0_up.shape)}")
        f0_up = f0_up.to(work)
        h = self.cfg.nb_harmonics + 1
        harmonics = torch.arange(1, h + 1, device=f0_up.device, dtype=work)[None, None, :]
        fn = f0_up * harmonics  # [B, N, H+1] Hz of each harmonic

        # phase increments in cycles per sample; random initial phase on the first sample
        rad = (fn / self.cfg.sampling_rate) % 1
        rad[:, 0, :] = rad[:, 0, :] + rand_ini.to(device=rad.device, dtype=work)
        # integrate at the frame rate, then interpolate the phase back to the sample rate
        rad = F.interpolate(rad.transpose(1, 2), scale_factor=1 / spf, mode="linear").transpose(1, 2)
        phase = torch.cumsum(rad, dim=1) * 2 * math.pi  # [B, frames, H+1] radians
        if frame_lengths is not None:
            # replicate each item's last frame over the padding, as upstream's interpolation clamps
            # at the end of an unpadded tensor
            t = phase.shape[1]
            idx = torch.minimum(torch.arange(t, device=phase.device)[None, :], (frame_lengths - 1)[:, None])
            phase = phase.gather(1, idx[:, :, None].expand(-1, -1, phase.shape[2]))
        mode = "nearest" if self.cfg.causal else "linear"
        phase = F.interpolate(phase.transpose(1, 2) * spf, scale_factor=float(spf), mode=mode).transpose(1, 2)
        sine_waves = torch.sin(phase) * self.cfg.nsf_alpha

        uv = (f0_up > self.cfg.nsf_voiced_threshold).to(work)
        noise_amp = uv * self.cfg.nsf_sigma + (1 - uv) * self.cfg.nsf_alpha / 3
        noise = noise_amp * std_noise.to(device=f0_up.device, dtype=work)
        sine_waves = sine_waves * uv + noise

        lin = self.m_source.l_linear
        merged = torch.tanh(F.linear(sine_waves, lin.weight.to(work), lin.bias.to(work)))
        return sine_waves, uv, merged.transpose(1, 2).to(out_dtype)

    def excitation(self, f0: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """NSF excitation from F0: ``[B, T]`` Hz -> source ``[B, 1, T*spf]`` (dtype of ``f0``).

        Random: consumes ``rand(B, H+1)``, then ``normal_`` on a transposed ``[B, H+1, T*spf]``
        layout, then ``[B, T*spf, 1]`` standard normals (discarded), from ``generator`` or, if None,
        torch's default generator for ``f0.device`` — the same calls in the same order as upstream's
        ``SourceModuleHnNSF``/``SineGen2``, so a seeded run matches upstream bit for bit.
        """
        if f0.dim() != 2:
            raise ValueError(f"f0 must be [B, T] (Hz), got {tuple(f0.shape)}")
        f0_up = self.upsample_f0(f0)
        rand_ini, std_noise = self.draw_excitation_noise(f0.shape[0], f0_up.shape[1], generator, f0.device)
        rand_ini, std_noise = to_device(rand_ini, f0.device), to_device(std_noise, f0.device)
        return self.source_from_draws(f0_up, rand_ini, std_noise)[2]

    def excitation_padded(
        self, f0: torch.Tensor, lengths: Sequence[int],
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> torch.Tensor:
        """Excitation of a padded batch: ``f0`` ``[B, T_max]`` Hz, ``lengths`` B ints (frames).

        Item b draws its random numbers from ``generators[b]`` (None: default generator) with the
        shapes of a single-item :meth:`excitation` call on ``f0[b:b+1, :lengths[b]]``, items in order,
        so the result equals those single-item calls. Returns ``[B, 1, T_max*spf]``, zero beyond
        each item's ``lengths[b]*spf`` samples. Raises ValueError on inconsistent arguments.
        """
        bsz, t_max = f0.shape
        lengths = [int(n) for n in lengths]
        if len(lengths) != bsz or any(n < 1 or n > t_max for n in lengths):
            raise ValueError(f"lengths {lengths} do not fit f0 of shape {tuple(f0.shape)}")
        gens = list(generators) if generators is not None else [None] * bsz
        if len(gens) != bsz:
            raise ValueError(f"{len(gens)} generators for a batch of {bsz}")
        spf = self.samples_per_frame
        h = self.cfg.nb_harmonics + 1
        n_max = t_max * spf
        rand_ini = torch.zeros(bsz, h, device=f0.device)
        std_noise = torch.zeros(bsz, h, n_max, device=f0.device).transpose(1, 2)
        for b, (n, g) in enumerate(zip(lengths, gens)):
            r, z = self.draw_excitation_noise(1, n * spf, g, f0.device)
            rand_ini[b] = to_device(r[0], f0.device)
            std_noise[b, : n * spf] = to_device(z[0], f0.device)
        len_t = _int_tensor(lengths, f0.device)
        src = self.source_from_draws(self.upsample_f0(f0), rand_ini, std_noise, frame_lengths=len_t)[2]
        return _zero_outside(src, _time_mask(len_t * spf, n_max))

    # ------------------------------------------------------------------ decoder

    def _source_stft(self, s: torch.Tensor, n_valid: torch.Tensor | None) -> torch.Tensor:
        """Centred STFT of the excitation ``[B, N]`` -> ``[B, n_fft+2, N/hop+1]`` (real bins, imag bins).

        With ``n_valid`` (int tensor [B], samples) the reflect padding is taken at each item's own end.
        Computed in at least float32 (FFTs do not support bfloat16), returned in ``s.dtype``.
        """
        out_dtype = s.dtype
        s = s.to(torch.promote_types(s.dtype, torch.float32))
        win = self.stft_window.to(device=s.device, dtype=s.dtype)
        if n_valid is None:
            spec = torch.stft(s, self.n_fft, self.hop, self.n_fft, window=win, center=True,
                              pad_mode="reflect", return_complex=True)
        else:
            pad = self.n_fft // 2
            n = s.shape[-1]
            q = torch.arange(-pad, n + pad, device=s.device)[None, :].abs()
            last = (n_valid - 1)[:, None]
            q = torch.where(q > last, 2 * last - q, q).clamp(0, n - 1)
            spec = torch.stft(s.gather(1, q), self.n_fft, self.hop, self.n_fft, window=win, center=False,
                              return_complex=True)
        spec = torch.view_as_real(spec)
        return torch.cat([spec[..., 0], spec[..., 1]], dim=1).to(out_dtype)

    def _istft(self, magnitude: torch.Tensor, phase: torch.Tensor, n_frames: torch.Tensor | None) -> torch.Tensor:
        """Inverse STFT (n_fft, hop, periodic Hann, centred) of ``[B, n_fft/2+1, F]`` -> ``[B, hop*(F-1)]``.

        Same kernels as ``torch.istft`` minus its host-synchronising envelope check. ``n_frames``
        (int tensor [B]) restricts overlap-add and window envelope to each item's own frames.
        Computed in at least float32, returned in ``magnitude.dtype``.
        """
        out_dtype = magnitude.dtype
        work = torch.promote_types(out_dtype, torch.float32)
        magnitude, phase = magnitude.to(work), phase.to(work)
        magnitude = torch.clip(magnitude, max=_MAG_MAX)
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        bsz, _, n_fr = spec.shape
        win = self.stft_window.to(device=magnitude.device, dtype=magnitude.dtype)
        frames = torch.fft.irfft(spec.transpose(1, 2), self.n_fft, dim=-1) * win  # [B, F, n_fft]
        total = self.n_fft + self.hop * (n_fr - 1)
        win_sq = win.pow(2).expand(1, n_fr, self.n_fft)
        if n_frames is not None:
            keep = (torch.arange(n_fr, device=frames.device)[None, :] < n_frames[:, None])[:, :, None]
            frames = frames.masked_fill(~keep, 0.0)
            win_sq = win_sq * keep.to(win_sq.dtype)
        y = torch.ops.aten.unfold_backward(frames, [bsz, total], 1, self.n_fft, self.hop)
        env = torch.ops.aten.unfold_backward(win_sq, [win_sq.shape[0], total], 1, self.n_fft, self.hop)
        start, end = self.n_fft // 2, total - self.n_fft // 2
        y, env = y[:, start:end], env[:, start:end]
        if n_frames is not None:
            env = env.masked_fill(env == 0, 1.0)  # outside an item's frames; zeroed by the caller
        return (y / env).to(out_dtype)

    def decode(self, mel: torch.Tensor, source: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Waveform from mel and excitation (deterministic).

        ``mel`` ``[B, in_channels, T]`` natural-log mel, ``source`` ``[B, 1, T*spf]`` excitation (same
        dtype/device) -> speech ``[B, T*spf]`` at ``sampling_rate``, clamped to ``±audio_limit``.
        ``lengths`` (optional int tensor [B], mel frames, on ``mel.device``): valid frames per item
        of a padded batch; the result then equals per-item calls and is 0 beyond each item's end.
        The convolution trunk runs in :attr:`trunk_dtype` (inputs cast to it, its output cast
        back before the inverse STFT). No host synchronisation. Raises ValueError on
        inconsistent shapes.
        """
        self._check_mel(mel)
        bsz, _, t = mel.shape
        spf = self.samples_per_frame
        if source.dim() != 3 or source.shape[0] != bsz or source.shape[1] != 1 or source.shape[2] != t * spf:
            raise ValueError(f"source must be [{bsz}, 1, {t * spf}] for mel {tuple(mel.shape)}, got {tuple(source.shape)}")
        frames_per_mel = spf // self.hop
        if lengths is None:
            masks = [None] * (self.num_upsamples + 1)
            n_stft = None
            s_stft = self._source_stft(source.squeeze(1), None)
        else:
            # valid length at the mel rate and after each upsampling stage (+1: reflection pad)
            valid = [lengths]
            for i, r in enumerate(self.cfg.upsample_rates):
                valid.append(valid[-1] * r)
            valid[-1] = valid[-1] + 1
            sizes = [t]
            for r in self.cfg.upsample_rates:
                sizes.append(sizes[-1] * r)
            sizes[-1] += 1
            masks = [_time_mask(v, s) for v, s in zip(valid, sizes)]
            n_stft = lengths * frames_per_mel + 1
            s_stft = self._source_stft(source.squeeze(1), lengths * spf)
            s_stft = _zero_outside(s_stft, masks[-1])

        io_dtype, tdt = mel.dtype, self.trunk_dtype
        s_stft, mel_t = s_stft.to(tdt), mel.to(tdt)
        if self.frame_major:
            s_stft, mel_t = _frame_major(s_stft), _frame_major(mel_t)
        x = self.conv_pre(_zero_outside(mel_t, masks[0]))
        for i in range(self.num_upsamples):
            x = F.leaky_relu(x, self.cfg.lrelu_slope)
            x = self.ups[i](_zero_outside(x, masks[i]))
            if i == self.num_upsamples - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            si = self.source_downs[i](s_stft)
            si = self.source_resblocks[i](si, masks[i + 1])
            x = x + si
            xs = None
            for j in range(self.num_kernels):
                r = self.resblocks[i * self.num_kernels + j](x, masks[i + 1])
                xs = r if xs is None else xs + r
            x = xs / self.num_kernels
        x = F.leaky_relu(x)  # default slope 0.01, as upstream
        x = self.conv_post(_zero_outside(x, masks[-1])).to(io_dtype)
        nb = self.n_fft // 2 + 1
        speech = self._istft(torch.exp(x[:, :nb, :]), torch.sin(x[:, nb:, :]), n_stft)
        speech = torch.clamp(speech, -self.cfg.audio_limit, self.cfg.audio_limit)
        if lengths is not None:
            speech = _zero_outside(speech[:, None], _time_mask(lengths * spf, speech.shape[-1]))[:, 0]
        return speech

    # ------------------------------------------------------------------ inference

    @torch.inference_mode()
    def inference(
        self, mel: torch.Tensor, cache_source: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mel -> (speech, source), upstream ``HiFTGenerator.inference``.

        ``mel`` ``[B, in_channels, T]`` natural-log mel at 50 frames/s. ``cache_source`` (optional,
        ``[B or 1, 1, n]``, n <= T*spf samples): the first n excitation samples are replaced by it
        (streaming continuity). ``generator``: see :meth:`excitation`. Returns speech
        ``[B, T*spf]`` (``±audio_limit``) and the excitation actually used ``[B, 1, T*spf]``.
        Raises ValueError on inconsistent shapes.
        """
        f0 = self.predict_f0(mel)
        source = self.excitation(f0, generator)
        if cache_source is not None and cache_source.shape[-1] > 0:
            n = cache_source.shape[-1]
            if cache_source.dim() != 3 or cache_source.shape[1] != 1 or n > source.shape[-1]:
                raise ValueError(
                    f"cache_source must be [B, 1, n] with n <= {source.shape[-1]}, got {tuple(cache_source.shape)}")
            source[:, :, :n] = cache_source
        return self.decode(mel, source), source

    @torch.inference_mode()
    def inference_batch(
        self, mels: Sequence[torch.Tensor], cache_sources: Sequence[torch.Tensor | None] | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Several items of different lengths in one padded forward pass.

        ``mels``: B tensors ``[1, in_channels, T_b]`` (same dtype/device); ``cache_sources``: per item
        None or ``[1, 1, n_b]`` (as :meth:`inference`); ``generators``: per item generator or None.
        Returns (speeches ``[1, T_b*spf]``, sources ``[1, 1, T_b*spf]``), each equal to the
        single-item ``inference(mels[b], cache_sources[b], generators[b])`` run in the same order
        (up to float rounding of differently blocked conv kernels; with :attr:`batched_f0` equal to
        the single-item ``inference_batch([mels[b]], ...)`` in that mode, whose F0 is the float64
        pass: see :meth:`predict_f0_batched`). Raises ValueError on inconsistent arguments.
        """
        bsz = len(mels)
        if bsz == 0:
            return [], []
        for m in mels:
            if m.dim() != 3 or m.shape[0] != 1:
                raise ValueError(f"each mel must be [1, {self.cfg.in_channels}, T], got {tuple(m.shape)}")
            self._check_mel(m)
        caches = list(cache_sources) if cache_sources is not None else [None] * bsz
        if len(caches) != bsz:
            raise ValueError(f"{len(caches)} cache_sources for a batch of {bsz}")
        lengths = [m.shape[-1] for m in mels]
        if min(lengths) < 1:
            raise ValueError("every mel needs at least one frame")
        spf = self.samples_per_frame
        t_max = max(lengths)
        mel = torch.cat([F.pad(m, (0, t_max - m.shape[-1])) for m in mels], dim=0)
        len_t = _int_tensor(lengths, mel.device)
        if self.batched_f0:  # one float64 masked pass for any batch size: independent of batch-mates
            f0 = self.predict_f0_batched(mel, len_t)
        else:  # per item with the single-item kernels: bit-identical to the item run alone
            f0 = torch.cat([F.pad(self.predict_f0(m), (0, t_max - m.shape[-1])) for m in mels], dim=0)
        source = self.excitation_padded(f0, lengths, generators)
        for b, c in enumerate(caches):
            if c is not None and c.shape[-1] > 0:
                n = c.shape[-1]
                if c.dim() != 3 or c.shape[:2] != (1, 1) or n > lengths[b] * spf:
                    raise ValueError(f"cache_sources[{b}] must be [1, 1, n] with n <= {lengths[b] * spf}, "
                                     f"got {tuple(c.shape)}")
                source[b, :, :n] = c[0]
        decode = self.graph_decode if (self.graph_decode is not None and mel.is_cuda) else self.decode
        speech = decode(mel, source, len_t)
        return ([speech[b:b + 1, : n * spf] for b, n in enumerate(lengths)],
                [source[b:b + 1, :, : n * spf] for b, n in enumerate(lengths)])

    def _check_mel(self, mel: torch.Tensor) -> None:
        if mel.dim() != 3 or mel.shape[1] != self.cfg.in_channels:
            raise ValueError(f"mel must be [B, {self.cfg.in_channels}, T], got {tuple(mel.shape)}")


# ----------------------------------------------------------------------------------------------
# streaming (upstream CosyVoice2Model.token2wav, HiFT part)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HiFTStreamState:
    """Per-request HiFT streaming cache carried from one chunk to the next (immutable).

    ``mel``: ``[1, in_channels, mel_cache_len]`` last mel frames of the previous chunk's HiFT input;
    ``source``: ``[1, 1, source_cache_len]`` last excitation samples; ``speech``:
    ``[1, source_cache_len]`` held-back (not yet emitted) tail of the previous chunk's faded speech.
    All None before the first chunk (``HiFTStreamState()``) and after a final chunk.
    """

    mel: torch.Tensor | None = None
    source: torch.Tensor | None = None
    speech: torch.Tensor | None = None

    @property
    def empty(self) -> bool:
        return self.mel is None


def fade_in_with_cache(speech: torch.Tensor, cached: torch.Tensor, overlap: int) -> torch.Tensor:
    """Cross-fade the first ``overlap`` samples of ``speech`` ``[B, N]`` with ``cached`` ``[B, >=overlap]``.

    ``out[:, :L] = speech[:, :L] * w[:L] + cached[:, -L:] * w[L:]`` with ``w = numpy.hamming(2L)``,
    evaluated in float64 and rounded to ``speech.dtype`` (upstream ``fade_in_out`` with a float64
    numpy window); the rest of ``speech`` is unchanged. Returns a new tensor.
    Raises ValueError if either input is shorter than ``overlap``.
    """
    if speech.shape[-1] < overlap or cached.shape[-1] < overlap:
        raise ValueError(f"fade needs {overlap} samples; got speech {tuple(speech.shape)}, cache {tuple(cached.shape)}")
    w_in, w_out = _fade_windows(overlap, speech.device)
    tail = cached if cached.shape[-1] == overlap else cached[..., -overlap:]
    head = speech[..., :overlap].double() * w_in + tail.double() * w_out
    return torch.cat([head.to(speech.dtype), speech[..., overlap:]], dim=-1)


_FADE_WINDOWS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _fade_windows(overlap: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The two halves of ``numpy.hamming(2 * overlap)`` as float64 tensors on ``device`` (fade-in,
    fade-out), made once per ``(overlap, device)`` and, on CUDA, per current stream (the copy that
    makes them is ordered on the stream that first reads them), so a streaming step fades every
    stream with them without re-copying the window."""
    device = torch.device(device)
    key: tuple = (overlap, device)
    if device.type == "cuda":
        key += (torch.cuda.current_stream(device).cuda_stream,)
    w = _FADE_WINDOWS.get(key)
    if w is None:
        full = to_device(torch.from_numpy(_hamming_f64(2 * overlap).copy()), device)
        w = _FADE_WINDOWS[key] = (full[:overlap], full[overlap:])
    return w


def stream_hift_input(
    hift: HiFTGenerator, state: HiFTStreamState, mel_chunk: torch.Tensor, finalize: bool,
    mel_cache_len: int = DEFAULT_MEL_CACHE_LEN,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What one streaming step feeds to :meth:`HiFTGenerator.inference`: ``(mel, cache_source)``.

    ``mel`` = cached mel ``[1, C, mel_cache_len]`` + ``mel_chunk`` ``[1, C, T]`` along time (just
    ``mel_chunk`` at the start of a stream); ``cache_source`` = ``state.source`` (None at the start).
    Raises ValueError on bad shapes, an empty first chunk, or a non-final chunk whose mel (with cache)
    is shorter than ``mel_cache_len`` frames.
    """
    if mel_chunk.dim() != 3 or mel_chunk.shape[:2] != (1, hift.cfg.in_channels):
        raise ValueError(f"mel_chunk must be [1, {hift.cfg.in_channels}, T], got {tuple(mel_chunk.shape)}")
    if state.mel is None:
        mel = mel_chunk
    else:
        cached = state.mel
        if cached.dtype != mel_chunk.dtype or cached.device != mel_chunk.device:
            cached = cached.to(mel_chunk)
        mel = torch.cat([cached, mel_chunk], dim=2)
    if mel.shape[-1] == 0:
        raise ValueError("empty mel chunk at the start of a stream")
    if not finalize and mel.shape[-1] < mel_cache_len:
        raise ValueError(f"a non-final chunk needs at least {mel_cache_len} mel frames (with cache), got {mel.shape[-1]}")
    return mel, state.source


def stream_hift_output(
    state: HiFTStreamState, speech: torch.Tensor, source: torch.Tensor, mel: torch.Tensor, finalize: bool,
    mel_cache_len: int = DEFAULT_MEL_CACHE_LEN, source_cache_len: int | None = None,
) -> tuple[torch.Tensor, HiFTStreamState]:
    """Fade, hold back and cache after one streaming HiFT call: ``-> (speech_out [1, n], new_state)``.

    ``speech`` ``[1, N]`` / ``source`` ``[1, 1, N]``: the :meth:`HiFTGenerator.inference` outputs for
    ``mel`` ``[1, C, T]`` (the :func:`stream_hift_input` mel), ``state`` the state before the step.
    If the state holds a speech tail, the first ``source_cache_len`` samples are cross-faded with it
    (:func:`fade_in_with_cache`). Non-final: new state = last ``mel_cache_len`` frames of ``mel``,
    last ``source_cache_len`` samples of ``source`` and of the faded speech; those speech samples are
    removed from the output. Final: all faded speech is returned with an empty state.
    ``source_cache_len`` defaults to ``mel_cache_len`` mel frames of samples (``N // T`` per frame).
    """
    if source_cache_len is None:
        source_cache_len = mel_cache_len * (speech.shape[-1] // mel.shape[-1])
    if state.speech is not None:
        speech = fade_in_with_cache(speech, state.speech, source_cache_len)
    return _stream_hift_finish(speech, source, mel, finalize, mel_cache_len, source_cache_len)


def _stream_hift_finish(
    speech: torch.Tensor, source: torch.Tensor, mel: torch.Tensor, finalize: bool, mel_cache_len: int,
    source_cache_len: int,
) -> tuple[torch.Tensor, HiFTStreamState]:
    """:func:`stream_hift_output` after the fade (``speech`` already cross-faded): hold back and cache."""
    if finalize:
        return speech, HiFTStreamState()
    if speech.shape[-1] < source_cache_len or source.shape[-1] < source_cache_len or mel.shape[-1] < mel_cache_len:
        raise ValueError("a non-final chunk is shorter than the stream caches")
    new_state = HiFTStreamState(
        mel=mel[:, :, -mel_cache_len:], source=source[:, :, -source_cache_len:], speech=speech[:, -source_cache_len:],
    )
    return speech[:, :-source_cache_len], new_state


def _fade_batch(speeches: Sequence[torch.Tensor], tails: Sequence[torch.Tensor], overlap: int) -> None:
    """:func:`fade_in_with_cache` of several items **in place**: the first ``overlap`` samples of each
    ``speeches[k]`` ``[1, N_k]`` become ``speech * w_in + tails[k][-overlap:] * w_out`` (float64
    products and sum, rounded to the speech dtype: the same values as the per-item function). One
    set of elementwise operations for the batch; the heads are read (and written back) as one view
    when they lie back to back in one storage (rows of a batch tensor). Raises ValueError as
    :func:`fade_in_with_cache` does."""
    for sp, tail in zip(speeches, tails):
        if sp.shape[-1] < overlap or tail.shape[-1] < overlap:
            raise ValueError(f"fade needs {overlap} samples; got speech {tuple(sp.shape)}, cache {tuple(tail.shape)}")
    heads = [sp[..., :overlap] for sp in speeches]
    tails = [t if t.shape[-1] == overlap else t[..., -overlap:] for t in tails]
    w_in, w_out = _fade_windows(overlap, heads[0].device)
    faded = (cat_adjacent(heads, 0).double() * w_in + cat_adjacent(tails, 0).to(heads[0].device).double() * w_out)
    faded = faded.to(heads[0].dtype)  # [K, overlap], computed before any head is written
    runs = merge_adjacent(heads, 0)
    if len(runs) == 1:
        runs[0].copy_(faded)
    else:
        for h, f in zip(heads, faded.split(1)):
            h.copy_(f)


def _cache_lens(hift: HiFTGenerator, mel_cache_len: int, source_cache_len: int | None) -> tuple[int, int]:
    if source_cache_len is None:
        source_cache_len = mel_cache_len * hift.samples_per_frame
    if mel_cache_len < 1 or source_cache_len < 1 or source_cache_len > mel_cache_len * hift.samples_per_frame:
        raise ValueError(f"invalid cache sizes: mel_cache_len={mel_cache_len}, source_cache_len={source_cache_len}")
    return mel_cache_len, source_cache_len


def hift_stream_step(
    hift: HiFTGenerator, state: HiFTStreamState, mel_chunk: torch.Tensor, finalize: bool,
    generator: torch.Generator | None = None, mel_cache_len: int = DEFAULT_MEL_CACHE_LEN,
    source_cache_len: int | None = None,
) -> tuple[torch.Tensor, HiFTStreamState]:
    """One streaming HiFT step (the vocoder half of upstream ``CosyVoice2Model.token2wav``).

    ``mel_chunk`` ``[1, in_channels, T]``: the new flow mel frames of this chunk (flow output after
    dropping ``token_offset * token_mel_ratio`` frames). The cached mel is prepended, the cached
    excitation replaces the start of the new excitation, HiFT runs (random draws from ``generator``,
    see :meth:`HiFTGenerator.excitation`), the first ``source_cache_len`` samples are cross-faded with
    the cached speech tail (:func:`fade_in_with_cache`). Non-final: the last ``mel_cache_len`` mel
    frames / ``source_cache_len`` excitation and speech samples become the new state and the last
    ``source_cache_len`` speech samples are withheld from the output. Final: everything is emitted
    and the returned state is empty. Defaults: 8 mel frames, ``8 * samples_per_frame`` (3840) samples.

    Returns ``(speech [1, n] at sampling_rate, new_state)``; ``state`` is not modified.
    Raises ValueError on bad shapes or a non-final chunk shorter than the mel cache.
    """
    mel_cache_len, source_cache_len = _cache_lens(hift, mel_cache_len, source_cache_len)
    mel, cache_source = stream_hift_input(hift, state, mel_chunk, finalize, mel_cache_len)
    speech, source = hift.inference(mel, cache_source, generator)
    return stream_hift_output(state, speech, source, mel, finalize, mel_cache_len, source_cache_len)


@torch.inference_mode()
def hift_stream_step_batch(
    hift: HiFTGenerator, states: Sequence[HiFTStreamState], mel_chunks: Sequence[torch.Tensor],
    finalize: Sequence[bool], generators: Sequence[torch.Generator | None] | None = None,
    mel_cache_len: int = DEFAULT_MEL_CACHE_LEN, source_cache_len: int | None = None,
) -> list[tuple[torch.Tensor, HiFTStreamState]]:
    """:func:`hift_stream_step` for several requests in one padded HiFT pass.

    Item b uses ``states[b]``, ``mel_chunks[b]``, ``finalize[b]`` and ``generators[b]``; the result
    list holds ``(speech, new_state)`` per item, equal to the single-request steps run in order.
    Runs under inference mode; the cross-fades of all items are one batch of elementwise operations
    written into the fresh vocoder outputs, whose views the results are.
    """
    mel_cache_len, source_cache_len = _cache_lens(hift, mel_cache_len, source_cache_len)
    if not (len(states) == len(mel_chunks) == len(finalize)):
        raise ValueError("states, mel_chunks and finalize must have the same length")
    inputs = [stream_hift_input(hift, s, m, f, mel_cache_len) for s, m, f in zip(states, mel_chunks, finalize)]
    mels = [mel for mel, _ in inputs]
    speeches, sources = hift.inference_batch(mels, [c for _, c in inputs], generators)
    # the cross-fades of all items with a held-back tail at once, in place on the fresh outputs
    fade = [i for i, st in enumerate(states) if st.speech is not None]
    if fade:
        _fade_batch([speeches[i] for i in fade], [states[i].speech for i in fade], source_cache_len)
    return [
        _stream_hift_finish(sp, so, m, f, mel_cache_len, source_cache_len)
        for sp, so, m, f in zip(speeches, sources, mels, finalize)
    ]


# ----------------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------------


def load_hift(
    checkpoint: str | Path, cfg: HiFTConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
    fold_weight_norm: bool = True,
) -> HiFTGenerator:
    """Build :class:`HiFTGenerator` from ``cfg``, load ``hift.pt`` strictly, move, set eval mode.

    Accepts both weight-norm key spellings and a ``generator.`` key prefix. With
    ``fold_weight_norm`` the weight norm is folded (:meth:`HiFTGenerator.remove_weight_norm`).
    Raises :class:`~cosyserve.errors.CheckpointError` on unreadable files or key/shape mismatches.
    """
    from .checkpoint import load_strict, normalize_weight_norm_keys, read_state_dict

    model = CausalHiFTGenerator(cfg) if cfg.causal else HiFTGenerator(cfg)
    sd = normalize_weight_norm_keys(read_state_dict(checkpoint), strip_prefix="generator.")
    load_strict(model, sd, str(checkpoint))
    if fold_weight_norm:
        model.remove_weight_norm()
    return model.to(device=device, dtype=dtype).eval()


# ----------------------------------------------------------------------------------------------
# CosyVoice3: causal HiFT (upstream CausalHiFTGenerator + CausalConvRNNF0Predictor)
# ----------------------------------------------------------------------------------------------


class CausalSourceNoise:
    """The excitation noise the causal HiFT draws once, at construction (not in ``hift.pt``).

    Upstream (``CausalHiFTGenerator``, eval mode) does not draw noise per call: ``SineGen2``
    holds ``rand_ini`` ``[1, H+1]`` (uniform, column 0 set to 0: initial phases) and
    ``sine_waves`` ``[1, noise_samples, H+1]`` (uniform [0, 1), used as ``noise_amp *
    sine_waves[:, :N]``), and ``SourceModuleHnNSF`` holds ``uv`` ``[1, noise_samples, 1]``
    (uniform; its noise branch, not part of the excitation). They come from torch's global CPU
    generator while the yaml is instantiated, right after ``CausalConditionalCFM.__init__``
    reseeded it (``set_all_random_seed(0)``) and drew its own noise; the draws in between are
    the default initialisations of the layers built before ``SineGen2`` (the flow's
    ``input_embedding`` and ``spk_embed_affine_layer``, then the F0 predictor's convs and
    classifier). This class replays exactly that sequence on a private ``torch.Generator``
    (``HiFTConfig.noise_seed``, ``noise_preamble``; the global generator is never touched),
    then ``rand(1, H+1)``, then ``sine_waves``, then ``Linear(H+1, 1)``'s initialisation, then
    ``uv``. CPU torch draws uniforms element by element from mt19937, so a prefix of a large draw
    equals a draw of the prefix: the tensors are materialised lazily, only as far as requested
    (the full ones would take 290 MB), from saved generator states.
    """

    def __init__(self, cfg: HiFTConfig):
        self.cfg = cfg
        self.h = cfg.nb_harmonics + 1
        self._rand_ini: torch.Tensor | None = None
        self._sine_state: torch.Tensor | None = None
        self._uv_state: torch.Tensor | None = None
        self._cache: dict[tuple[str, str], torch.Tensor] = {}

    # -- the replay
    @staticmethod
    def _init_linear(g: torch.Generator, fan_in: int, weight_shape: tuple[int, ...]) -> None:
        """What ``nn.Linear`` / ``nn.Conv1d.reset_parameters`` draw: kaiming_uniform_(a=sqrt(5))
        on the weight, then uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) on the bias."""
        w = torch.empty(weight_shape, device="cpu")
        nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=g)
        bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        nn.init.uniform_(torch.empty(weight_shape[0], device="cpu"), -bound, bound, generator=g)

    def _replay(self) -> None:
        cfg = self.cfg
        g = torch.Generator(device="cpu").manual_seed(cfg.noise_seed)
        for kind, shape in cfg.noise_preamble:
            shape = tuple(int(v) for v in shape)
            if kind == "randn":
                torch.randn(shape, generator=g, device="cpu")
            elif kind == "embedding":  # nn.Embedding(num, dim): normal_ on [num, dim]
                nn.init.normal_(torch.empty(shape, device="cpu"), generator=g)
            elif kind == "linear":  # (in_features, out_features)
                self._init_linear(g, shape[0], (shape[1], shape[0]))
            elif kind == "conv1d":  # (in_channels, out_channels, kernel)
                self._init_linear(g, shape[0] * shape[2], (shape[1], shape[0], shape[2]))
            else:
                raise ValueError(f"unknown construction-noise step {kind!r}")
        # the F0 predictor (built before the generator): conv k4, 4 x conv k3, classifier
        c_in, c = cfg.f0_in_channels, cfg.f0_cond_channels
        self._init_linear(g, c_in * 4, (c, c_in, 4))
        for _ in range(4):
            self._init_linear(g, c * 3, (c, c, 3))
        self._init_linear(g, c, (cfg.f0_num_class, c))
        # SineGen2.__init__
        rand_ini = torch.rand(1, self.h, generator=g, device="cpu")
        rand_ini[:, 0] = 0
        self._rand_ini = rand_ini
        self._sine_state = g.get_state()

    def _uv_generator(self) -> torch.Generator:
        """A generator in the state upstream's ``uv`` draw starts from (skips ``sine_waves`` and
        ``l_linear``'s initialisation; ~0.2 s for the full-size 64.8 M uniforms, done once)."""
        if self._uv_state is None:
            g = torch.Generator(device="cpu")
            g.set_state(self.sine_state())
            left = self.cfg.noise_samples * self.h
            buf = torch.empty(min(left, 1 << 22), device="cpu")
            while left > 0:
                k = min(left, buf.numel())
                buf[:k].uniform_(generator=g)
                left -= k
            self._init_linear(g, self.h, (1, self.h))
            self._uv_state = g.get_state()
        g = torch.Generator(device="cpu")
        g.set_state(self._uv_state)
        return g

    def sine_state(self) -> torch.Tensor:
        if self._sine_state is None:
            self._replay()
        return self._sine_state

    # -- the tensors
    def rand_ini(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``SineGen2.rand_ini`` ``[1, H+1]`` float32 on ``device``."""
        if self._rand_ini is None:
            self._replay()
        return self._cached("rand_ini", device, lambda n: self._rand_ini, 0)

    def _cached(self, name: str, device, build, n: int) -> torch.Tensor:
        key = (name, str(torch.device(device)))
        t = self._cache.get(key)
        if t is None or (name != "rand_ini" and t.shape[1] < n):
            if name == "rand_ini":
                t = build(0).to(device)
            else:
                grow = max(n, 2 * (t.shape[1] if t is not None else 0), 24000)
                t = build(min(grow, self.cfg.noise_samples)).to(device)
            self._cache[key] = t
        return t

    def _check(self, n: int) -> None:
        if n > self.cfg.noise_samples:
            raise ValueError(f"causal HiFT: {n} samples exceed the fixed noise of {self.cfg.noise_samples} samples "
                             f"({self.cfg.noise_samples / self.cfg.sampling_rate:.0f} s)")

    def sine_waves(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``SineGen2.sine_waves[:, :n]`` ``[1, n, H+1]`` float32 (uniform [0, 1)) on ``device``.
        Raises ValueError past ``noise_samples``."""
        self._check(n)

        def build(m: int) -> torch.Tensor:
            g = torch.Generator(device="cpu")
            g.set_state(self.sine_state())
            return torch.rand(1, m, self.h, generator=g, device="cpu")

        return self._cached("sine_waves", device, build, n)[:, :n]

    def uv(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``SourceModuleHnNSF.uv[:, :n]`` ``[1, n, 1]`` float32 (uniform [0, 1)) on ``device``."""
        self._check(n)
        return self._cached("uv", device, lambda m: torch.rand(1, m, 1, generator=self._uv_generator(),
                                                                device="cpu"), n)[:, :n]


class CausalHiFTGenerator(HiFTGenerator):
    """CosyVoice3's causal HiFT (upstream ``CausalHiFTGenerator`` with
    ``CausalConvRNNF0Predictor``), a variant of :class:`HiFTGenerator` built from a
    :class:`~cosyserve.models.config.HiFTConfig` with ``causal=True`` (:func:`parse_causal_hift`).

    Same network family and parameter names (``state_dict()`` = official CV3 ``hift.pt``), with:
    every convolution causal (left zero padding; ``conv_pre`` (kernel ``conv_pre_look_right + 1``)
    and the F0 predictor's first conv (kernel 4) read *right* context instead), nearest-upsampling
    convolutions instead of transposed ones, strided causal source downsampling; the excitation
    phase upsampled with "nearest"; the excitation noise fixed at construction
    (:class:`CausalSourceNoise`: deterministic, no generator); the F0 predictor kept and run in
    float64 as upstream (cast in place at the first inference as upstream does, or by
    :meth:`remove_weight_norm`, which folds its weight norm in float64; from then on ``.to(dtype)``
    of the whole module leaves it float64; ``state_dict()`` of a fresh build is float32 like
    ``hift.pt``).

    :meth:`inference` ``(mel, finalize)``: ``finalize=True`` -> ``480 * T`` samples (zeros as right
    context). ``finalize=False`` (a non-final streaming call over the accumulated mel): the last 3
    frames are only the F0 predictor's right context, of the remaining ``T - 3`` the last
    ``conv_pre_look_right`` only ``conv_pre``'s, and the last ``samples_per_frame`` samples are
    dropped: ``480 * (T - 3 - conv_pre_look_right - 1)`` samples, which equal the first samples of
    the final call up to float rounding.

    :meth:`inference_batch`: F0 and excitation item by item, the decoder as one padded pass
    (:meth:`decode_batch`; everything after ``conv_pre`` is causal, so no masks are needed).
    The CUDA-graph decoder (``graph_decode``) and ``lengths`` masks of :class:`HiFTGenerator`
    are not used by this variant.
    """

    def __init__(self, cfg: HiFTConfig):
        if not cfg.causal:
            raise ValueError("CausalHiFTGenerator needs a HiFTConfig with causal=True (parse_causal_hift)")
        super().__init__(cfg)
        #: fixed excitation noise (see :class:`CausalSourceNoise`), a plain attribute as upstream
        self.noise = CausalSourceNoise(cfg)
        #: optional :class:`~cosyserve.models.graphs.GraphedCausalHiFTTrunk`: :meth:`decode_batch`'s
        #: trunk + iSTFT (:meth:`_trunk_istft`) as CUDA graphs per (batch, frames) bucket, on CUDA
        self.graph_trunk = None

    def _apply(self, fn, recurse=True):
        # ``.to(dtype)`` / ``.half()`` / ``.cuda()`` on the whole module: once the F0 predictor is
        # float64 (after the first inference or :meth:`remove_weight_norm`, as upstream casts it at
        # every inference call) it follows the device but stays float64 — rounding its weights
        # through float32 would change F0 and hence the excitation phase. Before that (a fresh
        # build: float32 parameters, as in ``hift.pt``) it is converted like everything else.
        ref = next(self.f0_predictor.parameters(), None)
        if ref is None or ref.dtype != torch.float64:
            return super()._apply(fn, recurse)
        f0 = self._modules.pop("f0_predictor")
        try:
            super()._apply(fn, recurse)
        finally:
            self._modules["f0_predictor"] = f0
        # the target device: what ``fn`` does to a tensor on the predictor's current device (its
        # dtype conversion, if any, is not applied: a float32 round trip would round the weights)
        ref = next(f0.parameters(), None)
        if ref is not None:
            device = fn(torch.empty(0, dtype=ref.dtype, device=ref.device)).device
            f0.to(device=device, dtype=torch.float64)
        return self

    def remove_weight_norm(self) -> None:
        """As :meth:`HiFTGenerator.remove_weight_norm`; the F0 predictor's weights are folded in
        float64 (what upstream's parametrization computes after its float64 cast)."""
        self.f0_predictor.to(torch.float64)
        super().remove_weight_norm()

    @property
    def f0_lookahead(self) -> int:
        """Mel frames the F0 predictor reads past a non-final call's output (3)."""
        return self.f0_predictor.lookahead

    def predict_f0(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:  # type: ignore[override]
        """``[B, in_channels, T]`` log-mel -> F0 ``[B, T]`` Hz (``[B, T - 3]`` with ``finalize=False``),
        computed in float64, returned in ``mel.dtype``. Raises ValueError on a bad shape or a
        non-final mel of at most 3 frames."""
        self._check_mel(mel)
        _check_flag(finalize)
        if not finalize and mel.shape[-1] <= self.f0_lookahead:
            raise ValueError(f"a non-final causal HiFT call needs more than {self.f0_lookahead} mel frames")
        self.f0_predictor.to(torch.float64)
        return self.f0_predictor(mel.to(torch.float64), finalize=finalize).to(mel.dtype)

    def excitation(self, f0: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """NSF excitation from F0 ``[B, T]`` Hz -> ``[B, 1, T * spf]`` (dtype of ``f0``) with the fixed
        construction noise (``generator`` is not used: nothing is drawn)."""
        if f0.dim() != 2:
            raise ValueError(f"f0 must be [B, T] (Hz), got {tuple(f0.shape)}")
        f0_up = self.upsample_f0(f0)
        n = f0_up.shape[1]
        rand_ini = self.noise.rand_ini(f0.device).expand(f0.shape[0], -1)
        noise = self.noise.sine_waves(n, f0.device).expand(f0.shape[0], -1, -1)
        return self.source_from_draws(f0_up, rand_ini, noise)[2]

    def excitation_padded(self, f0: torch.Tensor, lengths: Sequence[int],
                          generators: Sequence[torch.Generator | None] | None = None) -> torch.Tensor:
        """Excitation of a padded batch ``f0 [B, T_max]`` with ``lengths`` (frames): item b equals
        :meth:`excitation` of ``f0[b:b+1, :lengths[b]]`` (fixed noise: every item starts at the
        noise tensors' first sample), zero beyond. ``generators`` are not used."""
        bsz, t_max = f0.shape
        lengths = [int(n) for n in lengths]
        if len(lengths) != bsz or any(n < 1 or n > t_max for n in lengths):
            raise ValueError(f"lengths {lengths} do not fit f0 of shape {tuple(f0.shape)}")
        spf = self.samples_per_frame
        return torch.cat([F.pad(self.excitation(f0[b:b + 1, :n]), (0, (t_max - n) * spf))
                          for b, n in enumerate(lengths)])

    def decode(self, mel: torch.Tensor, source: torch.Tensor, lengths: torch.Tensor | None = None,
               finalize: bool = True) -> torch.Tensor:
        """Waveform from mel ``[B, in_channels, T]`` and excitation ``[B, 1, T * spf]`` (upstream
        ``CausalHiFTGenerator.decode``): ``[B, T * spf]`` with ``finalize=True``; with
        ``finalize=False`` the last ``conv_pre_look_right`` frames are right context only and the
        last ``spf`` samples are dropped: ``[B, (T - conv_pre_look_right - 1) * spf]``. Clamped to
        ``±audio_limit``. ``lengths`` (padded batches) is not supported for the causal variant
        (ValueError). No host synchronisation."""
        if lengths is not None:
            raise ValueError("causal HiFT decode: padded batches (lengths) are not supported; decode items one by one")
        self._check_mel(mel)
        bsz, _, t = mel.shape
        spf, look = self.samples_per_frame, self.cfg.conv_pre_look_right
        if source.dim() != 3 or source.shape[0] != bsz or source.shape[1] != 1 or source.shape[2] != t * spf:
            raise ValueError(f"source must be [{bsz}, 1, {t * spf}] for mel {tuple(mel.shape)}, "
                             f"got {tuple(source.shape)}")
        if not finalize and t <= look + 1:
            raise ValueError(f"a non-final causal HiFT decode needs more than {look + 1} mel frames, got {t}")
        tdt = self.trunk_dtype
        s_stft = self._source_stft(source.squeeze(1), None).to(tdt)
        mel_t = mel.to(tdt)
        if finalize:
            x = self.conv_pre(mel_t)
        else:
            x = self.conv_pre(mel_t[:, :, :-look], mel_t[:, :, -look:])
            s_stft = s_stft[:, :, :-(math.prod(self.cfg.upsample_rates) * look)]
        speech = self._trunk_istft(x, s_stft, mel.dtype, None)
        if not finalize:
            speech = speech[:, :-spf]
        return torch.clamp(speech, -self.cfg.audio_limit, self.cfg.audio_limit)

    def _trunk_istft(self, x: torch.Tensor, s_stft: torch.Tensor, io_dtype: torch.dtype,
                     n_frames: torch.Tensor | None) -> torch.Tensor:
        """Everything after ``conv_pre``: ``x [B, base, T]`` (trunk dtype), ``s_stft [B, n_fft+2,
        T * prod(upsample_rates) + 1]`` -> speech ``[B, hop * T * prod(upsample_rates)]`` in
        ``io_dtype`` before trimming and clamping. Every layer here is causal, so frames past an
        item's end in a padded batch never reach its valid frames; ``n_frames`` (int tensor [B])
        limits the inverse STFT's overlap-add and envelope to each item's own STFT frames."""
        for i in range(self.num_upsamples):
            x = F.leaky_relu(x, self.cfg.lrelu_slope)
            x = self.ups[i](x)
            if i == self.num_upsamples - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + self.source_resblocks[i](self.source_downs[i](s_stft))
            xs = None
            for j in range(self.num_kernels):
                r = self.resblocks[i * self.num_kernels + j](x)
                xs = r if xs is None else xs + r
            x = xs / self.num_kernels
        x = F.leaky_relu(x)  # default slope 0.01, as upstream
        x = self.conv_post(x).to(io_dtype)
        nb = self.n_fft // 2 + 1
        return self._istft(torch.exp(x[:, :nb, :]), torch.sin(x[:, nb:, :]), n_frames)

    def decode_batch(self, mels: Sequence[torch.Tensor], sources: Sequence[torch.Tensor],
                     finalize: Sequence[bool]) -> list[torch.Tensor]:
        """:meth:`decode` of several items of different lengths in one padded pass: item b's mel
        ``[1, in_channels, T_b]``, excitation ``[1, 1, T_b * spf]`` and ``finalize[b]``; returns the
        B speeches :meth:`decode` returns for them (up to float rounding of differently shaped
        kernels). Only ``conv_pre`` reads the right (its ``conv_pre_look_right`` context frames,
        or zeros) and the source STFT reflects at each item's end: those two are built per item;
        the rest is one causal pass. Raises ValueError on inconsistent arguments."""
        bsz = len(mels)
        if not (bsz == len(sources) == len(finalize)) or bsz == 0:
            raise ValueError(f"decode_batch needs equally many (>= 1) mels, sources and flags, got "
                             f"{len(mels)}, {len(sources)}, {len(finalize)}")
        spf, look = self.samples_per_frame, self.cfg.conv_pre_look_right
        up = math.prod(self.cfg.upsample_rates)
        tdt = self.trunk_dtype
        rows, stfts, outs = [], [], []
        for mel, src, fin in zip(mels, sources, finalize):
            self._check_mel(mel)
            t = mel.shape[-1]
            if mel.shape[0] != 1 or src.shape != (1, 1, t * spf):
                raise ValueError(f"each item needs mel [1, C, T] and source [1, 1, T*{spf}], got "
                                 f"{tuple(mel.shape)} and {tuple(src.shape)}")
            if not fin and t <= look + 1:
                raise ValueError(f"a non-final causal HiFT decode needs more than {look + 1} mel frames, got {t}")
            o = t if fin else t - look  # output frames
            s = self._source_stft(src.squeeze(1), None)
            stfts.append(s[:, :, : up * o + 1])
            # conv_pre input: the output frames, then the right context (zeros when final)
            rows.append(F.pad(mel, (0, look)) if fin else mel)
            outs.append(o)
        o_max = max(outs)
        x_in = torch.cat([F.pad(r, (0, o_max + look - r.shape[-1])) for r in rows]).to(tdt)
        s_stft = torch.cat([F.pad(s, (0, up * o_max + 1 - s.shape[-1])) for s in stfts]).to(tdt)
        x = F.conv1d(x_in, self.conv_pre.weight, self.conv_pre.bias)  # no padding: o_max frames out
        n_fr = _int_tensor([up * o + 1 for o in outs], x.device)
        speech = None
        if self.graph_trunk is not None and x.is_cuda and mels[0].dtype == torch.float32:
            speech = self.graph_trunk(x, s_stft, n_fr)  # None beyond its buckets
        if speech is None:
            speech = self._trunk_istft(x, s_stft, mels[0].dtype, n_fr)
        res = []
        for b, (o, fin) in enumerate(zip(outs, finalize)):
            n = o * spf - (0 if fin else spf)
            res.append(torch.clamp(speech[b:b + 1, :n], -self.cfg.audio_limit, self.cfg.audio_limit))
        return res

    @torch.inference_mode()
    def inference(  # type: ignore[override]
        self, mel: torch.Tensor, finalize: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mel -> ``(speech, source)``, upstream ``CausalHiFTGenerator.inference``.

        ``mel`` ``[B, in_channels, T]`` natural-log mel (50 frames/s). ``finalize=True``: speech
        ``[B, T * spf]``, source ``[B, 1, T * spf]``. ``finalize=False``: F0 and source over the
        first ``T - 3`` frames, speech ``[B, (T - 3 - conv_pre_look_right - 1) * spf]``.
        Deterministic. Raises ValueError on bad shapes or too short non-final mels.
        """
        _check_flag(finalize)
        f0 = self.predict_f0(mel, finalize)
        source = self.excitation(f0)
        body = mel if finalize else mel[:, :, :-self.f0_lookahead]
        return self.decode(body, source, finalize=finalize), source

    @torch.inference_mode()
    def inference_batch(  # type: ignore[override]
        self, mels: Sequence[torch.Tensor], finalize: Sequence[bool] | bool = True,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """:meth:`inference` for several items: ``mels`` B tensors ``[1, in_channels, T_b]``,
        ``finalize`` one bool or one per item. F0 and excitation are computed item by item with the
        single-item kernels (the excitation phase integrates F0, see :class:`HiFTGenerator`), the
        decoder runs as one padded pass (:meth:`decode_batch`). Returns (speeches, sources) lists
        equal to the single-item calls up to float rounding. Raises ValueError on bad arguments."""
        flags = [bool(finalize)] * len(mels) if isinstance(finalize, bool) else [bool(f) for f in finalize]
        if len(flags) != len(mels):
            raise ValueError(f"{len(flags)} finalize flags for {len(mels)} mels")
        if not mels:
            return [], []
        bodies, sources = [], []
        for m, f in zip(mels, flags):
            if m.dim() != 3 or m.shape[0] != 1:
                raise ValueError(f"each mel must be [1, {self.cfg.in_channels}, T], got {tuple(m.shape)}")
            sources.append(self.excitation(self.predict_f0(m, f)))
            bodies.append(m if f else m[:, :, :-self.f0_lookahead])
        return self.decode_batch(bodies, sources, flags), sources

    # ------------------------------------------------------------------ bounded-window streaming

    @property
    def stream_margins(self) -> tuple[int, int]:
        """``(f0_margin, trunk_margin)`` mel frames (:func:`_causal_stream_margins`; 8 and 35 for
        the official CosyVoice3 HiFT): a streaming call recomputes ``f0_margin + trunk_margin``
        frames before the first new one."""
        if getattr(self, "_stream_margins", None) is None:
            self._stream_margins = _causal_stream_margins(self)
        return self._stream_margins

    def window_start(self, emitted_frames: int) -> int:
        """First mel frame of the window a streaming call reads after ``emitted_frames`` frames
        (``emitted samples / samples_per_frame``) were emitted: ``max(0, emitted - f0_margin -
        trunk_margin)``."""
        f0m, tm = self.stream_margins
        return max(0, emitted_frames - f0m - tm)

    def _window_excitation(self, f0: torch.Tensor, starts: Sequence[int], carry: torch.Tensor,
                           ks: Sequence[int], frames: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Excitation of B windows at once: F0 ``[B, W]`` (Hz, right-padded) of window frames
        ``starts[b] ..``; what :meth:`excitation` of each stream's whole F0 gives for those frames,
        with the phase accumulator carried in: ``carry`` ``[B, H+1]`` float64 = the sum of frames ``0
        .. starts[b] + ks[b] - 1``'s phase increments (zeros and ``ks[b] = 0`` for a window from frame
        0); window frames ``< ks[b]`` (not exact F0) hold the carried phase. ``frames[b]``: the item's
        valid F0 frames (the construction noise is read up to there). The sum runs in float64 and
        is rounded to the working dtype afterwards, which is exactly what torch's CPU ``cumsum`` of
        float32 does (its accumulator is double), so on CPU the phase equals the whole-mel run's bit
        for bit; padding frames come after each item's own and never reach them. The noise is
        indexed by absolute sample. Returns ``(source [B, 1, W * spf]`` in ``f0.dtype``,
        ``accumulated phase [B, W, H+1]`` float64)."""
        spf = self.samples_per_frame
        cfg = self.cfg
        dev = f0.device
        work = torch.promote_types(f0.dtype, torch.float32)
        f0_up = self.upsample_f0(f0).to(work)  # [B, N, 1]
        n = f0_up.shape[1]
        h = cfg.nb_harmonics + 1
        harmonics = torch.arange(1, h + 1, device=dev, dtype=work)[None, None, :]
        rad = (f0_up * harmonics / cfg.sampling_rate) % 1
        if any(st == 0 for st in starts):  # upstream adds the initial phases at the stream's sample 0
            first = (_int_tensor([int(st == 0) for st in starts], dev) == 1).to(work)[:, None]
            rad[:, 0, :] = rad[:, 0, :] + self.noise.rand_ini(dev).to(work) * first
        rad = F.interpolate(rad.transpose(1, 2), scale_factor=1 / spf, mode="linear").transpose(1, 2)
        w = rad.shape[1]
        keep = torch.arange(w, device=dev)[None, :] >= _int_tensor(ks, dev)[:, None]
        inc = rad.to(torch.float64) * keep[:, :, None]
        cum = torch.cumsum(torch.cat([carry.to(device=dev, dtype=torch.float64)[:, None, :], inc], dim=1), dim=1)[:, 1:]
        phase = cum.to(work) * 2 * math.pi
        phase = F.interpolate(phase.transpose(1, 2) * spf, scale_factor=float(spf), mode="nearest").transpose(1, 2)
        sine = torch.sin(phase) * cfg.nsf_alpha
        uv = (f0_up > cfg.nsf_voiced_threshold).to(work)
        noise_amp = uv * cfg.nsf_sigma + (1 - uv) * cfg.nsf_alpha / 3
        ends = [(st + fr) * spf for st, fr in zip(starts, frames)]
        table = self.noise.sine_waves(max(ends), dev)[0]  # [M, H+1]
        idx = _int_tensor([st * spf for st in starts], dev)[:, None] + torch.arange(n, device=dev)[None, :]
        idx = torch.minimum(idx, _int_tensor(ends, dev)[:, None] - 1)  # padding samples: any valid index
        sine = sine * uv + noise_amp * table[idx].to(work)
        lin = self.m_source.l_linear
        merged = torch.tanh(F.linear(sine, lin.weight.to(work), lin.bias.to(work)))
        return merged.transpose(1, 2).to(f0.dtype), cum

    @torch.inference_mode()
    def inference_stream_batch(
        self, mels: Sequence[torch.Tensor], emitted: Sequence[int], finalize: Sequence[bool],
        carries: Sequence[CausalHiFTCarry | None],
    ) -> tuple[list[torch.Tensor], list[CausalHiFTCarry | None]]:
        """Streaming calls without the whole-mel re-run: per item the samples that
        ``inference(mel, finalize)[0][:, emitted:]`` gives (upstream's ``CosyVoice3Model.token2wav``
        trims its re-run over the accumulated mel by ``speech_offset``), computed over a bounded
        window only.

        Why this is exact: every layer after ``conv_pre`` is causal with a finite left field, F0 at
        a frame reads a bounded left context (``f0_margin``), the construction noise is indexed
        by sample, and the only unbounded dependency — the excitation phase, a running sum of
        per-frame phase increments — is carried (:class:`CausalHiFTCarry`). So the window is
        frames ``window_start(emitted / spf) ..`` of the accumulated mel (``f0_margin +
        trunk_margin`` frames before the first new one), its first ``f0_margin`` frames' phase is
        the carried sum, and the output before the new samples is dropped. Numerics: on CPU the
        phase equals the whole-mel run's bit for bit and the rest differs only by convolution
        rounding of other lengths (tests: ~1e-7); on CUDA the float64 phase sum is more accurate
        than the re-run's float32 scan. Cost per call: window frames instead of all frames.

        Args: ``mels`` B accumulated mels ``[1, in_channels, T_b]`` (all frames so far; only the
        window is read); ``emitted`` samples already emitted per item (a multiple of
        ``samples_per_frame``, as every causal HiFT output is); ``finalize`` per item;
        ``carries`` per item: None for a stream's first call (or while its window starts at frame
        0), else the carry the previous call returned; an item whose carry is missing or belongs to
        another point of the stream is computed from frame 0 (the re-run's cost, same samples).

        Returns ``(speeches, carries)``: per item the new samples ``[1, n]`` and the carry for its
        next call (None after a final call or while the next window starts at frame 0).

        Raises ValueError on inconsistent arguments or a too short non-final mel.
        """
        b = len(mels)
        if not (b == len(emitted) == len(finalize) == len(carries)):
            raise ValueError(f"inference_stream_batch needs one emitted count, flag and carry per mel, got "
                             f"{b}, {len(emitted)}, {len(finalize)}, {len(carries)}")
        if b == 0:
            return [], []
        spf = self.samples_per_frame
        la = self.f0_lookahead
        f0m, _ = self.stream_margins
        wins, starts, ks, carry_rows, nf, flags, emitted_s = [], [], [], [], [], [], []
        h = self.cfg.nb_harmonics + 1
        for m, e_samples, fin, carry in zip(mels, emitted, finalize, carries):
            if m.dim() != 3 or m.shape[0] != 1:
                raise ValueError(f"each mel must be [1, {self.cfg.in_channels}, T], got {tuple(m.shape)}")
            self._check_mel(m)
            _check_flag(bool(fin) if isinstance(fin, (bool, int)) else fin)
            fin = bool(fin)
            e_samples = int(e_samples)
            if e_samples < 0 or e_samples % spf:
                raise ValueError(f"emitted samples must be a non-negative multiple of {spf}, got {e_samples}")
            start = self.window_start(e_samples // spf)
            if start > 0 and (carry is None or carry.frame != start + f0m):
                start = 0  # no usable carry (e.g. a state built by hand): run from frame 0, as the re-run does
            win = m[:, :, start:]
            if not fin and win.shape[-1] <= la:
                raise ValueError(f"a non-final causal HiFT call needs more than {la} mel frames")
            wins.append(win)
            starts.append(start)
            ks.append(f0m if start else 0)
            carry_rows.append(carry.phase.reshape(1, h).to(device=m.device, dtype=torch.float64) if start else
                              torch.zeros(1, h, dtype=torch.float64, device=m.device))
            nf.append(win.shape[-1] - (0 if fin else la))
            flags.append(fin)
            emitted_s.append(e_samples)
        # F0 of every window in one padded pass: the predictor reads right context only in its first
        # conv (a non-final window's own look-ahead frames, zeros after a final one), the rest is causal
        longest = max(w.shape[-1] for w in wins)
        f0 = self.predict_f0(torch.cat([F.pad(w, (0, longest - w.shape[-1])) for w in wins]), True)
        source, cum = self._window_excitation(f0, starts, torch.cat(carry_rows), ks, nf)
        bodies = [w if fin else w[:, :, :-la] for w, fin in zip(wins, flags)]
        sources = [source[b:b + 1, :, :n * spf] for b, n in enumerate(nf)]
        plans = [(st, e, cum[b:b + 1]) for b, (st, e) in enumerate(zip(starts, emitted_s))]
        speeches = self.decode_batch(bodies, sources, [bool(f) for f in finalize])
        outs, new_carries = [], []
        for sp, fin, (start, e_samples, cum) in zip(speeches, finalize, plans):
            out = sp[:, e_samples - start * spf:]
            outs.append(out)
            nxt = self.window_start((e_samples + out.shape[1]) // spf)
            if fin or nxt == 0:
                new_carries.append(None)
            else:
                frame = nxt + f0m
                new_carries.append(CausalHiFTCarry(frame=frame, phase=cum[:, frame - 1 - start].clone()))
        return outs, new_carries


@dataclass(frozen=True)
class CausalHiFTCarry:
    """What a causal-HiFT stream carries between windowed calls
    (:meth:`CausalHiFTGenerator.inference_stream_batch`): ``phase`` ``[1, H+1]`` float64, the
    excitation phase accumulator (cycles per sample summed over frames, upstream's ``cumsum`` of
    the frame-rate phase increments) over frames ``0 .. frame - 1``, where ``frame`` is the first
    frame whose F0 the next window computes exactly (``window start + f0 margin``). 72 bytes per
    stream at 8 harmonics."""

    frame: int
    phase: torch.Tensor


def _conv_left_field(module: nn.Module) -> int:
    """Sum over every ``nn.Conv1d`` in ``module`` of ``(kernel - 1) * dilation``: an upper bound of
    the input samples left of an output sample that a causal chain of those convolutions reads."""
    return sum((m.kernel_size[0] - 1) * m.dilation[0] for m in module.modules() if isinstance(m, nn.Conv1d))


def _causal_stream_margins(hift: "CausalHiFTGenerator") -> tuple[int, int]:
    """``(f0_margin, trunk_margin)`` in mel frames for :meth:`CausalHiFTGenerator.inference_stream_batch`.

    ``f0_margin``: frames at a window's start whose F0 differs from the whole-mel run (the F0
    predictor's causal convolutions after the first read zeros there; the first conv reads only
    the right). ``trunk_margin``: an upper bound of the mel frames left of an output sample that
    the decoder reads — per upsampling stage the upsampling conv plus the widest resblock (every
    conv of it chained) at that stage's rate, the source branch (strided downsampling conv from
    the STFT frame rate, its resblock), then ``conv_post``, the inverse STFT's overlap, the source
    STFT's centring and the last stage's one-sample reflection — rounded up, plus one frame.
    ``conv_pre`` reads only the right. Derived from the built modules, so from the yaml."""
    cfg = hift.cfg
    f0_margin = sum(m.pad_len for m in list(hift.f0_predictor.condnet)[1:] if isinstance(m, _CausalConv1d))
    stft_rate = math.prod(cfg.upsample_rates)  # source STFT frames per mel frame (+1 frame in all)
    total, rate = 0.0, 1
    k = hift.num_kernels
    for i, r in enumerate(cfg.upsample_rates):
        rate *= r
        widest = max(_conv_left_field(hift.resblocks[i * k + j]) for j in range(k))
        total += (_conv_left_field(hift.ups[i]) + widest + _conv_left_field(hift.source_resblocks[i])) / rate
        down = hift.source_downs[i]
        total += (_conv_left_field(down) + down.stride[0] - 1) / stft_rate
    total += (_conv_left_field(hift.conv_post) + hift.n_fft // hift.hop + 1) / stft_rate
    total += (hift.n_fft // 2) / hift.samples_per_frame
    return f0_margin, int(math.ceil(total)) + 1


def _check_flag(finalize) -> None:
    if not isinstance(finalize, bool):
        raise TypeError(f"causal HiFT: finalize must be a bool, got {type(finalize).__name__} (CosyVoice2's "
                        "cache_source / lengths arguments do not apply; stream with engine.token2wav_cv3)")


def parse_causal_hift(data: dict) -> HiFTConfig:
    """:class:`~cosyserve.models.config.HiFTConfig` (``causal=True``) of a CosyVoice3 yaml.

    ``data``: the whole dict of :func:`cosyserve.models.config.load_hyperpyyaml` (``cosyvoice3.yaml``).
    Checks the classes (``hift: CausalHiFTGenerator``, ``f0_predictor: CausalConvRNNF0Predictor``)
    and reads the construction-noise recipe from the ``flow`` section (its ``CausalConditionalCFM``
    reseeds and draws ``[1, 80, 15000]`` normals, then ``input_embedding`` ``(vocab_size,
    input_size)`` and ``spk_embed_affine_layer`` ``(spk_embed_dim -> output_size)`` are initialised;
    see :class:`CausalSourceNoise`), which requires ``flow`` to come before ``hift`` in the file as
    upstream's does. Raises :class:`~cosyserve.errors.ConfigError`.
    """
    from ..errors import ConfigError
    from .config import _get, _hift_kwargs, Tagged

    def expect(node, key: str, cls: str) -> dict:
        if not isinstance(node, Tagged) or node.kind != "new" or node.class_name != cls:
            raise ConfigError(f"yaml key '{key}' must be '!new:...{cls}' (CosyVoice3), found {node!r:.80}")
        return node.kwargs()

    hift = expect(data.get("hift"), "hift", "CausalHiFTGenerator")
    f0 = expect(hift.get("f0_predictor"), "hift.f0_predictor", "CausalConvRNNF0Predictor")
    flow = expect(data.get("flow"), "flow", "CausalMaskedDiffWithDiT")
    dec = expect(flow.get("decoder"), "flow.decoder", "CausalConditionalCFM")
    keys = list(data.keys())
    if keys.index("flow") > keys.index("hift"):
        raise ConfigError("yaml: 'hift' comes before 'flow'; the causal HiFT's construction noise is only "
                          "reproducible in upstream's order (flow, then hift)")
    del dec
    w = "hift"
    common = _hift_kwargs(hift, f0)
    fw = "flow"
    preamble = (
        ("randn", (1, 80, 50 * 300)),  # CausalConditionalCFM.rand_noise (literal shape upstream)
        ("embedding", (_get(flow, "vocab_size", fw, 4096, int), _get(flow, "input_size", fw, 512, int))),
        ("linear", (_get(flow, "spk_embed_dim", fw, 192, int), _get(flow, "output_size", fw, 80, int))),
    )
    cfg = HiFTConfig(
        **common,
        causal=True,
        conv_pre_look_right=_get(hift, "conv_pre_look_right", w, 4, int),
        noise_preamble=preamble,
        noise_seed=0,
        noise_samples=300 * 24000,
    )
    if cfg.sampling_rate == 22050:
        raise ConfigError("hift.sampling_rate 22050 selects upstream's SineGen v1, which the causal HiFT does not use")
    if not (len(cfg.upsample_rates) == len(cfg.upsample_kernel_sizes) == len(cfg.source_resblock_kernel_sizes)):
        raise ConfigError("hift: upsample_rates, upsample_kernel_sizes and source_resblock_kernel_sizes "
                          "must have equal length")
    if cfg.conv_pre_look_right < 1:
        raise ConfigError(f"hift.conv_pre_look_right must be >= 1, got {cfg.conv_pre_look_right}")
    if cfg.f0_num_class != 1:
        raise ConfigError(f"hift.f0_predictor.num_class must be 1, got {cfg.f0_num_class}")
    return cfg

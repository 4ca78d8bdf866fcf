"""Step-Audio2 token2wav directory: DiT flow + CosyVoice2 HiFT, offline and streaming, and its loader.

Layout of a token2wav directory (``Step-Audio-2-mini/token2wav``)::

    flow.yaml                       Step-Audio2 flow (parsed as data: config.load_dit_flow_config)
    flow.pt                         state dict of CausalMaskedDiffWithXvec (DiT flow)
    hift.pt                         state dict of the CosyVoice2 HiFT, keys prefixed ``generator.``
    campplus.onnx                   CAM++ speaker embedding
    speech_tokenizer_v2_25hz.onnx   S3Tokenizer v2 (25 Hz)

Algorithm source of the driver: ``stepaudio2.token2wav.Token2wav`` (PyPI
``token2wav-cosyvoice-stepaudio2==0.1.3``): offline ``__call__`` = flow ``inference`` + HiFT; streaming
``set_stream_cache`` (prompt + three 4218 silence tokens) then ``stream(tokens, last_chunk)`` per chunk:
flow ``inference_chunk``, cache trimming, HiFT with 8 cached mel frames and 3840 cached excitation
samples, Hamming cross-fade of 3840 samples with the held-back tail of the previous chunk, the tail
held back on non-final chunks; the first non-final chunk is preceded by 3840 zeros (so a stream's
audio is 160 ms longer than the offline audio, as upstream).

The HiFT of the directory is the CosyVoice2 ``HiFTGenerator`` (:mod:`cosyserve.models.hift`) with
Step-Audio2's constructor defaults (:func:`~cosyserve.models.config.stepaudio2_hift_config`); its
two widths are read from ``hift.pt``'s tensor shapes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import CheckpointError, ModelDirError
from .checkpoint import load_strict, normalize_weight_norm_keys, read_state_dict
from .config import DitFlowConfig, HiFTConfig, load_dit_flow_config, stepaudio2_hift_config
from .dit_flow import DitFlowModel, DitStreamState
from .hift import HiFTGenerator, HiFTStreamState, hift_stream_step_batch

FLOW_YAML = "flow.yaml"
FLOW_FILE = "flow.pt"
HIFT_FILE = "hift.pt"
CAMPPLUS_FILE = "campplus.onnx"
SPEECH_TOKENIZER_FILE = "speech_tokenizer_v2_25hz.onnx"
#: marks a random-weight token2wav directory (networks built from flow.yaml at load time)
RANDOM_T2W_MARKER = "RANDOM_WEIGHTS_NO_FILES.json"
#: samples of the Hamming cross-fade / held-back tail (8 mel frames at 480 samples per frame)
MEL_CACHE_LEN = 8


# ----------------------------------------------------------------------------------------------
# sizes and yaml
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DitT2WSize:
    """Sizes of a token2wav flow.yaml; defaults are the released Step-Audio2 sizes."""

    enc_dim: int = 512
    enc_heads: int = 8
    enc_blocks: int = 6
    enc_up_blocks: int = 4
    enc_linear: int = 2048
    dit_hidden: int = 512
    dit_depth: int = 16
    dit_heads: int = 8
    dit_head_dim: int = 64
    hift_channels: int = 512
    hift_f0_channels: int = 512


#: the released sizes (Step-Audio-2-mini/token2wav)
FULL_SIZE = DitT2WSize()
#: the tiny sizes of the reference fixture (encoder 64 wide, 2 heads, 2 + 2 blocks; DiT 64, depth 2)
TINY_SIZE = DitT2WSize(enc_dim=64, enc_heads=2, enc_blocks=2, enc_up_blocks=2, enc_linear=128, dit_hidden=64,
                       dit_depth=2, dit_heads=2, dit_head_dim=16, hift_channels=64, hift_f0_channels=64)

_YAML = """\
# Step-Audio2 token2wav flow ({what}); same tags and keys as the released flow.yaml.
flow: !new:cosyvoice2.flow.flow.CausalMaskedDiffWithXvec
    input_size: {s.enc_dim}
    output_size: 80
    spk_embed_dim: 192
    output_type: 'mel'
    vocab_size: 6561
    encoder: !new:cosyvoice2.transformer.upsample_encoder_v2.UpsampleConformerEncoderV2
        input_size: {s.enc_dim}
        output_size: {s.enc_dim}
        input_layer: 'linear'
        pre_lookahead_len: 3
        num_blocks: {s.enc_blocks}
        num_up_blocks: {s.enc_up_blocks}
        up_stride: 2
        up_scale_factor: 2
        attention_heads: {s.enc_heads}
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        key_bias: True
        linear_units: {s.enc_linear}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: True
    decoder: !new:cosyvoice2.flow.flow_matching.CausalConditionalCFM
        inference_cfg_rate: 0.7
        estimator: !new:cosyvoice2.flow.decoder_dit.DiT
            in_channels: 320
            out_channels: 80
            mlp_ratio: 4.0
            depth: {s.dit_depth}
            num_heads: {s.dit_heads}
            head_dim: {s.dit_head_dim}
            hidden_size: {s.dit_hidden}
"""


def dit_flow_yaml(size: DitT2WSize = FULL_SIZE, what: str = "random weights") -> str:
    """A token2wav ``flow.yaml`` at ``size`` (the released file's tags and keys)."""
    return _YAML.format(s=size, what=what)


# ----------------------------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------------------------


def align_prompt(prompt_tokens: torch.Tensor, prompt_mel: torch.Tensor, ratio: int) -> torch.Tensor:
    """``prompt_mel`` ``[F, 80]`` replicate-padded or cropped to ``ratio * len(prompt_tokens)`` frames
    (``Token2wav._prepare_prompt``'s rule). Raises ValueError on an empty prompt."""
    n = int(prompt_tokens.numel()) * ratio
    if n == 0 or prompt_mel.shape[0] == 0:
        raise ValueError("empty prompt (no tokens or no mel frames)")
    if prompt_mel.shape[0] >= n:
        return prompt_mel[:n]
    return F.pad(prompt_mel[None].transpose(1, 2), (0, n - prompt_mel.shape[0]), mode="replicate").transpose(1, 2)[0]


@dataclass(frozen=True)
class DitT2WStreamState:
    """Per-stream state of :class:`DitToken2Wav` streaming: the flow caches (None before the set-up)
    and the HiFT cache; ``started``: a chunk was already emitted (the first non-final chunk gets the
    leading zeros)."""

    flow: DitStreamState | None = None
    hift: HiFTStreamState = HiFTStreamState()
    started: bool = False

    @property
    def empty(self) -> bool:
        """Not started yet (or over): no flow caches."""
        return self.flow is None


class DitToken2Wav:
    """DiT flow + HiFT of a token2wav directory (``flow`` a :class:`DitFlowModel`, ``hift`` a
    :class:`HiFTGenerator`, float32 mel between them). Units: tokens at 25/s, mel at 50 frames/s,
    speech at 24 kHz float32 in ``[-0.99, 0.99]``."""

    def __init__(self, flow: DitFlowModel, hift: HiFTGenerator):
        self.flow = flow
        self.hift = hift
        self.mel_cache_len = MEL_CACHE_LEN
        self.source_cache_len = MEL_CACHE_LEN * hift.samples_per_frame

    @property
    def sample_rate(self) -> int:
        return self.hift.cfg.sampling_rate

    @property
    def hift_device(self) -> torch.device:
        return next(self.hift.parameters()).device

    def prompt(self, prompt_tokens: torch.Tensor, prompt_mel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens [P], mel [2P, 80])``: the prompt as the flow needs it (see :func:`align_prompt`)."""
        t = prompt_tokens.reshape(-1)
        return t, align_prompt(t, prompt_mel.reshape(-1, prompt_mel.shape[-1]), self.flow.up_rate)

    @torch.inference_mode()
    def offline_batch(self, requests: Sequence[tuple], generators: Sequence[torch.Generator | None] | None = None):
        """Offline speech for ``(tokens [N], prompt_tokens [P], prompt_mel [F, 80], embedding [192])``
        requests (one flow batch, one HiFT batch): ``[speech [1, 480 * 2N]]`` float32."""
        reqs = []
        for tok, pt, pm, emb in requests:
            pt, pm = self.prompt(pt, pm)
            reqs.append((tok.reshape(-1), pt, pm, emb.reshape(-1)))
        mels = self.flow.inference_batch(reqs)
        dev = self.hift_device
        speech, _ = self.hift.inference_batch([m.to(dev) for m in mels], None, generators)
        return speech

    def offline(self, tokens, prompt_tokens, prompt_mel, embedding, generator=None) -> torch.Tensor:
        """Offline speech ``[1, 480 * 2N]`` for ``tokens`` ``[N]`` (``Token2wav.__call__``)."""
        return self.offline_batch([(tokens, prompt_tokens, prompt_mel, embedding)], [generator])[0]

    def stream_setup_batch(self, prompts: Sequence[tuple]) -> list[DitT2WStreamState]:
        """:meth:`stream_setup` for several ``(prompt_tokens, prompt_mel, embedding)`` in one pass."""
        states = self.flow.setup_batch([(*self.prompt(pt, pm), emb.reshape(-1)) for pt, pm, emb in prompts])
        return [DitT2WStreamState(flow=s) for s in states]

    def stream_setup(self, prompt_tokens, prompt_mel, embedding) -> DitT2WStreamState:
        """Start a stream (``Token2wav.set_stream_cache``): flow caches of the prompt, empty HiFT cache."""
        return self.stream_setup_batch([(prompt_tokens, prompt_mel, embedding)])[0]

    def stream_step_batch(self, states: Sequence[DitT2WStreamState], tokens: Sequence[torch.Tensor],
                          last: Sequence[bool], generators: Sequence[torch.Generator | None] | None = None):
        """One ``Token2wav.stream`` call per stream, batched: ``[(speech [1, n], new_state)]``.

        ``tokens[b]`` are stream b's new tokens (a non-final chunk ends with the 3 look-ahead tokens,
        which the next chunk sends again). See the module docstring for the audio arithmetic.
        """
        flows = self.flow.chunk_batch([s.flow for s in states], tokens, last)
        dev = self.hift_device
        out = hift_stream_step_batch(self.hift, [s.hift for s in states], [m if m.device == dev else m.to(dev)
                                                                          for m, _ in flows], list(last),
                                     generators, self.mel_cache_len, self.source_cache_len)
        res = []
        for st, lf, (_, fs), (speech, hs) in zip(states, last, flows, out):
            if not lf and not st.started:
                speech = torch.cat([speech.new_zeros(1, self.source_cache_len), speech], dim=1)
            res.append((speech, DitT2WStreamState(flow=fs, hift=hs, started=True)))
        return res

    def stream_step(self, state: DitT2WStreamState, tokens: torch.Tensor, last: bool,
                    generator: torch.Generator | None = None) -> tuple[torch.Tensor, DitT2WStreamState]:
        """One streaming call (``Token2wav.stream(tokens, last_chunk)``) -> ``(speech [1, n], new state)``."""
        return self.stream_step_batch([state], [tokens], [last], [generator])[0]


# ----------------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------------


def open_token2wav_dir(path: str | Path) -> Path:
    """Check a token2wav directory; return its resolved path.

    Needs ``flow.yaml``, ``flow.pt``, ``hift.pt``, ``campplus.onnx`` and ``speech_tokenizer_v2_25hz.onnx``
    (a random-weights directory, :data:`RANDOM_T2W_MARKER`, no ``.pt`` files). Raises
    :class:`ModelDirError` listing every missing file.
    """
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ModelDirError(f"token2wav directory {root} does not exist or is not a directory")
    files = [FLOW_YAML, CAMPPLUS_FILE, SPEECH_TOKENIZER_FILE]
    if not (root / RANDOM_T2W_MARKER).is_file():
        files += [FLOW_FILE, HIFT_FILE]
    missing = [f for f in files if not (root / f).is_file()]
    if missing:
        raise ModelDirError(f"{root} is not a complete Step-Audio2 token2wav directory: missing {', '.join(missing)}")
    return root.resolve()


def hift_config_from_state_dict(sd: dict, source: str) -> HiFTConfig:
    """Step-Audio2 HiFT sizes from a (prefix-stripped, normalised) ``hift.pt``: ``base_channels`` =
    rows of ``conv_pre``, F0 ``cond_channels`` = rows of ``f0_predictor.condnet.0``; everything else
    the constructor defaults. Raises :class:`CheckpointError` if those tensors are missing."""
    def rows(prefix: str) -> int:
        for k in (f"{prefix}.parametrizations.weight.original1", f"{prefix}.weight"):
            if k in sd:
                return int(sd[k].shape[0])
        raise CheckpointError(f"{source}: no {prefix} weight; not a HiFT checkpoint")
    return stepaudio2_hift_config(rows("conv_pre"), rows("f0_predictor.condnet.0"))


def _random_seed(root: Path) -> int | None:
    p = root / RANDOM_T2W_MARKER
    if not p.is_file():
        return None
    return int(json.loads(p.read_text(encoding="utf-8")).get("seed", 0))


def build_random_dit_token2wav(cfg: DitFlowConfig, hift_cfg: HiFTConfig, device="cpu", dtype=torch.float32,
                               seed: int = 0, fold_weight_norm: bool = True) -> DitToken2Wav:
    """Random-weight DiT flow + HiFT (default initialisations under ``seed`` on a forked RNG).

    The DiT's adaLN and output layers are *not* zero-initialised (upstream's training init would make
    the random model output constant), so benchmarks exercise every kernel with non-trivial values.
    """
    devices = [torch.device(device)] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        with torch.device(device):
            flow = DitFlowModel(cfg)
            hift = HiFTGenerator(hift_cfg)
    if fold_weight_norm:
        hift.remove_weight_norm()
    return DitToken2Wav(flow.to(dtype=dtype).eval(), hift.to(device).eval())


def load_dit_token2wav(path: str | Path, device="cpu", dtype=torch.float32, noise_seed: int | None = None) -> DitToken2Wav:
    """Load a token2wav directory (strict: keys and shapes checked, errors name the file).

    ``dtype`` applies to the flow; HiFT stays float32 (as the CosyVoice2 path). ``noise_seed``
    overrides the CFM noise seed (:class:`~cosyserve.models.config.DitFlowConfig`). A random-weights
    directory builds the networks from ``flow.yaml`` (released HiFT size unless the marker says
    otherwise). Raises :class:`ModelDirError` / :class:`CheckpointError` / ``ConfigError``.
    """
    root = open_token2wav_dir(path)
    cfg = load_dit_flow_config(root / FLOW_YAML)
    if noise_seed is not None:
        cfg = replace(cfg, noise_seed=int(noise_seed))
    seed = _random_seed(root)
    if seed is not None:
        meta = json.loads((root / RANDOM_T2W_MARKER).read_text(encoding="utf-8"))
        hcfg = stepaudio2_hift_config(int(meta.get("hift_channels", 512)), int(meta.get("hift_f0_channels", 512)))
        return build_random_dit_token2wav(cfg, hcfg, device, dtype, seed)
    flow = DitFlowModel(cfg)
    load_strict(flow, read_state_dict(root / FLOW_FILE), str(root / FLOW_FILE))
    sd = normalize_weight_norm_keys(read_state_dict(root / HIFT_FILE), strip_prefix="generator.")
    hift = HiFTGenerator(hift_config_from_state_dict(sd, str(root / HIFT_FILE)))
    load_strict(hift, sd, str(root / HIFT_FILE))
    hift.remove_weight_norm()
    return DitToken2Wav(flow.to(device=device, dtype=dtype).eval(), hift.to(device).eval())


def write_token2wav_dir(out_dir: str | Path, size: DitT2WSize = TINY_SIZE, seed: int = 0, weights: bool = True,
                        force: bool = False) -> Path:
    """Write a random-weight token2wav directory (the audio is noise).

    ``flow.yaml`` at ``size``, the ONNX stand-ins of the demo model (CAM++ and S3Tokenizer v2 inputs
    and outputs) under the token2wav file names, and either ``flow.pt`` + ``hift.pt`` (``weights``;
    HiFT keys prefixed ``generator.`` as released) or a marker that makes the loader build the
    networks at load time (for the full size: no 500 MB of random files). Existing directories are
    kept unless ``force``. Raises OSError on write failures.
    """
    import onnx

    from .demo import DEMO_MARKER, campplus_standin, speech_tokenizer_standin

    out = Path(out_dir).expanduser()
    if (out / FLOW_YAML).is_file() and not force:
        open_token2wav_dir(out)
        return out
    out.mkdir(parents=True, exist_ok=True)
    what = "random weights" + (", full size" if size == FULL_SIZE else "")
    (out / FLOW_YAML).write_text(dit_flow_yaml(size, what), encoding="utf-8")
    onnx.save(campplus_standin(seed), str(out / CAMPPLUS_FILE))
    onnx.save(speech_tokenizer_standin(seed + 1), str(out / SPEECH_TOKENIZER_FILE))
    if weights:
        for f in (RANDOM_T2W_MARKER,):
            (out / f).unlink(missing_ok=True)
        t2w = build_random_dit_token2wav(load_dit_flow_config(out / FLOW_YAML),
                                         stepaudio2_hift_config(size.hift_channels, size.hift_f0_channels),
                                         seed=seed, fold_weight_norm=False)
        torch.save(t2w.flow.state_dict(), out / FLOW_FILE)
        torch.save({f"generator.{k}": v for k, v in t2w.hift.state_dict().items()}, out / HIFT_FILE)
    else:
        (out / RANDOM_T2W_MARKER).write_text(json.dumps({
            "seed": seed, "hift_channels": size.hift_channels, "hift_f0_channels": size.hift_f0_channels}) + "\n")
    (out / DEMO_MARKER).write_text("Step-Audio2 token2wav directory with RANDOM weights and stand-in ONNX files: "
                                   "the audio is noise.\n")
    return out

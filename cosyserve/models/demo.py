"""The demo model: an official-layout model directory with RANDOM weights.

Real CosyVoice2 weights cannot be shipped or downloaded here, yet everything (CLI,
server, tests, ``make demo``) must run on a fresh machine. ``cosyserve demo-model DIR``
writes a directory in the exact official layout, with the real architecture at a small
size and fixed-seed random weights:

* ``cosyvoice2.yaml`` in the official HyperPyYAML form (same classes and keys as the
  real file, small dimensions), loadable by upstream CosyVoice too;
* ``llm.pt`` / ``flow.pt`` / ``hift.pt`` state dicts with the official key spellings;
* ``CosyVoice-BlankEN/``: the real tokenizer files (shipped in ``cosyserve/assets``) and a
  small Qwen2 ``config.json``;
* ``campplus.onnx`` and ``speech_tokenizer_v2.onnx``: STAND-INS with the real inputs and
  outputs (CAM++: fbank ``[1, T, 80]`` -> ``[1, 192]``; S3Tokenizer v2: whisper log-mel
  ``[1, 128, T]`` + length ``[1]`` -> int64 tokens ``[1, ceil(T/4)]`` in ``[0, 6561)``),
  computing simple fixed random functions of their input.

``write_demo_model(..., family="cosyvoice3")`` (``cosyserve demo-model --cosyvoice3``) writes
the CosyVoice3 layout instead: ``cosyvoice3.yaml`` (``CosyVoice3LM``,
``CausalMaskedDiffWithDiT`` with ``PreLookaheadLayer`` + DiT, ``CausalHiFTGenerator``; small
dimensions) and ``speech_tokenizer_v3.onnx`` (the same stand-in function).

**Its output is noise.** It proves the plumbing, shapes, latency and streaming; it says
nothing about speech quality. Every command that uses it says so.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from .loader import RANDOM_WEIGHTS_MARKER

DEMO_MARKER = "DEMO_MODEL_RANDOM_WEIGHTS.txt"
DEMO_WARNING = "demo model with RANDOM weights: the audio is noise, not speech"


@dataclass(frozen=True)
class DemoSize:
    """Dimensions of the demo model (the real model's are in the docstrings' brackets)."""

    llm_hidden: int = 64          # [896]
    llm_layers: int = 2           # [24]
    llm_heads: int = 4            # [14]
    llm_kv_heads: int = 2         # [2]
    llm_intermediate: int = 192   # [4864]
    flow_dim: int = 64            # [512]
    flow_heads: int = 2           # [8]
    flow_blocks: int = 2          # [6]
    flow_linear: int = 128        # [2048]
    dec_channels: int = 64        # [256]
    dec_head_dim: int = 32        # [64]
    dec_heads: int = 2            # [8]
    dec_blocks: int = 1           # [4]
    dec_mid_blocks: int = 2       # [12]
    hift_channels: int = 64       # [512]
    # CosyVoice3 (Fun-CosyVoice3-0.5B) flow: pre-look-ahead layer and DiT estimator
    pre_lookahead_channels: int = 64  # [1024]
    dit_dim: int = 64             # [1024]
    dit_depth: int = 2            # [22]
    dit_heads: int = 2            # [16]
    dit_dim_head: int = 32        # [64]


_YAML = """\
# cosyserve DEMO MODEL: random weights, small dimensions. The audio it makes is noise.
# Same structure, classes and keys as the official CosyVoice2-0.5B cosyvoice2.yaml.
__set_seed1: !apply:random.seed [1986]
__set_seed2: !apply:numpy.random.seed [1986]
__set_seed3: !apply:torch.manual_seed [1986]
__set_seed4: !apply:torch.cuda.manual_seed_all [1986]

sample_rate: 24000
llm_input_size: {llm_hidden}
llm_output_size: {llm_hidden}
spk_embed_dim: 192
qwen_pretrain_path: ''
token_frame_rate: 25
token_mel_ratio: 2

chunk_size: 25
num_decoding_left_chunks: -1

llm: !new:cosyvoice.llm.llm.Qwen2LM
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: 6561
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: 0.8
        top_k: 25
        win_size: 10
        tau_r: 0.1

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec
    input_size: {flow_dim}
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: 6561
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
    encoder: !new:cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder
        output_size: {flow_dim}
        attention_heads: {flow_heads}
        linear_units: {flow_linear}
        num_blocks: {flow_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        input_size: {flow_dim}
        use_cnn_module: False
        macaron_style: False
        static_chunk_size: !ref <chunk_size>
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: 80
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: 1e-06
                solver: 'euler'
                t_scheduler: 'cosine'
                training_cfg_rate: 0.2
                inference_cfg_rate: 0.7
                reg_loss_type: 'l1'
        estimator: !new:cosyvoice.flow.decoder.CausalConditionalDecoder
            in_channels: 320
            out_channels: 80
            channels: [{dec_channels}]
            dropout: 0.0
            attention_head_dim: {dec_head_dim}
            n_blocks: {dec_blocks}
            num_mid_blocks: {dec_mid_blocks}
            num_heads: {dec_heads}
            act_fn: 'gelu'
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.HiFTGenerator
    in_channels: 80
    base_channels: {hift_channels}
    nb_harmonics: 8
    sampling_rate: !ref <sample_rate>
    nsf_alpha: 0.1
    nsf_sigma: 0.003
    nsf_voiced_threshold: 10
    upsample_rates: [8, 5, 3]
    upsample_kernel_sizes: [16, 11, 7]
    istft_params:
        n_fft: 16
        hop_len: 4
    resblock_kernel_sizes: [3, 7, 11]
    resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    source_resblock_kernel_sizes: [7, 7, 11]
    source_resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    lrelu_slope: 0.1
    audio_limit: 0.99
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor
        num_class: 1
        in_channels: 80
        cond_channels: {hift_channels}

get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer
    token_path: !ref <qwen_pretrain_path>
    skip_special_tokens: True
allowed_special: 'all'
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: 8000
    center: False
"""


_YAML_CV3 = """\
# cosyserve DEMO MODEL: random weights, small dimensions. The audio it makes is noise.
# Same model sections, classes and keys as the official Fun-CosyVoice3-0.5B cosyvoice3.yaml.
__set_seed1: !apply:random.seed [1986]
__set_seed2: !apply:numpy.random.seed [1986]
__set_seed3: !apply:torch.manual_seed [1986]
__set_seed4: !apply:torch.cuda.manual_seed_all [1986]

sample_rate: 24000
llm_input_size: {llm_hidden}
llm_output_size: {llm_hidden}
spk_embed_dim: 192
qwen_pretrain_path: ''
token_frame_rate: 25
token_mel_ratio: 2

chunk_size: 25
num_decoding_left_chunks: -1

llm: !new:cosyvoice.llm.llm.CosyVoice3LM
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: 6561
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: 0.8
        top_k: 25
        win_size: 10
        tau_r: 0.1

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT
    input_size: 80
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: 6561
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
    pre_lookahead_layer: !new:cosyvoice.transformer.upsample_encoder.PreLookaheadLayer
        in_channels: 80
        channels: {pre_lookahead_channels}
        pre_lookahead_len: 3
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: 80
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: 1e-06
                solver: 'euler'
                t_scheduler: 'cosine'
                training_cfg_rate: 0.2
                inference_cfg_rate: 0.7
                reg_loss_type: 'l1'
        estimator: !new:cosyvoice.flow.DiT.dit.DiT
            dim: {dit_dim}
            depth: {dit_depth}
            heads: {dit_heads}
            dim_head: {dit_dim_head}
            ff_mult: 2
            mel_dim: 80
            mu_dim: 80
            spk_dim: 80
            out_channels: 80
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator
    in_channels: 80
    base_channels: {hift_channels}
    nb_harmonics: 8
    sampling_rate: !ref <sample_rate>
    nsf_alpha: 0.1
    nsf_sigma: 0.003
    nsf_voiced_threshold: 10
    upsample_rates: [8, 5, 3]
    upsample_kernel_sizes: [16, 11, 7]
    istft_params:
        n_fft: 16
        hop_len: 4
    resblock_kernel_sizes: [3, 7, 11]
    resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    source_resblock_kernel_sizes: [7, 7, 11]
    source_resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    lrelu_slope: 0.1
    audio_limit: 0.99
    conv_pre_look_right: 4
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor
        num_class: 1
        in_channels: 80
        cond_channels: {hift_channels}

get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer
    token_path: !ref <qwen_pretrain_path>
    skip_special_tokens: True
    version: cosyvoice3
allowed_special: 'all'
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: null
    center: False
"""

#: the demo yaml template, yaml file name and speech tokenizer file of each model family
_FAMILY_FILES = {
    "cosyvoice2": (_YAML, "cosyvoice2.yaml", "speech_tokenizer_v2.onnx"),
    "cosyvoice3": (_YAML_CV3, "cosyvoice3.yaml", "speech_tokenizer_v3.onnx"),
}


def _family_files(family: str) -> tuple[str, str, str]:
    if family not in _FAMILY_FILES:
        raise ValueError(f"unknown model family {family!r} (known: {', '.join(_FAMILY_FILES)})")
    return _FAMILY_FILES[family]


def demo_yaml(size: DemoSize = DemoSize(), family: str = "cosyvoice2") -> str:
    """The demo ``cosyvoice2.yaml`` (or, ``family="cosyvoice3"``, ``cosyvoice3.yaml``) text for ``size``."""
    return _family_files(family)[0].format(**size.__dict__)


def demo_qwen_config(size: DemoSize = DemoSize()) -> dict:
    """A Qwen2 ``config.json`` with the official fields and the demo dimensions."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "hidden_act": "silu",
        "hidden_size": size.llm_hidden,
        "initializer_range": 0.02,
        "intermediate_size": size.llm_intermediate,
        "max_position_embeddings": 32768,
        "max_window_layers": size.llm_layers,
        "model_type": "qwen2",
        "num_attention_heads": size.llm_heads,
        "num_hidden_layers": size.llm_layers,
        "num_key_value_heads": size.llm_kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }


# ---------------------------------------------------------------------------- ONNX stand-ins


def _finish(model):
    """Pin the IR version (opset 18 = IR 8) so older onnxruntime builds load the file; validate."""
    import onnx

    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def campplus_standin(seed: int = 0):
    """ONNX stand-in for CAM++: ``input`` float32 [1, T, 80] -> ``output`` float32 [1, 192].

    Computes the per-bin mean and root-mean-square over time (160 values) and a fixed
    random linear map to 192 dimensions.
    """
    from onnx import TensorProto, helper, numpy_helper

    w = (np.random.default_rng(seed).standard_normal((160, 192)) / np.sqrt(160)).astype(np.float32)
    nodes = [
        helper.make_node("ReduceMean", ["input", "axis1"], ["mean"], keepdims=0),
        helper.make_node("Mul", ["input", "input"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axis1"], ["msq"], keepdims=0),
        helper.make_node("Sqrt", ["msq"], ["rms"]),
        helper.make_node("Concat", ["mean", "rms"], ["stats"], axis=1),
        helper.make_node("MatMul", ["stats", "w"], ["output"]),
    ]
    graph = helper.make_graph(
        nodes, "campplus_standin",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, "T", 80])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 192])],
        initializer=[numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array([1], np.int64), "axis1")],
    )
    return _finish(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)],
                                     producer_name="cosyserve-demo (STAND-IN, not CAM++)"))


def speech_tokenizer_standin(seed: int = 1):
    """ONNX stand-in for S3Tokenizer v2.

    Inputs ``feats`` float32 [1, 128, T] (whisper log-mel, 100 frames/s) and
    ``feats_length`` int32 [1]; output ``indices`` int64 [1, ceil(T/4)] (25 tokens/s) in
    ``[0, 6561)``: every 4th frame is projected to 8 values, squashed with tanh, rounded to
    {-1, 0, 1} and read as 8 base-3 digits.
    """
    from onnx import TensorProto, helper, numpy_helper

    w = (np.random.default_rng(seed).standard_normal((128, 8)) * 0.3).astype(np.float32)
    powers = (3 ** np.arange(8)).astype(np.float32)
    init = [
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(powers, "powers"),
        numpy_helper.from_array(np.array([0], np.int64), "start"),
        numpy_helper.from_array(np.array([np.iinfo(np.int64).max], np.int64), "end"),
        numpy_helper.from_array(np.array([2], np.int64), "axes"),
        numpy_helper.from_array(np.array([4], np.int64), "steps"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        numpy_helper.from_array(np.array([-1], np.int64), "last"),
    ]
    nodes = [
        helper.make_node("Slice", ["feats", "start", "end", "axes", "steps"], ["sub"]),
        helper.make_node("Transpose", ["sub"], ["sub_t"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["sub_t", "w"], ["proj"]),
        helper.make_node("Tanh", ["proj"], ["sq"]),
        helper.make_node("Round", ["sq"], ["digits"]),
        helper.make_node("Add", ["digits", "one"], ["digits01"]),
        helper.make_node("Mul", ["digits01", "powers"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted", "last"], ["code"], keepdims=0),
        helper.make_node("Cast", ["code"], ["indices"], to=TensorProto.INT64),
    ]
    graph = helper.make_graph(
        nodes, "speech_tokenizer_v2_standin",
        [helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
         helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1])],
        [helper.make_tensor_value_info("indices", TensorProto.INT64, [1, "T4"])],
        initializer=init,
    )
    return _finish(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)],
                                     producer_name="cosyserve-demo (STAND-IN, not S3Tokenizer)"))


# ---------------------------------------------------------------------------- writer


def _asset(*parts: str) -> Path:
    return Path(str(resources.files("cosyserve").joinpath("assets", *parts)))


def shipped_prompt() -> tuple[Path, str]:
    """The prompt recording shipped with cosyserve (the demo and random-weight models' voice
    ``default``): ``(path of zero_shot_prompt.wav, its transcript)``."""
    wav = _asset("prompts", "zero_shot_prompt.wav")
    meta = json.loads(_asset("prompts", "transcripts.json").read_text(encoding="utf-8"))[wav.name]
    return wav, meta["transcript"]


def _write_shipped_tokenizer(out: Path) -> Path:
    """Copy the shipped BlankEN tokenizer files into ``out/CosyVoice-BlankEN/`` (created, with its
    parents); returns that folder (the caller adds its ``config.json``). Raises OSError."""
    qdir = out / "CosyVoice-BlankEN"
    qdir.mkdir(parents=True, exist_ok=True)
    for f in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        shutil.copyfile(_asset("blanken", f), qdir / f)
    return qdir


def _write_standins(out: Path, seed: int, tokenizer_file: str) -> None:
    """Write the two ONNX stand-ins into ``out``: ``campplus.onnx`` (seed ``seed``) and the speech
    tokenizer ``tokenizer_file`` (seed ``seed + 1``). Raises OSError."""
    import onnx

    onnx.save(campplus_standin(seed), str(out / "campplus.onnx"))
    onnx.save(speech_tokenizer_standin(seed + 1), str(out / tokenizer_file))


def write_demo_model(out_dir: str | Path, seed: int = 0, size: DemoSize = DemoSize(), force: bool = False,
                     family: str = "cosyvoice2") -> Path:
    """Write the demo model directory (see module docstring); returns its path.

    ``family``: ``"cosyvoice2"`` or ``"cosyvoice3"`` (its yaml, classes and speech tokenizer
    file). Existing files are kept unless ``force``; a directory that already holds a complete
    demo model of that family is returned as is. Raises ValueError for an unknown family and
    :class:`~cosyserve.errors.ModelDirError` if this build cannot build a part of the family.
    """
    from .loader import build_random

    template, yaml_name, tokenizer_file = _family_files(family)
    out = Path(out_dir).expanduser()
    if (out / DEMO_MARKER).is_file() and (out / "llm.pt").is_file() and (out / yaml_name).is_file() and not force:
        return out
    out.mkdir(parents=True, exist_ok=True)
    qdir = _write_shipped_tokenizer(out)
    (qdir / "config.json").write_text(json.dumps(demo_qwen_config(size), indent=2) + "\n")
    for other, (_, name, _) in _FAMILY_FILES.items():  # one family's yaml only (the loader refuses both)
        if other != family and (out / name).is_file():
            (out / name).unlink()
    (out / yaml_name).write_text(template.format(**size.__dict__))

    models = build_random(out / yaml_name, seed=seed, fold_weight_norm=False)
    torch.save(models.llm.state_dict(), out / "llm.pt")
    torch.save(models.flow.state_dict(), out / "flow.pt")
    torch.save(models.hift.state_dict(), out / "hift.pt")
    _write_standins(out, seed, tokenizer_file)
    official = "Fun-CosyVoice3-0.5B" if family == "cosyvoice3" else "CosyVoice2-0.5B"
    arch = "CosyVoice3" if family == "cosyvoice3" else "CosyVoice2"
    (out / DEMO_MARKER).write_text(
        f"This is a cosyserve DEMO model: the real {arch} architecture at a small size with fixed-seed\n"
        f"RANDOM weights, and stand-in ONNX files. Its audio is noise. Use the official {official}\n"
        "directory for real speech.\n"
    )
    return out


def is_demo_model(model_dir: str | Path) -> bool:
    return (Path(model_dir) / DEMO_MARKER).is_file()


def is_random_weights_dir(model_dir: str | Path) -> bool:
    """True for a directory written by :func:`write_frontend_dir` (networks built at load time)."""
    return (Path(model_dir) / RANDOM_WEIGHTS_MARKER).is_file()


def random_weights_seed(model_dir: str | Path) -> int:
    """The weight seed recorded in a random-weights directory."""
    return int(json.loads((Path(model_dir) / RANDOM_WEIGHTS_MARKER).read_text())["seed"])


def write_frontend_dir(yaml_path: str | Path, qwen_config_path: str | Path, out_dir: str | Path,
                       seed: int = 0, full_size_frontend: bool = False) -> Path:
    """A model directory for RANDOM-weight runs of a real-size yaml, without weight files.

    Writes ``cosyvoice2.yaml`` or ``cosyvoice3.yaml`` (copied; the family is that of the yaml's
    LM class), ``CosyVoice-BlankEN/`` (the shipped tokenizer +
    ``qwen_config_path``), the two ONNX stand-ins and a marker; loading such a directory
    (:class:`cosyserve.engine.pipeline.Synthesizer`) builds the networks with
    :func:`cosyserve.models.loader.build_random` at the yaml's dimensions (weight seed
    ``seed``). Used by ``cosyserve serve/bench/batch --random-weights`` and the GPU
    benchmarks (the audio is noise). With ``full_size_frontend`` the two ONNX files are
    full-size random-weight models instead of stand-ins (:mod:`cosyserve.models.random_frontend`:
    the S3 tokenizer v2 structure, which the frontend runs in PyTorch on CUDA, and a CAM++-like D-TDNN),
    so per-request prompts cost what the real files cost. Raises OSError when a file cannot be
    read or written.
    """
    from .config import detect_family, load_hyperpyyaml

    _, yaml_name, tokenizer_file = _family_files(detect_family(load_hyperpyyaml(yaml_path)))
    out = Path(out_dir).expanduser()
    qdir = _write_shipped_tokenizer(out)
    shutil.copyfile(qwen_config_path, qdir / "config.json")
    shutil.copyfile(yaml_path, out / yaml_name)
    if full_size_frontend:
        from ..errors import ModelDirError
        from .random_frontend import S3_TOKENIZER_FILE, write_full_size_frontend

        if tokenizer_file != S3_TOKENIZER_FILE:
            raise ModelDirError(f"--full-size-frontend builds {S3_TOKENIZER_FILE} (the S3 tokenizer v2 of "
                                f"CosyVoice2); this yaml needs {tokenizer_file}")

        write_full_size_frontend(out, seed)
    else:
        _write_standins(out, seed, tokenizer_file)
    (out / DEMO_MARKER).write_text("RANDOM-weight benchmark directory (no weight files): the audio is noise.\n")
    (out / RANDOM_WEIGHTS_MARKER).write_text(json.dumps({"seed": seed, "yaml": str(yaml_path)}) + "\n")
    return out


def prepare_random_weights_dir(yaml_path: str | Path, qwen_config_path: str | Path | None, cache_dir: str | Path,
                               seed: int = 0, full_size_frontend: bool = False) -> Path:
    """:func:`write_frontend_dir` into ``cache_dir/random-<hash>`` (reused while the yaml and
    the Qwen2 config are unchanged); ``full_size_frontend``: see :func:`write_frontend_dir`
    (a directory of its own).

    ``qwen_config_path`` defaults to ``<yaml dir>/CosyVoice-BlankEN/config.json`` (the
    official layout). Raises :class:`~cosyserve.errors.ModelDirError` naming a missing file.
    """
    import hashlib

    from ..errors import ModelDirError

    yaml_path = Path(yaml_path).expanduser()
    if not yaml_path.is_file():
        raise ModelDirError(f"--random-weights: {yaml_path} is not a file (give the model's cosyvoice2.yaml "
                            "or cosyvoice3.yaml)")
    if qwen_config_path is None:
        qwen_config_path = yaml_path.parent / "CosyVoice-BlankEN" / "config.json"
        if not Path(qwen_config_path).is_file():
            raise ModelDirError(f"--random-weights: no Qwen2 config at {qwen_config_path}; pass --qwen-config "
                                "(the model's CosyVoice-BlankEN/config.json)")
    qwen_config_path = Path(qwen_config_path).expanduser()
    if not qwen_config_path.is_file():
        raise ModelDirError(f"--qwen-config: {qwen_config_path} is not a file")
    h = hashlib.sha256(yaml_path.read_bytes() + b"\0" + qwen_config_path.read_bytes() + f"\0{seed}".encode())
    tag = "-full-frontend" if full_size_frontend else ""
    out = Path(cache_dir).expanduser() / f"random-{h.hexdigest()[:16]}{tag}"
    if is_random_weights_dir(out) and (out / "campplus.onnx").is_file():
        return out
    return write_frontend_dir(yaml_path, qwen_config_path, out, seed=seed, full_size_frontend=full_size_frontend)

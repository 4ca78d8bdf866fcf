"""Read ``cosyvoice2.yaml`` / ``cosyvoice3.yaml`` as data and turn it into typed model configurations.

The official model directory describes its modules with HyperPyYAML tags
(``!new:cosyvoice.llm.llm.Qwen2LM``, ``!name:...``, ``!apply:...``, ``!ref <key>``).
Upstream executes those tags (importing and instantiating classes). cosyserve never
does: the tags are parsed into inert :class:`Tagged` / :class:`Ref` objects, references
are resolved (including arithmetic such as ``!ref <chunk_size> * <token_mel_ratio>``)
with a tiny expression evaluator that only accepts numbers and ``+ - * / // %``, and
the values are copied into frozen dataclasses. Every dimension used by
:mod:`cosyserve.models` comes from these dataclasses.

Class names are checked against the architecture cosyserve implements, per model family
(:data:`MODEL_FAMILIES`). CosyVoice2: ``Qwen2LM``, ``CausalMaskedDiffWithXvec``,
``UpsampleConformerEncoder``, ``CausalConditionalCFM``, ``CausalConditionalDecoder``,
``HiFTGenerator``, ``ConvRNNF0Predictor``. CosyVoice3 (Fun-CosyVoice3-0.5B): ``CosyVoice3LM``,
``CausalMaskedDiffWithDiT`` and ``CausalHiFTGenerator`` (their inner classes are checked by the
flow/HiFT parsers). A yaml's family is that of its ``llm`` class (and of its file name when it
is the official ``cosyvoice2.yaml`` / ``cosyvoice3.yaml``); the other classes must belong to the
same family. Anything else fails with :class:`~cosyserve.errors.ConfigError` naming the yaml key
and the class found.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError

# --------------------------------------------------------------------------------------
# HyperPyYAML as inert data
# --------------------------------------------------------------------------------------


@dataclass
class Tagged:
    """A ``!new:`` / ``!name:`` / ``!apply:`` node: what upstream would call, not called.

    ``kind`` is ``"new"``, ``"name"`` or ``"apply"``; ``target`` the dotted import path;
    ``args`` the mapping (keyword arguments) or sequence (positional arguments) below it.
    """

    kind: str
    target: str
    args: Any = None

    @property
    def class_name(self) -> str:
        return self.target.rsplit(".", 1)[-1]

    def kwargs(self) -> dict:
        if self.args is None:
            return {}
        if not isinstance(self.args, dict):
            raise ConfigError(f"!{self.kind}:{self.target} has positional arguments; keyword arguments expected")
        return self.args


@dataclass
class Ref:
    """A ``!ref`` node, e.g. ``<chunk_size> * <token_mel_ratio>``, resolved after loading."""

    expr: str


class _Loader(yaml.SafeLoader):
    pass


def _construct_tagged(kind: str):
    def construct(loader: yaml.Loader, suffix: str, node: yaml.Node) -> Tagged:
        if isinstance(node, yaml.MappingNode):
            args = loader.construct_mapping(node, deep=True)
        elif isinstance(node, yaml.SequenceNode):
            args = loader.construct_sequence(node, deep=True)
        else:
            value = loader.construct_scalar(node)
            args = None if value in ("", None) else value
        return Tagged(kind, suffix, args)

    return construct


def _construct_ref(loader: yaml.Loader, node: yaml.Node) -> Ref:
    return Ref(str(loader.construct_scalar(node)))


for _kind in ("new", "name", "apply"):
    _Loader.add_multi_constructor(f"!{_kind}:", _construct_tagged(_kind))
_Loader.add_constructor("!ref", _construct_ref)

_REF_RE = re.compile(r"<([^<>]+)>")
_BIN_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def _eval_arith(expr: str) -> int | float:
    """Evaluate ``expr`` containing only numbers, parentheses and + - * / // %."""

    def ev(n: ast.AST):
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)) and not isinstance(n.value, bool):
            return n.value
        if isinstance(n, ast.BinOp) and type(n.op) in _BIN_OPS:
            return _BIN_OPS[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd)):
            v = ev(n.operand)
            return -v if isinstance(n.op, ast.USub) else v
        raise ConfigError(f"unsupported expression in !ref: {expr!r}")

    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise ConfigError(f"cannot parse !ref expression {expr!r}") from exc
    return ev(tree)


def _lookup(root: dict, name: str, stack: tuple) -> Any:
    cur: Any = root
    for part in re.split(r"[.\[\]]+", name.strip()):
        if not part:
            continue
        if not isinstance(cur, dict) or part not in cur:
            raise ConfigError(f"!ref <{name}> points to a key that does not exist")
        cur = cur[part]
    return _resolve(cur, root, stack + (name,))


def _resolve(value: Any, root: dict, stack: tuple = ()) -> Any:
    if isinstance(value, Ref):
        names = _REF_RE.findall(value.expr)
        for n in names:
            if n in stack:
                raise ConfigError(f"circular !ref through <{n}>")
        if len(names) == 1 and value.expr.strip() == f"<{names[0]}>":
            return _lookup(root, names[0], stack)
        text = value.expr
        for n in names:
            v = _lookup(root, n, stack)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise ConfigError(f"!ref {value.expr!r}: <{n}> is not a number")
            text = text.replace(f"<{n}>", repr(v))
        return _eval_arith(text)
    if isinstance(value, Tagged):
        return Tagged(value.kind, value.target, _resolve(value.args, root, stack))
    if isinstance(value, dict):
        return {k: _resolve(v, root, stack) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, root, stack) for v in value]
    return value


def load_hyperpyyaml(path: str | Path) -> dict:
    """Parse a HyperPyYAML file into plain data with :class:`Tagged` nodes; resolve refs.

    Nothing is imported or executed. Raises :class:`ConfigError` on unreadable YAML.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from exc
    try:
        raw = yaml.load(text, Loader=_Loader)  # noqa: S506 - custom SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return _resolve(raw, raw)


# --------------------------------------------------------------------------------------
# Typed configuration
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingConfig:
    """Repetition-aware sampling (VALL-E 2, as upstream ``ras_sampling``)."""

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1


#: Model families: the yaml file name of the official directory and the top-level classes.
MODEL_FAMILIES: dict[str, dict[str, str]] = {
    "cosyvoice2": {"yaml": "cosyvoice2.yaml", "llm": "Qwen2LM", "flow": "CausalMaskedDiffWithXvec",
                   "hift": "HiFTGenerator"},
    "cosyvoice3": {"yaml": "cosyvoice3.yaml", "llm": "CosyVoice3LM", "flow": "CausalMaskedDiffWithDiT",
                   "hift": "CausalHiFTGenerator"},
}

#: CosyVoice3's "FSQ silent and breath" speech tokens (upstream ``CosyVoice3Model.silent_tokens``):
#: ``llm_job`` passes at most :data:`MAX_SILENT_TOKENS` of them in a row on to token2wav.
COSYVOICE3_SILENT_TOKENS: tuple[int, ...] = (1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323)
#: upstream ``llm_job``'s ``max_silent_token_num`` (CosyVoice2Model and CosyVoice3Model).
MAX_SILENT_TOKENS = 5


@dataclass(frozen=True)
class LLMConfig:
    """Speech LM: Qwen2 backbone + the CosyVoice heads of ``lm_class``.

    ``qwen`` is the dict of ``CosyVoice-BlankEN/config.json``. Speech-token ids ``0 ..
    speech_token_size-1`` (``S``) are speech tokens; the ids after them follow the upstream
    class's rules (``cosyvoice/llm/llm.py``):

    ==================  ===========================  =====================================
    property            ``Qwen2LM`` (CosyVoice2)      ``CosyVoice3LM``
    ==================  ===========================  =====================================
    extra ids           3                            200
    ``eos_token``       ``S``                        ``S + 1``
    ``fill_token``      ``S + 2``                    ``S + 3``
    sos / task id       ``llm_embedding`` rows 0, 1  ``speech_embedding`` rows ``S``, ``S + 2``
    ``stop_token_ids``  ``S .. S+2``                 ``S .. S+199``
    ``llm_decoder``     with bias                    without bias
    ==================  ===========================  =====================================

    Both classes mask id ``S`` (:attr:`min_len_mask_id`) during the first ``min_len`` steps
    (``sampling_ids``: ``weighted_scores[speech_token_size] = -inf``; for CosyVoice3 that is the
    sos id, not eos — an upstream quirk kept for parity).
    """

    llm_input_size: int
    llm_output_size: int
    speech_token_size: int
    sampling: SamplingConfig
    qwen: dict = field(default_factory=dict, compare=False, hash=False)
    #: the upstream class (``Qwen2LM`` or ``CosyVoice3LM``)
    lm_class: str = "Qwen2LM"

    @property
    def is_cosyvoice3(self) -> bool:
        return self.lm_class == "CosyVoice3LM"

    @property
    def num_extra_ids(self) -> int:
        """Ids after the speech tokens (``speech_embedding`` rows / ``llm_decoder`` outputs)."""
        return 200 if self.is_cosyvoice3 else 3

    @property
    def eos_token(self) -> int:
        return self.speech_token_size + (1 if self.is_cosyvoice3 else 0)

    @property
    def fill_token(self) -> int:
        return self.speech_token_size + (3 if self.is_cosyvoice3 else 2)

    @property
    def sos_token(self) -> int | None:
        """``speech_embedding`` row of the start-of-sequence input (CosyVoice3), else None
        (CosyVoice2 uses ``llm_embedding`` row 0)."""
        return self.speech_token_size if self.is_cosyvoice3 else None

    @property
    def task_id_token(self) -> int | None:
        """``speech_embedding`` row of the task-id input (CosyVoice3), else None
        (CosyVoice2 uses ``llm_embedding`` row 1)."""
        return self.speech_token_size + 2 if self.is_cosyvoice3 else None

    @property
    def has_llm_embedding(self) -> bool:
        """Whether the LM has the 2-row ``llm_embedding`` table (sos, task id): CosyVoice2 only."""
        return not self.is_cosyvoice3

    @property
    def decoder_bias(self) -> bool:
        return not self.is_cosyvoice3

    @property
    def min_len_mask_id(self) -> int:
        """The id masked while fewer than ``min_len`` tokens were decoded (upstream masks index
        ``speech_token_size``: CosyVoice2's eos, CosyVoice3's sos)."""
        return self.speech_token_size

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return tuple(self.speech_token_size + i for i in range(self.num_extra_ids))

    @property
    def num_speech_rows(self) -> int:
        """Rows of ``speech_embedding`` and outputs of ``llm_decoder`` (speech tokens + extra ids)."""
        return self.speech_token_size + self.num_extra_ids

    @property
    def silent_tokens(self) -> tuple[int, ...]:
        """Speech tokens of which at most :attr:`max_silent_tokens` in a row reach token2wav
        (upstream ``llm_job``; the LM's own history keeps them). Empty for CosyVoice2."""
        return COSYVOICE3_SILENT_TOKENS if self.is_cosyvoice3 else ()

    @property
    def max_silent_tokens(self) -> int:
        return MAX_SILENT_TOKENS

    @property
    def requires_endofprompt(self) -> bool:
        """CosyVoice3's LM input must contain ``<|endofprompt|>`` (upstream asserts it)."""
        return self.is_cosyvoice3

    @property
    def text_vocab_size(self) -> int:
        return int(self.qwen["vocab_size"])


@dataclass(frozen=True)
class EncoderConfig:
    """``UpsampleConformerEncoder``: conformer blocks, 2x upsampling, conformer blocks."""

    input_size: int
    output_size: int
    attention_heads: int
    linear_units: int
    num_blocks: int
    num_up_blocks: int
    static_chunk_size: int
    pre_lookahead_len: int
    upsample_stride: int
    activation: str = "swish"
    key_bias: bool = True
    pos_enc_max_len: int = 5000


@dataclass(frozen=True)
class EstimatorConfig:
    """``CausalConditionalDecoder``: the 1-D UNet velocity estimator of the CFM."""

    in_channels: int
    out_channels: int
    channels: tuple[int, ...]
    attention_head_dim: int
    n_blocks: int
    num_mid_blocks: int
    num_heads: int
    act_fn: str
    static_chunk_size: int
    num_decoding_left_chunks: int


@dataclass(frozen=True)
class CFMConfig:
    """``CausalConditionalCFM``: Euler solver settings and classifier-free guidance."""

    in_channels: int
    n_spks: int
    spk_emb_dim: int
    sigma_min: float
    t_scheduler: str
    inference_cfg_rate: float
    n_timesteps: int = 10  # upstream CausalMaskedDiffWithXvec.inference hard-codes 10
    noise_frames: int = 15000  # rand_noise buffer [1, mel, 50 * 300]
    noise_seed: int = 0


@dataclass(frozen=True)
class FlowConfig:
    """``CausalMaskedDiffWithXvec``: speech tokens -> 80-bin log-mel at 50 frames/s."""

    input_size: int
    output_size: int
    spk_embed_dim: int
    vocab_size: int
    token_mel_ratio: int
    pre_lookahead_len: int
    input_frame_rate: int
    encoder: EncoderConfig
    cfm: CFMConfig
    estimator: EstimatorConfig


@dataclass(frozen=True)
class HiFTConfig:
    """``HiFTGenerator`` + ``ConvRNNF0Predictor``: 80-bin mel -> waveform."""

    in_channels: int
    base_channels: int
    nb_harmonics: int
    sampling_rate: int
    nsf_alpha: float
    nsf_sigma: float
    nsf_voiced_threshold: float
    upsample_rates: tuple[int, ...]
    upsample_kernel_sizes: tuple[int, ...]
    istft_n_fft: int
    istft_hop_len: int
    resblock_kernel_sizes: tuple[int, ...]
    resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    source_resblock_kernel_sizes: tuple[int, ...]
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    lrelu_slope: float
    audio_limit: float
    f0_num_class: int
    f0_in_channels: int
    f0_cond_channels: int
    # ---- causal variant (CosyVoice3 ``CausalHiFTGenerator`` + ``CausalConvRNNF0Predictor``);
    # the defaults describe CosyVoice2's non-causal HiFT (parse with hift.parse_causal_hift)
    causal: bool = False
    #: right-context mel frames of ``conv_pre`` (kernel ``conv_pre_look_right + 1``); causal only
    conv_pre_look_right: int = 0
    #: random draws made from the construction generator before the source module's noise
    #: (``(kind, shape)`` with kind ``randn`` / ``embedding`` / ``linear`` / ``conv1d``), in order;
    #: the F0 predictor's own layers follow implicitly (see ``hift.CausalSourceNoise``)
    noise_preamble: tuple = ()
    #: seed of the construction generator (upstream ``set_all_random_seed(0)`` in the CFM)
    noise_seed: int = 0
    #: length of the fixed noise tensors in samples (upstream literal ``300 * 24000``)
    noise_samples: int = 300 * 24000

    @property
    def samples_per_frame(self) -> int:
        """Output samples per mel frame: prod(upsample_rates) * istft hop (480 at 24 kHz)."""
        n = self.istft_hop_len
        for r in self.upsample_rates:
            n *= r
        return n


@dataclass(frozen=True)
class MelConfig:
    """The prompt-mel extractor (``feat_extractor``: ``matcha.utils.audio.mel_spectrogram``)."""

    n_fft: int
    num_mels: int
    sampling_rate: int
    hop_size: int
    win_size: int
    fmin: float
    fmax: float | None
    center: bool

    @property
    def frame_rate(self) -> float:
        return self.sampling_rate / self.hop_size


@dataclass(frozen=True)
class CosyVoice2Config:
    """Everything cosyserve needs from ``cosyvoice2.yaml`` / ``cosyvoice3.yaml`` (+ the Qwen2
    ``config.json``).

    ``model_family`` is ``"cosyvoice2"`` or ``"cosyvoice3"`` (:data:`MODEL_FAMILIES`). For
    CosyVoice2 ``flow`` is a :class:`FlowConfig` and ``hift`` a :class:`HiFTConfig`; for
    CosyVoice3 they are what :func:`cosyserve.models.cv3_flow.parse_cv3_flow` (a ``CV3FlowConfig``)
    and :func:`cosyserve.models.hift.parse_causal_hift` (a ``HiFTConfig`` with ``causal=True``) return.
    """

    sample_rate: int
    token_frame_rate: int
    token_mel_ratio: int
    chunk_size: int
    num_decoding_left_chunks: int
    llm: LLMConfig
    flow: Any
    hift: Any
    feat: MelConfig
    model_family: str = "cosyvoice2"

    @property
    def samples_per_token(self) -> int:
        return self.sample_rate // self.token_frame_rate

    @property
    def is_cosyvoice3(self) -> bool:
        return self.model_family == "cosyvoice3"

    @property
    def yaml_name(self) -> str:
        """File name of this family's yaml in an official model directory."""
        return MODEL_FAMILIES[self.model_family]["yaml"]


#: any of the model configurations (one class for both families)
ModelConfig = CosyVoice2Config


def _expect(node: Any, key: str, class_name: str, family: str = "CosyVoice2") -> Tagged:
    if not isinstance(node, Tagged) or node.kind != "new":
        raise ConfigError(f"yaml key '{key}' must be '!new:...{class_name}', found {node!r:.80}")
    if node.class_name != class_name:
        raise ConfigError(
            f"yaml key '{key}' instantiates {node.target}; cosyserve implements {class_name} ({family}) there"
        )
    return node


def _get(d: dict, key: str, where: str, default: Any = ..., conv=None) -> Any:
    if key in d:
        v = d[key]
    elif default is ...:
        raise ConfigError(f"yaml '{where}' is missing '{key}'")
    else:
        v = default
    if conv is not None and v is not None:
        try:
            v = conv(v)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"yaml '{where}.{key}' = {v!r} is not a valid {conv.__name__}") from exc
    return v


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _int_tuple(v) -> tuple[int, ...]:
    return tuple(int(x) for x in v)


def _nested_int_tuple(v) -> tuple[tuple[int, ...], ...]:
    return tuple(_int_tuple(x) for x in v)


def _parse_llm(data: dict, qwen_config: dict | None, family: str) -> LLMConfig:
    """The ``llm`` section: ``Qwen2LM`` (CosyVoice2) or ``CosyVoice3LM`` + ``Qwen2Encoder``."""
    fam = MODEL_FAMILIES[family]
    lm_class = fam["llm"]
    llm = _expect(data.get("llm"), "llm", lm_class, _FAMILY_NAMES[family]).kwargs()
    enc = llm.get("llm")
    _expect(enc, "llm.llm", "Qwen2Encoder", _FAMILY_NAMES[family])
    samp = llm.get("sampling")
    if not (isinstance(samp, Tagged) and samp.class_name == "ras_sampling"):
        raise ConfigError(f"yaml 'llm.sampling' must be !name:...ras_sampling, found {samp!r:.80}")
    sk = samp.kwargs()
    sampling = SamplingConfig(
        top_p=_get(sk, "top_p", "llm.sampling", 0.8, float),
        top_k=_get(sk, "top_k", "llm.sampling", 25, int),
        win_size=_get(sk, "win_size", "llm.sampling", 10, int),
        tau_r=_get(sk, "tau_r", "llm.sampling", 0.1, float),
    )
    llm_cfg = LLMConfig(
        llm_input_size=_get(llm, "llm_input_size", "llm", conv=int),
        llm_output_size=_get(llm, "llm_output_size", "llm", conv=int),
        speech_token_size=_get(llm, "speech_token_size", "llm", conv=int),
        sampling=sampling,
        qwen=dict(qwen_config or {}),
        lm_class=lm_class,
    )
    if qwen_config is not None:
        hs = int(qwen_config.get("hidden_size", -1))
        _require(
            hs == llm_cfg.llm_input_size == llm_cfg.llm_output_size,
            f"CosyVoice-BlankEN/config.json hidden_size={hs} does not match yaml llm_input_size="
            f"{llm_cfg.llm_input_size} / llm_output_size={llm_cfg.llm_output_size}",
        )
    return llm_cfg


def _parse_cfm(dec: dict) -> CFMConfig:
    """:class:`CFMConfig` from the kwargs of ``flow.decoder`` (``CausalConditionalCFM``, in both
    CosyVoice2 and CosyVoice3) and its ``cfm_params`` (a dict or ``!new:omegaconf.DictConfig``
    with ``content``): Euler solver only, ``t_scheduler`` cosine or linear; defaults are upstream's.
    Raises :class:`ConfigError` naming the offending key."""
    cfm_params = dec.get("cfm_params")
    if isinstance(cfm_params, Tagged):
        cp = cfm_params.kwargs()
        cp = cp.get("content", cp)
    elif isinstance(cfm_params, dict):
        cp = cfm_params
    else:
        raise ConfigError("yaml 'flow.decoder.cfm_params' missing")
    _require(cp.get("solver", "euler") == "euler", "yaml 'flow.decoder.cfm_params.solver' must be 'euler'")
    t_sched = str(cp.get("t_scheduler", "linear"))
    _require(t_sched in ("cosine", "linear"), f"yaml t_scheduler {t_sched!r} unsupported (cosine/linear)")
    return CFMConfig(
        in_channels=_get(dec, "in_channels", "flow.decoder", conv=int),
        n_spks=_get(dec, "n_spks", "flow.decoder", 1, int),
        spk_emb_dim=_get(dec, "spk_emb_dim", "flow.decoder", 64, int),
        sigma_min=_get(cp, "sigma_min", "flow.decoder.cfm_params", 1e-6, float),
        t_scheduler=t_sched,
        inference_cfg_rate=_get(cp, "inference_cfg_rate", "flow.decoder.cfm_params", 0.7, float),
    )


def _parse_cv2_flow(data: dict, token_mel_ratio: int) -> FlowConfig:
    """The CosyVoice2 ``flow`` section (``CausalMaskedDiffWithXvec``)."""
    flow = _expect(data.get("flow"), "flow", "CausalMaskedDiffWithXvec").kwargs()
    enc = _expect(flow.get("encoder"), "flow.encoder", "UpsampleConformerEncoder").kwargs()
    w = "flow.encoder"
    _require(_get(enc, "input_layer", w, "conv2d") == "linear", f"yaml '{w}.input_layer' must be 'linear'")
    _require(
        _get(enc, "pos_enc_layer_type", w, "rel_pos") == "rel_pos_espnet",
        f"yaml '{w}.pos_enc_layer_type' must be 'rel_pos_espnet'",
    )
    _require(
        _get(enc, "selfattention_layer_type", w, "rel_selfattn") == "rel_selfattn",
        f"yaml '{w}.selfattention_layer_type' must be 'rel_selfattn'",
    )
    _require(not _get(enc, "use_cnn_module", w, True), f"yaml '{w}.use_cnn_module' must be False (as CosyVoice2)")
    _require(not _get(enc, "macaron_style", w, True), f"yaml '{w}.macaron_style' must be False (as CosyVoice2)")
    _require(_get(enc, "normalize_before", w, True), f"yaml '{w}.normalize_before' must be True")
    activation = _get(enc, "activation_type", w, "swish")
    _require(activation in ("swish", "relu", "gelu", "tanh"), f"yaml '{w}.activation_type' {activation!r} unsupported")
    pre_lookahead = _get(flow, "pre_lookahead_len", "flow", 3, int)
    encoder_cfg = EncoderConfig(
        input_size=_get(enc, "input_size", w, conv=int),
        output_size=_get(enc, "output_size", w, 256, int),
        attention_heads=_get(enc, "attention_heads", w, 4, int),
        linear_units=_get(enc, "linear_units", w, 2048, int),
        num_blocks=_get(enc, "num_blocks", w, 6, int),
        num_up_blocks=4,  # hard-coded upstream
        static_chunk_size=_get(enc, "static_chunk_size", w, 0, int),
        pre_lookahead_len=pre_lookahead,
        upsample_stride=token_mel_ratio,
        activation=activation,
        key_bias=bool(_get(enc, "key_bias", w, True)),
    )
    dec = _expect(flow.get("decoder"), "flow.decoder", "CausalConditionalCFM").kwargs()
    cfm_cfg = _parse_cfm(dec)
    est = _expect(dec.get("estimator"), "flow.decoder.estimator", "CausalConditionalDecoder").kwargs()
    w = "flow.decoder.estimator"
    act_fn = _get(est, "act_fn", w, "snake")
    _require(act_fn == "gelu", f"yaml '{w}.act_fn' {act_fn!r} unsupported (CosyVoice2 uses 'gelu')")
    est_cfg = EstimatorConfig(
        in_channels=_get(est, "in_channels", w, conv=int),
        out_channels=_get(est, "out_channels", w, conv=int),
        channels=_get(est, "channels", w, (256, 256), _int_tuple),
        attention_head_dim=_get(est, "attention_head_dim", w, 64, int),
        n_blocks=_get(est, "n_blocks", w, 1, int),
        num_mid_blocks=_get(est, "num_mid_blocks", w, 2, int),
        num_heads=_get(est, "num_heads", w, 4, int),
        act_fn=act_fn,
        static_chunk_size=_get(est, "static_chunk_size", w, 50, int),
        num_decoding_left_chunks=_get(est, "num_decoding_left_chunks", w, 2, int),
    )
    flow_cfg = FlowConfig(
        input_size=_get(flow, "input_size", "flow", 512, int),
        output_size=_get(flow, "output_size", "flow", 80, int),
        spk_embed_dim=_get(flow, "spk_embed_dim", "flow", 192, int),
        vocab_size=_get(flow, "vocab_size", "flow", 4096, int),
        token_mel_ratio=_get(flow, "token_mel_ratio", "flow", 2, int),
        pre_lookahead_len=pre_lookahead,
        input_frame_rate=_get(flow, "input_frame_rate", "flow", 50, int),
        encoder=encoder_cfg,
        cfm=cfm_cfg,
        estimator=est_cfg,
    )
    _require(
        flow_cfg.input_size == encoder_cfg.input_size,
        f"yaml flow.input_size={flow_cfg.input_size} differs from flow.encoder.input_size={encoder_cfg.input_size}",
    )
    _require(
        est_cfg.in_channels == 4 * flow_cfg.output_size,
        f"yaml estimator in_channels={est_cfg.in_channels} must be 4 x flow output_size={flow_cfg.output_size}"
        " (x, mu, speaker, cond)",
    )
    return flow_cfg


def _hift_kwargs(hift: dict, f0: dict) -> dict[str, Any]:
    """The :class:`HiFTConfig` fields both HiFT generators read the same way: ``hift`` the kwargs
    of the ``hift`` section (``HiFTGenerator`` for CosyVoice2, ``CausalHiFTGenerator`` for
    CosyVoice3), ``f0`` those of its ``f0_predictor``. Defaults are upstream's constructor defaults.
    Raises :class:`ConfigError` naming a missing or malformed key."""
    w = "hift"
    istft = _get(hift, "istft_params", w, {"n_fft": 16, "hop_len": 4})
    return dict(
        in_channels=_get(hift, "in_channels", w, 80, int),
        base_channels=_get(hift, "base_channels", w, 512, int),
        nb_harmonics=_get(hift, "nb_harmonics", w, 8, int),
        sampling_rate=_get(hift, "sampling_rate", w, 22050, int),
        nsf_alpha=_get(hift, "nsf_alpha", w, 0.1, float),
        nsf_sigma=_get(hift, "nsf_sigma", w, 0.003, float),
        nsf_voiced_threshold=_get(hift, "nsf_voiced_threshold", w, 10, float),
        upsample_rates=_get(hift, "upsample_rates", w, (8, 8), _int_tuple),
        upsample_kernel_sizes=_get(hift, "upsample_kernel_sizes", w, (16, 16), _int_tuple),
        istft_n_fft=int(istft["n_fft"]),
        istft_hop_len=int(istft["hop_len"]),
        resblock_kernel_sizes=_get(hift, "resblock_kernel_sizes", w, (3, 7, 11), _int_tuple),
        resblock_dilation_sizes=_get(hift, "resblock_dilation_sizes", w, ((1, 3, 5),) * 3, _nested_int_tuple),
        source_resblock_kernel_sizes=_get(hift, "source_resblock_kernel_sizes", w, (7, 11), _int_tuple),
        source_resblock_dilation_sizes=_get(
            hift, "source_resblock_dilation_sizes", w, ((1, 3, 5),) * 2, _nested_int_tuple
        ),
        lrelu_slope=_get(hift, "lrelu_slope", w, 0.1, float),
        audio_limit=_get(hift, "audio_limit", w, 0.99, float),
        f0_num_class=_get(f0, "num_class", "hift.f0_predictor", 1, int),
        f0_in_channels=_get(f0, "in_channels", "hift.f0_predictor", 80, int),
        f0_cond_channels=_get(f0, "cond_channels", "hift.f0_predictor", 512, int),
    )


def _parse_cv2_hift(data: dict, sample_rate: int, token_frame_rate: int, token_mel_ratio: int) -> HiFTConfig:
    """The CosyVoice2 ``hift`` section (``HiFTGenerator`` + ``ConvRNNF0Predictor``)."""
    hift = _expect(data.get("hift"), "hift", "HiFTGenerator").kwargs()
    f0 = _expect(hift.get("f0_predictor"), "hift.f0_predictor", "ConvRNNF0Predictor").kwargs()
    hift_cfg = HiFTConfig(**_hift_kwargs(hift, f0))
    _require(
        hift_cfg.sampling_rate != 22050,
        "hift.sampling_rate 22050 is the CosyVoice1 vocoder (SineGen v1); cosyserve implements CosyVoice2 (24 kHz)",
    )
    _require(
        len(hift_cfg.upsample_rates) == len(hift_cfg.upsample_kernel_sizes) == len(hift_cfg.source_resblock_kernel_sizes),
        "hift: upsample_rates, upsample_kernel_sizes and source_resblock_kernel_sizes must have equal length",
    )
    _require(
        hift_cfg.samples_per_frame * token_frame_rate * token_mel_ratio == sample_rate,
        f"hift produces {hift_cfg.samples_per_frame} samples per mel frame; with {token_frame_rate} tokens/s and "
        f"token_mel_ratio {token_mel_ratio} that is not sample_rate {sample_rate}",
    )
    return hift_cfg


def _parse_feat(data: dict) -> MelConfig:
    """``feat_extractor``: the prompt-mel settings (CosyVoice3 has ``fmax: null``, i.e. sr / 2)."""
    fe = data.get("feat_extractor")
    if not (isinstance(fe, Tagged) and fe.class_name == "mel_spectrogram"):
        raise ConfigError("yaml 'feat_extractor' must be !name:matcha.utils.audio.mel_spectrogram")
    fk = fe.kwargs()
    w = "feat_extractor"
    feat = MelConfig(
        n_fft=_get(fk, "n_fft", w, conv=int),
        num_mels=_get(fk, "num_mels", w, conv=int),
        sampling_rate=_get(fk, "sampling_rate", w, conv=int),
        hop_size=_get(fk, "hop_size", w, conv=int),
        win_size=_get(fk, "win_size", w, conv=int),
        fmin=_get(fk, "fmin", w, 0.0, float),
        fmax=_get(fk, "fmax", w, None, float),
        center=bool(_get(fk, "center", w, False)),
    )
    return feat


_FAMILY_NAMES = {"cosyvoice2": "CosyVoice2", "cosyvoice3": "CosyVoice3"}


def detect_family(data: dict, yaml_name: str | None = None) -> str:
    """The model family of parsed yaml ``data``: the family whose LM class ``llm`` instantiates.

    ``yaml_name`` (the file name) must agree when it is an official name (``cosyvoice2.yaml`` /
    ``cosyvoice3.yaml``): a CosyVoice3 class in ``cosyvoice2.yaml`` (or the reverse) is refused.
    Raises :class:`ConfigError` naming the class found.
    """
    node = data.get("llm")
    found = node.class_name if isinstance(node, Tagged) else None
    by_class = [f for f, m in MODEL_FAMILIES.items() if m["llm"] == found]
    by_name = [f for f, m in MODEL_FAMILIES.items() if m["yaml"] == yaml_name]
    if by_name:
        fam = by_name[0]
        if by_class and by_class[0] != fam:
            raise ConfigError(
                f"{yaml_name} must describe a {_FAMILY_NAMES[fam]} model, but its 'llm' is {node.target} "
                f"({_FAMILY_NAMES[by_class[0]]}); rename the file to {MODEL_FAMILIES[by_class[0]]['yaml']}"
            )
        return fam
    if not by_class:
        known = ", ".join(f"{m['llm']} ({_FAMILY_NAMES[f]})" for f, m in MODEL_FAMILIES.items())
        what = node.target if isinstance(node, Tagged) else repr(node)[:80]
        raise ConfigError(f"yaml key 'llm' instantiates {what}; cosyserve implements {known}")
    return by_class[0]


def _parse_cv3_token2wav(data: dict) -> tuple[Any, Any]:
    """CosyVoice3's ``flow`` (``CausalMaskedDiffWithDiT``) and ``hift`` (``CausalHiFTGenerator``):
    class names checked here, dimensions by :func:`cosyserve.models.cv3_flow.parse_cv3_flow` and
    :func:`cosyserve.models.hift.parse_causal_hift`. Raises :class:`ConfigError`."""
    from .cv3_flow import parse_cv3_flow  # imported here: both modules import this one
    from .hift import parse_causal_hift

    fam = MODEL_FAMILIES["cosyvoice3"]
    _expect(data.get("flow"), "flow", fam["flow"], "CosyVoice3")
    _expect(data.get("hift"), "hift", fam["hift"], "CosyVoice3")
    return parse_cv3_flow(data), parse_causal_hift(data)


def _raw_kwargs(data: dict, key: str) -> dict:
    node = data.get(key)
    return node.kwargs() if isinstance(node, Tagged) else {}


def parse_config(data: dict, qwen_config: dict | None = None, family: str | None = None) -> CosyVoice2Config:
    """Build a :class:`CosyVoice2Config` from parsed yaml data (see :func:`load_hyperpyyaml`).

    ``qwen_config`` is the dict of ``CosyVoice-BlankEN/config.json`` (may be ``None`` only
    for callers that do not build the speech LM). ``family`` (``"cosyvoice2"`` /
    ``"cosyvoice3"``) defaults to :func:`detect_family`; every class must belong to it.
    Raises :class:`ConfigError`.
    """
    family = family or detect_family(data)
    if family not in MODEL_FAMILIES:
        raise ConfigError(f"unknown model family {family!r} (known: {', '.join(MODEL_FAMILIES)})")
    sample_rate = _get(data, "sample_rate", "<top>", conv=int)
    token_frame_rate = _get(data, "token_frame_rate", "<top>", conv=int)
    token_mel_ratio = _get(data, "token_mel_ratio", "<top>", conv=int)
    chunk_size = _get(data, "chunk_size", "<top>", conv=int)
    num_left = _get(data, "num_decoding_left_chunks", "<top>", -1, conv=int)

    llm_cfg = _parse_llm(data, qwen_config, family)
    if family == "cosyvoice2":
        flow_cfg = _parse_cv2_flow(data, token_mel_ratio)
        hift_cfg = _parse_cv2_hift(data, sample_rate, token_frame_rate, token_mel_ratio)
        flow_mels, hift_mels = flow_cfg.output_size, hift_cfg.in_channels
    else:
        flow_cfg, hift_cfg = _parse_cv3_token2wav(data)
        # cross-checks on the raw sections, so they hold whichever parsers are present
        fk, hk = _raw_kwargs(data, "flow"), _raw_kwargs(data, "hift")
        flow_mels = _get(fk, "output_size", "flow", 80, int)
        hift_mels = _get(hk, "in_channels", "hift", 80, int)
        _require(_get(fk, "vocab_size", "flow", conv=int) == llm_cfg.speech_token_size,
                 f"yaml flow.vocab_size {fk.get('vocab_size')} != llm.speech_token_size {llm_cfg.speech_token_size}")
        istft = _get(hk, "istft_params", "hift")
        per_frame = _get(istft if isinstance(istft, dict) else {}, "hop_len", "hift.istft_params", conv=int)
        for r in _get(hk, "upsample_rates", "hift", conv=_int_tuple):
            per_frame *= r
        _require(per_frame * token_frame_rate * token_mel_ratio == sample_rate,
                 f"hift produces {per_frame} samples per mel frame; with {token_frame_rate} tokens/s and "
                 f"token_mel_ratio {token_mel_ratio} that is not sample_rate {sample_rate}")
    feat = _parse_feat(data)
    _require(feat.num_mels == flow_mels == hift_mels,
             f"mel bins disagree: feat_extractor {feat.num_mels}, flow {flow_mels}, hift {hift_mels}")
    _require(feat.sampling_rate == sample_rate, f"feat_extractor.sampling_rate {feat.sampling_rate} != sample_rate {sample_rate}")

    return CosyVoice2Config(
        sample_rate=sample_rate,
        token_frame_rate=token_frame_rate,
        token_mel_ratio=token_mel_ratio,
        chunk_size=chunk_size,
        num_decoding_left_chunks=num_left,
        llm=llm_cfg,
        flow=flow_cfg,
        hift=hift_cfg,
        feat=feat,
        model_family=family,
    )


QWEN_DIR = "CosyVoice-BlankEN"


def load_config(yaml_path: str | Path, qwen_config_path: str | Path | None = None) -> CosyVoice2Config:
    """Load ``cosyvoice2.yaml`` / ``cosyvoice3.yaml`` and (if found) ``CosyVoice-BlankEN/config.json``
    beside it.

    ``qwen_config_path`` defaults to ``<yaml dir>/CosyVoice-BlankEN/config.json``. The family
    comes from the LM class, checked against the file name (:func:`detect_family`).
    Raises :class:`ConfigError` if either file is unreadable or inconsistent.
    """
    yaml_path = Path(yaml_path)
    data = load_hyperpyyaml(yaml_path)
    qpath = Path(qwen_config_path) if qwen_config_path else yaml_path.parent / QWEN_DIR / "config.json"
    qwen = None
    if qpath.exists():
        try:
            qwen = json.loads(qpath.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{qpath} is not valid JSON: {exc}") from exc
    elif qwen_config_path is not None:
        raise ConfigError(f"{qpath} not found")
    try:
        return parse_config(data, qwen, detect_family(data, yaml_path.name))
    except ConfigError as exc:
        raise ConfigError(f"{yaml_path}: {exc}") from None


# --------------------------------------------------------------------------------------
# Step-Audio2 token2wav (DiT flow): flow.yaml of a token2wav directory
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DiTConfig:
    """``DiT`` velocity estimator of the Step-Audio2 token2wav CFM (``cosyvoice2.flow.decoder_dit.DiT``).

    ``in_channels`` = 4 x mel bins (x, mu, speaker, cond stacked on channels); ``hidden_size`` the
    transformer width; attention has ``num_heads`` heads of ``head_dim`` (``num_heads * head_dim``
    need not equal ``hidden_size``); the MLP is ``int(hidden_size * mlp_ratio)`` wide.
    """

    in_channels: int
    out_channels: int
    hidden_size: int
    depth: int
    num_heads: int
    head_dim: int
    mlp_ratio: float
    frequency_embedding_size: int = 256  # TimestepEmbedder default (not in the yaml)
    conv_kernel_size: int = 3  # CausalConvBlock kernel (literal 3 upstream)

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)


@dataclass(frozen=True)
class DitFlowConfig:
    """Step-Audio2 ``CausalMaskedDiffWithXvec`` (encoder v2 + causal CFM with a DiT estimator).

    ``encoder`` reuses :class:`EncoderConfig` (``static_chunk_size`` 0: the v2 encoder has no chunk
    mask; ``upsample_stride`` = ``up_stride``). CFM: ``n_timesteps`` Euler steps on the cosine
    schedule, classifier-free guidance ``inference_cfg_rate``; the noise buffer holds
    ``noise_frames`` frames (upstream ``50 * 600``) drawn from a private generator seeded with
    ``noise_seed`` (see :mod:`cosyserve.models.dit_flow`).
    """

    input_size: int
    output_size: int
    spk_embed_dim: int
    vocab_size: int
    encoder: EncoderConfig
    estimator: DiTConfig
    inference_cfg_rate: float
    n_timesteps: int = 10  # Token2wav's n_timesteps default
    noise_frames: int = 30000
    noise_seed: int = 0

    @property
    def token_mel_ratio(self) -> int:
        return self.encoder.upsample_stride

    @property
    def pre_lookahead_len(self) -> int:
        return self.encoder.pre_lookahead_len


#: class names of the Step-Audio2 token2wav flow.yaml (tags ``!new:cosyvoice2.flow....``)
STEPAUDIO2_FLOW_CLASSES = {
    "flow": "CausalMaskedDiffWithXvec",
    "flow.encoder": "UpsampleConformerEncoderV2",
    "flow.decoder": "CausalConditionalCFM",
    "flow.decoder.estimator": "DiT",
}


def parse_dit_flow_config(data: dict) -> DitFlowConfig:
    """Build a :class:`DitFlowConfig` from a parsed Step-Audio2 token2wav ``flow.yaml``.

    Class names are checked against :data:`STEPAUDIO2_FLOW_CLASSES`; every size comes from the yaml
    (defaults are those of the upstream constructors). Raises :class:`ConfigError` naming the key.
    """
    flow = _expect(data.get("flow"), "flow", STEPAUDIO2_FLOW_CLASSES["flow"]).kwargs()
    enc = _expect(flow.get("encoder"), "flow.encoder", STEPAUDIO2_FLOW_CLASSES["flow.encoder"]).kwargs()
    w = "flow.encoder"
    _require(_get(enc, "input_layer", w, "linear") == "linear", f"yaml '{w}.input_layer' must be 'linear'")
    _require(_get(enc, "pos_enc_layer_type", w, "rel_pos_espnet") == "rel_pos_espnet",
             f"yaml '{w}.pos_enc_layer_type' must be 'rel_pos_espnet'")
    _require(_get(enc, "selfattention_layer_type", w, "rel_selfattn") == "rel_selfattn",
             f"yaml '{w}.selfattention_layer_type' must be 'rel_selfattn'")
    _require(_get(enc, "normalize_before", w, True), f"yaml '{w}.normalize_before' must be True")
    activation = _get(enc, "activation_type", w, "swish")
    _require(activation in ("swish", "relu", "gelu", "tanh"), f"yaml '{w}.activation_type' {activation!r} unsupported")
    stride = _get(enc, "up_stride", w, 2, int)
    scale = _get(enc, "up_scale_factor", w, stride, float)
    _require(scale == stride, f"yaml '{w}.up_scale_factor' {scale} must equal up_stride {stride}")
    encoder_cfg = EncoderConfig(
        input_size=_get(enc, "input_size", w, conv=int),
        output_size=_get(enc, "output_size", w, 256, int),
        attention_heads=_get(enc, "attention_heads", w, 4, int),
        linear_units=_get(enc, "linear_units", w, 2048, int),
        num_blocks=_get(enc, "num_blocks", w, 6, int),
        num_up_blocks=_get(enc, "num_up_blocks", w, 4, int),
        static_chunk_size=0,
        pre_lookahead_len=_get(enc, "pre_lookahead_len", w, 3, int),
        upsample_stride=stride,
        activation=activation,
        key_bias=bool(_get(enc, "key_bias", w, True)),
    )
    _require(encoder_cfg.pre_lookahead_len >= 1, f"yaml '{w}.pre_lookahead_len' must be >= 1")
    dec = _expect(flow.get("decoder"), "flow.decoder", STEPAUDIO2_FLOW_CLASSES["flow.decoder"]).kwargs()
    est = _expect(dec.get("estimator"), "flow.decoder.estimator", STEPAUDIO2_FLOW_CLASSES["flow.decoder.estimator"]).kwargs()
    w = "flow.decoder.estimator"
    dit = DiTConfig(
        in_channels=_get(est, "in_channels", w, conv=int),
        out_channels=_get(est, "out_channels", w, conv=int),
        hidden_size=_get(est, "hidden_size", w, 256, int),
        depth=_get(est, "depth", w, 28, int),
        num_heads=_get(est, "num_heads", w, 8, int),
        head_dim=_get(est, "head_dim", w, 64, int),
        mlp_ratio=_get(est, "mlp_ratio", w, 4.0, float),
    )
    cfg = DitFlowConfig(
        input_size=_get(flow, "input_size", "flow", 512, int),
        output_size=_get(flow, "output_size", "flow", 80, int),
        spk_embed_dim=_get(flow, "spk_embed_dim", "flow", 192, int),
        vocab_size=_get(flow, "vocab_size", "flow", 5121, int),
        encoder=encoder_cfg,
        estimator=dit,
        inference_cfg_rate=_get(dec, "inference_cfg_rate", "flow.decoder", 0.7, float),
    )
    _require(_get(flow, "output_type", "flow", "mel") == "mel", "yaml 'flow.output_type' must be 'mel'")
    _require(cfg.input_size == encoder_cfg.input_size,
             f"yaml flow.input_size={cfg.input_size} differs from flow.encoder.input_size={encoder_cfg.input_size}")
    _require(dit.out_channels == cfg.output_size,
             f"yaml estimator out_channels={dit.out_channels} must equal flow output_size={cfg.output_size}")
    _require(dit.in_channels == 4 * cfg.output_size,
             f"yaml estimator in_channels={dit.in_channels} must be 4 x flow output_size={cfg.output_size}"
             " (x, mu, speaker, cond)")
    _require(cfg.inference_cfg_rate > 0, "yaml 'flow.decoder.inference_cfg_rate' must be > 0 (as upstream asserts)")
    _require(min(dit.hidden_size, dit.depth, dit.num_heads, dit.head_dim) > 0, f"yaml '{w}' sizes must be positive")
    return cfg


def load_dit_flow_config(yaml_path: str | Path) -> DitFlowConfig:
    """Load a Step-Audio2 token2wav ``flow.yaml`` as data (nothing executed) -> :class:`DitFlowConfig`.

    Raises :class:`ConfigError` naming the file on unreadable or unsupported content.
    """
    yaml_path = Path(yaml_path)
    data = load_hyperpyyaml(yaml_path)
    try:
        return parse_dit_flow_config(data)
    except ConfigError as exc:
        raise ConfigError(f"{yaml_path}: {exc}") from None


def stepaudio2_hift_config(base_channels: int = 512, f0_cond_channels: int = 512) -> HiFTConfig:
    """The vocoder of a Step-Audio2 token2wav directory: ``HiFTGenerator()`` of
    ``stepaudio2.flashcosyvoice.modules.hifigan`` with its constructor defaults (24 kHz, 8 harmonics,
    upsampling [8, 5, 3] / kernels [16, 11, 7], iSTFT 16/4, source resblocks [7, 7, 11]). The
    directory has no yaml for it; the two widths are read from ``hift.pt``'s tensor shapes by the
    loader (512/512 in the release)."""
    return HiFTConfig(
        in_channels=80, base_channels=base_channels, nb_harmonics=8, sampling_rate=24000,
        nsf_alpha=0.1, nsf_sigma=0.003, nsf_voiced_threshold=10.0,
        upsample_rates=(8, 5, 3), upsample_kernel_sizes=(16, 11, 7), istft_n_fft=16, istft_hop_len=4,
        resblock_kernel_sizes=(3, 7, 11), resblock_dilation_sizes=((1, 3, 5),) * 3,
        source_resblock_kernel_sizes=(7, 7, 11), source_resblock_dilation_sizes=((1, 3, 5),) * 3,
        lrelu_slope=0.1, audio_limit=0.99, f0_num_class=1, f0_in_channels=80, f0_cond_channels=f0_cond_channels,
    )

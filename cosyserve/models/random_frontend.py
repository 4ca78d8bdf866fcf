"""Full-size RANDOM-weight versions of the two frontend ONNX models, for benchmarks.

The demo and reference model directories ship tiny *stand-ins* for ``speech_tokenizer_v2.onnx``
and ``campplus.onnx`` (:mod:`cosyserve.models.demo`): they keep the calling convention but cost
nothing, so a benchmark with per-request prompts would not see what the real files cost. This
module writes ONNX files of the real size and structure with random weights:

* :func:`s3_tokenizer_v2_onnx`: the S3 speech tokenizer v2 graph (Whisper-sized encoder: two
  stride-2 convolutions, ``n_layer`` FSMN-attention blocks with rotary embeddings, FSQ
  quantizer; the architecture of S3Tokenizer's ``S3TokenizerV2``, GitHub
  xingchensong/S3Tokenizer, written here as our own ONNX graph). Nodes and initializers are
  named the way the official export names them (``/blocks.0/attn/query/MatMul`` with an
  ``onnx::MatMul_<n>`` weight, ``/blocks.0/attn_ln/LayerNormalization``,
  ``blocks.0.attn.fsmn_block.weight``, ``quantizer.project_in.bias``), so onnxruntime runs it
  AND :func:`cosyserve.frontend.s3tokenizer.load_s3_tokenizer_v2` reads it exactly as it reads
  the real file. Same inputs/outputs as the real file: ``feats`` float32 ``[B, 128, T]``,
  ``feats_length`` int32 ``[B]`` -> ``indices`` int64 ``[B, ceil(T / 4)]``. Released size
  (:class:`S3TokenizerSize` defaults): 128 mels, width 1280, 20 heads, 6 blocks, MLP 5120,
  FSMN kernel 31, 8 digits: ~124 M parameters (~500 MB, like the real file).
* :func:`campplus_like_onnx`: a CAM++-**like** speaker model. The real CAM++ (3D-Speaker) is
  a ~7 M-parameter D-TDNN; its exact graph is not available here, so this is a *faithful-cost
  stand-in*: the same stages and widths (2-D convolutional front end of 32 channels halving
  the 80 mel bins three times, a stride-2 TDNN layer to 128 channels, three densely connected
  TDNN blocks of 12/24/16 layers with growth 32, bottleneck 128, dilations 1/2/2 and a
  context-aware mask per layer, transition layers halving the channels, statistics pooling,
  a 192-dim embedding), batch norms folded away, the mask built from the utterance mean only
  (CAM++ also pools 100-frame segments). ~7 M parameters, comparable FLOPs. Same convention as
  the real file: ``input`` float32 ``[B, T, 80]`` -> ``output`` float32 ``[B, 192]``.

Both are written with fixed-seed random weights (``z`` standard normal: matrices
``z / sqrt(fan_in)``, biases ``0.1 z``, LayerNorm scales ``1 + 0.1 z``). **Their outputs are
meaningless**: they measure cost, not quality.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

S3_TOKENIZER_FILE = "speech_tokenizer_v2.onnx"
CAMPPLUS_FILE = "campplus.onnx"


@dataclass(frozen=True)
class S3TokenizerSize:
    """Size of a generated S3 tokenizer v2 (defaults: the released ``speech_tokenizer_v2.onnx``)."""

    n_mels: int = 128
    n_state: int = 1280
    head_dim: int = 64            # the rotary width; heads = n_state / head_dim (20)
    n_layer: int = 6
    n_mlp: int = 5120
    fsmn_kernel: int = 31
    n_digits: int = 8
    max_positions: int = 2048     # rows of the rotary tables (upstream precompute_freqs_cis(64, 1024 * 2))
    attn_ln_eps: float = 1e-6
    mlp_ln_eps: float = 1e-5


@dataclass(frozen=True)
class CamSize:
    """Size of a generated CAM++-like speaker model (defaults: CAM++ as used by CosyVoice)."""

    n_mels: int = 80
    fcm_channels: int = 32
    init_channels: int = 128
    growth: int = 32
    bottleneck: int = 128
    layers: tuple[int, ...] = (12, 24, 16)
    dilations: tuple[int, ...] = (1, 2, 2)
    embed_dim: int = 192


class _Graph:
    """A tiny ONNX graph writer that names things the way ``torch.onnx.export`` does."""

    def __init__(self, seed: int, first_id: int = 2216):
        from onnx import helper, numpy_helper

        self.h, self.nh = helper, numpy_helper
        self.rng = np.random.default_rng(seed)
        self.nodes: list = []
        self.inits: list = []
        self._ids = itertools.count(first_id)
        self._names: set[str] = set()
        self.n_params = 0

    # ---- initializers
    def tensor(self, arr: np.ndarray, kind: str | None = None, name: str | None = None) -> str:
        name = name or f"onnx::{kind}_{next(self._ids)}"
        self.inits.append(self.nh.from_array(np.ascontiguousarray(arr), name))
        if np.issubdtype(arr.dtype, np.floating) and arr.size > 1:
            self.n_params += arr.size
        return name

    def const(self, value, dtype=np.int64) -> str:
        return self.tensor(np.asarray(value, dtype=dtype), "Constant")

    def randn(self, shape, scale: float, kind: str, name: str | None = None, offset: float = 0.0) -> str:
        z = self.rng.standard_normal(size=shape, dtype=np.float32)
        return self.tensor((z * np.float32(scale) + np.float32(offset)).astype(np.float32), kind, name)

    # ---- nodes
    def node(self, op: str, inputs: list[str], name: str, n_out: int = 1, **attrs):
        if name in self._names:
            k = 1
            while f"{name}_{k}" in self._names:
                k += 1
            name = f"{name}_{k}"
        self._names.add(name)
        outs = [f"{name}_output_{i}" for i in range(n_out)]
        self.nodes.append(self.h.make_node(op, inputs, outs, name=name, **attrs))
        return outs[0] if n_out == 1 else outs

    def gelu(self, x: str, scope: str) -> str:
        """Exact (erf) GELU, decomposed as torch exports it at opset < 20."""
        d = self.node("Div", [x, self.const(np.sqrt(2.0), np.float32)], f"{scope}/Div")
        e = self.node("Erf", [d], f"{scope}/Erf")
        a = self.node("Add", [e, self.const(1.0, np.float32)], f"{scope}/Add")
        m = self.node("Mul", [x, a], f"{scope}/Mul")
        return self.node("Mul", [m, self.const(0.5, np.float32)], f"{scope}/Mul")

    def model(self, name: str, inputs, outputs, producer: str):
        import onnx

        graph = self.h.make_graph(self.nodes, name, inputs, outputs, initializer=self.inits)
        m = self.h.make_model(graph, opset_imports=[self.h.make_opsetid("", 18)], producer_name=producer)
        m.ir_version = 8
        onnx.checker.check_model(m)
        return m


# ---------------------------------------------------------------------------- S3 tokenizer v2


def s3_tokenizer_v2_onnx(size: S3TokenizerSize = S3TokenizerSize(), seed: int = 0):
    """A random-weight ``speech_tokenizer_v2.onnx`` of ``size`` (see module docstring); returns the
    ``onnx.ModelProto``. Raises ValueError for inconsistent sizes."""
    from onnx import TensorProto

    from ..frontend.s3tokenizer import FSQ_LEVELS, FSQ_SCALE, PAD_BIAS, rotary_tables

    s = size
    if s.n_state % s.head_dim or s.head_dim % 2:
        raise ValueError(f"width {s.n_state} must be a multiple of the (even) head size {s.head_dim}")
    heads = s.n_state // s.head_dim
    g = _Graph(seed)
    f32 = np.float32

    def lin(x, scope, n_in, n_out, bias=True):
        w = g.randn((n_in, n_out), 1.0 / np.sqrt(n_in), "MatMul")
        y = g.node("MatMul", [x, w], f"{scope}/MatMul")
        if bias:
            y = g.node("Add", [g.randn((n_out,), 0.1, "Add"), y], f"{scope}/Add")
        return y

    def mask_of(lengths, frames, scope):
        """bool [B, T] from int64 lengths [B] and frames ([1] int64)."""
        t = g.node("Squeeze", [frames], f"{scope}/Squeeze")
        ar = g.node("Range", [g.const(0), t, g.const(1)], f"{scope}/Range")
        ln = g.node("Unsqueeze", [lengths, g.const([1])], f"{scope}/Unsqueeze")
        return g.node("Less", [ar, ln], f"{scope}/Less")

    def stem(x, lengths, scope, n_in):
        frames = g.node("Shape", [x], f"{scope}/Shape", start=2, end=3)
        m = g.node("Cast", [mask_of(lengths, frames, scope)], f"{scope}/Cast", to=TensorProto.FLOAT)
        m = g.node("Unsqueeze", [m, g.const([1])], f"{scope}/Unsqueeze")
        x = g.node("Mul", [x, m], f"{scope}/Mul")
        w = g.randn((s.n_state, n_in, 3), 1.0 / np.sqrt(n_in * 3), "Conv")
        b = g.randn((s.n_state,), 0.1, "Conv")
        y = g.node("Conv", [x, w, b], f"{scope}/Conv", kernel_shape=[3], strides=[2], pads=[1, 1])
        # new lengths: (L + 2 * 1 - 3) // 2 + 1
        ln = g.node("Add", [lengths, g.const(-1)], f"{scope}/Add")
        ln = g.node("Div", [ln, g.const(2)], f"{scope}/Div")
        ln = g.node("Add", [ln, g.const(1)], f"{scope}/Add")
        return g.gelu(y, scope), ln

    feats, feats_len = "feats", "feats_length"
    lengths = g.node("Cast", [feats_len], "/Cast", to=TensorProto.INT64)
    x, lengths = stem(feats, lengths, "/conv1", s.n_mels)
    x, lengths = stem(x, lengths, "/conv2", s.n_state)
    frames = g.node("Shape", [x], "/Shape", start=2, end=3)
    mask = g.node("Cast", [mask_of(lengths, frames, "")], "/Cast", to=TensorProto.FLOAT)  # [B, T]
    x = g.node("Transpose", [x], "/Transpose", perm=[0, 2, 1])  # [B, T, D]
    mask_pad = g.node("Unsqueeze", [mask, g.const([2])], "/Unsqueeze")  # [B, T, 1]
    bias = g.node("Sub", [g.const(1.0, f32), mask], "/Sub")
    bias = g.node("Mul", [bias, g.const(PAD_BIAS, f32)], "/Mul")
    bias = g.node("Unsqueeze", [bias, g.const([1, 2])], "/Unsqueeze")  # [B, 1, 1, T]
    cos_t, sin_t = (t.numpy() for t in rotary_tables(s.max_positions, s.head_dim))
    rope = []
    for tab, nm in ((cos_t, "cos"), (sin_t, "sin")):
        sl = g.node("Slice", [g.tensor(tab, "Slice"), g.const([0]), frames, g.const([0])], f"/rope/{nm}/Slice")
        rope.append(g.node("Unsqueeze", [sl, g.const([0, 2])], f"/rope/{nm}/Unsqueeze"))  # [1, T, 1, Dh]
    cos, sin = rope
    hshape = g.const([0, 0, heads, s.head_dim])
    half = g.const([s.head_dim // 2, s.head_dim // 2])
    scale = g.const(s.head_dim ** -0.25, f32)

    def rotary(t, scope):
        a, b = g.node("Split", [t, half], f"{scope}/Split", n_out=2, axis=-1)
        rot = g.node("Concat", [g.node("Neg", [b], f"{scope}/Neg"), a], f"{scope}/Concat", axis=-1)
        return g.node("Add", [g.node("Mul", [t, cos], f"{scope}/Mul"), g.node("Mul", [rot, sin], f"{scope}/Mul")],
                      f"{scope}/Add")

    for i in range(s.n_layer):
        p = f"/blocks.{i}"
        h = g.node("LayerNormalization", [x, g.randn((s.n_state,), 0.1, "LayerNormalization", offset=1.0),
                                          g.randn((s.n_state,), 0.1, "LayerNormalization")],
                   f"{p}/attn_ln/LayerNormalization", axis=-1, epsilon=s.attn_ln_eps)
        q = lin(h, f"{p}/attn/query", s.n_state, s.n_state)
        k = lin(h, f"{p}/attn/key", s.n_state, s.n_state, bias=False)
        v = lin(h, f"{p}/attn/value", s.n_state, s.n_state)
        # FSMN memory: (dwconv(v * m) + v * m) * m
        vm = g.node("Mul", [v, mask_pad], f"{p}/attn/Mul")
        vt = g.node("Transpose", [vm], f"{p}/attn/Transpose", perm=[0, 2, 1])
        left = (s.fsmn_kernel - 1) // 2
        fw = g.randn((s.n_state, 1, s.fsmn_kernel), 1.0 / np.sqrt(s.fsmn_kernel), "Conv",
                     name=f"blocks.{i}.attn.fsmn_block.weight")
        fc = g.node("Conv", [vt, fw], f"{p}/attn/fsmn_block/Conv", kernel_shape=[s.fsmn_kernel],
                    group=s.n_state, pads=[left, s.fsmn_kernel - 1 - left])
        fc = g.node("Transpose", [fc], f"{p}/attn/Transpose", perm=[0, 2, 1])
        mem = g.node("Mul", [g.node("Add", [fc, vm], f"{p}/attn/Add"), mask_pad], f"{p}/attn/Mul")
        # attention
        qh = rotary(g.node("Reshape", [q, hshape], f"{p}/attn/Reshape"), f"{p}/attn/rope_q")
        kh = rotary(g.node("Reshape", [k, hshape], f"{p}/attn/Reshape"), f"{p}/attn/rope_k")
        vh = g.node("Reshape", [v, hshape], f"{p}/attn/Reshape")
        qh = g.node("Mul", [g.node("Transpose", [qh], f"{p}/attn/Transpose", perm=[0, 2, 1, 3]), scale],
                    f"{p}/attn/Mul")
        kh = g.node("Mul", [g.node("Transpose", [kh], f"{p}/attn/Transpose", perm=[0, 2, 3, 1]), scale],
                    f"{p}/attn/Mul")
        qk = g.node("Add", [g.node("MatMul", [qh, kh], f"{p}/attn/MatMul"), bias], f"{p}/attn/Add")
        w = g.node("Softmax", [qk], f"{p}/attn/Softmax", axis=-1)
        vh = g.node("Transpose", [vh], f"{p}/attn/Transpose", perm=[0, 2, 1, 3])
        o = g.node("MatMul", [w, vh], f"{p}/attn/MatMul")
        o = g.node("Transpose", [o], f"{p}/attn/Transpose", perm=[0, 2, 1, 3])
        o = g.node("Reshape", [o, g.const([0, 0, s.n_state])], f"{p}/attn/Reshape")
        o = lin(o, f"{p}/attn/out", s.n_state, s.n_state)
        x = g.node("Add", [x, g.node("Add", [o, mem], f"{p}/attn/Add")], f"{p}/Add")
        h = g.node("LayerNormalization", [x, g.randn((s.n_state,), 0.1, "LayerNormalization", offset=1.0),
                                          g.randn((s.n_state,), 0.1, "LayerNormalization")],
                   f"{p}/mlp_ln/LayerNormalization", axis=-1, epsilon=s.mlp_ln_eps)
        h = lin(h, f"{p}/mlp/mlp.0", s.n_state, s.n_mlp)
        h = g.gelu(h, f"{p}/mlp/mlp.1")
        h = lin(h, f"{p}/mlp/mlp.2", s.n_mlp, s.n_state)
        x = g.node("Add", [x, h], f"{p}/Add")
    q = "/quantizer/project_down"
    y = g.node("MatMul", [x, g.randn((s.n_state, s.n_digits), 1.0 / np.sqrt(s.n_state), "MatMul")], f"{q}/MatMul")
    y = g.node("Add", [g.randn((s.n_digits,), 0.1, "Add", name="quantizer.project_in.bias"), y], f"{q}/Add")
    y = g.node("Tanh", [y], "/quantizer/Tanh")
    y = g.node("Mul", [y, g.const(FSQ_SCALE, f32)], "/quantizer/Mul")
    y = g.node("Round", [y], "/quantizer/Round")
    y = g.node("Add", [y, g.const(1.0, f32)], "/quantizer/Add")
    powers = (FSQ_LEVELS ** np.arange(s.n_digits)).astype(f32)
    y = g.node("Mul", [y, g.tensor(powers, "Mul")], "/quantizer/Mul")
    y = g.node("ReduceSum", [y, g.const([-1])], "/quantizer/ReduceSum", keepdims=0)
    g.nodes.append(g.h.make_node("Cast", [y], ["indices"], name="/quantizer/Cast", to=TensorProto.INT64))
    return g.model(
        "speech_tokenizer_v2_random",
        [g.h.make_tensor_value_info("feats", TensorProto.FLOAT, ["B", s.n_mels, "T"]),
         g.h.make_tensor_value_info("feats_length", TensorProto.INT32, ["B"])],
        [g.h.make_tensor_value_info("indices", TensorProto.INT64, ["B", "T4"])],
        "cosyserve random_frontend (S3 tokenizer v2 structure, RANDOM weights)",
    )


# ---------------------------------------------------------------------------- CAM++-like


def campplus_like_onnx(size: CamSize = CamSize(), seed: int = 0):
    """A random-weight CAM++-like speaker model of ``size`` (see module docstring); returns the
    ``onnx.ModelProto``. Raises ValueError if the mel bins do not halve three times."""
    from onnx import TensorProto

    s = size
    if s.n_mels % 8:
        raise ValueError(f"n_mels {s.n_mels} must be divisible by 8 (three stride-2 stages)")
    g = _Graph(seed, first_id=100)
    f32 = np.float32

    def conv(x, scope, c_in, c_out, k, stride=1, pad=0, dil=1, two_d=False, relu=True):
        shape = (c_out, c_in, k, k) if two_d else (c_out, c_in, k)
        w = g.randn(shape, 1.0 / np.sqrt(c_in * k * (k if two_d else 1)), "Conv")
        b = g.randn((c_out,), 0.1, "Conv")
        if two_d:
            attrs = dict(kernel_shape=[k, k], strides=list(stride), pads=[pad, pad, pad, pad])
        else:
            attrs = dict(kernel_shape=[k], strides=[stride], pads=[pad, pad], dilations=[dil])
        y = g.node("Conv", [x, w, b], f"{scope}/Conv", **attrs)
        return g.node("Relu", [y], f"{scope}/Relu") if relu else y

    x = g.node("Transpose", ["input"], "/Transpose", perm=[0, 2, 1])       # [B, 80, T]
    x = g.node("Unsqueeze", [x, g.const([1])], "/Unsqueeze")              # [B, 1, 80, T]
    c = s.fcm_channels
    x = conv(x, "/head/conv1", 1, c, 3, (1, 1), 1, two_d=True)
    for li in (1, 2):
        for bi, stride in enumerate(((2, 1), (1, 1))):
            p = f"/head/layer{li}/{bi}"
            y = conv(x, f"{p}/conv1", c, c, 3, stride, 1, two_d=True)
            y = conv(y, f"{p}/conv2", c, c, 3, (1, 1), 1, two_d=True, relu=False)
            sc = conv(x, f"{p}/shortcut", c, c, 1, stride, 0, two_d=True, relu=False) if stride != (1, 1) else x
            x = g.node("Relu", [g.node("Add", [y, sc], f"{p}/Add")], f"{p}/Relu")
    x = conv(x, "/head/conv2", c, c, 3, (2, 1), 1, two_d=True)
    ch = c * (s.n_mels // 8)
    x = g.node("Reshape", [x, g.const([0, ch, -1])], "/head/Reshape")      # [B, 320, T]
    ch_out = s.init_channels
    x = conv(x, "/xvector/tdnn", ch, ch_out, 5, 2, 2)
    ch = ch_out
    axes_t = g.const([2])
    for bi, (n_layers, dil) in enumerate(zip(s.layers, s.dilations)):
        for li in range(n_layers):
            p = f"/xvector/block{bi + 1}/tdnnd{li + 1}"
            h = g.node("Relu", [x], f"{p}/nonlinear1/Relu")
            h = conv(h, f"{p}/linear1", ch, s.bottleneck, 1)
            y = conv(h, f"{p}/cam_layer/linear_local", s.bottleneck, s.growth, 3, 1, dil, dil, relu=False)
            ctx = g.node("ReduceMean", [h, axes_t], f"{p}/cam_layer/ReduceMean", keepdims=1)
            ctx = conv(ctx, f"{p}/cam_layer/linear1", s.bottleneck, s.bottleneck // 2, 1)
            ctx = conv(ctx, f"{p}/cam_layer/linear2", s.bottleneck // 2, s.growth, 1, relu=False)
            m = g.node("Sigmoid", [ctx], f"{p}/cam_layer/Sigmoid")
            y = g.node("Mul", [y, m], f"{p}/cam_layer/Mul")
            x = g.node("Concat", [x, y], f"{p}/Concat", axis=1)
            ch += s.growth
        p = f"/xvector/transit{bi + 1}"
        x = conv(g.node("Relu", [x], f"{p}/Relu"), p, ch, ch // 2, 1, relu=False)
        ch //= 2
    x = g.node("Relu", [x], "/xvector/out_nonlinear/Relu")
    mean = g.node("ReduceMean", [x, axes_t], "/xvector/stats/ReduceMean", keepdims=1)
    d = g.node("Sub", [x, mean], "/xvector/stats/Sub")
    var = g.node("ReduceMean", [g.node("Mul", [d, d], "/xvector/stats/Mul"), axes_t], "/xvector/stats/ReduceMean",
                 keepdims=0)
    std = g.node("Sqrt", [g.node("Add", [var, g.const(1e-5, f32)], "/xvector/stats/Add")], "/xvector/stats/Sqrt")
    mean = g.node("Squeeze", [mean, axes_t], "/xvector/stats/Squeeze")
    stats = g.node("Concat", [mean, std], "/xvector/stats/Concat", axis=1)  # [B, 2 ch]
    w = g.randn((2 * ch, s.embed_dim), 1.0 / np.sqrt(2 * ch), "MatMul")
    y = g.node("MatMul", [stats, w], "/xvector/dense/MatMul")
    g.nodes.append(g.h.make_node("Add", [y, g.randn((s.embed_dim,), 0.1, "Add")], ["output"],
                                 name="/xvector/dense/Add"))
    return g.model(
        "campplus_like_random",
        [g.h.make_tensor_value_info("input", TensorProto.FLOAT, ["B", "T", s.n_mels])],
        [g.h.make_tensor_value_info("output", TensorProto.FLOAT, ["B", s.embed_dim])],
        "cosyserve random_frontend (CAM++-like D-TDNN stand-in, RANDOM weights)",
    )


def count_parameters(model) -> int:
    """Number of floating-point values in ``model``'s initializers with more than one element
    (weights and tables; scalar constants are not counted)."""
    from onnx import numpy_helper

    n = 0
    for t in model.graph.initializer:
        a = numpy_helper.to_array(t)
        if np.issubdtype(a.dtype, np.floating) and a.size > 1:
            n += a.size
    return n


@dataclass(frozen=True)
class FullSizeFrontend:
    """Sizes of the two generated models (defaults: the released sizes)."""

    tokenizer: S3TokenizerSize = field(default_factory=S3TokenizerSize)
    speaker: CamSize = field(default_factory=CamSize)


def write_full_size_frontend(out_dir: str | Path, seed: int = 0,
                             sizes: FullSizeFrontend = FullSizeFrontend()) -> tuple[Path, Path]:
    """Write ``speech_tokenizer_v2.onnx`` (S3 tokenizer v2 structure) and ``campplus.onnx``
    (CAM++-like) with random weights into ``out_dir`` (replacing existing files); returns
    their paths. Takes ~10 s and ~1.5 GB of memory at full size. Raises OSError on write errors.
    """
    import onnx

    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    tok, spk = out / S3_TOKENIZER_FILE, out / CAMPPLUS_FILE
    for path, build in ((tok, lambda: s3_tokenizer_v2_onnx(sizes.tokenizer, seed + 1)),
                        (spk, lambda: campplus_like_onnx(sizes.speaker, seed))):
        tmp = path.with_suffix(".onnx.tmp")
        onnx.save(build(), str(tmp))
        tmp.replace(path)
    return tok, spk

"""S3 speech tokenizer v2 in PyTorch, built from the weights of ``speech_tokenizer_v2.onnx``.

The official ``speech_tokenizer_v2.onnx`` of CosyVoice2 is a Whisper-sized audio encoder
(two strided convolutions, 6 transformer blocks of width 1280 whose attention adds rotary
position embeddings and an FSMN memory — a depthwise convolution over the values — and a
finite scalar quantizer with 8 ternary digits, 3**8 = 6561 codes). Running it through
onnxruntime one request at a time dominates a per-request prompt's latency; this module runs
it in PyTorch on any device, **batched**: a list of log-mels of different lengths goes
through one padded forward with per-item masks, and each item's tokens equal those of the
item alone (padding reaches no valid position: frames are zeroed before each convolution,
padded keys get no attention weight, the FSMN input is masked).

Algorithm (the architecture of S3Tokenizer's ``S3TokenizerV2``, GitHub
xingchensong/S3Tokenizer ``model_v2.py``, which reproduces the official ONNX graph; this is our
own code written from reading it):

* stem: ``x *= mask``; ``gelu(conv1(x))``; ``x *= mask'``; ``gelu(conv2(x))`` (kernel 3,
  stride 2, padding 1 each: ``T' = ceil(T / 4)``; exact erf GELU);
* each block: ``x += attn(ln1(x)) + fsmn``; ``x += mlp(ln2(x))`` where attention has
  query/value biases and no key bias, rotary embeddings (rotate-half form, theta 10000) on
  query and key, both scaled by ``head_dim ** -0.25``, key padding bias ``-1e10``; the FSMN
  memory is ``(conv_dw(v * m) + v * m) * m`` (depthwise, kernel K, zero padding
  ``(K-1)//2`` left); the MLP is Linear-GELU-Linear;
* quantizer: ``h = tanh(W x + b) * 0.999``; digits ``round(h) + 1`` in {0, 1, 2}; token
  ``sum_i digit_i * 3**i``.

Dimensions come from the ONNX initializers (mels and width from ``conv1``, layers from the
block names, MLP width and FSMN kernel from their weights, digits from the quantizer
projection), LayerNorm epsilons and the stem's strides/paddings from the graph's node
attributes. The head size is the architecture's rotary dimension (64; upstream's
``precompute_freqs_cis(64, ...)``: the rotary tables are 64 wide, so heads are 64 wide).

:func:`load_s3_tokenizer_v2` reads the ONNX file with the ``onnx`` package and returns
``None`` for files without the real structure (the demo / reference stand-ins), which keep
running through onnxruntime (:class:`~cosyserve.frontend.speech_models.SpeechTokenizer`).
Weights are identified the way the official export names them: nodes
``/blocks.{i}/attn/{query,key,value,out}/{MatMul,Add}``, ``/blocks.{i}/{attn_ln,mlp_ln}/
LayerNormalization``, ``/blocks.{i}/attn/fsmn_block/Conv``, ``/blocks.{i}/mlp/mlp.{0,2}/...``;
the two stem convolutions are the graph's ungrouped Conv nodes outside the blocks, in order;
the quantizer projection is the MatMul/Add with a weight outside the blocks.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import ModelDirError

#: Width of the rotary tables, hence of each attention head (upstream ``precompute_freqs_cis(64, ...)``).
ROTARY_DIM = 64
#: Rotary base frequency (upstream ``precompute_freqs_cis`` default).
ROTARY_THETA = 10000.0
#: The quantizer scales ``tanh`` by this before rounding (upstream ``FSQCodebook.encode``).
FSQ_SCALE = 0.9990000128746033
#: Levels of each FSQ digit (``round(h) + 1`` with ``|h| < 1``: 0, 1, 2).
FSQ_LEVELS = 3
#: Additive bias of padded keys (upstream ``mask_to_bias``).
PAD_BIAS = -1.0e10


@dataclass(frozen=True)
class ConvSpec:
    """One stem convolution: kernel size, stride and symmetric padding (frames)."""

    kernel: int
    stride: int
    padding: int

    def out_len(self, n):
        """Output length for input length ``n`` (int or int tensor)."""
        return (n + 2 * self.padding - self.kernel) // self.stride + 1


@dataclass(frozen=True)
class S3TokenizerDims:
    """Dimensions of an S3 tokenizer v2 (all read from an ONNX file by :func:`read_s3_tokenizer_v2`).

    The released model: ``n_mels`` 128, ``n_state`` 1280, ``n_head`` 20, ``n_layer`` 6,
    ``n_mlp`` 5120, ``fsmn_kernel`` 31, ``n_digits`` 8 (6561 codes), stem ``(3, 2, 1)`` twice,
    LayerNorm epsilons 1e-6 (attention) and 1e-5 (MLP).
    """

    n_mels: int
    n_state: int
    n_head: int
    n_layer: int
    n_mlp: int
    fsmn_kernel: int
    n_digits: int
    conv1: ConvSpec
    conv2: ConvSpec
    attn_ln_eps: float
    mlp_ln_eps: float

    @property
    def head_dim(self) -> int:
        return self.n_state // self.n_head

    @property
    def codebook_size(self) -> int:
        return FSQ_LEVELS ** self.n_digits

    def token_lengths(self, frames):
        """Token count for ``frames`` log-mel frames (int or int tensor): ``ceil(T / 4)`` for the released stem."""
        return self.conv2.out_len(self.conv1.out_len(frames))


def rotary_tables(n: int, dim: int = ROTARY_DIM, theta: float = ROTARY_THETA,
                  device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` float32 ``[n, dim]`` of the rotate-half rotary embedding for positions ``0..n-1``
    (frequencies ``theta ** (-2j / dim)``, each repeated for both halves; computed in float32
    as upstream ``precompute_freqs_cis`` does)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device)[: dim // 2].float() / dim))
    angles = torch.outer(torch.arange(n, device=device, dtype=torch.float32), freqs)
    cos, sin = torch.cos(angles), torch.sin(angles)
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class _Block(torch.nn.Module):
    """One FSMN-attention transformer block (module names follow the official export)."""

    def __init__(self, d: S3TokenizerDims):
        super().__init__()
        n = d.n_state
        self.n_head = d.n_head
        self.attn_ln = torch.nn.LayerNorm(n, eps=d.attn_ln_eps)
        self.query = torch.nn.Linear(n, n)
        self.key = torch.nn.Linear(n, n, bias=False)
        self.value = torch.nn.Linear(n, n)
        self.out = torch.nn.Linear(n, n)
        self.fsmn = torch.nn.Conv1d(n, n, d.fsmn_kernel, groups=n, bias=False)
        self.fsmn_left = (d.fsmn_kernel - 1) // 2
        self.mlp_ln = torch.nn.LayerNorm(n, eps=d.mlp_ln_eps)
        self.fc1 = torch.nn.Linear(n, d.n_mlp)
        self.fc2 = torch.nn.Linear(d.n_mlp, n)

    def forward(self, x: torch.Tensor, frame_mask: torch.Tensor, key_mask: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, n = x.shape
        h = self.attn_ln(x)
        q = self.query(h).view(b, t, self.n_head, -1)
        k = self.key(h).view(b, t, self.n_head, -1)
        v = self.value(h)
        # FSMN memory over the (masked) values
        vm = v * frame_mask
        pad = (self.fsmn_left, self.fsmn.kernel_size[0] - 1 - self.fsmn_left)
        mem = (F.conv1d(F.pad(vm.transpose(1, 2), pad), self.fsmn.weight, groups=n).transpose(1, 2) + vm) * frame_mask
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        scale = q.shape[-1] ** -0.25
        q = q.transpose(1, 2) * scale
        k = k.transpose(1, 2) * scale
        vh = v.view(b, t, self.n_head, -1).transpose(1, 2)
        att = F.scaled_dot_product_attention(q, k, vh, attn_mask=key_mask, scale=1.0)
        x = x + self.out(att.transpose(1, 2).reshape(b, t, n)) + mem
        return x + self.fc2(F.gelu(self.fc1(self.mlp_ln(x))))


class S3TokenizerV2Model(torch.nn.Module):
    """The S3 tokenizer v2 network (see module docstring).

    ``forward(mel, lengths)``: ``mel`` float ``[B, n_mels, T]`` whisper log-mel (100
    frames/s, padding after each item's ``lengths[i]`` frames is ignored), ``lengths`` int
    ``[B]``; returns ``(tokens int32 [B, T'], token_lengths int64 [B])`` with
    ``T' = ceil(T / 4)`` (positions past ``token_lengths[i]`` are padding, not tokens).
    Runs in the parameters' dtype (float32 as loaded) on their device.
    """

    def __init__(self, dims: S3TokenizerDims):
        super().__init__()
        if dims.n_state % dims.n_head:
            raise ValueError(f"width {dims.n_state} is not a multiple of {dims.n_head} heads")
        self.dims = dims
        self.conv1 = torch.nn.Conv1d(dims.n_mels, dims.n_state, dims.conv1.kernel, dims.conv1.stride,
                                     dims.conv1.padding)
        self.conv2 = torch.nn.Conv1d(dims.n_state, dims.n_state, dims.conv2.kernel, dims.conv2.stride,
                                     dims.conv2.padding)
        self.blocks = torch.nn.ModuleList([_Block(dims) for _ in range(dims.n_layer)])
        self.project_down = torch.nn.Linear(dims.n_state, dims.n_digits)
        self.register_buffer("powers", FSQ_LEVELS ** torch.arange(dims.n_digits, dtype=torch.float32),
                             persistent=False)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def _rotary(self, n: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope is None or self._rope[0].shape[0] < n or self._rope[0].device != device:
            self._rope = rotary_tables(max(n, 1024), self.dims.head_dim, device=device)
        cos, sin = (t[:n].to(dtype)[None, :, None, :] for t in self._rope)
        return cos, sin

    @staticmethod
    def _mask(lengths: torch.Tensor, n: int) -> torch.Tensor:
        return torch.arange(n, device=lengths.device)[None, :] < lengths[:, None]  # [B, n] bool

    def encode(self, mel: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder output before quantization: float ``[B, T', n_state]`` and ``token_lengths`` ``[B]``."""
        d = self.dims
        p = self.conv1.weight
        x = mel.to(p.device, p.dtype)
        lengths = lengths.to(p.device, torch.long)
        x = x * self._mask(lengths, x.shape[-1])[:, None, :].to(x.dtype)
        x = F.gelu(self.conv1(x))
        lengths = d.conv1.out_len(lengths)
        x = x * self._mask(lengths, x.shape[-1])[:, None, :].to(x.dtype)
        x = F.gelu(self.conv2(x))
        lengths = d.conv2.out_len(lengths)
        mask = self._mask(lengths, x.shape[-1])
        x = x.transpose(1, 2)
        frame_mask = mask[:, :, None].to(x.dtype)
        key_mask = mask[:, None, None, :]
        cos, sin = self._rotary(x.shape[1], x.device, x.dtype)
        for blk in self.blocks:
            x = blk(x, frame_mask, key_mask, cos, sin)
        return x, lengths

    def quantize(self, hidden: torch.Tensor) -> torch.Tensor:
        """FSQ codes int32 ``[B, T']`` of encoder output ``[B, T', n_state]`` (computed in float32)."""
        h = torch.tanh(self.project_down(hidden).float()) * FSQ_SCALE
        return ((h.round() + 1.0) * self.powers).sum(-1).to(torch.int32)

    @torch.inference_mode()
    def forward(self, mel: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, lengths = self.encode(mel, lengths)
        return self.quantize(hidden), lengths

    @torch.inference_mode()
    def tokenize(self, mels: list[torch.Tensor]) -> list[torch.Tensor]:
        """Tokens of several utterances in ONE padded forward.

        Args:
            mels: float ``[n_mels, T_i]`` (or ``[1, n_mels, T_i]``) log-mels, any lengths ``T_i >= 1``.
        Returns:
            int32 ``[1, ceil(T_i / 4)]`` per item, on this model's device.
        """
        if not mels:
            return []
        mels = [m[0] if m.dim() == 3 else m for m in mels]
        for m in mels:
            if m.dim() != 2 or m.shape[0] != self.dims.n_mels or m.shape[1] == 0:
                raise ValueError(f"S3 tokenizer expects log-mels [{self.dims.n_mels}, T>0], got {tuple(m.shape)}")
        lengths = torch.tensor([m.shape[1] for m in mels])
        dev = self.conv1.weight.device
        batch = torch.zeros(len(mels), self.dims.n_mels, int(lengths.max()), device=dev)
        for i, m in enumerate(mels):
            batch[i, :, : m.shape[1]] = m.to(dev, non_blocking=True)
        codes, out_len = self(batch, lengths)
        return [codes[i : i + 1, : int(n)] for i, n in enumerate(out_len.tolist())]


# ---------------------------------------------------------------------------- ONNX loading

_BLOCK = re.compile(r"^blocks\.(\d+)$")


def _scope(node_name: str) -> list[str]:
    """``"/blocks.0/attn/query/MatMul"`` -> ``["blocks.0", "attn", "query"]`` (the module path)."""
    parts = [p for p in node_name.split("/") if p]
    return parts[:-1]


def _attr(node, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            import onnx

            return onnx.helper.get_attribute_value(a)
    return default


def _conv_spec(node, weight) -> ConvSpec:
    k = int(weight.shape[-1])
    strides = list(_attr(node, "strides", [1]))
    pads = list(_attr(node, "pads", [0, 0]))
    dil = list(_attr(node, "dilations", [1]))
    if len(strides) != 1 or len(pads) != 2 or pads[0] != pads[1] or dil != [1]:
        raise ModelDirError(f"unexpected stem convolution {node.name!r}: strides {strides} pads {pads} dilations {dil}")
    return ConvSpec(k, int(strides[0]), int(pads[0]))


def read_s3_tokenizer_v2(path: str | os.PathLike) -> tuple[S3TokenizerDims, dict[str, torch.Tensor]] | None:
    """Dimensions and a state dict of :class:`S3TokenizerV2Model` from ``speech_tokenizer_v2.onnx``.

    Returns ``None`` when the graph lacks the real structure (no ``/blocks.N/...`` nodes:
    a stand-in). Raises :class:`~cosyserve.errors.ModelDirError` for an unreadable file or a
    real-structure graph with missing or mis-shaped weights (naming what is wrong).
    """
    import onnx
    from onnx import numpy_helper

    path = Path(path)
    try:
        model = onnx.load(str(path))
    except Exception as exc:  # noqa: BLE001 - protobuf / IO errors
        raise ModelDirError(f"cannot read '{path}' as ONNX: {exc}") from None
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    consts = {}
    for node in g.node:  # Constant nodes holding tensors count as weights too
        if node.op_type == "Constant" and node.output:
            v = _attr(node, "value")
            if v is not None:
                consts[node.output[0]] = v

    def weight(name):
        t = inits.get(name) or consts.get(name)
        return None if t is None else torch.from_numpy(numpy_helper.to_array(t).copy())

    blocks: dict[int, dict[str, torch.Tensor]] = {}
    eps: dict[int, dict[str, float]] = {}
    stem: list[tuple] = []
    quant: dict[str, torch.Tensor] = {}
    for node in g.node:
        ws = [(i, weight(n)) for i, n in enumerate(node.input) if n in inits or n in consts]
        ws = [(i, w) for i, w in ws if w is not None and w.dim() >= 1 and w.is_floating_point()]
        if not ws:
            continue
        scope = _scope(node.name)
        bi = next((j for j, p in enumerate(scope) if _BLOCK.match(p)), None)
        if bi is None:
            if node.op_type == "Conv" and int(_attr(node, "group", 1)) == 1 and ws[0][1].dim() == 3:
                stem.append((node, ws[0][1], ws[1][1] if len(ws) > 1 else None))
            elif node.op_type == "MatMul" and ws[0][1].dim() == 2:
                quant["w"] = ws[0][1].t()
            elif node.op_type == "Add" and "w" in quant and ws[0][1].dim() == 1 \
                    and ws[0][1].numel() == quant["w"].shape[0]:
                quant["b"] = ws[0][1]
            continue
        idx = int(_BLOCK.match(scope[bi]).group(1))
        sub = scope[bi + 1:]
        b = blocks.setdefault(idx, {})
        if node.op_type == "LayerNormalization" and sub and sub[-1] in ("attn_ln", "mlp_ln"):
            scale = weight(node.input[1])
            bias = weight(node.input[2]) if len(node.input) > 2 else None
            if scale is None or bias is None:
                raise ModelDirError(f"'{path}': LayerNorm {node.name!r} lacks a constant scale or bias")
            b[f"{sub[-1]}.weight"], b[f"{sub[-1]}.bias"] = scale, bias
            eps.setdefault(idx, {})[sub[-1]] = float(_attr(node, "epsilon", 1e-5))
        elif node.op_type == "Conv" and sub and sub[-1] == "fsmn_block":
            b["fsmn.weight"] = ws[0][1]
        elif node.op_type in ("MatMul", "Add") and len(sub) >= 2:
            owner = {("attn", "query"): "query", ("attn", "key"): "key", ("attn", "value"): "value",
                     ("attn", "out"): "out", ("mlp", "mlp.0"): "fc1", ("mlp", "0"): "fc1",
                     ("mlp", "mlp.2"): "fc2", ("mlp", "2"): "fc2"}.get((sub[-2], sub[-1]))
            if owner is None:
                continue
            w = ws[0][1]
            if node.op_type == "MatMul" and w.dim() == 2:
                b[f"{owner}.weight"] = w.t()
            elif node.op_type == "Add" and w.dim() == 1:
                b[f"{owner}.bias"] = w
    if not blocks:
        return None
    if len(stem) != 2:
        raise ModelDirError(f"'{path}': expected 2 stem convolutions outside the blocks, found {len(stem)}")
    if set(quant) != {"w", "b"}:
        raise ModelDirError(f"'{path}': the quantizer projection (MatMul + Add outside the blocks) is missing")
    n_layer = max(blocks) + 1
    need = ["attn_ln.weight", "attn_ln.bias", "query.weight", "query.bias", "key.weight", "value.weight",
            "value.bias", "out.weight", "out.bias", "fsmn.weight", "mlp_ln.weight", "mlp_ln.bias",
            "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    for i in range(n_layer):
        missing = [k for k in need if k not in blocks.get(i, {})]
        if missing:
            raise ModelDirError(f"'{path}': block {i} lacks {', '.join(missing)}")
    (n1, w1, b1), (n2, w2, b2) = stem
    n_state, n_mels = int(w1.shape[0]), int(w1.shape[1])
    if n_state % ROTARY_DIM:
        raise ModelDirError(f"'{path}': width {n_state} is not a multiple of the rotary/head size {ROTARY_DIM}")
    dims = S3TokenizerDims(
        n_mels=n_mels, n_state=n_state, n_head=n_state // ROTARY_DIM, n_layer=n_layer,
        n_mlp=int(blocks[0]["fc1.weight"].shape[0]), fsmn_kernel=int(blocks[0]["fsmn.weight"].shape[-1]),
        n_digits=int(quant["w"].shape[0]), conv1=_conv_spec(n1, w1), conv2=_conv_spec(n2, w2),
        attn_ln_eps=eps[0].get("attn_ln", 1e-5), mlp_ln_eps=eps[0].get("mlp_ln", 1e-5),
    )
    sd = {"conv1.weight": w1, "conv2.weight": w2, "project_down.weight": quant["w"], "project_down.bias": quant["b"]}
    if b1 is not None:
        sd["conv1.bias"] = b1
    if b2 is not None:
        sd["conv2.bias"] = b2
    for i, b in blocks.items():
        sd.update({f"blocks.{i}.{k}": v for k, v in b.items()})
    return dims, sd


def load_s3_tokenizer_v2(path: str | os.PathLike, device: str | torch.device = "cpu") -> S3TokenizerV2Model | None:
    """:class:`S3TokenizerV2Model` with the weights of ``path`` on ``device`` (float32, eval mode), or
    ``None`` for a file without the real structure (see :func:`read_s3_tokenizer_v2`).

    Raises :class:`~cosyserve.errors.ModelDirError` when the weights do not fit the
    architecture (lists missing, unexpected and mis-shaped tensors).
    """
    got = read_s3_tokenizer_v2(path)
    if got is None:
        return None
    dims, sd = got
    with torch.device("meta"):
        model = S3TokenizerV2Model(dims)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    shapes = [f"{k} {tuple(sd[k].shape)} != {tuple(expected[k].shape)}" for k in expected
              if k in sd and tuple(sd[k].shape) != tuple(expected[k].shape)]
    if missing or unexpected or shapes:
        raise ModelDirError(f"'{path}' does not fit the S3 tokenizer v2 architecture: missing {missing}, "
                            f"unexpected {unexpected}, mis-shaped {shapes}")
    model.load_state_dict({k: v.float().contiguous() for k, v in sd.items()}, assign=True)
    model.powers = FSQ_LEVELS ** torch.arange(dims.n_digits, dtype=torch.float32)
    return model.to(device).eval()

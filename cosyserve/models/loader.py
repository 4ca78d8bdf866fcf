"""Load an official CosyVoice2 / CosyVoice3 model directory, or build a random-weight model from a yaml.

Official layout (``CosyVoice2-0.5B``; ``Fun-CosyVoice3-0.5B-2512`` has ``cosyvoice3.yaml`` and
``speech_tokenizer_v3.onnx`` instead)::

    cosyvoice2.yaml            hyperparameters (parsed as data, see config.py)
    llm.pt  flow.pt  hift.pt   state dicts of the speech LM, flow and HiFT (float32)
    campplus.onnx              CAM++ speaker embedding (ONNX)
    speech_tokenizer_v2.onnx   S3Tokenizer v2 (ONNX)
    CosyVoice-BlankEN/         Qwen2 config.json + tokenizer files (vocab.json, merges.txt, ...)
    spk2info.pt                optional speaker cache

The family is recognised from the yaml present (as upstream ``AutoModel`` does); a directory
with both yamls is refused as ambiguous.

Everything is checked up front: a missing file, or a checkpoint whose keys/shapes differ
from the architecture the yaml describes, fails with one :class:`ModelDirError` /
:class:`CheckpointError` naming the file and the mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ModelDirError
from .checkpoint import load_strict, normalize_weight_norm_keys, read_state_dict
from .config import MODEL_FAMILIES, QWEN_DIR, CosyVoice2Config, load_config
from .llm import SpeechLM

YAML_NAME = "cosyvoice2.yaml"
#: the speech tokenizer file of each family
SPEECH_TOKENIZER_FILES = {"cosyvoice2": "speech_tokenizer_v2.onnx", "cosyvoice3": "speech_tokenizer_v3.onnx"}
#: marks a ``--random-weights`` directory: no weight files, networks built from the yaml
RANDOM_WEIGHTS_MARKER = "RANDOM_WEIGHTS_NO_FILES.json"
LLM_FILE = "llm.pt"
FLOW_FILE = "flow.pt"
HIFT_FILE = "hift.pt"
CAMPPLUS_FILE = "campplus.onnx"
SPEECH_TOKENIZER_FILE = "speech_tokenizer_v2.onnx"
SPK2INFO_FILE = "spk2info.pt"
QWEN_FILES = ("config.json", "vocab.json", "merges.txt", "tokenizer_config.json")


@dataclass(frozen=True)
class ModelDir:
    """Validated paths of a model directory; ``family`` is ``"cosyvoice2"`` or ``"cosyvoice3"``."""

    root: Path
    family: str = "cosyvoice2"

    @property
    def yaml(self) -> Path:
        return self.root / MODEL_FAMILIES[self.family]["yaml"]

    @property
    def llm(self) -> Path:
        return self.root / LLM_FILE

    @property
    def flow(self) -> Path:
        return self.root / FLOW_FILE

    @property
    def hift(self) -> Path:
        return self.root / HIFT_FILE

    @property
    def campplus(self) -> Path:
        return self.root / CAMPPLUS_FILE

    @property
    def speech_tokenizer(self) -> Path:
        return self.root / SPEECH_TOKENIZER_FILES[self.family]

    @property
    def qwen(self) -> Path:
        return self.root / QWEN_DIR

    @property
    def spk2info(self) -> Path | None:
        p = self.root / SPK2INFO_FILE
        return p if p.is_file() else None


def detect_model_family(root: Path) -> str:
    """``"cosyvoice2"`` or ``"cosyvoice3"``: which official yaml ``root`` holds. Raises
    :class:`ModelDirError` if it holds neither (or both)."""
    found = [f for f, m in MODEL_FAMILIES.items() if (root / m["yaml"]).is_file()]
    names = " or ".join(m["yaml"] for m in MODEL_FAMILIES.values())
    if not found:
        raise ModelDirError(f"{root} is not a CosyVoice model directory: it has no {names}")
    if len(found) > 1:
        raise ModelDirError(f"{root} holds both {names}; keep the one of the model whose weights are there")
    return found[0]


def open_model_dir(path: str | Path, need: tuple[str, ...] = ("llm", "flow", "hift", "onnx", "qwen")) -> ModelDir:
    """Check that ``path`` is a CosyVoice2 or CosyVoice3 model directory; return its :class:`ModelDir`.

    The family comes from the yaml present (``cosyvoice2.yaml`` / ``cosyvoice3.yaml``), and
    with it the speech tokenizer's file name (``speech_tokenizer_v2.onnx`` / ``_v3``).
    ``need`` selects which parts must be present (``llm``, ``flow``, ``hift``, ``onnx``,
    ``qwen``); a random-weights directory (``RANDOM_WEIGHTS_MARKER``) needs no weight files.
    Raises :class:`ModelDirError` listing every missing file.
    """
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ModelDirError(f"model directory {root} does not exist or is not a directory")
    yamls = [m["yaml"] for m in MODEL_FAMILIES.values()]
    no_yaml = not any((root / y).is_file() for y in yamls)
    # without a yaml, list what a CosyVoice2 directory lacks (naming both yamls)
    md = ModelDir(root.resolve(), "cosyvoice2" if no_yaml else detect_model_family(root))
    if (root / RANDOM_WEIGHTS_MARKER).is_file():
        need = tuple(n for n in need if n not in ("llm", "flow", "hift")) + (("qwen",) if "llm" in need else ())
    files = [" or ".join(yamls) if no_yaml else md.yaml.name]
    if "llm" in need:
        files.append(LLM_FILE)
    if "flow" in need:
        files.append(FLOW_FILE)
    if "hift" in need:
        files.append(HIFT_FILE)
    if "onnx" in need:
        files += [CAMPPLUS_FILE, md.speech_tokenizer.name]
    if "qwen" in need or "llm" in need:
        files += [f"{QWEN_DIR}/{f}" for f in QWEN_FILES]
    missing = [f for f in files if not (root / f).is_file()]
    if missing:
        kind = "CosyVoice3" if md.family == "cosyvoice3" else "CosyVoice2"
        raise ModelDirError(f"{root} is not a complete {kind} model directory: missing {', '.join(missing)}")
    return md


@dataclass
class CosyVoice2Models:
    """The three networks of a CosyVoice2 / CosyVoice3 model and the configuration they were built from."""

    cfg: CosyVoice2Config
    llm: SpeechLM | None
    flow: "torch.nn.Module | None"
    hift: "torch.nn.Module | None"
    #: a Step-Audio2 DiT token2wav (``--token2wav-dir``, :class:`~cosyserve.models.dit_token2wav.DitToken2Wav`);
    #: when set, ``flow``/``hift`` are its networks and the engine uses the DiT token2wav backend
    dit: "object | None" = None


def _flow_cls(cfg: CosyVoice2Config):
    """The flow module class of ``cfg``'s family: :class:`~cosyserve.models.cv3_flow.CV3FlowModel`
    (CosyVoice3, ``CausalMaskedDiffWithDiT``) or :class:`~cosyserve.models.flow.FlowModel`."""
    if cfg.is_cosyvoice3:
        from .cv3_flow import CV3FlowModel

        return CV3FlowModel
    from .flow import FlowModel

    return FlowModel


def _hift_cls(cfg: CosyVoice2Config):
    """The vocoder class of ``cfg``'s family: :class:`~cosyserve.models.hift.CausalHiFTGenerator`
    (CosyVoice3) or :class:`~cosyserve.models.hift.HiFTGenerator`."""
    from .hift import CausalHiFTGenerator, HiFTGenerator

    return CausalHiFTGenerator if cfg.is_cosyvoice3 else HiFTGenerator


def load_llm(md: ModelDir, cfg: CosyVoice2Config, device="cpu", dtype=torch.float32) -> SpeechLM:
    """Build the speech LM on the meta device and assign ``llm.pt``'s tensors (strict)."""
    with torch.device("meta"):
        lm = SpeechLM(cfg.llm)
    sd = read_state_dict(md.llm)
    load_strict(lm, sd, str(md.llm), assign=True)
    lm.reset_rotary("cpu")
    lm.to(device=device, dtype=dtype)
    # Keep the (unused) text lm_head tied to the token embedding, as in the checkpoint.
    lm.llm.model.lm_head.weight = lm.backbone.embed_tokens.weight
    lm.setup_rope()
    return lm.eval()


def load_flow(md: ModelDir, cfg: CosyVoice2Config, device="cpu", dtype=torch.float32):
    """Build the flow model and load ``flow.pt`` strictly."""
    flow = _flow_cls(cfg)(cfg.flow)
    load_strict(flow, read_state_dict(md.flow), str(md.flow))
    return flow.to(device=device, dtype=dtype).eval()


def load_hift(md: ModelDir, cfg: CosyVoice2Config, device="cpu", dtype=torch.float32, fold_weight_norm: bool = True):
    """Build HiFT and load ``hift.pt`` strictly (either weight-norm key spelling)."""
    hift = _hift_cls(cfg)(cfg.hift)
    sd = normalize_weight_norm_keys(read_state_dict(md.hift), strip_prefix="generator.")
    load_strict(hift, sd, str(md.hift))
    if fold_weight_norm:
        hift.remove_weight_norm()
    return hift.to(device=device, dtype=dtype).eval()


def load_models(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    components: tuple[str, ...] = ("llm", "flow", "hift"),
) -> CosyVoice2Models:
    """Load the networks of an official CosyVoice2 or CosyVoice3 model directory.

    ``dtype`` applies to the LM and flow; HiFT always runs in float32 (its source
    excitation and iSTFT are precision-sensitive, as upstream keeps it in float32).
    Raises :class:`ModelDirError` / :class:`CheckpointError` with the file and mismatch.
    """
    md = open_model_dir(model_dir, need=tuple(components) + ("qwen",) if "llm" in components else tuple(components))
    cfg = load_config(md.yaml)
    return CosyVoice2Models(
        cfg=cfg,
        llm=load_llm(md, cfg, device, dtype) if "llm" in components else None,
        flow=load_flow(md, cfg, device, dtype) if "flow" in components else None,
        hift=load_hift(md, cfg, device) if "hift" in components else None,
    )


def attach_dit_token2wav(models: CosyVoice2Models, token2wav_dir: str | Path, device="cpu",
                         dtype=torch.float32) -> CosyVoice2Models:
    """Use the Step-Audio2 DiT token2wav of ``token2wav_dir`` as the models' flow + HiFT (the LM and
    the frontend stay CosyVoice2's). Raises :class:`ModelDirError` / :class:`CheckpointError` /
    ``ConfigError`` naming the file, or :class:`ModelDirError` when the two models disagree on the
    sample rate or the speech-token vocabulary."""
    from .dit_token2wav import load_dit_token2wav

    t2w = load_dit_token2wav(token2wav_dir, device=device, dtype=dtype)
    if t2w.sample_rate != models.cfg.sample_rate:
        raise ModelDirError(f"{token2wav_dir}: HiFT produces {t2w.sample_rate} Hz, the model {models.cfg.sample_rate} Hz")
    if t2w.flow.cfg.vocab_size < models.cfg.llm.speech_token_size:
        raise ModelDirError(f"{token2wav_dir}: flow vocabulary {t2w.flow.cfg.vocab_size} is smaller than the LM's "
                            f"{models.cfg.llm.speech_token_size} speech tokens")
    models.flow, models.hift, models.dit = t2w.flow, t2w.hift, t2w
    return models


def build_random(
    yaml_path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    qwen_config_path: str | Path | None = None,
    components: tuple[str, ...] = ("llm", "flow", "hift"),
    fold_weight_norm: bool = True,
) -> CosyVoice2Models:
    """Random-weight CosyVoice2 / CosyVoice3 networks built from a yaml alone (for benchmarks/demos).

    The Qwen2 config is read from ``qwen_config_path`` or ``<yaml dir>/CosyVoice-BlankEN/
    config.json``. Weights use each module's default initialisation under
    ``torch.manual_seed(seed)`` on a private RNG fork (the global RNG is left untouched).
    ``fold_weight_norm=False`` keeps HiFT's weight-norm parametrisation (to save a
    checkpoint with the official key spelling).
    """
    cfg = load_config(yaml_path, qwen_config_path)
    if "llm" in components and not cfg.llm.qwen:
        raise ModelDirError(f"no Qwen2 config.json found for {yaml_path} (pass qwen_config_path)")
    devices = [torch.device(device)] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        with torch.device(device):
            llm = SpeechLM(cfg.llm) if "llm" in components else None
            flow = _flow_cls(cfg)(cfg.flow) if "flow" in components else None
            hift = _hift_cls(cfg)(cfg.hift) if "hift" in components else None
    if llm is not None:
        llm.to(dtype=dtype).eval()
        llm.setup_rope()
    if flow is not None:
        flow.to(dtype=dtype).eval()
    if hift is not None:
        if fold_weight_norm:
            hift.remove_weight_norm()
        hift.to(device).eval()  # also its CPU-created buffers (the STFT window)
    return CosyVoice2Models(cfg=cfg, llm=llm, flow=flow, hift=hift)

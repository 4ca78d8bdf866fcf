"""Strict checkpoint loading for the official ``llm.pt`` / ``flow.pt`` / ``hift.pt`` files.

The official files are ``torch.save(module.state_dict())`` dicts of float32 tensors.
cosyserve's modules reproduce upstream's module trees, so their ``state_dict()`` keys
are exactly the checkpoint keys; loading is strict: a missing key, an unexpected key or
a shape mismatch fails with one :class:`~cosyserve.errors.CheckpointError` naming the
file and listing the differences. Nothing is ever silently ignored.

Key spellings accepted for weight-normalised convolutions (HiFT): the
``torch.nn.utils.parametrizations.weight_norm`` spelling
(``<m>.parametrizations.weight.original0`` = g, ``original1`` = v) used by the official
files, and the older ``torch.nn.utils.weight_norm`` spelling (``<m>.weight_g`` /
``<m>.weight_v``), which is renamed on load. A ``generator.`` key prefix (HiFT files
saved from the GAN wrapper) is stripped, as upstream does.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from ..errors import CheckpointError

_MAX_LISTED = 8


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a ``torch.save``'d state dict with ``weights_only=True`` (memory-mapped).

    Returns a dict of CPU tensors. Raises :class:`CheckpointError` if the file is
    missing, not a torch checkpoint, or not a flat ``{str: Tensor}`` mapping.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} not found")
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # zip errors, unpickling errors, truncated files
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:
            raise CheckpointError(f"{path} is not a readable torch checkpoint ({type(exc).__name__}: {exc})") from None
    if isinstance(sd, Mapping) and "state_dict" in sd and isinstance(sd["state_dict"], Mapping):
        sd = sd["state_dict"]
    if not isinstance(sd, Mapping) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise CheckpointError(f"{path} is not a state dict (a mapping from parameter names to tensors)")
    return dict(sd)


def normalize_weight_norm_keys(sd: Mapping[str, torch.Tensor], strip_prefix: str | None = None) -> dict[str, torch.Tensor]:
    """Rename legacy ``weight_g``/``weight_v`` keys to the parametrizations spelling.

    Also strips ``strip_prefix`` (e.g. ``"generator."``) from keys that start with it.
    """
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if strip_prefix and k.startswith(strip_prefix):
            k = k[len(strip_prefix):]
        if k.endswith(".weight_g"):
            k = k[: -len(".weight_g")] + ".parametrizations.weight.original0"
        elif k.endswith(".weight_v"):
            k = k[: -len(".weight_v")] + ".parametrizations.weight.original1"
        out[k] = v
    return out


def _fmt(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    more = len(items) - _MAX_LISTED
    return shown + (f", ... ({more} more)" if more > 0 else "")


def check_state_dict(expected: Mapping[str, tuple], actual: Mapping[str, torch.Tensor], source: str) -> None:
    """Compare checkpoint keys/shapes with ``expected`` (key -> shape); raise on any mismatch."""
    missing = [k for k in expected if k not in actual]
    unexpected = [k for k in actual if k not in expected]
    wrong = [
        f"{k}: checkpoint {tuple(actual[k].shape)} vs model {tuple(expected[k])}"
        for k in expected
        if k in actual and tuple(actual[k].shape) != tuple(expected[k])
    ]
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing key(s): {_fmt(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected key(s): {_fmt(unexpected)}")
        if wrong:
            parts.append(f"{len(wrong)} shape mismatch(es): {_fmt(wrong)}")
        raise CheckpointError(
            f"{source} does not match the architecture in cosyvoice2.yaml: " + "; ".join(parts)
        )


def expected_shapes(module: nn.Module) -> dict[str, tuple]:
    """``{key: shape}`` of ``module.state_dict()`` (works on meta-device modules)."""
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def load_strict(module: nn.Module, sd: Mapping[str, torch.Tensor], source: str, assign: bool = False) -> None:
    """Load ``sd`` into ``module`` strictly after a readable key/shape comparison.

    ``assign=True`` swaps the module's (e.g. meta) tensors for the checkpoint tensors
    instead of copying, as gpt-fast does. Dtypes are converted to the module's dtype.
    Raises :class:`CheckpointError` naming ``source`` on any mismatch.
    """
    exp = module.state_dict()
    check_state_dict({k: tuple(v.shape) for k, v in exp.items()}, sd, source)
    if assign:
        sd = {k: (v.to(exp[k].dtype) if v.dtype != exp[k].dtype and exp[k].dtype.is_floating_point else v)
              for k, v in sd.items()}
    try:
        module.load_state_dict(sd, strict=True, assign=assign)
    except RuntimeError as exc:  # pragma: no cover - check_state_dict catches the known cases
        raise CheckpointError(f"{source}: {exc}") from None

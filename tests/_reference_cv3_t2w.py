"""Discovery of the CosyVoice3 golden data for the flow / HiFT / token2wav tests.

The CosyVoice3 reference root (a directory holding ``tiny_cosyvoice3/`` + ``cases/`` +
``manifests/``) is, in order: ``$COSYSERVE_CV3_REFERENCE_DIR``; ``$COSYSERVE_REFERENCE_DIR`` itself
when it directly holds ``tiny_cosyvoice3/`` and ``cases/``; ``<reference>/cosyvoice3`` for the
reference directory of :mod:`tests._reference`. Cases are found from their sidecars by ``kind``, the
tensors they hold and other sidecar fields, never by name; tests skip when nothing is found.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

from _reference import reference_dir


def _is_root(p: Path) -> bool:
    return (p / "cases").is_dir() and any(p.glob("tiny_cosyvoice3*"))


@functools.lru_cache(maxsize=None)
def cv3_reference_dir() -> Path | None:
    env = os.environ.get("COSYSERVE_CV3_REFERENCE_DIR")
    if env:
        p = Path(env).expanduser().resolve()
        if not (p / "cases").is_dir():
            raise RuntimeError(f"COSYSERVE_CV3_REFERENCE_DIR={env} has no cases/ folder")
        return p
    env = os.environ.get("COSYSERVE_REFERENCE_DIR")
    if env and _is_root(Path(env).expanduser()):
        return Path(env).expanduser().resolve()
    try:
        base = reference_dir()
    except RuntimeError:  # COSYSERVE_REFERENCE_DIR names a folder without cases/ (and no CV3 root)
        return None
    if base is not None and _is_root(base / "cosyvoice3"):
        return (base / "cosyvoice3").resolve()
    return None


def require_cv3() -> Path:
    import pytest

    d = cv3_reference_dir()
    if d is None:
        pytest.skip("CosyVoice3 reference data not found (COSYSERVE_CV3_REFERENCE_DIR or <reference>/cosyvoice3)")
    return d


@functools.lru_cache(maxsize=None)
def _sidecars() -> tuple[tuple[str, dict], ...]:
    d = cv3_reference_dir()
    if d is None:
        return ()
    out = []
    for j in sorted((d / "cases").glob("*.json")):
        try:
            meta = json.loads(j.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            continue
        if isinstance(meta, dict) and "kind" in meta and (j.with_suffix(".safetensors")).is_file():
            out.append((j.stem, meta))
    return tuple(out)


def discover(kind: str, has: tuple[str, ...] = (), where=None) -> list[str]:
    """Names of CosyVoice3 cases of ``kind`` whose sidecar lists every tensor in ``has`` and
    satisfies ``where`` (a predicate on the sidecar dict)."""
    return [n for n, m in _sidecars()
            if m.get("kind") == kind and all(t in m.get("tensors", {}) for t in has) and (where is None or where(m))]


def meta(name: str) -> dict:
    return json.loads((require_cv3() / "cases" / f"{name}.json").read_text(encoding="utf-8"))


@functools.lru_cache(maxsize=32)
def _tensors(name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(require_cv3() / "cases" / f"{name}.safetensors"))


def tensors(name: str) -> dict[str, torch.Tensor]:
    """The case's tensors (fresh clones)."""
    return {k: v.clone() for k, v in _tensors(name).items()}


def model_dir() -> Path:
    """The tiny model directory (``cases/index.json``'s ``model_dir``, default ``tiny_cosyvoice3``)."""
    d = require_cv3()
    name = "tiny_cosyvoice3"
    idx = d / "cases" / "index.json"
    if idx.is_file():
        name = json.loads(idx.read_text(encoding="utf-8")).get("model_dir", name)
    return d / name


def manifests_dir() -> Path:
    import pytest

    p = require_cv3() / "manifests"
    if not p.is_dir():
        pytest.skip("the CosyVoice3 reference directory has no manifests/")
    return p

"""Discovery of the golden reference data (``../shared/reference`` by default).

The reference directory is found, in order, at ``$COSYSERVE_REFERENCE_DIR``, at
``<repo>/../shared/reference``, or, for a local ``git clone`` of the repository, at
``<origin>/../shared/reference``. Cases are discovered from the files: every
``cases/*.json`` sidecar with a ``kind`` (and its ``.safetensors`` twin) is a case;
tests select cases by kind and by the tensors they contain, never by name.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=None)
def reference_dir() -> Path | None:
    env = os.environ.get("COSYSERVE_REFERENCE_DIR")
    if env:
        p = Path(env).expanduser().resolve()
        if not (p / "cases").is_dir():
            raise RuntimeError(f"COSYSERVE_REFERENCE_DIR={env} has no cases/ folder")
        if _cosyvoice3_only(p):  # a CosyVoice3 set: its tests use _reference_cv3, the CosyVoice2 ones skip
            return None
        return p
    candidates = [REPO.parent / "shared" / "reference"]
    try:
        url = subprocess.run(["git", "-C", str(REPO), "remote", "get-url", "origin"], capture_output=True,
                             text=True, timeout=5).stdout.strip()
        if url and os.path.isdir(url):
            candidates.append(Path(url).resolve().parent / "shared" / "reference")
    except (OSError, subprocess.SubprocessError):
        pass
    for c in candidates:
        if (c / "cases").is_dir():
            return c.resolve()
    return None


def _cosyvoice3_only(p: Path) -> bool:
    """``p`` is a CosyVoice3 reference set (its model directory has cosyvoice3.yaml, no cosyvoice2.yaml)."""
    name = "tiny_cosyvoice2"
    idx = p / "cases" / "index.json"
    if idx.is_file():
        try:
            name = json.loads(idx.read_text(encoding="utf-8")).get("model_dir", name)
        except json.JSONDecodeError:
            pass
    return (p / name / "cosyvoice3.yaml").is_file() and not (p / name / "cosyvoice2.yaml").is_file()


def require_reference_dir() -> Path:
    import pytest

    d = reference_dir()
    if d is None:
        pytest.skip("reference data not found: set COSYSERVE_REFERENCE_DIR (default ../shared/reference)")
    return d


@functools.lru_cache(maxsize=None)
def _sidecars() -> tuple[tuple[str, dict], ...]:
    d = reference_dir()
    if d is None:
        return ()
    out = []
    for j in sorted((d / "cases").glob("*.json")):
        try:
            meta = json.loads(j.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            continue
        if isinstance(meta, dict) and "kind" in meta:
            out.append((j.stem, meta))
    return tuple(out)


def discover(kind: str | None = None, has: tuple[str, ...] = (), where=None) -> list[str]:
    """Names of reference cases of ``kind`` whose sidecar lists all tensors in ``has``.

    ``where`` is an optional predicate on the sidecar dict.
    """
    names = []
    for name, meta in _sidecars():
        if kind is not None and meta.get("kind") != kind:
            continue
        tensors = meta.get("tensors", {})
        if any(t not in tensors for t in has):
            continue
        if where is not None and not where(meta):
            continue
        names.append(name)
    return names


def meta(name: str) -> dict:
    return json.loads((require_reference_dir() / "cases" / f"{name}.json").read_text(encoding="utf-8"))


@functools.lru_cache(maxsize=64)
def _tensors(name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(require_reference_dir() / "cases" / f"{name}.safetensors"))


def tensors(name: str) -> dict[str, torch.Tensor]:
    """The case's tensors (fresh clones, safe to modify)."""
    return {k: v.clone() for k, v in _tensors(name).items()}


def model_dir() -> Path:
    """The reference model directory named by ``cases/index.json`` (``model_dir``)."""
    d = require_reference_dir()
    name = "tiny_cosyvoice2"
    idx = d / "cases" / "index.json"
    if idx.is_file():
        name = json.loads(idx.read_text(encoding="utf-8")).get("model_dir", name)
    return d / name


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (b is the reference)."""
    a = a.detach().double().reshape(-1)
    b = b.detach().double().reshape(-1)
    assert a.shape == b.shape, f"shape {tuple(a.shape)} vs reference {tuple(b.shape)}"
    den = b.norm().item()
    num = (a - b).norm().item()
    return num / den if den > 0 else num


class one_thread:
    """Run a block with one torch thread, as the reference data was produced (bit-exact checks)."""

    def __enter__(self):
        self.n = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.n)


def full_size_config(tmp_path: Path):
    """The REAL CosyVoice2-0.5B configuration from ``manifests/`` (yaml + BlankEN config.json),
    laid out as a model directory in ``tmp_path``; returns its ``CosyVoice2Config``."""
    import shutil

    import pytest

    from cosyserve.models.config import load_config

    man = require_reference_dir() / "manifests"
    if not (man / "cosyvoice2.real.yaml").is_file():
        pytest.skip("the reference directory has no full-size manifests")
    shutil.copy(man / "cosyvoice2.real.yaml", tmp_path / "cosyvoice2.yaml")
    qwen = man / "CosyVoice-BlankEN_config.real.json"
    if qwen.is_file():
        (tmp_path / "CosyVoice-BlankEN").mkdir(exist_ok=True)
        shutil.copy(qwen, tmp_path / "CosyVoice-BlankEN" / "config.json")
    return load_config(tmp_path / "cosyvoice2.yaml")


def manifest(component: str) -> dict:
    """``manifests/<component>_state_dict.json`` (component: llm, flow, hift)."""
    import pytest

    p = require_reference_dir() / "manifests" / f"{component}_state_dict.json"
    if not p.is_file():
        pytest.skip(f"the reference directory has no {p.name}")
    return json.loads(p.read_text(encoding="utf-8"))


def manifest_shapes(component: str) -> dict[str, list[int]]:
    """``{key: shape}`` of the full-size checkpoint ``component``."""
    return {e["key"]: list(e["shape"]) for e in manifest(component)["tensors"]}

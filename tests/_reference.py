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
#: the optional Step-Audio2 DiT token2wav fixture, a folder of the reference directory
DIT_FOLDER = "tiny_dit_token2wav"

# Tolerances, all relative L2 (``rel_l2``: ||ours - reference|| / ||reference||, in float64).
# Documented in docs/architecture.md, "Numerical parity and documented deviations"; every parity
# assertion uses one of these, and bit-exactness is only ever printed (``check_close``), never
# required, so that any reference directory in this format passes when the numerics are right
# (other BLAS builds, thread counts or lengths round differently: ~1e-7..1e-6, see the reference
# README). tests/tools/perturb_reference.py builds a perturbed copy to check exactly that.
PARITY_TOL = 1e-4
"""Any float32 output (features, log-probs, hidden states, mel, F0, excitation, waveform given
upstream's own mel and draws) against the reference data."""
WAVE_TOL = 2e-3
"""A waveform synthesised from OUR flow mel, or by HiFT from upstream's mel with OUR F0, by the seeded
HiFT: the excitation integrates F0 into a phase, so the flow's ~3e-7 rounding grows along the
utterance to ~2e-4..5e-4, and so does the F0 predictor's own ~1e-7 on CPUs whose conv kernels sum in
another order than the reference machine's (AVX-512/AMX Xeons: 1.1e-4..3.2e-4 on the CosyVoice2
cases; the excitation from upstream's F0 stays within 7e-8). Architecture.md, "Waveform tolerance"."""
DEVICE_WAVE_TOL = 5e-3
"""A waveform computed on another device (CUDA float32) than the CPU reference by the causal
(CosyVoice3) HiFT: it integrates F0 into the excitation phase over the whole accumulated mel, so
float32 rounding differences between devices grow with the audio: on an H100 the flow mel is
within 2.4e-7, the stream_token2wav case's three speech chunks 2.4e-4 / 1.0e-3 / 2.2e-3
(benchmarks/results/h100-gpu-tests-6.log). CPU parity stays PARITY_TOL / WAVE_TOL."""
SELF_TOL = 1e-5
"""Two of our own float32 code paths whose summation order differs with the input (batch vs
single item, padded vs unpadded, cached vs full pass); where exactness holds by construction for
any input (same kernels on the same data), tests keep ``torch.equal``."""
HALF_TOL = {"logp": 2e-2, "mel": 5e-2, "speech_float16": 5e-3, "speech_bfloat16": 4e-2}
"""Half precision against float32 on the same weights (tests/test_gpu.py; documented in
docs/perf.md, "Half precision"; measured about a third of these). speech_*: HiFT's convolution
trunk in float16 / bfloat16 (F0, excitation and STFTs stay float32)."""


@functools.lru_cache(maxsize=None)
def reference_dir() -> Path | None:
    env = os.environ.get("COSYSERVE_REFERENCE_DIR")
    if env:
        p = Path(env).expanduser().resolve()
        if not (p / "cases").is_dir() and not (p / DIT_FOLDER).is_dir():
            raise RuntimeError(f"COSYSERVE_REFERENCE_DIR={env} has no cases/ (or {DIT_FOLDER}/) folder")
        if (p / "cases").is_dir() and _cosyvoice3_only(p):  # a CosyVoice3 set: its tests use _reference_cv3, the CosyVoice2 ones skip
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
        if (c / "cases").is_dir() or (c / DIT_FOLDER).is_dir():
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
    if not (d / "cases").is_dir():
        pytest.skip(f"{d} holds no CosyVoice2 reference cases (cases/ folder)")
    return d


@functools.lru_cache(maxsize=None)
def _sidecars() -> tuple[tuple[str, dict], ...]:
    d = reference_dir()
    if d is None:
        return ()
    out = []
    if not (d / "cases").is_dir():
        return ()
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


def check_close(got: torch.Tensor, ref: torch.Tensor, what: str, tol: float = PARITY_TOL) -> float:
    """Assert ``got`` has ``ref``'s shape and is within ``tol`` relative L2 of it; print the error and
    whether it happens to be bit-exact (run pytest with ``-s`` to see it). Returns the error."""
    assert tuple(got.shape) == tuple(ref.shape), f"{what}: shape {tuple(got.shape)} vs reference {tuple(ref.shape)}"
    err = rel_l2(got, ref)
    exact = got.dtype == ref.dtype and torch.equal(got.detach().cpu(), ref.detach().cpu())
    print(f"[parity] {what}: rel_l2={err:.3e}{' (bit-exact)' if exact else ''}")
    assert err <= tol, f"{what}: relative L2 {err:.3e} > {tol:g}"
    return err


class one_thread:
    """Run a block with one torch thread, as the reference data was produced (bit-exactness can then
    be observed and is printed; it is never required)."""

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


# ---------------------------------------------------------------- Step-Audio2 DiT token2wav fixture


def dit_dir() -> Path | None:
    """``<reference>/tiny_dit_token2wav`` if present (also when the reference directory holds only it)."""
    d = reference_dir()
    if d is None or not (d / DIT_FOLDER / "cases").is_dir():
        return None
    return d / DIT_FOLDER


def require_dit_dir() -> Path:
    import pytest

    d = dit_dir()
    if d is None:
        pytest.skip(f"reference data has no {DIT_FOLDER}/ folder (set COSYSERVE_REFERENCE_DIR)")
    return d


def dit_discover(kind: str, has: tuple[str, ...] = ()) -> list[str]:
    """Names of the DiT fixture's cases of ``kind`` whose sidecar lists all tensors in ``has``."""
    d = dit_dir()
    if d is None:
        return []
    names = []
    for j in sorted((d / "cases").glob("*.json")):
        try:
            m = json.loads(j.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            continue
        if isinstance(m, dict) and m.get("kind") == kind and all(t in m.get("tensors", {}) for t in has):
            names.append(j.stem)
    return names


def dit_meta(name: str) -> dict:
    return json.loads((require_dit_dir() / "cases" / f"{name}.json").read_text(encoding="utf-8"))


def dit_tensors(name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(require_dit_dir() / "cases" / f"{name}.safetensors"))


def dit_index() -> dict:
    p = require_dit_dir() / "cases" / "index.json"
    return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else {}

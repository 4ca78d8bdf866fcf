"""Discovery of the CosyVoice3 golden reference data (for every CosyVoice3 test family: frontend,
LLM, flow / HiFT / token2wav, end to end).

The CosyVoice3 set is a directory holding ``tiny_cosyvoice3/`` (or the model directory named by
``cases/index.json``), ``cases/`` and ``manifests/``. It is found, in order, at
``$COSYSERVE_CV3_REFERENCE_DIR``; at ``$COSYSERVE_REFERENCE_DIR`` when that directory itself is
such a set; at ``<reference>/cosyvoice3/`` where ``<reference>`` is the CosyVoice2 reference
directory of :mod:`_reference`. Cases are discovered from the files (every ``cases/*.json``
sidecar with a ``kind``), never by name; tests skip cleanly when no set is found.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
import torch

from _reference import one_thread, reference_dir, rel_l2  # noqa: F401  (re-exported)

CV3_MODEL_DIR = "tiny_cosyvoice3"


def _is_cv3_set(p: Path) -> bool:
    if not (p / "cases").is_dir():
        return False
    idx = p / "cases" / "index.json"
    name = CV3_MODEL_DIR
    if idx.is_file():
        try:
            name = json.loads(idx.read_text(encoding="utf-8")).get("model_dir", name)
        except json.JSONDecodeError:
            pass
    return (p / name / "cosyvoice3.yaml").is_file()


@functools.lru_cache(maxsize=None)
def cv3_reference_dir() -> Path | None:
    env = os.environ.get("COSYSERVE_CV3_REFERENCE_DIR")
    if env:
        p = Path(env).expanduser().resolve()
        if not _is_cv3_set(p):
            raise RuntimeError(f"COSYSERVE_CV3_REFERENCE_DIR={env} has no cases/ + a cosyvoice3.yaml model directory")
        return p
    env = os.environ.get("COSYSERVE_REFERENCE_DIR")
    if env and _is_cv3_set(Path(env).expanduser().resolve()):
        return Path(env).expanduser().resolve()
    try:
        base = reference_dir()
    except RuntimeError:
        base = None
    if base is not None and _is_cv3_set(base / "cosyvoice3"):
        return (base / "cosyvoice3").resolve()
    return None


def require_cv3_dir() -> Path:
    import pytest

    d = cv3_reference_dir()
    if d is None:
        pytest.skip("CosyVoice3 reference data not found (set COSYSERVE_CV3_REFERENCE_DIR or COSYSERVE_REFERENCE_DIR)")
    return d


@functools.lru_cache(maxsize=None)
def _sidecars() -> tuple[tuple[str, dict], ...]:
    d = cv3_reference_dir()
    if d is None:
        return ()
    out = []
    for j in sorted((d / "cases").glob("*.json")):
        try:
            meta_ = json.loads(j.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            continue
        if isinstance(meta_, dict) and "kind" in meta_:
            out.append((j.stem, meta_))
    return tuple(out)


def discover(kind: str | None = None, has: tuple[str, ...] = (), where=None) -> list[str]:
    """Names of CosyVoice3 cases of ``kind`` whose sidecar lists all tensors in ``has`` (and
    satisfies the optional predicate ``where(sidecar)``)."""
    names = []
    for name, m in _sidecars():
        if kind is not None and m.get("kind") != kind:
            continue
        if any(t not in m.get("tensors", {}) for t in has):
            continue
        if where is not None and not where(m):
            continue
        names.append(name)
    return names


def meta(name: str) -> dict:
    return json.loads((require_cv3_dir() / "cases" / f"{name}.json").read_text(encoding="utf-8"))


@functools.lru_cache(maxsize=64)
def _tensors(name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(require_cv3_dir() / "cases" / f"{name}.safetensors"))


def tensors(name: str) -> dict[str, torch.Tensor]:
    """The case's tensors (fresh clones)."""
    return {k: v.clone() for k, v in _tensors(name).items()}


def model_dir() -> Path:
    """The tiny CosyVoice3 model directory named by ``cases/index.json`` (``model_dir``)."""
    d = require_cv3_dir()
    name = CV3_MODEL_DIR
    idx = d / "cases" / "index.json"
    if idx.is_file():
        name = json.loads(idx.read_text(encoding="utf-8")).get("model_dir", name)
    return d / name


def set_file(rel: str) -> Path:
    """A file a sidecar names relative to the set (e.g. ``audio/zero_shot_prompt.wav``)."""
    return require_cv3_dir() / rel


def manifest(component: str) -> dict:
    """``manifests/<component>_state_dict.json`` (component: llm, flow, hift)."""
    import pytest

    p = require_cv3_dir() / "manifests" / f"{component}_state_dict.json"
    if not p.is_file():
        pytest.skip(f"the CosyVoice3 reference set has no {p.name}")
    return json.loads(p.read_text(encoding="utf-8"))


def manifest_shapes(component: str) -> dict[str, list[int]]:
    return {e["key"]: list(e["shape"]) for e in manifest(component)["tensors"]}


def manifests_dir() -> Path:
    """The set's ``manifests/`` folder (full-size yaml, state-dict manifests); skips when absent."""
    import pytest

    p = require_cv3_dir() / "manifests"
    if not p.is_dir():
        pytest.skip("the CosyVoice3 reference directory has no manifests/")
    return p


def full_size_config(tmp_path: Path):
    """The REAL CosyVoice3 configuration from ``manifests/`` (yaml + BlankEN config.json) laid out
    as a model directory in ``tmp_path``; returns its config."""
    import shutil

    import pytest

    from cosyserve.models.config import load_config

    man = require_cv3_dir() / "manifests"
    if not (man / "cosyvoice3.real.yaml").is_file():
        pytest.skip("the CosyVoice3 reference set has no full-size manifests")
    shutil.copy(man / "cosyvoice3.real.yaml", tmp_path / "cosyvoice3.yaml")
    qwen = man / "CosyVoice-BlankEN_config.real.json"
    if qwen.is_file():
        (tmp_path / "CosyVoice-BlankEN").mkdir(exist_ok=True)
        shutil.copy(qwen, tmp_path / "CosyVoice-BlankEN" / "config.json")
    return load_config(tmp_path / "cosyvoice3.yaml")


# module-scoped fixtures of the tiny CosyVoice3 model's parts; a test module imports them
# (``from _reference_cv3 import yaml_data_fixture, flow_fixture, hift_fixture``)
@pytest.fixture(scope="module", name="yaml_data")
def yaml_data_fixture():
    """The tiny model's ``cosyvoice3.yaml`` as data (skips without the CosyVoice3 reference set)."""
    from cosyserve.models.config import load_hyperpyyaml

    require_cv3_dir()
    return load_hyperpyyaml(model_dir() / "cosyvoice3.yaml")


@pytest.fixture(scope="module", name="flow")
def flow_fixture(yaml_data):
    """The tiny model's CosyVoice3 flow (float32, CPU)."""
    from cosyserve.models.cv3_flow import load_cv3_flow, parse_cv3_flow

    return load_cv3_flow(model_dir() / "flow.pt", parse_cv3_flow(yaml_data))


@pytest.fixture(scope="module", name="hift")
def hift_fixture(yaml_data):
    """The tiny model's causal HiFT (float32, CPU)."""
    from cosyserve.models.hift import load_hift, parse_causal_hift

    return load_hift(model_dir() / "hift.pt", parse_causal_hift(yaml_data))


#: the prompt transcript of ``audio/zero_shot_prompt.wav`` with upstream's default CV3 instruction
PROMPT_TEXT = "You are a helpful assistant.<|endofprompt|>希望你以后能够做的比我还好呦。"


class ForcedSampler:
    """A sampler that emits given tokens, then the stop token (drives the engine with known tokens)."""

    def __init__(self, tokens: list[int], stop: int):
        self.tokens, self.stop = tokens, stop

    def sample(self, logp, history, generator=None, ignore_eos=False):
        return self.tokens[len(history)] if len(history) < len(self.tokens) else self.stop


def forced_params(tokens: list[int], stop: int, stream: bool):
    """:class:`SynthesisParams` whose LM emits exactly ``tokens`` (then ``stop``)."""
    from cosyserve.engine.request import SynthesisParams

    return SynthesisParams(seed=0, stream=stream, min_tokens=0, max_tokens=len(tokens) + 1,
                           sampler_factory=lambda: ForcedSampler(tokens, stop))


def stream_case_voice(synth, d: dict):
    """The shipped prompt's voice with a stream case's flow prompt (tokens, mel, embedding) ``d``."""
    from dataclasses import replace

    base = synth.make_voice("v", str(set_file("audio/zero_shot_prompt.wav")), PROMPT_TEXT)
    return replace(base, flow_speech_token=d["prompt_token"].reshape(-1).to(base.flow_speech_token.dtype),
                   speech_feat=d["prompt_feat"][0], flow_embedding=d["embedding"].reshape(-1))


def run_engine(engine, reqs) -> dict:
    """Add ``reqs`` and step ``engine`` until idle: ``{request id: (chunks, RequestFinished)}``; every
    request must finish without error."""
    from cosyserve.engine.request import AudioChunk

    out = {r.request_id: ([], None) for r in reqs}
    for r in reqs:
        engine.add_request(r)
    while engine.has_work():
        for ev in engine.step():
            chunks, _ = out[ev.request_id]
            if isinstance(ev, AudioChunk):
                chunks.append(ev)
            else:
                out[ev.request_id] = (chunks, ev)
    for rid, (_, fin) in out.items():
        assert fin is not None and fin.error is None, (rid, fin)
    return out

"""Voice store: atomic files, validated ids, spk2info import/export, bit-identical round trips."""

from __future__ import annotations

import pytest
import torch

from _reference import PARITY_TOL, model_dir, rel_l2, require_reference_dir
from cosyserve.errors import InvalidInputError, VoiceNotFoundError
from cosyserve.frontend.frontend import Frontend
from cosyserve.frontend.voice import Voice, VoiceStore

TENSORS = ("prompt_text_ids", "llm_speech_token", "flow_speech_token", "speech_feat", "llm_embedding", "flow_embedding")


def same(a: Voice, b: Voice) -> bool:
    """Bit-identical (our own save / load round trips: exact by construction)."""
    return all(getattr(a, k).dtype == getattr(b, k).dtype and torch.equal(getattr(a, k), getattr(b, k)) for k in TENSORS)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype and shape; ids exact, floats within the parity tolerance (b: upstream's)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return rel_l2(a, b) <= PARITY_TOL if a.is_floating_point() else torch.equal(a, b)


def same_as_upstream(a: Voice, up: Voice) -> bool:
    return all(close(getattr(a, k), getattr(up, k)) for k in TENSORS)


@pytest.fixture(scope="module")
def frontend():
    return Frontend(model_dir(), normalizer="rules")


@pytest.fixture(scope="module")
def voice(frontend):
    ref = require_reference_dir()
    return frontend.make_voice("zh-female", ref / "audio" / "zero_shot_prompt.wav", "希望你以后能够做的比我还好呦。")


def test_round_trip_add_restart_export_import(tmp_path, voice):
    store = VoiceStore(tmp_path / "voices")
    store.add(voice)
    with pytest.raises(InvalidInputError, match="already exists"):
        store.add(voice)
    reopened = VoiceStore(tmp_path / "voices")  # "restart"
    got = reopened.get("zh-female")
    assert same(got, voice) and got.prompt_text == voice.prompt_text
    assert [v["id"] for v in reopened.list()] == ["zh-female"]
    reopened.export_spk2info(tmp_path / "spk2info.pt")
    other = VoiceStore(tmp_path / "other")
    assert other.import_spk2info(tmp_path / "spk2info.pt") == ["zh-female"]
    assert same(other.get("zh-female"), voice)
    assert not list((tmp_path / "voices").glob("*.tmp"))


def test_matches_upstream_spk2info(tmp_path, voice):
    """Our voice for the reference prompt equals upstream's add_zero_shot_spk output (bit for bit in
    the reference environment; asserted to the parity tolerance for the float features)."""
    md = model_dir()
    if not (md / "spk2info.pt").is_file():
        pytest.skip("reference model directory has no spk2info.pt")
    store = VoiceStore(tmp_path)
    ids = store.import_spk2info(md / "spk2info.pt")
    up = store.get(ids[0])
    assert same_as_upstream(voice, up)
    exported = voice.to_spk2info()
    raw = torch.load(md / "spk2info.pt", weights_only=True)[ids[0]]
    assert set(exported) == set(raw)
    for k in raw:
        assert close(exported[k], raw[k]), k


def test_import_triton_runtime_format(tmp_path):
    ref = require_reference_dir()
    path = ref / "real_spk2info" / "spk2info.pt"
    if not path.is_file():
        pytest.skip("no real speaker cache in the reference directory")
    store = VoiceStore(tmp_path)
    ids = store.import_spk2info(path)
    raw = torch.load(path, map_location="cpu", weights_only=True)
    assert sorted(ids) == sorted(raw)
    for vid in ids:
        v = store.get(vid)
        assert v.prompt_text == raw[vid]["prompt_text"]
        assert torch.equal(v.flow_speech_token, raw[vid]["speech_token"].reshape(-1))
        assert torch.equal(v.speech_feat, raw[vid]["speech_feat"][0])


@pytest.mark.parametrize("bad", ["", "../etc", "a/b", ".hidden", "x" * 65, "sp ace", "a.tmp"])
def test_invalid_ids(tmp_path, bad, voice):
    store = VoiceStore(tmp_path)
    with pytest.raises(InvalidInputError, match="invalid voice id"):
        store.get(bad)


def test_unknown_and_remove(tmp_path, voice):
    store = VoiceStore(tmp_path)
    with pytest.raises(VoiceNotFoundError, match="unknown voice 'nope'"):
        store.get("nope")
    store.add(voice)
    store.remove(voice.id)
    with pytest.raises(VoiceNotFoundError):
        store.remove(voice.id)


def test_bad_spk2info(tmp_path):
    store = VoiceStore(tmp_path)
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(InvalidInputError, match="not a readable spk2info"):
        store.import_spk2info(tmp_path / "junk.pt")
    torch.save({"x": {"foo": torch.zeros(1)}}, tmp_path / "odd.pt")
    with pytest.raises(InvalidInputError, match="unknown layout"):
        store.import_spk2info(tmp_path / "odd.pt")


def test_voice_needs_transcript(frontend):
    ref = require_reference_dir()
    with pytest.raises(InvalidInputError, match="transcript"):
        frontend.make_voice("v", ref / "audio" / "zero_shot_prompt.wav", "   ")

"""CosyVoice3 frontend: tokenizer special tokens, prompt features with speech_tokenizer_v3 and the CV3
prompt mel, the zero-shot / cross-lingual / instruct2 LM inputs, <|endofprompt|> checks, spk2info voices.

Cases are discovered from the CosyVoice3 reference set (:mod:`_reference_cv3`).
"""

from __future__ import annotations

import pytest
import torch

from _reference_cv3 import discover, meta, model_dir, rel_l2, set_file, tensors
from cosyserve.errors import InvalidInputError
from cosyserve.frontend.audio import load_prompt_wav
from cosyserve.frontend.features import speaker_fbank, whisper_log_mel
from cosyserve.frontend.frontend import Frontend
from cosyserve.frontend.speech_models import SpeakerEncoder, SpeechTokenizer
from cosyserve.frontend.tokenizer import ENDOFPROMPT, TextTokenizer
from cosyserve.frontend.voice import Voice, VoiceStore

FEATURE_TOL = 1e-3
TOKENIZER_CASES = discover("tokenizer", where=lambda m: "added_tokens" in m or "texts" in m)
FRONTEND_CASES = discover("frontend", has=("zs_prompt_speech_feat", "zs_flow_prompt_speech_token", "embedding"))
LLM_CASES = discover("llm", has=("text_ids", "prompt_text_ids", "prompt_speech_token"),
                     where=lambda m: "text" in m and "prompt_text" in m)
TENSORS = ("prompt_text_ids", "llm_speech_token", "flow_speech_token", "speech_feat", "llm_embedding", "flow_embedding")


@pytest.fixture(scope="module")
def mdir():
    return model_dir()


@pytest.fixture(scope="module")
def frontend(mdir):
    return Frontend(mdir, normalizer="none")


def _wav(m: dict):
    p = set_file(m["wav_file"])
    if not p.is_file():
        pytest.skip(f"{p} not found")
    return p


# ----------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("case", TOKENIZER_CASES)
def test_cv3_special_tokens_and_text_ids(case, mdir):
    m = meta(case)
    tok = TextTokenizer(mdir / "CosyVoice-BlankEN", version="cosyvoice3")
    for name, i in m.get("added_tokens", {}).items():
        assert tok.token_id(name) == i, name
    if "len_tokenizer" in m:
        assert len(tok) == m["len_tokenizer"]
    for e in m.get("texts", []):
        assert tok.encode(e["text"]) == e["ids"], e["text"]
    assert tok.token_id(ENDOFPROMPT) == tok.special_token_ids[ENDOFPROMPT]


def test_frontend_uses_the_cv3_tokenizer(frontend):
    assert frontend.tokenizer.version == "cosyvoice3"
    assert frontend.tokenizer.token_id("<|endofsystem|>") == frontend.tokenizer.token_id("[mn]") + 1


def test_unknown_tokenizer_version(mdir):
    with pytest.raises(ValueError, match="unknown tokenizer version"):
        TextTokenizer(mdir / "CosyVoice-BlankEN", version="cosyvoice9")


# ----------------------------------------------------------------------------- prompt features


@pytest.mark.parity
@pytest.mark.parametrize("case", FRONTEND_CASES)
def test_zero_shot_prompt_features(case, frontend, mdir):
    t, m = tensors(case), meta(case)
    path = _wav(m)
    px = frontend.prompts
    assert px.speech_tokenizer.file_hint.endswith("speech_tokenizer_v3.onnx")
    wav16 = load_prompt_wav(path, 16000) if "speech_16k" in t else None
    if wav16 is not None:
        assert rel_l2(wav16, t["speech_16k"]) <= FEATURE_TOL
        if "whisper_mel" in t:
            assert rel_l2(whisper_log_mel(wav16), t["whisper_mel"]) <= FEATURE_TOL
        if "fbank" in t:
            assert rel_l2(speaker_fbank(wav16), t["fbank"]) <= FEATURE_TOL
    if "whisper_mel" in t and "speech_token" in t:
        tok = SpeechTokenizer(mdir / "speech_tokenizer_v3.onnx")
        assert torch.equal(tok(t["whisper_mel"]), t["speech_token"].to(torch.int32))
    if "fbank" in t:
        emb = SpeakerEncoder(mdir / "campplus.onnx")(t["fbank"])
        assert rel_l2(emb, t["embedding"]) <= FEATURE_TOL
    if "speech_feat" in t:
        wav24 = load_prompt_wav(path, frontend.cfg.sample_rate)
        assert rel_l2(px.mel(wav24), t["speech_feat"]) <= FEATURE_TOL  # fmax null (sr / 2) mel
    # the whole chain from the file
    p = px.extract_file(path)
    assert torch.equal(p.speech_token, t["zs_flow_prompt_speech_token"].to(torch.int32))
    assert p.speech_feat.shape == t["zs_prompt_speech_feat"].shape
    assert rel_l2(p.speech_feat, t["zs_prompt_speech_feat"]) <= FEATURE_TOL
    assert rel_l2(p.embedding, t["embedding"]) <= FEATURE_TOL
    # text ids of the zero-shot call
    if "prompt_text" in m and "zs_prompt_text" in t:
        assert frontend.tokenizer.encode(m["prompt_text"]) == t["zs_prompt_text"].reshape(-1).tolist()
    if "tts_text" in m and "zs_text" in t:
        assert frontend.tokenizer.encode(m["tts_text"]) == t["zs_text"].reshape(-1).tolist()


def test_spk2info_import_export_round_trip(mdir, tmp_path):
    """The reference spk2info.pt loads as voices; exporting them writes the same tensors bit for bit."""
    if not (mdir / "spk2info.pt").is_file():
        pytest.skip("no spk2info.pt")
    store = VoiceStore(tmp_path / "voices")
    ids = store.import_spk2info(mdir / "spk2info.pt")
    raw_all = torch.load(mdir / "spk2info.pt", weights_only=True)
    assert sorted(ids) == sorted(raw_all)
    for vid in ids:
        exported = store.get(vid).to_spk2info()
        raw = raw_all[vid]
        assert set(exported) == set(raw)
        for k in raw:
            assert exported[k].dtype == raw[k].dtype and torch.equal(exported[k], raw[k]), k
    store.export_spk2info(tmp_path / "out.pt")
    again = VoiceStore(tmp_path / "again")
    again.import_spk2info(tmp_path / "out.pt")
    for vid in ids:
        assert all(torch.equal(getattr(again.get(vid), k), getattr(store.get(vid), k)) for k in TENSORS)


@pytest.mark.parity
def test_make_voice_matches_upstream_spk2info(frontend, mdir, tmp_path):
    """A voice made from the prompt recording equals upstream's add_zero_shot_spk entry: tokens exactly,
    features and embedding within the feature tolerance (the frontend case with the entry's tokens
    names the recording)."""
    if not (mdir / "spk2info.pt").is_file():
        pytest.skip("no spk2info.pt")
    store = VoiceStore(tmp_path)
    for vid in store.import_spk2info(mdir / "spk2info.pt"):
        up = store.get(vid)
        match = [c for c in FRONTEND_CASES
                 if torch.equal(tensors(c)["zs_flow_prompt_speech_token"].reshape(-1).to(torch.int32),
                                up.flow_speech_token)]
        if not match:
            continue
        # the transcript as written (special tokens such as <|endofprompt|> kept)
        transcript = frontend.tokenizer.hf_tokenizer.decode(up.prompt_text_ids.tolist(), skip_special_tokens=False)
        mine = frontend.make_voice("mine", _wav(meta(match[0])), transcript)
        assert torch.equal(mine.prompt_text_ids, up.prompt_text_ids)
        assert torch.equal(mine.llm_speech_token, up.llm_speech_token)
        assert torch.equal(mine.flow_speech_token, up.flow_speech_token)
        assert rel_l2(mine.speech_feat, up.speech_feat) <= FEATURE_TOL
        assert rel_l2(mine.flow_embedding, up.flow_embedding) <= FEATURE_TOL
        return
    pytest.skip("no frontend case has the recording of spk2info.pt")


# ----------------------------------------------------------------------------- LM input layouts


def _voice_for(case: str, frontend: Frontend) -> tuple[Voice, torch.Tensor]:
    """The voice + text ids our frontend builds for an LLM case's layout (zero-shot / cross-lingual /
    instruct2, told apart by which prompt parts the case has)."""
    t, m = tensors(case), meta(case)
    flow_tok = torch.arange(10, dtype=torch.int32)
    base = Voice("base", "", torch.zeros(0, dtype=torch.int32), flow_tok, flow_tok, torch.zeros(20, 80), torch.ones(192),
                 torch.ones(192))
    has_prompt_text = t["prompt_text_ids"].numel() > 0
    has_prompt_speech = t["prompt_speech_token"].numel() > 0
    if has_prompt_text and has_prompt_speech:  # zero-shot: the voice's transcript and tokens
        ids = torch.tensor(frontend.tokenizer.encode(m["prompt_text"]), dtype=torch.int32)
        v = Voice.from_features("zs", m["prompt_text"], ids, t["prompt_speech_token"].reshape(1, -1).to(torch.int32),
                                torch.zeros(1, 2 * t["prompt_speech_token"].numel(), 80), torch.ones(1, 192))
    elif has_prompt_text:  # instruct2
        v = frontend.instruct2_voice(base, m["prompt_text"])
    else:  # cross-lingual
        v = frontend.cross_lingual_voice(base)
    text_ids = torch.tensor(frontend.tokenizer.encode(m["text"]), dtype=torch.long)
    frontend.check_lm_input(v, [text_ids])  # upstream's <|endofprompt|> assertion holds
    return v, text_ids


@pytest.mark.parametrize("case", LLM_CASES)
def test_lm_input_layouts(case, frontend):
    t = tensors(case)
    v, text_ids = _voice_for(case, frontend)
    assert text_ids.tolist() == t["text_ids"].reshape(-1).tolist()
    assert v.prompt_text_ids.tolist() == t["prompt_text_ids"].reshape(-1).tolist()
    assert v.llm_speech_token.tolist() == t["prompt_speech_token"].reshape(-1).tolist()


def test_endofprompt_is_required(frontend, mdir):
    ref = discover("frontend", has=("zs_prompt_speech_feat",))
    if not ref:
        pytest.skip("no frontend case")
    path = _wav(meta(ref[0]))
    with pytest.raises(InvalidInputError, match="endofprompt") as e:
        frontend.make_voice("v", path, "希望你以后能够做的比我还好呦。")
    assert e.value.field == "prompt_text"
    good = frontend.make_voice("v", path, f"You are a helpful assistant.{ENDOFPROMPT}希望你以后能够做的比我还好呦。")
    frontend.token_ids("你好。", good)  # the voice's prompt text carries it
    xl = frontend.cross_lingual_voice(good)
    assert xl.prompt_text_ids.numel() == 0 and xl.llm_speech_token.numel() == 0
    assert torch.equal(xl.flow_speech_token, good.flow_speech_token)
    with pytest.raises(InvalidInputError, match="endofprompt") as e:
        frontend.token_ids("你好。", xl)
    assert e.value.field == "input"
    frontend.token_ids(f"You are a helpful assistant.{ENDOFPROMPT}你好。", xl)
    with pytest.raises(InvalidInputError, match="endofprompt") as e:
        frontend.instruct2_voice(good, "请用广东话表达。")
    assert e.value.field == "instructions"
    with pytest.raises(InvalidInputError, match="empty"):
        frontend.instruct2_voice(good, "  ")

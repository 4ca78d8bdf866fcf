"""Frontend: audio I/O, resampling, features, the two ONNX models, text tokenizer, prompt chain.

Parity tests discover their cases from the reference data (sidecar ``kind`` and the
tensors it lists; input audio named by the sidecar's ``input_wav`` in ``<reference>/audio``)
and print the measured errors (run with ``-s`` to see them).

Tolerances: every float comparison with the reference uses the project's parity tolerance,
relative L2 <= 1e-4 (``PARITY_TOL``, tests/_reference.py). In the reference environment this
implementation reproduces the reference bit for bit (errors 0.0, printed); other FFT/BLAS
builds, thread counts or a reference made elsewhere differ by ~1e-7..1e-6, which a tighter
bound would wrongly reject. Token ids (speech tokens, text ids) are compared exactly.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from _reference import PARITY_TOL, discover, meta, model_dir, rel_l2, require_reference_dir, tensors
from cosyserve.errors import InvalidInputError, ModelDirError
from cosyserve.frontend import audio as audio_mod
from cosyserve.frontend.audio import load_audio, load_prompt_wav, resample, to_mono
from cosyserve.frontend.features import (
    SPEECH_TOKENIZER_MEL,
    PromptMelExtractor,
    kaldi_fbank,
    slaney_mel_filters,
    speaker_fbank,
    whisper_log_mel,
)
from cosyserve.frontend.prompt import PromptExtractor, PromptFeatures
from cosyserve.frontend.speech_models import SpeakerEncoder, SpeechTokenizer
from cosyserve.frontend.tokenizer import REQUIRED_FILES, TextTokenizer
from cosyserve.models.config import load_config

FEATURE_TOL = FILTER_TOL = RESAMPLE_TOL = PARITY_TOL

parity = pytest.mark.parity


# --------------------------------------------------------------------------------------
# fixtures / helpers
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mdir() -> Path:
    require_reference_dir()
    return model_dir()


@pytest.fixture(scope="module")
def cfg(mdir):
    return load_config(mdir / "cosyvoice2.yaml")


@pytest.fixture(scope="module")
def mel(cfg):
    return PromptMelExtractor(cfg.feat)


@pytest.fixture(scope="module")
def extractor(mdir, cfg):
    return PromptExtractor(mdir, cfg)


@pytest.fixture(scope="module")
def text_tokenizer(mdir):
    return TextTokenizer(mdir / "CosyVoice-BlankEN")


def _input_wav(m: dict) -> Path | None:
    """The case's input file in ``<reference>/audio`` (the sidecar may annotate the name)."""
    name = m.get("input_wav")
    if not name:
        return None
    audio = require_reference_dir() / "audio"
    if (audio / name).is_file():
        return audio / name
    match = re.match(r"\s*(\S+\.(?:wav|flac|ogg|mp3))", name, re.IGNORECASE)
    if match and (audio / match.group(1)).is_file():
        return audio / match.group(1)
    return None


def _report(label: str, err: float, extra: str = "") -> None:
    print(f"\n[frontend parity] {label}: rel_l2={err:.3e} {extra}", end="")


def _wav_bytes(data: np.ndarray, sr: int, subtype: str = "PCM_16") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, data, sr, format="WAV", subtype=subtype)
    return buf.getvalue()


# --------------------------------------------------------------------------------------
# 1. filter matrices
# --------------------------------------------------------------------------------------


@parity
@pytest.mark.parametrize("case", discover("frontend", has=("matcha_mel_basis",)))
def test_prompt_mel_filters(case, cfg):
    ref = tensors(case)["matcha_mel_basis"]
    f = cfg.feat
    got = slaney_mel_filters(f.sampling_rate, f.n_fft, f.num_mels, f.fmin, f.fmax)
    assert got.shape == ref.shape and got.dtype == torch.float32
    err = rel_l2(got, ref)
    _report(f"{case} matcha_mel_basis", err, f"max_abs={(got - ref).abs().max().item():.2e}")
    assert err <= FILTER_TOL


@parity
@pytest.mark.parametrize("case", discover("frontend", has=("whisper_mel_filters_128",)))
def test_whisper_mel_filters(case):
    ref = tensors(case)["whisper_mel_filters_128"]
    spec = SPEECH_TOKENIZER_MEL
    got = slaney_mel_filters(spec.sample_rate, spec.n_fft, ref.shape[0])
    assert got.shape == ref.shape
    err = rel_l2(got, ref)
    _report(f"{case} whisper_mel_filters_128", err, f"max_abs={(got - ref).abs().max().item():.2e}")
    assert err <= FILTER_TOL


# --------------------------------------------------------------------------------------
# 2. features from the reference's own resampled waveforms
# --------------------------------------------------------------------------------------


@parity
@pytest.mark.parametrize("case", discover("frontend", has=("wav_24k", "speech_feat")))
def test_prompt_mel(case, mel):
    t = tensors(case)
    got = mel(t["wav_24k"])
    assert got.shape == t["speech_feat"].shape and got.dtype == torch.float32
    err = rel_l2(got, t["speech_feat"])
    _report(f"{case} speech_feat", err, f"max_abs={(got - t['speech_feat']).abs().max().item():.2e}")
    assert err <= FEATURE_TOL


@parity
@pytest.mark.parametrize("case", discover("frontend", has=("wav_16k", "whisper_log_mel")))
def test_whisper_log_mel(case):
    t = tensors(case)
    ref = t["whisper_log_mel"]
    got = whisper_log_mel(t["wav_16k"], n_mels=ref.shape[1])
    assert got.shape == ref.shape
    err = rel_l2(got, ref)
    _report(f"{case} whisper_log_mel", err, f"max_abs={(got - ref).abs().max().item():.2e}")
    assert err <= FEATURE_TOL


@parity
@pytest.mark.parametrize("case", discover("frontend", has=("wav_16k", "fbank_cmn")))
def test_speaker_fbank(case):
    t = tensors(case)
    got = speaker_fbank(t["wav_16k"])
    assert got.shape == t["fbank_cmn"].shape
    err = rel_l2(got, t["fbank_cmn"])
    _report(f"{case} fbank_cmn", err, f"max_abs={(got - t['fbank_cmn']).abs().max().item():.2e}")
    assert err <= FEATURE_TOL
    if "fbank_mean" in t:
        raw = kaldi_fbank(t["wav_16k"])
        assert raw.dim() == 2 and raw.shape == got.shape[1:]
        err_mean = rel_l2(raw.mean(dim=0, keepdim=True), t["fbank_mean"])
        _report(f"{case} fbank_mean", err_mean)
        assert err_mean <= FEATURE_TOL


@parity
@pytest.mark.parametrize("case", discover("frontend", has=("whisper_log_mel", "standin_speech_token")))
def test_standin_speech_tokens(case, mdir):
    t = tensors(case)
    tok = SpeechTokenizer(mdir / "speech_tokenizer_v2.onnx")
    got = tok(t["whisper_log_mel"])
    assert got.dtype == torch.int32 and got.shape == t["standin_speech_token"].shape
    assert got.shape[1] == -(-t["whisper_log_mel"].shape[2] // 4)  # ceil(T/4): 25 tokens/s
    assert torch.equal(got, t["standin_speech_token"])
    if "wav_16k" in t:  # from our own log-mel as well
        mine = tok(whisper_log_mel(t["wav_16k"]))
        mismatches = int((mine != t["standin_speech_token"]).sum())
        print(f"\n[frontend parity] {case} standin tokens: exact; from own log-mel: {mismatches} mismatches", end="")
        assert mismatches == 0


@parity
@pytest.mark.parametrize("case", discover("frontend", has=("fbank_cmn", "standin_embedding")))
def test_standin_embedding(case, mdir):
    t = tensors(case)
    enc = SpeakerEncoder(mdir / "campplus.onnx")
    got = enc(t["fbank_cmn"])
    assert got.dtype == torch.float32 and got.shape == t["standin_embedding"].shape
    err = rel_l2(got, t["standin_embedding"])
    err_own = rel_l2(enc(speaker_fbank(t["wav_16k"])), t["standin_embedding"]) if "wav_16k" in t else float("nan")
    _report(f"{case} standin_embedding", err, f"(from own fbank: {err_own:.3e})")
    assert err <= FEATURE_TOL and not err_own > FEATURE_TOL


def _check_aligned(case: str, t: dict, m: dict, p: PromptFeatures, how: str) -> None:
    ref_feat, ref_tok = t["zero_shot_prompt_speech_feat"], t["zero_shot_prompt_speech_token"]
    assert p.speech_feat.dtype == torch.float32 and p.speech_token.dtype == torch.int32
    assert p.speech_feat.shape == ref_feat.shape and p.speech_token.shape == ref_tok.shape
    if "aligned_token_len" in m:
        assert p.num_tokens == m["aligned_token_len"]
    assert p.num_frames == 2 * p.num_tokens or p.num_frames % p.num_tokens == 0
    err = rel_l2(p.speech_feat, ref_feat)
    assert torch.equal(p.speech_token, ref_tok)
    msg = f"tokens exact, T_tok={p.num_tokens}"
    if "standin_embedding" in t:
        err_emb = rel_l2(p.embedding, t["standin_embedding"])
        msg += f", embedding rel_l2={err_emb:.3e}"
        assert err_emb <= FEATURE_TOL
    _report(f"{case} zero-shot aligned ({how}) prompt_speech_feat", err, msg)
    assert err <= FEATURE_TOL


@parity
@pytest.mark.parametrize(
    "case", discover("frontend", has=("wav_16k", "wav_24k", "zero_shot_prompt_speech_feat", "zero_shot_prompt_speech_token"))
)
def test_zero_shot_alignment_from_reference_wavs(case, extractor):
    t, m = tensors(case), meta(case)
    p = extractor.extract_resampled(t["wav_16k"], t["wav_24k"])
    _check_aligned(case, t, m, p, "reference wavs")


@parity
@pytest.mark.parametrize(
    "case", discover("frontend", has=("zero_shot_prompt_speech_feat", "zero_shot_prompt_speech_token"),
                     where=lambda m: bool(m.get("input_wav")))
)
def test_zero_shot_alignment_from_file(case, extractor):
    t, m = tensors(case), meta(case)
    path = _input_wav(m)
    if path is None:
        pytest.skip(f"input audio of {case} not found")
    _check_aligned(case, t, m, extractor.extract_file(path), "decoded file")
    wav, sr = load_audio(path.read_bytes())
    _check_aligned(case, t, m, extractor.extract(wav, sr), "bytes -> extract")


@parity
@pytest.mark.parametrize("case", discover("frontend", has=("prompt_text_ids",), where=lambda m: bool(m.get("transcript"))))
def test_prompt_text_ids(case, text_tokenizer):
    t, m = tensors(case), meta(case)
    ids = text_tokenizer.encode(m["transcript"])
    assert ids == t["prompt_text_ids"].reshape(-1).tolist()


# --------------------------------------------------------------------------------------
# 3. resampling from the input files
# --------------------------------------------------------------------------------------


@parity
@pytest.mark.parametrize("case", discover("frontend", has=("wav_16k", "wav_24k"), where=lambda m: bool(m.get("input_wav"))))
def test_load_and_resample_matches_reference(case):
    t, m = tensors(case), meta(case)
    path = _input_wav(m)
    if path is None:
        pytest.skip(f"input audio of {case} not found")
    info = sf.info(str(path))
    for key, sr in (("wav_16k", 16000), ("wav_24k", 24000)):
        got = load_prompt_wav(path, sr)
        ref = t[key]
        assert got.dtype == torch.float32 and got.shape == ref.shape, (key, got.shape, ref.shape)
        err = rel_l2(got, ref)
        _report(f"{case} {key} ({info.samplerate} Hz {info.subtype} -> {sr} Hz)", err,
                f"max_abs={(got - ref).abs().max().item():.2e}")
        assert err <= RESAMPLE_TOL


def test_resample_direct_path_equals_polyphase(monkeypatch):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 22050, generator=g)
    for orig, new in ((44100, 16000), (22050, 24000), (16000, 24000), (48000, 16000)):
        poly = resample(x, orig, new)
        monkeypatch.setattr(audio_mod, "MAX_POLYPHASE_KERNEL_ELEMENTS", 0)
        direct = resample(x, orig, new)
        monkeypatch.undo()
        assert direct.shape == poly.shape == (2, -(-new * x.shape[1] // orig))
        assert rel_l2(direct, poly) < 1e-6
    # a prime rate uses the direct path automatically without a gigantic kernel
    y = resample(torch.randn(1, 44101, generator=g), 44101, 16000)
    assert y.shape == (1, 16000)


def test_resample_properties():
    x = torch.randn(3, 4800, dtype=torch.float64)
    assert resample(x, 16000, 16000) is x
    y = resample(x, 48000, 16000)
    assert y.shape == (3, 1600) and y.dtype == torch.float64
    assert torch.allclose(resample(x[1:2], 48000, 16000), y[1:2])
    # a 1 kHz tone survives 48k -> 16k -> 48k
    tt = torch.arange(48000, dtype=torch.float32) / 48000
    tone = torch.sin(2 * torch.pi * 1000 * tt)[None]
    back = resample(resample(tone, 48000, 16000), 16000, 48000)
    assert rel_l2(back[:, 1000:-1000], tone[:, 1000:-1000]) < 1e-2
    with pytest.raises(ValueError):
        resample(torch.zeros(1, 10, dtype=torch.int16), 16000, 8000)


# --------------------------------------------------------------------------------------
# 4. real cached speech_feat
# --------------------------------------------------------------------------------------


@parity
@pytest.mark.parametrize("case", discover("frontend", has=("wav_24k", "real_speech_feat")))
def test_speech_feat_vs_real_cache(case, mel):
    t, m = tensors(case), meta(case)
    got = mel(t["wav_24k"])
    real = t["real_speech_feat"]
    assert got.shape == real.shape
    err, max_abs = rel_l2(got, real), (got - real).abs().max().item()
    _report(f"{case} speech_feat vs REAL cache", err,
            f"max_abs={max_abs:.2e} (reference recorded {m.get('speech_feat_vs_real_max_abs_diff', float('nan')):.2e})")
    assert err <= FEATURE_TOL
    path = _input_wav(m)
    if path is not None:  # the whole chain: decode, resample, mel
        full = mel(load_prompt_wav(path, mel.sample_rate))
        err_full = rel_l2(full, real)
        _report(f"{case} speech_feat vs REAL cache (from file)", err_full)
        assert err_full <= FEATURE_TOL


@parity
@pytest.mark.parametrize("case", discover("frontend", has=("real_prompt_text_token",)))
def test_real_prompt_text_token(case, text_tokenizer):
    real = tensors(case)["real_prompt_text_token"].reshape(-1).tolist()
    texts = [meta(n).get("cross_check_with_real_cache", {}).get("text") for n in discover("tokenizer")]
    texts = [x for x in texts if x]
    if not texts:
        pytest.skip("no text for the real cached prompt tokens")
    assert any(text_tokenizer.encode(x) == real for x in texts)


# --------------------------------------------------------------------------------------
# 5. text tokenizer
# --------------------------------------------------------------------------------------


@parity
@pytest.mark.parametrize("case", discover("tokenizer", where=lambda m: "entries" in m))
def test_text_tokens(case, text_tokenizer):
    m = meta(case)
    for e in m["entries"]:
        ids = text_tokenizer.encode(e["text"])
        assert ids == e["ids"], e["text"]
        assert text_tokenizer.decode(ids) == e["decoded_skip_special"], e["text"]
    for tok, i in m.get("special_token_ids", {}).items():
        assert text_tokenizer.token_id(tok) == i, tok
        assert text_tokenizer.special_token_ids.get(tok, i) == i
    if "vocab_size_with_added" in m:
        assert len(text_tokenizer) == m["vocab_size_with_added"]
    cc = m.get("cross_check_with_real_cache")
    if cc:
        assert text_tokenizer.encode(cc["text"]) == cc["ids_real_spk2info"]
    print(f"\n[frontend parity] {case}: {len(m['entries'])} entries encode/decode exactly", end="")


def _copy_blanken(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for name in REQUIRED_FILES:
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


@parity
def test_tokenizer_ignores_stock_tokenizer_json(mdir, tmp_path):
    d = _copy_blanken(mdir / "CosyVoice-BlankEN", tmp_path / "blanken")
    (d / "tokenizer.json").write_text('{"not": "the official merges"}', encoding="utf-8")
    tok = TextTokenizer(d)
    cases = discover("tokenizer", where=lambda m: "entries" in m)
    for case in cases:
        for e in meta(case)["entries"][:3]:
            assert tok.encode(e["text"]) == e["ids"]


@parity
def test_tokenizer_bad_files(mdir, tmp_path):
    src = mdir / "CosyVoice-BlankEN"
    with pytest.raises(ModelDirError, match="not found"):
        TextTokenizer(tmp_path / "nowhere")
    for name in REQUIRED_FILES:
        d = _copy_blanken(src, tmp_path / f"missing_{name}")
        (d / name).unlink()
        with pytest.raises(ModelDirError, match=re.escape(name)):
            TextTokenizer(d)
    d = _copy_blanken(src, tmp_path / "corrupt_vocab")
    (d / "vocab.json").write_bytes((src / "vocab.json").read_bytes()[:1000])
    with pytest.raises(ModelDirError, match="vocab.json"):
        TextTokenizer(d)
    d = _copy_blanken(src, tmp_path / "corrupt_merges")
    (d / "merges.txt").write_bytes(b"\x00\x01\x02 garbage with too many fields\n")
    with pytest.raises(ModelDirError, match="merges.txt"):
        TextTokenizer(d)


# --------------------------------------------------------------------------------------
# 6. bad inputs, model files
# --------------------------------------------------------------------------------------


def test_load_audio_formats_and_mono():
    sr = 22050
    stereo = np.stack([np.linspace(-0.5, 0.5, 3000), np.linspace(0.5, -0.25, 3000)], axis=1)
    pcm = np.round(stereo * 32767).astype(np.int16)
    pcm[0, 0] = -32768
    data = _wav_bytes(pcm, sr)
    wav, got_sr = load_audio(data)
    assert got_sr == sr and wav.shape == (2, 3000) and wav.dtype == torch.float32
    # PCM_16 scaling as torchaudio's soundfile backend: divide by 32768
    assert torch.equal(wav, torch.from_numpy(pcm.T.astype(np.float32) / 32768.0))
    assert wav.min().item() == -1.0
    wav2, _ = load_audio(io.BytesIO(data))
    assert torch.equal(wav, wav2)
    mono = to_mono(wav)
    assert mono.shape == (1, 3000) and torch.allclose(mono, wav.mean(0, keepdim=True))
    out = load_prompt_wav(data, 16000)
    assert out.shape == (1, -(-16000 * 3000 // sr))


@pytest.mark.parametrize(
    "src, pattern",
    [
        ("/definitely/not/here.wav", "not found"),
        (b"this is not audio at all" * 20, "cannot decode"),
        (b"", "empty"),
        (bytes(range(256)) * 8, "cannot decode"),
    ],
)
def test_load_audio_rejects(src, pattern):
    with pytest.raises(InvalidInputError, match=pattern) as info:
        load_audio(src)
    assert info.value.field == "prompt_wav"


def test_load_audio_rejects_empty_nan_and_absurd_rate(tmp_path):
    with pytest.raises(InvalidInputError, match="no audio samples"):
        load_audio(_wav_bytes(np.zeros((0, 1), np.float32), 16000))
    bad = np.zeros((1600, 1), np.float32)
    bad[10] = np.nan
    with pytest.raises(InvalidInputError, match="NaN"):
        load_audio(_wav_bytes(bad, 16000, subtype="FLOAT"))
    with pytest.raises(InvalidInputError, match="sample rate"):
        load_audio(_wav_bytes(np.zeros((100, 1), np.float32), 100))
    with pytest.raises(InvalidInputError, match="not a regular file"):
        load_audio(tmp_path)
    with pytest.raises(InvalidInputError, match="too low"):
        load_prompt_wav(_wav_bytes(np.zeros((8000, 1), np.float32), 8000), 24000)
    with pytest.raises(InvalidInputError, match="long"):
        load_audio(_wav_bytes(np.zeros((16000 * 3, 1), np.float32), 16000), max_seconds=2)


@parity
def test_prompt_duration_and_rate_limits(extractor):
    g = torch.Generator().manual_seed(1)
    with pytest.raises(InvalidInputError, match="too short"):
        extractor.extract(0.1 * torch.randn(1, 8000, generator=g), 16000)  # 0.5 s
    with pytest.raises(InvalidInputError, match="too long"):
        extractor.extract(0.1 * torch.randn(1, 16000 * 31, generator=g), 16000)  # 31 s
    with pytest.raises(InvalidInputError, match="too long"):
        extractor.extract_file(_wav_bytes(np.zeros((16000 * 31, 1), np.float32), 16000))
    with pytest.raises(InvalidInputError, match="too short"):
        extractor.extract_file(_wav_bytes(np.zeros((4000, 1), np.float32), 16000))
    with pytest.raises(InvalidInputError, match="sample rate"):
        extractor.extract(0.1 * torch.randn(1, 8000 * 2, generator=g), 8000)
    with pytest.raises(InvalidInputError, match="sample rate"):
        extractor.extract(0.1 * torch.randn(1, 48000, generator=g), 10**7)
    nan = torch.zeros(1, 32000)
    nan[0, 5] = float("inf")
    with pytest.raises(InvalidInputError, match="NaN or infinite"):
        extractor.extract(nan, 16000)
    with pytest.raises(InvalidInputError, match="empty"):
        extractor.extract(torch.zeros(1, 0), 16000)
    # a 2 s stereo 48 kHz prompt works and is aligned
    p = extractor.extract(0.1 * torch.randn(2, 96000, generator=g), 48000)
    assert p.speech_feat.shape == (1, 2 * p.num_tokens, 80) and p.embedding.shape == (1, 192)
    # limits are parameters
    lenient = PromptExtractor(extractor.model_dir, extractor.cfg, min_seconds=0.25)
    assert lenient.extract(0.1 * torch.randn(1, 8000, generator=g), 16000).num_tokens > 0


@parity
def test_speech_tokenizer_refuses_over_30s(mdir):
    tok = SpeechTokenizer(mdir / "speech_tokenizer_v2.onnx")
    ok = torch.zeros(1, SPEECH_TOKENIZER_MEL.n_mels, tok.max_frames)
    assert tok(ok).shape == (1, tok.max_frames // 4)
    with pytest.raises(InvalidInputError, match="too long"):
        tok(torch.zeros(1, SPEECH_TOKENIZER_MEL.n_mels, tok.max_frames + 1))


def test_onnx_model_file_errors(tmp_path):
    with pytest.raises(ModelDirError, match="campplus.onnx"):
        SpeakerEncoder(tmp_path / "campplus.onnx")
    bad = tmp_path / "speech_tokenizer_v2.onnx"
    bad.write_bytes(b"definitely not a protobuf" * 10)
    with pytest.raises(ModelDirError, match="not a loadable ONNX model"):
        SpeechTokenizer(bad)


@parity
def test_onnx_signature_mismatch(mdir):
    with pytest.raises(ModelDirError, match="input"):
        SpeechTokenizer(mdir / "campplus.onnx")  # one input where two are expected


def test_features_short_audio_and_batching(cfg):
    m = PromptMelExtractor(cfg.feat)
    with pytest.raises(InvalidInputError, match="too short"):
        m(torch.zeros(1, 100))
    with pytest.raises(InvalidInputError, match="too short"):
        kaldi_fbank(torch.zeros(1, 399))
    with pytest.raises(InvalidInputError, match="too short"):
        whisper_log_mel(torch.zeros(1, 150))
    g = torch.Generator().manual_seed(2)
    x = 0.1 * torch.randn(2, 24000, generator=g)
    batch = m(x)
    assert batch.shape == (2, 24000 // cfg.feat.hop_size, cfg.feat.num_mels)
    assert torch.allclose(batch[1:], m(x[1:]), atol=1e-5)
    w = whisper_log_mel(x[:, :16000])
    assert w.shape == (2, 128, 100) and torch.allclose(w[1:], whisper_log_mel(x[1:, :16000]), atol=1e-5)
    fb = speaker_fbank(x[:, :16000])
    assert fb.shape == (2, 98, 80) and torch.allclose(fb[1:], speaker_fbank(x[1:, :16000]), atol=1e-4)


@pytest.mark.gpu
def test_features_on_cuda_match_cpu(cfg):
    m = PromptMelExtractor(cfg.feat)
    g = torch.Generator().manual_seed(3)
    x = 0.1 * torch.randn(1, 48000, generator=g)
    dev = torch.device("cuda")
    assert rel_l2(m(x.to(dev)).cpu(), m(x)) < 1e-4
    x16 = resample(x, 24000, 16000)
    assert rel_l2(resample(x.to(dev), 24000, 16000).cpu(), x16) < 1e-5
    assert rel_l2(whisper_log_mel(x16.to(dev)).cpu(), whisper_log_mel(x16)) < 1e-4
    assert rel_l2(speaker_fbank(x16.to(dev)).cpu(), speaker_fbank(x16)) < 1e-4

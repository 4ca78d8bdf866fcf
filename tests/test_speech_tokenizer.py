"""The PyTorch S3 speech tokenizer v2, its ONNX loader and builder, backend selection, and
batched prompt extraction (issue 19).

Parity is checked against onnxruntime running an ONNX file written by
:mod:`cosyserve.models.random_frontend` (the real graph structure at small dimensions, random
weights). Token comparisons allow a difference only where the encoder's pre-rounding value is
within 1e-4 of a rounding boundary (float summation order can legitimately flip those).
"""

from __future__ import annotations

import asyncio
import os
import shutil

import numpy as np
import pytest
import torch

from cosyserve.errors import InvalidInputError, ModelDirError
from cosyserve.frontend.audio import load_audio, resample
from cosyserve.frontend.features import whisper_log_mel
from cosyserve.frontend.s3tokenizer import FSQ_SCALE, load_s3_tokenizer_v2, read_s3_tokenizer_v2
from cosyserve.frontend.speech_models import (
    SpeechTokenizer,
    TorchSpeechTokenizer,
    open_speech_tokenizer,
)
from cosyserve.models.demo import shipped_prompt
from cosyserve.models.random_frontend import (
    CamSize,
    S3TokenizerSize,
    campplus_like_onnx,
    count_parameters,
    s3_tokenizer_v2_onnx,
)

import _reference as ref

TINY = S3TokenizerSize(n_state=128, n_layer=2, n_mlp=256, fsmn_kernel=31, max_positions=1024)
TINY_CAM = CamSize(fcm_channels=4, init_channels=16, growth=8, bottleneck=16, layers=(2, 2, 2))


@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory):
    import onnx

    path = tmp_path_factory.mktemp("s3tok") / "speech_tokenizer_v2.onnx"
    onnx.save(s3_tokenizer_v2_onnx(TINY, seed=3), str(path))
    return path


@pytest.fixture(scope="module")
def mels():
    """Whisper log-mels of the shipped prompt cut to different lengths (odd and even frame counts)."""
    wav, sr = load_audio(shipped_prompt()[0])
    wav16 = resample(wav[:1].float(), sr, 16000)
    full = whisper_log_mel(wav16)[0]  # [128, T]
    return [full[:, :n].contiguous() for n in (37, 130, 402, full.shape[1])]


def _ort(path, mel_batch: torch.Tensor, lengths: list[int]) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {"feats": mel_batch.numpy().astype(np.float32),
                           "feats_length": np.asarray(lengths, np.int32)})[0]


def _pre_round(model, mel: torch.Tensor) -> torch.Tensor:
    """The quantizer's value before rounding, ``[T', digits]``."""
    with torch.inference_mode():
        hidden, _ = model.encode(mel[None], torch.tensor([mel.shape[1]]))
        return torch.tanh(model.project_down(hidden).float())[0] * FSQ_SCALE


def _digits(tokens: torch.Tensor, n: int) -> torch.Tensor:
    t = tokens.long().reshape(-1, 1)
    return (t // (3 ** torch.arange(n))) % 3


def assert_tokens_match(a, b, model, mel, what: str):
    a = torch.as_tensor(np.asarray(a)).reshape(-1).long()
    b = torch.as_tensor(np.asarray(b)).reshape(-1).long()
    assert a.shape == b.shape, f"{what}: {tuple(a.shape)} vs {tuple(b.shape)}"
    if torch.equal(a, b):
        return
    n = model.dims.n_digits
    differ = _digits(a, n) != _digits(b, n)
    h = _pre_round(model, mel)[: a.numel()]  # the full utterance's encoding, cut like the tokens
    near = (h.abs() - 0.5).abs() < 1e-4
    assert bool(near[differ].all()), f"{what}: {int((a != b).sum())} tokens differ away from rounding boundaries"


def test_builder_structure_is_read_back(tiny_onnx):
    import onnx

    dims, sd = read_s3_tokenizer_v2(tiny_onnx)
    assert (dims.n_mels, dims.n_state, dims.n_layer, dims.n_mlp, dims.fsmn_kernel, dims.n_digits) == \
        (TINY.n_mels, TINY.n_state, TINY.n_layer, TINY.n_mlp, TINY.fsmn_kernel, TINY.n_digits)
    assert dims.n_head == TINY.n_state // TINY.head_dim
    assert (dims.conv1.kernel, dims.conv1.stride, dims.conv1.padding) == (3, 2, 1)
    assert dims.attn_ln_eps == pytest.approx(TINY.attn_ln_eps) and dims.mlp_ln_eps == pytest.approx(TINY.mlp_ln_eps)
    assert dims.codebook_size == 6561
    # every floating weight of the graph lands in the state dict, except the rotary tables and FSQ powers
    model = onnx.load(str(tiny_onnx))
    assert sum(v.numel() for v in sd.values()) == count_parameters(model) - 2 * TINY.max_positions * TINY.head_dim \
        - TINY.n_digits


def test_torch_equals_onnxruntime_per_item_and_batched(tiny_onnx, mels):
    model = load_s3_tokenizer_v2(tiny_onnx)
    single = [model.tokenize([m])[0] for m in mels]
    batched = model.tokenize(mels)
    lengths = [m.shape[1] for m in mels]
    pad = torch.zeros(len(mels), 128, max(lengths))
    for i, m in enumerate(mels):
        pad[i, :, : m.shape[1]] = m
    ort_batched = _ort(tiny_onnx, pad, lengths)
    for i, m in enumerate(mels):
        n = -(-m.shape[1] // 4)
        assert single[i].shape == (1, n) and single[i].dtype == torch.int32
        ort_single = _ort(tiny_onnx, m[None], [m.shape[1]])
        assert ort_single.shape == (1, n)
        assert_tokens_match(single[i], ort_single, model, m, f"item {i}: torch vs onnxruntime")
        assert_tokens_match(batched[i], single[i], model, m, f"item {i}: torch batched vs alone")
        assert_tokens_match(ort_batched[i, :n], ort_single, model, m, f"item {i}: onnxruntime batched vs alone")
        assert len(torch.unique(single[i])) > min(n, 8) // 2, "random weights should give varied tokens"
    with pytest.raises(AssertionError, match="differ away from rounding boundaries"):  # the check can fail
        assert_tokens_match(single[0], (single[0] + 1) % 6561, model, mels[0], "shifted")
    # valid encoder outputs of a padded batch equal the single-item ones
    with torch.inference_mode():
        hb, lb = model.encode(pad, torch.tensor(lengths))
        for i, m in enumerate(mels):
            hs, ls = model.encode(m[None], torch.tensor([m.shape[1]]))
            assert int(lb[i]) == int(ls[0])
            assert ref.rel_l2(hb[i, : int(ls[0])], hs[0]) < 1e-5


def test_backend_selection(tiny_onnx):
    standin = ref.model_dir() / "speech_tokenizer_v2.onnx"
    assert read_s3_tokenizer_v2(standin) is None
    assert isinstance(open_speech_tokenizer(standin), SpeechTokenizer)
    with pytest.raises(ModelDirError, match="S3 tokenizer v2 structure"):
        open_speech_tokenizer(standin, backend="torch")
    # auto: onnxruntime on the CPU (faster there), PyTorch on CUDA (the GPU test)
    assert isinstance(open_speech_tokenizer(tiny_onnx), SpeechTokenizer)
    assert isinstance(open_speech_tokenizer(tiny_onnx, device="cpu"), SpeechTokenizer)
    tok = open_speech_tokenizer(tiny_onnx, backend="torch")
    assert isinstance(tok, TorchSpeechTokenizer) and tok.backend == "torch"
    assert isinstance(open_speech_tokenizer(tiny_onnx, backend="onnxruntime"), SpeechTokenizer)
    with pytest.raises(ModelDirError, match="unknown speech tokenizer backend"):
        open_speech_tokenizer(tiny_onnx, backend="tensorrt")
    with pytest.raises(ModelDirError, match="not found"):
        open_speech_tokenizer(tiny_onnx.parent / "missing.onnx")
    # the two backends agree through the common interface, including the input checks
    mel = torch.randn(1, 128, 123, generator=torch.Generator().manual_seed(0))
    ort_tok = open_speech_tokenizer(tiny_onnx, backend="onnxruntime")
    assert_tokens_match(tok(mel), ort_tok(mel), tok.model, mel[0], "torch vs onnxruntime backend")
    for t in (tok, ort_tok):
        with pytest.raises(InvalidInputError, match="too long"):
            t(torch.zeros(1, 128, t.max_frames + 1))
        with pytest.raises(InvalidInputError, match="no log-mel frames"):
            t.tokenize([torch.zeros(1, 128, 0)])


def test_loader_names_missing_weights(tiny_onnx, tmp_path):
    import onnx

    model = onnx.load(str(tiny_onnx))
    victim = next(n for n in model.graph.node if n.name == "/blocks.1/attn/key/MatMul")
    victim.name = "/blocks.1/attn/renamed/MatMul"
    broken = tmp_path / "broken.onnx"
    onnx.save(model, str(broken))
    with pytest.raises(ModelDirError, match="block 1 lacks key.weight"):
        read_s3_tokenizer_v2(broken)
    (tmp_path / "garbage.onnx").write_bytes(b"not an onnx file")
    with pytest.raises(ModelDirError):
        read_s3_tokenizer_v2(tmp_path / "garbage.onnx")


def test_campplus_like_runs_with_the_real_convention(tmp_path):
    import onnxruntime as ort

    from cosyserve.frontend.speech_models import SpeakerEncoder

    full = campplus_like_onnx()
    assert 5_000_000 < count_parameters(full) < 9_000_000  # CAM++ has ~7 M parameters
    import onnx

    path = tmp_path / "campplus.onnx"
    onnx.save(campplus_like_onnx(TINY_CAM, seed=1), str(path))
    enc = SpeakerEncoder(path)
    fb = torch.randn(1, 250, 80, generator=torch.Generator().manual_seed(1))
    emb = enc(fb)
    assert emb.shape == (1, 192) and torch.isfinite(emb).all()
    assert [torch.equal(a, b) for a, b in zip(enc.embed_many([fb, fb[:, :100]]), [emb, enc(fb[:, :100])])] == [True] * 2
    assert "CPUExecutionProvider" in ort.get_available_providers()


# ------------------------------------------------------------------- batched prompt extraction


@pytest.fixture(scope="module")
def builder_model_dir(tmp_path_factory, tiny_onnx):
    """The reference model directory with the two ONNX files replaced by builder models."""
    import onnx

    src = ref.model_dir()
    out = tmp_path_factory.mktemp("model")
    for p in src.iterdir():
        if p.suffix != ".onnx":
            os.symlink(p, out / p.name)
    shutil.copyfile(tiny_onnx, out / "speech_tokenizer_v2.onnx")
    onnx.save(campplus_like_onnx(TINY_CAM, seed=1), str(out / "campplus.onnx"))
    return out


def _prompts():
    wav, sr = load_audio(shipped_prompt()[0])
    wav = wav[:1].float()
    return [(wav[:, : int(sec * sr)], sr) for sec in (1.2, 2.5, 3.3)] + [(wav, sr)]


def _same(a, b):
    return (torch.equal(a.speech_token, b.speech_token) and torch.equal(a.embedding, b.embedding)
            and torch.equal(a.speech_feat, b.speech_feat))


def test_finish_batch_equals_single_extraction(builder_model_dir):
    from cosyserve.frontend.prompt import PromptExtractor

    ex = PromptExtractor(builder_model_dir, tokenizer_backend="torch")
    assert ex.speech_tokenizer.backend == "torch"
    prompts = _prompts()
    single = [ex.extract(w, sr) for w, sr in prompts]
    batched = ex.finish([ex.prepare(w, sr) for w, sr in prompts])
    for i, (s, b) in enumerate(zip(single, batched)):
        assert not isinstance(b, BaseException), b
        assert s.speech_token.shape[1] > 0 and s.num_frames == 2 * s.num_tokens
        if not _same(s, b):  # tokens may differ only at rounding boundaries
            assert torch.equal(s.embedding, b.embedding) and torch.equal(s.speech_feat, b.speech_feat)
            mel = ex.prepare(*prompts[i]).log_mel[0]
            assert_tokens_match(s.speech_token, b.speech_token, ex.speech_tokenizer.model, mel, f"prompt {i}")


@pytest.fixture(scope="module")
def builder_frontend(builder_model_dir):
    from cosyserve.frontend.frontend import Frontend

    return Frontend(builder_model_dir, normalizer="rules", tokenizer_backend="torch")


def test_batcher_shares_one_forward_and_isolates_errors(builder_frontend, monkeypatch):
    from cosyserve.frontend.prompt_batch import PromptBatcher

    fe = builder_frontend
    prompts = _prompts()
    transcript = shipped_prompt()[1]
    expected = [fe.make_voice("v", p, transcript) for p in prompts]
    calls = []
    real_tokenize = fe.prompts.speech_tokenizer.tokenize

    def counting(feats):
        calls.append(len(feats))
        return real_tokenize(feats)

    monkeypatch.setattr(fe.prompts.speech_tokenizer, "tokenize", counting)
    batcher = PromptBatcher(fe, window_s=0.2)
    too_short = (prompts[0][0][:, :100], prompts[0][1])

    async def main():
        jobs = [batcher.make_voice("v", p, transcript) for p in prompts]
        jobs.insert(1, batcher.make_voice("v", too_short, transcript))
        return await asyncio.gather(*jobs, return_exceptions=True)

    got = asyncio.run(main())
    assert isinstance(got[1], InvalidInputError) and "too short" in str(got[1])
    voices = got[:1] + got[2:]
    assert calls == [len(prompts)] and list(batcher.batch_sizes) == [len(prompts)]
    for p, v, e in zip(prompts, voices, expected):
        assert not isinstance(v, BaseException), v
        assert torch.equal(v.prompt_text_ids, e.prompt_text_ids) and torch.equal(v.llm_embedding, e.llm_embedding)
        assert torch.equal(v.speech_feat, e.speech_feat)
        mel = fe.prompts.prepare(*p).log_mel[0]
        assert_tokens_match(v.llm_speech_token, e.llm_speech_token, fe.prompts.speech_tokenizer.model,
                            mel, "batched voice")

    with pytest.raises(ValueError):
        PromptBatcher(fe, window_s=-1)


def test_batcher_skips_requests_that_went_away(builder_frontend):
    from cosyserve.frontend.prompt_batch import PromptBatcher

    fe = builder_frontend
    batcher = PromptBatcher(fe, window_s=0.1, max_batch=2)
    prepared = [fe.prompts.prepare(*p) for p in _prompts()]

    async def main():
        tasks = [asyncio.ensure_future(batcher.extract(p)) for p in prepared]
        await asyncio.sleep(0.02)
        tasks[0].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    got = asyncio.run(main())
    assert isinstance(got[0], asyncio.CancelledError)
    assert all(not isinstance(g, BaseException) for g in got[1:])
    # the cancelled one was dropped, the other three went in batches of at most max_batch
    assert list(batcher.batch_sizes) == [2, 1]
    single = fe.prompts.finish(prepared[1:])
    for g, s, p in zip(got[1:], single, prepared[1:]):
        assert torch.equal(g.embedding, s.embedding) and torch.equal(g.speech_feat, s.speech_feat)
        assert_tokens_match(g.speech_token, s.speech_token, fe.prompts.speech_tokenizer.model,
                            p.log_mel[0], "batched after a cancellation")


@pytest.mark.gpu
def test_gpu_torch_tokenizer_equals_onnxruntime(tmp_path, mels):
    """Full-size builder ONNX: the PyTorch tokenizer on CUDA (batched and alone) against
    onnxruntime on the CPU."""
    import onnx

    path = tmp_path / "speech_tokenizer_v2.onnx"
    onnx.save(s3_tokenizer_v2_onnx(S3TokenizerSize(), seed=5), str(path))
    tok = open_speech_tokenizer(path, device="cuda")  # auto picks PyTorch on CUDA
    assert isinstance(tok, TorchSpeechTokenizer) and tok.device.type == "cuda"
    model = tok.model
    cpu_model = load_s3_tokenizer_v2(path)
    batched = model.tokenize(mels)
    for i, m in enumerate(mels):
        alone = model.tokenize([m])[0].cpu()
        ort_tokens = _ort(path, m[None], [m.shape[1]])
        assert_tokens_match(alone, ort_tokens, cpu_model, m, f"item {i}: cuda vs onnxruntime")
        assert_tokens_match(batched[i].cpu(), alone, cpu_model, m, f"item {i}: cuda batched vs alone")


@pytest.mark.parametrize("argv, needle", [
    (["serve", "--demo", "--full-size-frontend"], "--full-size-frontend only applies with --random-weights"),
    (["serve", "--demo", "--prompt-cache", "-1"], "--prompt-cache must be >= 0"),
    (["serve", "--demo", "--prompt-batch-window", "5"], "--prompt-batch-window must be between 0 and 1 s"),
])
def test_cli_prompt_options_errors(capsys, argv, needle):
    from cosyserve.cli import main

    code = main(argv)
    err = capsys.readouterr().err
    assert code != 0 and needle in err and "Traceback" not in err

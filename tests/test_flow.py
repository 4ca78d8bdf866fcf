"""Parity of :mod:`cosyserve.models.flow` with the upstream reference data.

Cases are discovered from the reference directory by kind and by the tensors their
sidecars list (see ``tests/_reference.py``); nothing here names a case or a dimension.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _reference import PARITY_TOL as TOL
from _reference import SELF_TOL as BATCH_TOL
from _reference import (check_close, discover, full_size_config, manifest, manifest_shapes, meta, model_dir,
                        reference_dir, rel_l2, require_reference_dir, tensors)
from cosyserve.errors import CheckpointError
from cosyserve.models import fused
from cosyserve.models.checkpoint import load_strict, read_state_dict
from cosyserve.models.config import load_config
from cosyserve.models.flow import FlowModel

pytestmark = pytest.mark.parity

FLOW_INPUTS = ("token", "prompt_token", "prompt_feat", "embedding")
INTERMEDIATES = ("encoder_out", "mu", "spks", "cond", "noise", "estimator_step0_out")
STREAM_TOKEN_NAMES = ("source_speech_token", "speech_token", "token")

OFFLINE_CASES = discover("flow", has=FLOW_INPUTS + ("mel",))
NOISE_CASES = discover("flow", has=("rand_noise_prefix",))
STREAM_CASES = discover(
    "stream", has=("prompt_token", "prompt_feat", "embedding"),
    where=lambda m: bool(m.get("chunks")) and any(n in m.get("tensors", {}) for n in STREAM_TOKEN_NAMES),
)
E2E_CASES = discover("e2e", has=FLOW_INPUTS + ("mel",))


def _build(cfg_path) -> FlowModel:
    return FlowModel(load_config(cfg_path).flow).eval()


@pytest.fixture(scope="module")
def flow() -> FlowModel:
    require_reference_dir()
    model = _build(model_dir() / "cosyvoice2.yaml")
    load_strict(model, read_state_dict(model_dir() / "flow.pt"), "flow.pt")
    return model


def _stream_tokens(name: str) -> torch.Tensor:
    t = tensors(name)
    return next(t[n] for n in STREAM_TOKEN_NAMES if n in t)


def _stream_chunks(name: str):
    """(tokens, streaming, finalize, chunk index) for every chunk of a stream case."""
    tokens = _stream_tokens(name)
    for i, c in enumerate(meta(name)["chunks"]):
        yield tokens[:, : int(c["n_tokens"])], bool(c["streaming"]), bool(c["finalize"]), i


# ---------------------------------------------------------------------------------------
# 1. offline flow cases: every intermediate and the final mel


@pytest.mark.parametrize("name", OFFLINE_CASES)
def test_offline_flow_case(flow, name):
    t = tensors(name)
    args = [t[k] for k in FLOW_INPUTS]
    with torch.inference_mode():
        c = flow.condition([args[0]], [args[1]], [args[2]], args[3], False, True)
        frames = c.mu.size(-1)
        noise = flow.rand_noise[:, :, :frames]
        t0 = flow.decoder.time_span(flow.cfg.cfm.n_timesteps, c.mu.device, c.mu.dtype)[0]
        x = torch.cat([noise, noise])
        step0 = flow.decoder.estimator(
            x, torch.cat([c.mask, c.mask]), torch.cat([c.mu, torch.zeros_like(c.mu)]), t0.expand(2),
            torch.cat([c.spks, torch.zeros_like(c.spks)]), torch.cat([c.cond, torch.zeros_like(c.cond)]), False,
        )
    got = {"encoder_out": c.encoder_out, "mu": c.mu, "spks": c.spks, "cond": c.cond, "noise": noise,
           "estimator_step0_out": step0}
    mel = flow.inference(*args, streaming=False, finalize=True)
    assert mel.dtype == torch.float32
    errors = {k: rel_l2(got[k], t[k]) for k in INTERMEDIATES if k in t}
    errors["mel"] = rel_l2(mel, t["mel"])
    print(name, errors)
    assert all(e <= TOL for e in errors.values()), errors


# ---------------------------------------------------------------------------------------
# 2. the fixed CFM noise buffer


@pytest.mark.parametrize("name", NOISE_CASES)
def test_noise_buffer(flow, name):
    ref = tensors(name)["rand_noise_prefix"]
    got = flow.rand_noise[..., : ref.size(-1)]
    check_close(got, ref, f"{name} rand_noise prefix")
    assert "decoder.rand_noise" not in flow.state_dict()
    assert flow.rand_noise.shape == (1, flow.n_mels, flow.cfg.cfm.noise_frames)


def test_noise_does_not_touch_global_rng():
    """Upstream re-seeds the global RNGs with 0 when it builds the CFM; cosyserve must not,
    and the noise must not depend on the global RNG state."""
    require_reference_dir()
    torch.manual_seed(12345)
    a = _build(model_dir() / "cosyvoice2.yaml").rand_noise
    assert torch.initial_seed() == 12345
    torch.manual_seed(54321)
    b = _build(model_dir() / "cosyvoice2.yaml").rand_noise
    assert torch.initial_seed() == 54321
    assert torch.equal(a, b)  # the same seeded draw twice: exact by construction


# ---------------------------------------------------------------------------------------
# 3. streaming chunks


@pytest.mark.parametrize("name", STREAM_CASES)
def test_stream_chunks(flow, name):
    t = tensors(name)
    errors = {}
    for tokens, streaming, finalize, i in _stream_chunks(name):
        mel = flow.inference(tokens, t["prompt_token"], t["prompt_feat"], t["embedding"], streaming, finalize)
        errors[f"c{i}"] = rel_l2(mel, t[f"c{i}_flow_mel"])
    print(name, errors)
    assert errors and all(e <= TOL for e in errors.values()), errors


# ---------------------------------------------------------------------------------------
# 4. end-to-end token2wav (offline): the flow part


@pytest.mark.parametrize("name", E2E_CASES)
def test_e2e_token2wav_mel(flow, name):
    t = tensors(name)
    mel = flow.inference(*(t[k] for k in FLOW_INPUTS), streaming=False, finalize=True)
    err = rel_l2(mel, t["mel"])
    print(name, err)
    assert err <= TOL


# ---------------------------------------------------------------------------------------
# 5. one batch mixing everything equals the single-item results


def _batch_items():
    items = []  # (label, token, prompt_token, prompt_feat, embedding, streaming, finalize, reference mel or None)
    for name in OFFLINE_CASES + E2E_CASES:
        t = tensors(name)
        items.append((name, *(t[k] for k in FLOW_INPUTS), False, True, t["mel"]))
    for name in STREAM_CASES:
        t = tensors(name)
        for tokens, streaming, finalize, i in _stream_chunks(name):
            items.append((f"{name}/c{i}", tokens, t["prompt_token"], t["prompt_feat"], t["embedding"],
                          streaming, finalize, t[f"c{i}_flow_mel"]))
    if items:
        # derived items widen the mix: no prompt + streaming non-final chunk, and a prompt-only
        # item that is streaming *and* final
        _, tok, ptok, pfeat, emb, *_ = max(items, key=lambda it: it[1].size(1))
        items.append(("derived/no_prompt_stream_chunk", tok[:, : tok.size(1) // 2 + 4], ptok[:, :0],
                      pfeat[:, :0], emb, True, False, None))
        items.append(("derived/stream_final", tok[:, :7], ptok, pfeat, emb, True, True, None))
    return items


def test_batch_equals_single(flow):
    items = _batch_items()
    if len(items) < 2:
        pytest.skip("not enough reference cases to form a batch")
    labels, toks, ptoks, pfeats, embs, streams, finals, refs = zip(*items)
    assert any(p.size(1) == 0 for p in ptoks) and len({p.size(1) for p in ptoks}) > 1
    assert any(s and not f for s, f in zip(streams, finals))
    # shuffle deterministically so that the longest item is not first
    order = sorted(range(len(items)), key=lambda i: (i * 7919) % len(items))
    batch = flow.inference_batch([toks[i] for i in order], [ptoks[i] for i in order], [pfeats[i] for i in order],
                                 [embs[i] for i in order], [streams[i] for i in order], [finals[i] for i in order])
    errors = {}
    for out, i in zip(batch, order):
        single = flow.inference(toks[i], ptoks[i], pfeats[i], embs[i], streams[i], finals[i])
        assert out.shape == single.shape and out.dtype == torch.float32
        errors[labels[i]] = rel_l2(out, single)
        if refs[i] is not None:
            assert rel_l2(out, refs[i]) <= TOL, labels[i]
    print(errors)
    assert all(e <= BATCH_TOL for e in errors.values()), errors


def test_bucket_padded_flow_equals_batch(flow):
    """What a GraphedFlow graph computes (CPU here): the batch copied into larger bucket buffers
    (extra padding rows, tokens padded to a 32-token bucket, prompt mel padded to the bucket's
    frames) gives the eager batch's frames."""
    from cosyserve.models.graphs import fill_flow_buffers, flow_buffers, flow_from_buffers

    items = _batch_items()
    if not items:
        pytest.skip("no reference cases")
    labels, toks, ptoks, pfeats, embs, streams, finals, refs = zip(*items)
    ref = flow.inference_batch(toks, ptoks, pfeats, embs, streams, finals)
    inp = flow.prepare(toks, ptoks, pfeats, embs, streams, finals)
    bb, lb = len(items) + 2, -(-inp.ids.shape[1] // 32) * 32 + 32
    bufs = flow_buffers(flow, bb, lb, "cpu")
    fill_flow_buffers(bufs, inp, flow.token_mel_ratio)
    with torch.inference_mode():
        mel = flow_from_buffers(flow, bufs)
    assert mel.shape == (bb, flow.n_mels, flow.token_mel_ratio * lb)
    assert torch.isfinite(mel).all()  # padding rows too
    for i, (p, n) in enumerate(zip(inp.prompt_frames, inp.mel_lengths)):
        assert rel_l2(mel[i:i + 1, :, p:n], ref[i]) <= BATCH_TOL, labels[i]


# ---------------------------------------------------------------------------------------
# 6. strict checkpoint loading


def test_strict_loading_names_the_key():
    require_reference_dir()
    sd = read_state_dict(model_dir() / "flow.pt")
    keys = list(sd)
    victim = next(k for k in keys if k.startswith("decoder.estimator.") and k.endswith(".weight"))

    missing = {k: v for k, v in sd.items() if k != victim}
    with pytest.raises(CheckpointError, match=victim.replace(".", r"\.")):
        load_strict(_build(model_dir() / "cosyvoice2.yaml"), missing, "flow.pt")

    extra = dict(sd)
    extra["encoder.bogus_layer.weight"] = torch.zeros(3)
    with pytest.raises(CheckpointError, match=r"encoder\.bogus_layer\.weight"):
        load_strict(_build(model_dir() / "cosyvoice2.yaml"), extra, "flow.pt")

    wrong = dict(sd)
    shape_key = "encoder_proj.weight" if "encoder_proj.weight" in sd else keys[0]
    wrong[shape_key] = torch.zeros(*(s + 1 for s in sd[shape_key].shape))
    with pytest.raises(CheckpointError, match=shape_key.replace(".", r"\.")):
        load_strict(_build(model_dir() / "cosyvoice2.yaml"), wrong, "flow.pt")


# ---------------------------------------------------------------------------------------
# 7. the full-size architecture (meta device only)


def test_full_size_state_dict_matches_manifest(tmp_path):
    cfg = full_size_config(tmp_path).flow
    with torch.device("meta"):
        model = FlowModel(cfg)
    got = {k: list(v.shape) for k, v in model.state_dict().items()}
    want = manifest_shapes("flow")
    assert sorted(set(got) - set(want)) == [] and sorted(set(want) - set(got)) == []
    assert {k: v for k, v in got.items() if want[k] != v} == {}
    assert len(got) == manifest("flow").get("n_tensors", len(want))


# ---------------------------------------------------------------------------------------
# input validation and dtypes


def test_invalid_inputs(flow):
    case = (OFFLINE_CASES + E2E_CASES or [None])[0]
    if case is None:
        pytest.skip("no offline case")
    t = tensors(case)
    tok, ptok, pfeat, emb = (t[k] for k in FLOW_INPUTS)
    la = flow.pre_lookahead_len
    with pytest.raises(ValueError, match="batch dimension 1"):
        flow.inference(tok.repeat(2, 1), ptok, pfeat, emb, False, True)
    with pytest.raises(ValueError, match="non-final chunk"):
        flow.inference(tok[:, :la], ptok[:, :0], pfeat[:, :0], emb, True, False)
    with pytest.raises(ValueError, match="at least 1"):
        flow.inference(tok[:, :0], ptok[:, :0], pfeat[:, :0], emb, False, True)
    with pytest.raises(ValueError, match="integer"):
        flow.inference(tok.float(), ptok, pfeat, emb, False, True)
    with pytest.raises(ValueError, match="prompt_feat"):
        flow.inference(tok, ptok, pfeat[..., :-1], emb, False, True)
    with pytest.raises(ValueError, match="embeddings"):
        flow.inference(tok, ptok, pfeat, emb[:, :-1], False, True)
    with pytest.raises(ValueError, match="streaming"):
        flow.inference_batch([tok, tok], [ptok, ptok], [pfeat, pfeat], [emb, emb], [True], True)


def test_bfloat16_runs_and_returns_float32(flow):
    case = (OFFLINE_CASES + E2E_CASES or [None])[0]
    if case is None:
        pytest.skip("no offline case")
    t = tensors(case)
    model = _build(model_dir() / "cosyvoice2.yaml")
    model.load_state_dict(flow.state_dict())
    model = model.to(torch.bfloat16)
    mel = model.inference(*(t[k] for k in FLOW_INPUTS), streaming=False, finalize=True)
    assert mel.dtype == torch.float32 and mel.shape == t["mel"].shape
    assert torch.isfinite(mel).all()
    assert rel_l2(mel, t["mel"]) < 0.1  # bf16 has 8 mantissa bits; this only guards against garbage


def test_batch_equals_single_multilevel_unet():
    """The tiny and the real estimator have one U-Net level; a config with three levels also
    exercises the non-causal stride-2 down/up-sampling convolutions with odd lengths."""
    require_reference_dir()
    cfg = load_config(model_dir() / "cosyvoice2.yaml").flow
    first = cfg.estimator.channels[0]
    cfg = dataclasses.replace(cfg, estimator=dataclasses.replace(
        cfg.estimator, channels=(first, first + 16, first + 16), static_chunk_size=max(2, cfg.estimator.static_chunk_size // 5)))
    with torch.random.fork_rng():
        torch.manual_seed(7)
        model = FlowModel(cfg).eval()  # default (random) initialisation
    gen = torch.Generator().manual_seed(7)
    n_mels, vocab = cfg.output_size, cfg.vocab_size
    specs = [(0, 9, False, True), (5, 13, True, False), (4, 6, True, True), (11, 20, False, False), (3, 4, True, False)]
    items = []
    for p_len, n_len, streaming, finalize in specs:
        items.append((torch.randint(0, vocab, (1, n_len), generator=gen), torch.randint(0, vocab, (1, p_len), generator=gen),
                      torch.randn(1, cfg.token_mel_ratio * p_len, n_mels, generator=gen),
                      torch.randn(1, cfg.spk_embed_dim, generator=gen), streaming, finalize))
    batch = model.inference_batch(*(list(x) for x in zip(*items)))
    for item, out in zip(items, batch):
        single = model.inference(*item)
        assert torch.isfinite(single).all() and single.abs().max() > 0
        assert rel_l2(out, single) <= BATCH_TOL


@pytest.mark.gpu
def test_cuda_parity_sync_free_and_half_precision(flow):
    cases = OFFLINE_CASES + E2E_CASES
    if not cases:
        pytest.skip("no offline case")
    model = _build(model_dir() / "cosyvoice2.yaml")
    model.load_state_dict(flow.state_dict())
    model = model.cuda()
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        for name in cases:
            t = tensors(name)
            mel = model.inference(*(t[k] for k in FLOW_INPUTS), streaming=False, finalize=True)
            assert mel.is_cuda and rel_l2(mel.cpu(), t["mel"]) <= TOL, name
        for name in STREAM_CASES:
            t = tensors(name)
            for tokens, streaming, finalize, i in _stream_chunks(name):
                mel = model.inference(tokens, t["prompt_token"], t["prompt_feat"], t["embedding"], streaming, finalize)
                assert rel_l2(mel.cpu(), t[f"c{i}_flow_mel"]) <= TOL, (name, i)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    items = _batch_items()
    labels, toks, ptoks, pfeats, embs, streams, finals, refs = zip(*items)
    with torch.inference_mode():
        c = model.condition(toks, ptoks, pfeats, embs, streams, finals)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            mel = model.solve(c)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(mel).all()
    t = tensors(cases[0])
    for dtype in (torch.bfloat16, torch.float16):
        half = model.to(dtype)
        errors = {}
        for on in (False, True):  # eager (exact GELU) vs fused kernels + GELU epilogue (tanh GELU)
            prev = fused.set_enabled(on)
            try:
                mel = half.inference(*(t[k] for k in FLOW_INPUTS), streaming=False, finalize=True)
            finally:
                fused.set_enabled(prev)
            assert mel.dtype == torch.float32 and torch.isfinite(mel).all(), dtype
            errors[on] = rel_l2(mel.cpu(), t["mel"])
        print(f"flow {dtype} vs float32 reference, relative L2: eager {errors[False]:.2e}, fused {errors[True]:.2e}")
        assert errors[False] < 0.1 and errors[True] < 0.1, (dtype, errors)
        # the fused path (one rounding per kernel, the tanh GELU epilogue) is no further from
        # float32 than eager half precision is, beyond a small margin
        assert errors[True] <= 1.25 * errors[False] + 2e-3, (dtype, errors)
        model = half.float()


def test_reference_dir_is_discoverable():
    # guards against silently skipping every parity test above
    if reference_dir() is None or not (reference_dir() / "cases").is_dir():
        pytest.skip("reference data not found")
    assert OFFLINE_CASES and STREAM_CASES and NOISE_CASES


def test_flow_run_mels_do_not_alias_the_solver_state(flow):
    """FlowRun.mels copies: with CUDA graphs the state is a static buffer the next batch reuses."""
    items = _batch_items()
    if not items:
        pytest.skip("no reference cases")
    _, toks, ptoks, pfeats, embs, streams, finals, _ = items[0]
    run = flow.start(flow.prepare([toks], [ptoks], [pfeats], embs, [streams], [finals]))
    while run.steps_left:
        run.step()
    mel = run.mels()[0]
    before = mel.clone()
    with torch.inference_mode():
        run.state.x.fill_(123.0)
    assert torch.equal(mel, before)


def test_models_built_in_inference_mode_run(tmp_path):
    """Fused/derived weights (estimator q/k/v and conv matrices, LM q/k/v and gate/up) are built
    from parameters that may be inference tensors (a model built under
    ``torch.inference_mode()``, as the GPU tests and benchmarks do) and used outside it."""
    import json

    from cosyserve.models.demo import DemoSize, demo_qwen_config, demo_yaml
    from cosyserve.models.llm import KVCache
    from cosyserve.models.loader import build_random

    (tmp_path / "CosyVoice-BlankEN").mkdir()
    (tmp_path / "cosyvoice2.yaml").write_text(demo_yaml(DemoSize()))
    (tmp_path / "CosyVoice-BlankEN" / "config.json").write_text(json.dumps(demo_qwen_config(DemoSize())))
    with torch.inference_mode():
        m = build_random(tmp_path / "cosyvoice2.yaml", components=("llm", "flow"))
    g = torch.Generator().manual_seed(0)
    inputs = ([torch.randint(0, 100, (1, 12), generator=g)], [torch.randint(0, 100, (1, 7), generator=g)],
              [torch.randn(1, 14, m.flow.n_mels, generator=g)], torch.randn(1, m.flow.cfg.spk_embed_dim, generator=g),
              True, False)
    with torch.no_grad():
        outside = m.flow.inference_batch(*inputs)[0]
        lm = m.llm
        emb = torch.randn(1, 5, lm.cfg.llm_input_size, generator=g)
        h1 = lm.forward_cached(emb, KVCache.allocate(lm, 1, 64), torch.tensor([0]), torch.tensor([0]))
    with torch.inference_mode():
        inside = m.flow.inference_batch(*inputs)[0]
        h2 = lm.forward_cached(emb, KVCache.allocate(lm, 1, 64), torch.tensor([0]), torch.tensor([0]))
    # the same kernels on the same inputs, only the autograd mode differs: exact by construction
    assert torch.equal(outside, inside) and torch.isfinite(outside).all()
    assert torch.equal(h1, h2)

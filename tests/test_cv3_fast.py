"""Issue 20 (CosyVoice3 serving speed): the fast paths keep upstream's numerics.

* the DiT's cached rotary tables equal freshly computed ones and attention stays SDPA;
* :class:`~cosyserve.models.graphs.GraphedFlow`'s captured functions (run eagerly here) equal the
  eager CosyVoice3 flow, full and streaming calls;
* the causal HiFT over a bounded window with the carried phase (:class:`CausalHiFTStream`) equals
  the whole-mel re-run (reference streaming cases within 1e-4, long streams far tighter);
* concurrent CosyVoice3 streams' chunk jobs go through one flow call.

Cases are discovered from the CosyVoice3 reference set (:mod:`_reference_cv3`); GPU tests are
marked ``gpu``.
"""

from __future__ import annotations

import pytest
import torch

from cosyserve.models.config import load_hyperpyyaml
from cosyserve.models.cv3_flow import load_cv3_flow, parse_cv3_flow, rotary_tables
from cosyserve.models.hift import load_hift, parse_causal_hift

from _reference import check_close
from _reference_cv3 import flow_fixture, hift_fixture, yaml_data_fixture  # noqa: F401  (fixtures)
from _reference_cv3 import forced_params, run_engine, stream_case_voice
from _reference_cv3 import discover, meta, model_dir, tensors

FLOW_CASES = discover("flow", has=("token", "prompt_token", "prompt_feat", "embedding", "mel"))
HIFT_STREAM_CASES = discover("hift", has=("mel",), where=lambda m: bool(m.get("calls")))
STREAM_CASES = discover("stream", has=("source_speech_token", "prompt_token", "prompt_feat", "embedding"),
                        where=lambda m: bool(m.get("chunks")))






# ----------------------------------------------------------------------------------------------
# 1. attention
# ----------------------------------------------------------------------------------------------


def test_rotary_cache_equals_fresh_tables(flow):
    est = flow.decoder.estimator
    est._rotary_cache = None
    inv = est.rotary_embed.inv_freq
    for n, start in ((7, 0), (300, 0), (50, 250), (1, 0), (1025, 3)):  # grows the cache in between
        cos, sin = est.rotary(n, start)
        ref_cos, ref_sin = rotary_tables(inv, start + n)
        assert cos.shape == (n, est.cfg.dim_head) and cos.dtype == torch.float32
        assert torch.equal(cos, ref_cos[start:]) and torch.equal(sin, ref_sin[start:])
    assert est._rotary_cache[0].shape[0] >= 1028
    assert len(est._rotary_old) >= 1  # replaced tables stay alive (graphs captured with them read them)


def test_attention_is_one_sdpa_call_per_layer(flow, monkeypatch):
    """No per-head loop: each DiT block calls scaled_dot_product_attention once for all heads."""
    import torch.nn.functional as F

    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append((tuple(q.shape), attn_mask))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    est = flow.decoder.estimator
    n = est.cfg.mel_dim
    t = 60
    with torch.inference_mode():
        est(torch.randn(2, n, t), torch.ones(2, 1, t), torch.randn(2, n, t), torch.rand(2), torch.randn(2, n),
            torch.randn(2, n, t), streaming=True)
    assert len(calls) == est.cfg.depth
    assert all(shape == (2, est.cfg.heads, t, est.cfg.dim_head) for shape, _ in calls)
    # one additive mask in the model dtype, built once per evaluation, rows 8-aligned in memory (the
    # memory-efficient kernel reads it as it is): 0 within the chunk-causal field, -inf elsewhere
    masks = {id(m) for _, m in calls}
    mask = calls[0][1]
    assert len(masks) == 1 and mask.dtype == torch.float32 and mask.stride(-2) % 8 == 0
    chunk = est.cfg.static_chunk_size
    pos = torch.arange(t)
    allowed = pos[None, :] < (pos[:, None] // chunk + 1) * chunk
    expected = torch.zeros(t, t).masked_fill(~allowed, float("-inf"))
    assert torch.equal(mask[0, 0], expected) and torch.equal(mask[1, 0], expected)


def test_in_place_rotary_rotates_head_zero_pairs():
    """x-transformers' interleaved rotary on the first ``d`` channels: pair ``(x0, x1)`` at
    position ``p`` becomes ``(x0 cos - x1 sin, x1 cos + x0 sin)`` with angle ``p * inv_freq[k]``;
    the other channels are untouched (written from an independent complex-number formula)."""
    from cosyserve.models.cv3_flow import apply_rotary_, signed_sin

    d, t = 8, 5
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rotary_tables(inv, t)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, t, 3 * d).to(dtype)
        ref = x.clone().float()
        pairs = torch.view_as_complex(ref[..., :d].unflatten(-1, (-1, 2)).contiguous())
        angle = torch.arange(t).float()[:, None] * inv[None, :]
        ref[..., :d] = torch.view_as_real(pairs * torch.polar(torch.ones_like(angle), angle)).flatten(-2)
        out = apply_rotary_(x, cos, signed_sin(sin))
        assert out is x
        assert torch.equal(x[..., d:].float(), ref[..., d:])
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert torch.allclose(x[..., :d].float(), ref[..., :d].to(dtype).float(), atol=tol, rtol=tol)


# ----------------------------------------------------------------------------------------------
# 4. CUDA graphs: the captured functions, run eagerly (CPU) / captured (GPU)
# ----------------------------------------------------------------------------------------------


def _flow_items():
    """(label, token, prompt_token, prompt_feat, embedding, streaming, finalize, reference mel or None)
    for every reference flow case and every streaming chunk call of the reference stream cases."""
    items = []
    for case in FLOW_CASES:
        t, md = tensors(case), meta(case)
        items.append((case, t["token"], t["prompt_token"], t["prompt_feat"], t["embedding"],
                      bool(md.get("streaming", False)), bool(md.get("finalize", True)), t["mel"]))
    for case in STREAM_CASES:
        t, md = tensors(case), meta(case)
        for i, ch in enumerate(md["chunks"]):
            items.append((f"{case} chunk {i}", t["source_speech_token"][:, :ch["n_tokens"]], t["prompt_token"],
                          t["prompt_feat"], t["embedding"], bool(ch["flow_streaming"]), bool(ch["flow_finalize"]),
                          t.get(f"c{i}_flow_mel")))
    return items


def test_graphed_flow_functions_equal_reference(flow, one_thread):
    """What a GraphedFlow bucket of the CosyVoice3 flow captures — begin (encode + solver set-up)
    from bucket buffers, the attention plan copied into shared static buffers
    (``graphs._share_plan``), the Euler step replayed n times — run eagerly on CPU over a batch of
    every reference call padded to a larger (rows, tokens) bucket: every item's mel equals its
    reference within 1e-4 (and the eager batch)."""
    from dataclasses import replace

    from cosyserve.models.cv3_flow import DiTPlan
    from cosyserve.models.graphs import SharedBuffers, _share_plan, fill_flow_buffers, flow_begin_from_buffers, \
        flow_buffers

    items = _flow_items()
    if not items:
        pytest.skip("no CosyVoice3 flow cases")
    labels, toks, ptoks, pfeats, embs, streams, finals, refs = zip(*items)
    inp = flow.prepare(toks, ptoks, pfeats, torch.cat(embs), streams, finals)
    bb, lb = len(items) + 1, -(-inp.ids.shape[1] // 32) * 32 + 32
    shared = SharedBuffers(bb * lb, "cpu")
    bufs = flow_buffers(flow, bb, lb, "cpu", shared)
    fill_flow_buffers(bufs, inp, flow.token_mel_ratio)
    with torch.inference_mode():
        st = flow_begin_from_buffers(flow, bufs)
        assert isinstance(st.plan, DiTPlan)
        plan = _share_plan(st.plan, lambda name, t: shared.share(name, t, bb * lb))
        assert plan.allowed.data_ptr() != st.plan.allowed.data_ptr() and torch.equal(plan.allowed, st.plan.allowed)
        st = replace(st, plan=plan)
        for _ in range(st.n):
            flow.decoder.step(st)
        mel = st.mels()
        eager = flow.inference_batch(toks, ptoks, pfeats, torch.cat(embs), streams, finals)
    assert mel.shape == (bb, flow.n_mels, flow.token_mel_ratio * lb) and torch.isfinite(mel).all()
    for i, (p, n) in enumerate(zip(inp.prompt_frames, inp.mel_lengths)):
        got = mel[i:i + 1, :, p:n]
        check_close(got, eager[i], f"bucket vs eager batch: {labels[i]}", 1e-5)
        if refs[i] is not None:
            check_close(got, refs[i], f"bucket vs reference: {labels[i]}")


def test_share_plan_keeps_the_unet_buffer_names():
    """graphs._share_plan on CosyVoice2's AttentionPlan shares exactly what GraphedFlow shared before
    (``mask{d}`` per level, ``streaming``) and leaves the non-tensor fields alone."""
    from cosyserve.models.flow_estimator import AttentionPlan
    from cosyserve.models.graphs import _share_plan

    plan = AttentionPlan(masks=[torch.ones(2, 8, 1), torch.ones(2, 4, 1)], streaming=torch.tensor([True, False]),
                         chunk=50)
    names = []
    shared = _share_plan(plan, lambda name, t: names.append(name) or t.clone())
    assert names == ["mask0", "mask1", "streaming"] and shared.chunk == 50 and isinstance(shared.masks, list)
    assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in zip(shared.masks, plan.masks))


#: bf16 graphs vs float32 eager (mel): the bound test_cv3_token2wav documents for the eager bf16 flow
BF16_MEL_TOL = 5e-2


def _graphed_vs_eager(flow, graph, items):
    """Per item (graphed mel, eager mel) for ``items`` run as one batch through ``graph`` and eagerly."""
    labels, toks, ptoks, pfeats, embs, streams, finals, _ = zip(*items)
    inp = flow.prepare(toks, ptoks, pfeats, torch.cat(embs), streams, finals)  # CPU inputs (pinned copies)
    run = graph.start(inp)
    assert run is not None, "the batch should fit a bucket"
    while run.steps_left:
        run.step()
    got = [m.cpu() for m in run.mels()]
    dev = flow._model_device()
    saved, flow.graph = flow.graph, None
    try:
        eager = flow.inference_batch([x.to(dev) for x in toks], [x.to(dev) for x in ptoks],
                                     [x.to(dev) for x in pfeats], torch.cat(embs).to(dev), streams, finals)
    finally:
        flow.graph = saved
    return list(zip(labels, got, [e.cpu() for e in eager]))


@pytest.mark.gpu
def test_gpu_graphed_flow_equals_eager(yaml_data, no_tf32):
    """GraphedFlow over the CosyVoice3 flow (float32, TF32 off): every reference call alone and all
    of them as one batch, full and streaming chunk calls, graphed == eager (1e-5) and == the CPU
    reference (1e-4)."""
    from cosyserve.models.graphs import GraphedFlow

    flow = load_cv3_flow(model_dir() / "flow.pt", parse_cv3_flow(yaml_data), device="cuda")
    items = _flow_items()
    if not items:
        pytest.skip("no CosyVoice3 flow cases")
    flow.graph = GraphedFlow(flow, max_batch=len(items), max_tokens=512)
    refs = {it[0]: it[-1] for it in items}
    for batch in [[it] for it in items] + [items]:
        for label, got, eager in _graphed_vs_eager(flow, flow.graph, batch):
            check_close(got, eager, f"graphed vs eager ({len(batch)} items): {label}", 1e-5)
            if refs[label] is not None:
                check_close(got, refs[label], f"graphed vs reference: {label}")
    assert flow.graph.n_graphs >= 1


@pytest.mark.gpu
def test_gpu_graphed_flow_bf16_within_bound(yaml_data):
    """bf16 GraphedFlow vs the float32 eager flow: within BF16_MEL_TOL (the eager bf16 bound)."""
    from cosyserve.models.graphs import GraphedFlow

    ref = load_cv3_flow(model_dir() / "flow.pt", parse_cv3_flow(yaml_data), device="cuda")
    half = load_cv3_flow(model_dir() / "flow.pt", parse_cv3_flow(yaml_data), device="cuda", dtype=torch.bfloat16)
    items = _flow_items()
    if not items:
        pytest.skip("no CosyVoice3 flow cases")
    half.graph = GraphedFlow(half, max_batch=len(items), max_tokens=512)
    ref_out = {label: eager for label, _, eager in _graphed_vs_eager(ref, GraphedFlow(ref, len(items), 512), items)}
    for label, got, eager_half in _graphed_vs_eager(half, half.graph, items):
        check_close(got, eager_half, f"bf16 graphed vs bf16 eager: {label}", BF16_MEL_TOL)
        check_close(got, ref_out[label], f"bf16 graphed vs float32: {label}", BF16_MEL_TOL)


# ----------------------------------------------------------------------------------------------
# 3. causal HiFT over a bounded window with the carried phase
# ----------------------------------------------------------------------------------------------

#: windowed vs whole-mel re-run on CPU over long streams (measured ~8e-7: convolutions of other lengths)
WINDOW_SELF_TOL = 1e-5


def _windowed_stream(hift, mel: torch.Tensor, ends: list[int]):
    """Stream ``mel`` in calls ending at ``ends`` (last = all frames, final); per call (windowed
    new samples, whole-mel re-run's new samples)."""
    out, off, carry = [], 0, None
    for end in ends:
        fin = end == mel.shape[-1]
        (new,), (carry,) = hift.inference_stream_batch([mel[:, :, :end]], [off], [fin], [carry])
        full = hift.inference(mel[:, :, :end], fin)[0][:, off:]
        out.append((new, full))
        off += new.shape[1]
    return out


def _long_mel() -> torch.Tensor:
    mels = [tensors(c)["mel"] for c in discover("hift", has=("mel",))]
    if not mels:
        pytest.skip("no CosyVoice3 hift cases")
    mel = torch.cat(mels + [m.flip(-1) for m in mels], dim=2)
    while mel.shape[-1] < 600:
        mel = torch.cat([mel, mel.flip(-1)], dim=2)
    return mel


def test_stream_margins_come_from_the_modules(hift):
    f0m, tm = hift.stream_margins
    assert f0m == sum(m.pad_len for m in list(hift.f0_predictor.condnet)[1:] if hasattr(m, "pad_len"))
    assert 0 < tm < 100
    assert hift.window_start(f0m + tm + 7) == 7 and hift.window_start(5) == 0


@pytest.mark.parametrize("case", HIFT_STREAM_CASES)
def test_windowed_hift_matches_reference_stream(hift, case, one_thread):
    """The reference streaming HiFT calls (whole-mel re-run trimmed by speech_offset upstream)
    reproduced by the windowed HiFT with the carried phase: every call's new samples within 1e-4."""
    t, calls = tensors(case), meta(case)["calls"]
    off, carry = 0, None
    for i, call in enumerate(calls):
        (new,), (carry,) = hift.inference_stream_batch([t["mel"][:, :, :call["mel_frames_in"]]], [off],
                                                       [bool(call["finalize"])], [carry])
        assert off == call["speech_offset_before"]
        check_close(new, t[f"c{i}_raw_speech"][:, off:], f"{case} windowed call {i}")
        assert new.shape[1] == call["yielded_samples"]
        off += new.shape[1]


def test_windowed_hift_equals_rerun_over_a_long_stream(hift, one_thread):
    """A 600+ frame stream (windows start far from frame 0, the phase is carried several times):
    windowed == whole-mel re-run within WINDOW_SELF_TOL per call; with the margins cut the error is
    orders of magnitude larger (the margins are needed, the comparison can fail)."""
    mel = _long_mel()
    t = mel.shape[-1]
    ends = [60, 110, 210, 410, t - 90, t]
    res = _windowed_stream(hift, mel, ends)
    assert hift.window_start(sum(n.shape[1] for n, _ in res[:-1]) // hift.samples_per_frame) > 100
    for i, (new, full) in enumerate(res):
        check_close(new, full, f"windowed vs re-run, call {i} (ends {ends[i]})", WINDOW_SELF_TOL)
    f0m, tm = hift.stream_margins
    try:
        for cut in ((f0m, 4), (1, tm)):
            hift._stream_margins = cut
            worst = max(float((n - f).norm() / f.norm()) for n, f in _windowed_stream(hift, mel, ends))
            assert worst > 50 * WINDOW_SELF_TOL, (cut, worst)
    finally:
        hift._stream_margins = None


def test_windowed_hift_batch_equals_single(hift, one_thread):
    """Three streams at different points (first call, carried phase, final) in one windowed call
    equal their single calls."""
    mel = _long_mel()
    spf = hift.samples_per_frame
    (a,), (ca,) = hift.inference_stream_batch([mel[:, :, :300]], [0], [False], [None])
    emitted = a.shape[1]
    items = [(mel[:, :, :80], 0, False, None), (mel[:, :, :420], emitted, False, ca), (mel, emitted, True, ca)]
    assert hift.window_start(emitted // spf) > 0 and ca is not None
    outs, carries = hift.inference_stream_batch(*[list(x) for x in zip(*items)])
    for k, (item, o, c) in enumerate(zip(items, outs, carries)):
        (so,), (sc,) = hift.inference_stream_batch(*[[x] for x in item])
        check_close(o, so, f"windowed batch item {k}", 1e-5)
        assert (c is None) == (sc is None) and (c is None or (c.frame == sc.frame and torch.equal(c.phase, sc.phase)))
    assert carries[2] is None  # final


def test_missing_carry_falls_back_to_frame_zero(hift):
    mel = _long_mel()[:, :, :400]
    (a,), _ = hift.inference_stream_batch([mel[:, :, :300]], [0], [False], [None])
    (b,), (cb,) = hift.inference_stream_batch([mel], [a.shape[1]], [False], [None])
    check_close(b, hift.inference(mel, False)[0][:, a.shape[1]:], "no carry: computed from frame 0", 1e-6)
    assert cb is not None


def test_windowed_and_rerun_token2wav_agree(flow, hift, one_thread):
    """stream_token2wav with hift_window on and off: the same chunks (flow identical, speech 1e-5)."""
    from cosyserve.engine.token2wav_cv3 import stream_token2wav

    if not STREAM_CASES:
        pytest.skip("no stream case")
    t = tensors(STREAM_CASES[0])
    args = (t["source_speech_token"], t["prompt_token"], t["prompt_feat"], t["embedding"])
    on = list(stream_token2wav(flow, hift, *args, hift_window=True))
    off = list(stream_token2wav(flow, hift, *args, hift_window=False))
    assert [a.job for a in on] == [b.job for b in off]
    for i, (a, b) in enumerate(zip(on, off)):
        check_close(a.speech, b.speech, f"chunk {i} windowed vs re-run", 1e-5)


# ----------------------------------------------------------------------------------------------
# 5. batching in the engine
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream_cache", [False, True, "budget", "frames"])
@pytest.mark.parametrize("case", STREAM_CASES or [pytest.param(None, marks=pytest.mark.skip("no stream case"))])
def test_concurrent_streams_share_flow_and_hift_calls(case, stream_cache, monkeypatch, one_thread):
    """Two streaming requests started together: their chunk jobs go through ONE flow call (the
    usual pass, or the cached pass for streaming chunks with the flow stream cache on; with a cache
    budget every stream outgrows — bytes, or ``flow_stream_cache_frames`` — only the first chunk is
    cached) and ONE HiFT call per chunk
    (spied on the models), and each request's chunks still equal the reference stream case's
    (WAVE_TOL)."""

    from _reference import WAVE_TOL

    from cosyserve.engine.core import EngineConfig
    from cosyserve.engine.pipeline import Synthesizer
    from cosyserve.models.llm import SilentTokenFilter

    synth = Synthesizer(model_dir(), normalizer="none")
    m, d = meta(case), tensors(case)
    tokens = d["source_speech_token"].reshape(-1).tolist()
    if SilentTokenFilter.for_config(synth.cfg.llm).filter(tokens) != tokens:
        pytest.skip("the stream case's tokens hold a run of silent tokens")
    voice = stream_case_voice(synth, d)
    stop = synth.cfg.llm.stop_token_ids[0]
    flow_batches, hift_batches, cached_batches = [], [], []
    real_start, real_hift = synth.models.flow.start, synth.models.hift.inference_stream_batch
    real_cached = synth.models.flow.stream_cached_batch
    monkeypatch.setattr(synth.models.flow, "start",
                        lambda inputs, *a, **k: flow_batches.append(inputs.ids.shape[0]) or real_start(inputs, *a, **k))
    monkeypatch.setattr(synth.models.flow, "stream_cached_batch",
                        lambda inputs, caches: cached_batches.append(len(caches)) or real_cached(inputs, caches))
    monkeypatch.setattr(synth.models.hift, "inference_stream_batch",
                        lambda mels, *a, **k: hift_batches.append(len(mels)) or real_hift(mels, *a, **k))
    engine = synth.new_engine(EngineConfig(max_active=2, t2w_batch_target=2, flow_stream_cache=bool(stream_cache),
                                           flow_stream_cache_frames=1 if stream_cache == "frames" else None))
    if stream_cache == "budget":  # every stream outgrows it after its first cached call and recomputes after that
        engine.t2w.flow_cache_max_bytes = 1
    reqs = [synth.build_request("你好。", voice, forced_params(tokens, stop, True), request_id=f"s{i}")
            for i in range(2)]
    out = {rid: chunks for rid, (chunks, _) in run_engine(engine, reqs).items()}
    n_stream = sum(1 for ch in m["chunks"] if not ch["flow_finalize"])
    if stream_cache in ("budget", "frames"):
        assert cached_batches == [2] and flow_batches == [2] * (len(m["chunks"]) - 1)
    elif stream_cache:  # streaming chunks through the cache, the final chunk through the usual pass
        assert cached_batches == [2] * n_stream and flow_batches == [2] * (len(m["chunks"]) - n_stream)
        assert engine._flow_stream_cache
        assert engine.t2w.stream_state_bytes() > 0  # the caches' largest size: the memory bound's per-stream size
    else:
        assert not cached_batches and flow_batches == [2] * len(m["chunks"])  # one flow call per chunk
        assert engine.t2w.stream_state_bytes() == 0
    assert hift_batches == [2] * len(m["chunks"])
    for rid, chunks in out.items():
        assert len(chunks) == len(m["chunks"])
        for i, c in enumerate(chunks):
            check_close(torch.from_numpy(c.samples).reshape(1, -1), d[f"c{i}_speech"], f"{rid} chunk {i}", WAVE_TOL)


# ----------------------------------------------------------------------------------------------
# 4b. the causal HiFT trunk graph (GraphedCausalHiFTTrunk)
# ----------------------------------------------------------------------------------------------


def _trunk_args(hift, monkeypatch):
    """The arguments ``decode_batch`` passes to ``_trunk_istft`` for a windowed batch of three
    streams (first call, carried phase, final), recorded with a spy."""
    mel = _long_mel()
    seen = []
    real = hift._trunk_istft

    def spy(x, s, io, n):
        seen.append((x.clone(), s.clone(), io, n.clone()))
        return real(x, s, io, n)

    (a,), (ca,) = hift.inference_stream_batch([mel[:, :, :300]], [0], [False], [None])
    monkeypatch.setattr(hift, "_trunk_istft", spy)
    hift.inference_stream_batch([mel[:, :, :80], mel[:, :, :420], mel], [0, a.shape[1], a.shape[1]],
                                [False, False, True], [None, ca, ca])
    monkeypatch.setattr(hift, "_trunk_istft", real)
    (x, s, io, n), = seen
    return x, s, io, n


def test_hift_trunk_bucket_function_equals_eager(hift, monkeypatch, one_thread):
    """What a GraphedCausalHiFTTrunk bucket captures (its ``run`` over the bucket's static buffers),
    run eagerly through the class's own padding (__call__ with the replay done eagerly): a larger
    (rows, frames) bucket gives the eager trunk's samples."""
    from cosyserve.models.graphs import BucketGrid, GraphedCausalHiFTTrunk, SharedBuffers

    x, s, io, n = _trunk_args(hift, monkeypatch)
    b, _, t = x.shape
    g = object.__new__(GraphedCausalHiFTTrunk)  # no CUDA here: the grid and buffers only
    g.hift, g.grid = hift, BucketGrid([b + 2], [t + 37])
    g.shared, g._graphs, g._warming = SharedBuffers(g.grid.max_units(), "cpu"), {}, False

    class _Eager:
        def __init__(self, run):
            self.replay = run

    def entry(key):
        run, bufs, out = g.bucket(*key)
        return _Eager(run), bufs, out

    monkeypatch.setattr(g, "lookup", entry)
    with torch.inference_mode():
        got = g(x, s, n)
        want = hift._trunk_istft(x, s, io, n)
    assert got.shape == want.shape
    for i in range(b):
        k = int(n[i] - 1) * hift.hop  # each item's own samples
        check_close(got[i:i + 1, :k], want[i:i + 1, :k], f"trunk bucket item {i}", 1e-6)
    g.grid = BucketGrid([1], [t])
    assert g(x, s, n) is None  # beyond the grid: the caller runs it eagerly


@pytest.mark.gpu
def test_gpu_hift_trunk_graph_equals_eager(yaml_data, no_tf32):
    """The windowed causal HiFT on CUDA with its trunk graphed == without (fp32, TF32 off), for a
    batch of streams at different points and offline final calls of the reference mels."""
    from cosyserve.models.graphs import GraphedCausalHiFTTrunk

    hift = load_hift(model_dir() / "hift.pt", parse_causal_hift(yaml_data), device="cuda")
    mel = _long_mel().cuda()
    (a,), (ca,) = hift.inference_stream_batch([mel[:, :, :300]], [0], [False], [None])
    args = ([mel[:, :, :80], mel[:, :, :420], mel], [0, a.shape[1], a.shape[1]], [False, False, True], [None, ca, ca])
    eager, _ = hift.inference_stream_batch(*args)
    hift.graph_trunk = GraphedCausalHiFTTrunk(hift, max_batch=4, max_frames=2048)
    graphed, _ = hift.inference_stream_batch(*args)
    assert hift.graph_trunk.n_graphs == 1
    for i, (g, e) in enumerate(zip(graphed, eager)):
        check_close(g.cpu(), e.cpu(), f"graphed trunk item {i}", 1e-5)
    mels = [tensors(c)["mel"].cuda() for c in discover("hift", has=("mel",))]
    offline = (mels, [0] * len(mels), [True] * len(mels), [None] * len(mels))
    graphed, _ = hift.inference_stream_batch(*offline)
    graph, hift.graph_trunk = hift.graph_trunk, None
    eager, _ = hift.inference_stream_batch(*offline)
    for i, (g, e) in enumerate(zip(graphed, eager)):
        check_close(g.cpu(), e.cpu(), f"graphed trunk offline item {i}", 1e-5)
    assert graph.n_graphs >= 2


# ----------------------------------------------------------------------------------------------
# 2. per-stream DiT cache of complete static chunks (streaming calls)
# ----------------------------------------------------------------------------------------------

#: cached vs uncached streaming mel on CPU (float summation order only; measured ~1e-7)
CACHE_SELF_TOL = 1e-5


def _stream_calls(flow, tokens: torch.Tensor, prompt_token: torch.Tensor):
    """The streaming (non-final) calls of upstream's schedule for ``tokens [1, N]``: (n_tokens, token_offset)."""
    from cosyserve.engine.token2wav_cv3 import CV3StreamSchedule, after_hift, new_stream, plan_chunk

    sched = CV3StreamSchedule(pre_lookahead_len=flow.pre_lookahead_len, token_mel_ratio=flow.token_mel_ratio)
    st, calls = new_stream(prompt_token.shape[1], sched), []
    while True:
        job = plan_chunk(st, tokens.shape[1], llm_done=True)
        if job.finalize:
            return calls
        calls.append((job.n_tokens, job.token_offset))
        st = after_hift(st, job, torch.zeros(1, 0), new_only=True)[1]


def _cached_call(flow, tokens, t, cache):
    inp = flow.prepare([tokens], [t["prompt_token"]], [t["prompt_feat"]], t["embedding"], True, False)
    (mel,), (first,), (cache,) = flow.stream_cached_batch(inp, [cache])
    return mel, first, cache


@pytest.mark.parametrize("case", STREAM_CASES)
def test_stream_cache_matches_reference_chunks(flow, case, one_thread):
    """Every streaming flow call of the reference stream case through the cache: the frames it
    computes equal the reference chunk mel (1e-4); the first call computes from frame 0."""
    t, md = tensors(case), meta(case)
    cache, n = None, 0
    for i, ch in enumerate(md["chunks"]):
        if not ch["flow_streaming"] or ch["flow_finalize"]:
            continue
        before = 0 if cache is None else cache.frames
        mel, first, cache = _cached_call(flow, t["source_speech_token"][:, :ch["n_tokens"]], t, cache)
        check_close(mel, t[f"c{i}_flow_mel"][:, :, first:], f"{case} chunk {i} cached flow mel")
        assert first == max(0, before - t["prompt_feat"].shape[1])
        assert cache.frames % flow.decoder.estimator.cfg.static_chunk_size == 0 and cache.frames > before
        n += 1
    assert n >= 2, "the case should have at least two streaming calls"


def _long_tokens(t) -> torch.Tensor:
    tok = t["source_speech_token"]
    while tok.shape[1] < 420:
        tok = torch.cat([tok, tok.flip(-1)], dim=1)
    return tok


def test_stream_cache_equals_uncached_over_a_long_stream(flow, one_thread):
    """A 420+ token stream (calls of 25, 50, 100, 100, ... tokens): each cached call's frames equal
    the uncached streaming call's (CACHE_SELF_TOL), the new frames after ``token_offset`` too, and
    the cache's bytes equal bytes_per_frame x frames plus the fixed conv window."""
    from cosyserve.models.cv3_flow import DiTStreamCache

    if not STREAM_CASES:
        pytest.skip("no stream case")
    t = tensors(STREAM_CASES[0])
    tok = _long_tokens(t)
    calls = _stream_calls(flow, tok, t["prompt_token"])
    assert len(calls) >= 5
    cache = None
    est = flow.decoder.estimator
    for k, (n_tok, offset) in enumerate(calls):
        mel, first, cache = _cached_call(flow, tok[:, :n_tok], t, cache)
        full = flow.inference(tok[:, :n_tok], t["prompt_token"], t["prompt_feat"], t["embedding"], True, False)
        check_close(mel, full[:, :, first:], f"call {k} ({n_tok} tokens) cached vs uncached", CACHE_SELF_TOL)
        assert first <= flow.token_mel_ratio * offset  # the chunk's new frames are all computed
    per_frame = DiTStreamCache.bytes_per_frame(est.cfg, flow.cfg.cfm.n_timesteps, torch.float32)
    window = flow.cfg.cfm.n_timesteps * 2 * 2 * (est.cfg.conv_pos_kernel - 1) * est.cfg.dim * 4
    assert cache.nbytes == per_frame * cache.frames + window


def test_stream_cache_with_calls_off_the_chunk_grid(flow, one_thread):
    """Calls whose frames do not end on a static-chunk boundary (other chunk policies): only complete
    chunks are cached, the partial chunk is recomputed by the next call; every call == uncached."""
    if not STREAM_CASES:
        pytest.skip("no stream case")
    t = tensors(STREAM_CASES[0])
    tok = _long_tokens(t)
    c = flow.decoder.estimator.cfg.static_chunk_size
    cache, prev_end = None, 0
    for k, n_tok in enumerate((37, 61, 62, 130, 171)):
        mel, first, cache = _cached_call(flow, tok[:, :n_tok], t, cache)
        full = flow.inference(tok[:, :n_tok], t["prompt_token"], t["prompt_feat"], t["embedding"], True, False)
        check_close(mel, full[:, :, first:], f"off-grid call {k} ({n_tok} tokens)", CACHE_SELF_TOL)
        assert first <= prev_end and cache.frames % c == 0
        prev_end = full.shape[-1]


def test_stream_cache_batch_with_different_cache_lengths(flow, one_thread):
    """Three streams at different points (no cache, one cached call, three cached calls) in one
    cached batch == each alone (1e-5)."""
    if not STREAM_CASES:
        pytest.skip("no stream case")
    t = tensors(STREAM_CASES[0])
    tok = _long_tokens(t)
    calls = _stream_calls(flow, tok, t["prompt_token"])
    caches = [None]
    for n_tok, _ in calls[:3]:
        caches.append(_cached_call(flow, tok[:, :n_tok], t, caches[-1])[2])
    pick = [(0, None), (1, caches[1]), (3, caches[3])]
    inp = flow.prepare([tok[:, :calls[i][0]] for i, _ in pick], [t["prompt_token"]] * 3, [t["prompt_feat"]] * 3,
                       torch.cat([t["embedding"]] * 3), True, False)
    mels, firsts, news = flow.stream_cached_batch(inp, [c for _, c in pick])
    assert len({c.frames if c else 0 for _, c in pick}) == 3
    for k, ((i, c), mel, first, new) in enumerate(zip(pick, mels, firsts, news)):
        single, sfirst, snew = _cached_call(flow, tok[:, :calls[i][0]], t, c)
        assert first == sfirst and new.frames == snew.frames
        check_close(mel, single, f"batched cached item {k}", 1e-5)
        check_close(new.kv, snew.kv, f"batched cache item {k}", 1e-5)


def test_stream_cache_rejects_final_calls_and_foreign_caches(flow):
    if not STREAM_CASES:
        pytest.skip("no stream case")
    t = tensors(STREAM_CASES[0])
    tok = t["source_speech_token"]
    inp = flow.prepare([tok], [t["prompt_token"]], [t["prompt_feat"]], t["embedding"], False, True)
    with pytest.raises(ValueError, match="streaming non-final"):
        flow.stream_cached_batch(inp, [None])
    _, _, cache = _cached_call(flow, tok[:, :60], t, None)
    from dataclasses import replace as dc_replace

    inp = flow.prepare([tok[:, :60]], [t["prompt_token"]], [t["prompt_feat"]], t["embedding"], True, False)
    with pytest.raises(ValueError, match="does not fit"):
        flow.stream_cached_batch(inp, [dc_replace(cache, frames=cache.frames + 7)])


def test_stream_cache_bytes_at_full_size(tmp_path):
    """The stated memory per cached frame at full size (yaml dims): 10 steps x 22 layers x K,V x 2 CFG
    rows x 16 x 64 x 2 bytes (bfloat16) = 1.8 MB."""
    from _reference_cv3 import full_size_config

    from cosyserve.models.cv3_flow import DiTStreamCache

    full_size_config(tmp_path)  # the real yaml laid out in tmp_path (skips without manifests)
    flow_cfg = parse_cv3_flow(load_hyperpyyaml(tmp_path / "cosyvoice3.yaml"))
    est = flow_cfg.estimator
    per = DiTStreamCache.bytes_per_frame(est, flow_cfg.cfm.n_timesteps, torch.bfloat16)
    assert per == flow_cfg.cfm.n_timesteps * est.depth * 4 * est.heads * est.dim_head * 2
    print(f"[cv3] stream cache at full size: {per / 1e6:.2f} MB per frame, {per * 50 / 1e6:.0f} MB per second")
    assert 1.7e6 < per < 1.9e6


@pytest.mark.gpu
def test_gpu_stream_cache_matches_reference(yaml_data, no_tf32):
    """The cached streaming flow on CUDA (float32, TF32 off): reference chunk mels within 1e-4 and
    cached == uncached over the long stream (1e-5)."""
    flow = load_cv3_flow(model_dir() / "flow.pt", parse_cv3_flow(yaml_data), device="cuda")
    if not STREAM_CASES:
        pytest.skip("no stream case")
    for case in STREAM_CASES:
        t, md = tensors(case), meta(case)
        cache = None
        for i, ch in enumerate(md["chunks"]):
            if ch["flow_finalize"]:
                continue
            mel, first, cache = _cached_call(flow, t["source_speech_token"][:, :ch["n_tokens"]], t, cache)
            check_close(mel.cpu(), t[f"c{i}_flow_mel"][:, :, first:], f"cuda {case} chunk {i} cached flow mel")
    t = tensors(STREAM_CASES[0])
    tok = _long_tokens(t)
    cache = None
    for k, (n_tok, _) in enumerate(_stream_calls(flow, tok, t["prompt_token"])):
        mel, first, cache = _cached_call(flow, tok[:, :n_tok], t, cache)
        full = flow.inference(tok[:, :n_tok].cuda(), t["prompt_token"].cuda(), t["prompt_feat"].cuda(),
                              t["embedding"].cuda(), True, False)
        check_close(mel.cpu(), full[:, :, first:].cpu(), f"cuda call {k} cached vs uncached", CACHE_SELF_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("case", STREAM_CASES or [pytest.param(None, marks=pytest.mark.skip("no stream case"))])
def test_gpu_engine_streams_with_graphs_and_stream_cache(case):
    """On CUDA with CUDA graphs (flow + HiFT trunk graphed) and the flow stream cache forced on: two
    concurrent streams of the reference stream case, every chunk within DEVICE_WAVE_TOL."""

    from _reference import DEVICE_WAVE_TOL

    from cosyserve.engine.core import EngineConfig
    from cosyserve.engine.pipeline import Synthesizer

    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        synth = Synthesizer(model_dir(), device="cuda", normalizer="none")
        m, d = meta(case), tensors(case)
        tokens = d["source_speech_token"].reshape(-1).tolist()
        voice = stream_case_voice(synth, d)
        stop = synth.cfg.llm.stop_token_ids[0]
        engine = synth.new_engine(EngineConfig(max_active=2, t2w_batch_target=2, kv_max_len=1024,
                                               max_prefill_tokens=1024, flow_stream_cache=True))
        assert synth.models.flow.graph is not None and synth.models.hift.graph_trunk is not None
        assert engine._flow_stream_cache
        reqs = [synth.build_request("你好。", voice, forced_params(tokens, stop, True), request_id=f"s{i}")
                for i in range(2)]
        out = {rid: chunks for rid, (chunks, _) in run_engine(engine, reqs).items()}
        for rid, chunks in out.items():
            assert len(chunks) == len(m["chunks"])
            for i, c in enumerate(chunks):
                check_close(torch.from_numpy(c.samples).reshape(1, -1), d[f"c{i}_speech"], f"cuda {rid} chunk {i}",
                            DEVICE_WAVE_TOL)
        assert synth.models.hift.graph_trunk.n_graphs >= 1
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old

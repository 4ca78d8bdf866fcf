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
from _reference_cv3 import discover, meta, model_dir, require_cv3_dir, tensors

FLOW_CASES = discover("flow", has=("token", "prompt_token", "prompt_feat", "embedding", "mel"))
HIFT_STREAM_CASES = discover("hift", has=("mel",), where=lambda m: bool(m.get("calls")))
STREAM_CASES = discover("stream", has=("source_speech_token", "prompt_token", "prompt_feat", "embedding"),
                        where=lambda m: bool(m.get("chunks")))


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def yaml_data():
    require_cv3_dir()
    return load_hyperpyyaml(model_dir() / "cosyvoice3.yaml")


@pytest.fixture(scope="module")
def flow(yaml_data):
    return load_cv3_flow(model_dir() / "flow.pt", parse_cv3_flow(yaml_data))


@pytest.fixture(scope="module")
def hift(yaml_data):
    return load_hift(model_dir() / "hift.pt", parse_causal_hift(yaml_data))


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


def test_attention_is_one_sdpa_call_per_layer(flow, monkeypatch):
    """No per-head loop: each DiT block calls scaled_dot_product_attention once for all heads."""
    import torch.nn.functional as F

    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append((tuple(q.shape), attn_mask.dtype))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    est = flow.decoder.estimator
    n = est.cfg.mel_dim
    t = 60
    with torch.inference_mode():
        est(torch.randn(2, n, t), torch.ones(2, 1, t), torch.randn(2, n, t), torch.rand(2), torch.randn(2, n),
            torch.randn(2, n, t), streaming=True)
    assert len(calls) == est.cfg.depth
    assert all(shape == (2, est.cfg.heads, t, est.cfg.dim_head) and dt == torch.bool for shape, dt in calls)


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


@pytest.fixture
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


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

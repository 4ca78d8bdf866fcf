"""Batched DiT streaming steps (``DitFlowModel.forward_items`` / ``chunk_batch``,
``DitToken2Wav.stream_step_batch``) against one-stream calls, on a tiny random-weight token2wav
directory (no reference data needed).

Pins the vectorised per-item indexing of a chunk batch: streams with different prompt lengths,
different cache lengths (streams skip rounds), trimmed and untrimmed caches in one batch, mixed
``last`` flags, CUDA-graph bucket padding (eager on the CPU), ``final_states=False``, and that a
state handed out by one batch (views of batch tensors) is never written by later batches.
Tolerance: 1e-5 relative L2 (batched and one-stream passes differ only by float summation order).
"""

from __future__ import annotations

import copy

import pytest
import torch

from _dit import prompts as _prompts
from _dit import tiny_t2w
from _reference import rel_l2
from cosyserve.models.dit_flow import TRIM_KEEP, DitItem, trim_state

FIELDS = ("spk", "enc_att1", "enc_att2", "enc_lookahead", "enc_up", "est_att", "est_cnn")
TOL = 1e-5


@pytest.fixture(scope="module")
def t2w(tmp_path_factory):
    return tiny_t2w(tmp_path_factory)


def _assert_states(got, ref, what: str) -> None:
    assert got.prompt_frames == ref.prompt_frames, what
    for f in FIELDS:
        a, b = getattr(got, f), getattr(ref, f)
        assert a.shape == b.shape, (what, f, tuple(a.shape), tuple(b.shape))
        assert rel_l2(a, b) < TOL, (what, f, rel_l2(a, b))


def _rounds(g: torch.Generator, n_streams: int, n_rounds: int, min_tokens: int = 5):
    """Per round: the streams that take part (some skip rounds, so cache lengths diverge), their
    token counts (look-ahead included) and last flags (the final round ends a mix of streams)."""
    out = []
    for k in range(n_rounds):
        part = [i for i in range(n_streams) if (i + k) % 3 != 2 or k == n_rounds - 1]
        toks = [torch.randint(0, 6561, (int(torch.randint(min_tokens, 31, (1,), generator=g)),), generator=g)
                for _ in part]
        last = [k == n_rounds - 1 and i % 2 == 0 for i in part]
        out.append((part, toks, last))
    return out


@pytest.mark.parametrize("graph_padding", [False, True])
def test_chunk_batch_mixed_lengths_and_trimmed_caches_equal_single_streams(t2w, graph_padding):
    ref_flow = t2w.flow
    flow = ref_flow
    if graph_padding:  # rows, frames and cache frames padded to buckets (eager on the CPU)
        flow = copy.deepcopy(ref_flow)
        flow.enable_cuda_graphs(frames_bucket=16, cache_bucket=48)
    prompts = _prompts()
    got = flow.setup_batch(prompts)
    ref = [ref_flow.setup(*p) for p in prompts]
    for i, (a, b) in enumerate(zip(got, ref)):
        _assert_states(a, b, f"setup {i}")
    g = torch.Generator().manual_seed(1)
    seen_trimmed = seen_mixed = False
    for k, (part, toks, last) in enumerate(_rounds(g, len(prompts), 7)):
        caches = {got[i].cache_frames for i in part}
        trimmed = [got[i].cache_frames == got[i].prompt_frames + TRIM_KEEP for i in part]
        seen_mixed |= len(caches) > 1
        seen_trimmed |= any(trimmed) and not all(trimmed)
        res = flow.chunk_batch([got[i] for i in part], toks, last)
        for (mel, st), i, tk, lf in zip(res, part, toks, last):
            rmel, rst = ref_flow.chunk(ref[i], tk, lf)
            assert mel.shape == rmel.shape and rel_l2(mel, rmel) < TOL, (k, i, rel_l2(mel, rmel))
            _assert_states(st, rst, f"round {k} stream {i}")
            assert trim_state(st) is st  # trimmed where the driver trims, and only there
            got[i], ref[i] = st, rst
    assert seen_mixed and seen_trimmed, "the rounds must batch different cache lengths, trimmed and not"


def test_padded_solve_gives_attention_one_additive_bias(t2w, monkeypatch):
    """A solve of streams with different lengths masks padded keys with one additive bias in the model
    dtype, built once per solve (rows 8-aligned in memory: the memory-efficient kernel reads it as it
    is), not a boolean mask that SDPA would convert in every layer of every Euler step: 0 on an item's
    new and cached frames, -inf on padding."""
    import torch.nn.functional as F

    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append(attn_mask)
        return real(q, k, v, attn_mask=attn_mask, **kw)

    flow = t2w.flow
    states = flow.setup_batch(_prompts()[:2])
    g = torch.Generator().manual_seed(4)
    toks = [torch.randint(0, 6561, (n,), generator=g) for n in (9, 17)]
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    flow.chunk_batch(states, toks, [False, False])
    est = flow.decoder.estimator.cfg
    solve = calls[-est.depth * flow.cfg.n_timesteps:]  # the estimator's calls (the encoder's come first)
    assert len({id(m) for m in solve}) == 1
    bias = solve[0]
    assert bias.dtype == torch.float32 and bias.stride(-2) % 8 == 0 and bias.shape[:3] == (4, 1, 1)
    mmax = 2 * (max(len(t) for t in toks) - flow.pre_lookahead_len)
    for row, (st, tk) in enumerate(zip([s for s in states for _ in range(2)], [t for t in toks for _ in range(2)])):
        m, c = 2 * (len(tk) - flow.pre_lookahead_len), st.cache_frames
        allowed = torch.zeros(bias.shape[-1], dtype=torch.bool)
        allowed[:m] = True
        allowed[mmax:mmax + c] = True
        expected = torch.zeros(bias.shape[-1]).masked_fill(~allowed, float("-inf"))
        assert torch.equal(bias[row, 0, 0], expected), row


def test_stream_step_batch_equals_single_streams(t2w):
    prompts = _prompts(2)
    got = [t2w.stream_setup(*p) for p in prompts]
    ref = list(got)
    g = torch.Generator().manual_seed(3)
    for k, (part, toks, last) in enumerate(_rounds(g, len(prompts), 5, min_tokens=8)):  # HiFT: >= 8 mel frames
        gens = [torch.Generator().manual_seed(100 * k + i) for i in part]
        res = t2w.stream_step_batch([got[i] for i in part], toks, last, gens)
        for (speech, st), i, tk, lf in zip(res, part, toks, last):
            rs, rst = t2w.stream_step(ref[i], tk, lf, torch.Generator().manual_seed(100 * k + i))
            assert speech.shape == rs.shape and rel_l2(speech, rs) < 1e-4, (k, i, rel_l2(speech, rs))
            if lf:
                assert st.hift.empty and rst.hift.empty
            else:
                _assert_states(st.flow, rst.flow, f"round {k} stream {i}")
                assert rel_l2(st.hift.speech, rst.hift.speech) < 1e-4
            got[i], ref[i] = st, rst


def test_forward_items_trims_like_trim_state_and_skips_final_states(t2w):
    flow = t2w.flow
    prompts = _prompts(4)
    states = flow.setup_batch(prompts)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):  # grow the caches past P + TRIM_KEEP
        toks = [torch.randint(0, 6561, (28,), generator=g) for _ in states]
        states = [s for _, s in flow.chunk_batch(states, toks, [False] * len(states))]
    toks = [torch.randint(0, 6561, (n,), generator=g) for n in (28, 9, 20, 14)]
    last = [False, True, False, True]

    def items():
        return [DitItem(tokens=t, spk=s.spk, last=lf, state=s) for t, s, lf in zip(toks, states, last)]

    untrimmed = flow.forward_items(items())
    trimmed = flow.forward_items(items(), trim_keep=TRIM_KEEP)
    partial = flow.forward_items(items(), trim_keep=TRIM_KEEP, final_states=False)
    n_trimmed = 0
    for u, t, p, lf in zip(untrimmed, trimmed, partial, last):
        assert torch.equal(u.mel, t.mel) and torch.equal(t.mel, p.mel)
        expect = trim_state(u.state, TRIM_KEEP)
        n_trimmed += expect is not u.state
        _assert_states(t.state, expect, "trimmed")
        assert trim_state(t.state, TRIM_KEEP) is t.state
        if lf:
            assert p.state is None
        else:
            for f in FIELDS:
                assert torch.equal(getattr(p.state, f), getattr(t.state, f)), f
    assert n_trimmed > 0


def test_states_from_a_batch_are_not_written_by_later_batches(t2w):
    """New states are views of batch tensors: later batches (eager or bucket-padded) must leave
    them (and the states they were made from) unchanged."""
    padded = copy.deepcopy(t2w.flow)
    padded.enable_cuda_graphs(frames_bucket=16, cache_bucket=48)
    prompts = _prompts(6)
    g = torch.Generator().manual_seed(7)
    for flow in (t2w.flow, padded):
        states = flow.setup_batch(prompts)
        for _ in range(4):
            snap = [{f: getattr(s, f).clone() for f in FIELDS} for s in states]
            toks = [torch.randint(0, 6561, (int(torch.randint(5, 31, (1,), generator=g)),), generator=g)
                    for _ in states]
            new = [s for _, s in flow.chunk_batch(states, toks, [False] * len(states))]
            # the same states again, in another order, next to the states just made; then a final batch
            flow.chunk_batch(states[::-1] + new[:2], toks[::-1] + toks[:2], [False] * (len(states) + 2))
            flow.chunk_batch(new[1:], toks[1:], [True] * (len(states) - 1))
            for s, sn in zip(states, snap):
                for f in FIELDS:
                    assert torch.equal(getattr(s, f), sn[f]), f
            states = new


def test_cache_runs_are_the_trimmed_frames_of_the_key_value_buffer():
    """``_cache_runs``: the contiguous frame runs a solve copies each item's new estimator cache from
    equal the frame list of upstream's rule (new frames ++ cached frames, trimmed to ``[:P] ++
    [-keep:]``), adjacent runs joined."""
    import random

    from cosyserve.models.dit_flow import _cache_runs

    rng = random.Random(0)
    for _ in range(3000):
        m = rng.randint(0, 60)
        mmax, c, p = m + rng.randint(0, 10), rng.randint(0, 300), rng.randint(0, 120)
        keep = rng.choice([None, rng.randint(0, 150)])
        idx = [*range(m), *range(mmax, mmax + c)]
        if keep is not None and len(idx) > p + keep:
            idx = idx[:p] + idx[len(idx) - keep:]
        runs = _cache_runs(m, mmax, c, p, keep)
        assert [f for a, e in runs for f in range(a, e)] == idx
        assert all(e > a for a, e in runs) and all(r[1] < q[0] for r, q in zip(runs, runs[1:]))


def test_merge_adjacent_views():
    """Runs of views lying back to back in one storage become one view; anything else stays apart;
    the concatenation is unchanged."""
    from cosyserve.models.views import cat_adjacent as _cat
    from cosyserve.models.views import merge_adjacent as _merge_adjacent

    base = torch.arange(2 * 3 * 20 * 4, dtype=torch.float32).view(2, 3, 20, 4).permute(1, 0, 2, 3)  # non-contiguous
    views = list(base.split([5, 0, 7, 8], dim=2))
    merged = _merge_adjacent(views, 2)
    assert len(merged) == 1 and merged[0].shape == (3, 2, 20, 4) and torch.equal(merged[0], base)
    assert _cat(views, 2).data_ptr() == base.data_ptr()  # a single run: the view itself, no copy
    other = torch.randn(3, 2, 6, 4)
    cases = [
        [views[2], views[0]],  # reordered: not adjacent
        [views[0], other, views[2], views[3]],  # another storage in between: two runs around it
        [views[0], views[3]],  # a gap
        [base[:, :1].split(4, dim=2)[0], base[:, 1:].split(4, dim=2)[1]],  # other sizes/offsets
    ]
    expect_parts = [2, 3, 2, 2]
    for parts, n in zip(cases, expect_parts):
        got = _merge_adjacent(parts, 2)
        assert len(got) == n
        assert torch.equal(torch.cat(got, 2), torch.cat(parts, 2))
        assert torch.equal(_cat(parts, 2), torch.cat(parts, 2))
    rows = list(torch.randn(6, 5, 2).split(1))
    assert len(_merge_adjacent(rows, 0)) == 1 and len(_merge_adjacent(rows[::2], 0)) == 3


def test_wide_copies_are_bitwise_copies():
    """``copy_wide_`` / ``cat_wide`` move the estimator caches' bytes as 8-byte words where the layouts
    allow it (last dim contiguous, every stride and offset a whole word) and equal ``copy_`` / ``torch.cat``
    bit for bit, NaN payloads and negative zeros included; other layouts fall back to the plain ops."""
    from cosyserve.models.views import cat_wide, copy_wide_

    def wide(t):  # the layout can be moved as 8-byte words
        try:
            t.view(torch.int64)
            return True
        except RuntimeError:
            return False

    g = torch.Generator().manual_seed(0)
    buf = torch.randn(3, 2, 4, 50 + 40, 128, generator=g).to(torch.bfloat16)  # [S, depth, rows, M + C, 2hd]
    src = torch.randn(3, 2, 4, 40, 128, generator=g).to(torch.bfloat16)
    src.view(torch.int16)[0, 0, 0, 0, :4] = torch.tensor([0x7FC1, -0x8000, 0x7F81, -1], dtype=torch.int16)  # NaNs, -0
    dst = buf.narrow(3, 50, 40)
    assert wide(dst) and wide(src)
    before = buf.clone()
    copy_wide_(dst, src)
    assert torch.equal(buf[..., 50:, :].view(torch.int16), src.view(torch.int16))
    assert torch.equal(buf[..., :50, :].view(torch.int16), before[..., :50, :].view(torch.int16))
    runs = [buf.narrow(3, 3, 7), buf.narrow(3, 60, 20)]
    assert torch.equal(cat_wide(runs, 3).view(torch.int16), torch.cat(runs, 3).view(torch.int16))
    # fall-backs: odd last dim, a transposed last dim, different dtypes, concatenation along the last dim
    odd = torch.randn(4, 3, generator=g).to(torch.bfloat16)
    assert not wide(odd) and torch.equal(copy_wide_(torch.empty_like(odd), odd), odd)
    t = torch.randn(8, 8, generator=g).to(torch.bfloat16).t()
    out = torch.empty(8, 8, dtype=torch.bfloat16)
    assert torch.equal(copy_wide_(out, t), t) and not wide(t)
    row = torch.randn(1, 8, generator=g).to(torch.bfloat16)  # broadcast: copied element-wise, not as words
    assert torch.equal(copy_wide_(torch.empty(3, 8, dtype=torch.bfloat16), row), row.expand(3, 8))
    f32 = torch.randn(4, 8, generator=g)
    assert torch.equal(copy_wide_(torch.empty(4, 8, dtype=torch.bfloat16), f32), f32.to(torch.bfloat16))
    pieces = [torch.randn(2, 8, generator=g).to(torch.bfloat16) for _ in range(2)]
    assert torch.equal(cat_wide(pieces, -1), torch.cat(pieces, -1))


@pytest.mark.gpu
def test_gpu_graphed_batches_keep_states_and_issue_without_sync(t2w):
    """On CUDA with the solve graphed: batched chunks equal eager ones, states handed out by a batch
    are not changed by later replays (which overwrite the graph's buffers), and a batch whose graph
    exists is issued without a host synchronisation."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (run on the device machine)")
    flow = copy.deepcopy(t2w.flow).cuda()
    eager = copy.deepcopy(t2w.flow).cuda()
    graph = flow.enable_cuda_graphs(frames_bucket=16, cache_bucket=48)
    prompts = _prompts(8)
    states, ref = flow.setup_batch(prompts), eager.setup_batch(prompts)
    g = torch.Generator().manual_seed(9)
    for k in range(5):
        toks = [torch.randint(0, 6561, (28,), generator=g) for _ in states]
        res = flow.chunk_batch(states, toks, [False] * len(states))  # may capture its bucket
        rref = eager.chunk_batch(ref, toks, [False] * len(ref))
        snap = [{f: getattr(s, f).clone() for f in FIELDS} for _, s in res]
        torch.cuda.set_sync_debug_mode("error")
        try:  # the same bucket again (captured above): replays only, no synchronisation
            flow.chunk_batch(states[::-1], toks[::-1], [False] * len(states))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        for i, ((m, s), (rm, rs), sn) in enumerate(zip(res, rref, snap)):
            assert rel_l2(m.cpu(), rm.cpu()) < TOL, (k, i)
            for f in FIELDS:
                assert torch.equal(getattr(s, f), sn[f]), (k, i, f)  # not overwritten by the replay
                assert rel_l2(getattr(s, f).cpu(), getattr(rs, f).cpu()) < TOL, (k, i, f)
        states, ref = [s for _, s in res], [s for _, s in rref]
    assert graph.replays > 0


def test_gpu_offline_items_from_host_inputs_issue_without_sync(t2w):
    """Offline utterances as the engine's DiT backend builds them (``prompt_item`` from host tokens,
    prompt mel and embedding) keep their tokens on the host, and a graphed batch of them is built and
    issued without a host synchronisation: a range check of device tokens waited for the previous
    solve, ~40 % of the scheduler thread's busy time offline on an H100 (docs/perf.md "Session 27").
    The result equals the eager model's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (run on the device machine)")
    flow = copy.deepcopy(t2w.flow).cuda()
    eager = copy.deepcopy(t2w.flow).cuda()
    graph = flow.enable_cuda_graphs(frames_bucket=16, cache_bucket=48)
    g = torch.Generator().manual_seed(4)
    inputs = [(pt, pm, emb, torch.randint(0, 6561, (40,), generator=g)) for pt, pm, emb in _prompts(5)]

    def items(model):
        return [model.prompt_item(pt, pm, emb, extra, last=True) for pt, pm, emb, extra in inputs]

    first = flow.forward_items(items(flow), final_states=False)  # may capture its bucket
    assert all(it.tokens.device.type == "cpu" for it in items(flow))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:  # the same bucket again: host tokens, pinned copies and replays only
        again = flow.forward_items(items(flow), final_states=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ref = eager.forward_items(items(eager), final_states=False)
    for a, b, r in zip(first, again, ref):
        assert torch.equal(a.mel, b.mel)
        assert rel_l2(b.mel.cpu(), r.mel.cpu()) < TOL
    assert graph.replays > 0

"""The Step-Audio2 DiT flow's streaming encoder in its padded static-shape form (issue 17, DiT path):
:meth:`DitFlowModel._encode_static`, the body of the encoder graph that :class:`GraphedDiTSolve`
records next to each solve bucket's graph.

CPU: the padded form (run eagerly) equals today's eager ``_encode`` per item (mu frames and every new
cache) to float32 round-off (relative L2 <= 1e-6) for mixed batches (different cache lengths, trimmed
and untrimmed, final and non-final chunks, set-ups and an offline item without state, padding rows,
a bucket larger than the batch); the encoder bucket implied by the solve bucket always fits the
streams' batches; the graphed path (recorded by the stage machinery with a stand-in recording whose
replay runs the recorded function on the static tensors) equals the eager flow across chunks, reuses a
bucket's graphs for other lengths in that bucket, and leaves the solve-only use of a bucket (callers
bringing ``mu``) working. GPU (``gpu`` marker): the same on CUDA graphs, and no host synchronisation
while a captured batch is issued.
"""

from __future__ import annotations

import copy

import pytest
import torch

from _dit import Replay, stand_in_record, tiny_t2w
from _dit import prompts as _prompts
from _reference import rel_l2
from cosyserve.models import graphs as G
from cosyserve.models.dit_flow import TRIM_KEEP, DitItem, GraphedDiTSolve

FIELDS = ("spk", "enc_att1", "enc_att2", "enc_lookahead", "enc_up", "est_att", "est_cnn")
ENC_FIELDS = ("enc_att1", "enc_att2", "enc_lookahead", "enc_up")
EXACT = 1e-6  # padded vs eager encoder: float32 round-off
TOL = 1e-5  # whole flow (the solve adds its own summation-order noise), as tests/test_dit_batch_ops.py


@pytest.fixture(scope="module")
def t2w(tmp_path_factory):
    return tiny_t2w(tmp_path_factory)


def _toks(g: torch.Generator, n: int) -> torch.Tensor:
    return torch.randint(0, 6561, (n,), generator=g)


def _grown_states(flow, seed: int, rounds: int):
    """States of the four prompts after ``rounds`` chunk rounds in which streams skip rounds (so their
    cache lengths differ; the longest get trimmed)."""
    prompts = _prompts(seed)
    states = flow.setup_batch(prompts)
    g = torch.Generator().manual_seed(seed + 1)
    for k in range(rounds):
        part = [i for i in range(len(states)) if (i + k) % 3 != 2]
        res = flow.chunk_batch([states[i] for i in part], [_toks(g, int(torch.randint(5, 31, (1,), generator=g)))
                                                          for _ in part], [False] * len(part))
        for i, (_, s) in zip(part, res):
            states[i] = s
    return prompts, states


def _mixed_items(flow, prompts, states, g):
    """Chunks of every stream (non-final and final, different lengths), a set-up and an offline item."""
    items = [DitItem(tokens=_toks(g, n), spk=s.spk, last=lf, state=s)
             for n, s, lf in zip((9, 28, 4, 17), states, (False, False, True, True))]
    items.append(flow.setup_item(*prompts[1]))
    pt, pm, emb = prompts[0]
    items.append(flow.prompt_item(pt, pm, emb, _toks(g, 7), last=True))
    return items


def _assert_enc_equal(got, ref, tol=EXACT):
    mu, mlen, caches = got
    rmu, rmlen, rcaches = ref
    assert mlen == rmlen and mu.shape == rmu.shape
    for i, m in enumerate(mlen):
        assert rel_l2(mu[i, :m], rmu[i, :m]) <= tol, (i, rel_l2(mu[i, :m], rmu[i, :m]))
        if rcaches[i] is None:
            assert caches[i] is None, i
            continue
        for f, a, b in zip(ENC_FIELDS, caches[i], rcaches[i]):
            assert a.shape == b.shape, (i, f, tuple(a.shape), tuple(b.shape))
            assert rel_l2(a, b) <= tol, (i, f, rel_l2(a, b))


def test_padded_encoder_equals_eager_encode(t2w):
    """Mixed batch: items at different cache lengths (trimmed and not), final and non-final chunks, a
    set-up and an offline item (no state), in its own bucket and in larger buckets with padding rows,
    with and without trimming and with final states skipped."""
    flow = t2w.flow
    prompts, states = _grown_states(flow, 0, 6)
    c1 = {int(s.enc_att1.shape[3]) for s in states}
    assert len(c1) > 1, "the batch must mix cache lengths"
    assert any(s.cache_frames == s.prompt_frames + TRIM_KEEP for s in states), "some caches must be trimmed"
    items = _mixed_items(flow, prompts, states, torch.Generator().manual_seed(2))
    keep = [not it.last for it in items]
    with torch.inference_mode():
        for trim, ks in ((None, None), (TRIM_KEEP, None), (TRIM_KEEP, keep)):
            ref = flow._encode(items, trim, ks)
            _assert_enc_equal(flow._encode_padded(items, trim_keep=trim, keep_state=ks), ref)
            cmax = max(it.state.cache_frames for it in items if it.state is not None)
            mmax = max(ref[1])
            for rows, frames, cache in ((len(items), mmax + 9, cmax + 30), (12, mmax + 1, cmax + 64)):
                got = flow._encode_padded(items, frames=frames, cache=cache, rows=rows, trim_keep=trim, keep_state=ks)
                _assert_enc_equal(got, ref)
        with pytest.raises(ValueError, match="does not fit"):
            flow._encode_padded(items, rows=len(items) - 1)


def test_encoder_bucket_follows_the_solve_bucket(t2w):
    """A stream's estimator cache and its encoder's second-stage cache have the same length, ``up_rate``
    x the first stage's, at every step (trimmed or not), so the encoder bucket
    :meth:`encoder_bucket` derives from a batch's solve bucket always fits the batch."""
    flow = t2w.flow
    graph = GraphedDiTSolve(frames_bucket=16, cache_bucket=48, flow=flow)
    up, la = flow.up_rate, flow.pre_lookahead_len
    prompts = _prompts(3)
    states = flow.setup_batch(prompts)
    g = torch.Generator().manual_seed(4)
    for _ in range(7):
        for s in states:
            assert s.enc_att2.shape[3] == s.est_att.shape[4] == up * s.enc_att1.shape[3]
        lens = [int(torch.randint(la + 1, 31, (1,), generator=g)) for _ in states]
        last = [bool(torch.randint(0, 2, (1,), generator=g)) for _ in states]
        tlen = [n if lf else n - la for n, lf in zip(lens, last)]
        key = (graph.rows_bucket(len(states)), graph.frames_bucket(up * max(tlen)),
               graph.cache_bucket(max(s.cache_frames for s in states)))
        bufs = {name: torch.empty(shape, dtype=dt)
                for name, (shape, dt) in flow._encoder_shapes(key[0], *flow.encoder_bucket(*key[1:]),
                                                              torch.float32).items()}
        assert flow._encoder_fits(bufs, lens, [int(s.enc_att1.shape[3]) for s in states])
        states = [s for _, s in flow.chunk_batch(states, [_toks(g, n) for n in lens], [False] * len(states))]




def _streams(flow, eager, g, rounds: int, capture, in_place: bool = False):
    """Stream the four prompts through ``flow`` and ``eager`` in mixed batches (streams skip rounds, the
    last round ends half of them); ``capture(flow, items)`` runs before each batch. Compares every mel
    and state. ``in_place``: ``flow``'s streams keep their estimator caches in stores written in place
    (:attr:`DitItem.in_place`, the engine's way), the eager reference's states stay immutable."""
    prompts = _prompts(5)
    got, ref = flow.setup_batch(prompts), eager.setup_batch(prompts)
    for k in range(rounds):
        part = [i for i in range(len(got)) if (i + k) % 3 != 2 or k == rounds - 1]
        toks = [_toks(g, int(torch.randint(5, 31, (1,), generator=g))) for _ in part]
        last = [k == rounds - 1 and i % 2 == 0 for i in part]
        items = [DitItem(tokens=t, spk=got[i].spk, last=lf, state=got[i], in_place=in_place)
                 for t, i, lf in zip(toks, part, last)]
        capture(flow, items)
        res = [(r.mel, r.state) for r in flow.forward_items(items, trim_keep=TRIM_KEEP)]
        if in_place:
            assert all(s.est_store is not None and not s.stale for _, s in res)
        rres = eager.chunk_batch([ref[i] for i in part], toks, last)
        for (m, s), (rm, rs), i in zip(res, rres, part):
            assert m.shape == rm.shape and rel_l2(m, rm) < TOL, (k, i, rel_l2(m, rm))
            for f in FIELDS:
                a, b = getattr(s, f), getattr(rs, f)
                assert a.shape == b.shape and rel_l2(a.cpu(), b.cpu()) < TOL, (k, i, f)
            got[i], ref[i] = s, rs


def _batch_key(flow, items):
    graph, up, la = flow.graph, flow.up_rate, flow.pre_lookahead_len
    tl = [it.tokens.numel() - (0 if it.last else la) for it in items]
    return (graph.rows_bucket(len(items)), graph.frames_bucket(up * max(tl)),
            graph.cache_bucket(max(it.state.cache_frames if it.state is not None else 0 for it in items)))


@pytest.mark.parametrize("in_place", [False, True])
def test_graphed_encoder_replays_equal_eager(t2w, monkeypatch, in_place):
    """With the stand-in recording, each batch's bucket is captured (encoder + solve graphs) and
    replayed: mels and states equal the eager flow's across chunks (states carried, also when the
    streams' estimator caches are written in place from the graphs' shared buffers); every replay runs
    the encoder graph then the solve graph."""
    monkeypatch.setattr(G, "_record", stand_in_record)
    flow = copy.deepcopy(t2w.flow)
    graph = flow.enable_cuda_graphs(frames_bucket=16, cache_bucket=48)
    assert graph.encoder

    def capture(flow, items):
        key = _batch_key(flow, items)
        entry = graph.capture(key)
        assert isinstance(entry[2], Replay)

    capture(flow, [flow.setup_item(*p) for p in _prompts(5)])  # the set-up batch
    _streams(flow, t2w.flow, torch.Generator().manual_seed(6), 5, capture, in_place)
    assert graph.replays >= 6 and graph.encoder_replays == graph.replays
    assert sum(e[2].replays for e in graph._graphs.values()) == graph.encoder_replays
    assert sum(e[0].replays for e in graph._graphs.values()) == graph.replays


def test_same_bucket_reuses_graphs_and_solve_only_use_stays(t2w, monkeypatch):
    """A second batch with other token counts in the same bucket replays the same graphs (nothing new
    captured) and equals eager; a caller bringing its own ``mu`` (:meth:`_solve`) replays the solve
    graph alone; ``encoder=False`` records the solve only (the encoder runs eagerly)."""
    monkeypatch.setattr(G, "_record", stand_in_record)
    ref_flow = t2w.flow
    prompts, states = _grown_states(ref_flow, 7, 3)
    for enc_graph in (True, False):
        flow = copy.deepcopy(ref_flow)
        graph = flow.enable_cuda_graphs(frames_bucket=16, cache_bucket=48, encoder=enc_graph)
        g = torch.Generator().manual_seed(8)
        for lens in ((20, 21, 17, 22), (18, 22, 19, 16)):  # 2 * (n - 3) frames: one frames bucket (48)
            toks = [_toks(g, n) for n in lens]
            items = [DitItem(tokens=t, spk=s.spk, last=False, state=s) for t, s in zip(toks, states)]
            key = _batch_key(flow, items)
            graph.capture(key)
            assert graph.n_graphs == 1, key
            res = flow.chunk_batch(states, toks, [False] * len(states))
            rres = ref_flow.chunk_batch(states, toks, [False] * len(states))
            for (m, s), (rm, rs) in zip(res, rres):
                assert rel_l2(m, rm) < TOL
                for f in FIELDS:
                    assert rel_l2(getattr(s, f), getattr(rs, f)) < TOL, f
        entry = next(iter(graph._graphs.values()))
        assert (entry[2] is not None) == enc_graph
        assert graph.replays == 2 and graph.encoder_replays == (2 if enc_graph else 0)
        # solve only: mu from the eager encoder, the bucket's solve graph
        with torch.inference_mode():
            mu, mlen, _ = flow._encode(items)
            mel, _ = flow._solve(items, mu, mlen, flow.cfg.n_timesteps)
            rmu, rmlen, _ = ref_flow._encode(items)
            rmel, _ = ref_flow._solve(items, rmu, rmlen, ref_flow.cfg.n_timesteps)
        assert graph.replays == 3 and graph.encoder_replays == (2 if enc_graph else 0)
        for i, m in enumerate(mlen):
            assert rel_l2(mel[i, :, :m], rmel[i, :, :m]) < TOL


# ---------------------------------------------------------------------------------------------- GPU


def _cuda_flows(t2w):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (run on the device machine)")
    return copy.deepcopy(t2w.flow).cuda(), copy.deepcopy(t2w.flow).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("in_place", [False, True])
def test_gpu_graphed_encoder_and_solve_equal_eager_across_chunks(t2w, in_place):
    """CUDA graphs (captured on first use): mixed batches over several chunks, states carried (also
    written in place), equal the eager flow; every graphed batch replayed its encoder graph."""
    flow, eager = _cuda_flows(t2w)
    graph = flow.enable_cuda_graphs(frames_bucket=16, cache_bucket=48)
    _streams(flow, eager, torch.Generator().manual_seed(10), 5, lambda *a: None, in_place)
    assert graph.n_graphs > 0 and graph.replays > 0 and graph.encoder_replays == graph.replays
    assert all(e[2] is not None for e in graph._graphs.values())


@pytest.mark.gpu
def test_gpu_same_bucket_reuses_the_graph_without_sync(t2w):
    """A batch captures its bucket; a second batch of other token counts in that bucket replays the same
    graphs, is issued without a host synchronisation, and equals eager."""
    flow, eager = _cuda_flows(t2w)
    prompts = _prompts(11)
    states, ref = flow.setup_batch(prompts), eager.setup_batch(prompts)
    graph = flow.enable_cuda_graphs(frames_bucket=16, cache_bucket=48)
    g = torch.Generator().manual_seed(12)
    first = [_toks(g, n) for n in (20, 21, 17, 22)]
    flow.chunk_batch(states, first, [False] * len(states))  # captured on first use
    n, replays = graph.n_graphs, graph.replays
    assert n == 1 and replays == 1 and graph.encoder_replays == 1
    toks = [_toks(g, n) for n in (18, 22, 19, 16)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        res = flow.chunk_batch(states, toks, [False] * len(states))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert graph.n_graphs == n and graph.replays == replays + 1 and graph.encoder_replays == replays + 1
    for (m, s), (rm, rs) in zip(res, eager.chunk_batch(ref, toks, [False] * len(ref))):
        assert rel_l2(m.cpu(), rm.cpu()) < TOL
        for f in FIELDS:
            assert rel_l2(getattr(s, f).cpu(), getattr(rs, f).cpu()) < TOL, f

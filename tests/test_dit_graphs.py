"""Step-Audio2 DiT solve graphs as a graph stage (issue 17, DiT path): the bucket plan
(:func:`stream_solve_shapes`, :meth:`GraphedDiTSolve.plan`) against the buckets a simulated
engine stream really uses, capture through the shared ``_GraphStage`` machinery with a stand-in
recording on the CPU (published graphs give the eager results), the engine's wiring (stage,
warm-up, graph counts) and the DiT path's default chunk policy. The CUDA captures are in
tests/test_dit_token2wav.py (gpu)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from _dit import stand_in_record
from _reference import dit_discover, dit_tensors, one_thread, rel_l2
from cosyserve.engine.chunking import DIT_CHUNK_POLICY, ChunkPolicy, default_chunk_policy
from cosyserve.engine.core import EngineConfig, EngineCore
from cosyserve.models import graphs as G
from cosyserve.models.dit_flow import GraphedDiTSolve, stream_solve_shapes
from test_dit_token2wav import dit_model_dirs, t2w  # noqa: F401  (module fixtures)

STREAM = dit_discover("dit_flow", has=("stream_token", "prompt_token", "prompt_feat", "embedding")) or \
    dit_discover("dit_token2wav_e2e", has=("stream_token", "prompt_token", "prompt_feat", "embedding"))


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield




# ---------------------------------------------------------------------------------------------- arithmetic


def test_stream_solve_shapes_by_hand():
    """Prompt of 10 tokens (20 frames), hops 15 then 25, 3 look-ahead tokens, 2 frames per token,
    trim at prompt + 100 frames."""
    setups, chunks = stream_solve_shapes(10, [15, 25, 25, 25, 25], lookahead=3, up_rate=2, trim_keep=100)
    assert setups == {(20, 0)}
    caches = [20, 50, 100, 120]  # after the set-up, then each chunk (capped at 20 + 100)
    assert {c for _, c in chunks} == set(caches)
    assert (30, 20) in chunks and (50, 50) in chunks and (50, 100) in chunks and (50, 120) in chunks
    # a final chunk after chunk k has 3 .. next hop + 2 tokens: after the first (next hop 25) 3..27
    assert {f for f, c in chunks if c == 20} == {30}  # only the first chunk sees the bare set-up cache
    for c in caches[1:]:  # the next non-final chunk (50 frames) or a final one of 3 .. 27 tokens
        assert {f for f, cc in chunks if cc == c} == set(range(6, 55, 2))
    with pytest.raises(ValueError):
        stream_solve_shapes(0, [15], 3, 2)


def test_plan_pairs_every_frames_with_every_cache_and_bounds_the_count(caplog):
    g = GraphedDiTSolve(frames_bucket=25, cache_bucket=64, max_graphs=512)
    setups, chunks = stream_solve_shapes(100, ChunkPolicy.parse(DIT_CHUNK_POLICY).hops(100, 1000), 3, 2)
    n = g.plan(setups, chunks, max_rows=5)
    keys = set(g.keys())
    assert n == len(keys)
    rows = GraphedDiTSolve.rows_buckets(5)
    assert rows == [1, 2, 3, 4, 6]
    frames = {g.frames_bucket(f) for f, _ in chunks}
    caches = {g.cache_bucket(c) for _, c in chunks}
    assert frames == {25, 50, 75}  # 15- and 25-token hops, final chunks of 3 .. 27 tokens
    assert {(r, f, c) for r in rows for f in frames for c in caches} <= keys
    assert {(r, 200, 0) for r in (1, 2, 3, 4)} <= keys  # set-ups (at most 4 prompts at once)
    # the scheduler's budget: a bucket is planned only if its fewest rows at their shortest fit
    budgeted = GraphedDiTSolve(frames_bucket=25, cache_bucket=64)
    budgeted.plan(setups, chunks, max_rows=5, fits=lambda rows, tokens: rows * tokens <= 400, up_rate=2)
    kept = set(budgeted.keys())
    assert kept < keys and {k for k in keys if k[0] == 1} <= kept  # a lone job always runs
    for r, f, c in keys - kept:
        fewest = {2: 2, 3: 3, 4: 4, 6: 5}[r]
        assert fewest * max(-(-(f - 24) // 2), -(-(c - 63) // 2) + 1 if c else 0) > 400
    capped = GraphedDiTSolve(frames_bucket=25, cache_bucket=64)
    capped._shapes = lambda b, f, c: {"att": ((b, f + c), torch.float32)}  # no model: a stand-in buffer
    capped.plan(setups, chunks, max_rows=5, max_bytes=4 * 4 * 300)
    assert capped.keys() and all(r * (f + c) <= 4 * 300 for r, f, c in capped.keys())
    small = GraphedDiTSolve(max_graphs=10)
    with caplog.at_level("WARNING"):
        assert small.plan(setups, chunks, max_rows=5) == 10
    assert "run eagerly" in caplog.text
    assert small.order(small.keys())[0] == max(small.keys(), key=small._size)  # largest first, then smallest


def test_plan_adds_offline_utterances_at_coarse_frames_buckets():
    """Offline utterances (one pass, no cache) of any length up to the longest planned get a graph in
    a dozen coarse frame buckets (multiples of 128 frames up to 1024, of 256 beyond) for batches of up
    to ``offline_rows``; set-ups (no cache either) pad the same way then; chunks are unaffected, and
    without offline shapes nothing changes."""
    setups, chunks = stream_solve_shapes(100, ChunkPolicy.parse(DIT_CHUNK_POLICY).hops(100, 1000), 3, 2)
    plain = GraphedDiTSolve(frames_bucket=25, cache_bucket=64)
    plain.plan(setups, chunks, max_rows=12)
    assert not plain.coarse_uncached and plain.solve_frames_bucket(1000, 0) == 1000
    g = GraphedDiTSolve(frames_bucket=25, cache_bucket=64)
    offline = set(range(202, 2 * (100 + 750) + 1, 2))  # 100-token prompt + 1 .. 750 target tokens
    g.plan(setups, chunks, max_rows=12, offline=offline, offline_rows=8)
    assert g.coarse_uncached and g.offline_rows == 8 and plain.offline_rows is None
    assert {k for k in plain.keys() if k[2] > 0} == {k for k in g.keys() if k[2] > 0}  # chunks unchanged
    uncached = {k for k in g.keys() if k[2] == 0}
    assert sorted({f for _, f, _ in uncached}) == [256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792]
    assert {r for r, _, _ in uncached} == {1, 2, 3, 4, 6, 8}
    assert [g.solve_frames_bucket(m, 0) for m in (100, 200, 202, 700, 1024, 1025, 1700)] == \
        [128, 256, 256, 768, 1024, 1280, 1792]
    assert g.solve_frames_bucket(202, 64) == 225  # a chunk: the fine bucket
    assert {(g.rows_bucket(5), g.solve_frames_bucket(f, 0), 0) for f in offline} <= uncached
    assert {(r, g.solve_frames_bucket(f, 0), 0) for r in (1, 2, 3, 4) for f, _ in setups} <= uncached


def test_dit_graph_memory_share_bounds_the_buckets_and_the_rows(monkeypatch):
    """``EngineConfig.dit_graph_memory`` (``--dit-graph-memory``): no planned bucket's buffers exceed that
    share of the device's memory, and chunk batches are bounded to the rows whose buffers fit at the
    largest chunk shape (``max_rows``); a smaller share, fewer rows (device faked: no CUDA here)."""
    total = 4 * 4 * 2000  # a stand-in buffer costs 4 bytes x rows x (frames + cache)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(total_memory=total))
    models = SimpleNamespace(flow=SimpleNamespace(up_rate=2, pre_lookahead_len=3),
                             cfg=SimpleNamespace(token_frame_rate=25))
    rows = {}
    for share in (0.25, 0.1):
        g = GraphedDiTSolve(frames_bucket=25, cache_bucket=64)
        g.device = torch.device("cuda")
        g._shapes = lambda b, f, c: {"att": ((b, f + c), torch.float32)}
        cfg = EngineConfig(max_active=16, kv_max_len=256, dit_graph_memory=share)
        EngineCore._plan_dit_graphs(g, [60], models, cfg)
        assert g.keys() and all(g.buffer_bytes(k) <= share * total for k in g.keys())
        rows[share] = g.max_rows
    assert 1 < rows[0.1] < rows[0.25] <= 16, rows


def _models(flow):
    """The engine's view of a DiT model for the planner: the flow and the 25 Hz token rate."""
    return SimpleNamespace(flow=flow, cfg=SimpleNamespace(token_frame_rate=25))


# ---------------------------------------------------------------------------------------------- simulated engine


def _voices(t: dict, flow):
    """Two voices: the fixture's prompt and its first 60 % (another prompt length)."""
    pt, pm, emb = t["prompt_token"][0].reshape(-1), t["prompt_feat"][0], t["embedding"][0]
    n2 = int(pt.numel() * 0.6)
    return [SimpleNamespace(flow_speech_token=pt, speech_feat=pm, flow_embedding=emb),
            SimpleNamespace(flow_speech_token=pt[:n2], speech_feat=pm[: flow.up_rate * n2], flow_embedding=emb * 0.5)]


def _simulate(backend, voices, lengths, starts, policy: ChunkPolicy, per_step: int = 7, seed: int = 0):
    """Streams of ``lengths`` tokens (voice ``i % 2``) starting at engine steps ``starts``; each step the LM
    adds ``per_step`` tokens to every started stream and every stream with a ready chunk joins one token2wav
    batch, as ``EngineCore._next_chunk`` / ``_make_job`` build them. Returns the mels per stream."""
    from cosyserve.engine.token2wav import Token2WavJob
    from cosyserve.models.hift import HiFTStreamState

    g = torch.Generator().manual_seed(seed)
    toks = [torch.randint(0, 6561, (n,), generator=g) for n in lengths]
    state = [dict(n=0, sched=policy.start(int(voices[i % 2].flow_speech_token.numel())), hift=HiFTStreamState(),
                  done=False, audio=[]) for i in range(len(lengths))]
    step = 0
    while not all(s["done"] for s in state):
        jobs, who = [], []
        for i, s in enumerate(state):
            if s["done"] or step < starts[i]:
                continue
            s["n"] = min(lengths[i], s["n"] + per_step)
            sch = s["sched"]
            if sch.ready(s["n"]):
                jobs.append(Token2WavJob(voices[i % 2], toks[i][: sch.chunk_end()], sch.token_offset, False, True,
                                         s["hift"], torch.Generator().manual_seed(i)))
                who.append((i, False))
            elif s["n"] == lengths[i]:
                jobs.append(Token2WavJob(voices[i % 2], toks[i][: s["n"]], sch.token_offset, True, False, s["hift"],
                                         torch.Generator().manual_seed(i)))
                who.append((i, True))
        if jobs:
            for (i, final), r in zip(who, backend.run(jobs)):
                s = state[i]
                s["hift"] = r.hift_state
                s["audio"].append(r.speech)
                if final:
                    s["done"] = True
                else:
                    s["sched"].advance()
        step += 1
    return [torch.cat(s["audio"]) for s in state]


@pytest.mark.skipif(not STREAM, reason="no DiT streaming case")
def test_planned_buckets_cover_what_streams_use(t2w):  # noqa: F811
    """Every (rows, frames, cache) bucket that DitFlowModel._solve pads to while the engine's jobs of five
    streams (two prompt lengths, staggered starts, different lengths: mixed batches of set-ups, chunks at
    different cache lengths and final chunks) run is in the engine's plan for those prompt lengths."""
    import copy

    from cosyserve.engine.token2wav_dit import DitToken2WavBackend
    from cosyserve.models.dit_token2wav import DitToken2Wav

    t = dit_tensors(STREAM[0])
    flow = copy.deepcopy(t2w.flow)
    graph = flow.enable_cuda_graphs()
    voices = _voices(t, flow)
    backend = DitToken2WavBackend(DitToken2Wav(flow, t2w.hift), setup_cache_size=0)  # every stream sets up
    policy = ChunkPolicy.parse(DIT_CHUNK_POLICY)
    cfg = EngineConfig(max_active=5, kv_max_len=256, stream_chunk_policy=DIT_CHUNK_POLICY)
    prompts = [int(v.flow_speech_token.numel()) for v in voices]
    n = EngineCore._plan_dit_graphs(graph, prompts, _models(flow), cfg)  # (set-ups pad as planned)
    assert n == len(graph.keys()) and n <= graph.max_graphs
    # stream 1 ends with a final chunk of 27 tokens (54 frames: the 75-frame bucket), 3 with a 15-token one
    _simulate(backend, voices, lengths=[142, 67, 97, 30, 41], starts=[0, 1, 1, 3, 4], policy=policy, per_step=9)
    used = set(graph.used)
    assert any(r > 2 and c > 0 for r, _, c in used)  # chunks of several streams shared batches
    assert any(r > 1 and c == 0 for r, _, c in used)  # set-ups of both voices in one batch
    assert any(f == 75 for _, f, _ in used)
    missing = used - set(graph.keys())
    assert not missing, f"buckets used but not planned: {sorted(missing)}"


@pytest.mark.skipif(not STREAM, reason="no DiT streaming case")
def test_published_graphs_give_the_eager_results(t2w, monkeypatch):  # noqa: F811
    """warmup() captures every planned bucket through the stage machinery (a stand-in recording: replay
    runs the solve on the graph's static buffers); streams then replay them and their audio equals the
    eager flow's (no graphs), within the batching tolerance."""
    import copy

    from cosyserve.engine.token2wav_dit import DitToken2WavBackend
    from cosyserve.models.dit_token2wav import DitToken2Wav

    monkeypatch.setattr(G, "_record", stand_in_record)
    t = dit_tensors(STREAM[0])
    flow = copy.deepcopy(t2w.flow)
    graph = flow.enable_cuda_graphs()
    voices = _voices(t, flow)
    cfg = EngineConfig(max_active=2, kv_max_len=128, stream_chunk_policy=DIT_CHUNK_POLICY)
    EngineCore._plan_dit_graphs(graph, [int(v.flow_speech_token.numel()) for v in voices], _models(flow),
                                cfg)
    graph.capture_on_use = False
    graph.warmup()
    assert graph.n_graphs == len(graph.keys()) and not graph.pending() and graph.n_failed == 0
    policy = ChunkPolicy.parse(DIT_CHUNK_POLICY)
    args = dict(voices=voices, lengths=[90, 47], starts=[0, 1], policy=policy)
    got = _simulate(DitToken2WavBackend(DitToken2Wav(flow, t2w.hift)), **args)
    assert graph.replays > 0 and sum(e[0].replays for e in graph._graphs.values()) == graph.replays
    replays = graph.replays
    ref = _simulate(DitToken2WavBackend(DitToken2Wav(t2w.flow, t2w.hift)), **args)
    for a, b in zip(got, ref):
        assert a.shape == b.shape
        # flow batching noise (~1e-7) amplified by HiFT's F0 phase: the engine tests' waveform bound
        assert rel_l2(a, b) <= 2e-3
    # a bucket not published (nor captured on use) runs eagerly with the same padding
    graph._graphs.clear()
    again = _simulate(DitToken2WavBackend(DitToken2Wav(flow, t2w.hift)), **args)
    assert graph.replays == replays
    for a, b in zip(again, got):
        assert rel_l2(a, b) <= 1e-5


@pytest.mark.skipif(not STREAM, reason="no DiT streaming case")
def test_capture_steps_never_write_what_replays_read(t2w, monkeypatch):  # noqa: F811
    """A bucket's warm-up (private tensors) and its recording set-up leave the shared storages of the
    published graphs as they were (what makes a capture next to serving safe), and the time
    conditioning cache of the serving path is not touched by a warm-up."""
    import copy

    monkeypatch.setattr(G, "_record", stand_in_record)
    flow = copy.deepcopy(t2w.flow)
    graph = flow.enable_cuda_graphs()
    graph.plan({(40, 0)}, {(50, 40), (6, 90)}, max_rows=2)
    first, *rest = graph.order(graph.keys())
    graph.capture(first)  # the largest: sizes the shared storages
    with torch.inference_mode():
        for t in graph._flat.values():
            t.normal_() if t.is_floating_point() else t.random_(0, 2)  # stands for a replay's data
    flow._tc_cache = None
    for key in rest:
        before = [t.clone() for t in graph._flat.values()]
        graph._warm_up(*key)
        graph._record_entry(key, True)
        assert all(torch.equal(a, b) for a, b in zip(before, graph._flat.values())), key
    assert flow._tc_cache is None


def test_stage_captures_outside_the_plan_only_on_use(monkeypatch):
    """lookup(): a bucket outside the plan is captured on first use only with capture_on_use (the
    ``--lazy-graphs`` rule), never past max_graphs; the first capture of an unplanned stage works."""
    calls = []

    class Stub(GraphedDiTSolve):
        def _warm_up(self, *key):
            calls.append(("warm", key))

        def _record_entry(self, key, background):
            calls.append(("record", key))
            return ("graph", key)

    st = Stub(max_graphs=2)
    st.capture_on_use = False
    assert st.lookup((1, 50, 64)) is None and not calls
    st.capture_on_use = True
    assert st.lookup((1, 50, 64)) == ("graph", (1, 50, 64))
    assert st.lookup((2, 50, 64)) == ("graph", (2, 50, 64))
    assert st.lookup((3, 50, 64)) is None  # max_graphs reached: eager
    assert st.n_graphs == 2 and st.captures == 2


# ---------------------------------------------------------------------------------------------- engine / CLI


def test_engine_has_the_dit_stage_and_warms_it(dit_model_dirs, monkeypatch, tmp_path):  # noqa: F811
    """The engine's token2wav stages include the DiT solve stage with the planned buckets (default prompt
    range, replaced by the registered voices the server tells it about, later calls adding); warmup()
    captures them all, warming up once per class of buckets, and graph_counts counts them."""
    from _reference import reference_dir
    from cosyserve.engine.pipeline import Synthesizer
    from cosyserve.server.state import ServerConfig, ServerState

    monkeypatch.setattr(G, "_record", stand_in_record)
    md, t2w_dir = dit_model_dirs
    syn = Synthesizer(md, token2wav_dir=t2w_dir, normalizer="none")
    cfg = EngineConfig(max_active=2, kv_max_len=128, stream_prompt_s=(1.0, 1.2))
    eng = syn.new_engine(cfg)
    try:
        # CPU: no CUDA graphs are built; build the token2wav stages as the engine does on CUDA
        eng._t2w_stages = eng._t2w_graphs(syn.models, cfg)
        stage = syn.models.flow.graph
        assert isinstance(stage, GraphedDiTSolve) and any(s is stage for s in eng._t2w_stages)
        assert not stage.capture_on_use  # warmed: buckets outside the plan run eagerly
        planned = len(stage.keys())
        assert planned > 0 and eng.graph_counts()["pending"] == planned
        # the server tells the engine its registered voices' prompt lengths (ServerState.start)
        state = ServerState(ServerConfig(model_dir=str(md), voices_dir=str(tmp_path), token2wav_dir=str(t2w_dir)))
        voice = syn.make_voice("v", reference_dir() / "audio" / "zero_shot_prompt.wav", "希望你以后能够做的比我还好呦。")
        state.voices.add(voice)
        lens = state._voice_prompt_tokens()
        assert lens == [int(voice.flow_speech_token.numel())]
        default_plan = set(stage.keys())
        n = eng.plan_stream_prompts(lens + [40])  # the first voices told replace the default plan
        alone = GraphedDiTSolve(flow=syn.models.flow)
        assert n == EngineCore._plan_dit_graphs(alone, lens + [40], syn.models, cfg)
        assert set(stage.keys()) == set(alone.keys()) != default_plan
        assert eng.plan_stream_prompts([30]) >= n and set(alone.keys()) <= set(stage.keys())  # later calls add
        assert any(s is stage for s in eng._pending_warmup)
        warm = []
        real_warm_up = stage._warm_up
        monkeypatch.setattr(stage, "_warm_up", lambda *k: (warm.append(k), real_warm_up(*k)))
        eng.warmup()
        counts = eng.graph_counts()
        assert counts["captured"] == len(stage.keys()) and counts["pending"] == 0
        # one eager warm-up per class of buckets (rows 1 or more, cache or none), plus the capture
        # stream's first use, not one per bucket
        classes = {GraphedDiTSolve._warm_class(k) for k in stage.keys()}
        assert len(warm) <= len(classes) + 1 < len(stage.keys())
    finally:
        eng.close()
    lazy = EngineConfig(max_active=2, kv_max_len=128, t2w_graph_warmup=False)
    eng = syn.new_engine(lazy)
    try:
        eng._t2w_stages = eng._t2w_graphs(syn.models, lazy)
        assert syn.models.flow.graph.capture_on_use  # --lazy-graphs: captured on first use
    finally:
        eng.close()


def test_default_chunk_policy_of_the_dit_path():
    """--token2wav-dir without --chunk-policy: 15 tokens then 25-token hops; an explicit policy wins; the
    engine config carries it (the DiT graph plan); bench against a server keeps the server's."""
    from cosyserve.cli import _engine_config, _resolve_chunk_policy, build_parser

    def parsed(*argv):
        args = build_parser().parse_args(list(argv))
        _resolve_chunk_policy(args)
        return args

    assert default_chunk_policy(dit=True) == DIT_CHUNK_POLICY and default_chunk_policy(dit=False) == "upstream"
    # hops of a 100-token utterance: chunk ends 18, 43, 68, 93 (hop + 3 look-ahead tokens each)
    assert ChunkPolicy.parse(DIT_CHUNK_POLICY).hops(n_prompt_tokens=60, max_tokens=100) == [15, 25, 25, 25]
    assert ChunkPolicy.parse(DIT_CHUNK_POLICY).hops(60, 92) == [15, 25, 25]
    # upstream: 25 + 15 (60 + 40 aligned to 100 tokens), then doubling to 100; the 5th chunk ends at 393
    assert ChunkPolicy.parse("upstream").hops(60, 400) == [40, 50, 100, 100, 100]
    a = parsed("serve", "--model-dir", "m", "--token2wav-dir", "t")
    assert a.chunk_policy == DIT_CHUNK_POLICY
    assert _engine_config(a).stream_chunk_policy is None  # = the default of the path (the DiT's here)
    assert parsed("serve", "--model-dir", "m").chunk_policy == "upstream"
    b = parsed("serve", "--model-dir", "m", "--token2wav-dir", "t", "--chunk-policy", "fixed:20")
    assert b.chunk_policy == "fixed:20" and _engine_config(b).stream_chunk_policy == "fixed:20"
    assert parsed("synthesize", "--model-dir", "m", "--token2wav-dir", "t", "-o", "x.wav").chunk_policy \
        == DIT_CHUNK_POLICY
    assert parsed("bench", "--url", "http://x").chunk_policy is None
    assert parsed("bench", "--in-process", "--token2wav-dir", "t").chunk_policy == DIT_CHUNK_POLICY
    with pytest.raises(ValueError):
        EngineConfig(stream_chunk_policy="sometimes")
    with pytest.raises(ValueError):
        EngineConfig(stream_prompt_s=(3.0, 2.0))


# ---------------------------------------------------------------------------------------------- kernel count


def test_solve_kernel_count_stays_down():
    """The solve is bound by its number of small kernels (docs/perf.md "Session 29"): the operators a graph of
    ``DitFlowModel._euler`` replays, counted on the CPU by ``benchmarks/dit_solve_kernels.py`` (a fused op or
    the causal convolutions' columns kernel counts once), stay at most 16 per layer and evaluation (26 before
    the fused ops; 19 with the columns as three eager kernels, docs/perf.md "Session 32") and 5 per evaluation
    outside the layers (14.4 before), and every fused op of the solve and the columns kernel are used. Kernel
    count is a proxy, device time decides ("Session 33")."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "dit_solve_kernels.py"
    spec = importlib.util.spec_from_file_location("dit_solve_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    per_layer, rest, _ = mod.solve_kernels(streams=3)
    assert sum(per_layer.values()) <= 16, per_layer
    assert rest <= 5, rest
    for name in ("fused:dit_qk_norm_kv", "fused:dit_add_norm_modulate", "fused:dit_norm_mish", "kernel:causal_cols"):
        assert per_layer.get(name, 0) >= 1, (name, per_layer)

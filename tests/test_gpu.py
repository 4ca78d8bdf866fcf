"""GPU-only checks (skipped without CUDA): CUDA graphs equal eager; half precision vs float32.

Run on the device machine: ``python -m pytest tests/test_gpu.py -q``. Uses the demo
architecture with random weights, so no reference data is needed.
"""

from __future__ import annotations

import pytest
import torch

from _reference import HALF_TOL  # documented errors of half precision against float32
from cosyserve.models.demo import DemoSize, demo_qwen_config, demo_yaml

pytestmark = pytest.mark.gpu


def rel(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def yaml_dir(tmp_path_factory):
    import json

    d = tmp_path_factory.mktemp("gpu")
    (d / "CosyVoice-BlankEN").mkdir()
    (d / "cosyvoice2.yaml").write_text(demo_yaml(DemoSize()))
    (d / "CosyVoice-BlankEN" / "config.json").write_text(json.dumps(demo_qwen_config(DemoSize())))
    return d


@pytest.fixture(scope="module", autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def build(yaml_dir, dtype):
    from cosyserve.models.loader import build_random

    return build_random(yaml_dir / "cosyvoice2.yaml", device="cuda", dtype=dtype, seed=0)


@torch.inference_mode()
def test_graphed_decode_equals_eager(yaml_dir):
    from cosyserve.models.graphs import GraphedDecoder
    from cosyserve.models.llm import KVCache

    m = build(yaml_dir, torch.float32)
    lm = m.llm
    cache = KVCache.allocate(lm, 9, 600)
    prefixes = [lm.embed_prefix(torch.randint(0, 1000, (n,)), torch.zeros(0, dtype=torch.long),
                                torch.randint(0, 6561, (50 + n,))) for n in (5, 17, 40)]
    for i, p in enumerate(prefixes):
        lm.forward_cached(p[None], cache, torch.tensor([i]), torch.tensor([0]))
    graphs = GraphedDecoder(lm, cache, max_batch=8)
    eager_cache = KVCache(cache.k.clone(), cache.v.clone())
    lens = [p.shape[0] for p in prefixes]
    for step in range(4):
        toks = torch.randint(0, 6561, (3,))
        slots, start = torch.tensor([0, 1, 2]), torch.tensor(lens) + step
        got = graphs(toks, slots, start).clone()
        ref = lm.logprobs(lm.forward_cached(lm.embed_speech(toks[:, None]), eager_cache, slots, start)[:, -1])
        assert rel(got, ref) < 1e-5
    idle = graphs.rows.idle_pos  # idle rows (the captures' warm-up runs too) write only there
    # Slots written alike. Not torch.equal: the graph multiplies a bucket of rows, eager only the
    # rows asked for, and cuBLAS may pick another kernel (summation order) for another row count.
    # A stray write from a padding row (a whole K/V vector) would be ~1e-1, far above this.
    assert rel(cache.k[:, :3, :, :idle], eager_cache.k[:, :3, :, :idle]) < 1e-5
    # rows are slots: slot 1 idle between two decoding slots, results in the order asked for
    toks, slots, start = torch.randint(0, 6561, (2,)), torch.tensor([2, 0]), torch.tensor([lens[2], lens[0]]) + 4
    got = graphs(toks, slots, start).clone()
    ref = lm.logprobs(lm.forward_cached(lm.embed_speech(toks[:, None]), eager_cache, slots, start)[:, -1])
    assert rel(got, ref) < 1e-5
    assert rel(cache.k[:, :3, :, :idle], eager_cache.k[:, :3, :, :idle]) < 1e-5
    assert rel(cache.v[:, :3, :, :idle], eager_cache.v[:, :3, :, :idle]) < 1e-5


@torch.inference_mode()
def test_graphed_prefill_equals_eager(yaml_dir):
    from cosyserve.models.graphs import GraphedPrefill
    from cosyserve.models.llm import KVCache

    m = build(yaml_dir, torch.float32)
    lm = m.llm
    cache = KVCache.allocate(lm, 4, 600)
    eager = KVCache(cache.k.clone(), cache.v.clone())
    pre = GraphedPrefill(lm, cache, bucket=64, max_len=256, max_batch=4)
    for slot, n in ((0, 5), (1, 64), (2, 150)):
        p = lm.embed_prefix(torch.randint(0, 1000, (n,)), torch.zeros(0, dtype=torch.long),
                            torch.randint(0, 6561, (30,))).cuda()
        got = pre(p[None], slot).clone()
        ref = lm.forward_cached(p[None], eager, torch.tensor([slot]), torch.tensor([0]))
        assert got.shape == ref.shape and rel(got, ref) < 1e-5
        t = p.shape[0]
        assert rel(cache.k[:, slot, :, :t], eager.k[:, slot, :, :t]) < 1e-5  # [layers, slots, kv, len, hd]
    assert pre(torch.zeros(1, 300, lm.qwen_config.hidden_size, device="cuda"), 0) is None  # too long: eager
    # a right-padded batch of three (bucket of four rows: one reads/writes the scratch slot)
    ps = [lm.embed_prefix(torch.randint(0, 1000, (n,)), torch.zeros(0, dtype=torch.long),
                          torch.randint(0, 6561, (30,))).cuda() for n in (7, 90, 40)]
    emb = torch.zeros(3, max(p.shape[0] for p in ps), ps[0].shape[-1], device="cuda")
    for i, p in enumerate(ps):
        emb[i, : p.shape[0]] = p
    got = pre(emb, [2, 0, 1]).clone()
    ref = lm.forward_cached(emb, eager, torch.tensor([2, 0, 1]), torch.zeros(3, dtype=torch.long))
    for i, (slot, p) in enumerate(zip((2, 0, 1), ps)):
        t = p.shape[0]
        assert rel(got[i, :t], ref[i, :t]) < 1e-5
        assert rel(cache.k[:, slot, :, :t], eager.k[:, slot, :, :t]) < 1e-5
    assert pre(torch.zeros(5, 10, lm.qwen_config.hidden_size, device="cuda"), list(range(5))) is None  # > max_batch


@torch.inference_mode()
def test_graphed_hift_decode_equals_eager(yaml_dir):
    from cosyserve.models.graphs import GraphedHiFTDecoder

    hift = build(yaml_dir, torch.float32).hift
    spf = hift.samples_per_frame
    g = torch.Generator(device="cuda").manual_seed(0)
    graphed = GraphedHiFTDecoder(hift, max_batch=4, frame_bucket=32)
    for lengths in ([17], [40, 25, 33]):
        t = max(lengths)
        mel = torch.randn(len(lengths), 80, t, device="cuda", generator=g)
        source = torch.randn(len(lengths), 1, t * spf, device="cuda", generator=g) * 0.1
        lt = torch.tensor(lengths, device="cuda")
        ref = hift.decode(mel, source, lt)
        for _ in range(2):  # the second call replays the captured graph
            got = graphed(mel, source, lt)
            assert got.shape == ref.shape and rel(got, ref) < 1e-4
    # inference_batch uses it when set, with the same result
    mels = [torch.randn(1, 80, n, device="cuda", generator=g) for n in (20, 36)]
    gens = lambda: [torch.Generator().manual_seed(i) for i in range(2)]  # noqa: E731
    eager, _ = hift.inference_batch(mels, None, gens())
    hift.graph_decode = graphed
    try:
        fast, _ = hift.inference_batch(mels, None, gens())
    finally:
        hift.graph_decode = None
    for a, b in zip(fast, eager):
        assert a.shape == b.shape and rel(a, b) < 1e-4


@torch.inference_mode()
def test_graphed_flow_equals_eager(yaml_dir):
    from cosyserve.models.graphs import GraphedFlow

    m = build(yaml_dir, torch.float32)
    flow = m.flow
    for on_gpu in (True, False):  # inputs on the GPU (tests) or the CPU (the engine's voices)
        put = (lambda x: x.cuda()) if on_gpu else (lambda x: x)
        args = dict(tokens=[put(torch.randint(0, 6561, (1, n))) for n in (20, 33, 7)],
                    prompt_tokens=[put(torch.randint(0, 6561, (1, p))) for p in (30, 0, 40)],
                    prompt_feats=[put(torch.randn(1, 60, 80)), put(torch.zeros(1, 0, 80)), put(torch.randn(1, 80, 80))],
                    embeddings=put(torch.randn(3, 192)), streaming=[True, False, True], finalize=[False, True, True])
        ref = flow.inference_batch(**args)
        one = {k: v[:1] for k, v in args.items()}  # a batch of one: another bucket
        ref_one = flow.inference_batch(**one)
        flow.graph = GraphedFlow(flow, max_batch=4)
        try:
            got = flow.inference_batch(**args)
            got2 = flow.inference_batch(**args)  # replay
            got_one = flow.inference_batch(**one)  # its buffers are views of the same memory
            got3 = flow.inference_batch(**args)
        finally:
            flow.graph = None
        for a, b, c, d in zip(got, got2, ref, got3):
            # replays of one captured graph on the same inputs: exact by construction
            assert a.shape == c.shape and rel(a, c) < 1e-5 and torch.equal(a, b) and torch.equal(a, d)
        assert got_one[0].shape == ref_one[0].shape and rel(got_one[0], ref_one[0]) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.inference_mode()
def test_half_precision_within_documented_error(yaml_dir, dtype):
    from cosyserve.models.llm import KVCache

    ref, half = build(yaml_dir, torch.float32), build(yaml_dir, dtype)
    text, ptok = torch.randint(0, 1000, (20,)), torch.randint(0, 6561, (80,))
    out = []
    for m in (ref, half):
        cache = KVCache.allocate(m.llm, 1, 256)
        p = m.llm.embed_prefix(text, torch.zeros(0, dtype=torch.long), ptok)
        out.append(m.llm.logprobs(m.llm.forward_cached(p[None], cache, torch.tensor([0]), torch.tensor([0]))[0]))
    assert rel(out[1], out[0]) < HALF_TOL["logp"]
    mels = []
    for m in (ref, half):
        mels.append(m.flow.inference(torch.randint(0, 6561, (1, 40)).cuda().fill_(7) + torch.arange(40).cuda(),
                                     ptok[None].cuda(), torch.randn(1, 160, 80, generator=torch.Generator().manual_seed(0)).cuda(),
                                     torch.ones(1, 192).cuda(), False, True))
    assert rel(mels[1], mels[0]) < HALF_TOL["mel"]


def test_engine_with_graphs_samples_same_tokens(yaml_dir, tmp_path):
    """The engine on CUDA with graphs gives the tokens it gives without them (float32), and
    the LM on its high-priority stream gives the tokens and audio it gives on a normal one."""
    m = build(yaml_dir, torch.float32)
    results = []
    for graphs in (False, True):
        done, states = _engine_tokens(m, cuda_graphs=graphs)
        results.append(done)
        # HiFT's excitation noise is drawn on the GPU (no host work per chunk)
        assert all(seg.hift_gen.device.type == "cuda" for st in states for seg in st.segments)
    assert results[0] == results[1]
    audio = [_engine_tokens(m, lm_stream_priority=prio, audio=True)[0] for prio in (True, False)]
    assert audio[0].keys() == audio[1].keys()
    for rid, (tokens, wav) in audio[0].items():
        assert tokens == audio[1][rid][0] and wav.size > 0
        assert wav.shape == audio[1][rid][1].shape and float(abs(wav - audio[1][rid][1]).max()) < 1e-4


def test_engine_captures_every_graph_at_start(yaml_dir):
    """By default the engine captures every reachable prefill bucket when it is built and every
    flow and HiFT bucket in :meth:`EngineCore.warmup` (on the stepping thread; the first step
    does it otherwise), none while serving, and gives the tokens and audio of an engine that
    captures buckets on first use (all buckets share their static buffers)."""
    m = build(yaml_dir, torch.float32)
    counts, reachable = [], []

    def count(eng):
        graphs = (eng.prefill_graphs, m.flow.graph, m.hift.graph_decode)
        counts.append(tuple(g.n_graphs for g in graphs))
        reachable.append(tuple(len(g.grid.reachable()) for g in graphs))

    def start(eng):
        count(eng)  # built: prefill captured, flow and HiFT pending
        eng.warmup()
        count(eng)

    streams = []

    def done(eng):
        count(eng)
        streams.extend(g.stream.cuda_stream for g in (eng.decoder, eng.prefill_graphs, m.flow.graph,
                                                      m.hift.graph_decode))

    warm = _engine_tokens(m, audio=True, on_start=start, on_done=done, graph_capture="startup")[0]
    # every stage captures on a stream of its own: graphs sharing a capture stream share torch's
    # cuBLAS workspace and race on it when the LM's and the flow's are replayed concurrently
    assert len(set(streams)) == 4 and all(streams), streams
    assert counts[0] == (reachable[0][0], 0, 0), (counts, reachable)
    assert counts[1] == counts[2] == reachable[1] and min(counts[1]) > 1, (counts, reachable)
    lazy = _engine_tokens(m, audio=True, graph_warmup=False, t2w_graph_warmup=False, on_start=count,
                          on_done=count, graph_capture="startup")[0]
    assert counts[3] == (0, 0, 0) and min(counts[4]) >= 1 and all(b <= a for a, b in zip(counts[1], counts[4]))
    assert warm.keys() == lazy.keys()
    for rid, (tokens, wav) in warm.items():
        assert tokens == lazy[rid][0] and wav.shape == lazy[rid][1].shape
        assert float(abs(wav - lazy[rid][1]).max()) < 1e-4


def test_background_capture_serves_eagerly_meanwhile_with_the_same_results(yaml_dir, monkeypatch):
    """The default start-up: the engine serves while a background thread captures its graphs
    (every capture on that thread, none on the serving thread), requests served during the
    capture window (eager buckets, graphs as they are published) give the tokens and audio of an
    engine that captured everything first, and at the end every reachable bucket is captured."""
    import threading

    from cosyserve.models import graphs as G

    m = build(yaml_dir, torch.float32)
    threads, seen = [], {}
    real = G._GraphStage.capture

    def capture(self, key, background=False, level=10):
        threads.append((threading.current_thread().name, background))
        return real(self, key, background, level)

    monkeypatch.setattr(G._GraphStage, "capture", capture)

    def start(eng):
        assert eng.graph_counts()["captured"] == 0  # nothing captured when the engine is built
        eng.start_graph_capture()  # what AsyncEngine does: start, wait for priming only
        seen["pending_at_start"] = eng.graph_counts()["pending"]

    def done(eng):
        seen["pending_at_end_of_requests"] = eng.graph_counts()["pending"]
        assert eng.graph_capturer.wait(600)
        seen["counts"] = eng.graph_counts()
        seen["reachable"] = sum(len(g.keys()) for g in eng.graph_capturer.stages)

    bg = _engine_tokens(m, audio=True, on_start=start, on_done=done, graph_capture="background")[0]
    assert seen["pending_at_start"] > 0, seen  # the requests did run during the capture window
    assert seen["counts"]["captured"] == seen["reachable"] and seen["counts"]["failed"] == 0, seen
    assert seen["counts"]["pending"] == 0
    assert threads and all(name == "cosyserve-graph-capture" and bg for name, bg in threads), set(threads)
    threads.clear()
    first = _engine_tokens(m, audio=True, graph_capture="startup")[0]
    assert bg.keys() == first.keys()
    for rid, (tokens, wav) in bg.items():
        assert tokens == first[rid][0] and wav.shape == first[rid][1].shape
        assert float(abs(wav - first[rid][1]).max()) < 1e-4


def _engine_tokens(m, audio: bool = False, on_start=None, on_done=None, stream: bool = False, ratio: int = 3,
                   **config) -> tuple[dict, list]:
    """Three seeded requests through an EngineCore on ``m`` with ``EngineConfig(**config)``:
    ``({request_id: tokens}, request states)`` (with ``audio``: ``{request_id: (tokens, float32
    waveform)}``); the flow/HiFT graphs it installed are removed. ``on_start(engine)`` /
    ``on_done(engine)`` run before the first request / after the last; ``stream``: streaming requests
    (exponential chunk schedule); ``ratio``: speech tokens per text token (10-12 text tokens)."""
    from cosyserve.engine.chunking import ChunkPolicy

    import numpy as np

    from cosyserve.engine.core import EngineConfig, EngineCore
    from cosyserve.engine.request import AudioChunk, EngineRequest, RequestFinished, SynthesisParams
    from cosyserve.frontend.voice import Voice

    g = torch.Generator().manual_seed(0)  # the same voice on every call
    voice = Voice.from_features("v", "x", torch.randint(0, 1000, (8,), generator=g),
                                torch.randint(0, 6561, (60,), generator=g), torch.randn(120, 80, generator=g),
                                torch.randn(192, generator=g))
    eng = EngineCore(m, EngineConfig(max_active=4, kv_max_len=512, **config))
    if on_start is not None:
        on_start(eng)
    states = []
    for i in range(3):
        ids = torch.randint(0, 1000, (10 + i,), generator=torch.Generator().manual_seed(i))
        states.append(eng.add_request(EngineRequest(
            f"r{i}", [ids], voice, SynthesisParams(seed=i, min_token_text_ratio=ratio, max_token_text_ratio=ratio,
                                                   stream=stream,
                                                   chunk_policy=ChunkPolicy.parse("exponential") if stream else None))))
    done, wavs = {}, {}
    while eng.has_work():
        for ev in eng.step():
            if isinstance(ev, RequestFinished):
                done[ev.request_id] = ev.tokens
            elif isinstance(ev, AudioChunk):
                wavs.setdefault(ev.request_id, []).append(ev.samples)
    if on_done is not None:
        on_done(eng)
    m.flow.graph = m.flow.prefix_graph = m.hift.graph_decode = None
    if audio:
        done = {rid: (tokens, np.concatenate(wavs.get(rid, [np.zeros(0, np.float32)]))) for rid, tokens in done.items()}
    return done, states


@pytest.mark.parametrize("prefix_build", ["engine", "background"])
def test_engine_prompt_prefix_graphs_same_audio(yaml_dir, prefix_build):
    """``--flow-stream-cache prefix`` on CUDA (float32): three streams of one voice through the engine with
    every graph captured at start, the non-final chunks through the prefix graphs (the voice's prefix built
    once, on the engine thread or on the pool's worker thread and CUDA stream), give the tokens and audio of
    the engine without stream caches."""
    m = build(yaml_dir, torch.float32)
    seen = {}

    def done(eng):
        pg, pp = m.flow.prefix_graph, eng.t2w.prefix_pool
        seen.update(builds=pp.builds, hits=pp.hits, pending=len(pp._pending),
                    graphs=(pg.encoder.n_graphs, pg.solver.n_graphs), misses=sum(pg.solver.misses.values()))

    # 80-96 tokens per stream: non-final chunks after the first (which never waits for a prefix build)
    got = _engine_tokens(m, audio=True, stream=True, ratio=8, on_done=done, graph_capture="startup",
                         flow_stream_cache="prefix", flow_prefix_build=prefix_build)[0]
    ref = _engine_tokens(m, audio=True, stream=True, ratio=8, graph_capture="startup", flow_stream_cache=False)[0]
    assert min(seen["graphs"]) > 1 and seen["misses"] == 0, seen
    if prefix_build == "engine":
        assert seen["builds"] == 1 and seen["hits"] >= 2, seen
    else:  # the same build on the worker; the chunks it finished in time read it (ordering: test_flow_prefix.py)
        assert seen["builds"] + seen["pending"] == 1, seen
    assert got.keys() == ref.keys()
    for rid, (tokens, wav) in got.items():
        assert tokens == ref[rid][0] and wav.shape == ref[rid][1].shape and wav.size > 0
        assert float(abs(wav - ref[rid][1]).max()) < 1e-3


@torch.inference_mode()
def test_batched_f0_float64_pass_on_cuda_is_independent_of_batch_mates(yaml_dir):
    """``--hift-f0 batched`` on CUDA: one float64 F0 pass per batch; each item's F0 equals its own
    single-item pass bit for bit (float64 rounding stays below float32's), is within float32
    rounding of the per-item float32 F0, and issuing it does not synchronise the host."""
    hift = build(yaml_dir, torch.float32).hift
    g = torch.Generator(device="cuda").manual_seed(3)
    lengths = [57, 12, 33, 80]
    t = max(lengths)
    mel = torch.randn(len(lengths), 80, t, device="cuda", generator=g)
    lt = torch.tensor(lengths, device="cuda")
    hift.predict_f0_batched(mel, lt)  # the float64 weight copies are made here
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        f0 = hift.predict_f0_batched(mel, lt)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for b, n in enumerate(lengths):
        alone = hift.predict_f0_batched(mel[b:b + 1, :, :n], lt[b:b + 1])[0]
        assert torch.equal(f0[b, :n], alone), b
        assert torch.all(f0[b, n:] == 0)
        assert rel(alone, hift.predict_f0(mel[b:b + 1, :, :n])[0]) < 1e-5


@torch.inference_mode()
def test_prefill_inputs_reach_the_device_without_waiting_for_it(yaml_dir):
    """A newcomer's prefix embedding and the prefill's last-position gather copy host ids to the
    device through pinned memory: a pageable copy synchronises the LM stream (the scheduler thread
    then waits for the decode steps and the prefill queued before it; on the H100 issuing prefills
    took 17-19 % of the scheduler thread at 96-128 DiT clients, docs/perf.md "Session 30")."""
    from cosyserve.engine.core import EngineCore

    m = build(yaml_dir, torch.float32)
    text, ptext, pspeech = torch.randint(0, 1000, (12,)), torch.randint(0, 1000, (5,)), torch.randint(0, 6561, (30,))
    ref = m.llm.embed_prefix(text, ptext, pspeech)
    h = torch.randn(2, 40, m.llm.qwen_config.hidden_size, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = m.llm.embed_prefix(text, ptext, pspeech)
        idx = EngineCore._last_positions(h, [40, 17])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, ref) and torch.equal(idx, torch.stack([h[0, 39], h[1, 16]]))


@torch.inference_mode()
def test_token2wav_launch_does_not_wait_for_the_gpu(yaml_dir):
    """Issuing a token2wav batch on the side stream never blocks the host on that stream's
    earlier work (no pageable copies, no reads of device values, excitation noise drawn on
    the GPU): with the stream busy for ~1 s, launch returns long before, and the results equal
    those of an idle stream."""
    from cosyserve.engine.token2wav import Token2Wav, Token2WavJob
    from cosyserve.frontend.voice import Voice
    from cosyserve.models.graphs import GraphedFlow, GraphedHiFTDecoder
    from cosyserve.models.hift import HiFTStreamState

    m = build(yaml_dir, torch.float32)
    m.flow.graph = GraphedFlow(m.flow, 4)
    m.hift.graph_decode = GraphedHiFTDecoder(m.hift, 4)
    t2w = Token2Wav(m.flow, m.hift, m.cfg.token_mel_ratio)
    voice = Voice.from_features("v", "x", torch.randint(0, 1000, (8,)), torch.randint(0, 6561, (60,)),
                                torch.randn(120, 80), torch.randn(192))

    def jobs():
        return [Token2WavJob(voice, torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(n)), 0,
                             final, not final, HiFTStreamState(), torch.Generator(device="cuda").manual_seed(n))
                for n, final in ((18, False), (40, True))]

    side = torch.cuda.Stream()
    try:
        ref = t2w.finish(t2w.launch(jobs(), stream=side))  # also captures the graphs
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(side)
        torch.cuda._sleep(100_000_000)
        end.record(side)
        end.synchronize()
        cycles = int(100_000_000 * 1000 / start.elapsed_time(end))  # ~1 s of GPU time
        with torch.cuda.stream(side):
            torch.cuda._sleep(cycles)
        import time

        t0 = time.perf_counter()
        pending = t2w.launch(jobs(), stream=side, queue_steps=2)  # as the engine issues it
        for _ in range(5):  # the GPU is busy: advancing issues nothing more, and never waits
            assert not pending.advance(2)
        issued = time.perf_counter() - t0
        assert not pending.done() and pending.run.steps_left == pending.run.state.n - 2
        got = t2w.finish(pending)
        # bounded by the steps' device time: timing events around each step measure it
        pending = t2w.launch(jobs(), stream=side, queue_steps=4, queue_s=0.025)
        key, timed = pending.run.cost_key, t2w.finish(pending)
    finally:
        m.flow.graph = m.hift.graph_decode = None
    assert issued < 0.5, f"launch blocked the host for {issued:.3f} s"
    for a, b, c in zip(got, ref, timed):  # same draws; kernels may round differently between runs
        assert a.speech.shape == b.speech.shape and rel(a.speech, b.speech) < 1e-4
        assert c.speech.shape == b.speech.shape and rel(c.speech, b.speech) < 1e-4
    per_step = t2w.step_times.snapshot()
    assert list(per_step) == [key] and 0 < per_step[key] < 0.1, per_step


@torch.inference_mode()
def test_graphed_decode_samples_as_eager(yaml_dir):
    """The decode graph with device sampling feeds each slot's last token from the DecodeState,
    draws what ras_sample_device draws from its log-probs with the slot's repetition window,
    appends the token to the state; an engine with device sampling gives the same tokens with
    and without graphs, pipelined or not."""
    from cosyserve.models.graphs import GraphedDecoder
    from cosyserve.models.llm import DecodeState, KVCache
    from cosyserve.models.sampling import ras_sample_device

    m = build(yaml_dir, torch.float32)
    lm, cfg = m.llm, m.cfg.llm
    cache = KVCache.allocate(lm, 5, 256)
    win = cfg.sampling.win_size
    state = DecodeState.allocate(5, win, "cuda")
    dec = GraphedDecoder(lm, cache, 4, sampling=cfg.sampling, eos_id=cfg.eos_token, state=state)
    b = 3
    hist = [torch.randint(0, 6561, (n,)).tolist() for n in (win + 2, 3, 1)]
    state.load([0, 1, 2], hist)
    recent = state.recent[:b].clone()
    assert state.last[:b].tolist() == [h[-1] for h in hist] and recent[1, :win - 3].eq(-1).all()
    keys = (torch.tensor([1, 2, 3]), torch.tensor([4, 0, 7]), torch.tensor([True, False, False]))
    logp, toks = dec.sample(torch.arange(b), torch.tensor([5, 9, 2]), *keys)
    ref = ras_sample_device(logp, recent, *(k.cuda() for k in keys), cfg.sampling, cfg.eos_token)
    assert torch.equal(toks, ref)
    assert torch.equal(state.last[:b], ref) and torch.equal(state.recent[:b, -1], ref)
    assert torch.equal(state.recent[:b, :-1], recent[:, 1:])

    results = [_engine_tokens(m, cuda_graphs=graphs, device_sampling=True, pipeline_decode=piped,
                              decode_lookahead=ahead)[0]
               for graphs, piped, ahead in ((False, False, 1), (True, False, 1), (True, True, 1), (False, True, 1),
                                            (True, True, 3))]
    assert all(r == results[0] for r in results[1:])


@torch.inference_mode()
def test_fused_kernels_match_float32_eager():
    """The compiled elementwise kernels (cosyserve.models.fused) compute the eager formula: in
    float32 to rounding, in half precision closer to the float32 result than eager half is."""
    from cosyserve.models.dit_flow import _QK_NORM_KV
    from cosyserve.models.fused import add_norm_modulate
    from cosyserve.models.flow_estimator import add_layer_norm, conv_layer_norm_mish
    from cosyserve.models.hift import _snake
    from cosyserve.models.llm import _rope, _silu_mul

    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *shape: torch.randn(*shape, device="cuda", generator=g)  # noqa: E731
    mask = (torch.arange(300, device="cuda")[None] < torch.tensor([300, 120, 7], device="cuda")[:, None])[:, None]
    cases = [
        (_snake, (r(3, 64, 300) * 3, torch.rand(64, device="cuda", generator=g) + 0.5, mask)),
        (_snake, (r(3, 64, 300) * 3, torch.rand(64, device="cuda", generator=g) + 0.5, None)),
        (add_layer_norm, (r(4, 50, 256), r(4, 50, 256), r(256), r(256), 1e-5)),
        (conv_layer_norm_mish, (r(4, 50, 768) * 4, r(256), r(256), r(256), 1e-5, r(4, 1, 256))),
        (conv_layer_norm_mish, (r(4, 50, 768), r(256), r(256), r(256), 1e-5, r(4, 50, 256))),
        (conv_layer_norm_mish, (r(4, 2, 768), r(256), r(256), r(256), 1e-5, None)),
        (_rope, (r(2, 3, 9, 64), r(2, 3, 1, 64), r(2, 3, 1, 64))),
        (_silu_mul, (r(5, 1, 2 * 1024) * 3,)),
        (_QK_NORM_KV, (r(4, 50, 3, 8, 64) * 3, r(64), r(64), r(64), r(64), 1e-5, 1e-5)),
        (add_norm_modulate, (r(4, 50, 512), r(1, 1, 512), r(4, 50, 512), r(1, 1, 512), r(1, 1, 512))),
    ]
    for op, args in cases:
        ref = op.fn(*args)
        got = op(*args)
        assert op.compiled, op.name
        for a, b in zip(*((got, ref) if isinstance(ref, tuple) else ((got,), (ref,)))):
            assert a.dtype == b.dtype and rel(a, b) < 1e-6, op.name
        for dtype in (torch.bfloat16, torch.float16):
            half = [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
            got, eager = op(*half), op.fn(*half)
            for a, e, b in zip(*((got, eager, ref) if isinstance(ref, tuple) else ((got,), (eager,), (ref,)))):
                assert a.dtype == dtype and rel(a, b) <= rel(e, b) * 1.25 + 1e-6, (op.name, dtype)


@torch.inference_mode()
def test_fused_cfg_euler_step_matches_eager():
    """The DiT solve's fused CFG/Euler step: the ODE state stays float32 (as in the solve) with the velocity and
    the static inputs in float32, bfloat16 or float16: the compiled op equals its eager formula to rounding."""
    from cosyserve.models.dit_flow import _CFG_EULER

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(4, 80, 50, device="cuda", generator=g)
    dt = torch.tensor(0.1, device="cuda")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        v = torch.randn(8, 80, 50, device="cuda", generator=g).to(dtype)
        static_in = torch.randn(8, 240, 50, device="cuda", generator=g).to(dtype)
        got, ref = _CFG_EULER(x, v, dt, static_in, 0.7), _CFG_EULER.fn(x, v, dt, static_in, 0.7)
        assert _CFG_EULER.compiled
        assert got[0].dtype == torch.float32 and got[1].dtype == dtype
        assert rel(got[0], ref[0]) < 1e-6
        assert rel(got[1].float(), ref[1].float()) < (1e-6 if dtype == torch.float32 else 1e-2)


@torch.inference_mode()
def test_fused_flow_and_hift_equal_eager(yaml_dir):
    """The flow and HiFT with the fused kernels equal their eager runs (float32)."""
    from cosyserve.models import fused

    m = build(yaml_dir, torch.float32)
    args = dict(tokens=[torch.randint(0, 6561, (1, n)).cuda() for n in (20, 33)],
                prompt_tokens=[torch.randint(0, 6561, (1, p)).cuda() for p in (30, 0)],
                prompt_feats=[torch.randn(1, 60, 80).cuda(), torch.zeros(1, 0, 80).cuda()],
                embeddings=torch.randn(2, 192).cuda(), streaming=[True, False], finalize=[False, True])
    mels = [torch.randn(1, 80, n, device="cuda") * 2 - 5 for n in (20, 36)]
    gens = lambda: [torch.Generator().manual_seed(i) for i in range(2)]  # noqa: E731
    out = {}
    for on in (True, False):
        prev = fused.set_enabled(on)
        try:
            out[on] = (m.flow.inference_batch(**args), m.hift.inference_batch(mels, None, gens())[0])
        finally:
            fused.set_enabled(prev)
    for a, b in zip(out[True][0] + out[True][1], out[False][0] + out[False][1]):
        assert a.shape == b.shape and rel(a, b) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@torch.inference_mode()
def test_hift_half_trunk_within_documented_error(yaml_dir, dtype):
    """HiFT with its convolution trunk in half precision, eager and graphed, against float32."""
    from cosyserve.models.graphs import GraphedHiFTDecoder

    ref_m, half_m = build(yaml_dir, torch.float32).hift, build(yaml_dir, torch.float32).hift.set_trunk_dtype(dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [150, 90, 33]
    t = max(lengths)
    mel = torch.randn(3, 80, t, device="cuda", generator=g) * 2 - 5
    lt = torch.tensor(lengths, device="cuda")
    f0 = torch.stack([ref_m.predict_f0(mel[i:i + 1])[0] for i in range(3)])
    source = ref_m.excitation_padded(f0, lengths, [torch.Generator().manual_seed(i) for i in range(3)])
    ref = ref_m.decode(mel, source, lt)
    got = half_m.decode(mel, source, lt)
    tol = HALF_TOL[f"speech_{str(dtype).split('.')[-1]}"]
    print(f"HiFT trunk {dtype}: rel. error {rel(got, ref):.2e} (documented {tol})")
    assert got.dtype == torch.float32 and rel(got, ref) < tol
    graphed = GraphedHiFTDecoder(half_m, max_batch=4, frame_bucket=32)
    for _ in range(2):
        assert rel(graphed(mel, source, lt), ref) < tol


@torch.inference_mode()
def test_failed_capture_leaves_the_pool_usable():
    """A capture that CUDA invalidates (here: a device-wide synchronisation inside it; on the H100 in
    session 22 a fused kernel's autotuning in another thread) must not break later captures: its
    pool stays "recording" in torch 2.11 even when the recording is ended by hand, so it is retired
    (captures go to live_pool's successor), and the default CUDA generator leaves capture mode."""
    from cosyserve.models import graphs as G

    pool, stream = torch.cuda.graph_pool_handle(), G.capture_stream("cuda", non_blocking=True)
    x = torch.randn(1024, device="cuda")

    def run_bad():
        y = x * 2
        torch.cuda.synchronize()  # not permitted while capturing: the capture is invalidated
        return y + 1

    with pytest.raises(Exception):
        G._record(run_bad, pool, stream)
    torch.cuda.synchronize()
    torch.randn(8, device="cuda")  # the default generator left capture mode (it raised otherwise)
    from cosyserve.models.capture import live_pool

    assert live_pool(pool) != pool  # the failed capture's pool is retired; stages capture into its successor
    g, out = G._record(lambda: x * 3 + 1, live_pool(pool), stream)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x * 3 + 1)


@torch.inference_mode()
def test_fused_op_does_not_compile_while_another_thread_captures():
    """A fused op called while another thread captures runs eagerly (compiling a new variant there
    synchronises the device and invalidates that capture); the capture succeeds."""
    import threading

    from cosyserve.models import graphs as G
    from cosyserve.models.fused import FusedOp

    op = FusedOp(lambda a, b: torch.sin(a) * b + a, name="capture_race_probe")
    pool, stream = torch.cuda.graph_pool_handle(), G.capture_stream("cuda", non_blocking=True)
    x = torch.randn(4096, device="cuda")
    done = threading.Event()
    results = {}

    a = torch.randn(3, 77, device="cuda")  # (no default-generator draws during a capture)

    def serve():  # a never-seen op and shape: it would compile (and autotune) now
        results["y"] = op(a, a)
        results["ref"] = op.fn(a, a)
        done.set()

    def run():
        y = x * 2
        threading.Thread(target=serve).start()
        assert done.wait(120)
        return y - 1

    with G.CAPTURE_LOCK:
        g, out = G._record(run, pool, stream)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x * 2 - 1)
    assert torch.equal(results["y"], results["ref"]) and not op._broken

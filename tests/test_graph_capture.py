"""Background CUDA graph capture (issue 18: ready early, graphs captured while serving, no
stalls): the capturer's logic with fake stages and the graphed stages' bookkeeping on the CPU
with a stand-in for the CUDA recording. The real captures are in tests/test_gpu.py (gpu)."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import pytest
import torch

from cosyserve.models import graphs as G
from cosyserve.models.demo import DemoSize, demo_qwen_config, demo_yaml


class FakeStage(G._GraphStage):
    """A stage of ``keys`` whose capture records (thread, key), can block on ``gate[key]`` and
    raise for keys in ``fail``."""

    def __init__(self, name: str, keys: list, fail=(), gate=None, log=None):
        self.name = name
        self._keys = list(keys)
        self.fail, self.gate = set(fail), gate or {}
        self.log = log if log is not None else []
        self._init_stage("cpu")

    def keys(self):
        return list(self._keys)

    def _warm_up(self, *key):
        ev = self.gate.get(key)
        if ev is not None:
            assert ev.wait(10), "test gate never opened"
        if key in self.fail:
            raise RuntimeError(f"capture of {key} failed")

    def _record_entry(self, key, background):
        self.log.append((self.name, key, threading.get_ident(), background))
        return ("graph", key)


def test_plan_takes_groups_in_turn_and_stages_round_robin():
    a, b, c = FakeStage("a", [(1,), (2,)]), FakeStage("b", [(1,), (2,), (3,)]), FakeStage("c", [(9,)])
    cap = G.BackgroundCapturer([[a], [b, c]])
    assert [(s.name, k) for s, k in cap.plan()] == [("a", (1,)), ("a", (2,)), ("b", (1,)), ("c", (9,)),
                                                   ("b", (2,)), ("b", (3,))]
    assert cap.pending == 6 and cap.captured == 0


def test_bucket_order_is_largest_first_then_smallest_first():
    class Grid(G._BucketGraphs):
        def _warm_up(self, *key):
            pass

        def _record_entry(self, key, background):
            return key

    stage = Grid(G.BucketGrid([1, 2, 4], [32, 64, 128], max_area=256), "cpu")
    reach = stage.grid.reachable()
    order = stage.pending()
    assert sorted(order) == sorted(reach)
    sizes = [bb * lb for bb, lb in order]
    assert sizes[0] == max(sizes) and sizes[1:] == sorted(sizes[1:])  # the pool's size set first
    stage.capture(order[0])
    rest = stage.pending()
    assert [bb * lb for bb, lb in rest] == sorted(bb * lb for bb, lb in rest)  # then by likely use


def test_background_capture_publishes_atomically_and_serving_stays_eager_meanwhile():
    gate = {(2,): threading.Event()}
    log = []
    st = FakeStage("s", [(1,), (2,), (3,)], gate=gate, log=log)
    assert st.capture_on_use  # alone, a stage captures on first use (--lazy-graphs)
    cap = G.BackgroundCapturer([[st]], pause_s=0.001, prime=False)
    cap.start()
    assert not st.capture_on_use  # owned by the capturer: the serving path never captures
    deadline = time.time() + 10
    while (1,) not in st._graphs and time.time() < deadline:
        time.sleep(0.01)
    assert st.lookup((1,)) == ("graph", (1,))
    # (2,) is being captured: not published, so a batch in that bucket runs eagerly (None)
    for _ in range(20):
        assert st.lookup((2,)) is None and st.lookup((3,)) is None
    assert cap.pending == 2 and cap.captured == 1 and not cap.done
    gate[(2,)].set()
    assert cap.wait(10) and cap.done
    assert st.lookup((2,)) == ("graph", (2,)) and st.lookup((3,)) == ("graph", (3,))
    assert cap.pending == 0 and cap.captured == 3 and cap.failed == 0 and cap.wall_s is not None
    me = threading.get_ident()
    assert [k for _, k, _, _ in log] == [(1,), (2,), (3,)]
    assert all(tid != me and bg for _, _, tid, bg in log)  # all on the capture thread, background mode


def test_when_done_listeners_run_once_after_the_last_capture(caplog):
    """Listeners registered before the end run once on the capture thread after every bucket is
    published; one registered later runs at once on the caller's; a failing one is logged and the
    others still run (the server re-freezes the heap this way: engine/gc_pauses.py)."""
    gate = {(2,): threading.Event()}
    st = FakeStage("s", [(1,), (2,)], gate=gate)
    cap = G.BackgroundCapturer([[st]], prime=False)
    seen = []

    def listener(tag):
        def fn():
            seen.append((tag, threading.get_ident(), len(st._graphs)))
            if tag == "bad":
                raise RuntimeError("listener bug")
        return fn

    cap.when_done(listener("before-start"))
    cap.start()
    cap.when_done(listener("bad"))
    cap.when_done(listener("during"))
    assert seen == []  # (2,) still being captured
    gate[(2,)].set()
    with caplog.at_level("ERROR"):
        assert cap.wait(10)
        deadline = time.time() + 10
        while len(seen) < 3 and time.time() < deadline:
            time.sleep(0.01)
    me = threading.get_ident()
    assert [t for t, _, _ in seen] == ["before-start", "bad", "during"]
    assert all(tid != me and n == 2 for _, tid, n in seen)
    assert "a graph-capture listener failed" in caplog.text
    cap.when_done(listener("after"))
    assert seen[-1][:2] == ("after", me) and len(seen) == 4


def test_a_failing_capture_disables_only_its_bucket(caplog):
    st = FakeStage("s", [(1,), (2,), (3,)], fail={(2,)})
    cap = G.BackgroundCapturer([[st]])
    with caplog.at_level("WARNING"):
        cap.start()
        assert cap.wait(10)
    assert set(st._graphs) == {(1,), (3,)} and st.n_failed == 1 and cap.failed == 1 and cap.pending == 0
    assert "capturing the s graph 2 failed" in caplog.text
    st.capture_on_use = True  # even on first use, a disabled bucket stays eager
    assert st.lookup((2,)) is None and (2,) not in st._graphs


def test_captures_stop_after_too_many_failures_in_a_row(caplog):
    st = FakeStage("s", [(k,) for k in range(1, 21)], fail={(k,) for k in range(3, 21)})
    cap = G.BackgroundCapturer([[st]], prime=False)
    cap.start()
    assert cap.wait(10)
    assert set(st._graphs) == {(1,), (2,)} and cap.failed == G.BackgroundCapturer.max_failures_in_a_row
    assert cap.pending == 20 - 2 - cap.failed and "in a row failed" in caplog.text
    assert cap.error is not None  # the last failure: a listener tells a lost device from it


def test_one_failed_bucket_leaves_no_capture_error():
    st = FakeStage("s", [(1,), (2,), (3,)], fail={(2,)})
    cap = G.BackgroundCapturer([[st]])
    cap.start()
    assert cap.wait(10) and cap.failed == 1 and cap.error is None


def test_stop_while_capturing_ends_after_the_capture_in_progress():
    gate = {(2,): threading.Event()}
    st = FakeStage("s", [(1,), (2,), (3,), (4,)], gate=gate)
    cap = G.BackgroundCapturer([[st]], prime=False)
    cap.start()
    deadline = time.time() + 10
    while (1,) not in st._graphs and time.time() < deadline:
        time.sleep(0.01)
    assert not cap.stop(timeout=0.05)  # (2,) is still being captured
    gate[(2,)].set()
    assert cap.stop(timeout=10) and cap.done
    assert set(st._graphs) == {(1,), (2,)} and cap.pending == 2  # the rest stay eager
    assert st.lookup((3,)) is None


def test_priming_warms_one_and_two_row_buckets_before_any_capture():
    """Priming (``prime=True``: fused kernels compiled for one row and for more) runs first, on the
    capture thread, and :meth:`wait_primed` returns once it is done, before the captures."""
    warmed = []

    class Priming(FakeStage):
        def _warm_up(self, *key):
            warmed.append((key, len(self.log)))  # the bucket and how many captures came before

    st = Priming("s", [(1, 64), (1, 32), (2, 32), (4, 32)])
    cap = G.BackgroundCapturer([[st]], prime=True)
    cap.start()
    assert cap.wait_primed(10)
    assert cap.wait(10) and st.n_graphs == 4
    # the smallest bucket of 1 and of 2 rows, before any capture; then one warm-up per capture
    # of the other buckets (the primed ones are warm)
    assert warmed == [((1, 32), 0), ((2, 32), 0), ((1, 64), 0), ((4, 32), 3)]


def test_lazy_stage_captures_on_first_use_and_run_captures_everything_in_order():
    log = []
    st = FakeStage("s", [(1,), (2,)], log=log)
    assert st.lookup((2,)) == ("graph", (2,)) and log[-1][1] == (2,) and log[-1][3] is False
    other = FakeStage("t", [(5,), (6,)], log=log)
    G.BackgroundCapturer([[st, other]]).run()  # before serving, on this thread
    assert [k for _, k, _, _ in log] == [(2,), (1,), (5,), (6,)]
    assert all(tid == threading.get_ident() for _, _, tid, _ in log)


# ----------------------------------------------------------------------------------------------
# the real stages on the CPU: warm-ups and buffer set-up never write what serving reads; with a
# stand-in for the CUDA recording, published buckets give the eager results


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from cosyserve.models.loader import build_random

    d = tmp_path_factory.mktemp("capture")
    (d / "CosyVoice-BlankEN").mkdir()
    (d / "cosyvoice2.yaml").write_text(demo_yaml(DemoSize()))
    (d / "CosyVoice-BlankEN" / "config.json").write_text(json.dumps(demo_qwen_config(DemoSize())))
    return build_random(d / "cosyvoice2.yaml", device="cpu", dtype=torch.float32, seed=0)


def _copy_into(dst, src) -> None:
    """Write ``src``'s tensors into ``dst``'s (same structure): what a graph replay does to the
    static outputs recorded at capture."""
    if isinstance(dst, torch.Tensor):
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _copy_into(d, s)
    elif dataclasses.is_dataclass(dst):
        for f in dataclasses.fields(dst):
            _copy_into(getattr(dst, f.name), getattr(src, f.name))


class ReplayGraph:
    """A stand-in CUDA graph: replay runs the recorded function again into the recorded outputs."""

    def __init__(self, run, out):
        self.run, self.out, self.replays = run, out, 0

    def replay(self):
        self.replays += 1
        _copy_into(self.out, self.run())


def fake_record(run, pool, stream, settle_first=True):
    out = run()
    return ReplayGraph(run, out), out


def no_run_record(run, pool, stream, settle_first=True):
    """Recording without running anything (as CUDA does)."""
    return ReplayGraph(run, None), None


def _snapshot(stage, extra=()):
    return [t.clone() for t in list(stage.shared._flat.values()) + list(extra)] if hasattr(stage, "shared") \
        else [t.clone() for t in extra]


def _unchanged(before, stage, extra=()):
    now = list(stage.shared._flat.values()) + list(extra) if hasattr(stage, "shared") else list(extra)
    return len(before) == len(now) and all(torch.equal(a, b) for a, b in zip(before, now))


@torch.inference_mode()
def test_capture_steps_never_write_what_serving_reads(model, monkeypatch):
    """A bucket's warm-up (private inputs; the LM's on the scratch slot and a private decode
    state) and its buffer set-up before recording leave every shared buffer, every live KV slot
    and the decode state as they were: what makes a capture next to serving safe."""
    from cosyserve.models.llm import DecodeState, KVCache

    monkeypatch.setattr(G, "_record", no_run_record)
    lm, flow, hift = model.llm, model.flow, model.hift
    lm.setup_rope(512)
    cache = KVCache.allocate(lm, 5, 512)  # 4 serving slots + the scratch slot
    cache.k.normal_()
    cache.v.normal_()
    state = DecodeState.allocate(5, model.cfg.llm.sampling.win_size)
    state.last.random_(0, 100)
    state.recent.random_(0, 100)
    dec = G.GraphedDecoder(lm, cache, 4, sampling=model.cfg.llm.sampling, eos_id=model.cfg.llm.min_len_mask_id,
                           state=state)
    pre = G.GraphedPrefill(lm, cache, bucket=64, max_len=128, max_batch=4, max_tokens=256)
    fl = G.GraphedFlow(flow, max_batch=2, max_tokens=64, max_area=128)
    hi = G.GraphedHiFTDecoder(hift, max_batch=2, max_frames=64, max_area=128)
    live = [cache.k[:, :4], cache.v[:, :4], state.last, state.recent]
    for stage in (fl, hi, pre):  # the first bucket sizes and creates the shared buffers
        first = stage.pending()[0]
        stage._warm_up(*first)
        stage._record_entry(first, True)
        for t in stage.shared._flat.values():
            t.normal_() if t.is_floating_point() else t.random_(0, 2)  # stands for serving's data
    for stage in (dec, pre, fl, hi):
        for key in stage.pending()[:3]:
            before = _snapshot(stage, live)
            stage._warm_up(*key)
            stage._record_entry(key, True)
            assert _unchanged(before, stage, live), (stage.name, key)


@torch.inference_mode()
def test_published_buckets_give_the_eager_results(model, monkeypatch):
    """Flow and HiFT through their graph tables: eager while nothing is published (capture on
    use off), then, after a background capture with a stand-in recording, the replayed buckets
    give the eager results (shared buffers, private warm-ups, the begin/step split)."""
    monkeypatch.setattr(G, "_record", fake_record)
    flow, hift = model.flow, model.hift
    g = torch.Generator().manual_seed(0)
    n_tok = (20, 33)
    args = dict(tokens=[torch.randint(0, 6561, (1, n), generator=g) for n in n_tok],
                prompt_tokens=[torch.randint(0, 6561, (1, 10), generator=g), torch.zeros(1, 0, dtype=torch.long)],
                prompt_feats=[torch.randn(1, 20, 80, generator=g), torch.zeros(1, 0, 80)],
                embeddings=torch.randn(2, 192, generator=g), streaming=[True, False], finalize=[False, True])
    ref = flow.inference_batch(**args)
    fl = G.GraphedFlow(flow, max_batch=2, max_tokens=64, max_area=128)
    hi = G.GraphedHiFTDecoder(hift, max_batch=2, max_frames=64, max_area=128)
    inputs = flow.prepare(*args.values())
    key = fl.buckets(*inputs.ids.shape)
    cap = G.BackgroundCapturer([[hi, fl]])
    cap.start()  # capture_on_use off before anything is used
    if key not in fl._graphs:  # pending: the caller (FlowModel.start) runs it eagerly
        assert fl.start(inputs) is None
    assert cap.wait(120) and cap.failed == 0 and cap.pending == 0 and key in fl._graphs

    def graphed():  # FlowModel.start's graph path (taken on CUDA only)
        run = fl.start(inputs)
        while run.steps_left:
            run.step()
        return run.mels()

    got, got2 = graphed(), graphed()
    for a, b, r in zip(got, got2, ref):
        assert a.shape == r.shape and torch.allclose(a, r, rtol=1e-4, atol=1e-4) and torch.equal(a, b)
    assert fl._graphs[key][1].replays == 2 * flow.cfg.cfm.n_timesteps  # the step "graph" ran
    mel = torch.randn(2, hift.cfg.in_channels, 40, generator=g)
    source = torch.randn(2, 1, 40 * hift.samples_per_frame, generator=g) * 0.1
    lengths = torch.tensor([40, 25])
    eager = hift.decode(mel, source, lengths)
    graphed = hi(mel, source, lengths)
    for b, n in enumerate(lengths.tolist()):
        n *= hift.samples_per_frame
        assert torch.allclose(graphed[b, :n], eager[b, :n], rtol=1e-4, atol=1e-5)


@torch.inference_mode()
def test_priming_leaves_the_shared_buffers_to_the_largest_bucket(model, monkeypatch):
    """Priming warms small buckets first, but the shared buffers are still allocated by the first
    capture (the largest bucket), so every bucket's tensors are views of them (memory as the
    old largest-first capture): nothing allocated per bucket."""
    monkeypatch.setattr(G, "_record", no_run_record)
    fl = G.GraphedFlow(model.flow, max_batch=2, max_tokens=64, max_area=128)
    own = []
    take = G.SharedBuffers.take

    def spy(self, name, shape, dtype, units):
        t = take(self, name, shape, dtype, units)
        if t.data_ptr() != self._flat[name].data_ptr():
            own.append((name, tuple(shape)))  # did not fit: an allocation of its own
        return t

    monkeypatch.setattr(G.SharedBuffers, "take", spy)
    cap = G.BackgroundCapturer([[fl]])
    cap._prime()
    assert not fl.shared._flat  # priming allocated nothing shared
    order = fl.pending()
    fl.capture(order[0])
    sizes = {k: v.numel() for k, v in fl.shared._flat.items()}
    for key in order[1:]:
        fl.capture(key)
    assert {k: v.numel() for k, v in fl.shared._flat.items()} == sizes  # no buffer grew or was added
    assert not own, own


def test_engine_counts_graphs_and_metrics_show_them(model):
    """``EngineCore.graph_counts`` (CPU: no graphs, all 0) and the /metrics gauges read from it."""
    from cosyserve.engine.core import EngineConfig, EngineCore
    from cosyserve.server.metrics import Metrics

    with pytest.raises(ValueError, match="graph_capture"):
        EngineConfig(graph_capture="sometimes")
    eng = EngineCore(model, EngineConfig(max_active=2, kv_max_len=256))
    assert eng.graph_capturer is None
    assert eng.graph_counts() == {"captured": 0.0, "pending": 0.0, "failed": 0.0, "capture_seconds": 0.0}
    eng.start_graph_capture()  # nothing to do on the CPU
    m = Metrics()
    m.attach(eng)
    text = m.render().decode()
    for name in ("cosyserve_graphs_captured", "cosyserve_graphs_pending", "cosyserve_graphs_failed",
                 "cosyserve_graph_capture_seconds"):
        assert f"\n{name} 0.0" in text

    class Core:  # an engine with a capture under way
        cfg = eng.cfg
        capacity_model = eng.capacity_model
        queue_depth = active_count = kv_slots_used = 0
        capacity_streams = load_ratio = float("nan")

        @staticmethod
        def graph_counts():
            return {"captured": 7.0, "pending": 12.0, "failed": 1.0, "capture_seconds": 3.5}

    m.attach(Core())
    text = m.render().decode()
    assert "\ncosyserve_graphs_captured 7.0" in text and "\ncosyserve_graphs_pending 12.0" in text
    assert "\ncosyserve_graphs_failed 1.0" in text and "\ncosyserve_graph_capture_seconds 3.5" in text


def test_cli_flags_choose_the_capture_mode():
    """``serve`` captures in the background by default (``graph_capture="background"``, fused
    kernels compiled by the capture thread unless ``--graph-priming``); ``--graphs-before-ready``
    captures everything before ready (``bench --in-process``'s default, where ``--background-graphs``
    opts in); ``--lazy-graphs`` still captures prefill/flow/HiFT on first use (and combines with
    either); both capture flags at once is an error."""
    import pytest

    from cosyserve.cli import _engine_config, build_parser

    p = build_parser()
    base = ["serve", "--model-dir", "m"]

    def serve(*flags):
        e = _engine_config(p.parse_args(base + list(flags)), background_default=True)
        return e.graph_capture, e.graph_warmup, e.t2w_graph_warmup, e.graph_priming

    assert serve() == ("background", True, True, False)
    assert serve("--graph-priming") == ("background", True, True, True)
    assert serve("--graphs-before-ready") == ("startup", True, True, False)
    assert serve("--lazy-graphs") == ("background", False, False, False)
    assert serve("--lazy-graphs", "--graphs-before-ready") == ("startup", False, False, False)
    with pytest.raises(SystemExit, match="exclude each other"):
        serve("--background-graphs", "--graphs-before-ready")
    bench = ["bench", "--in-process", "--model-dir", "m"]
    assert _engine_config(p.parse_args(bench)).graph_capture == "startup"
    assert _engine_config(p.parse_args(bench + ["--background-graphs"])).graph_capture == "background"


def test_server_is_ready_and_serves_while_graphs_are_pending(tmp_path, monkeypatch):
    """The server reports ready (and answers requests) while its background capture is still
    under way; /metrics shows the buckets pending, then none once the capture is done. A
    stand-in stage, held mid-capture, takes the place of the CUDA grids (CPU here)."""
    import asyncio

    from cosyserve.engine.pipeline import Synthesizer
    from cosyserve.engine.request import AudioChunk, RequestFinished, SynthesisParams
    from cosyserve.models.demo import write_demo_model
    from cosyserve.server.state import ServerConfig, ServerState

    gate = threading.Event()
    stage = FakeStage("fake", [(1,), (2,), (3,)], gate={(2,): gate})
    real = Synthesizer.new_engine

    def new_engine(self, config, observer=None):
        core = real(self, config, observer)
        core.graph_capturer = G.BackgroundCapturer([[stage]], prime=False)
        return core

    monkeypatch.setattr(Synthesizer, "new_engine", new_engine)
    state = ServerState(ServerConfig(model_dir=str(write_demo_model(tmp_path / "demo")), device="cpu"))

    async def main():
        await state.start()
        assert state.ready  # ready while (2,) is still being captured
        assert (2,) not in stage._graphs and not stage.capture_on_use
        text = state.metrics.render().decode()
        assert "\ncosyserve_graphs_pending 2.0" in text and "\ncosyserve_graphs_captured 1.0" in text
        voice = await asyncio.to_thread(state.synth.make_voice, "v", (torch.zeros(1, 24000) + 0.1, 24000), "你好。")
        req = state.synth.build_request("Hello.", voice, SynthesisParams(seed=0, max_token_text_ratio=3), "r1")
        events = [ev async for ev in state.engine.generate(req)]
        assert any(isinstance(ev, AudioChunk) for ev in events) and isinstance(events[-1], RequestFinished)
        gate.set()
        assert await asyncio.to_thread(state.engine.core.graph_capturer.wait, 10)
        assert "\ncosyserve_graphs_pending 0.0" in state.metrics.render().decode()
        await state.stop(drain_timeout=0)

    asyncio.run(main())


@torch.inference_mode()
def test_decoder_runs_eagerly_until_published_then_replays(model, monkeypatch):
    """The LM decode step through :class:`GraphedDecoder`: a bucket not captured (background
    capture owns it) runs the same slot-ordered step eagerly; once published, the replay gives
    the same log-probabilities (CPU, stand-in recording)."""
    from cosyserve.models.llm import KVCache

    monkeypatch.setattr(G, "_record", fake_record)
    lm = model.llm
    lm.setup_rope(512)
    cache = KVCache.allocate(lm, 5, 512)
    prefixes = [lm.embed_prefix(torch.randint(0, 1000, (n,)), torch.zeros(0, dtype=torch.long),
                                torch.randint(0, 6561, (20 + n,))) for n in (5, 17)]
    for i, p in enumerate(prefixes):
        lm.forward_cached(p[None], cache, torch.tensor([i]), torch.tensor([0]))
    eager_cache = KVCache(cache.k.clone(), cache.v.clone())
    dec = G.GraphedDecoder(lm, cache, 4)
    dec.capture_on_use = False  # as under a BackgroundCapturer
    lens = torch.tensor([p.shape[0] for p in prefixes])
    slots = torch.tensor([1, 0])  # results in the order asked for
    for step in range(3):
        if step == 2:  # published between two steps
            dec.capture((2, 256), background=True)
            assert (2, 256) in dec._graphs
        toks = torch.randint(0, 6561, (2,))
        start = lens[[1, 0]] + step
        got = dec(toks, slots, start)
        ref = lm.logprobs(lm.forward_cached(lm.embed_speech(toks[:, None]), eager_cache, slots, start)[:, -1])
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-5), step
    assert dec._graphs[(2, 256)][0].replays == 1


def test_fused_op_runs_eagerly_while_another_thread_traces(monkeypatch):
    """torch's FX-tracing flag is process-wide: while one thread compiles (traces), a compiled op called
    in another thread raises. FusedOp then runs the eager formula for that call and stays usable."""
    import torch.fx._symbolic_trace as st

    from cosyserve.models import fused

    calls = []

    def compiled(*args):
        calls.append("compiled")
        if st._is_fx_tracing_flag:
            raise RuntimeError("Detected that you are using FX to symbolically trace a dynamo-optimized function.")
        return args[0] * 2

    op = fused.FusedOp(lambda x: x * 2, "double")
    op._compiled = compiled
    x = torch.ones(3)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(st, "_is_fx_tracing_flag", True)
    assert torch.equal(op(x), x * 2) and calls == [] and not op._broken  # checked before the call
    monkeypatch.setattr(fused, "_other_thread_tracing", lambda: False)  # the flag set during the call
    assert torch.equal(op(x), x * 2) and calls == ["compiled"] and not op._broken
    monkeypatch.setattr(st, "_is_fx_tracing_flag", False)
    assert torch.equal(op(x), x * 2) and calls == ["compiled"] * 2 and op.compiled


def test_capture_thread_alone_compiles_fused_kernels_while_it_runs():
    """From start() until the capture thread ends, only that thread may compile / run compiled fused
    kernels (fused.compile_only_on); afterwards every thread does again, however fast it ended."""
    from cosyserve.models import fused

    seen, gate = [], {(2,): threading.Event()}

    class Watching(FakeStage):
        def _warm_up(self, *key):
            seen.append(fused._compile_thread == threading.get_ident())
            super()._warm_up(*key)

    st = Watching("s", [(1,), (2,)], gate=gate)
    cap = G.BackgroundCapturer([[st]], prime=False)
    cap.start()
    try:
        assert fused._compile_thread is not None and fused._compile_thread != threading.get_ident()
    finally:
        gate[(2,)].set()
    assert cap.wait(10)
    assert seen and all(seen) and fused._compile_thread is None
    empty = G.BackgroundCapturer([[FakeStage("e", [])]], prime=False)  # nothing to capture: ends at once
    empty.start()
    assert empty.wait(10) and fused._compile_thread is None


def test_capture_thread_shortens_the_gil_switch_interval_while_it_runs():
    """While the capture thread runs, a serving thread that released the GIL gets it back within
    BackgroundCapturer.switch_interval_s, not the interpreter's 5 ms; the setting is restored after."""
    import sys

    outer = sys.getswitchinterval()
    sys.setswitchinterval(5e-3)  # the interpreter's default (an earlier test may have shortened it)
    seen = []

    class Watching(FakeStage):
        def _warm_up(self, *key):
            seen.append(sys.getswitchinterval())
            super()._warm_up(*key)

    try:
        st = Watching("s", [(1,), (2,)])
        cap = G.BackgroundCapturer([[st]], prime=False)
        cap.start()
        assert cap.wait(10)
        # (the interpreter stores whole microseconds: 2e-4 reads back as 1.9999...e-4; the restore compares
        # with the value read back, which an exact comparison with 2e-4 kept from ever happening)
        want = G.BackgroundCapturer.switch_interval_s
        assert len(seen) == 2 and all(v == pytest.approx(want, abs=1e-6) for v in seen)
        assert sys.getswitchinterval() == 5e-3
    finally:
        sys.setswitchinterval(outer)


def test_buckets_serving_runs_eagerly_are_captured_first():
    """A bucket the serving thread looked up (and ran eagerly) while it was pending is captured
    before the rest of the plan; a stage with ``demand_first`` False keeps its planned order."""
    log = []
    gate, entered = {(1,): threading.Event()}, threading.Event()

    class Signalling(FakeStage):
        def _warm_up(self, *key):
            entered.set()
            super()._warm_up(*key)

    st = Signalling("s", [(1,), (2,), (3,), (4,)], gate=gate, log=log)
    planned = FakeStage("p", [(1,), (2,), (3,)], log=log)
    planned.demand_first = False
    cap = G.BackgroundCapturer([[st], [planned]], prime=False)
    cap.start()
    try:
        assert entered.wait(10)  # the capture of (1,), first in the plan, is under way
        assert st.lookup((3,)) is None and st.lookup((3,)) is None  # eager meanwhile, counted
        assert st.lookup((2,)) is None
        assert planned.lookup((3,)) is None
    finally:
        gate[(1,)].set()
    assert cap.wait(10)
    assert [k for name, k, *_ in log if name == "s"] == [(1,), (3,), (2,), (4,)]  # (1,) was under way
    assert [k for name, k, *_ in log if name == "p"] == [(1,), (2,), (3,)]
    assert cap.demanded == 2 and st.misses[(3,)] == 2

"""Issue 17 (UNet path): prefixed flow solves in fixed shapes (:mod:`cosyserve.models.flow_prefix`).

A non-final streaming call solves only the frames after its voice's prompt prefix, read from a
fixed-capacity device pool through index tensors (the form a CUDA graph can capture). Checked here:
every streaming call of the reference stream cases against upstream's mel (PARITY_TOL) from a prefix the
call's own prompt built; prefixed calls against uncached ones over long streams under both schedules and
in one batch that mixes two voices (prefixes of different lengths in different slots), a streaming row
without prefix and a final (non-streaming) row (SELF_TOL); the pool's layout and its errors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _reference import PARITY_TOL, SELF_TOL, WAVE_TOL, meta, rel_l2, tensors
from cosyserve.engine.chunking import ChunkPolicy
from cosyserve.models.flow import FlowStreamCache
from cosyserve.models.flow_prefix import PrefixPool, context_width
from test_flow_stream_cache import STREAM_CASES, _calls, _long_stream, _run, _tokens, flow, prompt  # noqa: F401


def _prefix(flow, prompt, seed: int = 99):
    """The voice's prompt prefix (an EstimatorStreamCache), built as the engine builds it: a stream's first
    streaming call (other tokens than the ones checked) with its commit limited to the prefix's frames."""
    frames = flow.prompt_prefix_frames(prompt[0].shape[1])
    assert frames > 0
    builder = FlowStreamCache()
    builder.commit_limit = frames
    _run(flow, [_long_stream(flow, 20, seed)], prompt, [True], [False], caches=[builder])
    assert builder.frames == frames
    return builder.estimator


def _prefixed(flow, pool, items):
    """``items``: (tokens, prompt, finalize, slot, start) -> the mels of one prefixed batch."""
    inputs = flow.prepare([t for t, *_ in items], [p[0] for _, p, *_ in items], [p[1] for _, p, *_ in items],
                          torch.cat([p[2] for _, p, *_ in items]), [not f for _, _, f, _, _ in items],
                          [f for _, _, f, _, _ in items])
    run = flow.start_prefixed(inputs, pool, [s for *_, s, _ in items], [s for *_, s in items])
    while run.steps_left:
        run.step()
    assert int(run.state.plan.step) == run.state.n  # the device step counter advanced once per step
    return run.mels()


def _pool(flow, slots: int = 3, extra_chunks: int = 2, frames: int | None = None):
    chunk = flow.decoder.estimator.cfg.static_chunk_size
    return PrefixPool.for_flow(flow, slots, (frames or 0) + extra_chunks * chunk)


def test_pool_layout_matches_the_stream_cache(flow, prompt):
    est = _prefix(flow, prompt)
    assert est.contexts.size(-1) == context_width(flow.decoder.estimator)
    pool = _pool(flow, frames=est.frames)
    pool.put(1, est)
    s = est.frames
    assert pool.frames == [0, s, 0]
    assert torch.equal(pool.keys[1, ..., :s, :], est.keys) and torch.equal(pool.values[1, ..., :s, :], est.values)
    assert not pool.keys[1, ..., s:, :].any() and not pool.keys[0].any()  # zero past the prefix, other slots
    per_frame = flow.cfg.cfm.n_timesteps * flow.decoder.estimator.stream_cache_values_per_frame()
    assert pool.keys.numel() + pool.values.numel() == 3 * pool.max_frames * per_frame
    pool.clear(1)
    assert pool.frames[1] == 0 and not pool.keys[1].any()
    with pytest.raises(ValueError, match="exceeds"):
        PrefixPool.for_flow(flow, 1, s - 1).put(0, est)
    with pytest.raises(ValueError, match="out of range"):
        pool.put(3, est)
    from cosyserve.models.flow_estimator import EstimatorStreamCache
    with pytest.raises(ValueError, match="empty"):
        pool.put(0, EstimatorStreamCache())


@pytest.mark.parity
@pytest.mark.parametrize("name", STREAM_CASES)
def test_reference_stream_calls_from_a_prefix(flow, name):
    t = tensors(name)
    voice = (t["prompt_token"], t["prompt_feat"], t["embedding"])
    est = _prefix(flow, voice)
    pool = _pool(flow, slots=2, frames=est.frames)
    pool.put(1, est)
    tokens = _tokens(name)
    used = 0
    for i, c in enumerate(meta(name)["chunks"]):
        final = bool(c["finalize"])
        start = est.frames if c["streaming"] and not final else 0
        got = _prefixed(flow, pool, [(tokens[:, : int(c["n_tokens"])], voice, final, 1, start)])[0]
        ref = t[f"c{i}_flow_mel"]
        assert got.shape == ref.shape  # the prefix lies in the prompt: every non-prompt frame is returned
        err = rel_l2(got, ref)
        print(f"{name} call {i}: prefix {start} frames, rel L2 {err:.2e}")
        assert err <= PARITY_TOL
        used += start > 0
    assert used >= 1


@pytest.mark.parametrize("spec", ["upstream", "exponential"])
def test_prefixed_stream_equals_uncached(flow, prompt, spec):
    est = _prefix(flow, prompt)
    pool = _pool(flow, frames=est.frames)
    pool.put(2, est)
    tokens = _long_stream(flow, 300, seed=23)
    calls = _calls(ChunkPolicy.parse(spec, lookahead=flow.pre_lookahead_len), prompt[0].shape[1], 300)
    assert len(calls) >= 4
    for end, final in calls:
        full = _run(flow, [tokens[:, :end]], prompt, [not final], [final])[0]
        got = _prefixed(flow, pool, [(tokens[:, :end], prompt, final, 2, 0 if final else est.frames)])[0]
        assert got.shape == full.shape
        assert rel_l2(got, full) <= SELF_TOL, (spec, end, final)


def test_mixed_batch_two_voices(flow, prompt):
    """One batch: voice A's streams from slot 0 (two lengths), voice B (a shorter prompt: a shorter prefix)
    from slot 2, a streaming row of A without prefix, a final row of B; each equals its uncached call."""
    chunk = flow.decoder.estimator.cfg.static_chunk_size
    n_b = prompt[0].shape[1] - chunk // flow.token_mel_ratio
    voice_b = (prompt[0][:, :n_b], prompt[1][:, : flow.token_mel_ratio * n_b], prompt[2] * 0.5)
    est_a, est_b = _prefix(flow, prompt), _prefix(flow, voice_b)
    assert est_b.frames < est_a.frames
    pool = _pool(flow, frames=est_a.frames)
    pool.put(0, est_a)
    pool.put(2, est_b)
    s1, s2, s3, s4 = (_long_stream(flow, n, seed) for n, seed in ((40, 1), (90, 2), (60, 3), (70, 4)))
    items = [(s1, prompt, False, 0, est_a.frames), (s2, prompt, False, 0, est_a.frames),
             (s3, voice_b, False, 2, est_b.frames), (s4, prompt, False, 1, 0), (s2[:, :50], voice_b, True, 2, 0)]
    got = _prefixed(flow, pool, items)
    for g, (tok, voice, final, _, _) in zip(got, items):
        full = _run(flow, [tok], voice, [not final], [final])[0]
        assert g.shape == full.shape
        assert rel_l2(g, full) <= SELF_TOL


def test_inconsistent_prefix_arguments_are_rejected(flow, prompt):
    est = _prefix(flow, prompt)
    pool = _pool(flow, frames=est.frames)
    pool.put(0, est)
    tok = _long_stream(flow, 40, 7)
    with pytest.raises(ValueError, match="slot 1 holds 0"):
        _prefixed(flow, pool, [(tok, prompt, False, 1, est.frames)])
    with pytest.raises(ValueError, match="holds"):
        _prefixed(flow, pool, [(tok, prompt, False, 0, est.frames - 1)])
    with pytest.raises(ValueError, match="cannot start from a prefix"):
        _prefixed(flow, pool, [(tok, prompt, True, 0, est.frames)])  # a final (non-streaming) call
    inputs = flow.prepare([tok], [prompt[0]], [prompt[1]], prompt[2], [True], [False])
    with pytest.raises(ValueError, match="prefix slots"):
        flow.start_prefixed(inputs, pool, [0, 0], [0])


# ---------------------------------------------------------------------------------------
# engine: --flow-stream-cache prefix


def _engine_audio(syn, voices, texts, config, seed0: int):
    from cosyserve.engine.chunking import ChunkPolicy as Policy
    from cosyserve.engine.request import AudioChunk, SynthesisParams

    engine = syn.new_engine(config)
    for i, (t, v) in enumerate(zip(texts, voices)):
        p = SynthesisParams(seed=seed0 + i, stream=True, min_token_text_ratio=6, max_token_text_ratio=7,
                            chunk_policy=Policy.parse("exponential"))
        engine.add_request(syn.build_request(t, v, p, request_id=f"r{i}"))
    chunks = {f"r{i}": [] for i in range(len(texts))}
    while engine.has_work():
        for ev in engine.step():
            if isinstance(ev, AudioChunk):
                chunks[ev.request_id].append(ev.samples)
    engine.close()
    return engine, {k: np.concatenate(v) for k, v in chunks.items()}


def _spy_prefix_starts(monkeypatch, flow) -> list:
    """The list that collects, per ``flow.start_prefixed`` call (spied on), each row's prefix frames."""
    calls = []
    real = flow.start_prefixed

    def spy(inputs, pool, slots, starts, n_timesteps=None):
        calls.append(list(starts))
        return real(inputs, pool, slots, starts, n_timesteps)

    monkeypatch.setattr(flow, "start_prefixed", spy)
    return calls


@pytest.mark.parametrize("build", ["engine", "background"])
def test_engine_prompt_prefixes_equal_full_recomputation(monkeypatch, build):
    """``flow_stream_cache="prefix"``: the non-final chunks of three streams of a voice start from its prefix
    (built once, on the engine thread or on the pool's worker thread), no stream keeps a cache, the capacity
    model is told each batch's flow input less what the prefixes spared, and the audio equals the engine
    without caches."""
    from cosyserve.engine.core import EngineConfig
    from test_flow_stream_cache import _engine_setup

    syn, voice, texts, _ = _engine_setup(monkeypatch)
    voices = [voice, voice, voice]
    texts3 = texts + ["One more sentence for the third stream."]
    calls = _spy_prefix_starts(monkeypatch, syn.models.flow)
    # what the capacity model is told: each batch's cost units are the flow input its jobs solved
    from cosyserve.engine.admission import CapacityEstimator
    from cosyserve.engine.token2wav import Token2Wav

    inputs, saved, costs = [], [], []
    launch, finish, observe = Token2Wav.launch, Token2Wav.finish, CapacityEstimator.observe_t2w

    def spy_launch(self, jobs, *a, **kw):
        inputs.append(sum(int(j.voice.flow_speech_token.numel()) + len(j.tokens) for j in jobs))
        return launch(self, jobs, *a, **kw)

    def spy_finish(self, pending):
        out = finish(self, pending)
        saved.append([r.saved_tokens for r in out])
        return out

    def spy_observe(self, *a, cost=None, start=None):
        costs.append(cost)
        return observe(self, *a, cost=cost, start=start)

    monkeypatch.setattr(Token2Wav, "launch", spy_launch)
    monkeypatch.setattr(Token2Wav, "finish", spy_finish)
    monkeypatch.setattr(CapacityEstimator, "observe_t2w", spy_observe)
    engine, got = _engine_audio(syn, voices, texts3, EngineConfig(max_active=3, max_queue=4, flow_stream_cache="prefix",
                                                                  flow_prefix_build=build), 60)
    frames = syn.models.flow.prompt_prefix_frames(int(voice.flow_speech_token.numel()))
    pp = engine.t2w.prefix_pool
    assert pp is not None and pp.background == (build == "background") and not engine._flow_stream_cache
    assert calls and all(s in (0, frames) for c in calls for s in c)
    ratio = syn.models.flow.token_mel_ratio
    assert sorted(n for b in saved for n in b if n) == sorted([frames // ratio] * sum(s > 0 for c in calls for s in c))
    assert costs == [i - sum(b) for i, b in zip(inputs, saved)]  # flow input less what the prefixes spared
    if build == "engine":  # built inline at the first later chunk after two starts: every later chunk reads it
        assert pp.builds == 1 and pp.hits >= 2 and sum(s > 0 for c in calls for s in c) >= 3
        assert engine.capacity_model.start_cost_ratio < 1  # the first chunks, from a prefix, solve few frames
    else:  # the same build, on the worker thread; the chunks run whole until a batch finds it done
        pp.wait_builds(60)
        pp.assign([])
        assert pp.builds == 1 and pp.building >= 1 and not pp._pending
    _, ref = _engine_audio(syn, voices, texts3, EngineConfig(max_active=3, max_queue=4, flow_stream_cache=False), 60)
    for k in ref:
        assert got[k].shape == ref[k].shape
        assert rel_l2(torch.from_numpy(got[k]), torch.from_numpy(ref[k])) <= WAVE_TOL


def test_engine_prebuilds_known_voices_prefixes(monkeypatch):
    """``prebuild_prompt_prefixes`` (a server's known voices at start-up): the engine thread builds them before
    its next step, so the first stream of such a voice starts its later chunks from the prefix without a build
    of its own (one stream: a voice not prebuilt would get none), with the audio of the engine without caches;
    a second prebuild of the same voice builds nothing; with prefix mode off nothing is queued."""
    from cosyserve.engine.core import EngineConfig
    from test_flow_stream_cache import _engine_setup

    syn, voice, texts, _ = _engine_setup(monkeypatch)
    engine = syn.new_engine(EngineConfig(max_active=2, flow_stream_cache="prefix"))
    try:
        pp = engine.t2w.prefix_pool
        assert engine.prebuild_prompt_prefixes([voice, voice]) and engine.has_work()
        engine.step()
        assert pp.builds == 1 and not engine.has_work()
        assert engine.prebuild_prompt_prefixes([voice])
        engine.step()
        assert pp.builds == 1  # already there
    finally:
        engine.close()
    off = syn.new_engine(EngineConfig(max_active=2, flow_stream_cache=False))
    try:
        assert not off.prebuild_prompt_prefixes([voice]) and not off.has_work()
    finally:
        off.close()

    calls = _spy_prefix_starts(monkeypatch, syn.models.flow)
    from cosyserve.engine.core import EngineCore

    made = []
    new_engine = syn.new_engine

    def prebuilt(config, **kw):  # the engine _engine_audio makes, with the voice prebuilt as a server does
        eng = new_engine(config, **kw)
        assert eng.prebuild_prompt_prefixes([voice])
        made.append(eng)
        return eng

    monkeypatch.setattr(syn, "new_engine", prebuilt)
    engine, got = _engine_audio(syn, [voice], texts[:1], EngineConfig(max_active=2, flow_stream_cache="prefix"), 70)
    assert isinstance(engine, EngineCore) and made == [engine]
    pp = engine.t2w.prefix_pool
    frames = syn.models.flow.prompt_prefix_frames(int(voice.flow_speech_token.numel()))
    assert pp.builds == 1 and pp.hits >= 1 and pp.deferred == 0  # built before the stream, not by it
    assert calls and calls[0] == [frames]  # even the first chunk started from the prefix
    monkeypatch.setattr(syn, "new_engine", new_engine)
    _, ref = _engine_audio(syn, [voice], texts[:1], EngineConfig(max_active=2, flow_stream_cache=False), 70)
    assert got["r0"].shape == ref["r0"].shape
    assert rel_l2(torch.from_numpy(got["r0"]), torch.from_numpy(ref["r0"])) <= WAVE_TOL


def test_voice_prefix_pool_slots_are_shared_and_recycled(flow, prompt):
    """One slot, two voices: a batch's second voice runs without prefix (its slot is read by the first);
    the next batch of the second voice evicts the first; a stream's first chunk (token offset 0) uses a prefix
    but never builds one, and a later chunk builds one only once two streams of its voice have started (a
    per-request prompt never pays the build); a voice whose prompt has no complete chunk never gets one;
    non-streaming, final and stream-cached jobs get none."""
    from types import SimpleNamespace

    from cosyserve.engine.token2wav import VoicePrefixPool

    chunk = flow.decoder.estimator.cfg.static_chunk_size
    n_b = prompt[0].shape[1] - chunk // flow.token_mel_ratio

    def voice(tok, feat, emb):
        return SimpleNamespace(flow_speech_token=tok[0], speech_feat=feat, flow_embedding=emb[0])

    va = voice(*prompt)
    vb = voice(prompt[0][:, :n_b], prompt[1][:, : flow.token_mel_ratio * n_b], prompt[2] * 0.5)
    vs = voice(prompt[0][:, :4], prompt[1][:, :8], prompt[2])  # no complete chunk in the prompt

    def job(v, streaming=True, finalize=False, cache=None, offset=15):
        return SimpleNamespace(voice=v, streaming=streaming, finalize=finalize, flow_cache=cache, token_offset=offset)

    pp = VoicePrefixPool(flow, 1, 6 * chunk)
    fa, fb = flow.prompt_prefix_frames(int(va.flow_speech_token.numel())), \
        flow.prompt_prefix_frames(int(vb.flow_speech_token.numel()))
    assert pp.assign([job(va, offset=0)]) == ([0], [0]) and pp.builds == 0  # a first chunk does not wait
    # one stream of a voice started: its later chunk builds nothing (a per-request prompt would pay the eager
    # build for nothing); this batch's first chunk of a second stream counts before the later chunk is assigned
    assert pp.assign([job(va)]) == ([0], [0]) and pp.builds == 0 and pp.deferred == 1
    assert pp.assign([job(va), job(vb), job(va, offset=0)]) == ([0, 0, 0], [fa, 0, fa])
    assert pp.builds == 1 and pp.hits == 1
    assert pp.assign([job(vb)]) == ([0], [0]) and pp.builds == 1  # vb: no stream of it started yet
    assert pp.assign([job(vb, offset=0)]) == ([0], [0]) and pp.assign([job(vb, offset=0)]) == ([0], [0])
    assert pp.assign([job(vb)]) == ([0], [fb]) and pp.builds == 2
    assert pp.assign([job(va)]) == ([0], [fa]) and pp.builds == 3
    # prebuild (a server's known voices at start-up): into free slots only, the voice then counted as reused
    p2 = VoicePrefixPool(flow, 2, 6 * chunk)
    assert p2.prebuild([vs, va, vb, va]) == 2 and p2.builds == 2  # vs: no complete chunk; va once
    assert p2.prebuild([voice(prompt[0], prompt[1], prompt[2] * 0.25)]) == 0  # no free slot left
    assert p2.assign([job(va, offset=0), job(vb, offset=0)]) == ([0, 1], [fa, fb]) and p2.builds == 2
    assert pp.assign([job(vs), job(va, False), job(va, True, True), job(va, cache=object())]) == \
        ([0, 0, 0, 0], [0, 0, 0, 0])
    assert pp.nbytes() == pp.pool.nbytes() > 0
    from cosyserve.errors import SettingsError

    with pytest.raises(SettingsError, match="at least one chunk"):  # a CosyServeError: a one-line CLI message
        VoicePrefixPool(flow, 1, chunk - 1)


def test_voice_prefix_pool_builds_on_a_worker_thread(flow, prompt, caplog):
    """``background=True``: a later chunk that needs its voice's prefix starts the build on the pool's worker
    thread and runs without prefix (as do the voice's chunks while it runs); the next batch after it is done
    reads the prefix — the same as an inline build's. One build at a time, into a reserved slot (with one slot
    the evicted voice gets none meanwhile); a build that raises is logged and leaves its voice without prefix,
    other voices unharmed."""
    import threading
    from types import SimpleNamespace

    from cosyserve.engine.token2wav import VoicePrefixPool

    chunk = flow.decoder.estimator.cfg.static_chunk_size
    n_b = prompt[0].shape[1] - chunk // flow.token_mel_ratio

    def voice(tok, feat, emb):
        return SimpleNamespace(flow_speech_token=tok[0], speech_feat=feat, flow_embedding=emb[0])

    def job(v, offset=15):
        return SimpleNamespace(voice=v, streaming=True, finalize=False, flow_cache=None, token_offset=offset)

    va = voice(*prompt)
    vb = voice(prompt[0][:, :n_b], prompt[1][:, : flow.token_mel_ratio * n_b], prompt[2] * 0.5)
    vc = voice(prompt[0], prompt[1], prompt[2] * 0.25)
    fa, fb = (flow.prompt_prefix_frames(int(v.flow_speech_token.numel())) for v in (va, vb))
    inline = VoicePrefixPool(flow, 1, 6 * chunk)
    inline.prebuild([va])
    pp = VoicePrefixPool(flow, 1, 6 * chunk, background=True)
    pp.build_duty = 1.0  # (the next build may start as soon as one is done)
    gate, threads = threading.Event(), []
    build = pp._build

    def gated(slot, v):
        threads.append(threading.current_thread().name)
        assert gate.wait(30)
        if v is vc:
            raise RuntimeError("device fault")
        return build(slot, v)

    pp._build = gated
    try:
        for v in (va, vb, vc):
            assert pp.assign([job(v, 0), job(v, 0)]) == ([0, 0], [0, 0])  # two streams of each started
        assert pp.assign([job(va)]) == ([0], [0]) and pp.builds == 0 and pp.building == 1  # build started
        assert pp.assign([job(va), job(vb)]) == ([0, 0], [0, 0]) and pp.building == 3  # va under way, vb waits
        gate.set()
        pp.wait_builds(60)
        assert pp.assign([job(va)]) == ([0], [fa]) and pp.builds == 1 and threads == ["cosyserve-prefix_0"]
        for name in ("keys", "values", "contexts"):
            assert torch.equal(getattr(pp.pool, name)[0], getattr(inline.pool, name)[0])
        assert pp.assign([job(vb)]) == ([0], [0]) and pp.builds == 1  # evicts va (one slot), builds vb
        assert pp.assign([job(va)]) == ([0], [0])  # va's slot is vb's now, its build under way
        pp.wait_builds(60)
        assert pp.assign([job(vb)]) == ([0], [fb]) and pp.builds == 2
        assert pp.assign([job(vc)]) == ([0], [0])  # evicts vb; this build raises
        pp.wait_builds(60)
        with caplog.at_level("WARNING", logger="cosyserve.engine.token2wav"):
            assert pp.assign([job(vc)]) == ([0], [0]) and pp.builds == 2
        assert "build for voice ? failed (RuntimeError: device fault)" in caplog.text
        assert pp.assign([job(vc)]) == ([0], [0]) and not pp._pending  # never tried again
        assert pp.assign([job(va)]) == ([0], [0])  # va builds again into the free slot ...
        pp.wait_builds(60)
        pp.build_duty = 1e-9  # builds may take a negligible share of the time: the next waits (for ever here)
        assert pp.assign([job(va)]) == ([0], [fa]) and pp.builds == 3  # ... and is read
        assert pp.assign([job(vb)]) == ([0], [0]) and not pp._pending
    finally:
        gate.set()
        pp.close()


def test_auto_mode_is_prefix_with_cuda_graphs(monkeypatch):
    """``flow_stream_cache`` auto (None) resolves per engine: per-stream caches where the flow runs eagerly (this
    CPU engine: no prefix pool), ``"prefix"`` for the CosyVoice2 U-Net with CUDA graphs (the server's default on a
    GPU since session 40), an explicit mode kept; the server prebuilds prefixes by the engine's resolved mode."""
    from cosyserve.engine.core import EngineConfig
    from test_flow_stream_cache import _engine_setup

    syn, _, _, _ = _engine_setup(monkeypatch)
    engine = syn.new_engine(EngineConfig(max_active=1))
    try:
        assert engine.cfg.flow_stream_cache is True and engine._flow_stream_cache
        assert engine.t2w.prefix_pool is None
        assert engine._resolve_flow_stream_cache(EngineConfig(), graphed=True).flow_stream_cache == "prefix"
        assert engine._resolve_flow_stream_cache(EngineConfig(), graphed=False).flow_stream_cache is True
        for mode in (True, False, "prefix"):
            cfg = EngineConfig(flow_stream_cache=mode)
            assert engine._resolve_flow_stream_cache(cfg, graphed=True).flow_stream_cache == mode
    finally:
        engine.close()


def test_cli_prefix_flag():
    import argparse

    from cosyserve import cli

    p = argparse.ArgumentParser()
    cli._engine_args(p)
    cfg = cli._engine_config(p.parse_args(["--flow-stream-cache", "prefix", "--flow-prefix-slots", "2"]))
    assert cfg.flow_stream_cache == "prefix" and cfg.flow_prefix_slots == 2
    assert cli._engine_config(p.parse_args([])).flow_prefix_slots == 4
    with pytest.raises(SystemExit):
        p.parse_args(["--flow-prefix-slots", "0"])


# ---------------------------------------------------------------------------------------
# the CUDA-graph form, run eagerly: encoder bucket -> fixed buffers -> solver bucket


def test_fixed_buffer_halves_equal_uncached(flow, prompt):
    """:func:`prefix_encode_into` over a padded encoder bucket (more rows and tokens than the batch) and
    :func:`prefix_begin_from_fixed` over a padded solver bucket, with the fixed buffers holding another
    batch's leftovers: each item's mel equals its uncached call (what the captured graphs will replay)."""
    from cosyserve.models.graphs import (GraphedFlow, SharedBuffers, fill_flow_buffers, fill_prefix_rows, flow_buffers,
                                         prefix_begin_from_fixed, prefix_encode_into, prefix_fixed_buffers,
                                         shared_solver_state)

    est = _prefix(flow, prompt)
    pool = _pool(flow, frames=est.frames)
    pool.put(1, est)
    ratio = flow.token_mel_ratio
    items = [(_long_stream(flow, 40, 11), False, 1, est.frames), (_long_stream(flow, 75, 12), False, 1, est.frames),
             (_long_stream(flow, 30, 13), False, 0, 0), (_long_stream(flow, 55, 14), True, 0, 0)]
    inputs = flow.prepare([t for t, *_ in items], [prompt[0]] * 4, [prompt[1]] * 4, torch.cat([prompt[2]] * 4),
                          [not f for _, f, _, _ in items], [f for _, f, _, _ in items])
    bb, lb = 6, inputs.ids.shape[1] + 20  # bucket padding: two idle rows, 20 more tokens
    bufs = flow_buffers(flow, bb, lb, "cpu")
    fill_flow_buffers(bufs, inputs, ratio)
    fixed = prefix_fixed_buffers(flow, 8, ratio * lb + 64, "cpu")
    fixed["mu"].fill_(7.0)  # another batch's leftovers: read only where masked
    fixed["cond"].fill_(-3.0)
    prefix_encode_into(flow, bufs, fixed)
    fill_prefix_rows(fixed, [s for *_, s, _ in items], [s for *_, s in items])
    new = [m - s for m, (*_, s) in zip(inputs.mel_lengths, items)]
    nb = max(new) + 16
    # the solver state in shared buffers sized by a larger bucket, as the captured begin graph leaves it
    shared = SharedBuffers(bb * (nb + 64), "cpu")
    big = prefix_begin_from_fixed(flow, fixed, pool, bb, nb + 64)
    for name, t in GraphedFlow._state_buffers(big).items():
        shared.take(name, t.shape, t.dtype, bb * (nb + 64)).fill_(5.0)  # leftovers of that bucket
    state = shared_solver_state(prefix_begin_from_fixed(flow, fixed, pool, bb, nb), shared, bb * nb)
    assert state.plan.bias.data_ptr() == shared.take("bias", (1,), state.plan.bias.dtype, 1).data_ptr()
    for _ in range(state.n):
        flow.decoder.step(state)
    mel = state.mels()
    for b, (tok, final, _, s) in enumerate(items):
        full = _run(flow, [tok], prompt, [not final], [final])[0]
        p, n = inputs.prompt_frames[b], inputs.mel_lengths[b]
        got = mel[b:b + 1, :, max(p, s) - s:n - s]
        assert got.shape == full.shape
        assert rel_l2(got, full) <= SELF_TOL, b


def test_graphed_prefix_flow_grids(flow, prompt):
    """The two stages' grids (built on CPU, nothing captured): the solver's frame buckets are the encoder's
    token buckets x ``token_mel_ratio`` with the same rows, every encoder bucket has its solver bucket, and a
    batch past the grids is left to the eager path (None)."""
    from cosyserve.models.graphs import GraphedFlow, GraphedPrefixFlow

    est = _prefix(flow, prompt)
    pool = _pool(flow, frames=est.frames)
    token_grid = GraphedFlow(flow, 8, max_tokens=256, max_area=1024, max_quad=1024 * 512).grid
    g = GraphedPrefixFlow(flow, pool, token_grid)
    ratio = flow.token_mel_ratio
    assert g.encoder.grid is token_grid
    assert g.solver.grid.batches == g.encoder.grid.batches
    assert g.solver.grid.lengths == [ratio * n for n in g.encoder.grid.lengths]
    assert {(b, ratio * n) for b, n in g.encoder.keys()} == set(g.solver.keys())
    assert g.fixed["mu"].shape == (8, flow.n_mels, ratio * g.encoder.grid.lengths[-1])
    assert g.stages == [g.encoder, g.solver]
    long = _long_stream(flow, 300, 3)  # 300 tokens + the prompt: past max_tokens
    inputs = flow.prepare([long], [prompt[0]], [prompt[1]], prompt[2], [True], [False])
    assert g.start(inputs, [1], [est.frames]) is None


# ---------------------------------------------------------------------------------------
# CUDA (run on the GPU machine): the captured halves equal the eager prefixed solve and the uncached one


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphed_prefix_flow(flow, prompt, dtype):
    import copy

    from cosyserve.models.graphs import GraphedFlow, GraphedPrefixFlow

    model = copy.deepcopy(flow).to("cuda", dtype)
    est = _prefix(model, prompt)
    pool = _pool(model, frames=est.frames)
    pool.put(1, est)
    items = [(_long_stream(model, 40, 21), prompt, False, 1, est.frames),
             (_long_stream(model, 80, 22), prompt, False, 1, est.frames),
             (_long_stream(model, 35, 23), prompt, False, 0, 0), (_long_stream(model, 60, 24), prompt, True, 0, 0)]
    eager = _prefixed(model, pool, items)
    model.prefix_graph = GraphedPrefixFlow(model, pool, GraphedFlow(model, 8, max_tokens=512).grid)
    graphed = _prefixed(model, pool, items)  # buckets captured on first use
    assert len(model.prefix_graph.encoder._graphs) == 1 and len(model.prefix_graph.solver._graphs) == 1
    again = _prefixed(model, pool, items)  # replayed
    # against the uncached solve: other shapes, other cuBLAS/cuDNN kernels (session 36: 1.09e-5 in float32)
    tol = PARITY_TOL if dtype == torch.float32 else 2e-2
    for e, g, a, (tok, voice, final, _, _) in zip(eager, graphed, again, items):
        assert rel_l2(g.cpu(), e.cpu()) <= SELF_TOL and torch.equal(g.cpu(), a.cpu())
        full = _run(model, [tok], voice, [not final], [final])[0]
        assert rel_l2(g.cpu(), full.cpu()) <= tol


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_background_build_is_ordered_with_the_callers_stream(flow, prompt):
    """On CUDA a background build (the pool's worker thread and CUDA stream) starts only after the work the
    caller's stream had issued when the build was asked for — here a long sleep, then NaNs written into the slot
    the build fills (a batch still reading the evicted voice's slot would be such work) — and a batch issued on
    the caller's stream right after :meth:`VoicePrefixPool.assign` took the build in reads the finished prefix:
    the slot equals an inline build's and the prefixed solve equals one from the inline pool."""
    import copy
    from types import SimpleNamespace

    from cosyserve.engine.token2wav import VoicePrefixPool

    model = copy.deepcopy(flow).to("cuda", torch.float32)
    chunk = model.decoder.estimator.cfg.static_chunk_size
    voice = SimpleNamespace(flow_speech_token=prompt[0][0], speech_feat=prompt[1], flow_embedding=prompt[2][0])

    def job(offset=15):
        return SimpleNamespace(voice=voice, streaming=True, finalize=False, flow_cache=None, token_offset=offset)

    inline = VoicePrefixPool(model, 1, 6 * chunk)
    assert inline.prebuild([voice]) == 1
    pp = VoicePrefixPool(model, 1, 6 * chunk, background=True)
    pp.build_duty = 1.0
    side = torch.cuda.Stream()
    try:
        with torch.cuda.stream(side):
            assert pp.assign([job(0), job(0)]) == ([0, 0], [0, 0])
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the caller's stream
            for t in (pp.pool.keys, pp.pool.values, pp.pool.contexts):
                t[0].fill_(float("nan"))
            assert pp.assign([job()]) == ([0], [0]) and pp._pending  # the build starts on the worker
            pp.wait_builds(120)  # (its work issued; the device may still run it)
            slots, starts = pp.assign([job()])
            frames = inline.pool.frames[0]
            assert (slots, starts) == ([0], [frames]) and pp.builds == 1
            items = [(_long_stream(model, 40, 31), prompt, False, 0, frames)]
            got = _prefixed(model, pp.pool, items)[0]  # issued at once on the caller's stream
        side.synchronize()
        for name in ("keys", "values", "contexts"):
            a, b = getattr(pp.pool, name)[0], getattr(inline.pool, name)[0]
            assert not torch.isnan(a).any() and rel_l2(a.cpu(), b.cpu()) <= SELF_TOL, name
        assert rel_l2(got.cpu(), _prefixed(model, inline.pool, items)[0].cpu()) <= SELF_TOL
    finally:
        pp.close()

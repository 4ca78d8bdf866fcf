"""Issue 17 (UNet path): per-stream flow caches (:class:`~cosyserve.models.flow.FlowStreamCache`).

A streaming chunk with a cache solves only the frames from the first static chunk that was
incomplete in the stream's previous call. Checked here: every streaming call of the reference
stream cases against upstream's mel (PARITY_TOL), cached against uncached calls over long token
streams under the upstream and exponential schedules and in batches of streams at different
stages (SELF_TOL), the cache's size (bounded, the documented formula) and release, the engine
wiring (A/B flag) and, on CUDA, the cached path against the uncached one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _reference import (PARITY_TOL, SELF_TOL, WAVE_TOL, discover, meta, model_dir, rel_l2, require_reference_dir,
                        tensors)
from cosyserve.engine.chunking import ChunkPolicy
from cosyserve.models.checkpoint import load_strict, read_state_dict
from cosyserve.models.config import load_config
from cosyserve.models.flow import FlowModel, FlowStreamCache
from cosyserve.models.flow_estimator import CausalConv1d

STREAM_TOKEN_NAMES = ("source_speech_token", "speech_token", "token")
STREAM_CASES = discover(
    "stream", has=("prompt_token", "prompt_feat", "embedding"),
    where=lambda m: bool(m.get("chunks")) and any(n in m.get("tensors", {}) for n in STREAM_TOKEN_NAMES),
)


@pytest.fixture(scope="module")
def flow() -> FlowModel:
    require_reference_dir()
    model = FlowModel(load_config(model_dir() / "cosyvoice2.yaml").flow).eval()
    load_strict(model, read_state_dict(model_dir() / "flow.pt"), "flow.pt")
    return model


@pytest.fixture(scope="module")
def prompt():
    """(prompt_token, prompt_feat, embedding) of the first stream case."""
    if not STREAM_CASES:
        pytest.skip("no stream case in the reference data")
    t = tensors(STREAM_CASES[0])
    return t["prompt_token"], t["prompt_feat"], t["embedding"]


def _tokens(name: str) -> torch.Tensor:
    t = tensors(name)
    return next(t[n] for n in STREAM_TOKEN_NAMES if n in t)


def _long_stream(flow: FlowModel, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, flow.cfg.vocab_size, (1, n), generator=g)


def _calls(policy: ChunkPolicy, n_prompt: int, n_tokens: int):
    """(token end, finalize) of every flow call of a stream of ``n_tokens`` tokens."""
    sched = policy.start(n_prompt)
    out = []
    while sched.ready(n_tokens):
        out.append((sched.chunk_end(), False))
        sched.advance()
    out.append((n_tokens, True))
    return out


def _run(flow, tokens, prompt, streaming, finalize, caches=None):
    k = len(tokens)
    return flow.inference_batch(tokens, [prompt[0]] * k, [prompt[1]] * k, torch.cat([prompt[2]] * k),
                                streaming, finalize, caches=caches)


# ---------------------------------------------------------------------------------------
# parity with upstream: every call of the reference stream cases, through one cache


@pytest.mark.parity
@pytest.mark.parametrize("name", STREAM_CASES)
def test_reference_stream_calls_with_cache(flow, name):
    t = tensors(name)
    tokens = _tokens(name)
    cache = FlowStreamCache()
    shorter = 0
    for i, c in enumerate(meta(name)["chunks"]):
        before = cache.frames
        got = flow.inference_batch([tokens[:, : int(c["n_tokens"])]], [t["prompt_token"]], [t["prompt_feat"]],
                                   t["embedding"], [bool(c["streaming"])], [bool(c["finalize"])], caches=[cache])[0]
        ref = t[f"c{i}_flow_mel"]
        start = max(0, before - t["prompt_feat"].shape[1]) if c["streaming"] else 0
        assert got.shape[-1] == ref.shape[-1] - start  # a suffix: the frames from the first uncached one
        shorter += start > 0
        err = rel_l2(got, ref[..., start:])
        print(f"{name} call {i}: cached frames {before}, computed {got.shape[-1]} of {ref.shape[-1]}, rel L2 {err:.2e}")
        assert err <= PARITY_TOL
        if not c["streaming"]:
            assert cache.frames == 0 and cache.nbytes() == 0  # full attention: nothing reusable, freed
    assert shorter >= 1, "no call of the case reused its cache"


# ---------------------------------------------------------------------------------------
# cached == uncached over long streams (upstream and exponential schedules)


@pytest.mark.parametrize("spec", ["upstream", "exponential"])
def test_cached_stream_equals_uncached(flow, prompt, spec):
    la = flow.pre_lookahead_len
    n_tokens = 420
    tokens = _long_stream(flow, n_tokens, seed=17)
    cache = FlowStreamCache()
    chunk = flow.decoder.estimator.cfg.static_chunk_size
    calls = _calls(ChunkPolicy.parse(spec, lookahead=la), prompt[0].shape[1], n_tokens)
    assert len(calls) >= 4
    saved = 0
    for end, final in calls:
        streaming = not final
        before = cache.frames
        full = _run(flow, [tokens[:, :end]], prompt, [streaming], [final])[0]
        got = _run(flow, [tokens[:, :end]], prompt, [streaming], [final], caches=[cache])[0]
        start = full.shape[-1] - got.shape[-1]
        assert start == (max(0, before - prompt[1].shape[1]) if streaming else 0)
        saved += start
        assert rel_l2(got, full[..., start:]) <= SELF_TOL
        frames = prompt[1].shape[1] + full.shape[-1]
        assert cache.frames == (0 if final else frames // chunk * chunk)
    assert saved > 0


# ---------------------------------------------------------------------------------------
# a voice's prompt prefix: built by one stream, adopted by another with other tokens


@pytest.mark.parametrize("spec", ["upstream", "exponential"])
def test_prompt_prefix_of_one_stream_is_exact_for_another(flow, prompt, spec):
    """The prompt's complete chunks (``prompt_prefix_frames``) depend on the prompt alone: stream A's
    first call, its commit limited to them, yields a prefix that stream B (other tokens) adopts, and
    every call of B then equals B's uncached calls; B's first call solves only the frames after it."""
    la = flow.pre_lookahead_len
    n_prompt = prompt[0].shape[1]
    frames = flow.prompt_prefix_frames(n_prompt)
    chunk = flow.decoder.estimator.cfg.static_chunk_size
    assert frames == chunk * ((flow.token_mel_ratio * (n_prompt - la)) // chunk) > 0
    policy = ChunkPolicy.parse(spec, lookahead=la)
    a, b = _long_stream(flow, 200, seed=5), _long_stream(flow, 200, seed=6)
    builder = FlowStreamCache()
    builder.commit_limit = frames
    end0 = _calls(policy, n_prompt, 200)[0][0]
    _run(flow, [a[:, :end0]], prompt, [True], [False], caches=[builder])
    assert builder.frames == frames and builder.commit_limit is None  # one call only
    prefix = builder.prompt_prefix(n_prompt)
    assert prefix.ids.numel() == n_prompt and prefix.frames == frames
    cache = FlowStreamCache()
    cache.adopt(prefix)
    shared = prefix.estimator.keys.data_ptr()
    for i, (end, final) in enumerate(_calls(policy, n_prompt, 200)):
        full = _run(flow, [b[:, :end]], prompt, [not final], [final])[0]
        got = _run(flow, [b[:, :end]], prompt, [not final], [final], caches=[cache])[0]
        start = full.shape[-1] - got.shape[-1]
        if i == 0:
            assert start == max(0, frames - prompt[1].shape[1])  # the prefix's frames were not solved again
        assert rel_l2(got, full[..., start:]) <= SELF_TOL, (spec, i)
    assert prefix.estimator.keys.data_ptr() == shared and prefix.frames == frames  # never written into
    with pytest.raises(ValueError, match="no prompt prefix"):
        FlowStreamCache().prompt_prefix(n_prompt)


# ---------------------------------------------------------------------------------------
# a batch of streams at different stages (different cache lengths) == each alone


def test_batched_cached_streams_equal_single(flow, prompt):
    la = flow.pre_lookahead_len
    policy = ChunkPolicy.parse("exponential", lookahead=la)
    streams = [_long_stream(flow, 160, seed=s) for s in (1, 2, 3)]
    plans = [_calls(policy, prompt[0].shape[1], 160) for _ in streams]
    alone = [FlowStreamCache() for _ in streams]
    together = [FlowStreamCache() for _ in streams]
    # stream i starts i calls late, so that every batch mixes cache lengths (and finals)
    n_rounds = max(len(p) for p in plans) + len(streams)
    for r in range(n_rounds):
        items = [(i, plans[i][r - i]) for i in range(len(streams)) if 0 <= r - i < len(plans[i])]
        if not items:
            continue
        toks = [streams[i][:, :end] for i, (end, _) in items]
        streaming = [not final for _, (_, final) in items]
        finalize = [final for _, (_, final) in items]
        # plus one offline item without cache in every batch
        toks.append(streams[0][:, :50])
        streaming.append(False)
        finalize.append(True)
        lens_before = [together[i].frames for i, _ in items]
        batch = _run(flow, toks, prompt, streaming, finalize, caches=[together[i] for i, _ in items] + [None])
        for k, (i, (end, final)) in enumerate(items):
            single = _run(flow, [streams[i][:, :end]], prompt, [not final], [final], caches=[alone[i]])[0]
            assert single.shape == batch[k].shape
            assert rel_l2(batch[k], single) <= SELF_TOL
            assert together[i].frames == alone[i].frames
        offline = _run(flow, [streams[0][:, :50]], prompt, [False], [True])[0]
        assert rel_l2(batch[-1], offline) <= SELF_TOL
        if len(set(lens_before)) > 1:
            print(f"round {r}: cache lengths in the batch {lens_before}")


# ---------------------------------------------------------------------------------------
# size, bound, release, invalidation


def test_cache_size_bound_and_release(flow, prompt):
    est = flow.decoder.estimator
    chunk = est.cfg.static_chunk_size
    n_steps = flow.cfg.cfm.n_timesteps
    tokens = _long_stream(flow, 200, seed=5)
    la = flow.pre_lookahead_len
    calls = _calls(ChunkPolicy.parse("upstream", lookahead=la), prompt[0].shape[1], 200)
    cap = chunk * ((prompt[1].shape[1] // chunk) + 1)  # the prompt's chunks and one more
    capped, free = FlowStreamCache(max_frames=cap), FlowStreamCache()
    elem = flow.encoder_proj.weight.element_size()
    for end, final in calls[:-1]:
        full = _run(flow, [tokens[:, :end]], prompt, [True], [False])[0]
        got = _run(flow, [tokens[:, :end]], prompt, [True], [False], caches=[capped])[0]
        _run(flow, [tokens[:, :end]], prompt, [True], [False], caches=[free])
        assert capped.frames <= cap
        assert rel_l2(got, full[..., full.shape[-1] - got.shape[-1]:]) <= SELF_TOL
        ctx = n_steps * sum(2 * (m.kernel_size[0] - 1) * m.in_channels * elem for m in est.modules()
                            if isinstance(m, CausalConv1d))
        enc = flow.encoder.cfg
        ratio = enc.upsample_stride
        for c in (capped, free):  # keys/values: the documented per-frame count; contexts: kernel - 1 frames
            assert c.frames > 0 and c.encoder.tokens * ratio == c.frames
            assert c.estimator.nbytes() == c.frames * n_steps * est.stream_cache_values_per_frame() * elem + ctx
            enc_kv = 2 * enc.output_size * (enc.num_blocks * c.encoder.tokens + enc.num_up_blocks * c.frames)
            assert c.encoder.nbytes() == (enc_kv + flow.encoder.UP_CONTEXT * enc.output_size) * elem
            assert c.nbytes() == c.estimator.nbytes() + c.encoder.nbytes()
    assert capped.frames == cap and free.frames > cap
    # another stream's tokens (not an extension of the cached ids): starts from an empty cache
    other = _long_stream(flow, 200, seed=6)
    got = _run(flow, [other[:, :calls[1][0]]], prompt, [True], [False], caches=[free])[0]
    full = _run(flow, [other[:, :calls[1][0]]], prompt, [True], [False])[0]
    assert got.shape == full.shape and rel_l2(got, full) <= SELF_TOL
    # the final (non-streaming) call frees everything
    _run(flow, [tokens], prompt, [False], [True], caches=[free])
    assert free.frames == 0 and free.nbytes() == 0
    free.clear()
    with pytest.raises(ValueError, match="max_frames"):
        FlowStreamCache(max_frames=-1)


def test_deeper_unet_ignores_the_cache(tmp_path):
    """A multi-level U-Net (resampling convs read the next frame): caching would not be exact, so
    the cache is cleared and the call runs whole."""
    import dataclasses

    cfg = load_config(model_dir() / "cosyvoice2.yaml").flow
    est = dataclasses.replace(cfg.estimator, channels=(32, 32))
    model = FlowModel(dataclasses.replace(cfg, estimator=est)).eval()
    assert not model.supports_stream_cache
    cache = FlowStreamCache()
    tok = torch.randint(0, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    ptok = torch.zeros(1, 0, dtype=torch.long)
    feat = torch.zeros(1, 0, cfg.output_size)
    emb = torch.randn(1, cfg.spk_embed_dim, generator=torch.Generator().manual_seed(1))
    a = model.inference_batch([tok], [ptok], [feat], emb, [True], [False], caches=[cache])[0]
    b = model.inference_batch([tok], [ptok], [feat], emb, [True], [False])[0]
    assert cache.frames == 0 and torch.equal(a, b)


# ---------------------------------------------------------------------------------------
# engine: the flag, same audio, caches used and freed


def _engine_setup(monkeypatch):
    """The tiny model's synthesizer, the reference prompt's voice, two texts, and the list that collects the
    cached frames of every stream cache passed to the flow (``FlowModel.start`` spied on)."""
    from cosyserve.engine.pipeline import Synthesizer

    syn = Synthesizer(model_dir(), normalizer="rules")
    ref = require_reference_dir()
    voice = syn.make_voice("ref", ref / "audio" / "zero_shot_prompt.wav", "希望你以后能够做的比我还好呦。")
    texts = ["今天天气很好，我们去公园玩吧。", "Hello there, my friend, how are you today?"]
    seen: list[int] = []
    real_start = syn.models.flow.start

    def spy(inputs, n_timesteps=None, caches=None):
        if caches is not None:
            seen.extend(c.frames for c in caches if c is not None)
        return real_start(inputs, n_timesteps, caches)

    monkeypatch.setattr(syn.models.flow, "start", spy)
    return syn, voice, texts, seen


def test_engine_flow_stream_cache_on_off(monkeypatch):
    from cosyserve.engine.core import EngineConfig
    from cosyserve.engine.request import AudioChunk, RequestFinished, SynthesisParams

    syn, voice, texts, seen = _engine_setup(monkeypatch)
    params = [SynthesisParams(seed=40 + i, stream=True, min_token_text_ratio=6, max_token_text_ratio=7,
                              chunk_policy=ChunkPolicy.parse(p))
              for i, p in enumerate(["upstream", "exponential"])]
    audio = {}
    for on in (True, False):
        engine = syn.new_engine(EngineConfig(max_active=2, max_queue=0, flow_stream_cache=on))
        reqs = [syn.build_request(t, voice, p, request_id=f"r{i}") for i, (t, p) in enumerate(zip(texts, params))]
        for r in reqs:
            engine.add_request(r)
        chunks = {r.request_id: [] for r in reqs}
        states = {}
        held = 0  # the largest flow cache a stream held: the memory bound's per-stream size
        while engine.has_work():
            states.update(engine._active)
            for st in engine._active.values():
                for seg in st.segments:
                    if seg.flow_cache is not None:
                        held = max(held, seg.flow_cache.nbytes())
                        assert engine.t2w.state_bytes(seg.hift_state, seg.flow_cache) == seg.flow_cache.nbytes()
            for ev in engine.step():
                if isinstance(ev, AudioChunk):
                    chunks[ev.request_id].append(ev.samples)
                else:
                    assert isinstance(ev, RequestFinished)
        assert len(states) == len(reqs)
        for st in states.values():  # released at the end
            assert all(seg.flow_cache is None for seg in st.segments)
        audio[on] = {k: np.concatenate(v) for k, v in chunks.items()}
        engine.close()
        if on:
            assert max(seen) > 0, "the engine never reused a flow cache"
            seen.clear()
            assert engine.t2w.stream_state_bytes() >= held > 0
        else:
            assert engine.t2w.stream_state_bytes() == 0 and held == 0
    assert not seen  # off: no cache passed
    for k in audio[True]:
        assert audio[True][k].shape == audio[False][k].shape
        assert rel_l2(torch.from_numpy(audio[True][k]), torch.from_numpy(audio[False][k])) <= WAVE_TOL


def test_engine_streams_of_a_voice_share_its_prompt_prefix(monkeypatch):
    """The engine with stream caches: the voice's first stream builds its prompt prefix, the next one
    starts its first cached chunk from it (the prefix's frames are not solved again), and both streams'
    audio equals the uncached engine's."""
    from cosyserve.engine.core import EngineConfig
    from cosyserve.engine.request import AudioChunk, SynthesisParams

    syn, voice, texts, starts = _engine_setup(monkeypatch)
    frames = syn.models.flow.prompt_prefix_frames(int(voice.flow_speech_token.numel()))
    assert frames > 0
    audio = {}
    for on in (True, False):
        engine = syn.new_engine(EngineConfig(max_active=1, max_queue=4, flow_stream_cache=on))
        params = [SynthesisParams(seed=50 + i, stream=True, min_token_text_ratio=6, max_token_text_ratio=7,
                                  chunk_policy=ChunkPolicy.parse("exponential")) for i in range(2)]
        for i, (t, p) in enumerate(zip(texts, params)):
            engine.add_request(syn.build_request(t, voice, p, request_id=f"v{i}"))
        chunks = {"v0": [], "v1": []}
        while engine.has_work():
            for ev in engine.step():
                if isinstance(ev, AudioChunk):
                    chunks[ev.request_id].append(ev.samples)
        audio[on] = {k: np.concatenate(v) for k, v in chunks.items()}
        if on:
            assert engine.t2w.prefixes.builds == 1 and engine.t2w.prefixes.hits == 1 and len(engine.t2w.prefixes) == 1
            # the first stream's first call started empty, the second stream's from the prefix
            assert starts[0] == 0 and frames in starts[1:]
        engine.close()
    for k in audio[True]:
        assert audio[True][k].shape == audio[False][k].shape
        assert rel_l2(torch.from_numpy(audio[True][k]), torch.from_numpy(audio[False][k])) <= WAVE_TOL


def test_prompt_prefixes_are_keyed_by_content_and_bounded_in_bytes():
    """``PromptPrefixes``: the key follows the voice's flow prompt (tokens, mel, embedding), not the object;
    least recently used prefixes go first beyond ``max_bytes``; one larger than the budget is not kept."""
    from types import SimpleNamespace

    from cosyserve.engine.token2wav import PromptPrefixes

    def voice(seed, n=8):
        g = torch.Generator().manual_seed(seed)
        return SimpleNamespace(flow_speech_token=torch.randint(0, 100, (n,), generator=g, dtype=torch.int32),
                               speech_feat=torch.randn(2 * n, 4, generator=g), flow_embedding=torch.randn(3, generator=g))

    a, a2, b = voice(1), voice(1), voice(2)
    assert PromptPrefixes.key(a) == PromptPrefixes.key(a2) != PromptPrefixes.key(b)
    c = voice(1)
    c.speech_feat = c.speech_feat + 1e-3  # same tokens, another prompt mel: another prefix
    assert PromptPrefixes.key(c) != PromptPrefixes.key(a)
    from cosyserve.frontend.voice import Voice, flow_prompt_digest

    v = Voice.from_features("v", "x", torch.zeros(3), a.flow_speech_token, a.speech_feat, a.flow_embedding)
    assert "flow_prompt_key" not in v.__dict__
    assert PromptPrefixes.key(v) == flow_prompt_digest(v) == PromptPrefixes.key(a)  # a Voice: the same content key
    assert "flow_prompt_key" in v.__dict__  # computed once, kept on the voice (read for every streaming chunk)

    class Sized:
        def __init__(self, n):
            self.n = n

        def nbytes(self):
            return self.n

    p = PromptPrefixes(max_bytes=100)
    p.put(b"a", Sized(40))
    p.put(b"b", Sized(40))
    assert p.get(b"a").n == 40 and p.hits == 1  # a is now the most recently used
    p.put(b"c", Sized(40))  # 120 > 100: b (least recently used) goes
    assert p.get(b"b") is None and p.get(b"a") is not None and p.get(b"c") is not None and len(p) == 2
    p.put(b"d", Sized(101))  # alone over the budget: not kept, and the others stay
    assert p.get(b"d") is None and len(p) == 2 and p.nbytes() == 80 and p.builds == 3


def test_cli_flag():
    import argparse

    from cosyserve import cli

    p = argparse.ArgumentParser()
    cli._engine_args(p)
    cfg = cli._engine_config(p.parse_args([]))
    assert cfg.flow_stream_cache is None and cfg.flow_stream_cache_frames is None  # auto: on unless graphed
    assert cli._engine_config(p.parse_args(["--flow-stream-cache", "on"])).flow_stream_cache is True
    cfg = cli._engine_config(p.parse_args(["--flow-stream-cache", "off", "--flow-stream-cache-frames", "500"]))
    assert not cfg.flow_stream_cache and cfg.flow_stream_cache_frames == 500
    with pytest.raises(SystemExit):
        p.parse_args(["--flow-stream-cache", "maybe"])


# ---------------------------------------------------------------------------------------
# CUDA (the lead runs these on the GPU machine)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_cached_equals_uncached(flow, prompt, dtype):
    import copy

    model = copy.deepcopy(flow).to("cuda", dtype)
    la = model.pre_lookahead_len
    tokens = _long_stream(model, 190, seed=9)
    caches = [FlowStreamCache(), FlowStreamCache()]
    tol = SELF_TOL if dtype == torch.float32 else 2e-2
    # the second stream starts from the voice's prompt prefix, built by a third stream's first call
    builder, n_prompt = FlowStreamCache(), prompt[0].shape[1]
    builder.commit_limit = model.prompt_prefix_frames(n_prompt)
    _run(model, [_long_stream(model, la + 20, seed=10)], prompt, [True], [False], caches=[builder])
    caches[1].adopt(builder.prompt_prefix(n_prompt))
    for end, final in _calls(ChunkPolicy.parse("exponential", lookahead=la), prompt[0].shape[1], 190):
        toks = [tokens[:, :end], tokens[:, : max(la + 1, end - 20)]]
        full = _run(model, toks, prompt, [not final] * 2, [final] * 2)
        got = _run(model, toks, prompt, [not final] * 2, [final] * 2, caches=caches)
        for f, g in zip(full, got):
            assert rel_l2(g.cpu(), f[..., f.shape[-1] - g.shape[-1]:].cpu()) <= tol


# ---------------------------------------------------------------------------------------
# batched cache traffic (gathers/indexed copies over all items): exact under a change of batch order


def _cache_tensors(c: FlowStreamCache) -> dict:
    e, n = c.estimator, c.encoder
    return {"frames": c.frames, "tokens": n.tokens, "est_keys": e.keys, "est_values": e.values,
            "est_contexts": e.contexts, "enc_keys": n.keys, "enc_values": n.values, "up_keys": n.up_keys,
            "up_values": n.up_values, "context": n.context}


def test_batch_order_is_exact(flow, prompt):
    """Streams with different prompts, schedules and cache states (staggered starts, one bounded cache,
    no-cache and offline items) batched in two orders: every stream's mel and every cached tensor are
    bit-identical (each item's rows are gathered/scattered by index), each mel equals the stream run
    alone (SELF_TOL: a mix-up between streams would be far off), and the caches have the documented
    layout (``[n_steps, n_sites, 2, H, frames, D]`` estimator keys, ``[tokens, layers, H, d_k]`` encoder keys)."""
    la = flow.pre_lookahead_len
    ptok, pfeat, emb = prompt
    ratio = flow.token_mel_ratio
    n_prompt = [ptok.shape[1], max(1, ptok.shape[1] // 2), max(1, ptok.shape[1] // 3)]
    specs = [("upstream", None), ("fixed:9", None), ("exponential", 2 * flow.decoder.estimator.cfg.static_chunk_size)]
    streams = [_long_stream(flow, 150, seed=10 + i) for i in range(len(specs))]
    plans = [_calls(ChunkPolicy.parse(p, lookahead=la), n_prompt[i], 150) for i, (p, _) in enumerate(specs)]
    caches = {order: [FlowStreamCache(max_frames=m) for _, m in specs] for order in ("fwd", "rev", "alone")}
    exact = True
    for r in range(max(len(p) for p in plans) + 1):
        items = [(i, plans[i][r - i // 2]) for i in range(len(specs)) if 0 <= r - i // 2 < len(plans[i])]
        if not items:
            continue
        results = {}
        for order in ("fwd", "rev"):
            seq = items if order == "fwd" else items[::-1]
            toks = [streams[i][:, :end] for i, (end, _) in seq] + [streams[0][:, :40], streams[1][:, :60]]
            streaming = [not final for _, (_, final) in seq] + [True, False]
            finalize = [final for _, (_, final) in seq] + [False, True]
            pt = [ptok[:, :n_prompt[i]] for i, _ in seq] + [ptok, ptok]
            pf = [pfeat[:, :ratio * n_prompt[i]] for i, _ in seq] + [pfeat, pfeat]
            out = flow.inference_batch(toks, pt, pf, torch.cat([emb] * len(toks)), streaming, finalize,
                                       caches=[caches[order][i] for i, _ in seq] + [None, None])
            results[order] = {i: out[k] for k, (i, _) in enumerate(seq)}
            results[order]["extra"] = out[-2:]
        for i, (end, final) in items:
            assert torch.equal(results["fwd"][i], results["rev"][i]), f"round {r} stream {i}"
            # and the stream alone (other padding: equal up to summation order; a mix-up between
            # streams would be far off)
            single = flow.inference_batch([streams[i][:, :end]], [ptok[:, :n_prompt[i]]],
                                          [pfeat[:, :ratio * n_prompt[i]]], emb, [not final], [final],
                                          caches=[caches["alone"][i]])[0]
            assert single.shape == results["fwd"][i].shape
            assert rel_l2(results["fwd"][i], single) <= SELF_TOL, f"round {r} stream {i}"
            assert caches["alone"][i].frames == caches["fwd"][i].frames
            exact = exact and torch.equal(results["fwd"][i], single)
            a, b = _cache_tensors(caches["fwd"][i]), _cache_tensors(caches["rev"][i])
            for name in a:
                same = a[name] == b[name] if not isinstance(a[name], torch.Tensor) else torch.equal(a[name], b[name])
                assert same, f"round {r} stream {i}: cache {name} differs between batch orders"
        for x, y in zip(results["fwd"]["extra"], results["rev"]["extra"]):
            assert torch.equal(x, y)
    print(f"batched vs alone bit-exact: {exact}")
    est = flow.decoder.estimator
    for c in caches["fwd"]:
        if c.frames:
            e, n = c.estimator, c.encoder
            assert e.keys.shape == (flow.cfg.cfm.n_timesteps, est.attention_sites(), 2, est.cfg.num_heads,
                                    c.frames, est.cfg.attention_head_dim)
            assert n.keys.shape[:2] == (n.tokens, flow.encoder.cfg.num_blocks)
            assert n.up_keys.shape[:2] == (n.tokens * ratio, flow.encoder.cfg.num_up_blocks)


def test_segments_index():
    from cosyserve.models.flow_encoder import segment_index

    row, pos = segment_index([2, 0, 2], [3, 0, 2], [5, 9, 0])
    assert row.tolist() == [2, 2, 2, 2, 2] and pos.tolist() == [5, 6, 7, 0, 1]
    row, pos = segment_index([1], [0], [4])
    assert row.numel() == 0 and pos.numel() == 0

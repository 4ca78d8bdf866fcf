"""Step-Audio2 DiT token2wav (cosyserve.models.dit_flow / dit_token2wav) against the tiny_dit_token2wav fixture.

Cases are discovered from ``<reference>/tiny_dit_token2wav/cases`` by kind (``dit_flow``,
``dit_token2wav_e2e``) and by the tensors their sidecars list; tolerance 1e-4 relative L2 (float32).
"""

from __future__ import annotations

import dataclasses
import re
import shutil

import numpy as np
import pytest
import torch

from _reference import dit_discover, dit_index, dit_meta, dit_tensors, one_thread, rel_l2, require_dit_dir
from cosyserve.errors import CheckpointError, ConfigError, ModelDirError
from cosyserve.models.checkpoint import load_strict, normalize_weight_norm_keys, read_state_dict
from cosyserve.models.config import load_dit_flow_config, parse_dit_flow_config, load_hyperpyyaml
from cosyserve.models.dit_flow import TRIM_KEEP, DitFlowModel, DitItem, trim_state
from cosyserve.models.dit_token2wav import (FULL_SIZE, TINY_SIZE, DitToken2Wav, dit_flow_yaml,
                                            hift_config_from_state_dict, load_dit_token2wav, write_token2wav_dir)
from cosyserve.models.hift import HiFTGenerator

TOL = 1e-4

OFFLINE_FLOW = dit_discover("dit_flow", has=("mel", "token", "prompt_token", "prompt_feat", "embedding"))
STREAM_FLOW = dit_discover("dit_flow", has=("stream_token", "prompt_token", "prompt_feat", "embedding"))
E2E_OFFLINE = dit_discover("dit_token2wav_e2e", has=("token", "mel", "source", "wav"))
E2E_STREAM = dit_discover("dit_token2wav_e2e", has=("stream_token", "prompt_token", "prompt_feat", "embedding"))


def _noise_seed() -> int:
    """The seed of the fixture's noise recipe (``torch.manual_seed(S); torch.randn(1, 80, N)``)."""
    recipe = dit_index().get("flow", {}).get("noise_recipe", "")
    m = re.search(r"manual_seed\((\d+)\)", recipe)
    if m is None:
        pytest.skip("the DiT fixture's index.json has no noise recipe")
    return int(m.group(1))


def _report(name: str, got: torch.Tensor, ref: torch.Tensor) -> float:
    err = rel_l2(got, ref)
    print(f"{name}: rel L2 {err:.3e}, bit-exact {torch.equal(got.float(), ref.float())}")
    return err


@pytest.fixture(autouse=True)
def _single_thread():
    # the fixture was produced with one thread; one thread is also the fastest for these tiny shapes
    with one_thread():
        yield


@pytest.fixture(scope="module")
def t2w() -> DitToken2Wav:
    d = require_dit_dir()
    cfg = dataclasses.replace(load_dit_flow_config(d / "flow.yaml"), noise_seed=_noise_seed())
    flow = DitFlowModel(cfg)
    load_strict(flow, read_state_dict(d / "flow.pt"), "flow.pt")
    sd = normalize_weight_norm_keys(read_state_dict(d / "hift.pt"), strip_prefix="generator.")
    hift = HiFTGenerator(hift_config_from_state_dict(sd, "hift.pt"))
    load_strict(hift, sd, "hift.pt")
    hift.remove_weight_norm()
    return DitToken2Wav(flow.eval(), hift.eval())


# ---------------------------------------------------------------------------------------------- config


def test_flow_yaml_parses_and_checks_class_names(tmp_path):
    d = require_dit_dir()
    cfg = load_dit_flow_config(d / "flow.yaml")
    raw = load_hyperpyyaml(d / "flow.yaml")["flow"]
    est = raw.kwargs()["decoder"].kwargs()["estimator"].kwargs()
    assert cfg.estimator.hidden_size == est["hidden_size"] and cfg.estimator.depth == est["depth"]
    assert cfg.encoder.num_up_blocks == raw.kwargs()["encoder"].kwargs()["num_up_blocks"]
    text = (d / "flow.yaml").read_text().replace("decoder_dit.DiT", "decoder.ConditionalDecoder")
    (tmp_path / "flow.yaml").write_text(text)
    with pytest.raises(ConfigError, match="flow.decoder.estimator"):
        load_dit_flow_config(tmp_path / "flow.yaml")
    data = load_hyperpyyaml(d / "flow.yaml")
    data["flow"].args["decoder"].args["estimator"].args["in_channels"] = 321
    with pytest.raises(ConfigError, match="in_channels"):
        parse_dit_flow_config(data)


def test_noise_recipe_matches_recorded_prefix(t2w):
    import copy

    for name in dit_discover("dit_flow", has=("rand_noise_prefix",)):
        ref = dit_tensors(name)["rand_noise_prefix"]
        assert torch.equal(t2w.flow.rand_noise[:, :, : ref.shape[2]], ref)
    half = copy.deepcopy(t2w.flow).to(torch.bfloat16)  # the noise stays float32 in a half-precision model
    assert half.rand_noise.dtype == torch.float32 and torch.equal(half.rand_noise, t2w.flow.rand_noise)
    assert half.decoder.estimator.in_proj.weight.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------- flow parity


@pytest.mark.parametrize("name", OFFLINE_FLOW)
def test_offline_mel(t2w, name):
    t = dit_tensors(name)
    flow = t2w.flow
    saved = flow.rand_noise
    if "rand_noise_prefix" in t:  # inject the recorded noise
        flow.set_noise(t["rand_noise_prefix"])
    try:
        with one_thread():
            mel = flow.inference(t["token"][0], t["prompt_token"][0], t["prompt_feat"][0], t["embedding"][0])
    finally:
        flow.rand_noise = saved
    assert _report(name, mel, t["mel"]) < TOL


def _stream_windows(meta: dict) -> list[tuple[int, int, bool]]:
    return [(c["token_slice"][0], c["token_slice"][1], bool(c["last_chunk"])) for c in meta["chunks"]]


@pytest.mark.parametrize("name", STREAM_FLOW)
def test_stream_flow_mel_every_call(t2w, name):
    t, meta = dit_tensors(name), dit_meta(name)
    flow = t2w.flow
    with one_thread():
        st = flow.setup(t["prompt_token"][0], t["prompt_feat"][0], t["embedding"][0])
    shapes = meta["setup_cache_shapes"]
    assert list(st.est_att.shape[1:]) == shapes["estimator_att_cache"][1:]
    assert st.enc_att1.shape[3] * 2 == shapes["conformer_att_cache"][3] == st.enc_att2.shape[3]
    if "setup_conformer_cnn_cache" in t:
        assert _report("setup conformer cnn", torch.cat([st.enc_lookahead, st.enc_up], 2),
                       t["setup_conformer_cnn_cache"]) < TOL
    if "setup_estimator_cnn_cache" in t:
        ref = t["setup_estimator_cnn_cache"]
        steps = st.est_cnn.shape[0]
        assert _report("setup estimator cnn", st.est_cnn, ref[:steps]) < TOL
        assert not ref[steps:].any()  # upstream's scratch buffer: unused steps stay zero
    key = "flow_mel" if any(k.endswith("_flow_mel") for k in t) else "mel"
    for i, (a, b, last) in enumerate(_stream_windows(meta)):
        c = meta["chunks"][i]
        if "noise_offset" in c:
            assert st.noise_offset == c["noise_offset"]
        with one_thread():
            mel, st = flow.chunk(st, t["stream_token"][0, a:b], last)
        assert _report(f"{name} call {i}", mel, t[f"c{i}_{key}"]) < TOL
        after = c.get("flow_cache_shapes_after")
        if after is not None:
            assert st.est_att.shape[4] == after["estimator_att_cache"][4]
            assert st.enc_att2.shape[3] == after["conformer_att_cache"][3]


# ---------------------------------------------------------------------------------------------- e2e parity


@pytest.mark.parametrize("name", E2E_OFFLINE)
def test_e2e_offline(t2w, name):
    t = dit_tensors(name)
    tok, pt, pm = t["token"][0], t["prompt_token"][0], t["prompt_feat"][0]
    ptok, pmel = t2w.prompt(pt, pm)
    assert torch.equal(pmel, pm[: ptok.numel() * 2])
    with one_thread():
        mel = t2w.flow.inference(tok, ptok, pmel, t["embedding"][0])
        assert _report(f"{name} mel", mel, t["mel"]) < TOL
        wav = t2w.hift.decode(t["mel"], t["source"])
    assert _report(f"{name} hift.decode(mel, source)", wav, t["wav"]) < TOL


@pytest.mark.parametrize("name", E2E_STREAM)
def test_e2e_stream_every_call(t2w, name, monkeypatch):
    """The whole DitToken2Wav.stream_step (flow, trimming, HiFT caches, cross-fade, leading zeros) with
    HiFT's random excitation replaced by the recorded source of each call."""
    t, meta = dit_tensors(name), dit_meta(name)
    recorded: list[torch.Tensor] = []
    monkeypatch.setattr(t2w.hift, "excitation_padded", lambda f0, lengths, gens=None: recorded.pop(0).clone())
    with one_thread():
        st = t2w.stream_setup(t["prompt_token"][0], t["prompt_feat"][0], t["embedding"][0])
    assert st.flow.prompt_frames == meta.get("prompt_frames", st.flow.prompt_frames)
    total = 0
    for i, (a, b, last) in enumerate(_stream_windows(meta)):
        recorded.append(t[f"c{i}_source"])
        with one_thread():
            mel, _ = t2w.flow.chunk(st.flow, t["stream_token"][0, a:b], last)
            assert _report(f"{name} call {i} flow mel", mel, t[f"c{i}_flow_mel"]) < TOL
            speech, st = t2w.stream_step(st, t["stream_token"][0, a:b], last)
        assert not recorded
        assert speech.shape == t[f"c{i}_wav"].shape
        assert _report(f"{name} call {i} wav", speech, t[f"c{i}_wav"]) < TOL
        # HiFT alone on the recorded input
        with one_thread():
            hs = t2w.hift.decode(t[f"c{i}_hift_mel"], t[f"c{i}_source"])
        assert _report(f"{name} call {i} hift_speech", hs, t[f"c{i}_hift_speech"]) < TOL
        total += speech.shape[-1]
    if "total_wav_samples" in meta:
        assert total == meta["total_wav_samples"]


# ---------------------------------------------------------------------------------------------- batching


def _second_prompt(t: dict, frac: float = 0.6):
    n = max(4, int(t["prompt_token"].shape[1] * frac))
    return t["prompt_token"][0, :n], t["prompt_feat"][0, : 2 * n], t["embedding"][0] * 0.5 + 0.1


@pytest.mark.parametrize("name", STREAM_FLOW[:1])
def test_batched_streaming_equals_single_streams(t2w, name):
    """Streams with different prompts, cache lengths, chunk sizes and last flags in one padded pass."""
    t, meta = dit_tensors(name), dit_meta(name)
    flow = t2w.flow
    toks = t["stream_token"][0]
    p1 = (t["prompt_token"][0], t["prompt_feat"][0], t["embedding"][0])
    p2 = _second_prompt(t)
    s1, s2 = flow.setup_batch([p1, p2])
    r1, r2 = flow.setup(*p1), flow.setup(*p2)
    assert rel_l2(s1.est_att, r1.est_att) < 1e-5 and rel_l2(s2.enc_att2, r2.enc_att2) < 1e-5
    # stream 1 one chunk ahead: different cache lengths in the next batched call
    a, b, _ = _stream_windows(meta)[0]
    _, s1 = flow.chunk(s1, toks[a:b], False)
    _, r1 = flow.chunk(r1, toks[a:b], False)
    calls = [((toks[10:30], False), (toks[:20], False)), ((toks[30:41], True), (toks[17:30], True))]
    for (t1, l1), (t2, l2) in calls:
        (m1, s1), (m2, s2) = flow.chunk_batch([s1, s2], [t1, t2], [l1, l2])
        g1, r1 = flow.chunk(r1, t1, l1)
        g2, r2 = flow.chunk(r2, t2, l2)
        assert m1.shape == g1.shape and m2.shape == g2.shape
        assert rel_l2(m1, g1) < 1e-5 and rel_l2(m2, g2) < 1e-5, (rel_l2(m1, g1), rel_l2(m2, g2))
        if not (l1 or l2):
            _assert_own_storages([s1, s2])
        for f in _STATE_TENSORS:
            assert getattr(s1, f).shape == getattr(r1, f).shape
            assert rel_l2(getattr(s1, f), getattr(r1, f)) < 1e-5, f
            assert rel_l2(getattr(s2, f), getattr(r2, f)) < 1e-5, f


@pytest.mark.parametrize("name", OFFLINE_FLOW[:1])
def test_mixed_batch_offline_setup_and_chunk(t2w, name):
    t = dit_tensors(name)
    flow = t2w.flow
    p = (t["prompt_token"][0], t["prompt_feat"][0], t["embedding"][0])
    tok = t["token"][0]
    st = flow.setup(*p)
    offline_item = flow.prompt_item(p[0], p[1], p[2], tok, last=True)
    setup_item = flow.setup_item(*_second_prompt(t))
    chunk_item = DitItem(tokens=tok[:12], spk=st.spk, last=False, state=st)
    res = flow.forward_items([offline_item, setup_item, chunk_item])
    ref_off = flow.inference(tok, *p)
    assert rel_l2(res[0].mel[:, :, p[1].shape[0]:], ref_off) < 1e-5
    ref_setup = flow.setup(*_second_prompt(t))
    assert rel_l2(res[1].state.est_att, ref_setup.est_att) < 1e-5
    ref_mel, _ = flow.chunk(st, tok[:12], False)
    assert rel_l2(res[2].mel, ref_mel) < 1e-5


@pytest.mark.parametrize("name", STREAM_FLOW[:1])
def test_graph_bucket_padding_equals_unpadded(t2w, name):
    """The padding to CUDA-graph buckets (frames, cache frames; masked) leaves every result unchanged
    (on CPU the padded estimator call runs eagerly: this checks the padding, the GPU test the graphs)."""
    import copy

    t = dit_tensors(name)
    padded = copy.deepcopy(t2w.flow)
    padded.enable_cuda_graphs(frames_bucket=16, cache_bucket=48)
    ref = _gpu_streams(t2w.flow, t, chunks=3)
    got = _gpu_streams(padded, t, chunks=3)
    for a, b in zip(got, ref):
        assert a.shape == b.shape and rel_l2(a, b) < 1e-5


@pytest.mark.parametrize("name", OFFLINE_FLOW[:1])
def test_offline_bucket_padding_equals_unpadded(t2w, name):
    """Offline utterances padded to the coarse offline frames bucket (and 3 items to 3 rows, 5 to 6)
    give the unpadded results: the padding is masked like any other."""
    import copy

    t = dit_tensors(name)
    padded = copy.deepcopy(t2w.flow)
    graph = padded.enable_cuda_graphs(frames_bucket=16, cache_bucket=48)
    graph.coarse_uncached = True  # as once offline utterances are planned
    p = (t["prompt_token"][0], t["prompt_feat"][0], t["embedding"][0])
    tok = t["token"][0]
    lens = [tok.numel(), tok.numel() - 7, 9, tok.numel() - 20, 30]
    items = [t2w.flow.prompt_item(*p, tok[:n], last=True) for n in lens]
    ref = [t2w.flow.inference(tok[:n], *p) for n in lens]
    got = padded.forward_items(items, final_states=False)
    got3 = padded.forward_items(items[:3], final_states=False)
    assert {r for r, _, _ in graph.used} == {6, 3} and all(c == 0 and f % 128 == 0 for _, f, c in graph.used)
    f = p[1].shape[0]
    for r, g in zip(ref, got):
        assert g.state is None and g.mel.shape[2] == f + r.shape[2] and rel_l2(g.mel[:, :, f:], r) < 1e-5
    assert all(rel_l2(g.mel[:, :, f:], r) < 1e-5 for g, r in zip(got3, ref))


@pytest.mark.parametrize("name", STREAM_FLOW[:1])
def test_graph_row_padding_equals_unpadded(t2w, name):
    """With graphs set, a batch of 5 streams is padded to 6 items (a padding item has one valid frame
    and no cache); the real items' mels and trimmed states equal the unpadded batch's."""
    import copy

    t = dit_tensors(name)
    padded = copy.deepcopy(t2w.flow)
    graph = padded.enable_cuda_graphs(frames_bucket=16, cache_bucket=48)
    assert graph.rows_bucket(5) == 6
    st = t2w.flow.setup(t["prompt_token"][0], t["prompt_feat"][0], t["embedding"][0])
    g = torch.Generator().manual_seed(3)
    states = [st] * 5
    for k in range(3):
        toks = [torch.randint(0, 6561, (int(n),), generator=g) for n in (28, 19, 10, 28, 7)]
        last = [False, False, False, k == 2, False]
        ref = t2w.flow.chunk_batch(states, toks, last)
        got = padded.chunk_batch(states, toks, last)
        for (ma, sa), (mb, sb) in zip(got, ref):
            assert ma.shape == mb.shape and rel_l2(ma, mb) < 1e-5
            assert sa.est_att.shape == sb.est_att.shape and rel_l2(sa.est_att, sb.est_att) < 1e-5
            assert rel_l2(sa.est_cnn, sb.est_cnn) < 1e-5
        _assert_own_storages([s for _, s in got if s is not None])
        states = [s for _, s in ref]


_STATE_TENSORS = ("enc_att1", "enc_att2", "enc_lookahead", "enc_up", "est_att", "est_cnn")


def _assert_own_storages(states):
    """Every state tensor of a batch's states is contiguous in a storage of its own (exactly its
    size): a view of a batch-wide tensor would keep the whole batch's storage alive as long as any
    of its streams holds its state (the memory a stream costs would depend on its batch-mates)."""
    seen = set()
    for st in states:
        for f in _STATE_TENSORS:
            t = getattr(st, f)
            assert t.is_contiguous(), f
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), f
            assert t.untyped_storage().data_ptr() not in seen, f
            seen.add(t.untyped_storage().data_ptr())


def _in_place_run(flow, states, calls, write_back=None):
    """One batched call of :meth:`DitFlowModel.forward_items` with in-place items: ``[(mel, state)]``."""
    items = [DitItem(tokens=tk, spk=st.spk, last=lf, state=st, in_place=True) for st, (tk, lf) in zip(states, calls)]
    return [(r.mel, r.state) for r in flow.forward_items(items, trim_keep=TRIM_KEEP, write_back=write_back)]


def test_in_place_caches_equal_immutable_states(t2w):
    """In-place streams (DitItem.in_place: each stream's estimator caches in one store, overwritten chunk after
    chunk) compute exactly what immutable states compute, through the trimming, with different prompts and
    chunk sizes in one batch: each stream allocates its store once (P + TRIM_KEEP frames, at its first chunk;
    the shared set-up state is never written), every state it replaces is stale and refused, and the state's
    size is the store's."""
    names = STREAM_FLOW or E2E_STREAM
    if not names:
        pytest.skip("no streaming case")
    t = dit_tensors(names[0])
    flow = t2w.flow
    p1 = (t["prompt_token"][0], t["prompt_feat"][0], t["embedding"][0])
    setups = flow.setup_batch([p1, _second_prompt(t)])
    before = flow.chunk(setups[0], t["stream_token"][0][:28], False)
    ref, got = list(setups), list(setups)
    g = torch.Generator().manual_seed(11)
    ptrs = None
    for k in range(7):  # past P + TRIM_KEEP cache frames: the caches are trimmed in the store
        calls = [(torch.randint(0, 6561, (28,), generator=g), False), (torch.randint(0, 6561, (19,), generator=g), False)]
        expect = flow.chunk_batch(ref, [c[0] for c in calls], [c[1] for c in calls])
        old = got
        res = _in_place_run(flow, got, calls)
        for (m, st), (mr, sr), prev in zip(res, expect, old):
            assert torch.equal(m, mr)
            assert st.cache_frames == sr.cache_frames and torch.equal(st.est_att, sr.est_att)
            assert torch.equal(st.est_cnn, sr.est_cnn) and torch.equal(st.enc_att2, sr.enc_att2)
            assert st.est_store.capacity == st.prompt_frames + TRIM_KEEP and not st.stale
            assert st.nbytes() == sr.nbytes() - sr.est_att.nbytes + st.est_store.tensor.nbytes
            if k > 0:
                assert prev.stale
        if k > 0:
            assert [st.est_store.tensor.data_ptr() for _, st in res] == ptrs  # written in place
            with pytest.raises(ValueError, match="stale"):
                _in_place_run(flow, old, calls)
        ptrs = [st.est_store.tensor.data_ptr() for _, st in res]
        ref, got = [s for _, s in expect], [s for _, s in res]
    assert max(st.cache_frames for st in got) > min(st.prompt_frames for st in got) + 50  # trimming reached
    assert all(s.est_store is None and not s.stale for s in setups)
    after = flow.chunk(setups[0], t["stream_token"][0][:28], False)  # the set-up state was never written
    assert torch.equal(before[0], after[0]) and torch.equal(before[1].est_att, after[1].est_att)
    # a final chunk whose state is not kept (final_states=False, as the engine asks) writes nothing
    last = DitItem(tokens=t["stream_token"][0][:10], spk=got[0].spk, last=True, state=got[0], in_place=True)
    assert flow.forward_items([last], trim_keep=TRIM_KEEP, final_states=False)[0].state is None
    assert not got[0].stale


def test_in_place_write_back_waits_for_its_commit(t2w):
    """With a CacheWriteBack the stores keep the old caches until the commit: the old states stay valid (the
    batch can be re-run, with the same result), the new ones are stale until then, and no other batch runs
    while the write-back is pending (its copies read the solve buffers)."""
    from cosyserve.models.dit_flow import CacheWriteBack

    names = STREAM_FLOW or E2E_STREAM
    if not names:
        pytest.skip("no streaming case")
    t = dit_tensors(names[0])
    flow = t2w.flow
    toks = t["stream_token"][0]
    states = [s for _, s in _in_place_run(flow, flow.setup_batch([(t["prompt_token"][0], t["prompt_feat"][0],
                                                                   t["embedding"][0])]), [(toks[:28], False)])]
    calls = [(toks[25:53], False)]
    wb = CacheWriteBack()
    first = _in_place_run(flow, states, calls, wb)
    assert wb.pending and first[0][1].stale and not states[0].stale
    with pytest.raises(RuntimeError, match="write-back"):
        _in_place_run(flow, states, calls)
    wb.discard()
    assert not states[0].stale and first[0][1].stale
    with pytest.raises(ValueError, match="stale"):
        _in_place_run(flow, [first[0][1]], calls)
    wb = CacheWriteBack()
    again = _in_place_run(flow, states, calls, wb)
    assert torch.equal(again[0][0], first[0][0])
    wb.commit()
    assert states[0].stale and not again[0][1].stale
    ref = flow.chunk(flow.chunk(flow.setup(t["prompt_token"][0], t["prompt_feat"][0], t["embedding"][0]),
                                toks[:28], False)[1], toks[25:53], False)
    assert torch.equal(again[0][0], ref[0]) and torch.equal(again[0][1].est_att, ref[1].est_att)


def test_backend_batch_failing_after_its_solve_leaves_streams_intact(t2w, monkeypatch):
    """A DiT backend batch that fails after its chunks' solve (here in HiFT) commits none of its in-place caches,
    so re-running each job alone (what the engine does) gives every stream the audio of a clean run."""
    from types import SimpleNamespace

    import cosyserve.engine.token2wav_dit as backend_mod
    from cosyserve.engine.token2wav import Token2WavJob
    from cosyserve.engine.token2wav_dit import DitToken2WavBackend
    from cosyserve.models.hift import HiFTStreamState

    names = STREAM_FLOW or E2E_STREAM
    if not names:
        pytest.skip("no streaming case")
    t = dit_tensors(names[0])
    toks = t["stream_token"][0]
    voices = [SimpleNamespace(flow_speech_token=t["prompt_token"][0], speech_feat=t["prompt_feat"][0],
                              flow_embedding=t["embedding"][0]),
              SimpleNamespace(flow_speech_token=_second_prompt(t)[0], speech_feat=_second_prompt(t)[1],
                              flow_embedding=_second_prompt(t)[2])]

    def two_chunks(be, fail: bool):
        first = be.run([Token2WavJob(v, toks[:28], 0, False, True, HiFTStreamState(), torch.Generator().manual_seed(i))
                        for i, v in enumerate(voices)])
        jobs = [Token2WavJob(v, toks[:53], 25, False, True, r.hift_state, torch.Generator().manual_seed(7 + i))
                for i, (v, r) in enumerate(zip(voices, first))]
        if not fail:
            return be.run_each(jobs)  # each job alone, as the retry below runs them
        real = backend_mod.hift_stream_step_batch
        calls = {"n": 0}

        def failing(*a, **k):
            calls["n"] += 1
            if calls["n"] == 1:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated, after the solve)")
            return real(*a, **k)

        monkeypatch.setattr(backend_mod, "hift_stream_step_batch", failing)
        with pytest.raises(torch.OutOfMemoryError):
            be.run(jobs)
        out = be.run_each(jobs)  # (the failure came before HiFT drew from the jobs' generators)
        monkeypatch.setattr(backend_mod, "hift_stream_step_batch", real)
        return out

    ref = two_chunks(DitToken2WavBackend(t2w), fail=False)
    got = two_chunks(DitToken2WavBackend(t2w), fail=True)
    for a, b in zip(got, ref):
        assert not isinstance(a, Exception), a
        assert torch.equal(a.speech, b.speech)
        assert torch.equal(a.hift_state.flow.est_att, b.hift_state.flow.est_att)


def test_caches_stay_bounded_and_chunk_cost_constant(t2w):
    names = STREAM_FLOW or E2E_STREAM
    if not names:
        pytest.skip("no streaming case")
    t = dit_tensors(names[0])
    flow = t2w.flow
    st = flow.setup(t["prompt_token"][0], t["prompt_feat"][0], t["embedding"][0])
    p = st.prompt_frames
    g = torch.Generator().manual_seed(0)
    lens = []
    for _ in range(6):
        mel, st = flow.chunk(st, torch.randint(0, 6561, (15,), generator=g), False)
        assert mel.shape[-1] == 24
        lens.append(st.cache_frames)
    assert max(lens) <= p + 100 and lens[-1] == lens[-2] == p + 100
    assert st.enc_att2.shape[3] == p + 100 and st.enc_att1.shape[3] == (p + 100) // 2
    assert trim_state(st) is st


def test_bad_inputs_raise_clear_errors(t2w):
    flow = t2w.flow
    names = STREAM_FLOW or OFFLINE_FLOW
    if not names:
        pytest.skip("no case")
    t = dit_tensors(names[0])
    st = flow.setup(t["prompt_token"][0], t["prompt_feat"][0], t["embedding"][0])
    with pytest.raises(ValueError, match="no frame"):
        flow.chunk(st, torch.tensor([1, 2, 3]), False)
    with pytest.raises(ValueError, match="out of range"):
        flow.chunk(st, torch.tensor([1, 2, 3, 99999]), False)
    with pytest.raises(ValueError, match="mel frames"):
        flow.setup(t["prompt_token"][0], t["prompt_feat"][0, :-2], t["embedding"][0])


# ---------------------------------------------------------------------------------------------- full size, loading


def _block_pattern(key: str) -> str:
    return re.sub(r"\.(encoders|up_encoders|blocks)\.\d+\.", r".\1.N.", key)


def test_full_size_modules_on_meta_device(tmp_path):
    d = require_dit_dir()
    (tmp_path / "flow.yaml").write_text(dit_flow_yaml(FULL_SIZE))
    cfg = load_dit_flow_config(tmp_path / "flow.yaml")
    with torch.device("meta"):
        flow = DitFlowModel(cfg)
    sd = flow.state_dict()
    tiny = read_state_dict(d / "flow.pt")
    assert {_block_pattern(k) for k in sd} == {_block_pattern(k) for k in tiny}
    s = FULL_SIZE
    assert sum(k.startswith("encoder.encoders.") and k.endswith("linear_q.weight") for k in sd) == s.enc_blocks
    assert sum(k.startswith("encoder.up_encoders.") and k.endswith("linear_q.weight") for k in sd) == s.enc_up_blocks
    assert sum(k.endswith("adaLN_modulation.1.weight") and ".blocks." in k for k in sd) == s.dit_depth
    assert tuple(sd["decoder.estimator.blocks.0.adaLN_modulation.1.weight"].shape) == (9 * s.dit_hidden, s.dit_hidden)
    assert tuple(sd["decoder.estimator.blocks.0.attn.to_q.weight"].shape) == (s.dit_heads * s.dit_head_dim, s.dit_hidden)
    assert tuple(sd["decoder.estimator.blocks.0.attn.q_norm.weight"].shape) == (s.dit_head_dim,)
    assert tuple(sd["encoder.encoders.0.feed_forward.w_1.weight"].shape) == (s.enc_linear, s.enc_dim)
    assert tuple(sd["encoder.encoders.0.self_attn.pos_bias_u"].shape) == (s.enc_heads, s.enc_dim // s.enc_heads)
    n = sum(v.numel() for v in sd.values())
    print(f"full-size DiT flow: {n / 1e6:.1f} M parameters")
    # the tiny fixture's keys/shapes follow the same rule at its size
    tiny_cfg = load_dit_flow_config(d / "flow.yaml")
    with torch.device("meta"):
        tiny_model = DitFlowModel(tiny_cfg)
    assert {k: tuple(v.shape) for k, v in tiny_model.state_dict().items()} == {k: tuple(v.shape) for k, v in tiny.items()}
    with torch.device("meta"):
        hift = HiFTGenerator(hift_config_from_state_dict({"conv_pre.weight": torch.empty(s.hift_channels, 80, 7),
                                                          "f0_predictor.condnet.0.weight": torch.empty(s.hift_f0_channels, 80, 3)},
                                                         "meta"))
    nh = sum(v.numel() for v in hift.parameters())
    print(f"full-size HiFT: {nh / 1e6:.2f} M parameters")
    assert 20e6 < nh < 21.5e6  # the fixture README: about 20.8 M


def test_tiny_hift_matches_fixture_shapes():
    d = require_dit_dir()
    sd = normalize_weight_norm_keys(read_state_dict(d / "hift.pt"), strip_prefix="generator.")
    hift = HiFTGenerator(hift_config_from_state_dict(sd, "hift.pt"))
    assert {k: tuple(v.shape) for k, v in hift.state_dict().items()} == {k: tuple(v.shape) for k, v in sd.items()}


def test_token2wav_dir_loading_and_errors(tmp_path):
    d = require_dit_dir()
    out = write_token2wav_dir(tmp_path / "t2w", TINY_SIZE, seed=3)
    t2w = load_dit_token2wav(out)
    assert t2w.flow.cfg.estimator.depth == TINY_SIZE.dit_depth
    st = t2w.stream_setup(torch.arange(10), torch.randn(20, 80), torch.randn(192))
    sp, st = t2w.stream_step(st, torch.arange(28), False)
    assert sp.shape == (1, 3840 + 50 * 480 - 3840)
    sp2, st = t2w.stream_step(st, torch.arange(25, 40), True)
    assert sp2.shape == (1, 30 * 480 + 3840)
    # a fixture-like directory: the fixture's flow/hift + the stand-in ONNX files
    fx = tmp_path / "fixture"
    fx.mkdir()
    for f in ("flow.yaml", "flow.pt", "hift.pt"):
        shutil.copy(d / f, fx / f)
    with pytest.raises(ModelDirError, match="campplus.onnx"):
        load_dit_token2wav(fx)
    for f in ("campplus.onnx", "speech_tokenizer_v2_25hz.onnx"):
        shutil.copy(out / f, fx / f)
    assert load_dit_token2wav(fx).hift.cfg.base_channels == 64
    # mismatched checkpoint: the error names the file and the key
    shutil.copy(out / "flow.pt", fx / "flow.pt")
    (fx / "flow.yaml").write_text((d / "flow.yaml").read_text().replace("depth: 2", "depth: 3"))
    with pytest.raises(CheckpointError, match=r"flow\.pt.*blocks\.2"):
        load_dit_token2wav(fx)
    # random-weights directory (no .pt files): networks built at load time
    rnd = write_token2wav_dir(tmp_path / "rnd", TINY_SIZE, seed=1, weights=False)
    assert not (rnd / "flow.pt").exists()
    assert load_dit_token2wav(rnd).hift.cfg.base_channels == TINY_SIZE.hift_channels


# ---------------------------------------------------------------------------------------------- engine / CLI


@pytest.fixture(scope="module")
def dit_model_dirs(tmp_path_factory):
    """(tiny CosyVoice2 model dir, tiny DiT token2wav dir: the fixture's flow/hift + the ONNX stand-ins)."""
    from _reference import model_dir, reference_dir

    d = require_dit_dir()
    ref = reference_dir()
    if not (ref / "cases").is_dir() or not model_dir().is_dir():
        pytest.skip("needs the tiny CosyVoice2 model directory of the reference data too")
    root = tmp_path_factory.mktemp("dit")
    stub = write_token2wav_dir(root / "stub", TINY_SIZE)
    t2w = root / "t2w"
    t2w.mkdir()
    for f in ("flow.yaml", "flow.pt", "hift.pt"):
        shutil.copy(d / f, t2w / f)
    for f in ("campplus.onnx", "speech_tokenizer_v2_25hz.onnx"):
        shutil.copy(stub / f, t2w / f)
    return model_dir(), t2w


def test_cli_synthesize_with_token2wav_dir(tmp_path, capsys, dit_model_dirs):
    import numpy as np
    import soundfile as sf

    from _reference import reference_dir
    from cosyserve.cli import main

    md, t2w = dit_model_dirs
    prompt = reference_dir() / "audio" / "zero_shot_prompt.wav"
    outs = {}
    for mode in ("--stream", None):
        out = tmp_path / f"{mode or 'offline'}.wav"
        argv = ["synthesize", "--model-dir", md, "--token2wav-dir", t2w, "--prompt-wav", prompt, "--prompt-text",
                "希望你以后能够做的比我还好呦。", "--text", "你好，世界。", "--seed", "3", "-o", out, "--device", "cpu",
                "--min-token-text-ratio", "8", "--max-token-text-ratio", "9", "-q"] + ([mode] if mode else [])
        code = main([str(a) for a in argv])
        err = capsys.readouterr().err
        assert code == 0, err
        audio, sr = sf.read(out)
        assert sr == 24000 and audio.size > 0 and np.isfinite(audio).all() and np.abs(audio).max() > 0
        outs[mode] = audio
    # same tokens (same seed): the stream is the offline length + the 3840 leading zeros (160 ms)
    assert outs["--stream"].size == outs[None].size + 3840
    code = main(["synthesize", "--model-dir", str(md), "--token2wav-dir", str(tmp_path / "missing"), "--voice", "x",
                 "--text", "x", "-o", str(tmp_path / "x.wav")])
    err = capsys.readouterr().err
    assert code != 0 and "missing" in err and "Traceback" not in err


def _engine_streams_and_alone(dit_model_dirs, seeds, before_engine=None):
    """Streaming requests (one per seed, fixed 15-token chunks) run alone, then together in one engine of
    the DiT backend (``before_engine()`` runs in between, e.g. to inject a fault). Returns ``(engine stats,
    requests, chunks per request id, RequestFinished per request id, audio of each request alone)``."""
    from _reference import reference_dir
    from cosyserve.engine.chunking import ChunkPolicy
    from cosyserve.engine.core import EngineConfig
    from cosyserve.engine.pipeline import Synthesizer
    from cosyserve.engine.request import SynthesisParams

    md, t2w = dit_model_dirs
    syn = Synthesizer(md, token2wav_dir=t2w, normalizer="none")
    voice = syn.make_voice("v", reference_dir() / "audio" / "zero_shot_prompt.wav", "希望你以后能够做的比我还好呦。")
    params = [SynthesisParams(stream=True, seed=s, min_token_text_ratio=6, max_token_text_ratio=7,
                              chunk_policy=ChunkPolicy.parse("fixed:15")) for s in seeds]
    alone = [syn.synthesize("你好，世界。", voice, p).audio for p in params]
    if before_engine is not None:
        before_engine()
    engine = syn.new_engine(EngineConfig(max_active=len(params)))
    try:
        reqs = [syn.build_request("你好，世界。", voice, p) for p in params]
        for r in reqs:
            engine.add_request(r)
        chunks = {r.request_id: [] for r in reqs}
        done = {}
        while engine.has_work():
            for ev in engine.step():
                if hasattr(ev, "samples"):
                    chunks[ev.request_id].append(ev.samples)
                elif hasattr(ev, "outcome"):
                    done[ev.request_id] = ev
    finally:
        engine.close()
    return engine.stats, reqs, chunks, done, alone


def test_engine_batches_streams_of_the_dit_backend(dit_model_dirs):
    """Several streaming requests in one engine: chunks of different streams share token2wav batches and each
    request's audio equals its audio when run alone."""
    stats, reqs, chunks, _, alone = _engine_streams_and_alone(dit_model_dirs, (1, 2))
    assert max(stats.t2w_batches) >= 2  # chunks of both streams ran together
    for r, ref in zip(reqs, alone):
        got = torch.from_numpy(np.concatenate(chunks[r.request_id]))
        assert got.shape == ref.shape
        # flow batching noise (~1e-7, test_batched_streaming_equals_single_streams) amplified by HiFT's F0
        # phase integration; the CosyVoice2 path's engine tests use the same bound (test_pipeline WAVE_TOL)
        assert rel_l2(got, ref) <= 2e-3


def test_engine_survives_a_token2wav_batch_that_runs_out_of_memory(dit_model_dirs, monkeypatch):
    """A DiT chunk batch that runs out of device memory after its solve (as the H100 run of session 25 did, in
    the gather of the new caches) fails no request that can run alone: the engine re-runs each job of the batch
    by itself, and every stream's audio equals its audio when run alone (nothing the failed batch touched
    leaks into later chunks)."""
    from cosyserve.models.dit_flow import DitFlowModel

    solve = DitFlowModel._solve
    calls = {"n": 0, "failed_rows": 0}

    def failing_solve(self, items, *a, **k):
        out = solve(self, items, *a, **k)
        calls["n"] += 1
        if calls["n"] == 3 and len(items) > 1:  # a batch of several streams, after its solve ran
            calls["failed_rows"] = len(items)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.45 GiB (simulated)")
        return out

    _, reqs, chunks, done, alone = _engine_streams_and_alone(
        dit_model_dirs, (1, 2, 3), lambda: monkeypatch.setattr(DitFlowModel, "_solve", failing_solve))
    assert calls["failed_rows"] > 1  # the injected failure hit a batch of several streams
    assert all(done[r.request_id].outcome.value == "ok" for r in reqs)
    for r, ref in zip(reqs, alone):
        got = torch.from_numpy(np.concatenate(chunks[r.request_id]))
        assert got.shape == ref.shape and rel_l2(got, ref) <= 2e-3


# ---------------------------------------------------------------------------------------------- GPU


def _gpu_streams(flow, t: dict, chunks: int = 5):
    """Two streams (different prompts and chunk sizes) set up and run for ``chunks`` batched calls on
    the flow's device; returns every call's mels."""
    dev = next(flow.parameters()).device
    p1 = (t["prompt_token"][0], t["prompt_feat"][0].to(dev), t["embedding"][0].to(dev))
    p2 = tuple(x.to(dev) for x in _second_prompt(t))
    states = flow.setup_batch([p1, p2])
    g = torch.Generator().manual_seed(5)
    out = []
    for k in range(chunks):
        last = k == chunks - 1
        toks = [torch.randint(0, 6561, (28,), generator=g), torch.randint(0, 6561, (19 if not last else 7,), generator=g)]
        res = flow.chunk_batch(states, toks, [last, last])
        states = [s for _, s in res]
        out += [m for m, _ in res]
    return out


@pytest.mark.gpu
def test_gpu_graphs_equal_eager(t2w):
    import copy

    names = STREAM_FLOW or E2E_STREAM
    t = dit_tensors(names[0])
    flow = copy.deepcopy(t2w.flow).cuda()
    eager = _gpu_streams(flow, t)
    graph = flow.enable_cuda_graphs()
    graphed = _gpu_streams(flow, t)
    again = _gpu_streams(flow, t)  # replays of already-captured graphs
    assert graph.captures > 0 and graph.replays > graph.captures
    for e, g, a in zip(eager, graphed, again):
        assert e.shape == g.shape
        assert rel_l2(g, e) < 1e-5, rel_l2(g, e)
        assert torch.equal(g, a)
    # sanity: the CUDA result is the CPU one (cuDNN's default TF32 convolutions round differently)
    cpu = _gpu_streams(t2w.flow, t, chunks=2)
    for c, e in zip(cpu, eager[:2]):
        assert rel_l2(e.cpu(), c) < 1e-2


def _plan_gpu_streams(graph, t: dict, chunks: int = 5) -> None:
    """Plan the buckets :func:`_gpu_streams` uses (hops of 25 and 16 tokens, both prompts, 2 rows)."""
    from cosyserve.models.dit_flow import stream_solve_shapes

    flow = graph.flow
    setups, shapes = set(), set()
    for p, hop in ((int(t["prompt_token"].shape[1]), 25), (int(_second_prompt(t)[0].numel()), 16)):
        s, c = stream_solve_shapes(p, [hop] * chunks, flow.pre_lookahead_len, flow.up_rate)
        setups |= s
        shapes |= c
    graph.plan(setups, shapes, max_rows=2)


@pytest.mark.gpu
def test_gpu_warmup_graphs_equal_eager(t2w):
    """The stage's warmup() captures every planned bucket before any solve (the engine's start-up
    capture); the streams then only replay (nothing captured on use) and equal eager."""
    import copy

    t = dit_tensors((STREAM_FLOW or E2E_STREAM)[0])
    flow = copy.deepcopy(t2w.flow).cuda()
    eager = _gpu_streams(flow, t)
    graph = flow.enable_cuda_graphs()
    _plan_gpu_streams(graph, t)
    graph.capture_on_use = False
    graph.warmup()
    n = graph.n_graphs
    assert n == len(graph.keys()) > 0 and not graph.pending()
    graphed = _gpu_streams(flow, t)
    assert graph.n_graphs == n and graph.replays >= 6  # set-up + 5 chunk batches, all replayed
    assert set(graph.used) <= set(graph.keys())
    for e, g in zip(eager, graphed):
        assert e.shape == g.shape and rel_l2(g, e) < 1e-5, rel_l2(g, e)


@pytest.mark.gpu
def test_gpu_background_capture_while_solving(t2w):
    """A BackgroundCapturer captures the DiT stage in its thread while this thread streams (eagerly
    until each bucket is published, replays after): every result equals eager, no capture fails."""
    import copy

    from cosyserve.models.graphs import BackgroundCapturer

    t = dit_tensors((STREAM_FLOW or E2E_STREAM)[0])
    flow = copy.deepcopy(t2w.flow).cuda()
    eager = _gpu_streams(flow, t)
    graph = flow.enable_cuda_graphs()
    _plan_gpu_streams(graph, t)
    cap = BackgroundCapturer([[graph]], device=flow.rand_noise.device)
    cap.start()
    assert not graph.capture_on_use
    import time

    deadline = time.monotonic() + 300
    try:
        rounds = 0
        while not cap.done or rounds < 2:
            got = _gpu_streams(flow, t)
            for e, g in zip(eager, got):
                assert e.shape == g.shape and rel_l2(g, e) < 1e-5, rel_l2(g, e)
            rounds += 1
            assert time.monotonic() < deadline, "background capture did not finish in 300 s"
    finally:
        assert cap.stop(timeout=120)
    assert cap.failed == 0 and cap.pending == 0 and graph.n_graphs == len(graph.keys())
    replays = graph.replays
    for e, g in zip(eager, _gpu_streams(flow, t)):
        assert rel_l2(g, e) < 1e-5
    assert graph.replays >= replays + 6


#: half-precision flow vs float32 (tiny fixture model, offline + streaming mels), relative L2. Measured
#: on CPU with the same code: bfloat16 5.7e-3 .. 6.5e-3, float16 7.3e-4 .. 7.6e-4 (ODE state and time
#: grid stay float32); the bounds leave ~3x for GPU kernels (docs/architecture.md, "Step-Audio2 DiT token2wav")
HALF_BOUND = {torch.bfloat16: 2e-2, torch.float16: 3e-3}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_half_precision_within_bound(t2w, dtype):
    import copy

    t = dit_tensors((OFFLINE_FLOW or E2E_OFFLINE)[0])
    ref_flow = copy.deepcopy(t2w.flow).cuda()
    half = copy.deepcopy(t2w.flow).cuda().to(dtype)
    half.set_noise(t2w.flow.rand_noise)  # the same float32 noise (the cast rounded the buffer)
    args = (t["token"][0], t["prompt_token"][0], t["prompt_feat"][0].cuda(), t["embedding"][0].cuda())
    ref, got = ref_flow.inference(*args), half.inference(*args)
    assert got.dtype == torch.float32
    err = rel_l2(got, ref)
    print(f"{dtype} offline mel vs float32: {err:.2e}")
    assert err < HALF_BOUND[dtype]
    s = dit_tensors((STREAM_FLOW or E2E_STREAM)[0])
    half.enable_cuda_graphs()
    for a, b in zip(_gpu_streams(half, s, chunks=3), _gpu_streams(ref_flow, s, chunks=3)):
        e = rel_l2(a, b)
        print(f"{dtype} streaming mel vs float32: {e:.2e}")
        assert e < HALF_BOUND[dtype]


def test_backend_jobs_and_setup_cache(t2w):
    """DitToken2WavBackend: offline and streaming jobs in one batch equal DitToken2Wav's own calls; a second
    stream of the same prompt reuses the cached set-up."""
    from types import SimpleNamespace

    from cosyserve.engine.token2wav import Token2WavJob
    from cosyserve.engine.token2wav_dit import DitToken2WavBackend
    from cosyserve.models.hift import HiFTStreamState

    t = dit_tensors((STREAM_FLOW or E2E_STREAM)[0])
    voice = SimpleNamespace(flow_speech_token=t["prompt_token"][0], speech_feat=t["prompt_feat"][0],
                            flow_embedding=t["embedding"][0])
    be = DitToken2WavBackend(t2w)
    toks = t["stream_token"][0]
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 1, 2)]
    jobs = [Token2WavJob(voice, toks[:28], 0, False, True, HiFTStreamState(), gens[0]),
            Token2WavJob(voice, toks[:20], 0, True, False, HiFTStreamState(), gens[1])]
    r1, r2 = be.run(jobs)
    assert be.setup_hits == 0 and len(be._setups) == 1
    st = t2w.stream_setup(t["prompt_token"][0], t["prompt_feat"][0], t["embedding"][0])
    ref1, _ = t2w.stream_step(st, toks[:28], False, gens[2])
    ref2 = t2w.offline(toks[:20], t["prompt_token"][0], t["prompt_feat"][0], t["embedding"][0], gens[3])
    # flow batching noise (~1e-7) amplified by HiFT's F0 phase: the waveform tolerance of the engine tests
    assert r1.speech.shape == ref1[0].shape and rel_l2(r1.speech, ref1[0]) <= 2e-3
    assert r2.speech.shape == ref2[0].shape and rel_l2(r2.speech, ref2[0]) <= 2e-3
    assert not r1.hift_state.empty and r2.hift_state.empty
    # the stream goes on (state from the result); a new stream of the same voice hits the cache
    g3 = torch.Generator().manual_seed(3)
    r3, r4 = be.run([Token2WavJob(voice, toks[:40], 25, True, False, r1.hift_state, g3),
                     Token2WavJob(voice, toks[:28], 0, False, True, HiFTStreamState(), torch.Generator())])
    assert be.setup_hits == 1
    assert r3.speech.shape == (2 * 15 * 480 + 3840,) and r3.hift_state.empty



def test_backend_solves_offline_utterances_in_groups_the_graphs_plan(t2w):
    """With solve graphs planned for offline utterances in solves of up to ``offline_rows``, the DiT
    backend runs a batch's offline items in groups of at most that many (longest first), then one pass
    of its streaming items (last: their cache write-back reads the solve buffers); every result equals
    the ungrouped batch's."""
    import copy
    from types import SimpleNamespace

    from cosyserve.engine.token2wav import Token2WavJob
    from cosyserve.engine.token2wav_dit import DitToken2WavBackend
    from cosyserve.models.dit_token2wav import DitToken2Wav
    from cosyserve.models.hift import HiFTStreamState

    t = dit_tensors((STREAM_FLOW or E2E_STREAM)[0])
    voice = SimpleNamespace(flow_speech_token=t["prompt_token"][0], speech_feat=t["prompt_feat"][0],
                            flow_embedding=t["embedding"][0])
    toks = t["stream_token"][0]

    def jobs():
        offline = [Token2WavJob(voice, toks[:n], 0, True, False, HiFTStreamState(), torch.Generator().manual_seed(n))
                   for n in (20, 33, 9, 41, 27)]
        stream = Token2WavJob(voice, toks[:28], 0, False, True, HiFTStreamState(), torch.Generator().manual_seed(1))
        return offline[:2] + [stream] + offline[2:]

    ref = DitToken2WavBackend(t2w).run(jobs())
    flow = copy.deepcopy(t2w.flow)
    graph = flow.enable_cuda_graphs(frames_bucket=16, cache_bucket=48)
    graph.coarse_uncached, graph.offline_rows = True, 2
    calls = []
    forward = flow.forward_items
    flow.forward_items = lambda items, **kw: calls.append([int(it.tokens.numel()) for it in items]) or \
        forward(items, **kw)
    got = DitToken2WavBackend(DitToken2Wav(flow, t2w.hift)).run(jobs())
    assert len(calls[0]) == 1 and calls[-1] == [28]  # the stream's set-up first, its chunk last
    q = calls[1][0] - 41  # an offline item's prompt tokens
    assert calls[1:-1] == [[q + 41, q + 33], [q + 27, q + 20], [q + 9]]  # offline in pairs, longest first
    for a, b in zip(got, ref):
        assert a.speech.shape == b.speech.shape and rel_l2(a.speech, b.speech) <= 2e-3

"""CosyVoice3 flow (DiT), causal HiFT and token2wav streaming against the upstream golden data.

Cases are discovered from the sidecars under the CosyVoice3 reference directory
(:mod:`_reference_cv3`) by kind and by the tensors / fields they hold; tolerances are 1e-4
relative L2 in float32 (bit-exactness is printed, never required).
"""

from __future__ import annotations

import pytest
import torch

from cosyserve.errors import CheckpointError
from cosyserve.models.checkpoint import load_strict, normalize_weight_norm_keys, read_state_dict
from cosyserve.models.config import load_hyperpyyaml
from cosyserve.models.cv3_flow import CV3FlowModel, load_cv3_flow, parse_cv3_flow
from cosyserve.models.hift import CausalHiFTGenerator, CausalSourceNoise, load_hift, parse_causal_hift
from dataclasses import replace

from cosyserve.engine.token2wav_cv3 import (CV3BatchItem, CV3StreamSchedule, after_flow, after_hift, new_stream,
                                            plan_chunk, stream_token2wav, token2wav_batch)

from _reference import DEVICE_WAVE_TOL, PARITY_TOL, WAVE_TOL, check_close, rel_l2
from _reference_cv3 import flow_fixture, hift_fixture, yaml_data_fixture  # noqa: F401  (fixtures)
from _reference_cv3 import discover, manifests_dir, meta, model_dir, tensors

FLOW_CASES = discover("flow", has=("token", "prompt_token", "prompt_feat", "embedding", "mu", "spks", "cond",
                                   "est0_x_in", "est0_out", "mel"))
CFM_NOISE_CASES = discover("flow", has=("rand_noise_prefix",))
HIFT_CASES = discover("hift", has=("mel", "f0", "source", "speech"))
HIFT_STREAM_CASES = discover("hift", has=("mel",), where=lambda m: bool(m.get("calls")))
HIFT_NOISE_CASES = discover("hift", has=("rand_ini", "sine_waves_prefix", "uv_prefix"))
STREAM_CASES = discover("stream", has=("source_speech_token", "prompt_token", "prompt_feat", "embedding"),
                        where=lambda m: bool(m.get("chunks")))


def _report(what: str, err: float, exact: bool | None = None) -> None:
    extra = "" if exact is None else (" (bit-exact)" if exact else " (not bit-exact)")
    print(f"[cv3] {what}: rel_l2={err:.3e}{extra}")






# ----------------------------------------------------------------------------------------------
# flow
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", FLOW_CASES)
def test_flow_offline(flow, case, one_thread):
    t, md = tensors(case), meta(case)
    streaming, finalize = bool(md.get("streaming", False)), bool(md.get("finalize", True))
    c = flow.condition([t["token"]], [t["prompt_token"]], [t["prompt_feat"]], t["embedding"], streaming, finalize)
    check_close(c.mu, t["mu"], f"{case} mu")
    check_close(c.spks, t["spks"], f"{case} spks")
    check_close(c.cond, t["cond"], f"{case} cond")
    # first Euler step: the CFG batch (row 0 conditional, row 1 with mu/spks/cond zeroed) at t_span[0]
    x = t["est0_x_in"]
    frames = x.shape[-1]
    t0 = flow.decoder.time_span(flow.cfg.cfm.n_timesteps, x.device, x.dtype)[0]
    z = torch.zeros_like
    with torch.inference_mode():
        v = flow.decoder.estimator(x, torch.ones(2, 1, frames), torch.cat([t["mu"], z(t["mu"])]), t0.expand(2),
                                   torch.cat([t["spks"], z(t["spks"])]), torch.cat([t["cond"], z(t["cond"])]),
                                   streaming=streaming)
    check_close(v, t["est0_out"], f"{case} est0_out")
    mel = flow.inference(t["token"], t["prompt_token"], t["prompt_feat"], t["embedding"], streaming, finalize)
    check_close(mel, t["mel"], f"{case} mel")


@pytest.mark.parametrize("case", CFM_NOISE_CASES)
def test_flow_cfm_noise(flow, case):
    want = tensors(case)["rand_noise_prefix"]
    full = meta(case).get("full_shape")
    if full:
        assert list(flow.rand_noise.shape) == list(full)
    got = flow.rand_noise[..., :want.shape[-1]]
    assert torch.equal(got, want), "the fixed CFM noise differs from upstream's"


def test_flow_batch_equals_single(flow, one_thread):
    """Items of different lengths (with/without prompt, final and non-final, streaming and
    offline attention) in one padded batch equal the single-item calls."""
    if not FLOW_CASES:
        pytest.skip("no flow cases")
    items = []
    for k, case in enumerate(FLOW_CASES):
        t = tensors(case)
        items.append((t["token"], t["prompt_token"], t["prompt_feat"], t["embedding"], k % 2 == 0, True))
        if t["token"].shape[1] > flow.pre_lookahead_len + 1:
            items.append((t["token"][:, :-1], t["prompt_token"], t["prompt_feat"], t["embedding"], True, False))
    single = [flow.inference(tok, pt, pf, emb, st, fin) for tok, pt, pf, emb, st, fin in items]
    batch = flow.inference_batch([i[0] for i in items], [i[1] for i in items], [i[2] for i in items],
                                 torch.cat([i[3] for i in items]), [i[4] for i in items], [i[5] for i in items])
    for k, (a, b) in enumerate(zip(batch, single)):
        check_close(a, b, f"batch item {k} (streaming={items[k][4]}, finalize={items[k][5]})", 1e-5)


# ----------------------------------------------------------------------------------------------
# causal HiFT
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", HIFT_CASES)
def test_hift_offline(hift, case, one_thread):
    t = tensors(case)
    finalize = bool(meta(case).get("finalize", True))
    f0 = hift.predict_f0(t["mel"].to(t["f0"].dtype), finalize)  # F0 in the reference's dtype (float64)
    check_close(f0, t["f0"], f"{case} f0")
    speech, source = hift.inference(t["mel"], finalize)
    check_close(source, t["source"], f"{case} source")
    check_close(speech, t["speech"], f"{case} speech")
    # decode alone from the reference excitation (well conditioned)
    with torch.inference_mode():
        check_close(hift.decode(t["mel"], t["source"], finalize=finalize), t["speech"], f"{case} decode(ref source)")


@pytest.mark.parametrize("case", HIFT_STREAM_CASES)
def test_hift_streaming(hift, case, one_thread):
    """HiFT re-run over the accumulated mel as CosyVoice3Model.token2wav drives it."""
    t, calls = tensors(case), meta(case)["calls"]
    offset = 0
    for i, call in enumerate(calls):
        raw, _ = hift.inference(t["mel"][:, :, :call["mel_frames_in"]], bool(call["finalize"]))
        assert raw.shape[1] == call["raw_samples"]
        assert offset == call["speech_offset_before"]
        check_close(raw, t[f"c{i}_raw_speech"], f"{case} call {i} raw speech")
        yielded = raw[:, offset:]
        assert yielded.shape[1] == call["yielded_samples"]
        offset += yielded.shape[1]


def test_hift_batch_equals_single(hift, one_thread):
    """Final and non-final items of different lengths in one padded decoder pass."""
    mels = [tensors(c)["mel"] for c in HIFT_CASES + HIFT_STREAM_CASES]
    if not mels:
        pytest.skip("no hift cases")
    longest = max(mels, key=lambda m: m.shape[-1])
    items = [(m, True) for m in mels] + [(longest[:, :, :n], False) for n in (longest.shape[-1] - 5, 12)]
    speeches, sources = hift.inference_batch([m for m, _ in items], [f for _, f in items])
    for k, ((m, f), a, s) in enumerate(zip(items, speeches, sources)):
        b, bs = hift.inference(m, f)
        assert torch.equal(s, bs)  # F0 and excitation run item by item
        check_close(a, b, f"hift batch item {k} ({m.shape[-1]} frames, finalize={f})", 1e-5)


@pytest.mark.parametrize("case", HIFT_NOISE_CASES)
def test_hift_noise(hift, case):
    t = tensors(case)
    n = t["sine_waves_prefix"].shape[1]
    assert torch.equal(hift.noise.rand_ini(), t["rand_ini"])
    assert torch.equal(hift.noise.sine_waves(n), t["sine_waves_prefix"])
    assert torch.equal(hift.noise.uv(t["uv_prefix"].shape[1]), t["uv_prefix"])


def test_noise_beyond_buffer_is_an_error(hift):
    with pytest.raises(ValueError, match="fixed noise"):
        hift.noise.sine_waves(hift.cfg.noise_samples + 1)


def test_hift_short_nonfinal_mel_is_an_error(hift):
    with pytest.raises(ValueError, match="more than"):
        hift.inference(torch.zeros(1, hift.cfg.in_channels, hift.f0_lookahead), finalize=False)


# ----------------------------------------------------------------------------------------------
# token2wav streaming
# ----------------------------------------------------------------------------------------------


def _schedule(md: dict, flow) -> CV3StreamSchedule:
    r = md.get("schedule_rules", {})
    return CV3StreamSchedule(
        token_hop_len=int(r.get("token_hop_len_initial", 25)), token_max_hop_len=int(r.get("token_max_hop_len", 100)),
        stream_scale_factor=int(r.get("stream_scale_factor", 2)),
        pre_lookahead_len=int(r.get("pre_lookahead_len", flow.pre_lookahead_len)),
        token_mel_ratio=flow.token_mel_ratio,
    )


@pytest.mark.parametrize("case", STREAM_CASES)
def test_stream_token2wav(flow, hift, case, one_thread):
    t, md = tensors(case), meta(case)
    sched = _schedule(md, flow)
    if "prompt_token_pad" in md.get("schedule_rules", {}):
        pad = md["schedule_rules"]["prompt_token_pad"]
        assert new_stream(t["prompt_token"].shape[1], sched).prompt_token_pad == pad
    traces = list(stream_token2wav(flow, hift, t["source_speech_token"], t["prompt_token"], t["prompt_feat"],
                                   t["embedding"], stream=True, schedule=sched))
    assert len(traces) == len(md["chunks"])
    offset = 0
    for i, (tr, ch) in enumerate(zip(traces, md["chunks"])):
        assert tr.job.n_tokens == ch["n_tokens"] and tr.job.token_offset == ch["token_offset"]
        assert tr.job.streaming == ch["flow_streaming"] and tr.job.finalize == ch["flow_finalize"]
        assert offset == ch["speech_offset_before"]
        check_close(tr.flow_mel, t[f"c{i}_flow_mel"], f"{case} chunk {i} flow mel")
        check_close(tr.hift_mel, t[f"c{i}_hift_mel_in"], f"{case} chunk {i} hift mel in")
        # speech from OUR mel: its ~1e-7 rounding, integrated into the excitation phase -> WAVE_TOL
        # (HiFT from upstream's mel: test_hift_offline / test_hift_streaming, PARITY_TOL)
        check_close(tr.speech, t[f"c{i}_speech"], f"{case} chunk {i} speech", WAVE_TOL)
        assert tr.speech.shape[1] == ch["yielded_samples"]
        offset += tr.speech.shape[1]


E2E_CASES = discover("e2e", has=("speech_token", "mel", "speech"), where=lambda m: bool(m.get("prompt_wav")))


def _frontend_for(wav: str) -> str | None:
    """The frontend case holding the zero-shot flow prompt of ``wav`` (matched by its sidecar)."""
    names = discover("frontend", has=("zs_flow_prompt_speech_token", "zs_prompt_speech_feat", "embedding"),
                     where=lambda m: m.get("wav_file") == wav)
    return names[0] if names else None


@pytest.mark.parametrize("case", E2E_CASES)
def test_offline_token2wav_e2e(flow, hift, case, one_thread):
    """The non-streaming token2wav of an end-to-end case (its speech tokens, the flow prompt from
    the frontend case of the same prompt wav): one final call, flow mel and speech."""
    md = meta(case)
    fe = _frontend_for(md["prompt_wav"])
    if fe is None:
        pytest.skip(f"no frontend case for {md['prompt_wav']}")
    t, f = tensors(case), tensors(fe)
    traces = list(stream_token2wav(flow, hift, t["speech_token"], f["zs_flow_prompt_speech_token"],
                                   f["zs_prompt_speech_feat"], f["embedding"], stream=False))
    assert len(traces) == 1 and traces[0].job.finalize and not traces[0].job.streaming
    check_close(traces[0].flow_mel, t["mel"], f"{case} offline mel")
    check_close(traces[0].speech, t["speech"], f"{case} offline speech", WAVE_TOL)  # from our mel
    slow = list(stream_token2wav(flow, hift, t["speech_token"], f["zs_flow_prompt_speech_token"],
                                 f["zs_prompt_speech_feat"], f["embedding"], stream=False, speed=2.0))
    assert slow[0].hift_mel.shape[-1] == int(t["mel"].shape[-1] / 2.0)
    with pytest.raises(ValueError, match="speed"):
        list(stream_token2wav(flow, hift, t["speech_token"], f["zs_flow_prompt_speech_token"],
                              f["zs_prompt_speech_feat"], f["embedding"], stream=True, speed=2.0))


@pytest.mark.parametrize("case", STREAM_CASES)
def test_token2wav_batch_equals_single(flow, hift, case, one_thread):
    """Two requests in different phases (one a chunk ahead, one not streaming) batched chunk by
    chunk: the flow mels equal the single-request runs (1e-5) and the speech equals HiFT run alone
    on the batch's mel. The speech is not compared with the single runs at 1e-5: the padded flow
    pass differs from single calls by float rounding (~1e-7 on the mel), which the causal HiFT's
    excitation phase (the running integral of F0 over the whole accumulated mel) amplifies with
    length (measured 1e-4 .. 5e-4 on this 3.6 s case; printed)."""
    t, md = tensors(case), meta(case)
    sched = _schedule(md, flow)
    args = (t["source_speech_token"], t["prompt_token"], t["prompt_feat"], t["embedding"])
    single = list(stream_token2wav(flow, hift, *args, stream=True, schedule=sched))
    offline = list(stream_token2wav(flow, hift, *args, stream=False, schedule=sched))[0]
    n = args[0].shape[1]
    lead = new_stream(args[1].shape[1], sched)
    lead = after_hift(lead, single[0].job, single[0].speech)[1]  # its first chunk was already done
    lead = replace(lead, mel=single[0].hift_mel)
    lag = new_stream(args[1].shape[1], sched)
    off = new_stream(args[1].shape[1], sched)
    got_lead, got_lag = single[:1], []
    while not lag.finished:
        items = []
        if not lead.finished:
            items.append(CV3BatchItem(lead, plan_chunk(lead, n, True), *args))
        items.append(CV3BatchItem(lag, plan_chunk(lag, n, True), *args))
        if not off.finished:
            items.append(CV3BatchItem(off, plan_chunk(off, n, True, stream=False), *args))
        res = token2wav_batch(flow, hift, items)
        if not lead.finished:
            (tr, lead), res = res[0], res[1:]
            got_lead.append(tr)
        (tr, lag), res = res[0], res[1:]
        got_lag.append(tr)
        if res:
            (tr_off, off), = res
            check_close(tr_off.flow_mel, offline.flow_mel, "batched offline flow mel", 1e-5)
            _report("batched offline speech vs single run (informative)", rel_l2(tr_off.speech, offline.speech))
    for name, got in (("lead", got_lead), ("lag", got_lag)):
        assert [g.job for g in got] == [s.job for s in single]
        offset = 0
        for i, (g, s) in enumerate(zip(got, single)):
            check_close(g.flow_mel, s.flow_mel, f"batched {name} chunk {i} flow mel", 1e-5)
            # HiFT of the batch's own accumulated mel, run alone: the batched HiFT pass is plumbed right
            alone = hift.inference(g.hift_mel, g.job.finalize)[0][:, offset:]
            check_close(g.speech, alone, f"batched {name} chunk {i} speech vs HiFT alone", 1e-5)
            _report(f"batched {name} chunk {i} speech vs single run (informative)", rel_l2(g.speech, s.speech))
            offset += g.speech.shape[1]


def test_schedule_waits_and_grows():
    """Pure schedule logic: nothing is due before hop + look-ahead tokens, hops double up to the
    maximum, the final chunk comes only when the LM is done, and nothing after it."""
    s = new_stream(87)
    assert s.prompt_token_pad == 13
    assert plan_chunk(s, 40, llm_done=False) is None
    job = plan_chunk(s, 41, llm_done=False)
    assert (job.n_tokens, job.hop, job.finalize) == (41, 38, False)
    mel, s = after_flow(s, job, torch.zeros(1, 80, 76))
    _, s = after_hift(s, job, torch.zeros(1, 480 * 68))
    assert (s.token_offset, s.hop_len, s.speech_offset) == (38, 50, 480 * 68)
    assert plan_chunk(s, 90, llm_done=False) is None
    final = plan_chunk(s, 90, llm_done=True)
    assert final.finalize and final.n_tokens == 90 and final.token_offset == 38
    _, s = after_flow(s, final, torch.zeros(1, 80, 2 * 90))
    assert s.mel.shape[-1] == 76 + 2 * (90 - 38)
    speech, s = after_hift(s, final, torch.ones(1, 480 * s.mel.shape[-1]))
    assert speech.shape[1] == 480 * s.mel.shape[-1] - 480 * 68 and s.finished
    with pytest.raises(ValueError):
        plan_chunk(s, 90, llm_done=True)
    offline = plan_chunk(new_stream(0), 10, llm_done=True, stream=False)
    assert offline.finalize and not offline.streaming and offline.token_offset == 0


# ----------------------------------------------------------------------------------------------
# checkpoints and full-size structure
# ----------------------------------------------------------------------------------------------


def test_strict_loading_and_legacy_weight_norm(yaml_data, hift, one_thread):
    cfg = parse_causal_hift(yaml_data)
    sd = read_state_dict(model_dir() / "hift.pt")
    legacy = {}
    for k, v in sd.items():
        k = k.replace(".parametrizations.weight.original0", ".weight_g").replace(".parametrizations.weight.original1",
                                                                                ".weight_v")
        legacy[k] = v
    assert any(k.endswith(".weight_g") for k in legacy)
    m = CausalHiFTGenerator(cfg)
    load_strict(m, normalize_weight_norm_keys(legacy, strip_prefix="generator."), "legacy hift.pt")
    m.remove_weight_norm()
    m.eval()
    mel = torch.randn(1, cfg.in_channels, 20, generator=torch.Generator().manual_seed(0))
    a, _ = m.inference(mel)
    b, _ = hift.inference(mel)
    assert torch.equal(a, b)
    broken = dict(sd)
    broken.pop(next(iter(broken)))
    with pytest.raises(CheckpointError, match="missing"):
        load_strict(CausalHiFTGenerator(cfg), broken, "hift.pt")
    fsd = read_state_dict(model_dir() / "flow.pt")
    fsd["decoder.estimator.unexpected"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match="unexpected"):
        load_strict(CV3FlowModel(parse_cv3_flow(yaml_data)), fsd, "flow.pt")


def _real_yaml():
    p = manifests_dir() / "cosyvoice3.real.yaml"
    if not p.is_file():
        pytest.skip("no full-size cosyvoice3.real.yaml in the manifests")
    return load_hyperpyyaml(p)


def _manifest(component: str) -> dict:
    import json

    p = manifests_dir() / f"{component}_state_dict.json"
    if not p.is_file():
        pytest.skip(f"no {p.name}")
    return json.loads(p.read_text(encoding="utf-8"))


@pytest.mark.parametrize("component", ["flow", "hift"])
def test_full_size_state_dict_matches_manifest(component):
    data = _real_yaml()
    with torch.device("meta"):
        m = CV3FlowModel(parse_cv3_flow(data)) if component == "flow" else CausalHiFTGenerator(parse_causal_hift(data))
    man = _manifest(component)
    got = [(k, list(v.shape), str(v.dtype).replace("torch.", "")) for k, v in m.state_dict().items()]
    want = [(e["key"], list(e["shape"]), e["dtype"]) for e in man["tensors"]]
    assert got == want
    if "n_parameters_unique_storage" in man:
        assert sum(v.numel() for v in m.state_dict().values()) == man["n_parameters_unique_storage"]


def test_real_config_construction_noise():
    from safetensors.torch import load_file

    p = manifests_dir() / "real_config_construction_noise.safetensors"
    if not p.is_file():
        pytest.skip("no real_config_construction_noise in the manifests")
    want = load_file(str(p))
    data = _real_yaml()
    noise = CausalSourceNoise(parse_causal_hift(data))
    assert torch.equal(noise.rand_ini(), want["rand_ini"])
    assert torch.equal(noise.sine_waves(want["sine_waves_prefix"].shape[1]), want["sine_waves_prefix"])
    assert torch.equal(noise.uv(want["uv_prefix"].shape[1]), want["uv_prefix"])
    if "cfm_rand_noise_prefix" in want:
        with torch.device("meta"):
            flow = CV3FlowModel(parse_cv3_flow(data))
        n = want["cfm_rand_noise_prefix"].shape[-1]
        assert torch.equal(flow.rand_noise[..., :n], want["cfm_rand_noise_prefix"])


# ----------------------------------------------------------------------------------------------
# GPU (skipped without CUDA; run by the lead on the device machine)
# ----------------------------------------------------------------------------------------------

#: documented bounds vs float32: flow mel with the whole flow in half precision, HiFT speech with
#: its convolution trunk in half precision (F0 float64, excitation / STFTs float32), as test_gpu.py
HALF_TOL = {"mel": 5e-2, "speech_float16": 5e-3, "speech_bfloat16": 4e-2}
#: CUDA float32 (TF32 off) vs the CPU reference: the excitation phase integrates F0, so the
#: excitation and speech are platform-sensitive (see hift.py "Numerical parity"); mel is not.
#: Speech: DEVICE_WAVE_TOL (measured on an H100: 2.4e-4 .. 2.2e-3, growing with the accumulated mel)
GPU_TOL = {"mel": PARITY_TOL, "speech": DEVICE_WAVE_TOL}


@pytest.mark.gpu
def test_gpu_float32_matches_reference(yaml_data, no_tf32):
    flow = load_cv3_flow(model_dir() / "flow.pt", parse_cv3_flow(yaml_data), device="cuda")
    hift = load_hift(model_dir() / "hift.pt", parse_causal_hift(yaml_data), device="cuda")
    for case in FLOW_CASES:
        t, md = tensors(case), meta(case)
        mel = flow.inference(t["token"].cuda(), t["prompt_token"].cuda(), t["prompt_feat"].cuda(),
                             t["embedding"].cuda(), bool(md.get("streaming", False)), bool(md.get("finalize", True)))
        check_close(mel.cpu(), t["mel"], f"cuda {case} mel", GPU_TOL["mel"])
    for case in HIFT_CASES:
        t = tensors(case)
        speech, _ = hift.inference(t["mel"].cuda(), bool(meta(case).get("finalize", True)))
        check_close(speech.cpu(), t["speech"], f"cuda {case} speech", GPU_TOL["speech"])
    for case in STREAM_CASES:
        t = tensors(case)
        traces = stream_token2wav(flow, hift, t["source_speech_token"].cuda(), t["prompt_token"].cuda(),
                                  t["prompt_feat"].cuda(), t["embedding"].cuda(), schedule=_schedule(meta(case), flow))
        for i, tr in enumerate(traces):
            check_close(tr.flow_mel.cpu(), t[f"c{i}_flow_mel"], f"cuda {case} chunk {i} flow mel", GPU_TOL["mel"])
            check_close(tr.speech.cpu(), t[f"c{i}_speech"], f"cuda {case} chunk {i} speech", GPU_TOL["speech"])


@pytest.mark.gpu
def test_gpu_solver_step_graph_equals_eager(yaml_data, no_tf32):
    """One Euler step of the DiT solver captured as a CUDA graph and replayed n times equals the
    eager solve (the step has no host synchronisation)."""
    flow = load_cv3_flow(model_dir() / "flow.pt", parse_cv3_flow(yaml_data), device="cuda")
    case = FLOW_CASES[0] if FLOW_CASES else pytest.skip("no flow cases")
    t = tensors(case)
    with torch.inference_mode():
        c = flow.condition([t["token"].cuda()], [t["prompt_token"].cuda()], [t["prompt_feat"].cuda()],
                           t["embedding"].cuda(), True, True)
        eager = flow.solve(c)
        state = flow.decoder.begin(c.mu, c.mask, c.spks, c.cond, c.streaming)
        snap = [x.clone() for x in (state.xt, state.t, state.dt, state.k)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            flow.decoder.step(state)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        for dst, src in zip((state.xt, state.t, state.dt, state.k), snap):
            dst.copy_(src)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            flow.decoder.step(state)
        for dst, src in zip((state.xt, state.t, state.dt, state.k), snap):  # capture does not run the step
            dst.copy_(src)
        for _ in range(state.n):
            g.replay()
        graphed = state.mels()
    check_close(graphed.cpu(), eager.cpu(), "graphed solver vs eager", 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_half_precision_within_documented_error(yaml_data, dtype, no_tf32):
    ref_flow = load_cv3_flow(model_dir() / "flow.pt", parse_cv3_flow(yaml_data), device="cuda")
    half_flow = load_cv3_flow(model_dir() / "flow.pt", parse_cv3_flow(yaml_data), device="cuda", dtype=dtype)
    assert half_flow.decoder.estimator.rotary_embed.inv_freq.dtype == torch.float32
    for case in FLOW_CASES:
        t, md = tensors(case), meta(case)
        args = (t["token"].cuda(), t["prompt_token"].cuda(), t["prompt_feat"].cuda(), t["embedding"].cuda(),
                bool(md.get("streaming", False)), bool(md.get("finalize", True)))
        check_close(half_flow.inference(*args).cpu(), ref_flow.inference(*args).cpu(), f"{dtype} {case} mel vs float32",
                    HALF_TOL["mel"])
    ref_hift = load_hift(model_dir() / "hift.pt", parse_causal_hift(yaml_data), device="cuda")
    half_hift = load_hift(model_dir() / "hift.pt", parse_causal_hift(yaml_data), device="cuda").set_trunk_dtype(dtype)
    assert half_hift.f0_predictor.classifier.weight.dtype == torch.float64
    for case in HIFT_CASES:
        mel = tensors(case)["mel"].cuda()
        check_close(half_hift.inference(mel)[0].cpu(), ref_hift.inference(mel)[0].cpu(),
                    f"{dtype} {case} speech vs float32", HALF_TOL[f"speech_{str(dtype).replace('torch.', '')}"])

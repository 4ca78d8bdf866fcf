"""Parity tests of the HiFT vocoder (cosyserve.models.hift) against the upstream reference data.

Cases are discovered from ``../shared/reference/cases`` by kind and by the tensors they carry.
Deterministic checks (F0, decode, fade/trim, caches, source module from stored draws) use a relative
L2 tolerance of 1e-4 (``PARITY_TOL``, tests/_reference.py); seeded checks (random excitation drawn
from a ``torch.Generator`` seeded like upstream's global generator) are bit-exact in the reference
environment, with exactness reported in the test output (``-s``): given upstream's F0 the seeded
excitation is asserted to the same tolerance; from the mel (our F0, whose ~1e-7 rounding the
excitation integrates into its phase) to ``WAVE_TOL``. Only discrete values (the voiced flags) are
compared exactly.
"""

from __future__ import annotations


import pytest
import torch

from cosyserve.errors import CheckpointError
from cosyserve.models.checkpoint import load_strict, normalize_weight_norm_keys, read_state_dict
from cosyserve.models.config import load_config
from cosyserve.models.hift import (
    HiFTGenerator,
    HiFTStreamState,
    fade_in_with_cache,
    hift_stream_step,
    hift_stream_step_batch,
    stream_hift_input,
    stream_hift_output,
)

from _reference import PARITY_TOL as TOL
from _reference import SELF_TOL as BATCH_TOL
from _reference import WAVE_TOL
from _reference import (check_close, discover, full_size_config, manifest_shapes, meta, model_dir, rel_l2,
                        require_reference_dir, tensors)

HIFT_CASES = discover("hift", has=("mel", "f0", "source", "speech"))
INTERNALS_CASES = discover("hift", has=("mel", "f0_upsampled", "rand_ini", "sine_std_noise", "sine_waves", "uv", "source"))
E2E_CASES = discover("e2e", has=("mel", "source", "speech"))
STREAM_CASES = discover("stream", has=("speech_concat",), where=lambda m: bool(m.get("chunks")))

parity = pytest.mark.parity


def _report(what: str, err: float, exact: bool | None = None) -> None:
    extra = "" if exact is None else (" (bit-exact)" if exact else " (not bit-exact)")
    print(f"[hift] {what}: rel_l2={err:.3e}{extra}")




@pytest.fixture(scope="module")
def full_cfg():
    require_reference_dir()
    return load_config(model_dir() / "cosyvoice2.yaml")


@pytest.fixture(scope="module")
def hift_sd():
    require_reference_dir()
    return normalize_weight_norm_keys(read_state_dict(model_dir() / "hift.pt"), strip_prefix="generator.")


def _build(cfg, sd) -> HiFTGenerator:
    m = HiFTGenerator(cfg.hift)
    load_strict(m, sd, "hift.pt")
    return m.eval()


@pytest.fixture(scope="module")
def hift(full_cfg, hift_sd):
    return _build(full_cfg, hift_sd)


# ----------------------------------------------------------------------------------------------
# 1. HiFT cases: F0, decode (deterministic), seeded inference
# ----------------------------------------------------------------------------------------------


@parity
@pytest.mark.parametrize("case", HIFT_CASES)
def test_hift_case(hift, case, one_thread):
    t, md = tensors(case), meta(case)
    with torch.no_grad():
        f0 = hift.predict_f0(t["mel"])
        err = rel_l2(f0, t["f0"])
        _report(f"{case} f0", err, torch.equal(f0, t["f0"]))
        assert err <= TOL

        speech = hift.decode(t["mel"], t["source"])
        err = rel_l2(speech, t["speech"])
        _report(f"{case} decode(mel, source)", err, torch.equal(speech, t["speech"]))
        assert err <= TOL

        # the excitation given upstream's F0 and draws: the source module alone, exact to rounding
        gen = torch.Generator().manual_seed(int(md["seed"]))
        source = hift.excitation(t["f0"], gen)
        err = rel_l2(source, t["source"])
        _report(f"{case} seeded excitation(reference f0)", err, torch.equal(source, t["source"]))
        assert err <= TOL

    # end to end from the mel: our F0 (~1e-7 from upstream's on CPUs whose conv kernels sum in
    # another order) is integrated into the excitation phase, hence WAVE_TOL (_reference.py)
    gen = torch.Generator().manual_seed(int(md["seed"]))
    speech, source = hift.inference(t["mel"], generator=gen)
    e_src, e_sp = rel_l2(source, t["source"]), rel_l2(speech, t["speech"])
    _report(f"{case} seeded inference source", e_src, torch.equal(source, t["source"]))
    _report(f"{case} seeded inference speech", e_sp, torch.equal(speech, t["speech"]))
    assert e_src <= WAVE_TOL and e_sp <= WAVE_TOL


# ----------------------------------------------------------------------------------------------
# 2. source module internals from the stored random draws
# ----------------------------------------------------------------------------------------------


@parity
@pytest.mark.parametrize("case", INTERNALS_CASES)
def test_source_internals(hift, case, one_thread):
    t, md = tensors(case), meta(case)
    with torch.no_grad():
        f0_up = hift.upsample_f0(t["f0"])
        check_close(f0_up, t["f0_upsampled"], f"{case} f0_upsampled")

        sine, uv, source = hift.source_from_draws(t["f0_upsampled"], t["rand_ini"], t["sine_std_noise"])
        assert torch.equal(uv, t["uv"])  # 0/1 voiced flags of the reference's own f0_upsampled: discrete
        for name, got in (("sine_waves", sine), ("source", source)):
            err = rel_l2(got, t[name])
            _report(f"{case} {name} from stored draws", err, torch.equal(got, t[name]))
            assert err <= TOL

    # the draws themselves: same generator consumption as upstream (a wrong order or layout gives
    # unrelated numbers, relative L2 ~1.4; vectorised normal draws may differ in the last bit)
    gen = torch.Generator().manual_seed(int(md["seed"]))
    rand_ini, std_noise = hift.draw_excitation_noise(1, t["sine_std_noise"].shape[1], gen)
    check_close(rand_ini, t["rand_ini"], f"{case} rand_ini draw")
    check_close(std_noise, t["sine_std_noise"], f"{case} sine_std_noise draw")
    # and they are NOT randn(1, N, H+1): the transposed layout matters
    gen = torch.Generator().manual_seed(int(md["seed"]))
    torch.rand(t["rand_ini"].shape, generator=gen)
    assert rel_l2(torch.randn(t["sine_std_noise"].shape, generator=gen), t["sine_std_noise"]) > 100 * TOL


# ----------------------------------------------------------------------------------------------
# 3. end-to-end cases: decode(mel, source)
# ----------------------------------------------------------------------------------------------


@parity
@pytest.mark.parametrize("case", E2E_CASES)
def test_e2e_decode(hift, case, one_thread):
    t = tensors(case)
    with torch.no_grad():
        speech = hift.decode(t["mel"], t["source"])
    err = rel_l2(speech, t["speech"])
    _report(f"{case} decode(mel, source)", err, torch.equal(speech, t["speech"]))
    assert err <= TOL


# ----------------------------------------------------------------------------------------------
# 4. streaming
# ----------------------------------------------------------------------------------------------


def _chunk_mel(t, md, full_cfg, i):
    off = int(md["chunks"][i]["token_offset"]) * full_cfg.token_mel_ratio
    return t[f"c{i}_flow_mel"][:, :, off:]


@parity
@pytest.mark.parametrize("case", STREAM_CASES)
def test_stream_deterministic(hift, full_cfg, case, one_thread):
    """Each chunk with the reference HiFT outputs substituted (independent of the RNG)."""
    t, md = tensors(case), meta(case)
    chunks = md["chunks"]
    state = HiFTStreamState()
    outs = []
    for i, ch in enumerate(chunks):
        fin = bool(ch["finalize"])
        mel, cache_source = stream_hift_input(hift, state, _chunk_mel(t, md, full_cfg, i), fin)
        # copies of reference tensors (flow mel, previous source): exact when the reference is
        # self-consistent, asserted to the tolerance
        check_close(mel, t[f"c{i}_hift_mel_in"], f"{case} c{i} mel fed to HiFT")
        ref_cache = t[f"c{i}_cache_source"]
        if ref_cache.shape[-1] == 0:
            assert cache_source is None
        else:
            check_close(cache_source, ref_cache, f"{case} c{i} cache_source")

        with torch.no_grad():
            speech = hift.decode(t[f"c{i}_hift_mel_in"], t[f"c{i}_source"])
        err = rel_l2(speech, t[f"c{i}_hift_speech"])
        _report(f"{case} c{i} decode", err, torch.equal(speech, t[f"c{i}_hift_speech"]))
        assert err <= TOL
        # the excitation used starts with the cached source
        n = ref_cache.shape[-1]
        if n:
            check_close(t[f"c{i}_source"][..., :n], ref_cache, f"{case} c{i} source starts with the cache")

        out, state = stream_hift_output(state, t[f"c{i}_hift_speech"], t[f"c{i}_source"], mel, fin)
        err = rel_l2(out, t[f"c{i}_out_speech"])
        _report(f"{case} c{i} fade/trim output", err, torch.equal(out, t[f"c{i}_out_speech"]))
        assert err <= TOL
        outs.append(out)
        if i + 1 < len(chunks):
            check_close(state.source, t[f"c{i + 1}_cache_source"], f"{case} c{i} new source cache")
            n_mel = state.mel.shape[-1]
            check_close(state.mel, t[f"c{i + 1}_hift_mel_in"][:, :, :n_mel], f"{case} c{i} new mel cache")
        else:
            assert state.empty
    err = rel_l2(torch.cat(outs, dim=1), t["speech_concat"])
    _report(f"{case} concatenated output (reference HiFT outputs)", err)
    assert err <= TOL


@parity
@pytest.mark.parametrize("case", STREAM_CASES)
def test_stream_seeded(hift, full_cfg, case, one_thread):
    """The whole stream with one generator seeded like upstream, chunks in order. HiFT predicts
    F0 itself here, so its rounding is integrated into the phase: WAVE_TOL (each stage alone is
    checked at PARITY_TOL above and in test_hift_case)."""
    t, md = tensors(case), meta(case)
    gen = torch.Generator().manual_seed(int(md["seed"]))
    state = HiFTStreamState()
    outs = []
    for i, ch in enumerate(md["chunks"]):
        out, state = hift_stream_step(hift, state, _chunk_mel(t, md, full_cfg, i), bool(ch["finalize"]), gen)
        err = rel_l2(out, t[f"c{i}_out_speech"])
        _report(f"{case} seeded c{i} output", err, torch.equal(out, t[f"c{i}_out_speech"]))
        assert err <= WAVE_TOL
        outs.append(out)
    speech = torch.cat(outs, dim=1)
    err = rel_l2(speech, t["speech_concat"])
    _report(f"{case} seeded speech_concat", err, torch.equal(speech, t["speech_concat"]))
    assert err <= WAVE_TOL


def test_fade_float64_semantics():
    """Fade is evaluated in float64 (numpy window) and rounded once to float32."""
    import numpy as np

    g = torch.Generator().manual_seed(0)
    new, old = torch.randn(1, 100, generator=g), torch.randn(1, 40, generator=g)
    w = np.hamming(80)
    ref = new.clone()
    ref[..., :40] = new[..., :40] * torch.from_numpy(w[:40]) + old[..., -40:] * torch.from_numpy(w[40:])
    got = fade_in_with_cache(new, old, 40)
    assert got.dtype == torch.float32 and torch.equal(got, ref)  # the same float64 formula: exact by construction
    with pytest.raises(ValueError):
        fade_in_with_cache(new[:, :10], old, 40)


# ----------------------------------------------------------------------------------------------
# 5. batched path == single-item runs
# ----------------------------------------------------------------------------------------------


def _batch_inputs():
    """Mels of mixed lengths from the reference cases (hift, e2e and stream chunk inputs)."""
    mels = [tensors(c)["mel"] for c in HIFT_CASES + E2E_CASES]
    for c in STREAM_CASES:
        t = tensors(c)
        mels += [t[f"c{i}_hift_mel_in"] for i in range(len(meta(c)["chunks"]))]
    # keep the test fast: at most 4 items, shortest first, distinct lengths
    by_len = {}
    for m in mels:
        by_len.setdefault(m.shape[-1], m)
    return [by_len[k] for k in sorted(by_len)][:4]


@parity
@pytest.mark.parametrize("with_cache", [False, True])
def test_batch_equals_single(hift, with_cache):
    mels = _batch_inputs()
    if len(mels) < 2:
        pytest.skip("need at least two reference mels of different lengths")
    spf = hift.samples_per_frame
    g = torch.Generator().manual_seed(7)
    caches = [None] * len(mels)
    if with_cache:
        # mixed: some items with a cache of various sizes, one without
        caches = [None if b == 1 else 0.1 * torch.randn(1, 1, min(8 * spf, m.shape[-1] * spf) - 3 * b, generator=g)
                  for b, m in enumerate(mels)]
    seeds = [100 + b for b in range(len(mels))]
    singles = [hift.inference(m, c, torch.Generator().manual_seed(s)) for m, c, s in zip(mels, caches, seeds)]
    sp_b, so_b = hift.inference_batch(mels, caches, [torch.Generator().manual_seed(s) for s in seeds])
    for b, ((sp, so), sp2, so2) in enumerate(zip(singles, sp_b, so_b)):
        assert sp2.shape == sp.shape and so2.shape == so.shape
        e_so, e_sp = rel_l2(so2, so), rel_l2(sp2, sp)
        _report(f"batch (cache={with_cache}) item {b} T={mels[b].shape[-1]} source", e_so, torch.equal(so2, so))
        _report(f"batch (cache={with_cache}) item {b} T={mels[b].shape[-1]} speech", e_sp, torch.equal(sp2, sp))
        assert e_so <= BATCH_TOL and e_sp <= BATCH_TOL


@parity
def test_batched_f0_is_one_float64_pass_independent_of_batch_mates(hift, one_thread):
    """``batched_f0``: the F0 of the whole batch in one masked float64 pass (``predict_f0_batched``,
    for a batch of one too), frames beyond an item's length 0. An item's F0 is then the same alone
    and in any batch (float64 rounding is far below float32's), so its source and speech equal its
    single-item run in that mode as the per-item mode's do (SELF_TOL); its F0 is within float32
    rounding of the per-item float32 F0 and of upstream's. The float64 weight copies are no
    parameters (state_dict unchanged) and follow changes of the weights."""
    mels = _batch_inputs()
    if len(mels) < 2:
        pytest.skip("need at least two reference mels of different lengths")
    seeds = [300 + b for b in range(len(mels))]
    keys = list(hift.state_dict())
    calls = []
    predict = hift.predict_f0_batched

    def counting(mel, lengths):
        calls.append(tuple(mel.shape))
        return predict(mel, lengths)

    hift.batched_f0 = True
    try:
        hift.predict_f0_batched = counting
        sp_b, so_b = hift.inference_batch(mels, None, [torch.Generator().manual_seed(s) for s in seeds])
        assert calls == [(len(mels), mels[0].shape[1], max(m.shape[-1] for m in mels))]  # one pass
        # alone, in the same mode (a batch of one takes the float64 pass too), and reversed
        singles = [hift.inference_batch([m], None, [torch.Generator().manual_seed(s)]) for m, s in zip(mels, seeds)]
        assert len(calls) == 1 + len(mels)
        rev_sp, _ = hift.inference_batch(mels[::-1], None, [torch.Generator().manual_seed(s) for s in seeds[::-1]])
    finally:
        hift.batched_f0 = False
        del hift.predict_f0_batched  # the bound method again
    assert list(hift.state_dict()) == keys  # the float64 copies are not registered

    t_max = max(m.shape[-1] for m in mels)
    mel = torch.cat([torch.nn.functional.pad(m, (0, t_max - m.shape[-1])) for m in mels])
    lens = torch.tensor([m.shape[-1] for m in mels])
    with torch.no_grad():
        f0 = hift.predict_f0_batched(mel, lens)
        assert f0.dtype == mel.dtype
        for b, m in enumerate(mels):
            n = m.shape[-1]
            alone = hift.predict_f0_batched(m, lens[b:b + 1])[0]
            assert torch.all(f0[b, n:] == 0)
            assert torch.equal(f0[b, :n], alone), f"item {b}: its F0 depends on its batch-mates"
            per_item = hift.predict_f0(m)[0]  # float32, the default mode
            _report(f"float64 F0 item {b} T={n} vs per-item float32", rel_l2(alone, per_item))
            assert rel_l2(alone, per_item) <= BATCH_TOL
    for b, ((sp, so), sp2, so2) in enumerate(zip(singles, sp_b, so_b)):
        e_so, e_sp = rel_l2(so2, so[0]), rel_l2(sp2, sp[0])
        _report(f"batched F0 item {b} source / speech vs alone", max(e_so, e_sp), torch.equal(sp2, sp[0]))
        assert e_so <= BATCH_TOL and e_sp <= BATCH_TOL, b
        assert rel_l2(rev_sp[len(mels) - 1 - b], sp[0]) <= BATCH_TOL, b

    # the copy follows the weights (here: a changed F0 predictor, then restored)
    w = hift.f0_predictor.classifier.bias
    with torch.no_grad():
        before = hift.predict_f0_batched(mel, lens)
        w.add_(1.0)
        moved = hift.predict_f0_batched(mel, lens)
        w.sub_(1.0)
    assert not torch.equal(before, moved)
    with pytest.raises(ValueError, match="lengths"):
        hift.predict_f0_batched(mel, lens[:1])


@parity
def test_batched_f0_matches_upstream(hift, one_thread):
    """The float64 F0 pass against the reference cases' float32 F0 (upstream's own rounding, ~1e-7)."""
    for case in HIFT_CASES:
        t = tensors(case)
        with torch.no_grad():
            f0 = hift.predict_f0_batched(t["mel"], torch.tensor([t["mel"].shape[-1]]))
        _report(f"{case} float64 F0", rel_l2(f0, t["f0"]), torch.equal(f0, t["f0"]))
        assert rel_l2(f0, t["f0"]) <= TOL


@parity
def test_batch_default_generator_and_equal_lengths(hift):
    mels = _batch_inputs()[:2]
    # default (global) generator: items draw in order, like consecutive single calls
    torch.manual_seed(5)
    singles = [hift.inference(m) for m in mels]
    torch.manual_seed(5)
    sp_b, _ = hift.inference_batch(mels)
    for (sp, _), sp2 in zip(singles, sp_b):
        assert rel_l2(sp2, sp) <= BATCH_TOL
    # decode with lengths on an unpadded batch equals decode without
    m = mels[0]
    mel = torch.cat([m, m + 0.1], dim=0)
    with torch.no_grad():
        f0 = hift.predict_f0(mel)
        src = hift.excitation(f0, torch.Generator().manual_seed(1))
        a = hift.decode(mel, src)
        b = hift.decode(mel, src, torch.full((2,), m.shape[-1]))
    assert rel_l2(b, a) <= BATCH_TOL


@parity
@pytest.mark.parametrize("case", STREAM_CASES)
def test_stream_batch_equals_single(hift, full_cfg, case):
    """Two interleaved streams (the reference chunks, and the same chunks shifted) batched per step."""
    t, md = tensors(case), meta(case)
    chunks = md["chunks"]
    streams = [[_chunk_mel(t, md, full_cfg, i) for i in range(len(chunks))],
               [_chunk_mel(t, md, full_cfg, i)[:, :, 3:] - 0.2 for i in range(len(chunks))]]
    fins = [bool(ch["finalize"]) for ch in chunks]
    single_out = []
    for s, mels in enumerate(streams):
        gen, st, outs = torch.Generator().manual_seed(50 + s), HiFTStreamState(), []
        for m, f in zip(mels, fins):
            o, st = hift_stream_step(hift, st, m, f, gen)
            outs.append(o)
        single_out.append(outs)
    gens = [torch.Generator().manual_seed(50 + s) for s in range(len(streams))]
    states = [HiFTStreamState() for _ in streams]
    for i, f in enumerate(fins):
        res = hift_stream_step_batch(hift, states, [mels[i] for mels in streams], [f] * len(streams), gens)
        states = [st for _, st in res]
        for s, (o, _) in enumerate(res):
            err = rel_l2(o, single_out[s][i])
            _report(f"{case} batched stream {s} chunk {i}", err, torch.equal(o, single_out[s][i]))
            assert err <= BATCH_TOL


# ----------------------------------------------------------------------------------------------
# 6. checkpoint key spellings and strict loading
# ----------------------------------------------------------------------------------------------


def _legacy(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        k = k.replace(".parametrizations.weight.original0", ".weight_g").replace(".parametrizations.weight.original1", ".weight_v")
        out["generator." + k] = v
    return out


@parity
def test_legacy_weight_norm_keys(full_cfg, hift_sd, hift):
    legacy = _legacy(hift_sd)
    assert any(k.endswith(".weight_g") for k in legacy)
    m = HiFTGenerator(full_cfg.hift)
    load_strict(m, normalize_weight_norm_keys(legacy, strip_prefix="generator."), "legacy hift.pt")
    m.eval()
    mel = tensors(HIFT_CASES[0])["mel"] if HIFT_CASES else torch.zeros(1, full_cfg.hift.in_channels, 10)
    a = hift.inference(mel, generator=torch.Generator().manual_seed(3))
    b = m.inference(mel, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # same weights, same kernels: exact by construction


@parity
def test_strict_loading_errors(full_cfg, hift_sd):
    key = "conv_pre.parametrizations.weight.original1"
    assert key in hift_sd
    m = HiFTGenerator(full_cfg.hift)

    missing = {k: v for k, v in hift_sd.items() if k != key}
    with pytest.raises(CheckpointError, match="missing.*" + key.replace(".", r"\.")):
        load_strict(m, missing, "hift.pt")

    extra = dict(hift_sd, **{"conv_pre.extra_weight": torch.zeros(1)})
    with pytest.raises(CheckpointError, match=r"unexpected.*conv_pre\.extra_weight"):
        load_strict(m, extra, "hift.pt")

    wrong = dict(hift_sd)
    wrong[key] = torch.zeros(*hift_sd[key].shape[:-1], hift_sd[key].shape[-1] + 1)
    with pytest.raises(CheckpointError, match="shape.*" + key.replace(".", r"\.")):
        load_strict(m, wrong, "hift.pt")


# ----------------------------------------------------------------------------------------------
# 7. full-size architecture (meta device)
# ----------------------------------------------------------------------------------------------


@parity
def test_full_size_state_dict_matches_manifest(tmp_path):
    cfg = full_size_config(tmp_path).hift
    with torch.device("meta"):
        m = HiFTGenerator(cfg)
    got = {k: list(v.shape) for k, v in m.state_dict().items()}
    want = manifest_shapes("hift")
    assert got == want
    assert all(v.dtype == torch.float32 for v in m.state_dict().values())
    assert cfg.samples_per_frame * 50 == cfg.sampling_rate


# ----------------------------------------------------------------------------------------------
# 8. folding the weight norm
# ----------------------------------------------------------------------------------------------


@parity
def test_remove_weight_norm_keeps_outputs(full_cfg, hift_sd):
    m = _build(full_cfg, hift_sd)
    case = (INTERNALS_CASES or HIFT_CASES)[0]
    t = tensors(case)
    with torch.no_grad():
        f0_a, sp_a = m.predict_f0(t["mel"]), m.decode(t["mel"], t["source"])
        m.remove_weight_norm()
        f0_b, sp_b = m.predict_f0(t["mel"]), m.decode(t["mel"], t["source"])
    assert not any("parametrizations" in k for k in m.state_dict())
    e_f0, e_sp = rel_l2(f0_b, f0_a), rel_l2(sp_b, sp_a)
    _report("remove_weight_norm f0", e_f0, torch.equal(f0_a, f0_b))
    _report("remove_weight_norm decode", e_sp, torch.equal(sp_a, sp_b))
    assert e_f0 <= 1e-6 and e_sp <= 1e-6


# ----------------------------------------------------------------------------------------------
# misc: errors and window constant
# ----------------------------------------------------------------------------------------------


@parity
def test_shape_errors(hift):
    cfg = hift.cfg
    mel = torch.zeros(1, cfg.in_channels, 4)
    with pytest.raises(ValueError):
        hift.predict_f0(torch.zeros(1, cfg.in_channels + 1, 4))
    with pytest.raises(ValueError):
        hift.decode(mel, torch.zeros(1, 1, 4 * cfg.samples_per_frame - 1))
    with pytest.raises(ValueError):
        hift.inference(mel, cache_source=torch.zeros(1, 1, 5 * cfg.samples_per_frame))
    with pytest.raises(ValueError):
        hift_stream_step(hift, HiFTStreamState(), torch.zeros(1, cfg.in_channels, 3), finalize=False)


def test_stft_window_is_scipy_periodic_hann():
    """Upstream uses scipy.signal.get_window("hann", n, fftbins=True) (float64) cast to float32:
    the periodic Hann window 0.5 - 0.5 cos(2 pi k / n), k = 0..n-1."""
    import numpy as np

    from cosyserve.models.hift import _hann_periodic

    for n in (16, 20):
        k = np.arange(n, dtype=np.float64)
        ref = (0.5 - 0.5 * np.cos(2.0 * np.pi * k / n)).astype(np.float32)
        assert np.array_equal(_hann_periodic(n), ref)
        assert np.array_equal(_hann_periodic(n), torch.hann_window(n, periodic=True, dtype=torch.float64).float().numpy())


# ----------------------------------------------------------------------------------------------
# half-precision trunk (the float16 / bfloat16 path of the GPU is checked in test_gpu.py)
# ----------------------------------------------------------------------------------------------


@parity
@pytest.mark.parametrize("case", E2E_CASES[:1])
def test_bfloat16_trunk_close_to_reference(full_cfg, hift_sd, case):
    """Only the convolution trunk changes precision: F0 and the excitation stay float32 (so a
    seeded source is unchanged), decode takes and returns float32, and its speech stays near
    the float32 reference (bfloat16's 8-bit mantissa: ~1e-2 relative on the reference case)."""
    t = tensors(case)
    m = _build(full_cfg, hift_sd).set_trunk_dtype(torch.bfloat16)
    assert m.trunk_dtype == torch.bfloat16 and m.f0_predictor.classifier.weight.dtype == torch.float32
    assert m.m_source.l_linear.weight.dtype == torch.float32
    with torch.no_grad():
        speech = m.decode(t["mel"], t["source"])
        f0 = m.predict_f0(t["mel"])
    assert speech.dtype == torch.float32 and f0.dtype == torch.float32
    err = rel_l2(speech, t["speech"])
    _report(f"{case} decode, bfloat16 trunk", err)
    assert 0 < err < 5e-2


def test_resolve_hift_dtype():
    from cosyserve.engine.pipeline import resolve_hift_dtype

    assert resolve_hift_dtype("auto", "cuda", torch.bfloat16) == torch.float16
    assert resolve_hift_dtype("auto", "cuda:1", torch.float16) == torch.float16
    assert resolve_hift_dtype("auto", "cuda", torch.float32) == torch.float32
    assert resolve_hift_dtype("auto", "cpu", torch.bfloat16) == torch.float32
    assert resolve_hift_dtype("bfloat16", "cpu", torch.float32) == torch.bfloat16
    assert resolve_hift_dtype(torch.float16, "cpu", torch.float32) == torch.float16
    with pytest.raises(ValueError, match="hift dtype"):
        resolve_hift_dtype("int8", "cpu", torch.float32)


def test_fused_snake_runs_eagerly_on_cpu():
    """On CPU the fused op is the eager formula itself (nothing is compiled)."""
    from cosyserve.models.hift import _snake

    x = torch.randn(2, 4, 9)
    alpha = torch.rand(4) + 0.5
    mask = (torch.arange(9)[None] < torch.tensor([9, 5])[:, None])[:, None]
    a = alpha[None, :, None]
    want = (x + (1.0 / (a + 1e-9)) * torch.sin(x * a) ** 2).masked_fill(~mask, 0.0)
    assert torch.equal(_snake(x, alpha, mask), want)  # the same eager formula: exact by construction
    assert not _snake.compiled


def test_auto_hift_dtype_follows_models_passed_in(tmp_path):
    """With ``models`` given, ``Synthesizer``'s device/dtype arguments are unused: "auto" resolves
    from where the networks are (a CPU model is not given a float16 HiFT because the caller's
    defaults said CUDA)."""
    from cosyserve.engine.pipeline import Synthesizer
    from cosyserve.models.demo import write_demo_model
    from cosyserve.models.loader import load_models

    md = write_demo_model(tmp_path / "demo")
    models = load_models(md, device="cpu", dtype=torch.bfloat16)
    syn = Synthesizer(md, device="cuda", dtype=torch.bfloat16, models=models, normalizer="rules")
    assert syn.models.hift.trunk_dtype == torch.float32
    syn = Synthesizer(md, models=models, normalizer="rules", hift_dtype="bfloat16")
    assert syn.models.hift.trunk_dtype == torch.bfloat16


@torch.inference_mode()
def test_frame_major_decode_computes_the_same(hift):
    """``HiFTGenerator.frame_major`` (experimental, off by default) changes the memory layout of the
    trunk's inputs, not the result: a padded batch decodes to the same waveform."""
    g = torch.Generator().manual_seed(11)
    cfg = hift.cfg
    mel = torch.randn(3, cfg.in_channels, 40, generator=g) * 2 - 5
    lengths = torch.tensor([40, 31, 12])
    source = 0.1 * torch.randn(3, 1, 40 * hift.samples_per_frame, generator=g)
    ref = hift.decode(mel, source, lengths)
    try:
        hift.frame_major = True
        got = hift.decode(mel, source, lengths)
    finally:
        hift.frame_major = False
    assert got.shape == ref.shape and rel_l2(got, ref) <= 1e-5

"""CosyVoice3 end to end: frontend -> LM -> silent-token rule -> token2wav through the engine, the CLI
and the servers, against the upstream golden data of the CosyVoice3 set (:mod:`_reference_cv3`).

Cases are discovered from the sidecars (kind ``e2e`` / ``stream`` and the tensors they hold), never by
name; tolerances are those of :mod:`_reference` (``PARITY_TOL`` for mel, ``WAVE_TOL`` for waveforms
made from our own flow mel); bit-exactness is printed, never required.
"""

from __future__ import annotations

import json
import queue
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from _reference import DEVICE_WAVE_TOL, PARITY_TOL, WAVE_TOL, check_close
from _reference_cv3 import PROMPT_TEXT, discover, meta, model_dir, require_cv3_dir, set_file, tensors
from _reference_cv3 import forced_params as _forced_params
from _reference_cv3 import run_engine as _run
from _reference_cv3 import stream_case_voice

from cosyserve.engine.core import EngineConfig
from cosyserve.engine.request import SynthesisParams
from cosyserve.models.llm import SilentTokenFilter

E2E_CASES = discover("e2e", has=("llm_tokens", "speech_token", "mel", "speech"),
                     where=lambda m: "seed" in m and "prompt_wav" in m)
STREAM_CASES = discover("stream", has=("source_speech_token", "prompt_token", "prompt_feat", "embedding"),
                        where=lambda m: bool(m.get("chunks")))


def _check(what: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """:func:`check_close` after viewing ``got`` in the reference's shape when the sizes agree (the
    engine's audio is 1-D, the reference's ``[1, T]``)."""
    if got.numel() == want.numel():
        got = got.reshape(want.shape)
    check_close(got, want, what, tol)




@pytest.fixture(scope="module")
def synth():
    require_cv3_dir()
    from cosyserve.engine.pipeline import Synthesizer

    return Synthesizer(model_dir(), normalizer="none")


def _case_voice(synth, m: dict):
    return synth.make_voice("case", str(set_file(m["prompt_wav"])), m["prompt_text"])


@pytest.mark.parametrize("case", E2E_CASES or [pytest.param(None, marks=pytest.mark.skip("no CosyVoice3 e2e case"))])
def test_e2e_zero_shot_seeded(synth, case, one_thread):
    """frontend -> LM (upstream's seeded host sampling) -> silent filter -> offline token2wav: the
    case's LM tokens and token2wav tokens exactly, its mel and speech within tolerance."""
    m, d = meta(case), tensors(case)
    voice = _case_voice(synth, m)
    assert torch.equal(voice.prompt_text_ids.reshape(-1).long(), d["prompt_text_ids"].reshape(-1).long())
    assert torch.equal(voice.llm_speech_token.reshape(-1).long(), d["llm_prompt_speech_token"].reshape(-1).long())
    ids = synth.frontend.token_ids(m["tts_text"], voice)
    assert len(ids) == 1 and ids[0].tolist() == d["text_ids"].reshape(-1).tolist()
    res = synth.synthesize(m["tts_text"], voice, SynthesisParams(seed=int(m["seed"]), stream=False))
    raw = d["llm_tokens"].reshape(-1).tolist()
    assert res.finished.tokens == [raw]  # RequestFinished keeps the LM's raw tokens
    kept = SilentTokenFilter.for_config(synth.cfg.llm).filter(raw)
    assert kept == d["speech_token"].reshape(-1).tolist()
    if "silent_tokens" in m:
        assert sorted(synth.cfg.llm.silent_tokens) == sorted(m["silent_tokens"])
    flow = synth.models.flow
    mel = flow.inference(torch.tensor([kept]), voice.flow_speech_token[None], voice.speech_feat[None],
                         voice.flow_embedding[None], streaming=False, finalize=True)
    _check(f"{case} mel", mel, d["mel"], PARITY_TOL)
    _check(f"{case} speech", res.audio, d["speech"], WAVE_TOL)


def test_silent_token_rule_in_the_engine(synth):
    """token2wav reads the filtered tokens (a run of silent tokens is cut after max_silent_tokens),
    while RequestFinished.tokens keeps the raw list; CosyVoice2 configs keep everything."""
    cfg = synth.cfg.llm
    if not cfg.silent_tokens:
        pytest.skip("this CosyVoice3 config has no silent tokens")
    s = sorted(cfg.silent_tokens)[0]
    other = next(t for t in range(cfg.speech_token_size) if t not in cfg.silent_tokens)
    raw = [other] * 6 + [s] * (cfg.max_silent_tokens + 4) + [other] * 6
    kept = SilentTokenFilter.for_config(cfg).filter(raw)
    assert len(kept) == len(raw) - 4
    voice = synth.make_voice("v", str(set_file("audio/zero_shot_prompt.wav")), PROMPT_TEXT)
    engine = synth.new_engine(EngineConfig(max_active=1))
    req = synth.build_request("你好。", voice, _forced_params(raw, cfg.stop_token_ids[0], stream=False))
    chunks, fin = _run(engine, [req])[req.request_id]
    assert fin.tokens == [raw]
    spf = synth.models.hift.samples_per_frame
    assert sum(c.samples.shape[0] for c in chunks) == len(kept) * synth.cfg.token_mel_ratio * spf


@pytest.mark.parametrize("case", STREAM_CASES or [pytest.param(None, marks=pytest.mark.skip("no CosyVoice3 stream case"))])
def test_engine_streams_the_stream_case_and_batches(synth, case, one_thread):
    """The engine driven with the stream case's tokens (upstream chunk schedule, token2wav semantics of
    CosyVoice3Model.token2wav) emits the case's chunks, while an offline request of the e2e case runs
    in the same token2wav batches."""
    m, d = meta(case), tensors(case)
    tokens = d["source_speech_token"].reshape(-1).tolist()
    if SilentTokenFilter.for_config(synth.cfg.llm).filter(tokens) != tokens:
        pytest.skip("the stream case's tokens hold a run of silent tokens (its path skips llm_job's filter)")
    voice = stream_case_voice(synth, d)
    stop = synth.cfg.llm.stop_token_ids[0]
    engine = synth.new_engine(EngineConfig(max_active=2, t2w_batch_target=2))
    reqs = [synth.build_request("你好。", voice, _forced_params(tokens, stop, stream=True), request_id="stream")]
    e2e = None
    if E2E_CASES:
        e2e = E2E_CASES[0]
        me, de = meta(e2e), tensors(e2e)
        v2 = _case_voice(synth, me)
        kept = de["speech_token"].reshape(-1).tolist()
        reqs.append(synth.build_request(me["tts_text"], v2, _forced_params(kept, stop, stream=False),
                                        request_id="offline"))
    out = _run(engine, reqs)
    chunks, _ = out["stream"]
    assert len(chunks) == len(m["chunks"])
    for i, (c, spec) in enumerate(zip(chunks, m["chunks"])):
        assert c.samples.shape[0] == spec["yielded_samples"]
        _check(f"{case} chunk {i}", torch.from_numpy(c.samples), d[f"c{i}_speech"], WAVE_TOL)
    if e2e is not None:
        off, _ = out["offline"]
        _check(f"{e2e} offline, batched with a stream", torch.from_numpy(np.concatenate([c.samples for c in off])),
               de["speech"], WAVE_TOL)
    assert max(engine.stats.t2w_batches) >= 2 or e2e is None  # the two requests shared a batch


XL_CASES = discover("llm", has=("text_ids", "prompt_text_ids", "prompt_speech_token"),
                    where=lambda m: "<|endofprompt|>" in m.get("text", "") and m.get("prompt_text") == "")


@pytest.mark.parametrize("case", XL_CASES or [pytest.param(None, marks=pytest.mark.skip("no cross-lingual LLM case"))])
def test_cross_lingual_input_builds_upstream_lm_input(synth, case):
    """An input holding <|endofprompt|> is upstream's cross-lingual request: the LM gets no prompt text
    and no prompt speech, the text ids are the case's; the flow keeps the voice's prompt."""
    m, d = meta(case), tensors(case)
    voice = synth.make_voice("v", str(set_file("audio/zero_shot_prompt.wav")), PROMPT_TEXT)
    req = synth.build_request(m["text"], voice, SynthesisParams(seed=0))
    assert [s.tolist() for s in req.segments] == [d["text_ids"].reshape(-1).tolist()]
    assert req.voice.prompt_text_ids.numel() == 0 and req.voice.llm_speech_token.numel() == 0
    assert torch.equal(req.voice.flow_speech_token, voice.flow_speech_token)
    instruct = synth.frontend.instruct2_voice(voice, "You are a helpful assistant. 请用广东话表达。<|endofprompt|>")
    from cosyserve.errors import InvalidInputError

    with pytest.raises(InvalidInputError):
        synth.build_request(m["text"], instruct, SynthesisParams(seed=0))


# ---------------------------------------------------------------------------- CLI and servers

def _cli(capsys, *argv):
    from cosyserve.cli import main

    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _wav_samples(path: Path) -> int:
    data, sr = sf.read(str(path))
    assert sr == 24000
    return len(data)


def test_cli_synthesize_voices_import_batch_and_bench(tmp_path, capsys):
    md = model_dir()
    wav = set_file("audio/zero_shot_prompt.wav")
    for flag in ([], ["--stream"]):
        out = tmp_path / f"x{len(flag)}.wav"
        code, o, e = _cli(capsys, "synthesize", "--model-dir", md, "--prompt-wav", wav, "--prompt-text", PROMPT_TEXT,
                          "--text", "收到好友从远方寄来的生日礼物。", "-o", out, "--seed", 1, "-q", *flag)
        assert code == 0, e
        assert _wav_samples(out) > 0
    # a prompt text without <|endofprompt|>: one clear line, no traceback
    code, o, e = _cli(capsys, "synthesize", "--model-dir", md, "--prompt-wav", wav, "--prompt-text", "你好。",
                      "--text", "你好。", "-o", tmp_path / "bad.wav", "-q")
    assert code != 0 and "<|endofprompt|>" in e and "Traceback" not in e
    # voices import of the model's spk2info.pt, then synthesis with that voice
    vdir = tmp_path / "voices"
    code, o, e = _cli(capsys, "voices", "--voices-dir", vdir, "import", md / "spk2info.pt")
    assert code == 0, e
    code, o, e = _cli(capsys, "voices", "--voices-dir", vdir, "list", "--json")
    listed = json.loads(o)
    assert code == 0 and listed, e
    voice_id = listed[0]["id"]
    out = tmp_path / "v.wav"
    code, o, e = _cli(capsys, "synthesize", "--model-dir", md, "--voices-dir", vdir, "--voice", voice_id,
                      "--text", "你好。", "-o", out, "--seed", 2, "-q")
    assert code == 0, e
    assert _wav_samples(out) > 0
    # batch and bench --in-process over a two-item manifest with CosyVoice3 prompt texts
    man = tmp_path / "set" / "manifest.jsonl"
    man.parent.mkdir()
    man.write_text("".join(json.dumps({"id": f"u{i}", "prompt_wav": str(wav), "prompt_text": PROMPT_TEXT,
                                       "target_text": t, "language": "zh"}, ensure_ascii=False) + "\n"
                           for i, t in enumerate(["你好。", "收到好友从远方寄来的生日礼物。"])), encoding="utf-8")
    code, o, e = _cli(capsys, "batch", "--model-dir", md, "--set", man, "--out", tmp_path / "batch", "--device", "cpu",
                      "--no-progress")
    assert code == 0, e
    assert sorted(p.name for p in (tmp_path / "batch" / "wavs").iterdir()) == ["u0.wav", "u1.wav"]
    code, o, e = _cli(capsys, "bench", "--in-process", "--model-dir", md, "--set", man, "--concurrency", "1,2",
                      "--out", tmp_path / "bench", "--device", "cpu")
    assert code == 0, e
    assert (tmp_path / "bench" / "report.json").is_file()


@pytest.fixture(scope="module")
def cv3_server(tmp_path_factory):
    from _server import Server

    require_cv3_dir()
    tmp = tmp_path_factory.mktemp("cv3srv")
    s = Server(tmp, model=("--model-dir", str(model_dir())))
    yield s
    s.stop()


def test_serve_openai_instructions_and_grpc_stream(cv3_server):
    import httpx

    from cosyserve.frontend.audio import load_prompt_wav

    url = cv3_server.url
    wav = set_file("audio/zero_shot_prompt.wav")
    with open(wav, "rb") as f:
        r = httpx.post(url + "/v1/audio/voices", files={"audio_sample": ("p.wav", f, "audio/wav")},
                       data={"name": "cv3", "ref_text": PROMPT_TEXT}, timeout=60)
    assert r.status_code == 201, r.text
    # a CosyVoice3 server answers as cosyvoice3 (its own name first, then OpenAI's TTS names), not cosyvoice2
    ids = [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]]
    assert ids[0] == "cosyvoice3" and "tts-1" in ids and "cosyvoice2" not in ids
    body = {"model": "cosyvoice3", "input": "你好。", "voice": "cv3", "response_format": "pcm", "seed": 1}
    r = httpx.post(url + "/v1/audio/speech", json=dict(body, model="cosyvoice2"), timeout=60)
    assert r.status_code == 404 and "cosyvoice3" in r.json()["error"]["message"], r.text
    r = httpx.get(url + "/v2/models/cosyvoice2", timeout=10)
    assert r.status_code == 404 and "cosyvoice3" in r.text
    assert httpx.get(url + "/v2/models/cosyvoice3/ready", timeout=10).status_code == 200
    r = httpx.post(url + "/v1/audio/speech", json=body, timeout=120)
    assert r.status_code == 200 and len(r.content) > 0, r.text
    # instructions -> CosyVoice3 instruct2
    ins = dict(body, instructions="You are a helpful assistant. 请用广东话表达。<|endofprompt|>")
    r = httpx.post(url + "/v1/audio/speech", json=ins, timeout=120)
    assert r.status_code == 200 and len(r.content) > 0, r.text
    r = httpx.post(url + "/v1/audio/speech", json=dict(body, instructions="请用广东话表达。"), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "instructions"
    # cross-lingual input (the instruction in the input)
    xl = dict(body, input="You are a helpful assistant.<|endofprompt|>Hello, nice to meet you.")
    r = httpx.post(url + "/v1/audio/speech", json=xl, timeout=120)
    assert r.status_code == 200 and len(r.content) > 0, r.text
    r = httpx.post(url + "/v1/audio/speech", json=dict(xl, instructions=ins["instructions"]), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    # KServe gRPC decoupled stream with a reference wav + CosyVoice3 transcript
    import tritonclient.grpc as tg

    samples = load_prompt_wav(str(wav), 16000).numpy().reshape(1, -1).astype(np.float32)
    inputs = [tg.InferInput("reference_wav", list(samples.shape), "FP32"),
              tg.InferInput("reference_wav_len", [1, 1], "INT32"),
              tg.InferInput("reference_text", [1, 1], "BYTES"), tg.InferInput("target_text", [1, 1], "BYTES")]
    inputs[0].set_data_from_numpy(samples)
    inputs[1].set_data_from_numpy(np.array([[samples.shape[1]]], np.int32))
    inputs[2].set_data_from_numpy(np.array([[PROMPT_TEXT]], dtype=object))
    inputs[3].set_data_from_numpy(np.array([["收到好友从远方寄来的生日礼物。"]], dtype=object))
    c = tg.InferenceServerClient(f"127.0.0.1:{cv3_server.grpc_port}")
    results: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: results.put(error or result))
    try:
        c.async_stream_infer("cosyvoice3", inputs, request_id="1", outputs=[tg.InferRequestedOutput("waveform")],
                             enable_empty_final_response=True, parameters={"seed": 3})
        n = 0
        while True:
            r = results.get(timeout=120)
            assert not isinstance(r, Exception), r
            if r.get_response().parameters["triton_final_response"].bool_param:
                break
            n += r.as_numpy("waveform").size
        assert n > 0
    finally:
        c.stop_stream()


def test_demo_model_cosyvoice3_serves(tmp_path, capsys):
    from _server import Server

    demo = tmp_path / "demo3"
    code, o, e = _cli(capsys, "demo-model", demo, "--cosyvoice3")
    assert code == 0, e
    assert (demo / "cosyvoice3.yaml").is_file()
    s = Server(tmp_path, model=("--model-dir", str(demo)))
    try:
        import httpx

        with open(set_file("audio/zero_shot_prompt.wav"), "rb") as f:
            r = httpx.post(s.url + "/v1/audio/voices", files={"audio_sample": ("p.wav", f, "audio/wav")},
                           data={"name": "demo3", "ref_text": PROMPT_TEXT}, timeout=60)
        assert r.status_code == 201, r.text
        r = httpx.post(s.url + "/v1/audio/speech", json={"model": "tts-1", "input": "你好。", "voice": "demo3",
                                                         "response_format": "wav", "seed": 1}, timeout=120)
        assert r.status_code == 200 and len(r.content) > 44, r.text
        # `cosyserve client` without --model-name asks the server for its name (cosyvoice3 here), over
        # KServe gRPC and HTTP; a wrong name is refused with the served one
        for url, extra in ((f"grpc://127.0.0.1:{s.grpc_port}", ()), (s.url, ("--protocol", "http", "--mode", "offline"))):
            out = tmp_path / f"client{len(extra)}.wav"
            code, o, e = _cli(capsys, "client", "--url", url, *extra, "--text", "你好。", "--voice", "demo3",
                              "--seed", "1", "-o", out)
            assert code == 0 and out.stat().st_size > 44, e
        code, o, e = _cli(capsys, "client", "--url", s.url, "--protocol", "http", "--mode", "offline",
                          "--model-name", "cosyvoice2", "--text", "你好。", "--voice", "demo3", "-o", tmp_path / "x.wav")
        assert code != 0 and "cosyvoice3" in e and "Traceback" not in e
    finally:
        s.stop()


def test_default_voice_of_a_cosyvoice3_benchmark_model_has_the_instruction(tmp_path, capsys):
    """The voice ``default`` that demo / random-weight servers register from the shipped prompt puts
    upstream's default instruction before the transcript for CosyVoice3 (whose prompt texts need
    ``<|endofprompt|>``; without it the voice could not even be made)."""
    from cosyserve.cli import _builtin_default_voice
    from cosyserve.frontend.tokenizer import DEFAULT_INSTRUCTION
    from cosyserve.frontend.voice import VoiceStore
    from cosyserve.models.demo import shipped_prompt

    demo = tmp_path / "demo3"
    assert _cli(capsys, "demo-model", demo, "--cosyvoice3")[0] == 0
    _builtin_default_voice(str(demo), str(tmp_path / "voices"))
    voice = VoiceStore(tmp_path / "voices").get("default")
    assert voice.prompt_text == DEFAULT_INSTRUCTION + shipped_prompt()[1]


@pytest.mark.gpu
@pytest.mark.parametrize("case", STREAM_CASES or [pytest.param(None, marks=pytest.mark.skip("no CosyVoice3 stream case"))])
def test_gpu_engine_runs_cv3_eagerly_with_cuda_graphs_on(case):
    """On CUDA with the default engine config (CUDA graphs on): the LM and CosyVoice3's flow (DiT,
    GraphedFlow) are graphed, the causal HiFT runs eagerly (bounded window), and the streamed chunks
    of the stream case match."""
    from cosyserve.engine.pipeline import Synthesizer

    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        synth = Synthesizer(model_dir(), device="cuda", normalizer="none")
        m, d = meta(case), tensors(case)
        tokens = d["source_speech_token"].reshape(-1).tolist()
        voice = stream_case_voice(synth, d)
        engine = synth.new_engine(EngineConfig(max_active=2, kv_max_len=1024, max_prefill_tokens=1024))
        assert getattr(synth.models.flow, "graph", None) is not None and synth.models.hift.graph_decode is None
        req = synth.build_request("你好。", voice, _forced_params(tokens, synth.cfg.llm.stop_token_ids[0], True),
                                  request_id="stream")
        chunks, _ = _run(engine, [req])["stream"]
        assert len(chunks) == len(m["chunks"])
        for i, c in enumerate(chunks):
            _check(f"cuda {case} chunk {i}", torch.from_numpy(c.samples), d[f"c{i}_speech"], DEVICE_WAVE_TOL)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def test_strict_min_len_masks_every_stop_id(synth):
    """``strict_min_len`` (``--strict-min-len``, random-weight benchmarks): every stop id is masked until
    min_len, on the host and device samplers, so pinned token/text ratios pin the length; by default only
    upstream's one id (CosyVoice3's sos) is."""
    from cosyserve.models.sampling import UpstreamSampler, ras_sample_device

    cfg = synth.cfg.llm
    stops = cfg.stop_token_ids
    span = range(min(stops), max(stops) + 1)
    v = cfg.num_speech_rows
    logp = torch.full((v,), -30.0)
    logp[list(stops)] = 0.0  # every stop id far likelier than any speech token
    logp[3] = -5.0
    logp = logp.log_softmax(0)
    g = torch.Generator().manual_seed(0)
    loose, strict = UpstreamSampler(cfg.sampling, cfg.min_len_mask_id), UpstreamSampler(cfg.sampling, span)
    assert any(loose.sample(logp, [], g, ignore_eos=True) in stops for _ in range(5))
    assert all(strict.sample(logp, [], g, ignore_eos=True) not in stops for _ in range(5))
    assert all(t not in stops for t in strict.sample_batch(logp.expand(3, -1), [[]] * 3, [g] * 3, [True] * 3))
    dev = ras_sample_device(logp.expand(4, -1), torch.full((4, cfg.sampling.win_size), -1), torch.arange(4),
                            torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.bool), cfg.sampling, span)
    assert all(int(t) not in stops for t in dev)
    assert synth.new_engine(EngineConfig(max_active=1))._min_len_mask == cfg.min_len_mask_id
    engine = synth.new_engine(EngineConfig(max_active=2, strict_min_len=True))
    assert engine._min_len_mask == span
    voice = synth.make_voice("v", str(set_file("audio/zero_shot_prompt.wav")), PROMPT_TEXT)
    reqs = [synth.build_request("你好，今天天气很好。", voice, SynthesisParams(seed=s, stream=False, min_tokens=40,
                                                                          max_tokens=40)) for s in (1, 2)]
    for _, fin in _run(engine, reqs).values():
        assert [len(t) for t in fin.tokens] == [40] * len(fin.tokens)


def test_prompt_prefix_mode_is_off_for_cosyvoice3(synth):
    """``--flow-stream-cache prefix`` is CosyVoice2's (one-level U-Net): a CosyVoice3 engine starts without a
    prefix pool and without per-stream caches, instead of failing (it raised at start before)."""
    engine = synth.new_engine(EngineConfig(max_active=1, flow_stream_cache="prefix"))
    try:
        assert engine.t2w.supports_flow_cache and not engine.t2w.supports_prompt_prefixes
        assert engine.t2w.prefix_pool is None and not engine._flow_stream_cache
        # auto: no prefix mode for CosyVoice3 with CUDA graphs either (no per-stream caches there), caches eagerly
        assert engine._resolve_flow_stream_cache(EngineConfig(), graphed=True).flow_stream_cache is False
        assert engine._resolve_flow_stream_cache(EngineConfig(), graphed=False).flow_stream_cache is True
    finally:
        engine.close()

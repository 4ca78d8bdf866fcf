"""`cosyserve serve`: the real server process on 127.0.0.1, driven by real clients.

OpenAI SDK (streaming and not), SSE, voices over HTTP, tritonclient.http, tritonclient.grpc
decoupled streaming (as CosyVoice's client_grpc.py), /metrics, concurrency, bad input,
disconnects, admission control, API keys and graceful shutdown.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import io
import json
import queue
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from _server import Server

PROMPT = Path(__file__).resolve().parent.parent / "cosyserve" / "assets" / "prompts" / "zero_shot_prompt.wav"
TRANSCRIPT = "希望你以后能够做的比我还好呦。"


def metrics(url: str, headers=None) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", headers=headers or {}).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(m: dict, name: str, **labels) -> float:
    return sum(v for (n, lab), v in m.items() if n == name and all(dict(lab).get(k) == v2 for k, v2 in labels.items()))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("srv")
    s = Server(tmp, "--max-active-streams", "8", "--max-queue", "16", "--min-token-text-ratio", "3",
               "--max-token-text-ratio", "4")
    yield s
    code = s.stop()
    assert code == 0, s.logs()
    assert "Traceback" not in s.logs()


@pytest.fixture(scope="module")
def oai(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def pcm16(b: bytes) -> np.ndarray:
    return np.frombuffer(b, dtype="<i2").astype(np.float32) / 32767.0


# ---------------------------------------------------------------------------- OpenAI


def test_openai_sdk_non_streaming_and_streaming(oai):
    r = oai.audio.speech.create(model="cosyvoice2", voice="default", input="你好，世界。", response_format="wav")
    audio, sr = sf.read(io.BytesIO(r.content))
    assert sr == 24000 and len(audio) > 0 and len(audio) % 960 == 0
    first, t0 = None, time.time()
    with oai.audio.speech.with_streaming_response.create(model="tts-1", voice="default", response_format="pcm",
                                                         input="Hello there. This is a streaming test.") as resp:
        assert resp.headers["content-type"].startswith("audio/pcm")
        parts = []
        for b in resp.iter_bytes():
            first = first or time.time() - t0
            parts.append(b)
    pcm = b"".join(parts)
    assert len(pcm) % 2 == 0 and len(pcm) // 2 % 960 == 0 and len(parts) >= 1
    assert np.abs(pcm16(pcm)).max() > 0.01


@pytest.mark.parametrize("fmt", ["mp3", "opus", "flac", "wav", "pcm"])
def test_response_formats_decode(oai, fmt):
    r = oai.audio.speech.create(model="tts-1", voice={"id": "default"}, input="你好。", response_format=fmt, speed=1.0)
    if fmt == "pcm":
        assert len(r.content) % 1920 == 0
        return
    with sf.SoundFile(io.BytesIO(r.content)) as f:
        assert f.samplerate == 24000 and f.channels == 1
        n = sum(len(b) for b in f.blocks(blocksize=4096))  # FLAC streams carry "unknown length"
    assert n > 0.1 * 24000


def test_sse_events(server):
    body = {"model": "cosyvoice2", "input": "你好，世界。", "voice": "default", "response_format": "pcm",
            "stream_format": "sse", "seed": 3}
    events = []
    with httpx.stream("POST", server.url + "/v1/audio/speech", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] > 0
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    audio = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    plain = httpx.post(server.url + "/v1/audio/speech", timeout=120,
                       json={k: v for k, v in body.items() if k != "stream_format"}).content
    assert audio == plain  # same seed, same bytes


def test_finish_log_lines_carry_the_first_chunk_phases(server):
    """Every finished request logs its first chunk's engine phases; benchmarks/first_chunk_tail.py reads
    them back per request (the per-window tail attribution of a capacity run)."""
    import importlib.util

    body = {"model": "cosyvoice2", "input": "你好，世界。", "voice": "default", "response_format": "pcm", "seed": 5}
    assert httpx.post(server.url + "/v1/audio/speech", json=body, timeout=120).status_code == 200
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "first_chunk_tail.py"
    spec = importlib.util.spec_from_file_location("first_chunk_tail", path)
    tail = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tail)
    reqs = tail.parse(server.logs().splitlines())
    assert reqs and all(set(r["phases"]) == set(tail.PHASES) for r in reqs)
    for r in reqs:  # the phases end when the engine emits the chunk, the first chunk when the server hands it on
        assert all(v >= 0 for v in r["phases"].values())
        assert sum(r["phases"].values()) <= r["first_ms"] + 0.5
    lines = tail.report(reqs, window=2.0, gap=1e9, tail=0.5, min_requests=1)
    assert any(line.startswith("| 0-2 s |") for line in lines) and any("slowest" in line for line in lines)
    # split by a bench report's level starts (back-to-back levels leave no gap): labelled, each its own requests
    fake = [{"arrival": t, "first_ms": 100.0, "phases": {}} for t in (10.0, 10.4, 11.0, 11.2, 30.0)]
    bench = [{"started_at": 10.2, "role": "probe", "concurrency": 4}, {"started_at": 11.6, "concurrency": 2},
             {"concurrency": 8}]  # an older report's level without a start: skipped
    groups = tail.report_levels(fake, bench)
    assert [(label, [r["arrival"] for r in rs]) for label, rs in groups] == [
        ("probe, 4 clients", [10.0, 10.4, 11.0]), ("level, 2 clients", [11.2, 30.0])]  # 0.5 s lead
    lines = tail.report(fake, window=2.0, gap=1e9, tail=0.5, min_requests=1, bench_levels=bench)
    assert sum(line.startswith("Level (probe, 4 clients) from") for line in lines) == 1


def test_models_list(oai):
    ids = [m.id for m in oai.models.list().data]
    assert "cosyvoice2" in ids and "tts-1" in ids


# ---------------------------------------------------------------------------- voices


def test_voice_routes(server, oai):
    url = server.url + "/v1/audio/voices"
    files = {"audio_sample": ("p.wav", PROMPT.read_bytes(), "audio/wav")}
    r = httpx.post(url, files=files, data={"name": "alice", "ref_text": TRANSCRIPT}, timeout=60)
    assert r.status_code == 201, r.text
    assert r.json()["id"] == "alice"
    r = httpx.post(url, files=files, data={"name": "alice", "ref_text": TRANSCRIPT}, timeout=60)
    assert r.status_code == 409
    assert "alice" in httpx.get(url).json()["voices"]
    assert httpx.get(url + "/alice").json()["prompt_text"] == TRANSCRIPT
    audio = oai.audio.speech.create(model="tts-1", voice={"id": "alice"}, input="你好。", response_format="pcm")
    assert len(audio.content) > 0
    assert httpx.delete(url + "/alice").json()["deleted"] is True
    assert httpx.get(url + "/alice").status_code == 404
    assert httpx.delete(url + "/alice").status_code == 404


@pytest.mark.parametrize("data,files,status,field", [
    ({"name": "bob", "ref_text": TRANSCRIPT}, {"audio_sample": ("x.wav", b"garbage bytes" * 40, "audio/wav")}, 400,
     "audio_sample"),
    ({"name": "bob", "ref_text": TRANSCRIPT}, "short", 400, "audio_sample"),
    ({"name": "bad/name", "ref_text": TRANSCRIPT}, "ok", 400, "name"),
    ({"name": "bob", "ref_text": "  "}, "ok", 400, "ref_text"),
    ({"name": "bob"}, "ok", 400, "ref_text"),
])
def test_voice_upload_errors(server, data, files, status, field):
    if files == "ok":
        files = {"audio_sample": ("p.wav", PROMPT.read_bytes(), "audio/wav")}
    elif files == "short":
        buf = io.BytesIO()
        sf.write(buf, np.zeros(8000, np.float32), 16000, format="WAV")
        files = {"audio_sample": ("s.wav", buf.getvalue(), "audio/wav")}
    r = httpx.post(server.url + "/v1/audio/voices", files=files, data=data, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == field and r.json()["error"]["message"]


# ---------------------------------------------------------------------------- KServe v2


def _triton_inputs(mod, wav: np.ndarray | None, target: str, pad_to: int | None = None):
    inputs = []
    if wav is not None:
        samples = wav.reshape(1, -1).astype(np.float32)
        if pad_to:
            padded = np.zeros((1, pad_to), np.float32)
            padded[0, : samples.shape[1]] = samples
            samples = padded
        lengths = np.array([[wav.size]], np.int32)
        inputs += [mod.InferInput("reference_wav", list(samples.shape), "FP32"),
                   mod.InferInput("reference_wav_len", [1, 1], "INT32"),
                   mod.InferInput("reference_text", [1, 1], "BYTES")]
        inputs[0].set_data_from_numpy(samples)
        inputs[1].set_data_from_numpy(lengths)
        inputs[2].set_data_from_numpy(np.array([[TRANSCRIPT]], dtype=object))
    t = mod.InferInput("target_text", [1, 1], "BYTES")
    t.set_data_from_numpy(np.array([[target]], dtype=object))
    return inputs + [t]


@pytest.fixture(scope="module")
def wav16k():
    from cosyserve.frontend.audio import load_prompt_wav

    return load_prompt_wav(str(PROMPT), 16000)[0].numpy()


def test_tritonclient_http(server, wav16k):
    import tritonclient.http as th

    c = th.InferenceServerClient(f"127.0.0.1:{server.port}")
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("cosyvoice2")
    meta = c.get_model_metadata("cosyvoice2")
    assert [i["name"] for i in meta["inputs"]][:4] == ["reference_wav", "reference_wav_len", "reference_text",
                                                       "target_text"]
    assert c.get_model_config("cosyvoice2")["model_transaction_policy"]["decoupled"] is True
    res = c.infer("cosyvoice2", _triton_inputs(th, wav16k, "你好，世界。", pad_to=16000 * 10),
                  outputs=[th.InferRequestedOutput("waveform", binary_data=True)])
    wav = res.as_numpy("waveform")
    assert wav.dtype == np.float32 and wav.shape[0] == 1 and wav.shape[1] % 960 == 0 and wav.shape[1] > 0
    res = c.infer("cosyvoice2", _triton_inputs(th, None, "你好。"),
                  outputs=[th.InferRequestedOutput("waveform", binary_data=False)])  # default voice, JSON output
    assert res.as_numpy("waveform").shape[1] > 0
    assert c.get_inference_statistics("cosyvoice2")["model_stats"][0].get("inference_count", 0) >= 2
    # every model's statistics (GET /v2/models/stats, which `/v2/models/{name}` once took for a model name):
    # how clients without --model-name learn the served name
    assert c.get_inference_statistics()["model_stats"][0]["name"] == "cosyvoice2"


def test_plain_json_client_http_like_client_http_py(server, wav16k):
    """The request CosyVoice's client_http.py sends (JSON lists, no binary extension)."""
    data = {"inputs": [
        {"name": "reference_wav", "shape": [1, wav16k.size], "datatype": "FP32", "data": wav16k[None].tolist()},
        {"name": "reference_wav_len", "shape": [1, 1], "datatype": "INT32", "data": [[wav16k.size]]},
        {"name": "reference_text", "shape": [1, 1], "datatype": "BYTES", "data": [TRANSCRIPT]},
        {"name": "target_text", "shape": [1, 1], "datatype": "BYTES", "data": ["你好。"]}]}
    r = httpx.post(server.url + "/v2/models/cosyvoice2/infer", json=data, params={"request_id": "0"}, timeout=120)
    assert r.status_code == 200, r.text
    assert len(r.json()["outputs"][0]["data"]) % 960 == 0


def test_tritonclient_grpc_decoupled_stream(server, wav16k):
    import tritonclient.grpc as tg

    c = tg.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("cosyvoice2")
    assert c.get_model_metadata("cosyvoice2").inputs[3].name == "target_text"
    assert c.get_model_config("cosyvoice2").config.model_transaction_policy.decoupled
    before = c.get_inference_statistics(model_name="", as_json=True)["model_stats"][0].get("inference_count", 0)
    results: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: results.put(error or result))
    try:
        outputs = [tg.InferRequestedOutput("waveform")]
        c.async_stream_infer("cosyvoice2", _triton_inputs(tg, wav16k, "身临其境，换新体验。塑造开源语音合成新范式。",
                                                          pad_to=16000 * 10),
                             request_id="7", outputs=outputs, enable_empty_final_response=True,
                             parameters={"seed": 3})  # seeded: the random-weight LM's length is fixed
        chunks = []
        while True:
            r = results.get(timeout=120)
            assert not isinstance(r, Exception), r
            resp = r.get_response()
            assert resp.id == "7" and "triton_final_response" in resp.parameters
            if resp.parameters["triton_final_response"].bool_param:
                break
            chunks.append(r.as_numpy("waveform").reshape(-1))
        assert len(chunks) >= 2 and all(len(ch) > 0 for ch in chunks)
        # an invalid request on the same stream gets an error; the stream stays usable
        c.async_stream_infer("cosyvoice2", _triton_inputs(tg, None, "   "), request_id="8", outputs=outputs,
                             enable_empty_final_response=True)
        err = results.get(timeout=60)
        assert isinstance(err, Exception) and "INVALID_ARGUMENT" in str(err) and "target_text" in str(err)
        c.async_stream_infer("cosyvoice2", _triton_inputs(tg, None, "你好。"), request_id="9", outputs=outputs,
                             enable_empty_final_response=True)
        while True:
            r = results.get(timeout=120)
            assert not isinstance(r, Exception), r
            if r.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        c.stop_stream()
    res = c.infer("cosyvoice2", _triton_inputs(tg, wav16k, "你好。"))
    assert res.as_numpy("waveform").shape[1] > 0
    after = c.get_inference_statistics(model_name="", as_json=True)["model_stats"][0].get("inference_count", 0)
    assert int(after) >= int(before) + 3


# ---------------------------------------------------------------------------- bad input


BAD_SPEECH = [
    ({"model": "tts-1", "voice": "default", "input": ""}, 400, "input"),
    ({"model": "tts-1", "voice": "default", "input": "   "}, 400, "input"),
    ({"model": "tts-1", "voice": "default", "input": "字" * 5000}, 400, "input"),
    ({"model": "tts-1", "voice": "nobody", "input": "你好"}, 400, "voice"),
    ({"model": "tts-1", "voice": "../x", "input": "你好"}, 400, "voice"),
    ({"model": "tts-1", "voice": "default", "input": "你好", "response_format": "ogg"}, 400, "response_format"),
    ({"model": "tts-1", "voice": "default", "input": "你好", "speed": 9}, 400, "speed"),
    ({"model": "tts-1", "voice": "default", "input": "你好", "bogus": 1}, 400, "bogus"),
    ({"model": "tts-1", "voice": "default", "input": 12}, 400, "input"),
    ({"voice": "default", "input": "你好"}, 400, "model"),
    ({"model": "nope", "voice": "default", "input": "你好"}, 404, "model"),
]


@pytest.mark.parametrize("body,status,field", BAD_SPEECH)
def test_openai_bad_input(server, body, status, field):
    r = httpx.post(server.url + "/v1/audio/speech", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"]


def test_malformed_json_and_oversized(server):
    r = httpx.post(server.url + "/v1/audio/speech", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    big = b"x" * (21 * 1024 * 1024)
    r = httpx.post(server.url + "/v2/models/cosyvoice2/infer", content=big, timeout=60)
    assert r.status_code == 413


def _kserve(server, inputs, **kw):
    return httpx.post(server.url + "/v2/models/cosyvoice2/infer", json={"inputs": inputs, **kw}, timeout=60)


TT = {"name": "target_text", "shape": [1, 1], "datatype": "BYTES", "data": ["你好"]}
BAD_KSERVE = [
    ([{**TT, "datatype": "FP32", "data": [1.0]}], "target_text"),
    ([{**TT, "shape": [2, 1], "data": ["a", "b"]}], "target_text"),
    ([TT, {"name": "speaker", "shape": [1, 1], "datatype": "BYTES", "data": ["x"]}], "speaker"),
    ([{"name": "reference_text", "shape": [1, 1], "datatype": "BYTES", "data": ["x"]}], "target_text"),
    ([TT, {"name": "reference_wav", "shape": [1, 4], "datatype": "INT32", "data": [1, 2, 3, 4]}], "reference_wav"),
    ([TT, {"name": "reference_wav", "shape": [1, 3], "datatype": "FP32", "data": [0.1, 0.2]}], "reference_wav"),
    ([TT, {"name": "reference_wav", "shape": [1, 3], "datatype": "FP32", "data": [0.1, 0.2, 0.3]}],
     "reference_text"),
    ([TT, {"name": "reference_wav", "shape": [1, 3], "datatype": "FP32", "data": [0.1, 0.2, 0.3]},
      {"name": "reference_text", "shape": [1, 1], "datatype": "BYTES", "data": ["x"]}], "prompt"),
    ([TT, {"name": "voice", "shape": [1, 1], "datatype": "BYTES", "data": ["nobody"]}], "voice"),
]


@pytest.mark.parametrize("inputs,needle", BAD_KSERVE)
def test_kserve_bad_input(server, inputs, needle):
    r = _kserve(server, inputs)
    assert 400 <= r.status_code < 500, r.text
    assert needle in r.json()["error"]


def test_kserve_unknown_model(server):
    assert httpx.get(server.url + "/v2/models/other").status_code == 404
    assert httpx.post(server.url + "/v2/models/other/infer", json={"inputs": [TT]}).status_code == 404


def test_grpc_bad_input(server):
    import tritonclient.grpc as tg
    from tritonclient.utils import InferenceServerException

    c = tg.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    x = tg.InferInput("target_text", [1, 1], "FP32")
    x.set_data_from_numpy(np.zeros((1, 1), np.float32))
    with pytest.raises(InferenceServerException) as e:
        c.infer("cosyvoice2", [x])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and "target_text" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        c.infer("cosyvoice2", _triton_inputs(tg, np.zeros(100, np.float32), "你好"))
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and "short" in e.value.message()


# ---------------------------------------------------------------------------- concurrency


def _speech(server, text: str, seed: int) -> bytes:
    r = httpx.post(server.url + "/v1/audio/speech", timeout=300, json={
        "model": "cosyvoice2", "voice": "default", "input": text, "response_format": "pcm", "seed": seed})
    assert r.status_code == 200, r.text
    return r.content


def test_eight_concurrent_streams_match_alone_and_batch(server):
    texts = [f"{t}" for t in ("你好，世界。", "今天天气很好。", "Hello there, friend.", "收到好友寄来的礼物。",
                              "我们去公园玩吧。", "This is a test.", "谢谢你的帮助。", "Good morning to you.")]
    alone = [_speech(server, t, 1000 + i) for i, t in enumerate(texts)]
    before = metrics(server.url)
    with cf.ThreadPoolExecutor(8) as ex:
        together = list(ex.map(lambda a: _speech(server, *a), [(t, 1000 + i) for i, t in enumerate(texts)]))
    after = metrics(server.url)
    for a, b in zip(alone, together):
        assert len(a) == len(b)
        x, y = pcm16(a), pcm16(b)
        assert np.linalg.norm(x - y) <= 2e-3 * np.linalg.norm(x)  # float batching noise (see test_pipeline)
    # the LM ran with more than one sequence per step during the concurrent phase
    total = metric(after, "cosyserve_lm_batch_size_count") - metric(before, "cosyserve_lm_batch_size_count")
    le1 = metric(after, "cosyserve_lm_batch_size_bucket", le="1.0") - metric(
        before, "cosyserve_lm_batch_size_bucket", le="1.0")
    assert total > le1, "no LM step had a batch larger than 1"


def test_metrics_scrape(server):
    m = metrics(server.url)
    assert metric(m, "cosyserve_requests_total", protocol="openai", outcome="ok") >= 1
    assert metric(m, "cosyserve_requests_total", protocol="kserve_grpc", outcome="ok") >= 1
    assert metric(m, "cosyserve_first_chunk_latency_seconds_count") >= 1
    assert metric(m, "cosyserve_kv_slots_total") == 8
    assert metric(m, "cosyserve_ready") == 1
    for name in ("cosyserve_queue_depth", "cosyserve_active_streams", "cosyserve_kv_slots_used",
                 "cosyserve_rtf_count", "cosyserve_token2wav_batch_size_count"):
        assert any(n == name for n, _ in m), name
    # device time per stage and the first-chunk phases are exported and consistent
    for stage in ("prefill", "decode", "flow", "hift"):
        assert metric(m, "cosyserve_stage_seconds_count", stage=stage) >= 1, stage
        assert metric(m, "cosyserve_stage_seconds_sum", stage=stage) > 0, stage
    phases = ("queue", "prefill", "decode", "t2w_wait", "token2wav")
    n_first = metric(m, "cosyserve_first_chunk_phase_seconds_count", phase="token2wav")
    assert n_first >= 1
    assert all(metric(m, "cosyserve_first_chunk_phase_seconds_count", phase=p) == n_first for p in phases)
    assert metric(m, "cosyserve_first_chunk_phase_seconds_sum", phase="token2wav") > 0
    # the heap is frozen at ready and again once the graph capture has ended (on CPU: at once)
    logs = server.logs()
    assert "start-up objects out of garbage collection" in logs
    assert "objects left by the background graph capture out of garbage collection" in logs


def test_client_killed_mid_stream_frees_its_slot(server):
    body = {"model": "tts-1", "voice": "default", "response_format": "pcm",
            "input": "这是一个很长的句子，" * 8 + "结束。"}
    with httpx.stream("POST", server.url + "/v1/audio/speech", json=body, timeout=120) as r:
        for _ in r.iter_bytes():
            break  # first chunk, then hang up
    deadline = time.time() + 30
    while time.time() < deadline:
        m = metrics(server.url)
        if metric(m, "cosyserve_kv_slots_used") == 0 and metric(m, "cosyserve_active_streams") == 0:
            break
        time.sleep(0.2)
    assert metric(m, "cosyserve_kv_slots_used") == 0 and metric(m, "cosyserve_active_streams") == 0
    assert metric(m, "cosyserve_requests_total", protocol="openai", outcome="cancelled") >= 1
    assert len(_speech(server, "你好。", 1)) > 0  # still serving


# ---------------------------------------------------------------------------- limits, auth, shutdown


@pytest.fixture(scope="module")
def tight(tmp_path_factory):
    # lengths pinned at 20 speech tokens per text token (--strict-min-len: no stop id before min_len, which
    # random weights otherwise sample now and then): the request that occupies the only slot must not end
    # before the second request arrives
    s = Server(tmp_path_factory.mktemp("tight"), "--max-active-streams", "1", "--max-queue", "0", "--api-key",
               "sekrit", "--min-token-text-ratio", "20", "--max-token-text-ratio", "20", "--strict-min-len",
               "--model-name", "voicebox")
    yield s
    s.stop()


AUTH = {"Authorization": "Bearer sekrit"}


def test_api_key(tight):
    assert httpx.get(tight.url + "/v2/health/ready").status_code == 200  # health is public
    assert httpx.get(tight.url + "/v1/models").status_code == 401
    assert httpx.get(tight.url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(tight.url + "/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(tight.url + "/metrics").status_code == 401
    assert httpx.get(tight.url + "/v2/models/voicebox").status_code == 401
    import tritonclient.grpc as tg
    from tritonclient.utils import InferenceServerException

    c = tg.InferenceServerClient(f"127.0.0.1:{tight.grpc_port}")
    assert c.is_server_live()
    with pytest.raises(InferenceServerException, match="API key"):
        c.get_model_metadata("voicebox")
    assert c.get_model_metadata("voicebox", headers={"authorization": "Bearer sekrit"}).name == "voicebox"
    # serve --model-name: the served name everywhere; clients without one ask for it (with the key)
    from cosyserve.client.protocols import served_model_name

    ids = [m["id"] for m in httpx.get(tight.url + "/v1/models", headers=AUTH).json()["data"]]
    assert ids[0] == "voicebox" and "cosyvoice2" not in ids
    host = tight.url.split("://")[1]
    assert served_model_name("openai", "http", host, "sekrit") == "voicebox"
    assert served_model_name("http", "http", host, "sekrit") == "voicebox"
    assert served_model_name("grpc", "grpc", f"127.0.0.1:{tight.grpc_port}", "sekrit") == "voicebox"
    assert served_model_name("http", "http", host) == "cosyvoice2"  # refused (no key): the default name


def test_admission_settings_route(tight):
    """GET/PATCH /admin/admission: behind the API key; a bad setting is a 400 naming it and changes nothing; a
    change is in effect from the engine's next step (the engine is woken for it) and shows in GET and in the
    admission limit; the capacity model keeps running."""
    url = tight.url + "/admin/admission"
    assert httpx.get(url).status_code == 401 and httpx.patch(url, json={"target": 0.5}).status_code == 401
    before = httpx.get(url, headers=AUTH).json()
    assert before["settings"] == {"mode": "off", "target": 0.8, "start_share": 0.45, "lm_alone": True,
                                  "start_cost": True, "slack_margin": 0.05, "slack_recover": 0.5,
                                  "contention_fit": False, "pace_half_life": 1.0}
    assert before["admission_limit"] == 1 and before["admitted"] == 0
    for body, needle in (({"target": 2}, "target"), ({"lm_alone": 1}, "lm_alone"), ({"mode": "maybe"}, "mode"),
                         ({"speed": 1}, "speed"), ({}, "no admission setting"), ([1], "JSON object"),
                         ({"slack_margin": -0.1}, "slack_margin"), ({"slack_margin": "0.05"}, "slack_margin"),
                         ({"slack_recover": 0}, "slack_recover"), ({"pace_half_life": -1}, "pace_half_life")):
        r = httpx.patch(url, json=body, headers=AUTH)
        assert r.status_code == 400 and needle in r.json()["error"], (body, r.text)
    assert httpx.get(url, headers=AUTH).json()["settings"] == before["settings"]
    r = httpx.patch(url, json={"mode": 3, "target": 0.6, "lm_alone": False, "slack_margin": 0.08,
                               "slack_recover": 0.2, "contention_fit": True, "pace_half_life": 0}, headers=AUTH)
    assert r.status_code == 200 and r.json()["settings"]["mode"] == "3", r.text
    assert r.json()["settings"]["slack_margin"] == 0.08 and r.json()["settings"]["slack_recover"] == 0.2
    want = {"mode": "3", "target": 0.6, "start_share": 0.45, "lm_alone": False, "start_cost": True,
            "slack_margin": 0.08, "slack_recover": 0.2, "contention_fit": True, "pace_half_life": 0}
    deadline = time.time() + 30
    while (now := httpx.get(url, headers=AUTH).json())["settings"] != want and time.time() < deadline:
        time.sleep(0.05)
    assert now["settings"] == want and now["admission_limit"] == 1  # N = 3 streams, at most --max-active-streams
    assert "admission settings changed" in tight.logs()
    # back to the command line's settings (the next test needs its one stream and empty queue)
    r = httpx.patch(url, json={"mode": "off", "target": 0.8, "lm_alone": True, "slack_margin": 0.05,
                               "slack_recover": 0.5, "contention_fit": False, "pace_half_life": 1.0}, headers=AUTH)
    assert r.status_code == 200
    while httpx.get(url, headers=AUTH).json()["settings"] != before["settings"] and time.time() < deadline:
        time.sleep(0.05)
    assert httpx.get(url, headers=AUTH).json()["settings"] == before["settings"]


def test_admission_reset_route(tight):
    """POST /admin/admission/reset: behind the API key; an unknown field or a non-boolean calibrate is a 400; the
    capacity model forgets its measurements (logged), and with ``{"calibrate": true}`` the start-up calibration runs
    again (here ``--max-active-streams 1``: one LM-only request)."""
    url = tight.url + "/admin/admission/reset"
    assert httpx.post(url, json={}).status_code == 401
    for body, needle in (({"speed": 1}, "speed"), ({"calibrate": "yes"}, "calibrate")):
        r = httpx.post(url, json=body, headers=AUTH)
        assert r.status_code == 400 and needle in r.json()["error"], (body, r.text)
    r = httpx.post(url, headers=AUTH)  # (no body: reset only)
    assert r.status_code == 200 and r.json() == {"reset": True, "calibrated": None}, r.text
    r = httpx.post(url, json={"calibrate": True}, headers=AUTH)
    assert r.status_code == 200 and r.json() == {"reset": True, "calibrated": 1}, r.text
    deadline = time.time() + 30
    while "measurements were reset" not in tight.logs() and time.time() < deadline:
        time.sleep(0.05)
    assert "measurements were reset" in tight.logs() and "admission calibration: 1 of 1" in tight.logs()


def test_queue_full_429_and_graceful_shutdown(tight):
    body = {"model": "tts-1", "voice": "default", "response_format": "pcm",
            "input": "这是一个用来占住唯一位置的长句子，" * 6}
    with httpx.stream("POST", tight.url + "/v1/audio/speech", json=body, headers=AUTH, timeout=300) as r:
        it = r.iter_bytes()
        next(it)
        busy = httpx.post(tight.url + "/v1/audio/speech", json=body, headers=AUTH, timeout=60)
        assert busy.status_code == 429 and "busy" in busy.json()["error"]["message"]
        tight.proc.send_signal(signal.SIGTERM)  # graceful: the running stream is finished or closed cleanly
        rest = b"".join(it)
    assert tight.proc.wait(timeout=60) == 0
    assert "Traceback" not in tight.logs()
    assert len(rest) % 2 == 0


def test_prefix_mode_prebuilds_the_known_voices(tmp_path):
    """``--flow-stream-cache prefix``: the server builds its known voices' prompt prefixes at start-up (the default
    voice here), not while streams run, and streams of that voice start from it (no build of their own)."""
    s = Server(tmp_path, "--flow-stream-cache", "prefix", "--max-active-streams", "2", "--min-token-text-ratio", "3",
               "--max-token-text-ratio", "4")
    try:
        r = httpx.post(s.url + "/v1/audio/speech", json={"model": "tts-1", "voice": "default", "input": "你好，世界。",
                                                         "response_format": "pcm", "stream_format": "audio"},
                       timeout=120)
        assert r.status_code == 200 and len(r.content) > 0, r.text
        logs = s.logs()
        line = next(x for x in logs.splitlines() if "voice prompt prefixes of" in x)
        assert "prebuilt 1 voice prompt prefixes of 1 voices" in line, line
        assert logs.count("flow prompt prefix built for voice") == 1  # the start-up build only
    finally:
        assert s.stop() == 0


def test_loading_cancelled_by_a_stop_is_not_a_failure(caplog, monkeypatch):
    """A server stopped while its models load (SIGTERM; a router's shutdown while it restarts a worker) logs the
    cancellation at info level without a traceback, and its health does not turn to "failed"; a real load error
    still does, with its message."""
    import asyncio
    import threading

    from cosyserve.server.state import ServerConfig, ServerState

    state = ServerState(ServerConfig())
    release = threading.Event()
    monkeypatch.setattr(state, "_load_sync", lambda: release.wait(10))

    async def start_then_cancel():
        task = asyncio.create_task(state.start())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()

    with caplog.at_level("INFO", logger="cosyserve.server"):
        asyncio.run(start_then_cancel())
    assert state.load_error is None and not state.ready
    assert any("model loading cancelled" in r.message for r in caplog.records)
    assert not any(r.levelname == "ERROR" or r.exc_info for r in caplog.records)

    def broken():
        raise RuntimeError("flow.pt is truncated")

    monkeypatch.setattr(state, "_load_sync", broken)
    with caplog.at_level("INFO", logger="cosyserve.server"), pytest.raises(RuntimeError):
        asyncio.run(state.start())
    assert isinstance(state.load_error, RuntimeError)
    assert any(r.levelname == "ERROR" and "flow.pt is truncated" in r.getMessage() for r in caplog.records)

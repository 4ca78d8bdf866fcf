"""Disaggregated serving (issue 18, layout b) on the CPU demo model.

An LLM server (``serve --llm-only``) streams completions; a token2wav server (``serve --llm-url``)
synthesizes speech from those streamed tokens over every protocol; its tokens equal the
all-in-one engine's for a seed; an LLM server killed mid-stream fails that stream with a clear
error and the token2wav server serves again once the LLM is back; the router's disaggregated
layout answers every protocol from one port; ``--metrics-port`` serves /metrics without the
API key while the speech routes still need it.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from _server import Server, free_port

PROMPT = Path(__file__).resolve().parent.parent / "cosyserve" / "assets" / "prompts" / "zero_shot_prompt.wav"
TRANSCRIPT = "希望你以后能够做的比我还好呦。"
LONG_TEXT = "，".join(["收到好友从远方寄来的生日礼物"] * 6) + "。"
KEY = {"Authorization": "Bearer sekret"}


def start(tmp: Path, *extra: str, port: int | None = None) -> Server:
    """A Server (tests/_server.py) whose HTTP port is ``port`` when given (to restart on it)."""
    return Server(tmp, *extra, port=port)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("disagg")


@pytest.fixture(scope="module")
def llm(cache):
    s = start(cache, "--llm-only", "--max-active-streams", "4")
    yield s
    if s.proc.poll() is None:
        assert s.stop() == 0, s.logs()


@pytest.fixture(scope="module")
def t2w(cache, llm):
    # 20 speech tokens per text token: the LM is still generating LONG_TEXT's tokens (~3 s on the demo)
    # when the kill test stops it
    s = start(cache, "--llm-url", llm.url, "--api-key", "sekret", "--metrics-port", str(free_port()),
              "--min-token-text-ratio", "20", "--max-token-text-ratio", "20", "--max-active-streams", "4")
    yield s
    code = s.stop()
    assert code == 0, s.logs()
    assert "Traceback" not in s.logs()


def _sse_lines(resp) -> list[tuple[float, str]]:
    return [(time.monotonic(), line[5:].strip()) for line in resp.iter_lines() if line.startswith("data:")]


def _prompt(extra: dict) -> dict:
    return {"model": "cosyvoice2", "prompt": "<|sos|>hello world, this is a test.<|task_id|>", **extra}


def test_streaming_completions_match_non_streaming(llm):
    body = _prompt({"max_tokens": 300, "min_tokens": 300, "seed": 11})
    plain = httpx.post(llm.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    with httpx.stream("POST", llm.url + "/v1/completions", timeout=120,
                      json={**body, "stream": True, "return_token_ids": True,
                            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _sse_lines(r)
    assert events[-1][1] == "[DONE]"
    chunks = [json.loads(d) for _, d in events[:-1]]
    deltas = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is None]
    # sent as the engine produced them: many events, the first well before the end
    assert len(deltas) > 10, len(deltas)
    first = next(t for (t, d), c in zip(events, chunks) if c["choices"] and c["choices"][0]["text"])
    assert events[-1][0] - first > 0.05
    assert "".join(d["text"] for d in deltas) == plain["text"]
    ids = [i for d in deltas for i in d["token_ids"]]
    toks = [int(t) for t in re.findall(r"<\|s_(\d+)\|>", plain["text"])]
    assert len(ids) == len(toks) == 300 and [i - ids[0] for i in ids] == [t - toks[0] for t in toks]
    final = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [f["finish_reason"] for f in final] == [plain["finish_reason"]] == ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 300


def test_streaming_completions_disconnect_frees_the_slot_and_errors_are_4xx(llm):
    bad = httpx.post(llm.url + "/v1/completions", json={**_prompt({"stream": True}), "prompt": [1, 2, 3]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"  # before the stream starts
    assert httpx.post(llm.url + "/v1/completions", json=_prompt({"stream": True, "echo": True})).status_code == 400
    with httpx.stream("POST", llm.url + "/v1/completions", timeout=60,
                      json=_prompt({"max_tokens": 3000, "min_tokens": 3000, "stream": True})) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # hang up after the first event
    deadline = time.time() + 20
    while time.time() < deadline:
        m = httpx.get(llm.url + "/metrics").text
        if "cosyserve_kv_slots_used 0.0" in m and "cosyserve_active_streams 0.0" in m:
            return
        time.sleep(0.2)
    raise AssertionError("the disconnected stream still holds its slot:\n" + m)


def test_remote_engine_tokens_equal_local_engine(llm):
    """The seam: RemoteLMEngine (tokens streamed from the LLM server) samples exactly what the
    all-in-one EngineCore samples for a seed, and makes the same streamed audio from them. The
    remote engine runs with ``auto`` admission (the default on CUDA), whose state it shares with
    EngineCore (a missing attribute failed it on the H100 in session 27)."""
    from cosyserve.engine.admission import AdmissionPolicy
    from cosyserve.engine.core import EngineConfig
    from cosyserve.engine.pipeline import Synthesizer
    from cosyserve.engine.request import AudioChunk, RequestFinished, SynthesisParams
    from cosyserve.engine.token_source import RemoteLMEngine, remote_source_for
    model_dir = llm.cache / "demo-model"
    local = Synthesizer(model_dir)
    remote = Synthesizer(model_dir, load_llm=False)
    assert remote.models.llm is None
    voice = local.make_voice("v", str(PROMPT), TRANSCRIPT)
    params = SynthesisParams(seed=1234, stream=True, min_token_text_ratio=6, max_token_text_ratio=6)
    cfg = EngineConfig(max_active=2)

    def run(engine, synth):
        req = synth.build_request("你好，世界。Hello.", voice, params, "r1")
        chunks, fin = [], None
        for ev in engine.run_to_completion(req):
            if isinstance(ev, AudioChunk):
                chunks.append(ev.samples)
            elif isinstance(ev, RequestFinished):
                fin = ev
        return chunks, fin

    a_chunks, a = run(local.new_engine(cfg), local)
    source = remote_source_for(remote.models, len(remote.frontend.tokenizer), llm.url)
    engine = RemoteLMEngine(remote.models, source, EngineConfig(max_active=2, admission=AdmissionPolicy("auto")))
    try:
        b_chunks, b = run(engine, remote)
    finally:
        engine.close()
    assert a.outcome.value == b.outcome.value == "ok", (a.error, b.error)
    assert b.tokens == a.tokens and len(a.tokens[0]) > 25
    assert len(b_chunks) >= 2
    x, y = np.concatenate(a_chunks), np.concatenate(b_chunks)
    assert x.shape == y.shape
    assert np.linalg.norm(x - y) <= 1e-5 * max(np.linalg.norm(x), 1e-9)


def _openai_sse(url: str, text: str, on_first=None) -> tuple[int, list[dict]]:
    with httpx.stream("POST", url + "/v1/audio/speech", headers=KEY, timeout=180,
                      json={"model": "tts-1", "voice": "default", "input": text, "response_format": "pcm",
                            "stream_format": "sse", "seed": 5}) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.json()]
        events = []
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
                if len(events) == 1 and on_first is not None:
                    on_first()
        return 200, events


def test_t2w_server_streams_over_openai_and_grpc(t2w):
    import tritonclient.grpc as tg
    from tritonclient.utils import InferenceServerException

    code, events = _openai_sse(t2w.url, "你好，世界。")
    assert code == 200, events
    audio = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(audio) >= 2 and events[-1]["type"] == "speech.audio.done", (len(audio), events[-1], t2w.logs()[-4000:])

    g = tg.InferenceServerClient(f"127.0.0.1:{t2w.grpc_port}")
    results: queue.Queue = queue.Queue()
    g.start_stream(callback=lambda result, error: results.put(error or result),
                   headers={"authorization": KEY["Authorization"]})
    t = tg.InferInput("target_text", [1, 1], "BYTES")
    t.set_data_from_numpy(np.array([["你好，世界。"]], dtype=object))
    # the OpenAI request's seed: the same tokens (a random seed let the tiny LM stop after 11 tokens, one chunk)
    g.async_stream_infer("cosyvoice2", [t], request_id="g1", outputs=[tg.InferRequestedOutput("waveform")],
                         enable_empty_final_response=True, parameters={"seed": 5})
    chunks = []
    while True:
        r = results.get(timeout=120)
        assert not isinstance(r, InferenceServerException), (r, t2w.logs()[-4000:])
        if r.get_response().parameters["triton_final_response"].bool_param:
            break
        chunks.append(r.as_numpy("waveform").reshape(-1))
    g.stop_stream()
    assert len(chunks) >= 2 and all(c.size for c in chunks), (len(chunks), t2w.logs()[-4000:])


def test_metrics_port_needs_no_key_and_opens_nothing_else(t2w):
    port = int(t2w.proc.args[t2w.proc.args.index("--metrics-port") + 1])
    m = httpx.get(f"http://127.0.0.1:{port}/metrics")
    assert m.status_code == 200 and "cosyserve_requests_total" in m.text
    assert httpx.post(f"http://127.0.0.1:{port}/v1/audio/speech", json={}).status_code == 404
    assert httpx.get(f"http://127.0.0.1:{port}/v1/audio/voices").status_code == 404
    assert httpx.get(t2w.url + "/metrics").status_code == 401
    assert httpx.post(t2w.url + "/v1/audio/speech", json={"model": "tts-1", "input": "你好"}).status_code == 401


def test_admission_reset_on_disaggregated_servers(llm, t2w):
    """``POST /admin/admission/reset``: the LM server resets its capacity model but cannot calibrate (that runs
    through the whole model: a 400 naming ``calibrate``); a token2wav server with ``--llm-url`` has no local
    capacity model to reset (400)."""
    r = httpx.post(llm.url + "/admin/admission/reset", json={"calibrate": True}, timeout=30)
    assert r.status_code == 400 and "calibrate" in r.text, r.text
    r = httpx.post(llm.url + "/admin/admission/reset", json={}, timeout=30)
    assert r.status_code == 200 and r.json() == {"reset": True, "calibrated": None}, r.text
    r = httpx.post(t2w.url + "/admin/admission/reset", headers={"Authorization": "Bearer sekret"}, timeout=30)
    assert r.status_code == 400 and "no local capacity model" in r.text, r.text


def test_llm_killed_mid_stream_fails_that_stream_and_recovers(cache, llm, t2w):
    port = llm.port
    code, events = _openai_sse(t2w.url, LONG_TEXT, on_first=lambda: llm.kill())
    assert code == 200 and events[0]["type"] == "speech.audio.delta"
    assert events[-1]["type"] == "error", events[-1]
    msg = events[-1]["error"]["message"]
    assert f"LLM server http://127.0.0.1:{port}" in msg, msg
    r = httpx.post(t2w.url + "/v1/audio/speech", headers=KEY, timeout=60,
                   json={"model": "tts-1", "voice": "default", "input": "你好。"})
    assert r.status_code == 502 and "LLM server" in r.json()["error"]["message"], r.text
    import tritonclient.grpc as tg
    from tritonclient.utils import InferenceServerException

    t = tg.InferInput("target_text", [1, 1], "BYTES")
    t.set_data_from_numpy(np.array([["你好。"]], dtype=object))
    with pytest.raises(InferenceServerException) as e:
        tg.InferenceServerClient(f"127.0.0.1:{t2w.grpc_port}").infer(
            "cosyvoice2", [t], headers={"authorization": KEY["Authorization"]})
    assert "UNAVAILABLE" in str(e.value) and f"LLM server http://127.0.0.1:{port}" in str(e.value), str(e.value)
    assert httpx.get(t2w.url + "/v2/health/live").status_code == 200
    back = start(cache, "--llm-only", "--max-active-streams", "4", port=port)
    try:
        code, events = _openai_sse(t2w.url, "你好，世界。")
        assert code == 200 and events[-1]["type"] == "speech.audio.done", events[-1]
    finally:
        assert back.stop() == 0


@pytest.mark.parametrize("args,needle", [(["--llm-url", "ftp://x"], "must be http://"),
                                          (["--llm-url", "http://127.0.0.1:{port}"], "cannot list the LLM server"),
                                          (["--llm-url", "http://x:1", "--llm-only"], "give one of them"),
                                          (["--llm-gpus", "0"], "needs both"),
                                          (["--llm-workers", "1", "--llm-url", "http://x:1"], "one or the other")])
def test_llm_url_option_errors(args, needle, capsys, tmp_path, monkeypatch):
    from cosyserve.cli import main

    monkeypatch.setenv("COSYSERVE_CACHE_DIR", str(tmp_path))
    args = [a.replace("{port}", str(free_port())) for a in args]
    assert main(["serve", "--demo", "--voices-dir", str(tmp_path / "v"), *args]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("cosyserve: error: ") and needle in last and "Traceback" not in err, err


def test_worker_argv_drops_disaggregation_options():
    from cosyserve.cli import _worker_argv

    argv = ["serve", "--demo", "--llm-gpus", "0", "--t2w-gpus=1,2", "--metrics-port", "9100", "--llm-workers", "2",
            "--max-active-streams", "8"]
    assert _worker_argv(argv) == ["--demo", "--max-active-streams", "8"]


def test_llm_workers_on_one_gpu_print_why_they_are_slow(monkeypatch, capsys, tmp_path):
    """`serve --llm-workers N` on a GPU says that the processes take turns on one device (measured ~10x
    slower than one process, docs/perf.md "Session 31") and what to run instead; on CPU it says nothing."""
    import cosyserve.cli as cli
    from cosyserve.server import router

    configs = []

    async def fake_router(cfg):
        configs.append(cfg)

    monkeypatch.setattr(router, "serve_router", fake_router)
    argv = ["serve", "--demo", "--llm-workers", "1", "--port", str(free_port()), "--grpc-port", str(free_port())]
    for device, noted in (("cpu", False), ("cuda", True)):
        monkeypatch.setattr(cli, "_device", lambda name, d=device: d)
        assert cli.main(argv) == 0
        err = capsys.readouterr().err
        assert (cli.SHARED_GPU_NOTE in err) == noted, err
    assert [[w.role for w in c.workers] for c in configs] == [["llm", "speech"]] * 2


def test_disaggregated_router_answers_every_protocol(cache):
    import tritonclient.grpc as tg
    import tritonclient.http as th

    mport = free_port()
    (cache / "router").mkdir()
    s = Server(cache / "router", "--llm-workers", "1", "--workers", "1", "--metrics-port", str(mport),
               "--min-token-text-ratio", "3", "--max-token-text-ratio", "3")
    try:
        deadline = time.time() + 240
        while True:
            ws = httpx.get(s.url + "/router/workers").json()["workers"]
            if all(w["state"] == "ready" for w in ws) or time.time() > deadline:
                break
            time.sleep(0.5)
        assert sorted(w["role"] for w in ws) == ["llm", "speech"] and all(w["state"] == "ready" for w in ws), ws
        r = httpx.post(s.url + "/v1/audio/speech", timeout=120,
                       json={"model": "tts-1", "voice": "default", "input": "你好。", "response_format": "pcm"})
        assert r.status_code == 200 and len(r.content) > 0
        h = th.InferenceServerClient(f"127.0.0.1:{s.port}")
        t = th.InferInput("target_text", [1, 1], "BYTES")
        t.set_data_from_numpy(np.array([["你好。"]], dtype=object))
        assert h.infer("cosyvoice2", [t]).as_numpy("waveform").shape[1] > 0
        g = tg.InferenceServerClient(f"127.0.0.1:{s.grpc_port}")
        t = tg.InferInput("target_text", [1, 1], "BYTES")
        t.set_data_from_numpy(np.array([["你好。"]], dtype=object))
        assert g.infer("cosyvoice2", [t]).as_numpy("waveform").shape[1] > 0
        m = httpx.get(f"http://127.0.0.1:{mport}/metrics").text
        assert 'cosyserve_router_worker_ready{worker="1"} 1.0' in m
        # supervision: the LLM worker that dies is restarted on its port; speech works again after
        llm_w = next(w for w in ws if w["role"] == "llm")
        os.kill(llm_w["pid"], signal.SIGKILL)
        deadline = time.time() + 240
        while time.time() < deadline:
            w = next(x for x in httpx.get(s.url + "/router/workers").json()["workers"] if x["role"] == "llm")
            if w["restarts"] == 1 and w["state"] == "ready":
                break
            time.sleep(0.5)
        assert w["restarts"] == 1 and w["state"] == "ready" and w["http_port"] == llm_w["http_port"], w
        r = httpx.post(s.url + "/v1/audio/speech", timeout=120,
                       json={"model": "tts-1", "voice": "default", "input": "你好。", "response_format": "pcm"})
        assert r.status_code == 200 and len(r.content) > 0
    finally:
        assert s.stop() == 0, s.logs()


@pytest.mark.gpu
def test_remote_engine_on_cuda_uses_token2wav_graphs(llm):
    """On CUDA the remote engine builds the flow/HiFT CUDA graphs as EngineCore does and streams."""
    import torch

    from cosyserve.engine.core import EngineConfig
    from cosyserve.engine.pipeline import Synthesizer
    from cosyserve.engine.request import AudioChunk, RequestFinished, SynthesisParams
    from cosyserve.engine.token_source import RemoteLMEngine, remote_source_for

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    remote = Synthesizer(llm.cache / "demo-model", device="cuda", load_llm=False)
    voice = remote.make_voice("v", str(PROMPT), TRANSCRIPT)
    source = remote_source_for(remote.models, len(remote.frontend.tokenizer), llm.url)
    engine = RemoteLMEngine(remote.models, source, EngineConfig(max_active=2))
    try:
        assert remote.models.flow.graph is not None and remote.models.hift.graph_decode is not None
        engine.warmup()
        req = remote.build_request("你好，世界。Hello.", voice, SynthesisParams(
            seed=3, stream=True, min_token_text_ratio=6, max_token_text_ratio=6), "g1")
        evs = list(engine.run_to_completion(req))
    finally:
        engine.close()
    assert isinstance(evs[-1], RequestFinished) and evs[-1].outcome.value == "ok", evs[-1].error
    assert sum(isinstance(e, AudioChunk) for e in evs) >= 2


def _client_with(handler):
    from cosyserve.client.remote_lm import StreamingCompletionsLM, speech_vocab

    c = StreamingCompletionsLM("http://lm.example:9/v1", speech_vocab(151663, 6561), model="m", timeout_s=1.0)
    c._http = httpx.AsyncClient(base_url=c.base, transport=httpx.MockTransport(handler))
    return c


def _collect(client):
    import asyncio

    async def go():
        out = []
        try:
            async for d in client.stream([1, 2], 1, 10, seed=3):
                out.append(d)
        finally:
            await client.aclose()
        return out
    return asyncio.run(go())


class _Chunks(httpx.AsyncByteStream):
    def __init__(self, parts, fail: Exception | None = None):
        self.parts, self.fail = parts, fail

    async def __aiter__(self):
        for p in self.parts:
            yield p
        if self.fail is not None:
            raise self.fail


def _event(text, reason=None):
    return ("data: " + json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": reason}]}) + "\n\n").encode()


def test_streaming_client_parses_split_tokens_and_sends_the_request():
    from cosyserve.client.remote_lm import RemoteLMError

    seen = {}

    def handler(request):
        seen.update(json.loads(request.content))
        return httpx.Response(200, stream=_Chunks([_event("<|s_1|><|s"), _event("_2|> "), _event("<|s_3|><|eos1|>"),
                                                   b"data: [DONE]\n\n"]))
    out = _collect(_client_with(handler))
    assert [t for d in out for t in d.tokens] == [1, 2, 3] and out[-1].finish_reason == "stop"
    assert seen["stream"] is True and seen["prompt"] == [1, 2] and seen["seed"] == 3 and seen["model"] == "m"
    assert seen["min_tokens"] == 1 and seen["max_tokens"] == 10

    cases = [
        (lambda r: httpx.Response(503, text="overloaded"), "answered HTTP 503: overloaded"),
        (lambda r: (_ for _ in ()).throw(httpx.ConnectError("refused")), "ConnectError"),
        (lambda r: (_ for _ in ()).throw(httpx.ReadTimeout("slow")), "timed out"),
        (lambda r: httpx.Response(200, stream=_Chunks([_event("<|s_1|>")], httpx.RemoteProtocolError("cut"))),
         "RemoteProtocolError"),
        (lambda r: httpx.Response(200, stream=_Chunks([_event("<|s_1|>")])), "before its finish_reason"),
        (lambda r: httpx.Response(200, stream=_Chunks([b"data: {not json\n\n"])), "malformed stream event"),
        (lambda r: httpx.Response(200, stream=_Chunks([b'data: {"error": {"message": "boom"}}\n\n'])), "boom"),
    ]
    for handler, needle in cases:
        with pytest.raises(RemoteLMError) as e:
            _collect(_client_with(handler))
        assert "LLM server http://lm.example:9" in str(e.value) and needle in str(e.value), str(e.value)


def test_llm_checkpoint_sends_the_decoder_bias(llm, tmp_path):
    """--llm-checkpoint (external servers): the convert-llm folder's vocabulary and its decoder
    bias as logit_bias; a folder that is no checkpoint is a one-line CLI error."""
    from cosyserve.cli import main
    from cosyserve.client.remote_lm import load_checkpoint_info
    from cosyserve.engine.pipeline import Synthesizer
    from cosyserve.engine.token_source import remote_source_for
    from cosyserve.models.export import export_llm

    model_dir = llm.cache / "demo-model"
    export_llm(model_dir, tmp_path / "ck")
    sv, bias = load_checkpoint_info(tmp_path / "ck")
    syn = Synthesizer(model_dir, load_llm=False)
    src = remote_source_for(syn.models, len(syn.frontend.tokenizer), llm.url, checkpoint=str(tmp_path / "ck"))
    try:
        lb = src.client.logit_bias
        assert src.client.sv == sv and len(lb) == len(bias)
        assert lb[str(sv.speech_token_offset + 5)] == pytest.approx(max(-100, min(100, bias[5])))
    finally:
        src.close()
    assert main(["serve", "--model-dir", str(model_dir), "--llm-url", llm.url, "--llm-checkpoint",
                 str(tmp_path)]) == 2


def _stream_with(interval_s: float, feed) -> list[dict]:
    """The events ``completions._stream_events`` writes for one prompt whose engine queue gets what
    ``feed(queue)`` (a coroutine) puts into it, with ``--llm-stream-interval interval_s``."""
    import asyncio
    from types import SimpleNamespace

    from cosyserve.client.remote_lm import speech_vocab
    from cosyserve.server.completions import _stream_events

    aborted = []
    state = SimpleNamespace(config=SimpleNamespace(llm_stream_interval_s=interval_s),
                            metrics=SimpleNamespace(record=lambda *a: None),
                            engine=SimpleNamespace(abort=aborted.append))
    body = SimpleNamespace(model="cosyvoice2", return_token_ids=True, stream_options=None)

    async def go():
        q: asyncio.Queue = asyncio.Queue()
        task = asyncio.create_task(feed(q))
        out = [json.loads(e[6:]) async for e in _stream_events(
            state, body, [(SimpleNamespace(request_id="r"), 3)], [q], speech_vocab(151663, 6561))
            if e.strip() != b"data: [DONE]"]
        await task
        return out
    events = asyncio.run(go())
    assert aborted == []
    return events


def test_streamed_completion_gathers_queued_tokens_and_spaces_events():
    """Tokens of several engine steps already queued go out in one event; with an interval a prompt's
    events are at least that far apart (its tokens gathered meanwhile); tokens, their order and the
    finish reason are unchanged."""
    import asyncio

    from cosyserve.engine.request import Outcome, RequestFinished, TokensGenerated

    async def burst(q):  # three steps' tokens queued before the writer runs
        for k in range(3):
            q.put_nowait(TokensGenerated("r", 0, [k]))
        q.put_nowait(RequestFinished("r", Outcome.OK, stop_reasons=["stop"]))

    ev = _stream_with(0.0, burst)
    assert [e["choices"][0]["text"] for e in ev] == ["<|s_0|><|s_1|><|s_2|>", ""]
    assert ev[-1]["choices"][0]["finish_reason"] == "stop" and len(ev[0]["choices"][0]["token_ids"]) == 3

    async def paced(q):  # one token every 10 ms
        for k in range(12):
            q.put_nowait(TokensGenerated("r", 0, [k]))
            await asyncio.sleep(0.01)
        q.put_nowait(RequestFinished("r", Outcome.OK, stop_reasons=["length"]))

    one_each = _stream_with(0.0, paced)
    spaced = _stream_with(0.05, paced)
    tokens = [t for e in spaced for t in (e["choices"][0]["token_ids"] or [])]
    assert tokens == [t for e in one_each for t in (e["choices"][0]["token_ids"] or [])] and len(tokens) == 12
    # ~120 ms of tokens: an event each when the writer keeps up; in events >= 50 ms apart with the interval
    assert len(spaced) < len(one_each) and 1 <= len(spaced) - 1 <= 4
    assert spaced[-1]["choices"][0]["finish_reason"] == "length"


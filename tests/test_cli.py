"""`cosyserve` commands on the reference tiny model directory; bad input gives one clear line."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf
import torch

from _reference import model_dir, require_reference_dir
from cosyserve.cli import main

TEXT = "你好，世界。"
TRANSCRIPT = "希望你以后能够做的比我还好呦。"
RATIO = ["--min-token-text-ratio", "4", "--max-token-text-ratio", "5"]


@pytest.fixture(scope="module")
def prompt_wav():
    return str(require_reference_dir() / "audio" / "zero_shot_prompt.wav")


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_synthesize_prompt_wav_offline_and_stream(tmp_path, capsys, prompt_wav):
    md = model_dir()
    out1 = tmp_path / "off.wav"
    code, out, err = run(capsys, "synthesize", "--model-dir", md, "--prompt-wav", prompt_wav, "--prompt-text",
                         TRANSCRIPT, "--text", TEXT, "--seed", 3, "-o", out1, *RATIO)
    assert code == 0, err
    assert "RTF" in out
    out2 = tmp_path / "stream.wav"
    code, out, err = run(capsys, "synthesize", "--model-dir", md, "--prompt-wav", prompt_wav, "--prompt-text",
                         TRANSCRIPT, "--text", TEXT, "--seed", 3, "--stream", "-o", out2, *RATIO)
    assert code == 0, err
    assert "first-chunk latency" in out and "RTF" in out
    a, sr = sf.read(out1)
    b, sr2 = sf.read(out2)
    assert sr == sr2 == 24000 and a.shape == b.shape
    n_tokens = int(out.split(" speech tokens")[0].split()[-1])
    assert len(b) == n_tokens * 960 and np.abs(b).max() > 0.01


def test_voices_lifecycle_and_synthesize_by_voice(tmp_path, capsys, prompt_wav):
    md, vd = model_dir(), tmp_path / "voices"
    code, out, err = run(capsys, "voices", "--voices-dir", vd, "add", "alice", "--model-dir", md,
                         "--prompt-wav", prompt_wav, "--prompt-text", TRANSCRIPT)
    assert code == 0, err
    code, out, _ = run(capsys, "voices", "--voices-dir", vd, "list")
    assert "alice" in out and TRANSCRIPT in out
    code, out, err = run(capsys, "synthesize", "--model-dir", md, "--voices-dir", vd, "--voice", "alice",
                         "--text", TEXT, "--seed", 1, "-o", tmp_path / "a.wav", *RATIO)
    assert code == 0, err
    code, out, err = run(capsys, "voices", "--voices-dir", vd, "export", tmp_path / "spk2info.pt")
    assert code == 0 and "exported 1" in out
    code, out, err = run(capsys, "voices", "--voices-dir", tmp_path / "v2", "import", tmp_path / "spk2info.pt")
    assert code == 0 and "alice" in out
    code, out, err = run(capsys, "voices", "--voices-dir", vd, "remove", "alice")
    assert code == 0
    code, out, err = run(capsys, "voices", "--voices-dir", vd, "remove", "alice")
    assert code == 2 and "unknown voice 'alice'" in err


def test_reference_spk2info_imports(tmp_path, capsys):
    code, out, err = run(capsys, "voices", "--voices-dir", tmp_path, "import", model_dir() / "spk2info.pt")
    assert code == 0, err


@pytest.fixture()
def garbage(tmp_path):
    p = tmp_path / "garbage.wav"
    p.write_bytes(b"RIFF\x00\x00not really a wav file at all" * 10)
    return p


@pytest.fixture()
def short_wav(tmp_path):
    p = tmp_path / "short.wav"
    sf.write(p, np.random.default_rng(0).standard_normal(8000).astype(np.float32) * 0.1, 16000)
    return p


@pytest.fixture()
def long_wav(tmp_path):
    p = tmp_path / "long.wav"
    sf.write(p, np.random.default_rng(0).standard_normal(16000 * 31).astype(np.float32) * 0.1, 16000)
    return p


@pytest.fixture()
def text_file(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_text("hello")
    return p


BAD = [
    # (args builder, expected message fragment)
    (lambda f: ["--prompt-wav", "/nonexistent/x.wav", "--prompt-text", TRANSCRIPT, "--text", TEXT], "not found"),
    (lambda f: ["--prompt-wav", f["garbage"], "--prompt-text", TRANSCRIPT, "--text", TEXT], "decode"),
    (lambda f: ["--prompt-wav", f["text_file"], "--prompt-text", TRANSCRIPT, "--text", TEXT], "decode"),
    (lambda f: ["--prompt-wav", f["short"], "--prompt-text", TRANSCRIPT, "--text", TEXT], "too short"),
    (lambda f: ["--prompt-wav", f["long"], "--prompt-text", TRANSCRIPT, "--text", TEXT], "too long"),
    (lambda f: ["--prompt-wav", f["ok"], "--prompt-text", TRANSCRIPT, "--text", "   "], "text is empty"),
    (lambda f: ["--prompt-wav", f["ok"], "--prompt-text", "", "--text", TEXT], "transcript"),
    (lambda f: ["--voices-dir", f["tmp"], "--voice", "nobody", "--text", TEXT], "unknown voice 'nobody'"),
    (lambda f: ["--text", TEXT], "a voice is required"),
]


@pytest.mark.parametrize("i", range(len(BAD)))
def test_bad_input_one_clear_message(i, tmp_path, capsys, garbage, short_wav, long_wav, text_file, prompt_wav):
    files = {"garbage": garbage, "short": short_wav, "long": long_wav, "text_file": text_file, "ok": prompt_wav,
             "tmp": tmp_path / "voices"}
    args, fragment = BAD[i]
    code, out, err = run(capsys, "synthesize", "--model-dir", model_dir(), *args(files), "-o", tmp_path / "o.wav")
    assert code == 2
    assert err.startswith("cosyserve: error: ") and fragment in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_wrong_model_dir(tmp_path, capsys):
    code, out, err = run(capsys, "synthesize", "--model-dir", tmp_path, "--prompt-wav", "x.wav", "--prompt-text", "x",
                         "--text", TEXT, "-o", tmp_path / "o.wav")
    assert code == 2 and "not a complete CosyVoice2 model directory" in err and "llm.pt" in err
    code, out, err = run(capsys, "synthesize", "--model-dir", tmp_path / "missing", "--voice", "x", "--text", TEXT,
                         "-o", tmp_path / "o.wav")
    assert code == 2 and "does not exist" in err


def test_unsupported_output_format(tmp_path, capsys, prompt_wav):
    code, out, err = run(capsys, "synthesize", "--model-dir", model_dir(), "--prompt-wav", prompt_wav, "--prompt-text",
                         TRANSCRIPT, "--text", TEXT, "-o", tmp_path / "o.xyz")
    assert code == 2 and "unsupported output format" in err


def test_real_process_prints_no_traceback(tmp_path):
    """The installed entry point, as a user runs it."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    p = subprocess.run([sys.executable, "-m", "cosyserve.cli", "synthesize", "--model-dir", str(tmp_path), "--voice",
                        "v", "--text", "hi", "-o", str(tmp_path / "o.wav")], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 2
    assert p.stderr.strip().startswith("cosyserve: error:") and "Traceback" not in p.stderr


def test_convert_llm(tmp_path, capsys):
    code, out, err = run(capsys, "convert-llm", model_dir(), tmp_path / "hf", "--dtype", "float32")
    assert code == 0, err
    assert "151663" in out and (tmp_path / "hf" / "model.safetensors").is_file()
    sd = torch.load(model_dir() / "llm.pt", weights_only=True)
    from safetensors.torch import load_file

    out_sd = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(out_sd["model.norm.weight"], sd["llm.model.model.norm.weight"])


@pytest.mark.parametrize("value", ["-1", "soon"])
def test_t2w_slack_is_auto_or_seconds(capsys, value):
    code, out, err = run(capsys, "serve", "--model-dir", model_dir(), "--t2w-slack", value)
    assert code == 2 and "--t2w-slack must be" in err and "Traceback" not in err


def test_t2w_queue_steps_must_not_be_negative(capsys):
    code, out, err = run(capsys, "serve", "--model-dir", model_dir(), "--t2w-queue-steps", "-1")
    assert code == 2 and "--t2w-queue-steps must be >= 0, got -1" in err and "Traceback" not in err


@pytest.mark.parametrize("value", ["-5", "nan", "inf", "soon"])
def test_t2w_queue_ms_is_auto_or_milliseconds(capsys, value):
    code, out, err = run(capsys, "serve", "--model-dir", model_dir(), "--t2w-queue-ms", value)
    assert code == 2 and f"--t2w-queue-ms must be 'auto' or milliseconds >= 0, got '{value}'" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("value", ["0", "many"])
def test_max_t2w_tokens_is_a_positive_integer(capsys, value):
    with pytest.raises(SystemExit) as exc:  # an argparse usage error
        run(capsys, "serve", "--model-dir", model_dir(), "--max-t2w-tokens", value)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--max-t2w-tokens" in err and "positive integer" in err and "Traceback" not in err


@pytest.mark.parametrize("option,value,message", [("--t2w-batch-target", "0", "positive integer"),
                                                  ("--t2w-gather", "-1", "number >= 0"),
                                                  ("--t2w-gather", "soon", "number >= 0"),
                                                  ("--t2w-length-window", "1", "in [0, 1)"),
                                                  ("--t2w-length-window", "-0.5", "in [0, 1)")])
def test_token2wav_batching_options_are_validated(capsys, option, value, message):
    with pytest.raises(SystemExit) as exc:  # an argparse usage error
        run(capsys, "serve", "--model-dir", model_dir(), option, value)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and option in err and message in err and "Traceback" not in err


def test_engine_options_reach_the_server_config(capsys, monkeypatch):
    """The engine options of `serve` end up in its EngineConfig (one set of options, shared with
    `bench --in-process`); the defaults are EngineConfig's own."""
    from cosyserve.engine.core import EngineConfig

    seen = {}

    async def fake_serve(cfg, log_format="text"):
        seen["cfg"] = cfg

    import cosyserve.server.app as app

    monkeypatch.setattr(app, "serve", fake_serve)
    code, out, err = run(capsys, "serve", "--model-dir", model_dir(), "--max-t2w-tokens", "4096", "--lazy-graphs",
                         "--t2w-batch-target", "8", "--t2w-gather", "0.25", "--hift-dtype", "float16",
                         "--max-active-streams", "5", "--max-queue", "7", "--t2w-queue-steps", "0",
                         "--t2w-queue-ms", "0", "--sampling", "host", "--t2w-slack", "auto",
                         "--lm-stream-priority", "normal",
                         "--token2wav-thread", "--decode-lookahead", "2", "--t2w-length-window", "0.5",
                         "--kv-max-len", "1536", "--dit-graph-memory", "0.12", "--hift-f0", "per-item",
                         "--llm-stream-interval", "0.03")
    assert code == 0, err
    e = seen["cfg"].engine
    assert e.max_t2w_tokens == 4096 and e.graph_warmup is False and e.t2w_graph_warmup is False
    assert e.kv_max_len == 1536 and e.dit_graph_memory == 0.12 and e.hift_f0 == "per-item"
    assert e.t2w_batch_target == 8 and e.t2w_gather_s == 0.25
    assert (e.max_active, e.max_queue, e.t2w_queue_steps, e.device_sampling) == (5, 7, None, False)
    assert e.t2w_queue_s is None
    assert e.t2w_slack_s is None and e.lm_stream_priority is False and e.t2w_thread is True
    assert e.decode_lookahead == 2 and e.t2w_length_window == 0.5
    assert seen["cfg"].hift_dtype == "float16" and seen["cfg"].llm_stream_interval_s == 0.03
    code, out, err = run(capsys, "serve", "--model-dir", model_dir())
    assert code == 0 and seen["cfg"].hift_dtype == "auto"
    # CLI defaults = the engine's defaults, except that serve captures its CUDA graphs in the background
    assert seen["cfg"].engine == EngineConfig(graph_capture="background")
    code, out, err = run(capsys, "serve", "--model-dir", model_dir(), "--kv-max-len", "32")
    assert code != 0 and "Traceback" not in err and "kv_max_len" in err, err
    code, out, err = run(capsys, "serve", "--model-dir", model_dir(), "--dit-graph-memory", "0")
    assert code != 0 and "Traceback" not in err and "dit_graph_memory" in err, err


def test_bench_in_process_engine_options(capsys, monkeypatch):
    """`bench --in-process` takes the same engine options as `serve`; a server bench has none."""
    import cosyserve.client.bench as bench

    seen = {}

    def fake_run_bench(opts, echo=print):
        seen["opts"] = opts
        return {"levels": [{"failed": 0, "ok": 1}]}

    monkeypatch.setattr(bench, "run_bench", fake_run_bench)
    code, out, err = run(capsys, "bench", "--in-process", "--demo", "--max-active-streams", "3", "--t2w-gather", "0",
                         "--t2w-queue-steps", "2", "--t2w-queue-ms", "40")
    assert code == 0, err
    e = seen["opts"].engine
    assert (e.max_active, e.t2w_gather_s, e.t2w_queue_steps, e.t2w_queue_s) == (3, 0.0, 2, 0.04)
    code, out, err = run(capsys, "bench", "--url", "grpc://127.0.0.1:1")
    assert code == 0 and seen["opts"].engine is None
    code, out, err = run(capsys, "bench", "--in-process", "--demo", "--t2w-queue-steps", "-2")
    assert code == 2 and "--t2w-queue-steps must be >= 0" in err and "Traceback" not in err


def test_hift_dtype_choices(capsys):
    with pytest.raises(SystemExit) as exc:  # an argparse usage error
        run(capsys, "serve", "--model-dir", model_dir(), "--hift-dtype", "int8")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--hift-dtype" in err and "invalid choice" in err and "Traceback" not in err


def test_synthesize_with_a_bfloat16_hift_trunk(tmp_path, capsys, prompt_wav):
    """--hift-dtype reaches the synthesizer: the same seeded request with HiFT's convolutions in
    bfloat16 gives the same length and nearly, not exactly, the float32 waveform."""
    wavs = []
    for dt in ("float32", "bfloat16"):
        wavs.append(tmp_path / f"{dt}.wav")
        code, out, err = run(capsys, "synthesize", "--model-dir", model_dir(), "--prompt-wav", prompt_wav,
                             "--prompt-text", TRANSCRIPT, "--text", TEXT, "--seed", 3, "--hift-dtype", dt,
                             "-o", wavs[-1], *RATIO)
        assert code == 0, err
    a, b = sf.read(wavs[0])[0], sf.read(wavs[1])[0]
    assert a.shape == b.shape and not np.array_equal(a, b)
    assert np.linalg.norm(a - b) < 0.1 * np.linalg.norm(a)


def test_compile_cache_points_torch_at_a_folder(tmp_path, monkeypatch):
    """--compile-cache: Inductor's cache (compiled fused kernels) goes to the folder given, by default
    under COSYSERVE_CACHE_DIR unless TORCHINDUCTOR_CACHE_DIR is set; 'off' leaves torch's default;
    a folder that cannot be created is a one-line CLI error."""
    from cosyserve import cli

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("COSYSERVE_CACHE_DIR", str(tmp_path / "cache"))
    assert cli._compile_cache(None) == tmp_path / "cache" / "compile"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "cache" / "compile").resolve())
    assert cli._compile_cache(str(tmp_path / "mine")) == tmp_path / "mine"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "mine").resolve())
    assert cli._compile_cache(None) == tmp_path / "mine"  # an explicit TORCHINDUCTOR_CACHE_DIR is kept
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert cli._compile_cache("off") is None and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    (tmp_path / "file").write_text("x")
    with pytest.raises(cli.CLIError, match="--compile-cache"):
        cli._compile_cache(str(tmp_path / "file" / "sub"))

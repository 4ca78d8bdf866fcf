"""`cosyserve demo` (what `make demo` runs) and the demo model directory."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import soundfile as sf

from cosyserve.models.checkpoint import read_state_dict
from cosyserve.models.config import load_config
from cosyserve.models.demo import is_demo_model, write_demo_model
from cosyserve.models.loader import load_models


def test_demo_command_writes_real_length_24k_audio(tmp_path):
    p = subprocess.run([sys.executable, "-m", "cosyserve.cli", "demo", "--out", str(tmp_path)], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert "RANDOM" in p.stdout and "noise" in p.stdout
    reports = re.findall(r"wrote (\S+): ([\d.]+) s of audio, (\d+) speech tokens", p.stdout)
    latencies = re.findall(r"first-chunk latency (\d+) ms", p.stdout)
    assert len(reports) == 2 and len(latencies) == 2
    for path, dur, n_tok in reports:
        audio, sr = sf.read(path)
        assert sr == 24000 and audio.ndim == 1
        assert len(audio) == int(n_tok) * 960  # 25 tokens/s -> 0.04 s per token
        assert abs(len(audio) / sr - float(dur)) < 1e-6
        assert np.sqrt(np.mean(audio ** 2)) > 1e-3  # not silent
    assert {p.rsplit("_", 1)[-1] for p, _, _ in reports} == {"zh.wav", "en.wav"}


def test_demo_model_dir_is_official_layout(tmp_path):
    d = write_demo_model(tmp_path / "m")
    assert is_demo_model(d)
    cfg = load_config(d / "cosyvoice2.yaml")
    load_models(d)  # strict loading of all three checkpoints
    assert any(k.endswith(".parametrizations.weight.original0") for k in read_state_dict(d / "hift.pt"))
    assert "llm.model.lm_head.weight" in read_state_dict(d / "llm.pt")
    assert cfg.llm.speech_token_size == 6561 and cfg.sample_rate == 24000
    again = write_demo_model(tmp_path / "m")  # idempotent
    assert again == d

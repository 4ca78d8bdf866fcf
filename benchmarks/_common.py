"""Helpers shared by the GPU benchmark scripts in this folder (run as ``python3 benchmarks/X.py``,
which puts this folder on ``sys.path``)."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def add_model_args(ap: argparse.ArgumentParser, device: bool = True) -> None:
    """``--yaml`` / ``--qwen-config`` (the full-size CosyVoice2-0.5B architecture by default),
    ``--device`` (unless ``device=False``: CUDA only) and ``--dtype``."""
    ap.add_argument("--yaml", default=str(ROOT / "benchmarks/configs/cosyvoice2-0.5b.yaml"))
    ap.add_argument("--qwen-config", default=str(ROOT / "benchmarks/configs/CosyVoice-BlankEN-config.json"))
    if device:
        ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")


def gpu_ms(fn, n=30, warm=3) -> float:
    """Median GPU time of ``fn`` in ms over ``n`` calls after ``warm`` (CUDA events)."""
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def kernel_times(fn) -> dict[str, list]:
    """One call's GPU kernels (torch.profiler): ``{kernel name: [calls, total ms]}``."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    acc: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a = acc.setdefault(e.name, [0, 0.0])
            a[0] += 1
            a[1] += e.device_time_total / 1e3
    return acc

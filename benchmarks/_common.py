"""Helpers shared by the GPU benchmark scripts in this folder (run as ``python3 benchmarks/X.py``,
which puts this folder on ``sys.path``)."""

from __future__ import annotations

import argparse
import contextlib
import functools
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


def print_table(title: str, columns: list[str], rows: list[tuple]) -> None:
    """Print ``title`` and a Markdown table: ``columns`` (the first left-aligned, the rest right),
    one line per row of ``rows``."""
    print(title)
    print("| " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * (len(columns) - 1))
    for r in rows:
        print("| " + " | ".join(str(v) for v in r) + " |")


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


@contextlib.contextmanager
def phase_ranges(phases: dict):
    """Wrap calls in ``torch.profiler.record_function("phase:<label>")`` ranges while the block runs.

    ``phases``: ``{label: [(obj, attr), ...]}`` — ``obj`` an instance, a class or a module whose
    ``attr`` is called during the block; every attribute is put back as it was afterwards (an
    instance's shadowing attribute removed). Count the operators per label with :func:`ops_by_phase`."""
    from torch.profiler import record_function

    saved = []
    for label, targets in phases.items():
        for obj, attr in targets:
            fn = getattr(obj, attr)

            def wrapped(*a, _fn=fn, _label=label, **k):
                with record_function("phase:" + _label):
                    return _fn(*a, **k)

            own = vars(obj)
            saved.append((obj, attr, attr in own, own.get(attr)))
            setattr(obj, attr, functools.wraps(fn)(wrapped))
    try:
        yield
    finally:
        for obj, attr, had, old in reversed(saved):
            if had:
                setattr(obj, attr, old)
            else:
                delattr(obj, attr)


def ops_by_phase(prof) -> dict:
    """aten operator count per :func:`phase_ranges` label of a ``torch.profiler.profile`` (the
    innermost range holding the operator; ``other`` outside all)."""
    events = prof.events()
    ranges = [e for e in events if e.name.startswith("phase:")]
    out: dict = {}
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        inner = None
        for r in ranges:
            if r.time_range.start <= e.time_range.start and e.time_range.end <= r.time_range.end:
                if inner is None or r.time_range.elapsed_us() < inner.time_range.elapsed_us():
                    inner = r
        label = inner.name[len("phase:"):] if inner is not None else "other"
        out[label] = out.get(label, 0) + 1
    return out

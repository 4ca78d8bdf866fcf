"""Stage micro-benchmark on one GPU: the CUDA-graphed stages one at a time.

Full-size CosyVoice2 architecture, random weights. Prints, per stage and shape, the time of
one replayed graph (median of CUDA-event timings) and the time to build (capture) its graphs.
Stages: LM decode step with device sampling (batch 1/8/32/39, 512 KV positions; busy slots
packed or spread), single-sequence prefill (128 positions), flow solve (10 Euler steps with
CFG) at batch x frames, the flow encoder (``FlowModel.condition``, eager, host wall time).

    python benchmarks/stage_probe.py --device cuda --dtype bfloat16

(docs/perf-history.md run 8 used it with a since-removed ``torch.compile`` variant of each stage.)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import add_model_args, gpu_ms, kernel_times

from cosyserve.models import fused
from cosyserve.models.graphs import GraphedDecoder, GraphedFlow, GraphedPrefill
from cosyserve.models.llm import DecodeState, KVCache
from cosyserve.models.loader import build_random


def wall_ms(fn, n=20, warm=3, until_done=True) -> float:
    """Median ms of ``fn`` from a GPU at rest: until its work is done, or (``until_done=False``)
    only the host time to issue it."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        if until_done:
            torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
    return statistics.median(ts)


def kernels(fn) -> int:
    """GPU kernels (and memory copies/sets) one call of ``fn`` runs, graph nodes included
    (torch.profiler / CUPTI); -1 if the profiler is unavailable."""
    try:
        return sum(calls for calls, _ in kernel_times(fn).values())
    except Exception:  # noqa: BLE001 - a count is a nicety, timings are the point
        return -1


class _Rows(list):
    """Result rows, each also printed as soon as it is measured (a run cut short keeps them)."""

    HEAD = "| stage | shape | ms per call | build s | GPU kernels |\n|---|---|---:|---:|---:|"

    @staticmethod
    def fmt(row) -> str:
        stage, shape, ms, build, *n = row
        return f"| {stage} | {shape} | {ms:.2f} | {build:.1f} | {n[0] if n else ''} |"

    def append(self, row):
        super().append(row)
        print(self.fmt(row), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--flow-shapes", default="1x120,4x120,16x250", help="batch x tokens (87 prompt tokens included)")
    ap.add_argument("--decode-batches", default="1,8,32,39")
    ap.add_argument("--stages", default="encoder,decode,prefill,flow", help="which of them to measure")
    ap.add_argument("--no-fused", action="store_true", help="eager instead of the fused kernels (cosyserve.models.fused)")
    ap.add_argument("--kernel-table", type=int, default=0, metavar="N",
                    help="also print the N most expensive kernels of the largest decode step and flow batch")
    args = ap.parse_args()
    stages = set(args.stages.split(","))
    if args.no_fused:
        fused.set_enabled(False)
    dtype = getattr(torch, args.dtype)
    models = build_random(args.yaml, device=args.device, dtype=dtype, qwen_config_path=args.qwen_config)
    lm, flow = models.llm, models.flow
    dev = torch.device(args.device)
    batches = [int(b) for b in args.decode_batches.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.flow_shapes.split(",")]
    rows = _Rows()
    g = torch.Generator(device="cpu").manual_seed(0)

    # encoder (eager; not part of the graphs)
    for n_tok in ((100, 300) if "encoder" in stages else ()):
        tok = torch.randint(0, 6561, (1, n_tok), generator=g)
        ptok = torch.randint(0, 6561, (1, 87), generator=g)
        feat = torch.randn(1, 174, 80, generator=g)
        emb = torch.randn(1, 192, generator=g)
        ms = wall_ms(lambda: flow.condition([tok], [ptok], [feat], emb, True, False))
        rows.append(("flow encoder (eager, wall)", f"1 x {n_tok + 87} tokens", ms, float("nan")))
        ms = wall_ms(lambda: flow.condition([tok], [ptok], [feat], emb, True, False), n=10, warm=2, until_done=False)
        rows.append(("flow encoder (eager, host issue time)", f"1 x {n_tok + 87} tokens", ms, float("nan")))

    if stages & {"decode", "prefill"}:
        lm_stages(lm, models.cfg.llm, batches, rows, g, dev, dtype, args.kernel_table)
    if "flow" in stages:
        flow_stages(flow, shapes, rows, g, args.kernel_table)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, "
          f"fused kernels {'off' if args.no_fused else 'on'}")
    print(_Rows.HEAD)
    for row in sorted(rows, key=lambda r: (r[0], r[1])):
        print(_Rows.fmt(row))


def lm_stages(lm, cfg, batches, rows, g, dev, dtype, table=0):
    """The engine's decode step (device sampling, slot-ordered rows) at ``batches`` busy slots
    0..b-1 and, for each b, the same number of busy slots spread over the next power of two
    (slots below the next power of two above b, picked at random: the bucket's idle rows are
    computed and discarded)."""
    torch.manual_seed(0)
    top = max(batches)
    n_slots = 1 << top.bit_length()
    cache = KVCache.allocate(lm, n_slots + 1, 1024)
    cache.k.normal_()
    cache.v.normal_()
    state = DecodeState.allocate(cache.n_slots, cfg.sampling.win_size, dev)
    t0 = time.perf_counter()
    dec = GraphedDecoder(lm, cache, n_slots, kv_buckets=[512], sampling=cfg.sampling, eos_id=cfg.eos_token,
                         state=state)
    dec.warmup()
    build = time.perf_counter() - t0
    for b in batches:
        spread = sorted(torch.randperm(1 << b.bit_length(), generator=g)[:b].tolist())
        for label, slots in ((f"batch {b}, 512 KV", torch.arange(b)),
                             (f"batch {b} in slots < {spread[-1] + 1}, 512 KV", torch.tensor(spread))):
            start = torch.full((b,), 300, dtype=torch.long)
            keys = (torch.zeros(b, dtype=torch.long), torch.full((b,), 5, dtype=torch.long), torch.zeros(b, dtype=torch.bool))
            step = lambda: dec.sample(slots, start, *keys)  # noqa: E731
            rows.append(("LM decode step (device sampling)", label, gpu_ms(step), build, kernels(step)))
            build = float("nan")
    if table:
        print_kernel_table(step, f"one decode step ({label})", table)
    t0 = time.perf_counter()
    pre = GraphedPrefill(lm, cache, bucket=128, max_len=128)
    pre.warmup()
    build = time.perf_counter() - t0
    emb = torch.randn(1, 120, lm.qwen_config.hidden_size, generator=g).to(dev, dtype)
    rows.append(("LM prefill", "1 x 120 (bucket 128)", gpu_ms(lambda: pre(emb, 0)), build, kernels(lambda: pre(emb, 0))))


def print_kernel_table(fn, what: str, n: int) -> None:
    """The ``n`` most expensive GPU kernels of one call of ``fn`` (name, calls, ms, share)."""
    times = sorted(kernel_times(fn).items(), key=lambda kv: -kv[1][1])
    total = sum(ms for _, ms in dict(times).values())
    print(f"\nkernels of {what}: {sum(c for c, _ in dict(times).values())} in all, {total:.2f} ms")
    print("| kernel | calls | ms | share |\n|---|---:|---:|---:|")
    for name, (calls, ms) in times[:n]:
        print(f"| `{name[:110]}` | {calls} | {ms:.3f} | {100 * ms / total:.1f} % |")
    print()


def flow_stages(flow, shapes, rows, g, table=0):
    graph = GraphedFlow(flow, max(b for b, _ in shapes))
    for b, n_tok in shapes:
        inp = flow.prepare([torch.randint(0, 6561, (1, n_tok - 87), generator=g) for _ in range(b)],
                           [torch.randint(0, 6561, (1, 87), generator=g) for _ in range(b)],
                           [torch.randn(1, 174, 80, generator=g) for _ in range(b)],
                           torch.randn(b, 192, generator=g), True, False)
        t0 = time.perf_counter()
        graph(inp)
        torch.cuda.synchronize()
        build = time.perf_counter() - t0
        rows.append(("flow graph (encoder + 10 steps, CFG)", f"batch {b} x {n_tok} tokens",
                     gpu_ms(lambda: graph(inp), n=10), build, kernels(lambda: graph(inp))))
        rows.append(("flow launch (host)", f"batch {b} x {n_tok} tokens",
                     wall_ms(lambda: graph(inp), n=10, warm=2, until_done=False), build))
    if table:
        print_kernel_table(lambda: graph(inp), f"one flow solve (batch {b} x {n_tok} tokens)", table)


if __name__ == "__main__":
    main()

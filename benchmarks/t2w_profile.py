"""Where a token2wav batch spends its time on one GPU: DiT (Step-Audio2) streaming chunks and the CosyVoice3 flow.

For each mode and batch size prints one JSON line: host wall time of the call, GPU time (CUDA events),
kernels launched per call, and the split between stages (DiT: encoder / Euler solve / HiFT); then a
``torch.profiler`` table (top operators by self CPU time and top kernels by CUDA time) of one call at the
largest batch. Full-size architectures with random weights, bf16 (``--dtype``).

    python3 benchmarks/t2w_profile.py --mode dit --batches 1,8,32
    python3 benchmarks/t2w_profile.py --mode dit --batches 1,4,8 --offline-tokens 250   # offline utterances
    python3 benchmarks/t2w_profile.py --mode cv3 --batches 1,4 --yaml benchmarks/configs/cosyvoice3-0.5b.yaml
    python3 benchmarks/t2w_profile.py --mode dit --batches 1,8,16 --solve-kernels 12   # the solve's kernels by kind

``--solve-kernels N``: the DiT solve of N streams' chunks (steady-state caches), eagerly and as its CUDA graph,
under the torch profiler: its kernels grouped by kind (GEMM, attention, fused Triton, norms, copies, other) with
count, total and mean time — where the solve's device time goes. With ``--offline-tokens T`` too: the solve of N
offline utterances (prompt + T target tokens, no cache), padded to the server's coarse frame buckets.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cosyserve.models.config import load_dit_flow_config, stepaudio2_hift_config  # noqa: E402
from cosyserve.models.dit_token2wav import FULL_SIZE, build_random_dit_token2wav, dit_flow_yaml  # noqa: E402


def _events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def _kernels(prof) -> int:
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def _profile(fn, label: str, rows: int = 15) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    avg = prof.key_averages()
    print(f"--- {label}: top host operators (self CPU) ---")
    print(avg.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))
    print(f"--- {label}: top kernels (CUDA) ---")
    print(avg.table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=60))
    return _kernels(prof)


def _time(fn, n: int = 5, warm: int = 2) -> tuple[float, float]:
    """(host ms, GPU ms) medians of ``fn()``; the GPU idle at each start."""
    host, gpu = [], []
    for k in range(warm + n):
        torch.cuda.synchronize()
        a, b = _events()
        t0 = time.perf_counter()
        a.record()
        fn()
        h = (time.perf_counter() - t0) * 1e3
        b.record()
        b.synchronize()
        if k >= warm:
            host.append(h)
            gpu.append(a.elapsed_time(b))
    return statistics.median(host), statistics.median(gpu)


def steady_streams(t2w, rows: int, prompt_tokens: int, g) -> tuple[list, list]:
    """``rows`` streams set up on random prompts of ``prompt_tokens`` tokens and grown to the steady
    state (4 chunks: caches trimmed to prompt + 100 frames), and each one's next chunk of 25 + 3
    look-ahead tokens: ``(states, tokens)``."""
    prompts = [(torch.randint(0, 6561, (prompt_tokens,), generator=g),
                torch.randn(2 * prompt_tokens, 80, generator=g).cuda(), torch.randn(192, generator=g).cuda())
               for _ in range(rows)]
    states = t2w.stream_setup_batch(prompts)
    for _ in range(4):
        toks = [torch.randint(0, 6561, (28,), generator=g) for _ in range(rows)]
        states = [s for _, s in t2w.stream_step_batch(states, toks, [False] * rows)]
    return states, [torch.randint(0, 6561, (28,), generator=g) for _ in range(rows)]


def chunk_items(flow, states, toks) -> list:
    """The flow items of the streams' next (non-final) chunks."""
    from cosyserve.models.dit_flow import DitItem

    return [DitItem(tokens=flow._check_tokens(t), spk=s.flow.spk, last=False, state=s.flow)
            for s, t in zip(states, toks)]


def dit(args) -> None:
    tmp = Path("/tmp/t2w_profile")
    tmp.mkdir(exist_ok=True)
    (tmp / "flow.yaml").write_text(dit_flow_yaml(FULL_SIZE))
    cfg = load_dit_flow_config(tmp / "flow.yaml")
    hcfg = stepaudio2_hift_config(FULL_SIZE.hift_channels, FULL_SIZE.hift_f0_channels)
    dtype = getattr(torch, args.dtype)
    t2w = build_random_dit_token2wav(cfg, hcfg, device="cuda", dtype=dtype, seed=0)
    if not args.eager:
        t2w.flow.enable_cuda_graphs()
    flow = t2w.flow
    g = torch.Generator().manual_seed(0)
    if args.solve_kernels:
        return solve_kernels(t2w, args.solve_kernels, args.prompt_tokens, g, args.trace_kernels, args.offline_tokens)
    if args.offline_tokens:
        return dit_offline(args, t2w, g)
    last_fn = None
    for b in (int(x) for x in args.batches.split(",")):
        states, toks = steady_streams(t2w, b, args.prompt_tokens, g)

        @torch.inference_mode()
        def encode():
            items = chunk_items(flow, states, toks)
            return flow._encode(items), items

        @torch.inference_mode()
        def solve():
            (mu, mlen, _), items = enc_out
            return flow._solve(items, mu, mlen, flow.cfg.n_timesteps)

        def step():
            return t2w.stream_step_batch(states, toks, [False] * b)

        enc_out = encode()
        e_host, e_gpu = _time(encode)
        s_host, s_gpu = _time(solve)
        t_host, t_gpu = _time(step)
        print(json.dumps({"mode": "dit", "graphs": not args.eager, "dtype": args.dtype, "streams": b,
                          "cache_frames": states[0].flow.cache_frames,
                          "encode_host_ms": round(e_host, 2), "encode_gpu_ms": round(e_gpu, 2),
                          "solve_host_ms": round(s_host, 2), "solve_gpu_ms": round(s_gpu, 2),
                          "step_host_ms": round(t_host, 2), "step_gpu_ms": round(t_gpu, 2),
                          "per_stream_gpu_ms": round(t_gpu / b, 3)}), flush=True)
        last_fn = step
    n = _profile(last_fn, "dit stream_step_batch")
    print(json.dumps({"mode": "dit", "kernels_per_call": n}))


#: kernel name fragments -> kind (first match wins; lower-case)
KINDS = (("attention", ("fmha", "flash", "attention", "sdpa", "efficient_attention")),
         ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm80_")),
         ("fused (triton)", ("triton",)),
         ("norm", ("layer_norm", "layernorm", "norm")),
         ("copy / cat / index", ("copy", "cat", "index", "gather", "scatter", "fill", "memcpy", "memset",
                                 "cols_kernel")),
         ("elementwise", ("elementwise", "vectorized", "unrolled", "reduce")))


def kernel_kinds(prof) -> list[tuple[str, int, float]]:
    """``[(kind, kernels, total µs)]`` of a profile's CUDA kernels, by :data:`KINDS`."""
    out: dict[str, list] = {}
    for e in prof.key_averages():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.key.lower()
        kind = next((k for k, frags in KINDS if any(f in name for f in frags)), "other")
        row = out.setdefault(kind, [0, 0.0])
        row[0] += e.count
        t = getattr(e, "self_device_time_total", None)
        row[1] += e.self_cuda_time_total if t is None else t
    return sorted(((k, n, t) for k, (n, t) in out.items()), key=lambda r: -r[2])


def offline_items(flow, rows: int, prompt_tokens: int, target_tokens: int, g) -> list:
    """``rows`` offline utterances: random prompts of ``prompt_tokens`` tokens (mel ``2 x`` that), each
    followed by ``target_tokens`` target tokens (one pass, no cache)."""
    return [flow.prompt_item(torch.randint(0, 6561, (prompt_tokens,), generator=g),
                             torch.randn(2 * prompt_tokens, 80, generator=g).cuda(),
                             torch.randn(192, generator=g).cuda(),
                             torch.randint(0, 6561, (target_tokens,), generator=g), last=True)
            for _ in range(rows)]


def solve_kernels(t2w, rows: int, prompt_tokens: int, g, trace: int = 0, offline_tokens: int = 0) -> None:
    """Profile one DiT solve of ``rows`` streams (steady-state caches), eager and graphed; with
    ``offline_tokens``, of ``rows`` offline utterances instead, padded as the server pads them (to the
    coarse frame buckets of solves without cache)."""
    from torch.profiler import ProfilerActivity, profile

    flow = t2w.flow
    if offline_tokens:
        items, cache = offline_items(flow, rows, prompt_tokens, offline_tokens, g), 0
        if flow.graph is not None:
            flow.graph.coarse_uncached = True
    else:
        states, toks = steady_streams(t2w, rows, prompt_tokens, g)
        items, cache = chunk_items(flow, states, toks), states[0].flow.cache_frames
    with torch.inference_mode():
        mu, mlen, _ = flow._encode(items)
    graph = flow.graph
    for label, use in (("eager", None), ("graph", graph)):
        if label == "graph" and graph is None:
            continue
        flow.graph = use

        @torch.inference_mode()
        def solve():
            return flow._solve(items, mu, mlen, flow.cfg.n_timesteps)

        host, gpu = _time(solve, n=5, warm=2)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            solve()
            torch.cuda.synchronize()
        kinds = kernel_kinds(prof)
        total_us = sum(t for _, _, t in kinds)
        what = "offline utterances" if offline_tokens else "streams"
        print(f"--- DiT solve, {rows} {what} ({2 * rows} CFG rows x {max(mlen)} frames, cache "
              f"{cache} frames), {label}: {gpu:.2f} ms GPU (events), {host:.2f} ms host; "
              f"kernels seen by the profiler {sum(n for _, n, _ in kinds)}, {total_us / 1e3:.2f} ms")
        print("| kind | kernels | total ms | share | mean µs |\n|---|---:|---:|---:|---:|")
        for k, n, t in kinds:
            print(f"| {k} | {n} | {t / 1e3:.2f} | {100 * t / max(total_us, 1e-9):.0f} % | {t / max(n, 1):.1f} |")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=70))
        if trace:  # the kernels in the order they ran (one layer and Euler step is ~20 of them)
            kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            kern.sort(key=lambda e: e.time_range.start)
            print(f"first {trace} of {len(kern)} kernels in order (µs):")
            for e in kern[:trace]:
                print(f"  {e.time_range.elapsed_us():8.1f}  {e.name[:110]}")
        print(json.dumps({"mode": "dit-solve-kernels", "label": label, "streams": rows, "gpu_ms": round(gpu, 2),
                          "kinds": {k: [n, round(t / 1e3, 3)] for k, n, t in kinds}}), flush=True)
    flow.graph = graph


def dit_offline(args, t2w, g) -> None:
    """Offline utterances (prompt + ``--offline-tokens`` target tokens, one pass each) in batches:
    eagerly (a bucket no graph was planned for, as the server runs them) and, unless ``--eager``,
    with the bucket's graph captured on first use."""
    flow = t2w.flow
    p, n = args.prompt_tokens, args.offline_tokens
    if flow.graph is not None:  # pad solves without cache as the server does once it planned offline utterances
        flow.graph.coarse_uncached = True
    last_fn = None
    for b in (int(x) for x in args.batches.split(",")):
        items = offline_items(flow, b, p, n, g)

        @torch.inference_mode()
        def run():
            return flow.forward_items(items, final_states=False)

        rows = {}
        for label, on_use in (("eager", False), ("graph", True)):
            if label == "graph" and flow.graph is None:
                continue
            if flow.graph is not None:
                flow.graph.capture_on_use = on_use
            host, gpu = _time(run, n=3, warm=1)
            rows[label] = (round(host, 1), round(gpu, 1))
        audio_s = b * 2 * n / 50  # mel frames at 50/s of the target tokens
        frames = 2 * (p + n)  # the solve's mel frames: prompt + target tokens, 2 per token
        padded = flow.graph.solve_frames_bucket(frames, 0) if flow.graph is not None else frames
        print(json.dumps({"mode": "dit-offline", "dtype": args.dtype, "utterances": b, "prompt_tokens": p,
                          "target_tokens": n, "audio_s": audio_s, "frames": frames, "graph_padded_frames": padded,
                          **{f"{k}_host_ms": v[0] for k, v in rows.items()},
                          **{f"{k}_gpu_ms": v[1] for k, v in rows.items()},
                          **{f"{k}_x_real_time": round(audio_s / (v[1] / 1e3), 1) for k, v in rows.items()}}),
              flush=True)
        last_fn = run
    if flow.graph is not None:
        flow.graph.capture_on_use = False
    n_k = _profile(last_fn, "dit offline forward_items (eager)")
    print(json.dumps({"mode": "dit-offline", "kernels_per_call_eager": n_k}))


def cv3(args) -> None:
    from cosyserve.models.loader import build_random

    dtype = getattr(torch, args.dtype)
    m = build_random(args.yaml, device="cuda", dtype=dtype, components=("flow", "hift"))
    flow, hift = m.flow, m.hift
    g = torch.Generator().manual_seed(0)
    last_fn = None
    for b in (int(x) for x in args.batches.split(",")):
        p = args.prompt_tokens
        toks = [torch.randint(0, 6561, (1, args.tokens), generator=g).cuda() for _ in range(b)]
        ptok = [torch.randint(0, 6561, (1, p), generator=g).cuda() for _ in range(b)]
        pfeat = [torch.randn(1, 2 * p, 80, generator=g).cuda() for _ in range(b)]
        emb = torch.randn(b, 192, generator=g).cuda()

        def chunk():
            return flow.inference_batch(toks, ptok, pfeat, emb, streaming=True, finalize=False)

        host, gpu = _time(chunk, n=3, warm=1)
        mel = chunk()[0]
        frames = mel.shape[-1]

        def voc():
            return hift.inference_batch([mel.float()] * b, [False] * b) if hasattr(hift, "inference_batch") else None

        h_host, h_gpu = _time(voc, n=3, warm=1)
        print(json.dumps({"mode": "cv3", "dtype": args.dtype, "streams": b, "prompt_tokens": p, "tokens": args.tokens,
                          "new_frames": frames, "flow_host_ms": round(host, 2), "flow_gpu_ms": round(gpu, 2),
                          "hift_host_ms": round(h_host, 2), "hift_gpu_ms": round(h_gpu, 2)}), flush=True)
        last_fn = chunk
    n = _profile(last_fn, "cv3 flow inference_batch (streaming chunk)")
    print(json.dumps({"mode": "cv3", "kernels_per_call": n}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("dit", "cv3"), default="dit")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=87)
    ap.add_argument("--tokens", type=int, default=53, help="cv3: target tokens of the chunk call")
    ap.add_argument("--yaml", default="benchmarks/configs/cosyvoice3-0.5b.yaml")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--eager", action="store_true", help="dit: no CUDA graphs")
    ap.add_argument("--offline-tokens", type=int, default=0,
                    help="dit: time offline utterances of this many target tokens (prompt + target in one pass)")
    ap.add_argument("--solve-kernels", type=int, default=0, metavar="N",
                    help="dit: profile the solve of N streams' chunks (kernels by kind, eager and graphed) only")
    ap.add_argument("--trace-kernels", type=int, default=0, metavar="K",
                    help="with --solve-kernels: also print the first K kernels in the order they ran")
    ap.add_argument("--conv-cols", choices=("kernel", "eager", "compiled"), default="kernel",
                    help="dit: build the causal convolutions' columns with the solve's Triton kernel (default), "
                         "the eager ops (concatenation, unfolding copy, gather) or one compiled (Inductor) op of "
                         "them: A/Bs of docs/perf.md \"Session 32\" and \"Session 33\"")
    args = ap.parse_args()
    if args.conv_cols != "kernel":
        from cosyserve.models import conv_cols, dit_flow
        from cosyserve.models.fused import FusedOp

        eager = conv_cols.causal_cols_eager
        dit_flow.causal_cols = eager if args.conv_cols == "eager" else FusedOp(eager, "dit_causal_cols")
    torch.backends.cuda.matmul.allow_tf32 = True
    dit(args) if args.mode == "dit" else cv3(args)
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}))


if __name__ == "__main__":
    main()

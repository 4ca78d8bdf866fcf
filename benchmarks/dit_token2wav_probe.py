"""Step-Audio2 DiT token2wav at the released size (random weights) on one GPU: streaming chunk cost.

Builds the full-size flow (encoder 512 / 8 heads / 6 + 4 blocks, DiT 512 x 16 blocks) + HiFT with random
weights (``cosyserve.models.dit_token2wav.build_random_dit_token2wav``), sets up B streams on a prompt of
``--prompt-tokens`` tokens, then runs ``--chunks`` batched streaming calls of 25 new tokens (+3 look-ahead)
per stream, eager and with CUDA graphs, in float32 and ``--dtype``. Prints one JSON line per setting:
median flow time per batched chunk call (ms), HiFT time, the first vs last chunk's flow time (the chunk
cost must not grow with the stream: caches are trimmed to prompt + 100 frames), and the half-precision
mel error vs float32. Run: ``python3 benchmarks/dit_token2wav_probe.py [--batches 1,4,16]``.
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


def run(t2w, batch: int, prompt_tokens: int, chunks: int, seed: int = 0):
    dev = next(t2w.flow.parameters()).device
    g = torch.Generator().manual_seed(seed)
    prompts = [(torch.randint(0, 6561, (prompt_tokens,), generator=g), torch.randn(2 * prompt_tokens, 80, generator=g).to(dev),
                torch.randn(192, generator=g).to(dev)) for _ in range(batch)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    states = t2w.stream_setup_batch(prompts)
    torch.cuda.synchronize()
    setup_ms = (time.perf_counter() - t0) * 1e3
    flow_ms, total_ms, mels = [], [], []
    for k in range(chunks):
        toks = [torch.randint(0, 6561, (28,), generator=g) for _ in range(batch)]
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        c = torch.cuda.Event(enable_timing=True)
        a.record()
        res = t2w.flow.chunk_batch([s.flow for s in states], toks, [False] * batch)
        b.record()
        out = t2w.stream_step_batch(states, toks, [False] * batch) if k == chunks - 1 else None
        c.record()
        c.synchronize()
        flow_ms.append(a.elapsed_time(b))
        if out is not None:
            total_ms.append(b.elapsed_time(c))
        states = [type(s)(flow=r[1], hift=s.hift, started=True) for s, r in zip(states, res)]
        mels.append(res[0][0])
    return {"setup_ms": round(setup_ms, 1), "flow_ms_median": round(statistics.median(flow_ms[2:]), 2),
            "flow_ms_first": round(flow_ms[0], 2), "flow_ms_last": round(flow_ms[-1], 2),
            "stream_step_ms_last": round(total_ms[-1], 2),  # flow + HiFT + cross-fade of one call
            "cache_frames": states[0].flow.cache_frames}, mels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--prompt-tokens", type=int, default=150)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    tmp = Path("/tmp/dit_probe")
    tmp.mkdir(exist_ok=True)
    (tmp / "flow.yaml").write_text(dit_flow_yaml(FULL_SIZE))
    cfg = load_dit_flow_config(tmp / "flow.yaml")
    hcfg = stepaudio2_hift_config(FULL_SIZE.hift_channels, FULL_SIZE.hift_f0_channels)
    n_params = None
    ref_mels = {}
    for dtype_name in ("float32", args.dtype):
        dtype = getattr(torch, dtype_name)
        for graphs in (False, True):
            t2w = build_random_dit_token2wav(cfg, hcfg, device="cuda", dtype=dtype, seed=0)
            n_params = n_params or sum(p.numel() for p in t2w.flow.parameters())
            if graphs:
                t2w.flow.enable_cuda_graphs()
            for b in (int(x) for x in args.batches.split(",")):
                r, mels = run(t2w, b, args.prompt_tokens, args.chunks)
                key = (b, graphs)
                if dtype_name == "float32":
                    ref_mels[key] = mels
                    r["rel_err_vs_fp32"] = 0.0
                else:
                    ref = ref_mels[key]
                    errs = [((m - q).norm() / q.norm()).item() for m, q in zip(mels, ref)]
                    r["rel_err_vs_fp32_max"] = float(f"{max(errs):.2e}")
                if graphs:
                    r["graphs_captured"] = t2w.flow.graph.captures
                print(json.dumps({"dtype": dtype_name, "graphs": graphs, "streams": b, **r}), flush=True)
            del t2w
            torch.cuda.empty_cache()
    print(json.dumps({"flow_params_M": round(n_params / 1e6, 1), "gpu": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main()

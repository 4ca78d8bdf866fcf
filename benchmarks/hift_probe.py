"""HiFT micro-benchmark on one GPU: where a token2wav batch's vocoder time goes, and what the
half-precision trunk and the fused Snake kernels change.

Full-size CosyVoice2 HiFT (sizes from the yaml), random weights, a padded batch of B mels of
``--frames`` frames (lengths spread over [frames/2, frames]). Prints per phase (F0 per item,
excitation, decode as one CUDA graph) the median GPU time (CUDA events), and per trunk variant
(float32 / float16 / bfloat16 trunk x Snake eager / fused) the decode time and its error
against the float32 eager decode (relative RMS over valid samples, max abs, and the
fraction of samples at the ``audio_limit`` clamp, where errors are hidden).

    python benchmarks/hift_probe.py --batches 1,12 --frames 250
"""

from __future__ import annotations

import argparse

import torch
from _common import ROOT, gpu_ms, kernel_times

from cosyserve.models import fused
from cosyserve.models.graphs import _capture_graph, capture_stream
from cosyserve.models.loader import build_random


def graphed(fn):
    """``fn`` captured as one CUDA graph (as the engine captures its buckets); returns
    ``(replay, fn's output)``."""
    g, out = _capture_graph(fn, None, capture_stream(torch.device("cuda")))
    return g.replay, out


def _kernel_class(name: str) -> str:
    n = name.lower()
    return ("conv" if ("conv" in n or "xmma" in n or "implicit" in n or "cudnn" in n) else
            "gemm" if ("gemm" in n or "nvjet" in n or "cutlass" in n) else
            "fft" if "fft" in n else "triton (fused)" if "triton" in n else
            "copy/index" if ("copy" in n or "index" in n or "cat" in n or "pad" in n) else "elementwise/other")


def kernel_classes(times: dict) -> str:
    """:func:`kernel_times` summed by coarse class."""
    acc: dict[str, list] = {}
    for name, (calls, ms) in times.items():
        a = acc.setdefault(_kernel_class(name), [0, 0.0])
        a[0] += calls
        a[1] += ms
    return ", ".join(f"{k} {v[1]:.2f} ms/{v[0]}" for k, v in sorted(acc.items(), key=lambda kv: -kv[1][1]))


def top_kernels(times: dict, n=12) -> str:
    rows = sorted(times.items(), key=lambda kv: -kv[1][1])[:n]
    return "\n".join(f"  {v[1]:7.3f} ms {v[0]:5d}x {k[:110]}" for k, v in rows)


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--yaml", default=str(ROOT / "benchmarks/configs/cosyvoice2-0.5b.yaml"))
    ap.add_argument("--batches", default="1,12")
    ap.add_argument("--frames", type=int, default=250)
    ap.add_argument("--frame-major", action="store_true",
                    help="also the float16 fused decode with HiFTGenerator.frame_major (trunk inputs laid out "
                         "[B, T, C], what cuDNN's NHWC convolutions read)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    hift = build_random(args.yaml, device=dev, components=("hift",)).hift
    cfg = hift.cfg
    spf = hift.samples_per_frame
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, TF32 conv "
          f"{torch.backends.cudnn.allow_tf32}")
    print("| batch | phase / variant | ms | rel. RMS err | max abs err | clipped % | kernels |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for b in [int(v) for v in args.batches.split(",")]:
        g = torch.Generator(device="cpu").manual_seed(b)
        t = args.frames
        lengths = [t - (i * t // 2) // max(b, 1) for i in range(b)]
        mel = (torch.randn(b, cfg.in_channels, t, generator=g) * 2 - 5).to(dev)
        for i, n in enumerate(lengths):
            mel[i, :, n:] = 0
        len_t = torch.tensor(lengths, device=dev)
        f0_loop = lambda: [hift.predict_f0(mel[i:i + 1, :, :n]) for i, n in enumerate(lengths)]  # noqa: E731
        print(f"| {b} | F0, per item (eager) | {gpu_ms(f0_loop, n=20):.2f} | | | | |")
        f0 = torch.cat([torch.nn.functional.pad(hift.predict_f0(mel[i:i + 1, :, :n]), (0, t - n))
                        for i, n in enumerate(lengths)])
        gens = [torch.Generator(device=dev).manual_seed(i) for i in range(b)]
        exc = lambda: hift.excitation_padded(f0, lengths, gens)  # noqa: E731
        print(f"| {b} | excitation (eager) | {gpu_ms(exc, n=20):.2f} | | | | |")
        source = exc()
        ref = None
        valid = torch.arange(t * spf, device=dev)[None, :] < (len_t * spf)[:, None]
        variants = [(tdt, fuse, False) for tdt in (torch.float32, torch.float16, torch.bfloat16)
                    for fuse in (False, True)]
        if args.frame_major:
            variants.append((torch.float16, True, True))
        for tdt, fuse, frame_major in variants:
            hift.set_trunk_dtype(tdt)
            fused.set_enabled(fuse)
            hift.frame_major = frame_major
            replay, out = graphed(lambda: hift.decode(mel, source, len_t))
            replay()
            torch.cuda.synchronize()
            if ref is None:
                ref = out.clone()
            d = (out - ref)[valid].float()
            r = ref[valid].float()
            rel = (d.pow(2).mean() / r.pow(2).mean().clamp_min(1e-30)).sqrt().item()
            clip = (r.abs() >= cfg.audio_limit * 0.999).float().mean().item() * 100
            name = (f"decode graph, trunk {str(tdt).split('.')[-1]}, Snake {'fused' if fuse else 'eager'}"
                    + (", frame-major" if frame_major else ""))
            times = kernel_times(replay)
            print(f"| {b} | {name} | {gpu_ms(replay, n=20):.2f} | {rel:.2e} | {d.abs().max().item():.2e} | "
                  f"{clip:.1f} | {kernel_classes(times)} |", flush=True)
        print(f"top kernels of the last variant, batch {b}:")
        print(top_kernels(times))
        hift.set_trunk_dtype(torch.float32)
        fused.set_enabled(True)
        hift.frame_major = False


if __name__ == "__main__":
    main()

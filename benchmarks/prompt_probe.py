"""Per-request prompt extraction cost at full size: features, speech tokenizer, CAM++.

Writes full-size RANDOM-weight ``speech_tokenizer_v2.onnx`` (the real S3 tokenizer v2 structure,
~124 M parameters) and ``campplus.onnx`` (CAM++-like D-TDNN, ~7 M parameters) with
:mod:`cosyserve.models.random_frontend` (or reuses ``--onnx-dir``), then for each device (CPU,
and CUDA when available) and batch size B times, for B prompts of different lengths (the
shipped prompt tiled to ``--seconds``, cycled):

* ``features``: the per-request part (resampling, prompt mel, whisper log-mel, fbank;
  ``PromptExtractor.prepare``), item by item, on the CPU (where the server computes them, in
  the request's worker thread) and, on CUDA rows, also with the audio on the device;
* ``tokenizer``: ONE batched forward of the PyTorch S3 tokenizer over the B prompts (what
  the server's prompt batcher does), and, for comparison, onnxruntime item by item (the old
  path; on the CPU, batches up to ``--ort-max-batch``);
* ``campplus``: CAM++ item by item through onnxruntime (CUDA execution provider on the CUDA
  row when onnxruntime-gpu is installed, else CPU);
* ``finish``: what the server's prompt batcher runs per batch (``PromptExtractor.finish``: the
  tokenizer forward in one thread while CAM++ runs on the speaker threads), i.e. the time a
  request waits for its batch after its features are ready.

Prints a Markdown table: milliseconds per batch and per request (median of ``--reps``).

    python3 benchmarks/prompt_probe.py                       # CPU and CUDA, B = 1, 8, 32
    python3 benchmarks/prompt_probe.py --devices cuda --batches 1,8,32 --reps 5
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cosyserve.frontend.audio import load_audio  # noqa: E402
from cosyserve.frontend.prompt import PromptExtractor  # noqa: E402
from cosyserve.frontend.speech_models import SPEECH_TOKENIZER_FILE, SpeechTokenizer  # noqa: E402
from cosyserve.models.demo import shipped_prompt  # noqa: E402
from cosyserve.models.random_frontend import write_full_size_frontend  # noqa: E402


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, reps: int) -> tuple[float, object]:
    """Median wall time of ``fn()`` in ms over ``reps`` runs (after one untimed run), and its result."""
    out = fn()
    _sync(device)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        _sync(device)
        ts.append((time.perf_counter() - t) * 1000.0)
    return statistics.median(ts), out


def prompts(seconds: list[float], n: int) -> list[tuple[torch.Tensor, int]]:
    wav, sr = load_audio(shipped_prompt()[0])
    wav = wav[:1].float()
    out = []
    for i in range(n):
        want = int(seconds[i % len(seconds)] * sr)
        reps = -(-want // wav.shape[1])
        out.append((wav.repeat(1, reps)[:, :want].contiguous(), sr))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--yaml", default=str(ROOT / "benchmarks/configs/cosyvoice2-0.5b.yaml"),
                    help="cosyvoice2.yaml (prompt mel settings)")
    ap.add_argument("--onnx-dir", help="reuse the two ONNX files of this folder instead of writing new ones")
    ap.add_argument("--devices", default="cpu,cuda", help="comma-separated (cuda rows are skipped without CUDA)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--seconds", default="4,6,9,12", help="prompt durations, cycled over a batch")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cpu-max-batch", type=int, default=8, help="largest batch timed on the CPU (it is slow)")
    ap.add_argument("--ort-max-batch", type=int, default=1, help="largest batch of the onnxruntime tokenizer row")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    seconds = [float(s) for s in args.seconds.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="prompt_probe_"))
    try:
        shutil.copyfile(args.yaml, tmp / "cosyvoice2.yaml")
        if args.onnx_dir:
            for f in (SPEECH_TOKENIZER_FILE, "campplus.onnx"):
                shutil.copyfile(Path(args.onnx_dir) / f, tmp / f)
        else:
            t = time.perf_counter()
            write_full_size_frontend(tmp)
            print(f"wrote full-size random ONNX files in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        rows = []
        ort_tok = SpeechTokenizer(tmp / SPEECH_TOKENIZER_FILE)  # the old path: onnxruntime, CPU, 1 thread
        for device in args.devices.split(","):
            if device.startswith("cuda") and not torch.cuda.is_available():
                print(f"skipping {device}: no CUDA", file=sys.stderr)
                continue
            ex = PromptExtractor(tmp, device=device, tokenizer_backend="torch")
            cam = ex.speaker_encoder.session.get_providers()[0]
            name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
            for b in batches:
                if device == "cpu" and b > args.cpu_max_batch:
                    continue
                items = prompts(seconds, b)
                audio_s = sum(w.shape[1] / sr for w, sr in items)
                feat_ms, prepared = timed(lambda: [ex.prepare(w, sr) for w, sr in items], "cpu", args.reps)
                dev_feat_ms = None
                if device != "cpu":
                    try:
                        on_dev = [(w.to(device), sr) for w, sr in items]
                        dev_feat_ms, _ = timed(lambda: [ex.prepare(w, sr) for w, sr in on_dev], device, args.reps)
                    except Exception as exc:  # noqa: BLE001 - reported, the CPU figure stands
                        print(f"features on {device} failed: {exc}", file=sys.stderr)
                mels = [p.log_mel for p in prepared]
                tok_ms, _ = timed(lambda: ex.speech_tokenizer.tokenize(mels), device, args.reps)
                fbanks = [p.fbank for p in prepared]
                cam_ms, _ = timed(lambda: [ex.speaker_encoder(f) for f in fbanks], device, args.reps)
                fin_ms, _ = timed(lambda: ex.finish(prepared), device, args.reps)
                ort_ms = None
                if b <= args.ort_max_batch:
                    cpu_mels = [m.cpu() for m in mels]
                    ort_ms, _ = timed(lambda: [ort_tok(m) for m in cpu_mels], "cpu", max(1, args.reps // 2))
                rows.append((name, b, audio_s / b, feat_ms, dev_feat_ms, tok_ms, cam_ms, fin_ms, ort_ms, cam))
                print(f"{device} B={b}: features {feat_ms:.1f} ms, tokenizer {tok_ms:.1f} ms, CAM++ {cam_ms:.1f} ms"
                      + (f", onnxruntime tokenizer {ort_ms:.1f} ms" if ort_ms is not None else ""), file=sys.stderr)
        print("\nPrompt extraction, full-size random-weight models (ms; /req = per request; tokenizer = ONE "
              "batched PyTorch forward; CAM++ and features item by item)\n")
        print("| device | B | mean prompt s | features /req (CPU) | features /req (device) | tokenizer batch "
              "| tokenizer /req | CAM++ /req | finish batch | total /req | ORT tokenizer /req (old path, CPU) "
              "| CAM++ provider |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for name, b, sec, feat, dev_feat, tok, cam, fin, ort_ms, prov in rows:
            total = (feat + tok + cam) / b
            ort_s = f"{ort_ms / b:.1f}" if ort_ms is not None else "-"
            dev_s = f"{dev_feat / b:.1f}" if dev_feat is not None else "-"
            print(f"| {name} | {b} | {sec:.1f} | {feat / b:.1f} | {dev_s} | {tok:.1f} | {tok / b:.1f} | "
                  f"{cam / b:.1f} | {fin:.1f} | {total:.1f} | {ort_s} | {prov} |")
        print("\ntotal /req = (CPU features + tokenizer batch + CAM++ item by item) / B: compute per request. A "
              "request's prompt latency in the server is its own features (worker threads, in parallel) + the "
              "'finish batch' time (tokenizer forward overlapped with CAM++ on the speaker threads).")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``cosyserve``: one command with subcommands.

Every user error (bad model directory, bad audio, unknown voice, empty text, ...) ends
with one ``cosyserve: error: ...`` line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from .errors import CosyServeError

DEFAULT_VOICES_DIR = os.environ.get(
    "COSYSERVE_VOICES_DIR",
    os.path.join(os.environ.get("XDG_DATA_HOME", os.path.expanduser("~/.local/share")), "cosyserve", "voices"),
)


class CLIError(CosyServeError):
    """A command-line usage problem detected after argument parsing."""


# ---------------------------------------------------------------------------- helpers


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise CLIError("--device cuda was requested but CUDA is not available")
    return name


def _dtype(name: str, device: str):
    import torch

    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
            "float16": torch.float16, "fp16": torch.float16}[name]


def _add_dtype_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="LM/flow precision (auto: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--hift-dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="precision of the HiFT vocoder's convolutions (auto: float16 when --dtype is a half "
                        "type on CUDA, else float32; F0, excitation and STFTs always run in float32)")


def _add_token2wav_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token2wav-dir", default=None,
                   help="Step-Audio2 token2wav directory (e.g. Step-Audio-2-mini/token2wav: flow.yaml, flow.pt, "
                        "hift.pt, ...): its DiT flow + HiFT replace the model's; LM, frontend and voices stay")


def _add_model_args(p: argparse.ArgumentParser, need_model: bool = True) -> None:
    p.add_argument("--model-dir", required=need_model, help="official CosyVoice2 model directory")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    _add_dtype_args(p)


def _add_synthesis_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=None, help="random seed (reproducible output)")
    p.add_argument("--chunk-policy", default=None,
                   help="streaming chunk schedule: upstream[:25:100] (default), fixed[:N], exponential[:15:25[:max]]; "
                        "with --token2wav-dir the default is exponential:15:25:25 (15 tokens, then 25-token hops)")
    p.add_argument("--min-token-text-ratio", type=float, default=2.0,
                   help="speech tokens the LM must generate per text token (upstream 2)")
    p.add_argument("--max-token-text-ratio", type=float, default=20.0,
                   help="speech tokens the LM may generate per text token (upstream 20)")
    p.add_argument("--speed", type=float, default=1.0, help="tempo factor (offline mode)")
    p.add_argument("--normalizer", default="auto", choices=["auto", "wetext", "rules", "none"],
                   help="text normalisation (auto: WeTextProcessing if installed)")


def _params(args, stream: bool):
    from .engine.chunking import ChunkPolicy
    from .engine.request import SynthesisParams

    try:
        policy = ChunkPolicy.parse(args.chunk_policy)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    return SynthesisParams(seed=args.seed, stream=stream, chunk_policy=policy,
                           min_token_text_ratio=args.min_token_text_ratio,
                           max_token_text_ratio=args.max_token_text_ratio, speed=args.speed)


class _Progress:
    """A one-line progress display on stderr (only on a terminal)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and sys.stderr.isatty()
        self.audio_s = 0.0

    def update(self, chunk) -> None:
        self.audio_s += chunk.duration_s
        if self.enabled:
            sys.stderr.write(f"\r  synthesizing: segment {chunk.segment + 1}, chunk {chunk.index + 1}, "
                             f"{self.audio_s:6.2f} s of audio")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def _open_wav(path: Path, sample_rate: int):
    import soundfile as sf

    fmt = {".wav": "WAV", ".flac": "FLAC", ".ogg": "OGG"}.get(path.suffix.lower())
    if fmt is None:
        raise CLIError(f"unsupported output format {path.suffix!r} (use .wav, .flac or .ogg)")
    subtype = {"WAV": "PCM_16", "FLAC": "PCM_16", "OGG": "VORBIS"}[fmt]
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        return sf.SoundFile(str(path), "w", samplerate=sample_rate, channels=1, format=fmt, subtype=subtype)
    except (OSError, RuntimeError) as exc:
        raise CLIError(f"cannot write {path}: {exc}") from None


def _read_text(args) -> str:
    """The text of ``--text`` or ``--text-file`` (exactly one of them)."""
    text = args.text
    if args.text_file:
        if text:
            raise CLIError("give --text or --text-file, not both")
        try:
            text = Path(args.text_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CLIError(f"cannot read --text-file: {exc}") from None
    if text is None:
        raise CLIError("--text or --text-file is required")
    return text


def _voice_from_args(syn_or_frontend, args, store):
    if args.voice and (args.prompt_wav or args.prompt_text):
        raise CLIError("give either --voice or --prompt-wav with --prompt-text, not both")
    if args.voice:
        if store is None:
            raise CLIError("--voice needs a voice store (--voices-dir)")
        return store.get(args.voice)
    if not args.prompt_wav or args.prompt_text is None:
        raise CLIError("a voice is required: --voice ID, or --prompt-wav FILE with --prompt-text TRANSCRIPT")
    return syn_or_frontend.make_voice("prompt", args.prompt_wav, args.prompt_text)


def run_synthesis(syn, voice, text: str, params, out: Path, quiet: bool = False) -> dict:
    """Synthesize ``text`` into ``out`` (chunks are written as they arrive); return stats.

    Latency and RTF are measured from the call (text normalisation included) to the chunks.
    """
    progress = _Progress(not quiet)
    f = _open_wav(out, syn.sample_rate)
    first = None
    t0 = time.perf_counter()

    def on_chunk(chunk):
        nonlocal first
        if first is None:
            first = time.perf_counter() - t0
        f.write(chunk.samples)
        f.flush()
        progress.update(chunk)

    try:
        res = syn.synthesize(text, voice, params, on_chunk=on_chunk)
    finally:
        progress.close()
        f.close()
    total = time.perf_counter() - t0
    n_tokens = res.finished.n_tokens if res.finished else 0
    return {"path": str(out), "duration_s": res.duration_s, "first_chunk_s": first, "total_s": total,
            "rtf": total / res.duration_s if res.duration_s else float("inf"), "tokens": n_tokens,
            "seed": res.finished.seed if res.finished else None, "chunks": len(res.chunks)}


def _print_stats(st: dict, stream: bool) -> None:
    line = f"wrote {st['path']}: {st['duration_s']:.2f} s of audio, {st['tokens']} speech tokens, seed {st['seed']}"
    print(line)
    if stream:
        print(f"  first-chunk latency {st['first_chunk_s'] * 1000:.0f} ms, {st['chunks']} chunks, "
              f"RTF {st['rtf']:.3f}")
    else:
        print(f"  total {st['total_s']:.2f} s, RTF {st['rtf']:.3f}")


# ---------------------------------------------------------------------------- commands


def cmd_synthesize(args) -> int:
    from .engine.pipeline import Synthesizer
    from .frontend.voice import VoiceStore

    device = _device(args.device)
    text = _read_text(args)
    store = VoiceStore(args.voices_dir) if (args.voice or args.voices_dir_given) else None
    params = _params(args, stream=args.stream)
    syn = Synthesizer(args.model_dir, device=device, dtype=_dtype(args.dtype, device), normalizer=args.normalizer,
                      hift_dtype=args.hift_dtype, token2wav_dir=args.token2wav_dir)
    if syn.is_demo:
        print("note: demo model with RANDOM weights: the audio is noise, not speech", file=sys.stderr)
    voice = _voice_from_args(syn, args, store)
    syn.frontend.text.warmup()
    st = run_synthesis(syn, voice, text, params, Path(args.output), args.quiet)
    _print_stats(st, args.stream)
    return 0


def cmd_voices(args) -> int:
    from .frontend.voice import VoiceStore

    store = VoiceStore(args.voices_dir)
    if args.voices_cmd == "list":
        items = store.list()
        if args.json:
            import json

            print(json.dumps(items, ensure_ascii=False, indent=2))
        elif not items:
            print(f"no voices in {store.root}")
        else:
            for v in items:
                print(f"{v['id']:24s} {v.get('duration_s', 0):6.2f} s  {v.get('prompt_text', '')}")
        return 0
    if args.voices_cmd == "add":
        from .frontend.frontend import Frontend

        if args.id in store and not args.overwrite:
            raise CLIError(f"voice {args.id!r} already exists (use --overwrite)")
        fe = Frontend(args.model_dir, normalizer=args.normalizer)
        voice = fe.make_voice(args.id, args.prompt_wav, args.prompt_text, {"audio": os.path.basename(args.prompt_wav)})
        store.add(voice, overwrite=args.overwrite)
        print(f"added voice {args.id!r} ({voice.duration_s:.2f} s prompt) to {store.root}")
        return 0
    if args.voices_cmd == "remove":
        for vid in args.ids:
            store.remove(vid)
            print(f"removed voice {vid!r}")
        return 0
    if args.voices_cmd == "export":
        ids = store.export_spk2info(args.output, args.ids or None)
        print(f"exported {len(ids)} voice(s) to {args.output}")
        return 0
    if args.voices_cmd == "import":
        ids = store.import_spk2info(args.input, overwrite=args.overwrite)
        print(f"imported {len(ids)} voice(s): {', '.join(ids)}")
        return 0
    raise CLIError("voices: choose add, list, remove, export or import")


def cmd_demo_model(args) -> int:
    from .models.demo import write_demo_model

    if args.dit_token2wav:
        from .models.dit_token2wav import FULL_SIZE, TINY_SIZE, write_token2wav_dir

        size = FULL_SIZE if args.dit_size == "full" else TINY_SIZE
        t = write_token2wav_dir(args.dir, size, seed=args.seed, weights=not args.no_weight_files, force=args.force)
        print(f"wrote a {args.dit_size} Step-Audio2 DiT token2wav directory (RANDOM weights, the audio is noise) to {t}"
              + (" (no weight files: networks are built when loaded)" if args.no_weight_files else ""))
        return 0
    family = "cosyvoice3" if getattr(args, "cosyvoice3", False) else "cosyvoice2"
    out = write_demo_model(args.dir, seed=args.seed, force=args.force, family=family)
    print(f"wrote {family} demo model (RANDOM weights, the audio is noise) to {out}")
    return 0


DEMO_TEXTS = (
    ("zh", "收到好友从远方寄来的生日礼物，那份意外的惊喜让我心中充满了快乐。"),
    ("en", "Hello! This is cosyserve, streaming speech from a CosyVoice2 model."),
)


def cmd_demo(args) -> int:
    from .engine.pipeline import Synthesizer
    from .engine.request import SynthesisParams
    from .engine.chunking import ChunkPolicy
    from .models.demo import shipped_prompt, write_demo_model

    out = Path(args.out)
    model_dir = write_demo_model(out / "model")
    prompt_wav, transcript = shipped_prompt()
    print("cosyserve demo — the DEMO model has the real CosyVoice2 architecture at a small size with RANDOM")
    print("weights, so the audio is noise: this shows the pipeline, streaming and latency, not voice quality.")
    syn = Synthesizer(model_dir, device=_device(args.device))
    syn.frontend.warmup()
    voice = syn.make_voice("demo", prompt_wav, transcript)
    print(f"prompt: {prompt_wav} ({voice.duration_s:.2f} s) \"{transcript}\"")
    # Random weights almost never sample end-of-speech: pin the length to ~25 tokens/s of speech.
    params = SynthesisParams(seed=args.seed, stream=True, chunk_policy=ChunkPolicy(),
                             min_token_text_ratio=5.0, max_token_text_ratio=5.0)
    for lang, text in DEMO_TEXTS:
        st = run_synthesis(syn, voice, text, params, out / f"demo_{lang}.wav", quiet=True)
        print(f"[{lang}] {text}")
        _print_stats(st, stream=True)
    print("(token/text ratio pinned to 5 because random weights never choose to stop)")
    return 0


def _cache_dir() -> Path:
    return Path(os.environ.get("COSYSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "cosyserve"))


def _add_random_weights_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--random-weights", metavar="YAML",
                   help="full-size RANDOM-weight networks built from this cosyvoice2.yaml (benchmarks; the audio is "
                        "noise); the tokenizer, Qwen2 config and ONNX stand-ins are written to the cache")
    p.add_argument("--qwen-config", metavar="JSON",
                   help="Qwen2 config.json for --random-weights (default: YAML's dir/CosyVoice-BlankEN/config.json)")
    p.add_argument("--full-size-frontend", action="store_true",
                   help="with --random-weights: full-size random speech tokenizer (S3 tokenizer v2 structure, run "
                        "in PyTorch) and CAM++-like speaker model instead of the cost-free ONNX stand-ins, so "
                        "per-request prompts cost what the real files cost")


def _resolve_random_weights(args) -> bool:
    """Turn ``--random-weights YAML`` into ``args.model_dir``; True if it was given."""
    if not getattr(args, "random_weights", None):
        if getattr(args, "qwen_config", None):
            raise CLIError("--qwen-config only applies with --random-weights")
        if getattr(args, "full_size_frontend", False):
            raise CLIError("--full-size-frontend only applies with --random-weights")
        return False
    if args.model_dir or getattr(args, "demo", False):
        raise CLIError("give one of --model-dir, --demo or --random-weights")
    from .models.demo import prepare_random_weights_dir

    args.model_dir = str(prepare_random_weights_dir(args.random_weights, args.qwen_config, _cache_dir(),
                                                    full_size_frontend=getattr(args, "full_size_frontend", False)))
    print(f"note: --random-weights builds {args.random_weights} with RANDOM weights: the audio is noise, not speech",
          file=sys.stderr)
    return True


def _builtin_default_voice(model_dir: str, voices_dir: str) -> None:
    """Register the shipped prompt as voice ``default`` (demo / random-weight models; for CosyVoice3
    its transcript gets upstream's default instruction, which CosyVoice3 prompt texts need)."""
    from .frontend.frontend import Frontend
    from .frontend.tokenizer import DEFAULT_INSTRUCTION
    from .frontend.voice import VoiceStore
    from .models.demo import shipped_prompt

    store = VoiceStore(voices_dir)
    if "default" not in store:
        fe = Frontend(model_dir)
        wav, transcript = shipped_prompt()
        if fe.requires_endofprompt:
            transcript = DEFAULT_INSTRUCTION + transcript
        store.add(fe.make_voice("default", wav, transcript))


_SAMPLING = {"auto": None, "host": False, "device": True}  # --sampling -> EngineConfig.device_sampling


def _queue_steps(n: int) -> int | None:
    """``--t2w-queue-steps``: N >= 1 steps ahead, 0 = whole batches (None); CLIError otherwise."""
    if n < 0:
        raise CLIError(f"--t2w-queue-steps must be >= 0, got {n}")
    return n or None


def _queue_ms(value: str) -> float | str | None:
    """``--t2w-queue-ms``: 'auto', milliseconds > 0 -> seconds, 0 = no time bound (None); CLIError otherwise."""
    if value == "auto":
        return value
    try:
        ms = float(value)
    except ValueError:
        ms = float("nan")
    if not ms >= 0 or ms == float("inf"):
        raise CLIError(f"--t2w-queue-ms must be 'auto' or milliseconds >= 0, got {value!r}")
    return ms / 1000.0 or None


def _slack(value: str) -> float | None:
    """``--t2w-slack``: 'auto' (adaptive) or seconds >= 0; CLIError otherwise."""
    if value == "auto":
        return None
    try:
        s = float(value)
    except ValueError:
        raise CLIError(f"--t2w-slack must be 'auto' or seconds, got {value!r}") from None
    if not s >= 0:
        raise CLIError(f"--t2w-slack must be >= 0, got {value}")
    return s


def _positive_int(value: str) -> int:
    """argparse type: an integer >= 1 (argparse reports anything else as a usage error)."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def _fraction(value: str) -> float:
    """argparse type: a number in [0, 1) (argparse reports anything else as a usage error)."""
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {value!r}") from None
    if not 0 <= x < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {value}")
    return x


def _nonnegative_float(value: str) -> float:
    """argparse type: a number >= 0 (argparse reports anything else as a usage error)."""
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value!r}") from None
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return x


def _engine_args(p, in_process: bool = False) -> None:
    """Engine scheduling options shared by ``serve`` and ``bench --in-process`` (read back by
    :func:`_engine_config`)."""
    note = " (--in-process)" if in_process else ""
    p.add_argument("--max-active-streams", type=_positive_int, default=16,
                   help="requests processed at once (KV-cache slots)" + note)
    p.add_argument("--kv-max-len", type=_positive_int, default=4096, metavar="N",
                   help="positions per KV-cache slot: prompt text + prompt speech tokens + text + speech tokens of "
                        "one segment (default 4096); the cache holds --max-active-streams + 1 slots of N positions "
                        "(Qwen2-0.5B in bf16: 12 KiB per position, 6.4 GB at 128 streams x 4096), so a smaller N "
                        "leaves device memory to more streams' token2wav caches" + note)
    p.add_argument("--hift-f0", choices=["per-item", "batched"], default="batched",
                   help="CosyVoice2 HiFT (also the DiT token2wav's vocoder): predict F0 in one masked float64 pass per "
                        "token2wav batch (default: ~120 fewer host operators per stream; a stream's F0 does not "
                        "depend on its batch-mates) or item by item in float32 as upstream does (its speech is ~1e-4 "
                        "from the batched mode's)" + note)
    p.add_argument("--dit-graph-memory", type=_fraction, default=0.25, metavar="FRACTION",
                   help="Step-Audio2 DiT token2wav: the share of the device's memory its solve graphs' shared buffers "
                        "may take (default 0.25); they hold a batch's copy of its streams' caches, so a smaller share "
                        "bounds a chunk batch's rows lower and leaves more memory to the streams' own caches" + note)
    p.add_argument("--token2wav-thread", action="store_true",
                   help="run token2wav on its own thread (experimental; slower on the H100 measured, docs/perf-history.md)"
                        + note)
    p.add_argument("--t2w-queue-steps", type=int, default=4, metavar="N",
                   help="token2wav batches on the GPU are issued at most N flow steps ahead of the device, "
                        "between LM steps (default 4; 0 = whole batches at once)" + note)
    p.add_argument("--t2w-queue-ms", default="auto", metavar="MS",
                   help="beyond the first, a flow step is queued only while the queued steps' device time, "
                        "measured per batch shape, stays within MS: large batches' long steps go one at a time and "
                        "cannot hold the scheduler in the driver while a full launch queue drains; 0 = steps only; "
                        "'auto' (default) = 25 with --flow-stream-cache off (every chunk recomputes its history), "
                        "else 0 (docs/perf.md \"Session 44\")" + note)
    p.add_argument("--sampling", choices=sorted(_SAMPLING), default="auto",
                   help="where speech tokens are sampled: 'device' = inside the GPU decode step (reproducible per "
                        "seed and batch-independent, not upstream's random stream), 'host' = on the CPU with "
                        "upstream's generator semantics; 'auto' (default) = device on CUDA, host on CPU" + note)
    p.add_argument("--decode-lookahead", type=_positive_int, default=1, metavar="N",
                   help="pipelined decoding: LM steps issued beyond the one whose tokens are read next (default 1; "
                        "more keeps the GPU decoding while the scheduler issues token2wav work; experimental: "
                        "no gain measured on an H100)" + note)
    p.add_argument("--t2w-slack", default="1.0", metavar="SECONDS",
                   help="a token2wav job is launched this long before its client runs out of audio, and longer "
                        "jobs join a batch only then (default 1.0); 'auto' = 3x the recent batch duration, "
                        "0.15-1 s (experimental: stalls measured at 32 streams)")
    p.add_argument("--lm-stream-priority", choices=["high", "normal"], default="high",
                   help="CUDA stream priority of the LM against token2wav batches (default high)")
    p.add_argument("--max-t2w-tokens", type=_positive_int, default=16384, metavar="N",
                   help="flow input tokens per token2wav batch, padded: jobs x the longest job's prompt + speech "
                        "tokens (default 16384); bounds a batch's time and memory and the CUDA graphs captured")
    p.add_argument("--t2w-batch-target", type=_positive_int, default=16, metavar="N",
                   help="while the LM is busy, token2wav jobs not yet due (offline utterances, later chunks) "
                        "gather until N are ready and run as one batch (default 16: cheaper per job)")
    p.add_argument("--t2w-gather", type=_nonnegative_float, default=1.0, metavar="SECONDS",
                   help="the longest an offline utterance waits for others to join its token2wav batch "
                        "(default 1.0)")
    p.add_argument("--t2w-length-window", type=_fraction, default=0.75, metavar="FRACTION",
                   help="token2wav jobs not yet due join a batch only if they need more than FRACTION of its "
                        "flow length, or fill rows its CUDA-graph bucket would pad (default 0.75; 0: any shorter "
                        "job joins)")
    p.add_argument("--admission", default=None, metavar="auto|off|N",
                   help="admission control: start a queued stream only while the admitted ones stay real time; "
                        "'auto' = the capacity the engine measures (LM step and token2wav costs), N = at most N "
                        "streams, 'off' = only --max-active-streams; default auto on CUDA, off on CPU" + note)
    p.add_argument("--admission-target", type=float, default=0.8, metavar="FRACTION",
                   help="auto admission: the share of the scheduler thread / GPU the admitted streams may need "
                        "(default 0.8; headroom for jitter and prefills)" + note)
    p.add_argument("--admission-start-share", type=float, default=0.45, metavar="FRACTION",
                   help="auto admission: streams still before their second chunk are at most this share of the "
                        "admitted ones (default 0.45; a burst of arrivals then starts in waves, not all in phase; "
                        "1 = no such bound)" + note)
    p.add_argument("--admission-lm-alone", action=argparse.BooleanOptionalAction, default=True,
                   help="auto admission: price the LM's share of the GPU at the decode steps that ran without a "
                        "token2wav batch beside them (their time under contention includes waiting for the "
                        "flow's kernels, which token2wav's price already counts), its pace still bounded by every "
                        "step's time (default on; --no-admission-lm-alone: at every step's time; docs/perf.md "
                        "\"Sessions 37-38\" have its measurements)" + note)
    p.add_argument("--admission-start-cost", action=argparse.BooleanOptionalAction, default=True,
                   help="auto admission (CosyVoice2/3 flows): price a starting stream's token2wav at the cost its "
                        "first chunks were measured to need per audio second (with --flow-stream-cache prefix they "
                        "solve only the frames after the voice's prompt) rather than at the streams' average "
                        "(default on; --no-admission-start-cost: at the average)" + note)
    p.add_argument("--admission-slack-margin", type=float, default=0.05, metavar="SECONDS",
                   help="auto admission: a streaming chunk sent with less than SECONDS before its playback "
                        "deadline is a close call and caps admission at the streams active then minus one (a late "
                        "chunk at 0.9 x them; default 0.05; 0 = only late chunks cut)" + note)
    p.add_argument("--admission-slack-recover", type=float, default=0.5, metavar="SECONDS",
                   help="auto admission: after a close call the cap grows back by one stream per SECONDS without "
                        "another (default 0.5; > 0)" + note)
    p.add_argument("--admission-pace-half-life", type=float, default=1.0, metavar="SECONDS",
                   help="auto admission: average the token2wav batch-latency pace the capacity estimate is read at "
                        "over time with this half-life (default 1.0; 0 = the pace of the moment, which swings with "
                        "the last few batches)" + note)
    p.add_argument("--admission-contention-fit", action=argparse.BooleanOptionalAction, default=False,
                   help="auto admission: price the LM steps as they ran by their time against rows and whether "
                        "token2wav ran beside them, so that a burst's first-chunk flow work is not read as a cost "
                        "per row (default off: not measured yet; docs/perf.md \"Session 40\")" + note)
    p.add_argument("--admission-trace", default=None, metavar="FILE",
                   help="record the capacity model's measurements and estimates into FILE (JSON lines; gzip when "
                        "it ends in .gz) to replay them into other admission settings offline "
                        "(benchmarks/admission_replay.py)" + note)
    p.add_argument("--flow-stream-cache", choices=("auto", "on", "off", "prefix"), default="auto",
                   help="streaming chunks compute only the flow frames after the stream's complete static chunks, "
                        "reusing their cached per-step keys/values (CosyVoice2 U-Net: 2.2 MiB, CosyVoice3 DiT: "
                        "1.8 MB per cached frame at full size in bf16; CosyVoice2: a stream's first chunk starts "
                        "from its voice's prompt prefix, computed once per voice); cached chunks run without CUDA "
                        "graphs; "
                        "auto (default) = 'prefix' for CosyVoice2 with CUDA graphs, 'on' where the flow runs "
                        "eagerly (CPU), else 'off'; 'off' = upstream's full "
                        "recomputation; 'prefix' = CosyVoice2: no per-stream caches, every non-final streaming "
                        "chunk starts from its voice's prompt prefix, kept for --flow-prefix-slots voices in a "
                        "device pool allocated at start (--flow-stream-cache-frames frames each, default 300); "
                        "on CUDA the prefixed solves get CUDA graphs of their own (docs/perf.md \"Session 36\")"
                        + note)
    p.add_argument("--flow-prefix-slots", type=_positive_int, default=4, metavar="N",
                   help="with --flow-stream-cache prefix: voices whose prompt prefix is kept (default 4; "
                        "least recently used out)" + note)
    p.add_argument("--strict-min-len", action="store_true",
                   help="mask every stop token (not only upstream's one id) until a segment has its minimum "
                        "length: for benchmarks with random weights, where CosyVoice3's upstream min-length mask "
                        "(it masks sos) lets any of its 200 stop ids end an utterance after a few tokens, so "
                        "--min-token-text-ratio pins nothing; real weights do not need it" + note)
    p.add_argument("--lazy-graphs", action="store_true",
                   help="capture CUDA graphs (LM prefill, flow, HiFT) on first use, on the serving thread "
                        "(starts faster; each capture while serving stalls every stream for 0.1-0.4 s)")
    p.add_argument("--background-graphs", action="store_true",
                   help="report ready once the weights are loaded and capture the CUDA graphs in a background "
                        "thread while serving (each batch eager until its bucket is captured; the buckets serving "
                        "uses first); the default of serve: on an H100 at full size ready in ~20 s on a restart "
                        "instead of ~2.5 min, first chunks up to ~3 s in the first seconds (docs/perf.md, "
                        "'Session 24')" + note)
    p.add_argument("--graph-priming", action="store_true",
                   help="with background graphs: compile the fused kernels before reporting ready (~20 s more, "
                        "shorter first chunks right after ready)" + note)
    p.add_argument("--graphs-before-ready", action="store_true",
                   help="capture every CUDA graph before reporting ready (~2.5 min at full size on an H100; "
                        "the default of bench --in-process)" + note)
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="keep the compiled fused kernels (torch.compile / Triton) here across restarts, so a "
                        "restarted server loads them instead of compiling them again (start-up: docs/perf.md); "
                        "default $COSYSERVE_CACHE_DIR/compile (~/.cache/cosyserve/compile) unless "
                        "TORCHINDUCTOR_CACHE_DIR is set; 'off' = torch's default (a per-user folder in /tmp)" + note)
    p.add_argument("--flow-stream-cache-frames", type=_positive_int, default=None, metavar="N",
                   help="at most N mel frames (50/s, prompt included) cached per stream; CosyVoice2: later "
                        "frames are recomputed every chunk, CosyVoice3: a stream past N drops its cache and "
                        "recomputes its chunks (default: no limit besides the segment's length)" + note)


def _compile_cache(value: str | None) -> Path | None:
    """Point torch's compile cache (Inductor's FX graphs and Triton kernels, ``TORCHINDUCTOR_CACHE_DIR``)
    at ``value`` (``--compile-cache``; see its help) and return the folder (None: torch's default).
    Must run before anything compiles; worker processes inherit it. Raises CLIError when the folder
    cannot be created or written."""
    if value is not None and value.strip().lower() == "off":
        return None
    if value is None:
        if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
            return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
        value = str(_cache_dir() / "compile")
    path = Path(value).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CLIError(f"--compile-cache {value}: cannot create it ({exc.strerror or exc})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CLIError(f"--compile-cache {value}: not writable")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path.resolve())
    return path


def _graph_capture(args, background_default: bool) -> str:
    """``EngineConfig.graph_capture`` from ``--background-graphs`` / ``--graphs-before-ready``
    (``background_default``: the command's default; serve's is background). Exits with a message
    when both are given."""
    bg, before = getattr(args, "background_graphs", False), getattr(args, "graphs_before_ready", False)
    if bg and before:
        raise SystemExit("error: --background-graphs and --graphs-before-ready exclude each other")
    return "background" if bg or (background_default and not before) else "startup"


def _engine_config(args, background_default: bool = False, **overrides):
    """The :class:`~cosyserve.engine.core.EngineConfig` of the options :func:`_engine_args` added
    (``overrides``: fields set by the command itself); points the compile cache at
    ``--compile-cache`` (:func:`_compile_cache`). Raises CLIError for invalid values."""
    from .engine.core import EngineConfig

    _compile_cache(getattr(args, "compile_cache", None))
    lazy = args.lazy_graphs
    fields = dict(max_active=args.max_active_streams, kv_max_len=args.kv_max_len,
                  dit_graph_memory=args.dit_graph_memory, hift_f0=args.hift_f0, t2w_thread=args.token2wav_thread,
                  t2w_queue_steps=_queue_steps(args.t2w_queue_steps), t2w_queue_s=_queue_ms(args.t2w_queue_ms),
                  device_sampling=_SAMPLING[args.sampling],
                  t2w_slack_s=_slack(args.t2w_slack), lm_stream_priority=args.lm_stream_priority == "high",
                  max_t2w_tokens=args.max_t2w_tokens, t2w_batch_target=args.t2w_batch_target,
                  t2w_gather_s=args.t2w_gather, t2w_length_window=args.t2w_length_window,
                  graph_warmup=not lazy, t2w_graph_warmup=not lazy,
                  graph_capture=_graph_capture(args, background_default),
                  graph_priming=getattr(args, "graph_priming", False),
                  decode_lookahead=args.decode_lookahead, admission=args.admission,
                  admission_target=args.admission_target, admission_start_share=args.admission_start_share,
                  admission_lm_alone=args.admission_lm_alone, admission_start_cost=args.admission_start_cost,
                  admission_slack_margin_s=args.admission_slack_margin,
                  admission_slack_recover_s=args.admission_slack_recover,
                  admission_contention_fit=args.admission_contention_fit,
                  admission_pace_half_life_s=args.admission_pace_half_life,
                  admission_trace=getattr(args, "admission_trace", None),
                  flow_stream_cache={"auto": None, "on": True, "off": False,
                                     "prefix": "prefix"}[args.flow_stream_cache],
                  flow_prefix_slots=args.flow_prefix_slots,
                  flow_stream_cache_frames=args.flow_stream_cache_frames, strict_min_len=args.strict_min_len,
                  stream_chunk_policy=args.chunk_policy if getattr(args, "chunk_policy_given", False) else None)
    fields.update(overrides)
    if not 0 < fields["admission_target"] <= 1:
        raise CLIError(f"--admission-target must be in (0, 1], got {fields['admission_target']}")
    if not 0 < fields["admission_start_share"] <= 1:
        raise CLIError(f"--admission-start-share must be in (0, 1], got {fields['admission_start_share']}")
    if not 0 <= fields["admission_slack_margin_s"] < float("inf"):
        raise CLIError(f"--admission-slack-margin must be >= 0 seconds, got {fields['admission_slack_margin_s']}")
    if not 0 < fields["admission_slack_recover_s"] < float("inf"):
        raise CLIError(f"--admission-slack-recover must be > 0 seconds, got {fields['admission_slack_recover_s']}")
    if not 0 <= fields["admission_pace_half_life_s"] < float("inf"):
        raise CLIError(f"--admission-pace-half-life must be >= 0 seconds, got {fields['admission_pace_half_life_s']}")
    trace = fields["admission_trace"]
    if trace is not None and not (Path(trace).parent.is_dir() and os.access(Path(trace).parent, os.W_OK)):
        raise CLIError(f"--admission-trace: cannot write {trace} (its folder is missing or not writable)")
    try:
        return EngineConfig(**fields)
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def cmd_serve(args) -> int:
    import asyncio

    from .server.app import serve
    from .server.state import ServerConfig, setup_logging

    setup_logging(args.log_format, logging.DEBUG if args.verbose else logging.INFO)
    _router_gpus(args)  # router options checked before anything is loaded
    llm_api_key = args.llm_api_key or os.environ.get("COSYSERVE_LLM_API_KEY") or None
    if args.llm_url:
        _check_llm_url(args.llm_url, args.llm_model, llm_api_key)
    if args.llm_checkpoint:
        from .client.remote_lm import RemoteLMError, load_checkpoint_info

        if not args.llm_url:
            raise CLIError("--llm-checkpoint goes with --llm-url (the server that serves that checkpoint)")
        try:
            load_checkpoint_info(args.llm_checkpoint)
        except RemoteLMError as exc:
            raise CLIError(str(exc)) from None
    if args.prompt_cache < 0:
        raise CLIError(f"--prompt-cache must be >= 0, not {args.prompt_cache}")
    if not 0 <= args.prompt_batch_window <= 1:
        raise CLIError(f"--prompt-batch-window must be between 0 and 1 s, not {args.prompt_batch_window}")
    device = _device(args.device)
    default_voice = args.default_voice
    voices_dir = args.voices_dir
    synthetic = _resolve_random_weights(args)
    if args.demo:
        from .models.demo import write_demo_model

        if args.model_dir:
            raise CLIError("give --model-dir or --demo, not both")
        args.model_dir = str(write_demo_model(_cache_dir() / "demo-model"))
        print("note: --demo serves a model with RANDOM weights: the audio is noise, not speech", file=sys.stderr)
        synthetic = True
    if synthetic:
        _builtin_default_voice(args.model_dir, voices_dir)
        default_voice = default_voice or "default"
    if not args.model_dir:
        raise CLIError("--model-dir (or --demo, or --random-weights YAML) is required")
    from .models.loader import open_model_dir

    need = ("llm", "onnx", "qwen") if args.token2wav_dir else ("llm", "flow", "hift", "onnx", "qwen")
    if args.llm_url:  # the LM runs elsewhere: its weights need not be here
        need = tuple(n for n in need if n != "llm")
    md = open_model_dir(args.model_dir, need=need)  # fail fast with a clear message
    # the served model's name (KServe model, OpenAI `model`): the model family's unless given
    args.model_name = args.model_name or md.family
    if args.token2wav_dir:
        from .models.dit_token2wav import open_token2wav_dir

        open_token2wav_dir(args.token2wav_dir)
    if args.workers > 1 or args.gpus or args.llm_gpus or args.llm_workers:
        return _serve_router(args)
    cfg = ServerConfig(
        model_dir=args.model_dir, host=args.host, port=args.port, grpc_port=args.grpc_port, voices_dir=voices_dir,
        default_voice=default_voice, engine=_engine_config(args, background_default=True, max_queue=args.max_queue),
        api_key=args.api_key or os.environ.get("COSYSERVE_API_KEY") or None, device=device,
        dtype=str(_dtype(args.dtype, device)).replace("torch.", ""), hift_dtype=args.hift_dtype,
        request_timeout_s=args.request_timeout or None,
        max_text_chars=args.max_text_chars, max_upload_bytes=int(args.max_upload_mb * 1024 * 1024),
        normalizer=args.normalizer, chunk_policy=args.chunk_policy,
        min_token_text_ratio=args.min_token_text_ratio, max_token_text_ratio=args.max_token_text_ratio,
        warmup=not args.no_warmup, admission_calibrate=args.admission_calibrate, llm_only=args.llm_only,
        token2wav_dir=args.token2wav_dir,
        llm_stream_interval_s=args.llm_stream_interval,
        tokenizer_backend=args.speech_tokenizer,
        prompt_cache_size=args.prompt_cache, prompt_batch_window_s=args.prompt_batch_window,
        llm_url=args.llm_url, llm_model=args.llm_model, llm_api_key=llm_api_key, llm_timeout_s=args.llm_timeout,
        llm_checkpoint=args.llm_checkpoint,
        metrics_port=args.metrics_port, model_name=args.model_name,
    )
    try:
        asyncio.run(serve(cfg, args.log_format))
    except OSError as exc:
        raise CLIError(f"cannot start the server: {exc}") from None
    except RuntimeError as exc:
        raise CLIError(str(exc)) from None
    return 0


def _check_llm_url(url: str, model: str | None, api_key: str | None) -> None:
    """`serve --llm-url`: the URL must be http(s)://; without --llm-model the server must answer
    GET /v1/models now (its first model is served). Raises :class:`CLIError` (one line)."""
    import httpx

    from .client.remote_lm import RemoteLMError, completions_base_url

    try:
        base = completions_base_url(url)
    except RemoteLMError as exc:
        raise CLIError(str(exc)) from None
    if model is not None:
        return  # the LLM server may start later (a worker of a disaggregated router): checked at warm-up
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base + "/v1/models", headers=headers, timeout=10)
        r.raise_for_status()
        (r.json().get("data") or [])[0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise CLIError(f"--llm-url {url}: cannot list the LLM server's models (GET {base}/v1/models: "
                       f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no answer'}); start it, "
                       "fix the URL, or pass --llm-model") from None


def cmd_convert_llm(args) -> int:
    import torch

    from .models.export import export_llm

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    sv = export_llm(args.model_dir, args.out_dir, dtype=dtype)
    print(f"wrote Qwen2ForCausalLM checkpoint to {args.out_dir}: speech token i = id {sv.speech_token_offset} + i, "
          f"<|eos1|> {sv.eos_token_id}, <|sos|> {sv.sos_token_id}, <|task_id|> {sv.task_id_token_id}, "
          f"vocab {sv.vocab_size}; the speech-token logit bias is in speech_logit_bias.safetensors")
    return 0


def cmd_bench(args) -> int:
    from .client.bench import BenchOptions, parse_levels, run_bench

    protocol = args.protocol or ("grpc" if (args.url or "").startswith("grpc://") else "openai")
    if args.in_process and args.url:
        raise CLIError("give --url (a running server) or --in-process, not both")
    if args.in_process:
        if args.protocol:
            raise CLIError("--protocol applies to a server (--url), not to --in-process")
        protocol = "in-process"
    if args.token2wav_dir and not args.in_process:
        raise CLIError("--token2wav-dir applies to --in-process (for a server: cosyserve serve --token2wav-dir)")
    if args.random_weights and not args.in_process:
        raise CLIError("--random-weights applies to --in-process (for a server: cosyserve serve --random-weights)")
    _resolve_random_weights(args)
    device = _device(args.device) if args.in_process else "cpu"
    opts = BenchOptions(
        url=args.url, protocol=protocol, mode=args.mode,
        concurrency=None if args.capacity and args.concurrency is None else parse_levels(args.concurrency or "1,2,4,8,16"),
        set=args.set,
        limit=args.limit, requests_per_level=args.requests_per_level, repeat=args.repeat, warmup=args.warmup,
        seed=args.seed, voice=args.voice, api_key=args.api_key or os.environ.get("COSYSERVE_API_KEY") or None,
        model_name=args.model_name, out=args.out, save_audio=args.save_audio, timeout_s=args.timeout,
        progress=False if args.no_progress else None, min_token_text_ratio=args.min_token_text_ratio,
        max_token_text_ratio=args.max_token_text_ratio, in_process=args.in_process, model_dir=args.model_dir,
        demo=args.demo, device=device, dtype=str(_dtype(args.dtype, device)).replace("torch.", ""),
        hift_dtype=args.hift_dtype, voices_dir=args.voices_dir or DEFAULT_VOICES_DIR,
        engine=_engine_config(args) if args.in_process else None, chunk_policy=args.chunk_policy,
        metrics_url=args.metrics_url, min_requests_per_client=args.min_requests_per_client, ramp_s=args.ramp_s,
        playback=args.playback, capacity=args.capacity,
        p99_bound_ms=args.p99_bound_ms, max_streams=args.max_streams, capacity_tolerance=args.capacity_tolerance,
        overload=args.overload, token2wav_dir=args.token2wav_dir)
    report = run_bench(opts)
    failed = sum(lv["failed"] for lv in report["levels"])
    return 1 if failed and not any(lv["ok"] for lv in report["levels"]) else 0


#: options of `serve` that belong to the router, not its workers (value-taking unless listed in _ROUTER_FLAGS)
_ROUTER_OPTIONS = ("--workers", "--gpus", "--host", "--port", "--grpc-port", "--metrics-port", "--llm-gpus",
                   "--t2w-gpus", "--llm-workers")


def _worker_argv(argv: list[str]) -> list[str]:
    """The `serve` command line of a worker: the router's own, less the router options
    (``--opt VALUE`` and ``--opt=VALUE`` forms) and the subcommand name."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "serve" and not out:
            continue
        name = a.split("=", 1)[0]
        if name in _ROUTER_OPTIONS:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def _gpu_list(value: str | None, flag: str) -> list[str]:
    gpus = [g.strip() for g in value.split(",")] if value else []
    if value is not None and (not gpus or any(not g.isdigit() for g in gpus) or len(set(gpus)) != len(gpus)):
        raise CLIError(f"{flag} takes distinct GPU indices separated by commas, e.g. 0,1 (got {value!r})")
    return gpus


def _router_gpus(args) -> list[str]:
    """The GPUs of `serve --gpus` (or of the token2wav workers, `--t2w-gpus`; empty without
    them); raises :class:`CLIError` for inconsistent router / disaggregation options."""
    gpus = _gpu_list(args.gpus, "--gpus")
    llm_gpus, t2w_gpus = _gpu_list(args.llm_gpus, "--llm-gpus"), _gpu_list(args.t2w_gpus, "--t2w-gpus")
    if gpus and args.workers > 1 and args.workers != len(gpus):
        raise CLIError(f"--workers {args.workers} disagrees with --gpus {args.gpus} (one worker per GPU)")
    if bool(llm_gpus) != bool(t2w_gpus):
        raise CLIError("the disaggregated layout needs both --llm-gpus (LLM workers) and --t2w-gpus "
                       "(token2wav workers)")
    if llm_gpus and (gpus or args.llm_workers):
        raise CLIError("--llm-gpus/--t2w-gpus replace --gpus and --llm-workers (one LLM worker per --llm-gpus "
                       "GPU, one token2wav worker per --t2w-gpus GPU)")
    if t2w_gpus and args.workers > 1 and args.workers != len(t2w_gpus):
        raise CLIError(f"--workers {args.workers} disagrees with --t2w-gpus {args.t2w_gpus} (one worker per GPU)")
    disagg = bool(llm_gpus or args.llm_workers)
    if disagg and args.llm_url:
        raise CLIError("--llm-url names an external LLM server; --llm-gpus/--llm-workers start LLM workers: "
                       "give one or the other")
    if args.llm_only and (gpus or args.workers > 1 or disagg):
        raise CLIError("--llm-only serves one process; run one per GPU instead of --workers/--gpus")
    if args.llm_only and args.llm_url:
        raise CLIError("--llm-only serves the LM; --llm-url takes the LM from another server: give one of them")
    return t2w_gpus or gpus


#: printed by `serve --llm-workers N` on a GPU (docs/perf.md "Session 31")
SHARED_GPU_NOTE = (
    "note: --llm-workers runs the LLM and token2wav workers as separate processes on ONE GPU: without NVIDIA MPS "
    "their CUDA contexts take turns on the device instead of running side by side (measured on an H100 with the "
    "DiT token2wav: 11 real-time streams and 28x offline, against 120 and 300x in one process). Use it to test the "
    "layout; to serve, run one process per GPU (--gpus) or put the LLM on GPUs of its own (--llm-gpus/--t2w-gpus).")


def _serve_router(args) -> int:
    """`serve --workers N` / `--gpus LIST`: the router on the public ports over N worker processes;
    with `--llm-gpus/--t2w-gpus` or `--llm-workers` the disaggregated layout (LLM workers +
    token2wav workers streaming from them, round-robin)."""
    import asyncio

    from .server.router import RouterConfig, WorkerSpec, free_port, serve_router

    gpus = _router_gpus(args)
    base = _worker_argv(args.argv)
    if args.demo:  # the router wrote the demo model once; the workers share it
        base = [a for a in base if a != "--demo"] + ["--model-dir", args.model_dir, "--default-voice", "default"]
    llm_gpus = _gpu_list(args.llm_gpus, "--llm-gpus")
    if gpus or llm_gpus:
        base = [a for i, a in enumerate(base) if not (a == "--device" or (i and base[i - 1] == "--device")
                                                      or a.startswith("--device="))] + ["--device", "cuda"]
    if args.llm_workers and not llm_gpus and _device(args.device).startswith("cuda"):
        print(SHARED_GPU_NOTE, file=sys.stderr)
    # the disaggregated layout: --llm-only workers on fixed loopback ports, token2wav workers streaming from them
    llm_places = [({"CUDA_VISIBLE_DEVICES": g}, f"llm, gpu {g}") for g in llm_gpus] or \
        [({}, "llm, shared device")] * (args.llm_workers or 0)
    t2w_places = [({"CUDA_VISIBLE_DEVICES": g}, f"gpu {g}") for g in gpus] or \
        [({}, "shared device")] * args.workers
    # an LLM worker serves the streams of all its token2wav workers at once: as many KV slots
    llm_slots = args.max_active_streams * -(-len(t2w_places) // max(1, len(llm_places)))
    llm_specs = [WorkerSpec(i, base + ["--llm-only", "--max-active-streams", str(llm_slots)], env, label,
                            llm_slots, role="llm", port=free_port()) for i, (env, label) in enumerate(llm_places)]
    specs = []
    for i, (env, label) in enumerate(t2w_places):
        argv, env = list(base), dict(env)
        if llm_specs:
            llm = llm_specs[i % len(llm_specs)]
            argv += ["--llm-url", f"http://127.0.0.1:{llm.port}", "--llm-model", args.model_name]
            label = f"token2wav, {label}, LM worker {llm.index}"
            key = args.api_key or os.environ.get("COSYSERVE_API_KEY")
            if key:  # the LLM workers inherit the API key; their clients send it
                env["COSYSERVE_LLM_API_KEY"] = key
        specs.append(WorkerSpec(len(llm_specs) + i, argv, env, label, args.max_active_streams))
    cfg = RouterConfig(host=args.host, port=args.port, grpc_port=args.grpc_port, workers=llm_specs + specs,
                       max_upload_bytes=int(args.max_upload_mb * 1024 * 1024), metrics_port=args.metrics_port)
    try:
        asyncio.run(serve_router(cfg))
    except (OSError, RuntimeError) as exc:
        raise CLIError(f"cannot start the router: {exc}") from None
    return 0


def cmd_batch(args) -> int:
    from .client.batch import BatchOptions, run_batch

    _resolve_random_weights(args)
    device = _device(args.device)
    opts = BatchOptions(
        set=args.set, out=args.out, limit=args.limit, model_dir=args.model_dir, demo=args.demo, device=device,
        dtype=str(_dtype(args.dtype, device)).replace("torch.", ""), hift_dtype=args.hift_dtype,
        batch_size=args.batch_size,
        token2wav_batch_size=args.token2wav_batch_size, seed=args.seed,
        min_token_text_ratio=args.min_token_text_ratio, max_token_text_ratio=args.max_token_text_ratio,
        llm_url=args.llm_url, llm_model=args.llm_model, llm_checkpoint=args.llm_checkpoint,
        logit_bias=args.logit_bias, llm_api_key=args.llm_api_key or os.environ.get("COSYSERVE_LLM_API_KEY") or None,
        llm_extra=args.llm_extra, normalizer=args.normalizer, progress=False if args.no_progress else None,
        token2wav_dir=args.token2wav_dir)
    report = run_batch(opts)
    return 1 if report["failed"] else 0


def cmd_client(args) -> int:
    from .client.client import ClientOptions, run_client

    protocol = args.protocol or ("grpc" if args.url.startswith("grpc://") else "openai")
    text = _read_text(args)
    if not text:
        raise CLIError("--text or --text-file is required")
    opts = ClientOptions(url=args.url, protocol=protocol, mode=args.mode, text=text, output=args.output,
                         voice=args.voice, prompt_wav=args.prompt_wav, prompt_text=args.prompt_text, seed=args.seed,
                         api_key=args.api_key or os.environ.get("COSYSERVE_API_KEY") or None,
                         model_name=args.model_name, timeout_s=args.timeout)
    st = run_client(opts)
    print(f"wrote {st['path']}: {st['audio_s']:.2f} s of audio in {st['chunks']} chunk(s) over {protocol} "
          f"({args.mode})")
    line = f"  total {st['total_s'] * 1000:.0f} ms, RTF {st['rtf']:.3f}"
    if args.mode == "streaming":
        line = f"  first chunk {st['first_chunk_s'] * 1000:.0f} ms," + line[1:]
    print(line)
    return 0


# ---------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cosyserve", description="CosyVoice2 zero-shot TTS serving runtime")
    p.add_argument("-v", "--verbose", action="store_true", help="log details")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("synthesize", help="text + voice -> wav")
    _add_model_args(s)
    _add_token2wav_arg(s)
    s.add_argument("--voice", help="registered voice id")
    s.add_argument("--voices-dir", default=None, help=f"voice store (default {DEFAULT_VOICES_DIR})")
    s.add_argument("--prompt-wav", help="reference recording (1-30 s)")
    s.add_argument("--prompt-text", help="transcript of the reference recording")
    s.add_argument("--text", help="text to speak")
    s.add_argument("--text-file", help="read the text from a UTF-8 file")
    s.add_argument("--stream", action="store_true", help="stream: write chunks as they are generated")
    s.add_argument("-o", "--output", required=True, help="output file (.wav, .flac, .ogg), 24 kHz mono")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress display")
    _add_synthesis_args(s)
    s.set_defaults(func=cmd_synthesize)

    v = sub.add_parser("voices", help="manage registered voices")
    v.add_argument("--voices-dir", default=DEFAULT_VOICES_DIR, help=f"voice store (default {DEFAULT_VOICES_DIR})")
    vs = v.add_subparsers(dest="voices_cmd", required=True)
    a = vs.add_parser("add", help="compute a voice from a recording + transcript")
    a.add_argument("id")
    a.add_argument("--model-dir", required=True)
    a.add_argument("--prompt-wav", required=True)
    a.add_argument("--prompt-text", required=True)
    a.add_argument("--overwrite", action="store_true")
    a.add_argument("--normalizer", default="auto", choices=["auto", "wetext", "rules", "none"])
    lst = vs.add_parser("list", help="list voices")
    lst.add_argument("--json", action="store_true")
    r = vs.add_parser("remove", help="delete voices")
    r.add_argument("ids", nargs="+")
    e = vs.add_parser("export", help="write voices as an upstream spk2info.pt")
    e.add_argument("output")
    e.add_argument("ids", nargs="*")
    i = vs.add_parser("import", help="add the speakers of an upstream (or Triton runtime) spk2info.pt")
    i.add_argument("input")
    i.add_argument("--overwrite", action="store_true")
    v.set_defaults(func=cmd_voices)

    d = sub.add_parser("demo-model", help="write a random-weight demo model directory (its audio is noise)")
    d.add_argument("dir")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--force", action="store_true", help="rewrite an existing demo model")
    d.add_argument("--dit-token2wav", action="store_true",
                   help="write a Step-Audio2 DiT token2wav directory into DIR instead (for --token2wav-dir)")
    d.add_argument("--dit-size", choices=["tiny", "full"], default="tiny",
                   help="--dit-token2wav sizes: tiny (default) or the released full size (GPU benchmarks)")
    d.add_argument("--no-weight-files", action="store_true",
                   help="--dit-token2wav: write no .pt files; the random networks are built when loaded")
    d.add_argument("--cosyvoice3", action="store_true",
                   help="the CosyVoice3 layout (cosyvoice3.yaml, DiT flow, causal HiFT, speech_tokenizer_v3.onnx)")
    d.set_defaults(func=cmd_demo_model)

    dm = sub.add_parser("demo", help="build the demo model and synthesize a Chinese and an English sentence")
    dm.add_argument("--out", default="demo_out")
    dm.add_argument("--device", default="auto")
    dm.add_argument("--seed", type=int, default=1)
    dm.set_defaults(func=cmd_demo)

    sv = sub.add_parser("serve", help="run the streaming TTS server (OpenAI, KServe v2 HTTP/gRPC, metrics)")
    sv.add_argument("--model-dir", help="official CosyVoice2 model directory")
    _add_token2wav_arg(sv)
    sv.add_argument("--demo", action="store_true", help="serve the random-weight demo model (audio is noise)")
    sv.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    _add_dtype_args(sv)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000, help="HTTP port (OpenAI, voices, KServe v2, metrics)")
    sv.add_argument("--grpc-port", type=int, default=8001, help="KServe v2 / Triton gRPC port")
    sv.add_argument("--voices-dir", default=DEFAULT_VOICES_DIR, help=f"voice store (default {DEFAULT_VOICES_DIR})")
    sv.add_argument("--default-voice", help="voice used when a request names none (Triton's spk2info cache)")
    sv.add_argument("--model-name", metavar="NAME",
                    help="the served model's name: the KServe v2 model and the OpenAI `model` (default: the model "
                         "family, cosyvoice2 or cosyvoice3; OpenAI's TTS model names are accepted too)")
    sv.add_argument("--max-queue", type=int, default=64, help="requests that may wait; more get HTTP 429")
    _engine_args(sv)
    sv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (also $COSYSERVE_API_KEY)")
    sv.add_argument("--request-timeout", type=float, default=300.0, help="seconds; 0 = none")
    sv.add_argument("--max-text-chars", type=int, default=4096)
    sv.add_argument("--max-upload-mb", type=float, default=20.0, help="largest request body / audio upload")
    sv.add_argument("--log-format", default="text", choices=["text", "json"])
    sv.add_argument("--no-warmup", action="store_true", help="mark ready without a warm-up request")
    sv.add_argument("--admission-calibrate", action=argparse.BooleanOptionalAction, default=False,
                    help="after the warm-up, run LM-only requests at 1 to 48 rows (no token2wav) so that auto "
                         "admission prices the LM's own step cost from the first request on, not from the start-up "
                         "probes' 1-3 rows (default off: on an H200 the overloads after it stalled a few streams, "
                         "its LM-only steps pricing the LM below what served steps cost; docs/perf.md "
                         "\"Session 42\")")
    sv.add_argument("--workers", type=_positive_int, default=1,
                    help="serve from N worker processes behind one router on --port/--grpc-port (data-parallel "
                         "replicas; each loads the model; voices are shared through --voices-dir)")
    sv.add_argument("--gpus", help="one worker per listed GPU, e.g. 0,1 (each sees only its GPU); implies --workers")
    sv.add_argument("--llm-only", action="store_true",
                    help="serve only the speech LM as an OpenAI-compatible POST /v1/completions endpoint "
                         "(the exported vocabulary of convert-llm; for 'cosyserve batch --llm-url'); no speech "
                         "routes, no gRPC port; POST /v1/completions streams with stream=true)")
    sv.add_argument("--llm-stream-interval", type=_nonnegative_float, default=0.0, metavar="SECONDS",
                    help="--llm-only: send a streamed completion's tokens at most every SECONDS, several per event "
                         "(default 0: one event per engine step; a token2wav server receiving thousands of events per "
                         "second spends ~0.1 ms of Python on each)")
    sv.add_argument("--llm-url", metavar="URL",
                    help="disaggregated token2wav server: stream the speech tokens from this OpenAI-compatible "
                         "completions server (cosyserve serve --llm-only, or vLLM / SGLang / trtllm-serve serving the "
                         "convert-llm checkpoint) instead of running the LM here; no LM weights are loaded")
    sv.add_argument("--llm-model", metavar="NAME",
                    help="the LLM server's served model name (default: the first of its GET /v1/models, checked "
                         "at start-up)")
    sv.add_argument("--llm-api-key", help="bearer key of the --llm-url server (also $COSYSERVE_LLM_API_KEY)")
    sv.add_argument("--llm-timeout", type=float, default=60.0, metavar="SECONDS",
                    help="--llm-url: a stream that receives nothing for this long fails (default 60)")
    sv.add_argument("--llm-checkpoint", metavar="DIR",
                    help="--llm-url served by vLLM / SGLang / trtllm-serve: the convert-llm folder it serves; its "
                         "speech-logit bias is sent as logit_bias (the native --llm-only server needs none)")
    sv.add_argument("--llm-gpus", metavar="LIST",
                    help="disaggregated layout: one --llm-only LLM worker per listed GPU (with --t2w-gpus)")
    sv.add_argument("--t2w-gpus", metavar="LIST",
                    help="disaggregated layout: one token2wav worker per listed GPU, streaming its tokens from "
                         "the --llm-gpus workers (spread round-robin); requests go to these by load")
    sv.add_argument("--llm-workers", type=_positive_int, metavar="N",
                    help="disaggregated layout on one shared device: N LLM workers, and --workers token2wav workers "
                         "streaming from them (for tests: on one GPU the processes take turns on it, ~10x slower "
                         "than one process; serve with --llm-gpus/--t2w-gpus)")
    sv.add_argument("--metrics-port", type=int, metavar="PORT",
                    help="also serve GET /metrics on this port, WITHOUT the API key and nothing else there (for "
                         "Prometheus scrapers; keep it off public networks)")
    sv.add_argument("--speech-tokenizer", default="auto", choices=["auto", "torch", "onnxruntime"],
                    help="speech tokenizer backend: auto (default: PyTorch, batched, when serving on CUDA with a "
                         "real-structure speech_tokenizer_v2.onnx; else onnxruntime), torch or onnxruntime")
    sv.add_argument("--prompt-cache", type=int, default=64, metavar="N",
                    help="voices of the last N distinct per-request prompts are kept (default 64; 0: none, e.g. to "
                         "benchmark prompt extraction)")
    sv.add_argument("--prompt-batch-window", type=float, default=0.002, metavar="S",
                    help="seconds an idle prompt batcher waits for concurrent prompts to share one speech-tokenizer "
                         "forward (default 0.002)")
    _add_random_weights_args(sv)
    _add_synthesis_args(sv)
    sv.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="measure first-chunk latency, RTF and throughput of a server under concurrency",
                       description="Drive a running cosyserve (or Triton) server -- or the in-process engine -- "
                                   "with N concurrent clients over a benchmark set; print Markdown tables, write "
                                   "report.json, report.md and bench.png into --out.")
    b.add_argument("--url", help="server: grpc://HOST:PORT (KServe gRPC) or http://HOST:PORT (OpenAI / KServe HTTP)")
    b.add_argument("--protocol", choices=["grpc", "http", "openai"],
                   help="grpc (Triton ModelStreamInfer / ModelInfer), http (KServe v2 infer, offline only), openai "
                        "(/v1/audio/speech pcm); default: grpc for grpc:// URLs, else openai")
    b.add_argument("--mode", choices=["streaming", "offline"], default="streaming")
    b.add_argument("--concurrency", default=None,
                   help="concurrent clients per level (default 1,2,4,8,16; with --capacity: the levels probed "
                        "before bisecting, default 1,2,4,... up to --max-streams)")
    b.add_argument("--set", help="benchmark set folder or manifest .jsonl (default: benchmarks/sets/default)")
    b.add_argument("--limit", type=int, help="use only the first N items")
    b.add_argument("--requests-per-level", type=int, help="requests per level (default: items x --repeat)")
    b.add_argument("--repeat", type=int, default=1, help="times each item is sent per level (default 1)")
    b.add_argument("--min-requests-per-client", type=_positive_int, default=3, metavar="N",
                   help="every level sends at least N requests per client, back to back: a steady state, not a "
                        "burst (default 3; fewer per client is flagged 'burst' in the table)")
    b.add_argument("--ramp-s", type=_nonnegative_float, default=0.0, metavar="SECONDS",
                   help="start each level's clients over SECONDS (client k of c sends its first request k x SECONDS "
                        "/ c after the level starts) instead of all at once: arrivals spread as in a steady state "
                        "rather than one synchronised burst (default 0; about one request's duration, e.g. 1-2, "
                        "for capacity runs; the tables show the mean number of requests in flight)")
    b.add_argument("--playback", action="store_true",
                   help="streaming: each client listens — plays every stream in real time and sends its next "
                        "request when the audio has finished playing, not as soon as it has arrived; N clients are "
                        "then N concurrent real-time streams")
    b.add_argument("--capacity", action="store_true",
                   help="find the most concurrent streams with 0 stalls, no failures and first-chunk p99 within "
                        "--p99-bound-ms: levels doubling up to --max-streams, then bisection")
    b.add_argument("--p99-bound-ms", type=float, default=500.0, metavar="MS",
                   help="--capacity: first-chunk p99 bound (default 500)")
    b.add_argument("--max-streams", type=_positive_int, default=256, metavar="N",
                   help="--capacity: the largest level probed (default 256)")
    b.add_argument("--capacity-tolerance", type=_fraction, default=0.1, metavar="FRACTION",
                   help="--capacity: bisect until the gap is within FRACTION of the capacity, at least 1 stream "
                        "(default 0.1; 0 = exact)")
    b.add_argument("--overload", type=_nonnegative_float, default=0.0, metavar="FACTOR",
                   help="--capacity: then run one level at FACTOR x the capacity (e.g. 2) and report stalls among "
                        "the streams that ran, refusals, and whether queued requests started in arrival order")
    b.add_argument("--warmup", type=int, default=2, help="warm-up requests before the first level, not counted")
    b.add_argument("--seed", type=int, default=0, help="request seed = SEED + item index (same audio across levels)")
    b.add_argument("--voice", help="send this registered voice id instead of each item's reference audio")
    b.add_argument("--api-key", help="bearer key of the server (also $COSYSERVE_API_KEY)")
    b.add_argument("--model-name", help="KServe model / OpenAI model name (default: the server's own, from its "
                                        "model list: cosyvoice2, cosyvoice3 or its serve --model-name)")
    b.add_argument("--out", default="bench_out", help="output folder (default bench_out)")
    b.add_argument("--save-audio", action="store_true", help="write every request's audio into OUT/audio/")
    b.add_argument("--metrics-url", help="the server's Prometheus page for the engine stage breakdown (default: "
                                         "URL/metrics for http:// URLs; give it for grpc://)")
    b.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    b.add_argument("--no-progress", action="store_true")
    b.add_argument("--min-token-text-ratio", type=float, default=None,
                   help="speech tokens the LM must generate per text token (in-process; for a server: what it was "
                        "started with, recorded in the report when the server does not report it)")
    b.add_argument("--max-token-text-ratio", type=float, default=None, help="see --min-token-text-ratio")
    b.add_argument("--in-process", action="store_true",
                   help="drive an engine in this process instead of a server (same workload and report)")
    b.add_argument("--model-dir", help="model directory (--in-process)")
    _add_token2wav_arg(b)
    b.add_argument("--demo", action="store_true", help="the random-weight demo model (--in-process)")
    _add_random_weights_args(b)
    b.add_argument("--device", default="auto")
    _add_dtype_args(b)
    b.add_argument("--voices-dir", default=None, help="voice store for --voice (--in-process)")
    _engine_args(b, in_process=True)
    b.add_argument("--chunk-policy", default=None,
                   help="streaming chunk schedule: in-process (default upstream), or sent to a server as the KServe "
                        "gRPC request parameter chunk_policy (default: the server's)")
    b.set_defaults(func=cmd_bench)

    bt = sub.add_parser("batch", help="offline inference over a manifest: one wav per item, LLM/token2wav times, RTF",
                        description="Synthesize every item of a JSONL manifest offline: frontend, then the speech LM "
                                    "for all items (native continuous batching, or an OpenAI-compatible completions "
                                    "server with --llm-url), then token2wav in batches. Prints the time of each "
                                    "stage and the RTF.")
    bt.add_argument("--set", help="benchmark set folder or manifest .jsonl (default: benchmarks/sets/default)")
    bt.add_argument("--out", default="batch_out", help="output folder: wavs/<id>.wav and batch_report.json")
    bt.add_argument("--limit", type=int, help="use only the first N items")
    bt.add_argument("--model-dir", help="model directory (frontend, flow, HiFT; and the LM unless --llm-url)")
    _add_token2wav_arg(bt)
    bt.add_argument("--demo", action="store_true", help="the random-weight demo model")
    _add_random_weights_args(bt)
    bt.add_argument("--device", default="auto")
    _add_dtype_args(bt)
    bt.add_argument("--batch-size", type=int, default=16, help="LM sequences decoded together (native: KV slots; "
                                                               "--llm-url: requests in flight)")
    bt.add_argument("--token2wav-batch-size", type=int, default=8, help="utterances per flow + HiFT batch")
    bt.add_argument("--seed", type=int, default=0, help="item i uses seed SEED + i")
    bt.add_argument("--min-token-text-ratio", type=float, default=2.0)
    bt.add_argument("--max-token-text-ratio", type=float, default=20.0)
    bt.add_argument("--normalizer", default="auto", choices=["auto", "wetext", "rules", "none"])
    bt.add_argument("--llm-url", help="OpenAI-compatible completions server with the convert-llm checkpoint "
                                      "(vLLM, SGLang, trtllm-serve, cosyserve serve --llm-only)")
    bt.add_argument("--llm-model", help="served model name (default: the first of GET /v1/models)")
    bt.add_argument("--llm-checkpoint", help="the convert-llm output folder (its config.json gives the vocabulary "
                                             "layout; default: computed from --model-dir)")
    bt.add_argument("--logit-bias", action="store_true",
                    help="send the speech-logit bias of --llm-checkpoint as logit_bias (needed by servers that serve "
                         "the exported checkpoint, not by cosyserve --llm-only)")
    bt.add_argument("--llm-api-key", help="bearer key of the LM server (also $COSYSERVE_LLM_API_KEY)")
    bt.add_argument("--llm-extra", help='JSON object merged into every completions request (sent by default: '
                                        '{"skip_special_tokens": false, "stop_token_ids": [the 3 stop ids]})')
    bt.add_argument("--no-progress", action="store_true")
    bt.set_defaults(func=cmd_batch)

    cl = sub.add_parser("client", help="send one request to a server over any protocol and save the wav",
                        description="One TTS request over KServe gRPC (streaming or not), KServe HTTP or the OpenAI "
                                    "speech API; writes the audio and prints the latencies.")
    cl.add_argument("--url", required=True, help="grpc://HOST:PORT or http://HOST:PORT")
    cl.add_argument("--protocol", choices=["grpc", "http", "openai"], help="default: grpc for grpc://, else openai")
    cl.add_argument("--mode", choices=["streaming", "offline"], default="streaming")
    cl.add_argument("--text", help="text to speak")
    cl.add_argument("--text-file", help="read the text from a UTF-8 file")
    cl.add_argument("--voice", help="registered voice id")
    cl.add_argument("--prompt-wav", help="reference recording (sent as 16 kHz reference_wav; KServe protocols)")
    cl.add_argument("--prompt-text", help="transcript of --prompt-wav")
    cl.add_argument("--seed", type=int, default=None)
    cl.add_argument("--api-key", help="bearer key (also $COSYSERVE_API_KEY)")
    cl.add_argument("--model-name", help="KServe model / OpenAI model name (default: the server's own)")
    cl.add_argument("--timeout", type=float, default=600.0)
    cl.add_argument("-o", "--output", required=True, help="output wav (24 kHz)")
    cl.set_defaults(func=cmd_client)

    c = sub.add_parser("convert-llm", help="export the speech LM as a Hugging Face Qwen2ForCausalLM checkpoint")
    c.add_argument("model_dir")
    c.add_argument("out_dir")
    c.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    c.set_defaults(func=cmd_convert_llm)
    return p


def _resolve_chunk_policy(args) -> None:
    """The default ``--chunk-policy`` when none was given: the DiT path's with ``--token2wav-dir``
    (:func:`~cosyserve.engine.chunking.default_chunk_policy`), else ``upstream``. ``bench`` against a
    server keeps None (the server's own default applies). ``args.chunk_policy_given``: whether it
    was given (the engine config's ``stream_chunk_policy`` is None otherwise: the same default)."""
    from .engine.chunking import default_chunk_policy

    args.chunk_policy_given = getattr(args, "chunk_policy", None) is not None
    if not hasattr(args, "chunk_policy") or args.chunk_policy_given or (args.command == "bench" and not args.in_process):
        return
    args.chunk_policy = default_chunk_policy(dit=bool(getattr(args, "token2wav_dir", None)))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _resolve_chunk_policy(args)
    if args.command == "synthesize":
        args.voices_dir_given = args.voices_dir is not None
        if args.voices_dir is None:
            args.voices_dir = DEFAULT_VOICES_DIR
    try:
        return args.func(args)
    except CosyServeError as exc:
        print(f"cosyserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("cosyserve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

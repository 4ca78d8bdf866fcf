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


def _add_model_args(p: argparse.ArgumentParser, need_model: bool = True) -> None:
    p.add_argument("--model-dir", required=need_model, help="official CosyVoice2 model directory")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="LM/flow precision (auto: bfloat16 on CUDA, float32 on CPU)")


def _add_synthesis_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=None, help="random seed (reproducible output)")
    p.add_argument("--chunk-policy", default="upstream",
                   help="streaming chunk schedule: upstream[:25:100] (default), fixed[:N], exponential[:15:25[:max]]")
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
    store = VoiceStore(args.voices_dir) if (args.voice or args.voices_dir_given) else None
    params = _params(args, stream=args.stream)
    syn = Synthesizer(args.model_dir, device=device, dtype=_dtype(args.dtype, device), normalizer=args.normalizer)
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

    out = write_demo_model(args.dir, seed=args.seed, force=args.force)
    print(f"wrote demo model (RANDOM weights, the audio is noise) to {out}")
    return 0


DEMO_TEXTS = (
    ("zh", "收到好友从远方寄来的生日礼物，那份意外的惊喜让我心中充满了快乐。"),
    ("en", "Hello! This is cosyserve, streaming speech from a CosyVoice2 model."),
)


def cmd_demo(args) -> int:
    import json
    from importlib import resources

    from .engine.pipeline import Synthesizer
    from .engine.request import SynthesisParams
    from .engine.chunking import ChunkPolicy
    from .models.demo import write_demo_model

    out = Path(args.out)
    model_dir = write_demo_model(out / "model")
    prompts = Path(str(resources.files("cosyserve").joinpath("assets", "prompts")))
    meta = json.loads((prompts / "transcripts.json").read_text(encoding="utf-8"))["zero_shot_prompt.wav"]
    print("cosyserve demo — the DEMO model has the real CosyVoice2 architecture at a small size with RANDOM")
    print("weights, so the audio is noise: this shows the pipeline, streaming and latency, not voice quality.")
    syn = Synthesizer(model_dir, device=_device(args.device))
    syn.frontend.warmup()
    voice = syn.make_voice("demo", prompts / "zero_shot_prompt.wav", meta["transcript"])
    print(f"prompt: {prompts / 'zero_shot_prompt.wav'} ({voice.duration_s:.2f} s) \"{meta['transcript']}\"")
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


def cmd_serve(args) -> int:
    import asyncio
    import json
    from importlib import resources

    from .server.app import serve
    from .server.state import ServerConfig, setup_logging

    setup_logging(args.log_format, logging.DEBUG if args.verbose else logging.INFO)
    device = _device(args.device)
    default_voice = args.default_voice
    voices_dir = args.voices_dir
    if args.demo:
        from .frontend.frontend import Frontend
        from .frontend.voice import VoiceStore
        from .models.demo import write_demo_model

        if args.model_dir:
            raise CLIError("give --model-dir or --demo, not both")
        args.model_dir = str(write_demo_model(_cache_dir() / "demo-model"))
        print("note: --demo serves a model with RANDOM weights: the audio is noise, not speech", file=sys.stderr)
        store = VoiceStore(voices_dir)
        if "default" not in store:
            prompts = Path(str(resources.files("cosyserve").joinpath("assets", "prompts")))
            meta = json.loads((prompts / "transcripts.json").read_text(encoding="utf-8"))["zero_shot_prompt.wav"]
            fe = Frontend(args.model_dir)
            store.add(fe.make_voice("default", prompts / "zero_shot_prompt.wav", meta["transcript"]))
        default_voice = default_voice or "default"
    if not args.model_dir:
        raise CLIError("--model-dir (or --demo) is required")
    from .models.loader import open_model_dir

    open_model_dir(args.model_dir)  # fail fast with a clear message
    cfg = ServerConfig(
        model_dir=args.model_dir, host=args.host, port=args.port, grpc_port=args.grpc_port, voices_dir=voices_dir,
        default_voice=default_voice, max_active_streams=args.max_active_streams, max_queue=args.max_queue,
        api_key=args.api_key or os.environ.get("COSYSERVE_API_KEY") or None, device=device,
        dtype=str(_dtype(args.dtype, device)).replace("torch.", ""), request_timeout_s=args.request_timeout or None,
        max_text_chars=args.max_text_chars, max_upload_bytes=int(args.max_upload_mb * 1024 * 1024),
        normalizer=args.normalizer, chunk_policy=args.chunk_policy,
        min_token_text_ratio=args.min_token_text_ratio, max_token_text_ratio=args.max_token_text_ratio,
        warmup=not args.no_warmup,
    )
    try:
        asyncio.run(serve(cfg, args.log_format))
    except OSError as exc:
        raise CLIError(f"cannot start the server: {exc}") from None
    except RuntimeError as exc:
        raise CLIError(str(exc)) from None
    return 0


def cmd_convert_llm(args) -> int:
    import torch

    from .models.export import export_llm

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    sv = export_llm(args.model_dir, args.out_dir, dtype=dtype)
    print(f"wrote Qwen2ForCausalLM checkpoint to {args.out_dir}: speech token i = id {sv.speech_token_offset} + i, "
          f"<|eos1|> {sv.eos_token_id}, <|sos|> {sv.sos_token_id}, <|task_id|> {sv.task_id_token_id}, "
          f"vocab {sv.vocab_size}; the speech-token logit bias is in speech_logit_bias.safetensors")
    return 0


# ---------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cosyserve", description="CosyVoice2 zero-shot TTS serving runtime")
    p.add_argument("-v", "--verbose", action="store_true", help="log details")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("synthesize", help="text + voice -> wav")
    _add_model_args(s)
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
    d.set_defaults(func=cmd_demo_model)

    dm = sub.add_parser("demo", help="build the demo model and synthesize a Chinese and an English sentence")
    dm.add_argument("--out", default="demo_out")
    dm.add_argument("--device", default="auto")
    dm.add_argument("--seed", type=int, default=1)
    dm.set_defaults(func=cmd_demo)

    sv = sub.add_parser("serve", help="run the streaming TTS server (OpenAI, KServe v2 HTTP/gRPC, metrics)")
    sv.add_argument("--model-dir", help="official CosyVoice2 model directory")
    sv.add_argument("--demo", action="store_true", help="serve the random-weight demo model (audio is noise)")
    sv.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    sv.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000, help="HTTP port (OpenAI, voices, KServe v2, metrics)")
    sv.add_argument("--grpc-port", type=int, default=8001, help="KServe v2 / Triton gRPC port")
    sv.add_argument("--voices-dir", default=DEFAULT_VOICES_DIR, help=f"voice store (default {DEFAULT_VOICES_DIR})")
    sv.add_argument("--default-voice", help="voice used when a request names none (Triton's spk2info cache)")
    sv.add_argument("--max-active-streams", type=int, default=16, help="requests processed at once (KV slots)")
    sv.add_argument("--max-queue", type=int, default=64, help="requests that may wait; more get HTTP 429")
    sv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (also $COSYSERVE_API_KEY)")
    sv.add_argument("--request-timeout", type=float, default=300.0, help="seconds; 0 = none")
    sv.add_argument("--max-text-chars", type=int, default=4096)
    sv.add_argument("--max-upload-mb", type=float, default=20.0, help="largest request body / audio upload")
    sv.add_argument("--log-format", default="text", choices=["text", "json"])
    sv.add_argument("--no-warmup", action="store_true", help="mark ready without a warm-up request")
    _add_synthesis_args(sv)
    sv.set_defaults(func=cmd_serve)

    c = sub.add_parser("convert-llm", help="export the speech LM as a Hugging Face Qwen2ForCausalLM checkpoint")
    c.add_argument("model_dir")
    c.add_argument("out_dir")
    c.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    c.set_defaults(func=cmd_convert_llm)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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

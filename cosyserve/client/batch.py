"""``cosyserve batch``: offline inference over a manifest, stage by stage, with timings.

The equivalent of the Triton runtime's ``offline_inference.py``. Stages, each timed on its
own (seconds, wall clock):

1. **frontend** — each distinct prompt becomes a voice (speech tokens, mel, speaker
   embedding; computed once per prompt) and each target text is normalised, split into
   segments and tokenised;
2. **LLM** — the speech tokens of every segment:

   * ``native`` (default): one :class:`~cosyserve.engine.core.EngineCore` in LM-only mode
     with ``--batch-size`` KV slots; all items are queued at once and decoded with
     continuous batching (at most ``batch-size`` sequences per step);
   * ``--llm-url``: an OpenAI-compatible completions server serving the ``convert-llm``
     checkpoint (vLLM, SGLang, trtllm-serve, ``cosyserve serve --llm-only``), with
     ``batch-size`` requests in flight (protocol: :mod:`cosyserve.client.remote_lm`);
3. **token2wav** — flow + HiFT over the finished token sequences, ``--token2wav-batch-size``
   utterances per batch (:class:`~cosyserve.engine.token2wav.Token2Wav`);
4. **write** — one 24 kHz 16-bit wav per item (``OUT/wavs/<id>.wav``).

``total`` = frontend + LLM + token2wav + write (model loading excluded); ``RTF = total /
audio seconds``. Seeds: item ``i`` uses ``seed + i`` (the LM's generator; a remote LM gets
``seed + i + k`` for segment ``k``); HiFT's noise uses a generator derived from the same
seed, so both backends give the same audio for the same tokens.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..errors import CosyServeError, InvalidInputError
from .bench import machine_info
from .manifest import load_manifest, resolve_manifest
from .progress import Progress


class BatchError(CosyServeError):
    """Bad ``cosyserve batch`` options."""


@dataclass
class BatchOptions:
    """``cosyserve batch`` options (see ``cosyserve batch --help``)."""

    set: str | None = None
    out: str = "batch_out"
    limit: int | None = None
    model_dir: str | None = None
    demo: bool = False
    device: str = "cpu"
    dtype: str = "float32"
    hift_dtype: str = "auto"
    token2wav_dir: str | None = None  # Step-Audio2 DiT token2wav directory (replaces flow + HiFT)
    batch_size: int = 16
    token2wav_batch_size: int = 8
    seed: int = 0
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0
    llm_url: str | None = None
    llm_model: str | None = None
    llm_checkpoint: str | None = None
    logit_bias: bool = False
    llm_api_key: str | None = None
    llm_extra: str | None = None
    normalizer: str = "auto"
    progress: bool | None = None


def _synthesizer(o: BatchOptions):
    import os

    from ..engine.pipeline import DTYPES, Synthesizer

    if o.demo == bool(o.model_dir):
        raise BatchError("give --model-dir DIR or --demo")
    if o.demo:
        from ..models.demo import write_demo_model

        cache = Path(os.environ.get("COSYSERVE_CACHE_DIR") or Path.home() / ".cache" / "cosyserve")
        model_dir = write_demo_model(cache / "demo-model")
    else:
        model_dir = o.model_dir
    return Synthesizer(model_dir, device=o.device, dtype=DTYPES[o.dtype], normalizer=o.normalizer, hift_dtype=o.hift_dtype,
                       token2wav_dir=o.token2wav_dir)


def _remote_lm(o: BatchOptions, synth):
    from .remote_lm import CompletionsLM, load_checkpoint_info, logit_bias_map, speech_vocab

    bias = None
    if o.llm_checkpoint:
        sv, bias = load_checkpoint_info(o.llm_checkpoint)
    else:
        sv = speech_vocab(len(synth.frontend.tokenizer), synth.cfg.llm.speech_token_size, synth.cfg.model_family)
    if o.logit_bias:
        if bias is None:
            raise BatchError("--logit-bias needs --llm-checkpoint (the convert-llm folder with "
                             "speech_logit_bias.safetensors)")
        bias = logit_bias_map(sv, bias)
    else:
        bias = None
    extra = {"skip_special_tokens": False, "stop_token_ids": list(sv.stop_token_ids)}
    if o.llm_extra:
        try:
            more = json.loads(o.llm_extra)
        except json.JSONDecodeError as exc:
            raise BatchError(f"--llm-extra is not valid JSON: {exc}") from None
        if not isinstance(more, dict):
            raise BatchError("--llm-extra must be a JSON object")
        extra.update(more)
    s = synth.cfg.llm.sampling
    return CompletionsLM(o.llm_url, sv, model=o.llm_model, api_key=o.llm_api_key, top_p=s.top_p, top_k=s.top_k,
                         logit_bias=bias, extra=extra)


def _native_lm(synth, rows: list[dict], params_of, batch_size: int, progress: Progress) -> None:
    """LM-only requests for every row on one engine with ``batch_size`` slots (in place:
    ``row["tokens"]``, ``row["stop_reasons"]`` or ``row["error"]``)."""
    from ..engine.core import EngineConfig, EngineCore
    from ..engine.request import EngineRequest, RequestFinished

    core = EngineCore(synth.models, EngineConfig(max_active=batch_size, max_queue=len(rows) + 1))
    by_id = {}
    for r in rows:
        if r.get("error"):
            continue
        try:
            core.add_request(EngineRequest(r["id"], r["segments"], r["voice"], params_of(r["seed"])))
            by_id[r["id"]] = r
        except CosyServeError as exc:
            r["error"] = str(exc)
            progress.advance(False)
    try:
        while core.has_work():
            for ev in core.step():
                if isinstance(ev, RequestFinished) and ev.request_id in by_id:
                    r = by_id[ev.request_id]
                    if ev.error is not None or ev.outcome.value != "ok":
                        r["error"] = str(ev.error or ev.outcome.value)
                    else:
                        r["tokens"], r["stop_reasons"] = ev.tokens, ev.stop_reasons
                    progress.advance(r.get("error") is None)
    finally:
        core.close()


def _remote_lm_run(lm, rows: list[dict], params_of, batch_size: int, progress: Progress) -> dict:
    """Completions for every segment of every row, ``batch_size`` in flight."""
    from .remote_lm import RemoteLMError

    jobs, where = [], []
    for r in rows:
        if r.get("error"):
            continue
        v, p = r["voice"], params_of(r["seed"])
        for k, seg in enumerate(r["segments"]):
            lo, hi = p.token_bounds(int(seg.numel()))
            ids = lm.sv.prompt_ids(seg.tolist(), v.prompt_text_ids.tolist(), v.llm_speech_token.tolist())
            jobs.append((ids, lo, hi, r["seed"] + k))
            where.append((r, k))
    n_seg = {id(r): len(r["segments"]) for r in rows}
    done_seg: dict[int, int] = {}
    results: list = [None] * len(jobs)
    import concurrent.futures as cf

    def one(i):
        try:
            return lm.generate(*jobs[i])
        except RemoteLMError as exc:
            return exc

    ignored = 0
    with cf.ThreadPoolExecutor(max(1, batch_size)) as ex:
        futs = {ex.submit(one, i): i for i in range(len(jobs))}
        for f in cf.as_completed(futs):
            i = futs[f]
            results[i] = f.result()
            r, _ = where[i]
            done_seg[id(r)] = done_seg.get(id(r), 0) + 1
            if done_seg[id(r)] == n_seg[id(r)]:
                progress.advance(True)
    for (r, k), res in zip(where, results):
        if isinstance(res, Exception):
            r["error"] = str(res)
            continue
        r.setdefault("tokens", [[] for _ in r["segments"]])[k] = res.tokens
        r.setdefault("stop_reasons", [None for _ in r["segments"]])[k] = res.finish_reason
        ignored += res.ignored
    return {"ignored_output_tokens": ignored}


def run_batch(opts: BatchOptions, echo=print) -> dict:
    """Run the offline pipeline (see module docstring); returns the report dict and writes
    ``batch_report.json`` and ``wavs/`` into ``opts.out``.

    Raises :class:`~cosyserve.errors.CosyServeError` subclasses for bad options, an
    unusable model directory or manifest, or an unreachable LM server. Items that fail
    (e.g. a prompt the frontend refuses) are reported with their error; the others are
    still synthesized.
    """
    import soundfile as sf
    import torch

    from ..engine.request import HIFT_SEED_SALT, SynthesisParams
    from ..engine.token2wav import Token2WavJob
    from ..engine.token2wav import make_token2wav
    from ..models.hift import HiFTStreamState

    o = opts
    if o.batch_size < 1 or o.token2wav_batch_size < 1:
        raise BatchError("--batch-size and --token2wav-batch-size must be >= 1")
    if not o.llm_url and (o.llm_model or o.llm_checkpoint or o.logit_bias or o.llm_extra):
        raise BatchError("--llm-model, --llm-checkpoint, --logit-bias and --llm-extra need --llm-url")
    manifest = resolve_manifest(o.set)
    items = load_manifest(manifest, o.limit)
    out = Path(o.out)
    try:
        (out / "wavs").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BatchError(f"cannot create the output folder {out}: {exc}") from None

    def params_of(seed: int) -> SynthesisParams:
        return SynthesisParams(seed=seed, stream=False, lm_only=True, min_token_text_ratio=o.min_token_text_ratio,
                               max_token_text_ratio=o.max_token_text_ratio)

    params_of(0).validate()
    t_load = time.perf_counter()
    synth = _synthesizer(o)
    lm = _remote_lm(o, synth) if o.llm_url else None
    load_s = time.perf_counter() - t_load
    backend = f"remote ({lm.base}, model {lm.model})" if lm else "native"
    echo(f"cosyserve batch: {len(items)} items from {manifest}, LM {backend}, batch size {o.batch_size}, "
         f"token2wav batch size {o.token2wav_batch_size}, token/text ratio {o.min_token_text_ratio:g}–"
         f"{o.max_token_text_ratio:g}" + (" (DEMO model: random weights, the audio is noise)" if synth.is_demo else ""))

    # 1. frontend
    t0 = time.perf_counter()
    voices: dict = {}
    rows: list[dict] = []
    prog = Progress(len(items), "frontend", o.progress)
    for i, it in enumerate(items):
        r = {"id": it.id, "seed": o.seed + i, "language": it.language}
        try:
            key = (str(it.prompt_wav), it.prompt_text)
            if key not in voices:
                voices[key] = synth.make_voice("batch", it.prompt_wav, it.prompt_text)
            r["voice"] = voices[key]
            r["segments"] = synth.frontend.token_ids(it.target_text)
        except CosyServeError as exc:
            r["error"] = str(exc)
        rows.append(r)
        prog.advance("error" not in r)
    prog.close()
    frontend_s = time.perf_counter() - t0

    # 2. LLM
    t0 = time.perf_counter()
    prog = Progress(len(rows), "LLM", o.progress)
    extra = {}
    try:
        if lm is None:
            _native_lm(synth, rows, params_of, o.batch_size, prog)
        else:
            extra = _remote_lm_run(lm, rows, params_of, o.batch_size, prog)
    finally:
        prog.close()
        if lm is not None:
            lm.close()
    llm_s = time.perf_counter() - t0

    # 3. token2wav
    t0 = time.perf_counter()
    t2w = make_token2wav(synth.models)  # CosyVoice2's flow + HiFT, or the DiT token2wav (--token2wav-dir)
    hift_device = t2w.hift_device  # excitation noise is drawn where HiFT runs
    jobs: list[tuple[dict, int, Token2WavJob]] = []
    for r in rows:
        if r.get("error"):
            continue
        r["audio"] = [None] * len(r["segments"])
        for k, toks in enumerate(r["tokens"]):
            if not toks:
                r["audio"][k] = np.zeros(0, np.float32)
                continue
            g = torch.Generator(device=hift_device).manual_seed((r["seed"] ^ HIFT_SEED_SALT) + k)
            jobs.append((r, k, Token2WavJob(r["voice"], torch.tensor(toks), 0, True, False, HiFTStreamState(), g)))
    prog = Progress(len(jobs), "token2wav", o.progress)
    for b in range(0, len(jobs), o.token2wav_batch_size):
        part = jobs[b:b + o.token2wav_batch_size]
        try:
            res = t2w.run([j for _, _, j in part])
        except Exception:  # noqa: BLE001 - isolate the failing utterance
            res = []
            for r, _, j in part:
                try:
                    res.append(t2w.run([j])[0])
                except Exception as exc:  # noqa: BLE001
                    r["error"] = f"token2wav failed: {exc}"
                    res.append(None)
        for (r, k, _), x in zip(part, res):
            if x is not None:
                r["audio"][k] = x.speech.numpy()
            prog.advance(x is not None)
    prog.close()
    token2wav_s = time.perf_counter() - t0

    # 4. write
    t0 = time.perf_counter()
    sr = synth.sample_rate
    for r in rows:
        if r.get("error"):
            continue
        wav = np.concatenate(r["audio"]) if r["audio"] else np.zeros(0, np.float32)
        path = out / "wavs" / f"{r['id']}.wav"
        sf.write(str(path), wav, sr, subtype="PCM_16")
        r["wav"] = str(path.relative_to(out))
        r["samples"] = int(wav.size)
        r["audio_s"] = wav.size / sr
    write_s = time.perf_counter() - t0

    ok = [r for r in rows if not r.get("error")]
    audio_s = sum(r["audio_s"] for r in ok)
    n_tok = sum(len(t) for r in ok for t in r["tokens"])
    total_s = frontend_s + llm_s + token2wav_s + write_s
    cfg = asdict(o)
    cfg["llm_api_key"] = "***" if o.llm_api_key else None
    report = {
        "tool": "cosyserve batch", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": cfg,
        "machine": machine_info(), "backend": "remote" if lm else "native", "llm": backend, "demo_model": synth.is_demo,
        "set": {"manifest": str(manifest), "items": len(items)},
        "times_s": {"load": load_s, "frontend": frontend_s, "llm": llm_s, "token2wav": token2wav_s, "write": write_s,
                    "total": total_s},
        "items": len(items), "ok": len(ok), "failed": len(rows) - len(ok),
        "segments": sum(len(r["segments"]) for r in ok), "speech_tokens": n_tok, "audio_s": audio_s,
        "rtf": total_s / audio_s if audio_s else None,
        "llm_tokens_per_s": n_tok / llm_s if llm_s > 0 else None, **extra,
        "results": [{k: v for k, v in r.items() if k not in ("voice", "segments", "audio")} |
                    {"n_segments": len(r.get("segments") or []),
                     "n_tokens": sum(len(t) for t in r.get("tokens") or [])} for r in rows],
    }
    (out / "batch_report.json").write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    echo(markdown(report))
    for r in rows:
        if r.get("error"):
            echo(f"  failed {r['id']}: {r['error']}")
    echo(f"wrote {len(ok)} wav(s) to {out / 'wavs'} and {out / 'batch_report.json'}")
    return report


def markdown(report: dict) -> str:
    """The Markdown table of a ``cosyserve batch`` report."""
    t = report["times_s"]
    c = report["config"]
    name = "native" if report["backend"] == "native" else "remote LM"
    rtf = "–" if report["rtf"] is None else f"{report['rtf']:.3f}"
    tps = "–" if report["llm_tokens_per_s"] is None else f"{report['llm_tokens_per_s']:.0f}"
    return "\n".join([
        "",
        "| LM backend | batch | t2w batch | items ok | speech tokens | audio s | frontend s | LLM s | LLM tok/s | "
        "token2wav s | total s | RTF |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {name} | {c['batch_size']} | {c['token2wav_batch_size']} | {report['ok']}/{report['items']} | "
        f"{report['speech_tokens']} | {report['audio_s']:.2f} | {t['frontend']:.2f} | {t['llm']:.2f} | {tps} | "
        f"{t['token2wav']:.2f} | {t['total']:.2f} | {rtf} |",
        "",
        "total = frontend + LLM + token2wav + writing the wavs (model loading excluded: "
        f"{t['load']:.2f} s); RTF = total / audio seconds.",
        "",
    ])


__all__ = ["BatchOptions", "run_batch", "markdown", "InvalidInputError"]

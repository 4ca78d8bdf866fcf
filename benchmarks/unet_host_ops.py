"""Host work of a CosyVoice2 (U-Net flow) streaming token2wav batch, counted on the CPU: aten operators
dispatched per ``Token2Wav.launch`` + ``finish`` of N streaming chunks (one per stream), the growth per extra
stream, and (``--phases``) where that growth runs. On a GPU each operator is a kernel launch or host
bookkeeping issued by the scheduler's token2wav work (``t2w_launch``), which the H100 runs showed to bound the
UNet server (docs/perf.md, "Session 24"). A proxy that needs no GPU: a change that removes per-stream work can
be checked here before it is measured on one. Companion of ``benchmarks/dit_host_ops.py`` (DiT path).

    python3 benchmarks/unet_host_ops.py [--batches 1,2,6] [--flow-stream-cache on|off|both] [--phases]

The jobs are built as ``EngineCore._make_job`` builds a non-final streaming chunk: the tokens so far
(``schedule.chunk_end()``: the chunk's new tokens plus the look-ahead), the schedule's ``token_offset``, the
segment's HiFT state and generator, and (cache on) the segment's ``FlowStreamCache``. Every stream has its own
random prompt (``--prompt-tokens`` tokens, twice as many mel frames) and speaker vector, and is
``--warm-chunks`` chunks into its utterance (chunk schedule ``--policy``, the engine's default ``upstream``)
when its next chunk is counted, so the caches are in their steady state.

``--phases`` splits the counts by the innermost of these calls an operator runs in: ``flow prepare``
(``FlowModel.prepare``: validation, padding), ``flow encoder`` (the conformer encoder, cached or not),
``estimator stream plan`` (cache on: the estimator's per-item cache plan), ``flow conditioning``
(the rest of ``condition_inputs`` / ``_start_cached``: embedding, projections, ``mu``/``cond``/noise
slices), ``solver begin`` (CFG inputs, masks), ``solver steps`` (the Euler steps), ``flow mels``
(``FlowRun.mels``), ``HiFT F0`` / ``HiFT excitation`` / ``HiFT decode`` (``HiFTGenerator.predict_f0`` /
``excitation_padded`` / ``decode``) and ``HiFT stream step (rest)`` (the rest of ``hift_stream_step_batch``),
``other`` (engine bookkeeping in ``launch`` /
``_issue_hift`` / ``finish``).

Model: the reference's ``tiny_cosyvoice2`` (``COSYSERVE_REFERENCE_DIR``, or ``--model-dir``), float32, one
thread, eager solve (on CUDA the uncached solve is a CUDA graph, so its operators are not host work there:
compare the growth with the batch, not the totals).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import ops_by_phase, phase_ranges  # noqa: E402

import cosyserve.engine.token2wav as t2w_mod  # noqa: E402
from cosyserve.engine.chunking import ChunkPolicy  # noqa: E402
from cosyserve.engine.token2wav import Token2Wav, Token2WavJob  # noqa: E402
from cosyserve.models.flow import FlowRun  # noqa: E402
from cosyserve.models.hift import HiFTStreamState  # noqa: E402
from cosyserve.models.loader import load_models  # noqa: E402

#: phase label -> [(owner, attribute)] wrapped in a profiler range while ``--phases`` counts
PHASES = {
    "flow prepare": [("flow", "prepare")],
    "flow encoder": [("encoder", "forward"), ("encoder", "forward_stream")],
    "estimator stream plan": [("estimator", "stream_plan")],
    "flow conditioning": [("flow", "condition_inputs"), ("flow", "_start_cached")],
    "solver begin": [("decoder", "begin")],
    "solver steps": [("decoder", "step")],
    "flow mels": [("FlowRun", "mels")],
    "HiFT F0": [("hift", "predict_f0"), ("hift", "predict_f0_batched")],
    "HiFT excitation": [("hift", "excitation_padded")],
    "HiFT decode": [("hift", "decode")],
    "HiFT stream step (rest)": [("module", "hift_stream_step_batch")],
}


def _phases(t2w: Token2Wav) -> dict:
    """:data:`PHASES` with the objects of ``t2w`` (for :func:`_common.phase_ranges`)."""
    owners = {"flow": t2w.flow, "encoder": t2w.flow.encoder, "estimator": t2w.flow.decoder.estimator,
              "decoder": t2w.flow.decoder, "FlowRun": FlowRun, "hift": t2w.hift, "module": t2w_mod}
    return {label: [(owners[o], attr) for o, attr in targets] for label, targets in PHASES.items()}


class _Stream:
    """One streaming segment as the engine holds it: voice, generated tokens, schedule, HiFT state,
    generator and (optionally) flow stream cache."""

    def __init__(self, t2w: Token2Wav, policy: ChunkPolicy, prompt_tokens: int, cache: bool, g: torch.Generator,
                 seed: int):
        flow = t2w.flow
        self.voice = SimpleNamespace(
            flow_speech_token=torch.randint(0, flow.cfg.vocab_size, (prompt_tokens,), generator=g),
            speech_feat=torch.randn(t2w.ratio * prompt_tokens, flow.n_mels, generator=g),
            flow_embedding=torch.randn(flow.cfg.spk_embed_dim, generator=g))
        self.schedule = policy.start(prompt_tokens)
        self.hift_state = HiFTStreamState()
        self.generator = torch.Generator().manual_seed(seed)
        self.flow_cache = t2w.new_flow_cache() if cache else None
        self.vocab = flow.cfg.vocab_size
        self.tokens = torch.empty(0, dtype=torch.long)
        self.g = g

    def job(self) -> Token2WavJob:
        """The next non-final chunk's job (generating the tokens it needs first)."""
        end = self.schedule.chunk_end()
        if self.tokens.numel() < end:
            more = torch.randint(0, self.vocab, (end - self.tokens.numel(),), generator=self.g)
            self.tokens = torch.cat([self.tokens, more])
        return Token2WavJob(self.voice, self.tokens[:end].clone(), self.schedule.token_offset, False, True,
                            self.hift_state, self.generator, flow_cache=self.flow_cache)

    def done(self, result) -> None:
        self.hift_state = result.hift_state
        self.schedule.advance()


def _batch(t2w: Token2Wav, streams: list[_Stream]) -> None:
    jobs = [s.job() for s in streams]
    for s, r in zip(streams, t2w.finish(t2w.launch(jobs))):
        s.done(r)


def _counts(t2w: Token2Wav, n: int, args, cache: bool, g: torch.Generator) -> tuple[dict, dict]:
    policy = ChunkPolicy.parse(args.policy, lookahead=t2w.flow.pre_lookahead_len)
    streams = [_Stream(t2w, policy, args.prompt_tokens, cache, g, seed=k) for k in range(n)]
    with torch.inference_mode():
        for _ in range(args.warm_chunks):
            _batch(t2w, streams)
        with phase_ranges(_phases(t2w)) if args.phases else contextlib.nullcontext():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                _batch(t2w, streams)
    ops = {e.key: e.count for e in prof.key_averages() if e.key.startswith("aten::")}
    return ops, (ops_by_phase(prof) if args.phases else {})


def _report(label: str, both: dict, batches: list[int], phases: bool) -> None:
    counts = {b: c for b, (c, _) in both.items()}
    base, top = batches[0], batches[-1]
    print(f"== flow stream cache {label}")
    for b in batches:
        total = sum(counts[b].values())
        extra = (total - sum(counts[base].values())) / (b - base) if b != base else 0.0
        print(f"batch {b}: {total} aten ops ({total / b:.0f} per stream; {extra:.0f} more per extra stream)")
    if top == base:
        return
    grow = sorted(((counts[top].get(k, 0) - counts[base].get(k, 0)) / (top - base), k)
                  for k in set(counts[top]) | set(counts[base]))
    print("per extra stream:", ", ".join(f"{k} {n:.1f}" for n, k in reversed(grow[-12:]) if n > 0))
    if phases:
        pa, pb = both[base][1], both[top][1]
        labels = [*PHASES, "other"]
        print("per extra stream by phase:", ", ".join(
            f"{k} {(pb.get(k, 0) - pa.get(k, 0)) / (top - base):.1f}" for k in labels))
        print(f"batch {top} by phase:", ", ".join(f"{k} {pb.get(k, 0)}" for k in labels))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None,
                    help="CosyVoice2 model directory (default: $COSYSERVE_REFERENCE_DIR/tiny_cosyvoice2)")
    ap.add_argument("--batches", default="1,2,6")
    ap.add_argument("--prompt-tokens", type=int, default=40)
    ap.add_argument("--policy", default="upstream", help="chunk schedule (ChunkPolicy.parse), default upstream")
    ap.add_argument("--warm-chunks", type=int, default=3, help="chunks of every stream before the counted one")
    ap.add_argument("--flow-stream-cache", choices=("on", "off", "both"), default="both")
    ap.add_argument("--phases", action="store_true", help="split the counts by phase")
    args = ap.parse_args()
    model_dir = args.model_dir
    if model_dir is None:
        ref = os.environ.get("COSYSERVE_REFERENCE_DIR")
        if not ref:
            sys.exit("unet_host_ops: give --model-dir or set COSYSERVE_REFERENCE_DIR")
        model_dir = Path(ref) / "tiny_cosyvoice2"
    torch.set_num_threads(1)
    models = load_models(model_dir, components=("flow", "hift"))
    t2w = Token2Wav(models.flow, models.hift, models.cfg.token_mel_ratio)
    batches = [int(b) for b in args.batches.split(",")]
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.flow_stream_cache]
    for cache in modes:
        g = torch.Generator().manual_seed(0)
        both = {b: _counts(t2w, b, args, cache, g) for b in batches}
        _report("on" if cache else "off", both, batches, args.phases)


if __name__ == "__main__":
    main()

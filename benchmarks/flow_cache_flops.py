"""Flow work per streaming chunk with and without the per-stream flow cache (issue 17).

Counts, from the yaml's dimensions only (no weights, CPU, instant), the multiply-adds of every
flow call of one streamed utterance: the encoder once, the estimator ``n_timesteps`` x 2 (CFG
rows) times, dense attention as the kernels compute it (a masked key still costs its product).
"before": upstream's recomputation (every call over prompt + all tokens so far); "after": with
:class:`~cosyserve.models.flow.FlowStreamCache` (the estimator solves only the frames from the
first static chunk that was incomplete in the previous call; attention over the cached keys).
The encoder column of "after" assumes the encoder also starts from the first incomplete chunk
(``--encoder-cached yes``) or re-runs over everything (``no``). The final call is non-streaming
(full attention, upstream semantics) and is a full re-run in both. ``--prefix FRAMES``: "after" is
``--flow-stream-cache prefix`` instead (every streaming call solves the frames after the voice's prompt
prefix, attending the pool's FRAMES padded prefix keys; the encoder re-runs over everything).

    python benchmarks/flow_cache_flops.py [--yaml cosyvoice2.yaml] [--seconds 20] [--prompt-seconds 5]
                                          [--schedule upstream|exponential] [--encoder-cached yes|no]
                                          [--cap FRAMES] [--prefix FRAMES]

Default yaml: the REAL CosyVoice2-0.5B yaml in the reference data's manifests/.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from cosyserve.engine.chunking import ChunkPolicy
from cosyserve.models.config import load_config


def encoder_macs(enc, n_tok_new: int, n_tok_keys: int, ratio: int) -> float:
    """Encoder MACs for ``n_tok_new`` computed token positions attending to ``n_tok_keys`` keys
    (frames: ``ratio`` x both)."""
    d, ff = enc.output_size, enc.linear_units
    la = enc.pre_lookahead_len
    per_tok = enc.input_size * d + d * d * (la + 1) + d * d * 3  # embed, look-ahead conv1, conv2
    layer_lin = 4 * d * d + 2 * d * ff
    # content scores + weighted values (2 d per key) and the position term: q . p over 2T-1
    # distances plus linear_pos over the table (2T-1 rows, d x d)
    def attn(nq, nk):
        return nq * (2 * d * nk + d * (2 * nk - 1)) + (2 * nk - 1) * d * d
    total = n_tok_new * per_tok
    total += enc.num_blocks * (n_tok_new * layer_lin + attn(n_tok_new, n_tok_keys))
    f_new, f_keys = ratio * n_tok_new, ratio * n_tok_keys
    total += f_new * (d * d * (2 * ratio + 1) + enc.input_size * d)  # up conv, up_embed
    total += enc.num_up_blocks * (f_new * layer_lin + attn(f_new, f_keys))
    return float(total)


def estimator_macs(est, n_mels: int, frames_new: int, frames_keys: int) -> float:
    """One estimator call (one CFG row, one step) over ``frames_new`` query frames and
    ``frames_keys`` attention keys (one-level U-Net as CosyVoice2's)."""
    c = est.channels[0]
    inner = est.num_heads * est.attention_head_dim
    block = c * 3 * inner + inner * c + 2 * c * 4 * c  # qkv, out, feed-forward
    attn = 2 * inner * frames_keys  # QK^T and AV per query
    n_tf = est.n_blocks * (2 + est.num_mid_blocks)
    resnet = lambda cin, cout: cin * cout * 3 + cout * cout * 3 + cin * cout  # noqa: E731
    per_frame = n_tf * (block + attn)
    per_frame += resnet(est.in_channels, c) + est.num_mid_blocks * resnet(c, c) + resnet(2 * c, c)
    per_frame += 3 * c * c * 3 + c * n_mels  # down conv, up conv, final block, final projection
    return float(frames_new * per_frame)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default_ref = Path(__file__).resolve().parents[1].parent / "shared" / "reference"
    ref = Path(os.environ.get("COSYSERVE_REFERENCE_DIR", default_ref))
    ap.add_argument("--yaml", default=str(ref / "manifests" / "cosyvoice2.real.yaml"))
    ap.add_argument("--seconds", type=float, default=20.0, help="speech to stream (25 tokens/s)")
    ap.add_argument("--prompt-seconds", type=float, default=5.0, help="prompt speech (flow prompt tokens)")
    ap.add_argument("--schedule", default="upstream", help="chunk policy: upstream, exponential, fixed:N, ...")
    ap.add_argument("--encoder-cached", choices=["yes", "no"], default="yes")
    ap.add_argument("--cap", type=int, default=None, metavar="FRAMES",
                    help="--flow-stream-cache-frames: at most FRAMES cached frames per stream")
    ap.add_argument("--prefix", type=int, default=None, metavar="FRAMES",
                    help="'after' = --flow-stream-cache prefix with a pool of FRAMES frames per voice: every "
                         "streaming call solves the frames after the voice's prompt prefix (no per-stream cache), "
                         "attending FRAMES padded prefix keys; the encoder re-runs over everything")
    args = ap.parse_args()
    if args.prefix is not None:
        args.encoder_cached = "no"

    cfg = load_config(args.yaml).flow
    enc, est, cfm = cfg.encoder, cfg.estimator, cfg.cfm
    ratio, la = cfg.token_mel_ratio, cfg.pre_lookahead_len
    chunk = est.static_chunk_size
    rate = cfg.input_frame_rate
    n_tok, n_prompt = round(args.seconds * rate), round(args.prompt_seconds * rate)
    rows = 2 * cfm.n_timesteps  # CFG rows x Euler steps
    sched = ChunkPolicy.parse(args.schedule, lookahead=la).start(n_prompt)
    calls = []
    while sched.ready(n_tok):
        calls.append((sched.chunk_end(), True))
        sched.advance()
    calls.append((n_tok, False))

    n_tf = est.n_blocks * (2 + est.num_mid_blocks)
    per_frame_vals = cfm.n_timesteps * 2 * 2 * n_tf * est.num_heads * est.attention_head_dim
    print(f"yaml {args.yaml}\n{args.seconds:g} s speech ({n_tok} tokens), prompt {n_prompt} tokens, "
          f"schedule {args.schedule}, {cfm.n_timesteps} steps x 2 CFG rows, chunk {chunk} frames")
    print(f"{'call':>4} {'tokens':>6} {'frames':>6} {'cached':>6} {'solved':>6} | {'GMAC before':>11} "
          f"{'GMAC after':>10} {'x less':>6} | {'enc GMAC b/a':>13}")
    tot_b = tot_a = 0.0
    cached = 0
    for i, (end, streaming) in enumerate(calls):
        l_tok = n_prompt + end
        enc_len = l_tok - la if streaming else l_tok
        frames = ratio * enc_len
        start = cached if streaming else 0
        keys = frames
        if args.prefix is not None:  # the voice's prompt prefix (complete chunks of the prompt), padded keys
            start = min((ratio * (n_prompt - la)) // chunk * chunk, args.prefix // chunk * chunk) if streaming else 0
            keys = frames - start + (args.prefix // chunk * chunk if streaming else 0)
        e_before = encoder_macs(enc, enc_len, enc_len, ratio)
        tok_start = start // ratio
        e_after = encoder_macs(enc, enc_len - tok_start, enc_len, ratio) if args.encoder_cached == "yes" else e_before
        s_before = rows * estimator_macs(est, cfg.output_size, frames, frames)
        s_after = rows * estimator_macs(est, cfg.output_size, frames - start, keys)
        b, a = (e_before + s_before) / 1e9, (e_after + s_after) / 1e9
        tot_b, tot_a = tot_b + b, tot_a + a
        print(f"{i:>4} {end:>6} {frames:>6} {start:>6} {frames - start:>6} | {b:>11.1f} {a:>10.1f} {b / a:>6.2f} | "
              f"{e_before / 1e9:>6.1f}/{e_after / 1e9:<6.1f}")
        cached = (frames // chunk) * chunk if streaming else 0
        if args.cap is not None:
            cached = max(min(cached, args.cap // chunk * chunk), 0)
    print(f"{'all':>4} {'':>6} {'':>6} {'':>6} {'':>6} | {tot_b:>11.1f} {tot_a:>10.1f} {tot_b / tot_a:>6.2f}")
    peak = max(((n_prompt + e - la) * ratio // chunk) * chunk for e, s in calls if s) if len(calls) > 1 else 0
    if args.cap is not None:
        peak = min(peak, args.cap // chunk * chunk)
    print(f"\nestimator cache: {per_frame_vals} values per frame ({n_tf} transformer blocks x K,V x "
          f"{est.num_heads * est.attention_head_dim} x 2 CFG rows x {cfm.n_timesteps} steps) = "
          f"{per_frame_vals * 2 / 2**20:.2f} MiB/frame in bf16/fp16, {per_frame_vals * 4 / 2**20:.2f} MiB in fp32;")
    if args.prefix is not None:  # no per-stream cache: one pool slot per voice
        peak = args.prefix // chunk * chunk
        print(f"one voice's prefix slot in the pool: {peak} frames = {peak * per_frame_vals * 2 / 2**30:.2f} GiB "
              f"(bf16), {peak * per_frame_vals * 4 / 2**30:.2f} GiB (fp32); no per-stream cache")
    else:
        print(f"this stream's largest cache: {peak} frames = {peak * per_frame_vals * 2 / 2**30:.2f} GiB (bf16), "
              f"{peak * per_frame_vals * 4 / 2**30:.2f} GiB (fp32)")


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# CosyVoice3 on one GPU (issue 20): `serve --random-weights benchmarks/configs/cosyvoice3-0.5b.yaml` (the CV3-0.5B
# architecture, random weights, ratio pinned), streaming at LEVELS clients (>= 3 requests each) with the voice `default`
# (the shipped prompt behind upstream's default instruction), then offline at OFFLINE clients, then a steady-state
# capacity run (`bench --capacity` at CAPACITY_LEVELS concurrent streams, 0 stalls, p99 chunk gap <= 500 ms, then 2x
# overload; as benchmarks/session_capacity.sh does for the CosyVoice2 paths; CAPACITY_LEVELS= skips it).
# Usage: benchmarks/cv3_bench.sh OUT   (env: LEVELS 1,4,8, OFFLINE 32, RATIO 6, DTYPE bfloat16, CAPACITY_LEVELS
# 8,16,32,48,64, MAX_ACTIVE 64, SERVE_ARGS; e.g. SERVE_ARGS="--flow-stream-cache on" for the A/B of the per-stream DiT
# cache, which the default `auto` leaves off while the flow runs as CUDA graphs; SAMPLE_STACKS=1: the scheduler thread's
# stacks per level, benchmarks/stack_sampler.py; RAMP_S: each capacity level's clients start over RAMP_S seconds,
# `bench --ramp-s`, default 0 = all at once, as benchmarks/capacity_startup.sh; PLAYBACK=1: the capacity levels' clients
# listen, `bench --playback`; ADMISSION_TRACE=1: the server records OUT/admission.jsonl.gz (complete once the server has
# stopped, after this script: then `benchmarks/admission_replay.py TRACE --batches` tabulates its token2wav batches
# and scheduler gaps). Needs .whl.
# The server runs with --strict-min-len: with random weights CosyVoice3's upstream min-length mask (it masks sos, not
# the 200 stop ids) ends most utterances after ~30 tokens whatever the ratio, which made requests ~1.2 s long.
set -u
cd "$(dirname "$0")/.."
. benchmarks/_stop_server.sh
OUTDIR=${1:-bench_cv3_out}; LEVELS=${LEVELS:-1,4,8}; OFFLINE=${OFFLINE:-32}; RATIO=${RATIO:-6}; DTYPE=${DTYPE:-bfloat16}
CAPACITY_LEVELS=${CAPACITY_LEVELS-8,16,32,48,64}; MAX_ACTIVE=${MAX_ACTIVE:-64}
mkdir -p "$OUTDIR"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/cosyserve-site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/cosyserve-site:$PWD PYTHONUNBUFFERED=1 COSYSERVE_CACHE_DIR=/tmp/cosyserve-cache
CS="python3 -m cosyserve.cli"
t0=$(date +%s)
# SAMPLE_STACKS=1: the server runs under benchmarks/stack_sampler.py; the streaming and offline levels then print where
# the scheduler thread (cosyserve-engine) spent its time (the sampler costs throughput: read the shares, not the figures)
PREFIX=($CS)
[ "${SAMPLE_STACKS:-0}" = 1 ] && PREFIX=(python3 benchmarks/stack_sampler.py --out "$OUTDIR/stacks.txt" --interval-ms 5 -- -m cosyserve.cli)
stacks() {  # stacks LABEL SINCE: the scheduler thread's stacks from SINCE (seconds after the start) to now
  [ "${SAMPLE_STACKS:-0}" = 1 ] || return 0
  sleep 6
  echo "-- scheduler thread stacks during $1 (inclusive share of samples)"
  python3 benchmarks/stack_sampler.py --report "$OUTDIR/stacks.txt" --since "$2" --until "$(( $(date +%s) - t0 ))" \
    --thread cosyserve-engine --top "${STACKS_TOP:-40}" | cut -c1-190
}
TRACE_ARGS=(); [ "${ADMISSION_TRACE:-0}" = 1 ] && TRACE_ARGS=(--admission-trace "$OUTDIR/admission.jsonl.gz")
LISTEN=; [ "${PLAYBACK:-0}" = 1 ] && LISTEN=--playback
"${PREFIX[@]}" serve "${TRACE_ARGS[@]}" --graphs-before-ready --random-weights benchmarks/configs/cosyvoice3-0.5b.yaml --qwen-config benchmarks/configs/CosyVoice-BlankEN-config.json \
  --device cuda --dtype "$DTYPE" --min-token-text-ratio "$RATIO" --max-token-text-ratio "$RATIO" --max-active-streams "$MAX_ACTIVE" \
  --max-queue 256 --strict-min-len --voices-dir /tmp/cosyserve-voices-cv3 --port 8000 --grpc-port 8001 ${SERVE_ARGS:-} >"$OUTDIR/server.log" 2>&1 &
SERVER=$!; trap 'stop_and_wait $SERVER' EXIT
until python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:8000/v2/health/ready', timeout=2).status_code != 200)" 2>/dev/null; do
  kill -0 $SERVER 2>/dev/null || { echo "server exited"; tail -30 "$OUTDIR/server.log"; exit 1; }; sleep 1; done
echo "== CosyVoice3 server ready in $(( $(date +%s) - t0 )) s ($(nvidia-smi --query-gpu=name --format=csv,noheader))"
URL=(--url grpc://127.0.0.1:8001 --metrics-url http://127.0.0.1:8000/metrics --no-progress --voice default)
S0=$(( $(date +%s) - t0 ))
$CS bench "${URL[@]}" --concurrency "$LEVELS" --warmup 2 --out "$OUTDIR/streaming" 2>&1 | grep -v "^$" | head -12
stacks "streaming at $LEVELS clients" "$S0"
S0=$(( $(date +%s) - t0 ))
$CS bench "${URL[@]}" --mode offline --concurrency "$OFFLINE" --requests-per-level $((OFFLINE * 3)) --warmup 0 \
  --out "$OUTDIR/offline" 2>&1 | grep -v "^$" | head -12
stacks "offline at $OFFLINE clients" "$S0"
if [ -n "$CAPACITY_LEVELS" ]; then
  echo "== capacity (voice default, 0 stalls, p99 <= 500 ms, ramp ${RAMP_S:-0} s), then 2x overload"
  $CS bench "${URL[@]}" --capacity --concurrency "$CAPACITY_LEVELS" --max-streams "$MAX_ACTIVE" --p99-bound-ms 500 \
    --min-requests-per-client 3 --overload 2 --ramp-s "${RAMP_S:-0}" --warmup 0 $LISTEN --out "$OUTDIR/capacity" 2>&1 \
    | tail -40
  grep -m3 -i "capacity" "$OUTDIR/server.log"
fi
echo "== token2wav stage times (server /metrics)"
python3 - <<'PY' 2>/dev/null || true
import httpx
keep = ("cosyserve_stage_seconds_sum", "cosyserve_stage_seconds_count", "cosyserve_token2wav_batch_size_sum",
        "cosyserve_token2wav_batch_size_count")
print("\n".join(l for l in httpx.get("http://127.0.0.1:8000/metrics", timeout=5).text.splitlines() if l.startswith(keep)))
PY
# the device tool brings back at most 8 files: the plots go, the reports and logs stay
rm -f "$OUTDIR"/*/bench.png

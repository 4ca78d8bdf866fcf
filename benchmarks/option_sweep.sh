#!/usr/bin/env bash
# One `cosyserve serve` option, several values: per value, start the server (random weights,
# full-size architecture, bf16), warm up, then bench 8 and 32 streams and offline at 64 clients
# over KServe gRPC (about 2 minutes per value on one H100, most of it the start-up graph capture).
#
# Usage:  OPTION=--t2w-queue-steps VALUES="2 1" benchmarks/option_sweep.sh [OUT_DIR]
#   (default $OUT if set, else benchmarks/results/sweep-<option>-<UTC time>; the tables also go to
#   OUT_DIR/sweep.log)
# env: OFFLINE_REQUESTS (512: 8 per client, so the in-flight throughput has a steady middle)
# (install the carried wheels first, as benchmarks/gpu.sh does; docs/perf-history.md run 26 used it)
set -u
cd "$(dirname "$0")/.."
OUTDIR=${1:-${OUT:-benchmarks/results/sweep${OPTION#-}-$(date -u +%Y%m%d-%H%M%S)}}
mkdir -p "$OUTDIR"
exec > >(tee -a "$OUTDIR/sweep.log") 2>&1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 COSYSERVE_CACHE_DIR=${COSYSERVE_CACHE_DIR:-/tmp/cosyserve-cache}
CS="python3 -m cosyserve.cli"
MODEL=(--random-weights benchmarks/configs/cosyvoice2-0.5b.yaml --qwen-config benchmarks/configs/CosyVoice-BlankEN-config.json
       --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}" --min-token-text-ratio 6 --max-token-text-ratio 6)
URL=(--url grpc://127.0.0.1:8001 --metrics-url http://127.0.0.1:8000/metrics --voice default --no-progress)
for V in $VALUES; do
  echo "=== $OPTION $V"
  $CS serve --graphs-before-ready "${MODEL[@]}" --max-active-streams 64 --max-queue 256 --chunk-policy exponential \
    --voices-dir /tmp/cosyserve-voices --port 8000 --grpc-port 8001 "$OPTION" "$V" > "$OUTDIR/server-$V.log" 2>&1 &
  S=$!
  python3 -c "
import time, httpx
for _ in range(400):
    try:
        if httpx.get('http://127.0.0.1:8000/v2/health/ready', timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
else:
    raise SystemExit('server did not start')
" || { tail -20 "$OUTDIR/server-$V.log"; kill $S; exit 1; }
  $CS bench "${URL[@]}" --concurrency 8,32 --requests-per-level 24 --warmup 0 --out "$OUTDIR/warm-$V" >/dev/null
  $CS bench "${URL[@]}" --mode offline --concurrency 64 --requests-per-level 64 --warmup 0 --out "$OUTDIR/warm-off-$V" >/dev/null
  $CS bench "${URL[@]}" --concurrency 8,32 --out "$OUTDIR/streaming-$V" | grep "^| "
  $CS bench "${URL[@]}" --mode offline --concurrency 64 --requests-per-level "${OFFLINE_REQUESTS:-512}" --out "$OUTDIR/offline-$V" | grep "^| "
  kill -TERM $S; wait $S 2>/dev/null
done

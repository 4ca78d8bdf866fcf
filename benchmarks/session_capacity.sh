#!/usr/bin/env bash
# One GPU call: the UNet server with full-size random weights AND a full-size frontend (per-request prompts pay the real
# S3 tokenizer / CAM++ cost), admission auto; per-request-prompt and cached-voice streaming at LEVELS (>= 3 requests per
# client), then `bench --capacity` (cached voice). Usage: benchmarks/session_capacity.sh OUT  (env: LEVELS, RATIO,
# CAPACITY_LEVELS, SERVE_ARGS, TOKEN2WAV_DIR for the DiT path). Needs .whl (benchmarks/fetch_wheels.sh).
set -u
cd "$(dirname "$0")/.."
. benchmarks/_stop_server.sh
OUTDIR=${1:-bench_cap_out}; LEVELS=${LEVELS:-1,8,32}; RATIO=${RATIO:-6}; CAPACITY_LEVELS=${CAPACITY_LEVELS:-16,32,48,64,96}
mkdir -p "$OUTDIR"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/cosyserve-site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/cosyserve-site:$PWD PYTHONUNBUFFERED=1 COSYSERVE_CACHE_DIR=/tmp/cosyserve-cache
CS="python3 -m cosyserve.cli"
EXTRA=(); [ -n "${TOKEN2WAV_DIR:-}" ] && EXTRA=(--token2wav-dir "$TOKEN2WAV_DIR")
t0=$(date +%s)
$CS serve --graphs-before-ready --random-weights benchmarks/configs/cosyvoice2-0.5b.yaml --qwen-config benchmarks/configs/CosyVoice-BlankEN-config.json \
  --full-size-frontend --prompt-cache 0 --device cuda --dtype bfloat16 --min-token-text-ratio "$RATIO" --max-token-text-ratio "$RATIO" \
  --max-active-streams ${MAX_ACTIVE:-128} --max-queue 512 --chunk-policy exponential --voices-dir /tmp/cosyserve-voices --port 8000 --grpc-port 8001 \
  "${EXTRA[@]}" ${SERVE_ARGS:-} >"$OUTDIR/server.log" 2>&1 &
SERVER=$!; trap 'stop_and_wait $SERVER' EXIT
until python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:8000/v2/health/ready', timeout=2).status_code != 200)" 2>/dev/null; do
  kill -0 $SERVER 2>/dev/null || { echo "server exited"; tail -30 "$OUTDIR/server.log"; exit 1; }; sleep 1; done
echo "== ready in $(( $(date +%s) - t0 )) s ($(nvidia-smi --query-gpu=name --format=csv,noheader), commit $(git rev-parse --short HEAD 2>/dev/null))"
URL=(--url grpc://127.0.0.1:8001 --metrics-url http://127.0.0.1:8000/metrics --no-progress)
for what in per-request-prompt cached-voice; do
  v=(); [ $what = cached-voice ] && v=(--voice default)
  echo "== streaming, $what, levels $LEVELS (>= 3 requests per client)"
  $CS bench "${URL[@]}" "${v[@]}" --concurrency "$LEVELS" --warmup 2 --out "$OUTDIR/$what" 2>&1 | grep -v "^$" | tail -25
done
echo "== capacity (cached voice, 0 stalls, p99 <= 500 ms), then 2x overload"
$CS bench "${URL[@]}" --voice default --capacity --concurrency "$CAPACITY_LEVELS" --max-streams ${MAX_ACTIVE:-128} --p99-bound-ms 500 \
  --min-requests-per-client 3 --overload 2 --warmup 0 --out "$OUTDIR/capacity" 2>&1 | tail -40
grep -m3 -i "capacity" "$OUTDIR/server.log"

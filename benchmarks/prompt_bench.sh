#!/usr/bin/env bash
# First-chunk latency with per-request prompts next to cached voices (issue 19), one command:
#
#   1. benchmarks/prompt_probe.py: prompt extraction cost per request (features, batched PyTorch
#      speech tokenizer, CAM++) at B = 1/8/32 on the CPU and CUDA, full-size random weights
#   2. `cosyserve serve --random-weights ... --full-size-frontend --prompt-cache 0`: the full-size
#      networks AND a full-size speech tokenizer (real S3 tokenizer v2 structure, PyTorch on CUDA,
#      batched across requests) and CAM++-sized speaker model; no cache of per-request voices
#   3. `cosyserve bench` over KServe gRPC, streaming, at LEVELS clients: first WITHOUT --voice
#      (every request carries its reference audio: decoding, features, tokenizer and CAM++ are
#      inside the first-chunk latency), then with --voice default (cached voice), same server
#
# Usage:  benchmarks/prompt_bench.sh [OUT_DIR]
#   env: LEVELS (1,8,32), RATIO (6), DTYPE (bfloat16), REQUESTS (64 per level), NO_WHEELS=1, SKIP_PROBE=1,
#        SERVE_ARGS (extra `cosyserve serve` options)
# Needs the wheels of benchmarks/fetch_wheels.sh in .whl/ on the GPU machine (as benchmarks/gpu.sh).
set -u
cd "$(dirname "$0")/.."
. benchmarks/_stop_server.sh
OUTDIR=${1:-${OUT:-bench_prompt_out}}
LEVELS=${LEVELS:-1,8,32}
RATIO=${RATIO:-6}
DTYPE=${DTYPE:-bfloat16}
REQUESTS=${REQUESTS:-64}
YAML=${YAML:-benchmarks/configs/cosyvoice2-0.5b.yaml}
QWEN_CONFIG=${QWEN_CONFIG:-benchmarks/configs/CosyVoice-BlankEN-config.json}
mkdir -p "$OUTDIR"
if [ -z "${NO_WHEELS:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/cosyserve-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/cosyserve-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 COSYSERVE_CACHE_DIR=${COSYSERVE_CACHE_DIR:-/tmp/cosyserve-cache}
CS="python3 -m cosyserve.cli"

if [ -z "${SKIP_PROBE:-}" ]; then
  echo "== prompt extraction probe"
  python3 benchmarks/prompt_probe.py --reps 5 2>&1 | tee "$OUTDIR/prompt_probe.md"
fi

$CS serve --graphs-before-ready --random-weights "$YAML" --qwen-config "$QWEN_CONFIG" --full-size-frontend --device cuda --dtype "$DTYPE" \
  --min-token-text-ratio "$RATIO" --max-token-text-ratio "$RATIO" --max-active-streams 64 --max-queue 256 \
  --chunk-policy exponential --prompt-cache 0 --voices-dir /tmp/cosyserve-voices --port 8000 --grpc-port 8001 \
  ${SERVE_ARGS:-} >"$OUTDIR/server.log" 2>&1 &
SERVER=$!
trap 'stop_and_wait $SERVER' EXIT
for _ in $(seq 1200); do
  kill -0 $SERVER 2>/dev/null || { echo "server exited:"; tail -30 "$OUTDIR/server.log"; exit 1; }
  python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:8000/v2/health/ready', timeout=2).status_code != 200)" \
    2>/dev/null && break
  sleep 0.5
done
echo "== server ready; tokenizer backend: $(grep -m1 -o 'speech tokenizer .*' "$OUTDIR/server.log" || echo '(not logged)')"

for what in per-request-prompt cached-voice; do
  extra=(); [ "$what" = cached-voice ] && extra=(--voice default)
  echo "== streaming, $what, levels $LEVELS"
  $CS bench --url grpc://127.0.0.1:8001 --protocol grpc --mode streaming --concurrency "$LEVELS" \
    --requests-per-level "$REQUESTS" --warmup 4 --no-progress "${extra[@]}" --out "$OUTDIR/$what" \
    2>&1 | tee "$OUTDIR/$what.log"
done

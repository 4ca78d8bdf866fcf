#!/usr/bin/env bash
# The whole GPU benchmark of docs/perf.md in one command (about 8.5 minutes on one H100):
#
#   1. install the wheels carried in .whl/ (the GPU machine lacks fastapi, uvicorn, tritonclient, ...;
#      benchmarks/fetch_wheels.sh downloads them here)
#   2. start `cosyserve serve --random-weights` (full-size CosyVoice2-0.5B architecture from
#      benchmarks/configs/cosyvoice2-0.5b.yaml, random weights, bf16, output length pinned to
#      RATIO speech tokens per text token because random weights never choose to stop)
#   3. start-up (issue 18): time to ready, time until the background capture has every CUDA graph,
#      first-chunk latency of requests sent meanwhile (benchmarks/startup_probe.py; a STARTUP line,
#      OUT_DIR/startup*.json), then warm it up (requests over the levels' shapes, not counted)
#   4. `cosyserve bench` over KServe gRPC: streaming at 1/2/4/8/16/32 clients with the Triton
#      runtime's exponential schedule (15-token first hop), 1 client with the upstream schedule,
#      offline at 64 clients; every level with the engine's stage breakdown from /metrics, and a
#      steady state (at least 3 requests per client, back to back; `bench --min-requests-per-client`)
#   5. the capacity (issue 17): `bench --capacity`, the most concurrent streams with 0 stalls and
#      first-chunk p99 <= P99_BOUND_MS, 3 requests per client per level (ladder CAPACITY_LEVELS,
#      then bisection), then an overload level at 2x that capacity: stalls among the streams that
#      ran and whether queued requests started in arrival order (the server's /metrics)
#   6. with TOKEN2WAV_DIR (a DiT token2wav directory; `serve --token2wav-dir`), a server on that
#      token2wav path and step 5 again (skipped with a note if this cosyserve has no
#      --token2wav-dir); DIT=1 asks for it too and needs TOKEN2WAV_DIR
#   7. the same streaming and offline workload on the in-process engine (no HTTP/gRPC), so the
#      serving overhead is the difference
#
# Usage:  benchmarks/gpu.sh [OUT_DIR]    (default $OUT if set, else benchmarks/results/gpu-sh-<UTC time>)
#   env: RATIO (6), LEVELS (1,2,4,8,16,32), OFFLINE_REQUESTS (512), DTYPE (bfloat16), DEVICE (cuda), YAML, QWEN_CONFIG,
#        SKIP_IN_PROCESS=1, NO_WHEELS=1 (use the installed packages), COSYSERVE_COMMIT (default: git),
#        SERVE_ARGS (extra `cosyserve serve` options, e.g. --token2wav-thread), MAX_ACTIVE (64), ADMISSION (auto),
#        P99_BOUND_MS (500), CAPACITY_LEVELS (8,16,32,48,64), CAPACITY_MAX (MAX_ACTIVE), SKIP_CAPACITY=1,
#        ONLY_CAPACITY=1 (skip steps 4 and 7), TOKEN2WAV_DIR, DIT=1, PLAYBACK=1 (capacity clients listen: `bench
#        --playback`, each plays its streams in real time, so N clients are N concurrent real-time streams)
# Tables go to stdout (a copy in OUT_DIR/gpu-sh.log) and OUT_DIR/*/report.md; server log in
# OUT_DIR/server.log. Logs worth keeping are committed as benchmarks/results/<gpu>-gpu-sh-<run>.log.
set -u
cd "$(dirname "$0")/.."
. benchmarks/_stop_server.sh
OUTDIR=${1:-${OUT:-benchmarks/results/gpu-sh-$(date -u +%Y%m%d-%H%M%S)}}
RATIO=${RATIO:-6}
LEVELS=${LEVELS:-1,2,4,8,16,32}
# offline: 8 requests per client, so that the in-flight figure (Little's law over the requests
# that ran while all 64 had one in flight, `cosyserve bench`) has a steady middle to measure
OFFLINE_REQUESTS=${OFFLINE_REQUESTS:-512}
DTYPE=${DTYPE:-bfloat16}
MAX_ACTIVE=${MAX_ACTIVE:-64}
ADMISSION=${ADMISSION:-auto}
P99_BOUND_MS=${P99_BOUND_MS:-500}
CAPACITY_LEVELS=${CAPACITY_LEVELS:-8,16,32,48,64}
CAPACITY_MAX=${CAPACITY_MAX:-$MAX_ACTIVE}
DEVICE=${DEVICE:-cuda}
YAML=${YAML:-benchmarks/configs/cosyvoice2-0.5b.yaml}
QWEN_CONFIG=${QWEN_CONFIG:-benchmarks/configs/CosyVoice-BlankEN-config.json}
mkdir -p "$OUTDIR"
exec > >(tee -a "$OUTDIR/gpu-sh.log") 2>&1
T_START=$(date +%s)

if [ -z "${NO_WHEELS:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/cosyserve-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/cosyserve-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 COSYSERVE_CACHE_DIR=${COSYSERVE_CACHE_DIR:-/tmp/cosyserve-cache}
python3 -c "import fastapi, uvicorn, multipart, pydantic, tritonclient.grpc, soundfile, cosyserve.server.app" || {
  echo "missing Python packages (carry them as wheels in .whl/, see the device notes)"; exit 1; }
CS="python3 -m cosyserve.cli"
MODEL=(--random-weights "$YAML" --qwen-config "$QWEN_CONFIG" --device "$DEVICE" --dtype "$DTYPE")
PIN=(--min-token-text-ratio "$RATIO" --max-token-text-ratio "$RATIO")
BENCH=(--voice default --no-progress)

echo "== serve options: ${SERVE_ARGS:-(defaults)}"
echo "== machine: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null)," \
     "$(python3 -c 'import torch; print("torch", torch.__version__)'), commit ${COSYSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"

# start_server LOG [extra serve options...]: start `cosyserve serve` in the background and wait until ready
start_server() {
  local log=$1; shift
  $CS serve "${MODEL[@]}" "${PIN[@]}" --max-active-streams "$MAX_ACTIVE" --max-queue 256 --chunk-policy exponential \
    --admission "$ADMISSION" --voices-dir /tmp/cosyserve-voices --port 8000 --grpc-port 8001 ${SERVE_ARGS:-} "$@" \
    >"$log" 2>&1 &
  SERVER=$!
  trap 'stop_and_wait $SERVER' EXIT
  t0=$(date +%s)
  T0=$(date +%s.%N)
  SERVER_PID=$SERVER python3 - <<'EOF' || { echo "server did not start:"; tail -30 "$log"; exit 1; }
import os, time, httpx
for _ in range(3000):
    try:
        with open(f"/proc/{os.environ['SERVER_PID']}/stat") as f:  # exited (zombie or gone)?
            if f.read().rsplit(")", 1)[1].split()[0] in "ZX":
                raise SystemExit(1)
    except OSError:
        raise SystemExit(1)
    try:
        if httpx.get("http://127.0.0.1:8000/v2/health/ready", timeout=2).status_code == 200:
            raise SystemExit(0)
    except httpx.HTTPError:
        pass
    time.sleep(0.1)
raise SystemExit(1)
EOF
  echo "== server ready in $(( $(date +%s) - t0 )) s"
}

# startup JSON: start-up figures of the server just started (waits until every graph is captured)
startup() {
  echo "== start-up: ready, all CUDA graphs captured, first chunks during the capture"
  python3 benchmarks/startup_probe.py --since "$T0" --pid "$SERVER" --json "$1" || exit 1
}

stop_server() {
  kill -TERM $SERVER; wait $SERVER 2>/dev/null
  trap - EXIT
}

URL=(--url grpc://127.0.0.1:8001 --metrics-url http://127.0.0.1:8000/metrics)
# warm_up DIR: requests that capture every flow/HiFT bucket the levels reach (not counted)
warm_up() {
  echo "== warm-up (not counted)"
  $CS bench "${URL[@]}" "${BENCH[@]}" --concurrency 1,4,16,32 --requests-per-level 24 --min-requests-per-client 1 \
    --warmup 0 --out "$1/warmup" >/dev/null || exit 1
  $CS bench "${URL[@]}" "${BENCH[@]}" --mode offline --concurrency 64 --requests-per-level 64 \
    --min-requests-per-client 1 --warmup 0 --out "$1/warmup-offline" >/dev/null || exit 1
}

# capacity DIR LABEL: the steady-state capacity search, then the overload level at 2x
capacity() {
  echo "== $2: capacity (0 stalls, first-chunk p99 <= $P99_BOUND_MS ms, 3 requests per client per level), then 2x overload${PLAYBACK:+; clients listen (--playback)}"
  $CS bench "${URL[@]}" "${BENCH[@]}" --capacity --concurrency "$CAPACITY_LEVELS" --max-streams "$CAPACITY_MAX" \
    --p99-bound-ms "$P99_BOUND_MS" --min-requests-per-client 3 --overload 2 --warmup 0 \
    ${PLAYBACK:+--playback} --out "$1" || exit 1
  python3 - "$1/report.json" "$2" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
c = r["capacity"]
ov = c.get("overload") or {}
print(f"CAPACITY {sys.argv[2]}: {c['streams']} streams (first failing level: {c['first_failing']}); "
      f"overload {ov.get('clients', '-')} clients: {ov.get('stalled', '-')} stalled of {ov.get('ok', '-')} that ran, "
      f"{ov.get('failed', '-')} refused/failed, arrival order kept: {ov.get('in_order', '-')}")
EOF
}

echo "== token2wav: UNet flow (the model's)"
start_server "$OUTDIR/server.log"
startup "$OUTDIR/startup.json"
warm_up "$OUTDIR"
if [ -z "${ONLY_CAPACITY:-}" ]; then
  echo "== server, KServe gRPC streaming, exponential schedule (15, 25, 50, ... tokens)"
  $CS bench "${URL[@]}" "${BENCH[@]}" --concurrency "$LEVELS" --out "$OUTDIR/grpc-streaming" || exit 1
  echo "== server, KServe gRPC streaming, upstream schedule (25 + look-ahead, 50, 100)"
  $CS bench "${URL[@]}" "${BENCH[@]}" --concurrency 1 --chunk-policy upstream --out "$OUTDIR/grpc-upstream" || exit 1
  echo "== server, KServe gRPC offline, 64 requests in flight"
  $CS bench "${URL[@]}" "${BENCH[@]}" --mode offline --concurrency 64 --requests-per-level "$OFFLINE_REQUESTS" \
    --out "$OUTDIR/grpc-offline" || exit 1
fi
[ -z "${SKIP_CAPACITY:-}" ] && capacity "$OUTDIR/capacity-unet" "UNet token2wav"
stop_server

if [ -n "${TOKEN2WAV_DIR:-}" ] || [ -n "${DIT:-}" ]; then
  if [ -z "${TOKEN2WAV_DIR:-}" ]; then
    echo "== DiT token2wav: skipped (DIT=1 needs TOKEN2WAV_DIR=<DiT token2wav directory>)"
  elif ! $CS serve --help 2>/dev/null | grep -q -- "--token2wav-dir"; then
    echo "== DiT token2wav: skipped (this cosyserve has no serve --token2wav-dir)"
  elif [ -z "${SKIP_CAPACITY:-}" ]; then
    echo "== token2wav: DiT ($TOKEN2WAV_DIR)"
    start_server "$OUTDIR/server-dit.log" --token2wav-dir "$TOKEN2WAV_DIR"
    startup "$OUTDIR/startup-dit.json"
    warm_up "$OUTDIR/dit"
    capacity "$OUTDIR/capacity-dit" "DiT token2wav"
    stop_server
  fi
fi

if [ -z "${SKIP_IN_PROCESS:-}" ] && [ -z "${ONLY_CAPACITY:-}" ]; then
  echo "== in-process engine, streaming, exponential schedule"
  $CS bench --in-process "${MODEL[@]}" "${PIN[@]}" "${BENCH[@]}" --max-active-streams "$MAX_ACTIVE" \
    --admission "$ADMISSION" --chunk-policy exponential --graphs-before-ready \
    --concurrency "$LEVELS" --warmup 8 --out "$OUTDIR/in-process-streaming" 2>/dev/null || exit 1
fi
echo "== done in $(( $(date +%s) - T_START )) s; reports in $OUTDIR"

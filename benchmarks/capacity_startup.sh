#!/usr/bin/env bash
# One GPU call: start-up of `cosyserve serve` with the default background graph capture (benchmarks/startup_probe.py:
# ready, all graphs captured, first chunks sent during the capture), then the steady-state capacity search
# (`bench --capacity`: >= 3 requests per client per level, 0 stalls, first-chunk p99 <= 500 ms, then 2x overload) on
# the same server. Full-size CosyVoice2-0.5B with random weights, ratio 6, exponential schedule, KServe gRPC, voice
# `default`. PATH_KIND=unet (CosyVoice2 flow) or dit (Step-Audio2 DiT token2wav, full size, built here).
# Usage: benchmarks/capacity_startup.sh OUT  (env: PATH_KIND, CAPACITY_LEVELS, MAX_ACTIVE, SERVE_ARGS, RAMP_S: each
# capacity level's clients start over RAMP_S seconds, `bench --ramp-s`, default 0 = all at once; OFFLINE_CLIENTS: then
# one offline level (whole utterances, KServe gRPC ModelInfer) of that many clients x 3 requests (OFFLINE_REQ="3 6":
# one level per count, e.g. 6 requests each for a longer steady state); CHUNK_POLICY:
# default exponential for unet, the DiT path's own default (15 tokens, then 25-token hops) for dit; ONE_STREAM=N: first
# N requests from one client after the warm-up, the first-chunk table at 1 stream; CAPACITY_LEVELS= (empty) skips the
# capacity search; STREAM_CLIENTS=N[,M..]: plain streaming levels of N (M, ..) clients x 3 requests;
# STREAM_VOICE: the voice of the STREAM_CLIENTS levels (default `default`; empty: each item's own prompt audio, sent
# with every request, e.g. to exercise --flow-stream-cache prefix builds while serving);
# SAMPLE_STACKS=1: the scheduler thread's stacks per level, benchmarks/stack_sampler.py; PLAYBACK=1: the capacity and
# streaming levels' clients listen, `bench --playback`: each plays its streams in real time and sends the next request
# when the audio has played, so N clients are N concurrent real-time streams; MIN_REQ: requests per client per
# capacity level, default 3; OVERLOAD: the overload factor after the capacity search, default 2, 0 skips it;
# CAPACITY_TOL: `bench --capacity-tolerance`, default 0.1 (0.5 ends a failing search after two bisection levels);
# SWEEP: admission settings, JSON objects separated by ';', one capacity search each on the same server, see below).
# Needs .whl.
set -u
cd "$(dirname "$0")/.."
. benchmarks/_stop_server.sh
OUTDIR=${1:-capacity_startup_out}; KIND=${PATH_KIND:-unet}; RATIO=${RATIO:-6}
CAPACITY_LEVELS=${CAPACITY_LEVELS-32,48,64,96}; MAX_ACTIVE=${MAX_ACTIVE:-128}
mkdir -p "$OUTDIR"
. benchmarks/_full_size_server.sh
full_size_setup "$KIND" || exit 1
CS="python3 -m cosyserve.cli"
POLICY=${CHUNK_POLICY-exponential}
LISTEN=; [ "${PLAYBACK:-0}" = 1 ] && LISTEN=--playback
[ "$KIND" = dit ] && POLICY=${CHUNK_POLICY-}
T0=$(date +%s.%N)
# SAMPLE_STACKS=1: the server runs under benchmarks/stack_sampler.py; each level below then prints where the
# scheduler thread (cosyserve-engine) spent its time during that level (the sampler takes the GIL every 5 ms and costs
# throughput and stalls: read the shares, not the figures of such a run)
if [ "${SAMPLE_STACKS:-0}" = 1 ]; then
  SERVE_PREFIX=(python3 benchmarks/stack_sampler.py --out "$OUTDIR/stacks.txt" --interval-ms 5 -- -m cosyserve.cli)
fi
since() { python3 -c "import time; print(int(time.time() - $T0))"; }
stacks() {  # stacks LABEL SINCE: the scheduler thread's stacks from SINCE to now
  [ "${SAMPLE_STACKS:-0}" = 1 ] || return 0
  sleep 6  # the sampler writes its file every few seconds
  echo "-- scheduler thread stacks during $1 (inclusive share of samples)"
  python3 benchmarks/stack_sampler.py --report "$OUTDIR/stacks.txt" --since "$2" --until "$(since)" \
    --thread cosyserve-engine --top "${STACKS_TOP:-40}" | cut -c1-190
}
# ADMISSION_TRACE=1: the server records its capacity model into $OUTDIR/admission.jsonl.gz (replay it into other
# admission settings with benchmarks/admission_replay.py)
TRACE_ARGS=(); [ "${ADMISSION_TRACE:-0}" = 1 ] && TRACE_ARGS=(--admission-trace "$OUTDIR/admission.jsonl.gz")
full_size_serve "$OUTDIR/server.log" --min-token-text-ratio "$RATIO" --max-token-text-ratio "$RATIO" \
  --max-active-streams "$MAX_ACTIVE" --max-queue 512 ${POLICY:+--chunk-policy "$POLICY"} "${TRACE_ARGS[@]}" \
  ${SERVE_ARGS:-}
trap 'stop_and_wait $SERVER' EXIT
echo "== $KIND: $(nvidia-smi --query-gpu=name --format=csv,noheader), serve options: ${SERVE_ARGS:-(defaults)}"
python3 benchmarks/startup_probe.py --since "$T0" --url http://127.0.0.1:8000 --pid "$SERVER" \
  --json "$OUTDIR/startup.json" 2>&1 | tail -6
if ! kill -0 "$SERVER" 2>/dev/null; then  # (died at start: do not spend the device call waiting on it)
  echo "== the server exited; its log ends:"; tail -40 "$OUTDIR/server.log"; exit 1
fi
# SKIP_WARMUP=1: no warm-up levels (every graph captured before ready: UNet with --graphs-before-ready)
if [ "${SKIP_WARMUP:-0}" != 1 ]; then
  echo "== warm-up (not counted): lazily captured graphs (the DiT solves) get captured here"
  $CS bench --url grpc://127.0.0.1:8001 --no-progress --voice default --concurrency 1,4,16,32 --requests-per-level 24 \
    --min-requests-per-client 1 --warmup 0 --out "$OUTDIR/warmup" >/dev/null 2>&1
fi
if [ -n "${ONE_STREAM:-}" ]; then
  echo "== one stream: $ONE_STREAM requests back to back (first-chunk latency at 1 stream, client side)"
  $CS bench --url grpc://127.0.0.1:8001 --metrics-url http://127.0.0.1:8000/metrics --no-progress --voice default \
    --concurrency 1 --requests-per-level "$ONE_STREAM" --warmup 2 --out "$OUTDIR/one" 2>&1 | grep -A3 "^| clients"
fi
if [ -n "${STREAM_CLIENTS:-}" ]; then
  SVOICE=${STREAM_VOICE-default}
  echo "== streaming: $STREAM_CLIENTS clients x 3 requests (ramp ${RAMP_S:-0} s), voice ${SVOICE:-per item}"
  S0=$(since)
  $CS bench --url grpc://127.0.0.1:8001 --metrics-url http://127.0.0.1:8000/metrics --no-progress \
    ${SVOICE:+--voice "$SVOICE"} \
    --concurrency "$STREAM_CLIENTS" --min-requests-per-client 3 --ramp-s "${RAMP_S:-0}" --warmup 0 $LISTEN \
    --out "$OUTDIR/stream" 2>&1 | grep -A8 "^| clients"
  stacks "streaming at $STREAM_CLIENTS clients" "$S0"
  python3 benchmarks/first_chunk_tail.py "$OUTDIR/server.log" --min-requests 60 > "$OUTDIR/stream/first_chunk_tail.md"
fi
if [ -n "$CAPACITY_LEVELS" ]; then
  # SWEEP='{"lm_alone": true};{"lm_alone": false, "mode": "off"}': one capacity search per admission setting on this
  # server (PATCH /admin/admission before each; reports in OUT/capacity-0, -1, ...): no restart, no graph capture.
  # An entry's "reset": true (or "calibrate") first makes the capacity model forget its measurements (POST
  # /admin/admission/reset, then the start-up calibration again): several fresh-server first ramps on one start,
  # e.g. SWEEP='{"reset": true};{"reset": "calibrate"};{"reset": true};{"reset": "calibrate"}'
  IFS=';' read -r -a SETTINGS <<< "${SWEEP:-}"
  [ ${#SETTINGS[@]} -gt 0 ] || SETTINGS=("")
  i=0
  for SET in "${SETTINGS[@]}"; do
    CDIR="$OUTDIR/capacity"; [ -n "${SWEEP:-}" ] && CDIR="$OUTDIR/capacity-$i"; i=$((i + 1))
    if [ -n "$SET" ]; then
      echo "== admission settings: $SET"
      python3 -c 'import json, sys, urllib.request as u
def call(path, method, body):
    r = u.Request("http://127.0.0.1:8000" + path, data=json.dumps(body).encode(), method=method,
                  headers={"Content-Type": "application/json"})
    print(u.urlopen(r, timeout=60).read().decode())
s = json.loads(sys.argv[1])
reset = s.pop("reset", False)
if reset:
    call("/admin/admission/reset", "POST", {"calibrate": reset == "calibrate"})
if s:
    call("/admin/admission", "PATCH", s)' "$SET" || { echo "== cannot apply $SET"; continue; }
      sleep 1
    fi
    L0=$(wc -l < "$OUTDIR/server.log")
    echo "== capacity (voice default, 0 stalls, p99 <= 500 ms), then 2x overload${LISTEN:+; clients listen}"
    $CS bench --url grpc://127.0.0.1:8001 --metrics-url http://127.0.0.1:8000/metrics --no-progress --voice default \
      --capacity --concurrency "$CAPACITY_LEVELS" --max-streams "$MAX_ACTIVE" --p99-bound-ms 500 \
      --capacity-tolerance "${CAPACITY_TOL:-0.1}" --min-requests-per-client "${MIN_REQ:-3}" \
      --overload "${OVERLOAD:-2}" --ramp-s "${RAMP_S:-0}" --warmup 0 \
      $LISTEN --out "$CDIR" 2>&1 | tail -30
    # per level and 2-s arrival window: first chunk and its engine phases, and the slowest requests' phases
    tail -n +"$((L0 + 1))" "$OUTDIR/server.log" > "$CDIR/server_part.log"
    python3 benchmarks/first_chunk_tail.py "$CDIR/server_part.log" --min-requests 60 --report "$CDIR/report.json" \
      > "$CDIR/first_chunk_tail.md"
    rm -f "$CDIR/server_part.log"
  done
fi
for OREQ in ${OFFLINE_REQ:-3}; do
  [ -n "${OFFLINE_CLIENTS:-}" ] || break
  echo "== offline throughput: $OFFLINE_CLIENTS clients x $OREQ requests"
  S0=$(since)
  $CS bench --url grpc://127.0.0.1:8001 --metrics-url http://127.0.0.1:8000/metrics --no-progress --voice default \
    --mode offline --concurrency "$OFFLINE_CLIENTS" --min-requests-per-client "$OREQ" --warmup 0 \
    --out "$OUTDIR/offline$([ "$OREQ" = 3 ] || echo "-$OREQ")" 2>&1 | grep -A3 "^| clients"
  stacks "offline at $OFFLINE_CLIENTS clients" "$S0"
done
grep -i "capacity estimate" "$OUTDIR/server.log" | tail -3
grep "admission calibration" "$OUTDIR/server.log" | cut -c1-260  # serve --admission-calibrate: the steps alone
# prefix mode (the UNet default with CUDA graphs): the voices' prefixes built at start-up (engine thread) and while
# serving (the prefix pool's worker thread)
grep -E "event=prefix_(pre)?build" "$OUTDIR/server.log" | cut -c1-220 | head -12
grep -c "event=prefix_build " "$OUTDIR/server.log" | sed 's/^/prefix builds in all: /'
grep -E "event=prefix_build_failed" "$OUTDIR/server.log" | cut -c1-220 | head -3
grep -i "graphs\b.*captured\|captured .* graph buckets" "$OUTDIR/server.log" | tail -3
if [ ${#TRACE_ARGS[@]} -gt 0 ]; then
  stop_and_wait "$SERVER"  # the server closes its admission trace on the way out
  ls -l "$OUTDIR/admission.jsonl.gz"
  python3 benchmarks/admission_replay.py "$OUTDIR/admission.jsonl.gz" --bucket 10 | tail -1
fi
# the device tool brings back at most 8 files: the plots go, the reports and logs stay
rm -f "$OUTDIR"/*/bench.png

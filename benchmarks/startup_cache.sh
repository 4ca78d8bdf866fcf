#!/usr/bin/env bash
# Start-up of `cosyserve serve` twice in a row with the same compile cache (issue 18): the first start compiles the
# fused kernels into an empty --compile-cache, the second (a restart) loads them. Each start is measured by
# benchmarks/startup_probe.py (ready, all CUDA graphs captured, first chunks of requests sent meanwhile).
# Full-size CosyVoice2-0.5B with random weights (PATH_KIND=unet) or + the Step-Audio2 DiT token2wav (PATH_KIND=dit).
# Usage: benchmarks/startup_cache.sh OUT  (env: PATH_KIND, SERVE_ARGS (default: serve's, background capture), STARTS (default 2),
# SAMPLE_STACKS=1: run each server under benchmarks/stack_sampler.py, OUT/stacks-N.txt, summarised up to ready).
# PYC_CACHE=0: without a Python bytecode cache (benchmarks/_full_size_server.sh). Needs .whl (docs/perf.md "How to reproduce").
set -u
cd "$(dirname "$0")/.."
OUTDIR=${1:-startup_cache_out}; KIND=${PATH_KIND:-unet}; STARTS=${STARTS:-2}
SERVE_ARGS=${SERVE_ARGS:-}
mkdir -p "$OUTDIR"
. benchmarks/_full_size_server.sh
full_size_setup "$KIND" || exit 1
CACHE=/tmp/cosyserve-compile-$$; rm -rf "$CACHE"
echo "== $KIND: $(nvidia-smi --query-gpu=name --format=csv,noheader), serve options: ${SERVE_ARGS:-(defaults)}, compile cache $CACHE (empty)"
for i in $(seq 1 "$STARTS"); do
  T0=$(date +%s.%N)
  SERVE_PREFIX=()
  [ "${SAMPLE_STACKS:-0}" = 1 ] && SERVE_PREFIX=(python3 benchmarks/stack_sampler.py --out "$OUTDIR/stacks-$i.txt" --max-s "${SAMPLE_S:-100}" -- -m cosyserve.cli)
  full_size_serve "$OUTDIR/server-$i.log" --min-token-text-ratio 6 --max-token-text-ratio 6 --max-active-streams 64 \
    --chunk-policy exponential --compile-cache "$CACHE" $SERVE_ARGS
  echo "== start $i ($( [ "$i" = 1 ] && echo 'empty compile cache' || echo 'restart: compile cache filled'))"
  python3 benchmarks/startup_probe.py --since "$T0" --url http://127.0.0.1:8000 --pid "$SERVER" --json "$OUTDIR/startup-$i.json" 2>&1 | tail -5
  grep -E "primed|captured [0-9]+ CUDA graph buckets|failed|ready event" "$OUTDIR/server-$i.log" | cut -c1-400 | tail -6
  kill $SERVER; wait $SERVER 2>/dev/null
  if [ -f "$OUTDIR/stacks-$i.txt" ]; then
    READY=$(python3 -c "import json,sys; print(int(json.load(open(sys.argv[1])).get('ready_s', 0)) + 1)" "$OUTDIR/startup-$i.json" 2>/dev/null || echo 60)
    echo "== start $i: where the wall time went before ready (${READY} s; inclusive share of samples per thread)"
    python3 benchmarks/stack_sampler.py --report "$OUTDIR/stacks-$i.txt" --until "$READY" --top 45 | cut -c1-160
    gzip -f "$OUTDIR/stacks-$i.txt"
  fi
done
du -sh "$CACHE" 2>/dev/null

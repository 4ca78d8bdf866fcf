# Sourced by benchmarks/startup_cache.sh and capacity_startup.sh (not run on its own): the environment and the
# `cosyserve serve` command line of a full-size CosyVoice2-0.5B server with random weights on one GPU, so both
# scripts start the same server.
#   full_size_setup KIND        installs .whl into /tmp/cosyserve-site, exports the environment, and for KIND=dit
#                               builds the full-size Step-Audio2 DiT token2wav directory (/tmp/dit-t2w)
#   full_size_serve LOG ARGS... starts the server in the background (stdout+stderr to LOG; SERVER = its pid) with
#                               ARGS after the shared options; SERVE_PREFIX (an array, default `python3 -m
#                               cosyserve.cli`) is the command that runs the CLI
full_size_setup() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/cosyserve-site .whl/*.whl || return 1
  # PYTHONFAULTHANDLER: a crash in native code (session 33: one segfault at start-up) leaves its Python stack in the log
  export PYTHONPATH=/tmp/cosyserve-site:$PWD PYTHONUNBUFFERED=1 COSYSERVE_CACHE_DIR=/tmp/cosyserve-cache PYTHONFAULTHANDLER=1
  # The GPU machine's Python packages have no compiled bytecode and PYTHONDONTWRITEBYTECODE=1 is set, so every start
  # compiled torch/transformers/... from source (measured: `from transformers import Qwen2ForCausalLM` 18 s -> 9 s
  # with bytecode). pip installs bytecode (the deploy/ image has it): keep it in a cache of its own.
  # PYC_CACHE=0: as the machine comes.
  if [ "${PYC_CACHE:-1}" = 1 ]; then unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/cosyserve-pycache; fi
  FULL_SIZE_EXTRA=()
  if [ "$1" = dit ]; then
    python3 -m cosyserve.cli demo-model /tmp/dit-t2w --dit-token2wav --dit-size full --no-weight-files >/dev/null || return 1
    FULL_SIZE_EXTRA=(--token2wav-dir /tmp/dit-t2w)
  fi
}

full_size_serve() {
  local log=$1; shift
  local prefix=(python3 -m cosyserve.cli)
  if [ -n "${SERVE_PREFIX+x}" ] && [ ${#SERVE_PREFIX[@]} -gt 0 ]; then prefix=("${SERVE_PREFIX[@]}"); fi
  "${prefix[@]}" serve --random-weights benchmarks/configs/cosyvoice2-0.5b.yaml \
    --qwen-config benchmarks/configs/CosyVoice-BlankEN-config.json --device cuda --dtype bfloat16 \
    --voices-dir /tmp/cosyserve-voices --port 8000 --grpc-port 8001 "${FULL_SIZE_EXTRA[@]}" "$@" >"$log" 2>&1 &
  SERVER=$!
}

#!/usr/bin/env bash
# Run `cosyserve serve` under the image's runtime contract WITHOUT a container engine, and check it:
#
#   * as uid/gid 10001 (the image's USER), with the ENV of deploy/Dockerfile's final stage, its
#     paths moved under one scratch folder: /models, /data, /cache, /home/cosyserve;
#   * the model directory owned by root and not writable, HOME not writable: the process can
#     write only where the image says (voices dir, caches, /tmp), as with a read-only root;
#   * then: not ready -> ready (deploy/healthcheck.py exits 1, then 0), health routes answer
#     without the API key and /metrics with it, a voice upload lands in the voices dir, one
#     streamed synthesis over the OpenAI route, SIGTERM ends the process with status 0.
#
# Needs root (to switch user; creates no account) and the Python environment of cosyserve.
# The model is the random-weight demo model (its audio is noise). Usage:
#
#   sudo deploy/runtime_check.sh [cpu|cuda]         env: PYTHON (default python3), KEEP=1
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=${1:-cpu}
PY=${PYTHON:-python3}
UID_GID=10001
[ "$(id -u)" = 0 ] || { echo "runtime_check: run as root (it switches to uid $UID_GID)" >&2; exit 2; }
SCRATCH=$(mktemp -d /tmp/cosyserve-runtime.XXXXXX)
chmod 755 "$SCRATCH"
PIDFILE=$SCRATCH/server.pid
cleanup() {
  if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then kill "$(cat "$PIDFILE")" || true; fi
  [ -n "${KEEP:-}" ] || rm -rf "$SCRATCH"
}
trap cleanup EXIT

# the image's environment, with its absolute paths moved under $SCRATCH
ENV_LINES=$("$PY" - "$SCRATCH" <<'EOF'
import re, shlex, sys
scratch = sys.argv[1]
text = open("deploy/Dockerfile").read().replace("\\\n", " ")
final = text[text.rindex("\nFROM "):]
env = {}
for line in final.splitlines():
    if line.startswith("ENV "):
        for tok in shlex.split(line[4:]):
            k, v = tok.split("=", 1)
            env[k] = v
for k, v in env.items():
    if k in ("PATH", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES"):
        continue
    v = re.sub(r"(?<![\w:])/(cache|data|models|home/cosyserve)\b", scratch + r"/\1", v)
    print(f"{k}={v}")
EOF
)
mkdir -p "$SCRATCH/home/cosyserve" "$SCRATCH/data/voices" "$SCRATCH/cache" "$SCRATCH/tmp"
chown -R $UID_GID:$UID_GID "$SCRATCH/data" "$SCRATCH/cache" "$SCRATCH/tmp"
chmod 555 "$SCRATCH/home/cosyserve"           # HOME exists but is not writable
"$PY" -m cosyserve.cli demo-model "$SCRATCH/models" >/dev/null
chmod -R a-w "$SCRATCH/models"                # owned by root, read-only for everyone
PORT=${PORT:-18000}; GRPC_PORT=${GRPC_PORT:-18001}
KEY=runtime-check-key
RUN_ENV=(env -i PATH="$PATH" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TMPDIR="$SCRATCH/tmp"
         COSYSERVE_API_KEY=$KEY $ENV_LINES
         COSYSERVE_HEALTH_URL="http://127.0.0.1:$PORT/v2/health/ready")
echo "environment:"; printf '  %s\n' $ENV_LINES
AS_USER=(setpriv --reuid $UID_GID --regid $UID_GID --clear-groups "${RUN_ENV[@]}")

# the image's CMD, with the moved paths and free ports (setpriv and env exec: $! is the server)
"${AS_USER[@]}" "$PY" -m cosyserve.cli serve --model-dir "$SCRATCH/models" --host 127.0.0.1 --port "$PORT" \
  --grpc-port "$GRPC_PORT" --voices-dir "$SCRATCH/data/voices" --log-format json --device "$DEVICE" \
  --min-token-text-ratio 3 --max-token-text-ratio 3 >"$SCRATCH/server.log" 2>&1 &
echo $! >"$PIDFILE"
fail() { echo "runtime_check: FAILED: $*" >&2; tail -n 30 "$SCRATCH/server.log" >&2; exit 1; }

ready=""
for _ in $(seq 1 600); do
  kill -0 "$(cat "$PIDFILE")" 2>/dev/null || fail "the server exited"
  ! grep -q "model loading failed" "$SCRATCH/server.log" || fail "model loading failed"
  if "${AS_USER[@]}" "$PY" deploy/healthcheck.py 2>/dev/null; then ready=1; break; fi
  sleep 1
done
[ -n "$ready" ] || fail "not ready after 600 s"
echo "ready: deploy/healthcheck.py exits 0"

"$PY" - "$PORT" "$KEY" "$SCRATCH" <<'EOF' || fail "HTTP checks"
import io, sys, wave, httpx
port, key, scratch = sys.argv[1:]
base = f"http://127.0.0.1:{port}"
auth = {"Authorization": f"Bearer {key}"}
for path in ("/v2/health/live", "/v2/health/ready"):
    assert httpx.get(base + path).status_code == 200, path
assert httpx.get(base + "/metrics").status_code == 401
m = httpx.get(base + "/metrics", headers=auth)
assert m.status_code == 200 and "cosyserve_ready 1.0" in m.text
from cosyserve.models.demo import shipped_prompt
wav, text = shipped_prompt()
r = httpx.post(base + "/v1/audio/voices", headers=auth, timeout=120,
               files={"audio_sample": ("p.wav", open(wav, "rb"), "audio/wav")}, data={"name": "alice", "ref_text": text})
assert r.status_code == 201, r.text
import os
assert any(f.startswith("alice") for f in os.listdir(f"{scratch}/data/voices")), os.listdir(f"{scratch}/data/voices")
with httpx.stream("POST", base + "/v1/audio/speech", headers=auth, timeout=300,
                  json={"model": "cosyvoice2", "voice": "alice", "input": "你好，世界。", "response_format": "wav"}) as s:
    assert s.status_code == 200, s.read()
    body = b"".join(s.iter_bytes())
n = len(body) - 44
assert n > 24000 * 2 * 0.2, n  # at least 0.2 s of 16-bit audio
print(f"voice upload and synthesis: {n / 48000:.2f} s of audio; /metrics needs the key, health does not")
EOF

kill -TERM "$(cat "$PIDFILE")"
status=0; wait "$(cat "$PIDFILE")" || status=$?
[ "$status" = 0 ] || fail "exit status $status after SIGTERM"
echo "SIGTERM: exit status 0"
# nothing was written outside the writable places
if find "$SCRATCH/home" "$SCRATCH/models" -newer "$PIDFILE" | grep -q .; then fail "wrote into HOME or the model dir"; fi
echo "written: $(cd "$SCRATCH" && find data cache -type f | sed 's|/[^/]*$||' | sort | uniq -c | tr '\n' ';')"
echo "runtime_check: OK ($DEVICE)"

# Sourced by the benchmark scripts that start a `cosyserve serve` in the background (not run on its own).
#   stop_and_wait PID   SIGTERM to the server, then wait until it has exited (SIGKILL after 20 s), so that the
#                       next server (the next device call's included) starts on a free GPU (session 33: a server
#                       started right after another one's exit segfaulted at start-up). PID must be a child of
#                       the calling shell (`wait` reaps it).
stop_and_wait() {
  kill "$1" 2>/dev/null
  (sleep 20; kill -9 "$1" 2>/dev/null) &
  local watchdog=$!
  wait "$1" 2>/dev/null
  kill "$watchdog" 2>/dev/null
}

#!/usr/bin/env bash
# Start/stop a local standalone Redis on loopback.
#
#   redis-standalone.sh start  DATA_DIR [PORT=6379] [--aof]
#   redis-standalone.sh stop   DATA_DIR [PORT=6379]
#   redis-standalone.sh status DATA_DIR [PORT=6379]
#
# start waits until the server it started answers PING (a port another server holds fails);
# it is a no-op when the server already runs. DATA_DIR may be relative.
# stop is idempotent: it succeeds when nothing runs. --aof turns on the append-only file
# (appendfsync everysec) for durability tests; without it nothing is persisted.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cmd="${1:-}"; dir="${2:-}"; port="${3:-6379}"; aof="${4:-}"
if [[ -z "$cmd" || -z "$dir" ]]; then
  echo "usage: $0 start|stop|status DATA_DIR [PORT] [--aof]" >&2; exit 2
fi
dir="$(realpath -m "$dir")"  # redis-server enters --dir before it opens its log and pidfile
pidfile="$dir/redis-$port.pid"
# A process that exited is gone, though as a zombie it answers kill -0 until its parent reaps it
# (redis-server daemonizes: its parent is init, which may reap it seconds later).
running() { kill -0 "$1" 2>/dev/null && ! grep -qs '^State:[[:space:]]*Z' "/proc/$1/status"; }
alive() { [[ -f "$pidfile" ]] && running "$(cat "$pidfile")"; }

case "$cmd" in
  start)
    mkdir -p "$dir"
    if alive; then echo "redis already running on 127.0.0.1:$port"; exit 0; fi
    extra=()
    if [[ "$aof" == "--aof" ]]; then extra=(--appendonly yes --appendfsync everysec); fi
    redis-server "$HERE/standalone.conf" --port "$port" --dir "$dir" \
      --pidfile "$pidfile" --logfile "$dir/redis-$port.log" "${extra[@]}"
    for _ in $(seq 1 200); do
      # Ours answering: another server on the port also answers PING (ours then exits at once).
      if alive && [[ "$(redis-cli -p "$port" ping 2>/dev/null)" == "PONG" ]]; then
        echo "redis running on 127.0.0.1:$port (dir $dir)"; exit 0
      fi
      sleep 0.05
    done
    echo "redis on port $port did not start; see $dir/redis-$port.log" >&2; exit 1 ;;
  stop)
    if ! alive; then rm -f "$pidfile"; exit 0; fi
    pid="$(cat "$pidfile")"
    # SHUTDOWN writes the AOF tail when AOF is on; NOSAVE keeps RDB off either way.
    redis-cli -p "$port" shutdown nosave now >/dev/null 2>&1 || kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 200); do
      running "$pid" || { rm -f "$pidfile"; exit 0; }
      sleep 0.05
    done
    kill -9 "$pid" 2>/dev/null || true; rm -f "$pidfile" ;;
  status)
    if alive; then echo "running pid $(cat "$pidfile")"; else echo "stopped"; exit 1; fi ;;
  *) echo "unknown command $cmd" >&2; exit 2 ;;
esac

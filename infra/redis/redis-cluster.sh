#!/usr/bin/env bash
# Start/stop a local Redis Cluster of 6 processes (3 masters, 3 replicas) on loopback.
#
#   redis-cluster.sh start  DATA_DIR [BASE_PORT=7000]
#   redis-cluster.sh stop   DATA_DIR [BASE_PORT=7000]
#   redis-cluster.sh status DATA_DIR [BASE_PORT=7000]
#
# Ports BASE..BASE+5 serve clients; BASE+10000.. carry the cluster bus. start returns once
# every slot is served and all three replicas report their master link up (polled, not
# slept). stop is idempotent and removes nodes.conf, so the next start builds a new cluster.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cmd="${1:-}"; dir="${2:-}"; base="${3:-7000}"
if [[ -z "$cmd" || -z "$dir" ]]; then
  echo "usage: $0 start|stop|status DATA_DIR [BASE_PORT]" >&2; exit 2
fi
dir="$(realpath -m "$dir")"  # redis-server enters --dir before it opens its log and pidfile
ports=(); for i in 0 1 2 3 4 5; do ports+=($((base + i))); done
pidfile() { echo "$dir/node-$1/redis.pid"; }
# A process that exited is gone, though as a zombie it answers kill -0 until its parent reaps it
# (redis-server daemonizes: its parent is init, which may reap it seconds later).
running() { kill -0 "$1" 2>/dev/null && ! grep -qs '^State:[[:space:]]*Z' "/proc/$1/status"; }
alive() { local f; f="$(pidfile "$1")"; [[ -f "$f" ]] && running "$(cat "$f")"; }

replicas_up() {
  local n=0 p
  for p in "${ports[@]}"; do
    if redis-cli -p "$p" info replication 2>/dev/null | grep -q "master_link_status:up"; then n=$((n + 1)); fi
  done
  [[ $n -eq 3 ]]
}

case "$cmd" in
  start)
    if alive "${ports[0]}" && [[ "$(redis-cli -p "$base" cluster info 2>/dev/null | grep -c cluster_state:ok)" == 1 ]]; then
      echo "cluster already running on 127.0.0.1:$base-$((base + 5))"; exit 0
    fi
    for p in "${ports[@]}"; do
      mkdir -p "$dir/node-$p"
      if ! alive "$p"; then
        rm -f "$dir/node-$p/nodes.conf"
        redis-server "$HERE/cluster.conf" --port "$p" --dir "$dir/node-$p" \
          --pidfile "$(pidfile "$p")" --logfile "$dir/node-$p/redis.log"
      fi
    done
    for p in "${ports[@]}"; do
      for _ in $(seq 1 200); do
        [[ "$(redis-cli -p "$p" ping 2>/dev/null)" == "PONG" ]] && break
        sleep 0.05
      done
    done
    addrs=(); for p in "${ports[@]}"; do addrs+=("127.0.0.1:$p"); done
    redis-cli --cluster create "${addrs[@]}" --cluster-replicas 1 --cluster-yes >"$dir/cluster-create.log" 2>&1 || {
      echo "cluster create failed; see $dir/cluster-create.log" >&2; exit 1; }
    for _ in $(seq 1 600); do
      if redis-cli -p "$base" cluster info 2>/dev/null | grep -q cluster_state:ok && replicas_up; then
        echo "cluster running on 127.0.0.1:$base-$((base + 5)) (dir $dir)"; exit 0
      fi
      sleep 0.05
    done
    echo "cluster did not converge; see $dir/node-*/redis.log" >&2; exit 1 ;;
  stop)
    # NOW: don't wait for replicas to catch up (a master would wait up to 10 s); all in parallel.
    pids=()
    for p in "${ports[@]}"; do
      if alive "$p"; then
        pid="$(cat "$(pidfile "$p")")"; pids+=("$pid")
        redis-cli -p "$p" shutdown nosave now >/dev/null 2>&1 || kill "$pid" 2>/dev/null || true
      fi
    done
    for pid in "${pids[@]}"; do
      for _ in $(seq 1 200); do running "$pid" || break; sleep 0.05; done
      running "$pid" && kill -9 "$pid" 2>/dev/null || true
    done
    for p in "${ports[@]}"; do rm -f "$(pidfile "$p")" "$dir/node-$p/nodes.conf"; done ;;
  status)
    n=0; for p in "${ports[@]}"; do alive "$p" && n=$((n + 1)); done
    echo "$n/6 processes running"
    [[ $n -eq 6 ]] && redis-cli -p "$base" cluster info | grep cluster_state ;;
  *) echo "unknown command $cmd" >&2; exit 2 ;;
esac

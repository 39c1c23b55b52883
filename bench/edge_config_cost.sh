#!/usr/bin/env bash
# edge_config_cost.sh: what each HAProxy configuration costs per call, to
# find what in deploy/edge/haproxy.cfg is worth cutting. One bare
# attention-server runs for the whole script; each CONFIG in turn fronts it
# (same environment variables as deploy/edge/run.sh sets) under
# attention-client bench, dot_product B=1 n=8 d=64, concurrency 64. Prints per
# configuration: calls/s, p99, HAProxy's and the server's CPU time per call
# (/proc) and HAProxy's system calls and context switches per call
# (perf stat, on SECONDS of the run after 2 s).
#
#   bench/edge_config_cost.sh [--seconds N (6)] CONFIG...
#
# Give a configuration more than once to alternate (a b a b) on a shared
# machine. A CONFIG is a copy of haproxy.cfg with one change; its errorfile
# paths are relative to it (copy deploy/edge/errors/ next to it). Its
# backends are deploy/edge/sidecar.cfg's (the one server), loaded after it.
# Needs build/server/attention-server, build/client/attention-client, haproxy,
# perf (linux-perf).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
seconds=6
if [[ "${1:-}" == --seconds ]]; then seconds=$2; shift 2; fi
(($#)) || { sed -n '2,17s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 2; }
client=build/client/attention-client
work=$(mktemp -d)
trap 'kill -TERM $(jobs -p) 2>/dev/null; wait; rm -rf "$work"' EXIT

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
free_port() { /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

build/server/attention-server --address 127.0.0.1:0 --http-address 127.0.0.1:0 \
  --metrics-address "" --port-file "$work/ports" > "$work/server.log" 2>&1 &
server_pid=$!
until [[ -s "$work/ports" ]]; do sleep 0.1; done
export ATTENTION_EDGE_BACKEND=$(awk '$1 == "grpc" {print $2}' "$work/ports")
export ATTENTION_EDGE_HTTP_BACKEND=$(awk '$1 == "http" {print $2}' "$work/ports")
export ATTENTION_EDGE_LISTEN=127.0.0.1:$(free_port) ATTENTION_EDGE_BIND_OPTIONS="proto h2"

echo "$(lscpu | grep 'Model name' | tr -s ' '); $(haproxy -v | head -1); $(date -u '+%F %H:%M UTC')"
for config in "$@"; do
  haproxy -db -f "$(realpath "$config")" -f deploy/edge/sidecar.cfg > "$work/haproxy.log" 2>&1 &
  edge_pid=$!
  until "$client" --target "$ATTENTION_EDGE_LISTEN" --timeout 1 health > /dev/null 2>&1; do
    kill -0 "$edge_pid" 2>/dev/null || { cat "$work/haproxy.log" >&2; exit 1; }
    sleep 0.2
  done
  server_before=$(cpu_ticks "$server_pid") edge_before=$(cpu_ticks "$edge_pid")
  "$client" --target "$ATTENTION_EDGE_LISTEN" bench --model dot_product --batch 1 --n 8 --dim 64 \
    --concurrency 64 --duration $((seconds + 2)) --json > "$work/bench.json" &
  client_pid=$!
  sleep 2
  perf stat -x, -o "$work/stat" -p "$edge_pid" -e syscalls:sys_enter_sendto \
    -e syscalls:sys_enter_recvfrom -e syscalls:sys_enter_epoll_wait -e context-switches \
    -- sleep "$seconds"
  wait "$client_pid"
  server_cpu=$(($(cpu_ticks "$server_pid") - server_before))
  edge_cpu=$(($(cpu_ticks "$edge_pid") - edge_before))
  kill "$edge_pid"
  wait "$edge_pid" || true
  /usr/bin/python3 - "$config" "$work/bench.json" "$work/stat" "$seconds" "$server_cpu" \
      "$edge_cpu" "$(cut -d' ' -f1 /proc/loadavg)" <<'PY'
import json, os, sys
config, bench, stat, seconds, server_ticks, edge_ticks, load = sys.argv[1:]
r = json.load(open(bench))
all_calls = r["throughput_rps"] * (r["duration_s"] + r["warmup_s"])
counted = r["throughput_rps"] * float(seconds)
per_call = {line.split(",")[2].split(":")[-1].replace("sys_enter_", ""): float(line.split(",")[0]) / counted
            for line in open(stat) if line[:1].isdigit()}
print(f"{os.path.basename(config):20s} load {load:5s} {r['throughput_rps']:6.0f} calls/s "
      f"p99 {r['latency_ms']['p99']:5.1f} ms {r['errors']} errors; CPU per call: "
      f"edge {float(edge_ticks) * 1e4 / all_calls:4.1f} us, server {float(server_ticks) * 1e4 / all_calls:4.1f} us; "
      "per call: " + ", ".join(f"{name} {count:.2f}" for name, count in per_call.items()))
PY
done

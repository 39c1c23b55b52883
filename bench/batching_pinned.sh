#!/usr/bin/env bash
# batching_pinned.sh: batching on against off for issue 3's small request,
# with the server pinned to one CPU and the load generator to another, so
# the ratio is the server's own (no client stealing its CPU). Alternates
# the two modes for a few rounds and prints answers/s and the server's CPU
# time per answer. Needs 2 CPUs and a Release build (ATTENTION_BUILD_DIR).
#
#   bench/batching_pinned.sh [ROUNDS]     (default 2; 12 s per mode per round)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${ATTENTION_BUILD_DIR:-build}
rounds=${1:-2}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
ticks_per_s=$(getconf CLK_TCK)

run() {  # label, server flags...
  local label=$1
  shift
  rm -f "$work/ports"
  taskset -c 1 "$build/server/attention-server" --address 127.0.0.1:0 --metrics-address "" \
    --model-repository models --port-file "$work/ports" --threads 1 "$@" >"$work/server.log" 2>&1 &
  local server=$!
  for _ in $(seq 100); do [[ -s $work/ports ]] && break; sleep 0.1; done
  local target
  target=$(awk '$1 == "grpc" {print $2}' "$work/ports")
  local before after
  before=$(awk '{print $14 + $15}' "/proc/$server/stat")
  taskset -c 0 "$build/client/attention-client" --target "$target" bench --model mh_torch_e256_h8 \
    --batch 1 --n 32 --dim 256 --concurrency 64 --warmup 2 --duration 10 --json >"$work/bench.json"
  after=$(awk '{print $14 + $15}' "/proc/$server/stat")
  kill "$server"
  wait "$server" || true
  /usr/bin/python3 - "$work/bench.json" "$label" "$((after - before))" "$ticks_per_s" <<'PY'
import json, sys
result = json.load(open(sys.argv[1]))
label, ticks, hz = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rate = result["throughput_rps"]
# CPU over warm-up + measured window (12 s) against the answers of both.
print(f"{label:34s} {rate:8.1f} answers/s  server CPU {ticks / hz * 1e6 / (rate * 12):5.0f} us/answer")
PY
}

echo "server on CPU 1 (--threads 1), client on CPU 0; small request, concurrency 64; $(date -u '+%F %T') UTC, load $(cut -d' ' -f1 /proc/loadavg)"
for _ in $(seq "$rounds"); do
  run "off: --max-batch-size 1" --max-batch-size 1
  run "on: --max-batch-size 64, 1000 us" --max-batch-size 64 --max-queue-delay-us 1000
done

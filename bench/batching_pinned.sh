#!/usr/bin/env bash
# batching_pinned.sh: batching on against off for the small request (1x32x256),
# with the server pinned to one CPU and the load generator to another, so
# the ratio is the server's own (no client stealing its CPU). Alternates
# the two modes for a few rounds and prints answers/s and the server's CPU
# time per answer (closed loop), then latency percentiles of each mode in
# open loop at half of the peak it reached. Needs 2 CPUs and a Release
# build (ATTENTION_BUILD_DIR).
#
#   bench/batching_pinned.sh [ROUNDS]     (default 2; 12 s per mode per round)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${ATTENTION_BUILD_DIR:-build}
rounds=${1:-2}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
ticks_per_s=$(getconf CLK_TCK)

run() {  # label, rate (0: closed loop), server flags...
  local label=$1 rate=$2
  shift 2
  rm -f "$work/ports"
  taskset -c 1 "$build/server/attention-server" --address 127.0.0.1:0 --http-address "" --metrics-address "" \
    --model-repository models --port-file "$work/ports" --threads 1 "$@" >"$work/server.log" 2>&1 &
  local server=$!
  for _ in $(seq 100); do [[ -s $work/ports ]] && break; sleep 0.1; done
  local target
  target=$(awk '$1 == "grpc" {print $2}' "$work/ports")
  local before after
  before=$(awk '{print $14 + $15}' "/proc/$server/stat")
  local load=(--concurrency 64)
  ((rate == 0)) || load=(--rate "$rate")
  taskset -c 0 "$build/client/attention-client" --target "$target" bench --model mh_torch_e256_h8 \
    --batch 1 --n 32 --dim 256 "${load[@]}" --warmup 2 --duration 10 --json >"$work/bench.json"
  after=$(awk '{print $14 + $15}' "/proc/$server/stat")
  kill "$server"
  wait "$server" || true
  /usr/bin/python3 - "$work/bench.json" "$label" "$((after - before))" "$ticks_per_s" <<'PY'
import json, sys
result = json.load(open(sys.argv[1]))
label, ticks, hz = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rate = result["throughput_rps"]
latency = result["latency_ms"]
# CPU over warm-up + measured window (12 s) against the answers of both.
print(f"{label:40s} {rate:8.1f} answers/s  server CPU {ticks / hz * 1e6 / (rate * 12):5.0f} us/answer"
      f"  p50 {latency['p50']:6.2f} ms  p99 {latency['p99']:6.2f} ms  p99/p50 {latency['p99'] / latency['p50']:4.1f}")
PY
  peak=$(/usr/bin/python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['throughput_rps'])" \
    "$work/bench.json")
}

echo "server on CPU 1 (--threads 1), client on CPU 0; small request, concurrency 64; $(date -u '+%F %T') UTC, load $(cut -d' ' -f1 /proc/loadavg)"
off=(--max-batch-size 1)
on=(--max-batch-size 64 --max-queue-delay-us 1000)
peak=0 peak_off=0 peak_on=0
for _ in $(seq "$rounds"); do
  run "off, closed loop" 0 "${off[@]}"
  peak_off=$(/usr/bin/python3 -c "print(max($peak_off, $peak))")
  run "on (64, 1000 us), closed loop" 0 "${on[@]}"
  peak_on=$(/usr/bin/python3 -c "print(max($peak_on, $peak))")
done
half_off=$(/usr/bin/python3 -c "print(round($peak_off / 2))")
half_on=$(/usr/bin/python3 -c "print(round($peak_on / 2))")
run "off, open loop at $half_off/s" "$half_off" "${off[@]}"
run "on (64, 1000 us), open loop at $half_on/s" "$half_on" "${on[@]}"

#!/usr/bin/env bash
# soak.sh: a bounded soak of attention-server. Not in CI; its figures are in
# RELIABILITY.md.
#
# Starts attention-server (Release build, example models of models/), fills
# every batch once (a short burst at 64 calls per workload, so each batcher
# thread's engine scratch reaches its largest size, which is bounded but
# otherwise grows whenever a burst first makes a bigger batch), measures
# the capacity of a mix of five workloads (built-in and repository models,
# several shapes, causal and not) in closed loop, then runs the same mix in
# open loop at a fraction of that capacity for the duration, with
# `attention-client bench` (one process per workload). Every few seconds it
# samples the server's RSS and its answer counters into a table. At the end
# it stops the server with SIGTERM.
#
# Fails (exit 1) if any call failed, if the server did not exit 0, or if the
# RSS after warm-up ever exceeds the RSS at the end of warm-up by more than
# the allowed growth.
#
#   scripts/soak.sh                        10 minutes at 80% of capacity
#   scripts/soak.sh -d 300 -s 10           5 minutes, a sample every 10 s
#
# Options: -d DURATION_S (600)  -w WARMUP_S (60, part of the duration)
#          -s SAMPLE_S (5)      -f LOAD_FRACTION (0.8)
#          -g MAX_GROWTH_MIB (32)  -c CAPACITY_S (15, capacity measurement)
# Environment: ATTENTION_BUILD_DIR (build). Output: a directory
# soak-<date> under the build dir with rss.csv, the bench JSON and the
# server log.
set -euo pipefail
cd "$(dirname "$0")/.."

duration=600 warmup=60 sample=5 fraction=0.8 max_growth_mib=32 capacity_s=15 fill_s=5
while getopts "d:w:s:f:g:c:" opt; do
  case $opt in
    d) duration=$OPTARG ;;
    w) warmup=$OPTARG ;;
    s) sample=$OPTARG ;;
    f) fraction=$OPTARG ;;
    g) max_growth_mib=$OPTARG ;;
    c) capacity_s=$OPTARG ;;
    *) sed -n '2,27p' "$0"; exit 2 ;;
  esac
done
((warmup < duration)) || { echo "warm-up ($warmup s) must be shorter than the duration"; exit 2; }

build_dir=${ATTENTION_BUILD_DIR:-build}
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
nice cmake --build "$build_dir" -j 2 --target attention-server attention-client
server_bin=$build_dir/server/attention-server
client_bin=$build_dir/client/attention-client
out=$build_dir/soak-$(date +%Y%m%d-%H%M%S)
mkdir -p "$out"

# name | bench options: the mix of models and shapes.
workloads=(
  "dot_product|--model dot_product --batch 2 --n 128 --dim 64"
  "distance_causal|--model distance --batch 1 --n 256 --dim 32 --causal"
  "mh_torch|--model mh_torch_e256_h8 --batch 1 --n 64"
  "additive|--model additive_h32 --batch 4 --n 32"
  "bilinear_causal|--model bilinear_d64 --batch 2 --n 96 --causal"
)

"$server_bin" --address 127.0.0.1:0 --http-address 127.0.0.1:0 --metrics-address 127.0.0.1:0 \
  --model-repository models --port-file "$out/ports" >"$out/server.log" 2>&1 &
server_pid=$!
cleanup() { kill "$server_pid" 2>/dev/null || true; }
trap cleanup EXIT
for _ in $(seq 600); do [[ -s $out/ports ]] && break; sleep 0.1; done
[[ -s $out/ports ]] || { echo "the server did not start:"; cat "$out/server.log"; exit 1; }
target=$(awk '$1 == "grpc" {print $2}' "$out/ports")
metrics=$(awk '$1 == "metrics" {print $2}' "$out/ports")

json_field() {  # file, python expression on `j`
  /usr/bin/python3 -c "import json,sys; j=json.load(open(sys.argv[1])); print($2)" "$1"
}
rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$server_pid/status"; }
mib() { awk -v kib="$1" 'BEGIN { printf "%.1f", kib / 1024 }'; }
running() {  # any of the given pids alive
  local pid
  for pid in "$@"; do kill -0 "$pid" 2>/dev/null && return 0; done
  return 1
}
# From one scrape: the answers with code OK, the answers with any other code
# (sums of attention_requests_total) and the requests accepted but not yet
# answered, which shows whether the server was falling behind when RSS moved.
counters() {
  curl -s "http://$metrics/metrics" | awk '
    /^attention_requests_total\{/ {
      if (index($0, "code=\"OK\"") > 0) ok += $NF; else errors += $NF
    }
    /^attention_inflight_requests / { inflight = $NF }
    END { printf "%d %d %d\n", ok, errors, inflight }'
}

# 0. Full batches once per model, so RSS at the end of warm-up includes the
#    scratch of the largest batches (a 10-minute soak without this grew by
#    45 MiB in one step at minute 5, when a burst first made larger batches,
#    and was flat before and after).
echo "== fill: ${fill_s} s closed loop, concurrency 64 per workload"
pids=()
for w in "${workloads[@]}"; do
  # shellcheck disable=SC2086
  "$client_bin" --target "$target" bench ${w#*|} --concurrency 64 --warmup 0 \
    --duration "$fill_s" --json >/dev/null &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done

# 1. Capacity of the mix: every workload at once, closed loop.
echo "== capacity: ${capacity_s} s closed loop, concurrency 4 per workload"
pids=()
for w in "${workloads[@]}"; do
  name=${w%%|*}
  # shellcheck disable=SC2086
  "$client_bin" --target "$target" bench ${w#*|} --concurrency 4 --warmup 3 \
    --duration "$capacity_s" --json >"$out/capacity-$name.json" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
declare -A rate
total_capacity=0
for w in "${workloads[@]}"; do
  name=${w%%|*}
  capacity=$(json_field "$out/capacity-$name.json" "j['throughput_rps']")
  rate[$name]=$(/usr/bin/python3 -c "print(max(1.0, round($capacity * $fraction, 1)))")
  total_capacity=$(/usr/bin/python3 -c "print($total_capacity + $capacity)")
  printf '  %-16s %8.1f requests/s -> soak at %s\n' "$name" "$capacity" "${rate[$name]}"
done

# 2. The soak: open loop at the fraction of capacity, RSS sampled.
echo "== soak: ${duration} s (warm-up ${warmup} s) at ${fraction} of ${total_capacity} requests/s"
pids=()
for w in "${workloads[@]}"; do
  name=${w%%|*}
  # shellcheck disable=SC2086
  "$client_bin" --target "$target" bench ${w#*|} --rate "${rate[$name]}" --warmup 0 \
    --duration "$duration" --json >"$out/soak-$name.json" 2>"$out/soak-$name.err" &
  pids+=($!)
done
echo "elapsed_s,rss_mib,answered_ok,answered_error,inflight" >"$out/rss.csv"
printf '%10s %10s %12s %14s %9s\n' elapsed_s rss_mib answered_ok answered_error inflight
start=$SECONDS
warm_rss_kib=0 max_rss_kib=0
while running "${pids[@]}"; do
  elapsed=$((SECONDS - start))
  rss=$(rss_kib)
  read -r ok errors inflight < <(counters)
  printf '%10d %10s %12d %14d %9d\n' "$elapsed" "$(mib "$rss")" "$ok" "$errors" "$inflight"
  echo "$elapsed,$(mib "$rss"),$ok,$errors,$inflight" >>"$out/rss.csv"
  if ((elapsed <= warmup)); then
    warm_rss_kib=$rss
  elif ((rss > max_rss_kib)); then
    max_rss_kib=$rss
  fi
  sleep "$sample"
done
for pid in "${pids[@]}"; do wait "$pid" || true; done

# 3. Shutdown and verdict.
kill -TERM "$server_pid"
server_status=0
wait "$server_pid" || server_status=$?
trap - EXIT

failed=0 requests=0 errors=0
echo "== results (${out})"
for w in "${workloads[@]}"; do
  name=${w%%|*}
  file=$out/soak-$name.json
  if [[ ! -s $file ]]; then
    echo "  $name: bench failed: $(cat "$out/soak-$name.err")"
    failed=1
    continue
  fi
  r=$(json_field "$file" "j['requests']")
  e=$(json_field "$file" "j['errors']")
  requests=$((requests + r))
  errors=$((errors + e))
  printf '  %-16s %8d requests %4d errors  p50 %7.2f ms  p99 %7.2f ms  %s\n' "$name" "$r" "$e" \
    "$(json_field "$file" "j['latency_ms']['p50']")" "$(json_field "$file" "j['latency_ms']['p99']")" \
    "$(json_field "$file" "j['errors_by_code'] or ''")"
done
growth_mib=$(mib $((max_rss_kib - warm_rss_kib)))
echo "  total: $requests requests, $errors errors; server exit $server_status"
echo "  RSS: $(mib "$warm_rss_kib") MiB after warm-up," \
  "max $(mib "$max_rss_kib") MiB after it (growth $growth_mib MiB," \
  "allowed $max_growth_mib)"
((errors == 0)) || { echo "!! calls failed"; failed=1; }
((server_status == 0)) || { echo "!! the server exited $server_status"; failed=1; }
if awk -v g="$growth_mib" -v m="$max_growth_mib" 'BEGIN { exit !(g > m) }'; then
  echo "!! RSS grew after warm-up"
  failed=1
fi
exit $failed

#!/usr/bin/env bash
# edge_overhead.sh: what the HTTP/2 edge (deploy/edge/run.sh, HAProxy) costs:
# attention-client bench, dot_product B=1 n=8 d=64, closed loop at
# concurrency 64, against a bare attention-server and through the edge, both
# up for the whole run, alternating ROUNDS times; prints each run and the
# median throughput and p99 of each side with their ratios (issue 22's
# target: through the edge >= 80% of the throughput, p99 within 1.5x).
#
#   bench/edge_overhead.sh [ROUNDS (5)] [SECONDS per run (10)]
#
# Needs build/server/attention-server, build/client/attention-client, haproxy.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rounds=${1:-5} seconds=${2:-10}
client=build/client/attention-client
export ATTENTION_SERVER_BIN=$PWD/build/server/attention-server
work=$(mktemp -d)
trap 'kill -TERM $(jobs -p) 2>/dev/null; wait; rm -rf "$work"' EXIT

free_port() { /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
bare=127.0.0.1:$(free_port) edge=127.0.0.1:$(free_port)
"$ATTENTION_SERVER_BIN" --address "$bare" --http-address "" --metrics-address "" > "$work/bare.log" 2>&1 &
deploy/edge/run.sh --listen "$edge" -- --metrics-address "" > "$work/edge.log" 2>&1 &
for target in "$bare" "$edge"; do
  until "$client" --target "$target" --timeout 1 health > /dev/null 2>&1; do sleep 0.2; done
done

echo "$(lscpu | grep 'Model name' | tr -s ' '); load average $(cut -d' ' -f1-3 /proc/loadavg); $(date -u '+%F %H:%M UTC')"
for ((round = 1; round <= rounds; round++)); do
  for side in bare edge; do
    target=${!side}
    # A run that fails is reported and counted, not retried.
    if result=$("$client" --target "$target" bench --model dot_product --batch 1 --n 8 --dim 64 \
                    --concurrency 64 --duration "$seconds" --json 2>&1); then
      echo "$side $result" | tee -a "$work/results"
    else
      echo "$side FAILED: $result" | tee -a "$work/failed"
    fi
  done
done
echo "load average at the end $(cut -d' ' -f1-3 /proc/loadavg)"
[[ -e "$work/failed" ]] && echo "failed runs: $(wc -l < "$work/failed")"
/usr/bin/python3 - "$work/results" <<'PY'
import json, statistics, sys
runs = {"bare": [], "edge": []}
for line in open(sys.argv[1]):
    side, result = line.split(" ", 1)
    runs[side].append(json.loads(result))
median = {side: (statistics.median(r["throughput_rps"] for r in rs),
                 statistics.median(r["latency_ms"]["p99"] for r in rs),
                 sum(r["errors"] for r in rs)) for side, rs in runs.items()}
for side, (rps, p99, errors) in median.items():
    print(f"{side}: median {rps:.0f} calls/s, median p99 {p99:.1f} ms, {errors} errors")
ratio, p99_ratio = median["edge"][0] / median["bare"][0], median["edge"][1] / median["bare"][1]
print(f"edge/bare: throughput {ratio:.2f} (target >= 0.80: {'met' if ratio >= 0.8 else 'NOT met'}), "
      f"p99 {p99_ratio:.2f}x (target <= 1.5x: {'met' if p99_ratio <= 1.5 else 'NOT met'})")
PY

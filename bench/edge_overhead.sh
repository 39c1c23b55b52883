#!/usr/bin/env bash
# edge_overhead.sh: what the HTTP/2 edge (deploy/edge/run.sh, HAProxy) costs:
# attention-client bench, dot_product B=1 n=8 d=64, closed loop at
# concurrency 64, against a bare attention-server, through the edge in front
# of one server ("edge") and through the edge in front of three replicas
# (run.sh --replicas 3, "edge3"), all up for the whole run, alternating ROUNDS
# times; prints each run with the CPU time per call of client, servers and
# edge (/proc), and the median throughput, p99 and CPU per call of each side
# with their ratios (the targets: through the edge >= 80% of the
# throughput, p99 within 1.5x; the edge's CPU per call with three
# replicas <= 1.1x with one).
#
#   bench/edge_overhead.sh [--pinned] [--rate CALLS_PER_S] [--json FILE] [ROUNDS (5)] [SECONDS per run (10)]
#
# --json: also write every run and the medians there (bench/plot_report.py
# draws bench/figures/edge.png from bench/results/edge.json).
# --pinned: client and the servers on CPU 0, the edges (HAProxy) alone on
# CPU 1, as a Kubernetes sidecar with a core of its own would run; not the
# shared-core figure.
# --rate: an open loop at that many calls a second on every side instead of
# the closed loop, so that the edges' CPU per call is compared at one load:
# in the closed loop three replicas on 2 cores answer fewer calls a second
# than one, and an edge's CPU per call grows as its load falls (fewer
# frames per read and write).
# Needs build/server/attention-server, build/client/attention-client, haproxy.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
pinned=0 load=(--concurrency 64) json=""
if [[ "${1:-}" == --pinned ]]; then pinned=1; shift; fi
if [[ "${1:-}" == --rate ]]; then load=(--rate "${2:?--rate needs calls per second}" --max-in-flight 256); shift 2; fi
if [[ "${1:-}" == --json ]]; then json=$(realpath -m "${2:?--json needs a file}"); shift 2; fi
rounds=${1:-5} seconds=${2:-10}
client=build/client/attention-client
export ATTENTION_SERVER_BIN=$PWD/build/server/attention-server
work=$(mktemp -d)
trap 'kill -TERM $(jobs -p) 2>/dev/null; wait; rm -rf "$work"' EXIT

# Prefix of the commands that run on CPU 0 when pinned.
cpu0=()
((pinned)) && cpu0=(taskset -c 0)
# User plus system CPU time of processes, in clock ticks.
cpu_ticks() { local p t=0; for p in "$@"; do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done; echo "$t"; }

free_port() { /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
bare=127.0.0.1:$(free_port) edge=127.0.0.1:$(free_port) edge3=127.0.0.1:$(free_port)
"${cpu0[@]}" "$ATTENTION_SERVER_BIN" --address "$bare" --http-address "" --metrics-address "" \
  > "$work/bare.log" 2>&1 &
bare_server_pid=$!
"${cpu0[@]}" deploy/edge/run.sh --listen "$edge" --pid-file "$work/pids" -- --metrics-address "" \
  > "$work/edge.log" 2>&1 &
"${cpu0[@]}" deploy/edge/run.sh --listen "$edge3" --replicas 3 --pid-file "$work/pids3" \
  -- --metrics-address "" > "$work/edge3.log" 2>&1 &
for target in "$bare" "$edge" "$edge3"; do
  until "$client" --target "$target" --timeout 1 health > /dev/null 2>&1; do sleep 0.2; done
done
edge_server_pids=$(awk '$1 == "server" {print $2}' "$work/pids")
edge_pid=$(awk '$1 == "edge" {print $2}' "$work/pids")
edge3_server_pids=$(awk '$1 == "server" {print $2}' "$work/pids3")
edge3_pid=$(awk '$1 == "edge" {print $2}' "$work/pids3")
if ((pinned)); then
  taskset -a -p -c 1 "$edge_pid" > /dev/null
  taskset -a -p -c 1 "$edge3_pid" > /dev/null
fi

header="$(lscpu | grep 'Model name' | tr -s ' '); load average $(cut -d' ' -f1-3 /proc/loadavg); $(date -u '+%F %H:%M UTC')"
echo "$header"
((pinned)) && echo "pinned: client and servers on CPU 0, the edges on CPU 1"
echo "load: ${load[*]}"
for ((round = 1; round <= rounds; round++)); do
  for side in bare edge edge3; do
    target=${!side}
    case $side in
      bare) server_pids=$bare_server_pid side_edge_pid=$edge_pid ;;
      edge) server_pids=$edge_server_pids side_edge_pid=$edge_pid ;;
      edge3) server_pids=$edge3_server_pids side_edge_pid=$edge3_pid ;;
    esac
    # shellcheck disable=SC2086 # the list of server PIDs
    server_before=$(cpu_ticks $server_pids) edge_before=$(cpu_ticks "$side_edge_pid")
    # A run that fails is reported and counted, not retried.
    if result=$("${cpu0[@]}" /usr/bin/time -f '%U %S' -o "$work/client_time" \
                  "$client" --target "$target" bench --model dot_product --batch 1 --n 8 \
                  --dim 64 "${load[@]}" --duration "$seconds" --json 2>&1); then
      # shellcheck disable=SC2086
      server_cpu=$(($(cpu_ticks $server_pids) - server_before))
      edge_cpu=$(($(cpu_ticks "$side_edge_pid") - edge_before))
      [[ $side == bare ]] && edge_cpu=0
      client_cpu=$(awk '{print ($1 + $2) * 100}' "$work/client_time")
      echo "$side $client_cpu $server_cpu $edge_cpu $result" >> "$work/results"
      /usr/bin/python3 - "$side" "$client_cpu" "$server_cpu" "$edge_cpu" "$result" <<'PY'
import json, sys
side, ticks, r = sys.argv[1], [float(t) for t in sys.argv[2:5]], json.loads(sys.argv[5])
calls = r["throughput_rps"] * (r["duration_s"] + r["warmup_s"])
us = [t * 1e4 / calls for t in ticks]
print(f"{side}: {r['throughput_rps']:.0f} calls/s, p99 {r['latency_ms']['p99']:.1f} ms, "
      f"{r['errors']} errors; CPU per call: client {us[0]:.1f} us, server {us[1]:.1f} us, "
      f"edge {us[2]:.1f} us")
PY
    else
      echo "$side FAILED: $result" | tee -a "$work/failed"
    fi
  done
done
end="load average at the end $(cut -d' ' -f1-3 /proc/loadavg)"
echo "$end"
[[ -e "$work/failed" ]] && echo "failed runs: $(wc -l < "$work/failed")"
/usr/bin/python3 - "$work/results" "$json" "$header; $end" "${load[*]}" "$*" <<'PY'
import json, statistics, sys
runs = {"bare": [], "edge": [], "edge3": []}
for line in open(sys.argv[1]):
    side, client, server, edge, result = line.split(" ", 4)
    r = json.loads(result)
    calls = r["throughput_rps"] * (r["duration_s"] + r["warmup_s"])
    r["cpu_us"] = [float(t) * 1e4 / calls for t in (client, server, edge)]
    runs[side].append(r)
median = {side: (statistics.median(r["throughput_rps"] for r in rs),
                 statistics.median(r["latency_ms"]["p99"] for r in rs),
                 sum(r["errors"] for r in rs),
                 [statistics.median(r["cpu_us"][i] for r in rs) for i in range(3)])
          for side, rs in runs.items()}
for side, (rps, p99, errors, cpu) in median.items():
    print(f"{side}: median {rps:.0f} calls/s, median p99 {p99:.1f} ms, {errors} errors; "
          f"median CPU per call: client {cpu[0]:.1f} us, server {cpu[1]:.1f} us, "
          f"edge {cpu[2]:.1f} us, total {sum(cpu):.1f} us")
ratio, p99_ratio = median["edge"][0] / median["bare"][0], median["edge"][1] / median["bare"][1]
print(f"edge/bare: throughput {ratio:.2f} (target >= 0.80: {'met' if ratio >= 0.8 else 'NOT met'}), "
      f"p99 {p99_ratio:.2f}x (target <= 1.5x: {'met' if p99_ratio <= 1.5 else 'NOT met'})")
edge_cpu, edge3_cpu = median["edge"][3][2], median["edge3"][3][2]
cpu_ratio = edge3_cpu / edge_cpu
print(f"edge CPU per call, 3 replicas / 1: {edge3_cpu:.1f} / {edge_cpu:.1f} us = {cpu_ratio:.2f}x "
      f"(target <= 1.1x: {'met' if cpu_ratio <= 1.1 else 'NOT met'})")
if sys.argv[2]:
    with open(sys.argv[2], "w") as f:
        json.dump({"host": sys.argv[3], "load": sys.argv[4], "arguments": sys.argv[5],
                   "runs": runs,
                   "median": {side: {"calls_per_s": m[0], "p99_ms": m[1], "errors": m[2],
                                     "cpu_us_per_call": dict(zip(("client", "server", "edge"), m[3]))}
                              for side, m in median.items()},
                   "edge_over_bare": {"throughput": ratio, "p99": p99_ratio},
                   "edge3_over_edge_cpu": cpu_ratio}, f, indent=1)
PY

#!/usr/bin/env bash
# run.sh: runs attention-server replicas behind their HTTP/2 edge (HAProxy,
# haproxy.cfg next to this script), all in the foreground, for hosts without
# Kubernetes (which runs the same edge as a sidecar and as a Deployment,
# deploy/k8s/).
#
#   deploy/edge/run.sh --listen HOST:PORT [--replicas N] [--max-replicas M]
#                      [--pid-file FILE] [--edge-metrics-address HOST:PORT]
#                      [--tls-cert PEM --tls-key PEM [--tls-client-ca PEM]]
#                      [-- SERVER_FLAGS...]
#
# Each server listens on 127.0.0.1 (free ports, kept by its slot across
# restarts) in plaintext; only the edge faces clients, on HOST:PORT. With
# --tls-cert/--tls-key the edge terminates TLS there; with --tls-client-ca it
# requires client certificates that CA signed (mutual TLS; the servers see no
# certificate, so --tls-client-allow is not available). SERVER_FLAGS go to
# every attention-server (not --address, --http-address, --port-file,
# --tls-*: the edge owns them). The edge's one port carries gRPC (content-type
# application/grpc*) to the servers' gRPC ports and every other request to
# their REST ports; each call goes to the replica with the fewest calls
# outstanding, or by its attention-sequence-id header (docs/api.md 6.11).
# --replicas N (1 to 64, default 1): N servers. With more than one, replica i
# (from 1) serves metrics at the port of --metrics-address (or
# ATTENTION_METRICS_ADDRESS; default 0.0.0.0:9464) plus i-1 (port 0: a free
# one), and a replica that exits is started again at once, then after 1, 2,
# 4... up to 30 s while it keeps failing within 30 s of its start; their
# drain delay is 2 s unless set (the edge's checks see NOT_SERVING within
# about 1 s). With one, a server that exits ends run.sh (non-zero), as before.
# --max-replicas M (N to 64, default N): scale-up. Each SIGUSR1 to run.sh
# adds one replica (the next slot, its metrics port as above) while fewer
# than M run; the edge takes it into its rotation once it is ready (HAProxy's
# runtime API on a socket private to this run: needs socat or python3).
# Replicas are not removed (SIGTERM one to restart it).
# --edge-metrics-address: HAProxy's Prometheus exporter, /metrics there.
# attention-server is $ATTENTION_SERVER_BIN or found on PATH; haproxy is
# $ATTENTION_EDGE_HAPROXY_BIN or found on PATH.
# --pid-file: one "server PID GRPC_ADDRESS METRICS_ADDRESS" line per replica
# listening (METRICS_ADDRESS "-" when off; with several, the edge's checks
# take each into the rotation once it is ready) and an "edge PID" line,
# rewritten (write, then rename) whenever a replica is replaced. A replica that cannot
# start at first makes run.sh stop the others and exit with its code (its
# reason is on stderr). SIGTERM/SIGINT: every replica drains as it does alone
# (docs/api.md section 6.5), then the edge stops; exit 0, nothing left
# running. If the edge dies, the replicas are drained and the exit code is 1.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
usage() { awk 'NR > 1 && /^set -euo/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit "${1:-2}"; }

listen="" pid_file="" tls_cert="" tls_key="" tls_client_ca="" replicas=1 edge_metrics=""
max_replicas=""
server_flags=()
while (($#)); do
  case "$1" in
    --listen) listen=${2:?--listen needs HOST:PORT}; shift 2 ;;
    --replicas) replicas=${2:?--replicas needs a number}; shift 2 ;;
    --max-replicas) max_replicas=${2:?--max-replicas needs a number}; shift 2 ;;
    --pid-file) pid_file=${2:?--pid-file needs a file}; shift 2 ;;
    --edge-metrics-address) edge_metrics=${2:?--edge-metrics-address needs HOST:PORT}; shift 2 ;;
    --tls-cert) tls_cert=${2:?--tls-cert needs a file}; shift 2 ;;
    --tls-key) tls_key=${2:?--tls-key needs a file}; shift 2 ;;
    --tls-client-ca) tls_client_ca=${2:?--tls-client-ca needs a file}; shift 2 ;;
    -h|--help) usage 0 ;;
    --) shift; server_flags=("$@"); break ;;
    *) echo "run.sh: unknown argument '$1'" >&2; usage ;;
  esac
done
[[ -n "$listen" ]] || { echo "run.sh: --listen HOST:PORT is required" >&2; usage; }
if ! [[ "$replicas" =~ ^[0-9]+$ ]] || ((10#$replicas < 1 || 10#$replicas > 64)); then
  echo "run.sh: --replicas must be a whole number from 1 to 64; got '$replicas'" >&2; exit 2
fi
replicas=$((10#$replicas))
max_replicas=${max_replicas:-$replicas}
if ! [[ "$max_replicas" =~ ^[0-9]+$ ]] || ((10#$max_replicas < replicas || 10#$max_replicas > 64)); then
  echo "run.sh: --max-replicas must be a whole number from --replicas ($replicas) to 64; got '$max_replicas'" >&2
  exit 2
fi
max_replicas=$((10#$max_replicas))
# Replicas that run now: slots 1..active (SIGUSR1 adds one, up to max_replicas).
active=$replicas adds=0
if [[ -n "$edge_metrics" ]] && ! [[ "$edge_metrics" =~ ^[^[:space:]]*:[0-9]+$ ]]; then
  echo "run.sh: --edge-metrics-address must be HOST:PORT; got '$edge_metrics'" >&2; exit 2
fi
if [[ -z "$tls_cert" ]] && [[ -n "$tls_key" ]] || [[ -n "$tls_cert" ]] && [[ -z "$tls_key" ]]; then
  echo "run.sh: --tls-cert and --tls-key go together" >&2; exit 2
fi
if [[ -n "$tls_client_ca" ]] && [[ -z "$tls_cert" ]]; then
  echo "run.sh: --tls-client-ca needs --tls-cert and --tls-key" >&2; exit 2
fi
# With several replicas run.sh gives each its metrics address, and their
# drain delay unless one is set; the rest of SERVER_FLAGS goes to all.
metrics_base=${ATTENTION_METRICS_ADDRESS-0.0.0.0:9464} drain_delay_set=0
[[ -n "${ATTENTION_DRAIN_DELAY_SECONDS:-}" ]] && drain_delay_set=1
shared_flags=()
for ((k = 0; k < ${#server_flags[@]}; k++)); do
  flag=${server_flags[k]}
  case "$flag" in
    --address*|--http-address*|--port-file*|--tls-*)
      echo "run.sh: $flag belongs to the edge, not to the server behind it" >&2; exit 2 ;;
    --drain-delay-seconds*) drain_delay_set=1 ;;
  esac
  if ((max_replicas > 1)); then
    case "$flag" in
      --metrics-address=*) metrics_base=${flag#*=}; continue ;;
      --metrics-address)
        ((k + 1 < ${#server_flags[@]})) || { echo "run.sh: --metrics-address needs a value" >&2; exit 2; }
        k=$((k + 1)); metrics_base=${server_flags[k]}; continue ;;
    esac
  fi
  shared_flags+=("$flag")
done
if ((max_replicas > 1)) && [[ -n "$metrics_base" ]] && ! [[ "$metrics_base" =~ ^[^[:space:]]*:[0-9]+$ ]]; then
  echo "run.sh: --metrics-address must be HOST:PORT or empty; got '$metrics_base'" >&2; exit 2
fi
server_bin=${ATTENTION_SERVER_BIN:-$(command -v attention-server || true)}
haproxy_bin=${ATTENTION_EDGE_HAPROXY_BIN:-$(command -v haproxy || true)}
[[ -x "$server_bin" ]] || { echo "run.sh: attention-server not found (PATH or ATTENTION_SERVER_BIN)" >&2; exit 1; }
[[ -x "$haproxy_bin" ]] || { echo "run.sh: haproxy not found (apt-get install haproxy)" >&2; exit 1; }
# The edge's runtime API (scale-up only): socat, or python3.
admin_client=""
if ((max_replicas > replicas)); then
  if command -v socat > /dev/null; then admin_client=socat
  elif command -v python3 > /dev/null; then admin_client=python3
  else echo "run.sh: --max-replicas above --replicas needs socat or python3 (apt-get install socat)" >&2; exit 1
  fi
fi

work=$(mktemp -d)
# Per slot i (1..N): pid (empty when none), state (starting, serving,
# waiting, stopped), addresses once known, restart back-off and the time of
# the next start (microseconds), exits in a row soon after a start.
declare -a pid state grpc_address http_address metrics_address backoff due started last_status \
  quick_exits
edge_pid="" stopping=0
# The functions the traps call loop over their own local k: a trap runs
# between any two commands, and a shared loop variable would move the main
# loop to another slot.
cleanup() {
  local k
  [[ -z "$edge_pid" ]] || kill -TERM "$edge_pid" 2>/dev/null || true
  for ((k = 1; k <= active; k++)); do
    [[ -z "${pid[k]:-}" ]] || kill -TERM "${pid[k]}" 2>/dev/null || true
  done
  rm -rf "$work"
}
trap cleanup EXIT

now_us() { echo "${EPOCHREALTIME/./}"; }
# A pause that forks nothing (read on a FIFO no one writes), so that
# supervising costs the replicas no CPU worth measuring.
mkfifo "$work/tick"
exec {tick_fd}<>"$work/tick"
pause() { read -r -t "$1" -u "$tick_fd" _ || true; }

bind_options="proto h2"
if [[ -n "$tls_cert" ]]; then
  # HAProxy reads the chain and the key from one file, private to this run.
  (umask 077 && cat "$tls_cert" "$tls_key" > "$work/edge.pem")
  bind_options="ssl crt $work/edge.pem alpn h2 proto h2"
  [[ -z "$tls_client_ca" ]] || bind_options+=" ca-file $tls_client_ca verify required"
fi

# Starts slot $1's server: ports 0 the first time, then the same ones, so
# the edge's server r<i> stays valid without a reload.
launch() {
  local i=$1 metrics=() grpc=127.0.0.1:0 http=127.0.0.1:0
  [[ -n "${grpc_address[i]:-}" ]] && grpc=${grpc_address[i]} http=${http_address[i]}
  if ((max_replicas > 1)); then
    if [[ -n "${metrics_address[i]:-}" ]]; then
      metrics=(--metrics-address "${metrics_address[i]}")
    elif [[ -z "$metrics_base" ]]; then
      metrics=(--metrics-address "")
    else
      local port=${metrics_base##*:}
      ((port == 0)) || port=$((port + i - 1))
      metrics=(--metrics-address "${metrics_base%:*}:$port")
    fi
  fi
  rm -f "$work/ports.$i"
  if ((max_replicas > 1 && !drain_delay_set)); then
    ATTENTION_DRAIN_DELAY_SECONDS=2 "$server_bin" "${shared_flags[@]}" "${metrics[@]}" \
      --address "$grpc" --http-address "$http" --port-file "$work/ports.$i" &
  else
    "$server_bin" "${shared_flags[@]}" "${metrics[@]}" \
      --address "$grpc" --http-address "$http" --port-file "$work/ports.$i" &
  fi
  pid[i]=$! state[i]=starting started[i]=$(now_us)
}

# Slot $1 serves once its port file is written: it listens (its warm-up may
# still run, health NOT_SERVING, docs/api.md 6.9; the edge's checks of
# several replicas wait for it to be ready).
check_started() {
  local i=$1
  [[ -s "$work/ports.$i" ]] || return 1
  if [[ -z "${grpc_address[i]:-}" ]]; then
    grpc_address[i]=$(awk '$1 == "grpc" {print $2}' "$work/ports.$i")
    http_address[i]=$(awk '$1 == "http" {print $2}' "$work/ports.$i")
    metrics_address[i]=$(awk '$1 == "metrics" {print $2}' "$work/ports.$i")
    if [[ -z "${grpc_address[i]}" || -z "${http_address[i]}" ]]; then
      echo "run.sh: replica $i: attention-server did not start gRPC and REST" >&2; exit 1
    fi
  fi
  state[i]=serving
}

write_pid_file() {
  [[ -n "$pid_file" && -n "$edge_pid" ]] || return 0
  local k
  {
    for ((k = 1; k <= active; k++)); do
      [[ "${state[k]}" == serving ]] &&
        echo "server ${pid[k]} ${grpc_address[k]} ${metrics_address[k]:--}"
    done
    echo "edge $edge_pid"
  } > "$pid_file.tmp"
  mv "$pid_file.tmp" "$pid_file"
}

# Reaps slot $1's process if it ended; its status in last_status[i].
exited() {
  local i=$1
  [[ -n "${pid[i]:-}" ]] || return 1
  kill -0 "${pid[i]}" 2>/dev/null && return 1
  wait "${pid[i]}" && last_status[i]=0 || last_status[i]=$?
  pid[i]=""
  return 0
}

drain_all() {
  local k
  for ((k = 1; k <= active; k++)); do
    [[ -n "${pid[k]:-}" ]] && kill -TERM "${pid[k]}" 2>/dev/null || true
  done
}
trap 'stopping=1; drain_all' TERM INT
trap 'adds=$((adds + 1))' USR1

# edge_admin COMMAND: one command to the edge's runtime API; its answer.
edge_admin() {
  if [[ "$admin_client" == socat ]]; then
    echo "$1" | socat -t 5 - "UNIX-CONNECT:$work/admin.sock"
  else
    python3 -c 'import socket, sys
s = socket.socket(socket.AF_UNIX); s.settimeout(5); s.connect(sys.argv[1])
s.sendall(sys.argv[2].encode() + b"\n"); s.shutdown(socket.SHUT_WR)
while data := s.recv(65536): sys.stdout.write(data.decode())' "$work/admin.sock" "$1"
  fi
}

# Slot $1, added after the edge started, gets its addresses at the edge
# (a spare server of backends.sh --slots) and leaves maintenance; the edge's
# checks take it into the rotation once it is ready.
edge_add() {
  local i=$1 backend address commands="" answer
  for backend in attention_http attention attention_sequence attention_http_sequence; do
    address=${grpc_address[i]}
    [[ "$backend" == *http* ]] && address=${http_address[i]}
    commands+="set server $backend/r$i addr ${address%:*} port ${address##*:}; "
  done
  answer=$(edge_admin "${commands}enable server attention_http/r$i") || return 1
  if [[ "$answer" == *rror* || "$answer" == *nknown* || "$answer" == *"No such"* ]]; then
    echo "run.sh: the edge: $answer" >&2; return 1
  fi
  in_edge[i]=1
}

# Start-up: every replica, until all listen; one that exits first ends it all.
for ((i = 1; i <= replicas; i++)); do
  quick_exits[i]=0 last_status[i]=0 in_edge[i]=1
  ((stopping)) || launch "$i"
done
give_up=$(($(now_us) + 600000000))  # models load first: allow a large repository
while :; do
  waiting=0
  for ((i = 1; i <= replicas; i++)); do
    if exited "$i"; then
      state[i]=stopped
      ((stopping)) && continue
      status=${last_status[i]}
      echo "run.sh: attention-server (replica $i of $replicas) exited ($status) before serving" >&2
      drain_all
      for ((k = 1; k <= replicas; k++)); do [[ -n "${pid[k]:-}" ]] && wait "${pid[k]}" || true; done
      pid=()
      exit "$((status == 0 ? 1 : status))"
    fi
    [[ "${state[i]:-}" == starting ]] && ! check_started "$i" && waiting=1
  done
  if ((stopping)); then
    drain_all  # again: a replica launched as the signal came has not had it
    for ((i = 1; i <= replicas; i++)); do [[ -n "${pid[i]:-}" ]] && wait "${pid[i]}" || true; done
    pid=()
    exit 0
  fi
  ((waiting)) || break
  if (($(now_us) > give_up)); then
    echo "run.sh: attention-server did not start serving within 600 s" >&2; exit 1
  fi
  pause 0.1
done

if ((max_replicas == 1)); then
  # The edge as before: one server, unchecked (sidecar.cfg, with this
  # server's addresses).
  export ATTENTION_EDGE_BACKEND=${grpc_address[1]} ATTENTION_EDGE_HTTP_BACKEND=${http_address[1]}
  backends=("$here/sidecar.cfg")
  if [[ -n "$edge_metrics" ]]; then
    "$here/backends.sh" --metrics "$edge_metrics" "${grpc_address[1]},${http_address[1]}" |
      sed -n '/^frontend edge_metrics/,$p' > "$work/metrics.cfg"
    backends+=("$work/metrics.cfg")
  fi
else
  slots=()
  for ((i = 1; i <= replicas; i++)); do slots+=("${grpc_address[i]},${http_address[i]}"); done
  spare=()
  ((max_replicas == replicas)) || spare=(--slots "$max_replicas" --admin-socket "$work/admin.sock")
  "$here/backends.sh" ${edge_metrics:+--metrics "$edge_metrics"} "${spare[@]}" "${slots[@]}" \
    > "$work/backends.cfg"
  backends=("$work/backends.cfg")
fi
edge_config=(-f "$here/haproxy.cfg")
for file in "${backends[@]}"; do edge_config+=(-f "$file"); done
ATTENTION_EDGE_LISTEN=$listen ATTENTION_EDGE_BIND_OPTIONS=$bind_options \
  "$haproxy_bin" -db "${edge_config[@]}" &
edge_pid=$!
write_pid_file

# Supervision: replaces replicas that exit (several replicas), ends on the
# edge's death, and on SIGTERM waits for every replica's drain.
while :; do
  changed=0
  if ((adds > 0)); then
    if ((stopping)); then :
    elif ((active < max_replicas)); then
      active=$((active + 1))
      quick_exits[active]=0 last_status[active]=0 in_edge[active]=0
      echo "run.sh: adding replica $active (SIGUSR1)" >&2
      launch "$active"
    else
      echo "run.sh: SIGUSR1: already $active replicas, the most --max-replicas allows" >&2
    fi
    adds=$((adds - 1))
  fi
  for ((i = 1; i <= active; i++)); do
    if exited "$i"; then
      changed=1
      if ((stopping)); then state[i]=stopped; continue; fi
      status=${last_status[i]}
      if ((max_replicas == 1)); then
        # The server is gone: a soft stop lets the edge finish writing its
        # last answers; hard-stop-after (haproxy.cfg) bounds it.
        kill -USR1 "$edge_pid" 2>/dev/null || true
        wait "$edge_pid" || true
        edge_pid=""
        echo "run.sh: attention-server exited ($status)" >&2
        exit "$((status == 0 ? 1 : status))"
      fi
      # Back-off: the first exit is restarted at once; each further failure
      # within 30 s of its start doubles the wait, from 1 s to at most 30 s.
      # Exit 0 is a drain someone asked for (SIGTERM: a rolling restart).
      if ((status == 0)); then
        quick_exits[i]=0
      elif (($(now_us) - started[i] < 30000000)); then
        quick_exits[i]=$((quick_exits[i] + 1))
      else
        quick_exits[i]=1
      fi
      backoff[i]=0
      ((quick_exits[i] < 2)) || backoff[i]=$((quick_exits[i] > 6 ? 30 : 1 << (quick_exits[i] - 2)))
      state[i]=waiting due[i]=$(($(now_us) + backoff[i] * 1000000))
      echo "run.sh: replica $i (attention-server) exited ($status); starting it again in ${backoff[i]} s" >&2
    fi
    case "${state[i]}" in
      waiting)
        if ((stopping)); then state[i]=stopped
        elif (($(now_us) >= due[i])); then launch "$i"; fi ;;
      starting)
        if ((stopping)); then :
        elif check_started "$i"; then
          changed=1
          ((in_edge[i])) || edge_add "$i" ||
            echo "run.sh: replica $i could not be added to the edge; it serves, outside the rotation" >&2
        fi ;;
    esac
  done
  ((changed)) && write_pid_file
  if [[ -n "$edge_pid" ]] && ! kill -0 "$edge_pid" 2>/dev/null; then
    wait "$edge_pid" && edge_status=0 || edge_status=$?
    edge_pid=""
    if ((!stopping)); then
      echo "run.sh: the edge (haproxy) exited ($edge_status); draining attention-server" >&2
      stopping=1 failed=1
      drain_all
    fi
  fi
  if ((stopping)); then
    alive=0
    for ((i = 1; i <= active; i++)); do [[ -n "${pid[i]:-}" ]] && alive=1; done
    ((alive)) || break
  fi
  pause 0.1
done
# Every replica has drained: a soft stop lets the edge finish writing the
# last answers; hard-stop-after (haproxy.cfg) bounds it.
if [[ -n "$edge_pid" ]]; then
  kill -USR1 "$edge_pid" 2>/dev/null || true
  wait "$edge_pid" || true
  edge_pid=""
fi
((${failed:-0} == 0)) || exit 1
for ((i = 1; i <= active; i++)); do
  if ((last_status[i] != 0)); then
    echo "run.sh: replica $i (attention-server) exited (${last_status[i]}) while draining" >&2
    exit 1
  fi
done
exit 0

#!/usr/bin/env bash
# run.sh: runs attention-server behind its HTTP/2 edge (HAProxy, haproxy.cfg
# next to this script), both in the foreground, for hosts without Kubernetes
# (which runs the same edge as a sidecar, deploy/k8s/).
#
#   deploy/edge/run.sh --listen HOST:PORT [--pid-file FILE]
#                      [--tls-cert PEM --tls-key PEM [--tls-client-ca PEM]]
#                      [-- SERVER_FLAGS...]
#
# The server listens on 127.0.0.1 (a free port) in plaintext; only the edge
# faces clients, on HOST:PORT. With --tls-cert/--tls-key the edge terminates
# TLS there; with --tls-client-ca it requires client certificates that CA
# signed (mutual TLS; the server behind sees no certificate, so its
# --tls-client-allow is not available). SERVER_FLAGS go to attention-server
# (not --address, --http-address, --port-file, --tls-*: the edge owns them).
# The edge's one port carries gRPC (content-type application/grpc*) to the
# server's gRPC port and every other request to its REST port.
# attention-server is $ATTENTION_SERVER_BIN or found on PATH; haproxy is
# $ATTENTION_EDGE_HAPROXY_BIN or found on PATH.
# --pid-file writes "server PID" and "edge PID" lines. SIGTERM/SIGINT: the
# server drains as it does alone (docs/api.md section 6.5), then the edge
# stops; exit 0. If either process dies first, the other is stopped and the
# exit code is non-zero.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
usage() { sed -n '2,23s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit "${1:-2}"; }

listen="" pid_file="" tls_cert="" tls_key="" tls_client_ca=""
server_flags=()
while (($#)); do
  case "$1" in
    --listen) listen=${2:?--listen needs HOST:PORT}; shift 2 ;;
    --pid-file) pid_file=${2:?--pid-file needs a file}; shift 2 ;;
    --tls-cert) tls_cert=${2:?--tls-cert needs a file}; shift 2 ;;
    --tls-key) tls_key=${2:?--tls-key needs a file}; shift 2 ;;
    --tls-client-ca) tls_client_ca=${2:?--tls-client-ca needs a file}; shift 2 ;;
    -h|--help) usage 0 ;;
    --) shift; server_flags=("$@"); break ;;
    *) echo "run.sh: unknown argument '$1'" >&2; usage ;;
  esac
done
[[ -n "$listen" ]] || { echo "run.sh: --listen HOST:PORT is required" >&2; usage; }
if [[ -z "$tls_cert" ]] && [[ -n "$tls_key" ]] || [[ -n "$tls_cert" ]] && [[ -z "$tls_key" ]]; then
  echo "run.sh: --tls-cert and --tls-key go together" >&2; exit 2
fi
if [[ -n "$tls_client_ca" ]] && [[ -z "$tls_cert" ]]; then
  echo "run.sh: --tls-client-ca needs --tls-cert and --tls-key" >&2; exit 2
fi
for flag in "${server_flags[@]}"; do
  case "$flag" in
    --address*|--http-address*|--port-file*|--tls-*)
      echo "run.sh: $flag belongs to the edge, not to the server behind it" >&2; exit 2 ;;
  esac
done
server_bin=${ATTENTION_SERVER_BIN:-$(command -v attention-server || true)}
haproxy_bin=${ATTENTION_EDGE_HAPROXY_BIN:-$(command -v haproxy || true)}
[[ -x "$server_bin" ]] || { echo "run.sh: attention-server not found (PATH or ATTENTION_SERVER_BIN)" >&2; exit 1; }
[[ -x "$haproxy_bin" ]] || { echo "run.sh: haproxy not found (apt-get install haproxy)" >&2; exit 1; }

work=$(mktemp -d)
server_pid="" edge_pid=""
cleanup() {
  [[ -n "$edge_pid" ]] && kill -TERM "$edge_pid" 2>/dev/null
  [[ -n "$server_pid" ]] && kill -TERM "$server_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

bind_options="proto h2"
if [[ -n "$tls_cert" ]]; then
  # HAProxy reads the chain and the key from one file, private to this run.
  (umask 077 && cat "$tls_cert" "$tls_key" > "$work/edge.pem")
  bind_options="ssl crt $work/edge.pem alpn h2 proto h2"
  [[ -z "$tls_client_ca" ]] || bind_options+=" ca-file $tls_client_ca verify required"
fi

"$server_bin" "${server_flags[@]}" --address 127.0.0.1:0 --http-address 127.0.0.1:0 \
  --port-file "$work/ports" &
server_pid=$!
# Models load before the port file appears; allow for a large repository.
for ((i = 0; i < 6000; i++)); do
  [[ -s "$work/ports" ]] && break
  if ! kill -0 "$server_pid" 2>/dev/null; then
    wait "$server_pid" && status=0 || status=$?
    server_pid=""
    echo "run.sh: attention-server exited ($status) before serving" >&2
    exit "$((status == 0 ? 1 : status))"
  fi
  sleep 0.1
done
backend=$(awk '$1 == "grpc" {print $2}' "$work/ports")
[[ -n "$backend" ]] || { echo "run.sh: attention-server did not start serving" >&2; exit 1; }
http_backend=$(awk '$1 == "http" {print $2}' "$work/ports")
[[ -n "$http_backend" ]] || { echo "run.sh: attention-server did not start REST" >&2; exit 1; }

ATTENTION_EDGE_LISTEN=$listen ATTENTION_EDGE_BACKEND=$backend \
ATTENTION_EDGE_HTTP_BACKEND=$http_backend \
ATTENTION_EDGE_BIND_OPTIONS=$bind_options \
  "$haproxy_bin" -db -f "$here/haproxy.cfg" &
edge_pid=$!
if [[ -n "$pid_file" ]]; then
  printf 'server %s\nedge %s\n' "$server_pid" "$edge_pid" > "$pid_file.tmp"
  mv "$pid_file.tmp" "$pid_file"
fi

stopping=0
trap 'stopping=1; kill -TERM "$server_pid" 2>/dev/null || true' TERM INT
# Returns when either process ends; a signal interrupts wait, which resumes.
while kill -0 "$server_pid" 2>/dev/null && kill -0 "$edge_pid" 2>/dev/null; do
  wait -n "$server_pid" "$edge_pid" || true
done
if ! kill -0 "$server_pid" 2>/dev/null; then
  wait "$server_pid" && server_status=0 || server_status=$?
  server_pid=""
  # The server is gone: a soft stop lets the edge finish writing its last
  # answers; hard-stop-after (haproxy.cfg) bounds it.
  kill -USR1 "$edge_pid" 2>/dev/null || true
  wait "$edge_pid" || true
  edge_pid=""
  if ((stopping && server_status == 0)); then exit 0; fi
  echo "run.sh: attention-server exited ($server_status)" >&2
  exit "$((server_status == 0 ? 1 : server_status))"
fi
wait "$edge_pid" && edge_status=0 || edge_status=$?
edge_pid=""
echo "run.sh: the edge (haproxy) exited ($edge_status); draining attention-server" >&2
kill -TERM "$server_pid"
wait "$server_pid" || true
server_pid=""
exit 1

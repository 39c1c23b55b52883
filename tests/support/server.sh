# server.sh: sourced by the client shell tests. Starts attention-server
# on 127.0.0.1 with ports picked by the system, and stops every server it
# started when the test exits.
#
#   source tests/support/server.sh
#   start_server /path/to/attention-server --model-repository DIR   # sets SERVER_*
#   stop_server "$SERVER_PID"

CLIENT_TEST_TMP=$(mktemp -d)
CLIENT_TEST_PIDS=()

cleanup_servers() {
  local pid
  for pid in "${CLIENT_TEST_PIDS[@]}"; do
    kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
  done
  rm -rf "$CLIENT_TEST_TMP"
}
trap cleanup_servers EXIT

# start_server BINARY [FLAGS...]: returns once the server serves; sets
# SERVER_PID, SERVER_ADDRESS (127.0.0.1:PORT), SERVER_METRICS and SERVER_LOG.
start_server() {
  local binary=$1
  shift
  local dir
  dir=$(mktemp -d "$CLIENT_TEST_TMP/server.XXXXXX")
  SERVER_LOG=$dir/log
  "$binary" --address 127.0.0.1:0 --http-address 127.0.0.1:0 --metrics-address 127.0.0.1:0 --port-file "$dir/ports" \
    --threads 1 "$@" >"$SERVER_LOG" 2>&1 &
  SERVER_PID=$!
  CLIENT_TEST_PIDS+=("$SERVER_PID")
  local tries=0
  # The port file appears (atomically) once the server serves.
  until [[ -s $dir/ports ]]; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null || ((++tries > 600)); then
      echo "attention-server did not start:" >&2
      cat "$SERVER_LOG" >&2
      return 1
    fi
    sleep 0.1
  done
  SERVER_ADDRESS=$(awk '$1 == "grpc" {print $2}' "$dir/ports")
  SERVER_METRICS=$(awk '$1 == "metrics" {print $2}' "$dir/ports")
}

# stop_server PID: SIGTERM, then waits for the exit.
stop_server() {
  kill "$1" && wait "$1" 2>/dev/null
  return 0
}

# case_request NAME: the request of conformance case NAME, as a file path.
case_request() {
  local out=$CLIENT_TEST_TMP/$1.request.json
  /usr/bin/python3 -c 'import json, sys; json.dump(json.load(open(sys.argv[1]))["request"], open(sys.argv[2], "w"))' \
    "$SOURCE_DIR/tests/conformance/cases/$1.json" "$out"
  echo "$out"
}

# check_response CASE FILE: FILE holds a response (proto JSON) that matches
# conformance case CASE: shapes equal, and |actual - expected| <= atol + rtol |expected|.
check_response() {
  /usr/bin/python3 - "$SOURCE_DIR/tests/conformance/cases/$1.json" "$2" <<'PY'
import json, sys
case = json.load(open(sys.argv[1]))
lines = open(sys.argv[2]).read().strip().splitlines()
response = json.loads(lines[-1])
for key in ("output", "attention_weights"):
    expected, actual = case["expected"][key], response[key]
    if [int(s) for s in actual["shape"]] != expected["shape"]:
        sys.exit(f"{key} shape {actual['shape']} != expected {expected['shape']}")
    for i, (a, e) in enumerate(zip(actual["data"], expected["data"])):
        if abs(a - e) > case["atol"] + case["rtol"] * abs(e):
            sys.exit(f"{key}[{i}] = {a}, expected {e}")
    if len(actual["data"]) != len(expected["data"]):
        sys.exit(f"{key} has {len(actual['data'])} values, expected {len(expected['data'])}")
PY
}

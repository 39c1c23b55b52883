#!/usr/bin/env bash
# cli_test.sh: attention-client against a real attention-server:
# health, models, attend (answers checked against conformance cases, errors
# by exit code and message), bench (closed and open loop, JSON and text,
# progress line on a terminal), environment variables and the bearer token.
#
# Also runs the README's C++ example (attention-client-example).
#
#   tests/client/cli_test.sh SERVER_BINARY CLIENT_BINARY EXAMPLE_BINARY
set -euo pipefail

SERVER_BIN=$1
CLIENT=$2
EXAMPLE=$3
SOURCE_DIR=$(cd "$(dirname "$0")/../.." && pwd)
source "$SOURCE_DIR/tests/support/server.sh"

passed=0
failed=0
pass() { echo "PASS $1"; passed=$((passed + 1)); }
fail() { echo "FAIL $1: $2"; failed=$((failed + 1)); }

# run NAME EXPECTED_EXIT CMD...: runs CMD with stdout/stderr in $OUT/$ERR
# and fails NAME unless it exits with EXPECTED_EXIT.
OUT=$CLIENT_TEST_TMP/out
ERR=$CLIENT_TEST_TMP/err
run() {
  local name=$1 expected=$2
  shift 2
  local code=0
  "$@" >"$OUT" 2>"$ERR" || code=$?
  if [[ $code != "$expected" ]]; then
    fail "$name" "exit $code, expected $expected; stderr: $(head -c 400 "$ERR")"
    return 1
  fi
}
# expect_in NAME FILE TEXT: FILE contains TEXT.
expect_in() {
  if grep -qF -- "$3" "$2"; then pass "$1"; else fail "$1" "'$3' not in: $(head -c 400 "$2")"; fi
}

start_server "$SERVER_BIN" --model-repository "$SOURCE_DIR/tests/conformance/models"
T=$SERVER_ADDRESS

# health: exit 0 only when SERVING.
run "health serving" 0 "$CLIENT" --target "$T" health && expect_in "health prints SERVING" "$OUT" SERVING
run "unknown service" 1 "$CLIENT" --target "$T" health --service no.such.Service \
  && expect_in "unknown service is NOT_FOUND" "$ERR" "NOT_FOUND"
# The target from the environment, and flags after the subcommand.
run "ATTENTION_TARGET" 0 env ATTENTION_TARGET="$T" "$CLIENT" health && pass "target from environment"
run "flag after subcommand" 0 "$CLIENT" health --target "$T" && pass "flag after subcommand"

# models: a table, or proto JSON.
if run "models" 0 "$CLIENT" --target "$T" models; then
  expect_in "models lists built-ins" "$OUT" "dot_product"
  expect_in "models lists the repository" "$OUT" "additive_toy"
fi
if run "models --json" 0 "$CLIENT" --target "$T" models --json; then
  if /usr/bin/python3 -c '
import json, sys
models = {m["name"]: m for m in json.load(open(sys.argv[1]))["models"]}
assert models["additive_toy"]["kind"] == "additive", models["additive_toy"]
assert int(models["additive_toy"]["query_size"]) == 20, models["additive_toy"]
assert "dot_product" in models' "$OUT"; then pass "models --json"; else fail "models --json" "$(cat "$OUT")"; fi
fi

# attend: conformance answers from a file and from stdin.
for name in dot_product_d2l_toy additive_d2l_toy multi_head_torch_valid_lens; do
  request=$(case_request "$name")
  if run "attend $name" 0 "$CLIENT" --target "$T" attend "$request"; then
    if message=$(check_response "$name" "$OUT" 2>&1); then pass "attend $name"; else fail "attend $name" "$message"; fi
  fi
done
request=$(case_request dot_product_valid_lens_2d)
code=0
"$CLIENT" --target "$T" attend --pretty <"$request" >"$OUT" 2>"$ERR" || code=$?
if [[ $code == 0 ]] && /usr/bin/python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$OUT" \
    && [[ $(wc -l <"$OUT") -gt 1 ]]; then
  pass "attend from stdin, --pretty"
else
  fail "attend from stdin, --pretty" "exit $code: $(head -c 300 "$ERR")"
fi

# attend errors: the server's code and message, or bad input (exit 2).
echo '{"model": "no_such_model", "queries": {"shape": [1, 1, 1], "data": [1]}}' >"$CLIENT_TEST_TMP/unknown.json"
run "attend unknown model" 1 "$CLIENT" --target "$T" attend "$CLIENT_TEST_TMP/unknown.json" \
  && expect_in "unknown model is NOT_FOUND" "$ERR" "NOT_FOUND"
echo '{"model": "dot_product", "queries": {"shape": [1, 1, 2], "data": [1]}}' >"$CLIENT_TEST_TMP/short.json"
run "attend malformed request" 1 "$CLIENT" --target "$T" attend "$CLIENT_TEST_TMP/short.json" \
  && expect_in "malformed request is INVALID_ARGUMENT" "$ERR" "INVALID_ARGUMENT"
echo '{"model": "dot_product", "querys": {}}' >"$CLIENT_TEST_TMP/typo.json"
run "attend unknown field" 2 "$CLIENT" --target "$T" attend "$CLIENT_TEST_TMP/typo.json" \
  && expect_in "unknown field is named" "$ERR" "querys"
run "attend missing file" 2 "$CLIENT" --target "$T" attend "$CLIENT_TEST_TMP/none.json" \
  && expect_in "missing file is named" "$ERR" "none.json"

# bench --json: only one JSON object on stdout, with sane numbers.
check_bench() {  # check_bench NAME FILE MIN_REQUESTS MAX_REQUESTS DURATION WARMUP
  if /usr/bin/python3 - "$@" <<'PY'; then pass "$1"; else fail "$1" "$(cat "$2")"; fi
import json, sys
name, path, low, high = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
duration, warmup = float(sys.argv[5]), float(sys.argv[6])
text = open(path).read()
result = json.loads(text)  # fails on anything besides the one object
assert text.count("\n") == 1, "more than one line on stdout"
assert low <= result["requests"] <= high, f"requests {result['requests']} not in [{low}, {high}]"
assert result["errors"] == 0 and result["errors_by_code"] == {}, "errors"
assert result.get("skipped", 0) == 0, "skipped without --max-in-flight"
assert abs(result["throughput_rps"] * duration - result["requests"]) < 1e-6, "throughput != requests / duration"
l = result["latency_ms"]
assert 0 < l["p50"] <= l["p90"] <= l["p95"] <= l["p99"] <= l["max"], l
# An answer inside the window was sent after the run began.
assert l["max"] <= (warmup + duration) * 1000, l
PY
}
if run "bench closed loop" 0 "$CLIENT" --target "$T" bench --concurrency 4 --duration 2 --warmup 0.5 --json; then
  check_bench "bench closed loop" "$OUT" 10 100000000 2 0.5
fi
# Open loop at 50/s schedules 100 calls in the 2 s window and 125 in all:
# a rate far off either way fails.
if run "bench open loop" 0 "$CLIENT" --target "$T" bench --rate 50 --duration 2 --warmup 0.5 \
    --model additive_toy --batch 2 --n 8 --json; then
  check_bench "bench open loop" "$OUT" 50 125 2 0.5
fi
# With at most 1 call in flight, an open loop far faster than one round trip
# skips calls: every call due in the window is either answered or skipped.
if run "bench open loop max in flight" 0 "$CLIENT" --target "$T" bench --rate 20000 \
    --max-in-flight 1 --duration 1 --warmup 0 --json; then
  if /usr/bin/python3 - "$OUT" <<'PY'; then pass "bench max in flight skips"; else fail "bench max in flight skips" "$(cat "$OUT")"; fi
import json, sys
result = json.loads(open(sys.argv[1]).read())
assert result["max_in_flight"] == 1, result
assert result["skipped"] > 0 and result["errors"] == 0, result
assert abs(result["requests"] + result["skipped"] - 20000) <= 2, result
PY
fi
code=0
"$CLIENT" --target "$T" bench --max-in-flight 4 --duration 0.5 >"$OUT" 2>"$ERR" || code=$?
if [[ $code != 0 ]] && grep -q "requires --rate" "$ERR"; then
  pass "bench rejects --max-in-flight without --rate"
else
  fail "bench rejects --max-in-flight without --rate" "exit $code: $(cat "$ERR")"
fi
request=$(case_request multi_head_d2l_toy)
if run "bench text" 0 "$CLIENT" --target "$T" bench --request "$request" --duration 0.5 --warmup 0; then
  expect_in "bench text shows throughput" "$OUT" "throughput"
  expect_in "bench text shows p99" "$OUT" "p99"
  expect_in "bench text names the model" "$OUT" "model mh_d2l_toy"
fi
# Session mode: concurrent AttendSession streams, steps/s, tokens/s and
# step latency; every step answered (4 sessions x 20 steps x 2 tokens).
if run "bench sessions" 0 "$CLIENT" --target "$T" bench --sessions 4 --steps-per-session 20 \
    --tokens-per-step 2 --model mh_torch_small --json; then
  if /usr/bin/python3 - "$OUT" <<'PY'; then pass "bench sessions counts every step"; else fail "bench sessions counts every step" "$(cat "$OUT")"; fi
import json, sys
r = json.load(open(sys.argv[1]))
assert r["steps"] == 80 and r["errors"] == 0, r
assert r["tokens_per_s"] == 2 * r["steps_per_s"] > 0, r
assert 0 < r["step_latency_ms"]["p50"] <= r["step_latency_ms"]["max"], r
# The client's own CPU: some, and no more than its threads could use in the run.
assert 0 < r["client_cpu_s"] <= r["wall_s"] * (4 + 2), r
assert abs(r["client_cpu_us_per_token"] - r["client_cpu_s"] * 1e6 / 160) < 1e-6 * r["client_cpu_s"] * 1e6, r
PY
fi
run "bench sessions text" 0 "$CLIENT" --target "$T" bench --sessions 1 --steps-per-session 3 \
    --model mh_torch_small && expect_in "bench sessions text shows tokens/s" "$OUT" "tokens/s"
run "bench sessions refused" 1 "$CLIENT" --target "$T" bench --sessions 1 --steps-per-session 3 \
    --model additive_toy
run "bench unknown model" 2 "$CLIENT" --target "$T" bench --model nope --duration 0.5 \
  && expect_in "bench unknown model lists the models" "$ERR" "additive_toy"
code=0
"$CLIENT" --target "$T" bench --rate 5 --concurrency 2 >"$OUT" 2>"$ERR" || code=$?
if [[ $code != 0 ]] && grep -q "excludes" "$ERR"; then
  pass "bench rejects --rate with --concurrency"
else
  fail "bench rejects --rate with --concurrency" "exit $code: $(cat "$ERR")"
fi

# The progress line: on stderr when it is a terminal, and never otherwise.
if command -v script >/dev/null; then
  script -qec "'$CLIENT' --target '$T' bench --duration 1.2 --warmup 0 --json" /dev/null >"$OUT" 2>&1 || true
  expect_in "progress line on a terminal" "$OUT" "answered"
  run "no progress line in a pipe" 0 "$CLIENT" --target "$T" bench --duration 1.2 --warmup 0 --json
  if grep -q answered "$ERR"; then fail "no progress line in a pipe" "$(cat "$ERR")"; else pass "no progress line in a pipe"; fi
else
  fail "progress line" "the script command (util-linux) is missing"
fi

# The C++ example: q = (1, 0) over keys (1, 0), (0, 1), (-1, 0) with values
# 10, 20, 30; scores q.k / sqrt(2).
if run "C++ example" 0 "$EXAMPLE" "$T"; then
  if /usr/bin/python3 - "$OUT" <<'PY'; then pass "C++ example answer"; else fail "C++ example answer" "$(cat "$OUT")"; fi
import math, sys
lines = dict(line.split(":", 1) for line in open(sys.argv[1]).read().splitlines())
output = [float(x) for x in lines["output"].split()]
weights = [float(x) for x in lines["weights"].split()]
scores = [s / math.sqrt(2) for s in (1.0, 0.0, -1.0)]
expected = [math.exp(s) / sum(math.exp(t) for t in scores) for s in scores]
assert all(abs(w - e) < 1e-5 for w, e in zip(weights, expected)) and len(weights) == 3, weights
assert len(output) == 1 and abs(output[0] - sum(w * v for w, v in zip(expected, (10, 20, 30)))) < 1e-3, output
PY
fi

# Bearer token: refused without it, accepted from --token-file and ATTENTION_TOKEN.
printf '# tokens\ns3cret\n' >"$CLIENT_TEST_TMP/tokens"
printf 's3cret\n' >"$CLIENT_TEST_TMP/token"
start_server "$SERVER_BIN" --auth-token-file "$CLIENT_TEST_TMP/tokens"
run "no token" 1 "$CLIENT" --target "$SERVER_ADDRESS" models && expect_in "no token is UNAUTHENTICATED" "$ERR" UNAUTHENTICATED
run "--token-file" 0 "$CLIENT" --target "$SERVER_ADDRESS" --token-file "$CLIENT_TEST_TMP/token" models && pass "--token-file"
run "ATTENTION_TOKEN" 0 env ATTENTION_TOKEN=s3cret "$CLIENT" --target "$SERVER_ADDRESS" models && pass "ATTENTION_TOKEN"
run "health needs no token" 0 "$CLIENT" --target "$SERVER_ADDRESS" health && pass "health needs no token"
stop_server "$SERVER_PID"

# A stopped server: health fails (exit 1), after its retries.
run "health of a stopped server" 1 "$CLIENT" --target "$SERVER_ADDRESS" --timeout 5 health \
  && expect_in "stopped server is UNAVAILABLE" "$ERR" UNAVAILABLE

echo "client_cli_test: $passed passed, $failed failed"
((failed == 0))

#!/usr/bin/env bash
# node_test.sh: the Node client (client/node) against a real
# attention-server: installs its locked dependencies (npm ci), then checks that
# example.js lists the models and answers a conformance case correctly, that
# the module reports a server error with its gRPC code, and runs
# node_stream_test.js (attendStream) and node_attend_test.js (large attend
# calls: the reused request buffer, answers as views) against the same
# server, node_secure_test.js (token and TLS options) against TLS servers,
# node_unary_test.js (unary calls over node:http2: a scripted HTTP/2 server,
# and servers it starts itself), node_session_test.js (sessions, and their
# replay when their server is lost, on servers it starts) and
# node_wire_test.js (the module's own protobuf encoding, no server).
# Exits 77 (a skip, for ctest) only when node or npm is missing.
#
#   tests/client/node_test.sh SERVER_BINARY
set -euo pipefail

SERVER_BIN=$1
SOURCE_DIR=$(cd "$(dirname "$0")/../.." && pwd)
TEST_NAME=client_node_test
source "$SOURCE_DIR/tests/support/node.sh"
source "$SOURCE_DIR/tests/support/server.sh"

start_server "$SERVER_BIN" --model-repository "$SOURCE_DIR/tests/conformance/models"
passed=0
failed=0
pass() { echo "PASS $1"; passed=$((passed + 1)); }
fail() { echo "FAIL $1"; failed=$((failed + 1)); }
out=$CLIENT_TEST_TMP/node.out

for name in dot_product_d2l_toy additive_d2l_toy multi_head_torch_kvdim; do
  if node "$NODE_DIR/example.js" --target "$SERVER_ADDRESS" "$(case_request "$name")" >"$out" 2>&1 \
      && grep -q "additive_toy (additive)" "$out" && check_response "$name" "$out"; then
    pass "example.js $name"
  else
    fail "example.js $name: $(head -c 600 "$out")"
  fi
done

# Without a request file the example sends the d2l toy; weights past each
# example's valid length (2, 6) must be (about) zero, and every row sums to 1.
if node "$NODE_DIR/example.js" --target "$SERVER_ADDRESS" >"$out" 2>&1 && /usr/bin/python3 - "$out" <<'PY'
import json, sys
response = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
weights = response["attention_weights"]
assert weights["shape"] == [2, 1, 10], weights["shape"]
rows = [weights["data"][:10], weights["data"][10:]]
for row, valid in zip(rows, (2, 6)):
    assert abs(sum(row) - 1) < 1e-5, row
    assert all(w < 1e-6 for w in row[valid:]), row
    assert all(w > 0 for w in row[:valid]), row
assert response["output"]["shape"] == [2, 1, 4]
PY
then
  pass "example.js toy request"
else
  fail "example.js toy request: $(head -c 600 "$out")"
fi

# Errors come back as rejections with the gRPC code.
if node -e '
const { AttentionClient } = require(process.argv[1]);
const client = new AttentionClient(process.argv[2]);
client.attend({ model: "no_such_model", queries: { shape: [1, 1, 1], data: [1] } })
  .then(() => { console.error("no error"); process.exit(1); })
  .catch((error) => { client.close(); process.exit(error.code === 5 ? 0 : 1); });
' "$NODE_DIR/attention_client.js" "$SERVER_ADDRESS"; then
  pass "unknown model rejects with NOT_FOUND"
else
  fail "unknown model rejects with NOT_FOUND"
fi

# Token and TLS options, against a TLS server that wants a token and a mutual
# TLS one (certificates: tests/support/make_pki.sh).
pki=$CLIENT_TEST_TMP/pki
mkdir "$pki"
printf 's3cret\n' >"$pki/tokens"
if bash "$SOURCE_DIR/tests/support/make_pki.sh" "$pki" ca rogue -- \
    "server/ca/DNS:localhost,IP:127.0.0.1" client/ca intruder/rogue; then
  plain_address=$SERVER_ADDRESS
  start_server "$SERVER_BIN" --tls-cert "$pki/server.crt" --tls-key "$pki/server.key" \
    --auth-token-file "$pki/tokens"
  tls_token_address=$SERVER_ADDRESS
  start_server "$SERVER_BIN" --tls-cert "$pki/server.crt" --tls-key "$pki/server.key" \
    --tls-client-ca "$pki/ca.crt"
  mutual_address=$SERVER_ADDRESS
  SERVER_ADDRESS=$plain_address
  if node "$SOURCE_DIR/tests/client/node_secure_test.js" "$pki" "$tls_token_address" \
      "$mutual_address" >"$out" 2>&1; then
    pass "node_secure_test.js"
  else
    cat "$out"
    fail "node_secure_test.js"
  fi
else
  cat "$pki/openssl.log"
  fail "make_pki.sh"
fi

if node "$SOURCE_DIR/tests/client/node_stream_test.js" "$SERVER_ADDRESS" >"$out" 2>&1; then
  pass "node_stream_test.js"
else
  cat "$out"
  fail "node_stream_test.js"
fi

if node "$SOURCE_DIR/tests/client/node_attend_test.js" "$SERVER_ADDRESS" >"$out" 2>&1; then
  pass "node_attend_test.js"
else
  cat "$out"
  fail "node_attend_test.js"
fi

if node "$SOURCE_DIR/tests/client/node_unary_test.js" "$SERVER_BIN" "$SOURCE_DIR/tests/conformance/models" \
    >"$out" 2>&1; then
  pass "node_unary_test.js"
else
  cat "$out"
  fail "node_unary_test.js"
fi

if node "$SOURCE_DIR/tests/client/node_session_test.js" "$SERVER_BIN" \
    "$SOURCE_DIR/tests/conformance/models" >"$out" 2>&1; then
  pass "node_session_test.js"
else
  cat "$out"
  fail "node_session_test.js"
fi

if node "$SOURCE_DIR/tests/client/node_wire_test.js" >"$out" 2>&1; then
  pass "node_wire_test.js"
else
  cat "$out"
  fail "node_wire_test.js"
fi

echo "client_node_test: $passed passed, $failed failed"
((failed == 0))

#!/bin/bash
# client_token_warning_test: attention-client warns when a bearer token would
# travel in plaintext to another machine (docs/api.md, section 8), whether it
# comes from --token, ATTENTION_TOKEN or --token-file; never for loopback or
# with TLS. The calls themselves fail (nothing listens there): only the
# warning on stderr matters.
#   client_token_warning_test.sh build/client/attention-client
set -u
client=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
printf 'secret\n' > "$dir/token"
failures=0
expect() {  # expect yes|no DESCRIPTION -- ARGS...
  local want=$1 what=$2; shift 3
  "$@" > /dev/null 2> "$dir/err"
  if grep -q "travels in plaintext" "$dir/err"; then got=yes; else got=no; fi
  if [ "$got" != "$want" ]; then
    echo "FAIL: $what: warning expected $want, got $got"; cat "$dir/err"; failures=$((failures + 1))
  fi
}
remote=192.0.2.1:50051  # TEST-NET-1: never routed
expect yes "--token, remote" -- "$client" --target $remote --timeout 0.2 --token secret health
expect yes "ATTENTION_TOKEN, remote" -- env ATTENTION_TOKEN=secret "$client" --target $remote --timeout 0.2 health
expect yes "--token-file, remote" -- "$client" --target $remote --timeout 0.2 --token-file "$dir/token" health
expect yes "one remote of a list" -- "$client" --target 127.0.0.1:1,$remote --timeout 0.2 --token secret health
expect no "loopback" -- "$client" --target 127.0.0.1:1 --timeout 0.2 --token secret health
expect no "localhost" -- "$client" --target localhost:1 --timeout 0.2 --token secret health
expect no "no token" -- "$client" --target $remote --timeout 0.2 health
expect no "TLS" -- "$client" --target $remote --timeout 0.2 --tls --token secret health
[ $failures -eq 0 ] && echo "client_token_warning_test: all passed"
exit $((failures > 0))

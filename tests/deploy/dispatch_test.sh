#!/usr/bin/env bash
# dispatch_test.sh: the image's attention-server dispatcher must exec the
# AVX-512 build only when the CPU has every x86-64-v4 flag, the AVX2 build when
# it has the x86-64-v3 flags, refuse a CPU without AVX2 with a clear message,
# honour ATTENTION_ISA, and pass the arguments through unchanged.
set -euo pipefail

dispatcher=$(cd "$(dirname "$0")/../.." && pwd)/deploy/attention-server-dispatch.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Stand-ins for the two server builds print which one ran and its arguments.
cp "$dispatcher" "$work/attention-server"
for isa in avx2 avx512; do
  printf '#!/bin/sh\necho "%s $*"\n' "$isa" >"$work/attention-server-$isa"
  chmod +x "$work/attention-server-$isa"
done

v3="fpu sse sse2 avx avx2 bmi1 bmi2 f16c fma abm movbe xsave"
v4="avx512f avx512bw avx512cd avx512dq avx512vl"
failures=0
passes=0

# check NAME FLAGS EXPECTED_OUTPUT [ENV...]
check() {
  local name=$1 flags=$2 expected=$3 got
  shift 3
  printf 'processor\t: 0\nflags\t\t: %s\n' "$flags" >"$work/cpuinfo"
  got=$(env ATTENTION_CPUINFO="$work/cpuinfo" "$@" "$work/attention-server" --max-batch-size 8 2>&1) || true
  if [[ $got == "$expected" ]]; then
    passes=$((passes + 1))
  else
    echo "FAIL $name: expected '$expected', got '$got'"
    failures=$((failures + 1))
  fi
}

check "x86-64-v4 cpu" "$v3 $v4" "avx512 --max-batch-size 8"
check "x86-64-v3 cpu" "$v3" "avx2 --max-batch-size 8"
check "avx512f without avx512vl" "$v3 avx512f avx512bw avx512cd avx512dq" "avx2 --max-batch-size 8"
check "forced avx2 on v4 cpu" "$v3 $v4" "avx2 --max-batch-size 8" ATTENTION_ISA=avx2
check "flag that only prefixes another" "${v3/ avx2 / avx2x } $v4" \
  "attention-server: this CPU lacks x86-64-v3 (AVX2) instructions the image needs, missing: avx2"

printf 'processor\t: 0\nflags\t\t: fpu sse sse2 fma\n' >"$work/cpuinfo"
if ATTENTION_CPUINFO="$work/cpuinfo" "$work/attention-server" 2>"$work/err"; then
  echo "FAIL: a CPU without AVX2 must make the dispatcher exit non-zero"
  failures=$((failures + 1))
elif grep -q "missing: avx avx2 bmi1 bmi2 f16c abm movbe xsave$" "$work/err"; then
  passes=$((passes + 1))
else
  echo "FAIL: no clear message for a CPU without AVX2: $(cat "$work/err")"
  failures=$((failures + 1))
fi
if ATTENTION_ISA=sse "$work/attention-server" 2>"$work/err" || ! grep -q "ATTENTION_ISA must be avx2 or avx512, got 'sse'" "$work/err"; then
  echo "FAIL: ATTENTION_ISA=sse must be refused by name: $(cat "$work/err")"
  failures=$((failures + 1))
else
  passes=$((passes + 1))
fi

echo "$passes passed, $failures failed"
((failures == 0))

#!/bin/sh
# attention-server dispatcher: the image ships two builds of the server, one
# for x86-64-v4 (AVX-512) and one for x86-64-v3 (AVX2/FMA), so that one image
# runs fast on every AVX2 machine and uses AVX-512 where the CPU has it. This
# picks the build from the CPU flags and execs it with the same arguments.
#
#   ATTENTION_ISA=avx2|avx512  forces a build (e.g. to compare them)
#   ATTENTION_CPUINFO=FILE     reads the flags from FILE instead of /proc/cpuinfo
set -eu

dir=$(dirname "$0")
flags=" $(grep -m1 '^flags' "${ATTENTION_CPUINFO:-/proc/cpuinfo}" 2>/dev/null | cut -d: -f2) "

# Prints the flags among the arguments that the CPU lacks.
missing() {
  for flag in "$@"; do
    case "$flags" in *" $flag "*) ;; *) printf ' %s' "$flag" ;; esac
  done
}

# The flag sets of the two -march levels (GCC's x86-64-v3 and x86-64-v4).
v3="avx avx2 bmi1 bmi2 f16c fma abm movbe xsave"
v4="avx512f avx512bw avx512cd avx512dq avx512vl"

isa=${ATTENTION_ISA:-}
if [ -z "$isa" ]; then
  # shellcheck disable=SC2086 # the flag lists are meant to split into words
  lacking_v3=$(missing $v3)
  if [ -n "$lacking_v3" ]; then
    echo "attention-server: this CPU lacks x86-64-v3 (AVX2) instructions the image needs, missing:$lacking_v3" >&2
    exit 1
  fi
  # shellcheck disable=SC2086
  if [ -z "$(missing $v4)" ]; then isa=avx512; else isa=avx2; fi
fi
case "$isa" in
  avx2 | avx512) ;;
  *) echo "attention-server: ATTENTION_ISA must be avx2 or avx512, got '$isa'" >&2; exit 1 ;;
esac
# OpenBLAS (behind the engine's GEMMs) picks its kernels by CPU model and does
# not use AVX-512 on every AVX-512 CPU unless told; an explicit setting wins.
if [ "$isa" = avx512 ] && [ -z "${OPENBLAS_CORETYPE:-}" ]; then
  export OPENBLAS_CORETYPE=SKYLAKEX
fi
exec "$dir/attention-server-$isa" "$@"

#!/usr/bin/env bash
# fuzz.sh: builds the libFuzzer targets of tests/fuzz (clang, ASan+UBSan) and
# runs each one for a while on a corpus seeded from tests/conformance.
#
#   scripts/fuzz.sh                 every target, 60 s each (the CI smoke run)
#   scripts/fuzz.sh -t 3600 model_file   one target for an hour
#
# Options: -t SECONDS per target (default 60), -j JOBS build jobs and targets
# fuzzed at once (default 2: each fuzzer is one process on one core, so two
# cores fuzz two targets in the time of one), -b build only (.ci/run builds
# while the Release tests run).
# Environment: ATTENTION_FUZZ_BUILD_DIR (default build-fuzz),
# ATTENTION_FUZZ_WORK_DIR (corpus and crash artifacts; default
# $ATTENTION_FUZZ_BUILD_DIR/fuzz-work). The corpus grows across runs in the
# work dir. Exits non-zero if a target finds a crash or a broken property; the
# input is left in the work dir as crash-* and must become a file in
# tests/fuzz/regressions/<target>/ once fixed.
#
# Memory: one allocation may take at most 512 MiB (-malloc_limit_mb) and the
# process 1.5 GiB (-rss_limit_mb, ASan's quarantine and the corpus included:
# 10 s runs peak near 0.5 GiB); past either, libFuzzer stops with the input
# as an out-of-memory crash. The request limits (docs/api.md section 6.2)
# hold one request to 256 MiB of floats, so an allocation above that is a
# blow-up (one valid request used to take a server to 2.2 GB).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=60
jobs=2
build_only=false
while getopts "t:j:b" opt; do
  case $opt in
    t) seconds=$OPTARG ;;
    j) jobs=$OPTARG ;;
    b) build_only=true ;;
    *) sed -n '2,24p' "$0"; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
targets=("$@")
((${#targets[@]})) || targets=(model_file request_proto request_json)

build_dir=${ATTENTION_FUZZ_BUILD_DIR:-build-fuzz}
work_dir=${ATTENTION_FUZZ_WORK_DIR:-$build_dir/fuzz-work}

# clang, and libFuzzer's runtime (libclang-rt-14-dev on Debian 12).
need=()
command -v clang++ >/dev/null || need+=(clang)
ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1 ||
  need+=(libclang-rt-14-dev)
if ((${#need[@]})); then
  apt-get -o DPkg::Lock::Timeout=600 update
  apt-get install -o DPkg::Lock::Timeout=600 -y --no-install-recommends "${need[@]}"
fi

# Build type "Fuzz" has no flags of its own: -O1 with line tables only (the
# flags OSS-Fuzz uses) compiles in far less time than -O2 -g and keeps
# file:line stacks in the reports.
CC=clang CXX=clang++ cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Fuzz \
  -DCMAKE_CXX_FLAGS="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -O1 -gline-tables-only -fno-omit-frame-pointer" \
  -DATTENTION_FUZZ=ON -DATTENTION_BUILD_TESTS=OFF -DATTENTION_BUILD_BENCHMARKS=OFF >/dev/null
nice cmake --build "$build_dir" -j "$jobs" --target write_seed_corpus \
  "${targets[@]/%/_fuzzer}"
$build_only && exit 0

mkdir -p "$work_dir"
"$build_dir"/tests/fuzz/write_seed_corpus "$work_dir/seeds"

# Fuzzes one target; its summary goes to stdout, its log to the work dir.
fuzz_target() {
  local target=$1 status=0
  local corpus=$work_dir/corpus/$target artifacts=$work_dir/artifacts/$target/
  mkdir -p "$corpus" "$artifacts"
  local dict=()
  [[ -f tests/fuzz/$target.dict ]] && dict=(-dict="tests/fuzz/$target.dict")
  echo "== $target: ${seconds}s"
  # New inputs go to the first directory; the seeds and the regressions are read.
  if ! ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 \
      "$build_dir/tests/fuzz/${target}_fuzzer" "$corpus" "$work_dir/seeds/$target" \
      "tests/fuzz/regressions/$target" "${dict[@]}" \
      -max_total_time="$seconds" -max_len=65536 -rss_limit_mb=1536 -malloc_limit_mb=512 -timeout=10 \
      -print_final_stats=1 -artifact_prefix="$artifacts" 2>"$work_dir/$target.log"; then
    status=1
    echo "!! $target failed; see $work_dir/$target.log and $artifacts"
    grep -E "FUZZ_CHECK|ERROR:|SUMMARY:" "$work_dir/$target.log" | head -n 20 || true
  fi
  grep -E "^#[0-9]+[[:space:]]+DONE|^stat::(number_of_executed_units|peak_rss_mb)" "$work_dir/$target.log" || true
  echo "corpus: $(find "$corpus" -type f | wc -l) files"
  return $status
}

# $jobs targets at a time, each in the background with its summary in a
# file; the summaries are printed in the targets' order once all are done.
status=0
pids=()
for target in "${targets[@]}"; do
  if ((${#pids[@]} >= jobs)); then
    wait "${pids[0]}" || status=1
    pids=("${pids[@]:1}")
  fi
  fuzz_target "$target" >"$work_dir/$target.summary" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do
  wait "$pid" || status=1
done
for target in "${targets[@]}"; do
  cat "$work_dir/$target.summary"
done
exit $status

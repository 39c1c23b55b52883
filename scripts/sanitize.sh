#!/usr/bin/env bash
# sanitize.sh: the tests under sanitizers, built with gcc (the compiler of the
# shipped build) in their own dirs.
#
#   asan  every ctest test but the "deploy" and "cluster" labels (the
#         cluster suite's faults run on the Release build only), with core,
#         server, client and attention-server itself built with ASan+UBSan
#         and the tests' own code with ASan (build-asan). Leaks are errors.
#   tsan  the batcher, server and reliability tests, with attention-server
#         built with TSan (build-tsan). Debian's Abseil and gRPC are not
#         instrumented: tests/tsan/absl_sync_annotations.cc (LD_PRELOADed)
#         makes absl::Mutex visible to TSan, and tests/tsan.supp silences
#         reports inside gRPC only. Nothing of ours is suppressed.
#
#   scripts/sanitize.sh            both
#   scripts/sanitize.sh tsan       one
#   scripts/sanitize.sh -b         build both, run nothing (.ci/run builds
#                                  them while the Release tests run)
# Options: -j JOBS (default 2), -b. Environment: ATTENTION_ASAN_BUILD_DIR,
# ATTENTION_TSAN_BUILD_DIR. Every sanitizer report, of a test or of a server
# it started, is written under <build dir>/sanitizer-reports/ and fails the
# run, even when the process that hit it exited 0.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

jobs=2
build_only=false
while getopts "j:b" opt; do
  case $opt in
    j) jobs=$OPTARG ;;
    b) build_only=true ;;
    *) sed -n '2,23p' "$0"; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
modes=("$@")
((${#modes[@]})) || modes=(asan tsan)

# Build type "Sanitize" has no flags of its own: -O1 -g1 compiles in about
# half the time of -O2 -g and still gives file:line stacks; assertions stay on.
# The protoc-generated code and the tests' own sources are built without
# UBSan (ATTENTION_GENERATED_CODE_OPTIONS, ATTENTION_TEST_CODE_OPTIONS in
# CMakeLists.txt): it nearly doubles their compile time, and the code it is
# there to check keeps it; ASan and TSan still instrument them. The vector
# kernels' hot loops are built at -O2 (ATTENTION_KERNEL_OPTIONS), which the
# kernel tests' run time follows.
configure() {  # build_dir, sanitizer flags
  CC=gcc CXX=g++ cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Sanitize \
    -DCMAKE_CXX_FLAGS="$2 -O1 -g1 -fno-omit-frame-pointer" -DATTENTION_BUILD_BENCHMARKS=OFF \
    -DATTENTION_GENERATED_CODE_OPTIONS=-fno-sanitize=undefined \
    -DATTENTION_TEST_CODE_OPTIONS=-fno-sanitize=undefined -DATTENTION_KERNEL_OPTIONS=-O2 >/dev/null
}

# Fails if any process reported an error in $1 (files holding only the
# "Suppressions used" summary are not errors).
check_reports() {
  local reports
  mapfile -t reports < <(grep -lE "ERROR: |runtime error|WARNING: ThreadSanitizer" "$1"/* 2>/dev/null)
  ((${#reports[@]})) || return 0
  echo "!! sanitizer reports in $1:"
  for report in "${reports[@]}"; do
    echo "== $report"
    head -n 60 "$report"
  done
  return 1
}

# build_x and run_x are called as `x || status=1`, where bash ignores
# set -e inside them: every step that can fail returns or sets the status.
asan_build=${ATTENTION_ASAN_BUILD_DIR:-build-asan}
tsan_build=${ATTENTION_TSAN_BUILD_DIR:-build-tsan}

build_asan() {
  configure "$asan_build" "-fsanitize=address,undefined -fno-sanitize-recover=undefined" || return 1
  nice cmake --build "$asan_build" -j "$jobs"
}

run_asan() {
  local status=0
  build_asan || return 1
  local reports
  reports=$(cd "$asan_build" && pwd)/sanitizer-reports
  rm -rf "$reports" && mkdir -p "$reports"
  ASAN_OPTIONS="detect_leaks=1:detect_stack_use_after_return=1:strict_string_checks=1:log_path=$reports/asan" \
  UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$reports/ubsan" \
  LSAN_OPTIONS="suppressions=$root/tests/lsan.supp" \
    ctest --test-dir "$asan_build" -LE "deploy|cluster" --output-on-failure -j "$jobs" --timeout 1200 || status=1
  check_reports "$reports" || status=1
  return $status
}

# The TSan suite's targets: the batcher, server and reliability tests and
# the server they start.
tsan_targets() {
  local pattern='^(server_[a-z_]+_test|reliability_[a-z_]+_test|attention-server)$'
  ninja -C "$tsan_build" -t targets all | sed -n 's/: phony$//p' | grep -E "$pattern"
}

build_tsan() {
  configure "$tsan_build" "-fsanitize=thread" || return 1
  local targets
  mapfile -t targets < <(tsan_targets)
  ((${#targets[@]})) || { echo "no TSan targets found in $tsan_build"; return 1; }
  nice cmake --build "$tsan_build" -j "$jobs" --target "${targets[@]}" || return 1
  g++ -std=c++20 -shared -fPIC -O1 -g tests/tsan/absl_sync_annotations.cc \
    -o "$tsan_build/libabsl_sync_annotations.so" -labsl_synchronization -ldl
}

run_tsan() {
  build_tsan || return 1
  local targets
  mapfile -t targets < <(tsan_targets)
  local build_path
  build_path=$(cd "$tsan_build" && pwd)
  local reports=$build_path/sanitizer-reports
  rm -rf "$reports" && mkdir -p "$reports"
  local tests=() status=0
  for target in "${targets[@]}"; do
    [[ $target == attention-server ]] || tests+=("$tsan_build/tests/$target")
  done
  # The server tests start their own servers; two at a time share 2 cores.
  export LD_PRELOAD=$build_path/libabsl_sync_annotations.so
  export TSAN_OPTIONS="suppressions=$root/tests/tsan.supp:history_size=4:second_deadlock_stack=1:log_path=$reports/tsan"
  printf '%s\n' "${tests[@]}" | xargs -P "$jobs" -I{} sh -c \
    '{} --gtest_brief=1 >"{}.tsan.log" 2>&1 && echo "ok   {}" || { echo "FAIL {}"; tail -n 40 "{}.tsan.log"; exit 1; }' ||
    status=1
  unset LD_PRELOAD TSAN_OPTIONS
  check_reports "$reports" || status=1
  return $status
}

status=0
for mode in "${modes[@]}"; do
  start=$SECONDS
  case $mode in
    asan | tsan) ;;
    *) echo "unknown mode '$mode' (asan or tsan)"; exit 2 ;;
  esac
  if $build_only; then
    "build_$mode" || status=1
  else
    "run_$mode" || status=1
  fi
  echo "== $mode: $((SECONDS - start)) s"
done
exit $status

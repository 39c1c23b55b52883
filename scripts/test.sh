#!/usr/bin/env bash
# test.sh: installs the dependencies, builds everything and runs every test.
# The README's test command and what CI runs. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir=${ATTENTION_BUILD_DIR:-build}
jobs=${ATTENTION_JOBS:-$(nproc)}

scripts/install-deps.sh
# Explicitly on: scripts/serve.sh may have configured the same directory
# without them, and a build with no tests would pass with nothing run.
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DATTENTION_BUILD_TESTS=ON -DATTENTION_BUILD_BENCHMARKS=ON
cmake --build "$build_dir" -j "$jobs"
ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" --timeout 900 --no-tests=error
# The summary line of the conformance suite, for the log.
"$build_dir"/tests/core_conformance_test --gtest_brief=1 | tail -n 1

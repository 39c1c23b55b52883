#!/usr/bin/env bash
# test.sh: installs the dependencies, builds everything and runs every test.
# The README's test command and what CI runs. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir=${ATTENTION_BUILD_DIR:-build}
jobs=${ATTENTION_JOBS:-$(nproc)}

scripts/install-deps.sh
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$build_dir" -j "$jobs"
ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" --timeout 900
# The summary line of the conformance suite, for the log.
"$build_dir"/tests/core_conformance_test --gtest_brief=1 | tail -n 1

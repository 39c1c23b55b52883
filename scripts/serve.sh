#!/usr/bin/env bash
# serve.sh: installs the dependencies, builds, and runs attention-server on the
# example models in models/ (gRPC on :50051, metrics on :9464/metrics).
# Extra arguments go to the server, e.g. scripts/serve.sh --max-batch-size 16.
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir=${ATTENTION_BUILD_DIR:-build}
scripts/install-deps.sh --build
# The tests and benchmarks are not configured here, so their toolchain
# (GoogleTest, Google Benchmark, Prometheus, Node) need not be installed
# (scripts/test.sh turns them back on in the same build directory).
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DATTENTION_BUILD_TESTS=OFF -DATTENTION_BUILD_BENCHMARKS=OFF
cmake --build "$build_dir" -j "$(nproc)" --target attention-server attention-client
exec "$build_dir"/server/attention-server --model-repository models "$@"

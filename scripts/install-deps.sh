#!/usr/bin/env bash
# install-deps.sh: installs every Debian 12 package the project needs to build,
# test and run. Idempotent; used by the README, .ci/run and the Dockerfile.
#
#   scripts/install-deps.sh            build + test dependencies
#   scripts/install-deps.sh --build    what building and running the binaries need,
#                                      not the test toolchain (scripts/serve.sh,
#                                      the Dockerfile's default build)
#   scripts/install-deps.sh --runtime  only the shared libraries the binaries need
set -euo pipefail

apt_opts=(-o DPkg::Lock::Timeout=600 -y --no-install-recommends)

runtime_packages=(
  libgrpc++1.51 libgrpc29 libprotobuf32 libspdlog1.10 libfmt9
  libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 libopenblas0-pthread libssl3 ca-certificates
  haproxy
)

build_packages=(
  build-essential cmake ninja-build pkg-config git
  libgrpc++-dev libgrpc-dev protobuf-compiler protobuf-compiler-grpc libprotobuf-dev
  libabsl-dev libeigen3-dev libhwy-dev libopenblas-pthread-dev libspdlog-dev libfmt-dev nlohmann-json3-dev
  prometheus-cpp-dev libcli11-dev libboost-dev rapidjson-dev libssl-dev libxxhash-dev
  grpc-proto
)

test_packages=(
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  ccache
  openssl curl
  python3 python3-numpy python3-grpcio python3-grpc-tools python3-matplotlib python3-protobuf
  python3-setuptools python3-wheel python3-venv
  prometheus python3-yaml python3-jsonschema
  python3-h2 linux-perf iproute2
)

mode=${1:-}
case $mode in
  --runtime) wanted=("${runtime_packages[@]}") ;;
  --build) wanted=("${runtime_packages[@]}" "${build_packages[@]}") ;;
  "") wanted=("${runtime_packages[@]}" "${build_packages[@]}" "${test_packages[@]}") ;;
  *) sed -n '2,11p' "$0"; exit 2 ;;
esac

missing=()
for p in "${wanted[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# The Node client's test needs node and npm; a machine that already has a
# Node.js (e.g. NodeSource's, which bundles npm) keeps it.
if [[ -z $mode ]] && ! command -v npm >/dev/null; then
  missing+=(nodejs npm)
fi
if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#wanted[@]} packages present"
  exit 0
fi

export DEBIAN_FRONTEND=noninteractive
apt-get -o DPkg::Lock::Timeout=600 update
apt-get install "${apt_opts[@]}" "${missing[@]}"

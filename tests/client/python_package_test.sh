#!/usr/bin/env bash
# python_package_test.sh: runs python_package_test.py with the Python of a
# virtual environment the package is installed in (python_install.sh), as a
# user outside the repository would: from a fresh temporary directory, with
# an environment holding only PATH=VENV_DIR/bin (so no protoc), HOME and the
# server binary's path.
#
#   tests/client/python_package_test.sh VENV_DIR SERVER_BINARY
set -euo pipefail

VENV=$1
SERVER_BIN=$2
SOURCE_DIR=$(cd "$(dirname "$0")/../.." && pwd)
outside=$(mktemp -d)
trap 'rm -rf "$outside"' EXIT
cd "$outside"
env -i PATH="$VENV/bin" HOME="$outside" ATTENTION_SERVER_BIN="$SERVER_BIN" \
  "$VENV/bin/python" "$SOURCE_DIR/tests/client/python_package_test.py"

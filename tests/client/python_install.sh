#!/usr/bin/env bash
# python_install.sh: installs the Python client package (client/python) into
# a fresh virtual environment, as a user would on Debian 12: the system's
# packages visible (--system-site-packages), offline (no index) and without
# build isolation, from the repository path. Fails unless the package
# installs, its generated stubs are in it, and the build left the source
# tree as it was. The ctest fixture "python_client" that the Python tests
# run in.
#
#   tests/client/python_install.sh VENV_DIR
set -euo pipefail

VENV=$1
SOURCE_DIR=$(cd "$(dirname "$0")/../.." && pwd)
PACKAGE_DIR=$SOURCE_DIR/client/python

rm -rf "$VENV"
/usr/bin/python3 -m venv --system-site-packages "$VENV"
stamp=$(mktemp)
trap 'rm -f "$stamp"' EXIT
"$VENV/bin/pip" install --no-index --no-build-isolation --no-input --disable-pip-version-check \
  "$PACKAGE_DIR"

installed=$("$VENV/bin/python" -c 'import attention_client; print(attention_client.__file__)')
for module in attention_pb2.py attention_pb2_grpc.py; do
  if [[ ! -f $(dirname "$installed")/$module ]]; then
    echo "FAIL the installed package has no generated $module"
    exit 1
  fi
done
# pip builds a local directory in place; setup.py sends the build elsewhere.
changed=$(find "$PACKAGE_DIR" -newer "$stamp" -print)
if [[ -n $changed ]]; then
  echo "FAIL building the package wrote into the source tree: $changed"
  exit 1
fi
echo "installed attention-client into $VENV: $installed"

# node.sh: sourced by the Node client tests. Exits 77 (a skip, for ctest)
# when node or npm is missing; otherwise installs client/node's locked
# dependencies (npm ci, which also fills npm's cache for offline installs
# of the same versions) and refreshes the package's copy of the proto.
#
#   SOURCE_DIR=... TEST_NAME=client_node_test source tests/support/node.sh   # sets NODE_DIR

NODE_DIR=$SOURCE_DIR/client/node

for tool in node npm; do
  if ! command -v "$tool" >/dev/null; then
    echo "SKIP $TEST_NAME: '$tool' is not installed (Debian: nodejs npm)"
    exit 77
  fi
done

# npm ci reinstalls exactly the lockfile; skipped when node_modules was
# installed from this very lockfile (a copy is kept there as a stamp).
node_stamp=$NODE_DIR/node_modules/.attention-installed-lock.json
if ! cmp -s "$NODE_DIR/package-lock.json" "$node_stamp" 2>/dev/null; then
  if ! (cd "$NODE_DIR" && npm ci --no-audit --no-fund --loglevel=error); then
    echo "FAIL npm ci in client/node"
    exit 1
  fi
  cp "$NODE_DIR/package-lock.json" "$node_stamp"
fi
# The proto the module loads is the package's copy; refreshed here, since
# npm ci (which makes it) is skipped when the lockfile is unchanged.
node "$NODE_DIR/prepare.js"

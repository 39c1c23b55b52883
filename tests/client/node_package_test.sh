#!/usr/bin/env bash
# node_package_test.sh: the Node client as a user gets it. `npm pack` of
# client/node must hold the module, its types, the proto and the LICENSE
# (and nothing of the checkout); the tarball is installed offline into a
# temporary project outside the repository (its dependencies from npm's
# cache, at client/node's locked versions); there node_package_test.js sends
# every conformance case and every errors.json request through attend and
# attendStream against a real attention-server, and `tsc --noEmit --strict`
# checks node_package_check.ts against the package's index.d.ts.
# Exits 77 (a skip, for ctest) only when node or npm is missing.
#
#   tests/client/node_package_test.sh SERVER_BINARY
set -euo pipefail

SERVER_BIN=$1
SOURCE_DIR=$(cd "$(dirname "$0")/../.." && pwd)
TEST_NAME=client_node_package_test
source "$SOURCE_DIR/tests/support/node.sh"
source "$SOURCE_DIR/tests/support/server.sh"

work=$CLIENT_TEST_TMP/package
mkdir -p "$work/project"
(cd "$NODE_DIR" && npm pack --pack-destination "$work" --loglevel=error >/dev/null)
version=$(node -p "require('$NODE_DIR/package.json').version")
tarball=$work/attention-client-$version.tgz

expected="package/LICENSE
package/attention_client.js
package/errors.js
package/example.js
package/index.d.ts
package/package.json
package/proto/attention/v1/attention.proto
package/session.js
package/unary.js
package/wire.js"
contents=$(tar tzf "$tarball" | sort)
if [[ $contents != "$expected" ]]; then
  echo "FAIL the tarball holds:"
  echo "$contents"
  echo "expected:"
  echo "$expected"
  exit 1
fi
echo "PASS npm pack: $(basename "$tarball") holds the module, types, proto and LICENSE"

# The project's lockfile: the tarball, and client/node's locked runtime
# dependencies (the same tree, hoisted), so that npm ci installs offline.
node - "$NODE_DIR/package-lock.json" "$tarball" "$work/project" <<'JS'
const fs = require('fs');
const path = require('path');
const [lockPath, tarball, project] = process.argv.slice(2);
const lock = JSON.parse(fs.readFileSync(lockPath, 'utf8'));
const client = lock.packages[''];
const spec = `file:${path.relative(project, tarball)}`;
const root = { name: 'attention-client-check', version: '1.0.0', dependencies: { 'attention-client': spec } };
const packages = { '': root };
packages['node_modules/attention-client'] = {
  version: client.version, resolved: spec, license: client.license, dependencies: client.dependencies,
};
for (const [where, entry] of Object.entries(lock.packages)) {
  if (where !== '' && !entry.dev) packages[where] = entry;
}
fs.writeFileSync(path.join(project, 'package.json'), JSON.stringify(root, null, 2));
fs.writeFileSync(path.join(project, 'package-lock.json'),
  JSON.stringify({ name: root.name, version: root.version, lockfileVersion: 3, requires: true, packages }, null, 2));
JS
if ! (cd "$work/project" && npm ci --offline --no-audit --no-fund --loglevel=error); then
  echo "FAIL installing the tarball offline (npm's cache lacks a locked dependency: run npm ci in client/node)"
  exit 1
fi
echo "PASS the tarball installs offline into a project outside the repository"

cp "$SOURCE_DIR/tests/client/node_package_test.js" "$SOURCE_DIR/tests/client/node_package_check.ts" \
  "$work/project/"
start_server "$SERVER_BIN" --model-repository "$SOURCE_DIR/tests/conformance/models"
cmake_version=$(sed -n 's/^project([a-z_]* VERSION \([0-9.]*\).*/\1/p' "$SOURCE_DIR/CMakeLists.txt")
(cd "$work/project" && node node_package_test.js "$SERVER_ADDRESS" "$SOURCE_DIR/tests/conformance" \
  "$cmake_version")
(cd "$work/project" && "$NODE_DIR/node_modules/.bin/tsc" --noEmit --strict --target es2020 \
  --module commonjs --moduleResolution node node_package_check.ts)
echo "PASS tsc --noEmit --strict on node_package_check.ts"

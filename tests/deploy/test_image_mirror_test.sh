#!/usr/bin/env bash
# test_image_mirror_test.sh: deploy/test-image.sh seeds its base images from
# the Debian mirror of the host's own apt sources (the tree names none). Its
# --print-mirrors is run on made-up apt directories in both source formats,
# with entries that must be skipped, and with the DEBIAN_MIRROR override.
set -euo pipefail

script=$(cd "$(dirname "$0")/../.." && pwd)/deploy/test-image.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

passed=0
failed=0
# expect name, apt dir, expected mirror, expected security mirror
expect() {
  local name=$1 dir=$2 got
  got=$(DEBIAN_MIRROR=${DEBIAN_MIRROR:-} "$script" --print-mirrors "$dir" 2>&1 | paste -sd ' ') || true
  if [[ $got == "$3 $4" ]]; then
    echo "ok   $name"
    passed=$((passed + 1))
  else
    echo "FAIL $name: got '$got', expected '$3 $4'"
    failed=$((failed + 1))
  fi
}

# One-line format: deb-src, commented-out and other suites' lines come first
# and must be skipped; options in brackets may hold spaces.
mkdir -p "$work/one-line/sources.list.d"
cat >"$work/one-line/sources.list" <<'EOF'
# deb http://commented.invalid/debian bookworm main
deb-src http://source.invalid/debian bookworm main
deb http://other-suite.invalid/debian bullseye main
  deb [ arch=amd64 signed-by=/usr/share/keyrings/debian-archive-keyring.gpg ] http://one.invalid/debian/ bookworm main contrib
deb http://one.invalid/debian-security bookworm-security main
deb http://later.invalid/debian bookworm main
EOF
expect "sources.list, one-line format" "$work/one-line" \
  http://one.invalid/debian http://one.invalid/debian-security

# deb822 format: a disabled stanza and a deb-src one come first; comments
# inside a stanza; several URIs (the first is taken); key case is free.
mkdir -p "$work/deb822/sources.list.d"
cat >"$work/deb822/sources.list.d/debian.sources" <<'EOF'
Types: deb
URIs: http://disabled.invalid/debian
Suites: bookworm
Components: main
Enabled: no

Types: deb-src
URIs: http://source.invalid/debian
Suites: bookworm

Types: deb deb-src
# a comment inside the stanza
URIs: http://822.invalid/debian http://second.invalid/debian
suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://822.invalid/debian-security
Suites: bookworm-security
Components: main
EOF
expect "sources.list.d/*.sources, deb822 format" "$work/deb822" \
  http://822.invalid/debian http://822.invalid/debian-security

# Both formats in sources.list.d, with a third-party repository and a file
# whose name ends neither in .list nor .sources (ignored, as apt does); no
# security source: it is taken beside the main archive.
mkdir -p "$work/mixed/sources.list.d"
printf 'deb http://third-party.invalid/apt nodistro main\n' >"$work/mixed/sources.list.d/a.list"
printf 'deb http://ignored.invalid/debian bookworm main\n' >"$work/mixed/sources.list.d/b.list.disabled"
printf 'Types: deb\nURIs: http://mixed.invalid/debian\nSuites: bookworm\n' \
  >"$work/mixed/sources.list.d/c.sources"
expect "mixed formats, no security source" "$work/mixed" \
  http://mixed.invalid/debian http://mixed.invalid/debian-security

# The override wins over the host's sources.
DEBIAN_MIRROR=http://override.invalid/debian expect "DEBIAN_MIRROR overrides" "$work/deb822" \
  http://override.invalid/debian http://override.invalid/debian-security

# No bookworm source at all: the script fails and says what to set.
mkdir -p "$work/none/sources.list.d"
cp "$work/mixed/sources.list.d/a.list" "$work/none/sources.list.d/"
if out=$("$script" --print-mirrors "$work/none" 2>&1); then
  echo "FAIL no bookworm source: exited 0 with '$out'"
  failed=$((failed + 1))
elif [[ $out == *DEBIAN_MIRROR* ]]; then
  echo "ok   no bookworm source: fails naming DEBIAN_MIRROR"
  passed=$((passed + 1))
else
  echo "FAIL no bookworm source: message '$out' does not name DEBIAN_MIRROR"
  failed=$((failed + 1))
fi

echo "$passed passed, $failed failed"
((failed == 0))

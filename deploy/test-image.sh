#!/usr/bin/env bash
# test-image.sh: builds the container image from the Dockerfile with buildah
# (no Docker engine or registry needed) and checks that it really serves:
# gRPC health through the image's own HEALTHCHECK command, one Attend, the
# same request as REST infer (port 8000), and a /metrics scrape. The Debian
# base images are seeded from debootstrap into buildah's local storage, so
# nothing is pulled from a registry.
#
#   deploy/test-image.sh           seed (once), build, run, check, clean up
#   deploy/test-image.sh --seed    only seed the base images
#   deploy/test-image.sh --run-only   skip the build: check an image kept by KEEP_IMAGE=1
#   KEEP_IMAGE=1 deploy/test-image.sh   keep the built image afterwards
#   BUILD_ARGS="--build-arg ATTENTION_TESTS=ON" deploy/test-image.sh
#     build the image with the test suite run in its build stage
#   BUILD_CONTEXT=DIR deploy/test-image.sh   build another tree (e.g. a
#     `git archive HEAD` export) instead of this working tree
#   DEBIAN_MIRROR=URL [DEBIAN_SECURITY_MIRROR=URL] deploy/test-image.sh
#     seed from this mirror instead of the host's (/etc/apt/sources.list*)
#   deploy/test-image.sh --print-mirrors [APT_DIR]   print the two mirrors
#     the seeding would use (read from APT_DIR, default /etc/apt) and exit
#
# Needs root (buildah with chroot isolation, debootstrap), about 15 GB of disk
# and, on 2 cores, about 4 minutes for the default build (most of an hour with
# BUILD_ARGS="--build-arg ATTENTION_TESTS=ON", which also runs the tests).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
context=${BUILD_CONTEXT:-$repo}
image=localhost/attention-server:test
mirror=""           # set by choose_mirrors, only when seeding
security_mirror=""
seed_dir=${SEED_DIR:-/var/tmp/attention-seed}
buildah_opts=(--storage-driver "${BUILDAH_STORAGE_DRIVER:-vfs}")

log() { printf '[test-image] %s\n' "$*" >&2; }
die() { log "FAIL: $*"; exit 1; }

ensure_tools() {
  local missing=()
  command -v buildah >/dev/null || missing+=(buildah)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  command -v curl >/dev/null || missing+=(curl)
  command -v objdump >/dev/null || missing+=(binutils)
  if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    apt-get -o DPkg::Lock::Timeout=600 update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      -o DPkg::Lock::Timeout=600 "${missing[@]}"
  fi
}

have_image() { buildah "${buildah_opts[@]}" inspect --type image "$1" >/dev/null 2>&1; }

# Commits a root file system directory as localhost/<name of the official
# image>: buildah looks a short name (the Dockerfile's FROM debian:bookworm)
# up under localhost/ too, so the FROM lines resolve locally with
# --pull=never and no registry is named here.
commit_rootfs() {
  local rootfs=$1 name=$2 ctr
  ctr=$(buildah "${buildah_opts[@]}" from scratch)
  tar -C "$rootfs" -cf "$seed_dir/$(basename "$rootfs").tar" .
  buildah "${buildah_opts[@]}" add "$ctr" "$seed_dir/$(basename "$rootfs").tar" /
  rm -f "$seed_dir/$(basename "$rootfs").tar"
  buildah "${buildah_opts[@]}" config \
    --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd bash "$ctr"
  buildah "${buildah_opts[@]}" commit --rm "$ctr" "$name" >/dev/null
  log "seeded $name"
}

# Prints the URI of the first enabled `deb` source of each of the suites
# named in $2.. ("bookworm" for the archive, "bookworm-security"), one line
# per suite, "-" where none is found, reading the apt configuration under $1:
# sources.list and sources.list.d/*.list (one-line format, "deb [options] URI
# suite components") and sources.list.d/*.sources (deb822 stanzas with
# Types:, URIs:, Suites: and maybe Enabled: no). The tree names no mirror of
# its own: the host's apt already reaches one.
apt_source_uris() {
  local apt_dir=$1 files=()
  shift
  local f
  for f in "$apt_dir/sources.list" "$apt_dir"/sources.list.d/*.list "$apt_dir"/sources.list.d/*.sources; do
    [[ -f $f ]] && files+=("$f")
  done
  awk -v wanted="$*" '
    function take(uris, suites,   n, i, s, u) {
      split(suites, s, /[ \t]+/)
      split(uris, u, /[ \t]+/)
      for (i in s)
        if (s[i] in found && found[s[i]] == "-") found[s[i]] = u[1]
    }
    function flush() {
      if (types ~ /(^|[ \t])deb([ \t]|$)/ && enabled != "no") take(uris, suites)
      types = uris = suites = enabled = ""
    }
    BEGIN { n = split(wanted, w, " "); for (i = 1; i <= n; i++) found[w[i]] = "-" }
    FNR == 1 { flush() }
    FILENAME ~ /\.sources$/ {
      if ($0 ~ /^[ \t]*$/) { flush(); next }
      if ($0 ~ /^#/) next
      key = tolower($1); value = $0; sub(/^[^:]*:[ \t]*/, "", value); sub(/[ \t]+$/, "", value)
      if (key == "types:") types = value
      else if (key == "uris:") uris = value
      else if (key == "suites:") suites = value
      else if (key == "enabled:") enabled = tolower(value)
      next
    }
    $1 == "deb" {
      line = $0; sub(/#.*/, "", line)
      # Options in brackets ("[arch=amd64 signed-by=...]") may hold spaces.
      gsub(/\[[^]]*\]/, "", line)
      split(line, f, /[ \t]+/)
      # f[1] is empty when the line had leading blanks.
      i = (f[1] == "") ? 2 : 1
      if (f[i + 2] in found && found[f[i + 2]] == "-") found[f[i + 2]] = f[i + 1]
    }
    END { flush(); for (i = 1; i <= n; i++) print found[w[i]] }
  ' "${files[@]}" /dev/null
}

# Sets mirror and security_mirror: DEBIAN_MIRROR and DEBIAN_SECURITY_MIRROR
# if set, else the host's sources for bookworm and bookworm-security (the
# security archive beside the main one if the host has none).
choose_mirrors() {
  local apt_dir=${1:-/etc/apt} found
  mapfile -t found < <(apt_source_uris "$apt_dir" bookworm bookworm-security)
  mirror=${DEBIAN_MIRROR:-${found[0]%/}}
  [[ -n $mirror && $mirror != - ]] ||
    die "no bookworm source in $apt_dir/sources.list*; set DEBIAN_MIRROR to a Debian mirror"
  security_mirror=${DEBIAN_SECURITY_MIRROR:-${found[1]%/}}
  if [[ -z $security_mirror || $security_mirror == - || -n ${DEBIAN_MIRROR:-} && -z ${DEBIAN_SECURITY_MIRROR:-} ]]; then
    security_mirror=${mirror%/debian}/debian-security
  fi
}

# The official images' apt sources (deb822), so the build sees security updates.
write_sources() {
  local rootfs=$1
  rm -f "$rootfs/etc/apt/sources.list"
  cat >"$rootfs/etc/apt/sources.list.d/debian.sources" <<SOURCES
Types: deb
URIs: $mirror
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $security_mirror
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
}

# debootstrap mounts /proc (and may bind /dev) in the target; a failed run can
# leave them mounted, and rm -rf must never walk into the host's /dev.
unmount_under() {
  local dir mounts
  dir=$(realpath "$1")
  mounts=$(awk -v d="$dir/" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r)
  for m in $mounts; do umount -l "$m"; done
}

seed_base_images() {
  if have_image localhost/debian:bookworm && have_image localhost/debian:bookworm-slim; then
    log "base images already seeded"
    return
  fi
  choose_mirrors
  log "Debian mirror $mirror, security $security_mirror"
  mkdir -p "$seed_dir"
  local full=$seed_dir/bookworm slim=$seed_dir/bookworm-slim
  [[ -d $full ]] && unmount_under "$full"
  if [[ ! -f $seed_dir/bookworm.done ]]; then
    rm -rf "$full"
    log "debootstrap bookworm (minbase) into $full"
    nice debootstrap --variant=minbase bookworm "$full" "$mirror" >"$seed_dir/debootstrap.log" 2>&1 ||
      die "debootstrap failed, see $seed_dir/debootstrap.log"
    touch "$seed_dir/bookworm.done"
  fi
  write_sources "$full"
  rm -rf "$full"/var/lib/apt/lists/* "$full"/var/cache/apt/archives/*.deb
  # slim = the same system without documentation, as the official -slim image.
  rm -rf "$slim"
  cp -a "$full" "$slim"
  rm -rf "$slim"/usr/share/doc/* "$slim"/usr/share/man/* "$slim"/usr/share/info/*
  commit_rootfs "$full" localhost/debian:bookworm
  commit_rootfs "$slim" localhost/debian:bookworm-slim
  rm -rf "$slim"
}

build_image() {
  log "building $image (buildah bud, chroot isolation)"
  local start=$SECONDS
  local build_args
  read -r -a build_args <<<"${BUILD_ARGS:-}"
  nice buildah "${buildah_opts[@]}" bud --pull=never --isolation chroot --format docker \
    --layers "${build_args[@]}" -t "$image" -f "$context/Dockerfile" "$context"
  log "image built in $((SECONDS - start)) s"
}

free_port() {
  /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# Prints one field of the image's (Docker-format) config as JSON.
image_config() {
  buildah "${buildah_opts[@]}" inspect --type image "$image" |
    /usr/bin/python3 -c 'import json, sys; print(json.dumps(json.load(sys.stdin)["Docker"]["config"].get(sys.argv[1])))' "$1"
}

# Prints the pid of the server below a process: the first descendant whose
# executable is the image's attention-server.
find_server_process() {
  local pid child exe
  for child in $(ps -o pid= --ppid "$1"); do
    exe=$(readlink "/proc/$child/exe" || true)
    if [[ $exe == */usr/local/bin/attention-server ]]; then
      echo "$child"
      return
    fi
    pid=$(find_server_process "$child")
    [[ -n $pid ]] && { echo "$pid"; return; }
  done
  true
}

ctr=""
server_pid=""
cleanup() {
  [[ -n $server_pid ]] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
  [[ -n $ctr ]] && buildah "${buildah_opts[@]}" rm "$ctr" >/dev/null 2>&1
  if [[ -z ${KEEP_IMAGE:-} ]] && have_image "$image"; then
    buildah "${buildah_opts[@]}" rmi "$image" >/dev/null 2>&1 || true
  fi
  true
}

run_and_check() {
  local grpc_port metrics_port http_port workdir entrypoint healthcheck
  workdir=$(mktemp -d)
  grpc_port=$(free_port)
  metrics_port=$(free_port)
  http_port=$(free_port)
  ctr=$(buildah "${buildah_opts[@]}" from --pull=never "$image")

  entrypoint=$(image_config Entrypoint)
  [[ $entrypoint == '["attention-server"]' ]] || die "unexpected entrypoint $entrypoint"
  [[ $(image_config User) == '"10001"' ]] || die "image does not run as user 10001"
  image_config ExposedPorts | grep -q '"50051/tcp"' || die "50051 not exposed"
  image_config ExposedPorts | grep -q '"9464/tcp"' || die "9464 not exposed"
  image_config ExposedPorts | grep -q '"8000/tcp"' || die "8000 (REST) not exposed"
  # One build carries every kernel path: AVX-512 code (zmm registers) is in
  # it, chosen at run time only where the CPU has it (this check needs no
  # AVX-512 CPU).
  local root
  root=$(buildah "${buildah_opts[@]}" mount "$ctr")
  (($(objdump -d --no-show-raw-insn "$root/usr/local/bin/attention-server" | grep -c zmm) > 0)) ||
    die "attention-server has no AVX-512 kernel path"
  buildah "${buildah_opts[@]}" umount "$ctr" >/dev/null
  log "attention-server carries the AVX-512 kernel path"
  local uid
  uid=$(buildah "${buildah_opts[@]}" run --isolation chroot "$ctr" -- id -u)
  [[ $uid == 10001 ]] || die "processes in the container run as uid $uid, not 10001"

  # chroot isolation shares the host's network, so the ports are picked free
  # on the host and handed over through the ATTENTION_* variables (docs/api.md 6.1).
  log "starting the image's entrypoint on 127.0.0.1:$grpc_port (metrics :$metrics_port, REST :$http_port)"
  buildah "${buildah_opts[@]}" run --isolation chroot \
    --env ATTENTION_ADDRESS="127.0.0.1:$grpc_port" \
    --env ATTENTION_METRICS_ADDRESS="127.0.0.1:$metrics_port" \
    --env ATTENTION_HTTP_ADDRESS="127.0.0.1:$http_port" \
    "$ctr" -- attention-server >"$workdir/server.log" 2>&1 &
  server_pid=$!

  healthcheck=$(image_config Healthcheck)
  log "HEALTHCHECK: $healthcheck"
  local probe
  probe=$(/usr/bin/python3 -c 'import json,sys; t=json.loads(sys.argv[1])["Test"]; print(t[1] if t[0]=="CMD-SHELL" else "")' "$healthcheck")
  [[ -n $probe ]] || die "HEALTHCHECK is not a shell command: $healthcheck"
  local healthy=""
  for _ in $(seq 60); do
    if buildah "${buildah_opts[@]}" run --isolation chroot \
        --env ATTENTION_ADDRESS="127.0.0.1:$grpc_port" "$ctr" -- sh -c "$probe" >/dev/null 2>&1; then
      healthy=1; break
    fi
    kill -0 "$server_pid" 2>/dev/null || { cat "$workdir/server.log" >&2; die "server exited"; }
    sleep 1
  done
  [[ -n $healthy ]] || { cat "$workdir/server.log" >&2; die "HEALTHCHECK never passed"; }
  log "HEALTHCHECK passed"

  buildah "${buildah_opts[@]}" run --isolation chroot "$ctr" -- \
    attention-client models --target "127.0.0.1:$grpc_port" >"$workdir/models.txt"
  local model
  for model in "$context"/models/*.safetensors; do
    model=$(basename "$model" .safetensors)
    grep -q "^$model " "$workdir/models.txt" || die "example model $model is not served from /models"
  done
  log "serves the built-ins and the example models: $(cut -d' ' -f1 "$workdir/models.txt" | tail -n +2 | paste -sd ' ')"

  cat >"$workdir/request.json" <<'JSON'
{"model": "dot_product",
 "queries": {"shape": [1, 2, 2], "data": [1, 0, 0, 1]},
 "keys": {"shape": [1, 2, 2], "data": [1, 0, 0, 1]},
 "values": {"shape": [1, 2, 1], "data": [10, 20]}}
JSON
  buildah "${buildah_opts[@]}" run --isolation chroot "$ctr" -- \
    attention-client attend --target "127.0.0.1:$grpc_port" <"$workdir/request.json" >"$workdir/response.json"
  log "Attend answered: $(tr -d '\n' <"$workdir/response.json")"
  # softmax([1/sqrt2, 0]) . [10, 20] and its mirror image, computed here.
  /usr/bin/python3 - "$workdir/response.json" <<'PY'
import json, math, sys
out = json.load(open(sys.argv[1]))["output"]
assert [int(d) for d in out["shape"]] == [1, 2, 1], out["shape"]
a = math.exp(1 / math.sqrt(2))
expected = [(10 * a + 20) / (a + 1), (10 + 20 * a) / (a + 1)]
got = out["data"]
assert all(abs(g - e) < 1e-4 for g, e in zip(got, expected, strict=True)), (got, expected)
PY

  # The same request over REST (docs/api.md section 10), in JSON.
  curl -fsS "http://127.0.0.1:$http_port/v2/models/dot_product/infer" -d '{"inputs": [
    {"name": "queries", "datatype": "FP32", "shape": [1, 2, 2], "data": [1, 0, 0, 1]},
    {"name": "keys", "datatype": "FP32", "shape": [1, 2, 2], "data": [1, 0, 0, 1]},
    {"name": "values", "datatype": "FP32", "shape": [1, 2, 1], "data": [10, 20]}]}' \
    >"$workdir/rest.json" || die "REST infer failed"
  log "REST infer answered: $(cat "$workdir/rest.json")"
  /usr/bin/python3 - "$workdir/rest.json" <<'PY'
import json, math, sys
out = json.load(open(sys.argv[1]))["outputs"][0]
assert out["name"] == "output" and out["shape"] == [1, 2, 1], out
a = math.exp(1 / math.sqrt(2))
expected = [(10 * a + 20) / (a + 1), (10 + 20 * a) / (a + 1)]
assert all(abs(g - e) < 1e-4 for g, e in zip(out["data"], expected, strict=True)), out
PY

  curl -fsS "http://127.0.0.1:$metrics_port/metrics" >"$workdir/metrics.txt"
  grep -q '^attention_requests_total{.*model="dot_product".*} [1-9]' "$workdir/metrics.txt" ||
    { grep '^attention_' "$workdir/metrics.txt" >&2 || true; die "/metrics does not count the Attend call"; }
  log "/metrics counts the Attend call"

  # buildah run kills its container on SIGTERM instead of passing it on, so the
  # signal goes to the server process itself, as a container runtime's would.
  local server_process
  server_process=$(find_server_process "$server_pid")
  [[ -n $server_process ]] || die "no attention-server process under buildah run ($server_pid)"
  log "server process $server_process; OpenBLAS core: $(tr '\0' '\n' <"/proc/$server_process/environ" |
    sed -n 's/^OPENBLAS_CORETYPE=//p' | grep . || echo "its own choice")"
  kill -TERM "$server_process"
  local rc=0
  wait "$server_pid" || rc=$?
  server_pid=""
  [[ $rc == 0 ]] || { cat "$workdir/server.log" >&2; die "server exited $rc on SIGTERM"; }
  log "server drained and exited 0 on SIGTERM"
  rm -rf "$workdir"
}

if [[ ${1:-} == --print-mirrors ]]; then
  choose_mirrors "${2:-}"
  printf '%s\n' "$mirror" "$security_mirror"
  exit 0
fi
[[ $(id -u) == 0 ]] || die "run as root (buildah chroot isolation and debootstrap need it)"
ensure_tools
seed_base_images
[[ ${1:-} == --seed ]] && exit 0
trap cleanup EXIT
if [[ ${1:-} == --run-only ]]; then
  have_image "$image" || die "no $image to check: build it first (KEEP_IMAGE=1 $0)"
else
  build_image
fi
run_and_check
log "PASS"

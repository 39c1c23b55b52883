#!/bin/bash
# model_memory.sh: resident memory per loaded model.
#
# Starts attention-server on an empty repository and on a repository of eight
# copies of one model file, waits for each to listen, and reports
# (RSS with eight models - RSS empty) / 8, and that over the model's F32
# weight bytes (the file's size for an F32 file).
#
# Usage: bench/model_memory.sh SERVER_BINARY MODEL_FILE [WEIGHT_BYTES]
#   bench/make_service_model.py makes MODEL_FILE (--precision bf16 for a bf16 one).
set -euo pipefail

server=$1
model=$2
weight_bytes=${3:-$(stat -c %s "$model")}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/empty" "$work/eight"
for i in 1 2 3 4 5 6 7 8; do cp "$model" "$work/eight/m$i.safetensors"; done

# The resident kB of a server on repository $1 once it listens.
rss_kb() {
  "$server" --address 127.0.0.1:0 --metrics-address "" --model-repository "$1" \
    >"$work/log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 600); do
    grep -q "listening on" "$work/log" && break
    sleep 0.1
  done
  sleep 0.5
  local kb
  kb=$(awk '/^VmRSS/ {print $2}' "/proc/$pid/status")
  kill -TERM "$pid"
  wait "$pid" || true
  echo "$kb"
}

empty=$(rss_kb "$work/empty")
eight=$(rss_kb "$work/eight")
per_model=$(( (eight - empty) * 1024 / 8 ))
echo "RSS empty ${empty} kB, with eight models ${eight} kB: ${per_model} bytes per model," \
  "$(awk -v a="$per_model" -v b="$weight_bytes" 'BEGIN {printf "%.3f", a / b}')x" \
  "the ${weight_bytes} F32 weight bytes"

#!/usr/bin/env bash
# Builds here everything scripts/gpu_check.sh runs on a lent GPU machine
# (which has no network and little time), into target/gpu-carry/:
#   tierzero          release, --features gpu
#   overlap           the overlap harness (examples/overlap)
#   device_overlap    the overlap harness on the GPU (examples/device_overlap)
#   kernel_check, train_check, throughput   tierzero-gpu's examples
#   tierzero-*.whl    the Python wheel (release), for step 6b
# Then, with the device tool: carry ["target/gpu-carry"] and run
#   TIERZERO_BIN=target/gpu-carry/tierzero OVERLAP_BIN=target/gpu-carry/overlap \
#   DEVICE_OVERLAP_BIN=target/gpu-carry/device_overlap \
#   KERNEL_CHECK_BIN=target/gpu-carry/kernel_check TRAIN_CHECK_BIN=target/gpu-carry/train_check \
#   THROUGHPUT_BIN=target/gpu-carry/throughput TIERZERO_WHEEL=$(ls target/gpu-carry/*.whl) \
#   GPU_CHECK_BUDGET_S=560 OUT=$OUT scripts/gpu_check.sh
# with timeout_s 600 (one command may run 10 minutes; the budget leaves
# the JSON time to be written).
# (the carry limit is 64 MiB: the binaries are stripped of debug info).
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/gpu-carry
rm -rf "$out" && mkdir -p "$out"
export CARGO_PROFILE_RELEASE_DEBUG=0
cargo build --release --features gpu --bin tierzero --example overlap --example device_overlap
cargo build --release -p tierzero-gpu --example kernel_check --example train_check --example throughput
for b in tierzero examples/overlap examples/device_overlap examples/kernel_check examples/train_check examples/throughput; do
  cp "target/release/$b" "$out/"
  strip "$out/$(basename "$b")" 2>/dev/null || true
done
PYBIN="${PYTHON:-.ci/venv/bin/python}"
if "$PYBIN" -m maturin --version >/dev/null 2>&1; then
  "$PYBIN" -m maturin build --release --quiet --out "$out"
else
  echo "no maturin in $PYBIN: the wheel for step 6b is not built" >&2
fi
du -sh "$out"/*

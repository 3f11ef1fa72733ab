#!/usr/bin/env bash
# Builds here everything scripts/gpu_check.sh runs on a lent GPU machine
# (which has no network and little time), into target/gpu-carry/:
#   tierzero          release, --features gpu
#   overlap           the overlap harness (examples/overlap)
#   unit_check        the units on the GPU against candle's (examples/unit_check)
#   device_overlap    the overlap harness on the GPU (examples/device_overlap)
#   kernel_check, train_check, throughput   tierzero-gpu's examples
#   tierzero-*.whl    the Python wheel (release), for step 6b
# Then, with the device tool: carry ["target/gpu-carry"] and run
#   TIERZERO_BIN=target/gpu-carry/tierzero OVERLAP_BIN=target/gpu-carry/overlap \
#   DEVICE_OVERLAP_BIN=target/gpu-carry/device_overlap \
#   KERNEL_CHECK_BIN=target/gpu-carry/kernel_check TRAIN_CHECK_BIN=target/gpu-carry/train_check \
#   UNIT_CHECK_BIN=target/gpu-carry/unit_check \
#   THROUGHPUT_BIN=target/gpu-carry/throughput TIERZERO_WHEEL=$(ls target/gpu-carry/*.whl) \
#   OUT=$OUT scripts/gpu_check.sh
# with timeout_s 540: the check's own budget (GPU_CHECK_BUDGET_S, default
# 480 s, the JSON written inside it) ends it first, and a 15-minute lease
# (the machine's start included) keeps a few minutes for a shorter rerun
# of the steps the first call skipped for the budget or did not reach: the
# same command with GPU_CHECK_STEPS=<its JSON's "rerun_steps", also printed
# on stderr at the end> GPU_CHECK_BUDGET_S=<the device tool's budget_left_s
# less a minute>, timeout_s between that budget and budget_left_s, at once
# while the machine is warm (nothing to rerun when rerun_steps is empty;
# see gpu_check.sh's Step selection and Rerun). Each step's
# result lands in $OUT/gpu_check.partial.jsonl as it finishes, so a run
# killed at timeout_s still brings back what it did.
# (the carry limit is 64 MiB: the binaries are stripped of debug info).
#
# Step 6b needs the wheel: when it cannot be built (no maturin in
# $PYTHON, default .ci/venv/bin/python, or the build fails) this script
# says so on stderr and exits 1 after building the rest, unless
# ALLOW_NO_WHEEL=1 (then gpu_check.sh records 6b as {"skipped":"no wheel"}).
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/gpu-carry
rm -rf "$out" && mkdir -p "$out"
export CARGO_PROFILE_RELEASE_DEBUG=0
cargo build --release --features gpu --bin tierzero --example overlap --example device_overlap --example unit_check
cargo build --release -p tierzero-gpu --example kernel_check --example train_check --example throughput
for b in tierzero examples/overlap examples/device_overlap examples/unit_check examples/kernel_check examples/train_check examples/throughput; do
  cp "target/release/$b" "$out/"
  strip "$out/$(basename "$b")" 2>/dev/null || true
done
PYBIN="${PYTHON:-.ci/venv/bin/python}"
wheel_err=""
if ! "$PYBIN" -m maturin --version >/dev/null 2>&1; then
  wheel_err="no maturin in $PYBIN (set PYTHON to a python with maturin)"
elif ! "$PYBIN" -m maturin build --release --strip --quiet --out "$out"; then
  wheel_err="maturin build --release failed (its output is above)"
elif ! ls "$out"/tierzero-*.whl >/dev/null 2>&1; then
  wheel_err="maturin built no tierzero-*.whl into $out"
fi
du -sh "$out"/*
# The device tool carries the working tree (tracked and untracked files
# git does not ignore) and the carry paths, 64 MiB in all: refuse here,
# with the numbers, what would be refused there after the machine started.
carry_kib=$(du -sk "$out" | cut -f1)
tree_kib=$(git ls-files -z --cached --others --exclude-standard | du -ck --files0-from=- 2>/dev/null | tail -n 1 | cut -f1 || true)
total_mib=$(( (carry_kib + ${tree_kib:-0} + 1023) / 1024 ))
echo "carry: $out $(( carry_kib / 1024 )) MiB + working tree $(( ${tree_kib:-0} / 1024 )) MiB = about $total_mib MiB of the 64 MiB limit"
if [ "$total_mib" -gt 60 ]; then
  echo "*** gpu_check_prepare: about $total_mib MiB would travel, over 60 MiB (the device tool's limit is 64 MiB): leave out a binary or remove untracked files" >&2
  exit 1
fi
if [ -n "$wheel_err" ]; then
  {
    echo
    echo "*** gpu_check_prepare: THE PYTHON WHEEL WAS NOT BUILT: $wheel_err."
    echo "*** Step 6b (python/tests/test_adamw_cuda.py, AdamW over CUDA params) will be"
    echo "*** recorded as skipped (\"no wheel\") on the GPU machine, not run."
  } >&2
  if [ "${ALLOW_NO_WHEEL:-0}" = 1 ]; then
    echo "*** ALLOW_NO_WHEEL=1: carrying on without it." >&2
  else
    echo "*** Exiting 1; set ALLOW_NO_WHEEL=1 to carry on without it." >&2
    exit 1
  fi
fi

#!/usr/bin/env bash
# Export check, run by .ci/run after the tests: train the embedded
# default for a few steps with a checkpoint, export it, and check the export
# with an independent reader (scripts/check_export.py: safetensors + numpy,
# a GPT-2 forward written in numpy) against `tierzero eval`'s loss.
#
#   scripts/ci_export_check.sh [TIERZERO_BIN] [--transformers]
#
# With --transformers (needs torch + transformers; not in CI) it also loads
# the file strictly into transformers' GPT2LMHeadModel and compares losses.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-target/debug/tierzero}
EXTRA=${2:-}
PY=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tz-export-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# 64 windows of 128 bytes from the bundled corpus.
head -c $((64 * 128)) data/corpus.txt > "$WORK/eval.txt"

# From $WORK: the embedded config swaps to ./tierzero-swap, which would
# otherwise be left (empty) in the checkout.
ABS_BIN=$(realpath "$BIN")
(cd "$WORK" && "$ABS_BIN" train --steps 4 --save-dir "$WORK/ckpt" --metrics "$WORK/m.jsonl") \
  > "$WORK/train.log" 2>&1 || { cat "$WORK/train.log"; exit 1; }
"$BIN" export --checkpoint "$WORK/ckpt" --out "$WORK/out/model.safetensors" --dtype fp32
"$BIN" eval --checkpoint "$WORK/ckpt" --data "$WORK/eval.txt" --seq-len 128 --json \
  > "$WORK/eval.json"
cat "$WORK/eval.json"
LOSS=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["loss"])' "$WORK/eval.json")
TOKENS=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["tokens"])' "$WORK/eval.json")
CFG="$WORK/out/config.json"
[ -f "$CFG" ] || { echo "export wrote no config.json beside the weights" >&2; exit 1; }
"$PY" scripts/check_export.py --weights "$WORK/out/model.safetensors" --config "$CFG" \
  --data "$WORK/eval.txt" --seq-len 128 --expect-loss "$LOSS" --expect-tokens "$TOKENS" $EXTRA

#!/usr/bin/env bash
# Side-by-side `tierzero train` runs of one model and config, the arms
# alternating ROUNDS times; one line a run: tokens/s, weight_sha256, peak
# RSS, and the mean `param_write_wait_s` of steps 6 on (the compute thread
# waiting for a param write-back to free a swap buffer; 0 without NVMe).
#
#   scripts/ab_train.sh ROUNDS DIR STEPS ARM...
#
# DIR holds `ds.json` and `model/` (an arm directory of
# `scripts/compare_torch.py --workdir W`, e.g. W/tz0). An ARM is a command
# run through env(1): a binary, optionally after VAR=VALUE settings, e.g.
#   scripts/ab_train.sh 3 W/tz0 30 /tmp/tz_old target/release/tierzero
#   scripts/ab_train.sh 3 W/tz0 30 "TIERZERO_FUSED_ISA=baseline target/release/tierzero" \
#       "TIERZERO_FUSED_ISA=avx2 target/release/tierzero"
# An ARM starting with @D runs on directory D instead (another config of
# the same model, e.g. the NVMe arm of compare_torch.py against stage 0):
#   scripts/ab_train.sh 3 W/tz0 40 target/release/tierzero "@N/tzn0 target/release/tierzero"
set -euo pipefail
if [ $# -lt 4 ]; then
  sed -n '2,15p' "$0" >&2
  exit 2
fi
rounds=$1 dir=$2 steps=$3
shift 3
here=$(cd "$(dirname "$0")/.." && pwd)
metrics=$(mktemp)
trap 'rm -f "$metrics"' EXIT
for r in $(seq "$rounds"); do
  for arm in "$@"; do
    # shellcheck disable=SC2086 # the arm is words on purpose
    d=$dir cmd=$arm
    if [[ $arm == @* ]]; then
      d=${arm%% *} d=${d#@} cmd=${arm#* }
    fi
    # tierzero's stderr kept: a failed run says why (it exited 2 silently).
    out=$(env $cmd train --config "$d/ds.json" --model "$d/model" \
      --data "$here/data/corpus.txt" --data-format bytes --seq-len 128 \
      --steps "$steps" --metrics "$metrics" --json 2>"$metrics.err") || {
      echo "ab_train: '$cmd train' on $d failed:" >&2
      cat "$metrics.err" >&2
      exit 2
    }
    python3 -c '
import json, sys
arm, out, r, metrics = sys.argv[1:]
v = json.loads(out)
lines = [json.loads(l) for l in open(metrics)]
steps = [m for m in lines if not m.get("summary")][5:]
wait_ms = 1e3 * sum(m["param_write_wait_s"] for m in steps) / max(len(steps), 1)
print("round %s  %s: %s tok/s  sha %s  peak RSS %d MiB  write wait %.1f ms/step" % (
    r, arm, format(round(v["tokens_per_s"]), ","), v["weight_sha256"][:12],
    v["peak_rss_bytes"] >> 20, wait_ms))' \
      "$arm" "$out" "$r" "$metrics"
  done
done

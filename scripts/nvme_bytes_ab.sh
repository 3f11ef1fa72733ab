#!/usr/bin/env bash
# NVMe bytes of a bf16 run with clipping whose final gradients spill, for
# two tierzero binaries side by side (the same weights are expected): the
# embedded GPT-2 default, 8 sequences a step, gradient_clipping 1.0.
#
#   scripts/nvme_bytes_ab.sh OLD_BIN NEW_BIN [ROUNDS]   (default 1 round)
#
# Two runs per binary and round:
# - `cpu`: compute on the CPU, params in pinned host memory, optimizer on
#   NVMe, speculation off, no resident sub-group, sub_group_size 200000,
#   10 steps;
# - `sim`: the simulated device, params (max_in_cpu 0) and optimizer on
#   NVMe, speculation auto, sub_group_size 300000, 8 steps (its bytes vary
#   a little between runs: kept-or-spilled speculative gradients and param
#   buffers kept or let go follow timing; the weights never do).
# One line per run: the binary, the case, the final loss, weight_sha256,
# NVMe bytes read and written, and the plan's per-step prediction.
set -euo pipefail
old=${1:?usage: $0 OLD_BIN NEW_BIN [ROUNDS]}
new=${2:?usage: $0 OLD_BIN NEW_BIN [ROUNDS]}
rounds=${3:-1}
old=$(realpath "$old")
new=$(realpath "$new")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/swap"
cat >"$work/cpu.json" <<JSON
{"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
 "gradient_clipping": 1.0, "bf16": {"enabled": true},
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
 "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
   "offload_optimizer": {"device": "nvme", "nvme_path": "$work/swap"},
   "sub_group_size": 200000},
 "tierzero": {"speculative_step": false, "optimizer_resident_bytes": 0}}
JSON
cat >"$work/sim.json" <<JSON
{"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
 "gradient_clipping": 1.0, "bf16": {"enabled": true},
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
 "zero_optimization": {"stage": 3,
   "offload_param": {"device": "nvme", "nvme_path": "$work/swap", "max_in_cpu": 0},
   "offload_optimizer": {"device": "nvme", "nvme_path": "$work/swap"},
   "sub_group_size": 300000}}
JSON
for r in $(seq 1 "$rounds"); do
  for b in "$old" "$new"; do
    for case in cpu sim; do
      if [ "$case" = cpu ]; then extra=(--steps 10); else extra=(--device sim --steps 8); fi
      (cd "$work" && "$b" train --config "$case.json" "${extra[@]}" --json >out.json 2>err.txt) \
        || { echo "$b $case failed:"; tail -5 "$work/err.txt"; exit 1; }
      python3 - "$b" "$case" "$work/out.json" "$work/err.txt" <<'PY'
import json, sys
b, case, out, err = sys.argv[1:]
o = json.load(open(out))
pred = next((l.strip() for l in open(err) if "NVMe per step" in l), "no prediction")
print(f"{b} {case}: loss {o['final_loss']}, weight_sha256 {o['weight_sha256'][:16]}, "
      f"NVMe read {o['nvme_read_bytes'] / 1e6:.1f} MB, written {o['nvme_written_bytes'] / 1e6:.1f} MB; {pred}")
PY
    done
  done
done

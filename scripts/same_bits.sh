#!/usr/bin/env bash
# Do two builds train to the same bits? Runs `tierzero train` with each
# binary on the same configs (stage 0 in memory, stage 3 with params and
# optimizer in pinned host memory, on NVMe with clipping and gradient
# accumulation, fp16 with dynamic loss scaling, bf16 with small sub-groups
# and no pipelining) and compares first loss, final loss and weight_sha256.
# For refactors that must not change a bit: build the old commit and the
# new one, then
#
#   scripts/same_bits.sh OLD/tierzero NEW/tierzero [STEPS]
#
# Exit 0 when every config gives equal results, 1 otherwise. Plain JSON
# configs, so a build from before hjson reading can run them too. A build
# from before the shuffled data order (2026-12-06) reads the data in file
# order and knows no --data-order: against a later one it differs by
# design.
set -euo pipefail
OLD=${1:?usage: same_bits.sh OLD_BIN NEW_BIN [STEPS]}
NEW=${2:?usage: same_bits.sh OLD_BIN NEW_BIN [STEPS]}
STEPS=${3:-8}
WORK=$(mktemp -d /tmp/tz-same-bits.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

config() { # name, zero_optimization JSON, top-level extras JSON
  python3 - "$1" "$2" "$3" "$WORK" <<'EOF'
import json, sys
name, zero, extra, work = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
swap = f"{work}/{name}-SWAP"
for k in ("offload_param", "offload_optimizer"):
    if zero.get(k, {}).get("device") == "nvme":
        zero[k]["nvme_path"] = swap
c = {"train_micro_batch_size_per_gpu": 4,
     "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
     "zero_optimization": zero,
     "tierzero": {"checksums": True}}
c.update(extra)
json.dump(c, open(f"{work}/{name}.json", "w"), indent=1)
EOF
}

config stage0 '{"stage": 0}' '{}'
config cpu '{"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}, "sub_group_size": 3e5}' '{}'
config nvme_clip_ga '{"stage": 3, "offload_param": {"device": "nvme", "buffer_count": 8, "buffer_size": 2e5, "max_in_cpu": 0}, "offload_optimizer": {"device": "nvme", "pipeline_read": true, "pipeline_write": true}, "sub_group_size": 3e5, "stage3_param_persistence_threshold": 0}' '{"gradient_clipping": 1.0, "gradient_accumulation_steps": 2}'
config fp16 '{"stage": 3, "offload_param": {"device": "nvme", "buffer_count": 8, "buffer_size": 2e5, "max_in_cpu": 0}, "offload_optimizer": {"device": "nvme"}, "sub_group_size": 5e5}' '{"fp16": {"enabled": true, "initial_scale_power": 12}}'
config bf16 '{"stage": 3, "offload_param": {"device": "nvme", "buffer_count": 8, "buffer_size": 2e5, "max_in_cpu": 1e6}, "offload_optimizer": {"device": "nvme"}, "sub_group_size": 1e5}' '{"bf16": {"enabled": true}, "gradient_clipping": 0.5}'

fail=0
printf '%-14s %-4s %-12s %-12s %s\n' config bin first_loss final_loss weight_sha256
for name in stage0 cpu nvme_clip_ga fp16 bf16; do
  mkdir -p "$WORK/$name-SWAP"
  results=()
  for which in old new; do
    bin=$OLD; [[ $which == new ]] && bin=$NEW
    out=$("$bin" train --config "$WORK/$name.json" --steps "$STEPS" --seq-len 64 --json 2>"$WORK/$name.$which.err") \
      || { echo "$name: $which failed:"; tail -5 "$WORK/$name.$which.err"; exit 1; }
    line=$(python3 -c 'import json,sys; s=json.loads(sys.argv[1]); print(s["first_loss"], s["final_loss"], s["weight_sha256"])' "$out")
    printf '%-14s %-4s %s\n' "$name" "$which" "$line"
    results+=("$line")
  done
  if [[ "${results[0]}" != "${results[1]}" ]]; then
    echo "$name: DIFFERENT"
    fail=1
  fi
done
exit $fail

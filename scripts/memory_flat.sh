#!/usr/bin/env bash
# Peak RSS of the same GPT-2 (hidden 256) at 4 and 16 layers, stage 3 with
# params and optimizer state on NVMe, sub_group_size 1e6, buffer_size 2e6,
# 3 steps; two configs: GA 2 with clipping 1.0, and GA 1 without clipping.
# Issue 18's table. Usage: scripts/memory_flat.sh [tierzero binary]
# BUCKETS=small adds stage3_prefetch_bucket_size 1e6,
# stage3_max_live_parameters 2e6 and stage3_max_reuse_distance 1e6 (buckets
# below both models, as tests/memory_flat.rs sets them); by default
# DeepSpeed's defaults apply.
set -euo pipefail
EXTRA=""
if [ "${BUCKETS:-}" = small ]; then
  EXTRA='"stage3_prefetch_bucket_size":1e6,"stage3_max_live_parameters":2e6,"stage3_max_reuse_distance":1e6,'
fi
BIN=${1:-target/release/tierzero}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tz-memflat.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
model() { # n_layer
  mkdir -p "$WORK/m$1"
  cat > "$WORK/m$1/config.json" <<J
{"model_type":"gpt2","vocab_size":256,"n_positions":256,"n_embd":256,"n_layer":$1,"n_head":4,
 "activation_function":"gelu_new","initializer_range":0.02,"tie_word_embeddings":true}
J
}
config() { # ga clip
  cat > "$WORK/ds_$1_$2.json" <<J
{"train_micro_batch_size_per_gpu":2,"gradient_accumulation_steps":$1,"gradient_clipping":$2,
 "optimizer":{"type":"AdamW","params":{"lr":1e-3}},
 "zero_optimization":{"stage":3,"sub_group_size":1e6,$EXTRA
   "offload_param":{"device":"nvme","nvme_path":"$WORK/swap","buffer_size":2e6,"max_in_cpu":0},
   "offload_optimizer":{"device":"nvme","nvme_path":"$WORK/swap"}}}
J
}
mkdir -p "$WORK/swap"
model 4; model 16
printf '| config | 4 layers | 16 layers | ratio |\n|---|---|---|---|\n'
for c in "2 1.0" "1 0.0"; do
  set -- $c; config "$1" "$2"
  declare -A rss
  for n in 4 16; do
    out=$("$BIN" train --config "$WORK/ds_$1_$2.json" --model "$WORK/m$n" --steps 3 --seq-len 128 --json 2>"$WORK/err") || {
      echo "memory_flat: the run of m$n with ds_$1_$2.json failed:" >&2; cat "$WORK/err" >&2; exit 2; }
    rss[$n]=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["peak_rss_bytes"])' "$out")
  done
  python3 - "$1" "$2" "${rss[4]}" "${rss[16]}" <<'P'
import sys
ga, clip, a, b = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
print(f"| GA {ga}, clip {clip} | {a/2**20:.0f} MiB | {b/2**20:.0f} MiB | {b/a:.2f} |")
P
done

#!/usr/bin/env bash
# Peak RSS of a GPT-2 of width 128 at 2 and 64 blocks (0.44M and 12.7M
# params), params and optimizer state on NVMe, buckets bounded, 2 steps:
# under the default stage3_param_persistence_threshold (1e5) every param of
# this width persists, held whole in the heap; with the threshold 0, or
# stage3_model_persistence_threshold bounding them, host memory is flat.
# Prints each run's peak RSS and the plan's params row (its host column:
# the persistent params), and estimate's row for the 64-block model.
#   scripts/persistent_rss.sh [BIN]   (default target/release/tierzero)
set -euo pipefail
B=${1:-target/release/tierzero}
W=$(mktemp -d "${TMPDIR:-/tmp}/tz-persist.XXXXXX")
trap 'rm -rf "$W"' EXIT
mkdir -p "$W/swap"
export RAYON_NUM_THREADS=1
for L in 2 64; do
  mkdir -p "$W/L$L"
  cat > "$W/L$L/config.json" <<J
{"model_type":"gpt2","vocab_size":256,"n_positions":64,"n_embd":128,"n_layer":$L,"n_head":4,"activation_function":"gelu_new","initializer_range":0.02,"tie_word_embeddings":true}
J
done
for P in default threshold-0 model-threshold-1e5; do
  case $P in
    default) extra="" ;;
    threshold-0) extra='"stage3_param_persistence_threshold":0,' ;;
    model-threshold-1e5) extra='"stage3_model_persistence_threshold":1e5,' ;;
  esac
  cat > "$W/ds_$P.json" <<J
{"train_micro_batch_size_per_gpu":1,"gradient_clipping":1.0,"optimizer":{"type":"AdamW","params":{"lr":1e-3}},
 "zero_optimization":{"stage":3,"sub_group_size":2e5,$extra
   "stage3_prefetch_bucket_size":2e5,"stage3_max_live_parameters":4e5,"stage3_max_reuse_distance":2e5,
   "offload_param":{"device":"nvme","nvme_path":"$W/swap","buffer_size":2e5,"max_in_cpu":0},
   "offload_optimizer":{"device":"nvme","nvme_path":"$W/swap"}},
 "tierzero":{"activation_budget_bytes":0}}
J
  for L in 2 64; do
    out=$("$B" train --config "$W/ds_$P.json" --model "$W/L$L" --steps 2 --seq-len 32 --json 2>"$W/err") || {
      echo "persistent_rss: the run of L$L ($P) failed:" >&2; cat "$W/err" >&2; exit 2; }
    pk=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["peak_rss_bytes"] >> 20)' "$out")
    echo "$P, $L blocks: peak RSS ${pk} MiB; plan: $(grep -E '^  params' "$W/err" | tr -s ' ')"
  done
  echo "$P, estimate of 64 blocks: $("$B" estimate --model "$W/L64" --config "$W/ds_$P.json" 2>&1 | grep 'your config' | tr -s ' ')"
done

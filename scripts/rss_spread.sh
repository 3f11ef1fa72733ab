#!/usr/bin/env bash
# The spread of peak RSS behind tests/memory_flat.rs: its GPT-2 (hidden 256)
# at 4 and 16 layers, stage 3 with params and optimizer state on NVMe,
# gradient accumulation 2 and clipping, 3 steps; the two runs side by side,
# as the test binary runs its two tests, ROUNDS times. One line a round.
#
#   scripts/rss_spread.sh ROUNDS [BINARY]      (default target/debug/tierzero)
#
# Set GLIBC_TUNABLES to compare malloc settings, e.g. per-thread arenas
# (tierzero's thresholds otherwise: mmap 256 MiB, trimming off):
#   GLIBC_TUNABLES=glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=18446744073709551615 \
#     scripts/rss_spread.sh 8
set -euo pipefail
rounds=${1:?usage: scripts/rss_spread.sh ROUNDS [BINARY]}
here=$(cd "$(dirname "$0")/.." && pwd)
bin=${2:-$here/target/debug/tierzero}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for layers in 4 16; do
  mkdir -p "$work/m$layers" "$work/s$layers"
  cat > "$work/m$layers/config.json" <<JSON
{"model_type":"gpt2","vocab_size":256,"n_positions":256,"n_embd":256,"n_layer":$layers,"n_head":4,
 "activation_function":"gelu_new","initializer_range":0.02,"tie_word_embeddings":true}
JSON
  cat > "$work/ds$layers.json" <<JSON
{"train_micro_batch_size_per_gpu":2,"gradient_accumulation_steps":2,"gradient_clipping":1.0,
 "optimizer":{"type":"AdamW","params":{"lr":1e-3}},
 "zero_optimization":{"stage":3,"sub_group_size":1e6,"stage3_prefetch_bucket_size":1e6,
   "stage3_max_live_parameters":2e6,"stage3_max_reuse_distance":1e6,
   "offload_param":{"device":"nvme","nvme_path":"$work/s$layers","buffer_size":2e6,"max_in_cpu":0},
   "offload_optimizer":{"device":"nvme","nvme_path":"$work/s$layers"}},
 "tierzero":{"activation_budget_bytes":67108864}}
JSON
done
peak() {
  local out
  out=$("$bin" train --config "$work/ds$1.json" --model "$work/m$1" --steps 3 --seq-len 128 --json 2>"$work/err$1") || {
    echo "rss_spread: the run of m$1 failed:" >&2; cat "$work/err$1" >&2; return 2; }
  python3 -c 'import json,sys; print(json.loads(sys.argv[1])["peak_rss_bytes"] >> 20)' "$out"
}
for r in $(seq "$rounds"); do
  peak 4 > "$work/p4" & p4=$!
  peak 16 > "$work/p16" & p16=$!
  a=0; b=0; wait "$p4" || a=$?; wait "$p16" || b=$?
  [ "$a" -eq 0 ] && [ "$b" -eq 0 ] || exit 2
  echo "round $r: 4 layers $(cat "$work/p4") MiB, 16 layers $(cat "$work/p16") MiB"
done

#!/usr/bin/env bash
# A checkpoint at scale (issue 18): a Llama-layout model of about 0.55B
# params (hidden 1536, 16 layers, intermediate 4096, vocab 32000, untied
# head), bf16, ZeRO-3 with params and optimizer state on NVMe, GA 2,
# clipping 1.0, trained from a seeded init.
#
#   run A: 3 steps, a checkpoint after step 2 (and the end-of-run one
#          after step 3);
#   run B: resumed from A's step-2 checkpoint, step 3 only.
#
# Prints the save and load lines (bytes, seconds, rate), and checks that
# B's step 3 is A's bit for bit: the same loss and the same weight_sha256
# after it. Exits 1 if not.
#
# Needs about 40 GB free under WORK (swap about 13 GB per run, plus the
# speculation pool's 6.6 GB where half the free space holds it, run B's
# after run A's is removed; two checkpoints of about 7.7 GB each) and takes
# about 8 minutes on 2 cores. Too slow for CI.
#
# Usage: scripts/checkpoint_scale.sh [tierzero binary] [work dir]
set -euo pipefail
BIN=${1:-target/release/tierzero}
WORK=${2:-./tierzero-ckpt-scale}
SEED=${SEED:-1}
rm -rf "$WORK"
mkdir -p "$WORK/model" "$WORK/swap"
trap 'rm -rf "$WORK"' EXIT
cat > "$WORK/model/config.json" <<J
{"model_type": "llama", "architectures": ["LlamaForCausalLM"],
 "hidden_size": 1536, "intermediate_size": 4096, "num_hidden_layers": 16,
 "num_attention_heads": 12, "num_key_value_heads": 12, "vocab_size": 32000,
 "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
 "hidden_act": "silu", "tie_word_embeddings": false, "initializer_range": 0.02,
 "bos_token_id": 1, "eos_token_id": 2}
J
cat > "$WORK/ds_config.json" <<J
{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
 "gradient_clipping": 1.0, "bf16": {"enabled": true},
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}},
 "zero_optimization": {"stage": 3, "sub_group_size": 1e7,
   "stage3_prefetch_bucket_size": 1.5e7, "stage3_max_live_parameters": 3e7,
   "stage3_max_reuse_distance": 1.5e7, "stage3_param_persistence_threshold": 1e4,
   "offload_param": {"device": "nvme", "nvme_path": "$WORK/swap", "buffer_count": 3,
                     "buffer_size": 5e7, "max_in_cpu": 0},
   "offload_optimizer": {"device": "nvme", "nvme_path": "$WORK/swap"}}}
J
common=(--config "$WORK/ds_config.json" --seed "$SEED" --steps 3 --seq-len 128)
echo "== run A: 3 steps, checkpoint after step 2"
"$BIN" train "${common[@]}" --model "$WORK/model" --save-dir "$WORK/ck" --save-every 2 \
  --metrics "$WORK/a.jsonl" 2>&1 | tee "$WORK/a.log" | grep -E "^checkpoint:|params|NVMe total|^step|summary" || true
echo "== run B: resumed from step 2"
"$BIN" train "${common[@]}" --resume "$WORK/ck/step-00000002" \
  --metrics "$WORK/b.jsonl" 2>&1 | tee "$WORK/b.log" | grep -E "^checkpoint:|resuming" || true
python3 - "$WORK/a.jsonl" "$WORK/b.jsonl" "$WORK/a.log" "$WORK/b.log" <<'P'
import json, sys
def read(p):
    rows = [json.loads(l) for l in open(p) if l.strip()]
    steps = {r["step"]: r for r in rows if "step" in r and "loss" in r}
    summary = [r for r in rows if "weight_sha256" in r]
    return steps, summary[-1] if summary else {}
a, sa = read(sys.argv[1])
b, sb = read(sys.argv[2])
for line in open(sys.argv[3]).read().splitlines() + open(sys.argv[4]).read().splitlines():
    if line.startswith("checkpoint:"):
        print(line)
print(f"peak RSS A {sa.get('peak_rss_bytes', 0)/2**30:.2f} GiB, B {sb.get('peak_rss_bytes', 0)/2**30:.2f} GiB")
print("| step | loss A | loss B (resumed) |")
print("|---|---|---|")
for s in sorted(a):
    print(f"| {s} | {a[s]['loss']:.6f} | {b[s]['loss']:.6f} |" if s in b else f"| {s} | {a[s]['loss']:.6f} | |")
print(f"weight_sha256 A {sa.get('weight_sha256')}\nweight_sha256 B {sb.get('weight_sha256')}")
ok = 3 in a and 3 in b and a[3]["loss"] == b[3]["loss"] and sa.get("weight_sha256") == sb.get("weight_sha256") and sa.get("weight_sha256")
print("resumed step 3 bit-identical:", "yes" if ok else "NO")
sys.exit(0 if ok else 1)
P

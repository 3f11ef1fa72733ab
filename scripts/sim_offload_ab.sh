#!/usr/bin/env bash
# The host side of an offloaded bf16 step, without a GPU: two tierzero
# binaries, alternating, on the simulated device (--device sim) with the
# shape of scripts/gpu_check.sh's step 6h (a Llama of hidden 2048, 16 heads
# over 4 KV heads, intermediate 5632, vocab 32000; stage 3, params and
# optimizer in pinned host memory, bf16, sub-groups of 50M elements,
# clipping 1.0), 4 layers instead of 16 (337M params), micro 1 and seq 2
# so that the simulator's reference GEMMs stay short.
#
#   scripts/sim_offload_ab.sh OLD_BIN NEW_BIN [ROUNDS]   (default 2 rounds)
#
# Per run, one line: the binary, start-up seconds (total_s - train_s of
# --json), the second step's wall seconds and its tail (from the end of the
# last unit's backward on the compute lane to the step's end, from
# --timeline), and weight_sha256 (the two binaries must agree). The step
# is mostly the simulator's reference GEMMs; the tail and the start-up
# are host work: the gradients' adds and the seeded init.
set -euo pipefail
old=${1:?usage: $0 OLD_BIN NEW_BIN [ROUNDS]}
new=${2:?usage: $0 OLD_BIN NEW_BIN [ROUNDS]}
rounds=${3:-2}
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/llama"
cat >"$work/llama/config.json" <<'JSON'
{"model_type":"llama","vocab_size":32000,"hidden_size":2048,"intermediate_size":5632,"num_hidden_layers":4,
 "num_attention_heads":16,"num_key_value_heads":4,"max_position_embeddings":2048,"rope_theta":10000.0,
 "rms_norm_eps":1e-5,"tie_word_embeddings":false}
JSON
python3 - "$work/ds.json" <<'PY'
import json, sys
c = json.load(open("src/config/default.json"))
c["bf16"] = {"enabled": True}
c["train_micro_batch_size_per_gpu"] = 1
c["gradient_accumulation_steps"] = 1
c.pop("train_batch_size", None)
z = c["zero_optimization"]
z["stage"] = 3
z["offload_param"] = {"device": "cpu", "pin_memory": True}
z["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
z["sub_group_size"] = 5e7
z["stage3_prefetch_bucket_size"] = 1e8
z["stage3_max_live_parameters"] = 3e8
t = c.setdefault("tierzero", {})
t["device_budget_bytes"] = 4 << 30
t.pop("pinned_budget_bytes", None)
json.dump(c, open(sys.argv[1], "w"))
PY
for r in $(seq 1 "$rounds"); do
  for b in "$old" "$new"; do
    (cd "$work" && "$b" train --model llama --config ds.json --device sim --seq-len 2 --steps 2 \
      --threads 2 --json --timeline tl.json --timeline-steps 1 >out.json 2>err.txt) \
      || { echo "$b failed:"; tail -5 "$work/err.txt"; exit 1; }
    python3 - "$b" "$r" "$work/out.json" "$work/tl.json" <<'PY'
import json, sys
b, r, out, tl = sys.argv[1:]
o = json.load(open(out))
t = json.load(open(tl))
lanes = {e["tid"]: e["args"]["name"] for e in t["traceEvents"] if e.get("ph") == "M"}
spans = [e for e in t["traceEvents"] if e.get("ph") == "X"]
step = next(e for e in spans if e["name"].startswith("step"))
end = step["ts"] + step["dur"]
last_bwd = max(e["ts"] + e["dur"] for e in spans
               if lanes[e["tid"]] == "compute" and e["name"].startswith("bwd u") and e["ts"] < end)
print(f"round {r} {b}: start-up {o['total_s'] - o['train_s']:.1f} s, step {step['dur'] / 1e6:.2f} s, "
      f"tail {(end - last_bwd) / 1e3:.0f} ms, weight_sha256 {o['weight_sha256'][:16]}")
PY
  done
done

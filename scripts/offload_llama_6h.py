#!/usr/bin/env python3
"""The model and config of scripts/gpu_check.sh's step 6h (throughput with
offload), written for it and for scripts/sim_offload_ab.sh (its host side
on the simulated device).

Usage: scripts/offload_llama_6h.py MODEL_DIR DS_JSON MICRO LAYERS

MODEL_DIR/config.json: a Llama of hidden 2048, 16 heads over 4 KV heads,
intermediate 5632, vocab 32000, LAYERS layers (16 in 6h: 852.6M params).
DS_JSON: the embedded default config (src/config/default.json, so run it
from the repository root) in bf16 at stage 3 with params and optimizer
state in (pinned) host memory, micro-batch MICRO, and a 4 GiB device
budget, so that the device tier streams the params. Only the standard
library is used.
"""
import json
import os
import sys


def main():
    if len(sys.argv) != 5:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    model_dir, ds_json, micro, layers = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    os.makedirs(model_dir, exist_ok=True)
    model = {
        "model_type": "llama", "vocab_size": 32000, "hidden_size": 2048,
        "intermediate_size": 5632, "num_hidden_layers": layers,
        "num_attention_heads": 16, "num_key_value_heads": 4,
        "max_position_embeddings": 2048, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    }
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(model, f)
    c = json.load(open("src/config/default.json"))
    c["bf16"] = {"enabled": True}
    c["train_micro_batch_size_per_gpu"] = micro
    c["gradient_accumulation_steps"] = 1
    c.pop("train_batch_size", None)
    z = c["zero_optimization"]
    z["stage"] = 3
    z["offload_param"] = {"device": "cpu", "pin_memory": True}
    z["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    # Sub-groups of 50M elements; uploads up to two blocks ahead (a block
    # is ~45M elements), at most ~1.2 GB of fp32 params live on the device.
    z["sub_group_size"] = 5e7
    z["stage3_prefetch_bucket_size"] = 1e8
    z["stage3_max_live_parameters"] = 3e8
    t = c.setdefault("tierzero", {})
    t["device_budget_bytes"] = 4 << 30
    # The cpu tier pins every param's pages: no cap below what they need.
    t.pop("pinned_budget_bytes", None)
    with open(ds_json, "w") as f:
        json.dump(c, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The device check's PyTorch sides, run on the CPU: a smoke test, not a
measurement. scripts/gpu_check.sh compares tierzero with
scripts/torch_gpt2_throughput.py (PyTorch eager) and
scripts/fsdp2_offload_throughput.py (FSDP2 with CPUOffloadPolicy) on a
lent GPU, which a task gets rarely and for minutes; a script that breaks
there (an API renamed between PyTorch or transformers versions, a typo on
a path only CUDA takes) costs the comparison. Here each runs with
`--device cpu` on a tiny shape of the same layout, and its JSON line is
checked: finite losses, tokens/s above zero, and the param count (which
the TFLOPS figure uses) equal to the count from the config's shapes.

  .ci/venv/bin/python scripts/check_torch_sides.py

Exits 1 with the reason when a side fails.
"""

import json
import math
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

# The layout of gpu_check.sh's offload model, shrunk.
LLAMA = {
    "model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 176,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def llama_params(c):
    h, i, v, n = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    block = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return v * h + n * block + h + (0 if c["tie_word_embeddings"] else v * h)


def gpt2_params(layers, hidden, seq, vocab=50257):
    block = 12 * hidden * hidden + 13 * hidden
    return vocab * hidden + seq * hidden + layers * block + 2 * hidden


def run(script, args, want_params):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        p = subprocess.run([sys.executable, os.path.join(HERE, script), "--device", "cpu",
                            "--out", out] + args, capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            sys.exit(f"{script}: exit {p.returncode}\n{p.stderr[-3000:]}")
        r = json.load(open(out))
    problems = []
    if r.get("ok") is not True or r.get("device") != "cpu":
        problems.append(f"ok {r.get('ok')!r}, device {r.get('device')!r}")
    for k in ("first_loss", "last_loss"):
        if not (isinstance(r.get(k), float) and math.isfinite(r[k])):
            problems.append(f"{k} = {r.get(k)!r}")
    if not r.get("tokens_per_s", 0) > 0 or not r.get("model_tflops", 0) > 0:
        problems.append(f"tokens_per_s {r.get('tokens_per_s')!r}, model_tflops {r.get('model_tflops')!r}")
    # FSDP2's host seconds per phase: finite, not negative, and within the
    # timed steps' wall time (each phase is a part of a step).
    if "phase_s" in r or script.startswith("fsdp2"):
        ph = r.get("phase_s")
        if not (isinstance(ph, dict) and set(ph) == {"forward_backward", "clip", "optimizer"}
                and all(isinstance(v, float) and math.isfinite(v) and v >= 0 for v in ph.values())):
            problems.append(f"phase_s {ph!r}")
        elif not sum(ph.values()) <= r.get("step_s", 0) * 1.001:
            problems.append(f"phase_s {ph!r} adds up to more than step_s {r.get('step_s')!r}")
        elif not ph["optimizer"] > 0:
            problems.append(f"phase_s {ph!r}: the optimizer took no time")
    if r.get("params") != want_params:
        problems.append(f"params {r.get('params')!r}, the config's shapes give {want_params}")
    if problems:
        sys.exit(f"{script}: " + "; ".join(problems) + f"\n{json.dumps(r)}")
    print(f"{script}: ok ({r['params']} params, loss {r['first_loss']:.4f} -> {r['last_loss']:.4f})")


def main():
    with tempfile.TemporaryDirectory() as d:
        cfg = os.path.join(d, "config.json")
        with open(cfg, "w") as f:
            json.dump(LLAMA, f)
        run("fsdp2_offload_throughput.py", ["--config", cfg, "--micro", "2", "--seq", "32", "--steps", "3"],
            llama_params(LLAMA))
    run("torch_gpt2_throughput.py",
        ["--layers", "1", "--hidden", "64", "--heads", "4", "--seq", "64", "--batch", "2", "--steps", "2"],
        gpt2_params(1, 64, 64))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""tierzero's CPU AdamW against PyTorch's fused CPU AdamW, side by side on
this machine, alternating.

  python scripts/adam_vs_torch.py [--bin target/release/tierzero] [--params 100e6]
      [--threads N] [--steps 5] [--rounds 3] [--json OUT.json]

Each round times PyTorch first in odd rounds and tierzero first in even
ones (the machine drifts; see the developers' guide):

- PyTorch: `torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=True)`
  over one fp32 param of --params elements with an fp32 gradient, on
  --threads intra-op threads; two warm-up steps, then --steps timed steps,
  the median step.
- tierzero: `tierzero bench-adam --json --variant fp32` with the same
  params, threads and steps (one repeat): its fp32-moment AdamW, the same
  28 bytes a param (read g, read and write p, m, v). Its figure is the
  mean step of its one repeat, timed round-robin with its other kinds
  (the probe, the bf16 copy, bf16 moments: in the same JSON and printed
  beside), where torch's is the median step.

Prints a line per side per round and the median ratio over rounds
(tierzero params/s over PyTorch's). Needs torch: .ci/venv/bin/python, or
the GPU machine's /opt/torch/.venv/bin/python.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def torch_side(torch, p, opt, steps):
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        opt.step()
        ts.append(time.perf_counter() - t)
    return p.numel() / statistics.median(ts)


def tierzero_side(binary, params, threads, steps):
    out = subprocess.run(
        [binary, "bench-adam", "--json", "--variant", "fp32", "--params", str(params),
         "--threads", str(threads), "--steps", str(steps), "--repeats", "1"],
        capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        sys.exit(f"{binary} bench-adam: exit {out.returncode}\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--bin", default=os.path.join(here, "..", "target", "release", "tierzero"))
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the result here as one JSON object")
    a = ap.parse_args()
    n = int(a.params)
    if n < 1 or a.threads < 1 or a.steps < 1 or a.rounds < 1:
        sys.exit("--params, --threads, --steps and --rounds must be at least 1")
    if not os.access(a.bin, os.X_OK):
        sys.exit(f"{a.bin}: not an executable; build it with `cargo build --release` or pass --bin")
    try:
        import torch
    except ImportError:
        sys.exit("no torch in this python: use .ci/venv/bin/python or the GPU machine's torch")
    torch.set_num_threads(a.threads)
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n) * 1e-3
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=True)
    for _ in range(2):
        opt.step()
    rounds = []
    for r in range(1, a.rounds + 1):
        got = {}
        for side in (("torch", "tierzero") if r % 2 else ("tierzero", "torch")):
            if side == "torch":
                got["torch"] = torch_side(torch, p, opt, a.steps)
            else:
                got["tierzero"] = tierzero_side(a.bin, n, a.threads, a.steps)
        tz = got["tierzero"]
        row = {
            "round": r,
            "torch_fused_params_per_s": got["torch"],
            "tierzero_fp32_params_per_s": tz["fp32"]["params_per_s"],
            "tierzero_bf16_out_params_per_s": tz["bf16_out"]["params_per_s"],
            "probe_params_per_s": tz["probe"]["params_per_s"],
            "isa": tz["isa"],
        }
        row["ratio"] = row["tierzero_fp32_params_per_s"] / row["torch_fused_params_per_s"]
        rounds.append(row)
        print(f"round {r}: torch fused {row['torch_fused_params_per_s'] / 1e9:.2f} G params/s, "
              f"tierzero fp32 {row['tierzero_fp32_params_per_s'] / 1e9:.2f} "
              f"(bf16 copy fused {row['tierzero_bf16_out_params_per_s'] / 1e9:.2f}, "
              f"probe {row['probe_params_per_s'] / 1e9:.2f}, isa {row['isa']}): "
              f"ratio {row['ratio']:.3f}", flush=True)
    out = {
        "params": n,
        "threads": a.threads,
        "steps": a.steps,
        "torch": torch.__version__,
        "rounds": rounds,
        "median_ratio": statistics.median(r["ratio"] for r in rounds),
    }
    print(f"median ratio over {a.rounds} rounds (tierzero fp32 / torch fused): {out['median_ratio']:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)
            f.write("\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""tierzero.torch.AdamW side by side with torch.optim.AdamW and DeepSpeed's
CPU Adam: optimizer steps per second over the same fp32 CPU params.

    .ci/venv/bin/python scripts/compare_cpu_adam.py [--numel 50000000]
        [--tensors 10] [--steps 5] [--rounds 3] [--nvme-dir /tmp/tz-adam]

In one process, alternating rounds (the order rotates every round), each
arm steps `--steps` times over `--tensors` fp32 params of `--numel`
elements in all, with fixed gradients; reported: the median step time and
params/s, and the ratio to DeepSpeedCPUAdam (when it builds: DeepSpeed
JIT-compiles its cpu_adam op with ninja on the first run, which takes
minutes) and to torch's fused AdamW. Arms: torch fused, torch foreach,
DeepSpeedCPUAdam, tierzero offload="cpu" (stepped in place), tierzero
offload="nvme" (state on disk under --nvme-dir, streamed per sub-group).
Skips cleanly without torch.
"""
import argparse
import os
import statistics
import sys
import time

try:
    import torch
except ImportError:
    print("skipped: torch is not installed")
    sys.exit(0)

import tierzero.torch as tzt


def ds_cpu_adam():
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        probe = [torch.nn.Parameter(torch.zeros(8))]
        probe[0].grad = torch.zeros(8)
        DeepSpeedCPUAdam(probe, lr=1e-3).step()
        return DeepSpeedCPUAdam
    except Exception as e:  # not installed, or its op does not build
        print(f"DeepSpeedCPUAdam unavailable: {type(e).__name__}: {e}")
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=50_000_000)
    ap.add_argument("--tensors", type=int, default=10)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nvme-dir", default="/tmp/tz-adam")
    a = ap.parse_args()
    torch.manual_seed(0)
    per = a.numel // a.tensors
    init = [torch.randn(per) for _ in range(a.tensors)]
    grads = [torch.randn(per) for _ in range(a.tensors)]
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    DS = ds_cpu_adam()
    arms = {
        "torch fused": lambda ps: torch.optim.AdamW(ps, fused=True, **hyper),
        "torch foreach": lambda ps: torch.optim.AdamW(ps, foreach=True, **hyper),
        "tierzero cpu": lambda ps: tzt.AdamW(ps, offload="cpu", **hyper),
        "tierzero nvme": lambda ps: tzt.AdamW(ps, offload="nvme", nvme_path=a.nvme_dir, sub_group_size=per, **hyper),
    }
    if DS is not None:
        arms["DeepSpeedCPUAdam"] = lambda ps: DS(ps, adamw_mode=True, **hyper)
    times = {k: [] for k in arms}
    names = list(arms)
    for r in range(a.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            ps = [torch.nn.Parameter(t.clone()) for t in init]
            for p, g in zip(ps, grads):
                p.grad = g
            opt = arms[name](ps)
            opt.step()  # warm-up: state allocation, first reads
            t0 = time.perf_counter()
            for _ in range(a.steps):
                opt.step()
            times[name].append((time.perf_counter() - t0) / a.steps)
            del opt, ps
    ref = "DeepSpeedCPUAdam" if DS is not None else "torch fused"
    ref_t = statistics.median(times[ref])
    print(f"{a.numel} fp32 params in {a.tensors} tensors, {torch.get_num_threads()} threads, median of {a.rounds} rounds x {a.steps} steps")
    print(f"| arm | step s | params/s | vs {ref} |")
    print("|---|---|---|---|")
    for name in names:
        t = statistics.median(times[name])
        print(f"| {name} | {t:.4f} | {a.numel / t:.3e} | {ref_t / t:.2f} |")


if __name__ == "__main__":
    main()

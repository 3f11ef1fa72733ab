#!/usr/bin/env python3
"""tierzero.torch.AdamW's step time with fp32 and bf16 moments, on the host
tiers (in place over fp32 CPU params) and on NVMe, alternated in one run,
beside torch.optim.AdamW(fused=True).

  python scripts/bench_adamw_moments.py [--numel 33554432] [--sub-group 4194304] [--rounds 3] [--dir DIR]

Needs a release wheel (`pip install .`): a dev-profile build of the kernel
is ten times slower. DIR (default ./bench-adamw-moments) should be on the
disk, not a tmpfs; it is removed afterwards."""

import argparse
import shutil
import time

import torch

import tierzero.torch as tzt


def timed(opt, steps=3):
    opt.step()  # the first step reads the state from where load() put it
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - t0) / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=32 << 20)
    ap.add_argument("--sub-group", type=int, default=4 << 20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="bench-adamw-moments")
    a = ap.parse_args()
    res = {}
    try:
        for _ in range(a.rounds):
            for dt in (torch.float32, torch.bfloat16):
                for off in ("cpu", "nvme"):
                    p = torch.nn.Parameter(torch.randn(a.numel))
                    p.grad = torch.randn(a.numel)
                    opt = tzt.AdamW([p], offload=off, nvme_path=f"{a.dir}/{dt}", sub_group_size=a.sub_group, moments_dtype=dt)
                    res.setdefault(f"{off} {str(dt).split('.')[1]} moments", []).append(timed(opt))
                    del opt, p
            p = torch.nn.Parameter(torch.randn(a.numel))
            p.grad = torch.randn(a.numel)
            res.setdefault("torch fused AdamW", []).append(timed(torch.optim.AdamW([p], fused=True)))
    finally:
        shutil.rmtree(a.dir, ignore_errors=True)
    for k, v in res.items():
        print(f"{k:24} " + " ".join(f"{x * 1e3:7.1f}" for x in v) + " ms/step")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""tierzero.torch.AdamW(offload="cpu") over 50M bf16 params in 10 tensors,
sub-groups of 1e9 (pieces of several params: a bf16 buffer, scattered) and
of 5M (each sub-group one param: written in place); ms per step. An
optional argument labels the lines (e.g. the build measured)."""
import time, statistics, torch, sys
import tierzero.torch as tzt
torch.set_num_threads(2)
for sgs in (10**9, 5_000_000):
    ps=[torch.nn.Parameter(torch.randn(5_000_000).to(torch.bfloat16)) for _ in range(10)]
    for p in ps: p.grad=torch.randn(p.shape).to(torch.bfloat16)
    opt=tzt.AdamW(ps, lr=1e-3, offload="cpu", sub_group_size=sgs, threads=2)
    ts=[]
    for _ in range(6):
        t0=time.perf_counter(); opt.step(); ts.append(time.perf_counter()-t0)
    print(*sys.argv[1:2], "sub_group_size", sgs, f"{statistics.median(ts[1:])*1e3:.1f} ms")

#!/usr/bin/env python3
"""tierzero's in-place AdamW kernel over the same 50M params cut into 1,
10, 100 and 1000 tensors, one native call per tensor, at 1 and 2 threads:
what a call (and its thread spawn) costs. Needs the tierzero wheel.
"""
import time, torch, statistics
from tierzero import _native
def run(n, k, threads, reps=7):
    ps=[torch.randn(n) for _ in range(k)]; gs=[torch.randn(n) for _ in range(k)]
    ms=[torch.zeros(n) for _ in range(k)]; vs=[torch.zeros(n) for _ in range(k)]
    ts=[]
    for r in range(reps):
        t0=time.perf_counter()
        for i in range(k):
            _native.adamw_step_inplace(r+1, 1e-3, 0.9, 0.999, 1e-8, 0.01, ps[i], gs[i], ms[i], vs[i], threads, 1.0)
        ts.append(time.perf_counter()-t0)
    return statistics.median(ts[1:])
for threads in (1,2):
    for n,k in ((50_000_000,1),(5_000_000,10),(500_000,100),(50_000,1000)):
        print(threads, n, k, f"{run(n,k,threads)*1e3:.2f} ms")

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

# The binding's cost per param: 500 params of 8 elements, all in one call
# (the in-place AdamW path: _InPlaceMoments.step_many imports each param and
# its gradient; the moments were imported once), and one adamw_step_inplace
# call per param (four DLPack imports each).
K = 500
small = [[torch.randn(8) for _ in range(4)] for _ in range(K)]
cache = _native._InPlaceMoments([t[2] for t in small], [t[3] for t in small])
items = [(i, 1, 1e-3, 0.9, 0.999, 1e-8, 0.01, t[0], t[1]) for i, t in enumerate(small)]


def per_call():
    for p, g, m, v in small:
        _native.adamw_step_inplace(1, 1e-3, 0.9, 0.999, 1e-8, 0.01, p, g, m, v, 2)


for name, f in (("step_many, 500 x 8 elements", lambda: cache.step_many(items, 2)),
                ("adamw_step_inplace per param, 500 x 8 elements", per_call)):
    ts = []
    for _ in range(7):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    print(f"{name}: {statistics.median(ts[1:]) * 1e3:.2f} ms ({statistics.median(ts[1:]) / K * 1e6:.1f} us a param)")

#!/usr/bin/env python3
"""One handle, one op, locked tensor: GB/s and CPU-s/GB (a quick probe
beside scripts/compare_deepspeed_aio.py, which runs the whole matrix).

Usage: probe_locked_aio.py tz|ds read|write QD INTRA [BLOCK_BYTES]
(ROUNDS=3 in the environment; files under PROBE_DIR, default /tmp).
"""
import os, sys, time, resource, statistics, torch
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
which = sys.argv[1]; op = sys.argv[2]; qd = int(sys.argv[3]); intra = int(sys.argv[4]); bs = int(sys.argv[5]) if len(sys.argv) > 5 else 1<<20
rounds = int(os.environ.get("ROUNDS", "3"))
if which == "ds":
    from deepspeed.ops.op_builder import AsyncIOBuilder
    m = AsyncIOBuilder().load(verbose=False)
else:
    import tierzero.aio as m
n = 1 << 30
h = m.aio_handle(bs, qd, False, True, intra)
t = h.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8))
t.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
path = os.path.join(os.environ.get("PROBE_DIR", "/tmp"), f"tz_probe_{which}_{os.getpid()}.bin")
h.sync_pwrite(t, path)
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime + r.ru_stime
res = []
for r in range(rounds):
    if op == "write":
        os.unlink(path)
    c0, t0 = cpu(), time.perf_counter()
    (h.sync_pread if op == "read" else h.sync_pwrite)(t, path)
    dt, dc = time.perf_counter() - t0, cpu() - c0
    res.append((n/1e9/dt, dc/(n/1e9)))
os.unlink(path)
print(f"{which} {op} qd{qd} intra{intra} bs{bs}: GB/s {statistics.median(x for x,_ in res):.2f}  cpu-s/GB {statistics.median(y for _,y in res):.4f}")

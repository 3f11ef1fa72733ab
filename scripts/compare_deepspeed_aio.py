#!/usr/bin/env python3
"""tierzero.aio.aio_handle side by side with DeepSpeed's DeepNVMe aio_handle.

Usage:
  compare_deepspeed_aio.py [--dir /tmp] [--size-mib 1024] [--rounds 2]
                           [--queue-depths 32,128] [--intra 1,2]
                           [--block-size 1048576] [--json FILE]

In one process, for every (queue_depth, intra_op_parallelism), alternating
rounds (the order of the two handles flips every round), the same settings
for both (block_size 1 MiB, single_submit False, overlap_events True):

- write: ``sync_pwrite`` of a ``--size-mib`` tensor to a fresh file
  (a new name each round, deleted afterwards);
- read: ``sync_pread`` of that file back (after POSIX_FADV_DONTNEED; both
  handles use O_DIRECT anyway), checked equal to what was written;

each with two buffers: a locked tensor from the handle's own
``new_cpu_locked_tensor`` and a plain ``torch.empty`` tensor. Reported:
GB/s (1e9 bytes) and CPU-seconds per GB (``getrusage(RUSAGE_SELF)``
user + sys, which counts every thread of the process, the handles' I/O
threads included), the median over the rounds, and tierzero / DeepSpeed.

Exits 0 with a message when torch or deepspeed is missing, or DeepSpeed's
async_io op cannot be built or loaded. DeepSpeed JIT-builds the op with
ninja on the first run (minutes); the venv's bin/ is put on PATH for that.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--queue-depths", default="32,128")
    ap.add_argument("--intra", default="1,2")
    ap.add_argument("--block-size", type=int, default=1 << 20)
    ap.add_argument("--json", default=None, help="also write the raw samples here")
    args = ap.parse_args()

    try:
        import torch
    except ImportError:
        print("skipping: torch is not installed")
        return 0
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        print("skipping: deepspeed is not installed")
        return 0
    # torch's JIT loader looks for ninja on PATH, even for a cached build.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        b = AsyncIOBuilder()
        if not b.is_compatible(verbose=False):
            print("skipping: DeepSpeed's AsyncIOBuilder is not compatible here (libaio-dev missing?)")
            return 0
        ds_aio = b.load(verbose=False)
    except Exception as e:  # noqa: BLE001 (any build failure is a skip)
        print(f"skipping: DeepSpeed's async_io op cannot be loaded: {type(e).__name__}: {e}")
        return 0
    import tierzero.aio as tz_aio

    if getattr(ds_aio, "__name__", "").startswith("tierzero"):
        print("skipping: tierzero.deepspeed.install() is active; DeepSpeed's own op is not loaded")
        return 0

    nbytes = args.size_mib << 20
    gb = nbytes / 1e9
    qds = [int(x) for x in args.queue_depths.split(",")]
    intras = [int(x) for x in args.intra.split(",")]
    impls = {"tierzero": tz_aio.aio_handle, "deepspeed": ds_aio.aio_handle}

    print(f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, tierzero {__import__('tierzero').__version__}")
    print(f"{args.size_mib} MiB per op in {args.dir}, block_size {args.block_size}, {args.rounds} rounds, "
          f"RLIMIT_MEMLOCK {resource.getrlimit(resource.RLIMIT_MEMLOCK)}")
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    samples = []  # dicts
    seq = 0
    for qd in qds:
        for intra in intras:
            handles = {k: f(args.block_size, qd, False, True, intra) for k, f in impls.items()}
            bufs = {}
            for k, h in handles.items():
                locked = h.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
                bufs[k] = {"locked": locked, "plain": torch.empty(nbytes, dtype=torch.uint8)}
            for rnd in range(args.rounds):
                order = list(impls) if rnd % 2 == 0 else list(reversed(list(impls)))
                for k in order:
                    h = handles[k]
                    for kind in ("locked", "plain"):
                        buf = bufs[k][kind]
                        buf.copy_(src)
                        seq += 1
                        path = os.path.join(args.dir, f"tz_ds_aio_{os.getpid()}_{seq}.bin")
                        try:
                            c0, t0 = cpu_seconds(), time.perf_counter()
                            ret = h.sync_pwrite(buf, path)
                            t1, c1 = time.perf_counter(), cpu_seconds()
                            if ret != 1:
                                raise RuntimeError(f"{k} sync_pwrite returned {ret}")
                            if os.path.getsize(path) != nbytes:
                                raise RuntimeError(f"{k} wrote {os.path.getsize(path)} bytes, not {nbytes}")
                            drop_cache(path)
                            buf.zero_()
                            c2, t2 = cpu_seconds(), time.perf_counter()
                            ret = h.sync_pread(buf, path)
                            t3, c3 = time.perf_counter(), cpu_seconds()
                            if ret != 1:
                                raise RuntimeError(f"{k} sync_pread returned {ret}")
                            if not torch.equal(buf, src):
                                raise RuntimeError(f"{k} read back different bytes ({kind}, qd {qd}, intra {intra})")
                        finally:
                            if os.path.exists(path):
                                os.unlink(path)
                        for op, dt, dc in (("write", t1 - t0, c1 - c0), ("read", t3 - t2, c3 - c2)):
                            samples.append({"impl": k, "qd": qd, "intra": intra, "buffer": kind, "op": op,
                                            "round": rnd, "seconds": dt, "cpu_seconds": dc,
                                            "gbps": gb / dt, "cpu_s_per_gb": dc / gb})
            for k, h in handles.items():
                h.free_cpu_locked_tensor(bufs[k]["locked"])
            del handles, bufs

    def med(impl, qd, intra, kind, op, field):
        return statistics.median(s[field] for s in samples if (s["impl"], s["qd"], s["intra"], s["buffer"], s["op"])
                                 == (impl, qd, intra, kind, op))

    hdr = (f"{'qd':>4} {'intra':>5} {'buffer':>6} {'op':>5} | {'tz GB/s':>8} {'ds GB/s':>8} {'ratio':>6} | "
           f"{'tz cpu-s/GB':>11} {'ds cpu-s/GB':>11} {'ratio':>6}")
    print()
    print(hdr)
    print("-" * len(hdr))
    for qd in qds:
        for intra in intras:
            for kind in ("locked", "plain"):
                for op in ("write", "read"):
                    tg, dg = (med(i, qd, intra, kind, op, "gbps") for i in ("tierzero", "deepspeed"))
                    tc, dc = (med(i, qd, intra, kind, op, "cpu_s_per_gb") for i in ("tierzero", "deepspeed"))
                    print(f"{qd:>4} {intra:>5} {kind:>6} {op:>5} | {tg:>8.2f} {dg:>8.2f} {tg / dg:>6.2f} | "
                          f"{tc:>11.3f} {dc:>11.3f} {tc / dc if dc else float('nan'):>6.2f}")
    print("\nGB = 1e9 bytes; medians over rounds; ratio = tierzero / deepspeed "
          "(GB/s: > 1 is faster; cpu-s/GB: < 1 is cheaper)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "samples": samples}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

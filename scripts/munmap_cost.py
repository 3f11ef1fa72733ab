#!/usr/bin/env python3
"""What unmapping touched anonymous memory costs the thread that does it
(the figures in `src/engine/host/heap.rs`'s `free_off_thread`):

    python3 scripts/munmap_cost.py [GiB ...]     (default 0.25 2)

Each size is mapped, every page touched, then unmapped; the unmap's wall
time is printed.
"""
import mmap
import sys
import time

for gib in [float(a) for a in sys.argv[1:]] or [0.25, 2.0]:
    n = int(gib * (1 << 30))
    m = mmap.mmap(-1, n)
    for i in range(0, n, 4096):
        m[i] = 1
    t = time.perf_counter()
    m.close()
    print(f"{gib} GiB: munmap {(time.perf_counter() - t) * 1e3:.1f} ms")

#!/usr/bin/env python3
"""What a first touch of anonymous memory costs on this machine.

Maps 1 GiB four times (4 KiB pages, then with MADV_HUGEPAGE, twice over),
writes one byte per 4 KiB page, and prints the time. On the 2-core
development VM (2026-12-05) the first mapping took 4.8 and 5.4 s (18-21 us
a page: pages the guest reported free to the host come back through a host
fault), and the later ones anywhere from 0.06 s to 7.7 s, depending on what
the host had taken back in between. So start-up and end-of-run timings there
depend on what ran before, and are compared by alternating binaries, never
from single runs.

    python3 scripts/first_touch_cost.py [GiB]
"""
import mmap
import sys
import time

n = int(float(sys.argv[1]) * (1 << 30)) if len(sys.argv) > 1 else 1 << 30
for huge in (False, True, False, True):
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        m.madvise(mmap.MADV_HUGEPAGE)
    t = time.perf_counter()
    for off in range(0, n, 4096):
        m[off] = 1
    dt = time.perf_counter() - t
    pages = n // 4096
    print(f"huge pages advised={huge}: {n >> 20} MiB first touch {dt * 1e3:.0f} ms "
          f"({dt / pages * 1e6:.1f} us a 4 KiB page)")
    m.close()

#!/usr/bin/env python3
"""What the host-device link of this machine carries from pinned memory:
host to device alone, device to host alone, and both at once on two
streams, as GB/s (1e9 bytes a second).

  python scripts/link_bandwidth.py [--bytes 1GiB] [--copies 4] [--rounds 3]
      [--device 0] [--json OUT.json]

(--bytes takes k, m and g as powers of 1024: 1g, 1GiB and 1GB are 2^30.)

Each round times, in turn, --copies copies of --bytes each way alone, then
the same copies both ways at once (host to device on one stream, device
to host on another), between page-locked host buffers
(`pin_memory=True`) and device buffers. Each figure is the copies' bytes
over the wall time from a synchronized start to a synchronized end, the
median over rounds. "both" gives each direction's bytes over the wall
time of the two together.

This is the number that prices moving the optimizer's fp32 state to the
device and back for the device to step it there
(docs/decisions/offload-step-bound.md, lever 6): 12 bytes a param up
(master, m, v) and 14 down (the same, and the new 16-bit param), both
directions at once. It needs PyTorch with CUDA (the GPU machine's
/opt/torch/.venv/bin/python); without a device it says so and exits 2.
"""

import argparse
import json
import statistics
import sys
import time


def parse_bytes(s):
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = s.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(float(t))


def timed(torch, jobs):
    """Runs each (stream, fn) job's fn on its stream; the wall seconds from
    a synchronized start to the end of the last."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for stream, fn in jobs:
        with torch.cuda.stream(stream):
            fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bytes", type=parse_bytes, default=1 << 30)
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.bytes <= 0 or a.copies <= 0 or a.rounds <= 0:
        sys.exit("link_bandwidth: --bytes, --copies and --rounds must be positive")
    try:
        import torch
    except ImportError as e:
        print(f"link_bandwidth: no PyTorch ({e}); run it with /opt/torch/.venv/bin/python",
              file=sys.stderr)
        sys.exit(2)
    if not torch.cuda.is_available():
        print("link_bandwidth: no CUDA device (torch.cuda.is_available() is False)",
              file=sys.stderr)
        sys.exit(2)
    torch.cuda.set_device(a.device)
    host_up = torch.empty(a.bytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    host_down = torch.empty(a.bytes, dtype=torch.uint8, pin_memory=True)
    dev_up = torch.empty(a.bytes, dtype=torch.uint8, device="cuda")
    dev_down = torch.full((a.bytes,), 2, dtype=torch.uint8, device="cuda")
    up_stream, down_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def up():
        for _ in range(a.copies):
            dev_up.copy_(host_up, non_blocking=True)

    def down():
        for _ in range(a.copies):
            host_down.copy_(dev_down, non_blocking=True)

    moved = a.bytes * a.copies
    # Warm-up: the first copies map the buffers.
    timed(torch, [(up_stream, up), (down_stream, down)])
    rounds = []
    for _ in range(a.rounds):
        h2d = moved / timed(torch, [(up_stream, up)]) / 1e9
        d2h = moved / timed(torch, [(down_stream, down)]) / 1e9
        both = moved / timed(torch, [(up_stream, up), (down_stream, down)]) / 1e9
        rounds.append({"h2d_gbps": round(h2d, 2), "d2h_gbps": round(d2h, 2),
                       "both_each_gbps": round(both, 2)})
        print(f"h2d {h2d:.2f} GB/s, d2h {d2h:.2f} GB/s, both at once {both:.2f} GB/s each way")
    # The copies landed: the device holds the host's 1s, the host the 2s.
    if not (bool((dev_up[:: max(1, a.bytes // 4096)] == 1).all())
            and bool((host_down[:: max(1, a.bytes // 4096)] == 2).all())):
        sys.exit("link_bandwidth: a copy did not land")
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    out = {"device": torch.cuda.get_device_name(a.device), "bytes": a.bytes,
           "copies": a.copies, "rounds": rounds, **med}
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w") as f:
            f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()

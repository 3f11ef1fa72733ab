#!/usr/bin/env python3
"""One summary of a `tierzero train --metrics` file's steps, as
scripts/gpu_check.sh keeps it: the device tier's totals (step 6f) or the
offloaded run's means (step 6h).

  python scripts/metrics_summary.py METRICS.jsonl --preset tier
  python scripts/metrics_summary.py METRICS.jsonl --preset offload --steps N

- `tier`: totals over the steps after the first in the file (the first
  records the trace) of the copies' bytes and waits, the device queues' busy seconds,
  the steps' wall seconds, and `wall_over_busiest_queue` (the wall over
  the busiest of the compute, h2d and d2h queues: how well copies and
  compute overlapped; null when no queue was busy).
- `offload`: means over steps 3..N (the first records the trace, the
  second is the first of a steady state), as many of them as the file
  has, of each per-step figure that says where the step went, with the
  steps' numbers (`steps`). A key that some step lacks is left out.

Prints one JSON object; with --out, writes it there too. Exit 2 on an
unreadable file or too few steps (`tier` wants 2, `offload` 3). Steps
are counted by their numbers: a resumed run's redone steps count once
(their last lines). Only the standard library is used.
"""

import argparse
import json
import sys

# Step 6f's totals: (output key, metrics key).
TIER_TOTALS = (
    ("h2d_direct_bytes", "h2d_direct_bytes"),
    ("h2d_at_use_bytes", "h2d_at_use_bytes"),
    ("param_buffers_let_go", "param_buffers_let_go"),
    ("h2d_bytes", "h2d_bytes"),
    ("d2h_bytes", "d2h_bytes"),
    ("h2d_wait_s", "h2d_wait_s"),
    ("d2h_wait_s", "d2h_wait_s"),
    ("device_busy_s", "device_busy_s"),
    ("h2d_busy_s", "h2d_busy_s"),
    ("d2h_busy_s", "d2h_busy_s"),
    ("h2d_fill_busy_s", "h2d_fill_busy_s"),
    ("wall_s", "wall_s"),
    ("forwards_ahead", "device_forwards_ahead"),
    ("backwards_ahead", "device_backwards_ahead"),
)

# Step 6h's means.
OFFLOAD_MEANS = (
    "wall_s", "compute_s", "io_wait_s", "optimizer_s", "idle_s", "h2d_bytes",
    "h2d_at_use_bytes", "h2d_direct_bytes", "h2d_wait_s", "d2h_bytes", "d2h_wait_s",
    "device_busy_s", "h2d_busy_s", "d2h_busy_s", "h2d_fill_busy_s", "minor_faults",
)


def load_steps(path):
    """The file's step lines (its summary lines left out), one per step
    number, in step order. A resumed run appends to the file and redoes
    the steps after its checkpoint: a step's last line is the one whose
    work the weights kept, so it replaces the earlier ones."""
    by_step = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            d = json.loads(line)
            if "step" in d and not d.get("summary"):
                by_step[d["step"]] = d
    return [by_step[k] for k in sorted(by_step)]


def tier_totals(steps):
    """Step 6f's totals over the steps after the first."""
    later = steps[1:]
    out = {"steps_after_first": True}
    for name, key in TIER_TOTALS:
        out[name] = sum(s.get(key, 0) for s in later)
    busiest = max(out["device_busy_s"], out["h2d_busy_s"], out["d2h_busy_s"])
    out["wall_over_busiest_queue"] = round(out["wall_s"] / busiest, 3) if busiest > 0 else None
    return out


def offload_means(steps, n):
    """Step 6h's means over steps 3..n, as many of them as there are (a
    run cut short still says where its steps went), or None when there
    are none."""
    timed = [s for s in steps if 3 <= s["step"] <= n]
    if not timed:
        return None
    mean = {k: sum(s[k] for s in timed) / len(timed)
            for k in OFFLOAD_MEANS if all(k in s for s in timed)}
    mean["steps"] = [s["step"] for s in timed]
    return mean


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("metrics")
    ap.add_argument("--preset", choices=("tier", "offload"), required=True)
    ap.add_argument("--steps", type=int, help="offload: the run's step count N")
    ap.add_argument("--out")
    a = ap.parse_args()
    try:
        steps = load_steps(a.metrics)
    except (OSError, ValueError) as e:
        print(f"metrics_summary: {a.metrics}: {e}", file=sys.stderr)
        return 2
    if a.preset == "tier":
        if len(steps) < 2:
            print(f"metrics_summary: {a.metrics}: {len(steps)} steps, the totals need 2",
                  file=sys.stderr)
            return 2
        out = tier_totals(steps)
    else:
        if a.steps is None or a.steps < 3:
            print("metrics_summary: --preset offload needs --steps N of at least 3",
                  file=sys.stderr)
            return 2
        out = offload_means(steps, a.steps)
        if out is None:
            print(f"metrics_summary: {a.metrics}: {len(steps)} steps, the means need "
                  "a third", file=sys.stderr)
            return 2
    text = json.dumps(out)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Where a step lost its overlap, from a `tierzero train --timeline` file.

Usage: scripts/timeline_gaps.py TIMELINE.json [--top N] [--against ALONE.json]
       scripts/timeline_gaps.py TIMELINE.json --lanes

For each step span: its wall time, the time the disk was busy inside it
(and each engine's share: params, state reads, state writes, grad park), the time the
compute thread spent waiting for params, and the N longest disk-idle gaps,
each with the compute span (or params wait) it fell in. With a device's
lanes, also its busy time and its N longest idle gaps between compute
spans (where it waited for the host), with the host's spans then.

With --against ALONE.json (a timeline of the same model computing alone,
e.g. `examples/overlap`'s TIMELINE_STAGE0), also each unit's compute time:
the median over the steps in both files, their ratio, and the share of the
unit's spans during which the disk was busy in TIMELINE.json.
With --lanes, only each lane's span count and total seconds over the
whole file (e.g. the optimizer lane against the store lane, where the new
params are copied home).
Only the standard library is used.
"""
import json
import statistics
import sys


def load(path):
    try:
        with open(path) as f:
            v = json.load(f)
    except (OSError, ValueError) as e:
        print(f"timeline_gaps: {path}: {e}", file=sys.stderr)
        sys.exit(2)
    lanes = {e["tid"]: e["args"]["name"] for e in v["traceEvents"] if e.get("ph") == "M"}
    spans = {}
    for e in v["traceEvents"]:
        if e.get("ph") != "X":
            continue
        lane = lanes.get(e["tid"], str(e["tid"]))
        spans.setdefault(lane, []).append((e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3, e["name"]))
    for s in spans.values():
        s.sort()
    return spans


def clip(intervals, a, b):
    return [(max(s, a), min(e, b), n) for s, e, n in intervals if e > a and s < b]


def union(spans):
    """Overlapping spans merged, in order."""
    out = []
    for s, e, n in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e), out[-1][2])
        else:
            out.append((s, e, n))
    return out


def main():
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if args else 2
    def usage_error(msg):
        print(f"timeline_gaps: {msg}", file=sys.stderr)
        sys.exit(2)

    def value(flag):
        i = args.index(flag)
        if i + 1 >= len(args):
            usage_error(f"{flag} needs a value\n\n{__doc__.strip()}")
        v = args[i + 1]
        del args[i : i + 2]
        return v

    top = 3
    if "--top" in args:
        v = value("--top")
        try:
            top = int(v)
        except ValueError:
            usage_error(f"--top {v!r}: not a whole number")
    against = None
    if "--against" in args:
        against = load(value("--against"))
    lanes_only = "--lanes" in args
    if lanes_only:
        args.remove("--lanes")
    if len(args) != 1:
        usage_error(f"one TIMELINE.json, got {args}\n\n{__doc__.strip()}")
    spans = load(args[0])
    if lanes_only:
        for lane, s in sorted(spans.items()):
            print(f"{lane}: {len(s)} spans, {sum(e - b for b, e, _ in s) / 1e3:.3f} s")
        return 0
    disk = spans.get("disk", [])
    for s0, s1, name in spans.get("step", []):
        busy = clip(disk, s0, s1)
        busy_ms = sum(e - s for s, e, _ in busy)
        waits = clip(spans.get("params", []), s0, s1)
        wait_ms = sum(e - s for s, e, _ in waits)
        comp_ms = sum(e - s for s, e, _ in clip(spans.get("compute", []), s0, s1))
        gaps, t = [], s0
        for s, e, _ in busy:
            if s > t:
                gaps.append((s - t, t, s))
            t = max(t, e)
        if s1 > t:
            gaps.append((s1 - t, t, s1))
        gaps.sort(reverse=True)
        engines = ", ".join(
            f"{lane[6:]} {sum(e - s for s, e, _ in clip(spans[lane], s0, s1)):.1f}"
            for lane in ("disk: params", "disk: state reads", "disk: state writes", "disk: grad park")
            if lane in spans
        )
        print(
            f"{name}: {s1 - s0:.1f} ms; disk busy {busy_ms:.1f} ms ({busy_ms / (s1 - s0):.0%}"
            f"{'; ' + engines if engines else ''}), "
            f"compute {comp_ms:.1f} ms, waiting for params {wait_ms:.1f} ms"
        )
        if "device: compute" in spans or "device: h2d" in spans:
            dev = union(clip(spans.get("device: compute", []), s0, s1))

            def busy(lane):
                u = union(clip(spans.get(lane, []), s0, s1))
                under = sum(max(0.0, min(e, f) - max(s, c)) for s, e, _ in u for c, f, _ in dev)
                return sum(e - s for s, e, _ in u), under

            (h2d, h2d_under), (d2h, d2h_under) = busy("device: h2d"), busy("device: d2h")
            print(
                f"  device: compute busy {sum(e - s for s, e, _ in dev):.1f} ms; "
                f"h2d busy {h2d:.1f} ms ({h2d_under:.1f} under compute); "
                f"d2h busy {d2h:.1f} ms ({d2h_under:.1f} under compute)"
            )
            # Where the device waited for the host: its idle gaps between
            # compute spans, longest first, with the host's spans then.
            idle = sorted(
                ((b[0] - a[1], a[1], b[0], a[2], b[2]) for a, b in zip(dev, dev[1:]) if b[0] > a[1]),
                reverse=True,
            )
            print(f"  device idle between compute spans: {sum(i[0] for i in idle):.1f} ms in {len(idle)} gaps")
            for d, a, b, before, after in idle[:top]:
                host = host_during(spans, a, b)
                print(
                    f"  device idle {d:.1f} ms at +{a - s0:.1f} ms, after {before}, before {after}; "
                    f"host: {', '.join(sorted(set(host))) or 'nothing on its lanes'}"
                )
        for d, a, b in gaps[:top]:
            during = host_during(spans, a, b)
            what = ", ".join(sorted(set(during))) or "nothing on the compute thread"
            print(f"  disk idle {d:.1f} ms at +{a - s0:.1f} ms, during: {what}")
    if against is not None:
        per_unit(spans, against)
    return 0


def host_during(spans, a, b):
    """The names of the compute thread's and the store's spans within a..b."""
    names = [n for s, e, n in clip(spans.get("compute", []) + spans.get("params", []), a, b)]
    return names + [f"store {n}" for s, e, n in clip(spans.get("store", []), a, b)]


def per_unit(spans, alone):
    """Each unit's compute here against the same unit computing alone."""

    def by_name(sp):
        out = {}
        for s, e, n in sp.get("compute", []):
            out.setdefault(n, []).append((s, e))
        return out

    here, there = by_name(spans), by_name(alone)
    disk = spans.get("disk", [])
    order = sorted(there, key=lambda n: (n.split()[0] == "bwd", n))
    total_here = total_alone = 0.0
    print("unit      alone ms  here ms  ratio  disk busy")
    for name in order:
        if name not in here:
            continue
        a = statistics.median(e - s for s, e in there[name])
        h = statistics.median(e - s for s, e in here[name])
        share = statistics.median(
            sum(de - ds for ds, de, _ in clip(disk, s, e)) / (e - s) if e > s else 0.0
            for s, e in here[name]
        )
        total_here += h
        total_alone += a
        print(f"{name:8} {a:9.2f} {h:8.2f} {h / a if a else float('nan'):6.2f} {share:9.0%}")
    if total_alone:
        print(f"{'total':8} {total_alone:9.2f} {total_here:8.2f} {total_here / total_alone:6.2f}")


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Where a `perf record` of `tierzero train` spent its samples, by category,
and the fused element loops (`tierzero::wide::x86::avx2` instances, one per
inlined loop) by the source function most of each one's lines come from.

    perf record -F 999 -o perf.data target/release/tierzero train \\
        --config W/tz0/ds.json --model W/tz0/model --data data/corpus.txt \\
        --data-format bytes --seq-len 128 --steps 40 --json
    python3 scripts/perf_categories.py perf.data

The categories: gemm (its microkernels and packing), the fused element
loops, candle's backprop add (`binary_map_vec_par`), memset, memmove, the
kernel, the Adam kernel, and the rest.
"""
import collections
import re
import subprocess
import sys


def perf(*args):
    return subprocess.run(["perf", *args], check=True, capture_output=True, text=True).stdout


def category(kind, sym):
    if "gemm" in sym:
        return "gemm (microkernels, packing)"
    if "wide::x86" in sym:
        return "fused element loops (wide::x86::avx2)"
    if "binary_map_vec_par" in sym:
        return "candle backprop add"
    if "memset" in sym:
        return "memset"
    if "memmove" in sym:
        return "memmove"
    if kind == "k":
        return "kernel (wake-ups, faults)"
    if "adam" in sym:
        return "Adam kernel"
    return "other"


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    data = sys.argv[1]
    report = perf("report", "-i", data, "--no-children", "--sort", "symbol", "--stdio")
    cats = collections.Counter()
    for line in report.splitlines():
        m = re.match(r"\s+([0-9.]+)%\s+\[(.)\]\s+(.*?)\s{2,}", line)
        if m:
            cats[category(m.group(2), m.group(3))] += float(m.group(1))
    for c, pct in cats.most_common():
        print(f"{pct:5.1f}%  {c}")
    ann = perf("annotate", "-i", data, "--stdio", "-s", "tierzero::wide::x86::avx2").splitlines()
    starts = [i for i, l in enumerate(ann) if "Percent |" in l] + [len(ann)]
    print("\nfused element loops (samples, the source function most lines are from):")
    for a, b in zip(starts, starts[1:]):
        n = re.search(r"\((\d+) samples", ann[a])
        names = collections.Counter(
            m.group(1)
            for l in ann[a:b]
            if (m := re.match(r"\s+:\s+\d+\s+(tierzero::model::\S+?):?$", l))
        )
        top = names.most_common(1)[0][0] if names else "?"
        print(f"{n.group(1) if n else '?':>6}  {top}")


if __name__ == "__main__":
    main()

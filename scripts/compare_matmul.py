#!/usr/bin/env python3
"""GFLOP/s of one [1024, 192] x [192, 768] f32 matmul, torch (MKL) beside
tierzero's (candle's gemm, `examples/matmul_threads`), on 1 and 2 threads,
alternating. Shows how each scales from one thread to two.

    cargo build --release --example matmul_threads
    scripts/compare_matmul.py [--bin target/release/examples/matmul_threads]

Exits 0 with a message when torch is missing.
"""
import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=str(ROOT / "target/release/examples/matmul_threads"))
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("compare_matmul: torch is not installed; nothing to compare")
        return 0
    a, b = torch.randn(1024, 192), torch.randn(192, 768)
    for th in [1, 2, 1, 2]:
        torch.set_num_threads(th)
        for _ in range(20):
            a @ b
        reps = 300
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        gf = 2 * 1024 * 192 * 768 * reps / (time.perf_counter() - t) / 1e9
        print(f"torch threads {th} x @ w: {gf:.1f} GFLOP/s", flush=True)
        subprocess.run([args.bin, str(th)], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

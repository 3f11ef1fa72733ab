#!/usr/bin/env python3
"""HF Trainer losses: optim="adamw_torch" against tierzero.torch.AdamW
(offload none and nvme), the setting of python/tests/test_hf_trainer.py.
Prints every 10th logged loss and the largest difference.

    .ci/venv/bin/python scripts/compare_hf_trainer.py [--nvme-dir DIR]
"""
import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python" / "tests"))

try:
    import transformers
    from test_hf_trainer import Windows, args, decay_groups, losses, model, tzt
except ImportError as e:  # torch / transformers / accelerate missing
    print(f"skipped: {e}")
    sys.exit(0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nvme-dir", default=None)
    a = ap.parse_args()
    transformers.logging.set_verbosity_error()
    tmp = Path(tempfile.mkdtemp())
    nvme = Path(a.nvme_dir) if a.nvme_dir else tmp / "nvme"
    runs = {}
    with contextlib.redirect_stdout(io.StringIO()):
        runs["adamw_torch"] = losses(transformers.Trainer(model=model(), args=args(tmp, optim="adamw_torch"), train_dataset=Windows(512)))
        for off in ("none", "nvme"):
            m = model()
            opt = tzt.AdamW(decay_groups(m, 0.1), lr=1e-3, offload=off, nvme_path=nvme, sub_group_size=20_000)
            runs[f"tierzero {off}"] = losses(transformers.Trainer(model=m, args=args(tmp), train_dataset=Windows(512), optimizers=(opt, None)))
    names = list(runs)
    print("| step | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    ref = runs["adamw_torch"]
    for i in list(range(0, len(ref), 10)) + [len(ref) - 1]:
        print(f"| {i + 1} | " + " | ".join(f"{runs[n][i]:.6f}" for n in names) + " |")
    for n in names[1:]:
        print(f"{n}: largest |loss - adamw_torch| over {len(ref)} steps = {max(abs(x - y) for x, y in zip(runs[n], ref)):.2e}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The learning rates DeepSpeed's own schedulers give, step by step, for
tests/lr_schedule_deepspeed.rs (which checks tierzero's schedules against
them through the config reader).

  python scripts/deepspeed_lr_reference.py LR_SCHEDULES_PY [SOURCE] > tests/fixtures/deepspeed_lr_schedules.txt

SOURCE names the DeepSpeed the file came from (e.g. "edaa72212 (0.19.6)")
for the fixture's header, which this prints first (the header was lost
when the fixture was made again).

LR_SCHEDULES_PY is DeepSpeed's deepspeed/runtime/lr_schedules.py (from a
checkout, e.g. `git show HEAD:deepspeed/runtime/lr_schedules.py`); it is
loaded alone, with a stand-in for its one DeepSpeed import (the logger),
so DeepSpeed need not be installed. Needs torch.

Each case builds the scheduler on a torch SGD optimizer of lr 3e-4 with
the case's params, then for each of 12 optimizer steps records the lr the
step runs at and calls `scheduler.step()`, as DeepSpeed's engine does
after each applied step. One line per case: the scheduler type, its
params as JSON, and the 12 lrs (Python's repr: they round-trip exactly).
"""

import importlib.util
import json
import logging
import sys
import types

STEPS = 12
BASE_LR = 3e-4


def load(path):
    ds = types.ModuleType("deepspeed")
    utils = types.ModuleType("deepspeed.utils")
    utils.logger = logging.getLogger("deepspeed")
    utils.logger.setLevel(logging.ERROR)
    ds.utils = utils
    sys.modules.setdefault("deepspeed", ds)
    sys.modules.setdefault("deepspeed.utils", utils)
    spec = importlib.util.spec_from_file_location("lr_schedules", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cases():
    for kind in ("log", "linear"):
        for w in (1, 2, 5):
            common = {"warmup_num_steps": w, "warmup_type": kind}
            yield "WarmupLR", dict(common)
            yield "WarmupLR", dict(common, warmup_min_lr=1e-5, warmup_max_lr=2e-3)
            yield "WarmupDecayLR", dict(common, total_num_steps=8)
            yield "WarmupCosineLR", dict(common, total_num_steps=8, warmup_min_ratio=0.05,
                                         cos_min_ratio=0.1)


def main():
    if len(sys.argv) not in (2, 3):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    import torch
    mod = load(sys.argv[1])
    source = sys.argv[2] if len(sys.argv) == 3 else "(source not given)"
    print(f"# DeepSpeed's schedulers at {source}, by scripts/deepspeed_lr_reference.py:")
    print(f"# the scheduler, its params, the lr of each of {STEPS} optimizer steps.")
    p = torch.nn.Parameter(torch.zeros(1))
    for name, params in cases():
        opt = torch.optim.SGD([p], lr=BASE_LR)
        sched = getattr(mod, name)(opt, **params)
        lrs = []
        for _ in range(STEPS):
            lrs.append(opt.param_groups[0]["lr"])
            sched.step()
        print(name, json.dumps(params, sort_keys=True), " ".join(repr(x) for x in lrs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

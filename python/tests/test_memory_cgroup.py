"""Optimizer state larger than a memory cgroup: tierzero trains, torch is killed.

150M params: their fp32 master weights and moments are 1.8 GB, the cgroup
allows 1.6 GiB (1.72 GB). `torch.optim.AdamW` over the fp32 params (params,
grads, m, v: 16 B/param) is OOM-killed; `tierzero.torch.AdamW` with the
params and grads in bf16 in memory and the fp32 master, m and v on NVMe
(4 B/param in memory) trains. Needs a writable memory cgroup (v1 or v2;
root here); skips otherwise.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

CHILD = Path(__file__).with_name("_cgroup_child.py")
LIMIT_BYTES = 1600 << 20
NUMEL = 150_000_000


def make_cgroup(name):
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    if v2.exists():
        if "memory" not in v2.read_text().split():
            return None
        path = Path("/sys/fs/cgroup") / name
        limits = {"memory.max": LIMIT_BYTES, "memory.swap.max": 0}
    else:
        base = Path("/sys/fs/cgroup/memory")
        if not base.is_dir():
            return None
        path = base / name
        limits = {"memory.limit_in_bytes": LIMIT_BYTES}
        if (base / "memory.memsw.limit_in_bytes").exists():
            limits["memory.memsw.limit_in_bytes"] = LIMIT_BYTES
    try:
        path.mkdir(exist_ok=True)
        for k, v in limits.items():
            if (path / k).exists():
                (path / k).write_text(str(v))
    except OSError:
        return None
    return path


@pytest.fixture
def cgroup():
    path = make_cgroup(f"tierzero-test-{os.getpid()}")
    if path is None:
        pytest.skip("no writable memory cgroup")
    yield path
    try:
        path.rmdir()
    except OSError:
        pass


def run_in(cgroup, *args):
    procs = cgroup / "cgroup.procs"

    def enter():
        procs.write_text(str(os.getpid()))

    return subprocess.run(
        [sys.executable, str(CHILD), *map(str, args)],
        preexec_fn=enter,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_state_larger_than_the_cgroup_trains_on_nvme(cgroup, tmp_path):
    assert 12 * NUMEL > LIMIT_BYTES  # the fp32 state does not fit
    torch_run = run_in(cgroup, "torch", NUMEL, 2, tmp_path / "unused", "float32")
    assert torch_run.returncode == -9, (torch_run.returncode, torch_run.stdout, torch_run.stderr[-2000:])
    tz = run_in(cgroup, "tz", NUMEL, 2, tmp_path / "nvme", "bfloat16")
    assert tz.returncode == 0, (tz.returncode, tz.stdout, tz.stderr[-2000:])
    assert tz.stdout.startswith("ok tz")

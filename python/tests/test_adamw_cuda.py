"""tierzero.torch.AdamW over CUDA params: gradients down and new params up
through pinned buffers on a side stream (``_CudaCopies``), against the same
run over CPU params, bit for bit. Skipped without a GPU.

It needs no pytest: ``scripts/gpu_check.sh`` runs it as a script with the
lent machine's PyTorch (``python test_adamw_cuda.py TMPDIR``), which prints
one JSON line."""

import json
import pathlib
import sys
import tempfile

try:
    import pytest
except ImportError:  # run as a script
    pytest = None

try:
    import torch
except ImportError:
    torch = None
    if pytest is not None and __name__ != "__main__":
        pytest.skip("no torch", allow_module_level=True)

if pytest is not None and __name__ != "__main__" and not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

if torch is None:  # run as a script without torch: say so
    print(json.dumps({"cuda": False, "error": "torch is not installed"}))
    sys.exit(1)

import tierzero.torch as tzt  # noqa: E402

SIZES = [1, 7, 1023, 4097, 300_000]


def run(device, dtype, offload, tmp_path, sub_group_size, steps=5):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(n).to(dtype).to(device)) for n in SIZES]
    opt = tzt.AdamW(
        [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}],
        lr=1e-2,
        offload=offload,
        nvme_path=tmp_path / f"{device}{dtype}{offload}{sub_group_size}",
        sub_group_size=sub_group_size,
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in ps:
            # Gradients made on the device's compute stream, as backward makes them.
            p.grad = (torch.randn(p.shape, generator=g).to(device) * 2).to(dtype)
        opt.step()
        # The compute stream reads the new params at once.
        for p in ps:
            p.data.mul_(1.0)
    return [p.detach().cpu() for p in ps]


def test_cuda_params_get_the_bits_cpu_params_get(tmp_path):
    for dtype in (torch.float32, torch.bfloat16):
        for offload, sgs in (("cpu", 10**9), ("nvme", 10**9), ("nvme", 5000)):
            want = run("cpu", dtype, offload, tmp_path, sgs)
            got = run("cuda", dtype, offload, tmp_path, sgs)
            for a, b in zip(got, want):
                assert a.dtype == dtype, (dtype, offload, sgs)
                assert torch.equal(a, b), (dtype, offload, sgs)


def test_cuda_step_in_backward_equals_step_after(tmp_path):
    results = []
    for sib in (False, True):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda()
        opt = tzt.AdamW(
            m.parameters(), lr=1e-2, offload="nvme", nvme_path=tmp_path / f"sib{sib}",
            sub_group_size=4096, step_in_backward=sib,
        )
        g = torch.Generator(device="cuda").manual_seed(2)
        for _ in range(5):
            x = torch.randn(32, 64, device="cuda", generator=g)
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        results.append([p.detach().cpu() for p in m.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


if __name__ == "__main__":
    base = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
    out = {"cuda": bool(torch is not None and torch.cuda.is_available())}
    if out["cuda"]:
        for name, fn in list(globals().items()):
            if name.startswith("test_"):
                d = base / name
                d.mkdir(parents=True, exist_ok=True)
                try:
                    fn(d)
                    out[name] = "passed"
                except Exception as e:  # noqa: BLE001 - reported, not raised
                    out[name] = f"failed: {type(e).__name__}: {e}"
    print(json.dumps(out))
    sys.exit(0 if out["cuda"] and all(v == "passed" for k, v in out.items() if k.startswith("test_")) else 1)

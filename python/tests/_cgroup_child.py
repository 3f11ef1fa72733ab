"""Child of test_memory_cgroup.py: a few AdamW steps over N fp32 params."""
import resource
import sys

import torch

impl, numel, steps, nvme, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], getattr(torch, sys.argv[5])
torch.manual_seed(0)
params = [torch.nn.Parameter(torch.zeros(numel // 4, dtype=dtype)) for _ in range(4)]
if impl == "torch":
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
else:
    import tierzero.torch as tzt

    opt = tzt.AdamW(params, lr=1e-3, offload="nvme", nvme_path=nvme, sub_group_size=2_000_000)
for p in params:
    p.grad = torch.full_like(p, 0.5)
for _ in range(steps):
    opt.step()
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(f"ok {impl} numel={numel} steps={steps} max_rss_bytes={rss} p0={params[0][0].item():.6f}")

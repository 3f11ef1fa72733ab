#!/usr/bin/env python3
"""PyTorch FSDP2 with CPUOffloadPolicy: the training throughput tierzero's
offloaded run is compared with (issue 23's third device check). The model
is built with `transformers` from the same config.json tierzero trains
(a Llama layout), on one GPU: every decoder layer and the root wrapped by
`fully_shard` with `CPUOffloadPolicy(pin_memory=True)` (params, gradients
and AdamW's state in pinned host memory, AdamW on the CPU) and
`MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`, the
same batch and sequence length, random token ids. Prints one JSON line:
tokens/s, model TFLOPS (6 * params + 12 * layers * hidden * seq FLOPs per
token, the count gpu_check uses for tierzero), step seconds and the GPU's
peak memory.

  python scripts/fsdp2_offload_throughput.py --config DIR/config.json \
      [--micro 2] [--seq 1024] [--steps 5] [--attn eager] [--out OUT.json] \
      [--device cuda|cpu]

`--device cpu` is a smoke test, not a measurement: gloo instead of NCCL,
unpinned host memory, the compute on the CPU. `.ci/run` runs it on a tiny
Llama so that the first lent GPU does not find a broken script.

The first two steps are not timed (the first grows the allocator's pool
and pins the host memory). scripts/gpu_check.sh runs it with the lent
machine's PyTorch beside `tierzero train --device cuda`.
"""

import argparse
import json
import os
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True, help="the model's config.json (a Llama layout)")
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--attn", default="eager", help="eager (tierzero's algorithm) or sdpa")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--out")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cuda (the measurement) or cpu (a smoke test)")
    a = ap.parse_args()
    if a.steps < 3:
        raise SystemExit("--steps must be at least 3: two are not timed")

    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("fsdp2_offload_throughput: no CUDA device (torch.cuda.is_available() is False)")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # fp32 masters whatever the config.json's dtype says; transformers 5
    # renamed the argument.
    major = int(transformers.__version__.split(".")[0])
    fp32 = {"dtype": torch.float32} if major >= 5 else {"torch_dtype": torch.float32}
    try:
        cfg = AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(a.config)))
        cfg._attn_implementation = a.attn
        torch.manual_seed(0)
        t_build = time.perf_counter()
        model = AutoModelForCausalLM.from_config(cfg, **fp32)
        model.train()
        params = sum(p.numel() for p in model.parameters())
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        off = CPUOffloadPolicy(pin_memory=cuda)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp, offload_policy=off)
        fully_shard(model, mp_policy=mp, offload_policy=off)
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
        build_s = time.perf_counter() - t_build
        g = torch.Generator(device=a.device).manual_seed(1)

        def step():
            ids = torch.randint(0, cfg.vocab_size, (a.micro, a.seq), device=a.device, generator=g)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        first = step().item()
        step()
        sync()
        t0 = time.perf_counter()
        for _ in range(a.steps - 2):
            last = step()
        sync()
        secs = time.perf_counter() - t0
        timed = a.steps - 2
        tok_s = timed * a.micro * a.seq / secs
        layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
        fpt = 6 * params + 12 * layers * hidden * a.seq
        out = {
            "ok": True,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__,
            "policy": f"FSDP2 fully_shard per decoder layer + root, CPUOffloadPolicy(pin_memory={cuda}), "
            "MixedPrecisionPolicy(bf16 params, fp32 reduce), torch.optim.AdamW on the CPU",
            "attn": a.attn,
            "params": params,
            "layers": layers,
            "micro": a.micro,
            "seq": a.seq,
            "steps_timed": timed,
            "build_s": build_s,
            "step_s": secs / timed,
            "tokens_per_s": tok_s,
            "model_tflops": tok_s * fpt / 1e12,
            "first_loss": first,
            "last_loss": last.item(),
            "max_memory_allocated": torch.cuda.max_memory_allocated() if cuda else None,
        }
    finally:
        dist.destroy_process_group()
    line = json.dumps(out)
    print(line)
    if a.out:
        with open(a.out, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()

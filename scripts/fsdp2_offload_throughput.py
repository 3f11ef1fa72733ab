#!/usr/bin/env python3
"""PyTorch FSDP2 with CPUOffloadPolicy: the training throughput tierzero's
offloaded run is compared with (issue 23's third device check). The model
is built with `transformers` from the same config.json tierzero trains
(a Llama layout), on one GPU: every decoder layer and the root wrapped by
`fully_shard` with `CPUOffloadPolicy(pin_memory=True)` (params, gradients
and AdamW's state in pinned host memory, AdamW on the CPU) and
`MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`, the
same batch and sequence length, random token ids. As tierzero's default
config (src/config/default.json: "gradient_clipping": 1.0), the gradients
are clipped to a global L2 norm of 1.0 before each step (--clip; 0 turns
it off). The optimizer is torch's AdamW with fused=True (its CPU kernel)
where this torch accepts it for the offloaded (CPU, DTensor) params, else
foreach=True; the JSON says which ran ("optimizer") and why it fell back.
Prints one JSON line: tokens/s, model TFLOPS (6 * params + 12 * layers *
hidden * seq FLOPs per token, the count gpu_check uses for tierzero), step
seconds and their host seconds per phase (forward and backward, the
clipping, the CPU AdamW: `phase_s`), torch's CPU threads, the GPU's peak memory, the optimizer, the clipping and the
attention implementation the model was built with
(`model.config._attn_implementation`).

  python scripts/fsdp2_offload_throughput.py --config DIR/config.json \
      [--micro 2] [--seq 1024] [--steps 5] [--attn eager] [--clip 1.0] [--out OUT.json] \
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
    ap.add_argument("--clip", type=float, default=1.0,
                    help="clip the gradients' global L2 norm to this before each step, as "
                    "tierzero's default config does (gradient_clipping 1.0); 0: no clipping")
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
        # What transformers made of the request (it may pick another).
        attn_impl = getattr(model.config, "_attn_implementation", None)
        params = sum(p.numel() for p in model.parameters())
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        off = CPUOffloadPolicy(pin_memory=cuda)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp, offload_policy=off)
        fully_shard(model, mp_policy=mp, offload_policy=off)

        def make_opt(kind):
            kw = {"fused": True} if kind == "fused" else {"foreach": True}
            return torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01, **kw)

        # fused=True: torch's fused AdamW, which has a CPU kernel (the params
        # are offloaded to the CPU); foreach=True where this torch refuses it.
        opt_note = None
        try:
            opt, opt_kind = make_opt("fused"), "fused"
        except (TypeError, RuntimeError) as e:
            opt, opt_kind = make_opt("foreach"), "foreach"
            opt_note = f"fused=True refused at construction: {type(e).__name__}: {e}"[:500]
        build_s = time.perf_counter() - t_build
        g = torch.Generator(device=a.device).manual_seed(1)
        last_norm = [None]

        def clip():
            # The global L2 norm over every gradient, as tierzero clips on
            # the host's sum of squares. One rank: each DTensor's local shard
            # is the whole gradient, so the local tensors' norm is the global
            # one, and no collective runs (the offloaded gradients are CPU
            # tensors, which NCCL would not take).
            if a.clip <= 0:
                return
            with torch.no_grad():
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                local = [x.to_local() if hasattr(x, "to_local") else x for x in grads]
                if not local:
                    return
                norm = torch.linalg.vector_norm(
                    torch.stack([n.float() for n in torch._foreach_norm(local, 2.0)]), 2.0)
                coef = torch.clamp(a.clip / (norm + 1e-6), max=1.0)
                torch._foreach_mul_(local, coef.to(local[0].dtype))
                last_norm[0] = float(norm)

        # Host seconds per phase of the timed steps, no synchronisation
        # added: forward and backward until `backward()` returns, the
        # clipping, the optimizer step (with zero_grad). A wait for work
        # still in flight when `backward()` returns (the gradients' copies
        # to the host) falls in whichever phase waits for it. What
        # tierzero's offloaded step overlaps and FSDP2's runs in turn.
        phases = {"forward_backward": 0.0, "clip": 0.0, "optimizer": 0.0}
        timing = [False]

        def step():
            t = [time.perf_counter()]
            ids = torch.randint(0, cfg.vocab_size, (a.micro, a.seq), device=a.device, generator=g)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            t.append(time.perf_counter())
            clip()
            t.append(time.perf_counter())
            opt.step()
            opt.zero_grad(set_to_none=True)
            t.append(time.perf_counter())
            if timing[0]:
                for k, (t0, t1) in zip(phases, zip(t, t[1:])):
                    phases[k] += t1 - t0
            return loss

        # The first step is not timed; if the fused kernel is refused only
        # when it runs (the params are DTensors), the step is taken again
        # with foreach=True (a failed fused call has not touched the params).
        try:
            first = step().item()
        except (RuntimeError, NotImplementedError, TypeError) as e:
            if opt_kind != "fused":
                raise
            opt.zero_grad(set_to_none=True)
            opt, opt_kind = make_opt("foreach"), "foreach"
            opt_note = f"fused=True failed at the first step: {type(e).__name__}: {e}"[:500]
            first = step().item()
        step()
        sync()
        timing[0] = True
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
            f"MixedPrecisionPolicy(bf16 params, fp32 reduce), torch.optim.AdamW({opt_kind}=True) on the CPU",
            "optimizer": f"AdamW({opt_kind}=True)",
            "optimizer_note": opt_note,
            "grad_clip": a.clip if a.clip > 0 else None,
            "last_grad_norm": last_norm[0],
            "attn": a.attn,
            "attn_implementation": attn_impl,
            "params": params,
            "layers": layers,
            "micro": a.micro,
            "seq": a.seq,
            "steps_timed": timed,
            "build_s": build_s,
            "step_s": secs / timed,
            "phase_s": {k: v / timed for k, v in phases.items()},
            "cpu_threads": torch.get_num_threads(),
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

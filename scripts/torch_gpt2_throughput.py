#!/usr/bin/env python3
"""PyTorch eager's training throughput on the shape of
gpu/examples/throughput.rs: a GPT-2 of about 350M params (24 layers, hidden
1024, 16 heads, vocabulary 50257, tied embeddings), sequences of 1024,
torch.autocast(bfloat16), eager attention, AdamW(fused=True). Prints one
JSON line with tokens/s and model TFLOPS (6 * params + 12 * layers *
hidden * seq FLOPs per token, the count the Rust example uses), and the
attention implementation the model was built with
(`model.config._attn_implementation`: transformers may not keep the
"eager" asked for). scripts/gpu_check.sh passes --batch, --steps and
--layers, the values it gives the Rust example (BATCH, STEPS, LAYERS).

  python scripts/torch_gpt2_throughput.py [--batch 4] [--steps 6] [--layers 24] [--out OUT.json] \
      [--hidden 1024 --heads 16 --seq 1024] [--device cuda|cpu]

`--device cpu` is a smoke test, not a measurement (`.ci/run` runs it on a
small shape, so that the first lent GPU does not find a broken script).

scripts/gpu_check.sh runs it with the lent machine's PyTorch beside the
Rust example."""

import argparse
import json
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--out")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cuda (the measurement) or cpu (a smoke test)")
    a = ap.parse_args()
    if a.steps < 2:
        raise SystemExit("--steps must be at least 2: the first is not timed")
    cfg = GPT2Config(
        n_layer=a.layers, n_embd=a.hidden, n_head=a.heads, n_inner=4 * a.hidden, vocab_size=50257,
        n_positions=a.seq,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).to(a.device).train()
    # What transformers made of the request (it may pick another).
    attn_impl = getattr(model.config, "_attn_implementation", None)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    g = torch.Generator(device=a.device).manual_seed(1)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)

    def step():
        ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), device=a.device, generator=g)
        with torch.autocast(a.device, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    first = step().item()
    sync()
    t0 = time.perf_counter()
    for _ in range(a.steps - 1):
        last = step()
    sync()
    secs = time.perf_counter() - t0
    timed = a.steps - 1
    tok_s = timed * a.batch * a.seq / secs
    fpt = 6 * params + 12 * a.layers * a.hidden * a.seq
    out = {
        "ok": True, "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__, "params": params,
        "layers": a.layers, "hidden": a.hidden, "batch": a.batch, "seq": a.seq, "steps": a.steps, "steps_timed": timed,
        "step_s": secs / timed, "attn_implementation": attn_impl, "optimizer": "AdamW(fused=True)",
        "tokens_per_s": tok_s, "model_tflops": tok_s * fpt / 1e12, "first_loss": first, "last_loss": last.item(),
        "max_memory_allocated": torch.cuda.max_memory_allocated() if a.device == "cuda" else None,
    }
    line = json.dumps(out)
    print(line)
    if a.out:
        with open(a.out, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()

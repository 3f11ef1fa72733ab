#!/usr/bin/env python3
"""tierzero's CPU training speed beside PyTorch's, on the same model and
work, side by side and alternating (issue 27's table).

    scripts/compare_torch.py [--bin target/release/tierzero] [--rounds 3]
                             [--model gpt2|llama] [--steps 40] [--warmup 5]
                             [--threads 2] [--arms torch,torch_ckpt,tz,tz_ckpt,...]

Each round runs every arm once, in an order that reverses every other
round, and each arm trains `--warmup` + `--steps` steps of 8 x 128 tokens
(AdamW, clipping `--clip`) from a seeded init; tokens/s is taken over the
steps after the warm-up. The arms:

* `torch`: PyTorch eager (HF `GPT2LMHeadModel` / `LlamaForCausalLM`),
  `torch.optim.AdamW(fused=True)`, `torch.set_num_threads(--threads)`;
* `torch_ckpt`: the same with `gradient_checkpointing_enable()`;
* `tz`: `tierzero train --config` stage 0 (everything in memory), the
  activation policy's default (`"auto"`: blocks keep their graphs);
* `tz_ckpt`: the same with `--gradient-checkpointing` (every block
  recomputed, as before the policy);
* `tz_nvme`: stage 3 with params and optimizer state on NVMe (a temporary
  directory), `sub_group_size` 2e5 (13 sub-groups for the GPT-2 shape),
  optimizer pipelining on, the default policy.

`--clip` (default 1.0) sets every arm's clipping. From the seeded init
every step's norm is above 1, so with clipping the offloaded optimizer can
only step once the norm is known (the speculative step misses and stops);
`--clip 0` shows the offloaded step without that wait.

Prints one line per arm: the median tokens/s over rounds, and the ratio to
`torch`'s median. The models: `gpt2` is the embedded default's shape (4
layers, hidden 192, 4 heads, vocab 256); `llama` is hidden 512, 8 layers,
8 heads (4 KV heads), intermediate 1376, vocab 256. The data are the bytes
of data/corpus.txt. Exits 0 with a message when torch or transformers is
missing.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MICRO, SEQ = 8, 128

GPT2 = {
    "model_type": "gpt2", "vocab_size": 256, "n_positions": 256, "n_embd": 192,
    "n_layer": 4, "n_head": 4, "activation_function": "gelu_new",
    "initializer_range": 0.02, "tie_word_embeddings": True,
    "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
}
LLAMA = {
    "model_type": "llama", "vocab_size": 256, "hidden_size": 512,
    "intermediate_size": 1376, "num_hidden_layers": 8, "num_attention_heads": 8,
    "num_key_value_heads": 4, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
    "initializer_range": 0.02, "attention_bias": False, "mlp_bias": False,
    "attention_dropout": 0.0,
}


def ds_config(stage, swap, clip=1.0):
    zero = {"stage": stage}
    if stage == 3:
        off = {"device": "nvme", "nvme_path": str(swap)}
        zero.update({"offload_param": dict(off, buffer_size=4_000_000, max_in_cpu=0),
                     "offload_optimizer": dict(off, pipeline_read=True, pipeline_write=True),
                     "sub_group_size": 200_000})
    return {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95],
                                                  "eps": 1e-8, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "tierzero": {"checksums": False},
    }


def run_tierzero(args, work, model_cfg, stage, ckpt):
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(model_cfg))
    swap = work / "swap"
    swap.mkdir(exist_ok=True)
    cfg = work / "ds.json"
    ds = ds_config(stage, swap, args.clip)
    # The same compute threads as torch's set_num_threads (the tierzero
    # arms took every core on "auto" while the summary said N threads).
    ds["tierzero"]["compute_threads"] = args.threads
    cfg.write_text(json.dumps(ds))
    metrics = work / "metrics.jsonl"
    cmd = [args.bin, "train", "--config", str(cfg), "--model", str(model),
           "--data", str(ROOT / "data/corpus.txt"), "--data-format", "bytes",
           "--seq-len", str(SEQ), "--steps", str(args.warmup + args.steps),
           "--metrics", str(metrics), "--json"]
    if ckpt:
        cmd.append("--gradient-checkpointing")
    env = dict(os.environ)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    steps = [json.loads(l) for l in metrics.read_text().splitlines()]
    steps = [s for s in steps if "wall_s" in s and "step" in s][args.warmup:]
    return MICRO * SEQ * len(steps) / sum(s["wall_s"] for s in steps)


def run_torch(args, model_cfg, ckpt):
    import torch
    import transformers

    torch.manual_seed(1)
    torch.set_num_threads(args.threads)
    if model_cfg["model_type"] == "gpt2":
        cfg = transformers.GPT2Config(**{k: v for k, v in model_cfg.items() if k != "model_type"})
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(**{k: v for k, v in model_cfg.items() if k != "model_type"})
        model = transformers.LlamaForCausalLM(cfg)
    if ckpt:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.01, fused=True)
    data = torch.tensor(list((ROOT / "data/corpus.txt").read_bytes()), dtype=torch.long)
    g = torch.Generator().manual_seed(1)
    times = []
    for i in range(args.warmup + args.steps):
        starts = torch.randint(0, len(data) - SEQ - 1, (MICRO,), generator=g)
        batch = torch.stack([data[s:s + SEQ + 1] for s in starts.tolist()])
        t0 = time.perf_counter()
        out = model(input_ids=batch[:, :-1], labels=batch[:, :-1])
        out.loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return MICRO * SEQ * len(times) / sum(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=str(ROOT / "target/release/tierzero"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arms", default="torch,torch_ckpt,tz,tz_ckpt,tz_nvme")
    ap.add_argument("--workdir", default=None,
                    help="keep each arm's ds.json, model/config.json and metrics here "
                         "(default: a temporary directory, removed), e.g. to profile one "
                         "with perf record")
    ap.add_argument("--clip", type=float, default=1.0,
                    help="gradient clipping max norm for every arm (0: off)")
    args = ap.parse_args()
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"skipped: {e} (install torch and transformers to compare)")
        return 0
    if not Path(args.bin).exists():
        print(f"no tierzero binary at {args.bin}: cargo build --release first", file=sys.stderr)
        return 2
    model_cfg = GPT2 if args.model == "gpt2" else LLAMA
    arms = args.arms.split(",")
    results = {a: [] for a in arms}
    with tempfile.TemporaryDirectory(prefix="tz-vs-torch-") as tmp:
        tmp = Path(args.workdir) if args.workdir else Path(tmp)
        for r in range(args.rounds):
            order = arms if r % 2 == 0 else arms[::-1]
            for a in order:
                if a == "torch":
                    v = run_torch(args, model_cfg, False)
                elif a == "torch_ckpt":
                    v = run_torch(args, model_cfg, True)
                elif a == "tz":
                    v = run_tierzero(args, tmp / f"tz{r}", model_cfg, 0, False)
                elif a == "tz_ckpt":
                    v = run_tierzero(args, tmp / f"tzc{r}", model_cfg, 0, True)
                elif a == "tz_nvme":
                    v = run_tierzero(args, tmp / f"tzn{r}", model_cfg, 3, False)
                else:
                    print(f"unknown arm {a}", file=sys.stderr)
                    return 2
                results[a].append(v)
                print(f"round {r + 1} {a}: {v:,.0f} tok/s", file=sys.stderr, flush=True)
    base = statistics.median(results["torch"]) if results.get("torch") else None
    print(f"model {args.model}, {MICRO} x {SEQ} tokens a step, {args.steps} steps after "
          f"{args.warmup}, {args.threads} threads, clipping {args.clip}, {args.rounds} rounds "
          f"alternating")
    for a in arms:
        med = statistics.median(results[a])
        ratio = f"{med / base:.2f}x torch" if base else ""
        print(f"{a:11s} {med:9,.0f} tok/s  {ratio}  (rounds: "
              + ", ".join(f"{v:,.0f}" for v in results[a]) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())

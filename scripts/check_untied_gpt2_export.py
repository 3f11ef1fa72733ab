#!/usr/bin/env python3
"""An untied GPT-2 export loads with `GPT2LMHeadModel.from_pretrained`, and
the naming before 2026-12-05 (every name without `transformer.`) did not
under transformers 4.

Usage (the transformers of the interpreter's path; for 4.x, e.g.
`pip install --target /tmp/tf4 'transformers>=4.50,<5'` and
`PYTHONPATH=/tmp/tf4`):
  check_untied_gpt2_export.py [--bin target/debug/tierzero] [--dir /tmp/g2u]

Prints whether each loads ("clean", missing/unexpected keys, or the
error); exits 1 when tierzero's export does not load clean.
"""
import argparse
import json, os, subprocess, sys, shutil
import torch, transformers
from transformers import GPT2Config, GPT2LMHeadModel
from safetensors.torch import load_file, save_file
print("transformers", transformers.__version__)
ap = argparse.ArgumentParser(); ap.add_argument("--bin", default="target/debug/tierzero"); ap.add_argument("--dir", default="/tmp/g2u")
args = ap.parse_args(); B = os.path.abspath(args.bin)
d = os.path.join(args.dir, "run"); shutil.rmtree(d, ignore_errors=True); os.makedirs(d)
torch.manual_seed(0)
cfg = GPT2Config(vocab_size=320, n_positions=128, n_embd=64, n_layer=2, n_head=4, n_inner=96, tie_word_embeddings=False)
m = GPT2LMHeadModel(cfg); m.save_pretrained(f"{d}/model")
print("save_pretrained names:", sorted(load_file(f"{d}/model/model.safetensors"))[:3])
open(f"{d}/data.txt","wb").write(bytes(range(256))*4)
json.dump({"train_micro_batch_size_per_gpu":2,"gradient_accumulation_steps":1,"optimizer":{"type":"AdamW","params":{"lr":1e-2}},"zero_optimization":{"stage":3}}, open(f"{d}/ds.json","w"))
subprocess.run([B,"train","--model",f"{d}/model","--config",f"{d}/ds.json","--data",f"{d}/data.txt","--steps","1","--seq-len","48","--save-dir",f"{d}/ckpt","--json"],check=True,capture_output=True)
subprocess.run([B,"export","--checkpoint",f"{d}/ckpt","--out",f"{d}/export/model.safetensors","--dtype","fp32","--json"],check=True,capture_output=True)
names = sorted(load_file(f"{d}/export/model.safetensors"))
print("export names:", names[:2], "...", names[-2:])
def load(path):
    try:
        _, info = GPT2LMHeadModel.from_pretrained(path, output_loading_info=True)
        return {k: v for k, v in info.items() if v} or "clean"
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:120]}"
print("export loads:", load(f"{d}/export"))
# The old naming (every name unprefixed), as before this change.
w = load_file(f"{d}/export/model.safetensors")
os.makedirs(f"{d}/old", exist_ok=True); shutil.copy(f"{d}/export/config.json", f"{d}/old/config.json")
save_file({k.removeprefix("transformer."): v for k, v in w.items()}, f"{d}/old/model.safetensors", metadata={"format":"pt"})
print("old naming loads:", load(f"{d}/old"))
sys.exit(0 if load(f"{d}/export") == "clean" else 1)

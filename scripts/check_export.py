#!/usr/bin/env python3
"""Checks a `tierzero export` file against an independent reader.

Usage:
  check_export.py --weights FILE.safetensors --config config.json \
      --data FILE --seq-len L --expect-loss X [--transformers]

What it checks, with nothing from tierzero but the files:
  1. Names, shapes and dtypes are exactly HF GPT-2's (`GPT2LMHeadModel`
     state dict without the `transformer.` prefix, tied `lm_head` absent
     or equal to `wte`), and every value is finite. Read with the
     `safetensors` package (numpy backend).
  2. The next-token loss of the model on the data, computed here with a
     GPT-2 forward written in numpy (float64), over non-overlapping windows
     of L byte tokens where positions 1..L-1 are predicted from the ones
     before (HF's `labels=input_ids` convention), equals `--expect-loss`
     (what `tierzero eval --json` printed) within 1e-3 relative.
  3. With `--transformers`: the file loads strictly into
     `transformers.GPT2LMHeadModel` (no missing or unexpected keys) and
     its loss on the same windows matches too. Needs torch; CI skips it.

Exits 0 when everything holds, 1 with a message otherwise.
"""

import argparse
import json
import math
import sys

import numpy as np
from safetensors.numpy import load_file

BLOCK_NAMES = [
    ("ln_1.weight", lambda c: (c["n_embd"],)),
    ("ln_1.bias", lambda c: (c["n_embd"],)),
    ("attn.c_attn.weight", lambda c: (c["n_embd"], 3 * c["n_embd"])),
    ("attn.c_attn.bias", lambda c: (3 * c["n_embd"],)),
    ("attn.c_proj.weight", lambda c: (c["n_embd"], c["n_embd"])),
    ("attn.c_proj.bias", lambda c: (c["n_embd"],)),
    ("ln_2.weight", lambda c: (c["n_embd"],)),
    ("ln_2.bias", lambda c: (c["n_embd"],)),
    ("mlp.c_fc.weight", lambda c: (c["n_embd"], c["n_inner"])),
    ("mlp.c_fc.bias", lambda c: (c["n_inner"],)),
    ("mlp.c_proj.weight", lambda c: (c["n_inner"], c["n_embd"])),
    ("mlp.c_proj.bias", lambda c: (c["n_embd"],)),
]


def fail(msg):
    print(f"check_export: FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def expected_shapes(cfg):
    cfg = dict(cfg)
    if cfg.get("n_inner") is None:
        cfg["n_inner"] = 4 * cfg["n_embd"]
    shapes = {
        "wte.weight": (cfg["vocab_size"], cfg["n_embd"]),
        "wpe.weight": (cfg["n_positions"], cfg["n_embd"]),
        "ln_f.weight": (cfg["n_embd"],),
        "ln_f.bias": (cfg["n_embd"],),
    }
    for i in range(cfg["n_layer"]):
        for name, shape in BLOCK_NAMES:
            shapes[f"h.{i}.{name}"] = shape(cfg)
    return cfg, shapes


def strip_prefix(tensors):
    return {
        (k[len("transformer."):] if k.startswith("transformer.") else k): v
        for k, v in tensors.items()
    }


def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def gelu(x, kind):
    if kind == "gelu":
        return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def gpt2_logits(w, cfg, ids):
    """ids: [T] int array -> logits [T, vocab], float64."""
    t = len(ids)
    e = cfg["n_embd"]
    nh = cfg["n_head"]
    hd = e // nh
    eps = cfg.get("layer_norm_epsilon", 1e-5)
    act = cfg.get("activation_function", "gelu_new")
    x = w["wte.weight"][ids] + w["wpe.weight"][:t]
    mask = np.triu(np.full((t, t), -np.inf), 1)
    for i in range(cfg["n_layer"]):
        p = f"h.{i}."
        a = layer_norm(x, w[p + "ln_1.weight"], w[p + "ln_1.bias"], eps)
        qkv = a @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]
        q, k, v = np.split(qkv, 3, axis=-1)
        q = q.reshape(t, nh, hd).transpose(1, 0, 2)
        k = k.reshape(t, nh, hd).transpose(1, 0, 2)
        v = v.reshape(t, nh, hd).transpose(1, 0, 2)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(hd) + mask
        s = s - s.max(-1, keepdims=True)
        pr = np.exp(s)
        pr /= pr.sum(-1, keepdims=True)
        o = (pr @ v).transpose(1, 0, 2).reshape(t, e)
        x = x + o @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        m = layer_norm(x, w[p + "ln_2.weight"], w[p + "ln_2.bias"], eps)
        m = gelu(m @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"], act)
        x = x + m @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
    x = layer_norm(x, w["ln_f.weight"], w["ln_f.bias"], eps)
    head = w.get("lm_head.weight", w["wte.weight"])
    return x @ head.T


def windows(tokens, seq_len):
    n = len(tokens) // seq_len
    return [tokens[i * seq_len:(i + 1) * seq_len] for i in range(n)]


def numpy_loss(w, cfg, tokens, seq_len):
    total = 0.0
    count = 0
    for win in windows(tokens, seq_len):
        logits = gpt2_logits(w, cfg, win)
        z = logits[:-1]
        z = z - z.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        total -= logp[np.arange(len(win) - 1), win[1:]].sum()
        count += len(win) - 1
    return total / count, count


def transformers_loss(path, cfg_path, tokens, seq_len):
    import os
    import shutil
    import tempfile

    import torch
    from transformers import GPT2LMHeadModel

    with tempfile.TemporaryDirectory() as d:
        shutil.copy(cfg_path, os.path.join(d, "config.json"))
        shutil.copy(path, os.path.join(d, "model.safetensors"))
        model, info = GPT2LMHeadModel.from_pretrained(
            d, output_loading_info=True, torch_dtype=torch.float64
        )
    bad = {k: v for k, v in info.items() if v}
    if bad:
        fail(f"transformers loading info is not clean: {bad}")
    model.eval()
    total = 0.0
    count = 0
    with torch.no_grad():
        for win in windows(tokens, seq_len):
            ids = torch.tensor(win, dtype=torch.long)[None]
            out = model(ids, labels=ids)
            total += out.loss.item() * (len(win) - 1)
            count += len(win) - 1
    return total / count


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--expect-loss", type=float, required=True)
    ap.add_argument("--expect-tokens", type=int)
    ap.add_argument("--max-windows", type=int, default=0)
    ap.add_argument("--transformers", action="store_true")
    args = ap.parse_args()

    with open(args.config) as f:
        cfg, shapes = expected_shapes(json.load(f))
    raw = load_file(args.weights)
    w = strip_prefix(raw)
    names = set(w)
    missing = sorted(set(shapes) - names)
    extra = sorted(names - set(shapes) - {"lm_head.weight"})
    if missing:
        fail(f"missing tensors: {missing[:5]} ({len(missing)} in all)")
    if extra:
        fail(f"unexpected tensors: {extra[:5]} ({len(extra)} in all)")
    for name, shape in shapes.items():
        if tuple(w[name].shape) != shape:
            fail(f"{name}: shape {tuple(w[name].shape)}, HF GPT-2 has {shape}")
    if "lm_head.weight" in w and not np.array_equal(w["lm_head.weight"], w["wte.weight"]):
        fail("lm_head.weight differs from the tied wte.weight")
    for name, t in w.items():
        if not np.isfinite(t.astype(np.float64)).all():
            fail(f"{name}: non-finite values")
    w = {k: v.astype(np.float64) for k, v in w.items()}
    print(f"check_export: {len(shapes)} tensors, names and shapes are HF GPT-2's")

    with open(args.data, "rb") as f:
        tokens = np.frombuffer(f.read(), dtype=np.uint8).astype(np.int64)
    if args.max_windows:
        tokens = tokens[: args.max_windows * args.seq_len]
    loss, count = numpy_loss(w, cfg, tokens, args.seq_len)
    rel = abs(loss - args.expect_loss) / max(abs(args.expect_loss), 1e-12)
    print(
        f"check_export: numpy loss {loss:.6f} over {count} tokens; "
        f"tierzero eval {args.expect_loss:.6f}; relative difference {rel:.2e}"
    )
    if args.expect_tokens is not None and args.expect_tokens != count:
        fail(f"tierzero eval counted {args.expect_tokens} tokens, the numpy reader {count}")
    if rel > 1e-3:
        fail(f"loss differs by {rel:.2e} relative (limit 1e-3)")
    if args.transformers:
        tl = transformers_loss(args.weights, args.config, tokens, args.seq_len)
        trel = abs(tl - args.expect_loss) / abs(args.expect_loss)
        print(
            f"check_export: transformers GPT2LMHeadModel (strict load) loss {tl:.6f}; "
            f"relative difference {trel:.2e}"
        )
        if trel > 1e-3:
            fail(f"transformers loss differs by {trel:.2e} relative (limit 1e-3)")
    print("check_export: OK")


if __name__ == "__main__":
    main()

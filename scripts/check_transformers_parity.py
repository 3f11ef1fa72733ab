#!/usr/bin/env python3
"""tierzero against transformers, family by family and config style by style.

Usage:
  check_transformers_parity.py [--bin target/debug/tierzero] [--only NAME ...]
                               [--keep DIR] [--json FILE]

For each case (GPT-2, tied and untied; Llama with transformers 4's top-level `rope_theta`,
with transformers 5's `rope_parameters`, with Llama 3.1's `llama3` rope in
both styles, with linear, dynamic and yarn rope, with attention and MLP
biases; Mistral with a sliding window shorter than the sequence; Qwen2 with
tied embeddings; Qwen3 with an explicit head_dim):

  1. the config is built in Python and a model with random fp32 weights
     (norm weights and biases random too, so they matter) is written by
     transformers' `save_pretrained`; for the transformers 4 style the
     written `rope_parameters` is moved back to `rope_theta` / `rope_scaling`;
  2. `tierzero eval --model DIR` on a byte file (windows of L tokens that do
     not overlap, a trailing partial window of 2 or more counting, the mean
     over every predicted token: `src/eval.rs`) is compared with the same
     windows through transformers in fp32: relative difference <= 1e-5;
  3. one `tierzero train` step (stage 3, AdamW) saves a checkpoint, `tierzero
     export` writes safetensors plus config.json, transformers'
     `AutoModelForCausalLM.from_pretrained` loads it (no missing or
     unexpected keys, the family's class, the same rotary settings) and its
     loss equals `tierzero eval --checkpoint`'s: relative difference <= 1e-5;
     the step must have moved the loss.
  4. a control: where the case tests a setting (a rotary variant or base, a
     sliding window), tierzero's loss with that setting undone must differ
     by more than 50 times the limit ("control" column), so the match
     above is not luck.

Needs torch and transformers (5.x). Exits 0 when every case holds, 1 with
the failing cases otherwise; prints one table line per case.
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

TOL = 1e-5
SEQ_LEN = 48
# 4 full windows and a partial one of 10 tokens (9 predictions).
N_TOKENS = 4 * SEQ_LEN + 10
VOCAB = 320

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # head_dim 16 at theta 5e5: wavelengths 6.3, 32, 167, ...: one in each
    # of llama3's three bands with L = 64 (high < 16 <= medium <= 64 < low).
    "original_max_position_embeddings": 64,
}

# name -> (config class, kwargs, style): style "v5" keeps what
# save_pretrained wrote, "v4" rewrites it to rope_theta / rope_scaling.
CASES = {
    "gpt2": (
        GPT2Config,
        dict(vocab_size=VOCAB, n_positions=128, n_embd=64, n_layer=2, n_head=4, n_inner=96),
        "v5",
    ),
    # An untied head: the export names the body `transformer.*` beside
    # `lm_head.weight`, as GPT2LMHeadModel's state dict does.
    "gpt2-untied": (
        GPT2Config,
        dict(vocab_size=VOCAB, n_positions=128, n_embd=64, n_layer=2, n_head=4, n_inner=96,
             tie_word_embeddings=False),
        "v5",
    ),
    "llama-v4-theta": (
        LlamaConfig,
        dict(COMMON, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
        "v4",
    ),
    "llama-v5-theta": (
        LlamaConfig,
        dict(COMMON, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
        "v5",
    ),
    "llama3-rope-v5": (LlamaConfig, dict(COMMON, rope_parameters=dict(LLAMA3)), "v5"),
    "llama3-rope-v4": (LlamaConfig, dict(COMMON, rope_parameters=dict(LLAMA3)), "v4"),
    "llama-linear": (
        LlamaConfig,
        dict(COMMON, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0}),
        "v5",
    ),
    "llama-dynamic": (
        LlamaConfig,
        dict(COMMON, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
        "v5",
    ),
    "llama-yarn": (
        LlamaConfig,
        dict(
            COMMON,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        "v5",
    ),
    "llama-bias-hd20": (
        LlamaConfig,
        dict(COMMON, attention_bias=True, mlp_bias=True, head_dim=20, tie_word_embeddings=True),
        "v5",
    ),
    "mistral-window16": (
        MistralConfig,
        dict(COMMON, sliding_window=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        "v5",
    ),
    "qwen2-tied": (
        Qwen2Config,
        dict(COMMON, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        "v5",
    ),
    "qwen3-hd24": (
        Qwen3Config,
        dict(COMMON, head_dim=24, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        "v5",
    ),
}

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
    "zero_optimization": {"stage": 3},
}


def to_v4_style(cfg_path):
    """Rewrites transformers 5's rope_parameters as rope_theta / rope_scaling."""
    with open(cfg_path) as f:
        cfg = json.load(f)
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = rope
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)


def control_config(cfg):
    """The config with the setting under test undone (sliding window off, or
    plain RoPE of base 10000), or None when nothing would change: a control
    that tierzero's loss does depend on it."""
    cfg = dict(cfg)
    if cfg.get("sliding_window"):
        cfg["sliding_window"] = None
        return cfg
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", "default")
    if kind == "dynamic" or (kind == "default" and theta == 10000.0):
        return None
    for key in ("rope_parameters", "rope_scaling", "rope_theta"):
        cfg.pop(key, None)
    cfg["rope_theta"] = 10000.0
    return cfg


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name or "ln_" in name:
                if name.endswith("bias"):
                    p.copy_(0.1 * noise)
                else:
                    p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.15 * noise)


def windows(tokens, seq_len):
    """The windows of src/eval.rs: full ones, then a partial one of >= 2."""
    full = len(tokens) // seq_len
    out = [tokens[i * seq_len:(i + 1) * seq_len] for i in range(full)]
    rest = tokens[full * seq_len:]
    if len(rest) >= 2:
        out.append(rest)
    return out


def hf_loss(model, tokens, seq_len):
    """Mean NLL over every predicted token (position i predicts i + 1)."""
    total = 0.0
    count = 0
    model.eval()
    with torch.no_grad():
        for win in windows(tokens, seq_len):
            ids = torch.tensor(win, dtype=torch.long)[None]
            logits = model(ids).logits[0, :-1].double()
            logp = torch.log_softmax(logits, dim=-1)
            total -= logp[torch.arange(len(win) - 1), ids[0, 1:]].sum().item()
            count += len(win) - 1
    return total / count, count


def run(cmd, what):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{what} exited {r.returncode}: {r.stderr.strip()[-2000:]}")
    return r.stdout


def tz_eval(binary, source_flag, path, data):
    out = run(
        [binary, "eval", source_flag, path, "--data", data, "--seq-len", str(SEQ_LEN), "--json"],
        f"tierzero eval {source_flag} {path}",
    )
    v = json.loads(out)
    return v["loss"], v["tokens"]


def effective(config, key):
    """A config setting as the modeling code reads it (defaults filled in)."""
    v = getattr(config, key, None)
    if key == "head_dim" and v is None and hasattr(config, "num_attention_heads"):
        v = config.hidden_size // config.num_attention_heads
    if key == "rope_parameters" and isinstance(v, dict) and v.get("rope_type") == "yarn":
        v = dict(v)
        v.setdefault("truncate", True)
    return v


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def check_case(name, spec, binary, work, seed):
    cls, kwargs, style = spec
    d = os.path.join(work, name)
    model_dir = os.path.join(d, "model")
    os.makedirs(d)
    config = cls(**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, seed)
    model.save_pretrained(model_dir)
    cfg_path = os.path.join(model_dir, "config.json")
    if style == "v4":
        to_v4_style(cfg_path)
    # The reference reads the directory as a user's from_pretrained would,
    # so the style rewrite is part of what is compared.
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(1000 + seed)
    tokens = torch.randint(0, 256, (N_TOKENS,), generator=g).tolist()
    data = os.path.join(d, "data.bytes")
    with open(data, "wb") as f:
        f.write(bytes(tokens))
    want, count = hf_loss(ref, tokens, SEQ_LEN)
    got, tz_count = tz_eval(binary, "--model", model_dir, data)
    if tz_count != count:
        raise RuntimeError(f"tierzero predicted {tz_count} tokens, the reference {count}")
    before = rel(got, want)
    # The control: the same weights with the setting under test undone must
    # give a clearly different loss, or the comparison above proves nothing.
    with open(cfg_path) as f:
        control = control_config(json.load(f))
    control_rel = None
    if control is not None:
        cdir = os.path.join(d, "control")
        os.makedirs(cdir)
        with open(os.path.join(cdir, "config.json"), "w") as f:
            json.dump(control, f)
        os.symlink(os.path.join(model_dir, "model.safetensors"),
                   os.path.join(cdir, "model.safetensors"))
        control_loss, _ = tz_eval(binary, "--model", cdir, data)
        control_rel = rel(control_loss, want)
        if control_rel < 50 * TOL:
            raise RuntimeError(
                f"control: with the setting undone the loss moves only {control_rel:.2e}; "
                "the case does not test it")

    # One training step, export, from_pretrained.
    ds = os.path.join(d, "ds_config.json")
    with open(ds, "w") as f:
        json.dump(DS_CONFIG, f)
    ckpt = os.path.join(d, "ckpt")
    run(
        [binary, "train", "--model", model_dir, "--config", ds, "--data", data, "--steps", "1",
         "--seq-len", str(SEQ_LEN), "--save-dir", ckpt, "--json"],
        "tierzero train",
    )
    out_dir = os.path.join(d, "export")
    run(
        [binary, "export", "--checkpoint", ckpt, "--out", os.path.join(out_dir, "model.safetensors"),
         "--dtype", "fp32", "--json"],
        "tierzero export",
    )
    trained, _ = tz_eval(binary, "--checkpoint", ckpt, data)
    back, info = AutoModelForCausalLM.from_pretrained(
        out_dir, dtype=torch.float32, output_loading_info=True
    )
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise RuntimeError(f"from_pretrained of the export is not clean: {bad}")
    if type(back) is not type(ref):
        raise RuntimeError(f"export loads as {type(back).__name__}, not {type(ref).__name__}")
    for key in ("rope_parameters", "sliding_window", "head_dim", "attention_bias", "mlp_bias",
                "tie_word_embeddings", "num_key_value_heads", "rms_norm_eps"):
        a, b = effective(ref.config, key), effective(back.config, key)
        if a != b:
            raise RuntimeError(f"exported config: {key} = {b!r}, the source has {a!r}")
    after_hf, _ = hf_loss(back, tokens, SEQ_LEN)
    after = rel(trained, after_hf)
    if abs(trained - got) < 1e-6:
        raise RuntimeError(f"the training step did not move the loss ({got} -> {trained})")
    return dict(
        case=name, style=style, hf_loss=want, tz_loss=got, rel=before,
        trained_tz=trained, trained_hf=after_hf, trained_rel=after, tokens=count,
        control_rel=control_rel,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/debug/tierzero")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--keep", help="work in DIR and keep it")
    ap.add_argument("--json", help="write the results to FILE")
    args = ap.parse_args()
    binary = os.path.abspath(args.bin)
    names = args.only or list(CASES)
    work = args.keep or tempfile.mkdtemp(prefix="tz-parity.")
    if args.keep:
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
    print(f"check_transformers_parity: transformers {transformers.__version__}, torch "
          f"{torch.__version__}; windows of {SEQ_LEN} over {N_TOKENS} tokens; limit {TOL:g}")
    print(f"{'case':<18} {'style':<5} {'transformers':>13} {'tierzero':>13} {'rel':>9}   "
          f"{'after step: tierzero':>20} {'from_pretrained':>15} {'rel':>9} {'control':>9}")
    results, failures = [], []
    t0 = time.time()
    try:
        for i, name in enumerate(names):
            try:
                r = check_case(name, CASES[name], binary, work, seed=i + 1)
            except Exception as e:  # noqa: BLE001 - reported per case
                failures.append(f"{name}: {e}")
                print(f"{name:<18} FAIL: {e}")
                continue
            results.append(r)
            ok = r["rel"] <= TOL and r["trained_rel"] <= TOL
            if not ok:
                failures.append(f"{name}: relative differences {r['rel']:.2e}, {r['trained_rel']:.2e}")
            print(f"{name:<18} {r['style']:<5} {r['hf_loss']:>13.8f} {r['tz_loss']:>13.8f} "
                  f"{r['rel']:>9.2e}   {r['trained_tz']:>20.8f} {r['trained_hf']:>15.8f} "
                  f"{r['trained_rel']:>9.2e} "
                  f"{'-' if r['control_rel'] is None else format(r['control_rel'], '.2e'):>9}"
                  f"{'' if ok else '  FAIL'}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    print(f"check_transformers_parity: {len(results)} cases run in {time.time() - t0:.0f} s")
    if failures:
        for f in failures:
            print(f"check_transformers_parity: FAIL: {f}", file=sys.stderr)
        sys.exit(1)
    print("check_transformers_parity: OK")


if __name__ == "__main__":
    main()

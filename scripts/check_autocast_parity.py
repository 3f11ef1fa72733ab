#!/usr/bin/env python3
"""tierzero's bf16 against transformers under torch.autocast, same weights.

Usage:
  check_autocast_parity.py [--bin target/debug/tierzero] [--only gpt2|llama ...]
                           [--keep DIR] [--json FILE]

For a GPT-2 and a Llama (GQA, untied head) of tierzero's seeded init:

  1. `tierzero train` with `bf16.enabled` (stage 3) trains a few steps from
     the seeded init on byte data (so the logits are no longer uniform and
     the loss depends on the arithmetic), saving a checkpoint;
  2. `tierzero export --dtype bf16` writes the bf16 weights the run computes
     with (HF names, config.json);
  3. transformers' `from_pretrained(..., dtype=torch.float32)` loads them
     (bf16 values held exactly in fp32, so both sides read the same
     numbers, norm weights and biases included) and evaluates held-out
     windows under `torch.autocast("cpu", dtype=torch.bfloat16)`; `tierzero
     eval --precision bf16` evaluates the same windows: relative
     difference <= 2e-3;
  4. the same without autocast against `tierzero eval --precision fp32`:
     relative difference <= 1e-5.

  5. a closer look: autocast again, with forward hooks rounding the hidden
     state to bf16 where tierzero's units end (the embedding's and each
     block's output: the one place the policy of `src/model/precision.rs`
     differs from autocast, see there): relative difference <= 5e-4, so
     the 2e-3 above is not hiding a second difference.

"bf16 vs fp32" (transformers' autocast loss against its fp32 one) is for
scale: how much bf16 moves the loss of these small models at all. Needs torch and transformers (5.x); run by .ci/run beside
check_transformers_parity.py. Exits 0 when every case holds.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig  # noqa: E402

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

TOL_BF16 = 2e-3
TOL_FP32 = 1e-5
# Against autocast with the hidden state rounded to bf16 where tierzero's
# units end: what remains is the order of roundings inside a unit (SwiGLU's
# product rounded once, not twice; HF's gelu_new in several bf16 ops).
TOL_UNITS = 5e-4
SEQ_LEN = 64
VOCAB = 320
STEPS = 12

CASES = {
    "gpt2": (
        GPT2Config,
        dict(vocab_size=VOCAB, n_positions=128, n_embd=128, n_layer=3, n_head=4, n_inner=320),
    ),
    "llama": (
        LlamaConfig,
        dict(
            vocab_size=VOCAB,
            hidden_size=128,
            intermediate_size=320,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
}

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}},
    "zero_optimization": {"stage": 3},
}


def windows(tokens, seq_len):
    """The windows of src/eval.rs: full ones, then a partial one of >= 2."""
    full = len(tokens) // seq_len
    out = [tokens[i * seq_len:(i + 1) * seq_len] for i in range(full)]
    rest = tokens[full * seq_len:]
    if len(rest) >= 2:
        out.append(rest)
    return out


def round_unit_outputs(model):
    """Forward hooks that round the hidden state to bf16 where tierzero's
    units end (the embedding's output and each block's): the one place
    tierzero's policy differs from autocast. Returns the handles."""
    if hasattr(model, "transformer"):
        ends = [model.transformer.drop] + list(model.transformer.h)
    else:
        ends = [model.model.embed_tokens] + list(model.model.layers)

    def hook(_mod, _inp, out):
        if isinstance(out, tuple):
            return (out[0].to(torch.bfloat16).float(),) + tuple(out[1:])
        return out.to(torch.bfloat16).float()

    return [m.register_forward_hook(hook) for m in ends]


def hf_loss(model, tokens, seq_len, autocast):
    """Mean NLL over every predicted token (position i predicts i + 1); the
    logits (bf16 under autocast) are upcast before the log-softmax, as
    transformers' loss does."""
    total = 0.0
    count = 0
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
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


def tz_eval(binary, model_dir, data, precision):
    out = run(
        [binary, "eval", "--model", model_dir, "--data", data, "--seq-len", str(SEQ_LEN),
         "--precision", precision, "--json"],
        f"tierzero eval --precision {precision}",
    )
    v = json.loads(out)
    return v["loss"], v["tokens"]


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def corpus_bytes(repo, start, n):
    with open(os.path.join(repo, "data", "corpus.txt"), "rb") as f:
        data = f.read()
    return data[start:start + n]


def check_case(name, spec, binary, work, repo):
    cls, kwargs = spec
    d = os.path.join(work, name)
    init_dir = os.path.join(d, "init")
    os.makedirs(init_dir)
    # config.json alone: tierzero's seeded init.
    cls(**kwargs).save_pretrained(init_dir)
    for f in os.listdir(init_dir):
        if f != "config.json":
            os.remove(os.path.join(init_dir, f))
    train = os.path.join(d, "train.bytes")
    with open(train, "wb") as f:
        f.write(corpus_bytes(repo, 0, 64 * 1024))
    held_out = list(corpus_bytes(repo, 150_000, 8 * SEQ_LEN + 21))
    data = os.path.join(d, "eval.bytes")
    with open(data, "wb") as f:
        f.write(bytes(held_out))
    ds = os.path.join(d, "ds_config.json")
    with open(ds, "w") as f:
        json.dump(DS_CONFIG, f)
    ckpt = os.path.join(d, "ckpt")
    run(
        [binary, "train", "--model", init_dir, "--config", ds, "--data", train, "--steps",
         str(STEPS), "--seq-len", str(SEQ_LEN), "--save-dir", ckpt, "--json"],
        "tierzero train (bf16)",
    )
    out_dir = os.path.join(d, "export")
    run(
        [binary, "export", "--checkpoint", ckpt, "--out", os.path.join(out_dir, "model.safetensors"),
         "--dtype", "bf16", "--json"],
        "tierzero export --dtype bf16",
    )
    model, info = AutoModelForCausalLM.from_pretrained(
        out_dir, dtype=torch.float32, output_loading_info=True
    )
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise RuntimeError(f"from_pretrained of the export is not clean: {bad}")
    hf32, count = hf_loss(model, held_out, SEQ_LEN, autocast=False)
    hf16, _ = hf_loss(model, held_out, SEQ_LEN, autocast=True)
    handles = round_unit_outputs(model)
    hf16u, _ = hf_loss(model, held_out, SEQ_LEN, autocast=True)
    for h in handles:
        h.remove()
    tz32, n32 = tz_eval(binary, out_dir, data, "fp32")
    tz16, n16 = tz_eval(binary, out_dir, data, "bf16")
    if n32 != count or n16 != count:
        raise RuntimeError(f"tierzero predicted {n32}/{n16} tokens, the reference {count}")
    return dict(
        case=name, tokens=count, hf_fp32=hf32, tz_fp32=tz32, rel_fp32=rel(tz32, hf32),
        hf_bf16=hf16, tz_bf16=tz16, rel_bf16=rel(tz16, hf16), bf16_vs_fp32=rel(hf16, hf32),
        hf_bf16_units=hf16u, rel_bf16_units=rel(tz16, hf16u),
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/debug/tierzero")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--keep", help="work in DIR and keep it")
    ap.add_argument("--json", help="write the results to FILE")
    args = ap.parse_args()
    binary = os.path.abspath(args.bin)
    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
    names = args.only or list(CASES)
    work = args.keep or tempfile.mkdtemp(prefix="tz-autocast.")
    if args.keep:
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
    print(f"check_autocast_parity: transformers {transformers.__version__}, torch "
          f"{torch.__version__}; {STEPS} bf16 steps from the seeded init; limits bf16 "
          f"{TOL_BF16:g}, fp32 {TOL_FP32:g}")
    print(f"{'case':<6} {'hf fp32':>12} {'tz fp32':>12} {'rel':>9}   {'hf autocast':>12} "
          f"{'tz bf16':>12} {'rel':>9}   {'bf16 vs fp32':>12}   {'hf +units':>12} {'rel':>9}")
    results, failures = [], []
    t0 = time.time()
    try:
        for name in names:
            try:
                r = check_case(name, CASES[name], binary, work, repo)
            except Exception as e:  # noqa: BLE001 - reported per case
                failures.append(f"{name}: {e}")
                print(f"{name:<6} FAIL: {e}")
                continue
            results.append(r)
            ok = (r["rel_fp32"] <= TOL_FP32 and r["rel_bf16"] <= TOL_BF16
                  and r["rel_bf16_units"] <= TOL_UNITS)
            if not ok:
                failures.append(f"{name}: fp32 {r['rel_fp32']:.2e}, bf16 {r['rel_bf16']:.2e}, "
                                f"bf16 with rounded unit outputs {r['rel_bf16_units']:.2e}")
            print(f"{name:<6} {r['hf_fp32']:>12.7f} {r['tz_fp32']:>12.7f} {r['rel_fp32']:>9.2e}   "
                  f"{r['hf_bf16']:>12.7f} {r['tz_bf16']:>12.7f} {r['rel_bf16']:>9.2e}   "
                  f"{r['bf16_vs_fp32']:>12.2e}   {r['hf_bf16_units']:>12.7f} "
                  f"{r['rel_bf16_units']:>9.2e}{'' if ok else '  FAIL'}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    print(f"check_autocast_parity: {len(results)} cases run in {time.time() - t0:.0f} s")
    if failures:
        for f in failures:
            print(f"check_autocast_parity: FAIL: {f}", file=sys.stderr)
        sys.exit(1)
    print("check_autocast_parity: OK")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""`tierzero estimate` side by side with DeepSpeed's own ZeRO-3 estimator.

Usage:
  compare_estimate.py [--bin target/release/tierzero] [--params 125M,1.3B,7B,70B]
                      [--largest-layer N] [--gpus G]

Run it with a Python that has `deepspeed` (it needs torch to import; no ops
are built: `DS_BUILD_OPS=0 pip install torch deepspeed`). For each model
size it takes the largest layer tierzero assumes for it (a GPT-3-shaped
block, `inputs.largest_unit_numel` of `tierzero estimate --params N
--json`), or `--largest-layer` when given, and passes that one value to
both sides: `--largest-layer L` to tierzero and `largest_layer_params=L` to
`deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs`.

It prints one markdown table with DeepSpeed's rows (offload_param /
offload_optimizer none or cpu, zero_init 1 and 0, one node of G GPUs,
additional_buffer_factor 1.5): DeepSpeed's "per CPU" and "per GPU" next to
tierzero's device bytes per rank and host bytes (pinned + pageable, all
ranks) of stage 3 with the same offloads. tierzero has no zero_init=0
variant, so both zero_init rows show the same tierzero numbers.

It also checks the "DeepSpeed CPU / GPU" column of `tierzero estimate`
(tierzero's transcription of DeepSpeed's formulas, `estimate::deepspeed`)
against the real functions, for every choice that has it (stage 3 with
`estimate_zero3_model_states_mem_needs`, stages 1 and 2 with
`stage_1_and_2.estimate_zero2_model_states_mem_needs`), and that
`estimate_zero3_model_states_mem_needs_all_cold` prints the same figures.

Exits 0 when every check holds, 1 when one differs. Without `deepspeed`
(or when it fails to import) it says so, prints tierzero's side alone and
exits 0. Re-run it after a change to tierzero's sizing to refresh the
numbers in README.md and `src/estimate.rs`.
"""

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys

GIB = 2**30

# DeepSpeed's rows in estimate_zero3_model_states_mem_needs_all_cold order:
# (offload_param cpu, offload_optimizer cpu, zero_init).
DS_ROWS = [
    (True, True, True),
    (True, True, False),
    (False, True, True),
    (False, True, False),
    (False, False, True),
    (False, False, False),
]


def tierzero_json(binary, args):
    cmd = [binary, "estimate", *args, "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
    return json.loads(out.stdout)


def find(report, stage, optimizer, params):
    for e in report["estimates"]:
        c = e["choice"]
        if c["stage"] == stage and c["optimizer"] == optimizer and c["params"] == params:
            return e
    sys.exit(f"tierzero's report has no stage {stage} optimizer={optimizer} params={params}")


def gib(b):
    return f"{b / GIB:.2f}"


def load_deepspeed():
    """The two estimator modules, or (None, why)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            import deepspeed  # noqa: F401
            from deepspeed.runtime.zero import stage3, stage_1_and_2
    except Exception as e:  # ImportError, or torch failing to load its libraries
        return None, None, f"{type(e).__name__}: {e}"
    return stage3, stage_1_and_2, deepspeed.__version__


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default="target/release/tierzero", help="tierzero binary")
    ap.add_argument("--params", default="125M,1.3B,7B,70B", help="model sizes, comma-separated")
    ap.add_argument(
        "--largest-layer",
        default=None,
        help="largest layer for every size (default: the one tierzero assumes per size)",
    )
    ap.add_argument("--gpus", type=int, default=1, help="GPUs of one node (tierzero --ranks)")
    a = ap.parse_args()
    if not os.path.exists(a.bin):
        sys.exit(f"no tierzero binary at {a.bin}: build it (cargo build --release) or pass --bin")

    stage3, stage12, ds_version = load_deepspeed()
    have_ds = stage3 is not None
    if not have_ds:
        print(f"deepspeed is not importable here ({ds_version}); printing tierzero's side only.")
        print("Install it with: DS_BUILD_OPS=0 pip install torch deepspeed\n")

    g = a.gpus
    rows = []
    problems = []
    checked = 0
    for size in a.params.split(","):
        size = size.strip()
        if a.largest_layer is None:
            probe = tierzero_json(a.bin, ["--params", size, "--ranks", str(g)])
            largest = probe["inputs"]["largest_unit_numel"]
        else:
            largest = None
        args = ["--params", size, "--ranks", str(g), "--largest-layer", str(largest or a.largest_layer)]
        report = tierzero_json(a.bin, args)
        n = report["inputs"]["total_numel"]
        largest = report["inputs"]["largest_unit_numel"]

        if have_ds:
            # The Rust "DeepSpeed CPU / GPU" column against the real thing.
            for e in report["estimates"]:
                fig = e["deepspeed"]
                c = e["choice"]
                if fig is None:
                    continue
                cpu_offload = c["optimizer"] == "cpu"
                if c["stage"] == 3:
                    real = stage3.estimate_zero3_model_states_mem_needs(
                        total_params=n,
                        largest_layer_params=largest,
                        num_gpus_per_node=g,
                        num_nodes=1,
                        cpu_offload=cpu_offload,
                        cpu_offload_params=c["params"] == "cpu",
                        zero_init=True,
                        additional_buffer_factor=1.5,
                    )[:2]
                else:
                    real = stage12.estimate_zero2_model_states_mem_needs(
                        total_params=n,
                        num_gpus_per_node=g,
                        num_nodes=1,
                        cpu_offload=cpu_offload,
                        additional_buffer_factor=1.5,
                    )
                checked += 1
                if (fig["cpu_bytes"], fig["gpu_bytes"]) != tuple(real):
                    problems.append(
                        f"{size} stage {c['stage']} optimizer={c['optimizer']} params={c['params']}: "
                        f"tierzero's DeepSpeed column says cpu {fig['cpu_bytes']} gpu {fig['gpu_bytes']}, "
                        f"DeepSpeed {real[0]} {real[1]}"
                    )
            # The printed table carries the same figures.
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                stage3.estimate_zero3_model_states_mem_needs_all_cold(
                    total_params=n, largest_layer_params=largest, num_gpus_per_node=g, num_nodes=1
                )
            cold = re.findall(r"^\s*([\d.]+)GB \|\s*([\d.]+)GB \|", printed.getvalue(), re.M)
            if len(cold) != len(DS_ROWS):
                problems.append(f"{size}: all_cold printed {len(cold)} rows, expected {len(DS_ROWS)}")
                cold = [None] * len(DS_ROWS)

        for i, (par, opt, init) in enumerate(DS_ROWS):
            if not have_ds and not init:
                continue  # tierzero has no zero_init=0 variant: the same numbers again
            e = find(report, 3, "cpu" if opt else "none", "cpu" if par else "none")
            t = e["per_node"]
            row = {
                "size": size,
                "largest": largest,
                "param": "cpu" if par else "none",
                "opt": "cpu" if opt else "none",
                "init": int(init),
                "tz_device": e["per_rank"]["device_bytes"],
                "tz_pinned": t["pinned_bytes"],
                "tz_pageable": t["pageable_bytes"],
            }
            if have_ds:
                cpu, gpu, _ = stage3.estimate_zero3_model_states_mem_needs(
                    total_params=n,
                    largest_layer_params=largest,
                    num_gpus_per_node=g,
                    num_nodes=1,
                    cpu_offload=opt,
                    cpu_offload_params=par,
                    zero_init=init,
                    additional_buffer_factor=1.5,
                )
                row["ds_cpu"], row["ds_gpu"] = cpu, gpu
                if cold[i] is not None and cold[i] != (f"{cpu / GIB:.2f}", f"{gpu / GIB:.2f}"):
                    problems.append(f"{size} row {i}: all_cold printed {cold[i]}, the function gives {cpu} {gpu}")
            rows.append(row)

    gpus = f"{g} GPU" if g == 1 else f"{g} GPUs"
    ds_what = (
        f"DeepSpeed {ds_version}: estimate_zero3_model_states_mem_needs, additional_buffer_factor 1.5; "
        if have_ds
        else ""
    )
    print(
        f"Stage 3, one node of {gpus}, GiB (2^30 B). {ds_what}"
        "tierzero: `tierzero estimate --json` with DeepSpeed's default swap settings (no --config), "
        "device per rank, host = pinned + pageable for all ranks."
    )
    print()
    head = "| model | largest layer | offload_param | offload_optimizer | zero_init |"
    rule = "|---|---:|---|---|---:|"
    if have_ds:
        head += " DeepSpeed per GPU | DeepSpeed per CPU |"
        rule += "---:|---:|"
    head += " tierzero device | tierzero host (pinned + pageable) |"
    rule += "---:|---:|"
    print(head)
    print(rule)
    for r in rows:
        line = f"| {r['size']} | {r['largest'] / 1e6:.1f}M | {r['param']} | {r['opt']} | {r['init']} |"
        if have_ds:
            line += f" {gib(r['ds_gpu'])} | {gib(r['ds_cpu'])} |"
        host = r["tz_pinned"] + r["tz_pageable"]
        line += f" {gib(r['tz_device'])} | {gib(host)} ({gib(r['tz_pinned'])} + {gib(r['tz_pageable'])}) |"
        print(line)
    print()
    if not have_ds:
        print("DeepSpeed's side skipped: deepspeed is not installed.")
        return 0
    if problems:
        print("MISMATCH between tierzero's \"DeepSpeed CPU / GPU\" column and DeepSpeed:")
        for p in problems:
            print("  " + p)
        return 1
    print(
        f"Checked: tierzero's \"DeepSpeed CPU / GPU\" column equals DeepSpeed {ds_version}'s "
        f"estimate_zero3_model_states_mem_needs / estimate_zero2_model_states_mem_needs to the byte "
        f"for all {checked} (size, choice) pairs that have it, over {len(a.params.split(','))} size(s), "
        "and estimate_zero3_model_states_mem_needs_all_cold prints the same figures."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

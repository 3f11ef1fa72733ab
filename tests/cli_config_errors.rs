//! Bad `ds_config.json` files through the CLI: `tierzero train --config
//! BAD.json --steps 1` exits 2 and prints exactly one line on stderr that
//! names the key and the value or the fix, with no panic or backtrace. The
//! library-level checks are in `tests/config_errors.rs`; this is what a user
//! sees. Model and data are the embedded defaults (config errors come before
//! the engine starts); `base_config_trains` proves the base these cases
//! mutate is valid, so each error comes from the one key changed.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failure is a panic

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

mod cli_support;
use cli_support::{assert_bad_input, run_tierzero};

/// A fresh directory with an empty `swap/`.
fn scratch(tag: &str) -> PathBuf {
    let d = cli_support::scratch("cli-config", tag);
    std::fs::create_dir_all(d.join("swap")).unwrap();
    d
}

/// Stage 3 with params and optimizer state on NVMe in `d/swap`.
fn base(d: &Path) -> Value {
    let swap = d.join("swap");
    let swap = swap.to_str().unwrap();
    json!({
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999]}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": swap},
            "offload_optimizer": {"device": "nvme", "nvme_path": swap}
        }
    })
}

/// `a` with the keys of `patch` set (recursively for objects).
fn patched(mut a: Value, patch: Value) -> Value {
    fn merge(a: &mut Value, b: Value) {
        match (a, b) {
            (Value::Object(a), Value::Object(b)) => {
                for (k, v) in b {
                    merge(a.entry(k).or_insert(Value::Null), v);
                }
            }
            (a, b) => *a = b,
        }
    }
    merge(&mut a, patch);
    a
}

/// Writes `text` as the config and checks the one-line error.
fn check_text(tag: &str, d: &Path, text: &str, words: &[&str]) {
    std::fs::write(d.join("bad.json"), text).unwrap();
    let out = run_tierzero(Some(d), &["train", "--config", "bad.json", "--steps", "1"]);
    assert_bad_input(&out, tag, words);
    assert!(out.stderr.contains("bad.json"), "{tag}: {}", out.stderr);
    assert!(out.stdout.is_empty(), "{tag}: stdout {}", out.stdout);
}

/// The base config with `patch` applied must fail with `words`.
fn check(tag: &str, patch: Value, words: &[&str]) {
    let d = scratch(tag);
    let cfg = patched(base(&d), patch);
    check_text(tag, &d, &cfg.to_string(), words);
}

#[test]
fn base_config_trains() {
    let d = scratch("base");
    std::fs::write(d.join("ok.json"), base(&d).to_string()).unwrap();
    let out = run_tierzero(
        Some(&d),
        &[
            "train",
            "--config",
            "ok.json",
            "--steps",
            "1",
            "--seq-len",
            "16",
        ],
    );
    assert_eq!(out.code, 0, "stderr: {}", out.stderr);
    assert!(out.stdout.contains("weight_sha256"), "{}", out.stdout);
}

/// DeepSpeed reads its config with hjson; a config with comments and
/// trailing commas trains, and to the same weights as the plain JSON.
#[test]
fn commented_config_trains_like_the_plain_one() {
    let d = scratch("commented");
    let swap = d.join("swap");
    let swap = swap.to_str().unwrap();
    let commented = format!(
        r#"// ZeRO-3, everything on NVMe
{{
  "train_micro_batch_size_per_gpu": 2, # per rank
  "gradient_accumulation_steps": 1,
  /* AdamW as HF writes it */
  "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3, "betas": [0.9, 0.999],}},}},
  "zero_optimization": {{
    "stage": 3,
    "offload_param": {{"device": "nvme", "nvme_path": "{swap}"}},
    "offload_optimizer": {{"device": "nvme", "nvme_path": "{swap}",}},
  }},
}}
"#
    );
    std::fs::write(d.join("commented.json"), commented).unwrap();
    std::fs::write(d.join("plain.json"), base(&d).to_string()).unwrap();
    let sha = |name: &str| {
        let (out, summary) = train_json(&d, name, &[]);
        assert_eq!(out.code, 0, "{name}: stderr: {}", out.stderr);
        let v: Value = summary.unwrap();
        v["weight_sha256"].as_str().unwrap().to_owned()
    };
    assert_eq!(sha("commented.json"), sha("plain.json"));
}

#[test]
fn batch_arithmetic_that_does_not_add_up_shows_all_three_numbers() {
    check(
        "batch",
        json!({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
               "gradient_accumulation_steps": 3}),
        &[
            "`train_batch_size` = 16",
            "`train_micro_batch_size_per_gpu` 2",
            "`gradient_accumulation_steps` 3",
            "= 6",
            "fix:",
        ],
    );
}

/// A config saved as UTF-16 (a Windows editor's "Unicode") is named as
/// such with the fix, by train and estimate alike (it read "stream did not
/// contain valid UTF-8").
#[test]
fn a_config_that_is_not_utf8_is_named() {
    let d = scratch("utf16");
    let text = base(&d).to_string();
    let mut bytes = vec![0xff, 0xfe];
    bytes.extend(text.encode_utf16().flat_map(u16::to_le_bytes));
    std::fs::write(d.join("bad.json"), bytes).unwrap();
    for args in [
        &["train", "--config", "bad.json", "--steps", "1"][..],
        &["estimate", "--params", "1B", "--config", "bad.json"],
    ] {
        let out = run_tierzero(Some(&d), args);
        assert_bad_input(
            &out,
            "utf16",
            &["--config bad.json", "not UTF-8", "save it as UTF-8"],
        );
    }
}

#[test]
fn nvme_offload_without_nvme_path() {
    check(
        "nopath",
        json!({"zero_optimization": {"offload_param": {"nvme_path": null}}}),
        &[
            "`zero_optimization.offload_param.nvme_path` is missing",
            "\"nvme\"",
            "fix: add \"nvme_path\"",
        ],
    );
}

#[test]
fn nvme_path_that_does_not_exist() {
    check(
        "missing",
        json!({"zero_optimization": {"offload_optimizer": {"nvme_path": "/no/such/tierzero-dir"}}}),
        &[
            "zero_optimization.offload_optimizer.nvme_path",
            "/no/such/tierzero-dir",
            "does not exist",
            "mkdir -p",
        ],
    );
}

#[test]
fn nvme_path_that_is_not_a_directory() {
    let d = scratch("notdir");
    let file = d.join("a-file");
    std::fs::write(&file, "x").unwrap();
    let mut cfg = base(&d);
    cfg["zero_optimization"]["offload_param"]["nvme_path"] = json!(file);
    check_text(
        "notdir",
        &d,
        &cfg.to_string(),
        &[
            "zero_optimization.offload_param.nvme_path",
            "a-file",
            "not a directory",
        ],
    );
}

/// The tests run as root here, and root writes through permission bits, so
/// a chmod'ed directory would be writable. `/proc` refuses new files even
/// to root: a directory that exists and cannot be written.
#[test]
fn nvme_path_that_is_not_writable() {
    if std::fs::File::create("/proc/.tierzero-test").is_ok() {
        let _ = std::fs::remove_file("/proc/.tierzero-test");
        panic!("/proc is writable here; this test needs an unwritable directory");
    }
    check(
        "readonly",
        json!({"zero_optimization": {"offload_param": {"nvme_path": "/proc"}}}),
        &[
            "zero_optimization.offload_param.nvme_path",
            "/proc",
            "not writable",
            "fix:",
        ],
    );
}

#[test]
fn offload_param_without_stage_3_is_ignored_and_said() {
    // DeepSpeed's stage 1 and 2 never read offload_param: a stage-3
    // config switched to stage 2 runs, with a note (it was refused).
    let d = scratch("stage2");
    let cfg = patched(
        base(&d),
        json!({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"},
               "offload_optimizer": {"device": "cpu"}}}),
    );
    std::fs::write(d.join("s2.json"), cfg.to_string()).unwrap();
    let out = run_tierzero(
        Some(&d),
        &[
            "train",
            "--config",
            "s2.json",
            "--steps",
            "1",
            "--seq-len",
            "16",
        ],
    );
    assert_eq!(out.code, 0, "stderr: {}", out.stderr);
    assert!(
        out.stderr.contains("zero_optimization.offload_param")
            && out.stderr.contains("ignored")
            && out.stderr.contains("the stage is 2"),
        "{}",
        out.stderr
    );
}

#[test]
fn pinned_budget_too_small_for_the_swap_buffers() {
    check(
        "budget",
        json!({"zero_optimization": {"offload_param": {"buffer_count": 4, "buffer_size": 1e6, "max_in_cpu": 0}},
               "tierzero": {"pinned_budget_bytes": 4096}}),
        &[
            "`tierzero.pinned_budget_bytes` = 4096 bytes",
            // The train CLI knows the model's largest param: the buffers'
            // least, as the arena cuts them.
            "at least buffer_count 4 slots of the largest param's shard",
            "buffer_size 1000000 elements",
            "raise `tierzero.pinned_budget_bytes` to at least",
        ],
    );
}

#[test]
fn wrong_type_names_the_key_and_the_value() {
    check(
        "type",
        json!({"zero_optimization": {"stage": "three"}}),
        &["`zero_optimization.stage`", "\"three\"", "fix:"],
    );
    check(
        "type2",
        json!({"gradient_accumulation_steps": "four"}),
        &["`gradient_accumulation_steps`", "\"four\"", "expected"],
    );
}

#[test]
fn invalid_json_has_line_and_column() {
    let d = scratch("json");
    check_text(
        "json",
        &d,
        "{\n  \"train_micro_batch_size_per_gpu\": 2,\n  \"fp16\": {\"enabled\" true}\n}\n",
        &["invalid JSON at line 3, column 22", "expected `:`", "fix:"],
    );
}

#[test]
fn duplicate_key_names_both_lines() {
    let d = scratch("dup");
    let mut text = serde_json::to_string_pretty(&base(&d)).unwrap();
    // A second `stage` right after the first, inside zero_optimization.
    let first = text.lines().position(|l| l.contains("\"stage\"")).unwrap() + 1;
    text = text.replacen("\"stage\": 3", "\"stage\": 3,\n      \"stage\": 2", 1);
    check_text(
        "dup",
        &d,
        &text,
        &[
            "`zero_optimization.stage` is given twice",
            &format!("at line {first} and at line {}", first + 1),
            "fix:",
        ],
    );
}

#[test]
fn unknown_optimizer_type() {
    check(
        "optimizer",
        json!({"optimizer": {"type": "Lamb"}}),
        &["`optimizer.type`", "Lamb", "AdamW"],
    );
}

#[test]
fn learning_rate_and_betas_out_of_range() {
    check(
        "lr-negative",
        json!({"optimizer": {"params": {"lr": -0.001}}}),
        &["`optimizer.params.lr`", "-0.001"],
    );
    check(
        "lr-zero",
        json!({"optimizer": {"params": {"lr": 0}}}),
        &["`optimizer.params.lr` = 0", "never change"],
    );
    check(
        "betas",
        json!({"optimizer": {"params": {"betas": [0.9, 1.5]}}}),
        &["`optimizer.params.betas[1]`", "1.5", "[0, 1)"],
    );
}

#[test]
fn fp16_and_bf16_both_enabled() {
    check(
        "precision",
        json!({"fp16": {"enabled": true}, "bf16": {"enabled": true}}),
        &[
            "`fp16.enabled`",
            "`bf16.enabled`",
            "set one of them to false",
        ],
    );
}

#[test]
fn unknown_scheduler_type() {
    check(
        "scheduler",
        json!({"scheduler": {"type": "OneCycle", "params": {}}}),
        &["`scheduler.type`", "OneCycle", "WarmupLR"],
    );
}

#[test]
fn unknown_offload_device_and_stage_out_of_range() {
    check(
        "device",
        json!({"zero_optimization": {"offload_param": {"device": "disk"}}}),
        &["zero_optimization.offload_param.device", "disk", "\"nvme\""],
    );
    check(
        "stage4",
        json!({"zero_optimization": {"stage": 4}}),
        &["`zero_optimization.stage` = 4", "0, 1, 2 and 3"],
    );
}

#[test]
fn deprecated_alias_given_with_its_replacement() {
    check(
        "alias",
        json!({"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": true,
               "stage3_gather_16bit_weights_on_model_save": true}}),
        &[
            "stage3_gather_fp16_weights_on_model_save",
            "stage3_gather_16bit_weights_on_model_save",
            "keep only",
        ],
    );
}

/// `tierzero train --config NAME --steps 1 --seq-len 16 --json FLAGS...` in
/// `d`: the exit status, and the summary when it succeeded.
fn train_json(d: &Path, name: &str, flags: &[&str]) -> (cli_support::Out, Option<Value>) {
    let mut args = vec![
        "train",
        "--config",
        name,
        "--steps",
        "1",
        "--seq-len",
        "16",
        "--json",
    ];
    args.extend_from_slice(flags);
    let out = run_tierzero(Some(d), &args);
    let summary = (out.code == 0).then(|| serde_json::from_str(&out.stdout).unwrap());
    (out, summary)
}

/// HF Trainer fills `"auto"` from its own arguments; `--micro-batch`,
/// `--grad-accum` and `--lr` do the same, so an "auto" config with the
/// flags trains exactly as the config that writes those numbers.
#[test]
fn flags_fill_auto_batch_sizes_and_lr() {
    let d = scratch("flags-auto");
    let auto = patched(
        base(&d),
        json!({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
               "optimizer": {"params": {"lr": "auto"}}}),
    );
    let written = patched(
        base(&d),
        json!({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
               "optimizer": {"params": {"lr": 5e-4}}}),
    );
    std::fs::write(d.join("auto.json"), auto.to_string()).unwrap();
    std::fs::write(d.join("written.json"), written.to_string()).unwrap();
    let flags = ["--micro-batch", "3", "--grad-accum", "2", "--lr", "5e-4"];
    let (out, a) = train_json(&d, "auto.json", &flags);
    let a = a.unwrap_or_else(|| panic!("auto.json: {}", out.stderr));
    // 3 samples × 2 micro-steps × 16 tokens (the "auto" default would be 8 × 1).
    assert_eq!(a["tokens_per_step"], 96, "{a}");
    let (out, b) = train_json(&d, "written.json", &[]);
    let b = b.unwrap_or_else(|| panic!("written.json: {}", out.stderr));
    assert_eq!(a["weight_sha256"], b["weight_sha256"]);
    // A flag equal to what the config writes is fine.
    let (out, c) = train_json(&d, "written.json", &flags);
    let c = c.unwrap_or_else(|| panic!("written.json with equal flags: {}", out.stderr));
    assert_eq!(c["weight_sha256"], b["weight_sha256"]);
}

/// A number in the config that a flag contradicts is an error naming the
/// key, the config's value, the flag and its value (exit 2).
#[test]
fn flags_that_contradict_the_config_name_both() {
    let d = scratch("flags-mismatch");
    // base: micro 2, accumulation 1, lr 1e-3.
    std::fs::write(d.join("bad.json"), base(&d).to_string()).unwrap();
    for (flags, words) in [
        (
            ["--micro-batch", "4"],
            [
                "`train_micro_batch_size_per_gpu` = 2 in the config",
                "but 4 was given",
                "(--micro-batch)",
            ],
        ),
        (
            ["--grad-accum", "3"],
            [
                "`gradient_accumulation_steps` = 1 in the config",
                "but 3 was given",
                "(--grad-accum)",
            ],
        ),
        (
            ["--lr", "3e-4"],
            [
                "`optimizer.params.lr` = 0.001 in the config",
                "but 0.0003 was given",
                "(--lr)",
            ],
        ),
    ] {
        let (out, _) = train_json(&d, "bad.json", &flags);
        let mut words = words.to_vec();
        words.push("fix:");
        assert_bad_input(&out, flags[0], &words);
    }
    for (flags, words) in [
        (["--lr", "banana"], ["--lr banana", "positive number"]),
        (["--lr", "-0.001"], ["--lr -0.001", "positive number"]),
        (["--micro-batch", "0"], ["--micro-batch", "out of range"]),
        (["--grad-accum", "x"], ["--grad-accum", "whole number"]),
    ] {
        let (out, _) = train_json(&d, "bad.json", &flags);
        assert_bad_input(&out, flags[0], &words);
    }
}

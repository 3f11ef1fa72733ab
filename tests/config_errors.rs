//! Bad configs: each gives the expected `ConfigError` variant and a
//! one-line message that names the key (and the value where there is one).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: a failed unwrap is a failed test"
)]

use serde_json::json;
use tierzero::config::{
    load_file, load_str, ConfigError, ConfigWarning, OffloadDevice, PathChecks, RunContext,
};

fn skip_fs() -> RunContext {
    RunContext {
        path_checks: PathChecks::Skip,
        ..RunContext::default()
    }
}

fn err_with(text: &str, run: &RunContext) -> ConfigError {
    match load_str(text, run) {
        Ok(l) => panic!("expected an error, got {:?}", l.config),
        Err(e) => e,
    }
}

fn err(v: serde_json::Value) -> ConfigError {
    err_with(&v.to_string(), &skip_fs())
}

/// The message is one line and mentions every fragment.
fn assert_msg(e: &ConfigError, fragments: &[&str]) {
    let msg = e.to_string();
    assert!(!msg.contains('\n'), "multi-line message: {msg}");
    assert!(msg.contains("fix:"), "no fix in: {msg}");
    for f in fragments {
        assert!(msg.contains(f), "`{f}` missing from: {msg}");
    }
}

/// A minimal valid base to break one thing at a time.
fn base() -> serde_json::Value {
    json!({"train_micro_batch_size_per_gpu": 4})
}

fn with(mut v: serde_json::Value, patch: serde_json::Value) -> serde_json::Value {
    merge(&mut v, patch);
    v
}

fn merge(a: &mut serde_json::Value, b: serde_json::Value) {
    match (a, b) {
        (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
            for (k, v) in b {
                merge(a.entry(k).or_insert(serde_json::Value::Null), v);
            }
        }
        (a, b) => *a = b,
    }
}

fn nvme_stage3(dir: &str) -> serde_json::Value {
    with(
        base(),
        json!({"zero_optimization": {"stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": dir},
            "offload_optimizer": {"device": "nvme", "nvme_path": dir}}}),
    )
}

#[test]
fn base_is_valid() {
    load_str(&base().to_string(), &skip_fs()).unwrap();
}

#[test]
fn batch_arithmetic_that_does_not_add_up_shows_all_numbers() {
    let run = RunContext {
        ranks: 2,
        ..skip_fs()
    };
    let e = err_with(
        &json!({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})
            .to_string(),
        &run,
    );
    assert!(matches!(
        e,
        ConfigError::BatchMismatch {
            train_batch_size: 32,
            micro_batch_size: 4,
            gradient_accumulation_steps: 2,
            ranks: 2,
            product: 16,
            ..
        }
    ));
    assert_msg(
        &e,
        &[
            "train_batch_size` = 32",
            "train_micro_batch_size_per_gpu` 4",
            "gradient_accumulation_steps` 2",
            "ranks 2",
            "= 16",
        ],
    );
    // The fix offers the accumulation that would make it add up.
    assert_msg(&e, &["`gradient_accumulation_steps` to 4"]);
    // Sizes that are "auto" with no run value took HF's defaults (micro
    // 8, accumulation 1): the fix is the run's values, not "auto" again.
    let e = err(
        json!({"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto",
                       "gradient_accumulation_steps": "auto"}),
    );
    assert_msg(
        &e,
        &[
            "`train_micro_batch_size_per_gpu` and `gradient_accumulation_steps` are \"auto\"",
            "--micro-batch / --grad-accum",
            "e.g. --grad-accum 2",
        ],
    );
}

#[test]
fn batch_inference_that_is_not_whole() {
    let e = err(json!({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}));
    assert!(matches!(
        e,
        ConfigError::BatchIndivisible {
            missing: "gradient_accumulation_steps",
            divisor: 4,
            suggestion: 32,
            ..
        }
    ));
    assert_msg(
        &e,
        &[
            "gradient_accumulation_steps",
            "train_batch_size` = 30",
            "32",
            // Setting the missing one with 30 kept cannot help: 30 is no
            // multiple of 4 whatever it is.
            "or remove it and set `gradient_accumulation_steps`",
        ],
    );
}

#[test]
fn no_batch_size_at_all() {
    let e = err(json!({"gradient_accumulation_steps": 4}));
    assert!(matches!(e, ConfigError::BatchMissing));
    assert_msg(&e, &["train_batch_size", "train_micro_batch_size_per_gpu"]);
}

#[test]
fn zero_batch_size() {
    let e = err(json!({"train_micro_batch_size_per_gpu": 0}));
    assert!(
        matches!(&e, ConfigError::OutOfRange { key, .. } if key == "train_micro_batch_size_per_gpu")
    );
    assert_msg(&e, &["train_micro_batch_size_per_gpu", "at least 1"]);
}

#[test]
fn nvme_offload_without_nvme_path() {
    let e = err(with(
        base(),
        json!({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}),
    ));
    assert!(
        matches!(&e, ConfigError::NvmePathMissing { key, .. } if key == "zero_optimization.offload_param.nvme_path")
    );
    assert_msg(
        &e,
        &[
            "zero_optimization.offload_param.nvme_path",
            "zero_optimization.offload_param.device",
            "\"nvme_path\"",
        ],
    );

    let e = err(with(
        base(),
        json!({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}),
    ));
    assert!(
        matches!(&e, ConfigError::NvmePathMissing { key, .. } if key == "zero_optimization.offload_optimizer.nvme_path")
    );
}

#[test]
fn nvme_path_that_does_not_exist() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-such-dir");
    let text = nvme_stage3(missing.to_str().unwrap()).to_string();
    let e = err_with(&text, &RunContext::default());
    assert!(
        matches!(&e, ConfigError::NvmePathNotFound { key, .. } if key == "zero_optimization.offload_param.nvme_path")
    );
    assert_msg(
        &e,
        &[
            "zero_optimization.offload_param.nvme_path",
            missing.to_str().unwrap(),
            "mkdir -p",
        ],
    );
    // A path a shell would split is quoted in the command; one with a
    // line break is shown escaped, on one line, with no command to paste.
    let spaced = tmp.path().join("two words");
    let e = err_with(
        &nvme_stage3(spaced.to_str().unwrap()).to_string(),
        &RunContext::default(),
    );
    assert_msg(&e, &[&format!("mkdir -p '{}'", spaced.display())]);
    let broken = tmp.path().join("swap\nrm -rf x");
    let e = err_with(
        &nvme_stage3(broken.to_str().unwrap()).to_string(),
        &RunContext::default(),
    );
    assert_msg(&e, &["swap\\nrm -rf x", "create it or point"]);
    assert!(!e.to_string().contains("mkdir"), "{e}");
    // CreateMissing creates it instead.
    let run = RunContext {
        path_checks: PathChecks::CreateMissing,
        ..RunContext::default()
    };
    load_str(&text, &run).unwrap();
    assert!(missing.is_dir());
    // And the probe file was removed.
    assert_eq!(std::fs::read_dir(&missing).unwrap().count(), 0);
}

#[test]
fn nvme_path_that_is_a_file() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("swap.bin");
    std::fs::write(&file, b"x").unwrap();
    let e = err_with(
        &nvme_stage3(file.to_str().unwrap()).to_string(),
        &RunContext::default(),
    );
    assert!(matches!(e, ConfigError::NvmePathNotDir { .. }));
    assert_msg(
        &e,
        &[
            "zero_optimization.offload_param.nvme_path",
            file.to_str().unwrap(),
            "not a directory",
        ],
    );
}

#[test]
fn nvme_path_that_is_not_writable() {
    // /proc refuses new files even for root, unlike a chmod'ed directory.
    let dir = "/proc";
    if std::fs::File::create("/proc/.tierzero-test").is_ok() {
        let _ = std::fs::remove_file("/proc/.tierzero-test");
        panic!("/proc is writable here; this test needs an unwritable directory");
    }
    let e = err_with(&nvme_stage3(dir).to_string(), &RunContext::default());
    assert!(
        matches!(&e, ConfigError::NvmePathNotWritable { key, .. } if key == "zero_optimization.offload_param.nvme_path")
    );
    assert_msg(
        &e,
        &[
            "zero_optimization.offload_param.nvme_path",
            "/proc",
            "not writable",
        ],
    );
}

#[test]
fn nvme_path_ok_when_writable() {
    let tmp = tempfile::tempdir().unwrap();
    load_str(
        &nvme_stage3(tmp.path().to_str().unwrap()).to_string(),
        &RunContext::default(),
    )
    .unwrap();
    assert_eq!(
        std::fs::read_dir(tmp.path()).unwrap().count(),
        0,
        "probe file left behind"
    );
}

/// `offload_param` below stage 3 is ignored with a note, as DeepSpeed's
/// stage 1 and 2 ignore it (it was refused: a stage-3 config switched to
/// stage 2 ran there and not here); its path is not even checked.
#[test]
fn offload_param_without_stage_3_is_ignored_and_said() {
    let l = load_str(
        &with(
            base(),
            json!({"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme",
                "nvme_path": "/no/such/dir"}}}),
        )
        .to_string(),
        &RunContext::default(),
    )
    .unwrap();
    assert_eq!(l.config.zero.offload_param.device, OffloadDevice::None);
    assert!(l.warnings.iter().any(|w| matches!(w,
        ConfigWarning::Note { key, message }
            if key == "zero_optimization.offload_param" && message.contains("ignored")
                && message.contains("stage is 2"))));
}

#[test]
fn nvme_optimizer_offload_without_stage_3() {
    let e = err(with(
        base(),
        json!({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}}),
    ));
    assert!(matches!(
        e,
        ConfigError::NvmeOptimizerNeedsStage3 { stage: 2 }
    ));
    assert_msg(
        &e,
        &["zero_optimization.offload_optimizer.device", "stage` = 2"],
    );
}

#[test]
fn pinned_budget_too_small_for_param_buffers() {
    let v = with(
        nvme_stage3("/x"),
        json!({"zero_optimization": {"offload_param": {"buffer_count": 5, "buffer_size": 1e8}},
               "bf16": {"enabled": true},
               "tierzero": {"pinned_budget_bytes": "256MiB"}}),
    );
    let e = err(v);
    match &e {
        ConfigError::PinnedBudgetTooSmall {
            budget_bytes,
            required_bytes,
            ..
        } => {
            assert_eq!(*budget_bytes, 256 << 20);
            // Five buffers of 2e8 bytes, each rounded up to 4 KiB as the
            // engine maps them (the sizing policy's rule).
            assert_eq!(*required_bytes, 5 * 200_003_584);
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_msg(
        &e,
        &[
            "tierzero.pinned_budget_bytes",
            "268435456",
            "buffer_count 5",
            "buffer_size 100000000 elements",
            "2 bytes",
            "1000017920",
        ],
    );
}

/// With the model's largest param known, the check counts the param
/// swap-in buffers as the engine's arena takes them at the least: cut into
/// `buffer_count` slots of the largest shard (`sizing::param_slots`), not
/// whole `buffer_size` buffers. The embedded GPT-2's 147456-element
/// tensors in fp32 under buffers of 1e8 elements took 5 × 400 MB; it
/// trains in 58.5 MiB of slots (the build's exact check decides).
#[test]
fn pinned_budget_counts_param_buffers_as_slots_of_the_largest_param() {
    let v = with(
        nvme_stage3("/x"),
        json!({"zero_optimization": {"offload_param": {"buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 0},
                                     "offload_optimizer": {"device": "cpu"}},
               "tierzero": {"pinned_budget_bytes": "64MiB"}}),
    );
    let run = RunContext {
        model_numel: Some(1_878_144),
        largest_param_numel: Some(147_456),
        ..skip_fs()
    };
    load_str(&v.to_string(), &run).unwrap();
    // Below 5 slots of 576 KiB: refused, with that least.
    let mut small = v.clone();
    small["tierzero"]["pinned_budget_bytes"] = json!("2MiB");
    let e = err_with(&small.to_string(), &run);
    assert!(
        matches!(
            e,
            ConfigError::PinnedBudgetTooSmall {
                required_bytes: 2_949_120,
                ..
            }
        ),
        "{e:?}"
    );
    assert_msg(
        &e,
        &[
            "at least buffer_count 5 slots",
            "589824 bytes each",
            "buffer_size 100000000 elements",
        ],
    );
}

#[test]
fn pinned_budget_includes_optimizer_buffers_when_model_size_is_known() {
    let v = with(
        nvme_stage3("/x"),
        json!({"zero_optimization": {"offload_param": {"buffer_count": 2, "buffer_size": 1e6, "max_in_cpu": 0}, "sub_group_size": 1e7},
               "tierzero": {"pinned_budget_bytes": 20_000_000}}),
    );
    let text = v.to_string();
    // Params alone: 2 × 1e6 × 4 = 8 MB, fits.
    load_str(&text, &skip_fs()).unwrap();
    // A 100M-param model on 2 ranks: the pipeline needs 4 optimizer buffers
    // (3 states and the spilled gradient: DeepSpeed's default clips at
    // 1.0) of min(1e7, 5e7) × 4 = 40 MB (4 KiB-aligned: 40_001_536),
    // beside the params' 2 × 4_001_792.
    let run = RunContext {
        ranks: 2,
        model_numel: Some(100_000_000),
        ..skip_fs()
    };
    let e = err_with(&text, &run);
    assert!(
        matches!(
            e,
            ConfigError::PinnedBudgetTooSmall {
                required_bytes: 168_009_728,
                ..
            }
        ),
        "{e:?}"
    );
    assert_msg(
        &e,
        &[
            "offload_param + offload_optimizer",
            "sub_group_size 10000000",
        ],
    );
    // Without clipping, the 3 states' buffers: 3 × 40_001_536 + 2 × 4_001_792.
    let mut v = v;
    v["gradient_clipping"] = json!(0);
    let e = err_with(&v.to_string(), &run);
    assert!(
        matches!(
            e,
            ConfigError::PinnedBudgetTooSmall {
                required_bytes: 128_008_192,
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn wrong_types_name_the_key_path_and_expected_type() {
    let cases = [
        (
            json!({"train_micro_batch_size_per_gpu": "8"}),
            "train_micro_batch_size_per_gpu",
            "an integer or \"auto\"",
        ),
        (
            with(
                base(),
                json!({"zero_optimization": {"offload_param": {"buffer_count": true}}}),
            ),
            "zero_optimization.offload_param.buffer_count",
            "an integer",
        ),
        (
            with(
                base(),
                json!({"zero_optimization": {"stage": 3, "offload_param": {"buffer_size": 2.5}}}),
            ),
            "zero_optimization.offload_param.buffer_size",
            "an integer",
        ),
        (
            with(
                base(),
                json!({"zero_optimization": {"contiguous_gradients": "yes"}}),
            ),
            "zero_optimization.contiguous_gradients",
            "true or false",
        ),
        (
            with(
                base(),
                json!({"zero_optimization": {"sub_group_size": "auto"}}),
            ),
            "zero_optimization.sub_group_size",
            "not accepted for this key",
        ),
        (
            with(
                base(),
                json!({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}}),
            ),
            "optimizer.params.betas",
            "an array of two numbers",
        ),
        (
            with(base(), json!({"zero_optimization": []})),
            "zero_optimization",
            "a JSON object",
        ),
        (
            with(base(), json!({"tierzero": {"pinned_budget_bytes": "lots"}})),
            "tierzero.pinned_budget_bytes",
            "\"1GiB\"",
        ),
    ];
    for (v, key, expected) in cases {
        let e = err(v);
        assert!(
            matches!(&e, ConfigError::WrongType { key: k, .. } if k == key),
            "{key}: {e:?}"
        );
        assert_eq!(e.key(), Some(key));
        assert_msg(&e, &[&format!("`{key}`"), expected]);
    }
    // The top level itself.
    let e = err_with("[1, 2]", &skip_fs());
    assert!(matches!(e, ConfigError::WrongType { .. }));
    assert_msg(&e, &["<top level>", "a JSON object"]);
}

#[test]
fn invalid_json_has_line_and_column() {
    // A key without its colon is wrong in hjson too.
    let text = "{\n  \"train_batch_size\": 8,\n  \"fp16\": {\"enabled\" true}\n}\n";
    let e = err_with(text, &skip_fs());
    assert!(
        matches!(
            e,
            ConfigError::Json {
                line: 3,
                column: 22,
                ..
            }
        ),
        "{e:?}"
    );
    assert_msg(&e, &["line 3, column 22", "expected `:`"]);
    // An unclosed object: the end of the text.
    let e = err_with("{\n  \"fp16\": {\"enabled\": true}\n", &skip_fs());
    assert!(matches!(e, ConfigError::Json { line: 3, .. }), "{e:?}");
    assert_msg(&e, &["end of the text"]);
    let e = err_with("", &skip_fs());
    assert!(matches!(e, ConfigError::Json { .. }));
    // The message no longer claims DeepSpeed forbids comments.
    assert!(!e.to_string().contains("no comments"), "{e}");
}

/// DeepSpeed's loader raises on a key given twice in one object; a JSON
/// reader keeps the last one and the batch size changes without a word.
#[test]
fn duplicate_keys_name_the_path_and_both_lines() {
    let text = "{\n  \"train_micro_batch_size_per_gpu\": 4,\n  \"gradient_accumulation_steps\": 1,\n  \"train_micro_batch_size_per_gpu\": 8\n}\n";
    let e = err_with(text, &skip_fs());
    match &e {
        ConfigError::DuplicateKey {
            key,
            first_line,
            second_line,
            ..
        } => {
            assert_eq!(key, "train_micro_batch_size_per_gpu");
            assert_eq!((*first_line, *second_line), (2, 4));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(e.key(), Some("train_micro_batch_size_per_gpu"));
    assert_msg(
        &e,
        &[
            "`train_micro_batch_size_per_gpu`",
            "line 2",
            "line 4",
            "delete one",
        ],
    );

    // Nested, with comments and blank lines between the two.
    let text = "{\n  \"train_micro_batch_size_per_gpu\": 4,\n  \"zero_optimization\": {\n    \"stage\": 3, // partition everything\n    /* offload\n       later */\n\n    \"stage\": 2\n  }\n}\n";
    let e = err_with(text, &skip_fs());
    assert!(
        matches!(&e, ConfigError::DuplicateKey { key, first_line: 4, second_line: 8, .. }
            if key == "zero_optimization.stage"),
        "{e:?}"
    );
    assert_msg(&e, &["`zero_optimization.stage`", "line 4", "line 8"]);

    // On one line: the columns of the two values tell them apart.
    let text = r#"{"train_micro_batch_size_per_gpu": 2, "train_micro_batch_size_per_gpu": 4}"#;
    let e = err_with(text, &skip_fs());
    assert_msg(
        &e,
        &["`train_micro_batch_size_per_gpu` is given twice, on line 1, its values near columns 36 and 73"],
    );

    // The same key in two objects is not a duplicate.
    load_str(
        r#"{"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": false}, "bf16": {"enabled": false}}"#,
        &skip_fs(),
    )
    .unwrap();
}

#[test]
fn negative_learning_rate() {
    let e = err(with(
        base(),
        json!({"optimizer": {"type": "AdamW", "params": {"lr": -1e-4}}}),
    ));
    assert!(matches!(&e, ConfigError::OutOfRange { key, .. } if key == "optimizer.params.lr"));
    assert_msg(&e, &["optimizer.params.lr", "-0.0001"]);
}

#[test]
fn learning_rate_zero_at_every_step() {
    let e = err(with(
        base(),
        json!({"optimizer": {"type": "AdamW", "params": {"lr": 0}}}),
    ));
    assert!(matches!(&e, ConfigError::OutOfRange { key, .. } if key == "optimizer.params.lr"));
    assert_msg(&e, &["optimizer.params.lr", "= 0", "never change", "1e-4"]);
    // WarmupLR whose max follows the optimizer's lr ("auto") is 0 too.
    let e = err(with(
        base(),
        json!({"optimizer": {"type": "AdamW", "params": {"lr": 0}},
               "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}}),
    ));
    assert_msg(&e, &["scheduler.params.warmup_max_lr", "= 0"]);
    // A scheduler with its own positive peak makes an optimizer lr of 0 fine.
    load_str(
        &with(
            base(),
            json!({"optimizer": {"type": "AdamW", "params": {"lr": 0}},
                   "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3}}}),
        )
        .to_string(),
        &skip_fs(),
    )
    .unwrap();
}

#[test]
fn betas_outside_unit_interval() {
    let e = err(with(
        base(),
        json!({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.0]}}}),
    ));
    assert!(
        matches!(&e, ConfigError::OutOfRange { key, .. } if key == "optimizer.params.betas[1]")
    );
    assert_msg(&e, &["optimizer.params.betas[1]", "[0, 1)"]);
}

#[test]
fn unsupported_optimizer_type() {
    let e = err(with(
        base(),
        json!({"optimizer": {"type": "OneBitLamb", "params": {"lr": 1e-3}}}),
    ));
    assert!(matches!(e, ConfigError::UnsupportedOptimizer { .. }));
    assert_msg(&e, &["optimizer.type", "OneBitLamb", "AdamW"]);
    // DeepSpeed lower-cases optimizer names, so these are fine.
    for t in ["adamw", "ADAM"] {
        load_str(
            &with(base(), json!({"optimizer": {"type": t}})).to_string(),
            &skip_fs(),
        )
        .unwrap();
    }
}

#[test]
fn unsupported_scheduler_type() {
    let e = err(with(
        base(),
        json!({"scheduler": {"type": "OneCycle", "params": {}}}),
    ));
    assert!(matches!(e, ConfigError::UnsupportedScheduler { .. }));
    assert_msg(&e, &["scheduler.type", "OneCycle", "WarmupLR"]);
    let e = err(with(base(), json!({"scheduler": {"type": "warmuplr"}})));
    assert_msg(&e, &["scheduler.type", "write \"WarmupLR\""]);
}

#[test]
fn fp16_and_bf16_both_enabled() {
    let e = err(with(
        base(),
        json!({"fp16": {"enabled": true}, "bf16": {"enabled": true}}),
    ));
    assert!(matches!(e, ConfigError::PrecisionConflict));
    assert_msg(&e, &["fp16.enabled", "bf16.enabled"]);
}

#[test]
fn stage_out_of_range() {
    for bad in [json!(4), json!("three"), json!(-1), json!(2.5)] {
        let e = err(with(
            base(),
            json!({"zero_optimization": {"stage": bad.clone()}}),
        ));
        assert!(
            matches!(e, ConfigError::InvalidStage { .. }),
            "{bad}: {e:?}"
        );
        assert_msg(&e, &["zero_optimization.stage", &bad.to_string()]);
    }
}

#[test]
fn deprecated_alias_given_with_its_replacement() {
    let e = err(with(
        base(),
        json!({"aio": {"thread_count": 2, "intra_op_parallelism": 4}}),
    ));
    assert!(
        matches!(&e, ConfigError::ConflictingAlias { old, new } if old == "aio.thread_count" && new == "aio.intra_op_parallelism")
    );
    assert_msg(&e, &["aio.thread_count", "aio.intra_op_parallelism"]);
    // Either value of the flag, as DeepSpeed refuses both (a `false` beside
    // an NVMe block was advised to write `"device": "none"`).
    for (flag, block) in [(true, "cpu"), (false, "nvme")] {
        let e = err(with(
            base(),
            json!({"zero_optimization": {"stage": 3, "cpu_offload": flag,
                   "offload_optimizer": {"device": block, "nvme_path": "/tmp"}}}),
        ));
        assert!(matches!(e, ConfigError::ConflictingAlias { .. }), "{e}");
        assert_msg(
            &e,
            &[
                "zero_optimization.cpu_offload",
                "zero_optimization.offload_optimizer",
            ],
        );
    }
}

#[test]
fn auto_total_steps_without_a_step_count() {
    let v = with(
        base(),
        json!({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "warmup_num_steps": 10}}}),
    );
    let e = err(v.clone());
    assert!(
        matches!(&e, ConfigError::AutoUnresolved { key, .. } if key == "scheduler.params.total_num_steps")
    );
    assert_msg(&e, &["scheduler.params.total_num_steps", "--steps"]);
    // Missing entirely is reported on the same key.
    let e = err(with(
        base(),
        json!({"scheduler": {"type": "WarmupDecayLR"}}),
    ));
    assert!(
        matches!(&e, ConfigError::MissingKey { key, .. } if key == "scheduler.params.total_num_steps")
    );
    assert_msg(&e, &["scheduler.params.total_num_steps", "WarmupDecayLR"]);
    let run = RunContext {
        total_steps: Some(100),
        ..skip_fs()
    };
    load_str(&v.to_string(), &run).unwrap();
}

#[test]
fn config_value_contradicting_the_run() {
    let run = RunContext {
        micro_batch_size: Some(8),
        ..skip_fs()
    };
    let e = err_with(&base().to_string(), &run);
    assert!(
        matches!(&e, ConfigError::RunMismatch { key, .. } if key == "train_micro_batch_size_per_gpu")
    );
    assert_msg(
        &e,
        &[
            "train_micro_batch_size_per_gpu",
            "= 4",
            "8",
            "micro_batch_size",
            "\"auto\"",
        ],
    );
}

#[test]
fn unknown_offload_device() {
    let e = err(with(
        base(),
        json!({"zero_optimization": {"stage": 3, "offload_param": {"device": "disk"}}}),
    ));
    assert!(
        matches!(&e, ConfigError::UnknownOffloadDevice { key, .. } if key == "zero_optimization.offload_param.device")
    );
    assert_msg(
        &e,
        &[
            "zero_optimization.offload_param.device",
            "\"disk\"",
            "\"nvme\"",
        ],
    );
}

#[test]
fn aio_block_size_not_sector_aligned() {
    let e = err(with(base(), json!({"aio": {"block_size": 1000}})));
    assert!(matches!(&e, ConfigError::OutOfRange { key, .. } if key == "aio.block_size"));
    assert_msg(&e, &["aio.block_size", "1000", "512"]);
}

#[test]
fn nvme_optimizer_buffer_count_too_small() {
    let e = err(with(
        nvme_stage3("/x"),
        json!({"zero_optimization": {"offload_optimizer": {"buffer_count": 2}}}),
    ));
    assert!(
        matches!(&e, ConfigError::OutOfRange { key, .. } if key == "zero_optimization.offload_optimizer.buffer_count")
    );
    assert_msg(
        &e,
        &[
            "zero_optimization.offload_optimizer.buffer_count",
            "at least 4",
        ],
    );
}

#[test]
fn bad_tierzero_enum_value() {
    let e = err(with(base(), json!({"tierzero": {"io_backend": "libaio"}})));
    assert!(matches!(&e, ConfigError::OutOfRange { key, .. } if key == "tierzero.io_backend"));
    assert_msg(&e, &["tierzero.io_backend", "\"libaio\"", "\"uring\""]);
}

#[test]
fn missing_config_file() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("ds_config.json");
    let e = load_file(&path, &skip_fs()).unwrap_err();
    assert!(matches!(e, ConfigError::Read { .. }));
    assert_msg(&e, &["ds_config.json", "--config"]);
}

#[test]
fn long_values_are_truncated_to_one_short_line() {
    let long = "x".repeat(500);
    let e = err(with(base(), json!({"steps_per_print": long})));
    let msg = e.to_string();
    assert!(msg.len() < 300, "{msg}");
    assert!(msg.contains('…'));
}

#[test]
fn optimizer_or_scheduler_without_type() {
    let e = err(with(base(), json!({"optimizer": {"params": {"lr": 1e-3}}})));
    assert!(matches!(&e, ConfigError::MissingKey { key, .. } if key == "optimizer.type"));
    assert_msg(&e, &["optimizer.type", "AdamW"]);
    let e = err(with(base(), json!({"scheduler": {"params": {}}})));
    assert!(matches!(&e, ConfigError::MissingKey { key, .. } if key == "scheduler.type"));
}

/// A parameter larger than `sub_group_size` (an LLM's embedding) is an
/// optimizer sub-group of its own: with the largest parameter known, the
/// budget check sizes the optimizer buffers for it, as the engine's
/// layout will, instead of passing a config the build then refuses.
#[test]
fn pinned_budget_is_not_inflated_by_a_parameter_larger_than_a_sub_group() {
    let v = with(
        nvme_stage3("/x"),
        json!({"zero_optimization": {"offload_param": {"buffer_count": 2, "buffer_size": 1e6, "max_in_cpu": 0},
                                     "sub_group_size": 1e6},
               "tierzero": {"pinned_budget_bytes": 30_000_000}}),
    );
    let text = v.to_string();
    let run = |largest: Option<u64>| RunContext {
        model_numel: Some(100_000_000),
        largest_param_numel: largest,
        ..skip_fs()
    };
    // Sub-groups of 1e6: 3 buffers of 4 MB beside 8 MB of params, fits.
    load_str(&text, &run(None)).unwrap();
    // Sub-groups of 2e6 (3 x 8 MB + 8 MB of params) do not fit 30 MB.
    let big = text.replace(
        "\"sub_group_size\":1000000.0",
        "\"sub_group_size\":2000000.0",
    );
    assert_ne!(big, text, "{text}");
    let e = err_with(&big, &run(None));
    assert!(
        matches!(e, ConfigError::PinnedBudgetTooSmall { .. }),
        "{e:?}"
    );
}

/// `offload_optimizer.ratio` (DeepSpeed's Twin-Flow share of the
/// sub-groups on the CPU, at stage 3 with device "cpu"): 1.0, the
/// default, is what tierzero does and says nothing; a smaller share is a
/// note that all of the state is stepped on the CPU here, or that it has
/// no effect (not "ignored": the key is read); below stage 3, or outside
/// 0..=1, it is an error with the fix.
#[test]
fn offload_optimizer_ratio_is_read_as_deepspeed_reads_it() {
    let cpu = |ratio: serde_json::Value| {
        with(
            base(),
            json!({"zero_optimization": {"stage": 3,
                "offload_optimizer": {"device": "cpu", "ratio": ratio}}}),
        )
    };
    let warnings = |v: serde_json::Value| {
        load_str(&v.to_string(), &skip_fs())
            .unwrap()
            .warnings
            .iter()
            .map(ToString::to_string)
            .filter(|w| w.contains("ratio"))
            .collect::<Vec<_>>()
    };
    assert!(warnings(cpu(json!(1.0))).is_empty());
    let w = warnings(cpu(json!(0.3)));
    assert_eq!(w.len(), 1, "{w:?}");
    // DeepSpeed steps the first int((1 - ratio) x n) sub-groups on the GPU.
    for f in [
        "offload_optimizer.ratio",
        "0.3 asks",
        "the first 0.70 of the optimizer's sub-groups on the GPU and the rest on the CPU",
        "Twin-Flow",
        "all of them on the CPU",
    ] {
        assert!(w[0].contains(f), "`{f}` missing from: {}", w[0]);
    }
    let nvme = with(
        base(),
        json!({"zero_optimization": {"stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "ratio": 0.5}}}),
    );
    let w = warnings(nvme);
    assert!(
        w.len() == 1
            && w[0].contains("0.50 of the optimizer's sub-groups on the GPU")
            && w[0].contains("from NVMe"),
        "{w:?}"
    );
    // Below stage 3 DeepSpeed asserts ("Partial offloading only supported
    // for ZeRO Stage 3"), whatever the device.
    for dev in [
        json!({"device": "cpu", "ratio": 0.3}),
        json!({"ratio": 0.3}),
    ] {
        let stage2 = with(
            base(),
            json!({"zero_optimization": {"stage": 2, "offload_optimizer": dev}}),
        );
        assert_msg(
            &err(stage2),
            &["offload_optimizer.ratio", "below stage 3", "stage 3"],
        );
    }
    let none = with(
        base(),
        json!({"zero_optimization": {"stage": 3, "offload_optimizer": {"ratio": 0.5}}}),
    );
    let w = warnings(none);
    assert!(w.len() == 1 && w[0].contains("no effect"), "{w:?}");
    for bad in [json!(1.5), json!(-0.1)] {
        assert_msg(&err(cpu(bad)), &["offload_optimizer.ratio", "0 to 1"]);
    }
    assert_msg(&err(cpu(json!("half"))), &["offload_optimizer.ratio"]);
}

/// `fp16.min_loss_scale` is the dynamic scaler's: with a static scale
/// DeepSpeed does not check it, nor do we; with the dynamic one it must
/// be positive.
#[test]
fn min_loss_scale_is_checked_only_for_the_dynamic_scaler() {
    let fp16 = |loss_scale: f64| {
        json!({"train_batch_size": 8,
               "fp16": {"enabled": true, "loss_scale": loss_scale, "min_loss_scale": 0}})
        .to_string()
    };
    load_str(&fp16(128.0), &skip_fs()).unwrap();
    let e = err_with(&fp16(0.0), &skip_fs());
    assert_msg(&e, &["fp16.min_loss_scale", "positive"]);
}

/// A static `fp16.loss_scale` outside f32's normal range is refused: the
/// gradients are scaled by it and by its reciprocal in f32 (2e-39 failed
/// the first step with an internal error, 1e39 skipped every step).
#[test]
fn a_static_loss_scale_beyond_f32_is_refused() {
    let fp16 = |loss_scale: f64| {
        with(
            base(),
            json!({"fp16": {"enabled": true, "loss_scale": loss_scale}}),
        )
    };
    for bad in [
        2e-39,
        1e-300,
        1e39,
        1e300,
        1.7014118346046923e38 * 1.0000001,
    ] {
        assert_msg(&err(fp16(bad)), &["fp16.loss_scale", "2^-126 to 2^127"]);
    }
    for good in [1.1754944e-38, 0.5, 1024.0, 1.7014118346046923e38] {
        load_str(&fp16(good).to_string(), &skip_fs()).unwrap();
    }
}

/// `fp16.hysteresis` 0 is refused: DeepSpeed's scaler lowers the scale
/// when its count reaches 1 and from 0 only counts down, so every step
/// after the first overflow would be skipped (it was read as 1).
#[test]
fn hysteresis_zero_is_refused_with_the_fix() {
    let fp16 = |h: u64| with(base(), json!({"fp16": {"enabled": true, "hysteresis": h}}));
    assert_msg(&err(fp16(0)), &["fp16.hysteresis", "at least 1", "use 2"]);
    load_str(&fp16(1).to_string(), &skip_fs()).unwrap();
}

/// `fp16.min_loss_scale` is an integer in DeepSpeed (pydantic refuses a
/// fraction, whatever the scaler); a whole float is one.
#[test]
fn min_loss_scale_is_a_whole_number() {
    let fp16 = |min: serde_json::Value| {
        with(
            base(),
            json!({"fp16": {"enabled": true, "min_loss_scale": min}}),
        )
    };
    assert_msg(
        &err(fp16(json!(0.25))),
        &["fp16.min_loss_scale", "0.25", "whole number"],
    );
    load_str(&fp16(json!(2.0)).to_string(), &skip_fs()).unwrap();
    load_str(&fp16(json!(2)).to_string(), &skip_fs()).unwrap();
}

/// Optimizer keys DeepSpeed reads that change the math are read, not
/// warned about as unused: `torch_adam` builds torch's AdamW, whose
/// weight decay default is 0.01 (torch's Adam's 0); `amsgrad`, which
/// tierzero does not compute, is refused with the fix.
#[test]
fn optimizer_keys_that_change_the_math_are_read() {
    let opt = |kind: &str, params: serde_json::Value| {
        with(
            base(),
            json!({"optimizer": {"type": kind, "params": params}}),
        )
    };
    let loaded = |v: serde_json::Value| load_str(&v.to_string(), &skip_fs()).unwrap();
    let wd = |v: serde_json::Value| loaded(v).config.optimizer.weight_decay;
    assert_eq!(wd(opt("AdamW", json!({"lr": 1e-4}))), 0.0);
    assert_eq!(
        wd(opt("AdamW", json!({"lr": 1e-4, "torch_adam": true}))),
        0.01
    );
    assert_eq!(
        wd(opt("Adam", json!({"lr": 1e-4, "torch_adam": true}))),
        0.01
    );
    assert_eq!(
        wd(opt(
            "Adam",
            json!({"lr": 1e-4, "torch_adam": true, "adam_w_mode": false})
        )),
        0.0
    );
    assert_eq!(
        wd(opt(
            "AdamW",
            json!({"lr": 1e-4, "torch_adam": true, "weight_decay": 0.1})
        )),
        0.1
    );
    let silent = loaded(opt(
        "AdamW",
        json!({"lr": 1e-4, "torch_adam": false, "amsgrad": false, "fp32_optimizer_states": true}),
    ));
    assert!(silent.warnings.is_empty(), "{:?}", silent.warnings);
    assert_msg(
        &err(opt("AdamW", json!({"amsgrad": true}))),
        &["optimizer.params.amsgrad", "AMSGrad"],
    );
}

/// DeepSpeed keys that keep the master weights, gradients or Adam's state
/// in 16-bit are read and said when set (tierzero keeps fp32: the same
/// updates, rounded less), not warned about as unused, and refused where
/// DeepSpeed asserts; a schedule started part-way
/// (`last_batch_iteration`) is refused. Their defaults load silently.
#[test]
fn keys_for_16_bit_state_are_said_and_a_late_schedule_start_refused() {
    // DeepSpeed takes them at ZeRO stages 1 to 3.
    let base = || with(base(), json!({"zero_optimization": {"stage": 3}}));
    for (patch, key) in [
        (
            json!({"bf16": {"enabled": true, "bf16_master_weights_and_grads": true}}),
            "bf16.bf16_master_weights_and_grads",
        ),
        (
            json!({"fp16": {"enabled": true, "fp16_master_weights_and_grads": true}}),
            "fp16.fp16_master_weights_and_grads",
        ),
    ] {
        let l = load_str(&with(base(), patch.clone()).to_string(), &skip_fs()).unwrap();
        let said: Vec<String> = l.warnings.iter().map(ToString::to_string).collect();
        assert!(
            said.len() == 1 && said[0].contains(key) && said[0].contains("fp32"),
            "{patch}: {said:?}"
        );
    }
    let both = load_str(
        &with(
            base(),
            json!({"bf16": {"enabled": true, "bf16_master_weights_and_grads": true,
                            "bf16_optimizer_states": true}}),
        )
        .to_string(),
        &skip_fs(),
    )
    .unwrap();
    assert_eq!(both.warnings.len(), 2, "{:?}", both.warnings);
    // DeepSpeed's assertions: stage 1 to 3 only, and 16-bit optimizer
    // states only with 16-bit master weights.
    for (patch, key) in [
        (
            json!({"zero_optimization": {"stage": 0},
                   "fp16": {"enabled": true, "fp16_master_weights_and_grads": true}}),
            "fp16.fp16_master_weights_and_grads",
        ),
        (
            json!({"zero_optimization": {"stage": 0},
                   "bf16": {"enabled": true, "bf16_master_weights_and_grads": true}}),
            "bf16.bf16_master_weights_and_grads",
        ),
        (
            json!({"bf16": {"enabled": true, "bf16_optimizer_states": true}}),
            "bf16.bf16_optimizer_states",
        ),
    ] {
        assert_msg(&err(with(base(), patch)), &[key, "DeepSpeed asserts"]);
    }
    assert_msg(
        &err(with(
            base(),
            json!({"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 100}}}),
        )),
        &["scheduler.params.last_batch_iteration", "--resume"],
    );
    for patch in [
        json!({"bf16": {"enabled": true, "bf16_master_weights_and_grads": false,
                        "bf16_optimizer_states": false}}),
        json!({"fp16": {"enabled": true, "fp16_master_weights_and_grads": false}}),
        json!({"optimizer": {"type": "AdamW", "params": {"fp32_optimizer_states": true}}}),
        // False keeps DeepSpeed's moments in the master weights' dtype:
        // fp32 here, as tierzero's.
        json!({"optimizer": {"type": "AdamW", "params": {"fp32_optimizer_states": false}}}),
        json!({"scheduler": {"type": "WarmupCosineLR",
                             "params": {"total_num_steps": 2000, "last_batch_iteration": -1}}}),
    ] {
        let l = load_str(&with(base(), patch.clone()).to_string(), &skip_fs()).unwrap();
        assert!(l.warnings.is_empty(), "{patch}: {:?}", l.warnings);
    }
}

/// `gradient_allreduce_op`: "mean" (DeepSpeed's default) is what tierzero
/// does; "sum" (refused by DeepSpeed at stage 3, a sum below it) and
/// anything else are errors. It was an unknown key, warned about only.
#[test]
fn gradient_allreduce_op_is_mean_only() {
    let op = |v: &str| with(base(), json!({"gradient_allreduce_op": v}));
    for v in ["mean", "MEAN"] {
        // DeepSpeed lowercases it.
        let l = load_str(&op(v).to_string(), &skip_fs()).unwrap();
        assert!(l.warnings.is_empty(), "{:?}", l.warnings);
    }
    assert_msg(&err(op("sum")), &["gradient_allreduce_op", "\"mean\""]);
    assert_msg(&err(op("max")), &["gradient_allreduce_op", "\"mean\""]);
}

/// A batch size near u64's end: the error's suggested multiple does not
/// overflow (it was `div_ceil(d) * d`, 0 in release, a panic in debug).
#[test]
fn an_indivisible_huge_batch_suggests_a_multiple_that_fits() {
    let e = err_with(
        &json!({"train_batch_size": u64::MAX, "train_micro_batch_size_per_gpu": 2}).to_string(),
        &skip_fs(),
    );
    assert!(
        matches!(e, ConfigError::BatchIndivisible { suggestion, divisor: 2, .. }
            if suggestion == u64::MAX - 1),
        "{e:?}"
    );
}

/// Keys DeepSpeed 0.19.6's `runtime/config.py` reads that tierzero does not
/// use are warned about as DeepSpeed settings it ignores, not as keys
/// neither defines.
#[test]
fn deepspeeds_other_keys_are_known_and_ignored() {
    for key in [
        "eigenvalue",
        "progressive_layer_drop",
        "hybrid_engine",
        "tensor_parallel",
        "torch_autocast",
        "timers",
        "graph_harvesting",
        "log_level",
        "managed_gradient_accumulation",
    ] {
        let mut v = json!({"train_batch_size": 8});
        v[key] = json!({});
        let l = load_str(&v.to_string(), &skip_fs()).unwrap();
        let w: Vec<String> = l.warnings.iter().map(|w| w.to_string()).collect();
        assert!(
            w.iter().any(|w| w.contains(&format!(
                "`{key}` is a DeepSpeed setting tierzero does not use"
            ))),
            "{key}: {w:?}"
        );
    }
}

/// Sizes beyond any machine are refused naming the key (2^48 elements,
/// 2^16 buffers, a 1 GiB aio block); the largest allowed, with a pinned
/// budget to check them against, are a budget error with the numbers,
/// not an overflow (a panic in a debug build, a wrap to a small size in a
/// release one).
#[test]
fn sizes_beyond_any_machine_are_refused_and_the_largest_allowed_do_not_overflow() {
    let nvme = nvme_stage3("/nonexistent-swap");
    for (patch, key) in [
        (
            json!({"zero_optimization": {"offload_param": {"buffer_size": 1e19}}}),
            "offload_param.buffer_size",
        ),
        (
            json!({"zero_optimization": {"offload_param": {"buffer_count": 1e6}}}),
            "offload_param.buffer_count",
        ),
        (
            json!({"zero_optimization": {"offload_optimizer": {"buffer_count": 1e6}}}),
            "offload_optimizer.buffer_count",
        ),
        (
            json!({"zero_optimization": {"sub_group_size": 1e15}}),
            "sub_group_size",
        ),
        (
            json!({"aio": {"block_size": 4294967296u64}}),
            "aio.block_size",
        ),
    ] {
        let e = err(with(nvme.clone(), patch));
        assert_msg(&e, &[key]);
    }
    let largest = with(
        nvme,
        json!({"zero_optimization": {"sub_group_size": 281474976710656u64,
            "offload_param": {"buffer_size": 281474976710656u64, "buffer_count": 65536}},
            "tierzero": {"pinned_budget_bytes": "1GiB"}}),
    );
    let run = RunContext {
        model_numel: Some(1 << 40),
        largest_param_numel: Some(1 << 39),
        ..skip_fs()
    };
    let e = err_with(&largest.to_string(), &run);
    assert_msg(&e, &["pinned_budget_bytes"]);
}

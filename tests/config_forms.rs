//! The forms real configs use: "auto", integers written as floats,
//! DeepSpeed's deprecated aliases, unknown keys (warnings, never errors),
//! our `tierzero` block, the embedded default, and printing the effective
//! config back in DeepSpeed's key names.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: a failed unwrap is a failed test"
)]

use proptest::prelude::*;
use serde_json::json;
use tierzero::config::{
    default_embedded, load_default, load_str, parse_str, AutoOr, Bytes, ConfigError, ConfigWarning,
    DirectIo, DsConfig, IoBackend, Numel, OffloadDevice, PathChecks, Precision, RunContext,
    Scheduler, Source, Stage,
};

fn skip_fs() -> RunContext {
    RunContext {
        path_checks: PathChecks::Skip,
        ..RunContext::default()
    }
}

fn load(v: serde_json::Value) -> tierzero::config::Loaded {
    load_str(&v.to_string(), &skip_fs()).unwrap()
}

#[test]
fn integers_written_as_floats() {
    let l = load(json!({
        "train_micro_batch_size_per_gpu": 4.0,
        "steps_per_print": 1e2,
        "zero_optimization": {
            "stage": 3.0,
            "sub_group_size": 1e9,
            "reduce_bucket_size": 5e8,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_max_live_parameters": 1e9,
            "offload_param": {"device": "cpu", "buffer_size": 1e8, "max_in_cpu": 1e9}
        },
        "aio": {"block_size": 1.048576e6}
    }));
    let c = &l.config;
    assert_eq!(c.batch.micro_batch_size, 4);
    assert_eq!(c.steps_per_print, 100);
    assert_eq!(c.zero.stage, Stage::Parameters);
    assert_eq!(c.zero.sub_group_numel, Numel(1_000_000_000));
    assert_eq!(c.zero.reduce_bucket_numel, Numel(500_000_000));
    assert_eq!(c.zero.prefetch_bucket_numel, Numel(50_000_000));
    assert_eq!(c.zero.offload_param.buffer_numel, Numel(100_000_000));
    assert_eq!(c.aio.block_bytes, Bytes(1_048_576));
}

#[test]
fn deepspeed_defaults_when_keys_are_absent() {
    let c = load(json!({"train_batch_size": 16})).config;
    assert_eq!(c.zero.stage, Stage::Disabled);
    assert_eq!(c.zero.sub_group_numel, Numel(1_000_000_000));
    assert_eq!(c.zero.reduce_bucket_numel, Numel(500_000_000));
    assert_eq!(c.zero.prefetch_bucket_numel, Numel(50_000_000));
    assert_eq!(c.zero.param_persistence_threshold_numel, Numel(100_000));
    assert_eq!(c.zero.max_live_parameters_numel, Numel(1_000_000_000));
    assert_eq!(c.zero.offload_param.buffer_count, 5);
    assert_eq!(c.zero.offload_param.buffer_numel, Numel(100_000_000));
    assert_eq!(c.zero.offload_param.max_in_cpu_numel, Numel(1_000_000_000));
    assert!(c.zero.offload_param.pin_memory);
    assert_eq!(c.zero.offload_optimizer.buffer_count, 4);
    assert!(!c.zero.overlap_comm, "overlap_comm is false below stage 3");
    assert!(c.zero.contiguous_gradients);
    assert_eq!(c.aio.block_bytes, Bytes(1_048_576));
    assert_eq!((c.aio.queue_depth, c.aio.intra_op_parallelism), (8, 1));
    assert!(!c.aio.single_submit && c.aio.overlap_events && !c.aio.use_gds);
    assert_eq!(c.precision, Precision::Fp32);
    // DeepSpeed's default since 0.19.3 (0.0 before).
    assert_eq!(c.gradient_clipping, Some(1.0));
    assert_eq!(c.steps_per_print, 10);
    assert_eq!(c.scheduler, Scheduler::Constant);
    // No optimizer block: HF Trainer's AdamW with its defaults.
    assert_eq!(c.optimizer.lr, 5e-5);
    assert_eq!(
        (
            c.batch.micro_batch_size,
            c.batch.gradient_accumulation_steps
        ),
        (16, 1)
    );
    let c3 = load(json!({"train_batch_size": 16, "zero_optimization": {"stage": 3}})).config;
    assert!(
        c3.zero.overlap_comm,
        "overlap_comm defaults to true at stage 3"
    );
}

#[test]
fn explicit_optimizer_params_absent_use_deepspeed_defaults() {
    let c = load(json!({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"adam_w_mode": false}}})).config;
    assert_eq!(c.optimizer.lr, 1e-3);
    assert_eq!(c.optimizer.betas, [0.9, 0.999]);
    assert_eq!(c.optimizer.eps, 1e-8);
    assert_eq!(c.optimizer.weight_decay, 0.0);
    assert!(
        !c.optimizer.decoupled_weight_decay,
        "Adam with adam_w_mode false is L2 Adam"
    );
    let c = load(json!({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}})).config;
    assert!(
        c.optimizer.decoupled_weight_decay,
        "AdamW is always decoupled"
    );
    assert!(c.optimizer.bias_correction, "DeepSpeed's default");
    // bias_correction is read (DeepSpeed's CPU Adam takes it), not warned
    // about and ignored.
    let l = load(
        json!({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"bias_correction": false}}}),
    );
    assert!(!l.config.optimizer.bias_correction);
    assert!(
        l.warnings
            .iter()
            .all(|w| !w.to_string().contains("bias_correction")),
        "{:?}",
        l.warnings
    );
}

#[test]
fn absent_numeric_keys_take_run_values() {
    let run = RunContext {
        learning_rate: Some(2e-4),
        micro_batch_size: Some(2),
        ..skip_fs()
    };
    let l = load_str(&json!({"optimizer": {"type": "AdamW"}}).to_string(), &run).unwrap();
    assert_eq!(l.config.optimizer.lr, 2e-4);
    assert_eq!(l.config.batch.micro_batch_size, 2);
    assert!(l
        .resolved
        .iter()
        .any(|r| r.key == "optimizer.params.lr" && r.source == Source::Run("learning_rate")));
}

#[test]
fn auto_batch_sizes_multiply_over_ranks() {
    let run = RunContext {
        ranks: 4,
        micro_batch_size: Some(2),
        gradient_accumulation_steps: Some(3),
        ..skip_fs()
    };
    let text = json!({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                      "gradient_accumulation_steps": "auto"})
    .to_string();
    let b = load_str(&text, &run).unwrap().config.batch;
    assert_eq!(
        (
            b.train_batch_size,
            b.micro_batch_size,
            b.gradient_accumulation_steps,
            b.ranks
        ),
        (24, 2, 3, 4)
    );
    // Only train_batch_size "auto": micro and accumulation come from the run or HF defaults.
    let b = load_str(
        &json!({"train_batch_size": "auto"}).to_string(),
        &RunContext {
            ranks: 2,
            ..skip_fs()
        },
    )
    .unwrap()
    .config
    .batch;
    assert_eq!(
        (
            b.train_batch_size,
            b.micro_batch_size,
            b.gradient_accumulation_steps
        ),
        (16, 8, 1)
    );
}

#[test]
fn auto_precision_follows_the_run() {
    let text =
        json!({"train_batch_size": 8, "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}})
            .to_string();
    let run = |m| RunContext {
        mixed_precision: Some(m),
        ..skip_fs()
    };
    use tierzero::config::MixedPrecision::*;
    assert_eq!(
        load_str(&text, &run(Bf16)).unwrap().config.precision,
        Precision::Bf16
    );
    assert!(matches!(
        load_str(&text, &run(Fp16)).unwrap().config.precision,
        Precision::Fp16 { .. }
    ));
    assert_eq!(
        load_str(&text, &run(No)).unwrap().config.precision,
        Precision::Fp32
    );
    assert_eq!(
        load_str(&text, &skip_fs()).unwrap().config.precision,
        Precision::Fp32
    );
    assert_eq!(Precision::Bf16.param_elem_bytes(), 2);
}

#[test]
fn auto_scheduler_params_follow_optimizer_and_run() {
    let run = RunContext {
        learning_rate: Some(1e-4),
        warmup_steps: Some(7),
        total_steps: Some(70),
        ..skip_fs()
    };
    let text = json!({"train_batch_size": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": "auto", "total_num_steps": "auto",
                      "warmup_min_ratio": 0.1, "warmup_type": "linear"}}})
    .to_string();
    let s = load_str(&text, &run).unwrap().config.scheduler;
    assert_eq!(
        s,
        Scheduler::WarmupCosineLr {
            total_steps: 70,
            warmup_min_ratio: 0.1,
            warmup_steps: 7,
            cos_min_ratio: 0.0001,
            warmup_type: tierzero::config::WarmupType::Linear
        }
    );
}

#[test]
fn a_schedule_peak_other_than_the_runs_lr_is_refused_or_said() {
    let with_lr = RunContext {
        learning_rate: Some(2e-5),
        total_steps: Some(10),
        ..skip_fs()
    };
    let sched = |params: serde_json::Value| {
        json!({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
            "scheduler": {"type": "WarmupDecayLR", "params": params}})
        .to_string()
    };
    // A peak the run's lr contradicts: refused, as HF Trainer's fill_match.
    let e = load_str(&sched(json!({"warmup_max_lr": 1e-3})), &with_lr).unwrap_err();
    assert!(
        matches!(&e, ConfigError::RunMismatch { key, .. } if key == "scheduler.params.warmup_max_lr"),
        "{e}"
    );
    // Equal, or "auto": no word.
    for v in [json!(2e-5), json!("auto")] {
        let l = load_str(&sched(json!({"warmup_max_lr": v})), &with_lr).unwrap();
        assert!(!l
            .warnings
            .iter()
            .any(|w| w.key() == "scheduler.params.warmup_max_lr"));
    }
    // Absent: DeepSpeed's 0.001 peak stays, and is said.
    let l = load_str(&sched(json!({})), &with_lr).unwrap();
    assert!(
        matches!(l.config.scheduler, Scheduler::WarmupDecayLr { max_lr, .. } if max_lr == 0.001)
    );
    assert!(l.warnings.iter().any(|w| matches!(w,
        ConfigWarning::Note { key, message }
            if key == "scheduler.params.warmup_max_lr" && message.contains("0.001"))));
    // WarmupLR's absent peak is the optimizer's lr: nothing to say.
    let text =
        json!({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {}}})
        .to_string();
    let l = load_str(&text, &with_lr).unwrap();
    assert!(!l
        .warnings
        .iter()
        .any(|w| w.key() == "scheduler.params.warmup_max_lr"));
}

#[test]
fn total_steps_below_warmup_is_a_warning_as_in_deepspeed() {
    let l = load(json!({"train_batch_size": 8,
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 100, "total_num_steps": 10}}}));
    assert!(l
        .warnings
        .iter()
        .any(|w| matches!(w, ConfigWarning::Note { key, .. } if key == "scheduler.params.total_num_steps")));
}

#[test]
fn deprecated_aliases_are_accepted_with_warnings() {
    let l = load(json!({
        "train_batch_size": 8,
        "bfloat16": {"enabled": true},
        "zero_optimization": {
            "stage": 3,
            "cpu_offload": true,
            "cpu_offload_param": true,
            "cpu_offload_use_pin_memory": false,
            "stage3_gather_fp16_weights_on_model_save": true,
            "prefetch_bucket_size": 1234,
            "param_persistence_threshold": 55,
            "model_persistence_threshold": 77,
            "max_live_parameters": 999
        },
        "aio": {"thread_count": 3}
    }));
    let c = &l.config;
    assert_eq!(c.precision, Precision::Bf16);
    assert_eq!(c.zero.offload_optimizer.device, OffloadDevice::Cpu);
    assert_eq!(c.zero.offload_param.device, OffloadDevice::Cpu);
    // DeepSpeed ignores cpu_offload_use_pin_memory: the blocks' default
    // pin_memory (true since DeepSpeed 0.19.5) stands, with a note.
    assert!(c.zero.offload_param.pin_memory && c.zero.offload_optimizer.pin_memory);
    assert!(l.warnings.iter().any(|w| matches!(w,
        ConfigWarning::Note { key, message }
            if key == "zero_optimization.cpu_offload_use_pin_memory" && message.contains("ignored"))));
    assert!(c.zero.gather_16bit_weights_on_model_save);
    assert_eq!(c.zero.prefetch_bucket_numel, Numel(1234));
    assert_eq!(c.zero.param_persistence_threshold_numel, Numel(55));
    assert_eq!(c.zero.model_persistence_threshold_numel, Numel(77));
    assert_eq!(c.zero.max_live_parameters_numel, Numel(999));
    assert_eq!(c.aio.intra_op_parallelism, 3);
    let deprecated: Vec<&str> = l
        .warnings
        .iter()
        .filter_map(|w| match w {
            ConfigWarning::Deprecated { key, .. } => Some(key.as_str()),
            _ => None,
        })
        .collect();
    for k in [
        "bfloat16",
        "zero_optimization.cpu_offload",
        "zero_optimization.cpu_offload_param",
        "zero_optimization.stage3_gather_fp16_weights_on_model_save",
        "aio.thread_count",
    ] {
        assert!(deprecated.contains(&k), "{k} not reported: {deprecated:?}");
    }
    // The short pydantic field names are DeepSpeed's own, not deprecated.
    assert!(!deprecated
        .iter()
        .any(|k| k.ends_with("prefetch_bucket_size")));
    assert!(l.unknown_keys().is_empty());
}

/// A deprecated flag written `false` stands for no offload, and its
/// warning says so (it advised `{"device": "cpu"}`, turning offload on).
#[test]
fn a_false_cpu_offload_flag_advises_no_offload() {
    let l = load(json!({"train_batch_size": 8,
        "zero_optimization": {"stage": 3, "cpu_offload": false, "cpu_offload_param": true}}));
    assert_eq!(l.config.zero.offload_optimizer.device, OffloadDevice::None);
    let replacement = |k: &str| {
        l.warnings
            .iter()
            .find_map(|w| match w {
                ConfigWarning::Deprecated { key, replacement } if key == k => {
                    Some(replacement.clone())
                }
                _ => None,
            })
            .unwrap()
    };
    assert_eq!(
        replacement("zero_optimization.cpu_offload"),
        r#""offload_optimizer": {"device": "none"}"#
    );
    assert_eq!(
        replacement("zero_optimization.cpu_offload_param"),
        r#""offload_param": {"device": "cpu"}"#
    );
}

#[test]
fn bf16_wins_over_bfloat16_as_in_deepspeed() {
    // DeepSpeed's get_bfloat16_config reads `bf16` and looks at
    // `bfloat16` only where `bf16` is absent.
    let l = load(json!({"train_batch_size": 8,
        "bf16": {"enabled": false}, "bfloat16": {"enabled": true}}));
    assert_eq!(l.config.precision, Precision::Fp32);
    assert!(l.warnings.iter().any(
        |w| matches!(w, ConfigWarning::Note { key, message } if key == "bfloat16" && message.contains("bf16"))
    ));
    assert!(l.unknown_keys().is_empty());
    let l = load(json!({"train_batch_size": 8, "bfloat16": {"enabled": true}}));
    assert_eq!(l.config.precision, Precision::Bf16);
}

#[test]
fn boolean_zero_optimization_is_stage_one_or_zero() {
    // DeepSpeed's read_zero_config_deprecated: true is stage 1.
    for (on, stage) in [(true, 1), (false, 0)] {
        let l = load(json!({"train_batch_size": 8, "zero_optimization": on}));
        assert_eq!(l.config.zero.stage as u64, stage, "{on}");
        assert!(l.warnings.iter().any(|w| matches!(w,
            ConfigWarning::Deprecated { key, replacement }
                if key == "zero_optimization" && replacement.contains(&format!("\"stage\": {stage}")))));
    }
}

#[test]
fn cpu_offload_false_does_nothing() {
    let c = load(
        json!({"train_batch_size": 8, "zero_optimization": {"stage": 2, "cpu_offload": false}}),
    )
    .config;
    assert_eq!(c.zero.offload_optimizer.device, OffloadDevice::None);
}

/// DeepSpeed keys tierzero does not use warn as such, not as unknown:
/// the optimizer block's `legacy_fusion`, torch's AdamW arguments, and the
/// short names DeepSpeed's ZeRO model takes beside their `stage3_` aliases.
#[test]
fn deepspeed_keys_tierzero_does_not_use_are_not_unknown() {
    let l = load(json!({
        "train_batch_size": 8,
        "optimizer": {"type": "AdamW", "legacy_fusion": false,
                      "params": {"lr": 1e-4, "fused": true, "foreach": false}},
        "zero_optimization": {"stage": 3, "module_granularity_threshold": 0,
            "use_all_reduce_for_fetch_params": false, "allgather_sequential": false},
    }));
    assert!(l.unknown_keys().is_empty(), "{:?}", l.warnings);
    let ignored = l
        .warnings
        .iter()
        .filter(|w| matches!(w, ConfigWarning::IgnoredKey { .. }))
        .count();
    assert_eq!(ignored, 6, "{:?}", l.warnings);
}

/// `optimizer.params.max_grad_norm` is refused, as DeepSpeed refuses it,
/// naming `gradient_clipping`: ignored, it would train without clipping.
#[test]
fn max_grad_norm_among_the_optimizer_params_is_refused() {
    let text = serde_json::to_string(&json!({
        "train_batch_size": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "max_grad_norm": 0.5}},
    }))
    .unwrap();
    let err = load_str(&text, &skip_fs()).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("`optimizer.params.max_grad_norm` = 0.5")
            && msg.contains("\"gradient_clipping\": 0.5"),
        "{msg}"
    );
    assert_eq!(err.key(), Some("optimizer.params.max_grad_norm"));
}

#[test]
fn unknown_keys_warn_with_paths_and_never_fail() {
    let l = load(json!({
        "train_batch_size": 8,
        "my_custom_thing": {"a": 1},
        "fp16": {"enabled": false, "loss_scael": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "lr_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "total_num_steps": 50}},
        "zero_optimization": {"stage": 3, "stage3_foo": 1,
            "offload_param": {"device": "cpu", "buffer_cnt": 3}},
        "aio": {"queue_dept": 4},
        "tierzero": {"ring_thread": 2}
    }));
    let mut keys = l.unknown_keys();
    keys.sort_unstable();
    assert_eq!(
        keys,
        vec![
            "aio.queue_dept",
            "fp16.loss_scael",
            "my_custom_thing",
            "optimizer.params.lr_decay",
            "scheduler.params.total_num_steps",
            "tierzero.ring_thread",
            "zero_optimization.offload_param.buffer_cnt",
            "zero_optimization.stage3_foo",
        ]
    );
    let suggestion = |k: &str| {
        l.warnings.iter().find_map(|w| match w {
            ConfigWarning::UnknownKey {
                key, suggestion, ..
            } if key == k => suggestion.clone(),
            _ => None,
        })
    };
    assert_eq!(
        suggestion("fp16.loss_scael").as_deref(),
        Some("fp16.loss_scale")
    );
    assert_eq!(
        suggestion("aio.queue_dept").as_deref(),
        Some("aio.queue_depth")
    );
    assert_eq!(
        suggestion("tierzero.ring_thread").as_deref(),
        Some("tierzero.ring_threads")
    );
    assert_eq!(suggestion("my_custom_thing"), None);
    // Unknown keys are not applied.
    assert_eq!(l.config.aio.queue_depth, 8);
    // Where DeepSpeed refuses an unknown key (its pydantic sections; the
    // optimizer's and scheduler's constructor arguments) the warning says
    // so; where it ignores it (the top level, `aio`, our block) it does not.
    let refuses = |k: &str| {
        l.warnings.iter().find_map(|w| match w {
            ConfigWarning::UnknownKey {
                key,
                deepspeed_refuses,
                ..
            } if key == k => Some(deepspeed_refuses.is_some()),
            _ => None,
        })
    };
    for (key, refused) in [
        ("fp16.loss_scael", true),
        ("zero_optimization.stage3_foo", true),
        ("zero_optimization.offload_param.buffer_cnt", true),
        ("optimizer.params.lr_decay", true),
        ("scheduler.params.total_num_steps", true),
        ("my_custom_thing", false),
        ("aio.queue_dept", false),
        ("tierzero.ring_thread", false),
    ] {
        assert_eq!(refuses(key), Some(refused), "{key}");
    }
    let text = l
        .warnings
        .iter()
        .find(|w| w.key() == "zero_optimization.offload_param.buffer_cnt")
        .unwrap()
        .to_string();
    assert!(
        text.contains("did you mean `zero_optimization.offload_param.buffer_count`?")
            && text.contains("DeepSpeed would refuse this config"),
        "{text}"
    );
    // Warnings render on one line and name the key.
    for w in &l.warnings {
        let s = w.to_string();
        assert!(!s.contains('\n') && s.contains(w.key()), "{s}");
    }
    // parse_str (no run) reports the same unknown keys.
    let text = serde_json::to_string(&json!({"zero_optimization": {"stage3_foo": 1}})).unwrap();
    assert_eq!(
        parse_str(&text).unwrap().unknown_keys(),
        vec!["zero_optimization.stage3_foo"]
    );
}

#[test]
fn device_cache_bytes_is_auto_when_absent_or_auto_and_a_count_or_zero_otherwise() {
    let cache = |v: Option<serde_json::Value>| {
        let mut c = json!({"train_batch_size": 8, "tierzero": {}});
        if let Some(v) = v {
            c["tierzero"]["device_cache_bytes"] = v;
        }
        load(c).config.tierzero.device_cache_bytes
    };
    assert_eq!(cache(None), None);
    assert_eq!(cache(Some(json!("auto"))), None);
    assert_eq!(cache(Some(json!(0))), Some(Bytes(0)));
    assert_eq!(cache(Some(json!("1GiB"))), Some(Bytes(1 << 30)));
    // The device tier's limit: auto keeps what the budget holds.
    let limits = |v| {
        let c = json!({"train_batch_size": 8, "tierzero": {"device_cache_bytes": v}});
        tierzero::engine::device::TierLimits::of(&load(c).config).cache_bytes
    };
    assert_eq!(
        limits(json!("auto")),
        tierzero::engine::device::TierLimits::CACHE_AUTO
    );
    assert_eq!(limits(json!(4096)), 4096);
    let bad = load_str(
        &json!({"train_batch_size": 8, "tierzero": {"device_cache_bytes": "lots"}}).to_string(),
        &skip_fs(),
    );
    assert!(bad.is_err(), "{bad:?}");
}

#[test]
fn tierzero_block() {
    let l = load(json!({
        "train_batch_size": 8,
        "aio": {"intra_op_parallelism": 4},
        "tierzero": {
            "pinned_budget_bytes": "2GiB",
            "device_cache_bytes": 1e9,
            "io_backend": "portable",
            "direct_io": "off",
            "checksums": false,
            "overlap_optimizer": false
        }
    }));
    let t = l.config.tierzero;
    assert_eq!(t.pinned_budget_bytes, Some(Bytes(2 << 30)));
    assert_eq!(t.device_cache_bytes, Some(Bytes(1_000_000_000)));
    assert_eq!(t.io_backend, IoBackend::Portable);
    assert_eq!(t.direct_io, DirectIo::Off);
    assert_eq!(
        t.ring_threads, 4,
        "ring_threads follows aio.intra_op_parallelism"
    );
    assert!(!t.checksums && !t.overlap_optimizer);
    let d = load(json!({"train_batch_size": 8})).config.tierzero;
    assert_eq!(d.pinned_budget_bytes, None);
    assert_eq!(
        (d.io_backend, d.direct_io, d.ring_threads),
        (IoBackend::Auto, DirectIo::Auto, 1)
    );
    assert!(d.checksums && d.overlap_optimizer);
    let e = load_str(
        &json!({"train_batch_size": 8, "tierzero": {"ring_threads": 0}}).to_string(),
        &skip_fs(),
    )
    .unwrap_err();
    assert!(matches!(&e, ConfigError::OutOfRange { key, .. } if key == "tierzero.ring_threads"));
}

#[test]
fn compute_threads_is_auto_a_count_or_an_error() {
    let threads = |v: serde_json::Value| {
        load(json!({"train_batch_size": 8, "tierzero": {"compute_threads": v}}))
            .config
            .tierzero
            .compute_threads
    };
    assert_eq!(threads(json!("auto")), None);
    assert_eq!(threads(json!(3)), Some(3));
    assert_eq!(
        load(json!({"train_batch_size": 8}))
            .config
            .tierzero
            .compute_threads,
        None
    );
    tierzero_key_rejects(
        "compute_threads",
        [json!(0), json!(-1), json!(5000), json!("many"), json!(1.5)],
    );
}

#[test]
fn pin_threads_is_auto_true_false_or_an_error() {
    let pin = |v: serde_json::Value| {
        load(json!({"train_batch_size": 8, "tierzero": {"pin_threads": v}}))
            .config
            .tierzero
            .pin_threads
    };
    assert_eq!(pin(json!("auto")), None);
    assert_eq!(pin(json!(true)), Some(true));
    assert_eq!(pin(json!(false)), Some(false));
    assert_eq!(
        load(json!({"train_batch_size": 8}))
            .config
            .tierzero
            .pin_threads,
        None
    );
    tierzero_key_rejects("pin_threads", [json!(1), json!("yes"), json!([0, 1])]);
}

#[test]
fn stop_grace_s_is_positive_seconds_or_absent() {
    let grace = |v: serde_json::Value| {
        load(json!({"train_batch_size": 8, "tierzero": {"stop_grace_s": v}}))
            .config
            .tierzero
            .stop_grace
    };
    assert_eq!(grace(json!(25)), Some(std::time::Duration::from_secs(25)));
    assert_eq!(
        grace(json!(0.5)),
        Some(std::time::Duration::from_millis(500))
    );
    assert_eq!(
        load(json!({"train_batch_size": 8}))
            .config
            .tierzero
            .stop_grace,
        None
    );
    tierzero_key_rejects(
        "stop_grace_s",
        [json!(0), json!(-3), json!(1e9), json!("30s"), json!(true)],
    );
}

/// Each of `bad` as `tierzero.<key>` is an error that names the key.
fn tierzero_key_rejects<const N: usize>(key: &str, bad: [serde_json::Value; N]) {
    for v in bad {
        let e = load_str(
            &json!({"train_batch_size": 8, "tierzero": {key: v}}).to_string(),
            &skip_fs(),
        )
        .unwrap_err();
        assert!(
            e.to_string().contains(&format!("tierzero.{key}")),
            "{v}: {e}"
        );
    }
}

#[test]
fn optimizer_resident_bytes_is_auto_a_size_or_an_error() {
    let resident = |v: serde_json::Value| {
        load(json!({"train_batch_size": 8, "tierzero": {"optimizer_resident_bytes": v}}))
            .config
            .tierzero
            .optimizer_resident_bytes
    };
    assert_eq!(resident(json!("auto")), None);
    assert_eq!(resident(json!(0)), Some(Bytes(0)));
    assert_eq!(resident(json!("64MiB")), Some(Bytes(64 << 20)));
    assert_eq!(
        load(json!({"train_batch_size": 8}))
            .config
            .tierzero
            .optimizer_resident_bytes,
        None
    );
    tierzero_key_rejects(
        "optimizer_resident_bytes",
        [json!(-1), json!("lots"), json!(true), json!(1.5)],
    );
    // Like every key that takes "auto", the error says so.
    let e = load_str(
        &json!({"train_batch_size": 8, "tierzero": {"optimizer_resident_bytes": "lots"}})
            .to_string(),
        &skip_fs(),
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("expected a byte count such as 1073741824 or \"1GiB\" or \"auto\""),
        "{e}"
    );
}

#[test]
fn nvme_path_on_non_nvme_device_is_a_note() {
    let l = load(
        json!({"train_batch_size": 8, "zero_optimization": {"stage": 3,
        "offload_param": {"device": "cpu", "nvme_path": "/somewhere"}}}),
    );
    assert_eq!(l.config.zero.offload_param.device, OffloadDevice::Cpu);
    assert!(l.warnings.iter().any(
        |w| matches!(w, ConfigWarning::Note { key, .. } if key == "zero_optimization.offload_param.nvme_path")
    ));
}

#[test]
fn embedded_default_is_stage3_nvme_into_tierzero_swap() {
    let run = RunContext {
        total_steps: Some(200),
        path_checks: PathChecks::Skip,
        ..RunContext::default()
    };
    let l = load_default(&run).unwrap();
    assert!(l.warnings.is_empty(), "{:?}", l.warnings);
    let c = &l.config;
    assert_eq!(c.zero.stage, Stage::Parameters);
    let swap = OffloadDevice::Nvme {
        path: "./tierzero-swap".into(),
    };
    assert_eq!(c.zero.offload_param.device, swap);
    assert_eq!(c.zero.offload_optimizer.device, swap);
    assert!(matches!(
        c.scheduler,
        Scheduler::WarmupDecayLr {
            total_steps: 200,
            ..
        }
    ));
    // Its pinned buffers fit its own budget, with the model size known.
    let budget = c.tierzero.pinned_budget_bytes.unwrap();
    let shape = tierzero::engine::sizing::Shape::estimated(
        1_000_000_000_000,
        None,
        c.zero.sub_group_numel.0,
    );
    let sized = tierzero::engine::sizing::decide(c, &shape).unwrap();
    let buffers = sized.param_buffers.total_bytes() + sized.optimizer_buffers.total_bytes();
    assert!(buffers <= budget.0, "{buffers} > {}", budget.0);
    // Without --steps the decay has no end: a clear error, not a guess.
    let e = load_default(&RunContext {
        path_checks: PathChecks::Skip,
        ..RunContext::default()
    })
    .unwrap_err();
    assert!(matches!(e, ConfigError::AutoUnresolved { .. }));
    assert!(default_embedded().contains("\"nvme_path\": \"./tierzero-swap\""));
}

#[test]
fn embedded_default_creates_its_swap_dir() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tierzero-swap");
    let text = default_embedded().replace("./tierzero-swap", dir.to_str().unwrap());
    let run = RunContext {
        total_steps: Some(10),
        path_checks: PathChecks::CreateMissing,
        ..RunContext::default()
    };
    load_str(&text, &run).unwrap();
    assert!(dir.is_dir());
}

/// DeepSpeed reads its config with hjson: comments of all three kinds and
/// trailing commas load to exactly what the plain JSON loads to.
#[test]
fn comments_and_trailing_commas_load_like_plain_json() {
    let plain = r#"{
  "train_batch_size": 16,
  "train_micro_batch_size_per_gpu": 4,
  "gradient_clipping": 1.0,
  "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95]}},
  "zero_optimization": {
    "stage": 3,
    "sub_group_size": 1e9,
    "offload_param": {"device": "cpu", "pin_memory": true}
  }
}"#;
    let commented = r#"// HF-style header comment
{
  "train_batch_size": 16, // global
  "train_micro_batch_size_per_gpu": 4,
  # a hash comment, as Python hjson allows
  "gradient_clipping": 1.0,
  /* a block
     comment */
  "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95,],},},
  "zero_optimization": {
    "stage": 3,
    "sub_group_size": 1e9,
    "offload_param": {"device": "cpu", "pin_memory": true,},
  },
}
"#;
    let run = RunContext {
        ranks: 2,
        ..skip_fs()
    };
    let a = load_str(plain, &run).unwrap();
    let b = load_str(commented, &run).unwrap();
    assert_eq!(b.config, a.config);
    assert_eq!(b.ds, a.ds);
    assert_eq!(b.warnings, a.warnings);
    assert_eq!(b.config.batch.gradient_accumulation_steps, 2);
    assert_eq!(b.config.optimizer.betas, [0.9, 0.95]);
}

#[test]
fn effective_config_round_trips_in_deepspeed_names() {
    let fixtures = format!("{}/tests/fixtures/ds_config", env!("CARGO_MANIFEST_DIR"));
    let mut n = 0;
    for entry in std::fs::read_dir(&fixtures).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let Ok(parsed) = parse_str(&text) else {
            continue;
        };
        let out = serde_json::to_string(&parsed.ds).unwrap();
        // Back through our walker: same edge config, no warnings but the
        // notes the original drew for the same settings (a 16-bit master
        // weights flag is read, and said again).
        let again = parse_str(&out).unwrap();
        assert_eq!(again.ds, parsed.ds, "{}", path.display());
        assert!(
            again
                .warnings
                .iter()
                .all(|w| matches!(w, ConfigWarning::Note { .. }) && parsed.warnings.contains(w)),
            "{}: {:?}",
            path.display(),
            again.warnings
        );
        // And through plain serde.
        let via_serde: DsConfig = serde_json::from_str(&out).unwrap();
        assert_eq!(via_serde, parsed.ds);
        n += 1;
    }
    assert!(n >= 6, "only {n} fixtures parsed");
    let d = parse_str(default_embedded()).unwrap();
    assert_eq!(
        d.ds.scheduler.unwrap().params.total_num_steps,
        Some(AutoOr::Auto)
    );
}

proptest! {
    /// Given any two of the three batch sizes, the third is inferred so that
    /// train = micro × accumulation × ranks holds exactly, or a clear error
    /// says why it cannot be.
    #[test]
    fn batch_inference_is_exact(micro in 1u64..64, gas in 1u64..16, ranks in 1u64..9, which in 0usize..3, noise in 0u64..3) {
        let train = micro * gas * ranks + noise;
        let v = match which {
            0 => json!({"train_batch_size": train, "train_micro_batch_size_per_gpu": micro}),
            1 => json!({"train_batch_size": train, "gradient_accumulation_steps": gas}),
            _ => json!({"train_batch_size": train, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas}),
        };
        let run = RunContext { ranks, ..skip_fs() };
        match load_str(&v.to_string(), &run) {
            Ok(l) => {
                let b = l.config.batch;
                prop_assert_eq!(b.train_batch_size, train);
                prop_assert_eq!(b.micro_batch_size * b.gradient_accumulation_steps * b.ranks, train);
                if which == 2 { prop_assert_eq!(noise, 0); }
            }
            Err(ConfigError::BatchIndivisible { train_batch_size, divisor, .. }) => {
                prop_assert_eq!(train_batch_size, train);
                prop_assert!(train % divisor != 0);
                prop_assert!(which != 2);
            }
            Err(ConfigError::BatchMismatch { product, .. }) => {
                prop_assert_eq!(which, 2);
                prop_assert_eq!(product, micro * gas * ranks);
                prop_assert!(noise != 0);
            }
            Err(e) => prop_assert!(false, "unexpected {e}"),
        }
    }

    /// Extra keys anywhere never make a valid config fail; each is reported
    /// with its path. (No known key starts with "x_".)
    #[test]
    fn unknown_keys_never_fail(
        suffix in "[a-z_]{0,12}",
        val in prop_oneof![Just(json!(1)), Just(json!("x")), Just(json!({"y": [1]})), Just(json!(null))],
        obj in prop_oneof![Just(""), Just("zero_optimization"), Just("zero_optimization.offload_param"),
                           Just("aio"), Just("tierzero"), Just("fp16"), Just("optimizer.params")],
    ) {
        let name = format!("x_{suffix}");
        let mut v = json!({"train_batch_size": 8,
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
            "aio": {}, "tierzero": {}, "fp16": {}, "optimizer": {"type": "AdamW", "params": {}}});
        let mut target = &mut v;
        for part in obj.split('.').filter(|p| !p.is_empty()) {
            target = target.get_mut(part).unwrap();
        }
        target.as_object_mut().unwrap().insert(name.clone(), val);
        let l = load_str(&v.to_string(), &skip_fs()).unwrap();
        let path = if obj.is_empty() { name } else { format!("{obj}.{name}") };
        prop_assert_eq!(l.unknown_keys(), vec![path.as_str()]);
    }
}

#[test]
fn absent_gradient_clipping_takes_the_run_value_and_explicit_must_match() {
    let run = RunContext {
        max_grad_norm: Some(0.5),
        ..skip_fs()
    };
    let c = load_str(&json!({"train_batch_size": 8}).to_string(), &run)
        .unwrap()
        .config;
    assert_eq!(c.gradient_clipping, Some(0.5));
    let e = load_str(
        &json!({"train_batch_size": 8, "gradient_clipping": 1.0}).to_string(),
        &run,
    )
    .unwrap_err();
    assert!(matches!(&e, ConfigError::RunMismatch { key, .. } if key == "gradient_clipping"));
}

#[test]
fn explicit_scheduler_steps_win_over_the_run_with_a_note() {
    // HF Trainer fills scheduler params but does not enforce them: a short
    // test run of a long schedule is legitimate.
    let run = RunContext {
        total_steps: Some(100),
        warmup_steps: Some(5),
        ..skip_fs()
    };
    let text = json!({"train_batch_size": 8,
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10000, "warmup_num_steps": 50}}})
    .to_string();
    let l = load_str(&text, &run).unwrap();
    assert!(matches!(
        l.config.scheduler,
        Scheduler::WarmupDecayLr {
            total_steps: 10000,
            warmup_steps: 50,
            ..
        }
    ));
    for k in [
        "scheduler.params.total_num_steps",
        "scheduler.params.warmup_num_steps",
    ] {
        assert!(
            l.warnings
                .iter()
                .any(|w| matches!(w, ConfigWarning::Note { key, .. } if key == k)),
            "{k}"
        );
    }
}

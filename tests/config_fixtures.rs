//! Real-world ds_config.json files (see tests/fixtures/ds_config/README.md
//! for their sources) parse, resolve and validate with the meaning DeepSpeed
//! and HF Trainer give them.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: a failed unwrap is a failed test"
)]

use tierzero::config::{
    load_str, parse_str, ActivationBudget, ConfigError, ConfigWarning, LossScale, Numel,
    OffloadDevice, OptimizerKind, PathChecks, Precision, RunContext, Scheduler, Source, Stage,
    WarmupType,
};

fn fixture(name: &str) -> String {
    let path = format!(
        "{}/tests/fixtures/ds_config/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn skip_fs() -> RunContext {
    RunContext {
        path_checks: PathChecks::Skip,
        ..RunContext::default()
    }
}

fn has_warning(w: &[ConfigWarning], pred: impl Fn(&ConfigWarning) -> bool) -> bool {
    w.iter().any(pred)
}

#[test]
fn hf_zero3_auto_resolves_from_run_like_hf_trainer() {
    let run = RunContext {
        ranks: 2,
        micro_batch_size: Some(4),
        gradient_accumulation_steps: Some(2),
        learning_rate: Some(3e-5),
        weight_decay: Some(0.01),
        max_grad_norm: Some(0.5),
        warmup_steps: Some(50),
        total_steps: Some(1000),
        mixed_precision: Some(tierzero::config::MixedPrecision::Fp16),
        hidden_size: Some(1024),
        ..skip_fs()
    };
    let l = load_str(&fixture("hf_zero3_auto.json"), &run).unwrap();
    let c = &l.config;
    assert_eq!(c.batch.micro_batch_size, 4);
    assert_eq!(c.batch.gradient_accumulation_steps, 2);
    assert_eq!(c.batch.train_batch_size, 16);
    assert_eq!(c.gradient_clipping, Some(0.5));
    assert_eq!(c.steps_per_print, 2000);
    assert_eq!(
        c.precision,
        Precision::Fp16 {
            loss_scale: LossScale::Dynamic {
                initial_scale_power: 16,
                window: 1000,
                hysteresis: 2,
                min_scale: 1.0,
                consecutive_hysteresis: false
            }
        }
    );
    assert_eq!(c.optimizer.kind, OptimizerKind::AdamW);
    assert_eq!(c.optimizer.lr, 3e-5);
    assert_eq!(c.optimizer.betas, [0.9, 0.999]);
    assert_eq!(c.optimizer.eps, 1e-8);
    assert_eq!(c.optimizer.weight_decay, 0.01);
    assert!(c.optimizer.decoupled_weight_decay);
    assert_eq!(
        c.scheduler,
        Scheduler::WarmupLr {
            min_lr: 0.0,
            max_lr: 3e-5,
            warmup_steps: 50,
            warmup_type: WarmupType::Log
        }
    );
    let z = &c.zero;
    assert_eq!(z.stage, Stage::Parameters);
    assert_eq!(z.offload_param.device, OffloadDevice::Cpu);
    assert_eq!(z.offload_optimizer.device, OffloadDevice::Cpu);
    assert_eq!(z.sub_group_numel, Numel(100_000_000_000_000));
    assert_eq!(z.reduce_bucket_numel, Numel(1024 * 1024));
    assert_eq!(z.prefetch_bucket_numel, Numel(943_718)); // floor(0.9 * 1024^2)
    assert_eq!(z.param_persistence_threshold_numel, Numel(10_240));
    assert_eq!(z.max_live_parameters_numel, Numel(1_000_000_000));
    assert!(z.gather_16bit_weights_on_model_save);
    assert!(z.overlap_comm && z.contiguous_gradients);
    // Deprecated alias accepted with a warning; nothing unknown.
    assert!(has_warning(
        &l.warnings,
        |w| matches!(w, ConfigWarning::Deprecated { key, .. }
        if key == "zero_optimization.stage3_gather_fp16_weights_on_model_save")
    ));
    assert!(l.unknown_keys().is_empty(), "{:?}", l.warnings);
    // Every "auto" is recorded with its source.
    let src = |k: &str| {
        l.resolved
            .iter()
            .find(|r| r.key == k)
            .map(|r| r.source.clone())
    };
    assert_eq!(
        src("optimizer.params.lr"),
        Some(Source::Run("learning_rate"))
    );
    assert_eq!(src("optimizer.params.betas"), Some(Source::HfDefault));
    assert!(matches!(src("train_batch_size"), Some(Source::Derived(_))));
    assert!(matches!(
        src("zero_optimization.reduce_bucket_size"),
        Some(Source::Derived(_))
    ));
}

#[test]
fn hf_zero3_auto_without_run_values_uses_hf_and_deepspeed_defaults() {
    let l = load_str(&fixture("hf_zero3_auto.json"), &skip_fs()).unwrap();
    let c = &l.config;
    assert_eq!(
        (
            c.batch.micro_batch_size,
            c.batch.gradient_accumulation_steps,
            c.batch.train_batch_size
        ),
        (8, 1, 8)
    );
    assert_eq!(c.optimizer.lr, 5e-5);
    assert_eq!(c.precision, Precision::Fp32);
    assert_eq!(c.gradient_clipping, Some(1.0));
    assert_eq!(c.zero.reduce_bucket_numel, Numel(500_000_000));
    assert_eq!(c.zero.prefetch_bucket_numel, Numel(50_000_000));
    assert_eq!(c.zero.param_persistence_threshold_numel, Numel(100_000));
    // DeepSpeed's default, sys.maxsize: no bound.
    assert_eq!(
        c.zero.model_persistence_threshold_numel,
        Numel(i64::MAX as u64)
    );
    let src = l
        .resolved
        .iter()
        .find(|r| r.key == "zero_optimization.reduce_bucket_size")
        .unwrap();
    assert_eq!(src.source, Source::DeepSpeedDefault);
}

#[test]
fn hf_zero2_auto_stage2_cpu_optimizer_offload() {
    let l = load_str(&fixture("hf_zero2_auto.json"), &skip_fs()).unwrap();
    let z = &l.config.zero;
    assert_eq!(z.stage, Stage::Gradients);
    assert_eq!(z.offload_optimizer.device, OffloadDevice::Cpu);
    assert_eq!(z.offload_param.device, OffloadDevice::None);
    assert_eq!(z.reduce_bucket_numel, Numel(200_000_000));
    assert!(l.unknown_keys().is_empty());
    for k in [
        "zero_optimization.allgather_partitions",
        "zero_optimization.allgather_bucket_size",
        "zero_optimization.reduce_scatter",
    ] {
        assert!(
            has_warning(
                &l.warnings,
                |w| matches!(w, ConfigWarning::IgnoredKey { key } if key == k)
            ),
            "{k} not reported as ignored: {:?}",
            l.warnings
        );
    }
}

#[test]
fn accelerate_zero3_offload_needs_steps_for_total_num_steps() {
    let text = fixture("accelerate_zero3_offload.json");
    let err = load_str(&text, &skip_fs()).unwrap_err();
    assert!(
        matches!(&err, ConfigError::AutoUnresolved { key, .. } if key == "scheduler.params.total_num_steps")
    );
    assert!(err.to_string().contains("--steps"), "{err}");

    let run = RunContext {
        total_steps: Some(500),
        learning_rate: Some(2e-4),
        save_16bit_model: Some(true),
        ..skip_fs()
    };
    let l = load_str(&text, &run).unwrap();
    let c = &l.config;
    assert_eq!(
        c.scheduler,
        Scheduler::WarmupDecayLr {
            min_lr: 0.0,
            max_lr: 2e-4,
            warmup_steps: 0,
            warmup_type: WarmupType::Log,
            total_steps: 500
        }
    );
    assert!(matches!(c.precision, Precision::Fp16 { .. }));
    assert!(c.zero.gather_16bit_weights_on_model_save);
    assert_eq!(c.batch.gradient_accumulation_steps, 1);
    assert_eq!(c.optimizer.betas, [0.9, 0.999]); // absent: DeepSpeed default
}

#[test]
fn accelerate_zero3_offload_batch_mismatch_with_the_run_is_reported() {
    // The config fixes gradient_accumulation_steps = 1; the run asks for 4.
    let run = RunContext {
        total_steps: Some(500),
        gradient_accumulation_steps: Some(4),
        ..skip_fs()
    };
    let err = load_str(&fixture("accelerate_zero3_offload.json"), &run).unwrap_err();
    match &err {
        ConfigError::RunMismatch {
            key,
            config_value,
            run_value,
            ..
        } => {
            assert_eq!(key, "gradient_accumulation_steps");
            assert_eq!((config_value.as_str(), run_value.as_str()), ("1", "4"));
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn deepspeed_examples_zero_infinity_nvme() {
    let text = fixture("dse_zero_infinity.json");
    let l = load_str(&text, &skip_fs()).unwrap();
    let c = &l.config;
    assert_eq!(
        (
            c.batch.train_batch_size,
            c.batch.micro_batch_size,
            c.batch.gradient_accumulation_steps
        ),
        (4, 4, 1)
    );
    assert_eq!(
        c.precision,
        Precision::Fp16 {
            loss_scale: LossScale::Static(1024.0)
        }
    );
    assert!(c.wall_clock_breakdown);
    let z = &c.zero;
    assert_eq!(
        z.offload_param.device,
        OffloadDevice::Nvme {
            path: "/nvme_data".into()
        }
    );
    assert_eq!(
        z.offload_optimizer.device,
        OffloadDevice::Nvme {
            path: "/nvme_data".into()
        }
    );
    assert_eq!(z.offload_param.buffer_count, 5);
    assert_eq!(z.offload_param.buffer_numel, Numel(100_000_000));
    assert_eq!(z.offload_param.max_in_cpu_numel, Numel(1));
    assert_eq!(z.sub_group_numel, Numel(100_000_000));
    assert_eq!(z.max_reuse_distance_numel, Numel(100_000_000));
    assert_eq!(z.reduce_bucket_numel, Numel(90_000_000));
    // The typo is not applied: the default threshold stays.
    assert_eq!(z.param_persistence_threshold_numel, Numel(100_000));
    assert_eq!(c.aio.intra_op_parallelism, 2);
    assert_eq!(c.aio.queue_depth, 16);
    assert_eq!(c.tierzero.ring_threads, 2);
    assert_eq!(
        l.unknown_keys(),
        vec!["zero_optimization.stage3_param_persitance_threshold"],
        "{:?}",
        l.warnings
    );
    assert!(has_warning(
        &l.warnings,
        |w| matches!(w, ConfigWarning::UnknownKey { suggestion: Some(s), .. }
        if s == "zero_optimization.stage3_param_persistence_threshold")
    ));
    assert!(has_warning(
        &l.warnings,
        |w| matches!(w, ConfigWarning::Deprecated { key, .. } if key == "aio.thread_count")
    ));
    assert!(has_warning(
        &l.warnings,
        |w| matches!(w, ConfigWarning::IgnoredKey { key } if key == "zero_allow_untested_optimizer")
    ));
    // The same file with filesystem checks on: /nvme_data does not exist here.
    if !std::path::Path::new("/nvme_data").exists() {
        let err = load_str(&text, &RunContext::default()).unwrap_err();
        assert!(
            matches!(&err, ConfigError::NvmePathNotFound { key, .. }
            if key == "zero_optimization.offload_param.nvme_path"),
            "{err:?}"
        );
    }
}

#[test]
fn deepspeed_examples_zero_offload_10b_infers_micro_batch() {
    let text = fixture("dse_zero_offload_10b.json");
    for (ranks, micro) in [(1, 10), (2, 5), (5, 2)] {
        let l = load_str(&text, &RunContext { ranks, ..skip_fs() }).unwrap();
        assert_eq!(l.config.batch.micro_batch_size, micro, "ranks {ranks}");
        assert_eq!(l.config.batch.train_batch_size, 30);
        assert_eq!(l.config.batch.gradient_accumulation_steps, 3);
    }
    let err = load_str(
        &text,
        &RunContext {
            ranks: 4,
            ..skip_fs()
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            ConfigError::BatchIndivisible {
                train_batch_size: 30,
                divisor: 12,
                ..
            }
        ),
        "{err:?}"
    );

    let l = load_str(&text, &skip_fs()).unwrap();
    let c = &l.config;
    assert_eq!(c.zero.stage, Stage::Gradients);
    assert_eq!(c.zero.offload_optimizer.device, OffloadDevice::Cpu);
    assert!(
        !c.zero.overlap_comm,
        "overlap_comm defaults to false below stage 3"
    );
    assert_eq!(c.optimizer.kind, OptimizerKind::Adam);
    assert_eq!(c.optimizer.lr, 0.00015);
    assert!(
        c.optimizer.decoupled_weight_decay,
        "DeepSpeed's adam_w_mode defaults to true"
    );
    assert_eq!(
        c.precision,
        Precision::Fp16 {
            loss_scale: LossScale::Static(4096.0)
        }
    );
    assert!(has_warning(
        &l.warnings,
        |w| matches!(w, ConfigWarning::Deprecated { key, .. } if key == "zero_optimization.cpu_offload")
    ));
    assert!(has_warning(
        &l.warnings,
        |w| matches!(w, ConfigWarning::UnknownKey { key, suggestion: Some(s), .. }
        if key == "zero_optimization.comm_overlap" && s == "zero_optimization.overlap_comm")
    ));
    // Its activation_checkpointing block turns checkpointing on: every
    // block is recomputed, as DeepSpeed's checkpointed Megatron model does.
    assert_eq!(c.tierzero.activations, ActivationBudget::Checkpointing);
    assert!(!has_warning(
        &l.warnings,
        |w| matches!(w, ConfigWarning::IgnoredKey { key } if key == "activation_checkpointing")
    ));
}

#[test]
fn deepspeed_examples_cifar() {
    let text = fixture("dse_cifar.json");
    let l = load_str(&text, &skip_fs()).unwrap();
    let c = &l.config;
    assert_eq!(
        (
            c.batch.train_batch_size,
            c.batch.micro_batch_size,
            c.batch.gradient_accumulation_steps
        ),
        (4, 4, 1)
    );
    assert_eq!(c.optimizer.kind, OptimizerKind::Adam);
    assert_eq!(c.optimizer.betas, [0.8, 0.999]);
    assert_eq!(c.optimizer.weight_decay, 3e-7);
    assert_eq!(
        c.scheduler,
        Scheduler::WarmupLr {
            min_lr: 0.0,
            max_lr: 0.001,
            warmup_steps: 1000,
            warmup_type: WarmupType::Log
        }
    );
    assert_eq!(
        c.precision,
        Precision::Fp16 {
            loss_scale: LossScale::Dynamic {
                initial_scale_power: 15,
                window: 500,
                hysteresis: 2,
                min_scale: 1.0,
                consecutive_hysteresis: false
            }
        }
    );
    assert_eq!(c.zero.offload_optimizer.device, OffloadDevice::Cpu);
    assert!(l.unknown_keys().is_empty(), "{:?}", l.warnings);
    // fp16 master weights: read and said (tierzero keeps fp32 ones).
    assert!(
        has_warning(
            &l.warnings,
            |w| matches!(w, ConfigWarning::Note { key, message }
            if key == "fp16.fp16_master_weights_and_grads" && message.contains("fp32 master weights"))
        ),
        "{:?}",
        l.warnings
    );
    for k in ["prescale_gradients", "zero_optimization.reduce_scatter"] {
        assert!(
            has_warning(
                &l.warnings,
                |w| matches!(w, ConfigWarning::IgnoredKey { key } if key == k)
            ),
            "{k}"
        );
    }
    let l2 = load_str(
        &text,
        &RunContext {
            ranks: 2,
            ..skip_fs()
        },
    )
    .unwrap();
    assert_eq!(l2.config.batch.micro_batch_size, 2);
}

/// The published snippet has a trailing comma before its last `}`. DeepSpeed
/// reads configs with hjson, which accepts it, and so do we: it reads to
/// what the fixed copy reads to, less the micro batch size the copy adds.
#[test]
fn hf_docs_nvme_example_as_published_loads_despite_its_trailing_comma() {
    let text = fixture("hf_docs_nvme_trailing_comma.json");
    assert!(
        serde_json::from_str::<serde_json::Value>(&text).is_err(),
        "the fixture must keep the trailing comma that plain JSON refuses"
    );
    let published = parse_str(&text).unwrap();
    let fixed = parse_str(&fixture("hf_docs_nvme.json")).unwrap();
    let mut expected = fixed.ds.clone();
    expected.train_micro_batch_size_per_gpu = None;
    assert_eq!(published.ds, expected);
    assert_eq!(published.warnings, fixed.warnings);
    assert_eq!(published.unknown_keys(), vec!["zero_optimization.aio"]);
}

#[test]
fn hf_docs_nvme_example_warns_about_nested_aio() {
    let l = load_str(&fixture("hf_docs_nvme.json"), &skip_fs()).unwrap();
    assert_eq!(l.unknown_keys(), vec!["zero_optimization.aio"]);
    assert!(has_warning(
        &l.warnings,
        |w| matches!(w, ConfigWarning::UnknownKey { suggestion: Some(s), .. }
        if s.contains("top-level"))
    ));
    // Not applied: aio keeps its defaults.
    assert_eq!(l.config.aio.block_bytes.0, 1_048_576);
    assert_eq!(
        l.config.zero.offload_param.device,
        OffloadDevice::Nvme {
            path: "/local_nvme".into()
        }
    );
    assert_eq!(l.config.zero.offload_param.buffer_numel, Numel(100_000_000));
}

/// `tierzero.activation_budget_bytes` and DeepSpeed's
/// `activation_checkpointing`: absent both, auto; the block alone,
/// checkpointing (recompute every block); the key, its bytes (with the
/// block too, and a note that the block changes nothing); a wrong type in
/// the block, an error naming the key.
#[test]
fn activation_budget_and_deepspeeds_checkpointing_block() {
    let with = |extra: &str| {
        load_str(
            &format!(r#"{{"train_micro_batch_size_per_gpu": 1 {extra}}}"#),
            &skip_fs(),
        )
    };
    assert_eq!(
        with("").unwrap().config.tierzero.activations,
        ActivationBudget::Auto
    );
    let block = r#", "activation_checkpointing": {"partition_activations": false,
        "cpu_checkpointing": true, "number_checkpoints": 4}"#;
    assert_eq!(
        with(block).unwrap().config.tierzero.activations,
        ActivationBudget::Checkpointing
    );
    let key = r#", "tierzero": {"activation_budget_bytes": "2GiB"}"#;
    assert_eq!(
        with(key).unwrap().config.tierzero.activations,
        ActivationBudget::Bytes(2 << 30)
    );
    let both = with(&format!("{block}{key}")).unwrap();
    assert_eq!(
        both.config.tierzero.activations,
        ActivationBudget::Bytes(2 << 30)
    );
    assert!(has_warning(&both.warnings, |w| matches!(w,
        ConfigWarning::Note { key, .. } if key == "activation_checkpointing")));
    let auto = r#", "tierzero": {"activation_budget_bytes": "auto"}"#;
    assert_eq!(
        with(auto).unwrap().config.tierzero.activations,
        ActivationBudget::Auto
    );
    let bad = with(r#", "activation_checkpointing": {"partition_activations": 3}"#);
    let e = bad.unwrap_err().to_string();
    assert!(
        e.contains("activation_checkpointing.partition_activations"),
        "{e}"
    );
    let unknown = with(r#", "activation_checkpointing": {"partition_activation": true}"#).unwrap();
    assert!(has_warning(&unknown.warnings, |w| matches!(w,
        ConfigWarning::UnknownKey { key, .. } if key == "activation_checkpointing.partition_activation")));
}

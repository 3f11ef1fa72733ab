//! `bf16.check_grad_overflow`: a bf16 step whose gradients are not all
//! finite is skipped, as fp16's overflowing steps are, clipping or not;
//! false applies it. Absent, it is what DeepSpeed does at the stage: its
//! stage 1 and 2 optimizer checks (the key's default, true); its stage 0
//! and stage 3 optimizers never do. A learning rate of 1e30 makes the
//! weights ~1e30 after the first step, so the next forward overflows (two
//! such matmuls pass f32's range) and its gradients are not finite.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: a failed unwrap is a failed test"
)]

mod engine_support;

use engine_support::{corpus, ds_config, scratch, tiny_gpt2_dir, Knobs};
use tierzero::config::{load_str, PathChecks, RunContext};
use tierzero::engine::{Trainer, TrainerOptions};
use tierzero::model::ModelDir;

/// Trains 4 steps of bf16 without clipping (or with, `clip`) at lr 1e30;
/// the summary's skipped steps and weights, and each step's loss.
fn run(check: Option<bool>, stage: u8, optim: &'static str) -> (u64, String, Vec<f32>) {
    run_clipped(check, stage, optim, 0.0)
}

fn run_clipped(
    check: Option<bool>,
    stage: u8,
    optim: &'static str,
    clip: f64,
) -> (u64, String, Vec<f32>) {
    let model = tiny_gpt2_dir("bf16-overflow", 2, 32);
    let k = Knobs {
        stage,
        optim,
        param: if stage == 3 { optim } else { "none" },
        precision: "bf16",
        clip,
        ..Knobs::default()
    };
    let mut cfg = ds_config(&k, &scratch("bf16-overflow-swap"), 4);
    cfg["optimizer"]["params"]["lr"] = serde_json::json!(1e30);
    cfg.as_object_mut().unwrap().remove("scheduler");
    if let Some(c) = check {
        cfg["bf16"]["check_grad_overflow"] = serde_json::json!(c);
    }
    let run = RunContext {
        path_checks: PathChecks::CreateMissing,
        ..RunContext::default()
    };
    let loaded = load_str(&cfg.to_string(), &run).unwrap();
    let checks = check.unwrap_or(matches!(stage, 1 | 2));
    assert_eq!(loaded.config.check_grad_overflow, checks);
    // An explicit true where DeepSpeed does not read it says so.
    let noted = loaded
        .warnings
        .iter()
        .any(|w| w.to_string().contains("does not read this key"));
    assert_eq!(
        noted,
        check == Some(true) && stage != 2,
        "{:?}",
        loaded.warnings
    );
    assert_eq!(loaded.config.waits_for_global_norm(), checks || clip > 0.0);
    let md = ModelDir::open(&model, 3).unwrap();
    let mut t = Trainer::new(&loaded.config, &md, corpus(), TrainerOptions::cpu(3, 16)).unwrap();
    let losses = (0..4).map(|_| t.step().unwrap().metrics.loss).collect();
    let s = t.finish().unwrap();
    (s.skipped_steps, s.weight_sha256, losses)
}

#[test]
fn a_bf16_step_with_non_finite_gradients_is_skipped_as_deepspeed_would() {
    for (stage, optim) in [(0, "none"), (2, "cpu"), (3, "nvme")] {
        let (skipped, checked, losses) = run(Some(true), stage, optim);
        assert!(losses[0].is_finite(), "stage {stage}: {losses:?}");
        // Step 1 moved the weights to ~1e30; every later step overflows
        // and is skipped, so the weights stay where step 1 left them.
        assert_eq!(skipped, 3, "stage {stage}: {losses:?}");
        assert!(losses[1..].iter().all(|l| !l.is_finite()), "{losses:?}");
        let (skipped, applied, losses) = run(Some(false), stage, optim);
        assert_eq!(
            skipped, 0,
            "stage {stage}: applied without the check: {losses:?}"
        );
        assert_ne!(
            applied, checked,
            "stage {stage}: the overflowing steps were applied"
        );
        // Absent: DeepSpeed's stage 2 optimizer checks, its stage 0 and 3
        // ones apply the step.
        let (skipped, default, _) = run(None, stage, optim);
        if stage == 2 {
            assert_eq!((skipped, &default), (3, &checked), "stage {stage}");
        } else {
            assert_eq!((skipped, &default), (0, &applied), "stage {stage}");
        }
        // With clipping the norm is taken anyway: a norm that is not
        // finite skips the step with the check off too (stricter than
        // DeepSpeed, which would clip by it).
        let (skipped, clipped, _) = run_clipped(Some(false), stage, optim, 1.0);
        assert_eq!(skipped, 3, "stage {stage}: clipping");
        assert_ne!(clipped, applied);
    }
}

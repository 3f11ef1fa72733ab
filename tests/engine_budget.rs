//! Start-up checks of the engine: a pinned budget too small for the
//! optimizer pipeline, and a parameter larger than a swap buffer, are
//! errors that name the numbers (never a run-time "out of buffers").
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: a failed unwrap is a failed test"
)]

mod engine_support;

use engine_support::{corpus, ds_config, scratch, tiny_gpt2_dir, Knobs};
use tierzero::config::{load_str, PathChecks, RunContext};
use tierzero::engine::{EngineError, Trainer, TrainerOptions};
use tierzero::model::ModelDir;

fn try_build(k: &Knobs, edit: impl Fn(&mut serde_json::Value)) -> Result<Trainer, EngineError> {
    let dir = tiny_gpt2_dir("budget", 2, 32);
    let swap = scratch("swap");
    let mut cfg = ds_config(k, &swap, 4);
    edit(&mut cfg);
    let run = RunContext {
        path_checks: PathChecks::CreateMissing,
        ..RunContext::default()
    };
    let loaded = load_str(&cfg.to_string(), &run).unwrap();
    let md = ModelDir::open(&dir, 1).unwrap();
    Trainer::new(&loaded.config, &md, corpus(), TrainerOptions::cpu(1, 16))
}

#[test]
fn pinned_budget_too_small_for_the_pipeline_names_the_numbers() {
    // The configured param buffers (4 of 80 KiB: 327,680 bytes, what the
    // config check counts without the layout) fit, and so do the slots the
    // engine cuts them into (8 of 32 KiB, or as few as 4 within the
    // budget); the optimizer's 9 of the largest sub-group (20,000
    // elements: 80 KiB each) do not.
    let k = Knobs {
        pinned_budget: Some(330_000),
        sub_group: 20_000,
        ..Knobs::nvme()
    };
    let err = try_build(&k, |_| {}).unwrap_err();
    match &err {
        EngineError::PinnedBudget {
            optimizer_buffers_needed,
            required_bytes,
            budget_bytes,
            ..
        } => {
            assert_eq!(*optimizer_buffers_needed, 9);
            assert_eq!(*budget_bytes, 330_000);
            assert!(*required_bytes > 330_000);
        }
        other => panic!("expected PinnedBudget, got {other}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("330000")
            && msg.contains("9 buffers")
            && msg.contains("(3 states x 3 stages)"),
        "{msg}"
    );
    // With clipping the final gradients spill to NVMe and are read back
    // with the state: each stage holds 4 buffers, and the message says so
    // (it said "3 states" for 4 buffers a stage).
    let k = Knobs {
        pinned_budget: Some(330_000),
        sub_group: 20_000,
        clip: 1.0,
        ..Knobs::nvme()
    };
    let msg = try_build(&k, |_| {}).unwrap_err().to_string();
    assert!(
        msg.contains("12 buffers")
            && msg.contains("(3 states and the spilled gradient x 3 stages)"),
        "{msg}"
    );
}

#[test]
fn a_budget_that_fits_trains() {
    // 4 param buffers of 20000 x 4 B (80 KiB each, aligned; mapped as 8
    // slots of 32 KiB) + 9 optimizer buffers of the largest sub-group.
    let k = Knobs {
        pinned_budget: Some(8 << 20),
        ..Knobs::nvme()
    };
    let mut t = try_build(&k, |_| {}).unwrap();
    let m = t.step().unwrap().metrics;
    assert!(m.loss.is_finite());
}

#[test]
fn param_larger_than_a_swap_buffer_is_a_startup_error() {
    let err = try_build(&Knobs::nvme(), |c| {
        c["zero_optimization"]["offload_param"]["buffer_size"] = serde_json::json!(1000);
    })
    .unwrap_err();
    // The buffer's elements are the configured 1000 rounded up to whole
    // 4 KiB blocks, and the message says so (it named that count as the
    // `buffer_size`, which the user had not written).
    let msg = err.to_string();
    assert!(
        msg.contains("a param swap buffer holds 1024")
            && msg.contains("rounded up to whole 4 KiB blocks"),
        "{msg}"
    );
    // The largest NVMe param is named, so one raise fits every param (the
    // first too large one was named: a round of raises per param).
    let largest = tiny_gpt2_dir("budget", 2, 32);
    let md = ModelDir::open(&largest, 1).unwrap();
    let most = md.model().params().iter().map(|p| p.numel).max().unwrap() as u64;
    match err {
        EngineError::ParamTooLarge {
            numel,
            buffer_numel,
            ..
        } => {
            assert_eq!(numel, most);
            assert!(buffer_numel >= 1000);
        }
        other => panic!("expected ParamTooLarge, got {other}"),
    }
    // Raised to that, it builds.
    try_build(&Knobs::nvme(), |c| {
        c["zero_optimization"]["offload_param"]["buffer_size"] = serde_json::json!(most);
    })
    .unwrap();
}

/// A model directory without weights is initialised with its own seed;
/// `TrainerOptions::seed`, which the checkpoints record as the init's,
/// must be that one (the manifest named a seed that did not give its
/// weights).
#[test]
fn an_init_seed_other_than_the_options_is_refused() {
    let dir = tiny_gpt2_dir("seeds", 2, 32);
    let swap = scratch("swap-seeds");
    let cfg = ds_config(&Knobs::default(), &swap, 4);
    let run = RunContext {
        path_checks: PathChecks::CreateMissing,
        ..RunContext::default()
    };
    let loaded = load_str(&cfg.to_string(), &run).unwrap();
    let md = ModelDir::open(&dir, 0).unwrap();
    let e = match Trainer::new(&loaded.config, &md, corpus(), TrainerOptions::cpu(42, 16)) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("two seeds accepted"),
    };
    assert!(
        e.contains("initialised with seed 0") && e.contains("TrainerOptions::seed is 42"),
        "{e}"
    );
    assert!(Trainer::new(&loaded.config, &md, corpus(), TrainerOptions::cpu(0, 16)).is_ok());
}

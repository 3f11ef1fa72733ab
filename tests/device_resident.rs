//! Training in device memory (`tierzero::engine::device::ResidentUnits`)
//! on the simulated device: params, gradient sums and AdamW's state stay
//! on the device and the step runs there. The path to compare with is the
//! same units with the host's optimizer (`ReferenceUnits`, the kernels'
//! scalar references in host memory): the sums are the host's additions
//! in the host's order and the AdamW kernel gives the CPU kernel's bits,
//! and the clipping norm is taken in the host's order, so the runs are
//! bit-identical.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod engine_support;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use engine_support::*;
use tierzero::engine::device::sim::{SimConfig, SimDevice, SimProbe};
use tierzero::engine::device::ResidentUnits;
use tierzero::engine::{Trainer, TrainerOptions};
use tierzero::model::exec_units::{ReferenceUnits, UnitCompute};
use tierzero::model::ModelDir;
use tierzero_gpu::unit::GemmDtype;

/// What a run left.
#[derive(Debug)]
struct Out {
    loss_bits: Vec<u32>,
    /// The clipping norm's bits, per step (None: not taken).
    grad_norm_bits: Vec<Option<u64>>,
    sha: String,
    /// Host-to-device bytes per step.
    h2d_bytes: Vec<u64>,
    /// Forwards launched ahead and taken, per step.
    forwards_ahead: Vec<u64>,
    /// Backwards launched ahead and taken, per step.
    backwards_ahead: Vec<u64>,
}

fn drive(mut t: Trainer, steps: u64) -> Out {
    let mut out = Out {
        loss_bits: Vec::new(),
        grad_norm_bits: Vec::new(),
        sha: String::new(),
        h2d_bytes: Vec::new(),
        forwards_ahead: Vec::new(),
        backwards_ahead: Vec::new(),
    };
    for _ in 0..steps {
        let m = t.step().unwrap().metrics;
        out.loss_bits.push(m.loss.to_bits());
        out.grad_norm_bits.push(m.grad_norm.map(f64::to_bits));
        out.h2d_bytes.push(m.h2d_bytes);
        out.forwards_ahead.push(m.device_forwards_ahead);
        out.backwards_ahead.push(m.device_backwards_ahead);
    }
    out.sha = t.finish().unwrap().weight_sha256;
    out
}

fn opts_with(compute: Arc<dyn UnitCompute>) -> TrainerOptions {
    let mut opts = TrainerOptions::cpu(3, 16);
    opts.compute = Some(compute);
    opts
}

fn host_optimizer(model: &Path, k: &Knobs, gemm: GemmDtype, steps: u64) -> Out {
    let t = build_with(
        model,
        k,
        opts_with(Arc::new(ReferenceUnits { gemm })),
        steps,
    );
    drive(t, steps)
}

fn sim(budget_bytes: u64, gemm: GemmDtype) -> SimConfig {
    SimConfig {
        budget_bytes,
        copy_delay: Duration::ZERO,
        h2d_bytes_per_s: None,
        staging_slots: 2,
        gemm,
        fail_upload: None,
        compute_delay: std::time::Duration::ZERO,
    }
}

fn resident_units(model: &Path, k: &Knobs, gemm: GemmDtype) -> (Arc<dyn UnitCompute>, SimProbe) {
    let dev = SimDevice::new(sim(64 << 20, gemm)).unwrap();
    let probe = dev.probe();
    let md = ModelDir::open(model, 3).unwrap();
    let units = ResidentUnits::new(dev, md.model(), k.precision == "bf16").unwrap();
    (Arc::new(units), probe)
}

fn on_device(model: &Path, k: &Knobs, gemm: GemmDtype, steps: u64) -> (Out, SimProbe) {
    let (units, probe) = resident_units(model, k, gemm);
    let t = build_with(model, k, opts_with(units), steps);
    (drive(t, steps), probe)
}

#[test]
fn adam_on_the_device_trains_bit_identical_to_the_host_optimizer() {
    let gpt2 = tiny_gpt2_dir("resident", 2, 32);
    let llama = tiny_llama_dir("resident");
    let knobs = [
        ("stage 0", Knobs::default()),
        (
            "stage 3, 2 micro-batches, params tiled over sub-groups",
            Knobs {
                stage: 3,
                gas: 2,
                sub_group: 1000,
                ..Knobs::default()
            },
        ),
    ];
    for (model, name) in [(&gpt2, "gpt2 (tied embedding)"), (&llama, "llama")] {
        for (what, k) in &knobs {
            let case = format!("{name}, {what}");
            let want = host_optimizer(model, k, GemmDtype::F32, 3);
            let (got, probe) = on_device(model, k, GemmDtype::F32, 3);
            println!(
                "{case}: h2d per step {:?} on the device, {:?} with the host's optimizer",
                got.h2d_bytes, want.h2d_bytes
            );
            assert_eq!(got.loss_bits, want.loss_bits, "{case}: losses");
            assert_eq!(got.sha, want.sha, "{case}: weights");
            // The first step loads the state; after it only the units'
            // inputs cross, far less than a step of params.
            assert!(got.h2d_bytes[0] > got.h2d_bytes[1], "{case}: {got:?}");
            assert_eq!(got.h2d_bytes[1], got.h2d_bytes[2], "{case}: {got:?}");
            // Every block's forward is launched as the unit before it
            // comes down, the head's (forward and backward) as the last
            // block's output comes down, every block's and the embedding's
            // backward as the unit after it comes down, and each is taken
            // by its call: all the params are on the device.
            let blocks = blocks_in(model);
            assert_eq!(got.forwards_ahead, vec![blocks * k.gas; 3], "{case}");
            assert_eq!(got.backwards_ahead, vec![(blocks + 2) * k.gas; 3], "{case}");
            // Every device byte went back when the units were dropped.
            assert_eq!(probe.used_bytes(), 0, "{case}: device bytes left");
        }
    }
}

#[test]
fn bf16_storage_with_adam_on_the_device_is_bit_identical_too() {
    let model = tiny_llama_dir("resident-bf16");
    let k = Knobs {
        precision: "bf16",
        ..Knobs::default()
    };
    let want = host_optimizer(&model, &k, GemmDtype::Bf16, 3);
    let (got, probe) = on_device(&model, &k, GemmDtype::Bf16, 3);
    println!("bf16: h2d per step {:?} on the device", got.h2d_bytes);
    assert_eq!(got.loss_bits, want.loss_bits, "losses");
    assert_eq!(got.sha, want.sha, "weights");
    // The device held bf16 weights (2 bytes an element) beside fp32
    // masters and moments (12), and got every byte back: the weights
    // rewritten each step stayed the buffers it counted.
    let md = ModelDir::open(&model, 3).unwrap();
    let numel: u64 = md.model().params().iter().map(|p| p.numel as u64).sum();
    assert_eq!(probe.peak_bytes(), 14 * numel);
    assert_eq!(probe.used_bytes(), 0);
}

/// Clipping on the device's Σg² steps as the host's: the norm is taken
/// in the host optimizer's order over the same sub-groups (one group of
/// the whole model, whose parts of 8192 elements cross params; groups of
/// 1000 elements, which tile params), so the runs are the same bits.
#[test]
fn clipping_on_the_device_norm_is_the_hosts_bits() {
    let model = tiny_gpt2_dir("resident-clip", 2, 32);
    for sub_group in [1_000_000, 1000] {
        // A max norm the first steps exceed: every step clips.
        let k = Knobs {
            clip: 0.05,
            sub_group,
            ..Knobs::default()
        };
        let want = host_optimizer(&model, &k, GemmDtype::F32, 4);
        let (got, _) = on_device(&model, &k, GemmDtype::F32, 4);
        // The norm itself, in f64 (its f32 multiplier would hide a last
        // bit).
        assert!(want.grad_norm_bits.iter().all(Option::is_some));
        assert_eq!(
            got.grad_norm_bits, want.grad_norm_bits,
            "sub-groups of {sub_group}"
        );
        assert_eq!(got.loss_bits, want.loss_bits, "sub-groups of {sub_group}");
        assert_eq!(got.sha, want.sha, "sub-groups of {sub_group}");
    }
}

#[test]
fn a_checkpoint_of_device_state_resumes_to_the_same_bits() {
    let model = tiny_gpt2_dir("resident-ckpt", 2, 32);
    let k = Knobs {
        stage: 3,
        sub_group: 1000,
        ..Knobs::default()
    };
    let (straight, _) = on_device(&model, &k, GemmDtype::F32, 4);

    let (first_units, _) = resident_units(&model, &k, GemmDtype::F32);
    let mut t = build_with(&model, &k, opts_with(first_units.clone()), 4);
    let mut losses = Vec::new();
    for _ in 0..2 {
        losses.push(t.step().unwrap().metrics.loss.to_bits());
    }
    let dir = scratch("resident-ckpt-save");
    let saved = t.save_checkpoint(&dir).unwrap();
    // The trainer goes on after a save, on the device's state.
    let after_save = t.step().unwrap().metrics.loss.to_bits();
    assert_eq!(after_save, straight.loss_bits[2], "the step after a save");
    drop(t);

    let swap = scratch("swap");
    let cfg = ds_config(&k, &swap, 4);
    let run = tierzero::config::RunContext {
        path_checks: tierzero::config::PathChecks::CreateMissing,
        ..tierzero::config::RunContext::default()
    };
    let loaded = tierzero::config::load_str(&cfg.to_string(), &run).unwrap();
    let c = tierzero::checkpoint::Checkpoint::open(&saved).unwrap();
    let (units, _) = resident_units(&model, &k, GemmDtype::F32);
    let resumed = Trainer::resume(&loaded.config, &c, corpus(), opts_with(units)).unwrap();
    let rest = drive(resumed, 2);
    let mut again = losses.clone();
    losses.extend(rest.loss_bits);
    assert_eq!(losses, straight.loss_bits, "losses");
    assert_eq!(rest.sha, straight.sha, "weights");

    // Resumed on the compute the first trainer used, which holds that
    // trainer's state of a step past the checkpoint: the checkpoint's is
    // loaded over it.
    let resumed = Trainer::resume(&loaded.config, &c, corpus(), opts_with(first_units)).unwrap();
    let rest = drive(resumed, 2);
    again.extend(rest.loss_bits);
    assert_eq!(
        again, straight.loss_bits,
        "losses resumed on the same compute"
    );
    assert_eq!(
        rest.sha, straight.sha,
        "weights resumed on the same compute"
    );
}

#[test]
fn a_model_whose_state_does_not_fit_the_device_is_refused_with_the_numbers() {
    let model = tiny_gpt2_dir("resident-big", 2, 32);
    let md = ModelDir::open(&model, 3).unwrap();
    let m = md.model();
    let dev = SimDevice::new(sim(100_000, GemmDtype::F32)).unwrap();
    let err = ResidentUnits::new(dev, m, false).unwrap_err().to_string();
    assert!(err.contains("offload_optimizer"), "{err}");
    assert!(err.contains("are left after start-up"), "{err}");
    assert!(
        err.contains("tierzero.device_budget_bytes by at least "),
        "{err}"
    );

    // The plan's rows are the state the check counted.
    let numel: u64 = m.params().iter().map(|p| p.numel as u64).sum();
    // A row's device bytes in the plan of the units in `bf16` or not.
    let rows = |gemm, bf16| {
        let dev = SimDevice::new(sim(64 << 20, gemm)).unwrap();
        let plan = ResidentUnits::new(dev, m, bf16)
            .unwrap()
            .memory_plan(m)
            .unwrap();
        move |what: &str| {
            plan.rows
                .iter()
                .find(|r| r.what.starts_with(what))
                .unwrap_or_else(|| panic!("no {what} row in {plan:?}"))
                .device_bytes
        }
    };
    let row = rows(GemmDtype::F32, false);
    assert_eq!(row("params"), 4 * numel);
    assert_eq!(row("Adam moments"), 8 * numel);
    assert!(row("gradients") >= 4 * numel);

    // In bf16 the weights are bf16 on the device, beside fp32 masters.
    let row = rows(GemmDtype::Bf16, true);
    assert_eq!(row("params"), 2 * numel);
    assert_eq!(row("fp32 master"), 4 * numel);
    assert_eq!(row("Adam moments"), 8 * numel);
}

/// `Trainer::weight_sha256` between steps, with Adam's state on the
/// device: the device's state is written back first, so the hash is the
/// one the run ends with, not the host's stale copy (the one-rank hash
/// reads the masters in place on the optimizer thread).
#[test]
fn the_weights_hash_between_steps_reads_the_device_s_state() {
    let gpt2 = tiny_gpt2_dir("resident-hash", 2, 32);
    let k = Knobs::default();
    let (units, _) = resident_units(&gpt2, &k, GemmDtype::F32);
    let mut t = build_with(&gpt2, &k, opts_with(units), 3);
    let before = t.weight_sha256().unwrap();
    // Three steps: the warmup's first two run at lr 0, as in DeepSpeed.
    for _ in 0..3 {
        t.step().unwrap();
    }
    let between = t.weight_sha256().unwrap();
    assert_ne!(between, before, "three steps changed no weight");
    t.step().unwrap();
    let after = t.weight_sha256().unwrap();
    assert_ne!(after, between);
    assert_eq!(t.finish().unwrap().weight_sha256, after);
}

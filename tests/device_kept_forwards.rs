//! Blocks' forwards kept on the device from their forward to their
//! backward (`keep_forwards`, `tierzero.activation_budget_bytes` on a
//! compute device; "Kept forwards" in `tierzero::engine::device`), on the
//! simulated device. A kept block's backward runs from its forward's
//! intermediates instead of computing them again: the same operations on
//! the same values, so the run keeps the recompute's bits, and the
//! block's input does not cross to the device a second time.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod engine_support;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use engine_support::*;
use tierzero::config::ActivationBudget;
use tierzero::engine::device::sim::{SimConfig, SimDevice};
use tierzero::engine::device::{ResidentUnits, TierLimits, TieredUnits};
use tierzero::engine::{Trainer, TrainerOptions};
use tierzero::model::exec_units::UnitCompute;
use tierzero::model::ModelDir;
use tierzero_gpu::unit::GemmDtype;

/// Blocks in the test models.
const BLOCKS: u64 = 2;
/// Elements of a block's hidden input per micro-batch: micro 2 × seq 16
/// × hidden 32.
const HIDDEN_NUMEL: u64 = 2 * 16 * 32;

/// What a run left, per step.
#[derive(Debug, PartialEq)]
struct Out {
    loss_bits: Vec<u32>,
    sha: String,
    h2d_bytes: Vec<u64>,
    kept: Vec<u64>,
    recomputed: Vec<u64>,
}

fn drive(mut t: Trainer, steps: u64) -> Out {
    let mut out = Out {
        loss_bits: Vec::new(),
        sha: String::new(),
        h2d_bytes: Vec::new(),
        kept: Vec::new(),
        recomputed: Vec::new(),
    };
    for _ in 0..steps {
        let m = t.step().unwrap().metrics;
        out.loss_bits.push(m.loss.to_bits());
        out.h2d_bytes.push(m.h2d_bytes);
        out.kept.push(m.device_forwards_kept);
        out.recomputed.push(m.device_forwards_recomputed);
    }
    out.sha = t.finish().unwrap().weight_sha256;
    out
}

fn sim(gemm: GemmDtype) -> SimDevice {
    SimDevice::new(SimConfig {
        budget_bytes: 64 << 20,
        copy_delay: Duration::ZERO,
        h2d_bytes_per_s: None,
        staging_slots: 2,
        gemm,
        fail_upload: None,
        compute_delay: std::time::Duration::ZERO,
    })
    .unwrap()
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Compute {
    /// `ResidentUnits`: Adam on the device.
    Resident,
    /// `TieredUnits`: the host's optimizer.
    Tiered,
}

/// A run on `compute` keeping forwards within `budget` (None: recompute,
/// as built); also the most bytes the kept forwards held.
fn train(
    model: &Path,
    k: &Knobs,
    compute: Compute,
    budget: Option<ActivationBudget>,
    steps: u64,
) -> (Out, u64) {
    let gemm = if k.precision == "bf16" {
        GemmDtype::Bf16
    } else {
        GemmDtype::F32
    };
    let md = ModelDir::open(model, 3).unwrap();
    let (units, peak): (Arc<dyn UnitCompute>, Box<dyn Fn() -> u64>) = match compute {
        Compute::Resident => {
            let mut u = ResidentUnits::new(sim(gemm), md.model(), k.precision == "bf16").unwrap();
            if let Some(b) = budget {
                u = u.keep_forwards(b).unwrap();
            }
            let u = Arc::new(u);
            let p = u.clone();
            (u, Box::new(move || p.forward_peak_bytes()))
        }
        Compute::Tiered => {
            let limits = TierLimits {
                prefetch_numel: u64::MAX,
                max_live_numel: u64::MAX,
                cache_bytes: 0,
            };
            let mut u = TieredUnits::new(sim(gemm), limits).unwrap();
            if let Some(b) = budget {
                u = u.keep_forwards(b).unwrap();
            }
            let u = Arc::new(u);
            let p = u.clone();
            (u, Box::new(move || p.forward_peak_bytes()))
        }
    };
    let mut opts = TrainerOptions::cpu(3, 16);
    opts.compute = Some(units);
    let t = build_with(model, k, opts, steps);
    let out = drive(t, steps);
    (out, peak())
}

#[test]
fn kept_forwards_train_to_the_recompute_s_bits_and_skip_the_inputs_second_upload() {
    let gpt2 = tiny_gpt2_dir("kept-fwd", 2, 32);
    let llama = tiny_llama_dir("kept-fwd");
    let knobs = [
        ("stage 0", Knobs::default()),
        (
            "stage 3, 2 micro-batches",
            Knobs {
                stage: 3,
                gas: 2,
                sub_group: 1000,
                ..Knobs::default()
            },
        ),
    ];
    for (model, name) in [(&gpt2, "gpt2"), (&llama, "llama")] {
        for compute in [Compute::Resident, Compute::Tiered] {
            for (what, k) in &knobs {
                let case = format!("{name}, {compute:?}, {what}");
                let (re, _) = train(model, k, compute, None, 3);
                let (kept, peak) =
                    train(model, k, compute, Some(ActivationBudget::Bytes(1 << 30)), 3);
                println!(
                    "{case}: h2d per step {:?} kept, {:?} recomputed; kept forwards held at most {peak} B",
                    kept.h2d_bytes, re.h2d_bytes
                );
                assert_eq!(kept.loss_bits, re.loss_bits, "{case}: losses");
                assert_eq!(kept.sha, re.sha, "{case}: weights");
                let per_step = BLOCKS * k.gas;
                assert!(kept.kept.iter().all(|&n| n == per_step), "{case}: {kept:?}");
                assert!(kept.recomputed.iter().all(|&n| n == 0), "{case}: {kept:?}");
                assert!(re.kept.iter().all(|&n| n == 0), "{case}: {re:?}");
                assert!(
                    re.recomputed.iter().all(|&n| n == per_step),
                    "{case}: {re:?}"
                );
                // Every block's input crossed once, not twice.
                for (a, b) in re.h2d_bytes.iter().zip(&kept.h2d_bytes) {
                    assert_eq!(a - b, per_step * HIDDEN_NUMEL * 4, "{case}");
                }
                assert!(peak > 0);
                // With Adam on the device and every forward kept, nothing
                // crosses after the first step's load (the rotary tables
                // stay on the device).
                if compute == Compute::Resident {
                    assert!(
                        kept.h2d_bytes[1..].iter().all(|&b| b == 0),
                        "{case}: {kept:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn a_budget_of_one_block_keeps_the_first_and_recomputes_the_next() {
    let model = tiny_gpt2_dir("kept-fwd-one", 2, 32);
    let k = Knobs {
        gas: 2,
        ..Knobs::default()
    };
    let (all, all_peak) = train(
        &model,
        &k,
        Compute::Resident,
        Some(ActivationBudget::Bytes(1 << 30)),
        2,
    );
    // Both blocks were held at once: one block's forward is half.
    let one = all_peak / BLOCKS;
    let (some, peak) = train(
        &model,
        &k,
        Compute::Resident,
        Some(ActivationBudget::Bytes(one)),
        2,
    );
    assert_eq!(peak, one, "the budget held one block");
    assert_eq!(some.kept, vec![k.gas; 2], "{some:?}");
    assert_eq!(some.recomputed, vec![k.gas; 2], "{some:?}");
    assert_eq!(some.loss_bits, all.loss_bits);
    assert_eq!(some.sha, all.sha);
    // Checkpointing keeps none.
    let (none, peak) = train(
        &model,
        &k,
        Compute::Resident,
        Some(ActivationBudget::Checkpointing),
        2,
    );
    assert_eq!((none.kept, peak), (vec![0; 2], 0));
    assert_eq!(none.sha, all.sha);
}

#[test]
fn bf16_kept_forwards_keep_the_bits_and_skip_the_narrow_inputs() {
    let model = tiny_llama_dir("kept-fwd-bf16");
    let k = Knobs {
        precision: "bf16",
        ..Knobs::default()
    };
    let (re, _) = train(&model, &k, Compute::Resident, None, 3);
    let (kept, _) = train(
        &model,
        &k,
        Compute::Resident,
        Some(ActivationBudget::Auto),
        3,
    );
    assert_eq!(kept.loss_bits, re.loss_bits);
    assert_eq!(kept.sha, re.sha);
    assert!(kept.kept.iter().all(|&n| n == BLOCKS), "{kept:?}");
    // bf16 inputs cross as 2-byte elements.
    for (a, b) in re.h2d_bytes.iter().zip(&kept.h2d_bytes) {
        assert_eq!(a - b, BLOCKS * HIDDEN_NUMEL * 2);
    }
}

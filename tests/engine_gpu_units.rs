//! The engine training on another executor's units
//! (`TrainerOptions::compute`): the CUDA units' code on the kernels'
//! scalar references (`ReferenceUnits`), against candle's units, through
//! the whole engine (tiers, optimizer, schedule, clipping, accumulation).
//! A GPU runs the same units through `CudaUnits` (`--device cuda`; the
//! device check compares it with the CPU).
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod engine_support;

use std::sync::Arc;

use engine_support::*;
use tierzero::engine::TrainerOptions;
use tierzero::model::exec_units::ReferenceUnits;
use tierzero_gpu::unit::GemmDtype;

fn losses(model: &std::path::Path, k: &Knobs, gemm: Option<GemmDtype>, steps: u64) -> Vec<f32> {
    let mut opts = TrainerOptions::cpu(3, 16);
    opts.compute = gemm.map(|g| Arc::new(ReferenceUnits { gemm: g }) as _);
    let mut t = build_with(model, k, opts, steps);
    let out = (0..steps).map(|_| t.step().unwrap().metrics.loss).collect();
    t.finish().unwrap();
    out
}

fn worst(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| ((x - y) / y).abs() as f64)
        .fold(0.0, f64::max)
}

#[test]
fn the_cuda_units_reference_trains_as_candle_through_the_engine() {
    let gpt2 = tiny_gpt2_dir("exec", 2, 32);
    let llama = tiny_llama_dir("exec");
    let knobs = [
        ("stage 0", Knobs::default()),
        (
            "stage 3 nvme, clipping, 2 micro-batches",
            Knobs {
                clip: 0.5,
                gas: 2,
                ..Knobs::nvme()
            },
        ),
    ];
    for (model, name) in [(&gpt2, "gpt2"), (&llama, "llama")] {
        for (what, k) in &knobs {
            let want = losses(model, k, None, 6);
            let got = losses(model, k, Some(GemmDtype::F32), 6);
            let e = worst(&got, &want);
            println!("{name}, {what}: losses {got:?}, worst relative difference {e:.2e}");
            assert!(e < 1e-5, "{name}, {what}: {got:?} vs {want:?}");
            assert!(got[5] < got[0], "{name}, {what}: no learning: {got:?}");
        }
        // bf16 GEMM operands: close to fp32, not equal.
        let f = losses(model, &Knobs::default(), Some(GemmDtype::F32), 4);
        let b = losses(model, &Knobs::default(), Some(GemmDtype::Bf16), 4);
        let e = worst(&b, &f);
        println!("{name}, bf16 GEMMs: losses {b:?}, worst relative difference to fp32 {e:.2e}");
        assert!(
            e < 2e-2 && e > 0.0,
            "{name}: bf16 GEMMs {b:?} vs fp32 {f:?}"
        );
    }
}

/// bf16 params (`bf16.enabled`): the units take them widened, compute
/// with bf16 GEMM operands and fp32 elsewhere, and hand back bf16 hidden
/// states and gradients. Within 1e-3 of candle's bf16 units (which also round
/// linear outputs and attention probabilities), learning, and not the
/// fp32 run.
#[test]
fn bf16_params_train_on_the_units_close_to_candle_bf16() {
    let gpt2 = tiny_gpt2_dir("exec-bf16", 2, 32);
    let llama = tiny_llama_dir("exec-bf16");
    for (model, name) in [(&gpt2, "gpt2"), (&llama, "llama")] {
        for (what, k) in [
            (
                "stage 0",
                Knobs {
                    precision: "bf16",
                    ..Knobs::default()
                },
            ),
            (
                "stage 3 nvme, clipping, 2 micro-batches",
                Knobs {
                    precision: "bf16",
                    clip: 0.5,
                    gas: 2,
                    ..Knobs::nvme()
                },
            ),
        ] {
            let want = losses(model, &k, None, 6);
            let got = losses(model, &k, Some(GemmDtype::Bf16), 6);
            let fp32 = losses(
                model,
                &Knobs {
                    precision: "fp32",
                    ..k.clone()
                },
                Some(GemmDtype::Bf16),
                6,
            );
            let e = worst(&got, &want);
            println!("{name}, {what}, bf16: losses {got:?}, candle bf16 {want:?}, worst {e:.2e}");
            assert!(e < 1e-3, "{name}, {what}: {got:?} vs {want:?}");
            assert!(got[5] < got[0], "{name}, {what}: no learning: {got:?}");
            assert_ne!(got, fp32, "{name}, {what}: bf16 storage changed nothing");
        }
    }
}

/// fp16 params (`fp16.enabled`): the units take them widened, compute
/// with fp16 GEMM operands, and hand back fp16 hidden states and
/// gradients, the head's gradient at the loss scale. A scale that
/// overflows fp16 (`initial_scale_power` 18 on these small models: two steps) makes
/// the same steps skip as with candle's fp16 units, and the losses stay
/// within 1e-3 of theirs.
#[test]
fn fp16_params_train_on_the_units_close_to_candle_fp16_and_skip_the_same_steps() {
    let gpt2 = tiny_gpt2_dir("exec-fp16", 2, 32);
    let llama = tiny_llama_dir("exec-fp16");
    let run = |model: &std::path::Path, k: &Knobs, gemm: Option<GemmDtype>| {
        let mut opts = TrainerOptions::cpu(3, 16);
        opts.compute = gemm.map(|g| Arc::new(ReferenceUnits { gemm: g }) as _);
        let mut t = build_with(model, k, opts, 8);
        let out: Vec<(f32, bool, f64)> = (0..8)
            .map(|_| {
                let m = t.step().unwrap().metrics;
                (m.loss, m.skipped, m.loss_scale)
            })
            .collect();
        t.finish().unwrap();
        out
    };
    for (model, name) in [(&gpt2, "gpt2"), (&llama, "llama")] {
        for (what, k) in [
            (
                "stage 0",
                Knobs {
                    precision: "fp16",
                    initial_scale_power: 18,
                    ..Knobs::default()
                },
            ),
            (
                "stage 3 nvme, clipping, 2 micro-batches",
                Knobs {
                    precision: "fp16",
                    initial_scale_power: 18,
                    clip: 0.5,
                    gas: 2,
                    ..Knobs::nvme()
                },
            ),
        ] {
            let want = run(model, &k, None);
            let got = run(model, &k, Some(GemmDtype::F16));
            println!("{name}, {what}, fp16: (loss, skipped, scale) {got:?}, candle {want:?}");
            let skips = |v: &[(f32, bool, f64)]| v.iter().map(|s| (s.1, s.2)).collect::<Vec<_>>();
            assert_eq!(
                skips(&got),
                skips(&want),
                "{name}, {what}: skips and scales"
            );
            assert!(
                got.iter().any(|s| s.1),
                "{name}, {what}: no step overflowed"
            );
            assert!(
                got.iter().any(|s| !s.1),
                "{name}, {what}: every step overflowed"
            );
            let l = |v: &[(f32, bool, f64)]| v.iter().map(|s| s.0).collect::<Vec<_>>();
            let e = worst(&l(&got), &l(&want));
            assert!(e < 1e-3, "{name}, {what}: worst {e:.2e}");
            assert!(got[7].0 < got[0].0, "{name}, {what}: no learning: {got:?}");
        }
    }
}

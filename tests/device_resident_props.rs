//! Property test of training in device memory
//! (`tierzero::engine::device::ResidentUnits`, Adam and the clipping norm
//! on the device) on the simulated device: for any stage, sub-group size
//! (groups that tile params, parts of the norm that cross them),
//! accumulation, clipping and storage precision, the run has the host
//! optimizer's bits: the same losses, the same clipping norm to the last
//! bit of its f64 (taken when clipping is on: a quarter of the draws have
//! none, and no norm), the same weights, and every device byte back.
//! `tests/device_resident.rs` has the chosen cases and their reasons.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod engine_support;

use std::sync::Arc;

use engine_support::*;
use proptest::prelude::*;
use tierzero::engine::device::sim::{SimConfig, SimDevice};
use tierzero::engine::device::ResidentUnits;
use tierzero::engine::{Trainer, TrainerOptions};
use tierzero::model::exec_units::{ReferenceUnits, UnitCompute};
use tierzero::model::ModelDir;

const STEPS: u64 = 3;

/// Each step's loss and clipping norm (their bits), and `weight_sha256`.
type Trained = (Vec<(u32, Option<u64>)>, String);

fn drive(mut t: Trainer) -> Trained {
    let steps = (0..STEPS)
        .map(|_| {
            let m = t.step().unwrap().metrics;
            (m.loss.to_bits(), m.grad_norm.map(f64::to_bits))
        })
        .collect();
    (steps, t.finish().unwrap().weight_sha256)
}

fn opts_with(compute: Arc<dyn UnitCompute>) -> TrainerOptions {
    let mut opts = TrainerOptions::cpu(3, 16);
    opts.compute = Some(compute);
    opts
}

fn knobs() -> impl Strategy<Value = (TinyArch, Knobs)> {
    (
        prop_oneof![Just(TinyArch::Gpt2), Just(TinyArch::Llama)],
        prop_oneof![Just("fp32"), Just("bf16")],
        0u8..=3,
        1u64..=3,
        prop_oneof![Just(0.0), Just(0.05), Just(0.5), Just(100.0)],
        prop_oneof![100u64..3_000, 3_000u64..40_000, Just(1_000_000)],
    )
        .prop_map(|(arch, precision, stage, gas, clip, sub_group)| {
            (
                arch,
                Knobs {
                    stage,
                    precision,
                    gas,
                    clip,
                    sub_group,
                    ..Knobs::default()
                },
            )
        })
}

proptest! {
    #![proptest_config(props_config(24))]

    #[test]
    fn adam_and_the_norm_on_the_device_have_the_host_s_bits(draw in knobs()) {
        let (arch, k) = draw;
        let model = arch.model();
        let host = drive(build_with(
            &model,
            &k,
            opts_with(Arc::new(ReferenceUnits {
                gemm: k.gemm_dtype(),
            })),
            STEPS,
        ));
        let dev = SimDevice::new(SimConfig {
            gemm: k.gemm_dtype(),
            ..SimConfig::instant(64 << 20, 2)
        })
        .unwrap();
        let probe = dev.probe();
        let md = ModelDir::open(&model, 3).unwrap();
        let units = ResidentUnits::new(dev, md.model(), k.precision == "bf16").unwrap();
        // The trainer steps on the device exactly when its compute holds
        // an optimizer (`Trainer::device_compute`): else this would
        // compare the host with itself.
        prop_assert!(units.device_optimizer().is_some());
        let on_device = drive(build_with(&model, &k, opts_with(Arc::new(units)), STEPS));
        prop_assert_eq!(&on_device.0, &host.0, "losses and norms");
        prop_assert_eq!(&on_device.1, &host.1, "weights");
        prop_assert_eq!(sim_leftovers(&probe), None);
    }
}

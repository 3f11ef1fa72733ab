//! Property test of the offload engine on the CPU: any ZeRO-3 offload the
//! DeepSpeed config can ask for (params and optimizer state on cpu or
//! nvme; prefetch bucket, live params, persistence threshold, sub-group
//! size, the param swap buffers' count and size, `max_in_cpu`, pipelined
//! and overlapped or not, resident optimizer groups, speculation, a
//! pinned budget, kept activations), with any accumulation, clipping and
//! precision (fp16's skipped steps included), trains the bits of stage 0
//! with everything in memory, or refuses at build with the numbers and
//! the fix (in 800 draws here: 16 refusals, each a pinned budget under
//! 700 KB, the rest the same bits).
//! The same holds across a checkpoint: saved after any step and resumed
//! under any other offload, the run keeps stage 0's bits.
//! "Offload must not change a bit", drawn instead of chosen:
//! `tests/engine_equivalence.rs` has the chosen cases and their reasons.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod engine_support;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use engine_support::*;
use proptest::prelude::*;
use tierzero::config::{load_str, PathChecks, RunContext};
use tierzero::engine::{Trainer, TrainerOptions};
use tierzero::model::ModelDir;

const STEPS: u64 = 3;

/// A run's losses (their bits) and `weight_sha256`.
type Trained = (Vec<u32>, String);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Arch {
    /// GPT-2 with its head tied to the token table (8 192 elements, the
    /// largest param).
    Gpt2,
    /// Llama (untied, GQA).
    Llama,
}

impl Arch {
    fn model(self) -> PathBuf {
        static DIRS: OnceLock<Mutex<HashMap<Arch, PathBuf>>> = OnceLock::new();
        let dirs = DIRS.get_or_init(Default::default);
        dirs.lock()
            .unwrap()
            .entry(self)
            .or_insert_with(|| match self {
                Arch::Gpt2 => tiny_gpt2_dir("engine-props", 2, 32),
                Arch::Llama => tiny_llama_dir("engine-props"),
            })
            .clone()
    }
}

/// Builds a trainer, or says why not.
fn try_build(model: &Path, k: &Knobs) -> Result<Trainer, String> {
    let swap = scratch("props-swap");
    let cfg = ds_config(k, &swap, STEPS);
    let run = RunContext {
        path_checks: PathChecks::CreateMissing,
        ..RunContext::default()
    };
    let loaded = load_str(&cfg.to_string(), &run).map_err(|e| e.to_string())?;
    let md = ModelDir::open(model, 5).unwrap();
    Trainer::new(&loaded.config, &md, corpus(), TrainerOptions::cpu(5, 16))
        .map_err(|e| e.to_string())
}

/// A trainer resumed from the checkpoint at `ckpt` with `k`.
fn try_resume(ckpt: &Path, k: &Knobs) -> Result<Trainer, String> {
    let swap = scratch("props-swap");
    let cfg = ds_config(k, &swap, STEPS);
    let run = RunContext {
        path_checks: PathChecks::CreateMissing,
        ..RunContext::default()
    };
    let loaded = load_str(&cfg.to_string(), &run).map_err(|e| e.to_string())?;
    let c = tierzero::checkpoint::Checkpoint::open(ckpt).map_err(|e| e.to_string())?;
    Trainer::resume(&loaded.config, &c, corpus(), TrainerOptions::cpu(5, 16))
        .map_err(|e| e.to_string())
}

/// The same arithmetic as `k` (precision, accumulation, clipping, loss
/// scale) with `other`'s offload.
fn same_math(k: &Knobs, other: Knobs) -> Knobs {
    Knobs {
        precision: k.precision,
        gas: k.gas,
        clip: k.clip,
        initial_scale_power: k.initial_scale_power,
        ..other
    }
}

fn train_all(mut t: Trainer) -> Trained {
    let losses = (0..STEPS)
        .map(|_| t.step().unwrap().metrics.loss.to_bits())
        .collect();
    (losses, t.finish().unwrap().weight_sha256)
}

/// Stage 0, nothing offloaded, with the same math.
fn reference(arch: Arch, k: &Knobs) -> Trained {
    type Key = (Arch, &'static str, u64, u64, u32);
    static REFS: OnceLock<Mutex<HashMap<Key, Trained>>> = OnceLock::new();
    let key = (
        arch,
        k.precision,
        k.gas,
        k.clip.to_bits(),
        k.initial_scale_power,
    );
    let refs = REFS.get_or_init(Default::default);
    if let Some(r) = refs.lock().unwrap().get(&key) {
        return r.clone();
    }
    let base = Knobs {
        precision: k.precision,
        gas: k.gas,
        clip: k.clip,
        initial_scale_power: k.initial_scale_power,
        ..Knobs::default()
    };
    let r = train_all(try_build(&arch.model(), &base).unwrap());
    refs.lock().unwrap().insert(key, r.clone());
    r
}

fn device() -> impl Strategy<Value = &'static str> {
    prop_oneof![Just("cpu"), Just("nvme")]
}

fn draw() -> impl Strategy<Value = (Arch, Knobs)> {
    (
        (
            prop_oneof![Just(Arch::Gpt2), Just(Arch::Llama)],
            prop_oneof![Just("fp32"), Just("bf16"), Just("fp16")],
            1u64..=3,
            prop_oneof![Just(0.0), Just(0.5)],
        ),
        (device(), device(), any::<bool>(), any::<bool>()),
        (
            500u64..20_000,
            prop_oneof![Just(0u64), 1u64..2_000, Just(100_000)],
            1_000u64..40_000,
            10_000u64..80_000,
        ),
        (
            8_192u64..40_000,
            2u64..=6,
            prop_oneof![Just(0u64), 1u64..30_000, Just(1_000_000_000)],
        ),
        (
            prop_oneof![Just(None), (0u64..200_000).prop_map(Some)],
            prop_oneof![Just(None), any::<bool>().prop_map(Some)],
            8u32..=20,
            prop_oneof![
                Just(None),
                (256u64 << 10..4 << 20).prop_map(Some),
                (4u64 << 20..64 << 20).prop_map(Some),
            ],
            prop_oneof![Just(None), (0u64..4 << 20).prop_map(Some)],
            prop_oneof![Just(None), any::<bool>().prop_map(Some)],
        ),
    )
        .prop_map(
            |(
                (arch, precision, gas, clip),
                (param, optim, overlap, pipeline),
                (sub_group, persistence, prefetch_bucket, max_live),
                (param_buffer_numel, param_buffer_count, max_in_cpu),
                (
                    optimizer_resident_bytes,
                    speculative,
                    initial_scale_power,
                    pinned_budget,
                    activation_budget,
                    pin_threads,
                ),
            )| {
                (
                    arch,
                    Knobs {
                        stage: 3,
                        param,
                        optim,
                        gas,
                        precision,
                        clip,
                        overlap,
                        pipeline,
                        sub_group,
                        persistence,
                        prefetch_bucket,
                        max_live,
                        param_buffer_numel,
                        param_buffer_count,
                        max_in_cpu,
                        optimizer_resident_bytes,
                        speculative,
                        initial_scale_power,
                        pinned_budget,
                        activation_budget,
                        pin_threads,
                        ..Knobs::default()
                    },
                )
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 128,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Any offload of params and optimizer state: stage 0's bits, or a
    /// refusal at build that names the numbers.
    #[test]
    fn any_offload_trains_the_in_memory_bits(draw in draw()) {
        let (arch, k) = draw;
        match try_build(&arch.model(), &k) {
            Ok(t) => {
                let got = train_all(t);
                let want = reference(arch, &k);
                prop_assert_eq!(&got.0, &want.0, "losses");
                prop_assert_eq!(&got.1, &want.1, "weights");
            }
            Err(e) => {
                // Refusals name the numbers and what to change.
                prop_assert!(e.chars().any(|c| c.is_ascii_digit()), "a refusal without numbers: {}", e);
                prop_assert!(e.contains("raise") || e.contains("lower"), "a refusal without its fix: {}", e);
            }
        }
    }

    /// Any offload, saved after any step and resumed under any other
    /// offload (tiers, sub-groups, windows, buffers): stage 0's bits over
    /// the whole run (the optimizer state, the loss scaler and the data
    /// position round-trip; the checkpoint is read by param).
    #[test]
    fn any_offload_resumed_under_any_other_trains_the_in_memory_bits(
        first in draw(),
        second in draw(),
        split in 1..STEPS,
    ) {
        let (arch, k) = first;
        let k2 = same_math(&k, second.1);
        let Ok(mut t) = try_build(&arch.model(), &k) else {
            // Refused at build: the property above checks the refusals.
            return Ok(());
        };
        let mut losses = Vec::new();
        for _ in 0..split {
            losses.push(t.step().unwrap().metrics.loss.to_bits());
        }
        let save = scratch("props-save");
        t.save_checkpoint(&save).unwrap();
        drop(t);
        let mut r = match try_resume(&save, &k2) {
            Ok(r) => r,
            Err(e) => {
                prop_assert!(
                    e.contains("raise") || e.contains("lower"),
                    "resume refused without a fix: {}", e
                );
                return Ok(());
            }
        };
        prop_assert_eq!(r.steps_done(), split);
        for _ in split..STEPS {
            losses.push(r.step().unwrap().metrics.loss.to_bits());
        }
        let sha = r.finish().unwrap().weight_sha256;
        let want = reference(arch, &k);
        prop_assert_eq!(&losses, &want.0, "losses");
        prop_assert_eq!(&sha, &want.1, "weights");
    }
}

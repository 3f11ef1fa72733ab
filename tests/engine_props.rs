//! Property test of the offload engine on the CPU: any ZeRO offload the
//! DeepSpeed config can ask for (stage 3 with params and optimizer state on
//! cpu or nvme, stages 1 and 2 with the optimizer's on cpu; prefetch
//! bucket, live params, persistence threshold, sub-group size, the param
//! swap buffers' count and size, `max_in_cpu`, pipelined and overlapped or
//! not, resident optimizer groups, speculation, a pinned budget, kept
//! activations), with any accumulation, clipping and precision (fp16's
//! skipped steps included), trains the bits of stage 0 with everything in
//! memory, with the pinned bytes its start-up plan printed mapped, its swap
//! buffers within the pinned budget and its NVMe bytes within the plan's
//! per-step bound, or refuses at build with the numbers and the fix (the
//! pinned budget is drawn down to 256 KiB so that some draws are refused).
//! Draws are new each run (`PROPTEST_CASES=N` draws more); a failure prints
//! its smallest case. The same holds across a checkpoint: saved after any
//! step and resumed under any other offload, the run keeps stage 0's bits.
//! Either way the final checkpoint exports (`tierzero export`, fp32
//! safetensors) to the bytes stage 0's does: whole weights, whatever the
//! tiers and sub-groups. "Offload must not change a bit", drawn instead of
//! chosen: `tests/engine_equivalence.rs` has the chosen cases and their
//! reasons.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod engine_support;

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Mutex, OnceLock};

use engine_support::*;
use proptest::prelude::*;
use tierzero::engine::{Trainer, TrainerOptions};

const STEPS: u64 = 3;

/// A run's losses (their bits), `weight_sha256`, and its final
/// checkpoint exported as fp32 safetensors.
type Trained = (Vec<u32>, String, Vec<u8>);

/// Every run's seed and sequence length.
fn opts() -> TrainerOptions {
    TrainerOptions::cpu(5, 16)
}

/// Builds a trainer (its swap files under `dir`), or says why not.
fn try_build(model: &Path, k: &Knobs, dir: &Path) -> Result<Trainer, String> {
    try_build_in(model, k, opts(), STEPS, dir)
}

/// A trainer resumed from the checkpoint at `ckpt` with `k` (its swap
/// files under `dir`).
fn try_resume(ckpt: &Path, k: &Knobs, dir: &Path) -> Result<Trainer, String> {
    let l = loaded_in(k, STEPS, dir)?;
    let c = tierzero::checkpoint::Checkpoint::open(ckpt).map_err(|e| e.to_string())?;
    Trainer::resume(&l.config, &c, corpus(), opts()).map_err(|e| e.to_string())
}

/// The start-up plan's pinned bytes are what the trainer mapped, and the
/// swap buffers it mapped fit the pinned budget (the cpu tier's pages,
/// the params' home, are outside it): one sizing policy, no hidden
/// buffers. The plan's NVMe bytes a step, at most (read, written).
fn pinned_as_planned(t: &Trainer, k: &Knobs, dir: &Path) -> Result<(u64, u64), TestCaseError> {
    let l = loaded_in(k, STEPS, dir).unwrap();
    let plan = tierzero::run::Plan::new(&l.config, t.model(), t.layout(), t.sizing(), "cpu".into());
    prop_assert_eq!(
        plan.pinned_total_bytes(),
        t.pinned_mapped_bytes(),
        "plan {:?}",
        plan
    );
    if let Some(budget) = k.pinned_budget {
        let swap_bytes = plan.pinned_total_bytes() - plan.params.pinned_bytes;
        prop_assert!(
            swap_bytes <= budget,
            "{} B of swap buffers mapped under a {} B budget",
            swap_bytes,
            budget
        );
    }
    Ok(plan.nvme_step)
}

/// `got` has stage 0's losses, weights and exported bytes (`want`).
fn same_bits(got: &Trained, want: &Trained, what: &str) -> Result<(), TestCaseError> {
    prop_assert_eq!(&got.0, &want.0, "losses ({})", what);
    prop_assert_eq!(&got.1, &want.1, "weights ({})", what);
    prop_assert!(got.2 == want.2, "the exported weights differ ({})", what);
    Ok(())
}

/// N of the "at least N" (bytes) a pinned-budget refusal asks for.
fn at_least(e: &str) -> Option<u64> {
    let rest = &e[e.find("at least ")? + "at least ".len()..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// A refusal at build is the pinned budget's (the only limit drawn
/// small enough to refuse), with the numbers and the key to change.
fn refusal(e: &str, k: &Knobs) -> Result<(), TestCaseError> {
    prop_assert!(
        k.pinned_budget.is_some(),
        "refused without a pinned budget: {}",
        e
    );
    prop_assert!(
        e.contains("pinned_budget_bytes"),
        "a refusal that names another key: {}",
        e
    );
    prop_assert!(
        e.chars().any(|c| c.is_ascii_digit()),
        "a refusal without numbers: {}",
        e
    );
    Ok(())
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

fn train_all(t: Trainer, dir: &Path) -> Trained {
    train_counting_nvme(t, dir).0
}

/// [`train_all`], and the NVMe bytes its steps read and wrote.
fn train_counting_nvme(mut t: Trainer, dir: &Path) -> (Trained, [u64; 2]) {
    let mut nvme = [0u64; 2];
    let losses = (0..STEPS)
        .map(|_| {
            let m = t.step().unwrap().metrics;
            nvme[0] += m.bytes_read["nvme"];
            nvme[1] += m.bytes_written["nvme"];
            m.loss.to_bits()
        })
        .collect();
    let exported = saved_and_exported(&mut t, dir);
    ((losses, t.finish().unwrap().weight_sha256, exported), nvme)
}

/// The bytes of `t`'s weights saved into a checkpoint under `dir` and
/// exported from it as fp32 safetensors (`tierzero export`): whole
/// weights, whatever the offload and sub-groups the run had.
fn saved_and_exported(t: &mut Trainer, dir: &Path) -> Vec<u8> {
    let step_dir = t.save_checkpoint(&dir.join("final")).unwrap();
    let ckpt = tierzero::checkpoint::Checkpoint::open(&step_dir).unwrap();
    let out = dir.join("export").join("model.safetensors");
    tierzero::checkpoint::export_safetensors(&ckpt, &out, candle_core::DType::F32).unwrap();
    std::fs::read(&out).unwrap()
}

/// Stage 0, nothing offloaded, with the same math.
fn reference(arch: TinyArch, k: &Knobs) -> Trained {
    type Key = (TinyArch, &'static str, u64, u64, u32);
    static REFS: OnceLock<Mutex<HashMap<Key, Trained>>> = OnceLock::new();
    // The loss scale is fp16's alone (`fp16.enabled` is false otherwise):
    // fp32 and bf16 draws of any scale share one reference.
    let scale_power = if k.precision == "fp16" {
        k.initial_scale_power
    } else {
        0
    };
    let key = (arch, k.precision, k.gas, k.clip.to_bits(), scale_power);
    let refs = REFS.get_or_init(Default::default);
    if let Some(r) = refs.lock().unwrap().get(&key) {
        return r.clone();
    }
    let base = same_math(k, Knobs::default());
    let dir = Scratch::new("props-ref");
    let r = train_all(try_build(&arch.model(), &base, &dir.0).unwrap(), &dir.0);
    refs.lock().unwrap().insert(key, r.clone());
    r
}

fn device() -> impl Strategy<Value = &'static str> {
    prop_oneof![Just("cpu"), Just("nvme")]
}

fn draw() -> impl Strategy<Value = (TinyArch, Knobs)> {
    (
        (
            prop_oneof![Just(TinyArch::Gpt2), Just(TinyArch::Llama)],
            prop_oneof![Just("fp32"), Just("bf16"), Just("fp16")],
            1u64..=3,
            prop_oneof![Just(0.0), Just(0.5)],
        ),
        (
            prop_oneof![3 => Just(3u8), 1 => 1u8..=2],
            device(),
            device(),
            any::<bool>(),
            any::<bool>(),
        ),
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
                (stage, param, optim, overlap, pipeline),
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
                // Stages 1 and 2 keep the params in memory and can put the
                // optimizer's state in host memory, not on NVMe.
                let (param, optim) = match stage {
                    3 => (param, optim),
                    _ => ("none", "cpu"),
                };
                (
                    arch,
                    Knobs {
                        stage,
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
    #![proptest_config(props_config(128))]

    /// Any offload of params and optimizer state: stage 0's bits, or a
    /// refusal at build that names the numbers.
    #[test]
    fn any_offload_trains_the_in_memory_bits(draw in draw()) {
        let (arch, k) = draw;
        let dir = Scratch::new("props-case");
        match try_build(&arch.model(), &k, &dir.0) {
            Ok(t) => {
                let nvme_step = pinned_as_planned(&t, &k, &dir.0)?;
                let (got, nvme) = train_counting_nvme(t, &dir.0);
                // The plan's NVMe bytes a step are an upper bound.
                prop_assert!(
                    nvme[0] <= STEPS * nvme_step.0 && nvme[1] <= STEPS * nvme_step.1,
                    "NVMe read {} and wrote {} B in {} steps; the plan says at most {:?} a step",
                    nvme[0], nvme[1], STEPS, nvme_step
                );
                same_bits(&got, &reference(arch, &k), "the draw")?;
            }
            Err(e) => {
                refusal(&e, &k)?;
                // The fix works: the budget the refusal asks for builds and
                // trains the same bits, and a byte less is refused (it is
                // the smallest that works). A config read without the
                // model counts only the param buffers, so the build may
                // ask once more, for the optimizer's.
                let mut k = k;
                let mut e = e;
                for _ in 0..2 {
                    let need = at_least(&e);
                    prop_assert!(need.is_some(), "no \"at least N\" in: {}", e);
                    let need = need.unwrap_or_default();
                    prop_assert!(need > k.pinned_budget.unwrap_or(u64::MAX), "{}", e);
                    let less = Knobs {
                        pinned_budget: Some(need - 1),
                        ..k.clone()
                    };
                    match try_build(&arch.model(), &less, &dir.0.join("less")) {
                        Ok(_) => prop_assert!(false, "{} - 1 built", need),
                        Err(e) => {
                            refusal(&e, &less)?;
                            prop_assert_eq!(at_least(&e), Some(need), "{} - 1: {}", need, e);
                        }
                    }
                    k.pinned_budget = Some(need);
                    match try_build(&arch.model(), &k, &dir.0.join(format!("fix-{need}"))) {
                        Ok(t) => {
                            let got = train_all(t, &dir.0.join("fixed"));
                            return same_bits(&got, &reference(arch, &k), "the budget asked for");
                        }
                        Err(again) => {
                            refusal(&again, &k)?;
                            e = again;
                        }
                    }
                }
                prop_assert!(false, "still refused after two budgets asked for: {}", e);
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
        let dir = Scratch::new("props-case");
        let Ok(mut t) = try_build(&arch.model(), &k, &dir.0.join("first")) else {
            // Refused at build: the property above checks the refusals.
            return Ok(());
        };
        let mut losses = Vec::new();
        for _ in 0..split {
            losses.push(t.step().unwrap().metrics.loss.to_bits());
        }
        let save = dir.0.join("save");
        t.save_checkpoint(&save).unwrap();
        drop(t);
        let mut r = match try_resume(&save, &k2, &dir.0.join("second")) {
            Ok(r) => r,
            Err(e) => return refusal(&e, &k2),
        };
        prop_assert_eq!(r.steps_done(), split);
        for _ in split..STEPS {
            losses.push(r.step().unwrap().metrics.loss.to_bits());
        }
        let exported = saved_and_exported(&mut r, &dir.0.join("resumed"));
        let got = (losses, r.finish().unwrap().weight_sha256, exported);
        same_bits(&got, &reference(arch, &k), "resumed")?;
    }
}

/// A draw that found the plan's NVMe read bound too low (every param read
/// twice a micro-batch, where a tied embedding is read three times: its
/// embedding's forward and backward, and the head's): every block
/// recomputed, params on NVMe, the tied GPT-2. Each step reads at most what
/// the plan says, in fp16 and fp32.
#[test]
fn the_plan_bounds_the_reads_of_a_tied_embedding_with_every_block_recomputed() {
    for precision in ["fp16", "fp32"] {
        let k = Knobs {
            stage: 3,
            param: "nvme",
            optim: "cpu",
            precision,
            initial_scale_power: 17,
            sub_group: 500,
            param_buffer_numel: 8192,
            param_buffer_count: 2,
            max_in_cpu: 0,
            prefetch_bucket: 1000,
            max_live: 10000,
            activation_budget: Some(0),
            ..Knobs::default()
        };
        let dir = Scratch::new("plan-tied");
        let mut t = try_build(&TinyArch::Gpt2.model(), &k, &dir.0).unwrap();
        let (read_bound, _) = pinned_as_planned(&t, &k, &dir.0).unwrap();
        for step in 1..=STEPS {
            let read = t.step().unwrap().metrics.bytes_read["nvme"];
            assert!(
                read <= read_bound,
                "{precision} step {step}: read {read} B, the plan says at most {read_bound}"
            );
        }
    }
}

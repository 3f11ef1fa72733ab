//! The speculative optimizer step (`tierzero.speculative_step`): with
//! clipping or fp16 and optimizer state on NVMe, sub-groups step during
//! backward as if nothing clips or overflows, and are committed, redone or
//! undone once the global norm is known. Whatever happens, every loss and
//! the final weights are bit-identical to the step that waits.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: a failed unwrap is a failed test"
)]

mod engine_support;

use engine_support::{assert_identical, tiny_gpt2_dir, train, Knobs, Run};

const STEPS: u64 = 12;
const SEQ: usize = 16;

fn speculative(k: &Knobs, on: Option<bool>) -> Knobs {
    Knobs {
        speculative: on,
        ..k.clone()
    }
}

fn counts(r: &Run) -> (u64, u64) {
    let last = r.steps.last().unwrap();
    (last.speculation_hits, last.speculation_misses)
}

/// Runs `k` speculating and not, checks the bits, returns (hits, misses).
fn both(tag: &str, k: &Knobs, on: Option<bool>) -> (u64, u64) {
    let dir = tiny_gpt2_dir(tag, 2, 32);
    let spec = train(&dir, &speculative(k, on), 5, STEPS, |_| SEQ);
    let wait = train(&dir, &speculative(k, Some(false)), 5, STEPS, |_| SEQ);
    assert_identical(&spec, &wait, tag);
    assert_eq!(counts(&wait), (0, 0), "{tag}: speculation off speculated");
    let (hits, misses) = counts(&spec);
    if hits + misses > 0 {
        // A speculated sub-group went to the optimizer during backward.
        let during: Vec<u64> = spec
            .steps
            .iter()
            .map(|s| s.sub_groups_stepped_during_backward)
            .collect();
        assert!(
            during.iter().any(|&n| n > 0),
            "{tag}: speculated, but no sub-group stepped during backward: {during:?}"
        );
    }
    (hits, misses)
}

#[test]
fn clipping_that_never_clips_commits_every_step() {
    let k = Knobs {
        clip: 1e6,
        ..Knobs::nvme()
    };
    assert_eq!(both("spec-noclip", &k, Some(true)), (STEPS, 0));
}

#[test]
fn clipping_that_always_clips_redoes_every_step() {
    let k = Knobs {
        clip: 0.05,
        ..Knobs::nvme()
    };
    assert_eq!(both("spec-clip", &k, Some(true)), (0, STEPS));
}

#[test]
fn clipping_sometimes_mixes_hits_and_misses() {
    // Find a max_norm between the run's gradient norms, so some steps clip
    // and some do not.
    let dir = tiny_gpt2_dir("spec-mixed-probe", 2, 32);
    let probe = Knobs {
        clip: 1e6,
        speculative: Some(false),
        ..Knobs::nvme()
    };
    let r = train(&dir, &probe, 5, STEPS, |_| SEQ);
    let mut norms: Vec<f64> = r.steps.iter().map(|s| s.grad_norm.unwrap()).collect();
    norms.sort_by(f64::total_cmp);
    let k = Knobs {
        clip: norms[norms.len() / 2],
        ..Knobs::nvme()
    };
    let (hits, misses) = both("spec-mixed", &k, Some(true));
    assert!(hits > 0 && misses > 0, "hits {hits} misses {misses}");
    assert_eq!(hits + misses, STEPS);
}

#[test]
fn fp16_overflow_undoes_the_speculation_and_skips() {
    // 2^24 overflows the first steps' fp16 gradients (skipped), then the
    // scale comes down and steps apply.
    let k = Knobs {
        precision: "fp16",
        initial_scale_power: 24,
        ..Knobs::nvme()
    };
    let dir = tiny_gpt2_dir("spec-fp16", 2, 32);
    let spec = train(&dir, &speculative(&k, Some(true)), 5, STEPS, |_| SEQ);
    let wait = train(&dir, &speculative(&k, Some(false)), 5, STEPS, |_| SEQ);
    assert_identical(&spec, &wait, "fp16 speculative");
    let skipped = spec.steps.iter().filter(|s| s.skipped).count() as u64;
    assert!(skipped > 0, "no overflow step");
    let (hits, misses) = counts(&spec);
    assert_eq!(misses, skipped, "every overflow is a miss");
    assert_eq!(hits, STEPS - skipped);
}

#[test]
fn auto_stops_speculating_after_three_misses_in_a_row() {
    let k = Knobs {
        clip: 0.05,
        ..Knobs::nvme()
    };
    assert_eq!(both("spec-auto", &k, None), (0, 3));
}

/// More NVMe sub-groups than the speculation pool has slots (one, bought
/// by `tierzero.speculation_pool_bytes`): the first group backward finishes speculates,
/// the rest wait for the decision, every step, and the bits are still the
/// waiting step's, for hits, misses and fp16 overflows alike.
#[test]
fn a_pool_smaller_than_the_groups_keeps_the_bits() {
    for pipeline in [true, false] {
        for (tag, clip, precision) in [
            ("hit", 1e6, "bf16"),
            ("miss", 0.05, "bf16"),
            ("fp16", 1e6, "fp16"),
        ] {
            let tag = format!("spec-pool-{tag}-{pipeline}");
            let k = Knobs {
                clip,
                precision,
                initial_scale_power: 24,
                pipeline,
                speculation_pool_bytes: Some(1),
                ..Knobs::nvme()
            };
            let dir = tiny_gpt2_dir(&tag, 2, 32);
            let spec = train(&dir, &speculative(&k, Some(true)), 5, STEPS, |_| SEQ);
            let wait = train(&dir, &speculative(&k, Some(false)), 5, STEPS, |_| SEQ);
            assert_identical(&spec, &wait, &tag);
            let last = spec.steps.last().unwrap();
            let (hits, misses) = counts(&spec);
            assert_eq!(hits + misses, STEPS, "{tag}");
            // The same groups wait every step.
            let waits = last.speculation_pool_waits;
            assert!(waits > 0 && waits % STEPS == 0, "{tag}: {waits} pool waits");
            assert_eq!(wait.steps.last().unwrap().speculation_pool_waits, 0);
            if tag.contains("fp16") {
                let skipped = spec.steps.iter().filter(|s| s.skipped).count() as u64;
                assert!(skipped > 0, "{tag}: no overflow step");
                assert_eq!(misses, skipped, "{tag}");
            }
        }
    }
}

/// A pool for every NVMe group, auto's choice when the disk has room (and
/// `tierzero.speculation_pool_bytes` large enough): no group waits for the
/// norm, the gradients beyond the pipeline's depth are spilled for a
/// re-step, and the bits are those of the step that waits (hits and
/// misses, fp16 overflows, with and without pipelining).
#[test]
fn a_pool_of_every_group_never_waits_and_keeps_the_bits() {
    for pipeline in [true, false] {
        for (tag, clip, precision, pool) in [
            ("hit", 1e6, "bf16", None),
            ("miss", 0.05, "bf16", None),
            ("fp16", 1e6, "fp16", None),
            ("miss-bytes", 0.05, "bf16", Some(1 << 40)),
        ] {
            let tag = format!("spec-pool-all-{tag}-{pipeline}");
            let k = Knobs {
                clip,
                precision,
                initial_scale_power: 24,
                pipeline,
                speculation_pool_bytes: pool,
                ..Knobs::nvme()
            };
            let dir = tiny_gpt2_dir(&tag, 2, 32);
            let spec = train(&dir, &speculative(&k, Some(true)), 5, STEPS, |_| SEQ);
            let wait = train(&dir, &speculative(&k, Some(false)), 5, STEPS, |_| SEQ);
            assert_identical(&spec, &wait, &tag);
            let (hits, misses) = counts(&spec);
            assert_eq!(hits + misses, STEPS, "{tag}");
            assert_eq!(
                spec.steps.last().unwrap().speculation_pool_waits,
                0,
                "{tag}"
            );
        }
    }
}

/// Without speculation, the final gradients that spill to NVMe (clipping)
/// are handed to the optimizer thread within the same bound: the compute
/// thread waits for one to come back (`Done::Spilled`) while a pipeline's
/// worth is out. Before, every spill was sent at once, and each held its
/// gradient in host memory until the optimizer thread had copied it out,
/// past the plan's bound where the disk is slower than backward. Every
/// group of the model spills here (the optimizer keeps no state
/// resident), and the bits are the unbounded run's: the in-memory
/// optimizer's.
#[test]
fn spilled_hand_over_is_bounded_by_the_pipeline() {
    use engine_support::{corpus, ds_config, scratch};
    use tierzero::config::{load_str, PathChecks, RunContext};
    use tierzero::engine::{sizing, Trainer, TrainerOptions};
    use tierzero::model::ModelDir;
    let dir = tiny_gpt2_dir("spill-bound", 2, 32);
    let run = RunContext {
        path_checks: PathChecks::CreateMissing,
        ..RunContext::default()
    };
    let train = |k: &Knobs, tag: &str| {
        let swap = scratch(tag);
        let cfg = ds_config(k, &swap, 4);
        let loaded = load_str(&cfg.to_string(), &run).unwrap();
        let md = ModelDir::open(&dir, 5).unwrap();
        let mut t =
            Trainer::new(&loaded.config, &md, corpus(), TrainerOptions::cpu(5, SEQ)).unwrap();
        let groups = t.layout().sub_groups.len();
        let sizing = t.sizing().clone();
        for _ in 0..3 {
            t.step().unwrap();
        }
        let peak = t.grads_handed_over_peak();
        let s = t.finish().unwrap();
        let _ = std::fs::remove_dir_all(&swap);
        (groups, sizing, peak, s.weight_sha256)
    };
    let k = Knobs {
        clip: 1e6,
        sub_group: 500,
        optimizer_resident_bytes: Some(0),
        speculative: Some(false),
        ..Knobs::nvme()
    };
    let (groups, sizing, peak, spilled) = train(&k, "spill-bound-swap");
    assert!(sizing.spill_grads, "the final gradients spill");
    let limit = sizing::grads_in_flight(sizing.read_ahead, sizing.write_behind);
    let held = sizing.held_grad_groups;
    assert!(
        groups > 4 * limit + held,
        "{groups} sub-groups, limit {limit}"
    );
    // The held groups' steps go after the decision, unbounded, while the
    // last spills may still be out (each is counted); the spills never
    // pass the limit.
    assert!(
        peak > held && peak <= limit + held,
        "peak {peak}, limit {limit}, held {held}"
    );
    let in_memory = Knobs {
        optim: "cpu",
        ..k.clone()
    };
    let (_, _, _, reference) = train(&in_memory, "spill-bound-mem");
    assert_eq!(spilled, reference, "the spilled run's weights");
}

/// A trainer of a 2-layer, width-32 GPT-2 (`tag`) under `k`'s config of
/// `steps` steps, and its swap dir (removed by the caller).
fn tiny_trainer(
    tag: &str,
    k: &Knobs,
    steps: u64,
) -> (tierzero::engine::Trainer, std::path::PathBuf) {
    use engine_support::{corpus, ds_config, scratch};
    use tierzero::config::{load_str, PathChecks, RunContext};
    use tierzero::engine::{Trainer, TrainerOptions};
    use tierzero::model::ModelDir;
    let dir = tiny_gpt2_dir(tag, 2, 32);
    let swap = scratch(&format!("{tag}-swap"));
    let cfg = ds_config(k, &swap, steps);
    let run = RunContext {
        path_checks: PathChecks::CreateMissing,
        ..RunContext::default()
    };
    let loaded = load_str(&cfg.to_string(), &run).unwrap();
    let md = ModelDir::open(&dir, 5).unwrap();
    let t = Trainer::new(&loaded.config, &md, corpus(), TrainerOptions::cpu(5, SEQ)).unwrap();
    (t, swap)
}

/// Speculative steps hand their gradients over during backward as the
/// overlapped steps do: at most a pipeline's worth waits for the optimizer
/// thread at once (`sizing::grads_in_flight`), however many sub-groups
/// speculate. Before, every speculated group's gradient could queue,
/// the whole shard's on a model whose optimizer I/O is slower than
/// backward.
#[test]
fn speculative_hand_over_is_bounded_by_the_pipeline() {
    use tierzero::engine::sizing;
    let k = Knobs {
        clip: 1e6,
        sub_group: 500,
        optimizer_resident_bytes: Some(0),
        speculative: Some(true),
        ..Knobs::nvme()
    };
    let (mut t, swap) = tiny_trainer("spec-bound", &k, 4);
    let groups = t.layout().sub_groups.len();
    let limit = sizing::grads_in_flight(t.sizing().read_ahead, t.sizing().write_behind);
    assert!(groups > 4 * limit, "{groups} sub-groups, limit {limit}");
    let mut hits = 0;
    for _ in 0..4 {
        hits = t.step().unwrap().metrics.speculation_hits;
    }
    let peak = t.grads_handed_over_peak();
    t.finish().unwrap();
    let _ = std::fs::remove_dir_all(&swap);
    assert_eq!(hits, 4, "every step speculated and held");
    assert!(peak >= 1 && peak <= limit, "peak {peak}, limit {limit}");
}

/// After the decision (clipping, no speculation) every sub-group's step is
/// sent at once and the optimizer thread steps them back to back, while
/// the trainer stores their new values at unit boundaries: it lends at
/// most `sizing::values_in_flight` values buffers at once (a unit's
/// sub-groups and the hand-over's). Before, a values buffer per
/// sub-group stepped meanwhile was out (here all 60, the rank's whole
/// 16-bit shard).
#[test]
fn values_lent_after_the_decision_are_bounded() {
    use tierzero::engine::sizing;
    let k = Knobs {
        clip: 1e6,
        sub_group: 500,
        speculative: Some(false),
        ..Knobs::cpu()
    };
    let (mut t, swap) = tiny_trainer("values-bound", &k, 3);
    let groups = t.layout().sub_groups.len();
    let unit_groups = sizing::largest_unit_groups(t.model(), t.layout()) as usize;
    let limit = sizing::values_in_flight(
        t.sizing().read_ahead,
        t.sizing().write_behind,
        unit_groups,
        groups,
    );
    assert!(groups > limit, "{groups} sub-groups, limit {limit}");
    let losses: Vec<f32> = (0..3).map(|_| t.step().unwrap().metrics.loss).collect();
    let peak = t.values_lent_peak();
    t.finish().unwrap();
    let _ = std::fs::remove_dir_all(&swap);
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    eprintln!("{groups} sub-groups: at most {peak} values buffers lent at once (limit {limit})");
    assert!(peak >= 1 && peak <= limit, "peak {peak}, limit {limit}");
}

//! Resume is bit-identical: N steps, save, a fresh trainer resumed from the
//! checkpoint, M more steps gives exactly the per-step losses and final
//! weight hash of N+M steps in one run. Stage 3 with params and optimizer
//! state on NVMe (extents copied with copy_file_range), fp16 dynamic loss
//! scaling with skipped steps (the scaler must round-trip), gradient
//! accumulation on the cpu tier, and a different sub_group_size on resume
//! (loading is by parameter, not by region).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: a failed unwrap is a failed test"
)]

mod engine_support;

use engine_support::{assert_identical, build, resume, scratch, tiny_gpt2_dir, train, Knobs, Run};

const SEQ: usize = 16;

/// N steps, save into a save dir, resume, M steps; returns the joined run.
fn split_run(dir: &std::path::Path, k: &Knobs, k2: &Knobs, n: u64, m: u64) -> Run {
    let save = scratch("save");
    let mut t = build(dir, k, 7, SEQ, n + m);
    let mut steps = Vec::new();
    for _ in 0..n {
        steps.push(t.step().unwrap().metrics);
    }
    let step_dir = t.save_checkpoint(&save).unwrap();
    assert!(step_dir.ends_with(format!("step-{n:08}")), "{step_dir:?}");
    drop(t);
    let mut r = resume(&save, k2, 7, SEQ, n + m);
    assert_eq!(r.steps_done(), n);
    for _ in 0..m {
        steps.push(r.step().unwrap().metrics);
    }
    let s = r.finish().unwrap();
    assert_eq!(s.steps, n + m);
    Run {
        steps,
        sha256: s.weight_sha256,
        rerecords: 0,
        // The resumed half's totals only.
        bytes_read: s.bytes_read,
        bytes_written: s.bytes_written,
        activations: None,
    }
}

#[test]
fn resume_stage3_nvme_fp32_is_bit_identical() {
    let dir = tiny_gpt2_dir("ck-nvme", 2, 32);
    let whole = train(&dir, &Knobs::nvme(), 7, 6, |_| SEQ);
    let split = split_run(&dir, &Knobs::nvme(), &Knobs::nvme(), 3, 3);
    assert_identical(&whole, &split, "nvme fp32 resume");
    // Step numbers continue.
    let nums: Vec<u64> = split.steps.iter().map(|s| s.step).collect();
    assert_eq!(nums, vec![1, 2, 3, 4, 5, 6]);
}

#[test]
fn resume_fp16_loss_scaler_round_trips() {
    // 2^24 overflows at first: steps are skipped and the scale comes down;
    // the split lands while the scaler is mid-way (hysteresis, window 4).
    let k = Knobs {
        precision: "fp16",
        initial_scale_power: 24,
        ..Knobs::nvme()
    };
    let dir = tiny_gpt2_dir("ck-fp16", 2, 32);
    let whole = train(&dir, &k, 7, 10, |_| SEQ);
    assert!(whole.steps.iter().any(|s| s.skipped), "no skipped step");
    let split = split_run(&dir, &k, &k, 3, 7);
    let a: Vec<(bool, u64)> = whole
        .steps
        .iter()
        .map(|s| (s.skipped, s.loss_scale.to_bits()))
        .collect();
    let b: Vec<(bool, u64)> = split
        .steps
        .iter()
        .map(|s| (s.skipped, s.loss_scale.to_bits()))
        .collect();
    assert_eq!(a, b, "skips and loss scales differ");
    assert_identical(&whole, &split, "fp16 resume");
}

#[test]
fn resume_cpu_tier_with_grad_accumulation_and_other_sub_groups() {
    let k = Knobs {
        gas: 2,
        ..Knobs::cpu()
    };
    // Resume with another sub_group_size: the checkpoint is read by
    // parameter, so the layout may change.
    let k2 = Knobs {
        sub_group: 1000,
        ..k.clone()
    };
    let dir = tiny_gpt2_dir("ck-cpu", 2, 32);
    let whole = train(&dir, &k, 7, 5, |_| SEQ);
    let split = split_run(&dir, &k, &k2, 2, 3);
    assert_identical(&whole, &split, "cpu gas2 resume");
}

#[test]
fn resume_without_the_checkpoint_differs() {
    // Guard: a "resume" that ignored the checkpoint would restart from the
    // init; its losses then differ from the uninterrupted run's.
    let dir = tiny_gpt2_dir("ck-guard", 2, 32);
    let whole = train(&dir, &Knobs::nvme(), 7, 4, |_| SEQ);
    let fresh = train(&dir, &Knobs::nvme(), 7, 2, |_| SEQ);
    let split = split_run(&dir, &Knobs::nvme(), &Knobs::nvme(), 2, 2);
    assert_ne!(split.steps[2].loss.to_bits(), fresh.steps[0].loss.to_bits());
    assert_identical(&whole, &split, "guard");
}

/// A resume with another global batch continues at the sample the
/// checkpoint reached: 2 steps of 2 samples, then steps of 4 from sample
/// 4 (it restarted the count at step 2 with the new batch, sample 8,
/// skipping samples 4..8), and the next checkpoint counts 4 + 4.
#[test]
fn resume_with_another_global_batch_continues_at_the_checkpoints_sample() {
    use tierzero::checkpoint::Checkpoint;
    let dir = tiny_gpt2_dir("ck-batch", 2, 32);
    let save = scratch("save-batch");
    let k = Knobs::nvme();
    let mut t = build(&dir, &k, 7, SEQ, 3);
    for _ in 0..2 {
        t.step().unwrap();
    }
    t.save_checkpoint(&save).unwrap();
    drop(t);
    let ck = Checkpoint::open(&save).unwrap();
    assert_eq!(ck.manifest().data.samples_consumed, 4);
    let k2 = Knobs { gas: 2, ..k };
    let mut r = resume(&save, &k2, 7, SEQ, 3);
    r.step().unwrap();
    let again = scratch("save-batch-2");
    r.save_checkpoint(&again).unwrap();
    drop(r);
    let ck = Checkpoint::open(&again).unwrap();
    assert_eq!(ck.manifest().step, 3);
    assert_eq!(ck.manifest().data.samples_consumed, 4 + 4);
}

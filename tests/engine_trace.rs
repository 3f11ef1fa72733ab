//! The prefetching scheduler: the trace is recorded in step 1 and checked
//! later; a different sequence length mid-run invalidates it, which must
//! re-record without deadlock and without changing a single bit of the
//! results (compared with a stage-0 run of the same schedule).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: a failed unwrap is a failed test"
)]

mod engine_support;

use engine_support::{assert_identical, build, tiny_gpt2_dir, train, Knobs};
use tierzero::engine::params::prefetch::TraceState;
use tierzero::engine::ParamState;

fn seq_schedule(step: u64) -> usize {
    if step < 3 {
        16
    } else {
        8
    }
}

#[test]
fn sequence_length_change_rerecords_without_changing_results() {
    let dir = tiny_gpt2_dir("trace", 2, 32);
    let a = train(&dir, &Knobs::default(), 3, 6, seq_schedule);
    let b = train(&dir, &Knobs::nvme(), 3, 6, seq_schedule);
    assert_eq!(b.rerecords, 1, "the seq change must re-record exactly once");
    assert_identical(&a, &b, "trace re-record");
}

#[test]
fn prefetch_issues_reads_ahead_once_the_trace_is_complete() {
    // Six blocks of width 64 (about 50,000 elements each): more than
    // `stage3_max_live_parameters` less one prefetch bucket (200,000 −
    // 50,000), so the forward's later units are not among the params whose
    // updates stay resident, and are read ahead.
    let dir = tiny_gpt2_dir("prefetch", 6, 64);
    let knobs = Knobs {
        prefetch_bucket: 50_000,
        max_live: 200_000,
        ..Knobs::nvme()
    };
    let mut t = build(&dir, &knobs, 1, 16, 4);
    t.step().unwrap();
    assert!(matches!(t.prefetcher().state(), TraceState::Record(_)));
    assert_eq!(
        t.lookahead_reads(),
        0,
        "no trace yet, nothing to prefetch on"
    );
    t.step().unwrap();
    assert!(matches!(
        t.prefetcher().state(),
        TraceState::Complete { .. }
    ));
    assert!(
        t.lookahead_reads() > 0,
        "with a complete trace some reads must be issued ahead"
    );
    // The params the next forward needs first stay resident after their
    // update (written through), those of the last block do not.
    t.settle_optimizer().unwrap();
    let units = t.model().units();
    // The embedding and the first two blocks fit the 150,000 elements
    // (one bucket alone would keep only the embedding).
    let kept: Vec<_> = units[..3].iter().flat_map(|u| u.params.clone()).collect();
    for &p in &kept {
        assert_eq!(t.store().state(p), ParamState::Resident, "{p:?}");
    }
    let last_block = &units[units.len() - 2].params;
    assert!(last_block
        .iter()
        .any(|&p| t.store().state(p) == ParamState::OnDisk));
    // Everything but persistent/cached params is released after the step.
    let n = t.model().params().len();
    let resident = (0..n)
        .filter(|&i| t.store().state(tierzero::model::ParamId(i)) == ParamState::Resident)
        .count();
    assert!(resident < n, "params were not released ({resident}/{n})");
}

#[test]
fn device_cache_keeps_params_resident_and_stays_identical() {
    let dir = tiny_gpt2_dir("cache", 2, 32);
    let cached = Knobs {
        device_cache_bytes: 1 << 30,
        ..Knobs::nvme()
    };
    let a = train(&dir, &Knobs::default(), 5, 5, |_| 16);
    let b = train(&dir, &cached, 5, 5, |_| 16);
    let c = train(&dir, &Knobs::nvme(), 5, 5, |_| 16);
    // With everything cached, params are read from NVMe in step 1 only;
    // later steps read optimizer state only. Uncached, every step reads
    // every param at least twice (forward and backward).
    let (cached_b, plain_b) = (b.nvme_read_bytes(), c.nvme_read_bytes());
    assert!(
        cached_b < plain_b,
        "cache did not cut param reads ({plain_b} -> {cached_b} bytes)"
    );
    assert_identical(&a, &b, "device cache");
    assert_identical(&a, &c, "no device cache");
}

/// The cpu tier reads ahead too: once the trace is complete, the next
/// units' params are copied out of their pinned pages on the param copy
/// thread (`ParamStore::prefetch`), and the results are those of a run
/// without offload, bit for bit.
#[test]
fn cpu_tier_params_are_read_ahead_on_the_copy_thread_with_the_same_bits() {
    let dir = tiny_gpt2_dir("prefetch-cpu", 6, 64);
    let knobs = Knobs {
        prefetch_bucket: 50_000,
        max_live: 200_000,
        ..Knobs::cpu()
    };
    let mut t = build(&dir, &knobs, 1, 16, 4);
    t.step().unwrap();
    assert_eq!(t.lookahead_reads(), 0, "no trace yet");
    t.step().unwrap();
    assert!(
        t.lookahead_reads() > 0,
        "with a complete trace cpu-tier params must be read ahead"
    );
    drop(t);
    let a = train(&dir, &Knobs::default(), 3, 4, |_| 16);
    let b = train(&dir, &knobs, 3, 4, |_| 16);
    assert_identical(&a, &b, "cpu tier read ahead");
}

/// Mixed tiers (the first 150,000 elements in pinned host memory, the
/// rest on NVMe) with one NVMe swap buffer: the window's NVMe reads run out
/// of buffers at every fetch, and its cpu-tier params are still read
/// ahead by the copy thread (in backward, where the NVMe params come first,
/// they were not: `Trainer::lookahead_reads` after 6 steps of these knobs,
/// printed from a scratch copy of this test, 154 before and 185 after). The
/// results are the in-memory run's bits.
#[test]
fn mixed_tiers_with_one_nvme_buffer_keep_the_bits() {
    let dir = tiny_gpt2_dir("mixed", 6, 64);
    let knobs = Knobs {
        prefetch_bucket: 50_000,
        max_live: 200_000,
        max_in_cpu: 150_000,
        param_buffer_count: 1,
        param_buffer_numel: 16384,
        ..Knobs::nvme()
    };
    let a = train(&dir, &Knobs::default(), 1, 6, |_| 16);
    let b = train(&dir, &knobs, 1, 6, |_| 16);
    assert_identical(&a, &b, "mixed tiers, one NVMe buffer");
}

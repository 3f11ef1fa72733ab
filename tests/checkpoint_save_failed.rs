//! A save that fails inside the optimizer thread (an injected EIO on the
//! first checkpoint state write) is an error of that save alone, for an
//! embedder that catches it: the trainer trains on, a later save works,
//! and the weights are those of a run that never tried to save. (The
//! failure used to end the optimizer thread: the next step failed with
//! "optimizer thread stopped", the cause gone.)
//!
//! Its own test binary: the failpoint is read from the environment once
//! per process.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: a failed unwrap is a failed test"
)]

mod engine_support;

use engine_support::{build, scratch, tiny_gpt2_dir, Knobs};

#[test]
fn a_failed_save_leaves_the_trainer_training() {
    std::env::set_var("TIERZERO_FAILPOINT", "ckpt.state_write:1:eio");
    let model = tiny_gpt2_dir("save-failed", 2, 32);
    let k = Knobs::nvme();
    let mut t = build(&model, &k, 7, 16, 4);
    t.step().unwrap();
    t.step().unwrap();
    let e = t
        .save_checkpoint(&scratch("save-failed-a"))
        .expect_err("the injected EIO fails the save");
    assert!(e.to_string().contains("injected"), "{e}");
    t.step().unwrap();
    t.save_checkpoint(&scratch("save-failed-b"))
        .expect("a later save works");
    t.step().unwrap();
    let tried = t.finish().unwrap().weight_sha256;

    let mut t = build(&model, &k, 7, 16, 4);
    for _ in 0..4 {
        t.step().unwrap();
    }
    assert_eq!(tried, t.finish().unwrap().weight_sha256);
}

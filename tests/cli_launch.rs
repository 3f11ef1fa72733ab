//! `tierzero launch` and `train` under a multi-rank launcher, in a build
//! without the `mpi` feature: both refuse with exit 2 and the fix (build
//! with `--features mpi`), instead of N processes each training alone. The
//! multi-rank runs themselves are in `tests/mpi_*.rs` (feature `mpi`).
#![cfg(not(feature = "mpi"))]
#![allow(clippy::expect_used)] // tests: a failure is a panic

use std::process::Command;

#[test]
fn launch_without_the_mpi_feature_says_how_to_build_it() {
    let out = Command::new(env!("CARGO_BIN_EXE_tierzero"))
        .args(["launch", "--nproc", "2", "--", "train", "--steps", "1"])
        .output()
        .expect("run tierzero");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert!(err.contains("--features mpi"), "stderr: {err}");
}

#[test]
fn train_as_one_of_several_ranks_without_mpi_refuses() {
    let out = Command::new(env!("CARGO_BIN_EXE_tierzero"))
        .args(["train", "--steps", "1"])
        .env("OMPI_COMM_WORLD_SIZE", "2")
        .env("OMPI_COMM_WORLD_RANK", "0")
        .output()
        .expect("run tierzero");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert!(
        err.contains("one of 2 ranks") && err.contains("--features mpi"),
        "stderr: {err}"
    );
    // Nothing was trained or written.
    assert!(
        out.stdout.is_empty(),
        "stdout: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// A rank count out of range names the range (it said "a whole number
/// from 1", which 2000000 is).
#[test]
fn launch_names_the_range_of_rank_counts() {
    let out = Command::new(env!("CARGO_BIN_EXE_tierzero"))
        .args(["launch", "--nproc", "2000000", "--", "train"])
        .output()
        .expect("run tierzero");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert!(err.contains("from 1 to 1048576"), "stderr: {err}");
}

//! A signal to one rank stops every rank at the same step (feature `mpi`;
//! needs OpenMPI's `mpirun`). Two ranks of `tierzero train` run under
//! `mpirun`; once rank 0 has written two steps' metrics, one rank (not
//! mpirun) gets SIGTERM or SIGINT. The ranks agree on the stop at the end
//! of every step (an all-gather of the stop flag), so both stop after the
//! same step and save it together (a collective): the checkpoint is of 2
//! ranks at the step the summary reports, resuming it under 2 ranks gives
//! the weights of a 2-rank run never stopped, no swap file is left on any
//! rank, and the job's exit code is the stop's (143 / 130).
#![cfg(feature = "mpi")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: a failed unwrap is a failed test"
)]

mod cli_support;
mod engine_support;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use engine_support::scratch;
use serde_json::{json, Value};
use tierzero::checkpoint::Checkpoint;

const TOTAL: u64 = 40;

fn setup(d: &Path) {
    std::fs::create_dir_all(d.join("model")).unwrap();
    let model = json!({"model_type": "gpt2", "vocab_size": 256, "n_positions": 32,
        "n_embd": 32, "n_layer": 2, "n_head": 2, "n_inner": 64});
    std::fs::write(d.join("model/config.json"), model.to_string()).unwrap();
    let text = "two ranks stopped by one signal stop at the same step. ".repeat(80);
    std::fs::write(d.join("data.txt"), text).unwrap();
    let swap = d.join("swap");
    std::fs::create_dir_all(&swap).unwrap();
    let cfg = json!({
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": swap, "buffer_count": 4,
                "buffer_size": 20000},
            "offload_optimizer": {"device": "nvme", "nvme_path": swap},
            "sub_group_size": 3000
        },
        "tierzero": {"pinned_budget_bytes": "16MiB", "checksums": true}
    });
    std::fs::write(d.join("ds.json"), cfg.to_string()).unwrap();
}

/// `mpirun -np 2 tierzero train ...` in `d`, its ranks marked with `mark`.
fn mpirun(d: &Path, mark: &str, extra: &[&str]) -> Command {
    let mut c = Command::new("mpirun");
    c.current_dir(d)
        .args(["-np", "2", "--oversubscribe", "--bind-to", "none"])
        .arg(env!("CARGO_BIN_EXE_tierzero"))
        .args([
            "train", "--config", "ds.json", "--data", "data.txt", "--json",
        ])
        .args(["--seq-len", "16", "--steps", &TOTAL.to_string()])
        .args(extra)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("TIERZERO_COMM_TIMEOUT_S", "60")
        .env("TZ_STOP_MARK", mark)
        .env_remove("TIERZERO_FAILPOINT")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

fn summary(out: &Output, what: &str) -> Value {
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| {
            panic!(
                "{what}: no JSON summary: {text}\n{}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    serde_json::from_str(line).unwrap()
}

fn complete(c: &mut Command, what: &str) -> Value {
    let out = c.output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    summary(&out, what)
}

/// The pid of rank `rank` of the job marked `mark`.
fn rank_pid(mark: &str, rank: usize) -> Option<u32> {
    let want_mark = format!("TZ_STOP_MARK={mark}");
    let want_rank = format!("OMPI_COMM_WORLD_RANK={rank}");
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(env) = std::fs::read(e.path().join("environ")) else {
            continue;
        };
        let vars: Vec<&[u8]> = env.split(|&b| b == 0).collect();
        let has = |s: &str| vars.contains(&s.as_bytes());
        if has(&want_mark) && has(&want_rank) {
            let exe = std::fs::read_link(e.path().join("exe")).unwrap_or_default();
            if exe.file_name().is_some_and(|n| n == "tierzero") {
                return Some(pid);
            }
        }
    }
    None
}

/// Every `*.tzswap` file under `dir`.
fn swap_files(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(swap_files(&p));
        } else if p.to_string_lossy().ends_with(".tzswap") {
            out.push(p.display().to_string());
        }
    }
    out
}

/// Starts a 2-rank run, sends `sig` to rank `target` once two steps are
/// done, and returns the job's output.
fn stopped(d: &Path, tag: &str, sig: &str, target: usize, extra: &[&str]) -> Output {
    let mark = format!("{tag}-{}", std::process::id());
    let metrics = format!("m-{tag}.jsonl");
    let mut args = vec!["--metrics", metrics.as_str()];
    args.extend_from_slice(extra);
    // (Under nohup, as a CI job may run, SIGHUP would stay ignored.)
    let mut child = cli_support::hup_at_default(&mpirun(d, &mark, &args))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun");
    let t0 = Instant::now();
    let pid = loop {
        assert!(
            child.try_wait().unwrap().is_none(),
            "{tag}: the job ended before the signal"
        );
        let stepped =
            std::fs::read_to_string(d.join(&metrics)).is_ok_and(|t| t.lines().count() >= 2);
        if let (true, Some(pid)) = (stepped, rank_pid(&mark, target)) {
            break pid;
        }
        assert!(t0.elapsed() < Duration::from_secs(120), "{tag}: no step");
        std::thread::sleep(Duration::from_millis(10));
    };
    let ok = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
    child.wait_with_output().unwrap()
}

#[test]
fn a_signal_to_one_rank_stops_both_at_the_same_step() {
    let d = scratch("mpi-stop");
    setup(&d);
    let reference = complete(&mut mpirun(&d, "ref", &["--model", "model"]), "reference");
    for (sig, code, target) in [("TERM", 143, 1), ("INT", 130, 0)] {
        let what = format!("SIG{sig} to rank {target} with --save-dir");
        let ck = format!("ck-{sig}");
        let out = stopped(
            &d,
            &format!("save-{sig}"),
            sig,
            target,
            &["--model", "model", "--save-dir", &ck, "--save-every", "7"],
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{what}: {err}");
        let s = summary(&out, &what);
        assert_eq!(s["stopped"], json!("signal"), "{what}: {s}");
        assert_eq!(s["stop_signal"], json!(format!("SIG{sig}")), "{what}: {s}");
        let step = s["steps"].as_u64().unwrap();
        assert!((2..TOTAL).contains(&step), "{what}: {step}");
        assert_eq!(s["checkpoint_step"].as_u64(), Some(step), "{what}: {s}");
        eprintln!("{what}: mpirun exited {code}, both ranks stopped at step {step}");
        let c = Checkpoint::open(&d.join(&ck)).unwrap();
        assert_eq!(c.step(), step, "{what}");
        assert_eq!(c.manifest().world_size, 2, "{what}");
        assert!(c.verify().ok(), "{what}");
        assert_eq!(swap_files(&d.join("swap")), Vec::<String>::new(), "{what}");
        let resumed = complete(
            &mut mpirun(&d, "resume", &["--resume", &ck, "--save-dir", &ck]),
            &format!("{what}, resumed"),
        );
        assert_eq!(
            resumed["weight_sha256"], reference["weight_sha256"],
            "{what}: the resumed run's weights differ from a run never stopped"
        );
    }
    // Without a save dir, and on SIGHUP: the same stop, its exit code and
    // clean-up (129 is a stop, not a failure: no rank calls MPI_Abort,
    // which killed rank 0 before its summary).
    let out = stopped(&d, "nosave", "HUP", 1, &["--model", "model"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(129), "without --save-dir: {err}");
    assert!(!err.contains("MPI_ABORT"), "a stop is not an abort: {err}");
    let s = summary(&out, "without --save-dir");
    assert_eq!(s["stopped"], json!("signal"));
    assert_eq!(s["stop_signal"], json!("SIGHUP"));
    assert!(s["steps"].as_u64().unwrap() < TOTAL);
    assert_eq!(swap_files(&d.join("swap")), Vec::<String>::new());
    std::fs::remove_dir_all(&d).unwrap();
}

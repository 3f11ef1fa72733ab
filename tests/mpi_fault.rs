//! A rank that dies or hangs must not leave the others waiting forever
//! (feature `mpi`; needs OpenMPI's `mpirun`). Two ranks of `tierzero train`
//! run under `mpirun`; once rank 0 has written a step, rank 1 is
//! SIGKILLed (mpirun tears the job down) or SIGSTOPped (rank 0's collective
//! times out after `TIERZERO_COMM_TIMEOUT_S` and aborts the job). Either way
//! the job must end within 60 s, with a non-zero status and a message that
//! says what happened.
#![cfg(feature = "mpi")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: a failed unwrap is a failed test"
)]

mod engine_support;

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use engine_support::{ds_config, scratch, Knobs};
use serde_json::json;

const BOUND: Duration = Duration::from_secs(60);

/// The pid of the rank `rank` whose environment carries `mark`.
fn rank_pid(mark: &str, rank: usize) -> Option<u32> {
    let want_mark = format!("TZ_FAULT_MARK={mark}");
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
            // mpirun itself does not carry a rank; a rank's exec'd binary does.
            let exe = std::fs::read_link(e.path().join("exe")).unwrap_or_default();
            if exe.file_name().is_some_and(|n| n == "tierzero") {
                return Some(pid);
            }
        }
    }
    None
}

fn alive(pid: u32) -> bool {
    // A zombie has no exe link; a live or stopped process does.
    std::fs::read_link(format!("/proc/{pid}/exe")).is_ok()
}

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -{sig} {pid}");
}

/// Starts 2 ranks of `tierzero train` on a tiny model; returns mpirun, the
/// metrics path and the scratch dir.
fn start(tag: &str, timeout_s: &str) -> (Child, PathBuf, String) {
    let dir = scratch(&format!("fault-{tag}"));
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    let cfg = json!({
        "model_type": "gpt2", "vocab_size": 256, "n_positions": 32, "n_embd": 32,
        "n_layer": 2, "n_head": 2, "n_inner": 64
    });
    std::fs::write(model.join("config.json"), cfg.to_string()).unwrap();
    std::fs::create_dir_all(dir.join("swap")).unwrap();
    let ds = ds_config(&Knobs::nvme(), &dir.join("swap"), 100_000);
    let ds_path = dir.join("ds_config.json");
    std::fs::write(&ds_path, ds.to_string()).unwrap();
    let metrics = dir.join("metrics.jsonl");
    let mark = format!("{tag}-{}", std::process::id());
    let child = Command::new("mpirun")
        .args(["-np", "2", "--oversubscribe", "--bind-to", "none"])
        .arg(env!("CARGO_BIN_EXE_tierzero"))
        .args(["train", "--steps", "100000", "--seq-len", "16"])
        .arg("--model")
        .arg(&model)
        .arg("--config")
        .arg(&ds_path)
        .arg("--metrics")
        .arg(&metrics)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("TIERZERO_COMM_TIMEOUT_S", timeout_s)
        .env("TZ_FAULT_MARK", &mark)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run mpirun (install openmpi-bin)");
    (child, metrics, mark)
}

/// Waits until rank 0 has written a step's metrics and both ranks are
/// found; returns (rank 0 pid, rank 1 pid).
fn wait_running(child: &mut Child, metrics: &Path, mark: &str) -> (u32, u32) {
    let t0 = Instant::now();
    loop {
        assert!(
            child.try_wait().unwrap().is_none(),
            "mpirun ended before the fault"
        );
        let stepped = std::fs::read_to_string(metrics).is_ok_and(|t| t.lines().count() >= 1);
        if let (true, Some(a), Some(b)) = (stepped, rank_pid(mark, 0), rank_pid(mark, 1)) {
            return (a, b);
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "no step within 120 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits for mpirun to end within [`BOUND`]; returns (status code, stderr,
/// seconds).
fn wait_end(mut child: Child, t0: Instant) -> (Option<i32>, String, f64) {
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            return (status.code(), err, t0.elapsed().as_secs_f64());
        }
        if t0.elapsed() > BOUND {
            let _ = child.kill();
            let mut err = String::new();
            let _ = child.stderr.take().unwrap().read_to_string(&mut err);
            panic!("the job did not end within {BOUND:?} after the fault; stderr:\n{err}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn killing_a_rank_ends_the_job_with_a_clear_error() {
    let (mut child, metrics, mark) = start("kill", "600");
    let (r0, r1) = wait_running(&mut child, &metrics, &mark);
    let t0 = Instant::now();
    signal(r1, "KILL");
    let (code, err, secs) = wait_end(child, t0);
    eprintln!("SIGKILL of rank 1: mpirun exited with {code:?} after {secs:.1} s:\n{err}");
    assert_ne!(code, Some(0));
    assert!(
        err.contains("rank 1") && err.contains("signal 9"),
        "mpirun should name the killed rank and the signal:\n{err}"
    );
    assert!(!alive(r0), "rank 0 (pid {r0}) still runs");
}

#[test]
fn a_hung_rank_makes_the_others_time_out_and_stop() {
    let (mut child, metrics, mark) = start("stop", "3");
    let (r0, r1) = wait_running(&mut child, &metrics, &mark);
    let t0 = Instant::now();
    signal(r1, "STOP");
    let (code, err, secs) = wait_end(child, t0);
    eprintln!("SIGSTOP of rank 1: mpirun exited with {code:?} after {secs:.1} s:\n{err}");
    if alive(r1) {
        // Not to leave a stopped process behind if mpirun did not kill it.
        signal(r1, "KILL");
    }
    assert_ne!(code, Some(0));
    assert!(
        err.contains("rank 0 of 2") && err.contains("got no answer from the other ranks within"),
        "rank 0 should say its collective timed out:\n{err}"
    );
    assert!(!alive(r0), "rank 0 (pid {r0}) still runs");
}

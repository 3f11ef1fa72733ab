//! Stopping `tierzero train` as users and schedulers do: SIGINT (Ctrl-C)
//! and SIGTERM (SLURM, Kubernetes) mid-run, on the built binary.
//!
//! The signal is delivered at a known step: a `step.backward:<n>:stop`
//! failpoint freezes the run (SIGSTOP) inside step 3, the test sends the
//! signal (pending while stopped) and SIGCONT. The run must then stop at a
//! step boundary (step 3, or a later one if the watcher saw the signal only
//! after step 3 ended), and:
//!
//! * exit 130 (SIGINT) or 143 (SIGTERM), with the `--json` summary and the
//!   metrics summary line saying `"stopped": "signal"`;
//! * with `--save-dir` (and `--save-every 5`, so the stop step is off the
//!   grid): the save dir opens at a checkpoint of exactly that step, which
//!   verifies, and resuming it to the end gives the `weight_sha256` of a
//!   run never stopped;
//! * without one: its weights are those of a run of just that many steps
//!   (constant lr: the schedule does not depend on the total);
//! * no swap file of the stopped run is left.
//!
//! A second signal during the stop's save aborts at once (the process dies
//! of the signal) and the last checkpoint stays whole.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failure is a panic

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tierzero::checkpoint::Checkpoint;

mod cli_support;

const TOTAL: u64 = 30;

fn setup(d: &Path) {
    std::fs::create_dir_all(d.join("model")).unwrap();
    let model = json!({"model_type": "gpt2", "vocab_size": 256, "n_positions": 32,
        "n_embd": 32, "n_layer": 2, "n_head": 2, "tie_word_embeddings": true});
    std::fs::write(d.join("model/config.json"), model.to_string()).unwrap();
    let text = "a run stopped by a signal resumes and ends the same. ".repeat(60);
    std::fs::write(d.join("data.txt"), text).unwrap();
    let swap = d.join("swap");
    std::fs::create_dir_all(&swap).unwrap();
    // Constant lr (no scheduler): the first k steps of any run are a
    // k-step run.
    let cfg = json!({
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
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

fn train(d: &Path, steps: u64, extra: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tierzero"));
    c.current_dir(d)
        .args([
            "train", "--config", "ds.json", "--data", "data.txt", "--json",
        ])
        .args(["--seq-len", "16", "--steps", &steps.to_string()])
        .args(extra)
        .env_remove("TIERZERO_FAILPOINT")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

fn summary(out: &Output, what: &str) -> Value {
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.trim()).unwrap_or_else(|e| {
        panic!(
            "{what}: no JSON summary ({e}): {text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// A run to completion; its summary.
fn complete(c: Command, what: &str) -> Value {
    let out = run_out(c);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    summary(&out, what)
}

fn run_out(mut c: Command) -> Output {
    c.spawn().unwrap().wait_with_output().unwrap()
}

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -{sig} {pid}");
}

/// Waits until `child` is stopped (state `T` in /proc).
fn wait_stopped(child: &mut Child) {
    let t0 = Instant::now();
    loop {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before its failpoint froze it"
        );
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", child.id())).unwrap();
        let state = stat.rsplit(')').next().unwrap().split_whitespace().next();
        if state == Some("T") {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "never stopped");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Our swap files in `d/swap/tierzero/` (left only by a process that did
/// not finish).
fn swap_files(d: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(d.join("swap/tierzero")) else {
        return Vec::new();
    };
    entries
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tzswap"))
        .collect()
}

/// Hits of `step.backward` per step (units with a backward), from a run
/// armed past its end.
fn backward_hits_per_step(d: &Path) -> u64 {
    let mut c = train(d, 1, &["--model", "model"]);
    c.env("TIERZERO_FAILPOINT", "step.backward:1000000");
    let out = run_out(c);
    let err = String::from_utf8_lossy(&out.stderr);
    let hits = err
        .split("step.backward=")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no hit counts: {err}"));
    assert!(hits > 0);
    hits
}

/// Runs `c` frozen mid step 3 by a failpoint, delivers `sig` and lets it
/// go on; returns its output.
fn stopped_by(mut c: Command, sig: &str, per_step: u64) -> Output {
    stopped_timed(c.env_remove("TIERZERO_FAILPOINT"), sig, per_step).0
}

/// [`stopped_by`], and the seconds from the signal to the exit.
fn stopped_timed(c: &mut Command, sig: &str, per_step: u64) -> (Output, f64) {
    c.env(
        "TIERZERO_FAILPOINT",
        format!("step.backward:{}:stop", 2 * per_step + 1),
    );
    let mut child = c.spawn().unwrap();
    wait_stopped(&mut child);
    let t0 = Instant::now();
    signal(child.id(), sig);
    signal(child.id(), "CONT");
    let out = child.wait_with_output().unwrap();
    (out, t0.elapsed().as_secs_f64())
}

fn check_stopped(out: &Output, sig: &str, code: i32, what: &str) -> (Value, u64) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{what}: {err}");
    assert!(!err.contains("panicked"), "{what}: {err}");
    assert!(
        err.contains(&format!(
            "{sig} received: stopping after the step in progress"
        )),
        "{what}: {err}"
    );
    let s = summary(out, what);
    assert_eq!(s["stopped"], json!("signal"), "{what}: {s}");
    assert_eq!(s["stop_signal"], json!(sig), "{what}: {s}");
    let step = s["steps"].as_u64().unwrap();
    // Step 3 or a later one: the watcher sees the signal within 20 ms, and
    // a step of this model takes about 10 ms.
    assert!((3..TOTAL).contains(&step), "{what}: stopped at step {step}");
    assert_eq!(s["final_step"].as_u64(), Some(step), "{what}");
    (s, step)
}

#[test]
fn sigint_and_sigterm_stop_at_a_step_boundary_with_a_checkpoint_of_it() {
    let d = cli_support::scratch("stop", "save");
    setup(&d);
    let per_step = backward_hits_per_step(&d);
    let reference = complete(train(&d, TOTAL, &["--model", "model"]), "reference");
    let ref_hash = reference["weight_sha256"].as_str().unwrap().to_owned();
    for (sig, code) in [("INT", 130), ("TERM", 143)] {
        let name = format!("SIG{sig}");
        let what = format!("{name} with --save-dir");
        let ck = format!("ck-{sig}");
        let metrics = format!("m-{sig}.jsonl");
        let mut c = train(
            &d,
            TOTAL,
            &[
                "--model",
                "model",
                "--save-dir",
                &ck,
                "--save-every",
                "5",
                "--metrics",
                &metrics,
            ],
        );
        let (out, secs) = stopped_timed(&mut c, sig, per_step);
        let (s, step) = check_stopped(&out, &name, code, &what);
        eprintln!("{what}: exit {code} at step {step}, {secs:.2} s after the signal");
        assert_eq!(s["checkpoint_step"].as_u64(), Some(step), "{what}: {s}");
        // The metrics file's summary line says so too.
        let text = std::fs::read_to_string(d.join(&metrics)).unwrap();
        let last: Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
        assert_eq!(last["summary"], json!(true), "{what}");
        assert_eq!(last["stopped"], json!("signal"), "{what}: {last}");
        assert_eq!(last["stop_signal"], json!(name), "{what}: {last}");
        assert_eq!(last["steps"].as_u64(), Some(step), "{what}");
        // The save dir opens at the step it stopped at, off the grid.
        let c = Checkpoint::open(&d.join(&ck)).unwrap();
        assert_eq!(c.step(), step, "{what}");
        assert!(c.verify().ok(), "{what}: {:?}", c.verify());
        let leftovers: Vec<String> = std::fs::read_dir(d.join(&ck))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".step-") || n.starts_with(".latest.tmp"))
            .collect();
        assert!(leftovers.is_empty(), "{what}: {leftovers:?}");
        assert_eq!(
            swap_files(&d),
            Vec::<String>::new(),
            "{what}: swap files left"
        );
        // Resumed, it ends with the bytes of the run never stopped.
        let resumed = complete(
            train(&d, TOTAL, &["--resume", &ck, "--save-dir", &ck]),
            &format!("{what}, resumed"),
        );
        assert_eq!(resumed["stopped"], Value::Null, "{what}");
        assert_eq!(
            resumed["weight_sha256"].as_str(),
            Some(ref_hash.as_str()),
            "{what}: the resumed run's weights differ from a run never stopped"
        );
        assert_eq!(swap_files(&d), Vec::<String>::new(), "{what}");
    }
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn sigint_and_sigterm_without_a_save_dir_stop_with_the_weights_of_that_step() {
    let d = cli_support::scratch("stop", "nosave");
    setup(&d);
    let per_step = backward_hits_per_step(&d);
    // SIGHUP (a closed terminal) too: its default action killed the run.
    for (sig, code) in [("INT", 130), ("TERM", 143), ("HUP", 129)] {
        let name = format!("SIG{sig}");
        let what = format!("{name} without --save-dir");
        let mut c = train(&d, TOTAL, &["--model", "model"]);
        if sig == "HUP" {
            c = hup_not_ignored(c);
        }
        let out = stopped_by(c, sig, per_step);
        let (s, step) = check_stopped(&out, &name, code, &what);
        assert_eq!(s["checkpoint_step"], Value::Null, "{what}: {s}");
        assert!(s.get("checkpoint_step").is_some(), "{what}: {s}");
        let text = String::from_utf8_lossy(&out.stderr);
        assert!(!text.contains("checkpoint:"), "{what}: {text}");
        assert_eq!(
            swap_files(&d),
            Vec::<String>::new(),
            "{what}: swap files left"
        );
        let short = complete(train(&d, step, &["--model", "model"]), "short run");
        assert_eq!(
            s["weight_sha256"], short["weight_sha256"],
            "{what}: the weights at the stop differ from a {step}-step run's"
        );
    }
    std::fs::remove_dir_all(&d).unwrap();
}

/// `c` with SIGHUP at its default action: a test run under `nohup` (a CI
/// job's) passes its ignored SIGHUP on, which the run rightly keeps.
fn hup_not_ignored(c: Command) -> Command {
    let ignored = std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("SigIgn:"))
        .and_then(|h| u64::from_str_radix(h.trim(), 16).ok())
        .is_some_and(|mask| mask & 1 != 0);
    if !ignored {
        return c;
    }
    let mut w = cli_support::hup_at_default(&c);
    w.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    w
}

/// Under `nohup` SIGHUP stays ignored: the run goes on to its last step.
#[test]
fn a_run_started_under_nohup_ignores_sighup() {
    let d = cli_support::scratch("stop", "nohup");
    setup(&d);
    let per_step = backward_hits_per_step(&d);
    let plain = train(&d, TOTAL, &["--model", "model"]);
    let mut c = Command::new("nohup");
    c.arg(plain.get_program())
        .args(plain.get_args())
        .current_dir(&d)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let out = stopped_by(c, "HUP", per_step);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(!err.contains("SIGHUP received"), "{err}");
    let s = summary(&out, "nohup");
    assert_eq!(s["stopped"], Value::Null, "{s}");
    assert_eq!(s["steps"].as_u64(), Some(TOTAL), "{s}");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_stop_whose_save_does_not_fit_the_grace_period_skips_it_and_says_so() {
    let d = cli_support::scratch("stop", "grace");
    setup(&d);
    let per_step = backward_hits_per_step(&d);
    let c = train(
        &d,
        TOTAL,
        &[
            "--model",
            "model",
            "--save-dir",
            "ck",
            "--save-every",
            "2",
            "--stop-grace",
            "0.000001",
        ],
    );
    let out = stopped_by(c, "TERM", per_step);
    let (s, step) = check_stopped(&out, "SIGTERM", 143, "a tiny --stop-grace");
    // The stop's save is skipped, on the --save-every grid or off it: the
    // newest checkpoint is the grid's before the stop.
    let newest = (step - 1) / 2 * 2;
    assert_eq!(s["checkpoint_step"].as_u64(), Some(newest), "{s}");
    assert_eq!(Checkpoint::open(&d.join("ck")).unwrap().step(), newest);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("the checkpoint of step {step} was skipped"))
            && err.contains("stop grace period")
            && err.contains(&format!(
                "this run's last checkpoint is step {newest}'s, ck/step-{newest:08}"
            )),
        "{err}"
    );
    assert_eq!(swap_files(&d), Vec::<String>::new());
    std::fs::remove_dir_all(&d).unwrap();
}

/// A signal during a `--save-every` save stops the run right after it, at
/// the step just saved: it went on to train the next step and save that
/// too, past the grace period a scheduler gives.
#[test]
fn a_signal_during_a_periodic_save_stops_at_the_step_saved() {
    let d = cli_support::scratch("stop", "periodic");
    setup(&d);
    let reference = complete(train(&d, TOTAL, &["--model", "model"]), "reference");
    let mut c = train(
        &d,
        TOTAL,
        &["--model", "model", "--save-dir", "ck", "--save-every", "2"],
    );
    // Frozen in the first save (step 2's), its files written.
    c.env("TIERZERO_FAILPOINT", "ckpt.before_rename:1:stop");
    let mut child = c.spawn().unwrap();
    wait_stopped(&mut child);
    signal(child.id(), "TERM");
    signal(child.id(), "CONT");
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(143), "{err}");
    let s = summary(&out, "a stop during a save");
    assert_eq!(s["stopped"], json!("signal"), "{s}");
    assert_eq!(s["steps"].as_u64(), Some(2), "{s}\n{err}");
    assert_eq!(s["checkpoint_step"].as_u64(), Some(2), "{s}");
    assert_eq!(
        tierzero::checkpoint::saved_steps(&d.join("ck")),
        vec![2],
        "{err}"
    );
    assert_eq!(swap_files(&d), Vec::<String>::new());
    let resumed = complete(
        train(&d, TOTAL, &["--resume", "ck", "--save-dir", "ck"]),
        "resumed",
    );
    assert_eq!(resumed["weight_sha256"], reference["weight_sha256"]);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_second_signal_aborts_at_once_and_the_last_checkpoint_stays_whole() {
    let d = cli_support::scratch("stop", "second");
    setup(&d);
    let reference = complete(train(&d, TOTAL, &["--model", "model"]), "reference");
    // A checkpoint of step 2, then a run from it that is frozen in its
    // stop's save (the first write of a state file), signalled again.
    complete(
        train(&d, 2, &["--model", "model", "--save-dir", "ck"]),
        "first part",
    );
    let mut c = train(
        &d,
        1000,
        &["--resume", "ck", "--save-dir", "ck", "--metrics", "m.jsonl"],
    );
    c.env("TIERZERO_FAILPOINT", "ckpt.state_write:1:stop");
    let mut child = c.spawn().unwrap();
    let t0 = Instant::now();
    while !std::fs::read_to_string(d.join("m.jsonl")).is_ok_and(|t| t.lines().count() >= 2) {
        assert!(t0.elapsed() < Duration::from_secs(60), "no step");
        std::thread::sleep(Duration::from_millis(5));
    }
    signal(child.id(), "INT");
    wait_stopped(&mut child);
    signal(child.id(), "INT");
    signal(child.id(), "CONT");
    let out = child.wait_with_output().unwrap();
    use std::os::unix::process::ExitStatusExt as _;
    assert_eq!(
        out.status.signal(),
        Some(2),
        "the second SIGINT must kill it: {:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    // The last whole checkpoint is still the one the save dir opens at;
    // the stop's staging dir is never opened.
    let c = Checkpoint::open(&d.join("ck")).unwrap();
    assert_eq!(c.step(), 2);
    assert!(c.verify().ok());
    let names: Vec<String> = std::fs::read_dir(d.join("ck"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let staging: Vec<&String> = names.iter().filter(|n| n.starts_with(".step-")).collect();
    assert_eq!(staging.len(), 1, "{names:?}");
    assert!(Checkpoint::open(&d.join("ck").join(staging[0])).is_err());
    // Killed, it left its swap files; the next start reclaims them, and
    // resuming ends as the run never stopped.
    assert!(!swap_files(&d).is_empty());
    let resumed = complete(
        train(&d, TOTAL, &["--resume", "ck", "--save-dir", "ck"]),
        "resumed",
    );
    assert_eq!(resumed["weight_sha256"], reference["weight_sha256"]);
    assert_eq!(swap_files(&d), Vec::<String>::new());
    std::fs::remove_dir_all(&d).unwrap();
}

/// A signal during start-up ends the run at once with the stop's exit
/// code, removing the save dir it made: there is nothing to save, and the
/// start-up may be blocked (here
/// in the open of a FIFO no one writes) or busy for minutes (encoding a
/// corpus). It was put off until after the first step, which a blocked
/// start-up never reached: only a second signal ended it.
/// `child`, still running half a second after its start (blocked, as
/// `what` would say otherwise), sent `sig`: its output once it ends, which
/// must be within 20 s.
fn blocked_then_signalled(mut child: Child, sig: &str, what: &str) -> Output {
    std::thread::sleep(Duration::from_millis(500));
    assert!(child.try_wait().unwrap().is_none(), "{what}");
    signal(child.id(), sig);
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("still running 20 s after SIG{sig}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn a_signal_during_start_up_ends_it_at_once() {
    let d = cli_support::scratch("stop", "start-up");
    setup(&d);
    let fifo = d.join("corpus.fifo");
    let made = Command::new("mkfifo").arg(&fifo).status();
    if !made.is_ok_and(|s| s.success()) {
        cli_support::skipped("mkfifo failed");
        return;
    }
    let child = Command::new(env!("CARGO_BIN_EXE_tierzero"))
        .current_dir(&d)
        .args(["train", "--config", "ds.json", "--model", "model", "--data"])
        .arg(&fifo)
        .args(["--seq-len", "16", "--steps", "2", "--save-dir", "new/ck"])
        .env_remove("TIERZERO_FAILPOINT")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Blocked in the FIFO's open (or still starting): not ended.
    let out = blocked_then_signalled(child, "TERM", "ended without a writer");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(143), "{stderr}");
    assert!(
        stderr.contains("SIGTERM received during start-up: exiting"),
        "{stderr}"
    );
    // The save dir the start-up made (and its parent) is gone again.
    assert!(!d.join("new").exists(), "the start-up's save dir stays");
}

/// A signal while the trainer is built (the initial state's store, which
/// takes minutes for a model larger than memory) ends the build there: no
/// step, no swap file, the save dir it created gone. It used to wait for
/// the first step.
#[test]
fn a_signal_during_the_build_ends_it_there() {
    let d = cli_support::scratch("stop", "build");
    setup(&d);
    // About 4.2M params in 212 sub-groups of NVMe state: the store takes
    // about 0.2 s here, far beyond the watcher's 20 ms poll.
    let model = json!({"model_type": "gpt2", "vocab_size": 4096, "n_positions": 64,
        "n_embd": 256, "n_layer": 4, "n_head": 4, "tie_word_embeddings": true});
    std::fs::create_dir_all(d.join("big")).unwrap();
    std::fs::write(d.join("big/config.json"), model.to_string()).unwrap();
    let swap = d.join("swap");
    let cfg = json!({
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": swap},
            "offload_optimizer": {"device": "nvme", "nvme_path": swap},
            "sub_group_size": 20000
        }
    });
    std::fs::write(d.join("ds-big.json"), cfg.to_string()).unwrap();
    for (sig, code) in [("INT", 130), ("TERM", 143)] {
        let mut c = Command::new(env!("CARGO_BIN_EXE_tierzero"));
        c.current_dir(&d)
            .args(["train", "--config", "ds-big.json", "--model", "big"])
            .args(["--data", "data.txt", "--seq-len", "16", "--steps", "3"])
            .args(["--save-dir", "new/ck", "--json"])
            .env("TIERZERO_FAILPOINT", "build.initial:1:stop")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = c.spawn().unwrap();
        // Frozen after the first sub-group's store: the swap files exist.
        wait_stopped(&mut child);
        assert!(
            !swap_files(&d).is_empty(),
            "SIG{sig}: no swap file mid-build"
        );
        signal(child.id(), sig);
        signal(child.id(), "CONT");
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "SIG{sig}: {err}");
        assert!(!err.contains("panicked"), "SIG{sig}: {err}");
        assert!(
            err.contains(&format!("SIG{sig} received: stopping the trainer's build")),
            "SIG{sig}: {err}"
        );
        assert!(
            err.contains(&format!(
                "stopped by SIG{sig} while the trainer was being built ("
            )) && err.contains("no step was trained, nothing was saved"),
            "SIG{sig}: {err}"
        );
        assert!(!err.contains("step 1/3"), "SIG{sig}: a step ran: {err}");
        let s = summary(&out, "stopped build");
        assert_eq!(s["steps_run"], json!(0), "SIG{sig}: {s}");
        assert_eq!(s["stopped"], json!("signal"), "SIG{sig}: {s}");
        assert_eq!(
            s["stop_signal"],
            json!(format!("SIG{sig}")),
            "SIG{sig}: {s}"
        );
        assert_eq!(s["stopped_in_build"], json!(true), "SIG{sig}: {s}");
        assert_eq!(swap_files(&d), Vec::<String>::new(), "SIG{sig}");
        assert!(!d.join("new").exists(), "SIG{sig}: the save dir stays");
    }
}

/// `--metrics` on a FIFO with no reader: the trainer's build waited in
/// its open, where no signal could end it. Now start-up opens it, says it
/// waits, and a signal there ends the run at once.
#[test]
fn a_metrics_fifo_without_a_reader_waits_in_start_up() {
    let d = cli_support::scratch("stop", "metrics-fifo");
    setup(&d);
    let fifo = d.join("m.fifo");
    let made = Command::new("mkfifo").arg(&fifo).status();
    if !made.is_ok_and(|s| s.success()) {
        cli_support::skipped("mkfifo failed");
        return;
    }
    let mut c = train(&d, 2, &["--model", "model", "--metrics", "m.fifo"]);
    let out = blocked_then_signalled(c.spawn().unwrap(), "INT", "ended without a reader");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(
        err.contains("--metrics m.fifo is a FIFO: waiting for its reader"),
        "{err}"
    );
    assert!(err.contains("SIGINT received during start-up"), "{err}");
    assert_eq!(swap_files(&d), Vec::<String>::new());
    // --json: the summary object says so (stdout was empty).
    let s = summary(&out, "stopped start-up");
    assert_eq!(s["steps_run"], json!(0), "{s}");
    assert_eq!(s["stop_signal"], json!("SIGINT"), "{s}");
    assert_eq!(s["stopped_in_start_up"], json!(true), "{s}");
}

/// Swap files a killed run of another number of ranks left (under
/// `<nvme_path>/rank<R>/`, where a 2-rank run keeps them) are reclaimed by
/// the next run on the path, of any rank count: a run looked only at its
/// own dir, and `inspect` promised the next run would remove them.
#[test]
fn a_run_reclaims_the_swap_files_another_rank_count_left() {
    let d = cli_support::scratch("stop", "other-count");
    setup(&d);
    let gone = Command::new("true").spawn().unwrap();
    let pid = gone.id();
    let _ = gone.wait_with_output();
    let left: Vec<std::path::PathBuf> = ["rank0", "rank1"]
        .iter()
        .map(|r| {
            let dir = d.join("swap").join(r).join("tierzero");
            std::fs::create_dir_all(&dir).unwrap();
            let f = dir.join(format!("swap-{pid}-0-0.tzswap"));
            std::fs::write(&f, vec![0u8; 4096]).unwrap();
            f
        })
        .collect();
    complete(train(&d, 1, &["--model", "model"]), "a 1-rank run");
    for f in &left {
        assert!(!f.exists(), "{} stays", f.display());
    }
    std::fs::remove_dir_all(&d).unwrap();
}

/// Swap data changed under a run (here between its steps, as a failing
/// device or another writer would) is a disk fault: exit 2, the checksum
/// mismatch named, with what to check and the way on. It was "internal
/// error" (exit 1) with no hint.
#[test]
fn damaged_swap_data_is_a_disk_fault_with_the_way_on() {
    let d = cli_support::scratch("stop", "damage");
    setup(&d);
    let mut c = train(&d, 4, &["--model", "model"]);
    c.env("TIERZERO_FAILPOINT", "step.backward:3:stop");
    let mut child = c.spawn().unwrap();
    wait_stopped(&mut child);
    // Every swap file's bytes flipped, one in each 4 KiB.
    let files = swap_files(&d);
    assert!(!files.is_empty());
    for f in &files {
        let p = d.join("swap/tierzero").join(f);
        let mut bytes = std::fs::read(&p).unwrap();
        for b in bytes.iter_mut().step_by(4096) {
            *b ^= 0xff;
        }
        std::fs::write(&p, bytes).unwrap();
    }
    signal(child.id(), "CONT");
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    for want in ["checksum mismatch", "a disk fault", "dmesg", "--resume"] {
        assert!(stderr.contains(want), "{want}: {stderr}");
    }
    assert!(!stderr.contains("internal error"), "{stderr}");
}

//! Running the built `tierzero` binary from integration tests.
#![allow(clippy::expect_used, dead_code)] // tests; not every test file uses every helper

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// A fresh, empty directory `<prefix>-<tag>-<pid>-<n>` under cargo's
/// per-target tmp dir (removed first if a killed earlier run left it).
pub fn scratch(prefix: &str, tag: &str) -> PathBuf {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("{prefix}-{tag}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("create a scratch dir");
    d
}

/// What a run of the binary produced.
pub struct Out {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `tierzero ARGS...`, in `cwd` when given.
pub fn run_tierzero(cwd: Option<&Path>, args: &[&str]) -> Out {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tierzero"));
    cmd.args(args);
    if let Some(d) = cwd {
        cmd.current_dir(d);
    }
    let out = cmd.output().expect("run tierzero");
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Asserts a user mistake's output: exit code 2, no panic, and stderr is one
/// line starting with `error: ` that contains every one of `words`.
pub fn assert_bad_input(out: &Out, what: &str, words: &[&str]) {
    assert_eq!(
        out.code, 2,
        "{what}: stdout {} stderr {}",
        out.stdout, out.stderr
    );
    assert!(!out.stderr.contains("panicked"), "{what}: {}", out.stderr);
    assert!(!out.stderr.contains("backtrace"), "{what}: {}", out.stderr);
    let lines: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| !l.trim().is_empty())
        .collect();
    assert_eq!(lines.len(), 1, "{what}: not one line: {}", out.stderr);
    assert!(lines[0].starts_with("error: "), "{what}: {}", lines[0]);
    for w in words {
        assert!(
            lines[0].contains(w),
            "{what}: `{w}` missing from: {}",
            lines[0]
        );
    }
}

/// `tierzero train` in `d` on `ds.json` / `data.txt` (seq 16) for `total`
/// steps, saving every step into `save` and writing `metrics`; resumed from
/// `save`, or from `model/` when starting. No failpoint from the caller's
/// environment; pipes for stdout and stderr (crash and fault tests).
pub fn train_saving(d: &Path, total: u64, save: &str, resume: bool, metrics: &str) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tierzero"));
    c.current_dir(d)
        .args(["train", "--config", "ds.json", "--data", "data.txt"])
        .args(["--seq-len", "16", "--steps", &total.to_string()])
        .args([
            "--save-dir",
            save,
            "--save-every",
            "1",
            "--metrics",
            metrics,
        ])
        .env_remove("TIERZERO_FAILPOINT")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if resume {
        c.args(["--resume", save]);
    } else {
        c.args(["--model", "model"]);
    }
    c
}

/// `c` run through `env --default-signal=HUP`: a test run under `nohup` (a
/// CI job's) hands its ignored SIGHUP on to what it starts, which rightly
/// keeps it ignored, so a test of what a SIGHUP does would see nothing.
/// The program, arguments, directory and environment changes are `c`'s;
/// stdio is the caller's to set.
pub fn hup_at_default(c: &std::process::Command) -> std::process::Command {
    let mut w = std::process::Command::new("env");
    w.arg("--default-signal=HUP")
        .arg(c.get_program())
        .args(c.get_args());
    if let Some(d) = c.get_current_dir() {
        w.current_dir(d);
    }
    for (k, v) in c.get_envs() {
        match v {
            Some(v) => w.env(k, v),
            None => w.env_remove(k),
        };
    }
    w
}

/// A test that cannot run here says so where CI's log shows it, naming
/// itself: the harness captures a passing test's `eprintln!`, so every
/// skip showed as a plain `ok`.
pub fn skipped(why: impl std::fmt::Display) {
    use std::io::Write as _;
    let test = std::thread::current().name().unwrap_or("?").to_owned();
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}

/// Waits (up to 60 s) until `child` is frozen by its failpoint (state
/// `T` in /proc), failing if it ends first.
pub fn wait_frozen(child: &mut std::process::Child) {
    let t0 = std::time::Instant::now();
    loop {
        assert!(
            child.try_wait().expect("poll the child").is_none(),
            "ended before the failpoint"
        );
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", child.id()))
            .expect("read the child's /proc stat");
        if stat
            .rsplit(')')
            .next()
            .and_then(|s| s.split_whitespace().next())
            == Some("T")
        {
            return;
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(60),
            "never stopped"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// The built binary run in `cwd` with `args`, its stdin closed and its
/// output piped, armed with the failpoint `failpoint`
/// (`TIERZERO_FAILPOINT`, a `stop` action), once frozen there
/// ([`wait_frozen`]).
pub fn spawn_frozen(cwd: &Path, args: &[&str], failpoint: &str) -> std::process::Child {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tierzero"))
        .current_dir(cwd)
        .args(args)
        .env("TIERZERO_FAILPOINT", failpoint)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run tierzero");
    wait_frozen(&mut child);
    child
}

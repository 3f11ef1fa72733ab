//! The swap directory lock: one process per `nvme_path`, shared by the
//! spaces of one process, and never left blocking by a killed holder. The
//! second process is this test binary re-run as a child.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tierzero_swap::lock::LOCK_FILE;
use tierzero_swap::space::SWAP_SUBDIR;
use tierzero_swap::{SpaceConfig, SwapError, SwapSpace};

const CHILD_ENV: &str = "TIERZERO_SWAP_LOCK_CHILD_DIR";

fn test_dir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Not a test of its own: the child half of the cross-process tests. It
/// holds a space on the directory named by the environment and waits to be
/// killed (at most a minute, so a broken parent cannot leave it behind).
#[test]
fn child_holds_a_space() {
    let Ok(dir) = std::env::var(CHILD_ENV) else {
        return;
    };
    let space = SwapSpace::create(SpaceConfig::new(&dir, 1 << 20)).unwrap();
    println!("HOLDING {}", std::process::id());
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(space);
}

struct Child {
    child: std::process::Child,
}

impl Child {
    /// Starts the child on `dir` and waits until it holds the lock.
    fn hold(dir: &Path) -> Child {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_holds_a_space", "--nocapture"])
            .args(["--test-threads=1"])
            .env(CHILD_ENV, dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let mut line = String::new();
        let mut reader = BufReader::new(out);
        loop {
            line.clear();
            let n = reader.read_line(&mut line).unwrap();
            assert!(n > 0, "child exited before holding the lock");
            if line.contains("HOLDING") {
                break;
            }
        }
        Child { child }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn kill(&mut self) {
        // std's kill is SIGKILL: the child cannot release anything itself.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        self.kill();
    }
}

#[test]
fn second_process_is_refused_and_a_killed_holder_does_not_block() {
    let d = test_dir();
    let swap_dir: PathBuf = d.path().join(SWAP_SUBDIR);
    let mut child = Child::hold(d.path());
    let before = names(&swap_dir);
    let child_file = before
        .iter()
        .find(|n| n.starts_with(&format!("swap-{}-", child.pid())))
        .cloned()
        .expect("the child's swap file");
    let child_len = std::fs::metadata(swap_dir.join(&child_file)).unwrap().len();
    assert!(before.contains(&LOCK_FILE.to_owned()), "{before:?}");

    // The second process (us) is refused, naming the lock and the holder.
    let err = SwapSpace::create(SpaceConfig::new(d.path(), 1 << 20)).unwrap_err();
    match &err {
        SwapError::Locked { path, holder_pid } => {
            assert_eq!(path, &swap_dir.join(LOCK_FILE));
            assert_eq!(*holder_pid, Some(child.pid()));
        }
        other => panic!("{other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains(&swap_dir.join(LOCK_FILE).display().to_string())
            && msg.contains(&format!("pid {}", child.pid()))
            && msg.contains("nvme_path"),
        "{msg}"
    );
    // Nothing of the holder's was touched, and we left nothing behind.
    assert_eq!(names(&swap_dir), before);
    assert_eq!(
        std::fs::metadata(swap_dir.join(&child_file)).unwrap().len(),
        child_len
    );

    // SIGKILL: the kernel drops the flock; the lock file (with the dead
    // pid) and the swap file stay behind, and neither blocks us.
    let dead = child.pid();
    child.kill();
    assert!(swap_dir.join(LOCK_FILE).exists());
    let space = SwapSpace::create(SpaceConfig::new(d.path(), 1 << 20)).unwrap();
    let now = names(&swap_dir);
    assert!(
        !now.iter().any(|n| n.starts_with(&format!("swap-{dead}-"))),
        "the dead holder's swap file was reclaimed: {now:?}"
    );
    let holder = std::fs::read_to_string(swap_dir.join(LOCK_FILE)).unwrap();
    assert_eq!(holder.trim(), std::process::id().to_string());
    drop(space);
    assert!(!swap_dir.join(LOCK_FILE).exists());
}

#[test]
fn spaces_of_one_process_share_the_lock_under_any_spelling() {
    let d = test_dir();
    let link = d.path().join("alias");
    let real = d.path().join("real");
    std::fs::create_dir(&real).unwrap();
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let a = SwapSpace::create(SpaceConfig::new(&real, 1 << 20)).unwrap();
    // Same directory through a symlink and through a `..` detour: one lock.
    let b = SwapSpace::create(SpaceConfig::new(&link, 1 << 20)).unwrap();
    let c = SwapSpace::create(SpaceConfig::new(real.join("..").join("real"), 1 << 20)).unwrap();
    let lock = real.join(SWAP_SUBDIR).join(LOCK_FILE);
    assert_eq!(
        std::fs::read_to_string(&lock).unwrap().trim(),
        std::process::id().to_string()
    );
    drop(a);
    drop(b);
    assert!(lock.exists(), "released while a space still uses it");
    drop(c);
    assert!(!lock.exists());
    // We created tierzero/, so the last space removed it (lock file first).
    assert!(!real.join(SWAP_SUBDIR).exists());
}

//! Failpoints: named places where a test makes this process die or an
//! operation fail, so crash safety is tested at exact, reproducible points
//! instead of at random wall-clock moments.
//!
//! # Use
//!
//! `TIERZERO_FAILPOINT=<site>:<n>[:<action>]`, read once per process. The
//! `n`-th time (from 1) execution reaches `<site>`, the action runs:
//!
//! * `kill` (default): the process sends itself `SIGKILL` and dies there,
//!   exactly as if the OOM killer or `kill -9` had struck: no destructor,
//!   no flush, no unwinding. Unlike `std::process::abort` (SIGABRT, a
//!   catchable signal) it is indistinguishable from an outside kill.
//! * `stop`: the process sends itself `SIGSTOP` and freezes there, holding
//!   its files and locks, until a `SIGCONT` or a `SIGKILL`; a test uses it
//!   to act while the process is known to be mid-run.
//! * `enospc`, `eio`: only at I/O sites ([`Site::can_fail`]): the operation
//!   fails with that errno instead of running, and the caller reports it as
//!   it would report the real error (naming the file and the operation).
//!
//! Other hits of the site, and every other site, run normally.
//!
//! # Design
//!
//! * **Few, named, here.** Every site is a [`Site`] variant, documented
//!   below with where it is and what a kill there leaves on disk. Adding
//!   one is adding a variant and one call.
//! * **Free when unset.** The variable is parsed once into a `OnceLock`;
//!   with nothing armed a site costs one atomic load and a branch. No
//!   cargo feature: the crash tests run the same binary users run.
//! * **Safe code only.** The main crate denies `unsafe`, so the signal is
//!   sent with `kill(1)` (`kill -KILL <own pid>`); the hitting thread
//!   blocks on it and never returns. Other threads may run for the
//!   milliseconds that takes, as they would under an outside kill. If
//!   `kill(1)` is missing, `abort()` is the fallback (still no destructors).
//! * **Counted per site**, across threads (atomics), so `n` picks the same
//!   point in every run of a deterministic workload: a seed chooses
//!   `(site, n)` and the crash is reproducible.
//! * A malformed variable is an error at start-up ([`check_env`], called by
//!   `tierzero train`), never silently ignored.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// The environment variable that arms a failpoint.
pub const ENV_VAR: &str = "TIERZERO_FAILPOINT";

/// A named place in the code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Site {
    /// `step.backward`: after each unit's backward in a training step,
    /// before its gradients reach the optimizer. A kill is "mid-step":
    /// parameters and optimizer state on NVMe may be from different
    /// steps; only checkpoints count.
    StepBackward,
    /// `optim.write_back`: after the optimizer submitted one sub-group's
    /// NVMe state write-back, before it completed. A kill leaves the swap
    /// file half updated (and its `swap-<pid>-*.tzswap` files behind).
    OptimWriteBack,
    /// `ckpt.state_write`: before each sub-group region of each checkpoint
    /// state file is written. A kill leaves a staging dir with a partly
    /// written state file; `enospc`/`eio` fail that write.
    CkptStateWrite,
    /// `ckpt.manifest_write`: halfway through writing the manifest's
    /// temporary file in the staging dir.
    CkptManifestWrite,
    /// `ckpt.before_rename`: the staging dir is complete and synced
    /// (manifest included), not yet renamed to `step-<N>`.
    CkptBeforeRename,
    /// `ckpt.before_latest`: `step-<N>` is renamed into place and the save
    /// dir synced; `latest` still names the previous checkpoint.
    CkptBeforeLatest,
    /// `ckpt.latest_write`: halfway through writing `latest`'s temporary
    /// file (the old `latest` is still in place).
    CkptLatestWrite,
    /// `optim.before_commit`: every speculative step of a step is written
    /// to its speculation pool slot, none committed yet. A kill leaves old and
    /// new state side by side in the swap file; only checkpoints count.
    SpeculativeBeforeCommit,
    /// `data.encode`: a text corpus's cache key is taken (its content read
    /// once) and the cache's temporary file made, its encode not begun. A
    /// stop lets a test change the file between the two reads, or signal
    /// the encode.
    DataEncode,
    /// `build.initial`: after each sub-group's initial weights and
    /// optimizer state are stored into the tiers, while the trainer is
    /// built. A stop lets a test signal the build.
    BuildInitial,
    /// `bench.file_made`: `bench-io` / `tune` made and preallocated their
    /// file, their signal watcher not yet started. A stop lets a test
    /// signal them there.
    BenchFileMade,
    /// `export.write`: `export` made its output's directories and its
    /// model file's temporary file, nothing written into it yet. A stop
    /// lets a test signal it there.
    ExportWrite,
}

impl Site {
    /// Every site.
    pub const ALL: [Site; 12] = [
        Site::StepBackward,
        Site::OptimWriteBack,
        Site::CkptStateWrite,
        Site::CkptManifestWrite,
        Site::CkptBeforeRename,
        Site::CkptBeforeLatest,
        Site::CkptLatestWrite,
        Site::SpeculativeBeforeCommit,
        Site::DataEncode,
        Site::BuildInitial,
        Site::BenchFileMade,
        Site::ExportWrite,
    ];

    /// The name used in [`ENV_VAR`].
    pub fn name(self) -> &'static str {
        match self {
            Site::StepBackward => "step.backward",
            Site::OptimWriteBack => "optim.write_back",
            Site::CkptStateWrite => "ckpt.state_write",
            Site::CkptManifestWrite => "ckpt.manifest_write",
            Site::CkptBeforeRename => "ckpt.before_rename",
            Site::CkptBeforeLatest => "ckpt.before_latest",
            Site::CkptLatestWrite => "ckpt.latest_write",
            Site::SpeculativeBeforeCommit => "optim.before_commit",
            Site::DataEncode => "data.encode",
            Site::BuildInitial => "build.initial",
            Site::BenchFileMade => "bench.file_made",
            Site::ExportWrite => "export.write",
        }
    }

    /// Whether the site is an I/O operation that can be made to fail
    /// (`enospc`, `eio`) rather than only kill or stop.
    pub fn can_fail(self) -> bool {
        matches!(
            self,
            Site::CkptStateWrite | Site::CkptManifestWrite | Site::CkptLatestWrite
        )
    }

    fn index(self) -> usize {
        match self {
            Site::StepBackward => 0,
            Site::OptimWriteBack => 1,
            Site::CkptStateWrite => 2,
            Site::CkptManifestWrite => 3,
            Site::CkptBeforeRename => 4,
            Site::CkptBeforeLatest => 5,
            Site::CkptLatestWrite => 6,
            Site::SpeculativeBeforeCommit => 7,
            Site::DataEncode => 8,
            Site::BuildInitial => 9,
            Site::BenchFileMade => 10,
            Site::ExportWrite => 11,
        }
    }
}

/// What happens at the armed hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// SIGKILL this process.
    Kill,
    /// SIGSTOP this process.
    Stop,
    /// Fail the operation with `ENOSPC`.
    NoSpace,
    /// Fail the operation with `EIO`.
    Eio,
}

/// A parsed [`ENV_VAR`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Armed {
    /// Where.
    pub site: Site,
    /// Which hit, from 1.
    pub nth: u64,
    /// What.
    pub action: Action,
}

/// Parses `<site>:<n>[:<action>]`.
pub fn parse(text: &str) -> Result<Armed, String> {
    let mut it = text.trim().split(':');
    let name = it.next().unwrap_or("");
    let site = Site::ALL
        .into_iter()
        .find(|s| s.name() == name)
        .ok_or_else(|| {
            format!(
                "{ENV_VAR}={text:?}: unknown site {name:?}; sites are {}",
                Site::ALL.map(Site::name).join(", ")
            )
        })?;
    let nth: u64 = it
        .next()
        .and_then(|n| n.parse().ok())
        .filter(|&n| n >= 1)
        .ok_or_else(|| {
            format!("{ENV_VAR}={text:?}: give the hit to act on as <site>:<n>, n >= 1")
        })?;
    let action = match it.next() {
        None | Some("kill") => Action::Kill,
        Some("stop") => Action::Stop,
        Some("enospc") => Action::NoSpace,
        Some("eio") => Action::Eio,
        Some(other) => {
            return Err(format!(
                "{ENV_VAR}={text:?}: unknown action {other:?}; use kill, stop, enospc or eio"
            ))
        }
    };
    if it.next().is_some() {
        return Err(format!(
            "{ENV_VAR}={text:?}: expected <site>:<n>[:<action>]"
        ));
    }
    if matches!(action, Action::NoSpace | Action::Eio) && !site.can_fail() {
        return Err(format!(
            "{ENV_VAR}={text:?}: {} is not an I/O site; it can only kill or stop",
            site.name()
        ));
    }
    Ok(Armed { site, nth, action })
}

struct State {
    armed: Option<Armed>,
    error: Option<String>,
    hits: [AtomicU64; Site::ALL.len()],
}

static STATE: OnceLock<State> = OnceLock::new();

fn state() -> &'static State {
    STATE.get_or_init(|| {
        let (armed, error) = match std::env::var(ENV_VAR) {
            Ok(v) if !v.is_empty() => match parse(&v) {
                Ok(a) => (Some(a), None),
                Err(e) => (None, Some(e)),
            },
            _ => (None, None),
        };
        State {
            armed,
            error,
            hits: Default::default(),
        }
    })
}

/// The armed failpoint, or the reason [`ENV_VAR`] does not parse.
pub fn check_env() -> Result<Option<Armed>, String> {
    let s = state();
    match &s.error {
        Some(e) => Err(e.clone()),
        None => Ok(s.armed),
    }
}

/// How often `site` was reached; counted only while a failpoint is armed
/// (with nothing armed nothing is counted, to keep sites free).
pub fn hits(site: Site) -> u64 {
    state().hits[site.index()].load(Ordering::Relaxed)
}

/// The action for this hit of `site`, if it is the armed one.
fn reached(site: Site) -> Option<Action> {
    let s = state();
    let a = s.armed?;
    let n = s.hits[site.index()].fetch_add(1, Ordering::Relaxed) + 1;
    (a.site == site && n == a.nth).then_some(a.action)
}

fn signal_self(signal: &str) {
    let pid = std::process::id().to_string();
    let _ = std::process::Command::new("kill")
        .args([signal, &pid])
        .status();
}

fn act(site: Site, action: Action) {
    match action {
        Action::Kill => {
            tracing::debug!(site = site.name(), "failpoint: SIGKILL");
            signal_self("-KILL");
            // kill(1) has returned: the signal is pending or delivered.
            // Give it a moment, then die the nearest other way.
            std::thread::sleep(std::time::Duration::from_secs(5));
            std::process::abort();
        }
        Action::Stop => {
            tracing::debug!(site = site.name(), "failpoint: SIGSTOP");
            signal_self("-STOP");
        }
        Action::NoSpace | Action::Eio => {}
    }
}

/// A site that can only kill or stop.
#[inline]
pub fn kill_point(site: Site) {
    if let Some(action) = reached(site) {
        act(site, action);
    }
}

/// An I/O site: kills or stops like [`kill_point`], or returns the armed
/// error for the caller to report as its own operation's failure.
#[inline]
pub fn io_point(site: Site) -> std::io::Result<()> {
    match reached(site) {
        None => Ok(()),
        Some(Action::NoSpace) => Err(injected(site, ENOSPC)),
        Some(Action::Eio) => Err(injected(site, EIO)),
        Some(action) => {
            act(site, action);
            Ok(())
        }
    }
}

/// Linux errnos (the main crate has no libc).
const ENOSPC: i32 = 28;
const EIO: i32 = 5;

fn injected(site: Site, errno: i32) -> std::io::Error {
    let os = std::io::Error::from_raw_os_error(errno);
    std::io::Error::new(
        os.kind(),
        format!("{os} (injected by {ENV_VAR} at {})", site.name()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sites_counts_and_actions() {
        for s in Site::ALL {
            let a = parse(&format!("{}:3", s.name())).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!((a.site, a.nth, a.action), (s, 3, Action::Kill));
        }
        let a = parse("ckpt.state_write:2:enospc").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(a.action, Action::NoSpace);
        assert_eq!(
            parse("step.backward:1:stop").map(|a| a.action),
            Ok(Action::Stop)
        );
        for bad in [
            "",
            "nowhere:1",
            "step.backward",
            "step.backward:0",
            "step.backward:x",
            "step.backward:1:eio",
            "ckpt.state_write:1:explode",
            "ckpt.state_write:1:eio:more",
        ] {
            assert!(parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn injected_errors_are_the_errno() {
        let e = injected(Site::CkptStateWrite, ENOSPC);
        assert_eq!(e.kind(), std::io::ErrorKind::StorageFull);
        assert!(e.to_string().contains("ckpt.state_write"), "{e}");
        assert_eq!(
            injected(Site::CkptLatestWrite, EIO).kind(),
            std::io::Error::from_raw_os_error(EIO).kind()
        );
    }
}

//! Other processes: signals to them, for `tierzero launch` and mpirun
//! (the main crate denies unsafe code; `kill(2)` and `prctl(2)` are here,
//! as [`crate::space::process_alive`]'s `kill(pid, 0)` is in `space`), and
//! [`OwnPaths`]: which files named with a pid are in use.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

/// The paths this process is writing whose names carry its pid (the swap
/// files, the checkpoint staging dirs). A path named with another pid is
/// in use while that process lives; one named with this process's pid is
/// in use only while listed here: otherwise it is a dead process's that had
/// the same pid (in a container every restart may be pid 1), and leaving
/// it would keep a full-size file forever, or make this process's
/// `create_new` of the same name fail. Matched by file name (unique within
/// a process for both users), however the directory is spelled.
#[derive(Debug)]
pub struct OwnPaths(Mutex<Vec<PathBuf>>);

impl OwnPaths {
    /// None listed.
    pub const fn new() -> Self {
        OwnPaths(Mutex::new(Vec::new()))
    }

    fn list(&self) -> MutexGuard<'_, Vec<PathBuf>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lists `path` (before it is created, so no other thread's clean-up
    /// can take it for a dead process's).
    pub fn add(&self, path: PathBuf) {
        self.list().push(path);
    }

    /// Unlists `path` (removed, or handed to its final name).
    pub fn remove(&self, path: &Path) {
        self.list().retain(|p| p != path);
    }

    /// Whether the file or dir at `path`, named with `pid`, may be in use.
    pub fn in_use(&self, pid: u32, path: &Path) -> bool {
        if pid == std::process::id() {
            let name: Option<&OsStr> = path.file_name();
            self.list().iter().any(|p| p.file_name() == name)
        } else {
            crate::space::process_alive(pid)
        }
    }
}

impl Default for OwnPaths {
    fn default() -> Self {
        Self::new()
    }
}

/// Sends `signal` to process `pid` (`kill(2)`); the main crate denies
/// unsafe code, and `tierzero launch` passes a stop on to mpirun with it.
pub fn send_signal(pid: u32, signal: i32) -> std::io::Result<()> {
    let pid = i32::try_from(pid)
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: kill(2) takes plain integers and touches no memory of ours;
    // the pid is positive, so it names one process, never a group.
    let rc = unsafe { libc::kill(pid, signal) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// `CAP_IPC_LOCK`: page-locking beyond `RLIMIT_MEMLOCK`.
pub const CAP_IPC_LOCK: u32 = 14;
/// `CAP_SYS_RESOURCE`: a file system's reserved blocks among others.
pub const CAP_SYS_RESOURCE: u32 = 24;

/// Whether `/proc/self/status` text says the effective capabilities
/// (`CapEff`) hold capability `cap`; false when it cannot tell.
pub fn has_capability(status: &str, cap: u32) -> bool {
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << cap) != 0)
}

/// Whether `signal`'s disposition is "ignore" (`sigaction(2)` read only):
/// `nohup` starts a program with SIGHUP ignored, and a handler installed
/// over it would undo that. False when it cannot tell.
pub fn signal_ignored(signal: i32) -> bool {
    let mut old = std::mem::MaybeUninit::<libc::sigaction>::zeroed();
    // SAFETY: a null `act` only reads the disposition into `old`, which
    // points to writable memory of exactly the type sigaction fills.
    let rc = unsafe { libc::sigaction(signal, std::ptr::null(), old.as_mut_ptr()) };
    if rc != 0 {
        return false;
    }
    // SAFETY: sigaction returned 0, so it filled `old` (and it was zeroed).
    let old = unsafe { old.assume_init() };
    old.sa_sigaction == libc::SIG_IGN
}

/// Makes the process `cmd` spawns receive `signal` when the thread that
/// spawned it dies (Linux's `PR_SET_PDEATHSIG`): `tierzero launch` gives
/// mpirun SIGINT, its abort, so that the ranks do not outlive a launcher
/// killed with SIGKILL or by the OOM killer.
pub fn signal_with_parent(cmd: &mut std::process::Command, signal: i32) {
    use std::os::unix::process::CommandExt as _;
    let sig = libc::c_ulong::try_from(signal).unwrap_or(libc::SIGKILL as libc::c_ulong);
    // SAFETY: the closure runs in the child between fork and exec, where
    // only async-signal-safe calls are allowed: it makes one `prctl` call
    // with integer arguments and touches no memory the parent owns.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// The open-file limit (`RLIMIT_NOFILE`): soft and hard, `None` for
/// unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenFileLimit {
    /// The soft limit, which `open(2)` meets as `EMFILE`.
    pub soft: Option<u64>,
    /// The hard limit, up to which a process may raise its soft one.
    pub hard: Option<u64>,
}

fn rlim_value(v: libc::rlim_t) -> Option<u64> {
    (v != libc::RLIM_INFINITY).then_some(v)
}

/// The process's open-file limit now.
pub fn open_file_limit() -> std::io::Result<OpenFileLimit> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit struct through a valid pointer.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(OpenFileLimit {
        soft: rlim_value(lim.rlim_cur),
        hard: rlim_value(lim.rlim_max),
    })
}

/// The soft open-file limit [`raise_open_file_limit`] asks for: many times
/// what a run holds (its swap files, rings, checkpoint files and data), and
/// not the millions some containers' hard limits allow, which the
/// processes it starts (mpirun) would inherit.
pub const OPEN_FILES_WANTED: u64 = 65_536;

/// Raises the soft open-file limit towards the hard one, up to
/// [`OPEN_FILES_WANTED`], as a process that does not use `select(2)` may
/// (systemd keeps the soft limit at 1024 for `select`'s sake only; Go's
/// runtime raises it at start-up): a run with many swap files, rings and
/// checkpoint files then never meets a soft limit the user did not
/// choose. Returns the limit after; a limit at or above the wanted one,
/// or a hard limit at the soft one, is left as it is.
pub fn raise_open_file_limit() -> std::io::Result<OpenFileLimit> {
    let before = open_file_limit()?;
    let want = before
        .hard
        .map_or(OPEN_FILES_WANTED, |h| h.min(OPEN_FILES_WANTED));
    if before.soft.is_none_or(|s| s >= want) {
        return Ok(before);
    }
    let lim = libc::rlimit {
        rlim_cur: want,
        rlim_max: before
            .hard
            .map_or(libc::RLIM_INFINITY, |h| h as libc::rlim_t),
    };
    // SAFETY: setrlimit reads one rlimit struct through a valid pointer;
    // a soft limit at most the hard one needs no privilege.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    open_file_limit()
}

/// Whether `e` is the open-file limit: the process's (`EMFILE`) or the
/// system's (`ENFILE`).
pub fn is_open_file_limit(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_file_limit_raised_at_most_to_the_wanted_and_the_hard() {
        let before = open_file_limit().unwrap_or_else(|e| panic!("{e}"));
        let after = raise_open_file_limit().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(after.hard, before.hard, "the hard limit is never changed");
        let cap = before
            .hard
            .map_or(OPEN_FILES_WANTED, |h| h.min(OPEN_FILES_WANTED));
        match before.soft {
            Some(s) if s < cap => assert_eq!(after.soft, Some(cap)),
            _ => assert_eq!(
                after.soft, before.soft,
                "a limit at or above the wanted stays"
            ),
        }
        assert!(is_open_file_limit(&std::io::Error::from_raw_os_error(
            libc::EMFILE
        )));
        assert!(is_open_file_limit(&std::io::Error::from_raw_os_error(
            libc::ENFILE
        )));
        assert!(!is_open_file_limit(&std::io::Error::from_raw_os_error(
            libc::ENOSPC
        )));
    }
}

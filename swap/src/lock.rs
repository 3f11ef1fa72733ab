//! One tierzero process per swap directory: an advisory `flock` on
//! `<nvme_path>/tierzero/lock`.
//!
//! Two processes pointed at the same `nvme_path` would each create their own
//! files (names carry the pid), so they cannot overwrite each other's
//! extents; but the second one's stale-file reclaim, its free-space
//! arithmetic and the first one's bandwidth all assume the directory is
//! theirs. So the second process refuses at start-up with
//! [`SwapError::Locked`], naming the lock file and the holder's pid, before
//! it creates, reclaims or writes anything.
//!
//! ## Why `flock`
//! The kernel drops an `flock` when the last descriptor of its open file
//! goes away, including when the process is killed with SIGKILL. A lock
//! left by a dead process therefore never blocks: the file may still exist
//! (with the dead pid in it), but locking it succeeds. A pid file without a
//! lock would need liveness guesses (and pid reuse makes them wrong).
//!
//! ## Sharing within a process
//! `flock` conflicts between open file descriptions even in one process, so
//! a process takes the lock once per directory and its spaces share it:
//! `space.rs` keeps a per-process use count per (canonical) directory and
//! holds one [`DirLock`] while the count is above zero.
//!
//! ## Removing the file
//! The last user unlinks the lock file while still holding the lock (so an
//! empty `tierzero/` directory we created can be removed). A process that
//! opened the old file just before the unlink could then lock an orphaned
//! inode; [`DirLock::acquire`] therefore checks, after locking, that the path
//! still names the inode it locked, and starts over if not.
//!
//! ## The pid inside
//! After locking, the holder writes its pid into the file; a refused process
//! reads it for the error message only (it is never used to decide anything).
//! File systems without `flock` support (`ENOLCK`, `EOPNOTSUPP`) get a
//! warning and no lock.
//!
//! ## The pieces, shared
//! [`open_lock_file`], [`try_lock`] and [`write_pid`] are the whole
//! protocol (open without following a symlink, lock without waiting, read
//! the holder's pid when refused, write ours when not). `tierzero`'s
//! checkpoint save-dir lock uses them too, so both locks behave alike and
//! the one `flock` call is std's `File::try_lock`.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::{Result, SwapError};

/// Name of the lock file inside a swap directory.
pub const LOCK_FILE: &str = "lock";

/// A held lock on one swap directory; released (and its file removed) on drop.
#[derive(Debug)]
pub struct DirLock {
    path: PathBuf,
    /// Holds the lock while open (closing it releases the lock).
    _file: File,
}

impl DirLock {
    /// Locks `<dir>/lock`. `Ok(None)` where the file system cannot lock
    /// (with a warning); [`SwapError::Locked`] if another process holds it.
    pub fn acquire(dir: &Path) -> Result<Option<DirLock>> {
        let path = dir.join(LOCK_FILE);
        let setup = |what: &str, source: std::io::Error| SwapError::Setup {
            what: format!("{what} {}", path.display()),
            source,
        };
        // Each retry follows a concurrent unlink by the previous holder; a
        // handful is plenty.
        for _ in 0..16 {
            let mut file = open_lock_file(&path).map_err(|e| setup("opening lock file", e))?;
            match try_lock(&mut file).map_err(|e| setup("locking", e))? {
                TryLock::Locked => {}
                TryLock::Busy { holder_pid } => {
                    return Err(SwapError::Locked {
                        path: path.clone(),
                        holder_pid,
                    });
                }
                TryLock::Unsupported(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "this file system cannot lock files; nothing stops a second tierzero process from using this nvme_path");
                    return Ok(None);
                }
            }
            // Still the file the path names? (See the module docs.)
            let ours = file.metadata().map_err(|e| setup("stat of", e))?;
            match std::fs::symlink_metadata(&path) {
                Ok(now) if now.dev() == ours.dev() && now.ino() == ours.ino() => {}
                _ => continue,
            }
            // Held from here: a failed pid write unlinks the file while
            // holding it, as the drop does (it was left, with the empty
            // directory, where a full disk refused the write).
            let mut lock = DirLock {
                path: path.clone(),
                _file: file,
            };
            if let Err(e) = write_pid(&mut lock._file) {
                drop(lock);
                let full = e.kind() == std::io::ErrorKind::StorageFull;
                return Err(setup(
                    if full {
                        "no room on its disk (free space there, or give another nvme_path) to \
                         write our pid to"
                    } else {
                        "writing our pid to"
                    },
                    e,
                ));
            }
            return Ok(Some(lock));
        }
        Err(SwapError::Config(format!(
            "could not lock {}: the file kept being replaced",
            path.display()
        )))
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        // Unlink while holding the lock; closing `file` then releases it.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Opens (creating it, mode 0600) a lock file, never through a symlink
/// (`O_NOFOLLOW`: a link planted as the lock file is an error, and its
/// target is never written), close-on-exec.
pub fn open_lock_file(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(path)
}

/// What [`try_lock`] found.
#[derive(Debug)]
pub enum TryLock {
    /// The file is locked through this descriptor (closing it releases it).
    Locked,
    /// Another open file description holds the lock; the pid its holder
    /// wrote, if it has written one yet.
    Busy {
        /// The holder's pid, for the message.
        holder_pid: Option<u32>,
    },
    /// The file system cannot lock files (`ENOLCK`, `EOPNOTSUPP`,
    /// `ENOSYS`).
    Unsupported(std::io::Error),
}

/// An exclusive `flock` of `file` without waiting (std's
/// `File::try_lock`). Any other failure is the error.
pub fn try_lock(file: &mut File) -> std::io::Result<TryLock> {
    match file.try_lock() {
        Ok(()) => Ok(TryLock::Locked),
        Err(TryLockError::WouldBlock) => Ok(TryLock::Busy {
            holder_pid: read_holder_pid(file),
        }),
        Err(TryLockError::Error(e))
            if matches!(
                e.raw_os_error(),
                Some(libc::ENOLCK) | Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS)
            ) =>
        {
            Ok(TryLock::Unsupported(e))
        }
        Err(TryLockError::Error(e)) => Err(e),
    }
}

/// Replaces the file's contents with our pid (for the next one's message).
pub fn write_pid(file: &mut File) -> std::io::Result<()> {
    let pid = format!("{}\n", std::process::id());
    file.set_len(0)?;
    file.rewind()?;
    file.write_all(pid.as_bytes())
}

/// Who holds a swap directory's lock, as [`lock_state`] found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockState {
    /// Nobody: no run uses the directory, and every swap file in it is
    /// stale (a run that made files held the lock while they lived).
    Free,
    /// A live process (the pid it wrote, if read).
    Held {
        /// The holder's pid.
        holder_pid: Option<u32>,
    },
    /// Not known: no lock file (nobody holds it, or the file system gave
    /// the holder no lock), or locks unsupported here.
    Unknown,
}

/// Whether `<dir>/lock` is held, looked at without changing anything: the
/// existing file opened read-only (never created, never through a symlink)
/// and locked without waiting, then closed at once (`tierzero inspect`).
pub fn lock_state(dir: &Path) -> LockState {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(dir.join(LOCK_FILE));
    let Ok(mut file) = file else {
        return LockState::Unknown;
    };
    match try_lock(&mut file) {
        Ok(TryLock::Locked) => LockState::Free,
        Ok(TryLock::Busy { holder_pid }) => LockState::Held { holder_pid },
        Ok(TryLock::Unsupported(_)) | Err(_) => LockState::Unknown,
    }
}

/// The pid the holder wrote, if it has written it yet (it writes right
/// after locking, so a few short retries cover the gap).
fn read_holder_pid(file: &mut File) -> Option<u32> {
    for _ in 0..20 {
        let mut text = String::new();
        if file.rewind().is_ok() && file.read_to_string(&mut text).is_ok() {
            if let Ok(pid) = text.trim().parse() {
                return Some(pid);
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_lock_in_one_process_conflicts_and_names_the_holder() {
        // Two open file descriptions conflict even in one process: this is
        // why space.rs shares one lock per directory.
        let d = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let first = DirLock::acquire(d.path()).unwrap_or_else(|e| panic!("{e}"));
        assert!(first.is_some(), "tempdir cannot lock");
        match DirLock::acquire(d.path()) {
            Err(SwapError::Locked { path, holder_pid }) => {
                assert_eq!(path, d.path().join(LOCK_FILE));
                assert_eq!(holder_pid, Some(std::process::id()));
            }
            other => panic!("{other:?}"),
        }
        drop(first);
        assert!(!d.path().join(LOCK_FILE).exists());
        let again = DirLock::acquire(d.path()).unwrap_or_else(|e| panic!("{e}"));
        assert!(again.is_some());
    }

    #[test]
    fn a_symlinked_lock_file_is_refused() {
        let d = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let target = d.path().join("elsewhere");
        std::fs::write(&target, b"x").unwrap_or_else(|e| panic!("{e}"));
        std::os::unix::fs::symlink(&target, d.path().join(LOCK_FILE))
            .unwrap_or_else(|e| panic!("{e}"));
        let Err(err) = DirLock::acquire(d.path()) else {
            panic!("locked through a symlink");
        };
        assert!(err.to_string().contains("lock"), "{err}");
        assert_eq!(std::fs::read(&target).unwrap_or_default(), b"x");
    }
}

//! One writer per save dir: [`SaveDirLock`].
//!
//! Two runs saving into the same directory would race on `latest`, on
//! step dirs of the same number (each moving the other's aside), and on
//! removing each other's staging dirs. A trainer therefore holds an
//! exclusive `flock` on `<save_dir>/.lock` for as long as it owns the save
//! dir; a second process refuses at once with the path and the holder's
//! pid.
//!
//! * **`flock`, not a pid file.** The kernel drops the lock when the holder
//!   dies, however it dies (`SIGKILL` included), so a crashed run never
//!   leaves the save dir locked, and no pid-liveness guess is needed. The
//!   pid written into the file is only for the message.
//! * **The file stays.** Removing a lock file races with a process that has
//!   just opened it (it would lock an unlinked inode); `.lock` is 0600,
//!   a few bytes, and ignored by the reader (not a `step-*` name).
//! * **Readers do not lock.** Opening a checkpoint never needs the lock:
//!   the write protocol keeps every step dir whole or invisible.
//! * The protocol is the swap directory lock's ([`tierzero_swap::lock`]:
//!   open without following a symlink, std's `File::try_lock`, which is
//!   `flock(LOCK_EX | LOCK_NB)` on Linux, the holder's pid read when
//!   refused and ours written when not). Locks of two open file
//!   descriptions conflict even within one process.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use tierzero_swap::lock::{open_lock_file, try_lock, write_pid, TryLock};

use super::{io_err, CheckpointError};

/// Name of the lock file in a save dir.
pub const LOCK_FILE: &str = ".lock";

/// An exclusive claim on a save dir; released on drop (or process death).
#[derive(Debug)]
pub struct SaveDirLock {
    /// The save dir, canonical.
    dir: PathBuf,
    /// The locked file's device and inode: what [`SaveDirLock::covers`]
    /// checks, since the path alone may name another run's dir by then.
    file_id: (u64, u64),
    /// Holds the flock.
    _file: File,
}

impl SaveDirLock {
    /// Takes the lock of `save_dir` (which must exist), without waiting:
    /// [`CheckpointError::Locked`] names the lock file and the holder's
    /// pid when another process has it.
    pub fn acquire(save_dir: &Path) -> Result<SaveDirLock, CheckpointError> {
        let dir = save_dir
            .canonicalize()
            .map_err(io_err("opening", save_dir))?;
        let path = dir.join(LOCK_FILE);
        let mut file = open_lock_file(&path).map_err(io_err("opening", &path))?;
        match try_lock(&mut file).map_err(io_err("locking", &path))? {
            TryLock::Locked => {}
            TryLock::Busy { holder_pid } => {
                let holder = holder_pid
                    .map_or_else(|| "another process".to_owned(), |p| format!("process {p}"));
                return Err(CheckpointError::Locked { path, holder });
            }
            // A save dir must be lockable: two runs saving into one would
            // race on `latest` and on step dirs.
            TryLock::Unsupported(e) => return Err(io_err("locking", &path)(e)),
        }
        // Ours now: record our pid for the message of the next one.
        write_pid(&mut file).map_err(io_err("writing", &path))?;
        let meta = file.metadata().map_err(io_err("reading", &path))?;
        Ok(SaveDirLock {
            dir,
            file_id: (meta.dev(), meta.ino()),
            _file: file,
        })
    }

    /// The save dir it locks (canonical).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether it locks `save_dir`: the same canonical path, and its
    /// `.lock` still the file this lock holds. A save dir moved or removed
    /// while the run lived, and made again at its path by another run that
    /// locked it, has the same path but another `.lock`: compared by path
    /// alone, the first run went on saving into the second's dir, pointing
    /// its `latest` at the first run's steps, and the second replaced them.
    pub fn covers(&self, save_dir: &Path) -> bool {
        save_dir.canonicalize().is_ok_and(|d| d == self.dir)
            && std::fs::symlink_metadata(self.dir.join(LOCK_FILE))
                .is_ok_and(|m| (m.dev(), m.ino()) == self.file_id)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[test]
    fn second_claim_is_refused_and_release_frees_it() {
        let d = tempfile::tempdir().unwrap();
        let a = SaveDirLock::acquire(d.path()).unwrap();
        assert!(a.covers(d.path()));
        match SaveDirLock::acquire(d.path()) {
            Err(CheckpointError::Locked { path, holder }) => {
                assert_eq!(path, d.path().canonicalize().unwrap().join(LOCK_FILE));
                assert_eq!(holder, format!("process {}", std::process::id()));
            }
            other => panic!("{other:?}"),
        }
        drop(a);
        let b = SaveDirLock::acquire(d.path()).unwrap();
        drop(b);
        let mode = {
            use std::os::unix::fs::PermissionsExt;
            std::fs::metadata(d.path().join(LOCK_FILE))
                .unwrap()
                .permissions()
                .mode()
                & 0o777
        };
        assert_eq!(mode, 0o600);
    }

    #[test]
    fn a_save_dir_replaced_at_its_path_is_not_covered() {
        let d = tempfile::tempdir().unwrap();
        let ck = d.path().join("ck");
        std::fs::create_dir(&ck).unwrap();
        let a = SaveDirLock::acquire(&ck).unwrap();
        // The user moves the dir away while the run lives; another run
        // makes it again and locks it.
        std::fs::rename(&ck, d.path().join("ck-old")).unwrap();
        assert!(!a.covers(&ck), "moved away");
        std::fs::create_dir(&ck).unwrap();
        let b = SaveDirLock::acquire(&ck).unwrap();
        assert!(b.covers(&ck));
        assert!(!a.covers(&ck), "the same path, another run's lock");
        // Taking it again is refused, naming the holder (here this
        // process, through another open file description).
        assert!(matches!(
            SaveDirLock::acquire(&ck),
            Err(CheckpointError::Locked { .. })
        ));
    }

    #[test]
    fn a_symlinked_lock_file_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("elsewhere");
        std::fs::write(&target, "x").unwrap();
        std::os::unix::fs::symlink(&target, d.path().join(LOCK_FILE)).unwrap();
        assert!(SaveDirLock::acquire(d.path()).is_err());
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "x");
    }
}

//! Durable file-system updates: the one place that knows how to make a
//! write survive a crash.
//!
//! # Rules
//!
//! * **Atomic rewrite** ([`write_atomic`]): the new contents go to a
//!   temporary file in the *same directory* (so the rename cannot cross a
//!   file system), created `0600` with `O_EXCL` (never through an existing
//!   file or symlink), written, `fsync`ed, renamed over the target, and then
//!   the directory is `fsync`ed so the rename itself is on disk. A reader
//!   sees the old file or the new one, never a mix, and after a crash the
//!   new one only if the whole sequence finished.
//! * **Private by default**: files we create are `0600` ([`create_file`]),
//!   directories `0700` ([`create_dir`]).
//! * **Directories are synced explicitly** ([`sync_dir`]): a file's `fsync`
//!   does not persist its directory entry.
//!
//! * **Streamed atomic write** ([`write_atomic_streamed`]): the same
//!   sequence for a file too large to hold in memory (an exported
//!   `model.safetensors`), written through a caller's function.
//! * **Renames into place** ([`rename`]): a rename followed by the `fsync`
//!   of the target's directory (a staged checkpoint dir becoming
//!   `step-<N>`).
//!
//! Every manifest, checkpoint file, `latest` pointer, export and saved HF
//! directory goes through these helpers; nothing else renames into place. They return [`DurableError`], which names the operation and the
//! path.
//!
//! * **Recorded, for the power-loss test** ([`record`]): while a test
//!   records, every create, write, fsync, rename and removal of these
//!   helpers and of the checkpoint writer is logged in order, an fsync with
//!   the file's bytes at that moment; `tests/power_loss.rs` replays every
//!   prefix of a save with what was not fsynced dropped. Free when not
//!   recording (one atomic load), never on in production.

use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A failed durable operation.
#[derive(Debug, thiserror::Error)]
#[error("{op} {path}: {source}")]
pub struct DurableError {
    /// What we were doing ("creating", "syncing", "renaming to", ...).
    pub op: &'static str,
    /// The file or directory.
    pub path: PathBuf,
    /// The OS error.
    #[source]
    pub source: std::io::Error,
}

fn err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> DurableError + 'a {
    move |source| DurableError {
        op,
        path: path.to_path_buf(),
        source,
    }
}

static TMP_SEQ: AtomicU64 = AtomicU64::new(0);

/// The `<seq>` of a new temporary file's name `.{name}.tmp-<pid>-<seq>`:
/// unique within this process, and from a start drawn from the clock, so
/// that processes of one pid in other pid namespaces (pid 1 in each of
/// several containers) writing one shared directory do not pick the
/// same name.
fn next_tmp_seq() -> u64 {
    static START: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let start = *START.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        // Room to count up without wrapping.
        nanos & ((1 << 60) - 1)
    });
    start + TMP_SEQ.fetch_add(1, Ordering::Relaxed)
}

/// A log of file-system operations, in the style of ALICE / CrashMonkey:
/// what a crash-consistency model needs to rebuild what a power loss at
/// any point would leave on disk.
///
/// [`start`](record::start) begins a recording for the whole process (the checkpoint's
/// state files are written on the optimizer thread), [`finish`](record::finish) ends it
/// and returns the operations in the order they ran. The sites are
/// `durable`'s helpers and the checkpoint writer's own writes, removals
/// and resizes (`crate::checkpoint`, `Trainer::save_checkpoint`).
pub mod record {
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Mutex;

    /// One operation.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum FsOp {
        /// A new, empty file.
        CreateFile(PathBuf),
        /// A new directory.
        CreateDir(PathBuf),
        /// `len` bytes written at `offset` (not yet durable).
        Write {
            /// The file.
            path: PathBuf,
            /// Where.
            offset: u64,
            /// How many bytes.
            len: u64,
        },
        /// The file's length set (`set_len`).
        SetLen {
            /// The file.
            path: PathBuf,
            /// The new length.
            len: u64,
        },
        /// `fsync` of a file: its bytes at that moment are durable.
        Fsync {
            /// The file.
            path: PathBuf,
            /// Its whole contents when synced.
            contents: Vec<u8>,
        },
        /// `fsync` of a directory: its entries at that moment are durable.
        FsyncDir(PathBuf),
        /// A rename (of a file or a directory).
        Rename {
            /// The old name.
            from: PathBuf,
            /// The new name.
            to: PathBuf,
        },
        /// A file or a directory tree removed.
        Remove(PathBuf),
    }

    static ON: AtomicBool = AtomicBool::new(false);
    static LOG: Mutex<Vec<FsOp>> = Mutex::new(Vec::new());

    /// Starts recording (dropping anything recorded before).
    pub fn start() {
        LOG.lock().unwrap_or_else(|p| p.into_inner()).clear();
        ON.store(true, Ordering::SeqCst);
    }

    /// Stops recording; the operations since [`start`], in order.
    pub fn finish() -> Vec<FsOp> {
        ON.store(false, Ordering::SeqCst);
        std::mem::take(&mut *LOG.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The operations so far, recording on.
    pub fn snapshot() -> Vec<FsOp> {
        LOG.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Records `op()` when recording.
    #[inline]
    pub(crate) fn note(op: impl FnOnce() -> FsOp) {
        if ON.load(Ordering::Relaxed) {
            let op = op();
            LOG.lock().unwrap_or_else(|p| p.into_inner()).push(op);
        }
    }

    /// Records a write of `len` bytes at `offset` of `path`.
    #[inline]
    pub(crate) fn write(path: &Path, offset: u64, len: u64) {
        note(|| FsOp::Write {
            path: path.to_path_buf(),
            offset,
            len,
        });
    }

    /// Records a removal.
    #[inline]
    pub(crate) fn remove(path: &Path) {
        note(|| FsOp::Remove(path.to_path_buf()));
    }

    /// Records an fsync of `path`, with its bytes now.
    pub(super) fn fsync(path: &Path) {
        note(|| FsOp::Fsync {
            path: path.to_path_buf(),
            contents: std::fs::read(path).unwrap_or_default(),
        });
    }
}

/// Creates `path` as a new file, mode `0600`, read-write; fails if anything
/// (a file or a symlink) is already there.
pub fn create_file(path: &Path) -> Result<File, DurableError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(err("creating", path))
        .inspect(|_| record::note(|| record::FsOp::CreateFile(path.to_path_buf())))
}

/// Creates the directory `path`, mode `0700` (its parent must exist).
pub fn create_dir(path: &Path) -> Result<(), DurableError> {
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(path)
        .map_err(err("creating directory", path))
        .inspect(|()| record::note(|| record::FsOp::CreateDir(path.to_path_buf())))
}

/// Creates `path` and missing parents, each new one `0700`; an existing
/// directory is fine. Each new directory's entry is made durable: its
/// parent is fsynced, outermost first (a save dir created for a run must
/// not vanish on power loss after its first checkpoint was reported
/// saved: the checkpoint's own fsyncs reach only the save dir).
pub fn create_dir_all(path: &Path) -> Result<(), DurableError> {
    create_dirs(path).map(drop)
}

/// [`create_dir_all`], returning the directories it made, the deepest
/// first: what [`remove_empty_dirs`] undoes when what they were made for
/// fails (a refused run's save dir, a failed export's output directory).
pub fn create_dirs(path: &Path) -> Result<Vec<PathBuf>, DurableError> {
    let missing = missing_dirs(path);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .recursive(true)
        .create(path)
        .map_err(err("creating directory", path))?;
    for p in missing.iter().rev() {
        record::note(|| record::FsOp::CreateDir(p.clone()));
        sync_dir(&parent_dir(p))?;
    }
    Ok(missing)
}

/// The directories of `path` and its ancestors that do not exist, the
/// deepest first: what [`create_dirs`] would make.
pub fn missing_dirs(path: &Path) -> Vec<PathBuf> {
    path.ancestors()
        .take_while(|p| !p.as_os_str().is_empty() && !p.exists())
        .map(Path::to_path_buf)
        .collect()
}

/// Removes `made` ([`create_dirs`]'s, the deepest first) while each is
/// empty; the first that is not stays, and its parents with it.
pub fn remove_empty_dirs(made: &[PathBuf]) {
    for d in made {
        if std::fs::remove_dir(d).is_err() {
            break;
        }
    }
}

/// `fsync`s a directory, persisting the entries created, renamed or removed
/// in it.
pub fn sync_dir(path: &Path) -> Result<(), DurableError> {
    File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(err("syncing directory", path))?;
    record::note(|| record::FsOp::FsyncDir(path.to_path_buf()));
    Ok(())
}

/// `fsync`s a file's data and metadata.
pub fn sync_file(file: &File, path: &Path) -> Result<(), DurableError> {
    file.sync_all().map_err(err("syncing", path))?;
    record::fsync(path);
    Ok(())
}

/// `std::fs::rename`, recorded.
fn rename_raw(from: &Path, to: &Path) -> Result<(), DurableError> {
    std::fs::rename(from, to).map_err(err("renaming to", to))?;
    record::note(|| record::FsOp::Rename {
        from: from.to_path_buf(),
        to: to.to_path_buf(),
    });
    Ok(())
}

/// Removes a temporary file after a failed rewrite (recorded).
fn remove_tmp(tmp: &Path) {
    if std::fs::remove_file(tmp).is_ok() {
        record::remove(tmp);
    }
}

/// Whether two paths name the same file or directory, however spelled
/// (`d/sub/..`, a symbolic link): compared as given, else resolved.
pub fn same_path(a: &Path, b: &Path) -> bool {
    a == b || std::fs::canonicalize(a).is_ok_and(|a| std::fs::canonicalize(b).is_ok_and(|b| a == b))
}

/// What a file that is not a regular file is, in words ("FIFO",
/// "character device", ...).
pub fn kind_of(t: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt as _;
    if t.is_dir() {
        "directory"
    } else if t.is_char_device() {
        "character device"
    } else if t.is_block_device() {
        "block device"
    } else if t.is_fifo() {
        "FIFO"
    } else if t.is_socket() {
        "socket"
    } else {
        "special file"
    }
}

/// Opens `path` (through symlinks) for reading when it is a regular file,
/// else fails with `InvalidInput` naming what it is: without a writer, a
/// FIFO's open waited for ever, and a device (`/dev/zero`) is read
/// without end. The open does not wait (`O_NONBLOCK`, which a regular
/// file's reads ignore).
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let t = f.metadata()?.file_type();
    if t.is_file() {
        return Ok(f);
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        format!("it is a {}, not a regular file", kind_of(t)),
    ))
}

/// The bytes of `path` when it is a regular file or a pipe (a shell's
/// `<(...)`), at most `max_bytes` of them (a longer one fails with
/// `InvalidData`); a device (`/dev/zero`, read without end), a directory or
/// a socket fails with `InvalidInput` naming what it is.
pub fn read_file_or_pipe(path: &Path, max_bytes: u64) -> std::io::Result<Vec<u8>> {
    use std::os::unix::fs::FileTypeExt as _;
    let t = std::fs::metadata(path)?.file_type();
    if !(t.is_file() || t.is_fifo()) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("it is a {}, not a file", kind_of(t)),
        ));
    }
    read_at_most(File::open(path)?, max_bytes)
}

/// `f`'s bytes, at most `max_bytes` of them: a longer one fails with
/// `InvalidData`.
fn read_at_most(f: File, max_bytes: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read as _;
    let mut bytes = Vec::new();
    f.take(max_bytes.saturating_add(1))
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max_bytes {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("larger than {max_bytes} bytes"),
        ));
    }
    Ok(bytes)
}

/// The bytes of the regular file `path` ([`open_regular`]), at most
/// `max_bytes` of them: a longer file fails with `InvalidData`.
pub fn read_regular(path: &Path, max_bytes: u64) -> std::io::Result<Vec<u8>> {
    read_at_most(open_regular(path)?, max_bytes)
}

/// [`read_regular`]'s bytes as UTF-8 text (`InvalidData` where they are
/// not).
pub fn read_regular_text(path: &Path, max_bytes: u64) -> std::io::Result<String> {
    String::from_utf8(read_regular(path, max_bytes)?).map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("not UTF-8 text: {e}"),
        )
    })
}

/// Refuses to replace `path` when it exists and is not a regular file: a
/// device, a FIFO, a socket, a directory, or a symbolic link (dangling or
/// not). The rename of an atomic rewrite would put a regular file in its
/// place: run as root, `--timeline /dev/null` replaced `/dev/null` itself,
/// and `--timeline /dev/stdout` the system's `/dev/stdout` link.
pub fn check_replaceable(path: &Path) -> Result<(), DurableError> {
    let why = match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_file() => return Ok(()),
        Ok(m) if m.file_type().is_symlink() => format!(
            "it is a symbolic link (to {}), which the write would replace with a file; give \
             the path it names, or remove the link",
            std::fs::read_link(path).map_or_else(|_| "?".into(), |t| t.display().to_string())
        ),
        Ok(m) => format!(
            "it is a {}, not a regular file; give the path of a regular file",
            kind_of(m.file_type())
        ),
        // Not there: a new file is made.
        Err(_) => return Ok(()),
    };
    Err(DurableError {
        op: "replacing",
        path: path.to_path_buf(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidInput, why),
    })
}

/// Atomically replaces (or creates) `path` with `bytes`: temp file in the
/// same directory (0600), fsync, rename, fsync of the directory. On error
/// the temp file is removed and `path` is unchanged. A `path` that is not
/// a regular file is refused ([`check_replaceable`]).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), DurableError> {
    write_atomic_with(path, bytes, None)
}

/// [`write_atomic`] with a failpoint halfway through writing the temporary
/// file (see [`crate::failpoint`]); an injected error is reported as a
/// failed write of the temporary file.
pub(crate) fn write_atomic_with(
    path: &Path,
    bytes: &[u8],
    mid: Option<crate::failpoint::Site>,
) -> Result<(), DurableError> {
    check_replaceable(path)?;
    let dir = parent_dir(path);
    let name = path
        .file_name()
        .ok_or_else(|| DurableError {
            op: "writing",
            path: path.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "no file name"),
        })?
        .to_string_lossy()
        .into_owned();
    let tmp = dir.join(format!(
        ".{name}.tmp-{}-{}",
        std::process::id(),
        next_tmp_seq()
    ));
    let _listed = InProgress::new(&tmp);
    let result = (|| {
        let mut f = create_file(&tmp)?;
        lock_tmp(&f);
        let (a, b) = bytes.split_at(bytes.len() / 2);
        f.write_all(a).map_err(err("writing", &tmp))?;
        record::write(&tmp, 0, a.len() as u64);
        if let Some(site) = mid {
            crate::failpoint::io_point(site).map_err(err("writing", &tmp))?;
        }
        f.write_all(b).map_err(err("writing", &tmp))?;
        record::write(&tmp, a.len() as u64, b.len() as u64);
        sync_file(&f, &tmp)?;
        // Renamed while still open, so still locked ([`lock_tmp`]).
        rename_raw(&tmp, path)?;
        drop(f);
        sync_dir(&dir)
    })();
    if result.is_err() {
        remove_tmp(&tmp);
    }
    result
}

/// The temporary files of the atomic rewrites this process is writing
/// now ([`write_atomic`], [`write_atomic_streamed`]), for
/// [`remove_tmps_in_progress`].
static IN_PROGRESS: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

/// A temporary file listed in [`IN_PROGRESS`] while this lives.
struct InProgress(PathBuf);

impl InProgress {
    fn new(tmp: &Path) -> Self {
        if let Ok(mut v) = IN_PROGRESS.lock() {
            v.push(tmp.to_path_buf());
        }
        InProgress(tmp.to_path_buf())
    }
}

impl Drop for InProgress {
    fn drop(&mut self) {
        if let Ok(mut v) = IN_PROGRESS.lock() {
            if let Some(i) = v.iter().position(|p| *p == self.0) {
                v.swap_remove(i);
            }
        }
    }
}

/// Removes the temporary files of the atomic rewrites this process is
/// writing now, for a process about to exit from another thread (a signal
/// during `train`'s start-up, while a corpus is encoded into its token
/// cache): they would stay, as large as what they write, beside the data,
/// where only a later rewrite of the same file removes them (a cache entry
/// of another key never does). The writes in progress then fail at their
/// rename; call it only on the way out.
pub fn remove_tmps_in_progress() {
    let listed = match IN_PROGRESS.lock() {
        Ok(mut v) => std::mem::take(&mut *v),
        Err(_) => return,
    };
    for tmp in &listed {
        remove_tmp(tmp);
    }
}

/// The directory a path's temporary sibling goes in.
fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// [`write_atomic`] for contents written by `write` instead of held in
/// memory: `write` gets the new temporary file (0600, in `path`'s
/// directory) and its path, and returns the file when done; it is then
/// `fsync`ed, renamed over `path`, and the directory `fsync`ed. Returns the
/// bytes written. On any error the temporary file is removed and `path` is
/// unchanged.
pub fn write_atomic_streamed<E: From<DurableError>>(
    path: &Path,
    write: impl FnOnce(File, &Path) -> Result<File, E>,
) -> Result<u64, E> {
    check_replaceable(path)?;
    let dir = parent_dir(path);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "file".to_owned());
    let tmp = dir.join(format!(
        ".{name}.tmp-{}-{}",
        std::process::id(),
        next_tmp_seq()
    ));
    let _listed = InProgress::new(&tmp);
    let result = (|| {
        let created = create_file(&tmp)?;
        // The lock stays with this open file description, which `write`
        // hands back (a clone shares it).
        lock_tmp(&created);
        let file = write(created, &tmp)?;
        let bytes = file.metadata().map_err(err("stat", &tmp))?.len();
        record::write(&tmp, 0, bytes);
        sync_file(&file, &tmp)?;
        rename_raw(&tmp, path)?;
        drop(file);
        sync_dir(&dir)?;
        Ok(bytes)
    })();
    if result.is_err() {
        remove_tmp(&tmp);
    }
    result
}

/// The pid of `.{name}.tmp-<pid>-<seq>`, the temporary file of an atomic
/// rewrite of `name` ([`write_atomic`], [`write_atomic_streamed`]).
pub(crate) fn tmp_owner_pid(tmp_name: &str, name: &str) -> Option<u32> {
    let rest = tmp_name.strip_prefix(&format!(".{name}.tmp-"))?;
    let (pid, seq) = rest.split_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(pid) || !digits(seq) {
        return None;
    }
    pid.parse().ok()
}

/// Removes the temporary files of atomic rewrites of `path` that
/// processes now gone left beside it (gone by their pid, and their lock
/// free: `lock_tmp`) (killed mid-write: an export's is as
/// large as the model, and nothing else would remove it), and with
/// `own_too` this process's (a caller that is not writing `path` now: one
/// of its pid is a dead incarnation's, pid 1 in a restarted container).
/// Returns how many; a file it cannot remove is said, not an error.
pub fn remove_stale_tmp(path: &Path, own_too: bool) -> usize {
    remove_tmp_where(path, true, |pid| {
        (own_too && pid == std::process::id())
            || (pid != std::process::id() && !tierzero_swap::space::process_alive(pid))
    })
}

/// Removes every temporary file of an atomic rewrite of `path`, whatever
/// its pid: for a caller that holds the lock every writer of `path` takes
/// (a save dir's), which proves them all stale. A pid check cannot: a
/// reused pid, another user's process or a thread id looks alive.
pub fn remove_every_tmp(path: &Path) -> usize {
    remove_tmp_where(path, false, |_| true)
}

/// Takes an exclusive `flock` on a temporary file being written, held
/// until the file is closed (after its rename): a process in another pid
/// namespace or on another host sharing the directory (ranks of several
/// nodes encoding one corpus) cannot tell our pid alive, but finds the
/// lock held and leaves the file ([`remove_stale_tmp`]). A file system
/// without locks is written all the same.
fn lock_tmp(f: &File) {
    let _ = f.try_lock();
}

/// Whether a temporary file's writer holds its lock ([`lock_tmp`]). It is
/// opened for writing: NFS turns `flock` into a write lock, which a
/// read-only descriptor cannot take. A lock that cannot be tested (no
/// lock support there) says nothing, and the pid decides alone.
fn tmp_in_use(path: &Path) -> bool {
    match OpenOptions::new().read(true).write(true).open(path) {
        Ok(f) => matches!(f.try_lock(), Err(std::fs::TryLockError::WouldBlock)),
        Err(_) => false,
    }
}

/// Removes the temporary files of atomic rewrites of `path` whose pid
/// `stale` says, and with `unlocked` only those no writer holds locked
/// ([`tmp_in_use`]); a file it cannot remove is said, not an error.
fn remove_tmp_where(path: &Path, unlocked: bool, stale: impl Fn(u32) -> bool) -> usize {
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return 0;
    };
    let Ok(entries) = std::fs::read_dir(parent_dir(path)) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| tmp_owner_pid(n, name)) else {
            continue;
        };
        if !stale(pid)
            || !e.file_type().is_ok_and(|t| t.is_file())
            || (unlocked && tmp_in_use(&e.path()))
        {
            continue;
        }
        match std::fs::remove_file(e.path()) {
            Ok(()) => {
                record::remove(&e.path());
                removed += 1;
                tracing::warn!(file = %e.path().display(), pid, "removed the temporary file of an unfinished write");
            }
            Err(err) => {
                tracing::warn!(file = %e.path().display(), error = %err, "could not remove a stale temporary file");
            }
        }
    }
    removed
}

/// Renames `from` to `to` (a file or a directory, in one file system) and
/// `fsync`s `to`'s directory, so the new name is on disk when this returns.
pub fn rename(from: &Path, to: &Path) -> Result<(), DurableError> {
    rename_raw(from, to)?;
    sync_dir(&parent_dir(to))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    /// Only a regular file is opened: a FIFO without a writer and a
    /// device fail at once, naming what they are; a read is bounded.
    #[test]
    fn open_regular_refuses_fifos_and_devices_without_waiting() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("latest");
        assert!(std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success());
        for (p, kind) in [
            (fifo.as_path(), "FIFO"),
            (Path::new("/dev/zero"), "character device"),
        ] {
            let e = open_regular(p).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
            assert!(
                e.to_string()
                    .contains(&format!("it is a {kind}, not a regular file")),
                "{e}"
            );
        }
        let file = dir.path().join("f");
        std::fs::write(&file, b"step-00000004").unwrap();
        assert_eq!(read_regular(&file, 13).unwrap(), b"step-00000004");
        let e = read_regular(&file, 12).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
    }

    /// A temporary file whose writer holds its lock is not removed, even
    /// when its pid is dead here (a writer in another pid namespace or on
    /// another host), nor is this process's own write in progress; once
    /// the lock is free it is removed.
    #[test]
    fn a_locked_temporary_file_is_not_stale() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache.u16");
        // 4194305: above pid_max, never alive.
        let tmp = dir.path().join(".cache.u16.tmp-4194305-0");
        let held = File::create(&tmp).unwrap();
        held.try_lock().unwrap();
        assert_eq!(remove_stale_tmp(&path, true), 0);
        assert!(tmp.exists());
        drop(held);
        assert_eq!(remove_stale_tmp(&path, true), 1);
        assert!(!tmp.exists());
        // Our own write, in progress: its temporary file is locked.
        let n = write_atomic_streamed(&path, |f, _| -> Result<File, DurableError> {
            assert_eq!(remove_stale_tmp(&path, true), 0);
            Ok(f)
        })
        .unwrap();
        assert_eq!(n, 0);
        assert!(path.exists());
    }

    /// A rewrite of a path that is a FIFO (or a device) is refused and
    /// leaves it as it was: the rename made it a regular file (as root,
    /// `/dev/null` too). A symlink to a regular file is rewritten as
    /// before; a new path is made.
    #[test]
    fn a_path_that_is_not_a_regular_file_is_never_replaced() {
        use std::os::unix::fs::FileTypeExt as _;
        let dir = std::env::temp_dir().join(format!("tz-durable-special-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        let e = write_atomic(&fifo, b"x").unwrap_err();
        assert!(e.to_string().contains("FIFO"), "{e}");
        let e = write_atomic_streamed::<DurableError>(&fifo, |f, _| Ok(f)).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        assert!(std::fs::symlink_metadata(&fifo)
            .unwrap()
            .file_type()
            .is_fifo());
        // (A device is refused alike; not tried on `/dev/null`: a
        // regression would replace the test machine's.)
        assert!(check_replaceable(Path::new("/dev/null"))
            .is_err_and(|e| e.to_string().contains("character device")));
        let file = dir.join("file");
        write_atomic(&file, b"one").unwrap();
        let link = dir.join("link");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        // A link is refused, not replaced by a file (nor written through):
        // `--timeline /dev/stdout` replaced the system's link.
        let e = write_atomic(&link, b"two").unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(std::fs::read(&file).unwrap(), b"one");
        assert!(check_replaceable(Path::new("/dev/stdout"))
            .is_err_and(|e| e.to_string().contains("symbolic link")));
        // Nothing left behind.
        let mut names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["fifo", "file", "link"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_dead_process_s_temporary_files_are_removed_and_no_other() {
        let dir = std::env::temp_dir().join(format!("tz-durable-stale-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("model.safetensors");
        // 4194305: above the kernel's pid_max limit of 2^22, never a live pid.
        let names = [
            (".model.safetensors.tmp-4194305-0", false),
            (
                &*format!(".model.safetensors.tmp-{}-0", std::process::id()),
                true,
            ),
            (".model.safetensors.tmp-4194305-x", true),
            (".other.tmp-4194305-0", true),
            ("model.safetensors", true),
        ];
        for (n, _) in &names {
            std::fs::write(dir.join(n), b"x").unwrap();
        }
        assert_eq!(remove_stale_tmp(&out, false), 1);
        for (n, kept) in &names {
            assert_eq!(dir.join(n).exists(), *kept, "{n}");
        }
        // This process's, when it says it is not writing `out`.
        assert_eq!(remove_stale_tmp(&out, true), 1);
        assert!(!dir.join(names[1].0).exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn atomic_write_replaces_and_leaves_no_temp() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("latest");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let names: Vec<_> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }

    #[test]
    fn atomic_write_into_a_missing_dir_fails_cleanly() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("nope").join("x");
        let e = write_atomic(&p, b"x").unwrap_err();
        assert_eq!(e.op, "creating");
        assert!(e.to_string().contains("nope"), "{e}");
    }

    /// Each new directory's entry is made durable: its parent is fsynced
    /// after it is created, outermost first; an existing one is not
    /// synced again. (The only test in this crate that records.)
    #[test]
    fn new_directories_have_their_parents_synced() {
        let d = tempfile::tempdir().unwrap();
        let (a, b) = (d.path().join("a"), d.path().join("a").join("b"));
        record::start();
        create_dir_all(&b).unwrap();
        create_dir_all(&b).unwrap();
        let ops: Vec<record::FsOp> = record::finish()
            .into_iter()
            .filter(|op| match op {
                record::FsOp::CreateDir(p) | record::FsOp::FsyncDir(p) => p.starts_with(d.path()),
                _ => false,
            })
            .collect();
        assert_eq!(
            ops,
            vec![
                record::FsOp::CreateDir(a.clone()),
                record::FsOp::FsyncDir(d.path().to_path_buf()),
                record::FsOp::CreateDir(b),
                record::FsOp::FsyncDir(a),
            ]
        );
    }

    #[test]
    fn private_modes_and_no_clobber() {
        let d = tempfile::tempdir().unwrap();
        let sub = d.path().join("a").join("b");
        create_dir_all(&sub).unwrap();
        let mode = std::fs::metadata(&sub).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        let f = sub.join("f");
        create_file(&f).unwrap();
        assert!(
            create_file(&f).is_err(),
            "create_file must not reuse a file"
        );
        std::os::unix::fs::symlink(&f, sub.join("link")).unwrap();
        assert!(
            create_file(&sub.join("link")).is_err(),
            "nor follow a symlink"
        );
    }
}

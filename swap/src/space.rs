//! The swap space: a few large preallocated files and the extents in them.
//!
//! Each NVMe path gets one tierzero-owned subdirectory (`<path>/tierzero`,
//! created 0700) holding one file per space, created 0600 with `O_EXCL` and
//! preallocated with `fallocate`. DeepSpeed keeps one file per tensor and
//! opens it on every operation; we keep the files open (and registered with
//! io_uring) for the life of the space and hand out [`Extent`]s: aligned
//! byte ranges placed by an [`ExtentAllocator`] per file.
//!
//! ## Striping
//! An extent larger than `stripe_bytes` is split into stripe-sized chunks
//! dealt round-robin over the paths, so several devices add up their
//! bandwidth. Chunk `k` lives on part `k % P` at
//! `part.offset + (k / P) * stripe_bytes`; each part is one contiguous
//! allocation in its path's file.
//!
//! ## Ownership and cleanup
//! Files are named `swap-<pid>-<space>-<path>.tzswap`. A space removes its
//! own files when dropped (after the last extent, since extents hold the
//! space alive). At creation it reclaims files of that pattern whose pid is
//! no longer alive: stale leftovers of a killed run. Nothing else in the
//! directory is ever touched. A `tierzero/` directory this process created
//! is removed (if empty) when the last space using it drops.
//!
//! ## One process per directory
//! Before creating or reclaiming anything, a space takes the directory's
//! lock (`tierzero/lock`, see [`crate::lock`]); the spaces of one process
//! share it. A second process on the same `nvme_path` fails with
//! [`SwapError::Locked`] naming the lock file and the holder's pid. The
//! lock also makes stale-file reclaim safe: while we hold it, no other
//! tierzero process can be using files in the directory. Files adopted
//! with [`SwapSpace::open_file`] (benchmarks) are never removed.
//!
//! ## Poisoning
//! If a write fails, the bytes on disk are unknown. The space is marked
//! poisoned with the first failure, and every later operation fails fast
//! with [`SwapError::Poisoned`] instead of returning stale data.
//!
//! ## Checksums
//! With `checksums` on, a write at offset 0 (the whole extent, or a prefix
//! of it, as a spilled 16-bit gradient in an extent sized for fp32) records
//! the crc32c of its data and the length it covers, and a read of exactly
//! that prefix verifies it. A write at another offset clears a recorded
//! crc it overlaps. (Until 2026-12-05 only whole-extent I/O was checked,
//! so the spilled gradients, written and read as prefixes, never were.)
//!
//! ## Copies to and from ordinary files
//! [`SwapSpace::copy_extent_to_file`] and
//! [`SwapSpace::copy_extent_from_file`] move an extent's bytes (piece by
//! striping piece). Checkpoints use them for NVMe optimizer state. Three
//! ways, the first that applies: where both files are on one XFS or btrfs
//! file system, `copy_file_range` (the kernel reflinks, moving no data);
//! for a save (extent to file) where every offset and length is aligned
//! and both files take O_DIRECT, direct reads and writes through an 8 MiB
//! bounce buffer, past the page cache (on this ext4 VM a 2.4 GiB save took
//! 1.7-3.2 s against about 7 s with `copy_file_range`, which copied
//! through the page cache with a core of kernel memcpy); else
//! `copy_file_range` in-kernel, and where the kernel refuses that call
//! between the two files, a `pread`/`pwrite` fallback through a 1 MiB heap
//! buffer. The [`CopyReport`] says how many bytes took which way.
//!
//! ## O_DIRECT
//! `DirectIo::Auto` opens with `O_DIRECT` and falls back to buffered I/O
//! with a warning where the file system refuses it (tmpfs); `Require`
//! fails with [`SwapError::DirectIoUnsupported`] instead.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::align::Alignment;
use crate::alloc::ExtentAllocator;
use crate::error::{IoOp, Result, SwapError};

mod copy;
mod room;
pub use copy::CopyReport;
use room::{check_room, size_file};
pub use room::{filesystem_space, FsSpace};

/// Why a space was poisoned: the failed write's message, its OS error's
/// kind and code (see [`SwapError::Poisoned`]).
pub(crate) type PoisonCause = (String, Option<std::io::ErrorKind>, Option<i32>);

/// Name of the subdirectory we create under each NVMe path.
pub const SWAP_SUBDIR: &str = "tierzero";
const SWAP_EXT: &str = "tzswap";

/// Index of a file in a space (also its io_uring fixed-file index).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileIdx(pub u32);

/// Identity of an extent within its space.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExtentId(pub u64);

/// O_DIRECT policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirectIo {
    /// O_DIRECT where supported; buffered with a warning elsewhere.
    Auto,
    /// O_DIRECT or an error.
    Require,
    /// Buffered I/O through the page cache.
    Off,
}

/// Settings for [`SwapSpace::create`].
#[derive(Debug, Clone)]
pub struct SpaceConfig {
    /// One directory per device; each gets a file.
    pub paths: Vec<PathBuf>,
    /// Size of the file on each path.
    pub capacity_bytes_per_path: u64,
    /// Chunk size for striping over paths (rounded up to the alignment).
    pub stripe_bytes: u64,
    /// O_DIRECT policy.
    pub direct_io: DirectIo,
    /// Record and verify crc32c per extent.
    pub checksums: bool,
    /// `fallocate` the files up front, after checking the file system's
    /// free space ([`SwapError::NoRoom`] now, not `ENOSPC` mid-run).
    pub preallocate: bool,
}

impl SpaceConfig {
    /// One path, `capacity_bytes`, O_DIRECT where possible, 1 MiB stripes.
    pub fn new(path: impl Into<PathBuf>, capacity_bytes: u64) -> Self {
        SpaceConfig {
            paths: vec![path.into()],
            capacity_bytes_per_path: capacity_bytes,
            stripe_bytes: 1 << 20,
            direct_io: DirectIo::Auto,
            checksums: false,
            preallocate: true,
        }
    }
}

/// One open swap file.
#[derive(Debug)]
pub struct SwapFile {
    path: PathBuf,
    file: File,
    direct: bool,
    owned: bool,
    alloc: Mutex<ExtentAllocator>,
}

impl SwapFile {
    /// Where the file is.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// Whether it was opened with O_DIRECT.
    pub fn is_direct(&self) -> bool {
        self.direct
    }
    /// Whether this process made it (and its drop removes it), as opposed
    /// to an existing file opened ([`SwapSpace::open_file`]).
    pub fn is_owned(&self) -> bool {
        self.owned
    }
    pub(crate) fn file(&self) -> &File {
        &self.file
    }
    /// Free bytes in this file.
    pub fn free_bytes(&self) -> u64 {
        self.lock_alloc().free_bytes()
    }
    /// Capacity of this file.
    pub fn capacity_bytes(&self) -> u64 {
        self.lock_alloc().capacity_bytes()
    }
    fn lock_alloc(&self) -> std::sync::MutexGuard<'_, ExtentAllocator> {
        self.alloc.lock().unwrap_or_else(|e| e.into_inner())
    }
}

static NEXT_SPACE: AtomicU64 = AtomicU64::new(0);

/// A set of swap files and the extents allocated in them.
#[derive(Debug)]
pub struct SwapSpace {
    id: u64,
    files: Vec<SwapFile>,
    alignment: Alignment,
    stripe_bytes: u64,
    checksums: bool,
    poisoned: AtomicBool,
    /// The first failed write's message and OS error kind.
    poison_cause: Mutex<Option<PoisonCause>>,
    next_extent: AtomicU64,
    /// The `tierzero/` directories this space uses (dropped after the files).
    _dirs: Vec<DirLease>,
}

/// Per-process use of one swap directory: how many spaces use it, whether
/// this process created it, and the directory lock they share.
#[derive(Debug)]
struct DirUse {
    users: usize,
    created: bool,
    lock: Option<crate::lock::DirLock>,
    warned_buffered: bool,
}

/// Per-process uses of swap directories, keyed by canonical path (so two
/// spellings of one directory share one lock: `flock` would otherwise
/// conflict with ourselves). The last space using a directory releases its
/// lock, and removes the directory (if empty) when this process created it,
/// whichever space created it.
static DIR_USERS: Mutex<Option<HashMap<PathBuf, DirUse>>> = Mutex::new(None);

/// One space's use of a swap directory; released on drop.
#[derive(Debug)]
struct DirLease {
    key: PathBuf,
    dir: PathBuf,
}

impl DirLease {
    /// Creates `dir` (0700) if missing and takes the directory lock if this
    /// process does not hold it yet, under the registry lock so a space
    /// dropping concurrently cannot remove or unlock it in between.
    fn acquire(dir: PathBuf) -> Result<Self> {
        let mut guard = DIR_USERS.lock().unwrap_or_else(|e| e.into_inner());
        let users = guard.get_or_insert_with(HashMap::new);
        let created = match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => true,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let m = std::fs::symlink_metadata(&dir).map_err(|source| SwapError::Setup {
                    what: format!("swap directory {}", dir.display()),
                    source,
                })?;
                if !m.is_dir() {
                    return Err(SwapError::Config(format!(
                        "{} exists and is not a directory (refusing to follow a symlink or replace a file)",
                        dir.display()
                    )));
                }
                false
            }
            Err(source) => {
                return Err(SwapError::Setup {
                    what: format!("creating swap directory {}", dir.display()),
                    source,
                })
            }
        };
        let key = std::fs::canonicalize(&dir).unwrap_or_else(|_| dir.clone());
        if let Some(entry) = users.get_mut(&key) {
            entry.users += 1;
            entry.created |= created;
        } else {
            let lock = match crate::lock::DirLock::acquire(&key) {
                Ok(l) => l,
                Err(e) => {
                    if created {
                        let _ = std::fs::remove_dir(&dir);
                    }
                    return Err(e);
                }
            };
            users.insert(
                key.clone(),
                DirUse {
                    users: 1,
                    created,
                    lock,
                    warned_buffered: false,
                },
            );
        }
        Ok(DirLease { key, dir })
    }

    /// Whether this process holds the directory's `flock` (false where the
    /// file system has no `flock`: a warning, and no lock).
    fn locked(&self) -> bool {
        let guard = DIR_USERS.lock().unwrap_or_else(|e| e.into_inner());
        guard
            .as_ref()
            .and_then(|u| u.get(&self.key))
            .is_some_and(|entry| entry.lock.is_some())
    }

    /// True the first time it is called for this directory while in use:
    /// the buffered-I/O fallback is reported once per directory, not once
    /// per space.
    fn first_buffered_warning(&self) -> bool {
        let mut guard = DIR_USERS.lock().unwrap_or_else(|e| e.into_inner());
        match guard.as_mut().and_then(|u| u.get_mut(&self.key)) {
            Some(entry) => !std::mem::replace(&mut entry.warned_buffered, true),
            None => true,
        }
    }
}

impl Drop for DirLease {
    fn drop(&mut self) {
        let mut guard = DIR_USERS.lock().unwrap_or_else(|e| e.into_inner());
        let Some(users) = guard.as_mut() else { return };
        let Some(entry) = users.get_mut(&self.key) else {
            return;
        };
        entry.users -= 1;
        if entry.users == 0 {
            if let Some(entry) = users.remove(&self.key) {
                // Unlinks the lock file, then unlocks.
                drop(entry.lock);
                if entry.created {
                    // Only succeeds if empty: other processes' files stay.
                    let _ = std::fs::remove_dir(&self.dir);
                }
            }
        }
    }
}

impl SwapSpace {
    /// Creates the files under each path's `tierzero/` subdirectory.
    pub fn create(config: SpaceConfig) -> Result<Arc<Self>> {
        if config.paths.is_empty() {
            return Err(SwapError::Config("no swap paths given".into()));
        }
        let alignment = config
            .paths
            .iter()
            .map(|p| Alignment::for_path(p))
            .max()
            .unwrap_or(Alignment::new(4096));
        let capacity =
            config.capacity_bytes_per_path - config.capacity_bytes_per_path % alignment.bytes();
        if capacity == 0 {
            return Err(SwapError::Config(format!(
                "swap capacity per path of {} bytes is below one aligned block of {} bytes",
                config.capacity_bytes_per_path,
                alignment.bytes()
            )));
        }
        let space_seq = NEXT_SPACE.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        // The files made so far, removed if a later path fails (the space
        // that would own them is never built, and `reclaim_stale` spares
        // this process's own files).
        struct Made(Vec<PathBuf>);
        impl Drop for Made {
            fn drop(&mut self) {
                for p in &self.0 {
                    let _ = std::fs::remove_file(p);
                    OWN_FILES.remove(p);
                }
            }
        }
        // Declared last, dropped first: on a failure the files go before
        // the directory leases, whose drop removes a `tierzero/` this
        // space created once it is empty (and unlocks it).
        let mut dirs = Vec::new();
        let mut files = Vec::new();
        let mut made = Made(Vec::new());
        for (i, base) in config.paths.iter().enumerate() {
            let meta = std::fs::metadata(base).map_err(|source| SwapError::Setup {
                what: format!("swap path {}", base.display()),
                source,
            })?;
            if !meta.is_dir() {
                return Err(SwapError::Config(format!(
                    "swap path {} is not a directory",
                    base.display()
                )));
            }
            let dir = base.join(SWAP_SUBDIR);
            let lease = DirLease::acquire(dir.clone())?;
            reclaim_stale(&dir, lease.locked());
            let path = dir.join(format!("swap-{pid}-{space_seq}-{i}.{SWAP_EXT}"));
            // After the reclaim, whose files' space is free again; before
            // the file exists, so nothing is made for a space that cannot be.
            if config.preallocate {
                check_room(&dir, &path, capacity)?;
            }
            // Listed before it exists: another thread's `reclaim_stale` of
            // this directory must never take it for a dead incarnation's.
            // (On a failure below, `made` forgets it.)
            OWN_FILES.add(path.clone());
            made.0.push(path.clone());
            let (file, direct) =
                open_swap_file(&path, config.direct_io, OpenMode::Create, &|| {
                    lease.first_buffered_warning()
                })?;
            dirs.push(lease);
            let sf = SwapFile {
                path: path.clone(),
                file,
                direct,
                owned: true,
                alloc: Mutex::new(ExtentAllocator::new(capacity, alignment)),
            };
            size_file(&sf.file, &path, capacity, config.preallocate)?;
            files.push(sf);
        }
        // Built: the space owns the files from here (its drop removes them).
        made.0.clear();
        let stripe_bytes = alignment.round_up(config.stripe_bytes.max(1));
        Ok(Arc::new(SwapSpace {
            id: space_seq,
            files,
            alignment,
            stripe_bytes,
            checksums: config.checksums,
            poisoned: AtomicBool::new(false),
            poison_cause: Mutex::new(None),
            next_extent: AtomicU64::new(0),
            _dirs: dirs,
        }))
    }

    /// Uses an existing file (for benchmarks). It is never removed or
    /// resized; its contents are overwritten by writes. Opened read-only
    /// unless `writable` (a write through it then fails with `EBADF`).
    pub fn open_file(
        path: &Path,
        direct_io: DirectIo,
        checksums: bool,
        writable: bool,
    ) -> Result<Arc<Self>> {
        let mode = if writable {
            OpenMode::Existing
        } else {
            OpenMode::ReadOnly
        };
        let (file, direct) = open_swap_file(path, direct_io, mode, &|| true)?;
        let len = file
            .metadata()
            .map_err(|source| SwapError::Setup {
                what: format!("stat {}", path.display()),
                source,
            })?
            .len();
        let alignment = Alignment::for_path(path);
        let sf = SwapFile {
            path: path.to_path_buf(),
            file,
            direct,
            owned: false,
            alloc: Mutex::new(ExtentAllocator::new(len, alignment)),
        };
        Ok(Arc::new(SwapSpace {
            id: NEXT_SPACE.fetch_add(1, Ordering::Relaxed),
            files: vec![sf],
            alignment,
            stripe_bytes: alignment.round_up(len.max(1)),
            checksums,
            poisoned: AtomicBool::new(false),
            poison_cause: Mutex::new(None),
            next_extent: AtomicU64::new(0),
            _dirs: Vec::new(),
        }))
    }

    /// Unique id of this space within the process.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The O_DIRECT alignment of all files.
    pub fn alignment(&self) -> Alignment {
        self.alignment
    }

    /// The files, indexed by [`FileIdx`].
    pub fn files(&self) -> &[SwapFile] {
        &self.files
    }

    pub(crate) fn file(&self, idx: FileIdx) -> &SwapFile {
        &self.files[idx.0 as usize]
    }

    /// Whether checksums are on.
    pub fn checksums(&self) -> bool {
        self.checksums
    }

    /// Free bytes over all files.
    pub fn free_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.free_bytes()).sum()
    }

    /// Raw fds in [`FileIdx`] order, for io_uring file registration.
    pub(crate) fn raw_fds(&self) -> Vec<i32> {
        self.files.iter().map(|f| f.file.as_raw_fd()).collect()
    }

    /// [`SwapError::OutOfSpace`] for `requested_bytes`: the space's free
    /// bytes and its largest free range over every file, named by the
    /// first file (the free bytes were the whole space's beside file 0's
    /// largest range, or one file's alone).
    fn out_of_space(&self, requested_bytes: u64) -> SwapError {
        SwapError::OutOfSpace {
            path: self.file(FileIdx(0)).path.clone(),
            requested_bytes,
            free_bytes: self.free_bytes(),
            largest_free_bytes: self
                .files
                .iter()
                .map(|f| f.lock_alloc().largest_free_bytes())
                .max()
                .unwrap_or(0),
        }
    }

    /// Allocates an extent of `len_bytes` (rounded up to the alignment),
    /// striped over the paths when it is larger than one stripe.
    pub fn allocate(self: &Arc<Self>, len_bytes: u64) -> Result<Extent> {
        // More than the space holds never fits (and near u64::MAX the
        // rounding below would overflow).
        let capacity_bytes: u64 = self.files.iter().map(SwapFile::capacity_bytes).sum();
        if len_bytes > capacity_bytes {
            return Err(self.out_of_space(len_bytes));
        }
        let len = self.alignment.round_up(len_bytes.max(1));
        let id = ExtentId(self.next_extent.fetch_add(1, Ordering::Relaxed));
        let chunks = len.div_ceil(self.stripe_bytes);
        let nfiles = self.files.len() as u64;
        let nparts = nfiles.min(chunks).max(1);
        let first = id.0 % nfiles;
        let mut parts: Vec<Part> = Vec::with_capacity(nparts as usize);
        for p in 0..nparts {
            // Chunks p, p+P, p+2P, ...; only the very last chunk can be short.
            let nchunks = (chunks - p).div_ceil(nparts);
            let mut part_len = nchunks * self.stripe_bytes;
            if (chunks - 1) % nparts == p {
                part_len -= chunks * self.stripe_bytes - len;
            }
            // The rotation's file, else the next with room: a part never
            // fails while another file holds it (with a full first choice
            // it did, the other files' room unused).
            let preferred = (first + p) % nfiles;
            let got = (0..nfiles)
                .map(|k| FileIdx(((preferred + k) % nfiles) as u32))
                .find_map(|file| {
                    let offset = self.file(file).lock_alloc().allocate(part_len);
                    offset.map(|offset_bytes| (file, offset_bytes))
                });
            match got {
                Some((file, offset_bytes)) => parts.push(Part {
                    file,
                    offset_bytes,
                    len_bytes: part_len,
                }),
                None => {
                    for part in &parts {
                        self.file(part.file)
                            .lock_alloc()
                            .free(part.offset_bytes, part.len_bytes);
                    }
                    return Err(self.out_of_space(len));
                }
            }
        }
        Ok(Extent(Arc::new(ExtentInner {
            id,
            len_bytes: len,
            stripe_bytes: self.stripe_bytes,
            parts,
            crc: Mutex::new(None),
            space: self.clone(),
        })))
    }

    /// Marks the space poisoned (the first cause wins), with the failed
    /// write's OS error kind when it had one.
    pub fn poison(&self, cause: String, failed: &SwapError) {
        let (io_kind, os_error) = (failed.io_kind(), failed.raw_os_error());
        let mut c = self.poison_cause.lock().unwrap_or_else(|e| e.into_inner());
        if c.is_none() {
            tracing::error!(%cause, "swap space poisoned");
            *c = Some((cause, io_kind, os_error));
        }
        self.poisoned.store(true, Ordering::Release);
    }

    /// Whether a write has failed in this space.
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire)
    }

    /// `Err(Poisoned)` if the space is poisoned.
    pub fn check_poison(&self, op: IoOp) -> Result<()> {
        if !self.is_poisoned() {
            return Ok(());
        }
        let (cause, io_kind, os_error) = self
            .poison_cause
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_default();
        Err(SwapError::Poisoned {
            op,
            cause,
            io_kind,
            os_error,
        })
    }
}

impl Drop for SwapSpace {
    fn drop(&mut self) {
        for f in &self.files {
            if f.owned {
                if let Err(e) = std::fs::remove_file(&f.path) {
                    tracing::warn!(path = %f.path.display(), error = %e, "could not remove swap file");
                }
                OWN_FILES.remove(&f.path);
            }
        }
    }
}

/// The swap files this process created and has not removed (see
/// [`crate::process::OwnPaths`]).
static OWN_FILES: crate::process::OwnPaths = crate::process::OwnPaths::new();

/// Opens (or creates) a swap file under the O_DIRECT policy. `warn` says
/// whether to log the buffered fallback (once per directory).
/// How [`open_swap_file`] opens its file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpenMode {
    /// A new file, read-write (`create_new`, mode 0600).
    Create,
    /// An existing file, read-write.
    Existing,
    /// An existing file, read-only.
    ReadOnly,
}

fn open_swap_file(
    path: &Path,
    policy: DirectIo,
    mode: OpenMode,
    warn: &dyn Fn() -> bool,
) -> Result<(File, bool)> {
    let create = mode == OpenMode::Create;
    let open = |direct: bool| {
        let mut o = OpenOptions::new();
        o.read(true).write(mode != OpenMode::ReadOnly);
        if create {
            o.create_new(true).mode(0o600);
        }
        let mut flags = libc::O_CLOEXEC | libc::O_NOFOLLOW;
        if direct {
            flags |= libc::O_DIRECT;
        }
        o.custom_flags(flags);
        o.open(path)
    };
    if policy == DirectIo::Off {
        return open(false)
            .map(|f| (f, false))
            .map_err(|source| SwapError::Setup {
                what: format!("opening swap file {}", path.display()),
                source,
            });
    }
    match open(true) {
        Ok(f) => Ok((f, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            if create {
                // create_new may have created it before O_DIRECT was refused.
                let _ = std::fs::remove_file(path);
            }
            if policy == DirectIo::Require {
                return Err(SwapError::DirectIoUnsupported {
                    path: path.to_path_buf(),
                });
            }
            if warn() {
                tracing::warn!(path = %path.display(), "O_DIRECT is not supported here; using buffered I/O (slower, and it uses page cache; a training config's tierzero.direct_io \"require\" refuses instead)");
            }
            open(false)
                .map(|f| (f, false))
                .map_err(|source| SwapError::Setup {
                    what: format!("opening swap file {}", path.display()),
                    source,
                })
        }
        Err(source) => Err(SwapError::Setup {
            what: format!("opening swap file {}", path.display()),
            source,
        }),
    }
}

/// Makes a write past `RLIMIT_FSIZE` fail with `EFBIG`, reported like any
/// other I/O error (operation, file, offset), instead of killing the
/// process with `SIGXFSZ`. Binaries call it once at start-up.
pub fn ignore_sigxfsz() {
    // SAFETY: setting a signal's disposition to SIG_IGN installs no handler
    // code and touches no memory of ours.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
}

/// Removes the stale swap files (of processes that are gone) under the
/// swap path `base`, as creating a [`SwapSpace`] there does, without
/// creating one: for a run that ends before it needs swap space (a
/// resume with nothing left to do). Holds the directory's lock while it
/// looks, so no live space's file is touched. A `base` without our
/// subdirectory has nothing to reclaim.
pub fn reclaim_stale_files(base: &Path) -> Result<()> {
    let dir = base.join(SWAP_SUBDIR);
    if !dir.is_dir() {
        return Ok(());
    }
    let lease = DirLease::acquire(dir.clone())?;
    reclaim_stale(&dir, lease.locked());
    Ok(())
}

/// Removes the `swap-<pid>-*.tzswap` files no live space uses (this
/// process's pid: files it did not create, see [`OWN_FILES`]). With the
/// directory's lock held (`locked`), every other pid's file is stale: a
/// process that made files there held the lock while they lived, and
/// still would. Only where the file system gave no lock does the owner's
/// pid decide, by [`process_alive`], which pid reuse (after a reboot) and
/// zombies (a rank mpirun left unreaped) can fool into keeping a dead
/// run's files for good.
fn reclaim_stale(dir: &Path, locked: bool) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(pid) = swap_file_owner_pid(name) else {
            continue;
        };
        // `swap-<pid>-<space seq>-<path index>`: unique within a process.
        let in_use = match (locked, pid == std::process::id()) {
            (true, false) => false,
            _ => OWN_FILES.in_use(pid, &entry.path()),
        };
        if in_use {
            continue;
        }
        match entry.file_type() {
            Ok(t) if t.is_file() => {}
            _ => continue,
        }
        let path = entry.path();
        match std::fs::remove_file(&path) {
            Ok(()) => {
                tracing::warn!(path = %path.display(), pid, "reclaimed stale swap file of a run that is gone")
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "could not reclaim stale swap file")
            }
        }
    }
}

/// The owning pid in a file name of our pattern `swap-<pid>-<n>-<m>.tzswap`,
/// or `None` if the name is not ours. Stale-file reclaim and
/// `tierzero inspect` both use this, so they agree on what is ours.
pub fn swap_file_owner_pid(name: &str) -> Option<u32> {
    let rest = name
        .strip_prefix("swap-")?
        .strip_suffix(&format!(".{SWAP_EXT}"))?;
    let mut it = rest.split('-');
    let pid = it.next()?.parse().ok()?;
    let a = it.next()?;
    let b = it.next()?;
    if it.next().is_some() || a.parse::<u64>().is_err() || b.parse::<u64>().is_err() {
        return None;
    }
    Some(pid)
}

/// Whether process `pid` exists (`kill(pid, 0)`). A process we may not
/// signal (`EPERM`) counts as alive: only `ESRCH` proves it is gone, so a
/// file is never called stale while its owner might still use it. Linux's
/// `kill` also takes a thread id; a `pid` that `/proc` says is a thread of
/// another process (its `Tgid` differs) is no process, so not alive: the
/// pid of a dead writer is often reused by some thread.
pub fn process_alive(pid: u32) -> bool {
    let Ok(pid_i) = i32::try_from(pid) else {
        return false;
    };
    // SAFETY: kill with signal 0 only checks for existence.
    let rc = unsafe { libc::kill(pid_i, 0) };
    let exists = rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH);
    exists && thread_group_of(pid).is_none_or(|tgid| tgid == pid)
}

/// The `Tgid` (process id) `/proc/<tid>/status` gives for thread `tid`,
/// if it can be read.
fn thread_group_of(tid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse().ok())
}

#[derive(Debug, Clone, Copy)]
struct Part {
    file: FileIdx,
    offset_bytes: u64,
    len_bytes: u64,
}

/// The crc32c of an extent's first `len_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PrefixCrc {
    pub len_bytes: u64,
    pub crc: u32,
}

#[derive(Debug)]
struct ExtentInner {
    id: ExtentId,
    len_bytes: u64,
    stripe_bytes: u64,
    parts: Vec<Part>,
    /// The crc32c of the extent's first `len_bytes` (the whole extent, or
    /// the prefix a range write at offset 0 wrote), if recorded.
    crc: Mutex<Option<PrefixCrc>>,
    space: Arc<SwapSpace>,
}

impl Drop for ExtentInner {
    fn drop(&mut self) {
        for p in &self.parts {
            self.space
                .file(p.file)
                .lock_alloc()
                .free(p.offset_bytes, p.len_bytes);
        }
    }
}

/// An allocated, aligned, possibly striped byte range of a swap space.
/// Cloning shares it; the space is freed when the last clone drops (the
/// I/O engine holds a clone while a transfer is in flight).
#[derive(Debug, Clone)]
pub struct Extent(Arc<ExtentInner>);

/// One contiguous piece of a transfer, in one file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Which file.
    pub file: FileIdx,
    /// Offset in the file.
    pub file_offset_bytes: u64,
    /// Offset from the start of the transfer (and of the buffer).
    pub buf_offset_bytes: u64,
    /// Length of the piece.
    pub len_bytes: u64,
}

impl Extent {
    /// Id within its space.
    pub fn id(&self) -> ExtentId {
        self.0.id
    }
    /// Length in bytes (a multiple of the alignment).
    pub fn len_bytes(&self) -> u64 {
        self.0.len_bytes
    }
    /// The space the extent lives in.
    pub fn space(&self) -> &Arc<SwapSpace> {
        &self.0.space
    }
    /// Number of files the extent is striped over.
    pub fn stripe_width(&self) -> usize {
        self.0.parts.len()
    }

    /// Splits `[offset_bytes, offset_bytes + len_bytes)` of the extent into
    /// per-file pieces of at most `max_piece_bytes`, in logical order.
    pub fn pieces(&self, offset_bytes: u64, len_bytes: u64, max_piece_bytes: u64) -> Vec<Piece> {
        let inner = &*self.0;
        let nparts = inner.parts.len() as u64;
        let stripe = inner.stripe_bytes;
        let max_piece = max_piece_bytes.max(1);
        let mut out = Vec::new();
        let mut pos = offset_bytes;
        let end = offset_bytes + len_bytes;
        while pos < end {
            let chunk = pos / stripe;
            let within = pos % stripe;
            let part = &inner.parts[(chunk % nparts) as usize];
            let file_off = part.offset_bytes + (chunk / nparts) * stripe + within;
            let len = (stripe - within).min(end - pos).min(max_piece);
            out.push(Piece {
                file: part.file,
                file_offset_bytes: file_off,
                buf_offset_bytes: pos - offset_bytes,
                len_bytes: len,
            });
            pos += len;
        }
        out
    }

    /// The crc32c recorded by the last whole-extent write (spaces with
    /// checksums on), if any. Covers all [`Extent::len_bytes`] (a prefix's
    /// crc is not returned).
    pub fn recorded_crc32c(&self) -> Option<u32> {
        self.checksum()
            .filter(|c| c.len_bytes == self.len_bytes())
            .map(|c| c.crc)
    }

    /// Records `crc` as the checksum of the extent's whole contents, to be
    /// verified by the next whole-extent read (used after
    /// [`SwapSpace::copy_extent_from_file`] with a crc the caller verified).
    pub fn set_recorded_crc32c(&self, crc: Option<u32>) {
        self.set_checksum(crc.map(|crc| PrefixCrc {
            len_bytes: self.len_bytes(),
            crc,
        }));
    }

    /// The recorded crc32c and the prefix it covers, if any.
    pub(crate) fn checksum(&self) -> Option<PrefixCrc> {
        *self.0.crc.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn set_checksum(&self, crc: Option<PrefixCrc>) {
        *self.0.crc.lock().unwrap_or_else(|e| e.into_inner()) = crc;
    }

    /// After a successful write of `[offset_bytes, offset_bytes +
    /// len_bytes)` whose crc32c is `crc` (computed for writes at offset 0):
    /// a write at offset 0 records its prefix; any other write clears a
    /// recorded prefix it overlaps.
    pub(crate) fn record_write(&self, offset_bytes: u64, len_bytes: u64, crc: Option<u32>) {
        let mut g = self.0.crc.lock().unwrap_or_else(|e| e.into_inner());
        *g = match (offset_bytes, crc) {
            (0, Some(crc)) => Some(PrefixCrc { len_bytes, crc }),
            _ => g.filter(|c| offset_bytes >= c.len_bytes),
        };
    }

    /// Where the extent starts on disk (for error messages).
    pub fn first_location(&self) -> (PathBuf, u64) {
        let p = self.0.parts[0];
        (self.0.space.file(p.file).path.clone(), p.offset_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::space::room::size_error;

    /// A space whose second path fails leaves no file of the first behind
    /// (they were left, preallocated, until the process exited), nor the
    /// `tierzero/` directory it made there (its lease was dropped before
    /// the files, so the directory was not empty yet and stayed).
    #[test]
    fn a_failed_create_removes_the_files_it_made() {
        let a = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let not_a_dir = a.path().join("plain-file");
        std::fs::write(&not_a_dir, b"x").unwrap_or_else(|e| panic!("write: {e}"));
        let mut cfg = SpaceConfig::new(a.path(), 1 << 20);
        cfg.paths.push(not_a_dir);
        let e = SwapSpace::create(cfg).err().map(|e| e.to_string());
        assert!(
            e.as_deref().is_some_and(|e| e.contains("not a directory")),
            "{e:?}"
        );
        let dir = a.path().join(SWAP_SUBDIR);
        assert!(
            !dir.exists(),
            "left behind: {:?}",
            std::fs::read_dir(&dir).map(|d| d
                .filter_map(|e| e.ok())
                .map(|e| e.file_name())
                .collect::<Vec<_>>())
        );
    }

    /// A file named with this process's pid that this process did not
    /// create (a dead incarnation's with the same pid, as in a container
    /// restarted as pid 1) is reclaimed; this process's live file is not.
    #[test]
    fn own_pid_files_not_ours_are_reclaimed() {
        let a = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let space = SwapSpace::create(SpaceConfig::new(a.path(), 1 << 20))
            .unwrap_or_else(|e| panic!("create: {e}"));
        let dir = a.path().join(SWAP_SUBDIR);
        let stale = dir.join(format!(
            "swap-{}-{}-0.{SWAP_EXT}",
            std::process::id(),
            u64::MAX
        ));
        std::fs::write(&stale, b"left by a run with our pid").unwrap_or_else(|e| panic!("{e}"));
        // Spelled another way: the live file is still recognised.
        let other_spelling = a.path().join(".").join(SWAP_SUBDIR).join("..");
        reclaim_stale_files(&other_spelling).unwrap_or_else(|e| panic!("reclaim: {e}"));
        assert!(!stale.exists(), "a dead incarnation's file stays");
        let live = space.files[0].path.clone();
        assert!(live.exists(), "this process's live file was removed");
        drop(space);
        assert!(!live.exists());
    }

    /// A part whose rotation's file is full goes to another file with
    /// room: with two 4 MiB files, extents of 1 MiB and 4 KiB by turns put
    /// every 1 MiB one in file 0 (ids 0, 2, 4, 6), and the fifth 1 MiB
    /// failed, 4 MiB free in file 1. A request past the whole space's
    /// free bytes still fails, with its numbers.
    #[test]
    fn a_full_file_s_part_goes_to_another_file_with_room() {
        let a = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let b = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let mut cfg = SpaceConfig::new(a.path(), 4 << 20);
        cfg.paths.push(b.path().to_path_buf());
        let space = SwapSpace::create(cfg).unwrap_or_else(|e| panic!("space: {e}"));
        let mut held = Vec::new();
        for _ in 0..4 {
            for len in [1 << 20, 4096] {
                held.push(
                    space
                        .allocate(len)
                        .unwrap_or_else(|e| panic!("allocate: {e}")),
                );
            }
        }
        assert_eq!(space.file(FileIdx(0)).free_bytes(), 0);
        let moved = space
            .allocate(1 << 20)
            .unwrap_or_else(|e| panic!("file 1 has room: {e}"));
        assert_eq!(moved.0.parts[0].file, FileIdx(1));
        let free = space.free_bytes();
        match space.allocate(free + 4096) {
            Err(SwapError::OutOfSpace {
                free_bytes,
                largest_free_bytes,
                ..
            }) => {
                assert_eq!(free_bytes, free);
                assert_eq!(largest_free_bytes, free);
            }
            other => panic!("{other:?}"),
        }
        drop((held, moved));
    }

    #[test]
    fn extent_copies_round_trip_over_stripes() {
        use std::os::unix::fs::FileExt;
        let a = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let b = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let out = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let mut cfg = SpaceConfig::new(a.path(), 1 << 20);
        cfg.paths.push(b.path().to_path_buf());
        cfg.stripe_bytes = 4096;
        let space = SwapSpace::create(cfg).unwrap_or_else(|e| panic!("space: {e}"));
        let ext = space
            .allocate(5 * 4096)
            .unwrap_or_else(|e| panic!("allocate: {e}"));
        assert_eq!(ext.stripe_width(), 2);
        let len = ext.len_bytes();
        let pattern: Vec<u8> = (0..len as usize + 100)
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        let src_path = out.path().join("src");
        let src = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&src_path)
            .unwrap_or_else(|e| panic!("create: {e}"));
        src.write_all_at(&pattern, 0)
            .unwrap_or_else(|e| panic!("write: {e}"));
        // Fill the extent from offset 100 of the source.
        let r = space
            .copy_extent_from_file(&ext, len, &src, &src_path, 100)
            .unwrap_or_else(|e| panic!("copy in: {e}"));
        // Offset 100 is off the alignment: not the direct way.
        assert_eq!(r.direct_bytes, 0);
        assert_eq!(r.kernel_bytes + r.fallback_bytes, len);
        // Each striping piece landed where `pieces` says.
        for p in ext.pieces(0, len, u64::MAX) {
            let f = File::open(space.file(p.file).path()).unwrap_or_else(|e| panic!("open: {e}"));
            let mut got = vec![0u8; p.len_bytes as usize];
            f.read_exact_at(&mut got, p.file_offset_bytes)
                .unwrap_or_else(|e| panic!("read: {e}"));
            let at = 100 + p.buf_offset_bytes as usize;
            assert_eq!(got, pattern[at..at + p.len_bytes as usize]);
        }
        // And back out, at an offset in a fresh file.
        let dst_path = out.path().join("dst");
        let dst = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&dst_path)
            .unwrap_or_else(|e| panic!("create: {e}"));
        let r = space
            .copy_extent_to_file(&ext, len - 4096, &dst, &dst_path, 4096)
            .unwrap_or_else(|e| panic!("copy out: {e}"));
        assert_eq!(
            r.kernel_bytes + r.fallback_bytes + r.direct_bytes,
            len - 4096
        );
        // Aligned, on O_DIRECT-capable files: past the page cache.
        let direct = space.files().iter().all(SwapFile::is_direct);
        assert_eq!(r.direct_bytes, if direct { len - 4096 } else { 0 }, "{r:?}");
        let mut got = vec![0u8; (len - 4096) as usize];
        dst.read_exact_at(&mut got, 4096)
            .unwrap_or_else(|e| panic!("read: {e}"));
        assert_eq!(got, pattern[100..100 + (len - 4096) as usize]);
        // And in again from there (restores take copy_file_range): the
        // same bytes.
        let ext2 = space
            .allocate(5 * 4096)
            .unwrap_or_else(|e| panic!("allocate: {e}"));
        let r = space
            .copy_extent_from_file(&ext2, len - 4096, &dst, &dst_path, 4096)
            .unwrap_or_else(|e| panic!("copy in again: {e}"));
        assert_eq!(r.direct_bytes, 0, "{r:?}");
        let out2 = out.path().join("dst2");
        let dst2 = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&out2)
            .unwrap_or_else(|e| panic!("create: {e}"));
        space
            .copy_extent_to_file(&ext2, len - 4096, &dst2, &out2, 0)
            .unwrap_or_else(|e| panic!("copy out again: {e}"));
        let mut got2 = vec![0u8; (len - 4096) as usize];
        dst2.read_exact_at(&mut got2, 0)
            .unwrap_or_else(|e| panic!("read: {e}"));
        assert_eq!(got2, got);
        // Longer than the extent: refused before any I/O.
        assert!(matches!(
            space.copy_extent_to_file(&ext, len + 4096, &dst, &dst_path, 0),
            Err(SwapError::OutOfBounds { .. })
        ));
        // A source too short is a short read naming the source file.
        let tiny_path = out.path().join("tiny");
        std::fs::write(&tiny_path, b"short").unwrap_or_else(|e| panic!("write: {e}"));
        let tiny = File::open(&tiny_path).unwrap_or_else(|e| panic!("open: {e}"));
        match space.copy_extent_from_file(&ext, len, &tiny, &tiny_path, 0) {
            Err(SwapError::ShortIo { path, .. }) => assert_eq!(path, tiny_path),
            other => panic!("expected ShortIo, got {other:?}"),
        }
        // ... and poisons the space: the extent's bytes are unknown now.
        assert!(space.is_poisoned());
    }

    #[test]
    fn stale_names() {
        assert_eq!(swap_file_owner_pid("swap-123-0-1.tzswap"), Some(123));
        assert_eq!(swap_file_owner_pid("swap-123-0.tzswap"), None);
        assert_eq!(swap_file_owner_pid("swap-x-0-1.tzswap"), None);
        assert_eq!(swap_file_owner_pid("notes.txt"), None);
        assert_eq!(swap_file_owner_pid("swap-1-2-3.tzswap.bak"), None);
    }

    #[test]
    fn liveness() {
        assert!(process_alive(std::process::id()));
        // Above the kernel's pid_max (at most 2^22), so never a live process.
        assert!(!process_alive(1 << 23));
        // Does not fit in a pid_t: never alive.
        assert!(!process_alive(u32::MAX));
        // A thread of this process: `kill` takes its id, but it is no
        // process (a dead writer's pid is often some thread's now).
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            let tid = unsafe { libc::gettid() };
            tx.send(tid as u32).unwrap_or_else(|e| panic!("{e}"));
            let _ = done_rx.recv();
        });
        let tid = rx.recv().unwrap_or_else(|e| panic!("{e}"));
        assert_ne!(tid, std::process::id());
        assert!(!process_alive(tid), "thread {tid} counted as a process");
        drop(done_tx);
        t.join().unwrap_or_else(|_| panic!("thread"));
    }

    #[test]
    fn fs_space_of_temp_dir() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let s = filesystem_space(dir.path()).unwrap_or_else(|e| panic!("statvfs: {e}"));
        assert!(s.total_bytes > 0);
        assert!(s.available_bytes <= s.total_bytes);
        let missing = dir.path().join("no-such-dir");
        let e = filesystem_space(&missing).err();
        assert_eq!(e.map(|e| e.kind()), Some(std::io::ErrorKind::NotFound));
    }

    /// A space larger than its file system's free space is refused before
    /// any file is made, with the numbers; one that fits is made.
    #[test]
    fn a_space_beyond_the_free_space_is_refused_before_any_file() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let free = filesystem_space(dir.path())
            .unwrap_or_else(|e| panic!("statvfs: {e}"))
            .usable_bytes();
        let too_big = (free + (1 << 30)).next_multiple_of(1 << 20);
        match SwapSpace::create(SpaceConfig::new(dir.path(), too_big)) {
            Err(SwapError::NoRoom {
                path,
                needed_bytes,
                available_bytes,
            }) => {
                assert_eq!(needed_bytes, too_big);
                assert!(available_bytes < needed_bytes, "{available_bytes}");
                assert!(path.starts_with(dir.path().join(SWAP_SUBDIR)), "{path:?}");
            }
            other => panic!("expected NoRoom, got {other:?}"),
        }
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap_or_else(|e| panic!("{e}"))
            .flatten()
            .map(|e| e.path())
            .collect();
        assert!(left.is_empty(), "left behind: {left:?}");
        // Without preallocation nothing is reserved, so nothing is checked.
        let mut sparse = SpaceConfig::new(dir.path(), too_big);
        sparse.preallocate = false;
        assert!(SwapSpace::create(sparse).is_ok());
        assert!(SwapSpace::create(SpaceConfig::new(dir.path(), 1 << 20)).is_ok());
    }

    /// `ENOSPC` from the allocation is the same refusal, with the free
    /// space read then; any other error stays the write's I/O error.
    #[test]
    fn an_allocation_out_of_space_is_no_room() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let path = dir.path().join("swap-1-0-0.tzswap");
        let full = std::io::Error::from_raw_os_error(libc::ENOSPC);
        match size_error(&path, 1 << 40, full) {
            SwapError::NoRoom {
                needed_bytes,
                available_bytes,
                ..
            } => {
                assert_eq!(needed_bytes, 1 << 40);
                assert!(available_bytes > 0);
            }
            other => panic!("expected NoRoom, got {other:?}"),
        }
        // ENOSPC with room left (no inodes): the write's error, not NoRoom.
        let full = std::io::Error::from_raw_os_error(libc::ENOSPC);
        assert!(matches!(
            size_error(&path, 4096, full),
            SwapError::Io {
                len_bytes: 4096,
                ..
            }
        ));
        let eio = std::io::Error::from_raw_os_error(libc::EIO);
        assert!(matches!(
            size_error(&path, 1 << 40, eio),
            SwapError::Io {
                op: IoOp::Write,
                len_bytes: 1099511627776,
                ..
            }
        ));
    }
}

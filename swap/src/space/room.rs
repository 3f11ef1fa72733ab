//! Room on a swap path's file system: its size and free space
//! (`statvfs`), and the check a swap file's preallocation makes against
//! them before it is made, or after its `ENOSPC`.

use std::fs::File;
use std::os::unix::io::AsRawFd;
use std::path::Path;

use crate::error::{IoOp, Result, SwapError};

/// Size and free space of a file system, from `statvfs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsSpace {
    /// Total size of the file system.
    pub total_bytes: u64,
    /// Bytes an unprivileged user can still allocate (`f_bavail`).
    pub available_bytes: u64,
    /// Bytes free, the reserve for root included (`f_bfree`): what a
    /// process with `CAP_SYS_RESOURCE` can allocate (not every root).
    pub free_bytes: u64,
}

impl FsSpace {
    /// The bytes this process may allocate there: a process with
    /// `CAP_SYS_RESOURCE` may use the file system's reserve (ext4 keeps 5%
    /// by default), others `f_bavail`. Being root is not enough: a container's
    /// root often lacks the capability, and an ext4 mounted with `resuid=` /
    /// `resgid=` gives the reserve to someone else; there `f_bfree` was 251
    /// GB, `f_bavail` 79 GB, and a 101 GB file failed with `ENOSPC` as root.
    /// (The `resuid`/`resgid` owner itself is counted at `f_bavail`: refused
    /// a file only the reserve would hold.)
    pub fn usable_bytes(&self) -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        if has_sys_resource(&status) {
            self.free_bytes.max(self.available_bytes)
        } else {
            self.available_bytes
        }
    }
}

/// The size and free space of the file system holding `path`, so callers
/// can check a swap space will fit before creating it.
// `f_frsize`, `f_blocks` and `f_bavail` are `u64` on 64-bit Linux but
// 32-bit on other targets; the casts widen them there.
#[allow(clippy::unnecessary_cast)]
pub fn filesystem_space(path: &Path) -> std::io::Result<FsSpace> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "path contains a NUL byte")
    })?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c_path` is a NUL-terminated string alive for the whole call,
    // and `st` points to writable memory of exactly the type statvfs fills.
    let rc = unsafe { libc::statvfs(c_path.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: statvfs returned 0, so it initialised every field of `st`.
    let st = unsafe { st.assume_init() };
    let frag_bytes = if st.f_frsize > 0 {
        st.f_frsize as u64
    } else {
        st.f_bsize as u64
    };
    Ok(FsSpace {
        total_bytes: (st.f_blocks as u64).saturating_mul(frag_bytes),
        available_bytes: (st.f_bavail as u64).saturating_mul(frag_bytes),
        free_bytes: (st.f_bfree as u64).saturating_mul(frag_bytes),
    })
}

/// Refuses a swap file of `needed_bytes` at `path` that the free space of
/// the file system holding `dir` cannot take ([`SwapError::NoRoom`]). A
/// file system whose space cannot be read, or that reports no size (ramfs
/// says 0 blocks, 0 free, and grows), is not refused: the allocation
/// finds out.
pub(super) fn check_room(dir: &Path, path: &Path, needed_bytes: u64) -> Result<()> {
    match filesystem_space(dir) {
        Ok(s) if s.total_bytes > 0 && s.usable_bytes() < needed_bytes => Err(SwapError::NoRoom {
            path: path.to_path_buf(),
            needed_bytes,
            available_bytes: s.usable_bytes(),
        }),
        _ => Ok(()),
    }
}

/// Whether `/proc/self/status` text says the effective capabilities hold
/// `CAP_SYS_RESOURCE`; false when it cannot tell.
fn has_sys_resource(status: &str) -> bool {
    crate::process::has_capability(status, crate::process::CAP_SYS_RESOURCE)
}

/// The error of a failed sizing of the swap file at `path` to `bytes`:
/// [`SwapError::NoRoom`] for `ENOSPC` (with the free space read after the
/// file is gone), else the write's [`SwapError::Io`].
pub(super) fn size_error(path: &Path, bytes: u64, source: std::io::Error) -> SwapError {
    if source.raw_os_error() == Some(libc::ENOSPC) {
        // Only where the numbers show it: an ENOSPC with room left (no
        // inodes, a btrfs short of metadata) stays the write's error.
        if let Some(available_bytes) = path
            .parent()
            .and_then(|d| filesystem_space(d).ok())
            .map(|s| s.usable_bytes())
            .filter(|&b| b < bytes)
        {
            return SwapError::NoRoom {
                path: path.to_path_buf(),
                needed_bytes: bytes,
                available_bytes,
            };
        }
    }
    SwapError::Io {
        op: IoOp::Write,
        path: path.to_path_buf(),
        offset_bytes: 0,
        len_bytes: bytes,
        source,
    }
}

/// Sizes a new swap file to `bytes`: preallocated (`fallocate`) when
/// asked and the file system can, else sparse (said once); a failure
/// removes the file and is [`size_error`]'s.
pub(super) fn size_file(file: &File, path: &Path, bytes: u64, preallocate: bool) -> Result<()> {
    let fail = |source: std::io::Error| {
        // Truncated first: the file stays open (its caller holds it), so
        // unlinked alone it kept the blocks a failed fallocate took, and
        // the free space read next said 0 B where 51 MiB were free.
        let _ = file.set_len(0);
        let _ = std::fs::remove_file(path);
        size_error(path, bytes, source)
    };
    if preallocate {
        // SAFETY: fallocate on an fd we own; no memory is passed.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, bytes as libc::off_t) };
        if rc == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EOPNOTSUPP) {
            return Err(fail(err));
        }
        // No fallocate here (ext2, ext3 without extents, ramfs): the file
        // is sized sparse and nothing is reserved, so a disk filled by
        // others shows as a failed write mid-run, not as NoRoom now. Said
        // once a process (it was silent while `preallocate` promised it).
        if !SPARSE_SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(
                path = %path.display(),
                bytes,
                "this file system cannot preallocate (fallocate: not supported): the swap file is \
                 sparse and its {bytes} bytes are not reserved; if the disk fills up meanwhile, a \
                 swap write fails mid-run (then free space and --resume from a checkpoint)"
            );
        }
    }
    file.set_len(bytes).map_err(fail)
}

/// Whether a swap file sized sparse for want of `fallocate` was said.
static SPARSE_SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_is_counted_only_with_cap_sys_resource() {
        // A container's root: every capability but CAP_SYS_RESOURCE.
        assert!(!has_sys_resource(
            "Name:\ttierzero\nCapEff:\t000001fffeffffff\n"
        ));
        assert!(has_sys_resource("CapInh:\t0\nCapEff:\t000001ffffffffff\n"));
        assert!(has_sys_resource("CapEff:\t0000000001000000\n"));
        assert!(!has_sys_resource("CapEff:\t0000000000000000\n"));
        assert!(!has_sys_resource("CapEff:\tzz\n"));
        assert!(!has_sys_resource(""));
        let s = FsSpace {
            total_bytes: 100,
            available_bytes: 30,
            free_bytes: 90,
        };
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let want = if has_sys_resource(&status) { 90 } else { 30 };
        assert_eq!(s.usable_bytes(), want);
    }
}

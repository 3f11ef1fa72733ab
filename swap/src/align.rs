//! O_DIRECT alignment.
//!
//! O_DIRECT needs the buffer address, the file offset and the length to be
//! multiples of the device's logical block size (statx's `dio_offset_align`
//! on recent kernels). We read the logical block size from sysfs for the
//! block device that holds each swap path, and never go below 4096 bytes:
//! one page, which also keeps buffers page-aligned for `mlock` and for CUDA
//! host registration.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// The smallest alignment we ever use.
pub const MIN_ALIGNMENT_BYTES: u64 = 4096;

/// A power-of-two byte alignment, at least [`MIN_ALIGNMENT_BYTES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Alignment(u64);

impl Alignment {
    /// An alignment of `bytes`, raised to the minimum and to a power of two.
    pub fn new(bytes: u64) -> Self {
        Alignment(bytes.max(MIN_ALIGNMENT_BYTES).next_power_of_two())
    }

    /// The alignment in bytes.
    pub fn bytes(self) -> u64 {
        self.0
    }

    /// Whether `value` is a multiple of the alignment.
    pub fn is_aligned(self, value: u64) -> bool {
        value.is_multiple_of(self.0)
    }

    /// `value` rounded up to a multiple of the alignment (saturating).
    pub fn round_up(self, value: u64) -> u64 {
        value.div_ceil(self.0).saturating_mul(self.0)
    }

    /// The alignment needed for O_DIRECT on the device holding `path`.
    pub fn for_path(path: &Path) -> Self {
        Alignment::new(logical_block_size(path).unwrap_or(MIN_ALIGNMENT_BYTES))
    }
}

/// The logical block size of the block device holding `path`, from sysfs.
///
/// Returns `None` when it cannot be found (tmpfs, overlay, network file
/// systems): callers then use [`MIN_ALIGNMENT_BYTES`].
pub fn logical_block_size(path: &Path) -> Option<u64> {
    let dev = std::fs::metadata(path).ok()?.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let base = format!("/sys/dev/block/{major}:{minor}");
    // A whole disk has queue/ itself; a partition's queue/ is its parent's.
    for candidate in ["queue/logical_block_size", "../queue/logical_block_size"] {
        let p = Path::new(&base).join(candidate);
        if let Ok(text) = std::fs::read_to_string(&p) {
            if let Ok(v) = text.trim().parse::<u64>() {
                return Some(v);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_rounds() {
        let a = Alignment::new(512);
        assert_eq!(a.bytes(), 4096);
        assert_eq!(a.round_up(1), 4096);
        assert_eq!(a.round_up(4096), 4096);
        assert_eq!(a.round_up(4097), 8192);
        assert!(a.is_aligned(8192));
        assert!(!a.is_aligned(100));
        assert_eq!(Alignment::new(6000).bytes(), 8192);
    }

    #[test]
    fn block_size_of_tmp_is_sane_or_absent() {
        if let Some(lbs) = logical_block_size(Path::new("/")) {
            assert!(lbs.is_power_of_two() && lbs >= 512, "lbs {lbs}");
        }
    }
}

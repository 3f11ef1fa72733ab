//! Writing a region of a file past the page cache, from memory the caller
//! fills chunk by chunk: [`DirectWriter`].
//!
//! # Why
//!
//! A checkpoint of optimizer state held in host memory is most of the
//! host's memory again (12 bytes a param). Written through the page cache,
//! every byte is first copied into a page-cache page the kernel allocates
//! for it, and those pages crowd out the memory the run itself is using
//! until writeback frees them. On the development VM the copy into fresh
//! page-cache pages was most of a save: 3.5 GiB of state in 26.5-30.2 s
//! (117-134 MiB/s, `copy_folio_from_iter_atomic` and `clear_page_erms` 73%
//! of the samples), where the disk writes 1-3 GB/s.
//!
//! # How
//!
//! The file is opened a second time with `O_DIRECT`. The caller's `fill`
//! writes each chunk of the region into an aligned bounce buffer (an
//! aligned window of one heap allocation: no `unsafe`, and the writes are
//! synchronous, so the buffer outlives every call that uses it), and the
//! chunk goes to the disk in one `pwrite` of [`CHUNK_BYTES`], a size at
//! which one call at a time runs at the disk's rate (the same as
//! [`crate::SwapSpace::copy_extent_to_file`]'s).
//!
//! O_DIRECT needs the offset, the length and the memory aligned to the
//! device's logical block size ([`Alignment::for_path`]). Where it does not
//! apply (a file system without O_DIRECT such as tmpfs, an unaligned
//! region, or the kernel refusing the first direct write with `EINVAL`),
//! [`DirectWriter::write_at`] writes nothing and says so, and the caller
//! writes the region another way. After a direct write succeeded, a failed
//! one is an error naming the path, offset and length.
//!
//! Durability is the caller's: a direct write bypasses the page cache, not
//! the device's volatile cache, so the file still needs its `fsync`.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::align::Alignment;
use crate::error::{IoOp, Result, SwapError};

/// Bytes per direct write.
pub const CHUNK_BYTES: usize = 8 << 20;

/// An existing file opened for `O_DIRECT` writes, with its bounce buffer
/// (see the module docs).
#[derive(Debug)]
pub struct DirectWriter {
    file: File,
    path: PathBuf,
    align: Alignment,
    /// `CHUNK_BYTES + align` bytes; the chunk is its aligned window.
    backing: Vec<u8>,
    /// Whether a direct write succeeded (the kernel's verdict on direct
    /// I/O comes with the first one).
    accepted: bool,
}

impl DirectWriter {
    /// Opens `path` (which must exist) for direct writes, or `None` where
    /// the file system refuses `O_DIRECT`.
    pub fn open(path: &Path) -> Option<Self> {
        let file = OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW | libc::O_DIRECT)
            .open(path)
            .ok()?;
        let align = Alignment::for_path(path);
        Some(DirectWriter {
            file,
            path: path.to_path_buf(),
            align,
            backing: vec![0u8; CHUNK_BYTES + align.bytes() as usize],
            accepted: false,
        })
    }

    /// The alignment the region's offset and length need.
    pub fn alignment(&self) -> Alignment {
        self.align
    }

    /// Writes `len_bytes` at `offset_bytes`, one chunk at a time: `fill(pos,
    /// chunk)` writes every byte of the chunk that starts `pos` bytes into
    /// the region. `Ok(false)`: nothing was written, because the region is
    /// not aligned or the kernel refused this writer's first direct write;
    /// the caller writes it another way (and discards what `fill` saw).
    pub fn write_at(
        &mut self,
        offset_bytes: u64,
        len_bytes: u64,
        mut fill: impl FnMut(u64, &mut [u8]),
    ) -> Result<bool> {
        if !self.align.is_aligned(offset_bytes) || !self.align.is_aligned(len_bytes) {
            return Ok(false);
        }
        let start = self
            .backing
            .as_ptr()
            .align_offset(self.align.bytes() as usize);
        let mut pos = 0u64;
        while pos < len_bytes {
            let n = (len_bytes - pos).min(CHUNK_BYTES as u64) as usize;
            let chunk = &mut self.backing[start..start + n];
            fill(pos, chunk);
            let at = offset_bytes + pos;
            match self.file.write_all_at(chunk, at) {
                Err(e) if !self.accepted && e.raw_os_error() == Some(libc::EINVAL) => {
                    return Ok(false)
                }
                Err(source) => {
                    return Err(SwapError::Io {
                        op: IoOp::Write,
                        path: self.path.clone(),
                        offset_bytes: at,
                        len_bytes: n as u64,
                        source,
                    })
                }
                Ok(()) => self.accepted = true,
            }
            pos += n as u64;
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failure is a panic

    use super::*;

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 % 251) as u8).collect()
    }

    #[test]
    fn a_region_is_written_chunk_by_chunk_and_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        // Two chunks and a partial third, after a leading block left alone.
        let len = 2 * CHUNK_BYTES + 3 * 4096;
        let off = 4096u64;
        std::fs::write(&path, vec![7u8; off as usize + len + 4096]).unwrap();
        let want = pattern(len);
        let Some(mut w) = DirectWriter::open(&path) else {
            eprintln!("skipped: no O_DIRECT on {}", dir.path().display());
            return;
        };
        let mut seen = Vec::new();
        let done = w
            .write_at(off, len as u64, |pos, chunk| {
                seen.push((pos, chunk.len()));
                let p = pos as usize;
                chunk.copy_from_slice(&want[p..p + chunk.len()]);
            })
            .unwrap();
        if !done {
            eprintln!("skipped: the kernel refused O_DIRECT here");
            return;
        }
        assert_eq!(
            seen,
            vec![
                (0, CHUNK_BYTES),
                (CHUNK_BYTES as u64, CHUNK_BYTES),
                (2 * CHUNK_BYTES as u64, 3 * 4096)
            ]
        );
        let back = std::fs::read(&path).unwrap();
        assert_eq!(&back[..off as usize], &vec![7u8; off as usize][..]);
        assert_eq!(&back[off as usize..off as usize + len], &want[..]);
        assert_eq!(&back[off as usize + len..], &vec![7u8; 4096][..]);
    }

    #[test]
    fn an_unaligned_region_is_left_to_the_caller() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, vec![7u8; 16384]).unwrap();
        let Some(mut w) = DirectWriter::open(&path) else {
            return;
        };
        let mut called = false;
        for (off, len) in [(100u64, 4096u64), (0, 100)] {
            assert!(!w.write_at(off, len, |_, _| called = true).unwrap());
        }
        assert!(!called, "fill ran for a region that is not written");
        assert_eq!(std::fs::read(&path).unwrap(), vec![7u8; 16384]);
    }

    #[test]
    fn a_file_that_is_not_there_has_no_writer() {
        let dir = tempfile::tempdir().unwrap();
        assert!(DirectWriter::open(&dir.path().join("missing")).is_none());
    }
}

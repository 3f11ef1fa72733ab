//! A region of a file written past the page cache from memory the caller
//! fills chunk by chunk ([`DirectWriter`]), or read past it into an
//! aligned buffer ([`read_direct`]).
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
//! chunk goes to the disk in one positional write of at most
//! [`CHUNK_BYTES`], a size at which one call at a time runs at the disk's rate (the same as
//! [`crate::SwapSpace::copy_extent_to_file`]'s).
//!
//! O_DIRECT needs the offset, the length and the memory aligned to the
//! device's logical block size ([`Alignment::for_path`]). Where it does not
//! apply (a file system without O_DIRECT, an unaligned
//! region, or the kernel refusing the first direct write with `EINVAL`),
//! [`DirectWriter::write_at`] says so before any chunk was written whole,
//! and the caller writes the whole region another way. After a direct write succeeded, a failed
//! one is an error naming the path, offset and length.
//!
//! Durability is the caller's: a direct write bypasses the page cache, not
//! the device's volatile cache, so the file still needs its `fsync`.
//!
//! # Reading
//!
//! [`read_direct`] reads a region whole with `O_DIRECT` into an
//! [`AlignedBytes`] (an aligned window of one heap allocation, so the
//! caller may view it as `f32`s in place), or says it does not apply, as
//! above. A checkpoint's region read through the page cache was copied
//! twice (into the cache, then out of it) and left a cached copy of the
//! state beside the state itself.

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
    /// The bounce buffer: one chunk.
    chunk: AlignedBytes,
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
            chunk: AlignedBytes::zeroed(CHUNK_BYTES, align.bytes() as usize),
            accepted: false,
        })
    }

    /// The alignment the region's offset and length need.
    pub fn alignment(&self) -> Alignment {
        self.align
    }

    /// Writes `len_bytes` at `offset_bytes`, one chunk at a time: `fill(pos,
    /// chunk)` writes every byte of the chunk that starts `pos` bytes into
    /// the region. `Ok(false)`: the region is not aligned (nothing was
    /// written), or the kernel refused this writer's first direct write
    /// (at most a part of the first chunk may have reached the file); the
    /// caller writes the whole region another way, and discards what
    /// `fill` saw.
    pub fn write_at(
        &mut self,
        offset_bytes: u64,
        len_bytes: u64,
        mut fill: impl FnMut(u64, &mut [u8]),
    ) -> Result<bool> {
        if !self.align.is_aligned(offset_bytes) || !self.align.is_aligned(len_bytes) {
            return Ok(false);
        }
        let mut pos = 0u64;
        while pos < len_bytes {
            let n = (len_bytes - pos).min(CHUNK_BYTES as u64) as usize;
            let chunk = &mut self.chunk.as_mut_slice()[..n];
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

/// Bytes in an aligned window of a heap allocation (see the module docs).
#[derive(Debug)]
pub struct AlignedBytes {
    backing: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBytes {
    /// `len_bytes` zero bytes whose first one is aligned to `align_bytes`
    /// (a power of two).
    pub fn zeroed(len_bytes: usize, align_bytes: usize) -> Self {
        let backing = vec![0u8; len_bytes + align_bytes];
        let start = backing.as_ptr().align_offset(align_bytes);
        AlignedBytes {
            backing,
            start,
            len: len_bytes,
        }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.backing[self.start..self.start + self.len]
    }

    /// The bytes, to write.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.backing[self.start..self.start + self.len]
    }
}

/// Reads `len_bytes` at `offset_bytes` of `path` past the page cache, or
/// `None` where that does not apply: a file system without `O_DIRECT`, a
/// region off the device's alignment, or the kernel refusing the read
/// with `EINVAL`. The caller then reads it another way. A short read (end
/// of file) is [`SwapError::ShortIo`]; another failure is
/// [`SwapError::Io`], naming the path, offset and length.
pub fn read_direct(path: &Path, offset_bytes: u64, len_bytes: u64) -> Result<Option<AlignedBytes>> {
    let align = Alignment::for_path(path);
    if !align.is_aligned(offset_bytes) || !align.is_aligned(len_bytes) {
        return Ok(None);
    }
    let Ok(file) = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW | libc::O_DIRECT)
        .open(path)
    else {
        return Ok(None);
    };
    let Ok(len) = usize::try_from(len_bytes) else {
        return Ok(None);
    };
    let mut out = AlignedBytes::zeroed(len, align.bytes() as usize);
    // `read_exact_at` would not say how much it read before the end.
    let mut got = 0usize;
    while got < len {
        match file.read_at(&mut out.as_mut_slice()[got..], offset_bytes + got as u64) {
            Ok(0) => {
                return Err(SwapError::ShortIo {
                    op: IoOp::Read,
                    path: path.to_path_buf(),
                    offset_bytes,
                    expected_bytes: len_bytes,
                    got_bytes: got as u64,
                })
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if got == 0 && e.raw_os_error() == Some(libc::EINVAL) => return Ok(None),
            Err(source) => {
                return Err(SwapError::Io {
                    op: IoOp::Read,
                    path: path.to_path_buf(),
                    offset_bytes: offset_bytes + got as u64,
                    len_bytes: len_bytes - got as u64,
                    source,
                })
            }
        }
    }
    Ok(Some(out))
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
            eprintln!("skipped: no O_DIRECT on {}", dir.path().display());
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
    fn a_region_reads_back_aligned_past_the_page_cache() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let bytes = pattern(5 * 4096 + 100);
        std::fs::write(&path, &bytes).unwrap();
        let Some(got) = read_direct(&path, 4096, 3 * 4096).unwrap() else {
            eprintln!("skipped: no O_DIRECT on {}", dir.path().display());
            return;
        };
        assert_eq!(got.as_slice(), &bytes[4096..4 * 4096]);
        assert_eq!(got.as_slice().as_ptr() as usize % 4096, 0);
        // Unaligned: left to the caller.
        assert!(read_direct(&path, 100, 4096).unwrap().is_none());
        assert!(read_direct(&path, 0, 100).unwrap().is_none());
        // Past the end of the file: a short read, named, with what it got
        // (the last whole block at least, of the 4196 bytes there).
        match read_direct(&path, 4 * 4096, 4 * 4096) {
            Err(SwapError::ShortIo {
                offset_bytes,
                got_bytes,
                ..
            }) => {
                assert_eq!(offset_bytes, 4 * 4096);
                assert!((4096..=4196).contains(&got_bytes), "{got_bytes}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_file_that_is_not_there_has_no_writer() {
        let dir = tempfile::tempdir().unwrap();
        assert!(DirectWriter::open(&dir.path().join("missing")).is_none());
    }
}

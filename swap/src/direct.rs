//! A region of a file written past the page cache from memory the caller
//! fills chunk by chunk ([`DirectWriter`]), or read past it into an
//! aligned buffer ([`read_direct`]); a whole file read past it chunk by
//! chunk ([`ChunkReader`]).
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
//!
//! [`ChunkReader`] reads a whole file of any length front to back in
//! chunks of [`CHUNK_BYTES`] through one aligned buffer, for one pass
//! over it (`tierzero inspect --verify`'s checksums). A direct read that
//! ends off a block boundary (the file's end, or a short read) hands the
//! rest to buffered reads; only a read of nothing is the end.
//!
//! # Tests
//!
//! Where the temporary directory refuses `O_DIRECT` the tests of the
//! direct paths say they skipped; with `TIERZERO_REQUIRE_DIRECT_IO=1`
//! (set by `.ci/run` where a probe finds `O_DIRECT` working) they fail
//! instead, so CI runs the direct paths, not their fallbacks.

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
        let (align, chunk) = chunk_for(path);
        Some(DirectWriter {
            file,
            path: path.to_path_buf(),
            align,
            chunk,
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

/// The alignment direct I/O on `path` needs, and a bounce buffer of one
/// chunk aligned to it.
fn chunk_for(path: &Path) -> (Alignment, AlignedBytes) {
    let align = Alignment::for_path(path);
    (
        align,
        AlignedBytes::zeroed(CHUNK_BYTES, align.bytes() as usize),
    )
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

/// A whole file read front to back, one chunk of at most [`CHUNK_BYTES`]
/// at a time, past the page cache where `O_DIRECT` applies (see the
/// module docs), through it where it does not: a file system without
/// `O_DIRECT`, or the kernel refusing the first direct read with `EINVAL`
/// (the reader then reopens the file and goes on buffered, having handed
/// out nothing). The chunks start at multiples of [`CHUNK_BYTES`], so
/// every direct read is aligned; a direct read that comes back off a
/// block boundary (the file's end, or a file system's short read) makes
/// the reader go on buffered from there. Only a read of nothing ends the
/// file, so a short read never cuts it.
///
/// For reading a large file once, as a checksum pass does: the file does
/// not stay in the page cache, evicting the memory a run is using.
#[derive(Debug)]
pub struct ChunkReader {
    file: File,
    path: PathBuf,
    align: Alignment,
    chunk: AlignedBytes,
    pos_bytes: u64,
    direct: bool,
}

impl ChunkReader {
    /// Opens `path`: with `O_DIRECT` where the file system takes it, else
    /// plainly. A file that cannot be opened either way is
    /// [`SwapError::Setup`].
    pub fn open(path: &Path) -> Result<Self> {
        let direct = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC | libc::O_DIRECT)
            .open(path);
        let (file, direct) = match direct {
            Ok(f) => (f, true),
            Err(_) => (Self::open_buffered(path)?, false),
        };
        let (align, chunk) = chunk_for(path);
        Ok(ChunkReader {
            file,
            path: path.to_path_buf(),
            align,
            chunk,
            pos_bytes: 0,
            direct,
        })
    }

    fn open_buffered(path: &Path) -> Result<File> {
        OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|source| SwapError::Setup {
                what: format!("opening {}", path.display()),
                source,
            })
    }

    /// Whether the chunks come past the page cache (so far: a refused
    /// first read, or a direct read off a block boundary, turns it off).
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Bytes handed out so far: the offset of the next chunk.
    pub fn pos_bytes(&self) -> u64 {
        self.pos_bytes
    }

    /// The next chunk, `None` at the end of the file. A failed read is
    /// [`SwapError::Io`], naming the path, offset and length.
    pub fn next_chunk(&mut self) -> Result<Option<&[u8]>> {
        let mut got = 0usize;
        while got < CHUNK_BYTES {
            let at = self.pos_bytes + got as u64;
            match self.file.read_at(&mut self.chunk.as_mut_slice()[got..], at) {
                Ok(0) => break,
                Ok(n) => {
                    got += n;
                    // A direct read that ends off a block boundary ended at
                    // the end of the file, or (some file systems) came back
                    // short mid-file. Either way the next offset is
                    // misaligned: go on buffered, which reads the rest,
                    // or nothing at the end.
                    if self.direct && !self.align.is_aligned(got as u64) {
                        self.file = Self::open_buffered(&self.path)?;
                        self.direct = false;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e)
                    if self.direct
                        && self.pos_bytes == 0
                        && got == 0
                        && e.raw_os_error() == Some(libc::EINVAL) =>
                {
                    self.file = Self::open_buffered(&self.path)?;
                    self.direct = false;
                }
                Err(source) => {
                    return Err(SwapError::Io {
                        op: IoOp::Read,
                        path: self.path.clone(),
                        offset_bytes: at,
                        len_bytes: (CHUNK_BYTES - got) as u64,
                        source,
                    })
                }
            }
        }
        self.pos_bytes += got as u64;
        if got == 0 {
            return Ok(None);
        }
        Ok(Some(&self.chunk.as_slice()[..got]))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failure is a panic

    use super::*;

    /// A test that cannot run its direct path here says so, or fails
    /// where CI requires direct I/O (`TIERZERO_REQUIRE_DIRECT_IO=1`, which
    /// `.ci/run` sets where the temporary directory takes `O_DIRECT`).
    fn skip(why: &str) {
        assert!(
            !std::env::var("TIERZERO_REQUIRE_DIRECT_IO").is_ok_and(|v| v == "1"),
            "TIERZERO_REQUIRE_DIRECT_IO=1, but {why}"
        );
        eprintln!("skipped: {why}");
    }

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
            skip(&format!("no O_DIRECT on {}", dir.path().display()));
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
            skip("the kernel refused O_DIRECT here");
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
            skip(&format!("no O_DIRECT on {}", dir.path().display()));
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
            skip(&format!("no O_DIRECT on {}", dir.path().display()));
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

    /// The file's bytes through a [`ChunkReader`], each chunk's start,
    /// and whether the first chunk and the whole file came direct.
    fn read_whole(path: &Path) -> (Vec<u8>, Vec<(u64, usize)>, bool, bool) {
        let mut r = ChunkReader::open(path).unwrap();
        let (mut all, mut chunks, mut first_direct) = (Vec::new(), Vec::new(), None);
        loop {
            let pos = r.pos_bytes();
            let Some(c) = r.next_chunk().unwrap() else {
                break;
            };
            chunks.push((pos, c.len()));
            all.extend_from_slice(c);
            first_direct.get_or_insert(r.is_direct());
        }
        assert!(r.next_chunk().unwrap().is_none(), "a chunk after the end");
        assert_eq!(r.pos_bytes(), all.len() as u64);
        let direct = r.is_direct();
        (all, chunks, first_direct.unwrap_or(direct), direct)
    }

    #[test]
    fn a_file_is_read_whole_in_chunks_whatever_its_length() {
        let dir = tempfile::tempdir().unwrap();
        for len in [0, 100, 4096, CHUNK_BYTES, 2 * CHUNK_BYTES + 3 * 4096 + 100] {
            let path = dir.path().join(format!("f{len}"));
            let want = pattern(len);
            std::fs::write(&path, &want).unwrap();
            let (got, chunks, first_direct, direct) = read_whole(&path);
            assert!(got == want, "{len} bytes read back differently");
            let starts: Vec<u64> = chunks.iter().map(|c| c.0).collect();
            let expect: Vec<u64> = (0..len.div_ceil(CHUNK_BYTES))
                .map(|i| (i * CHUNK_BYTES) as u64)
                .collect();
            assert_eq!(starts, expect, "{len} bytes");
            // A whole-block file is read direct to its end; an unaligned
            // tail is read buffered (the direct read that found it came
            // back off a block boundary), after whole direct chunks.
            let whole_blocks = len % 4096 == 0;
            let direct_part = if whole_blocks {
                direct
            } else {
                first_direct || len < CHUNK_BYTES
            };
            if !direct_part {
                skip(&format!("no O_DIRECT reads on {}", dir.path().display()));
            } else if !whole_blocks {
                assert!(!direct, "{len} bytes: the tail did not go buffered");
            }
        }
    }

    #[test]
    fn a_missing_file_is_a_setup_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing");
        match ChunkReader::open(&path) {
            Err(e @ SwapError::Setup { .. }) => {
                assert!(e.to_string().contains("missing"), "{e}");
            }
            other => panic!("{other:?}"),
        }
    }
}

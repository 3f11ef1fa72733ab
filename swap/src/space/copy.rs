//! Copies between a swap space's extents and other files (checkpoints):
//! `copy_file_range` where it reflinks (both files on one XFS or btrfs),
//! else O_DIRECT through a bounce buffer, else `copy_file_range`, else
//! `pread`/`pwrite` (see "Copies to and from ordinary files" in the
//! [`super`] docs).

use super::*;

/// How an extent copy moved its bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopyReport {
    /// Bytes moved by `copy_file_range` (in-kernel copy or reflink).
    pub kernel_bytes: u64,
    /// Bytes moved by the `pread`/`pwrite` fallback (file systems or kernels
    /// where `copy_file_range` between these files is refused).
    pub fallback_bytes: u64,
    /// Bytes moved by O_DIRECT reads and writes through a bounce buffer,
    /// past the page cache (both sides on O_DIRECT-capable files, every
    /// offset and length aligned): the first choice.
    pub direct_bytes: u64,
}

/// Which way [`SwapSpace::copy_extent_to_file`] /
/// [`SwapSpace::copy_extent_from_file`] move bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CopyWay {
    ToFile,
    FromFile,
}

/// Bytes per `pread`/`pwrite` of the copy fallback.
const COPY_FALLBACK_CHUNK_BYTES: usize = 1 << 20;

impl SwapSpace {
    /// Copies the first `len_bytes` of `ext` into `dst` at `dst_offset_bytes`
    /// without passing the data through user memory: `copy_file_range(2)`
    /// per striping piece, so the kernel reflinks on XFS/btrfs and copies
    /// in-kernel elsewhere. Every returned length is checked; a short copy
    /// is continued, end of file is [`SwapError::ShortIo`], an errno is
    /// [`SwapError::Io`] naming the file and offset. Where the kernel
    /// refuses `copy_file_range` between these files (`EXDEV`, `EINVAL`,
    /// `ENOSYS`, `EOPNOTSUPP`), the piece is copied with `pread`/`pwrite`
    /// through a 1 MiB heap buffer on a buffered descriptor instead
    /// (counted in [`CopyReport::fallback_bytes`]).
    ///
    /// The caller must make sure no write to `ext` is in flight (drain the
    /// engines first): the copy reads whatever is on disk now.
    pub fn copy_extent_to_file(
        &self,
        ext: &Extent,
        len_bytes: u64,
        dst: &File,
        dst_path: &Path,
        dst_offset_bytes: u64,
    ) -> Result<CopyReport> {
        self.check_poison(IoOp::Read)?;
        self.copy_extent(
            ext,
            len_bytes,
            dst,
            dst_path,
            dst_offset_bytes,
            CopyWay::ToFile,
        )
    }

    /// The reverse of [`SwapSpace::copy_extent_to_file`]: fills the first
    /// `len_bytes` of `ext` from `src` at `src_offset_bytes`. The extent's
    /// recorded checksum is cleared (the caller may record one it verified
    /// with [`Extent::set_recorded_crc32c`]); a failure poisons the space,
    /// since the extent's bytes are then unknown. No I/O on `ext` may be in
    /// flight.
    pub fn copy_extent_from_file(
        &self,
        ext: &Extent,
        len_bytes: u64,
        src: &File,
        src_path: &Path,
        src_offset_bytes: u64,
    ) -> Result<CopyReport> {
        self.check_poison(IoOp::Write)?;
        ext.set_checksum(None);
        let r = self.copy_extent(
            ext,
            len_bytes,
            src,
            src_path,
            src_offset_bytes,
            CopyWay::FromFile,
        );
        if let Err(e) = &r {
            self.poison(
                format!(
                    "restoring extent {} from {}: {e}",
                    ext.id().0,
                    src_path.display()
                ),
                e,
            );
        }
        r
    }

    fn copy_extent(
        &self,
        ext: &Extent,
        len_bytes: u64,
        other: &File,
        other_path: &Path,
        other_offset_bytes: u64,
        way: CopyWay,
    ) -> Result<CopyReport> {
        if ext.space().id != self.id {
            return Err(SwapError::Config(format!(
                "extent {} belongs to swap space {}, not {}",
                ext.id().0,
                ext.space().id,
                self.id
            )));
        }
        let op = match way {
            CopyWay::ToFile => IoOp::Read,
            CopyWay::FromFile => IoOp::Write,
        };
        if len_bytes > ext.len_bytes() {
            return Err(SwapError::OutOfBounds {
                op,
                offset_bytes: 0,
                len_bytes,
                buffer_bytes: len_bytes,
                extent_bytes: ext.len_bytes(),
            });
        }
        // Copies out (checkpoint saves) go the direct way. Copies in keep
        // `copy_file_range`: tierzero's restore does not use them (its
        // checkpoint reader loads state ranges into memory, checking crcs
        // as it reads), and a caller that just read the file to check it
        // finds it in the page cache.
        if way == CopyWay::ToFile {
            if let Some(report) =
                self.direct_copy_to_file(ext, len_bytes, other_path, other_offset_bytes)?
            {
                return Ok(report);
            }
        }
        let mut report = CopyReport::default();
        // The swap side through a buffered descriptor: the kernel refuses
        // `copy_file_range` on an O_DIRECT one (EINVAL). The page cache
        // stays coherent with our O_DIRECT descriptors: a direct read writes
        // back dirty cached pages of its range first, a direct write
        // invalidates them.
        let mut reopened: HashMap<u32, File> = HashMap::new();
        for piece in ext.pieces(0, len_bytes, u64::MAX) {
            let sf = self.file(piece.file);
            let swap_fd = match reopened.entry(piece.file.0) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    let f = OpenOptions::new()
                        .read(true)
                        .write(way == CopyWay::FromFile)
                        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
                        .open(&sf.path)
                        .map_err(|source| SwapError::Setup {
                            what: format!("reopening {} for a copy", sf.path.display()),
                            source,
                        })?;
                    e.insert(f)
                }
            };
            let other_off = other_offset_bytes
                .checked_add(piece.buf_offset_bytes)
                .ok_or_else(|| {
                    SwapError::Config(format!("copy offset overflows in {}", other_path.display()))
                })?;
            let (src, dst) = match way {
                CopyWay::ToFile => (
                    End {
                        file: &*swap_fd,
                        path: &sf.path,
                        offset_bytes: piece.file_offset_bytes,
                    },
                    End {
                        file: other,
                        path: other_path,
                        offset_bytes: other_off,
                    },
                ),
                CopyWay::FromFile => (
                    End {
                        file: other,
                        path: other_path,
                        offset_bytes: other_off,
                    },
                    End {
                        file: &*swap_fd,
                        path: &sf.path,
                        offset_bytes: piece.file_offset_bytes,
                    },
                ),
            };
            let done = kernel_copy(&src, &dst, piece.len_bytes, op)?;
            report.kernel_bytes += done;
            if done < piece.len_bytes {
                let rest = piece.len_bytes - done;
                fallback_copy(&src.advanced(done), &dst.advanced(done), rest, op)?;
                report.fallback_bytes += rest;
            }
        }
        Ok(report)
    }
}

impl SwapSpace {
    /// [`SwapSpace::copy_extent_to_file`] past the page cache: the swap side
    /// through its own O_DIRECT descriptors, the other file through an
    /// O_DIRECT descriptor of its own, [`DIRECT_COPY_CHUNK_BYTES`] at a time
    /// through an aligned bounce buffer (the striped pieces of a chunk
    /// gathered from the swap files, one write to the other). Copying through
    /// the page cache (`copy_file_range`, 1 MiB stripe by stripe) ran at
    /// about half the disk's bandwidth and a core of kernel memcpy here.
    ///
    /// `None` when it does not apply: a swap file without O_DIRECT, an
    /// other file that cannot be opened with it (tmpfs), an offset or
    /// length off the alignment, or the kernel refusing the first direct
    /// call (`EINVAL`); the caller then copies as before. Nothing is
    /// written before the first call succeeds, so the fallback starts
    /// from a clean slate; later errors are errors.
    fn direct_copy_to_file(
        &self,
        ext: &Extent,
        len_bytes: u64,
        other_path: &Path,
        other_offset_bytes: u64,
    ) -> Result<Option<CopyReport>> {
        use std::os::unix::fs::FileExt;
        let align = self.alignment.bytes();
        let pieces = ext.pieces(0, len_bytes, u64::MAX);
        let aligned = |x: u64| x.is_multiple_of(align);
        if len_bytes == 0
            || !aligned(len_bytes)
            || !aligned(other_offset_bytes)
            || pieces.iter().any(|p| {
                !self.file(p.file).direct || !aligned(p.file_offset_bytes) || !aligned(p.len_bytes)
            })
        {
            return Ok(None);
        }
        let other = match OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW | libc::O_DIRECT)
            .open(other_path)
        {
            Ok(f) => f,
            Err(_) => return Ok(None),
        };
        // Where `copy_file_range` can reflink (XFS, btrfs) it moves no data
        // at all: leave the copy to it.
        if pieces
            .iter()
            .any(|p| reflinks_between(&self.file(p.file).file, &other))
        {
            return Ok(None);
        }
        let chunk_bytes = (DIRECT_COPY_CHUNK_BYTES as u64).min(len_bytes) as usize;
        // Every piece within one chunk (stripes divide the chunk).
        let chunk_of = |x: u64| x / chunk_bytes as u64;
        if pieces
            .iter()
            .any(|p| chunk_of(p.buf_offset_bytes) != chunk_of(p.buf_offset_bytes + p.len_bytes - 1))
        {
            return Ok(None);
        }
        // An aligned window of a heap allocation: no unsafe, and the
        // allocation outlives every call that uses it (the calls are
        // synchronous).
        let mut bounce = crate::direct::AlignedBytes::zeroed(chunk_bytes, align as usize);
        let buf = bounce.as_mut_slice();
        let mut first = true;
        let mut chunk_start = 0u64;
        while chunk_start < len_bytes {
            let n = (len_bytes - chunk_start).min(chunk_bytes as u64);
            let chunk = &mut buf[..n as usize];
            let other_off = other_offset_bytes + chunk_start;
            let within: Vec<&Piece> = pieces
                .iter()
                .filter(|p| {
                    p.buf_offset_bytes >= chunk_start && p.buf_offset_bytes < chunk_start + n
                })
                .collect();
            // The kernel's verdict on direct I/O comes with the first call.
            let refused = |r: &std::io::Result<()>| matches!(r, Err(e) if e.raw_os_error() == Some(libc::EINVAL));
            for p in &within {
                let sf = self.file(p.file);
                let at = (p.buf_offset_bytes - chunk_start) as usize;
                let r = sf.file.read_exact_at(
                    &mut chunk[at..at + p.len_bytes as usize],
                    p.file_offset_bytes,
                );
                if first && refused(&r) {
                    return Ok(None);
                }
                r.map_err(|e| {
                    positional_error(IoOp::Read, &sf.path, p.file_offset_bytes, p.len_bytes, e)
                })?;
            }
            let r = other.write_all_at(chunk, other_off);
            if first && refused(&r) {
                return Ok(None);
            }
            first = false;
            r.map_err(|e| positional_error(IoOp::Write, other_path, other_off, n, e))?;
            chunk_start += n;
        }
        Ok(Some(CopyReport {
            direct_bytes: len_bytes,
            ..CopyReport::default()
        }))
    }
}

/// Whether two open files are on one XFS or btrfs file system, where
/// `copy_file_range` shares extents instead of copying.
fn reflinks_between(a: &File, b: &File) -> bool {
    const XFS_MAGIC: i64 = 0x5846_5342;
    const BTRFS_MAGIC: i64 = 0x9123_683e;
    let fs = |f: &File| -> Option<(i64, [i32; 2])> {
        let mut st = std::mem::MaybeUninit::<libc::statfs>::zeroed();
        // SAFETY: `f` is an open descriptor for the call (borrowed), and
        // `st` is a valid, exclusively borrowed `statfs` the kernel fills;
        // it is read only after a 0 return.
        let rc = unsafe { libc::fstatfs(f.as_raw_fd(), st.as_mut_ptr()) };
        if rc != 0 {
            return None;
        }
        // SAFETY: fstatfs returned 0, so it wrote the whole struct (and it
        // was zeroed before: every field is initialised either way).
        let st = unsafe { st.assume_init() };
        // SAFETY: `fsid_t` is two i32s in every libc layout; read as such.
        let id: [i32; 2] = unsafe { std::mem::transmute(st.f_fsid) };
        // `f_type`'s width differs between libc targets.
        #[allow(clippy::unnecessary_cast, reason = "i64 on some targets only")]
        let kind = st.f_type as i64;
        Some((kind, id))
    };
    match (fs(a), fs(b)) {
        (Some((ta, ia)), Some((tb, ib))) => {
            ta == tb && ia == ib && (ta == XFS_MAGIC || ta == BTRFS_MAGIC)
        }
        _ => false,
    }
}

/// The bounce buffer of [`SwapSpace::direct_copy_to_file`]: large enough that one
/// call per chunk on the other file runs at the disk's rate.
const DIRECT_COPY_CHUNK_BYTES: usize = 8 << 20;

/// One side of a copy.
#[derive(Debug, Clone, Copy)]
struct End<'a> {
    file: &'a File,
    path: &'a Path,
    offset_bytes: u64,
}

impl End<'_> {
    fn advanced(&self, by: u64) -> Self {
        End {
            offset_bytes: self.offset_bytes + by,
            ..*self
        }
    }
}

/// The error of a positional read or write of `len_bytes` at
/// `offset_bytes` of `path`: a read that met the end of the file is a
/// short read, anything else an I/O error.
fn positional_error(
    op: IoOp,
    path: &Path,
    offset_bytes: u64,
    len_bytes: u64,
    source: std::io::Error,
) -> SwapError {
    if source.kind() == std::io::ErrorKind::UnexpectedEof {
        SwapError::ShortIo {
            op,
            path: path.to_path_buf(),
            offset_bytes,
            expected_bytes: len_bytes,
            got_bytes: 0,
        }
    } else {
        SwapError::Io {
            op,
            path: path.to_path_buf(),
            offset_bytes,
            len_bytes,
            source,
        }
    }
}

fn copy_io_error(
    op: IoOp,
    src: &End<'_>,
    dst: &End<'_>,
    done: u64,
    len_bytes: u64,
    source: std::io::Error,
) -> SwapError {
    let (path, offset) = match op {
        IoOp::Read => (src.path, src.offset_bytes),
        IoOp::Write => (dst.path, dst.offset_bytes),
    };
    SwapError::Io {
        op,
        path: path.to_path_buf(),
        offset_bytes: offset + done,
        len_bytes: len_bytes - done,
        source,
    }
}

/// `copy_file_range` until `len_bytes` are copied. Returns the bytes
/// copied before the kernel refused the call (0..len), leaving the rest to
/// the fallback; other errors are returned.
fn kernel_copy(src: &End<'_>, dst: &End<'_>, len_bytes: u64, op: IoOp) -> Result<u64> {
    let mut done = 0u64;
    while done < len_bytes {
        let mut off_in = (src.offset_bytes + done) as libc::loff_t;
        let mut off_out = (dst.offset_bytes + done) as libc::loff_t;
        let want = usize::try_from(len_bytes - done)
            .unwrap_or(usize::MAX)
            .min(1 << 30);
        // SAFETY: both fds are open for the duration of the call (borrowed
        // `File`s), and `off_in` / `off_out` are valid, exclusively borrowed
        // loff_t locals the kernel updates; no user memory is read or written.
        let rc = unsafe {
            libc::copy_file_range(
                src.file.as_raw_fd(),
                &mut off_in,
                dst.file.as_raw_fd(),
                &mut off_out,
                want,
                0,
            )
        };
        if rc < 0 {
            let err = std::io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EINTR) | Some(libc::EAGAIN) => continue,
                Some(libc::EXDEV)
                | Some(libc::EINVAL)
                | Some(libc::ENOSYS)
                | Some(libc::EOPNOTSUPP) => return Ok(done),
                _ => return Err(copy_io_error(op, src, dst, done, len_bytes, err)),
            }
        }
        if rc == 0 {
            return Err(SwapError::ShortIo {
                op,
                path: src.path.to_path_buf(),
                offset_bytes: src.offset_bytes + done,
                expected_bytes: len_bytes - done,
                got_bytes: 0,
            });
        }
        done += rc as u64;
    }
    Ok(done)
}

/// The `pread`/`pwrite` fallback of an extent copy, through a 1 MiB heap
/// buffer.
fn fallback_copy(src: &End<'_>, dst: &End<'_>, len_bytes: u64, op: IoOp) -> Result<()> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; COPY_FALLBACK_CHUNK_BYTES];
    let mut done = 0u64;
    while done < len_bytes {
        let n = usize::try_from(len_bytes - done)
            .unwrap_or(usize::MAX)
            .min(buf.len());
        let chunk = &mut buf[..n];
        src.file
            .read_exact_at(chunk, src.offset_bytes + done)
            .map_err(|source| {
                if source.kind() == std::io::ErrorKind::UnexpectedEof {
                    SwapError::ShortIo {
                        op,
                        path: src.path.to_path_buf(),
                        offset_bytes: src.offset_bytes + done,
                        expected_bytes: len_bytes - done,
                        got_bytes: 0,
                    }
                } else {
                    copy_io_error(IoOp::Read, src, dst, done, len_bytes, source)
                }
            })?;
        dst.file
            .write_all_at(chunk, dst.offset_bytes + done)
            .map_err(|source| copy_io_error(IoOp::Write, src, dst, done, len_bytes, source))?;
        done += n as u64;
    }
    Ok(())
}

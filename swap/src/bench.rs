//! Bandwidth measurement, shared by `cargo bench` and `tierzero bench-io`.
//!
//! A run keeps exactly `queue_depth` requests of `block_bytes` in flight on
//! one ring (with as many more queued in the engine, so a completion is
//! replaced at once), walking the extent sequentially and wrapping around, which is
//! what `fio --rw=read|write --bs=B --iodepth=Q --direct=1` does with one
//! job. Each run gets its own arena (`queue_depth` buffers of `block_bytes`)
//! and engine, so settings do not leak between runs. Reads only make sense
//! after the range was written: a preallocated but never-written extent
//! reads as zeros without touching the device, so [`BenchTarget::fill`]
//! writes it first.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::arena::{ArenaConfig, LockPolicy, PinnedArena};
use crate::engine::{BackendKind, Engine, EngineConfig, Request};
use crate::error::{IoOp, Result, SwapError};
use crate::space::{DirectIo, Extent, SpaceConfig, SwapSpace};

/// One measurement.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchResult {
    /// Read or write.
    pub op: IoOp,
    /// Bytes per request.
    pub block_bytes: u64,
    /// Requests in flight.
    pub queue_depth: usize,
    /// Bytes moved.
    pub bytes: u64,
    /// Wall time.
    pub seconds: f64,
    /// Median device latency of one block (µs), from handing it to the
    /// kernel to its completion (engine queueing excluded, as fio's clat).
    pub latency_p50_us: f64,
    /// p99 device latency of one block (µs).
    pub latency_p99_us: f64,
}

impl BenchResult {
    /// Bandwidth in GB/s (10^9 bytes per second, as fio reports).
    pub fn gbps(&self) -> f64 {
        if self.seconds > 0.0 {
            self.bytes as f64 / self.seconds / 1e9
        } else {
            0.0
        }
    }
}

/// The block size of [`BenchTarget::fill`]'s writes.
pub const FILL_BLOCK_BYTES: u64 = 1 << 20;
/// The queue depth of [`BenchTarget::fill`]'s writes.
pub const FILL_QUEUE_DEPTH: usize = 32;

/// A file region to measure on.
#[derive(Debug)]
pub struct BenchTarget {
    space: Arc<SwapSpace>,
    extent: Extent,
    /// Whether each run's buffers are page-locked ([`LockPolicy::Require`]
    /// unless [`BenchTarget::set_lock`] says otherwise).
    lock: LockPolicy,
}

impl BenchTarget {
    /// A new swap file of `size_bytes` under `dir` (removed on drop).
    pub fn create(dir: &Path, size_bytes: u64, direct_io: DirectIo) -> Result<Self> {
        let mut cfg = SpaceConfig::new(dir, size_bytes);
        cfg.direct_io = direct_io;
        let space = SwapSpace::create(cfg)?;
        let extent = space.allocate(space.free_bytes())?;
        Ok(BenchTarget {
            space,
            extent,
            lock: LockPolicy::Require,
        })
    }

    /// An existing file (its contents are overwritten by write runs);
    /// opened read-only unless `writable` (a read-only one can be measured
    /// by reads alone).
    pub fn existing(file: &Path, direct_io: DirectIo, writable: bool) -> Result<Self> {
        let space = SwapSpace::open_file(file, direct_io, false, writable)?;
        let free = space.free_bytes();
        if free == 0 {
            let len = std::fs::metadata(file).map_or(0, |m| m.len());
            return Err(SwapError::Config(if len == 0 {
                format!("{} is empty", file.display())
            } else {
                format!(
                    "{} holds {len} bytes, less than one aligned block of {} bytes; give a \
                     larger file",
                    file.display(),
                    space.alignment().bytes()
                )
            }));
        }
        let extent = space.allocate(free)?;
        Ok(BenchTarget {
            space,
            extent,
            lock: LockPolicy::Require,
        })
    }

    /// What this target made, for a process that ends without its drop
    /// (a signal): its swap files, then its swap directory's lock file
    /// and the directory (`tierzero/`, which goes only if empty, made by
    /// this run or not). Nothing for an existing file.
    pub fn made_paths(&self) -> Vec<std::path::PathBuf> {
        let files: Vec<_> = self
            .space
            .files()
            .iter()
            .filter(|f| f.is_owned())
            .map(|f| f.path().to_path_buf())
            .collect();
        let dirs: Vec<_> = files
            .iter()
            .filter_map(|f| f.parent().map(std::path::Path::to_path_buf))
            .collect();
        let mut made = files;
        for d in dirs {
            made.push(d.join(crate::lock::LOCK_FILE));
            made.push(d);
        }
        made
    }

    /// Bytes in the target.
    pub fn len_bytes(&self) -> u64 {
        self.extent.len_bytes()
    }

    /// Whether the file is opened with O_DIRECT.
    pub fn is_direct(&self) -> bool {
        self.space.files().iter().all(|f| f.is_direct())
    }

    /// Whether the runs' buffers are page-locked: [`LockPolicy::Off`]
    /// measures with pageable buffers (what a run whose `RLIMIT_MEMLOCK`
    /// cannot hold them gets: `train`'s `memlock: auto` does the same).
    pub fn set_lock(&mut self, lock: LockPolicy) {
        self.lock = lock;
    }

    /// Writes the whole target once so that later reads touch the device
    /// ([`FILL_QUEUE_DEPTH`] requests of [`FILL_BLOCK_BYTES`]).
    pub fn fill(&self, backend: BackendKind) -> Result<BenchResult> {
        self.run(
            IoOp::Write,
            FILL_BLOCK_BYTES,
            FILL_QUEUE_DEPTH,
            self.len_bytes(),
            None,
            backend,
        )
    }

    /// Moves `total_bytes` with `queue_depth` requests of `block_bytes`
    /// (mapping [`run_arena_bytes`] of pinned memory for the run),
    /// or stops issuing new requests after `max_duration`, whichever is first.
    pub fn run(
        &self,
        op: IoOp,
        block_bytes: u64,
        queue_depth: usize,
        total_bytes: u64,
        max_duration: Option<Duration>,
        backend: BackendKind,
    ) -> Result<BenchResult> {
        let align = self.space.alignment();
        if !align.is_aligned(block_bytes) || block_bytes == 0 {
            return Err(SwapError::Misaligned {
                what: "block size",
                value: block_bytes,
                alignment_bytes: align.bytes(),
            });
        }
        let qd = queue_depth.max(1);
        let outstanding_max = outstanding_buffers(qd);
        let arena_bytes = run_arena_bytes(block_bytes, qd).ok_or_else(|| {
            SwapError::Config(format!(
                "{outstanding_max} buffers of {block_bytes} bytes overflow 64 bits"
            ))
        })?;
        let mut acfg = ArenaConfig::new(arena_bytes, block_bytes);
        acfg.alignment = align;
        acfg.lock = self.lock;
        let arena = PinnedArena::new(acfg)?;
        let engine = Engine::new(
            self.space.clone(),
            arena.clone(),
            EngineConfig {
                backend,
                workers: 1,
                queue_depth: qd as u32,
                block_bytes,
                ..EngineConfig::default()
            },
        )?;
        let mut buffers = arena.try_acquire_n(outstanding_max)?;
        if op == IoOp::Write {
            for (i, b) in buffers.iter_mut().enumerate() {
                for (j, chunk) in b.as_mut_slice().chunks_mut(8).enumerate() {
                    let v = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ j as u64;
                    chunk.copy_from_slice(&v.to_le_bytes()[..chunk.len()]);
                }
            }
        }
        let len = self.extent.len_bytes();
        let (tx, rx) = crossbeam_channel::unbounded();
        let mut next_offset = 0u64;
        let mut submitted = 0u64;
        let mut outstanding = 0usize;
        let start = Instant::now();
        let submit = |buf, submitted: &mut u64, next_offset: &mut u64| -> Result<()> {
            let this = block_bytes.min(len - *next_offset);
            engine.submit_to(
                Request::range(op, &self.extent, *next_offset, this, buf),
                &tx,
            )?;
            *submitted += this;
            *next_offset = (*next_offset + this) % len;
            Ok(())
        };
        while let Some(b) = buffers.pop() {
            if submitted >= total_bytes {
                break;
            }
            submit(b, &mut submitted, &mut next_offset)?;
            outstanding += 1;
        }
        while outstanding > 0 {
            let c = rx
                .recv_timeout(Duration::from_secs(600))
                .map_err(|_| SwapError::Shutdown)?;
            outstanding -= 1;
            // Any failed request fails the measurement (the engine drains
            // the rest when it drops).
            let buf = c.into_result()?;
            let in_time = max_duration.is_none_or(|d| start.elapsed() < d);
            if submitted < total_bytes && in_time {
                submit(buf, &mut submitted, &mut next_offset)?;
                outstanding += 1;
            }
        }
        let seconds = start.elapsed().as_secs_f64();
        let s = engine.stats();
        Ok(BenchResult {
            op,
            block_bytes,
            queue_depth: qd,
            bytes: submitted,
            seconds,
            latency_p50_us: s.device_p50_us,
            latency_p99_us: s.device_p99_us,
        })
    }
}
/// Buffers a run at `queue_depth` keeps: twice the depth. The ring keeps
/// exactly `queue_depth` in flight and refills from its own queue the
/// moment one completes, as fio does within its one thread, instead of
/// waiting for the submitting thread to wake up and resubmit.
pub fn outstanding_buffers(queue_depth: usize) -> usize {
    queue_depth.max(1).saturating_mul(2)
}

/// The pinned bytes a run of `block_bytes` at `queue_depth` maps
/// ([`outstanding_buffers`] buffers of `block_bytes`); `None` past 64 bits.
pub fn run_arena_bytes(block_bytes: u64, queue_depth: usize) -> Option<u64> {
    block_bytes.checked_mul(u64::try_from(outstanding_buffers(queue_depth)).ok()?)
}

/// Bytes of the file at `path` that hold data, by `SEEK_DATA` /
/// `SEEK_HOLE`: holes, and on ext4 and XFS the unwritten extents that
/// `fallocate` leaves (they read as zeros without touching the device),
/// are not data. A file system without those seeks (they then report
/// the whole file as data) says so: a read benchmark of the rest would
/// not measure the disk.
pub fn data_bytes(path: &Path) -> std::io::Result<u64> {
    use std::os::unix::io::AsRawFd;
    let file = std::fs::File::open(path)?;
    let len = file.metadata()?.len();
    let fd = file.as_raw_fd();
    let seek = |offset: u64, whence: libc::c_int| -> std::io::Result<Option<u64>> {
        // SAFETY: lseek on an fd this function owns (`file`, open for its
        // whole body); no memory is passed.
        let r = unsafe { libc::lseek(fd, offset as libc::off_t, whence) };
        if r >= 0 {
            return Ok(Some(r as u64));
        }
        let e = std::io::Error::last_os_error();
        // ENXIO: no data (or hole) at or past `offset`.
        if e.raw_os_error() == Some(libc::ENXIO) {
            Ok(None)
        } else {
            Err(e)
        }
    };
    let (mut pos, mut data) = (0u64, 0u64);
    while pos < len {
        let Some(start) = seek(pos, libc::SEEK_DATA)? else {
            break;
        };
        let end = seek(start, libc::SEEK_HOLE)?.unwrap_or(len).min(len);
        data += end.saturating_sub(start);
        pos = end.max(start + 1);
    }
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hole and, where the file system keeps unwritten extents apart
    /// (ext4, XFS, tmpfs), a `fallocate`d range are not data; written
    /// bytes are.
    #[test]
    fn holes_and_unwritten_extents_are_not_data() {
        use std::os::unix::fs::FileExt;
        let d = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let p = d.path().join("f");
        let f = std::fs::File::create(&p).unwrap_or_else(|e| panic!("create: {e}"));
        f.set_len(8 << 20)
            .unwrap_or_else(|e| panic!("set_len: {e}"));
        assert_eq!(data_bytes(&p).unwrap_or_else(|e| panic!("{e}")), 0);
        f.write_all_at(&vec![7u8; 1 << 20], 2 << 20)
            .unwrap_or_else(|e| panic!("write: {e}"));
        f.sync_all().unwrap_or_else(|e| panic!("sync: {e}"));
        let data = data_bytes(&p).unwrap_or_else(|e| panic!("{e}"));
        assert!((1 << 20..8 << 20).contains(&data), "{data}");
        let g = d.path().join("g");
        let status = std::process::Command::new("fallocate")
            .args(["-l", "4M"])
            .arg(&g)
            .status();
        if status.is_ok_and(|s| s.success()) {
            let data = data_bytes(&g).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(data, 0, "a fallocated file's unwritten extents");
        }
    }
}

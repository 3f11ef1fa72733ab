//! The portable backend: a pool of threads doing `pread`/`pwrite`.
//!
//! Used where io_uring is disabled (the `kernel.io_uring_disabled` sysctl,
//! seccomp filters in containers) or when chosen by config. Files keep their
//! O_DIRECT flag, so alignment rules and page-cache behaviour are the same
//! as with io_uring. Concurrency comes from threads instead of a queue:
//! `workers × queue_depth` threads (at most 64) share one request channel,
//! and each runs its request's pieces one after another with the same
//! completion check as the rings.

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::Sender;

use crate::engine::{EngineConfig, Job, PieceOutcome, Shared};
use crate::error::{IoOp, Result, SwapError};

type Pool = (Vec<Sender<Job>>, Vec<JoinHandle<()>>);

pub(crate) fn spawn_pool(shared: &Arc<Shared>, config: &EngineConfig) -> Result<Pool> {
    let threads = (config.workers * config.queue_depth as usize).clamp(1, 64);
    let (tx, rx) = crossbeam_channel::unbounded::<Job>();
    let mut handles = Vec::with_capacity(threads);
    for t in 0..threads {
        let rx = rx.clone();
        let shared = shared.clone();
        let stat_slot = t % config.workers;
        let cpus = config.thread_cpus.clone();
        let h = std::thread::Builder::new()
            .name(format!("tz-pio-{t}"))
            .spawn(move || {
                crate::affinity::place_current_thread(cpus.as_deref(), "tz-pio");
                while let Ok(job) = rx.recv() {
                    let start = Instant::now();
                    shared.stats.busy_start();
                    run_job(&shared, job);
                    shared.stats.busy_stop(stat_slot, start.elapsed());
                }
            })
            .map_err(|source| SwapError::Setup {
                what: "spawning portable I/O threads".into(),
                source,
            })?;
        handles.push(h);
    }
    // One sender per thread (clones of one channel), so the engine joins
    // every thread when it drops.
    Ok((vec![tx; threads], handles))
}

fn run_job(shared: &Shared, mut job: Job) {
    let req = &mut job.req;
    let pieces = req
        .extent
        .pieces(req.offset_bytes, req.len_bytes, shared.block_bytes);
    let base = req.buffer.as_mut_ptr();
    let mut error = None;
    'pieces: for piece in &pieces {
        let fd = shared.space.file(piece.file).file().as_raw_fd();
        let mut done = 0u64;
        loop {
            let len = (piece.len_bytes - done) as usize;
            let off = (piece.file_offset_bytes + done) as libc::off_t;
            // SAFETY: base + buf_offset + done .. + len lies inside the job's
            // buffer (validated at submission: len_bytes <= capacity), which
            // this thread owns exclusively until `finish`.
            let ptr = unsafe { base.add((piece.buf_offset_bytes + done) as usize) };
            let issued = Instant::now();
            let raw = match req.op {
                // SAFETY: ptr is valid for `len` writable bytes (see above).
                IoOp::Read => unsafe { libc::pread(fd, ptr.cast(), len, off) },
                // SAFETY: ptr is valid for `len` readable bytes (see above).
                IoOp::Write => unsafe { libc::pwrite(fd, ptr.cast(), len, off) },
            };
            shared.stats.record_piece(issued.elapsed());
            let raw = if raw < 0 {
                let errno = std::io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EIO);
                if errno == libc::EINTR {
                    continue;
                }
                -(errno as i64)
            } else {
                raw as i64
            };
            match shared.check_piece(req.op, piece, done, raw) {
                PieceOutcome::Done => break,
                PieceOutcome::Partial { done_bytes } => done = done_bytes,
                PieceOutcome::Failed(e) => {
                    error = Some(e);
                    break 'pieces;
                }
            }
        }
    }
    shared.finish(job, error);
}

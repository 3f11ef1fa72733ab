//! io_uring ring threads: the only code that pushes SQEs.
//!
//! Each ring thread owns one `IoUring`, created inside the thread (so
//! `IORING_SETUP_SINGLE_ISSUER` binds to it), with the arena's buffers
//! registered once (`IORING_REGISTER_BUFFERS`, one iovec per buffer: buffer
//! index = registered index) and the space's files registered once
//! (`IORING_REGISTER_FILES`: file index = fixed-file slot). Transfers then
//! use `ReadFixed`/`WriteFixed` on fixed files, which skips per-operation
//! page pinning and fd lookup in the kernel. If registration fails (for
//! example RLIMIT_MEMLOCK counts registered pages for unprivileged users),
//! the ring falls back to plain `Read`/`Write` and says so.
//!
//! ## The loop
//! 1. Take jobs from the channel (blocking only when nothing is in flight),
//!    and split them into pieces queued in order.
//! 2. Push pieces while fewer than `queue_depth` are in flight.
//! 3. `submit_and_wait(1)`: one syscall submits the batch and waits.
//! 4. Reap every CQE: check its result against the piece's length; queue
//!    the rest of a short transfer at the front; record a failure on the job
//!    (its pieces not yet issued are then skipped); finish a job when its
//!    last piece is done.
//!
//! ## Buffer safety
//! A job's `Buffer` lives in the job table from intake until `finish`, and
//! `finish` runs only when no piece of the job is in flight. The SQE holds
//! a raw pointer into the arena; the arena outlives the ring (the job holds
//! an `Arc` of it, and the ring is dropped after the loop has drained every
//! in-flight piece, also at shutdown).

use std::collections::VecDeque;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender, TryRecvError};

/// Whether a locked arena's io_uring registration refused for
/// RLIMIT_MEMLOCK was said (once a process: every ring meets the same
/// limit).
static REGISTER_ENOMEM_SAID: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);
use io_uring::{opcode, types, IoUring};

use crate::arena::PinnedArena;
use crate::engine::{ActiveBackend, EngineConfig, Job, PieceOutcome, Shared};
use crate::error::{IoOp, Result, SwapError};
use crate::space::Piece;

/// Most buffers io_uring lets us register.
const MAX_REGISTERED_BUFFERS: usize = 1 << 14;

/// io_uring's limit for one registered buffer (`io_buffer_validate`:
/// `iov_len > SZ_1G` is refused).
const MAX_REGISTERED_BUFFER_BYTES: usize = 1 << 30;

/// Whether the arena's buffers can be registered with a ring: at most
/// [`MAX_REGISTERED_BUFFERS`] of them, each within
/// [`MAX_REGISTERED_BUFFER_BYTES`]. Otherwise the ring reads and writes
/// them unregistered (the kernel pins the pages per operation), which works
/// for any size: a piece never exceeds the block size.
fn registrable(iovecs: &[libc::iovec]) -> bool {
    let ok = iovecs.len() <= MAX_REGISTERED_BUFFERS
        && iovecs
            .iter()
            .all(|v| v.iov_len <= MAX_REGISTERED_BUFFER_BYTES);
    if !ok {
        tracing::debug!(
            buffers = iovecs.len(),
            largest_bytes = iovecs.iter().map(|v| v.iov_len).max().unwrap_or(0),
            "buffers not registered with io_uring (over its count or 1 GiB size limit); unregistered reads and writes"
        );
    }
    ok
}

type Rings = (Vec<(Sender<Job>, JoinHandle<()>)>, ActiveBackend);

/// After an `io_uring_enter` that failed hard (not EINTR/EAGAIN/EBUSY):
/// the pieces in flight may still be used by the kernel, so the thread
/// keeps waiting for their completions, but backs off (1 ms doubling to
/// 100 ms) and logs the first failure and every 1000th rather than
/// spinning a core and flooding the log.
#[derive(Debug, Default)]
pub(crate) struct EnterBackoff {
    failures: u64,
}

impl EnterBackoff {
    pub(crate) fn failed(&mut self, e: &std::io::Error, what: &str) {
        if self.failures.is_multiple_of(1000) {
            tracing::error!(
                error = %e,
                failures = self.failures + 1,
                "io_uring_enter failed in {what}; waiting for the I/O in flight"
            );
        }
        let ms = 1u64 << self.failures.min(7);
        self.failures += 1;
        std::thread::sleep(std::time::Duration::from_millis(ms.min(100)));
    }

    pub(crate) fn ok(&mut self) {
        self.failures = 0;
    }
}

/// Aborts the process when dropped during a panic on a ring thread. The
/// ring's buffers (and a file I/O worker's caller memory) may be in SQEs
/// the kernel has not completed: unwinding would return them to their
/// pool (or drop their owners) while the kernel may still write into
/// them, and the ring's fd closing does not wait for the kernel. Declared
/// after the state it guards, so it drops first.
pub(crate) struct AbortOnUnwind(pub &'static str);

impl Drop for AbortOnUnwind {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "tierzero-swap: {} thread panicked with I/O possibly in flight; aborting rather \
                 than freeing buffers the kernel may still write",
                self.0
            );
            std::process::abort();
        }
    }
}

pub(crate) fn spawn_rings(
    shared: &Arc<Shared>,
    arena: &Arc<PinnedArena>,
    config: &EngineConfig,
) -> Result<Rings> {
    let mut out = Vec::new();
    let mut active = ActiveBackend::Uring {
        fixed_buffers: true,
        fixed_files: true,
    };
    for idx in 0..config.workers {
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let (ready_tx, ready_rx) = crossbeam_channel::bounded::<Result<(bool, bool)>>(1);
        let shared = shared.clone();
        let arena = arena.clone();
        let qd = config.queue_depth;
        let sqpoll = config.sqpoll;
        let cpus = config.thread_cpus.clone();
        let thread = std::thread::Builder::new()
            .name(format!("tz-ring-{idx}"))
            .spawn(move || {
                crate::affinity::place_current_thread(cpus.as_deref(), "tz-ring");
                match setup(&shared, &arena, qd, sqpoll) {
                    Ok((ring, fixed_buffers, fixed_files)) => {
                        let _ = ready_tx.send(Ok((fixed_buffers, fixed_files)));
                        let mut r = Ring {
                            ring,
                            shared,
                            idx,
                            qd: qd as usize,
                            fixed_buffers,
                            fixed_files,
                            jobs: Vec::new(),
                            free_jobs: Vec::new(),
                            queue: VecDeque::new(),
                            slots: (0..qd).map(|_| None).collect(),
                            free_slots: (0..qd as usize).rev().collect(),
                            in_flight: 0,
                            busy_since: None,
                        };
                        let _abort = AbortOnUnwind("io_uring ring");
                        r.run(rx);
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            })
            .map_err(|source| SwapError::Setup {
                what: "spawning an io_uring thread".into(),
                source,
            });
        let thread = match thread {
            Ok(t) => t,
            Err(e) => return Err(stop_rings(out, e)),
        };
        let ready = ready_rx.recv().map_err(|_| SwapError::Shutdown);
        match ready.and_then(|r| r) {
            Ok((fb, ff)) => {
                if let ActiveBackend::Uring {
                    fixed_buffers,
                    fixed_files,
                } = &mut active
                {
                    *fixed_buffers &= fb;
                    *fixed_files &= ff;
                }
                out.push((tx, thread));
            }
            Err(e) => {
                drop(tx);
                let _ = thread.join();
                return Err(stop_rings(out, e));
            }
        }
    }
    Ok((out, active))
}

/// Stops and joins the rings started before a failed start (`e`), which
/// it returns: no ring thread outlives the engine that failed to start.
fn stop_rings(started: Vec<(Sender<Job>, JoinHandle<()>)>, e: SwapError) -> SwapError {
    for (tx, th) in started {
        // A ring ends when its queue is closed and empty.
        drop(tx);
        let _ = th.join();
    }
    e
}

fn setup(
    shared: &Shared,
    arena: &PinnedArena,
    qd: u32,
    sqpoll: bool,
) -> Result<(IoUring, bool, bool)> {
    let build = |fast: bool| {
        let mut b = IoUring::builder();
        if sqpoll {
            b.setup_sqpoll(2000);
        } else if fast {
            b.setup_single_issuer().setup_coop_taskrun();
        }
        b.build(qd.next_power_of_two().max(2))
    };
    let ring = build(true)
        .or_else(|_| build(false))
        .map_err(|source| SwapError::Setup {
            what: "io_uring setup".into(),
            source,
        })?;
    let iovecs: Vec<libc::iovec> = arena
        .iovecs()
        .into_iter()
        .map(|(addr, len)| libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: len,
        })
        .collect();
    let fixed_buffers = if registrable(&iovecs) {
        // SAFETY: every iovec covers one buffer of the arena's live mapping;
        // the arena (kept alive by `Shared`'s users: every Job holds a buffer
        // with an Arc of it, the engine holds one, and this ring's thread
        // holds one while it runs) outlives this ring's registration, which
        // `Ring::unregister` ends once nothing is in flight (a panic of the
        // thread aborts the process: `AbortOnUnwind`).
        match unsafe { ring.submitter().register_buffers(&iovecs) } {
            Ok(()) => true,
            // An arena left unlocked for RLIMIT_MEMLOCK (said where that was
            // decided) is refused the same limit here: one warning is
            // enough, not one per ring.
            Err(e) if !arena.is_locked() && e.raw_os_error() == Some(libc::ENOMEM) => {
                tracing::debug!(error = %e, buffers = iovecs.len(), "unlocked arena's buffers not registered with io_uring; unregistered reads and writes");
                false
            }
            // A locked arena refused ENOMEM: io_uring charges each ring's
            // registration against RLIMIT_MEMLOCK again (beside mlock's
            // own charge), so with several rings the limit that locked the
            // arena is short by a ring's worth each. One warning a
            // process, with the numbers (it was one per ring, none).
            Err(e) if e.raw_os_error() == Some(libc::ENOMEM) => {
                let bytes: u64 = iovecs.iter().map(|v| v.iov_len as u64).sum();
                if !REGISTER_ENOMEM_SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    let info = crate::arena::MemlockInfo::current();
                    tracing::warn!(
                        registered_bytes = bytes,
                        memlock_limit_bytes = info.limit_bytes,
                        locked_bytes = info.locked_bytes,
                        "io_uring refused to register {bytes} bytes of pinned buffers: it charges \
                         each ring's registration against RLIMIT_MEMLOCK ({} bytes, {} locked \
                         already) beside the lock itself; reads and writes go unregistered (the \
                         same bytes, a little more CPU). Fix: raise the limit by {bytes} bytes for \
                         each ring, two a ring thread (tierzero.ring_threads), or unlimited \
                         (`ulimit -l unlimited`), or run with CAP_IPC_LOCK",
                        info.limit_bytes,
                        info.locked_bytes
                    );
                } else {
                    tracing::debug!(error = %e, registered_bytes = bytes, "buffers not registered with io_uring (RLIMIT_MEMLOCK)");
                }
                false
            }
            Err(e) => {
                tracing::warn!(error = %e, buffers = iovecs.len(), "could not register buffers with io_uring; using unregistered reads and writes");
                false
            }
        }
    } else {
        false
    };
    let fixed_files = match ring.submitter().register_files(&shared.space.raw_fds()) {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(error = %e, "could not register swap files with io_uring");
            false
        }
    };
    Ok((ring, fixed_buffers, fixed_files))
}

#[derive(Debug, Clone, Copy)]
struct PieceOp {
    job: usize,
    piece: Piece,
    done_bytes: u64,
    /// When the SQE was pushed (set when it goes in flight).
    issued: Option<Instant>,
}

struct JobState {
    job: Job,
    pending: usize,
    error: Option<SwapError>,
}

struct Ring {
    ring: IoUring,
    shared: Arc<Shared>,
    idx: usize,
    qd: usize,
    fixed_buffers: bool,
    fixed_files: bool,
    jobs: Vec<Option<JobState>>,
    free_jobs: Vec<usize>,
    queue: VecDeque<PieceOp>,
    slots: Vec<Option<PieceOp>>,
    free_slots: Vec<usize>,
    in_flight: usize,
    busy_since: Option<Instant>,
}

impl Ring {
    fn run(&mut self, rx: Receiver<Job>) {
        let mut backoff = EnterBackoff::default();
        let mut open = true;
        loop {
            // 1. Intake. Block only when there is nothing else to do.
            while open && self.queue.len() < 2 * self.qd {
                let next = if self.in_flight == 0 && self.queue.is_empty() {
                    rx.recv().map_err(|_| TryRecvError::Disconnected)
                } else {
                    rx.try_recv()
                };
                match next {
                    Ok(job) => self.accept(job),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => open = false,
                }
            }
            if !open && self.in_flight == 0 && self.queue.is_empty() {
                self.unregister();
                return;
            }
            // 2. Fill the submission queue.
            self.push_pieces();
            if self.in_flight == 0 {
                continue;
            }
            // 3. Submit and wait for at least one completion.
            match self.ring.submit_and_wait(1) {
                Ok(_) => backoff.ok(),
                Err(e) => match e.raw_os_error() {
                    Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY) => {}
                    // The ring itself is broken: failing every piece in
                    // flight would be unsafe (the kernel may still use the
                    // buffers), so keep waiting on completions.
                    _ => backoff.failed(&e, "the swap engine"),
                },
            }
            // 4. Reap.
            self.reap();
        }
    }

    /// Hands the registered files and buffers back before the ring is
    /// dropped, with nothing in flight. Closing a ring tears it down in
    /// the kernel's own time, after the process may have exited: a
    /// swap file it still held kept its blocks (a 40 MiB file was still
    /// counted used just after exit, and a second run on that tmpfs was
    /// refused for room), and its registered buffers stayed charged to
    /// `RLIMIT_MEMLOCK`. Unregistered, they are let go at once.
    fn unregister(&mut self) {
        let submitter = self.ring.submitter();
        if self.fixed_files {
            if let Err(e) = submitter.unregister_files() {
                tracing::debug!(error = %e, "unregistering swap files from io_uring");
            }
            self.fixed_files = false;
        }
        if self.fixed_buffers {
            if let Err(e) = submitter.unregister_buffers() {
                tracing::debug!(error = %e, "unregistering buffers from io_uring");
            }
            self.fixed_buffers = false;
        }
    }

    fn accept(&mut self, job: Job) {
        let r = &job.req;
        let pieces = r
            .extent
            .pieces(r.offset_bytes, r.len_bytes, self.shared.block_bytes);
        let slot = match self.free_jobs.pop() {
            Some(s) => s,
            None => {
                self.jobs.push(None);
                self.jobs.len() - 1
            }
        };
        for piece in &pieces {
            self.queue.push_back(PieceOp {
                job: slot,
                piece: *piece,
                done_bytes: 0,
                issued: None,
            });
        }
        self.jobs[slot] = Some(JobState {
            pending: pieces.len(),
            job,
            error: None,
        });
        if pieces.is_empty() {
            self.piece_finished(slot, None);
        }
    }

    fn push_pieces(&mut self) {
        while self.in_flight < self.qd {
            let Some(p) = self.queue.pop_front() else {
                break;
            };
            let failed = self.jobs[p.job].as_ref().is_none_or(|j| j.error.is_some());
            if failed {
                // The job already failed: do not issue the rest.
                self.piece_finished(p.job, None);
                continue;
            }
            let Some(slot) = self.free_slots.pop() else {
                self.queue.push_front(p);
                break;
            };
            let Some(js) = self.jobs[p.job].as_mut() else {
                continue;
            };
            let op = js.job.req.op;
            let buf_idx = js.job.req.buffer.idx().0;
            let offset_in_buf = (p.piece.buf_offset_bytes + p.done_bytes) as usize;
            // SAFETY: offset + len stays inside the job's buffer (validated
            // at submission: len_bytes <= capacity), which the job table
            // owns until every piece has completed.
            let ptr = unsafe { js.job.req.buffer.as_mut_ptr().add(offset_in_buf) };
            let len = (p.piece.len_bytes - p.done_bytes) as u32;
            let off = p.piece.file_offset_bytes + p.done_bytes;
            let file_idx = p.piece.file.0;
            let entry = match (op, self.fixed_files, self.fixed_buffers) {
                (IoOp::Read, true, true) => {
                    opcode::ReadFixed::new(types::Fixed(file_idx), ptr, len, buf_idx as u16)
                        .offset(off)
                        .build()
                }
                (IoOp::Write, true, true) => {
                    opcode::WriteFixed::new(types::Fixed(file_idx), ptr, len, buf_idx as u16)
                        .offset(off)
                        .build()
                }
                (IoOp::Read, true, false) => opcode::Read::new(types::Fixed(file_idx), ptr, len)
                    .offset(off)
                    .build(),
                (IoOp::Write, true, false) => opcode::Write::new(types::Fixed(file_idx), ptr, len)
                    .offset(off)
                    .build(),
                (IoOp::Read, false, fixed) => {
                    let fd = types::Fd(std::os::fd::AsRawFd::as_raw_fd(
                        self.shared.space.file(p.piece.file).file(),
                    ));
                    if fixed {
                        opcode::ReadFixed::new(fd, ptr, len, buf_idx as u16)
                            .offset(off)
                            .build()
                    } else {
                        opcode::Read::new(fd, ptr, len).offset(off).build()
                    }
                }
                (IoOp::Write, false, fixed) => {
                    let fd = types::Fd(std::os::fd::AsRawFd::as_raw_fd(
                        self.shared.space.file(p.piece.file).file(),
                    ));
                    if fixed {
                        opcode::WriteFixed::new(fd, ptr, len, buf_idx as u16)
                            .offset(off)
                            .build()
                    } else {
                        opcode::Write::new(fd, ptr, len).offset(off).build()
                    }
                }
            }
            .user_data(slot as u64);
            // SAFETY: the SQE points at buffer memory owned by the job table
            // until this piece's CQE is reaped (see module docs); the fd or
            // fixed-file slot stays open for the space's lifetime.
            let pushed = unsafe { self.ring.submission().push(&entry) };
            if pushed.is_err() {
                // SQ full: submit what we have and retry this piece later.
                self.free_slots.push(slot);
                self.queue.push_front(p);
                if let Err(e) = self.ring.submit() {
                    tracing::warn!(error = %e, "io_uring submit failed while the SQ was full");
                }
                break;
            }
            self.slots[slot] = Some(PieceOp {
                issued: Some(Instant::now()),
                ..p
            });
            if self.in_flight == 0 {
                self.busy_since = Some(Instant::now());
                self.shared.stats.busy_start();
            }
            self.in_flight += 1;
        }
    }

    fn reap(&mut self) {
        let mut done: Vec<(usize, i64)> = Vec::new();
        for cqe in self.ring.completion() {
            done.push((cqe.user_data() as usize, cqe.result() as i64));
        }
        for (slot, raw) in done {
            let Some(p) = self.slots.get_mut(slot).and_then(Option::take) else {
                tracing::error!(slot, "completion for an unknown io_uring slot");
                continue;
            };
            self.free_slots.push(slot);
            self.in_flight -= 1;
            if let Some(t) = p.issued {
                self.shared.stats.record_piece(t.elapsed());
            }
            if self.in_flight == 0 {
                if let Some(t) = self.busy_since.take() {
                    self.shared.stats.busy_stop(self.idx, t.elapsed());
                }
            }
            let Some(op) = self.jobs[p.job].as_ref().map(|j| j.job.req.op) else {
                continue;
            };
            let raw = if raw == -(libc::EINTR as i64) || raw == -(libc::EAGAIN as i64) {
                // Retry the same piece unchanged.
                self.queue.push_front(p);
                continue;
            } else {
                raw
            };
            match self.shared.check_piece(op, &p.piece, p.done_bytes, raw) {
                PieceOutcome::Done => self.piece_finished(p.job, None),
                PieceOutcome::Partial { done_bytes } => {
                    self.queue.push_front(PieceOp { done_bytes, ..p })
                }
                PieceOutcome::Failed(e) => self.piece_finished(p.job, Some(e)),
            }
        }
    }

    fn piece_finished(&mut self, slot: usize, error: Option<SwapError>) {
        let Some(js) = self.jobs[slot].as_mut() else {
            return;
        };
        if js.error.is_none() {
            js.error = error;
        }
        js.pending = js.pending.saturating_sub(1);
        if js.pending == 0 {
            if let Some(js) = self.jobs[slot].take() {
                self.free_jobs.push(slot);
                self.shared.finish(js.job, js.error);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enter_backoff_doubles_to_100_ms_and_resets() {
        let mut b = EnterBackoff::default();
        let e = std::io::Error::from_raw_os_error(libc::EBADF);
        let t0 = Instant::now();
        for _ in 0..3 {
            b.failed(&e, "a test");
        }
        // 1 + 2 + 4 ms.
        let took = t0.elapsed();
        assert!(took >= std::time::Duration::from_millis(7), "{took:?}");
        assert_eq!(b.failures, 3);
        b.ok();
        assert_eq!(b.failures, 0, "a success resets the backoff");
        b.failures = 100;
        let t0 = Instant::now();
        b.failed(&e, "a test");
        let took = t0.elapsed();
        assert!(took >= std::time::Duration::from_millis(100), "{took:?}");
    }
}

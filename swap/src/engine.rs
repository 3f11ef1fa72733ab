//! The I/O engine: requests in, completions out, over io_uring or threads.
//!
//! A caller hands the engine a [`Request`] (an extent range and a buffer it
//! gives up) and gets a [`Ticket`]. The request travels over a crossbeam
//! channel to a worker: an io_uring ring thread (`ring.rs`) or, when
//! io_uring cannot be set up or is not wanted, a thread of the portable
//! `pread`/`pwrite` pool (`portable.rs`). The worker splits the request into
//! pieces of at most `block_bytes` that never cross a stripe, keeps up to
//! `queue_depth` pieces in flight, checks every piece's result against its
//! length (finishing short transfers, failing with `ShortIo` at end of
//! file, and with `Io` on an errno), and when the last piece is done sends a
//! [`Completion`] that carries the buffer back.
//!
//! Validation happens on the caller's thread at submission: alignment
//! (`Misaligned`), bounds (`OutOfBounds`), the buffer's arena, and poison,
//! so a bad request never reaches a worker.
//!
//! Dropping a [`Ticket`] does not cancel anything: the worker still owns the
//! buffer and the extent until the kernel is done with them, then drops the
//! completion, and the buffer goes back to the pool. Dropping the engine
//! waits for every in-flight request.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};

use crate::arena::{Buffer, PinnedArena};
use crate::error::{IoOp, Result, SwapError};
use crate::fault::FaultInjector;
use crate::space::{Extent, ExtentId, Piece, SwapSpace};
use crate::stats::{BusyClock, Stats, StatsSnapshot};

/// Which backend runs the transfers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// io_uring, or the portable pool if io_uring cannot be set up.
    Auto,
    /// io_uring or an error.
    Uring,
    /// A thread pool doing `pread`/`pwrite`.
    Portable,
}

/// The largest block one request may move: Linux moves at most
/// `MAX_RW_COUNT` (2 GiB less a page) per read or write, and the rings'
/// lengths are 32-bit.
pub const MAX_BLOCK_BYTES: u64 = u32::MAX as u64 / 2;

/// Settings for [`Engine::new`].
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Backend choice.
    pub backend: BackendKind,
    /// Ring threads (io_uring), or pool threads (portable).
    pub workers: usize,
    /// Pieces in flight per ring (DeepSpeed's `aio.queue_depth`).
    pub queue_depth: u32,
    /// Largest single piece (DeepSpeed's `aio.block_size`).
    pub block_bytes: u64,
    /// Use a kernel submission-polling thread (io_uring only).
    pub sqpoll: bool,
    /// Fault injection (tests).
    pub faults: Option<Arc<FaultInjector>>,
    /// A busy clock shared with other engines (the union of their busy
    /// time); `None`: per-worker busy time only.
    pub busy_clock: Option<Arc<BusyClock>>,
    /// A clock of this engine alone, driven beside `busy_clock` (for
    /// example one lane of a timeline: which engine had the disk when).
    pub own_clock: Option<Arc<BusyClock>>,
    /// CPUs the engine's threads (rings, or the portable pool) run on
    /// ([`crate::affinity`]); `None`: wherever the scheduler puts them.
    pub thread_cpus: Option<Arc<[usize]>>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            backend: BackendKind::Auto,
            workers: 1,
            queue_depth: 32,
            block_bytes: 1 << 20,
            sqpoll: false,
            faults: None,
            busy_clock: None,
            own_clock: None,
            thread_cpus: None,
        }
    }
}

/// The backend actually in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActiveBackend {
    /// io_uring rings; whether buffers and files are registered.
    Uring {
        /// `IORING_REGISTER_BUFFERS` succeeded (ReadFixed/WriteFixed in use).
        fixed_buffers: bool,
        /// `IORING_REGISTER_FILES` succeeded.
        fixed_files: bool,
    },
    /// The portable thread pool.
    Portable,
}

/// Identity of a submitted request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TicketId(pub u64);

/// One transfer between a buffer and a range of an extent.
#[derive(Debug)]
pub struct Request {
    /// Read or write.
    pub op: IoOp,
    /// The extent.
    pub extent: Extent,
    /// Start within the extent (aligned).
    pub offset_bytes: u64,
    /// Length (aligned); the buffer's first `len_bytes` are used.
    pub len_bytes: u64,
    /// The buffer, owned by the engine until the completion.
    pub buffer: Buffer,
}

impl Request {
    /// Reads the whole extent into `buffer`.
    pub fn read(extent: &Extent, buffer: Buffer) -> Self {
        Request {
            op: IoOp::Read,
            len_bytes: extent.len_bytes(),
            extent: extent.clone(),
            offset_bytes: 0,
            buffer,
        }
    }
    /// Writes `buffer` over the whole extent.
    pub fn write(extent: &Extent, buffer: Buffer) -> Self {
        Request {
            op: IoOp::Write,
            len_bytes: extent.len_bytes(),
            extent: extent.clone(),
            offset_bytes: 0,
            buffer,
        }
    }
    /// A transfer of `[offset_bytes, offset_bytes + len_bytes)`.
    pub fn range(
        op: IoOp,
        extent: &Extent,
        offset_bytes: u64,
        len_bytes: u64,
        buffer: Buffer,
    ) -> Self {
        Request {
            op,
            extent: extent.clone(),
            offset_bytes,
            len_bytes,
            buffer,
        }
    }
}

/// The outcome of a request; the buffer always comes back.
#[derive(Debug)]
pub struct Completion {
    /// Which request.
    pub ticket: TicketId,
    /// Read or write.
    pub op: IoOp,
    /// The extent it touched.
    pub extent: ExtentId,
    /// The buffer (holding the data, for a successful read).
    pub buffer: Buffer,
    /// Whether every byte was transferred (and verified).
    pub result: Result<()>,
}

impl Completion {
    /// The buffer if the transfer succeeded, else the error.
    pub fn into_result(self) -> Result<Buffer> {
        self.result.map(|()| self.buffer)
    }
}

/// A handle on one request's completion.
#[derive(Debug)]
pub struct Ticket {
    id: TicketId,
    rx: Receiver<Completion>,
}

impl Ticket {
    /// The request's id.
    pub fn id(&self) -> TicketId {
        self.id
    }
    /// Waits for the completion.
    pub fn wait_completion(self) -> Result<Completion> {
        self.rx.recv().map_err(|_| SwapError::Shutdown)
    }
    /// Waits; returns the buffer or the error.
    pub fn wait(self) -> Result<Buffer> {
        self.wait_completion()?.into_result()
    }
    /// The completion if it has arrived. After it returns `Some`, the
    /// ticket is spent.
    pub fn poll(&self) -> Option<Completion> {
        self.rx.try_recv().ok()
    }
    /// The channel the completion arrives on, to wait for it together with
    /// other channels (`crossbeam_channel::Select::ready`, which does not
    /// take the message). Whatever is received through it is this ticket's
    /// completion: the buffer is in it, and the ticket is then spent.
    pub fn receiver(&self) -> &Receiver<Completion> {
        &self.rx
    }
    /// Whether the completion has arrived and is waiting to be taken
    /// (false again once [`Ticket::poll`] has taken it).
    pub fn is_done(&self) -> bool {
        !self.rx.is_empty()
    }
}

/// Waits for every ticket; returns the buffers in order, or the first error
/// (after all have completed, so no buffer is left with the kernel).
pub fn wait_all(tickets: Vec<Ticket>) -> Result<Vec<Buffer>> {
    let mut out = Vec::with_capacity(tickets.len());
    let mut first_err = None;
    for t in tickets {
        match t.wait() {
            Ok(b) => out.push(b),
            Err(e) => {
                if first_err.is_none() {
                    first_err = Some(e);
                }
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

/// A request inside a worker.
#[derive(Debug)]
pub(crate) struct Job {
    pub ticket: TicketId,
    pub req: Request,
    pub reply: Sender<Completion>,
    pub submitted: Instant,
    /// crc32c of a write at offset 0 (the whole extent or a prefix of it),
    /// computed on the submitting thread
    /// so the ring thread never hashes data on its submission path.
    pub write_crc: Option<u32>,
}

/// What every worker shares.
#[derive(Debug)]
pub(crate) struct Shared {
    pub space: Arc<SwapSpace>,
    pub stats: Stats,
    pub faults: Option<Arc<FaultInjector>>,
    pub block_bytes: u64,
    inflight: Mutex<usize>,
    idle: Condvar,
}

/// Result of checking one piece's completion.
pub(crate) enum PieceOutcome {
    /// All bytes of the piece are done.
    Done,
    /// Only `done_bytes` so far: submit the rest.
    Partial { done_bytes: u64 },
    /// The piece failed.
    Failed(SwapError),
}

impl Shared {
    /// Checks a piece's raw result (`bytes` or `-errno`), after fault
    /// injection. `done_bytes` were transferred by earlier attempts.
    pub fn check_piece(&self, op: IoOp, piece: &Piece, done_bytes: u64, raw: i64) -> PieceOutcome {
        let remaining = piece.len_bytes - done_bytes;
        let raw = match &self.faults {
            Some(f) => f.apply(op, raw, remaining),
            None => raw,
        };
        let path = || self.space.file(piece.file).path().to_path_buf();
        if raw < 0 {
            let errno = i32::try_from(-raw).unwrap_or(libc::EIO);
            return PieceOutcome::Failed(SwapError::Io {
                op,
                path: path(),
                offset_bytes: piece.file_offset_bytes + done_bytes,
                len_bytes: remaining,
                source: std::io::Error::from_raw_os_error(errno),
            });
        }
        let got = raw as u64;
        if got == remaining {
            PieceOutcome::Done
        } else if got == 0 || got > remaining {
            PieceOutcome::Failed(SwapError::ShortIo {
                op,
                path: path(),
                offset_bytes: piece.file_offset_bytes,
                expected_bytes: piece.len_bytes,
                got_bytes: done_bytes + got.min(remaining),
            })
        } else {
            PieceOutcome::Partial {
                done_bytes: done_bytes + got,
            }
        }
    }

    /// Finishes a job: verifies, poisons on write failure, records stats,
    /// replies. Called exactly once per job, after its last piece.
    pub fn finish(&self, job: Job, error: Option<SwapError>) {
        let req = &job.req;
        let mut result = match error {
            Some(e) => Err(e),
            None => Ok(()),
        };
        if req.op == IoOp::Read && result.is_ok() && self.space.checksums() {
            // A read of exactly the prefix the last write at offset 0 wrote
            // (the whole extent, or a range write's: a spilled 16-bit
            // gradient in an fp32-sized extent) is verified.
            let recorded = req
                .extent
                .checksum()
                .filter(|c| req.offset_bytes == 0 && c.len_bytes == req.len_bytes)
                .map(|c| c.crc);
            if let Some(expected) = recorded {
                let got = crc32c::crc32c(&req.buffer.as_slice()[..req.len_bytes as usize]);
                if got != expected {
                    let (path, offset_bytes) = req.extent.first_location();
                    result = Err(SwapError::ChecksumMismatch {
                        extent: req.extent.id().0,
                        path,
                        offset_bytes,
                        expected,
                        got,
                    });
                }
            }
        }
        if req.op == IoOp::Write {
            match &result {
                Err(e) => self.space.poison(e.to_string(), e),
                Ok(()) if self.space.checksums() => {
                    req.extent
                        .record_write(req.offset_bytes, req.len_bytes, job.write_crc)
                }
                Ok(()) => {}
            }
        }
        self.stats.record(
            req.op,
            req.len_bytes,
            result.is_ok(),
            job.submitted.elapsed(),
        );
        let Job {
            ticket, req, reply, ..
        } = job;
        let completion = Completion {
            ticket,
            op: req.op,
            extent: req.extent.id(),
            buffer: req.buffer,
            result,
        };
        // The extent goes back before the reply: a caller that drops its
        // own clone after the wait and allocates again finds the space
        // free.
        drop(req.extent);
        // A dropped ticket is fine: the completion (and its buffer) drop here.
        let _ = reply.send(completion);
        let mut n = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
        *n -= 1;
        if *n == 0 {
            self.idle.notify_all();
        }
    }
}

struct Worker {
    tx: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

/// The I/O engine over one swap space and one pinned arena.
pub struct Engine {
    shared: Arc<Shared>,
    arena: Arc<PinnedArena>,
    workers: Vec<Worker>,
    next_worker: AtomicUsize,
    next_ticket: AtomicU64,
    backend: ActiveBackend,
    queue_depth: u32,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("backend", &self.backend)
            .field("workers", &self.workers.len())
            .field("queue_depth", &self.queue_depth)
            .finish()
    }
}

impl Engine {
    /// Starts the workers.
    pub fn new(
        space: Arc<SwapSpace>,
        arena: Arc<PinnedArena>,
        config: EngineConfig,
    ) -> Result<Self> {
        if config.queue_depth == 0 || config.workers == 0 {
            return Err(SwapError::Config(
                "queue_depth and workers must be at least 1".into(),
            ));
        }
        crate::fileio::check_queue_depth(config.queue_depth)?;
        if !space.alignment().is_aligned(config.block_bytes) || config.block_bytes == 0 {
            return Err(SwapError::Misaligned {
                what: "aio block_size",
                value: config.block_bytes,
                alignment_bytes: space.alignment().bytes(),
            });
        }
        if config.block_bytes > MAX_BLOCK_BYTES {
            return Err(SwapError::Config(format!(
                "block size {} is 2 GiB or more; a request moves at most {MAX_BLOCK_BYTES} bytes",
                config.block_bytes
            )));
        }
        if arena.alignment().bytes() < space.alignment().bytes() {
            return Err(SwapError::Config(format!(
                "arena alignment {} is below the swap files' O_DIRECT alignment {}",
                arena.alignment().bytes(),
                space.alignment().bytes()
            )));
        }
        let shared = Arc::new(Shared {
            space: space.clone(),
            stats: Stats::new(
                config.workers,
                config
                    .busy_clock
                    .iter()
                    .chain(&config.own_clock)
                    .cloned()
                    .collect(),
            ),
            faults: config.faults.clone(),
            block_bytes: config.block_bytes,
            inflight: Mutex::new(0),
            idle: Condvar::new(),
        });
        let mut workers = Vec::new();
        let mut backend = ActiveBackend::Portable;
        if config.backend != BackendKind::Portable {
            match crate::ring::spawn_rings(&shared, &arena, &config) {
                Ok((ws, active)) => {
                    backend = active;
                    workers = ws
                        .into_iter()
                        .map(|(tx, thread)| Worker {
                            tx: Some(tx),
                            thread: Some(thread),
                        })
                        .collect();
                }
                Err(e) if config.backend == BackendKind::Auto => {
                    tracing::warn!(error = %e, "io_uring unavailable; using the portable pread/pwrite backend");
                }
                Err(e) => return Err(e),
            }
        }
        if workers.is_empty() {
            let (tx, thread) = crate::portable::spawn_pool(&shared, &config)?;
            workers = tx
                .into_iter()
                .zip(thread)
                .map(|(tx, th)| Worker {
                    tx: Some(tx),
                    thread: Some(th),
                })
                .collect();
        }
        Ok(Engine {
            shared,
            arena,
            workers,
            next_worker: AtomicUsize::new(0),
            next_ticket: AtomicU64::new(0),
            backend,
            queue_depth: config.queue_depth,
        })
    }

    /// The backend in use.
    pub fn backend(&self) -> ActiveBackend {
        self.backend
    }

    /// The swap space.
    pub fn space(&self) -> &Arc<SwapSpace> {
        &self.shared.space
    }

    /// The pinned arena.
    pub fn arena(&self) -> &Arc<PinnedArena> {
        &self.arena
    }

    /// Counters so far.
    pub fn stats(&self) -> StatsSnapshot {
        self.shared.stats.snapshot()
    }

    fn validate(&self, req: &Request) -> Result<()> {
        let space = &self.shared.space;
        if !Arc::ptr_eq(req.extent.space(), space) {
            return Err(SwapError::Config(
                "extent belongs to another swap space".into(),
            ));
        }
        if !Arc::ptr_eq(req.buffer.arena(), &self.arena) {
            return Err(SwapError::Config("buffer belongs to another arena".into()));
        }
        let align = space.alignment();
        for (what, v) in [
            ("offset_bytes", req.offset_bytes),
            ("len_bytes", req.len_bytes),
        ] {
            if !align.is_aligned(v) {
                return Err(SwapError::Misaligned {
                    what,
                    value: v,
                    alignment_bytes: align.bytes(),
                });
            }
        }
        let end = req.offset_bytes.checked_add(req.len_bytes);
        if req.len_bytes == 0
            || end.is_none_or(|e| e > req.extent.len_bytes())
            || req.len_bytes > req.buffer.capacity_bytes()
        {
            return Err(SwapError::OutOfBounds {
                op: req.op,
                offset_bytes: req.offset_bytes,
                len_bytes: req.len_bytes,
                buffer_bytes: req.buffer.capacity_bytes(),
                extent_bytes: req.extent.len_bytes(),
            });
        }
        space.check_poison(req.op)
    }

    /// Submits a request; the completion arrives on `sink`, which must be
    /// unbounded: a ring thread that sends a completion into a full
    /// channel stops reaping and issuing every request of its ring, with
    /// their buffers, until the caller receives, and a caller that waits
    /// on that ring first (another ticket, [`Engine::wait_idle`], a drop
    /// of the engine) never does. A bounded sink is
    /// [`SwapError::Config`].
    pub fn submit_to(&self, req: Request, sink: &Sender<Completion>) -> Result<TicketId> {
        if let Some(cap) = sink.capacity() {
            return Err(SwapError::Config(format!(
                "submit_to: a completion sink of capacity {cap}: it must be unbounded \
                 (crossbeam_channel::unbounded), or the ring thread could block on it"
            )));
        }
        self.submit_any(req, sink)
    }

    /// [`Engine::submit_to`] for any sink: the caller sees that a send
    /// into it never blocks (one completion per job into a channel with
    /// room for it).
    fn submit_any(&self, req: Request, sink: &Sender<Completion>) -> Result<TicketId> {
        self.validate(&req)?;
        let ticket = TicketId(self.next_ticket.fetch_add(1, Ordering::Relaxed));
        let w = self.next_worker.fetch_add(1, Ordering::Relaxed) % self.workers.len();
        let tx = self.workers[w].tx.as_ref().ok_or(SwapError::Shutdown)?;
        *self
            .shared
            .inflight
            .lock()
            .unwrap_or_else(|e| e.into_inner()) += 1;
        let write_crc =
            (self.shared.space.checksums() && req.op == IoOp::Write && req.offset_bytes == 0)
                .then(|| crc32c::crc32c(&req.buffer.as_slice()[..req.len_bytes as usize]));
        let job = Job {
            ticket,
            req,
            reply: sink.clone(),
            submitted: Instant::now(),
            write_crc,
        };
        if tx.send(job).is_err() {
            let mut n = self
                .shared
                .inflight
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            *n -= 1;
            return Err(SwapError::Shutdown);
        }
        Ok(ticket)
    }

    /// Submits a request and returns its ticket.
    pub fn submit(&self, req: Request) -> Result<Ticket> {
        // Room for its one completion: the ring's send never blocks.
        let (tx, rx) = crossbeam_channel::bounded(1);
        let id = self.submit_any(req, &tx)?;
        Ok(Ticket { id, rx })
    }

    /// Reads the whole extent into `buffer`.
    pub fn read(&self, extent: &Extent, buffer: Buffer) -> Result<Ticket> {
        self.submit(Request::read(extent, buffer))
    }

    /// Writes `buffer` over the whole extent.
    pub fn write(&self, extent: &Extent, buffer: Buffer) -> Result<Ticket> {
        self.submit(Request::write(extent, buffer))
    }

    /// Requests submitted and not yet completed.
    pub fn in_flight(&self) -> usize {
        *self
            .shared
            .inflight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Blocks until no request is in flight.
    pub fn wait_idle(&self) {
        let mut n = self
            .shared
            .inflight
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        while *n > 0 {
            n = self.shared.idle.wait(n).unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        for w in &mut self.workers {
            w.tx.take();
        }
        for w in &mut self.workers {
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }
}

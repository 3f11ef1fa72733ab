//! The param copy thread: takes landed param reads out of their swap
//! buffers, and prefetched cpu-tier params out of their pinned pages
//! ([`Copier::copy_page`], done as soon as it arrives), off the compute
//! thread.
//!
//! # Why a thread
//!
//! A param read lands in a pinned swap buffer, and the buffer must go back
//! to the pool before another transfer can use it, so its bytes are copied
//! out: into a tensor (one rank), or into host bytes staged for the gather
//! of the next fetch (several ranks). On the compute thread that copy was
//! a few milliseconds per step (every streamed param's bytes, megabytes):
//! time the step's compute waited for while the other core sat mostly idle
//! (its optimizer and ring threads are busy a small part of a step). Here
//! a thread of its own does it; the compute thread picks up the result.
//! Buffers also come back to the pool as soon as their read lands, not
//! when the compute thread next looks.
//!
//! Write-backs keep their copy on the compute thread. Handed to this
//! thread, a write-back held its swap buffer until the thread got the core
//! (it shares it with the optimizer's Adam), and the compute thread's next
//! acquire waited for that: steps ran 7-9% longer. A read is issued a
//! prefetch window ahead of its use and has time to spare; a write-back's
//! buffer is wanted at once.
//!
//! # Ownership and order
//!
//! * The store submits a read, gets its [`Ticket`], and hands the ticket
//!   here with what to make of it ([`Unpack`]); it keeps a [`PendingRead`],
//!   a one-shot channel on which the result comes back. The param stays
//!   `InFlight` until the store takes the result.
//! * The thread waits on the job channel and on every ticket it holds at
//!   once ([`crossbeam_channel::Select`]) and serves reads in the order
//!   they land, not the order they were submitted, so a slow read never
//!   holds up a finished one. Beside that it only waits, briefly, for a
//!   page the compute thread is writing (a page copy's read pin waits
//!   for the write's guard), which that thread drops without waiting on
//!   this one; every buffer it holds is in a read the kernel completes
//!   by itself, so a caller waiting on a [`PendingRead`] (for example to
//!   free a buffer) always gets its answer.
//! * The buffer is dropped (back to the pool) **before** the result is
//!   sent: whoever waits on a [`PendingRead`] to free a buffer finds it
//!   free once the result arrives; unless the store asked to keep it
//!   ([`Unpack::Tensor`]'s `keep_buffer`, the buffers registered with a
//!   device): then it comes back *in* the result, as a [`ReadPin`] of the
//!   tensor's bytes, and goes back to the pool when the last pin of it is
//!   dropped (the store's, or a device copy's). The buffer is the kernel's until the
//!   completion, whatever happens here: a ticket dropped unread leaves the
//!   buffer with the I/O engine, which returns it to the pool when the
//!   transfer ends.
//! * A failed read's error (short read, I/O error) comes back as the
//!   result, so it surfaces at the fetch or harvest that takes it, naming
//!   the operation that failed.
//! * The thread ends when the store drops it, after the reads it holds
//!   have landed; a [`PendingRead`] whose thread is gone reports
//!   [`EngineError::Internal`] instead of hanging.
//!
//! The tensor is built on the CPU by [`crate::engine::params::store::cpu_tensor`], the
//! function the store uses, so the bits are those of a read completed on
//! the compute thread; the store moves it to the compute device.

use candle_core::{DType, Tensor};
use crossbeam_channel::{Receiver, Select, Sender, TryRecvError};
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tierzero_swap::{ReadPin, SharedBuffer, Ticket};

use crate::engine::params::store::cpu_tensor;
use crate::engine::{EngineError, Result};

/// What to make of a completed read.
#[derive(Debug, Clone)]
pub enum Unpack {
    /// A CPU tensor of `shape` and `dtype` from the first
    /// `shape.iter().product() × dtype size` bytes.
    Tensor {
        /// Element type of the stored bytes.
        dtype: DType,
        /// The whole param's shape (one rank holds the whole param).
        shape: Vec<usize>,
        /// Keep a landed read's swap buffer, as a read pin of the
        /// tensor's bytes, for a device's copy engine to read in place
        /// (the buffers' arena registered with it): see "Swap buffers
        /// kept for the device" in the store's docs. Ignored for a page.
        keep_buffer: bool,
    },
    /// The first `len_bytes` bytes, copied out (a shard to stage).
    Bytes {
        /// Bytes of the shard.
        len_bytes: usize,
    },
}

/// A read's bytes, out of the swap buffer.
#[derive(Debug)]
pub enum Unpacked {
    /// Built on the CPU ([`Unpack::Tensor`]); with `keep_buffer`, the
    /// swap buffer it was built from, pinned (the tensor's bytes).
    Tensor {
        /// The tensor.
        tensor: Tensor,
        /// The swap buffer's pin, when asked to keep it.
        pin: Option<ReadPin>,
    },
    /// Copied out ([`Unpack::Bytes`]).
    Bytes(Vec<u8>),
}

/// The result of a read handed to the copy thread.
#[derive(Debug)]
pub struct PendingRead {
    rx: Receiver<Result<Unpacked>>,
    /// Handed over `seq`-th (from 0) of this copier's reads and copies.
    seq: u64,
}

impl PendingRead {
    /// Its place in the order reads and copies were handed over.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The result if it is there (the read landed and was copied out).
    /// After `Some`, the pending read is spent.
    pub fn poll(&self) -> Option<Result<Unpacked>> {
        match self.rx.try_recv() {
            Ok(r) => Some(r),
            Err(TryRecvError::Empty) => None,
            Err(TryRecvError::Disconnected) => Some(Err(gone())),
        }
    }

    /// Waits for the result.
    pub fn wait(self) -> Result<Unpacked> {
        self.rx.recv().unwrap_or_else(|_| Err(gone()))
    }
}

fn gone() -> EngineError {
    EngineError::internal("the param copy thread stopped before a read's result came back")
}

/// How many param reads are on the disk now, for the optimizer thread:
/// its state read-ahead beyond the next sub-group to step waits while
/// param reads are in flight (`worker::State::pump`), so the reads the
/// compute waits for do not share the disk with reads wanted only later.
/// The store counts a read in when it hands it over ([`Copier::read`]);
/// the copy thread counts it out when it lands, and wakes the optimizer
/// thread ([`ParamReadGate::idle`]) when none is left.
#[derive(Debug)]
pub struct ParamReadGate {
    inflight: AtomicUsize,
    idle_tx: Sender<()>,
    idle_rx: Receiver<()>,
}

impl ParamReadGate {
    /// A gate with no read in flight.
    pub fn new() -> Arc<Self> {
        let (idle_tx, idle_rx) = crossbeam_channel::bounded(1);
        Arc::new(ParamReadGate {
            inflight: AtomicUsize::new(0),
            idle_tx,
            idle_rx,
        })
    }

    /// Whether a param read is on the disk.
    pub fn busy(&self) -> bool {
        self.inflight.load(Ordering::Acquire) > 0
    }

    /// Gets a message after the last read in flight landed (possibly a
    /// stale one: check [`ParamReadGate::busy`] again).
    pub fn idle(&self) -> &Receiver<()> {
        &self.idle_rx
    }

    /// Counts a read in (the store, as it hands one over).
    pub(crate) fn issued(&self) {
        self.inflight.fetch_add(1, Ordering::AcqRel);
    }

    /// Counts a read out (the copy thread, as it lands).
    pub(crate) fn landed(&self) {
        if self.inflight.fetch_sub(1, Ordering::AcqRel) == 1 {
            // Full means a wake-up is already waiting.
            let _ = self.idle_tx.try_send(());
        }
    }
}

struct Job {
    ticket: Ticket,
    unpack: Unpack,
    reply: Sender<Result<Unpacked>>,
}

/// A cpu-tier param to copy out of its pinned page.
struct PageJob {
    page: SharedBuffer,
    range: Range<usize>,
    unpack: Unpack,
    reply: Sender<Result<Unpacked>>,
}

/// What the thread is asked to do.
enum Work {
    /// A read in flight: copied out when it lands.
    Read(Job),
    /// A page region: copied out at once.
    Page(PageJob),
}

/// The copy thread's handle (see the module docs).
#[derive(Debug)]
pub struct Copier {
    gate: Arc<ParamReadGate>,
    tx: Option<Sender<Work>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Reads and copies handed over so far ([`PendingRead::seq`]).
    handed: std::sync::atomic::AtomicU64,
}

impl Copier {
    /// Starts the thread (`tz-param-copy`), on `cpus` when given; it
    /// counts reads in and out of `gate`.
    pub fn spawn(cpus: Option<Arc<[usize]>>, gate: Arc<ParamReadGate>) -> Result<Self> {
        let (tx, rx) = crossbeam_channel::unbounded::<Work>();
        let thread_gate = gate.clone();
        let thread = std::thread::Builder::new()
            .name("tz-param-copy".into())
            .spawn(move || {
                tierzero_swap::affinity::place_current_thread(cpus.as_deref(), "tz-param-copy");
                run(&rx, &thread_gate)
            })
            .map_err(|e| {
                EngineError::internal(format!("could not start the param copy thread: {e}"))
            })?;
        Ok(Copier {
            gate,
            tx: Some(tx),
            thread: Some(thread),
            handed: std::sync::atomic::AtomicU64::new(0),
        })
    }

    fn next_seq(&self) -> u64 {
        self.handed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    /// Hands over a submitted read.
    pub fn read(&self, ticket: Ticket, unpack: Unpack) -> Result<PendingRead> {
        let (reply, rx) = crossbeam_channel::bounded(1);
        let tx = self.tx.as_ref().ok_or_else(gone)?;
        self.gate.issued();
        if tx
            .send(Work::Read(Job {
                ticket,
                unpack,
                reply,
            }))
            .is_err()
        {
            self.gate.landed();
            return Err(gone());
        }
        Ok(PendingRead {
            rx,
            seq: self.next_seq(),
        })
    }

    /// Hands over the copy of `range` of a cpu-tier `page` (not a disk
    /// read: the gate does not count it). The thread read-locks the page
    /// while it copies.
    pub fn copy_page(
        &self,
        page: SharedBuffer,
        range: Range<usize>,
        unpack: Unpack,
    ) -> Result<PendingRead> {
        let (reply, rx) = crossbeam_channel::bounded(1);
        let tx = self.tx.as_ref().ok_or_else(gone)?;
        tx.send(Work::Page(PageJob {
            page,
            range,
            unpack,
            reply,
        }))
        .map_err(|_| gone())?;
        Ok(PendingRead {
            rx,
            seq: self.next_seq(),
        })
    }
}

impl Drop for Copier {
    fn drop(&mut self) {
        // Closing the channel ends the loop once the reads held have
        // landed.
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(jobs: &Receiver<Work>, gate: &ParamReadGate) {
    let mut held: Vec<Job> = Vec::new();
    let mut open = true;
    while open || !held.is_empty() {
        let mut sel = Select::new();
        for j in &held {
            sel.recv(j.ticket.receiver());
        }
        let jobs_at = open.then(|| sel.recv(jobs));
        let k = sel.ready();
        if Some(k) == jobs_at {
            loop {
                match jobs.try_recv() {
                    Ok(Work::Read(job)) => held.push(job),
                    Ok(Work::Page(job)) => copy_page(job),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
            continue;
        }
        let Some(ready) = held.get(k) else {
            continue;
        };
        // `ready` may wake spuriously (crossbeam's docs: check again):
        // take the completion only if it is there, never block on one
        // read while others that landed hold their buffers. A closed
        // channel is the engine gone.
        let landed = match ready.ticket.receiver().try_recv() {
            Ok(c) => c.into_result(),
            Err(TryRecvError::Empty) => continue,
            Err(TryRecvError::Disconnected) => Err(tierzero_swap::SwapError::Shutdown),
        };
        let job = held.swap_remove(k);
        gate.landed();
        let res = landed.map_err(EngineError::from).and_then(|buf| {
            let out = unpack_bytes(&job.unpack, buf.as_slice())?;
            match (out, &job.unpack) {
                (
                    Unpacked::Tensor { tensor, .. },
                    Unpack::Tensor {
                        keep_buffer: true, ..
                    },
                ) => {
                    // Held by the pin alone: back to the pool when the
                    // store and every copy that shares it let it go.
                    let len = tensor_len_bytes(&tensor);
                    let pin = SharedBuffer::new(buf)
                        .pin(0..len)
                        .map_err(|e| EngineError::internal(format!("swap buffer: {e}")))?;
                    Ok(Unpacked::Tensor {
                        tensor,
                        pin: Some(pin),
                    })
                }
                (out, _) => {
                    // Back to the pool before the result is seen.
                    drop(buf);
                    Ok(out)
                }
            }
        });
        // The store may have dropped its pending read (it was dropped
        // itself): then nobody is told, and the send fails harmlessly.
        let _ = job.reply.send(res);
    }
}

/// A page job, done now: its region read-locked, unpacked, answered.
fn copy_page(job: PageJob) {
    let res = match job.page.pin(job.range.clone()) {
        Ok(pin) => unpack_bytes(&job.unpack, pin.bytes()),
        Err(e) => Err(EngineError::internal(format!("cpu page: {e}"))),
    };
    let _ = job.reply.send(res);
}

/// Bytes of `t`'s elements.
fn tensor_len_bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

fn unpack_bytes(what: &Unpack, bytes: &[u8]) -> Result<Unpacked> {
    match what {
        Unpack::Tensor { dtype, shape, .. } => Ok(Unpacked::Tensor {
            tensor: cpu_tensor(bytes, *dtype, shape)?,
            pin: None,
        }),
        Unpack::Bytes { len_bytes } => {
            let src = bytes.get(..*len_bytes).ok_or_else(|| {
                EngineError::internal(format!(
                    "a read of {} bytes for a shard of {len_bytes}",
                    bytes.len()
                ))
            })?;
            Ok(Unpacked::Bytes(src.to_vec()))
        }
    }
}

//! [`DeviceComm`]: the ranks' collectives on device buffers (NCCL): the
//! params' gather where they are computed on, and the reduce-scatter of a
//! unit's gradients where they were computed.
//!
//! # A param's gather
//!
//! With several ranks each holds only its shard of every param. Through
//! the host, every rank gathers the whole param there (the host's
//! collective) and uploads all of it. Here each rank uploads only its
//! shard, into its range of the param's device buffer
//! ([`crate::link::Uploads::start_shard`]), and [`DeviceComm::gather`]
//! fills the other ranges on this communicator's stream, after the
//! shard's copy: this rank's range sent to every peer, each peer's
//! received into its range (`ncclSend`/`ncclRecv` in one group). The
//! upload's event becomes the exchange's, so the compute stream waits for
//! the whole param; issuing it, the host waits for nothing. 1/N of the
//! param crosses the host's link. NCCL only moves bytes: the same bits
//! as a gather on the host. When the param's unit takes it, the host
//! waits for that event with a deadline before the compute is ordered
//! after it ([`DeviceComm::wait_gathered`]), since a dead peer would leave
//! it incomplete for ever; issued a unit ahead, it is usually done by
//! then, though on this stream it queues behind the reduces issued
//! before it, which wait for their units' compute. A failed or late
//! collective makes the communicator unusable: every later one fails at
//! once instead of waiting out its own deadline. A gathered upload
//! dropped before its exchange is seen done leaks its buffer rather than
//! free it under NCCL.
//!
//! # A unit's gradients
//!
//! With several ranks, each computes the whole of a unit's gradients for
//! its micro-batches, and keeps only its shard of their sums. Through the
//! host, every rank downloads all of them and the host's collective moves
//! them again. Here they never leave the device but for this rank's sums:
//!
//! 1. **Pack** ([`DeviceComm::pack`]), as the unit's backward ends, on
//!    the compute stream: the gradients laid out as one buffer in the
//!    dtype they cross in (fp32 as computed; bf16 or fp16 rounded to
//!    nearest even, what their download would have brought, so half the
//!    bytes go between the ranks), rank `r`'s chunk of every gradient one
//!    after the other, the ranks' blocks in rank order; an event marks
//!    the layout done. Queued right
//!    after the unit's compute, so nothing below waits for the compute
//!    queued later (the next unit's).
//! 2. **Reduce** ([`DeviceComm::reduce`]), when the engine collects the
//!    unit (in backward order on every rank: it is a collective), on this
//!    communicator's own stream, which waits for the pack's event only:
//!    * an all-to-all of the blocks (`ncclSend` / `ncclRecv` to every
//!      peer in one group; this rank's own block a device copy), so this
//!      rank holds every rank's chunk of its shard, in rank order;
//!    * the running sums uploaded (when a micro-batch before began them);
//!    * `add_chunks` (one thread per element): the running sum, then
//!      each rank's chunk element widened exactly to fp32, added one
//!      after the other in rank order.
//!
//!    An event marks the sums done; their download waits for it, not for
//!    the compute stream.
//!
//! # Deterministic
//!
//! NCCL only moves bytes here: no `ncclReduceScatter` (its summation
//! order is NCCL's, by topology). The sums are `add_chunks`'s, in rank
//! order, the order the host's collective adds them in
//! (`reference::add_chunks`), so a run whose gradients are reduced on the
//! device has the same bits as one reduced on the host.
//!
//! # Buffers in flight
//!
//! The packed buffer is allocated on the compute stream and read by the
//! collective stream; it is kept in [`Reduced`] until the sums' download
//! completed, so its free (on the compute stream) never waits for the
//! collective. The receive buffer and the uploaded running sums are the
//! collective stream's own, kept there too. The gradients packed are
//! freed on the compute stream, after the copies that read them there.
//! cudarc records a buffer's last use as each NCCL call is made, before
//! NCCL queues its work at the group's end; so those records are not
//! relied on: every buffer is allocated before the group (a budget
//! refusal fails before this rank queues any NCCL work; peers already in
//! the group then fail at their deadline, `TIERZERO_COMM_TIMEOUT_S`, as
//! each GPU's budget is its own), and on an error
//! after the group they are leaked: NCCL's work may wait for a peer for
//! ever, so they are neither waited for nor freed under it. A shard of no
//! elements allocates nothing (the driver refuses empty allocations).
//! The running sums cross from pinned staging the communicator keeps,
//! rewritten only after an event says the copy that last read it is
//! done (and leaked, not freed, if that copy never ends).
//!
//! # Never waiting for ever
//!
//! A peer that died leaves this rank's all-to-all unfinished.
//! [`DeviceComm::wait`] polls the sums' event up to a deadline (the
//! engine's `TIERZERO_COMM_TIMEOUT_S`), then fails, leaking that
//! reduce's buffers on purpose (NCCL may still write into them).
//! [`DeviceComm::warm_up`], right after the communicator is built, runs
//! one all-to-all of one element and checks its sum: NCCL connects to the
//! peers, and takes those connections' memory, then, not in the first
//! step; and a communicator that cannot move bytes fails at start-up.
//!
//! # The optimizer on the device
//!
//! With nothing offloaded each GPU holds the params whole and Adam's
//! state for its rank's shard (`ResidentUnits` in the engine):
//!
//! * [`DeviceComm::reduce_onto`]: a unit's params' micro-batch sums,
//!   packed as above, reduce-scattered onto each param's running sums,
//!   which are already on the device (a former result of it): they are
//!   copied into one buffer, the chunks added onto it in rank order, and
//!   each param's range copied out to a buffer of its own, with an event
//!   after it. Every buffer is taken before the group. What the
//!   collective used (the pack, the chunks received, the running sums
//!   given, the combined sums) goes on a retiring queue with an event
//!   after that work, and is freed by the next reduce or gather that
//!   finds the event done ([`DeviceComm::reap`]): at most the last
//!   reduce's buffers are held beside the next one's.
//! * [`DeviceComm::gather_kept`]: after Adam, each rank's master shard is
//!   copied, or rounded to bf16, into its range of the weights on the
//!   compute stream, then every param's other ranges are exchanged in one
//!   group on this stream; the caller waits for its event with the
//!   deadline ([`DeviceComm::wait_event`]) before the compute reads them.
//!
//! # The communicator
//!
//! `ncclComm_t` is used from one thread at a time (a mutex), with the
//! device's context bound first. It is built with
//! [`DeviceComm::new`] on every rank from one [`DeviceComm::unique_id`]
//! (rank 0's, handed out by the caller's own bootstrap: the host's
//! collectives), and `ncclCommInitRank` blocks until every rank joined.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod kept;

pub use cudarc::driver::CudaEvent;
use cudarc::driver::{CudaStream, PinnedHostSlice, PushKernelArg};
use cudarc::nccl::result::{group_end, group_start};
pub use kept::{Gathered, KeptSums};

use crate::device::{driver_err, guarded, Device, DeviceBuffer};
use crate::link::{PendingUpload, Wire};
use crate::ops::Elem;
use crate::unit::DevBuf;
use crate::{GpuError, Result};

/// Bytes of an `ncclUniqueId`.
pub const ID_BYTES: usize = 128;

/// The NCCL library's name, for errors.
const NCCL: &str = "libnccl.so";

/// An `ncclComm_t` and the stream it queues on.
struct Handle {
    /// Dropped by [`Handle`]'s drop, under `catch_unwind`.
    comm: std::mem::ManuallyDrop<cudarc::nccl::Comm>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        // cudarc's `Comm` aborts the communicator when dropped and panics
        // if NCCL reports an error, which it may after a fault broke the
        // context: the run is already failing with its own error, and a
        // panic here (one more while that error unwinds: an abort) would
        // take its place. It is said instead.
        // SAFETY: `comm` is taken once, here, and not used after.
        let comm = unsafe { std::mem::ManuallyDrop::take(&mut self.comm) };
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(comm))).is_err() {
            tracing::warn!("aborting the NCCL communicator failed (see the panic message above)");
        }
    }
}

// SAFETY: an `ncclComm_t` may be used from any thread, but not from two at
// once; `DeviceComm` reaches it only under its mutex, with the device's
// context bound to the calling thread first.
unsafe impl Send for Handle {}

/// The ranks' collectives on one GPU's buffers (see the module docs).
pub struct DeviceComm {
    handle: Mutex<Handle>,
    /// The collectives' stream (NCCL's, the all-to-all's copies and the
    /// sums' kernel).
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
    /// The running sums' pinned staging (see [`AccStaging`]).
    acc_staging: Mutex<AccStaging>,
    /// Set when a collective failed after its group or was not done in
    /// time: a peer is gone, so every later one fails at once (no NCCL
    /// call, no wait) instead of each waiting out its own deadline.
    broken: std::sync::atomic::AtomicBool,
    /// Buffers a reduce kept on the device ([`DeviceComm::reduce_onto`])
    /// read or wrote, each batch with an event recorded after that work on
    /// this communicator's stream: freed once it completed, oldest first
    /// (the stream is in order), so they live for their collective and
    /// no longer; leaked at the drop if it never completed.
    retiring: Mutex<crate::event_queue::EventQueue<Vec<DevBuf>>>,
}

/// Pinned host memory the running sums cross from (so their upload is
/// the copy engine's DMA, asynchronous, not the driver's pageable path),
/// grown to the largest shard and reused, and an event after the copy
/// that last read it: the next reduce waits for it before writing.
#[derive(Default)]
struct AccStaging {
    host: Option<PinnedHostSlice<f32>>,
    read: Option<CudaEvent>,
}

impl Drop for DeviceComm {
    fn drop(&mut self) {
        // A copy still reading the staging (its stream stuck behind an
        // all-to-all whose peer is gone): leak the buffer, never free it
        // under the copy.
        let st = self
            .acc_staging
            .get_mut()
            .unwrap_or_else(|p| p.into_inner());
        if st
            .read
            .as_ref()
            .is_some_and(|ev| !matches!(ev.try_is_complete(), Ok(true)))
        {
            std::mem::forget(st.host.take());
        }
        self.retiring
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .leak_unfinished();
    }
}

impl std::fmt::Debug for DeviceComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish_non_exhaustive()
    }
}

/// A unit's gradients laid out for their reduce-scatter
/// ([`DeviceComm::pack`]), in the dtype they cross in.
#[derive(Debug)]
pub struct Packed {
    send: DevBuf,
    /// Each rank's block length (elements).
    blocks: Vec<usize>,
    /// Recorded on the compute stream after the layout.
    ready: CudaEvent,
}

/// A reduce-scatter's sums on the device ([`DeviceComm::reduce`]).
#[derive(Debug)]
pub struct Reduced {
    /// This rank's sums (fp32; None for a shard of no elements).
    pub sums: Option<DeviceBuffer<f32>>,
    /// Recorded on the collective stream after them: their download waits
    /// for it.
    pub done: CudaEvent,
    /// The buffers the collective read, kept until the sums' download
    /// completed (see "Buffers in flight").
    pub keep: Vec<DevBuf>,
    /// A timing event on the collective stream as its work for this
    /// reduce begins (after the pack's event), for the timeline's span:
    /// taken by whoever records the span's end
    /// ([`crate::link::EventClock::span`] on [`DeviceComm::stream`]).
    pub began: Option<CudaEvent>,
}

/// Running sums a reduce adds onto: from the host (uploaded on the
/// collective stream) or already on the device.
enum Acc<'a> {
    Host(&'a [f32]),
    Device(DeviceBuffer<f32>),
}

impl Acc<'_> {
    fn len(&self) -> usize {
        match self {
            Acc::Host(a) => a.len(),
            Acc::Device(b) => b.len(),
        }
    }
}

/// `m` locked, whoever panicked holding it.
fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether `libnccl.so` loads.
pub fn nccl_available() -> Result<()> {
    // SAFETY: only `dlopen`s the candidate names and closes them.
    let present = unsafe { cudarc::nccl::sys::is_culib_present() };
    if present {
        return Ok(());
    }
    Err(GpuError::LibraryMissing {
        library: NCCL,
        tried: crate::tried_names("nccl"),
        fix: "install NCCL (libnccl-dev provides libnccl.so; with only libnccl.so.2, from \
              libnccl2 or the nvidia-nccl wheel, link it as libnccl.so in a directory on \
              LD_LIBRARY_PATH)",
    })
}

fn nccl_err(call: &'static str) -> impl Fn(cudarc::nccl::result::NcclError) -> GpuError {
    move |e| GpuError::Driver {
        call,
        detail: format!("{e:?}"),
    }
}

/// Offsets of consecutive blocks.
fn offsets(blocks: &[usize]) -> Vec<usize> {
    blocks
        .iter()
        .scan(0usize, |at, &b| {
            let o = *at;
            *at += b;
            Some(o)
        })
        .collect()
}

fn shape(detail: String) -> GpuError {
    GpuError::Shape {
        kernel: "reduce-scatter".into(),
        detail,
    }
}

impl DeviceComm {
    /// A new `ncclUniqueId` (rank 0 makes it; every rank builds its
    /// communicator from it).
    pub fn unique_id() -> Result<[u8; ID_BYTES]> {
        nccl_available()?;
        guarded(NCCL, || {
            let id = cudarc::nccl::Id::new().map_err(nccl_err("ncclGetUniqueId"))?;
            Ok(id.internal().map(|c| c as u8))
        })
    }

    /// This rank's communicator on `dev`, among `world` ranks, from rank
    /// 0's `id`: blocks until every rank joined.
    pub fn new(dev: &Device, id: &[u8; ID_BYTES], rank: usize, world: usize) -> Result<Self> {
        nccl_available()?;
        if rank >= world {
            return Err(shape(format!("rank {rank} of {world}")));
        }
        guarded(NCCL, || {
            let ctx = dev.context();
            ctx.bind_to_thread()
                .map_err(driver_err("cuCtxSetCurrent"))?;
            let stream = ctx.new_stream().map_err(driver_err("cuStreamCreate"))?;
            let id = cudarc::nccl::Id::uninit(id.map(|b| b as core::ffi::c_char));
            let comm = cudarc::nccl::Comm::from_rank(stream.clone(), rank, world, id)
                .map_err(nccl_err("ncclCommInitRank"))?;
            Ok(DeviceComm {
                handle: Mutex::new(Handle {
                    comm: std::mem::ManuallyDrop::new(comm),
                }),
                stream,
                rank,
                world,
                acc_staging: Mutex::new(AccStaging::default()),
                broken: std::sync::atomic::AtomicBool::new(false),
                retiring: Mutex::new(crate::event_queue::EventQueue::default()),
            })
        })
    }

    /// The collectives' stream.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// `grads` (fp32) laid out for their reduce-scatter, on the compute
    /// stream, in `wire`'s dtype (16-bit gradients rounded there, to
    /// nearest even, as their download would round them: half the bytes
    /// cross between the ranks): gradient `p` cut into chunks of
    /// `counts[p][r]` elements, rank `r`'s chunks of every gradient one
    /// after the other, the blocks in rank order.
    pub fn pack(
        &self,
        dev: &Device,
        grads: &[&DeviceBuffer<f32>],
        counts: &[Vec<usize>],
        wire: Wire,
    ) -> Result<Packed> {
        if grads.len() != counts.len() {
            return Err(shape(format!(
                "{} gradients but {} counts",
                grads.len(),
                counts.len()
            )));
        }
        for (g, c) in grads.iter().zip(counts) {
            if c.len() != self.world || c.iter().sum::<usize>() != g.len() {
                return Err(shape(format!(
                    "a gradient of {} elements cut as {c:?} for {} ranks",
                    g.len(),
                    self.world
                )));
            }
        }
        // The rounded copies are the compute stream's, freed there after
        // the layout's copies read them.
        fn rounded<T: Elem>(
            dev: &Device,
            grads: &[&DeviceBuffer<f32>],
        ) -> Result<Vec<DeviceBuffer<T>>> {
            grads
                .iter()
                .map(|g| {
                    let mut out = dev.alloc_output::<T>("gradient rounded to cross", g.len())?;
                    crate::ops::cast::<f32, T>(dev, &mut out, g)?;
                    Ok(out)
                })
                .collect()
        }
        let (send, blocks) = match wire {
            Wire::F32 => {
                let (send, blocks) = self.lay_out(dev, grads, counts)?;
                (DevBuf::F32(send), blocks)
            }
            Wire::Bf16 => {
                let r = rounded::<half::bf16>(dev, grads)?;
                let (send, blocks) = self.lay_out(dev, &r.iter().collect::<Vec<_>>(), counts)?;
                (DevBuf::Bf16(send), blocks)
            }
            Wire::F16 => {
                let r = rounded::<half::f16>(dev, grads)?;
                let (send, blocks) = self.lay_out(dev, &r.iter().collect::<Vec<_>>(), counts)?;
                (DevBuf::F16(send), blocks)
            }
        };
        let ready = dev
            .compute
            .record_event(None)
            .map_err(driver_err("cuEventRecord"))?;
        Ok(Packed {
            send,
            blocks,
            ready,
        })
    }

    /// `parts` laid out by rank in one new buffer (copies on the compute
    /// stream), and each rank's block length.
    fn lay_out<T: Elem>(
        &self,
        dev: &Device,
        parts: &[&DeviceBuffer<T>],
        counts: &[Vec<usize>],
    ) -> Result<(DeviceBuffer<T>, Vec<usize>)> {
        let total: usize = parts.iter().map(|g| g.len()).sum();
        let mut send = dev.alloc_output::<T>("gradients laid out by rank", total)?;
        let mut blocks = vec![0usize; self.world];
        let mut at = 0usize;
        for (r, block) in blocks.iter_mut().enumerate() {
            for (g, c) in parts.iter().zip(counts) {
                let from: usize = c[..r].iter().sum();
                let n = c[r];
                if n > 0 {
                    let src = g.slice().slice(from..from + n);
                    let mut dst = send.slice_mut().slice_mut(at..at + n);
                    dev.compute
                        .memcpy_dtod(&src, &mut dst)
                        .map_err(driver_err("cuMemcpyDtoDAsync"))?;
                }
                at += n;
                *block += n;
            }
        }
        Ok((send, blocks))
    }

    /// The reduce-scatter of `packed` on the collective stream (see the
    /// module docs): this rank's chunks from every rank, in the dtype they
    /// were packed in, widened exactly and added onto `acc` (this rank's
    /// running sums; None: +0.0) in rank order. Every rank calls it for the same packs in the
    /// same order. The buffers it needs are allocated before any NCCL call
    /// (a budget refusal fails here, before this rank queues NCCL work;
    /// peers already in the group fail at their deadline); after one, an
    /// error leaks the buffers NCCL's work may still touch (it may wait
    /// for a peer for ever: they are neither waited for nor freed) and
    /// marks the communicator unusable.
    pub fn reduce(&self, dev: &Device, packed: Packed, acc: Option<&[f32]>) -> Result<Reduced> {
        self.reduce_from(dev, packed, acc.map(Acc::Host))
    }

    /// [`Self::reduce`] onto `acc`, wherever it is.
    fn reduce_from(&self, dev: &Device, packed: Packed, acc: Option<Acc<'_>>) -> Result<Reduced> {
        self.check_usable("ncclSend/ncclRecv (the gradients' all-to-all)")?;
        let Packed {
            send,
            blocks,
            ready,
        } = packed;
        match send {
            DevBuf::F32(send) => self.reduce_typed(dev, send, blocks, ready, acc),
            DevBuf::Bf16(send) => self.reduce_typed(dev, send, blocks, ready, acc),
            DevBuf::F16(send) => self.reduce_typed(dev, send, blocks, ready, acc),
        }
    }

    /// [`Self::reduce`] of chunks of `T`.
    fn reduce_typed<T: Elem + cudarc::nccl::NcclType>(
        &self,
        dev: &Device,
        send: DeviceBuffer<T>,
        blocks: Vec<usize>,
        ready: CudaEvent,
        acc: Option<Acc<'_>>,
    ) -> Result<Reduced>
    where
        DevBuf: From<DeviceBuffer<T>>,
    {
        let (me, world) = (self.rank, self.world);
        if blocks.len() != world {
            return Err(shape(format!("{} blocks for {world} ranks", blocks.len())));
        }
        let mine = blocks[me];
        if let Some(n) = acc.as_ref().map(Acc::len).filter(|&n| n != mine) {
            return Err(shape(format!(
                "{n} running sums for a shard of {mine} elements"
            )));
        }
        let s = &self.stream;
        dev.context()
            .bind_to_thread()
            .map_err(driver_err("cuCtxSetCurrent"))?;
        // Nothing of a zero-element shard is allocated (the driver refuses
        // empty allocations); the rank still sends its blocks.
        let (mut recv, acc, mut sums) = if mine == 0 {
            (None, None, None)
        } else {
            let recv = dev.alloc_output_on::<T>(s, "gradient chunks received", mine * world)?;
            let acc = match acc {
                Some(Acc::Host(a)) => {
                    let mut b = dev.alloc_output_on::<f32>(s, "running gradient sums", a.len())?;
                    self.upload_acc(dev, a, &mut b)?;
                    Some(b)
                }
                Some(Acc::Device(b)) => Some(b),
                None => None,
            };
            let sums = dev.alloc_output_on::<f32>(s, "reduced gradient sums", mine)?;
            (Some(recv), acc, Some(sums))
        };
        s.wait(&ready).map_err(driver_err("cuStreamWaitEvent"))?;
        // Timing only: a failed record loses the span, not the reduce.
        let began = crate::link::timing(crate::link::EventClock::mark(s));
        let from = offsets(&blocks);
        let queued = (|| -> Result<CudaEvent> {
            if let Some(recv) = recv.as_mut() {
                let own = send.slice().slice(from[me]..from[me] + mine);
                let mut dst = recv.slice_mut().slice_mut(me * mine..(me + 1) * mine);
                s.memcpy_dtod(&own, &mut dst)
                    .map_err(driver_err("cuMemcpyDtoDAsync"))?;
            }
            {
                let h = self.handle.lock().unwrap_or_else(|p| p.into_inner());
                // Counts are the same on every rank, so a zero-length send
                // here is a zero-length receive there: both are skipped.
                group_start().map_err(nccl_err("ncclGroupStart"))?;
                let mut first_error = None;
                for p in (0..world).filter(|&p| p != me) {
                    if blocks[p] > 0 {
                        let view = send.slice().slice(from[p]..from[p] + blocks[p]);
                        if let Err(e) = h.comm.send(&view, p as i32) {
                            first_error.get_or_insert(nccl_err("ncclSend")(e));
                        }
                    }
                    if let Some(recv) = recv.as_mut() {
                        let mut view = recv.slice_mut().slice_mut(p * mine..(p + 1) * mine);
                        if let Err(e) = h.comm.recv(&mut view, p as i32) {
                            first_error.get_or_insert(nccl_err("ncclRecv")(e));
                        }
                    }
                }
                let ended = group_end().map_err(nccl_err("ncclGroupEnd"));
                if let Some(e) = first_error {
                    return Err(e);
                }
                ended?;
            }
            if let (Some(sums), Some(recv)) = (sums.as_mut(), recv.as_ref()) {
                add_chunks_on::<T>(dev, s, sums, acc.as_ref(), recv, world)?;
            }
            s.record_event(None).map_err(driver_err("cuEventRecord"))
        })();
        let done = match queued {
            Ok(done) => done,
            Err(e) => {
                // cudarc recorded the buffers' last uses as the calls were
                // made, before NCCL queued its work at the group's end, and
                // that work may wait for a peer for ever: the buffers are
                // leaked, neither waited for nor freed under it.
                std::mem::forget((send, recv, acc, sums));
                self.set_broken();
                return Err(e);
            }
        };
        let mut keep = vec![DevBuf::from(send)];
        keep.extend(recv.map(DevBuf::from));
        keep.extend(acc.map(DevBuf::F32));
        Ok(Reduced {
            sums,
            done,
            keep,
            began,
        })
    }

    /// `a` into `dst` on the collective stream, through the pinned
    /// staging (see [`AccStaging`]).
    fn upload_acc(&self, dev: &Device, a: &[f32], dst: &mut DeviceBuffer<f32>) -> Result<()> {
        let mut st = self.acc_staging.lock().unwrap_or_else(|p| p.into_inner());
        // The last copy out of the staging: waited for before it is
        // rewritten; on a failed wait it stays recorded (the drop then
        // deals with it), never dropped with the copy maybe running.
        if let Some(ev) = &st.read {
            ev.synchronize().map_err(driver_err("cuEventSynchronize"))?;
        }
        st.read = None;
        if st.host.as_ref().is_none_or(|h| h.len() < a.len()) {
            st.host = None;
            // SAFETY: uninitialised pinned memory, every bit pattern a
            // valid f32; only its first `a.len()` elements are read by the
            // copy below, after the host wrote them.
            let p = unsafe { dev.context().alloc_pinned_with_flags::<f32>(a.len(), 0) }
                .map_err(driver_err("cuMemHostAlloc"))?;
            st.host = Some(p);
        }
        let host = st
            .host
            .as_mut()
            .ok_or_else(|| shape("no pinned staging".into()))?;
        host.as_mut_slice()
            .map_err(driver_err("cuEventSynchronize"))?[..a.len()]
            .copy_from_slice(a);
        self.stream
            .memcpy_htod(
                &host.as_slice().map_err(driver_err("cuEventSynchronize"))?[..a.len()],
                dst.slice_mut(),
            )
            .map_err(driver_err("cuMemcpyHtoDAsync"))?;
        match self.stream.record_event(None) {
            Ok(ev) => st.read = Some(ev),
            Err(e) => {
                // No event for the copy queued above: wait for the stream
                // instead; if that fails too, the staging is leaked, never
                // freed or rewritten under the copy.
                if self.stream.synchronize().is_err() {
                    std::mem::forget(st.host.take());
                }
                return Err(driver_err("cuEventRecord")(e));
            }
        }
        Ok(())
    }

    /// One all-to-all of one element for each rank, waited for at most
    /// `timeout`, and its sum checked (every rank sends 1.0 to each: the
    /// sum is the rank count). NCCL connects a communicator to its peers,
    /// and takes those connections' buffers, at its first send and
    /// receive: so that happens at start-up, not in the first step's
    /// backward, and a communicator that cannot move bytes fails here.
    pub fn warm_up(&self, dev: &Device, timeout: Duration) -> Result<()> {
        let ones = dev.upload("warm-up all-to-all", &vec![1f32; self.world])?;
        let packed = self.pack(dev, &[&ones], &[vec![1; self.world]], Wire::F32)?;
        let r = self.wait(self.reduce(dev, packed, None)?, timeout)?;
        let got = match &r.sums {
            Some(sums) => dev.download(sums)?,
            None => Vec::new(),
        };
        if got != [self.world as f32] {
            return Err(shape(format!(
                "the warm-up all-to-all of {} ranks summed to {got:?}, not [{}]",
                self.world, self.world
            )));
        }
        Ok(())
    }

    /// Waits for `r`'s sums, at most `timeout`: past it, a peer has died
    /// or hangs (its half of the all-to-all never came), and waiting on
    /// would block for ever. Then `r` is leaked on purpose (NCCL may still
    /// write into its buffers) and the caller fails.
    pub fn wait(&self, r: Reduced, timeout: Duration) -> Result<Reduced> {
        match self.poll(
            &r.done,
            timeout,
            "ncclSend/ncclRecv (the gradients' all-to-all)",
        ) {
            Ok(()) => Ok(r),
            Err(e) => {
                std::mem::forget(r);
                Err(e)
            }
        }
    }

    /// Waits for a gathered param's exchange ([`DeviceComm::gather`]), at
    /// most `timeout`, as [`DeviceComm::wait`] waits for a reduce. On an
    /// error `up` is leaked on purpose: NCCL may still write into it.
    pub fn wait_gathered(&self, up: PendingUpload, timeout: Duration) -> Result<PendingUpload> {
        let Some(ev) = up.event.as_ref() else {
            return Err(shape("a gathered upload without its event".into()));
        };
        match self.poll(ev, timeout, "ncclSend/ncclRecv (a param's gather)") {
            Ok(()) => Ok(up),
            Err(e) => {
                std::mem::forget(up);
                Err(e)
            }
        }
    }

    /// Polls `ev` until it completed or `timeout` passed (an error naming
    /// `call`: a rank has died or hangs).
    fn poll(&self, ev: &CudaEvent, timeout: Duration, call: &'static str) -> Result<()> {
        self.check_usable(call)?;
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_micros(20);
        loop {
            if ev.try_is_complete().map_err(driver_err("cuEventQuery"))? {
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.set_broken();
                return Err(GpuError::Driver {
                    call,
                    detail: format!(
                        "rank {} of {}: not done within {:.0} s: a rank has died or hangs; \
                         stopping (set TIERZERO_COMM_TIMEOUT_S to wait longer)",
                        self.rank,
                        self.world,
                        timeout.as_secs_f64()
                    ),
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    /// Whether the communicator is unusable (see `broken`).
    fn is_broken(&self) -> bool {
        self.broken.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Marks the communicator unusable (see `broken`).
    fn set_broken(&self) {
        self.broken
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// An error naming `call` once the communicator is unusable: a
    /// collective before failed or was not done in time.
    fn check_usable(&self, call: &'static str) -> Result<()> {
        if self.is_broken() {
            return Err(GpuError::Driver {
                call,
                detail: format!(
                    "rank {} of {}: an earlier collective on the GPUs' buffers failed or was not \
                     done in time; the communicator is unusable",
                    self.rank, self.world
                ),
            });
        }
        Ok(())
    }

    /// A param gathered on the device: `up` is the upload of this rank's
    /// shard into its range of the param's buffer
    /// ([`crate::link::Uploads::start_shard`]; `counts[r]` elements of
    /// rank `r`, the ranges in rank order). On this communicator's stream,
    /// after the shard's copy: this rank's range sent to every peer and
    /// each peer's received into its range (`ncclSend`/`ncclRecv` in one
    /// group; NCCL only moves bytes, so the param has the bits a gather
    /// on the host gives). The upload comes back with the exchange's
    /// event in place of the copy's ([`PendingUpload::is_gathered`]), and
    /// a timing event for the span of the collective stream's work. Every
    /// rank calls it for the same params in the same order. On an error
    /// after the group `up` is leaked (see "Buffers in flight").
    pub fn gather(
        &self,
        dev: &Device,
        up: PendingUpload,
        counts: &[usize],
    ) -> Result<(PendingUpload, Option<CudaEvent>)> {
        self.check_usable("ncclSend/ncclRecv (a param's gather)")?;
        let (me, world) = (self.rank, self.world);
        let numel = up.crossed.as_ref().map_or(0, DevBuf::len);
        if counts.len() != world || counts.iter().sum::<usize>() != numel {
            return Err(GpuError::Shape {
                kernel: "gather".into(),
                detail: format!("a param of {numel} elements cut as {counts:?} for {world} ranks"),
            });
        }
        let Some(copied) = up.event.as_ref() else {
            return Err(shape("an upload without its event".into()));
        };
        dev.context()
            .bind_to_thread()
            .map_err(driver_err("cuCtxSetCurrent"))?;
        let s = &self.stream;
        s.wait(copied).map_err(driver_err("cuStreamWaitEvent"))?;
        let began = crate::link::timing(crate::link::EventClock::mark(s));
        let mut up = up;
        let exchanged = {
            let h = self.handle.lock().unwrap_or_else(|p| p.into_inner());
            match &mut up.crossed {
                Some(DevBuf::F32(b)) => exchange(&h.comm, b, counts, me),
                Some(DevBuf::Bf16(b)) => exchange(&h.comm, b, counts, me),
                Some(DevBuf::F16(b)) => exchange(&h.comm, b, counts, me),
                None => Err(shape("an upload without its buffer".into())),
            }
        }
        .and_then(|()| s.record_event(None).map_err(driver_err("cuEventRecord")));
        match exchanged {
            Ok(done) => {
                up.event = Some(done);
                up.gathered = true;
                Ok((up, began))
            }
            Err(e) => {
                // NCCL's work may wait for a peer for ever: the buffers
                // are neither waited for nor freed under it.
                std::mem::forget(up);
                self.set_broken();
                Err(e)
            }
        }
    }
}

/// One group of `ncclSend`s of this rank's range of `buf` to every peer
/// and `ncclRecv`s of each peer's range from it (`counts[r]` elements of
/// rank `r`, the ranges in rank order). Ranges of no elements are
/// skipped: the counts are the same on every rank, so the matching
/// receive or send is skipped there too.
fn exchange<T: Elem + cudarc::nccl::NcclType>(
    comm: &cudarc::nccl::Comm,
    buf: &mut DeviceBuffer<T>,
    counts: &[usize],
    me: usize,
) -> Result<()> {
    group_start().map_err(nccl_err("ncclGroupStart"))?;
    let sent = exchange_calls(comm, buf, counts, me);
    let ended = group_end().map_err(nccl_err("ncclGroupEnd"));
    sent?;
    ended.map(|_| ())
}

/// [`exchange`]'s sends and receives, inside a group its caller opened:
/// all are made, and the first error returned.
fn exchange_calls<T: Elem + cudarc::nccl::NcclType>(
    comm: &cudarc::nccl::Comm,
    buf: &mut DeviceBuffer<T>,
    counts: &[usize],
    me: usize,
) -> Result<()> {
    let from = offsets(counts);
    let mut first_error = None;
    for p in (0..counts.len()).filter(|&p| p != me) {
        if counts[me] > 0 {
            let view = buf.slice().slice(from[me]..from[me] + counts[me]);
            if let Err(e) = comm.send(&view, p as i32) {
                first_error.get_or_insert(nccl_err("ncclSend")(e));
            }
        }
        if counts[p] > 0 {
            let mut view = buf.slice_mut().slice_mut(from[p]..from[p] + counts[p]);
            if let Err(e) = comm.recv(&mut view, p as i32) {
                first_error.get_or_insert(nccl_err("ncclRecv")(e));
            }
        }
    }
    first_error.map_or(Ok(()), Err)
}

/// `add_chunks_T` on `stream`: `out = acc (or +0.0) + chunk 0 + chunk 1 +
/// ...`, each chunk element widened exactly from `T`, `chunks` holding
/// `world` chunks of `out.len()` elements.
pub fn add_chunks_on<T: Elem>(
    dev: &Device,
    stream: &Arc<CudaStream>,
    out: &mut DeviceBuffer<f32>,
    acc: Option<&DeviceBuffer<f32>>,
    chunks: &DeviceBuffer<T>,
    world: usize,
) -> Result<()> {
    let k = format!("add_chunks_{}", T::SUFFIX);
    let n = out.len();
    if chunks.len() != n * world || acc.is_some_and(|a| a.len() != n) {
        return Err(GpuError::Shape {
            kernel: k,
            detail: format!(
                "{} chunk elements for {world} chunks of {n}, running sums of {:?}",
                chunks.len(),
                acc.map(DeviceBuffer::len)
            ),
        });
    }
    if n == 0 {
        return Ok(());
    }
    let world_i32 = i32::try_from(world).map_err(|_| GpuError::Shape {
        kernel: k.clone(),
        detail: format!("{world} ranks"),
    })?;
    let n64 = n as i64;
    let null = 0u64;
    let mut a = stream.launch_builder(dev.function(&k)?);
    a.arg(out.slice_mut());
    match acc {
        Some(b) => a.arg(b.slice()),
        None => a.arg(&null),
    };
    a.arg(chunks.slice());
    a.arg(&n64);
    a.arg(&world_i32);
    let cfg = crate::ops::per_item(n);
    // SAFETY: the arguments are add_chunks_T's (layout.cu): the fp32
    // output of n elements, the running sums of n (or null), the chunks of
    // world · n elements of T (all checked above), then n as long long and
    // world as int.
    unsafe { a.launch(cfg) }.map_err(|e| GpuError::Driver {
        call: "cuLaunchKernel",
        detail: format!("{k}: {e}"),
    })?;
    Ok(())
}

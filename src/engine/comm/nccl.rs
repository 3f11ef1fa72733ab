//! [`NcclComm`]: the [`Comm`] collectives over NCCL (feature `gpu`), one
//! process per rank and one GPU per rank.
//!
//! # What it is, honestly
//!
//! The engine's collectives work on host memory: the param store gathers
//! shards into host tensors (which the device tier then uploads, with
//! `--device cuda`), and gradients are reduce-scattered into the host
//! optimizer's accumulators. So every collective **stages host buffers
//! through the device**: host → device copy, the NCCL call on the rank's
//! stream, device → host copy, synchronise. That is correct and exercises
//! NCCL (NVLink, InfiniBand, the GPUDirect paths NCCL picks) but pays two
//! PCIe copies per collective. The copies go through one pinned host
//! buffer and NCCL sends from and receives into device buffers, all kept
//! between calls (`Staging`), in rounds of at most [`STAGING_BYTES`] of
//! all ranks' data ([`round_bytes`] each; beyond 64 ranks, 1 MiB each),
//! so the staging is bounded (that much pinned, up to twice on the
//! device) whatever a collective's size; a failed round poisons it. Before, each call allocated its device buffers (one
//! zeroed) and copied from and to pageable memory: an all-gather measured
//! 0.555 GB/s on one H200; the pinned path has not run on a GPU yet. The
//! engine calls
//! it once per unit (its params' gather, its gradients' reduce-scatter),
//! not once per param. With the device tier on the GPUs, a unit's
//! gradients do not come through here (but for a unit with a tied param,
//! whose sum spans two units): they are reduce-scattered on the GPUs'
//! buffers (`tierzero_gpu::collective::DeviceComm`, see
//! `engine::device::cuda::device_collectives`). Not built: the params'
//! gather on the GPUs' buffers (a param's shard uploaded, gathered on the
//! device), which would skip both copies for them.
//!
//! # Design
//!
//! * **One CUDA thread.** A guarded thread ([`crate::gpu::spawn_guarded`])
//!   creates the CUDA context, the stream and the NCCL communicator and
//!   makes every CUDA/NCCL call; [`NcclComm`] holds channels to it. NCCL's
//!   communicator is a raw handle (not `Send`), the context is bound per
//!   thread, and cudarc panics when a library is missing: a thread that owns
//!   everything solves all three without `unsafe` (the same shape as
//!   `mpi.rs`). A mutex serialises callers, so collectives are issued in
//!   call order.
//! * **Deterministic, as [`Comm`] requires.** NCCL never reduces anything
//!   here. [`Comm::all_gather_bytes`] pads every shard to the largest count
//!   and runs `ncclAllGather` on bytes (pure data movement), then drops the
//!   padding on the host. [`Comm::reduce_scatter_add_f32`] is an
//!   all-to-all of variable chunks (`ncclSend`/`ncclRecv` to every peer in
//!   one `ncclGroupStart`/`End`, the standard NCCL all-to-all; this rank's
//!   own chunk a device copy in the staging), then the host adds the chunks into the
//!   accumulator in rank order 0..N, exactly like `MpiComm`. So NCCL and MPI
//!   runs give the same bits as one rank (invariant 15 in ARCHITECTURE.md).
//!   `ncclReduceScatter`/`ncclAllReduce` would sum in an order of NCCL's
//!   choosing (ring/tree, by topology), so they are not used for gradients.
//!   Scalars are all-gathered (their bytes, `ncclAllGather`) and summed by
//!   the caller in rank order.
//! * **Bootstrap.** Rank 0 makes the `ncclUniqueId`; it reaches the others
//!   through an existing communicator (MPI under `mpirun`) or a TCP
//!   rendezvous (`TIERZERO_NCCL_ADDR`), see `rendezvous.rs`. Every
//!   rank first tries CUDA and NCCL locally and reports whether it could,
//!   so a rank without a driver makes *every* rank fail at once with a
//!   clear error instead of leaving them in `ncclCommInitRank`.
//! * **Without a driver** [`NcclComm::new`] returns
//!   [`GpuError::DriverMissing`] (never a panic), without NCCL
//!   [`GpuError::NcclMissing`].
//! * **Timeouts.** Every call into the CUDA thread (init and each
//!   collective) waits at most [`NcclOptions::timeout`]; past it the caller
//!   gets [`EngineError::Comm`] and the communicator is marked broken (the
//!   thread is stuck in the driver and is not joined). [`Comm::abort`] ends
//!   the job through the bootstrap communicator when there is one
//!   (`MPI_Abort`), else exits this process; peers of a TCP-bootstrapped job
//!   then stop at their own timeout.
//! * One rank per GPU: NCCL refuses two ranks of one communicator on the
//!   same device ("Duplicate GPU detected").

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DriverError, PinnedHostSlice};
use cudarc::nccl::result::{group_end, group_start};

use crate::engine::comm::owner::{CallFailure, OwnerThread};
use crate::engine::comm::rendezvous::{self, ID_BYTES};
use crate::engine::comm::{add_chunks_in_rank_order, check_counts, Comm, RoundPieces};
use crate::engine::{EngineError, Result};
use crate::gpu::imp::{device_count, driver_error, nccl_error, nccl_version};
use crate::gpu::{
    classify_panic, panic_message, spawn_guarded, DeviceChoice, GpuError, NcclVersion,
};

/// How the ranks find each other.
#[derive(Debug, Clone)]
pub enum Bootstrap {
    /// Through an existing communicator (e.g. `MpiComm`): rank and world
    /// are its own. It is kept, and [`Comm::abort`] goes through it.
    Comm(Arc<dyn Comm>),
    /// A TCP rendezvous at `addr` (`host:port` of rank 0).
    Tcp {
        /// Where rank 0 listens.
        addr: String,
        /// This rank.
        rank: usize,
        /// Ranks.
        world: usize,
    },
}

/// How to build an [`NcclComm`].
#[derive(Debug, Clone)]
pub struct NcclOptions {
    /// Which GPU.
    pub device: DeviceChoice,
    /// This process's index on its node (for [`DeviceChoice::Auto`]).
    pub local_rank: usize,
    /// Longest wait of any call (init, rendezvous, each collective).
    pub timeout: Duration,
    /// How the ranks find each other.
    pub bootstrap: Bootstrap,
}

/// Work for the CUDA thread.
#[derive(Debug)]
enum Op {
    Init(Box<[u8; ID_BYTES]>),
    GatherBytes(Vec<u8>),
    AllToAllF32 { full: Vec<f32>, counts: Vec<usize> },
    GatherF64(Vec<f64>),
    Barrier,
}

impl Op {
    fn name(&self) -> &'static str {
        match self {
            Op::Init(_) => "ncclCommInitRank",
            Op::GatherBytes(_) => "all-gather",
            Op::AllToAllF32 { .. } => "reduce-scatter (all-to-all)",
            Op::GatherF64(_) => "all-gather of scalars",
            Op::Barrier => "barrier",
        }
    }
}

#[derive(Debug)]
enum Reply {
    Done,
    Bytes(Vec<u8>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    Failed(GpuError),
}

/// What the CUDA thread reports once CUDA and NCCL are loaded.
#[derive(Debug)]
struct Ready {
    ordinal: usize,
    nccl: NcclVersion,
    id: Option<Box<[u8; ID_BYTES]>>,
}

/// N ranks over NCCL (see the module docs).
#[derive(Debug)]
pub struct NcclComm {
    rank: usize,
    world: usize,
    ordinal: usize,
    nccl: NcclVersion,
    owner: OwnerThread<Op, Reply>,
    bootstrap: Option<Arc<dyn Comm>>,
}

fn drv(op: &'static str) -> impl Fn(DriverError) -> GpuError {
    move |e| driver_error(op, &e)
}

fn nccl(op: &'static str) -> impl Fn(cudarc::nccl::result::NcclError) -> GpuError {
    move |e| nccl_error(op, &e)
}

/// The CUDA thread's state once NCCL is up.
struct Gpu {
    stream: Arc<CudaStream>,
    comm: cudarc::nccl::Comm,
    rank: usize,
    world: usize,
    /// The staging every collective crosses through (this thread's own).
    staging: std::cell::RefCell<Staging>,
}

/// Bytes of all ranks' data a collective moves per round, at most (up to
/// 64 ranks; beyond, 1 MiB a rank): the staging holds this much pinned
/// and up to twice on the device, whatever the collective's size
/// ([`round_bytes`]).
const STAGING_BYTES: usize = 64 << 20;

/// Bytes of each rank's data moved per round (an all-gather's slice, an
/// all-to-all's chunk for each peer): [`STAGING_BYTES`] shared among the
/// ranks, from 1 MiB (many ranks) to 16 MiB (up to four).
fn round_bytes(world: usize) -> usize {
    (STAGING_BYTES / world.max(1)).clamp(1 << 20, 16 << 20)
}

/// What the collectives stage through, kept between calls and grown to
/// the largest round (never shrunk; at most [`round_bytes`] × ranks
/// each): a pinned host buffer (so both copies are the copy
/// engine's DMA, not the driver's pageable path) and the device buffers
/// NCCL sends from and receives into (so no call allocates device memory,
/// nor zeroes it). One round at a time, each ending with the stream
/// synchronised, so nothing is in flight between rounds.
/// After a failed round the staging is poisoned: a copy or an NCCL
/// kernel may still be in flight on it (waiting for a peer, for ever), so
/// it is neither waited for, nor freed, nor used again, and every later
/// collective fails at once.
#[derive(Default)]
struct Staging {
    host: Option<PinnedHostSlice<u8>>,
    send: Option<CudaSlice<u8>>,
    recv: Option<CudaSlice<u8>>,
    poisoned: bool,
}

/// `bytes` (a whole number of `T`s, any alignment) as `T`s.
fn values_of<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
    let mut v = vec![T::zeroed(); bytes.len() / std::mem::size_of::<T>()];
    bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(bytes);
    v
}

/// Bytes of pinned staging (page-aligned, a whole number of f32s) as
/// f32s.
fn as_f32(bytes: &mut [u8]) -> std::result::Result<&mut [f32], GpuError> {
    let len = bytes.len();
    bytemuck::try_cast_slice_mut(bytes).map_err(|e| GpuError::Driver {
        op: "pinned staging",
        reason: format!("{len} bytes as f32s: {e:?}"),
    })
}

/// The pinned buffer's bytes, to write (nothing is in flight between
/// calls, and within one the stream orders its copies).
fn pinned(p: &mut PinnedHostSlice<u8>) -> std::result::Result<&mut [u8], GpuError> {
    p.as_mut_slice().map_err(drv("pinned staging"))
}

/// The pinned buffer's bytes, to read or to copy from.
fn pinned_ref(p: &PinnedHostSlice<u8>) -> std::result::Result<&[u8], GpuError> {
    p.as_slice().map_err(drv("pinned staging"))
}

/// `slot`'s buffer, replaced by `make(len)` when it holds fewer than
/// `len` bytes (`len_of`), the old one dropped first.
fn grown_with<B>(
    slot: &mut Option<B>,
    len: usize,
    len_of: impl Fn(&B) -> usize,
    make: impl FnOnce(usize) -> std::result::Result<B, GpuError>,
) -> std::result::Result<&mut B, GpuError> {
    if slot.as_ref().is_none_or(|b| len_of(b) < len) {
        *slot = None;
        *slot = Some(make(len.max(1))?);
    }
    slot.as_mut().ok_or_else(|| GpuError::Driver {
        op: "staging",
        reason: "a buffer just allocated is gone".into(),
    })
}

/// `slot`'s device buffer, grown to at least `len` bytes (at least one).
fn grown<'a>(
    slot: &'a mut Option<CudaSlice<u8>>,
    s: &Arc<CudaStream>,
    len: usize,
) -> std::result::Result<&'a mut CudaSlice<u8>, GpuError> {
    grown_with(slot, len, CudaSlice::len, |n| {
        s.alloc_zeros::<u8>(n).map_err(drv("device allocation"))
    })
}

/// `slot`'s pinned host buffer, grown to at least `len` bytes.
fn grown_host<'a>(
    slot: &'a mut Option<PinnedHostSlice<u8>>,
    s: &Arc<CudaStream>,
    len: usize,
) -> std::result::Result<&'a mut PinnedHostSlice<u8>, GpuError> {
    grown_with(slot, len, PinnedHostSlice::len, |n| {
        tierzero_gpu::link::pinned_bytes(s.context(), n).map_err(|e| GpuError::Driver {
            op: "pinned staging",
            reason: e.to_string(),
        })
    })
}

impl Gpu {
    /// Runs `f` (one round's copies and NCCL calls on the stream, then
    /// its synchronisation). On an error the staging is poisoned (see
    /// [`Staging`]): not waited for (an NCCL kernel whose peer is gone
    /// never ends), its buffers leaked rather than freed under a copy.
    fn staged<T>(
        &self,
        f: impl FnOnce(&mut Staging) -> std::result::Result<T, GpuError>,
    ) -> std::result::Result<T, GpuError> {
        let mut st = self.staging.borrow_mut();
        if st.poisoned {
            return Err(GpuError::Nccl {
                op: "staging",
                reason: "an earlier collective failed on this rank; its copies may still be in \
                         flight, so no other runs"
                    .into(),
            });
        }
        let r = f(&mut st);
        if r.is_err() {
            std::mem::forget(std::mem::take(&mut *st));
            st.poisoned = true;
        }
        r
    }

    /// `ncclAllGather` of equal-length host byte slices (staged through
    /// pinned memory and the device, [`round_bytes`] of each rank's at a
    /// time): rank r's slice at `r · local.len()`.
    fn gather(&self, local: &[u8]) -> std::result::Result<Vec<u8>, GpuError> {
        let (n, world, s) = (local.len(), self.world, &self.stream);
        let round = round_bytes(world);
        let mut out = vec![0u8; n * world];
        // The same rounds on every rank: `n` and `world` are.
        for from in (0..n).step_by(round) {
            let len = (n - from).min(round);
            let got = self.staged(|st| {
                let host = grown_host(&mut st.host, s, len * world)?;
                let send = grown(&mut st.send, s, len)?;
                let recv = grown(&mut st.recv, s, len * world)?;
                pinned(host)?[..len].copy_from_slice(&local[from..from + len]);
                s.memcpy_htod(&pinned_ref(host)?[..len], &mut send.slice_mut(..len))
                    .map_err(drv("copy to device"))?;
                self.comm
                    .all_gather(&send.slice(..len), &mut recv.slice_mut(..len * world))
                    .map_err(nccl("ncclAllGather"))?;
                s.memcpy_dtoh(
                    &recv.slice(..len * world),
                    &mut pinned(host)?[..len * world],
                )
                .map_err(drv("copy to host"))?;
                s.synchronize().map_err(drv("stream synchronize"))?;
                for r in 0..world {
                    out[r * n + from..r * n + from + len]
                        .copy_from_slice(&pinned_ref(host)?[r * len..(r + 1) * len]);
                }
                Ok(())
            });
            got?;
        }
        Ok(out)
    }

    /// Every rank's chunk for this rank, in rank order (`world × mine`),
    /// [`round_bytes`] of each peer's chunk at a time
    /// ([`RoundPieces`]: the same rounds on every rank, and in each a
    /// piece of none here is a piece of none there, both skipped).
    fn all_to_all(
        &self,
        full: &[f32],
        counts: &[usize],
    ) -> std::result::Result<Vec<f32>, GpuError> {
        const F32: usize = std::mem::size_of::<f32>();
        let (me, world, s) = (self.rank, self.world, &self.stream);
        let round = round_bytes(world) / F32;
        let mine = counts[me];
        let most = counts.iter().copied().max().unwrap_or(0);
        let mut out = vec![0f32; mine * world];
        for from in (0..most).step_by(round) {
            let pieces = RoundPieces::of(counts, from, round);
            let (n, got) = (pieces.total(), pieces.sent[me]);
            let (n_bytes, got_bytes) = (n * F32, got * F32);
            let done = self.staged(|st| {
                let host = grown_host(&mut st.host, s, n_bytes.max(got_bytes * world))?;
                let send = grown(&mut st.send, s, n_bytes)?;
                let recv = grown(&mut st.recv, s, got_bytes * world)?;
                // Pinned memory is page-aligned: its bytes are f32s.
                pieces.pack(full, counts, from, as_f32(&mut pinned(host)?[..n_bytes])?);
                if n > 0 {
                    s.memcpy_htod(
                        &pinned_ref(host)?[..n_bytes],
                        &mut send.slice_mut(..n_bytes),
                    )
                    .map_err(drv("copy to device"))?;
                }
                if got > 0 {
                    let at = pieces.put[me] * F32;
                    let own = send.slice(at..at + got_bytes);
                    let mut dst = recv.slice_mut(me * got_bytes..(me + 1) * got_bytes);
                    s.memcpy_dtod(&own, &mut dst).map_err(drv("device copy"))?;
                }
                group_start().map_err(nccl("ncclGroupStart"))?;
                let mut first_error = None;
                for p in (0..world).filter(|&p| p != me) {
                    if pieces.sent[p] > 0 {
                        let at = pieces.put[p] * F32;
                        let view = send.slice(at..at + pieces.sent[p] * F32);
                        if let Err(e) = self.comm.send(&view, p as i32) {
                            first_error.get_or_insert(nccl_error("ncclSend", &e));
                        }
                    }
                    if got > 0 {
                        let mut view = recv.slice_mut(p * got_bytes..(p + 1) * got_bytes);
                        if let Err(e) = self.comm.recv(&mut view, p as i32) {
                            first_error.get_or_insert(nccl_error("ncclRecv", &e));
                        }
                    }
                }
                let ended = group_end().map_err(nccl("ncclGroupEnd"));
                if let Some(e) = first_error {
                    return Err(e);
                }
                ended?;
                let all = got_bytes * world;
                if got > 0 {
                    s.memcpy_dtoh(&recv.slice(..all), &mut pinned(host)?[..all])
                        .map_err(drv("copy to host"))?;
                }
                s.synchronize().map_err(drv("stream synchronize"))?;
                let received = as_f32(&mut pinned(host)?[..all])?;
                RoundPieces::unpack(received, got, mine, from, &mut out);
                Ok(())
            });
            done?;
        }
        Ok(out)
    }

    fn serve(&self, op: Op) -> Reply {
        let r = match op {
            Op::Init(_) => Err(GpuError::Nccl {
                op: "ncclCommInitRank",
                reason: "initialised twice".into(),
            }),
            Op::GatherBytes(padded) => self.gather(&padded).map(Reply::Bytes),
            Op::AllToAllF32 { full, counts } => self.all_to_all(&full, &counts).map(Reply::F32),
            Op::GatherF64(v) => self
                .gather(bytemuck::cast_slice(&v))
                .map(|b| Reply::F64(values_of(&b))),
            Op::Barrier => self.gather(&[1u8]).map(|_| Reply::Done),
        };
        r.unwrap_or_else(Reply::Failed)
    }
}

/// The CUDA thread: loads CUDA and NCCL, reports, waits for the id, builds
/// the communicator, then serves collectives until the channel closes.
fn cuda_thread(
    rank: usize,
    world: usize,
    device: DeviceChoice,
    local_rank: usize,
    ready: &Sender<std::result::Result<Ready, GpuError>>,
    ops: &Receiver<Op>,
    replies: &Sender<Reply>,
) {
    let setup = (|| {
        let count = device_count()?;
        let ordinal = device.resolve(count, local_rank)?;
        let ctx = CudaContext::new(ordinal).map_err(drv("context"))?;
        let stream = ctx.new_stream().map_err(drv("stream"))?;
        let version = nccl_version()?;
        let id = if rank == 0 {
            let id = cudarc::nccl::Id::new().map_err(nccl("ncclGetUniqueId"))?;
            // c_char is i8 or u8 by platform: the bytes are opaque.
            Some(Box::new(id.internal().map(|c| c as u8)))
        } else {
            None
        };
        Ok((
            stream,
            Ready {
                ordinal,
                nccl: version,
                id,
            },
        ))
    })();
    let (stream, ordinal) = match setup {
        Ok((stream, r)) => {
            let ordinal = r.ordinal;
            if ready.send(Ok(r)).is_err() {
                return;
            }
            (stream, ordinal)
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let Ok(Op::Init(id)) = ops.recv() else {
        return;
    };
    let id = cudarc::nccl::Id::uninit(id.map(|b| b as _));
    let gpu = match cudarc::nccl::Comm::from_rank(stream.clone(), rank, world, id) {
        Ok(comm) => Gpu {
            stream,
            comm,
            rank,
            world,
            staging: std::cell::RefCell::new(Staging::default()),
        },
        Err(e) => {
            let _ = replies.send(Reply::Failed(init_error(ordinal, &e)));
            return;
        }
    };
    if replies.send(Reply::Done).is_err() {
        return;
    }
    while let Ok(op) = ops.recv() {
        if replies.send(gpu.serve(op)).is_err() {
            break;
        }
    }
}

/// Why `ncclCommInitRank` failed: `ncclInvalidUsage` (two ranks on one
/// GPU, seen on a one-GPU machine with NCCL 2.28) is the user's to fix.
fn init_error(ordinal: usize, e: &cudarc::nccl::result::NcclError) -> GpuError {
    if e.0 == cudarc::nccl::sys::ncclResult_t::ncclInvalidUsage {
        GpuError::InitRefused { ordinal }
    } else {
        nccl_error("ncclCommInitRank", e)
    }
}

/// Joins a CUDA thread that has ended and names why it did.
fn death(handle: Option<JoinHandle<()>>, op: &'static str) -> GpuError {
    match handle.map(JoinHandle::join) {
        Some(Err(payload)) => classify_panic(op, panic_message(payload.as_ref())),
        _ => GpuError::Panicked {
            op,
            message: "the CUDA thread ended".into(),
        },
    }
}

impl NcclComm {
    /// Loads CUDA and NCCL on a thread of its own, hands rank 0's NCCL id to
    /// every rank, and builds the communicator. Without a driver:
    /// [`GpuError::DriverMissing`]; if another rank failed:
    /// [`GpuError::PeerFailed`].
    pub fn new(opts: NcclOptions) -> std::result::Result<NcclComm, GpuError> {
        let (rank, world, keep) = match &opts.bootstrap {
            Bootstrap::Comm(c) => (c.rank(), c.world_size(), Some(c.clone())),
            Bootstrap::Tcp { rank, world, .. } => (*rank, *world, None),
        };
        if world == 0 || rank >= world || i32::try_from(world).is_err() {
            return Err(GpuError::Rendezvous(EngineError::internal(format!(
                "NCCL: rank {rank} of {world} ranks"
            ))));
        }
        let (ready_tx, ready_rx) = bounded(1);
        let (op_tx, op_rx) = bounded::<Op>(1);
        let (reply_tx, reply_rx) = bounded::<Reply>(1);
        let (device, local_rank) = (opts.device, opts.local_rank);
        let thread = spawn_guarded("nccl", move || {
            cuda_thread(
                rank, world, device, local_rank, &ready_tx, &op_rx, &reply_tx,
            );
        })?;
        let mut thread = Some(thread);
        let local = match ready_rx.recv_timeout(opts.timeout) {
            Ok(r) => r,
            Err(RecvTimeoutError::Disconnected) => Err(death(thread.take(), "initialisation")),
            Err(RecvTimeoutError::Timeout) => {
                // Stuck in the driver: not joined.
                thread = None;
                Err(GpuError::Timeout {
                    op: "initialisation",
                    seconds: opts.timeout.as_secs_f64(),
                })
            }
        };
        // Every rank takes part in the exchange, ready or not (see
        // `rendezvous`).
        let id = local.as_ref().ok().and_then(|r| r.id.as_deref());
        let exchange = match &opts.bootstrap {
            Bootstrap::Comm(c) => rendezvous::comm_exchange(c.as_ref(), local.is_ok(), id),
            Bootstrap::Tcp { addr, .. } => {
                rendezvous::tcp_exchange(addr, rank, world, local.is_ok(), id, opts.timeout)
            }
        };
        let finish = |thread: Option<JoinHandle<()>>, op_tx: Sender<Op>| {
            drop(op_tx);
            if let Some(t) = thread {
                let _ = t.join();
            }
        };
        let ready = match local {
            Ok(r) => r,
            Err(e) => {
                finish(thread, op_tx);
                return Err(e);
            }
        };
        let exchange = match exchange {
            Ok(x) if x.failed_ranks.is_empty() => x,
            Ok(x) => {
                finish(thread, op_tx);
                return Err(GpuError::PeerFailed {
                    ranks: x.failed_ranks,
                });
            }
            Err(e) => {
                finish(thread, op_tx);
                return Err(GpuError::Rendezvous(e));
            }
        };
        let comm = NcclComm {
            rank,
            world,
            ordinal: ready.ordinal,
            nccl: ready.nccl,
            owner: OwnerThread::new(op_tx, reply_rx, thread, opts.timeout),
            bootstrap: keep,
        };
        match comm.call(Op::Init(Box::new(exchange.id))) {
            Ok(Reply::Done) => Ok(comm),
            Ok(Reply::Failed(e)) => Err(e),
            Ok(other) => Err(GpuError::Nccl {
                op: "ncclCommInitRank",
                reason: format!("unexpected reply {other:?}"),
            }),
            Err(CallError::Timeout(seconds)) => Err(GpuError::Timeout {
                op: "ncclCommInitRank (waiting for every rank)",
                seconds,
            }),
            Err(CallError::Gpu(e)) => Err(e),
        }
    }

    /// The CUDA device this rank uses.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The NCCL library's version.
    pub fn nccl_version(&self) -> NcclVersion {
        self.nccl
    }

    /// Runs one operation on the CUDA thread, waiting at most the timeout.
    fn call(&self, op: Op) -> std::result::Result<Reply, CallError> {
        let name = op.name();
        let nccl = |reason: &str| {
            CallError::Gpu(GpuError::Nccl {
                op: name,
                reason: reason.into(),
            })
        };
        match self.owner.call(op) {
            Ok(Reply::Failed(e)) => {
                // NCCL communicators do not recover from a failed call.
                self.owner.mark_broken();
                Ok(Reply::Failed(e))
            }
            Ok(r) => Ok(r),
            Err(CallFailure::Broken) => {
                Err(nccl("an earlier call failed; the communicator is unusable"))
            }
            Err(CallFailure::Poisoned) => Err(nccl("the communicator lock is poisoned")),
            Err(CallFailure::ShutDown) => Err(nccl("the communicator is shut down")),
            Err(CallFailure::Ended) => Err(CallError::Gpu(death(self.owner.take_thread(), name))),
            Err(CallFailure::Timeout(waited_s)) => Err(CallError::Timeout(waited_s)),
        }
    }

    /// A collective: its reply, or the engine's error.
    fn collective(&self, op: Op) -> Result<Reply> {
        let name = op.name();
        let e = |reason: String| EngineError::Comm {
            rank: self.rank,
            world: self.world,
            op: name,
            reason,
        };
        match self.call(op) {
            Ok(Reply::Failed(g)) => Err(e(g.to_string())),
            Ok(r) => Ok(r),
            Err(CallError::Timeout(s)) => Err(e(format!(
                "got no answer from the other ranks within {s:.0} s: a rank has died or hangs, \
                 or is still starting (at start-up: encoding a corpus its node has no token \
                 cache of); stopping (set TIERZERO_COMM_TIMEOUT_S to wait longer)"
            ))),
            Err(CallError::Gpu(g)) => Err(e(g.to_string())),
        }
    }
}

#[derive(Debug)]
enum CallError {
    Timeout(f64),
    Gpu(GpuError),
}

impl Comm for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn all_gather_bytes(&self, shard: &[u8], counts_bytes: &[usize], out: &mut [u8]) -> Result<()> {
        check_counts(
            "all_gather",
            self.rank,
            counts_bytes,
            shard.len(),
            out.len(),
        )?;
        if counts_bytes.len() != self.world {
            return Err(EngineError::internal("all_gather: one count per rank"));
        }
        let max = counts_bytes.iter().copied().max().unwrap_or(0);
        if max == 0 {
            // Every count is 0 on every rank (counts are the same
            // everywhere): nothing to move.
            return Ok(());
        }
        let mut padded = vec![0u8; max];
        padded[..shard.len()].copy_from_slice(shard);
        let bytes = match self.collective(Op::GatherBytes(padded))? {
            Reply::Bytes(b) if b.len() == max * self.world => b,
            other => {
                return Err(EngineError::internal(format!(
                    "all_gather: unexpected reply {other:?}"
                )))
            }
        };
        let mut at = 0;
        for (r, &c) in counts_bytes.iter().enumerate() {
            out[at..at + c].copy_from_slice(&bytes[r * max..r * max + c]);
            at += c;
        }
        Ok(())
    }

    fn reduce_scatter_add_f32(
        &self,
        full: &[f32],
        counts_numel: &[usize],
        acc: &mut [f32],
    ) -> Result<()> {
        check_counts(
            "reduce_scatter",
            self.rank,
            counts_numel,
            acc.len(),
            full.len(),
        )?;
        if counts_numel.len() != self.world {
            return Err(EngineError::internal("reduce_scatter: one count per rank"));
        }
        let chunks = match self.collective(Op::AllToAllF32 {
            full: full.to_vec(),
            counts: counts_numel.to_vec(),
        })? {
            Reply::F32(v) if v.len() == acc.len() * self.world => v,
            other => {
                return Err(EngineError::internal(format!(
                    "reduce_scatter: unexpected reply {other:?}"
                )))
            }
        };
        add_chunks_in_rank_order(acc, &chunks);
        Ok(())
    }

    fn all_gather_f64(&self, local: &[f64], out: &mut [f64]) -> Result<()> {
        if out.len() != local.len() * self.world {
            return Err(EngineError::internal("all_gather_f64: lengths"));
        }
        if local.is_empty() {
            return Ok(());
        }
        match self.collective(Op::GatherF64(local.to_vec()))? {
            Reply::F64(v) if v.len() == out.len() => {
                out.copy_from_slice(&v);
                Ok(())
            }
            other => Err(EngineError::internal(format!(
                "all_gather_f64: unexpected reply {other:?}"
            ))),
        }
    }

    fn staging_bytes(&self) -> Option<crate::engine::comm::CommStaging> {
        // A round's pieces: `ranks ×` the round pinned (what comes back),
        // as much received on the device plus at most as much sent.
        let most = (round_bytes(self.world) * self.world) as u64;
        Some(crate::engine::comm::CommStaging {
            pinned_bytes: most,
            device_bytes: 2 * most,
        })
    }

    fn barrier(&self) -> Result<()> {
        match self.collective(Op::Barrier)? {
            Reply::Done => Ok(()),
            other => Err(EngineError::internal(format!(
                "barrier: unexpected reply {other:?}"
            ))),
        }
    }

    fn abort(&self, code: i32) {
        if let Some(b) = &self.bootstrap {
            // MPI_Abort: ends every rank of the job.
            b.abort(code);
        }
        std::process::exit(code);
    }
}

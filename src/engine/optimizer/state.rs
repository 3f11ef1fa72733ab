//! Optimizer state: fp32 master weights and Adam moments per sub-group, in
//! host memory or on NVMe, and the pipelined step.
//!
//! # Tiers
//!
//! `offload_optimizer.device = none | cpu` keeps `master`, `m` and `v` of
//! every sub-group in host `Vec<f32>`s (the CPU optimizer runs on the host
//! either way; with a CPU compute device "device memory" is host memory).
//! `nvme` keeps three extents per sub-group (four with gradient spill) and
//! streams them through
//! pinned buffers of `largest sub-group × 4` bytes.
//!
//! # Moment dtype
//!
//! `m` and `v` are fp32 or bf16 ([`MomentDtype`], fixed at
//! [`OptimizerState::new`]); the master is always fp32. With bf16 the
//! memory tier holds `Vec<bf16>` moments and the NVMe extents of `m` and
//! `v` are `numel × 2` bytes ([`state_bytes`]), so a step moves 8 bytes per
//! element each way instead of 12; the pinned buffers keep one size (the
//! master's), a moment using the front half of its buffer. The kernel
//! steps either in place ([`Moments::Bf16`]'s rounding). The interface
//! stays fp32: [`OptimizerState::group_states`] widens the moments (exact)
//! and [`OptimizerState::load_group`] rounds them as the kernel stores
//! them, so values that came out of bf16 state go back bit for bit.
//!
//! # Pipeline (NVMe)
//!
//! ```text
//!   read engine :  read(i+1) ─────────┐
//!   compute     :        step(i) ──────┼─ Adam on the pinned buffers in place
//!   write engine:  write(i-1) ────────┘
//! ```
//!
//! A sub-group's three buffers are taken when its read is issued, stepped
//! in place, and handed to the write engine; they return to the pool when
//! that write is retired. Reads and writes go through **separate engines**
//! (rings), so a long write queue never delays the next read. In flight at
//! once: reads of up to `read_ahead` sub-groups (1 with `pipeline_read`),
//! the step, and up to `write_behind` writes (1 with `pipeline_write`):
//! `(3 + spill) × (1 + read_ahead + write_behind)` buffers (`spill` 1 when
//! final gradients spill to NVMe and are read back with the state),
//! checked against the pinned budget at start-up ([`buffers_needed`]), so
//! the pipeline cannot run out of buffers at run time. When the arena holds
//! more buffers than that (`offload_optimizer.buffer_count` above the
//! minimum), `pipeline_read` is on and gradients do not spill (spill writes
//! take buffers of the same pool while backward runs), the extra ones
//! deepen the reads: `read_ahead` becomes
//! `buffers / 3 − 1 − write_behind`, so state reads issued at the start of
//! a step ([`crate::engine::optimizer::worker::Job::Expect`]) run as far ahead as memory
//! allows (DeepSpeed's `PipelinedOptimizerSwapper` asserts
//! at run time instead). Sub-groups must be stepped in the order their
//! reads were issued (FIFO); the trainer does.
//!
//! Reads are **paced**: one sub-group's reads are in flight at a time;
//! the next is issued when they complete ([`OptimizerState::prefetch`]
//! says no until then, and the worker waits on the completion, see
//! `worker.rs`). The read-ahead is for having state ready when its
//! gradient arrives, not for queueing: a parameter read that the compute
//! is waiting for shares the disk with these reads, and would otherwise
//! queue behind the whole read-ahead (12 MiB at the overlap harness's
//! settings) instead of one sub-group. The worker goes further: while
//! param reads are on the disk, it reads ahead only the next sub-group to
//! step, and the rest wait until those reads land (`worker.rs`, `pump`).
//! A finished write's buffers return to the pool when the write is
//! retired: [`OptimizerState::poll_writes`] retires the finished ones
//! without blocking, [`OptimizerState::retire_behind`] blocks until at
//! most `write_behind` remain (called after each step, once the new
//! params are handed on).
//!
//! # Speculative steps
//!
//! With speculation ([`crate::engine::sizing::speculates`]) the NVMe state
//! has a bounded **pool** of spare extents: `pool_slots` sets of three
//! ([`crate::engine::sizing::speculation_pool`]: by default one per
//! NVMe group, as far as the disk's free space allows), each sized for
//! the largest NVMe sub-group. A speculative
//! [`OptimizerState::step`] reads the group's current state as any step
//! does and writes the new state into a free slot (the smallest that
//! fits), so the old state survives; the slot is the group's *pending*
//! state. Then:
//!
//! * [`OptimizerState::commit`] (the speculation held), after every write
//!   has retired: the pending slot becomes the group's current extents and
//!   the group's old extents become a free slot. Extents swap roles, so
//!   the group → extents mapping is per-group state of this struct; a
//!   checkpoint ([`OptimizerState::save_state`]) copies the current
//!   extents, and refuses while any group has a pending slot: it sees only
//!   committed state;
//! * a non-speculative step of a group with a pending slot (its re-step
//!   after a miss) writes the group's current extents in place, as every
//!   non-speculative step does, and returns the slot to the pool;
//! * [`OptimizerState::cancel_reads`] (an overflow) returns every
//!   pending slot.
//!
//! A slot returned while its speculative write may be in flight is taken
//! again only once that write has retired (writes retire in order, so a
//! sequence number per slot says when). A speculative step with no free
//! slot is an error: the trainer speculates at most `pool_slots` groups a
//! step, and every slot is free again by the end of the step's optimizer
//! tail (on a miss, a group's slot is freed when its re-step runs; the
//! next step's speculative steps queue behind that tail's `Flush`).
//! The swap file never outlives the run (checkpoints do), so a kill before
//! the commit leaves the last committed state, the one the last checkpoint
//! copied.
//!
//! # Resident sub-groups
//!
//! With NVMe state, some sub-groups keep their state in host memory
//! anyway (`resident` in [`OptimizerState::new`]): never read, never
//! written, stepped in place like the memory tier. The trainer picks the
//! groups holding the params the next forward needs first
//! (`tierzero.optimizer_resident_bytes`, by default one prefetch bucket's
//! state). Those are the groups backward finishes last, so they are the
//! optimizer's tail: on NVMe, their state writes (and any reads the
//! read-ahead had not reached) ran while the next forward waited for
//! their params, and their state was read back at the very end of the
//! next backward. Kept in memory, the tail is Adam alone, and every step
//! moves `24 bytes × their elements` less. They also need no NVMe extents
//! (nor gradient-spill extents: a resident group's gradient given to
//! [`OptimizerState::spill_grad`] stays in memory until its step). The
//! result is bit-identical: the same kernel on the same values.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tierzero_swap::{Buffer, Engine, Extent, PinnedArena, Ticket};

use crate::engine::layout::SubGroupId;
use crate::engine::optimizer::GradBuf;
use half::bf16;

use crate::engine::sizing::{buffers_needed, state_bytes, SumDtype};
use crate::engine::{EngineError, Result};
use crate::optim::{
    f32_to_bf16_moment_bits, CpuAdam, GradIn, GradScale, LowPrecisionOut, MomentDtype, Moments,
};

#[derive(Debug)]
struct MemGroup {
    master: Vec<f32>,
    moments: MemMoments,
}

/// A memory-tier group's `m` and `v`, in their [`MomentDtype`].
#[derive(Debug)]
enum MemMoments {
    F32 { m: Vec<f32>, v: Vec<f32> },
    Bf16 { m: Vec<bf16>, v: Vec<bf16> },
}

/// `n` copies of `zero`, or an error naming the bytes where the allocator
/// has no room for them (`vec!` aborted the process: a Python caller's
/// state for 2^50 elements ended it with "memory allocation failed").
fn try_filled<T: Clone>(n: usize, zero: T, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| EngineError::Config {
        reason: format!(
            "the optimizer state's {what} of {n} elements ({} bytes) cannot be allocated in host \
             memory; keep the state on NVMe, or step fewer params",
            n as u128 * std::mem::size_of::<T>() as u128
        ),
    })?;
    v.resize(n, zero);
    Ok(v)
}

impl MemMoments {
    fn zeros(n: usize, dtype: MomentDtype) -> Result<Self> {
        Ok(match dtype {
            MomentDtype::F32 => MemMoments::F32 {
                m: try_filled(n, 0.0, "m")?,
                v: try_filled(n, 0.0, "v")?,
            },
            MomentDtype::Bf16 => MemMoments::Bf16 {
                m: try_filled(n, bf16::ZERO, "m")?,
                v: try_filled(n, bf16::ZERO, "v")?,
            },
        })
    }

    fn as_moments(&mut self) -> Moments<'_> {
        match self {
            MemMoments::F32 { m, v } => Moments::F32 { m, v },
            MemMoments::Bf16 { m, v } => Moments::Bf16 { m, v },
        }
    }

    /// Moment `k` (1 `m`, 2 `v`) widened to f32 (exact) into `out`, of
    /// its length.
    fn widen_into(&self, k: usize, out: &mut [f32]) {
        match (self, k) {
            (MemMoments::F32 { m, .. }, 1) => out.copy_from_slice(m),
            (MemMoments::F32 { v, .. }, _) => out.copy_from_slice(v),
            (MemMoments::Bf16 { m, .. }, 1) => {
                out.iter_mut().zip(m).for_each(|(o, x)| *o = x.to_f32())
            }
            (MemMoments::Bf16 { v, .. }, _) => {
                out.iter_mut().zip(v).for_each(|(o, x)| *o = x.to_f32())
            }
        }
    }

    /// Sets both moments from f32 values (rounded as the kernel stores them).
    fn set(&mut self, m_src: &[f32], v_src: &[f32]) {
        match self {
            MemMoments::F32 { m, v } => {
                m.copy_from_slice(m_src);
                v.copy_from_slice(v_src);
            }
            MemMoments::Bf16 { m, v } => {
                narrow_into(m, m_src);
                narrow_into(v, v_src);
            }
        }
    }

    /// Moment `k`'s stored bytes (little-endian).
    fn le_bytes(&self, k: usize) -> std::borrow::Cow<'_, [u8]> {
        use crate::le::bytes as le_bytes;
        match (self, k) {
            (MemMoments::F32 { m, .. }, 1) => le_bytes(m),
            (MemMoments::F32 { v, .. }, _) => le_bytes(v),
            (MemMoments::Bf16 { m, .. }, 1) => le_bytes(m),
            (MemMoments::Bf16 { v, .. }, _) => le_bytes(v),
        }
    }
}

/// f32 values stored as bf16 moments, rounded as the kernel stores them.
fn narrow_into(dst: &mut [bf16], src: &[f32]) {
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = bf16::from_bits(f32_to_bf16_moment_bits(x));
    }
}

/// The NVMe side: two engines over one swap space and one arena.
#[derive(Debug)]
pub struct NvmeOptim {
    /// Reads state.
    pub read: Engine,
    /// Writes state.
    pub write: Engine,
    /// Buffers of `largest sub-group × 4` bytes.
    pub arena: Arc<PinnedArena>,
}

#[derive(Debug)]
struct NvmeState {
    io: NvmeOptim,
    /// The current (committed) state of each sub-group; `None` for a
    /// resident one (its state lives in `mem`).
    extents: Vec<Option<[Extent; 3]>>,
    /// The speculation pool's free slots (see "Speculative steps" in the
    /// module docs).
    pool: Vec<Slot>,
    /// Per sub-group: the slot its speculative step wrote, until commit.
    pending: Vec<Option<Slot>>,
    /// Slots the pool was built with.
    pool_slots: usize,
    /// Sub-groups' state writes issued and retired so far (they retire in
    /// order): a slot whose `last_write` is retired is safe to overwrite.
    writes_issued: u64,
    writes_retired: u64,
    /// Per sub-group: the sequence number of the last state write into its
    /// current extents (0: none queued). A read of its state waits until
    /// that write has retired (reads and writes go through different
    /// rings, so a read issued behind a queued write may see the old
    /// bytes).
    extents_last_write: Vec<u64>,
    grad_extents: Vec<Option<Extent>>,
    /// Per sub-group: its gradient is spilled, in this dtype (as the host
    /// held it: fp32 sums, or bf16 gradients, half the bytes written and
    /// read back), until its step reads it.
    spilled: Vec<Option<SumDtype>>,
    spill_writes: Vec<Option<Ticket>>,
    reading: VecDeque<(SubGroupId, Vec<Ticket>)>,
    writes: VecDeque<Vec<Option<Ticket>>>,
}

/// A speculation pool slot: three extents (master, m, v) and the sequence
/// number of the last state write into them.
#[derive(Debug)]
struct Slot {
    ext: [Extent; 3],
    last_write: u64,
}

/// Counters of the optimizer state I/O.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OptCounters {
    /// Bytes read from NVMe.
    pub nvme_read_bytes: u64,
    /// Bytes written to NVMe.
    pub nvme_written_bytes: u64,
    /// Time waiting on state I/O.
    pub io_wait: Duration,
    /// Time in the Adam kernel.
    pub adam: Duration,
}

/// The speculation pool as the sizing policy decided it
/// (`Sizing::speculation_slots`, `Sizing::speculation_kept_grads`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolSize {
    /// Slots of spare state extents.
    pub slots: usize,
    /// Speculated gradients kept in host memory for a re-step; the others
    /// are spilled.
    pub kept_grads: usize,
}

/// Master weights and moments of this rank's sub-groups.
#[derive(Debug)]
pub struct OptimizerState {
    numel: Vec<usize>,
    /// Per sub-group: its state in host memory (every group without NVMe;
    /// the resident ones with it), else `None` (on NVMe).
    mem: Vec<Option<MemGroup>>,
    /// A resident group's gradient handed to [`OptimizerState::spill_grad`]:
    /// kept here (it has no extent to go to) until its step.
    held: Vec<Option<GradBuf>>,
    nvme: Option<NvmeState>,
    read_ahead: usize,
    write_behind: usize,
    /// [`PoolSize::kept_grads`].
    kept_grads: usize,
    /// How `m` and `v` are stored (see "Moment dtype" in the module docs).
    moments: MomentDtype,
    counters: OptCounters,
}

mod checkpoint;
mod pool;
#[cfg(test)]
mod tests;

/// The extents of an NVMe sub-group.
fn nvme_extents(extents: &[Option<[Extent; 3]>], sg: SubGroupId) -> Result<&[Extent; 3]> {
    extents
        .get(sg.0)
        .and_then(Option::as_ref)
        .ok_or_else(|| EngineError::internal(format!("sub-group {sg:?} has no NVMe extents")))
}

fn as_f32(buf: &mut Buffer, numel: usize) -> Result<&mut [f32]> {
    as_typed(buf, numel)
}

/// The first `numel` elements of a pinned buffer, as `T`.
fn as_typed<T: bytemuck::Pod>(buf: &mut Buffer, numel: usize) -> Result<&mut [T]> {
    let bytes = buf
        .as_mut_slice()
        .get_mut(..numel * std::mem::size_of::<T>())
        .ok_or_else(|| EngineError::internal("optimizer buffer smaller than its sub-group"))?;
    bytemuck::try_cast_slice_mut::<u8, T>(bytes)
        .map_err(|e| EngineError::internal(format!("optimizer buffer cast: {e}")))
}

/// The `m` and `v` buffers of an NVMe group as the kernel's [`Moments`].
fn buffer_moments<'a>(
    m: &'a mut Buffer,
    v: &'a mut Buffer,
    numel: usize,
    dtype: MomentDtype,
) -> Result<Moments<'a>> {
    Ok(match dtype {
        MomentDtype::F32 => Moments::F32 {
            m: as_typed(m, numel)?,
            v: as_typed(v, numel)?,
        },
        MomentDtype::Bf16 => Moments::Bf16 {
            m: as_typed(m, numel)?,
            v: as_typed(v, numel)?,
        },
    })
}

impl OptimizerState {
    /// State for sub-groups of `numel` elements each, in memory (`nvme`
    /// None) or on NVMe, except the groups `resident` marks (see
    /// "Resident sub-groups" in the module docs), which stay in host memory
    /// either way. Initialise every sub-group with
    /// [`OptimizerState::load_group`]. `m` and `v` are stored as `moments`
    /// says (see "Moment dtype" in the module docs).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        numel: Vec<usize>,
        nvme: Option<NvmeOptim>,
        resident: &[bool],
        read_ahead: usize,
        write_behind: usize,
        spill_grads: bool,
        pool: PoolSize,
        moments: MomentDtype,
    ) -> Result<Self> {
        let pool_slots = pool.slots;
        let mem_group = |n: usize| -> Result<MemGroup> {
            Ok(MemGroup {
                master: try_filled(n, 0.0, "fp32 master")?,
                moments: MemMoments::zeros(n, moments)?,
            })
        };
        let in_mem = |i: usize| nvme.is_none() || resident.get(i).copied().unwrap_or(false);
        let mem: Vec<Option<MemGroup>> = numel
            .iter()
            .enumerate()
            .map(|(i, &n)| in_mem(i).then(|| mem_group(n)).transpose())
            .collect::<Result<_>>()?;
        let nvme = match nvme {
            None => None,
            Some(io) => {
                let need = buffers_needed(read_ahead, write_behind, spill_grads);
                if io.arena.count() < need {
                    return Err(EngineError::internal(format!(
                        "optimizer arena has {} buffers, the pipeline needs {need}",
                        io.arena.count()
                    )));
                }
                let mut extents = Vec::with_capacity(numel.len());
                let mut grad_extents = Vec::with_capacity(numel.len());
                let space = io.read.space().clone();
                for (i, &n) in numel.iter().enumerate() {
                    if mem[i].is_some() {
                        extents.push(None);
                        grad_extents.push(None);
                        continue;
                    }
                    let [b0, b1, b2] = state_bytes(n, moments);
                    extents.push(Some([
                        space.allocate(b0)?,
                        space.allocate(b1)?,
                        space.allocate(b2)?,
                    ]));
                    grad_extents.push(if spill_grads {
                        Some(space.allocate(b0)?)
                    } else {
                        None
                    });
                }
                // Slots fit any NVMe group: a committed slot becomes the
                // group's extents, and its old extents a slot.
                let largest = (0..numel.len())
                    .filter(|&i| mem[i].is_none())
                    .map(|i| numel[i])
                    .max();
                let mut pool = Vec::new();
                if let Some(n) = largest {
                    let [b0, b1, b2] = state_bytes(n, moments);
                    for _ in 0..pool_slots {
                        pool.push(Slot {
                            ext: [
                                space.allocate(b0)?,
                                space.allocate(b1)?,
                                space.allocate(b2)?,
                            ],
                            last_write: 0,
                        });
                    }
                }
                let groups = numel.len();
                Some(NvmeState {
                    io,
                    extents,
                    pool_slots: pool.len(),
                    pool,
                    pending: (0..groups).map(|_| None).collect(),
                    writes_issued: 0,
                    writes_retired: 0,
                    extents_last_write: vec![0; groups],
                    grad_extents,
                    spilled: vec![None; groups],
                    spill_writes: (0..groups).map(|_| None).collect(),
                    reading: VecDeque::new(),
                    writes: VecDeque::new(),
                })
            }
        };
        let held = numel.iter().map(|_| None).collect();
        // Buffers beyond what the configured depths need deepen the read
        // pipeline (not with spilled gradients, whose spill writes take
        // buffers of the same pool while backward runs).
        let read_ahead = match &nvme {
            Some(nv) if read_ahead > 0 && !spill_grads => {
                read_ahead.max((nv.io.arena.count() / 3).saturating_sub(1 + write_behind))
            }
            _ => read_ahead,
        };
        Ok(OptimizerState {
            numel,
            mem,
            held,
            nvme,
            read_ahead,
            write_behind,
            kept_grads: pool.kept_grads,
            moments,
            counters: OptCounters::default(),
        })
    }

    /// How `m` and `v` are stored.
    pub fn moment_dtype(&self) -> MomentDtype {
        self.moments
    }

    /// Whether state lives on NVMe (all of it but the resident groups).
    pub fn is_nvme(&self) -> bool {
        self.nvme.is_some()
    }

    /// Whether `sg`'s state lives in host memory (the memory tiers, or a
    /// resident group of NVMe state): it is never read or written.
    pub fn in_memory(&self, sg: SubGroupId) -> bool {
        self.mem.get(sg.0).is_some_and(Option::is_some)
    }

    /// Counters so far.
    pub fn counters(&self) -> OptCounters {
        self.counters
    }

    /// Whether `sg`'s state read is issued and it is not yet stepped.
    pub fn is_issued(&self, sg: SubGroupId) -> bool {
        self.nvme
            .as_ref()
            .is_some_and(|n| n.reading.iter().any(|(g, _)| *g == sg))
    }

    /// The sub-group whose state read is the oldest issued, the only one
    /// [`OptimizerState::step`] may step next without reading again.
    pub fn next_read(&self) -> Option<SubGroupId> {
        self.nvme.as_ref()?.reading.front().map(|(g, _)| *g)
    }

    /// Sub-groups whose reads are issued and not yet stepped.
    pub fn reads_pending(&self) -> usize {
        self.nvme.as_ref().map_or(0, |n| n.reading.len())
    }

    /// The completion channel of the oldest state write not yet retired,
    /// to wait on (without taking it) beside other channels.
    pub fn oldest_write(&self) -> Option<&crossbeam_channel::Receiver<tierzero_swap::Completion>> {
        self.nvme
            .as_ref()?
            .writes
            .front()?
            .iter()
            .flatten()
            .next()
            .map(Ticket::receiver)
    }

    /// The completion channel of the oldest state read still in flight.
    pub fn inflight_read(&self) -> Option<&crossbeam_channel::Receiver<tierzero_swap::Completion>> {
        self.nvme
            .as_ref()?
            .reading
            .iter()
            .flat_map(|(_, ts)| ts.iter())
            .find(|t| !t.is_done())
            .map(Ticket::receiver)
    }

    /// How many reads may run ahead of the step.
    pub fn read_ahead(&self) -> usize {
        self.read_ahead
    }

    /// Elements of a sub-group.
    pub fn numel_of(&self, sg: SubGroupId) -> Result<usize> {
        self.numel
            .get(sg.0)
            .copied()
            .ok_or_else(|| EngineError::internal(format!("no sub-group {sg:?}")))
    }

    /// Sets a sub-group's master weights; zeroes its moments (tests).
    #[cfg(test)]
    pub fn init_group(&mut self, sg: SubGroupId, master: &[f32]) -> Result<()> {
        let n = self.numel_of(sg)?;
        let zeros = vec![0f32; n];
        self.load_group(sg, [master, &zeros, &zeros])
    }

    /// Retires gradient-spill writes: those already complete, or (with
    /// `block`) all of them. Their buffers go back to the pool.
    fn retire_spill_writes(&mut self, block: bool) -> Result<()> {
        let Some(nv) = &mut self.nvme else {
            return Ok(());
        };
        for slot in nv.spill_writes.iter_mut() {
            let Some(t) = slot.take() else { continue };
            if block {
                let t0 = Instant::now();
                let r = t.wait();
                self.counters.io_wait += t0.elapsed();
                drop(r?);
            } else {
                match t.poll() {
                    Some(c) => drop(c.into_result()?),
                    None => *slot = Some(t),
                }
            }
        }
        Ok(())
    }

    /// Retires finished writes without blocking; blocks on the oldest
    /// while more than `keep` are queued.
    fn retire_writes(&mut self, keep: usize) -> Result<()> {
        self.poll_writes()?;
        let Some(nv) = &mut self.nvme else {
            return Ok(());
        };
        while nv.writes.len() > keep {
            if let Some(ts) = nv.writes.pop_front() {
                nv.writes_retired += 1;
                let t0 = Instant::now();
                let r = tierzero_swap::wait_all(ts.into_iter().flatten().collect());
                self.counters.io_wait += t0.elapsed();
                drop(r?);
            }
        }
        Ok(())
    }

    /// Retires the oldest sub-groups' writes that have completed (in
    /// order), without blocking, so their buffers return to the pool.
    pub fn poll_writes(&mut self) -> Result<()> {
        let Some(nv) = &mut self.nvme else {
            return Ok(());
        };
        while let Some(front) = nv.writes.front_mut() {
            for slot in front.iter_mut() {
                let Some(t) = slot.as_ref() else { continue };
                match t.receiver().try_recv() {
                    Ok(c) => {
                        *slot = None;
                        drop(c.into_result()?);
                    }
                    Err(crossbeam_channel::TryRecvError::Empty) => {}
                    Err(crossbeam_channel::TryRecvError::Disconnected) => {
                        return Err(tierzero_swap::SwapError::Shutdown.into())
                    }
                }
            }
            if front.iter().any(Option::is_some) {
                break;
            }
            nv.writes.pop_front();
            nv.writes_retired += 1;
        }
        Ok(())
    }

    /// Issues the state read of `sg` if the pipeline has room (at most
    /// `read_ahead` reads beyond the one about to be stepped), no other
    /// sub-group's read is still in flight (pacing, see the module docs),
    /// and its buffers are free. Returns whether it is issued (true also
    /// if it already was; memory tier: always true, nothing to do).
    pub fn prefetch(&mut self, sg: SubGroupId) -> Result<bool> {
        let n = self.numel_of(sg)?;
        self.retire_spill_writes(false)?;
        let limit = self.read_ahead + 1;
        if self.in_memory(sg) {
            return Ok(true);
        }
        let Some(nv) = &mut self.nvme else {
            return Ok(true);
        };
        if nv.reading.iter().any(|(g, _)| *g == sg) {
            return Ok(true);
        }
        if nv.reading.len() >= limit {
            return Ok(false);
        }
        // Pacing: one sub-group's reads in flight at a time, so that a
        // parameter read the compute waits for queues behind one group's
        // state, not the whole read-ahead.
        if nv
            .reading
            .iter()
            .any(|(_, ts)| ts.iter().any(|t| !t.is_done()))
        {
            return Ok(false);
        }
        // Read after write: this group's own state write, if one is still
        // queued (a step of it not long ago), must retire first.
        let last = nv.extents_last_write.get(sg.0).copied().unwrap_or(0);
        self.retire_writes_through(last)?;
        let Some(nv) = &mut self.nvme else {
            return Ok(true);
        };
        let spilled = nv.spilled.get(sg.0).copied().flatten();
        let k = 3 + usize::from(spilled.is_some());
        if nv.io.arena.free_count() < k {
            self.poll_writes()?;
        }
        let Some(nv) = &mut self.nvme else {
            return Ok(true);
        };
        let bufs = match nv.io.arena.try_acquire_n(k) {
            Ok(b) => b,
            Err(_) => return Ok(false),
        };
        // Read after write: the spilled gradient's write (on the other
        // engine) must be complete before it is read back.
        if let Some(t) = nv.spill_writes.get_mut(sg.0).and_then(Option::take) {
            let t0 = Instant::now();
            let r = t.wait();
            self.counters.io_wait += t0.elapsed();
            drop(r?);
        }
        let grad_ext = if spilled.is_some() {
            nv.grad_extents.get(sg.0).cloned().flatten()
        } else {
            None
        };
        let mut tickets = Vec::with_capacity(k);
        let exts = nvme_extents(&nv.extents, sg)?;
        let sizes = state_bytes(n, self.moments);
        // The three states, then the spilled gradient (in its dtype).
        let grad_bytes = spilled.map_or(0, |d| n as u64 * d.bytes_per_elem());
        let lens = sizes.into_iter().chain(std::iter::once(grad_bytes));
        for ((ext, buf), len) in exts.iter().chain(grad_ext.as_ref()).zip(bufs).zip(lens) {
            let len = nv.io.read.space().alignment().round_up(len);
            tickets.push(nv.io.read.submit(tierzero_swap::Request::range(
                tierzero_swap::IoOp::Read,
                ext,
                0,
                len,
                buf,
            ))?);
            self.counters.nvme_read_bytes += len;
        }
        nv.reading.push_back((sg, tickets));
        Ok(true)
    }

    /// Runs Adam on `sg`: reads its state (or takes the prefetched read),
    /// steps with `grad`, hands the updated master to `after` (to produce
    /// fp32 params), and writes the state back (asynchronously on NVMe):
    /// into its extents, or with `speculative` into a free slot of the
    /// speculation pool, leaving the old state in place until
    /// [`OptimizerState::commit`] (see "Speculative steps" in the module
    /// docs).
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &mut self,
        sg: SubGroupId,
        adam: &CpuAdam,
        step: u64,
        grad: Option<GradIn<'_>>,
        scale: GradScale,
        out: Option<LowPrecisionOut<'_>>,
        after: &mut dyn FnMut(&[f32]) -> Result<()>,
        speculative: bool,
    ) -> Result<()> {
        let n = self.numel_of(sg)?;
        if grad.is_some_and(|g| g.len() != n) {
            return Err(EngineError::internal("step: gradient length"));
        }
        if let Some(g) = self.mem.get_mut(sg.0).and_then(Option::as_mut) {
            let held = self.held.get_mut(sg.0).and_then(Option::take);
            let grad = grad.or(held.as_ref().map(GradBuf::as_in)).ok_or_else(|| {
                EngineError::internal("step without a gradient in the memory tier")
            })?;
            let t0 = Instant::now();
            adam.step(
                step,
                &mut g.master,
                grad,
                g.moments.as_moments(),
                out,
                scale,
            )?;
            self.counters.adam += t0.elapsed();
            return after(&g.master);
        }
        // NVMe: make sure the read is issued (FIFO), then wait for it.
        let front_is_sg = self
            .nvme
            .as_ref()
            .and_then(|nv| nv.reading.front())
            .is_some_and(|(g, _)| *g == sg);
        if !front_is_sg {
            let pending = self.reads_pending();
            if pending > 0 {
                return Err(EngineError::internal(format!(
                    "sub-group {sg:?} stepped out of read order ({pending} reads pending)"
                )));
            }
            self.retire_writes(0)?;
            self.retire_spill_writes(true)?;
            if !self.prefetch(sg)? {
                return Err(EngineError::internal(
                    "optimizer pipeline has no free buffers (start-up check missed a case)",
                ));
            }
        }
        let nv = self
            .nvme
            .as_mut()
            .ok_or_else(|| EngineError::internal("nvme state missing"))?;
        let (_, tickets) = nv
            .reading
            .pop_front()
            .ok_or_else(|| EngineError::internal("no pending read"))?;
        let t0 = Instant::now();
        let waited = tierzero_swap::wait_all(tickets);
        self.counters.io_wait += t0.elapsed();
        let mut bufs = waited?;
        let spilled = nv.spilled.get(sg.0).copied().flatten();
        if bufs.len() != 3 + usize::from(spilled.is_some()) {
            return Err(EngineError::internal(
                "state read returned wrong buffer count",
            ));
        }
        // The spilled gradient's buffer is freed right after the step.
        let mut grad_buf = if spilled.is_some() { bufs.pop() } else { None };
        {
            let (bm, rest) = bufs.split_at_mut(1);
            let (bmm, bv) = rest.split_at_mut(1);
            let master = as_f32(&mut bm[0], n)?;
            let moments = buffer_moments(&mut bmm[0], &mut bv[0], n, self.moments)?;
            let g: GradIn<'_> = match (grad, grad_buf.as_mut()) {
                (Some(g), _) => g,
                (None, Some(b)) => match spilled {
                    Some(SumDtype::Bf16) => GradIn::Bf16(as_typed::<bf16>(b, n)?),
                    _ => GradIn::F32(as_f32(b, n)?),
                },
                (None, None) => {
                    return Err(EngineError::internal(
                        "step without a gradient and none spilled",
                    ))
                }
            };
            let t0 = Instant::now();
            adam.step(step, master, g, moments, out, scale)?;
            self.counters.adam += t0.elapsed();
            after(master)?;
        }
        drop(grad_buf);
        if let Some(f) = nv.spilled.get_mut(sg.0) {
            *f = None;
        }
        let seq = nv.writes_issued + 1;
        let slot = if speculative {
            Some(self.take_slot(sg, n)?)
        } else {
            // A re-step after a miss (or a step after an fp16 skip): the
            // speculative state it replaces is garbage, its slot free once
            // that write has retired.
            self.release_pending(sg);
            None
        };
        let nv = self
            .nvme
            .as_mut()
            .ok_or_else(|| EngineError::internal("nvme state missing"))?;
        let mut tickets = Vec::with_capacity(3);
        let exts = match &slot {
            Some(s) => &s.ext,
            None => nvme_extents(&nv.extents, sg)?,
        };
        for ((ext, buf), len) in exts.iter().zip(bufs).zip(state_bytes(n, self.moments)) {
            let len = nv.io.write.space().alignment().round_up(len);
            tickets.push(Some(nv.io.write.submit(tierzero_swap::Request::range(
                tierzero_swap::IoOp::Write,
                ext,
                0,
                len,
                buf,
            ))?));
            self.counters.nvme_written_bytes += len;
        }
        match slot {
            Some(mut s) => {
                s.last_write = seq;
                if let Some(p) = nv.pending.get_mut(sg.0) {
                    *p = Some(s);
                }
            }
            None => {
                if let Some(w) = nv.extents_last_write.get_mut(sg.0) {
                    *w = seq;
                }
            }
        }
        nv.writes_issued = seq;
        nv.writes.push_back(tickets);
        crate::failpoint::kill_point(crate::failpoint::Site::OptimWriteBack);
        // The writes are retired down to `write_behind` by the caller
        // (`retire_behind`), after it has handed the new params on: their
        // consumer should not wait for the previous sub-group's write.
        Ok(())
    }

    /// Retires state writes (blocking on the oldest) until at most
    /// `write_behind` sub-groups' writes are queued: call after each step.
    pub fn retire_behind(&mut self) -> Result<()> {
        let keep = self.write_behind;
        self.retire_writes(keep)
    }

    /// Drops prefetched reads and spilled gradients (a skipped fp16 step).
    pub fn cancel_reads(&mut self) -> Result<()> {
        self.held.iter_mut().for_each(|h| *h = None);
        if let Some(nv) = &mut self.nvme {
            // The reads and spills in flight are waited for (their buffers
            // come back): I/O wait like any other.
            let t0 = Instant::now();
            let waited = (|| -> Result<()> {
                while let Some((_, ts)) = nv.reading.pop_front() {
                    drop(tierzero_swap::wait_all(ts)?);
                }
                for t in nv.spill_writes.iter_mut().filter_map(Option::take) {
                    drop(t.wait()?);
                }
                Ok(())
            })();
            self.counters.io_wait += t0.elapsed();
            waited?;
            nv.spilled.iter_mut().for_each(|f| *f = None);
            // An fp16 skip drops every speculative step's new state.
            for s in nv.pending.iter_mut().filter_map(Option::take) {
                nv.pool.push(s);
            }
        }
        Ok(())
    }

    /// Writes a sub-group's final gradient to NVMe (asynchronously) so host
    /// memory does not hold it until the step; the step reads it back with
    /// the state.
    pub fn spill_grad(&mut self, sg: SubGroupId, grad: GradIn<'_>) -> Result<()> {
        let n = self.numel_of(sg)?;
        if grad.len() != n {
            return Err(EngineError::internal("spill_grad: gradient length"));
        }
        if self.in_memory(sg) {
            // No extent to spill to: a resident group's gradient stays in
            // memory until its step (bounded like the group itself).
            if let Some(h) = self.held.get_mut(sg.0) {
                *h = Some(match grad {
                    GradIn::F32(g) => GradBuf::F32(g.to_vec()),
                    GradIn::Bf16(g) => GradBuf::Bf16(g.to_vec()),
                });
            }
            return Ok(());
        }
        loop {
            let nv = self
                .nvme
                .as_mut()
                .ok_or_else(|| EngineError::internal("spill_grad without NVMe state"))?;
            if let Ok(mut buf) = nv.io.arena.try_acquire() {
                // As the host held it: a bf16 gradient is half the
                // bytes, read back as bf16 (its extent is the fp32 size).
                let dtype = match grad {
                    GradIn::F32(g) => {
                        as_f32(&mut buf, n)?.copy_from_slice(g);
                        SumDtype::F32
                    }
                    GradIn::Bf16(g) => {
                        as_typed::<bf16>(&mut buf, n)?.copy_from_slice(g);
                        SumDtype::Bf16
                    }
                };
                let ext = nv
                    .grad_extents
                    .get(sg.0)
                    .cloned()
                    .flatten()
                    .ok_or_else(|| EngineError::internal("no gradient extent"))?;
                let len = nv
                    .io
                    .write
                    .space()
                    .alignment()
                    .round_up(n as u64 * dtype.bytes_per_elem());
                let t = nv.io.write.submit(tierzero_swap::Request::range(
                    tierzero_swap::IoOp::Write,
                    &ext,
                    0,
                    len,
                    buf,
                ))?;
                nv.spill_writes[sg.0] = Some(t);
                nv.spilled[sg.0] = Some(dtype);
                self.counters.nvme_written_bytes += len;
                return Ok(());
            }
            // Free a buffer: retire the oldest state write, else a spill
            // write.
            let state_writes = nv.writes.len();
            if state_writes > 0 {
                self.retire_writes(state_writes - 1)?;
                continue;
            }
            let oldest = nv.spill_writes.iter_mut().find_map(Option::take);
            match oldest {
                Some(t) => {
                    let t0 = Instant::now();
                    let r = t.wait();
                    self.counters.io_wait += t0.elapsed();
                    drop(r?);
                }
                None => {
                    return Err(EngineError::internal(
                        "no optimizer buffer free to spill a gradient (reads hold them all)",
                    ))
                }
            }
        }
    }

    /// Waits for every write.
    pub fn flush(&mut self) -> Result<()> {
        self.retire_writes(0)
    }
}

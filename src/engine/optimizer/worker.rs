//! The optimizer thread: Adam runs concurrently with backward.
//!
//! [`OptimizerWorker`] owns the [`OptimizerState`] (and its read and write
//! engines) on a dedicated thread. The compute thread sends it jobs over a
//! channel and keeps running backward:
//!
//! * [`Job::SpillGrad`]: with NVMe optimizer state, when the step must wait
//!   for the global norm (clipping, fp16), write a final gradient to NVMe
//!   (DeepSpeed's gradient swap-out), so
//!   host memory holds no gradient while the norm is being completed; the
//!   step reads it back with master, m and v (4 buffers per sub-group).
//!   The gradient goes back to the compute thread ([`Done::Spilled`]),
//!   which hands over at most a pipeline's worth of them at once;
//! * [`Job::Step`]: step a sub-group with its final gradient (moved, not
//!   copied) and the gradient multiplier;
//! * [`Job::Expect`]: at the start of a step whose sub-groups step during
//!   backward, the order their `Step` jobs will come in, so their state
//!   reads start before their gradients are final;
//! * `Step { speculative: true, .. }`, [`Job::Commit`] and [`Job::Restore`]:
//!   the speculative step with clipping or an overflow check ("Speculative step" in the
//!   trainer module docs); a `Step` that replaces a queued one, or a
//!   speculative step `CancelReads` drops, is answered
//!   [`Done::Superseded`], so every sent step gets exactly one reply;
//! * [`Job::CancelReads`] (a skipped fp16 step), [`Job::Flush`],
//!   [`Job::Master`].
//!
//! Sub-groups are read and stepped in one FIFO order: the order of their
//! `Expect` list, or of their `Step` jobs. The worker issues reads from the front
//! of that order while the pipeline has room (one sub-group's reads in
//! flight at a time, see [`OptimizerState::prefetch`]), steps the front
//! when its job is there, and otherwise waits for whichever comes first:
//! a job, or the completion that lets the next read start (the read in
//! flight, or the oldest write, whose buffers a read needs). It never
//! sits on its channel while a read could run: before, the read-ahead
//! was refilled only when a job arrived, and the disk idled through the
//! first block of backward. A step's [`Done::Stepped`] goes out before
//! the worker waits for older state writes to retire, so the compute
//! thread never waits on a write it does not need. The updated 16-bit (or
//! fp32) parameter values go back as [`Done::Stepped`] ([`StepValues`],
//! the kernel's output itself, moved); the compute thread
//! stores them at unit boundaries, and before the next step uses those
//! params (the [`crate::engine::ParamStore`] has a single owner, the compute
//! thread, so it needs no lock). A stepped sub-group's params are never
//! used again in the same step, so applying them later cannot change a
//! value. The worker publishes its counters after every job
//! ([`OptimizerWorker::counters`]), so a step's metrics count the work
//! done during its wall time even while the optimizer tail overlaps the
//! next step.

use std::collections::{HashMap, VecDeque};
use std::thread::JoinHandle;
use std::time::Duration;

use candle_core::{DType, Tensor};
use crossbeam_channel::{Receiver, Sender};
use half::{bf16, f16};

use crate::engine::layout::SubGroupId;
use crate::engine::optimizer::state::{OptCounters, OptimizerState};
use crate::engine::optimizer::GradBuf;
use crate::engine::{EngineError, Result};
use crate::model::ParamId;
use crate::optim::{AdamHyper, CpuAdam, GradScale, LowPrecisionOut};

mod values;
use values::SpareValues;
pub use values::ValuesLent;

/// Work for the optimizer thread.
#[derive(Debug)]
pub enum Job {
    /// Write a final gradient to NVMe instead of holding it in memory.
    SpillGrad {
        /// Which.
        sg: SubGroupId,
        /// Its final gradient.
        grad: GradBuf,
    },
    /// Step a sub-group.
    Step {
        /// Which.
        sg: SubGroupId,
        /// Its final gradient; `None` when it was spilled.
        grad: Option<GradBuf>,
        /// Unscale · clip multiplier.
        scale: GradScale,
        /// 1-based Adam step.
        step: u64,
        /// Hyper-parameters (the scheduled lr).
        hyper: AdamHyper,
        /// Params of the sub-group whose new tensors the compute thread
        /// will keep resident: built here, from the new bytes, so the
        /// compute thread does not copy them (see [`TensorWant`]).
        tensors: Vec<TensorWant>,
        /// A speculative step (NVMe state only): the new state goes to a
        /// slot of the speculation pool (see "Speculative steps" in
        /// `state.rs`) and the gradient stays in host memory after the
        /// step, for a re-step should the speculation miss (at most
        /// [`OptimizerState::kept_grads_max`]; beyond that it is spilled
        /// to NVMe). A
        /// later `Step` of the same group before this one ran replaces it
        /// (the replaced one is answered [`Done::Superseded`]) and inherits
        /// its gradient; one after it ran, without a gradient, takes the
        /// kept one.
        speculative: bool,
    },
    /// Make the speculative steps of these groups current (after every
    /// queued step has run): the speculation held. Their kept gradients
    /// are dropped.
    Commit(Vec<SubGroupId>),
    /// Reply with a sub-group's param bytes made from its current master
    /// weights, as a [`Done::Stepped`]: undoes a speculative step's params
    /// after gradients that are not finite (an overflow).
    Restore(SubGroupId),
    /// The order in which this step's `Step` jobs will come (backward
    /// order). The worker queues them and starts their state reads now,
    /// as far as its buffers allow, instead of when each gradient is
    /// final: the reads do not depend on the gradients, and the disk would
    /// otherwise idle while backward computes its first units. Sent only
    /// when every sub-group's `Step` job follows in this order, and no
    /// gradient of a group whose read may start now is spilled (a read
    /// issued before its spill would miss it): with spilled gradients the
    /// trainer holds those groups' gradients in memory.
    Expect(Vec<SubGroupId>),
    /// Drop issued reads (skipped step).
    CancelReads,
    /// Finish every queued step and write; reply with the counters.
    Flush,
    /// Reply with a sub-group's master weights.
    Master(SubGroupId),
    /// Run a closure on the state with nothing else in flight (checkpoint
    /// save); its result comes back as [`Done::Ran`].
    Exclusive(ExclusiveJob),
}

/// A param of a stepped sub-group whose new tensor the optimizer thread
/// builds (on the CPU, with [`crate::engine::params::store::cpu_tensor`] over the param's
/// new bytes: the function the compute thread would call, so the same
/// bits). The
/// compute thread asks for the params it will keep resident after the
/// update, with one rank only (several ranks gather on the compute
/// thread). It took a copy of megabytes per step off the compute thread.
#[derive(Debug, Clone)]
pub struct TensorWant {
    /// Which param.
    pub param: ParamId,
    /// Its first element within the sub-group.
    pub offset_in_group: usize,
    /// Its shape (the whole param: one rank holds it).
    pub shape: Vec<usize>,
}

/// The result of an [`ExclusiveJob`].
pub type ExclusiveResult = Box<dyn std::any::Any + Send>;

/// A closure run on the optimizer thread with exclusive use of the state.
pub struct ExclusiveJob(
    #[allow(clippy::type_complexity)]
    pub  Box<dyn FnOnce(&mut OptimizerState) -> Result<ExclusiveResult> + Send>,
);

impl std::fmt::Debug for ExclusiveJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ExclusiveJob")
    }
}

/// A stepped sub-group's new param values in the storage dtype, as the
/// AdamW kernel wrote them (its low-precision output, or the fp32
/// master copied in parallel): moved to the trainer, which reads them as
/// bytes ([`StepValues::as_bytes`]). They used to be re-encoded into a
/// new `Vec<u8>` element by element on this thread, a fresh 90 MB a
/// 45M-element sub-group in bf16 (about 50 ms on one core here, most of it
/// page faults), on the optimizer tail that paces the next forward.
///
/// The elements of one of the three storage dtypes, as a device's
/// download holds them: the same type.
pub type StepValues = crate::model::exec_units::HostVec;

// The stored bytes are little-endian (`to_le_bytes` wrote them before;
// `params::store::cpu_tensor` reads them back by a native cast).
const _: () = assert!(
    cfg!(target_endian = "little"),
    "the param store's bytes are little-endian"
);

impl StepValues {
    /// Their bytes (little-endian, as the store keeps them).
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            StepValues::F32(v) => bytemuck::cast_slice(v),
            StepValues::Bf16(v) => bytemuck::cast_slice(v),
            StepValues::F16(v) => bytemuck::cast_slice(v),
        }
    }

    /// Their storage dtype.
    fn dtype(&self) -> DType {
        match self {
            StepValues::F32(_) => DType::F32,
            StepValues::Bf16(_) => DType::BF16,
            StepValues::F16(_) => DType::F16,
        }
    }

    /// Elements their buffer holds without growing.
    fn capacity_elems(&self) -> usize {
        match self {
            StepValues::F32(v) => v.capacity(),
            StepValues::Bf16(v) => v.capacity(),
            StepValues::F16(v) => v.capacity(),
        }
    }

    /// Bytes of their buffer.
    fn capacity_bytes(&self) -> usize {
        self.capacity_elems() * self.dtype().size_in_bytes()
    }

    /// Becomes `master` in its storage dtype (rounded to nearest even,
    /// as the kernel's low-precision output; fp32 copied in parallel),
    /// in its own buffer: every element written.
    fn set_from_master(&mut self, master: &[f32]) {
        let n = master.len();
        match self {
            StepValues::Bf16(v) => {
                v.resize(n, bf16::ZERO);
                for (d, &x) in v.iter_mut().zip(master) {
                    *d = bf16::from_bits(crate::optim::f32_to_bf16_bits(x));
                }
            }
            StepValues::F16(v) => {
                v.resize(n, f16::ZERO);
                for (d, &x) in v.iter_mut().zip(master) {
                    *d = f16::from_bits(crate::optim::f32_to_f16_bits(x));
                }
            }
            StepValues::F32(v) => {
                v.resize(n, 0.0);
                tierzero_gpu::host_copy::copy(v, master);
            }
        }
    }
}

/// Replies from the optimizer thread.
#[derive(Debug)]
pub enum Done {
    /// New parameter values of a stepped sub-group (storage dtype).
    Stepped {
        /// Which.
        sg: SubGroupId,
        /// The whole sub-group's, in its param order.
        values: StepValues,
        /// Its place among the values lent at once: dropped once they are
        /// stored ([`OptimizerWorker::bound_values`]).
        lent: ValuesLent,
        /// The tensors the `Step` job asked for ([`TensorWant`]).
        tensors: Vec<(ParamId, Tensor)>,
        /// The gradient it stepped with, handed back for a later step's
        /// sums (`None`: none came with the job, or it is kept for a
        /// re-step).
        spent: Option<GradBuf>,
    },
    /// All queued work finished.
    Flushed,
    /// Master weights.
    Master(SubGroupId, Vec<f32>),
    /// An [`Job::Exclusive`] closure's result.
    Ran(ExclusiveResult),
    /// A queued step that will not run: replaced by a later `Step` of the
    /// same group, or dropped by `CancelReads`. Its params get no bytes
    /// from it.
    Superseded(SubGroupId),
    /// A spilled gradient ([`Job::SpillGrad`]: written to its extent, or
    /// copied beside a resident group's state), handed back for a later
    /// step's sums; the compute thread's acknowledgment, whose hand-over
    /// of gradients is bounded (`Trainer::spills_out`).
    Spilled(GradBuf),
    /// Gradients kept in memory for re-steps that none needs (the
    /// speculation held: [`Job::Commit`]; the step was skipped:
    /// [`Job::CancelReads`]), handed back for a later step's sums like
    /// `Stepped`'s `spent` (they were freed on this thread, and the next
    /// backward made and faulted new sums in their place).
    Spent(Vec<GradBuf>),
    /// A job failed.
    Failed(EngineError),
}

/// Where a queued sub-group stands when backward ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TailClass {
    /// State in host memory: steps without a read.
    InMemory,
    /// State read issued: must step in read (FIFO) order.
    Issued,
    /// State read not yet issued.
    Unissued,
}

/// The optimizer tail's order: in-memory groups in index order, then the
/// issued ones in their order, then the rest in index order.
fn tail_order(
    order: &VecDeque<SubGroupId>,
    class: impl Fn(SubGroupId) -> TailClass,
) -> VecDeque<SubGroupId> {
    let mut mem: Vec<SubGroupId> = Vec::new();
    let mut issued: Vec<SubGroupId> = Vec::new();
    let mut rest: Vec<SubGroupId> = Vec::new();
    for &g in order {
        match class(g) {
            TailClass::InMemory => mem.push(g),
            TailClass::Issued => issued.push(g),
            TailClass::Unissued => rest.push(g),
        }
    }
    mem.sort_by_key(|g| g.0);
    rest.sort_by_key(|g| g.0);
    mem.into_iter().chain(issued).chain(rest).collect()
}

/// Handle on the optimizer thread.
#[derive(Debug)]
pub struct OptimizerWorker {
    tx: Option<Sender<Job>>,
    rx: Receiver<Done>,
    handle: Option<JoinHandle<()>>,
    live: std::sync::Arc<std::sync::Mutex<OptCounters>>,
    spare: SpareValues,
}

/// A step job waiting for its turn: gradient (None: spilled), multiplier,
/// 1-based Adam step, hyper-parameters, tensors to build, speculative.
type PendingStep = (
    Option<GradBuf>,
    GradScale,
    u64,
    AdamHyper,
    Vec<TensorWant>,
    bool,
);

struct State {
    opt: OptimizerState,
    adam: CpuAdam,
    dtype: DType,
    order: VecDeque<SubGroupId>,
    steps: HashMap<SubGroupId, PendingStep>,
    /// Gradients of speculative steps that ran, kept in host memory for a
    /// re-step until the decision (at most `opt.kept_grads_max()`).
    kept: HashMap<SubGroupId, GradBuf>,
    live: std::sync::Arc<std::sync::Mutex<OptCounters>>,
    timeline: Option<std::sync::Arc<crate::engine::Timeline>>,
    /// The param store's reads on the disk (`None`: params not on NVMe).
    gate: Option<std::sync::Arc<crate::engine::params::copier::ParamReadGate>>,
    /// The next step's output buffer, given back by the trainer.
    spare: SpareValues,
}

/// Why [`State::pump`] stopped issuing reads.
#[derive(Debug, Default, Clone, Copy)]
struct Pumped {
    /// A read was held back while param reads are on the disk.
    held: bool,
    /// A read was kept back by pacing, behind a state read in flight.
    paced: bool,
}

impl State {
    /// Issues the state reads that fit (`OptimizerState::prefetch`), in
    /// step order. While param reads are on the disk, only the next
    /// sub-group on NVMe to step reads: the deeper read-ahead waits for a
    /// gap ([`crate::engine::params::copier::ParamReadGate`]), so the reads the compute
    /// waits for (at the start of forward, the optimizer's read-ahead for
    /// backward took half the disk while the compute waited on params) get
    /// the disk, and the read-ahead fills the idle turn between forward
    /// and backward instead. Returns why the reads stopped.
    fn pump(&mut self) -> Result<Pumped> {
        if !self.opt.is_nvme() {
            return Ok(Pumped::default());
        }
        let yield_to_params = self.gate.as_ref().is_some_and(|g| g.busy());
        let mut on_disk_before = 0usize;
        for &sg in &self.order {
            if self.opt.in_memory(sg) {
                continue;
            }
            if yield_to_params && on_disk_before > 0 && !self.opt.is_issued(sg) {
                return Ok(Pumped {
                    held: true,
                    paced: false,
                });
            }
            if !self.opt.prefetch(sg)? {
                // Paced: the pipeline had room, but a state read still on
                // the disk kept this one back (it may land before the
                // caller looks again).
                let room = self.opt.reads_pending() <= self.opt.read_ahead();
                let paced = room && self.opt.inflight_read().is_some();
                return Ok(Pumped { held: false, paced });
            }
            on_disk_before += 1;
        }
        Ok(Pumped::default())
    }

    /// When a queued sub-group's state read could start but waits (the
    /// pipeline has room for it), the completion it waits for: the state
    /// read in flight (reads are paced, see `OptimizerState::prefetch`),
    /// else the oldest unretired write, whose buffers it needs.
    fn wanted_io(&self) -> Option<&crossbeam_channel::Receiver<tierzero_swap::Completion>> {
        let pending = self.opt.reads_pending();
        let unissued = self
            .order
            .iter()
            .any(|&g| !self.opt.in_memory(g) && !self.opt.is_issued(g));
        if unissued && pending <= self.opt.read_ahead() {
            self.opt.inflight_read().or_else(|| self.opt.oldest_write())
        } else {
            None
        }
    }

    fn step_front(&mut self) -> Result<Option<Done>> {
        let Some(&sg) = self.order.front() else {
            return Ok(None);
        };
        let Some((grad, scale, step, hyper, wants, speculative)) = self.steps.remove(&sg) else {
            return Ok(None);
        };
        self.order.pop_front();
        // A re-step after its speculative step ran: the kept gradient.
        let grad = grad.or_else(|| self.kept.remove(&sg));
        let t0 = std::time::Instant::now();
        self.adam.set_hyper(hyper)?;
        let n = self.opt.numel_of(sg)?;
        // Every element is written: by the kernel's low-precision output,
        // or (fp32) by the master's copy.
        let (mut values, lent) = self.spare.take(self.dtype, n);
        let (out, mut master_copy) = match &mut values {
            StepValues::Bf16(v) => (Some(LowPrecisionOut::Bf16(v)), None),
            StepValues::F16(v) => (Some(LowPrecisionOut::F16(v)), None),
            StepValues::F32(v) => (None, Some(v)),
        };
        let mut after = |master: &[f32]| -> Result<()> {
            if let Some(dst) = master_copy.as_deref_mut() {
                if dst.len() != master.len() {
                    return Err(EngineError::internal(format!(
                        "a master of {} elements for a sub-group of {}",
                        master.len(),
                        dst.len()
                    )));
                }
                tierzero_gpu::host_copy::copy(dst, master);
            }
            Ok(())
        };
        self.opt.step(
            sg,
            &self.adam,
            step,
            grad.as_ref().map(GradBuf::as_in),
            scale,
            out,
            &mut after,
            speculative,
        )?;
        let mut spent = None;
        if speculative {
            // Kept for a re-step from the old state, should the
            // speculation miss: in host memory, up to the pipeline's depth
            // (a hit then writes no gradient); spilled beyond it, so host
            // memory does not grow with the pool.
            if let Some(g) = grad {
                if self.kept.len() < self.opt.kept_grads_max() {
                    self.kept.insert(sg, g);
                } else {
                    self.opt.spill_grad(sg, g.as_in())?;
                    spent = Some(g);
                }
            }
        } else {
            spent = grad;
        }
        let bytes = values.as_bytes();
        let eb = self.dtype.size_in_bytes();
        let tensors = wants
            .into_iter()
            .map(|w| {
                let n: usize = w.shape.iter().product();
                let src = bytes
                    .get(w.offset_in_group * eb..(w.offset_in_group + n) * eb)
                    .ok_or_else(|| EngineError::internal("wanted tensor out of its sub-group"))?;
                let t = crate::engine::params::store::cpu_tensor(src, self.dtype, &w.shape)?;
                Ok((w.param, t))
            })
            .collect::<Result<Vec<_>>>()?;
        if let Some(tl) = &self.timeline {
            tl.span(
                crate::engine::Lane::Optimizer,
                || format!("sg {}", sg.0),
                t0,
                std::time::Instant::now(),
            );
        }
        Ok(Some(Done::Stepped {
            sg,
            values,
            lent,
            tensors,
            spent,
        }))
    }

    /// After a step: sends its reply, issues the next read (the stepped
    /// group's read is done, so pacing allows one), then waits for older
    /// state writes down to `write_behind`.
    fn hand_on(&mut self, done: Done, out: &Sender<Done>) -> Result<()> {
        let _ = out.send(done);
        self.pump()?;
        self.opt.retire_behind()
    }

    /// Steps every queued sub-group in the current order.
    fn run_queued(&mut self, out: &Sender<Done>) -> Result<()> {
        while !self.steps.is_empty() {
            self.pump()?;
            match self.step_front()? {
                Some(d) => {
                    self.hand_on(d, out)?;
                    self.publish();
                }
                None => return Err(EngineError::internal("a queued sub-group has no step job")),
            }
        }
        Ok(())
    }

    fn enqueue(&mut self, sg: SubGroupId) {
        if !self.order.contains(&sg) {
            self.order.push_back(sg);
        }
    }

    fn publish(&self) {
        if let Ok(mut c) = self.live.lock() {
            *c = self.opt.counters();
        }
    }

    /// Handles one job; returns replies to send.
    fn handle(&mut self, job: Job, out: &Sender<Done>) -> Result<()> {
        match job {
            Job::SpillGrad { sg, grad } => {
                self.opt.spill_grad(sg, grad.as_in())?;
                let _ = out.send(Done::Spilled(grad));
            }
            Job::Step {
                sg,
                grad,
                scale,
                step,
                hyper,
                tensors,
                speculative,
            } => {
                self.enqueue(sg);
                let mut grad = grad;
                if let Some(old) = self.steps.remove(&sg) {
                    // A re-step replacing a speculative step that did not
                    // run: it steps from the old state with the same
                    // gradient.
                    grad = grad.or(old.0);
                    let _ = out.send(Done::Superseded(sg));
                }
                self.steps
                    .insert(sg, (grad, scale, step, hyper, tensors, speculative));
            }
            Job::Commit(groups) => {
                self.run_queued(out)?;
                self.opt.commit(&groups)?;
                let spent: Vec<GradBuf> = groups
                    .iter()
                    .filter_map(|sg| self.kept.remove(sg))
                    .collect();
                if !spent.is_empty() {
                    let _ = out.send(Done::Spent(spent));
                }
                self.publish();
            }
            Job::Restore(sg) => {
                // Lent as a step's are (the same bound); converted from the
                // master in place (no copy of it).
                let n = self.opt.numel_of(sg)?;
                let (mut values, lent) = self.spare.take(self.dtype, n);
                self.opt.with_master(sg, |m| values.set_from_master(m))?;
                let _ = out.send(Done::Stepped {
                    sg,
                    values,
                    lent,
                    tensors: Vec::new(),
                    spent: None,
                });
            }
            Job::Expect(order) => {
                for sg in order {
                    self.enqueue(sg);
                }
                self.pump()?;
            }
            Job::CancelReads => {
                // Queued speculative steps of a skipped step do not run.
                let dropped: Vec<SubGroupId> = self
                    .steps
                    .iter()
                    .filter(|(_, s)| s.5)
                    .map(|(g, _)| *g)
                    .collect();
                // Their gradients go back with the kept ones, for a later
                // step's sums (dropped here, they were freed on this
                // thread).
                let mut spent: Vec<GradBuf> = Vec::new();
                for sg in dropped {
                    if let Some((Some(g), ..)) = self.steps.remove(&sg) {
                        spent.push(g);
                    }
                    let _ = out.send(Done::Superseded(sg));
                }
                spent.extend(self.kept.drain().map(|(_, g)| g));
                if !spent.is_empty() {
                    let _ = out.send(Done::Spent(spent));
                }
                self.opt.cancel_reads()?;
                self.order.retain(|g| self.steps.contains_key(g));
            }
            Job::Flush => {
                // Backward is over: the sub-groups still queued are stepped
                // in index order (forward order), because the next step's
                // forward, which overlaps this tail, needs the lowest first
                // ("Optimizer tail" in the trainer module docs). Groups whose state is in
                // memory (resident) need no read: they go first. Groups
                // whose state reads are already issued keep their order
                // (reads are FIFO), before the rest.
                // Each group's result does not depend on the order.
                self.order = tail_order(&self.order, |g| {
                    if self.opt.in_memory(g) {
                        TailClass::InMemory
                    } else if self.opt.is_issued(g) {
                        TailClass::Issued
                    } else {
                        TailClass::Unissued
                    }
                });
                self.run_queued(out)?;
                self.opt.flush()?;
                self.publish();
                let _ = out.send(Done::Flushed);
            }
            Job::Master(sg) => {
                let m = self.opt.master(sg)?;
                let _ = out.send(Done::Master(sg, m));
            }
            Job::Exclusive(job) => {
                if !self.steps.is_empty() {
                    return Err(EngineError::internal(
                        "exclusive optimizer job with steps queued (flush first)",
                    ));
                }
                self.opt.flush()?;
                let r = (job.0)(&mut self.opt)?;
                let _ = out.send(Done::Ran(r));
            }
        }
        Ok(())
    }
}

impl OptimizerWorker {
    /// Starts the thread, which takes ownership of the state; with a
    /// timeline, each sub-group's step is a span of it.
    pub fn spawn(
        opt: OptimizerState,
        adam: CpuAdam,
        dtype: DType,
        timeline: Option<std::sync::Arc<crate::engine::Timeline>>,
        cpus: Option<std::sync::Arc<[usize]>>,
        gate: Option<std::sync::Arc<crate::engine::params::copier::ParamReadGate>>,
    ) -> Result<Self> {
        Self::spawn_with(opt, adam, dtype, timeline, cpus, gate, Duration::ZERO)
    }

    /// [`OptimizerWorker::spawn`], the thread sleeping `settle` after each
    /// `pump` before it decides what to wait for (tests: the reads in
    /// flight land in that gap, as they may at any time).
    fn spawn_with(
        opt: OptimizerState,
        adam: CpuAdam,
        dtype: DType,
        timeline: Option<std::sync::Arc<crate::engine::Timeline>>,
        cpus: Option<std::sync::Arc<[usize]>>,
        gate: Option<std::sync::Arc<crate::engine::params::copier::ParamReadGate>>,
        settle: Duration,
    ) -> Result<Self> {
        let (tx, jobs) = crossbeam_channel::unbounded::<Job>();
        let (done_tx, rx) = crossbeam_channel::unbounded::<Done>();
        let live = std::sync::Arc::new(std::sync::Mutex::new(opt.counters()));
        let spare = SpareValues::new(cpus.clone());
        let mut st = State {
            opt,
            adam,
            dtype,
            order: VecDeque::new(),
            steps: HashMap::new(),
            kept: HashMap::new(),
            live: live.clone(),
            timeline,
            gate,
            spare: spare.clone(),
        };
        let handle = std::thread::Builder::new()
            .name("tierzero-optim".into())
            .spawn(move || {
                // Adam's scoped threads inherit this mask.
                tierzero_swap::affinity::place_current_thread(cpus.as_deref(), "tierzero-optim");
                // Wake-ups in a row on the wanted read's channel with
                // nothing in it (see below).
                let mut empty_wakes = 0u32;
                loop {
                    // Step whatever is ready before blocking for more work.
                    let ready = st.order.front().is_some_and(|sg| st.steps.contains_key(sg));
                    let job = if ready {
                        match jobs.try_recv() {
                            Ok(j) => Some(j),
                            Err(crossbeam_channel::TryRecvError::Empty) => None,
                            Err(crossbeam_channel::TryRecvError::Disconnected) => return,
                        }
                    } else {
                        // Nothing to step: issue the reads that fit, then wait
                        // for a job, or for the I/O completion that lets the
                        // next wanted read start (see `wanted_io`).
                        let pumped = match st.opt.poll_writes().and_then(|()| st.pump()) {
                            Ok(d) => d,
                            Err(e) => {
                                let _ = done_tx.send(Done::Failed(e));
                                return;
                            }
                        };
                        let deferred = pumped.held;
                        if !settle.is_zero() {
                            std::thread::sleep(settle);
                        }
                        st.publish();
                        // Wait for a job, for the completion a wanted read
                        // waits for, or (when read-ahead yields to param
                        // reads, see `pump`) for the param reads to land.
                        if pumped.paced && st.opt.inflight_read().is_none() {
                            // The read that paced `pump` landed since (no
                            // read is left in flight to wait for): pump
                            // again, or the thread would sit on its
                            // channel (or wait for a queued write, which
                            // `wanted_io` falls back to) while a read
                            // could run. Each retry follows a completion,
                            // so this cannot spin.
                            continue;
                        }
                        let io = st.wanted_io();
                        let gate = deferred.then_some(st.gate.as_ref()).flatten();
                        let mut sel = crossbeam_channel::Select::new();
                        let job_op = sel.recv(&jobs);
                        let io_op = io.map(|io| sel.recv(io));
                        let gate_op = gate.map(|g| sel.recv(g.idle()));
                        let k = sel.ready();
                        if Some(k) == gate_op {
                            if let Some(g) = gate {
                                let _ = g.idle().try_recv();
                            }
                            continue;
                        }
                        if let (Some(io), true) = (io, Some(k) == io_op) {
                            // Ready with nothing in it: a spurious wake-up
                            // (crossbeam's `ready` may return one), or the
                            // engine dropped the request unanswered (a
                            // closed channel is ready at once, every time).
                            // The completion must stay in the channel for
                            // the step, so it is not taken to tell them
                            // apart: 100 in a row, 1 ms apart, is the
                            // engine gone.
                            if io.is_empty() {
                                empty_wakes += 1;
                                if empty_wakes >= 100 {
                                    let _ = done_tx.send(Done::Failed(
                                        tierzero_swap::SwapError::Shutdown.into(),
                                    ));
                                    return;
                                }
                                std::thread::sleep(std::time::Duration::from_millis(1));
                            } else {
                                empty_wakes = 0;
                            }
                            continue;
                        }
                        empty_wakes = 0;
                        debug_assert_eq!(k, job_op);
                        match jobs.try_recv() {
                            Ok(j) => Some(j),
                            Err(crossbeam_channel::TryRecvError::Empty) => continue,
                            Err(crossbeam_channel::TryRecvError::Disconnected) => return,
                        }
                    };
                    let r = match job {
                        Some(j) => st.handle(j, &done_tx),
                        None => st.pump().and_then(|_| match st.step_front()? {
                            Some(d) => st.hand_on(d, &done_tx),
                            None => Ok(()),
                        }),
                    };
                    st.publish();
                    if let Err(e) = r {
                        // Stop at the first failure: the state is no longer
                        // trustworthy, and a job that keeps failing must not
                        // spin. Dropping the state drains its in-flight I/O.
                        let _ = done_tx.send(Done::Failed(e));
                        return;
                    }
                }
            })
            .map_err(|e| EngineError::internal(format!("spawning the optimizer thread: {e}")))?;
        Ok(OptimizerWorker {
            tx: Some(tx),
            rx,
            handle: Some(handle),
            live,
            spare,
        })
    }

    /// Gives back a [`Done::Stepped`]'s values once they are stored: a
    /// later step writes its output into them (see `SpareValues`).
    pub fn give_values(&self, values: StepValues) {
        self.spare.give(values);
    }

    /// Frees the values buffer kept for the next step (the trainer, as a
    /// backward starts: see `SpareValues`).
    pub fn drop_spare_values(&self) {
        self.spare.clear();
    }

    /// Lends at most `cap` values buffers at once
    /// ([`crate::engine::sizing::values_in_flight`]): a step or restore
    /// beyond waits until a [`Done::Stepped`]'s [`ValuesLent`] is dropped.
    /// Without it (the default) the thread lends as many as it steps, and
    /// after a decision (clipping, an overflow check) it steps every
    /// remaining sub-group back to back while the trainer stores their
    /// values only at unit boundaries: up to the rank's whole 16-bit
    /// shard at once.
    pub fn bound_values(&self, cap: usize) {
        self.spare.bound(cap);
    }

    /// The most values buffers lent at once so far.
    pub fn values_lent_peak(&self) -> usize {
        self.spare.peak()
    }

    /// Sends a job. If the thread has stopped on an error, returns that
    /// error (not just "stopped"), so the cause reaches the caller.
    pub fn send(&self, job: Job) -> Result<()> {
        self.tx
            .as_ref()
            .ok_or_else(|| EngineError::internal("optimizer thread stopped"))?
            .send(job)
            .map_err(|_| self.stopped())
    }

    /// The error the thread stopped with, if it sent one.
    fn stopped(&self) -> EngineError {
        while let Ok(d) = self.rx.try_recv() {
            if let Done::Failed(e) = d {
                return e;
            }
        }
        EngineError::internal("optimizer thread stopped")
    }

    /// A reply if one is waiting.
    pub fn try_recv(&self) -> Option<Done> {
        self.rx.try_recv().ok()
    }

    /// Waits for the next reply.
    pub fn recv(&self) -> Result<Done> {
        self.rx
            .recv()
            .map_err(|_| EngineError::internal("optimizer thread stopped"))
    }

    /// The optimizer's counters as of its last finished job.
    pub fn counters(&self) -> OptCounters {
        self.live.lock().map_or_else(|e| *e.into_inner(), |c| *c)
    }
}

impl Drop for OptimizerWorker {
    fn drop(&mut self) {
        self.tx = None;
        // Replies not received hold their places: a step waiting for one
        // would never wake.
        self.spare.close();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failure is a panic
    use std::num::NonZeroUsize;
    use std::time::{Duration, Instant};

    use tierzero_swap::{
        ArenaConfig, Engine, EngineConfig, LockPolicy, PinnedArena, SpaceConfig, SwapSpace,
    };

    use super::*;
    use crate::engine::optimizer::state::{NvmeOptim, PoolSize};
    use crate::optim::AdamHyper;

    /// An NVMe optimizer state of `groups` sub-groups of 1024 elements
    /// over `buffers` 4 KiB buffers (write-behind 1, read-ahead from the
    /// extra buffers), all masters 1.0.
    fn nvme_state(dir: &std::path::Path, groups: usize, buffers: u64) -> OptimizerState {
        nvme_state_with(dir, groups, buffers, &[])
    }

    /// Four groups of 1024 elements in memory (the reference).
    fn mem_state() -> OptimizerState {
        let pool = PoolSize::default();
        let moments = crate::optim::MomentDtype::F32;
        OptimizerState::new(vec![1024; 4], None, &[], 1, 1, false, pool, moments).unwrap()
    }

    /// [`nvme_state`] with the groups `resident` marks kept in memory.
    fn nvme_state_with(
        dir: &std::path::Path,
        groups: usize,
        buffers: u64,
        resident: &[bool],
    ) -> OptimizerState {
        nvme_state_opts(dir, groups, buffers, resident, false, 0)
    }

    /// [`nvme_state_with`] with gradient spill extents and a speculation
    /// pool of `pool` slots.
    fn nvme_state_opts(
        dir: &std::path::Path,
        groups: usize,
        buffers: u64,
        resident: &[bool],
        spill: bool,
        pool: usize,
    ) -> OptimizerState {
        std::fs::create_dir_all(dir).unwrap();
        let numel = vec![1024usize; groups];
        let buf_bytes = 4096u64;
        let space = SwapSpace::create(SpaceConfig::new(dir, 1 << 20)).unwrap();
        let mut ac = ArenaConfig::new(buf_bytes * buffers, buf_bytes);
        ac.lock = LockPolicy::Off;
        let arena = PinnedArena::new(ac).unwrap();
        let read = Engine::new(space.clone(), arena.clone(), EngineConfig::default()).unwrap();
        let write = Engine::new(space, arena.clone(), EngineConfig::default()).unwrap();
        let mut opt = OptimizerState::new(
            numel.clone(),
            Some(NvmeOptim { read, write, arena }),
            resident,
            1,
            1,
            spill,
            PoolSize {
                slots: pool,
                kept_grads: crate::engine::sizing::speculation_kept_grads(1, 1, pool),
            },
            crate::optim::MomentDtype::F32,
        )
        .unwrap();
        for (i, &n) in numel.iter().enumerate() {
            opt.init_group(SubGroupId(i), &vec![1.0; n]).unwrap();
        }
        opt.flush().unwrap();
        opt
    }

    /// Waits (up to 60 s) until the worker has read `groups` sub-groups'
    /// state (three 4 KiB extents each) beyond `read0` bytes. Reads are
    /// paced (one group's on the disk at a time), so each group waits for
    /// the last one's 4 KiB reads to land: with the whole lib suite's I/O
    /// on CI's 2-core VM one group's reads did not land within 10 s once (cold CI at
    /// 7b63710, and one of four local runs of the suite), the old bound. A
    /// lost completion would still fail here.
    fn wait_reads(w: &OptimizerWorker, read0: u64, groups: u64, what: &str) {
        let want = read0 + groups * 3 * 4096;
        let t0 = Instant::now();
        while w.counters().nvme_read_bytes < want {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "{what}: {} of {want} bytes read",
                w.counters().nvme_read_bytes
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        // Never beyond what the pipeline allows.
        assert_eq!(w.counters().nvme_read_bytes, want, "{what}: read too far");
    }

    /// A worker (fp32, default Adam) over `opt`, and the NVMe bytes `opt`
    /// had read before it started.
    fn spawn_with_reads(
        opt: OptimizerState,
        gate: Option<std::sync::Arc<crate::engine::params::copier::ParamReadGate>>,
    ) -> (OptimizerWorker, u64) {
        let read0 = opt.counters().nvme_read_bytes;
        let adam = CpuAdam::new(AdamHyper::default(), NonZeroUsize::MIN).unwrap();
        let w = OptimizerWorker::spawn(opt, adam, DType::F32, None, None, gate).unwrap();
        (w, read0)
    }

    /// Sends `Flush` and returns the sub-groups stepped before it, in order.
    fn flush_and_collect(w: &OptimizerWorker) -> Vec<usize> {
        w.send(Job::Flush).unwrap();
        let mut stepped = Vec::new();
        loop {
            match w.recv().unwrap() {
                Done::Stepped { sg, .. } => stepped.push(sg.0),
                Done::Flushed => return stepped,
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    fn step_job(sg: usize) -> Job {
        Job::Step {
            sg: SubGroupId(sg),
            grad: Some(GradBuf::F32(vec![0.5; 1024])),
            scale: GradScale::ONE,
            step: 1,
            hyper: AdamHyper::default(),
            tensors: Vec::new(),
            speculative: false,
        }
    }

    /// Bounded, the thread lends at most that many values buffers: the
    /// next step waits until a reply's `lent` is dropped (on any path),
    /// and a handle dropped while it waits does not hang. Unbounded, every
    /// queued step's values were out at once.
    #[test]
    fn values_lent_are_bounded_and_come_back_when_their_reply_is_dropped() {
        let adam = CpuAdam::new(AdamHyper::default(), NonZeroUsize::MIN).unwrap();
        let w = OptimizerWorker::spawn(mem_state(), adam.clone(), DType::BF16, None, None, None)
            .unwrap();
        w.bound_values(2);
        for sg in 0..4 {
            w.send(step_job(sg)).unwrap();
        }
        let first = w.recv().unwrap();
        let second = w.recv().unwrap();
        assert!(matches!(first, Done::Stepped { .. }) && matches!(second, Done::Stepped { .. }));
        // Two lent: the third step waits.
        std::thread::sleep(Duration::from_millis(300));
        assert!(w.try_recv().is_none(), "a third values buffer was lent");
        // One stored and given back (its place with it).
        if let Done::Stepped { values, lent, .. } = first {
            w.give_values(values);
            drop(lent);
        }
        let third = w.rx.recv_timeout(Duration::from_secs(60)).unwrap();
        assert!(matches!(third, Done::Stepped { sg, .. } if sg == SubGroupId(2)));
        std::thread::sleep(Duration::from_millis(300));
        assert!(w.try_recv().is_none(), "a fourth values buffer was lent");
        // A reply dropped unstored gives its place back too.
        drop(second);
        let fourth = w.rx.recv_timeout(Duration::from_secs(60)).unwrap();
        assert!(matches!(fourth, Done::Stepped { sg, .. } if sg == SubGroupId(3)));

        // Dropped while its thread waits for a place: the drop returns.
        let w = OptimizerWorker::spawn(mem_state(), adam, DType::BF16, None, None, None).unwrap();
        w.bound_values(1);
        for sg in 0..3 {
            w.send(step_job(sg)).unwrap();
        }
        let held = w.recv().unwrap();
        let (tx, rx) = crossbeam_channel::bounded(1);
        std::thread::spawn(move || {
            drop(w);
            let _ = tx.send(());
        });
        assert!(
            rx.recv_timeout(Duration::from_secs(60)).is_ok(),
            "the handle's drop waited for a place that never came back"
        );
        drop(held);
    }

    /// A step writes its values into the buffer the trainer gave back
    /// (the same memory, no new one), poisoned or not: every element is
    /// the kernel's, bit for bit what a new buffer gets, in each storage
    /// dtype.
    #[test]
    fn a_given_back_buffer_takes_the_next_steps_values() {
        let stepped = |w: &OptimizerWorker| match w.recv().unwrap() {
            Done::Stepped { values, .. } => values,
            other => panic!("unexpected {other:?}"),
        };
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let adam = CpuAdam::new(AdamHyper::default(), NonZeroUsize::MIN).unwrap();
            let a =
                OptimizerWorker::spawn(mem_state(), adam.clone(), dtype, None, None, None).unwrap();
            let b = OptimizerWorker::spawn(mem_state(), adam, dtype, None, None, None).unwrap();
            for w in [&a, &b] {
                w.send(step_job(0)).unwrap();
            }
            let (va, vb) = (stepped(&a), stepped(&b));
            assert_eq!(va, vb);
            // Poisoned: NaN bits everywhere, as a stale buffer may hold.
            let poisoned = match va {
                StepValues::F32(v) => StepValues::F32(vec![f32::NAN; v.len()]),
                StepValues::Bf16(v) => StepValues::Bf16(vec![bf16::NAN; v.len()]),
                StepValues::F16(v) => StepValues::F16(vec![f16::NAN; v.len()]),
            };
            let at = poisoned.as_bytes().as_ptr();
            a.give_values(poisoned);
            for w in [&a, &b] {
                let mut job = step_job(1);
                if let Job::Step { grad, .. } = &mut job {
                    *grad = Some(GradBuf::F32(
                        (0..1024).map(|i| (i as f32 - 500.0) * 1e-3).collect(),
                    ));
                }
                w.send(job).unwrap();
            }
            let (va, vb) = (stepped(&a), stepped(&b));
            assert_eq!(
                va.as_bytes().as_ptr(),
                at,
                "{dtype:?}: the buffer given back"
            );
            assert_eq!(va.as_bytes(), vb.as_bytes(), "{dtype:?}");
            assert_eq!(va.as_bytes().len(), 1024 * dtype.size_in_bytes());
        }
    }

    /// A spare is taken only by a step of its dtype that it holds; the
    /// largest given is kept; a cleared one is gone.
    #[test]
    fn a_spare_is_taken_only_when_it_fits() {
        let s = SpareValues::default();
        s.give(StepValues::Bf16(vec![bf16::ONE; 10]));
        assert!(matches!(s.take(DType::F16, 4).0, StepValues::F16(v) if v.len() == 4));
        assert!(matches!(s.take(DType::BF16, 11).0, StepValues::Bf16(v) if v.len() == 11));
        s.give(StepValues::F32(vec![1.0; 3]));
        assert!(
            matches!(s.take(DType::BF16, 10).0, StepValues::Bf16(v) if v.len() == 10 && v[0] == bf16::ONE),
            "the larger one kept, and taken"
        );
        assert!(matches!(s.take(DType::BF16, 1).0, StepValues::Bf16(v) if v[0] == bf16::ZERO));
        s.give(StepValues::Bf16(vec![bf16::ONE; 10]));
        s.clear();
        assert!(
            matches!(s.take(DType::BF16, 10).0, StepValues::Bf16(v) if v[0] == bf16::ZERO),
            "cleared: a new one"
        );
    }

    /// State reads are paced (one sub-group in flight at a time), yet the
    /// read-ahead still fills to its depth on `Expect` alone; and after a
    /// step frees a place in it, the next read starts with no further job
    /// (the thread does not sit on its channel while a read could run).
    #[test]
    fn reads_refill_the_read_ahead_without_further_jobs() {
        let dir = std::env::temp_dir().join(format!("tz-worker-refill-{}", std::process::id()));
        // 9 buffers: the minimum, so read-ahead 1 (two groups reading).
        let opt = nvme_state(&dir, 4, 9);
        assert_eq!(opt.read_ahead(), 1);
        let (w, read0) = spawn_with_reads(opt, None);
        w.send(Job::Expect((0..4).map(SubGroupId).collect()))
            .unwrap();
        wait_reads(&w, read0, 2, "after Expect");
        w.send(step_job(0)).unwrap();
        match w.recv().unwrap() {
            Done::Stepped { sg, .. } => assert_eq!(sg, SubGroupId(0)),
            other => panic!("unexpected {other:?}"),
        }
        wait_reads(&w, read0, 3, "after the first step");
        for sg in 1..4 {
            w.send(step_job(sg)).unwrap();
        }
        let stepped = flush_and_collect(&w);
        assert_eq!(stepped, vec![1, 2, 3]);
        drop(w);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// While a param read is on the disk, only the next sub-group's state
    /// is read; the deeper read-ahead starts once the param reads landed,
    /// with no job to wake the thread.
    #[test]
    fn deep_read_ahead_waits_for_param_reads_to_land() {
        let dir = std::env::temp_dir().join(format!("tz-worker-gate-{}", std::process::id()));
        // 12 buffers: read-ahead 2 (three groups reading when free).
        let opt = nvme_state(&dir, 4, 12);
        assert_eq!(opt.read_ahead(), 2);
        let gate = crate::engine::params::copier::ParamReadGate::new();
        gate.issued();
        let (w, read0) = spawn_with_reads(opt, Some(gate.clone()));
        w.send(Job::Expect((0..4).map(SubGroupId).collect()))
            .unwrap();
        wait_reads(&w, read0, 1, "with a param read in flight");
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(
            w.counters().nvme_read_bytes,
            read0 + 3 * 4096,
            "the read-ahead went past the next group while a param read was in flight"
        );
        gate.landed();
        wait_reads(&w, read0, 3, "after the param read landed");
        for sg in 0..4 {
            w.send(step_job(sg)).unwrap();
        }
        let stepped = flush_and_collect(&w);
        assert_eq!(stepped, vec![0, 1, 2, 3]);
        drop(w);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A paced read that lands between `pump` and the thread's choice of
    /// what to wait for is not lost: the thread pumps again instead of
    /// sitting on its channel with no read in flight (it did, and the
    /// read-ahead stopped at one group until the next job: a flaky
    /// timeout of `deep_read_ahead_waits_for_param_reads_to_land`).
    #[test]
    fn a_read_landing_after_pump_still_refills_the_read_ahead() {
        let dir = std::env::temp_dir().join(format!("tz-worker-settle-{}", std::process::id()));
        let opt = nvme_state(&dir, 4, 12);
        assert_eq!(opt.read_ahead(), 2);
        let read0 = opt.counters().nvme_read_bytes;
        let adam = CpuAdam::new(AdamHyper::default(), NonZeroUsize::MIN).unwrap();
        // 50 ms after each pump: every 4 KiB read lands in that gap.
        let settle = Duration::from_millis(50);
        let w =
            OptimizerWorker::spawn_with(opt, adam, DType::F32, None, None, None, settle).unwrap();
        w.send(Job::Expect((0..4).map(SubGroupId).collect()))
            .unwrap();
        wait_reads(&w, read0, 3, "with reads landing after each pump");
        for sg in 0..4 {
            w.send(step_job(sg)).unwrap();
        }
        assert_eq!(flush_and_collect(&w), vec![0, 1, 2, 3]);
        drop(w);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// `Job::Expect` starts the state reads before any gradient arrives,
    /// and the steps then come back in the expected order.
    #[test]
    fn expected_sub_groups_are_read_before_their_gradients_arrive() {
        let dir = std::env::temp_dir().join(format!("tz-worker-expect-{}", std::process::id()));
        // 12 buffers: one group stepping, one writing, two read ahead.
        let opt = nvme_state(&dir, 4, 12);
        assert_eq!(opt.read_ahead(), 2, "extra buffers deepen the reads");
        let (w, read0) = spawn_with_reads(opt, None);
        let order = [3usize, 1, 2, 0].map(SubGroupId);
        w.send(Job::Expect(order.to_vec())).unwrap();
        // The read-ahead fills on `Expect` alone: 3, 1 and 2 read (the
        // pipeline's depth), 0 waits for a step to free its buffers.
        wait_reads(&w, read0, 3, "after Expect");
        // Sub-group 1 asks for two of its params' tensors (a 4×8 matrix
        // at its start, 900 elements from element 100).
        let wants = vec![
            TensorWant {
                param: ParamId(7),
                offset_in_group: 0,
                shape: vec![4, 8],
            },
            TensorWant {
                param: ParamId(9),
                offset_in_group: 100,
                shape: vec![900],
            },
        ];
        for &sg in &order {
            let mut job = step_job(sg.0);
            if let Job::Step { tensors, .. } = &mut job {
                if sg.0 == 1 {
                    *tensors = wants.clone();
                }
            }
            w.send(job).unwrap();
        }
        w.send(Job::Flush).unwrap();
        let mut stepped = Vec::new();
        loop {
            match w.recv().unwrap() {
                Done::Stepped {
                    sg,
                    values,
                    tensors,
                    ..
                } => {
                    let bytes = values.as_bytes();
                    assert_eq!(bytes.len(), 1024 * 4);
                    let got: Vec<(ParamId, Vec<usize>, Vec<u8>)> = tensors
                        .iter()
                        .map(|(p, t)| {
                            let b = crate::engine::params::store::tensor_bytes(t).unwrap();
                            (*p, t.dims().to_vec(), b)
                        })
                        .collect();
                    let expect: Vec<(ParamId, Vec<usize>, Vec<u8>)> = if sg.0 == 1 {
                        vec![
                            (ParamId(7), vec![4, 8], bytes[..32 * 4].to_vec()),
                            (ParamId(9), vec![900], bytes[100 * 4..1000 * 4].to_vec()),
                        ]
                    } else {
                        Vec::new()
                    };
                    assert_eq!(got, expect, "sub-group {}", sg.0);
                    stepped.push(sg);
                }
                Done::Flushed => break,
                other => panic!("unexpected {other:?}"),
            }
        }
        // The three read ahead by `Expect` step first, in its order (a
        // `Flush` keeps issued reads in their order, "Optimizer tail"),
        // then 0.
        assert_eq!(stepped, order, "{stepped:?}");
        drop(w);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Resident sub-groups of NVMe state: never read or written, a
    /// spilled gradient of theirs kept until the step, results equal to
    /// the memory tier's, interleaved with NVMe groups in one order.
    #[test]
    fn resident_groups_are_never_read_or_written_and_step_like_the_rest() {
        let dir = std::env::temp_dir().join(format!("tz-worker-resident-{}", std::process::id()));
        let resident = [false, true, false, true];
        let opt = nvme_state_with(&dir, 4, 9, &resident);
        let in_memory: Vec<bool> = (0..4).map(|g| opt.in_memory(SubGroupId(g))).collect();
        assert_eq!(in_memory, resident);
        let c0 = opt.counters();
        // Init wrote only the NVMe groups.
        assert_eq!(c0.nvme_written_bytes, 2 * 3 * 4096);
        let adam = CpuAdam::new(AdamHyper::default(), NonZeroUsize::MIN).unwrap();
        // The reference: every group in memory.
        let mut mem = mem_state();
        let mut want = Vec::new();
        for sg in 0..4 {
            mem.init_group(SubGroupId(sg), &[1.0; 1024]).unwrap();
            let mut bytes = Vec::new();
            mem.step(
                SubGroupId(sg),
                &adam,
                1,
                Some((&[0.5; 1024]).into()),
                GradScale::ONE,
                None,
                &mut |m: &[f32]| {
                    bytes = m.iter().flat_map(|x| x.to_le_bytes()).collect();
                    Ok(())
                },
                false,
            )
            .unwrap();
            want.push(bytes);
        }
        let w = OptimizerWorker::spawn(opt, adam, DType::F32, None, None, None).unwrap();
        let order = [3usize, 2, 1, 0].map(SubGroupId);
        w.send(Job::Expect(order.to_vec())).unwrap();
        // Resident group 1's gradient goes through the spill path.
        w.send(Job::SpillGrad {
            sg: SubGroupId(1),
            grad: GradBuf::F32(vec![0.5; 1024]),
        })
        .unwrap();
        for &sg in &order {
            let job = if sg.0 == 1 {
                Job::Step {
                    sg,
                    grad: None,
                    scale: GradScale::ONE,
                    step: 1,
                    hyper: AdamHyper::default(),
                    tensors: Vec::new(),
                    speculative: false,
                }
            } else {
                step_job(sg.0)
            };
            w.send(job).unwrap();
        }
        w.send(Job::Flush).unwrap();
        let mut stepped = Vec::new();
        let mut spilled = 0;
        loop {
            match w.recv().unwrap() {
                Done::Stepped { sg, values, .. } => {
                    assert_eq!(values.as_bytes(), want[sg.0], "sub-group {}", sg.0);
                    stepped.push(sg);
                }
                Done::Flushed => break,
                Done::Spilled(g) => {
                    assert_eq!(g.len(), 1024, "the spilled gradient comes back");
                    spilled += 1;
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(spilled, 1);
        // Every group once (the tail after `Flush` goes in index order, so
        // the order depends on what was stepped before it).
        stepped.sort_by_key(|g| g.0);
        assert_eq!(stepped, (0..4).map(SubGroupId).collect::<Vec<_>>());
        let c = w.counters();
        assert_eq!(c.nvme_read_bytes - c0.nvme_read_bytes, 2 * 3 * 4096);
        assert_eq!(c.nvme_written_bytes - c0.nvme_written_bytes, 2 * 3 * 4096);
        drop(w);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Waits for `n` replies; returns the `Stepped` ones' bytes by group
    /// (a later one replaces an earlier one), the `Superseded` groups, and
    /// the gradients handed back by `Spent` replies met on the way (not
    /// counted in `n`).
    fn replies(w: &OptimizerWorker, n: usize) -> (HashMap<usize, Vec<u8>>, Vec<usize>, usize) {
        let mut stepped = HashMap::new();
        let mut superseded = Vec::new();
        let mut spent = 0;
        let mut got = 0;
        while got < n {
            match w.recv().unwrap() {
                Done::Stepped { sg, values, .. } => {
                    stepped.insert(sg.0, values.as_bytes().to_vec());
                }
                Done::Superseded(sg) => superseded.push(sg.0),
                Done::Spent(g) => {
                    spent += g.len();
                    continue;
                }
                other => panic!("unexpected {other:?}"),
            }
            got += 1;
        }
        (stepped, superseded, spent)
    }

    /// The speculation pool: 4 NVMe groups, 2 slots. Groups 3 and 2
    /// speculate every step, 0 and 1 wait for the decision; a hit commits
    /// (slots and extents swap roles), a miss re-steps from the old state
    /// with the kept gradient, an overflow drops and restores. Every
    /// master equals the memory tier's stepped without speculation, and a
    /// hit writes no gradient.
    #[test]
    fn the_speculation_pool_swaps_extents_and_keeps_the_bits() {
        let dir = std::env::temp_dir().join(format!("tz-worker-pool-{}", std::process::id()));
        let opt = nvme_state_opts(&dir, 4, 12, &[], true, 2);
        assert_eq!(opt.pool_slots(), 2);
        let adam = CpuAdam::new(AdamHyper::default(), NonZeroUsize::MIN).unwrap();
        let mut mem = mem_state();
        for sg in 0..4 {
            mem.init_group(SubGroupId(sg), &[1.0; 1024]).unwrap();
        }
        let grad = |sg: usize, step: u64| vec![0.01 * (sg as f32 + 1.0) * step as f32; 1024];
        let job = |sg: usize, step: u64, g: Option<Vec<f32>>, scale: f32, spec: bool| Job::Step {
            sg: SubGroupId(sg),
            grad: g.map(GradBuf::F32),
            scale: GradScale(scale),
            step,
            hyper: AdamHyper::default(),
            tensors: Vec::new(),
            speculative: spec,
        };
        let w = OptimizerWorker::spawn(opt, adam.clone(), DType::F32, None, None, None).unwrap();
        let order = || Job::Expect([3usize, 2, 0, 1].map(SubGroupId).to_vec());
        // (Adam step, outcome): hit, miss (scale 0.5), overflow, hit.
        let mut adam_step = 0u64;
        for (round, outcome) in ["hit", "miss", "overflow", "hit"].into_iter().enumerate() {
            let t = round as u64 + 1;
            let written0 = w.counters().nvme_written_bytes;
            w.send(order()).unwrap();
            for sg in [3, 2] {
                w.send(job(sg, adam_step + 1, Some(grad(sg, t)), 1.0, true))
                    .unwrap();
            }
            let (first, _, _) = replies(&w, 2);
            let scale = match outcome {
                "hit" => {
                    w.send(Job::Commit(vec![SubGroupId(3), SubGroupId(2)]))
                        .unwrap();
                    1.0
                }
                "miss" => {
                    for sg in [2, 3] {
                        w.send(job(sg, adam_step + 1, None, 0.5, false)).unwrap();
                    }
                    0.5
                }
                _ => {
                    w.send(Job::CancelReads).unwrap();
                    for sg in [3, 2] {
                        w.send(Job::Restore(SubGroupId(sg))).unwrap();
                    }
                    let (restored, _, spent) = replies(&w, 2);
                    // The kept gradients of the dropped speculation come
                    // back for later sums.
                    assert_eq!(spent, 2, "round {round}");
                    for sg in [3, 2] {
                        let want: Vec<u8> = mem
                            .master(SubGroupId(sg))
                            .unwrap()
                            .iter()
                            .flat_map(|x| x.to_le_bytes())
                            .collect();
                        assert_eq!(restored[&sg], want, "restore of {sg}");
                    }
                    assert_ne!(first[&3], restored[&3]);
                    assert_eq!(flush_and_collect(&w), Vec::<usize>::new());
                    continue;
                }
            };
            adam_step += 1;
            for sg in [0, 1] {
                w.send(job(sg, adam_step, Some(grad(sg, t)), scale, false))
                    .unwrap();
            }
            let (mut got, _, spent) = replies(&w, if outcome == "miss" { 4 } else { 2 });
            // A hit hands back the gradients kept for re-steps; a miss
            // steps again with them (they come back with those steps).
            let want_spent = if outcome == "hit" { 2 } else { 0 };
            assert_eq!(spent, want_spent, "round {round}");
            assert_eq!(flush_and_collect(&w), Vec::<usize>::new());
            if outcome == "hit" {
                got.extend(first);
                // Three state extents per group, no gradient written.
                let written = w.counters().nvme_written_bytes - written0;
                assert_eq!(written, 4 * 3 * 4096, "round {round}");
            }
            for sg in 0..4 {
                let mut want = Vec::new();
                mem.step(
                    SubGroupId(sg),
                    &adam,
                    adam_step,
                    Some((&grad(sg, t)).into()),
                    GradScale(scale),
                    None,
                    &mut |m: &[f32]| {
                        want = m.iter().flat_map(|x| x.to_le_bytes()).collect();
                        Ok(())
                    },
                    false,
                )
                .unwrap();
                assert_eq!(got[&sg], want, "round {round} group {sg}");
                w.send(Job::Master(SubGroupId(sg))).unwrap();
                match w.recv().unwrap() {
                    Done::Master(g, m) => {
                        assert_eq!(g.0, sg);
                        assert_eq!(m, mem.master(SubGroupId(sg)).unwrap(), "round {round}");
                    }
                    other => panic!("unexpected {other:?}"),
                }
            }
        }
        drop(w);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_tail_steps_in_memory_groups_first_then_issued_reads_in_order() {
        let order: VecDeque<SubGroupId> = [9, 4, 7, 2, 5, 0, 3, 1].map(SubGroupId).into();
        let class = |g: SubGroupId| match g.0 {
            0..=2 => TailClass::InMemory,
            7 | 4 => TailClass::Issued,
            _ => TailClass::Unissued,
        };
        let got: Vec<usize> = tail_order(&order, class).iter().map(|g| g.0).collect();
        assert_eq!(got, vec![0, 1, 2, 4, 7, 3, 5, 9]);
    }
}

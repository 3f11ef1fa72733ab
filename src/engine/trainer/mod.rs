//! The training step of one rank, and the embeddable [`Trainer`] API.
//!
//! # A step
//!
//! ```text
//! lr = schedule.lr_for_step(adam steps so far); scale = loss scaler (fp16) or 1
//! for micro in 0..gradient_accumulation_steps:
//!     forward:  for unit in embedding, blocks:   fetch params (prefetch ahead), run, release
//!     backward: for unit in head, blocks reversed, embedding:
//!                   fetch, recompute + backprop (head starts at scale / GAS),
//!                   add fp32 grads into the sub-group accumulators (or,
//!                   where each element gets one bf16 gradient a step,
//!                   copy it: `sizing::grad_sum_dtype`), release;
//!                   last micro-batch: sub-groups whose grads became final
//!                   → no clipping, no fp16: stepped now, on the optimizer
//!                     thread, while backward goes on
//!                   → otherwise: norm pass now (and, with NVMe state, the
//!                     gradient spilled to NVMe, except for the first
//!                     sub-groups, whose state reads started with the
//!                     step and whose gradients stay in memory)
//! decision: Σg² over sub-groups in index order → skip (gradients not finite) or
//!           the multiplier clip / loss_scale
//! optimizer: the remaining sub-groups in index order, pipelined
//!           (read i+1 / step i / write i-1), 16-bit params written back to
//!           their home tier — without waiting: see "Optimizer tail"
//! ```
//!
//! # Optimizer tail
//!
//! `step` does not wait for the optimizer thread to finish. The sub-groups
//! still being stepped when backward ends (all of them with clipping or
//! fp16, the last units' otherwise) run on while the *next* step's forward
//! starts: before a unit's params are fetched, [`Trainer::fetch_unit`]
//! waits until every sub-group holding one of them has been stepped and
//! its new bytes stored, and the prefetcher skips params whose new bytes
//! are still coming. Those sub-groups are stepped in index order, which is
//! forward order (embedding first), so forward of unit `k` overlaps the
//! steps of the sub-groups of units `k+1…`. The values are exactly those
//! of a step that waited (every param is used only after its update is
//! stored); [`Trainer::settle_optimizer`] waits for the whole tail, and
//! `master`, `weight_sha256` and `finish` call it.
//!
//! State reads start before the gradients are final (`Job::Expect` at
//! the start of the step): without clipping or an overflow check, in the order backward
//! makes gradients final, as deep as the optimizer's buffers allow; with
//! them, for the first `read_ahead + 1` sub-groups in index order (the
//! ones the tail steps first). With NVMe state and clipping or an overflow check those
//! groups' gradients are held in memory, the others' spilled, as DeepSpeed
//! does, until the global norm is known. This is the part of the
//! optimizer that overlaps backward when the step must wait for the norm.
//!
//! The micro-batch loss is the head's loss (recomputed during the head's
//! backward, so the head runs once per micro-batch); the step's loss is the
//! f32 sum over micro-batches divided by their count.
//!
//! Data: micro-batch `k` of step `s` on rank `r` reads rows starting at
//! global sample `((s · GAS + k) · ranks + r) · micro_batch`.
//!
//! # Activations
//!
//! Backward needs what each block's forward computed. The activation
//! policy (`activations.rs`, `tierzero.activation_budget_bytes`) keeps a
//! block's forward graph from its forward to its backward while the
//! measured graphs fit the budget, and recomputes the others from their
//! saved inputs; a kept block is not fetched again in backward. The
//! decision is made in the first micro-batch of each batch shape and
//! holds for the shape. The gradients are the same bits either way.
//!
//! # Speculative step
//!
//! With clipping or an overflow check (fp16; bf16 with
//! `check_grad_overflow`, whose default is on at stages 1-2 only, so with
//! the NVMe optimizer state of stage 3 bf16 speculates with clipping or
//! that key set: `Config::waits_for_global_norm`) a step needs the global gradient norm (or the
//! overflow flag) before it can scale a single gradient, and backward ends
//! before that is known: without more, the optimizer could only read
//! ahead during backward and step after it. With NVMe optimizer state and
//! `tierzero.speculative_step` not `false` ([`crate::engine::sizing::speculates`]),
//! NVMe sub-groups instead **step as soon as their gradients are final**,
//! with the multiplier the decision gives when nothing clips or overflows
//! (`1 / loss_scale`, no clip coefficient). The optimizer thread writes
//! that step's new state into a slot of the **speculation pool** (the old
//! state stays where it is; "Speculative steps" in `optimizer/state.rs`)
//! and keeps the gradient for a possible re-step, and its
//! new params are stored as in the overlapped case. The pool has
//! `speculation_slots` slots ([`crate::engine::sizing::speculation_pool`],
//! in the plan): by default one per NVMe group, a second copy of the NVMe
//! state, because an exact speculation must keep every old state that
//! steps before the decision, and every group backward finishes steps
//! before it; auto takes at most half the disk's free space left by the
//! run's other extents (at least the pipeline's depth,
//! `1 + pipeline_read + pipeline_write`), and
//! `tierzero.speculation_pool_bytes` sets it. A
//! step speculates the first that many NVMe groups backward finishes;
//! **when the pool is taken, the others wait for the decision** as
//! without speculation (their gradients held or spilled, their state
//! reads started ahead), counted in `speculation_pool_waits`.
//! Resident (in-memory) groups are not speculated: they step after the
//! decision. When backward ends:
//!
//! * the decision's multiplier equals the speculative one (no overflow,
//!   and the clip coefficient rounds to the same f32 multiplier: a norm
//!   well below `max_norm`; within 1e-6 of it torch's coefficient is just
//!   below 1, a miss): the
//!   speculative steps are the step, bit for bit. `Job::Commit` makes each
//!   slot the group's extents and its old extents a free slot (after every
//!   queued step has run), and drops the kept gradients;
//! * it differs (clipping): every speculated group is **stepped again from
//!   its old state** with the real multiplier and its kept gradient,
//!   exactly as the step that waits computes it, and its slot returns to
//!   the pool; a speculative step not yet run is replaced by its re-step
//!   (`Done::Superseded` answers it);
//! * overflow (fp16): queued speculative steps are dropped, the slots
//!   return to the pool, the ones that ran get their params back from the
//!   old masters (`Job::Restore`), and the step is skipped. With several
//!   ranks each restored param is restaged on every rank
//!   (`Trainer::restage_restored_elsewhere`): the ranks' pools and
//!   sub-groups differ, so the params one restores another may hold
//!   resident, and the next forward's all-gather must take the same
//!   params on every rank (`tests/mpi_equivalence.rs` skips on 3 ranks).
//!
//! So the weights are the same bits with speculation on or off (the
//! equivalence tests in `tests/engine_speculative.rs` force hits, misses
//! and overflows, with a pool of one slot and of every group). The cost:
//! the pool on NVMe (`speculation_slots` × 12 bytes × the largest NVMe
//! sub-group's elements, shown in the plan); the speculated gradients
//! beyond the pipeline's depth written to their spill extents (the
//! optimizer thread keeps `speculation_kept_grads`, the pipeline's depth,
//! in host memory, so host memory does not grow with the pool; a hit
//! never reads them back); and on a miss the re-step's reads and writes. With `"auto"` the run stops speculating after 3 misses in a row
//! and says so once; `true` never stops. `speculation_hits` and
//! `speculation_misses` are in every step's metrics and in the summary. A
//! kill before the commit (`optim.before_commit`) leaves the last
//! committed state: the swap file holds old and new state side by side,
//! and only checkpoints (which copy committed state only) outlive the run.
//!
//! # Several ranks
//!
//! Each rank holds its shard of every param, gradient and optimizer state
//! ([`Layout`]); params are all-gathered when fetched (stage 3: from their
//! home tier; stages 1-2: kept resident, re-gathered after each update),
//! each unit's gradients are reduce-scattered into this rank's sub-group
//! accumulators during backward, and Adam steps this rank's sub-groups
//! only. The arithmetic is one rank's with `GAS · ranks` micro-batches:
//! the head's gradient starts at `scale / (GAS · ranks)`, micro-batch `k`
//! of rank `r` is global micro-batch `k · ranks + r`, every param gets one
//! gradient per micro-batch (see `accumulate`), the reduce-scatter adds
//! the ranks' chunks in rank order, and the loss sums every micro-batch's
//! loss in global order. Losses and weights are therefore bit-identical to
//! one rank's; the global Σg² (clipping, fp16) sums per-rank sub-groups and
//! can differ in the last bits. Stage 0 with several ranks shards the
//! optimizer state like stage 1 (DeepSpeed would replicate it; results are
//! the same).
//!
//! # Embedding
//!
//! [`Trainer::new`] takes a validated [`Config`], an opened [`ModelDir`],
//! the token data and [`TrainerOptions`]; [`Trainer::step`] runs one
//! optimizer step and returns a [`StepReport`]. [`Trainer::fetch_unit`] /
//! [`Trainer::release_unit`] expose the param store to a caller that runs
//! its own loop (evaluation, export), and [`Trainer::finish`] writes the
//! summary. [`Trainer::save_checkpoint`] writes a checkpoint between steps
//! and [`Trainer::resume`] builds a trainer that continues from one
//! (format and guarantees: [`crate::checkpoint`]). The CLI lives elsewhere.
//!
//! # Failure
//!
//! Any error out of [`Trainer::step`] (or the other methods that drive
//! the tiers) stops the trainer for good: a failed step leaves gradients
//! half accumulated, sub-groups half stepped and swap I/O half done, so
//! continuing would train on bad data. Every later call returns
//! [`EngineError::Stopped`] with the first error's text (which names the
//! file, offset and operation for I/O errors); recovery is a restart from
//! the last checkpoint. [`Trainer::swap_poisoned`] tells whether a swap
//! space saw a failed write. [`TrainerOptions::faults`] installs fault
//! injectors on the three swap engines (tests).
//!
//! # Pinned memory
//!
//! Buffers of offload blocks with `pin_memory: true` are page-locked. Their
//! total is compared with `RLIMIT_MEMLOCK` (unless the process has
//! `CAP_IPC_LOCK`) before anything is mapped: if it does not fit,
//! `tierzero.memlock = "require"` refuses with the numbers and the fix
//! ([`crate::engine::EngineError::Memlock`]), and `"auto"` (the
//! default) logs one warning with the numbers and runs with unlocked
//! buffers, so the out-of-the-box run works under a default 8 MiB limit.

mod activations;
pub use activations::Decision as ActivationDecision;
mod build;
mod checkpoint;
mod device_optim;
mod groups;
mod options;
mod speculation;
mod step;
mod stop;
mod tail;

use speculation::{Speculation, SpeculationNews, SPECULATION_GIVE_UP};

pub use build::{other_rank_counts_swap_dirs, rank_swap_dir, BuildTimes};
pub use checkpoint::{
    config_fingerprint, numerics_differing, same_step_on_every_rank, NumericsDiffer,
};
pub use options::{FaultPlan, TrainerOptions};
pub use stop::{StopCause, StopHandle, StopSave};

use std::collections::{BTreeMap, HashMap};
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use tierzero_swap::{
    ArenaConfig, BackendKind, BusyClock, Engine, EngineConfig, FaultInjector, LockPolicy,
    MemlockInfo, PinnedArena, SpaceConfig, SwapError, SwapSpace,
};

use crate::checkpoint::{
    align_state_bytes, step_dir_name, Checkpoint, ConfigFingerprint, DataPosition, FileEntry,
    Manifest, ParamEntry, RankLayout, RegionCrc, StagedCheckpoint, StateKind, SubGroupEntry,
    FORMAT_NAME, FORMAT_VERSION,
};
use crate::config::{self, Config, OffloadDevice, Precision};
use crate::data::TokenData;
use crate::engine::comm::{agree, all_gather_var, Comm, SingleRank};
use crate::engine::grads::{GradPark, ParkCounters};
use crate::engine::host::threads::{self, ComputeThreads};
use crate::engine::layout::{shard_counts, Layout, SubGroupId};
use crate::engine::observe::metrics::{peak_rss_bytes, MetricsWriter, StepMetrics, Summary};
use crate::engine::observe::timeline::{Lane, Timeline};
use crate::engine::optimizer::state::{NvmeOptim, OptCounters, OptimizerState, PoolSize};
use crate::engine::optimizer::worker::{
    Done, ExclusiveJob, ExclusiveResult, Job, OptimizerWorker, TensorWant,
};
use crate::engine::params::prefetch::{Limits, Pass, Prefetcher, Visit};
use crate::engine::params::store::{Freshness, NvmeParams, ParamStore, StoreCounters};
use crate::engine::sizing::{self, BudgetShort, Buffers, Shape, Sizing};
use crate::engine::{EngineError, Result};
use crate::model::{Model, ModelDir, ParamId, UnitGrads, UnitId, UnitInput, UnitKind, Upstream};
use crate::optim::schedule::{LossScaler, LrSchedule};
use crate::optim::{
    f32_to_bf16_bits, f32_to_f16_bits, AdamHyper, AdamMode, CpuAdam, GradNorm, GradScale, GradStep,
};
use crate::sha256::Sha256;

/// What one step did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    /// The metrics line of the step.
    pub metrics: StepMetrics,
    /// Set when the run is to stop after this step: a [`StopHandle`]
    /// request on this rank or any other (every rank reports it at the
    /// same step). See [`Trainer::save_on_stop`].
    pub stop: Option<StopCause>,
}

/// How the optimizer relates to backward in a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OverlapMode {
    /// Everything after backward, in sub-group order.
    None,
    /// State reads and norms during backward; steps after.
    Io,
    /// State reads and steps during backward.
    Step,
    /// Clipping or fp16 with NVMe state: NVMe sub-groups step during
    /// backward as if nothing clips or overflows, into slots of the
    /// speculation pool (as many as it has), and are committed, redone or undone once the global norm is known
    /// (see "Speculative step" in the module docs).
    Speculate,
}

/// One rank's trainer.
#[derive(Debug)]
pub struct Trainer {
    config: Config,
    compute_threads: ComputeThreads,
    /// CPU Adam's threads, resolved.
    adam_threads: threads::AdamThreads,
    /// Which CPUs compute and helper threads run on.
    placement: threads::Placement,
    /// Where a step's CPU compute runs (`None`: compute is not on the CPU).
    compute_pool: Option<Arc<threads::ComputePool>>,
    /// Where the host's own parallel work runs (the gradients' adds into
    /// the sums): the compute pool, or a pool of its own when a device
    /// computes.
    host_pool: Arc<threads::ComputePool>,
    /// Gradient sums (fp32, or bf16 held as they came) kept from one step
    /// for the next
    /// ([`groups::SpareSums`]).
    spare_sums: std::sync::Mutex<groups::SpareSums>,
    /// How the host holds each sub-group's gradients, by `SubGroupId`
    /// (the plan's [`sizing::grad_sum_dtype`]).
    grad_sum_dtypes: Vec<sizing::SumDtype>,
    /// What [`crate::engine::host::heap::keep_heap_mapped`] did (`None`: option off).
    malloc: Option<tierzero_swap::MallocTuning>,
    model: Model,
    data: TokenData,
    opts: TrainerOptions,
    layout: Layout,
    store: ParamStore,
    opt: OptimizerWorker,
    /// Partial gradient sums parked on NVMe between micro-batches
    /// (`crate::engine::grads`), with several micro-batches and NVMe
    /// optimizer state.
    park: Option<GradPark>,
    sched: Prefetcher,
    adam: CpuAdam,
    lr: LrSchedule,
    scaler: LossScaler,
    steps_done: u64,
    adam_steps: u64,
    skipped: u64,
    metrics: Option<MetricsWriter>,
    groups_after_unit: Vec<Vec<SubGroupId>>,
    /// Sub-groups in the order backward makes them final (see `build`).
    backward_order: Vec<SubGroupId>,
    lookahead_reads: u64,
    /// What [`sizing::decide`] decided, as built.
    sizing: Sizing,
    /// The pinned arenas this trainer mapped (cpu-tier pages, param and
    /// optimizer swap buffers).
    arenas: Vec<Arc<PinnedArena>>,
    data_name: String,
    /// Where the data position counts from: samples consumed before step
    /// `step` (a resumed run's checkpoint; 0 and 0 for a new run), and
    /// the checkpoint lineage this run continues.
    data_base: DataBase,
    /// The save dir this trainer owns (see [`crate::checkpoint::SaveDirLock`]).
    save_lock: Option<crate::checkpoint::SaveDirLock>,
    /// Union of the busy time of every I/O engine of this trainer.
    io_clock: Arc<BusyClock>,
    /// How long building it took, by part.
    build_times: BuildTimes,
    /// With a timeline: the param, optimizer-read, optimizer-write and
    /// grad-park engines' own clocks, each with its disk lane.
    engine_clocks: Option<Vec<(Lane, Arc<BusyClock>)>>,
    /// A `Flush` was sent and its reply has not arrived.
    flush_open: bool,
    /// The device optimizer stepped since its state was last loaded or
    /// written back to the host (`device_optim.rs`).
    device_dirty: bool,
    /// This trainer loaded the device optimizer's state from its own
    /// (`device_optim.rs`). Not the device's own "every param has state":
    /// a compute passed on from an earlier trainer has that trainer's
    /// state, which a resumed one must replace with its checkpoint's.
    device_loaded: bool,
    /// The run said that its swap buffers were short for copies in place
    /// ([`Trainer::check_kept_buffers`]; said once).
    said_buffers_short: bool,
    /// Time the compute thread spent waiting for the optimizer thread.
    optimizer_wait: Duration,
    /// The speculative step's record.
    speculation: Speculation,
    /// Sub-groups whose step was sent with its gradient and not answered
    /// yet: at most [`sizing::grads_in_flight`] (the compute thread waits
    /// for a reply first), so gradients queued for the optimizer thread
    /// are bounded by the config, not by the model.
    grads_out: std::collections::HashSet<SubGroupId>,
    /// Final gradients sent to the optimizer thread to spill
    /// ([`Job::SpillGrad`](crate::engine::optimizer::Job)) and not handed
    /// back yet: with `grads_out`, at most [`sizing::grads_in_flight`]
    /// during backward (they queued without bound where the disk was
    /// slower than backward).
    spills_out: usize,
    /// The most `grads_out` and `spills_out` held at once in this run.
    grads_out_peak: usize,
    /// This rank's swap spaces (params, optimizer state), for [`Trainer::swap_usage`].
    swap_spaces: Vec<Arc<SwapSpace>>,
    /// The first error out of a step; set, the trainer refuses to go on.
    failed: Option<String>,
    /// Requests to stop at a step boundary ([`StopHandle`]).
    stop: StopHandle,
    /// What the ranks agreed to stop for (sticky).
    stopped: Option<StopCause>,
    /// When this rank learned of the stop (its own request's time, or the
    /// agreement's).
    stop_seen_at: Option<Instant>,
    /// The slowest checkpoint save of this trainer (the grace estimate).
    slowest_save: Option<Duration>,
    /// The last step's wall time (the grace estimate before any save).
    last_step_wall: Option<Duration>,
    /// The activation policy: which blocks keep their forward graph.
    activations: activations::Activations,
}

/// Where the initial weights come from.
#[derive(Debug, Clone, Copy)]
enum WeightSource<'a> {
    /// An HF model dir (or its seeded init); moments start at zero.
    Dir(&'a ModelDir),
    /// A checkpoint: masters and moments.
    Checkpoint(&'a Checkpoint),
}

/// Bytes of this rank's NVMe swap files and optimizer buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SwapUsage {
    /// Bytes held by extents (params, optimizer state, spilled gradients).
    pub allocated_bytes: u64,
    /// Bytes of the swap files (extents plus slack).
    pub file_bytes: u64,
    /// Pinned optimizer swap buffers (NVMe optimizer state only).
    pub optimizer_buffers_bytes: u64,
}

/// The data position a trainer counts from ([`Trainer::first_sample`]),
/// and the runs before it.
#[derive(Debug, Clone)]
pub(super) struct DataBase {
    /// The step the count starts at.
    pub(super) step: u64,
    /// Samples consumed before it.
    pub(super) samples: u64,
    /// The lineage its checkpoints record ([`crate::checkpoint::Manifest::lineage`]):
    /// the resumed checkpoint's, then this run (a new id) from `step`.
    pub(super) lineage: Vec<crate::checkpoint::LineageEntry>,
}

impl Default for DataBase {
    /// A new run: step 0, no sample, a lineage of itself.
    fn default() -> Self {
        DataBase {
            step: 0,
            samples: 0,
            lineage: vec![crate::checkpoint::LineageEntry::new_run(0)],
        }
    }
}

impl Trainer {
    /// Builds the tiers, stores the initial weights and optimizer state.
    /// A directory without weights is initialised with its own seed
    /// ([`ModelDir::seed`]), which must be [`TrainerOptions::seed`]: the
    /// checkpoints record that one as the init's (two different seeds
    /// made weights the manifest's seed does not give).
    pub fn new(
        config: &Config,
        model_dir: &ModelDir,
        data: TokenData,
        opts: TrainerOptions,
    ) -> Result<Self> {
        if !model_dir.has_weights() && model_dir.seed() != opts.seed {
            return Err(EngineError::config(format!(
                "the model directory {} has no weights and is initialised with seed {} (given to \
                 ModelDir::open), but TrainerOptions::seed is {}, which the checkpoints record \
                 as the init's: give both the same seed",
                model_dir.path().display(),
                model_dir.seed(),
                opts.seed
            )));
        }
        Self::build(
            config,
            model_dir.model().clone(),
            WeightSource::Dir(model_dir),
            data,
            opts,
        )
    }

    /// The first sample of `micro` of the step being run on this rank:
    /// after the samples consumed before the trainer's base step (a
    /// resumed run's checkpoint's count), each later step takes the
    /// global batch this run's config gives, micro-batch by micro-batch,
    /// rank by rank. A resume with another global batch so continues at
    /// the sample the checkpoint reached, neither skipping nor repeating.
    pub(super) fn first_sample(&self, micro: usize) -> u64 {
        self.sample_of(micro as u64, self.opts.comm.rank() as u64)
    }

    /// Samples consumed by the steps done (all ranks): where the next
    /// step's first micro-batch of rank 0 starts.
    pub(super) fn samples_consumed(&self) -> u64 {
        self.sample_of(0, 0)
    }

    /// The first sample of micro-batch `micro` of rank `rank` in the step
    /// being run (see [`Trainer::first_sample`]).
    fn sample_of(&self, micro: u64, rank: u64) -> u64 {
        let b = &self.config.batch;
        let (gas, mb) = (
            b.gradient_accumulation_steps.max(1),
            b.micro_batch_size.max(1),
        );
        self.steps_done
            .saturating_sub(self.data_base.step)
            .saturating_mul(gas)
            .saturating_add(micro)
            .saturating_mul(self.opts.comm.world_size() as u64)
            .saturating_add(rank)
            .saturating_mul(mb)
            .saturating_add(self.data_base.samples)
    }

    /// `Err(Stopped)` once a step has failed.
    pub(super) fn check_usable(&self) -> Result<()> {
        match &self.failed {
            Some(cause) => Err(EngineError::Stopped {
                cause: cause.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Records the first error: from then on the trainer refuses to go on.
    pub(super) fn latch<T>(&mut self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            if self.failed.is_none() {
                self.failed = Some(e.to_string());
            }
        }
        r
    }

    /// Whether a write to one of the trainer's swap spaces has failed (the
    /// space is then poisoned: every later transfer fails fast).
    pub fn swap_poisoned(&self) -> bool {
        self.swap_spaces.iter().any(|s| s.is_poisoned())
    }

    /// The swap spaces of this trainer (params first, if on NVMe; then
    /// the optimizer state, if on NVMe).
    pub fn swap_spaces(&self) -> &[Arc<SwapSpace>] {
        &self.swap_spaces
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Threads of the CPU compute kernels, and why (see
    /// [`crate::engine::host::threads`]).
    pub fn compute_threads(&self) -> ComputeThreads {
        self.compute_threads
    }

    /// How long building this trainer took, by part.
    pub fn build_times(&self) -> BuildTimes {
        self.build_times
    }

    /// CPU Adam's threads and why ([`TrainerOptions::adam_threads`]
    /// resolved).
    pub fn adam_threads(&self) -> threads::AdamThreads {
        self.adam_threads
    }

    /// Which CPUs the compute and helper threads run on.
    pub fn placement(&self) -> &threads::Placement {
        &self.placement
    }

    /// The process's malloc settings as this trainer found or made them
    /// (`None`: [`TrainerOptions::keep_heap_mapped`] off).
    pub fn malloc_tuning(&self) -> Option<tierzero_swap::MallocTuning> {
        self.malloc
    }

    /// The layout (shards and sub-groups).
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// How the host holds each sub-group's gradients, by `SubGroupId`
    /// ([`sizing::grad_sum_dtype`]).
    pub fn grad_sum_dtypes(&self) -> &[sizing::SumDtype] {
        &self.grad_sum_dtypes
    }

    /// What the sizing policy decided, as built ([`sizing::decide`]).
    pub fn sizing(&self) -> &Sizing {
        &self.sizing
    }

    /// Pinned host memory this trainer mapped: the bytes of every pinned
    /// arena it made (cpu-tier pages, param and optimizer swap buffers).
    pub fn pinned_mapped_bytes(&self) -> u64 {
        self.arenas.iter().map(|a| a.total_bytes()).sum()
    }

    /// With units computed on a device that stages params
    /// ([`crate::model::exec_units::UnitCompute::stages`]) and params in
    /// the cpu tier's pages: whether the pages are registered with the
    /// device, so the params cross from them in place. None otherwise.
    pub fn pages_registered(&self) -> Option<bool> {
        (self.stages_on_device() && self.sizing.cpu_pages.count > 0)
            .then(|| self.store.pages_registered())
    }

    /// With units computed on a device that stages params and params on
    /// NVMe: whether the param swap buffers are registered with the
    /// device, so params cross from the buffers their reads landed in
    /// (see "Swap buffers kept for the device" in
    /// [`crate::engine::params::store`]). None otherwise.
    pub fn swap_buffers_registered(&self) -> Option<bool> {
        (self.stages_on_device() && self.sizing.params_on_nvme())
            .then(|| self.store.swap_buffers_registered())
    }

    /// Whether units compute on a device that stages params.
    fn stages_on_device(&self) -> bool {
        self.opts
            .compute
            .as_ref()
            .is_some_and(|c| c.on_device() && c.stages())
    }

    /// The activation policy's line for the plan (its budget and where it
    /// came from), or, with units computed elsewhere
    /// ([`TrainerOptions::compute`]), that every block is recomputed.
    pub fn activations_line(&self) -> String {
        if let Some(c) = &self.opts.compute {
            // Only candle's units keep forward graphs (passes.rs); a
            // device compute may keep its blocks' forwards itself.
            return c.activations_line().unwrap_or_else(|| {
                "activations: every block is recomputed in backward from its input \
                 (the device units keep no forward graph); \
                 tierzero.activation_budget_bytes applies to the CPU units"
                    .to_owned()
            });
        }
        self.activations.describe()
    }

    /// Which blocks the activation policy keeps, once the first
    /// micro-batch of the current batch shape decided it.
    pub fn activation_decision(&self) -> Option<&ActivationDecision> {
        self.activations.last_decision()
    }

    /// The parameter store.
    pub fn store(&self) -> &ParamStore {
        &self.store
    }

    /// The prefetcher.
    pub fn prefetcher(&self) -> &Prefetcher {
        &self.sched
    }

    /// Param reads issued ahead of their unit from the trace so far (not
    /// counting a unit's own params, whose reads are issued together when
    /// it is fetched).
    pub fn lookahead_reads(&self) -> u64 {
        self.lookahead_reads
    }

    /// The most gradients handed to the optimizer thread and not answered
    /// yet at one time in this run (steps and spills): at most
    /// [`sizing::grads_in_flight`] where the hand-over is bounded (steps
    /// during backward, speculative steps, spills); the gradients sent
    /// after the decision are counted too and are not bounded by it.
    pub fn grads_handed_over_peak(&self) -> usize {
        self.grads_out_peak
    }

    /// The most stepped sub-groups' new values the optimizer thread had
    /// lent at once in this run (replies not yet stored): at most
    /// [`sizing::values_in_flight`], after a decision too.
    pub fn values_lent_peak(&self) -> usize {
        self.opt.values_lent_peak()
    }

    /// Changes the sequence length from the next step on. A length the
    /// model or the data cannot give is refused here, the trainer usable
    /// (at the next step it would stop the trainer).
    pub fn set_seq_len(&mut self, seq_len: usize) -> Result<()> {
        if seq_len == 0 || seq_len > self.model.config().max_seq_len {
            return Err(EngineError::config(format!(
                "seq_len {seq_len} must be in 1..={}",
                self.model.config().max_seq_len
            )));
        }
        self.data.check_seq_len(seq_len)?;
        if self.opts.compute.is_none() && !self.opts.skip_compute {
            build::check_head_memory(&self.config, &self.model, seq_len)?;
        }
        self.opts.seq_len = seq_len;
        Ok(())
    }

    /// Why the `--metrics` file stopped being written, when a write to it
    /// failed (the run goes on: the writer stops, not the run).
    pub fn metrics_failure(&self) -> Option<&str> {
        self.metrics.as_ref().and_then(MetricsWriter::failure)
    }

    /// Current loss scale.
    pub fn loss_scale(&self) -> f64 {
        self.scaler.scale()
    }

    /// Whether the loss scale is fp16's dynamic one, which a skipped step
    /// lowers (fp32, bf16 and a static fp16 scale have nothing to lower:
    /// a step skipped for a non-finite loss leaves the run where it was).
    pub fn dynamic_loss_scale(&self) -> bool {
        self.scaler.is_dynamic()
    }

    /// Optimizer steps done so far (including skipped ones; a resumed
    /// trainer starts at the checkpoint's).
    pub fn steps_done(&self) -> u64 {
        self.steps_done
    }

    /// Updates applied so far: [`Trainer::steps_done`] less the skipped
    /// steps (a resumed trainer starts at the checkpoint's).
    pub fn adam_steps(&self) -> u64 {
        self.adam_steps
    }

    /// Names the data source in checkpoints (the trainer only sees tokens).
    pub fn set_data_name(&mut self, name: impl Into<String>) {
        self.data_name = name.into();
    }

    /// The fp32 master weights of one sub-group of this rank. A sub-group
    /// this rank does not have is an error that leaves the trainer usable.
    pub fn master(&mut self, sg: SubGroupId) -> Result<Vec<f32>> {
        let groups = self.layout.sub_groups.len();
        if sg.0 >= groups {
            return Err(EngineError::config(format!(
                "sub-group {} does not exist: this rank has {groups} (0..{groups})",
                sg.0
            )));
        }
        self.check_usable()?;
        let r = self.master_inner(sg);
        self.latch(r)
    }

    pub(super) fn master_inner(&mut self, sg: SubGroupId) -> Result<Vec<f32>> {
        self.settle_optimizer()?;
        self.opt.send(Job::Master(sg))?;
        loop {
            match self.opt.recv()? {
                Done::Master(got, m) if got == sg => return Ok(m),
                other => self.on_done(other)?,
            }
        }
    }

    /// The whole fp32 master weights of `pid`, gathered from every rank's
    /// shard (a collective: every rank calls it in the same order).
    /// `cache` holds the last sub-group read, so walking params in order
    /// reads each sub-group once.
    ///
    /// This rank joins the collective even when its own shard could not be
    /// read (an NVMe error, an error the optimizer thread latched): it
    /// sends zeros, and the error comes back inside (`Ok(Err(..))`) once the
    /// others have their gather, so that a walk over the params goes on
    /// joining theirs and no rank waits for a collective that never comes
    /// (a rank that stopped at its error left the others in the next
    /// param's gather until the timeout). `Err`: the collective failed.
    pub(super) fn gather_master_joined(
        &mut self,
        pid: ParamId,
        cache: &mut Option<(SubGroupId, Vec<f32>)>,
    ) -> Result<Result<Vec<f32>>> {
        let slot = self
            .layout
            .params
            .get(pid.0)
            .cloned()
            .ok_or_else(|| EngineError::internal("master of an unknown param"))?;
        // A tiled shard is assembled from its pieces, group by group.
        let mut own = || -> Result<Vec<u8>> {
            let mut shard_bytes: Vec<u8> = Vec::with_capacity(slot.shard_numel * 4);
            for pc in &slot.pieces {
                if cache.as_ref().is_none_or(|(sg, _)| *sg != pc.sub_group) {
                    *cache = Some((pc.sub_group, self.master(pc.sub_group)?));
                }
                let group = cache.as_ref().map(|(_, m)| m.as_slice()).unwrap_or(&[]);
                let piece = group
                    .get(pc.group_range())
                    .ok_or_else(|| EngineError::internal("master shard out of range"))?;
                shard_bytes.extend_from_slice(&crate::le::bytes(piece));
            }
            Ok(shard_bytes)
        };
        let (shard_bytes, own_err) = match own() {
            Ok(b) => (b, None),
            Err(e) => (vec![0u8; slot.shard_numel * 4], Some(e)),
        };
        let counts: Vec<usize> = shard_counts(slot.numel, self.layout.world)
            .iter()
            .map(|c| c * 4)
            .collect();
        let mut full = vec![0u8; slot.numel * 4];
        self.opts
            .comm
            .all_gather_bytes(&shard_bytes, &counts, &mut full)?;
        Ok(match own_err {
            Some(e) => Err(e),
            None => Ok(crate::le::f32s(&full)),
        })
    }

    /// Every parameter's whole fp32 master weights, in `ParamId` order,
    /// gathered from all ranks (a collective). Holds the whole model in
    /// host memory: for tests and export of small models.
    pub fn full_masters(&mut self) -> Result<Vec<Vec<f32>>> {
        let mut out = Vec::with_capacity(self.layout.params.len());
        self.walk_masters(|m| out.push(m))?;
        Ok(out)
    }

    /// `f` of every param's whole fp32 master weights in `ParamId` order
    /// (a collective). Every gather is joined, this rank's own reads
    /// failing or not; the first failure is returned after the walk (see
    /// [`Trainer::gather_master_joined`]).
    pub(super) fn walk_masters(&mut self, mut f: impl FnMut(Vec<f32>)) -> Result<()> {
        let mut cache = None;
        let mut first = None;
        for i in 0..self.layout.params.len() {
            match self.gather_master_joined(ParamId(i), &mut cache)? {
                Ok(m) => f(m),
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// sha256 over every fp32 master weight in `ParamId` order
    /// (little-endian). Several ranks: each param's shards are gathered
    /// (one param at a time), so the hash equals the one-rank hash of the
    /// same weights; every rank computes it (a collective).
    pub fn weight_sha256(&mut self) -> Result<String> {
        if self.layout.world == 1 && groups_concatenate_params(&self.layout) {
            // One rank whose sub-groups hold the params back to back: the
            // masters hashed where they are, on the optimizer thread, with
            // no copy of the model (the general way below copies each
            // group's masters out and each param's again). Settled first,
            // as `master` is: Adam's state on a device is written back,
            // and the queued steps have run.
            self.check_usable()?;
            let r = self.settle_optimizer();
            self.latch(r)?;
            let groups = self.layout.sub_groups.len();
            let r = self.exclusive(move |st| {
                let mut h = Sha256::new();
                for i in 0..groups {
                    st.with_master(SubGroupId(i), |m| h.update(&crate::le::bytes(m)))?;
                }
                Ok(h.finish_hex())
            });
            // A failed read of NVMe masters stops the run, as in `master`.
            return self.latch(r);
        }
        let mut h = Sha256::new();
        self.walk_masters(|m| h.update(&crate::le::bytes(&m)))?;
        Ok(h.finish_hex())
    }

    /// Bytes of this rank's swap files and optimizer swap buffers.
    pub fn swap_usage(&self) -> SwapUsage {
        let file_bytes: u64 = self
            .swap_spaces
            .iter()
            .flat_map(|s| s.files().iter().map(|f| f.capacity_bytes()))
            .sum();
        let free: u64 = self.swap_spaces.iter().map(|s| s.free_bytes()).sum();
        SwapUsage {
            allocated_bytes: file_bytes - free,
            file_bytes,
            optimizer_buffers_bytes: self.sizing.optimizer_buffers.total_bytes(),
        }
    }

    /// Flushes I/O, writes the summary line, returns it.
    pub fn finish(mut self) -> Result<Summary> {
        self.check_usable()?;
        if let Some(tl) = &self.opts.timeline {
            tl.finishing(self.steps_done);
        }
        let r = self.settle_optimizer();
        self.latch(r)?;
        let r = self.store.flush_writes();
        self.latch(r)?;
        // The last step's optimizer tail has ended: its disk time too.
        self.record_disk();
        let (bytes_read, bytes_written) = step::tier_bytes(
            &self.store.counters(),
            &self.opt.counters(),
            &self.park_counters(),
        );
        let s = Summary {
            summary: true,
            bytes_read,
            bytes_written,
            steps: self.steps_done,
            skipped_steps: self.skipped,
            weight_sha256: self.weight_sha256()?,
            peak_rss_bytes: peak_rss_bytes(),
            trace_rerecords: self.sched.rerecords(),
            speculation_hits: self.speculation.hits,
            speculation_misses: self.speculation.misses,
            speculation_pool_waits: self.speculation.pool_waits,
            stopped: self.stopped.map(|c| c.kind().to_owned()),
            stop_signal: self.stopped.and_then(StopCause::signal_name),
        };
        if let Some(w) = &mut self.metrics {
            w.write(&s)?;
        }
        Ok(s)
    }
}

/// Whether the sub-groups, back to back, hold every param's shard in
/// `ParamId` order and nothing else: their masters concatenated are then
/// the shards concatenated.
fn groups_concatenate_params(layout: &Layout) -> bool {
    // The next piece expected: (param, offset in its shard).
    let mut next = (0usize, 0usize);
    for g in &layout.sub_groups {
        let mut at = 0usize;
        for pc in &g.pieces {
            if pc.group_range().start != at || (pc.param.0, pc.offset_in_shard) != next {
                return false;
            }
            at += pc.numel;
            let Some(slot) = layout.params.get(pc.param.0) else {
                return false;
            };
            next = match pc.offset_in_shard + pc.numel {
                end if end == slot.shard_numel => (pc.param.0 + 1, 0),
                end => (pc.param.0, end),
            };
        }
        if at != g.numel {
            return false;
        }
    }
    next == (layout.params.len(), 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The optimizer's fingerprint is the text checkpoints saved before
    /// `bias_correction` was read (its settings' `Debug` text then), so
    /// they resume without a warning that the settings differ; bias
    /// correction off is a difference.
    #[test]
    fn the_optimizer_fingerprint_is_the_text_older_checkpoints_saved() {
        let mut o = config::Optimizer {
            kind: config::OptimizerKind::AdamW,
            lr: 1e-3,
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled_weight_decay: true,
            bias_correction: true,
        };
        assert_eq!(
            checkpoint::optimizer_fingerprint(&o),
            "Optimizer { kind: AdamW, lr: 0.001, betas: [0.9, 0.999], eps: 1e-8, \
             weight_decay: 0.0, decoupled_weight_decay: true }"
        );
        o.bias_correction = false;
        assert!(checkpoint::optimizer_fingerprint(&o).ends_with("without bias correction"));
    }

    /// One rank's layouts, tiled or not, hold the params back to back;
    /// a layout with a piece out of place or missing does not.
    #[test]
    fn one_rank_s_sub_groups_concatenate_the_params() {
        let json = serde_json::json!({"model_type": "gpt2", "vocab_size": 300,
            "n_positions": 16, "n_embd": 32, "n_layer": 2, "n_head": 2,
            "tie_word_embeddings": true});
        let (cfg, _) = crate::model::ModelConfig::from_hf_json(&json.to_string())
            .unwrap_or_else(|e| panic!("{e}"));
        let model = Model::new(cfg).unwrap_or_else(|e| panic!("{e}"));
        for cap in [1000usize, 4096, 9600, 1 << 20] {
            let l = Layout::new(&model, 0, 1, cap);
            assert!(groups_concatenate_params(&l), "cap {cap}");
            let mut swapped = l.clone();
            match swapped.sub_groups.iter_mut().find(|g| g.pieces.len() > 1) {
                Some(g) => g.pieces.swap(0, 1),
                None => swapped.sub_groups.swap(0, 1),
            }
            assert!(!groups_concatenate_params(&swapped), "cap {cap}: swapped");
            let mut short = l.clone();
            if let Some(g) = short.sub_groups.last_mut() {
                g.pieces.pop();
            }
            assert!(
                !groups_concatenate_params(&short),
                "cap {cap}: a piece missing"
            );
        }
    }
}

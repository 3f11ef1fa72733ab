//! The training step of one rank, and the embeddable [`Trainer`] API.
//!
//! # A step
//!
//! ```text
//! lr = schedule(adam steps so far); scale = loss scaler (fp16) or 1
//! for micro in 0..gradient_accumulation_steps:
//!     forward:  for unit in embedding, blocks:   fetch params (prefetch ahead), run, release
//!     backward: for unit in head, blocks reversed, embedding:
//!                   fetch, recompute + backprop (head starts at scale / GAS),
//!                   add fp32 grads into the sub-group accumulators, release;
//!                   last micro-batch: sub-groups whose grads became final
//!                   → no clipping, no fp16: stepped now, on the optimizer
//!                     thread, while backward goes on
//!                   → otherwise: norm pass now (and, with NVMe state, the
//!                     gradient spilled to NVMe, except for the first
//!                     sub-groups, whose state reads started with the
//!                     step and whose gradients stay in memory)
//! decision: Σg² over sub-groups in index order → skip (fp16 overflow) or
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
//! State reads start before the gradients are final ([`Job::Expect`] at
//! the start of the step): without clipping or fp16, in the order backward
//! makes gradients final, as deep as the optimizer's buffers allow; with
//! them, for the first `read_ahead + 1` sub-groups in index order (the
//! ones the tail steps first). With NVMe state and clipping or fp16 those
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
//! ([`tierzero_swap::SwapError::MemlockTooLow`]), and `"auto"` (the
//! default) logs one warning with the numbers and runs with unlocked
//! buffers, so the out-of-the-box run works under a default 8 MiB limit.

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
use crate::config::{self, Config, OffloadDevice, Precision, Stage};
use crate::data::TokenData;
use crate::engine::comm::{agree, all_gather_var, Comm, SingleRank};
use crate::engine::host::threads::{self, ComputeThreads};
use crate::engine::layout::{shard_counts, Layout, SubGroupId};
use crate::engine::observe::metrics::{peak_rss_bytes, MetricsWriter, StepMetrics, Summary};
use crate::engine::observe::timeline::{Lane, Timeline};
use crate::engine::optimizer::state::{buffers_needed, NvmeOptim, OptCounters, OptimizerState};
use crate::engine::optimizer::worker::{
    Done, ExclusiveJob, ExclusiveResult, Job, OptimizerWorker, TensorWant,
};
use crate::engine::params::prefetch::{Limits, Pass, Prefetcher, Visit};
use crate::engine::params::store::{NvmeParams, ParamStore, StoreCounters, Tier};
use crate::engine::{EngineError, Result};
use crate::model::{Model, ModelDir, ParamId, UnitGrads, UnitId, UnitInput, UnitKind, Upstream};
use crate::optim::schedule::{LossScaler, LrSchedule};
use crate::optim::{
    f32_to_bf16_bits, f32_to_f16_bits, AdamHyper, AdamMode, CpuAdam, GradNorm, GradScale, GradStep,
};
use crate::sha256::Sha256;

/// Run options that are not in the ds_config.
#[derive(Debug, Clone)]
pub struct TrainerOptions {
    /// Init seed (models without weights).
    pub seed: u64,
    /// Sequence length (tokens per row).
    pub seq_len: usize,
    /// Compute device.
    pub device: Device,
    /// Collectives (one rank: [`SingleRank`]).
    pub comm: Arc<dyn Comm>,
    /// Threads of the CPU Adam kernel.
    pub adam_threads: NonZeroUsize,
    /// JSON-lines metrics file.
    pub metrics_path: Option<PathBuf>,
    /// Measurement only ("I/O alone"): forward and backward are not
    /// computed. Every parameter is still fetched and released in trace
    /// order, and the optimizer still reads, steps and writes its state
    /// with zero gradients, so a step does exactly the I/O of a real step
    /// and almost none of its compute. The weights it trains are
    /// meaningless; `examples/overlap.rs` uses it to time the I/O phase.
    pub skip_compute: bool,
    /// Fault injection on the swap engines (tests); none by default.
    pub faults: FaultPlan,
    /// A timeline of a window of steps (`--timeline`, see
    /// [`crate::engine::observe::timeline`]); none by default.
    pub timeline: Option<Arc<Timeline>>,
    /// Raise glibc's mmap and trim thresholds for the process (see
    /// [`crate::engine::host::heap`]); on by default.
    pub keep_heap_mapped: bool,
}

/// Fault injectors for the trainer's swap engines: the parameter engine,
/// and the optimizer state's read and write engines. Each injector counts
/// the completions of its own engine (see [`FaultInjector`]).
#[derive(Debug, Clone, Default)]
pub struct FaultPlan {
    /// On the parameter swap engine.
    pub params: Option<Arc<FaultInjector>>,
    /// On the optimizer state's read engine.
    pub optim_read: Option<Arc<FaultInjector>>,
    /// On the optimizer state's write engine.
    pub optim_write: Option<Arc<FaultInjector>>,
}

impl TrainerOptions {
    /// One rank on the CPU, one Adam thread, no metrics file.
    pub fn cpu(seed: u64, seq_len: usize) -> Self {
        TrainerOptions {
            seed,
            seq_len,
            device: Device::Cpu,
            comm: Arc::new(SingleRank),
            adam_threads: NonZeroUsize::MIN,
            metrics_path: None,
            skip_compute: false,
            faults: FaultPlan::default(),
            timeline: None,
            keep_heap_mapped: true,
        }
    }
}

/// What one step did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    /// The metrics line of the step.
    pub metrics: StepMetrics,
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
}

/// One rank's trainer.
#[derive(Debug)]
pub struct Trainer {
    config: Config,
    compute_threads: ComputeThreads,
    /// Which CPUs compute and helper threads run on.
    placement: threads::Placement,
    /// What [`crate::engine::host::heap::keep_heap_mapped`] did (`None`: option off).
    malloc: Option<tierzero_swap::MallocTuning>,
    model: Model,
    data: TokenData,
    opts: TrainerOptions,
    layout: Layout,
    store: ParamStore,
    opt: OptimizerWorker,
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
    spill_grads: bool,
    /// With `spill_grads`, the first this many sub-groups keep their final
    /// gradients in memory (see `build`).
    held_grad_groups: usize,
    data_name: String,
    /// The save dir this trainer owns (see [`crate::checkpoint::SaveDirLock`]).
    save_lock: Option<crate::checkpoint::SaveDirLock>,
    /// Union of the busy time of every I/O engine of this trainer.
    io_clock: Arc<BusyClock>,
    /// With a timeline: the param, optimizer-read and optimizer-write
    /// engines' own clocks (its per-engine disk lanes).
    engine_clocks: Option<[Arc<BusyClock>; 3]>,
    /// Sub-groups whose step job was sent and whose new param bytes have
    /// not been stored yet (see "Optimizer tail" in the module docs).
    pending: Vec<bool>,
    /// A `Flush` was sent and its reply has not arrived.
    flush_open: bool,
    /// Time the compute thread spent waiting for the optimizer thread.
    optimizer_wait: Duration,
    /// This rank's swap spaces (params, optimizer state), for [`Trainer::swap_usage`].
    swap_spaces: Vec<Arc<SwapSpace>>,
    /// Pinned optimizer swap buffers of this rank.
    opt_buffers_bytes: u64,
    /// The first error out of a step; set, the trainer refuses to go on.
    failed: Option<String>,
}

/// Where the initial weights come from.
#[derive(Debug, Clone, Copy)]
enum WeightSource<'a> {
    /// An HF model dir (or its seeded init); moments start at zero.
    Dir(&'a ModelDir),
    /// A checkpoint: masters and moments.
    Checkpoint(&'a Checkpoint),
}

/// The settings that change the numbers, as text, and a hash of the whole
/// resolved config (see [`ConfigFingerprint`]).
pub fn config_fingerprint(config: &Config) -> ConfigFingerprint {
    let mut numerics = BTreeMap::new();
    numerics.insert("batch".to_owned(), format!("{:?}", config.batch));
    numerics.insert(
        "gradient_clipping".to_owned(),
        format!("{:?}", config.gradient_clipping),
    );
    numerics.insert("precision".to_owned(), format!("{:?}", config.precision));
    numerics.insert("optimizer".to_owned(), format!("{:?}", config.optimizer));
    numerics.insert("scheduler".to_owned(), format!("{:?}", config.scheduler));
    numerics.insert(
        "sub_group_size".to_owned(),
        format!("{}", config.zero.sub_group_numel.0),
    );
    let mut h = Sha256::new();
    h.update(format!("{config:?}").as_bytes());
    ConfigFingerprint {
        numerics,
        full_sha256: h.finish_hex(),
    }
}

fn precision_name(p: &Precision) -> &'static str {
    match p {
        Precision::Fp32 => "fp32",
        Precision::Bf16 => "bf16",
        Precision::Fp16 { .. } => "fp16",
    }
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

/// The lock policy of an arena: `pin` is its offload block's `pin_memory`;
/// `lockable` says whether all pinned buffers together fit under
/// `RLIMIT_MEMLOCK` (see the module docs).
fn lock_policy(pin: bool, lockable: bool, memlock: config::Memlock) -> LockPolicy {
    match (pin, lockable, memlock) {
        (false, _, _) | (true, false, _) => LockPolicy::Off,
        (true, true, config::Memlock::Require) => LockPolicy::Require,
        (true, true, config::Memlock::Auto) => LockPolicy::BestEffort,
    }
}

fn engine_config(
    config: &Config,
    clock: &Arc<BusyClock>,
    own_clock: Option<Arc<BusyClock>>,
    faults: Option<Arc<FaultInjector>>,
    thread_cpus: Option<Arc<[usize]>>,
) -> EngineConfig {
    EngineConfig {
        backend: match config.tierzero.io_backend {
            config::IoBackend::Auto => BackendKind::Auto,
            config::IoBackend::Uring => BackendKind::Uring,
            config::IoBackend::Portable => BackendKind::Portable,
        },
        workers: config.tierzero.ring_threads.max(1) as usize,
        queue_depth: config.aio.queue_depth.max(1),
        block_bytes: config.aio.block_bytes.0.max(4096).div_ceil(4096) * 4096,
        sqpoll: false,
        faults,
        busy_clock: Some(clock.clone()),
        own_clock,
        thread_cpus,
    }
}

fn space_config(config: &Config, path: &std::path::Path, capacity_bytes: u64) -> SpaceConfig {
    let mut sc = SpaceConfig::new(path, capacity_bytes.max(1 << 20));
    sc.direct_io = match config.tierzero.direct_io {
        config::DirectIo::Auto => tierzero_swap::DirectIo::Auto,
        config::DirectIo::Require => tierzero_swap::DirectIo::Require,
        config::DirectIo::Off => tierzero_swap::DirectIo::Off,
    };
    sc.checksums = config.tierzero.checksums;
    sc
}

const ALIGN: u64 = 4096;

/// Per sub-group of `layout`: whether its optimizer state stays in host
/// memory although `offload_optimizer.device` is `nvme` (always false
/// without NVMe state). Those are the groups holding a param of the next
/// forward's first units ([`Prefetcher::first_units`], one prefetch
/// bucket), in index order, while their state (12 bytes per element:
/// master, m, v) fits `tierzero.optimizer_resident_bytes`. Auto: one
/// prefetch bucket's state, and never more than a quarter of the rank's
/// state (NVMe offload asks for the state to stay off host memory; auto
/// only takes the tail). See "Resident sub-groups" in `optstate.rs`. The
/// start-up plan shows the same set.
pub fn optimizer_resident_groups(config: &Config, model: &Model, layout: &Layout) -> Vec<bool> {
    let zero = &config.zero;
    if zero.offload_optimizer.device.nvme_path().is_none() {
        return vec![false; layout.sub_groups.len()];
    }
    let bucket = zero.prefetch_bucket_numel.0;
    let state_bytes = (layout.shard_numel() as u64).saturating_mul(12);
    let budget_bytes = config.tierzero.optimizer_resident_bytes.map_or(
        auto_optimizer_resident_bytes(bucket, 12, state_bytes),
        |b| b.0,
    );
    let first_units = Prefetcher::first_units(model, bucket);
    let mut resident = vec![false; layout.sub_groups.len()];
    let mut used_bytes = 0u64;
    for g in &layout.sub_groups {
        if !g
            .params
            .iter()
            .any(|p| first_units.get(p.0).copied().unwrap_or(false))
        {
            continue;
        }
        let bytes = (g.numel as u64).saturating_mul(12);
        if used_bytes.saturating_add(bytes) > budget_bytes {
            break;
        }
        used_bytes += bytes;
        if let Some(r) = resident.get_mut(g.id.0) {
            *r = true;
        }
    }
    resident
}

/// `tierzero.optimizer_resident_bytes: "auto"`: one prefetch bucket of
/// state (`state_bytes_per_elem` each), at most a quarter of all the
/// state (`state_bytes`). Shared with `tierzero estimate`.
pub fn auto_optimizer_resident_bytes(
    prefetch_bucket_numel: u64,
    state_bytes_per_elem: u64,
    state_bytes: u64,
) -> u64 {
    prefetch_bucket_numel
        .saturating_mul(state_bytes_per_elem)
        .min(state_bytes / 4)
}

/// With spilled gradients: the sub-groups below this index keep their
/// final gradients in memory. They are the first `nvme_groups` groups
/// whose state is on NVMe (index order), whose reads start with the step,
/// and the resident groups among them.
pub fn held_grad_bound(resident: &[bool], nvme_groups: usize) -> usize {
    let mut seen = 0;
    for (i, r) in resident.iter().enumerate() {
        if !r {
            seen += 1;
            if seen == nvme_groups {
                return i + 1;
            }
        }
    }
    resident.len()
}

fn align_up(x: u64) -> u64 {
    x.max(1).div_ceil(ALIGN) * ALIGN
}

/// Low-precision bytes of fp32 values (round to nearest even, the same
/// conversion as the optimizer's fused output).
fn encode(values: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::BF16 => values
            .iter()
            .flat_map(|&x| f32_to_bf16_bits(x).to_le_bytes())
            .collect(),
        DType::F16 => values
            .iter()
            .flat_map(|&x| f32_to_f16_bits(x).to_le_bytes())
            .collect(),
        _ => values.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// Bytes read and written per tier (`cpu`, `nvme`), cumulative.
fn tier_bytes(
    store: &StoreCounters,
    opt: &OptCounters,
) -> (BTreeMap<String, u64>, BTreeMap<String, u64>) {
    let read = BTreeMap::from([
        ("cpu".to_string(), store.cpu_read_bytes),
        (
            "nvme".to_string(),
            store.nvme_read_bytes + opt.nvme_read_bytes,
        ),
    ]);
    let written = BTreeMap::from([
        ("cpu".to_string(), store.cpu_written_bytes),
        (
            "nvme".to_string(),
            store.nvme_written_bytes + opt.nvme_written_bytes,
        ),
    ]);
    (read, written)
}

impl Trainer {
    /// Builds the tiers, stores the initial weights and optimizer state.
    pub fn new(
        config: &Config,
        model_dir: &ModelDir,
        data: TokenData,
        opts: TrainerOptions,
    ) -> Result<Self> {
        Self::build(
            config,
            model_dir.model().clone(),
            WeightSource::Dir(model_dir),
            data,
            opts,
        )
    }

    /// A trainer that continues from `ckpt`: the model is the checkpoint's,
    /// masters and moments are loaded (crc-verified) and the params
    /// re-encoded from the masters; step counters, the loss scaler and so
    /// the lr schedule and data position continue where it stopped. With the
    /// same config, the run continues bit-identically.
    ///
    /// Refused ([`CheckpointError::Mismatch`]) when the run cannot use the
    /// checkpoint; warned about when the config's numerics, the seq_len or
    /// the precision of the loss scaler differ.
    pub fn resume(
        config: &Config,
        ckpt: &Checkpoint,
        data: TokenData,
        opts: TrainerOptions,
    ) -> Result<Self> {
        let m = ckpt.manifest();
        let run_fp = config_fingerprint(config);
        // Another rank count with the same global batch and micro-batch
        // size does the same arithmetic (N ranks with accumulation G are
        // one rank with G·N) and reads the same data: not a difference.
        let same_global_batch = m.data.micro_batch_size == config.batch.micro_batch_size
            && m.data
                .micro_batch_size
                .checked_mul(m.data.gradient_accumulation_steps)
                .and_then(|x| x.checked_mul(m.world_size as u64))
                == Some(config.batch.train_batch_size);
        let differing: Vec<&str> = run_fp
            .numerics
            .iter()
            .filter(|(k, v)| m.config.numerics.get(*k) != Some(*v))
            .filter(|(k, _)| !(k.as_str() == "batch" && same_global_batch))
            .map(|(k, _)| k.as_str())
            .collect();
        let world = opts.comm.world_size();
        if m.world_size != world && opts.comm.rank() == 0 {
            tracing::info!(
                checkpoint_ranks = m.world_size,
                ranks = world,
                "resharding the checkpoint: each rank loads its own shard of every parameter"
            );
        }
        if !differing.is_empty() {
            tracing::warn!(
                settings = %differing.join(", "),
                "the training config differs from the checkpoint's in settings that change the \
                 numbers; the resumed run will not match an uninterrupted one"
            );
        }
        if m.seq_len != opts.seq_len {
            tracing::warn!(
                checkpoint = m.seq_len,
                run = opts.seq_len,
                "seq_len differs from the checkpoint's: the data position moves"
            );
        }
        let mut t = Self::build(
            config,
            ckpt.model().clone(),
            WeightSource::Checkpoint(ckpt),
            data,
            opts,
        )?;
        t.steps_done = m.step;
        t.adam_steps = m.adam_steps;
        t.skipped = m.skipped_steps;
        match (
            &m.loss_scaler,
            matches!(config.precision, Precision::Fp16 { .. }),
        ) {
            (Some(s), true) => t.scaler.restore(s),
            (None, true) => tracing::warn!(
                "the checkpoint has no loss-scaler state (not fp16): starting from the config's"
            ),
            _ => {}
        }
        Ok(t)
    }

    fn build(
        config: &Config,
        model: Model,
        source: WeightSource<'_>,
        data: TokenData,
        opts: TrainerOptions,
    ) -> Result<Self> {
        let mc = model.config();
        if data.vocab_needed() > mc.vocab_size {
            return Err(EngineError::config(format!(
                "the data has token ids up to {} but the model's vocab_size is {}",
                data.vocab_needed().saturating_sub(1),
                mc.vocab_size
            )));
        }
        if opts.seq_len == 0 || opts.seq_len > mc.max_seq_len {
            return Err(EngineError::config(format!(
                "seq_len {} must be in 1..={} (the model's max positions)",
                opts.seq_len, mc.max_seq_len
            )));
        }
        let world = opts.comm.world_size();
        let rank = opts.comm.rank();
        if world == 0 || rank >= world {
            return Err(EngineError::internal(format!(
                "rank {rank} of a world of {world}"
            )));
        }
        if config.batch.ranks != world as u64 {
            return Err(EngineError::config(format!(
                "the config was resolved for {} ranks but the communicator has {world}",
                config.batch.ranks
            )));
        }
        // Before any of our threads start (see `threads`).
        let offloaded = config.zero.offload_param.device != OffloadDevice::None
            || config.zero.offload_optimizer.device != OffloadDevice::None;
        let compute_threads = threads::resolve(
            config.tierzero.compute_threads,
            threads::user_env().as_deref(),
            threads::cores(),
            offloaded,
            opts.adam_threads.get(),
            matches!(opts.device, Device::Cpu),
        );
        threads::apply(&compute_threads);
        // The building thread's mask: what `taskset` or a cpuset allows.
        let placement = match tierzero_swap::affinity::current_thread_cpus() {
            Ok(allowed) => threads::place(
                config.tierzero.pin_threads,
                &allowed,
                &compute_threads,
                world,
                offloaded,
            ),
            Err(e) => {
                tracing::warn!(error = %e, "could not read the CPU mask; threads not pinned");
                threads::Placement::Unpinned("the CPU mask could not be read")
            }
        };
        let malloc = opts
            .keep_heap_mapped
            .then(crate::engine::host::heap::keep_heap_mapped);
        let (param_dtype, scaler) = match config.precision {
            Precision::Fp32 => (DType::F32, LossScaler::none()),
            Precision::Bf16 => (DType::BF16, LossScaler::none()),
            Precision::Fp16 { loss_scale } => (DType::F16, LossScaler::from_config(loss_scale)),
        };
        let elem_bytes = config.precision.param_elem_bytes();
        let zero = &config.zero;
        let sub_group = usize::try_from(zero.sub_group_numel.0).unwrap_or(usize::MAX);
        let layout = Layout::new(&model, rank, world, sub_group);
        // Several ranks: each keeps its own swap files under
        // `<nvme_path>/rank<R>/` (one rank: `<nvme_path>` itself).
        let rank_dir = |p: &std::path::Path| -> Result<PathBuf> {
            if world == 1 {
                return Ok(p.to_owned());
            }
            let d = p.join(format!("rank{rank}"));
            std::fs::create_dir_all(&d).map_err(|source| EngineError::Io {
                path: d.clone(),
                source,
            })?;
            Ok(d)
        };
        let mut swap_spaces = Vec::new();

        // Home tier per param.
        let mut tiers = Vec::with_capacity(model.params().len());
        let mut in_cpu = 0u64;
        for slot in &layout.params {
            let t = if zero.stage != Stage::Parameters {
                Tier::Device
            } else {
                match &zero.offload_param.device {
                    OffloadDevice::None => Tier::Device,
                    OffloadDevice::Cpu => Tier::Cpu,
                    OffloadDevice::Nvme { .. } => {
                        let n = slot.shard_numel as u64;
                        if in_cpu + n <= zero.offload_param.max_in_cpu_numel.0 {
                            in_cpu += n;
                            Tier::Cpu
                        } else {
                            Tier::Nvme
                        }
                    }
                }
            };
            tiers.push(t);
        }

        // Pinned budget: param swap buffers, then optimizer buffers.
        let param_nvme = tiers.contains(&Tier::Nvme);
        let opt_nvme = zero
            .offload_optimizer
            .device
            .nvme_path()
            .map(|p| p.to_owned());
        let param_buf_bytes =
            align_up(zero.offload_param.buffer_numel.0.saturating_mul(elem_bytes));
        let param_buf_count = zero.offload_param.buffer_count.max(1);
        let param_pinned = if param_nvme {
            param_buf_bytes * param_buf_count
        } else {
            0
        };
        let read_ahead = usize::from(zero.offload_optimizer.pipeline_read);
        let write_behind = usize::from(zero.offload_optimizer.pipeline_write);
        // Gradient spill: NVMe optimizer state, overlap on, and a step that
        // must wait for the global norm (clipping or fp16).
        let spill_grads = opt_nvme.is_some()
            && config.tierzero.overlap_optimizer
            && (config.gradient_clipping.is_some()
                || matches!(config.precision, Precision::Fp16 { .. }));
        let opt_needed = buffers_needed(read_ahead, write_behind, spill_grads) as u64;
        let opt_buf_bytes = align_up(layout.max_sub_group_numel() as u64 * 4);
        let opt_count = if opt_nvme.is_some() {
            match config.tierzero.pinned_budget_bytes {
                None => opt_needed.max(zero.offload_optimizer.buffer_count),
                Some(b) => {
                    let avail = b.0.saturating_sub(param_pinned) / opt_buf_bytes;
                    if avail < opt_needed {
                        let stages = opt_needed / (3 + u64::from(spill_grads));
                        return Err(EngineError::PinnedBudget {
                            budget_bytes: b.0,
                            param_buffer_count: if param_nvme { param_buf_count } else { 0 },
                            param_buffer_bytes: param_buf_bytes,
                            param_buffers_bytes: param_pinned,
                            optimizer_buffers_needed: opt_needed,
                            optimizer_buffer_bytes: opt_buf_bytes,
                            optimizer_stages: stages,
                            required_bytes: param_pinned + opt_needed * opt_buf_bytes,
                        });
                    }
                    avail.min(opt_needed.max(zero.offload_optimizer.buffer_count))
                }
            }
        } else {
            0
        };
        if let (Some(b), true) = (config.tierzero.pinned_budget_bytes, param_nvme) {
            if param_pinned > b.0 {
                return Err(EngineError::PinnedBudget {
                    budget_bytes: b.0,
                    param_buffer_count: param_buf_count,
                    param_buffer_bytes: param_buf_bytes,
                    param_buffers_bytes: param_pinned,
                    optimizer_buffers_needed: opt_needed,
                    optimizer_buffer_bytes: opt_buf_bytes,
                    optimizer_stages: opt_needed / 3,
                    required_bytes: param_pinned + opt_needed * opt_buf_bytes,
                });
            }
        }

        let io_clock = BusyClock::new();
        // With a timeline, one clock per engine too (its disk lanes): the
        // param engine, the optimizer's read and write engines.
        let engine_clocks: Option<[Arc<BusyClock>; 3]> = opts.timeline.as_ref().map(|_| {
            let c = [BusyClock::new(), BusyClock::new(), BusyClock::new()];
            for k in &c {
                k.set_logging(true);
            }
            c
        });
        let engine_clock = |i: usize| engine_clocks.as_ref().map(|c| c[i].clone());

        // Cpu-tier pages.
        let cpu_shards: Vec<u64> = layout
            .params
            .iter()
            .zip(&tiers)
            .filter(|(_, t)| **t == Tier::Cpu)
            .map(|(s, _)| s.shard_numel as u64 * elem_bytes)
            .collect();
        let (page_bytes, pages) = ParamStore::cpu_page_plan(&cpu_shards);

        // Everything we would page-lock, against RLIMIT_MEMLOCK, before
        // mapping anything.
        let pin_param = zero.offload_param.pin_memory;
        let pin_opt = zero.offload_optimizer.pin_memory;
        let lock_bytes = if pin_param {
            page_bytes.saturating_mul(pages as u64) + param_pinned
        } else {
            0
        } + if pin_opt {
            opt_buf_bytes.saturating_mul(opt_count)
        } else {
            0
        };
        let memlock = config.tierzero.memlock;
        let info = MemlockInfo::current();
        let lockable = lock_bytes == 0 || info.check(lock_bytes).is_ok();
        if !lockable {
            if memlock == config::Memlock::Require {
                return Err(EngineError::Swap(SwapError::MemlockTooLow {
                    requested_bytes: lock_bytes,
                    limit_bytes: info.limit_bytes,
                    locked_bytes: info.locked_bytes,
                }));
            }
            tracing::warn!(
                pinned_bytes = lock_bytes,
                memlock_limit_bytes = info.limit_bytes,
                "the pinned buffers exceed RLIMIT_MEMLOCK; running with unlocked buffers (fix: \
                 `ulimit -l unlimited` or lower the buffers; tierzero.memlock = \"require\" \
                 refuses instead)"
            );
        }
        let cpu_pages = if pages > 0 {
            let mut ac = ArenaConfig::new(page_bytes * pages as u64, page_bytes);
            ac.lock = lock_policy(pin_param, lockable, memlock);
            let arena = PinnedArena::new(ac)?;
            arena.try_acquire_n(pages)?
        } else {
            Vec::new()
        };

        // NVMe for params.
        let nvme_params = if param_nvme {
            let path = zero
                .offload_param
                .device
                .nvme_path()
                .ok_or_else(|| EngineError::internal("nvme tier without nvme_path"))?;
            let cap: u64 = layout
                .params
                .iter()
                .zip(&tiers)
                .filter(|(_, t)| **t == Tier::Nvme)
                .map(|(s, _)| align_up(s.shard_numel as u64 * elem_bytes))
                .sum();
            let path = rank_dir(path)?;
            let space = SwapSpace::create(space_config(config, &path, cap + (1 << 20)))?;
            swap_spaces.push(space.clone());
            let mut ac = ArenaConfig::new(param_pinned, param_buf_bytes);
            ac.lock = lock_policy(pin_param, lockable, memlock);
            let arena = PinnedArena::new(ac)?;
            let engine = Engine::new(
                space,
                arena.clone(),
                engine_config(
                    config,
                    &io_clock,
                    engine_clock(0),
                    opts.faults.params.clone(),
                    placement.helper_cpus(),
                ),
            )?;
            Some(NvmeParams {
                engine,
                arena,
                copier_cpus: placement.helper_cpus(),
                read_gate: crate::engine::params::copier::ParamReadGate::new(),
            })
        } else {
            None
        };
        let param_read_gate = nvme_params.as_ref().map(|n| n.read_gate.clone());
        let mut store = ParamStore::new(
            &model,
            &layout,
            &tiers,
            param_dtype,
            opts.device.clone(),
            opts.comm.clone(),
            cpu_pages,
            nvme_params,
        )?;

        // Optimizer state. With NVMe, the sub-groups holding the params the
        // next forward needs first keep their state in host memory, within
        // `tierzero.optimizer_resident_bytes` ("Resident sub-groups" in
        // optstate.rs).
        let resident = optimizer_resident_groups(config, &model, &layout);
        let nvme_opt = match &opt_nvme {
            Some(path) => {
                let cap: u64 = layout
                    .sub_groups
                    .iter()
                    .filter(|g| !resident.get(g.id.0).copied().unwrap_or(false))
                    .map(|g| (3 + u64::from(spill_grads)) * align_up(g.numel as u64 * 4))
                    .sum();
                let path = rank_dir(path)?;
                let space = SwapSpace::create(space_config(config, &path, cap + (1 << 20)))?;
                swap_spaces.push(space.clone());
                let mut ac = ArenaConfig::new(opt_buf_bytes * opt_count, opt_buf_bytes);
                ac.lock = lock_policy(pin_opt, lockable, memlock);
                let arena = PinnedArena::new(ac)?;
                let read = Engine::new(
                    space.clone(),
                    arena.clone(),
                    engine_config(
                        config,
                        &io_clock,
                        engine_clock(1),
                        opts.faults.optim_read.clone(),
                        placement.helper_cpus(),
                    ),
                )?;
                let write = Engine::new(
                    space,
                    arena.clone(),
                    engine_config(
                        config,
                        &io_clock,
                        engine_clock(2),
                        opts.faults.optim_write.clone(),
                        placement.helper_cpus(),
                    ),
                )?;
                Some(NvmeOptim { read, write, arena })
            }
            None => None,
        };
        let mut opt = OptimizerState::new(
            layout.sub_groups.iter().map(|g| g.numel).collect(),
            nvme_opt,
            &resident,
            read_ahead,
            write_behind,
            spill_grads,
        )?;

        // Initial weights: fp32 master → stored bytes; masters per sub-group
        // (and, from a checkpoint, the moments).
        for g in &layout.sub_groups {
            let mut states = [
                vec![0f32; g.numel],
                vec![0f32; g.numel],
                vec![0f32; g.numel],
            ];
            match source {
                WeightSource::Dir(dir) => {
                    for &pid in &g.params {
                        let slot = &layout.params[pid.0];
                        let at = slot.offset_in_group..slot.offset_in_group + slot.shard_numel;
                        let t = dir.load_param(pid, DType::F32, &Device::Cpu)?;
                        let all = t.flatten_all()?.to_vec1::<f32>()?;
                        let shard = all
                            .get(slot.shard_start..slot.shard_start + slot.shard_numel)
                            .ok_or_else(|| EngineError::internal("shard out of range"))?;
                        states[0][at].copy_from_slice(shard);
                    }
                }
                // Reshard on load: exactly this rank's range of each param,
                // assembled from whichever ranks of the checkpoint hold it
                // (any world size, any sub_group_size). One state at a
                // time, so the reader keeps one region per source rank.
                WeightSource::Checkpoint(ckpt) => {
                    for kind in StateKind::ALL {
                        for &pid in &g.params {
                            let slot = &layout.params[pid.0];
                            let v = ckpt.load_param_state_range(
                                kind,
                                pid,
                                slot.shard_start,
                                slot.shard_numel,
                            )?;
                            states[kind.index()]
                                [slot.offset_in_group..slot.offset_in_group + slot.shard_numel]
                                .copy_from_slice(&v);
                        }
                    }
                }
            }
            for &pid in &g.params {
                let slot = &layout.params[pid.0];
                let shard =
                    &states[0][slot.offset_in_group..slot.offset_in_group + slot.shard_numel];
                store.store_initial(pid, &encode(shard, param_dtype))?;
            }
            opt.load_group(g.id, [&states[0], &states[1], &states[2]])?;
        }
        if let WeightSource::Checkpoint(ckpt) = source {
            ckpt.release_cache();
        }
        opt.flush()?;

        let o = &config.optimizer;
        let hyper = AdamHyper {
            lr: o.lr,
            beta1: o.betas[0],
            beta2: o.betas[1],
            eps: o.eps,
            weight_decay: o.weight_decay,
            mode: if o.decoupled_weight_decay {
                AdamMode::AdamW
            } else {
                AdamMode::L2
            },
            bias_correction: true,
        };
        let adam = CpuAdam::new(hyper, opts.adam_threads)?;
        // With spilled gradients, the state reads of the first sub-groups
        // (index order: the next forward needs them first) are issued when
        // the step starts (`Job::Expect`), and those groups' gradients are
        // held in memory instead of spilled: a read issued before its
        // spill would miss it. As many NVMe groups as the pipeline reads at
        // once (resident groups among them are read by nobody), so the set
        // is fixed by the config, not by timing.
        let held_grad_groups = if spill_grads {
            held_grad_bound(&resident, opt.read_ahead() + 1)
        } else {
            0
        };
        if opts.timeline.is_some() {
            io_clock.set_logging(true);
        }
        let opt = OptimizerWorker::spawn(
            opt,
            adam.clone(),
            param_dtype,
            opts.timeline.clone(),
            placement.helper_cpus(),
            param_read_gate,
        )?;
        let limits = Limits {
            prefetch_bucket_numel: zero.prefetch_bucket_numel.0,
            max_live_numel: zero.max_live_parameters_numel.0,
            max_reuse_distance_numel: zero.max_reuse_distance_numel.0,
            persistence_threshold_numel: zero.param_persistence_threshold_numel.0,
            device_cache_bytes: config.tierzero.device_cache_bytes.0,
        };
        let sched = Prefetcher::new(&model, limits);
        let n_sub_groups = layout.sub_groups.len();
        let mut groups_after_unit = vec![Vec::new(); model.units().len()];
        for g in &layout.sub_groups {
            if let Some(v) = groups_after_unit.get_mut(g.final_after_unit.0) {
                v.push(g.id);
            }
        }
        // The order a step's sub-groups become final in backward (units in
        // reverse, each unit's groups), then any left, by index: the order
        // of the Step jobs without clipping or fp16.
        let mut backward_order: Vec<SubGroupId> = Vec::with_capacity(n_sub_groups);
        let mut listed = vec![false; n_sub_groups];
        for v in groups_after_unit.iter().rev() {
            for &g in v {
                if let Some(seen) = listed.get_mut(g.0) {
                    if !*seen {
                        *seen = true;
                        backward_order.push(g);
                    }
                }
            }
        }
        for (i, seen) in listed.iter().enumerate() {
            if !seen {
                backward_order.push(SubGroupId(i));
            }
        }
        let metrics = match &opts.metrics_path {
            Some(p) => Some(MetricsWriter::create(p)?),
            None => None,
        };
        Ok(Trainer {
            compute_threads,
            placement,
            malloc,
            config: config.clone(),
            model,
            data,
            opts,
            layout,
            store,
            opt,
            sched,
            adam,
            lr: LrSchedule {
                scheduler: config.scheduler,
                base_lr: config.optimizer.lr,
            },
            scaler,
            steps_done: 0,
            adam_steps: 0,
            skipped: 0,
            metrics,
            groups_after_unit,
            backward_order,
            lookahead_reads: 0,
            spill_grads,
            held_grad_groups,
            data_name: "unnamed".to_owned(),
            save_lock: None,
            io_clock,
            engine_clocks,
            pending: vec![false; n_sub_groups],
            flush_open: false,
            optimizer_wait: Duration::ZERO,
            swap_spaces,
            opt_buffers_bytes: opt_buf_bytes * opt_count,
            failed: None,
        })
    }

    /// `Err(Stopped)` once a step has failed.
    fn check_usable(&self) -> Result<()> {
        match &self.failed {
            Some(cause) => Err(EngineError::Stopped {
                cause: cause.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Records the first error: from then on the trainer refuses to go on.
    fn latch<T>(&mut self, r: Result<T>) -> Result<T> {
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

    /// Changes the sequence length from the next step on.
    pub fn set_seq_len(&mut self, seq_len: usize) -> Result<()> {
        if seq_len == 0 || seq_len > self.model.config().max_seq_len {
            return Err(EngineError::config(format!(
                "seq_len {seq_len} must be in 1..={}",
                self.model.config().max_seq_len
            )));
        }
        self.opts.seq_len = seq_len;
        Ok(())
    }

    /// Current loss scale.
    pub fn loss_scale(&self) -> f64 {
        self.scaler.scale()
    }

    fn overlap_mode(&self) -> OverlapMode {
        if !self.config.tierzero.overlap_optimizer {
            OverlapMode::None
        } else if self.config.gradient_clipping.is_some()
            || matches!(self.config.precision, Precision::Fp16 { .. })
        {
            OverlapMode::Io
        } else {
            OverlapMode::Step
        }
    }

    /// Fetches the params of `unit` (declared order), after issuing the
    /// prefetcher's prefetches.
    pub fn fetch_unit(&mut self, unit: UnitId) -> Result<Vec<Tensor>> {
        self.check_usable()?;
        let r = self.fetch_unit_inner(unit);
        self.latch(r)
    }

    fn fetch_unit_inner(&mut self, unit: UnitId) -> Result<Vec<Tensor>> {
        // This unit's own params first: their reads are issued together
        // (not one synchronous read after another), then the window ahead.
        // A param whose write-back is still queued is skipped, not waited
        // for: only running out of swap buffers ends the window.
        let ids = self.model.unit(unit)?.params.clone();
        // The last step's optimizer may still be running (its tail overlaps
        // this step's forward): this unit's params must be the new ones.
        self.drain_done()?;
        for &p in &ids {
            self.wait_stepped(self.layout.params[p.0].sub_group)?;
        }
        self.store.harvest()?;
        let ahead = self.sched.prefetch_candidates(&self.store);
        for (k, &p) in ids.iter().chain(&ahead).enumerate() {
            if self.store.free_buffers() == 0 {
                break;
            }
            // A read of a param whose new bytes are still coming would be
            // wasted (the update replaces it): skip it.
            if self.pending[self.layout.params[p.0].sub_group.0] {
                continue;
            }
            if self.store.prefetch(p)? && k >= ids.len() {
                self.lookahead_reads += 1;
            }
        }
        ids.iter().map(|&p| self.store.fetch(p)).collect()
    }

    /// Releases the params of `unit` that the prefetcher does not keep.
    pub fn release_unit(&mut self, unit: UnitId) -> Result<()> {
        self.check_usable()?;
        let r = self.release_unit_inner(unit);
        self.latch(r)
    }

    fn release_unit_inner(&mut self, unit: UnitId) -> Result<()> {
        let ids = self.model.unit(unit)?.params.clone();
        for p in ids {
            let bytes = self.store.device_bytes(p);
            if !self.sched.keep(p, bytes) {
                self.store.release(p)?;
            }
        }
        Ok(())
    }

    /// Waits until the new param bytes of `sg` (if a step of it is
    /// running) are stored.
    fn wait_stepped(&mut self, sg: SubGroupId) -> Result<()> {
        while self.pending.get(sg.0).copied().unwrap_or(false) {
            let t0 = Instant::now();
            let d = self.opt.recv()?;
            self.optimizer_wait += t0.elapsed();
            self.on_done(d)?;
        }
        Ok(())
    }

    /// Waits until the optimizer thread has finished every step and write
    /// of the last step, and their new param bytes are stored and written
    /// to their home tier: afterwards no I/O of the last step is in flight.
    pub fn settle_optimizer(&mut self) -> Result<()> {
        while self.flush_open || self.pending.iter().any(|p| *p) {
            let t0 = Instant::now();
            let d = self.opt.recv()?;
            self.optimizer_wait += t0.elapsed();
            self.on_done(d)?;
        }
        self.store.flush_writes()
    }

    fn visit(&mut self, unit: UnitId, pass: Pass, shape: [usize; 2]) -> Result<()> {
        if !self.sched.visit(Visit { unit, pass, shape }) {
            // The trace was wrong: finish every read we issued on its word.
            self.store.settle()?;
        }
        Ok(())
    }

    /// Runs one optimizer step (all micro-batches). After an error the
    /// trainer is stopped (see the module docs).
    pub fn step(&mut self) -> Result<StepReport> {
        self.check_usable()?;
        // The calling thread computes this step on the compute CPUs, and
        // gets its own mask back after (`threads::ComputePin`).
        let _pin = self
            .placement
            .compute_cpus()
            .map(threads::ComputePin::enter);
        let r = self.step_inner();
        self.latch(r)
    }

    fn step_inner(&mut self) -> Result<StepReport> {
        let t_step = Instant::now();
        let this_step = self.steps_done + 1;
        if let Some(tl) = &self.opts.timeline {
            self.record_disk();
            tl.begin_step(this_step);
        }
        let c0 = self.store.counters();
        let o0 = self.opt.counters();
        let busy0 = self.io_clock.busy_s();
        let wait0 = self.optimizer_wait;
        let mut compute = Duration::ZERO;
        let mut norm_time = Duration::ZERO;

        let gas = self.config.batch.gradient_accumulation_steps.max(1) as usize;
        let mb = self.config.batch.micro_batch_size.max(1) as usize;
        let world = self.opts.comm.world_size() as u64;
        let rank = self.opts.comm.rank() as u64;
        let seq = self.opts.seq_len;
        let loss_scale = self.scaler.scale();
        let mode = self.overlap_mode();
        let lr = self.lr.lr(self.adam_steps);
        let mut hyper = *self.adam.hyper();
        hyper.lr = lr;
        self.adam.set_hyper(hyper)?;
        let adam_step = self.adam_steps + 1;
        let n_groups = self.layout.sub_groups.len();
        let mut grads: Vec<Option<Vec<f32>>> = vec![None; n_groups];
        // A micro-batch's gradient of a param used by several units (a tied
        // embedding), summed locally until its last unit (see accumulate).
        let mut pending: BTreeMap<ParamId, Vec<f32>> = BTreeMap::new();
        let mut sq: Vec<Option<f64>> = vec![None; n_groups];
        // Sub-groups in the order their state reads were requested.
        let mut order: Vec<SubGroupId> = Vec::with_capacity(n_groups);
        let mut sent = vec![false; n_groups];
        let mut spilled = vec![false; n_groups];
        // The head's gradient starts at scale / (GAS · ranks): the mean over
        // the global batch, as one rank with GAS · ranks micro-batches.
        let head_scale = loss_scale / (gas as f64 * world as f64);
        let units: Vec<(UnitId, UnitKind)> =
            self.model.units().iter().map(|u| (u.id, u.kind)).collect();
        let mut micro_losses = vec![0f32; gas];
        self.sched.begin_step();
        if mode == OverlapMode::Io && self.spill_grads {
            // Steps come after backward, in index order; the first groups'
            // state reads start now (their gradients are held, see
            // `held_grad_groups`).
            self.opt
                .send(Job::Expect((0..n_groups).map(SubGroupId).collect()))?;
        } else if mode == OverlapMode::Step {
            // The order the Step jobs will come in (`backward_order`); the
            // worker starts their state reads now.
            self.opt.send(Job::Expect(self.backward_order.clone()))?;
        }

        for micro in 0..gas {
            let first = ((self.steps_done * gas as u64 + micro as u64) * world + rank) * mb as u64;
            let (ids, targets) = self.data.batch(first, mb, seq, &self.opts.device)?;
            let shape = [mb, seq];
            let last_micro = micro + 1 == gas;
            // Forward over everything but the head, saving unit inputs.
            let mut saved: Vec<Option<Tensor>> = vec![None; units.len()];
            let mut hidden: Option<Tensor> = None;
            for &(uid, kind) in &units {
                if kind == UnitKind::Head {
                    saved[uid.0] = hidden.clone();
                    continue;
                }
                self.visit(uid, Pass::Forward, shape)?;
                let tf = Instant::now();
                let params = self.fetch_unit(uid)?;
                self.span(this_step, Lane::Params, || format!("u{} fwd", uid.0), tf);
                if self.opts.skip_compute {
                    drop(params);
                    self.release_unit(uid)?;
                    continue;
                }
                let t0 = Instant::now();
                let out = match (kind, &hidden) {
                    (UnitKind::Embedding, _) => {
                        self.model
                            .forward_unit(uid, &params, UnitInput::Tokens(&ids))?
                    }
                    (_, Some(h)) => {
                        saved[uid.0] = Some(h.clone());
                        self.model
                            .forward_unit(uid, &params, UnitInput::Hidden(h))?
                    }
                    (_, None) => return Err(EngineError::internal("block before embedding")),
                };
                compute += t0.elapsed();
                self.span(this_step, Lane::Compute, || format!("fwd u{}", uid.0), t0);
                drop(params);
                self.release_unit(uid)?;
                hidden = Some(out.into_tensor());
            }
            // Backward in reverse, by recompute.
            let mut upstream: Option<Tensor> = None;
            for &(uid, kind) in units.iter().rev() {
                self.visit(uid, Pass::Backward, shape)?;
                let tf = Instant::now();
                let params = self.fetch_unit(uid)?;
                self.span(this_step, Lane::Params, || format!("u{} bwd", uid.0), tf);
                let t0 = Instant::now();
                let g = match kind {
                    _ if self.opts.skip_compute => UnitGrads {
                        params: Vec::new(),
                        input: None,
                        loss: None,
                    },
                    UnitKind::Head => {
                        let h = saved[uid.0]
                            .as_ref()
                            .ok_or_else(|| EngineError::internal("head input missing"))?;
                        self.model.backward_unit(
                            uid,
                            &params,
                            UnitInput::HiddenWithTargets {
                                hidden: h,
                                targets: &targets,
                            },
                            Upstream::LossScale(head_scale),
                        )?
                    }
                    UnitKind::Block { .. } => {
                        let h = saved[uid.0]
                            .as_ref()
                            .ok_or_else(|| EngineError::internal("block input missing"))?;
                        let up = upstream
                            .as_ref()
                            .ok_or_else(|| EngineError::internal("upstream missing"))?;
                        self.model.backward_unit(
                            uid,
                            &params,
                            UnitInput::Hidden(h),
                            Upstream::Grad(up),
                        )?
                    }
                    UnitKind::Embedding => {
                        let up = upstream
                            .as_ref()
                            .ok_or_else(|| EngineError::internal("upstream missing"))?;
                        self.model.backward_unit(
                            uid,
                            &params,
                            UnitInput::Tokens(&ids),
                            Upstream::Grad(up),
                        )?
                    }
                };
                drop(params);
                if let Some(l) = &g.loss {
                    let l = l.to_dtype(DType::F32)?.to_scalar::<f32>()?;
                    if let Some(m) = micro_losses.get_mut(micro) {
                        *m += l;
                    }
                }
                for (pid, grad) in &g.params {
                    self.accumulate(&mut grads, &mut pending, uid, *pid, grad)?;
                }
                compute += t0.elapsed();
                self.span(this_step, Lane::Compute, || format!("bwd u{}", uid.0), t0);
                upstream = g.input;
                saved[uid.0] = None;
                self.release_unit(uid)?;
                crate::failpoint::kill_point(crate::failpoint::Site::StepBackward);
                // Params of sub-groups the optimizer thread has finished.
                self.drain_done()?;
                if last_micro && mode != OverlapMode::None {
                    let finals = self
                        .groups_after_unit
                        .get(uid.0)
                        .cloned()
                        .unwrap_or_default();
                    for sg in finals {
                        match mode {
                            OverlapMode::Step => {
                                let grad = grads[sg.0].take().unwrap_or_else(|| {
                                    vec![0f32; self.layout.sub_groups[sg.0].numel]
                                });
                                self.opt.send(Job::Step {
                                    sg,
                                    grad: Some(grad),
                                    scale: GradScale::ONE,
                                    step: adam_step,
                                    hyper,
                                    tensors: self.tensor_wants(sg),
                                })?;
                                order.push(sg);
                                sent[sg.0] = true;
                                self.pending[sg.0] = true;
                            }
                            _ => {
                                // The norm now; the step after backward, in
                                // index order (see "Optimizer tail").
                                let t0 = Instant::now();
                                sq[sg.0] = Some(self.group_sq_norm(&grads, sg));
                                norm_time += t0.elapsed();
                                if self.spill_grads && sg.0 >= self.held_grad_groups {
                                    let grad = grads[sg.0].take().unwrap_or_else(|| {
                                        vec![0f32; self.layout.sub_groups[sg.0].numel]
                                    });
                                    self.opt.send(Job::SpillGrad { sg, grad })?;
                                    spilled[sg.0] = true;
                                }
                            }
                        }
                    }
                }
            }
        }

        let loss = self.global_loss(&micro_losses)?;
        let overlapped = sent.iter().filter(|x| **x).count() as u64;
        // Decision.
        let fp16 = matches!(self.config.precision, Precision::Fp16 { .. });
        let clip = self.config.gradient_clipping;
        let mut grad_norm = None;
        let decision = if mode == OverlapMode::Step {
            GradNorm::from_sq_sum(0.0).scale_for_step(loss_scale, None)?
        } else if fp16 || clip.is_some() {
            let t0 = Instant::now();
            let mut total = 0f64;
            for (i, s) in sq.iter_mut().enumerate() {
                let v = match s {
                    Some(v) => *v,
                    None => self.group_sq_norm(&grads, SubGroupId(i)),
                };
                *s = Some(v);
                total += v;
            }
            norm_time += t0.elapsed();
            let total = self.opts.comm.all_reduce_sum_f64(total)?;
            let gn = GradNorm::from_sq_sum(total);
            grad_norm = Some(gn.norm(loss_scale));
            gn.scale_for_step(loss_scale, clip)?
        } else {
            GradNorm::from_sq_sum(0.0).scale_for_step(loss_scale, None)?
        };
        let skipped = match decision {
            GradStep::Skip => {
                self.opt.send(Job::CancelReads)?;
                true
            }
            GradStep::Apply(scale) => {
                // The rest, in read order first, then index order.
                for i in 0..n_groups {
                    if !order.contains(&SubGroupId(i)) {
                        order.push(SubGroupId(i));
                    }
                }
                for &sg in &order {
                    if sent[sg.0] {
                        continue;
                    }
                    let grad = if spilled[sg.0] {
                        None
                    } else {
                        Some(
                            grads[sg.0]
                                .take()
                                .unwrap_or_else(|| vec![0f32; self.layout.sub_groups[sg.0].numel]),
                        )
                    };
                    self.opt.send(Job::Step {
                        sg,
                        grad,
                        scale,
                        step: adam_step,
                        hyper,
                        tensors: self.tensor_wants(sg),
                    })?;
                    sent[sg.0] = true;
                    self.pending[sg.0] = true;
                }
                false
            }
        };
        // The optimizer tail runs on while the next step's forward starts:
        // `fetch_unit` waits for the sub-groups it needs, `settle_optimizer`
        // for all of them.
        self.opt.send(Job::Flush)?;
        self.flush_open = true;
        self.drain_done()?;
        let opt_wait = self.optimizer_wait.saturating_sub(wait0);
        self.scaler.update(skipped);
        if skipped {
            self.skipped += 1;
        } else {
            self.adam_steps += 1;
        }
        self.steps_done += 1;

        // Metrics.
        let wall = t_step.elapsed().as_secs_f64();
        self.span(
            this_step,
            Lane::Step,
            || format!("step {this_step}"),
            t_step,
        );
        self.record_disk();
        let c1 = self.store.counters();
        let o1 = self.opt.counters();
        let io_wait = (c1.io_wait + o1.io_wait).saturating_sub(c0.io_wait + o0.io_wait);
        let optimizer = o1.adam.saturating_sub(o0.adam) + norm_time;
        let io_busy = (self.io_clock.busy_s() - busy0).max(0.0);
        let compute_s = compute.as_secs_f64();
        let io_wait_s = io_wait.as_secs_f64();
        let optimizer_s = optimizer.as_secs_f64();
        let (r0, w0) = tier_bytes(&c0, &o0);
        let (mut bytes_read, mut bytes_written) = tier_bytes(&c1, &o1);
        for (now, before) in [(&mut bytes_read, r0), (&mut bytes_written, w0)] {
            for (tier, b) in before {
                if let Some(n) = now.get_mut(&tier) {
                    *n = n.saturating_sub(b);
                }
            }
        }
        let tokens = (mb * gas * seq) as f64 * world as f64;
        let main_busy = compute_s + (c1.io_wait.saturating_sub(c0.io_wait)).as_secs_f64();
        let metrics = StepMetrics {
            step: self.steps_done,
            loss,
            tokens_per_s: if wall > 0.0 { tokens / wall } else { 0.0 },
            wall_s: wall,
            compute_s,
            io_wait_s,
            optimizer_s,
            idle_s: (wall - main_busy - opt_wait.as_secs_f64()).max(0.0),
            io_busy_s: io_busy,
            bytes_read,
            bytes_written,
            peak_rss_bytes: peak_rss_bytes(),
            overlap_efficiency: if wall > 0.0 {
                compute_s.max(io_busy).max(optimizer_s) / wall
            } else {
                0.0
            },
            lr,
            loss_scale,
            skipped,
            grad_norm,
            sub_groups_stepped_during_backward: overlapped,
            param_write_wait_s: c1.write_wait.saturating_sub(c0.write_wait).as_secs_f64(),
        };
        if let Some(w) = &mut self.metrics {
            w.write(&metrics)?;
        }
        Ok(StepReport { metrics })
    }

    /// A compute-thread span of step `step` (1-based) from `start` to
    /// now, if the timeline keeps that step.
    fn span(&self, step: u64, lane: Lane, name: impl FnOnce() -> String, start: Instant) {
        if let Some(tl) = &self.opts.timeline {
            if tl.keeps(step) {
                tl.span(lane, name, start, Instant::now());
            }
        }
    }

    /// Moves the disk's finished busy periods into the timeline.
    fn record_disk(&self) {
        if let Some(tl) = &self.opts.timeline {
            tl.disk(Lane::Disk, &self.io_clock.take_periods());
            if let Some(c) = &self.engine_clocks {
                let lanes = [
                    Lane::DiskParams,
                    Lane::DiskStateReads,
                    Lane::DiskStateWrites,
                ];
                for (clock, lane) in c.iter().zip(lanes) {
                    tl.disk(lane, &clock.take_periods());
                }
            }
        }
    }

    fn group_sq_norm(&self, grads: &[Option<Vec<f32>>], sg: SubGroupId) -> f64 {
        match grads.get(sg.0).and_then(|g| g.as_ref()) {
            Some(g) => self.adam.grad_sq_norm(g),
            None => 0.0,
        }
    }

    /// Adds one unit's gradient of `pid` into the sub-group accumulator.
    ///
    /// A param used by several units (a tied embedding: head, then
    /// embedding) gets several gradients per micro-batch; they are first
    /// summed locally in backward order (`h + e`) and reduced once, after
    /// its last unit (the smallest, reached last in backward). Every
    /// micro-batch thus adds exactly one gradient per param into the
    /// accumulator, and N ranks adding theirs in rank order reproduce one
    /// rank's order over the same micro-batches bit for bit. The price is
    /// one full fp32 gradient of such a param held during backward (as
    /// PyTorch's autograd holds it before ZeRO's hook sees it).
    fn accumulate(
        &self,
        grads: &mut [Option<Vec<f32>>],
        pending: &mut BTreeMap<ParamId, Vec<f32>>,
        unit: UnitId,
        pid: ParamId,
        grad: &Tensor,
    ) -> Result<()> {
        let slot = self
            .layout
            .params
            .get(pid.0)
            .ok_or_else(|| EngineError::internal("grad of unknown param"))?;
        let full = grad
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_device(&Device::Cpu)?
            .to_vec1::<f32>()?;
        let full = match pending.remove(&pid) {
            Some(mut sum) => {
                for (a, b) in sum.iter_mut().zip(&full) {
                    *a += *b;
                }
                sum
            }
            None => full,
        };
        let last_unit = self
            .model
            .params()
            .get(pid.0)
            .and_then(|p| p.units.iter().copied().min())
            .unwrap_or(unit);
        if unit != last_unit {
            pending.insert(pid, full);
            return Ok(());
        }
        let g = &self.layout.sub_groups[slot.sub_group.0];
        let acc = grads[slot.sub_group.0].get_or_insert_with(|| vec![0f32; g.numel]);
        let dst = acc
            .get_mut(slot.offset_in_group..slot.offset_in_group + slot.shard_numel)
            .ok_or_else(|| EngineError::internal("grad slot out of range"))?;
        // Every rank's chunk of this rank's shard is added in rank order
        // (reduce-scatter), straight into the accumulator.
        let counts = shard_counts(slot.numel, self.layout.world);
        self.opts.comm.reduce_scatter_add_f32(&full, &counts, dst)
    }

    /// The step's loss: every rank's micro-batch losses, all-gathered and
    /// summed in global micro-batch order (micro `k` of rank `r` is global
    /// micro-batch `k · ranks + r`, the data order), divided by their count.
    /// The same bits on every rank, and the same as one rank running all
    /// the micro-batches.
    fn global_loss(&self, micro_losses: &[f32]) -> Result<f32> {
        let world = self.opts.comm.world_size();
        let gas = micro_losses.len();
        let local: Vec<f64> = micro_losses.iter().map(|&l| f64::from(l)).collect();
        let mut all = vec![0f64; gas * world];
        self.opts.comm.all_gather_f64(&local, &mut all)?;
        let mut sum = 0f32;
        for k in 0..gas {
            for r in 0..world {
                // Exact: the values are f32s carried in f64s.
                sum += all[r * gas + k] as f32;
            }
        }
        Ok(sum / (gas * world) as f32)
    }

    /// Applies the optimizer thread's replies that are already there.
    fn drain_done(&mut self) -> Result<()> {
        while let Some(d) = self.opt.try_recv() {
            self.on_done(d)?;
        }
        Ok(())
    }

    /// The params of `sg` whose new tensors the optimizer thread should
    /// build: those [`Trainer::on_done`]'s update will leave resident as
    /// things stand now ([`ParamStore::stays_resident`]), with one rank
    /// only. A guess that turns out wrong costs only time: a tensor not
    /// needed is dropped, one missing is built by the store.
    fn tensor_wants(&self, sg: SubGroupId) -> Vec<TensorWant> {
        if self.layout.world > 1 {
            return Vec::new();
        }
        let Some(g) = self.layout.sub_groups.get(sg.0) else {
            return Vec::new();
        };
        g.params
            .iter()
            .filter(|&&pid| {
                self.store
                    .stays_resident(pid, self.sched.keep_after_update(pid))
            })
            .filter_map(|&pid| {
                let shape = self.model.params().get(pid.0)?.shape.clone();
                Some(TensorWant {
                    param: pid,
                    offset_in_group: self.layout.params.get(pid.0)?.offset_in_group,
                    shape,
                })
            })
            .collect()
    }

    /// Stores the new param bytes of a stepped sub-group.
    fn on_done(&mut self, done: Done) -> Result<()> {
        match done {
            Done::Stepped { sg, bytes, tensors } => {
                let t0 = Instant::now();
                let g = self
                    .layout
                    .sub_groups
                    .get(sg.0)
                    .ok_or_else(|| EngineError::internal("stepped an unknown sub-group"))?;
                let params = g.params.clone();
                let eb = self.store.device_bytes_per_elem() as usize;
                let mut built: HashMap<ParamId, Tensor> = tensors.into_iter().collect();
                for pid in params {
                    let slot = &self.layout.params[pid.0];
                    let range =
                        slot.offset_in_group * eb..(slot.offset_in_group + slot.shard_numel) * eb;
                    let shard = bytes
                        .get(range)
                        .ok_or_else(|| EngineError::internal("param bytes out of range"))?;
                    let keep = self.sched.keep_after_update(pid);
                    self.store.update(pid, shard, keep, built.remove(&pid))?;
                }
                if let Some(p) = self.pending.get_mut(sg.0) {
                    *p = false;
                }
                // In the step being run (`steps_done + 1`), the one whose
                // forward overlaps this tail.
                self.span(
                    self.steps_done + 1,
                    Lane::Store,
                    || format!("sg {}", sg.0),
                    t0,
                );
                Ok(())
            }
            Done::Flushed => {
                self.flush_open = false;
                Ok(())
            }
            Done::Failed(e) => Err(e),
            Done::Master(..) | Done::Ran(_) => Err(EngineError::internal(
                "unexpected reply from the optimizer thread",
            )),
        }
    }

    /// Optimizer steps done so far (including skipped ones; a resumed
    /// trainer starts at the checkpoint's).
    pub fn steps_done(&self) -> u64 {
        self.steps_done
    }

    /// Names the data source in checkpoints (the trainer only sees tokens).
    pub fn set_data_name(&mut self, name: impl Into<String>) {
        self.data_name = name.into();
    }

    /// Hands the trainer a save-dir lock taken earlier (the CLI takes it at
    /// start-up, to refuse before training rather than at the first save).
    /// [`Trainer::save_checkpoint`] takes one itself when it has none for
    /// its save dir.
    pub fn adopt_save_dir_lock(&mut self, lock: crate::checkpoint::SaveDirLock) {
        self.save_lock = Some(lock);
    }

    /// One writer per save dir (rank 0 writes everything outside the rank
    /// dirs): the `flock` on `<save_dir>/.lock`, held until the trainer is
    /// dropped.
    fn take_save_lock(&mut self, save_dir: &std::path::Path) -> Result<()> {
        if !self.save_lock.as_ref().is_some_and(|l| l.covers(save_dir)) {
            crate::durable::create_dir_all(save_dir)
                .map_err(crate::checkpoint::CheckpointError::from)?;
            self.save_lock = Some(crate::checkpoint::SaveDirLock::acquire(save_dir)?);
        }
        Ok(())
    }

    /// Writes a checkpoint of the current state to
    /// `<save_dir>/step-<N>/` and points `<save_dir>/latest` at it; returns
    /// the step dir. See [`crate::checkpoint`] for the format and the
    /// write sequence. Pending parameter writes and the optimizer pipeline
    /// are drained first; NVMe optimizer extents are copied with
    /// `copy_file_range`, memory tiers written from memory.
    ///
    /// Several ranks: a collective, called by every rank at the same step.
    /// Rank 0 creates the staging dir (named after its pid, which every
    /// rank learns through an all-gather); every rank writes and fsyncs its
    /// own `rank<RRRR>/` files in parallel; the ranks' layouts and file
    /// records (crcs) are all-gathered; rank 0 writes the consolidated
    /// 16-bit weights if configured (each param gathered from all ranks),
    /// the manifest last, renames the dir into place and rewrites
    /// `latest`. Only rank 0 touches anything outside its own rank dir.
    /// After each phase the ranks agree on the outcome
    /// ([`crate::engine::comm::agree`]), so a rank that fails makes every rank fail
    /// with an error naming it instead of leaving them waiting, and no rank
    /// returns before the checkpoint is visible (or the save has failed
    /// everywhere).
    pub fn save_checkpoint(&mut self, save_dir: &std::path::Path) -> Result<PathBuf> {
        let comm = self.opts.comm.clone();
        let world = comm.world_size();
        let rank = comm.rank();
        let step = self.steps_done;
        // A stopped trainer's state is not trustworthy: never save it.
        // Then the last step's optimizer tail (its Flush included), and the
        // param writes it caused.
        let ready = self.check_usable().and_then(|()| {
            self.settle_optimizer()?;
            self.store.flush_writes()
        });
        agree(&*comm, "saving a checkpoint (preparing)", ready)?;

        // Rank 0's pid names the staging dir; everyone learns it.
        let owner_pid = if world == 1 {
            std::process::id()
        } else {
            let mut all = vec![0u8; 4 * world];
            comm.all_gather_bytes(&std::process::id().to_le_bytes(), &vec![4; world], &mut all)?;
            u32::from_le_bytes([all[0], all[1], all[2], all[3]])
        };
        let begun = if rank == 0 {
            self.take_save_lock(save_dir).and_then(|()| {
                StagedCheckpoint::begin(save_dir, step)
                    .map(Some)
                    .map_err(EngineError::from)
            })
        } else {
            Ok(None)
        };
        // Also the barrier before the other ranks write into the dir.
        let mut staged = agree(&*comm, "saving a checkpoint (staging dir)", begun)?;

        // Every rank: its own state files. A failure anywhere fails every
        // rank, after all have stopped writing (rank 0 then removes the
        // staging dir when `staged` drops).
        let part = self.save_rank_part(&mut staged, save_dir, owner_pid);
        let layout = agree(&*comm, "saving a checkpoint (state files)", part)?;

        // The ranks' layouts and file records, to rank 0 (all-gathered).
        let own_files = match &staged {
            Some(s) if rank != 0 => s.files().to_vec(),
            _ => Vec::new(),
        };
        let record = serde_json::to_vec(&(&layout, &own_files))
            .map_err(|e| EngineError::internal(format!("serialising a rank record: {e}")))?;
        let records = all_gather_var(&*comm, &record)?;

        // Consolidated 16-bit weights (a collective), then rank 0 commits.
        let hf = self.save_hf_weights(if rank == 0 { staged.as_mut() } else { None });
        let done = match (rank, hf) {
            (0, Ok(hf_weights)) => match staged.take() {
                Some(s) => self.commit_checkpoint(s, layout, &records, hf_weights),
                None => Err(EngineError::internal("rank 0 has no staging dir")),
            },
            (_, Ok(_)) => Ok(save_dir.join(step_dir_name(step))),
            (_, Err(e)) => Err(e),
        };
        // No rank returns before the checkpoint is complete.
        let dir = agree(&*comm, "saving a checkpoint (commit)", done)?;
        if rank == 0 {
            tracing::info!(dir = %dir.display(), name = %step_dir_name(step), ranks = world, "checkpoint saved");
        }
        Ok(dir)
    }

    /// This rank's part of a save: joins rank 0's staging dir (other
    /// ranks), writes `rank<RRRR>/{master,exp_avg,exp_avg_sq}.f32`, records
    /// them with their region crcs and (other ranks) fsyncs them. Returns
    /// this rank's layout for the manifest.
    fn save_rank_part(
        &mut self,
        staged: &mut Option<StagedCheckpoint>,
        save_dir: &std::path::Path,
        owner_pid: u32,
    ) -> Result<RankLayout> {
        let rank = self.opts.comm.rank();
        if staged.is_none() {
            *staged = Some(StagedCheckpoint::join(
                save_dir,
                self.steps_done,
                owner_pid,
            )?);
        }
        let staged = staged
            .as_mut()
            .ok_or_else(|| EngineError::internal("no staging dir"))?;
        let rank_dir = format!("rank{rank:04}");
        staged.create_dir(&rank_dir)?;

        // Regions: the same in the three state files.
        let mut regions: Vec<(u64, u64)> = Vec::with_capacity(self.layout.sub_groups.len());
        let mut offset = 0u64;
        for g in &self.layout.sub_groups {
            let len = align_state_bytes(g.numel as u64 * 4)
                .ok_or_else(|| EngineError::internal("sub-group size overflows"))?;
            regions.push((offset, len));
            offset += len;
        }
        let total_bytes = offset;
        let mut files = Vec::with_capacity(3);
        for kind in StateKind::ALL {
            let rel = format!("{rank_dir}/{}.f32", kind.name());
            let (f, path) = staged.create_file(&rel)?;
            f.set_len(total_bytes)
                .map_err(crate::checkpoint::io_err("sizing", &path))?;
            files.push((kind, rel, f, path));
        }
        // The copies run on the optimizer thread, which owns the state.
        let job_regions = regions.clone();
        let job_files: Vec<(usize, std::fs::File, PathBuf)> = files
            .iter()
            .map(|(k, _, f, p)| {
                f.try_clone()
                    .map(|f| (k.index(), f, p.clone()))
                    .map_err(|source| EngineError::Io {
                        path: p.clone(),
                        source,
                    })
            })
            .collect::<Result<_>>()?;
        self.opt
            .send(Job::Exclusive(ExclusiveJob(Box::new(move |st| {
                let mut crcs: Vec<Vec<u32>> = Vec::with_capacity(3);
                for (k, f, p) in &job_files {
                    let mut v = Vec::with_capacity(job_regions.len());
                    for (i, &(off, len)) in job_regions.iter().enumerate() {
                        v.push(st.save_state(SubGroupId(i), *k, f, p, off, len)?);
                    }
                    crcs.push(v);
                }
                Ok(Box::new(crcs) as ExclusiveResult)
            }))))?;
        let crcs: Vec<Vec<u32>> = loop {
            match self.opt.recv()? {
                Done::Ran(r) => {
                    break *r.downcast::<Vec<Vec<u32>>>().map_err(|_| {
                        EngineError::internal("checkpoint job returned the wrong type")
                    })?
                }
                other => self.on_done(other)?,
            }
        };
        for ((_, rel, _, _), crc) in files.iter().zip(&crcs) {
            let rc = regions
                .iter()
                .zip(crc)
                .map(|(&(offset_bytes, len_bytes), &crc32c)| RegionCrc {
                    offset_bytes,
                    len_bytes,
                    crc32c,
                })
                .collect();
            staged.add_file_with_regions(rel, rc)?;
        }
        drop(files);
        if rank != 0 {
            // Rank 0's commit syncs its own (and again everyone's).
            staged.sync_own()?;
        }

        let mut states = std::collections::BTreeMap::new();
        for kind in StateKind::ALL {
            states.insert(
                kind.name().to_owned(),
                format!("{rank_dir}/{}.f32", kind.name()),
            );
        }
        let sub_groups = self
            .layout
            .sub_groups
            .iter()
            .zip(&regions)
            .map(|(g, &(offset_bytes, len_bytes))| SubGroupEntry {
                numel: g.numel as u64,
                offset_bytes,
                len_bytes,
                params: g
                    .params
                    .iter()
                    .map(|&pid| {
                        let slot = &self.layout.params[pid.0];
                        ParamEntry {
                            name: self
                                .model
                                .param(pid)
                                .map(|p| p.name.clone())
                                .unwrap_or_default(),
                            numel: slot.numel as u64,
                            shard_start: slot.shard_start as u64,
                            shard_numel: slot.shard_numel as u64,
                            offset_in_group: slot.offset_in_group as u64,
                        }
                    })
                    .collect(),
            })
            .collect();
        Ok(RankLayout {
            rank,
            states,
            sub_groups,
        })
    }

    /// Consolidated 16-bit weights (`stage3_gather_16bit_weights_on_model_save`):
    /// every param is gathered from all ranks in `ParamId` order (a
    /// collective on every rank); rank 0 (`staged` is `Some`) streams them
    /// into `model.safetensors` and writes `config.json`. If rank 0's
    /// writing fails part-way, it still takes part in the remaining
    /// gathers, so the other ranks are not left waiting, and then fails.
    fn save_hf_weights(
        &mut self,
        staged: Option<&mut StagedCheckpoint>,
    ) -> Result<Option<crate::checkpoint::HfWeights>> {
        if !self.config.zero.gather_16bit_weights_on_model_save {
            return Ok(None);
        }
        let model = self.model.clone();
        let mut cache: Option<(SubGroupId, Vec<f32>)> = None;
        let Some(staged) = staged else {
            for p in model.params() {
                self.gather_master(p.id, &mut cache)?;
            }
            return Ok(None);
        };
        let dtype = self.store.dtype();
        let mut fetched = 0usize;
        let mut gather_err: Option<EngineError> = None;
        let written = staged
            .create_file("model.safetensors")
            .map_err(EngineError::from)
            .and_then(|(f, path)| {
                crate::model::write_safetensors(f, &path, &model, dtype, |pid| {
                    fetched += 1;
                    let shape = model
                        .param(pid)
                        .map(|p| p.shape.clone())
                        .unwrap_or_default();
                    match self.gather_master(pid, &mut cache) {
                        Ok(v) => Ok(Tensor::from_vec(v, shape.as_slice(), &Device::Cpu)?),
                        Err(e) => {
                            let text = e.to_string();
                            gather_err = Some(e);
                            Err(crate::model::ModelError::Unsupported { what: text })
                        }
                    }
                })
                .map_err(EngineError::Model)
            });
        if let Some(e) = gather_err {
            return Err(e);
        }
        if let Err(e) = written {
            // The others still gather the params rank 0 did not fetch.
            for p in model.params().iter().skip(fetched) {
                self.gather_master(p.id, &mut cache)?;
            }
            return Err(e);
        }
        drop(written);
        let (cf, cpath) = staged.create_file("config.json")?;
        let text = crate::model::hf_config_text(&self.model)?;
        {
            use std::io::Write as _;
            let mut cf = cf;
            cf.write_all(text.as_bytes())
                .map_err(|source| EngineError::Io {
                    path: cpath.clone(),
                    source,
                })?;
        }
        staged.add_file("model.safetensors")?;
        staged.add_file("config.json")?;
        Ok(Some(crate::checkpoint::manifest_hf_weights(
            "model.safetensors",
            "config.json",
            match dtype {
                DType::BF16 => "bf16",
                DType::F16 => "fp16",
                _ => "fp32",
            },
        )))
    }

    /// Rank 0: records the other ranks' files, writes the manifest (every
    /// rank's layout, in rank order) last and makes the step dir visible.
    fn commit_checkpoint(
        &self,
        mut staged: StagedCheckpoint,
        own: RankLayout,
        records: &[Vec<u8>],
        hf_weights: Option<crate::checkpoint::HfWeights>,
    ) -> Result<PathBuf> {
        let world = self.opts.comm.world_size();
        let mut ranks = Vec::with_capacity(world);
        ranks.push(own);
        for (r, bytes) in records.iter().enumerate().skip(1) {
            let (layout, files): (RankLayout, Vec<FileEntry>) = serde_json::from_slice(bytes)
                .map_err(|e| EngineError::internal(format!("rank {r}'s record: {e}")))?;
            if layout.rank != r {
                return Err(EngineError::internal(format!(
                    "rank {r}'s record says rank {}",
                    layout.rank
                )));
            }
            staged.add_entries(files)?;
            ranks.push(layout);
        }
        let gas = self.config.batch.gradient_accumulation_steps.max(1);
        let mb = self.config.batch.micro_batch_size.max(1);
        let manifest = Manifest {
            format: FORMAT_NAME.to_owned(),
            version: FORMAT_VERSION,
            step: self.steps_done,
            adam_steps: self.adam_steps,
            skipped_steps: self.skipped,
            loss_scaler: matches!(self.config.precision, Precision::Fp16 { .. })
                .then(|| self.scaler.state()),
            seed: self.opts.seed,
            seq_len: self.opts.seq_len,
            data: DataPosition {
                source: self.data_name.clone(),
                samples_consumed: self.steps_done * gas * world as u64 * mb,
                micro_batch_size: mb,
                gradient_accumulation_steps: gas,
            },
            precision: precision_name(&self.config.precision).to_owned(),
            world_size: world,
            model: self.model.hf_config_value(),
            config: config_fingerprint(&self.config),
            ranks,
            hf_weights,
            files: Vec::new(),
        };
        Ok(staged.commit(manifest)?)
    }

    /// The fp32 master weights of one sub-group of this rank.
    pub fn master(&mut self, sg: SubGroupId) -> Result<Vec<f32>> {
        self.check_usable()?;
        let r = self.master_inner(sg);
        self.latch(r)
    }

    fn master_inner(&mut self, sg: SubGroupId) -> Result<Vec<f32>> {
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
    fn gather_master(
        &mut self,
        pid: ParamId,
        cache: &mut Option<(SubGroupId, Vec<f32>)>,
    ) -> Result<Vec<f32>> {
        let slot = self
            .layout
            .params
            .get(pid.0)
            .cloned()
            .ok_or_else(|| EngineError::internal("master of an unknown param"))?;
        if cache.as_ref().is_none_or(|(sg, _)| *sg != slot.sub_group) {
            *cache = Some((slot.sub_group, self.master(slot.sub_group)?));
        }
        let group = cache.as_ref().map(|(_, m)| m.as_slice()).unwrap_or(&[]);
        let shard = group
            .get(slot.offset_in_group..slot.offset_in_group + slot.shard_numel)
            .ok_or_else(|| EngineError::internal("master shard out of range"))?;
        let shard_bytes: Vec<u8> = shard.iter().flat_map(|x| x.to_le_bytes()).collect();
        let counts: Vec<usize> = shard_counts(slot.numel, self.layout.world)
            .iter()
            .map(|c| c * 4)
            .collect();
        let mut full = vec![0u8; slot.numel * 4];
        self.opts
            .comm
            .all_gather_bytes(&shard_bytes, &counts, &mut full)?;
        Ok(full
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// Every parameter's whole fp32 master weights, in `ParamId` order,
    /// gathered from all ranks (a collective). Holds the whole model in
    /// host memory: for tests and export of small models.
    pub fn full_masters(&mut self) -> Result<Vec<Vec<f32>>> {
        let mut cache = None;
        (0..self.layout.params.len())
            .map(|i| self.gather_master(ParamId(i), &mut cache))
            .collect()
    }

    /// sha256 over every fp32 master weight in `ParamId` order
    /// (little-endian). Several ranks: each param's shards are gathered
    /// (one param at a time), so the hash equals the one-rank hash of the
    /// same weights; every rank computes it (a collective).
    pub fn weight_sha256(&mut self) -> Result<String> {
        let mut h = Sha256::new();
        let mut cache = None;
        for i in 0..self.layout.params.len() {
            let m = self.gather_master(ParamId(i), &mut cache)?;
            let bytes: Vec<u8> = m.iter().flat_map(|x| x.to_le_bytes()).collect();
            h.update(&bytes);
        }
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
            optimizer_buffers_bytes: self.opt_buffers_bytes,
        }
    }

    /// Flushes I/O, writes the summary line, returns it.
    pub fn finish(mut self) -> Result<Summary> {
        self.check_usable()?;
        let r = self.settle_optimizer();
        self.latch(r)?;
        let r = self.store.flush_writes();
        self.latch(r)?;
        // The last step's optimizer tail has ended: its disk time too.
        self.record_disk();
        let (bytes_read, bytes_written) = tier_bytes(&self.store.counters(), &self.opt.counters());
        let s = Summary {
            summary: true,
            bytes_read,
            bytes_written,
            steps: self.steps_done,
            skipped_steps: self.skipped,
            weight_sha256: self.weight_sha256()?,
            peak_rss_bytes: peak_rss_bytes(),
            trace_rerecords: self.sched.rerecords(),
        };
        if let Some(w) = &mut self.metrics {
            w.write(&s)?;
        }
        Ok(s)
    }
}

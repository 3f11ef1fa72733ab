//! Validated, internal configuration: enums instead of strings, unit
//! newtypes instead of bare numbers, every `"auto"` resolved and every
//! cross-key rule checked. The engine consumes only these types.
//!
//! Checks done here (each a [`ConfigError`] variant, each tested):
//! - batch arithmetic, with DeepSpeed's inference of the missing size;
//! - stage range, stage-3-only offloads, `nvme_path` presence and, unless
//!   [`PathChecks::Skip`], that it is an existing writable directory;
//! - the pinned budget against the swap buffers it must hold;
//! - optimizer/scheduler types and numeric ranges (lr, betas, eps, ...);
//! - fp16 and bf16 not both on; aio sizes usable for O_DIRECT.
//!
//! Things DeepSpeed only warns about stay warnings
//! ([`ConfigWarning::Note`]): `total_num_steps < warmup_num_steps`, an
//! `nvme_path` given for a non-nvme device, `use_gds` (not supported here),
//! an explicit scheduler step count that differs from the run's.
//!
//! A relative `nvme_path` is relative to the working directory, as in
//! DeepSpeed. The writability probe creates and removes one empty file;
//! nothing else is written at load time.

use std::path::{Path, PathBuf};

use super::ds::{
    AutoOr, DirectIo, DsConfig, DsDevice, DsOffloadOptimizer, DsOffloadParam, DsScheduler,
    IoBackend, Memlock,
};
use super::error::ConfigError;
use super::reader::Sink;
use super::run::{hf_defaults, MixedPrecision, PathChecks, Resolved, RunContext, Source};
use super::units::{Bytes, Numel};

/// ZeRO stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stage {
    /// 0: plain data parallelism, nothing partitioned.
    Disabled,
    /// 1: optimizer states partitioned.
    OptimizerStates,
    /// 2: optimizer states and gradients partitioned.
    Gradients,
    /// 3: optimizer states, gradients and parameters partitioned.
    Parameters,
}

impl Stage {
    /// DeepSpeed's number for the stage.
    pub fn number(self) -> u8 {
        match self {
            Stage::Disabled => 0,
            Stage::OptimizerStates => 1,
            Stage::Gradients => 2,
            Stage::Parameters => 3,
        }
    }
}

/// Where an offloaded tensor class lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OffloadDevice {
    /// Not offloaded (stays on the compute device).
    None,
    /// Host memory.
    Cpu,
    /// Files under `path` (DeepSpeed's `nvme_path`).
    Nvme {
        /// Swap directory.
        path: PathBuf,
    },
}

impl OffloadDevice {
    /// The swap directory, for NVMe.
    pub fn nvme_path(&self) -> Option<&Path> {
        match self {
            OffloadDevice::Nvme { path } => Some(path),
            _ => None,
        }
    }
}

/// Batch sizes after resolution; `train_batch_size = micro_batch_size ×
/// gradient_accumulation_steps × ranks` holds exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batch {
    /// Samples per optimizer step over all ranks.
    pub train_batch_size: u64,
    /// Samples per rank per forward/backward.
    pub micro_batch_size: u64,
    /// Micro-steps per optimizer step.
    pub gradient_accumulation_steps: u64,
    /// Data-parallel ranks.
    pub ranks: u64,
}

/// fp16 loss scaling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LossScale {
    /// Dynamic scaling (DeepSpeed `loss_scale: 0`).
    Dynamic {
        /// First scale is 2^this.
        initial_scale_power: u32,
        /// Overflow-free steps before the scale doubles.
        window: u64,
        /// Overflows tolerated before the scale halves.
        hysteresis: u64,
        /// Smallest scale.
        min_scale: f64,
    },
    /// A fixed scale.
    Static(f64),
}

/// Training precision of parameters and gradients (master weights and
/// optimizer state are always fp32).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Precision {
    /// fp32.
    Fp32,
    /// fp16 with loss scaling.
    Fp16 {
        /// How the loss is scaled.
        loss_scale: LossScale,
    },
    /// bf16.
    Bf16,
}

impl Precision {
    /// Bytes per parameter element in this precision.
    pub fn param_elem_bytes(self) -> u64 {
        match self {
            Precision::Fp32 => 4,
            Precision::Fp16 { .. } | Precision::Bf16 => 2,
        }
    }
}

/// Optimizer type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptimizerKind {
    /// DeepSpeed `Adam` (decoupled weight decay unless `adam_w_mode: false`).
    Adam,
    /// DeepSpeed `AdamW`.
    AdamW,
}

/// Adam/AdamW hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Optimizer {
    /// Type as configured.
    pub kind: OptimizerKind,
    /// Learning rate (before the schedule).
    pub lr: f64,
    /// (beta1, beta2), each in [0, 1).
    pub betas: [f64; 2],
    /// Denominator epsilon.
    pub eps: f64,
    /// Weight decay coefficient.
    pub weight_decay: f64,
    /// True: AdamW-style decoupled decay; false: L2 added to the gradient.
    pub decoupled_weight_decay: bool,
}

/// Warmup curve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WarmupType {
    /// DeepSpeed's default: log-shaped increase.
    Log,
    /// Linear increase.
    Linear,
}

/// Learning-rate schedule, stepped once per optimizer step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scheduler {
    /// No `scheduler` block: the optimizer's lr throughout.
    Constant,
    /// DeepSpeed `WarmupLR`: warm up from `min_lr` to `max_lr`, then hold.
    WarmupLr {
        /// Start lr.
        min_lr: f64,
        /// Lr after warmup.
        max_lr: f64,
        /// Warmup length in optimizer steps.
        warmup_steps: u64,
        /// Curve.
        warmup_type: WarmupType,
    },
    /// DeepSpeed `WarmupDecayLR`: WarmupLR, then linear decay to 0 at `total_steps`.
    WarmupDecayLr {
        /// Start lr.
        min_lr: f64,
        /// Peak lr.
        max_lr: f64,
        /// Warmup length in optimizer steps.
        warmup_steps: u64,
        /// Curve.
        warmup_type: WarmupType,
        /// Step at which lr reaches 0.
        total_steps: u64,
    },
    /// DeepSpeed `WarmupCosineLR`: ratios of the optimizer's lr.
    WarmupCosineLr {
        /// Step at which the cosine ends.
        total_steps: u64,
        /// Start ratio of warmup.
        warmup_min_ratio: f64,
        /// Warmup length in optimizer steps.
        warmup_steps: u64,
        /// Final ratio of the cosine.
        cos_min_ratio: f64,
        /// Curve.
        warmup_type: WarmupType,
    },
}

/// Parameter offload (`offload_param`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamOffload {
    /// Where parameters live between uses.
    pub device: OffloadDevice,
    /// Pinned swap-in buffers.
    pub buffer_count: u64,
    /// Elements per swap-in buffer (DeepSpeed `buffer_size`).
    pub buffer_numel: Numel,
    /// Elements kept in host memory before spilling to NVMe (`max_in_cpu`).
    pub max_in_cpu_numel: Numel,
    /// Page-lock the buffers.
    pub pin_memory: bool,
}

/// Optimizer-state offload (`offload_optimizer`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptimizerOffload {
    /// Where fp32 master weights and Adam moments live.
    pub device: OffloadDevice,
    /// Pinned buffers, one sub-group each.
    pub buffer_count: u64,
    /// Page-lock the buffers.
    pub pin_memory: bool,
    /// Prefetch the next sub-group while stepping this one.
    pub pipeline_read: bool,
    /// Write this sub-group while stepping the next.
    pub pipeline_write: bool,
    /// Fast NVMe initialisation.
    pub fast_init: bool,
}

/// `zero_optimization`, validated. All sizes are element counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Zero {
    /// Stage.
    pub stage: Stage,
    /// Parameter offload.
    pub offload_param: ParamOffload,
    /// Optimizer offload.
    pub offload_optimizer: OptimizerOffload,
    /// Optimizer-step tile (`sub_group_size`).
    pub sub_group_numel: Numel,
    /// Prefetch bucket (`stage3_prefetch_bucket_size`).
    pub prefetch_bucket_numel: Numel,
    /// Params below this stay resident (`stage3_param_persistence_threshold`).
    pub param_persistence_threshold_numel: Numel,
    /// Gathered elements resident at most (`stage3_max_live_parameters`).
    pub max_live_parameters_numel: Numel,
    /// Keep a param if reused within this many elements (`stage3_max_reuse_distance`).
    pub max_reuse_distance_numel: Numel,
    /// Save consolidated 16-bit weights with checkpoints.
    pub gather_16bit_weights_on_model_save: bool,
    /// Contiguous gradient buffer.
    pub contiguous_gradients: bool,
    /// Overlap gradient reduction with backward.
    pub overlap_comm: bool,
    /// Gradient reduce bucket (`reduce_bucket_size`).
    pub reduce_bucket_numel: Numel,
}

/// `aio`, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Aio {
    /// Bytes per I/O request (a multiple of 512).
    pub block_bytes: Bytes,
    /// Requests in flight per worker.
    pub queue_depth: u32,
    /// Workers an operation is split across.
    pub intra_op_parallelism: u32,
    /// One submission per request.
    pub single_submit: bool,
    /// Refill the queue as completions arrive.
    pub overlap_events: bool,
    /// GPUDirect Storage requested (not supported: always served by the host path).
    pub use_gds: bool,
}

/// The `tierzero` block, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tierzero {
    /// Cap on page-locked host memory; `None` = what the buffers need.
    pub pinned_budget_bytes: Option<Bytes>,
    /// Accelerator memory for a resident parameter cache.
    pub device_cache_bytes: Bytes,
    /// I/O backend.
    pub io_backend: IoBackend,
    /// O_DIRECT policy.
    pub direct_io: DirectIo,
    /// Pinned buffers above `RLIMIT_MEMLOCK`: warn and run unlocked, or refuse.
    pub memlock: Memlock,
    /// I/O submission threads.
    pub ring_threads: u32,
    /// CRC32C on swap extents.
    pub checksums: bool,
    /// Overlap the CPU optimizer with backward.
    pub overlap_optimizer: bool,
    /// Threads of the CPU compute kernels; `None` = auto (see
    /// `crate::engine::host::threads`).
    pub compute_threads: Option<u32>,
    /// Host memory for the state of the optimizer's tail sub-groups kept
    /// out of NVMe; `None` = auto (one prefetch bucket's state).
    pub optimizer_resident_bytes: Option<Bytes>,
    /// Keep compute and helper threads on separate CPUs; `None` = auto
    /// (see `crate::engine::host::threads`).
    pub pin_threads: Option<bool>,
    /// Speculative optimizer step with clipping or fp16; `None` = auto
    /// (see `crate::engine::trainer` "Speculative step").
    pub speculative_step: Option<bool>,
    /// NVMe bytes of the speculation pool; `None` = auto (one optimizer
    /// pipeline's worth of slots, see `crate::engine::sizing`).
    pub speculation_pool_bytes: Option<Bytes>,
    /// How long a stop may take from its request to the end of the run
    /// (`tierzero.stop_grace_s`); `None` = no bound.
    pub stop_grace: Option<std::time::Duration>,
}

/// The validated configuration the engine runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Batch sizes.
    pub batch: Batch,
    /// Global-norm gradient clipping; `None` when 0 (off).
    pub gradient_clipping: Option<f64>,
    /// Log every this many steps.
    pub steps_per_print: u64,
    /// Per-phase timing.
    pub wall_clock_breakdown: bool,
    /// Precision.
    pub precision: Precision,
    /// Optimizer.
    pub optimizer: Optimizer,
    /// Learning-rate schedule.
    pub scheduler: Scheduler,
    /// ZeRO settings.
    pub zero: Zero,
    /// I/O settings.
    pub aio: Aio,
    /// tierzero's own settings.
    pub tierzero: Tierzero,
}

// ---------------------------------------------------------------------------

struct Resolver<'r> {
    run: &'r RunContext,
    resolved: Vec<Resolved>,
}

fn close(a: f64, b: f64) -> bool {
    a == b || (a - b).abs() <= 1e-12 * a.abs().max(b.abs())
}

impl Resolver<'_> {
    fn record(&mut self, key: &str, value: String, source: Source) {
        self.resolved.push(Resolved {
            key: key.to_owned(),
            value,
            source,
        });
    }

    /// The `"auto"` / explicit / absent rule for a float key.
    fn f64(
        &mut self,
        key: &str,
        cfg: Option<AutoOr<f64>>,
        run: Option<f64>,
        run_name: &'static str,
        hf_default: f64,
        ds_default: f64,
    ) -> Result<f64, ConfigError> {
        match (cfg, run) {
            (Some(AutoOr::Auto), Some(r)) | (None, Some(r)) => {
                self.record(key, format!("{r:?}"), Source::Run(run_name));
                Ok(r)
            }
            (Some(AutoOr::Auto), None) => {
                self.record(key, format!("{hf_default:?}"), Source::HfDefault);
                Ok(hf_default)
            }
            (Some(AutoOr::Value(v)), Some(r)) if !close(v, r) => Err(ConfigError::RunMismatch {
                key: key.to_owned(),
                config_value: format!("{v:?}"),
                run_value: format!("{r:?}"),
                run_source: run_name.to_owned(),
            }),
            (Some(AutoOr::Value(v)), _) => Ok(v),
            (None, None) => Ok(ds_default),
        }
    }

    /// Same rule for an integer key that may stay unset (batch sizes).
    fn u64_opt(
        &mut self,
        key: &str,
        cfg: Option<AutoOr<u64>>,
        run: Option<u64>,
        run_name: &'static str,
        hf_default: u64,
    ) -> Result<Option<u64>, ConfigError> {
        match (cfg, run) {
            (Some(AutoOr::Auto), Some(r)) | (None, Some(r)) => {
                self.record(key, r.to_string(), Source::Run(run_name));
                Ok(Some(r))
            }
            (Some(AutoOr::Auto), None) => {
                self.record(key, hf_default.to_string(), Source::HfDefault);
                Ok(Some(hf_default))
            }
            (Some(AutoOr::Value(v)), Some(r)) if v != r => Err(ConfigError::RunMismatch {
                key: key.to_owned(),
                config_value: v.to_string(),
                run_value: r.to_string(),
                run_source: run_name.to_owned(),
            }),
            (Some(AutoOr::Value(v)), _) => Ok(Some(v)),
            (None, None) => Ok(None),
        }
    }

    /// HF's "fill only" rule, used for scheduler params: `"auto"` or absent
    /// takes the run value; an explicit value wins over a different run
    /// value, with a note. Returns `None` when nothing is known.
    fn u64_fill(
        &mut self,
        key: &str,
        cfg: Option<AutoOr<u64>>,
        run: Option<u64>,
        run_name: &'static str,
        sink: &mut Sink,
    ) -> Option<u64> {
        match (cfg, run) {
            (Some(AutoOr::Value(v)), Some(r)) => {
                if v != r {
                    sink.note(
                        key,
                        format!("config value {v} kept although the run's {run_name} is {r} (scheduler values are fill-only, as in HF Trainer)"),
                    );
                }
                Some(v)
            }
            (Some(AutoOr::Value(v)), None) => Some(v),
            (Some(AutoOr::Auto) | None, Some(r)) => {
                self.record(key, r.to_string(), Source::Run(run_name));
                Some(r)
            }
            (Some(AutoOr::Auto) | None, None) => None,
        }
    }

    fn bool(
        &mut self,
        key: &str,
        cfg: AutoOr<bool>,
        run: Option<bool>,
        run_name: &'static str,
    ) -> Result<bool, ConfigError> {
        match (cfg, run) {
            (AutoOr::Auto, Some(r)) => {
                self.record(key, r.to_string(), Source::Run(run_name));
                Ok(r)
            }
            (AutoOr::Auto, None) => {
                self.record(key, "false".to_owned(), Source::HfDefault);
                Ok(false)
            }
            // Explicit booleans win over a run default here: the run
            // value for these is rarely a deliberate choice.
            (AutoOr::Value(v), _) => Ok(v),
        }
    }

    /// A hidden-size rule.
    fn hidden(
        &mut self,
        key: &str,
        cfg: AutoOr<u64>,
        rule: fn(u64) -> u64,
        rule_desc: &str,
        ds_default: u64,
    ) -> u64 {
        match cfg {
            AutoOr::Value(v) => v,
            AutoOr::Auto => match self.run.hidden_size {
                Some(h) => {
                    let v = rule(h);
                    self.record(
                        key,
                        v.to_string(),
                        Source::Derived(format!("{rule_desc} with hidden_size {h}")),
                    );
                    v
                }
                None => {
                    self.record(key, ds_default.to_string(), Source::DeepSpeedDefault);
                    ds_default
                }
            },
        }
    }
}

/// The largest `tierzero.stop_grace_s` (a week).
pub const MAX_STOP_GRACE_S: f64 = 604_800.0;

fn range(key: &str, value: impl ToString, allowed: &str, fix: &str) -> ConfigError {
    ConfigError::OutOfRange {
        key: key.to_owned(),
        value: value.to_string(),
        allowed: allowed.to_owned(),
        fix: fix.to_owned(),
    }
}

/// A schedule whose learning rate is 0 at every step changes no weight: a
/// mistake (DeepSpeed and torch accept it silently). An optimizer lr of 0 is
/// fine when the scheduler sets its own peak (`WarmupLR`/`WarmupDecayLR`
/// with a positive `warmup_max_lr`); the error names the key that decides.
fn check_some_lr_is_positive(optimizer_lr: f64, scheduler: &Scheduler) -> Result<(), ConfigError> {
    let (key, peak) = match *scheduler {
        Scheduler::Constant | Scheduler::WarmupCosineLr { .. } => {
            ("optimizer.params.lr", optimizer_lr)
        }
        Scheduler::WarmupLr { min_lr, max_lr, .. }
        | Scheduler::WarmupDecayLr { min_lr, max_lr, .. } => {
            ("scheduler.params.warmup_max_lr", min_lr.max(max_lr))
        }
    };
    if peak == 0.0 {
        return Err(range(
            key,
            peak,
            "positive (with a learning rate of 0 at every step the weights never change)",
            "use a positive learning rate such as 1e-4",
        ));
    }
    Ok(())
}

fn positive(key: &str, v: u64, fix: &str) -> Result<u64, ConfigError> {
    if v == 0 {
        Err(range(key, 0, "at least 1", fix))
    } else {
        Ok(v)
    }
}

fn small_u32(key: &str, v: u64, max: u32, fix: &str) -> Result<u32, ConfigError> {
    match u32::try_from(v) {
        Ok(x) if x >= 1 && x <= max => Ok(x),
        _ => Err(range(key, v, &format!("between 1 and {max}"), fix)),
    }
}

/// Resolves `"auto"`, applies DeepSpeed's batch inference, checks every
/// rule and builds the internal [`Config`].
pub(crate) fn validate(
    ds: &DsConfig,
    run: &RunContext,
    sink: &mut Sink,
) -> Result<(Config, Vec<Resolved>), ConfigError> {
    let mut r = Resolver {
        run,
        resolved: Vec::new(),
    };

    let stage = match ds.zero_optimization.stage {
        0 => Stage::Disabled,
        1 => Stage::OptimizerStates,
        2 => Stage::Gradients,
        3 => Stage::Parameters,
        n => {
            return Err(ConfigError::InvalidStage {
                value: n.to_string(),
            })
        }
    };

    let batch = resolve_batch(ds, &mut r)?;

    let clip = r.f64(
        "gradient_clipping",
        ds.gradient_clipping,
        run.max_grad_norm,
        "max_grad_norm",
        hf_defaults::MAX_GRAD_NORM,
        0.0,
    )?;
    if clip < 0.0 {
        return Err(range(
            "gradient_clipping",
            clip,
            "0 (off) or positive",
            "use 1.0, or 0 to disable clipping",
        ));
    }

    let precision = resolve_precision(ds, &mut r)?;
    let optimizer = resolve_optimizer(ds, &mut r)?;
    let scheduler = resolve_scheduler(ds.scheduler.as_ref(), optimizer.lr, &mut r, sink)?;
    check_some_lr_is_positive(optimizer.lr, &scheduler)?;

    let z = &ds.zero_optimization;
    let offload_param = validate_param_offload(z.offload_param.as_ref(), stage, sink)?;
    let offload_optimizer = validate_optimizer_offload(z.offload_optimizer.as_ref(), stage, sink)?;
    let sub_group = positive(
        "zero_optimization.sub_group_size",
        z.sub_group_size,
        "use DeepSpeed's default 1e9",
    )?;
    let reduce_bucket = r.hidden(
        "zero_optimization.reduce_bucket_size",
        z.reduce_bucket_size,
        |h| h.saturating_mul(h),
        "hidden_size²",
        500_000_000,
    );
    let prefetch_bucket = r.hidden(
        "zero_optimization.stage3_prefetch_bucket_size",
        z.stage3_prefetch_bucket_size,
        |h| h.saturating_mul(h).saturating_mul(9) / 10,
        "0.9 × hidden_size²",
        50_000_000,
    );
    let persistence = r.hidden(
        "zero_optimization.stage3_param_persistence_threshold",
        z.stage3_param_persistence_threshold,
        |h| h.saturating_mul(10),
        "10 × hidden_size",
        100_000,
    );
    let gather16 = r.bool(
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        z.stage3_gather_16bit_weights_on_model_save,
        run.save_16bit_model,
        "save_16bit_model",
    )?;
    let zero = Zero {
        stage,
        offload_param,
        offload_optimizer,
        sub_group_numel: Numel(sub_group),
        prefetch_bucket_numel: Numel(prefetch_bucket),
        param_persistence_threshold_numel: Numel(persistence),
        max_live_parameters_numel: Numel(z.stage3_max_live_parameters),
        max_reuse_distance_numel: Numel(z.stage3_max_reuse_distance),
        gather_16bit_weights_on_model_save: gather16,
        contiguous_gradients: z.contiguous_gradients,
        overlap_comm: z.overlap_comm.unwrap_or(stage == Stage::Parameters),
        reduce_bucket_numel: Numel(reduce_bucket),
    };

    let a = &ds.aio;
    if a.block_size == 0 || !a.block_size.is_multiple_of(512) {
        return Err(range(
            "aio.block_size",
            a.block_size,
            "a positive multiple of 512 bytes (O_DIRECT alignment)",
            "use 1048576 (1 MiB, DeepSpeed's default)",
        ));
    }
    let aio = Aio {
        block_bytes: Bytes(a.block_size),
        queue_depth: small_u32("aio.queue_depth", a.queue_depth, 4096, "use 8 to 128")?,
        intra_op_parallelism: small_u32(
            "aio.intra_op_parallelism",
            a.intra_op_parallelism,
            256,
            "use 1 to 8",
        )?,
        single_submit: a.single_submit,
        overlap_events: a.overlap_events,
        use_gds: a.use_gds,
    };
    if a.use_gds {
        sink.note(
            "aio.use_gds",
            "GPUDirect Storage is not supported by tierzero; swaps go through pinned host buffers",
        );
    }

    let t = &ds.tierzero;
    let tierzero = Tierzero {
        pinned_budget_bytes: t.pinned_budget_bytes.map(Bytes),
        device_cache_bytes: Bytes(t.device_cache_bytes),
        io_backend: t.io_backend,
        direct_io: t.direct_io,
        memlock: t.memlock,
        ring_threads: match t.ring_threads {
            Some(n) => small_u32(
                "tierzero.ring_threads",
                n,
                256,
                "use 1 to 4, or remove it to follow aio.intra_op_parallelism",
            )?,
            None => aio.intra_op_parallelism,
        },
        checksums: t.checksums,
        overlap_optimizer: t.overlap_optimizer,
        compute_threads: match t.compute_threads {
            Some(n) => Some(small_u32(
                "tierzero.compute_threads",
                n,
                1024,
                "use \"auto\" (one core per Adam thread kept for the optimizer and I/O \
                 threads when offloading), or a count no larger than the machine's cores",
            )?),
            None => None,
        },
        optimizer_resident_bytes: t.optimizer_resident_bytes.map(Bytes),
        pin_threads: t.pin_threads,
        speculative_step: t.speculative_step,
        speculation_pool_bytes: t.speculation_pool_bytes.map(Bytes),
        stop_grace: match t.stop_grace_s {
            Some(s) if s.is_finite() && s > 0.0 && s <= MAX_STOP_GRACE_S => {
                Some(std::time::Duration::from_secs_f64(s))
            }
            Some(s) => {
                return Err(range(
                    "tierzero.stop_grace_s",
                    s,
                    &format!("seconds, more than 0 and at most {MAX_STOP_GRACE_S}"),
                    "use the grace period your scheduler gives before SIGKILL (SLURM's and \
                     Kubernetes' default is 30), or remove it for no bound",
                ))
            }
            None => None,
        },
    };

    let config = Config {
        batch,
        gradient_clipping: if clip > 0.0 { Some(clip) } else { None },
        steps_per_print: ds.steps_per_print,
        wall_clock_breakdown: ds.wall_clock_breakdown,
        precision,
        optimizer,
        scheduler,
        zero,
        aio,
        tierzero,
    };

    check_pinned_budget(&config, run)?;
    for (key, dev) in [
        (
            "zero_optimization.offload_param.nvme_path",
            &config.zero.offload_param.device,
        ),
        (
            "zero_optimization.offload_optimizer.nvme_path",
            &config.zero.offload_optimizer.device,
        ),
    ] {
        if let OffloadDevice::Nvme { path } = dev {
            check_dir(key, path, run.path_checks)?;
        }
    }
    Ok((config, r.resolved))
}

fn resolve_batch(ds: &DsConfig, r: &mut Resolver<'_>) -> Result<Batch, ConfigError> {
    let run = r.run;
    let ranks = run.ranks;
    if ranks == 0 {
        return Err(range(
            "ranks (run context)",
            0,
            "at least 1",
            "pass the world size, 1 for a single process",
        ));
    }
    let micro_key = "train_micro_batch_size_per_gpu";
    let gas_key = "gradient_accumulation_steps";
    let train_key = "train_batch_size";
    let mut micro = r.u64_opt(
        micro_key,
        ds.train_micro_batch_size_per_gpu,
        run.micro_batch_size,
        "micro_batch_size",
        hf_defaults::MICRO_BATCH_SIZE,
    )?;
    let mut gas = r.u64_opt(
        gas_key,
        ds.gradient_accumulation_steps,
        run.gradient_accumulation_steps,
        "gradient_accumulation_steps",
        hf_defaults::GRADIENT_ACCUMULATION_STEPS,
    )?;
    for (key, v) in [(micro_key, micro), (gas_key, gas)] {
        if v == Some(0) {
            return Err(range(key, 0, "at least 1", "use 1 or more"));
        }
    }
    let overflow = || {
        range(
            train_key,
            "micro × accumulation × ranks",
            "below 2^64",
            "use smaller batch sizes",
        )
    };
    let mut train = match ds.train_batch_size {
        Some(AutoOr::Value(0)) => {
            return Err(range(
                train_key,
                0,
                "at least 1",
                "use 1 or more, or \"auto\"",
            ))
        }
        Some(AutoOr::Value(v)) => Some(v),
        Some(AutoOr::Auto) => {
            // HF: train = world_size × per_device × accumulation, with the
            // HF defaults standing in for unset values.
            let m = *micro.get_or_insert_with(|| {
                r.resolved.push(Resolved {
                    key: micro_key.to_owned(),
                    value: hf_defaults::MICRO_BATCH_SIZE.to_string(),
                    source: Source::HfDefault,
                });
                hf_defaults::MICRO_BATCH_SIZE
            });
            let g = *gas.get_or_insert(hf_defaults::GRADIENT_ACCUMULATION_STEPS);
            let t = m
                .checked_mul(g)
                .and_then(|x| x.checked_mul(ranks))
                .ok_or_else(overflow)?;
            r.record(
                train_key,
                t.to_string(),
                Source::Derived(format!("micro {m} × accumulation {g} × ranks {ranks}")),
            );
            Some(t)
        }
        None => None,
    };

    let indivisible =
        |missing: &'static str, t: u64, desc: String, d: u64| ConfigError::BatchIndivisible {
            missing,
            train_batch_size: t,
            divisor_desc: desc,
            divisor: d,
            suggestion: t.div_ceil(d) * d,
        };
    let (t, m, g) = match (train, micro, gas) {
        (Some(t), Some(m), Some(g)) => (t, m, g),
        (Some(t), Some(m), None) => {
            let d = m.checked_mul(ranks).ok_or_else(overflow)?;
            if t % d != 0 {
                return Err(indivisible(
                    gas_key,
                    t,
                    format!("micro {m} × ranks {ranks}"),
                    d,
                ));
            }
            r.record(gas_key, (t / d).to_string(), Source::Inferred);
            (t, m, t / d)
        }
        (Some(t), None, Some(g)) => {
            let d = g.checked_mul(ranks).ok_or_else(overflow)?;
            if t % d != 0 {
                return Err(indivisible(
                    micro_key,
                    t,
                    format!("accumulation {g} × ranks {ranks}"),
                    d,
                ));
            }
            r.record(micro_key, (t / d).to_string(), Source::Inferred);
            (t, t / d, g)
        }
        (None, Some(m), Some(g)) => {
            let t = m
                .checked_mul(g)
                .and_then(|x| x.checked_mul(ranks))
                .ok_or_else(overflow)?;
            r.record(train_key, t.to_string(), Source::Inferred);
            (t, m, g)
        }
        (Some(t), None, None) => {
            if t % ranks != 0 {
                return Err(indivisible(micro_key, t, format!("ranks {ranks}"), ranks));
            }
            r.record(gas_key, "1".to_owned(), Source::Inferred);
            r.record(micro_key, (t / ranks).to_string(), Source::Inferred);
            (t, t / ranks, 1)
        }
        (None, Some(m), None) => {
            let t = m.checked_mul(ranks).ok_or_else(overflow)?;
            r.record(gas_key, "1".to_owned(), Source::Inferred);
            r.record(train_key, t.to_string(), Source::Inferred);
            (t, m, 1)
        }
        (None, None, _) => return Err(ConfigError::BatchMissing),
    };
    train = Some(t);
    let product = m
        .checked_mul(g)
        .and_then(|x| x.checked_mul(ranks))
        .ok_or_else(overflow)?;
    if train != Some(product) {
        let d = m * ranks;
        let fix = if t % d == 0 {
            format!("set `train_batch_size` to {product}, or `gradient_accumulation_steps` to {}, or use \"auto\"", t / d)
        } else {
            format!("set `train_batch_size` to {product} or to \"auto\"")
        };
        return Err(ConfigError::BatchMismatch {
            train_batch_size: t,
            micro_batch_size: m,
            gradient_accumulation_steps: g,
            ranks,
            product,
            fix,
        });
    }
    Ok(Batch {
        train_batch_size: t,
        micro_batch_size: m,
        gradient_accumulation_steps: g,
        ranks,
    })
}

fn resolve_precision(ds: &DsConfig, r: &mut Resolver<'_>) -> Result<Precision, ConfigError> {
    let mp = r.run.mixed_precision;
    let fp16 = r.bool(
        "fp16.enabled",
        ds.fp16.enabled,
        mp.map(|m| m == MixedPrecision::Fp16),
        "mixed_precision",
    )?;
    let bf16 = r.bool(
        "bf16.enabled",
        ds.bf16.enabled,
        mp.map(|m| m == MixedPrecision::Bf16),
        "mixed_precision",
    )?;
    match (fp16, bf16) {
        (true, true) => Err(ConfigError::PrecisionConflict),
        (false, true) => Ok(Precision::Bf16),
        (false, false) => Ok(Precision::Fp32),
        (true, false) => {
            let f = &ds.fp16;
            if f.loss_scale < 0.0 {
                return Err(range(
                    "fp16.loss_scale",
                    f.loss_scale,
                    "0 (dynamic) or positive",
                    "use 0 for dynamic loss scaling",
                ));
            }
            if f.min_loss_scale <= 0.0 {
                return Err(range(
                    "fp16.min_loss_scale",
                    f.min_loss_scale,
                    "positive",
                    "use 1",
                ));
            }
            let loss_scale = if f.loss_scale == 0.0 {
                LossScale::Dynamic {
                    initial_scale_power: f.initial_scale_power,
                    window: positive("fp16.loss_scale_window", f.loss_scale_window, "use 1000")?,
                    hysteresis: f.hysteresis,
                    min_scale: f.min_loss_scale,
                }
            } else {
                LossScale::Static(f.loss_scale)
            };
            Ok(Precision::Fp16 { loss_scale })
        }
    }
}

fn resolve_optimizer(ds: &DsConfig, r: &mut Resolver<'_>) -> Result<Optimizer, ConfigError> {
    let run = r.run;
    // No optimizer block: behave like HF Trainer's own AdamW, i.e. as if
    // every param were "auto".
    let (kind, params) = match &ds.optimizer {
        Some(o) => {
            let kind = if o.kind.eq_ignore_ascii_case("adamw") {
                OptimizerKind::AdamW
            } else if o.kind.eq_ignore_ascii_case("adam") {
                OptimizerKind::Adam
            } else {
                return Err(ConfigError::UnsupportedOptimizer {
                    value: super::error::render(&serde_json::Value::String(o.kind.clone())),
                });
            };
            (kind, o.params.clone())
        }
        None => (
            OptimizerKind::AdamW,
            super::ds::DsAdamParams {
                lr: Some(AutoOr::Auto),
                betas: Some(AutoOr::Auto),
                eps: Some(AutoOr::Auto),
                weight_decay: Some(AutoOr::Auto),
                adam_w_mode: true,
            },
        ),
    };
    let lr = r.f64(
        "optimizer.params.lr",
        params.lr,
        run.learning_rate,
        "learning_rate",
        hf_defaults::LEARNING_RATE,
        1e-3,
    )?;
    if lr < 0.0 {
        return Err(range(
            "optimizer.params.lr",
            lr,
            "0 or positive",
            "use a positive learning rate such as 1e-4",
        ));
    }
    let betas = match (params.betas, run.adam_betas) {
        (Some(AutoOr::Auto), Some(b)) | (None, Some(b)) => {
            r.record(
                "optimizer.params.betas",
                format!("[{:?}, {:?}]", b[0], b[1]),
                Source::Run("adam_betas"),
            );
            b
        }
        (Some(AutoOr::Auto), None) => {
            let b = hf_defaults::ADAM_BETAS;
            r.record(
                "optimizer.params.betas",
                format!("[{:?}, {:?}]", b[0], b[1]),
                Source::HfDefault,
            );
            b
        }
        (Some(AutoOr::Value(v)), Some(b)) if !(close(v[0], b[0]) && close(v[1], b[1])) => {
            return Err(ConfigError::RunMismatch {
                key: "optimizer.params.betas".to_owned(),
                config_value: format!("[{:?}, {:?}]", v[0], v[1]),
                run_value: format!("[{:?}, {:?}]", b[0], b[1]),
                run_source: "adam_betas".to_owned(),
            })
        }
        (Some(AutoOr::Value(v)), _) => v,
        (None, None) => [0.9, 0.999],
    };
    for (i, b) in betas.iter().enumerate() {
        if !(0.0..1.0).contains(b) {
            return Err(range(
                &format!("optimizer.params.betas[{i}]"),
                b,
                "in [0, 1)",
                "use the usual [0.9, 0.999] (or 0.95 for beta2)",
            ));
        }
    }
    let eps = r.f64(
        "optimizer.params.eps",
        params.eps,
        run.adam_eps,
        "adam_eps",
        hf_defaults::ADAM_EPS,
        1e-8,
    )?;
    if eps < 0.0 {
        return Err(range(
            "optimizer.params.eps",
            eps,
            "0 or positive",
            "use 1e-8",
        ));
    }
    let weight_decay = r.f64(
        "optimizer.params.weight_decay",
        params.weight_decay,
        run.weight_decay,
        "weight_decay",
        hf_defaults::WEIGHT_DECAY,
        0.0,
    )?;
    if weight_decay < 0.0 {
        return Err(range(
            "optimizer.params.weight_decay",
            weight_decay,
            "0 or positive",
            "use 0.0 or e.g. 0.01",
        ));
    }
    Ok(Optimizer {
        kind,
        lr,
        betas,
        eps,
        weight_decay,
        decoupled_weight_decay: kind == OptimizerKind::AdamW || params.adam_w_mode,
    })
}

fn resolve_scheduler(
    s: Option<&DsScheduler>,
    lr: f64,
    r: &mut Resolver<'_>,
    sink: &mut Sink,
) -> Result<Scheduler, ConfigError> {
    let Some(s) = s else {
        return Ok(Scheduler::Constant);
    };
    let run = r.run;
    let p = &s.params;
    let warmup_type = match p.warmup_type.as_deref() {
        Some("linear") => WarmupType::Linear,
        _ => WarmupType::Log,
    };
    let lr_key = |r: &mut Resolver<'_>,
                  key: &str,
                  v: Option<AutoOr<f64>>,
                  auto: f64,
                  auto_desc: &str,
                  dflt: f64| {
        let v = match v {
            Some(AutoOr::Auto) => {
                r.record(
                    key,
                    format!("{auto:?}"),
                    Source::Derived(auto_desc.to_owned()),
                );
                auto
            }
            Some(AutoOr::Value(v)) => v,
            None => dflt,
        };
        if v < 0.0 {
            return Err(range(
                key,
                v,
                "0 or positive",
                "use a non-negative learning rate",
            ));
        }
        Ok(v)
    };
    let warmup_key = "scheduler.params.warmup_num_steps";
    let warmup_steps = match r.u64_fill(
        warmup_key,
        p.warmup_num_steps,
        run.warmup_steps,
        "warmup_steps",
        sink,
    ) {
        Some(w) => w,
        None if p.warmup_num_steps == Some(AutoOr::Auto) => {
            r.record(
                warmup_key,
                hf_defaults::WARMUP_STEPS.to_string(),
                Source::HfDefault,
            );
            hf_defaults::WARMUP_STEPS
        }
        None => 1000,
    };
    let total = |r: &mut Resolver<'_>, sink: &mut Sink| -> Result<u64, ConfigError> {
        let key = "scheduler.params.total_num_steps";
        match r.u64_fill(key, p.total_num_steps, run.total_steps, "total_steps", sink) {
            Some(t) => Ok(t),
            None if p.total_num_steps == Some(AutoOr::Auto) => Err(ConfigError::AutoUnresolved {
                key: key.to_owned(),
                needs: "the total number of optimizer steps is not known".to_owned(),
                fix: "pass --steps N, or write the number into the config".to_owned(),
            }),
            None => Err(ConfigError::MissingKey {
                key: key.to_owned(),
                why: format!("scheduler type {} needs it", s.kind),
                fix: "add \"total_num_steps\": N, or \"auto\" with --steps N".to_owned(),
            }),
        }
    };
    let check_total = |sink: &mut Sink, total: u64| {
        if total < warmup_steps {
            sink.note(
                "scheduler.params.total_num_steps",
                format!("{total} is less than warmup_num_steps {warmup_steps}; the run ends inside the warmup"),
            );
        }
    };
    match s.kind.as_str() {
        "WarmupLR" => Ok(Scheduler::WarmupLr {
            min_lr: lr_key(
                r,
                "scheduler.params.warmup_min_lr",
                p.warmup_min_lr,
                0.0,
                "HF: 0",
                0.0,
            )?,
            max_lr: lr_key(
                r,
                "scheduler.params.warmup_max_lr",
                p.warmup_max_lr,
                lr,
                "HF: optimizer lr",
                0.001,
            )?,
            warmup_steps,
            warmup_type,
        }),
        "WarmupDecayLR" => {
            let min_lr = lr_key(
                r,
                "scheduler.params.warmup_min_lr",
                p.warmup_min_lr,
                0.0,
                "HF: 0",
                0.0,
            )?;
            let max_lr = lr_key(
                r,
                "scheduler.params.warmup_max_lr",
                p.warmup_max_lr,
                lr,
                "HF: optimizer lr",
                0.001,
            )?;
            let total_steps = total(r, sink)?;
            check_total(sink, total_steps);
            Ok(Scheduler::WarmupDecayLr {
                min_lr,
                max_lr,
                warmup_steps,
                warmup_type,
                total_steps,
            })
        }
        "WarmupCosineLR" => {
            let total_steps = total(r, sink)?;
            check_total(sink, total_steps);
            let ratio = |key: &str, v: Option<f64>, dflt: f64| {
                let v = v.unwrap_or(dflt);
                if (0.0..=1.0).contains(&v) {
                    Ok(v)
                } else {
                    Err(range(
                        key,
                        v,
                        "in [0, 1]",
                        "use a ratio of the optimizer lr, e.g. 0.1",
                    ))
                }
            };
            Ok(Scheduler::WarmupCosineLr {
                total_steps,
                warmup_min_ratio: ratio(
                    "scheduler.params.warmup_min_ratio",
                    p.warmup_min_ratio,
                    0.0,
                )?,
                warmup_steps,
                cos_min_ratio: ratio("scheduler.params.cos_min_ratio", p.cos_min_ratio, 0.0001)?,
                warmup_type,
            })
        }
        other => Err(ConfigError::UnsupportedScheduler {
            value: super::error::render(&serde_json::Value::String(other.to_owned())),
            fix: "use WarmupLR, WarmupDecayLR or WarmupCosineLR".to_owned(),
        }),
    }
}

fn device(
    section: &str,
    dev: DsDevice,
    nvme_path: Option<&PathBuf>,
    sink: &mut Sink,
) -> Result<OffloadDevice, ConfigError> {
    let key = format!("zero_optimization.{section}.nvme_path");
    match (dev, nvme_path) {
        (DsDevice::Nvme, Some(p)) => Ok(OffloadDevice::Nvme { path: p.clone() }),
        (DsDevice::Nvme, None) => Err(ConfigError::NvmePathMissing {
            key,
            device_key: format!("zero_optimization.{section}.device"),
        }),
        (other, Some(_)) => {
            sink.note(
                &key,
                format!(
                    "ignored because device is \"{}\", not \"nvme\"",
                    other.as_str()
                ),
            );
            Ok(if other == DsDevice::Cpu {
                OffloadDevice::Cpu
            } else {
                OffloadDevice::None
            })
        }
        (DsDevice::Cpu, None) => Ok(OffloadDevice::Cpu),
        (DsDevice::None, None) => Ok(OffloadDevice::None),
    }
}

fn validate_param_offload(
    p: Option<&DsOffloadParam>,
    stage: Stage,
    sink: &mut Sink,
) -> Result<ParamOffload, ConfigError> {
    let d = DsOffloadParam::default();
    let p = p.unwrap_or(&d);
    let dev = device("offload_param", p.device, p.nvme_path.as_ref(), sink)?;
    if dev != OffloadDevice::None && stage != Stage::Parameters {
        return Err(ConfigError::OffloadParamNeedsStage3 {
            stage: stage.number(),
            device: p.device.as_str(),
        });
    }
    if matches!(dev, OffloadDevice::Nvme { .. }) {
        positive(
            "zero_optimization.offload_param.buffer_count",
            p.buffer_count,
            "use DeepSpeed's default 5",
        )?;
        positive(
            "zero_optimization.offload_param.buffer_size",
            p.buffer_size,
            "use a size (in elements) at least as large as the largest parameter, e.g. 1e8",
        )?;
    }
    Ok(ParamOffload {
        device: dev,
        buffer_count: p.buffer_count,
        buffer_numel: Numel(p.buffer_size),
        max_in_cpu_numel: Numel(p.max_in_cpu),
        pin_memory: p.pin_memory,
    })
}

fn validate_optimizer_offload(
    o: Option<&DsOffloadOptimizer>,
    stage: Stage,
    sink: &mut Sink,
) -> Result<OptimizerOffload, ConfigError> {
    let d = DsOffloadOptimizer::default();
    let o = o.unwrap_or(&d);
    let dev = device("offload_optimizer", o.device, o.nvme_path.as_ref(), sink)?;
    match (&dev, stage) {
        (OffloadDevice::Nvme { .. }, s) if s != Stage::Parameters => {
            return Err(ConfigError::NvmeOptimizerNeedsStage3 { stage: s.number() })
        }
        (OffloadDevice::Cpu, Stage::Disabled) => {
            return Err(range(
                "zero_optimization.offload_optimizer.device",
                "\"cpu\"",
                "\"none\" with zero_optimization.stage 0 (offload needs stage 1, 2 or 3)",
                "set zero_optimization.stage to 3 (or 1/2)",
            ))
        }
        (OffloadDevice::Nvme { .. }, _) if o.buffer_count < 4 => return Err(range(
            "zero_optimization.offload_optimizer.buffer_count",
            o.buffer_count,
            "at least 4 with nvme (fp32 params, Adam m and v, and gradients each take a buffer)",
            "use DeepSpeed's default 4",
        )),
        _ => {}
    }
    Ok(OptimizerOffload {
        device: dev,
        buffer_count: o.buffer_count,
        pin_memory: o.pin_memory,
        pipeline_read: o.pipeline_read,
        pipeline_write: o.pipeline_write,
        fast_init: o.fast_init,
    })
}

/// `tierzero.pinned_budget_bytes` against the swap buffers, with the
/// engine's own sizing policy ([`crate::engine::sizing`]): on a model
/// known by its size (`run.model_numel`) the whole decision, else the
/// param swap-in buffers alone (the optimizer's depend on the model's
/// sub-groups). The engine checks again with the real layout at build.
fn check_pinned_budget(c: &Config, run: &RunContext) -> Result<(), ConfigError> {
    use crate::engine::sizing::{self, Shape};
    let Some(budget) = c.tierzero.pinned_budget_bytes else {
        return Ok(());
    };
    let p = &c.zero.offload_param;
    let elem = c.precision.param_elem_bytes();
    let short = match run.model_numel {
        Some(model) => {
            let ranks = c.batch.ranks.max(1);
            let per_rank = model.div_ceil(ranks);
            // The largest parameter's shard is a sub-group of its own when
            // it exceeds sub_group_size, as in the engine's layout.
            let largest = run.largest_param_numel.map(|l| l.div_ceil(ranks));
            let shape = Shape::estimated(per_rank, largest, c.zero.sub_group_numel.0);
            sizing::decide(c, &shape).err()
        }
        None => {
            let bufs = sizing::param_buffers(p.buffer_count, p.buffer_numel.0, elem);
            let nvme =
                c.zero.stage == Stage::Parameters && matches!(p.device, OffloadDevice::Nvme { .. });
            (nvme && bufs.total_bytes() > budget.0).then_some(sizing::BudgetShort {
                budget_bytes: budget.0,
                param_buffers: bufs,
                optimizer_buffers_needed: sizing::Buffers::NONE,
                optimizer_stages: 0,
                park_buffers: sizing::Buffers::NONE,
                required_bytes: bufs.total_bytes(),
            })
        }
    };
    let Some(short) = short else {
        return Ok(());
    };
    let mut what = Vec::new();
    let mut parts = Vec::new();
    let mut lower = Vec::new();
    if short.param_buffers.count > 0 {
        what.push("offload_param");
        parts.push(format!(
            "buffer_count {} × buffer_size {} elements × {elem} bytes, 4 KiB-aligned ({} bytes each)",
            short.param_buffers.count, p.buffer_numel.0, short.param_buffers.bytes_each
        ));
        lower.push("zero_optimization.offload_param.buffer_count / buffer_size");
    }
    if short.optimizer_buffers_needed.count > 0 {
        what.push("offload_optimizer");
        parts.push(format!(
            "{} buffers (what the optimizer pipeline needs) × {} bytes (the largest sub-group's fp32 state, 4 KiB-aligned; sub_group_size {})",
            short.optimizer_buffers_needed.count,
            short.optimizer_buffers_needed.bytes_each,
            c.zero.sub_group_numel.0
        ));
        lower.push("zero_optimization.sub_group_size");
    }
    if short.park_buffers.count > 0 {
        parts.push(format!(
            "{} gradient park buffers × {} bytes (partial sums between micro-batches; the largest sub-group's fp32 gradient)",
            short.park_buffers.count, short.park_buffers.bytes_each
        ));
    }
    Err(ConfigError::PinnedBudgetTooSmall {
        budget_bytes: budget.0,
        required_bytes: short.required_bytes,
        what: what.join(" + "),
        breakdown: parts.join(" + "),
        lower_keys: lower.join(" or "),
    })
}

/// Checks that `dir` is an existing, writable directory (creating it first
/// with [`PathChecks::CreateMissing`]). Writability is tested by creating
/// and removing a probe file, which also catches read-only mounts that
/// permission bits do not show.
fn check_dir(key: &str, dir: &Path, mode: PathChecks) -> Result<(), ConfigError> {
    let not_writable = |reason: String| ConfigError::NvmePathNotWritable {
        key: key.to_owned(),
        dir: dir.to_owned(),
        reason: super::error::truncate(&reason),
    };
    match mode {
        PathChecks::Skip => return Ok(()),
        PathChecks::CreateMissing if !dir.exists() => {
            std::fs::create_dir_all(dir)
                .map_err(|e| not_writable(format!("cannot create it: {e}")))?;
        }
        _ => {}
    }
    match std::fs::metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(ConfigError::NvmePathNotFound {
                key: key.to_owned(),
                dir: dir.to_owned(),
            })
        }
        Err(e) => return Err(not_writable(e.to_string())),
        Ok(m) if !m.is_dir() => {
            return Err(ConfigError::NvmePathNotDir {
                key: key.to_owned(),
                dir: dir.to_owned(),
            })
        }
        Ok(_) => {}
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let probe = dir.join(format!(
        ".tierzero-write-probe-{}-{nanos}",
        std::process::id()
    ));
    let created = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe);
    match created {
        Ok(f) => {
            drop(f);
            std::fs::remove_file(&probe)
                .map_err(|e| not_writable(format!("cannot remove probe file: {e}")))?;
            Ok(())
        }
        Err(e) => Err(not_writable(format!("cannot create a file there: {e}"))),
    }
}

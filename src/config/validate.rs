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

mod offload;
mod training;

use offload::{check_dir, check_pinned_budget, validate_optimizer_offload, validate_param_offload};
use training::{resolve_batch, resolve_optimizer, resolve_precision, resolve_scheduler};

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
        /// DeepSpeed's `consecutive_hysteresis`: every step without an
        /// overflow restores the hysteresis (else only a growth does).
        consecutive_hysteresis: bool,
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

    /// Its name in the plan and the checkpoint's manifest.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 { .. } => "fp16",
        }
    }

    /// The dtype params are stored, gathered and computed in: the 16-bit
    /// one when enabled, else fp32.
    pub fn storage_dtype(self) -> candle_core::DType {
        match self {
            Precision::Fp32 => candle_core::DType::F32,
            Precision::Bf16 => candle_core::DType::BF16,
            Precision::Fp16 { .. } => candle_core::DType::F16,
        }
    }

    /// The device units' GEMM operands: fp32, or the 16-bit dtype when
    /// enabled (16-bit params and unit outputs, fp32 math elsewhere, the
    /// head's gradients at the loss scale; see `model::exec_units`).
    pub fn gemm_dtype(self) -> tierzero_gpu::unit::GemmDtype {
        use tierzero_gpu::unit::GemmDtype;
        match self {
            Precision::Fp32 => GemmDtype::F32,
            Precision::Bf16 => GemmDtype::Bf16,
            Precision::Fp16 { .. } => GemmDtype::F16,
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
    /// Adam's bias correction (`optimizer.params.bias_correction`).
    pub bias_correction: bool,
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
    /// Params of at most this many elements stay resident
    /// (`stage3_param_persistence_threshold`), within
    /// `model_persistence_threshold_numel` in all.
    pub param_persistence_threshold_numel: Numel,
    /// The persistent params' elements at most
    /// (`stage3_model_persistence_threshold`; see
    /// [`crate::engine::sizing::persistent_params`]).
    pub model_persistence_threshold_numel: Numel,
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
    /// Accelerator memory for a resident parameter cache; `None` = auto
    /// (what the device tier's share of the budget holds).
    pub device_cache_bytes: Option<Bytes>,
    /// GPU memory tierzero may allocate; `None` = free memory less 5%.
    pub device_budget_bytes: Option<Bytes>,
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
    /// Speculative optimizer step with clipping or an overflow check; `None` = auto
    /// (see `crate::engine::trainer` "Speculative step").
    pub speculative_step: Option<bool>,
    /// NVMe bytes of the speculation pool; `None` = auto (a slot for every
    /// NVMe sub-group within half the free space, see
    /// `crate::engine::sizing::speculation_pool`).
    pub speculation_pool_bytes: Option<Bytes>,
    /// How long a stop may take from its request to the end of the run
    /// (`tierzero.stop_grace_s`); `None` = no bound.
    pub stop_grace: Option<std::time::Duration>,
    /// Memory for the units' forward graphs kept until backward
    /// (`tierzero.activation_budget_bytes`, DeepSpeed's
    /// `activation_checkpointing`).
    pub activations: ActivationBudget,
}

/// The activation policy's budget (see "Activations" in
/// `crate::engine::trainer`): how much memory may hold the units' forward
/// graphs from their forward to their backward; the units beyond it are
/// recomputed from their saved inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ActivationBudget {
    /// `"auto"`: half the memory available once the engine is built.
    #[default]
    Auto,
    /// `tierzero.activation_budget_bytes` (0: recompute every unit).
    Bytes(u64),
    /// Checkpointing on (DeepSpeed's `activation_checkpointing` block, or
    /// `tierzero train --gradient-checkpointing` as HF's switch):
    /// recompute every unit.
    Checkpointing,
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
    /// Whether the step checks its gradients for overflow (waits for their
    /// global norm and skips the step when it is not finite): always in
    /// fp16 (the loss scaler's overflow), never in fp32 (DeepSpeed does not
    /// check there). In bf16 as DeepSpeed does: `bf16.check_grad_overflow`
    /// (default true) is read by its stage 1 and 2 optimizer only; its
    /// stage 0 and stage 3 optimizers never check (nor its stage 1
    /// `BF16_Optimizer`, with `data_types.grad_accum_dtype` fp32 and no
    /// CPU offload: tierzero does not read `data_types`). An
    /// explicit true at stage 0 or 3 is honoured, with a note that
    /// DeepSpeed would apply such a step. With clipping the norm
    /// is taken anyway, and a norm that is not finite skips the step
    /// whatever this says: stricter than DeepSpeed, which would clip by
    /// it and apply NaNs.
    pub check_grad_overflow: bool,
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

/// DeepSpeed's assertions on its 16-bit state flags (`config.py`
/// `_do_error_check`): each needs ZeRO stage 1, 2 or 3, and
/// `bf16_optimizer_states` needs `bf16_master_weights_and_grads`.
fn check_16bit_state_flags(ds: &DsConfig, stage: Stage) -> Result<(), ConfigError> {
    for (key, on) in [
        (
            "fp16.fp16_master_weights_and_grads",
            ds.fp16.fp16_master_weights_and_grads,
        ),
        (
            "bf16.bf16_master_weights_and_grads",
            ds.bf16.bf16_master_weights_and_grads,
        ),
        ("bf16.bf16_optimizer_states", ds.bf16.bf16_optimizer_states),
    ] {
        if on && stage == Stage::Disabled {
            return Err(range(
                key,
                true,
                "false at ZeRO stage 0 (DeepSpeed asserts stage 1, 2 or 3)",
                "remove it, or set zero_optimization.stage",
            ));
        }
    }
    if ds.bf16.bf16_optimizer_states && !ds.bf16.bf16_master_weights_and_grads {
        return Err(range(
            "bf16.bf16_optimizer_states",
            true,
            "false without bf16.bf16_master_weights_and_grads (DeepSpeed asserts it)",
            "remove it, or set bf16.bf16_master_weights_and_grads too",
        ));
    }
    Ok(())
}

/// `bf16.check_grad_overflow` at `stage`, as DeepSpeed reads it
/// ([`Config::check_grad_overflow`]).
fn bf16_checks_overflow(written: Option<bool>, stage: Stage, sink: &mut Sink) -> bool {
    let read_by_deepspeed = matches!(stage, Stage::OptimizerStates | Stage::Gradients);
    match written {
        None => read_by_deepspeed,
        Some(true) if !read_by_deepspeed => {
            sink.note(
                "bf16.check_grad_overflow",
                format!(
                    "true at stage {}: a bf16 step whose gradients are not all finite is \
                     skipped, as asked; DeepSpeed's stage {} optimizer does not read this \
                     key and would apply the step",
                    stage.number(),
                    stage.number()
                ),
            );
            true
        }
        Some(v) => v,
    }
}

impl Config {
    /// Whether each step waits for the global gradient norm before Adam:
    /// to clip by it, or to skip a step whose gradients are not all
    /// finite ([`Config::check_grad_overflow`]). The one rule for the
    /// step's decision, the optimizer's overlap and the spill sizing.
    pub fn waits_for_global_norm(&self) -> bool {
        self.gradient_clipping.is_some() || self.check_grad_overflow
    }
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
    /// value, with a note, as accelerate does (HF Trainer refuses the
    /// mismatch: here a `--steps` below a fixed schedule's end is a run
    /// resumed later to its end). Returns `None` when nothing is known.
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
                        format!("config value {v} kept although the run's {run_name} is {r} (scheduler step counts are fill-only, as in accelerate; HF Trainer refuses the mismatch)"),
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
        // WarmupLR's peak defaults to the optimizer's lr (DeepSpeed #7360).
        Scheduler::WarmupLr { min_lr, max_lr, .. } => (
            "scheduler.params.warmup_max_lr (absent: optimizer.params.lr)",
            min_lr.max(max_lr),
        ),
        Scheduler::WarmupDecayLr { min_lr, max_lr, .. } => {
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

/// The most elements a size key (`sub_group_size`, `buffer_size`) may
/// name: 2^48, far beyond any model, so that byte counts made from it
/// (times 4, times a buffer count, summed) stay exact in a u64.
pub const MAX_SIZE_NUMEL: u64 = 1 << 48;

/// The most buffers a `buffer_count` may name.
pub const MAX_BUFFER_COUNT: u64 = 1 << 16;

/// `v` within `1..=max`.
fn within(key: &str, v: u64, max: u64, fix: &str) -> Result<u64, ConfigError> {
    if v == 0 || v > max {
        Err(range(key, v, &format!("between 1 and {max}"), fix))
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
        // DeepSpeed's default since 0.19.3 (#8068; 0.0 before).
        1.0,
    )?;
    if ds.gradient_clipping.is_none() && run.max_grad_norm.is_none() {
        r.record(
            "gradient_clipping",
            format!("{clip:?}"),
            Source::DeepSpeedDefaultSince {
                version: "0.19.3",
                before: "0 (no clipping)",
            },
        );
    }
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
    let sub_group = within(
        "zero_optimization.sub_group_size",
        z.sub_group_size,
        MAX_SIZE_NUMEL,
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
        model_persistence_threshold_numel: Numel(z.stage3_model_persistence_threshold),
        max_live_parameters_numel: Numel(z.stage3_max_live_parameters),
        max_reuse_distance_numel: Numel(z.stage3_max_reuse_distance),
        gather_16bit_weights_on_model_save: gather16,
        contiguous_gradients: z.contiguous_gradients,
        overlap_comm: z.overlap_comm.unwrap_or(stage == Stage::Parameters),
        reduce_bucket_numel: Numel(reduce_bucket),
    };

    let a = &ds.aio;
    if a.block_size == 0 || !a.block_size.is_multiple_of(512) || a.block_size > 1 << 30 {
        return Err(range(
            "aio.block_size",
            a.block_size,
            "a positive multiple of 512 bytes (O_DIRECT alignment), at most 1 GiB",
            "use 1048576 (1 MiB, DeepSpeed's default)",
        ));
    }
    let aio = Aio {
        block_bytes: Bytes(a.block_size),
        queue_depth: small_u32(
            "aio.queue_depth",
            a.queue_depth,
            tierzero_swap::fileio::MAX_RING_ENTRIES,
            "use 8 to 128",
        )?,
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
        device_cache_bytes: t.device_cache_bytes.map(Bytes),
        device_budget_bytes: t.device_budget_bytes.map(Bytes),
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
                crate::engine::host::threads::MAX_COMPUTE_THREADS as u32,
                "use \"auto\" (every core), or a count no larger than the machine's cores",
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
        activations: match (t.activation_budget_bytes, &ds.activation_checkpointing) {
            (Some(b), Some(_)) => {
                sink.note(
                    "activation_checkpointing",
                    format!(
                        "tierzero.activation_budget_bytes {b} decides which blocks are kept \
                         and which recomputed; this block changes nothing"
                    ),
                );
                ActivationBudget::Bytes(b)
            }
            (Some(b), None) => ActivationBudget::Bytes(b),
            (None, Some(_)) => ActivationBudget::Checkpointing,
            (None, None) => ActivationBudget::Auto,
        },
    };

    let config = Config {
        batch,
        gradient_clipping: if clip > 0.0 { Some(clip) } else { None },
        steps_per_print: ds.steps_per_print,
        wall_clock_breakdown: ds.wall_clock_breakdown,
        precision,
        check_grad_overflow: match precision {
            Precision::Fp16 { .. } => true,
            Precision::Bf16 => bf16_checks_overflow(ds.bf16.check_grad_overflow, zero.stage, sink),
            Precision::Fp32 => false,
        },
        optimizer,
        scheduler,
        zero,
        aio,
        tierzero,
    };

    check_16bit_state_flags(ds, config.zero.stage)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Each precision's element bytes, storage dtype, GEMM operands and
    /// name agree (the plan sizes by one, the engine stores by another).
    #[test]
    fn a_precisions_dtypes_agree() {
        use tierzero_gpu::unit::GemmDtype;
        let fp16 = Precision::Fp16 {
            loss_scale: LossScale::Static(1.0),
        };
        for (p, gemm, name) in [
            (Precision::Fp32, GemmDtype::F32, "fp32"),
            (Precision::Bf16, GemmDtype::Bf16, "bf16"),
            (fp16, GemmDtype::F16, "fp16"),
        ] {
            assert_eq!(
                p.storage_dtype().size_in_bytes() as u64,
                p.param_elem_bytes()
            );
            assert_eq!(p.gemm_dtype(), gemm);
            assert_eq!(p.name(), name);
            assert_eq!(
                format!("{:?}", p.storage_dtype()).to_lowercase(),
                match name {
                    "fp32" => "f32",
                    "fp16" => "f16",
                    _ => "bf16",
                }
            );
        }
    }
}

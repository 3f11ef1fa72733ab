//! The edge: serde structs that mirror `ds_config.json` key for key, with
//! DeepSpeed's defaults, and the walker that fills them from JSON.
//!
//! These structs hold the config *as written*, after aliases are folded into
//! their current names and defaults are filled in, but before `"auto"` is
//! resolved and before any cross-key check. `"auto"` survives as
//! [`AutoOr::Auto`]. Serialising a [`DsConfig`] gives the effective config in
//! DeepSpeed's own key names (useful for `--print-config` style output); it
//! deserialises back to the same value.
//!
//! Defaults are DeepSpeed's (see `shared/reference/deepspeed-offload.md`
//! section 1(a) and DeepSpeed's `runtime/config.py`, `runtime/zero/config.py`,
//! `runtime/zero/offload_config.py`, `runtime/swap_tensor/aio_config.py`,
//! `runtime/lr_schedules.py`). Where DeepSpeed's default is "none" the field
//! is an `Option`.
//!
//! Deprecated aliases accepted (each logs a [`ConfigWarning::Deprecated`];
//! giving an alias together with its replacement is
//! [`ConfigError::ConflictingAlias`]):
//! - `zero_optimization.stage3_gather_fp16_weights_on_model_save` →
//!   `stage3_gather_16bit_weights_on_model_save`;
//! - `zero_optimization.cpu_offload: true` → `offload_optimizer: {device: cpu}`;
//! - `zero_optimization.cpu_offload_param: true` → `offload_param: {device: cpu}`;
//! - `zero_optimization.cpu_offload_use_pin_memory` → `pin_memory` of the
//!   sections created by the two keys above;
//! - `aio.thread_count` → `aio.intra_op_parallelism`;
//! - top-level `bfloat16` → `bf16`.
//!
//! DeepSpeed's pydantic models also accept the field names of the `stage3_*`
//! keys without the prefix (`prefetch_bucket_size`,
//! `param_persistence_threshold`, `max_live_parameters`,
//! `max_reuse_distance`, `gather_16bit_weights_on_model_save`); so do we,
//! silently, as DeepSpeed does.

use std::path::PathBuf;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use super::error::{render, ConfigError};
use super::reader::{ConfigWarning, Field, Obj, Sink};
use super::units::parse_bytes_str;

/// A value that may be written as `"auto"` (to be filled from the run, the
/// way HF Trainer fills it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AutoOr<T> {
    /// `"auto"`.
    Auto,
    /// A concrete value.
    Value(T),
}

impl<T> AutoOr<T> {
    fn from_opt(v: Option<T>) -> Self {
        match v {
            Some(v) => AutoOr::Value(v),
            None => AutoOr::Auto,
        }
    }
}

impl<T: Serialize> Serialize for AutoOr<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            AutoOr::Auto => s.serialize_str("auto"),
            AutoOr::Value(v) => v.serialize(s),
        }
    }
}

impl<'de, T: DeserializeOwned> Deserialize<'de> for AutoOr<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        if v.as_str() == Some("auto") {
            return Ok(AutoOr::Auto);
        }
        T::deserialize(v)
            .map(AutoOr::Value)
            .map_err(serde::de::Error::custom)
    }
}

/// The whole `ds_config.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DsConfig {
    /// `train_batch_size`: samples per optimizer step over all ranks.
    pub train_batch_size: Option<AutoOr<u64>>,
    /// `train_micro_batch_size_per_gpu`: samples per forward/backward per rank.
    pub train_micro_batch_size_per_gpu: Option<AutoOr<u64>>,
    /// `gradient_accumulation_steps`.
    pub gradient_accumulation_steps: Option<AutoOr<u64>>,
    /// `gradient_clipping`: global-norm clip; `None` = absent, DeepSpeed's
    /// default 0.0 (off).
    pub gradient_clipping: Option<AutoOr<f64>>,
    /// `steps_per_print`: DeepSpeed default 10.
    pub steps_per_print: u64,
    /// `wall_clock_breakdown`: DeepSpeed default false.
    pub wall_clock_breakdown: bool,
    /// `fp16` block.
    pub fp16: DsFp16,
    /// `bf16` block (alias `bfloat16`).
    pub bf16: DsBf16,
    /// `optimizer` block; `None` when absent.
    pub optimizer: Option<DsOptimizer>,
    /// `scheduler` block; `None` when absent.
    pub scheduler: Option<DsScheduler>,
    /// `zero_optimization` block.
    pub zero_optimization: DsZero,
    /// `aio` block.
    pub aio: DsAio,
    /// Our own knobs.
    pub tierzero: DsTierzero,
}

impl Default for DsConfig {
    fn default() -> Self {
        DsConfig {
            train_batch_size: None,
            train_micro_batch_size_per_gpu: None,
            gradient_accumulation_steps: None,
            gradient_clipping: None,
            steps_per_print: 10,
            wall_clock_breakdown: false,
            fp16: DsFp16::default(),
            bf16: DsBf16::default(),
            optimizer: None,
            scheduler: None,
            zero_optimization: DsZero::default(),
            aio: DsAio::default(),
            tierzero: DsTierzero::default(),
        }
    }
}

/// `fp16` {...}.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DsFp16 {
    /// `enabled`: default false.
    pub enabled: AutoOr<bool>,
    /// `loss_scale`: 0 means dynamic loss scaling (default 0).
    pub loss_scale: f64,
    /// `initial_scale_power`: the first dynamic scale is 2^this (default 16).
    pub initial_scale_power: u32,
    /// `loss_scale_window`: steps without overflow before raising the scale (default 1000).
    pub loss_scale_window: u64,
    /// `hysteresis`: overflows tolerated before lowering the scale (default 2).
    pub hysteresis: u64,
    /// `min_loss_scale`: floor of the dynamic scale (default 1).
    pub min_loss_scale: f64,
}

impl Default for DsFp16 {
    fn default() -> Self {
        DsFp16 {
            enabled: AutoOr::Value(false),
            loss_scale: 0.0,
            initial_scale_power: 16,
            loss_scale_window: 1000,
            hysteresis: 2,
            min_loss_scale: 1.0,
        }
    }
}

/// `bf16` {...}.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DsBf16 {
    /// `enabled`: default false.
    pub enabled: AutoOr<bool>,
}

impl Default for DsBf16 {
    fn default() -> Self {
        DsBf16 {
            enabled: AutoOr::Value(false),
        }
    }
}

/// `optimizer` {...}.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DsOptimizer {
    /// `type` as written (DeepSpeed matches it case-insensitively).
    #[serde(rename = "type")]
    pub kind: String,
    /// `params`.
    #[serde(default)]
    pub params: DsAdamParams,
}

/// `optimizer.params` for Adam/AdamW. `None` = not written (DeepSpeed's
/// defaults apply: lr 1e-3, betas [0.9, 0.999], eps 1e-8, weight_decay 0).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DsAdamParams {
    /// `lr`.
    pub lr: Option<AutoOr<f64>>,
    /// `betas`.
    pub betas: Option<AutoOr<[f64; 2]>>,
    /// `eps`.
    pub eps: Option<AutoOr<f64>>,
    /// `weight_decay`.
    pub weight_decay: Option<AutoOr<f64>>,
    /// `adam_w_mode`: decoupled weight decay for type `Adam` (DeepSpeed
    /// default true; type `AdamW` is always decoupled).
    pub adam_w_mode: bool,
}

impl Default for DsAdamParams {
    fn default() -> Self {
        DsAdamParams {
            lr: None,
            betas: None,
            eps: None,
            weight_decay: None,
            adam_w_mode: true,
        }
    }
}

/// `scheduler` {...}.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DsScheduler {
    /// `type` as written (DeepSpeed matches it exactly).
    #[serde(rename = "type")]
    pub kind: String,
    /// `params`; which keys apply depends on `type`.
    #[serde(default)]
    pub params: DsSchedulerParams,
}

/// `scheduler.params` for WarmupLR / WarmupDecayLR / WarmupCosineLR. `None`
/// = not written. DeepSpeed defaults: `warmup_min_lr` 0, `warmup_max_lr`
/// 0.001, `warmup_num_steps` 1000, `warmup_type` "log", `warmup_min_ratio`
/// 0, `cos_min_ratio` 0.0001; `total_num_steps` has no default (required by
/// WarmupDecayLR and WarmupCosineLR).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DsSchedulerParams {
    /// `warmup_min_lr` (WarmupLR, WarmupDecayLR).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup_min_lr: Option<AutoOr<f64>>,
    /// `warmup_max_lr` (WarmupLR, WarmupDecayLR).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup_max_lr: Option<AutoOr<f64>>,
    /// `warmup_num_steps` (all three).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup_num_steps: Option<AutoOr<u64>>,
    /// `warmup_type`: "log" or "linear" (all three).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup_type: Option<String>,
    /// `total_num_steps` (WarmupDecayLR, WarmupCosineLR).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub total_num_steps: Option<AutoOr<u64>>,
    /// `warmup_min_ratio` (WarmupCosineLR).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup_min_ratio: Option<f64>,
    /// `cos_min_ratio` (WarmupCosineLR).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cos_min_ratio: Option<f64>,
}

/// Offload device as DeepSpeed spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DsDevice {
    /// `"none"` (default).
    #[default]
    None,
    /// `"cpu"`.
    Cpu,
    /// `"nvme"`.
    Nvme,
}

impl DsDevice {
    /// DeepSpeed's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            DsDevice::None => "none",
            DsDevice::Cpu => "cpu",
            DsDevice::Nvme => "nvme",
        }
    }
}

/// `zero_optimization` {...}. Sizes are element counts, as in DeepSpeed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DsZero {
    /// `stage`: 0..=3 (default 0). Kept wide here; validated later.
    pub stage: u64,
    /// `offload_param` (stage 3 only); `None` when absent.
    pub offload_param: Option<DsOffloadParam>,
    /// `offload_optimizer`; `None` when absent.
    pub offload_optimizer: Option<DsOffloadOptimizer>,
    /// `sub_group_size` (elements, default 1e9).
    pub sub_group_size: u64,
    /// `stage3_prefetch_bucket_size` (elements, default 5e7).
    #[serde(alias = "prefetch_bucket_size")]
    pub stage3_prefetch_bucket_size: AutoOr<u64>,
    /// `stage3_param_persistence_threshold` (elements, default 1e5).
    #[serde(alias = "param_persistence_threshold")]
    pub stage3_param_persistence_threshold: AutoOr<u64>,
    /// `stage3_max_live_parameters` (elements, default 1e9).
    #[serde(alias = "max_live_parameters")]
    pub stage3_max_live_parameters: u64,
    /// `stage3_max_reuse_distance` (elements, default 1e9).
    #[serde(alias = "max_reuse_distance")]
    pub stage3_max_reuse_distance: u64,
    /// `stage3_gather_16bit_weights_on_model_save` (default false).
    #[serde(
        alias = "stage3_gather_fp16_weights_on_model_save",
        alias = "gather_16bit_weights_on_model_save"
    )]
    pub stage3_gather_16bit_weights_on_model_save: AutoOr<bool>,
    /// `contiguous_gradients` (default true).
    pub contiguous_gradients: bool,
    /// `overlap_comm` (default: true for stage 3, false otherwise).
    pub overlap_comm: Option<bool>,
    /// `reduce_bucket_size` (elements, default 5e8).
    pub reduce_bucket_size: AutoOr<u64>,
}

impl Default for DsZero {
    fn default() -> Self {
        DsZero {
            stage: 0,
            offload_param: None,
            offload_optimizer: None,
            sub_group_size: 1_000_000_000,
            stage3_prefetch_bucket_size: AutoOr::Value(50_000_000),
            stage3_param_persistence_threshold: AutoOr::Value(100_000),
            stage3_max_live_parameters: 1_000_000_000,
            stage3_max_reuse_distance: 1_000_000_000,
            stage3_gather_16bit_weights_on_model_save: AutoOr::Value(false),
            contiguous_gradients: true,
            overlap_comm: None,
            reduce_bucket_size: AutoOr::Value(500_000_000),
        }
    }
}

/// `zero_optimization.offload_param` {...}.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DsOffloadParam {
    /// `device` (default "none").
    pub device: DsDevice,
    /// `nvme_path` (no default).
    pub nvme_path: Option<PathBuf>,
    /// `buffer_count`: pinned swap-in buffers (default 5).
    pub buffer_count: u64,
    /// `buffer_size`: **elements** per buffer (default 1e8).
    pub buffer_size: u64,
    /// `max_in_cpu`: **elements** of params kept in host memory with nvme (default 1e9).
    pub max_in_cpu: u64,
    /// `pin_memory` (default true).
    pub pin_memory: bool,
}

impl Default for DsOffloadParam {
    fn default() -> Self {
        DsOffloadParam {
            device: DsDevice::None,
            nvme_path: None,
            buffer_count: 5,
            buffer_size: 100_000_000,
            max_in_cpu: 1_000_000_000,
            pin_memory: true,
        }
    }
}

/// `zero_optimization.offload_optimizer` {...}.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DsOffloadOptimizer {
    /// `device` (default "none").
    pub device: DsDevice,
    /// `nvme_path` (no default).
    pub nvme_path: Option<PathBuf>,
    /// `buffer_count`: pinned buffers of one sub-group each (default 4).
    pub buffer_count: u64,
    /// `pin_memory` (default true).
    pub pin_memory: bool,
    /// `pipeline_read` (default false).
    pub pipeline_read: bool,
    /// `pipeline_write` (default false).
    pub pipeline_write: bool,
    /// `fast_init` (default false).
    pub fast_init: bool,
}

impl Default for DsOffloadOptimizer {
    fn default() -> Self {
        DsOffloadOptimizer {
            device: DsDevice::None,
            nvme_path: None,
            buffer_count: 4,
            pin_memory: true,
            pipeline_read: false,
            pipeline_write: false,
            fast_init: false,
        }
    }
}

/// Top-level `aio` {...}.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DsAio {
    /// `block_size`: **bytes** per request (default 1048576).
    pub block_size: u64,
    /// `queue_depth`: requests in flight per worker (default 8).
    pub queue_depth: u64,
    /// `intra_op_parallelism` (old name `thread_count`): workers per op (default 1).
    #[serde(alias = "thread_count")]
    pub intra_op_parallelism: u64,
    /// `single_submit` (default false).
    pub single_submit: bool,
    /// `overlap_events` (default true).
    pub overlap_events: bool,
    /// `use_gds` (default false).
    pub use_gds: bool,
}

impl Default for DsAio {
    fn default() -> Self {
        DsAio {
            block_size: 1_048_576,
            queue_depth: 8,
            intra_op_parallelism: 1,
            single_submit: false,
            overlap_events: true,
            use_gds: false,
        }
    }
}

/// `tierzero.io_backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IoBackend {
    /// io_uring when the kernel allows it, else the portable backend.
    #[default]
    Auto,
    /// io_uring only; fail if unavailable.
    Uring,
    /// Thread-pool `pread`/`pwrite`; works everywhere.
    Portable,
}

/// `tierzero.direct_io`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DirectIo {
    /// `O_DIRECT` when the filesystem supports it, buffered I/O otherwise.
    #[default]
    Auto,
    /// `O_DIRECT` or fail (benchmarks that must bypass the page cache).
    Require,
    /// Always buffered I/O.
    Off,
}

/// `tierzero.memlock`: what to do when the pinned buffers (those with
/// `pin_memory: true`) exceed `RLIMIT_MEMLOCK` and the process lacks
/// `CAP_IPC_LOCK`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Memlock {
    /// One warning with the numbers, then run with unlocked buffers
    /// (correct, slower, and the kernel may swap them out).
    #[default]
    Auto,
    /// Refuse to start, with the numbers and the fix.
    Require,
}

impl From<IoBackend> for tierzero_swap::BackendKind {
    fn from(b: IoBackend) -> Self {
        match b {
            IoBackend::Auto => tierzero_swap::BackendKind::Auto,
            IoBackend::Uring => tierzero_swap::BackendKind::Uring,
            IoBackend::Portable => tierzero_swap::BackendKind::Portable,
        }
    }
}

impl From<DirectIo> for tierzero_swap::DirectIo {
    fn from(d: DirectIo) -> Self {
        match d {
            DirectIo::Auto => tierzero_swap::DirectIo::Auto,
            DirectIo::Require => tierzero_swap::DirectIo::Require,
            DirectIo::Off => tierzero_swap::DirectIo::Off,
        }
    }
}

/// Our own knobs: the top-level `"tierzero": {...}` block. DeepSpeed ignores
/// unknown top-level keys only with a warning, so a config that carries this
/// block still loads in DeepSpeed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DsTierzero {
    /// `pinned_budget_bytes`: the most page-locked host memory tierzero may
    /// allocate for all swap buffers together (integer bytes or a string
    /// like `"2GiB"`). Absent = sized to what the buffers need. Checked
    /// against `offload_param.buffer_count × buffer_size × element bytes`
    /// at load time (DeepSpeed#3000: pinned buffers OOM small hosts).
    pub pinned_budget_bytes: Option<u64>,
    /// `device_cache_bytes`: accelerator memory tierzero may use to keep
    /// gathered parameters resident between uses, beyond
    /// `stage3_max_live_parameters` (DeepSpeed#3054). Default 0 (no cache).
    pub device_cache_bytes: u64,
    /// `io_backend`: "auto" (default), "uring" or "portable".
    pub io_backend: IoBackend,
    /// `direct_io`: "auto" (default), "require" or "off".
    pub direct_io: DirectIo,
    /// `memlock`: "auto" (default) or "require"; see [`Memlock`].
    pub memlock: Memlock,
    /// `ring_threads`: I/O submission threads (one io_uring each). Absent =
    /// `aio.intra_op_parallelism`.
    pub ring_threads: Option<u64>,
    /// `checksums`: CRC32C every swap extent on write and verify on read, so
    /// a short or torn write is caught at the next read with its file and
    /// offset (DeepSpeed's "buffer nbytes != file bytes"). Default true.
    pub checksums: bool,
    /// `overlap_optimizer`: step the CPU optimizer for a sub-group as soon as
    /// its gradients are final, overlapping backward, instead of after
    /// backward as DeepSpeed does. Same result; default true.
    pub overlap_optimizer: bool,
    /// `compute_threads`: threads of the CPU compute kernels (candle's
    /// matmuls). `"auto"` (absent) keeps one core per Adam thread free for
    /// the optimizer and I/O threads when anything is offloaded, and uses
    /// every core otherwise; `RAYON_NUM_THREADS` in the environment takes
    /// the place of `"auto"`. `None` = auto.
    pub compute_threads: Option<u64>,
    /// `optimizer_resident_bytes`: host memory (pageable, not pinned) for
    /// the fp32 state of the sub-groups the next forward needs first, kept
    /// out of `offload_optimizer.device = "nvme"`: they are the last
    /// stepped, so their state would be written in the optimizer's tail,
    /// while the next forward waits on it, and read again at the end of
    /// the next backward. `"auto"` (absent) = the state of one
    /// `stage3_prefetch_bucket_size` (12 bytes per element), at most a
    /// quarter of all the state; 0 = none.
    /// Same result either way. `None` = auto.
    pub optimizer_resident_bytes: Option<u64>,
    /// `pin_threads`: keep the compute thread(s) and the helper threads
    /// (I/O rings, param copy, optimizer) on separate CPUs. `"auto"`
    /// (absent) pins when something is offloaded on a single rank and a
    /// CPU is left for the helpers; `true` pins whenever a CPU is left;
    /// `false` never. `None` = auto.
    pub pin_threads: Option<bool>,
}

impl Default for DsTierzero {
    fn default() -> Self {
        DsTierzero {
            pinned_budget_bytes: None,
            device_cache_bytes: 0,
            io_backend: IoBackend::Auto,
            direct_io: DirectIo::Auto,
            memlock: Memlock::Auto,
            ring_threads: None,
            checksums: true,
            overlap_optimizer: true,
            compute_threads: None,
            optimizer_resident_bytes: None,
            pin_threads: None,
        }
    }
}

// ---------------------------------------------------------------------------
// Schema: known keys and DeepSpeed keys tierzero ignores, per object.

const TOP_KEYS: &[&str] = &[
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "steps_per_print",
    "wall_clock_breakdown",
    "fp16",
    "bf16",
    "bfloat16",
    "optimizer",
    "scheduler",
    "zero_optimization",
    "aio",
    "tierzero",
];
const TOP_IGNORED: &[&str] = &[
    "prescale_gradients",
    "gradient_predivide_factor",
    "sparse_gradients",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "activation_checkpointing",
    "flops_profiler",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comms_logger",
    "communication_data_type",
    "amp",
    "autotuning",
    "elasticity",
    "data_efficiency",
    "curriculum_learning",
    "memory_breakdown",
    "dump_state",
    "checkpoint",
    "data_types",
    "compression_training",
    "pipeline",
    "sparse_attention",
    "dataloader_drop_last",
    "fp32_allreduce",
    "disable_allgather",
    "seed",
];
const FP16_KEYS: &[&str] = &[
    "enabled",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "min_loss_scale",
];
const FP16_IGNORED: &[&str] = &[
    "auto_cast",
    "consecutive_hysteresis",
    "fp16_master_weights_and_grads",
];
const BF16_KEYS: &[&str] = &["enabled"];
const BF16_IGNORED: &[&str] = &["immediate_grad_update", "check_grad_overflow"];
const OPT_KEYS: &[&str] = &["type", "params"];
const ADAM_KEYS: &[&str] = &["lr", "betas", "eps", "weight_decay", "adam_w_mode"];
const ADAM_IGNORED: &[&str] = &[
    "torch_adam",
    "bias_correction",
    "amsgrad",
    "fp32_optimizer_states",
];
const SCHED_KEYS: &[&str] = &["type", "params"];
const SCHED_IGNORED: &[&str] = &["last_batch_iteration"];
const ZERO_KEYS: &[&str] = &[
    "stage",
    "offload_param",
    "offload_optimizer",
    "sub_group_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save",
    "contiguous_gradients",
    "overlap_comm",
    "reduce_bucket_size",
    "prefetch_bucket_size",
    "param_persistence_threshold",
    "max_live_parameters",
    "max_reuse_distance",
    "gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
    "cpu_offload",
    "cpu_offload_param",
    "cpu_offload_use_pin_memory",
];
const ZERO_IGNORED: &[&str] = &[
    "reduce_scatter",
    "allgather_partitions",
    "allgather_bucket_size",
    "use_multi_rank_bucket_allreduce",
    "load_from_fp32_weights",
    "stage3_model_persistence_threshold",
    "model_persistence_threshold",
    "round_robin_gradients",
    "zero_hpz_partition_size",
    "zero_quantized_weights",
    "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients",
    "zeropp_loco_param",
    "memory_efficient_linear",
    "override_module_apply",
    "pipeline_loading_checkpoint",
    "log_trace_cache_warnings",
    "enable_sanity_checks",
    "leaf_module",
    "ignore_unused_parameters",
    "legacy_stage1",
    "elastic_checkpoint",
    "zenflow",
    "stage3_module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential",
    "save_muon_momentum_buffer_in_memory",
    "mics_shard_size",
    "mics_hierarchical_params_gather",
];
const OFFLOAD_PARAM_KEYS: &[&str] = &[
    "device",
    "nvme_path",
    "buffer_count",
    "buffer_size",
    "max_in_cpu",
    "pin_memory",
];
const OFFLOAD_OPT_KEYS: &[&str] = &[
    "device",
    "nvme_path",
    "buffer_count",
    "pin_memory",
    "pipeline_read",
    "pipeline_write",
    "fast_init",
];
const OFFLOAD_OPT_IGNORED: &[&str] = &["ratio", "super_offload", "cpuadam_cores_perc", "pipeline"];
const AIO_KEYS: &[&str] = &[
    "block_size",
    "queue_depth",
    "intra_op_parallelism",
    "thread_count",
    "single_submit",
    "overlap_events",
    "use_gds",
];
const TIERZERO_KEYS: &[&str] = &[
    "pinned_budget_bytes",
    "device_cache_bytes",
    "io_backend",
    "direct_io",
    "memlock",
    "ring_threads",
    "checksums",
    "overlap_optimizer",
    "compute_threads",
    "optimizer_resident_bytes",
    "pin_threads",
];

// ---------------------------------------------------------------------------
// Walker.

fn auto_u64(f: &Field<'_>) -> Result<AutoOr<u64>, ConfigError> {
    f.auto_u64().map(AutoOr::from_opt)
}

fn auto_f64(f: &Field<'_>) -> Result<AutoOr<f64>, ConfigError> {
    f.auto_f64().map(AutoOr::from_opt)
}

fn auto_bool(f: &Field<'_>) -> Result<AutoOr<bool>, ConfigError> {
    f.auto_bool().map(AutoOr::from_opt)
}

/// Reads the whole config from a parsed JSON value.
pub(crate) fn read(root: &Value, sink: &mut Sink) -> Result<DsConfig, ConfigError> {
    let mut o = Obj::new("", root, TOP_KEYS, TOP_IGNORED)?;
    let mut c = DsConfig::default();
    if let Some(f) = o.take("train_batch_size") {
        c.train_batch_size = Some(auto_u64(&f)?);
    }
    if let Some(f) = o.take("train_micro_batch_size_per_gpu") {
        c.train_micro_batch_size_per_gpu = Some(auto_u64(&f)?);
    }
    if let Some(f) = o.take("gradient_accumulation_steps") {
        c.gradient_accumulation_steps = Some(auto_u64(&f)?);
    }
    if let Some(f) = o.take("gradient_clipping") {
        c.gradient_clipping = Some(auto_f64(&f)?);
    }
    if let Some(f) = o.take("steps_per_print") {
        c.steps_per_print = f.u64()?;
    }
    if let Some(f) = o.take("wall_clock_breakdown") {
        c.wall_clock_breakdown = f.bool()?;
    }
    if let Some(f) = o.take("fp16") {
        c.fp16 = read_fp16(&f, sink)?;
    }
    if let Some(f) = o.take_alias("bf16", &["bfloat16"], true, sink)? {
        let mut b = Obj::new(&f.key, f.value, BF16_KEYS, BF16_IGNORED)?;
        if let Some(e) = b.take("enabled") {
            c.bf16.enabled = auto_bool(&e)?;
        }
        b.finish(sink);
    }
    if let Some(f) = o.take("optimizer") {
        c.optimizer = Some(read_optimizer(&f, sink)?);
    }
    if let Some(f) = o.take("scheduler") {
        c.scheduler = Some(read_scheduler(&f, sink)?);
    }
    if let Some(f) = o.take("zero_optimization") {
        c.zero_optimization = read_zero(&f, sink)?;
    }
    if let Some(f) = o.take("aio") {
        c.aio = read_aio(&f, sink)?;
    }
    if let Some(f) = o.take("tierzero") {
        c.tierzero = read_tierzero(&f, sink)?;
    }
    o.finish(sink);
    Ok(c)
}

fn read_fp16(f: &Field<'_>, sink: &mut Sink) -> Result<DsFp16, ConfigError> {
    let mut o = Obj::new(&f.key, f.value, FP16_KEYS, FP16_IGNORED)?;
    let mut p = DsFp16::default();
    if let Some(f) = o.take("enabled") {
        p.enabled = auto_bool(&f)?;
    }
    if let Some(f) = o.take("loss_scale") {
        p.loss_scale = f.f64()?;
    }
    if let Some(f) = o.take("initial_scale_power") {
        let v = f.u64()?;
        p.initial_scale_power =
            u32::try_from(v)
                .ok()
                .filter(|v| *v <= 127)
                .ok_or_else(|| ConfigError::OutOfRange {
                    key: f.key.clone(),
                    value: render(f.value),
                    allowed: "at most 127 (the scale is 2^power in fp32)".to_owned(),
                    fix: "use DeepSpeed's default 16".to_owned(),
                })?;
    }
    if let Some(f) = o.take("loss_scale_window") {
        p.loss_scale_window = f.u64()?;
    }
    if let Some(f) = o.take("hysteresis") {
        p.hysteresis = f.u64()?;
    }
    if let Some(f) = o.take("min_loss_scale") {
        p.min_loss_scale = f.f64()?;
    }
    o.finish(sink);
    Ok(p)
}

fn read_optimizer(f: &Field<'_>, sink: &mut Sink) -> Result<DsOptimizer, ConfigError> {
    let mut o = Obj::new(&f.key, f.value, OPT_KEYS, &[])?;
    let kind = match o.take("type") {
        Some(t) => t.str()?.to_owned(),
        None => {
            return Err(ConfigError::MissingKey {
                key: o.key_path("type"),
                why: "an optimizer block needs a type".to_owned(),
                fix: "add \"type\": \"AdamW\" (or \"Adam\")".to_owned(),
            })
        }
    };
    let mut params = DsAdamParams::default();
    if let Some(pf) = o.take("params") {
        let mut p = Obj::new(&pf.key, pf.value, ADAM_KEYS, ADAM_IGNORED)?;
        if let Some(f) = p.take("lr") {
            params.lr = Some(auto_f64(&f)?);
        }
        if let Some(f) = p.take("betas") {
            params.betas = Some(AutoOr::from_opt(f.auto_pair()?));
        }
        if let Some(f) = p.take("eps") {
            params.eps = Some(auto_f64(&f)?);
        }
        if let Some(f) = p.take("weight_decay") {
            params.weight_decay = Some(auto_f64(&f)?);
        }
        if let Some(f) = p.take("adam_w_mode") {
            params.adam_w_mode = f.bool()?;
        }
        p.finish(sink);
    }
    o.finish(sink);
    Ok(DsOptimizer { kind, params })
}

/// Which `scheduler.params` keys each supported type takes.
pub(crate) fn scheduler_param_keys(kind: &str) -> Option<&'static [&'static str]> {
    match kind {
        "WarmupLR" => Some(&[
            "warmup_min_lr",
            "warmup_max_lr",
            "warmup_num_steps",
            "warmup_type",
        ]),
        "WarmupDecayLR" => Some(&[
            "warmup_min_lr",
            "warmup_max_lr",
            "warmup_num_steps",
            "warmup_type",
            "total_num_steps",
        ]),
        "WarmupCosineLR" => Some(&[
            "total_num_steps",
            "warmup_min_ratio",
            "warmup_num_steps",
            "cos_min_ratio",
            "warmup_type",
        ]),
        _ => None,
    }
}

fn read_scheduler(f: &Field<'_>, sink: &mut Sink) -> Result<DsScheduler, ConfigError> {
    let mut o = Obj::new(&f.key, f.value, SCHED_KEYS, &[])?;
    let kind = match o.take("type") {
        Some(t) => t.str()?.to_owned(),
        None => {
            return Err(ConfigError::MissingKey {
                key: o.key_path("type"),
                why: "a scheduler block needs a type".to_owned(),
                fix: "add \"type\": \"WarmupLR\", \"WarmupDecayLR\" or \"WarmupCosineLR\", or remove the block"
                    .to_owned(),
            })
        }
    };
    let Some(keys) = scheduler_param_keys(&kind) else {
        let fix = match ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
            .iter()
            .find(|k| k.eq_ignore_ascii_case(&kind))
        {
            Some(k) => format!("write \"{k}\" (DeepSpeed matches scheduler names exactly)"),
            None => "use one of those, or remove the scheduler block for a constant learning rate"
                .to_owned(),
        };
        return Err(ConfigError::UnsupportedScheduler {
            value: render(&Value::String(kind)),
            fix,
        });
    };
    let mut params = DsSchedulerParams::default();
    if let Some(pf) = o.take("params") {
        let mut p = Obj::new(&pf.key, pf.value, keys, SCHED_IGNORED)?;
        let wants = |k: &str| keys.contains(&k);
        // Keys that do not belong to this type stay untaken and are reported
        // as unknown by `finish` (DeepSpeed would reject them as unexpected
        // keyword arguments).
        if wants("warmup_min_lr") {
            if let Some(f) = p.take("warmup_min_lr") {
                params.warmup_min_lr = Some(auto_f64(&f)?);
            }
        }
        if wants("warmup_max_lr") {
            if let Some(f) = p.take("warmup_max_lr") {
                params.warmup_max_lr = Some(auto_f64(&f)?);
            }
        }
        if let Some(f) = p.take("warmup_num_steps") {
            params.warmup_num_steps = Some(auto_u64(&f)?);
        }
        if let Some(f) = p.take("warmup_type") {
            let t = f.str()?;
            if t != "log" && t != "linear" {
                return Err(ConfigError::OutOfRange {
                    key: f.key.clone(),
                    value: render(f.value),
                    allowed: "\"log\" or \"linear\"".to_owned(),
                    fix: "use \"linear\" (or DeepSpeed's default \"log\")".to_owned(),
                });
            }
            params.warmup_type = Some(t.to_owned());
        }
        if wants("total_num_steps") {
            if let Some(f) = p.take("total_num_steps") {
                params.total_num_steps = Some(auto_u64(&f)?);
            }
        }
        if wants("warmup_min_ratio") {
            if let Some(f) = p.take("warmup_min_ratio") {
                params.warmup_min_ratio = Some(f.f64()?);
            }
        }
        if wants("cos_min_ratio") {
            if let Some(f) = p.take("cos_min_ratio") {
                params.cos_min_ratio = Some(f.f64()?);
            }
        }
        p.finish(sink);
    }
    o.finish(sink);
    Ok(DsScheduler { kind, params })
}

fn read_device(f: &Field<'_>) -> Result<DsDevice, ConfigError> {
    match f.str() {
        Ok("none") => Ok(DsDevice::None),
        Ok("cpu") => Ok(DsDevice::Cpu),
        Ok("nvme") => Ok(DsDevice::Nvme),
        _ => Err(ConfigError::UnknownOffloadDevice {
            key: f.key.clone(),
            value: render(f.value),
        }),
    }
}

fn read_path(f: &Field<'_>) -> Result<PathBuf, ConfigError> {
    let s = f.str()?;
    if s.is_empty() {
        return Err(ConfigError::WrongType {
            key: f.key.clone(),
            value: render(f.value),
            expected: "a non-empty directory path".to_owned(),
        });
    }
    Ok(PathBuf::from(s))
}

/// A deprecated `cpu_offload` / `cpu_offload_param` flag: warns, and when
/// true fills `slot` (the new-style `new_name` block) with `make(pin)`,
/// refusing if that block is also given. Returns whether the deprecated
/// pin-memory flag was used.
fn deprecated_cpu_offload<T>(
    f: &Field<'_>,
    new_name: &str,
    new_key: String,
    slot: &mut Option<T>,
    pin: Option<bool>,
    sink: &mut Sink,
    make: impl FnOnce(Option<bool>) -> T,
) -> Result<bool, ConfigError> {
    sink.warnings.push(ConfigWarning::Deprecated {
        key: f.key.clone(),
        replacement: format!("\"{new_name}\": {{\"device\": \"cpu\"}}"),
    });
    if !f.bool()? {
        return Ok(false);
    }
    if slot.is_some() {
        return Err(ConfigError::ConflictingAlias {
            old: f.key.clone(),
            new: new_key,
        });
    }
    *slot = Some(make(pin));
    Ok(pin.is_some())
}

fn read_zero(f: &Field<'_>, sink: &mut Sink) -> Result<DsZero, ConfigError> {
    let mut o = Obj::new(&f.key, f.value, ZERO_KEYS, ZERO_IGNORED)?;
    let mut z = DsZero::default();
    if let Some(f) = o.take("stage") {
        z.stage = f.u64().map_err(|e| match e {
            ConfigError::WrongType { value, .. } | ConfigError::OutOfRange { value, .. } => {
                ConfigError::InvalidStage { value }
            }
            other => other,
        })?;
    }
    if let Some(f) = o.take("offload_param") {
        z.offload_param = Some(read_offload_param(&f, sink)?);
    }
    if let Some(f) = o.take("offload_optimizer") {
        z.offload_optimizer = Some(read_offload_optimizer(&f, sink)?);
    }

    // Deprecated boolean forms.
    let pin = match o.take("cpu_offload_use_pin_memory") {
        Some(f) => Some((f.bool()?, f.key.clone())),
        None => None,
    };
    let pin_flag = pin.as_ref().map(|(p, _)| *p);
    let mut pin_used = false;
    if let Some(f) = o.take("cpu_offload") {
        let new_key = o.key_path("offload_optimizer");
        pin_used |= deprecated_cpu_offload(
            &f,
            "offload_optimizer",
            new_key,
            &mut z.offload_optimizer,
            pin_flag,
            sink,
            |pin| DsOffloadOptimizer {
                device: DsDevice::Cpu,
                pin_memory: pin.unwrap_or(DsOffloadOptimizer::default().pin_memory),
                ..DsOffloadOptimizer::default()
            },
        )?;
    }
    if let Some(f) = o.take("cpu_offload_param") {
        let new_key = o.key_path("offload_param");
        pin_used |= deprecated_cpu_offload(
            &f,
            "offload_param",
            new_key,
            &mut z.offload_param,
            pin_flag,
            sink,
            |pin| DsOffloadParam {
                device: DsDevice::Cpu,
                pin_memory: pin.unwrap_or(DsOffloadParam::default().pin_memory),
                ..DsOffloadParam::default()
            },
        )?;
    }
    if let Some((_, key)) = pin {
        sink.warnings.push(ConfigWarning::Deprecated {
            key: key.clone(),
            replacement: "\"pin_memory\" inside offload_param / offload_optimizer".to_owned(),
        });
        if !pin_used {
            sink.note(&key, "has no effect without cpu_offload or cpu_offload_param; set pin_memory inside the offload blocks");
        }
    }

    if let Some(f) = o.take("sub_group_size") {
        z.sub_group_size = f.u64()?;
    }
    if let Some(f) = o.take_alias(
        "stage3_prefetch_bucket_size",
        &["prefetch_bucket_size"],
        false,
        sink,
    )? {
        z.stage3_prefetch_bucket_size = auto_u64(&f)?;
    }
    if let Some(f) = o.take_alias(
        "stage3_param_persistence_threshold",
        &["param_persistence_threshold"],
        false,
        sink,
    )? {
        z.stage3_param_persistence_threshold = auto_u64(&f)?;
    }
    if let Some(f) = o.take_alias(
        "stage3_max_live_parameters",
        &["max_live_parameters"],
        false,
        sink,
    )? {
        z.stage3_max_live_parameters = f.u64()?;
    }
    if let Some(f) = o.take_alias(
        "stage3_max_reuse_distance",
        &["max_reuse_distance"],
        false,
        sink,
    )? {
        z.stage3_max_reuse_distance = f.u64()?;
    }
    // The deprecated fp16 name warns; the short field name does not.
    if let Some(f) = o.take_alias(
        "stage3_gather_16bit_weights_on_model_save",
        &["stage3_gather_fp16_weights_on_model_save"],
        true,
        sink,
    )? {
        if o.has("gather_16bit_weights_on_model_save") {
            return Err(ConfigError::ConflictingAlias {
                old: o.key_path("gather_16bit_weights_on_model_save"),
                new: f.key.clone(),
            });
        }
        z.stage3_gather_16bit_weights_on_model_save = auto_bool(&f)?;
    } else if let Some(f) = o.take("gather_16bit_weights_on_model_save") {
        z.stage3_gather_16bit_weights_on_model_save = auto_bool(&f)?;
    }
    if let Some(f) = o.take("contiguous_gradients") {
        z.contiguous_gradients = f.bool()?;
    }
    if let Some(f) = o.take("overlap_comm") {
        z.overlap_comm = Some(f.bool()?);
    }
    if let Some(f) = o.take("reduce_bucket_size") {
        z.reduce_bucket_size = auto_u64(&f)?;
    }
    o.finish(sink);
    Ok(z)
}

fn read_offload_param(f: &Field<'_>, sink: &mut Sink) -> Result<DsOffloadParam, ConfigError> {
    let mut o = Obj::new(&f.key, f.value, OFFLOAD_PARAM_KEYS, &[])?;
    let mut p = DsOffloadParam::default();
    if let Some(f) = o.take("device") {
        p.device = read_device(&f)?;
    }
    if let Some(f) = o.take("nvme_path") {
        p.nvme_path = Some(read_path(&f)?);
    }
    if let Some(f) = o.take("buffer_count") {
        p.buffer_count = f.u64()?;
    }
    if let Some(f) = o.take("buffer_size") {
        p.buffer_size = f.u64()?;
    }
    if let Some(f) = o.take("max_in_cpu") {
        p.max_in_cpu = f.u64()?;
    }
    if let Some(f) = o.take("pin_memory") {
        p.pin_memory = f.bool()?;
    }
    o.finish(sink);
    Ok(p)
}

fn read_offload_optimizer(
    f: &Field<'_>,
    sink: &mut Sink,
) -> Result<DsOffloadOptimizer, ConfigError> {
    let mut o = Obj::new(&f.key, f.value, OFFLOAD_OPT_KEYS, OFFLOAD_OPT_IGNORED)?;
    let mut p = DsOffloadOptimizer::default();
    if let Some(f) = o.take("device") {
        p.device = read_device(&f)?;
    }
    if let Some(f) = o.take("nvme_path") {
        p.nvme_path = Some(read_path(&f)?);
    }
    if let Some(f) = o.take("buffer_count") {
        p.buffer_count = f.u64()?;
    }
    if let Some(f) = o.take("pin_memory") {
        p.pin_memory = f.bool()?;
    }
    if let Some(f) = o.take("pipeline_read") {
        p.pipeline_read = f.bool()?;
    }
    if let Some(f) = o.take("pipeline_write") {
        p.pipeline_write = f.bool()?;
    }
    if let Some(f) = o.take("fast_init") {
        p.fast_init = f.bool()?;
    }
    o.finish(sink);
    Ok(p)
}

fn read_aio(f: &Field<'_>, sink: &mut Sink) -> Result<DsAio, ConfigError> {
    let mut o = Obj::new(&f.key, f.value, AIO_KEYS, &[])?;
    let mut a = DsAio::default();
    if let Some(f) = o.take("block_size") {
        a.block_size = f.u64()?;
    }
    if let Some(f) = o.take("queue_depth") {
        a.queue_depth = f.u64()?;
    }
    if let Some(f) = o.take_alias("intra_op_parallelism", &["thread_count"], true, sink)? {
        a.intra_op_parallelism = f.u64()?;
    }
    if let Some(f) = o.take("single_submit") {
        a.single_submit = f.bool()?;
    }
    if let Some(f) = o.take("overlap_events") {
        a.overlap_events = f.bool()?;
    }
    if let Some(f) = o.take("use_gds") {
        a.use_gds = f.bool()?;
    }
    o.finish(sink);
    Ok(a)
}

/// Bytes as an integer (integral floats accepted) or a string with a unit.
fn bytes_field(f: &Field<'_>) -> Result<u64, ConfigError> {
    if let Some(s) = f.value.as_str() {
        return parse_bytes_str(s).ok_or_else(|| ConfigError::WrongType {
            key: f.key.clone(),
            value: render(f.value),
            expected: "a byte count such as 1073741824 or \"1GiB\"".to_owned(),
        });
    }
    f.u64().map_err(|e| match e {
        ConfigError::WrongType { key, value, .. } => ConfigError::WrongType {
            key,
            value,
            expected: "a byte count such as 1073741824 or \"1GiB\"".to_owned(),
        },
        other => other,
    })
}

fn read_tierzero(f: &Field<'_>, sink: &mut Sink) -> Result<DsTierzero, ConfigError> {
    let mut o = Obj::new(&f.key, f.value, TIERZERO_KEYS, &[])?;
    let mut t = DsTierzero::default();
    if let Some(f) = o.take("pinned_budget_bytes") {
        t.pinned_budget_bytes = Some(bytes_field(&f)?);
    }
    if let Some(f) = o.take("device_cache_bytes") {
        t.device_cache_bytes = bytes_field(&f)?;
    }
    if let Some(f) = o.take("io_backend") {
        t.io_backend = match f.str() {
            Ok("auto") => IoBackend::Auto,
            Ok("uring") => IoBackend::Uring,
            Ok("portable") => IoBackend::Portable,
            _ => {
                return Err(ConfigError::OutOfRange {
                    key: f.key.clone(),
                    value: render(f.value),
                    allowed: "\"auto\", \"uring\" or \"portable\"".to_owned(),
                    fix: "use \"auto\" unless you need to force a backend".to_owned(),
                })
            }
        };
    }
    if let Some(f) = o.take("direct_io") {
        t.direct_io = match f.str() {
            Ok("auto") => DirectIo::Auto,
            Ok("require") => DirectIo::Require,
            Ok("off") => DirectIo::Off,
            _ => {
                return Err(ConfigError::OutOfRange {
                    key: f.key.clone(),
                    value: render(f.value),
                    allowed: "\"auto\", \"require\" or \"off\"".to_owned(),
                    fix: "use \"auto\" to fall back to buffered I/O where O_DIRECT is refused"
                        .to_owned(),
                })
            }
        };
    }
    if let Some(f) = o.take("memlock") {
        t.memlock =
            match f.str() {
                Ok("auto") => Memlock::Auto,
                Ok("require") => Memlock::Require,
                _ => return Err(ConfigError::OutOfRange {
                    key: f.key.clone(),
                    value: render(f.value),
                    allowed: "\"auto\" or \"require\"".to_owned(),
                    fix: "use \"auto\" to run with unlocked buffers when RLIMIT_MEMLOCK is too low"
                        .to_owned(),
                }),
            };
    }
    if let Some(f) = o.take("ring_threads") {
        t.ring_threads = Some(f.u64()?);
    }
    if let Some(f) = o.take("checksums") {
        t.checksums = f.bool()?;
    }
    if let Some(f) = o.take("overlap_optimizer") {
        t.overlap_optimizer = f.bool()?;
    }
    if let Some(f) = o.take("compute_threads") {
        t.compute_threads = f.auto_u64()?;
    }
    if let Some(f) = o.take("pin_threads") {
        t.pin_threads = f.auto_bool()?;
    }
    if let Some(f) = o.take("optimizer_resident_bytes") {
        t.optimizer_resident_bytes = if f.value.as_str() == Some("auto") {
            None
        } else {
            Some(bytes_field(&f)?)
        };
    }
    o.finish(sink);
    Ok(t)
}

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
//! Each object is declared once, as a `section!` table: one row per key
//! with its field, type, DeepSpeed's default, reader and other names (see
//! `reader.rs`). Only what a table cannot say is written by hand: the
//! `optimizer` and `scheduler` blocks (a required `type` that decides which
//! `params` apply), and the deprecated boolean offload forms of
//! `zero_optimization`.
//!
//! Defaults are DeepSpeed's, from its sources (paths under `deepspeed/`):
//! `runtime/config.py` and `runtime/constants.py` (top level),
//! `runtime/precision_config.py` (`fp16`, `bf16`), `runtime/zero/config.py`
//! (`zero_optimization`), `runtime/zero/offload_config.py` (`offload_param`,
//! `offload_optimizer`), `runtime/swap_tensor/aio_config.py` (`aio`),
//! `ops/adam/cpu_adam.py` (Adam's params) and `runtime/lr_schedules.py`
//! (schedulers). Where DeepSpeed's default is "none" the field is an
//! `Option`.
//!
//! Deprecated aliases accepted (each logs a
//! [`crate::config::ConfigWarning::Deprecated`]; the forms that are not a
//! renamed key are read in `ds/deprecated.rs`;
//! giving an alias together with its replacement is
//! [`ConfigError::ConflictingAlias`]):
//! - `zero_optimization.stage3_gather_fp16_weights_on_model_save` →
//!   `stage3_gather_16bit_weights_on_model_save`;
//! - `zero_optimization.cpu_offload: true` → `offload_optimizer: {device: cpu}`;
//! - `zero_optimization.cpu_offload_param: true` → `offload_param: {device: cpu}`;
//! - `zero_optimization.cpu_offload_use_pin_memory`: read and ignored
//!   with a note, as DeepSpeed ignores it (it sets no new param);
//! - `aio.thread_count` → `aio.intra_op_parallelism`;
//! - top-level `bfloat16` → `bf16` (given with `bf16`, it is ignored with
//!   a note, as DeepSpeed's `get_bfloat16_config` reads `bf16` alone then);
//! - `"zero_optimization": true` → `{"stage": 1}` (`false`: stage 0), as
//!   DeepSpeed's `read_zero_config_deprecated` reads it.
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
use super::reader::{auto, auto_none, flag, int, num, pair, section, some, Field, Obj, Sink};
use super::units::parse_bytes_str;

mod deprecated;
use deprecated::{bfloat16_old_name, deprecated_cpu_offload, read_zero};

/// A value that may be written as `"auto"` (to be filled from the run, the
/// way HF Trainer fills it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AutoOr<T> {
    /// `"auto"`.
    Auto,
    /// A concrete value.
    Value(T),
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

section! {
    /// The whole `ds_config.json`.
    pub struct DsConfig {
        /// `train_batch_size`: samples per optimizer step over all ranks.
        train_batch_size: Option<AutoOr<u64>> => some(auto(int));
        /// `train_micro_batch_size_per_gpu`: samples per forward/backward per rank.
        train_micro_batch_size_per_gpu: Option<AutoOr<u64>> => some(auto(int));
        /// `gradient_accumulation_steps`.
        gradient_accumulation_steps: Option<AutoOr<u64>> => some(auto(int));
        /// `gradient_clipping`: global-norm clip; `None` = absent, DeepSpeed's
        /// default 1.0 (since DeepSpeed 0.19.3; 0.0, off, before).
        gradient_clipping: Option<AutoOr<f64>> => some(auto(num));
        /// `gradient_allreduce_op`: "mean" (DeepSpeed's default), the only
        /// reduction tierzero makes; "sum" is refused
        /// (`allreduce_op`).
        gradient_allreduce_op: Option<String> => some(allreduce_op);
        /// `steps_per_print`: the interval of the plain progress lines
        /// (default 10). DeepSpeed's default is none (no progress report);
        /// tierzero is the training loop too, and keeps a line every 10
        /// steps.
        steps_per_print: u64 = 10 => int;
        /// `wall_clock_breakdown`: DeepSpeed default false.
        wall_clock_breakdown: bool => flag;
        /// `fp16` block.
        fp16: DsFp16 => DsFp16::read;
        /// `bf16` block (the old name `bfloat16`, read as DeepSpeed does
        /// where `bf16` is absent).
        bf16: DsBf16 => DsBf16::read, then bfloat16_old_name;
        /// `optimizer` block; `None` when absent.
        optimizer: Option<DsOptimizer> => some(read_optimizer);
        /// `scheduler` block; `None` when absent.
        scheduler: Option<DsScheduler> => some(read_scheduler);
        /// `zero_optimization` block (or DeepSpeed's deprecated boolean).
        zero_optimization: DsZero => read_zero;
        /// `aio` block.
        aio: DsAio => DsAio::read;
        /// `activation_checkpointing` block; `None` when absent. Present, it
        /// means checkpointing on: every unit's activations are recomputed
        /// in backward (unless `tierzero.activation_budget_bytes` is set).
        activation_checkpointing: Option<DsActivationCheckpointing> =>
            some(DsActivationCheckpointing::read);
        /// Our own knobs.
        tierzero: DsTierzero => DsTierzero::read;
    }
    ignored: [
        "prescale_gradients",
        "gradient_predivide_factor",
        "sparse_gradients",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
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
        "eigenvalue",
        "progressive_layer_drop",
        "hybrid_engine",
        "tensor_parallel",
        "torch_autocast",
        "timers",
        "graph_harvesting",
        "log_level",
        "managed_gradient_accumulation",
        "allgather_size",
    ];
    also: ["bfloat16"];
}

section! {
    /// `fp16` {...}.
    pub struct DsFp16 {
        /// `enabled`: default false.
        enabled: AutoOr<bool> = AutoOr::Value(false) => auto(flag);
        /// `loss_scale`: 0 means dynamic loss scaling (default 0).
        loss_scale: f64 => num;
        /// `initial_scale_power`: the first dynamic scale is 2^this (default 16).
        initial_scale_power: u32 = 16 => scale_power;
        /// `loss_scale_window`: steps without overflow before raising the scale (default 1000).
        loss_scale_window: u64 = 1000 => int;
        /// `hysteresis`: overflows tolerated before lowering the scale (default 2).
        hysteresis: u64 = 2 => int;
        /// `min_loss_scale`: floor of the dynamic scale (default 1).
        min_loss_scale: f64 = 1.0 => num;
        /// `consecutive_hysteresis`: a step without overflow restores the
        /// hysteresis (default false: only a growth of the scale does).
        consecutive_hysteresis: bool = false => flag;
        /// `fp16_master_weights_and_grads`: true is said (tierzero keeps
        /// fp32 master weights; `fp32_state_only`).
        fp16_master_weights_and_grads: bool = false => fp32_state_only;
    }
    ignored: ["auto_cast"];
    deepspeed_refuses: "its config model for this section forbids unknown keys";
}

section! {
    /// `bf16` {...}.
    pub struct DsBf16 {
        /// `enabled`: default false.
        enabled: AutoOr<bool> = AutoOr::Value(false) => auto(flag);
        /// `check_grad_overflow`: skip a step whose gradients are not all
        /// finite. DeepSpeed's default is true since 0.19.3 (#8035), but
        /// only its stage 1 and 2 optimizer reads it: `None` (absent) means
        /// what DeepSpeed does at the config's stage
        /// (`Config::check_grad_overflow`).
        check_grad_overflow: Option<bool> => some(flag);
        /// `bf16_master_weights_and_grads`: true is said (tierzero keeps
        /// fp32 master weights and gradient sums; `fp32_state_only`).
        bf16_master_weights_and_grads: bool = false => fp32_state_only;
        /// `bf16_optimizer_states`: true is said (`fp32_state_only`).
        bf16_optimizer_states: bool = false => fp32_state_only;
    }
    ignored: ["immediate_grad_update"];
    deepspeed_refuses: "its config model for this section forbids unknown keys";
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

section! {
    /// `optimizer.params` for Adam/AdamW. `None` = not written (DeepSpeed's
    /// defaults apply: lr 1e-3, betas [0.9, 0.999], eps 1e-8, weight_decay 0).
    pub struct DsAdamParams {
        /// `lr`.
        lr: Option<AutoOr<f64>> => some(auto(num));
        /// `betas`.
        betas: Option<AutoOr<[f64; 2]>> => some(auto(pair));
        /// `eps`.
        eps: Option<AutoOr<f64>> => some(auto(num));
        /// `weight_decay`.
        weight_decay: Option<AutoOr<f64>> => some(auto(num));
        /// `adam_w_mode`: decoupled weight decay for type `Adam` (DeepSpeed
        /// default true; type `AdamW` is always decoupled).
        adam_w_mode: bool = true => flag;
        /// `bias_correction`: Adam's bias correction of the moments
        /// (DeepSpeed's CPU and fused Adam take it; default true).
        bias_correction: bool = true => flag;
        /// `torch_adam`: DeepSpeed builds `torch.optim.AdamW` (or `Adam`
        /// without `adam_w_mode`), whose `weight_decay` default is 0.01.
        torch_adam: bool = false => flag;
        /// `amsgrad`: refused when true (tierzero's Adam has no AMSGrad;
        /// neither have DeepSpeed's CPU and fused Adam).
        amsgrad: bool = false => flag;
        /// `fp32_optimizer_states`: DeepSpeed's CPU Adam keeps its moments
        /// in the master weights' dtype when false, which is fp32 unless
        /// `bf16.bf16_master_weights_and_grads` (said there): read, no
        /// effect of its own.
        fp32_optimizer_states: Option<bool> => some(flag);
    }
    // Arguments some of DeepSpeed's optimizer classes take (FusedAdam's
    // set_grad_none; torch's AdamW with `torch_adam`): no effect here.
    ignored: ["set_grad_none", "foreach", "fused", "capturable", "differentiable"];
    deepspeed_refuses: "it passes these to the optimizer's constructor, which refuses an unknown argument";
}

/// `scheduler` {...}.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DsScheduler {
    /// `type` as written (DeepSpeed matches it exactly).
    #[serde(rename = "type")]
    pub kind: String,
    /// `params`; which keys apply depends on `type`
    /// (`scheduler_param_keys`).
    #[serde(default)]
    pub params: DsSchedulerParams,
}

section! {
    /// `scheduler.params` for WarmupLR / WarmupDecayLR / WarmupCosineLR. `None`
    /// = not written. DeepSpeed defaults: `warmup_min_lr` 0, `warmup_max_lr`
    /// the optimizer's lr for WarmupLR (DeepSpeed #7360) and 0.001 for
    /// WarmupDecayLR, `warmup_num_steps` 1000, `warmup_type` "log", `warmup_min_ratio`
    /// 0, `cos_min_ratio` 0.0001; `total_num_steps` has no default (required by
    /// WarmupDecayLR and WarmupCosineLR).
    pub struct DsSchedulerParams {
        /// `warmup_min_lr` (WarmupLR, WarmupDecayLR).
        #[serde(skip_serializing_if = "Option::is_none")]
        warmup_min_lr: Option<AutoOr<f64>> => some(auto(num));
        /// `warmup_max_lr` (WarmupLR, WarmupDecayLR).
        #[serde(skip_serializing_if = "Option::is_none")]
        warmup_max_lr: Option<AutoOr<f64>> => some(auto(num));
        /// `warmup_num_steps` (all three).
        #[serde(skip_serializing_if = "Option::is_none")]
        warmup_num_steps: Option<AutoOr<u64>> => some(auto(int));
        /// `warmup_type`: "log" or "linear" (all three).
        #[serde(skip_serializing_if = "Option::is_none")]
        warmup_type: Option<String> => some(warmup_type);
        /// `total_num_steps` (WarmupDecayLR, WarmupCosineLR).
        #[serde(skip_serializing_if = "Option::is_none")]
        total_num_steps: Option<AutoOr<u64>> => some(auto(int));
        /// `warmup_min_ratio` (WarmupCosineLR).
        #[serde(skip_serializing_if = "Option::is_none")]
        warmup_min_ratio: Option<f64> => some(num);
        /// `cos_min_ratio` (WarmupCosineLR).
        #[serde(skip_serializing_if = "Option::is_none")]
        cos_min_ratio: Option<f64> => some(num);
        /// `last_batch_iteration`: -1 (DeepSpeed's default, the schedule
        /// from its start) only; `schedule_start`. Not printed back.
        #[serde(skip_serializing)]
        last_batch_iteration: i64 = -1 => schedule_start;
    }
    deepspeed_refuses: "it passes these to the scheduler's constructor, which refuses an unknown argument";
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

section! {
    /// `zero_optimization` {...}. Sizes are element counts, as in DeepSpeed.
    pub struct DsZero {
        /// `stage`: 0..=3 (default 0). Kept wide here; validated later.
        stage: u64 => zero_stage;
        /// `offload_param` (stage 3 only); `None` when absent.
        offload_param: Option<DsOffloadParam> => some(DsOffloadParam::read);
        /// `offload_optimizer`; `None` when absent.
        offload_optimizer: Option<DsOffloadOptimizer> => some(DsOffloadOptimizer::read),
            then deprecated_cpu_offload;
        /// `sub_group_size` (elements, default 1e9).
        sub_group_size: u64 = 1_000_000_000 => int;
        /// `stage3_prefetch_bucket_size` (elements, default 5e7).
        stage3_prefetch_bucket_size: AutoOr<u64> = AutoOr::Value(50_000_000) => auto(int),
            alias "prefetch_bucket_size";
        /// `stage3_param_persistence_threshold` (elements, default 1e5).
        stage3_param_persistence_threshold: AutoOr<u64> = AutoOr::Value(100_000) => auto(int),
            alias "param_persistence_threshold";
        /// `stage3_model_persistence_threshold` (elements, default
        /// `sys.maxsize`): the persistent params' elements at most.
        stage3_model_persistence_threshold: u64 = i64::MAX as u64 => int,
            alias "model_persistence_threshold";
        /// `stage3_max_live_parameters` (elements, default 1e9).
        stage3_max_live_parameters: u64 = 1_000_000_000 => int, alias "max_live_parameters";
        /// `stage3_max_reuse_distance` (elements, default 1e9).
        stage3_max_reuse_distance: u64 = 1_000_000_000 => int, alias "max_reuse_distance";
        /// `stage3_gather_16bit_weights_on_model_save` (default false). The
        /// deprecated fp16 name warns; the short field name does not.
        stage3_gather_16bit_weights_on_model_save: AutoOr<bool> = AutoOr::Value(false) => auto(flag),
            deprecated "stage3_gather_fp16_weights_on_model_save",
            alias "gather_16bit_weights_on_model_save";
        /// `contiguous_gradients` (default true).
        contiguous_gradients: bool = true => flag;
        /// `overlap_comm` (default: true for stage 3, false otherwise).
        overlap_comm: Option<bool> => some(flag);
        /// `reduce_bucket_size` (elements, default 5e8).
        reduce_bucket_size: AutoOr<u64> = AutoOr::Value(500_000_000) => auto(int);
    }
    ignored: [
        "reduce_scatter",
        "allgather_partitions",
        "allgather_bucket_size",
        "use_multi_rank_bucket_allreduce",
        "load_from_fp32_weights",
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
        // The three short names DeepSpeed's pydantic model also takes
        // (populate_by_name) beside the stage3_ aliases above.
        "module_granularity_threshold",
        "use_all_reduce_for_fetch_params",
        "allgather_sequential",
    ];
    also: ["cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"];
    deepspeed_refuses: "its config model for this section forbids unknown keys";
}

section! {
    /// `zero_optimization.offload_param` {...}.
    pub struct DsOffloadParam {
        /// `device` (default "none").
        device: DsDevice => device;
        /// `nvme_path` (no default).
        nvme_path: Option<PathBuf> => some(path);
        /// `buffer_count`: pinned swap-in buffers (default 5).
        buffer_count: u64 = 5 => int;
        /// `buffer_size`: **elements** per buffer (default 1e8).
        buffer_size: u64 = 100_000_000 => int;
        /// `max_in_cpu`: **elements** of params kept in host memory with nvme
        /// (default 1e9): the params in order while their shards fit, a
        /// param that does not fit going to NVMe and a later, smaller one
        /// still kept. Two differences from DeepSpeed, which changes no
        /// number: DeepSpeed applies it to whole optimizer sub-groups of
        /// 16-bit partitions (a prefix), and keeps every partition smaller
        /// than `max(1 MiB, aio.block_size)` in CPU memory whatever this
        /// says; tierzero swaps such small params too (4 KiB-aligned extents).
        max_in_cpu: u64 = 1_000_000_000 => int;
        /// `pin_memory` (default true).
        pin_memory: bool = true => flag;
    }
    deepspeed_refuses: "its config model for this section forbids unknown keys";
}

section! {
    /// `zero_optimization.offload_optimizer` {...}.
    pub struct DsOffloadOptimizer {
        /// `device` (default "none").
        device: DsDevice => device;
        /// `nvme_path` (no default).
        nvme_path: Option<PathBuf> => some(path);
        /// `buffer_count`: pinned buffers of one sub-group each (default 4).
        buffer_count: u64 = 4 => int;
        /// `pin_memory` (default true).
        pin_memory: bool = true => flag;
        /// `pipeline_read` (default false).
        pipeline_read: bool => flag;
        /// `pipeline_write` (default false).
        pipeline_write: bool => flag;
        /// `fast_init` (default false).
        fast_init: bool => flag;
        /// `ratio`: the share of the optimizer's sub-groups DeepSpeed
        /// steps on the CPU at stage 3 (the last ones; the first on the
        /// GPU: ZeRO-Offload++ "Twin-Flow"; default 1.0, all on the CPU).
        /// tierzero steps all of them on the CPU: a ratio under 1 is a
        /// note.
        ratio: f64 = 1.0 => num;
    }
    ignored: ["super_offload", "cpuadam_cores_perc", "pipeline"];
    deepspeed_refuses: "its config model for this section forbids unknown keys";
}

section! {
    /// Top-level `activation_checkpointing` {...}: DeepSpeed's settings of
    /// `deepspeed.checkpointing`. Its presence turns checkpointing on
    /// (recompute every unit); the settings themselves change nothing
    /// here: the engine checkpoints each unit's input in host memory
    /// (`cpu_checkpointing`'s place) and has no model parallelism to
    /// partition across (`partition_activations`).
    pub struct DsActivationCheckpointing {
        /// `partition_activations` (default false).
        partition_activations: bool => flag;
        /// `cpu_checkpointing` (default false).
        cpu_checkpointing: bool => flag;
        /// `contiguous_memory_optimization` (default false).
        contiguous_memory_optimization: bool => flag;
        /// `number_checkpoints` (default none).
        number_checkpoints: Option<u64> => some(int);
        /// `synchronize_checkpoint_boundary` (default false).
        synchronize_checkpoint_boundary: bool => flag;
        /// `profile` (default false).
        profile: bool => flag;
    }
}

section! {
    /// Top-level `aio` {...}.
    pub struct DsAio {
        /// `block_size`: **bytes** per request (default 1048576). Not, as in
        /// DeepSpeed, also the smallest param partition swapped to NVMe
        /// (see `offload_param.max_in_cpu`).
        block_size: u64 = 1_048_576 => int;
        /// `queue_depth`: requests in flight per worker (default 8).
        queue_depth: u64 = 8 => int;
        /// `intra_op_parallelism` (old name `thread_count`): workers per op (default 1).
        intra_op_parallelism: u64 = 1 => int, deprecated "thread_count";
        /// `single_submit` (default false).
        single_submit: bool => flag;
        /// `overlap_events` (default true).
        overlap_events: bool = true => flag;
        /// `use_gds` (default false).
        use_gds: bool => flag;
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

/// One of our string-valued settings, spelled as serde spells it.
trait Choice: Copy + Serialize + DeserializeOwned + 'static {
    /// Every value, in the order the error lists them.
    const ALL: &'static [Self];
    /// The fix an error suggests.
    const FIX: &'static str;
}

impl Choice for IoBackend {
    const ALL: &'static [Self] = &[IoBackend::Auto, IoBackend::Uring, IoBackend::Portable];
    const FIX: &'static str = "use \"auto\" unless you need to force a backend";
}

impl Choice for DirectIo {
    const ALL: &'static [Self] = &[DirectIo::Auto, DirectIo::Require, DirectIo::Off];
    const FIX: &'static str = "use \"auto\" to fall back to buffered I/O where O_DIRECT is refused";
}

impl Choice for Memlock {
    const ALL: &'static [Self] = &[Memlock::Auto, Memlock::Require];
    const FIX: &'static str =
        "use \"auto\" to run with unlocked buffers when RLIMIT_MEMLOCK is too low";
}

section! {
    /// Our own knobs: the top-level `"tierzero": {...}` block. DeepSpeed ignores
    /// unknown top-level keys only with a warning, so a config that carries this
    /// block still loads in DeepSpeed.
    pub struct DsTierzero {
        /// `pinned_budget_bytes`: the most page-locked host memory tierzero may
        /// allocate for all swap buffers together (integer bytes or a string
        /// like `"2GiB"`). Absent = sized to what the buffers need. Checked
        /// against `offload_param.buffer_count × buffer_size × element bytes`
        /// at load time (DeepSpeed#3000: pinned buffers OOM small hosts).
        /// The cpu tier's pinned pages (`offload_param: cpu`, or
        /// `max_in_cpu`) hold the params themselves and are not in it
        /// (`offload_param.pin_memory: false` leaves them pageable); the
        /// plan prints both.
        pinned_budget_bytes: Option<u64> => some(bytes);
        /// `device_cache_bytes`: accelerator memory tierzero may use to keep
        /// gathered parameters resident between uses, beyond
        /// `stage3_max_live_parameters` (DeepSpeed#3054). `"auto"` (absent)
        /// = as many as the device tier's share of the device budget holds
        /// beside the params in flight and in use; 0 = no cache. Same
        /// result either way. `None` = auto.
        device_cache_bytes: Option<u64> => auto_none(bytes);
        /// `device_budget_bytes`: GPU memory tierzero may allocate with
        /// `--device cuda` (params on the device tier, activations,
        /// workspace). Absent = the free memory at start-up less 5%. A budget
        /// above the free memory is refused at start-up with the numbers.
        device_budget_bytes: Option<u64> => some(bytes);
        /// `io_backend`: "auto" (default), "uring" or "portable".
        io_backend: IoBackend => choice;
        /// `direct_io`: "auto" (default), "require" or "off".
        direct_io: DirectIo => choice;
        /// `memlock`: "auto" (default) or "require"; see [`Memlock`].
        memlock: Memlock => choice;
        /// `ring_threads`: I/O submission threads (one io_uring each). Absent =
        /// `aio.intra_op_parallelism`.
        ring_threads: Option<u64> => some(int);
        /// `checksums`: CRC32C every swap extent on write and verify on read, so
        /// a short or torn write is caught at the next read with its file and
        /// offset (DeepSpeed's "buffer nbytes != file bytes"). Default true.
        checksums: bool = true => flag;
        /// `overlap_optimizer`: step the CPU optimizer for a sub-group as soon as
        /// its gradients are final, overlapping backward, instead of after
        /// backward as DeepSpeed does. Same result; default true. Off, with
        /// NVMe optimizer state, host memory holds every sub-group's
        /// gradient until the step (4 bytes an element of the shard, as
        /// DeepSpeed does; the plan counts it).
        overlap_optimizer: bool = true => flag;
        /// `compute_threads`: threads of the CPU compute kernels (candle's
        /// matmuls). `"auto"` (absent) uses every core;
        /// `RAYON_NUM_THREADS` in the environment takes the place of
        /// `"auto"`. `None` = auto.
        compute_threads: Option<u64> => auto_none(int);
        /// `optimizer_resident_bytes`: host memory (pageable, not pinned) for
        /// the fp32 state of the sub-groups the next forward needs first, kept
        /// out of `offload_optimizer.device = "nvme"`: they are the last
        /// stepped, so their state would be written in the optimizer's tail,
        /// while the next forward waits on it, and read again at the end of
        /// the next backward. `"auto"` (absent) = the state of one
        /// sub-group (`sub_group_size` × 12 bytes), at most one
        /// `stage3_prefetch_bucket_size`'s; 0 = none.
        /// Same result either way. `None` = auto.
        optimizer_resident_bytes: Option<u64> => auto_none(bytes);
        /// `pin_threads`: keep the compute thread(s) and the helper threads
        /// (I/O rings, param copy, optimizer) on separate CPUs. `"auto"`
        /// (absent) pins when something is offloaded on a single rank and a
        /// CPU is left for the helpers; `true` pins whenever a CPU is left;
        /// `false` never. `None` = auto.
        pin_threads: Option<bool> => auto_none(flag);
        /// `speculative_step`: with clipping or an overflow check and optimizer state on
        /// NVMe, step each sub-group as soon as its gradients are final,
        /// assuming no clip and no overflow, into new extents, and commit
        /// or redo it exactly once the global norm is known. `"auto"`
        /// (absent) speculates and stops after a run of misses; `true`
        /// always; `false` never. Same result either way. `None` = auto.
        speculative_step: Option<bool> => auto_none(flag);
        /// `speculation_pool_bytes`: NVMe space for the speculative step's
        /// pool of state slots (each the fp32 master, m and v of one largest
        /// sub-group). A step speculates as many sub-groups as there are
        /// slots; the others wait for the global norm. `"auto"` (absent) =
        /// a slot for every NVMe sub-group, within half the disk's free
        /// space after the run's other extents (at least 1 +
        /// `pipeline_read` + `pipeline_write`); bytes buy `bytes / slot`
        /// slots, at least one. Same result either way. `None` = auto.
        speculation_pool_bytes: Option<u64> => auto_none(bytes);
        /// `activation_budget_bytes`: host (compute device) memory for the
        /// units' forward graphs kept until their backward; a unit whose
        /// graph does not fit is recomputed from its saved input, as with
        /// checkpointing. 0 recomputes every unit. `"auto"` (absent) = half
        /// the memory available once the engine is built (shared by the
        /// ranks), or 0 when
        /// `activation_checkpointing` is present. Same result either way.
        /// `None` = auto.
        activation_budget_bytes: Option<u64> => auto_none(bytes);
        /// `stop_grace_s`: seconds a stop (SIGINT, SIGTERM, or a library
        /// `StopHandle`) may take from the request to the end of the run:
        /// the step in progress, the checkpoint of that step and the
        /// summary. A save that would not fit is skipped, and the run says
        /// so. Absent = no bound (`--stop-grace` overrides it).
        stop_grace_s: Option<f64> => some(num);
    }
}

// ---------------------------------------------------------------------------
// Readers of single keys (the generic ones are in `reader.rs`).

/// `zero_optimization.stage`: any integer here (validated later), anything
/// else is [`ConfigError::InvalidStage`].
fn zero_stage(f: &Field<'_>, _: &mut Sink) -> Result<u64, ConfigError> {
    f.u64().map_err(|e| match e {
        ConfigError::WrongType { value, .. } | ConfigError::OutOfRange { value, .. } => {
            ConfigError::InvalidStage { value }
        }
        other => other,
    })
}

/// `fp16.initial_scale_power`: at most 127 (the scale is 2^power in fp32).
fn scale_power(f: &Field<'_>, _: &mut Sink) -> Result<u32, ConfigError> {
    u32::try_from(f.u64()?)
        .ok()
        .filter(|v| *v <= 127)
        .ok_or_else(|| {
            f.out_of_range(
                "at most 127 (the scale is 2^power in fp32)",
                "use DeepSpeed's default 16",
            )
        })
}

/// `scheduler.params.warmup_type`: `"log"` or `"linear"`.
fn warmup_type(f: &Field<'_>, _: &mut Sink) -> Result<String, ConfigError> {
    match f.str()? {
        t @ ("log" | "linear") => Ok(t.to_owned()),
        _ => Err(f.out_of_range(
            "\"log\" or \"linear\"",
            "use \"linear\" (or DeepSpeed's default \"log\")",
        )),
    }
}

/// A DeepSpeed flag that keeps master weights, gradients or Adam's state
/// in 16-bit. tierzero keeps them in fp32 (DeepSpeed's default): true is
/// read and said, not refused (DeepSpeedExamples' configs set it), since
/// the run computes the same updates with more precision, in more memory
/// than the user's DeepSpeed run (the plan counts fp32).
fn fp32_state_only(f: &Field<'_>, sink: &mut Sink) -> Result<bool, ConfigError> {
    let v = flag(f, sink)?;
    if v {
        sink.note(
            &f.key,
            "true: tierzero keeps fp32 master weights, gradient sums and Adam state (DeepSpeed \
             would keep 16-bit ones): the same updates, rounded less, in more host memory \
             (the plan counts fp32)",
        );
    }
    Ok(v)
}

/// `scheduler.params.last_batch_iteration`: -1 only. Another value starts
/// DeepSpeed's schedule part-way; tierzero's schedule starts at the run's
/// first step, and a resumed run continues it from its checkpoint.
fn schedule_start(f: &Field<'_>, _: &mut Sink) -> Result<i64, ConfigError> {
    match f.value.as_f64() {
        Some(-1.0) => Ok(-1),
        _ => Err(f.out_of_range(
            "-1 (the schedule from its start)",
            "remove it; to continue a schedule, resume from a checkpoint (--resume)",
        )),
    }
}

/// `gradient_allreduce_op`: "mean" only. DeepSpeed refuses "sum" at stage
/// 3 and below it sums the ranks' gradients, which tierzero does not (its
/// reduction averages them, in rank order).
fn allreduce_op(f: &Field<'_>, _: &mut Sink) -> Result<String, ConfigError> {
    // DeepSpeed lowercases it (`get_gradient_allreduce_op`).
    match f.str()?.to_ascii_lowercase().as_str() {
        "mean" => Ok("mean".to_owned()),
        "sum" => Err(f.out_of_range(
            "\"mean\"",
            "remove it: tierzero averages the ranks' gradients, as \"mean\" does (DeepSpeed \
             refuses \"sum\" at stage 3, and below it would sum them)",
        )),
        _ => Err(f.out_of_range(
            "\"mean\" (DeepSpeed also takes \"sum\")",
            "use \"mean\", DeepSpeed's default",
        )),
    }
}

/// A string naming a value of `T` as serde spells it.
fn named<T: DeserializeOwned>(f: &Field<'_>) -> Option<T> {
    let s = f.value.as_str()?;
    serde_json::from_value(Value::String(s.to_owned())).ok()
}

/// An offload `device`.
fn device(f: &Field<'_>, _: &mut Sink) -> Result<DsDevice, ConfigError> {
    named(f).ok_or_else(|| ConfigError::UnknownOffloadDevice {
        key: f.key.clone(),
        value: render(f.value),
    })
}

/// One of a [`Choice`]'s values.
fn choice<T: Choice>(f: &Field<'_>, _: &mut Sink) -> Result<T, ConfigError> {
    named(f).ok_or_else(|| {
        let names: Vec<String> = T::ALL
            .iter()
            .map(|v| serde_json::to_string(v).unwrap_or_default())
            .collect();
        let allowed = match names.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
            _ => names.concat(),
        };
        f.out_of_range(&allowed, T::FIX)
    })
}

/// A non-empty path.
fn path(f: &Field<'_>, _: &mut Sink) -> Result<PathBuf, ConfigError> {
    match f.str()? {
        "" => Err(f.wrong("a non-empty directory path")),
        s => Ok(PathBuf::from(s)),
    }
}

/// Bytes as an integer (integral floats accepted) or a string with a unit.
fn bytes(f: &Field<'_>, _: &mut Sink) -> Result<u64, ConfigError> {
    let expected = "a byte count such as 1073741824 or \"1GiB\"";
    if let Some(s) = f.value.as_str() {
        return parse_bytes_str(s).ok_or_else(|| f.wrong(expected));
    }
    f.u64().map_err(|e| match e {
        ConfigError::WrongType { .. } => f.wrong(expected),
        other => other,
    })
}

// ---------------------------------------------------------------------------
// What a table cannot say.

/// Reads the whole config from a parsed JSON value.
pub(crate) fn read(root: &Value, sink: &mut Sink) -> Result<DsConfig, ConfigError> {
    let top = Field {
        key: String::new(),
        value: root,
    };
    DsConfig::read(&top, sink)
}

/// Opens an `optimizer` or `scheduler` block (`what`) and reads its
/// required `type`.
fn typed_block<'a>(f: &Field<'a>, what: &str, fix: &str) -> Result<(Obj<'a>, String), ConfigError> {
    // DeepSpeed reads these blocks as dicts: an unknown key warns (the
    // optimizer's `legacy_fusion` is DeepSpeed's, unused here).
    let mut o = Obj::new(
        &f.key,
        f.value,
        &["type", "params"],
        &["legacy_fusion"],
        None,
    )?;
    let kind = match o.take("type") {
        Some(t) => t.str()?.to_owned(),
        None => {
            return Err(ConfigError::MissingKey {
                key: o.key_path("type"),
                why: format!("{what} block needs a type"),
                fix: fix.to_owned(),
            })
        }
    };
    Ok((o, kind))
}

fn read_optimizer(f: &Field<'_>, sink: &mut Sink) -> Result<DsOptimizer, ConfigError> {
    let fix = "add \"type\": \"AdamW\" (or \"Adam\")";
    let (mut o, kind) = typed_block(f, "an optimizer", fix)?;
    let params = o.take("params");
    if let Some(v) = params.as_ref().and_then(|p| p.value.get("max_grad_norm")) {
        return Err(ConfigError::MaxGradNormInOptimizer { value: render(v) });
    }
    let params = params.map(|p| DsAdamParams::read(&p, sink));
    let params = params.transpose()?.unwrap_or_default();
    o.finish(sink);
    Ok(DsOptimizer { kind, params })
}

/// Which `scheduler.params` keys each supported type takes (the keys of
/// DeepSpeed's `lr_schedules.py` constructors).
pub(crate) fn scheduler_param_keys(kind: &str) -> Option<&'static [&'static str]> {
    match kind {
        "WarmupLR" => Some(&[
            "warmup_min_lr",
            "warmup_max_lr",
            "warmup_num_steps",
            "warmup_type",
            "last_batch_iteration",
        ]),
        "WarmupDecayLR" => Some(&[
            "warmup_min_lr",
            "warmup_max_lr",
            "warmup_num_steps",
            "warmup_type",
            "total_num_steps",
            "last_batch_iteration",
        ]),
        "WarmupCosineLR" => Some(&[
            "total_num_steps",
            "warmup_min_ratio",
            "warmup_num_steps",
            "cos_min_ratio",
            "warmup_type",
            "last_batch_iteration",
        ]),
        _ => None,
    }
}

fn read_scheduler(f: &Field<'_>, sink: &mut Sink) -> Result<DsScheduler, ConfigError> {
    let fix =
        "add \"type\": \"WarmupLR\", \"WarmupDecayLR\" or \"WarmupCosineLR\", or remove the block";
    let (mut o, kind) = typed_block(f, "a scheduler", fix)?;
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
    // Keys that do not belong to this type stay untaken and are reported as
    // unknown (DeepSpeed rejects them as unexpected keyword arguments).
    let params = o
        .take("params")
        .map(|p| DsSchedulerParams::read_known(&p, sink, keys));
    let params = params.transpose()?.unwrap_or_default();
    o.finish(sink);
    Ok(DsScheduler { kind, params })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scheduler_param_keys_are_fields() {
        for kind in ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"] {
            for k in scheduler_param_keys(kind).unwrap_or_default() {
                assert!(DsSchedulerParams::KEYS.contains(k), "{kind}: {k}");
            }
        }
    }

    #[test]
    fn keys_list_fields_aliases_and_hand_read_keys() {
        assert_eq!(
            DsAio::KEYS,
            [
                "block_size",
                "queue_depth",
                "intra_op_parallelism",
                "single_submit",
                "overlap_events",
                "use_gds",
                "thread_count"
            ]
        );
        for k in [
            "stage",
            "gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save",
            "cpu_offload_use_pin_memory",
        ] {
            assert!(DsZero::KEYS.contains(&k), "{k}");
        }
        assert!(DsConfig::KEYS.contains(&"bfloat16"));
    }
}

//! Memory needs of model states per ZeRO stage and offload choice, and what
//! fits on a given machine (`tierzero estimate`).
//!
//! Pure computation: [`estimate`] takes the model size, the rank count, the
//! swap settings of a config and a [`Machine`] description, and returns
//! every [`Choice`] with its bytes per tier and whether it fits. Reading the
//! machine ([`probe_machine`]) is separate so tests can pass any machine.
//!
//! # What DeepSpeed computes
//!
//! DeepSpeed ships two estimators (deepspeedai/DeepSpeed,
//! `deepspeed/runtime/zero/stage_1_and_2.py::estimate_zero2_model_states_mem_needs`
//! as of commit 02aa38c3, and
//! `deepspeed/runtime/zero/stage3.py::estimate_zero3_model_states_mem_needs`
//! as of 007cca6a; explained, with example output, in
//! `docs/code-docs/source/memory.rst` as of 0cca5393). With `N` params,
//! `G` GPUs per node, `T` GPUs in all, `L` the largest layer's params and
//! `f = 1.5` an "additional buffer factor":
//!
//! | stage | offload | per GPU | per CPU (node) |
//! |---|---|---|---|
//! | 1/2 | none | `2N + 18N/T` | `4N·G·f` (fp32 model load) |
//! | 1/2 | optimizer cpu | `2N` | `N·max(4T, 16)·f` |
//! | 3 | none | `4L + 18N/T` | `4L·G·f` (with `zero.Init`) |
//! | 3 | optimizer cpu | `4L + 2N/T` | `16N·f·G/T` |
//! | 3 | optimizer + params cpu | `4L` | `18N·f·G/T` |
//!
//! [`deepspeed`] reproduces these formulas exactly (tested against the
//! numbers printed in `memory.rst`, and byte for byte against DeepSpeed
//! 0.19.8's functions from PyPI: `scripts/compare_estimate.py` checks every
//! figure of the column against them), and each estimate carries DeepSpeed's
//! figure for comparison where DeepSpeed has one (one node of `R` GPUs,
//! `zero_init=1`, `f = 1.5`, and our largest unit as its largest layer).
//! `memory.rst` still prints `4N + 16N/T` per GPU for stage 2 without
//! offload; the code computes `2N + 18N/T`, which is what we follow. DeepSpeed has no estimate
//! for stage 0 or for NVMe offload, and its numbers hide where the memory
//! goes: the 1.5 factor stands in for buffers it does not list, and pinned
//! memory (what actually runs out, see DeepSpeed#3000) is not shown at all.
//!
//! # What we compute
//!
//! tierzero's own accounting, per rank, item by item, each with its formula
//! ([`Item`]). `S = ⌈N/R⌉` is one rank's partition of `N` params over `R`
//! ranks; `p` the bytes of a 16-bit param (4 in an fp32 run); `m` the bytes
//! of one Adam moment (4, or 2 with bf16 moments).
//!
//! - **16-bit params**: `N·p` (stages 0-2) or `S·p` (stage 3), on the
//!   device, in host memory (`offload_param: cpu`, pinned when `pin_memory`,
//!   since every forward and backward copies them to the device), or on NVMe.
//!   With the model known ([`Inputs::shape`]), offloaded params are sized
//!   from its shards by the sizing policy's own functions: host memory in
//!   pages packed first-fit in `ParamId` order (`sizing::cpu_page_plan`: a
//!   page's tail no later shard fits in stays empty; next fit, which left
//!   a tail each time the next shard did not fit, was +28% over `S·p`
//!   for Llama-2-7B on one rank), the shards
//!   `max_in_cpu` holds kept in such pages and the rest on NVMe, each
//!   extent 4 KiB-aligned (`sizing::nvme_param_homes`). A shard homed on
//!   NVMe larger than one param swap-in buffer makes the choice one
//!   `tierzero train` refuses ([`Estimate::refused`]): it does not fit.
//! - **Gathered units** (stage 3): the unit being computed and the one being
//!   prefetched, `2·L·p`, where `L` is the largest *unit* (a whole
//!   transformer block: that is what the engine gathers, not DeepSpeed's
//!   single module). Skipped with one rank and params on the device: there
//!   is nothing to gather.
//! - **Unit gradients**: one unit's 16-bit grads, `L·p`, on the device
//!   before they are reduced or offloaded (whenever grads are partitioned or
//!   offloaded; stages 0/1 without offload accumulate straight into fp32).
//! - **fp32 gradient accumulators**: `S·4` at every stage (the trainer
//!   shards the sums and the optimizer state over the ranks whatever the
//!   stage: `crate::engine::layout`), wherever the optimizer runs: device, pageable host memory (the CPU
//!   optimizer's sums: a device's copies land in the link's pinned staging
//!   buffers and are read into them, so they need not be pinned; the
//!   plan's grads row), or NVMe (swapped with the optimizer sub-group, as
//!   DeepSpeed's gradient swap files). With the state in host memory, one
//!   rank, bf16 and one micro-batch, the gradients of params no two units
//!   share are held as they came, 2 bytes each
//!   ([`Inputs::bf16_grad_numel`], from `--model` and `--config`).
//! - **Optimizer state**: fp32 master + m + v, `(4 + 2m)` bytes per param,
//!   `S` of them at every stage: on the device, in
//!   *pageable* host memory (`cpu`: the CPU Adam reads and writes it in
//!   place, no DMA touches it, so it need not be pinned), or on NVMe (each
//!   sub-group's three extents 4 KiB-aligned). On
//!   NVMe, tierzero keeps the state of the first forward units' sub-groups
//!   in pageable memory while it fits `tierzero.optimizer_resident_bytes`
//!   (auto: one sub-group's state, at most one prefetch bucket's): the
//!   engine's rule (`sizing::resident_groups_within`) on the model's
//!   sub-groups, or on a stand-in from its size whose first sub-group (at
//!   most `sub_group_size`: a larger tensor is tiled) is the first units'.
//! - **Pinned swap buffers**, from the config (DeepSpeed's defaults without
//!   one):
//!   - param swap-in buffers: `buffer_count × buffer_size × p`, 4 KiB-aligned
//!     (with the model: cut into slots of the largest NVMe shard, as the
//!     arena cuts them, `sizing::param_slots`);
//!   - the param host cache: `min(max_in_cpu, S) × p` (DeepSpeed keeps the
//!     first `max_in_cpu` elements of 16-bit params in host memory; with
//!     the model: the shards the engine's greedy rule keeps, in pages, as
//!     above);
//!   - optimizer swap buffers: `buffers × min(sub_group_size, S) × 4`, where
//!     `buffers` is `offload_optimizer.buffer_count`, raised to what the
//!     pipeline needs (`sizing::buffers_needed`): 3 states (master, m, v), 4
//!     when final gradients spill to NVMe, times the sub-groups in flight
//!     (the one stepped, plus one read ahead with `pipeline_read` and one
//!     written behind with `pipeline_write`), since the pipeline needs them
//!     all (DeepSpeed fails with "ran out of swap buffers" instead);
//!   - with the optimizer offloaded, stepped sub-groups' new 16-bit
//!     values on their way to the params' homes: as many as the optimizer
//!     thread lends at once (`sizing::values_in_flight`: the largest
//!     unit's sub-groups, 2 more plus the pipeline's depth, at most all)
//!     and its spare, each `min(sub_group_size, S) × p`, pageable (heap
//!     memory).
//!
//! With `pin_memory: false`, what would be pinned is counted as pageable.
//!
//! **`offload_optimizer: none` on a GPU** (`--device-memory`) is counted
//! where `tierzero train` runs Adam ([`items_on`]): on the device only with
//! nothing offloaded and where its kernel applies (not fp16, `adam_w_mode`
//! on: `engine::device::trains_resident`), with the device optimizer's own
//! bytes (`engine::device::resident_state_bytes`: bf16 weights and their
//! fp32 masters, m and v, the gradient sums and a workspace of the largest
//! unit and three largest params) and the host's copy of the state
//! (`12·S`, loaded into the device and written back at saves); otherwise
//! on the host, as `cpu`. On a GPU every choice with params `none` also
//! counts the param store's host copy of them (`N·p` on one rank, `S·p`
//! on several: each rank's store holds its shards). Without a GPU the CPU
//! computes and the items above hold.
//!
//! Not counted (as in DeepSpeed): activations, communication buckets,
//! allocator fragmentation. The per-node host and NVMe totals assume all
//! `R` ranks run on this machine.
//!
//! # Where ours and DeepSpeed's ZeRO-3 numbers differ, term by term
//!
//! `scripts/compare_estimate.py` prints both side by side (DeepSpeed's
//! `estimate_zero3_model_states_mem_needs`, the function behind
//! `estimate_zero3_model_states_mem_needs_all_cold`, against our device and
//! host totals, with the same `L`); re-run it when the sizing changes. Each
//! of DeepSpeed's terms and the item of ours it corresponds to:
//!
//! - **`4L` per GPU** (`largest_layer_memory`, in every row; we read it as
//!   the largest layer's 16-bit params and 16-bit grads): ours are the
//!   *gathered units* item, `2·L·p` because the unit being prefetched is
//!   held beside the one being computed (none with one rank and params on
//!   the device, where nothing is gathered), plus the *unit gradients* item,
//!   `L·p`. `L` also means more here: DeepSpeed's `model_to_params` takes
//!   the largest single module (one `Linear`, or the embedding), ours the
//!   largest unit the engine gathers (a whole transformer block).
//! - **`2N/T` per GPU** (params on the device, optimizer on the CPU) is our
//!   *16-bit params* item on the device, `S·p`: equal with 16-bit params,
//!   twice it in an fp32 run (`p = 4`).
//! - **`18N/T` per GPU** (nothing offloaded) is our *16-bit params* +
//!   *fp32 gradient accumulators* + *optimizer state* items on the device,
//!   `S·(p + 4 + 4 + 2m)`: the same 18 bytes with 16-bit params and fp32
//!   moments, 14 with bf16 moments.
//! - **The 1.5 (`additional_buffer_factor`) on every per-CPU figure** and
//!   on none of the per-GPU ones has no counterpart: we add no blanket
//!   factor and instead list the host buffers by name (below); that alone
//!   makes DeepSpeed's per-CPU figure 1.5 times the terms we share.
//! - **`16N·f·G/T` per CPU** (optimizer offloaded: 4 B of fp32 grads and
//!   12 B of fp32 master + m + v per param) is our *fp32 gradient accumulators*
//!   item (2 B where held as bf16) plus our *optimizer state* item, both in
//!   pageable host memory, each as large as the sizing plan holds it there.
//! - **`18N·f·G/T` per CPU** (params offloaded too) adds 2 B of 16-bit
//!   params: our *16-bit param partition* item, pinned with `pin_memory`
//!   (`S·p`).
//! - **Stepped sub-groups' new 16-bit values** (about a unit's worth,
//!   pageable, when the optimizer is offloaded) are not a term of
//!   DeepSpeed's formula; they are inside its 1.5.
//! - **`4L·G·f` per CPU with `zero_init=1`, `4N·G·f` (or `N·max(4G, 16 or
//!   18)·f`) with `zero_init=0`** is memory for building the model (one
//!   layer in fp32 under `zero.Init`, or the whole fp32 model in every
//!   process before it is partitioned); we count only the training-time
//!   model states, no load-time memory, so we have no `zero_init=0`
//!   variant and no host bytes when nothing is offloaded.
//! - **pinned vs pageable**: DeepSpeed's per-CPU figure is one number;
//!   ours is split, since pinned memory is what `RLIMIT_MEMLOCK` limits
//!   and what runs out first.
//! - **NVMe**: DeepSpeed's estimators take only `cpu_offload` /
//!   `cpu_offload_params` booleans and have no NVMe tier, so our NVMe rows,
//!   their NVMe bytes and the pinned swap buffers and param host cache
//!   (`max_in_cpu`) they need have no DeepSpeed figure.
//! - **Precision**: DeepSpeed's formulas fix 16-bit params and fp32 Adam
//!   moments; ours take `p` and `m` from the config and `--moments`.
//! - **Gradients with the state on NVMe** never sit in host memory for the
//!   whole model (DeepSpeed's NVMe swapper swaps them out too, and its
//!   estimators do not model it): host memory holds at most the sums (fp32,
//!   or 2 bytes an element where every group holds bf16) of the largest
//!   unit's sub-groups, those held for the clipping norm,
//!   the speculated ones and the steps handed to the optimizer thread
//!   (`sizing::nvme_state_grad_bound_bytes`, the bound the plan prints);
//!   with clipping or an overflow check the final gradients spill to NVMe (`4S`), with
//!   gradient accumulation the partial sums are parked there between
//!   micro-batches (`4S`, through 4 pinned buffers of one sub-group), and
//!   a speculative step writes into a pool of state slots there.
//!
//! # Against a run
//!
//! `scripts/scale_run.sh`'s config and model (a 2.03B Llama, bf16, GA 2,
//! clipping, `sub_group_size` 1e7) estimated with `tierzero estimate
//! --config ... --model ...`: NVMe 44.59 GB (params 4.06, state 24.27,
//! spilled grads 8.13, parked sums 8.13), and the run's plan maps
//! 44.6 GB on NVMe; host memory 1.75 GB (device 0.39 GB, pinned 0.72 GB,
//! pageable 0.64 GB; the plan: pinned 0.72 GB, grads 0.52 GB, resident
//! state 0.12 GB) against a measured peak RSS of 3.12 GB (2.91 GiB).
//! The rest is what the estimate leaves out: the compute's activations and
//! workspace (the largest unit's fp32 copies and gradients in backward:
//! the 65.5M-element embedding alone is 262 MB per fp32 copy), the
//! program and its heap.
//!
//! # Fitting
//!
//! A choice fits when its device bytes fit in [`DEVICE_USABLE_PERCENT`] of
//! the device memory given, its host bytes (× ranks) fit in
//! [`HOST_USABLE_PERCENT`] of RAM, and its NVMe
//! bytes (× ranks) fit the free space of the swap path. Without a device
//! size the compute device is taken to be the CPU (tierzero trains on the
//! CPU when there is no GPU), so device bytes come out of RAM too. Pinned
//! bytes above `RLIMIT_MEMLOCK` do not make a choice unfit (the limit can be
//! raised) but are flagged. The recommendation is the first choice that
//! fits in order of least data movement: params offload none < cpu < nvme,
//! then optimizer offload none < cpu < nvme, then the lowest stage.
//!
//! # When the largest unit is unknown
//!
//! With only `--params`, `L` is assumed from a GPT-3-shaped decoder
//! (hidden = 128 × layers and 12·hidden² params per layer, so
//! `layers = ∛(N / 196608)` and `L = N / layers`): 213M for 7B, against
//! 202M for Llama-2-7B's real block. The output says it is assumed;
//! `--largest-layer` or `--model` replace it.

use serde::Serialize;

pub mod deepspeed;
mod items;
mod machine;
use items::SPECULATION_POOL;
pub use items::{items, items_on, items_within};
pub use machine::{
    cgroup_memory, cgroup_memory_under, parse_meminfo, parse_memlock, probe_machine, probe_ram,
    probe_swap_free, CgroupMemory, Machine, Memlock,
};

use crate::engine::sizing::{self, Buffers, Shape};

use crate::config::{
    parse_str, AutoOr, Config, ConfigError, Loaded, OffloadDevice, PathChecks, RunContext, Stage,
};

/// Share of RAM a choice may use for model states (the rest is left to the
/// OS, activations and the page cache).
pub const HOST_USABLE_PERCENT: u64 = 90;

/// Share of device memory a choice may use for model states (the rest is
/// left to activations and the allocator).
pub const DEVICE_USABLE_PERCENT: u64 = 90;

/// The most ranks one machine's estimate takes: every rank is counted on
/// this machine (its RAM, its disk), and a device's estimate does per-rank
/// shard arithmetic for each.
pub const MAX_RANKS: u64 = 4096;

/// Errors of the estimate area.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EstimateError {
    /// More ranks than one machine's estimate takes.
    #[error("--ranks {ranks}: the estimate is of one machine, whose ranks share its RAM and disk; give at most {MAX_RANKS} (the ranks of this node)")]
    TooManyRanks {
        /// The ranks asked for.
        ranks: u64,
    },
    /// A count that must be positive was zero.
    #[error("{what} must be at least 1 (got 0)")]
    Zero {
        /// Which input.
        what: &'static str,
    },
    /// The largest unit is bigger than the model.
    #[error("the largest unit ({largest_numel} params) cannot exceed the model ({total_numel} params); fix --largest-layer")]
    LargestExceedsTotal {
        /// Largest unit.
        largest_numel: u64,
        /// Whole model.
        total_numel: u64,
    },
    /// A byte count does not fit in 64 bits.
    #[error("{what} overflows 64-bit byte counts; the model is too large to estimate")]
    Overflow {
        /// Which product.
        what: String,
    },
}

/// Where a tensor class lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Offload {
    /// On the compute device.
    None,
    /// In host memory.
    Cpu,
    /// On NVMe.
    Nvme,
}

impl Offload {
    /// DeepSpeed's name for the device.
    pub fn name(self) -> &'static str {
        match self {
            Offload::None => "none",
            Offload::Cpu => "cpu",
            Offload::Nvme => "nvme",
        }
    }
}

/// A ZeRO stage and its offload choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Choice {
    /// ZeRO stage (serialised as DeepSpeed's number).
    #[serde(serialize_with = "stage_number")]
    pub stage: Stage,
    /// `offload_optimizer.device`.
    pub optimizer: Offload,
    /// `offload_param.device` (always `None` below stage 3).
    pub params: Offload,
}

fn stage_number<S: serde::Serializer>(stage: &Stage, ser: S) -> Result<S::Ok, S::Error> {
    ser.serialize_u8(stage.number())
}

impl Choice {
    /// Every choice DeepSpeed accepts: stage 0 without offload; stages 1
    /// and 2 with the optimizer on the device or the CPU; stage 3 with each
    /// of none/cpu/nvme for the optimizer and for the params.
    pub fn all() -> Vec<Choice> {
        use Offload::*;
        let mut v = vec![Choice {
            stage: Stage::Disabled,
            optimizer: None,
            params: None,
        }];
        for stage in [Stage::OptimizerStates, Stage::Gradients] {
            for optimizer in [None, Cpu] {
                v.push(Choice {
                    stage,
                    optimizer,
                    params: None,
                });
            }
        }
        for optimizer in [None, Cpu, Nvme] {
            for params in [None, Cpu, Nvme] {
                v.push(Choice {
                    stage: Stage::Parameters,
                    optimizer,
                    params,
                });
            }
        }
        v
    }

    /// Preference order: less data movement first.
    fn preference(self) -> (Offload, Offload, Stage) {
        (self.params, self.optimizer, self.stage)
    }
}

/// The swap settings that size pinned buffers (DeepSpeed's keys).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SwapSettings {
    /// `offload_param.buffer_count`.
    pub param_buffer_count: u64,
    /// `offload_param.buffer_size` (elements).
    pub param_buffer_numel: u64,
    /// `offload_param.max_in_cpu` (elements).
    pub param_max_in_cpu_numel: u64,
    /// `offload_param.pin_memory`.
    pub param_pin_memory: bool,
    /// `offload_optimizer.buffer_count`.
    pub optimizer_buffer_count: u64,
    /// `offload_optimizer.pin_memory`.
    pub optimizer_pin_memory: bool,
    /// `offload_optimizer.pipeline_read`.
    pub pipeline_read: bool,
    /// `offload_optimizer.pipeline_write`.
    pub pipeline_write: bool,
    /// Whether final gradients would spill to NVMe with the optimizer
    /// state there (overlap on, and clipping or an overflow check: see
    /// [`crate::engine::sizing::spills_grads`]); their read-back takes a
    /// fourth buffer per sub-group in the pipeline.
    pub spill_grads_with_nvme_state: bool,
    /// `sub_group_size` (elements).
    pub sub_group_numel: u64,
    /// `stage3_prefetch_bucket_size` (elements).
    pub prefetch_bucket_numel: u64,
    /// `tierzero.optimizer_resident_bytes` (`None`: auto).
    pub optimizer_resident_bytes: Option<u64>,
    /// What the config asks of the speculative step with the state on
    /// NVMe ([`crate::engine::sizing::speculation_ask`]): a pool of state
    /// slots on NVMe, and their gradients kept in host memory.
    pub speculation_with_nvme_state: sizing::SpeculationAsk,
    /// `gradient_accumulation_steps` (1 when `"auto"` or absent): above 1,
    /// with the state on NVMe, partial sums are parked on NVMe between
    /// micro-batches.
    pub gradient_accumulation_steps: u64,
    /// `tierzero.overlap_optimizer`: off, with the state on NVMe, every
    /// sub-group's gradients stay in host memory until the step
    /// (`crate::engine::sizing::Sizing::grads_held_until_step`).
    pub overlap_optimizer: bool,
    /// `tierzero.pinned_budget_bytes`: the param swap-in slots are cut to
    /// what it holds ([`sizing::param_slots_within`]).
    pub pinned_budget_bytes: Option<u64>,
}

impl SwapSettings {
    /// The settings of a validated config (its offload devices are ignored:
    /// every choice is estimated with the same buffer sizes).
    pub fn from_config(c: &Config) -> Self {
        let p = &c.zero.offload_param;
        let o = &c.zero.offload_optimizer;
        SwapSettings {
            param_buffer_count: p.buffer_count,
            param_buffer_numel: p.buffer_numel.0,
            param_max_in_cpu_numel: p.max_in_cpu_numel.0,
            param_pin_memory: p.pin_memory,
            optimizer_buffer_count: o.buffer_count,
            optimizer_pin_memory: o.pin_memory,
            pipeline_read: o.pipeline_read,
            pipeline_write: o.pipeline_write,
            spill_grads_with_nvme_state: sizing::spills_with_nvme_state(c),
            speculation_with_nvme_state: sizing::speculation_ask_with_nvme_state(c),
            gradient_accumulation_steps: c.batch.gradient_accumulation_steps.max(1),
            sub_group_numel: c.zero.sub_group_numel.0,
            prefetch_bucket_numel: c.zero.prefetch_bucket_numel.0,
            optimizer_resident_bytes: c.tierzero.optimizer_resident_bytes.map(|b| b.0),
            overlap_optimizer: c.tierzero.overlap_optimizer,
            pinned_budget_bytes: c.tierzero.pinned_budget_bytes.map(|b| b.0),
        }
    }
}

/// Loads config text for estimating: precision, the ZeRO and offload
/// settings and the gradient accumulation size memory. The scheduler is
/// dropped (its `"auto"` values would need a run) and `nvme_path` is not
/// checked on disk. The batch sizes are read as a run reads them, so an
/// accumulation that `train_batch_size` implies (`32` over a micro-batch
/// of 4 on one rank: 8) counts its parked gradient sums; where they do not
/// resolve without a run (`"auto"`, a batch for another rank count), they
/// are dropped and a missing micro-batch size becomes `"auto"`. Everything
/// else is validated as for a run.
pub fn load_config(text: &str, ranks: u64, total_numel: u64) -> Result<Loaded, ConfigError> {
    load_config_with(text, ranks, total_numel, None)
}

/// [`load_config`] for a known model: its hidden size and largest param
/// resolve the `"auto"` keys that depend on them
/// (`stage3_prefetch_bucket_size` is `0.9 × hidden²`, ...) as `tierzero
/// train` resolves them for it.
pub fn load_config_for_model(
    text: &str,
    ranks: u64,
    model: &crate::model::Model,
) -> Result<Loaded, ConfigError> {
    load_config_with(
        text,
        ranks,
        model.numel() as u64,
        Some((
            model.config().hidden_size as u64,
            model.params().iter().map(|p| p.numel as u64).max(),
        )),
    )
}

fn load_config_with(
    text: &str,
    ranks: u64,
    total_numel: u64,
    model: Option<(u64, Option<u64>)>,
) -> Result<Loaded, ConfigError> {
    let mut parsed = parse_str(text)?;
    parsed.ds.scheduler = None;
    let run = RunContext {
        ranks,
        model_numel: Some(total_numel),
        hidden_size: model.map(|m| m.0),
        largest_param_numel: model.and_then(|m| m.1),
        path_checks: PathChecks::Skip,
        ..RunContext::default()
    };
    if let Ok(loaded) = parsed.clone().resolve(&run) {
        return Ok(loaded);
    }
    parsed.ds.train_batch_size = None;
    parsed
        .ds
        .train_micro_batch_size_per_gpu
        .get_or_insert(AutoOr::Auto);
    parsed.resolve(&run)
}

/// The choice a config selects.
pub fn choice_of_config(c: &Config) -> Choice {
    let off = |d: &OffloadDevice| match d {
        OffloadDevice::None => Offload::None,
        OffloadDevice::Cpu => Offload::Cpu,
        OffloadDevice::Nvme { .. } => Offload::Nvme,
    };
    Choice {
        stage: c.zero.stage,
        optimizer: off(&c.zero.offload_optimizer.device),
        params: off(&c.zero.offload_param.device),
    }
}

/// Where the largest-unit size came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LargestSource {
    /// `--largest-layer`.
    Given,
    /// Counted from the model's `config.json`.
    Model,
    /// Assumed from the total (see the module docs).
    Assumed,
}

/// What is estimated.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Inputs {
    /// Model parameters (shared ones counted once).
    pub total_numel: u64,
    /// Params of the largest unit gathered at once.
    pub largest_unit_numel: u64,
    /// Where `largest_unit_numel` came from.
    pub largest_source: LargestSource,
    /// Largest single tensor, when the model is known (checked against the
    /// param swap buffer size).
    pub largest_tensor_numel: Option<u64>,
    /// Data-parallel ranks, all on this machine.
    pub ranks: u64,
    /// Bytes per param element (2 for fp16/bf16, 4 for fp32 runs).
    pub param_elem_bytes: u64,
    /// Bytes per Adam moment element (4, or 2 with bf16 moments).
    pub moment_elem_bytes: u64,
    /// Elements whose gradients the host holds as bf16, as they came, with
    /// the optimizer state in host memory
    /// ([`crate::engine::sizing::bf16_grad_numel`]: one rank, bf16, one
    /// micro-batch, params no two units share; needs the model and the
    /// config); the rest take 4 bytes, fp32 sums.
    pub bf16_grad_numel: u64,
    /// Elements of the params several units use (a tied embedding), when
    /// the model is known ([`crate::engine::sizing::tied_numel`]; 0 from
    /// a size alone): their gradients' sums are held through backward.
    pub tied_numel: u64,
    /// Pinned buffer settings.
    pub swap: SwapSettings,
    /// Why Adam cannot run on a GPU with nothing offloaded
    /// ([`crate::engine::device::trains_resident`] of the config with both
    /// offloads `none`: fp16, or `adam_w_mode: false`); `None` when it
    /// can. Only a GPU's estimate (`--device-memory`) reads it.
    pub device_adam_refusal: Option<String>,
    /// Params stored as bf16 (the device optimizer then keeps fp32 masters
    /// beside them).
    pub bf16_params: bool,
    /// With the model known: the elements and the count of its
    /// persistent params (`crate::engine::sizing::persistent_params`),
    /// which stage 3 keeps whole in host memory beside their homes when
    /// the params are offloaded; `(0, 0)` from a size alone.
    pub persistent: (u64, u64),
    /// With the model known: rank 0's shape as the trainer lays it out
    /// ([`Shape::of`]: its param shards in `ParamId` order, its optimizer
    /// sub-groups, those of the first forward units marked). The trainer
    /// shards the optimizer state and the gradient sums at every stage, so
    /// the sub-groups hold for every choice; the param shards are those of
    /// stage 3. The sizing policy's own functions then size the param
    /// pages and homes and the resident sub-groups from it. `None`: sizes
    /// only ([`Shape::estimated`] where a shape is needed).
    #[serde(skip)]
    pub shape: Option<Shape>,
    /// With the model known: the sub-groups its largest unit's params
    /// touch on rank 0 (`sizing::largest_unit_groups`), the sums backward
    /// adds into at once with the state on NVMe. `None`: bounded from the
    /// unit's size.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub largest_unit_groups: Option<u64>,
}

/// The assumed largest unit for a GPT-3-shaped model of `total_numel`
/// params (see the module docs).
pub fn assumed_largest_unit_numel(total_numel: u64) -> u64 {
    let layers = (total_numel as f64 / 196_608.0).cbrt().round().max(1.0);
    (total_numel as f64 / layers).ceil() as u64
}

/// A memory tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// Accelerator memory (or RAM when the CPU is the device).
    Device,
    /// Page-locked host memory.
    Pinned,
    /// Ordinary host memory.
    Pageable,
    /// NVMe swap files.
    Nvme,
}

/// One line of the accounting.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Item {
    /// Where the bytes live.
    pub tier: Tier,
    /// What they are.
    pub what: &'static str,
    /// How many, per rank.
    pub bytes: u64,
    /// How they were computed, with the numbers.
    pub formula: String,
}

/// Bytes per tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Totals {
    /// Device bytes.
    pub device_bytes: u64,
    /// Pinned host bytes.
    pub pinned_bytes: u64,
    /// Pageable host bytes.
    pub pageable_bytes: u64,
    /// NVMe bytes.
    pub nvme_bytes: u64,
}

impl Totals {
    fn add(&mut self, tier: Tier, bytes: u64) {
        let slot = match tier {
            Tier::Device => &mut self.device_bytes,
            Tier::Pinned => &mut self.pinned_bytes,
            Tier::Pageable => &mut self.pageable_bytes,
            Tier::Nvme => &mut self.nvme_bytes,
        };
        *slot = slot.saturating_add(bytes);
    }

    fn times(self, k: u64) -> Result<Totals, EstimateError> {
        let m = |v: u64, what: &str| {
            v.checked_mul(k).ok_or_else(|| EstimateError::Overflow {
                what: format!("{what} × ranks"),
            })
        };
        Ok(Totals {
            device_bytes: m(self.device_bytes, "device bytes")?,
            pinned_bytes: m(self.pinned_bytes, "pinned bytes")?,
            pageable_bytes: m(self.pageable_bytes, "pageable bytes")?,
            nvme_bytes: m(self.nvme_bytes, "NVMe bytes")?,
        })
    }

    /// Host bytes, pinned and pageable.
    pub fn host_bytes(&self) -> u64 {
        self.pinned_bytes.saturating_add(self.pageable_bytes)
    }
}

/// DeepSpeed's own estimate for the same choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DeepSpeedFigure {
    /// "per CPU" (per node), with `zero_init=1`.
    pub cpu_bytes: u64,
    /// "per GPU".
    pub gpu_bytes: u64,
}

/// Whether one resource suffices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Enough.
    Fits,
    /// Not enough.
    TooSmall,
    /// The resource's size is unknown.
    Unknown,
}

/// The fit of one choice on a machine.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Fit {
    /// Device memory (per rank); `Unknown` folds the device into host RAM.
    pub device: Verdict,
    /// Host RAM (per node, device bytes included when the CPU is the device).
    pub host: Verdict,
    /// NVMe free space (per node).
    pub nvme: Verdict,
    /// Pinned bytes per rank exceed `RLIMIT_MEMLOCK`.
    pub pinned_over_memlock: bool,
    /// Everything known fits and nothing needed is unknown.
    pub fits: bool,
    /// The largest of need / usable over the resources whose size is
    /// known: at most 1 when it fits; how far off it is otherwise.
    pub max_use_ratio: f64,
}

/// The estimate of one choice.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Estimate {
    /// The choice.
    pub choice: Choice,
    /// Per-rank accounting.
    pub items: Vec<Item>,
    /// Per-rank totals.
    pub per_rank: Totals,
    /// All ranks on this machine.
    pub per_node: Totals,
    /// Host bytes the node needs in RAM (device bytes included when the CPU
    /// is the device).
    pub node_ram_bytes: u64,
    /// DeepSpeed's estimate, where it has one.
    pub deepspeed: Option<DeepSpeedFigure>,
    /// Fit on the machine.
    pub fit: Fit,
    /// Why `tierzero train` would refuse this choice at start-up, whatever
    /// the machine (then it does not fit): see `items::refusal`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
}

/// The whole answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// What was estimated.
    pub inputs: Inputs,
    /// The machine.
    pub machine: Machine,
    /// One estimate per choice, in [`Choice::all`] order.
    pub estimates: Vec<Estimate>,
    /// The first fitting choice in preference order.
    pub recommended: Option<Choice>,
    /// When nothing fits: the choice closest to fitting (smallest
    /// [`Fit::max_use_ratio`]).
    pub closest: Option<Choice>,
    /// Warnings and hints, one line each.
    pub notes: Vec<String>,
}

/// DeepSpeed's figure for `c` (one node of `ranks` GPUs, `zero_init=1`,
/// factor 1.5), or `None` where DeepSpeed has no estimator.
pub fn deepspeed_figure(inp: &Inputs, c: Choice) -> Option<DeepSpeedFigure> {
    let (cpu, gpu) = match (c.stage, c.optimizer, c.params) {
        (Stage::OptimizerStates | Stage::Gradients, o, Offload::None) if o != Offload::Nvme => {
            deepspeed::zero2(inp.total_numel, inp.ranks, 1, o == Offload::Cpu, 1.5)
        }
        (Stage::Parameters, Offload::None, Offload::None) => {
            let (c, g, _) = deepspeed::zero3(
                inp.total_numel,
                inp.largest_unit_numel,
                inp.ranks,
                1,
                false,
                false,
                true,
                1.5,
            );
            (c, g)
        }
        (Stage::Parameters, Offload::Cpu, p @ (Offload::None | Offload::Cpu)) => {
            let (c, g, _) = deepspeed::zero3(
                inp.total_numel,
                inp.largest_unit_numel,
                inp.ranks,
                1,
                true,
                p == Offload::Cpu,
                true,
                1.5,
            );
            (c, g)
        }
        _ => return None,
    };
    Some(DeepSpeedFigure {
        cpu_bytes: cpu,
        gpu_bytes: gpu,
    })
}

fn fit(per_rank: &Totals, node_ram_bytes: u64, per_node: &Totals, m: &Machine) -> Fit {
    let verdict = |need: u64, have: Option<u64>| match have {
        _ if need == 0 => Verdict::Fits,
        Some(h) if need <= h => Verdict::Fits,
        Some(_) => Verdict::TooSmall,
        None => Verdict::Unknown,
    };
    let usable = |b: u64, percent: u64| (b as u128 * percent as u128 / 100) as u64;
    let device = match m.device_bytes {
        Some(d) => verdict(
            per_rank.device_bytes,
            Some(usable(d, DEVICE_USABLE_PERCENT)),
        ),
        None => Verdict::Unknown,
    };
    let usable_ram = m.ram_bytes.map(|r| usable(r, HOST_USABLE_PERCENT));
    let host = verdict(node_ram_bytes, usable_ram);
    let nvme = verdict(per_node.nvme_bytes, m.nvme_free_bytes);
    let pinned_over_memlock = match m.memlock {
        Some(Memlock::Bytes(b)) => per_rank.pinned_bytes > b,
        _ => false,
    };
    let device_ok = m.device_bytes.is_none() || device == Verdict::Fits;
    let ratio = |need: u64, have: Option<u64>| match have {
        _ if need == 0 => 0.0,
        Some(0) => f64::INFINITY,
        Some(h) => need as f64 / h as f64,
        None => 0.0,
    };
    let max_use_ratio = ratio(
        per_rank.device_bytes,
        m.device_bytes.map(|d| usable(d, DEVICE_USABLE_PERCENT)),
    )
    .max(ratio(node_ram_bytes, usable_ram))
    .max(ratio(per_node.nvme_bytes, m.nvme_free_bytes));
    Fit {
        device,
        host,
        nvme,
        pinned_over_memlock,
        fits: device_ok && host == Verdict::Fits && nvme == Verdict::Fits,
        max_use_ratio,
    }
}

/// Checks the inputs.
pub fn validate(inp: &Inputs) -> Result<(), EstimateError> {
    if inp.total_numel == 0 {
        return Err(EstimateError::Zero {
            what: "the parameter count",
        });
    }
    if inp.ranks == 0 {
        return Err(EstimateError::Zero { what: "--ranks" });
    }
    if inp.ranks > MAX_RANKS {
        return Err(EstimateError::TooManyRanks { ranks: inp.ranks });
    }
    if inp.largest_unit_numel == 0 {
        return Err(EstimateError::Zero {
            what: "the largest unit",
        });
    }
    if inp.largest_unit_numel > inp.total_numel {
        return Err(EstimateError::LargestExceedsTotal {
            largest_numel: inp.largest_unit_numel,
            total_numel: inp.total_numel,
        });
    }
    Ok(())
}

/// Estimates every choice on `machine`.
pub fn estimate(inp: &Inputs, machine: &Machine) -> Result<Report, EstimateError> {
    validate(inp)?;
    let mut estimates = Vec::new();
    for choice in Choice::all() {
        // On a GPU, `offload_optimizer: none` is where train runs Adam.
        let gpu = machine.device_bytes.is_some();
        let mut items = items_on(inp, choice, gpu, None)?;
        // The run bounds an auto speculation pool by the free space
        // (half what is left after its other extents): so does this.
        if let Some(free) = machine.nvme_free_bytes {
            let pool = items.iter().any(|i| i.what == SPECULATION_POOL);
            let bought = matches!(
                inp.swap.speculation_with_nvme_state,
                sizing::SpeculationAsk::PoolBytes(_)
            );
            if pool && !bought {
                let others: u64 = items
                    .iter()
                    .filter(|i| i.tier == Tier::Nvme && i.what != SPECULATION_POOL)
                    .map(|i| i.bytes)
                    .sum();
                let ranks = inp.ranks.max(1);
                let room = free.saturating_sub(others.saturating_mul(ranks)) / ranks;
                items = items_on(inp, choice, gpu, Some(room))?;
            }
        }
        let mut per_rank = Totals::default();
        for it in &items {
            per_rank.add(it.tier, it.bytes);
        }
        let per_node = per_rank.times(inp.ranks)?;
        let mut node_ram_bytes = per_node.host_bytes();
        if machine.device_bytes.is_none() {
            node_ram_bytes = node_ram_bytes.saturating_add(per_node.device_bytes);
        }
        let mut fit = fit(&per_rank, node_ram_bytes, &per_node, machine);
        let refused = items::refusal(inp, choice)?;
        fit.fits &= refused.is_none();
        estimates.push(Estimate {
            choice,
            deepspeed: deepspeed_figure(inp, choice),
            items,
            per_rank,
            per_node,
            node_ram_bytes,
            fit,
            refused,
        });
    }
    let recommended = estimates
        .iter()
        .filter(|e| e.fit.fits)
        .min_by_key(|e| e.choice.preference())
        .map(|e| e.choice);
    // Closest among the choices train would take (all, if it takes none).
    let closest = if recommended.is_some() {
        None
    } else {
        let taken = estimates.iter().any(|e| e.refused.is_none());
        estimates
            .iter()
            .filter(|e| !taken || e.refused.is_none())
            .min_by(|a, b| a.fit.max_use_ratio.total_cmp(&b.fit.max_use_ratio))
            .map(|e| e.choice)
    };
    let mut notes = Vec::new();
    if inp.largest_source == LargestSource::Assumed {
        notes.push(format!(
            "largest unit assumed {} params (GPT-3-shaped model); pass --largest-layer or --model for the real one",
            inp.largest_unit_numel
        ));
    }
    if let Some(why) = estimates.iter().find_map(|e| e.refused.as_ref()) {
        notes.push(format!("params on NVMe do not fit: {why}"));
    }
    let (_, needed) = sizing::optimizer_buffers(
        inp.swap.optimizer_buffer_count,
        usize::from(inp.swap.pipeline_read),
        usize::from(inp.swap.pipeline_write),
        inp.swap.spill_grads_with_nvme_state,
        0,
    );
    if inp.swap.optimizer_buffer_count < needed {
        notes.push(format!(
            "offload_optimizer.buffer_count {} is below the {needed} buffers the optimizer pipeline needs (states per sub-group × sub-groups in flight); counted as {needed}",
            inp.swap.optimizer_buffer_count
        ));
    }
    if machine.device_bytes.is_none() {
        notes.push(
            "device memory unknown (no GPU driver is queried): assuming the CPU is the compute device, so device bytes come out of RAM; pass --device-memory (e.g. 80GiB) for a GPU"
                .to_owned(),
        );
    }
    if let Some(rec) = recommended {
        if let Some(e) = estimates.iter().find(|e| e.choice == rec) {
            if e.fit.pinned_over_memlock {
                if let Some(Memlock::Bytes(b)) = machine.memlock {
                    notes.push(format!(
                        "the recommended choice pins {} bytes per rank but RLIMIT_MEMLOCK is {b} bytes: raise it (ulimit -l, or memlock in /etc/security/limits.conf) or set pin_memory false",
                        e.per_rank.pinned_bytes
                    ));
                }
            }
        }
    }
    Ok(Report {
        inputs: inp.clone(),
        machine: machine.clone(),
        estimates,
        recommended,
        closest,
        notes,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failure is a panic
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn settings(json: &str) -> SwapSettings {
        SwapSettings::from_config(&load_config(json, 1, 1000).unwrap().config)
    }

    /// `tierzero.optimizer_resident_bytes`: with NVMe state, the sub-groups
    /// of the first forward units stay in pageable memory while their state
    /// fits the budget (auto: one sub-group's, at most one prefetch
    /// bucket's): an explicit size keeps no other group (the engine's
    /// `sizing::resident_groups`); 0 keeps nothing. Each NVMe group's three
    /// extents are 4 KiB-aligned.
    #[test]
    fn resident_optimizer_state_moves_from_nvme_to_host() {
        let cfg = |extra: &str| {
            settings(&format!(
                r#"{{"zero_optimization": {{"stage": 3, "sub_group_size": 1e6,
                    "stage3_prefetch_bucket_size": 5e6,
                    "offload_optimizer": {{"device": "cpu"}}}}{extra}}}"#
            ))
        };
        let (n, l) = (100_000_000u64, 5_000_000u64);
        let resident = |sw: SwapSettings, largest: Option<u64>| {
            let mut inp = inputs(n, l, 1, sw);
            inp.largest_tensor_numel = largest;
            let r = estimate(&inp, &machine(1 << 40, 1 << 40, None)).unwrap();
            let e = find(&r, 3, Offload::Nvme, Offload::Nvme);
            let kept = e
                .items
                .iter()
                .find(|i| i.what == "optimizer state kept resident")
                .map(|i| (i.tier, i.bytes));
            let state = e
                .items
                .iter()
                .find(|i| i.what == "fp32 master + Adam m, v")
                .map(|i| (i.tier, i.bytes));
            (kept, state)
        };
        // 100 groups of 1M elements; each group's master, m and v on NVMe
        // are 4,000,000 B rounded up to 4 KiB.
        let group_nvme = 3 * 4_001_792;
        let all = 100 * group_nvme;
        // "auto": one sub-group's state (1M elements, within the 5M
        // bucket).
        assert_eq!(
            resident(cfg(""), None),
            (
                Some((Tier::Pageable, 1_000_000 * 12)),
                Some((Tier::Nvme, all - group_nvme))
            )
        );
        // 100 MiB would hold 8 groups, but only the first is the first
        // forward units' (a model known by its size: its first group).
        let explicit = r#", "tierzero": {"optimizer_resident_bytes": "100MiB"}"#;
        assert_eq!(
            resident(cfg(explicit), None),
            (
                Some((Tier::Pageable, 1_000_000 * 12)),
                Some((Tier::Nvme, all - group_nvme))
            )
        );
        let off = r#", "tierzero": {"optimizer_resident_bytes": 0}"#;
        assert_eq!(resident(cfg(off), None), (None, Some((Tier::Nvme, all))));
        // An embedding of 10M elements is tiled into groups of 1M: its
        // first tile is resident, as any first group.
        assert_eq!(
            resident(cfg(""), Some(10_000_000)),
            (
                Some((Tier::Pageable, 1_000_000 * 12)),
                Some((Tier::Nvme, all - group_nvme))
            )
        );
    }

    /// With the model's shards, offloaded params are sized as the engine
    /// sizes them: `cpu` packs every shard into pinned pages (first-fit in
    /// `ParamId` order; a page's tail that no later shard fits in is left
    /// empty), `nvme` keeps what `max_in_cpu` holds in such pages
    /// and aligns each NVMe extent; a shard on NVMe larger than a param
    /// swap-in buffer is a choice train refuses, so it does not fit.
    #[test]
    fn the_model_s_shards_size_param_pages_homes_and_refusals() {
        use crate::engine::sizing::{GroupShape, SumDtype};
        let (a, b) = (40_000_000u64, 10_000_000u64);
        let shape = Shape {
            param_shard_numel: vec![a, b, a],
            sub_groups: vec![GroupShape {
                numel: 2 * a + b,
                first_units: true,
                sum_dtype: SumDtype::F32,
            }],
            exact_shards: true,
        };
        let report = |buffer_size: &str| {
            let sw = settings(&format!(
                r#"{{"zero_optimization": {{"stage": 3,
                    "offload_param": {{"device": "cpu", "max_in_cpu": 5e7,
                        "buffer_size": {buffer_size}}}}}}}"#
            ));
            let mut inp = inputs(2 * a + b, a, 1, sw);
            inp.shape = Some(shape.clone());
            estimate(&inp, &machine(1 << 40, 1 << 40, None)).unwrap()
        };
        let r = report("1e8");
        let rows = |e: &Estimate| -> Vec<(Tier, &str, u64)> {
            e.items
                .iter()
                .filter(|i| {
                    i.what.contains("param")
                        && !i.what.starts_with("new param values")
                        && i.tier != Tier::Device
                })
                .map(|i| (i.tier, i.what, i.bytes))
                .collect()
        };
        // Pages of the largest shard, 80 MB (> 64 MiB) rounded up to
        // 4 KiB: 80 MB, then 20 MB that the 80 MB after it does not join.
        let page = 80_003_072;
        assert_eq!(
            rows(find(&r, 3, Offload::Cpu, Offload::Cpu)),
            [(Tier::Pinned, "param partition", 3 * page)]
        );
        // max_in_cpu 5e7 keeps the first two shards (50M elements); the
        // third goes to NVMe, read through 5 slots of its own size cut
        // from the 200 MB buffers.
        assert_eq!(
            rows(find(&r, 3, Offload::Cpu, Offload::Nvme)),
            [
                (Tier::Pinned, "param host cache (max_in_cpu)", 2 * page),
                (Tier::Nvme, "param partition", page),
                (Tier::Pinned, "param swap-in buffers", 5 * page),
            ]
        );
        assert!(r.estimates.iter().all(|e| e.refused.is_none()));
        // Buffers of 3e7 elements (60 MB) cannot hold the 80 MB shard.
        let r = report("3e7");
        let e = find(&r, 3, Offload::Cpu, Offload::Nvme);
        assert!(!e.fit.fits);
        let why = e.refused.as_deref().unwrap();
        assert!(
            why.contains("40000000 elements") && why.contains("buffer_size 30000000"),
            "{why}"
        );
        assert!(
            r.notes
                .iter()
                .any(|n| n.contains("raise buffer_size to at least 40000000")),
            "{:?}",
            r.notes
        );
        assert_ne!(r.recommended.map(|c| c.params), Some(Offload::Nvme));
        assert!(find(&r, 3, Offload::Cpu, Offload::Cpu).refused.is_none());
    }

    #[test]
    fn config_for_estimate_ignores_batch_and_schedule() {
        // An HF-style config: "auto" batch sizes and step counts, and a
        // train_batch_size that only holds for 2 ranks.
        let text = r#"{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 8,
            "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}},
            "bf16": {"enabled": true},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}"#;
        let loaded = load_config(text, 4, 1_000_000).unwrap();
        assert_eq!(loaded.config.precision.param_elem_bytes(), 2);
        assert_eq!(
            choice_of_config(&loaded.config),
            Choice {
                stage: Stage::Parameters,
                optimizer: Offload::Cpu,
                params: Offload::None
            }
        );
        // Real config errors still fail.
        assert!(load_config(r#"{"zero_optimization": {"stage": 7}}"#, 1, 1).is_err());
    }

    /// The accumulation a config's batch sizes imply is the run's: its
    /// parked gradient sums are counted (it was taken as 1).
    #[test]
    fn an_accumulation_the_batch_sizes_imply_is_counted() {
        let text = r#"{"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}"#;
        assert_eq!(settings(text).gradient_accumulation_steps, 8);
        assert_eq!(
            load_config(text, 2, 1000)
                .unwrap()
                .config
                .batch
                .gradient_accumulation_steps,
            4
        );
        // One that holds for another rank count: dropped, as before.
        assert_eq!(
            load_config(text, 3, 1000)
                .unwrap()
                .config
                .batch
                .gradient_accumulation_steps,
            1
        );
    }

    fn inputs(total: u64, largest: u64, ranks: u64, swap: SwapSettings) -> Inputs {
        Inputs {
            total_numel: total,
            largest_unit_numel: largest,
            largest_source: LargestSource::Given,
            largest_tensor_numel: None,
            ranks,
            param_elem_bytes: 2,
            moment_elem_bytes: 4,
            bf16_grad_numel: 0,
            tied_numel: 0,
            swap,
            device_adam_refusal: None,
            bf16_params: true,
            persistent: (0, 0),
            shape: None,
            largest_unit_groups: None,
        }
    }

    fn machine(ram: u64, nvme: u64, device: Option<u64>) -> Machine {
        Machine {
            ram_bytes: Some(ram),
            ram_available_bytes: None,
            memlock: Some(Memlock::Unlimited),
            nvme_dir: None,
            nvme_free_bytes: Some(nvme),
            device_bytes: device,
        }
    }

    fn gib2(bytes: u64) -> String {
        format!("{:.2}", bytes as f64 / GIB as f64)
    }

    /// DeepSpeed's `docs/code-docs/source/memory.rst` prints, for
    /// `estimate_zero3_model_states_mem_needs_all_cold(total_params=2851e6,
    /// largest_layer_params=32e6, num_gpus_per_node=8, num_nodes=1)`:
    /// 71.69/0.12, 127.45/0.12, 63.72/0.78, 127.45/0.78, 1.43/6.09,
    /// 127.45/6.09 GB (per CPU / per GPU).
    #[test]
    fn zero3_matches_deepspeed_docs() {
        let (n, l) = (2_851_000_000, 32_000_000);
        let rows = [
            (true, true, true, "71.69", "0.12"),
            (true, true, false, "127.45", "0.12"),
            (true, false, true, "63.72", "0.78"),
            (true, false, false, "127.45", "0.78"),
            (false, false, true, "1.43", "6.09"),
            (false, false, false, "127.45", "6.09"),
        ];
        for (opt, par, init, cpu, gpu) in rows {
            let (c, g, largest) = deepspeed::zero3(n, l, 8, 1, opt, par, init, 1.5);
            assert_eq!(
                (gib2(c).as_str(), gib2(g).as_str()),
                (cpu, gpu),
                "{opt} {par} {init}"
            );
            assert_eq!(largest, 4 * l);
        }
    }

    /// Same page, `estimate_zero2_model_states_mem_needs_all_cold(2851e6,
    /// 8 GPUs)`: 127.45 GB per CPU for both rows, 5.31 GB per GPU with
    /// CPU offload. (Its no-offload GPU figure, 15.93, is from the older
    /// `4N + 16N/T` formula; today's code computes `2N + 18N/T`.)
    #[test]
    fn zero2_matches_deepspeed_docs() {
        let n = 2_851_000_000;
        let (c, g) = deepspeed::zero2(n, 8, 1, true, 1.5);
        assert_eq!((gib2(c).as_str(), gib2(g).as_str()), ("127.45", "5.31"));
        let (c, g) = deepspeed::zero2(n, 8, 1, false, 1.5);
        assert_eq!(gib2(c), "127.45");
        assert_eq!(g, 2 * n + 18 * n / 8);
    }

    /// Byte-exact figures of DeepSpeed 0.19.8's own functions (printed by
    /// `scripts/compare_estimate.py`'s DeepSpeed, run by hand):
    /// `estimate_zero3_model_states_mem_needs(N, L, G, 1, cpu_offload,
    /// cpu_offload_params, zero_init, 1.5)` for 7B on 1 GPU and 70B on 8,
    /// each with the largest unit tierzero assumes for it, and
    /// `estimate_zero2_model_states_mem_needs(7e9, 1, 1, cpu_offload, 1.5)`.
    #[test]
    fn matches_deepspeed_0_19_8_to_the_byte() {
        // (total params, largest layer, GPUs, (per CPU, per GPU) per row).
        type Case = (u64, u64, u64, [(u64, u64); 6]);
        let cases: [Case; 2] = [
            (
                7_000_000_000,
                212_121_213,
                1,
                [
                    (189_000_000_000, 848_484_852),
                    (189_000_000_000, 848_484_852),
                    (168_000_000_000, 14_848_484_852),
                    (168_000_000_000, 14_848_484_852),
                    (1_272_727_278, 126_848_484_852),
                    (42_000_000_000, 126_848_484_852),
                ],
            ),
            (
                70_000_000_000,
                985_915_493,
                8,
                [
                    (1_890_000_000_000, 3_943_661_972),
                    (3_360_000_000_000, 3_943_661_972),
                    (1_680_000_000_000, 21_443_661_972),
                    (3_360_000_000_000, 21_443_661_972),
                    (47_323_943_664, 161_443_661_972),
                    (3_360_000_000_000, 161_443_661_972),
                ],
            ),
        ];
        // DeepSpeed's row order: (optimizer cpu, params cpu, zero_init).
        let rows = [
            (true, true, true),
            (true, true, false),
            (true, false, true),
            (true, false, false),
            (false, false, true),
            (false, false, false),
        ];
        for (n, l, g, want) in cases {
            assert_eq!(assumed_largest_unit_numel(n), l);
            for ((opt, par, init), (cpu, gpu)) in rows.into_iter().zip(want) {
                let (c, gm, _) = deepspeed::zero3(n, l, g, 1, opt, par, init, 1.5);
                assert_eq!((c, gm), (cpu, gpu), "{n} {g} {opt} {par} {init}");
            }
        }
        assert_eq!(
            deepspeed::zero2(7_000_000_000, 1, 1, true, 1.5),
            (168_000_000_000, 14_000_000_000)
        );
        assert_eq!(
            deepspeed::zero2(7_000_000_000, 1, 1, false, 1.5),
            (42_000_000_000, 140_000_000_000)
        );
    }

    fn find(r: &Report, stage: u8, optimizer: Offload, params: Offload) -> &Estimate {
        r.estimates
            .iter()
            .find(|e| {
                (e.choice.stage.number(), e.choice.optimizer, e.choice.params)
                    == (stage, optimizer, params)
            })
            .unwrap()
    }

    #[test]
    fn stage_partitioning_per_rank() {
        let sw = settings("{}");
        let (n, l, ranks) = (1_000_000_000u64, 50_000_000u64, 4u64);
        let r = estimate(&inputs(n, l, ranks, sw), &machine(1 << 40, 1 << 40, None)).unwrap();
        let s = n / ranks;
        // On the CPU as the device, `offload_optimizer: none` is where
        // train runs Adam on the host, with the same plan as `cpu`: each
        // none row holds what the cpu row holds (its new param values and
        // staged gradients were left out), all of it the device's; stage
        // 0's as stage 1's.
        let total = |e: &Estimate| {
            e.per_rank.device_bytes + e.per_rank.pinned_bytes + e.per_rank.pageable_bytes
        };
        for stage in 1..=3 {
            let none = find(&r, stage, Offload::None, Offload::None);
            assert_eq!(
                total(none),
                total(find(&r, stage, Offload::Cpu, Offload::None)),
                "stage {stage}"
            );
            assert_eq!(none.per_rank.device_bytes, total(none), "stage {stage}");
        }
        assert_eq!(
            find(&r, 0, Offload::None, Offload::None).per_rank,
            find(&r, 1, Offload::None, Offload::None).per_rank
        );
        // Stages 0 and 1: the params replicated, the fp32 sums and the
        // optimizer state sharded (the trainer shards them at every stage),
        // the stepped sub-groups' new values (one lent, and the spare) and
        // the reduce's fp32 buffer of a unit (several ranks).
        let host_side = 4 * s + 12 * s + 2 * 2 * s + 4 * l;
        assert_eq!(
            find(&r, 1, Offload::None, Offload::None)
                .per_rank
                .device_bytes,
            2 * n + 2 * l + host_side
        );
        // Stage 3: params too, plus two gathered units.
        assert_eq!(
            find(&r, 3, Offload::None, Offload::None)
                .per_rank
                .device_bytes,
            2 * s + 2 * 2 * l + 2 * l + host_side
        );
        // Node totals are ranks × per rank.
        let e = find(&r, 3, Offload::Cpu, Offload::Cpu);
        assert_eq!(e.per_node.pinned_bytes, ranks * e.per_rank.pinned_bytes);
        // Stage 3, everything on the CPU: pinned = params, pageable = the
        // CPU optimizer's fp32 sums (heap memory), its state, stepped
        // sub-groups' new 16-bit values (one sub-group lent, and the
        // spare) and the reduce's fp32 buffer of one unit (several ranks);
        // the device holds only units.
        assert_eq!(e.per_rank.device_bytes, 6 * l);
        assert_eq!(e.per_rank.pinned_bytes, 2 * s);
        assert_eq!(
            e.per_rank.pageable_bytes,
            4 * s + 12 * s + 2 * 2 * s.min(1_000_000_000) + 4 * l
        );
        assert_eq!(e.per_rank.nvme_bytes, 0);
        // DeepSpeed's figure for the same choice is attached.
        let ds = e.deepspeed.unwrap();
        assert_eq!(ds.gpu_bytes, 4 * l);
        assert!(find(&r, 3, Offload::Nvme, Offload::Nvme)
            .deepspeed
            .is_none());
        assert!(find(&r, 0, Offload::None, Offload::None)
            .deepspeed
            .is_none());
    }

    /// With the optimizer state in host memory, the gradients held as bf16
    /// take 2 bytes, the rest 4, all in pageable memory, under a name and
    /// formula that say which; with it on the device they stay fp32 sums.
    #[test]
    fn bf16_gradients_held_as_they_came_take_two_bytes_in_host_memory() {
        let n = 1000u64;
        let grads = |bf16: u64| {
            let mut inp = inputs(n, 10, 1, settings("{}"));
            inp.bf16_grad_numel = bf16;
            let r = estimate(&inp, &machine(1 << 40, 1 << 40, None)).unwrap();
            let e = find(&r, 3, Offload::Cpu, Offload::Cpu).clone();
            // Less the state and the new 16-bit values (the one
            // sub-group lent, and the spare).
            let host = e.per_rank.pageable_bytes - 12 * n - 2 * 2 * n;
            let item = e
                .items
                .iter()
                .find(|i| i.tier == Tier::Pageable && i.what.contains("grad"))
                .map(|i| (i.what, i.tier, i.formula.clone()))
                .unwrap();
            let device = find(&r, 0, Offload::None, Offload::None)
                .per_rank
                .device_bytes;
            (host, item, device)
        };
        let (host, (what, tier, _), fp32_device) = grads(0);
        assert_eq!(
            (host, what, tier),
            (4 * n, "fp32 grad accumulators", Tier::Pageable)
        );
        let (host, (what, _, formula), device) = grads(n);
        assert_eq!(host, 2 * n);
        assert!(what.starts_with("bf16 gradients"), "{what}");
        assert_eq!(formula, "1000 × 2 B");
        // On the CPU as the device, offload_optimizer none holds them as
        // the host optimizer does (it is the host optimizer there).
        assert_eq!(fp32_device - device, 2 * n);
        let (host, (what, _, formula), _) = grads(600);
        assert_eq!(host, 400 * 4 + 600 * 2);
        assert!(what.contains("fp32") && what.contains("bf16"), "{what}");
        assert!(
            formula.starts_with("400 × 4 B") && formula.ends_with("600 × 2 B"),
            "{formula}"
        );
        // More than the partition (a stale count) is the partition.
        assert_eq!(grads(5 * n).0, 2 * n);
        // With the state on NVMe, the bound on the sums in host memory
        // counts 2 bytes an element when every group holds bf16, else 4.
        let bound = |bf16: u64| {
            let mut inp = inputs(n, 10, 1, settings("{}"));
            inp.bf16_grad_numel = bf16;
            let r = estimate(&inp, &machine(1 << 40, 1 << 40, None)).unwrap();
            let e = find(&r, 3, Offload::Nvme, Offload::Nvme);
            e.items
                .iter()
                .find(|i| i.tier == Tier::Pageable && i.what.contains("in host memory"))
                .map(|i| (i.what, i.bytes))
                .unwrap()
        };
        let (fp32_what, fp32_bytes) = bound(n - 1);
        let (bf16_what, bf16_bytes) = bound(n);
        assert!(fp32_what.starts_with("fp32") && bf16_what.starts_with("bf16"));
        assert_eq!(bf16_bytes * 2, fp32_bytes);
    }

    #[test]
    fn bf16_moments_and_fp32_params() {
        let sw = settings("{}");
        let mut inp = inputs(1000, 10, 1, sw);
        inp.moment_elem_bytes = 2;
        inp.param_elem_bytes = 4;
        let r = estimate(&inp, &machine(1 << 40, 1 << 40, None)).unwrap();
        // 4 (params) + 4 (grads) + 4 + 2 + 2 (master, m, v), one unit's
        // grads (10 × 4 B) and the new values of the sub-group lent and
        // the spare (2 × 1000 × 4 B).
        assert_eq!(
            find(&r, 0, Offload::None, Offload::None)
                .per_rank
                .device_bytes,
            16 * 1000 + 10 * 4 + 2 * 1000 * 4
        );
    }

    #[test]
    fn pinned_buffers_come_from_the_config() {
        let sw = settings(
            r#"{"gradient_clipping": 0, "zero_optimization": {"stage": 3, "sub_group_size": 1e8,
                "offload_param": {"device": "cpu", "buffer_count": 6, "buffer_size": 2e8, "max_in_cpu": 0},
                "offload_optimizer": {"device": "cpu", "buffer_count": 5}}}"#,
        );
        let (n, l) = (7_000_000_000u64, 200_000_000u64);
        let r = estimate(&inputs(n, l, 1, sw), &machine(1 << 40, 1 << 40, None)).unwrap();
        let e = find(&r, 3, Offload::Nvme, Offload::Nvme);
        let pinned: Vec<(&str, u64)> = e
            .items
            .iter()
            .filter(|i| i.tier == Tier::Pinned)
            .map(|i| (i.what, i.bytes))
            .collect();
        assert_eq!(
            pinned,
            vec![
                // Each buffer rounded up to 4 KiB, as the engine maps it.
                ("param swap-in buffers", 6 * 400_003_072),
                ("optimizer swap buffers", 5 * 400_003_072),
            ]
        );
        // No clipping, GA 1: the gradients neither spill nor park; only
        // params and state are on NVMe, each of the 70 sub-groups' three
        // state extents 4 KiB-aligned; and each of the two swap files'
        // alignment room, as the engine sizes them.
        assert_eq!(
            e.per_rank.nvme_bytes,
            n * 2 + 70 * 3 * 400_003_072 + 2 * crate::engine::sizing::SWAP_SLACK_BYTES
        );
        // Pipelined reads: 3 states × (1 + 1 read ahead) = 6 buffers, the
        // engine's rule (above buffer_count's 4), with a note. (Without
        // clipping: with it, the spilled gradient is a fourth.)
        let sw = settings(
            r#"{"gradient_clipping": 0, "zero_optimization": {"stage": 3, "sub_group_size": 1e8,
                "offload_optimizer": {"device": "cpu", "pipeline_read": true}}}"#,
        );
        let r = estimate(&inputs(n, l, 1, sw), &machine(1 << 40, 1 << 40, None)).unwrap();
        let e = find(&r, 3, Offload::Nvme, Offload::None);
        let opt = e
            .items
            .iter()
            .find(|i| i.what == "optimizer swap buffers")
            .unwrap();
        assert_eq!(opt.bytes, 6 * 400_003_072);
        assert!(r
            .notes
            .iter()
            .any(|n| n.contains("below the 6 buffers the optimizer pipeline needs")));
        // pin_memory false moves them to pageable.
        let sw = settings(
            r#"{"zero_optimization": {"stage": 3,
                "offload_optimizer": {"device": "cpu", "pin_memory": false}}}"#,
        );
        let r = estimate(&inputs(n, l, 1, sw), &machine(1 << 40, 1 << 40, None)).unwrap();
        let e = find(&r, 3, Offload::Cpu, Offload::None);
        assert!(e
            .items
            .iter()
            .filter(|i| i.what == "fp32 grad accumulators")
            .all(|i| i.tier == Tier::Pageable));
    }

    /// `tierzero.overlap_optimizer: false` with the state on NVMe: the
    /// engine holds every sub-group's gradients until the step
    /// (`grads_held_until_step`), and so does the estimate; it counted
    /// the overlapped bound (7 sub-groups of 1e8 instead of 70).
    #[test]
    fn not_overlapped_holds_every_gradient_until_the_step() {
        let cfg = |overlap: bool| {
            settings(&format!(
                r#"{{"gradient_clipping": 0, "zero_optimization": {{"stage": 3, "sub_group_size": 1e8,
                    "offload_param": {{"device": "cpu"}}, "offload_optimizer": {{"device": "cpu"}}}},
                    "tierzero": {{"overlap_optimizer": {overlap}}}}}"#
            ))
        };
        let n = 7_000_000_000;
        let grads = |sw: SwapSettings| {
            let inp = inputs(n, assumed_largest_unit_numel(n), 1, sw);
            let r = estimate(&inp, &machine(8 * GIB, 500 * GIB, None)).unwrap();
            let e = find(&r, 3, Offload::Nvme, Offload::Nvme);
            e.items
                .iter()
                .find(|i| i.what == "fp32 grads in host memory (at most)")
                .map(|i| i.bytes)
                .unwrap()
        };
        assert_eq!(grads(cfg(true)), 7 * 100_000_000 * 4);
        assert_eq!(grads(cfg(false)), n * 4);
    }

    /// 7B without a GPU (the CPU is the device) and with 500 GiB of NVMe:
    /// on 8 GiB of RAM only stage 3 with everything on NVMe fits (under
    /// 7 GiB of RAM with a moderate `sub_group_size`); on 24 GiB the 16-bit
    /// params (13 GiB) can stay in RAM and only the optimizer goes to NVMe.
    /// The CPU-offload choices need over 100 GiB of RAM.
    #[test]
    fn seven_b_fits_in_small_ram_with_nvme_offload() {
        // No clipping (DeepSpeed's default clips at 1.0).
        let sw = settings(
            r#"{"gradient_clipping": 0, "zero_optimization": {"stage": 3, "sub_group_size": 5e7,
                "offload_param": {"device": "cpu", "max_in_cpu": 0},
                "offload_optimizer": {"device": "cpu"}}}"#,
        );
        let n = 7_000_000_000;
        let inp = inputs(n, assumed_largest_unit_numel(n), 1, sw);
        let nvme_only = Choice {
            stage: Stage::Parameters,
            optimizer: Offload::Nvme,
            params: Offload::Nvme,
        };
        let r = estimate(&inp, &machine(8 * GIB, 500 * GIB, None)).unwrap();
        assert_eq!(r.recommended, Some(nvme_only));
        let e = find(&r, 3, Offload::Nvme, Offload::Nvme);
        // Host fp32 grads at most (unit 5 + 2, handed over 2) x 5e7 x 4 B.
        let grads = e
            .items
            .iter()
            .find(|i| i.what == "fp32 grads in host memory (at most)")
            .unwrap();
        assert_eq!(grads.bytes, 9 * 50_000_000 * 4, "{}", grads.formula);
        assert!(e.node_ram_bytes < 7 * GIB, "{}", e.node_ram_bytes);
        assert_eq!(
            e.per_rank.pinned_bytes,
            // 4 KiB-aligned buffers, as the engine maps them.
            5 * 200_003_584 + 4 * 200_003_584
        );
        let m = machine(24 * GIB, 500 * GIB, None);
        let r = estimate(&inp, &m).unwrap();
        assert_eq!(
            r.recommended,
            Some(Choice {
                stage: Stage::Parameters,
                optimizer: Offload::Nvme,
                params: Offload::None
            })
        );
        assert!(find(&r, 3, Offload::Nvme, Offload::Nvme).fit.fits);
        assert!(!find(&r, 3, Offload::Cpu, Offload::Cpu).fit.fits);
        assert!(find(&r, 3, Offload::Cpu, Offload::Cpu).node_ram_bytes > 100 * GIB);
        // Not enough disk: nothing fits; the closest is all on NVMe with the
        // params in RAM (78.2 GiB of NVMe state for 75 GiB free).
        let r = estimate(&inp, &machine(24 * GIB, 75 * GIB, None)).unwrap();
        assert_eq!(r.recommended, None);
        assert_eq!(
            r.closest,
            Some(Choice {
                stage: Stage::Parameters,
                optimizer: Offload::Nvme,
                params: Offload::None
            })
        );
        let e = find(&r, 3, Offload::Nvme, Offload::None);
        assert!(e.fit.max_use_ratio > 1.0 && e.fit.max_use_ratio < 1.1);
        // With DeepSpeed's default sub_group_size (1e9) the optimizer swap
        // buffers alone are 4 × 1e9 × 4 B = 14.9 GiB pinned.
        let r = estimate(
            &inputs(n, assumed_largest_unit_numel(n), 1, settings("{}")),
            &m,
        )
        .unwrap();
        let e = find(&r, 3, Offload::Nvme, Offload::Nvme);
        assert_eq!(
            e.per_rank.pinned_bytes,
            5 * 200_003_584 + 1_000_000_000 * 2 + 4 * 4_000_002_048
        );
    }

    #[test]
    fn gpu_machine_prefers_least_offload() {
        let sw = settings("{}");
        let n = 1_000_000_000;
        let inp = inputs(n, 50_000_000, 1, sw);
        // 80 GiB GPU: stage 0, nothing offloaded (18 GB).
        let r = estimate(&inp, &machine(256 * GIB, 1 << 40, Some(80 * GIB))).unwrap();
        assert_eq!(
            r.recommended.unwrap(),
            Choice {
                stage: Stage::Disabled,
                optimizer: Offload::None,
                params: Offload::None
            }
        );
        // 8 GiB GPU: the optimizer goes to the CPU, params stay.
        let r = estimate(&inp, &machine(256 * GIB, 1 << 40, Some(8 * GIB))).unwrap();
        let rec = r.recommended.unwrap();
        assert_eq!((rec.optimizer, rec.params), (Offload::Cpu, Offload::None));
        assert!(r.notes.iter().all(|n| !n.contains("device memory unknown")));
    }

    /// On a GPU, `offload_optimizer: none` is accounted where train runs
    /// Adam: on the device with nothing offloaded (the device optimizer's
    /// bytes, and the host's copies of the state and the params, which can
    /// be what does not fit), on the host otherwise (fp16 here).
    #[test]
    fn a_gpu_s_optimizer_none_is_where_train_runs_adam() {
        let (n, l) = (2_000_000_000u64, 100_000_000u64);
        let mut inp = inputs(n, l, 1, settings(r#"{"bf16": {"enabled": true}}"#));
        inp.largest_tensor_numel = Some(l);
        let m = machine(24 * GIB, 500 * GIB, Some(80 * GIB));
        let r = estimate(&inp, &m).unwrap();
        let e = find(&r, 0, Offload::None, Offload::None);
        // bf16 weights 2 B, fp32 masters 4, m and v 8, and the sums with
        // the workspace: (N + the largest unit + 3 largest params) × 4 B.
        assert_eq!(e.per_rank.device_bytes, 14 * n + 4 * (n + l + 3 * l));
        // The host's copy of master, m and v, and the param store's.
        assert_eq!(e.per_rank.pageable_bytes, 12 * n + 2 * n);
        assert_eq!(e.fit.host, Verdict::TooSmall);
        assert_ne!(
            r.recommended.map(|c| (c.optimizer, c.params)),
            Some((Offload::None, Offload::None))
        );
        // fp16: Adam stays on the host, as with offload_optimizer cpu.
        inp.device_adam_refusal = Some("fp16.enabled".into());
        let r = estimate(&inp, &m).unwrap();
        let none = find(&r, 2, Offload::None, Offload::None);
        let cpu = find(&r, 2, Offload::Cpu, Offload::None);
        assert_eq!(none.per_rank, cpu.per_rank);
        assert!(none
            .items
            .iter()
            .any(|i| i.formula.contains("fp16.enabled")));
        // Params offloaded: the host too, whatever the precision.
        inp.device_adam_refusal = None;
        let r = estimate(&inp, &m).unwrap();
        assert_eq!(
            find(&r, 3, Offload::None, Offload::Cpu).per_rank,
            find(&r, 3, Offload::Cpu, Offload::Cpu).per_rank
        );
        // The param store's host copy is there whoever runs Adam (stage 1,
        // the optimizer on the CPU: the state, the sums and the params).
        let host_adam = find(&r, 1, Offload::Cpu, Offload::None);
        assert!(host_adam
            .items
            .iter()
            .any(|i| i.what == "params host copy (the param store)" && i.bytes == 2 * n));
        // Several ranks: each rank's store holds its shards, whatever the
        // stage (they are handed out and gathered).
        let mut four = inp.clone();
        four.ranks = 4;
        let r4 = estimate(&four, &m).unwrap();
        let s = n / 4;
        assert_eq!(
            find(&r4, 0, Offload::None, Offload::None)
                .per_rank
                .pageable_bytes,
            12 * s + 2 * s
        );
        // Without a GPU (the CPU computes), Adam runs on the host as with
        // offload_optimizer cpu, all of it the device's: the params, one
        // unit's grads, the sums, the state and the stepped sub-groups'
        // new values (a unit's two sub-groups lent, and the spare: 3 ×
        // sub_group_size 1e9 × 2 B).
        let r = estimate(&inp, &machine(1 << 40, 1 << 40, None)).unwrap();
        let none = find(&r, 0, Offload::None, Offload::None);
        let items: Vec<_> = none
            .items
            .iter()
            .map(|i| (i.what, i.bytes, i.formula.clone()))
            .collect();
        assert_eq!(
            none.per_rank.device_bytes,
            2 * n + 2 * l + 4 * n + 12 * n + 3 * 1_000_000_000 * 2,
            "{items:?}"
        );
    }

    #[test]
    fn memlock_flag_and_bad_inputs() {
        let sw = settings("{}");
        let mut m = machine(1 << 40, 1 << 40, None);
        m.memlock = Some(Memlock::Bytes(8 << 20));
        let r = estimate(&inputs(1_000_000_000, 1_000_000, 1, sw), &m).unwrap();
        assert!(
            find(&r, 3, Offload::Nvme, Offload::Nvme)
                .fit
                .pinned_over_memlock
        );
        assert!(
            !find(&r, 0, Offload::None, Offload::None)
                .fit
                .pinned_over_memlock
        );
        assert_eq!(
            estimate(&inputs(10, 1, 0, sw), &m).unwrap_err(),
            EstimateError::Zero { what: "--ranks" }
        );
        assert!(matches!(
            estimate(&inputs(10, 11, 1, sw), &m),
            Err(EstimateError::LargestExceedsTotal { .. })
        ));
        assert!(matches!(
            estimate(&inputs(u64::MAX / 2, 1, 1, sw), &m),
            Err(EstimateError::Overflow { .. })
        ));
    }

    #[test]
    fn assumed_unit_is_close_to_real_models() {
        // Llama-2-7B block: 202M; Llama-2-70B block: 856M (GQA); GPT-3 175B: 1.81B.
        let l7 = assumed_largest_unit_numel(7_000_000_000);
        assert!((190_000_000..230_000_000).contains(&l7), "{l7}");
        let l175 = assumed_largest_unit_numel(175_000_000_000);
        assert!((1_600_000_000..2_000_000_000).contains(&l175), "{l175}");
        assert_eq!(assumed_largest_unit_numel(1), 1);
    }

    #[test]
    fn proc_parsers() {
        let (t, a) = parse_meminfo(
            "MemTotal:       24576000 kB\nMemFree: 1 kB\nMemAvailable:   12000000 kB\n",
        );
        assert_eq!(t, Some(24_576_000 * 1024));
        assert_eq!(a, Some(12_000_000 * 1024));
        assert_eq!(parse_meminfo("garbage"), (None, None));
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \nMax locked memory         8388608              8388608              bytes     \n";
        assert_eq!(parse_memlock(limits), Some(Memlock::Bytes(8 << 20)));
        assert_eq!(
            parse_memlock(
                "Max locked memory         unlimited            unlimited            bytes"
            ),
            Some(Memlock::Unlimited)
        );
        assert_eq!(parse_memlock("nothing"), None);
    }
}

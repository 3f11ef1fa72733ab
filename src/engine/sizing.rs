//! The one sizing policy: from a validated [`Config`] and the model's shape
//! on one rank, where every param lives and how much memory each tier
//! gets.
//!
//! [`decide`] is the only place these numbers are computed:
//!
//! - each param's home tier ([`Tier`]): the device below stage 3 or
//!   without `offload_param`; pinned host memory with `offload_param:
//!   cpu`; with `nvme`, pinned host memory for params in `ParamId` order
//!   while their elements fit `offload_param.max_in_cpu`, NVMe for the rest
//!   (DeepSpeed's `max_in_cpu` rule);
//! - the pinned pages of the cpu tier ([`cpu_page_plan`]);
//! - the param swap-in buffers ([`param_buffers`]): `buffer_count` (at
//!   least 1) buffers of `buffer_size` elements, rounded up to 4 KiB, when
//!   any param lives on NVMe, mapped cut into slots of the largest NVMe
//!   shard ([`param_slots`]; never more bytes than configured);
//! - whether final gradients spill to NVMe ([`spills_grads`]);
//! - which optimizer sub-groups keep their state in host memory
//!   ([`resident_groups`]) and which groups hold their gradients instead of
//!   spilling them ([`held_grad_bound`]);
//! - the optimizer swap buffers ([`optimizer_buffers`]): what the pipeline
//!   needs ([`buffers_needed`]) or `buffer_count` if more, each the
//!   largest sub-group's fp32 state rounded up to 4 KiB, capped by what
//!   `tierzero.pinned_budget_bytes` leaves after the param buffers;
//! - the NVMe bytes of the swap files, and the bytes to page-lock;
//! - how the host holds each sub-group's gradients for the CPU optimizer
//!   ([`grad_sum_dtype`]): fp32 sums, or the bf16 gradients themselves
//!   where each element gets exactly one a step;
//! - which params persist (never released: [`persistent_params`],
//!   DeepSpeed's two persistence thresholds) and the host bytes the
//!   offloaded ones hold beside their homes ([`persistent_total`]).
//!
//! `Trainer::build` maps exactly what it returns; the start-up plan
//! ([`crate::run::Plan`]) prints the [`Sizing`] the trainer was built
//! with; the config's budget check and `tierzero estimate` call the same
//! functions on an estimated [`Shape`] (the model's size, not its layout).
//! A test checks that the plan's pinned total is the bytes the arenas
//! mapped.
//!
//! A budget too small for the buffers is [`BudgetShort`], with every
//! number in it; callers turn it into their own error
//! ([`crate::engine::EngineError::PinnedBudget`],
//! `ConfigError::PinnedBudgetTooSmall`).

use crate::config::{Config, OffloadDevice, Stage};
use crate::engine::layout::Layout;
use crate::engine::params::prefetch::Prefetcher;
use crate::engine::params::store::Tier;
use crate::model::Model;

mod grads;
mod head;
mod pages;
mod persistent;
mod speculation;
mod swap;
pub use grads::{
    backward_staging_bytes, bf16_grad_numel, grad_spill_step_bytes, grad_sum_dtype,
    grads_in_flight, host_grad_bound_bytes, host_grad_bound_groups, largest_unit_groups,
    nvme_state_grad_bound_bytes, nvme_state_grad_bound_groups, tied_numel, values_buffers,
    values_in_flight, SumDtype,
};
pub use head::{check_logits_memory, logits_bytes, TRAIN_LOGITS_COPIES};
pub use pages::{cpu_page_places, cpu_page_plan};
pub use persistent::{persistent_in_order, persistent_params, persistent_total};
pub use speculation::{
    speculation_kept_grads, speculation_pool, speculation_slots, SpeculationAsk, SpeculationPool,
};
pub use swap::{available_bytes_at, nearest_existing, same_file_system, SwapUse, SWAP_SLACK_BYTES};

/// Alignment of NVMe extents and pinned buffers (O_DIRECT).
pub const ALIGN_BYTES: u64 = 4096;

/// `bytes` rounded up to [`ALIGN_BYTES`] (at least one block); a count
/// too close to `u64::MAX` to round up gives the largest multiple
/// (sizes that large fail later, at the budget or the mapping, with their
/// numbers; they never wrap to a small one).
pub fn align_up(bytes: u64) -> u64 {
    bytes
        .max(1)
        .div_ceil(ALIGN_BYTES)
        .saturating_mul(ALIGN_BYTES)
        .min(u64::MAX / ALIGN_BYTES * ALIGN_BYTES)
}

/// Bytes of fp32 optimizer state per element: master, m and v.
pub const STATE_BYTES_PER_ELEM: u64 = 12;

/// Bytes of a sub-group's three states (master, m, v) before alignment,
/// each at least one element's: the fp32 master, and the moments in
/// `moments`. The optimizer state's extents, reads and writes, and a
/// binding's swap-space capacity, all take their lengths from here.
pub fn state_bytes(numel: usize, moments: crate::optim::MomentDtype) -> [u64; 3] {
    // Saturating: a count no disk holds is refused by the space's size
    // check, not an overflow here.
    let n = numel.max(1) as u64;
    let mb = n.saturating_mul(moments.bytes_per_elem());
    [n.saturating_mul(4), mb, mb]
}

/// Host memory this process may still take: `MemAvailable` from
/// `/proc/meminfo`, and within its memory cgroup's limit where one is set
/// (a container's: `MemAvailable` is the whole host's), if readable.
pub fn mem_available_bytes() -> Option<u64> {
    crate::estimate::probe_ram().1
}

/// Device bytes the blocks' forwards kept from their forward to their
/// backward may hold together (`tierzero.activation_budget_bytes` on a
/// compute device; see "Kept forwards" in [`crate::engine::device`]):
///
/// * `"auto"`: half of `room_bytes`, what the device has left for a unit's
///   activations and temporaries once everything else is placed (the
///   other half is the working set of the unit computing); where that is
///   host memory (`room_bytes` None: the simulated device), half of
///   `host_available_bytes`, as on the CPU;
/// * a byte count (0: every block recomputed): refused when more than
///   `room_bytes`, since the unit computing would then find no memory;
/// * activation checkpointing: 0.
pub fn device_forward_budget_bytes(
    budget: crate::config::ActivationBudget,
    room_bytes: Option<u64>,
    host_available_bytes: Option<u64>,
) -> Result<u64, String> {
    use crate::config::ActivationBudget;
    match budget {
        ActivationBudget::Checkpointing => Ok(0),
        ActivationBudget::Auto => Ok(room_bytes.or(host_available_bytes).unwrap_or(0) / 2),
        ActivationBudget::Bytes(b) => match room_bytes {
            Some(room) if b > room => Err(format!(
                "tierzero.activation_budget_bytes is {b}, and the device has {room} bytes left \
                 for activations and temporaries; set it to at most {room}, or to \"auto\" \
                 ({}: half of that, the other half for the unit computing)",
                room / 2
            )),
            _ => Ok(b),
        },
    }
}

/// Most sub-groups an estimated [`Shape`] lists.
const MAX_ESTIMATED_GROUPS: u64 = 1 << 20;

/// What sizing needs to know of a model on one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shape {
    /// This rank's elements of each param, in `ParamId` order.
    pub param_shard_numel: Vec<u64>,
    /// The optimizer sub-groups, in index order.
    pub sub_groups: Vec<GroupShape>,
    /// Whether `param_shard_numel` are the real shards ([`Shape::of`]), so
    /// the param swap buffers are cut into slots of the largest
    /// ([`param_slots`]); an estimated shape's are stand-ins, and sizing
    /// counts the configured buffers, the most the slots can take.
    pub exact_shards: bool,
}

/// One optimizer sub-group as sizing sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupShape {
    /// Elements of the group (this rank's shards of its params).
    pub numel: u64,
    /// Whether it holds a param of the next forward's first units
    /// ([`Prefetcher::first_units`]), whose state may stay resident.
    pub first_units: bool,
    /// How the host holds its gradients ([`grad_sum_dtype`]; fp32 in an
    /// estimated shape, the most it can take).
    pub sum_dtype: SumDtype,
}

impl Shape {
    /// The exact shape of a model laid out on one rank.
    pub fn of(config: &Config, model: &Model, layout: &Layout) -> Shape {
        let first = Prefetcher::first_units(model, config.zero.prefetch_bucket_numel.0);
        Shape {
            param_shard_numel: layout.params.iter().map(|s| s.shard_numel as u64).collect(),
            sub_groups: layout
                .sub_groups
                .iter()
                .map(|g| GroupShape {
                    numel: g.numel as u64,
                    first_units: g
                        .param_ids()
                        .any(|p| first.get(p.0).copied().unwrap_or(false)),
                    sum_dtype: grad_sum_dtype(config, model, layout.world, g),
                })
                .collect(),
            exact_shards: true,
        }
    }

    /// The shape of a model known only by its size: `per_rank_numel`
    /// elements on this rank, the largest param (if known) first and the
    /// rest in params of `sub_group_numel`; the sub-groups tile all of
    /// them in order, `sub_group_numel` each, as a real layout packs and
    /// tiles params (`crate::engine::layout`), and those holding the
    /// largest param count as the first units' (it is the embedding). The
    /// largest sub-group is thus `min(sub_group_size, elements)`, whatever
    /// the largest param.
    pub fn estimated(
        per_rank_numel: u64,
        largest_param_numel: Option<u64>,
        sub_group_numel: u64,
    ) -> Shape {
        let mut params = Vec::new();
        let mut sub_groups = Vec::new();
        let mut left = per_rank_numel;
        // At most 2^20 groups stand for the rest: a `sub_group_size` so
        // small that more would be needed is counted as if it were
        // `elements / 2^20` (bounded work for any model).
        let chunk = sub_group_numel
            .max(1)
            .max(per_rank_numel.div_ceil(MAX_ESTIMATED_GROUPS));
        // The largest param (`l`) first, then the rest in params of
        // `chunk`; the sub-groups tile them all in order, as a layout packs
        // params into sub-groups of `sub_group_size` (the largest param's
        // last tile shares its group with what follows: alone, it made
        // the largest group smaller than a whole model that fits one, and
        // the config's pinned-budget check asked for less than the run's).
        let l = largest_param_numel.unwrap_or(0).min(left);
        if l > 0 {
            params.push(l);
            left -= l;
        }
        while left > 0 {
            let n = chunk.min(left);
            params.push(n);
            left -= n;
        }
        let mut offset = 0;
        while offset < per_rank_numel {
            let n = chunk.min(per_rank_numel - offset);
            sub_groups.push(GroupShape {
                numel: n,
                // Holding (part of) the largest param, the embedding, or
                // the first group.
                first_units: offset == 0 || offset < l,
                sum_dtype: SumDtype::F32,
            });
            offset += n;
        }
        Shape {
            param_shard_numel: params,
            sub_groups,
            exact_shards: false,
        }
    }

    /// Elements on this rank.
    pub fn numel(&self) -> u64 {
        self.param_shard_numel.iter().sum()
    }

    /// Elements of the largest sub-group.
    pub fn max_sub_group_numel(&self) -> u64 {
        self.sub_groups.iter().map(|g| g.numel).max().unwrap_or(0)
    }

    /// Bytes of the largest sub-group's gradients on the host
    /// ([`GroupShape::sum_dtype`]).
    pub fn max_sum_bytes(&self) -> u64 {
        self.sub_groups
            .iter()
            .map(|g| g.numel.saturating_mul(g.sum_dtype.bytes_per_elem()))
            .max()
            .unwrap_or(0)
    }
}

/// A set of equal buffers (or pages).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Buffers {
    /// How many.
    pub count: u64,
    /// Bytes of each.
    pub bytes_each: u64,
}

impl Buffers {
    /// None at all.
    pub const NONE: Buffers = Buffers {
        count: 0,
        bytes_each: 0,
    };

    /// `count × bytes_each`.
    pub fn total_bytes(&self) -> u64 {
        self.count.saturating_mul(self.bytes_each)
    }
}

/// Everything [`decide`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sizing {
    /// Home tier of each param, in `ParamId` order.
    pub tiers: Vec<Tier>,
    /// Bytes of one stored param element (2, or 4 in an fp32 run).
    pub param_elem_bytes: u64,
    /// Pinned pages of the cpu tier.
    pub cpu_pages: Buffers,
    /// Param swap-in slots, as the arena maps them (none without NVMe
    /// params): the configured buffers cut by [`param_slots`].
    pub param_buffers: Buffers,
    /// Optimizer swap buffers (none without NVMe optimizer state).
    pub optimizer_buffers: Buffers,
    /// Optimizer buffers the pipeline needs at the least.
    pub optimizer_buffers_needed: u64,
    /// `offload_optimizer.pipeline_read`: sub-groups read ahead.
    pub read_ahead: usize,
    /// `offload_optimizer.pipeline_write`: sub-groups written behind.
    pub write_behind: usize,
    /// Whether final gradients are spilled to NVMe until the step.
    pub spill_grads: bool,
    /// Whether sub-groups step speculatively during backward
    /// ([`speculates`]): a speculative step writes its new state into a
    /// slot of a bounded pool of state extents, committed or dropped once
    /// the global norm is known.
    pub speculative: bool,
    /// With `speculative`: the pool's slots ([`speculation_pool`]),
    /// the most sub-groups a step speculates (the others wait for the
    /// decision). 0 without speculation.
    pub speculation_slots: usize,
    /// With `speculative`: the most speculated gradients the optimizer
    /// thread keeps in host memory for a re-step
    /// ([`speculation_kept_grads`]); the others are spilled.
    pub speculation_kept_grads: usize,
    /// NVMe bytes of the speculation pool (in `optimizer_nvme_bytes`):
    /// `speculation_slots` sets of three extents of the largest NVMe
    /// sub-group.
    pub speculation_pool_nvme_bytes: u64,
    /// `tierzero.speculative_step` auto turned off because its least pool
    /// (these bytes) does not fit the free space left on the optimizer
    /// state's file system ([`speculation_pool`]); `None`
    /// otherwise.
    pub speculation_off_for_room_bytes: Option<u64>,
    /// Per sub-group: its optimizer state stays in host memory.
    pub resident_groups: Vec<bool>,
    /// With `spill_grads`: sub-groups below this index hold their final
    /// gradients in memory (0 without spilling).
    pub held_grad_groups: usize,
    /// NVMe bytes of the param extents.
    pub param_nvme_bytes: u64,
    /// NVMe bytes of the optimizer state extents (master, m, v).
    pub optimizer_nvme_bytes: u64,
    /// NVMe bytes of the spilled-gradient extents.
    pub grad_spill_nvme_bytes: u64,
    /// Whether partial gradient sums are parked on NVMe between
    /// micro-batches ([`parks_grads`]).
    pub park_grads: bool,
    /// The park's pinned buffers (none without parking).
    pub park_buffers: Buffers,
    /// NVMe bytes of the park's extents.
    pub grad_park_nvme_bytes: u64,
    /// Bytes the run would page-lock (offload blocks with `pin_memory`).
    pub lock_bytes: u64,
    /// NVMe optimizer state with `tierzero.overlap_optimizer: false`:
    /// every sub-group's gradient is held in host memory until the step
    /// after backward (nothing is stepped or spilled during it), as
    /// DeepSpeed holds the partition's gradients. The host bound is then
    /// the whole shard's ([`host_grad_bound_groups`]).
    pub grads_held_until_step: bool,
}

impl Sizing {
    /// Pinned host memory mapped: cpu-tier pages and both sets of swap
    /// buffers (page-locked or not, by `pin_memory`).
    pub fn pinned_total_bytes(&self) -> u64 {
        [
            self.cpu_pages,
            self.param_buffers,
            self.optimizer_buffers,
            self.park_buffers,
        ]
        .iter()
        .fold(0u64, |sum, b| sum.saturating_add(b.total_bytes()))
    }

    /// Bytes of optimizer state (fp32 master, m and v) kept in host memory:
    /// every sub-group's, or with the state on NVMe (`opt_nvme`) the
    /// resident ones' ([`Sizing::resident_groups`]).
    pub fn optimizer_host_bytes(&self, shape: &Shape, opt_nvme: bool) -> u64 {
        shape
            .sub_groups
            .iter()
            .enumerate()
            .filter(|(i, _)| !opt_nvme || self.resident_groups.get(*i).copied().unwrap_or(false))
            .map(|(_, g)| g.numel.saturating_mul(STATE_BYTES_PER_ELEM))
            .fold(0u64, u64::saturating_add)
    }

    /// Whether any param lives on NVMe.
    pub fn params_on_nvme(&self) -> bool {
        self.tiers.contains(&Tier::Nvme)
    }

    /// Sub-groups whose state stays in host memory.
    pub fn resident_group_count(&self) -> usize {
        self.resident_groups.iter().filter(|r| **r).count()
    }
}

/// `tierzero.pinned_budget_bytes` is too small for the swap buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetShort {
    /// The configured budget.
    pub budget_bytes: u64,
    /// The param swap-in slots ([`param_slots`] of [`param_buffers`]).
    pub param_buffers: Buffers,
    /// Optimizer buffers the pipeline needs, and bytes of each.
    pub optimizer_buffers_needed: Buffers,
    /// Pipeline stages that hold buffers at once.
    pub optimizer_stages: u64,
    /// Whether each stage holds a sub-group's spilled gradient beside its
    /// 3 states ([`spills_grads`]).
    pub optimizer_spills_grads: bool,
    /// The gradient park's buffers ([`parks_grads`]).
    pub park_buffers: Buffers,
    /// The smallest budget that works.
    pub required_bytes: u64,
}

/// Buffers a pipeline with these depths needs: 3 states per sub-group, 4
/// when gradients are spilled to NVMe and read back with the state.
pub fn buffers_needed(read_ahead: usize, write_behind: usize, spill_grads: bool) -> usize {
    (3 + usize::from(spill_grads)) * (1 + read_ahead + write_behind)
}

/// The param swap-in slots a pinned budget leaves room for: `slots` (the
/// shard slots the buffers cut into) cut to what `budget_bytes` holds
/// beside `beside_bytes` (the parked sums' buffers and the optimizer
/// pipeline's least), never below `configured_count` (`buffer_count`):
/// the slots beyond it are a speed-up. No budget: `slots`. The engine's
/// sizing and `tierzero estimate` both ask this.
pub fn param_slots_within(
    slots: Buffers,
    configured_count: u64,
    budget_bytes: Option<u64>,
    beside_bytes: u64,
) -> Buffers {
    match budget_bytes {
        Some(b) if slots.count > configured_count => Buffers {
            count: (b.saturating_sub(beside_bytes) / slots.bytes_each.max(1))
                .clamp(configured_count, slots.count),
            ..slots
        },
        _ => slots,
    }
}

/// Final gradients spill to NVMe (and are read back with the state) when
/// the state is on NVMe, the optimizer overlaps backward, and the step must
/// wait for the global norm (clipping, or the overflow check of fp16 and,
/// by default, bf16: [`Config::waits_for_global_norm`]).
pub fn spills_grads(config: &Config) -> bool {
    config.zero.offload_optimizer.device.nvme_path().is_some() && spills_with_nvme_state(config)
}

/// [`spills_grads`] whatever the optimizer's device: whether gradients
/// would spill were the state on NVMe (`tierzero estimate` asks it of
/// every offload choice).
pub fn spills_with_nvme_state(config: &Config) -> bool {
    config.tierzero.overlap_optimizer && config.waits_for_global_norm()
}

/// [`speculation_ask`] whatever the optimizer's device, as
/// [`spills_with_nvme_state`].
pub fn speculation_ask_with_nvme_state(config: &Config) -> SpeculationAsk {
    SpeculationAsk::new(
        spills_with_nvme_state(config),
        config.tierzero.speculative_step,
        config.tierzero.speculation_pool_bytes.map(|b| b.0),
    )
}

/// Partial gradient sums are parked on NVMe between micro-batches
/// (`crate::engine::grads`) when there are several micro-batches and the
/// optimizer state is on NVMe: host memory then holds only the sums being
/// added into. (With the state in host memory, 12 bytes per element of it
/// are there anyway, and the 4 of the sums stay beside them.)
pub fn parks_grads(config: &Config) -> bool {
    config.zero.offload_optimizer.device.nvme_path().is_some()
        && config.batch.gradient_accumulation_steps > 1
}

/// Sub-groups step speculatively during backward, assuming no clip and no
/// overflow: when gradients spill ([`spills_grads`]: the step must wait for
/// the global norm) and `tierzero.speculative_step` is not `false`.
pub fn speculates(config: &Config) -> bool {
    speculation_ask(config) != SpeculationAsk::Off
}

/// What `config` asks of the speculation pool, where it speculates
/// ([`speculates`]).
pub fn speculation_ask(config: &Config) -> SpeculationAsk {
    SpeculationAsk::new(
        spills_grads(config),
        config.tierzero.speculative_step,
        config.tierzero.speculation_pool_bytes.map(|b| b.0),
    )
}

/// The gradient park's pinned buffers ([`parks_grads`]): a fixed count,
/// each one largest sub-group of fp32 sums, 4 KiB-aligned.
pub fn park_buffers(max_group_numel: u64) -> Buffers {
    Buffers {
        count: crate::engine::grads::PARK_BUFFERS,
        bytes_each: align_up(max_group_numel.saturating_mul(4)),
    }
}

/// The param swap-in buffers as configured: `buffer_count` (at least 1)
/// buffers of `buffer_size` elements of `elem_bytes`, each rounded up to
/// 4 KiB: the most pinned memory the params' swap maps. The config's
/// budget check and `tierzero estimate` count it where the shards are not
/// known; [`decide`] maps it as [`param_slots`].
pub fn param_buffers(buffer_count: u64, buffer_numel: u64, elem_bytes: u64) -> Buffers {
    Buffers {
        count: buffer_count.max(1),
        bytes_each: align_up(buffer_numel.saturating_mul(elem_bytes)),
    }
}

/// The slots the param swap arena cuts `configured` ([`param_buffers`])
/// into: each the largest NVMe shard (`largest_shard_bytes`, 4 KiB-aligned)
/// instead of `buffer_size`, as many as fit in each configured buffer,
/// and at most two per NVMe param (`nvme_params`: one read and one
/// write-back each is the most any param has in flight). Never more bytes
/// than configured, never fewer slots; a shard larger than `buffer_size`
/// keeps the configured buffers (the store then refuses that param with
/// both numbers).
///
/// Why: a swap buffer holds one shard while its read or write-back is in
/// flight, so `buffer_count` buffers bound the shards in flight, however
/// small they are. DeepSpeed's default 5 buffers of 1e8 elements hold 5
/// shards; on the GPT-2 of `scripts/compare_torch.py` (52 shards of at most
/// 148,608 elements, 5 × 4e6-element buffers) the compute thread waited for
/// a write-back to free a buffer for 17 ms of a 127 ms step, and the NVMe
/// step was 1.14× the in-memory step; cut into 576 KiB slots it was 1.05×
/// (`docs/decisions/param-swap-slots.md`).
pub fn param_slots(configured: Buffers, largest_shard_bytes: u64, nvme_params: u64) -> Buffers {
    let slot = align_up(largest_shard_bytes);
    if configured.count == 0 || slot >= configured.bytes_each {
        return configured;
    }
    let per_buffer = configured.bytes_each / slot;
    let count = configured
        .count
        .saturating_mul(per_buffer)
        .min(nvme_params.saturating_mul(2))
        .max(configured.count);
    Buffers {
        count,
        bytes_each: slot,
    }
}

/// The optimizer swap buffers wanted: what the pipeline needs or
/// `buffer_count` if more, each one fp32 state of the largest sub-group
/// rounded up to 4 KiB. Returns `(wanted, needed)`.
pub fn optimizer_buffers(
    buffer_count: u64,
    read_ahead: usize,
    write_behind: usize,
    spill_grads: bool,
    max_sub_group_numel: u64,
) -> (Buffers, u64) {
    let needed = buffers_needed(read_ahead, write_behind, spill_grads) as u64;
    (
        Buffers {
            count: needed.max(buffer_count),
            bytes_each: align_up(max_sub_group_numel.saturating_mul(4)),
        },
        needed,
    )
}

/// `tierzero.optimizer_resident_bytes: "auto"`: one sub-group's state
/// (`sub_group_numel` elements of `state_bytes_per_elem` each), at most
/// one prefetch bucket of it. Bounded by the config, whatever the model's
/// size (a share of all the state, as before, grew with the model).
pub fn auto_optimizer_resident_bytes(
    prefetch_bucket_numel: u64,
    sub_group_numel: u64,
    state_bytes_per_elem: u64,
) -> u64 {
    prefetch_bucket_numel
        .min(sub_group_numel)
        .saturating_mul(state_bytes_per_elem)
}

/// Per sub-group: whether its optimizer state stays in host memory
/// although `offload_optimizer.device` is `nvme` (always false without
/// NVMe state). Those are the groups holding a param of the next
/// forward's first units, in index order, while their state (12 bytes per
/// element) fits `tierzero.optimizer_resident_bytes` (auto:
/// [`auto_optimizer_resident_bytes`]). See "Resident sub-groups" in
/// `crate::engine::optimizer::state`.
pub fn resident_groups(config: &Config, shape: &Shape) -> Vec<bool> {
    let zero = &config.zero;
    if zero.offload_optimizer.device.nvme_path().is_none() {
        return vec![false; shape.sub_groups.len()];
    }
    resident_groups_within(
        shape,
        config.tierzero.optimizer_resident_bytes.map(|b| b.0),
        zero.prefetch_bucket_numel.0,
        zero.sub_group_numel.0,
    )
}

/// [`resident_groups`] with the state on NVMe, from the settings it reads:
/// `optimizer_resident_bytes` (`None`: auto), `stage3_prefetch_bucket_size`
/// and `sub_group_size` (`tierzero estimate` calls it with the config's).
pub fn resident_groups_within(
    shape: &Shape,
    optimizer_resident_bytes: Option<u64>,
    prefetch_bucket_numel: u64,
    sub_group_numel: u64,
) -> Vec<bool> {
    let mut resident = vec![false; shape.sub_groups.len()];
    let budget_bytes = optimizer_resident_bytes.unwrap_or_else(|| {
        auto_optimizer_resident_bytes(prefetch_bucket_numel, sub_group_numel, STATE_BYTES_PER_ELEM)
    });
    let mut used_bytes = 0u64;
    let mut kept = 0usize;
    for (g, r) in shape.sub_groups.iter().zip(resident.iter_mut()) {
        if !g.first_units {
            continue;
        }
        // "auto" never keeps every group: some state is always on the
        // tier the config names (a one-group model stays offloaded).
        if optimizer_resident_bytes.is_none() && kept + 1 >= shape.sub_groups.len() {
            break;
        }
        kept += 1;
        let bytes = g.numel.saturating_mul(STATE_BYTES_PER_ELEM);
        if used_bytes.saturating_add(bytes) > budget_bytes {
            break;
        }
        used_bytes += bytes;
        *r = true;
    }
    resident
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

/// Home tier of each param (see the module docs).
fn home_tiers(config: &Config, shape: &Shape) -> Vec<Tier> {
    let zero = &config.zero;
    let n = shape.param_shard_numel.len();
    if zero.stage != Stage::Parameters {
        return vec![Tier::Device; n];
    }
    match &zero.offload_param.device {
        OffloadDevice::None => vec![Tier::Device; n],
        OffloadDevice::Cpu => vec![Tier::Cpu; n],
        OffloadDevice::Nvme { .. } => nvme_param_homes(
            &shape.param_shard_numel,
            zero.offload_param.max_in_cpu_numel.0,
        )
        .into_iter()
        .map(|nvme| if nvme { Tier::Nvme } else { Tier::Cpu })
        .collect(),
    }
}

/// With `offload_param: nvme`, which params (this rank's shards, in
/// `ParamId` order) go to NVMe: a shard stays in (pinned) host memory
/// while the running total of those kept, with it, is at most
/// `max_in_cpu` elements, and goes to NVMe otherwise (a later smaller one
/// may still stay).
pub fn nvme_param_homes(param_shard_numel: &[u64], max_in_cpu_numel: u64) -> Vec<bool> {
    let mut in_cpu = 0u64;
    param_shard_numel
        .iter()
        .map(|&n| {
            if in_cpu.saturating_add(n) <= max_in_cpu_numel {
                in_cpu += n;
                false
            } else {
                true
            }
        })
        .collect()
}

/// The one sizing policy (see the module docs), with no known limit on
/// NVMe space: [`decide_within`] with `None`.
pub fn decide(config: &Config, shape: &Shape) -> Result<Sizing, BudgetShort> {
    decide_within(config, shape, None)
}

/// One rank's share of the free space of the file system under
/// `offload_optimizer.nvme_path` (its nearest existing ancestor, when the
/// directory is not made yet): the free bytes over `ranks`, since the
/// ranks of a node share the path (`<nvme_path>/rank<R>`) and each sizes
/// its pool from it at once. It bounds the auto speculation pool; `None`
/// without NVMe state or when `statvfs` fails (the pool is then not
/// bounded by it, and a short disk shows as the swap file's `fallocate`
/// error). `ranks` is the world size: the ranks on this node are at most
/// that many, so the shares never add up to more than the disk.
pub fn nvme_available_bytes(config: &Config, ranks: usize) -> Option<u64> {
    let ranks = u64::try_from(ranks.max(1)).unwrap_or(u64::MAX);
    let path = config.zero.offload_optimizer.device.nvme_path()?;
    available_bytes_at(path).map(|b| b / ranks)
}

/// The one sizing policy, with `nvme_available_bytes` this rank's share of
/// the free space of the file system under `offload_optimizer.nvme_path`
/// when known ([`nvme_available_bytes`]: `statvfs`'s available bytes over
/// the ranks, before this run's swap files exist): it
/// bounds the auto speculation pool ([`speculation_pool`]), to what
/// half of it buys after the run's other extents (the params' too when
/// they share the directory).
pub fn decide_within(
    config: &Config,
    shape: &Shape,
    nvme_available_bytes: Option<u64>,
) -> Result<Sizing, BudgetShort> {
    let zero = &config.zero;
    let elem_bytes = config.precision.param_elem_bytes();
    let tiers = home_tiers(config, shape);
    let shard_bytes_on = |tier: Tier| {
        shape
            .param_shard_numel
            .iter()
            .zip(&tiers)
            .filter(move |(_, t)| **t == tier)
            .map(move |(n, _)| n * elem_bytes)
    };
    let cpu_shards: Vec<u64> = shard_bytes_on(Tier::Cpu).collect();
    let cpu_pages = cpu_page_plan(&cpu_shards);
    let param_nvme_bytes: u64 = shard_bytes_on(Tier::Nvme).map(align_up).sum();

    // The arena maps the configured buffers cut into slots (never more
    // bytes); the budget counts what it maps. An estimated shape counts
    // the configured buffers: at least what the slots will take.
    let configured = if tiers.contains(&Tier::Nvme) {
        param_buffers(
            zero.offload_param.buffer_count,
            zero.offload_param.buffer_numel.0,
            elem_bytes,
        )
    } else {
        Buffers::NONE
    };
    let param_buffers = if shape.exact_shards {
        param_slots(
            configured,
            shard_bytes_on(Tier::Nvme).max().unwrap_or(0),
            shard_bytes_on(Tier::Nvme).count() as u64,
        )
    } else {
        configured
    };

    let opt_nvme = zero.offload_optimizer.device.nvme_path().is_some();
    let read_ahead = usize::from(zero.offload_optimizer.pipeline_read);
    let write_behind = usize::from(zero.offload_optimizer.pipeline_write);
    let spill_grads = spills_grads(config);
    let park_grads = parks_grads(config);
    let park_buffers = if park_grads {
        park_buffers(shape.max_sub_group_numel())
    } else {
        Buffers::NONE
    };
    let (wanted, needed) = optimizer_buffers(
        zero.offload_optimizer.buffer_count,
        read_ahead,
        write_behind,
        spill_grads,
        shape.max_sub_group_numel(),
    );
    // Within a pinned budget the param slots are cut to what it leaves
    // beside the parked sums and the optimizer pipeline's least, never
    // below `buffer_count` (the slots are a speed-up: DeepSpeed's default
    // buffers cut into 104 slots asked a 40 MiB budget for 58.5 MiB on a
    // small GPT-2 whose 5 slots take 2.8 MiB).
    // The optimizer pipeline's least pinned bytes (none without NVMe
    // state).
    let optimizer_least = if opt_nvme {
        needed.saturating_mul(wanted.bytes_each)
    } else {
        0
    };
    let param_buffers = param_slots_within(
        param_buffers,
        configured.count,
        config.tierzero.pinned_budget_bytes.map(|b| b.0),
        park_buffers.total_bytes().saturating_add(optimizer_least),
    );
    // Buffers the budget must hold before the optimizer's.
    let fixed_bytes = param_buffers
        .total_bytes()
        .saturating_add(park_buffers.total_bytes());
    let short = || BudgetShort {
        budget_bytes: config.tierzero.pinned_budget_bytes.map_or(0, |b| b.0),
        param_buffers,
        optimizer_buffers_needed: if opt_nvme {
            Buffers {
                count: needed,
                bytes_each: wanted.bytes_each,
            }
        } else {
            Buffers::NONE
        },
        optimizer_stages: if opt_nvme {
            needed / (3 + u64::from(spill_grads))
        } else {
            0
        },
        optimizer_spills_grads: opt_nvme && spill_grads,
        park_buffers,
        required_bytes: fixed_bytes.saturating_add(optimizer_least),
    };
    if let Some(b) = config.tierzero.pinned_budget_bytes {
        if fixed_bytes > b.0 {
            return Err(short());
        }
    }
    let optimizer_buffers = if opt_nvme {
        match config.tierzero.pinned_budget_bytes {
            None => wanted,
            Some(b) => {
                let avail = b.0.saturating_sub(fixed_bytes) / wanted.bytes_each.max(1);
                if avail < needed {
                    return Err(short());
                }
                Buffers {
                    count: avail.min(wanted.count),
                    bytes_each: wanted.bytes_each,
                }
            }
        }
    } else {
        Buffers::NONE
    };

    let resident = resident_groups(config, shape);
    let nvme_groups = || {
        shape
            .sub_groups
            .iter()
            .zip(&resident)
            .filter(|(_, r)| !**r)
            .map(|(g, _)| align_up(g.numel * 4))
    };
    let spill_nvme_bytes: u64 = if spill_grads { nvme_groups().sum() } else { 0 };
    let park_nvme_bytes: u64 = if park_grads {
        shape.sub_groups.iter().map(|g| align_up(g.numel * 4)).sum()
    } else {
        0
    };
    let (optimizer_nvme_bytes, grad_spill_nvme_bytes) = if opt_nvme {
        (3 * nvme_groups().sum::<u64>(), spill_nvme_bytes)
    } else {
        (0, 0)
    };
    // (With speculation the trainer applies the same rule to the NVMe
    // groups that do not speculate, see `Trainer::expect_reads`; the
    // speculated ones' gradients go to the optimizer thread.)
    let held_grad_groups = if spill_grads {
        held_grad_bound(&resident, read_ahead + 1)
    } else {
        0
    };
    let lock_bytes = if zero.offload_param.pin_memory {
        cpu_pages
            .total_bytes()
            .saturating_add(param_buffers.total_bytes())
    } else {
        0
    }
    .saturating_add(if zero.offload_optimizer.pin_memory {
        optimizer_buffers
            .total_bytes()
            .saturating_add(park_buffers.total_bytes())
    } else {
        0
    });
    // A speculation pool's slot: one largest NVMe group's three extents.
    let slot_bytes = 3 * nvme_groups().max().unwrap_or(0);
    let nvme_group_count = nvme_groups().count();
    let mut sizing = Sizing {
        tiers,
        param_elem_bytes: elem_bytes,
        cpu_pages,
        param_buffers,
        optimizer_buffers,
        optimizer_buffers_needed: if opt_nvme { needed } else { 0 },
        read_ahead,
        write_behind,
        spill_grads,
        speculative: false,
        speculation_slots: 0,
        speculation_kept_grads: 0,
        speculation_pool_nvme_bytes: 0,
        speculation_off_for_room_bytes: None,
        resident_groups: resident,
        held_grad_groups,
        param_nvme_bytes,
        optimizer_nvme_bytes,
        grad_spill_nvme_bytes,
        park_grads,
        park_buffers,
        grad_park_nvme_bytes: park_nvme_bytes,
        lock_bytes,
        grads_held_until_step: opt_nvme && !config.tierzero.overlap_optimizer,
    };
    // The pool's room: the free space less every swap space the run makes
    // there without it (the params' too when they share the directory, and
    // each space's alignment room), as the disk check counts them.
    let room_bytes = nvme_available_bytes
        .zip(zero.offload_optimizer.device.nvme_path())
        .map(|(avail, dir)| avail.saturating_sub(sizing.swap_bytes_under(config, dir)));
    let pool = speculation_pool(
        speculation_ask(config),
        read_ahead,
        write_behind,
        nvme_group_count,
        slot_bytes,
        room_bytes,
    );
    sizing.add_speculation_pool(pool, slot_bytes);
    Ok(sizing)
}

impl Sizing {
    /// Gives the sizing `pool`, of `slot_bytes` slots: speculation keeps
    /// the old state while the new one is written, into a pool slot sized
    /// for any NVMe group (a committed slot becomes the group's extents,
    /// its old extents a slot), in the optimizer state's swap space.
    fn add_speculation_pool(&mut self, pool: SpeculationPool, slot_bytes: u64) {
        self.speculative = pool.slots > 0;
        self.speculation_slots = pool.slots;
        self.speculation_kept_grads =
            speculation_kept_grads(self.read_ahead, self.write_behind, pool.slots);
        self.speculation_pool_nvme_bytes = (pool.slots as u64).saturating_mul(slot_bytes);
        self.speculation_off_for_room_bytes = pool.off_for_room_bytes;
        self.optimizer_nvme_bytes = self
            .optimizer_nvme_bytes
            .saturating_add(self.speculation_pool_nvme_bytes);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[test]
    fn the_device_s_kept_forwards_take_half_its_room_or_what_is_set() {
        use crate::config::ActivationBudget as A;
        let f = device_forward_budget_bytes;
        assert_eq!(f(A::Auto, Some(1000), Some(9000)), Ok(500));
        // Host memory (the simulated device): half of what is available.
        assert_eq!(f(A::Auto, None, Some(9000)), Ok(4500));
        assert_eq!(f(A::Auto, None, None), Ok(0));
        assert_eq!(f(A::Checkpointing, Some(1000), None), Ok(0));
        assert_eq!(f(A::Bytes(0), Some(1000), None), Ok(0));
        assert_eq!(f(A::Bytes(1000), Some(1000), None), Ok(1000));
        assert_eq!(f(A::Bytes(5000), None, None), Ok(5000));
        let err = f(A::Bytes(1001), Some(1000), None).unwrap_err();
        assert!(
            err.contains("1001") && err.contains("at most 1000") && err.contains("(500: half"),
            "{err}"
        );
    }

    #[test]
    fn the_speculation_pool_buys_slots_with_bytes() {
        use SpeculationAsk as A;
        let pool = |ask, groups, room| speculation_pool(ask, 1, 1, groups, 300, room);
        let slots = |ask, groups, room| pool(ask, groups, room).slots;
        // auto, no known room: every NVMe group.
        assert_eq!(slots(A::Auto, 10, None), 10);
        assert_eq!(slots(A::Auto, 2, None), 2);
        // auto within a room: what half of it buys, at least the
        // pipeline's depth (3), at most the groups.
        assert_eq!(slots(A::Auto, 10, Some(6000)), 10);
        assert_eq!(slots(A::Auto, 10, Some(3000)), 5);
        assert_eq!(slots(A::Auto, 10, Some(2999)), 4);
        assert_eq!(slots(A::Auto, 10, Some(1800)), 3);
        // ... and off when that least pool does not fit half the room (the
        // rest is the checkpoints'), while speculative_step true keeps it
        // (the disk check then refuses).
        assert_eq!(
            pool(A::Auto, 10, Some(1799)),
            SpeculationPool {
                slots: 0,
                off_for_room_bytes: Some(900)
            }
        );
        assert_eq!(
            pool(A::On, 10, Some(1799)),
            SpeculationPool {
                slots: 3,
                off_for_room_bytes: None
            }
        );
        assert_eq!(slots(A::On, 10, Some(0)), 3);
        assert_eq!(slots(A::On, 2, Some(0)), 2);
        assert_eq!(slots(A::On, 10, Some(3000)), 5);
        assert_eq!(slots(A::Auto, 2, Some(1200)), 2);
        assert_eq!(slots(A::Auto, 2, Some(1199)), 0);
        // bytes: floor(bytes / slot), at least one, at most the groups,
        // whatever the room.
        assert_eq!(slots(A::PoolBytes(1500), 10, None), 5);
        assert_eq!(slots(A::PoolBytes(1500), 10, Some(0)), 5);
        assert_eq!(slots(A::PoolBytes(299), 10, None), 1);
        assert_eq!(slots(A::PoolBytes(0), 10, None), 1);
        assert_eq!(slots(A::PoolBytes(1 << 40), 10, None), 10);
        assert_eq!(
            speculation_pool(A::PoolBytes(5), 1, 1, 10, 0, None).slots,
            10
        );
        // No speculation, or no NVMe group: none.
        assert_eq!(pool(A::Off, 10, None), pool(A::Auto, 0, Some(0)));
        assert_eq!(slots(A::Off, 10, None), 0);
        assert_eq!(slots(A::PoolBytes(3000), 0, None), 0);
        // The ask of the two keys.
        assert_eq!(SpeculationAsk::new(false, Some(true), Some(1)), A::Off);
        assert_eq!(SpeculationAsk::new(true, Some(false), Some(1)), A::Off);
        assert_eq!(SpeculationAsk::new(true, None, None), A::Auto);
        assert_eq!(SpeculationAsk::new(true, Some(true), None), A::On);
        assert_eq!(SpeculationAsk::new(true, None, Some(7)), A::PoolBytes(7));
        // Kept gradients: the pipeline's depth, at most the slots.
        assert_eq!(speculation_kept_grads(1, 1, 10), 3);
        assert_eq!(speculation_kept_grads(1, 1, 2), 2);
        assert_eq!(speculation_kept_grads(0, 0, 0), 0);
    }

    #[test]
    fn the_nvme_state_gradient_bound_counts_the_groups_in_flight() {
        // On NVMe: the groups given and those in flight, at most all; the
        // bytes are that many of the largest.
        assert_eq!(nvme_state_grad_bound_groups(2, 1, 1, 20), 6);
        assert_eq!(nvme_state_grad_bound_bytes(2, 1, 1, 20, 400), 6 * 400);
        assert_eq!(nvme_state_grad_bound_groups(2, 1, 1, 4), 4);
        assert_eq!(nvme_state_grad_bound_bytes(2, 1, 1, 4, 200), 4 * 200);
        assert_eq!(nvme_state_grad_bound_groups(0, 0, 0, 3), 2);
    }

    #[test]
    fn estimated_shape_keeps_the_total_and_the_largest_group() {
        // The largest param (3M) is tiled into three groups of 1M, the
        // first units' groups.
        let s = Shape::estimated(10_000_000, Some(3_000_000), 1_000_000);
        assert_eq!(s.numel(), 10_000_000);
        assert_eq!(s.max_sub_group_numel(), 1_000_000);
        assert_eq!(s.sub_groups.len(), 10);
        assert!(s.sub_groups[..3].iter().all(|g| g.first_units));
        assert!(!s.sub_groups[3].first_units);
        let s = Shape::estimated(500, None, 1_000_000);
        assert_eq!(s.param_shard_numel, vec![500]);
        assert_eq!(Shape::estimated(0, Some(5), 10).numel(), 0);
        // A model that fits one sub-group is one, whatever its largest
        // param (alone, that param made a smaller largest group, and the
        // config's pinned-budget check asked for less than the run's).
        let s = Shape::estimated(1_878_144, Some(147_456), 1_000_000_000);
        assert_eq!(s.max_sub_group_numel(), 1_878_144);
        assert_eq!(s.sub_groups.len(), 1);
        assert_eq!(s.param_shard_numel, vec![147_456, 1_730_688]);
        // The largest param's last tile shares its group with what follows.
        let s = Shape::estimated(10, Some(5), 4);
        let groups: Vec<(u64, bool)> = s
            .sub_groups
            .iter()
            .map(|g| (g.numel, g.first_units))
            .collect();
        assert_eq!(groups, [(4, true), (4, true), (2, false)]);
    }

    #[test]
    fn param_slots_cut_the_configured_bytes_into_shard_slots() {
        // 5 buffers of 4e6 fp32 elements (15.3 MiB each), shards of at
        // most 148,608 elements (580.5 KiB, 584 KiB aligned): 26 slots a
        // buffer, capped at two per NVMe param.
        let conf = param_buffers(5, 4_000_000, 4);
        let s = param_slots(conf, 148_608 * 4, 52);
        assert_eq!((s.count, s.bytes_each), (104, 584 * 1024));
        let s = param_slots(conf, 148_608 * 4, 1000);
        assert_eq!((s.count, s.bytes_each), (130, 584 * 1024));
        assert!(s.total_bytes() <= conf.total_bytes());
        // Never fewer slots than buffers, never larger than configured.
        let s = param_slots(conf, 148_608 * 4, 1);
        assert_eq!(s.count, 5);
        assert_eq!(param_slots(conf, 4_000_000 * 4, 52), conf);
        assert_eq!(param_slots(conf, 9_000_000 * 4, 52), conf);
        assert_eq!(param_slots(Buffers::NONE, 4096, 3), Buffers::NONE);
    }

    #[test]
    fn buffers_round_up_and_never_fall_below_the_pipeline() {
        let p = param_buffers(0, 1000, 2);
        assert_eq!((p.count, p.bytes_each), (1, 4096));
        let (o, needed) = optimizer_buffers(4, 1, 1, true, 1025);
        assert_eq!(needed, 12);
        assert_eq!((o.count, o.bytes_each), (12, 8192));
        let (o, needed) = optimizer_buffers(20, 0, 0, false, 1024);
        assert_eq!((o.count, needed), (20, 3));
    }

    #[test]
    fn cpu_pages_pack_first_fit() {
        assert_eq!(cpu_page_plan(&[]), Buffers::NONE);
        let p = cpu_page_plan(&[100, 200]);
        assert_eq!((p.count, p.bytes_each), (1, 4096));
        let big = 40 << 20;
        let p = cpu_page_plan(&[big, big, big]);
        assert_eq!(p.bytes_each, 64 << 20);
        assert_eq!(p.count, 3);
        // A later shard fills an earlier page's tail (next fit opened a
        // page whenever the next shard missed the last one: 4 here).
        assert_eq!(
            cpu_page_places(&[6, 5, 4, 3, 2], 8),
            [(0, 0), (1, 0), (2, 0), (1, 5), (0, 6)]
        );
        let mib = 1 << 20;
        let p = cpu_page_plan(&[96 * mib, 80 * mib, 64 * mib, 16 * mib, 32 * mib]);
        assert_eq!((p.count, p.bytes_each), (3, 96 * mib));
    }

    #[test]
    fn held_groups_skip_resident_ones() {
        assert_eq!(held_grad_bound(&[true, false, false, false], 2), 3);
        assert_eq!(held_grad_bound(&[false, false], 5), 2);
    }
}

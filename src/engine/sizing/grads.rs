//! The host's gradients, as sizing sees them: how each sub-group's are
//! held ([`grad_sum_dtype`]: fp32 sums, or bf16 as they came) and the
//! most bytes of them host memory holds at once
//! ([`host_grad_bound_bytes`]), which the plan prints and the trainer's
//! spare sums stay within.

use super::{Shape, Sizing};
use crate::config::{Config, Precision};
use crate::model::Model;

/// How the host holds a sub-group's gradients for the CPU optimizer
/// ([`grad_sum_dtype`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SumDtype {
    /// fp32 sums, the gradients added into them.
    #[default]
    F32,
    /// The bf16 gradients as they came, one per element, which the
    /// optimizer reads as their fp32 sums would be
    /// ([`crate::optim::GradIn::Bf16`]): half the bytes held, and no
    /// widening pass.
    Bf16,
}

impl SumDtype {
    /// Bytes of one element.
    pub fn bytes_per_elem(self) -> u64 {
        match self {
            SumDtype::F32 => 4,
            SumDtype::Bf16 => 2,
        }
    }
}

/// The one rule for how the host holds `group`'s gradients: as bf16 where
/// every element gets exactly one gradient a step and it is bf16 (bf16
/// params, one rank, one micro-batch, and no param of the group used by
/// several units: a tied embedding's gradients add up over its units),
/// else in fp32 sums. A step from them is the same bits either way (a sum
/// of one gradient is `+0.0 + g`, what the optimizer reads a bf16 one as).
pub fn grad_sum_dtype(
    config: &Config,
    model: &Model,
    world: usize,
    group: &crate::engine::layout::SubGroup,
) -> SumDtype {
    if one_bf16_grad_each(config, world) && group.param_ids().all(|p| model.in_one_unit(p)) {
        SumDtype::Bf16
    } else {
        SumDtype::F32
    }
}

/// [`grad_sum_dtype`]'s conditions on the run: each param gets one bf16
/// gradient a step (bf16 params, one rank, one micro-batch), unless
/// several units use it.
fn one_bf16_grad_each(config: &Config, world: usize) -> bool {
    world == 1
        && config.batch.gradient_accumulation_steps <= 1
        && matches!(config.precision, Precision::Bf16)
}

/// Elements of `model` whose gradients the host holds as bf16 on one of
/// `world` ranks ([`grad_sum_dtype`] of each sub-group of the layout a run
/// of `config` makes), for `tierzero estimate`; the rest take 4 bytes.
pub fn bf16_grad_numel(config: &Config, model: &Model, world: usize) -> u64 {
    if !one_bf16_grad_each(config, world) {
        return 0;
    }
    let sub_group = usize::try_from(config.zero.sub_group_numel.0).unwrap_or(usize::MAX);
    let layout = crate::engine::layout::Layout::new(model, 0, world, sub_group);
    layout
        .sub_groups
        .iter()
        .filter(|g| grad_sum_dtype(config, model, world, g) == SumDtype::Bf16)
        .map(|g| g.numel as u64)
        .sum()
}

/// NVMe bytes one step's spilled gradients take, written and again read
/// (those of the groups whose state is on NVMe, not `resident`): each in
/// the dtype the host holds it in ([`SumDtype`]; its extent is fp32's),
/// 4 KiB-aligned.
pub fn grad_spill_step_bytes(shape: &Shape, resident: &[bool]) -> u64 {
    shape
        .sub_groups
        .iter()
        .zip(resident)
        .filter(|(_, r)| !**r)
        .map(|(g, _)| super::align_up(g.numel * g.sum_dtype.bytes_per_elem()))
        .sum()
}

/// Gradients handed to the optimizer thread in backward that it may have
/// queued or in use at once, steps and spills together (the compute
/// thread waits for a reply beyond): one per pipeline stage, and one more
/// being handed over.
pub fn grads_in_flight(read_ahead: usize, write_behind: usize) -> usize {
    2 + read_ahead + write_behind
}

/// Stepped sub-groups' new 16-bit (or fp32) values the optimizer thread
/// lends at once, each at most the largest sub-group's elements: the
/// gradients handed over in backward (each answered by storing its
/// values, so the bound does not hold the thread back there) and the
/// sub-groups of the largest unit (`unit_groups`,
/// [`largest_unit_groups`]), never more than the `sub_groups`. After a
/// decision every remaining step is sent at once and the trainer stores
/// values only at unit boundaries: a unit's worth lets the thread step
/// the next unit's groups while this one computes, as it did unbounded,
/// where a bound of a few held the forward at every boundary while the
/// thread stepped that unit's groups. One more is kept as the spare
/// (`crate::engine::optimizer::worker`); the plan and the estimate count
/// both.
pub fn values_in_flight(
    read_ahead: usize,
    write_behind: usize,
    unit_groups: usize,
    sub_groups: usize,
) -> usize {
    (grads_in_flight(read_ahead, write_behind) + unit_groups)
        .min(sub_groups)
        .max(1)
}

/// Values buffers the host holds at most: the [`values_in_flight`] lent
/// and the spare the optimizer thread keeps (the plan's row, the
/// estimate's item).
pub fn values_buffers(
    read_ahead: usize,
    write_behind: usize,
    unit_groups: usize,
    sub_groups: usize,
) -> usize {
    values_in_flight(read_ahead, write_behind, unit_groups, sub_groups) + 1
}

/// Bytes of gradients host memory holds at most, from the config and the
/// layout alone (4 bytes an element in fp32 sums, 2 as bf16:
/// [`grad_sum_dtype`]). With the optimizer state in host memory, the
/// whole shard's (beside the state's 12 bytes an element), and so with it
/// on NVMe and `overlap_optimizer` off (`Sizing::grads_held_until_step`).
/// With it on NVMe and overlapped: the sums backward is adding into (the sub-groups of the largest
/// unit, `unit_groups`), the first groups held for the step
/// (`held_grad_groups`), the speculated gradients the optimizer thread
/// keeps for a re-step (`speculation_kept_grads`) and the steps and spills
/// handed to it ([`grads_in_flight`]), each at most the largest sub-group's.
pub fn host_grad_bound_bytes(
    sizing: &Sizing,
    shape: &Shape,
    opt_nvme: bool,
    unit_groups: u64,
) -> u64 {
    if !opt_nvme || sizing.grads_held_until_step {
        return shape
            .sub_groups
            .iter()
            .map(|g| g.numel.saturating_mul(g.sum_dtype.bytes_per_elem()))
            .fold(0u64, u64::saturating_add);
    }
    host_grad_bound_groups(sizing, shape, opt_nvme, unit_groups)
        .saturating_mul(shape.max_sum_bytes())
}

/// The sub-groups' sums [`host_grad_bound_bytes`] counts: every one with
/// the optimizer state in host memory; with it on NVMe, the sums being
/// added into, held, speculated and handed over
/// ([`nvme_state_grad_bound_groups`]). The trainer keeps as many sums
/// from one step for the next (its spares: a sum made in one is written
/// in place, where a new one is page-faulted in as it is zeroed), so
/// they stay within the bound: spares are sums that were in use, and it
/// never holds more buffers than it had in use at once (`SpareSums`).
pub fn host_grad_bound_groups(
    sizing: &Sizing,
    shape: &Shape,
    opt_nvme: bool,
    unit_groups: u64,
) -> u64 {
    let sub_groups = shape.sub_groups.len() as u64;
    if !opt_nvme || sizing.grads_held_until_step {
        return sub_groups;
    }
    nvme_state_grad_bound_groups(
        unit_groups + sizing.held_grad_groups as u64 + sizing.speculation_kept_grads as u64,
        sizing.read_ahead,
        sizing.write_behind,
        sub_groups,
    )
}

/// Bytes of fp32 gradients backward holds in host memory beside the
/// sub-groups' sums, at most (`Trainer::accumulate_unit`): each tied
/// param's sum over its units, whole (they are summed before the reduce,
/// so every rank's micro-batch adds one gradient a param), from its first
/// unit's backward to its last; and with several ranks the reduce's
/// buffer of one unit's gradients, unsharded (the largest unit's,
/// `Model::largest_unit_numel`), which the reduce-scatter takes its
/// chunks from. `tied_numel` is [`tied_numel`]'s.
pub fn backward_staging_bytes(tied_numel: u64, largest_unit_numel: u64, ranks: u64) -> u64 {
    let reduce = if ranks > 1 { largest_unit_numel } else { 0 };
    tied_numel.saturating_add(reduce).saturating_mul(4)
}

/// Elements of the params several units use (a tied embedding and head):
/// their gradients' sums are held through backward
/// ([`backward_staging_bytes`]).
pub fn tied_numel(model: &crate::model::Model) -> u64 {
    model
        .params()
        .iter()
        .filter(|p| !model.in_one_unit(p.id))
        .map(|p| p.numel as u64)
        .sum()
}

/// The sub-groups the largest unit's params touch: the sums backward
/// adds into at once (`unit_groups` of [`host_grad_bound_bytes`]).
pub fn largest_unit_groups(
    model: &crate::model::Model,
    layout: &crate::engine::layout::Layout,
) -> u64 {
    model
        .units()
        .iter()
        .map(|u| {
            let mut gs: Vec<usize> = u
                .params
                .iter()
                .filter_map(|p| layout.params.get(p.0))
                .flat_map(|s| s.pieces.iter().map(|pc| pc.sub_group.0))
                .collect();
            gs.sort_unstable();
            gs.dedup();
            gs.len() as u64
        })
        .max()
        .unwrap_or(1)
}

/// [`host_grad_bound_bytes`] with the optimizer state on NVMe, from its
/// parts: `groups` sub-groups' sums being added into, held or speculated,
/// and the [`grads_in_flight`] steps handed over, at most `sub_groups`
/// groups of `max_sum_bytes` each (the largest group's elements in its
/// [`SumDtype`]; `tierzero estimate` calls it for a model known by its
/// size).
pub fn nvme_state_grad_bound_bytes(
    groups: u64,
    read_ahead: usize,
    write_behind: usize,
    sub_groups: u64,
    max_sum_bytes: u64,
) -> u64 {
    nvme_state_grad_bound_groups(groups, read_ahead, write_behind, sub_groups)
        .saturating_mul(max_sum_bytes)
}

/// [`nvme_state_grad_bound_bytes`]'s sums: `groups` and the
/// [`grads_in_flight`] steps, at most `sub_groups`.
pub fn nvme_state_grad_bound_groups(
    groups: u64,
    read_ahead: usize,
    write_behind: usize,
    sub_groups: u64,
) -> u64 {
    (groups + grads_in_flight(read_ahead, write_behind) as u64).min(sub_groups)
}

#[cfg(test)]
mod tests {
    use super::super::GroupShape;
    use super::*;

    fn group(numel: u64, sum_dtype: SumDtype) -> GroupShape {
        GroupShape {
            numel,
            first_units: false,
            sum_dtype,
        }
    }

    /// The largest group's bytes and one step's spilled gradients count
    /// each group in the dtype its gradients are held in (2 bytes for
    /// bf16, 4 for fp32 sums), 4 KiB-aligned, the resident groups' none.
    #[test]
    fn gradient_bytes_count_each_group_in_its_dtype() {
        let shape = Shape {
            param_shard_numel: vec![5000, 3000, 1000],
            sub_groups: vec![
                group(5000, SumDtype::Bf16),
                group(3000, SumDtype::F32),
                group(1000, SumDtype::Bf16),
            ],
            exact_shards: true,
        };
        assert_eq!(shape.max_sum_bytes(), 12_000, "3000 fp32 over 5000 bf16");
        let align = super::super::align_up;
        assert_eq!(
            grad_spill_step_bytes(&shape, &[false, false, false]),
            align(10_000) + align(12_000) + align(2_000)
        );
        assert_eq!(
            grad_spill_step_bytes(&shape, &[false, true, false]),
            align(10_000) + align(2_000)
        );
        assert_eq!(grad_spill_step_bytes(&shape, &[true, true, true]), 0);
    }
}

//! What [`ResidentUnits`]' state needs on the device (see "Memory" in
//! [`super`]): one rule, [`resident_state_bytes`], which the refusal at
//! start-up, the kept forwards' room and the plan's rows all read.

use candle_core::DType;

use super::{DeviceLink, ResidentUnits, ELEM_BYTES};
use crate::model::exec_units::{DeviceMemoryPlan, DeviceMemoryRow};
use crate::model::{Model, ParamId};

/// Device bytes of the resident state of params of `numels` elements on
/// rank `rank` of `world`: `[weights, master, moments, gradients]`.
///
/// With one rank, bf16 storage has an fp32 master beside the bf16
/// weights; the gradients (fp32) are the step's sums plus, at most, one
/// unit's micro-batch gradients (`unit_numels`, as backward returns them,
/// all alive until each is added) and three of the largest param beside
/// them: a tied param's micro-batch sum still open (from the head, with
/// several micro-batches) and either its bf16 rounding with the cast's
/// bf16 temporary (one and a half) or the new sum an add makes.
///
/// With several, the weights are whole on every rank and the master and
/// moments are this rank's shards (`crate::engine::layout::shard_counts`);
/// the gradients are the shards of the step's sums plus, at most, a
/// unit's micro-batch sums (`unit_numels`: the params of the unit with
/// the most elements) and the largest param's gradient beside them (its
/// bf16 rounding), and two units' reduces (the last one's buffers may
/// still be in flight as the next one's are taken): the sums laid out to
/// cross, the chunks every rank sent this rank, and the running and new
/// sums, together and split. With the params partitioned (stage 3), the
/// weights are not resident: a unit's are gathered whole for it, and
/// freed after; room for two units' (the one computing and the next,
/// gathered ahead as the engine stages it).
pub fn resident_state_bytes(
    numels: &[u64],
    bf16: bool,
    rank: usize,
    world: usize,
    unit_numels: &[u64],
    partition: bool,
) -> [u64; 4] {
    let total: u64 = numels.iter().sum();
    let largest = numels.iter().copied().max().unwrap_or(0);
    let storage = if bf16 { DType::BF16 } else { DType::F32 };
    let weights = crate::engine::device::param_device_bytes(total, storage);
    let unit: u64 = unit_numels.iter().sum();
    if world <= 1 {
        return [
            weights,
            if bf16 { total * ELEM_BYTES } else { 0 },
            2 * total * ELEM_BYTES,
            (total + unit + 3 * largest) * ELEM_BYTES,
        ];
    }
    let shard = |n: u64| {
        crate::engine::layout::shard_counts(n as usize, world)
            .get(rank)
            .map_or(0, |&c| c as u64)
    };
    let shards: u64 = numels.iter().map(|&n| shard(n)).sum();
    let unit_shard: u64 = unit_numels.iter().map(|&n| shard(n)).sum();
    let weights = if partition {
        2 * crate::engine::device::param_device_bytes(unit, storage)
    } else {
        weights
    };
    [
        weights,
        shards * ELEM_BYTES,
        2 * shards * ELEM_BYTES,
        (shards + largest + 3 * unit + 2 * (world as u64 + 3) * unit_shard) * ELEM_BYTES,
    ]
}

/// The numels of the params of `model`'s unit with the most elements.
pub(super) fn largest_unit_numels(model: &Model) -> Vec<u64> {
    let numel = |ids: &[ParamId]| -> Vec<u64> {
        ids.iter()
            .filter_map(|id| model.params().get(id.0))
            .map(|p| p.numel as u64)
            .collect()
    };
    model
        .units()
        .iter()
        .map(|u| numel(&u.params))
        .max_by_key(|n| n.iter().sum::<u64>())
        .unwrap_or_default()
}

impl<L: DeviceLink> ResidentUnits<L> {
    /// [`resident_state_bytes`] of this model on this rank.
    pub(super) fn state_bytes(&self) -> [u64; 4] {
        let world = self.link.reduce_ranks();
        resident_state_bytes(
            &self.numels,
            self.bf16,
            self.link.collective_rank(),
            world,
            &self.unit_numels,
            self.partitioned(),
        )
    }

    /// The device bytes the state may take: the whole budget less
    /// start-up (the tier's share and the temporaries' together).
    pub(super) fn room_bytes(link: &L) -> u64 {
        let mem = link.memory();
        link.budget_bytes() + mem.temporaries_bytes.unwrap_or(0)
    }

    /// The start-up plan's rows of the state, the staging and what is
    /// left of the device.
    pub(super) fn plan(&self) -> DeviceMemoryPlan {
        let mem = self.link.memory();
        let [weights, master, moments, grads] = self.state_bytes();
        let largest = self.numels.iter().copied().max().unwrap_or(0);
        let row = |what: &str, device_bytes: u64| DeviceMemoryRow {
            what: what.into(),
            device_bytes,
            pinned_bytes: 0,
        };
        let shard = if self.ranks.is_some() {
            ", this rank's shard"
        } else {
            ""
        };
        let mut rows = vec![row(
            match &self.ranks {
                Some(r) if r.partition => "params, two units' gathered whole (at most)",
                Some(_) => "params, resident (whole on every rank)",
                None => "params, resident",
            },
            weights,
        )];
        if master > 0 {
            rows.push(row(&format!("fp32 master weights{shard}"), master));
        }
        rows.push(row(&format!("Adam moments (m, v), fp32{shard}"), moments));
        rows.push(row(
            if self.ranks.is_some() {
                "gradients (this rank's shard of the step's sums, a unit's reduce)"
            } else {
                "gradients (the step's sums)"
            },
            grads,
        ));
        rows.push(DeviceMemoryRow {
            what: "upload staging buffers".into(),
            device_bytes: 0,
            pinned_bytes: mem.staging.bound_bytes(largest * ELEM_BYTES),
        });
        if mem.temporaries_bytes.is_some() {
            let state = weights + master + moments + grads;
            let room = Self::room_bytes(&self.link).saturating_sub(state);
            let kept = self.inputs.forward_budget_bytes().min(room);
            if kept > 0 {
                rows.push(row("blocks' kept forwards (at most)", kept));
            }
            rows.push(row("activations, temporaries", room - kept));
        }
        if mem.startup_bytes > 0 {
            rows.push(row("kernels and cuBLAS workspaces", mem.startup_bytes));
        }
        DeviceMemoryPlan {
            budget_bytes: mem.device_budget_bytes,
            rows,
            optimizer_on_device: true,
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn several_ranks_hold_whole_weights_and_their_shard_of_the_state() {
        // Params of 10 and 3 elements: rank 1 of 2 holds 5 and 1 of them
        // (`shard_counts` cuts 3 as [2, 1]).
        let numels = [10u64, 3];
        // One unit holds both.
        let one = super::resident_state_bytes(&numels, true, 0, 1, &numels, false);
        // One rank: the sums (13), the unit's gradients as backward
        // returned them (13), and three of the largest (10: a tied param's
        // open sum, and its bf16 rounding or a new sum beside them).
        assert_eq!(one, [26, 52, 104, (13 + 13 + 30) * 4]);
        let two = super::resident_state_bytes(&numels, true, 1, 2, &numels, false);
        // bf16 weights whole; the fp32 master and moments of 6 elements;
        // the sums' shards (6), the largest gradient (10), the unit's
        // micro-batch sums (13), and two reduces of the unit: its sums
        // laid out (13) and 2 + 3 times its shard (6: the chunks
        // received, the running and new sums together, the new split).
        assert_eq!(two, [26, 24, 48, (6 + 10 + 13 + 2 * (13 + 5 * 6)) * 4]);
        let fp32 = super::resident_state_bytes(&numels, false, 0, 2, &numels, false);
        assert_eq!(fp32[..3], [52, 28, 56]);
        // Partitioned (stage 3): no weights resident but two units'
        // gathered, bf16; the rest as with whole weights.
        let part = super::resident_state_bytes(&numels, true, 1, 2, &numels, true);
        assert_eq!(part, [2 * 26, two[1], two[2], two[3]]);
    }
}

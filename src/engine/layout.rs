//! Where each parameter's elements live: per-rank shards and optimizer
//! sub-groups.
//!
//! * **Shards.** Parameter `p` of `n` elements is cut into `world` contiguous
//!   shards of `ceil(n / world)` elements (the last ones shorter, possibly
//!   empty); rank `r` owns `[r·c, min((r+1)·c, n))`. With one rank the shard
//!   is the whole parameter.
//! * **Sub-groups.** This rank's shards, in `ParamId` order, are packed into
//!   sub-groups of at most `sub_group_size` elements; a shard that is larger
//!   on its own forms its own sub-group (as DeepSpeed's
//!   `_create_fp16_sub_groups`). Sub-groups hold whole shards, so writing
//!   the 16-bit params of a stepped sub-group writes whole param records,
//!   never a partial, unaligned range of one. The sub-group is the unit of
//!   optimizer I/O and of the step.
//! * **Finality.** Backward visits units in reverse, so a parameter's
//!   gradient is final after the backward of the *smallest* unit that uses
//!   it (a tied embedding: the embedding unit, not the head). A sub-group is
//!   final after the backward of the smallest such unit over its params;
//!   [`SubGroup::final_after_unit`] records it for the overlapped optimizer.

use crate::model::{Model, ParamId, UnitId};

/// Index of a sub-group in [`Layout::sub_groups`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SubGroupId(pub usize);

/// One parameter's place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSlot {
    /// The parameter.
    pub id: ParamId,
    /// Whole parameter elements.
    pub numel: usize,
    /// First element of this rank's shard.
    pub shard_start: usize,
    /// Elements in this rank's shard.
    pub shard_numel: usize,
    /// The sub-group holding the shard.
    pub sub_group: SubGroupId,
    /// Offset of the shard inside the sub-group, in elements.
    pub offset_in_group: usize,
}

/// A tile of the optimizer step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubGroup {
    /// Its index.
    pub id: SubGroupId,
    /// Params whose shards it holds, in order.
    pub params: Vec<ParamId>,
    /// Elements.
    pub numel: usize,
    /// Its gradients are final after the backward of this unit.
    pub final_after_unit: UnitId,
}

/// Shards and sub-groups of one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Indexed by `ParamId`.
    pub params: Vec<ParamSlot>,
    /// In order.
    pub sub_groups: Vec<SubGroup>,
    /// This rank.
    pub rank: usize,
    /// Ranks.
    pub world: usize,
}

/// Rank `rank`'s shard of a tensor of `numel` elements over `world` ranks:
/// `(first element, elements)`.
pub fn shard_range(numel: usize, rank: usize, world: usize) -> (usize, usize) {
    let chunk = numel.div_ceil(world.max(1));
    let start = (rank * chunk).min(numel);
    let end = ((rank + 1) * chunk).min(numel);
    (start, end - start)
}

/// Every rank's shard length of a tensor of `numel` elements, in rank order
/// (the counts of the gather and reduce-scatter collectives).
pub fn shard_counts(numel: usize, world: usize) -> Vec<usize> {
    (0..world.max(1))
        .map(|r| shard_range(numel, r, world).1)
        .collect()
}

impl Layout {
    /// Computes the layout of `model` for `rank` of `world` with sub-groups
    /// of at most `sub_group_numel` elements.
    pub fn new(model: &Model, rank: usize, world: usize, sub_group_numel: usize) -> Self {
        let world = world.max(1);
        let cap = sub_group_numel.max(1);
        let mut params = Vec::with_capacity(model.params().len());
        let mut groups: Vec<SubGroup> = Vec::new();
        for p in model.params() {
            let (start, shard) = shard_range(p.numel, rank, world);
            let first_unit = p.units.iter().copied().min().unwrap_or(UnitId(0));
            let need_new = match groups.last() {
                None => true,
                Some(g) => g.numel > 0 && g.numel + shard > cap,
            };
            if need_new {
                groups.push(SubGroup {
                    id: SubGroupId(groups.len()),
                    params: Vec::new(),
                    numel: 0,
                    final_after_unit: first_unit,
                });
            }
            let gi = groups.len() - 1;
            let g = &mut groups[gi];
            params.push(ParamSlot {
                id: p.id,
                numel: p.numel,
                shard_start: start,
                shard_numel: shard,
                sub_group: g.id,
                offset_in_group: g.numel,
            });
            g.params.push(p.id);
            g.numel += shard;
            g.final_after_unit = g.final_after_unit.min(first_unit);
        }
        Layout {
            params,
            sub_groups: groups,
            rank,
            world,
        }
    }

    /// Elements of the largest sub-group.
    pub fn max_sub_group_numel(&self) -> usize {
        self.sub_groups.iter().map(|g| g.numel).max().unwrap_or(0)
    }

    /// This rank's elements over all params.
    pub fn shard_numel(&self) -> usize {
        self.params.iter().map(|p| p.shard_numel).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_the_tensor_in_rank_order() {
        for numel in [0usize, 1, 5, 32, 33, 1000] {
            for world in 1..5 {
                let counts = shard_counts(numel, world);
                assert_eq!(counts.iter().sum::<usize>(), numel);
                let mut next = 0;
                for (r, &c) in counts.iter().enumerate() {
                    let (start, len) = shard_range(numel, r, world);
                    assert_eq!((start, len), (next.min(numel), c));
                    next = start + len;
                }
            }
        }
        assert_eq!(shard_counts(5, 2), vec![3, 2]);
        assert_eq!(shard_counts(32, 3), vec![11, 11, 10]);
    }
}

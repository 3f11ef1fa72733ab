//! Where each parameter's elements live: per-rank shards and optimizer
//! sub-groups.
//!
//! * **Shards.** Parameter `p` of `n` elements is cut into `world` contiguous
//!   shards of `ceil(n / world)` elements (the last ones shorter, possibly
//!   empty); rank `r` owns `[r·c, min((r+1)·c, n))`. With one rank the shard
//!   is the whole parameter.
//! * **Sub-groups.** This rank's shards, in `ParamId` order, are packed into
//!   sub-groups of at most `sub_group_size` elements. A shard larger than
//!   that is **tiled**: cut into pieces of `sub_group_size` elements, each
//!   the start of a sub-group of its own (the last piece packs with the
//!   shards after it). DeepSpeed's `_create_fp16_sub_groups` makes such a
//!   shard one oversized group instead, and every optimizer swap buffer
//!   grows to it (a 128k × 4096 embedding: 2 GB per fp32 buffer); here
//!   every sub-group, and so every buffer, is bounded by the config. The
//!   sub-group is the unit of optimizer I/O and of the step; Adam is
//!   element-wise, so the cut changes no value of the step. A tiled param's
//!   new 16-bit bytes come back piece by piece and are assembled by the
//!   param store before they are written home.
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
    /// The shard's pieces in order: one, unless the shard is larger than
    /// `sub_group_size` (then tiled over several sub-groups).
    pub pieces: Vec<Piece>,
}

impl ParamSlot {
    /// Whether the shard is cut over several sub-groups.
    pub fn is_tiled(&self) -> bool {
        self.pieces.len() > 1
    }
}

/// A contiguous range of one param's shard inside one sub-group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// The parameter.
    pub param: ParamId,
    /// The sub-group holding it.
    pub sub_group: SubGroupId,
    /// Its first element inside the sub-group.
    pub offset_in_group: usize,
    /// Its first element inside the param's shard.
    pub offset_in_shard: usize,
    /// Elements.
    pub numel: usize,
}

impl Piece {
    /// Its elements inside the sub-group.
    pub fn group_range(&self) -> std::ops::Range<usize> {
        self.offset_in_group..self.offset_in_group + self.numel
    }

    /// Its elements inside the param's shard.
    pub fn shard_range(&self) -> std::ops::Range<usize> {
        self.offset_in_shard..self.offset_in_shard + self.numel
    }
}

/// A tile of the optimizer step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubGroup {
    /// Its index.
    pub id: SubGroupId,
    /// The pieces of param shards it holds, in order (a tiled param has
    /// pieces in several groups).
    pub pieces: Vec<Piece>,
    /// Elements.
    pub numel: usize,
    /// Its gradients are final after the backward of this unit.
    pub final_after_unit: UnitId,
}

impl SubGroup {
    /// The params with a piece here, in order.
    pub fn param_ids(&self) -> impl Iterator<Item = ParamId> + '_ {
        self.pieces.iter().map(|p| p.param)
    }
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

/// The most optimizer sub-groups one rank's layout may have. Each is a
/// layout entry with its pieces, a state map entry and its own extents;
/// `sub_group_size: 10` cut GPT-2 small into 12.4M of them, and the layout
/// alone took gigabytes before anything said why.
pub const MAX_SUB_GROUPS: u64 = 1 << 20;

/// Refuses a `sub_group_numel` that cuts the largest rank's shard of a
/// model of `model_numel` elements on `world` ranks into more than
/// [`MAX_SUB_GROUPS`] sub-groups, naming the smallest `sub_group_size`
/// that does not. Called before any [`Layout::new`] of a user's config.
pub fn check_sub_group_count(
    model_numel: u64,
    world: usize,
    sub_group_numel: u64,
) -> crate::engine::Result<()> {
    let shard = model_numel.div_ceil(world.max(1) as u64);
    let groups = shard.div_ceil(sub_group_numel.max(1));
    if groups <= MAX_SUB_GROUPS {
        return Ok(());
    }
    Err(crate::engine::EngineError::Config {
        reason: format!(
            "zero_optimization.sub_group_size {sub_group_numel} cuts a rank's {shard} elements \
             into {groups} optimizer sub-groups, more than the {MAX_SUB_GROUPS} tierzero \
             supports; raise sub_group_size to at least {} (DeepSpeed's default is 1e9)",
            shard.div_ceil(MAX_SUB_GROUPS)
        ),
    })
}

impl Layout {
    /// Computes the layout of `model` for `rank` of `world` with sub-groups
    /// of at most `sub_group_numel` elements (checked first with
    /// [`check_sub_group_count`] where the size is the user's).
    pub fn new(model: &Model, rank: usize, world: usize, sub_group_numel: usize) -> Self {
        let world = world.max(1);
        let cap = sub_group_numel.max(1);
        let mut params = Vec::with_capacity(model.params().len());
        let mut groups: Vec<SubGroup> = Vec::new();
        for p in model.params() {
            let (start, shard) = shard_range(p.numel, rank, world);
            let first_unit = p.units.iter().copied().min().unwrap_or(UnitId(0));
            let mut pieces = Vec::new();
            let mut done = 0usize;
            // An empty shard still gets its (empty) piece, so every param
            // has a place.
            loop {
                let left = shard - done;
                if groups
                    .last()
                    .is_none_or(|g| g.numel > 0 && g.numel + left > cap)
                {
                    groups.push(SubGroup {
                        id: SubGroupId(groups.len()),
                        pieces: Vec::new(),
                        numel: 0,
                        final_after_unit: first_unit,
                    });
                }
                let gi = groups.len() - 1;
                let g = &mut groups[gi];
                // A fresh group takes at most `cap` (a tile of a larger
                // shard); a started one only ever gets a whole rest.
                let n = if g.numel == 0 { left.min(cap) } else { left };
                let piece = Piece {
                    param: p.id,
                    sub_group: g.id,
                    offset_in_group: g.numel,
                    offset_in_shard: done,
                    numel: n,
                };
                g.pieces.push(piece);
                g.numel += n;
                g.final_after_unit = g.final_after_unit.min(first_unit);
                pieces.push(piece);
                done += n;
                if done >= shard {
                    break;
                }
            }
            params.push(ParamSlot {
                id: p.id,
                numel: p.numel,
                shard_start: start,
                shard_numel: shard,
                pieces,
            });
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

    /// A sub_group_size cutting a rank's shard into more than
    /// `MAX_SUB_GROUPS` groups is refused with the smallest size that is
    /// not; exactly the limit passes; ranks divide the shard.
    #[test]
    fn too_many_sub_groups_are_refused_naming_the_smallest_size() {
        let n = 124_439_808u64;
        let e = match check_sub_group_count(n, 1, 10) {
            Err(e) => e.to_string(),
            Ok(()) => panic!("12.4M sub-groups passed"),
        };
        assert!(
            e.contains("into 12443981 optimizer sub-groups") && e.contains("at least 119"),
            "{e}"
        );
        assert!(check_sub_group_count(n, 1, 119).is_ok());
        assert!(check_sub_group_count(MAX_SUB_GROUPS, 1, 1).is_ok());
        assert!(check_sub_group_count(MAX_SUB_GROUPS + 1, 1, 1).is_err());
        assert!(check_sub_group_count(2 * MAX_SUB_GROUPS, 2, 1).is_ok());
        assert!(check_sub_group_count(1000, 1, 0).is_ok());
    }

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

    #[test]
    fn a_shard_larger_than_a_sub_group_is_tiled_and_every_element_has_one_place() {
        use crate::model::ModelConfig;
        let json = serde_json::json!({"model_type": "gpt2", "vocab_size": 300,
            "n_positions": 16, "n_embd": 32, "n_layer": 2, "n_head": 2,
            "tie_word_embeddings": true});
        let (cfg, _) =
            ModelConfig::from_hf_json(&json.to_string()).unwrap_or_else(|e| panic!("{e}"));
        let model = Model::new(cfg).unwrap_or_else(|e| panic!("{e}"));
        for world in [1usize, 2, 3] {
            for cap in [1000usize, 4096, 9600, 1 << 20] {
                for rank in 0..world {
                    let l = Layout::new(&model, rank, world, cap);
                    assert!(l.max_sub_group_numel() <= cap, "cap {cap}");
                    for slot in &l.params {
                        let mut next = 0;
                        for pc in &slot.pieces {
                            assert_eq!(pc.offset_in_shard, next);
                            next += pc.numel;
                            let g = &l.sub_groups[pc.sub_group.0];
                            assert!(g.pieces.contains(pc));
                        }
                        assert_eq!(next, slot.shard_numel);
                        assert_eq!(slot.is_tiled(), slot.shard_numel > cap);
                    }
                    for g in &l.sub_groups {
                        let mut at = 0;
                        for pc in &g.pieces {
                            assert_eq!(pc.offset_in_group, at);
                            at += pc.numel;
                        }
                        assert_eq!(at, g.numel);
                    }
                }
            }
        }
        // wte is 300 x 32 = 9600 elements: tiled at 4096 into 4096, 4096, 1408.
        let l = Layout::new(&model, 0, 1, 4096);
        let wte: Vec<usize> = l.params[0].pieces.iter().map(|p| p.numel).collect();
        assert_eq!(wte, vec![4096, 4096, 1408]);
    }
}

//! The activation policy: keep a block's forward graph until its backward
//! when it fits the budget, recompute it from its saved input when not.
//!
//! # What is kept
//!
//! Backward needs, for every block, what its forward computed. Recompute
//! (DeepSpeed's and HF's activation checkpointing, this engine's only mode
//! before) saves each unit's input and runs the forward again in backward:
//! one more forward per step, and, with params on NVMe or pinned memory,
//! one more fetch of the block's params. Keeping records the forward
//! graph instead ([`crate::model::Model::record_unit`]) and backpropagates
//! from it ([`crate::model::Model::backward_recorded`]): the params'
//! `Var` copies, the input and every intermediate stay in memory from the
//! block's forward to its backward, and backward fetches nothing for it.
//!
//! Only blocks are kept. The embedding is a lookup whose recompute costs
//! nothing, and keeping it would hold a copy of the table; the head runs
//! once, in backward, either way.
//!
//! # The budget
//!
//! `tierzero.activation_budget_bytes` ([`ActivationBudget`]):
//!
//! * `"auto"`: half the memory available (`MemAvailable`) once the engine
//!   is built, its buffers, params and optimizer state in place (the other
//!   half is left for the compute's transient workspace and the rest of
//!   the machine), divided among the run's ranks (they may share the
//!   machine);
//! * a byte count (0: recompute every block);
//! * DeepSpeed's `activation_checkpointing` block, or `tierzero train
//!   --gradient-checkpointing` (HF's switch): recompute every block.
//!
//! # The decision
//!
//! The first micro-batch of a batch shape (micro-batch × sequence length)
//! records every block while the running total fits: each record's
//! [`crate::model::RecordedUnit::held_bytes`] is measured, and a block is
//! kept if the total with it stays within the budget; from the first that
//! does not fit on, blocks are recomputed. A block whose graph would not
//! fit beside the kept ones by the last block's measure is not recorded
//! at all (recording it to measure held it and the kept ones at once, one
//! graph past the budget); only the first record can pass the budget so,
//! when one graph is larger than the whole budget. The decision holds for every
//! later micro-batch of that shape (a new shape decides again), so the
//! prefetcher's trace, which has no backward visit of a kept block, stays
//! the same step after step. Blocks of one model are alike, so the kept
//! ones are a prefix: the first `k` blocks.
//!
//! Keeping and recomputing run the same function on the same values, so
//! the gradients, losses and weights are the same bits either way
//! (`tests/engine_activations.rs`).

use crate::config::ActivationBudget;
use crate::model::RecordedUnit;

use candle_core::Tensor;

/// What the forward left for a unit's backward.
#[derive(Debug)]
pub(super) enum Saved {
    /// Its input (recompute).
    Input(Tensor),
    /// Its forward graph (keep).
    Kept(RecordedUnit),
}

/// The budget, resolved, and the decision per batch shape.
#[derive(Debug, Clone)]
pub(super) struct Activations {
    /// Bytes the kept graphs may hold at once (0: recompute every block).
    budget_bytes: u64,
    /// Where the budget came from.
    budget: ActivationBudget,
    /// The decision for the last batch shape seen.
    decided: Option<Decision>,
    /// The budget is the smallest rank's ([`Activations::agree`]).
    agreed: bool,
    /// Ranks of the run.
    ranks: usize,
}

/// Which blocks are kept for one batch shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// `[micro_batch, seq_len]`.
    pub shape: [usize; 2],
    /// Per unit (by `UnitId`): kept.
    pub keep: Vec<bool>,
    /// Per unit: the measured bytes of its graph (0 when not recorded).
    pub held_bytes: Vec<u64>,
    /// Blocks in the model.
    pub blocks: usize,
}

impl Decision {
    /// Kept blocks.
    pub fn kept(&self) -> usize {
        self.keep.iter().filter(|k| **k).count()
    }

    /// Bytes the kept graphs hold together.
    pub fn kept_bytes(&self) -> u64 {
        self.keep
            .iter()
            .zip(&self.held_bytes)
            .filter(|(k, _)| **k)
            .map(|(_, b)| *b)
            .sum()
    }
}

/// What a forward should do with a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Plan {
    /// Save the input; recompute in backward.
    Recompute,
    /// Record and keep (decided).
    Keep,
    /// Record, measure and keep if the running total fits (deciding).
    Try,
}

impl Activations {
    /// The budget resolved: `available_bytes` is `MemAvailable` now (the
    /// engine built), for `"auto"`, shared by `ranks` (the ranks of a run
    /// may share one machine, each building while the others do: each
    /// takes its share of the half).
    pub(super) fn new(
        budget: ActivationBudget,
        available_bytes: Option<u64>,
        ranks: usize,
    ) -> Self {
        let budget_bytes = match budget {
            ActivationBudget::Auto => available_bytes.map_or(0, |b| b / 2 / ranks.max(1) as u64),
            ActivationBudget::Bytes(b) => b,
            ActivationBudget::Checkpointing => 0,
        };
        Activations {
            budget_bytes,
            budget,
            decided: None,
            agreed: false,
            ranks,
        }
    }

    /// Takes the smallest rank's budget, once (a collective: every rank
    /// calls it at its first step). A kept block's backward fetches no
    /// params and a recomputed one does, a gather on stage 3, so every
    /// rank must keep the same blocks; `"auto"` budgets come from each
    /// rank's own `MemAvailable` at build, which differ.
    pub(super) fn agree(
        &mut self,
        comm: &dyn crate::engine::comm::Comm,
    ) -> crate::engine::Result<()> {
        if !self.agreed {
            self.budget_bytes = crate::engine::comm::least_among_ranks(comm, self.budget_bytes)?;
            self.agreed = true;
        }
        Ok(())
    }

    /// Bytes the kept graphs may hold at once.
    pub(super) fn budget_bytes(&self) -> u64 {
        self.budget_bytes
    }

    /// The decision for `shape`, if made.
    pub(super) fn decision(&self, shape: [usize; 2]) -> Option<&Decision> {
        self.decided.as_ref().filter(|d| d.shape == shape)
    }

    /// The last decision made.
    pub(super) fn last_decision(&self) -> Option<&Decision> {
        self.decided.as_ref()
    }

    /// Whether a forward of `shape` decides (measures and keeps what fits):
    /// a budget, and no decision for the shape yet.
    pub(super) fn deciding(&self, shape: [usize; 2]) -> bool {
        self.budget_bytes > 0 && self.decision(shape).is_none()
    }

    /// What to do with unit `unit` (a block) in a forward of `shape`.
    pub(super) fn plan(&self, shape: [usize; 2], unit: usize) -> Plan {
        if self.deciding(shape) {
            return Plan::Try;
        }
        match self.decision(shape) {
            Some(d) if self.budget_bytes > 0 && d.keep.get(unit).copied().unwrap_or(false) => {
                Plan::Keep
            }
            _ => Plan::Recompute,
        }
    }

    /// Records a decision (the first micro-batch of its shape).
    pub(super) fn decide(&mut self, decision: Decision) {
        self.decided = Some(decision);
    }

    /// The plan's line.
    pub(super) fn describe(&self) -> String {
        let why = match self.budget {
            ActivationBudget::Auto => {
                "auto: half the memory available once the engine is built".to_owned()
            }
            ActivationBudget::Bytes(b) => format!("tierzero.activation_budget_bytes {b}"),
            ActivationBudget::Checkpointing => {
                "activation checkpointing on: every block recomputed".to_owned()
            }
        };
        let agreed = if self.ranks > 1 && !self.agreed {
            "; this rank's: every rank takes the smallest rank's at the first step"
        } else {
            ""
        };
        if self.budget_bytes == 0 {
            format!("activations: every block recomputed in backward from its saved input ({why})")
        } else {
            format!(
                "activations: budget {} ({why}{agreed}); each block's forward graph is kept for \
                 its backward while the measured total fits, the others are recomputed \
                 (tierzero.activation_budget_bytes)",
                crate::units::format_bytes(self.budget_bytes)
            )
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[test]
    fn the_budget_resolves_by_its_source() {
        let auto = Activations::new(ActivationBudget::Auto, Some(10_000), 1);
        assert_eq!(auto.budget_bytes(), 5_000);
        assert_eq!(
            Activations::new(ActivationBudget::Auto, Some(10_000), 2).budget_bytes(),
            2_500
        );
        assert_eq!(
            Activations::new(ActivationBudget::Auto, None, 1).budget_bytes(),
            0
        );
        assert_eq!(
            Activations::new(ActivationBudget::Bytes(7), Some(10_000), 1).budget_bytes(),
            7
        );
        let ckpt = Activations::new(ActivationBudget::Checkpointing, Some(10_000), 1);
        assert_eq!(ckpt.budget_bytes(), 0);
        assert_eq!(ckpt.plan([1, 8], 1), Plan::Recompute);
        assert!(ckpt.describe().contains("every block recomputed"));
    }

    /// Every rank keeps the smallest rank's budget, agreed once: the
    /// kept blocks decide which backward fetches gather.
    #[test]
    fn the_budget_is_the_smallest_ranks_agreed_once() {
        use crate::engine::comm::scripted::Scripted;
        let peers = Scripted {
            gather_f64: Some(|local, out| {
                out.copy_from_slice(&[9_000.0, local[0], 1_234.0]);
                Ok(())
            }),
            ..Scripted::rank_of(1, 3)
        };
        let mut a = Activations::new(ActivationBudget::Auto, Some(10_000), 3);
        assert_eq!(a.budget_bytes(), 1_666);
        assert!(a
            .describe()
            .contains("every rank takes the smallest rank's"));
        a.agree(&peers).unwrap();
        assert_eq!(a.budget_bytes(), 1_234);
        assert!(!a.describe().contains("smallest rank's"));
        // Once: a later call issues no collective (an unscripted one
        // would fail).
        a.agree(&Scripted::rank_of(1, 3)).unwrap();
        assert_eq!(a.budget_bytes(), 1_234);
    }

    #[test]
    fn a_decision_holds_for_its_shape_only() {
        let mut a = Activations::new(ActivationBudget::Bytes(100), None, 1);
        assert_eq!(a.plan([2, 8], 1), Plan::Try);
        a.decide(Decision {
            shape: [2, 8],
            keep: vec![false, true, false, false],
            held_bytes: vec![0, 60, 60, 0],
            blocks: 2,
        });
        assert_eq!(a.plan([2, 8], 1), Plan::Keep);
        assert_eq!(a.plan([2, 8], 2), Plan::Recompute);
        assert_eq!(a.plan([2, 16], 1), Plan::Try);
        let d = a.decision([2, 8]).unwrap();
        assert_eq!((d.kept(), d.kept_bytes()), (1, 60));
    }
}

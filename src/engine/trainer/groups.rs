//! One typed state per sub-group within a step ([`GroupStep`]), moved
//! only by [`GroupEvent`]s through [`StepGroups::apply`] (see "A step" in
//! the trainer's module docs).

use super::*;

/// Where one sub-group stands within a step. A step keeps exactly one of
/// these per sub-group ([`StepGroups`]), moved only by [`GroupEvent`]s
/// (see "A step" in the module docs):
///
/// ```text
/// Parked ◀──Park── Accumulating ──Norm──▶ Normed ──Spill──▶ Spilled
///   └────Unpark─────▶ │                   │  └──Speculate──▶ Speculated
///                     └──────Send─────────┴───────Send─────────┴──▶ Sent
/// ```
///
/// (`Park`/`Unpark`: between micro-batches, the partial sum waits on NVMe,
/// see `crate::engine::grads`.)
///
/// (`Send` from `Spilled` and `Speculated` hands on no gradient: the
/// optimizer thread has it.)
#[derive(Debug)]
pub(super) enum GroupStep {
    /// Backward adds gradients into its fp32 accumulator (`None` until the
    /// first one).
    Accumulating(Option<Vec<f32>>),
    /// Between micro-batches: its partial sum is in the gradient park.
    Parked,
    /// Its gradients are final and its Σg² taken; the gradient waits in
    /// memory for the step (clipping or fp16).
    Normed { grad: Option<Vec<f32>>, sq: f64 },
    /// Final with its Σg² taken; the gradient was spilled to NVMe and is
    /// read back with the state.
    Spilled { sq: f64 },
    /// Final with its Σg² taken; stepped speculatively (no clip, no
    /// overflow) on the optimizer thread, which keeps the gradient for a
    /// re-step.
    Speculated { sq: f64 },
    /// Its step was sent to the optimizer thread.
    Sent,
}

/// What can happen to a sub-group within a step.
#[derive(Debug)]
pub(super) enum GroupEvent {
    /// Its partial sum goes to the gradient park (returned by
    /// [`StepGroups::apply`]) until the next micro-batch adds to it.
    Park,
    /// Its partial sum is back from the park.
    Unpark(Vec<f32>),
    /// Its Σg² was taken (its gradients are final).
    Norm(f64),
    /// Its gradient goes to NVMe (returned by [`StepGroups::apply`]).
    Spill,
    /// Its step goes to the optimizer thread with the gradient returned
    /// by [`StepGroups::apply`] (zeros if none came; `None` if spilled).
    Send,
    /// Its speculative step goes to the optimizer thread with the
    /// gradient returned by [`StepGroups::apply`].
    Speculate,
}

/// The step state of every sub-group, in index order.
#[derive(Debug)]
pub(super) struct StepGroups {
    pub(super) groups: Vec<GroupStep>,
    /// Reduce-scatters of gradients this step issued.
    pub(super) grad_reduces: u64,
}

impl StepGroups {
    pub(super) fn new(n: usize) -> StepGroups {
        StepGroups {
            groups: (0..n).map(|_| GroupStep::Accumulating(None)).collect(),
            grad_reduces: 0,
        }
    }

    pub(super) fn get_mut(&mut self, sg: SubGroupId) -> Result<&mut GroupStep> {
        self.groups
            .get_mut(sg.0)
            .ok_or_else(|| EngineError::internal(format!("no sub-group {}", sg.0)))
    }

    /// The accumulator of `sg` (created zeroed, `numel` elements): only
    /// while its gradients are not final.
    pub(super) fn accumulator(&mut self, sg: SubGroupId, numel: usize) -> Result<&mut Vec<f32>> {
        match self.get_mut(sg)? {
            GroupStep::Accumulating(acc) => {
                Ok(acc.get_or_insert_with(|| crate::model::fused::zeros_f32(numel)))
            }
            other => Err(EngineError::internal(format!(
                "a gradient for sub-group {} after it became final ({})",
                sg.0,
                other.name()
            ))),
        }
    }

    /// `sg`'s Σg², taken now if not yet (`Accumulating → Normed`).
    pub(super) fn norm(&mut self, sg: SubGroupId, adam: &CpuAdam) -> Result<f64> {
        let sq = match self.get_mut(sg)? {
            GroupStep::Normed { sq, .. }
            | GroupStep::Spilled { sq }
            | GroupStep::Speculated { sq } => return Ok(*sq),
            GroupStep::Accumulating(acc) => acc.as_ref().map_or(0.0, |g| adam.grad_sq_norm(g)),
            GroupStep::Parked => {
                return Err(EngineError::internal(format!(
                    "the norm of sub-group {} while its sum is parked",
                    sg.0
                )))
            }
            GroupStep::Sent => {
                return Err(EngineError::internal(format!(
                    "the norm of sub-group {} after its step was sent",
                    sg.0
                )))
            }
        };
        self.apply(sg, GroupEvent::Norm(sq), 0)?;
        Ok(sq)
    }

    /// The only way a sub-group's state changes. Returns the gradient the
    /// event hands on: the spilled one for `Spill`, the step's for `Send`
    /// (`numel` zeros if no gradient came; `None` once spilled).
    pub(super) fn apply(
        &mut self,
        sg: SubGroupId,
        event: GroupEvent,
        numel: usize,
    ) -> Result<Option<Vec<f32>>> {
        let slot = self.get_mut(sg)?;
        let old = std::mem::replace(slot, GroupStep::Sent);
        let zeros_if_none = |g: Option<Vec<f32>>| Some(g.unwrap_or_else(|| vec![0f32; numel]));
        let (new, out) = match (old, event) {
            (GroupStep::Accumulating(Some(sum)), GroupEvent::Park) => {
                (GroupStep::Parked, Some(sum))
            }
            (GroupStep::Parked, GroupEvent::Unpark(sum)) => {
                (GroupStep::Accumulating(Some(sum)), None)
            }
            (GroupStep::Accumulating(grad), GroupEvent::Norm(sq)) => {
                (GroupStep::Normed { grad, sq }, None)
            }
            (GroupStep::Normed { grad, sq }, GroupEvent::Spill) => {
                (GroupStep::Spilled { sq }, zeros_if_none(grad))
            }
            (GroupStep::Accumulating(grad) | GroupStep::Normed { grad, .. }, GroupEvent::Send) => {
                (GroupStep::Sent, zeros_if_none(grad))
            }
            (GroupStep::Normed { grad, sq }, GroupEvent::Speculate) => {
                (GroupStep::Speculated { sq }, zeros_if_none(grad))
            }
            (GroupStep::Spilled { .. } | GroupStep::Speculated { .. }, GroupEvent::Send) => {
                (GroupStep::Sent, None)
            }
            (old, event) => {
                let from = old.name();
                *slot = old;
                let event = match event {
                    GroupEvent::Unpark(_) => "Unpark".to_owned(),
                    other => format!("{other:?}"),
                };
                return Err(EngineError::internal(format!(
                    "sub-group {}: {event} while {from}",
                    sg.0
                )));
            }
        };
        *slot = new;
        Ok(out)
    }

    pub(super) fn is_sent(&self, sg: SubGroupId) -> bool {
        matches!(self.groups.get(sg.0), Some(GroupStep::Sent))
    }

    /// The sub-groups stepped speculatively, in index order.
    pub(super) fn speculated(&self) -> Vec<SubGroupId> {
        self.groups
            .iter()
            .enumerate()
            .filter(|(_, g)| matches!(g, GroupStep::Speculated { .. }))
            .map(|(i, _)| SubGroupId(i))
            .collect()
    }

    pub(super) fn sent_count(&self) -> usize {
        self.groups
            .iter()
            .filter(|g| matches!(g, GroupStep::Sent))
            .count()
    }
}

impl GroupStep {
    pub(super) fn name(&self) -> &'static str {
        match self {
            GroupStep::Accumulating(_) => "Accumulating",
            GroupStep::Parked => "Parked",
            GroupStep::Normed { .. } => "Normed",
            GroupStep::Spilled { .. } => "Spilled",
            GroupStep::Speculated { .. } => "Speculated",
            GroupStep::Sent => "Sent",
        }
    }
}

/// The gradient park's side of a step: sums parked after the unit that
/// completes them, prefetched, and taken back before the next addition.
impl Trainer {
    /// After `uid`'s backward in a micro-batch before the last: the
    /// sub-groups it completed go to the gradient park (if there is one).
    pub(super) fn park_final_groups(&mut self, uid: UnitId, groups: &mut StepGroups) -> Result<()> {
        let Some(park) = self.park.as_mut() else {
            return Ok(());
        };
        let done = self.groups_after_unit.get(uid.0).map_or(&[][..], |g| g);
        for &sg in done {
            if matches!(
                groups.groups.get(sg.0),
                Some(GroupStep::Accumulating(Some(_)))
            ) {
                if let Some(sum) = groups.apply(sg, GroupEvent::Park, 0)? {
                    park.park(sg, &sum)?;
                }
            }
        }
        Ok(())
    }

    /// Issues the park's reads of the sums the next units will add to, in
    /// backward order, as far as its buffers allow.
    pub(super) fn prefetch_parked(&mut self) -> Result<()> {
        match self.park.as_mut() {
            Some(park) => park.prefetch_in(&self.backward_order),
            None => Ok(()),
        }
    }

    /// The gradient park's counters (zeros without one).
    pub(super) fn park_counters(&self) -> ParkCounters {
        self.park
            .as_ref()
            .map(GradPark::counters)
            .unwrap_or_default()
    }

    /// Brings `sg`'s parked sum back into memory (no-op if not parked).
    pub(super) fn unpark(&mut self, groups: &mut StepGroups, sg: SubGroupId) -> Result<()> {
        if !matches!(groups.groups.get(sg.0), Some(GroupStep::Parked)) {
            return Ok(());
        }
        let park = self
            .park
            .as_mut()
            .ok_or_else(|| EngineError::internal("a parked sum without a park"))?;
        let sum = park.take(sg)?;
        groups.apply(sg, GroupEvent::Unpark(sum), 0)?;
        Ok(())
    }
}

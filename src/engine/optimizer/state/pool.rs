//! The speculation pool of [`OptimizerState`] (see "Speculative steps" in
//! the parent's docs): slots taken by speculative steps, made current by
//! [`OptimizerState::commit`], returned on a miss; and the state writes a
//! slot or a read waits for.

use super::*;

impl OptimizerState {
    /// Makes the speculative steps of `groups` current: waits for every
    /// write, then each group's pending slot becomes its extents and its
    /// old extents a free slot of the pool.
    pub fn commit(&mut self, groups: &[SubGroupId]) -> Result<()> {
        self.flush()?;
        self.retire_spill_writes(true)?;
        crate::failpoint::kill_point(crate::failpoint::Site::SpeculativeBeforeCommit);
        let Some(nv) = &mut self.nvme else {
            return Ok(());
        };
        for &sg in groups {
            let (Some(e), Some(p)) = (nv.extents.get_mut(sg.0), nv.pending.get_mut(sg.0)) else {
                return Err(EngineError::internal(format!(
                    "commit of unknown sub-group {sg:?}"
                )));
            };
            let (Some(cur), Some(new)) = (e.as_mut(), p.take()) else {
                return Err(EngineError::internal(format!(
                    "commit of sub-group {sg:?} without a speculative step"
                )));
            };
            let old = std::mem::replace(cur, new.ext);
            // Every write has retired (`flush` above).
            nv.pool.push(Slot {
                ext: old,
                last_write: nv.writes_issued,
            });
            if let Some(f) = nv.spilled.get_mut(sg.0) {
                *f = None;
            }
        }
        Ok(())
    }

    /// State writes queued and not retired.
    #[cfg(test)]
    pub fn writes_queued(&self) -> usize {
        self.nvme.as_ref().map_or(0, |nv| nv.writes.len())
    }

    /// Slots of the speculation pool (free or pending).
    #[cfg(test)]
    pub fn pool_slots(&self) -> usize {
        self.nvme.as_ref().map_or(0, |nv| nv.pool_slots)
    }

    /// The most speculated gradients kept in host memory for a re-step
    /// ([`PoolSize::kept_grads`], the sizing policy's).
    pub fn kept_grads_max(&self) -> usize {
        self.kept_grads
    }

    /// Sub-groups with a speculative step not yet committed or dropped.
    pub fn pending_speculations(&self) -> usize {
        self.nvme
            .as_ref()
            .map_or(0, |nv| nv.pending.iter().flatten().count())
    }

    /// Takes the smallest free slot that holds `numel` elements for `sg`'s
    /// speculative step, first retiring writes until its last one has.
    pub(super) fn take_slot(&mut self, sg: SubGroupId, numel: usize) -> Result<Slot> {
        let nv = self
            .nvme
            .as_mut()
            .ok_or_else(|| EngineError::internal("nvme state missing"))?;
        if nv.pending.get(sg.0).is_some_and(Option::is_some) {
            return Err(EngineError::internal(format!(
                "a second speculative step of sub-group {sg:?} before its commit"
            )));
        }
        let need = (numel.max(1) * 4) as u64;
        let best = nv
            .pool
            .iter()
            .enumerate()
            .filter(|(_, s)| s.ext[0].len_bytes() >= need)
            .min_by_key(|(_, s)| s.ext[0].len_bytes())
            .map(|(i, _)| i)
            .ok_or_else(|| {
                EngineError::internal(format!(
                    "a speculative step of sub-group {sg:?} with the speculation pool empty \
                     ({} slots)",
                    nv.pool_slots
                ))
            })?;
        let slot = nv.pool.swap_remove(best);
        self.retire_writes_through(slot.last_write)?;
        Ok(slot)
    }

    /// Retires state writes, oldest first, until write number `last`
    /// (counted from 1; 0 is none) has.
    pub(super) fn retire_writes_through(&mut self, last: u64) -> Result<()> {
        while self
            .nvme
            .as_ref()
            .is_some_and(|nv| nv.writes_retired < last)
        {
            let queued = self.nvme.as_ref().map_or(0, |nv| nv.writes.len());
            if queued == 0 {
                return Err(EngineError::internal(
                    "a state write neither queued nor retired",
                ));
            }
            self.retire_writes(queued - 1)?;
        }
        Ok(())
    }

    /// Returns `sg`'s pending slot, if any, to the pool (its write may
    /// still be in flight: see [`OptimizerState::take_slot`]).
    pub(super) fn release_pending(&mut self, sg: SubGroupId) {
        if let Some(nv) = &mut self.nvme {
            if let Some(s) = nv.pending.get_mut(sg.0).and_then(Option::take) {
                nv.pool.push(s);
            }
        }
    }
}

//! A unit's gradients into this rank's sub-group accumulators: a tied
//! param's summed over its units first, then each param's reduce-scatter
//! in rank order, on the host ([`Trainer::accumulate_unit`]; one rank,
//! read where a device's copies landed them:
//! [`Trainer::accumulate_downloaded`]) or on the device that kept them
//! ([`Trainer::accumulate_on_device`]).

use super::super::groups::GradSum;
use super::*;
use crate::model::exec_units::{with_host_elems, HostElems};

/// A unit's params' slots, each cut into per-rank counts, and this rank's
/// accumulated shards of them, concatenated in order: `None` while
/// nothing has been summed into any of them this step (every one
/// `+0.0`, and nothing read to say so).
struct ShardAccs {
    slots: Vec<crate::engine::layout::ParamSlot>,
    counts: Vec<Vec<usize>>,
    acc: Option<Vec<f32>>,
}

impl ShardAccs {
    /// The accumulated shards, `+0.0` where nothing was summed yet.
    fn acc_or_zeros(&mut self) -> Vec<f32> {
        self.acc
            .take()
            .unwrap_or_else(|| vec![0.0; self.slots.iter().map(|s| s.shard_numel).sum()])
    }
}

impl Trainer {
    /// Adds a unit's gradients into the sub-group accumulators, in the
    /// order given.
    ///
    /// A param used by several units (a tied embedding: head, then
    /// embedding) gets several gradients per micro-batch; they are first
    /// summed locally in backward order (`h + e`) and reduced once, after
    /// its last unit (the smallest, reached last in backward). Every
    /// micro-batch thus adds exactly one gradient per param into the
    /// accumulator, and N ranks adding theirs in rank order reproduce one
    /// rank's order over the same micro-batches bit for bit. The price is
    /// one full fp32 gradient of such a param held during backward (as
    /// PyTorch's autograd holds it before ZeRO's hook sees it).
    ///
    /// With one rank a param used by one unit is added into its sums as it
    /// is stored, in parallel on the host pool, with no fp32 copy
    /// ([`Self::add_into`]).
    ///
    /// With several ranks the unit's gradients go through **one**
    /// reduce-scatter: rank `r`'s chunk is every param's chunk `r`, one
    /// after the other ([`crate::engine::comm::RankChunks`], each gradient
    /// widened straight into its chunks), and this rank's accumulator
    /// slices are added to as one buffer, chunk by chunk in rank order:
    /// per element the same additions in the same order as a
    /// reduce-scatter each, for one collective's latency a unit instead of
    /// one a param.
    pub(super) fn accumulate_unit(
        &mut self,
        groups: &mut StepGroups,
        tied: &mut BTreeMap<ParamId, Vec<f32>>,
        unit: UnitId,
        grads: &[(ParamId, Tensor)],
    ) -> Result<()> {
        if self.layout.world == 1 {
            // No collective: the adds split over the host pool's threads
            // (the step runs on it already when the compute is on the CPU).
            let pool = self.host_pool.clone();
            return pool.run(|| {
                for (pid, grad) in grads {
                    with_host_elems(
                        grad,
                        |e| Ok(self.one_rank_grad(groups, tied, unit, *pid, e)),
                    )??;
                }
                Ok(())
            });
        }
        // The gradients whose sum is complete at this unit: a param used
        // by this unit alone as stored (`None`: widened straight into its
        // chunks below), a tied one's sum over its units once its last
        // unit is here.
        let mut ready: Vec<(ParamId, Option<Vec<f32>>, &Tensor)> = Vec::with_capacity(grads.len());
        for (pid, grad) in grads {
            if self.model.in_one_unit(*pid) {
                ready.push((*pid, None, grad));
            } else if let Some(sum) =
                with_host_elems(grad, |e| Ok(self.local_grad(tied, unit, *pid, e)))??
            {
                ready.push((*pid, Some(sum), grad));
            }
        }
        let ids: Vec<ParamId> = ready.iter().map(|(pid, _, _)| *pid).collect();
        let mut accs = self.shard_accs(groups, &ids)?;
        let mut acc = accs.acc_or_zeros();
        let lens: Vec<usize> = ready
            .iter()
            .map(|(_, sum, grad)| sum.as_ref().map_or_else(|| grad.elem_count(), Vec::len))
            .collect();
        let chunks = crate::engine::comm::RankChunks::new(&lens, &accs.counts)?;
        // Every element of `full` is some chunk's: written once below.
        let mut full = vec![0f32; chunks.total_numel()];
        let pool = self.host_pool.clone();
        pool.run(|| -> Result<()> {
            for (p, (_, sum, grad)) in ready.iter().enumerate() {
                let mut lay = |e: HostElems<'_>| {
                    chunks.chunks(p).try_for_each(|(to, from)| {
                        crate::model::fused::widen_elems_into(&mut full[to], e, from)
                    })
                };
                match sum {
                    Some(sum) => lay(HostElems::F32(sum))?,
                    None => with_host_elems(grad, |e| Ok(lay(e)))??,
                }
            }
            Ok(())
        })?;
        self.opts
            .comm
            .reduce_scatter_add_f32(&full, chunks.blocks(), &mut acc)?;
        // A large embedding's `full` is a mapping of its own: unmapped off
        // this thread (`heap::free_off_thread`).
        let bytes = std::mem::size_of_val(full.as_slice());
        crate::engine::host::heap::free_off_thread(full, bytes, self.placement.helper_cpus());
        groups.grad_reduces += 1;
        self.store_shard_accs(groups, &accs.slots, &acc)
    }

    /// One rank: `unit`'s gradients that its device left downloading
    /// ([`crate::model::exec_units::UnitCompute::take_grads_with`]) read
    /// into the sums where the copies landed (the link's pinned staging
    /// buffers), as [`Self::accumulate_unit`] reads a host tensor's: the
    /// same additions, without a host copy of each gradient first. A
    /// unit that left none adds nothing.
    pub(super) fn accumulate_downloaded(
        &mut self,
        groups: &mut StepGroups,
        tied: &mut BTreeMap<ParamId, Vec<f32>>,
        unit: UnitId,
        compute: &dyn crate::model::exec_units::UnitCompute,
    ) -> Result<()> {
        if self.layout.world != 1 {
            return Err(EngineError::internal(
                "gradients read where they landed with several ranks \
                 (their collective wants them whole)",
            ));
        }
        let pool = self.host_pool.clone();
        pool.run(|| {
            let mut first: Result<()> = Ok(());
            let taken = compute.take_grads_with(unit, &mut |pid, e| {
                if first.is_ok() {
                    first = self.one_rank_grad(groups, tied, unit, pid, e);
                }
            });
            // The first error: after one here, the link hands on nothing
            // more, so any error it returns came later.
            first?;
            taken.map(|_| ()).map_err(Into::into)
        })
    }

    /// One rank: `pid`'s gradient from `unit` (its elements as stored)
    /// into its sums: straight in if only `unit` uses it, else summed
    /// over its units first ([`Self::local_grad`]).
    fn one_rank_grad(
        &mut self,
        groups: &mut StepGroups,
        tied: &mut BTreeMap<ParamId, Vec<f32>>,
        unit: UnitId,
        pid: ParamId,
        grad: HostElems<'_>,
    ) -> Result<()> {
        if self.model.in_one_unit(pid) {
            self.add_into(groups, pid, grad)
        } else if let Some(full) = self.local_grad(tied, unit, pid, grad)? {
            // One rank: the reduce-scatter of the tied sum is that sum.
            self.add_into(groups, pid, HostElems::F32(&full))
        } else {
            Ok(())
        }
    }

    /// Several ranks: a unit's gradients kept on its device
    /// ([`crate::model::exec_units::UnitCompute::grads_on_device`]: `ids`, in
    /// declared order) reduce-scattered there
    /// ([`crate::model::exec_units::UnitCompute::reduce_grads`]): the
    /// device adds every rank's chunk onto this rank's accumulated shards
    /// in rank order, as [`Self::accumulate_unit`]'s collective does on
    /// the host, and only those shards come down, read into the sums
    /// where they landed. None of them is tied (the device keeps no
    /// unit's that is: its sum spans two units).
    pub(super) fn accumulate_on_device(
        &mut self,
        groups: &mut StepGroups,
        compute: &dyn crate::model::exec_units::UnitCompute,
        unit: UnitId,
        ids: &[ParamId],
    ) -> Result<()> {
        if let Some(pid) = ids.iter().find(|&&p| !self.model.in_one_unit(p)) {
            return Err(EngineError::internal(format!(
                "param {} of unit {} is tied, but its gradient was kept on the device",
                pid.0, unit.0
            )));
        }
        let ShardAccs { slots, counts, acc } = self.shard_accs(groups, ids)?;
        // Sums not yet begun are +0.0 on the device too: the same bits,
        // and nothing to upload.
        let acc = acc.filter(|a| a.iter().any(|v| v.to_bits() != 0));
        let want_numel: usize = slots.iter().map(|s| s.shard_numel).sum();
        let mut stored = Err(EngineError::internal(format!(
            "the device handed no gradient sums for unit {}",
            unit.0
        )));
        let this = &*self;
        compute.reduce_grads(unit, &counts, acc.as_deref(), &mut |sums| {
            stored = if sums.len() == want_numel {
                this.store_shard_accs(groups, &slots, sums)
            } else {
                Err(EngineError::internal(format!(
                    "the device reduced {} gradient elements for unit {}, not {want_numel}",
                    sums.len(),
                    unit.0
                )))
            };
        })?;
        stored?;
        groups.grad_reduces += 1;
        Ok(())
    }

    /// The layout slots of `ids`, each cut into per-rank counts, and this
    /// rank's accumulated shards of them, concatenated in order (their
    /// parked sums brought back first). A piece nothing was summed into
    /// yet is not read: its shard is `+0.0`, and its sum is overwritten
    /// whole by [`Self::store_shard_accs`] (neither zeroed nor copied).
    fn shard_accs(&mut self, groups: &mut StepGroups, ids: &[ParamId]) -> Result<ShardAccs> {
        let world = self.layout.world;
        let mut slots = Vec::with_capacity(ids.len());
        for pid in ids {
            let slot = self.param_slot(*pid)?;
            self.unpark_slot(groups, &slot)?;
            slots.push(slot);
        }
        let counts: Vec<Vec<usize>> = slots.iter().map(|s| shard_counts(s.numel, world)).collect();
        let summed = |g: &StepGroups, pc: &crate::engine::layout::Piece| {
            g.summed(pc.sub_group, pc.group_range())
        };
        if !slots
            .iter()
            .flat_map(|s| &s.pieces)
            .any(|pc| summed(groups, pc))
        {
            return Ok(ShardAccs {
                slots,
                counts,
                acc: None,
            });
        }
        let mut acc = vec![0f32; slots.iter().map(|s| s.shard_numel).sum()];
        let mut start = 0;
        for slot in &slots {
            let shard = &mut acc[start..start + slot.shard_numel];
            for pc in &slot.pieces {
                if !summed(groups, pc) {
                    continue;
                }
                let (sum, _) = self.piece_sum(groups, pc)?.piece(pc.group_range())?;
                shard
                    .get_mut(pc.shard_range())
                    .filter(|s| s.len() == sum.len())
                    .ok_or_else(|| EngineError::internal("grad shard out of range"))?
                    .copy_from_slice(sum);
            }
            start += slot.shard_numel;
        }
        Ok(ShardAccs {
            slots,
            counts,
            acc: Some(acc),
        })
    }

    /// [`Self::shard_accs`]'s shards, summed into, back into the
    /// sub-groups' accumulators: each piece's sum overwritten whole
    /// (split over threads when long).
    fn store_shard_accs(
        &self,
        groups: &mut StepGroups,
        slots: &[crate::engine::layout::ParamSlot],
        acc: &[f32],
    ) -> Result<()> {
        let mut at = 0;
        for slot in slots {
            let n = slot.shard_numel;
            let part = acc
                .get(at..at + n)
                .ok_or_else(|| EngineError::internal("reduced gradients too short"))?;
            for pc in &slot.pieces {
                // Checked before `piece` marks the range written: an error
                // leaves no stale values counted as sums.
                let src = part
                    .get(pc.shard_range())
                    .filter(|s| s.len() == pc.group_range().len())
                    .ok_or_else(|| EngineError::internal("grad shard out of range"))?;
                let (sum, _) = self.piece_sum(groups, pc)?.piece(pc.group_range())?;
                tierzero_gpu::host_copy::copy(sum, src);
            }
            at += n;
        }
        Ok(())
    }

    /// Brings back the sums parked after the last micro-batch in the
    /// sub-groups holding `slot`'s param: they are added to first.
    fn unpark_slot(
        &mut self,
        groups: &mut StepGroups,
        slot: &crate::engine::layout::ParamSlot,
    ) -> Result<()> {
        for pc in &slot.pieces {
            self.unpark(groups, pc.sub_group)?;
        }
        Ok(())
    }

    /// `pid`'s layout slot.
    fn param_slot(&self, pid: ParamId) -> Result<crate::engine::layout::ParamSlot> {
        self.layout
            .params
            .get(pid.0)
            .cloned()
            .ok_or_else(|| EngineError::internal("grad of unknown param"))
    }

    /// The accumulator of `pc`'s sub-group (taken, from a spare if one
    /// is kept, at its first gradient). Its [`GradSum::piece`] says
    /// whether the piece's values are stale: its first gradient is then
    /// set, not added ([`GradSum::put`]), or overwritten whole
    /// ([`Self::store_shard_accs`]).
    fn piece_sum<'g>(
        &self,
        groups: &'g mut StepGroups,
        pc: &crate::engine::layout::Piece,
    ) -> Result<&'g mut GradSum> {
        let numel = self.sub_group_numel(pc.sub_group)?;
        let dtype = self.sum_dtype(pc.sub_group);
        groups.accumulator(pc.sub_group, numel, dtype, &self.spare_sums)
    }

    /// `grad` of `pid` from `unit` as a flat fp32 vector, summed with the
    /// earlier units' gradients of a tied param; `None` until its last
    /// unit (the sum is held in `tied` meanwhile).
    fn local_grad(
        &mut self,
        tied: &mut BTreeMap<ParamId, Vec<f32>>,
        unit: UnitId,
        pid: ParamId,
        grad: HostElems<'_>,
    ) -> Result<Option<Vec<f32>>> {
        // Widened in parallel on the host pool: added straight onto an
        // earlier unit's sum, else copied once.
        let pool = self.host_pool.clone();
        let full = match tied.remove(&pid) {
            Some(mut sum) => {
                pool.run(|| crate::model::fused::add_grad_elems_into(&mut sum, grad, 0))?;
                sum
            }
            None => pool.run(|| crate::model::fused::elems_to_f32(grad)),
        };
        let last_unit = self
            .model
            .params()
            .get(pid.0)
            .and_then(|p| p.units.iter().copied().min())
            .unwrap_or(unit);
        if unit != last_unit {
            tied.insert(pid, full);
            return Ok(None);
        }
        Ok(Some(full))
    }

    /// One rank: puts `grad`, the gradient of `pid` (used by one unit, or a
    /// tied param's sum over its units), into its sub-groups' accumulators
    /// from its elements as they are stored, in parallel ([`GradSum::put`]:
    /// set or added into fp32 sums, copied into bf16 ones): the same
    /// additions as one rank's reduce-scatter of its fp32 copy, without
    /// the copies.
    fn add_into(
        &mut self,
        groups: &mut StepGroups,
        pid: ParamId,
        grad: HostElems<'_>,
    ) -> Result<()> {
        let slot = self.param_slot(pid)?;
        if grad.len() != slot.numel {
            return Err(EngineError::internal(format!(
                "a gradient of {} elements for param {} of {}",
                grad.len(),
                pid.0,
                slot.numel
            )));
        }
        self.unpark_slot(groups, &slot)?;
        groups.grad_reduces += 1;
        for pc in &slot.pieces {
            self.piece_sum(groups, pc)?
                .put(pc.group_range(), grad, pc.shard_range().start)?;
        }
        Ok(())
    }
}

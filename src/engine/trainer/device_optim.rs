//! The optimizer on the compute's device
//! ([`crate::model::exec_units::DeviceOptimizer`]): with nothing offloaded
//! to the host, the units' compute keeps the params, their gradient sums
//! and Adam's state on the device and steps there. The trainer then runs
//! the step's decision (skip, clip) on the device's Σg² and never sends a
//! sub-group to the optimizer thread; the thread's state is the host copy:
//!
//! * **loaded** into the device before the first step (a fresh run's
//!   masters and zero moments, or a resumed checkpoint's), param by
//!   param, each assembled from its sub-group pieces;
//! * **written back** when the trainer settles (a checkpoint, the final
//!   weights, [`Trainer::master`]): each param's master and moments
//!   downloaded once, each sub-group's state replaced on the optimizer
//!   thread, and each param's new storage bytes (the master in the storage
//!   dtype, as the host's step would encode it) written to the param store.
//!
//! Between the two the host's params and state are those of the last
//! write-back; the units read the device's.

use super::*;
use crate::model::exec_units::UnitCompute;

impl Trainer {
    /// The units' compute, when it holds the optimizer.
    pub(super) fn device_compute(&self) -> Option<Arc<dyn UnitCompute>> {
        if self.opts.skip_compute {
            return None;
        }
        self.opts
            .compute
            .clone()
            .filter(|c| c.device_optimizer().is_some())
    }

    /// Loads every param's state into the device, once per trainer (a
    /// device that already holds every param's state from an earlier
    /// trainer is loaded again, from this one's).
    pub(super) fn load_device_optimizer(&mut self) -> Result<()> {
        let Some(compute) = self.device_compute() else {
            return Ok(());
        };
        let Some(dev) = compute.device_optimizer() else {
            return Ok(());
        };
        if self.device_loaded {
            return Ok(());
        }
        let groups = self.layout.sub_groups.clone();
        let slots = self.layout.params.clone();
        // Params are loaded in param order on every rank (with several,
        // at stages 0-2 the last load gathers every param's weights, a
        // collective). The layout gives every param a
        // piece in order, an empty one for a shard of no elements here,
        // which loads empty in its turn.
        let mut next = 0usize;
        // A param tiled over several groups is assembled across them.
        let mut open: BTreeMap<ParamId, [Vec<f32>; 3]> = BTreeMap::new();
        for g in groups {
            let sg = g.id;
            let states = self.exclusive(move |st| st.group_states(sg))?;
            for pc in &g.pieces {
                if pc.param.0 != next {
                    return Err(EngineError::internal(
                        "the sub-groups' pieces are not in param order",
                    ));
                }
                let slot = slots
                    .get(pc.param.0)
                    .ok_or_else(|| EngineError::internal("a piece of an unknown param"))?;
                let whole = open
                    .entry(pc.param)
                    .or_insert_with(|| std::array::from_fn(|_| vec![0f32; slot.shard_numel]));
                for (dst, src) in whole.iter_mut().zip(&states) {
                    let from = src
                        .get(pc.group_range())
                        .ok_or_else(|| EngineError::internal("a piece outside its sub-group"))?;
                    dst.get_mut(pc.shard_range())
                        .ok_or_else(|| EngineError::internal("a piece outside its param"))?
                        .copy_from_slice(from);
                }
                if pc.offset_in_shard + pc.numel == slot.shard_numel {
                    if let Some([master, m, v]) = open.remove(&pc.param) {
                        dev.load(pc.param, [&master, &m, &v])?;
                        next = pc.param.0 + 1;
                    }
                }
            }
        }
        if !open.is_empty() || !dev.is_loaded() {
            return Err(EngineError::internal(
                "the device optimizer was not given every param",
            ));
        }
        self.device_dirty = false;
        self.device_loaded = true;
        Ok(())
    }

    /// Carries out the step's decision on the device. Returns whether the
    /// step was skipped.
    pub(super) fn device_step(
        &mut self,
        hyper: &AdamHyper,
        adam_step: u64,
        decision: GradStep,
    ) -> Result<bool> {
        let compute = self
            .device_compute()
            .ok_or_else(|| EngineError::internal("no device optimizer"))?;
        let dev = compute
            .device_optimizer()
            .ok_or_else(|| EngineError::internal("no device optimizer"))?;
        match decision {
            GradStep::Skip => {
                dev.step(None)?;
                Ok(true)
            }
            GradStep::Apply(scale) => {
                let s =
                    crate::optim::gpu_step_scalars(hyper, adam_step, scale)?.ok_or_else(|| {
                        EngineError::internal("the device optimizer has AdamW only (not L2 Adam)")
                    })?;
                dev.step(Some(s))?;
                self.device_dirty = true;
                Ok(false)
            }
        }
    }

    /// Writes the device's state back to the host, if it changed: each
    /// sub-group's master and moments on the optimizer thread, each
    /// param's storage bytes in the param store.
    pub(super) fn write_back_device_optimizer(&mut self) -> Result<()> {
        if !self.device_dirty {
            return Ok(());
        }
        let Some(compute) = self.device_compute() else {
            return Ok(());
        };
        let Some(dev) = compute.device_optimizer() else {
            return Ok(());
        };
        let dtype = self.store.dtype();
        let groups = self.layout.sub_groups.clone();
        // The param downloaded last: a tiled one spans consecutive groups.
        let mut last: Option<(ParamId, [Vec<f32>; 3])> = None;
        for g in groups {
            let mut flat: [Vec<f32>; 3] = std::array::from_fn(|_| vec![0f32; g.numel]);
            for pc in &g.pieces {
                if last.as_ref().map(|(p, _)| *p) != Some(pc.param) {
                    let state = dev.state(pc.param)?;
                    let keep = self.sched.keep_after_update(pc.param);
                    self.store.update(
                        pc.param,
                        &super::build::encode(&state[0], dtype),
                        keep,
                        None,
                    )?;
                    last = Some((pc.param, state));
                }
                let Some((_, state)) = last.as_ref() else {
                    continue;
                };
                for (dst, src) in flat.iter_mut().zip(state) {
                    let from = src
                        .get(pc.shard_range())
                        .ok_or_else(|| EngineError::internal("a piece outside its param"))?;
                    dst.get_mut(pc.group_range())
                        .ok_or_else(|| EngineError::internal("a piece outside its sub-group"))?
                        .copy_from_slice(from);
                }
            }
            let sg = g.id;
            self.exclusive(move |st| {
                let [master, m, v] = &flat;
                st.load_group(sg, [master.as_slice(), m.as_slice(), v.as_slice()])
            })?;
        }
        self.device_dirty = false;
        Ok(())
    }
}

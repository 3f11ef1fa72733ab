//! [`ResidentUnits`] with several ranks: each param's gradient sum of a
//! micro-batch reduce-scattered on the devices onto this rank's shard of
//! the step's sum, and the weights gathered on them after the last load
//! and after each step, or
//! at stage 3 for each unit (see "Several ranks" and "Params
//! partitioned" in [`super`]). Every call here is a collective of the
//! link's ranks: each rank makes them for the same params in the same
//! order, from the engine's thread.

use candle_core::DType;

use super::{
    exec_units, DeviceLink, Grad, ModelError, ParamId, Reduced, Resident, ResidentUnits, UnitId,
};
use crate::engine::device::Wire;

impl<L: DeviceLink> ResidentUnits<L> {
    /// The micro-batch sums of `ids` (in this order: the same on every
    /// rank), each open since its param's first unit's gradient,
    /// reduce-scattered among the ranks in one collective, each onto this
    /// rank's shard of its param's step sum (left in flight;
    /// [`Self::settle`] waits for them). A param no unit gave a gradient
    /// since the last is left out. The sums cross between the ranks as
    /// `wire`'s elements (an untied param's sum is its one unit's gradient,
    /// rounded as the unit's were: it crosses so, exactly; a tied one's, a
    /// sum of two, as fp32).
    pub(super) fn reduce_params(
        &self,
        st: &mut Resident<L::Buf, L::Upload>,
        ids: &[ParamId],
        wire: Wire,
    ) -> Result<(), ModelError> {
        let Some(ranks) = self.ranks.as_ref() else {
            return Err(super::param_err(
                ids.first().copied().unwrap_or(ParamId(0)),
                "reduced with one rank",
            ));
        };
        let mut taken = Vec::with_capacity(ids.len());
        let mut micros = Vec::with_capacity(ids.len());
        let mut accs = Vec::with_capacity(ids.len());
        let mut counts = Vec::with_capacity(ids.len());
        for &id in ids {
            let p = st
                .params
                .get_mut(&id)
                .ok_or_else(|| super::param_err(id, "has a gradient but no state"))?;
            let micro = match std::mem::take(&mut p.grad) {
                Grad::Zero => continue,
                Grad::Micro { sum: None, micro } => micro,
                // The step's sum lives in `reduced` with several ranks.
                Grad::Micro { sum: Some(_), .. } | Grad::Summed(_) => {
                    return Err(super::param_err(
                        id,
                        "has a whole step's sum with several ranks",
                    ))
                }
            };
            // The running sum: the micro-batches' before, this rank's
            // shard.
            let acc = match std::mem::take(&mut p.reduced) {
                Reduced::None => None,
                Reduced::Ready(b) => Some(b),
                // Added onto on the collectives' stream that wrote it.
                Reduced::InFlight(u) => Some(self.link.kept_running_sums(u)?),
            };
            taken.push(id);
            micros.push(micro);
            accs.push(acc);
            counts.push(
                ranks
                    .counts
                    .get(id.0)
                    .cloned()
                    .ok_or_else(|| super::param_err(id, "is not in the model"))?,
            );
        }
        if taken.is_empty() {
            return Ok(());
        }
        let what = format!(
            "params {}..={} gradients",
            taken.first().map_or(0, |p| p.0),
            taken.last().map_or(0, |p| p.0)
        );
        let packed = self.link.pack_grads(&what, micros, wire, &counts)?;
        let sums = self.link.reduce_kept(&what, packed, accs, &counts)?;
        if sums.len() != taken.len() {
            return Err(super::param_err(
                taken[0],
                &format!(
                    "reduced with {} sums for {} params",
                    sums.len(),
                    taken.len()
                ),
            ));
        }
        for (id, s) in taken.into_iter().zip(sums) {
            if let Some(p) = st.params.get_mut(&id) {
                p.reduced = match s {
                    Some(u) => Reduced::InFlight(u),
                    None => Reduced::None,
                };
            }
        }
        Ok(())
    }

    /// Waits for every reduce in flight, in param order.
    pub(super) fn settle(&self, st: &mut Resident<L::Buf, L::Upload>) -> Result<(), ModelError> {
        for p in st.params.values_mut() {
            p.reduced = match std::mem::take(&mut p.reduced) {
                Reduced::InFlight(u) => Reduced::Ready(self.link.finish(u)?),
                other => other,
            };
        }
        Ok(())
    }

    /// After the last load and after each step: every param's weights get
    /// this rank's range from its master shard, and the others' from
    /// their ranks, in one gather ([`DeviceLink::gather_kept`]).
    pub(super) fn gather_weights(
        &self,
        st: &mut Resident<L::Buf, L::Upload>,
    ) -> Result<(), ModelError> {
        let Some(ranks) = self.ranks.as_ref() else {
            return Ok(());
        };
        if let Some((&id, _)) = st.params.iter().find(|(_, p)| p.weights.is_none()) {
            return Err(super::param_err(id, "is in use in the step"));
        }
        let mut ids = Vec::with_capacity(st.params.len());
        let mut wholes = Vec::with_capacity(st.params.len());
        let mut counts = Vec::with_capacity(st.params.len());
        for (&id, p) in st.params.iter_mut() {
            let w = p
                .weights
                .take()
                .ok_or_else(|| super::param_err(id, "is in use in the step"))?;
            ids.push(id);
            wholes.push(w);
            counts.push(ranks.counts.get(id.0).cloned().unwrap_or_default());
        }
        let shards: Vec<Option<&L::Buf>> = st
            .params
            .values()
            .map(|p| p.adam.as_ref().and_then(|a| a.master.as_ref()))
            .collect();
        let wholes = self
            .link
            .gather_kept("the stepped weights", wholes, &shards, &counts)?;
        if wholes.len() != ids.len() {
            return Err(exec_units::gpu_err(tierzero_gpu::GpuError::Shape {
                kernel: "gather_kept".into(),
                detail: format!("{} params gathered of {}", wholes.len(), ids.len()),
            }));
        }
        for (id, w) in ids.into_iter().zip(wholes) {
            if let Some(p) = st.params.get_mut(&id) {
                p.weights = Some(w);
            }
        }
        Ok(())
    }

    /// Params partitioned: `unit`'s params (`ids`, in declared order)
    /// gathered whole for it, in the storage dtype, from the ranks'
    /// master shards (each rank's rounded to bf16 in bf16 storage, as the
    /// host's copy is), in one collective ([`DeviceLink::alloc_param`],
    /// [`DeviceLink::gather_kept_ahead`]), left in flight: the unit's
    /// call finishes them ([`DeviceLink::finish_all`]) and frees them
    /// after. Issued when the engine stages the unit, else at its call.
    pub(super) fn gather_unit_ahead(
        &self,
        st: &mut Resident<L::Buf, L::Upload>,
        unit: UnitId,
        ids: &[ParamId],
    ) -> Result<Vec<L::Upload>, ModelError> {
        let Some(ranks) = self.ranks.as_ref() else {
            return Err(super::param_err(
                ids.first().copied().unwrap_or(ParamId(0)),
                "gathered with one rank",
            ));
        };
        let storage = if self.bf16 { DType::BF16 } else { DType::F32 };
        let mut wholes = Vec::with_capacity(ids.len());
        let mut counts = Vec::with_capacity(ids.len());
        for &id in ids {
            let made = match (st.params.contains_key(&id), self.numels.get(id.0)) {
                (true, Some(&n)) => {
                    self.link
                        .alloc_param(&format!("param {} gathered", id.0), n as usize, storage)
                }
                _ => Err(super::param_err(
                    id,
                    "has no state on the device (it is loaded before the first step)",
                )),
            };
            match made {
                Ok(w) => wholes.push(w),
                Err(e) => {
                    for w in wholes {
                        self.link.free(w);
                    }
                    return Err(e);
                }
            }
            counts.push(ranks.counts.get(id.0).cloned().unwrap_or_default());
        }
        let shards: Vec<Option<&L::Buf>> = ids
            .iter()
            .map(|id| {
                st.params
                    .get(id)
                    .and_then(|p| p.adam.as_ref())
                    .and_then(|a| a.master.as_ref())
            })
            .collect();
        self.link
            .gather_kept_ahead(&format!("unit {} params", unit.0), wholes, &shards, &counts)
    }
}

//! The tier's side of the params gathered on the device (see "Params
//! gathered on the device" in [`super::super`]): each param handed over
//! as this rank's shard, its size the whole param's, its gather issued on
//! the engine's thread.

use tierzero_swap::ReadPin;

use super::*;

impl<L: DeviceLink> TieredUnits<L> {
    /// Whether params are gathered on the device (several ranks, a link
    /// with collectives of its own): the engine then hands the tier each
    /// param's shard, this rank's, not the whole.
    pub(super) fn gathers(&self) -> bool {
        self.link.reduce_ranks() > 1
    }

    /// `id`'s size on the device, from `host`, its host tensor: the whole
    /// param, or (gathering) this rank's shard of the model's param of
    /// that dtype, checked against the shard's length.
    pub(super) fn size_of(
        &self,
        model: &Model,
        id: ParamId,
        host: &Tensor,
    ) -> Result<ParamSize, ModelError> {
        if !self.gathers() {
            return Ok(ParamSize::of(host));
        }
        let numel = model
            .params()
            .get(id.0)
            .map(|p| p.numel)
            .ok_or_else(|| ModelError::Gpu {
                what: format!("device tier: no param {}", id.0),
            })?;
        let ranks = self.link.reduce_ranks();
        let counts = crate::engine::layout::shard_counts(numel, ranks);
        let rank_numel = host.elem_count();
        if !counts.contains(&rank_numel) {
            return Err(ModelError::Gpu {
                what: format!(
                    "device tier: param {} of {numel} elements came as {rank_numel}, not a \
                     shard of {ranks} ranks ({counts:?}; an engine bug)",
                    id.0
                ),
            });
        }
        Ok(ParamSize {
            numel: numel as u64,
            bytes: super::super::param_device_bytes(numel as u64, host.dtype()),
        })
    }

    /// Gathers `id`, whose shard is `host`, on the device now, on this
    /// thread: the gathers are collectives, so every rank issues them in
    /// the engine's order, from the engine's thread (the upload thread's
    /// queue would interleave them with the gradients' reduces by
    /// timing). Its shard's bytes are what crosses the host's link.
    pub(super) fn gather_now(
        &self,
        st: &mut State<Queued<L::Upload>, L::Buf>,
        id: ParamId,
        host: &Tensor,
        pin: Option<ReadPin>,
        size: ParamSize,
    ) -> Result<L::Upload, ModelError> {
        let counts =
            crate::engine::layout::shard_counts(size.numel as usize, self.link.reduce_ranks());
        let what = format!("param {}", id.0);
        let (u, direct) = exec_units::with_host_elems(host, |v| match pin {
            // Its page's range, registered: the shard crosses in place.
            Some(pin) => self.link.gather_pinned(&what, pin, v, &counts),
            None => Ok((self.link.gather_param(&what, v, &counts)?, false)),
        })?;
        let bytes = exec_units::host_elems_bytes(host);
        st.traffic.h2d_bytes += bytes;
        if direct {
            st.traffic.h2d_direct_bytes += bytes;
        }
        Ok(u)
    }
}

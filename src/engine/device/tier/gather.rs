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
        let (rank, ranks) = (self.link.collective_rank(), self.link.reduce_ranks());
        let counts = crate::engine::layout::shard_counts(numel, ranks);
        let rank_numel = host.elem_count();
        if counts.get(rank) != Some(&rank_numel) {
            return Err(ModelError::Gpu {
                what: format!(
                    "device tier: param {} of {numel} elements came as {rank_numel}, not rank \
                     {rank}'s shard of {ranks} ({counts:?}; an engine bug)",
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use candle_core::Device;

    use super::*;
    use crate::engine::comm::scripted::Scripted;
    use crate::engine::device::sim::{SimConfig, SimDevice};
    use crate::engine::device::TierLimits;
    use crate::engine::layout::shard_counts;
    use crate::model::ModelConfig;

    fn gpt2() -> Model {
        let text = r#"{"model_type": "gpt2", "vocab_size": 256, "n_positions": 32,
            "n_embd": 64, "n_layer": 2, "n_head": 2, "n_inner": 128}"#;
        Model::new(ModelConfig::from_hf_json(text).unwrap().0).unwrap()
    }

    /// Rank 1 of two, the peer's shard bytes all 0x11.
    fn second_of_two() -> Scripted {
        Scripted {
            gather_bytes: Some(|shard, counts, out| {
                crate::engine::comm::check_counts("all_gather", 1, counts, shard.len(), out.len())?;
                out[..counts[0]].fill(0x11);
                out[counts[0]..].copy_from_slice(shard);
                Ok(())
            }),
            ..Scripted::rank_of(1, 2)
        }
    }

    fn tier() -> (TieredUnits<SimDevice>, crate::engine::device::sim::SimProbe) {
        let dev = SimDevice::new(SimConfig::instant(1 << 30, 2))
            .unwrap()
            .with_collectives(Arc::new(second_of_two()));
        let probe = dev.probe();
        let limits = TierLimits {
            prefetch_numel: u64::MAX,
            max_live_numel: u64::MAX,
            cache_bytes: 0,
        };
        (TieredUnits::new(dev, limits).unwrap(), probe)
    }

    /// This rank's shard of each of `unit`'s params (or, `whole`, each
    /// param whole), its elements 1.5.
    fn hosts(model: &Model, unit: usize, whole: bool) -> Vec<Tensor> {
        model.units()[unit]
            .params
            .iter()
            .map(|id| {
                let numel = model.params()[id.0].numel;
                let n = if whole {
                    numel
                } else {
                    shard_counts(numel, 2)[1]
                };
                Tensor::full(1.5f32, n, &Device::Cpu).unwrap()
            })
            .collect()
    }

    #[test]
    fn shards_are_gathered_whole_on_the_device_and_a_whole_param_is_refused() {
        let model = gpt2();
        let (tier, probe) = tier();
        assert!(tier.gathers_params());
        // A block's shards: each gathered on the device (one collective a
        // param), each counted there at the whole param's size, and only
        // the shards' bytes crossed.
        let block = &model.units()[1].params;
        let shards = hosts(&model, 1, false);
        tier.stage(&model, UnitId(1), &shards, Vec::new()).unwrap();
        assert_eq!(probe.gathers(), block.len() as u64);
        let whole: u64 = block.iter().map(|p| model.params()[p.0].numel as u64).sum();
        assert_eq!(tier.peaks().device_bytes, whole * 4);
        let crossed: u64 = shards.iter().map(|t| t.elem_count() as u64 * 4).sum();
        assert_eq!(tier.take_traffic().unwrap().h2d_bytes, crossed);
        // Each buffer is the whole param: the peer's range (its bytes),
        // then this rank's shard.
        let (ids, bufs) = tier.take(&model, UnitId(1), &shards).unwrap();
        for (id, b) in ids.iter().zip(&bufs) {
            let counts = shard_counts(model.params()[id.0].numel, 2);
            assert_eq!(b.len(), counts[0] + counts[1]);
            assert!(b[..counts[0]].iter().all(|x| x.to_bits() == 0x1111_1111));
            assert!(b[counts[0]..].iter().all(|&x| x == 1.5));
        }
        tier.give_back(&ids, bufs).unwrap();
        // A whole param where a shard belongs is an engine bug: refused,
        // nothing gathered.
        let e = tier
            .stage(&model, UnitId(2), &hosts(&model, 2, true), Vec::new())
            .unwrap_err()
            .to_string();
        assert!(e.contains("not rank 1's shard of 2"), "{e}");
        assert_eq!(probe.gathers(), block.len() as u64);
    }
}

//! A unit's param gradients out of the device tier ([`GradsOut`]).
//!
//! As a unit's backward ends, its gradients either start down on the
//! link's copy queue out, whole (one rank; a unit with a tied param,
//! whose sum spans two units and is made on the host), or stay on the
//! device, laid out per rank for their reduce-scatter there (several
//! ranks, on a link that reduce-scatters among them:
//! [`DeviceLink::reduce_ranks`], [`DeviceLink::pack_grads`]; the layout
//! is queued right after the unit's compute, so what follows never waits
//! for later compute). The engine collects them after it started the
//! next unit's backward, in backward order on every rank: the downloads
//! with `take`, the kept ones with `reduce`, which reduce-scatters them on
//! the device ([`DeviceLink::reduce_grads`]: a collective, so issued
//! there, in an order the same on every rank, and never from the tier's
//! own threads) and brings down this rank's sums only: `1 / ranks` of
//! the unit's gradients, in fp32 (so, for 16-bit gradients, `2 / ranks`
//! of their bytes), plus its running sums' upload when a micro-batch
//! before this one began them.
//!
//! Every buffer is owned by its entry here until its download completed
//! (or, packed, until the reduce's download did); a new step or the tier
//! dropped waits for the downloads and lets the packed ones go.

use std::collections::VecDeque;
use std::sync::Mutex;

use candle_core::{DType, Tensor};

use super::{DeviceLink, Wire, ELEM_BYTES};
use crate::engine::layout::shard_counts;
use crate::model::exec_units::HostVec;
use crate::model::{Model, ModelError, ParamId, UnitId};

/// One param's gradient, with its host shape.
type Held<T> = (ParamId, T, Vec<usize>);

/// A unit's gradients on the host, in declared order.
type HostGrads = Vec<(ParamId, Tensor)>;

/// Where one unit's gradients are.
enum Where<L: DeviceLink> {
    /// On their way to the host.
    Downloading(Vec<Held<L::Download>>),
    /// Laid out on the device for the reduce-scatter there: the params
    /// in order, each one's per-rank counts.
    Packed {
        ids: Vec<ParamId>,
        counts: Vec<Vec<usize>>,
        packed: L::Packed,
    },
}

/// One unit's param gradients.
struct Pending<L: DeviceLink> {
    unit: UnitId,
    at: Where<L>,
    /// The gradients' dtype on the host.
    dtype: DType,
}

/// What moved, for the tier's traffic.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Moved {
    /// Bytes down.
    pub d2h_bytes: u64,
    /// Bytes up (a reduce's running sums).
    pub h2d_bytes: u64,
}

/// The units' param gradients not yet collected, oldest first.
pub(super) struct GradsOut<L: DeviceLink> {
    queue: Mutex<VecDeque<Pending<L>>>,
}

/// The wire a gradient of `dtype` crosses as: 16-bit ones rounded on the
/// device, half the bytes.
pub(super) fn wire_of(dtype: DType) -> Wire {
    match dtype {
        DType::BF16 => Wire::Bf16,
        DType::F16 => Wire::F16,
        _ => Wire::F32,
    }
}

/// Bytes of one element on `wire`.
fn wire_bytes(wire: Wire) -> u64 {
    if wire == Wire::F32 {
        ELEM_BYTES
    } else {
        2
    }
}

/// The most device bytes one unit's reduce-scatter holds among `ranks`
/// (a unit with no tied param): its gradients packed and the chunks
/// received (each the unit's fp32 gradients), this rank's running sums
/// and its sums (each at most the largest rank's share). For the plan.
pub(super) fn reduce_bytes_bound(model: &Model, ranks: usize) -> u64 {
    if ranks < 2 {
        return 0;
    }
    let untied = |id: &ParamId| model.params().get(id.0).is_some_and(|p| p.units.len() == 1);
    model
        .units()
        .iter()
        .filter(|u| !u.params.is_empty() && u.params.iter().all(untied))
        .map(|u| {
            let (mut whole, mut share) = (0u64, 0u64);
            for id in &u.params {
                let numel = model.params().get(id.0).map_or(0, |p| p.numel);
                whole += numel as u64;
                share += shard_counts(numel, ranks).into_iter().max().unwrap_or(0) as u64;
            }
            (2 * whole + 2 * share) * ELEM_BYTES
        })
        .max()
        .unwrap_or(0)
}

impl<L: DeviceLink> GradsOut<L> {
    pub(super) fn new() -> Self {
        GradsOut {
            queue: Mutex::new(VecDeque::new()),
        }
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, VecDeque<Pending<L>>> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A unit's gradients, its backward just ended: laid out on the
    /// device for their reduce-scatter when `link` reduce-scatters among
    /// several ranks and none of them is tied (a param of more than one
    /// unit), else started down. Returns the bytes that started down.
    pub(super) fn put(
        &self,
        link: &L,
        model: &Model,
        unit: UnitId,
        grads: Vec<Held<L::Buf>>,
        dtype: DType,
    ) -> Result<u64, ModelError> {
        let untied = grads
            .iter()
            .all(|(id, _, _)| model.params().get(id.0).is_some_and(|p| p.units.len() == 1));
        let ranks = link.reduce_ranks();
        let (at, down) = if ranks > 1 && untied && !grads.is_empty() {
            let ids: Vec<ParamId> = grads.iter().map(|(id, _, _)| *id).collect();
            let counts: Vec<Vec<usize>> = grads
                .iter()
                .map(|(_, _, dims)| shard_counts(dims.iter().product(), ranks))
                .collect();
            let bufs = grads.into_iter().map(|(_, b, _)| b).collect();
            let packed = link.pack_grads(&format!("unit {} gradients", unit.0), bufs, &counts)?;
            let at = Where::Packed {
                ids,
                counts,
                packed,
            };
            (at, 0)
        } else {
            let wire = wire_of(dtype);
            let mut down = 0u64;
            let mut out = Vec::with_capacity(grads.len());
            for (id, g, dims) in grads {
                down += dims.iter().product::<usize>() as u64 * wire_bytes(wire);
                out.push((id, link.download(&format!("grad {}", id.0), g, wire)?, dims));
            }
            (Where::Downloading(out), down)
        };
        self.queue().push_back(Pending { unit, at, dtype });
        Ok(down)
    }

    fn remove(&self, unit: UnitId) -> Option<Pending<L>> {
        let mut q = self.queue();
        let i = q.iter().position(|p| p.unit == unit)?;
        q.remove(i)
    }

    /// The params of `unit` whose gradients are laid out on the device
    /// for their reduce-scatter.
    pub(super) fn on_device(&self, unit: UnitId) -> Option<Vec<ParamId>> {
        self.queue()
            .iter()
            .find(|p| p.unit == unit)
            .and_then(|p| match &p.at {
                Where::Packed { ids, .. } => Some(ids.clone()),
                Where::Downloading(_) => None,
            })
    }

    /// `unit`'s gradients on the host, whole, in declared order, once
    /// their copies completed. None: none of `unit`'s are downloading.
    pub(super) fn take(&self, link: &L, unit: UnitId) -> Result<Option<HostGrads>, ModelError> {
        let p = match self.remove(unit) {
            None => return Ok(None),
            Some(Pending {
                at: Where::Downloading(d),
                dtype,
                ..
            }) => (d, dtype),
            Some(p) => {
                self.queue().push_front(p);
                return Err(ModelError::Gpu {
                    what: format!(
                        "unit {}: its gradients are on the device for their reduce-scatter \
                         there, not downloading",
                        unit.0
                    ),
                });
            }
        };
        let (downloads, dtype) = p;
        let mut out = Vec::with_capacity(downloads.len());
        let mut result = Ok(());
        for (id, d, dims) in downloads {
            // After an error the rest are still waited for (their
            // buffers come back), not used.
            match link.finish_download(d) {
                Ok(v) if result.is_ok() => out.push((id, v.into_tensor(&dims, dtype)?)),
                Ok(_) => {}
                Err(e) => result = result.and(Err(e)),
            }
        }
        result.map(|()| Some(out))
    }

    /// `unit`'s gradients reduce-scattered on the device
    /// ([`DeviceLink::reduce_grads`]), this rank's sums on the host. The
    /// engine's `counts` must be those they were laid out by.
    pub(super) fn reduce(
        &self,
        link: &L,
        unit: UnitId,
        counts: &[Vec<usize>],
        acc: Option<&[f32]>,
    ) -> Result<(Vec<f32>, Moved), ModelError> {
        let refused = |why: String| ModelError::Gpu {
            what: format!("unit {}: no reduce-scatter on the device ({why})", unit.0),
        };
        let (laid_out, packed, dtype) = match self.remove(unit) {
            Some(Pending {
                at: Where::Packed { counts, packed, .. },
                dtype,
                ..
            }) => (counts, packed, dtype),
            Some(p) => {
                // Not kept: back in the queue for `take`.
                self.queue().push_front(p);
                return Err(refused("its gradients are downloading".into()));
            }
            None => return Err(refused("it left no gradients".into())),
        };
        if laid_out != counts {
            return Err(refused(format!(
                "laid out in chunks of {laid_out:?} elements, asked for {counts:?}"
            )));
        }
        let d = link.reduce_grads(
            &format!("unit {} gradients", unit.0),
            packed,
            wire_of(dtype),
            acc,
        )?;
        let sums = match link.finish_download(d)? {
            HostVec::F32(v) => v,
            other => {
                return Err(refused(format!(
                    "the sums came down as {} bytes of 16-bit elements, not fp32",
                    other.bytes()
                )))
            }
        };
        let moved = Moved {
            d2h_bytes: sums.len() as u64 * ELEM_BYTES,
            h2d_bytes: acc.map_or(0, |a| a.len() as u64 * ELEM_BYTES),
        };
        Ok((sums, moved))
    }

    /// Waits for every download still in flight and lets every laid-out
    /// unit go (a new step, the tier dropped).
    pub(super) fn drain(&self, link: &L) -> Result<(), ModelError> {
        let pending: Vec<_> = self.queue().drain(..).collect();
        let mut result = Ok(());
        for p in pending {
            if let Where::Downloading(d) = p.at {
                for (_, d, _) in d {
                    if let Err(e) = link.finish_download(d) {
                        result = result.and(Err(e));
                    }
                }
            }
        }
        result
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::model::ModelConfig;

    fn gpt2(vocab: usize, tied: bool) -> Model {
        let text = format!(
            r#"{{"model_type": "gpt2", "vocab_size": {vocab}, "n_positions": 32, "n_embd": 64,
                "n_layer": 2, "n_head": 2, "n_inner": 128, "tie_word_embeddings": {tied}}}"#
        );
        Model::new(ModelConfig::from_hf_json(&text).unwrap().0).unwrap()
    }

    #[test]
    fn the_reduce_bound_is_the_largest_untied_unit_s_packed_and_received_gradients_and_two_shares()
    {
        // A block: two layer norms, qkv and projection, the MLP's two
        // linears, with biases; every param even, so each rank's share is
        // half.
        let block = 4 * 64 + (64 * 192 + 192) + (64 * 64 + 64) + (64 * 128 + 128) + (128 * 64 + 64);
        let bound = |numel: usize| (2 * numel + 2 * numel / 2) * 4;
        // Tied, the head and the embedding come down whole: the largest
        // unit reduced on the device is a block, whatever the vocabulary.
        assert_eq!(
            reduce_bytes_bound(&gpt2(1024, true), 2),
            bound(block) as u64
        );
        // Untied, the embedding (token and position tables) is reduced on
        // the device too, and larger than a block and than the head.
        let embedding = 1024 * 64 + 32 * 64;
        let head = 1024 * 64 + 2 * 64;
        assert!(embedding > head && head > block);
        assert_eq!(
            reduce_bytes_bound(&gpt2(1024, false), 2),
            bound(embedding) as u64
        );
        assert_eq!(reduce_bytes_bound(&gpt2(1024, true), 1), 0);
    }
}

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
//! with `take_with` (one rank: each gradient's elements read into the
//! sums where the link landed them, the CUDA link's pinned staging, with
//! no host copy first) or `take` (host tensors, for a host collective),
//! the kept ones with `reduce`, which reduce-scatters them on
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
use crate::model::exec_units::{HostElems, HostVec};
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
    wire.elem_bytes() as u64
}

/// The most device bytes one unit's reduce-scatter holds among `ranks`
/// (a unit with no tied param) for gradients of `dtype`: its gradients
/// packed and the chunks received (each the unit's gradients as they
/// cross, [`wire_of`]), this rank's running sums and its sums (each at
/// most the largest rank's share, fp32). For the plan.
pub(super) fn reduce_bytes_bound(model: &Model, ranks: usize, dtype: DType) -> u64 {
    let crossing = wire_bytes(wire_of(dtype));
    if ranks < 2 {
        return 0;
    }
    let untied = |id: &ParamId| model.in_one_unit(*id);
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
            2 * whole * crossing + 2 * share * ELEM_BYTES
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
        let untied = grads.iter().all(|(id, _, _)| model.in_one_unit(*id));
        let ranks = link.reduce_ranks();
        let (at, down) = if ranks > 1 && untied && !grads.is_empty() {
            let ids: Vec<ParamId> = grads.iter().map(|(id, _, _)| *id).collect();
            let counts: Vec<Vec<usize>> = grads
                .iter()
                .map(|(_, _, dims)| shard_counts(dims.iter().product(), ranks))
                .collect();
            let bufs = grads.into_iter().map(|(_, b, _)| b).collect();
            let packed = link.pack_grads(
                &format!("unit {} gradients", unit.0),
                bufs,
                wire_of(dtype),
                &counts,
            )?;
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

    /// `unit`'s downloads and their gradients' dtype, taken out of the
    /// queue (None: it has none). A unit packed for its reduce-scatter is
    /// an error, and stays queued.
    #[allow(clippy::type_complexity, reason = "the queue's own entry, moved out")]
    fn downloading(
        &self,
        unit: UnitId,
    ) -> Result<Option<(Vec<Held<L::Download>>, DType)>, ModelError> {
        match self.remove(unit) {
            None => Ok(None),
            Some(Pending {
                at: Where::Downloading(d),
                dtype,
                ..
            }) => Ok(Some((d, dtype))),
            Some(p) => {
                self.queue().push_front(p);
                Err(ModelError::Gpu {
                    what: format!(
                        "unit {}: its gradients are on the device for their reduce-scatter \
                         there, not downloading",
                        unit.0
                    ),
                })
            }
        }
    }

    /// [`GradsOut::take`], handing `f` each gradient's elements where the
    /// link landed them (in declared order, flat), instead of host
    /// tensors made of copies of them ([`DeviceLink::finish_download_with`]).
    /// Returns false when none of `unit`'s are downloading. An fp32
    /// download of a 16-bit gradient (none is: its wire is 16-bit,
    /// [`wire_of`]) goes through the host tensor `take` makes, rounded as
    /// there. A download whose length is not its shape's is an error.
    /// After an error the rest are still waited for, not handed on; what
    /// `f` took before it stays taken (the caller's sums: the error ends
    /// the step).
    pub(super) fn take_with(
        &self,
        link: &L,
        unit: UnitId,
        f: &mut dyn FnMut(ParamId, HostElems<'_>),
    ) -> Result<bool, ModelError> {
        let Some((downloads, dtype)) = self.downloading(unit)? else {
            return Ok(false);
        };
        let mut result = Ok(());
        for (id, d, dims) in downloads {
            let r = link.finish_download_with(d, &mut |elems| {
                if result.is_err() {
                    return;
                }
                let numel: usize = dims.iter().product();
                if elems.len() != numel {
                    result = Err(ModelError::Gpu {
                        what: format!(
                            "grad {}: {} elements came down for a shape of {numel}",
                            id.0,
                            elems.len()
                        ),
                    });
                    return;
                }
                match (elems, dtype) {
                    (HostElems::F32(v), DType::BF16 | DType::F16) => {
                        result = HostVec::F32(v.to_vec())
                            .into_tensor(&dims, dtype)
                            .and_then(|t| {
                                crate::model::exec_units::with_host_elems(&t, |e| {
                                    f(id, e);
                                    Ok(())
                                })
                            });
                    }
                    (e, _) => f(id, e),
                }
            });
            result = result.and(r);
        }
        result.map(|()| true)
    }

    /// `unit`'s gradients on the host, whole, in declared order, once
    /// their copies completed. None: none of `unit`'s are downloading.
    pub(super) fn take(&self, link: &L, unit: UnitId) -> Result<Option<HostGrads>, ModelError> {
        let Some((downloads, dtype)) = self.downloading(unit)? else {
            return Ok(None);
        };
        let mut out = Vec::with_capacity(downloads.len());
        let mut result = Ok(());
        for (id, d, dims) in downloads {
            // After an error the rest are still waited for (their
            // buffers come back), not used.
            match link.finish_download(d) {
                Ok(v) if result.is_ok() => match v.into_tensor(&dims, dtype) {
                    Ok(t) => out.push((id, t)),
                    Err(e) => result = Err(e),
                },
                Ok(_) => {}
                Err(e) => result = result.and(Err(e)),
            }
        }
        result.map(|()| Some(out))
    }

    /// `unit`'s gradients reduce-scattered on the device
    /// ([`DeviceLink::reduce_grads`]), this rank's sums handed to `f` where
    /// they came down ([`DeviceLink::finish_download_with`]). The engine's
    /// `counts` must be those they were laid out by.
    pub(super) fn reduce(
        &self,
        link: &L,
        unit: UnitId,
        counts: &[Vec<usize>],
        acc: Option<&[f32]>,
        f: &mut dyn FnMut(&[f32]),
    ) -> Result<Moved, ModelError> {
        let refused = |why: String| ModelError::Gpu {
            what: format!("unit {}: no reduce-scatter on the device ({why})", unit.0),
        };
        let Some(p) = self.remove(unit) else {
            return Err(refused("it left no gradients".into()));
        };
        let why = match &p.at {
            Where::Packed {
                counts: laid_out, ..
            } if laid_out == counts => None,
            Where::Packed {
                counts: laid_out, ..
            } => Some(format!(
                "laid out in chunks of {laid_out:?} elements, asked for {counts:?}"
            )),
            _ => Some("its gradients are downloading".into()),
        };
        if let Some(why) = why {
            // Refused: back in the queue as it was, nothing lost.
            self.queue().push_front(p);
            return Err(refused(why));
        }
        let Where::Packed { packed, .. } = p.at else {
            return Err(refused("not packed".into()));
        };
        let d = link.reduce_grads(&format!("unit {} gradients", unit.0), packed, acc)?;
        let mut came: Result<u64, ModelError> = Ok(0);
        link.finish_download_with(d, &mut |e| {
            came = match e {
                HostElems::F32(sums) => {
                    f(sums);
                    Ok(sums.len() as u64)
                }
                other => Err(refused(format!(
                    "the sums came down as {} elements of 16 bits, not fp32",
                    other.len()
                ))),
            };
        })?;
        Ok(Moved {
            d2h_bytes: came? * ELEM_BYTES,
            h2d_bytes: acc.map_or(0, |a| a.len() as u64 * ELEM_BYTES),
        })
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
    use crate::engine::device::sim::{SimConfig, SimDevice};
    use crate::model::ModelConfig;
    use std::sync::Arc;

    /// Rank 0 of two, the other rank's chunks all +0.0: its reduce-scatter
    /// adds this rank's own chunk onto the running sums, then zeros.
    fn rank_zero_of_two() -> crate::engine::comm::scripted::Scripted {
        crate::engine::comm::scripted::Scripted {
            reduce_scatter: Some(|full, counts, acc| {
                crate::engine::comm::check_counts(
                    "reduce_scatter",
                    0,
                    counts,
                    acc.len(),
                    full.len(),
                )?;
                for (a, c) in acc.iter_mut().zip(&full[..counts[0]]) {
                    *a += *c;
                    *a += 0.0;
                }
                Ok(())
            }),
            ..crate::engine::comm::scripted::Scripted::rank_of(0, 2)
        }
    }

    fn device() -> SimDevice {
        SimDevice::new(SimConfig::instant(1 << 30, 2))
            .unwrap()
            .with_collectives(Arc::new(rank_zero_of_two()))
    }

    /// Unit `unit`'s gradients of `model`, each element a function of its
    /// param and position.
    fn grads_of(model: &Model, unit: usize) -> Vec<Held<Vec<f32>>> {
        model.units()[unit]
            .params
            .iter()
            .map(|&id| {
                let numel = model.params()[id.0].numel;
                let g = (0..numel).map(|i| (id.0 * 1000 + i) as f32 * 0.5).collect();
                (id, g, vec![numel])
            })
            .collect()
    }

    fn counts_of(model: &Model, unit: usize) -> Vec<Vec<usize>> {
        model.units()[unit]
            .params
            .iter()
            .map(|id| shard_counts(model.params()[id.0].numel, 2))
            .collect()
    }

    /// Every element's bits, widened to a `u32`.
    fn bits_of(e: HostElems<'_>) -> Vec<u32> {
        match e {
            HostElems::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
            HostElems::Bf16(v) => v.iter().map(|x| u32::from(x.to_bits())).collect(),
            HostElems::F16(v) => v.iter().map(|x| u32::from(x.to_bits())).collect(),
        }
    }

    /// `take_with` hands on each gradient's elements as `take` gives its
    /// host tensor's, in declared order, for fp32 and bf16 wires (bf16:
    /// rounded on the device, the 2-byte elements as they came); a unit
    /// with none is false; a packed one is refused and stays packed.
    #[test]
    fn take_with_hands_on_what_take_gives_in_order() {
        let link = SimDevice::new(SimConfig::instant(1 << 30, 2)).unwrap();
        let model = gpt2(256, true);
        let out = GradsOut::<SimDevice>::new();
        for dtype in [DType::F32, DType::BF16] {
            out.put(&link, &model, UnitId(1), grads_of(&model, 1), dtype)
                .unwrap();
            let taken = out.take(&link, UnitId(1)).unwrap().unwrap();
            out.put(&link, &model, UnitId(1), grads_of(&model, 1), dtype)
                .unwrap();
            let mut seen: Vec<(ParamId, Vec<u32>)> = Vec::new();
            let got = out
                .take_with(&link, UnitId(1), &mut |id, e| {
                    assert_eq!(
                        matches!(e, HostElems::Bf16(_)),
                        dtype == DType::BF16,
                        "{dtype:?} crossed as {e:?}"
                    );
                    seen.push((id, bits_of(e)));
                })
                .unwrap();
            assert!(got);
            let want: Vec<(ParamId, Vec<u32>)> = taken
                .iter()
                .map(|(id, t)| {
                    let bits =
                        crate::model::exec_units::with_host_elems(t, |e| Ok(bits_of(e))).unwrap();
                    (*id, bits)
                })
                .collect();
            assert_eq!(seen, want, "{dtype:?}");
            assert!(!out.take_with(&link, UnitId(1), &mut |_, _| {}).unwrap());
        }
        // A download whose length is not its shape's: refused, and every
        // download still finished.
        let mut wrong = grads_of(&model, 1);
        wrong[0].2 = vec![wrong[0].1.len() + 1];
        out.put(&link, &model, UnitId(1), wrong, DType::F32)
            .unwrap();
        let mut handed = 0;
        let e = out
            .take_with(&link, UnitId(1), &mut |_, _| handed += 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("elements came down for a shape of"), "{e}");
        assert_eq!(handed, 0, "nothing after the error");
        assert!(!out.take_with(&link, UnitId(1), &mut |_, _| {}).unwrap());
        let two = device();
        let out = GradsOut::<SimDevice>::new();
        out.put(&two, &model, UnitId(1), grads_of(&model, 1), DType::F32)
            .unwrap();
        let ids = model.units()[1].params.clone();
        assert!(out.take_with(&two, UnitId(1), &mut |_, _| {}).is_err());
        assert_eq!(out.on_device(UnitId(1)), Some(ids));
        out.drain(&two).unwrap();
    }

    #[test]
    fn packed_units_reduce_once_in_rank_order_and_every_wrong_call_is_an_error_that_loses_nothing()
    {
        let (link, model) = (device(), gpt2(256, true));
        let out = GradsOut::<SimDevice>::new();
        let ids = |u: usize| model.units()[u].params.clone();
        // A block (unit 1) is packed: nothing starts down.
        let down = out
            .put(&link, &model, UnitId(1), grads_of(&model, 1), DType::F32)
            .unwrap();
        assert_eq!(down, 0);
        assert_eq!(out.on_device(UnitId(1)), Some(ids(1)));
        // The head (unit 3) holds the tied embedding: it comes down whole.
        let down = out
            .put(&link, &model, UnitId(3), grads_of(&model, 3), DType::F32)
            .unwrap();
        assert!(down > 0);
        assert_eq!(out.on_device(UnitId(3)), None);
        // Taking a packed unit, or reducing a downloading one, is refused
        // and leaves it where it was.
        assert!(out.take(&link, UnitId(1)).is_err());
        assert_eq!(out.on_device(UnitId(1)), Some(ids(1)));
        let mut never = |_: &[f32]| panic!("a refused reduce handed sums over");
        assert!(out
            .reduce(&link, UnitId(3), &counts_of(&model, 3), None, &mut never)
            .is_err());
        let head = out.take(&link, UnitId(3)).unwrap().unwrap();
        assert_eq!(head.len(), ids(3).len());
        // The reduce: rank 0's chunk of each param, added onto the running
        // sums, then the other rank's zeros; only rank 0's half comes down.
        let counts = counts_of(&model, 1);
        let acc: Vec<f32> = (0..counts.iter().map(|c| c[0]).sum::<usize>())
            .map(|i| i as f32 * 0.25)
            .collect();
        let mut sums = Vec::new();
        let moved = out
            .reduce(&link, UnitId(1), &counts, Some(&acc), &mut |s| {
                sums.extend_from_slice(s)
            })
            .unwrap();
        let mut want = acc.clone();
        let mut at = 0;
        for (_, g, _) in grads_of(&model, 1) {
            let half = g.len() / 2;
            for (w, x) in want[at..at + half].iter_mut().zip(&g[..half]) {
                *w += *x;
            }
            at += half;
        }
        assert_eq!(sums, want);
        assert_eq!(moved.d2h_bytes, acc.len() as u64 * 4);
        assert_eq!(moved.h2d_bytes, acc.len() as u64 * 4);
        assert_eq!(out.on_device(UnitId(1)), None, "reduced once");
        assert!(out
            .reduce(&link, UnitId(1), &counts, None, &mut never)
            .is_err());
        // Counts other than those it was packed by are refused.
        out.put(&link, &model, UnitId(2), grads_of(&model, 2), DType::F32)
            .unwrap();
        let mut wrong = counts_of(&model, 2);
        wrong[0].swap(0, 1);
        wrong[0][0] += 1;
        wrong[0][1] -= 1;
        let e = out
            .reduce(&link, UnitId(2), &wrong, None, &mut never)
            .unwrap_err()
            .to_string();
        assert!(e.contains("laid out in chunks"), "{e}");
        // ... and the unit stays packed for a reduce with the right counts.
        assert_eq!(out.on_device(UnitId(2)), Some(ids(2)));
        // A new step lets every packed unit go.
        out.drain(&link).unwrap();
        assert_eq!(out.on_device(UnitId(2)), None);
    }

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
        let f32 = DType::F32;
        assert_eq!(
            reduce_bytes_bound(&gpt2(1024, true), 2, f32),
            bound(block) as u64
        );
        // bf16 gradients are packed and received as bf16; the sums are fp32.
        assert_eq!(
            reduce_bytes_bound(&gpt2(1024, true), 2, DType::BF16),
            (2 * block * 2 + 2 * (block / 2) * 4) as u64
        );
        // Untied, the embedding (token and position tables) is reduced on
        // the device too, and larger than a block and than the head.
        let embedding = 1024 * 64 + 32 * 64;
        let head = 1024 * 64 + 2 * 64;
        assert!(embedding > head && head > block);
        assert_eq!(
            reduce_bytes_bound(&gpt2(1024, false), 2, f32),
            bound(embedding) as u64
        );
        assert_eq!(reduce_bytes_bound(&gpt2(1024, true), 1, f32), 0);
    }
}

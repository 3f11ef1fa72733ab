//! [`ResidentUnits`] as the optimizer on its device
//! ([`DeviceOptimizer`]): a param's state loaded from the host (with
//! several ranks, this rank's shard, the weights gathered on the
//! devices, or at stage 3 none), the gradient norm, the step (see "The
//! step" in [`super`]) and the state written back.

use tierzero_gpu::norm::{NormGroup, NormSegment};
use tierzero_gpu::reference::AdamScalars;
use tierzero_gpu::unit::Exec;

use crate::engine::layout::SubGroup;
use crate::optim::NORM_PART_NUMEL;

use super::{
    exec_units, param_err, AdamState, DeviceLink, DeviceOptimizer, Grad, HostElems, ModelError,
    OnDevice, ParamId, Reduced, ResidentUnits, ELEM_BYTES,
};

impl<L: DeviceLink> DeviceOptimizer for ResidentUnits<L> {
    fn is_loaded(&self) -> bool {
        self.lock().params.len() == self.numels.len()
    }

    fn load(&self, id: ParamId, [master, m, v]: [&[f32]; 3]) -> Result<(), ModelError> {
        let numel = self
            .numels
            .get(id.0)
            .copied()
            .ok_or_else(|| param_err(id, "is not in the model"))? as usize;
        let shard = self.ranks.as_ref().map_or(numel, |r| r.shard_numel(id));
        if [master.len(), m.len(), v.len()] != [shard; 3] {
            return Err(ModelError::Gpu {
                what: format!(
                    "device optimizer: param {} has {shard} elements on this rank; its state \
                     has {}, {} and {}",
                    id.0,
                    master.len(),
                    m.len(),
                    v.len()
                ),
            });
        }
        let mut st = self.lock();
        if let Some(old) = st.params.remove(&id) {
            self.free(old);
        }
        let what = |k: &str| format!("{k} {}", id.0);
        let f32s = HostElems::F32;
        // The weights are the master, rounded to bf16 in bf16 storage:
        // with one rank those cross as bf16 elements (2 bytes) and stay so
        // on the device (several ranks: gathered on the devices from the
        // masters).
        let rounded: Vec<half::bf16> = if self.bf16 && self.ranks.is_none() {
            master.iter().map(|&x| half::bf16::from_f32(x)).collect()
        } else {
            Vec::new()
        };
        let weights_host = if self.bf16 {
            HostElems::Bf16(&rounded)
        } else {
            f32s(master)
        };
        let (weights, adam_master) = match &self.ranks {
            // Only this rank's master shard crosses. The whole weights are
            // gathered on the devices from the ranks' master shards: every
            // param's in one collective once the last is loaded, as after
            // a step (partitioned: none kept; for each unit, when it runs).
            Some(r) => {
                let w = if r.partition {
                    None
                } else {
                    let storage = if self.bf16 {
                        candle_core::DType::BF16
                    } else {
                        candle_core::DType::F32
                    };
                    Some(self.link.alloc_param(&what("param"), numel, storage)?)
                };
                let master = if shard == 0 {
                    None
                } else {
                    Some(self.put(&mut st, &what("master"), f32s(master))?)
                };
                (w, master)
            }
            None if self.bf16 => (
                Some(self.put(&mut st, &what("param"), weights_host)?),
                Some(self.put(&mut st, &what("master"), f32s(master))?),
            ),
            None => (Some(self.put(&mut st, &what("param"), weights_host)?), None),
        };
        let adam = if self.ranks.is_some() && shard == 0 {
            None
        } else {
            Some(AdamState {
                master: adam_master,
                m: self.put(&mut st, &what("exp_avg"), f32s(m))?,
                v: self.put(&mut st, &what("exp_avg_sq"), f32s(v))?,
            })
        };
        st.params.insert(
            id,
            OnDevice {
                weights,
                adam,
                grad: Grad::Zero,
                reduced: Reduced::None,
            },
        );
        if st.params.len() == self.numels.len() && !self.partitioned() {
            // The last load (every rank's, in param order): the weights'
            // one gather (none with one rank).
            self.gather_weights(&mut st)?;
        }
        Ok(())
    }

    fn grad_sq_sums(&self, groups: &[SubGroup]) -> Result<Vec<f64>, ModelError> {
        let mut st = self.lock();
        self.fold_all(&mut st)?;
        let e = self.link.exec();
        // This rank's sums: the whole step's with one rank, its shards'
        // with several (the trainer adds the ranks'), each piece of a
        // sub-group a segment of its param's sum; a param no unit gave a
        // gradient is zeros, which add nothing. After `fold_all` a sum is
        // one of those: any other state is an error, not a zero.
        let mut norm_groups: Vec<NormGroup<'_, L::Buf>> = Vec::with_capacity(groups.len());
        for g in groups {
            let mut segments = Vec::with_capacity(g.pieces.len());
            for pc in &g.pieces {
                let p = st
                    .params
                    .get(&pc.param)
                    .ok_or_else(|| param_err(pc.param, "has no state for the norm"))?;
                let sum = match (&p.grad, &p.reduced) {
                    (Grad::Summed(s), Reduced::None) | (Grad::Zero, Reduced::Ready(s)) => s,
                    (Grad::Zero, Reduced::None) => continue,
                    _ => {
                        return Err(param_err(
                            pc.param,
                            "has a gradient sum that was not folded before the norm",
                        ))
                    }
                };
                segments.push(NormSegment {
                    buf: sum,
                    offset: pc.offset_in_shard,
                    numel: pc.numel,
                    flat_start: pc.offset_in_group,
                });
            }
            norm_groups.push(NormGroup {
                numel: g.numel,
                part_numel: NORM_PART_NUMEL,
                segments,
            });
        }
        // One launch and one wait for every sub-group.
        e.norm_sq_sums(&norm_groups).map_err(exec_units::gpu_err)
    }

    fn step(&self, s: Option<AdamScalars>) -> Result<(), ModelError> {
        let mut st = self.lock();
        self.fold_all(&mut st)?;
        let e = self.link.exec();
        let gpu = exec_units::gpu_err;
        let partitioned = self.partitioned();
        self.link.timed(
            || "optimizer step".to_string(),
            || {
                for (id, p) in st.params.iter_mut() {
                    let grad = std::mem::take(&mut p.grad);
                    let reduced = std::mem::take(&mut p.reduced);
                    let (Some(s), Some(adam)) = (s, p.adam.as_mut()) else {
                        if let Reduced::Ready(g) = reduced {
                            self.link.free(g);
                        }
                        continue;
                    };
                    // The step's sum: this rank's shard of it with several
                    // ranks (the link's buffer), the whole with one.
                    let (g, linked) = match (grad, reduced) {
                        (_, Reduced::Ready(g)) => (g, true),
                        (Grad::Summed(g), _) => (g, false),
                        // No unit gave it a gradient: it steps on zeros.
                        _ => {
                            let n = e.len(&adam.m);
                            (e.zeros("zero gradient", n).map_err(gpu)?, false)
                        }
                    };
                    // The weights are checked first: a param a unit still
                    // holds fails the step before its state changed.
                    let stepped = match (adam.master.as_mut(), p.weights.as_mut()) {
                        // Partitioned: the master shard is all there is.
                        (Some(master), None) if partitioned => e
                            .adamw([master, &mut adam.m, &mut adam.v], &g, s)
                            .map_err(gpu),
                        (_, None) => Err(param_err(*id, "is in use in the step")),
                        (Some(master), Some(weights)) => e
                            .adamw([master, &mut adam.m, &mut adam.v], &g, s)
                            .and_then(|()| {
                                // One rank: the bf16 weights are the
                                // master rounded. Several: gathered below.
                                match self.ranks {
                                    None => e.round_bf16(weights, master),
                                    Some(_) => Ok(()),
                                }
                            })
                            .map_err(gpu),
                        (None, Some(weights)) => e
                            .adamw([weights, &mut adam.m, &mut adam.v], &g, s)
                            .map_err(gpu),
                    };
                    if linked {
                        self.link.free(g);
                    }
                    stepped?;
                }
                Ok::<(), ModelError>(())
            },
        )?;
        if s.is_some() && self.ranks.is_some() && !partitioned {
            self.gather_weights(&mut st)?;
        }
        Ok(())
    }

    fn state(&self, id: ParamId) -> Result<[Vec<f32>; 3], ModelError> {
        let mut st = self.lock();
        let e = self.link.exec();
        let p = st
            .params
            .get(&id)
            .ok_or_else(|| param_err(id, "has no state on the device"))?;
        let Some(adam) = p.adam.as_ref() else {
            // This rank's shard has no elements.
            return Ok([Vec::new(), Vec::new(), Vec::new()]);
        };
        let master = adam
            .master
            .as_ref()
            .or(p.weights.as_ref())
            .ok_or_else(|| param_err(id, "is in use"))?;
        let gpu = exec_units::gpu_err;
        let out = [
            e.download(master).map_err(gpu)?,
            e.download(&adam.m).map_err(gpu)?,
            e.download(&adam.v).map_err(gpu)?,
        ];
        st.traffic.d2h_bytes += 3 * out[1].len() as u64 * ELEM_BYTES;
        Ok(out)
    }
}

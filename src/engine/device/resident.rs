//! [`ResidentUnits`]: training in device memory. With nothing offloaded
//! (`offload_optimizer` and `offload_param` both `none`), every param's
//! weights, its gradient sum and Adam's state (fp32 master and moments)
//! live on the device, the units compute on them, and the optimizer step
//! runs there ([`DeviceOptimizer`]): no param or gradient crosses per
//! step, only a unit's inputs and outputs. With several ranks whose
//! devices have collectives of their own, each device holds its rank's
//! shard of the state (see "Several ranks").
//!
//! # One state per param
//!
//! [`OnDevice`] holds a param's buffers. Its gradient is a [`Grad`],
//! changed only by [`GradEvent`]s in [`Grad::apply`]:
//!
//! | state | event | next |
//! |---|---|---|
//! | `Zero` | `Unit(g)` | `Micro { sum: None, micro: g }` |
//! | `Micro { sum, micro }` | `Unit(g)` | `Micro { sum, micro: micro + g }` |
//! | `Summed(s)` | `Unit(g)` | `Micro { sum: Some(s), micro: g }` |
//! | `Micro { sum: None, micro }` | `Fold` | `Summed(micro)` |
//! | `Micro { sum: Some(s), micro }` | `Fold` | `Summed(s + micro)` |
//! | `Zero`, `Summed` | `Fold` | unchanged |
//! | any | `Clear` | `Zero` (buffers freed) |
//!
//! A unit's gradient comes as `Unit`; `Fold` follows at the param's last
//! unit of the micro-batch (the smallest unit that uses it: a tied
//! embedding's is the embedding). These are the host's additions in the
//! host's order (`Trainer::accumulate`: a micro-batch's units summed,
//! then added to the step's sum), so the sums are the same bits. In bf16
//! storage a unit's gradient is first rounded to bf16, as the host's
//! copy would be.
//!
//! # The step
//!
//! [`DeviceOptimizer::step`] runs the AdamW kernel on each param in
//! param order with the host kernel's f32 constants
//! (`crate::optim::gpu_step_scalars`), the kernel written to give the CPU
//! kernel's bits; a param no unit gave a gradient steps with zeros, as the
//! host's zeroed accumulator does. In bf16 storage the weights are then the
//! master rounded to bf16 (the kernels `cast_f32_bf16`, `cast_bf16_f32`),
//! which is the host's bf16 copy (with several ranks, each rank's range
//! rounded and the rest gathered: "Several ranks"). The gradient norm for
//! clipping is taken on the device over the optimizer's sub-groups in the
//! host optimizer's order (`Exec::norm_sq_sums`, the `sumsq_parts` kernel:
//! each sub-group's pieces of the params' sums as segments, every
//! sub-group in one launch and one wait; `tierzero_gpu::norm`), and the
//! trainer adds the sub-groups' sums in order: the host's norm's bits, so
//! a run that clips is the host's bits too.
//!
//! # Several ranks
//!
//! With the link's collectives among several ranks (NCCL between GPUs;
//! [`DeviceLink::reduce_ranks`]), Adam's state (fp32 master, moments)
//! and the step's gradient sums are this rank's shard of each param
//! (`crate::engine::layout::shard_counts`'s cut, the host's). At stages
//! 0-2 every device holds each param's weights whole, for its units, as
//! ZeRO-2 keeps them; at stage 3 none ("Params partitioned"). The micro-batch sums stay in [`Grad`] (never `Summed`); a
//! param's shard of the step's sum over the ranks is a [`Reduced`]
//! (`ranks.rs`):
//!
//! | state | event | next |
//! |---|---|---|
//! | `None` | the param's last unit of a micro-batch | `InFlight` (its micro-batch sum reduce-scattered onto +0.0) |
//! | `InFlight(u)`, `Ready(s)` | the same | `InFlight` (onto `s`, or `u`'s sums once done) |
//! | `InFlight(u)` | the norm or the step | `Ready` (waited for, with the communicator's deadline) |
//! | `Ready(s)` | the step | `None` (Adam stepped the shard on `s`; `s` freed) |
//!
//! The params whose sums a unit's backward completes are reduced
//! together, one collective ([`DeviceLink::reduce_kept`]) for each dtype
//! they cross in: an untied param's sum as bf16 when its unit's
//! gradients were rounded to bf16 (it is that gradient: exact), a tied
//! one's as fp32. Each adds every rank's chunk onto the param's running
//! sum in rank order, as the host's collective does, so N ranks give one
//! rank's bits over the same micro-batches. With whole weights, after the
//! step each rank's new master shard is rounded into its range of the
//! weights and the ranks gather the rest, every param in one
//! [`DeviceLink::gather_kept`], and once more at load, after the last
//! param's master shard has crossed (the weights do not cross: the
//! masters are their source). Each of
//! these is a collective, made on the engine's thread in one order on
//! every rank: the reduces in backward order (a unit's fp32 ones, then
//! its bf16 ones, each in declared order), the gathers of the step's end
//! and of the last load (at stage 3, instead, each unit's gather, in the
//! engine's calls). The norm for
//! clipping is this rank's shards' Σg², which the trainer adds over the
//! ranks. The param store hands out shards ([`UnitCompute::gathers_params`]):
//! the host gathers nothing.
//!
//! # Params partitioned
//!
//! At ZeRO stage 3 ([`ResidentUnits::with_partition`]) the params are
//! partitioned on the devices as their state is: no weights are
//! resident. A unit's params are gathered whole for it (`ranks.rs`,
//! `gather_unit_ahead`): each rank's master shard copied, or rounded to bf16
//! in bf16 storage, into its range of a new buffer
//! ([`DeviceLink::alloc_param`]), the others' exchanged, every param of
//! the unit in one [`DeviceLink::gather_kept`]; the same bits as the
//! whole weights of stages 0-2. The gather is issued when the engine
//! stages the unit (`stage`, a unit ahead: [`DeviceLink::gather_kept_ahead`],
//! the host not waiting), else when it is called; either is a point in
//! the engine's order, every rank's. Its call finishes the gather (with
//! the communicator's deadline) and frees the wholes when it gives them
//! back; they are gathered again for its backward. A unit is launched
//! ahead ([`Holder::ready`]) only on params gathered so, never gathering
//! there. Nothing is gathered at load or after the step; what was staged
//! and not called is freed as the next step begins.
//!
//! # Memory
//!
//! [`resident_state_bytes`] decides what the state needs; the plan
//! prints its rows, and [`ResidentUnits::new`] refuses a model whose state
//! does not fit the device (less what start-up took) with the numbers and
//! the fix (offload the optimizer). What is left holds the units'
//! activations and temporaries.
//!
//! # Buffers
//!
//! The weights, master and moments are uploaded through the link (with
//! several ranks the weights are gathered through it), counted in its
//! budget and freed through it. The units' gradients and the micro-batch
//! sums are the executor's buffers, dropped when cleared; with several
//! ranks the shards of the step's sums are the link's
//! ([`DeviceLink::reduce_kept`]), freed through it once stepped, and the
//! buffers a reduce sent and received are the link's until its
//! collective is done. A unit takes its weights out of the map while it
//! computes and puts them back after, error or not (at stage 3 it is
//! given them gathered, and they are freed after).

mod memory;
mod optimizer;
mod ranks;

use memory::largest_unit_numels;
pub use memory::resident_state_bytes;

use std::collections::BTreeMap;
use std::sync::Mutex;

use candle_core::{DType, Tensor};
use tierzero_gpu::unit::Exec;

use super::ahead::{Aheads, Holder};
use super::inputs::{numel_of, output_numel, Inputs};
use super::{DeviceLink, Wire, ELEM_BYTES};
use crate::model::exec_units::{
    self, DeviceMemoryPlan, DeviceOptimizer, DeviceSpan, DeviceTraffic, HomePins, HostElems,
    UnitCompute,
};
use crate::model::{
    Model, ModelError, ParamId, UnitGrads, UnitId, UnitInput, UnitOutput, Upstream,
};

/// A param's gradient on the device (the table in the module docs).
#[derive(Debug, Default)]
pub enum Grad<B> {
    /// None this step.
    #[default]
    Zero,
    /// This micro-batch's units' sum so far, beside the step's sum of the
    /// micro-batches before.
    Micro {
        /// The earlier micro-batches' sum.
        sum: Option<B>,
        /// This micro-batch's.
        micro: B,
    },
    /// The step's sum, this micro-batch's units all added.
    Summed(B),
}

/// What happens to a param's gradient.
#[derive(Debug)]
pub enum GradEvent<B> {
    /// A unit's gradient of the param.
    Unit(B),
    /// The param's last unit of the micro-batch is done: its sum joins the
    /// step's.
    Fold,
    /// The step used or skipped it.
    Clear,
}

impl<B> Grad<B> {
    /// The next state; sums on `e`. After an error the gradient is gone
    /// (the engine stops on it).
    pub fn apply<E: Exec<Buf = B>>(
        self,
        e: &E,
        event: GradEvent<B>,
    ) -> Result<Grad<B>, ModelError> {
        let add = |a: &B, b: &B| e.add(a, b).map_err(exec_units::gpu_err);
        Ok(match (self, event) {
            (_, GradEvent::Clear) => Grad::Zero,
            (Grad::Zero, GradEvent::Unit(g)) => Grad::Micro {
                sum: None,
                micro: g,
            },
            (Grad::Micro { sum, micro }, GradEvent::Unit(g)) => Grad::Micro {
                sum,
                micro: add(&micro, &g)?,
            },
            (Grad::Summed(s), GradEvent::Unit(g)) => Grad::Micro {
                sum: Some(s),
                micro: g,
            },
            (Grad::Micro { sum: None, micro }, GradEvent::Fold) => Grad::Summed(micro),
            (
                Grad::Micro {
                    sum: Some(s),
                    micro,
                },
                GradEvent::Fold,
            ) => Grad::Summed(add(&s, &micro)?),
            (g @ (Grad::Zero | Grad::Summed(_)), GradEvent::Fold) => g,
        })
    }
}

/// One param on the device.
#[derive(Debug)]
struct OnDevice<B, U> {
    /// What the units read, whole on every rank: the master itself in
    /// fp32 storage with one rank, the master rounded to bf16 in bf16
    /// storage (a bf16 buffer on the device:
    /// [`super::param_device_bytes`]). None while its unit computes, and
    /// always with the params partitioned (stage 3: gathered per unit).
    weights: Option<B>,
    /// Adam's state of this rank's shard (the whole param with one rank;
    /// None: this rank's shard has no elements).
    adam: Option<AdamState<B>>,
    /// Its gradient: the units' sums of this micro-batch (and, with one
    /// rank, the step's).
    grad: Grad<B>,
    /// Several ranks: this rank's shard of the step's sum over the ranks
    /// (see "Several ranks").
    reduced: Reduced<B, U>,
}

/// A staged unit's params gathered ahead (see "Params partitioned").
struct Prefetched<U> {
    /// Its params, in declared order.
    ids: Vec<ParamId>,
    /// Their wholes in flight.
    wholes: Vec<U>,
}

/// Adam's state of a param's shard on the device.
#[derive(Debug)]
struct AdamState<B> {
    /// The fp32 master weights: with one rank in bf16 storage only (fp32
    /// storage steps the weights themselves); with several, always (the
    /// master is this rank's shard, the weights whole or gathered).
    master: Option<B>,
    /// First moments.
    m: B,
    /// Second moments.
    v: B,
}

/// Several ranks: this rank's shard of a param's step sum over the ranks
/// (the table in "Several ranks").
#[derive(Debug, Default)]
enum Reduced<B, U> {
    /// None this step (or one rank).
    #[default]
    None,
    /// A reduce-scatter's sums in flight ([`DeviceLink::reduce_kept`]).
    InFlight(U),
    /// The sums, on the device.
    Ready(B),
}

/// Several ranks: this rank among them, and how each param is cut.
#[derive(Debug)]
struct Ranks {
    /// This rank ([`DeviceLink::collective_rank`]); the ranks are
    /// [`DeviceLink::reduce_ranks`].
    rank: usize,
    /// Stage 3: no weights resident; each unit's gathered for it from the
    /// ranks' master shards ("Params partitioned").
    partition: bool,
    /// `counts[p][r]`: elements of param `p` in rank `r`'s shard
    /// (`crate::engine::layout::shard_counts`).
    counts: Vec<Vec<usize>>,
}

impl Ranks {
    /// Elements of param `id`'s shard on this rank.
    fn shard_numel(&self, id: ParamId) -> usize {
        self.counts
            .get(id.0)
            .and_then(|c| c.get(self.rank))
            .copied()
            .unwrap_or(0)
    }
}

/// The units computed on a [`DeviceLink`] with everything resident (see
/// the module docs).
pub struct ResidentUnits<L: DeviceLink> {
    link: L,
    /// bf16 storage: the weights are the masters rounded.
    bf16: bool,
    /// Every param's elements, in param order.
    numels: Vec<u64>,
    /// Each param's last unit in backward (the smallest that uses it).
    last_unit: Vec<UnitId>,
    /// The numels of the params of the unit with the most elements.
    unit_numels: Vec<u64>,
    /// Several ranks (None: one).
    ranks: Option<Ranks>,
    state: Mutex<Resident<L::Buf, L::Upload>>,
    /// Params partitioned: the units the engine staged, their params
    /// gathered ahead (in declared order, in flight), until their call
    /// takes them. Locked after `state` when both are.
    prefetched: Mutex<BTreeMap<UnitId, Prefetched<L::Upload>>>,
    inputs: Inputs<L::Buf>,
    /// The unit staged last, and the forward launched ahead.
    aheads: Aheads<L::Buf>,
}

#[derive(Debug)]
struct Resident<B, U> {
    params: BTreeMap<ParamId, OnDevice<B, U>>,
    traffic: DeviceTraffic,
}

impl<L: DeviceLink> std::fmt::Debug for ResidentUnits<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResidentUnits")
            .field("link", &self.link)
            .field("bf16", &self.bf16)
            .finish_non_exhaustive()
    }
}

impl<L: DeviceLink> ResidentUnits<L> {
    /// `model` on `link`, its state in `bf16` storage or fp32; with
    /// several ranks when the link has collectives of its own
    /// ([`DeviceLink::reduce_ranks`]; see "Several ranks"). Refuses a
    /// model whose state does not fit the device.
    pub fn new(link: L, model: &Model, bf16: bool) -> Result<Self, ModelError> {
        Self::with_partition(link, model, bf16, false)
    }

    /// [`Self::new`]; with several ranks and `partition` (ZeRO stage 3),
    /// the params partitioned as their state is: no weights resident, a
    /// unit's gathered whole for it from the ranks' master shards and
    /// freed after (see "Params partitioned").
    pub fn with_partition(
        link: L,
        model: &Model,
        bf16: bool,
        partition: bool,
    ) -> Result<Self, ModelError> {
        let numels: Vec<u64> = model.params().iter().map(|p| p.numel as u64).collect();
        let last_unit = model
            .params()
            .iter()
            .map(|p| p.units.iter().copied().min().unwrap_or(UnitId(0)))
            .collect();
        let world = link.reduce_ranks();
        let ranks = (world > 1).then(|| Ranks {
            rank: link.collective_rank(),
            partition,
            counts: numels
                .iter()
                .map(|&n| crate::engine::layout::shard_counts(n as usize, world))
                .collect(),
        });
        // Every rank decides on rank 0's shards, the largest
        // (`shard_counts` cuts chunks of the ceiling), so all
        // refuse or none does.
        let unit_numels = largest_unit_numels(model);
        let partition = partition && world > 1;
        let need: u64 = resident_state_bytes(&numels, bf16, 0, world, &unit_numels, partition)
            .iter()
            .sum();
        let room = Self::room_bytes(&link);
        if need > room {
            return Err(ModelError::Gpu {
                what: format!(
                    "training in device memory: the model's {} params need {need} bytes ({}) \
                     on the device (weights, {}Adam's moments and the gradients) and {room} \
                     bytes ({}) are left after start-up; set \
                     zero_optimization.offload_optimizer.device to \"cpu\" (the optimizer on \
                     the host, the params streamed to the device), or raise \
                     tierzero.device_budget_bytes by at least {} bytes",
                    numels.iter().sum::<u64>(),
                    crate::units::format_bytes(need),
                    if bf16 { "fp32 masters, " } else { "" },
                    crate::units::format_bytes(room),
                    need - room,
                ),
            });
        }
        Ok(ResidentUnits {
            link,
            bf16,
            numels,
            last_unit,
            unit_numels,
            ranks,
            state: Mutex::new(Resident {
                params: BTreeMap::new(),
                traffic: DeviceTraffic::default(),
            }),
            prefetched: Mutex::new(BTreeMap::new()),
            inputs: Inputs::new(),
            aheads: Aheads::new(),
        })
    }

    /// Keeps each block's forward on the device for its backward while
    /// the kept ones fit `budget` (`tierzero.activation_budget_bytes`;
    /// see "Kept forwards" in [`super`]), within what the state leaves of
    /// the device. Without it every block is recomputed.
    pub fn keep_forwards(
        self,
        budget: crate::config::ActivationBudget,
    ) -> Result<Self, ModelError> {
        let room = self.link.memory().temporaries_bytes.map(|_| {
            let state: u64 = self.state_bytes().iter().sum();
            Self::room_bytes(&self.link).saturating_sub(state)
        });
        self.inputs.keep_forwards(budget, room)?;
        Ok(self)
    }

    /// Whether a unit is launched ahead as the one before it in its pass
    /// comes down (see "Units launched ahead" in [`super`]): on by
    /// default; off only to measure what it gains.
    pub fn launch_ahead(mut self, on: bool) -> Self {
        self.aheads.set_enabled(on);
        self
    }

    /// The most device bytes the kept forwards held at once.
    pub fn forward_peak_bytes(&self) -> u64 {
        self.inputs.forward_peak_bytes()
    }

    /// Whether the params are partitioned (see "Params partitioned").
    fn partitioned(&self) -> bool {
        self.ranks.as_ref().is_some_and(|r| r.partition)
    }

    /// The link.
    pub fn link(&self) -> &L {
        &self.link
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Resident<L::Buf, L::Upload>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A host vector on the device, through the link (counted).
    fn put(
        &self,
        st: &mut Resident<L::Buf, L::Upload>,
        what: &str,
        v: HostElems<'_>,
    ) -> Result<L::Buf, ModelError> {
        let bytes = v.bytes();
        let u = self.link.upload(what, v)?;
        st.traffic.h2d_bytes += bytes;
        self.link.finish(u)
    }

    /// The unit's weights, taken out of the map in declared order.
    fn take(
        &self,
        model: &Model,
        unit: UnitId,
        params: &[Tensor],
    ) -> Result<(Vec<ParamId>, Vec<L::Buf>), ModelError> {
        let ids = model.unit(unit)?.params.clone();
        if ids.len() != params.len() {
            return Err(ModelError::ParamCount {
                unit,
                expected: ids.len(),
                found: params.len(),
            });
        }
        let mut st = self.lock();
        if self.partitioned() {
            let ahead = self.prefetches().remove(&unit);
            let wholes = match ahead {
                Some(p) => p.wholes,
                None => self.gather_unit_ahead(&mut st, unit, &ids)?,
            };
            let bufs = self.link.finish_all(wholes)?;
            return Ok((ids, bufs));
        }
        let mut bufs = Vec::with_capacity(ids.len());
        for &id in &ids {
            match st.params.get_mut(&id).and_then(|p| p.weights.take()) {
                Some(b) => bufs.push(b),
                None => {
                    let why = if st.params.contains_key(&id) {
                        "is in use by another unit"
                    } else {
                        "has no state on the device (it is loaded before the first step)"
                    };
                    for (&back, b) in ids.iter().zip(bufs) {
                        if let Some(p) = st.params.get_mut(&back) {
                            p.weights = Some(b);
                        }
                    }
                    return Err(ModelError::Gpu {
                        what: format!("device optimizer: param {} of unit {} {why}", id.0, unit.0),
                    });
                }
            }
        }
        Ok((ids, bufs))
    }

    /// The staged units' gathers.
    fn prefetches(&self) -> std::sync::MutexGuard<'_, BTreeMap<UnitId, Prefetched<L::Upload>>> {
        self.prefetched.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every staged unit's gathered params, not taken, freed; after a
    /// failure the rest of that unit's go with their uploads (which leak
    /// what a collective may still write) rather than each waiting on a
    /// communicator that failed.
    fn drop_prefetched(&self) {
        let ahead = std::mem::take(&mut *self.prefetches());
        for p in ahead.into_values() {
            for u in p.wholes {
                if let Err(e) = self.link.discard(u) {
                    tracing::warn!(error = %e, "a staged gather nobody took failed");
                    break;
                }
            }
        }
    }

    /// Puts a unit's weights back (partitioned: frees the unit's
    /// gathered ones).
    fn put_back(&self, ids: &[ParamId], bufs: Vec<L::Buf>) {
        if self.partitioned() {
            for b in bufs {
                self.link.free(b);
            }
            return;
        }
        let mut st = self.lock();
        for (id, b) in ids.iter().zip(bufs) {
            match st.params.get_mut(id) {
                Some(p) => p.weights = Some(b),
                None => self.link.free(b),
            }
        }
    }

    /// Moves param `id`'s gradient by `event`.
    fn grad_event(
        &self,
        st: &mut Resident<L::Buf, L::Upload>,
        id: ParamId,
        event: GradEvent<L::Buf>,
    ) -> Result<(), ModelError> {
        let e = self.link.exec();
        let p = st.params.get_mut(&id).ok_or_else(|| ModelError::Gpu {
            what: format!(
                "device optimizer: a gradient of param {}, which has no state",
                id.0
            ),
        })?;
        p.grad = std::mem::take(&mut p.grad).apply(&e, event)?;
        Ok(())
    }

    /// Frees a param's link buffers.
    fn free(&self, p: OnDevice<L::Buf, L::Upload>) {
        if let Some(w) = p.weights {
            self.link.free(w);
        }
        if let Some(a) = p.adam {
            self.free_adam(a);
        }
        match p.reduced {
            Reduced::None => {}
            Reduced::Ready(b) => self.link.free(b),
            // In flight: waited for (at once on a communicator a failed
            // collective made unusable, which leaks it), then freed.
            Reduced::InFlight(u) => {
                if let Err(e) = self.link.discard(u) {
                    tracing::warn!(error = %e, "a reduce nobody took failed");
                }
            }
        }
    }

    /// Frees Adam's state of a shard.
    fn free_adam(&self, a: AdamState<L::Buf>) {
        if let Some(master) = a.master {
            self.link.free(master);
        }
        self.link.free(a.m);
        self.link.free(a.v);
    }

    /// Every micro-batch sum still open joins the step's (a param whose
    /// last unit did not run): with several ranks, each is reduced, in
    /// param order (the same on every rank), and every sum in flight is
    /// waited for.
    fn fold_all(&self, st: &mut Resident<L::Buf, L::Upload>) -> Result<(), ModelError> {
        let ids: Vec<ParamId> = st.params.keys().copied().collect();
        if self.ranks.is_some() {
            // Whatever these sums' units were, fp32 crosses them exactly.
            self.reduce_params(st, &ids, Wire::F32)?;
            return self.settle(st);
        }
        for id in ids {
            self.grad_event(st, id, GradEvent::Fold)?;
        }
        Ok(())
    }
}

/// An error about param `id`'s state.
fn param_err(id: ParamId, what: &str) -> ModelError {
    ModelError::Gpu {
        what: format!("device optimizer: param {} {what}", id.0),
    }
}

impl<L: DeviceLink> Holder<L> for ResidentUnits<L> {
    fn link(&self) -> &L {
        &self.link
    }

    fn inputs(&self) -> &Inputs<L::Buf> {
        &self.inputs
    }

    fn take_params(
        &self,
        model: &Model,
        unit: UnitId,
        params: &[Tensor],
    ) -> Result<(Vec<ParamId>, Vec<L::Buf>), ModelError> {
        self.take(model, unit, params)
    }

    fn give_params(&self, ids: &[ParamId], bufs: Vec<L::Buf>) -> Result<(), ModelError> {
        self.put_back(ids, bufs);
        Ok(())
    }

    /// Every param's weights are on the device, unless a unit has them.
    /// Partitioned, none is: a unit's are gathered when it is staged or
    /// called (a collective, made in the engine's order), so it is ready
    /// only once staged.
    fn ready(&self, ids: &[ParamId]) -> bool {
        if self.partitioned() {
            return !ids.is_empty() && self.prefetches().values().any(|p| p.ids == ids);
        }
        let st = self.lock();
        ids.iter()
            .all(|id| st.params.get(id).is_some_and(|p| p.weights.is_some()))
    }
}

impl<L: DeviceLink> UnitCompute for ResidentUnits<L> {
    fn on_device(&self) -> bool {
        true
    }

    fn describe(&self) -> String {
        match &self.ranks {
            None => format!(
                "{}; params, gradients and AdamW resident on the device",
                self.link.describe()
            ),
            Some(r) if r.partition => format!(
                "{}; params, AdamW's state and the gradients' sums sharded on {} ranks' \
                 devices (stage 3), each unit's params gathered on them for it, the gradients \
                 reduce-scattered there",
                self.link.describe(),
                self.link.reduce_ranks()
            ),
            Some(_) => format!(
                "{}; params whole on each of {} ranks' devices, AdamW's state and the \
                 gradients' sums sharded there, reduce-scattered and gathered on the devices",
                self.link.describe(),
                self.link.reduce_ranks()
            ),
        }
    }

    /// Several ranks: the host's params are only counted (the units read
    /// the device's), so the param store hands out this rank's shards and
    /// gathers nothing on the host.
    fn gathers_params(&self) -> bool {
        self.ranks.is_some()
    }

    fn forward_unit(
        &self,
        model: &Model,
        unit: UnitId,
        params: &[Tensor],
        input: UnitInput<'_>,
    ) -> Result<UnitOutput, ModelError> {
        let out = self.aheads.forward(self, model, unit, params, input)?;
        self.lock().traffic.d2h_bytes += output_numel(&out) * ELEM_BYTES;
        Ok(out)
    }

    fn backward_unit(
        &self,
        model: &Model,
        unit: UnitId,
        params: &[Tensor],
        input: UnitInput<'_>,
        upstream: Upstream<'_>,
    ) -> Result<UnitGrads, ModelError> {
        let out = self
            .aheads
            .backward(self, model, unit, params, input, upstream)?;
        let e = self.link.exec();
        let mut st = self.lock();
        st.traffic.d2h_bytes += out.input.as_ref().map_or(0, numel_of) * ELEM_BYTES;
        // Several ranks: the params whose sums this unit completes, by the
        // dtype they cross in, reduced together after (one collective for
        // each dtype, fp32's first, in declared order: the same on every
        // rank).
        let mut folds: [Vec<ParamId>; 2] = [Vec::new(), Vec::new()];
        for (id, g, _dims) in out.grads {
            // A bf16 gradient is what the host would have received.
            let g = if out.dtype == DType::BF16 {
                let mut r = e
                    .output("bf16 gradient", e.len(&g))
                    .map_err(exec_units::gpu_err)?;
                e.round_bf16(&mut r, &g).map_err(exec_units::gpu_err)?;
                // The fp32 gradient goes before the add below makes the
                // new sum (the memory bound counts two of the largest
                // beside the unit's gradients, not three); freed in the
                // compute stream's order, after the rounding read it.
                drop(g);
                r
            } else {
                g
            };
            self.grad_event(&mut st, id, GradEvent::Unit(g))?;
            if self.last_unit.get(id.0) == Some(&unit) {
                if self.ranks.is_some() {
                    // An untied param's sum is this unit's gradient, rounded
                    // as the unit's were: it crosses so, exactly (the
                    // tier's rule); a tied one's, a sum of two, as fp32.
                    let narrow =
                        model.in_one_unit(id) && super::grads_out::wire_of(out.dtype) != Wire::F32;
                    folds[usize::from(narrow)].push(id);
                } else {
                    self.grad_event(&mut st, id, GradEvent::Fold)?;
                }
            }
        }
        let narrow = super::grads_out::wire_of(out.dtype);
        for (ids, wire) in folds.iter().zip([Wire::F32, narrow]) {
            if !ids.is_empty() {
                self.reduce_params(&mut st, ids, wire)?;
            }
        }
        drop(st);
        // Its gradients are summed: the unit before it may compute now.
        if let Some(dx) = &out.input {
            self.aheads.launch_backward(self, model, unit, dx)?;
        }
        Ok(UnitGrads {
            params: Vec::new(),
            input: out.input,
            loss: out.loss,
        })
    }

    fn head_batch(&self, targets: &Tensor, loss_scale: f64) {
        self.aheads.head_batch(targets, loss_scale);
    }

    fn begin_step(&self) -> Result<(), ModelError> {
        let ahead = self.aheads.clear(self);
        self.inputs.clear();
        self.drop_prefetched();
        ahead
    }

    /// The engine hands over the next unit's params, for its forward to
    /// be launched ahead (see "Forwards launched ahead" in [`super`]):
    /// they are on the device already (partitioned, none is launched
    /// ahead).
    fn stages(&self) -> bool {
        true
    }

    fn stage(
        &self,
        model: &Model,
        unit: UnitId,
        params: &[Tensor],
        _pins: HomePins,
    ) -> Result<(), ModelError> {
        if self.partitioned() {
            // Its params gathered now, in the engine's order (every
            // rank's), in flight until its call, which may be launched
            // ahead on them.
            let ids = model.unit(unit)?.params.clone();
            let mut st = self.lock();
            if !self.prefetches().contains_key(&unit) {
                let wholes = self.gather_unit_ahead(&mut st, unit, &ids)?;
                self.prefetches().insert(unit, Prefetched { ids, wholes });
            }
        }
        self.aheads.staged(unit, params);
        Ok(())
    }

    fn take_traffic(&self) -> Option<DeviceTraffic> {
        let mut t = std::mem::take(&mut self.lock().traffic);
        t.add(&self.inputs.take_traffic());
        Some(t)
    }

    fn take_device_spans(&self) -> Vec<DeviceSpan> {
        self.link.take_spans()
    }

    fn memory_plan(&self, _model: &Model) -> Option<DeviceMemoryPlan> {
        Some(self.plan())
    }

    fn device_optimizer(&self) -> Option<&dyn DeviceOptimizer> {
        Some(self)
    }

    fn activations_line(&self) -> Option<String> {
        Some(self.inputs.forwards_line())
    }
}

impl<L: DeviceLink> Drop for ResidentUnits<L> {
    fn drop(&mut self) {
        let _ = self.aheads.clear(&*self);
        self.inputs.clear();
        self.drop_prefetched();
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        let params = std::mem::take(&mut st.params);
        for p in params.into_values() {
            self.free(p);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::{Grad, GradEvent};
    use tierzero_gpu::unit::HostExec;

    fn sum(g: &Grad<Vec<f32>>) -> Option<&Vec<f32>> {
        match g {
            Grad::Summed(s) => Some(s),
            _ => None,
        }
    }

    #[test]
    fn gradients_add_a_micro_batch_s_units_first_then_into_the_step_s_sum() {
        let e = HostExec::F32;
        // Values where the order of the additions shows in f32.
        let (a, b, c) = (vec![1.0e8f32], vec![1.0f32], vec![-1.0e8f32]);
        let mut g = Grad::Zero;
        // Micro-batch 1: two units (a tied param), then its last unit folds.
        g = g.apply(&e, GradEvent::Unit(a.clone())).unwrap();
        g = g.apply(&e, GradEvent::Unit(b.clone())).unwrap();
        g = g.apply(&e, GradEvent::Fold).unwrap();
        assert_eq!(sum(&g), Some(&vec![a[0] + b[0]]));
        // Micro-batch 2: its own sum first, then added to the step's:
        // (a + b) + (c + b), not ((a + b) + c) + b.
        g = g.apply(&e, GradEvent::Unit(c.clone())).unwrap();
        g = g.apply(&e, GradEvent::Unit(b.clone())).unwrap();
        g = g.apply(&e, GradEvent::Fold).unwrap();
        let want = (a[0] + b[0]) + (c[0] + b[0]);
        assert_ne!(want, ((a[0] + b[0]) + c[0]) + b[0], "the test's values");
        assert_eq!(sum(&g), Some(&vec![want]));
        // A fold with nothing open changes nothing; clear empties it.
        g = g.apply(&e, GradEvent::Fold).unwrap();
        assert_eq!(sum(&g), Some(&vec![want]));
        g = g.apply(&e, GradEvent::Clear).unwrap();
        assert!(matches!(g, Grad::Zero));
        assert!(matches!(
            Grad::Zero.apply(&e, GradEvent::<Vec<f32>>::Fold).unwrap(),
            Grad::Zero
        ));
    }
}

//! Units launched ahead: a unit's forward or backward queued on the
//! device as soon as the unit before it in that pass has its result on
//! the host, before the engine asks for it (see "Units launched ahead"
//! in [`super`]).
//!
//! # What it holds
//!
//! At most one [`Ahead`]: the unit, the pass, the host tensors it was
//! launched on (its input, in backward its upstream gradient, and its
//! params: their tensor ids), the device params it holds (taken from its
//! owner, [`super::TieredUnits`] or [`super::ResidentUnits`], through
//! [`Holder`]) and its results on the device. It leaves in one of two
//! ways: the engine's call for that unit in that pass on those tensors
//! takes it, or any other call gives its params back unused and drops
//! its results. A new step and the owner dropped give it back too
//! ([`Aheads::clear`]), so no param stays in use past them.
//!
//! # When one is launched
//!
//! In forward, after a unit's hidden output came down, the next unit in
//! the model's order if it is a block, or, if it is the head, the head's
//! forward and backward (its loss and gradients: it computes first in
//! backward) on the micro-batch's targets and loss scale, which the
//! engine gives before the forward ([`Aheads::head_batch`]); in backward,
//! after a unit's input
//! gradient came down, the unit before it (a block or the embedding),
//! on its host input in the last forward ([`Aheads::forward`] keeps each
//! unit's, until its backward). Only if the engine handed that unit's
//! params over ([`Aheads::staged`], from `UnitCompute::stage`; held until
//! that unit's backward, or the next unit staged) and the
//! owner says every one of them is on the device with nothing for the
//! host to wait for ([`Holder::ready`]). It never waits for an upload's
//! fill: the engine's call would wait for it anyway, and the upload
//! thread must get the next unit's fills meanwhile. (A param gathered on
//! the device is issued on the engine's thread, so it is ready at once;
//! taking it waits on the host for its exchange on a GPU, which the
//! engine's call would wait for too.)

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use candle_core::{Tensor, TensorId};

use super::inputs::Inputs;
use super::DeviceLink;
use crate::model::exec_units::{BackwardDev, BackwardOut, ForwardOut};
use crate::model::{Model, ModelError, ParamId, UnitId, UnitInput, UnitKind, UnitOutput, Upstream};

/// What lends a unit's params on the device to a compute: the owner of
/// the params, its link and its inputs.
pub(super) trait Holder<L: DeviceLink> {
    /// The link it computes on.
    fn link(&self) -> &L;
    /// Its units' inputs.
    fn inputs(&self) -> &Inputs<L::Buf>;
    /// `unit`'s params on the device, in declared order, now in use
    /// (`params`: their host copies).
    fn take_params(
        &self,
        model: &Model,
        unit: UnitId,
        params: &[Tensor],
    ) -> Result<(Vec<ParamId>, Vec<L::Buf>), ModelError>;
    /// Gives back what [`Holder::take_params`] lent.
    fn give_params(&self, ids: &[ParamId], bufs: Vec<L::Buf>) -> Result<(), ModelError>;
    /// Whether [`Holder::take_params`] of these params would not make the
    /// host wait for a fill (each one is on the device, or its upload is
    /// issued; a gathered one's exchange may still be waited for).
    fn ready(&self, ids: &[ParamId]) -> bool;
}

/// What a unit launched ahead left on the device.
enum Launched<B> {
    /// A forward's output.
    Forward(ForwardOut<B>),
    /// A backward's gradients.
    Backward(BackwardDev<B>),
}

/// What a backward was launched on above the unit: the unit after's
/// input gradient, or (the head's) the loss scale's bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Up {
    Grad(TensorId),
    Scale(u64),
}

/// A unit launched ahead of the engine's call.
struct Ahead<B> {
    unit: UnitId,
    /// The host input it was launched on.
    input: TensorId,
    /// The head's: the targets it was launched on.
    targets: Option<TensorId>,
    /// In backward, what it was launched on above it.
    upstream: Option<Up>,
    /// The host params it was launched with (the staged ones).
    host_params: Vec<TensorId>,
    ids: Vec<ParamId>,
    bufs: Vec<B>,
    out: Launched<B>,
}

impl<B> Ahead<B> {
    /// Whether it is this call's: the same unit, pass and host tensors.
    fn is_for(&self, call: &Call<'_, '_>) -> bool {
        let same_input = match call.input {
            UnitInput::Hidden(t) | UnitInput::Tokens(t) => {
                t.id() == self.input && self.targets.is_none()
            }
            UnitInput::HiddenWithTargets { hidden, targets } => {
                hidden.id() == self.input && self.targets == Some(targets.id())
            }
        };
        let same_params = self.host_params.len() == call.params.len()
            && self
                .host_params
                .iter()
                .zip(call.params)
                .all(|(id, t)| *id == t.id());
        self.unit == call.unit
            && matches!(self.out, Launched::Backward(_)) == call.backward
            && same_input
            && self.upstream == call.upstream
            && same_params
    }
}

/// A call's params lent by the holder, and its results.
type Lent<B, T> = (Vec<ParamId>, Vec<B>, Result<T, ModelError>);

/// An engine's call, to match a unit launched ahead against.
struct Call<'c, 'i> {
    unit: UnitId,
    params: &'c [Tensor],
    input: &'c UnitInput<'i>,
    backward: bool,
    /// A backward's upstream (None: a forward).
    upstream: Option<Up>,
}

/// The unit the engine staged last, the unit launched ahead, and each
/// unit's host input in the last forward.
pub(super) struct Aheads<B> {
    /// Whether units are launched ahead at all (on unless a measurement
    /// turns it off).
    enabled: bool,
    staged: Mutex<Option<(UnitId, Vec<Tensor>)>>,
    ahead: Mutex<Option<Ahead<B>>>,
    /// Each unit's host input (hidden state or tokens) in the last
    /// forward, until its backward: what a backward launched ahead
    /// computes on.
    seen: Mutex<HashMap<UnitId, Tensor>>,
    /// This micro-batch's targets and the head's loss scale
    /// ([`Aheads::head_batch`]): what the head, launched ahead as the
    /// last block's output comes down, computes on.
    head: Mutex<Option<(Tensor, f64)>>,
}

/// The unit after `unit` in the model's order (`after`), or the one
/// before it, and its kind.
fn neighbour(model: &Model, unit: UnitId, after: bool) -> Option<(UnitId, UnitKind)> {
    let units = model.units();
    let at = units.iter().position(|u| u.id == unit)?;
    let n = units.get(if after { at + 1 } else { at.checked_sub(1)? })?;
    Some((n.id, n.kind))
}

/// The unit before `unit` in the model's order, unless it is the head:
/// the one whose backward takes `unit`'s input gradient.
fn prev_unit(model: &Model, unit: UnitId) -> Option<UnitId> {
    neighbour(model, unit, false).and_then(|(id, kind)| (kind != UnitKind::Head).then_some(id))
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<B> Aheads<B> {
    /// Nothing staged, launched or seen.
    pub(super) fn new() -> Self {
        Aheads {
            enabled: true,
            staged: Mutex::new(None),
            ahead: Mutex::new(None),
            seen: Mutex::new(HashMap::new()),
            head: Mutex::new(None),
        }
    }

    /// This micro-batch's targets and the head's loss scale, for the head
    /// launched ahead ([`crate::model::exec_units::UnitCompute::head_batch`]).
    pub(super) fn head_batch(&self, targets: &Tensor, loss_scale: f64) {
        *locked(&self.head) = Some((targets.clone(), loss_scale));
    }

    /// Launches units ahead, or (`false`: to measure what it gains) none.
    pub(super) fn set_enabled(&mut self, on: bool) {
        self.enabled = on;
    }

    /// The engine staged `unit` with these host params.
    pub(super) fn staged(&self, unit: UnitId, params: &[Tensor]) {
        *locked(&self.staged) = Some((unit, params.to_vec()));
    }

    /// Gives back a unit launched ahead that nobody will ask for (a new
    /// step, the owner dropped), and forgets what was staged and seen.
    pub(super) fn clear<L: DeviceLink<Buf = B>>(
        &self,
        holder: &impl Holder<L>,
    ) -> Result<(), ModelError> {
        *locked(&self.staged) = None;
        locked(&self.seen).clear();
        *locked(&self.head) = None;
        let a = locked(&self.ahead).take();
        a.map_or(Ok(()), |a| give_back(holder, a))
    }

    /// `unit`'s forward: the one launched ahead if it is this call's
    /// (counted in the inputs' traffic), else computed now (one launched
    /// for anything else given back first). Once its hidden output is on
    /// the host, the next block's forward is launched on it when it can
    /// be (see the module docs).
    pub(super) fn forward<L: DeviceLink<Buf = B>>(
        &self,
        holder: &impl Holder<L>,
        model: &Model,
        unit: UnitId,
        params: &[Tensor],
        input: UnitInput<'_>,
    ) -> Result<UnitOutput, ModelError> {
        let (link, inputs) = (holder.link(), holder.inputs());
        if let UnitInput::Hidden(t) | UnitInput::Tokens(t) = &input {
            locked(&self.seen).insert(unit, (*t).clone());
        }
        let call = Call {
            unit,
            params,
            input: &input,
            backward: false,
            upstream: None,
        };
        let (ids, bufs, out) = self.taken_or(
            holder,
            model,
            &call,
            |l| match l {
                Launched::Forward(o) => {
                    inputs.count(|c| c.forwards_ahead += 1);
                    Ok(o)
                }
                other => Err(other),
            },
            |bufs| inputs.forward_on(link, model, unit, (params, bufs), input),
        )?;
        let out = out.and_then(|o| inputs.to_host(link, o));
        let back = holder.give_params(&ids, bufs);
        let out = out?;
        back?;
        if let UnitOutput::Hidden(h) = &out {
            self.launch_forward(holder, model, unit, h)?;
        }
        Ok(out)
    }

    /// `unit`'s backward: the one launched ahead if it is this call's
    /// (counted in the inputs' traffic), else computed now (one launched
    /// for anything else given back first). Its input gradient comes back
    /// on the host, its param gradients stay on the device; the caller
    /// then launches the unit before it ([`Aheads::launch_backward`]),
    /// once it has queued what it does with them.
    pub(super) fn backward<L: DeviceLink<Buf = B>>(
        &self,
        holder: &impl Holder<L>,
        model: &Model,
        unit: UnitId,
        params: &[Tensor],
        input: UnitInput<'_>,
        upstream: Upstream<'_>,
    ) -> Result<BackwardOut<B>, ModelError> {
        let (link, inputs) = (holder.link(), holder.inputs());
        // Its forward's input is no longer needed here.
        locked(&self.seen).remove(&unit);
        let call = Call {
            unit,
            params,
            input: &input,
            backward: true,
            upstream: Some(match upstream {
                Upstream::Grad(t) => Up::Grad(t.id()),
                Upstream::LossScale(s) => Up::Scale(s.to_bits()),
            }),
        };
        let (ids, bufs, dev) = self.taken_or(
            holder,
            model,
            &call,
            |l| match l {
                Launched::Backward(d) => {
                    inputs.count(|c| c.backwards_ahead += 1);
                    Ok(d)
                }
                other => Err(other),
            },
            |bufs| inputs.backward_dev(link, model, unit, (params, bufs), input, upstream),
        )?;
        let out = dev.and_then(|d| inputs.backward_out(link, d));
        let back = holder.give_params(&ids, bufs);
        // Its staged host params, if it was the last staged, are not
        // launched again before the engine stages it anew: let them go
        // (the embedding's, staged last in each step, were held through
        // the optimizer step until the next one began).
        self.forget_staged(unit);
        let out = out?;
        back?;
        Ok(out)
    }

    /// Forgets the staged host params if they are `unit`'s.
    fn forget_staged(&self, unit: UnitId) {
        let mut staged = locked(&self.staged);
        if staged.as_ref().is_some_and(|(u, _)| *u == unit) {
            *staged = None;
        }
    }

    /// The unit whose staged host params are held for a launch ahead.
    pub(super) fn staged_unit(&self) -> Option<UnitId> {
        locked(&self.staged).as_ref().map(|(u, _)| *u)
    }

    /// The call's params (lent by `holder`) and results: the unit
    /// launched ahead if it is this call's (`pick` takes its results),
    /// else `compute`d now on params taken from the holder.
    fn taken_or<L: DeviceLink<Buf = B>, T>(
        &self,
        holder: &impl Holder<L>,
        model: &Model,
        call: &Call<'_, '_>,
        pick: impl FnOnce(Launched<B>) -> Result<T, Launched<B>>,
        compute: impl FnOnce(&[B]) -> Result<T, ModelError>,
    ) -> Result<Lent<B, T>, ModelError> {
        match self.take(holder, call)? {
            Some(a) => match pick(a.out) {
                Ok(t) => Ok((a.ids, a.bufs, Ok(t))),
                // `Ahead::is_for` compares the pass: an engine bug.
                Err(_) => {
                    let back = holder.give_params(&a.ids, a.bufs);
                    Err(ModelError::Gpu {
                        what: format!(
                            "device units: unit {} launched ahead in the other pass was taken \
                             (an engine bug){}",
                            a.unit.0,
                            back.err()
                                .map_or(String::new(), |e| format!("; giving it back: {e}"))
                        ),
                    })
                }
            },
            None => {
                let (ids, bufs) = holder.take_params(model, call.unit, call.params)?;
                let out = compute(&bufs);
                Ok((ids, bufs, out))
            }
        }
    }

    /// The unit launched ahead if it is `call`'s; one launched for
    /// anything else is given back.
    fn take<L: DeviceLink<Buf = B>>(
        &self,
        holder: &impl Holder<L>,
        call: &Call<'_, '_>,
    ) -> Result<Option<Ahead<B>>, ModelError> {
        let Some(a) = locked(&self.ahead).take() else {
            return Ok(None);
        };
        if a.is_for(call) {
            return Ok(Some(a));
        }
        give_back(holder, a)?;
        Ok(None)
    }

    /// `unit`'s staged host params, if the engine staged it last and the
    /// holder has each of them on the device, ready.
    fn staged_ready<L: DeviceLink<Buf = B>>(
        &self,
        holder: &impl Holder<L>,
        model: &Model,
        unit: UnitId,
    ) -> Result<Option<Vec<Tensor>>, ModelError> {
        if !self.enabled {
            return Ok(None);
        }
        let params = match &*locked(&self.staged) {
            Some((u, params)) if *u == unit => params.clone(),
            _ => return Ok(None),
        };
        let ids = &model.unit(unit)?.params;
        Ok((ids.len() == params.len() && holder.ready(ids)).then_some(params))
    }

    /// Launches, on `host`, `unit`'s output, the unit after it if the
    /// engine staged it and its params are ready: a block's forward, or
    /// the head's forward and backward (its loss and gradients) with the
    /// micro-batch's targets and loss scale (the engine then fetches the
    /// last block's params for its backward while the head computes).
    fn launch_forward<L: DeviceLink<Buf = B>>(
        &self,
        holder: &impl Holder<L>,
        model: &Model,
        unit: UnitId,
        host: &Tensor,
    ) -> Result<(), ModelError> {
        let Some((next, kind)) = neighbour(model, unit, true) else {
            return Ok(());
        };
        let head = match kind {
            UnitKind::Block { .. } => None,
            UnitKind::Head => match locked(&self.head).clone() {
                Some(h) => Some(h),
                None => return Ok(()),
            },
            UnitKind::Embedding => return Ok(()),
        };
        let Some(params) = self.staged_ready(holder, model, next)? else {
            return Ok(());
        };
        let (link, inputs) = (holder.link(), holder.inputs());
        match &head {
            None => self.launch(holder, model, next, params, (host, None, None), |p, b| {
                inputs
                    .forward_on(link, model, next, (p, b), UnitInput::Hidden(host))
                    .map(Launched::Forward)
            }),
            Some((targets, scale)) => {
                let key = (host, Some(targets), Some(Up::Scale(scale.to_bits())));
                self.launch(holder, model, next, params, key, |p, b| {
                    let input = UnitInput::HiddenWithTargets {
                        hidden: host,
                        targets,
                    };
                    inputs
                        .backward_dev(
                            link,
                            model,
                            next,
                            (p, b),
                            input,
                            Upstream::LossScale(*scale),
                        )
                        .map(Launched::Backward)
                })
            }
        }
    }

    /// Launches the backward of the unit before `unit` on `dx`, `unit`'s
    /// input gradient, and on that unit's host input in the last forward,
    /// if the engine staged it and its params are ready.
    pub(super) fn launch_backward<L: DeviceLink<Buf = B>>(
        &self,
        holder: &impl Holder<L>,
        model: &Model,
        unit: UnitId,
        dx: &Tensor,
    ) -> Result<(), ModelError> {
        let Some(prev) = prev_unit(model, unit) else {
            return Ok(());
        };
        let Some(x) = locked(&self.seen).get(&prev).cloned() else {
            return Ok(());
        };
        let Some(params) = self.staged_ready(holder, model, prev)? else {
            return Ok(());
        };
        let input = match model.unit(prev)?.kind {
            UnitKind::Embedding => UnitInput::Tokens(&x),
            _ => UnitInput::Hidden(&x),
        };
        let (link, inputs) = (holder.link(), holder.inputs());
        let key = (&x, None, Some(Up::Grad(dx.id())));
        self.launch(holder, model, prev, params, key, |p, b| {
            inputs
                .backward_dev(link, model, prev, (p, b), input, Upstream::Grad(dx))
                .map(Launched::Backward)
        })
    }

    /// Launches `unit` on its staged host `params`, taken from the holder
    /// (`run`), and keeps what it launched on (`(input, targets,
    /// upstream)`) with its results until its call; a launch that failed
    /// gives its params back and fails.
    fn launch<L: DeviceLink<Buf = B>>(
        &self,
        holder: &impl Holder<L>,
        model: &Model,
        unit: UnitId,
        params: Vec<Tensor>,
        (input, targets, upstream): (&Tensor, Option<&Tensor>, Option<Up>),
        run: impl FnOnce(&[Tensor], &[B]) -> Result<Launched<B>, ModelError>,
    ) -> Result<(), ModelError> {
        let (ids, bufs) = holder.take_params(model, unit, &params)?;
        let out = match run(&params, &bufs) {
            Ok(o) => o,
            Err(e) => {
                // The launch's own failure is the cause; one in giving
                // the params back after it is said, not put in its place.
                if let Err(back) = holder.give_params(&ids, bufs) {
                    tracing::warn!(error = %back, "giving back a failed launch's params failed too");
                }
                return Err(e);
            }
        };
        *locked(&self.ahead) = Some(Ahead {
            unit,
            input: input.id(),
            targets: targets.map(Tensor::id),
            upstream,
            host_params: params.iter().map(Tensor::id).collect(),
            ids,
            bufs,
            out,
        });
        Ok(())
    }
}

/// Gives back what a unit launched ahead holds, unused: its params to
/// their holder, its results dropped.
fn give_back<L: DeviceLink>(holder: &impl Holder<L>, a: Ahead<L::Buf>) -> Result<(), ModelError> {
    drop(a.out);
    holder.give_params(&a.ids, a.bufs)
}

//! One micro-batch's compute: forward over the units but the head, then
//! backward from the head, each unit from what its forward left (its
//! input, or its recorded graph: the activation policy, `activations.rs`),
//! its gradients handed to the sub-groups as they become final.

use super::super::activations::{Plan as ActivationPlan, Saved};
use super::*;
use crate::model::exec_units::HomePins;

/// One micro-batch's tokens.
#[derive(Debug)]
struct Batch<'a> {
    ids: &'a Tensor,
    targets: &'a Tensor,
    shape: [usize; 2],
    /// The step's last micro-batch: gradients become final during its
    /// backward.
    last_micro: bool,
}

/// A unit's params fetched, and handed to the compute, before its turn
/// ([`Trainer::stage_unit`]).
type Staged = Option<(UnitId, Vec<Tensor>)>;

impl Trainer {
    /// One micro-batch: forward over everything but the head, then
    /// backward by recompute from the head. Returns its loss.
    pub(super) fn micro_batch(
        &mut self,
        plan: &StepPlan,
        micro: usize,
        groups: &mut StepGroups,
        tied: &mut BTreeMap<ParamId, Vec<f32>>,
        times: &mut StepTimes,
    ) -> Result<f32> {
        let first = self.first_sample(micro);
        let (ids, targets) = self.data.batch(
            first,
            plan.micro_batch,
            plan.seq_len,
            self.opts.data_order,
            &self.opts.device,
        )?;
        let batch = Batch {
            ids: &ids,
            targets: &targets,
            shape: [plan.micro_batch, plan.seq_len],
            last_micro: micro + 1 == plan.gas,
        };
        let (mut saved, head) = self.forward(plan, &batch, times)?;
        let loss = self.backward(plan, &batch, &mut saved, head, groups, tied, times)?;
        if batch.last_micro {
            // Every sum is back in memory for the step (a group no unit
            // added to in this micro-batch would otherwise stay parked).
            for i in 0..self.layout.sub_groups.len() {
                self.unpark(groups, SubGroupId(i))?;
            }
        }
        Ok(loss)
    }

    /// Forward over every unit but the head; returns what each unit's
    /// backward needs (the head's input too): its input, or, for a block
    /// the activation policy keeps, its forward graph (`activations.rs`).
    /// With a compute that stages, also the head's params: the head
    /// computes first in backward, so they are fetched and staged under
    /// the last block's forward (with several ranks their gather, and
    /// their upload, overlap that block's compute), in backward's order of
    /// visits.
    fn forward(
        &mut self,
        plan: &StepPlan,
        batch: &Batch<'_>,
        times: &mut StepTimes,
    ) -> Result<(Vec<Option<Saved>>, Staged)> {
        let units: Vec<(UnitId, UnitKind)> =
            self.model.units().iter().map(|u| (u.id, u.kind)).collect();
        let mut saved: Vec<Option<Saved>> = (0..units.len()).map(|_| None).collect();
        let mut hidden: Option<Tensor> = None;
        // Deciding (the first micro-batch of this shape): the running
        // total of the kept graphs, and whether one no longer fit.
        let deciding = self.activations.deciding(batch.shape)
            && !self.opts.skip_compute
            && self.opts.compute.is_none();
        let mut keep = vec![false; units.len()];
        let mut held = vec![0u64; units.len()];
        let mut used_bytes = 0u64;
        let mut full = false;
        // The last block's graph measured while deciding: the blocks are
        // alike, so a graph that would not fit beside the kept ones is not
        // built to be measured (it was, and the budget then held it and
        // the kept ones at once, one block's graph past it).
        let mut last_graph_bytes: Option<u64> = None;
        let stages = self.stages();
        if stages {
            if let Some(c) = &self.opts.compute {
                c.head_batch(batch.targets, plan.head_scale);
            }
        }
        let mut ahead = None;
        for (idx, &(uid, kind)) in units.iter().enumerate() {
            if kind == UnitKind::Head {
                saved[uid.0] = hidden.clone().map(Saved::Input);
                continue;
            }
            let params = self.unit_params(plan, uid, Pass::Forward, batch.shape, &mut ahead)?;
            if stages {
                self.load_unit(uid, &params)?;
            }
            match units.get(idx + 1) {
                Some(&(next, k)) if stages && k != UnitKind::Head => {
                    ahead = Some(self.stage_unit(plan, next, Pass::Forward, batch.shape)?);
                }
                Some(&(next, UnitKind::Head)) if stages => {
                    ahead = Some(self.stage_unit(plan, next, Pass::Backward, batch.shape)?);
                }
                _ => {}
            }
            if self.opts.skip_compute {
                drop(params);
                self.release_unit(uid)?;
                continue;
            }
            let t0 = Instant::now();
            let policy = match kind {
                // Another executor's units keep no candle graph.
                UnitKind::Block { .. } if !full && self.opts.compute.is_none() => {
                    match self.activations.plan(batch.shape, uid.0) {
                        ActivationPlan::Try
                            if last_graph_bytes.is_some_and(|b| {
                                used_bytes.saturating_add(b) > self.activations.budget_bytes()
                            }) =>
                        {
                            full = true;
                            ActivationPlan::Recompute
                        }
                        p => p,
                    }
                }
                _ => ActivationPlan::Recompute,
            };
            let out = match (kind, &hidden, policy) {
                (UnitKind::Embedding, _, _) => self
                    .forward_unit(uid, &params, UnitInput::Tokens(batch.ids))?
                    .into_tensor(),
                (_, Some(h), ActivationPlan::Recompute) => {
                    saved[uid.0] = Some(Saved::Input(h.clone()));
                    self.forward_unit(uid, &params, UnitInput::Hidden(h))?
                        .into_tensor()
                }
                (_, Some(h), ActivationPlan::Keep | ActivationPlan::Try) => {
                    let rec = self.model.record_unit(uid, &params, UnitInput::Hidden(h))?;
                    let out = rec
                        .hidden()
                        .ok_or_else(|| EngineError::internal("a block without a hidden output"))?;
                    if policy == ActivationPlan::Keep {
                        saved[uid.0] = Some(Saved::Kept(rec));
                    } else {
                        let bytes = rec.held_bytes();
                        held[uid.0] = bytes;
                        last_graph_bytes = Some(bytes);
                        if used_bytes.saturating_add(bytes) <= self.activations.budget_bytes() {
                            used_bytes += bytes;
                            keep[uid.0] = true;
                            saved[uid.0] = Some(Saved::Kept(rec));
                        } else {
                            // It does not fit, nor would the next: this one
                            // and the rest are recomputed.
                            full = true;
                            saved[uid.0] = Some(Saved::Input(h.clone()));
                        }
                    }
                    out
                }
                (_, None, _) => return Err(EngineError::internal("block before embedding")),
            };
            times.compute += t0.elapsed();
            self.span(plan.step, Lane::Compute, || format!("fwd u{}", uid.0), t0);
            drop(params);
            self.release_unit(uid)?;
            self.prefetch_parked()?;
            hidden = Some(out);
        }
        if deciding {
            let blocks = units
                .iter()
                .filter(|(_, k)| matches!(k, UnitKind::Block { .. }))
                .count();
            let decision = ActivationDecision {
                shape: batch.shape,
                keep,
                held_bytes: held,
                blocks,
            };
            tracing::info!(
                kept = decision.kept(),
                blocks,
                kept_bytes = decision.kept_bytes(),
                budget_bytes = self.activations.budget_bytes(),
                "activations: {} of {blocks} blocks keep their forward graph for backward \
                 ({} held, budget {}), the others are recomputed; micro-batch {} x {} tokens",
                decision.kept(),
                crate::units::format_bytes(decision.kept_bytes()),
                crate::units::format_bytes(self.activations.budget_bytes()),
                batch.shape[0],
                batch.shape[1],
            );
            self.activations.decide(decision);
        }
        Ok((saved, ahead))
    }

    /// Backward over every unit in reverse, by recompute from the inputs
    /// `saved` or from a kept graph; gradients go into the sub-groups'
    /// accumulators. Returns the micro-batch's loss (the head's).
    #[allow(
        clippy::too_many_arguments,
        reason = "the step's plan, batch and accumulators, and what forward left"
    )]
    fn backward(
        &mut self,
        plan: &StepPlan,
        batch: &Batch<'_>,
        saved: &mut [Option<Saved>],
        head: Staged,
        groups: &mut StepGroups,
        tied: &mut BTreeMap<ParamId, Vec<f32>>,
        times: &mut StepTimes,
    ) -> Result<f32> {
        // No values buffer kept through backward, where the gradient sums
        // peak (see `SpareValues` in `optimizer/worker.rs`).
        self.opt.drop_spare_values();
        let units: Vec<(UnitId, UnitKind)> =
            self.model.units().iter().map(|u| (u.id, u.kind)).collect();
        let mut loss = 0f32;
        let mut upstream: Option<Tensor> = None;
        let stages = self.stages();
        let defers = self.defers_grads();
        // With a device that defers its gradients: the unit whose grads
        // are still downloading, finished after the next unit's backward
        // has started (so the download overlaps that compute).
        let mut downloading: Option<(UnitId, Vec<(ParamId, Tensor)>)> = None;
        // The head's, staged under the last block's forward.
        let mut ahead = head;
        for (idx, &(uid, kind)) in units.iter().enumerate().rev() {
            let this = saved.get_mut(uid.0).and_then(Option::take);
            // A kept block needs no params: its graph holds their copies.
            let kept = matches!(this, Some(Saved::Kept(_)));
            let params = if kept {
                Vec::new()
            } else {
                self.unit_params(plan, uid, Pass::Backward, batch.shape, &mut ahead)?
            };
            if stages && !kept {
                self.load_unit(uid, &params)?;
            }
            if let Some(prev) = idx.checked_sub(1) {
                let prev_kept = matches!(saved.get(units[prev].0 .0), Some(Some(Saved::Kept(_))));
                if stages && !prev_kept {
                    ahead =
                        Some(self.stage_unit(plan, units[prev].0, Pass::Backward, batch.shape)?);
                }
            }
            let t0 = Instant::now();
            let parked0 = self.park_counters().io_wait;
            let g = self.backward_unit(plan, uid, kind, &params, batch, this, upstream.as_ref())?;
            drop(params);
            if let Some(l) = &g.loss {
                loss += l.to_dtype(DType::F32)?.to_scalar::<f32>()?;
            }
            let mut grads = g.params;
            if !defers {
                self.add_unit_grads(batch, uid, std::mem::take(&mut grads), groups, tied)?;
            }
            times.add_compute(t0, self.park_counters().io_wait.saturating_sub(parked0));
            self.span(plan.step, Lane::Compute, || format!("bwd u{}", uid.0), t0);
            upstream = g.input;
            if !kept {
                self.release_unit(uid)?;
            }
            if defers {
                // This unit's backward has started on the device: the
                // previous unit's gradients were downloading meanwhile.
                if let Some((prev, grads)) = downloading.replace((uid, grads)) {
                    self.add_downloaded(plan, batch, prev, grads, groups, tied, times)?;
                }
            } else {
                self.unit_grads_added(plan, batch, uid, groups, times)?;
            }
        }
        if let Some((prev, grads)) = downloading {
            self.add_downloaded(plan, batch, prev, grads, groups, tied, times)?;
        }
        Ok(loss)
    }

    /// A unit's gradients its device left downloading, added once the next
    /// unit's backward started (its own span on the compute lane: host
    /// time the device does not wait for only while the next unit's
    /// compute lasts).
    #[allow(
        clippy::too_many_arguments,
        reason = "the step's plan, batch and accumulators, and the unit's gradients"
    )]
    fn add_downloaded(
        &mut self,
        plan: &StepPlan,
        batch: &Batch<'_>,
        uid: UnitId,
        grads: Vec<(ParamId, Tensor)>,
        groups: &mut StepGroups,
        tied: &mut BTreeMap<ParamId, Vec<f32>>,
        times: &mut StepTimes,
    ) -> Result<()> {
        let t = Instant::now();
        let parked0 = self.park_counters().io_wait;
        self.add_unit_grads(batch, uid, grads, groups, tied)?;
        times.add_compute(t, self.park_counters().io_wait.saturating_sub(parked0));
        self.span(plan.step, Lane::Compute, || format!("grads u{}", uid.0), t);
        self.unit_grads_added(plan, batch, uid, groups, times)
    }

    /// Whether the units' compute leaves param gradients downloading
    /// ([`crate::model::exec_units::UnitCompute::defers_grads`]).
    fn defers_grads(&self) -> bool {
        !self.opts.skip_compute && self.opts.compute.as_ref().is_some_and(|c| c.defers_grads())
    }

    /// A unit's param gradients (`ready`, or those its device still
    /// downloads) into the sub-groups' accumulators, in declared order;
    /// the groups that became final are parked between micro-batches.
    fn add_unit_grads(
        &mut self,
        batch: &Batch<'_>,
        uid: UnitId,
        ready: Vec<(ParamId, Tensor)>,
        groups: &mut StepGroups,
        tied: &mut BTreeMap<ParamId, Vec<f32>>,
    ) -> Result<()> {
        // The device left this unit's gradients with itself (downloading,
        // or kept for a reduce-scatter there).
        let deferred = match &self.opts.compute {
            Some(c) if ready.is_empty() && self.defers_grads() => Some(c.clone()),
            _ => None,
        };
        let on_device = deferred
            .as_ref()
            .and_then(|c| c.grads_on_device(uid).map(|ids| (c.clone(), ids)));
        if let Some((c, ids)) = on_device {
            self.accumulate_on_device(groups, &*c, uid, &ids)?;
        } else if ready.is_empty() && self.device_compute().is_some() {
            // The device optimizer summed them where they were computed
            // (with several ranks, reduced there): nothing to add here,
            // and no host collective of nothing.
        } else {
            match deferred {
                // One rank: read where the device's copies landed.
                Some(c) if self.layout.world == 1 => {
                    self.accumulate_downloaded(groups, tied, uid, &*c)?;
                }
                Some(c) => {
                    let grads = c.take_grads(uid)?.unwrap_or_default();
                    self.accumulate_unit(groups, tied, uid, &grads)?;
                }
                None => self.accumulate_unit(groups, tied, uid, &ready)?,
            }
        }
        if !batch.last_micro {
            self.park_final_groups(uid, groups)?;
        }
        self.prefetch_parked()
    }

    /// After a unit's gradients were added: the optimizer's finished
    /// sub-groups come back, and with the last micro-batch the groups
    /// that became final go to the optimizer.
    fn unit_grads_added(
        &mut self,
        plan: &StepPlan,
        batch: &Batch<'_>,
        uid: UnitId,
        groups: &mut StepGroups,
        times: &mut StepTimes,
    ) -> Result<()> {
        crate::failpoint::kill_point(crate::failpoint::Site::StepBackward);
        // Params of sub-groups the optimizer thread has finished.
        self.drain_done()?;
        if batch.last_micro && plan.mode != OverlapMode::None {
            self.on_final_groups(plan, uid, groups, times)?;
        }
        Ok(())
    }

    /// Whether the units' compute wants the next unit's params before
    /// this one computes ([`crate::model::exec_units::UnitCompute::stage`]).
    fn stages(&self) -> bool {
        !self.opts.skip_compute && self.opts.compute.as_ref().is_some_and(|c| c.stages())
    }

    /// `uid`'s params for `pass`: the ones [`Trainer::stage_unit`] fetched
    /// ahead, or fetched now (its visit first).
    fn unit_params(
        &mut self,
        plan: &StepPlan,
        uid: UnitId,
        pass: Pass,
        shape: [usize; 2],
        ahead: &mut Staged,
    ) -> Result<Vec<Tensor>> {
        match ahead.take() {
            Some((u, params)) if u == uid => return Ok(params),
            Some(_) => {
                return Err(EngineError::internal(
                    "params fetched ahead for another unit",
                ))
            }
            None => {}
        }
        self.visit(uid, pass, shape)?;
        let tf = Instant::now();
        let params = self.fetch_unit(uid)?;
        let name = match pass {
            Pass::Forward => "fwd",
            Pass::Backward => "bwd",
        };
        self.span(plan.step, Lane::Params, || format!("u{} {name}", uid.0), tf);
        Ok(params)
    }

    /// Hands `uid`'s params, about to be computed on, to the compute
    /// before the next unit is staged
    /// ([`crate::model::exec_units::UnitCompute::load`]).
    /// The swap buffers kept for `uid`'s params are let go then (the
    /// compute holds the params, or copies them with pins of its own),
    /// but for a param another unit uses too (a tied embedding, uploaded
    /// again for the head): it keeps its buffer while it is resident.
    fn load_unit(&mut self, uid: UnitId, params: &[Tensor]) -> Result<()> {
        if let Some(c) = self.opts.compute.clone() {
            let pins = self.home_pins(uid)?;
            c.load(&self.model, uid, params, pins)?;
            if self.store.swap_buffers_registered() {
                let own: Vec<ParamId> = self
                    .model
                    .unit(uid)?
                    .params
                    .iter()
                    .copied()
                    .filter(|&p| self.model.in_one_unit(p))
                    .collect();
                self.store.let_go_kept(&own)?;
            }
        }
        Ok(())
    }

    /// Read pins of `uid`'s params in their registered pinned homes (pages,
    /// or the swap buffers their reads landed in; registered only ever
    /// with the compute's own registrar, at build): its device copies from
    /// them in place (see
    /// [`crate::engine::device::DeviceLink::upload_pinned`]; with several
    /// ranks, a page's range is this rank's shard, for
    /// [`crate::engine::device::DeviceLink::gather_pinned`]). Empty
    /// otherwise.
    ///
    /// Finished write-backs are retired first: a param kept resident from
    /// its update crosses from its write's buffer once that is retired.
    fn home_pins(&mut self, uid: UnitId) -> Result<HomePins> {
        if !self.store.homes_registered() {
            return Ok(Vec::new());
        }
        if self.store.swap_buffers_registered() {
            self.store.retire_done_writes()?;
        }
        let ids = &self.model.unit(uid)?.params;
        ids.iter().map(|&p| self.store.pin_home(p)).collect()
    }

    /// Visits and fetches the next unit `uid` before this one computes,
    /// and hands its params to the compute to move ahead of its call.
    fn stage_unit(
        &mut self,
        plan: &StepPlan,
        uid: UnitId,
        pass: Pass,
        shape: [usize; 2],
    ) -> Result<(UnitId, Vec<Tensor>)> {
        let params = self.unit_params(plan, uid, pass, shape, &mut None)?;
        if let Some(c) = self.opts.compute.clone() {
            let pins = self.home_pins(uid)?;
            c.stage(&self.model, uid, &params, pins)?;
        }
        Ok((uid, params))
    }

    /// One unit's backward (or nothing, with `skip_compute`), from what its
    /// forward left: its input (recompute) or its graph (kept).
    #[allow(
        clippy::too_many_arguments,
        reason = "the unit, its params, its inputs and its upstream gradient: one call of the model"
    )]
    fn backward_unit(
        &self,
        plan: &StepPlan,
        uid: UnitId,
        kind: UnitKind,
        params: &[Tensor],
        batch: &Batch<'_>,
        saved: Option<Saved>,
        upstream: Option<&Tensor>,
    ) -> Result<UnitGrads> {
        if self.opts.skip_compute {
            return Ok(UnitGrads {
                params: Vec::new(),
                input: None,
                loss: None,
            });
        }
        let up = || upstream.ok_or_else(|| EngineError::internal("upstream missing"));
        let input = match saved {
            Some(Saved::Kept(rec)) => {
                return Ok(self.model.backward_recorded(rec, Upstream::Grad(up()?))?)
            }
            Some(Saved::Input(t)) => Some(t),
            None => None,
        };
        let input = || {
            input
                .as_ref()
                .ok_or_else(|| EngineError::internal("unit input missing"))
        };
        let (unit_input, upstream) = match kind {
            UnitKind::Head => (
                UnitInput::HiddenWithTargets {
                    hidden: input()?,
                    targets: batch.targets,
                },
                Upstream::LossScale(plan.head_scale),
            ),
            UnitKind::Block { .. } => (UnitInput::Hidden(input()?), Upstream::Grad(up()?)),
            UnitKind::Embedding => (UnitInput::Tokens(batch.ids), Upstream::Grad(up()?)),
        };
        Ok(match &self.opts.compute {
            None => self
                .model
                .backward_unit(uid, params, unit_input, upstream)?,
            Some(c) => c.backward_unit(&self.model, uid, params, unit_input, upstream)?,
        })
    }

    /// One unit's forward on candle or on [`TrainerOptions::compute`].
    fn forward_unit(
        &self,
        uid: UnitId,
        params: &[Tensor],
        input: UnitInput<'_>,
    ) -> Result<crate::model::UnitOutput> {
        Ok(match &self.opts.compute {
            None => self.model.forward_unit(uid, params, input)?,
            Some(c) => c.forward_unit(&self.model, uid, params, input)?,
        })
    }
}

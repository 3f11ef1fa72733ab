use super::*;

mod passes;
mod reduce;

/// Bytes read and written per tier (`cpu`, `nvme`), cumulative.
pub(super) fn tier_bytes(
    store: &StoreCounters,
    opt: &OptCounters,
    park: &ParkCounters,
) -> (BTreeMap<String, u64>, BTreeMap<String, u64>) {
    let read = BTreeMap::from([
        ("cpu".to_string(), store.cpu_read_bytes),
        (
            "nvme".to_string(),
            store.nvme_read_bytes + opt.nvme_read_bytes + park.read_bytes,
        ),
    ]);
    let written = BTreeMap::from([
        ("cpu".to_string(), store.cpu_written_bytes),
        (
            "nvme".to_string(),
            store.nvme_written_bytes + opt.nvme_written_bytes + park.written_bytes,
        ),
    ]);
    (read, written)
}

/// The numbers a step fixes at its start.
#[derive(Debug)]
struct StepPlan {
    /// The step being run, 1-based (`steps_done + 1`).
    step: u64,
    gas: usize,
    micro_batch: usize,
    world: u64,
    seq_len: usize,
    loss_scale: f64,
    mode: OverlapMode,
    lr: f64,
    hyper: AdamHyper,
    /// Adam's step count if this step applies (1-based).
    adam_step: u64,
    /// The head's upstream gradient: `loss_scale / (GAS · ranks)`.
    head_scale: f64,
    /// The multiplier a speculative step assumes: unscaling only, no
    /// clip (what the decision gives when nothing clips or overflows).
    speculative_scale: GradScale,
    /// With [`OverlapMode::Speculate`], per sub-group: whether it
    /// speculates this step (the first `speculation_slots` NVMe groups in
    /// backward order, see `Trainer::speculation_plan`).
    speculate: Vec<bool>,
    /// With [`OverlapMode::Speculate`]: the NVMe groups below this index
    /// that do not speculate hold their final gradients in memory (their
    /// state reads may start before the decision); the others spill.
    held_below: usize,
}

/// Counters and clocks at a step's start.
#[derive(Debug)]
struct StepStart {
    at: Instant,
    store: StoreCounters,
    opt: OptCounters,
    park: ParkCounters,
    io_busy_s: f64,
    optimizer_wait: Duration,
    minor_faults: u64,
}

/// Compute-thread time a step spent computing and taking norms.
#[derive(Debug, Default)]
struct StepTimes {
    compute: Duration,
    norm: Duration,
}

impl StepTimes {
    /// Adds a compute span that began at `t0`, less `io_wait`: what it
    /// waited inside for parked gradient sums (a unit's gradients added
    /// to a sum read back from NVMe), which `io_wait_s` counts.
    fn add_compute(&mut self, t0: Instant, io_wait: Duration) {
        self.compute += t0.elapsed().saturating_sub(io_wait);
    }
}

/// What a step came to, for its metrics.
#[derive(Debug)]
struct StepOutcome {
    loss: f32,
    skipped: bool,
    grad_norm: Option<f64>,
    /// Sub-groups stepped while backward ran.
    overlapped: u64,
    opt_wait: Duration,
    /// Reduce-scatters of gradients the step issued.
    grad_reduces: u64,
}

use super::groups::{GroupEvent, GroupStep, StepGroups};
use crate::model::exec_units::{busy_s, DeviceQueue};

impl Trainer {
    /// Runs one optimizer step (all micro-batches). After an error the
    /// trainer is stopped (see the module docs).
    pub fn step(&mut self) -> Result<StepReport> {
        self.check_usable()?;
        // The step runs on the compute pool's threads, the caller waiting
        // (`threads::ComputePool`).
        let r = match self.compute_pool.clone() {
            Some(pool) => pool.run(|| self.step_inner()),
            None => self.step_inner(),
        };
        self.latch(r)
    }

    pub(super) fn step_inner(&mut self) -> Result<StepReport> {
        self.activations.agree(&*self.opts.comm)?;
        let start = self.step_start();
        let plan = self.step_plan()?;
        let mut groups = StepGroups::new(self.layout.sub_groups.len());
        let mut times = StepTimes::default();
        self.sched.begin_step();
        if let Some(c) = &self.opts.compute {
            // The optimizer changed the params: nothing on the device is
            // current.
            c.begin_step()?;
        }
        self.load_device_optimizer()?;
        self.expect_reads(&plan)?;
        // A micro-batch's gradient of a param used by several units (a tied
        // embedding), summed locally until its last unit (see accumulate).
        let mut tied: BTreeMap<ParamId, Vec<f32>> = BTreeMap::new();
        let mut micro_losses = vec![0f32; plan.gas];
        for (micro, loss) in micro_losses.iter_mut().enumerate() {
            *loss = self.micro_batch(&plan, micro, &mut groups, &mut tied, &mut times)?;
        }
        let loss = self.global_loss(&micro_losses)?;
        let overlapped = groups.handed_over_count() as u64;
        let grad_reduces = groups.grad_reduces;
        let (decision, grad_norm) = self.decide(&plan, &mut groups, &mut times)?;
        let skipped = if self.device_compute().is_some() {
            // Adam on the device: nothing goes to the optimizer thread.
            let t0 = Instant::now();
            let skipped = self.device_step(&plan.hyper, plan.adam_step, decision)?;
            times.compute += t0.elapsed();
            skipped
        } else {
            let skipped = self.dispatch(&plan, &mut groups, decision)?;
            // The optimizer tail runs on while the next step's forward
            // starts: `fetch_unit` waits for the params it needs,
            // `settle_optimizer` for all of them.
            self.opt.send(Job::Flush)?;
            self.flush_open = true;
            self.drain_done()?;
            skipped
        };
        let opt_wait = self.optimizer_wait.saturating_sub(start.optimizer_wait);
        // fp16's scaler may end the run here (an overflow at its minimum
        // scale): the step's metrics line is written first, so the record
        // shows the step that ended it.
        let scaled = self.scaler.update(skipped);
        if skipped {
            self.skipped += 1;
        } else {
            self.adam_steps += 1;
        }
        self.steps_done += 1;
        let metrics = self.report(
            &plan,
            &start,
            &times,
            StepOutcome {
                loss,
                skipped,
                grad_norm,
                overlapped,
                opt_wait,
                grad_reduces,
            },
        );
        if let Some(w) = &mut self.metrics {
            w.write(&metrics)?;
        }
        scaled?;
        self.check_kept_buffers(&metrics);
        self.last_step_wall = Some(start.at.elapsed());
        // The step boundary: every rank, every step (a collective).
        let stop = self.agree_stop()?;
        Ok(StepReport { metrics, stop })
    }

    /// Counters and clocks at the start of a step (the metrics report
    /// their differences).
    fn step_start(&self) -> StepStart {
        let step = self.steps_done + 1;
        if let Some(tl) = &self.opts.timeline {
            self.record_disk();
            tl.begin_step(step);
        }
        StepStart {
            at: Instant::now(),
            store: self.store.counters(),
            opt: self.opt.counters(),
            park: self.park_counters(),
            io_busy_s: self.io_clock.busy_s(),
            optimizer_wait: self.optimizer_wait,
            minor_faults: crate::engine::observe::metrics::minor_faults(),
        }
    }

    /// The step's fixed numbers; sets the optimizer's learning rate.
    fn step_plan(&mut self) -> Result<StepPlan> {
        let gas = self.config.batch.gradient_accumulation_steps.max(1) as usize;
        let world = self.opts.comm.world_size() as u64;
        let loss_scale = self.scaler.scale();
        let lr = self.lr.lr_for_step(self.adam_steps);
        let mut hyper = *self.adam.hyper();
        hyper.lr = lr;
        self.adam.set_hyper(hyper)?;
        let mode = self.overlap_mode();
        let (speculate, held_below) = if mode == OverlapMode::Speculate {
            self.speculation_plan()
        } else {
            (Vec::new(), 0)
        };
        Ok(StepPlan {
            step: self.steps_done + 1,
            gas,
            micro_batch: self.config.batch.micro_batch_size.max(1) as usize,
            world,
            seq_len: self.opts.seq_len,
            loss_scale,
            mode,
            lr,
            hyper,
            adam_step: self.adam_steps + 1,
            // The head's gradient starts at scale / (GAS · ranks): the mean
            // over the global batch, as one rank with GAS · ranks
            // micro-batches.
            head_scale: loss_scale / (gas as f64 * world as f64),
            speculative_scale: match GradNorm::from_sq_sum(0.0).scale_for_step(loss_scale, None)? {
                GradStep::Apply(s) => s,
                GradStep::Skip => GradScale::ONE,
            },
            speculate,
            held_below,
        })
    }

    /// Which sub-groups speculate, and the held-gradient bound of those
    /// that do not. The pool has `speculation_slots` slots (see
    /// [`crate::engine::sizing::speculation_pool`]), all free at a step's
    /// start: the first that many NVMe groups backward finishes
    /// speculate; the rest wait for the decision as without speculation.
    /// Those are read in index order once the speculated ones are, at most
    /// `read_ahead + 1` before the decision (the reads the worker may
    /// issue ahead of a step): those hold their gradients in memory (a
    /// read issued before a spill would miss it), the others spill
    /// ([`crate::engine::sizing::held_grad_bound`] over the groups that do
    /// not speculate).
    fn speculation_plan(&self) -> (Vec<bool>, usize) {
        let resident = &self.sizing.resident_groups;
        let is_resident = |g: SubGroupId| resident.get(g.0).copied().unwrap_or(false);
        let mut speculate = vec![false; self.layout.sub_groups.len()];
        for &g in self
            .backward_order
            .iter()
            .filter(|g| !is_resident(**g))
            .take(self.sizing.speculation_slots)
        {
            if let Some(s) = speculate.get_mut(g.0) {
                *s = true;
            }
        }
        let skip: Vec<bool> = speculate
            .iter()
            .enumerate()
            .map(|(i, &s)| s || is_resident(SubGroupId(i)))
            .collect();
        let held_below = crate::engine::sizing::held_grad_bound(&skip, self.sizing.read_ahead + 1);
        (speculate, held_below)
    }

    /// Starts the state reads the step will want, before its gradients
    /// are final (see "Optimizer tail" in the module docs).
    fn expect_reads(&mut self, plan: &StepPlan) -> Result<()> {
        let n_groups = self.layout.sub_groups.len();
        if plan.mode == OverlapMode::Io && self.sizing.spill_grads {
            // Steps come after backward, in index order; the first groups'
            // state reads start now (their gradients are held, see
            // `Sizing::held_grad_groups`).
            self.opt
                .send(Job::Expect((0..n_groups).map(SubGroupId).collect()))?;
        } else if plan.mode == OverlapMode::Step {
            // The order the Step jobs will come in (`backward_order`); the
            // worker starts their state reads now.
            self.opt.send(Job::Expect(self.backward_order.clone()))?;
        } else if plan.mode == OverlapMode::Speculate {
            // The speculated groups' steps come in backward order, then
            // the other NVMe groups' after the decision, in index order
            // (`dispatch`); the resident groups step after the decision
            // and need no read.
            let speculated = self
                .backward_order
                .iter()
                .copied()
                .filter(|g| plan.speculate.get(g.0).copied().unwrap_or(false));
            let waiting = (0..n_groups).map(SubGroupId).filter(|g| {
                !plan.speculate.get(g.0).copied().unwrap_or(false)
                    && !self
                        .sizing
                        .resident_groups
                        .get(g.0)
                        .copied()
                        .unwrap_or(false)
            });
            self.opt
                .send(Job::Expect(speculated.chain(waiting).collect()))?;
        }
        Ok(())
    }

    /// The sub-groups whose gradients became final with `uid`'s backward
    /// (last micro-batch): without clipping or an overflow check they are stepped now,
    /// on the optimizer thread, while backward goes on; otherwise their
    /// norm is taken now and, with NVMe state, their gradient spilled
    /// (except the first groups', whose state reads started with the step).
    fn on_final_groups(
        &mut self,
        plan: &StepPlan,
        uid: UnitId,
        groups: &mut StepGroups,
        times: &mut StepTimes,
    ) -> Result<()> {
        let finals = self
            .groups_after_unit
            .get(uid.0)
            .cloned()
            .unwrap_or_default();
        for sg in finals {
            // A sum parked in an earlier micro-batch that no gradient of
            // this one brought back (a unit whose device gave none) is
            // needed now, for its norm or its step, not after backward.
            self.unpark(groups, sg)?;
            if plan.mode == OverlapMode::Step {
                self.send_step(plan, groups, sg, GradScale::ONE)?;
                continue;
            }
            if plan.mode == OverlapMode::Speculate {
                let t0 = Instant::now();
                groups.norm(sg, &self.adam)?;
                times.norm += t0.elapsed();
                if plan.speculate.get(sg.0).copied().unwrap_or(false) {
                    self.send_speculative(plan, groups, sg)?;
                    continue;
                }
                if self
                    .sizing
                    .resident_groups
                    .get(sg.0)
                    .copied()
                    .unwrap_or(false)
                {
                    continue;
                }
                // The pool is taken: this group waits for the decision, its
                // gradient held or spilled as without speculation.
                self.speculation.pool_waits += 1;
                if sg.0 >= plan.held_below {
                    let numel = self.sub_group_numel(sg)?;
                    let grad = groups
                        .apply(sg, GroupEvent::Spill, numel, self.sum_dtype(sg))?
                        .ok_or_else(|| EngineError::internal("a spill without a gradient"))?;
                    self.send_spill(sg, grad)?;
                }
                continue;
            }
            // The norm now; the step after backward, in index order (see
            // "Optimizer tail").
            let t0 = Instant::now();
            groups.norm(sg, &self.adam)?;
            times.norm += t0.elapsed();
            if self.sizing.spill_grads && sg.0 >= self.sizing.held_grad_groups {
                let numel = self.sub_group_numel(sg)?;
                let grad = groups
                    .apply(sg, GroupEvent::Spill, numel, self.sum_dtype(sg))?
                    .ok_or_else(|| EngineError::internal("a spill without a gradient"))?;
                self.send_spill(sg, grad)?;
            }
        }
        Ok(())
    }

    /// How the host holds `sg`'s gradients (fp32 for an unknown group,
    /// which `sub_group_numel` refuses).
    fn sum_dtype(&self, sg: SubGroupId) -> sizing::SumDtype {
        self.grad_sum_dtypes.get(sg.0).copied().unwrap_or_default()
    }

    /// Elements of sub-group `sg`.
    fn sub_group_numel(&self, sg: SubGroupId) -> Result<usize> {
        self.layout
            .sub_groups
            .get(sg.0)
            .map(|g| g.numel)
            .ok_or_else(|| EngineError::internal("an unknown sub-group"))
    }

    /// Waits for the optimizer thread's replies while it holds
    /// [`sizing::grads_in_flight`] gradients handed over in backward
    /// (steps and spills not answered yet): the bound the plan's host
    /// gradients count.
    fn wait_for_hand_over_room(&mut self) -> Result<()> {
        let limit = sizing::grads_in_flight(self.sizing.read_ahead, self.sizing.write_behind);
        while self.grads_out.len() + self.spills_out >= limit {
            let t0 = Instant::now();
            let d = self.opt.recv()?;
            self.optimizer_wait += t0.elapsed();
            self.on_done(d)?;
        }
        Ok(())
    }

    /// Records the gradients handed over and unanswered now (steps and
    /// spills) in the run's peak ([`Trainer::grads_handed_over_peak`]).
    fn note_hand_over_peak(&mut self) {
        self.grads_out_peak = self
            .grads_out_peak
            .max(self.grads_out.len() + self.spills_out);
    }

    /// Sends `sg`'s final gradient to the optimizer thread to spill to
    /// NVMe, within the hand-over's bound: a spill in backward holds its
    /// gradient in host memory until the optimizer thread has copied it
    /// out, and they queued without bound where the disk was slower than
    /// backward. The thread hands the gradient back (`Done::Spilled`).
    fn send_spill(
        &mut self,
        sg: SubGroupId,
        grad: crate::engine::optimizer::GradBuf,
    ) -> Result<()> {
        self.wait_for_hand_over_room()?;
        self.opt.send(Job::SpillGrad { sg, grad })?;
        self.spills_out += 1;
        self.note_hand_over_peak();
        Ok(())
    }

    /// Sends `sg`'s step to the optimizer thread, with its gradient (none
    /// if spilled: it is read back with the state).
    fn send_step(
        &mut self,
        plan: &StepPlan,
        groups: &mut StepGroups,
        sg: SubGroupId,
        scale: GradScale,
    ) -> Result<()> {
        self.send_job(plan, groups, sg, scale, GroupEvent::Send)
    }

    /// Sends `sg`'s speculative step (no clip, no overflow assumed) with its
    /// gradient.
    fn send_speculative(
        &mut self,
        plan: &StepPlan,
        groups: &mut StepGroups,
        sg: SubGroupId,
    ) -> Result<()> {
        let scale = plan.speculative_scale;
        self.send_job(plan, groups, sg, scale, GroupEvent::Speculate)
    }

    /// Moves `sg` by `event` (`Send` or `Speculate`) and sends the step job
    /// with the gradient the move hands on; its params' new bytes are then
    /// coming.
    fn send_job(
        &mut self,
        plan: &StepPlan,
        groups: &mut StepGroups,
        sg: SubGroupId,
        scale: GradScale,
        event: GroupEvent,
    ) -> Result<()> {
        let numel = self.sub_group_numel(sg)?;
        let speculative = matches!(event, GroupEvent::Speculate);
        // Bounded hand-over: wait for a reply while the optimizer thread
        // holds its share of gradients (see `Trainer::grads_out`). Only
        // where every job comes in the worker's expected order: steps
        // during backward, and speculative steps (the speculated groups
        // lead the worker's order, in the order backward sends them). A
        // group's job that follows the decision (clipping or an overflow
        // check, not speculated) may be one the worker waits for in its
        // order, so those are not held back.
        if plan.mode == OverlapMode::Step || speculative {
            self.wait_for_hand_over_room()?;
        }
        let grad = groups.apply(sg, event, numel, self.sum_dtype(sg))?;
        if grad.is_some() {
            self.grads_out.insert(sg);
            self.note_hand_over_peak();
        }
        let tensors = self.tensor_wants(sg);
        self.opt.send(Job::Step {
            sg,
            grad,
            scale,
            step: plan.adam_step,
            hyper: plan.hyper,
            tensors,
            speculative,
        })?;
        self.expect_update(sg)
    }

    /// The decision: Σg² over sub-groups in index order (all ranks), then
    /// skip (gradients not finite) or the multiplier (clip / loss scale). Returns
    /// it with the global gradient norm when one was taken.
    fn decide(
        &mut self,
        plan: &StepPlan,
        groups: &mut StepGroups,
        times: &mut StepTimes,
    ) -> Result<(GradStep, Option<f64>)> {
        let clip = self.config.gradient_clipping;
        if plan.mode == OverlapMode::Step || !self.config.waits_for_global_norm() {
            let d = GradNorm::from_sq_sum(0.0).scale_for_step(plan.loss_scale, None)?;
            return Ok((d, None));
        }
        let t0 = Instant::now();
        let mut total = 0f64;
        match self.device_compute() {
            Some(c) => {
                if let Some(dev) = c.device_optimizer() {
                    for s in dev.grad_sq_sums(&self.layout.sub_groups)? {
                        total += s;
                    }
                }
            }
            None => {
                for i in 0..self.layout.sub_groups.len() {
                    total += groups.norm(SubGroupId(i), &self.adam)?;
                }
            }
        }
        times.norm += t0.elapsed();
        let total = self.opts.comm.all_reduce_sum_f64(total)?;
        let gn = GradNorm::from_sq_sum(total);
        Ok((
            gn.scale_for_step(plan.loss_scale, clip)?,
            Some(gn.norm(plan.loss_scale)),
        ))
    }

    /// After a skipped step, with several ranks: every param that some rank
    /// restores (the params of its speculated sub-groups) is restaged on
    /// every rank, so the next forward gathers the same params everywhere.
    /// Each rank speculates the sub-groups its own pool has slots for, and
    /// a rank's sub-groups hold other params than another's where the
    /// shards differ (the last rank's are shorter), so the restored params
    /// differ between ranks: a param restaged on one rank and resident on
    /// another would be in one rank's all-gather and not the other's. One
    /// all-gather of a bitmap of the params each rank restored.
    fn restage_restored_elsewhere(&mut self, speculated: &[SubGroupId]) -> Result<()> {
        let comm = self.opts.comm.clone();
        let world = comm.world_size();
        if world == 1 {
            return Ok(());
        }
        let params = self.model.params().len();
        let mut mine = vec![0u8; params.div_ceil(8).max(1)];
        for sg in speculated {
            let g = self
                .layout
                .sub_groups
                .get(sg.0)
                .ok_or_else(|| EngineError::internal("a restore of an unknown sub-group"))?;
            for p in g.param_ids() {
                mine[p.0 / 8] |= 1 << (p.0 % 8);
            }
        }
        let mut all = vec![0u8; mine.len() * world];
        comm.all_gather_bytes(&mine, &vec![mine.len(); world], &mut all)?;
        let bit = |map: &[u8], p: usize| map[p / 8] >> (p % 8) & 1 == 1;
        for p in 0..params {
            let elsewhere = all.chunks_exact(mine.len()).any(|m| bit(m, p));
            if elsewhere && !bit(&mine, p) {
                self.store.restage_resident(ParamId(p))?;
            }
        }
        Ok(())
    }

    /// Carries out the decision: the sub-groups not stepped yet are sent in
    /// index order, or the state reads are cancelled. Returns whether the
    /// step was skipped.
    fn dispatch(
        &mut self,
        plan: &StepPlan,
        groups: &mut StepGroups,
        decision: GradStep,
    ) -> Result<bool> {
        let speculated = groups.speculated();
        let held = match decision {
            GradStep::Apply(scale) => scale == plan.speculative_scale,
            GradStep::Skip => false,
        };
        if !speculated.is_empty() {
            self.record_speculation(held);
        } else if plan.mode == OverlapMode::Io && self.sizing.speculative {
            self.record_would_hold(held);
        }
        match decision {
            GradStep::Skip => {
                // Queued speculative steps are dropped; the ones that ran
                // get their params back from the old masters.
                self.opt.send(Job::CancelReads)?;
                for &sg in &speculated {
                    self.opt.send(Job::Restore(sg))?;
                    self.expect_update(sg)?;
                }
                self.restage_restored_elsewhere(&speculated)?;
                Ok(true)
            }
            GradStep::Apply(scale) => {
                if held && !speculated.is_empty() {
                    // Exactly the step with this multiplier: keep it.
                    self.opt.send(Job::Commit(speculated))?;
                }
                for i in 0..self.layout.sub_groups.len() {
                    let sg = SubGroupId(i);
                    let redo = matches!(groups.groups.get(i), Some(GroupStep::Speculated { .. }));
                    if (redo && held) || groups.is_sent(sg) {
                        continue;
                    }
                    // A missed speculation steps again from the old state
                    // with the real multiplier.
                    self.send_step(plan, groups, sg, scale)?;
                }
                Ok(false)
            }
        }
    }

    /// Says once when a step let most of the swap buffers it kept for
    /// copies in place go before their units were loaded (to reads ahead
    /// or write-backs): those params crossed through staging, and more
    /// `offload_param.buffer_count` would let them cross in place. A few
    /// are let go in any run (a read ahead of the window's end); the
    /// warning wants at least 8 kept in the step and over half let go.
    fn check_kept_buffers(&mut self, m: &StepMetrics) {
        let (kept, let_go) = (m.param_buffers_kept, m.param_buffers_let_go);
        if self.said_buffers_short || kept < 8 || let_go * 2 <= kept {
            return;
        }
        self.said_buffers_short = true;
        tracing::warn!(
            step = m.step,
            kept,
            let_go,
            buffer_count = self.config.zero.offload_param.buffer_count,
            "step {}: {let_go} of the {kept} param swap buffers kept for the device's copies in \
             place were let go for reads ahead or write-backs before their units were loaded, so those params \
             crossed through staging; a larger zero_optimization.offload_param.buffer_count (now \
             {}) lets more cross in place (param_buffers_let_go in the metrics)",
            m.step,
            self.config.zero.offload_param.buffer_count
        );
    }

    /// Counts a speculative step's outcome (see [`Speculation::record`]).
    fn record_speculation(&mut self, held: bool) {
        let auto = self.config.tierzero.speculative_step.is_none();
        if let Some(SpeculationNews::Stopped { misses }) = self.speculation.record(true, held, auto)
        {
            tracing::warn!(
                misses,
                "the speculative optimizer step missed {misses} steps in a row (clipping or a \
                 gradient overflow); stepping after the global norm until {SPECULATION_GIVE_UP} steps in a \
                 row would not have clipped (tierzero.speculative_step: true keeps speculating)"
            );
        }
    }

    /// While `"auto"` is not speculating: whether this step's decision
    /// would have held (see [`Speculation::record`]).
    fn record_would_hold(&mut self, held: bool) {
        if let Some(SpeculationNews::Resumed) = self.speculation.record(false, held, true) {
            tracing::debug!("speculating again: {SPECULATION_GIVE_UP} steps in a row did not clip");
        }
    }

    /// The step's metrics line.
    fn report(
        &self,
        plan: &StepPlan,
        start: &StepStart,
        times: &StepTimes,
        out: StepOutcome,
    ) -> StepMetrics {
        let wall = start.at.elapsed().as_secs_f64();
        self.span(
            plan.step,
            Lane::Step,
            || format!("step {}", plan.step),
            start.at,
        );
        self.record_disk();
        let (c0, o0) = (&start.store, &start.opt);
        let c1 = self.store.counters();
        let o1 = self.opt.counters();
        let p1 = self.park_counters();
        let io_wait = (c1.io_wait + o1.io_wait + p1.io_wait)
            .saturating_sub(c0.io_wait + o0.io_wait + start.park.io_wait);
        let optimizer = o1.adam.saturating_sub(o0.adam) + times.norm;
        let io_busy = (self.io_clock.busy_s() - start.io_busy_s).max(0.0);
        let compute_s = times.compute.as_secs_f64();
        let io_wait_s = io_wait.as_secs_f64();
        let optimizer_s = optimizer.as_secs_f64();
        let (r0, w0) = tier_bytes(c0, o0, &start.park);
        let (mut bytes_read, mut bytes_written) = tier_bytes(&c1, &o1, &p1);
        for (now, before) in [(&mut bytes_read, r0), (&mut bytes_written, w0)] {
            for (tier, b) in before {
                if let Some(n) = now.get_mut(&tier) {
                    *n = n.saturating_sub(b);
                }
            }
        }
        let tokens = (plan.micro_batch * plan.gas * plan.seq_len) as f64 * plan.world as f64;
        // The norm pass runs on the compute thread too (counted in
        // `optimizer_s`, not idle), and so do the store's and the park's
        // waits (in `io_wait_s`, not in `compute_s`).
        let main_busy = compute_s
            + times.norm.as_secs_f64()
            + (c1.io_wait.saturating_sub(c0.io_wait)).as_secs_f64()
            + (p1.io_wait.saturating_sub(start.park.io_wait)).as_secs_f64();
        let (device, spans) = match &self.opts.compute {
            Some(c) => (c.take_traffic().unwrap_or_default(), c.take_device_spans()),
            None => Default::default(),
        };
        if let Some(tl) = &self.opts.timeline {
            if tl.keeps(plan.step) {
                tl.device(&spans);
            }
        }
        // Each queue's busy time, once (each is a sort of its spans).
        let [device_busy_s, h2d_busy_s, d2h_busy_s, h2d_fill_busy_s, collective_busy_s] = [
            DeviceQueue::Compute,
            DeviceQueue::H2d,
            DeviceQueue::D2h,
            DeviceQueue::Fill,
            DeviceQueue::Collective,
        ]
        .map(|q| busy_s(&spans, q));
        StepMetrics {
            step: self.steps_done,
            loss: out.loss,
            tokens_per_s: if wall > 0.0 { tokens / wall } else { 0.0 },
            wall_s: wall,
            compute_s,
            io_wait_s,
            optimizer_s,
            idle_s: (wall - main_busy - out.opt_wait.as_secs_f64()).max(0.0),
            io_busy_s: io_busy,
            bytes_read,
            bytes_written,
            peak_rss_bytes: peak_rss_bytes(),
            minor_faults: crate::engine::observe::metrics::minor_faults()
                .saturating_sub(start.minor_faults),
            overlap_efficiency: crate::engine::observe::metrics::overlap_efficiency(
                wall,
                compute_s - device.h2d_wait_s - device.d2h_wait_s,
                &[
                    io_busy,
                    optimizer_s,
                    device_busy_s,
                    h2d_busy_s,
                    d2h_busy_s,
                    h2d_fill_busy_s,
                    collective_busy_s,
                ],
            ),
            lr: plan.lr,
            loss_scale: plan.loss_scale,
            skipped: out.skipped,
            grad_norm: out.grad_norm,
            sub_groups_stepped_during_backward: out.overlapped,
            param_write_wait_s: c1.write_wait.saturating_sub(c0.write_wait).as_secs_f64(),
            param_gathers: c1.param_gathers.saturating_sub(c0.param_gathers),
            grad_reduces: if plan.world > 1 { out.grad_reduces } else { 0 },
            speculation_hits: self.speculation.hits,
            speculation_misses: self.speculation.misses,
            speculation_pool_waits: self.speculation.pool_waits,
            h2d_bytes: device.h2d_bytes,
            d2h_bytes: device.d2h_bytes,
            h2d_wait_s: device.h2d_wait_s,
            d2h_wait_s: device.d2h_wait_s,
            h2d_kept_bytes: device.h2d_kept_bytes,
            h2d_direct_bytes: device.h2d_direct_bytes,
            h2d_at_use_bytes: device.h2d_at_use_bytes,
            param_buffers_let_go: c1.kept_buffers_evicted - c0.kept_buffers_evicted,
            param_buffers_kept: c1.kept_buffers - c0.kept_buffers,
            device_forwards_kept: device.forwards_kept,
            device_forwards_recomputed: device.forwards_recomputed,
            device_forwards_ahead: device.forwards_ahead,
            device_backwards_ahead: device.backwards_ahead,
            device_busy_s,
            h2d_busy_s,
            d2h_busy_s,
            h2d_fill_busy_s,
            collective_busy_s,
        }
    }

    pub(super) fn visit(&mut self, unit: UnitId, pass: Pass, shape: [usize; 2]) -> Result<()> {
        if !self.sched.visit(Visit { unit, pass, shape }) {
            // The trace was wrong: finish every read we issued on its word.
            self.store.settle()?;
        }
        Ok(())
    }

    /// A compute-thread span of step `step` (1-based) from `start` to
    /// now, if the timeline keeps that step.
    pub(super) fn span(
        &self,
        step: u64,
        lane: Lane,
        name: impl FnOnce() -> String,
        start: Instant,
    ) {
        if let Some(tl) = &self.opts.timeline {
            if tl.keeps(step) {
                tl.span(lane, name, start, Instant::now());
            }
        }
    }

    /// Moves the disk's finished busy periods into the timeline.
    pub(super) fn record_disk(&self) {
        if let Some(tl) = &self.opts.timeline {
            tl.disk(Lane::Disk, &self.io_clock.take_periods());
            for (lane, clock) in self.engine_clocks.iter().flatten() {
                tl.disk(*lane, &clock.take_periods());
            }
        }
    }

    /// The step's loss: every rank's micro-batch losses, all-gathered and
    /// summed in global micro-batch order (micro `k` of rank `r` is global
    /// micro-batch `k · ranks + r`, the data order), divided by their count.
    /// The same bits on every rank, and the same as one rank running all
    /// the micro-batches.
    pub(super) fn global_loss(&self, micro_losses: &[f32]) -> Result<f32> {
        let world = self.opts.comm.world_size();
        let gas = micro_losses.len();
        let local: Vec<f64> = micro_losses.iter().map(|&l| f64::from(l)).collect();
        let mut all = vec![0f64; gas * world];
        self.opts.comm.all_gather_f64(&local, &mut all)?;
        let mut sum = 0f32;
        for k in 0..gas {
            for r in 0..world {
                // Exact: the values are f32s carried in f64s.
                sum += all[r * gas + k] as f32;
            }
        }
        Ok(sum / (gas * world) as f32)
    }

    pub(super) fn overlap_mode(&self) -> OverlapMode {
        // Adam on the device steps after the decision, on the device.
        if !self.config.tierzero.overlap_optimizer || self.device_compute().is_some() {
            OverlapMode::None
        } else if self.config.waits_for_global_norm() {
            if self.sizing.speculative && !self.speculation.given_up {
                OverlapMode::Speculate
            } else {
                OverlapMode::Io
            }
        } else {
            OverlapMode::Step
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A compute span's waits on parked sums leave it: they are I/O wait,
    /// not compute; a wait longer than the span (clock skew) leaves zero.
    #[test]
    fn compute_spans_leave_out_their_park_waits() {
        let mut times = StepTimes::default();
        let t0 = Instant::now() - Duration::from_millis(50);
        times.add_compute(t0, Duration::from_millis(20));
        assert!(times.compute >= Duration::from_millis(30), "{times:?}");
        assert!(times.compute < Duration::from_millis(45), "{times:?}");
        let before = times.compute;
        times.add_compute(Instant::now(), Duration::from_secs(1));
        assert_eq!(times.compute, before);
    }
}

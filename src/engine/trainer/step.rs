use super::*;

/// Bytes read and written per tier (`cpu`, `nvme`), cumulative.
pub(super) fn tier_bytes(
    store: &StoreCounters,
    opt: &OptCounters,
) -> (BTreeMap<String, u64>, BTreeMap<String, u64>) {
    let read = BTreeMap::from([
        ("cpu".to_string(), store.cpu_read_bytes),
        (
            "nvme".to_string(),
            store.nvme_read_bytes + opt.nvme_read_bytes,
        ),
    ]);
    let written = BTreeMap::from([
        ("cpu".to_string(), store.cpu_written_bytes),
        (
            "nvme".to_string(),
            store.nvme_written_bytes + opt.nvme_written_bytes,
        ),
    ]);
    (read, written)
}

impl Trainer {
    /// Runs one optimizer step (all micro-batches). After an error the
    /// trainer is stopped (see the module docs).
    pub fn step(&mut self) -> Result<StepReport> {
        self.check_usable()?;
        // The calling thread computes this step on the compute CPUs, and
        // gets its own mask back after (`threads::ComputePin`).
        let _pin = self
            .placement
            .compute_cpus()
            .map(threads::ComputePin::enter);
        let r = self.step_inner();
        self.latch(r)
    }

    pub(super) fn step_inner(&mut self) -> Result<StepReport> {
        let t_step = Instant::now();
        let this_step = self.steps_done + 1;
        if let Some(tl) = &self.opts.timeline {
            self.record_disk();
            tl.begin_step(this_step);
        }
        let c0 = self.store.counters();
        let o0 = self.opt.counters();
        let busy0 = self.io_clock.busy_s();
        let wait0 = self.optimizer_wait;
        let mut compute = Duration::ZERO;
        let mut norm_time = Duration::ZERO;

        let gas = self.config.batch.gradient_accumulation_steps.max(1) as usize;
        let mb = self.config.batch.micro_batch_size.max(1) as usize;
        let world = self.opts.comm.world_size() as u64;
        let rank = self.opts.comm.rank() as u64;
        let seq = self.opts.seq_len;
        let loss_scale = self.scaler.scale();
        let mode = self.overlap_mode();
        let lr = self.lr.lr(self.adam_steps);
        let mut hyper = *self.adam.hyper();
        hyper.lr = lr;
        self.adam.set_hyper(hyper)?;
        let adam_step = self.adam_steps + 1;
        let n_groups = self.layout.sub_groups.len();
        let mut grads: Vec<Option<Vec<f32>>> = vec![None; n_groups];
        // A micro-batch's gradient of a param used by several units (a tied
        // embedding), summed locally until its last unit (see accumulate).
        let mut pending: BTreeMap<ParamId, Vec<f32>> = BTreeMap::new();
        let mut sq: Vec<Option<f64>> = vec![None; n_groups];
        // Sub-groups in the order their state reads were requested.
        let mut order: Vec<SubGroupId> = Vec::with_capacity(n_groups);
        let mut sent = vec![false; n_groups];
        let mut spilled = vec![false; n_groups];
        // The head's gradient starts at scale / (GAS · ranks): the mean over
        // the global batch, as one rank with GAS · ranks micro-batches.
        let head_scale = loss_scale / (gas as f64 * world as f64);
        let units: Vec<(UnitId, UnitKind)> =
            self.model.units().iter().map(|u| (u.id, u.kind)).collect();
        let mut micro_losses = vec![0f32; gas];
        self.sched.begin_step();
        if mode == OverlapMode::Io && self.sizing.spill_grads {
            // Steps come after backward, in index order; the first groups'
            // state reads start now (their gradients are held, see
            // `held_grad_groups`).
            self.opt
                .send(Job::Expect((0..n_groups).map(SubGroupId).collect()))?;
        } else if mode == OverlapMode::Step {
            // The order the Step jobs will come in (`backward_order`); the
            // worker starts their state reads now.
            self.opt.send(Job::Expect(self.backward_order.clone()))?;
        }

        for micro in 0..gas {
            let first = ((self.steps_done * gas as u64 + micro as u64) * world + rank) * mb as u64;
            let (ids, targets) = self.data.batch(first, mb, seq, &self.opts.device)?;
            let shape = [mb, seq];
            let last_micro = micro + 1 == gas;
            // Forward over everything but the head, saving unit inputs.
            let mut saved: Vec<Option<Tensor>> = vec![None; units.len()];
            let mut hidden: Option<Tensor> = None;
            for &(uid, kind) in &units {
                if kind == UnitKind::Head {
                    saved[uid.0] = hidden.clone();
                    continue;
                }
                self.visit(uid, Pass::Forward, shape)?;
                let tf = Instant::now();
                let params = self.fetch_unit(uid)?;
                self.span(this_step, Lane::Params, || format!("u{} fwd", uid.0), tf);
                if self.opts.skip_compute {
                    drop(params);
                    self.release_unit(uid)?;
                    continue;
                }
                let t0 = Instant::now();
                let out = match (kind, &hidden) {
                    (UnitKind::Embedding, _) => {
                        self.model
                            .forward_unit(uid, &params, UnitInput::Tokens(&ids))?
                    }
                    (_, Some(h)) => {
                        saved[uid.0] = Some(h.clone());
                        self.model
                            .forward_unit(uid, &params, UnitInput::Hidden(h))?
                    }
                    (_, None) => return Err(EngineError::internal("block before embedding")),
                };
                compute += t0.elapsed();
                self.span(this_step, Lane::Compute, || format!("fwd u{}", uid.0), t0);
                drop(params);
                self.release_unit(uid)?;
                hidden = Some(out.into_tensor());
            }
            // Backward in reverse, by recompute.
            let mut upstream: Option<Tensor> = None;
            for &(uid, kind) in units.iter().rev() {
                self.visit(uid, Pass::Backward, shape)?;
                let tf = Instant::now();
                let params = self.fetch_unit(uid)?;
                self.span(this_step, Lane::Params, || format!("u{} bwd", uid.0), tf);
                let t0 = Instant::now();
                let g = match kind {
                    _ if self.opts.skip_compute => UnitGrads {
                        params: Vec::new(),
                        input: None,
                        loss: None,
                    },
                    UnitKind::Head => {
                        let h = saved[uid.0]
                            .as_ref()
                            .ok_or_else(|| EngineError::internal("head input missing"))?;
                        self.model.backward_unit(
                            uid,
                            &params,
                            UnitInput::HiddenWithTargets {
                                hidden: h,
                                targets: &targets,
                            },
                            Upstream::LossScale(head_scale),
                        )?
                    }
                    UnitKind::Block { .. } => {
                        let h = saved[uid.0]
                            .as_ref()
                            .ok_or_else(|| EngineError::internal("block input missing"))?;
                        let up = upstream
                            .as_ref()
                            .ok_or_else(|| EngineError::internal("upstream missing"))?;
                        self.model.backward_unit(
                            uid,
                            &params,
                            UnitInput::Hidden(h),
                            Upstream::Grad(up),
                        )?
                    }
                    UnitKind::Embedding => {
                        let up = upstream
                            .as_ref()
                            .ok_or_else(|| EngineError::internal("upstream missing"))?;
                        self.model.backward_unit(
                            uid,
                            &params,
                            UnitInput::Tokens(&ids),
                            Upstream::Grad(up),
                        )?
                    }
                };
                drop(params);
                if let Some(l) = &g.loss {
                    let l = l.to_dtype(DType::F32)?.to_scalar::<f32>()?;
                    if let Some(m) = micro_losses.get_mut(micro) {
                        *m += l;
                    }
                }
                for (pid, grad) in &g.params {
                    self.accumulate(&mut grads, &mut pending, uid, *pid, grad)?;
                }
                compute += t0.elapsed();
                self.span(this_step, Lane::Compute, || format!("bwd u{}", uid.0), t0);
                upstream = g.input;
                saved[uid.0] = None;
                self.release_unit(uid)?;
                crate::failpoint::kill_point(crate::failpoint::Site::StepBackward);
                // Params of sub-groups the optimizer thread has finished.
                self.drain_done()?;
                if last_micro && mode != OverlapMode::None {
                    let finals = self
                        .groups_after_unit
                        .get(uid.0)
                        .cloned()
                        .unwrap_or_default();
                    for sg in finals {
                        match mode {
                            OverlapMode::Step => {
                                let grad = grads[sg.0].take().unwrap_or_else(|| {
                                    vec![0f32; self.layout.sub_groups[sg.0].numel]
                                });
                                self.opt.send(Job::Step {
                                    sg,
                                    grad: Some(grad),
                                    scale: GradScale::ONE,
                                    step: adam_step,
                                    hyper,
                                    tensors: self.tensor_wants(sg),
                                })?;
                                order.push(sg);
                                sent[sg.0] = true;
                                self.expect_update(sg)?;
                            }
                            _ => {
                                // The norm now; the step after backward, in
                                // index order (see "Optimizer tail").
                                let t0 = Instant::now();
                                sq[sg.0] = Some(self.group_sq_norm(&grads, sg));
                                norm_time += t0.elapsed();
                                if self.sizing.spill_grads && sg.0 >= self.sizing.held_grad_groups {
                                    let grad = grads[sg.0].take().unwrap_or_else(|| {
                                        vec![0f32; self.layout.sub_groups[sg.0].numel]
                                    });
                                    self.opt.send(Job::SpillGrad { sg, grad })?;
                                    spilled[sg.0] = true;
                                }
                            }
                        }
                    }
                }
            }
        }

        let loss = self.global_loss(&micro_losses)?;
        let overlapped = sent.iter().filter(|x| **x).count() as u64;
        // Decision.
        let fp16 = matches!(self.config.precision, Precision::Fp16 { .. });
        let clip = self.config.gradient_clipping;
        let mut grad_norm = None;
        let decision = if mode == OverlapMode::Step {
            GradNorm::from_sq_sum(0.0).scale_for_step(loss_scale, None)?
        } else if fp16 || clip.is_some() {
            let t0 = Instant::now();
            let mut total = 0f64;
            for (i, s) in sq.iter_mut().enumerate() {
                let v = match s {
                    Some(v) => *v,
                    None => self.group_sq_norm(&grads, SubGroupId(i)),
                };
                *s = Some(v);
                total += v;
            }
            norm_time += t0.elapsed();
            let total = self.opts.comm.all_reduce_sum_f64(total)?;
            let gn = GradNorm::from_sq_sum(total);
            grad_norm = Some(gn.norm(loss_scale));
            gn.scale_for_step(loss_scale, clip)?
        } else {
            GradNorm::from_sq_sum(0.0).scale_for_step(loss_scale, None)?
        };
        let skipped = match decision {
            GradStep::Skip => {
                self.opt.send(Job::CancelReads)?;
                true
            }
            GradStep::Apply(scale) => {
                // The rest, in read order first, then index order.
                for i in 0..n_groups {
                    if !order.contains(&SubGroupId(i)) {
                        order.push(SubGroupId(i));
                    }
                }
                for &sg in &order {
                    if sent[sg.0] {
                        continue;
                    }
                    let grad = if spilled[sg.0] {
                        None
                    } else {
                        Some(
                            grads[sg.0]
                                .take()
                                .unwrap_or_else(|| vec![0f32; self.layout.sub_groups[sg.0].numel]),
                        )
                    };
                    self.opt.send(Job::Step {
                        sg,
                        grad,
                        scale,
                        step: adam_step,
                        hyper,
                        tensors: self.tensor_wants(sg),
                    })?;
                    sent[sg.0] = true;
                    self.expect_update(sg)?;
                }
                false
            }
        };
        // The optimizer tail runs on while the next step's forward starts:
        // `fetch_unit` waits for the sub-groups it needs, `settle_optimizer`
        // for all of them.
        self.opt.send(Job::Flush)?;
        self.flush_open = true;
        self.drain_done()?;
        let opt_wait = self.optimizer_wait.saturating_sub(wait0);
        self.scaler.update(skipped);
        if skipped {
            self.skipped += 1;
        } else {
            self.adam_steps += 1;
        }
        self.steps_done += 1;

        // Metrics.
        let wall = t_step.elapsed().as_secs_f64();
        self.span(
            this_step,
            Lane::Step,
            || format!("step {this_step}"),
            t_step,
        );
        self.record_disk();
        let c1 = self.store.counters();
        let o1 = self.opt.counters();
        let io_wait = (c1.io_wait + o1.io_wait).saturating_sub(c0.io_wait + o0.io_wait);
        let optimizer = o1.adam.saturating_sub(o0.adam) + norm_time;
        let io_busy = (self.io_clock.busy_s() - busy0).max(0.0);
        let compute_s = compute.as_secs_f64();
        let io_wait_s = io_wait.as_secs_f64();
        let optimizer_s = optimizer.as_secs_f64();
        let (r0, w0) = tier_bytes(&c0, &o0);
        let (mut bytes_read, mut bytes_written) = tier_bytes(&c1, &o1);
        for (now, before) in [(&mut bytes_read, r0), (&mut bytes_written, w0)] {
            for (tier, b) in before {
                if let Some(n) = now.get_mut(&tier) {
                    *n = n.saturating_sub(b);
                }
            }
        }
        let tokens = (mb * gas * seq) as f64 * world as f64;
        let main_busy = compute_s + (c1.io_wait.saturating_sub(c0.io_wait)).as_secs_f64();
        let metrics = StepMetrics {
            step: self.steps_done,
            loss,
            tokens_per_s: if wall > 0.0 { tokens / wall } else { 0.0 },
            wall_s: wall,
            compute_s,
            io_wait_s,
            optimizer_s,
            idle_s: (wall - main_busy - opt_wait.as_secs_f64()).max(0.0),
            io_busy_s: io_busy,
            bytes_read,
            bytes_written,
            peak_rss_bytes: peak_rss_bytes(),
            overlap_efficiency: if wall > 0.0 {
                compute_s.max(io_busy).max(optimizer_s) / wall
            } else {
                0.0
            },
            lr,
            loss_scale,
            skipped,
            grad_norm,
            sub_groups_stepped_during_backward: overlapped,
            param_write_wait_s: c1.write_wait.saturating_sub(c0.write_wait).as_secs_f64(),
        };
        if let Some(w) = &mut self.metrics {
            w.write(&metrics)?;
        }
        Ok(StepReport { metrics })
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
            if let Some(c) = &self.engine_clocks {
                let lanes = [
                    Lane::DiskParams,
                    Lane::DiskStateReads,
                    Lane::DiskStateWrites,
                ];
                for (clock, lane) in c.iter().zip(lanes) {
                    tl.disk(lane, &clock.take_periods());
                }
            }
        }
    }

    pub(super) fn group_sq_norm(&self, grads: &[Option<Vec<f32>>], sg: SubGroupId) -> f64 {
        match grads.get(sg.0).and_then(|g| g.as_ref()) {
            Some(g) => self.adam.grad_sq_norm(g),
            None => 0.0,
        }
    }

    /// Adds one unit's gradient of `pid` into the sub-group accumulator.
    ///
    /// A param used by several units (a tied embedding: head, then
    /// embedding) gets several gradients per micro-batch; they are first
    /// summed locally in backward order (`h + e`) and reduced once, after
    /// its last unit (the smallest, reached last in backward). Every
    /// micro-batch thus adds exactly one gradient per param into the
    /// accumulator, and N ranks adding theirs in rank order reproduce one
    /// rank's order over the same micro-batches bit for bit. The price is
    /// one full fp32 gradient of such a param held during backward (as
    /// PyTorch's autograd holds it before ZeRO's hook sees it).
    pub(super) fn accumulate(
        &self,
        grads: &mut [Option<Vec<f32>>],
        pending: &mut BTreeMap<ParamId, Vec<f32>>,
        unit: UnitId,
        pid: ParamId,
        grad: &Tensor,
    ) -> Result<()> {
        let slot = self
            .layout
            .params
            .get(pid.0)
            .ok_or_else(|| EngineError::internal("grad of unknown param"))?;
        let full = grad
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_device(&Device::Cpu)?
            .to_vec1::<f32>()?;
        let full = match pending.remove(&pid) {
            Some(mut sum) => {
                for (a, b) in sum.iter_mut().zip(&full) {
                    *a += *b;
                }
                sum
            }
            None => full,
        };
        let last_unit = self
            .model
            .params()
            .get(pid.0)
            .and_then(|p| p.units.iter().copied().min())
            .unwrap_or(unit);
        if unit != last_unit {
            pending.insert(pid, full);
            return Ok(());
        }
        let g = &self.layout.sub_groups[slot.sub_group.0];
        let acc = grads[slot.sub_group.0].get_or_insert_with(|| vec![0f32; g.numel]);
        let dst = acc
            .get_mut(slot.offset_in_group..slot.offset_in_group + slot.shard_numel)
            .ok_or_else(|| EngineError::internal("grad slot out of range"))?;
        // Every rank's chunk of this rank's shard is added in rank order
        // (reduce-scatter), straight into the accumulator.
        let counts = shard_counts(slot.numel, self.layout.world);
        self.opts.comm.reduce_scatter_add_f32(&full, &counts, dst)
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
        if !self.config.tierzero.overlap_optimizer {
            OverlapMode::None
        } else if self.config.gradient_clipping.is_some()
            || matches!(self.config.precision, Precision::Fp16 { .. })
        {
            OverlapMode::Io
        } else {
            OverlapMode::Step
        }
    }
}

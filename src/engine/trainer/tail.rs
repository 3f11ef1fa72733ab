use super::*;
use crate::engine::Tier;

impl Trainer {
    /// Fetches the params of `unit` (declared order), after issuing the
    /// prefetcher's prefetches. With several ranks and a compute that
    /// gathers the params on its device
    /// ([`crate::model::exec_units::UnitCompute::gathers_params`]), each
    /// is this rank's shard (1-D), for that compute to gather. With
    /// several ranks otherwise, a param not resident is gathered from the
    /// ranks' shards: a collective, so every rank fetches the same units in
    /// the same order (a loop on rank 0 alone waits out the collective
    /// timeout).
    pub fn fetch_unit(&mut self, unit: UnitId) -> Result<Vec<Tensor>> {
        self.check_unit(unit)?;
        self.check_usable()?;
        let r = self.fetch_unit_inner(unit);
        self.latch(r)
    }

    /// A unit the model does not have is the caller's mistake, refused
    /// with the trainer usable (inside a fetch or a release, it would stop
    /// the trainer).
    fn check_unit(&self, unit: UnitId) -> Result<()> {
        let units = self.model.units().len();
        if unit.0 >= units {
            return Err(EngineError::config(format!(
                "unit {} does not exist: the model has {units} (0..{units})",
                unit.0
            )));
        }
        Ok(())
    }

    pub(super) fn fetch_unit_inner(&mut self, unit: UnitId) -> Result<Vec<Tensor>> {
        // This unit's own params first: their reads are issued together
        // (not one synchronous read after another), then the window ahead.
        // A param whose write-back is still queued is skipped, not waited
        // for: only running out of swap buffers ends the window's NVMe
        // reads. Its cpu-tier params go on (the copy thread builds them
        // from their pages, with no swap buffer); they stopped there too,
        // so in backward, where the NVMe params come first, the cpu-tier
        // ones were copied on this thread as each unit was fetched.
        let ids = self.model.unit(unit)?.params.clone();
        // The last step's optimizer may still be running (its tail overlaps
        // this step's forward): this unit's params must be the new ones.
        self.drain_done()?;
        for &p in &ids {
            self.wait_updated(p)?;
        }
        self.store.harvest()?;
        let ahead = self.sched.prefetch_candidates(&self.store);
        let mut nvme_out = false;
        for (k, &p) in ids.iter().chain(&ahead).enumerate() {
            let tier = self.store.tier(p);
            if tier == Tier::Nvme {
                // Once out, no later NVMe param takes a buffer that frees
                // meanwhile ahead of a nearer one.
                nvme_out = nvme_out || self.store.free_buffers() == 0;
                if nvme_out {
                    continue;
                }
            }
            // A read of a param whose new bytes are still coming would be
            // wasted (the update replaces it): skip it. So is a copy out
            // of a cpu page on the copy thread for a param wanted now:
            // the fetch below copies it on this thread.
            if self.store.freshness(p) == Freshness::UpdateComing
                || (tier == Tier::Cpu && k < ids.len())
            {
                continue;
            }
            if self.store.prefetch(p)? && k >= ids.len() {
                self.lookahead_reads += 1;
            }
        }
        self.store.fetch_many(&ids)
    }

    /// Releases the params of `unit` that the prefetcher does not keep.
    pub fn release_unit(&mut self, unit: UnitId) -> Result<()> {
        self.check_unit(unit)?;
        self.check_usable()?;
        let r = self.release_unit_inner(unit);
        self.latch(r)
    }

    pub(super) fn release_unit_inner(&mut self, unit: UnitId) -> Result<()> {
        let ids = self.model.unit(unit)?.params.clone();
        for p in ids {
            let bytes = self.store.device_bytes(p);
            // The live bytes, not the resident ones: the same on every
            // rank at this point of the trace (see `ParamStore::live_bytes`).
            let live_numel = self.store.live_bytes() / self.store.device_bytes_per_elem().max(1);
            if !self.sched.keep(p, bytes, live_numel) {
                self.store.release(p)?;
            }
        }
        Ok(())
    }

    /// Marks the params of `sg` as having new bytes coming: its step job
    /// is being sent (see "Optimizer tail" in the module docs).
    pub(super) fn expect_update(&mut self, sg: SubGroupId) -> Result<()> {
        let g = self
            .layout
            .sub_groups
            .get(sg.0)
            .ok_or_else(|| EngineError::internal("a step of an unknown sub-group"))?;
        for p in g.param_ids() {
            self.store.expect_update(p)?;
        }
        Ok(())
    }

    /// Waits until the new bytes of `p` (if a step of its sub-group is
    /// running) are stored.
    pub(super) fn wait_updated(&mut self, p: ParamId) -> Result<()> {
        while self.store.freshness(p) == Freshness::UpdateComing {
            let t0 = Instant::now();
            let d = self.opt.recv()?;
            self.optimizer_wait += t0.elapsed();
            self.on_done(d)?;
        }
        Ok(())
    }

    /// Waits until the optimizer thread has finished every step and write
    /// of the last step, and their new param bytes are stored and written
    /// to their home tier: afterwards no I/O of the last step is in flight.
    /// A failure of that tail (a state write's EIO) is the trainer's: it
    /// stops the trainer, and every later call names it.
    pub fn settle_optimizer(&mut self) -> Result<()> {
        self.check_usable()?;
        let r = self.settle_optimizer_inner();
        self.latch(r)
    }

    /// [`Trainer::settle_optimizer`] on every rank, agreed (a collective:
    /// every rank calls it at the same point): a failure on one rank fails
    /// them all here, so none is left waiting for it in the next
    /// collective (a save's). One rank: `settle_optimizer`.
    pub fn settle_optimizer_all_ranks(&mut self) -> Result<()> {
        let r = self.settle_optimizer();
        let comm = self.opts.comm.clone();
        crate::engine::comm::agree(&*comm, "settling the optimizer", r)
    }

    fn settle_optimizer_inner(&mut self) -> Result<()> {
        // Adam on the device: its state is the host's again first.
        self.write_back_device_optimizer()?;
        while self.flush_open || self.store.any_update_coming() {
            let t0 = Instant::now();
            let d = self.opt.recv()?;
            self.optimizer_wait += t0.elapsed();
            self.on_done(d)?;
        }
        self.store.flush_writes()
    }

    /// Runs `f` on the optimizer thread's state with nothing else in
    /// flight; applies the replies that come before its result.
    ///
    /// An error of `f`'s comes back as its result, not as the thread's
    /// failure: the jobs only read the state or load all of it (a
    /// checkpoint's copy, a hash, a resume), so a save that failed on a
    /// full disk leaves the optimizer thread and its state as they were,
    /// and the trainer usable. (As the thread's own error it ended the
    /// thread, and the next step failed with "optimizer thread stopped",
    /// the cause gone.)
    pub(super) fn exclusive<T: Send + 'static>(
        &mut self,
        f: impl FnOnce(&mut OptimizerState) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        self.opt
            .send(Job::Exclusive(ExclusiveJob(Box::new(move |st| {
                Ok(Box::new(f(st)) as ExclusiveResult)
            }))))?;
        loop {
            match self.opt.recv()? {
                Done::Ran(r) => {
                    return r.downcast::<Result<T>>().map(|b| *b).map_err(|_| {
                        EngineError::internal("an optimizer job returned the wrong type")
                    })?
                }
                other => self.on_done(other)?,
            }
        }
    }

    /// Applies the optimizer thread's replies that are already there.
    pub(super) fn drain_done(&mut self) -> Result<()> {
        while let Some(d) = self.opt.try_recv() {
            self.on_done(d)?;
        }
        Ok(())
    }

    /// The params of `sg` whose new tensors the optimizer thread should
    /// build: those [`Trainer::on_done`]'s update will leave resident as
    /// things stand now ([`ParamStore::stays_resident`]), with one rank
    /// only. A guess that turns out wrong costs only time: a tensor not
    /// needed is dropped, one missing is built by the store.
    pub(super) fn tensor_wants(&self, sg: SubGroupId) -> Vec<TensorWant> {
        if self.layout.world > 1 {
            return Vec::new();
        }
        let Some(g) = self.layout.sub_groups.get(sg.0) else {
            return Vec::new();
        };
        // A tiled param's tensor is built once its pieces are assembled
        // (by the store), never from one piece.
        g.pieces
            .iter()
            .filter(|pc| {
                self.layout
                    .params
                    .get(pc.param.0)
                    .is_some_and(|s| !s.is_tiled())
            })
            .filter(|pc| {
                self.store
                    .stays_resident(pc.param, self.sched.keep_after_update(pc.param))
            })
            .filter_map(|pc| {
                let shape = self.model.params().get(pc.param.0)?.shape.clone();
                Some(TensorWant {
                    param: pc.param,
                    offset_in_group: pc.offset_in_group,
                    shape,
                })
            })
            .collect()
    }

    /// Gradients the optimizer thread is done with, kept for a later
    /// step's sums ([`super::groups::SpareSums`]).
    fn give_spare_sums(
        &self,
        grads: impl IntoIterator<Item = crate::engine::optimizer::GradBuf>,
    ) -> Result<()> {
        let mut spare = self
            .spare_sums
            .lock()
            .map_err(|_| EngineError::internal("the spare gradient sums' lock"))?;
        for g in grads {
            spare.give(g);
        }
        Ok(())
    }

    /// Stores the new param bytes of a stepped sub-group.
    pub(super) fn on_done(&mut self, done: Done) -> Result<()> {
        match done {
            Done::Stepped {
                sg,
                values,
                lent,
                tensors,
                spent,
            } => {
                self.give_spare_sums(spent)?;
                let bytes = values.as_bytes();
                self.grads_out.remove(&sg);
                let t0 = Instant::now();
                let g = self
                    .layout
                    .sub_groups
                    .get(sg.0)
                    .ok_or_else(|| EngineError::internal("stepped an unknown sub-group"))?;
                let pieces = g.pieces.clone();
                let eb = self.store.device_bytes_per_elem() as usize;
                let mut built: HashMap<ParamId, Tensor> = tensors.into_iter().collect();
                for pc in pieces {
                    let range = pc.offset_in_group * eb..(pc.offset_in_group + pc.numel) * eb;
                    let piece = bytes
                        .get(range)
                        .ok_or_else(|| EngineError::internal("param bytes out of range"))?;
                    let keep = self.sched.keep_after_update(pc.param);
                    self.store.update_piece(
                        pc.param,
                        pc.offset_in_shard * eb,
                        piece,
                        keep,
                        built.remove(&pc.param),
                    )?;
                }
                self.opt.give_values(values);
                // Stored and given back: the optimizer thread may lend
                // another.
                drop(lent);
                // In the step being run (`steps_done + 1`), the one whose
                // forward overlaps this tail.
                self.span(
                    self.steps_done + 1,
                    Lane::Store,
                    || format!("sg {}", sg.0),
                    t0,
                );
                Ok(())
            }
            Done::Superseded(sg) => {
                self.grads_out.remove(&sg);
                let params = self
                    .layout
                    .sub_groups
                    .get(sg.0)
                    .ok_or_else(|| EngineError::internal("superseded an unknown sub-group"))?
                    .param_ids()
                    .collect::<Vec<_>>();
                for p in params {
                    self.store.update_dropped(p)?;
                }
                Ok(())
            }
            Done::Spent(grads) => self.give_spare_sums(grads),
            Done::Spilled(grad) => {
                self.spills_out = self.spills_out.saturating_sub(1);
                self.give_spare_sums(Some(grad))
            }
            Done::Flushed => {
                self.flush_open = false;
                Ok(())
            }
            Done::Failed(e) => Err(e),
            Done::Master(..) | Done::Ran(_) => Err(EngineError::internal(
                "unexpected reply from the optimizer thread",
            )),
        }
    }
}

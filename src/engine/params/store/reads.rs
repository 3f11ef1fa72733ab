//! The NVMe tier's reads: into a swap buffer (one of
//! `offload_param.buffer_count`), handed to the param copy thread, taken
//! back as a tensor (or staged bytes) by a fetch or a harvest; and the
//! acquire that frees a buffer when none is (retiring writes, letting go
//! of kept buffers, completing reads).

use super::*;

impl ParamStore {
    /// Issues a read of an NVMe param's home extent now, after its queued
    /// write, into a swap buffer (retiring writes or completing reads to
    /// free one).
    pub(super) fn read_home_now(&mut self, id: ParamId) -> Result<Ticket> {
        self.wait_write_of(id)?;
        let buf = self.acquire_buffer()?;
        let Home::Nvme { extent } = &self.homes[id.0] else {
            return Err(EngineError::internal("not an NVMe-tier param"));
        };
        let nv = self
            .nvme
            .as_ref()
            .ok_or_else(|| EngineError::internal("nvme engine missing"))?;
        let ticket = nv.engine.read(extent, buf)?;
        self.counters.nvme_read_bytes += extent.len_bytes();
        Ok(ticket)
    }

    /// A swap buffer, retiring writes, letting kept buffers go or
    /// completing reads until one is free; last, waiting for the device's
    /// copies that share kept buffers (they end without this thread).
    pub(super) fn acquire_buffer(&mut self) -> Result<Buffer> {
        loop {
            let arena = match &self.nvme {
                Some(nv) => nv.arena.clone(),
                None => return Err(EngineError::internal("nvme engine missing")),
            };
            if let Ok(b) = arena.try_acquire() {
                return Ok(b);
            }
            self.retire_done_writes()?;
            if arena.free_count() > 0 {
                continue;
            }
            // Free at once (unless a copy shares it), where a write or a
            // read would be waited for.
            if self.evict_kept()? {
                continue;
            }
            if self.retire_oldest_write()? {
                continue;
            }
            // The oldest disk read in flight: the first to land, and one
            // that frees a swap buffer (a copy out of a cpu page holds
            // none; in backward the lowest ParamId is the newest read).
            // Any other in flight when none is.
            let inflight = self
                .slots
                .iter()
                .enumerate()
                .filter_map(|(i, e)| match &e.slot {
                    Slot::InFlight(r) => Some((self.tier(ParamId(i)) != Tier::Nvme, r.seq(), i)),
                    _ => None,
                })
                .min()
                .map(|(_, _, i)| i);
            match inflight {
                Some(i) => self.complete_read(ParamId(i), false)?,
                None if arena.registrar().is_some() => return self.wait_for_copies(&arena),
                None => {
                    return Err(EngineError::internal(
                        "no parameter swap buffer is free and none is in flight",
                    ))
                }
            }
        }
    }

    /// Issues an asynchronous read of `id` if it is only at home (on
    /// NVMe, with a swap buffer free now; or in its cpu page, copied out
    /// by the copy thread). Never blocks on another param. Returns whether
    /// a read was issued.
    pub fn prefetch(&mut self, id: ParamId) -> Result<bool> {
        if self.state(id) != ParamState::OnDisk {
            return Ok(false);
        }
        if self.tier(id) == Tier::Cpu {
            return self.prefetch_cpu(id);
        }
        if self.tier(id) != Tier::Nvme {
            return Ok(false);
        }
        self.retire_done_writes()?;
        if self.writes.iter().any(|w| w.id == id) {
            return Ok(false);
        }
        let Some(buf) = self.free_buffer_now()? else {
            return Ok(false);
        };
        let Some(nv) = &self.nvme else {
            return Ok(false);
        };
        let Home::Nvme { extent } = &self.homes[id.0] else {
            return Ok(false);
        };
        let ticket = nv.engine.read(extent, buf)?;
        self.counters.nvme_read_bytes += extent.len_bytes();
        self.counters.prefetches += 1;
        let read = self.hand_over(id, ticket)?;
        self.apply(id, ParamEvent::ReadIssued(read))?;
        Ok(true)
    }

    /// A free swap buffer without waiting: one in the pool, or else the
    /// newest kept buffer let go (a buffer kept for a nearer param's copy
    /// in place is worth less than a read ahead), if that frees one now
    /// (no copy shares it).
    fn free_buffer_now(&mut self) -> Result<Option<Buffer>> {
        let Some(arena) = self.nvme.as_ref().map(|n| n.arena.clone()) else {
            return Ok(None);
        };
        if let Ok(b) = arena.try_acquire() {
            return Ok(Some(b));
        }
        if self.evict_kept()? {
            return Ok(arena.try_acquire().ok());
        }
        Ok(None)
    }

    /// Number of free param swap buffers.
    pub fn free_buffers(&self) -> usize {
        self.nvme.as_ref().map_or(0, |n| n.arena.free_count())
    }

    /// Completes the read of `id`; builds the tensor when `gather` (called
    /// from a fetch), with one rank or when handing out shards, else
    /// stages the shard bytes.
    pub(super) fn complete_read(&mut self, id: ParamId, gather: bool) -> Result<()> {
        let Some(read) = self.take_read(id) else {
            return Err(EngineError::internal(
                "complete_read of a param not in flight",
            ));
        };
        let t0 = Instant::now();
        let res = read.wait();
        self.counters.io_wait += t0.elapsed();
        self.finish_read(id, res, gather)
    }

    /// Takes every prefetched param whose read the copy thread has taken
    /// out of its swap buffer (into a tensor, or staged bytes under
    /// several ranks) and makes it resident (or staged), without blocking.
    /// (The buffers are already back in the pool: the copy thread frees
    /// each as its read lands, unless kept for the device.) Returns how many were harvested; a failed
    /// read's error comes back here.
    /// Finished write-backs are retired too (their buffers freed), so the
    /// prefetch window that follows sees every free buffer.
    pub fn harvest(&mut self) -> Result<usize> {
        self.retire_done_writes()?;
        let mut n = 0;
        for i in 0..self.slots.len() {
            let done = match &self.slots[i].slot {
                Slot::InFlight(read) => read.poll(),
                _ => None,
            };
            if let Some(r) = done {
                self.take_read(ParamId(i));
                self.finish_read(ParamId(i), r, false)?;
                n += 1;
            }
        }
        Ok(n)
    }

    /// Hands a submitted read of `id` to the copy thread, saying what to
    /// make of it: the tensor itself when it is built from this rank's
    /// bytes alone ([`ParamStore::builds_locally`]), else the shard's bytes
    /// (the gather belongs to the compute thread).
    pub(super) fn hand_over(&self, id: ParamId, ticket: Ticket) -> Result<PendingRead> {
        self.copier
            .as_ref()
            .ok_or_else(|| EngineError::internal("nvme read without a copy thread"))?
            .read(ticket, self.unpack(id))
    }

    /// What the copy thread makes of `id`'s shard bytes: the tensor (one
    /// rank; or this rank's shard, 1-D, when the store hands out shards),
    /// or the bytes to stage for the gather (several).
    pub(super) fn unpack(&self, id: ParamId) -> Unpack {
        let info = &self.info[id.0];
        if self.builds_locally(id) {
            Unpack::Tensor {
                dtype: self.dtype,
                shape: self.local_shape(id),
                keep_buffer: matches!(self.homes[id.0], Home::Nvme { .. })
                    && self.swap_buffers_registered(),
            }
        } else {
            Unpack::Bytes {
                len_bytes: info.shard_numel * self.elem_bytes,
            }
        }
    }

    /// The second half of a read: the slot is `OnDisk` (its read taken);
    /// makes the copy thread's tensor resident, or stages the shard (or,
    /// when `gather`, builds the tensor from it).
    pub(super) fn finish_read(
        &mut self,
        id: ParamId,
        res: Result<Unpacked>,
        gather: bool,
    ) -> Result<()> {
        // The slot is OnDisk (`take_read`) while we build the tensor; the
        // outcome goes through the table: OnDisk -> Materialized.
        match res? {
            Unpacked::Tensor { tensor, pin } => {
                let t = tensor.to_device(&self.device)?;
                match pin {
                    Some(pin) => self.apply(id, ParamEvent::Landed(t, pin)),
                    None => self.apply(id, ParamEvent::Materialized(t)),
                }
            }
            Unpacked::Bytes(shard) if !gather && self.defer_gather() => {
                self.apply(id, ParamEvent::Staged(shard))
            }
            Unpacked::Bytes(shard) => {
                let t = self.tensor_from_shard(id, &shard)?;
                self.apply(id, ParamEvent::Materialized(t))
            }
        }
    }
}

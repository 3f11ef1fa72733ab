//! The param store's write-backs to the home tier: the initial bytes and
//! the optimizer's updates (whether they stay resident), a new shard
//! written home (kept coherent with a resident copy), the queue of NVMe
//! writes in flight, each holding its swap buffer until it is retired.

use super::*;

/// An NVMe write-back in flight: its ticket holds the swap buffer.
#[derive(Debug)]
pub(super) struct QueuedWrite {
    pub(super) id: ParamId,
    pub(super) ticket: Ticket,
    /// The param stays resident from this update and the buffers are
    /// registered: the buffer is kept for its copy in place once written.
    pub(super) keeps: bool,
}

impl ParamStore {
    /// Stores the initial shard bytes of `id` at home (synchronously).
    pub fn store_initial(&mut self, id: ParamId, shard: &[u8]) -> Result<()> {
        // Always resident: built now. A `Host` home is gathered at the
        // first fetch, as the other tiers are.
        let keep = matches!(self.homes.get(id.0), Some(Home::Device));
        self.write_home(id, shard, keep, None)?;
        self.flush_writes()
    }

    /// Writes new shard bytes for `id` at home (after an optimizer step).
    /// A resident device copy is replaced (kept coherent); device-tier
    /// params are rebuilt.
    ///
    /// `keep` asks for the new bytes to stay resident as well (written
    /// through to the home tier), for a param that the next forward needs
    /// first: it is then not read back right after being written. The
    /// caller decides from the trace alone, never from timing, so the
    /// number of reads a step does stays fixed.
    ///
    /// `built` is the CPU tensor of `shard` when the optimizer thread built
    /// it already (one rank; see `crate::engine::optimizer::worker::TensorWant`); it is used
    /// if the param stays resident, else dropped.
    pub fn update(
        &mut self,
        id: ParamId,
        shard: &[u8],
        keep: bool,
        built: Option<Tensor>,
    ) -> Result<()> {
        if self.state(id) == ParamState::InFlight {
            // Complete the stale read first (see module docs).
            self.complete_read(id, false)?;
        }
        let keep = self.stays_resident(id, keep);
        self.write_home(id, shard, keep, built)?;
        if let Some(e) = self.slots.get_mut(id.0) {
            e.updates_coming = e.updates_coming.saturating_sub(1);
        }
        Ok(())
    }

    /// Whether an [`ParamStore::update`] of `id` asked to `keep` it leaves
    /// it resident: asked to, resident (or staged) now, or always resident
    /// (a device-tier param, unless its fetches gather it from a `Host`
    /// home: released, it stays at home as the other tiers' params do).
    /// (The trainer asks the optimizer thread for the tensors of exactly
    /// these params.)
    pub fn stays_resident(&self, id: ParamId, keep: bool) -> bool {
        keep || matches!(self.state(id), ParamState::Resident | ParamState::Staged)
            || matches!(self.homes.get(id.0), Some(Home::Device))
    }

    pub(super) fn write_home(
        &mut self,
        id: ParamId,
        shard: &[u8],
        keep_resident: bool,
        built: Option<Tensor>,
    ) -> Result<()> {
        let info = self
            .info
            .get(id.0)
            .ok_or_else(|| EngineError::internal(format!("no param {id:?}")))?;
        let len = info.shard_numel * self.elem_bytes;
        if shard.len() != len {
            return Err(EngineError::internal(format!(
                "`{}`: {} bytes for a shard of {len}",
                info.name,
                shard.len()
            )));
        }
        match &mut self.homes[id.0] {
            Home::Device => {}
            Home::Host { shard: home } => {
                home.clear();
                home.extend_from_slice(shard);
            }
            Home::Cpu { page, offset_bytes } => {
                let (page, off) = (*page, *offset_bytes);
                let dst = self
                    .pages
                    .get(page)
                    .ok_or_else(|| EngineError::internal("cpu page missing"))?;
                // Waits for a copy-thread copy out of this page (another
                // param's prefetch; this param's own read was completed
                // by `update`).
                // And for a device's copy straight out of the page (a
                // `ReadPin` held until its copy completed).
                let (mut g, waited) = dst.write();
                // Split over threads when long (`host_copy`): one core's
                // copy of a sub-group's new params held the forward up.
                tierzero_gpu::host_copy::copy(&mut g.as_mut_slice()[off..off + len], shard);
                drop(g);
                self.counters.io_wait += waited;
                self.counters.cpu_written_bytes += len as u64;
            }
            Home::Nvme { extent } => {
                let extent = extent.clone();
                // Two writes of one extent in flight could land in either
                // order: the older one's must finish first.
                self.wait_write_of(id)?;
                // The copy is made here (split over threads when long),
                // not handed to the copy thread: handed to it, a write-back held its buffer until that thread
                // got the core (the optimizer shares it), and the next
                // acquire waited for it (measured: steps 7-9% longer).
                let mut buf = self.acquire_buffer()?;
                tierzero_gpu::host_copy::copy(&mut buf.as_mut_slice()[..len], shard);
                let nv = self
                    .nvme
                    .as_ref()
                    .ok_or_else(|| EngineError::internal("nvme engine missing"))?;
                let ticket = nv.engine.write(&extent, buf)?;
                self.writes.push_back(QueuedWrite {
                    id,
                    ticket,
                    keeps: keep_resident && self.swap_buffers_registered(),
                });
                self.counters.nvme_written_bytes += extent.len_bytes();
            }
        }
        if keep_resident && self.defer_gather() {
            return self.apply(id, ParamEvent::Staged(shard.to_vec()));
        }
        let t = if keep_resident {
            Some(match built {
                Some(t) if self.comm.world_size() == 1 => t.to_device(&self.device)?,
                _ => self.tensor_from_shard(id, shard)?,
            })
        } else {
            None
        };
        self.apply(id, ParamEvent::Updated(t))
    }

    /// Whether building a tensor is a collective that must wait for a
    /// fetch (see the module docs): several ranks, unless the store hands
    /// out shards.
    pub(super) fn defer_gather(&self) -> bool {
        self.comm.world_size() > 1 && !self.shards_out
    }

    /// Whether `id`'s tensor is built from this rank's bytes alone: the
    /// whole param (one rank), or this rank's shard of it when the store
    /// hands out shards. Such a tensor is built where the bytes land (a
    /// read's swap buffer may be kept for the device, a page's range
    /// pinned), as with one rank.
    pub(super) fn builds_locally(&self, id: ParamId) -> bool {
        self.shards_out
            || self
                .info
                .get(id.0)
                .is_some_and(|i| i.counts_bytes.len() == 1)
    }

    /// Waits for every queued write.
    pub fn flush_writes(&mut self) -> Result<()> {
        while self.retire_oldest_write()? {}
        Ok(())
    }

    /// Retires every queued write that has completed, wherever it is in
    /// the queue, without blocking: its swap buffer goes back to the pool.
    /// (Only the front was retired before; one slow write then kept every
    /// later finished one's buffer, and with the pool full of those, the
    /// next fetch read its params one at a time.)
    pub(crate) fn retire_done_writes(&mut self) -> Result<()> {
        let mut first_err = None;
        let mut landed = Vec::new();
        self.writes.retain(|w| match w.ticket.poll() {
            Some(c) => {
                match c.into_result() {
                    Ok(buf) if w.keeps => landed.push((w.id, buf)),
                    Ok(_) => {}
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
                false
            }
            None => true,
        });
        for (id, buf) in landed {
            self.keep_written(id, buf)?;
        }
        match first_err {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// A finished write-back's buffer, kept for the device when the param
    /// stayed resident from that update (its tensor was built from these
    /// very bytes): the next forward's first units then cross from it in
    /// place too. Nothing changes a resident param's tensor while its
    /// write is queued but a newer update, which retires this write first
    /// (`wait_write_of`), so the slot still holds this write's tensor
    /// here unless the param was let go.
    fn keep_written(&mut self, id: ParamId, buf: Buffer) -> Result<()> {
        let len = self.shard_bytes(id)?;
        let unkept = matches!(
            self.slots.get(id.0).map(|e| &e.slot),
            Some(Slot::Resident(_, None))
        );
        if unkept {
            let pin = SharedBuffer::new(buf)
                .pin(0..len)
                .map_err(|e| EngineError::internal(format!("swap buffer: {e}")))?;
            self.apply(id, ParamEvent::Kept(pin))?;
        }
        Ok(())
    }

    pub(super) fn retire_oldest_write(&mut self) -> Result<bool> {
        match self.writes.pop_front() {
            None => Ok(false),
            Some(w) => {
                let t0 = Instant::now();
                let r = w.ticket.wait();
                self.counters.io_wait += t0.elapsed();
                self.counters.write_wait += t0.elapsed();
                let buf = r?;
                if w.keeps {
                    self.keep_written(w.id, buf)?;
                }
                Ok(true)
            }
        }
    }

    pub(super) fn wait_write_of(&mut self, id: ParamId) -> Result<()> {
        while self.writes.iter().any(|w| w.id == id) {
            self.retire_oldest_write()?;
        }
        Ok(())
    }
}

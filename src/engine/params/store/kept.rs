//! Pins for a device's copy in place: of a cpu-tier param's range in its
//! registered page, or of an NVMe param's swap buffer kept since its read
//! landed ("Swap buffers kept for the device" in the store's docs).

use super::*;

/// How long an acquire waits for the device's copies to give back the
/// swap buffers they share, when nothing else could free one. A copy ends
/// by itself (its DMA, or the simulated device's thread); this is a bound
/// on a stuck device, not a tuning knob.
const COPIES_WAIT: Duration = Duration::from_secs(120);

impl ParamStore {
    /// Whether the cpu tier's pages were registered with a device (their
    /// arena has a registrar): pins of them may be copied from in place.
    pub fn pages_registered(&self) -> bool {
        self.pages
            .first()
            .is_some_and(|p| p.arena().registrar().is_some())
    }

    /// Whether the NVMe tier's swap buffers were registered with a device:
    /// a landed read's buffer is then kept for its param's copy in place.
    pub fn swap_buffers_registered(&self) -> bool {
        self.nvme
            .as_ref()
            .is_some_and(|n| n.arena.registrar().is_some())
    }

    /// Whether any home a pin may come from is registered
    /// ([`ParamStore::pin_home`] can give one).
    pub fn homes_registered(&self) -> bool {
        self.pages_registered() || self.swap_buffers_registered()
    }

    /// A read pin of `id`'s bytes in pinned memory a device may copy from
    /// in place: its range in its page (cpu tier), or the swap buffer its
    /// read landed in, kept (NVMe tier, shared: the store keeps its own
    /// pin until [`ParamStore::let_go_kept`]). `None` unless the param's
    /// tensor is built from these bytes alone (one rank, the whole param;
    /// or, handing out shards, this rank's shard:
    /// `ParamStore::builds_locally`) with no new bytes coming, and
    /// (NVMe) its buffer was kept and not let go.
    ///
    /// The bytes are the ones the param's tensor was built from: pages are
    /// written on this thread only and an update keeps a resident tensor
    /// coherent with its page (a write-back into the page waits for the
    /// pin, [`SharedBuffer::write`]); a kept buffer goes with the tensor
    /// built from it, and an update drops both.
    pub fn pin_home(&self, id: ParamId) -> Result<Option<ReadPin>> {
        // Handing out shards, a page's range (a kept buffer) is the shard
        // the device gathers from ([`ParamStore::hand_out_shards`]).
        if !self.builds_locally(id) || self.freshness(id) != Freshness::Current {
            return Ok(None);
        }
        match &self.homes[id.0] {
            Home::Cpu { .. } => {
                let (page, range) = self.cpu_home(id)?;
                page.pin(range)
                    .map(Some)
                    .map_err(|e| EngineError::internal(format!("cpu page: {e}")))
            }
            Home::Nvme { .. } => Ok(self.kept(id).map(|k| k.pin.share())),
            Home::Device | Home::Host { .. } => Ok(None),
        }
    }

    /// Lets go of the kept swap buffers of `ids` (their unit was loaded:
    /// the device holds its params or copies them now, with pins of its
    /// own). Each goes back to the pool once no copy shares it.
    pub fn let_go_kept(&mut self, ids: &[ParamId]) -> Result<()> {
        for &id in ids {
            if self.kept(id).is_some() {
                self.apply(id, ParamEvent::LetGo)?;
            }
        }
        Ok(())
    }

    /// `id`'s kept buffer, if it has one.
    fn kept(&self, id: ParamId) -> Option<&Kept> {
        match self.slots.get(id.0).map(|e| &e.slot) {
            Some(Slot::Resident(_, kept)) => kept.as_ref(),
            _ => None,
        }
    }

    /// Swap buffers kept now, held by resident params.
    pub fn kept_now(&self) -> usize {
        self.slots
            .iter()
            .filter(|e| matches!(e.slot, Slot::Resident(_, Some(_))))
            .count()
    }

    /// Lets go of the newest kept swap buffer, for a read or a write-back
    /// that wants a buffer: the newest is the param used last, whose
    /// buffer would be held longest. Its param stays resident and crosses
    /// through staging. Whether there was one.
    pub(super) fn evict_kept(&mut self) -> Result<bool> {
        let newest = (0..self.slots.len())
            .filter_map(|i| self.kept(ParamId(i)).map(|k| (k.landed_seq, i)))
            .max();
        match newest {
            Some((_, i)) => {
                self.apply(ParamId(i), ParamEvent::LetGo)?;
                self.counters.kept_buffers_evicted += 1;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// A swap buffer once a device copy that shares one is done with it:
    /// every buffer is with such a copy (nothing kept, written or read
    /// here), and copies end by themselves.
    pub(super) fn wait_for_copies(&mut self, arena: &Arc<PinnedArena>) -> Result<Buffer> {
        let t0 = Instant::now();
        let got = arena.acquire_timeout(COPIES_WAIT);
        self.counters.io_wait += t0.elapsed();
        got.map_err(|e| {
            EngineError::internal(format!(
                "no parameter swap buffer came back from the device's copies in {} s \
                 ({} buffers, all lent to copies in place): {e}",
                COPIES_WAIT.as_secs(),
                arena.count()
            ))
        })
    }
}

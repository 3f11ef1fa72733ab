//! Several ranks: a unit's params gathered in one collective
//! ([`ParamStore::fetch_many`]), each rank's shards of the params not
//! resident one after the other, cut apart per param and rank (unless
//! the store hands out shards: then nothing is gathered here).

use super::*;

impl ParamStore {
    /// The tensors of `ids` (a unit's params), fetching what is not
    /// resident. With several ranks, every param that needs its gather
    /// is gathered in **one** collective: each rank's shards of those
    /// params, one after the other, then cut apart per param and rank
    /// (pure data movement, so the same bytes as a gather each). A unit
    /// of a dozen params then pays one collective's latency, not a dozen
    /// (NCCL's staged path synchronises once per collective). Every rank
    /// calls this with the same `ids` in unit order and holds the same
    /// params resident (residency grows only by a gather; it shrinks by
    /// releases, decided from the trace and [`Self::live_bytes`], which
    /// an update's timing does not move, and by updates, which turn a
    /// resident param into a staged one that every rank has staged by
    /// the time a fetch wants it), so the collectives match across ranks.
    /// With one rank, [`Self::fetch`] of each.
    pub fn fetch_many(&mut self, ids: &[ParamId]) -> Result<Vec<Tensor>> {
        if !self.defer_gather() {
            return ids.iter().map(|&id| self.fetch(id)).collect();
        }
        // Every param not resident gets its shard bytes staged here.
        let mut gather = Vec::new();
        for &id in ids {
            match self.state(id) {
                ParamState::Resident => {
                    self.counters.hits += 1;
                    continue;
                }
                ParamState::Staged => {}
                ParamState::InFlight => self.complete_read(id, false)?,
                ParamState::OnDisk => match &self.homes[id.0] {
                    Home::Device => return Err(self.not_on_device(id)),
                    Home::Host { shard } => {
                        let shard = shard.clone();
                        self.apply(id, ParamEvent::Staged(shard))?;
                    }
                    Home::Cpu { .. } => {
                        let shard = self.with_cpu_home(id, |src| Ok(src.to_vec()))?;
                        self.counters.cpu_read_bytes += shard.len() as u64;
                        self.apply(id, ParamEvent::Staged(shard))?;
                    }
                    Home::Nvme { .. } => {
                        let ticket = self.read_home_now(id)?;
                        self.counters.sync_reads += 1;
                        let read = self.hand_over(id, ticket)?;
                        self.apply(id, ParamEvent::ReadIssued(read))?;
                        self.complete_read(id, false)?;
                    }
                },
            }
            if !gather.contains(&id) {
                gather.push(id);
            }
        }
        self.gather_staged(&gather)?;
        ids.iter().map(|&id| self.resident_tensor(id)).collect()
    }

    /// One all-gather of the staged shards of `ids` (each staged), then
    /// each param's tensor from its ranks' pieces, made resident.
    fn gather_staged(&mut self, ids: &[ParamId]) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let world = self.comm.world_size();
        let mut mine = Vec::new();
        let mut counts_bytes = vec![0usize; world];
        for &id in ids {
            let info = &self.info[id.0];
            if info.counts_bytes.len() != world {
                return Err(EngineError::internal(format!(
                    "param `{}` is cut for {} ranks, not {world}",
                    info.name,
                    info.counts_bytes.len()
                )));
            }
            match &self.slots[id.0].slot {
                Slot::Staged(b, _) => mine.extend_from_slice(b),
                other => {
                    return Err(EngineError::internal(format!(
                        "gathering `{}` {}",
                        info.name,
                        other.name()
                    )))
                }
            }
            for (c, n) in counts_bytes.iter_mut().zip(&info.counts_bytes) {
                *c += n;
            }
        }
        let mut all = vec![0u8; counts_bytes.iter().sum()];
        self.comm.all_gather_bytes(&mine, &counts_bytes, &mut all)?;
        self.gathers
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // Rank r's block starts at the sum of the blocks before it; in
        // it, param i's piece follows the pieces of the params before i.
        let mut at: Vec<usize> = counts_bytes
            .iter()
            .scan(0usize, |acc, &c| {
                let start = *acc;
                *acc += c;
                Some(start)
            })
            .collect();
        for &id in ids {
            let info = &self.info[id.0];
            let mut full = Vec::with_capacity(info.numel * self.elem_bytes);
            for (r, n) in info.counts_bytes.iter().enumerate() {
                full.extend_from_slice(&all[at[r]..at[r] + n]);
                at[r] += n;
            }
            let t = cpu_tensor(&full, self.dtype, &info.shape)?.to_device(&self.device)?;
            self.apply(id, ParamEvent::Materialized(t))?;
        }
        Ok(())
    }
}

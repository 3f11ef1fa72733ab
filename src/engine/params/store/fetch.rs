//! Fetching a param: its tensor built from this rank's bytes, or
//! gathered from every rank's shards ([`ParamStore::fetch`]), from
//! whichever home holds it; and its release.

use super::*;

impl ParamStore {
    /// The shape of `id`'s tensor built from this rank's bytes alone
    /// ([`ParamStore::builds_locally`]): the param's, or (handing out
    /// shards) its shard's, 1-D.
    pub(super) fn local_shape(&self, id: ParamId) -> Vec<usize> {
        let info = &self.info[id.0];
        if info.counts_bytes.len() == 1 {
            info.shape.clone()
        } else {
            vec![info.shard_numel]
        }
    }

    /// Where this rank's shard starts in `id`'s resident tensor's bytes:
    /// its rank's offset in the whole param, or 0 when the tensor is built
    /// from this rank's bytes alone (one rank; or the shard itself, when
    /// handing out shards).
    pub(super) fn resident_offset_bytes(&self, id: ParamId) -> usize {
        if self.builds_locally(id) {
            0
        } else {
            let rank = self.comm.rank();
            self.info[id.0].counts_bytes.iter().take(rank).sum()
        }
    }

    pub(super) fn tensor_from_shard(&self, id: ParamId, shard: &[u8]) -> Result<Tensor> {
        let info = &self.info[id.0];
        // One rank holds the whole param, or the shard is what is handed
        // out: no gather (and no zeroed copy).
        let t = if self.builds_locally(id) {
            let shape = self.local_shape(id);
            let want = shape.iter().product::<usize>() * self.elem_bytes;
            if shard.len() != want {
                return Err(EngineError::internal(format!(
                    "param {id:?}: a shard of {} bytes for {want} bytes",
                    shard.len()
                )));
            }
            cpu_tensor(shard, self.dtype, &shape)?
        } else {
            let mut full = vec![0u8; info.numel * self.elem_bytes];
            self.comm
                .all_gather_bytes(shard, &info.counts_bytes, &mut full)?;
            self.gathers
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            cpu_tensor(&full, self.dtype, &info.shape)?
        };
        Ok(t.to_device(&self.device)?)
    }

    /// Bytes of `id`'s shard.
    pub(super) fn shard_bytes(&self, id: ParamId) -> Result<usize> {
        self.info
            .get(id.0)
            .map(|i| i.shard_numel * self.elem_bytes)
            .ok_or_else(|| EngineError::internal(format!("no param {id:?}")))
    }

    /// The device tensor of `id`, fetching it if needed (handing out
    /// shards, [`ParamStore::hand_out_shards`]: this rank's shard).
    pub fn fetch(&mut self, id: ParamId) -> Result<Tensor> {
        match self.state(id) {
            ParamState::Resident => self.counters.hits += 1,
            ParamState::InFlight => self.complete_read(id, true)?,
            ParamState::Staged => {
                let shard = match &mut self.slots[id.0].slot {
                    Slot::Staged(b, _) => std::mem::take(b),
                    _ => return Err(EngineError::internal("staged slot changed")),
                };
                match self.tensor_from_shard(id, &shard) {
                    Ok(t) => self.apply(id, ParamEvent::Materialized(t))?,
                    Err(e) => {
                        // The gather failed: the staged bytes go back, so
                        // the slot does not offer an empty shard later.
                        if let Slot::Staged(b, _) = &mut self.slots[id.0].slot {
                            *b = shard;
                        }
                        return Err(e);
                    }
                }
            }
            ParamState::OnDisk => match &self.homes[id.0] {
                Home::Device => return Err(self.not_on_device(id)),
                Home::Host { shard } => {
                    let t = self.tensor_from_shard(id, shard)?;
                    self.apply(id, ParamEvent::Materialized(t))?;
                }
                Home::Cpu { .. } => {
                    let (t, len) = self.with_cpu_home(id, |src| {
                        Ok((self.tensor_from_shard(id, src)?, src.len()))
                    })?;
                    self.counters.cpu_read_bytes += len as u64;
                    self.apply(id, ParamEvent::Materialized(t))?;
                }
                Home::Nvme { .. } => {
                    let ticket = self.read_home_now(id)?;
                    self.counters.sync_reads += 1;
                    let read = self.hand_over(id, ticket)?;
                    self.apply(id, ParamEvent::ReadIssued(read))?;
                    self.complete_read(id, true)?;
                }
            },
        }
        self.resident_tensor(id)
    }

    /// The tensor of `id`, which a fetch just made resident.
    pub(super) fn resident_tensor(&self, id: ParamId) -> Result<Tensor> {
        match &self.slots[id.0].slot {
            Slot::Resident(t, _) => Ok(t.clone()),
            other => Err(EngineError::internal(format!(
                "fetch left `{}` {}",
                self.info[id.0].name,
                other.name()
            ))),
        }
    }

    /// Not resident, but its home is the device.
    pub(super) fn not_on_device(&self, id: ParamId) -> EngineError {
        EngineError::internal(format!(
            "device-tier param `{}` is not resident",
            self.info[id.0].name
        ))
    }

    /// Drops the device copy of `id` (no-op for params that are not
    /// resident and for device-tier params that are always resident: a
    /// device-tier param whose fetches gather it keeps its shard at home
    /// and drops the whole).
    pub fn release(&mut self, id: ParamId) -> Result<()> {
        if matches!(self.homes.get(id.0), None | Some(Home::Device))
            || self.state(id) != ParamState::Resident
        {
            return Ok(());
        }
        self.apply(id, ParamEvent::Released)
    }

    /// Completes every in-flight read (e.g. when a trace is invalidated).
    pub fn settle(&mut self) -> Result<()> {
        for i in 0..self.slots.len() {
            if matches!(self.slots[i].slot, Slot::InFlight(_)) {
                self.complete_read(ParamId(i), false)?;
            }
        }
        Ok(())
    }

    /// Reads the current shard bytes of `id` from home (tests, export).
    pub fn read_shard(&mut self, id: ParamId) -> Result<Vec<u8>> {
        let t = self.fetch(id)?;
        let bytes = tensor_bytes(&t)?;
        Ok(bytes)
    }
}

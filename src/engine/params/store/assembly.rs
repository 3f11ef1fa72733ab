//! The pieces of a tiled param (see `crate::engine::layout`): their new
//! bytes assembled into one shard in host memory and written home when the
//! last expected update arrives, ranges no piece filled taken from the
//! current shard.

use super::*;

/// The new bytes of a tiled param's pieces that have arrived.
#[derive(Debug)]
pub(super) struct Assembly {
    /// The whole shard, `shard_numel × elem_bytes`.
    bytes: Vec<u8>,
    /// Byte ranges filled so far, by start (a piece sent again, a re-step
    /// or a restore, overwrites its range).
    filled: std::collections::BTreeMap<usize, usize>,
    /// Whether any piece asked to stay resident.
    keep: bool,
}

impl Assembly {
    fn filled_bytes(&self) -> usize {
        self.filled.values().sum()
    }
}

impl ParamStore {
    /// New bytes for one piece of `id`'s shard (`offset_bytes` into it),
    /// after an optimizer step of the sub-group holding it. A whole shard
    /// is [`ParamStore::update`]; the pieces of a tiled param (see
    /// `crate::engine::layout`) are assembled in host memory (one shard,
    /// the largest tensor's at most) and written home when the last
    /// expected update arrives. Should some pieces get no update in that
    /// round (their group was not stepped: a skipped step restores only the
    /// speculated groups), their current bytes are read from home first.
    pub fn update_piece(
        &mut self,
        id: ParamId,
        offset_bytes: usize,
        bytes: &[u8],
        keep: bool,
        built: Option<Tensor>,
    ) -> Result<()> {
        let len = self.shard_bytes(id)?;
        if offset_bytes == 0 && bytes.len() == len {
            return self.update(id, bytes, keep, built);
        }
        let end = offset_bytes
            .checked_add(bytes.len())
            .filter(|&e| e <= len)
            .ok_or_else(|| {
                EngineError::internal(format!(
                    "piece {offset_bytes}+{} of a {len}-byte shard",
                    bytes.len()
                ))
            })?;
        let e = self
            .slots
            .get_mut(id.0)
            .ok_or_else(|| EngineError::internal(format!("no param {id:?}")))?;
        let a = e.assembling.get_or_insert_with(|| Assembly {
            bytes: vec![0u8; len],
            filled: std::collections::BTreeMap::new(),
            keep: false,
        });
        a.bytes[offset_bytes..end].copy_from_slice(bytes);
        a.filled.insert(offset_bytes, bytes.len());
        a.keep |= keep;
        e.updates_coming = e.updates_coming.saturating_sub(1);
        if e.updates_coming == 0 {
            self.finish_assembly(id)?;
        }
        Ok(())
    }

    /// Writes an assembled shard home; ranges no piece filled keep their
    /// current bytes.
    pub(super) fn finish_assembly(&mut self, id: ParamId) -> Result<()> {
        let Some(mut a) = self.slots.get_mut(id.0).and_then(|e| e.assembling.take()) else {
            return Ok(());
        };
        if a.filled_bytes() < a.bytes.len() {
            let current = self.current_shard(id)?;
            let mut at = 0usize;
            let filled: Vec<(usize, usize)> = a.filled.iter().map(|(&o, &l)| (o, l)).collect();
            for (o, l) in filled.into_iter().chain([(a.bytes.len(), 0)]) {
                if o > at {
                    a.bytes[at..o].copy_from_slice(&current[at..o]);
                }
                at = at.max(o + l);
            }
        }
        if self.state(id) == ParamState::InFlight {
            self.complete_read(id, false)?;
        }
        let keep = self.stays_resident(id, a.keep);
        self.write_home(id, &a.bytes, keep, None)
    }

    /// Makes a resident `id` gathered again at its next fetch, like a
    /// param whose new bytes were staged: its own current shard is staged
    /// (a param not resident already is gathered at its next fetch). With
    /// several ranks, a fetch gathers the params no rank holds resident
    /// in one collective, so the ranks must agree on which are: the
    /// trainer calls this for a param another rank staged and this one did
    /// not (after a skipped step, each rank restores the params of the
    /// sub-groups it speculated, and those differ between ranks).
    pub fn restage_resident(&mut self, id: ParamId) -> Result<()> {
        if self.state(id) != ParamState::Resident {
            return Ok(());
        }
        let shard = self.current_shard(id)?;
        self.apply(id, ParamEvent::Staged(shard))
    }

    /// This rank's current shard bytes of `id`, from wherever they are
    /// (never a collective: several ranks stage, and gather only in
    /// fetches).
    fn current_shard(&mut self, id: ParamId) -> Result<Vec<u8>> {
        let len = self.shard_bytes(id)?;
        if self.state(id) == ParamState::InFlight {
            self.complete_read(id, false)?;
        }
        match &self.slots[id.0].slot {
            Slot::Staged(b, _) => return Ok(b.clone()),
            Slot::Resident(t, _) => {
                let all = tensor_bytes(t)?;
                let start = self.resident_offset_bytes(id);
                if start == 0 && all.len() == len {
                    return Ok(all);
                }
                return all
                    .get(start..start + len)
                    .map(<[u8]>::to_vec)
                    .ok_or_else(|| {
                        EngineError::internal("resident tensor shorter than its shard")
                    });
            }
            _ => {}
        }
        match &self.homes[id.0] {
            Home::Device => Err(EngineError::internal("device-tier param not resident")),
            Home::Host { shard } => Ok(shard.clone()),
            Home::Cpu { .. } => self.with_cpu_home(id, |b| Ok(b.to_vec())),
            Home::Nvme { .. } => {
                let ticket = self.read_home_now(id)?;
                let t0 = Instant::now();
                let buf = ticket.wait()?;
                self.counters.io_wait += t0.elapsed();
                Ok(buf.as_slice()[..len].to_vec())
            }
        }
    }
}

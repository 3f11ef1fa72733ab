//! The cpu tier's pinned pages: a param's shard read in place (the page
//! read-locked), or handed to the param copy thread to build its tensor
//! there (a prefetch). Write-backs into a page are in `writes.rs`.

use super::*;

impl ParamStore {
    /// A cpu-tier param's page and the byte range of its shard there.
    pub(super) fn cpu_home(&self, id: ParamId) -> Result<(SharedBuffer, std::ops::Range<usize>)> {
        let len = self.shard_bytes(id)?;
        let Home::Cpu { page, offset_bytes } = &self.homes[id.0] else {
            return Err(EngineError::internal("not a cpu-tier param"));
        };
        let p = self
            .pages
            .get(*page)
            .ok_or_else(|| EngineError::internal("cpu page missing"))?;
        Ok((p.clone(), *offset_bytes..*offset_bytes + len))
    }

    /// `f` of the shard bytes of a cpu-tier param, in its pinned page
    /// (read-locked: the copy thread may be reading it too).
    pub(super) fn with_cpu_home<R>(
        &self,
        id: ParamId,
        f: impl FnOnce(&[u8]) -> Result<R>,
    ) -> Result<R> {
        let (page, range) = self.cpu_home(id)?;
        let pin = page
            .pin(range)
            .map_err(|e| EngineError::internal(format!("cpu page: {e}")))?;
        f(pin.bytes())
    }

    /// A cpu-tier param's tensor built on the copy thread from its page
    /// (the page read-locked there while it copies).
    pub(super) fn prefetch_cpu(&mut self, id: ParamId) -> Result<bool> {
        let Some(copier) = &self.copier else {
            return Ok(false);
        };
        let (page, range) = self.cpu_home(id)?;
        let len = range.len();
        let read = copier.copy_page(page, range, self.unpack(id))?;
        self.counters.cpu_read_bytes += len as u64;
        self.counters.prefetches += 1;
        self.apply(id, ParamEvent::ReadIssued(read))?;
        Ok(true)
    }
}

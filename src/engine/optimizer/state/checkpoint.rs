//! The checkpoint side of [`OptimizerState`]: a sub-group's three states
//! loaded from a checkpoint, and written into one (see
//! `crate::engine::trainer` for the save and resume sequence).

use super::*;

impl OptimizerState {
    /// Sets all three states of a sub-group (master, m, v), e.g. from a
    /// checkpoint. On NVMe, at any point between steps (the Python
    /// optimizer's `load_state_dict` after it has stepped): every queued
    /// state write lands first (two writes of one extent in flight could
    /// land in either order), and a read of this sub-group issued ahead, or
    /// a speculative step of it not committed, is dropped: the next step
    /// would otherwise use the state from before the load.
    pub fn load_group(&mut self, sg: SubGroupId, states: [&[f32]; 3]) -> Result<()> {
        let n = self.numel_of(sg)?;
        if states.iter().any(|s| s.len() != n) {
            return Err(EngineError::internal("load_group: wrong length"));
        }
        if self.nvme.is_some() {
            self.retire_writes(0)?;
        }
        if let Some(nv) = &mut self.nvme {
            let mut stale = Vec::new();
            nv.reading.retain_mut(|(id, ts)| {
                let keep = *id != sg;
                if !keep {
                    stale.append(ts);
                }
                keep
            });
            drop(tierzero_swap::wait_all(stale)?);
            if let Some(slot) = nv.pending.get_mut(sg.0).and_then(Option::take) {
                nv.pool.push(slot);
            }
        }
        if let Some(g) = self.mem.get_mut(sg.0).and_then(Option::as_mut) {
            g.master.copy_from_slice(states[0]);
            g.moments.set(states[1], states[2]);
            return Ok(());
        }
        match &mut self.nvme {
            None => return Err(EngineError::internal("no state for a sub-group")),
            Some(nv) => {
                let mut tickets = Vec::with_capacity(3);
                let exts = nvme_extents(&nv.extents, sg)?;
                let moments = self.moments;
                for (k, (ext, src)) in exts.iter().zip(states).enumerate() {
                    let mut buf = nv.io.arena.acquire()?;
                    let data_bytes = match (k, moments) {
                        (0, _) | (_, MomentDtype::F32) => {
                            as_f32(&mut buf, n)?.copy_from_slice(src);
                            n * 4
                        }
                        (_, MomentDtype::Bf16) => {
                            narrow_into(as_typed::<bf16>(&mut buf, n)?, src);
                            n * 2
                        }
                    };
                    let len = ext.len_bytes();
                    // The padding past the data is written too: zeros, not
                    // a reused buffer's old bytes, so the extent (and any
                    // checkpoint copied from it) depends only on the state.
                    if let Some(tail) = usize::try_from(len)
                        .ok()
                        .and_then(|l| buf.as_mut_slice().get_mut(data_bytes..l))
                    {
                        tail.fill(0);
                    }
                    tickets.push(nv.io.write.write(ext, buf)?);
                    self.counters.nvme_written_bytes += len;
                }
                tierzero_swap::wait_all(tickets)?;
            }
        }
        Ok(())
    }

    /// Writes state `k` (0 master, 1 m, 2 v) of `sg` into `file` at
    /// `offset_bytes`, `len_bytes` long (its stored bytes,
    /// [`state_bytes`], rounded up to 4096; the tail is padding), and
    /// returns the region's crc32c.
    ///
    /// Memory tiers write from memory (zero padding) and compute the crc as
    /// they go. NVMe copies the extent with
    /// [`tierzero_swap::SwapSpace::copy_extent_to_file`] (O_DIRECT past the
    /// page cache, or a reflink) after draining every queued write; the crc is the one the swap space
    /// recorded for the extent when checksums are on (and the extent is
    /// exactly the region), else it is computed by reading the region back.
    pub fn save_state(
        &mut self,
        sg: SubGroupId,
        k: usize,
        file: &std::fs::File,
        path: &std::path::Path,
        offset_bytes: u64,
        len_bytes: u64,
    ) -> Result<u32> {
        use std::os::unix::fs::FileExt;
        let n = self.numel_of(sg)?;
        let stored = state_bytes(n, self.moments);
        if k > 2 || (n > 0 && stored[k] > len_bytes) {
            return Err(EngineError::internal("save_state: bad state or region"));
        }
        // The checkpoint's `exp_avg.f32` / `exp_avg_sq.f32` are fp32 and the
        // manifest names no other dtype: bf16 moments written as they are
        // would be read back as fp32 garbage.
        if k > 0 && self.moments != MomentDtype::F32 {
            return Err(EngineError::Unsupported {
                what: "a checkpoint of bf16 Adam moments (its files hold fp32)".into(),
            });
        }
        let io_err = |op: &'static str| {
            move |source: std::io::Error| {
                EngineError::Checkpoint(crate::checkpoint::CheckpointError::Io {
                    op,
                    path: path.to_path_buf(),
                    source,
                })
            }
        };
        crate::failpoint::io_point(crate::failpoint::Site::CkptStateWrite)
            .map_err(io_err("writing"))?;
        if let Some(g) = self.mem.get(sg.0).and_then(Option::as_ref) {
            let data = match k {
                0 => crate::le::bytes(&g.master),
                _ => g.moments.le_bytes(k),
            };
            let crc = write_region(file, path, offset_bytes, len_bytes, &data)?;
            crate::durable::record::write(path, offset_bytes, len_bytes);
            return Ok(crc);
        }
        // Only committed state is saved.
        if self.pending_speculations() > 0 {
            return Err(EngineError::internal(
                "save_state with speculative steps not committed",
            ));
        }
        // Nothing may be in flight on these extents while the kernel copies.
        if self.reads_pending() > 0 {
            return Err(EngineError::internal(
                "save_state with optimizer reads in flight",
            ));
        }
        self.retire_writes(0)?;
        self.retire_spill_writes(true)?;
        let nv = self
            .nvme
            .as_ref()
            .ok_or_else(|| EngineError::internal("nvme state missing"))?;
        let ext = &nvme_extents(&nv.extents, sg)?[k];
        let space = ext.space().clone();
        space.copy_extent_to_file(ext, len_bytes, file, path, offset_bytes)?;
        crate::durable::record::write(path, offset_bytes, len_bytes);
        match ext.recorded_crc32c() {
            Some(crc) if ext.len_bytes() == len_bytes => Ok(crc),
            _ => {
                let mut buf = vec![0u8; 1 << 20];
                let mut crc = 0u32;
                let mut pos = 0u64;
                while pos < len_bytes {
                    let take = ((len_bytes - pos) as usize).min(buf.len());
                    file.read_exact_at(&mut buf[..take], offset_bytes + pos)
                        .map_err(io_err("reading back"))?;
                    crc = crc32c::crc32c_append(crc, &buf[..take]);
                    pos += take as u64;
                }
                Ok(crc)
            }
        }
    }
}

/// Writes `data`, then zeros up to `len_bytes`, at `offset_bytes` of the
/// checkpoint file `file` (at `path`), and returns the region's crc32c.
/// Past the page cache where the file system allows
/// ([`tierzero_swap::DirectWriter`], whose docs give the measurements);
/// through `file` otherwise.
pub(super) fn write_region(
    file: &std::fs::File,
    path: &std::path::Path,
    offset_bytes: u64,
    len_bytes: u64,
    data: &[u8],
) -> Result<u32> {
    use std::os::unix::fs::FileExt;
    let len = usize::try_from(len_bytes)
        .ok()
        .filter(|&l| l >= data.len())
        .ok_or_else(|| EngineError::internal("save_state: the region is shorter than the state"))?;
    if let Some(mut w) = tierzero_swap::DirectWriter::open(path) {
        let mut crc = 0u32;
        let written = w.write_at(offset_bytes, len_bytes, |pos, chunk| {
            let from = (pos as usize).min(data.len());
            let have = (data.len() - from).min(chunk.len());
            let (head, tail) = chunk.split_at_mut(have);
            head.copy_from_slice(&data[from..from + have]);
            tail.fill(0);
            crc = crc32c::crc32c_append(crc, chunk);
        })?;
        if written {
            return Ok(crc);
        }
    }
    let io_err = |source: std::io::Error| {
        EngineError::Checkpoint(crate::checkpoint::CheckpointError::Io {
            op: "writing",
            path: path.to_path_buf(),
            source,
        })
    };
    file.write_all_at(data, offset_bytes).map_err(io_err)?;
    let padding = vec![0u8; len - data.len()];
    file.write_all_at(&padding, offset_bytes + data.len() as u64)
        .map_err(io_err)?;
    Ok(crc32c::crc32c_append(crc32c::crc32c(data), &padding))
}

impl OptimizerState {
    /// The master weights and moments of `sg` (synchronous reads on NVMe,
    /// after every queued write), e.g. for a framework's `state_dict`.
    pub fn group_states(&mut self, sg: SubGroupId) -> Result<[Vec<f32>; 3]> {
        let n = self.numel_of(sg)?;
        let mut out: [Vec<f32>; 3] = [vec![0.0; n], vec![0.0; n], vec![0.0; n]];
        let [a, b, c] = &mut out;
        self.group_states_into(sg, [a, b, c])?;
        Ok(out)
    }

    /// [`OptimizerState::group_states`] into the caller's memory (three
    /// slices of the sub-group's numel): a framework's `state_dict` costs
    /// its own tensors, not a second copy.
    pub fn group_states_into(&mut self, sg: SubGroupId, out: [&mut [f32]; 3]) -> Result<()> {
        let n = self.numel_of(sg)?;
        if out.iter().any(|o| o.len() != n) {
            return Err(EngineError::internal(
                "group_states_into: outputs are not of the sub-group's numel",
            ));
        }
        self.flush()?;
        let [master, m, v] = out;
        if let Some(g) = self.mem.get(sg.0).and_then(Option::as_ref) {
            master.copy_from_slice(&g.master);
            g.moments.widen_into(1, m);
            g.moments.widen_into(2, v);
            return Ok(());
        }
        let nv = self
            .nvme
            .as_mut()
            .ok_or_else(|| EngineError::internal("no state for a sub-group"))?;
        let exts = nvme_extents(&nv.extents, sg)?.clone();
        for (k, (ext, out)) in exts.iter().zip([master, m, v]).enumerate() {
            let buf = nv.io.arena.acquire()?;
            let mut buf = nv.io.read.read(ext, buf)?.wait()?;
            self.counters.nvme_read_bytes += ext.len_bytes();
            match (k, self.moments) {
                (0, _) | (_, MomentDtype::F32) => out.copy_from_slice(as_f32(&mut buf, n)?),
                (_, MomentDtype::Bf16) => out
                    .iter_mut()
                    .zip(as_typed::<bf16>(&mut buf, n)?.iter())
                    .for_each(|(o, x)| *o = x.to_f32()),
            }
        }
        Ok(())
    }

    /// The master weights of `sg` (a synchronous read on NVMe).
    pub fn master(&mut self, sg: SubGroupId) -> Result<Vec<f32>> {
        self.with_master(sg, <[f32]>::to_vec)
    }

    /// `f` of the master weights of `sg`, where they are (in memory), or
    /// in the pinned buffer a synchronous read put them in (NVMe).
    pub fn with_master<R>(&mut self, sg: SubGroupId, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
        let n = self.numel_of(sg)?;
        self.flush()?;
        if let Some(g) = self.mem.get(sg.0).and_then(Option::as_ref) {
            return Ok(f(&g.master));
        }
        match &mut self.nvme {
            None => Err(EngineError::internal("no state for a sub-group")),
            Some(nv) => {
                let t0 = std::time::Instant::now();
                let buf = nv.io.arena.acquire()?;
                let ext = &nvme_extents(&nv.extents, sg)?[0];
                let read = nv.io.read.read(ext, buf).and_then(|t| t.wait());
                // A Restore's read (a skipped speculative step) blocks the
                // optimizer thread: I/O wait.
                self.counters.io_wait += t0.elapsed();
                let mut buf = read?;
                self.counters.nvme_read_bytes += ext.len_bytes();
                Ok(f(as_f32(&mut buf, n)?))
            }
        }
    }
}

//! The simulated device's collectives for the optimizer on the device
//! ([`DeviceLink::reduce_kept`], [`DeviceLink::gather_kept`]): its memory
//! is host memory, so they are the ranks' own collectives on it, and
//! their buffers are counted in its budget as a GPU's would be.

use super::{buf_key, SimDevice, SimPacked, SimUpload};
use crate::engine::device::DeviceLink;
use crate::model::ModelError;

impl SimDevice {
    /// [`DeviceLink::reduce_kept`] on the simulated device.
    pub(super) fn reduce_kept_here(
        &self,
        what: &str,
        packed: SimPacked,
        accs: Vec<Option<Vec<f32>>>,
        counts: &[Vec<usize>],
    ) -> Result<Vec<Option<SimUpload>>, ModelError> {
        let SimPacked { full, blocks } = packed;
        let rank = self.collective_rank();
        let mine: Vec<usize> = counts
            .iter()
            .map(|c| c.get(rank).copied().unwrap_or(0))
            .collect();
        if accs.len() != mine.len()
            || accs
                .iter()
                .zip(&mine)
                .any(|(a, &n)| a.as_ref().is_some_and(|a| a.len() != n))
        {
            let lens: Vec<_> = accs.iter().map(|a| a.as_ref().map(Vec::len)).collect();
            for a in accs.into_iter().flatten() {
                self.free(a);
            }
            return Err(ModelError::Gpu {
                what: format!("{what}: running sums of {lens:?} for shards of {mine:?}"),
            });
        }
        // The running sums in one buffer, in pack order, +0.0 for a param
        // without its own; theirs leave the device's count, and each
        // param's new sums join it after the collective (as a gather's
        // whole does, so that a refusal leaves no peer waiting in it).
        let mut sums: Vec<f32> = Vec::with_capacity(mine.iter().sum());
        for (a, &n) in accs.into_iter().zip(&mine) {
            match a {
                Some(a) => {
                    sums.extend_from_slice(&a);
                    self.free(a);
                }
                None => sums.resize(sums.len() + n, 0.0),
            }
        }
        let sums = self.on_collectives(what, &self.shared.reduces, |comm| {
            let mut sums = sums;
            comm.reduce_scatter_add_f32(&full, &blocks, &mut sums)
                .map_err(|e| e.to_string())?;
            Ok(sums)
        })?;
        self.reserve(what, sums.len() as u64 * 4)?;
        let mut out = Vec::with_capacity(mine.len());
        let mut at = 0usize;
        for &n in &mine {
            if n == 0 {
                out.push(None);
                continue;
            }
            // Its memory is host memory: the sums are where the compute
            // reads them, at once.
            out.push(Some(SimUpload::ready(sums[at..at + n].to_vec())));
            at += n;
        }
        Ok(out)
    }

    /// [`DeviceLink::gather_kept`] on the simulated device.
    pub(super) fn gather_kept_here(
        &self,
        what: &str,
        wholes: Vec<Vec<f32>>,
        shards: &[Option<&Vec<f32>>],
        counts: &[Vec<usize>],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let mut wholes = wholes;
        let gathered = self.fill_and_gather(what, &mut wholes, shards, counts);
        match gathered {
            Ok(()) => Ok(wholes),
            Err(e) => {
                // The wholes leave the device's count with the error.
                for w in wholes {
                    self.free(w);
                }
                Err(e)
            }
        }
    }

    /// [`Self::gather_kept_here`]'s work on `wholes`: this rank's ranges
    /// from the shards, then the others' through the ranks' collective.
    fn fill_and_gather(
        &self,
        what: &str,
        wholes: &mut [Vec<f32>],
        shards: &[Option<&Vec<f32>>],
        counts: &[Vec<usize>],
    ) -> Result<(), ModelError> {
        let rank = self.collective_rank();
        let bad = |detail: String| ModelError::Gpu {
            what: format!("{what}: {detail}"),
        };
        if shards.len() != wholes.len() || counts.len() != wholes.len() {
            return Err(bad(format!(
                "{} params, {} shards, {} counts",
                wholes.len(),
                shards.len(),
                counts.len()
            )));
        }
        for ((w, shard), c) in wholes.iter_mut().zip(shards).zip(counts) {
            let n = c.get(rank).copied().unwrap_or(0);
            let from: usize = c.iter().take(rank).sum();
            let src: &[f32] = shard.map_or(&[], |v| v.as_slice());
            if src.len() != n || from + n > w.len() {
                return Err(bad(format!(
                    "a shard of {} elements for rank {rank}'s {n} of a param of {} cut as {c:?}",
                    src.len(),
                    w.len()
                )));
            }
            // A whole kept in bf16 gets the master rounded, as the host's
            // bf16 copy is (its buffer holds the values widened).
            let narrow = self.shared.narrow().contains_key(&buf_key(w));
            for (d, &x) in w[from..from + n].iter_mut().zip(src) {
                *d = if narrow {
                    half::bf16::from_f32(x).to_f32()
                } else {
                    x
                };
            }
        }
        self.on_collectives(what, &self.shared.kept_gathers, |comm| {
            super::gather::into_wholes(comm, wholes, counts)
        })
    }
}

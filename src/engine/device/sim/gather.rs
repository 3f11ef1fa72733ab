//! The simulated device's gather of a param ([`super::SimDevice`]'s
//! `DeviceLink::gather_param`): its memory is host memory, so the ranks'
//! shards meet through the ranks' own collective, bytes only, as NCCL's
//! exchange moves them.

use crate::engine::comm::Comm;
use crate::engine::device::Wire;
use crate::model::exec_units::{HostElems, HostVec};

/// Every rank's shard of a param, in rank order: `shard` is this rank's
/// `counts[rank]` elements (`counts[r]` of rank `r`), all-gathered as
/// little-endian bytes through `comm` and read back in `shard`'s dtype.
/// The same bits as a gather on the host.
pub(super) fn shards(
    comm: &dyn Comm,
    shard: HostElems<'_>,
    counts: &[usize],
) -> Result<HostVec, String> {
    let (wire, mine): (Wire, Vec<u8>) = match shard {
        HostElems::F32(v) => (Wire::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        HostElems::Bf16(v) => (Wire::Bf16, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        HostElems::F16(v) => (Wire::F16, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
    };
    shards_of_bytes(comm, wire, &mine, counts)
}

/// [`shards`] of this rank's shard as its little-endian bytes `mine`,
/// elements of `wire`'s dtype (a page's range, read in place).
pub(super) fn shards_of_bytes(
    comm: &dyn Comm,
    wire: Wire,
    mine: &[u8],
    counts: &[usize],
) -> Result<HostVec, String> {
    let elem_bytes = wire.elem_bytes();
    let counts_bytes: Vec<usize> = counts.iter().map(|c| c * elem_bytes).collect();
    if counts.len() != comm.world_size() || counts_bytes.get(comm.rank()) != Some(&mine.len()) {
        return Err(format!(
            "a shard of {} elements on rank {} of {}, cut as {counts:?}",
            mine.len() / elem_bytes,
            comm.rank(),
            comm.world_size()
        ));
    }
    let mut all = vec![0u8; counts_bytes.iter().sum()];
    comm.all_gather_bytes(mine, &counts_bytes, &mut all)
        .map_err(|e| e.to_string())?;
    Ok(match wire {
        Wire::F32 => HostVec::F32(
            all.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
        Wire::Bf16 => HostVec::Bf16(
            all.chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]))
                .collect(),
        ),
        Wire::F16 => HostVec::F16(
            all.chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]))
                .collect(),
        ),
    })
}

/// Every rank's range of each of `wholes` gathered into it, this rank's
/// own already in place (`counts[p][r]` elements of whole `p` for rank
/// `r`, the ranges in rank order): one all-gather of the ranks' ranges
/// of every whole, concatenated, as little-endian fp32 bytes (the
/// simulated device holds 16-bit values widened, exactly), each put back
/// in its range. The same bits as a gather on the host.
pub(super) fn into_wholes(
    comm: &dyn Comm,
    wholes: &mut [Vec<f32>],
    counts: &[Vec<usize>],
) -> Result<(), String> {
    let (me, world) = (comm.rank(), comm.world_size());
    if wholes.len() != counts.len() {
        return Err(format!(
            "{} params but {} counts",
            wholes.len(),
            counts.len()
        ));
    }
    for (w, c) in wholes.iter().zip(counts) {
        if c.len() != world || c.iter().sum::<usize>() != w.len() {
            return Err(format!(
                "a param of {} elements cut as {c:?} for {world} ranks",
                w.len()
            ));
        }
    }
    // Where rank `r`'s range of each whole starts.
    let start = |c: &[usize], r: usize| c[..r].iter().sum::<usize>();
    let mine: Vec<u8> = wholes
        .iter()
        .zip(counts)
        .flat_map(|(w, c)| {
            let from = start(c, me);
            w[from..from + c[me]].iter().flat_map(|x| x.to_le_bytes())
        })
        .collect();
    let counts_bytes: Vec<usize> = (0..world)
        .map(|r| counts.iter().map(|c| c[r] * 4).sum())
        .collect();
    let mut all = vec![0u8; counts_bytes.iter().sum()];
    comm.all_gather_bytes(&mine, &counts_bytes, &mut all)
        .map_err(|e| e.to_string())?;
    let mut at = 0usize;
    for r in 0..world {
        for (w, c) in wholes.iter_mut().zip(counts) {
            let from = start(c, r);
            for (dst, b) in w[from..from + c[r]]
                .iter_mut()
                .zip(all[at..at + 4 * c[r]].chunks_exact(4))
            {
                *dst = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
            at += 4 * c[r];
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::engine::comm::scripted::Scripted;

    /// Rank 1 of three whose peers' shards are bytes of their rank
    /// (0x00 from rank 0, 0x02 from rank 2): the gather must put each in
    /// its range, this rank's own between.
    fn rank_one_of_three() -> Scripted {
        Scripted {
            gather_bytes: Some(|shard, counts, out| {
                crate::engine::comm::check_counts("all_gather", 1, counts, shard.len(), out.len())?;
                let (a, b) = (counts[0], counts[0] + counts[1]);
                out[..a].fill(0x00);
                out[a..b].copy_from_slice(shard);
                out[b..].fill(0x02);
                Ok(())
            }),
            ..Scripted::rank_of(1, 3)
        }
    }

    #[test]
    fn each_rank_s_shard_lands_in_its_range_in_its_dtype() {
        // Uneven counts, as `shard_counts` cuts 7 elements for 3 ranks.
        let counts = [3usize, 2, 2];
        let mine = [1.5f32, -2.25];
        let HostVec::F32(got) =
            shards(&rank_one_of_three(), HostElems::F32(&mine), &counts).unwrap()
        else {
            panic!("not fp32")
        };
        let two = f32::from_le_bytes([2; 4]);
        assert_eq!(
            got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            [0.0, 0.0, 0.0, 1.5, -2.25, two, two]
                .iter()
                .map(|x| x.to_bits())
                .collect::<Vec<_>>()
        );
        let mine16 = [half::bf16::from_f32(3.0), half::bf16::from_f32(-0.5)];
        let HostVec::Bf16(got) =
            shards(&rank_one_of_three(), HostElems::Bf16(&mine16), &counts).unwrap()
        else {
            panic!("not bf16")
        };
        assert_eq!(got.len(), 7);
        assert_eq!(&got[3..5], &mine16);
        assert_eq!(got[5].to_bits(), 0x0202);
    }

    #[test]
    fn a_shard_of_the_wrong_length_is_refused_with_the_counts() {
        let e = shards(&rank_one_of_three(), HostElems::F32(&[1.0; 3]), &[3, 2, 2]).unwrap_err();
        assert!(
            e.contains("3 elements on rank 1 of 3") && e.contains("[3, 2, 2]"),
            "{e}"
        );
        let e = shards(&rank_one_of_three(), HostElems::F32(&[1.0; 2]), &[3, 4]).unwrap_err();
        assert!(e.contains("[3, 4]"), "{e}");
    }

    #[test]
    fn kept_wholes_get_every_rank_s_range_of_each_param_in_one_gather() {
        // Two params cut for three ranks; rank 1's ranges are in place,
        // the scripted peers' are bytes of their rank.
        let counts = vec![vec![3usize, 2, 2], vec![1, 1, 0]];
        let mut wholes = vec![vec![9f32; 7], vec![9f32; 2]];
        wholes[0][3..5].copy_from_slice(&[1.5, -2.25]);
        wholes[1][1] = 4.0;
        into_wholes(&rank_one_of_three(), &mut wholes, &counts).unwrap();
        let two = f32::from_le_bytes([2; 4]);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&wholes[0]),
            bits(&[0.0, 0.0, 0.0, 1.5, -2.25, two, two])
        );
        assert_eq!(bits(&wholes[1]), bits(&[0.0, 4.0]));
        let e = into_wholes(&rank_one_of_three(), &mut wholes, &[vec![3, 2, 2]]).unwrap_err();
        assert!(e.contains("2 params but 1 counts"), "{e}");
    }
}

//! A self-test of any [`Comm`]: every collective the engine uses, on inputs
//! every rank can recompute for every other rank, checked bit for bit, plus
//! a timed all-gather. `tierzero gpu-info --nccl-test` runs it over NCCL
//! (`scripts/gpu_check.sh`); the unit tests run it over [`crate::engine::SingleRank`].
//!
//! The checks are the determinism contract of [`Comm`]: the reduce-scatter
//! must equal, bit for bit, the host adding every rank's chunk into the
//! accumulator in rank order; variable counts (ranks with different shard
//! lengths, one rank with none) must land at the right offsets.

use std::time::Instant;

use crate::engine::comm::Comm;
use crate::engine::{EngineError, Result};

/// What [`self_test`] measured. Every check passed when it returns `Ok`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CheckReport {
    /// This rank.
    pub rank: usize,
    /// Ranks.
    pub world: usize,
    /// Names of the checks that passed, in order.
    pub passed: Vec<&'static str>,
    /// Bytes each rank contributed to the timed all-gather.
    pub gather_shard_bytes: usize,
    /// Timed all-gather repetitions.
    pub gather_iters: usize,
    /// Mean seconds per timed all-gather.
    pub gather_mean_s: f64,
    /// Bytes gathered per second per rank (`world × shard / time`), the
    /// "algorithm bandwidth" of nccl-tests, in GB/s (10⁹).
    pub gather_algbw_gb_s: f64,
}

/// Byte `i` of rank `r`'s shard.
fn shard_byte(r: usize, i: usize) -> u8 {
    (r.wrapping_mul(31) ^ i.wrapping_mul(7)).wrapping_add(i >> 8) as u8
}

/// Element `j` of rank `r`'s full gradient: values whose sums round, so
/// the order of addition shows.
fn grad_value(r: usize, j: usize) -> f32 {
    let x = ((r * 7919 + j * 104_729) % 10_007) as f32;
    (x - 5003.0) * 1.0e-3 + 1.0 / ((r + 1) as f32 * 3.0)
}

/// An all-gather of `counts[r]` bytes from rank r (each byte a function
/// of its rank and position), checked byte for byte.
fn gather_check(comm: &dyn Comm, counts: &[usize]) -> Result<()> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let shard: Vec<u8> = (0..counts[rank]).map(|i| shard_byte(rank, i)).collect();
    let mut out = vec![0u8; counts.iter().sum()];
    comm.all_gather_bytes(&shard, counts, &mut out)?;
    let want: Vec<u8> = (0..world)
        .flat_map(|r| (0..counts[r]).map(move |i| shard_byte(r, i)))
        .collect();
    match out.iter().zip(&want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(at) => Err(fail(
            rank,
            world,
            "all_gather_bytes",
            format!("wrong bytes from offset {at} of {}", out.len()),
        )),
    }
}

/// A reduce-scatter of chunks of `base + 5 r` elements for rank r,
/// checked bit for bit against adding every rank's chunk in rank order.
fn reduce_scatter_check(comm: &dyn Comm, base: usize) -> Result<()> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let numel: Vec<usize> = (0..world).map(|r| base + 5 * r).collect();
    let total: usize = numel.iter().sum();
    let offset: usize = numel[..rank].iter().sum();
    let full: Vec<f32> = (0..total).map(|j| grad_value(rank, j)).collect();
    let mut acc: Vec<f32> = (0..numel[rank]).map(|k| 0.5 + k as f32 * 1e-4).collect();
    let mut want = acc.clone();
    comm.reduce_scatter_add_f32(&full, &numel, &mut acc)?;
    for p in 0..world {
        for (k, w) in want.iter_mut().enumerate() {
            *w += grad_value(p, offset + k);
        }
    }
    match acc
        .iter()
        .zip(&want)
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        None => Ok(()),
        Some(k) => Err(fail(
            rank,
            world,
            "reduce_scatter_add_f32",
            format!(
                "element {k} of {} is {} but adding in rank order gives {}",
                acc.len(),
                acc[k],
                want[k]
            ),
        )),
    }
}

fn fail(rank: usize, world: usize, check: &str, what: String) -> EngineError {
    EngineError::Comm {
        rank,
        world,
        op: "self-test",
        reason: format!("{check}: {what}"),
    }
}

/// Runs every check, then times `iters` all-gathers of `shard_bytes` per
/// rank. Every rank must call it with the same arguments.
pub fn self_test(comm: &dyn Comm, shard_bytes: usize, iters: usize) -> Result<CheckReport> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut passed = Vec::new();

    // 1. Variable-count all-gather: rank r has 1000 + 333 r bytes, except
    // that the last rank has none when there are several.
    let counts: Vec<usize> = (0..world)
        .map(|r| {
            if world > 1 && r == world - 1 {
                0
            } else {
                1000 + 333 * r
            }
        })
        .collect();
    gather_check(comm, &counts)?;
    passed.push("all_gather_bytes (variable counts)");
    // The same, each rank's shard just over 16 MiB: a staged backend
    // (NCCL's) moves it in more than one round; every byte depends on its
    // rank and position, so a piece placed wrong shows.
    let counts: Vec<usize> = (0..world).map(|r| (16 << 20) + 1000 + 333 * r).collect();
    gather_check(comm, &counts)?;
    passed.push("all_gather_bytes (over 16 MiB a rank)");

    // 2. Reduce-scatter: bit-identical to adding in rank order; small
    // chunks, then chunks of just over 16 MiB, which a staged backend
    // (NCCL's) moves in more than one round.
    for (base, name) in [
        (
            4097usize,
            "reduce_scatter_add_f32 (rank order, bit-identical)",
        ),
        (
            (16 << 20) / 4 + 3,
            "reduce_scatter_add_f32 (chunks over 16 MiB, bit-identical)",
        ),
    ] {
        reduce_scatter_check(comm, base)?;
        passed.push(name);
    }

    // 3. Scalars.
    let local = [rank as f64 + 0.25, -(rank as f64) * 1e-17];
    let mut all = vec![0f64; 2 * world];
    comm.all_gather_f64(&local, &mut all)?;
    let want: Vec<f64> = (0..world)
        .flat_map(|r| [r as f64 + 0.25, -(r as f64) * 1e-17])
        .collect();
    if all
        .iter()
        .zip(&want)
        .any(|(a, b)| a.to_bits() != b.to_bits())
    {
        return Err(fail(rank, world, "all_gather_f64", format!("{all:?}")));
    }
    let sum = comm.all_reduce_sum_f64(0.1 * (rank + 1) as f64)?;
    let want = (0..world).fold(0f64, |s, r| s + 0.1 * (r + 1) as f64);
    if sum.to_bits() != want.to_bits() {
        return Err(fail(
            rank,
            world,
            "all_reduce_sum_f64",
            format!("{sum} != {want}"),
        ));
    }
    passed.push("all_gather_f64, all_reduce_sum_f64");
    comm.barrier()?;
    passed.push("barrier");

    // 4. Timed all-gather (after one warm-up).
    let counts = vec![shard_bytes; world];
    let shard = vec![rank as u8; shard_bytes];
    let mut out = vec![0u8; shard_bytes * world];
    comm.all_gather_bytes(&shard, &counts, &mut out)?;
    comm.barrier()?;
    let t0 = Instant::now();
    for _ in 0..iters {
        comm.all_gather_bytes(&shard, &counts, &mut out)?;
    }
    let mean_s = t0.elapsed().as_secs_f64() / iters.max(1) as f64;
    if out
        .chunks_exact(shard_bytes.max(1))
        .enumerate()
        .any(|(r, c)| c.iter().any(|&b| b != r as u8))
    {
        return Err(fail(rank, world, "timed all_gather", "wrong bytes".into()));
    }
    Ok(CheckReport {
        rank,
        world,
        passed,
        gather_shard_bytes: shard_bytes,
        gather_iters: iters,
        gather_mean_s: mean_s,
        gather_algbw_gb_s: if mean_s > 0.0 {
            (shard_bytes * world) as f64 / mean_s / 1e9
        } else {
            0.0
        },
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;
    use crate::engine::SingleRank;

    #[test]
    fn single_rank_passes_every_check() {
        let r = self_test(&SingleRank, 4096, 3).unwrap();
        assert_eq!(r.passed.len(), 6);
        assert_eq!((r.rank, r.world, r.gather_iters), (0, 1, 3));
    }

    /// A communicator whose reduce-scatter is off in the last bits (as a
    /// reduction in another order would be): the check must catch it.
    fn backwards() -> crate::engine::comm::scripted::Scripted {
        crate::engine::comm::scripted::Scripted {
            gather_bytes: Some(|s, c, o| SingleRank.all_gather_bytes(s, c, o)),
            reduce_scatter: Some(|full, _, acc| {
                for (a, b) in acc.iter_mut().zip(full) {
                    *a = (0.0 + *b) + *a * (1.0 + f32::EPSILON);
                }
                Ok(())
            }),
            gather_f64: Some(|l, o| SingleRank.all_gather_f64(l, o)),
            ..crate::engine::comm::scripted::Scripted::rank_of(0, 1)
        }
    }

    #[test]
    fn a_reduction_in_another_order_fails_the_check() {
        let e = self_test(&backwards(), 16, 1).unwrap_err().to_string();
        assert!(e.contains("reduce_scatter_add_f32"), "{e}");
    }
}

//! Collectives between data-parallel ranks.
//!
//! ZeRO-3 partitions every parameter into per-rank shards ([`super::layout`]).
//! A fetch gathers the shards into the full tensor, a gradient is
//! reduce-scattered so each rank keeps the sum of its shard, and the global
//! gradient norm and the loss are all-reduced. The engine calls these
//! through [`Comm`] only, so an MPI or NCCL backend plugs in without
//! touching the step. This issue implements one rank: [`SingleRank`], where
//! every collective is the identity. Collectives must be deterministic
//! (fixed reduction order over ranks) to keep results bit-reproducible.

/// The collectives the engine needs.
pub trait Comm: Send + Sync + std::fmt::Debug {
    /// This rank, from 0.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// Concatenates every rank's `shard` (rank order) into `out`, whose
    /// length is the sum of the shard lengths.
    fn all_gather_bytes(&self, shard: &[u8], out: &mut [u8]) -> crate::engine::Result<()>;
    /// Sums `full` over ranks and keeps this rank's `[start, start+len)`
    /// part in `shard_out` (gradient reduce-scatter).
    fn reduce_scatter_f32(
        &self,
        full: &[f32],
        start: usize,
        shard_out: &mut [f32],
    ) -> crate::engine::Result<()>;
    /// Sums a scalar over ranks, in rank order.
    fn all_reduce_sum_f64(&self, x: f64) -> crate::engine::Result<f64>;
}

/// One rank: collectives are copies.
#[derive(Debug, Clone, Copy, Default)]
pub struct SingleRank;

impl Comm for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_gather_bytes(&self, shard: &[u8], out: &mut [u8]) -> crate::engine::Result<()> {
        if shard.len() != out.len() {
            return Err(crate::engine::EngineError::internal(format!(
                "all_gather: shard of {} bytes into {} bytes with one rank",
                shard.len(),
                out.len()
            )));
        }
        out.copy_from_slice(shard);
        Ok(())
    }
    fn reduce_scatter_f32(
        &self,
        full: &[f32],
        start: usize,
        shard_out: &mut [f32],
    ) -> crate::engine::Result<()> {
        let src = full.get(start..start + shard_out.len()).ok_or_else(|| {
            crate::engine::EngineError::internal("reduce_scatter: shard out of range")
        })?;
        shard_out.copy_from_slice(src);
        Ok(())
    }
    fn all_reduce_sum_f64(&self, x: f64) -> crate::engine::Result<f64> {
        Ok(x)
    }
}

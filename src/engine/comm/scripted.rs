//! [`Scripted`]: one rank of a world whose peers' answers are a unit
//! test's, for code that calls collectives (the simulated device's
//! gathers and reduces, the device budget's agreement, the self-test).
//! A collective the test does not script fails.

use super::Comm;
use crate::engine::{EngineError, Result};

/// An all-gather of bytes: (this rank's shard, counts, out).
pub(crate) type GatherBytes = fn(&[u8], &[usize], &mut [u8]) -> Result<()>;
/// A reduce-scatter: (this rank's whole, counts, running sums).
pub(crate) type ReduceScatter = fn(&[f32], &[usize], &mut [f32]) -> Result<()>;
/// An all-gather of scalars: (this rank's, out).
pub(crate) type GatherF64 = fn(&[f64], &mut [f64]) -> Result<()>;

/// Rank `rank` of `world`, its collectives the test's functions.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scripted {
    pub rank: usize,
    pub world: usize,
    pub gather_bytes: Option<GatherBytes>,
    pub reduce_scatter: Option<ReduceScatter>,
    pub gather_f64: Option<GatherF64>,
}

impl Scripted {
    /// Rank `rank` of `world` with no collective scripted.
    pub(crate) fn rank_of(rank: usize, world: usize) -> Self {
        Scripted {
            rank,
            world,
            gather_bytes: None,
            reduce_scatter: None,
            gather_f64: None,
        }
    }
}

fn unscripted(what: &str) -> EngineError {
    EngineError::internal(format!("{what}: not scripted in this test"))
}

impl Comm for Scripted {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn all_gather_bytes(&self, shard: &[u8], counts: &[usize], out: &mut [u8]) -> Result<()> {
        self.gather_bytes
            .ok_or_else(|| unscripted("all_gather_bytes"))?(shard, counts, out)
    }
    fn reduce_scatter_add_f32(
        &self,
        full: &[f32],
        counts: &[usize],
        acc: &mut [f32],
    ) -> Result<()> {
        self.reduce_scatter
            .ok_or_else(|| unscripted("reduce_scatter_add_f32"))?(full, counts, acc)
    }
    fn all_gather_f64(&self, local: &[f64], out: &mut [f64]) -> Result<()> {
        self.gather_f64
            .ok_or_else(|| unscripted("all_gather_f64"))?(local, out)
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
}

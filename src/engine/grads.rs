//! Parked gradient accumulators: with `gradient_accumulation_steps > 1` and
//! optimizer state on NVMe, a sub-group's partial gradient sum lives on
//! NVMe between micro-batches, so host memory holds only the accumulators
//! backward is adding into, never the whole model's.
//!
//! # Life of a sub-group's accumulator within a step
//!
//! ```text
//!  micro-batch k < last:  Accumulating ──(its last unit's backward)──▶ park ─▶ NVMe
//!  micro-batch k + 1:     NVMe ─▶ prefetch (read issued ahead, backward order)
//!                         ─▶ take (before its first gradient is added) ─▶ Accumulating
//! ```
//!
//! A sub-group is parked after the backward of the unit that completes it
//! in this micro-batch (`SubGroup::final_after_unit`, the same point at
//! which the last micro-batch hands it to the optimizer), and taken back
//! before the next micro-batch adds to it. The values make an exact round
//! trip (fp32 bytes), and the additions happen in the same order as with
//! the sum kept in memory, so parking changes no bit.
//!
//! # Buffers and what may be in flight
//!
//! [`GradPark`] owns a pinned arena of [`PARK_BUFFERS`] buffers of the
//! largest sub-group's fp32 bytes, one extent per sub-group in its own swap
//! space, and one engine. A buffer travels with its request: a park write
//! holds its buffer until the write completes; a prefetch read holds one
//! until the sum is taken. A sub-group has at most one request in flight,
//! and its read is issued only after its write has completed (the engine
//! may reorder requests on one extent). When no buffer is free, a park
//! waits for the oldest write, then finishes and drops the read of the
//! lowest sub-group (in backward order, the newest read: the sum needed
//! last, read again at its take); a prefetch is never waited for by
//! anyone but its take, so this cannot deadlock.
//! Host memory: the accumulators being added into (the sub-groups of one
//! or two units, and a tied param's), plus these buffers.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tierzero_swap::{Engine, Extent, PinnedArena, Ticket};

use crate::engine::layout::SubGroupId;
use crate::engine::{EngineError, Result};

/// Pinned buffers of the park: one write draining, one read ahead, and
/// one each for the sub-group being parked and the one being taken.
pub const PARK_BUFFERS: u64 = 4;

/// Where one sub-group's partial sum is.
#[derive(Debug)]
enum Spot {
    /// Not parked (in host memory, or no sum yet).
    Away,
    /// Being written.
    Writing(Ticket),
    /// On NVMe, nothing in flight.
    Parked,
    /// Being read back.
    Reading(Ticket),
}

/// Counters of the park's I/O.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ParkCounters {
    /// Bytes written.
    pub written_bytes: u64,
    /// Bytes read.
    pub read_bytes: u64,
    /// Time the compute thread waited on park I/O.
    pub io_wait: Duration,
}

/// The parked partial sums of one rank (see the module docs).
#[derive(Debug)]
pub struct GradPark {
    engine: Engine,
    arena: Arc<PinnedArena>,
    extents: Vec<Extent>,
    numel: Vec<usize>,
    spots: Vec<Spot>,
    /// Sub-groups with a write in flight, oldest first.
    writing: VecDeque<SubGroupId>,
    counters: ParkCounters,
}

impl GradPark {
    /// A park for sub-groups of `numel` elements each, with one extent each
    /// allocated from `engine`'s space; `arena` holds the buffers.
    pub fn new(engine: Engine, arena: Arc<PinnedArena>, numel: Vec<usize>) -> Result<GradPark> {
        let extents = numel
            .iter()
            .map(|&n| {
                engine
                    .space()
                    .allocate(crate::engine::sizing::align_up(n as u64 * 4))
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(GradPark {
            engine,
            arena,
            extents,
            spots: numel.iter().map(|_| Spot::Away).collect(),
            numel,
            writing: VecDeque::new(),
            counters: ParkCounters::default(),
        })
    }

    /// The counters so far.
    pub fn counters(&self) -> ParkCounters {
        self.counters
    }

    /// Whether `sg`'s sum is parked (written, being written or being read).
    pub fn is_parked(&self, sg: SubGroupId) -> bool {
        !matches!(self.spots.get(sg.0), Some(Spot::Away) | None)
    }

    fn extent(&self, sg: SubGroupId) -> Result<Extent> {
        self.extents
            .get(sg.0)
            .cloned()
            .ok_or_else(|| EngineError::internal(format!("no park extent for sub-group {}", sg.0)))
    }

    /// Writes `sum` (the whole sub-group) to NVMe; host memory is free
    /// once this returns.
    pub fn park(&mut self, sg: SubGroupId, sum: &[f32]) -> Result<()> {
        let n = self.numel.get(sg.0).copied().unwrap_or(usize::MAX);
        if sum.len() != n {
            return Err(EngineError::internal(format!(
                "park of sub-group {}: {} elements for {n}",
                sg.0,
                sum.len()
            )));
        }
        if self.is_parked(sg) {
            return Err(EngineError::internal(format!(
                "sub-group {} parked twice",
                sg.0
            )));
        }
        let mut buf = self.acquire()?;
        buf.as_mut_slice()[..n * 4].copy_from_slice(bytemuck::cast_slice(sum));
        let extent = self.extent(sg)?;
        let ticket = self.engine.write(&extent, buf)?;
        self.counters.written_bytes += extent.len_bytes();
        self.spots[sg.0] = Spot::Writing(ticket);
        self.writing.push_back(sg);
        Ok(())
    }

    /// Issues the read of `sg`'s parked sum if its write has completed and
    /// a buffer is free now; never blocks. Returns whether it was issued.
    pub fn prefetch(&mut self, sg: SubGroupId) -> Result<bool> {
        self.retire_done_writes()?;
        if !matches!(self.spots.get(sg.0), Some(Spot::Parked)) {
            return Ok(false);
        }
        let Ok(buf) = self.arena.try_acquire() else {
            return Ok(false);
        };
        let extent = self.extent(sg)?;
        let ticket = self.engine.read(&extent, buf)?;
        self.counters.read_bytes += extent.len_bytes();
        self.spots[sg.0] = Spot::Reading(ticket);
        Ok(true)
    }

    /// Issues reads of the parked sums in `order` (the order backward adds
    /// to them), skipping those already read or still being written, while
    /// a buffer is free and one stays free for a park; never blocks.
    pub fn prefetch_in(&mut self, order: &[SubGroupId]) -> Result<()> {
        self.retire_done_writes()?;
        let mut reading = self
            .spots
            .iter()
            .filter(|s| matches!(s, Spot::Reading(_)))
            .count() as u64;
        for &sg in order {
            if reading + 1 >= PARK_BUFFERS || self.arena.free_count() <= 1 {
                break;
            }
            if matches!(self.spots.get(sg.0), Some(Spot::Parked)) && self.prefetch(sg)? {
                reading += 1;
            }
        }
        Ok(())
    }

    /// `sg`'s parked sum, back in host memory (waiting for its read, issued
    /// now if it was not).
    pub fn take(&mut self, sg: SubGroupId) -> Result<Vec<f32>> {
        let n = self
            .numel
            .get(sg.0)
            .copied()
            .ok_or_else(|| EngineError::internal("take of an unknown sub-group"))?;
        if matches!(self.spots.get(sg.0), Some(Spot::Writing(_))) {
            self.wait_write_of(sg)?;
        }
        if matches!(self.spots.get(sg.0), Some(Spot::Parked)) {
            let buf = self.acquire()?;
            let extent = self.extent(sg)?;
            let ticket = self.engine.read(&extent, buf)?;
            self.counters.read_bytes += extent.len_bytes();
            self.spots[sg.0] = Spot::Reading(ticket);
        }
        match std::mem::replace(&mut self.spots[sg.0], Spot::Away) {
            Spot::Reading(t) => {
                let t0 = Instant::now();
                let buf = t.wait();
                self.counters.io_wait += t0.elapsed();
                let buf = buf?;
                let bytes = buf
                    .as_slice()
                    .get(..n * 4)
                    .ok_or_else(|| EngineError::internal("park buffer smaller than its group"))?;
                bytemuck::try_cast_slice::<u8, f32>(bytes)
                    .map(<[f32]>::to_vec)
                    .map_err(|e| EngineError::internal(format!("park buffer cast: {e}")))
            }
            other => {
                self.spots[sg.0] = other;
                Err(EngineError::internal(format!(
                    "take of sub-group {} that is not parked",
                    sg.0
                )))
            }
        }
    }

    /// Moves every completed write's sub-group to `Parked`, freeing its
    /// buffer (a failed write is an error here, at the operation).
    fn retire_done_writes(&mut self) -> Result<()> {
        let mut i = 0;
        while i < self.writing.len() {
            let sg = self.writing[i];
            let done = match &self.spots[sg.0] {
                Spot::Writing(t) => t.poll(),
                _ => None,
            };
            match done {
                Some(c) => {
                    self.writing.remove(i);
                    self.spots[sg.0] = Spot::Parked;
                    c.into_result()?;
                }
                None => i += 1,
            }
        }
        Ok(())
    }

    fn wait_write_of(&mut self, sg: SubGroupId) -> Result<()> {
        if let Spot::Writing(t) = std::mem::replace(&mut self.spots[sg.0], Spot::Parked) {
            self.writing.retain(|g| *g != sg);
            let t0 = Instant::now();
            let r = t.wait();
            self.counters.io_wait += t0.elapsed();
            r?;
        }
        Ok(())
    }

    /// A free buffer: waits for the oldest write, else finishes and drops
    /// the lowest sub-group's read (see the module docs) to free one.
    fn acquire(&mut self) -> Result<tierzero_swap::Buffer> {
        loop {
            if let Ok(b) = self.arena.try_acquire() {
                return Ok(b);
            }
            self.retire_done_writes()?;
            if self.arena.free_count() > 0 {
                continue;
            }
            if let Some(&sg) = self.writing.front() {
                self.wait_write_of(sg)?;
                continue;
            }
            // Every buffer holds a prefetched read nobody has taken yet:
            // finish one and drop its buffer; the sum stays parked and is
            // read again at its take.
            let reading = self
                .spots
                .iter()
                .position(|s| matches!(s, Spot::Reading(_)));
            match reading {
                Some(i) => {
                    if let Spot::Reading(t) = std::mem::replace(&mut self.spots[i], Spot::Parked) {
                        let t0 = Instant::now();
                        let r = t.wait();
                        self.counters.io_wait += t0.elapsed();
                        drop(r?);
                    }
                }
                None => {
                    return Err(EngineError::internal(
                        "no gradient park buffer is free and none is in flight",
                    ))
                }
            }
        }
    }
}

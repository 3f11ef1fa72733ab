//! The speculative step's pool (see "Speculative steps" in
//! `crate::engine::trainer`): how many state slots it has, whether auto
//! speculation fits the disk, and the speculated gradients kept in host
//! memory.

/// What a config asks of the speculative step
/// (`tierzero.speculative_step` and `tierzero.speculation_pool_bytes`),
/// where it would speculate at all ([`super::speculates`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SpeculationAsk {
    /// No speculation: `speculative_step: false`, or nothing spills.
    Off,
    /// Neither set: a slot for every NVMe group within half the room, and
    /// off when even the least pool does not fit it.
    Auto,
    /// `speculative_step: true` without a pool size: as auto, but never
    /// off (a disk too small is then refused with the numbers).
    On,
    /// `speculation_pool_bytes` set: the slots these bytes buy.
    PoolBytes(u64),
}

impl SpeculationAsk {
    /// The ask of a config where `spills` says whether its final gradients
    /// would spill (the step waits for the norm, [`super::spills_grads`]),
    /// with `speculative_step` and `pool_bytes` its two keys (`None`:
    /// auto); `speculative_step: false` is off.
    pub fn new(spills: bool, speculative_step: Option<bool>, pool_bytes: Option<u64>) -> Self {
        match (spills, speculative_step, pool_bytes) {
            (false, _, _) | (_, Some(false), _) => SpeculationAsk::Off,
            (true, _, Some(b)) => SpeculationAsk::PoolBytes(b),
            (true, None, None) => SpeculationAsk::Auto,
            (true, Some(true), None) => SpeculationAsk::On,
        }
    }
}

/// The speculation pool a run has ([`speculation_pool`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpeculationPool {
    /// State slots; 0 without speculation.
    pub slots: usize,
    /// Auto speculation turned off because its least pool (these bytes)
    /// does not fit half the room; `None` otherwise.
    pub off_for_room_bytes: Option<u64>,
}

/// The speculation pool for `ask`, where a slot is one largest NVMe
/// sub-group's three state extents (`slot_bytes`):
///
/// * [`SpeculationAsk::PoolBytes`] buys `pool_bytes / slot_bytes` slots,
///   at least one and at most `nvme_groups`.
/// * [`SpeculationAsk::Auto`] and [`SpeculationAsk::On`]: a slot for
///   every NVMe group, so that every group backward finishes can step
///   before the norm is known, as without clipping; with `room_bytes`
///   (the free space of the state's file system less the run's other swap
///   extents, when known) at most what half of it buys, leaving the rest
///   for checkpoints and other files, and never fewer than the pipeline's
///   depth ([`speculation_slots`]).
/// * Under [`SpeculationAsk::Auto`], when even that least pool does not
///   fit `room_bytes`, speculation is off rather than the run refused for
///   a disk its state fits without it: the result is the same bits, the
///   step only waits for the norm.
///
/// The pool is the price of an exact speculation: the old state must
/// survive until the decision, so every group that steps before it needs
/// a second set of extents. With the pipeline's depth alone, the overlap
/// harness at `CLIP=1` ran at 1.358× its slowest phase, against 1.288×
/// without speculation and 1.053× with every group (docs/decisions/overlap.md).
pub fn speculation_pool(
    ask: SpeculationAsk,
    read_ahead: usize,
    write_behind: usize,
    nvme_groups: usize,
    slot_bytes: u64,
    room_bytes: Option<u64>,
) -> SpeculationPool {
    let pool = |slots: usize| SpeculationPool {
        slots,
        off_for_room_bytes: None,
    };
    if nvme_groups == 0 {
        return pool(0);
    }
    let buys = |b: u64| {
        usize::try_from(b.checked_div(slot_bytes).unwrap_or(u64::MAX)).unwrap_or(usize::MAX)
    };
    match ask {
        SpeculationAsk::Off => pool(0),
        SpeculationAsk::PoolBytes(b) => pool(buys(b).clamp(1, nvme_groups)),
        SpeculationAsk::Auto | SpeculationAsk::On => {
            let floor = speculation_slots(true, read_ahead, write_behind, nvme_groups);
            let Some(room) = room_bytes else {
                return pool(nvme_groups);
            };
            let slots = buys(room / 2).min(nvme_groups);
            match ask {
                // Never past half the room, the rest left for checkpoints
                // (a least pool raised to the whole room left a save on the
                // same disk no space: the run trained, then failed at it).
                SpeculationAsk::Auto if slots < floor => SpeculationPool {
                    slots: 0,
                    off_for_room_bytes: Some((floor as u64).saturating_mul(slot_bytes)),
                },
                _ => pool(slots.max(floor)),
            }
        }
    }
}

/// The least pool auto gives: one sub-group pipeline's worth of state in
/// flight, `1 + read_ahead + write_behind` sub-groups (as many as the
/// optimizer pipeline holds at once, [`super::buffers_needed`]), at most the NVMe
/// sub-groups; 0 without speculation.
pub fn speculation_slots(
    speculative: bool,
    read_ahead: usize,
    write_behind: usize,
    nvme_groups: usize,
) -> usize {
    if speculative {
        (1 + read_ahead + write_behind).min(nvme_groups)
    } else {
        0
    }
}

/// Speculated gradients the optimizer thread keeps in host memory for a
/// re-step should the speculation miss: the pipeline's depth
/// ([`speculation_slots`]), at most the pool's slots. Beyond that they are
/// written to their spill extents (which every NVMe group has when the
/// step speculates), so host memory stays bounded by the config however
/// large the pool: a hit costs those gradients' write, a miss reads them
/// back.
pub fn speculation_kept_grads(read_ahead: usize, write_behind: usize, pool_slots: usize) -> usize {
    (1 + read_ahead + write_behind).min(pool_slots)
}

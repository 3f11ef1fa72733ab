//! The speculative step's pool (see "Speculative steps" in
//! `crate::engine::trainer`): how many state slots it has, whether auto
//! speculation fits the disk, and the speculated gradients kept in host
//! memory.

/// The speculation pool's slots with `tierzero.speculation_pool_bytes`.
///
/// * A byte count buys `pool_bytes / slot_bytes` slots (a slot is one
///   largest NVMe sub-group's three state extents), at least one and at
///   most `nvme_groups`.
/// * `None` (auto): a slot for every NVMe group, so that every group
///   backward finishes can step before the norm is known, as without
///   clipping; with `room_bytes` (the free space of the state's file
///   system less the run's other swap extents, when known) at most what
///   half of it buys, leaving the rest for checkpoints and other files,
///   and never fewer than the pipeline's depth ([`speculation_slots`]).
///
/// The pool is the price of an exact speculation: the old state must
/// survive until the decision, so every group that steps before it needs
/// a second set of extents. With the pipeline's depth alone, the overlap
/// harness at `CLIP=1` ran at 1.358× its slowest phase, against 1.288×
/// without speculation and 1.053× with every group (docs/decisions/overlap.md).
/// 0 without speculation.
pub fn speculation_pool_slots(
    speculative: bool,
    read_ahead: usize,
    write_behind: usize,
    nvme_groups: usize,
    pool_bytes: Option<u64>,
    slot_bytes: u64,
    room_bytes: Option<u64>,
) -> usize {
    if !speculative || nvme_groups == 0 {
        return 0;
    }
    let buys = |b: u64| {
        usize::try_from(b.checked_div(slot_bytes).unwrap_or(u64::MAX)).unwrap_or(usize::MAX)
    };
    match pool_bytes {
        Some(b) => buys(b).clamp(1, nvme_groups),
        None => {
            let floor = speculation_slots(true, read_ahead, write_behind, nvme_groups);
            match room_bytes {
                Some(room) => buys(room / 2).clamp(floor, nvme_groups),
                None => nvme_groups,
            }
        }
    }
}

/// Whether an auto speculation pool of `pool_bytes` fits `room_bytes`
/// (the free space the optimizer state's file system has beside the run's
/// other swap extents; `None`: not known, taken as fitting). When even
/// the least pool does not, auto speculation is off rather than the run
/// refused for a disk its state fits without it: the result is the same
/// bits, the step only waits for the norm.
pub fn speculation_fits_the_room(pool_bytes: u64, room_bytes: Option<u64>) -> bool {
    room_bytes.is_none_or(|room| pool_bytes <= room)
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

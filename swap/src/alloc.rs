//! The extent allocator: aligned byte ranges inside one swap file.
//!
//! Free space is a `BTreeMap` from offset to length of maximal free ranges
//! (adjacent free ranges are always merged). Allocation is first-fit by
//! offset, which keeps allocations packed at the start of the file, where a
//! fresh run writes them in order and reads them back sequentially. All
//! offsets and lengths are multiples of the alignment, so every extent can
//! be read and written with O_DIRECT.

use std::collections::BTreeMap;

use crate::align::Alignment;

/// A free-space map over `[0, capacity_bytes)`.
#[derive(Debug, Clone)]
pub struct ExtentAllocator {
    alignment: Alignment,
    capacity_bytes: u64,
    free_bytes: u64,
    /// offset -> length of free ranges; never adjacent, never overlapping.
    free: BTreeMap<u64, u64>,
}

impl ExtentAllocator {
    /// An allocator over `capacity_bytes` (rounded down to the alignment).
    pub fn new(capacity_bytes: u64, alignment: Alignment) -> Self {
        let cap = capacity_bytes - capacity_bytes % alignment.bytes();
        let mut free = BTreeMap::new();
        if cap > 0 {
            free.insert(0, cap);
        }
        ExtentAllocator {
            alignment,
            capacity_bytes: cap,
            free_bytes: cap,
            free,
        }
    }

    /// Total bytes managed.
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    /// Bytes not allocated.
    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// The largest single free range.
    pub fn largest_free_bytes(&self) -> u64 {
        self.free.values().copied().max().unwrap_or(0)
    }

    /// Allocates `len_bytes` (rounded up to the alignment); returns the offset.
    pub fn allocate(&mut self, len_bytes: u64) -> Option<u64> {
        let len = self.alignment.round_up(len_bytes.max(1));
        let (&off, &flen) = self.free.iter().find(|(_, &l)| l >= len)?;
        self.free.remove(&off);
        if flen > len {
            self.free.insert(off + len, flen - len);
        }
        self.free_bytes -= len;
        Some(off)
    }

    /// Returns `[offset, offset + len_bytes)` (length rounded up as in
    /// `allocate`). Freeing a range that is not allocated is a bug in the
    /// caller; it is detected and ignored with `false`.
    pub fn free(&mut self, offset_bytes: u64, len_bytes: u64) -> bool {
        let len = self.alignment.round_up(len_bytes.max(1));
        let end = offset_bytes.saturating_add(len);
        if end > self.capacity_bytes || !self.alignment.is_aligned(offset_bytes) {
            return false;
        }
        // Must not overlap the free range before or after.
        let prev = self
            .free
            .range(..=offset_bytes)
            .next_back()
            .map(|(&o, &l)| (o, l));
        if let Some((po, pl)) = prev {
            if po + pl > offset_bytes {
                return false;
            }
        }
        let next = self
            .free
            .range(offset_bytes..)
            .next()
            .map(|(&o, &l)| (o, l));
        if let Some((no, _)) = next {
            if no < end {
                return false;
            }
        }
        let mut start = offset_bytes;
        let mut length = len;
        if let Some((po, pl)) = prev {
            if po + pl == offset_bytes {
                self.free.remove(&po);
                start = po;
                length += pl;
            }
        }
        if let Some((no, nl)) = next {
            if no == end {
                self.free.remove(&no);
                length += nl;
            }
        }
        self.free.insert(start, length);
        self.free_bytes += len;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const A: u64 = 4096;

    #[test]
    fn allocate_free_merge() {
        let mut a = ExtentAllocator::new(10 * A, Alignment::new(A));
        let x = a.allocate(1).unwrap_or(u64::MAX);
        let y = a.allocate(2 * A).unwrap_or(u64::MAX);
        let z = a.allocate(A + 1).unwrap_or(u64::MAX);
        assert_eq!((x, y, z), (0, A, 3 * A));
        assert_eq!(a.free_bytes(), 5 * A);
        assert!(a.free(y, 2 * A));
        assert!(!a.free(y, 2 * A), "double free must be refused");
        assert!(a.free(x, A));
        assert_eq!(a.largest_free_bytes(), 5 * A);
        assert!(a.free(z, A + 1));
        assert_eq!(a.free_bytes(), 10 * A);
        assert_eq!(a.largest_free_bytes(), 10 * A);
        assert_eq!(a.allocate(11 * A), None);
    }

    proptest! {
        /// Random allocate/free sequences never hand out overlapping or
        /// misaligned ranges, and free space is conserved.
        #[test]
        fn never_overlaps(ops in proptest::collection::vec((any::<bool>(), 1u64..40_000, any::<prop::sample::Index>()), 1..200)) {
            let cap = 64 * A;
            let mut a = ExtentAllocator::new(cap, Alignment::new(A));
            let mut live: Vec<(u64, u64)> = Vec::new();
            for (alloc, len, pick) in ops {
                if alloc || live.is_empty() {
                    if let Some(off) = a.allocate(len) {
                        let l = len.div_ceil(A) * A;
                        prop_assert_eq!(off % A, 0);
                        prop_assert!(off + l <= cap);
                        for &(o, ol) in &live {
                            prop_assert!(off + l <= o || o + ol <= off, "overlap");
                        }
                        live.push((off, l));
                    } else {
                        prop_assert!(a.largest_free_bytes() < len.div_ceil(A) * A);
                    }
                } else {
                    let (o, l) = live.swap_remove(pick.index(live.len()));
                    prop_assert!(a.free(o, l));
                }
                let used: u64 = live.iter().map(|&(_, l)| l).sum();
                prop_assert_eq!(a.free_bytes() + used, cap);
            }
            for (o, l) in live.drain(..) {
                prop_assert!(a.free(o, l));
            }
            prop_assert_eq!(a.largest_free_bytes(), cap);
        }
    }
}

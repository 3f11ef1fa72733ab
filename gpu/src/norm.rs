//! The clipping norm's sum of squares, in the host optimizer's order
//! (`tierzero`'s `optim::norm`): what the `sumsq_parts` kernel
//! ([`crate::ops::sumsq_parts`]) and its reference
//! ([`crate::reference::sumsq_parts`]) compute, and the checked plan
//! both read. The device's Σg² is then the host's bits, so training in
//! device memory (Adam there) clips exactly as the offloaded optimizer
//! does.
//!
//! # The order
//!
//! A norm is taken over **groups** (the optimizer's sub-groups), each a
//! flat run of `numel` f32 elements. On the device those elements are
//! **segments** of several buffers: a sub-group packs params' gradients
//! one after the other, and a param larger than a sub-group is cut over
//! several. An element no segment holds is a zero (it adds nothing).
//!
//! * A group is cut into **parts** of `part_numel` elements (the last
//!   shorter): part `p` is flat elements `p · part_numel ..`.
//! * In a part, lane `j` of [`NORM_LANES`] (8) adds, in order, the
//!   squares of elements `j, j + 8, j + 16, …` in f64 with a fused
//!   multiply-add (the square of an f32 is exact in f64, so each step is
//!   `acc + g²` rounded once).
//! * The lanes are added pairwise: `((0 + 1) + (2 + 3)) + ((4 + 5) + (6 +
//!   7))`, which is an xor butterfly over 8 lanes of a warp, 1 first
//!   (`a + b == b + a` in IEEE arithmetic).
//! * The group's sum is its parts' sums added in order, from 0
//!   ([`fold_parts`]).
//!
//! Everything here is f64, so nothing is lost to an f32 accumulator; the
//! sum is inf or NaN exactly when some element is, which is also the fp16
//! overflow check. A finite sum is the same bits on the host and the
//! device; a NaN is a NaN on both, its payload perhaps not (a GPU's
//! arithmetic gives the canonical NaN, x86 passes an operand's on), which
//! changes nothing: the step is skipped either way. The part length is the caller's (the host optimizer's
//! constant). Eight lanes are two AVX2 vectors of f64 on the host (32
//! lanes ran 1.3 times slower there); on the GPU a warp takes four parts,
//! each load of a part's 8 lanes one 32-byte sector.

use crate::{GpuError, Result};

/// Lanes of a part.
pub const NORM_LANES: usize = 8;

/// `numel` elements of `buf` from element `offset`, which are flat
/// elements `flat_start ..` of their group.
#[derive(Debug)]
pub struct NormSegment<'a, B> {
    /// The buffer.
    pub buf: &'a B,
    /// Its first element here.
    pub offset: usize,
    /// Elements.
    pub numel: usize,
    /// Where they start in the group.
    pub flat_start: usize,
}

/// One group of a norm: `numel` flat elements cut into parts of
/// `part_numel`, held by `segments` (in flat order, disjoint, inside the
/// group and their buffers: [`NormPlan::new`] checks it).
#[derive(Debug)]
pub struct NormGroup<'a, B> {
    /// Flat elements.
    pub numel: usize,
    /// Elements per part.
    pub part_numel: usize,
    /// The elements there are (the rest are zeros).
    pub segments: Vec<NormSegment<'a, B>>,
}

impl<'a, B> NormGroup<'a, B> {
    /// The same group over other buffers: `f` of each segment's.
    pub fn try_map_bufs<C, E>(
        &self,
        f: impl Fn(&'a B) -> std::result::Result<&'a C, E>,
    ) -> std::result::Result<NormGroup<'a, C>, E> {
        let segments = self
            .segments
            .iter()
            .map(|s| {
                Ok(NormSegment {
                    buf: f(s.buf)?,
                    offset: s.offset,
                    numel: s.numel,
                    flat_start: s.flat_start,
                })
            })
            .collect::<std::result::Result<Vec<_>, E>>()?;
        Ok(NormGroup {
            numel: self.numel,
            part_numel: self.part_numel,
            segments,
        })
    }

    /// Its parts.
    pub fn parts(&self) -> usize {
        self.numel.div_ceil(self.part_numel.max(1))
    }
}

/// The checked layout of a norm over groups: what the kernel reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NormPlan {
    /// Per part, 4 values: its flat start and end in its group, and its
    /// segments `first .. end` (indices into [`NormPlan::segments`]).
    pub parts: Vec<i64>,
    /// The non-empty segments in order: `(group, index in the group)`.
    pub segments: Vec<(usize, usize)>,
    /// Parts per group.
    pub group_parts: Vec<usize>,
}

fn plan_err(detail: String) -> GpuError {
    GpuError::Shape {
        kernel: "sumsq_parts".into(),
        detail,
    }
}

impl NormPlan {
    /// The plan of `groups`, once every part length is at least 1 and
    /// every segment lies inside its group and its buffer (`len`), the
    /// segments of a group in flat order without overlap.
    pub fn new<B>(groups: &[NormGroup<'_, B>], len: impl Fn(&B) -> usize) -> Result<Self> {
        let mut plan = NormPlan {
            parts: Vec::new(),
            segments: Vec::new(),
            group_parts: Vec::with_capacity(groups.len()),
        };
        for (gi, g) in groups.iter().enumerate() {
            if g.part_numel == 0 {
                return Err(plan_err(format!("group {gi} has parts of 0 elements")));
            }
            // The group's non-empty segments, checked, as (flat start,
            // flat end, global index).
            let first = plan.segments.len();
            let mut at = 0usize;
            for (si, s) in g.segments.iter().enumerate() {
                let end = s.flat_start.checked_add(s.numel);
                let in_buf = s.offset.checked_add(s.numel);
                if s.flat_start < at || end.is_none_or(|e| e > g.numel) {
                    return Err(plan_err(format!(
                        "group {gi}'s segment {si} (elements {} + {} of a group of {}) \
                         overlaps the one before or leaves the group",
                        s.flat_start, s.numel, g.numel
                    )));
                }
                if in_buf.is_none_or(|e| e > len(s.buf)) {
                    return Err(plan_err(format!(
                        "group {gi}'s segment {si} reads elements {} + {} of a buffer of {}",
                        s.offset,
                        s.numel,
                        len(s.buf)
                    )));
                }
                if s.numel > 0 {
                    plan.segments.push((gi, si));
                    at = s.flat_start + s.numel;
                }
            }
            let spans: Vec<(usize, usize)> = plan.segments[first..]
                .iter()
                .map(|&(_, si)| {
                    let s = &g.segments[si];
                    (s.flat_start, s.flat_start + s.numel)
                })
                .collect();
            // Each part's segments: those ending after its start and
            // starting before its end (a cursor over both, in order).
            let (mut lo, mut hi) = (0usize, 0usize);
            for p in 0..g.parts() {
                let a = p * g.part_numel;
                let b = (a + g.part_numel).min(g.numel);
                while lo < spans.len() && spans[lo].1 <= a {
                    lo += 1;
                }
                hi = hi.max(lo);
                while hi < spans.len() && spans[hi].0 < b {
                    hi += 1;
                }
                plan.parts
                    .extend([a, b, first + lo, first + hi].map(|v| v as i64));
            }
            plan.group_parts.push(g.parts());
        }
        Ok(plan)
    }

    /// Parts in all.
    pub fn total_parts(&self) -> usize {
        self.parts.len() / 4
    }
}

/// A group's sum from its parts' sums: added in order, from 0.
pub fn fold_parts(parts: &[f64]) -> f64 {
    parts.iter().fold(0.0, |s, &p| s + p)
}

/// Each group's sum from every part's sum (`parts` in plan order).
pub fn fold_groups(plan: &NormPlan, parts: &[f64]) -> Vec<f64> {
    let mut at = 0;
    plan.group_parts
        .iter()
        .map(|&n| {
            let s = fold_parts(&parts[at..at + n]);
            at += n;
            s
        })
        .collect()
}

/// The lanes added pairwise, neighbours first: `((0 + 1) + (2 + 3)) +
/// ((4 + 5) + (6 + 7))` (the kernel's xor butterfly, 1, 2, then 4).
pub fn combine_lanes(acc: [f64; NORM_LANES]) -> f64 {
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
}

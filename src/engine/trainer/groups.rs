//! One typed state per sub-group within a step ([`GroupStep`]), moved
//! only by [`GroupEvent`]s through [`StepGroups::apply`] (see "A step" in
//! the trainer's module docs).

use std::ops::Range;

use super::*;
use crate::engine::optimizer::GradBuf;
use crate::engine::sizing::SumDtype;
use crate::model::exec_units::HostElems;

/// Where one sub-group stands within a step. A step keeps exactly one of
/// these per sub-group ([`StepGroups`]), moved only by [`GroupEvent`]s
/// (see "A step" in the module docs):
///
/// ```text
/// Parked ◀──Park── Accumulating ──Norm──▶ Normed ──Spill──▶ Spilled
///   └────Unpark─────▶ │                   │  └──Speculate──▶ Speculated
///                     └──────Send─────────┴───────Send─────────┴──▶ Sent
/// ```
///
/// (`Park`/`Unpark`: between micro-batches, the partial sum waits on NVMe,
/// see `crate::engine::grads`.)
///
/// (`Send` from `Spilled` and `Speculated` hands on no gradient: the
/// optimizer thread has it.)
#[derive(Debug)]
pub(super) enum GroupStep {
    /// Backward adds gradients into its accumulator (`None` until the
    /// first one): fp32 sums, or bf16 gradients set once
    /// ([`crate::engine::sizing::grad_sum_dtype`]).
    Accumulating(Option<GradSum>),
    /// Between micro-batches: its partial sum is in the gradient park.
    Parked,
    /// Its gradients are final and its Σg² taken; the gradient waits in
    /// memory for the step (clipping or an overflow check).
    Normed { grad: Option<GradBuf>, sq: f64 },
    /// Final with its Σg² taken; the gradient was spilled to NVMe and is
    /// read back with the state.
    Spilled { sq: f64 },
    /// Final with its Σg² taken; stepped speculatively (no clip, no
    /// overflow) on the optimizer thread, which keeps the gradient for a
    /// re-step.
    Speculated { sq: f64 },
    /// Its step was sent to the optimizer thread.
    Sent,
}

/// What can happen to a sub-group within a step.
#[derive(Debug)]
pub(super) enum GroupEvent {
    /// Its partial sum goes to the gradient park (returned by
    /// [`StepGroups::apply`]) until the next micro-batch adds to it.
    Park,
    /// Its partial sum is back from the park.
    Unpark(Vec<f32>),
    /// Its Σg² was taken (its gradients are final).
    Norm(f64),
    /// Its gradient goes to NVMe (returned by [`StepGroups::apply`]).
    Spill,
    /// Its step goes to the optimizer thread with the gradient returned
    /// by [`StepGroups::apply`] (zeros if none came; `None` if spilled).
    Send,
    /// Its speculative step goes to the optimizer thread with the
    /// gradient returned by [`StepGroups::apply`].
    Speculate,
}

/// The least sum kept as a spare: the size from which the heap maps a
/// block of its own (`crate::engine::host::heap::MMAP_THRESHOLD_BYTES`).
pub(in crate::engine) const SPARE_MIN_BYTES: usize =
    crate::engine::host::heap::MMAP_THRESHOLD_BYTES;

/// Gradient sums (fp32, or bf16 gradients: [`GradBuf`]) kept from one
/// step for the next, those of [`SPARE_MIN_BYTES`] or more: a
/// sub-group's sum made from a spare keeps its pages, and its first gradients are set into it ([`GradSum`]), where
/// a new block that size is a fresh `mmap` whose pages fault in as it is
/// zeroed (and are unmapped again when it is freed). Smaller sums come
/// from the heap, which keeps freed blocks mapped
/// (`crate::engine::host::heap`) and reuses them for other buffers too:
/// spares of those held 8 sub-groups of 200 MB through the step on
/// `scripts/sim_offload_ab.sh` and the optimizer's spans doubled (its
/// other buffers grew the heap instead; measured again with the set
/// first gradients and the optimizer's output buffers given back: the
/// gradients' adds took 0.6x the time, but the whole step 1.2-1.4x; both
/// times against a build patched so that
/// `TrainerOptions::spare_sum_min_bytes` defaults to 0, which no command
/// of the repo sets: stop 51's figures, not reproducible as they stand),
/// where with one sub-group of
/// 1.25 GB (`SUB_GROUP_SIZE=1e9`, DeepSpeed's default size) they are what
/// keeps the sum's pages. One 45M-element block's bf16 gradient into a new
/// (faulting) sum took 65 ms on 2 cores, into one whose pages were in
/// place 14 ms (`cargo bench --bench grad_accumulate`). A spare comes back
/// with the optimizer thread's reply
/// ([`crate::engine::optimizer::Done::Stepped`]'s `spent`), and at most
/// `max` are kept ([`crate::engine::sizing::host_grad_bound_groups`], as many as
/// the plan's gradient bound counts). A new sum is made only when no spare
/// holds it, and then one spare is freed first, so spares and sums in use
/// are never more buffers than were in use at once, each at most the
/// largest sub-group.
#[derive(Debug, Default)]
pub(in crate::engine) struct SpareSums {
    spares: Vec<GradBuf>,
    max: usize,
    min_bytes: usize,
}

impl SpareSums {
    /// Keeps at most `max` spares of `min_bytes` or more.
    pub(in crate::engine) fn with_min(max: usize, min_bytes: usize) -> SpareSums {
        SpareSums {
            spares: Vec::new(),
            max,
            min_bytes,
        }
    }

    /// A sum of `numel` elements held as `dtype`: the smallest spare of
    /// that dtype that holds them, its old values left in place
    /// ([`GradSum`] knows them stale), else a new one of `+0.0`s (one
    /// spare freed). A bf16 one is always stale until set: its elements
    /// take one gradient each.
    pub(in crate::engine) fn take(&mut self, numel: usize, dtype: SumDtype) -> GradSum {
        let fit = self
            .spares
            .iter()
            .enumerate()
            .filter(|(_, v)| v.dtype() == dtype && v.capacity() >= numel)
            .min_by_key(|(_, v)| v.capacity())
            .map(|(i, _)| i);
        let Some(i) = fit else {
            // None holds it (a smaller one is left): one spare goes, so
            // the buffers do not outgrow those in use at once.
            self.spares.pop();
            return match dtype {
                SumDtype::F32 => GradSum::whole(crate::model::fused::zeros_f32(numel)),
                SumDtype::Bf16 => {
                    GradSum::stale(GradBuf::Bf16(crate::model::fused::zeros_bf16(numel)))
                }
            };
        };
        // Within its capacity: no new pages (a longer one's, touched).
        let v = match self.spares.swap_remove(i) {
            GradBuf::F32(mut v) => {
                v.resize(numel, 0.0);
                GradBuf::F32(v)
            }
            GradBuf::Bf16(mut v) => {
                v.resize(numel, half::bf16::ZERO);
                GradBuf::Bf16(v)
            }
        };
        GradSum::stale(v)
    }

    /// Keeps `v` for a later sum if it is `min_bytes` or more
    /// ([`SPARE_MIN_BYTES`] in training unless
    /// `TrainerOptions::spare_sum_min_bytes` says otherwise) and fewer
    /// than `max` are kept; else frees it.
    pub(in crate::engine) fn give(&mut self, v: GradBuf) {
        let bytes = v.capacity_bytes();
        if self.spares.len() < self.max && bytes > 0 && bytes >= self.min_bytes {
            self.spares.push(v);
        }
    }

    /// Spares kept.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.spares.len()
    }
}

/// A sub-group's gradient sum while backward adds into it. One made
/// from a spare ([`SpareSums::take`]) still holds the spare's old values:
/// each piece's first gradient is *set* into it
/// ([`crate::model::fused::set_grad_into`], the bits of an add onto
/// `+0.0`) instead of added, and the elements no piece wrote (padding, a
/// param that got no gradient) are zeroed when the sum is read
/// ([`GradSum::settled`], [`GradSum::into_settled`]). A spare's sum is so
/// one write per element where a zero fill then an add was a write, a
/// read and a write: 8 bytes an element less for the first micro-batch.
///
/// A bf16 sum ([`SumDtype::Bf16`]) holds each element's one gradient as
/// it came ([`GradSum::put`] copies it: 2 bytes an element written, not
/// 4, and 2 read by the norm and the step), which the optimizer reads as
/// its fp32 sum. Should a second gradient come for an element, or one
/// that is not bf16 (neither does where `grad_sum_dtype` chose bf16), the
/// sum is widened to fp32 first ([`GradSum::widen`]): the same bits, at
/// fp32's memory.
#[derive(Debug)]
pub(in crate::engine) struct GradSum {
    values: GradBuf,
    /// `None`: every element is a sum (or `+0.0`). `Some`: the ranges
    /// written since the sum was taken (start → end, disjoint); the rest
    /// holds stale values.
    written: Option<BTreeMap<usize, usize>>,
}

impl GradSum {
    /// fp32 `values`, every one a sum (or `+0.0`).
    pub(in crate::engine) fn whole(values: Vec<f32>) -> GradSum {
        GradSum {
            values: GradBuf::F32(values),
            written: None,
        }
    }

    /// `values` whose old contents are stale: nothing written yet.
    fn stale(values: GradBuf) -> GradSum {
        GradSum {
            values,
            written: Some(BTreeMap::new()),
        }
    }

    /// How it holds its values.
    #[cfg(test)]
    fn dtype(&self) -> SumDtype {
        self.values.dtype()
    }

    /// A bf16 sum made fp32 (`+0.0 + g` each, the bits of its sums; the
    /// stale elements stay stale).
    fn widen(&mut self) {
        if let GradBuf::Bf16(v) = &self.values {
            self.values = GradBuf::F32(crate::model::fused::bf16_sums_to_f32(v));
        }
    }

    /// The elements `range` (a piece's), and whether they are stale: then
    /// the caller writes every one before any is read (sets its first
    /// gradient). From now on they count as written. A range that
    /// overlaps another written one without being it is an error: pieces
    /// are disjoint. A bf16 sum is widened to fp32 first.
    pub(in crate::engine) fn piece(&mut self, range: Range<usize>) -> Result<(&mut [f32], bool)> {
        let stale = self.mark(range.clone())?;
        self.widen();
        // `mark` checked the range against the sum.
        match &mut self.values {
            GradBuf::F32(values) => values
                .get_mut(range)
                .map(|slice| (slice, stale))
                .ok_or_else(|| EngineError::internal("a checked piece out of its sum")),
            GradBuf::Bf16(_) => Err(EngineError::internal("a gradient sum not widened")),
        }
    }

    /// Puts a gradient's elements (`src`, as they are stored: a host
    /// tensor's, or where a device's copy landed them) from `offset` into
    /// `range`: set if they are stale, else added (a bf16 sum is widened
    /// for the add, or for a gradient that is not bf16).
    pub(in crate::engine) fn put(
        &mut self,
        range: Range<usize>,
        src: HostElems<'_>,
        offset: usize,
    ) -> Result<()> {
        if range.is_empty() {
            // An empty piece (a param of no elements here): nothing to
            // put, and no reason to widen a bf16 sum.
            return self.mark(range).map(|_| ());
        }
        if let (GradBuf::Bf16(_), HostElems::Bf16(g)) = (&self.values, src) {
            let stale = self.mark(range.clone())?;
            if let (GradBuf::Bf16(values), true) = (&mut self.values, stale) {
                let dst = values
                    .get_mut(range)
                    .ok_or_else(|| EngineError::internal("a bf16 gradient out of its sum"))?;
                crate::model::fused::copy_bf16_elems_into(dst, g, offset)?;
                return Ok(());
            }
        }
        let (dst, stale) = self.piece(range)?;
        if stale {
            crate::model::fused::set_grad_elems_into(dst, src, offset)?;
        } else {
            crate::model::fused::add_grad_elems_into(dst, src, offset)?;
        }
        Ok(())
    }

    /// Whether [`GradSum::piece`] of `range` would say stale, without
    /// marking it written: a caller that will set the whole range need
    /// not read (or zero) it first. Nothing is checked; `piece` checks.
    pub(in crate::engine) fn is_stale(&self, range: Range<usize>) -> bool {
        self.written
            .as_ref()
            .is_some_and(|w| !range.is_empty() && w.get(&range.start) != Some(&range.end))
    }

    /// Checks `range` against the sum and the pieces written, and marks it
    /// written; returns whether it was stale.
    fn mark(&mut self, range: Range<usize>) -> Result<bool> {
        let len = self.values.len();
        let bad = || {
            EngineError::internal(format!(
                "gradient elements {}..{} of a sum of {len}",
                range.start, range.end
            ))
        };
        if range.start > range.end || range.end > len {
            return Err(bad());
        }
        let stale = match &mut self.written {
            Some(w) if !range.is_empty() && w.get(&range.start) != Some(&range.end) => {
                let before = w.range(..range.start).next_back();
                let after = w.range(range.start..).next();
                if before.is_some_and(|(_, &end)| end > range.start)
                    || after.is_some_and(|(&start, _)| start < range.end)
                {
                    return Err(EngineError::internal(format!(
                        "gradient elements {}..{} overlap a piece written before",
                        range.start, range.end
                    )));
                }
                w.insert(range.start, range.end);
                true
            }
            _ => false,
        };
        Ok(stale)
    }

    /// Every element a sum: the ones no piece wrote are zeroed.
    pub(in crate::engine) fn settled(&mut self) -> crate::optim::GradIn<'_> {
        if let Some(w) = self.written.take() {
            match &mut self.values {
                GradBuf::F32(v) => zero_gaps(v, &w),
                GradBuf::Bf16(v) => zero_gaps(v, &w),
            }
        }
        self.values.as_in()
    }

    /// [`GradSum::settled`]'s values.
    pub(in crate::engine) fn into_settled(mut self) -> GradBuf {
        self.settled();
        self.values
    }
}

/// `v`'s elements outside the `written` ranges (start → end, disjoint, in
/// order) set to `+0.0`.
fn zero_gaps<T: Copy + Default + Send>(v: &mut [T], written: &BTreeMap<usize, usize>) {
    let len = v.len();
    let mut at = 0;
    for (&start, &end) in written.iter().chain([(&len, &len)]) {
        if let Some(gap) = v.get_mut(at..start) {
            crate::model::fused::fill_zeros(gap);
        }
        at = at.max(end);
    }
}

/// The step state of every sub-group, in index order.
#[derive(Debug)]
pub(super) struct StepGroups {
    pub(super) groups: Vec<GroupStep>,
    /// Reduce-scatters of gradients this step issued.
    pub(super) grad_reduces: u64,
}

impl StepGroups {
    pub(super) fn new(n: usize) -> StepGroups {
        StepGroups {
            groups: (0..n).map(|_| GroupStep::Accumulating(None)).collect(),
            grad_reduces: 0,
        }
    }

    pub(super) fn get_mut(&mut self, sg: SubGroupId) -> Result<&mut GroupStep> {
        self.groups
            .get_mut(sg.0)
            .ok_or_else(|| EngineError::internal(format!("no sub-group {}", sg.0)))
    }

    /// Whether the elements `range` of `sg`'s sum hold gradients summed
    /// this step ([`GradSum::is_stale`] not): false while `sg` has no sum
    /// yet, for an empty range, and outside accumulation (where taking
    /// the sum is the error).
    pub(super) fn summed(&self, sg: SubGroupId, range: Range<usize>) -> bool {
        match self.groups.get(sg.0) {
            Some(GroupStep::Accumulating(Some(sum))) => !range.is_empty() && !sum.is_stale(range),
            _ => false,
        }
    }

    /// The accumulator of `sg` (a sum of `numel` from `spares` when it is
    /// the first gradient): only while its gradients are not final.
    pub(super) fn accumulator(
        &mut self,
        sg: SubGroupId,
        numel: usize,
        dtype: SumDtype,
        spares: &std::sync::Mutex<SpareSums>,
    ) -> Result<&mut GradSum> {
        match self.get_mut(sg)? {
            GroupStep::Accumulating(acc) => Ok(match acc {
                Some(a) => a,
                None => acc.insert(
                    spares
                        .lock()
                        .map_err(|_| EngineError::internal("the spare gradient sums' lock"))?
                        .take(numel, dtype),
                ),
            }),
            other => Err(EngineError::internal(format!(
                "a gradient for sub-group {} after it became final ({})",
                sg.0,
                other.name()
            ))),
        }
    }

    /// `sg`'s Σg², taken now if not yet (`Accumulating → Normed`).
    pub(super) fn norm(&mut self, sg: SubGroupId, adam: &CpuAdam) -> Result<f64> {
        let sq = match self.get_mut(sg)? {
            GroupStep::Normed { sq, .. }
            | GroupStep::Spilled { sq }
            | GroupStep::Speculated { sq } => return Ok(*sq),
            GroupStep::Accumulating(acc) => {
                acc.as_mut().map_or(0.0, |g| adam.grad_sq_norm(g.settled()))
            }
            GroupStep::Parked => {
                return Err(EngineError::internal(format!(
                    "the norm of sub-group {} while its sum is parked",
                    sg.0
                )))
            }
            GroupStep::Sent => {
                return Err(EngineError::internal(format!(
                    "the norm of sub-group {} after its step was sent",
                    sg.0
                )))
            }
        };
        self.apply(sg, GroupEvent::Norm(sq), 0, SumDtype::F32)?;
        Ok(sq)
    }

    /// The only way a sub-group's state changes. Returns the gradient the
    /// event hands on: the parked sum (fp32) for `Park`, the spilled one
    /// for `Spill`, the step's for `Send` (`numel` zeros of `dtype`, its
    /// sums' dtype, if no gradient came; `None` once spilled).
    pub(super) fn apply(
        &mut self,
        sg: SubGroupId,
        event: GroupEvent,
        numel: usize,
        dtype: SumDtype,
    ) -> Result<Option<GradBuf>> {
        let slot = self.get_mut(sg)?;
        let old = std::mem::replace(slot, GroupStep::Sent);
        let zeros_if_none =
            |g: Option<GradBuf>| Some(g.unwrap_or_else(|| GradBuf::zeros(numel, dtype)));
        let (new, out) = match (old, event) {
            (GroupStep::Accumulating(Some(sum)), GroupEvent::Park) => (
                GroupStep::Parked,
                Some(GradBuf::F32(sum.into_settled().into_f32())),
            ),
            (GroupStep::Parked, GroupEvent::Unpark(sum)) => {
                (GroupStep::Accumulating(Some(GradSum::whole(sum))), None)
            }
            (GroupStep::Accumulating(grad), GroupEvent::Norm(sq)) => (
                GroupStep::Normed {
                    grad: grad.map(GradSum::into_settled),
                    sq,
                },
                None,
            ),
            (GroupStep::Normed { grad, sq }, GroupEvent::Spill) => {
                (GroupStep::Spilled { sq }, zeros_if_none(grad))
            }
            (GroupStep::Accumulating(grad), GroupEvent::Send) => (
                GroupStep::Sent,
                zeros_if_none(grad.map(GradSum::into_settled)),
            ),
            (GroupStep::Normed { grad, .. }, GroupEvent::Send) => {
                (GroupStep::Sent, zeros_if_none(grad))
            }
            (GroupStep::Normed { grad, sq }, GroupEvent::Speculate) => {
                (GroupStep::Speculated { sq }, zeros_if_none(grad))
            }
            (GroupStep::Spilled { .. } | GroupStep::Speculated { .. }, GroupEvent::Send) => {
                (GroupStep::Sent, None)
            }
            (old, event) => {
                let from = old.name();
                *slot = old;
                let event = match event {
                    GroupEvent::Unpark(_) => "Unpark".to_owned(),
                    other => format!("{other:?}"),
                };
                return Err(EngineError::internal(format!(
                    "sub-group {}: {event} while {from}",
                    sg.0
                )));
            }
        };
        *slot = new;
        Ok(out)
    }

    pub(super) fn is_sent(&self, sg: SubGroupId) -> bool {
        matches!(self.groups.get(sg.0), Some(GroupStep::Sent))
    }

    /// The sub-groups stepped speculatively, in index order.
    pub(super) fn speculated(&self) -> Vec<SubGroupId> {
        self.groups
            .iter()
            .enumerate()
            .filter(|(_, g)| matches!(g, GroupStep::Speculated { .. }))
            .map(|(i, _)| SubGroupId(i))
            .collect()
    }

    /// Sub-groups already handed to the optimizer thread: sent, or
    /// stepped speculatively (both went during backward when counted
    /// before the step's decision).
    pub(super) fn handed_over_count(&self) -> usize {
        self.groups
            .iter()
            .filter(|g| matches!(g, GroupStep::Sent | GroupStep::Speculated { .. }))
            .count()
    }
}

impl GroupStep {
    pub(super) fn name(&self) -> &'static str {
        match self {
            GroupStep::Accumulating(_) => "Accumulating",
            GroupStep::Parked => "Parked",
            GroupStep::Normed { .. } => "Normed",
            GroupStep::Spilled { .. } => "Spilled",
            GroupStep::Speculated { .. } => "Speculated",
            GroupStep::Sent => "Sent",
        }
    }
}

/// The gradient park's side of a step: sums parked after the unit that
/// completes them, prefetched, and taken back before the next addition.
impl Trainer {
    /// After `uid`'s backward in a micro-batch before the last: the
    /// sub-groups it completed go to the gradient park (if there is one).
    pub(super) fn park_final_groups(&mut self, uid: UnitId, groups: &mut StepGroups) -> Result<()> {
        let Some(park) = self.park.as_mut() else {
            return Ok(());
        };
        let done = self.groups_after_unit.get(uid.0).map_or(&[][..], |g| g);
        for &sg in done {
            if matches!(
                groups.groups.get(sg.0),
                Some(GroupStep::Accumulating(Some(_)))
            ) {
                if let Some(sum) = groups.apply(sg, GroupEvent::Park, 0, SumDtype::F32)? {
                    park.park(sg, &sum.into_f32())?;
                }
            }
        }
        Ok(())
    }

    /// Issues the park's reads of the sums the next units will add to, in
    /// backward order, as far as its buffers allow.
    pub(super) fn prefetch_parked(&mut self) -> Result<()> {
        match self.park.as_mut() {
            Some(park) => park.prefetch_in(&self.backward_order),
            None => Ok(()),
        }
    }

    /// The gradient park's counters (zeros without one).
    pub(super) fn park_counters(&self) -> ParkCounters {
        self.park
            .as_ref()
            .map(GradPark::counters)
            .unwrap_or_default()
    }

    /// Brings `sg`'s parked sum back into memory (no-op if not parked).
    pub(super) fn unpark(&mut self, groups: &mut StepGroups, sg: SubGroupId) -> Result<()> {
        if !matches!(groups.groups.get(sg.0), Some(GroupStep::Parked)) {
            return Ok(());
        }
        let park = self
            .park
            .as_mut()
            .ok_or_else(|| EngineError::internal("a parked sum without a park"))?;
        let sum = park.take(sg)?;
        groups.apply(sg, GroupEvent::Unpark(sum), 0, SumDtype::F32)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failure is a panic

    use super::{GradBuf, GradSum, HostElems, SpareSums, SumDtype};
    use half::bf16;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// An fp32 sum's values.
    fn f32s(g: GradBuf) -> Vec<f32> {
        match g {
            GradBuf::F32(v) => v,
            GradBuf::Bf16(_) => panic!("a bf16 sum where fp32 was asked"),
        }
    }

    fn f32_spare(v: Vec<f32>) -> GradBuf {
        GradBuf::F32(v)
    }

    /// A sum made from a spare is the spare's memory (no new block); read
    /// with nothing written, every element is `+0.0` whatever it held; the
    /// smallest spare that holds the sum is taken; a longer or shorter one
    /// is cut or grown; no more than `max` are kept, and (in training) none
    /// the heap keeps mapped itself.
    #[test]
    fn spare_sums_are_reused_zeroed_and_bounded() {
        let mut heap = SpareSums::with_min(4, super::SPARE_MIN_BYTES);
        heap.give(f32_spare(vec![1.0; 1 << 20]));
        assert_eq!(heap.len(), 0, "4 MiB: the heap's to keep");
        let mut s = SpareSums::with_min(2, 0);
        let big = vec![-1.5f32; 300_001];
        let small = vec![f32::NAN; 1000];
        let (big_at, small_at) = (big.as_ptr(), small.as_ptr());
        s.give(f32_spare(big));
        s.give(f32_spare(small));
        s.give(f32_spare(vec![7.0; 10]));
        assert_eq!(s.len(), 2, "a third spare is freed");
        let a = f32s(s.take(999, SumDtype::F32).into_settled());
        assert_eq!(a.as_ptr(), small_at, "the smallest that holds 999");
        assert_eq!(a.len(), 999);
        assert!(a.iter().all(|v| v.to_bits() == 0));
        let b = f32s(s.take(300_000, SumDtype::F32).into_settled());
        assert_eq!(b.as_ptr(), big_at);
        assert!(b.len() == 300_000 && b.iter().all(|v| v.to_bits() == 0));
        assert_eq!(s.len(), 0);
        // None left: a new sum, of zeros already. A spare grown within its
        // capacity.
        let mut c = s.take(5, SumDtype::F32);
        assert!(!c.piece(0..5).unwrap().1, "a new sum is not stale");
        assert!(f32s(c.into_settled()).iter().all(|v| v.to_bits() == 0));
        // One that no spare holds frees one: no more buffers than in use.
        s.give(f32_spare(vec![0.0; 8]));
        s.give(f32_spare(vec![0.0; 9]));
        assert_eq!(s.len(), 2);
        let big2 = f32s(s.take(100, SumDtype::F32).into_settled());
        assert!(big2.len() == 100 && s.len() == 1);
        let mut d = Vec::with_capacity(64);
        d.extend([3.0f32; 8]);
        let d_at = d.as_ptr();
        s.give(f32_spare(d));
        let e = f32s(s.take(64, SumDtype::F32).into_settled());
        assert_eq!(e.as_ptr(), d_at);
        assert!(e.len() == 64 && e.iter().all(|v| v.to_bits() == 0));
        // Nothing kept with max 0.
        let mut none = SpareSums::with_min(0, 0);
        none.give(f32_spare(vec![1.0; 4]));
        assert_eq!(none.len(), 0);
    }

    /// A spare's sum: a piece is stale the first time only; what pieces
    /// wrote stays, and only what none wrote (between, before, after them)
    /// is zeroed when it is read; asking whether a piece is stale marks
    /// nothing; a piece over a written one, or out of the sum, is an
    /// error; an empty one is never stale. A whole sum is never stale.
    #[test]
    fn a_spare_sum_keeps_what_pieces_wrote_and_zeroes_the_rest() {
        let mut g = GradSum::stale(GradBuf::F32(vec![f32::NAN; 20]));
        assert!(g.is_stale(3..6) && g.is_stale(3..6), "asking marks nothing");
        assert!(!g.is_stale(7..7), "empty");
        let (p, stale) = g.piece(3..6).unwrap();
        assert!(stale);
        p.fill(-0.5);
        assert!(!g.is_stale(3..6), "written");
        let (p, stale) = g.piece(3..6).unwrap();
        assert!(!stale, "written: added into now");
        p.iter_mut().for_each(|x| *x += 1.0);
        let (_, stale) = g.piece(9..9).unwrap();
        assert!(!stale, "empty");
        assert!(g.piece(9..9).is_ok());
        let (z, stale) = g.piece(10..12).unwrap();
        assert!(stale);
        z.copy_from_slice(&[0.0, 2.0]);
        let (p, stale) = g.piece(12..19).unwrap();
        assert!(stale);
        p.fill(7.0);
        for bad in [4..8, 2..4, 11..13, 0..21] {
            let e = g.piece(bad.clone()).unwrap_err().to_string();
            assert!(
                e.contains("overlap") || e.contains("of a sum of 20"),
                "{bad:?}: {e}"
            );
        }
        #[allow(clippy::reversed_empty_ranges)]
        let backwards = 6..5;
        assert!(g.piece(backwards).is_err());
        let mut want = vec![0f32; 20];
        want[3..6].fill(0.5);
        want[11] = 2.0;
        want[12..19].fill(7.0);
        match g.settled() {
            crate::optim::GradIn::F32(v) => assert_eq!(bits(v), bits(&want)),
            other => panic!("{other:?}"),
        }
        assert!(!g.is_stale(0..3), "settled: nothing stale");
        assert!(!g.piece(0..3).unwrap().1, "settled: nothing stale");
        assert_eq!(bits(&f32s(g.into_settled())), bits(&want));
        let mut w = GradSum::whole(vec![1.0; 4]);
        assert!(!w.is_stale(0..4));
        assert!(!w.piece(0..4).unwrap().1);
        assert_eq!(f32s(w.into_settled()), vec![1.0; 4]);
    }

    /// A bf16 sum holds each element's one bf16 gradient as it came, the
    /// gaps no piece wrote zeroed, and reads (widened) as the fp32 sum of
    /// the same puts, bit for bit, `-0.0`s and all; a second gradient for
    /// a piece, or one that is not bf16, widens it to fp32 first and then
    /// adds as an fp32 sum would; a bf16 spare is reused only for a bf16
    /// sum, and an fp32 one only for fp32.
    #[test]
    fn a_bf16_sum_is_its_gradients_and_widens_for_a_second() {
        let vals: Vec<f32> = (0..40)
            .map(|i| match i % 7 {
                0 => -0.0,
                1 => f32::from_bits(1 << 16), // a bf16 subnormal
                _ => (i as f32 * 0.37).sin(),
            })
            .collect();
        let g16: Vec<bf16> = vals.iter().map(|&x| bf16::from_f32(x)).collect();
        let e16 = || HostElems::Bf16(&g16);
        let e32 = || HostElems::F32(&vals);
        // Pieces 2..9 (gradient from 0), 12..20 (from 30); 0..2, 9..12
        // and 20..24 get none.
        let puts = [(2..9, 0usize), (12..20, 30)];
        let mut b = GradSum::stale(GradBuf::zeros(24, SumDtype::Bf16));
        let mut f = GradSum::stale(GradBuf::F32(vec![f32::NAN; 24]));
        for (r, off) in puts.clone() {
            b.put(r.clone(), e16(), off).unwrap();
            f.put(r, e16(), off).unwrap();
        }
        assert_eq!(b.dtype(), SumDtype::Bf16, "one gradient each: no widening");
        let (bb, ff) = (b.into_settled(), f32s(f.into_settled()));
        let GradBuf::Bf16(held) = &bb else {
            panic!("widened")
        };
        assert_eq!(&held[2..9], &g16[0..7], "as it came: -0.0 kept");
        assert!(held[..2]
            .iter()
            .chain(&held[9..12])
            .chain(&held[20..])
            .all(|x| x.to_bits() == 0));
        assert_eq!(bits(&bb.into_f32()), bits(&ff), "read as the fp32 sums");
        assert!(ff.iter().all(|x| x.to_bits() != 0x8000_0000));
        // A second gradient for a piece: widened, then added.
        for second in [e16(), e32()] {
            let mut b = GradSum::stale(GradBuf::zeros(24, SumDtype::Bf16));
            let mut f = GradSum::stale(GradBuf::F32(vec![0.5; 24]));
            b.put(2..9, e16(), 0).unwrap();
            f.put(2..9, e16(), 0).unwrap();
            b.put(2..9, second, 10).unwrap();
            f.put(2..9, second, 10).unwrap();
            assert_eq!(b.dtype(), SumDtype::F32);
            assert_eq!(bits(&f32s(b.into_settled())), bits(&f32s(f.into_settled())));
        }
        // A first gradient that is not bf16: widened, then set.
        let mut b = GradSum::stale(GradBuf::zeros(24, SumDtype::Bf16));
        b.put(12..20, e32(), 3).unwrap();
        assert_eq!(b.dtype(), SumDtype::F32);
        let v = f32s(b.into_settled());
        assert_eq!(
            bits(&v[12..20]),
            bits(&vals[3..11].iter().map(|x| 0.0 + x).collect::<Vec<_>>())
        );
        assert!(v[..12].iter().chain(&v[20..]).all(|x| x.to_bits() == 0));
        // Out of range, overlapping: refused.
        let mut b = GradSum::stale(GradBuf::zeros(24, SumDtype::Bf16));
        b.put(2..9, e16(), 0).unwrap();
        assert!(b.put(5..12, e16(), 0).is_err());
        assert!(b.put(20..25, e16(), 0).is_err());
        assert!(b.put(20..24, e16(), 38).is_err(), "past the gradient's end");
        // An empty piece, of either dtype, keeps a bf16 sum bf16.
        b.put(12..12, e32(), 0).unwrap();
        b.put(12..12, e16(), 40).unwrap();
        assert_eq!(b.dtype(), SumDtype::Bf16);
        // Spares by dtype.
        let mut s = SpareSums::with_min(4, 0);
        s.give(GradBuf::zeros(100, SumDtype::Bf16));
        let c = s.take(50, SumDtype::F32).into_settled();
        assert_eq!(c.dtype(), SumDtype::F32);
        assert_eq!(
            s.len(),
            0,
            "no fp32 spare: the bf16 one freed for a new sum"
        );
        s.give(GradBuf::zeros(100, SumDtype::Bf16));
        s.give(c);
        let d = s.take(60, SumDtype::Bf16).into_settled();
        let GradBuf::Bf16(d) = d else {
            panic!("an fp32 spare for bf16")
        };
        assert!(d.len() == 60 && d.iter().all(|x| x.to_bits() == 0));
    }
}

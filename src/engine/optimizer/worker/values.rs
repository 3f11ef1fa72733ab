//! The optimizer thread's values buffers: the spare the trainer gives
//! back, and the count and bound of those lent out (see [`SpareValues`]).

use candle_core::DType;
use half::{bf16, f16};

use super::StepValues;

/// The last [`StepValues`] the trainer stored, handed back
/// ([`OptimizerWorker::give_values`](super::OptimizerWorker::give_values))
/// for a later step's kernel output: the kernel writes every element, so a
/// spare needs no fill, where a new buffer was filled on the optimizer
/// thread first (`vec![bf16::ZERO; n]`, 90 MB for a 45M-element sub-group
/// in bf16, on the tail that paces the next forward) or, from 256 MiB up
/// (`crate::engine::host::heap`), was a fresh mapping whose pages faulted
/// in under the kernel (2 GB for DeepSpeed's default sub-group of 1e9
/// elements). One is kept, the largest given, and only within a run of
/// steps: the trainer drops it when a backward starts
/// ([`OptimizerWorker::drop_spare_values`](super::OptimizerWorker::drop_spare_values)),
/// so with clipping or an overflow check, whose steps all wait for the
/// norm, no values buffer lives through the backward where the gradient
/// sums peak (a new one is made for the first step a backward runs, as
/// before). With the speculative step, the speculated sub-groups step
/// during the backward: the first makes a values buffer, and it cycles
/// through the rest of the backward as the spare (one buffer of the largest
/// sub-group's elements, as a step without a spare would make anyway). A
/// large one's pages are unmapped off the trainer's thread, on the helper
/// CPUs ([`crate::engine::host::heap::free_off_thread`]), as the backward
/// starts.
///
/// It also counts the values lent out (each
/// [`Done::Stepped`](super::Done::Stepped) carries a [`ValuesLent`]) and
/// bounds them
/// ([`OptimizerWorker::bound_values`](super::OptimizerWorker::bound_values)):
/// after a decision the thread steps the remaining sub-groups back to back,
/// and the trainer stores their values at its unit boundaries, so unbounded
/// it held a values buffer per sub-group stepped meanwhile (the rank's
/// whole 16-bit shard at worst) where the sizing policy counts
/// [`crate::engine::sizing::values_in_flight`] of them.
#[derive(Debug, Clone, Default)]
pub(super) struct SpareValues {
    pool: std::sync::Arc<ValuesPool>,
    /// The helper CPUs a large spare is freed on.
    helper_cpus: Option<std::sync::Arc<[usize]>>,
}

/// The spare and the values buffers lent out ([`SpareValues`]).
#[derive(Debug, Default)]
struct ValuesPool {
    state: std::sync::Mutex<PoolState>,
    /// Signalled when a lent buffer comes back or the pool closes.
    returned: std::sync::Condvar,
}

#[derive(Debug)]
struct PoolState {
    spare: Option<StepValues>,
    /// Values handed out ([`Done::Stepped`](super::Done::Stepped)) whose
    /// [`ValuesLent`] is not dropped yet: in the reply channel, or being
    /// stored.
    lent: usize,
    /// At most this many lent at once
    /// ([`OptimizerWorker::bound_values`](super::OptimizerWorker::bound_values);
    /// `usize::MAX`: no bound).
    cap: usize,
    /// The most lent at once so far.
    peak: usize,
    /// The handle is gone: nobody gives any back, nothing waits.
    closed: bool,
}

impl Default for PoolState {
    fn default() -> Self {
        PoolState {
            spare: None,
            lent: 0,
            cap: usize::MAX,
            peak: 0,
            closed: false,
        }
    }
}

/// One values buffer lent out, counted until this is dropped (with its
/// [`Done::Stepped`](super::Done::Stepped), or once the trainer stored the
/// values): a drop on any path, an error's included, gives its place back,
/// so the optimizer thread waiting for one cannot be left waiting.
#[derive(Debug)]
pub struct ValuesLent(std::sync::Arc<ValuesPool>);

impl Drop for ValuesLent {
    fn drop(&mut self) {
        let mut st = self.0.state.lock().unwrap_or_else(|e| e.into_inner());
        st.lent = st.lent.saturating_sub(1);
        drop(st);
        self.0.returned.notify_all();
    }
}

impl SpareValues {
    /// No spare, no bound; a large spare not kept is freed on
    /// `helper_cpus`.
    pub(super) fn new(helper_cpus: Option<std::sync::Arc<[usize]>>) -> Self {
        SpareValues {
            helper_cpus,
            ..SpareValues::default()
        }
    }

    /// The most values lent at once so far.
    pub(super) fn peak(&self) -> usize {
        self.state().peak
    }

    fn state(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.pool.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps `v` unless a spare that large or larger is kept. The one
    /// not kept is freed off the calling thread when it is large
    /// ([`crate::engine::host::heap::free_off_thread`]).
    pub(super) fn give(&self, v: StepValues) {
        let mut st = self.state();
        let gone = if st
            .spare
            .as_ref()
            .is_none_or(|s| s.capacity_bytes() < v.capacity_bytes())
        {
            st.spare.replace(v)
        } else {
            Some(v)
        };
        drop(st);
        if let Some(gone) = gone {
            let bytes = gone.capacity_bytes();
            crate::engine::host::heap::free_off_thread(gone, bytes, self.helper_cpus.clone());
        }
    }

    /// Frees the spare, if one is kept: off the calling thread (the
    /// trainer's, as a backward starts) when it is large.
    pub(super) fn clear(&self) {
        let spare = self.state().spare.take();
        if let Some(v) = spare {
            let bytes = v.capacity_bytes();
            crate::engine::host::heap::free_off_thread(v, bytes, self.helper_cpus.clone());
        }
    }

    /// Bounds the values lent at once to `cap` (at least 1).
    pub(super) fn bound(&self, cap: usize) {
        self.state().cap = cap.max(1);
        self.pool.returned.notify_all();
    }

    /// Nobody gives values back any more: a [`SpareValues::take`] waiting
    /// for a place goes on (the handle is being dropped).
    pub(super) fn close(&self) {
        self.state().closed = true;
        self.pool.returned.notify_all();
    }

    /// `n` elements of `dtype`'s values, lent: once as many as the bound
    /// are lent, waits until one comes back. Then the spare if it is of
    /// that dtype and holds them (its old values left for the kernel to
    /// overwrite), else new ones.
    pub(super) fn take(&self, dtype: DType, n: usize) -> (StepValues, ValuesLent) {
        let mut st = self.state();
        while st.lent >= st.cap && !st.closed {
            st = self
                .pool
                .returned
                .wait(st)
                .unwrap_or_else(|e| e.into_inner());
        }
        st.lent += 1;
        st.peak = st.peak.max(st.lent);
        let spare = match st.spare.take() {
            Some(v) if v.dtype() == dtype && v.capacity_elems() >= n => Some(v),
            other => {
                st.spare = other;
                None
            }
        };
        drop(st);
        let lent = ValuesLent(self.pool.clone());
        let values = match spare {
            // Within its capacity: no new pages.
            Some(StepValues::F32(mut v)) => {
                v.resize(n, 0.0);
                StepValues::F32(v)
            }
            Some(StepValues::Bf16(mut v)) => {
                v.resize(n, bf16::ZERO);
                StepValues::Bf16(v)
            }
            Some(StepValues::F16(mut v)) => {
                v.resize(n, f16::ZERO);
                StepValues::F16(v)
            }
            None => match dtype {
                DType::BF16 => StepValues::Bf16(vec![bf16::ZERO; n]),
                DType::F16 => StepValues::F16(vec![f16::ZERO; n]),
                _ => StepValues::F32(vec![0.0; n]),
            },
        };
        (values, lent)
    }
}

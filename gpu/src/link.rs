//! Asynchronous uploads for the engine's device tier: host data staged in
//! pinned memory, copied on the host-to-device stream, ordered before the
//! compute that reads it by a CUDA event.
//!
//! # How an upload travels
//!
//! 1. [`Uploads::start`] takes a pinned staging buffer of exactly the
//!    upload's length from the pool, or allocates one. It fills the buffer
//!    on the host and allocates the destination, counted against the
//!    device budget, on the `h2d` stream. It queues the copy there and
//!    records an event after it, for the upload. The staging buffer goes
//!    on the pool's retiring list at once, with an event of its own
//!    after the copy: nothing but the copy reads it.
//! 2. [`Uploads::finish`] makes the compute stream wait on the upload's
//!    event, so the host does not wait. It then hands back the
//!    destination.
//!    A bf16 or fp16 upload ([`Uploads::start_bf16`],
//!    [`Uploads::start_f16`]) crosses as its 2-byte elements into a buffer
//!    of that type. A param's ([`Role::Param`]) stays the buffer it
//!    crossed into, 16-bit or fp32: the units read 16-bit params as they
//!    are ([`crate::unit::DevBuf`]), and its owner lets it go
//!    through [`Uploads::free_after_compute`]. A unit's input
//!    ([`Role::Input`]) is dropped with the unit's temporaries, so `finish`
//!    moves it into an fp32 buffer of the compute stream's (a 16-bit one
//!    widened by its cast kernel, exact; an fp32 one copied) and lets the
//!    one it crossed into go as below: dropped as it is, its free would
//!    make the h2d stream wait for the unit's compute.
//! 3. A later `start` moves retiring buffers whose event completed back to
//!    the pool (one pool per element type). When the pool's pinned bytes
//!    would pass its cap, it frees idle buffers, then waits for the
//!    oldest copy's event and frees that buffer: every staging buffer is
//!    the pool's, idle, retiring or being filled (taken out of the pool
//!    while the host writes it, out of the eviction's reach, still
//!    counted: the upload thread and the engine thread may each fill
//!    one), so the pool holds at most the larger of its cap and the
//!    buffers being filled at once. Until 2026-12-05 a
//!    buffer travelled in its [`PendingUpload`] until `finish`, out of
//!    the pool's reach: with the uploads of a unit and the window ahead
//!    not yet finished, a full pool allocated past its cap, and the
//!    plan's staging bound was not one.
//!
//! # Freeing a destination
//!
//! Destinations are allocated on the h2d stream, so cudarc frees them
//! there, first making that stream wait for their last use on the
//! compute stream: a param freed after its unit's kernels were queued
//! would hold every later upload behind those kernels. So
//! [`Uploads::free_after_compute`] records an event on the compute stream
//! and keeps the buffer, with it, until the event completed; only then is
//! it dropped, and its free waits for nothing. Its bytes leave the device
//! budget at once, as a dropped buffer's do (cudarc's free of a dropped
//! one is stream-ordered after its last use too). That is not the same
//! memory, though: a dropped buffer's free is queued on h2d at once, and
//! a later allocation there may reuse it in stream order, while one let
//! go here stays allocated until its compute is done and a later
//! `start` or `finish` reaps it. So the device holds, beyond what the
//! budget counts, the buffers of the units still computing (with units
//! launched ahead, two units' params). The 5% of free memory that the
//! default budget leaves covers that on the GPUs this has run on; a
//! budget set near the device's free memory may not, and then an
//! allocation fails in the driver (`cuMemAlloc`), not with the budget's
//! numbers.
//!
//! # What may be in flight
//!
//! A staging buffer is in exactly one place: the pool (idle), or the
//! retiring list (its copy queued, the copy's event not yet seen
//! complete); between the two only inside `fill_and_copy`, which fills
//! it, queues its copy and retires it. It is refilled only from the
//! pool, once its event is complete. So the copy engine never reads a
//! buffer the host is writing. The copies of one stream complete in
//! order, so waiting for the oldest retiring event waits for a copy
//! already queued, behind nothing the host has yet to do.
//! cudarc's `PinnedHostSlice` also records its own event at each copy, and
//! synchronises on it before any host access and before it is freed.
//!
//! # Copies in place
//!
//! A param whose bytes are in host memory registered with the device
//! ([`crate::host_register`]) needs no staging buffer:
//! [`Uploads::start_pinned`] queues the DMA from those bytes and records
//! an event after it. The bytes' `tierzero_swap::ReadPin` keeps them from
//! being rewritten until the copy is done: it goes, with a second event
//! after the copy, to a thread of the uploads' own, which waits for that
//! event and drops the pin. Neither the copy stream nor the engine waits
//! for it (not a host function on the stream: that would hold the stream
//! until it ran). `finish` is the same as for a staged upload, with no
//! staging buffer to retire.
//!
//! # Timing
//!
//! Each copy is also bracketed by two timing events on the `h2d` stream
//! ([`EventClock`]). [`Uploads::take_spans`] turns those whose end
//! completed into host-clock spans for the timeline; the others wait for
//! a later call.
//!
//! The upload staging memory is write-combined, which suits memory the
//! CPU only writes and the copy engine only reads. A long fill (and a
//! download's long read-back) is split over threads
//! ([`crate::host_copy`]): one core's copy would cap the link's rate.
//!
//! # How a download travels ([`Downloads`])
//!
//! 1. [`Downloads::start`] takes the device buffer (a unit's gradient,
//!    just computed on the compute stream; for 16-bit elements on the wire,
//!    first rounded to a buffer of them there, unless it is one: a 16-bit
//!    param comes as it is) and a pinned staging buffer of its length (plain page-locked memory, not write-combined: the CPU
//!    reads it). The `d2h` stream waits on an event recorded on the
//!    compute stream after the kernels that wrote the buffer, then copies
//!    it out. The host does not wait.
//! 2. [`Downloads::finish`] reads the staging buffer once its copy
//!    completed (cudarc's `PinnedHostSlice` synchronises on the copy's
//!    event before any host access), then frees the device buffer and
//!    returns the staging buffer to the pool.
//!
//! A [`PendingDownload`] owns both buffers while its copy may run; dropped
//! unfinished, it first waits for the copy, so neither is freed under
//! it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream, PinnedHostSlice};
use half::{bf16, f16};

use crate::device::{driver_err as driver, Device, DeviceBuffer};
use crate::event_queue::EventQueue;
use crate::unit::DevBuf;
use crate::Result;

/// An element type an upload crosses as: its staging pool, and the
/// variants that carry its destination and staging.
trait Crossing:
    cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy + Send + Sync + Sized
{
    fn pool(u: &Uploads) -> &Mutex<Pool<Self>>;
    fn dev_buf(dst: DeviceBuffer<Self>) -> DevBuf;
}

impl Crossing for f32 {
    fn pool(u: &Uploads) -> &Mutex<Pool<Self>> {
        &u.pool
    }
    fn dev_buf(dst: DeviceBuffer<Self>) -> DevBuf {
        DevBuf::F32(dst)
    }
}

impl Crossing for bf16 {
    fn pool(u: &Uploads) -> &Mutex<Pool<Self>> {
        &u.pool16
    }
    fn dev_buf(dst: DeviceBuffer<Self>) -> DevBuf {
        DevBuf::Bf16(dst)
    }
}

impl Crossing for f16 {
    fn pool(u: &Uploads) -> &Mutex<Pool<Self>> {
        &u.poolh
    }
    fn dev_buf(dst: DeviceBuffer<Self>) -> DevBuf {
        DevBuf::F16(dst)
    }
}

/// The element type of a copy in place ([`Uploads::start_pinned`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wire {
    /// fp32 elements.
    F32,
    /// bf16 elements.
    Bf16,
    /// fp16 elements.
    F16,
}

impl Wire {
    /// Bytes of one element.
    pub fn elem_bytes(self) -> usize {
        match self {
            Wire::F32 => 4,
            Wire::Bf16 | Wire::F16 => 2,
        }
    }
}

/// A staging buffer of a pool: its bytes count in the pool's
/// `pinned_bytes` from its allocation to its drop, wherever it is then
/// (idle, retiring with its copy, or dropped on an error path).
#[derive(Debug)]
pub struct Staging<T> {
    slice: PinnedHostSlice<T>,
    pinned_bytes: Arc<AtomicU64>,
}

impl<T> Staging<T> {
    fn len(&self) -> usize {
        self.slice.len()
    }
}

impl<T> Drop for Staging<T> {
    fn drop(&mut self) {
        // The slice itself is freed after this, by cudarc, once its copy
        // is done (its drop synchronises its event).
        self.pinned_bytes
            .fetch_sub(self.slice.num_bytes() as u64, Ordering::Relaxed);
    }
}

/// Staging buffers of one element type.
#[derive(Debug)]
struct Pool<T> {
    /// Idle staging buffers by length.
    free: HashMap<usize, Vec<Staging<T>>>,
    /// Buffers whose copy may still run, oldest first.
    retiring: EventQueue<Staging<T>>,
    /// Pinned bytes of every buffer the pool made and that is not dropped.
    pinned_bytes: Arc<AtomicU64>,
}

impl<T> Pool<T> {
    fn pinned_bytes(&self) -> u64 {
        self.pinned_bytes.load(Ordering::Relaxed)
    }
}

impl<T> Default for Pool<T> {
    fn default() -> Self {
        Pool {
            free: HashMap::new(),
            retiring: EventQueue::default(),
            pinned_bytes: Arc::new(AtomicU64::new(0)),
        }
    }
}

/// Waits for `ev`. cudarc keeps an error that a drop could not return
/// (a `CudaSlice`'s or an event's, on any thread) and hands it to the
/// next call that binds the context, which then returns it without doing
/// anything: so a first error may be someone else's, and this call would
/// not have waited. One more wait tells: it fails again only if the
/// context itself is broken. The first error is not dropped: it is the
/// failure of an operation whose owner could not be told, so it is kept
/// ([`deferred_error`]) and the next upload fails with it.
fn wait_for(ev: &CudaEvent) -> std::result::Result<(), cudarc::driver::DriverError> {
    retried("cuEventSynchronize", || ev.synchronize())
}

/// [`wait_for`] of a whole stream's queue.
fn drain(s: &CudaStream) -> std::result::Result<(), cudarc::driver::DriverError> {
    retried("cuStreamSynchronize", || s.synchronize())
}

/// An error cudarc handed to a wait that was not the wait's own (see
/// [`wait_for`]), kept until [`take_deferred_error`] reports it.
static DEFERRED: Mutex<Option<String>> = Mutex::new(None);

/// `f`, once more after a first failure (see [`wait_for`]); a first error
/// the second call does not repeat is kept in [`DEFERRED`] (the first one
/// kept wins) and said once.
fn retried(
    call: &'static str,
    f: impl Fn() -> std::result::Result<(), cudarc::driver::DriverError>,
) -> std::result::Result<(), cudarc::driver::DriverError> {
    let Err(first) = f() else {
        return Ok(());
    };
    f()?;
    // The code alone: formatting the error itself asks the driver for its
    // text, a second call into a context that just failed.
    let detail = format!(
        "{:?} (handed by cudarc to a {call} on another operation's behalf)",
        first.0
    );
    tracing::warn!(error = %detail, "an earlier CUDA operation failed");
    let mut slot = DEFERRED.lock().unwrap_or_else(|p| p.into_inner());
    slot.get_or_insert(detail);
    Ok(())
}

/// A timing event's result (the timeline's spans only): its value, or
/// `None` with the error kept in [`DEFERRED`]. The record may have failed
/// for an earlier operation whose drop could not return its error (cudarc
/// hands that to the next call that binds the context): dropped here, the
/// run would go on past a failed free or wait.
pub(crate) fn timing<T>(r: crate::Result<T>) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(e) => {
            tracing::warn!(error = %e, "recording a timing event failed");
            let mut slot = DEFERRED.lock().unwrap_or_else(|p| p.into_inner());
            slot.get_or_insert_with(|| format!("{e} (while recording a timing event)"));
            None
        }
    }
}

/// The failure of an earlier CUDA operation that a drop could not return
/// and a wait found (`wait_for`), once: the operation it belonged to
/// (a free, an event's record, a stream's wait) did not happen, so what
/// ran after it cannot be trusted. [`Uploads::finish`] returns it.
pub fn take_deferred_error() -> Option<crate::GpuError> {
    let mut slot = DEFERRED.lock().unwrap_or_else(|p| p.into_inner());
    slot.take().map(|detail| crate::GpuError::Driver {
        call: "an earlier CUDA operation",
        detail,
    })
}

/// The host's clock for CUDA events: a base event recorded on the
/// compute stream and waited for when the clock is made, with the host
/// instant it completed at. An event's time is the base's instant plus
/// `cuEventElapsedTime` from the base (microsecond resolution; the two
/// clocks drift apart by far less than that over a run's few steps).
#[derive(Debug)]
pub struct EventClock {
    base: CudaEvent,
    at: Instant,
}

/// A span between two timing events, not yet known to have ended.
#[derive(Debug)]
pub struct TimedSpan {
    /// What ran.
    pub name: String,
    start: CudaEvent,
    end: CudaEvent,
}

impl EventClock {
    /// The clock of `dev` (waits for its compute stream once).
    pub fn new(dev: &Device) -> Result<Self> {
        let base = Self::mark(&dev.compute)?;
        base.synchronize().map_err(driver("cuEventSynchronize"))?;
        Ok(EventClock {
            base,
            at: Instant::now(),
        })
    }

    /// A timing event recorded on `stream` now.
    pub fn mark(stream: &CudaStream) -> Result<CudaEvent> {
        stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(driver("cuEventRecord"))
    }

    /// A span from `start` to an event recorded on `stream` now.
    pub fn span(stream: &CudaStream, name: String, start: CudaEvent) -> Result<TimedSpan> {
        Ok(TimedSpan {
            name,
            start,
            end: Self::mark(stream)?,
        })
    }

    fn instant(&self, ev: &CudaEvent) -> Result<Instant> {
        let ms = self
            .base
            .elapsed_ms(ev)
            .map_err(driver("cuEventElapsedTime"))?;
        Ok(self.at + Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
    }

    /// Removes the spans of `pending` whose end completed and returns
    /// them on the host's clock, in order; the rest stay.
    pub fn resolve(&self, pending: &mut Vec<TimedSpan>) -> Result<Vec<(String, Instant, Instant)>> {
        let mut done = Vec::new();
        let mut keep = Vec::new();
        for s in pending.drain(..) {
            if s.end.try_is_complete().map_err(driver("cuEventQuery"))? {
                done.push(s);
            } else {
                keep.push(s);
            }
        }
        *pending = keep;
        done.into_iter()
            .map(|s| Ok((s.name, self.instant(&s.start)?, self.instant(&s.end)?)))
            .collect()
    }
}

/// Spans kept for [`SpanLog::take`] before the completed ones are
/// dropped unread.
const MAX_PENDING_SPANS: usize = 1 << 14;

/// Spans recorded on a device's streams, read back on the host's clock:
/// an [`EventClock`] and the spans not yet read.
#[derive(Debug)]
pub struct SpanLog {
    clock: EventClock,
    pending: Mutex<Vec<TimedSpan>>,
}

impl SpanLog {
    /// A log with its own clock on `dev`.
    pub fn new(dev: &Device) -> Result<Self> {
        Ok(SpanLog {
            clock: EventClock::new(dev)?,
            pending: Mutex::new(Vec::new()),
        })
    }

    /// Keeps `span` until read; when nobody reads them, only those not
    /// yet complete are kept past `MAX_PENDING_SPANS`.
    pub fn push(&self, span: TimedSpan) -> Result<()> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if pending.len() >= MAX_PENDING_SPANS {
            drop(self.clock.resolve(&mut pending)?);
        }
        pending.push(span);
        Ok(())
    }

    /// The spans that completed since the last call, on the host's clock.
    pub fn take(&self) -> Result<Vec<(String, Instant, Instant)>> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        self.clock.resolve(&mut pending)
    }
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

mod downloads;
mod pending;
mod uploads;
pub use downloads::{Downloaded, DownloadedRef, Downloads, PendingDownload};
pub use pending::{PendingUpload, Role};
pub use uploads::Uploads;

/// `len` bytes of pinned (page-locked, not write-combined) host memory on
/// `ctx`, zeroed: staging that the host writes and reads back and the
/// copy engine reads and writes (the host's NCCL collectives stage
/// through it: `tierzero::engine::comm::nccl`).
pub fn pinned_bytes(
    ctx: &Arc<cudarc::driver::CudaContext>,
    len: usize,
) -> Result<PinnedHostSlice<u8>> {
    // SAFETY: the memory is uninitialised, and every bit pattern is a
    // valid u8; it is zeroed below before anyone reads it.
    let mut p =
        unsafe { ctx.alloc_pinned_with_flags::<u8>(len, 0) }.map_err(driver("cuMemHostAlloc"))?;
    p.as_mut_slice()
        .map_err(driver("cuEventSynchronize"))?
        .fill(0);
    Ok(p)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;
    use cudarc::driver::sys::CUresult;
    use cudarc::driver::DriverError;
    use std::cell::Cell;

    /// A first error the retry does not repeat is kept and reported once;
    /// one it repeats is the call's own and returned; none, nothing kept.
    #[test]
    fn a_retried_wait_keeps_a_first_error_that_was_not_its_own() {
        let _ = take_deferred_error();
        let calls = Cell::new(0);
        let first_fails = || {
            calls.set(calls.get() + 1);
            if calls.get() == 1 {
                Err(DriverError(CUresult::CUDA_ERROR_LAUNCH_FAILED))
            } else {
                Ok(())
            }
        };
        retried("cuEventSynchronize", first_fails).unwrap();
        assert_eq!(calls.get(), 2);
        let e = take_deferred_error().unwrap().to_string();
        assert!(
            e.contains("LAUNCH_FAILED") || e.contains("launch failed"),
            "{e}"
        );
        assert!(take_deferred_error().is_none(), "reported once");
        let always = || Err(DriverError(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS));
        assert!(retried("cuEventSynchronize", always).is_err());
        assert!(take_deferred_error().is_none(), "its own error, returned");
        retried("cuEventSynchronize", || Ok(())).unwrap();
        assert!(take_deferred_error().is_none());
    }
}

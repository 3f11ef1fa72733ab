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

/// The upload path of one device.
#[derive(Debug)]
pub struct Uploads {
    dev: Arc<Device>,
    pool: Mutex<Pool<f32>>,
    pool16: Mutex<Pool<bf16>>,
    poolh: Mutex<Pool<f16>>,
    cap_bytes: u64,
    spans: SpanLog,
    /// Where the pins of copies in place go, each with an event after its
    /// copy ([`Uploads::start_pinned`], [`spawn_reaper`]).
    reaper: Mutex<std::sync::mpsc::Sender<(CudaEvent, tierzero_swap::ReadPin)>>,
    /// Destinations let go, each with an event after its last use on the
    /// compute stream, dropped once that event completed (see "Freeing a
    /// destination").
    freeing: Mutex<EventQueue<DevBuf>>,
}

/// The thread that lets the pins of copies in place go once they are
/// done: it waits for each copy's event (copies on one stream complete in
/// order, so in turn), then drops its pin, and a write-back waiting for
/// that pin proceeds. The copy stream never waits for it, and the host
/// only where the bytes are rewritten. Dropping an arena's last pin (its
/// store gone) unregisters the arena, a CUDA call, which is fine on this
/// thread. It ends when the uploads are dropped and its queue is empty.
fn spawn_reaper() -> Result<std::sync::mpsc::Sender<(CudaEvent, tierzero_swap::ReadPin)>> {
    let (tx, rx) = std::sync::mpsc::channel::<(CudaEvent, tierzero_swap::ReadPin)>();
    std::thread::Builder::new()
        .name("tierzero-pin-reaper".into())
        .spawn(move || {
            for (done, pin) in rx {
                if let Err(e) = wait_for(&done) {
                    // The context failed: no copy runs on it any more,
                    // and a pin that never went would hang a write-back.
                    tracing::warn!(error = %e, "cuEventSynchronize before letting a page pin go");
                }
                drop(pin);
            }
        })
        .map_err(|e| crate::GpuError::Driver {
            call: "std::thread::spawn",
            detail: format!("the pin reaper thread did not start: {e}"),
        })?;
    Ok(tx)
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Uploads {
    /// Uploads to `dev` through at most `cap_bytes` of pinned staging
    /// memory for each element type (a single upload larger than the cap
    /// still gets its buffer).
    pub fn new(dev: Arc<Device>, cap_bytes: u64) -> Result<Self> {
        Ok(Uploads {
            spans: SpanLog::new(&dev)?,
            reaper: Mutex::new(spawn_reaper()?),
            dev,
            pool: Mutex::new(Pool::default()),
            pool16: Mutex::new(Pool::default()),
            poolh: Mutex::new(Pool::default()),
            cap_bytes,
            freeing: Mutex::new(EventQueue::default()),
        })
    }

    /// The copies that completed since the last call, on the host's
    /// clock.
    pub fn take_spans(&self) -> Result<Vec<(String, Instant, Instant)>> {
        self.spans.take()
    }

    /// The cap on its pinned staging bytes of each element type.
    pub fn cap_bytes(&self) -> u64 {
        self.cap_bytes
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// Pinned bytes the pools own now.
    pub fn pinned_bytes(&self) -> u64 {
        locked(&self.pool).pinned_bytes()
            + locked(&self.pool16).pinned_bytes()
            + locked(&self.poolh).pinned_bytes()
    }

    /// A staging buffer of `len` elements, from `pool` or new.
    fn staging<T: cudarc::driver::DeviceRepr>(
        &self,
        pool: &mut Pool<T>,
        len: usize,
    ) -> Result<Staging<T>> {
        // Copies that completed give their buffers back.
        while let Some(s) = pool.retiring.pop_done().map_err(driver("cuEventQuery"))? {
            pool.free.entry(s.len()).or_default().push(s);
        }
        if let Some(s) = pool.free.get_mut(&len).and_then(Vec::pop) {
            return Ok(s);
        }
        let bytes = (len * std::mem::size_of::<T>()) as u64;
        // Over the cap: free idle buffers of other lengths, then wait for
        // the oldest copies and free theirs.
        while pool.pinned_bytes() + bytes > self.cap_bytes {
            let idle = pool.free.values_mut().find_map(Vec::pop);
            let victim = match idle {
                Some(s) => s,
                None => match pool.retiring.pop_oldest() {
                    Some((ev, s)) => {
                        wait_for(&ev).map_err(driver("cuEventSynchronize"))?;
                        s
                    }
                    None => break,
                },
            };
            // Its drop gives its bytes back.
            drop(victim);
        }
        // SAFETY: the buffer is uninitialised: `start` writes all of its
        // `len` elements (the upload is exactly that long) before the copy
        // reads it, and nothing else reads it.
        let slice = unsafe {
            self.dev
                .context()
                .alloc_pinned::<T>(len)
                .map_err(driver("cuMemHostAlloc"))?
        };
        pool.pinned_bytes.fetch_add(bytes, Ordering::Relaxed);
        Ok(Staging {
            slice,
            pinned_bytes: pool.pinned_bytes.clone(),
        })
    }

    /// Fills a staging buffer from `host` and queues its copy into a new
    /// device buffer on the h2d stream: the buffers and the event after.
    fn queue<
        T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy + Send + Sync,
    >(
        &self,
        pool: &Mutex<Pool<T>>,
        what: &str,
        host: &[T],
    ) -> Result<(DeviceBuffer<T>, CudaEvent)> {
        let mut dst = self.dst::<T>(what, host.len())?;
        let event = self.fill_and_copy(pool, what, host, dst.slice_mut())?;
        Ok((dst, event))
    }

    /// Fills a staging buffer from `host` and queues its copy into `dst`
    /// (as long) on the h2d stream: the event after the copy. The staging
    /// buffer goes on the retiring list at once, with an event of its own
    /// after the copy (see "What may be in flight").
    fn fill_and_copy<
        T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy + Send + Sync,
        D: cudarc::driver::DevicePtrMut<T>,
    >(
        &self,
        pool: &Mutex<Pool<T>>,
        what: &str,
        host: &[T],
        dst: &mut D,
    ) -> Result<CudaEvent> {
        // On an error below the buffers are dropped: cudarc frees them
        // once a copy that reads them is done, and their bytes leave the
        // count.
        let mut staging = self.staging(&mut locked(pool), host.len())?;
        // A long fill is split over threads (see `host_copy`).
        crate::host_copy::copy(
            staging
                .slice
                .as_mut_slice()
                .map_err(driver("cuEventSynchronize"))?,
            host,
        );
        let began = EventClock::mark(&self.dev.h2d)?;
        self.dev
            .h2d
            .memcpy_htod(&staging.slice, dst)
            .map_err(driver("cuMemcpyHtoDAsync"))?;
        let span = EventClock::span(&self.dev.h2d, what.to_owned(), began)?;
        self.spans.push(span)?;
        let event = self
            .dev
            .h2d
            .record_event(None)
            .map_err(driver("cuEventRecord"))?;
        let retire = self
            .dev
            .h2d
            .record_event(None)
            .map_err(driver("cuEventRecord"))?;
        locked(pool).retiring.push(retire, staging);
        Ok(event)
    }

    /// Starts copying `host` into a new device buffer for `what`, a
    /// `role`.
    pub fn start(&self, what: &str, host: &[f32], role: Role) -> Result<PendingUpload> {
        self.start_as(what, host, role)
    }

    /// Starts copying bf16 `host` (its 2-byte elements, half an fp32
    /// upload's bytes) to the device, a `role`.
    pub fn start_bf16(&self, what: &str, host: &[bf16], role: Role) -> Result<PendingUpload> {
        self.start_as(what, host, role)
    }

    /// Starts copying fp16 `host` to the device, as
    /// [`Uploads::start_bf16`] does bf16.
    pub fn start_f16(&self, what: &str, host: &[f16], role: Role) -> Result<PendingUpload> {
        self.start_as(what, host, role)
    }

    /// The three above: `host` through its element type's pool.
    fn start_as<T: Crossing>(&self, what: &str, host: &[T], role: Role) -> Result<PendingUpload> {
        let (dst, event) = self.queue(T::pool(self), what, host)?;
        Ok(PendingUpload::new(T::dev_buf(dst), event, role))
    }

    /// Starts copying `shard`, elements `offset..offset + shard.len()` of
    /// a param of `numel` fp32 elements (this rank's), into that range of
    /// a new device buffer of `numel`: the rest is for
    /// [`crate::collective::DeviceComm::gather`] to write, which must
    /// follow before [`Uploads::finish`]. A [`Role::Param`].
    pub fn start_shard(
        &self,
        what: &str,
        shard: &[f32],
        offset: usize,
        numel: usize,
    ) -> Result<PendingUpload> {
        self.start_shard_as(what, shard, offset, numel)
    }

    /// [`Uploads::start_shard`] of bf16 elements, into a bf16 buffer.
    pub fn start_shard_bf16(
        &self,
        what: &str,
        shard: &[bf16],
        offset: usize,
        numel: usize,
    ) -> Result<PendingUpload> {
        self.start_shard_as(what, shard, offset, numel)
    }

    /// [`Uploads::start_shard`] of fp16 elements, into an fp16 buffer.
    pub fn start_shard_f16(
        &self,
        what: &str,
        shard: &[f16],
        offset: usize,
        numel: usize,
    ) -> Result<PendingUpload> {
        self.start_shard_as(what, shard, offset, numel)
    }

    /// The three above. A shard of no elements takes no staging buffer
    /// and queues no copy: its event is recorded after the
    /// destination's allocation.
    fn start_shard_as<T: Crossing>(
        &self,
        what: &str,
        shard: &[T],
        offset: usize,
        numel: usize,
    ) -> Result<PendingUpload> {
        if numel == 0
            || offset
                .checked_add(shard.len())
                .is_none_or(|end| end > numel)
        {
            return Err(crate::GpuError::Shape {
                kernel: "shard upload".into(),
                detail: format!(
                    "{what}: a shard of {} elements at {offset} of a param of {numel}",
                    shard.len()
                ),
            });
        }
        let mut dst = self.dst::<T>(what, numel)?;
        let event = if shard.is_empty() {
            self.dev
                .h2d
                .record_event(None)
                .map_err(driver("cuEventRecord"))?
        } else {
            self.fill_and_copy(
                T::pool(self),
                what,
                shard,
                &mut dst.slice_mut().slice_mut(offset..offset + shard.len()),
            )?
        };
        Ok(PendingUpload::new(T::dev_buf(dst), event, Role::Param))
    }

    /// A destination of `len` elements on the h2d stream (not
    /// initialised: the copy queued next writes all of it), buffers let go
    /// whose compute is done dropped first.
    fn dst<T: cudarc::driver::DeviceRepr>(
        &self,
        what: &str,
        len: usize,
    ) -> Result<DeviceBuffer<T>> {
        self.reap_freed()?;
        self.dev.alloc_uninit_on_h2d::<T>(what, len)
    }

    /// Drops the buffers let go whose event completed.
    fn reap_freed(&self) -> Result<()> {
        locked(&self.freeing)
            .drop_done()
            .map_err(driver("cuEventQuery"))
    }

    /// Lets `buf` go once the work queued on the compute stream so far
    /// (its last use) is done, without making the h2d stream wait for it
    /// (see "Freeing a destination"). A buffer allocated on the compute
    /// stream may come here too: its free would not have waited anyway.
    pub fn free_after_compute(&self, mut buf: DevBuf) -> Result<()> {
        buf.uncount();
        let done = match self.dev.compute.record_event(None) {
            Ok(ev) => ev,
            Err(e) => {
                // No event to wait on: dropped now, cudarc orders its free
                // after its uses (the h2d stream waits).
                drop(buf);
                return Err(driver("cuEventRecord")(e));
            }
        };
        self.reap_freed()?;
        locked(&self.freeing).push(done, buf);
        Ok(())
    }

    /// Starts copying `pin`'s bytes, in host memory registered with this
    /// device ([`crate::host_register::HostRegistration`]), straight into
    /// a new device buffer for `what`: one DMA, no staging copy. The bytes
    /// are a param's elements of `wire` (kept so: a [`Role::Param`]). The
    /// pin travels with the copy:
    /// the reaper thread lets it go once an event after the copy completed
    /// (`spawn_reaper`), so a write-back into those bytes waits for the
    /// copy and for nothing else. The caller checks the registration
    /// (`ReadPin::registered_with`); memory that is not registered would
    /// still copy, but synchronously.
    pub fn start_pinned(
        &self,
        what: &str,
        pin: tierzero_swap::ReadPin,
        wire: Wire,
    ) -> Result<PendingUpload> {
        let elem_bytes = wire.elem_bytes();
        let len_bytes = pin.len_bytes();
        if !len_bytes.is_multiple_of(elem_bytes) {
            return Err(crate::GpuError::Driver {
                call: "cuMemcpyHtoDAsync",
                detail: format!(
                    "{what}: {len_bytes} bytes is not a whole number of {elem_bytes}-byte elements"
                ),
            });
        }
        let numel = len_bytes / elem_bytes;
        let (crossed, event) = match wire {
            Wire::F32 => {
                let (d, ev) = self.copy_pinned_new::<f32>(what, pin, numel)?;
                (DevBuf::F32(d), ev)
            }
            Wire::Bf16 => {
                let (d, ev) = self.copy_pinned_new::<bf16>(what, pin, numel)?;
                (DevBuf::Bf16(d), ev)
            }
            Wire::F16 => {
                let (d, ev) = self.copy_pinned_new::<f16>(what, pin, numel)?;
                (DevBuf::F16(d), ev)
            }
        };
        Ok(PendingUpload::new(crossed, event, Role::Param))
    }

    /// Starts copying `pin`'s bytes, this rank's shard of a param of
    /// `numel` elements of `wire` at element `offset`, in host memory
    /// registered with this device, straight into that range of a new
    /// device buffer of `numel`: [`Uploads::start_pinned`]'s copy in
    /// place (the pin travels with the copy) for
    /// [`crate::collective::DeviceComm::gather`] to complete, as
    /// [`Uploads::start_shard`] does through staging. A pin of no bytes
    /// queues no copy.
    pub fn start_shard_pinned(
        &self,
        what: &str,
        pin: tierzero_swap::ReadPin,
        wire: Wire,
        offset: usize,
        numel: usize,
    ) -> Result<PendingUpload> {
        let elem_bytes = wire.elem_bytes();
        let len_bytes = pin.len_bytes();
        let n = len_bytes / elem_bytes;
        if !len_bytes.is_multiple_of(elem_bytes)
            || numel == 0
            || offset.checked_add(n).is_none_or(|end| end > numel)
        {
            return Err(crate::GpuError::Shape {
                kernel: "shard upload".into(),
                detail: format!(
                    "{what}: {len_bytes} pinned bytes of {elem_bytes}-byte elements at {offset} \
                     of a param of {numel}"
                ),
            });
        }
        let (crossed, event) = match wire {
            Wire::F32 => {
                let (d, ev) = self.shard_pinned_new::<f32>(what, pin, offset, numel)?;
                (DevBuf::F32(d), ev)
            }
            Wire::Bf16 => {
                let (d, ev) = self.shard_pinned_new::<bf16>(what, pin, offset, numel)?;
                (DevBuf::Bf16(d), ev)
            }
            Wire::F16 => {
                let (d, ev) = self.shard_pinned_new::<f16>(what, pin, offset, numel)?;
                (DevBuf::F16(d), ev)
            }
        };
        Ok(PendingUpload::new(crossed, event, Role::Param))
    }

    /// A new destination of `numel` elements and [`Uploads::copy_pinned`]
    /// of `pin` into its range from `offset` (none for a pin of no
    /// bytes: the event is recorded after the allocation).
    fn shard_pinned_new<T: cudarc::driver::DeviceRepr>(
        &self,
        what: &str,
        pin: tierzero_swap::ReadPin,
        offset: usize,
        numel: usize,
    ) -> Result<(DeviceBuffer<T>, CudaEvent)> {
        let mut dst = self.dst::<T>(what, numel)?;
        let n = pin.len_bytes() / std::mem::size_of::<T>();
        let event = if n == 0 {
            drop(pin);
            self.dev
                .h2d
                .record_event(None)
                .map_err(driver("cuEventRecord"))?
        } else {
            self.copy_pinned(
                what,
                pin,
                &mut dst.slice_mut().slice_mut(offset..offset + n),
            )?
        };
        Ok((dst, event))
    }

    /// A new destination of `numel` elements and [`Uploads::copy_pinned`]
    /// of `pin` into it.
    fn copy_pinned_new<T: cudarc::driver::DeviceRepr>(
        &self,
        what: &str,
        pin: tierzero_swap::ReadPin,
        numel: usize,
    ) -> Result<(DeviceBuffer<T>, CudaEvent)> {
        let mut dst = self.dst::<T>(what, numel)?;
        let event = self.copy_pinned(what, pin, dst.slice_mut())?;
        Ok((dst, event))
    }

    /// Queues the copy of `pin` into `dst` on the h2d stream and records
    /// two events after it: one goes to the reaper thread with the pin
    /// ([`spawn_reaper`]), the other is the caller's.
    fn copy_pinned<T, D: cudarc::driver::DevicePtrMut<T> + cudarc::driver::DeviceSlice<T>>(
        &self,
        what: &str,
        pin: tierzero_swap::ReadPin,
        dst: &mut D,
    ) -> Result<CudaEvent> {
        if dst.num_bytes() < pin.len_bytes() {
            return Err(crate::GpuError::Driver {
                call: "cuMemcpyHtoDAsync",
                detail: format!(
                    "{what}: {} bytes pinned into {} bytes on the device",
                    pin.len_bytes(),
                    dst.num_bytes()
                ),
            });
        }
        self.dev
            .context()
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))?;
        let began = EventClock::mark(&self.dev.h2d)?;
        {
            let (dst_ptr, _written) = dst.device_ptr_mut(&self.dev.h2d);
            // SAFETY: `dst` is a live allocation on this context (or a
            // range of one) of at least `pin.len_bytes()` bytes (checked
            // above); the
            // source is registered host memory that nobody writes while
            // `pin` lives, and `pin` lives until an event recorded after
            // this copy on the same stream has completed (the reaper
            // waits for it), or until the stream was synchronised.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    dst_ptr,
                    pin.bytes(),
                    self.dev.h2d.cu_stream(),
                )
            }
            .map_err(driver("cuMemcpyHtoDAsync"))?;
        }
        // From here the copy may be running: every way out hands the pin
        // to the reaper or waits for the stream first. The span is for the
        // timeline only; a failed one loses it, and its error is kept
        // ([`timing`]).
        if let Some(span) = timing(EventClock::span(&self.dev.h2d, what.to_owned(), began)) {
            let _ = self.spans.push(span);
        }
        // The reaper's event, then the caller's: both after the copy. The
        // reaper's blocks its thread while it waits (cudarc's default
        // events spin a core, and the reaper waits most of a step).
        let done = self
            .dev
            .h2d
            .record_event(Some(CUevent_flags::CU_EVENT_BLOCKING_SYNC));
        let event = self.dev.h2d.record_event(None);
        let (done, event) = match (done, event) {
            (Ok(d), Ok(e)) => (d, e),
            (Err(e), _) | (_, Err(e)) => {
                // No event to hand the pin over with: it goes once the
                // stream has run the copy.
                let _ = drain(&self.dev.h2d);
                drop(pin);
                return Err(driver("cuEventRecord")(e));
            }
        };
        if let Err(std::sync::mpsc::SendError((done, pin))) = locked(&self.reaper).send((done, pin))
        {
            // The reaper is gone (it panicked): wait here instead.
            let _ = wait_for(&done);
            drop(pin);
        }
        Ok(event)
    }

    /// Orders the compute stream's next work after `event`.
    fn compute_waits(&self, event: &CudaEvent) -> Result<()> {
        self.dev
            .compute
            .wait(event)
            .map_err(driver("cuStreamWaitEvent"))
    }

    /// The destination, with the compute stream waiting on the copy's
    /// event (the host does not wait): a param's as it crossed
    /// ([`Role::Param`]); an input's in an fp32 buffer of the compute
    /// stream's, widened exactly by its cast kernel or copied
    /// there, the buffer it crossed into let go after that
    /// ([`Role::Input`]).
    pub fn finish(&self, u: PendingUpload) -> Result<DevBuf> {
        // An earlier operation's failure that a wait found: the run stops
        // here, at the next unit's params, not later on wrong data.
        if let Some(e) = take_deferred_error() {
            return Err(e);
        }
        self.finish_own(u)
    }

    /// An upload nobody takes, ordered like [`Uploads::finish`] and freed
    /// after the compute queued so far. An earlier operation's failure a
    /// wait found stays for the next `finish` to report: a caller that
    /// drops what this returns (a stop, a unit given back) does not drop
    /// that too.
    pub fn discard(&self, u: PendingUpload) -> Result<()> {
        let r = self.finish_own(u).and_then(|b| self.free_after_compute(b));
        // A failure here may be an earlier operation's that cudarc handed
        // to this call (a failed drop's): kept for the next `finish` too,
        // since the caller only says it.
        if let Err(e) = &r {
            let mut slot = DEFERRED.lock().unwrap_or_else(|p| p.into_inner());
            slot.get_or_insert_with(|| format!("{e} (while discarding an upload nobody took)"));
        }
        r
    }

    /// [`Uploads::finish`] less the earlier failure's check.
    fn finish_own(&self, u: PendingUpload) -> Result<DevBuf> {
        let mut u = u;
        let role = u.role;
        let (Some(crossed), Some(event)) = (u.crossed.take(), u.event.take()) else {
            return Err(crate::GpuError::Driver {
                call: "cuStreamWaitEvent",
                detail: "an upload finished twice".into(),
            });
        };
        drop(u);
        self.compute_waits(&event)?;
        drop(event);
        self.reap_freed()?;
        if role == Role::Param {
            return Ok(crossed);
        }
        // The buffer it crossed into is let go below, after this copy: its
        // bytes leave the budget now, so that an input does not count
        // twice in the temporaries' share while it moves.
        let mut crossed = crossed;
        crossed.uncount();
        let mut out = self.dev.alloc_output::<f32>("unit input", crossed.len())?;
        match &crossed {
            DevBuf::Bf16(narrow) => crate::ops::cast::<bf16, f32>(&self.dev, &mut out, narrow)?,
            DevBuf::F16(narrow) => crate::ops::cast::<f16, f32>(&self.dev, &mut out, narrow)?,
            DevBuf::F32(dst) => self
                .dev
                .compute
                .memcpy_dtod(dst.slice(), out.slice_mut())
                .map_err(driver("cuMemcpyDtoDAsync"))?,
        }
        // The buffer it crossed into was allocated on the h2d stream: let
        // go after this, not dropped now.
        self.free_after_compute(crossed)?;
        Ok(DevBuf::F32(out))
    }
}

mod downloads;
mod pending;
pub use downloads::{Downloaded, DownloadedRef, Downloads, PendingDownload};
pub use pending::{PendingUpload, Role};

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

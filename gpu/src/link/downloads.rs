//! The download path ([`Downloads`]): see "How a download travels" in
//! [`super`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::driver::PinnedHostSlice;
use half::{bf16, f16};

use super::{driver, locked, EventClock, SpanLog, Wire};
use crate::device::{Device, DeviceBuffer};
use crate::unit::DevBuf;
use crate::Result;

/// A download in flight: the device buffer being read and the pinned
/// buffer being written (see [`super`]'s docs).
#[derive(Debug)]
pub struct PendingDownload {
    inner: Option<Down>,
    /// Buffers kept until the copy is done: 16-bit buffers widened into
    /// the one copied (params, allocated on the h2d stream; dropped
    /// earlier, that stream would wait for the cast), or the buffers a
    /// reduce-scatter read and wrote (`start_reduced`: freed only once its
    /// sums, after them on its stream, came down).
    sources: Vec<DevBuf>,
}

#[derive(Debug)]
enum Down {
    F32(DeviceBuffer<f32>, PinnedHostSlice<f32>),
    Bf16(DeviceBuffer<bf16>, PinnedHostSlice<bf16>),
    F16(DeviceBuffer<f16>, PinnedHostSlice<f16>),
}

impl Drop for PendingDownload {
    fn drop(&mut self) {
        // Unfinished: wait for the copy before any buffer is freed
        // (`as_slice` waits for the slice's event), once more after a first
        // failure that may be another operation's (`retried`). If the wait
        // fails, the copy may still be running: its buffers and the ones
        // kept for it (a reduce's, which its collective may still read)
        // are leaked, not freed under it, and the failure is said.
        let wait = || match &self.inner {
            Some(Down::F32(_, s)) => s.as_slice().map(drop),
            Some(Down::Bf16(_, s)) => s.as_slice().map(drop),
            Some(Down::F16(_, s)) => s.as_slice().map(drop),
            None => Ok(()),
        };
        if let Err(e) = super::retried("cuEventSynchronize", wait) {
            tracing::warn!(error = ?e.0, "waiting for a download before freeing it failed; its buffers are leaked");
            std::mem::forget(self.inner.take());
            std::mem::forget(std::mem::take(&mut self.sources));
        }
    }
}

/// What a download brought back.
#[derive(Debug, Clone, PartialEq)]
pub enum Downloaded {
    /// fp32 elements.
    F32(Vec<f32>),
    /// bf16 elements, rounded on the device (to nearest even).
    Bf16(Vec<bf16>),
    /// fp16 elements, rounded on the device (to nearest even, overflow
    /// to infinity).
    F16(Vec<f16>),
}

/// A download's elements where they landed, in its pinned staging buffer
/// ([`Downloads::finish_with`]): borrowed until the buffer goes back to
/// its pool.
#[derive(Debug, Clone, Copy)]
pub enum DownloadedRef<'a> {
    /// fp32 elements.
    F32(&'a [f32]),
    /// bf16 elements, rounded on the device.
    Bf16(&'a [bf16]),
    /// fp16 elements, rounded on the device.
    F16(&'a [f16]),
}

/// Idle pinned buffers of one element type by length, and their bytes.
#[derive(Debug)]
struct IdlePinned<T> {
    by_len: HashMap<usize, Vec<PinnedHostSlice<T>>>,
    bytes: u64,
}

impl<T> Default for IdlePinned<T> {
    fn default() -> Self {
        IdlePinned {
            by_len: HashMap::new(),
            bytes: 0,
        }
    }
}

/// The download path of one device: copies out on the `d2h` stream
/// through pooled pinned buffers.
#[derive(Debug)]
pub struct Downloads {
    dev: Arc<Device>,
    free: Mutex<IdlePinned<f32>>,
    free16: Mutex<IdlePinned<bf16>>,
    freeh: Mutex<IdlePinned<f16>>,
    cap_bytes: u64,
    spans: SpanLog,
}

impl Downloads {
    /// Downloads from `dev`, keeping at most `cap_bytes` of idle pinned
    /// buffers of each element type.
    pub fn new(dev: Arc<Device>, cap_bytes: u64) -> Result<Self> {
        Ok(Downloads {
            spans: SpanLog::new(&dev)?,
            dev,
            free: Mutex::new(IdlePinned::default()),
            free16: Mutex::new(IdlePinned::default()),
            freeh: Mutex::new(IdlePinned::default()),
            cap_bytes,
        })
    }

    /// The most idle pinned bytes kept for reuse, per element type.
    pub fn cap_bytes(&self) -> u64 {
        self.cap_bytes
    }

    /// Queues the copy of `src` into a pinned buffer of its length on the
    /// d2h stream, after `after` (None: the compute stream's work queued so
    /// far).
    fn queue<T: cudarc::driver::DeviceRepr>(
        &self,
        pool: &Mutex<IdlePinned<T>>,
        what: &str,
        src: &DeviceBuffer<T>,
        after: Option<&cudarc::driver::CudaEvent>,
    ) -> Result<PinnedHostSlice<T>> {
        let len = src.len();
        let pooled = {
            let mut free = locked(pool);
            let got = free.by_len.get_mut(&len).and_then(Vec::pop);
            if got.is_some() {
                free.bytes -= (len * std::mem::size_of::<T>()) as u64;
            }
            got
        };
        let mut staging = match pooled {
            Some(s) => s,
            // SAFETY: the buffer is uninitialised: the copy below writes
            // all of its `len` elements (the source is exactly that long)
            // before `finish` reads it, which waits for the copy first.
            None => unsafe {
                self.dev
                    .context()
                    .alloc_pinned_with_flags::<T>(len, 0)
                    .map_err(driver("cuMemHostAlloc"))?
            },
        };
        let recorded;
        let written = match after {
            Some(ev) => ev,
            None => {
                recorded = self
                    .dev
                    .compute
                    .record_event(None)
                    .map_err(driver("cuEventRecord"))?;
                &recorded
            }
        };
        self.dev
            .d2h
            .wait(written)
            .map_err(driver("cuStreamWaitEvent"))?;
        let began = EventClock::mark(&self.dev.d2h)?;
        self.dev
            .d2h
            .memcpy_dtoh(src.slice(), &mut staging)
            .map_err(driver("cuMemcpyDtoHAsync"))?;
        let span = EventClock::span(&self.dev.d2h, what.to_owned(), began)?;
        self.spans.push(span)?;
        Ok(staging)
    }

    /// Starts copying `src` to the host as `wire` elements, after the
    /// compute stream's work queued so far: a 16-bit `wire` rounds it on
    /// the compute stream first (its cast kernel), so half the bytes
    /// cross.
    pub fn start(&self, what: &str, src: DevBuf, wire: Wire) -> Result<PendingDownload> {
        let inner = match (src, wire) {
            (DevBuf::F32(src), Wire::F32) => {
                let staging = self.queue(&self.free, what, &src, None)?;
                Down::F32(src, staging)
            }
            // Rounded on the device first: half the bytes cross.
            (DevBuf::F32(src), Wire::Bf16) => {
                let half = self.rounded::<bf16>(&src)?;
                // A gradient, of the compute stream's: freed in order.
                drop(src);
                let staging = self.queue(&self.free16, what, &half, None)?;
                Down::Bf16(half, staging)
            }
            (DevBuf::F32(src), Wire::F16) => {
                let half = self.rounded::<f16>(&src)?;
                drop(src);
                let staging = self.queue(&self.freeh, what, &half, None)?;
                Down::F16(half, staging)
            }
            // A 16-bit buffer (a param kept so) comes down as it is.
            (DevBuf::Bf16(half), Wire::Bf16) => {
                let staging = self.queue(&self.free16, what, &half, None)?;
                Down::Bf16(half, staging)
            }
            (DevBuf::F16(half), Wire::F16) => {
                let staging = self.queue(&self.freeh, what, &half, None)?;
                Down::F16(half, staging)
            }
            // Or widened, exactly, then as an fp32 one.
            (DevBuf::Bf16(half), wire) => {
                let wide = self.rounded::<f32>(&half)?;
                let mut d = self.start(what, DevBuf::F32(wide), wire)?;
                d.sources.push(DevBuf::Bf16(half));
                return Ok(d);
            }
            (DevBuf::F16(half), wire) => {
                let wide = self.rounded::<f32>(&half)?;
                let mut d = self.start(what, DevBuf::F32(wide), wire)?;
                d.sources.push(DevBuf::F16(half));
                return Ok(d);
            }
        };
        Ok(PendingDownload {
            inner: Some(inner),
            sources: Vec::new(),
        })
    }

    /// `src` cast to `T` on the compute stream, in a new buffer.
    fn rounded<T: crate::ops::Elem>(
        &self,
        src: &DeviceBuffer<impl crate::ops::Elem>,
    ) -> Result<DeviceBuffer<T>> {
        let mut out = self.dev.alloc_output::<T>("cast download", src.len())?;
        crate::ops::cast(&self.dev, &mut out, src)?;
        Ok(out)
    }

    /// Starts copying a reduce-scatter's sums (fp32) to the host, after
    /// its own event only (not the compute stream's work: the next unit
    /// computes meanwhile); the buffers it read stay with the download
    /// until the copy is done.
    pub fn start_reduced(
        &self,
        what: &str,
        r: crate::collective::Reduced,
    ) -> Result<PendingDownload> {
        let sources = r.keep;
        let Some(sums) = r.sums else {
            // A shard of no elements: nothing to copy; its sends are done
            // before the buffers they read are let go.
            r.done.synchronize().map_err(driver("cuEventSynchronize"))?;
            return Ok(PendingDownload {
                inner: None,
                sources,
            });
        };
        match self.queue(&self.free, what, &sums, Some(&r.done)) {
            Ok(staging) => Ok(PendingDownload {
                inner: Some(Down::F32(sums, staging)),
                sources,
            }),
            Err(e) => {
                // The collective may still read and write these: freed
                // after its event, or leaked if that cannot be waited for.
                if super::retried("cuEventSynchronize", || r.done.synchronize()).is_err() {
                    std::mem::forget(sums);
                    std::mem::forget(sources);
                }
                Err(e)
            }
        }
    }

    /// The downloaded elements (waits for the copy), copied out of the
    /// pinned staging buffer ([`crate::host_copy::to_vec`]).
    pub fn finish(&self, d: PendingDownload) -> Result<Downloaded> {
        self.finish_with(d, |r| match r {
            DownloadedRef::F32(v) => Downloaded::F32(crate::host_copy::to_vec(v)),
            DownloadedRef::Bf16(v) => Downloaded::Bf16(crate::host_copy::to_vec(v)),
            DownloadedRef::F16(v) => Downloaded::F16(crate::host_copy::to_vec(v)),
        })
    }

    /// Waits for the copy and hands `f` the elements where they landed,
    /// in the pinned staging buffer, with no copy out: the caller reads
    /// them straight into what it makes of them (the engine's gradient
    /// sums). The buffer goes back to its pool after `f` returns (the
    /// borrow ends there), and the device buffer it came from is freed.
    /// A download that crossed nothing (a reduced shard of no elements)
    /// hands `f` an empty fp32 slice.
    pub fn finish_with<R>(
        &self,
        mut d: PendingDownload,
        f: impl FnOnce(DownloadedRef<'_>) -> R,
    ) -> Result<R> {
        fn back<
            T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy + Send + Sync,
            R,
        >(
            pool: &Mutex<IdlePinned<T>>,
            cap: u64,
            src: DeviceBuffer<T>,
            staging: PinnedHostSlice<T>,
            f: impl FnOnce(&[T]) -> R,
        ) -> Result<R> {
            // `as_slice` waits for the copy's event: the elements are
            // all there, and nothing writes the buffer while `f` reads.
            // The device buffer they came from is freed first: the copy
            // is complete, and `f` (host work) may take a while.
            let landed = staging.as_slice().map_err(driver("cuEventSynchronize"))?;
            drop(src);
            let out = f(landed);
            let bytes = staging.num_bytes() as u64;
            let mut free = locked(pool);
            if free.bytes + bytes <= cap {
                free.bytes += bytes;
                free.by_len.entry(staging.len()).or_default().push(staging);
            }
            Ok(out)
        }
        match d.inner.take() {
            Some(Down::F32(src, s)) => back(&self.free, self.cap_bytes, src, s, |v| {
                f(DownloadedRef::F32(v))
            }),
            Some(Down::Bf16(src, s)) => back(&self.free16, self.cap_bytes, src, s, |v| {
                f(DownloadedRef::Bf16(v))
            }),
            Some(Down::F16(src, s)) => back(&self.freeh, self.cap_bytes, src, s, |v| {
                f(DownloadedRef::F16(v))
            }),
            None => Ok(f(DownloadedRef::F32(&[]))),
        }
    }

    /// The copies that completed since the last call, on the host's
    /// clock.
    pub fn take_spans(&self) -> Result<Vec<(String, Instant, Instant)>> {
        self.spans.take()
    }
}

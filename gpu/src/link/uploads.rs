//! [`Uploads`]: the host-to-device path of one device, its pinned staging
//! pools, the copies in place from registered pages and the pin reaper,
//! and the destinations let go after their last use (see the [`super`]
//! docs: what may be in flight, and which event frees what).

use super::*;

/// The upload path of one device.
#[derive(Debug)]
pub struct Uploads {
    dev: Arc<Device>,
    pub(super) pool: Mutex<Pool<f32>>,
    pub(super) pool16: Mutex<Pool<bf16>>,
    pub(super) poolh: Mutex<Pool<f16>>,
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

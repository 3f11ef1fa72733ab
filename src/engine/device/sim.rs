//! The simulated device: the device tier's logic run without a GPU.
//!
//! * **Memory** is host memory with its own byte budget for the tier's
//!   params (a unit's inputs, `upload_input`, are its temporaries and not
//!   counted, as a GPU's other share holds them). An upload that
//!   would pass the budget is refused with the numbers, so a tier that
//!   overshoots fails; [`SimProbe::peak_bytes`] says how close it came.
//!   A param counts what a GPU holds of it ([`super::param_device_bytes`]:
//!   2 bytes an element in bf16 or fp16). Its buffer is a `Vec<f32>` all
//!   the same (the scalar references compute on those), so the device
//!   remembers a 16-bit param's bytes by its buffer's address until it is
//!   freed. That
//!   needs its buffers to stay where they are: the host executor writes a
//!   param (the resident path's new weights) in place.
//! * **Staging buffers**: `staging_slots` of them, like the pinned
//!   buffers of a real copy path. An upload takes one (waiting while none
//!   is free) and the copy thread gives it back after the copy. The
//!   buffer travels with its copy job, so it cannot be refilled
//!   mid-copy here: the CUDA pools' rule (a buffer back to its pool only
//!   after its copy's event) has no counterpart in the sim and is not
//!   tested by it. [`SimProbe::violations`] counts what the copy finds
//!   changed, which for staged copies is always nothing; for pinned pages
//!   (below) it is the check.
//! * **Registered pages**: the device has a registrar
//!   ([`SimRegistrar`]; [`SimDevice::without_registration`] has none),
//!   and a param pinned in a page it registered is copied in place
//!   ([`DeviceLink::upload_pinned`]): the copy thread reads the pinned
//!   bytes at the end of the copy's time and only then lets the pin go,
//!   so a write into the page that did not wait for the pin would show
//!   in the copied values. [`SimProbe::direct_copies`] and
//!   [`SimProbe::pins_held`] count them.
//! * **Copies** run on one thread, in order, each taking `copy_delay`
//!   plus its bytes at `h2d_bytes_per_s` (a PCIe link, say), and each is
//!   a span of the `H2d` queue.
//! * **Compute** spans are the host's time in a unit's compute. With a
//!   `compute_delay`, the compute is asynchronous, as a GPU's launches
//!   are: each unit takes at least that long on the device's own clock,
//!   after the units queued before it, while the host goes on; the host
//!   waits for it where a GPU's would ([`DeviceLink::wait_compute`]: a
//!   unit's output coming down), and a download starts after it (but a
//!   reduce-scatter's sums, which wait for their collective only).
//! * **Downloads** (a unit's gradients) run on a second thread, the copy
//!   queue out, each taking its bytes' time as a copy in does, and each is
//!   a span of the `D2h` queue; waiting for one waits for its event.
//! * **Events** complete when the copy does. [`DeviceLink::finish`] waits
//!   for them on the host.
//! * **Compute** is the CUDA kernels' scalar references
//!   ([`tierzero_gpu::unit::HostExec`]), on the buffers the copies made.
//!
//! Dropping the device waits for every queued copy.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use candle_core::DType;
use crossbeam_channel::Sender;
use tierzero_gpu::unit::{GemmDtype, HostExec};

use tierzero_swap::{HostRegistrar, ReadPin};

use super::{DeviceLink, LinkMemory, Staging, Wire};
use crate::engine::comm::Comm;
use crate::model::exec_units::{DeviceQueue, DeviceSpan, HostElems, HostVec};
use crate::model::ModelError;

mod gather;
mod kept;
mod probe;
mod threads;

pub use probe::SimProbe;
use threads::{copy_thread, download_thread, fingerprint};

/// How the simulated device behaves.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Device memory the tier's params may hold.
    pub budget_bytes: u64,
    /// How long each copy takes, besides its bytes.
    pub copy_delay: Duration,
    /// The copies' bandwidth (None: only `copy_delay`).
    pub h2d_bytes_per_s: Option<f64>,
    /// Staging buffers (at least 1).
    pub staging_slots: usize,
    /// The GEMMs' operand dtype.
    pub gemm: GemmDtype,
    /// Fault injection: the `n`th upload (1-based) fails, as a copy the
    /// driver refuses would.
    pub fail_upload: Option<u64>,
    /// The least each unit's compute takes (a slower device: the compute
    /// thread sleeps out the rest of it). Zero: as long as the reference
    /// kernels take.
    pub compute_delay: Duration,
}

impl SimConfig {
    /// A device of `budget_bytes` whose copies and compute take no time
    /// of their own, with `staging_slots` staging buffers, fp32 GEMMs and
    /// no fault.
    pub fn instant(budget_bytes: u64, staging_slots: usize) -> Self {
        SimConfig {
            budget_bytes,
            copy_delay: Duration::ZERO,
            h2d_bytes_per_s: None,
            staging_slots,
            gemm: GemmDtype::F32,
            fail_upload: None,
            compute_delay: Duration::ZERO,
        }
    }
}

/// A completion flag with its result: a copy's elements in
/// ([`Vec<f32>`]) or out ([`HostVec`]).
#[derive(Debug)]
struct Event<T> {
    done: Mutex<Option<T>>,
    cv: Condvar,
}

impl<T> Default for Event<T> {
    fn default() -> Self {
        Event {
            done: Mutex::new(None),
            cv: Condvar::new(),
        }
    }
}

impl<T> Event<T> {
    /// Completes it with `v`.
    fn complete(&self, v: T) {
        *self.done.lock().unwrap_or_else(|p| p.into_inner()) = Some(v);
        self.cv.notify_all();
    }

    /// Waits for its result.
    fn wait(&self) -> T {
        let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(v) = done.take() {
                return v;
            }
            done = self.cv.wait(done).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// What a copy reads.
enum Source {
    /// A staging buffer the upload filled, and its fingerprint then.
    Staged { slab: Vec<f32>, sum: u64 },
    /// Registered host memory, in place: the pin is let go when the copy is
    /// done. Elements of `dtype` (fp32, bf16 or fp16, little-endian).
    Pinned { pin: ReadPin, dtype: DType },
}

/// One copy for the copy thread.
struct Job {
    what: String,
    /// Bytes that cross (2 per 16-bit element).
    bytes: u64,
    src: Source,
    event: Arc<Event<Vec<f32>>>,
}

/// The fp32 elements of little-endian `bytes` of `dtype`: 16-bit ones
/// widened (exactly), or fp32 ones.
fn widen(bytes: &[u8], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    }
}

/// The dtype `host`'s elements cross in.
fn dtype_of(host: HostElems<'_>) -> DType {
    match host {
        HostElems::F32(_) => DType::F32,
        HostElems::Bf16(_) => DType::BF16,
        HostElems::F16(_) => DType::F16,
    }
}

/// The simulated device's registrar: an arena registered through it is
/// one the device copies from in place (it has nothing to set up: its
/// copies read host memory anyway).
#[derive(Debug, Default)]
pub struct SimRegistrar;

impl HostRegistrar for SimRegistrar {
    fn register(&self, _addr: usize, _len_bytes: usize) -> std::io::Result<()> {
        Ok(())
    }

    fn unregister(&self, _addr: usize, _len_bytes: usize) {}
}

/// The device bytes of a param upload of `host` ([`super::param_device_bytes`]).
fn host_device_bytes(host: HostElems<'_>) -> u64 {
    super::param_device_bytes(host.len() as u64, dtype_of(host))
}

/// A buffer's identity while it lives: its address and length.
fn buf_key(buf: &[f32]) -> (usize, usize) {
    (buf.as_ptr() as usize, buf.len())
}

/// What the copy thread and the callers share.
#[derive(Debug, Default)]
struct Shared {
    /// The device bytes of the 16-bit params held, by [`buf_key`].
    narrow: Mutex<std::collections::HashMap<(usize, usize), u64>>,
    used_bytes: AtomicU64,
    peak_bytes: AtomicU64,
    free_slabs: Mutex<Vec<Vec<f32>>>,
    slab_back: Condvar,
    violations: AtomicU64,
    in_flight: AtomicU64,
    peak_in_flight: AtomicU64,
    copies: AtomicU64,
    uploads: AtomicU64,
    /// Copies that read a registered host memory in place, and their bytes.
    direct_copies: AtomicU64,
    direct_bytes: AtomicU64,
    /// Pins held by copies queued or running.
    pins_held: AtomicU64,
    downloads_in_flight: AtomicU64,
    downloads: AtomicU64,
    /// Reduce-scatters of gradients on the device (a unit's, or a
    /// param's kept there: [`DeviceLink::reduce_kept`]).
    reduces: AtomicU64,
    /// Params gathered on the device.
    gathers: AtomicU64,
    /// Gathers of the weights kept on the device after a step
    /// ([`DeviceLink::gather_kept`]: every param's in one).
    kept_gathers: AtomicU64,
    spans: Mutex<Vec<DeviceSpan>>,
    /// With a `compute_delay`: when the units launched so far are done
    /// computing, on the device's own clock.
    compute_until: Mutex<Option<Instant>>,
}

impl Shared {
    /// A staging buffer back in the pool, for an upload waiting for one.
    fn give_slab(&self, slab: Vec<f32>) {
        self.free_slabs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(slab);
        self.slab_back.notify_all();
    }

    fn narrow(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<(usize, usize), u64>> {
        self.narrow.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn compute_until(&self) -> Option<Instant> {
        *self.compute_until.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn push_span(&self, span: DeviceSpan) {
        self.spans
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(span);
    }
}

/// An upload on the simulated device.
#[derive(Debug)]
pub struct SimUpload {
    event: Arc<Event<Vec<f32>>>,
    /// A param kept in 16 bits: its device bytes, remembered with its buffer
    /// by `finish`.
    narrow_bytes: Option<u64>,
}

impl SimUpload {
    /// An upload already done: `buf` is on the device (its memory is host
    /// memory: a collective's result is where the compute reads it).
    fn ready(buf: Vec<f32>) -> Self {
        let event = Arc::new(Event::default());
        event.complete(buf);
        SimUpload {
            event,
            narrow_bytes: None,
        }
    }
}

/// A unit's gradients laid out for their reduce-scatter on the simulated
/// device: every rank's block, and their lengths.
#[derive(Debug)]
pub struct SimPacked {
    full: Vec<f32>,
    blocks: Vec<usize>,
}

/// A download on the simulated device.
#[derive(Debug)]
pub struct SimDownload {
    event: Arc<Event<HostVec>>,
}

/// One download for the download thread.
struct Down {
    what: String,
    data: Vec<f32>,
    wire: Wire,
    event: Arc<Event<HostVec>>,
    /// It starts once the compute queued before it is done.
    after: Option<Instant>,
}

/// The simulated device (see the module docs).
#[derive(Debug)]
pub struct SimDevice {
    cfg: SimConfig,
    shared: Arc<Shared>,
    jobs: Mutex<Option<Sender<Job>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    downs: Mutex<Option<Sender<Down>>>,
    down_thread: Mutex<Option<JoinHandle<()>>>,
    /// Registers pages for copies in place (None: it registers nothing,
    /// and every upload goes through staging).
    registrar: Option<Arc<dyn HostRegistrar>>,
    /// The ranks' collectives its own stand on ([`SimDevice::with_collectives`]).
    comm: Option<Arc<dyn Comm>>,
}

impl SimDevice {
    /// A simulated device with its copy threads.
    pub fn new(cfg: SimConfig) -> Result<Self, ModelError> {
        let slots = cfg.staging_slots.max(1);
        let shared = Arc::new(Shared {
            free_slabs: Mutex::new((0..slots).map(|_| Vec::new()).collect()),
            ..Shared::default()
        });
        let (tx, rx) = crossbeam_channel::unbounded();
        let s = shared.clone();
        let c = cfg.clone();
        let thread = std::thread::Builder::new()
            .name("tierzero-sim-copy".into())
            .spawn(move || copy_thread(rx, s, c))
            .map_err(|e| ModelError::Gpu {
                what: format!("the simulated device's copy thread did not start: {e}"),
            })?;
        let (dtx, drx) = crossbeam_channel::unbounded();
        let (s, c) = (shared.clone(), cfg.clone());
        let down_thread = std::thread::Builder::new()
            .name("tierzero-sim-d2h".into())
            .spawn(move || download_thread(drx, s, c))
            .map_err(|e| ModelError::Gpu {
                what: format!("the simulated device's download thread did not start: {e}"),
            })?;
        Ok(SimDevice {
            cfg: SimConfig {
                staging_slots: slots,
                ..cfg
            },
            shared,
            jobs: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            downs: Mutex::new(Some(dtx)),
            down_thread: Mutex::new(Some(down_thread)),
            registrar: Some(Arc::new(SimRegistrar)),
            comm: None,
        })
    }

    /// The device with collectives of its own among `comm`'s ranks, as
    /// NCCL gives a GPU: with more than one rank it reduce-scatters the
    /// gradients on the device ([`DeviceLink::reduce_grads`]) and
    /// gathers the params there ([`DeviceLink::gather_param`]). Its
    /// memory is host memory, so its all-to-all is `comm`'s own
    /// ([`Comm::reduce_scatter_add_f32`], the same additions in the same
    /// order as on a GPU); only this rank's sums cross its copy queue out.
    /// Its gather is `comm`'s all-gather of the shards' bytes, the whole
    /// param then put on the device by its copy queue in the time of the
    /// shard's bytes (what crosses a GPU's link; the tier counts them).
    pub fn with_collectives(mut self, comm: Arc<dyn Comm>) -> Self {
        self.comm = Some(comm);
        self
    }

    /// The device registering no host memory: every upload goes through
    /// staging, as on a GPU whose registration failed.
    pub fn without_registration(mut self) -> Self {
        self.registrar = None;
        self
    }

    /// Hands `data` to the download thread, to cross as `wire`'s after the
    /// compute queued before it (`after_compute`; else at once: a
    /// reduce-scatter's sums wait for their collective only).
    fn send_down(
        &self,
        what: &str,
        data: Vec<f32>,
        wire: Wire,
        after_compute: bool,
    ) -> Result<SimDownload, ModelError> {
        let event = Arc::new(Event::default());
        self.shared
            .downloads_in_flight
            .fetch_add(1, Ordering::Relaxed);
        let sent = self
            .downs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|tx| {
                tx.send(Down {
                    what: what.to_owned(),
                    data,
                    wire,
                    event: event.clone(),
                    after: self.shared.compute_until().filter(|_| after_compute),
                })
            });
        match sent {
            Some(Ok(())) => Ok(SimDownload { event }),
            _ => {
                self.shared
                    .downloads_in_flight
                    .fetch_sub(1, Ordering::Relaxed);
                Err(ModelError::Gpu {
                    what: "simulated device: the download thread has stopped".into(),
                })
            }
        }
    }

    /// Counts a violation unless `pin` holds exactly `host`'s elements
    /// (a copy in place from a stale page or a wrong range).
    fn check_pin(&self, pin: &ReadPin, host: HostElems<'_>) {
        let b = pin.bytes();
        let same = match host {
            HostElems::F32(v) => {
                b.len() == v.len() * 4
                    && b.chunks_exact(4).zip(v).all(|(c, x)| c == x.to_le_bytes())
            }
            HostElems::Bf16(v) => {
                b.len() == v.len() * 2
                    && b.chunks_exact(2).zip(v).all(|(c, x)| c == x.to_le_bytes())
            }
            HostElems::F16(v) => {
                b.len() == v.len() * 2
                    && b.chunks_exact(2).zip(v).all(|(c, x)| c == x.to_le_bytes())
            }
        };
        if !same {
            self.shared.violations.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A param gathered through the ranks' collective (`gather`: this
    /// rank's shard met with the others'; its memory is host memory),
    /// then the whole put on the device by one upload of the copy queue
    /// that takes the time of the shard's `shard_bytes`.
    fn gather_with(
        &self,
        what: &str,
        shard_bytes: u64,
        gather: impl FnOnce(&dyn Comm) -> Result<HostVec, String>,
    ) -> Result<SimUpload, ModelError> {
        let whole = self.on_collectives(what, &self.shared.gathers, gather)?;
        // The copy takes the shard's time: only it crosses a GPU's link.
        self.send_crossing(what, whole.elems(), true, shard_bytes)
    }

    /// `f` on the ranks' collectives, its own (the device's collectives
    /// are the ranks'), timed as a span of its collectives and counted in
    /// `count`.
    fn on_collectives<T>(
        &self,
        what: &str,
        count: &AtomicU64,
        f: impl FnOnce(&dyn Comm) -> Result<T, String>,
    ) -> Result<T, ModelError> {
        let comm = self.comm.clone().ok_or_else(|| ModelError::Gpu {
            what: format!("{what}: the simulated device has no collectives"),
        })?;
        let start = Instant::now();
        let out = f(&*comm).map_err(|e| ModelError::Gpu {
            what: format!("{what}: {e}"),
        })?;
        self.shared.push_span(DeviceSpan {
            queue: DeviceQueue::Collective,
            name: what.to_owned(),
            start,
            end: Instant::now(),
        });
        count.fetch_add(1, Ordering::Relaxed);
        Ok(out)
    }

    /// A handle on the device's counters, valid after the device is gone.
    pub fn probe(&self) -> SimProbe {
        SimProbe {
            shared: self.shared.clone(),
            slots: self.cfg.staging_slots,
        }
    }

    fn take_slab(&self) -> Vec<f32> {
        let mut free = self
            .shared
            .free_slabs
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(s) = free.pop() {
                return s;
            }
            free = self
                .shared
                .slab_back
                .wait(free)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Queues a copy of `host`; `counted`: into the budget (a param's),
    /// or a unit's temporary (an input), which the budget does not count.
    fn send(
        &self,
        what: &str,
        host: HostElems<'_>,
        counted: bool,
    ) -> Result<SimUpload, ModelError> {
        self.send_crossing(what, host, counted, host.bytes())
    }

    /// [`SimDevice::send`] whose copy takes the time of `cross_bytes`
    /// crossing (a gathered param: its shard's; the rest met on the
    /// device).
    fn send_crossing(
        &self,
        what: &str,
        host: HostElems<'_>,
        counted: bool,
        cross_bytes: u64,
    ) -> Result<SimUpload, ModelError> {
        let bytes = if counted { host_device_bytes(host) } else { 0 };
        self.admit(what, bytes)?;
        let mut slab = self.take_slab();
        slab.clear();
        // 16-bit elements are widened here rather than after the copy (the
        // same exact values); the copy takes the time of the bytes that
        // crossed.
        match host {
            HostElems::F32(v) => slab.extend_from_slice(v),
            HostElems::Bf16(v) => slab.extend(v.iter().map(|x| x.to_f32())),
            HostElems::F16(v) => slab.extend(v.iter().map(|x| x.to_f32())),
        }
        let sum = fingerprint(&slab);
        let mut u = self.queue(what, cross_bytes, bytes, Source::Staged { slab, sum })?;
        u.narrow_bytes = (counted && dtype_of(host) != DType::F32).then_some(bytes);
        Ok(u)
    }

    /// Counts an upload and its `bytes` of device memory in the budget
    /// (or refuses it, with the numbers).
    fn admit(&self, what: &str, bytes: u64) -> Result<(), ModelError> {
        let nth = self.shared.uploads.fetch_add(1, Ordering::Relaxed) + 1;
        if self.cfg.fail_upload == Some(nth) {
            return Err(ModelError::Gpu {
                what: format!("simulated device: upload {nth} ({what}) failed (injected)"),
            });
        }
        self.reserve(what, bytes)
    }

    /// Counts `bytes` of device memory in the budget (or refuses them,
    /// with the numbers).
    fn reserve(&self, what: &str, bytes: u64) -> Result<(), ModelError> {
        let used = self.shared.used_bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
        if used > self.cfg.budget_bytes {
            self.shared.used_bytes.fetch_sub(bytes, Ordering::Relaxed);
            return Err(ModelError::Gpu {
                what: format!(
                    "simulated device: {what} needs {bytes} bytes with {} held of a {} byte budget",
                    used - bytes,
                    self.cfg.budget_bytes
                ),
            });
        }
        self.shared.peak_bytes.fetch_max(used, Ordering::Relaxed);
        Ok(())
    }

    /// Queues the copy of `src` (`cross_bytes` crossing, `bytes` admitted
    /// to the budget, given back if the copy thread has stopped).
    fn queue(
        &self,
        what: &str,
        cross_bytes: u64,
        bytes: u64,
        src: Source,
    ) -> Result<SimUpload, ModelError> {
        let event = Arc::new(Event::default());
        let n = self.shared.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        self.shared.peak_in_flight.fetch_max(n, Ordering::Relaxed);
        let job = Job {
            what: what.to_owned(),
            bytes: cross_bytes,
            src,
            event: event.clone(),
        };
        let refused = match self.jobs.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            Some(tx) => tx.send(job).err().map(|e| e.into_inner()),
            None => Some(job),
        };
        let Some(job) = refused else {
            return Ok(SimUpload {
                event,
                narrow_bytes: None,
            });
        };
        // The staging buffer comes back with the job that was not queued:
        // dropped, the next upload would wait for a free one forever (an
        // error became a hang).
        if let Source::Staged { slab, .. } = job.src {
            self.shared.give_slab(slab);
        }
        self.shared.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.shared.used_bytes.fetch_sub(bytes, Ordering::Relaxed);
        Err(ModelError::Gpu {
            what: "simulated device: the copy thread has stopped".into(),
        })
    }
}

impl DeviceLink for SimDevice {
    type Buf = Vec<f32>;
    type Exec<'a> = HostExec;
    type Upload = SimUpload;
    type Download = SimDownload;
    type Packed = SimPacked;

    fn exec(&self) -> HostExec {
        HostExec {
            gemm: self.cfg.gemm,
        }
    }

    fn describe(&self) -> String {
        let delay = self.cfg.copy_delay;
        let copies = match self.cfg.h2d_bytes_per_s.filter(|r| *r > 0.0) {
            Some(r) if delay.is_zero() => format!("copies at {} GB/s", r / 1e9),
            Some(r) => format!("copies of {delay:?} plus their bytes at {} GB/s", r / 1e9),
            None => format!("copies of {delay:?}"),
        };
        let compute = if self.cfg.compute_delay.is_zero() {
            String::new()
        } else {
            format!(
                ", each unit at least {:?} on its own clock",
                self.cfg.compute_delay
            )
        };
        let reduce = if self.reduce_ranks() > 1 {
            "; params gathered and gradients reduce-scattered on the device"
        } else {
            ""
        };
        format!(
            "simulated device ({} budget, {copies}, {} staging buffers; the kernels' scalar \
             references{compute}), {:?} GEMMs{reduce}",
            crate::units::format_bytes(self.cfg.budget_bytes),
            self.cfg.staging_slots,
            self.cfg.gemm
        )
    }

    fn budget_bytes(&self) -> u64 {
        self.cfg.budget_bytes
    }

    fn upload(&self, what: &str, host: HostElems<'_>) -> Result<SimUpload, ModelError> {
        self.send(what, host, true)
    }

    fn upload_input(&self, what: &str, host: HostElems<'_>) -> Result<SimUpload, ModelError> {
        self.send(what, host, false)
    }

    fn host_registrar(&self) -> Option<Arc<dyn HostRegistrar>> {
        self.registrar.clone()
    }

    fn copy_in_place(
        &self,
        what: &str,
        pin: ReadPin,
        host: HostElems<'_>,
    ) -> Result<SimUpload, ModelError> {
        // The pin must hold the elements the tier asked for: a pin of other
        // bytes (a stale page, a wrong range) is counted, as a staging
        // buffer changed mid-copy is.
        self.check_pin(&pin, host);
        let bytes = host_device_bytes(host);
        self.admit(what, bytes)?;
        let dtype = dtype_of(host);
        self.shared.pins_held.fetch_add(1, Ordering::Relaxed);
        let cross = pin.len_bytes() as u64;
        let mut u = self
            .queue(what, cross, bytes, Source::Pinned { pin, dtype })
            .inspect_err(|_| {
                self.shared.pins_held.fetch_sub(1, Ordering::Relaxed);
            })?;
        u.narrow_bytes = (dtype != DType::F32).then_some(bytes);
        Ok(u)
    }

    fn finish(&self, upload: SimUpload) -> Result<Vec<f32>, ModelError> {
        let buf = upload.event.wait();
        if let Some(bytes) = upload.narrow_bytes.filter(|_| !buf.is_empty()) {
            self.shared.narrow().insert(buf_key(&buf), bytes);
        }
        Ok(buf)
    }

    fn free(&self, buf: Vec<f32>) {
        let bytes = self
            .shared
            .narrow()
            .remove(&buf_key(&buf))
            .unwrap_or(std::mem::size_of_val(buf.as_slice()) as u64);
        self.shared.used_bytes.fetch_sub(bytes, Ordering::Relaxed);
    }

    fn download(&self, what: &str, buf: Vec<f32>, wire: Wire) -> Result<SimDownload, ModelError> {
        // A buffer downloaded is gone from the device (as `free`).
        self.shared.narrow().remove(&buf_key(&buf));
        self.send_down(what, buf, wire, true)
    }

    fn reduce_ranks(&self) -> usize {
        self.comm.as_ref().map_or(1, |c| c.world_size())
    }

    fn collective_rank(&self) -> usize {
        self.comm.as_ref().map_or(0, |c| c.rank())
    }

    fn pack_grads(
        &self,
        what: &str,
        mut grads: Vec<Vec<f32>>,
        wire: Wire,
        counts: &[Vec<usize>],
    ) -> Result<SimPacked, ModelError> {
        for g in &mut grads {
            self.shared.narrow().remove(&buf_key(g));
            // The values a download would have brought: 16-bit gradients
            // rounded on the device (its buffers hold their widened values).
            match wire {
                Wire::Bf16 => g
                    .iter_mut()
                    .for_each(|x| *x = half::bf16::from_f32(*x).to_f32()),
                Wire::F16 => g
                    .iter_mut()
                    .for_each(|x| *x = half::f16::from_f32(*x).to_f32()),
                Wire::F32 => {}
            }
        }
        let parts: Vec<&[f32]> = grads.iter().map(Vec::as_slice).collect();
        let (full, blocks) =
            crate::engine::comm::rank_chunks(&parts, counts).map_err(|e| ModelError::Gpu {
                what: format!("{what}: {e}"),
            })?;
        Ok(SimPacked { full, blocks })
    }

    fn reduce_grads(
        &self,
        what: &str,
        packed: SimPacked,
        acc: Option<&[f32]>,
    ) -> Result<SimDownload, ModelError> {
        let SimPacked { full, blocks } = packed;
        let sums = self.on_collectives(what, &self.shared.reduces, |comm| {
            let mine = blocks.get(comm.rank()).copied().unwrap_or(0);
            let mut sums = match acc {
                Some(a) => a.to_vec(),
                None => vec![0f32; mine],
            };
            comm.reduce_scatter_add_f32(&full, &blocks, &mut sums)
                .map_err(|e| e.to_string())?;
            Ok(sums)
        })?;
        self.send_down(what, sums, Wire::F32, false)
    }

    fn gather_param(
        &self,
        what: &str,
        shard: HostElems<'_>,
        counts: &[usize],
    ) -> Result<SimUpload, ModelError> {
        self.gather_with(what, shard.bytes(), |comm| {
            gather::shards(comm, shard, counts)
        })
    }

    fn gather_in_place(
        &self,
        what: &str,
        pin: ReadPin,
        shard: HostElems<'_>,
        counts: &[usize],
    ) -> Result<SimUpload, ModelError> {
        // The shard is read from the pin itself (the page's range), checked
        // against the elements the tier asked for; the pin goes once the
        // ranks' bytes met, which copied them.
        self.check_pin(&pin, shard);
        let wire = shard.wire();
        let up = self.gather_with(what, pin.len_bytes() as u64, |comm| {
            gather::shards_of_bytes(comm, wire, pin.bytes(), counts)
        })?;
        self.shared.direct_copies.fetch_add(1, Ordering::Relaxed);
        self.shared
            .direct_bytes
            .fetch_add(pin.len_bytes() as u64, Ordering::Relaxed);
        drop(pin);
        Ok(up)
    }

    fn reduce_kept(
        &self,
        what: &str,
        packed: SimPacked,
        accs: Vec<Option<Vec<f32>>>,
        counts: &[Vec<usize>],
    ) -> Result<Vec<Option<SimUpload>>, ModelError> {
        self.reduce_kept_here(what, packed, accs, counts)
    }

    fn gather_kept_ahead(
        &self,
        what: &str,
        wholes: Vec<Vec<f32>>,
        shards: &[Option<&Vec<f32>>],
        counts: &[Vec<usize>],
    ) -> Result<Vec<SimUpload>, ModelError> {
        // Its memory is host memory: gathered at once, each whole where the
        // compute reads it (its buffer, and so its 16-bit count, kept).
        let wholes = self.gather_kept_here(what, wholes, shards, counts)?;
        Ok(wholes.into_iter().map(SimUpload::ready).collect())
    }

    fn alloc_param(&self, what: &str, numel: usize, dtype: DType) -> Result<Vec<f32>, ModelError> {
        let bytes = super::param_device_bytes(numel as u64, dtype);
        self.reserve(what, bytes)?;
        // Unset on a GPU: NaN here, so a range left unwritten shows.
        let buf = vec![f32::NAN; numel];
        if dtype != DType::F32 && !buf.is_empty() {
            self.shared.narrow().insert(buf_key(&buf), bytes);
        }
        Ok(buf)
    }

    fn finish_download(&self, d: SimDownload) -> Result<HostVec, ModelError> {
        Ok(d.event.wait())
    }

    fn memory(&self) -> LinkMemory {
        LinkMemory {
            device_budget_bytes: self.cfg.budget_bytes,
            startup_bytes: 0,
            temporaries_bytes: None,
            staging: Staging::Slots(self.cfg.staging_slots),
            download_idle_bytes: 0,
        }
    }

    fn timed<T>(&self, name: impl FnOnce() -> String, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        let (start, end) = if self.cfg.compute_delay.is_zero() {
            (start, Instant::now())
        } else {
            // Launched: the device computes it after what it has queued,
            // for at least `compute_delay`, while the host goes on.
            let mut until = self
                .shared
                .compute_until
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let begin = until.map_or(start, |u| u.max(start));
            let end = begin + self.cfg.compute_delay.max(start.elapsed());
            *until = Some(end);
            (begin, end)
        };
        self.shared.push_span(DeviceSpan {
            queue: DeviceQueue::Compute,
            name: name(),
            start,
            end,
        });
        out
    }

    fn wait_compute(&self) {
        if let Some(rest) = self
            .shared
            .compute_until()
            .and_then(|t| t.checked_duration_since(Instant::now()))
        {
            std::thread::sleep(rest);
        }
    }

    fn take_spans(&self) -> Vec<DeviceSpan> {
        std::mem::take(&mut *self.shared.spans.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

impl Drop for SimDevice {
    fn drop(&mut self) {
        drop(self.jobs.lock().unwrap_or_else(|p| p.into_inner()).take());
        drop(self.downs.lock().unwrap_or_else(|p| p.into_inner()).take());
        if let Some(t) = self
            .down_thread
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            let _ = t.join();
        }
        if let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use tierzero_swap::{ArenaConfig, LockPolicy, PinnedArena, SharedBuffer};

    use super::*;

    fn device(delay_ms: u64) -> SimDevice {
        SimDevice::new(SimConfig {
            budget_bytes: 1 << 20,
            copy_delay: Duration::from_millis(delay_ms),
            h2d_bytes_per_s: None,
            staging_slots: 1,
            gemm: GemmDtype::F32,
            fail_upload: None,
            compute_delay: Duration::ZERO,
        })
        .unwrap()
    }

    /// A page of 4096 bytes, registered through `registrar` if given.
    fn page(registrar: Option<Arc<dyn HostRegistrar>>) -> SharedBuffer {
        let mut c = ArenaConfig::new(4096, 4096);
        c.lock = LockPolicy::Off;
        c.registrar = registrar;
        SharedBuffer::new(PinnedArena::new(c).unwrap().try_acquire().unwrap())
    }

    fn put(page: &SharedBuffer, v: &[f32]) {
        let (mut g, _) = page.write();
        for (i, x) in v.iter().enumerate() {
            g.as_mut_slice()[4 * i..4 * i + 4].copy_from_slice(&x.to_le_bytes());
        }
    }

    /// With the copy thread gone, an upload fails and gives its staging
    /// buffer back: with one slot, the next upload waited for it forever.
    #[test]
    fn an_upload_refused_by_a_stopped_copy_thread_gives_its_staging_back() {
        let dev = device(0);
        let probe = dev.probe();
        drop(dev.jobs.lock().unwrap().take());
        let host = [1.0f32, 2.0];
        for _ in 0..2 {
            let e = dev.upload("p", HostElems::F32(&host)).err().unwrap();
            assert!(e.to_string().contains("copy thread has stopped"), "{e}");
            assert_eq!(probe.free_staging(), 1);
        }
    }

    #[test]
    fn a_copy_in_place_holds_its_pin_and_a_write_back_waits_for_it() {
        let dev = device(300);
        let probe = dev.probe();
        let page = page(dev.host_registrar());
        put(&page, &[1.0, 2.0, 3.0]);
        let host = [1.0f32, 2.0, 3.0];
        let (up, direct) = dev
            .upload_pinned("p", page.pin(0..12).unwrap(), HostElems::F32(&host))
            .unwrap();
        assert!(direct);
        assert_eq!(probe.pins_held(), 1);
        // The optimizer's new bytes: the write waits for the copy.
        let p2 = page.clone();
        let writer = std::thread::spawn(move || put(&p2, &[9.0, 9.0, 9.0]));
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(
            probe.in_flight(),
            1,
            "the copy ended early: the test saw nothing"
        );
        assert!(
            !writer.is_finished(),
            "a write went ahead of a copy in place"
        );
        writer.join().unwrap();
        // The copy read the bytes of the pin's time, not the new ones.
        assert_eq!(dev.finish(up).unwrap(), vec![1.0, 2.0, 3.0]);
        assert_eq!((probe.pins_held(), probe.direct_copies()), (0, 1));
        assert_eq!(probe.direct_bytes(), 12);
        // No staging buffer was taken.
        assert_eq!(probe.free_staging(), 1);
    }

    #[test]
    fn a_page_the_device_did_not_register_goes_through_staging() {
        let dev = device(0);
        let probe = dev.probe();
        let other: Arc<dyn HostRegistrar> = Arc::new(SimRegistrar);
        for registrar in [None, Some(other)] {
            let page = page(registrar);
            put(&page, &[4.0, 5.0]);
            let host = [4.0f32, 5.0];
            let (up, direct) = dev
                .upload_pinned("p", page.pin(0..8).unwrap(), HostElems::F32(&host))
                .unwrap();
            assert!(!direct);
            // The pin was let go at once: a write does not wait.
            assert_eq!(page.pins(), 0);
            assert_eq!(dev.finish(up).unwrap(), vec![4.0, 5.0]);
        }
        assert_eq!(probe.direct_copies(), 0);
        // Pinned bytes that are not the host's elements (an fp16 page for
        // an fp32 upload, say) go through staging too.
        let dev = device(0);
        let page = page(dev.host_registrar());
        let host = [4.0f32, 5.0];
        let (up, direct) = dev
            .upload_pinned("p", page.pin(0..4).unwrap(), HostElems::F32(&host))
            .unwrap();
        assert!(!direct);
        assert_eq!(dev.finish(up).unwrap(), vec![4.0, 5.0]);
    }

    #[test]
    fn a_pin_of_other_bytes_than_the_upload_s_is_counted() {
        let dev = device(0);
        let probe = dev.probe();
        let page = page(dev.host_registrar());
        put(&page, &[1.0, 2.0]);
        let host = [1.0f32, 7.0];
        let (up, _) = dev
            .upload_pinned("p", page.pin(0..8).unwrap(), HostElems::F32(&host))
            .unwrap();
        dev.free(dev.finish(up).unwrap());
        assert_eq!(probe.violations(), 1);
    }

    #[test]
    fn bf16_pages_cross_as_bf16_and_a_device_dropped_mid_copy_lets_its_pins_go() {
        let dev = device(50);
        let probe = dev.probe();
        let page = page(dev.host_registrar());
        let host: Vec<half::bf16> = [1.5f32, -2.25, 3.0]
            .iter()
            .map(|&x| half::bf16::from_f32(x))
            .collect();
        {
            let (mut g, _) = page.write();
            for (i, x) in host.iter().enumerate() {
                g.as_mut_slice()[2 * i..2 * i + 2].copy_from_slice(&x.to_le_bytes());
            }
        }
        let (up, direct) = dev
            .upload_pinned("b", page.pin(0..6).unwrap(), HostElems::Bf16(&host))
            .unwrap();
        assert!(direct);
        assert_eq!(dev.finish(up).unwrap(), vec![1.5, -2.25, 3.0]);
        // Two copies queued, the device dropped before they ran.
        for _ in 0..2 {
            let (up, _) = dev
                .upload_pinned("b", page.pin(0..6).unwrap(), HostElems::Bf16(&host))
                .unwrap();
            drop(up);
        }
        assert!(page.pins() > 0);
        drop(dev);
        assert_eq!((page.pins(), probe.pins_held()), (0, 0));
    }
}

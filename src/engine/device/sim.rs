//! The simulated device: the device tier's logic run without a GPU.
//!
//! * **Memory** is host memory with its own byte budget for the tier's
//!   params (a unit's inputs, `upload_input`, are its temporaries and not
//!   counted, as a GPU's other share holds them). An upload that
//!   would pass the budget is refused with the numbers, so a tier that
//!   overshoots fails; [`SimProbe::peak_bytes`] says how close it came.
//! * **Staging buffers**: `staging_slots` of them, like the pinned
//!   buffers of a real copy path. An upload takes one (waiting while none
//!   is free) and the copy thread gives it back after the copy. The copy
//!   checks that the buffer still holds what the upload put in it, so a
//!   buffer refilled mid-copy is counted ([`SimProbe::violations`]).
//! * **Copies** run on one thread, in order, each taking `copy_delay`
//!   plus its bytes at `h2d_bytes_per_s` (a PCIe link, say), and each is
//!   a span of the `H2d` queue.
//! * **Compute** spans are the host's time in a unit's compute. With a
//!   `compute_delay`, the compute is asynchronous, as a GPU's launches
//!   are: each unit takes at least that long on the device's own clock,
//!   after the units queued before it, while the host goes on; the host
//!   waits for it where a GPU's would ([`DeviceLink::wait_compute`]: a
//!   unit's output coming down), and a download starts after it.
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

use crossbeam_channel::{Receiver, Sender};
use tierzero_gpu::unit::{GemmDtype, HostExec};

use super::{DeviceLink, LinkMemory, Staging};
use crate::model::exec_units::{DeviceQueue, DeviceSpan, HostElems, HostVec};
use crate::model::ModelError;

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

/// One copy for the copy thread.
struct Job {
    what: String,
    /// Bytes that cross (2 per bf16 element).
    bytes: u64,
    slab: Vec<f32>,
    sum: u64,
    event: Arc<Event<Vec<f32>>>,
}

/// What the copy thread and the callers share.
#[derive(Debug, Default)]
struct Shared {
    used_bytes: AtomicU64,
    peak_bytes: AtomicU64,
    free_slabs: Mutex<Vec<Vec<f32>>>,
    slab_back: Condvar,
    violations: AtomicU64,
    in_flight: AtomicU64,
    peak_in_flight: AtomicU64,
    copies: AtomicU64,
    uploads: AtomicU64,
    downloads_in_flight: AtomicU64,
    downloads: AtomicU64,
    spans: Mutex<Vec<DeviceSpan>>,
    /// With a `compute_delay`: when the units launched so far are done
    /// computing, on the device's own clock.
    compute_until: Mutex<Option<Instant>>,
}

impl Shared {
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

/// The simulated device's counters (see [`SimDevice::probe`]).
#[derive(Debug, Clone)]
pub struct SimProbe {
    shared: Arc<Shared>,
    slots: usize,
}

impl SimProbe {
    /// Device bytes held now.
    pub fn used_bytes(&self) -> u64 {
        self.shared.used_bytes.load(Ordering::Relaxed)
    }

    /// The most device bytes held at once.
    pub fn peak_bytes(&self) -> u64 {
        self.shared.peak_bytes.load(Ordering::Relaxed)
    }

    /// Staging buffers not lent to a copy.
    pub fn free_staging(&self) -> usize {
        self.shared
            .free_slabs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }

    /// Staging buffers in all.
    pub fn staging_slots(&self) -> usize {
        self.slots
    }

    /// Copies that found their staging buffer changed since the upload.
    pub fn violations(&self) -> u64 {
        self.shared.violations.load(Ordering::Relaxed)
    }

    /// Copies queued or running now.
    pub fn in_flight(&self) -> u64 {
        self.shared.in_flight.load(Ordering::Relaxed)
    }

    /// The most copies queued or running at once.
    pub fn peak_in_flight(&self) -> u64 {
        self.shared.peak_in_flight.load(Ordering::Relaxed)
    }

    /// Copies completed.
    pub fn copies(&self) -> u64 {
        self.shared.copies.load(Ordering::Relaxed)
    }

    /// Uploads asked for (refused ones included).
    pub fn uploads(&self) -> u64 {
        self.shared.uploads.load(Ordering::Relaxed)
    }

    /// Downloads queued or running now.
    pub fn downloads_in_flight(&self) -> u64 {
        self.shared.downloads_in_flight.load(Ordering::Relaxed)
    }

    /// Downloads completed.
    pub fn downloads(&self) -> u64 {
        self.shared.downloads.load(Ordering::Relaxed)
    }
}

/// An upload on the simulated device.
#[derive(Debug)]
pub struct SimUpload {
    event: Arc<Event<Vec<f32>>>,
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
    narrow: bool,
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
}

/// An order-sensitive hash of a buffer's bits.
fn fingerprint(v: &[f32]) -> u64 {
    v.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, x| {
        (h ^ u64::from(x.to_bits())).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// How long the copy of `bytes` takes.
fn copy_time(cfg: &SimConfig, bytes: u64) -> Duration {
    let rate = cfg
        .h2d_bytes_per_s
        .filter(|r| r.is_finite() && *r > 0.0)
        .map_or(Duration::ZERO, |r| {
            Duration::from_secs_f64(bytes as f64 / r)
        });
    cfg.copy_delay + rate
}

fn copy_thread(rx: Receiver<Job>, shared: Arc<Shared>, cfg: SimConfig) {
    for job in rx {
        let start = Instant::now();
        std::thread::sleep(copy_time(&cfg, job.bytes));
        if fingerprint(&job.slab) != job.sum {
            shared.violations.fetch_add(1, Ordering::Relaxed);
        }
        let dst = job.slab.clone();
        shared.push_span(DeviceSpan {
            queue: DeviceQueue::H2d,
            name: job.what,
            start,
            end: Instant::now(),
        });
        // The counters and the staging buffer first, then the event: who
        // waited on it sees the device with this copy done.
        shared.in_flight.fetch_sub(1, Ordering::Relaxed);
        shared.copies.fetch_add(1, Ordering::Relaxed);
        shared
            .free_slabs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(job.slab);
        shared.slab_back.notify_all();
        job.event.complete(dst);
    }
}

fn download_thread(rx: Receiver<Down>, shared: Arc<Shared>, cfg: SimConfig) {
    for d in rx {
        if let Some(rest) = d
            .after
            .and_then(|t| t.checked_duration_since(Instant::now()))
        {
            std::thread::sleep(rest);
        }
        let start = Instant::now();
        // With `narrow`, rounded to bf16 on the device: half the bytes.
        let out = if d.narrow {
            HostVec::Bf16(d.data.iter().map(|&x| half::bf16::from_f32(x)).collect())
        } else {
            HostVec::F32(d.data)
        };
        std::thread::sleep(copy_time(&cfg, out.bytes()));
        shared.push_span(DeviceSpan {
            queue: DeviceQueue::D2h,
            name: d.what,
            start,
            end: Instant::now(),
        });
        d.event.complete(out);
        shared.downloads_in_flight.fetch_sub(1, Ordering::Relaxed);
        shared.downloads.fetch_add(1, Ordering::Relaxed);
    }
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
        })
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
        // The destination holds fp32 elements, whatever crossed.
        let bytes = if counted { host.len() as u64 * 4 } else { 0 };
        let nth = self.shared.uploads.fetch_add(1, Ordering::Relaxed) + 1;
        if self.cfg.fail_upload == Some(nth) {
            return Err(ModelError::Gpu {
                what: format!("simulated device: upload {nth} ({what}) failed (injected)"),
            });
        }
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
        let mut slab = self.take_slab();
        slab.clear();
        // bf16 is widened here rather than after the copy (the same exact
        // values); the copy takes the time of the bytes that crossed.
        match host {
            HostElems::F32(v) => slab.extend_from_slice(v),
            HostElems::Bf16(v) => slab.extend(v.iter().map(|x| x.to_f32())),
        }
        let sum = fingerprint(&slab);
        let event = Arc::new(Event::default());
        let n = self.shared.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        self.shared.peak_in_flight.fetch_max(n, Ordering::Relaxed);
        let sent = self
            .jobs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|tx| {
                tx.send(Job {
                    what: what.to_owned(),
                    bytes: host.bytes(),
                    slab,
                    sum,
                    event: event.clone(),
                })
            });
        match sent {
            Some(Ok(())) => Ok(SimUpload { event }),
            _ => {
                self.shared.in_flight.fetch_sub(1, Ordering::Relaxed);
                self.shared.used_bytes.fetch_sub(bytes, Ordering::Relaxed);
                Err(ModelError::Gpu {
                    what: "simulated device: the copy thread has stopped".into(),
                })
            }
        }
    }
}

impl DeviceLink for SimDevice {
    type Buf = Vec<f32>;
    type Exec<'a> = HostExec;
    type Upload = SimUpload;
    type Download = SimDownload;

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
        format!(
            "simulated device ({} budget, {copies}, {} staging buffers; the kernels' scalar \
             references{compute}), {:?} GEMMs",
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

    fn finish(&self, upload: SimUpload) -> Result<Vec<f32>, ModelError> {
        Ok(upload.event.wait())
    }

    fn free(&self, buf: Vec<f32>) {
        let bytes = std::mem::size_of_val(buf.as_slice()) as u64;
        self.shared.used_bytes.fetch_sub(bytes, Ordering::Relaxed);
    }

    fn download(&self, what: &str, buf: Vec<f32>, narrow: bool) -> Result<SimDownload, ModelError> {
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
                    data: buf,
                    narrow,
                    event: event.clone(),
                    after: self.shared.compute_until(),
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

    fn finish_download(&self, d: SimDownload) -> Result<HostVec, ModelError> {
        Ok(d.event.wait())
    }

    fn memory(&self) -> LinkMemory {
        LinkMemory {
            device_budget_bytes: self.cfg.budget_bytes,
            startup_bytes: 0,
            temporaries_bytes: None,
            staging: Staging::Slots(self.cfg.staging_slots),
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

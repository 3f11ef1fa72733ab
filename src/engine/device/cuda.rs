//! [`CudaLink`]: the device tier on a GPU (`tierzero_gpu`). The uploads
//! are [`tierzero_gpu::link::Uploads`]: pinned staging, the h2d stream,
//! and a compute stream that waits on each copy's event. The gradients'
//! downloads are [`tierzero_gpu::link::Downloads`] on the d2h stream. The compute is
//! the CUDA units ([`tierzero_gpu::unit::CudaExec`]).
//!
//! A param whose bytes are in a cpu-tier page crosses from the page
//! itself: the trainer maps the pages with this link's registrar
//! ([`tierzero_gpu::host_register::HostRegistration`]), and
//! [`DeviceLink::upload_pinned`] copies the pinned range in place
//! ([`tierzero_gpu::link::Uploads::start_pinned`]), with no staging fill.
//!
//! # Its share of the device
//!
//! The params on the tier may hold half of the device budget left after
//! start-up (`tierzero.device_budget_bytes`, or the free memory less 5%,
//! less the kernels' and cuBLAS's workspace). The other half is left for
//! the unit's activations and temporaries. The plan prints both halves. A
//! unit whose temporaries do not fit fails with the device's
//! `OutOfBudget`, which gives the numbers.

use std::sync::Arc;

use tierzero_gpu::collective::{CudaEvent, DeviceComm, Packed};
use tierzero_gpu::device::Device;
use tierzero_gpu::host_register::HostRegistration;
use tierzero_gpu::link::{
    Downloaded, DownloadedRef, Downloads, EventClock, PendingDownload, PendingUpload, Role,
    SpanLog, Uploads, Wire,
};
use tierzero_gpu::unit::{CudaExec, DevBuf, GemmDtype};

use tierzero_swap::{HostRegistrar, ReadPin};

use super::{DeviceLink, LinkMemory, Staging};
use crate::model::exec_units::{gpu_err, DeviceQueue, DeviceSpan, HostElems, HostVec};
use crate::model::ModelError;

/// Pinned staging memory for the uploads: a few units' worth is enough
/// for a window one unit ahead.
pub const STAGING_CAP_BYTES: u64 = 256 << 20;

/// The device tier's link to a GPU.
#[derive(Debug)]
pub struct CudaLink {
    uploads: Uploads,
    downloads: Downloads,
    gemm: GemmDtype,
    budget_bytes: u64,
    startup_bytes: u64,
    /// Units' compute between two events on the compute stream.
    compute_spans: SpanLog,
    /// Reduce-scatters between two events on the collectives' stream.
    collective_spans: SpanLog,
    /// Registers the cpu tier's pinned pages with the device.
    registrar: Arc<dyn HostRegistrar>,
    /// The ranks' collectives on this GPU's buffers: with several ranks,
    /// the gradients are reduce-scattered here
    /// ([`CudaLink::with_collectives`]), and the longest wait for a
    /// reduce-scatter's sums.
    collective: Option<(DeviceComm, std::time::Duration)>,
}

impl CudaLink {
    /// The link to `dev`; the tier's params may hold half of what its
    /// budget has left.
    pub fn new(dev: Arc<Device>, gemm: GemmDtype) -> Result<Self, ModelError> {
        let b = dev.budget();
        let startup_bytes = b.used_bytes();
        let budget_bytes = b.budget_bytes().saturating_sub(startup_bytes) / 2;
        Ok(CudaLink {
            downloads: Downloads::new(dev.clone(), STAGING_CAP_BYTES).map_err(gpu_err)?,
            compute_spans: SpanLog::new(&dev).map_err(gpu_err)?,
            collective_spans: SpanLog::new(&dev).map_err(gpu_err)?,
            registrar: Arc::new(HostRegistration::new(dev.clone())),
            uploads: Uploads::new(dev, STAGING_CAP_BYTES).map_err(gpu_err)?,
            gemm,
            budget_bytes,
            startup_bytes,
            collective: None,
        })
    }

    /// The link with the ranks' collectives on this GPU's buffers
    /// (`comm`, built on its device): with more than one rank, each param
    /// crosses as this rank's shard and is gathered on the GPU
    /// ([`DeviceLink::gather_param`]), and a unit's gradients are
    /// reduce-scattered on the GPU and only this rank's sums come down
    /// ([`DeviceLink::reduce_grads`]); each waited for at most `timeout`
    /// (past it a rank has died or hangs).
    pub fn with_collectives(mut self, comm: DeviceComm, timeout: std::time::Duration) -> Self {
        self.collective = Some((comm, timeout));
        self
    }

    /// The timeline's span of a collective that began at `began` (a
    /// timing event on its stream), its end recorded now, after its work.
    fn collective_span(&self, comm: &DeviceComm, what: &str, began: Option<CudaEvent>) {
        if let Some(b) = began {
            if let Ok(span) = EventClock::span(comm.stream(), what.to_owned(), b) {
                let _ = self.collective_spans.push(span);
            }
        }
    }

    /// `upload`, its gather waited for when it is one: a gathered
    /// param's event is NCCL's, waited for with a deadline (a dead peer
    /// never completes it) before the compute is ordered after it.
    fn gather_waited(&self, upload: PendingUpload) -> Result<PendingUpload, ModelError> {
        if !upload.is_gathered() {
            return Ok(upload);
        }
        let (comm, timeout) = self.collective("a param's gather")?;
        comm.wait_gathered(upload, *timeout).map_err(gpu_err)
    }

    fn collective(&self, what: &str) -> Result<&(DeviceComm, std::time::Duration), ModelError> {
        self.collective.as_ref().ok_or_else(|| ModelError::Gpu {
            what: format!("{what}: no collectives on this GPU's buffers"),
        })
    }

    /// The link with the tier's budget agreed among `comm`'s ranks: the
    /// smallest rank's (a collective: every rank calls it at the same
    /// point). Each GPU's budget is its own free memory unless
    /// `tierzero.device_budget_bytes` sets it, and the tier's decisions
    /// (what to stage, evict, refuse) follow the budget; with params
    /// gathered on the GPUs each decision issues or skips a collective,
    /// so every rank must take the same ones. One rank: as it is.
    pub fn with_budget_agreed(
        mut self,
        comm: &dyn crate::engine::comm::Comm,
    ) -> Result<Self, crate::engine::EngineError> {
        let least = crate::engine::comm::least_among_ranks(comm, self.budget_bytes)?;
        if least < self.budget_bytes {
            tracing::info!(
                own_bytes = self.budget_bytes,
                agreed_bytes = least,
                "the device tier's budget is the smallest rank's"
            );
            self.budget_bytes = least;
        }
        Ok(self)
    }

    /// A param gathered on the GPUs: this rank's shard of `shard_len`
    /// elements (`counts[r]` of rank `r`) started into its range of the
    /// whole by `start(offset, numel)`, then the exchange
    /// ([`DeviceComm::gather`]), a span of the collectives' stream.
    fn gathered(
        &self,
        what: &str,
        shard_len: usize,
        counts: &[usize],
        start: impl FnOnce(usize, usize) -> tierzero_gpu::Result<PendingUpload>,
    ) -> Result<PendingUpload, ModelError> {
        let (comm, _) = self.collective(what)?;
        let numel: usize = counts.iter().sum();
        if counts.len() != comm.world() {
            return Err(ModelError::Gpu {
                what: format!("{what}: cut as {counts:?} for {} ranks", comm.world()),
            });
        }
        let offset = crate::engine::comm::check_counts(what, comm.rank(), counts, shard_len, numel)
            .map_err(|e| ModelError::Gpu {
                what: e.to_string(),
            })?;
        let up = start(offset, numel).map_err(gpu_err)?;
        let (up, began) = comm.gather(self.device(), up, counts).map_err(gpu_err)?;
        if let Some(b) = began {
            if let Ok(span) = EventClock::span(comm.stream(), what.to_owned(), b) {
                let _ = self.collective_spans.push(span);
            }
        }
        Ok(up)
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        self.uploads.device()
    }

    /// Starts the upload of `host` for `role`, in the dtype it crosses in.
    fn start(
        &self,
        what: &str,
        host: HostElems<'_>,
        role: Role,
    ) -> Result<PendingUpload, ModelError> {
        match host {
            HostElems::F32(v) => self.uploads.start(what, v, role),
            HostElems::Bf16(v) => self.uploads.start_bf16(what, v, role),
            HostElems::F16(v) => self.uploads.start_f16(what, v, role),
        }
        .map_err(gpu_err)
    }
}

/// The failure of building the GPUs' communicator on `rank` of `world`.
fn init_failed(rank: usize, world: usize, reason: String) -> crate::engine::EngineError {
    crate::engine::EngineError::Comm {
        rank,
        world,
        op: "ncclCommInitRank (the GPUs' buffers)",
        reason,
    }
}

/// Rank 0's NCCL id, on every rank of `comm` (a collective: every rank
/// calls it at the same point). Every rank first reports whether NCCL
/// loads (rank 0: whether it made the id), and if one cannot, every rank
/// fails here at once, the others naming it, instead of leaving them in
/// `ncclCommInitRank`.
pub fn nccl_id(
    comm: &dyn crate::engine::comm::Comm,
) -> Result<[u8; tierzero_gpu::collective::ID_BYTES], crate::engine::EngineError> {
    use crate::engine::comm::{agree, all_gather_var};
    let (rank, world) = (comm.rank(), comm.world_size());
    let local = if rank == 0 {
        DeviceComm::unique_id().map(|id| id.to_vec())
    } else {
        tierzero_gpu::collective::nccl_available().map(|()| Vec::new())
    };
    let mine = agree(
        comm,
        "NCCL on the GPUs' buffers",
        local.map_err(|e| init_failed(rank, world, e.to_string())),
    )?;
    let ids = all_gather_var(comm, &mine)?;
    ids.first()
        .and_then(|b| b.as_slice().try_into().ok())
        .ok_or_else(|| init_failed(rank, world, "rank 0 handed out no NCCL id".into()))
}

/// The ranks' collectives on `dev`'s buffers, among `comm`'s ranks (None
/// with one rank), for [`CudaLink::with_collectives`]. Every rank calls it
/// at the same point: rank 0's id reaches every rank ([`nccl_id`]), then
/// each builds its communicator, on a guarded thread, and warms it up
/// (one all-to-all of one element: NCCL connects to the peers then, not
/// mid-step; [`DeviceComm::warm_up`]), waiting at most `timeout` for every
/// rank to join (a rank that failed between the two leaves the others
/// there; that thread is then left behind, stuck in NCCL, as the host's
/// NCCL communicator leaves its own).
pub fn device_collectives(
    dev: &Arc<Device>,
    comm: &dyn crate::engine::comm::Comm,
    timeout: std::time::Duration,
) -> Result<Option<DeviceComm>, crate::engine::EngineError> {
    let (rank, world) = (comm.rank(), comm.world_size());
    if world == 1 {
        return Ok(None);
    }
    let failed = |reason: String| init_failed(rank, world, reason);
    let id = nccl_id(comm)?;
    let (tx, rx) = crossbeam_channel::bounded(1);
    let device = dev.clone();
    crate::gpu::spawn_guarded("nccl-init", move || {
        let built = DeviceComm::new(&device, &id, rank, world)
            .and_then(|c| c.warm_up(&device, timeout).map(|()| c));
        let _ = tx.send(built);
    })
    .map_err(|e| failed(e.to_string()))?;
    match rx.recv_timeout(timeout) {
        Ok(built) => Ok(Some(built.map_err(|e| failed(e.to_string()))?)),
        Err(crossbeam_channel::RecvTimeoutError::Timeout) => Err(failed(format!(
            "not every rank joined within {:.0} s: a rank has died or hangs; stopping (set \
             TIERZERO_COMM_TIMEOUT_S to wait longer)",
            timeout.as_secs_f64()
        ))),
        Err(crossbeam_channel::RecvTimeoutError::Disconnected) => Err(failed(
            "the thread building the communicator ended without an answer".into(),
        )),
    }
}

impl DeviceLink for CudaLink {
    type Buf = DevBuf;
    type Exec<'a> = CudaExec<'a>;
    type Upload = PendingUpload;
    type Download = PendingDownload;
    type Packed = Packed;

    fn exec(&self) -> CudaExec<'_> {
        CudaExec {
            dev: self.uploads.device(),
            gemm: self.gemm,
        }
    }

    fn describe(&self) -> String {
        let d = self.uploads.device();
        let b = d.budget();
        let reduce = match &self.collective {
            Some((c, _)) if c.world() > 1 => format!(
                "; params gathered and gradients reduce-scattered on the GPU among {} ranks \
                 (NCCL)",
                c.world()
            ),
            _ => String::new(),
        };
        format!(
            "cuda:{} {} (sm_{}), {:?} GEMMs; device budget {} ({} for the params on the \
             device tier, the rest for activations, temporaries and cuBLAS){reduce}",
            d.ordinal(),
            d.name(),
            d.arch(),
            self.gemm,
            crate::units::format_bytes(b.budget_bytes()),
            crate::units::format_bytes(self.budget_bytes),
        )
    }

    fn budget_bytes(&self) -> u64 {
        self.budget_bytes
    }

    fn whole_budget_for(&self, params_bytes: u64) -> u64 {
        // [`CudaLink::new`]: half of what start-up's workspaces leave.
        params_bytes
            .saturating_mul(2)
            .saturating_add(self.startup_bytes)
    }

    fn upload(&self, what: &str, host: HostElems<'_>) -> Result<PendingUpload, ModelError> {
        self.start(what, host, Role::Param)
    }

    fn host_registrar(&self) -> Option<Arc<dyn HostRegistrar>> {
        Some(self.registrar.clone())
    }

    fn copy_in_place(
        &self,
        what: &str,
        pin: ReadPin,
        host: HostElems<'_>,
    ) -> Result<PendingUpload, ModelError> {
        self.uploads
            .start_pinned(what, pin, host.wire())
            .map_err(gpu_err)
    }

    fn bind_upload_thread(&self) -> Result<(), ModelError> {
        // cudarc binds the context at most calls; an event query (the
        // staging pool's first look) does not.
        self.device()
            .context()
            .bind_to_thread()
            .map_err(|e| ModelError::Gpu {
                what: format!("cuCtxSetCurrent on the device tier's upload thread: {e}"),
            })
    }

    fn upload_input(&self, what: &str, host: HostElems<'_>) -> Result<PendingUpload, ModelError> {
        // The device budget counts it with the other temporaries. The
        // units' activations are fp32: a 16-bit one is widened on arrival.
        self.start(what, host, Role::Input)
    }

    fn finish(&self, upload: PendingUpload) -> Result<DevBuf, ModelError> {
        let upload = self.gather_waited(upload)?;
        self.uploads.finish(upload).map_err(gpu_err)
    }

    fn discard(&self, upload: PendingUpload) -> Result<(), ModelError> {
        // As `finish`, less taking an earlier operation's failure.
        let upload = self.gather_waited(upload)?;
        self.uploads.discard(upload).map_err(gpu_err)
    }

    fn free(&self, buf: DevBuf) {
        // Not before the compute queued so far (its last use) is done, so
        // that the upload stream does not wait for it.
        if let Err(e) = self.uploads.free_after_compute(buf) {
            tracing::warn!(error = %e, "a device buffer was freed without its event");
        }
    }

    fn download(&self, what: &str, buf: DevBuf, wire: Wire) -> Result<PendingDownload, ModelError> {
        self.downloads.start(what, buf, wire).map_err(gpu_err)
    }

    fn reduce_ranks(&self) -> usize {
        self.collective.as_ref().map_or(1, |(c, _)| c.world())
    }

    fn collective_rank(&self) -> usize {
        self.collective.as_ref().map_or(0, |(c, _)| c.rank())
    }

    fn pack_grads(
        &self,
        what: &str,
        grads: Vec<DevBuf>,
        wire: Wire,
        counts: &[Vec<usize>],
    ) -> Result<Packed, ModelError> {
        let (comm, _) = self.collective(what)?;
        let mut wide = Vec::with_capacity(grads.len());
        for g in &grads {
            match g {
                DevBuf::F32(b) => wide.push(b),
                _ => {
                    return Err(ModelError::Gpu {
                        what: format!("{what}: a 16-bit gradient buffer (they are fp32)"),
                    })
                }
            }
        }
        // The gradients are the compute stream's: freed there, after the
        // copies that read them.
        comm.pack(self.device(), &wide, counts, wire)
            .map_err(gpu_err)
    }

    fn reduce_grads(
        &self,
        what: &str,
        packed: Packed,
        acc: Option<&[f32]>,
    ) -> Result<PendingDownload, ModelError> {
        let (comm, timeout) = self.collective(what)?;
        let mut reduced = comm.reduce(self.device(), packed, acc).map_err(gpu_err)?;
        self.collective_span(comm, what, reduced.began.take());
        let reduced = comm.wait(reduced, *timeout).map_err(gpu_err)?;
        self.downloads.start_reduced(what, reduced).map_err(gpu_err)
    }

    fn reduce_kept(
        &self,
        what: &str,
        packed: Packed,
        accs: Vec<Option<DevBuf>>,
        counts: &[Vec<usize>],
    ) -> Result<Vec<Option<PendingUpload>>, ModelError> {
        let (comm, _) = self.collective(what)?;
        let accs = accs
            .into_iter()
            .map(|a| a.map(DevBuf::into_f32).transpose())
            .collect::<Result<Vec<_>, _>>()
            .map_err(gpu_err)?;
        let (sums, began) = comm
            .reduce_onto(self.device(), packed, accs, counts)
            .map_err(gpu_err)?;
        self.collective_span(comm, what, began);
        // Each param's sums in flight: its `finish` waits for them with
        // the deadline. The buffers the collective used are the
        // communicator's to free.
        Ok(sums
            .into_iter()
            .map(|s| s.map(|(sums, done)| PendingUpload::collected(DevBuf::F32(sums), done)))
            .collect())
    }

    fn kept_running_sums(&self, u: PendingUpload) -> Result<DevBuf, ModelError> {
        // Written on the collectives' stream, which the next reduce runs
        // on: no wait. Anything else is finished as usual.
        if !u.is_collected() {
            return self.finish(u);
        }
        u.into_collected().ok_or_else(|| ModelError::Gpu {
            what: "running gradient sums without their buffer".into(),
        })
    }

    fn gather_kept_ahead(
        &self,
        what: &str,
        wholes: Vec<DevBuf>,
        shards: &[Option<&DevBuf>],
        counts: &[Vec<usize>],
    ) -> Result<Vec<PendingUpload>, ModelError> {
        let (comm, _) = self.collective(what)?;
        let tierzero_gpu::collective::Gathered {
            wholes,
            done,
            began,
        } = comm
            .gather_kept(self.device(), wholes, shards, counts)
            .map_err(gpu_err)?;
        self.collective_span(comm, what, began);
        // One event for each whole, all after the exchanges: its `finish`
        // waits for it with the deadline, then orders the compute after.
        let mut done = Some(done);
        let mut ups = Vec::with_capacity(wholes.len());
        let mut wholes = wholes.into_iter();
        for w in wholes.by_ref() {
            let ev = match done.take() {
                Some(ev) => ev,
                None => match comm.stream().record_event(None) {
                    Ok(ev) => ev,
                    Err(e) => {
                        // The rest are leaked with the gather's work in
                        // flight; those made so far leak on their own.
                        std::mem::forget((w, wholes.collect::<Vec<_>>()));
                        return Err(ModelError::Gpu {
                            what: format!("{what}: cuEventRecord: {e:?}"),
                        });
                    }
                },
            };
            ups.push(PendingUpload::collected(w, ev));
        }
        Ok(ups)
    }

    fn alloc_param(
        &self,
        what: &str,
        numel: usize,
        dtype: candle_core::DType,
    ) -> Result<DevBuf, ModelError> {
        let dev = self.device();
        let buf = match dtype {
            candle_core::DType::BF16 => dev
                .alloc_output::<half::bf16>(what, numel)
                .map(DevBuf::Bf16),
            candle_core::DType::F16 => dev.alloc_output::<half::f16>(what, numel).map(DevBuf::F16),
            _ => dev.alloc_output::<f32>(what, numel).map(DevBuf::F32),
        };
        buf.map_err(gpu_err)
    }

    fn gather_param(
        &self,
        what: &str,
        shard: HostElems<'_>,
        counts: &[usize],
    ) -> Result<PendingUpload, ModelError> {
        self.gathered(what, shard.len(), counts, |offset, numel| match shard {
            HostElems::F32(v) => self.uploads.start_shard(what, v, offset, numel),
            HostElems::Bf16(v) => self.uploads.start_shard_bf16(what, v, offset, numel),
            HostElems::F16(v) => self.uploads.start_shard_f16(what, v, offset, numel),
        })
    }

    fn gather_in_place(
        &self,
        what: &str,
        pin: ReadPin,
        shard: HostElems<'_>,
        counts: &[usize],
    ) -> Result<PendingUpload, ModelError> {
        let wire = shard.wire();
        self.gathered(what, shard.len(), counts, |offset, numel| {
            self.uploads
                .start_shard_pinned(what, pin, wire, offset, numel)
        })
    }

    fn finish_download(&self, d: PendingDownload) -> Result<HostVec, ModelError> {
        Ok(match self.downloads.finish(d).map_err(gpu_err)? {
            Downloaded::F32(v) => HostVec::F32(v),
            Downloaded::Bf16(v) => HostVec::Bf16(v),
            Downloaded::F16(v) => HostVec::F16(v),
        })
    }

    fn finish_download_with(
        &self,
        d: PendingDownload,
        f: &mut dyn FnMut(HostElems<'_>),
    ) -> Result<(), ModelError> {
        self.downloads
            .finish_with(d, |r| match r {
                DownloadedRef::F32(v) => f(HostElems::F32(v)),
                DownloadedRef::Bf16(v) => f(HostElems::Bf16(v)),
                DownloadedRef::F16(v) => f(HostElems::F16(v)),
            })
            .map_err(gpu_err)
    }

    fn memory(&self) -> LinkMemory {
        let whole = self.uploads.device().budget().budget_bytes();
        LinkMemory {
            device_budget_bytes: whole,
            startup_bytes: self.startup_bytes,
            temporaries_bytes: Some(
                whole
                    .saturating_sub(self.startup_bytes)
                    .saturating_sub(self.budget_bytes),
            ),
            // The uploads' pools of fp32, bf16 and fp16 elements, under
            // the cap each (every staging buffer is its pool's, idle or
            // retiring with its copy: `tierzero_gpu::link`).
            staging: Staging::Pools {
                pools: 3,
                cap_bytes: self.uploads.cap_bytes(),
            },
            // The downloads' idle buffers of the three element types.
            download_idle_bytes: 3 * self.downloads.cap_bytes(),
        }
    }

    fn timed<T>(&self, name: impl FnOnce() -> String, f: impl FnOnce() -> T) -> T {
        let stream = &self.uploads.device().compute;
        // Timing is for the timeline: a failed record only loses the span.
        let began = EventClock::mark(stream).ok();
        let out = f();
        if let Some(span) = began.and_then(|b| EventClock::span(stream, name(), b).ok()) {
            let _ = self.compute_spans.push(span);
        }
        out
    }

    fn take_spans(&self) -> Vec<DeviceSpan> {
        let compute = self.compute_spans.take();
        let copies = self.uploads.take_spans();
        let down = self.downloads.take_spans();
        let collective = self.collective_spans.take();
        let mut out = Vec::new();
        for (queue, got) in [
            (DeviceQueue::Compute, compute),
            (DeviceQueue::H2d, copies),
            (DeviceQueue::D2h, down),
            (DeviceQueue::Collective, collective),
        ] {
            match got {
                Ok(spans) => out.extend(spans.into_iter().map(|(name, start, end)| DeviceSpan {
                    queue,
                    name,
                    start,
                    end,
                })),
                Err(e) => tracing::warn!(error = %e, "could not read the device's timing events"),
            }
        }
        out
    }
}

use super::*;
use crate::engine::sizing::SwapUse;

mod checks;
pub(super) use checks::check_head_memory;
use checks::*;

/// Where rank `rank` of `world` keeps its swap files under an
/// `nvme_path`: `<nvme_path>/rank<R>` with several ranks, the path itself
/// with one.
pub fn rank_swap_dir(nvme_path: &std::path::Path, rank: usize, world: usize) -> PathBuf {
    match world {
        1 => nvme_path.to_owned(),
        _ => nvme_path.join(format!("rank{rank}")),
    }
}

/// The swap dirs under `nvme_path` that runs of another number of ranks
/// than `world` use ([`rank_swap_dir`]), those that exist: the path itself
/// (one rank) and its `rank<R>` dirs beyond this run's. A run killed with
/// another count left its files there, which no run of this count looks
/// at; their locks keep a live run's from being touched.
pub fn other_rank_counts_swap_dirs(nvme_path: &std::path::Path, world: usize) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if world > 1 {
        dirs.push(nvme_path.to_owned());
    }
    for entry in std::fs::read_dir(nvme_path).into_iter().flatten().flatten() {
        let name = entry.file_name();
        let rank = name
            .to_str()
            .and_then(|n| n.strip_prefix("rank"))
            .filter(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|r| r.parse::<usize>().ok());
        if rank.is_some_and(|r| world == 1 || r >= world) && entry.path().is_dir() {
            dirs.push(entry.path());
        }
    }
    dirs.sort();
    dirs
}

/// The lock policy of an arena: `pin` is its offload block's `pin_memory`;
/// `lockable` says whether all pinned buffers together fit under
/// `RLIMIT_MEMLOCK` (see the module docs).
fn lock_policy(pin: bool, lockable: bool, memlock: config::Memlock) -> LockPolicy {
    match (pin, lockable, memlock) {
        (false, _, _) | (true, false, _) => LockPolicy::Off,
        (true, true, config::Memlock::Require) => LockPolicy::Require,
        (true, true, config::Memlock::Auto) => LockPolicy::BestEffort,
    }
}

fn engine_config(
    config: &Config,
    clock: &Arc<BusyClock>,
    own_clock: Option<Arc<BusyClock>>,
    faults: Option<Arc<FaultInjector>>,
    thread_cpus: Option<Arc<[usize]>>,
) -> EngineConfig {
    EngineConfig {
        backend: match config.tierzero.io_backend {
            config::IoBackend::Auto => BackendKind::Auto,
            config::IoBackend::Uring => BackendKind::Uring,
            config::IoBackend::Portable => BackendKind::Portable,
        },
        workers: config.tierzero.ring_threads.max(1) as usize,
        queue_depth: config.aio.queue_depth.max(1),
        block_bytes: config.aio.block_bytes.0.max(4096).div_ceil(4096) * 4096,
        sqpoll: false,
        faults,
        busy_clock: Some(clock.clone()),
        own_clock,
        thread_cpus,
    }
}

fn space_config(config: &Config, path: &std::path::Path, capacity_bytes: u64) -> SpaceConfig {
    let mut sc = SpaceConfig::new(path, capacity_bytes);
    sc.direct_io = match config.tierzero.direct_io {
        config::DirectIo::Auto => tierzero_swap::DirectIo::Auto,
        config::DirectIo::Require => tierzero_swap::DirectIo::Require,
        config::DirectIo::Off => tierzero_swap::DirectIo::Off,
    };
    sc.checksums = config.tierzero.checksums;
    sc
}

/// Low-precision bytes of fp32 values (round to nearest even, the same
/// conversion as the optimizer's fused output).
pub(super) fn encode(values: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::BF16 => values
            .iter()
            .flat_map(|&x| f32_to_bf16_bits(x).to_le_bytes())
            .collect(),
        DType::F16 => values
            .iter()
            .flat_map(|&x| f32_to_f16_bits(x).to_le_bytes())
            .collect(),
        _ => crate::le::bytes(values).into_owned(),
    }
}

/// The precision's stored param dtype and its loss scaler.
fn precision_setup(precision: &Precision) -> (DType, LossScaler) {
    let scaler = match precision {
        Precision::Fp32 | Precision::Bf16 => LossScaler::none(),
        Precision::Fp16 { loss_scale } => LossScaler::from_config(*loss_scale),
    };
    (precision.storage_dtype(), scaler)
}

/// Whether the run's compute gathers the params on its device (several
/// ranks, a device with collectives of its own, and compute on): the
/// store then hands out shards, and the homes they cross from are
/// registered with the device.
fn gathers_on_device(opts: &TrainerOptions) -> bool {
    !opts.skip_compute && opts.compute.as_ref().is_some_and(|c| c.gathers_params())
}

/// The compute threads, where threads run, and the malloc settings:
/// decided before any of our threads start (see `host::threads`).
struct HostSetup {
    compute_threads: ComputeThreads,
    adam_threads: threads::AdamThreads,
    placement: threads::Placement,
    compute_pool: Option<std::sync::Arc<threads::ComputePool>>,
    /// Where the host's parallel work outside a step's compute runs: the
    /// compute pool, else [`threads::ComputePool::for_host_work`].
    host_pool: std::sync::Arc<threads::ComputePool>,
    malloc: Option<tierzero_swap::MallocTuning>,
}

impl HostSetup {
    fn new(config: &Config, opts: &TrainerOptions) -> Result<HostSetup> {
        let offloaded = config.zero.offload_param.device != OffloadDevice::None
            || config.zero.offload_optimizer.device != OffloadDevice::None;
        let world = opts.comm.world_size();
        // A device's units (the CUDA ones, the device tier) leave candle
        // idle: no compute threads to size.
        let cpu_compute = matches!(opts.device, Device::Cpu)
            && !opts.compute.as_ref().is_some_and(|c| c.on_device());
        let compute_threads = threads::resolve(
            config.tierzero.compute_threads,
            threads::user_env().as_deref(),
            threads::cores(),
            cpu_compute,
        );
        let adam_threads =
            threads::adam_threads(opts.adam_threads, &compute_threads, threads::cores());
        threads::apply(&compute_threads);
        // The building thread's mask: what `taskset` or a cpuset allows.
        let placement = match tierzero_swap::affinity::current_thread_cpus() {
            Ok(allowed) => threads::place(
                config.tierzero.pin_threads,
                &allowed,
                &compute_threads,
                world,
                offloaded,
            ),
            Err(e) => {
                tracing::warn!(error = %e, "could not read the CPU mask; threads not pinned");
                threads::Placement::Unpinned("the CPU mask could not be read")
            }
        };
        // Before the pool's threads start: the arena cap only stops arenas
        // not yet made.
        let malloc = opts
            .keep_heap_mapped
            .then(crate::engine::host::heap::keep_heap_mapped);
        let compute_pool = threads::ComputePool::new(&compute_threads, &placement)
            .map_err(|e| EngineError::ComputeThreads {
                threads: compute_threads.threads,
                reason: e.to_string(),
            })?
            .map(std::sync::Arc::new);
        let host_pool = match &compute_pool {
            Some(p) => p.clone(),
            None => std::sync::Arc::new(threads::ComputePool::for_host_work().map_err(|e| {
                EngineError::ComputeThreads {
                    threads: 0,
                    reason: format!("the host's helper pool: {e}"),
                }
            })?),
        };
        Ok(HostSetup {
            compute_threads,
            adam_threads,
            placement,
            compute_pool,
            host_pool,
            malloc,
        })
    }
}

/// The busy clocks of the I/O engines: one union clock, and with a
/// timeline one per engine, each with its disk lane (params, optimizer
/// reads, optimizer writes, grad park): `Trainer::record_disk` moves each
/// clock's periods into its own lane.
struct Clocks {
    io: Arc<BusyClock>,
    engines: Option<Vec<(Lane, Arc<BusyClock>)>>,
}

impl Clocks {
    fn new(opts: &TrainerOptions) -> Clocks {
        let engines = opts.timeline.as_ref().map(|_| {
            [
                Lane::DiskParams,
                Lane::DiskStateReads,
                Lane::DiskStateWrites,
                Lane::DiskGradPark,
            ]
            .into_iter()
            .map(|lane| {
                let clock = BusyClock::new();
                clock.set_logging(true);
                (lane, clock)
            })
            .collect()
        });
        Clocks {
            io: BusyClock::new(),
            engines,
        }
    }

    /// The clock of the engine whose disk lane is `lane` (with a timeline).
    fn engine(&self, lane: Lane) -> Option<Arc<BusyClock>> {
        let engines = self.engines.as_ref()?;
        engines
            .iter()
            .find(|(l, _)| *l == lane)
            .map(|(_, c)| c.clone())
    }
}

/// What building the tiers needs besides the config and the sizing.
struct TierBuild<'a> {
    config: &'a Config,
    sizing: &'a Sizing,
    opts: &'a TrainerOptions,
    clocks: &'a Clocks,
    helper_cpus: Option<Arc<[usize]>>,
    lockable: bool,
    /// Swap spaces made so far (params, then optimizer state).
    swap_spaces: Vec<Arc<SwapSpace>>,
    /// Pinned arenas mapped so far.
    arenas: Vec<Arc<PinnedArena>>,
}

impl TierBuild<'_> {
    /// This rank's directory under `path`: `<path>/rank<R>/` with several
    /// ranks, `path` itself with one.
    fn rank_dir(&self, path: &std::path::Path) -> Result<PathBuf> {
        let (rank, world) = (self.opts.comm.rank(), self.opts.comm.world_size());
        let d = rank_swap_dir(path, rank, world);
        if world == 1 {
            return Ok(d);
        }
        std::fs::create_dir_all(&d).map_err(|source| EngineError::Io {
            path: d.clone(),
            source,
        })?;
        Ok(d)
    }

    /// Maps one arena of `buffers`, locked by its block's `pin_memory`.
    fn arena(&mut self, buffers: Buffers, pin: bool) -> Result<Arc<PinnedArena>> {
        self.arena_registered(buffers, pin, None, "")
    }

    /// An arena params cross to the device from: registered with the
    /// compute's registrar when its device copies from registered host
    /// memory in place and this is the only rank (pins are of whole
    /// params), or when the compute gathers the params on its device
    /// (pins are of this rank's shards, which the store then hands out).
    /// `what` names it in a refusal's warning.
    fn device_arena(
        &mut self,
        buffers: Buffers,
        pin: bool,
        what: &str,
    ) -> Result<Arc<PinnedArena>> {
        let one_rank = self.opts.comm.world_size() == 1;
        let registrar = match &self.opts.compute {
            Some(c) if one_rank || gathers_on_device(self.opts) => c.host_registrar(),
            _ => None,
        };
        self.arena_registered(buffers, pin, registrar, what)
    }

    /// [`TierBuild::arena`], registered through `registrar` too (with a
    /// device's, its copy engine reads the arena in place). A registration
    /// the device refuses is a warning: the arena is mapped without it,
    /// and its bytes cross through staging buffers. `what` names the
    /// arena in that warning.
    fn arena_registered(
        &mut self,
        buffers: Buffers,
        pin: bool,
        registrar: Option<Arc<dyn tierzero_swap::HostRegistrar>>,
        what: &str,
    ) -> Result<Arc<PinnedArena>> {
        let mut ac = ArenaConfig::new(buffers.total_bytes(), buffers.bytes_each);
        ac.lock = lock_policy(pin, self.lockable, self.config.tierzero.memlock);
        let arena = match registrar {
            None => PinnedArena::new(ac)?,
            Some(r) => {
                let mut with = ac.clone();
                with.registrar = Some(r);
                match PinnedArena::new(with) {
                    Ok(a) => a,
                    Err(e) => {
                        let a = PinnedArena::new(ac)?;
                        tracing::warn!(
                            bytes = buffers.total_bytes(),
                            error = %e,
                            "the device did not register {what}; \
                             their params cross through staging buffers"
                        );
                        a
                    }
                }
            }
        };
        self.arenas.push(arena.clone());
        Ok(arena)
    }

    /// The swap space of `what`, as the sizing sizes it, in this rank's
    /// directory under its `nvme_path`. One its file system cannot take
    /// is refused with this rank's total there ([`EngineError::NvmeSpace`]).
    fn space(&mut self, what: SwapUse) -> Result<Arc<SwapSpace>> {
        let (Some(dir), Some(bytes)) = (
            what.nvme_path(self.config),
            self.sizing.swap_space_bytes(self.config, what),
        ) else {
            return Err(EngineError::internal(format!(
                "a swap space for {} the run does not make",
                what.what()
            )));
        };
        let space = SwapSpace::create(space_config(self.config, &self.rank_dir(dir)?, bytes))
            .map_err(|e| match e {
                SwapError::NoRoom {
                    path,
                    needed_bytes,
                    available_bytes,
                } => EngineError::NvmeSpace {
                    holds: what,
                    dir: dir.to_owned(),
                    path,
                    needed_bytes,
                    rank_total_bytes: self.sizing.swap_bytes_under(self.config, dir),
                    available_bytes,
                    ranks: self.opts.comm.world_size(),
                },
                e => e.into(),
            })?;
        self.swap_spaces.push(space.clone());
        Ok(space)
    }

    /// An I/O engine over `space` and `arena` with disk lane `lane`.
    fn engine(
        &self,
        space: Arc<SwapSpace>,
        arena: Arc<PinnedArena>,
        lane: Lane,
        faults: Option<Arc<FaultInjector>>,
    ) -> Result<Engine> {
        Ok(Engine::new(
            space,
            arena,
            engine_config(
                self.config,
                &self.clocks.io,
                self.clocks.engine(lane),
                faults,
                self.helper_cpus.clone(),
            ),
        )?)
    }

    /// The param store: cpu-tier pages, and the NVMe tier's space, buffers
    /// and engine.
    fn store(&mut self, model: &Model, layout: &Layout, dtype: DType) -> Result<ParamStore> {
        let zero = &self.config.zero;
        let pin = zero.offload_param.pin_memory;
        let cpu_pages = if self.sizing.cpu_pages.count > 0 {
            let arena =
                self.device_arena(self.sizing.cpu_pages, pin, "the cpu tier's pinned pages")?;
            arena.try_acquire_n(self.sizing.cpu_pages.count as usize)?
        } else {
            Vec::new()
        };
        let nvme = if self.sizing.params_on_nvme() {
            let space = self.space(SwapUse::Params)?;
            // Params cross from where their reads landed (the store keeps
            // the buffers for it).
            let arena =
                self.device_arena(self.sizing.param_buffers, pin, "the param swap buffers")?;
            let faults = self.opts.faults.params.clone();
            let engine = self.engine(space, arena.clone(), Lane::DiskParams, faults)?;
            Some(NvmeParams {
                engine,
                arena,
                read_gate: crate::engine::params::copier::ParamReadGate::new(),
            })
        } else {
            None
        };
        ParamStore::new(
            model,
            layout,
            &self.sizing.tiers,
            dtype,
            self.opts.device.clone(),
            self.opts.comm.clone(),
            cpu_pages,
            nvme,
            self.helper_cpus.clone(),
        )
    }

    /// The gradient park (several micro-batches with NVMe optimizer
    /// state): its own space beside the optimizer's, buffers and engine.
    fn park(&mut self, layout: &Layout) -> Result<Option<GradPark>> {
        if !self.sizing.park_grads {
            return Ok(None);
        }
        let zero = &self.config.zero;
        let space = self.space(SwapUse::GradPark)?;
        let arena = self.arena(self.sizing.park_buffers, zero.offload_optimizer.pin_memory)?;
        let faults = self.opts.faults.grad_park.clone();
        let engine = self.engine(space, arena.clone(), Lane::DiskGradPark, faults)?;
        Ok(Some(GradPark::new(
            engine,
            arena,
            layout.sub_groups.iter().map(|g| g.numel).collect(),
        )?))
    }

    /// The optimizer state: in host memory, or on NVMe with its space,
    /// buffers, and read and write engines. With NVMe, the sub-groups
    /// holding the params the next forward needs first keep their state in
    /// host memory ("Resident sub-groups" in `optimizer/state.rs`).
    fn optimizer(&mut self, layout: &Layout) -> Result<OptimizerState> {
        let zero = &self.config.zero;
        let nvme = match zero.offload_optimizer.device.nvme_path() {
            Some(_) => {
                let space = self.space(SwapUse::OptimizerState)?;
                let arena = self.arena(
                    self.sizing.optimizer_buffers,
                    zero.offload_optimizer.pin_memory,
                )?;
                let faults = &self.opts.faults;
                let read = self.engine(
                    space.clone(),
                    arena.clone(),
                    Lane::DiskStateReads,
                    faults.optim_read.clone(),
                )?;
                let write = self.engine(
                    space,
                    arena.clone(),
                    Lane::DiskStateWrites,
                    faults.optim_write.clone(),
                )?;
                Some(NvmeOptim { read, write, arena })
            }
            None => None,
        };
        OptimizerState::new(
            layout.sub_groups.iter().map(|g| g.numel).collect(),
            nvme,
            &self.sizing.resident_groups,
            self.sizing.read_ahead,
            self.sizing.write_behind,
            self.sizing.spill_grads,
            PoolSize {
                slots: self.sizing.speculation_slots,
                kept_grads: self.sizing.speculation_kept_grads,
            },
            // ds_config has no moment dtype: fp32, as DeepSpeed's CPU Adam.
            crate::optim::MomentDtype::F32,
        )
    }
}

/// Stores the initial weights: fp32 masters → stored bytes, and masters
/// per sub-group (from a checkpoint, the moments too).
fn load_initial(
    layout: &Layout,
    source: WeightSource<'_>,
    dtype: DType,
    store: &mut ParamStore,
    opt: &mut OptimizerState,
    stop: &StopHandle,
    mut digests: Option<&mut [u64]>,
) -> Result<()> {
    // Streamed: one sub-group's state and one param at a time (a tiled
    // param's fp32 values and encoded shard are kept until its last
    // piece), so a model larger than memory is initialised tile by tile.
    let total_numel: usize = layout.sub_groups.iter().map(|g| g.numel).sum();
    let mut progress = InitProgress::new(total_numel);
    let mut loaded: Option<(ParamId, Vec<f32>)> = None;
    let mut encoded: Option<(ParamId, Vec<u8>)> = None;
    for g in &layout.sub_groups {
        // A stop ends the build here (it may take minutes).
        super::stop::check_build_stop(stop, progress.done_numel as u64, total_numel as u64)?;
        let mut states = [
            vec![0f32; g.numel],
            vec![0f32; g.numel],
            vec![0f32; g.numel],
        ];
        match source {
            WeightSource::Dir(dir) => {
                for pc in &g.pieces {
                    let slot = &layout.params[pc.param.0];
                    if loaded.as_ref().is_none_or(|(p, _)| *p != pc.param) {
                        let t = dir.load_param(pc.param, DType::F32, &Device::Cpu)?;
                        let values = t.flatten_all()?.to_vec1::<f32>()?;
                        if let Some(d) = digests.as_deref_mut().and_then(|d| d.get_mut(pc.param.0))
                        {
                            *d = u64::from(crc32c::crc32c(bytemuck::cast_slice(&values)));
                        }
                        loaded = Some((pc.param, values));
                    }
                    let all = loaded.as_ref().map(|(_, v)| v.as_slice()).unwrap_or(&[]);
                    let from = slot.shard_start + pc.offset_in_shard;
                    let piece = all
                        .get(from..from + pc.numel)
                        .ok_or_else(|| EngineError::internal("shard out of range"))?;
                    states[0][pc.group_range()].copy_from_slice(piece);
                }
            }
            // Reshard on load: exactly this rank's range of each param,
            // assembled from whichever ranks of the checkpoint hold it (any
            // world size, any sub_group_size). One state at a time, so the
            // reader keeps one region per source rank.
            WeightSource::Checkpoint(ckpt) => {
                for kind in StateKind::ALL {
                    for pc in &g.pieces {
                        let slot = &layout.params[pc.param.0];
                        ckpt.load_param_state_range_into(
                            kind,
                            pc.param,
                            slot.shard_start + pc.offset_in_shard,
                            &mut states[kind.index()][pc.group_range()],
                        )?;
                    }
                }
            }
        }
        for pc in &g.pieces {
            let slot = &layout.params[pc.param.0];
            let bytes = encode(&states[0][pc.group_range()], dtype);
            if !slot.is_tiled() {
                store.store_initial(pc.param, &bytes)?;
                continue;
            }
            if encoded.as_ref().is_none_or(|(p, _)| *p != pc.param) {
                encoded = Some((
                    pc.param,
                    Vec::with_capacity(bytes.len() * slot.pieces.len()),
                ));
            }
            if let Some((_, shard)) = encoded.as_mut() {
                shard.extend_from_slice(&bytes);
            }
            if pc.offset_in_shard + pc.numel == slot.shard_numel {
                if let Some((_, shard)) = encoded.take() {
                    store.store_initial(pc.param, &shard)?;
                }
                loaded = None;
            }
        }
        opt.load_group(g.id, [&states[0], &states[1], &states[2]])?;
        progress.done(g.numel);
        crate::failpoint::kill_point(crate::failpoint::Site::BuildInitial);
    }
    if let WeightSource::Checkpoint(ckpt) = source {
        ckpt.release_cache();
    }
    opt.flush()
}

/// How long [`Trainer::new`] or [`Trainer::resume`] took, by part (the
/// rest of the build, the threads and the metrics file, is short).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BuildTimes {
    /// The host's threads and the tiers: pinned arenas (and their
    /// registration with a device), swap files, the optimizer state's
    /// memory.
    pub tiers_s: f64,
    /// The initial weights and optimizer state stored into the tiers: the
    /// seeded init or the model's weights, or the checkpoint's load.
    pub initial_s: f64,
}

/// Progress of the initial store, logged every few seconds (a model
/// larger than memory takes minutes to write to its tiers).
struct InitProgress {
    total_numel: usize,
    done_numel: usize,
    start: Instant,
    last: Instant,
}

impl InitProgress {
    const EVERY: Duration = Duration::from_secs(10);

    fn new(total_numel: usize) -> InitProgress {
        let now = Instant::now();
        InitProgress {
            total_numel,
            done_numel: 0,
            start: now,
            last: now,
        }
    }

    fn done(&mut self, numel: usize) {
        self.done_numel += numel;
        if self.last.elapsed() >= Self::EVERY {
            self.last = Instant::now();
            let pct = 100.0 * self.done_numel as f64 / self.total_numel.max(1) as f64;
            tracing::info!(
                "initial weights and optimizer state: {} of {} elements stored ({pct:.0}%, {:.0} s)",
                self.done_numel,
                self.total_numel,
                self.start.elapsed().as_secs_f64()
            );
        }
    }
}

/// Adam's hyper-parameters from the config.
fn adam_hyper(o: &config::Optimizer) -> AdamHyper {
    AdamHyper {
        lr: o.lr,
        beta1: o.betas[0],
        beta2: o.betas[1],
        eps: o.eps,
        weight_decay: o.weight_decay,
        mode: if o.decoupled_weight_decay {
            AdamMode::AdamW
        } else {
            AdamMode::L2
        },
        bias_correction: o.bias_correction,
    }
}

/// The prefetcher's limits from the config.
fn limits(config: &Config) -> Limits {
    let zero = &config.zero;
    Limits {
        prefetch_bucket_numel: zero.prefetch_bucket_numel.0,
        max_live_numel: zero.max_live_parameters_numel.0,
        max_reuse_distance_numel: zero.max_reuse_distance_numel.0,
        persistence_threshold_numel: zero.param_persistence_threshold_numel.0,
        model_persistence_threshold_numel: zero.model_persistence_threshold_numel.0,
        // `"auto"` is the device tier's (`crate::engine::device::TierLimits::of`):
        // with CPU compute the params' host memory is the tiers', and a
        // cache kept here would grow with the model.
        device_cache_bytes: config.tierzero.device_cache_bytes.map_or(0, |b| b.0),
    }
}

/// Per unit, the sub-groups whose gradients are final after its
/// backward; and the order a step's sub-groups become final in backward
/// (units in reverse, each unit's groups, then any left, by index): the
/// order of the Step jobs without clipping or an overflow check.
fn group_orders(model: &Model, layout: &Layout) -> (Vec<Vec<SubGroupId>>, Vec<SubGroupId>) {
    let n_sub_groups = layout.sub_groups.len();
    let mut groups_after_unit = vec![Vec::new(); model.units().len()];
    for g in &layout.sub_groups {
        if let Some(v) = groups_after_unit.get_mut(g.final_after_unit.0) {
            v.push(g.id);
        }
    }
    let mut backward_order: Vec<SubGroupId> = Vec::with_capacity(n_sub_groups);
    let mut listed = vec![false; n_sub_groups];
    for v in groups_after_unit.iter().rev() {
        for &g in v {
            if let Some(seen) = listed.get_mut(g.0) {
                if !*seen {
                    *seen = true;
                    backward_order.push(g);
                }
            }
        }
    }
    for (i, seen) in listed.iter().enumerate() {
        if !seen {
            backward_order.push(SubGroupId(i));
        }
    }
    (groups_after_unit, backward_order)
}

impl Trainer {
    /// Builds the tiers as [`sizing::decide`] sizes them, stores the
    /// initial weights and optimizer state, and starts the optimizer
    /// thread.
    pub(super) fn build(
        config: &Config,
        model: Model,
        source: WeightSource<'_>,
        data: TokenData,
        opts: TrainerOptions,
    ) -> Result<Self> {
        let started = Instant::now();
        check_run(config, &model, &data, &opts)?;
        let several = opts.comm.world_size() > 1;
        let data_crc32c = several.then(|| data.ids_crc32c());
        crate::engine::comm::same_on_every_rank(
            &*opts.comm,
            &rank_settings(config, &model, &data, data_crc32c, &opts),
        )?;
        let host = HostSetup::new(config, &opts)?;
        let (param_dtype, scaler) = precision_setup(&config.precision);
        let sub_group = usize::try_from(config.zero.sub_group_numel.0).unwrap_or(usize::MAX);
        crate::engine::layout::check_sub_group_count(
            model.numel() as u64,
            opts.comm.world_size(),
            config.zero.sub_group_numel.0,
        )?;
        let layout = Layout::new(&model, opts.comm.rank(), opts.comm.world_size(), sub_group);
        let shape = Shape::of(config, &model, &layout);
        let nvme_share_bytes = sizing::nvme_available_bytes(config, opts.comm.world_size());
        let sizing =
            sizing::decide_within(config, &shape, nvme_share_bytes).map_err(budget_error)?;
        let lockable = check_memlock(config, &sizing)?;
        // Every rank's own memory, agreed: one refusing alone left the
        // others in their first collective.
        crate::engine::comm::agree(
            &*opts.comm,
            "checking host memory",
            check_host_memory(
                config,
                &sizing,
                &shape,
                host_working_bytes(config, &model, &layout, &sizing, opts.compute.is_some()),
                lockable,
                sizing::mem_available_bytes(),
                crate::estimate::probe_swap_free(),
            ),
        )?;
        let clocks = Clocks::new(&opts);
        let total_numel: u64 = layout.sub_groups.iter().map(|g| g.numel as u64).sum();
        // The tiers and the initial store as one result, which every rank
        // takes to the agreement on how the build ended: a rank whose
        // tiers fail alone (its disk fuller) or that stops mid-store does
        // not leave the others waiting in it. What a failed build made
        // (swap files, arenas) drops here.
        // Each param's crc32c as loaded, compared among the ranks.
        let mut digests = several.then(|| vec![NOT_LOADED; model.params().len()]);
        let built = (|| {
            let mut tiers = TierBuild {
                config,
                sizing: &sizing,
                opts: &opts,
                clocks: &clocks,
                helper_cpus: host.placement.helper_cpus(),
                lockable,
                swap_spaces: Vec::new(),
                arenas: Vec::new(),
            };
            let mut store = tiers.store(&model, &layout, param_dtype)?;
            if gathers_on_device(&opts) {
                store.hand_out_shards();
            }
            if config.zero.stage == config::Stage::Parameters {
                store.partition_device_params();
            }
            let mut opt = tiers.optimizer(&layout)?;
            let park = tiers.park(&layout)?;
            let tiers_done = Instant::now();
            // The seeded init splits over threads: on the host pool. A
            // stop ends it.
            host.host_pool.run(|| {
                load_initial(
                    &layout,
                    source,
                    param_dtype,
                    &mut store,
                    &mut opt,
                    &opts.stop,
                    digests.as_deref_mut(),
                )
            })?;
            Ok((
                store,
                opt,
                park,
                tiers.swap_spaces,
                tiers.arenas,
                tiers_done,
            ))
        })();
        let (store, opt, park, swap_spaces, arenas, tiers_done) =
            super::stop::agree_build_end(&*opts.comm, &opts.stop, total_numel, built)?;
        if let Some(d) = &digests {
            same_weights_on_every_rank(&*opts.comm, &model, d)?;
        }
        let build_times = BuildTimes {
            tiers_s: (tiers_done - started).as_secs_f64(),
            initial_s: tiers_done.elapsed().as_secs_f64(),
        };

        let adam = CpuAdam::new(adam_hyper(&config.optimizer), host.adam_threads.threads)?;
        if opts.timeline.is_some() {
            clocks.io.set_logging(true);
        }
        let opt = OptimizerWorker::spawn(
            opt,
            adam.clone(),
            param_dtype,
            opts.timeline.clone(),
            host.placement.helper_cpus(),
            store.read_gate(),
        )?;
        opt.bound_values(crate::engine::sizing::values_in_flight(
            sizing.read_ahead,
            sizing.write_behind,
            crate::engine::sizing::largest_unit_groups(&model, &layout) as usize,
            layout.sub_groups.len(),
        ));
        let sched = Prefetcher::new(&model, limits(config));
        let (groups_after_unit, backward_order) = group_orders(&model, &layout);
        let metrics = match &opts.metrics_path {
            Some(p) => Some(MetricsWriter::create(p, opts.metrics_append)?),
            None => None,
        };
        let stop = opts.stop.clone();
        // After every buffer, param and state is in place: what is left.
        let activations = activations::Activations::new(
            config.tierzero.activations,
            crate::engine::sizing::mem_available_bytes(),
            opts.comm.world_size(),
        );
        // Spare gradient sums: as many as the plan's gradient bound counts.
        let opt_nvme = config.zero.offload_optimizer.device.nvme_path().is_some();
        let spares = sizing::host_grad_bound_groups(
            &sizing,
            &shape,
            opt_nvme,
            sizing::largest_unit_groups(&model, &layout),
        );
        let spare_sums = std::sync::Mutex::new(super::groups::SpareSums::with_min(
            usize::try_from(spares).unwrap_or(usize::MAX),
            opts.spare_sum_min_bytes
                .unwrap_or(super::groups::SPARE_MIN_BYTES),
        ));
        let grad_sum_dtypes = shape
            .sub_groups
            .iter()
            .map(|g| {
                if opts.f32_grad_sums {
                    sizing::SumDtype::F32
                } else {
                    g.sum_dtype
                }
            })
            .collect();
        Ok(Trainer {
            compute_threads: host.compute_threads,
            adam_threads: host.adam_threads,
            placement: host.placement,
            compute_pool: host.compute_pool,
            host_pool: host.host_pool,
            spare_sums,
            grad_sum_dtypes,
            malloc: host.malloc,
            config: config.clone(),
            model,
            data,
            opts,
            layout,
            store,
            opt,
            park,
            sched,
            adam,
            lr: LrSchedule {
                scheduler: config.scheduler,
                base_lr: config.optimizer.lr,
            },
            scaler,
            steps_done: 0,
            adam_steps: 0,
            skipped: 0,
            metrics,
            groups_after_unit,
            backward_order,
            lookahead_reads: 0,
            sizing,
            arenas,
            data_name: "unnamed".to_owned(),
            data_base: super::DataBase::default(),
            save_lock: None,
            io_clock: clocks.io,
            build_times,
            engine_clocks: clocks.engines,
            flush_open: false,
            device_dirty: false,
            device_loaded: false,
            said_buffers_short: false,
            optimizer_wait: Duration::ZERO,
            speculation: Speculation::default(),
            grads_out: std::collections::HashSet::new(),
            grads_out_peak: 0,
            spills_out: 0,
            swap_spaces,
            failed: None,
            stop,
            stopped: None,
            stop_seen_at: None,
            slowest_save: None,
            last_step_wall: None,
            activations,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    /// The host-memory check: the page-locked bytes must fit what is
    /// available, everything (locked or not, and the state) what is
    /// available and the free swap; unknown memory is not checked.
    #[test]
    fn host_memory_counts_locked_bytes_against_ram_and_the_rest_against_swap_too() {
        let text = r#"{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3,
            "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}"#;
        let run = config::RunContext {
            path_checks: config::PathChecks::Skip,
            ..config::RunContext::default()
        };
        let config = config::load_str(text, &run).unwrap().config;
        let json = serde_json::json!({"model_type": "gpt2", "vocab_size": 300,
            "n_positions": 16, "n_embd": 32, "n_layer": 2, "n_head": 2});
        let (mc, _) = crate::model::ModelConfig::from_hf_json(&json.to_string()).unwrap();
        let model = Model::new(mc).unwrap();
        let layout = Layout::new(&model, 0, 1, 1_000_000);
        let shape = Shape::of(&config, &model, &layout);
        let sizing = sizing::decide_within(&config, &shape, None).unwrap();
        let pinned = sizing.pinned_total_bytes();
        let state = sizing.optimizer_host_bytes(&shape, false);
        assert!(pinned > 0 && sizing.lock_bytes > 0 && state == 12 * model.numel() as u64);
        let check = |lockable, avail, swap| {
            check_host_memory(&config, &sizing, &shape, 0, lockable, avail, swap)
        };
        assert!(check(true, Some(pinned + state), None).is_ok());
        let e = check(true, Some(pinned + state - 1), None).unwrap_err();
        assert!(matches!(e, EngineError::HostMemory { .. }), "{e}");
        // Swap takes what is not locked.
        assert!(check(true, Some(pinned + state - 1), Some(1)).is_ok());
        // Locked bytes beyond the memory available: swap does not help.
        let locked = sizing.lock_bytes;
        assert!(check(true, Some(locked - 1), Some(u64::MAX)).is_err());
        // Unlocked (RLIMIT_MEMLOCK too low), they may go to swap too.
        assert!(check(false, Some(locked - 1), Some(pinned + state)).is_ok());
        assert!(check(true, None, None).is_ok());
        // With CPU compute the step's working bytes count too (a run the
        // check passed was killed by a 700 MiB cgroup, without a word).
        let plan = crate::run::Plan::new(&config, &model, &layout, &sizing, String::new());
        let working = plan.host_working_bytes();
        assert!(
            working >= 4 * model.numel() as u64,
            "{working}: the fp32 params at least"
        );
        let with =
            |avail| check_host_memory(&config, &sizing, &shape, working, true, Some(avail), None);
        assert!(with(pinned + state + working).is_ok());
        let e = with(pinned + state + working - 1).unwrap_err().to_string();
        assert!(e.contains("more while it steps"), "{e}");
        assert!(
            e.contains("offload the params and the optimizer state to NVMe"),
            "{e}"
        );
        // With a device, the param store's host copy of the params homed
        // there is counted (it was 0: a model larger than the host passed);
        // none is homed there when they are offloaded.
        let homed = |text: &str| {
            let config = config::load_str(text, &run).unwrap().config;
            let shape = Shape::of(&config, &model, &layout);
            let sizing = sizing::decide_within(&config, &shape, None).unwrap();
            checks::host_working_bytes(&config, &model, &layout, &sizing, true)
        };
        let none = r#"{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3,
            "offload_param": {"device": "none"}, "offload_optimizer": {"device": "cpu"}}}"#;
        assert_eq!(homed(none), 4 * model.numel() as u64);
        assert_eq!(homed(text), 0);
    }
}

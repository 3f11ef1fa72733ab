use super::*;

/// Run options that are not in the ds_config.
#[derive(Debug, Clone)]
pub struct TrainerOptions {
    /// Init seed (models without weights: [`Trainer::new`] refuses a
    /// `ModelDir` opened with another), recorded in the checkpoints; and
    /// the data shuffle's ([`TrainerOptions::cpu`]).
    pub seed: u64,
    /// The order each pass reads the data's windows in
    /// ([`crate::data::order`]); [`TrainerOptions::cpu`] shuffles them
    /// with its seed, as HF's Trainer does with its `seed`.
    pub data_order: crate::data::DataOrder,
    /// Sequence length (tokens per row).
    pub seq_len: usize,
    /// Compute device.
    pub device: Device,
    /// Collectives (one rank: [`SingleRank`]).
    pub comm: Arc<dyn Comm>,
    /// Threads of the CPU Adam kernel; `None` (the default) is auto: one
    /// beside CPU compute, half the cores beside a device's
    /// ([`crate::engine::host::threads::adam_threads`]).
    pub adam_threads: Option<NonZeroUsize>,
    /// JSON-lines metrics file.
    pub metrics_path: Option<PathBuf>,
    /// Append to the metrics file instead of truncating it: a resumed run
    /// continues the file of the run it resumes (`tierzero train --resume`
    /// sets it). Steps that run logged after its checkpoint are logged
    /// again, so a step may have two lines; its last one is this run's.
    pub metrics_append: bool,
    /// The step this run is to end at, written into its checkpoints
    /// (`run_steps` in the manifest): a resume that names no length runs
    /// to it. `None` (the default): not said.
    pub run_steps: Option<u64>,
    /// Measurement only ("I/O alone"): forward and backward are not
    /// computed. Every parameter is still fetched and released in trace
    /// order, and the optimizer still reads, steps and writes its state
    /// with zero gradients, so a step does exactly the I/O of a real step
    /// and almost none of its compute. The weights it trains are
    /// meaningless; `examples/overlap.rs` uses it to time the I/O phase.
    pub skip_compute: bool,
    /// Fault injection on the swap engines (tests); none by default.
    pub faults: FaultPlan,
    /// A timeline of a window of steps (`--timeline`, see
    /// `crate::engine::observe::timeline`); none by default.
    pub timeline: Option<Arc<Timeline>>,
    /// Raise glibc's mmap and trim thresholds for the process (see
    /// `crate::engine::host::heap`); on by default.
    pub keep_heap_mapped: bool,
    /// Requests to stop at a step boundary; a fresh handle by default
    /// ([`Trainer::stop_handle`] gives it back). Hand one in to stop the
    /// build itself: a request made while the trainer is built ends the
    /// build ([`EngineError::StoppedInBuild`](crate::engine::EngineError::StoppedInBuild)).
    pub stop: StopHandle,
    /// Bounds a stop from its request to the end of the run (see
    /// [`Trainer::save_on_stop`]); `None` = `tierzero.stop_grace_s`.
    pub stop_grace: Option<Duration>,
    /// What computes the units: `None` is candle on [`TrainerOptions::device`];
    /// `Some` another executor with the same unit contract (the CUDA units,
    /// [`crate::model::exec_units`]). It keeps no candle graph: a device
    /// compute keeps its blocks' forwards itself, within
    /// `tierzero.activation_budget_bytes`, or recomputes them.
    pub compute: Option<Arc<dyn crate::model::exec_units::UnitCompute>>,
    /// The least gradient sum kept from one step for the next (as many as
    /// the plan's gradient bound counts); `None` (the default) is the
    /// heap's mmap threshold, below which the heap keeps freed blocks
    /// itself (see `SpareSums` in `trainer/groups.rs`). Tests set 0 to take
    /// the spare path, whose first gradients are set into stale values,
    /// at any size.
    #[doc(hidden)]
    pub spare_sum_min_bytes: Option<usize>,
    /// Every sub-group's gradients in fp32 sums, where the plan holds some
    /// as bf16 ([`crate::engine::sizing::grad_sum_dtype`]): tests compare
    /// the two, bit for bit. The plan's bound does not follow it (it
    /// counts the bf16 groups' 2 bytes).
    #[doc(hidden)]
    pub f32_grad_sums: bool,
}

/// Fault injectors for the trainer's swap engines: the parameter engine,
/// the optimizer state's read and write engines, and the gradient park's
/// (several micro-batches with NVMe optimizer state). Each injector counts
/// the completions of its own engine (see [`FaultInjector`]).
#[derive(Debug, Clone, Default)]
pub struct FaultPlan {
    /// On the parameter swap engine.
    pub params: Option<Arc<FaultInjector>>,
    /// On the optimizer state's read engine.
    pub optim_read: Option<Arc<FaultInjector>>,
    /// On the optimizer state's write engine.
    pub optim_write: Option<Arc<FaultInjector>>,
    /// On the gradient park's engine (its parked partial sums' writes and
    /// reads).
    pub grad_park: Option<Arc<FaultInjector>>,
}

impl TrainerOptions {
    /// One rank on the CPU, Adam's threads auto (one, on the CPU), no
    /// metrics file.
    pub fn cpu(seed: u64, seq_len: usize) -> Self {
        TrainerOptions {
            seed,
            data_order: crate::data::DataOrder::Shuffled { seed },
            seq_len,
            device: Device::Cpu,
            comm: Arc::new(SingleRank),
            adam_threads: None,
            metrics_path: None,
            metrics_append: false,
            run_steps: None,
            skip_compute: false,
            faults: FaultPlan::default(),
            timeline: None,
            keep_heap_mapped: true,
            stop: StopHandle::new(),
            stop_grace: None,
            compute: None,
            spare_sum_min_bytes: None,
            f32_grad_sums: false,
        }
    }
}

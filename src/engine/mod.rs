//! The ZeRO-3 training engine: one rank's training step over parameters,
//! gradients and optimizer state that live in different memory tiers, and
//! its collectives with the other ranks.
//!
//! # Pieces
//!
//! ```text
//!  trainer/        Trainer: step() = micro-batches → forward units → head → backward units
//!     │             (step.rs: one GroupStep per sub-group; tail.rs: the optimizer's replies;
//!     │              build.rs: the tiers as sizing decided them; checkpoint.rs: save/resume)
//!     ├─ sizing.rs  the one sizing policy: home tiers, buffers, spill, resident groups
//!     ├─ device/    the device tier: unit params staged ahead on a DeviceLink (a GPU, or the
//!     │             simulated device), kept while they fit; TieredUnits is a UnitCompute
//!     ├─ params/    ParamStore (store.rs): home tier per param, device | cpu (pinned) | nvme,
//!     │             one state map per tensor driven by ParamEvent, and its Freshness;
//!     │             the param copy thread (copier.rs); the Prefetcher (prefetch.rs):
//!     │             unit trace, prefetch window, release policy
//!     ├─ optimizer/ OptimizerWorker (worker.rs), the optimizer thread, owning
//!     │             OptimizerState (state.rs): fp32 master/m/v per sub-group in host memory
//!     │             or on NVMe, pipelined read(i+1) / step(i) / write(i-1)
//!     ├─ layout.rs  per-rank shards, sub-groups (a param larger than one is tiled)
//!     ├─ grads.rs   GradPark: partial gradient sums on NVMe between micro-batches
//!     ├─ comm/      Comm: collectives in rank order; SingleRank, MpiComm (mpi.rs, feature
//!     │             `mpi`), NcclComm (nccl.rs, feature `gpu`; id via rendezvous.rs)
//!     ├─ host/      compute threads and their placement (threads.rs), malloc settings (heap.rs)
//!     └─ observe/   JSON lines per step and the summary (metrics.rs), --timeline (timeline.rs)
//! ```
//!
//! Learning-rate schedules and the fp16 loss scaler are in
//! [`crate::optim::schedule`]; the token loader in [`crate::data`].
//!
//! # Bit-identical results across tiers (the central invariant)
//!
//! Stage 0 in memory and stage 3 with NVMe offload must produce the same
//! bits. Every configuration therefore runs **the same arithmetic in the
//! same order**; only where bytes rest differs:
//!
//! * Parameters are always materialised from their stored bytes (16-bit
//!   or fp32) with `Tensor::from_raw_buffer`; the device tier merely keeps
//!   the tensor built from those bytes. The 16-bit bytes are produced by
//!   the fused low-precision output of [`crate::optim::CpuAdam::step`] (and
//!   at start-up by the same round-to-nearest-even conversion), whatever
//!   the tier.
//! * Forward and backward call [`crate::model::Model`] unit by unit in the
//!   same order; prefetching and release only change *when* a tensor is
//!   built, never its value.
//! * Gradients are converted to fp32 and added into a zeroed per-sub-group
//!   accumulator in backward order (micro-batch, then unit in reverse, then
//!   the unit's declared param order), the same in every mode.
//! * Sub-groups are whole parameters in `ParamId` order packed up to
//!   `sub_group_size` elements. The global Σg² is the f64 sum of the
//!   per-sub-group [`crate::optim::CpuAdam::grad_sq_norm`] values **in
//!   sub-group index order**, even when those values are computed in a
//!   different order (overlapped with backward).
//! * Adam is element-wise ([`crate::optim`] guarantees thread- and
//!   ISA-split independence), so stepping sub-groups in a different order
//!   (as they become final during backward) cannot change a bit.
//!
//! # What overlaps with what
//!
//! * Parameter reads from NVMe are issued ahead of use by the prefetcher
//!   (bounded by `stage3_prefetch_bucket_size`, `stage3_max_live_parameters`
//!   and free swap buffers) and complete on the I/O engine's threads while
//!   the compute thread runs earlier units.
//! * Optimizer-state reads for a sub-group are issued as soon as the
//!   sub-group's gradients are final (during backward), and writes drain
//!   while later sub-groups step.
//! * Without gradient clipping and without fp16 loss scaling the gradient
//!   multiplier is known before backward ends (it is 1), so a sub-group is
//!   **stepped** as soon as its gradients are final, while backward
//!   continues on earlier units. With clipping or an overflow check the step needs the
//!   global norm (or the global overflow flag) first: the per-sub-group
//!   norms and the state reads still overlap backward, the steps run after
//!   it.
//! * Adam runs on its own thread (`worker`): the compute thread hands
//!   it each final sub-group's gradient and continues backward; the new
//!   16-bit params come back over a channel and are stored at unit
//!   boundaries.
//!
//! # Not yet here
//!
//! * The all-gather of unit i+1 overlapping the compute of unit i with
//!   several ranks (the NVMe read of this rank's shard is prefetched; the
//!   gather runs at the fetch, on the compute thread's call), and stage
//!   1's separate all-reduce (stages 1 and 2 both reduce-scatter; the
//!   shard's sum is the same).
//! * A zero-copy device path for NCCL: compute is on the CPU, so NCCL
//!   stages host buffers through the device
//!   (`docs/decisions/gpu-collectives.md`).
//! * Reading a param larger than `offload_param.buffer_size` in pieces:
//!   such a param is an error naming the size to set
//!   ([`EngineError::ParamTooLarge`]); the optimizer side tiles it
//!   (`layout.rs`).
//! * Overlap figures are in `docs/decisions/overlap.md`.

pub mod comm;
pub mod device;
pub(crate) mod error;
pub(crate) mod grads;
pub mod host;
pub(crate) mod layout;
pub(crate) mod observe;
pub mod optimizer;
pub mod params;
pub mod sizing;
pub mod trainer;

pub use comm::{Comm, SingleRank};
pub use error::EngineError;
pub use layout::{check_sub_group_count, Layout, SubGroupId, MAX_SUB_GROUPS};
pub use observe::metrics::{StepMetrics, Summary};
pub use observe::timeline::{Lane, Timeline};
pub use params::store::{ParamEvent, ParamState, ParamStore, Tier};
pub use trainer::{
    ActivationDecision, BuildTimes, FaultPlan, StepReport, StopCause, StopHandle, StopSave,
    SwapUsage, Trainer, TrainerOptions,
};

/// Result type of the engine.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

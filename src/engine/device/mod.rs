//! The device tier: unit params staged on the compute device ahead of
//! their use, kept there while they fit, and computed on where they lie.
//!
//! # Pieces
//!
//! * [`DeviceLink`]: what the tier needs of a device. Memory with a byte
//!   budget, an executor (`tierzero_gpu::unit::Exec`) whose buffers are
//!   that memory, and asynchronous uploads that carry their own pinned
//!   staging buffer. Two links implement it:
//!   * [`sim::SimDevice`], the simulated device. Its memory is host
//!     memory with a budget, its copies run on a thread after a set delay,
//!     and its events complete when the copy does. It computes on the
//!     kernels' scalar references. The tests below run the engine on it,
//!     with no GPU.
//!   * [`cuda::CudaLink`], a `tierzero_gpu` device. Its
//!     uploads go through pinned staging buffers on the host-to-device
//!     stream, and the compute stream waits on each upload's CUDA event.
//! * [`TieredUnits`]: a [`crate::model::exec_units::UnitCompute`] over a
//!   link. It holds one state map of the params on the device and the
//!   rules that bound it. The engine calls it where it calls the model,
//!   and hands it the next unit's params before it computes this one
//!   ([`crate::model::exec_units::UnitCompute::stage`]).
//!
//! # One state per param on the device
//!
//! [`Residency`] is the state of a param on the device, changed only by
//! [`TierEvent`]s:
//!
//! | state | event | next | device bytes |
//! |---|---|---|---|
//! | absent | `Staged(upload)` | `Uploading` | held by the upload's destination |
//! | absent | `Loaded` (uploaded when its unit ran) | `InUse` | held |
//! | `Uploading` | `Taken` (its event waited on) | `InUse` | held |
//! | `Resident` | `Taken` | `InUse` | held |
//! | `InUse` | `Returned { keep: true }` | `Resident` | held |
//! | `InUse` | `Returned { keep: false }` | absent | freed |
//! | `Uploading`, `Resident` | `Dropped` (new step, or the tier dropped) | absent | freed once the copy completed |
//!
//! # What bounds it
//!
//! * **The device budget** ([`DeviceLink::budget_bytes`]). The bytes of
//!   every state together never exceed it: a stage that would pass it is
//!   not issued, and a unit whose params do not fit first evicts kept
//!   params. A unit that does not fit on its own is an error that gives
//!   the numbers.
//! * **The prefetch window** (`stage3_prefetch_bucket_size`): elements
//!   whose uploads are in flight ahead of use. The first upload is always
//!   issued.
//! * **Live params** (`stage3_max_live_parameters`): elements uploading or
//!   in use, the kept ones not counted.
//! * **The device cache** (`tierzero.device_cache_bytes`): after its unit,
//!   a param stays `Resident` while the kept bytes fit. The first to come
//!   are kept, so a block's forward leaves its params for its backward.
//!   Every step starts empty ([`crate::model::exec_units::UnitCompute::begin_step`]),
//!   because the optimizer changed the params.
//!
//! # Buffers in flight
//!
//! An upload's pinned staging buffer is moved into the copy and comes back
//! only after the copy's event completes. The CUDA link keeps it with the
//! event; the simulated link's copy thread hands it back. So it is never
//! refilled while the copy engine may still read it. An upload dropped
//! before it is taken (the tier dropped mid-step, a trace that was wrong)
//! is first completed, then its destination is freed.
//!
//! # Bit-identical
//!
//! A unit computes the same operations on the same values whether its
//! params were staged, kept or uploaded when it ran. The copies move
//! bytes; they never convert them.

pub mod cuda;
pub mod sim;
mod tier;

pub use tier::{Residency, TierEvent, TierLimits, TierPeaks, TieredUnits};

use crate::model::ModelError;

/// What the device tier needs of a device.
pub trait DeviceLink: Send + Sync + std::fmt::Debug {
    /// A buffer in device memory (fp32 elements).
    type Buf: Send;
    /// The executor that computes on [`DeviceLink::Buf`]s.
    type Exec<'a>: tierzero_gpu::unit::Exec<Buf = Self::Buf>
    where
        Self: 'a;
    /// An upload in flight: its destination, its staging buffer, its event.
    type Upload: Send;
    /// The executor.
    fn exec(&self) -> Self::Exec<'_>;
    /// What computes, for the plan.
    fn describe(&self) -> String;
    /// Device bytes the tier's params may hold.
    fn budget_bytes(&self) -> u64;
    /// Starts copying `host` into a new device buffer. The copy reads a
    /// pinned staging buffer, which travels with it: this may wait for a
    /// staging buffer to come back.
    fn upload(&self, what: &str, host: &[f32]) -> Result<Self::Upload, ModelError>;
    /// The uploaded buffer, ordered after its copy for the compute that
    /// follows: a CUDA compute stream waits on the copy's event, and the
    /// host does not; the simulated device waits on the host.
    fn finish(&self, upload: Self::Upload) -> Result<Self::Buf, ModelError>;
    /// Frees a buffer.
    fn free(&self, buf: Self::Buf);
}

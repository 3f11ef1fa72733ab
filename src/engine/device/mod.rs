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
//! * [`ResidentUnits`]: training in device memory, when nothing is
//!   offloaded. Every param's weights, gradient sum, fp32 master and
//!   moments stay on the device and AdamW steps there
//!   ([`crate::model::exec_units::DeviceOptimizer`]); with several ranks
//!   (the link's collectives spanning them) the master, moments and step
//!   sums are this rank's shard, reduce-scattered and gathered on the
//!   devices ([`DeviceLink::reduce_kept`], [`DeviceLink::gather_kept`]),
//!   and at stage 3 the weights are too, each unit's gathered for it.
//!   The host's optimizer state is loaded into it before the first step
//!   and written back when the trainer settles (a checkpoint, the final
//!   weights). Its own module docs give its state tables and what the
//!   plan shows.
//!
//! # One state per param on the device
//!
//! [`Residency`] is the state of a param on the device, changed only by
//! [`TierEvent`]s:
//!
//! | state | event | next | device bytes |
//! |---|---|---|---|
//! | absent | `Staged(upload)` | `Uploading` | held by the upload's destination |
//! | absent | `Loading(upload)` (its unit computes next) | `Loading` | held |
//! | `Uploading` | `Due` (its unit computes next) | `Loading` | held |
//! | absent | `Loaded` (uploaded when its unit ran) | `InUse` | held |
//! | `Uploading`, `Loading` | `Taken` (its event waited on) | `InUse` | held |
//! | `Resident` | `Taken` | `InUse` | held |
//! | `InUse` | `Returned { keep: true }` | `Resident` | held |
//! | `InUse` | `Returned { keep: false }` | absent | freed |
//! | `Uploading`, `Loading`, `Resident` | `Dropped` (new step, or the tier dropped) | absent | freed once the copy completed |
//! | `InUse` | `Failed` (its upload failed as its unit took it, or the tier dropped while a unit held it) | absent | the failure's (an error is returned) |
//!
//! # What bounds it
//!
//! * **The device budget** ([`DeviceLink::budget_bytes`]). The bytes of
//!   every state together never exceed it: a unit's own params, and a
//!   stage within the window, first evict kept params (the device cache,
//!   below); a stage that still would pass it is not issued. A unit that
//!   does not fit on its own is an error that gives the numbers.
//! * **The prefetch window** (`stage3_prefetch_bucket_size`): elements
//!   whose uploads are in flight ahead of use. The first upload is always
//!   issued.
//! * **First things first.** Before the engine stages the next unit, it
//!   hands the tier the unit about to compute
//!   ([`crate::model::exec_units::UnitCompute::load`]): whatever of its
//!   params is not on the device or on its way starts uploading then,
//!   and what was staged for it is no longer ahead of use (both
//!   `Loading`, outside the window), so the copy queue carries this
//!   unit's params before the next one's, and the window is the next
//!   unit's to fill. Without it
//!   the first unit of each pass (the embedding forward, the tied head
//!   backward: the largest params) queued behind the next block's
//!   prefetch, and its compute waited for both. The head, which computes
//!   first in backward, is staged under the last block's forward and
//!   launched as that block's output comes down, so neither its upload
//!   (with several ranks, its gather) nor the last block's for its
//!   backward is a stall at backward's start.
//! * **Live params** (`stage3_max_live_parameters`): elements uploading or
//!   in use, the kept ones not counted.
//! * **The device cache** (`tierzero.device_cache_bytes`): after its unit,
//!   a param stays `Resident` while the kept bytes fit, so a block's
//!   forward leaves its params for its backward (and for the next
//!   micro-batch). Every step starts empty
//!   ([`crate::model::exec_units::UnitCompute::begin_step`]), because the
//!   optimizer changed the params. `"auto"` (the default,
//!   [`TierLimits::CACHE_AUTO`]) keeps them as long as the link's budget
//!   for the tier's params holds them.
//!
//!   A kept param is let go when an upload needs its room: a unit's own,
//!   or one the window stages ahead. Never the kept params of the unit
//!   loaded to compute next, or of the unit the room is for; and none
//!   unless enough can go. The one whose last unit comes first goes
//!   first: in forward the first blocks', which backward needs last,
//!   while a tied table, which the head needs at the end of forward,
//!   stays. In backward the same order lets go first the params the rest
//!   of the pass needs last, but keeps those of the units it has passed
//!   (a next-use order would need the pass, which `load` does not carry).
//!
//!   Letting go for the window trades bytes for overlap. A kept param let
//!   go crosses again at its next use, as it would without a cache, so
//!   the cache never moves more bytes than no cache; but keeping it and
//!   uploading the next unit's params at its turn instead moves fewer. In
//!   `tests/device_tier.rs` (a 90 KB budget under a 133 KB GPT-2, 3
//!   steps): no cache 754,944 B, of which 110,592 uploaded at the unit's
//!   turn (`h2d_at_use_bytes`, waited for); auto 587,520 B, 110,592 at
//!   use; auto without the window's evictions (the `make_room` call in
//!   `stage` taken out, session 56) 390,912 B, 210,048 at use. The test
//!   prints the first two (`cargo test --test device_tier auto_cache --
//!   --nocapture`).
//!   The default keeps the window whole: it is no worse than no cache on
//!   either count.
//!
//!   On the 311M Llama of `scripts/sim_offload_ab.sh` (bf16, 594 MB of
//!   params) the simulated device's 4 GiB budget kept all of them: 623 MB
//!   crossed a step instead of 1115 MB. A 400 MiB budget kept part: 844
//!   MB crossed. The weights were the same bits.
//!
//! # Off the engine's thread
//!
//! The params' uploads are issued by the tier's upload thread
//! (`fill.rs`): the fill of a staging buffer is a host copy of the param,
//! and the engine stages the next unit before it launches this one's
//! compute, so on the engine's thread every unit's compute waited for the
//! next unit's fill. One thread, one queue, so the copies keep the order
//! the tier asked for; the engine waits for a fill only when it takes
//! the param. A unit's inputs and a param uploaded as its unit is taken
//! are issued on the engine's thread: they are for use at once. So are
//! the params gathered on the device (below): they are collectives.
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
//! # Params in their storage dtype
//!
//! A param stays on the device as it crossed: bf16 and fp16 params as
//! such (2 bytes an element, [`param_device_bytes`]), which the units'
//! GEMMs of that dtype read as they are; fp32 as fp32. The
//! tier's budget, the resident state and the simulated device all count
//! that. A unit's inputs land as fp32 (the units' activations are fp32).
//! A param's buffer is let go ([`DeviceLink::free`]) after the compute
//! queued on it: the CUDA link holds it with an event until that compute
//! is done, so its free does not make the upload stream wait.
//!
//! # Params straight from their pages and swap buffers
//!
//! A param whose home is a cpu-tier page needs no staging buffer: its
//! bytes are pinned memory already. Nor does an NVMe param whose read
//! landed in a registered swap buffer: the store keeps that buffer, with
//! the tensor built from it, until the param's unit is loaded (see "Swap
//! buffers kept for the device" in [`crate::engine::params::store`]), and
//! its pin is the one handed here. The trainer maps the pages with the
//! link's registrar ([`DeviceLink::host_registrar`]; on a GPU,
//! `cuMemHostRegister`), and hands the tier, with each staged or loaded
//! unit, a read pin of each param's range ([`tierzero_swap::ReadPin`],
//! taken on the engine's thread, so its bytes are those the param's
//! tensor was built from). The upload thread gives the pin to
//! [`DeviceLink::upload_pinned`], which copies the range in place: no
//! host copy, one DMA. The pin travels with the copy until it is done
//! (on a GPU, the link's pin-reaper thread drops it once an event
//! recorded after the copy completed), and a write-back of the optimizer's new bytes into that
//! page waits for every pin of it ([`tierzero_swap::SharedBuffer`]), so
//! the copy engine never reads a range the host is rewriting. A page the
//! device did not register (registration refused, or a device with no
//! registrar) goes through staging as before; the plan says which. The
//! step's `h2d_direct_bytes` counts what crossed in place.
//!
//! # What it shows
//!
//! * **The plan's device rows** ([`TieredUnits`]'s `memory_plan`): the
//!   bound on its params ([`TieredUnits::params_bound_bytes`]: the
//!   largest unit in use, plus what may upload ahead, plus the cache,
//!   within the link's budget), the pinned staging bound
//!   ([`Staging::bound_bytes`]), and on a GPU the share left for a unit's
//!   activations and temporaries and what start-up took (kernels,
//!   cuBLAS). With the tier, the optimizer state and its gradients stay
//!   in host memory, in the plan's other rows ([`ResidentUnits`] has
//!   rows of its own: the params, moments and gradients it keeps).
//! * **Spans of the device's queues** ([`DeviceLink::timed`],
//!   [`DeviceLink::take_spans`]): each unit's compute and each param's
//!   copy, on the host's clock. On a GPU they come from CUDA events on the
//!   compute and h2d streams ([`tierzero_gpu::link::EventClock`]), so they
//!   are the device's busy time, not the host's launches. The step takes
//!   them for its `device_busy_s` and `h2d_busy_s` metrics and for the
//!   timeline's `device: compute` and `device: h2d` lanes. The upload
//!   thread's issues (each staging fill, and any wait for a staging
//!   buffer) are spans too, on the host's clock: `h2d_fill_busy_s` and
//!   the `device: staging fill (host)` lane, which show whether the
//!   fills keep ahead of the compute. With several ranks, each unit's
//!   reduce-scatter on the device is a span of its collectives' stream
//!   (the simulated device: its collective on the host's clock):
//!   `collective_busy_s` and the `device: collective` lane.
//!
//! # Units launched ahead
//!
//! Between two units the engine does host work: it stores what the
//! optimizer sent back, collects the last unit's gradients, releases the
//! unit, fetches the unit after next (waiting, on NVMe, for its read)
//! and stages it. A unit's call returns once its result is on the host
//! (a forward's hidden output, a backward's input gradient), and the
//! device then had nothing queued until the engine's next call: it idled
//! through that work. So once a unit's result came down, both computes
//! ([`TieredUnits`], [`ResidentUnits`]) launch the next unit of the pass
//! on it at once (`ahead.rs`): in forward the next block, on that output
//! (after the last block, the head's forward and backward, on the
//! micro-batch's targets and loss scale: the head computes first in
//! backward; its loss stays on the device until the head's call reads
//! it); in backward the unit before (a block or the embedding), on that
//! gradient and on the unit's input in the last forward. Only when the
//! engine staged that unit and each of its params is on the device with
//! no fill left to wait for (kept, or its upload issued; with
//! [`ResidentUnits`]' params partitioned, gathered as the engine staged
//! it);
//! otherwise
//! nothing is launched, and the tier never waits for a fill there (a
//! param gathered on the device is issued on the engine's thread, so it
//! is ready at once; taking it waits for its exchange, see "Params
//! gathered on the device"). The
//! launched unit holds its params in use and its results on the device
//! until the engine's call for it, which takes them if it is the same
//! unit and pass on the same host tensors (input, upstream gradient,
//! params: their ids); any other call, a new step or the compute dropped
//! gives them back unused first. Its compute is the one the call would
//! have launched, on the same values, so the bits do not change. The
//! step's metrics count the ones taken (`device_forwards_ahead`,
//! `device_backwards_ahead`). The simulated device shows it with a
//! `compute_delay`: its compute is then asynchronous, as a GPU's is.
//!
//! # Gradients out
//!
//! A unit's param gradients leave on the link's copy queue out
//! ([`DeviceLink::download`]) while the engine starts the next unit's
//! backward; the engine collects them after that
//! ([`crate::model::exec_units::UnitCompute::take_grads`]), in the same
//! order as before, so the sums are the same. A download owns its device
//! buffer until its copy completed. The unit's input gradient comes down
//! at once: it is the next unit's upstream. A new step, or the tier
//! dropped, first waits for every download still in flight.
//!
//! With several ranks, on a link with collectives of its own
//! ([`DeviceLink::reduce_ranks`]: NCCL on the GPUs' buffers, or the
//! simulated device's over the ranks' collectives), a unit's gradients
//! do not come down whole: they are laid out per rank on the device as
//! its backward ends ([`DeviceLink::pack_grads`]) and reduce-scattered
//! there when the engine collects them
//! ([`crate::model::exec_units::UnitCompute::reduce_grads`]: this rank's
//! chunks added onto its running sums in rank order, the host's order),
//! so only this rank's sums cross (`grads_out.rs`). A unit with a tied
//! param still comes down whole: that param's sum spans two units.
//!
//! # Params gathered on the device
//!
//! With several ranks on such a link, the params are gathered there too.
//! The param store hands out each param as this rank's shard
//! ([`crate::engine::params::store::ParamStore::hand_out_shards`], once
//! the compute says it gathers:
//! [`crate::model::exec_units::UnitCompute::gathers_params`]), so the
//! host gathers nothing. Where the tier would upload a param, it issues
//! [`DeviceLink::gather_param`] instead: the shard crosses into its
//! range of a new device buffer of the whole param, and the device's
//! collective fills the other ranks' ranges (NCCL's send and receive on
//! a GPU, after the shard's copy, on the collectives' stream; the
//! compute stream waits for it, and the host, issuing it, for nothing). 1/N of each
//! param crosses the host's link; no host collective stages it. A shard
//! crosses from where it is in place ([`DeviceLink::gather_pinned`]), as
//! a whole param does with one rank: its page's range, or the swap
//! buffer its read landed in (the store works as with one rank when it
//! hands out shards, and the trainer registers both with the device).
//! Whether a shard crosses in place may depend on timing (a kept buffer
//! let go for a read); the gather is issued either way. Its size
//! on the device, in the budget and the windows, is the whole param's
//! (the model's count, in the shard's dtype).
//!
//! A gather is a collective, so every rank must issue them in the same
//! order, and in the same order relative to the gradients' reduces. So
//! they are issued on the engine's thread, where the tier decides them
//! (a stage, a load, a param taken that was not staged), never on the
//! upload thread, whose queue would interleave them with the reduces by
//! timing. The tier's decisions are its own counts' (the windows, the
//! cache: the config's; the budget: on a GPU each rank's free memory
//! unless `tierzero.device_budget_bytes` sets it, so the ranks agree on
//! the smallest at start-up, `cuda::CudaLink::with_budget_agreed`), the
//! same on every rank. A unit launched ahead takes only params already
//! on the device, so it issues none. The fill of a shard's staging
//! buffer is then the engine thread's, 1/N of the param's. On a GPU,
//! taking a gathered param (its unit's call, or the unit launched ahead)
//! waits on the host, with the communicator's deadline, for the exchange
//! to be done (a dead peer would never complete it), then orders the
//! compute after it.
//!
//! # A unit's inputs
//!
//! A unit's hidden input, upstream gradient and rotary tables go through
//! the link too ([`DeviceLink::upload_input`]): a pinned staging buffer,
//! the copy queue, the compute stream waiting on the copy's event, as a
//! param's upload does, instead of a synchronous copy from pageable
//! memory on the compute stream. They are the unit's temporaries: the
//! device budget's other share holds them, not the tier's, and they count
//! in `h2d_bytes`. A unit's fp32 output (a block's hidden state in
//! forward, an input gradient in backward) is also kept on the device
//! beside its host copy, one at a time: when that host copy comes in as
//! the next unit's input, the kept buffer is fed instead of an upload
//! (`h2d_kept_bytes`). A bf16 output is not kept: its host copy is
//! rounded, the device's is not. The rotary tables cross once per
//! sequence length: they stay on the device for every later call and
//! step, since they depend on the model and the length alone.
//!
//! # Kept forwards
//!
//! A block's backward needs what its forward computed. By default it
//! computes the forward again from the block's input (activation
//! checkpointing): one more forward per step, and the input crosses to
//! the device a second time. With
//! [`TieredUnits::keep_forwards`] / [`ResidentUnits::keep_forwards`]
//! (the CLI passes `tierzero.activation_budget_bytes`), a block's
//! forward is kept on the device, its input and the intermediates its
//! backward reads (`tierzero_gpu::unit::Gpt2Kept`, `LlamaKept`), while
//! the kept ones fit the budget; the backward then runs from them, as
//! PyTorch eager's autograd does. The budget is
//! [`crate::engine::sizing::device_forward_budget_bytes`]'s: `"auto"`
//! takes half of what the device has left for activations and
//! temporaries (the other half is the computing unit's working set), a
//! byte count more than that room is refused at start-up, and
//! checkpointing keeps none. A forward that does not fit is dropped and
//! its backward recomputes; the blocks of a model are alike, so the kept
//! ones are the first blocks. Each kept forward carries the id of the
//! host input it was computed on: a backward on another input
//! recomputes. The step's metrics count both (`device_forwards_kept`,
//! `device_forwards_recomputed`); every kept forward is dropped at a new
//! step. The engine's trace does not change: backward still visits each
//! block, for its params.
//!
//! # Bit-identical
//!
//! A unit computes the same operations on the same values whether its
//! params were staged, kept or uploaded when it ran, and whether its
//! forward was kept or recomputed. The copies move
//! bytes; they never convert them.

mod ahead;
mod choose;
pub mod cuda;
mod fill;
mod grads_out;
mod inputs;
mod resident;
pub mod sim;
mod tier;

pub use choose::{trains_resident, units_on};
pub use resident::{resident_state_bytes, Grad, GradEvent, ResidentUnits};
pub use tier::{Residency, TierEvent, TierLimits, TierPeaks, TieredUnits};

/// Bytes of an fp32 element on the device.
const ELEM_BYTES: u64 = 4;

/// Device bytes of a param of `numel` elements stored as `dtype`: it stays
/// on the device as it crossed (as `exec_units::host_elems_bytes` counts its crossing):
/// bf16 and fp16 as their 2-byte elements (the units read such params as
/// they are), fp32 as 4. Every count of a
/// param's device bytes (the tier's budget, the resident state, the
/// simulated device's) is this one.
pub fn param_device_bytes(numel: u64, dtype: candle_core::DType) -> u64 {
    numel.saturating_mul(crate::model::exec_units::elem_bytes_crossing(dtype))
}

use std::sync::Arc;

pub use tierzero_gpu::link::Wire;
use tierzero_swap::{HostRegistrar, ReadPin};

use crate::model::exec_units::{DeviceSpan, HostElems, HostVec};
use crate::model::ModelError;

/// What a [`DeviceLink`] without collectives of its own says when one is
/// asked of it (the trait's default collectives).
fn no_collectives(what: &str) -> ModelError {
    ModelError::Gpu {
        what: format!("{what}: this device has no collectives of its own"),
    }
}

/// What the device tier needs of a device.
pub trait DeviceLink: Send + Sync + std::fmt::Debug {
    /// A buffer in device memory: fp32 elements, or a bf16 param's as it
    /// crossed ([`DeviceLink::upload`]).
    type Buf: Send;
    /// The executor that computes on [`DeviceLink::Buf`]s.
    type Exec<'a>: tierzero_gpu::unit::Exec<Buf = Self::Buf>
    where
        Self: 'a;
    /// An upload in flight: its destination, its staging buffer, its event.
    type Upload: Send;
    /// A download in flight: its source and its host buffer.
    type Download: Send;
    /// A unit's gradients laid out on the device for their reduce-scatter
    /// ([`DeviceLink::pack_grads`]).
    type Packed: Send;
    /// The executor.
    fn exec(&self) -> Self::Exec<'_>;
    /// What computes, for the plan.
    fn describe(&self) -> String;
    /// Device bytes the tier's params may hold.
    fn budget_bytes(&self) -> u64;
    /// The `tierzero.device_budget_bytes` that gives the tier's params
    /// `params_bytes` ([`DeviceLink::budget_bytes`] as this link derives
    /// it from the whole budget): the fix a refusal names. By default the
    /// params' budget is the whole.
    fn whole_budget_for(&self, params_bytes: u64) -> u64 {
        params_bytes
    }
    /// Starts copying `host`, a param's elements, into a new device
    /// buffer: fp32 ones into fp32, bf16 ones as they are, half the bytes,
    /// into a buffer that stays bf16 ([`param_device_bytes`]; the units
    /// read bf16 params as they are). The copy reads a pinned staging
    /// buffer, which travels with it: this may wait for a staging buffer
    /// to come back.
    fn upload(&self, what: &str, host: HostElems<'_>) -> Result<Self::Upload, ModelError>;
    /// [`DeviceLink::upload`] of a unit's input (a hidden state, an
    /// upstream gradient, a rotary table): a temporary of the unit, in the
    /// device's share for temporaries, not in the tier's budget, and fp32
    /// on the device (a bf16 one is widened there, exactly: the units'
    /// activations are fp32). The executor drops it with the unit's other
    /// temporaries.
    fn upload_input(&self, what: &str, host: HostElems<'_>) -> Result<Self::Upload, ModelError>;
    /// What registers host memory with the device, so that its copy
    /// engine reads it in place: the trainer maps the cpu tier's pinned
    /// pages with it ([`DeviceLink::upload_pinned`]). None: no such thing.
    fn host_registrar(&self) -> Option<Arc<dyn HostRegistrar>> {
        None
    }
    /// [`DeviceLink::upload`] of a param whose bytes are also `pin`, a
    /// range of pinned host memory (a page, a kept swap buffer) nobody
    /// writes while the pin lives. When that memory is registered through
    /// [`DeviceLink::host_registrar`] (and its bytes are `host`'s), the
    /// copy reads it in place, with no
    /// staging fill, and the pin travels with the copy until it is done:
    /// `(upload, true)`. Otherwise the pin is let go and `host` goes
    /// through staging: `(upload, false)`. This is the one place that
    /// decides; the link only copies ([`DeviceLink::copy_in_place`]).
    fn upload_pinned(
        &self,
        what: &str,
        pin: ReadPin,
        host: HostElems<'_>,
    ) -> Result<(Self::Upload, bool), ModelError> {
        if self.crosses_in_place(&pin, host) {
            return Ok((self.copy_in_place(what, pin, host)?, true));
        }
        drop(pin);
        Ok((self.upload(what, host)?, false))
    }
    /// Whether `pin` may be copied from in place for `host`: memory this
    /// link registered ([`DeviceLink::host_registrar`]) holding exactly
    /// `host`'s bytes. The one rule of [`DeviceLink::upload_pinned`] and
    /// [`DeviceLink::gather_pinned`].
    fn crosses_in_place(&self, pin: &ReadPin, host: HostElems<'_>) -> bool {
        self.host_registrar()
            .is_some_and(|r| pin.registered_with(&r))
            && pin.len_bytes() as u64 == host.bytes()
    }
    /// The copy of [`DeviceLink::upload_pinned`] in place: `pin`'s bytes,
    /// in memory this link registered and exactly `host`'s elements, read
    /// by the copy itself, the pin held until the copy is done. Reached
    /// only through `upload_pinned`, so only for a link with a registrar.
    fn copy_in_place(
        &self,
        what: &str,
        pin: ReadPin,
        host: HostElems<'_>,
    ) -> Result<Self::Upload, ModelError>;
    /// Makes the calling thread ready to issue uploads (the tier's upload
    /// thread calls it once, first): a CUDA link makes its context
    /// current there.
    fn bind_upload_thread(&self) -> Result<(), ModelError> {
        Ok(())
    }
    /// The uploaded buffer, ordered after its copy for the compute that
    /// follows: a CUDA compute stream waits on the copy's event, and the
    /// host does not; the simulated device waits on the host.
    fn finish(&self, upload: Self::Upload) -> Result<Self::Buf, ModelError>;
    /// An upload nobody will take, [`DeviceLink::finish`]ed and freed. A
    /// CUDA link leaves a failure that was not this upload's own (an
    /// earlier operation's, which a wait found) for the next `finish` to
    /// report, so that a caller dropping what this returns does not hide
    /// it.
    fn discard(&self, upload: Self::Upload) -> Result<(), ModelError> {
        self.free(self.finish(upload)?);
        Ok(())
    }
    /// Frees a buffer.
    fn free(&self, buf: Self::Buf);
    /// Starts copying `buf` (a unit's gradient) to the host, on the copy
    /// queue out, after the compute that wrote it; the host does not
    /// wait. Its elements cross as `wire`'s: to bf16 or fp16, rounded on
    /// the device first (to nearest even, as the host's rounding of the
    /// fp32 values; half the bytes cross). The download owns `buf` until
    /// it completes.
    fn download(
        &self,
        what: &str,
        buf: Self::Buf,
        wire: Wire,
    ) -> Result<Self::Download, ModelError>;
    /// The downloaded elements: waits for the copy, then frees its source.
    fn finish_download(&self, d: Self::Download) -> Result<HostVec, ModelError>;
    /// [`DeviceLink::finish_download`], handing `f` the elements where
    /// they landed instead of a copy of them: the CUDA link's pinned
    /// staging buffer, read by `f` straight into the gradient sums (one
    /// host copy of every gradient less), and back to its pool after `f`
    /// returns. By default, `f` reads the copy.
    fn finish_download_with(
        &self,
        d: Self::Download,
        f: &mut dyn FnMut(HostElems<'_>),
    ) -> Result<(), ModelError> {
        let v = self.finish_download(d)?;
        f(v.elems());
        Ok(())
    }
    /// The ranks it reduce-scatters gradients among on the device
    /// ([`DeviceLink::pack_grads`], [`DeviceLink::reduce_grads`]): those
    /// of its own collective (NCCL on the GPU's buffers; the simulated
    /// device's, over the host's collectives). 1: it does not.
    fn reduce_ranks(&self) -> usize {
        1
    }
    /// This rank among [`DeviceLink::reduce_ranks`] (0 with one).
    fn collective_rank(&self) -> usize {
        0
    }
    /// Several ranks, as a unit's backward ends: its gradients `grads`
    /// (fp32 as computed, in declared order) laid out on the device for
    /// their reduce-scatter, ordered after the compute that wrote them, in
    /// `wire`'s dtype (bf16 or fp16 ones rounded to nearest even, the
    /// values [`DeviceLink::download`] would have brought; half the bytes
    /// cross between the ranks): gradient `p` cut into per-rank chunks of
    /// `counts[p][r]` elements, rank `r`'s chunks of every gradient one
    /// after the other, the ranks' blocks in rank order (the layout of
    /// [`crate::engine::comm::rank_chunks`]). The gradients are freed.
    fn pack_grads(
        &self,
        what: &str,
        grads: Vec<Self::Buf>,
        wire: Wire,
        counts: &[Vec<usize>],
    ) -> Result<Self::Packed, ModelError> {
        let _ = (wire, counts);
        for g in grads {
            self.free(g);
        }
        Err(no_collectives(what))
    }
    /// The reduce-scatter of a [`DeviceLink::pack_grads`]: this rank's
    /// chunks from the ranks, widened exactly, added onto `acc` (this rank's accumulated shards,
    /// concatenated in the same order; None: +0.0) one rank after the
    /// other, in rank order, as
    /// [`crate::engine::comm::Comm::reduce_scatter_add_f32`] adds them on
    /// the host: the same bits. The sums come down as fp32. Every rank
    /// calls it for the same units in the same order (it is a
    /// collective); it is ordered after its pack only, not after the
    /// compute queued since.
    fn reduce_grads(
        &self,
        what: &str,
        packed: Self::Packed,
        acc: Option<&[f32]>,
    ) -> Result<Self::Download, ModelError> {
        let _ = (packed, acc);
        Err(no_collectives(what))
    }
    /// Several ranks ([`DeviceLink::reduce_ranks`] > 1): starts a param's
    /// upload from `shard`, this rank's `counts[rank]` elements of it
    /// (`counts[r]` for rank `r`, the ranges in rank order, as
    /// `crate::engine::layout::shard_counts` cuts it), into its range of
    /// a new device buffer of the whole param, then gathers every other
    /// rank's range from that rank there, on the device: 1/N of the param
    /// crosses the host's link, and NCCL moves the rest between the
    /// devices. The same bytes as a gather on the host. Its
    /// [`DeviceLink::finish`] orders the compute after the gather. A
    /// collective: every rank calls it for the same params in the same
    /// order, from one thread.
    fn gather_param(
        &self,
        what: &str,
        shard: HostElems<'_>,
        counts: &[usize],
    ) -> Result<Self::Upload, ModelError> {
        let _ = (shard, counts);
        Err(no_collectives(what))
    }
    /// Several ranks, the optimizer on the device
    /// ([`ResidentUnits`]): [`DeviceLink::reduce_grads`] whose sums stay
    /// on the device, of a pack of several params (`counts[p]`, the cut
    /// of param `p` as packed), in one collective. For each param, this
    /// rank's chunks of it from every rank, widened exactly, added onto
    /// `accs[p]` (its running sums, a buffer of this link's, consumed;
    /// None: +0.0) in rank order: the same additions as on the host.
    /// Returns each param's sums in flight as an upload: its
    /// [`DeviceLink::finish`] waits for the collective (with the
    /// communicator's deadline: a dead peer never completes it) and orders
    /// the compute after it. None: this rank's shard of that param has no
    /// elements (it still sent its chunks). A collective.
    fn reduce_kept(
        &self,
        what: &str,
        packed: Self::Packed,
        accs: Vec<Option<Self::Buf>>,
        counts: &[Vec<usize>],
    ) -> Result<Vec<Option<Self::Upload>>, ModelError> {
        let _ = (packed, counts);
        for a in accs.into_iter().flatten() {
            self.free(a);
        }
        Err(no_collectives(what))
    }
    /// The running sums of a [`DeviceLink::reduce_kept`] in flight, to be
    /// added onto by the next one: that one runs on the same collectives'
    /// stream, after it, so the host need not wait. By default it is
    /// finished ([`DeviceLink::finish`]).
    fn kept_running_sums(&self, u: Self::Upload) -> Result<Self::Buf, ModelError> {
        self.finish(u)
    }
    /// [`DeviceLink::gather_kept`] left in flight: the host does not wait
    /// for it here. Each whole comes back as an upload, which
    /// [`DeviceLink::finish`] hands over once the gather is done (waited
    /// for with the communicator's deadline), the compute ordered after
    /// it: a unit's params gathered ahead of its call. A collective.
    fn gather_kept_ahead(
        &self,
        what: &str,
        wholes: Vec<Self::Buf>,
        shards: &[Option<&Self::Buf>],
        counts: &[Vec<usize>],
    ) -> Result<Vec<Self::Upload>, ModelError> {
        let _ = (shards, counts);
        for w in wholes {
            self.free(w);
        }
        Err(no_collectives(what))
    }
    /// A new buffer of `numel` elements of `dtype` (a param's storage:
    /// fp32, or bf16 or fp16 as they stay on the device), counted in the
    /// device's memory, its values unset: for [`DeviceLink::gather_kept`]
    /// to write in full (a param gathered for its unit from the ranks'
    /// master shards). Freed with [`DeviceLink::free`].
    fn alloc_param(
        &self,
        what: &str,
        numel: usize,
        dtype: candle_core::DType,
    ) -> Result<Self::Buf, ModelError> {
        let _ = (numel, dtype);
        Err(ModelError::Gpu {
            what: format!("{what}: this device allocates no params of its own"),
        })
    }
    /// Several ranks, the optimizer on the device: each of `wholes` (a
    /// param's weights, whole, fp32 or bf16 as they crossed) gets its
    /// range of this rank, `counts[p][rank]` elements, from `shards[p]`
    /// (this rank's fp32 master shard; rounded to nearest even into a
    /// bf16 whole, as the host rounds its bf16 copy; None for a shard of
    /// no elements), after the compute queued so far; then every other
    /// rank's range from that rank, every param's exchange in one group.
    /// NCCL only moves bytes: the bits a gather on the host gives. Waits
    /// for the exchanges with the communicator's deadline and orders the
    /// compute after them. Returns the wholes. A collective.
    fn gather_kept(
        &self,
        what: &str,
        wholes: Vec<Self::Buf>,
        shards: &[Option<&Self::Buf>],
        counts: &[Vec<usize>],
    ) -> Result<Vec<Self::Buf>, ModelError> {
        // [`DeviceLink::gather_kept_ahead`], each whole finished at once:
        // one rule for both.
        let ups = self.gather_kept_ahead(what, wholes, shards, counts)?;
        self.finish_all(ups)
    }
    /// Every upload of `ups` [`DeviceLink::finish`]ed, in order. On an
    /// error the ones finished are freed, and the rest go with their
    /// uploads (which leak what a collective may still write).
    fn finish_all(&self, ups: Vec<Self::Upload>) -> Result<Vec<Self::Buf>, ModelError> {
        let mut bufs = Vec::with_capacity(ups.len());
        for u in ups {
            match self.finish(u) {
                Ok(b) => bufs.push(b),
                Err(e) => {
                    for b in bufs {
                        self.free(b);
                    }
                    return Err(e);
                }
            }
        }
        Ok(bufs)
    }
    /// [`DeviceLink::gather_param`] of a param whose shard's bytes are
    /// also `pin`, a range of pinned host memory nobody writes while the
    /// pin lives (its cpu-tier page's range), as
    /// [`DeviceLink::upload_pinned`] is of an upload: when that memory is
    /// registered through [`DeviceLink::host_registrar`] and holds
    /// exactly the shard's bytes, the shard crosses from it in place, the
    /// pin travelling with the copy: `(upload, true)`; otherwise through
    /// staging: `(upload, false)`. The one place that decides.
    fn gather_pinned(
        &self,
        what: &str,
        pin: ReadPin,
        shard: HostElems<'_>,
        counts: &[usize],
    ) -> Result<(Self::Upload, bool), ModelError> {
        if self.crosses_in_place(&pin, shard) {
            return Ok((self.gather_in_place(what, pin, shard, counts)?, true));
        }
        drop(pin);
        Ok((self.gather_param(what, shard, counts)?, false))
    }
    /// The gather of [`DeviceLink::gather_pinned`] with the shard copied
    /// from `pin` in place (registered, exactly `shard`'s bytes). Reached
    /// only through `gather_pinned`. By default the pin is let go and the
    /// shard crosses through staging.
    fn gather_in_place(
        &self,
        what: &str,
        pin: ReadPin,
        shard: HostElems<'_>,
        counts: &[usize],
    ) -> Result<Self::Upload, ModelError> {
        drop(pin);
        self.gather_param(what, shard, counts)
    }
    /// The device's memory, for the plan.
    fn memory(&self) -> LinkMemory;
    /// Runs `f`, a unit's compute, as a span of the compute queue: on a
    /// GPU, between two events on the compute stream (so the span is the
    /// kernels', not the host's launches); on the simulated device, on the
    /// host's clock.
    fn timed<T>(&self, name: impl FnOnce() -> String, f: impl FnOnce() -> T) -> T;
    /// Waits until the units launched so far have computed, before their
    /// results are read on the host. A GPU's download waits on its stream
    /// anyway, so the CUDA link does nothing here; the simulated device
    /// with a compute delay sleeps out its own clock.
    fn wait_compute(&self) {}
    /// The compute and copy spans that completed since the last call.
    fn take_spans(&self) -> Vec<DeviceSpan>;
}

/// A link's memory, for the start-up plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkMemory {
    /// The whole device budget.
    pub device_budget_bytes: u64,
    /// What start-up took of it (kernels, cuBLAS's workspaces).
    pub startup_bytes: u64,
    /// What is left for a unit's activations, gradients and temporaries
    /// (None: they are in host memory, as on the simulated device).
    pub temporaries_bytes: Option<u64>,
    /// The pinned staging buffers of the uploads.
    pub staging: Staging,
    /// The idle pinned buffers the gradients' downloads keep for reuse,
    /// at most (0: downloads land in no pinned staging, as on the
    /// simulated device). Those in flight come on top: the gradients of
    /// the units not yet taken, at most two units' (`grads_out`: the
    /// engine takes a unit's after it started the next one's backward).
    pub download_idle_bytes: u64,
}

/// The threads that fill a link's staging buffers at once: the tier's
/// upload thread and the engine thread (an upload it needs now).
pub const STAGING_FILLERS: u64 = 2;

/// How a link's pinned staging memory is bounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Staging {
    /// A fixed count of buffers, each as long as the longest upload.
    Slots(usize),
    /// Pools (one per element type) under a byte cap each. A buffer being
    /// filled is out of its pool (the lock is not held over the fill), so
    /// it cannot be freed for room: a pool goes past its cap only when the
    /// uploads filling at once ([`STAGING_FILLERS`] of them at most) do not
    /// fit in it, and then holds those alone.
    Pools {
        /// How many pools.
        pools: usize,
        /// Each one's cap.
        cap_bytes: u64,
    },
}

impl Staging {
    /// The most pinned bytes it holds when the longest upload is
    /// `largest_bytes`.
    pub fn bound_bytes(self, largest_bytes: u64) -> u64 {
        match self {
            Staging::Slots(n) => n as u64 * largest_bytes,
            Staging::Pools { pools, cap_bytes } => {
                pools as u64 * cap_bytes.max(STAGING_FILLERS.saturating_mul(largest_bytes))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Staging;

    #[test]
    fn staging_bounds_count_slots_of_the_longest_upload_or_the_cap() {
        assert_eq!(Staging::Slots(4).bound_bytes(1000), 4000);
        let pools = |pools, cap_bytes| Staging::Pools { pools, cap_bytes };
        assert_eq!(pools(3, 1 << 20).bound_bytes(1000), 3 << 20);
        // Uploads longer than the cap still get their buffers, in any of
        // the pools: two filling at once (neither can be freed for the
        // other) hold twice the longest.
        assert_eq!(pools(3, 1000).bound_bytes(5000), 30000);
        assert_eq!(pools(3, 8000).bound_bytes(5000), 30000);
        assert_eq!(pools(3, 20000).bound_bytes(5000), 60000);
    }
}

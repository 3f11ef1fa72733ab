//! [`PendingUpload`]: an upload in flight, whatever wrote it (a copy
//! from staging or in place, a gather's exchange, a reduce's sums), and
//! the rule that a collective's buffer is never freed before its event.

use cudarc::driver::CudaEvent;

use crate::unit::DevBuf;

/// An upload in flight: the buffer its copy writes and the event recorded
/// after its copy. (Its staging buffer, if it crossed through one, is on
/// the pool's retiring list from the moment the copy was queued: see
/// "What may be in flight" in [`super`].)
#[derive(Debug)]
pub struct PendingUpload {
    /// The buffer the copy writes, of the elements that cross: fp32, or
    /// bf16 or fp16 as they are (half the bytes).
    pub(crate) crossed: Option<DevBuf>,
    /// Recorded after the copy (after a gather's exchange, for a shard
    /// gathered on the device: [`crate::collective::DeviceComm::gather`]).
    pub(crate) event: Option<CudaEvent>,
    /// What `finish` hands over.
    pub(super) role: Role,
    /// Whether a collective writes the rest of `crossed` after the copy
    /// (`event` is then the collective's, which a dead peer may never
    /// complete: see [`PendingUpload::is_gathered`]).
    pub(crate) gathered: bool,
    /// A collective's result, not an upload ([`PendingUpload::collected`]).
    collected: bool,
}

impl Drop for PendingUpload {
    /// A gathered param's buffer dropped before its exchange is seen done
    /// is leaked, never freed: cudarc recorded its last use when each
    /// NCCL call was made, before NCCL queued the work at its group's
    /// end, so a stream-ordered free could run ahead of NCCL's writes.
    /// `Uploads::finish` takes it out first.
    fn drop(&mut self) {
        let done = self
            .event
            .as_ref()
            .is_some_and(|ev| matches!(ev.try_is_complete(), Ok(true)));
        if self.gathered && !done {
            std::mem::forget(self.crossed.take());
        }
    }
}

impl PendingUpload {
    /// An upload of `crossed`, its copy before `event`, not gathered.
    pub(super) fn new(crossed: DevBuf, event: CudaEvent, role: Role) -> Self {
        PendingUpload {
            crossed: Some(crossed),
            event: Some(event),
            role,
            gathered: false,
            collected: false,
        }
    }

    /// A buffer a collective writes, before `done` on its stream (a
    /// reduce-scatter's sums kept on the device,
    /// [`crate::collective::DeviceComm::reduce_onto`]; a param's whole
    /// gathered ahead from the ranks' master shards,
    /// [`crate::collective::DeviceComm::gather_kept`]), as an upload in
    /// flight: waited for with a deadline before [`super::Uploads::finish`]
    /// hands it over as a param's buffer.
    pub fn collected(buf: DevBuf, done: CudaEvent) -> Self {
        PendingUpload {
            crossed: Some(buf),
            event: Some(done),
            role: Role::Param,
            gathered: true,
            collected: true,
        }
    }

    /// Whether its event is a gather's on the ranks' collective stream
    /// ([`crate::collective::DeviceComm::gather`]): a peer that died
    /// leaves it incomplete for ever, so the caller waits for it with a
    /// deadline ([`crate::collective::DeviceComm::wait_gathered`]) before
    /// [`super::Uploads::finish`] orders the compute after it.
    pub fn is_gathered(&self) -> bool {
        self.gathered
    }

    /// Whether it is a collective's result ([`PendingUpload::collected`]):
    /// [`PendingUpload::into_collected`] then gives its buffer.
    pub fn is_collected(&self) -> bool {
        self.collected && self.crossed.is_some()
    }

    /// The buffer of a collective's result, for the next work on that
    /// collective's own stream, which is ordered after it: no host wait,
    /// no event kept. None (and the upload dropped) for any other upload,
    /// which must be finished instead: check [`PendingUpload::is_collected`].
    pub fn into_collected(mut self) -> Option<DevBuf> {
        if self.is_collected() {
            self.crossed.take()
        } else {
            None
        }
    }
}

/// What an upload is for, which decides what [`super::Uploads::finish`] hands
/// over (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A param: the buffer it crossed into, fp32 or bf16, let go by its
    /// owner through [`super::Uploads::free_after_compute`].
    Param,
    /// A unit's input, dropped with the unit's temporaries: an fp32
    /// buffer of the compute stream's (the units' activations are fp32).
    Input,
}

//! [`DeviceComm`]'s collectives for the optimizer on the device (see
//! "The optimizer on the device" in [`super`]): a unit's gradient sums
//! reduce-scattered onto running sums kept on the device
//! ([`DeviceComm::reduce_onto`]), the buffers they used retired after
//! their event ([`DeviceComm::reap`]), and the weights gathered from the
//! master shards ([`DeviceComm::gather_kept`]: after the step, or at
//! stage 3 for each unit).

use std::time::Duration;

use cudarc::driver::CudaEvent;
use cudarc::nccl::result::{group_end, group_start};

use super::{exchange_calls, locked, nccl_err, offsets, shape, Acc, DeviceComm, Packed};
use crate::device::{driver_err, Device, DeviceBuffer};
use crate::unit::DevBuf;
use crate::{GpuError, Result};

/// The weights of [`DeviceComm::gather_kept`].
#[derive(Debug)]
pub struct Gathered {
    /// The wholes, in the order given.
    pub wholes: Vec<DevBuf>,
    /// Recorded on the collective stream after the exchanges: waited for
    /// with a deadline before the compute is ordered after it.
    pub done: CudaEvent,
    /// A timing event as the collective stream's work for it begins, for
    /// the timeline's span (as [`super::Reduced::began`]).
    pub began: Option<CudaEvent>,
}

/// A param's sums of [`DeviceComm::reduce_onto`], this rank's, and the
/// event after them on the communicator's stream.
pub type KeptSums = (DeviceBuffer<f32>, CudaEvent);

impl DeviceComm {
    /// [`Self::reduce`] of a pack of several params' gradients (`counts[p]`
    /// the cut of param `p`, as packed) onto each param's running sums
    /// already on the device (`accs[p]`: fp32, this rank's `counts[p][rank]`
    /// elements, a former result of this; None: +0.0), every param's in
    /// one all-to-all: the sums of the optimizer on the device, which
    /// never leave it. Returns each param's new sums (None for a shard of
    /// no elements) with an event after them on this communicator's
    /// stream, which the caller waits for with a deadline
    /// ([`Self::wait_event`]) before the compute reads them.
    ///
    /// The running sums are copied into one buffer, in pack order, the
    /// chunks added onto it in rank order (`add_chunks`, the same
    /// additions per element as one param at a time: +0.0 for a param
    /// without its own), and each param's range copied out to a buffer of
    /// its own. Every buffer the collective used, the running sums given
    /// included, is the communicator's to free once its event says the
    /// work is done (see `retiring`), so a reduce's send and receive
    /// buffers do not live until the sums are next needed.
    pub fn reduce_onto(
        &self,
        dev: &Device,
        packed: Packed,
        accs: Vec<Option<DeviceBuffer<f32>>>,
        counts: &[Vec<usize>],
    ) -> Result<(Vec<Option<KeptSums>>, Option<CudaEvent>)> {
        let me = self.rank;
        if accs.len() != counts.len() || counts.iter().any(|c| c.len() != self.world) {
            return Err(shape(format!(
                "{} running sums for {} params cut as {counts:?} for {} ranks",
                accs.len(),
                counts.len(),
                self.world
            )));
        }
        let mine: Vec<usize> = counts.iter().map(|c| c[me]).collect();
        for (a, &n) in accs.iter().zip(&mine) {
            if let Some(a) = a.as_ref().filter(|a| a.len() != n) {
                return Err(shape(format!(
                    "{} running sums for a shard of {n} elements",
                    a.len()
                )));
            }
        }
        let total: usize = mine.iter().sum();
        if packed.blocks.len() != self.world || packed.blocks[me] != total {
            return Err(shape(format!(
                "a pack of blocks {:?} for shards of {mine:?} on rank {me}",
                packed.blocks
            )));
        }
        // What earlier reduces used and is done with goes first, so that
        // at most the last one's buffers are held beside this one's.
        self.reap()?;
        let s = &self.stream;
        dev.context()
            .bind_to_thread()
            .map_err(driver_err("cuCtxSetCurrent"))?;
        // Every buffer before the group (a budget refusal fails here,
        // before this rank queues NCCL work; peers already in the group
        // fail at their deadline): the running sums in one,
        // in pack order (on this stream, where they were written), and
        // each param's own for its range of the new sums.
        let acc = if accs.iter().any(Option::is_some) && total > 0 {
            let mut acc = dev.alloc_output_on::<f32>(s, "running gradient sums", total)?;
            let mut at = 0usize;
            for (a, &n) in accs.iter().zip(&mine) {
                if n > 0 {
                    let mut dst = acc.slice_mut().slice_mut(at..at + n);
                    match a {
                        Some(a) => s.memcpy_dtod(a.slice(), &mut dst),
                        None => s.memset_zeros(&mut dst),
                    }
                    .map_err(driver_err("cuMemcpyDtoDAsync"))?;
                }
                at += n;
            }
            Some(acc)
        } else {
            None
        };
        let mut owns = mine
            .iter()
            .map(|&n| {
                (n > 0)
                    .then(|| dev.alloc_output_on::<f32>(s, "gradient sums", n))
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        // The running sums given travel with the collective: after an
        // error past the group (the one that breaks the communicator) they
        // are leaked with its buffers. One before it (a budget refusal, the
        // communicator broken already) queued nothing on them: they are
        // freed, and their bytes leave the budget.
        let accs: Vec<DevBuf> = accs.into_iter().flatten().map(DevBuf::F32).collect();
        let broken_before = self.is_broken();
        let mut r = match self.reduce_from(dev, packed, acc.map(Acc::Device)) {
            Ok(r) => r,
            Err(e) => {
                if !broken_before && self.is_broken() {
                    std::mem::forget((accs, owns));
                }
                return Err(e);
            }
        };
        let began = r.began.take();
        let mut keep = std::mem::take(&mut r.keep);
        keep.extend(accs);
        // Each param's range of the sums copied to its own buffer.
        let split = (|| -> Result<Vec<Option<KeptSums>>> {
            let mut out = Vec::with_capacity(mine.len());
            let mut at = 0usize;
            for (own, &n) in owns.iter_mut().zip(&mine) {
                match (own.take(), r.sums.as_ref()) {
                    (Some(mut own), Some(sums)) => {
                        s.memcpy_dtod(&sums.slice().slice(at..at + n), own.slice_mut())
                            .map_err(driver_err("cuMemcpyDtoDAsync"))?;
                        let ev = s.record_event(None).map_err(driver_err("cuEventRecord"))?;
                        out.push(Some((own, ev)));
                    }
                    _ => out.push(None),
                }
                at += n;
            }
            Ok(out)
        })();
        keep.extend(r.sums.take().map(DevBuf::F32));
        let retired = split.and_then(|out| {
            let ev = s.record_event(None).map_err(driver_err("cuEventRecord"))?;
            Ok((out, ev))
        });
        match retired {
            Ok((out, ev)) => {
                locked(&self.retiring).push(ev, keep);
                Ok((out, began))
            }
            Err(e) => {
                // Not knowing when the collective ends, its buffers are
                // leaked, never freed under it.
                std::mem::forget((keep, owns));
                self.set_broken();
                Err(e)
            }
        }
    }

    /// Frees the retiring buffers whose collective is done, oldest first
    /// (a reduce kept on the device calls it first; so does the weights'
    /// gather, after which every reduce of the step is done).
    pub fn reap(&self) -> Result<()> {
        locked(&self.retiring)
            .drop_done()
            .map_err(driver_err("cuEventQuery"))
    }

    /// The weights of the optimizer on the device, with several ranks
    /// (after its step, or at stage 3 a unit's before it runs): each of
    /// `wholes` gets this rank's range (`counts[p]`
    /// cut, in rank order) from `shards[p]`, its fp32 master shard (copied
    /// into an fp32 whole; rounded to nearest even into a bf16 one, by
    /// `cast_f32_bf16`; None for a shard of no elements), on the compute
    /// stream after the work queued there; then, on this communicator's
    /// stream after that, every param's range sent to every peer and each
    /// peer's received into place, in one group. Returns the wholes and the
    /// event after the exchanges: the caller waits for it with a deadline
    /// ([`Self::wait_event`]) before ordering the compute after it. On an
    /// error after the group the wholes are leaked (see "Buffers in
    /// flight").
    pub fn gather_kept(
        &self,
        dev: &Device,
        wholes: Vec<DevBuf>,
        shards: &[Option<&DevBuf>],
        counts: &[Vec<usize>],
    ) -> Result<Gathered> {
        self.check_usable("ncclSend/ncclRecv (the weights' gather)")?;
        // What the reduces done by now used goes before the gather's
        // buffers are taken (after the step, every one of them).
        self.reap()?;
        let (me, world) = (self.rank, self.world);
        if shards.len() != wholes.len() || counts.len() != wholes.len() {
            return Err(shape(format!(
                "{} params, {} shards, {} counts",
                wholes.len(),
                shards.len(),
                counts.len()
            )));
        }
        for ((w, sh), c) in wholes.iter().zip(shards).zip(counts) {
            let n = sh.map_or(0, |b| b.len());
            if c.len() != world || c.iter().sum::<usize>() != w.len() || c[me] != n {
                return Err(GpuError::Shape {
                    kernel: "gather_kept".into(),
                    detail: format!(
                        "a param of {} elements cut as {c:?} for {world} ranks, a shard of {n} \
                         on rank {me}",
                        w.len()
                    ),
                });
            }
        }
        dev.context()
            .bind_to_thread()
            .map_err(driver_err("cuCtxSetCurrent"))?;
        let mut wholes = wholes;
        // This rank's ranges, on the compute stream.
        for ((w, sh), c) in wholes.iter_mut().zip(shards).zip(counts) {
            let Some(sh) = sh else { continue };
            let src = sh.f32()?;
            let from = offsets(c)[me];
            let range = from..from + c[me];
            match w {
                DevBuf::F32(w) => {
                    let mut dst = w.slice_mut().slice_mut(range);
                    dev.compute
                        .memcpy_dtod(src.slice(), &mut dst)
                        .map_err(driver_err("cuMemcpyDtoDAsync"))?;
                }
                DevBuf::Bf16(w) => {
                    // Rounded into a buffer of the compute stream's, freed
                    // there after the copy that reads it.
                    let mut narrow = dev.alloc_output::<half::bf16>("master rounded", c[me])?;
                    crate::ops::cast::<f32, half::bf16>(dev, &mut narrow, src)?;
                    let mut dst = w.slice_mut().slice_mut(range);
                    dev.compute
                        .memcpy_dtod(narrow.slice(), &mut dst)
                        .map_err(driver_err("cuMemcpyDtoDAsync"))?;
                }
                DevBuf::F16(_) => {
                    return Err(shape(
                        "an fp16 whole (the device optimizer keeps fp32 or bf16 params)".into(),
                    ))
                }
            }
        }
        let written = dev
            .compute
            .record_event(None)
            .map_err(driver_err("cuEventRecord"))?;
        let s = &self.stream;
        s.wait(&written).map_err(driver_err("cuStreamWaitEvent"))?;
        // Timing only: a failed record loses the span, not the gather.
        let began = crate::link::timing(crate::link::EventClock::mark(s));
        let exchanged = {
            let h = self.handle.lock().unwrap_or_else(|p| p.into_inner());
            (|| -> Result<()> {
                group_start().map_err(nccl_err("ncclGroupStart"))?;
                let mut first_error = None;
                for (w, c) in wholes.iter_mut().zip(counts) {
                    let sent = match w {
                        DevBuf::F32(b) => exchange_calls(&h.comm, b, c, me),
                        DevBuf::Bf16(b) => exchange_calls(&h.comm, b, c, me),
                        DevBuf::F16(b) => exchange_calls(&h.comm, b, c, me),
                    };
                    if let Err(e) = sent {
                        first_error.get_or_insert(e);
                    }
                }
                let ended = group_end().map_err(nccl_err("ncclGroupEnd"));
                if let Some(e) = first_error {
                    return Err(e);
                }
                ended.map(|_| ())
            })()
        }
        .and_then(|()| s.record_event(None).map_err(driver_err("cuEventRecord")));
        match exchanged {
            Ok(done) => Ok(Gathered {
                wholes,
                done,
                began,
            }),
            Err(e) => {
                // NCCL's work may wait for a peer for ever: the wholes are
                // neither waited for nor freed under it.
                std::mem::forget(wholes);
                self.set_broken();
                Err(e)
            }
        }
    }

    /// Waits for `ev`, a collective's event, at most `timeout`, as
    /// [`Self::wait`] waits for a reduce (an error naming `call` past it:
    /// a rank has died or hangs; the communicator is then unusable).
    pub fn wait_event(&self, ev: &CudaEvent, timeout: Duration, call: &'static str) -> Result<()> {
        self.poll(ev, timeout, call)
    }
}

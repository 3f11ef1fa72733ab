//! [`Filler`]: the device tier's param uploads issued off the engine's
//! thread.
//!
//! # Why
//!
//! Issuing an upload fills its pinned staging buffer on the host (a copy
//! of the param's bytes, `tierzero_gpu::host_copy`) before the copy
//! engine can take it. The engine hands the tier the next unit's params
//! ([`crate::model::exec_units::UnitCompute::stage`]) *before* it
//! launches this unit's compute, so with the fill on the engine's thread
//! the device sat idle for the whole fill of the next unit's params: per
//! unit, fill then compute, not the longer of the two. On the filler's
//! thread the fill runs while this unit computes; the engine only waits
//! for it when the unit that needs the param is taken, and then only for
//! what is left of it.
//!
//! # Order
//!
//! One thread, one queue: uploads are issued in the order the tier asked
//! for them ([`Filler::send`] takes a unit's params in one message), so
//! the copy queue carries the unit computing now before the one after it
//! ("first things first" in [`super`]). A unit's inputs, needed at once,
//! are still uploaded on the engine's thread.
//!
//! # What may be in flight
//!
//! A [`Queued`] upload is the receiving end of the filler's reply: the
//! upload itself (its staging buffer, destination and event) is on the
//! filler's thread until it is issued, then in the reply. The tier holds
//! the [`Queued`] in the param's state, as it held the upload; its device
//! bytes were counted when the tier admitted it, before the filler
//! allocates them. An upload whose [`Queued`] was dropped before the reply
//! (nobody will take it) is finished and freed on the filler's thread,
//! as the tier finishes and frees an upload it drops. Dropping the filler
//! waits for its thread, so nothing it issued outlives it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use candle_core::Tensor;
use crossbeam_channel::{Receiver, Sender};
use tierzero_swap::ReadPin;

use super::DeviceLink;
use crate::model::exec_units::{with_host_elems, DeviceQueue, DeviceSpan};
use crate::model::ModelError;

/// One param for [`Filler::send`]: its host tensor, the pin of the same
/// bytes in pinned host memory when it is in some (the link may copy from
/// there in place, [`DeviceLink::upload_pinned`]), and its slot.
pub struct Fill<U> {
    /// Its name in the spans.
    pub what: String,
    /// The param's host tensor.
    pub host: Tensor,
    /// Its bytes in pinned host memory (a page, a kept swap buffer), if
    /// they are in some.
    pub pin: Option<ReadPin>,
    /// Where its upload goes.
    pub slot: Slot<U>,
}

/// Where the filler puts one upload ([`Filler::slot`]).
#[derive(Debug)]
pub struct Slot<U> {
    reply: Sender<Result<U, ModelError>>,
}

/// An upload the filler issues, or has issued.
#[derive(Debug)]
pub struct Queued<U> {
    rx: Receiver<Result<U, ModelError>>,
    /// The filler's answer, once [`Queued::is_issued`] took it.
    got: Option<Result<U, ModelError>>,
}

impl<U> Queued<U> {
    /// An upload issued already, on another thread (a param gathered on
    /// the device is issued on the engine's).
    pub fn issued(u: U) -> Self {
        let (_, rx) = crossbeam_channel::bounded(1);
        Queued {
            rx,
            got: Some(Ok(u)),
        }
    }

    /// Whether the filler has issued the upload: [`Queued::wait`] would
    /// not block, and returns it. An upload whose issue failed is not:
    /// nothing is launched ahead on it, and the call for its unit says
    /// the error.
    pub fn is_issued(&mut self) -> bool {
        if self.got.is_none() {
            self.got = self.rx.try_recv().ok();
        }
        matches!(self.got, Some(Ok(_)))
    }

    /// The upload, once the filler issued it (the host waits for the
    /// fill, not for the copy); its error, if issuing failed.
    pub fn wait(self) -> Result<U, ModelError> {
        match self.got {
            Some(r) => r,
            None => self.rx.recv().unwrap_or_else(|_| {
                Err(ModelError::Gpu {
                    what: "device tier: the upload thread stopped before issuing an upload".into(),
                })
            }),
        }
    }
}

/// The upload thread of one tier (see the module docs).
pub struct Filler<L: DeviceLink> {
    tx: Option<Sender<Vec<Fill<L::Upload>>>>,
    thread: Option<JoinHandle<()>>,
    /// Each upload's issue (fill, and any wait for a staging buffer), on
    /// the host's clock, not yet taken.
    spans: Arc<Mutex<Vec<DeviceSpan>>>,
    /// Bytes uploaded in place from registered pages, not yet taken.
    direct_bytes: Arc<AtomicU64>,
}

impl<L: DeviceLink> std::fmt::Debug for Filler<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Filler").finish_non_exhaustive()
    }
}

impl<L: DeviceLink + 'static> Filler<L> {
    /// The thread that issues `link`'s uploads.
    pub fn new(link: Arc<L>) -> Result<Self, ModelError> {
        let (tx, rx) = crossbeam_channel::unbounded::<Vec<Fill<L::Upload>>>();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let log = spans.clone();
        let direct_bytes = Arc::new(AtomicU64::new(0));
        let in_place = direct_bytes.clone();
        let thread = std::thread::Builder::new()
            .name("tierzero-h2d-fill".into())
            .spawn(move || {
                let bound = link.bind_upload_thread();
                for items in rx {
                    for Fill {
                        what,
                        host,
                        pin,
                        slot: Slot { reply },
                    } in items
                    {
                        let start = Instant::now();
                        let r = match &bound {
                            // A panic (a library's, loaded at run time)
                            // comes back as this upload's error with its
                            // message: the thread goes on, and the waits
                            // behind it do not all say only that it stopped.
                            Ok(()) => {
                                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                    with_host_elems(&host, |v| match pin {
                                        Some(pin) => {
                                            let (u, direct) = link.upload_pinned(&what, pin, v)?;
                                            if direct {
                                                in_place.fetch_add(v.bytes(), Ordering::Relaxed);
                                            }
                                            Ok(u)
                                        }
                                        None => link.upload(&what, v),
                                    })
                                }))
                                .unwrap_or_else(|p| {
                                    Err(ModelError::Gpu {
                                        what: format!(
                                        "device tier: {what} not uploaded: the upload panicked: {}",
                                        crate::gpu::panic_message(p.as_ref())
                                    ),
                                    })
                                })
                            }
                            Err(e) => Err(ModelError::Gpu {
                                what: format!("device tier: {what} not uploaded: {e}"),
                            }),
                        };
                        log.lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(DeviceSpan {
                                queue: DeviceQueue::Fill,
                                name: what,
                                start,
                                end: Instant::now(),
                            });
                        if let Err(crossbeam_channel::SendError(Ok(u))) = reply.send(r) {
                            // Nobody takes it: finished and freed, as the
                            // tier does with an upload it drops.
                            if let Err(e) = link.discard(u) {
                                tracing::warn!(error = %e, "an upload nobody took failed");
                            }
                        }
                    }
                }
            })
            .map_err(|e| ModelError::Gpu {
                what: format!("device tier: could not start the upload thread: {e}"),
            })?;
        Ok(Filler {
            tx: Some(tx),
            thread: Some(thread),
            spans,
            direct_bytes,
        })
    }
}

impl<L: DeviceLink> Filler<L> {
    /// The issues that ended since the last call (the timeline's
    /// `device: staging fill (host)` lane, `h2d_fill_busy_s`).
    pub fn take_spans(&self) -> Vec<DeviceSpan> {
        std::mem::take(&mut *self.spans.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Bytes uploaded in place from registered pages since the last call
    /// (`h2d_direct_bytes`).
    pub fn take_direct_bytes(&self) -> u64 {
        self.direct_bytes.swap(0, Ordering::Relaxed)
    }

    /// A reply slot: the [`Queued`] the tier keeps, and the [`Slot`] the
    /// upload goes into, for [`Filler::send`]. A slot never sent leaves
    /// its [`Queued`] an error.
    pub fn slot(&self) -> (Slot<L::Upload>, Queued<L::Upload>) {
        let (reply, rx) = crossbeam_channel::bounded(1);
        (Slot { reply }, Queued { rx, got: None })
    }

    /// Issues the uploads of `items`, in order, as one message.
    pub fn send(&self, items: Vec<Fill<L::Upload>>) -> Result<(), ModelError> {
        if items.is_empty() {
            return Ok(());
        }
        self.tx
            .as_ref()
            .and_then(|tx| tx.send(items).ok())
            .ok_or_else(|| ModelError::Gpu {
                what: "device tier: the upload thread has stopped".into(),
            })
    }
}

impl<L: DeviceLink> Drop for Filler<L> {
    fn drop(&mut self) {
        // The thread ends when its queue is closed and empty.
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use std::time::Duration;

    use candle_core::{DType, Device};
    use tierzero_gpu::unit::GemmDtype;

    use super::*;
    use crate::engine::device::sim::{SimConfig, SimDevice, SimUpload};

    fn sim(delay_ms: u64, slots: usize) -> SimDevice {
        SimDevice::new(SimConfig {
            budget_bytes: 1 << 20,
            copy_delay: Duration::from_millis(delay_ms),
            h2d_bytes_per_s: None,
            staging_slots: slots,
            gemm: GemmDtype::F32,
            fail_upload: None,
            compute_delay: std::time::Duration::ZERO,
        })
        .unwrap()
    }

    fn fill_of(what: String, host: Tensor, slot: Slot<SimUpload>) -> Fill<SimUpload> {
        Fill {
            what,
            host,
            pin: None,
            slot,
        }
    }

    fn host(n: usize, v: f32) -> Tensor {
        Tensor::full(v, n, &Device::Cpu).unwrap()
    }

    #[test]
    fn uploads_are_issued_in_the_order_sent_and_carry_their_bytes() {
        let link = Arc::new(sim(1, 2));
        let fill = Filler::new(link.clone()).unwrap();
        let mut queued = Vec::new();
        let mut items = Vec::new();
        for (k, n) in [7usize, 1, 33, 4].into_iter().enumerate() {
            let (slot, q) = fill.slot();
            items.push(fill_of(format!("p{k}"), host(n, k as f32 + 0.5), slot));
            queued.push((n, k, q));
        }
        fill.send(items).unwrap();
        for (n, k, q) in queued {
            let buf = link.finish(q.wait().unwrap()).unwrap();
            assert_eq!(buf, vec![k as f32 + 0.5; n]);
            link.free(buf);
        }
        let names: Vec<String> = link.take_spans().into_iter().map(|s| s.name).collect();
        assert_eq!(names, ["p0", "p1", "p2", "p3"]);
        let fills = fill.take_spans();
        assert_eq!(fills.len(), 4);
        assert!(fills
            .iter()
            .all(|s| s.queue == DeviceQueue::Fill && s.end >= s.start));
        drop(fill);
        let p = link.probe();
        assert_eq!((p.used_bytes(), p.in_flight()), (0, 0));
    }

    #[test]
    fn an_upload_nobody_takes_is_finished_and_freed_by_the_thread() {
        let link = Arc::new(sim(20, 1));
        let p = link.probe();
        let fill = Filler::new(link.clone()).unwrap();
        let items: Vec<_> = (0..3)
            .map(|k| {
                let (slot, q) = fill.slot();
                drop(q);
                fill_of(format!("p{k}"), host(64, 1.0), slot)
            })
            .collect();
        fill.send(items).unwrap();
        // A slot never sent: its upload is an error, not a hang.
        let (slot, q) = fill.slot();
        drop(slot);
        let e = q.wait().unwrap_err().to_string();
        assert!(e.contains("stopped before issuing"), "{e}");
        drop(fill);
        assert_eq!(p.uploads(), 3);
        assert_eq!((p.used_bytes(), p.in_flight()), (0, 0));
        assert_eq!(p.free_staging(), p.staging_slots());
        assert_eq!(p.violations(), 0);
    }

    #[test]
    fn bf16_hosts_cross_as_bf16() {
        let link = Arc::new(sim(0, 1));
        let fill = Filler::new(link.clone()).unwrap();
        let (slot, q) = fill.slot();
        let t = host(5, 1.25).to_dtype(DType::BF16).unwrap();
        fill.send(vec![fill_of("b".into(), t, slot)]).unwrap();
        let buf = link.finish(q.wait().unwrap()).unwrap();
        // Widened exactly on the device side.
        assert_eq!(buf, vec![1.25f32; 5]);
        link.free(buf);
    }
}

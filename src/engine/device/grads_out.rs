//! A unit's param gradients out of the device tier ([`GradsOut`]).
//!
//! As a unit's backward ends, its gradients either start down on the
//! link's copy queue out, whole (one rank; a unit with a tied param,
//! whose sum spans two units and is made on the host), or stay on the
//! device (several ranks, on a link that reduce-scatters there:
//! [`DeviceLink::reduces_grads`]). The engine collects them after it
//! started the next unit's backward, in backward order on every rank:
//! the downloads with `take`, the kept ones with `reduce`, which
//! reduce-scatters them on the device ([`DeviceLink::reduce_grads`]: a
//! collective, so issued there, in an order the same on every rank, and
//! never from the tier's own threads) and brings down this rank's sums
//! only. Each rank then moves `1 / ranks` of a unit's gradients over its
//! host link instead of all of them, plus its running sums' upload when
//! a micro-batch before this one began them.
//!
//! Every buffer is owned by its entry here until its download completed
//! (or, kept, until the reduce's download did); a new step or the tier
//! dropped waits for the downloads and frees the kept buffers.

use std::collections::VecDeque;
use std::sync::Mutex;

use candle_core::{DType, Tensor};

use super::{DeviceLink, Wire, ELEM_BYTES};
use crate::model::exec_units::HostVec;
use crate::model::{Model, ModelError, ParamId, UnitId};

/// One param's gradient, with its host shape.
type Held<T> = (ParamId, T, Vec<usize>);

/// A unit's gradients on the host, in declared order.
type HostGrads = Vec<(ParamId, Tensor)>;

/// Where one unit's gradients are.
enum Where<L: DeviceLink> {
    /// On their way to the host.
    Downloading(Vec<Held<L::Download>>),
    /// Kept on the device for the reduce-scatter there.
    OnDevice(Vec<Held<L::Buf>>),
}

/// One unit's param gradients.
struct Pending<L: DeviceLink> {
    unit: UnitId,
    at: Where<L>,
    /// The gradients' dtype on the host.
    dtype: DType,
}

/// What moved, for the tier's traffic.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Moved {
    /// Bytes down.
    pub d2h_bytes: u64,
    /// Bytes up (a reduce's running sums).
    pub h2d_bytes: u64,
}

/// The units' param gradients not yet collected, oldest first.
pub(super) struct GradsOut<L: DeviceLink> {
    queue: Mutex<VecDeque<Pending<L>>>,
}

/// The wire a gradient of `dtype` crosses as: 16-bit ones rounded on the
/// device, half the bytes.
pub(super) fn wire_of(dtype: DType) -> Wire {
    match dtype {
        DType::BF16 => Wire::Bf16,
        DType::F16 => Wire::F16,
        _ => Wire::F32,
    }
}

/// Bytes of one element on `wire`.
fn wire_bytes(wire: Wire) -> u64 {
    if wire == Wire::F32 {
        ELEM_BYTES
    } else {
        2
    }
}

impl<L: DeviceLink> GradsOut<L> {
    pub(super) fn new() -> Self {
        GradsOut {
            queue: Mutex::new(VecDeque::new()),
        }
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, VecDeque<Pending<L>>> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A unit's gradients, its backward just ended: kept on the device
    /// when `link` reduce-scatters there and none of them is tied (a
    /// param of more than one unit), else started down. Returns the
    /// bytes that started down.
    pub(super) fn put(
        &self,
        link: &L,
        model: &Model,
        unit: UnitId,
        grads: Vec<Held<L::Buf>>,
        dtype: DType,
    ) -> Result<u64, ModelError> {
        let untied = grads
            .iter()
            .all(|(id, _, _)| model.params().get(id.0).is_some_and(|p| p.units.len() == 1));
        let (at, down) = if link.reduces_grads() && untied && !grads.is_empty() {
            (Where::OnDevice(grads), 0)
        } else {
            let wire = wire_of(dtype);
            let mut down = 0u64;
            let mut out = Vec::with_capacity(grads.len());
            for (id, g, dims) in grads {
                down += dims.iter().product::<usize>() as u64 * wire_bytes(wire);
                out.push((id, link.download(&format!("grad {}", id.0), g, wire)?, dims));
            }
            (Where::Downloading(out), down)
        };
        self.queue().push_back(Pending { unit, at, dtype });
        Ok(down)
    }

    fn remove(&self, unit: UnitId) -> Option<Pending<L>> {
        let mut q = self.queue();
        let i = q.iter().position(|p| p.unit == unit)?;
        q.remove(i)
    }

    /// The params of `unit` whose gradients are kept on the device.
    pub(super) fn on_device(&self, unit: UnitId) -> Option<Vec<ParamId>> {
        self.queue()
            .iter()
            .find(|p| p.unit == unit)
            .and_then(|p| match &p.at {
                Where::OnDevice(g) => Some(g.iter().map(|(id, _, _)| *id).collect()),
                Where::Downloading(_) => None,
            })
    }

    /// `unit`'s gradients on the host, whole, in declared order (kept
    /// ones downloaded now), once their copies completed. None: none of
    /// `unit`'s.
    pub(super) fn take(
        &self,
        link: &L,
        unit: UnitId,
    ) -> Result<Option<(HostGrads, Moved)>, ModelError> {
        let Some(p) = self.remove(unit) else {
            return Ok(None);
        };
        let mut moved = Moved::default();
        let wire = wire_of(p.dtype);
        let downloads = match p.at {
            Where::Downloading(d) => d,
            Where::OnDevice(bufs) => {
                let mut out = Vec::with_capacity(bufs.len());
                let mut failed = Ok(());
                for (id, g, dims) in bufs {
                    if failed.is_err() {
                        link.free(g);
                        continue;
                    }
                    moved.d2h_bytes += dims.iter().product::<usize>() as u64 * wire_bytes(wire);
                    match link.download(&format!("grad {}", id.0), g, wire) {
                        Ok(d) => out.push((id, d, dims)),
                        Err(e) => failed = Err(e),
                    }
                }
                if let Err(e) = failed {
                    let _ = Self::finish_all(link, out);
                    return Err(e);
                }
                out
            }
        };
        let mut out = Vec::with_capacity(downloads.len());
        let mut result = Ok(());
        for (id, d, dims) in downloads {
            // After an error the rest are still waited for (their
            // buffers come back), not used.
            match link.finish_download(d) {
                Ok(v) if result.is_ok() => out.push((id, v.into_tensor(&dims, p.dtype)?)),
                Ok(_) => {}
                Err(e) => result = result.and(Err(e)),
            }
        }
        result.map(|()| Some((out, moved)))
    }

    /// `unit`'s kept gradients reduce-scattered on the device
    /// ([`DeviceLink::reduce_grads`]), this rank's sums on the host.
    pub(super) fn reduce(
        &self,
        link: &L,
        unit: UnitId,
        counts: &[Vec<usize>],
        acc: Option<&[f32]>,
    ) -> Result<(Vec<f32>, Moved), ModelError> {
        let refused = |why: &str| ModelError::Gpu {
            what: format!(
                "unit {}: no gradients kept on the device to reduce ({why})",
                unit.0
            ),
        };
        let (bufs, dtype) = match self.remove(unit) {
            Some(Pending {
                at: Where::OnDevice(bufs),
                dtype,
                ..
            }) => (bufs, dtype),
            Some(p) => {
                // Not kept: back in the queue for `take`.
                self.queue().push_front(p);
                return Err(refused("they are downloading"));
            }
            None => return Err(refused("none")),
        };
        let wire = wire_of(dtype);
        let bufs: Vec<L::Buf> = bufs.into_iter().map(|(_, b, _)| b).collect();
        let d = link.reduce_grads(
            &format!("unit {} gradients", unit.0),
            bufs,
            wire,
            counts,
            acc,
        )?;
        let sums = match link.finish_download(d)? {
            HostVec::F32(v) => v,
            other => {
                return Err(ModelError::Gpu {
                    what: format!(
                        "unit {}: the reduced gradients came down as {} bytes of 16-bit \
                         elements, not fp32",
                        unit.0,
                        other.bytes()
                    ),
                })
            }
        };
        let moved = Moved {
            d2h_bytes: sums.len() as u64 * ELEM_BYTES,
            h2d_bytes: acc.map_or(0, |a| a.len() as u64 * ELEM_BYTES),
        };
        Ok((sums, moved))
    }

    fn finish_all(link: &L, downloads: Vec<Held<L::Download>>) -> Result<(), ModelError> {
        let mut result = Ok(());
        for (_, d, _) in downloads {
            if let Err(e) = link.finish_download(d) {
                result = result.and(Err(e));
            }
        }
        result
    }

    /// Waits for every download still in flight and frees every kept
    /// buffer (a new step, the tier dropped).
    pub(super) fn drain(&self, link: &L) -> Result<(), ModelError> {
        let pending: Vec<_> = self.queue().drain(..).collect();
        let mut result = Ok(());
        for p in pending {
            match p.at {
                Where::Downloading(d) => result = result.and(Self::finish_all(link, d)),
                Where::OnDevice(bufs) => {
                    for (_, b, _) in bufs {
                        link.free(b);
                    }
                }
            }
        }
        result
    }
}

//! A unit's inputs through a [`DeviceLink`]: the [`Crossing`] both device
//! computes ([`super::TieredUnits`], [`super::ResidentUnits`]) give their
//! units (see "A unit's inputs" in the module docs of [`super`]).

use std::sync::Mutex;
use std::time::Instant;

use candle_core::{DType, Tensor, TensorId};

use super::{DeviceLink, ELEM_BYTES};
use crate::model::exec_units::{self, BackwardOut, Crossing, DeviceTraffic};
use crate::model::{Model, ModelError, UnitId, UnitInput, UnitOutput, Upstream};

/// Elements of a host tensor.
pub(super) fn numel_of(t: &Tensor) -> u64 {
    t.elem_count() as u64
}

/// Elements of a unit's output (it came down to the host).
pub(super) fn output_numel(out: &UnitOutput) -> u64 {
    match out {
        UnitOutput::Hidden(t) | UnitOutput::Loss(t) => numel_of(t),
    }
}

/// The last unit's fp32 output kept on the device, and what the inputs
/// moved.
pub(super) struct Inputs<B> {
    /// The last unit's fp32 output (hidden state or input gradient) still
    /// on the device, with the id of its host copy: fed back instead of
    /// uploaded when that copy is the next unit's input.
    carry: Mutex<Option<(TensorId, B)>>,
    /// The inputs' uploads (and what was not uploaded) since the last
    /// [`Inputs::take_traffic`].
    traffic: Mutex<DeviceTraffic>,
}

impl<B> Inputs<B> {
    pub(super) fn new() -> Self {
        Inputs {
            carry: Mutex::new(None),
            traffic: Mutex::new(DeviceTraffic::default()),
        }
    }

    /// Drops the kept output (a new step, or the compute dropped).
    pub(super) fn clear(&self) {
        drop(self.carry.lock().unwrap_or_else(|p| p.into_inner()).take());
    }

    /// What the inputs moved since the last call.
    pub(super) fn take_traffic(&self) -> DeviceTraffic {
        std::mem::take(&mut *self.traffic.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The crossing of one unit's call on `link`.
    pub(super) fn crossing<'a, L: DeviceLink<Buf = B>>(
        &'a self,
        link: &'a L,
    ) -> LinkCrossing<'a, L> {
        LinkCrossing { link, inputs: self }
    }

    /// `unit`'s forward on `link` with its params `bufs` (their host
    /// copies `params`), as a span of the compute queue.
    pub(super) fn forward<L: DeviceLink<Buf = B>>(
        &self,
        link: &L,
        model: &Model,
        unit: UnitId,
        (params, bufs): (&[Tensor], &[B]),
        input: UnitInput<'_>,
    ) -> Result<UnitOutput, ModelError> {
        let e = link.exec();
        let feed = self.crossing(link);
        link.timed(
            || format!("forward unit {}", unit.0),
            || exec_units::forward_with(&e, &feed, model, unit, params, bufs, input),
        )
    }

    /// `unit`'s backward on `link`, its param gradients left on the
    /// device, as a span of the compute queue.
    pub(super) fn backward<L: DeviceLink<Buf = B>>(
        &self,
        link: &L,
        model: &Model,
        unit: UnitId,
        (params, bufs): (&[Tensor], &[B]),
        input: UnitInput<'_>,
        upstream: Upstream<'_>,
    ) -> Result<BackwardOut<B>, ModelError> {
        let e = link.exec();
        let feed = self.crossing(link);
        link.timed(
            || format!("backward unit {}", unit.0),
            || exec_units::backward_on(&e, &feed, model, unit, params, bufs, input, upstream),
        )
    }

    fn count(&self, f: impl FnOnce(&mut DeviceTraffic)) {
        f(&mut self.traffic.lock().unwrap_or_else(|p| p.into_inner()));
    }
}

/// A unit's [`Crossing`] through a link: inputs uploaded as a param is
/// (a pinned staging buffer, the copy queue, the compute ordered after
/// it), or the output the last unit left on the device.
pub(super) struct LinkCrossing<'a, L: DeviceLink> {
    link: &'a L,
    inputs: &'a Inputs<L::Buf>,
}

impl<L: DeviceLink> LinkCrossing<'_, L> {
    /// A unit's input on the device through the link, counted; it is one
    /// of the unit's temporaries.
    pub(super) fn upload(&self, what: &str, t: &Tensor) -> Result<L::Buf, ModelError> {
        let t0 = Instant::now();
        let (u, up_bytes) =
            exec_units::with_host_elems(t, |v| Ok((self.link.upload_input(what, v)?, v.bytes())))?;
        let b = self.link.finish(u);
        self.inputs.count(|c| {
            c.h2d_bytes += up_bytes;
            c.h2d_wait_s += t0.elapsed().as_secs_f64();
        });
        b
    }
}

impl<L: DeviceLink> Crossing<L::Buf> for LinkCrossing<'_, L> {
    fn feed(&self, what: &str, t: &Tensor) -> Result<L::Buf, ModelError> {
        let kept = {
            let mut c = self.inputs.carry.lock().unwrap_or_else(|p| p.into_inner());
            match c.take() {
                Some((id, b)) if id == t.id() => Some(b),
                other => {
                    *c = other;
                    None
                }
            }
        };
        match kept {
            Some(b) => {
                self.inputs
                    .count(|c| c.h2d_kept_bytes += numel_of(t) * ELEM_BYTES);
                Ok(b)
            }
            None => self.upload(what, t),
        }
    }

    fn keep(&self, host: &Tensor, dev: L::Buf) {
        // Only fp32: a bf16 host copy is rounded, the device's is not.
        if host.dtype() == DType::F32 {
            *self.inputs.carry.lock().unwrap_or_else(|p| p.into_inner()) = Some((host.id(), dev));
        }
    }
}

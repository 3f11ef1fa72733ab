//! A unit's inputs through a [`DeviceLink`]: the [`Crossing`] both device
//! computes ([`super::TieredUnits`], [`super::ResidentUnits`]) give their
//! units (see "A unit's inputs" in the module docs of [`super`]), and the
//! blocks' forwards kept on the device for their backward ("Kept
//! forwards" there).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use candle_core::{DType, Tensor, TensorId};

use super::{DeviceLink, ELEM_BYTES};
use crate::config::ActivationBudget;
use crate::engine::sizing;
use crate::model::exec_units::{
    self, BackwardDev, BackwardOut, Crossing, DeviceTraffic, ForwardOut, KeptForward,
};
use crate::model::{Model, ModelError, UnitId, UnitInput, UnitOutput, Upstream};
use tierzero_gpu::unit::RopeTables;

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
    /// The blocks' forwards kept for their backward.
    forwards: Mutex<Forwards<B>>,
    /// The rotary tables of the last sequence length, kept on the device
    /// from one unit's call to the next and across steps (they depend on
    /// the model and the length alone).
    rope: Mutex<Option<(usize, RopeTables<B>)>>,
}

/// The blocks' forwards kept on the device from their forward to their
/// backward, within a byte budget.
struct Forwards<B> {
    /// Where the budget came from (None: nothing asked to keep them).
    source: Option<ActivationBudget>,
    /// Whether the device said what it has left for activations (else
    /// they are in host memory: the simulated device).
    room_known: bool,
    /// Bytes they may hold together (0: every block recomputed).
    budget_bytes: u64,
    /// Bytes they hold now.
    held_bytes: u64,
    /// The most they held at once.
    peak_bytes: u64,
    /// Per unit: the id of the host input it was computed on, the
    /// forward, its bytes.
    kept: HashMap<UnitId, (TensorId, KeptForward<B>, u64)>,
}

impl<B> Forwards<B> {
    fn drop_all(&mut self) {
        self.kept.clear();
        self.held_bytes = 0;
    }
}

impl<B> Inputs<B> {
    /// Inputs keeping no forward: every block recomputed in backward.
    pub(super) fn new() -> Self {
        Inputs {
            carry: Mutex::new(None),
            traffic: Mutex::new(DeviceTraffic::default()),
            forwards: Mutex::new(Forwards {
                source: None,
                room_known: false,
                budget_bytes: 0,
                held_bytes: 0,
                peak_bytes: 0,
                kept: HashMap::new(),
            }),
            rope: Mutex::new(None),
        }
    }

    /// Keeps blocks' forwards within `budget` (resolved by
    /// [`sizing::device_forward_budget_bytes`] against `room_bytes`, what
    /// the device has left for activations and temporaries; None: host
    /// memory). Drops any kept now.
    pub(super) fn keep_forwards(
        &self,
        budget: ActivationBudget,
        room_bytes: Option<u64>,
    ) -> Result<(), ModelError> {
        let bytes =
            sizing::device_forward_budget_bytes(budget, room_bytes, sizing::mem_available_bytes())
                .map_err(|what| ModelError::Gpu { what })?;
        let mut f = self.lock_forwards();
        f.drop_all();
        f.source = Some(budget);
        f.room_known = room_bytes.is_some();
        f.budget_bytes = bytes;
        Ok(())
    }

    /// Device bytes the kept forwards may hold together.
    pub(super) fn forward_budget_bytes(&self) -> u64 {
        self.lock_forwards().budget_bytes
    }

    /// The plan's activations line.
    pub(super) fn forwards_line(&self) -> String {
        let f = self.lock_forwards();
        let why = match f.source {
            None => "the device units were not given an activation budget".to_owned(),
            Some(ActivationBudget::Auto) if f.room_known => {
                "tierzero.activation_budget_bytes auto: half the device's room for activations"
                    .to_owned()
            }
            Some(ActivationBudget::Auto) => "tierzero.activation_budget_bytes auto: half the \
                host memory available, where this device computes"
                .to_owned(),
            Some(ActivationBudget::Bytes(b)) => format!("tierzero.activation_budget_bytes {b}"),
            Some(ActivationBudget::Checkpointing) => {
                "activation checkpointing on: every block recomputed".to_owned()
            }
        };
        if f.budget_bytes == 0 {
            format!(
                "activations: every block recomputed in backward from its input on the device \
                 ({why})"
            )
        } else {
            format!(
                "activations: each block's forward kept on the device for its backward while \
                 the kept ones fit {} ({why}); the rest recomputed from their input",
                crate::units::format_bytes(f.budget_bytes)
            )
        }
    }

    /// The most device bytes the kept forwards held at once.
    pub(super) fn forward_peak_bytes(&self) -> u64 {
        self.lock_forwards().peak_bytes
    }

    fn lock_forwards(&self) -> std::sync::MutexGuard<'_, Forwards<B>> {
        self.forwards.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Drops the kept output and every kept forward (a new step, or the
    /// compute dropped).
    pub(super) fn clear(&self) {
        drop(self.carry.lock().unwrap_or_else(|p| p.into_inner()).take());
        self.lock_forwards().drop_all();
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
    /// copies `params`), as a span of the compute queue, up to its output
    /// on the device: the unit's compute is queued, its hidden output not
    /// downloaded ([`Inputs::to_host`]).
    pub(super) fn forward_on<L: DeviceLink<Buf = B>>(
        &self,
        link: &L,
        model: &Model,
        unit: UnitId,
        (params, bufs): (&[Tensor], &[B]),
        input: UnitInput<'_>,
    ) -> Result<ForwardOut<B>, ModelError> {
        let e = link.exec();
        let feed = self.crossing(link);
        link.timed(
            || format!("forward unit {}", unit.0),
            || exec_units::forward_on(&e, &feed, model, unit, params, bufs, input),
        )
    }

    /// A forward's output on the host ([`ForwardOut::into_host`]): a hidden
    /// state downloaded, its device buffer kept for the next unit.
    pub(super) fn to_host<L: DeviceLink<Buf = B>>(
        &self,
        link: &L,
        out: ForwardOut<B>,
    ) -> Result<UnitOutput, ModelError> {
        link.wait_compute();
        out.into_host(&link.exec(), &self.crossing(link))
    }

    /// `unit`'s backward on `link`, as a span of the compute queue, up to
    /// its results on the device: its compute is queued, nothing
    /// downloaded ([`Inputs::backward_out`]).
    pub(super) fn backward_dev<L: DeviceLink<Buf = B>>(
        &self,
        link: &L,
        model: &Model,
        unit: UnitId,
        (params, bufs): (&[Tensor], &[B]),
        input: UnitInput<'_>,
        upstream: Upstream<'_>,
    ) -> Result<BackwardDev<B>, ModelError> {
        let e = link.exec();
        let feed = self.crossing(link);
        link.timed(
            || format!("backward unit {}", unit.0),
            || exec_units::backward_dev(&e, &feed, model, unit, params, bufs, input, upstream),
        )
    }

    /// A backward's input gradient on the host, once its compute is done
    /// ([`BackwardDev::into_out`]); its param gradients left on the
    /// device.
    pub(super) fn backward_out<L: DeviceLink<Buf = B>>(
        &self,
        link: &L,
        out: BackwardDev<B>,
    ) -> Result<BackwardOut<B>, ModelError> {
        link.wait_compute();
        out.into_out(&link.exec(), &self.crossing(link))
    }

    /// Adds to what the inputs moved.
    pub(super) fn count(&self, f: impl FnOnce(&mut DeviceTraffic)) {
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

    fn keeps_forwards(&self) -> bool {
        self.inputs.lock_forwards().budget_bytes > 0
    }

    fn keep_forward(&self, unit: UnitId, input: &Tensor, fwd: KeptForward<L::Buf>, bytes: u64) {
        let mut f = self.inputs.lock_forwards();
        // A forward of this unit not taken (a forward with no backward)
        // is replaced.
        if let Some((_, old, old_bytes)) = f.kept.remove(&unit) {
            drop(old);
            f.held_bytes -= old_bytes;
        }
        if f.held_bytes.saturating_add(bytes) <= f.budget_bytes {
            f.held_bytes += bytes;
            f.peak_bytes = f.peak_bytes.max(f.held_bytes);
            f.kept.insert(unit, (input.id(), fwd, bytes));
        }
    }

    fn take_rope(&self, seq: usize) -> Option<RopeTables<L::Buf>> {
        let mut r = self.inputs.rope.lock().unwrap_or_else(|p| p.into_inner());
        match r.take() {
            Some((len, tables)) if len == seq => Some(tables),
            other => {
                *r = other;
                None
            }
        }
    }

    fn put_rope(&self, seq: usize, tables: RopeTables<L::Buf>) {
        *self.inputs.rope.lock().unwrap_or_else(|p| p.into_inner()) = Some((seq, tables));
    }

    fn take_forward(&self, unit: UnitId, input: &Tensor) -> Option<KeptForward<L::Buf>> {
        let found = {
            let mut f = self.inputs.lock_forwards();
            match f.kept.remove(&unit) {
                Some((id, fwd, bytes)) => {
                    f.held_bytes -= bytes;
                    // Computed on another input: not this backward's.
                    (id == input.id()).then_some(fwd)
                }
                None => None,
            }
        };
        self.inputs.count(|c| match found {
            Some(_) => c.forwards_kept += 1,
            None => c.forwards_recomputed += 1,
        });
        found
    }
}

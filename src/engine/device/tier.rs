//! [`TieredUnits`]: the device tier's state map and its rules (see the
//! module docs of [`super`]).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::{DType, Tensor};

use super::ahead::{Aheads, Holder};
use super::fill::{Fill, Filler, Queued};
use super::grads_out::GradsOut;
use super::inputs::{numel_of, output_numel, Inputs};
use super::{DeviceLink, ELEM_BYTES};

mod gather;
mod memory;
use crate::model::exec_units::{
    self, DeviceMemoryPlan, DeviceMemoryRow, DeviceSpan, DeviceTraffic, HomePins, HostElems,
    UnitCompute,
};
use crate::model::{
    Model, ModelError, ParamId, UnitGrads, UnitId, UnitInput, UnitOutput, Upstream,
};

/// The tier's bounds (elements, except the cache).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierLimits {
    /// `stage3_prefetch_bucket_size`: elements uploading ahead of use.
    pub prefetch_numel: u64,
    /// `stage3_max_live_parameters`: elements uploading or in use.
    pub max_live_numel: u64,
    /// `tierzero.device_cache_bytes`: bytes kept between uses
    /// ([`TierLimits::CACHE_AUTO`]: as many as the budget holds).
    pub cache_bytes: u64,
}

impl TierLimits {
    /// `cache_bytes` of `tierzero.device_cache_bytes: "auto"`: params stay
    /// after their unit as long as the link's budget for the tier's params
    /// holds them, and a kept one is let go when an upload needs its room
    /// (see "The device cache" in [`super`]).
    pub const CACHE_AUTO: u64 = u64::MAX;
}

/// A param on the device.
#[derive(Debug)]
pub enum Residency<U, B> {
    /// Its upload is in flight, issued ahead of its unit.
    Uploading {
        /// The upload.
        upload: U,
        /// Its size.
        size: ParamSize,
    },
    /// Its upload is in flight, issued for its unit, which computes next
    /// (outside the prefetch window).
    Loading {
        /// The upload.
        upload: U,
        /// Its size.
        size: ParamSize,
    },
    /// Its unit is computing on it.
    InUse {
        /// Its size.
        size: ParamSize,
    },
    /// Kept on the device between uses (the device cache).
    Resident {
        /// The buffer.
        buf: B,
        /// Its size.
        size: ParamSize,
    },
}

/// A param's size on the device: its elements (what DeepSpeed's windows
/// count) and its bytes there (what the budget counts:
/// [`super::param_device_bytes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamSize {
    /// Elements.
    pub numel: u64,
    /// Device bytes.
    pub bytes: u64,
}

impl ParamSize {
    /// The size of `host`, a param's host tensor, on the device.
    fn of(host: &Tensor) -> Self {
        let numel = numel_of(host);
        ParamSize {
            numel,
            bytes: super::param_device_bytes(numel, host.dtype()),
        }
    }
}

impl<U, B> Residency<U, B> {
    fn size(&self) -> ParamSize {
        match self {
            Residency::Uploading { size, .. }
            | Residency::Loading { size, .. }
            | Residency::InUse { size }
            | Residency::Resident { size, .. } => *size,
        }
    }
    fn numel(&self) -> u64 {
        self.size().numel
    }
    fn bytes(&self) -> u64 {
        self.size().bytes
    }
    fn name(&self) -> &'static str {
        match self {
            Residency::Uploading { .. } => "uploading",
            Residency::Loading { .. } => "loading",
            Residency::InUse { .. } => "in use",
            Residency::Resident { .. } => "resident",
        }
    }
}

/// What happens to a param on the device (the table in [`super`]).
#[derive(Debug)]
pub enum TierEvent<U, B> {
    /// Its upload was issued ahead of its unit.
    Staged(U, ParamSize),
    /// Its upload was issued for its unit, which computes next.
    Loading(U, ParamSize),
    /// Its unit computes next: an upload issued ahead is no longer ahead
    /// of use.
    Due,
    /// It was uploaded when its unit ran.
    Loaded(ParamSize),
    /// Its unit takes it (an upload is waited for).
    Taken,
    /// Its unit is done with it; `Some` keeps the buffer.
    Returned(Option<B>),
    /// Dropped (a new step, or the tier dropped).
    Dropped,
    /// Its upload failed while its unit took it, or the tier was dropped
    /// while a unit held it: forgotten, its buffer the failure's.
    Failed,
}

impl<U, B> TierEvent<U, B> {
    fn name(&self) -> &'static str {
        match self {
            TierEvent::Staged(..) => "staged",
            TierEvent::Loading(..) => "loading",
            TierEvent::Due => "due",
            TierEvent::Loaded(_) => "loaded",
            TierEvent::Taken => "taken",
            TierEvent::Returned(_) => "returned",
            TierEvent::Dropped => "dropped",
            TierEvent::Failed => "failed",
        }
    }
}

/// The highest the tier went, since it was built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierPeaks {
    /// Device bytes of all states together.
    pub device_bytes: u64,
    /// Elements uploading ahead of use.
    pub ahead_numel: u64,
    /// Elements uploading or in use.
    pub live_numel: u64,
    /// Bytes kept between uses.
    pub cached_bytes: u64,
    /// Elements uploading or in use right after an upload was staged
    /// (what `stage3_max_live_parameters` bounds; a unit's own params
    /// are uploaded when it runs even past it).
    pub live_numel_at_stage: u64,
}

/// The state map and the counters.
#[derive(Debug)]
struct State<U, B> {
    params: BTreeMap<ParamId, Residency<U, B>>,
    /// The params of the unit loaded last ([`UnitCompute::load`]), which
    /// computes next: kept ones are not let go to stage another unit.
    due: Vec<ParamId>,
    traffic: DeviceTraffic,
    peaks: TierPeaks,
}

impl<U, B> State<U, B> {
    fn device_bytes(&self) -> u64 {
        self.params.values().map(Residency::bytes).sum()
    }
    fn ahead_numel(&self) -> u64 {
        self.params
            .values()
            .filter(|r| matches!(r, Residency::Uploading { .. }))
            .map(Residency::numel)
            .sum()
    }
    fn live_numel(&self) -> u64 {
        self.params
            .values()
            .filter(|r| !matches!(r, Residency::Resident { .. }))
            .map(Residency::numel)
            .sum()
    }
    fn cached_bytes(&self) -> u64 {
        self.params
            .values()
            .filter(|r| matches!(r, Residency::Resident { .. }))
            .map(Residency::bytes)
            .sum()
    }

    /// The one place a param's state changes. Returns what leaves the map
    /// (an upload to wait for, a buffer to compute on or to free).
    fn apply(&mut self, id: ParamId, event: TierEvent<U, B>) -> Result<Left<U, B>, ModelError> {
        let now = self.params.remove(&id);
        let bad = |now: &Option<Residency<U, B>>, ev: &TierEvent<U, B>| ModelError::Gpu {
            what: format!(
                "device tier: param {} is {} and cannot be {} (an engine bug)",
                id.0,
                now.as_ref().map_or("absent", Residency::name),
                ev.name()
            ),
        };
        let (next, left) = match (now, event) {
            (None, TierEvent::Staged(upload, size)) => {
                (Some(Residency::Uploading { upload, size }), Left::Nothing)
            }
            (None, TierEvent::Loading(upload, size)) => {
                (Some(Residency::Loading { upload, size }), Left::Nothing)
            }
            (Some(Residency::Uploading { upload, size }), TierEvent::Due) => {
                (Some(Residency::Loading { upload, size }), Left::Nothing)
            }
            (None, TierEvent::Loaded(size)) => (Some(Residency::InUse { size }), Left::Nothing),
            (
                Some(Residency::Uploading { upload, size } | Residency::Loading { upload, size }),
                TierEvent::Taken,
            ) => (Some(Residency::InUse { size }), Left::Upload(upload)),
            (Some(Residency::Resident { buf, size }), TierEvent::Taken) => {
                (Some(Residency::InUse { size }), Left::Buf(buf))
            }
            (Some(Residency::InUse { size }), TierEvent::Returned(Some(buf))) => {
                (Some(Residency::Resident { buf, size }), Left::Nothing)
            }
            (Some(Residency::InUse { .. }), TierEvent::Returned(None)) => (None, Left::Nothing),
            (
                Some(Residency::Uploading { upload, .. } | Residency::Loading { upload, .. }),
                TierEvent::Dropped,
            ) => (None, Left::Upload(upload)),
            (Some(Residency::Resident { buf, .. }), TierEvent::Dropped) => (None, Left::Buf(buf)),
            (Some(Residency::InUse { .. }), TierEvent::Failed) => (None, Left::Nothing),
            (now, ev) => {
                let err = bad(&now, &ev);
                if let Some(r) = now {
                    self.params.insert(id, r);
                }
                return Err(err);
            }
        };
        if let Some(r) = next {
            self.params.insert(id, r);
        }
        let now = TierPeaks {
            device_bytes: self.device_bytes(),
            ahead_numel: self.ahead_numel(),
            live_numel: self.live_numel(),
            cached_bytes: self.cached_bytes(),
            live_numel_at_stage: 0,
        };
        let p = &mut self.peaks;
        p.device_bytes = p.device_bytes.max(now.device_bytes);
        p.ahead_numel = p.ahead_numel.max(now.ahead_numel);
        p.live_numel = p.live_numel.max(now.live_numel);
        p.cached_bytes = p.cached_bytes.max(now.cached_bytes);
        Ok(left)
    }
}

/// What [`State::apply`] hands back.
enum Left<U, B> {
    Nothing,
    Upload(U),
    Buf(B),
}

/// The units computed on a [`DeviceLink`], their params staged ahead and
/// kept while they fit (see the module docs of [`super`]).
pub struct TieredUnits<L: DeviceLink> {
    link: Arc<L>,
    limits: TierLimits,
    state: Mutex<State<Queued<L::Upload>, L::Buf>>,
    /// Units' param gradients on their way to the host, or kept on the
    /// device for their reduce-scatter there, oldest first.
    grads_out: GradsOut<L>,
    /// A unit's inputs, and the output it left on the device.
    inputs: Inputs<L::Buf>,
    /// The unit staged last, and the forward launched ahead.
    aheads: Aheads<L::Buf>,
    /// The run's param storage dtype, for the plan's bound.
    storage: DType,
    /// Issues the params' uploads off the engine's thread (last: dropped
    /// after the state, it waits for the uploads it still issues).
    fill: Filler<L>,
}

impl<L: DeviceLink> std::fmt::Debug for TieredUnits<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TieredUnits")
            .field("link", &self.link)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl<L: DeviceLink + 'static> TieredUnits<L> {
    /// The tier on `link`, with its upload thread (`fill.rs`).
    pub fn new(link: L, limits: TierLimits) -> Result<Self, ModelError> {
        let link = Arc::new(link);
        Ok(TieredUnits {
            fill: Filler::new(link.clone())?,
            link,
            limits,
            state: Mutex::new(State {
                params: BTreeMap::new(),
                due: Vec::new(),
                traffic: DeviceTraffic::default(),
                peaks: TierPeaks::default(),
            }),
            grads_out: GradsOut::new(),
            inputs: Inputs::new(),
            aheads: Aheads::new(),
            storage: DType::F32,
        })
    }
}

impl<L: DeviceLink> TieredUnits<L> {
    /// Keeps each block's forward on the device for its backward while
    /// the kept ones fit `budget` (`tierzero.activation_budget_bytes`;
    /// see "Kept forwards" in [`super`]), within the device's share for
    /// activations and temporaries. Without it every block is recomputed.
    pub fn keep_forwards(
        self,
        budget: crate::config::ActivationBudget,
    ) -> Result<Self, ModelError> {
        let room = self.link.memory().temporaries_bytes;
        self.inputs.keep_forwards(budget, room)?;
        Ok(self)
    }

    /// The dtype the run stores its params in (fp32 until told), for the
    /// plan's bound ([`TieredUnits::params_bound_bytes`]); what the tier
    /// holds is counted from each param's own host dtype as it crosses.
    pub fn params_stored_as(mut self, storage: DType) -> Self {
        self.storage = storage;
        self
    }

    /// Whether a unit is launched ahead as the one before it in its pass
    /// comes down (see "Units launched ahead" in [`super`]): on by
    /// default; off only to measure what it gains.
    pub fn launch_ahead(mut self, on: bool) -> Self {
        self.aheads.set_enabled(on);
        self
    }

    /// The most device bytes the kept forwards held at once.
    pub fn forward_peak_bytes(&self) -> u64 {
        self.inputs.forward_peak_bytes()
    }

    /// Waits for every gradient download still in flight and drops them
    /// (a new step, or the tier dropped): the first error, if any.
    fn drain_downloads(&self) -> Result<(), ModelError> {
        self.grads_out.drain(&self.link)
    }

    /// The link.
    pub fn link(&self) -> &L {
        &self.link
    }

    /// The bounds.
    pub fn limits(&self) -> TierLimits {
        self.limits
    }

    /// The unit whose host params the tier holds to launch it ahead: the
    /// one the engine staged last, until its backward has run (then the
    /// store's release of those params frees them).
    pub fn staged_unit(&self) -> Option<UnitId> {
        self.aheads.staged_unit()
    }

    /// The highest the tier went.
    pub fn peaks(&self) -> TierPeaks {
        self.lock().peaks
    }

    /// Params on the device now, by state name.
    pub fn census(&self) -> BTreeMap<&'static str, usize> {
        let mut out = BTreeMap::new();
        for r in self.lock().params.values() {
            *out.entry(r.name()).or_insert(0) += 1;
        }
        out
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<Queued<L::Upload>, L::Buf>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Empties the map: uploads completed, then every buffer freed.
    fn drop_all(&self, st: &mut State<Queued<L::Upload>, L::Buf>) -> Result<(), ModelError> {
        let ids: Vec<ParamId> = st.params.keys().copied().collect();
        let mut first_err = None;
        for id in ids {
            if matches!(st.params.get(&id), Some(Residency::InUse { .. })) {
                first_err.get_or_insert(ModelError::Gpu {
                    what: format!("device tier: param {} is still in use", id.0),
                });
                st.apply(id, TierEvent::Failed)?;
                continue;
            }
            match st.apply(id, TierEvent::Dropped)? {
                Left::Upload(u) => match u.wait().and_then(|u| self.link.finish(u)) {
                    Ok(b) => self.link.free(b),
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                },
                Left::Buf(b) => self.link.free(b),
                Left::Nothing => {}
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Frees kept params until `bytes` more fit in the budget, except
    /// those in `spare` (the unit the room is for, and with a stage the
    /// unit loaded to compute next). Nothing is freed unless enough can
    /// be: a kept param let go for a room that does not come would only
    /// cross again. The one whose last unit comes first goes first (ties
    /// by `ParamId`): in forward the first blocks', which backward needs
    /// last, while a tied table, which the head needs next, stays.
    fn make_room(
        &self,
        st: &mut State<Queued<L::Upload>, L::Buf>,
        model: &Model,
        bytes: u64,
        spare: &[&[ParamId]],
    ) -> Result<(), ModelError> {
        let budget = self.link.budget_bytes();
        let held = st.device_bytes();
        if held.saturating_add(bytes) <= budget {
            return Ok(());
        }
        let last_unit = |id: ParamId| {
            model
                .params()
                .get(id.0)
                .and_then(|p| p.units.iter().max().copied())
                .unwrap_or(UnitId(0))
        };
        let mut victims: Vec<(UnitId, ParamId, u64)> = st
            .params
            .iter()
            .filter(|(id, r)| {
                matches!(r, Residency::Resident { .. }) && !spare.iter().any(|s| s.contains(id))
            })
            .map(|(id, r)| (last_unit(*id), *id, r.bytes()))
            .collect();
        let freeable: u64 = victims.iter().map(|v| v.2).sum();
        if held - freeable.min(held) + bytes > budget {
            return Ok(());
        }
        victims.sort_unstable();
        for (_, id, _) in victims {
            if st.device_bytes() + bytes <= budget {
                break;
            }
            if let Left::Buf(b) = st.apply(id, TierEvent::Dropped)? {
                self.link.free(b);
            }
        }
        Ok(())
    }

    /// The unit's params on the device, in declared order: kept ones,
    /// staged ones (their uploads waited for) and the rest uploaded now.
    fn take(
        &self,
        model: &Model,
        unit: UnitId,
        params: &[Tensor],
    ) -> Result<(Vec<ParamId>, Vec<L::Buf>), ModelError> {
        let ids = model.unit(unit)?.params.clone();
        if ids.len() != params.len() {
            return Err(ModelError::ParamCount {
                unit,
                expected: ids.len(),
                found: params.len(),
            });
        }
        let mut st = self.lock();
        let mut bufs = Vec::with_capacity(ids.len());
        for (k, (&id, host)) in ids.iter().zip(params).enumerate() {
            match self.take_one(&mut st, model, (unit, &ids), id, host) {
                Ok(b) => bufs.push(b),
                Err(e) => {
                    // Give back what was taken: nothing is left in use.
                    for (&id, b) in ids[..k].iter().zip(bufs) {
                        let _ = st.apply(id, TierEvent::Returned(None));
                        self.link.free(b);
                    }
                    return Err(e);
                }
            }
        }
        Ok((ids, bufs))
    }

    /// `unit`'s param `id` (`ids`: all of the unit's) on the device.
    fn take_one(
        &self,
        st: &mut State<Queued<L::Upload>, L::Buf>,
        model: &Model,
        unit: (UnitId, &[ParamId]),
        id: ParamId,
        host: &Tensor,
    ) -> Result<L::Buf, ModelError> {
        if st.params.contains_key(&id) {
            return match st.apply(id, TierEvent::Taken)? {
                Left::Upload(u) => {
                    let t = Instant::now();
                    // The fill if the upload thread is still at it, then
                    // the copy's event (on a GPU the host does not wait).
                    let b = u.wait().and_then(|u| self.link.finish(u));
                    st.traffic.h2d_wait_s += t.elapsed().as_secs_f64();
                    match b {
                        Ok(b) => Ok(b),
                        Err(e) => st.apply(id, TierEvent::Failed).and(Err(e)),
                    }
                }
                Left::Buf(b) => Ok(b),
                Left::Nothing => Err(ModelError::Gpu {
                    what: "device tier: a taken param left nothing".into(),
                }),
            };
        }
        let t = Instant::now();
        let (u, size) = self.upload_now(st, model, unit, id, host)?;
        st.apply(id, TierEvent::Loaded(size))?;
        let b = self.link.finish(u);
        st.traffic.h2d_wait_s += t.elapsed().as_secs_f64();
        match b {
            Ok(b) => Ok(b),
            Err(e) => st.apply(id, TierEvent::Failed).and(Err(e)),
        }
    }

    /// Issues the upload of `unit`'s param `id` (`unit`: the unit and
    /// all its params), absent from the device, for use now, on this
    /// thread ([`TieredUnits::admit`] first). Its size comes back with
    /// the upload.
    fn upload_now(
        &self,
        st: &mut State<Queued<L::Upload>, L::Buf>,
        model: &Model,
        unit: (UnitId, &[ParamId]),
        id: ParamId,
        host: &Tensor,
    ) -> Result<(L::Upload, ParamSize), ModelError> {
        let size = self.admit(st, model, unit, id, self.size_of(model, id, host)?)?;
        let u = if self.gathers() {
            self.gather_now(st, id, host, None, size)?
        } else {
            let (u, up_bytes) = exec_units::with_host_elems(host, |v| {
                Ok((self.link.upload(&format!("param {}", id.0), v)?, v.bytes()))
            })?;
            st.traffic.h2d_bytes += up_bytes;
            u
        };
        st.traffic.h2d_at_use_bytes += exec_units::host_elems_bytes(host);
        Ok((u, size))
    }

    /// Makes room for `unit`'s param `id` (`unit`: the unit and all its
    /// params), absent from the device, to be uploaded for use now: kept
    /// params are evicted (not the unit's own), and a param that still
    /// does not fit the budget is an error with the numbers. Its size.
    fn admit(
        &self,
        st: &mut State<Queued<L::Upload>, L::Buf>,
        model: &Model,
        (unit, spare): (UnitId, &[ParamId]),
        id: ParamId,
        size: ParamSize,
    ) -> Result<ParamSize, ModelError> {
        let bytes = size.bytes;
        self.make_room(st, model, bytes, &[spare])?;
        let budget = self.link.budget_bytes();
        let held = st.device_bytes();
        if held + bytes > budget {
            return Err(ModelError::Gpu {
                what: format!(
                    "device tier: unit {} needs {bytes} more bytes for param {} with {held} held \
                     (params in flight and in use) of a {budget} byte device budget; raise \
                     tierzero.device_budget_bytes or lower stage3_prefetch_bucket_size",
                    unit.0, id.0
                ),
            });
        }
        Ok(size)
    }

    /// The unit is done with its params: kept while the cache has room,
    /// freed otherwise.
    fn give_back(&self, ids: &[ParamId], bufs: Vec<L::Buf>) -> Result<(), ModelError> {
        let mut st = self.lock();
        let mut result = Ok(());
        for (&id, b) in ids.iter().zip(bufs) {
            // Kept only if in use (a param dropped meanwhile, after an
            // error, is not): any other buffer goes back to the link, not
            // dropped, which on a GPU would free it under its last use.
            let keep = match st.params.get(&id) {
                Some(r @ Residency::InUse { .. }) => {
                    st.cached_bytes().saturating_add(r.bytes()) <= self.limits.cache_bytes
                }
                _ => false,
            };
            if keep {
                if let Err(e) = st.apply(id, TierEvent::Returned(Some(b))) {
                    result = result.and(Err(e));
                }
            } else {
                self.link.free(b);
                if let Err(e) = st.apply(id, TierEvent::Returned(None)) {
                    result = result.and(Err(e));
                }
            }
        }
        result
    }
}

impl<L: DeviceLink> Holder<L> for TieredUnits<L> {
    fn link(&self) -> &L {
        &self.link
    }

    fn inputs(&self) -> &Inputs<L::Buf> {
        &self.inputs
    }

    fn take_params(
        &self,
        model: &Model,
        unit: UnitId,
        params: &[Tensor],
    ) -> Result<(Vec<ParamId>, Vec<L::Buf>), ModelError> {
        self.take(model, unit, params)
    }

    fn give_params(&self, ids: &[ParamId], bufs: Vec<L::Buf>) -> Result<(), ModelError> {
        self.give_back(ids, bufs)
    }

    /// Kept, or its upload issued by the upload thread: taking it waits
    /// for no fill (on a GPU, the compute stream waits for the copy).
    fn ready(&self, ids: &[ParamId]) -> bool {
        let mut st = self.lock();
        ids.iter().all(|id| match st.params.get_mut(id) {
            Some(Residency::Resident { .. }) => true,
            Some(Residency::Uploading { upload, .. } | Residency::Loading { upload, .. }) => {
                upload.is_issued()
            }
            _ => false,
        })
    }
}

impl<L: DeviceLink> UnitCompute for TieredUnits<L> {
    fn on_device(&self) -> bool {
        true
    }

    fn describe(&self) -> String {
        let kept = self.limits.kept_text(self.link.budget_bytes());
        format!(
            "{}; params staged a unit ahead (window {} elements, {} live), {kept}",
            self.link.describe(),
            self.limits.prefetch_numel,
            self.limits.max_live_numel,
        )
    }

    fn forward_unit(
        &self,
        model: &Model,
        unit: UnitId,
        params: &[Tensor],
        input: UnitInput<'_>,
    ) -> Result<UnitOutput, ModelError> {
        let out = self.aheads.forward(self, model, unit, params, input)?;
        self.lock().traffic.d2h_bytes += output_numel(&out) * ELEM_BYTES;
        Ok(out)
    }

    fn backward_unit(
        &self,
        model: &Model,
        unit: UnitId,
        params: &[Tensor],
        input: UnitInput<'_>,
        upstream: Upstream<'_>,
    ) -> Result<UnitGrads, ModelError> {
        let out = self
            .aheads
            .backward(self, model, unit, params, input, upstream)?;
        // The param gradients go out on the copy queue while the engine
        // starts the next unit (it collects them with `take_grads`), or
        // stay for their reduce-scatter on the device (`reduce_grads`).
        let down = out.input.as_ref().map_or(0, numel_of) * ELEM_BYTES
            + self
                .grads_out
                .put(&self.link, model, unit, out.grads, out.dtype)?;
        self.lock().traffic.d2h_bytes += down;
        // Its gradients are queued to come down: the unit before it may
        // compute now.
        if let Some(dx) = &out.input {
            self.aheads.launch_backward(self, model, unit, dx)?;
        }
        Ok(UnitGrads {
            params: Vec::new(),
            input: out.input,
            loss: out.loss,
        })
    }

    fn stages(&self) -> bool {
        true
    }

    fn gathers_params(&self) -> bool {
        self.gathers()
    }

    fn host_registrar(&self) -> Option<Arc<dyn tierzero_swap::HostRegistrar>> {
        self.link.host_registrar()
    }

    fn stage(
        &self,
        model: &Model,
        unit: UnitId,
        params: &[Tensor],
        pins: HomePins,
    ) -> Result<(), ModelError> {
        let ids = model.unit(unit)?.params.clone();
        let mut pins = pins.into_iter();
        self.aheads.staged(unit, params);
        let mut st = self.lock();
        let budget = self.link.budget_bytes();
        // Issued as one message to the upload thread, after the loop.
        let mut items = Vec::new();
        for (&id, host) in ids.iter().zip(params) {
            let pin = pins.next().flatten();
            if st.params.contains_key(&id) {
                continue;
            }
            let size = self.size_of(model, id, host)?;
            let numel = size.numel;
            let ahead = st.ahead_numel();
            let window = ahead == 0 || ahead + numel <= self.limits.prefetch_numel;
            let live = st.live_numel() + numel <= self.limits.max_live_numel;
            if window && live && st.device_bytes() + size.bytes > budget {
                // Kept params yield to the window: each is needed later
                // than this one if at all, and once let go costs at most
                // the upload it had saved (see "The device cache").
                let due = st.due.clone();
                self.make_room(&mut st, model, size.bytes, &[&ids, &due])?;
            }
            let fits = st.device_bytes() + size.bytes <= budget;
            if !(window && live && fits) {
                // The rest uploads when its unit runs.
                break;
            }
            if self.gathers() {
                let u = self.gather_now(&mut st, id, host, pin, size)?;
                st.apply(id, TierEvent::Staged(Queued::issued(u), size))?;
                st.peaks.live_numel_at_stage = st.peaks.live_numel_at_stage.max(st.live_numel());
                continue;
            }
            let (slot, q) = self.fill.slot();
            st.apply(id, TierEvent::Staged(q, size))?;
            st.peaks.live_numel_at_stage = st.peaks.live_numel_at_stage.max(st.live_numel());
            st.traffic.h2d_bytes += exec_units::host_elems_bytes(host);
            items.push(Fill {
                what: format!("param {}", id.0),
                host: host.clone(),
                pin,
                slot,
            });
        }
        self.fill.send(items)
    }

    fn load(
        &self,
        model: &Model,
        unit: UnitId,
        params: &[Tensor],
        pins: HomePins,
    ) -> Result<(), ModelError> {
        let ids = model.unit(unit)?.params.clone();
        let mut pins = pins.into_iter();
        let mut st = self.lock();
        st.due.clone_from(&ids);
        // On the upload thread, as one message, ahead of whatever is
        // staged after it.
        let mut items = Vec::new();
        let mut admitted = Ok(());
        for (&id, host) in ids.iter().zip(params) {
            let pin = pins.next().flatten();
            match st.params.get(&id) {
                // Staged ahead: no longer ahead of use.
                Some(Residency::Uploading { .. }) => {
                    st.apply(id, TierEvent::Due)?;
                    continue;
                }
                Some(_) => continue,
                None => {}
            }
            let size = match self
                .size_of(model, id, host)
                .and_then(|size| self.admit(&mut st, model, (unit, &ids), id, size))
            {
                Ok(n) => n,
                Err(e) => {
                    admitted = Err(e);
                    break;
                }
            };
            // Its bytes cross for the unit about to compute, not ahead.
            let up_bytes = exec_units::host_elems_bytes(host);
            if self.gathers() {
                match self.gather_now(&mut st, id, host, pin, size) {
                    Ok(u) => {
                        st.traffic.h2d_at_use_bytes += up_bytes;
                        st.apply(id, TierEvent::Loading(Queued::issued(u), size))?;
                    }
                    Err(e) => {
                        admitted = Err(e);
                        break;
                    }
                }
                continue;
            }
            let (slot, q) = self.fill.slot();
            st.apply(id, TierEvent::Loading(q, size))?;
            st.traffic.h2d_bytes += up_bytes;
            st.traffic.h2d_at_use_bytes += up_bytes;
            items.push(Fill {
                what: format!("param {}", id.0),
                host: host.clone(),
                pin,
                slot,
            });
        }
        // What was admitted before a refusal is issued all the same: its
        // state waits for it.
        self.fill.send(items)?;
        admitted
    }

    fn head_batch(&self, targets: &Tensor, loss_scale: f64) {
        self.aheads.head_batch(targets, loss_scale);
    }

    fn begin_step(&self) -> Result<(), ModelError> {
        let ahead = self.aheads.clear(self);
        self.inputs.clear();
        let drained = self.drain_downloads().and(ahead);
        let mut st = self.lock();
        st.due.clear();
        self.drop_all(&mut st).and(drained)
    }

    fn defers_grads(&self) -> bool {
        true
    }

    fn take_grads(&self, unit: UnitId) -> Result<Option<Vec<(ParamId, Tensor)>>, ModelError> {
        let t = Instant::now();
        let got = self.grads_out.take(&self.link, unit);
        self.lock().traffic.d2h_wait_s += t.elapsed().as_secs_f64();
        got
    }

    fn take_grads_with(
        &self,
        unit: UnitId,
        f: &mut dyn FnMut(ParamId, HostElems<'_>),
    ) -> Result<bool, ModelError> {
        // The wait is the time outside `f` (which reads the elements into
        // the sums: host work, not the link's).
        let t = Instant::now();
        let mut in_f = std::time::Duration::ZERO;
        let got = self.grads_out.take_with(&self.link, unit, &mut |id, e| {
            let t = Instant::now();
            f(id, e);
            in_f += t.elapsed();
        });
        self.lock().traffic.d2h_wait_s += t.elapsed().saturating_sub(in_f).as_secs_f64();
        got
    }

    fn grads_on_device(&self, unit: UnitId) -> Option<Vec<ParamId>> {
        self.grads_out.on_device(unit)
    }

    fn reduce_grads(
        &self,
        unit: UnitId,
        counts: &[Vec<usize>],
        acc: Option<&[f32]>,
        f: &mut dyn FnMut(&[f32]),
    ) -> Result<(), ModelError> {
        // The wait is the time outside `f` (host work, not the link's), as
        // in `take_grads_with`.
        let t = Instant::now();
        let mut in_f = std::time::Duration::ZERO;
        let got = self
            .grads_out
            .reduce(&self.link, unit, counts, acc, &mut |sums| {
                let t = Instant::now();
                f(sums);
                in_f += t.elapsed();
            });
        let mut st = self.lock();
        st.traffic.d2h_wait_s += t.elapsed().saturating_sub(in_f).as_secs_f64();
        let moved = got?;
        st.traffic.d2h_bytes += moved.d2h_bytes;
        st.traffic.h2d_bytes += moved.h2d_bytes;
        Ok(())
    }

    fn take_traffic(&self) -> Option<DeviceTraffic> {
        let mut t = std::mem::take(&mut self.lock().traffic);
        t.add(&self.inputs.take_traffic());
        t.h2d_direct_bytes += self.fill.take_direct_bytes();
        Some(t)
    }

    fn take_device_spans(&self) -> Vec<DeviceSpan> {
        let mut spans = self.link.take_spans();
        spans.extend(self.fill.take_spans());
        spans
    }

    fn activations_line(&self) -> Option<String> {
        Some(self.inputs.forwards_line())
    }

    fn memory_plan(&self, model: &Model) -> Option<DeviceMemoryPlan> {
        Some(self.device_memory_plan(model))
    }
}

impl<L: DeviceLink> Drop for TieredUnits<L> {
    fn drop(&mut self) {
        let _ = self.aheads.clear(&*self);
        self.inputs.clear();
        let _ = self.drain_downloads();
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        let mut st = std::mem::replace(
            st,
            State {
                params: BTreeMap::new(),
                due: Vec::new(),
                traffic: DeviceTraffic::default(),
                peaks: TierPeaks::default(),
            },
        );
        let _ = self.drop_all(&mut st);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use std::time::Duration;

    use tierzero_gpu::unit::GemmDtype;

    use super::*;
    use crate::engine::device::sim::{SimConfig, SimDevice};

    fn tier(
        fail_upload: Option<u64>,
    ) -> (TieredUnits<SimDevice>, crate::engine::device::sim::SimProbe) {
        let link = SimDevice::new(SimConfig {
            budget_bytes: 1 << 20,
            copy_delay: Duration::ZERO,
            h2d_bytes_per_s: None,
            staging_slots: 1,
            gemm: GemmDtype::F32,
            fail_upload,
            compute_delay: Duration::ZERO,
        })
        .unwrap();
        let probe = link.probe();
        let limits = TierLimits {
            prefetch_numel: 1 << 20,
            max_live_numel: 1 << 20,
            cache_bytes: TierLimits::CACHE_AUTO,
        };
        (TieredUnits::new(link, limits).unwrap(), probe)
    }

    /// A staged upload whose issue failed is not ready: nothing is
    /// launched ahead on it (it was, and the unit before it failed with
    /// the error); taking it, for its own unit, says the error.
    #[test]
    fn a_failed_staged_upload_is_not_ready() {
        let (tier, _probe) = tier(Some(1));
        let (id, ok) = (ParamId(0), ParamId(1));
        let size = ParamSize {
            numel: 8,
            bytes: 32,
        };
        let mut items = Vec::new();
        for p in [id, ok] {
            let (slot, q) = tier.fill.slot();
            tier.lock().apply(p, TierEvent::Staged(q, size)).unwrap();
            items.push(super::super::fill::Fill {
                what: format!("param {}", p.0),
                host: Tensor::zeros(8, DType::F32, &candle_core::Device::Cpu).unwrap(),
                pin: None,
                slot,
            });
        }
        tier.fill.send(items).unwrap();
        // The second is issued after the first failed: once it is ready,
        // the filler has answered both.
        let t = Instant::now();
        while !tier.ready(&[ok]) {
            assert!(t.elapsed().as_secs() < 10, "the filler never answered");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(!tier.ready(&[id]));
        assert!(!tier.ready(&[ok, id]));
        let mut st = tier.lock();
        type St = State<Queued<crate::engine::device::sim::SimUpload>, Vec<f32>>;
        let model_free_take = |st: &mut St, p| match st.apply(p, TierEvent::Taken) {
            Ok(Left::Upload(u)) => u.wait().and_then(|u| tier.link.finish(u)),
            _ => panic!("not staged"),
        };
        let e = model_free_take(&mut st, id).unwrap_err().to_string();
        assert!(e.contains("upload 1"), "{e}");
        let b = model_free_take(&mut st, ok).unwrap();
        tier.link.free(b);
        st.params.clear();
    }

    #[test]
    fn a_param_given_back_after_the_tier_dropped_it_is_freed_not_dropped() {
        let (tier, probe) = tier(None);
        let id = ParamId(0);
        let buf = tier.link.alloc_param("p", 16, DType::F32).unwrap();
        let size = ParamSize {
            numel: 16,
            bytes: 64,
        };
        let mut st = tier.lock();
        st.apply(id, TierEvent::Loaded(size)).unwrap();
        // A new step while it is in use (after an error): it leaves the map.
        let e = tier.drop_all(&mut st).unwrap_err().to_string();
        assert!(e.contains("still in use"), "{e}");
        drop(st);
        // Its unit gives it back: the buffer returns to the link.
        assert!(tier.give_back(&[id], vec![buf]).is_err());
        assert_eq!(probe.used_bytes(), 0);
        assert!(tier.census().is_empty());
    }
}

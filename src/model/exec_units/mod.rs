//! The units on `tierzero-gpu`'s executors: the same unit contract as
//! [`Model::forward_unit`] / [`Model::backward_unit`] (params, input and
//! gradients as host candle tensors, in the declared order), computed by
//! the CUDA kernels ([`CudaUnits`]) or by their scalar references on the
//! host ([`ReferenceUnits`]), instead of candle. The engine calls a
//! [`UnitCompute`] where it would call the model, so it does not learn
//! which device computes.
//!
//! # Data movement
//!
//! [`CudaUnits`] and [`ReferenceUnits`] upload a unit's params and input
//! at each call, compute, and return the output or the gradients on the
//! host. There the engine's tiers and the CPU optimizer keep them.
//! `crate::engine::device::TieredUnits` runs the same functions
//! (`forward_on`, `backward_dev`) on params that the device tier
//! staged ahead or kept on the device, and feeds them their inputs
//! through its link (`Feed`). It is what `--device cuda` uses.
//! Activations are recomputed in backward: no graphs are kept.
//!
//! # What it supports
//!
//! fp32, bf16 or fp16 params; GPT-2 with `gelu_new` (tanh), the Llama
//! family without a sliding window; GEMMs in fp32 or with bf16 or fp16
//! operands ([`GemmDtype`]).
//!
//! # bf16
//!
//! With bf16 params (`bf16.enabled`), a unit's params and hidden input
//! cross to the executor widened to fp32 (exactly), it computes with bf16
//! GEMM operands ([`GemmDtype::Bf16`]) and fp32 everywhere else, and its
//! hidden output and gradients come back rounded to bf16 once: the
//! storage rows of the precision policy (`super::precision`). Inside a
//! unit the two round in different places, so they are close, not
//! bit-identical: the CPU units round each linear output to bf16 and the
//! device's do not; the device's bf16 attention stores the scores
//! `q kᵀ`, the probabilities and the score gradients (dP, dS) in bf16
//! (its GEMMs' outputs, as transformers' eager attention gives them under
//! autocast), where the CPU units keep scores and dS in fp32 and round
//! only the probabilities (as the CPU flash-attention kernel under sdpa).
//!
//! # fp16
//!
//! fp16 params (`fp16.enabled`) take the same path with fp16 GEMM
//! operands ([`GemmDtype::F16`]): widened exactly on the way in, fp32
//! math, the hidden output and gradients rounded to fp16 once on the way
//! back. The head's gradient starts at the loss scale, as on the CPU, so
//! a gradient that overflows fp16 comes back `inf` from that rounding and
//! the engine skips the step and lowers the scale exactly as it does for
//! the candle units. The device tier moves fp16 up as it is (2 bytes an
//! element, as bf16; a param stays fp16 on the device, an input is
//! widened there), so its params cross in place from a page or a swap
//! buffer too; gradients are rounded to fp16 on the device and come down
//! as 2 bytes an element, the bits the host's rounding gives.
//!
//! [`supports`] says why a model is not supported, for the start-up check.

use candle_core::{DType, Device, Tensor};
use tierzero_gpu::unit::{self, Exec, GemmDtype, Gpt2Dims, HostExec, LlamaDims};

mod crossing;
mod host;
mod report;

pub use crossing::KeptForward;
use crossing::{with_rope, Direct};
pub(crate) use crossing::{Crossing, Feed};
use host::host_f32;
pub(crate) use host::{elem_bytes_crossing, host_elems_bytes, with_host_elems};
pub use host::{HostElems, HostVec};
pub use report::{
    busy_s, DeviceMemoryPlan, DeviceMemoryRow, DeviceQueue, DeviceSpan, DeviceTraffic,
};

use super::{
    Activation, Arch, Model, ModelConfig, ModelError, ParamId, UnitGrads, UnitId, UnitInput,
    UnitKind, UnitOutput, Upstream,
};

/// Read pins of a unit's params in pinned host memory (a cpu-tier page,
/// or the swap buffer an NVMe read landed in; declared order, `None`
/// where a param has none; empty: none at all), for uploads straight from
/// there ([`UnitCompute::stage`]).
pub type HomePins = Vec<Option<tierzero_swap::ReadPin>>;

/// Runs units: candle's (the model itself) or another executor's.
pub trait UnitCompute: Send + Sync + std::fmt::Debug {
    /// What computes, for the plan (e.g. "cuda:0 NVIDIA H200 (sm_90), fp32 GEMMs").
    fn describe(&self) -> String;
    /// [`Model::forward_unit`]'s contract.
    fn forward_unit(
        &self,
        model: &Model,
        unit: UnitId,
        params: &[Tensor],
        input: UnitInput<'_>,
    ) -> Result<UnitOutput, ModelError>;
    /// [`Model::backward_unit`]'s contract.
    fn backward_unit(
        &self,
        model: &Model,
        unit: UnitId,
        params: &[Tensor],
        input: UnitInput<'_>,
        upstream: Upstream<'_>,
    ) -> Result<UnitGrads, ModelError>;
    /// Whether it computes on a device (a GPU, or the simulated one),
    /// not on the host's cores: the trainer then makes no CPU compute
    /// pool and gives CPU Adam half the cores by default
    /// (`crate::engine::host::threads`).
    fn on_device(&self) -> bool {
        false
    }
    /// Whether the engine should hand it the next unit's params
    /// ([`UnitCompute::stage`]) before this unit computes.
    fn stages(&self) -> bool {
        false
    }
    /// Several ranks: whether it gathers the params where it computes (a
    /// device's collectives): the engine then hands it, in
    /// [`UnitCompute::stage`], [`UnitCompute::load`] and the calls, each
    /// param as this rank's shard (a 1-D tensor of its elements,
    /// `crate::engine::layout::shard_counts`'s cut) instead of the whole,
    /// and it gathers them in the order it is handed them (the same on
    /// every rank).
    fn gathers_params(&self) -> bool {
        false
    }
    /// Starts moving `unit`'s params (host copies, declared order) to
    /// where it computes, ahead of its call. The call then gets the same
    /// `params`. `pins` (declared order too, or empty) are the params'
    /// same bytes in pinned host memory (pages, kept swap buffers), where
    /// they are in some: a device whose registrar
    /// ([`UnitCompute::host_registrar`]) mapped that memory copies from it
    /// in place.
    fn stage(
        &self,
        _model: &Model,
        _unit: UnitId,
        _params: &[Tensor],
        _pins: HomePins,
    ) -> Result<(), ModelError> {
        Ok(())
    }
    /// `unit` computes next: starts every copy its params (host copies,
    /// declared order) still need, before the engine stages the unit
    /// after it ([`UnitCompute::stage`]), so that the copies of the unit
    /// that runs first are not queued behind those of the one that runs
    /// second. Outside the prefetch window: they are for use now. The
    /// call then gets the same `params`; `pins` as for
    /// [`UnitCompute::stage`].
    fn load(
        &self,
        _model: &Model,
        _unit: UnitId,
        _params: &[Tensor],
        _pins: HomePins,
    ) -> Result<(), ModelError> {
        Ok(())
    }
    /// What registers host memory with the device it computes on, so its
    /// copy engine reads that memory in place: the trainer maps the cpu
    /// tier's pinned pages and the param swap buffers with it, and hands
    /// their pins to
    /// [`UnitCompute::stage`] and [`UnitCompute::load`]. None: it copies
    /// from nothing in place (the host, or a device without it).
    fn host_registrar(&self) -> Option<std::sync::Arc<dyn tierzero_swap::HostRegistrar>> {
        None
    }
    /// A step begins: the optimizer may have changed every param since
    /// the last call, so nothing moved before may be reused.
    fn begin_step(&self) -> Result<(), ModelError> {
        Ok(())
    }
    /// A micro-batch's forward begins: its `targets` and the head's
    /// `loss_scale` (what its backward call will pass as
    /// [`crate::model::Upstream::LossScale`]), so that a compute that
    /// stages may launch the head as the last block's output comes down.
    fn head_batch(&self, _targets: &Tensor, _loss_scale: f64) {}
    /// What moved to and from the device since the last call (None: it
    /// does not count).
    fn take_traffic(&self) -> Option<DeviceTraffic> {
        None
    }
    /// Whether [`UnitCompute::backward_unit`] leaves the param gradients
    /// on their way to the host (a device's copy queue out), returning
    /// none: the engine then collects them with [`UnitCompute::take_grads`]
    /// after it has started the next unit's backward.
    fn defers_grads(&self) -> bool {
        false
    }
    /// The param gradients the last `backward_unit` of `unit` left in
    /// flight, in declared order, once their copies completed (None: it
    /// left none for `unit`).
    fn take_grads(&self, _unit: UnitId) -> Result<Option<Vec<(ParamId, Tensor)>>, ModelError> {
        Ok(None)
    }
    /// [`UnitCompute::take_grads`], handing `f` each gradient's elements
    /// (flat, in declared order) where the device's copy landed them, so
    /// the caller reads them into its sums with no host copy in between.
    /// Returns false when `unit` left none. By default, the elements of
    /// `take_grads`'s tensors.
    fn take_grads_with(
        &self,
        unit: UnitId,
        f: &mut dyn FnMut(ParamId, HostElems<'_>),
    ) -> Result<bool, ModelError> {
        let Some(grads) = self.take_grads(unit)? else {
            return Ok(false);
        };
        for (id, t) in &grads {
            with_host_elems(t, |e| {
                f(*id, e);
                Ok(())
            })?;
        }
        Ok(true)
    }
    /// Several ranks: the params whose gradients the last
    /// `backward_unit` of `unit` kept on the device, in declared order, to
    /// be reduce-scattered there ([`UnitCompute::reduce_grads`]). None: it
    /// kept none of `unit`'s ([`UnitCompute::take_grads`] gives them).
    fn grads_on_device(&self, _unit: UnitId) -> Option<Vec<ParamId>> {
        None
    }
    /// The gradients of `unit` kept on the device, reduce-scattered among
    /// the ranks there: every rank's chunk (`counts[p][r]` elements of
    /// param `p` for rank `r`, rank `r`'s chunks of every param in order)
    /// added onto `acc` (this rank's accumulated shards, concatenated in
    /// the same order; None: +0.0) in rank order, as
    /// [`crate::engine::comm::Comm::reduce_scatter_add_f32`] adds them:
    /// the same bits. Hands `f` those sums where they came down (the CUDA
    /// link's pinned staging buffer, read by `f` straight into the
    /// optimizer's sums: no host copy of them first), once. A collective:
    /// every rank calls it for the same units in the same order.
    fn reduce_grads(
        &self,
        unit: UnitId,
        _counts: &[Vec<usize>],
        _acc: Option<&[f32]>,
        _f: &mut dyn FnMut(&[f32]),
    ) -> Result<(), ModelError> {
        Err(ModelError::Gpu {
            what: format!("unit {}: no gradients kept on a device", unit.0),
        })
    }
    /// The device's spans that completed since the last call: its
    /// compute stream's units and its copies, for the timeline and the
    /// step's busy time. Empty when it keeps none.
    fn take_device_spans(&self) -> Vec<DeviceSpan> {
        Vec::new()
    }
    /// The device memory it holds, for the start-up plan (None: it
    /// computes in host memory).
    fn memory_plan(&self, _model: &Model) -> Option<DeviceMemoryPlan> {
        None
    }
    /// The optimizer on its device, when it keeps the params, their
    /// gradients and Adam's state there (None: the gradients go to the
    /// host's optimizer). Its `backward_unit` then returns no param
    /// gradients: they are summed on the device.
    fn device_optimizer(&self) -> Option<&dyn DeviceOptimizer> {
        None
    }
    /// The plan's activations line: which blocks' forwards it keeps for
    /// their backward (None: it keeps none, every block is recomputed).
    fn activations_line(&self) -> Option<String> {
        None
    }
}

/// Adam on the compute's device: with nothing offloaded, each param's
/// weights, gradient sum, master and moments stay in device memory and
/// the step runs there (`engine::device::ResidentUnits`). The host's
/// optimizer state is its copy for checkpoints and the final weights:
/// loaded into the device before the first step, and written back when
/// the engine settles. With several ranks (the device's own collectives
/// among them) its state is this rank's shard of each param (the
/// layout's), and [`DeviceOptimizer::load`] and [`DeviceOptimizer::step`]
/// are collectives: every rank calls them for the same params in the
/// same order (at stage 3 the weights are partitioned too, gathered in
/// each unit's call, which is then a collective as well).
pub trait DeviceOptimizer: Send + Sync {
    /// Whether every param's state has been loaded ([`DeviceOptimizer::load`]).
    fn is_loaded(&self) -> bool;
    /// Param `id`'s state from the host: `[master, m, v]`, fp32, its
    /// elements in order (with several ranks, this rank's shard's). The
    /// weights the units read are made from the master (in bf16 storage,
    /// rounded to bf16; with several ranks, gathered from the ranks'
    /// shards: at stages 0-2 every param's at once, by the last load, so
    /// the weights are unset until every param is loaded).
    fn load(&self, id: ParamId, state: [&[f32]; 3]) -> Result<(), ModelError>;
    /// Each sub-group's Σ g² over the step's gradients (with several
    /// ranks, this rank's shards of them; the caller adds the ranks'), in
    /// the host optimizer's order (`crate::optim::NORM_PART_NUMEL`, see
    /// `tierzero_gpu::norm`): the bits the host's norm of the same
    /// gradients gives, which the caller adds in sub-group order as the
    /// host's.
    fn grad_sq_sums(
        &self,
        groups: &[crate::engine::layout::SubGroup],
    ) -> Result<Vec<f64>, ModelError>;
    /// One AdamW step of every param with `s` (None: the step is
    /// skipped), in param order; the gradients are dropped either way.
    fn step(&self, s: Option<tierzero_gpu::reference::AdamScalars>) -> Result<(), ModelError>;
    /// Param `id`'s `[master, m, v]` on the host (with several ranks,
    /// this rank's shard's).
    fn state(&self, id: ParamId) -> Result<[Vec<f32>; 3], ModelError>;
}

/// Why `tierzero-gpu`'s units cannot run this model on sequences of
/// `seq_len` tokens (None: they can). A sliding attention window
/// (Mistral's) at least as long as the sequence never cuts a key off, so
/// it changes nothing and the units run it (Mistral-7B-v0.1's 4096 at a
/// `--seq-len` up to 4096); a shorter one they do not implement. With
/// `seq_len` 0, the window is not asked about.
pub fn supports(c: &ModelConfig, seq_len: usize) -> Option<String> {
    match c.arch {
        Arch::Gpt2 if c.activation != Activation::GeluTanh => Some(format!(
            "GPT-2 with activation {:?}: the CUDA units have gelu_new (tanh) only",
            c.activation
        )),
        Arch::Llama => c.sliding_window.filter(|&w| w < seq_len).map(|w| {
            format!(
                "a sliding attention window of {w} tokens shorter than the sequence \
                 ({seq_len}; Mistral): the CUDA units attend causally over the whole sequence \
                 (a sequence of at most {w} tokens leaves the window without effect)"
            )
        }),
        _ => None,
    }
}

/// An executor to run units on: [`UnitCompute`] follows for every one.
pub trait ExecSource: Send + Sync + std::fmt::Debug {
    /// The executor.
    type E<'a>: Exec
    where
        Self: 'a;
    /// The executor for one call.
    fn exec(&self) -> Self::E<'_>;
    /// What computes, for the plan.
    fn describe(&self) -> String;
    /// [`UnitCompute::on_device`].
    fn on_device(&self) -> bool;
}

impl<S: ExecSource> UnitCompute for S {
    fn describe(&self) -> String {
        ExecSource::describe(self)
    }
    fn on_device(&self) -> bool {
        ExecSource::on_device(self)
    }
    fn forward_unit(
        &self,
        model: &Model,
        unit: UnitId,
        params: &[Tensor],
        input: UnitInput<'_>,
    ) -> Result<UnitOutput, ModelError> {
        forward(&self.exec(), model, unit, params, input)
    }
    fn backward_unit(
        &self,
        model: &Model,
        unit: UnitId,
        params: &[Tensor],
        input: UnitInput<'_>,
        upstream: Upstream<'_>,
    ) -> Result<UnitGrads, ModelError> {
        backward(&self.exec(), model, unit, params, input, upstream)
    }
}

/// The units on the kernels' scalar references (host memory): the CUDA
/// units' arithmetic without a GPU.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReferenceUnits {
    /// The GEMMs' operand dtype.
    pub gemm: GemmDtype,
}

impl ExecSource for ReferenceUnits {
    type E<'a> = HostExec;
    fn exec(&self) -> HostExec {
        HostExec { gemm: self.gemm }
    }
    fn describe(&self) -> String {
        format!(
            "cpu (the CUDA kernels' scalar references), {:?} GEMMs",
            self.gemm
        )
    }
    fn on_device(&self) -> bool {
        false
    }
}

/// The units on a GPU: the CUDA kernels and cuBLAS.
#[derive(Debug, Clone)]
pub struct CudaUnits {
    /// The device.
    pub device: std::sync::Arc<tierzero_gpu::device::Device>,
    /// The GEMMs' operand dtype.
    pub gemm: GemmDtype,
}

impl ExecSource for CudaUnits {
    type E<'a> = unit::CudaExec<'a>;
    fn on_device(&self) -> bool {
        true
    }
    fn exec(&self) -> unit::CudaExec<'_> {
        unit::CudaExec {
            dev: &self.device,
            gemm: self.gemm,
        }
    }
    fn describe(&self) -> String {
        let d = &self.device;
        format!(
            "cuda:{} {} (sm_{}), {:?} GEMMs; params and activations cross to the device per unit",
            d.ordinal(),
            d.name(),
            d.arch(),
            self.gemm
        )
    }
}

pub(crate) fn gpu_err(e: tierzero_gpu::GpuError) -> ModelError {
    ModelError::Gpu {
        what: e.to_string(),
    }
}

/// Bytes of an fp32 element on the executor.
const F32_BYTES: u64 = 4;

/// The dtype a unit's hidden output and gradients leave in: its params'
/// (the storage dtype: bf16 under `bf16.enabled`, fp32 otherwise), as
/// the CPU units' precision policy has them (`super::precision`). The
/// loss is fp32 either way.
fn storage_dtype(params: &[Tensor]) -> DType {
    params.first().map_or(DType::F32, Tensor::dtype)
}

/// `v` as a host tensor of `shape` in `dtype` (rounded once from fp32).
pub(crate) fn tensor_as(v: Vec<f32>, shape: &[usize], dtype: DType) -> Result<Tensor, ModelError> {
    let t = tensor(v, shape)?;
    Ok(if dtype == DType::F32 {
        t
    } else {
        t.to_dtype(dtype)?
    })
}

fn ids_of(t: &Tensor) -> Result<Vec<i32>, ModelError> {
    Ok(t.flatten_all()?
        .to_vec1::<u32>()?
        .into_iter()
        .map(|v| v as i32)
        .collect())
}

fn upload<E: Exec>(e: &E, what: &str, t: &Tensor) -> Result<E::Buf, ModelError> {
    e.upload(what, &host_f32(t)?).map_err(gpu_err)
}

fn uploads<E: Exec>(e: &E, params: &[Tensor]) -> Result<Vec<E::Buf>, ModelError> {
    params.iter().map(|p| upload(e, "unit params", p)).collect()
}

fn tensor(v: Vec<f32>, shape: &[usize]) -> Result<Tensor, ModelError> {
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
}

/// The batch shape `[b, t]` of a unit's input.
/// `(batch, seq)` of a unit's input, refused as the CPU's checks refuse it
/// (`Model::check_tokens`, `check_hidden`) when `seq` exceeds the model's
/// positions: GPT-2's position ids would be out of range, and a Llama
/// family's rotary tables would run past the positions it was trained on.
fn batch_shape(
    c: &ModelConfig,
    unit: UnitId,
    input: &UnitInput<'_>,
) -> Result<(usize, usize), ModelError> {
    let t = match input {
        UnitInput::Tokens(t) => *t,
        UnitInput::Hidden(h) => *h,
        UnitInput::HiddenWithTargets { hidden, .. } => *hidden,
    };
    let d = t.dims();
    let bt = match d {
        [_, s, ..] if *s > c.max_seq_len => {
            return Err(ModelError::BadInput {
                unit,
                reason: format!("sequence length {s} exceeds max_seq_len {}", c.max_seq_len),
            })
        }
        [_, s, ..] if supports(c, *s).is_some() => {
            return Err(ModelError::Unsupported {
                what: supports(c, *s).unwrap_or_default(),
            })
        }
        [b, s, ..] => (*b, *s),
        _ => {
            return Err(ModelError::Unsupported {
                what: format!("a unit input of shape {d:?}"),
            })
        }
    };
    // The head's loss takes one target a row of hidden: fewer would scale
    // the loss wrong, more would read past the logits.
    if let UnitInput::HiddenWithTargets { targets, .. } = input {
        if targets.dims() != [bt.0, bt.1] {
            return Err(ModelError::BadInput {
                unit,
                reason: format!(
                    "targets shape {:?} must be [{}, {}] to match hidden",
                    targets.dims(),
                    bt.0,
                    bt.1
                ),
            });
        }
    }
    Ok(bt)
}

/// A GPT-2 config's dimensions for the units, at `(batch, seq)`.
pub fn gpt2_dims(c: &ModelConfig, (batch, seq): (usize, usize)) -> Gpt2Dims {
    Gpt2Dims {
        batch,
        seq,
        hidden: c.hidden_size,
        heads: c.n_head,
        inner: c.intermediate_size,
        vocab: c.vocab_size,
        eps: c.norm_eps as f32,
    }
}

/// A Llama-family config's dimensions and options for the units, at
/// `(batch, seq)`.
pub fn llama_dims(c: &ModelConfig, (batch, seq): (usize, usize)) -> LlamaDims {
    LlamaDims {
        batch,
        seq,
        hidden: c.hidden_size,
        heads: c.n_head,
        kv_heads: c.n_kv_head,
        head_dim: c.head_dim,
        inner: c.intermediate_size,
        vocab: c.vocab_size,
        eps: c.norm_eps as f32,
        qkv_bias: c.qkv_bias,
        o_bias: c.o_bias,
        mlp_bias: c.mlp_bias,
        qk_norm: c.qk_norm,
    }
}

/// The model is one the units implement, and `p` (on the executor) and
/// `params` (their host copies, or this rank's shards of them) are the
/// unit's params: as many as it declares, each on the executor of the
/// model's length.
fn check<E: Exec>(
    e: &E,
    model: &Model,
    unit: UnitId,
    params: &[Tensor],
    p: &[E::Buf],
) -> Result<UnitKind, ModelError> {
    if let Some(why) = supports(model.config(), 0) {
        return Err(ModelError::Unsupported { what: why });
    }
    let spec = model.unit(unit)?;
    for found in [params.len(), p.len()] {
        if found != spec.params.len() {
            return Err(ModelError::ParamCount {
                unit,
                expected: spec.params.len(),
                found,
            });
        }
    }
    // Against the model's own count: with several ranks a compute that
    // gathers on its device is handed this rank's shards
    // (`UnitCompute::gathers_params`), and the executor holds the whole.
    for (i, (&id, dev)) in spec.params.iter().zip(p).enumerate() {
        let numel = model.params().get(id.0).map_or(0, |d| d.numel);
        if numel != e.len(dev) {
            return Err(ModelError::BadInput {
                unit,
                reason: format!(
                    "param {i} has {numel} elements in the model and {} on the executor",
                    e.len(dev)
                ),
            });
        }
    }
    Ok(spec.kind)
}

/// The positions `0..seq` of each row.
fn positions<E: Exec>(
    e: &E,
    c: &ModelConfig,
    (b, t): (usize, usize),
) -> Result<E::Ids, ModelError> {
    let pos: Vec<i32> = (0..b * t).map(|i| (i % t) as i32).collect();
    e.ids(&pos, c.max_seq_len).map_err(gpu_err)
}

fn forward<E: Exec>(
    e: &E,
    model: &Model,
    unit: UnitId,
    params: &[Tensor],
    input: UnitInput<'_>,
) -> Result<UnitOutput, ModelError> {
    let p = uploads(e, params)?;
    forward_on(e, &Direct(e), model, unit, params, &p, input)?.into_host(e, &Direct(e))
}

/// A unit's forward output still on the executor: a hidden state not yet
/// downloaded, or the head's loss (on the host already).
#[derive(Debug)]
pub(crate) enum ForwardOut<B> {
    /// A hidden state (an embedding's or a block's output).
    Hidden {
        /// Its fp32 elements on the executor.
        buf: B,
        /// `[batch, seq, hidden]`.
        shape: [usize; 3],
        /// The dtype its host copy is stored in (its params').
        dtype: DType,
    },
    /// The head's loss.
    Loss(Tensor),
}

impl<B> ForwardOut<B> {
    /// The output on the host: a hidden state downloaded (and rounded
    /// once to its dtype), its executor buffer handed to the crossing to
    /// keep for the next unit ([`Crossing::keep`]).
    pub(crate) fn into_host<E: Exec<Buf = B>>(
        self,
        e: &E,
        feed: Feed<'_, B>,
    ) -> Result<UnitOutput, ModelError> {
        match self {
            ForwardOut::Hidden { buf, shape, dtype } => {
                let t = tensor_as(e.download(&buf).map_err(gpu_err)?, &shape, dtype)?;
                feed.keep(&t, buf);
                Ok(UnitOutput::Hidden(t))
            }
            ForwardOut::Loss(t) => Ok(UnitOutput::Loss(t)),
        }
    }
}

/// [`UnitCompute::forward_unit`] with the unit's params already on the
/// executor (`p`, in declared order; `params` are their host copies), up
/// to the output on the executor: the unit's kernels are queued, its
/// hidden output is not downloaded (the caller does, with
/// [`ForwardOut::into_host`]).
pub(crate) fn forward_on<E: Exec>(
    e: &E,
    feed: Feed<'_, E::Buf>,
    model: &Model,
    unit: UnitId,
    params: &[Tensor],
    p: &[E::Buf],
    input: UnitInput<'_>,
) -> Result<ForwardOut<E::Buf>, ModelError> {
    let kind = check(e, model, unit, params, p)?;
    let c = model.config();
    let bt = batch_shape(c, unit, &input)?;
    let h = c.hidden_size;
    let shape = [bt.0, bt.1, h];
    let dtype = storage_dtype(params);
    let hidden_out = |buf: E::Buf| -> Result<ForwardOut<E::Buf>, ModelError> {
        Ok(ForwardOut::Hidden { buf, shape, dtype })
    };
    match (kind, input, c.arch) {
        (UnitKind::Embedding, UnitInput::Tokens(ids), arch) => {
            let ids = e.ids(&ids_of(ids)?, c.vocab_size).map_err(gpu_err)?;
            let y = match arch {
                Arch::Gpt2 => {
                    let pos = positions(e, c, bt)?;
                    unit::gpt2_embedding_forward(e, &gpt2_dims(c, bt), p, &ids, &pos)
                }
                Arch::Llama => unit::llama_embedding_forward(e, &llama_dims(c, bt), &p[0], &ids),
            }
            .map_err(gpu_err)?;
            hidden_out(y)
        }
        (UnitKind::Block { .. }, UnitInput::Hidden(host_x), Arch::Gpt2) => {
            let x = feed.feed("hidden", host_x)?;
            let d = gpt2_dims(c, bt);
            if !feed.keeps_forwards() {
                return hidden_out(unit::gpt2_block_forward(e, &d, p, &x).map_err(gpu_err)?);
            }
            let (y, kept) = unit::gpt2_block_forward_kept(e, &d, p, x).map_err(gpu_err)?;
            let bytes = kept.bytes(e);
            feed.keep_forward(unit, host_x, KeptForward::Gpt2(kept), bytes);
            hidden_out(y)
        }
        (UnitKind::Block { .. }, UnitInput::Hidden(host_x), Arch::Llama) => {
            let x = feed.feed("hidden", host_x)?;
            let d = llama_dims(c, bt);
            let y = with_rope(feed, c, bt.1, |rope| {
                if !feed.keeps_forwards() {
                    return unit::llama_block_forward(e, &d, p, &x, rope).map_err(gpu_err);
                }
                let (y, kept) =
                    unit::llama_block_forward_kept(e, &d, p, x, rope).map_err(gpu_err)?;
                let bytes = kept.bytes(e);
                feed.keep_forward(unit, host_x, KeptForward::Llama(kept), bytes);
                Ok(y)
            })?;
            hidden_out(y)
        }
        (UnitKind::Head, UnitInput::HiddenWithTargets { hidden, targets }, _) => {
            // The loss alone: the head's backward at scale 0 computes it
            // and its gradients are dropped.
            let out = head(e, feed, model, p, hidden, targets, 0.0, bt)?;
            let loss = out.loss.mean(e).map_err(gpu_err)?;
            Ok(ForwardOut::Loss(Tensor::new(loss, &Device::Cpu)?))
        }
        (kind, _, _) => Err(ModelError::BadInput {
            unit,
            reason: format!("{kind:?} was given the wrong kind of input"),
        }),
    }
}

/// What the head leaves: its mean loss, its params' gradients and its
/// input's gradient.
struct HeadOut<B> {
    loss: unit::HeadLoss<B>,
    grads: Vec<B>,
    dx: B,
}

/// The head's loss and, at `loss_scale`, its gradients.
#[allow(clippy::too_many_arguments)] // the head's inputs, each its own
fn head<E: Exec>(
    e: &E,
    feed: Feed<'_, E::Buf>,
    model: &Model,
    p: &[E::Buf],
    hidden: &Tensor,
    targets: &Tensor,
    loss_scale: f32,
    bt: (usize, usize),
) -> Result<HeadOut<E::Buf>, ModelError> {
    let c = model.config();
    let x = feed.feed("hidden", hidden)?;
    let t = e.ids(&ids_of(targets)?, c.vocab_size).map_err(gpu_err)?;
    let mut g: Vec<E::Buf> = p
        .iter()
        .map(|b| e.zeros("head gradients", e.len(b)))
        .collect::<tierzero_gpu::Result<_>>()
        .map_err(gpu_err)?;
    let (loss, dx) = match (c.arch, p, &mut g[..]) {
        (Arch::Gpt2, [p0, p1, p2], [g0, g1, g2]) => unit::gpt2_head(
            e,
            &gpt2_dims(c, bt),
            [p0, p1, p2],
            &x,
            &t,
            loss_scale,
            [g0, g1, g2],
        ),
        (Arch::Llama, [p0, p1], [g0, g1]) => unit::llama_head(
            e,
            &llama_dims(c, bt),
            [p0, p1],
            &x,
            &t,
            loss_scale,
            [g0, g1],
        ),
        _ => {
            return Err(ModelError::Unsupported {
                what: format!("a head of {} params", p.len()),
            })
        }
    }
    .map_err(gpu_err)?;
    Ok(HeadOut { loss, grads: g, dx })
}

fn backward<E: Exec>(
    e: &E,
    model: &Model,
    unit: UnitId,
    params: &[Tensor],
    input: UnitInput<'_>,
    upstream: Upstream<'_>,
) -> Result<UnitGrads, ModelError> {
    let p = uploads(e, params)?;
    let feed = Direct(e);
    let out =
        backward_dev(e, &feed, model, unit, params, &p, input, upstream)?.into_out(e, &feed)?;
    let params = out
        .grads
        .into_iter()
        .map(|(id, g, dims)| {
            Ok((
                id,
                tensor_as(e.download(&g).map_err(gpu_err)?, &dims, out.dtype)?,
            ))
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    Ok(UnitGrads {
        params,
        input: out.input,
        loss: out.loss,
    })
}

/// A unit's backward with its param gradients still on the executor.
pub(crate) struct BackwardOut<B> {
    /// Each param's gradient, with its host shape, in declared order.
    pub grads: Vec<(ParamId, B, Vec<usize>)>,
    /// The input gradient, on the host in `dtype`.
    pub input: Option<Tensor>,
    /// The loss (the head's).
    pub loss: Option<Tensor>,
    /// The dtype the gradients leave in ([`storage_dtype`]).
    pub dtype: DType,
}

/// A unit's backward still on the executor: its param gradients and its
/// input gradient not yet downloaded.
#[derive(Debug)]
pub(crate) struct BackwardDev<B> {
    /// Each param's gradient, with its host shape, in declared order.
    grads: Vec<(ParamId, B, Vec<usize>)>,
    /// The input gradient and its `[batch, seq, hidden]` shape (none for
    /// the embedding).
    input_grad: Option<(B, [usize; 3])>,
    /// The loss (the head's), still on the executor.
    loss: Option<unit::HeadLoss<B>>,
    /// The dtype the gradients leave in ([`storage_dtype`]).
    dtype: DType,
}

impl<B> BackwardDev<B> {
    /// Its input gradient downloaded (and rounded once to its dtype), its
    /// executor buffer handed to the crossing to keep as the next unit's
    /// upstream ([`Crossing::keep`]); the param gradients stay.
    pub(crate) fn into_out<E: Exec<Buf = B>>(
        self,
        e: &E,
        feed: Feed<'_, B>,
    ) -> Result<BackwardOut<B>, ModelError> {
        let input = match self.input_grad {
            Some((dx, shape)) => {
                let t = tensor_as(e.download(&dx).map_err(gpu_err)?, &shape, self.dtype)?;
                feed.keep(&t, dx);
                Some(t)
            }
            None => None,
        };
        let loss = match &self.loss {
            Some(l) => Some(Tensor::new(l.mean(e).map_err(gpu_err)?, &Device::Cpu)?),
            None => None,
        };
        Ok(BackwardOut {
            grads: self.grads,
            input,
            loss,
            dtype: self.dtype,
        })
    }
}

/// [`UnitCompute::backward_unit`] with the unit's params already on the
/// executor (`p`, in declared order; `params` are their host copies, whose
/// shapes the gradients take), up to its results on the executor: the
/// unit's kernels are queued, nothing downloaded
/// ([`BackwardDev::into_out`]: the input gradient; the param gradients
/// stay, for the device tier to download on its copy queue out).
#[allow(clippy::too_many_arguments)] // the unit, its params twice, its inputs
pub(crate) fn backward_dev<E: Exec>(
    e: &E,
    feed: Feed<'_, E::Buf>,
    model: &Model,
    unit: UnitId,
    params: &[Tensor],
    p: &[E::Buf],
    input: UnitInput<'_>,
    upstream: Upstream<'_>,
) -> Result<BackwardDev<E::Buf>, ModelError> {
    let kind = check(e, model, unit, params, p)?;
    let spec = model.unit(unit)?.clone();
    let c = model.config();
    let bt = batch_shape(c, unit, &input)?;
    let h = c.hidden_size;
    let zeros = |e: &E| -> Result<Vec<E::Buf>, ModelError> {
        p.iter()
            .map(|b| e.zeros("unit gradients", e.len(b)))
            .collect::<tierzero_gpu::Result<_>>()
            .map_err(gpu_err)
    };
    let (grads, input_grad, loss) = match (kind, input, upstream) {
        (
            UnitKind::Head,
            UnitInput::HiddenWithTargets { hidden, targets },
            Upstream::LossScale(s),
        ) => {
            let out = head(e, feed, model, p, hidden, targets, s as f32, bt)?;
            (out.grads, Some(out.dx), Some(out.loss))
        }
        (UnitKind::Block { .. }, UnitInput::Hidden(host_x), Upstream::Grad(dy)) => {
            // The kept forward (its input in it), or the input to
            // recompute it from.
            let kept = feed.take_forward(unit, host_x);
            let x = match kept {
                Some(_) => None,
                None => Some(feed.feed("hidden", host_x)?),
            };
            let dy = feed.feed("upstream gradient", dy)?;
            let mut g = zeros(e)?;
            let dx = match (c.arch, kept, &x) {
                (Arch::Gpt2, Some(KeptForward::Gpt2(k)), _) => {
                    unit::gpt2_block_backward_kept(e, &gpt2_dims(c, bt), p, k, &dy, &mut g)
                        .map_err(gpu_err)
                }
                (Arch::Gpt2, None, Some(x)) => {
                    unit::gpt2_block_backward(e, &gpt2_dims(c, bt), p, x, &dy, &mut g)
                        .map_err(gpu_err)
                }
                (Arch::Llama, Some(KeptForward::Llama(k)), _) => with_rope(feed, c, bt.1, |r| {
                    unit::llama_block_backward_kept(e, &llama_dims(c, bt), p, k, &dy, &mut g, r)
                        .map_err(gpu_err)
                }),
                (Arch::Llama, None, Some(x)) => with_rope(feed, c, bt.1, |r| {
                    unit::llama_block_backward(e, &llama_dims(c, bt), p, x, &dy, &mut g, r)
                        .map_err(gpu_err)
                }),
                (arch, _, _) => Err(ModelError::BadInput {
                    unit,
                    reason: format!("a kept forward of another architecture than {arch:?}"),
                }),
            }?;
            (g, Some(dx), None)
        }
        (UnitKind::Embedding, UnitInput::Tokens(ids), Upstream::Grad(dy)) => {
            let dy = feed.feed("upstream gradient", dy)?;
            let ids = e.ids(&ids_of(ids)?, c.vocab_size).map_err(gpu_err)?;
            let mut g = zeros(e)?;
            match c.arch {
                Arch::Gpt2 => {
                    let pos = positions(e, c, bt)?;
                    unit::gpt2_embedding_backward(e, &gpt2_dims(c, bt), &dy, &ids, &pos, &mut g)
                }
                Arch::Llama => {
                    unit::llama_embedding_backward(e, &llama_dims(c, bt), &dy, &ids, &mut g[0])
                }
            }
            .map_err(gpu_err)?;
            (g, None, None)
        }
        (kind, _, _) => {
            return Err(ModelError::BadInput {
                unit,
                reason: format!("{kind:?} was given the wrong kind of input or upstream"),
            })
        }
    };
    let dtype = storage_dtype(params);
    let grads = spec
        .params
        .iter()
        .zip(grads)
        .map(|(id, g)| {
            // The model's shape: the host tensor may be a shard
            // (`UnitCompute::gathers_params`).
            let shape = model
                .params()
                .get(id.0)
                .map_or_else(Vec::new, |d| d.shape.clone());
            (*id, g, shape)
        })
        .collect();
    Ok(BackwardDev {
        grads,
        input_grad: input_grad.map(|dx| (dx, [bt.0, bt.1, h])),
        loss,
        dtype,
    })
}

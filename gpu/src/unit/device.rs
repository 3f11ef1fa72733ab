//! The CUDA executor: [`Exec`] on a [`Device`], every operation a kernel
//! of [`crate::ops`] or a cuBLAS GEMM on its compute stream.
//!
//! Its buffers ([`DevBuf`]) are fp32 but for two kinds:
//!
//! * with bf16 GEMMs, the attention keeps its `[batch · heads, seq, seq]`
//!   scores, probabilities and their gradients in bf16
//!   ([`Exec::attention_fwd`]), the largest buffers of a block at long
//!   sequences;
//! * params stored in bf16 or fp16 stay so on the device, as they
//!   crossed (the engine's links keep a 16-bit upload as it is: half the
//!   device bytes, no widening pass). A GEMM with operands of that dtype
//!   reads such a weight as it is, where an fp32 one would be cast first
//!   (the same bits: the cast of a widened 16-bit value gives it back). A
//!   kernel that reads an fp32 param (a norm's weight, a bias) reads it
//!   widened, exactly, into a small scratch buffer (`As::Cast`); the
//!   embedding gathers a 16-bit table's rows as they are and widens
//!   those.
//!
//! Every other operand must be fp32: an activation or gradient in 16 bits
//! is refused.

use half::{bf16, f16};

use super::{check_ids, mm, AttnShape, Exec, GemmDtype};
use crate::device::{Device, DeviceBuffer};
use crate::norm::NormGroup;
use crate::ops::{self, AdamState, MatmulShape, NormOut, NormStats};
use crate::reference::{AdamScalars, HeadsShape, KvShape, RopeShape};
use crate::{GpuError, Result};

/// A unit's buffer on the device: fp32, or bf16 or fp16 for a param
/// stored so, and bf16 for what the executor keeps narrower on its own
/// (the attention's probabilities with bf16 GEMMs).
#[derive(Debug)]
pub enum DevBuf {
    /// fp32 elements.
    F32(DeviceBuffer<f32>),
    /// bf16 elements.
    Bf16(DeviceBuffer<bf16>),
    /// fp16 elements.
    F16(DeviceBuffer<f16>),
}

impl From<DeviceBuffer<f32>> for DevBuf {
    fn from(b: DeviceBuffer<f32>) -> Self {
        DevBuf::F32(b)
    }
}

impl From<DeviceBuffer<bf16>> for DevBuf {
    fn from(b: DeviceBuffer<bf16>) -> Self {
        DevBuf::Bf16(b)
    }
}

impl From<DeviceBuffer<f16>> for DevBuf {
    fn from(b: DeviceBuffer<f16>) -> Self {
        DevBuf::F16(b)
    }
}

impl DevBuf {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            DevBuf::F32(b) => b.len(),
            DevBuf::Bf16(b) => b.len(),
            DevBuf::F16(b) => b.len(),
        }
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> u64 {
        match self {
            DevBuf::F32(b) => b.len() as u64 * 4,
            DevBuf::Bf16(b) => b.len() as u64 * 2,
            DevBuf::F16(b) => b.len() as u64 * 2,
        }
    }

    /// [`DeviceBuffer::uncount`].
    pub(crate) fn uncount(&mut self) {
        match self {
            DevBuf::F32(b) => b.uncount(),
            DevBuf::Bf16(b) => b.uncount(),
            DevBuf::F16(b) => b.uncount(),
        }
    }

    fn not_f32() -> GpuError {
        GpuError::Shape {
            kernel: "unit buffer".into(),
            detail: "a 16-bit buffer where an fp32 one is needed".into(),
        }
    }

    /// The fp32 buffer (an error for a 16-bit one).
    pub fn f32(&self) -> Result<&DeviceBuffer<f32>> {
        match self {
            DevBuf::F32(b) => Ok(b),
            DevBuf::Bf16(_) | DevBuf::F16(_) => Err(Self::not_f32()),
        }
    }

    /// The fp32 buffer, mutably (an error for a 16-bit one).
    pub fn f32_mut(&mut self) -> Result<&mut DeviceBuffer<f32>> {
        match self {
            DevBuf::F32(b) => Ok(b),
            DevBuf::Bf16(_) | DevBuf::F16(_) => Err(Self::not_f32()),
        }
    }

    /// The fp32 buffer itself (an error for a 16-bit one).
    pub fn into_f32(self) -> Result<DeviceBuffer<f32>> {
        match self {
            DevBuf::F32(b) => Ok(b),
            DevBuf::Bf16(_) | DevBuf::F16(_) => Err(Self::not_f32()),
        }
    }
}

/// Ids on a device, with their embedding runs.
#[derive(Debug)]
pub struct DeviceIds {
    ids: DeviceBuffer<i32>,
    runs: ops::DeviceRuns,
    vocab: usize,
}

/// The units on a [`Device`], with their GEMMs in `gemm`'s operand dtype.
#[derive(Debug, Clone, Copy)]
pub struct CudaExec<'a> {
    /// The device.
    pub dev: &'a Device,
    /// The GEMMs' operand dtype (bf16: both operands cast by the
    /// `cast_f32_bf16` kernel into scratch buffers, then a bf16 x bf16 ->
    /// fp32 cuBLAS GEMM).
    pub gemm: GemmDtype,
}

/// `x` cast to `T` in a scratch buffer (the cast writes every element).
fn cast_copy<T: ops::Elem, S: ops::Elem>(
    dev: &Device,
    x: &DeviceBuffer<S>,
) -> Result<DeviceBuffer<T>> {
    let mut out = dev.alloc_output("cast operand", x.len())?;
    ops::cast::<S, T>(dev, &mut out, x)?;
    Ok(out)
}

/// A buffer as `T` for a kernel or a GEMM that reads `T`: itself, or a
/// copy cast into a scratch buffer (freed after its reader, on the
/// compute stream, in order).
enum As<'b, T> {
    /// A buffer of `T`, as it is.
    Same(&'b DeviceBuffer<T>),
    /// Another buffer's cast copy.
    Cast(DeviceBuffer<T>),
}

impl<T> std::ops::Deref for As<'_, T> {
    type Target = DeviceBuffer<T>;
    fn deref(&self) -> &DeviceBuffer<T> {
        match self {
            As::Same(b) => b,
            As::Cast(b) => b,
        }
    }
}

/// `b` cast to `T` ([`cast_copy`]), as an [`As`].
fn cast_to<T: ops::Elem, S: ops::Elem>(
    dev: &Device,
    b: &DeviceBuffer<S>,
) -> Result<As<'static, T>> {
    Ok(As::Cast(cast_copy(dev, b)?))
}

/// `b` as fp32: an fp32 buffer as it is, a 16-bit one (a param kept in
/// its storage dtype) widened exactly.
fn wide<'b>(dev: &Device, b: &'b DevBuf) -> Result<As<'b, f32>> {
    match b {
        DevBuf::F32(b) => Ok(As::Same(b)),
        DevBuf::Bf16(n) => cast_to(dev, n),
        DevBuf::F16(n) => cast_to(dev, n),
    }
}

/// `b` as a bf16 GEMM operand: a bf16 buffer as it is, an fp32 one
/// rounded, an fp16 one widened first (never in a run: fp16 storage
/// computes with fp16 GEMMs).
fn narrow<'b>(dev: &Device, b: &'b DevBuf) -> Result<As<'b, bf16>> {
    match b {
        DevBuf::Bf16(n) => Ok(As::Same(n)),
        DevBuf::F32(w) => cast_to(dev, w),
        DevBuf::F16(_) => cast_to(dev, &*wide(dev, b)?),
    }
}

/// `b` as an fp16 GEMM operand: an fp16 buffer as it is, an fp32 one
/// rounded, a bf16 one widened first (never in a run).
fn to_f16<'b>(dev: &Device, b: &'b DevBuf) -> Result<As<'b, f16>> {
    match b {
        DevBuf::F16(n) => Ok(As::Same(n)),
        DevBuf::F32(w) => cast_to(dev, w),
        DevBuf::Bf16(_) => cast_to(dev, &*wide(dev, b)?),
    }
}

/// A new device buffer of `n` elements for `what`, written in full by
/// `op` (so not zeroed first: [`Device::alloc_output`]).
fn fresh(
    dev: &Device,
    what: &str,
    n: usize,
    op: impl FnOnce(&mut DeviceBuffer<f32>) -> Result<()>,
) -> Result<DevBuf> {
    let mut b = dev.alloc_output(what, n)?;
    op(&mut b)?;
    Ok(DevBuf::F32(b))
}

/// A new bf16 device buffer of `n` elements for `what`, written in full
/// by `op`.
fn fresh16(
    dev: &Device,
    what: &str,
    n: usize,
    op: impl FnOnce(&mut DeviceBuffer<bf16>) -> Result<()>,
) -> Result<DeviceBuffer<bf16>> {
    let mut b = dev.alloc_output(what, n)?;
    op(&mut b)?;
    Ok(b)
}

impl CudaExec<'_> {
    /// The rows of a 16-bit embedding `table` for `ids`, widened to fp32.
    fn gather_widened<T: ops::Elem>(
        &self,
        table: &DeviceBuffer<T>,
        ids: &DeviceIds,
        hidden: usize,
    ) -> Result<DevBuf> {
        let n = ids.ids.len() * hidden;
        let mut rows = self.dev.alloc_output::<T>("embedding rows", n)?;
        ops::embedding_fwd(self.dev, &mut rows, table, &ids.ids, hidden)?;
        fresh(self.dev, "embedding output", n, |o| {
            ops::cast(self.dev, o, &rows)
        })
    }
}

impl Exec for CudaExec<'_> {
    type Buf = DevBuf;
    type Ids = DeviceIds;

    fn rmsnorm_fwd(&self, x: &DevBuf, w: &DevBuf, cols: usize, eps: f32) -> Result<[DevBuf; 2]> {
        let x = x.f32()?;
        let rows = x.len() / cols.max(1);
        let mut y = self.dev.alloc_output("rmsnorm output", x.len())?;
        let mut rstd = self.dev.alloc_output("rmsnorm rstd", rows)?;
        let out = NormOut {
            y: &mut y,
            mean: None,
            rstd: &mut rstd,
        };
        ops::rmsnorm_fwd(self.dev, out, x, &*wide(self.dev, w)?, cols, eps)?;
        Ok([y.into(), rstd.into()])
    }
    fn rmsnorm_bwd(
        &self,
        dy: &DevBuf,
        x: &DevBuf,
        w: &DevBuf,
        rstd: &DevBuf,
        dw: &mut DevBuf,
        cols: usize,
    ) -> Result<DevBuf> {
        let (dy, x, rstd) = (dy.f32()?, x.f32()?, rstd.f32()?);
        let w = wide(self.dev, w)?;
        let w: &DeviceBuffer<f32> = &w;
        ops::rmsnorm_bwd_w(self.dev, dw.f32_mut()?, dy, x, rstd, cols)?;
        fresh(self.dev, "rmsnorm dx", x.len(), |o| {
            ops::rmsnorm_bwd_dx(self.dev, o, dy, x, w, rstd, cols)
        })
    }
    fn rope(
        &self,
        x: &DevBuf,
        cos: &DevBuf,
        sin: &DevBuf,
        s: RopeShape,
        sign: f32,
    ) -> Result<DevBuf> {
        let (x, cos, sin) = (x.f32()?, cos.f32()?, sin.f32()?);
        fresh(self.dev, "rotated", x.len(), |o| {
            ops::rope(self.dev, o, x, cos, sin, s, sign)
        })
    }
    fn swiglu_fwd(&self, gate: &DevBuf, up: &DevBuf) -> Result<DevBuf> {
        let (gate, up) = (gate.f32()?, up.f32()?);
        fresh(self.dev, "swiglu output", gate.len(), |o| {
            ops::swiglu_fwd(self.dev, o, gate, up)
        })
    }
    fn swiglu_bwd(&self, dy: &DevBuf, gate: &DevBuf, up: &DevBuf) -> Result<[DevBuf; 2]> {
        let (dy, gate, up) = (dy.f32()?, gate.f32()?, up.f32()?);
        let mut dg = self.dev.alloc_output("swiglu dgate", gate.len())?;
        let mut du = self.dev.alloc_output("swiglu dup", up.len())?;
        ops::swiglu_bwd(self.dev, &mut dg, &mut du, dy, gate, up)?;
        Ok([dg.into(), du.into()])
    }
    fn repeat_kv(&self, x: &DevBuf, s: KvShape) -> Result<DevBuf> {
        let x = x.f32()?;
        fresh(self.dev, "repeated kv", x.len() * s.group, |o| {
            ops::repeat_kv(self.dev, o, x, s)
        })
    }
    fn sum_kv(&self, x: &DevBuf, s: KvShape) -> Result<DevBuf> {
        let x = x.f32()?;
        fresh(self.dev, "kv gradient", x.len() / s.group.max(1), |o| {
            ops::sum_kv(self.dev, o, x, s)
        })
    }
    fn upload(&self, what: &str, v: &[f32]) -> Result<DevBuf> {
        Ok(self.dev.upload(what, v)?.into())
    }
    fn download(&self, b: &DevBuf) -> Result<Vec<f32>> {
        match b {
            DevBuf::F32(b) => self.dev.download(b),
            DevBuf::Bf16(b) => Ok(self.dev.download(b)?.iter().map(|x| x.to_f32()).collect()),
            DevBuf::F16(b) => Ok(self.dev.download(b)?.iter().map(|x| x.to_f32()).collect()),
        }
    }
    fn fill_zero(&self, b: &mut DevBuf) -> Result<()> {
        match b {
            DevBuf::F32(b) => self.dev.zero(b),
            DevBuf::Bf16(b) => self.dev.zero(b),
            DevBuf::F16(b) => self.dev.zero(b),
        }
    }
    fn adamw(&self, [master, m, v]: [&mut DevBuf; 3], grad: &DevBuf, s: AdamScalars) -> Result<()> {
        let st = AdamState {
            master: master.f32_mut()?,
            m: m.f32_mut()?,
            v: v.f32_mut()?,
        };
        ops::adamw::<f32>(self.dev, st, grad.f32()?, None, s)
    }

    fn norm_sq_sums(&self, groups: &[NormGroup<'_, DevBuf>]) -> Result<Vec<f64>> {
        let groups = groups
            .iter()
            .map(|g| g.try_map_bufs(DevBuf::f32))
            .collect::<Result<Vec<_>>>()?;
        ops::norm_sq_sums(self.dev, &groups)
    }

    fn round_bf16(&self, dst: &mut DevBuf, src: &DevBuf) -> Result<()> {
        let src = src.f32()?;
        match dst {
            // A param kept in bf16: the rounding is its new bits.
            DevBuf::Bf16(d) => ops::cast(self.dev, d, src),
            DevBuf::F32(d) => {
                let narrow = cast_copy::<bf16, f32>(self.dev, src)?;
                ops::cast(self.dev, d, &narrow)
            }
            DevBuf::F16(_) => Err(GpuError::Shape {
                kernel: "round_bf16".into(),
                detail: "into an fp16 buffer (the device optimizer keeps fp32 or bf16 params)"
                    .into(),
            }),
        }
    }
    fn zeros(&self, what: &str, n: usize) -> Result<DevBuf> {
        Ok(self.dev.alloc_zeros::<f32>(what, n)?.into())
    }
    fn output(&self, what: &str, n: usize) -> Result<DevBuf> {
        Ok(self.dev.alloc_output::<f32>(what, n)?.into())
    }
    fn len(&self, b: &DevBuf) -> usize {
        b.len()
    }
    fn bytes(&self, b: &DevBuf) -> u64 {
        b.bytes()
    }
    fn ids(&self, ids: &[i32], vocab: usize) -> Result<DeviceIds> {
        check_ids(ids, vocab)?;
        Ok(DeviceIds {
            ids: self.dev.upload("token ids", ids)?,
            runs: ops::DeviceRuns::new(self.dev, ids, vocab)?,
            vocab,
        })
    }
    fn matmul(
        &self,
        c: &mut DevBuf,
        a: &DevBuf,
        b: &DevBuf,
        s: MatmulShape,
        beta: f32,
    ) -> Result<()> {
        let (dev, c) = (self.dev, c.f32_mut()?);
        match self.gemm {
            GemmDtype::F32 => ops::matmul(dev, c, &*wide(dev, a)?, &*wide(dev, b)?, s, 1.0, beta),
            GemmDtype::Bf16 => {
                let (a16, b16) = (narrow(dev, a)?, narrow(dev, b)?);
                ops::matmul_16_f32::<bf16>(dev, c, &a16, &b16, s, 1.0, beta)
            }
            GemmDtype::F16 => {
                let (a16, b16) = (to_f16(dev, a)?, to_f16(dev, b)?);
                ops::matmul_16_f32::<half::f16>(dev, c, &a16, &b16, s, 1.0, beta)
            }
        }
    }
    fn bias_add(&self, y: &mut DevBuf, b: &DevBuf) -> Result<()> {
        ops::bias_add(self.dev, y.f32_mut()?, &*wide(self.dev, b)?)
    }
    fn bias_grad(&self, db: &mut DevBuf, dy: &DevBuf) -> Result<()> {
        ops::bias_grad(self.dev, db.f32_mut()?, dy.f32()?)
    }
    fn layernorm_fwd(
        &self,
        x: &DevBuf,
        w: &DevBuf,
        b: &DevBuf,
        cols: usize,
        eps: f32,
    ) -> Result<[DevBuf; 3]> {
        let x = x.f32()?;
        let rows = x.len() / cols.max(1);
        let mut y = self.dev.alloc_output("layernorm output", x.len())?;
        let mut mean = self.dev.alloc_output("layernorm mean", rows)?;
        let mut rstd = self.dev.alloc_output("layernorm rstd", rows)?;
        let out = NormOut {
            y: &mut y,
            mean: Some(&mut mean),
            rstd: &mut rstd,
        };
        let (w, b) = (wide(self.dev, w)?, wide(self.dev, b)?);
        ops::layernorm_fwd(self.dev, out, x, &w, Some(&b), cols, eps)?;
        Ok([y.into(), mean.into(), rstd.into()])
    }
    fn layernorm_bwd(
        &self,
        dy: &DevBuf,
        x: &DevBuf,
        w: &DevBuf,
        [mean, rstd]: [&DevBuf; 2],
        dw: &mut DevBuf,
        db: &mut DevBuf,
        cols: usize,
    ) -> Result<DevBuf> {
        let (dy, x) = (dy.f32()?, x.f32()?);
        let w = wide(self.dev, w)?;
        let w: &DeviceBuffer<f32> = &w;
        let stats = NormStats {
            mean: Some(mean.f32()?),
            rstd: rstd.f32()?,
        };
        ops::layernorm_bwd_wb(
            self.dev,
            dw.f32_mut()?,
            Some(db.f32_mut()?),
            dy,
            x,
            stats,
            cols,
        )?;
        fresh(self.dev, "layernorm dx", x.len(), |o| {
            ops::layernorm_bwd_dx(self.dev, o, dy, x, w, stats, cols)
        })
    }
    fn softmax_causal_fwd(&self, s: &DevBuf, seq: usize, scale: f32) -> Result<DevBuf> {
        let s = s.f32()?;
        fresh(self.dev, "attention probabilities", s.len(), |o| {
            ops::softmax_causal_fwd(self.dev, o, s, seq, scale)
        })
    }
    fn softmax_bwd(&self, p: &DevBuf, dp: &DevBuf, seq: usize, scale: f32) -> Result<DevBuf> {
        let (p, dp) = (p.f32()?, dp.f32()?);
        fresh(self.dev, "score gradient", p.len(), |o| {
            ops::softmax_bwd(self.dev, o, p, dp, seq, scale)
        })
    }
    fn attention_fwd(
        &self,
        q: &DevBuf,
        k: &DevBuf,
        v: &DevBuf,
        a: AttnShape,
    ) -> Result<[DevBuf; 2]> {
        if self.gemm != GemmDtype::Bf16 {
            return super::attention_fwd_fp32(self, q, k, v, a);
        }
        let (bh, seq, hd) = (a.bh, a.seq, a.head_dim);
        let dev = self.dev;
        let (q16, k16) = (
            cast_copy::<bf16, f32>(dev, q.f32()?)?,
            cast_copy::<bf16, f32>(dev, k.f32()?)?,
        );
        let s16 = fresh16(dev, "attention scores", a.scores_numel(), |s| {
            ops::matmul(
                dev,
                s,
                &q16,
                &k16,
                mm(bh, seq, seq, hd, false, true),
                1.0,
                0.0,
            )
        })?;
        drop((q16, k16));
        let p16 = fresh16(dev, "attention probabilities", a.scores_numel(), |p| {
            ops::softmax_causal_fwd(dev, p, &s16, seq, a.scale())
        })?;
        drop(s16);
        let v16 = cast_copy::<bf16, f32>(dev, v.f32()?)?;
        let o = fresh(dev, "attention output", a.heads_numel(), |o| {
            let s = mm(bh, seq, hd, seq, false, false);
            ops::matmul_16_f32::<bf16>(dev, o, &p16, &v16, s, 1.0, 0.0)
        })?;
        Ok([o, DevBuf::Bf16(p16)])
    }
    fn attention_bwd(
        &self,
        p: &DevBuf,
        [q, k, v]: [&DevBuf; 3],
        dout: &DevBuf,
        a: AttnShape,
    ) -> Result<[DevBuf; 3]> {
        let p16 = match (self.gemm, p) {
            (GemmDtype::Bf16, DevBuf::Bf16(p16)) => p16,
            _ => return super::attention_bwd_fp32(self, p, [q, k, v], dout, a),
        };
        let (bh, seq, hd) = (a.bh, a.seq, a.head_dim);
        let dev = self.dev;
        let half = |b: &DevBuf| cast_copy::<bf16, f32>(dev, b.f32()?);
        let (do16, v16) = (half(dout)?, half(v)?);
        let dp16 = fresh16(dev, "probability gradient", a.scores_numel(), |dp| {
            ops::matmul(
                dev,
                dp,
                &do16,
                &v16,
                mm(bh, seq, seq, hd, false, true),
                1.0,
                0.0,
            )
        })?;
        drop(v16);
        let dv = fresh(dev, "v gradient", a.heads_numel(), |dv| {
            let s = mm(bh, seq, hd, seq, true, false);
            ops::matmul_16_f32::<bf16>(dev, dv, p16, &do16, s, 1.0, 0.0)
        })?;
        drop(do16);
        let ds16 = fresh16(dev, "score gradient", a.scores_numel(), |ds| {
            ops::softmax_bwd(dev, ds, p16, &dp16, seq, a.scale())
        })?;
        drop(dp16);
        let (q16, k16) = (half(q)?, half(k)?);
        let dq = fresh(dev, "q gradient", a.heads_numel(), |dq| {
            let s = mm(bh, seq, hd, seq, false, false);
            ops::matmul_16_f32::<bf16>(dev, dq, &ds16, &k16, s, 1.0, 0.0)
        })?;
        let dk = fresh(dev, "k gradient", a.heads_numel(), |dk| {
            let s = mm(bh, seq, hd, seq, true, false);
            ops::matmul_16_f32::<bf16>(dev, dk, &ds16, &q16, s, 1.0, 0.0)
        })?;
        Ok([dq, dk, dv])
    }
    fn gelu_fwd(&self, x: &DevBuf) -> Result<DevBuf> {
        let x = x.f32()?;
        fresh(self.dev, "gelu output", x.len(), |o| {
            ops::gelu_tanh_fwd(self.dev, o, x)
        })
    }
    fn gelu_bwd(&self, dy: &DevBuf, x: &DevBuf) -> Result<DevBuf> {
        let (dy, x) = (dy.f32()?, x.f32()?);
        fresh(self.dev, "gelu dx", x.len(), |o| {
            ops::gelu_tanh_bwd(self.dev, o, dy, x)
        })
    }
    fn add(&self, a: &DevBuf, b: &DevBuf) -> Result<DevBuf> {
        let (a, b) = (a.f32()?, b.f32()?);
        fresh(self.dev, "sum", a.len(), |o| ops::add(self.dev, o, a, b))
    }
    fn heads_from_rows(&self, x: &DevBuf, s: HeadsShape, slot: usize) -> Result<DevBuf> {
        let x = x.f32()?;
        fresh(self.dev, "heads", s.heads_numel(), |o| {
            ops::heads_from_rows(self.dev, o, x, s, slot)
        })
    }
    fn rows_from_heads(
        &self,
        out: &mut DevBuf,
        x: &DevBuf,
        s: HeadsShape,
        slot: usize,
    ) -> Result<()> {
        ops::rows_from_heads(self.dev, out.f32_mut()?, x.f32()?, s, slot)
    }
    fn embedding_fwd(&self, table: &DevBuf, ids: &DeviceIds, hidden: usize) -> Result<DevBuf> {
        let n = ids.ids.len() * hidden;
        match table {
            DevBuf::F32(table) => fresh(self.dev, "embedding output", n, |o| {
                ops::embedding_fwd(self.dev, o, table, &ids.ids, hidden)
            }),
            // A 16-bit table: its rows gathered as they are, then widened
            // (exact), not the whole table widened first.
            DevBuf::Bf16(table) => self.gather_widened(table, ids, hidden),
            DevBuf::F16(table) => self.gather_widened(table, ids, hidden),
        }
    }
    fn embedding_bwd(
        &self,
        grad_table: &mut DevBuf,
        dy: &DevBuf,
        ids: &DeviceIds,
        hidden: usize,
    ) -> Result<()> {
        let g = grad_table.f32_mut()?;
        ops::embedding_bwd(self.dev, g, dy.f32()?, &ids.runs, ids.vocab, hidden)
    }
    fn cross_entropy(
        &self,
        logits: &DevBuf,
        targets: &DeviceIds,
        vocab: usize,
        grad_scale: f32,
    ) -> Result<(DevBuf, DevBuf)> {
        let logits = logits.f32()?;
        let rows = targets.ids.len();
        let mut loss_rows = self.dev.alloc_output("loss rows", rows)?;
        let mut dlogits = self.dev.alloc_output("logit gradient", logits.len())?;
        ops::cross_entropy(
            self.dev,
            &mut loss_rows,
            Some(&mut dlogits),
            logits,
            &targets.ids,
            vocab,
            -100,
            grad_scale,
        )?;
        let mut total = self.dev.alloc_output("loss", 1)?;
        ops::sum_f32(self.dev, &mut total, &loss_rows)?;
        // Not read back here: the caller reads it when it needs it.
        Ok((total.into(), dlogits.into()))
    }
}

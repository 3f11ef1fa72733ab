//! The CUDA executor: [`Exec`] on a [`Device`], every operation a kernel
//! of [`crate::ops`] or a cuBLAS GEMM on its compute stream.

use super::{check_ids, Exec, GemmDtype};
use crate::device::{Device, DeviceBuffer};
use crate::ops::{self, AdamState, MatmulShape, NormOut, NormStats};
use crate::reference::{self as r, AdamScalars, EmbeddingRuns, HeadsShape, KvShape, RopeShape};
use crate::Result;

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

/// `x` cast to a 16-bit type (bf16 or fp16) in a scratch buffer (the
/// cast writes every element).
fn to_half<T: ops::Elem>(dev: &Device, x: &DeviceBuffer<f32>) -> Result<DeviceBuffer<T>> {
    let mut out = dev.alloc_output("16-bit GEMM operand", x.len())?;
    ops::cast(dev, &mut out, x)?;
    Ok(out)
}

/// A new device buffer of `n` elements for `what`, written in full by
/// `op` (so not zeroed first: [`Device::alloc_output`]).
fn fresh(
    dev: &Device,
    what: &str,
    n: usize,
    op: impl FnOnce(&mut DeviceBuffer<f32>) -> Result<()>,
) -> Result<DeviceBuffer<f32>> {
    let mut b = dev.alloc_output(what, n)?;
    op(&mut b)?;
    Ok(b)
}

impl Exec for CudaExec<'_> {
    type Buf = DeviceBuffer<f32>;
    type Ids = DeviceIds;

    fn rmsnorm_fwd(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        cols: usize,
        eps: f32,
    ) -> Result<[Self::Buf; 2]> {
        let rows = x.len() / cols.max(1);
        let mut y = self.dev.alloc_output("rmsnorm output", x.len())?;
        let mut rstd = self.dev.alloc_output("rmsnorm rstd", rows)?;
        let out = NormOut {
            y: &mut y,
            mean: None,
            rstd: &mut rstd,
        };
        ops::rmsnorm_fwd(self.dev, out, x, w, cols, eps)?;
        Ok([y, rstd])
    }
    fn rmsnorm_bwd(
        &self,
        dy: &Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        rstd: &Self::Buf,
        dw: &mut Self::Buf,
        cols: usize,
    ) -> Result<Self::Buf> {
        ops::rmsnorm_bwd_w(self.dev, dw, dy, x, rstd, cols)?;
        fresh(self.dev, "rmsnorm dx", x.len(), |o| {
            ops::rmsnorm_bwd_dx(self.dev, o, dy, x, w, rstd, cols)
        })
    }
    fn rope(
        &self,
        x: &Self::Buf,
        cos: &Self::Buf,
        sin: &Self::Buf,
        s: RopeShape,
        sign: f32,
    ) -> Result<Self::Buf> {
        fresh(self.dev, "rotated", x.len(), |o| {
            ops::rope(self.dev, o, x, cos, sin, s, sign)
        })
    }
    fn swiglu_fwd(&self, gate: &Self::Buf, up: &Self::Buf) -> Result<Self::Buf> {
        fresh(self.dev, "swiglu output", gate.len(), |o| {
            ops::swiglu_fwd(self.dev, o, gate, up)
        })
    }
    fn swiglu_bwd(
        &self,
        dy: &Self::Buf,
        gate: &Self::Buf,
        up: &Self::Buf,
    ) -> Result<[Self::Buf; 2]> {
        let mut dg = self.dev.alloc_output("swiglu dgate", gate.len())?;
        let mut du = self.dev.alloc_output("swiglu dup", up.len())?;
        ops::swiglu_bwd(self.dev, &mut dg, &mut du, dy, gate, up)?;
        Ok([dg, du])
    }
    fn repeat_kv(&self, x: &Self::Buf, s: KvShape) -> Result<Self::Buf> {
        fresh(self.dev, "repeated kv", x.len() * s.group, |o| {
            ops::repeat_kv(self.dev, o, x, s)
        })
    }
    fn sum_kv(&self, x: &Self::Buf, s: KvShape) -> Result<Self::Buf> {
        fresh(self.dev, "kv gradient", x.len() / s.group.max(1), |o| {
            ops::sum_kv(self.dev, o, x, s)
        })
    }
    fn upload(&self, what: &str, v: &[f32]) -> Result<Self::Buf> {
        self.dev.upload(what, v)
    }
    fn download(&self, b: &Self::Buf) -> Result<Vec<f32>> {
        self.dev.download(b)
    }
    fn fill_zero(&self, b: &mut Self::Buf) -> Result<()> {
        self.dev.zero(b)
    }
    fn adamw(
        &self,
        [master, m, v]: [&mut Self::Buf; 3],
        grad: &Self::Buf,
        s: AdamScalars,
    ) -> Result<()> {
        ops::adamw::<f32>(self.dev, AdamState { master, m, v }, grad, None, s)
    }

    fn sq_sum(&self, x: &Self::Buf) -> Result<f64> {
        let host_offsets = r::sumsq_chunk_offsets(x.len());
        if host_offsets.len() < 2 {
            return Ok(0.0);
        }
        let offsets = self.dev.upload("sum of squares offsets", &host_offsets)?;
        let groups = host_offsets.len() - 1;
        let mut out = self.dev.alloc_output::<f32>("sum of squares", groups)?;
        ops::sumsq_groups(self.dev, &mut out, x, &offsets, &host_offsets)?;
        Ok(r::sum_chunks_f64(&self.dev.download(&out)?))
    }
    fn sq_sums(&self, xs: &[&Self::Buf]) -> Result<Vec<f64>> {
        let host_offsets: Vec<Vec<i64>> =
            xs.iter().map(|x| r::sumsq_chunk_offsets(x.len())).collect();
        let flat: Vec<i64> = host_offsets.concat();
        let groups: Vec<usize> = host_offsets
            .iter()
            .map(|h| h.len().saturating_sub(1))
            .collect();
        let total: usize = groups.iter().sum();
        if total == 0 {
            return Ok(vec![0.0; xs.len()]);
        }
        let offsets = self.dev.upload("sum of squares offsets", &flat)?;
        let mut out = self.dev.alloc_output::<f32>("sums of squares", total)?;
        ops::sumsq_groups_many(self.dev, &mut out, xs, &offsets, &host_offsets)?;
        let sums = self.dev.download(&out)?;
        let mut at = 0;
        Ok(groups
            .iter()
            .map(|&g| {
                let s = r::sum_chunks_f64(&sums[at..at + g]);
                at += g;
                s
            })
            .collect())
    }
    fn round_bf16(&self, dst: &mut Self::Buf, src: &Self::Buf) -> Result<()> {
        let narrow = to_half::<half::bf16>(self.dev, src)?;
        ops::cast(self.dev, dst, &narrow)
    }
    fn zeros(&self, what: &str, n: usize) -> Result<Self::Buf> {
        self.dev.alloc_zeros(what, n)
    }
    fn output(&self, what: &str, n: usize) -> Result<Self::Buf> {
        self.dev.alloc_output(what, n)
    }
    fn len(&self, b: &Self::Buf) -> usize {
        b.len()
    }
    fn ids(&self, ids: &[i32], vocab: usize) -> Result<DeviceIds> {
        check_ids(ids, vocab)?;
        let EmbeddingRuns {
            uniq,
            starts,
            order,
        } = r::embedding_runs(ids);
        Ok(DeviceIds {
            ids: self.dev.upload("token ids", ids)?,
            runs: ops::DeviceRuns {
                uniq: self.dev.upload("embedding runs", &uniq)?,
                starts: self.dev.upload("embedding runs", &starts)?,
                order: self.dev.upload("embedding runs", &order)?,
            },
            vocab,
        })
    }
    fn matmul(
        &self,
        c: &mut Self::Buf,
        a: &Self::Buf,
        b: &Self::Buf,
        s: MatmulShape,
        beta: f32,
    ) -> Result<()> {
        match self.gemm {
            GemmDtype::F32 => ops::matmul(self.dev, c, a, b, s, 1.0, beta),
            GemmDtype::Bf16 => {
                let (a16, b16) = (to_half(self.dev, a)?, to_half(self.dev, b)?);
                ops::matmul_16_f32::<half::bf16>(self.dev, c, &a16, &b16, s, 1.0, beta)
            }
            GemmDtype::F16 => {
                let (a16, b16) = (to_half(self.dev, a)?, to_half(self.dev, b)?);
                ops::matmul_16_f32::<half::f16>(self.dev, c, &a16, &b16, s, 1.0, beta)
            }
        }
    }
    fn bias_add(&self, y: &mut Self::Buf, b: &Self::Buf) -> Result<()> {
        ops::bias_add(self.dev, y, b)
    }
    fn bias_grad(&self, db: &mut Self::Buf, dy: &Self::Buf) -> Result<()> {
        ops::bias_grad(self.dev, db, dy)
    }
    fn layernorm_fwd(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        b: &Self::Buf,
        cols: usize,
        eps: f32,
    ) -> Result<[Self::Buf; 3]> {
        let rows = x.len() / cols.max(1);
        let mut y = self.dev.alloc_output("layernorm output", x.len())?;
        let mut mean = self.dev.alloc_output("layernorm mean", rows)?;
        let mut rstd = self.dev.alloc_output("layernorm rstd", rows)?;
        let out = NormOut {
            y: &mut y,
            mean: Some(&mut mean),
            rstd: &mut rstd,
        };
        ops::layernorm_fwd(self.dev, out, x, w, Some(b), cols, eps)?;
        Ok([y, mean, rstd])
    }
    fn layernorm_bwd(
        &self,
        dy: &Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        [mean, rstd]: [&Self::Buf; 2],
        dw: &mut Self::Buf,
        db: &mut Self::Buf,
        cols: usize,
    ) -> Result<Self::Buf> {
        let stats = NormStats {
            mean: Some(mean),
            rstd,
        };
        ops::layernorm_bwd_wb(self.dev, dw, Some(db), dy, x, stats, cols)?;
        fresh(self.dev, "layernorm dx", x.len(), |o| {
            ops::layernorm_bwd_dx(self.dev, o, dy, x, w, stats, cols)
        })
    }
    fn softmax_causal_fwd(&self, s: &Self::Buf, seq: usize, scale: f32) -> Result<Self::Buf> {
        fresh(self.dev, "attention probabilities", s.len(), |o| {
            ops::softmax_causal_fwd(self.dev, o, s, seq, scale)
        })
    }
    fn softmax_bwd(
        &self,
        p: &Self::Buf,
        dp: &Self::Buf,
        seq: usize,
        scale: f32,
    ) -> Result<Self::Buf> {
        fresh(self.dev, "score gradient", p.len(), |o| {
            ops::softmax_bwd(self.dev, o, p, dp, seq, scale)
        })
    }
    fn gelu_fwd(&self, x: &Self::Buf) -> Result<Self::Buf> {
        fresh(self.dev, "gelu output", x.len(), |o| {
            ops::gelu_tanh_fwd(self.dev, o, x)
        })
    }
    fn gelu_bwd(&self, dy: &Self::Buf, x: &Self::Buf) -> Result<Self::Buf> {
        fresh(self.dev, "gelu dx", x.len(), |o| {
            ops::gelu_tanh_bwd(self.dev, o, dy, x)
        })
    }
    fn add(&self, a: &Self::Buf, b: &Self::Buf) -> Result<Self::Buf> {
        fresh(self.dev, "sum", a.len(), |o| ops::add(self.dev, o, a, b))
    }
    fn heads_from_rows(&self, x: &Self::Buf, s: HeadsShape, slot: usize) -> Result<Self::Buf> {
        fresh(self.dev, "heads", s.heads_numel(), |o| {
            ops::heads_from_rows(self.dev, o, x, s, slot)
        })
    }
    fn rows_from_heads(
        &self,
        out: &mut Self::Buf,
        x: &Self::Buf,
        s: HeadsShape,
        slot: usize,
    ) -> Result<()> {
        ops::rows_from_heads(self.dev, out, x, s, slot)
    }
    fn embedding_fwd(
        &self,
        table: &Self::Buf,
        ids: &DeviceIds,
        hidden: usize,
    ) -> Result<Self::Buf> {
        fresh(self.dev, "embedding output", ids.ids.len() * hidden, |o| {
            ops::embedding_fwd(self.dev, o, table, &ids.ids, hidden)
        })
    }
    fn embedding_bwd(
        &self,
        grad_table: &mut Self::Buf,
        dy: &Self::Buf,
        ids: &DeviceIds,
        hidden: usize,
    ) -> Result<()> {
        ops::embedding_bwd(self.dev, grad_table, dy, &ids.runs, ids.vocab, hidden)
    }
    fn cross_entropy(
        &self,
        logits: &Self::Buf,
        targets: &DeviceIds,
        vocab: usize,
        grad_scale: f32,
    ) -> Result<(f32, Self::Buf)> {
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
        let t = self.dev.download(&total)?;
        Ok((t.first().copied().unwrap_or(f32::NAN), dlogits))
    }
}

//! The CUDA executor: [`Exec`] on a [`Device`], every operation a kernel
//! of [`crate::ops`] or a cuBLAS GEMM on its compute stream.

use super::{check_ids, Exec};
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

/// A new device buffer of `n` elements for `what`, written by `op`.
fn fresh(
    dev: &Device,
    what: &str,
    n: usize,
    op: impl FnOnce(&mut DeviceBuffer<f32>) -> Result<()>,
) -> Result<DeviceBuffer<f32>> {
    let mut b = dev.alloc_zeros(what, n)?;
    op(&mut b)?;
    Ok(b)
}

impl Exec for Device {
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
        let mut y = self.alloc_zeros("rmsnorm output", x.len())?;
        let mut rstd = self.alloc_zeros("rmsnorm rstd", rows)?;
        let out = NormOut {
            y: &mut y,
            mean: None,
            rstd: &mut rstd,
        };
        ops::rmsnorm_fwd(self, out, x, w, cols, eps)?;
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
        ops::rmsnorm_bwd_w(self, dw, dy, x, rstd, cols)?;
        fresh(self, "rmsnorm dx", x.len(), |o| {
            ops::rmsnorm_bwd_dx(self, o, dy, x, w, rstd, cols)
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
        fresh(self, "rotated", x.len(), |o| {
            ops::rope(self, o, x, cos, sin, s, sign)
        })
    }
    fn swiglu_fwd(&self, gate: &Self::Buf, up: &Self::Buf) -> Result<Self::Buf> {
        fresh(self, "swiglu output", gate.len(), |o| {
            ops::swiglu_fwd(self, o, gate, up)
        })
    }
    fn swiglu_bwd(
        &self,
        dy: &Self::Buf,
        gate: &Self::Buf,
        up: &Self::Buf,
    ) -> Result<[Self::Buf; 2]> {
        let mut dg = self.alloc_zeros("swiglu dgate", gate.len())?;
        let mut du = self.alloc_zeros("swiglu dup", up.len())?;
        ops::swiglu_bwd(self, &mut dg, &mut du, dy, gate, up)?;
        Ok([dg, du])
    }
    fn repeat_kv(&self, x: &Self::Buf, s: KvShape) -> Result<Self::Buf> {
        fresh(self, "repeated kv", x.len() * s.group, |o| {
            ops::repeat_kv(self, o, x, s)
        })
    }
    fn sum_kv(&self, x: &Self::Buf, s: KvShape) -> Result<Self::Buf> {
        fresh(self, "kv gradient", x.len() / s.group.max(1), |o| {
            ops::sum_kv(self, o, x, s)
        })
    }
    fn upload(&self, what: &str, v: &[f32]) -> Result<Self::Buf> {
        Device::upload(self, what, v)
    }
    fn download(&self, b: &Self::Buf) -> Result<Vec<f32>> {
        Device::download(self, b)
    }
    fn fill_zero(&self, b: &mut Self::Buf) -> Result<()> {
        self.zero(b)
    }
    fn adamw(
        &self,
        [master, m, v]: [&mut Self::Buf; 3],
        grad: &Self::Buf,
        s: AdamScalars,
    ) -> Result<()> {
        ops::adamw::<f32>(self, AdamState { master, m, v }, grad, None, s)
    }

    fn zeros(&self, what: &str, n: usize) -> Result<Self::Buf> {
        self.alloc_zeros(what, n)
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
            ids: self.upload("token ids", ids)?,
            runs: ops::DeviceRuns {
                uniq: self.upload("embedding runs", &uniq)?,
                starts: self.upload("embedding runs", &starts)?,
                order: self.upload("embedding runs", &order)?,
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
        ops::matmul(self, c, a, b, s, 1.0, beta)
    }
    fn bias_add(&self, y: &mut Self::Buf, b: &Self::Buf) -> Result<()> {
        ops::bias_add(self, y, b)
    }
    fn bias_grad(&self, db: &mut Self::Buf, dy: &Self::Buf) -> Result<()> {
        ops::bias_grad(self, db, dy)
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
        let mut y = self.alloc_zeros("layernorm output", x.len())?;
        let mut mean = self.alloc_zeros("layernorm mean", rows)?;
        let mut rstd = self.alloc_zeros("layernorm rstd", rows)?;
        let out = NormOut {
            y: &mut y,
            mean: Some(&mut mean),
            rstd: &mut rstd,
        };
        ops::layernorm_fwd(self, out, x, w, Some(b), cols, eps)?;
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
        ops::layernorm_bwd_wb(self, dw, Some(db), dy, x, stats, cols)?;
        fresh(self, "layernorm dx", x.len(), |o| {
            ops::layernorm_bwd_dx(self, o, dy, x, w, stats, cols)
        })
    }
    fn softmax_causal_fwd(&self, s: &Self::Buf, seq: usize, scale: f32) -> Result<Self::Buf> {
        fresh(self, "attention probabilities", s.len(), |o| {
            ops::softmax_causal_fwd(self, o, s, seq, scale)
        })
    }
    fn softmax_bwd(
        &self,
        p: &Self::Buf,
        dp: &Self::Buf,
        seq: usize,
        scale: f32,
    ) -> Result<Self::Buf> {
        fresh(self, "score gradient", p.len(), |o| {
            ops::softmax_bwd(self, o, p, dp, seq, scale)
        })
    }
    fn gelu_fwd(&self, x: &Self::Buf) -> Result<Self::Buf> {
        fresh(self, "gelu output", x.len(), |o| {
            ops::gelu_tanh_fwd(self, o, x)
        })
    }
    fn gelu_bwd(&self, dy: &Self::Buf, x: &Self::Buf) -> Result<Self::Buf> {
        fresh(self, "gelu dx", x.len(), |o| {
            ops::gelu_tanh_bwd(self, o, dy, x)
        })
    }
    fn add(&self, a: &Self::Buf, b: &Self::Buf) -> Result<Self::Buf> {
        fresh(self, "sum", a.len(), |o| ops::add(self, o, a, b))
    }
    fn heads_from_rows(&self, x: &Self::Buf, s: HeadsShape, slot: usize) -> Result<Self::Buf> {
        fresh(self, "heads", s.heads_numel(), |o| {
            ops::heads_from_rows(self, o, x, s, slot)
        })
    }
    fn rows_from_heads(
        &self,
        out: &mut Self::Buf,
        x: &Self::Buf,
        s: HeadsShape,
        slot: usize,
    ) -> Result<()> {
        ops::rows_from_heads(self, out, x, s, slot)
    }
    fn embedding_fwd(
        &self,
        table: &Self::Buf,
        ids: &DeviceIds,
        hidden: usize,
    ) -> Result<Self::Buf> {
        fresh(self, "embedding output", ids.ids.len() * hidden, |o| {
            ops::embedding_fwd(self, o, table, &ids.ids, hidden)
        })
    }
    fn embedding_bwd(
        &self,
        grad_table: &mut Self::Buf,
        dy: &Self::Buf,
        ids: &DeviceIds,
        hidden: usize,
    ) -> Result<()> {
        ops::embedding_bwd(self, grad_table, dy, &ids.runs, ids.vocab, hidden)
    }
    fn cross_entropy(
        &self,
        logits: &Self::Buf,
        targets: &DeviceIds,
        vocab: usize,
        grad_scale: f32,
    ) -> Result<(f32, Self::Buf)> {
        let rows = targets.ids.len();
        let mut loss_rows = self.alloc_zeros("loss rows", rows)?;
        let mut dlogits = self.alloc_zeros("logit gradient", logits.len())?;
        ops::cross_entropy(
            self,
            &mut loss_rows,
            Some(&mut dlogits),
            logits,
            &targets.ids,
            vocab,
            -100,
            grad_scale,
        )?;
        let mut total = self.alloc_zeros("loss", 1)?;
        ops::sum_f32(self, &mut total, &loss_rows)?;
        let t = self.download(&total)?;
        Ok((t.first().copied().unwrap_or(f32::NAN), dlogits))
    }
}

//! The GPT-2 units (embedding, block, head) written once, forward and
//! backward, over an [`Exec`]: the operations of [`crate::ops`] on some
//! buffers. Two executors run the same code:
//!
//! * [`HostExec`]: host `Vec<f32>`s through [`crate::reference`], each
//!   kernel's scalar reference. `tests/gpu_units.rs` (main crate) runs a
//!   whole model through it and checks loss and every gradient against the
//!   candle units, so the algorithm (the shapes, the order, the backward's
//!   derivation) is checked without a GPU;
//! * [`Device`]: the same calls as CUDA kernels and cuBLAS GEMMs, each
//!   checked against its reference by the device check.
//!
//! Backward recomputes the unit's forward from its saved input (as the CPU
//! units do), keeping the intermediates it needs, then runs the chain rule
//! by hand. Parameter gradients are accumulated (`+=`), so a tied
//! embedding's two units add into one buffer, and so do micro-batches.
//! Storage is fp32 here (bf16 and fp16 units are the next step: they need
//! GEMMs with fp32 outputs for the gradients).

use crate::device::{Device, DeviceBuffer};
use crate::ops::{self, AdamState, MatmulShape, NormOut, NormStats};
use crate::reference::{self as r, AdamScalars, EmbeddingRuns, HeadsShape};
use crate::{GpuError, Result};

/// What a unit needs of its buffers' executor.
pub trait Exec {
    /// An fp32 buffer.
    type Buf;
    /// `n` zeros.
    fn zeros(&self, what: &str, n: usize) -> Result<Self::Buf>;
    /// A buffer's elements.
    fn len(&self, b: &Self::Buf) -> usize;
    /// Token ids (or positions) and their [`EmbeddingRuns`] on this executor.
    type Ids;
    /// Uploads `ids` (checked below `vocab`).
    fn ids(&self, ids: &[i32], vocab: usize) -> Result<Self::Ids>;
    /// [`ops::matmul`].
    fn matmul(
        &self,
        c: &mut Self::Buf,
        a: &Self::Buf,
        b: &Self::Buf,
        s: MatmulShape,
        beta: f32,
    ) -> Result<()>;
    /// [`ops::bias_add`].
    fn bias_add(&self, y: &mut Self::Buf, b: &Self::Buf) -> Result<()>;
    /// [`ops::bias_grad`].
    fn bias_grad(&self, db: &mut Self::Buf, dy: &Self::Buf) -> Result<()>;
    /// [`ops::layernorm_fwd`]: `(y, mean, rstd)`.
    fn layernorm_fwd(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        b: &Self::Buf,
        cols: usize,
        eps: f32,
    ) -> Result<[Self::Buf; 3]>;
    /// [`ops::layernorm_bwd_dx`] and [`ops::layernorm_bwd_wb`]: returns dx,
    /// adds into dw and db.
    #[allow(clippy::too_many_arguments)]
    fn layernorm_bwd(
        &self,
        dy: &Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        stats: [&Self::Buf; 2],
        dw: &mut Self::Buf,
        db: &mut Self::Buf,
        cols: usize,
    ) -> Result<Self::Buf>;
    /// [`ops::softmax_causal_fwd`].
    fn softmax_causal_fwd(&self, s: &Self::Buf, seq: usize, scale: f32) -> Result<Self::Buf>;
    /// [`ops::softmax_bwd`].
    fn softmax_bwd(
        &self,
        p: &Self::Buf,
        dp: &Self::Buf,
        seq: usize,
        scale: f32,
    ) -> Result<Self::Buf>;
    /// [`ops::gelu_tanh_fwd`].
    fn gelu_fwd(&self, x: &Self::Buf) -> Result<Self::Buf>;
    /// [`ops::gelu_tanh_bwd`].
    fn gelu_bwd(&self, dy: &Self::Buf, x: &Self::Buf) -> Result<Self::Buf>;
    /// [`ops::add`].
    fn add(&self, a: &Self::Buf, b: &Self::Buf) -> Result<Self::Buf>;
    /// [`ops::heads_from_rows`].
    fn heads_from_rows(&self, x: &Self::Buf, s: HeadsShape, slot: usize) -> Result<Self::Buf>;
    /// [`ops::rows_from_heads`] (into `out`).
    fn rows_from_heads(
        &self,
        out: &mut Self::Buf,
        x: &Self::Buf,
        s: HeadsShape,
        slot: usize,
    ) -> Result<()>;
    /// [`ops::embedding_fwd`].
    fn embedding_fwd(&self, table: &Self::Buf, ids: &Self::Ids, hidden: usize)
        -> Result<Self::Buf>;
    /// [`ops::embedding_bwd`] (adds into `grad_table`).
    fn embedding_bwd(
        &self,
        grad_table: &mut Self::Buf,
        dy: &Self::Buf,
        ids: &Self::Ids,
        hidden: usize,
    ) -> Result<()>;
    /// A copy of `v` on this executor.
    fn upload(&self, what: &str, v: &[f32]) -> Result<Self::Buf>;
    /// A buffer's values on the host.
    fn download(&self, b: &Self::Buf) -> Result<Vec<f32>>;
    /// Zeroes a buffer in place.
    fn fill_zero(&self, b: &mut Self::Buf) -> Result<()>;
    /// [`ops::adamw`] on `[master, m, v]`.
    fn adamw(&self, st: [&mut Self::Buf; 3], grad: &Self::Buf, s: AdamScalars) -> Result<()>;
    /// [`ops::cross_entropy`] and the sum of its rows: `(total loss, dlogits)`
    /// with `dlogits` scaled by `grad_scale`.
    fn cross_entropy(
        &self,
        logits: &Self::Buf,
        targets: &Self::Ids,
        vocab: usize,
        grad_scale: f32,
    ) -> Result<(f32, Self::Buf)>;
}

/// The host executor: every operation is its kernel's scalar reference.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostExec;

/// Ids on the host, with their embedding runs.
#[derive(Debug, Clone)]
pub struct HostIds {
    ids: Vec<i32>,
}

fn check_ids(ids: &[i32], vocab: usize) -> Result<()> {
    match ids.iter().find(|&&i| i < 0 || i as usize >= vocab) {
        Some(bad) => Err(GpuError::Shape {
            kernel: "embedding".into(),
            detail: format!("token id {bad} is outside the vocabulary of {vocab}"),
        }),
        None => Ok(()),
    }
}

impl Exec for HostExec {
    type Buf = Vec<f32>;
    type Ids = HostIds;

    fn upload(&self, _: &str, v: &[f32]) -> Result<Vec<f32>> {
        Ok(v.to_vec())
    }
    fn download(&self, b: &Vec<f32>) -> Result<Vec<f32>> {
        Ok(b.clone())
    }
    fn fill_zero(&self, b: &mut Vec<f32>) -> Result<()> {
        b.fill(0.0);
        Ok(())
    }
    fn adamw(
        &self,
        [master, m, v]: [&mut Vec<f32>; 3],
        grad: &Vec<f32>,
        s: AdamScalars,
    ) -> Result<()> {
        r::adamw::<f32>(master, m, v, grad, None, s);
        Ok(())
    }

    fn zeros(&self, _: &str, n: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; n])
    }
    fn len(&self, b: &Vec<f32>) -> usize {
        b.len()
    }
    fn ids(&self, ids: &[i32], vocab: usize) -> Result<HostIds> {
        check_ids(ids, vocab)?;
        Ok(HostIds { ids: ids.to_vec() })
    }
    fn matmul(
        &self,
        c: &mut Vec<f32>,
        a: &Vec<f32>,
        b: &Vec<f32>,
        s: MatmulShape,
        beta: f32,
    ) -> Result<()> {
        r::matmul(
            c,
            a,
            b,
            s.batch,
            (s.m, s.n, s.k),
            (s.trans_a, s.trans_b),
            1.0,
            beta,
        );
        Ok(())
    }
    fn bias_add(&self, y: &mut Vec<f32>, b: &Vec<f32>) -> Result<()> {
        r::bias_add(y, b);
        Ok(())
    }
    fn bias_grad(&self, db: &mut Vec<f32>, dy: &Vec<f32>) -> Result<()> {
        r::bias_grad(db, dy);
        Ok(())
    }
    fn layernorm_fwd(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        b: &Vec<f32>,
        cols: usize,
        eps: f32,
    ) -> Result<[Vec<f32>; 3]> {
        let (y, m, s) = r::layernorm_fwd(x, w, Some(b), cols, eps);
        Ok([y, m, s])
    }
    fn layernorm_bwd(
        &self,
        dy: &Vec<f32>,
        x: &Vec<f32>,
        w: &Vec<f32>,
        [mean, rstd]: [&Vec<f32>; 2],
        dw: &mut Vec<f32>,
        db: &mut Vec<f32>,
        cols: usize,
    ) -> Result<Vec<f32>> {
        r::layernorm_bwd_wb(dw, Some(db), dy, x, mean, rstd, cols);
        Ok(r::layernorm_bwd_dx(dy, x, w, mean, rstd, cols))
    }
    fn softmax_causal_fwd(&self, s: &Vec<f32>, seq: usize, scale: f32) -> Result<Vec<f32>> {
        Ok(r::softmax_causal_fwd(s, seq, scale))
    }
    fn softmax_bwd(&self, p: &Vec<f32>, dp: &Vec<f32>, seq: usize, scale: f32) -> Result<Vec<f32>> {
        Ok(r::softmax_bwd(p, dp, seq, scale))
    }
    fn gelu_fwd(&self, x: &Vec<f32>) -> Result<Vec<f32>> {
        Ok(r::gelu_tanh_fwd(x))
    }
    fn gelu_bwd(&self, dy: &Vec<f32>, x: &Vec<f32>) -> Result<Vec<f32>> {
        Ok(r::gelu_tanh_bwd(dy, x))
    }
    fn add(&self, a: &Vec<f32>, b: &Vec<f32>) -> Result<Vec<f32>> {
        Ok(r::add(a, b))
    }
    fn heads_from_rows(&self, x: &Vec<f32>, s: HeadsShape, slot: usize) -> Result<Vec<f32>> {
        Ok(r::heads_from_rows(x, s, slot))
    }
    fn rows_from_heads(
        &self,
        out: &mut Vec<f32>,
        x: &Vec<f32>,
        s: HeadsShape,
        slot: usize,
    ) -> Result<()> {
        r::rows_from_heads(out, x, s, slot);
        Ok(())
    }
    fn embedding_fwd(&self, table: &Vec<f32>, ids: &HostIds, hidden: usize) -> Result<Vec<f32>> {
        Ok(r::embedding_fwd(table, &ids.ids, hidden))
    }
    fn embedding_bwd(
        &self,
        grad_table: &mut Vec<f32>,
        dy: &Vec<f32>,
        ids: &HostIds,
        hidden: usize,
    ) -> Result<()> {
        r::embedding_bwd(grad_table, dy, &ids.ids, hidden);
        Ok(())
    }
    fn cross_entropy(
        &self,
        logits: &Vec<f32>,
        targets: &HostIds,
        vocab: usize,
        grad_scale: f32,
    ) -> Result<(f32, Vec<f32>)> {
        let (rows, grad) = r::cross_entropy(logits, &targets.ids, vocab, -100, Some(grad_scale));
        Ok((r::sum_f32(&rows), grad.unwrap_or_default()))
    }
}

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

/// A GPT-2's dimensions for its units.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gpt2Dims {
    /// Sequences per micro-batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Attention heads.
    pub heads: usize,
    /// MLP inner size.
    pub inner: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// LayerNorm epsilon.
    pub eps: f32,
}

impl Gpt2Dims {
    fn rows(&self) -> usize {
        self.batch * self.seq
    }
    fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }
    fn heads_shape(&self, slots: usize) -> HeadsShape {
        HeadsShape {
            batch: self.batch,
            seq: self.seq,
            heads: self.heads,
            head_dim: self.head_dim(),
            slots,
        }
    }
    /// `x [rows, k] @ w [k, n]` (HF Conv1D layout).
    fn conv(&self, k: usize, n: usize) -> MatmulShape {
        MatmulShape {
            batch: 1,
            m: self.rows(),
            n,
            k,
            trans_a: false,
            trans_b: false,
        }
    }
}

fn mm(batch: usize, m: usize, n: usize, k: usize, trans_a: bool, trans_b: bool) -> MatmulShape {
    MatmulShape {
        batch,
        m,
        n,
        k,
        trans_a,
        trans_b,
    }
}

/// `x @ w + b` with `w` in Conv1D layout [k, n].
fn conv1d<E: Exec>(
    e: &E,
    d: &Gpt2Dims,
    x: &E::Buf,
    w: &E::Buf,
    b: &E::Buf,
    k: usize,
    n: usize,
) -> Result<E::Buf> {
    let mut y = e.zeros("linear output", d.rows() * n)?;
    e.matmul(&mut y, x, w, d.conv(k, n), 0.0)?;
    e.bias_add(&mut y, b)?;
    Ok(y)
}

/// Backward of [`conv1d`]: adds `xᵀ dy` into `dw` and `Σ dy` into `db`,
/// returns `dy wᵀ`.
#[allow(clippy::too_many_arguments)]
fn conv1d_bwd<E: Exec>(
    e: &E,
    d: &Gpt2Dims,
    dy: &E::Buf,
    x: &E::Buf,
    w: &E::Buf,
    grads: (&mut E::Buf, &mut E::Buf),
    k: usize,
    n: usize,
) -> Result<E::Buf> {
    let rows = d.rows();
    e.matmul(grads.0, x, dy, mm(1, k, n, rows, true, false), 1.0)?;
    e.bias_grad(grads.1, dy)?;
    let mut dx = e.zeros("linear dx", rows * k)?;
    e.matmul(&mut dx, dy, w, mm(1, rows, k, n, false, true), 0.0)?;
    Ok(dx)
}

/// What a block's forward keeps for its backward.
struct BlockSaved<B> {
    ln1: [B; 3],
    qkv: B,
    q: B,
    k: B,
    v: B,
    p: B,
    y: B,
    x1: B,
    ln2: [B; 3],
    fc: B,
    g: B,
    out: B,
}

fn block_forward_saving<E: Exec>(
    e: &E,
    d: &Gpt2Dims,
    p: &[E::Buf],
    x: &E::Buf,
) -> Result<BlockSaved<E::Buf>> {
    let (h, inner, hd) = (d.hidden, d.inner, d.head_dim());
    let bh = d.batch * d.heads;
    let ln1 = e.layernorm_fwd(x, &p[0], &p[1], h, d.eps)?;
    let qkv = conv1d(e, d, &ln1[0], &p[2], &p[3], h, 3 * h)?;
    let hs = d.heads_shape(3);
    let (q, k, v) = (
        e.heads_from_rows(&qkv, hs, 0)?,
        e.heads_from_rows(&qkv, hs, 1)?,
        e.heads_from_rows(&qkv, hs, 2)?,
    );
    let mut s = e.zeros("attention scores", bh * d.seq * d.seq)?;
    e.matmul(&mut s, &q, &k, mm(bh, d.seq, d.seq, hd, false, true), 0.0)?;
    let scale = 1.0 / (hd as f32).sqrt();
    let pr = e.softmax_causal_fwd(&s, d.seq, scale)?;
    let mut o = e.zeros("attention output", bh * d.seq * hd)?;
    e.matmul(&mut o, &pr, &v, mm(bh, d.seq, hd, d.seq, false, false), 0.0)?;
    let mut y = e.zeros("attention rows", d.rows() * h)?;
    e.rows_from_heads(&mut y, &o, d.heads_shape(1), 0)?;
    let attn = conv1d(e, d, &y, &p[4], &p[5], h, h)?;
    let x1 = e.add(x, &attn)?;
    let ln2 = e.layernorm_fwd(&x1, &p[6], &p[7], h, d.eps)?;
    let fc = conv1d(e, d, &ln2[0], &p[8], &p[9], h, inner)?;
    let g = e.gelu_fwd(&fc)?;
    let mo = conv1d(e, d, &g, &p[10], &p[11], inner, h)?;
    let out = e.add(&x1, &mo)?;
    Ok(BlockSaved {
        ln1,
        qkv,
        q,
        k,
        v,
        p: pr,
        y,
        x1,
        ln2,
        fc,
        g,
        out,
    })
}

fn check_params<E: Exec>(e: &E, unit: &str, p: &[E::Buf], want: &[usize]) -> Result<()> {
    if p.len() != want.len() {
        return Err(GpuError::Shape {
            kernel: unit.into(),
            detail: format!("{} params, the unit has {}", p.len(), want.len()),
        });
    }
    for (i, (b, &n)) in p.iter().zip(want).enumerate() {
        if e.len(b) != n {
            return Err(GpuError::Shape {
                kernel: unit.into(),
                detail: format!("param {i} has {} elements, want {n}", e.len(b)),
            });
        }
    }
    Ok(())
}

fn block_param_numel(d: &Gpt2Dims) -> [usize; 12] {
    let (h, i) = (d.hidden, d.inner);
    [h, h, h * 3 * h, 3 * h, h * h, h, h, h, h * i, i, i * h, h]
}

/// A GPT-2 block's output `[batch, seq, hidden]` (params in the CPU unit's
/// order: ln_1 w, b; c_attn w, b; attn c_proj w, b; ln_2 w, b; c_fc w, b;
/// mlp c_proj w, b).
pub fn gpt2_block_forward<E: Exec>(
    e: &E,
    d: &Gpt2Dims,
    p: &[E::Buf],
    x: &E::Buf,
) -> Result<E::Buf> {
    check_params(e, "gpt2 block", p, &block_param_numel(d))?;
    Ok(block_forward_saving(e, d, p, x)?.out)
}

/// A GPT-2 block's backward by recompute from its input `x`: adds the
/// param gradients into `grads` (same order and sizes as the params) and
/// returns the input's gradient.
pub fn gpt2_block_backward<E: Exec>(
    e: &E,
    d: &Gpt2Dims,
    p: &[E::Buf],
    x: &E::Buf,
    dout: &E::Buf,
    grads: &mut [E::Buf],
) -> Result<E::Buf> {
    let numel = block_param_numel(d);
    check_params(e, "gpt2 block", p, &numel)?;
    check_params(e, "gpt2 block gradients", grads, &numel)?;
    let (h, inner, hd) = (d.hidden, d.inner, d.head_dim());
    let bh = d.batch * d.heads;
    let s = block_forward_saving(e, d, p, x)?;
    let [g0, g1, g2, g3, g4, g5, g6, g7, g8, g9, g10, g11] = grads else {
        return Err(GpuError::Shape {
            kernel: "gpt2 block".into(),
            detail: "12 gradient buffers".into(),
        });
    };
    // MLP.
    let dg = conv1d_bwd(e, d, dout, &s.g, &p[10], (g10, g11), inner, h)?;
    let dfc = e.gelu_bwd(&dg, &s.fc)?;
    let dm = conv1d_bwd(e, d, &dfc, &s.ln2[0], &p[8], (g8, g9), h, inner)?;
    let dx1_ln = e.layernorm_bwd(&dm, &s.x1, &p[6], [&s.ln2[1], &s.ln2[2]], g6, g7, h)?;
    let dx1 = e.add(dout, &dx1_ln)?;
    // Attention.
    let dy = conv1d_bwd(e, d, &dx1, &s.y, &p[4], (g4, g5), h, h)?;
    let do_ = e.heads_from_rows(&dy, d.heads_shape(1), 0)?;
    let mut dp = e.zeros("probability gradient", bh * d.seq * d.seq)?;
    e.matmul(
        &mut dp,
        &do_,
        &s.v,
        mm(bh, d.seq, d.seq, hd, false, true),
        0.0,
    )?;
    let mut dv = e.zeros("v gradient", bh * d.seq * hd)?;
    e.matmul(
        &mut dv,
        &s.p,
        &do_,
        mm(bh, d.seq, hd, d.seq, true, false),
        0.0,
    )?;
    let scale = 1.0 / (hd as f32).sqrt();
    let ds = e.softmax_bwd(&s.p, &dp, d.seq, scale)?;
    let mut dq = e.zeros("q gradient", bh * d.seq * hd)?;
    e.matmul(
        &mut dq,
        &ds,
        &s.k,
        mm(bh, d.seq, hd, d.seq, false, false),
        0.0,
    )?;
    let mut dk = e.zeros("k gradient", bh * d.seq * hd)?;
    e.matmul(
        &mut dk,
        &ds,
        &s.q,
        mm(bh, d.seq, hd, d.seq, true, false),
        0.0,
    )?;
    let mut dqkv = e.zeros("qkv gradient", d.rows() * 3 * h)?;
    let hs = d.heads_shape(3);
    e.rows_from_heads(&mut dqkv, &dq, hs, 0)?;
    e.rows_from_heads(&mut dqkv, &dk, hs, 1)?;
    e.rows_from_heads(&mut dqkv, &dv, hs, 2)?;
    let da = conv1d_bwd(e, d, &dqkv, &s.ln1[0], &p[2], (g2, g3), h, 3 * h)?;
    let dx_ln = e.layernorm_bwd(&da, x, &p[0], [&s.ln1[1], &s.ln1[2]], g0, g1, h)?;
    drop(s.qkv);
    e.add(&dx1, &dx_ln)
}

/// GPT-2's embedding: `wte[ids] + wpe[positions]` (params: wte, wpe).
pub fn gpt2_embedding_forward<E: Exec>(
    e: &E,
    d: &Gpt2Dims,
    p: &[E::Buf],
    ids: &E::Ids,
    positions: &E::Ids,
) -> Result<E::Buf> {
    let tok = e.embedding_fwd(&p[0], ids, d.hidden)?;
    let pos = e.embedding_fwd(&p[1], positions, d.hidden)?;
    e.add(&tok, &pos)
}

/// The embedding's backward: adds into `grads` (wte, wpe).
pub fn gpt2_embedding_backward<E: Exec>(
    e: &E,
    d: &Gpt2Dims,
    dout: &E::Buf,
    ids: &E::Ids,
    positions: &E::Ids,
    grads: &mut [E::Buf],
) -> Result<()> {
    let [gw, gp] = grads else {
        return Err(GpuError::Shape {
            kernel: "gpt2 embedding".into(),
            detail: "2 gradient buffers".into(),
        });
    };
    e.embedding_bwd(gw, dout, ids, d.hidden)?;
    e.embedding_bwd(gp, dout, positions, d.hidden)
}

/// The head (params ln_f w, b, then the [vocab, hidden] output matrix):
/// the mean cross-entropy of `targets`, and with `loss_scale` its
/// backward: adds into `grads` (same order), returns the hidden input's
/// gradient.
pub fn gpt2_head<E: Exec>(
    e: &E,
    d: &Gpt2Dims,
    p: [&E::Buf; 3],
    x: &E::Buf,
    targets: &E::Ids,
    loss_scale: f32,
    grads: [&mut E::Buf; 3],
) -> Result<(f32, E::Buf)> {
    let (h, v, rows) = (d.hidden, d.vocab, d.rows());
    for (i, (b, n)) in p.iter().zip([h, h, v * h]).enumerate() {
        if e.len(b) != n || e.len(&*grads[i]) != n {
            return Err(GpuError::Shape {
                kernel: "gpt2 head".into(),
                detail: format!("param {i} or its gradient is not {n} elements"),
            });
        }
    }
    let ln = e.layernorm_fwd(x, p[0], p[1], h, d.eps)?;
    let mut logits = e.zeros("logits", rows * v)?;
    e.matmul(
        &mut logits,
        &ln[0],
        p[2],
        mm(1, rows, v, h, false, true),
        0.0,
    )?;
    let (total, dlogits) = e.cross_entropy(&logits, targets, v, loss_scale / rows as f32)?;
    let [g0, g1, g2] = grads;
    e.matmul(g2, &dlogits, &ln[0], mm(1, v, h, rows, true, false), 1.0)?;
    let mut dn = e.zeros("head dx", rows * h)?;
    e.matmul(
        &mut dn,
        &dlogits,
        p[2],
        mm(1, rows, h, v, false, false),
        0.0,
    )?;
    let dx = e.layernorm_bwd(&dn, x, p[0], [&ln[1], &ln[2]], g0, g1, h)?;
    Ok((total / rows as f32, dx))
}

/// AdamW's hyper-parameters for [`Gpt2Trainer`] (torch's defaults but
/// the learning rate).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamHyper {
    /// Learning rate.
    pub lr: f64,
    /// β1, β2.
    pub betas: (f64, f64),
    /// ε.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

impl AdamHyper {
    /// The f32 constants of step `t` (1-based), as the CPU kernel derives
    /// them.
    pub fn scalars(&self, t: u64) -> AdamScalars {
        let (b1, b2) = self.betas;
        let tf = t as f64;
        AdamScalars {
            grad_scale: 1.0,
            beta1: b1 as f32,
            one_minus_beta1: (1.0 - b1) as f32,
            beta2: b2 as f32,
            one_minus_beta2: (1.0 - b2) as f32,
            eps: self.eps as f32,
            neg_step_size: (-self.lr / (1.0 - b1.powf(tf))) as f32,
            inv_sqrt_bc2: (1.0 / (1.0 - b2.powf(tf)).sqrt()) as f32,
            neg_lr_wd: (-self.lr * self.weight_decay) as f32,
        }
    }
}

/// A whole GPT-2 (tied embeddings) trained in memory on one executor:
/// the units above in the engine's order (forward saving each block's
/// input, backward head first) and AdamW on every param. Params are
/// `[wte, wpe, 12 per block..., ln_f w, ln_f b]`.
pub struct Gpt2Trainer<'e, E: Exec> {
    e: &'e E,
    d: Gpt2Dims,
    layers: usize,
    params: Vec<E::Buf>,
    grads: Vec<E::Buf>,
    m: Vec<E::Buf>,
    v: Vec<E::Buf>,
    step: u64,
    hyper: AdamHyper,
}

impl<E: Exec> std::fmt::Debug for Gpt2Trainer<'_, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpt2Trainer")
            .field("dims", &self.d)
            .field("layers", &self.layers)
            .field("step", &self.step)
            .finish_non_exhaustive()
    }
}

impl<'e, E: Exec> Gpt2Trainer<'e, E> {
    /// Elements of each param, in order (`max_seq` positions).
    pub fn param_numel(d: &Gpt2Dims, layers: usize, max_seq: usize) -> Vec<usize> {
        let mut n = vec![d.vocab * d.hidden, max_seq * d.hidden];
        for _ in 0..layers {
            n.extend(block_param_numel(d));
        }
        n.extend([d.hidden, d.hidden]);
        n
    }

    /// A trainer over `init` (one vector per param, [`Self::param_numel`]).
    pub fn new(
        e: &'e E,
        d: Gpt2Dims,
        layers: usize,
        init: &[Vec<f32>],
        hyper: AdamHyper,
    ) -> Result<Self> {
        let up = |what: &str| -> Result<Vec<E::Buf>> {
            init.iter().map(|v| e.zeros(what, v.len())).collect()
        };
        let (grads, m, v) = (up("gradients")?, up("adam m")?, up("adam v")?);
        let params = init
            .iter()
            .map(|p| e.upload("params", p))
            .collect::<Result<Vec<_>>>()?;
        Ok(Gpt2Trainer {
            e,
            d,
            layers,
            params,
            grads,
            m,
            v,
            step: 0,
            hyper,
        })
    }

    fn block_range(&self, layer: usize) -> std::ops::Range<usize> {
        2 + 12 * layer..2 + 12 * (layer + 1)
    }

    /// One step on `ids` / `targets` (`batch × seq` each): returns the
    /// mean loss before the update.
    pub fn step(&mut self, ids: &[i32], targets: &[i32]) -> Result<f32> {
        let (e, d) = (self.e, self.d);
        let ids = e.ids(ids, d.vocab)?;
        let targets = e.ids(targets, d.vocab)?;
        let pos: Vec<i32> = (0..d.batch * d.seq).map(|i| (i % d.seq) as i32).collect();
        let max_seq = e.len(&self.params[1]) / d.hidden.max(1);
        let positions = e.ids(&pos, max_seq)?;
        for g in &mut self.grads {
            e.fill_zero(g)?;
        }
        let mut h = gpt2_embedding_forward(e, &d, &self.params[0..2], &ids, &positions)?;
        let mut saved = Vec::with_capacity(self.layers);
        for l in 0..self.layers {
            let next = gpt2_block_forward(e, &d, &self.params[self.block_range(l)], &h)?;
            saved.push(std::mem::replace(&mut h, next));
        }
        // The head: ln_f (the last two params) and the tied wte (the first).
        let n = self.params.len();
        let head_p = [&self.params[n - 2], &self.params[n - 1], &self.params[0]];
        let (wte_g, rest) = self.grads.split_at_mut(1);
        let [.., lnw_g, lnb_g] = rest else {
            return Err(GpuError::Shape {
                kernel: "gpt2".into(),
                detail: "fewer than 3 params".into(),
            });
        };
        let (loss, mut up) = gpt2_head(
            e,
            &d,
            head_p,
            &h,
            &targets,
            1.0,
            [lnw_g, lnb_g, &mut wte_g[0]],
        )?;
        for l in (0..self.layers).rev() {
            let r = self.block_range(l);
            up = gpt2_block_backward(
                e,
                &d,
                &self.params[r.clone()],
                &saved[l],
                &up,
                &mut self.grads[r],
            )?;
        }
        gpt2_embedding_backward(e, &d, &up, &ids, &positions, &mut self.grads[0..2])?;
        self.step += 1;
        let s = self.hyper.scalars(self.step);
        for (((p, g), m), v) in self
            .params
            .iter_mut()
            .zip(&self.grads)
            .zip(&mut self.m)
            .zip(&mut self.v)
        {
            e.adamw([p, m, v], g, s)?;
        }
        Ok(loss)
    }

    /// The params' values on the host, in order.
    pub fn params(&self) -> Result<Vec<Vec<f32>>> {
        self.params.iter().map(|p| self.e.download(p)).collect()
    }
}

/// A deterministic init for [`Gpt2Trainer`]: weights normal-ish with std
/// 0.02 (a sum of uniforms), norm weights 1, biases 0.
pub fn gpt2_init(d: &Gpt2Dims, layers: usize, max_seq: usize, seed: u64) -> Vec<Vec<f32>> {
    let numel = Gpt2Trainer::<HostExec>::param_numel(d, layers, max_seq);
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut uniform = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    numel
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            // In each block: 0 ln_1 w, 1 b, 2 c_attn w, 3 b, 4 c_proj w, 5 b,
            // 6 ln_2 w, 7 b, 8 c_fc w, 9 b, 10 c_proj w, 11 b; the head's
            // ln_f w, b last.
            let role = if i < 2 {
                2
            } else if i >= numel.len() - 2 {
                (i - (numel.len() - 2)) % 2 + 6
            } else {
                (i - 2) % 12
            };
            match role {
                0 | 6 => vec![1.0; n],
                1 | 3 | 5 | 7 | 9 | 11 => vec![0.0; n],
                _ => (0..n)
                    .map(|_| 0.02 * 2.0 * (uniform() + uniform() + uniform()))
                    .collect(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn dims() -> Gpt2Dims {
        Gpt2Dims {
            batch: 2,
            seq: 8,
            hidden: 16,
            heads: 2,
            inner: 32,
            vocab: 23,
            eps: 1e-5,
        }
    }

    fn run(steps: usize) -> (Vec<f32>, Vec<Vec<f32>>) {
        let d = dims();
        let init = gpt2_init(&d, 2, 8, 3);
        let hyper = AdamHyper {
            lr: 1e-2,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
        };
        let mut t = Gpt2Trainer::new(&HostExec, d, 2, &init, hyper).unwrap();
        // A repeating sequence: learnable.
        let toks: Vec<i32> = (0..d.batch * (d.seq + 1))
            .map(|i| ((i * 5) % 7) as i32)
            .collect();
        let (mut ids, mut targets) = (Vec::new(), Vec::new());
        for b in 0..d.batch {
            let row = &toks[b * (d.seq + 1)..(b + 1) * (d.seq + 1)];
            ids.extend_from_slice(&row[..d.seq]);
            targets.extend_from_slice(&row[1..]);
        }
        let losses = (0..steps)
            .map(|_| t.step(&ids, &targets).unwrap())
            .collect();
        (losses, t.params().unwrap())
    }

    #[test]
    fn the_trainer_learns_a_repeating_sequence_and_repeats_its_bits() {
        let (losses, params) = run(30);
        assert!(
            (losses[0] - (23f32).ln()).abs() < 0.1,
            "first loss {} is not near ln(vocab)",
            losses[0]
        );
        assert!(losses[29] < 0.5 * losses[0], "losses {losses:?}");
        let (again, params2) = run(30);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&losses), bits(&again));
        assert!(params.iter().zip(&params2).all(|(a, b)| bits(a) == bits(b)));
    }
}

//! The model's units, GPT-2 ([`gpt2`]) and the Llama family ([`llama`]:
//! embedding, block, head), written once, forward and backward, over an
//! [`Exec`]: the operations of [`crate::ops`] on some buffers. Two
//! executors run the same code:
//!
//! * [`HostExec`]: host `Vec<f32>`s through [`crate::reference`], each
//!   kernel's scalar reference. `tests/gpu_units.rs` (main crate) runs a
//!   whole model through it and checks loss and every gradient against the
//!   candle units, so the algorithm (the shapes, the order, the backward's
//!   derivation) is checked without a GPU;
//! * [`crate::device::Device`]: the same calls as CUDA kernels and cuBLAS
//!   GEMMs, each checked against its reference by the device check.
//!
//! Backward recomputes the unit's forward from its saved input (as the CPU
//! units do), keeping the intermediates it needs, then runs the chain rule
//! by hand. Parameter gradients are accumulated (`+=`), so a tied
//! embedding's two units add into one buffer, and so do micro-batches.
//! Storage is fp32 but for the GEMMs' operands, rounded to the
//! [`GemmDtype`], params stored in bf16 (a device executor keeps them as
//! they crossed, [`DevBuf::Bf16`]; the host one holds their values in
//! fp32, the same numbers), and, with bf16 GEMMs, the attention's scores,
//! probabilities and their gradients, kept in bf16 as autocast keeps them
//! ([`Exec::attention_fwd`]): at seq 1024 those `[batch · heads, seq,
//! seq]` buffers are most of a block's bytes. Param gradients, norms'
//! statistics and the residual stream stay fp32.

mod device;
pub mod gpt2;
mod host;
pub mod llama;

pub use device::{CudaExec, DevBuf, DeviceIds};
pub use gpt2::*;
pub use host::{HostExec, HostIds};
pub use llama::*;

use crate::norm::NormGroup;
use crate::ops::MatmulShape;
use crate::reference::{AdamScalars, HeadsShape, KvShape, RopeShape};
use crate::{GpuError, Result};

/// The operand dtype of the units' GEMMs. Everything else (the residual
/// stream, norms, softmax, activations, gradients) is fp32 either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GemmDtype {
    /// fp32 operands.
    #[default]
    F32,
    /// Operands rounded to bf16, fp32 accumulation and result: what
    /// `torch.autocast(dtype=bfloat16)` does to a matmul (autocast also
    /// rounds its output; here it stays fp32).
    Bf16,
    /// Operands rounded to fp16, fp32 accumulation and result: the same
    /// GEMM under `fp16.enabled` (the gradients loss-scaled by the head).
    F16,
}

/// The shape of a causal attention over heads: `bh` (batch × heads)
/// matrices of `seq` rows, `head_dim` columns for q, k, v and the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnShape {
    /// Batch × heads.
    pub bh: usize,
    /// Sequence length.
    pub seq: usize,
    /// Head dimension.
    pub head_dim: usize,
}

impl AttnShape {
    /// Elements of q, k, v or the output.
    pub fn heads_numel(&self) -> usize {
        self.bh * self.seq * self.head_dim
    }
    /// Elements of the scores and of the probabilities.
    pub fn scores_numel(&self) -> usize {
        self.bh * self.seq * self.seq
    }
    /// `1 / sqrt(head_dim)`.
    pub fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}

/// What a unit needs of its buffers' executor.
pub trait Exec {
    /// A buffer: fp32, except what an executor keeps narrower on its own
    /// (the attention's probabilities in bf16: [`Exec::attention_fwd`]).
    type Buf;
    /// `n` zeros.
    fn zeros(&self, what: &str, n: usize) -> Result<Self::Buf>;
    /// `n` elements for an output that the next operation writes in full
    /// before anything reads it (a GEMM's `c` with β 0, every slot of a
    /// [`Self::rows_from_heads`]): their values until then are
    /// unspecified. The device leaves them as its pool gives them, saving
    /// [`Self::zeros`]'s memset pass ([`crate::device::Device::alloc_output`]);
    /// the host fills them with NaN, so a unit that reads one before
    /// writing all of it fails its tests.
    fn output(&self, what: &str, n: usize) -> Result<Self::Buf>;
    /// A buffer's elements.
    fn len(&self, b: &Self::Buf) -> usize;
    /// A buffer's bytes on the executor (4 per element, or 2 for one
    /// kept in bf16).
    fn bytes(&self, b: &Self::Buf) -> u64 {
        self.len(b) as u64 * 4
    }
    /// Token ids (or positions) and their [`crate::reference::EmbeddingRuns`] on this executor.
    type Ids;
    /// Uploads `ids` (checked below `vocab`).
    fn ids(&self, ids: &[i32], vocab: usize) -> Result<Self::Ids>;
    /// [`crate::ops::matmul`].
    fn matmul(
        &self,
        c: &mut Self::Buf,
        a: &Self::Buf,
        b: &Self::Buf,
        s: MatmulShape,
        beta: f32,
    ) -> Result<()>;
    /// [`crate::ops::bias_add`].
    fn bias_add(&self, y: &mut Self::Buf, b: &Self::Buf) -> Result<()>;
    /// [`crate::ops::bias_grad`].
    fn bias_grad(&self, db: &mut Self::Buf, dy: &Self::Buf) -> Result<()>;
    /// [`crate::ops::layernorm_fwd`]: `(y, mean, rstd)`.
    fn layernorm_fwd(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        b: &Self::Buf,
        cols: usize,
        eps: f32,
    ) -> Result<[Self::Buf; 3]>;
    /// [`crate::ops::layernorm_bwd_dx`] and [`crate::ops::layernorm_bwd_wb`]: returns dx,
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
    /// [`crate::ops::softmax_causal_fwd`].
    fn softmax_causal_fwd(&self, s: &Self::Buf, seq: usize, scale: f32) -> Result<Self::Buf>;
    /// [`crate::ops::softmax_bwd`].
    fn softmax_bwd(
        &self,
        p: &Self::Buf,
        dp: &Self::Buf,
        seq: usize,
        scale: f32,
    ) -> Result<Self::Buf>;
    /// [`crate::ops::gelu_tanh_fwd`].
    fn gelu_fwd(&self, x: &Self::Buf) -> Result<Self::Buf>;
    /// [`crate::ops::gelu_tanh_bwd`].
    fn gelu_bwd(&self, dy: &Self::Buf, x: &Self::Buf) -> Result<Self::Buf>;
    /// [`crate::ops::add`].
    fn add(&self, a: &Self::Buf, b: &Self::Buf) -> Result<Self::Buf>;
    /// [`crate::ops::heads_from_rows`].
    fn heads_from_rows(&self, x: &Self::Buf, s: HeadsShape, slot: usize) -> Result<Self::Buf>;
    /// [`crate::ops::rows_from_heads`] (into `out`).
    fn rows_from_heads(
        &self,
        out: &mut Self::Buf,
        x: &Self::Buf,
        s: HeadsShape,
        slot: usize,
    ) -> Result<()>;
    /// [`crate::ops::embedding_fwd`].
    fn embedding_fwd(&self, table: &Self::Buf, ids: &Self::Ids, hidden: usize)
        -> Result<Self::Buf>;
    /// [`crate::ops::embedding_bwd`] (adds into `grad_table`).
    fn embedding_bwd(
        &self,
        grad_table: &mut Self::Buf,
        dy: &Self::Buf,
        ids: &Self::Ids,
        hidden: usize,
    ) -> Result<()>;
    /// [`crate::ops::rmsnorm_fwd`]: `(y, rstd)`.
    fn rmsnorm_fwd(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        cols: usize,
        eps: f32,
    ) -> Result<[Self::Buf; 2]>;
    /// [`crate::ops::rmsnorm_bwd_dx`] and [`crate::ops::rmsnorm_bwd_w`]: returns dx, adds
    /// into dw.
    fn rmsnorm_bwd(
        &self,
        dy: &Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        rstd: &Self::Buf,
        dw: &mut Self::Buf,
        cols: usize,
    ) -> Result<Self::Buf>;
    /// [`crate::ops::rope`].
    fn rope(
        &self,
        x: &Self::Buf,
        cos: &Self::Buf,
        sin: &Self::Buf,
        s: RopeShape,
        sign: f32,
    ) -> Result<Self::Buf>;
    /// [`crate::ops::swiglu_fwd`].
    fn swiglu_fwd(&self, gate: &Self::Buf, up: &Self::Buf) -> Result<Self::Buf>;
    /// [`crate::ops::swiglu_bwd`]: `(dgate, dup)`.
    fn swiglu_bwd(
        &self,
        dy: &Self::Buf,
        gate: &Self::Buf,
        up: &Self::Buf,
    ) -> Result<[Self::Buf; 2]>;
    /// [`crate::ops::repeat_kv`].
    fn repeat_kv(&self, x: &Self::Buf, s: KvShape) -> Result<Self::Buf>;
    /// [`crate::ops::sum_kv`].
    fn sum_kv(&self, x: &Self::Buf, s: KvShape) -> Result<Self::Buf>;
    /// A copy of `v` on this executor.
    fn upload(&self, what: &str, v: &[f32]) -> Result<Self::Buf>;
    /// A buffer's values on the host.
    fn download(&self, b: &Self::Buf) -> Result<Vec<f32>>;
    /// Zeroes a buffer in place.
    fn fill_zero(&self, b: &mut Self::Buf) -> Result<()>;
    /// [`crate::ops::adamw`] on `[master, m, v]`.
    fn adamw(&self, st: [&mut Self::Buf; 3], grad: &Self::Buf, s: AdamScalars) -> Result<()>;
    /// Each group's Σ x² in the host optimizer's order
    /// ([`crate::norm`]): on the device [`crate::ops::sumsq_parts`] (one
    /// launch for every group, one wait), the parts added on the host;
    /// the buffers must be fp32.
    fn norm_sq_sums(&self, groups: &[NormGroup<'_, Self::Buf>]) -> Result<Vec<f64>>;
    /// `dst = src` rounded to bf16 (to nearest even) and widened back, by
    /// the `cast_f32_bf16` and `cast_bf16_f32` kernels.
    fn round_bf16(&self, dst: &mut Self::Buf, src: &Self::Buf) -> Result<()>;
    /// Causal attention of the heads `q`, `k`, `v`: `[o, p]`, the output
    /// (fp32) and the probabilities the backward reads. By default
    /// [`attention_fwd_fp32`]; with bf16 GEMMs both executors keep the
    /// scores and the probabilities in bf16, as autocast does (the
    /// scores a bf16 GEMM's output, the softmax computed in fp32 from
    /// them and stored in bf16, which the next GEMM takes as it is):
    /// half the bytes of the `[bh, seq, seq]` buffers, and no cast of
    /// them before a GEMM.
    fn attention_fwd(
        &self,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        a: AttnShape,
    ) -> Result<[Self::Buf; 2]>
    where
        Self: Sized,
    {
        attention_fwd_fp32(self, q, k, v, a)
    }
    /// The backward of [`Exec::attention_fwd`]: `[dq, dk, dv]` (fp32),
    /// from its probabilities `p`, the heads `[q, k, v]` and the
    /// output's gradient. By default [`attention_bwd_fp32`]; with bf16
    /// GEMMs the probabilities' and the scores' gradients are bf16.
    fn attention_bwd(
        &self,
        p: &Self::Buf,
        qkv: [&Self::Buf; 3],
        dout: &Self::Buf,
        a: AttnShape,
    ) -> Result<[Self::Buf; 3]>
    where
        Self: Sized,
    {
        attention_bwd_fp32(self, p, qkv, dout, a)
    }
    /// [`crate::ops::cross_entropy`] and the sum of its rows: `(total
    /// loss, dlogits)`, the total a one-element buffer (read back only when
    /// wanted: [`HeadLoss::mean`]), `dlogits` scaled by `grad_scale`.
    fn cross_entropy(
        &self,
        logits: &Self::Buf,
        targets: &Self::Ids,
        vocab: usize,
        grad_scale: f32,
    ) -> Result<(Self::Buf, Self::Buf)>;
}

/// A head's loss still on its executor: the sum over its `rows` of the
/// rows' cross-entropy, a one-element buffer. Reading it back waits for
/// the head's compute, so a head's caller reads it when it needs it, not
/// the head (a head launched ahead then leaves the host free).
#[derive(Debug)]
pub struct HeadLoss<B> {
    total: B,
    rows: usize,
}

impl<B> HeadLoss<B> {
    /// The mean loss over the rows (NaN for an empty total): read back,
    /// then divided on the host, in f32.
    pub fn mean<E: Exec<Buf = B>>(&self, e: &E) -> Result<f32> {
        let total = e.download(&self.total)?;
        Ok(total.first().copied().unwrap_or(f32::NAN) / self.rows as f32)
    }
}

/// Causal attention of heads `q`, `k`, `v` ([`AttnShape`]):
/// `[o, p]`, `p = softmax(q kᵀ · scale)` over the columns up to each
/// row's own and `o = p v`, with every buffer fp32 (the GEMMs' operands
/// rounded to `gemm`'s dtype by the executor's `matmul`). The executors'
/// [`Exec::attention_fwd`] unless they narrow the intermediates.
pub fn attention_fwd_fp32<E: Exec>(
    e: &E,
    q: &E::Buf,
    k: &E::Buf,
    v: &E::Buf,
    a: AttnShape,
) -> Result<[E::Buf; 2]> {
    let (bh, seq, hd) = (a.bh, a.seq, a.head_dim);
    let mut s = e.output("attention scores", a.scores_numel())?;
    e.matmul(&mut s, q, k, mm(bh, seq, seq, hd, false, true), 0.0)?;
    let p = e.softmax_causal_fwd(&s, seq, a.scale())?;
    drop(s);
    let mut o = e.output("attention output", a.heads_numel())?;
    e.matmul(&mut o, &p, v, mm(bh, seq, hd, seq, false, false), 0.0)?;
    Ok([o, p])
}

/// The backward of [`attention_fwd_fp32`] from its probabilities `p`
/// and the output's gradient `dout`: `[dq, dk, dv]`.
pub fn attention_bwd_fp32<E: Exec>(
    e: &E,
    p: &E::Buf,
    [q, k, v]: [&E::Buf; 3],
    dout: &E::Buf,
    a: AttnShape,
) -> Result<[E::Buf; 3]> {
    let (bh, seq, hd) = (a.bh, a.seq, a.head_dim);
    let mut dp = e.output("probability gradient", a.scores_numel())?;
    e.matmul(&mut dp, dout, v, mm(bh, seq, seq, hd, false, true), 0.0)?;
    let mut dv = e.output("v gradient", a.heads_numel())?;
    e.matmul(&mut dv, p, dout, mm(bh, seq, hd, seq, true, false), 0.0)?;
    let ds = e.softmax_bwd(p, &dp, seq, a.scale())?;
    drop(dp);
    let mut dq = e.output("q gradient", a.heads_numel())?;
    e.matmul(&mut dq, &ds, k, mm(bh, seq, hd, seq, false, false), 0.0)?;
    let mut dk = e.output("k gradient", a.heads_numel())?;
    e.matmul(&mut dk, &ds, q, mm(bh, seq, hd, seq, true, false), 0.0)?;
    Ok([dq, dk, dv])
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

/// A kept forward is this batch's: its input and its attention
/// probabilities (`bufs`) have the elements `want`.
fn check_kept<E: Exec>(e: &E, unit: &str, bufs: [&E::Buf; 2], want: [usize; 2]) -> Result<()> {
    let found = bufs.map(|b| e.len(b));
    if found == want {
        return Ok(());
    }
    Err(GpuError::Shape {
        kernel: unit.into(),
        detail: format!(
            "a kept forward of {} input and {} attention elements for a batch of {} and {}",
            found[0], found[1], want[0], want[1]
        ),
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
            // `0 - x`: +0 without decay, as the CPU kernel's (a -0.0
            // param stays -0.0).
            neg_lr_wd: (0.0 - self.lr * self.weight_decay) as f32,
        }
    }
}

/// The LM head on normalized rows `n` [rows, hidden] with the output
/// matrix `w` [vocab, hidden]: the mean cross-entropy of `targets` and,
/// with `loss_scale`, its backward: `gw += dlogitsᵀ n`; returns
/// `(loss, dn)`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn lm_head<E: Exec>(
    e: &E,
    (rows, hidden, vocab): (usize, usize, usize),
    n: &E::Buf,
    w: &E::Buf,
    targets: &E::Ids,
    loss_scale: f32,
    gw: &mut E::Buf,
) -> Result<(HeadLoss<E::Buf>, E::Buf)> {
    let mut logits = e.output("logits", rows * vocab)?;
    e.matmul(
        &mut logits,
        n,
        w,
        mm(1, rows, vocab, hidden, false, true),
        0.0,
    )?;
    let (total, dlogits) = e.cross_entropy(&logits, targets, vocab, loss_scale / rows as f32)?;
    e.matmul(
        gw,
        &dlogits,
        n,
        mm(1, vocab, hidden, rows, true, false),
        1.0,
    )?;
    let mut dn = e.output("head dx", rows * hidden)?;
    e.matmul(
        &mut dn,
        &dlogits,
        w,
        mm(1, rows, hidden, vocab, false, false),
        0.0,
    )?;
    Ok((HeadLoss { total, rows }, dn))
}

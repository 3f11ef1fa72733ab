//! The Llama family's units (Llama, Mistral without a sliding window,
//! Qwen2, Qwen3) over an [`Exec`].

use super::{check_kept, check_params, lm_head, mm, AttnShape, Exec, HeadLoss};
use crate::reference::{HeadsShape, KvShape, RopeShape};
use crate::{GpuError, Result};

/// A Llama-family model's dimensions and options for its units.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LlamaDims {
    /// Sequences per micro-batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (divides `heads`).
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// MLP inner size.
    pub inner: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// Biases on q, k, v (Qwen2).
    pub qkv_bias: bool,
    /// Bias on the output projection.
    pub o_bias: bool,
    /// Biases on the MLP's projections.
    pub mlp_bias: bool,
    /// RMSNorm of each q and k head before the rotation (Qwen3).
    pub qk_norm: bool,
}

/// Where each of a Llama block's params is in its list (the CPU unit's
/// order: input norm, q, k, v, o (each weight then its optional bias), the
/// optional q and k norms, the post-attention norm, gate, up, down).
#[derive(Debug, Clone, Copy)]
struct LlamaIdx {
    ln1: usize,
    q: (usize, Option<usize>),
    k: (usize, Option<usize>),
    v: (usize, Option<usize>),
    o: (usize, Option<usize>),
    qk_norm: Option<(usize, usize)>,
    ln2: usize,
    gate: (usize, Option<usize>),
    up: (usize, Option<usize>),
    down: (usize, Option<usize>),
    /// (index, elements) of every param, in order.
    numel: usize,
}

impl LlamaDims {
    fn rows(&self) -> usize {
        self.batch * self.seq
    }
    fn group(&self) -> usize {
        self.heads / self.kv_heads.max(1)
    }
    fn idx(&self) -> LlamaIdx {
        let mut n = 0usize;
        let mut next = || {
            n += 1;
            n - 1
        };
        let ln1 = next();
        let lin = |bias: bool, next: &mut dyn FnMut() -> usize| (next(), bias.then(&mut *next));
        let q = lin(self.qkv_bias, &mut next);
        let k = lin(self.qkv_bias, &mut next);
        let v = lin(self.qkv_bias, &mut next);
        let o = lin(self.o_bias, &mut next);
        let qk_norm = self.qk_norm.then(|| (next(), next()));
        let ln2 = next();
        let gate = lin(self.mlp_bias, &mut next);
        let up = lin(self.mlp_bias, &mut next);
        let down = lin(self.mlp_bias, &mut next);
        LlamaIdx {
            ln1,
            q,
            k,
            v,
            o,
            qk_norm,
            ln2,
            gate,
            up,
            down,
            numel: next(),
        }
    }
    /// Elements of each block param, in order.
    pub fn block_param_numel(&self) -> Vec<usize> {
        let i = self.idx();
        let (h, hd, inner) = (self.hidden, self.head_dim, self.inner);
        let (qd, kvd) = (self.heads * hd, self.kv_heads * hd);
        let mut n = vec![0usize; i.numel];
        n[i.ln1] = h;
        n[i.ln2] = h;
        for ((w, b), out, inp) in [
            (i.q, qd, h),
            (i.k, kvd, h),
            (i.v, kvd, h),
            (i.o, h, qd),
            (i.gate, inner, h),
            (i.up, inner, h),
            (i.down, h, inner),
        ] {
            n[w] = out * inp;
            if let Some(b) = b {
                n[b] = out;
            }
        }
        if let Some((qn, kn)) = i.qk_norm {
            n[qn] = hd;
            n[kn] = hd;
        }
        n
    }
    fn rope_shape(&self, heads: usize) -> RopeShape {
        RopeShape {
            batch: self.batch,
            seq: self.seq,
            heads,
            head_dim: self.head_dim,
        }
    }
    fn attn(&self) -> AttnShape {
        AttnShape {
            bh: self.batch * self.heads,
            seq: self.seq,
            head_dim: self.head_dim,
        }
    }
    fn heads_shape(&self, heads: usize) -> HeadsShape {
        HeadsShape {
            batch: self.batch,
            seq: self.seq,
            heads,
            head_dim: self.head_dim,
            slots: 1,
        }
    }
    fn kv_shape(&self) -> KvShape {
        KvShape {
            batch: self.batch,
            kv_heads: self.kv_heads,
            group: self.group(),
            n: self.seq * self.head_dim,
        }
    }
}

/// The rotary tables of a sequence: `cos`, `sin` [seq, head_dim / 2].
#[derive(Debug)]
pub struct RopeTables<B> {
    /// cos(θ).
    pub cos: B,
    /// sin(θ).
    pub sin: B,
}

/// `x [rows, in] @ w [out, in]ᵀ (+ b)`.
fn linear<E: Exec>(
    e: &E,
    rows: usize,
    x: &E::Buf,
    w: &E::Buf,
    b: Option<&E::Buf>,
    out: usize,
    inp: usize,
) -> Result<E::Buf> {
    let mut y = e.output("linear output", rows * out)?;
    e.matmul(&mut y, x, w, mm(1, rows, out, inp, false, true), 0.0)?;
    if let Some(b) = b {
        e.bias_add(&mut y, b)?;
    }
    Ok(y)
}

/// Backward of [`linear`]: `dw += dyᵀ x`, `db += Σ dy`; returns `dy w`.
#[allow(clippy::too_many_arguments)]
fn linear_bwd<E: Exec>(
    e: &E,
    rows: usize,
    dy: &E::Buf,
    x: &E::Buf,
    w: &E::Buf,
    dw: &mut E::Buf,
    db: Option<&mut E::Buf>,
    (out, inp): (usize, usize),
) -> Result<E::Buf> {
    e.matmul(dw, dy, x, mm(1, out, inp, rows, true, false), 1.0)?;
    if let Some(db) = db {
        e.bias_grad(db, dy)?;
    }
    let mut dx = e.output("linear dx", rows * inp)?;
    e.matmul(&mut dx, dy, w, mm(1, rows, inp, out, false, false), 0.0)?;
    Ok(dx)
}

/// Disjoint mutable references to `grads[w]` and `grads[b]`.
fn two<B>(grads: &mut [B], (w, b): (usize, Option<usize>)) -> (&mut B, Option<&mut B>) {
    match b {
        None => (&mut grads[w], None),
        Some(b) => {
            let (lo, hi) = grads.split_at_mut(b);
            (&mut lo[w], Some(&mut hi[0]))
        }
    }
}

/// What a block's backward reads of its forward (its input is kept
/// beside them, in [`LlamaKept`]).
struct LlamaSaved<B> {
    ln1: [B; 2],
    /// q and k before their norms, with the norms' outputs (Qwen3).
    qn: Option<(B, B, [B; 2], [B; 2])>,
    qh: B,
    ke: B,
    ve: B,
    p: B,
    y: B,
    x1: B,
    ln2: [B; 2],
    gate: B,
    up: B,
    act: B,
}

impl<B> LlamaSaved<B> {
    /// Every buffer, for their sizes.
    fn buffers(&self) -> Vec<&B> {
        let mut v: Vec<&B> = self.ln1.iter().collect();
        if let Some((q, k, qn, kn)) = &self.qn {
            v.extend([q, k]);
            v.extend(qn.iter().chain(kn.iter()));
        }
        v.extend([&self.qh, &self.ke, &self.ve, &self.p, &self.y, &self.x1]);
        v.extend(self.ln2.iter());
        v.extend([&self.gate, &self.up, &self.act]);
        v
    }
}

/// A Llama-family block's forward kept for its backward
/// ([`llama_block_forward_kept`], [`llama_block_backward_kept`]): its
/// input and the intermediates its backward reads. Backward from them
/// runs the same operations on the same values as
/// [`llama_block_backward`]'s recompute: the same bits.
pub struct LlamaKept<B> {
    x: B,
    s: LlamaSaved<B>,
}

impl<B> LlamaKept<B> {
    /// Elements held, the input included.
    pub fn numel<E: Exec<Buf = B>>(&self, e: &E) -> usize {
        e.len(&self.x)
            + self
                .s
                .buffers()
                .into_iter()
                .map(|b| e.len(b))
                .sum::<usize>()
    }

    /// Bytes held on the executor ([`Exec::bytes`]: the probabilities
    /// are bf16 on a device with bf16 GEMMs).
    pub fn bytes<E: Exec<Buf = B>>(&self, e: &E) -> u64 {
        e.bytes(&self.x)
            + self
                .s
                .buffers()
                .into_iter()
                .map(|b| e.bytes(b))
                .sum::<u64>()
    }
}

impl<B> std::fmt::Debug for LlamaKept<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlamaKept").finish_non_exhaustive()
    }
}

fn llama_forward_saving<E: Exec>(
    e: &E,
    d: &LlamaDims,
    p: &[E::Buf],
    x: &E::Buf,
    rope: &RopeTables<E::Buf>,
) -> Result<(LlamaSaved<E::Buf>, E::Buf)> {
    let i = d.idx();
    let (rows, h, hd) = (d.rows(), d.hidden, d.head_dim);
    let (qd, kvd) = (d.heads * hd, d.kv_heads * hd);
    let bias = |b: Option<usize>| b.map(|b| &p[b]);
    let ln1 = e.rmsnorm_fwd(x, &p[i.ln1], h, d.eps)?;
    let q = linear(e, rows, &ln1[0], &p[i.q.0], bias(i.q.1), qd, h)?;
    let k = linear(e, rows, &ln1[0], &p[i.k.0], bias(i.k.1), kvd, h)?;
    let v = linear(e, rows, &ln1[0], &p[i.v.0], bias(i.v.1), kvd, h)?;
    let qn = match i.qk_norm {
        Some((qi, ki)) => Some((
            e.rmsnorm_fwd(&q, &p[qi], hd, d.eps)?,
            e.rmsnorm_fwd(&k, &p[ki], hd, d.eps)?,
        )),
        None => None,
    };
    let (qq, kk) = match &qn {
        Some((a, b)) => (&a[0], &b[0]),
        None => (&q, &k),
    };
    let qr = e.rope(qq, &rope.cos, &rope.sin, d.rope_shape(d.heads), 1.0)?;
    let kr = e.rope(kk, &rope.cos, &rope.sin, d.rope_shape(d.kv_heads), 1.0)?;
    let qh = e.heads_from_rows(&qr, d.heads_shape(d.heads), 0)?;
    let kh = e.heads_from_rows(&kr, d.heads_shape(d.kv_heads), 0)?;
    let vh = e.heads_from_rows(&v, d.heads_shape(d.kv_heads), 0)?;
    let ke = e.repeat_kv(&kh, d.kv_shape())?;
    let ve = e.repeat_kv(&vh, d.kv_shape())?;
    let [o, pr] = e.attention_fwd(&qh, &ke, &ve, d.attn())?;
    let mut y = e.output("attention rows", rows * qd)?;
    e.rows_from_heads(&mut y, &o, d.heads_shape(d.heads), 0)?;
    let attn = linear(e, rows, &y, &p[i.o.0], bias(i.o.1), h, qd)?;
    let x1 = e.add(x, &attn)?;
    let ln2 = e.rmsnorm_fwd(&x1, &p[i.ln2], h, d.eps)?;
    let gate = linear(e, rows, &ln2[0], &p[i.gate.0], bias(i.gate.1), d.inner, h)?;
    let up = linear(e, rows, &ln2[0], &p[i.up.0], bias(i.up.1), d.inner, h)?;
    let act = e.swiglu_fwd(&gate, &up)?;
    let mo = linear(e, rows, &act, &p[i.down.0], bias(i.down.1), h, d.inner)?;
    let out = e.add(&x1, &mo)?;
    drop(v);
    let qn = qn.map(|(a, b)| (q, k, a, b));
    Ok((
        LlamaSaved {
            ln1,
            qn,
            qh,
            ke,
            ve,
            p: pr,
            y,
            x1,
            ln2,
            gate,
            up,
            act,
        },
        out,
    ))
}

fn check_llama<E: Exec>(e: &E, d: &LlamaDims, p: &[E::Buf]) -> Result<()> {
    if d.kv_heads == 0 || !d.heads.is_multiple_of(d.kv_heads) || !d.head_dim.is_multiple_of(2) {
        return Err(GpuError::Shape {
            kernel: "llama block".into(),
            detail: format!(
                "{} heads over {} kv heads of dim {}",
                d.heads, d.kv_heads, d.head_dim
            ),
        });
    }
    check_params(e, "llama block", p, &d.block_param_numel())
}

/// A Llama-family block's output (params in the CPU unit's order; see
/// [`LlamaDims`] for the options).
pub fn llama_block_forward<E: Exec>(
    e: &E,
    d: &LlamaDims,
    p: &[E::Buf],
    x: &E::Buf,
    rope: &RopeTables<E::Buf>,
) -> Result<E::Buf> {
    check_llama(e, d, p)?;
    Ok(llama_forward_saving(e, d, p, x, rope)?.1)
}

/// [`llama_block_forward`] that keeps what the backward reads, the input
/// `x` with it: the output and the kept forward, for
/// [`llama_block_backward_kept`].
pub fn llama_block_forward_kept<E: Exec>(
    e: &E,
    d: &LlamaDims,
    p: &[E::Buf],
    x: E::Buf,
    rope: &RopeTables<E::Buf>,
) -> Result<(E::Buf, LlamaKept<E::Buf>)> {
    check_llama(e, d, p)?;
    let (s, out) = llama_forward_saving(e, d, p, &x, rope)?;
    Ok((out, LlamaKept { x, s }))
}

/// A block's params and their gradients have the block's sizes.
fn check_block<E: Exec>(e: &E, d: &LlamaDims, p: &[E::Buf], grads: &[E::Buf]) -> Result<()> {
    check_llama(e, d, p)?;
    check_params(e, "llama block gradients", grads, &d.block_param_numel())
}

/// A Llama-family block's backward by recompute: adds into `grads`,
/// returns the input's gradient.
pub fn llama_block_backward<E: Exec>(
    e: &E,
    d: &LlamaDims,
    p: &[E::Buf],
    x: &E::Buf,
    dout: &E::Buf,
    grads: &mut [E::Buf],
    rope: &RopeTables<E::Buf>,
) -> Result<E::Buf> {
    check_block(e, d, p, grads)?;
    let (s, out) = llama_forward_saving(e, d, p, x, rope)?;
    drop(out);
    backward_from(e, d, p, x, &s, dout, grads, rope)
}

/// [`llama_block_backward`] from the forward [`llama_block_forward_kept`]
/// kept (for these params and this batch shape), with no recompute.
pub fn llama_block_backward_kept<E: Exec>(
    e: &E,
    d: &LlamaDims,
    p: &[E::Buf],
    kept: LlamaKept<E::Buf>,
    dout: &E::Buf,
    grads: &mut [E::Buf],
    rope: &RopeTables<E::Buf>,
) -> Result<E::Buf> {
    check_block(e, d, p, grads)?;
    check_kept(
        e,
        "llama block",
        [&kept.x, &kept.s.p],
        [d.rows() * d.hidden, d.batch * d.heads * d.seq * d.seq],
    )?;
    backward_from(e, d, p, &kept.x, &kept.s, dout, grads, rope)
}

/// The chain rule of a block from its forward's intermediates `s`.
#[allow(
    clippy::too_many_arguments,
    reason = "a block's backward: params, input, forward, upstream, gradients, rotary tables"
)]
fn backward_from<E: Exec>(
    e: &E,
    d: &LlamaDims,
    p: &[E::Buf],
    x: &E::Buf,
    s: &LlamaSaved<E::Buf>,
    dout: &E::Buf,
    grads: &mut [E::Buf],
    rope: &RopeTables<E::Buf>,
) -> Result<E::Buf> {
    let i = d.idx();
    let (rows, h, hd, inner) = (d.rows(), d.hidden, d.head_dim, d.inner);
    let (qd, kvd) = (d.heads * hd, d.kv_heads * hd);
    // MLP.
    let (gw, gb) = two(grads, i.down);
    let dact = linear_bwd(e, rows, dout, &s.act, &p[i.down.0], gw, gb, (h, inner))?;
    let [dgate, dup] = e.swiglu_bwd(&dact, &s.gate, &s.up)?;
    let (gw, gb) = two(grads, i.gate);
    let dm_g = linear_bwd(e, rows, &dgate, &s.ln2[0], &p[i.gate.0], gw, gb, (inner, h))?;
    let (gw, gb) = two(grads, i.up);
    let dm_u = linear_bwd(e, rows, &dup, &s.ln2[0], &p[i.up.0], gw, gb, (inner, h))?;
    let dm = e.add(&dm_g, &dm_u)?;
    let dx1_n = e.rmsnorm_bwd(&dm, &s.x1, &p[i.ln2], &s.ln2[1], &mut grads[i.ln2], h)?;
    let dx1 = e.add(dout, &dx1_n)?;
    // Attention.
    let (gw, gb) = two(grads, i.o);
    let dy = linear_bwd(e, rows, &dx1, &s.y, &p[i.o.0], gw, gb, (h, qd))?;
    let do_ = e.heads_from_rows(&dy, d.heads_shape(d.heads), 0)?;
    let [dq, dke, dve] = e.attention_bwd(&s.p, [&s.qh, &s.ke, &s.ve], &do_, d.attn())?;
    let dkh = e.sum_kv(&dke, d.kv_shape())?;
    let dvh = e.sum_kv(&dve, d.kv_shape())?;
    let mut dqr = e.output("q rows gradient", rows * qd)?;
    e.rows_from_heads(&mut dqr, &dq, d.heads_shape(d.heads), 0)?;
    let mut dkr = e.output("k rows gradient", rows * kvd)?;
    e.rows_from_heads(&mut dkr, &dkh, d.heads_shape(d.kv_heads), 0)?;
    let mut dv = e.output("v rows gradient", rows * kvd)?;
    e.rows_from_heads(&mut dv, &dvh, d.heads_shape(d.kv_heads), 0)?;
    let dqn = e.rope(&dqr, &rope.cos, &rope.sin, d.rope_shape(d.heads), -1.0)?;
    let dkn = e.rope(&dkr, &rope.cos, &rope.sin, d.rope_shape(d.kv_heads), -1.0)?;
    let (dq_lin, dk_lin) = match (i.qk_norm, &s.qn) {
        (Some((qi, ki)), Some((q, k, qn, kn))) => (
            e.rmsnorm_bwd(&dqn, q, &p[qi], &qn[1], &mut grads[qi], hd)?,
            e.rmsnorm_bwd(&dkn, k, &p[ki], &kn[1], &mut grads[ki], hd)?,
        ),
        _ => (dqn, dkn),
    };
    let (gw, gb) = two(grads, i.q);
    let da_q = linear_bwd(e, rows, &dq_lin, &s.ln1[0], &p[i.q.0], gw, gb, (qd, h))?;
    let (gw, gb) = two(grads, i.k);
    let da_k = linear_bwd(e, rows, &dk_lin, &s.ln1[0], &p[i.k.0], gw, gb, (kvd, h))?;
    let (gw, gb) = two(grads, i.v);
    let da_v = linear_bwd(e, rows, &dv, &s.ln1[0], &p[i.v.0], gw, gb, (kvd, h))?;
    let da = e.add(&e.add(&da_q, &da_k)?, &da_v)?;
    let dx_n = e.rmsnorm_bwd(&da, x, &p[i.ln1], &s.ln1[1], &mut grads[i.ln1], h)?;
    e.add(&dx1, &dx_n)
}

/// The Llama embedding: `embed_tokens[ids]`.
pub fn llama_embedding_forward<E: Exec>(
    e: &E,
    d: &LlamaDims,
    table: &E::Buf,
    ids: &E::Ids,
) -> Result<E::Buf> {
    e.embedding_fwd(table, ids, d.hidden)
}

/// The embedding's backward: adds into `grad`.
pub fn llama_embedding_backward<E: Exec>(
    e: &E,
    d: &LlamaDims,
    dout: &E::Buf,
    ids: &E::Ids,
    grad: &mut E::Buf,
) -> Result<()> {
    e.embedding_bwd(grad, dout, ids, d.hidden)
}

/// The head (params: the final RMSNorm weight, the [vocab, hidden] output
/// matrix): mean cross-entropy and, with `loss_scale`, its backward.
pub fn llama_head<E: Exec>(
    e: &E,
    d: &LlamaDims,
    p: [&E::Buf; 2],
    x: &E::Buf,
    targets: &E::Ids,
    loss_scale: f32,
    grads: [&mut E::Buf; 2],
) -> Result<(HeadLoss<E::Buf>, E::Buf)> {
    let (h, v, rows) = (d.hidden, d.vocab, d.rows());
    let ln = e.rmsnorm_fwd(x, p[0], h, d.eps)?;
    let [g0, g1] = grads;
    let (loss, dn) = lm_head(e, (rows, h, v), &ln[0], p[1], targets, loss_scale, g1)?;
    let dx = e.rmsnorm_bwd(&dn, x, p[0], &ln[1], g0, h)?;
    Ok((loss, dx))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;
    use crate::unit::HostExec;

    fn dims(qk_norm: bool) -> LlamaDims {
        LlamaDims {
            batch: 2,
            seq: 5,
            hidden: 12,
            heads: 3,
            kv_heads: 1,
            head_dim: 4,
            inner: 20,
            vocab: 17,
            eps: 1e-6,
            qkv_bias: qk_norm,
            o_bias: false,
            mlp_bias: qk_norm,
            qk_norm,
        }
    }

    fn fill(n: usize, seed: u64) -> Vec<f32> {
        crate::reference::test_values(n, seed)
            .into_iter()
            .map(|v| 0.5 * v)
            .collect()
    }

    #[test]
    fn backward_from_the_kept_forward_gives_the_recompute_s_bits() {
        let e = HostExec::F32;
        for qk_norm in [false, true] {
            let d = dims(qk_norm);
            let p: Vec<Vec<f32>> = d
                .block_param_numel()
                .iter()
                .enumerate()
                .map(|(i, &n)| fill(n, i as u64 + 1))
                .collect();
            let half = d.head_dim / 2;
            let angle = |s: usize, j: usize| s as f32 / 10f32.powf(j as f32 / half as f32);
            let rope = RopeTables {
                cos: (0..d.seq * half)
                    .map(|i| angle(i / half, i % half).cos())
                    .collect(),
                sin: (0..d.seq * half)
                    .map(|i| angle(i / half, i % half).sin())
                    .collect(),
            };
            let x = fill(d.rows() * d.hidden, 99);
            let dout = fill(d.rows() * d.hidden, 7);
            let zeros = || -> Vec<Vec<f32>> { p.iter().map(|v| vec![0.0; v.len()]).collect() };
            let mut g_re = zeros();
            let dx_re = llama_block_backward(&e, &d, &p, &x, &dout, &mut g_re, &rope).unwrap();
            let (out, kept) = llama_block_forward_kept(&e, &d, &p, x.clone(), &rope).unwrap();
            assert_eq!(out, llama_block_forward(&e, &d, &p, &x, &rope).unwrap());
            let mut g_kept = zeros();
            let dx_kept =
                llama_block_backward_kept(&e, &d, &p, kept, &dout, &mut g_kept, &rope).unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&dx_re), bits(&dx_kept), "qk_norm {qk_norm}");
            for (a, b) in g_re.iter().zip(&g_kept) {
                assert_eq!(bits(a), bits(b), "qk_norm {qk_norm}");
            }
            assert!(g_re.iter().all(|g| g.iter().any(|v| *v != 0.0)));
        }
    }
}

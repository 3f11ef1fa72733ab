//! GPT-2's units (embedding, block, head) over an [`Exec`], a whole-model
//! trainer and a deterministic init.

use super::{
    check_kept, check_params, lm_head, mm, AdamHyper, AttnShape, Exec, HeadLoss, HostExec,
};
use crate::ops::MatmulShape;
use crate::reference::HeadsShape;
use crate::{GpuError, Result};

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
    fn attn(&self) -> AttnShape {
        AttnShape {
            bh: self.batch * self.heads,
            seq: self.seq,
            head_dim: self.head_dim(),
        }
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
    let mut y = e.output("linear output", d.rows() * n)?;
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
    let mut dx = e.output("linear dx", rows * k)?;
    e.matmul(&mut dx, dy, w, mm(1, rows, k, n, false, true), 0.0)?;
    Ok(dx)
}

/// What a block's backward reads of its forward: the intermediates (the
/// block's input is kept beside them, in [`Gpt2Kept`]).
struct BlockSaved<B> {
    ln1: [B; 3],
    q: B,
    k: B,
    v: B,
    p: B,
    y: B,
    x1: B,
    ln2: [B; 3],
    fc: B,
    g: B,
}

impl<B> BlockSaved<B> {
    /// Every buffer, for their sizes.
    fn buffers(&self) -> impl Iterator<Item = &B> {
        self.ln1
            .iter()
            .chain([&self.q, &self.k, &self.v, &self.p, &self.y, &self.x1])
            .chain(self.ln2.iter())
            .chain([&self.fc, &self.g])
    }
}

/// A GPT-2 block's forward kept for its backward
/// ([`gpt2_block_forward_kept`], [`gpt2_block_backward_kept`]): its input
/// and the intermediates its backward reads, so the backward does not
/// compute the forward again. Backward from them runs the same operations
/// on the same values as [`gpt2_block_backward`]'s recompute: the same
/// bits.
pub struct Gpt2Kept<B> {
    x: B,
    s: BlockSaved<B>,
}

impl<B> Gpt2Kept<B> {
    /// Elements held, the input included.
    pub fn numel<E: Exec<Buf = B>>(&self, e: &E) -> usize {
        std::iter::once(&self.x)
            .chain(self.s.buffers())
            .map(|b| e.len(b))
            .sum()
    }

    /// Bytes held on the executor ([`Exec::bytes`]: the probabilities
    /// are bf16 on a device with bf16 GEMMs).
    pub fn bytes<E: Exec<Buf = B>>(&self, e: &E) -> u64 {
        std::iter::once(&self.x)
            .chain(self.s.buffers())
            .map(|b| e.bytes(b))
            .sum()
    }
}

impl<B> std::fmt::Debug for Gpt2Kept<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpt2Kept").finish_non_exhaustive()
    }
}

fn block_forward_saving<E: Exec>(
    e: &E,
    d: &Gpt2Dims,
    p: &[E::Buf],
    x: &E::Buf,
) -> Result<(BlockSaved<E::Buf>, E::Buf)> {
    let (h, inner) = (d.hidden, d.inner);
    let ln1 = e.layernorm_fwd(x, &p[0], &p[1], h, d.eps)?;
    let qkv = conv1d(e, d, &ln1[0], &p[2], &p[3], h, 3 * h)?;
    let hs = d.heads_shape(3);
    let (q, k, v) = (
        e.heads_from_rows(&qkv, hs, 0)?,
        e.heads_from_rows(&qkv, hs, 1)?,
        e.heads_from_rows(&qkv, hs, 2)?,
    );
    let [o, pr] = e.attention_fwd(&q, &k, &v, d.attn())?;
    let mut y = e.output("attention rows", d.rows() * h)?;
    e.rows_from_heads(&mut y, &o, d.heads_shape(1), 0)?;
    let attn = conv1d(e, d, &y, &p[4], &p[5], h, h)?;
    let x1 = e.add(x, &attn)?;
    let ln2 = e.layernorm_fwd(&x1, &p[6], &p[7], h, d.eps)?;
    let fc = conv1d(e, d, &ln2[0], &p[8], &p[9], h, inner)?;
    let g = e.gelu_fwd(&fc)?;
    let mo = conv1d(e, d, &g, &p[10], &p[11], inner, h)?;
    let out = e.add(&x1, &mo)?;
    drop(qkv);
    Ok((
        BlockSaved {
            ln1,
            q,
            k,
            v,
            p: pr,
            y,
            x1,
            ln2,
            fc,
            g,
        },
        out,
    ))
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
    Ok(block_forward_saving(e, d, p, x)?.1)
}

/// [`gpt2_block_forward`] that keeps what the backward reads, the input
/// `x` with it: the output and the kept forward, for
/// [`gpt2_block_backward_kept`].
pub fn gpt2_block_forward_kept<E: Exec>(
    e: &E,
    d: &Gpt2Dims,
    p: &[E::Buf],
    x: E::Buf,
) -> Result<(E::Buf, Gpt2Kept<E::Buf>)> {
    check_params(e, "gpt2 block", p, &block_param_numel(d))?;
    let (s, out) = block_forward_saving(e, d, p, &x)?;
    Ok((out, Gpt2Kept { x, s }))
}

/// A block's params and their gradients have the block's sizes.
fn check_block<E: Exec>(e: &E, d: &Gpt2Dims, p: &[E::Buf], grads: &[E::Buf]) -> Result<()> {
    let numel = block_param_numel(d);
    check_params(e, "gpt2 block", p, &numel)?;
    check_params(e, "gpt2 block gradients", grads, &numel)
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
    check_block(e, d, p, grads)?;
    let (s, out) = block_forward_saving(e, d, p, x)?;
    drop(out);
    block_backward_from(e, d, p, x, &s, dout, grads)
}

/// [`gpt2_block_backward`] from the forward [`gpt2_block_forward_kept`]
/// kept (for these params and this batch shape), with no recompute.
pub fn gpt2_block_backward_kept<E: Exec>(
    e: &E,
    d: &Gpt2Dims,
    p: &[E::Buf],
    kept: Gpt2Kept<E::Buf>,
    dout: &E::Buf,
    grads: &mut [E::Buf],
) -> Result<E::Buf> {
    check_block(e, d, p, grads)?;
    check_kept(
        e,
        "gpt2 block",
        [&kept.x, &kept.s.p],
        [d.rows() * d.hidden, d.batch * d.heads * d.seq * d.seq],
    )?;
    block_backward_from(e, d, p, &kept.x, &kept.s, dout, grads)
}

/// The chain rule of a block from its forward's intermediates `s`.
fn block_backward_from<E: Exec>(
    e: &E,
    d: &Gpt2Dims,
    p: &[E::Buf],
    x: &E::Buf,
    s: &BlockSaved<E::Buf>,
    dout: &E::Buf,
    grads: &mut [E::Buf],
) -> Result<E::Buf> {
    let (h, inner) = (d.hidden, d.inner);
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
    let [dq, dk, dv] = e.attention_bwd(&s.p, [&s.q, &s.k, &s.v], &do_, d.attn())?;
    let mut dqkv = e.output("qkv gradient", d.rows() * 3 * h)?;
    let hs = d.heads_shape(3);
    e.rows_from_heads(&mut dqkv, &dq, hs, 0)?;
    e.rows_from_heads(&mut dqkv, &dk, hs, 1)?;
    e.rows_from_heads(&mut dqkv, &dv, hs, 2)?;
    let da = conv1d_bwd(e, d, &dqkv, &s.ln1[0], &p[2], (g2, g3), h, 3 * h)?;
    let dx_ln = e.layernorm_bwd(&da, x, &p[0], [&s.ln1[1], &s.ln1[2]], g0, g1, h)?;
    e.add(&dx1, &dx_ln)
}

/// What [`Gpt2Trainer`] keeps of a block's forward for its backward.
enum BlockInput<B> {
    /// Its input (recompute).
    Input(B),
    /// Its forward.
    Kept(Gpt2Kept<B>),
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
) -> Result<(HeadLoss<E::Buf>, E::Buf)> {
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
    let [g0, g1, g2] = grads;
    let (loss, dn) = lm_head(e, (rows, h, v), &ln[0], p[2], targets, loss_scale, g2)?;
    let dx = e.layernorm_bwd(&dn, x, p[0], [&ln[1], &ln[2]], g0, g1, h)?;
    Ok((loss, dx))
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
    /// Keep each block's forward for its backward instead of recomputing
    /// it ([`Gpt2Trainer::keep_activations`]).
    keep: bool,
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
            keep: false,
        })
    }

    /// With `keep`, each block's forward is kept until its backward
    /// ([`gpt2_block_forward_kept`]): one forward per step instead of
    /// two, for the memory of every block's intermediates. The same bits
    /// either way.
    pub fn keep_activations(&mut self, keep: bool) {
        self.keep = keep;
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
            let p = &self.params[self.block_range(l)];
            let (next, s) = if self.keep {
                let (next, kept) = gpt2_block_forward_kept(e, &d, p, h)?;
                (next, BlockInput::Kept(kept))
            } else {
                (gpt2_block_forward(e, &d, p, &h)?, BlockInput::Input(h))
            };
            saved.push(s);
            h = next;
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
        for (l, s) in saved.into_iter().enumerate().rev() {
            let r = self.block_range(l);
            let (p, g) = (&self.params[r.clone()], &mut self.grads[r]);
            up = match s {
                BlockInput::Kept(kept) => gpt2_block_backward_kept(e, &d, p, kept, &up, g)?,
                BlockInput::Input(x) => gpt2_block_backward(e, &d, p, &x, &up, g)?,
            };
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
        // Read back once the whole step is queued, not at the head.
        loss.mean(e)
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
    let mut draw = crate::reference::uniform(seed);
    let mut uniform = move || draw() - 0.5;
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
        run_keeping(steps, false)
    }

    fn run_keeping(steps: usize, keep: bool) -> (Vec<f32>, Vec<Vec<f32>>) {
        let d = dims();
        let init = gpt2_init(&d, 2, 8, 3);
        let hyper = AdamHyper {
            lr: 1e-2,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
        };
        let mut t = Gpt2Trainer::new(&HostExec::F32, d, 2, &init, hyper).unwrap();
        t.keep_activations(keep);
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

    #[test]
    fn keeping_each_block_s_forward_gives_the_recompute_s_bits() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let (losses, params) = run_keeping(4, false);
        let (kept, kept_params) = run_keeping(4, true);
        assert_eq!(bits(&losses), bits(&kept));
        assert!(params
            .iter()
            .zip(&kept_params)
            .all(|(a, b)| bits(a) == bits(b)));
    }

    #[test]
    fn a_kept_forward_of_another_batch_shape_is_refused() {
        let d = dims();
        let e = HostExec::F32;
        let init = gpt2_init(&d, 1, 8, 3);
        let p: Vec<Vec<f32>> = init[2..14].to_vec();
        let x: Vec<f32> = (0..d.batch * d.seq * d.hidden)
            .map(|i| (i % 11) as f32 * 0.1)
            .collect();
        let (out, kept) = gpt2_block_forward_kept(&e, &d, &p, x).unwrap();
        assert!(kept.numel(&e) > 4 * out.len(), "{}", kept.numel(&e));
        let other = Gpt2Dims {
            batch: 1,
            seq: 16,
            ..d
        };
        let mut g: Vec<Vec<f32>> = p.iter().map(|v| vec![0.0; v.len()]).collect();
        let err = gpt2_block_backward_kept(&e, &other, &p, kept, &out, &mut g).unwrap_err();
        assert!(err.to_string().contains("kept forward"), "{err}");
    }
}

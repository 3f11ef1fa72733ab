//! Scalar CPU references of every kernel in [`crate::kernels`], with the
//! kernels' arithmetic in the kernels' order: the same per-thread partial
//! sums and block-sum tree ([`block_sum`]), the same operations left to
//! right, `mul_add` exactly where the sources write `fmaf` (the kernels
//! compile with `--fmad=false`). Storage goes through [`Storage`] (fp32,
//! bf16, fp16; rounding to nearest even, as `cvt.rn`). The transcendental
//! functions (`exp`, `tanh`, `ln`) are Rust's, within a few ulp of CUDA's.
//!
//! These are the functions the device check compares each kernel with;
//! `tests/reference.rs` checks them against candle's autograd.

use half::{bf16, f16};

use crate::kernels::{BLOCK_THREADS, ROW_CHUNK};
use crate::norm::{combine_lanes, fold_groups, NormGroup, NormPlan, NORM_LANES};
use crate::Result;

const BLOCK: usize = BLOCK_THREADS as usize;

/// A storage dtype: loaded to f32, stored from f32.
pub trait Storage: Copy + Default + std::fmt::Debug + PartialEq + Send + Sync + 'static {
    /// Its value as f32 (exact).
    fn load(self) -> f32;
    /// `x` rounded to nearest even (NaN stays NaN).
    fn store(x: f32) -> Self;
}

impl Storage for f32 {
    fn load(self) -> f32 {
        self
    }
    fn store(x: f32) -> Self {
        x
    }
}

impl Storage for bf16 {
    fn load(self) -> f32 {
        self.to_f32()
    }
    fn store(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

impl Storage for f16 {
    fn load(self) -> f32 {
        self.to_f32()
    }
    fn store(x: f32) -> Self {
        f16::from_f32(x)
    }
}

/// `tz_warp_sum`: the butterfly xor 16, 8, 4, 2, 1 over 32 lanes; lane 0's
/// value (every lane ends with it).
fn warp_sum(mut lanes: [f32; 32]) -> f32 {
    let mut o = 16;
    while o > 0 {
        let prev = lanes;
        for (i, l) in lanes.iter_mut().enumerate() {
            *l = prev[i] + prev[i ^ o];
        }
        o >>= 1;
    }
    lanes[0]
}

/// `tz_block_sum` over a block of [`BLOCK_THREADS`] threads whose thread
/// `j` holds `partials[j]`.
pub fn block_sum(partials: &[f32; BLOCK]) -> f32 {
    let mut warps = [0f32; 32];
    for (w, chunk) in partials.chunks_exact(32).enumerate() {
        let mut lanes = [0f32; 32];
        lanes.copy_from_slice(chunk);
        warps[w] = warp_sum(lanes);
    }
    warp_sum(warps)
}

/// Thread `j`'s partial sum of `term(i)` for `i = j, j + BLOCK, ... < n`,
/// then [`block_sum`]: a block's strided loop and reduction.
pub fn strided_block_sum(n: usize, term: impl Fn(usize) -> f32) -> f32 {
    let mut partials = [0f32; BLOCK];
    for (j, p) in partials.iter_mut().enumerate() {
        let mut s = 0f32;
        let mut i = j;
        while i < n {
            s += term(i);
            i += BLOCK;
        }
        *p = s;
    }
    block_sum(&partials)
}

fn block_max(n: usize, term: impl Fn(usize) -> f32) -> f32 {
    (0..n).fold(f32::NEG_INFINITY, |m, i| m.max(term(i)))
}

/// The kernels' column sum (prelude.cu, "Column sums"): `acc[c] +=` the sum
/// of `term(r, c)` over `rows`, each chunk of [`ROW_CHUNK`] rows added in
/// order from 0.0, then the chunks' sums left to right from the first
/// (`col_sums_finish`). No rows: `acc` is left as it is.
pub fn col_sums_into(acc: &mut [f32], rows: usize, term: impl Fn(usize, usize) -> f32) {
    for (c, a) in acc.iter_mut().enumerate() {
        let mut total: Option<f32> = None;
        for r0 in (0..rows).step_by(ROW_CHUNK) {
            let chunk = (r0..(r0 + ROW_CHUNK).min(rows)).fold(0f32, |s, r| s + term(r, c));
            total = Some(total.map_or(chunk, |t| t + chunk));
        }
        if let Some(t) = total {
            *a += t;
        }
    }
}

/// `embedding_fwd`: the rows of `table` ([vocab, hidden]) at `ids`; a NaN
/// row for an id outside the vocabulary.
pub fn embedding_fwd<T: Storage>(table: &[T], ids: &[i32], hidden: usize) -> Vec<T> {
    let vocab = table.len() / hidden.max(1);
    let mut out = Vec::with_capacity(ids.len() * hidden);
    for &id in ids {
        match usize::try_from(id).ok().filter(|&i| i < vocab) {
            Some(i) => out.extend_from_slice(&table[i * hidden..(i + 1) * hidden]),
            None => out.extend(std::iter::repeat_n(T::store(f32::NAN), hidden)),
        }
    }
    out
}

/// The host's plan for `embedding_bwd`: the distinct ids (ascending), the
/// token positions sorted by (id, position), and each id's run in them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmbeddingRuns {
    /// Distinct ids, ascending.
    pub uniq: Vec<i32>,
    /// `starts[u] .. starts[u + 1]`: the positions of `uniq[u]` in `order`.
    pub starts: Vec<i32>,
    /// Token positions sorted by (id, position).
    pub order: Vec<i32>,
}

/// [`EmbeddingRuns`] of `ids` (a counting sort would do; a stable sort is
/// simpler and the host does it once per step).
pub fn embedding_runs(ids: &[i32]) -> EmbeddingRuns {
    let mut order: Vec<i32> = (0..ids.len() as i32).collect();
    order.sort_by_key(|&p| ids[p as usize]);
    let (mut uniq, mut starts) = (Vec::new(), Vec::new());
    for (k, &p) in order.iter().enumerate() {
        let id = ids[p as usize];
        if uniq.last() != Some(&id) {
            uniq.push(id);
            starts.push(k as i32);
        }
    }
    starts.push(order.len() as i32);
    EmbeddingRuns {
        uniq,
        starts,
        order,
    }
}

/// `embedding_bwd`: `grad_table[id] += ` the id's rows of `grad_out`, in
/// position order.
pub fn embedding_bwd<T: Storage>(
    grad_table: &mut [f32],
    grad_out: &[T],
    ids: &[i32],
    hidden: usize,
) {
    let runs = embedding_runs(ids);
    for (u, &id) in runs.uniq.iter().enumerate() {
        let run = &runs.order[runs.starts[u] as usize..runs.starts[u + 1] as usize];
        for h in 0..hidden {
            let mut s = 0f32;
            for &p in run {
                s += grad_out[p as usize * hidden + h].load();
            }
            grad_table[id as usize * hidden + h] += s;
        }
    }
}

/// `layernorm_fwd` over `rows` rows of `cols`: `(y, mean, rstd)`.
pub fn layernorm_fwd<T: Storage>(
    x: &[T],
    w: &[T],
    b: Option<&[T]>,
    cols: usize,
    eps: f32,
) -> (Vec<T>, Vec<f32>, Vec<f32>) {
    let rows = x.len() / cols.max(1);
    let (mut y, mut mean, mut rstd) = (
        vec![T::default(); x.len()],
        vec![0f32; rows],
        vec![0f32; rows],
    );
    for r in 0..rows {
        let xr = &x[r * cols..(r + 1) * cols];
        let mu = strided_block_sum(cols, |c| xr[c].load()) / cols as f32;
        let var = strided_block_sum(cols, |c| {
            let d = xr[c].load() - mu;
            d * d
        }) / cols as f32;
        let rs = 1.0 / (var + eps).sqrt();
        for c in 0..cols {
            let bias = b.map_or(0.0, |b| b[c].load());
            y[r * cols + c] = T::store((xr[c].load() - mu) * rs * w[c].load() + bias);
        }
        mean[r] = mu;
        rstd[r] = rs;
    }
    (y, mean, rstd)
}

/// `layernorm_bwd_dx`.
pub fn layernorm_bwd_dx<T: Storage>(
    dy: &[T],
    x: &[T],
    w: &[T],
    mean: &[f32],
    rstd: &[f32],
    cols: usize,
) -> Vec<T> {
    let mut dx = vec![T::default(); x.len()];
    for (r, (&mu, &rs)) in mean.iter().zip(rstd).enumerate() {
        let o = r * cols;
        let g = |c: usize| dy[o + c].load() * w[c].load();
        let xhat = |c: usize| (x[o + c].load() - mu) * rs;
        let mg = strided_block_sum(cols, g) / cols as f32;
        let mgx = strided_block_sum(cols, |c| g(c) * xhat(c)) / cols as f32;
        for c in 0..cols {
            dx[o + c] = T::store(rs * (g(c) - mg - xhat(c) * mgx));
        }
    }
    dx
}

/// `layernorm_bwd_wb` and its `col_sums_finish`: `dw += Σ_rows dy·xhat`,
/// `db += Σ_rows dy` ([`col_sums_into`]).
pub fn layernorm_bwd_wb<T: Storage>(
    dw: &mut [f32],
    db: Option<&mut [f32]>,
    dy: &[T],
    x: &[T],
    mean: &[f32],
    rstd: &[f32],
    cols: usize,
) {
    let rows = mean.len().min(rstd.len());
    col_sums_into(dw, rows, |r, c| {
        let g = dy[r * cols + c].load();
        g * ((x[r * cols + c].load() - mean[r]) * rstd[r])
    });
    if let Some(db) = db {
        col_sums_into(db, rows, |r, c| dy[r * cols + c].load());
    }
}

/// `rmsnorm_fwd`: `(y, rstd)`.
pub fn rmsnorm_fwd<T: Storage>(x: &[T], w: &[T], cols: usize, eps: f32) -> (Vec<T>, Vec<f32>) {
    let rows = x.len() / cols.max(1);
    let (mut y, mut rstd) = (vec![T::default(); x.len()], vec![0f32; rows]);
    for r in 0..rows {
        let xr = &x[r * cols..(r + 1) * cols];
        let ms = strided_block_sum(cols, |c| {
            let v = xr[c].load();
            v * v
        }) / cols as f32;
        let rs = 1.0 / (ms + eps).sqrt();
        for c in 0..cols {
            y[r * cols + c] = T::store(xr[c].load() * rs * w[c].load());
        }
        rstd[r] = rs;
    }
    (y, rstd)
}

/// `rmsnorm_bwd_dx`.
pub fn rmsnorm_bwd_dx<T: Storage>(dy: &[T], x: &[T], w: &[T], rstd: &[f32], cols: usize) -> Vec<T> {
    let mut dx = vec![T::default(); x.len()];
    for (r, &rs) in rstd.iter().enumerate() {
        let o = r * cols;
        let mgx = strided_block_sum(cols, |c| {
            dy[o + c].load() * w[c].load() * (x[o + c].load() * rs)
        }) / cols as f32;
        for c in 0..cols {
            let g = dy[o + c].load() * w[c].load();
            dx[o + c] = T::store(rs * (g - (x[o + c].load() * rs) * mgx));
        }
    }
    dx
}

/// `rmsnorm_bwd_w` and its `col_sums_finish`: `dw += Σ_rows dy·xhat`
/// ([`col_sums_into`]).
pub fn rmsnorm_bwd_w<T: Storage>(dw: &mut [f32], dy: &[T], x: &[T], rstd: &[f32], cols: usize) {
    let n = cols.min(dw.len());
    let dw = &mut dw[..n];
    col_sums_into(dw, rstd.len(), |r, c| {
        dy[r * cols + c].load() * (x[r * cols + c].load() * rstd[r])
    });
}

/// The shape of a rotary embedding's input: [batch, seq, heads, head_dim].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RopeShape {
    /// Batch.
    pub batch: usize,
    /// Sequence length (positions 0..seq).
    pub seq: usize,
    /// Heads.
    pub heads: usize,
    /// Elements per head (even).
    pub head_dim: usize,
}

/// `rope`: rotate by `sign`·θ; `cos`, `sin` are [seq, head_dim / 2].
pub fn rope<T: Storage>(x: &[T], cos: &[f32], sin: &[f32], s: RopeShape, sign: f32) -> Vec<T> {
    let half = s.head_dim / 2;
    let mut y = x.to_vec();
    for row in 0..s.batch * s.seq * s.heads {
        let t = (row / s.heads) % s.seq;
        for j in 0..half {
            let (c, sn) = (cos[t * half + j], sign * sin[t * half + j]);
            let a = row * s.head_dim + j;
            let (x1, x2) = (x[a].load(), x[a + half].load());
            y[a] = T::store(x1 * c - x2 * sn);
            y[a + half] = T::store(x2 * c + x1 * sn);
        }
    }
    y
}

/// `softmax_causal_fwd` over rows of `seq` scores (row `r` is query
/// `r % seq`).
pub fn softmax_causal_fwd<T: Storage>(s: &[T], seq: usize, scale: f32) -> Vec<T> {
    let mut p = vec![T::default(); s.len()];
    for (row, (sr, pr)) in s.chunks_exact(seq).zip(p.chunks_exact_mut(seq)).enumerate() {
        let t = row % seq;
        let mx = block_max(t + 1, |j| sr[j].load() * scale);
        let sum = strided_block_sum(t + 1, |j| (sr[j].load() * scale - mx).exp());
        let inv = 1.0 / sum;
        for (j, pj) in pr.iter_mut().enumerate() {
            *pj = T::store(if j <= t {
                (sr[j].load() * scale - mx).exp() * inv
            } else {
                0.0
            });
        }
    }
    p
}

/// `softmax_bwd`.
pub fn softmax_bwd<T: Storage>(p: &[T], dp: &[T], seq: usize, scale: f32) -> Vec<T> {
    let mut ds = vec![T::default(); p.len()];
    for ((pr, dpr), dsr) in p
        .chunks_exact(seq)
        .zip(dp.chunks_exact(seq))
        .zip(ds.chunks_exact_mut(seq))
    {
        let dot = strided_block_sum(seq, |j| pr[j].load() * dpr[j].load());
        for j in 0..seq {
            dsr[j] = T::store(pr[j].load() * (dpr[j].load() - dot) * scale);
        }
    }
    ds
}

const GELU_K: f32 = 0.797_884_6;
const GELU_C: f32 = 0.044715;

/// `gelu_tanh_fwd`.
pub fn gelu_tanh_fwd<T: Storage>(x: &[T]) -> Vec<T> {
    x.iter()
        .map(|&x| {
            let v = x.load();
            let u = GELU_K * (v + GELU_C * v * v * v);
            T::store(0.5 * v * (1.0 + u.tanh()))
        })
        .collect()
}

/// `gelu_tanh_bwd`.
pub fn gelu_tanh_bwd<T: Storage>(dy: &[T], x: &[T]) -> Vec<T> {
    dy.iter()
        .zip(x)
        .map(|(&dy, &x)| {
            let v = x.load();
            let u = GELU_K * (v + GELU_C * v * v * v);
            let th = u.tanh();
            let du = GELU_K * (1.0 + 3.0 * GELU_C * v * v);
            let d = 0.5 * (1.0 + th) + 0.5 * v * (1.0 - th * th) * du;
            T::store(dy.load() * d)
        })
        .collect()
}

/// `swiglu_fwd`.
pub fn swiglu_fwd<T: Storage>(gate: &[T], up: &[T]) -> Vec<T> {
    gate.iter()
        .zip(up)
        .map(|(&g, &u)| {
            let g = g.load();
            T::store(g / (1.0 + (-g).exp()) * u.load())
        })
        .collect()
}

/// `swiglu_bwd`: `(dgate, dup)`.
pub fn swiglu_bwd<T: Storage>(dy: &[T], gate: &[T], up: &[T]) -> (Vec<T>, Vec<T>) {
    let mut dgate = Vec::with_capacity(dy.len());
    let mut dup = Vec::with_capacity(dy.len());
    for ((&d, &g), &u) in dy.iter().zip(gate).zip(up) {
        let (g, u, d) = (g.load(), u.load(), d.load());
        let sig = 1.0 / (1.0 + (-g).exp());
        dup.push(T::store(d * (g * sig)));
        dgate.push(T::store(d * u * sig * (1.0 + g * (1.0 - sig))));
    }
    (dgate, dup)
}

/// `bias_add` (in place).
pub fn bias_add<T: Storage>(y: &mut [T], b: &[T]) {
    let cols = b.len();
    for (i, v) in y.iter_mut().enumerate() {
        *v = T::store(v.load() + b[i % cols].load());
    }
}

/// `bias_grad` and its `col_sums_finish`: `db += Σ_rows dy`
/// ([`col_sums_into`]).
pub fn bias_grad<T: Storage>(db: &mut [f32], dy: &[T]) {
    let cols = db.len();
    col_sums_into(db, dy.len() / cols.max(1), |r, c| dy[r * cols + c].load());
}

/// `cross_entropy` over rows of `vocab` logits: the per-row losses, and
/// (with `grad_scale`) the logits' gradient.
pub fn cross_entropy<T: Storage>(
    logits: &[T],
    targets: &[i32],
    vocab: usize,
    ignore_index: i32,
    grad_scale: Option<f32>,
) -> (Vec<f32>, Option<Vec<T>>) {
    let mut loss = vec![0f32; targets.len()];
    let mut grad = grad_scale.map(|_| vec![T::default(); logits.len()]);
    for (row, &target) in targets.iter().enumerate() {
        let lr = &logits[row * vocab..(row + 1) * vocab];
        if target == ignore_index {
            if let Some(g) = grad.as_mut() {
                g[row * vocab..(row + 1) * vocab].fill(T::store(0.0));
            }
            continue;
        }
        let mx = block_max(vocab, |j| lr[j].load());
        let lse = mx + strided_block_sum(vocab, |j| (lr[j].load() - mx).exp()).ln();
        loss[row] = match usize::try_from(target).ok().filter(|&t| t < vocab) {
            Some(t) => lse - lr[t].load(),
            None => f32::NAN,
        };
        if let (Some(g), Some(scale)) = (grad.as_mut(), grad_scale) {
            for j in 0..vocab {
                let pj = (lr[j].load() - lse).exp();
                let hot = if j as i32 == target { 1.0 } else { 0.0 };
                g[row * vocab + j] = T::store((pj - hot) * scale);
            }
        }
    }
    (loss, grad)
}

/// `sum_f32`.
pub fn sum_f32(x: &[f32]) -> f32 {
    strided_block_sum(x.len(), |i| x[i])
}

/// The `cast_*` kernels.
pub fn cast<S: Storage, D: Storage>(src: &[S]) -> Vec<D> {
    src.iter().map(|s| D::store(s.load())).collect()
}

/// `sumsq_parts`: every part's Σ x² of the groups (in plan order), in
/// the order of [`crate::norm`]: each segment's elements in flat order,
/// each onto its lane's f64 sum, the lanes added pairwise, neighbours
/// first ([`combine_lanes`]).
pub fn sumsq_parts(groups: &[NormGroup<'_, Vec<f32>>]) -> Result<Vec<f64>> {
    Ok(parts_of(groups, &NormPlan::new(groups, Vec::len)?))
}

/// [`sumsq_parts`] by `plan`, made from `groups`.
fn parts_of(groups: &[NormGroup<'_, Vec<f32>>], plan: &NormPlan) -> Vec<f64> {
    let mut out = Vec::with_capacity(plan.total_parts());
    for part in plan.parts.chunks_exact(4) {
        let [a, b, s0, s1] = [part[0], part[1], part[2], part[3]].map(|v| v as usize);
        let mut acc = [0f64; NORM_LANES];
        for &(gi, si) in &plan.segments[s0..s1] {
            let s = &groups[gi].segments[si];
            let (lo, hi) = (a.max(s.flat_start), b.min(s.flat_start + s.numel));
            for f in lo..hi {
                let g = f64::from(s.buf[s.offset + f - s.flat_start]);
                let lane = &mut acc[(f - a) % NORM_LANES];
                *lane = g.mul_add(g, *lane);
            }
        }
        out.push(combine_lanes(acc));
    }
    out
}

/// Each group's Σ x² ([`sumsq_parts`], the parts added in order).
pub fn norm_sq_sums(groups: &[NormGroup<'_, Vec<f32>>]) -> Result<Vec<f64>> {
    let plan = NormPlan::new(groups, Vec::len)?;
    Ok(fold_groups(&plan, &parts_of(groups, &plan)))
}

/// The f32 constants of one AdamW step, as the CPU kernel derives them
/// (`src/optim/mod.rs`, `StepScalars`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamScalars {
    /// Gradient multiplier (unscale and clip).
    pub grad_scale: f32,
    /// β1.
    pub beta1: f32,
    /// 1 − β1.
    pub one_minus_beta1: f32,
    /// β2.
    pub beta2: f32,
    /// 1 − β2.
    pub one_minus_beta2: f32,
    /// ε.
    pub eps: f32,
    /// −lr / (1 − β1^t).
    pub neg_step_size: f32,
    /// 1 / sqrt(1 − β2^t).
    pub inv_sqrt_bc2: f32,
    /// −lr · weight decay.
    pub neg_lr_wd: f32,
}

/// `adamw`: one step of every element; `out` gets the new params in `T`.
pub fn adamw<T: Storage>(
    master: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    grad: &[f32],
    mut out: Option<&mut [T]>,
    s: AdamScalars,
) {
    for i in 0..master.len() {
        let g = grad[i] * s.grad_scale;
        let m2 = s.beta1.mul_add(m[i], s.one_minus_beta1 * g);
        let v2 = s.beta2.mul_add(v[i], (s.one_minus_beta2 * g) * g);
        let den = v2.sqrt().mul_add(s.inv_sqrt_bc2, s.eps);
        let upd = m2 / den;
        let p = master[i];
        let p2 = s.neg_step_size.mul_add(upd, s.neg_lr_wd.mul_add(p, p));
        master[i] = p2;
        m[i] = m2;
        v[i] = v2;
        if let Some(o) = out.as_deref_mut() {
            o[i] = T::store(p2);
        }
    }
}

/// The shape `heads_from_rows` / `rows_from_heads` move between: rows
/// [batch, seq, slots · heads · head_dim] and heads [batch, heads, seq,
/// head_dim].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadsShape {
    /// Batch.
    pub batch: usize,
    /// Sequence length.
    pub seq: usize,
    /// Heads.
    pub heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Slots per row (3 for GPT-2's packed q | k | v, else 1).
    pub slots: usize,
}

impl HeadsShape {
    /// Elements of one slot's heads: batch · heads · seq · head_dim.
    pub fn heads_numel(&self) -> usize {
        self.batch * self.heads * self.seq * self.head_dim
    }

    /// Row index of heads element `i` in the rows layout, slot `slot`.
    fn row_index(&self, i: usize, slot: usize) -> usize {
        let d = i % self.head_dim;
        let t = (i / self.head_dim) % self.seq;
        let h = (i / (self.head_dim * self.seq)) % self.heads;
        let b = i / (self.head_dim * self.seq * self.heads);
        ((b * self.seq + t) * self.slots + slot) * self.heads * self.head_dim
            + h * self.head_dim
            + d
    }
}

/// `heads_from_rows`: slot `slot` of the rows, as heads.
pub fn heads_from_rows<T: Storage>(x: &[T], s: HeadsShape, slot: usize) -> Vec<T> {
    (0..s.heads_numel())
        .map(|i| x[s.row_index(i, slot)])
        .collect()
}

/// `rows_from_heads`: writes `x` (heads) into slot `slot` of `out` (rows).
pub fn rows_from_heads<T: Storage>(out: &mut [T], x: &[T], s: HeadsShape, slot: usize) {
    for (i, &v) in x.iter().enumerate().take(s.heads_numel()) {
        out[s.row_index(i, slot)] = v;
    }
}

/// `add`: `a + b` elementwise.
pub fn add<T: Storage>(a: &[T], b: &[T]) -> Vec<T> {
    a.iter()
        .zip(b)
        .map(|(x, y)| T::store(x.load() + y.load()))
        .collect()
}

/// `add_chunks`: `world` chunks of `n` elements of `T` (`chunks`, rank
/// r's at `r · n`), each widened exactly, added one after the other in
/// rank order onto `acc` (+0.0 when None): a reduce-scatter's sums, in
/// the order the host's collective adds them.
pub fn add_chunks<T: Storage>(acc: Option<&[f32]>, chunks: &[T], n: usize) -> Vec<f32> {
    let mut out = acc.map_or_else(|| vec![0f32; n], <[f32]>::to_vec);
    if n == 0 {
        return out;
    }
    for chunk in chunks.chunks_exact(n) {
        for (s, &c) in out.iter_mut().zip(chunk) {
            *s += c.load();
        }
    }
    out
}

/// The shape `repeat_kv` / `sum_kv` move between: [batch, kv_heads, n]
/// and [batch, kv_heads · group, n] (n = seq · head_dim).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    /// Batch.
    pub batch: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Query heads per key/value head.
    pub group: usize,
    /// Elements per head (seq · head_dim).
    pub n: usize,
}

/// `repeat_kv`: each key/value head repeated `group` times.
pub fn repeat_kv<T: Storage>(x: &[T], s: KvShape) -> Vec<T> {
    let mut out = Vec::with_capacity(x.len() * s.group);
    for b in 0..s.batch {
        for h in 0..s.kv_heads * s.group {
            let k = h / s.group;
            out.extend_from_slice(&x[(b * s.kv_heads + k) * s.n..(b * s.kv_heads + k + 1) * s.n]);
        }
    }
    out
}

/// `sum_kv`: the sum over each key/value head's `group` query heads.
pub fn sum_kv<T: Storage>(x: &[T], s: KvShape) -> Vec<T> {
    let mut out = Vec::with_capacity(s.batch * s.kv_heads * s.n);
    for b in 0..s.batch {
        for k in 0..s.kv_heads {
            for j in 0..s.n {
                let mut acc = 0f32;
                for g in 0..s.group {
                    acc += x[((b * s.kv_heads + k) * s.group + g) * s.n + j].load();
                }
                out.push(T::store(acc));
            }
        }
    }
    out
}

/// The product [`crate::ops::matmul`] asks cuBLAS for (row-major, per
/// batch: `C = α·op(A)·op(B) + β·C`, C not read when β is 0), summed in f64 (cuBLAS's order is its
/// own: compare within a tolerance).
///
/// Each element's sum runs over `k` in order from 0. Eight columns of a
/// row are summed side by side (eight independent sums, each in that
/// order, so the same bits as one column at a time): the simulated
/// device computes its units with this, and one dependent f64 add a step
/// made it most of the simulated tests' time.
#[allow(clippy::too_many_arguments)]
pub fn matmul<T: Storage>(
    c: &mut [T],
    a: &[T],
    b: &[T],
    batch: usize,
    (m, n, k): (usize, usize, usize),
    (trans_a, trans_b): (bool, bool),
    alpha: f32,
    beta: f32,
) {
    const COLS: usize = 8;
    for p in 0..batch {
        let (a, b) = (
            &a[p * m * k..(p + 1) * m * k],
            &b[p * k * n..(p + 1) * k * n],
        );
        for i in 0..m {
            for j0 in (0..n).step_by(COLS) {
                let cols = COLS.min(n - j0);
                let mut sums = [0f64; COLS];
                for l in 0..k {
                    let x = if trans_a { a[l * m + i] } else { a[i * k + l] };
                    let x = x.load() as f64;
                    for (dj, s) in sums[..cols].iter_mut().enumerate() {
                        let j = j0 + dj;
                        let y = if trans_b { b[j * k + l] } else { b[l * n + j] };
                        *s += x * y.load() as f64;
                    }
                }
                for (dj, s) in sums[..cols].iter().enumerate() {
                    let o = &mut c[p * m * n + i * n + j0 + dj];
                    // BLAS's rule, which cuBLAS follows: with β 0, C is not
                    // read (it may hold NaN or anything else).
                    let old = if beta == 0.0 {
                        0.0
                    } else {
                        beta as f64 * o.load() as f64
                    };
                    *o = T::store((alpha as f64 * s + old) as f32);
                }
            }
        }
    }
}

/// Deterministic test values: `n` draws in [-1, 1) from a xorshift
/// sequence seeded by `seed` (the kernels' checks and the units' tests
/// feed these).
pub fn test_values(n: usize, seed: u64) -> Vec<f32> {
    let mut u = uniform(seed);
    (0..n).map(|_| u() * 2.0 - 1.0).collect()
}

/// Deterministic draws in [0, 1) with 24 bits each, from a xorshift
/// sequence seeded by `seed` ([`test_values`] and
/// [`crate::unit::gpt2_init`] draw from it).
pub fn uniform(seed: u64) -> impl FnMut() -> f32 {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> 40) as f32 / (1u64 << 24) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One element at a time, each sum over `k` in order: what
    /// [`matmul`] must equal bit for bit.
    #[allow(clippy::too_many_arguments)]
    fn matmul_by_element<T: Storage>(
        c: &mut [T],
        a: &[T],
        b: &[T],
        batch: usize,
        (m, n, k): (usize, usize, usize),
        (trans_a, trans_b): (bool, bool),
        alpha: f32,
        beta: f32,
    ) {
        for p in 0..batch {
            let (a, b) = (&a[p * m * k..], &b[p * k * n..]);
            for i in 0..m {
                for j in 0..n {
                    let mut s = 0f64;
                    for l in 0..k {
                        let x = if trans_a { a[l * m + i] } else { a[i * k + l] };
                        let y = if trans_b { b[j * k + l] } else { b[l * n + j] };
                        s += x.load() as f64 * y.load() as f64;
                    }
                    let o = &mut c[p * m * n + i * n + j];
                    let old = if beta == 0.0 {
                        0.0
                    } else {
                        beta as f64 * o.load() as f64
                    };
                    *o = T::store((alpha as f64 * s + old) as f32);
                }
            }
        }
    }

    #[test]
    fn matmul_s_columns_side_by_side_give_the_bits_of_one_element_at_a_time() {
        // Widths under, at and over the eight columns summed together and
        // not a multiple of them; both transposes; β 0 over NaN (not read)
        // and β 0.5. Two kinds of operands: random ones spread over
        // magnitudes (an element or index taken wrongly shows), and ones
        // whose sums show their order: along k, op(A)'s rows are 1, 2^60,
        // -2^60, then small values, against an op(B) of ones, so that in
        // order the 1 is lost and the small values kept, and in any other
        // order not.
        for (batch, m, n, k) in [
            (1, 1, 1, 1),
            (2, 3, 7, 5),
            (1, 4, 8, 9),
            (3, 2, 17, 33),
            (1, 5, 29, 64),
        ] {
            let s = (m, n, k);
            for trans @ (trans_a, trans_b) in
                [(false, false), (true, false), (false, true), (true, true)]
            {
                // Memory laid out for the transposes from op(A)[i][l] and
                // op(B)[l][j].
                let lay_a = |f: &dyn Fn(usize, usize, usize) -> f32| {
                    let mut a = vec![0f32; batch * m * k];
                    for p in 0..batch {
                        for i in 0..m {
                            for l in 0..k {
                                let at = if trans_a { l * m + i } else { i * k + l };
                                a[p * m * k + at] = f(p, i, l);
                            }
                        }
                    }
                    a
                };
                let lay_b = |g: &dyn Fn(usize, usize, usize) -> f32| {
                    let mut b = vec![0f32; batch * k * n];
                    for p in 0..batch {
                        for l in 0..k {
                            for j in 0..n {
                                let at = if trans_b { j * k + l } else { l * n + j };
                                b[p * k * n + at] = g(p, l, j);
                            }
                        }
                    }
                    b
                };
                let random = |seed: u64, len: usize| {
                    let v = test_values(len, seed);
                    move |x: usize| v[x % len] * [1e-6f32, 1.0, 3e5][x % 3]
                };
                let (ra, rb) = (random(1, 97), random(2, 89));
                let small = test_values(k, 4);
                let operands = [
                    (
                        lay_a(&|p, i, l| ra((p * m + i) * k + l)),
                        lay_b(&|p, l, j| rb((p * k + l) * n + j)),
                    ),
                    (
                        lay_a(&|_, i, l| match l {
                            0 => 1.0,
                            1 => 2f32.powi(60),
                            2 => -(2f32.powi(60)),
                            _ => small[l] * 1e-3 * (i + 1) as f32,
                        }),
                        lay_b(&|_, _, _| 1.0),
                    ),
                ];
                for (a, b) in &operands {
                    for beta in [0.0f32, 0.5] {
                        let c0: Vec<f32> = if beta == 0.0 {
                            vec![f32::NAN; batch * m * n]
                        } else {
                            test_values(batch * m * n, 3)
                        };
                        let what = format!("{batch}x{m}x{n}x{k} {trans:?} beta {beta}");
                        let (mut got, mut want) = (c0.clone(), c0);
                        matmul(&mut got, a, b, batch, s, trans, 0.75, beta);
                        matmul_by_element(&mut want, a, b, batch, s, trans, 0.75, beta);
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&got), bits(&want), "{what}");
                        let to_bf16 = |v: &[f32]| {
                            v.iter()
                                .map(|&x| <bf16 as Storage>::store(x))
                                .collect::<Vec<_>>()
                        };
                        let (a, b) = (to_bf16(a), to_bf16(b));
                        let mut got = to_bf16(&got);
                        let mut want = got.clone();
                        matmul(&mut got, &a, &b, batch, s, trans, 1.0, beta);
                        matmul_by_element(&mut want, &a, &b, batch, s, trans, 1.0, beta);
                        let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&got), bits(&want), "bf16 {what}");
                    }
                }
            }
        }
    }

    #[test]
    fn add_chunks_adds_in_rank_order_onto_the_running_sum_each_chunk_widened() {
        // acc + c0 + c1 + c2 left to right: 1 + 1e8 rounds to 1e8, + 1
        // rounds back to 1e8, then 0; the chunks summed first, then added
        // to the running sum, would give 1.
        let got = add_chunks::<f32>(Some(&[1.0]), &[1e8, 1.0, -1e8], 1);
        assert_eq!(got, [0.0]);
        let chunks_first = 1f32 + (1e8f32 + 1.0 - 1e8);
        assert_eq!(chunks_first, 1.0);
        // bf16 chunks widened exactly: 1 + 2^-7 and 0.5.
        let chunks = [
            half::bf16::from_f32(1.0 + 1.0 / 128.0),
            half::bf16::from_f32(0.5),
        ];
        assert_eq!(add_chunks(None, &chunks, 1), [1.5 + 1.0 / 128.0]);
        // Two elements a chunk, three ranks; +0.0 for no running sum.
        let got = add_chunks::<f32>(None, &[1.0, 2.0, 10.0, 20.0, 100.0, 200.0], 2);
        assert_eq!(got, [111.0, 222.0]);
        assert_eq!(add_chunks::<f32>(None, &[-0.0], 1)[0].to_bits(), 0);
        assert!(add_chunks::<f32>(None, &[], 0).is_empty());
    }

    #[test]
    fn block_sum_is_the_butterfly_tree() {
        // Values whose sum depends on the order: the tree's, not the
        // left-to-right one.
        let mut p = [0f32; BLOCK];
        p[0] = 1e8;
        p[1] = 1.0;
        p[16] = -1e8;
        p[17] = 1.0;
        // Lane 0: (p0 + p16) + (p1 + p17) = 0 + 2.
        assert_eq!(block_sum(&p), 2.0);
        let seq = p.iter().fold(0f32, |a, &b| a + b);
        assert_ne!(seq, 2.0);
        let ones = [1f32; BLOCK];
        assert_eq!(block_sum(&ones), BLOCK as f32);
    }

    #[test]
    fn embedding_runs_sort_by_id_then_position() {
        let r = embedding_runs(&[5, 2, 5, 2, 9, 5]);
        assert_eq!(r.uniq, vec![2, 5, 9]);
        assert_eq!(r.order, vec![1, 3, 0, 2, 5, 4]);
        assert_eq!(r.starts, vec![0, 2, 5, 6]);
    }
}

//! Differentiable building blocks composed only of candle primitives.
//!
//! Why not `candle_nn`: `candle_nn::ops::{layer_norm, rms_norm,
//! softmax_last_dim}` (and the `LayerNorm` / `RmsNorm` modules that call them)
//! are fused custom ops whose backward is missing, so gradients through them
//! are silently dropped: training would "work" with frozen norms. The same
//! holds for `candle_nn::rotary_emb::rope` (`apply_op3_no_bwd`), so rotary
//! embedding is built here from narrow/cat/mul as well. Candle's
//! built-in `gelu` has a backward, but it uses constants rounded to six digits
//! (`0.0356774`, `0.797885`, ...), so its derivative disagrees with its own
//! forward at about 1e-6 relative, which would blur a tight finite-difference
//! check. Every function here is therefore built from ops whose backward is
//! exact in candle's `backprop.rs`: matmul, broadcast add/sub/mul/div, affine,
//! sqr, sqrt, exp, log, tanh, erf, silu, sum, narrow, cat, reshape,
//! transpose, index_select, gather.
//!
//! The max subtracted for numerical stability in softmax and log-softmax is
//! `detach`ed: both functions are invariant to it, so its true gradient is
//! zero, and detaching avoids the max-reduction backward (an equality mask)
//! that would add terms that cancel only up to rounding.

use candle_core::{DType, Device, Tensor, D};

/// `y = x W + b` with `W` in HF Conv1D layout `[in, out]`, over the last dim.
pub fn conv1d(x: &Tensor, w_in_out: &Tensor, b: Option<&Tensor>) -> candle_core::Result<Tensor> {
    let y = matmul_last(x, w_in_out)?;
    match b {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// `y = x W^T + b` with `W` in `nn.Linear` layout `[out, in]`, over the last dim.
pub fn linear(x: &Tensor, w_out_in: &Tensor, b: Option<&Tensor>) -> candle_core::Result<Tensor> {
    let y = matmul_last(x, &w_out_in.t()?)?;
    match b {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// `x [.., in] @ w [in, out]` as one 2-D GEMM over the flattened leading dims.
fn matmul_last(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let dims = x.dims().to_vec();
    let (lead, last) = dims.split_at(dims.len().saturating_sub(1));
    let rows: usize = lead.iter().product();
    let inner = last.first().copied().unwrap_or(1);
    let out = w.dim(1)?;
    let y = x.reshape((rows, inner))?.matmul(w)?;
    let mut out_dims = lead.to_vec();
    out_dims.push(out);
    y.reshape(out_dims)
}

/// LayerNorm over the last dim: `(x - mean) / sqrt(var + eps) * w + b`,
/// biased variance as in PyTorch.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let denom = (var + eps)?.sqrt()?;
    xc.broadcast_div(&denom)?.broadcast_mul(w)?.broadcast_add(b)
}

/// RMSNorm over the last dim: `x / sqrt(mean(x^2) + eps) * w`.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    let denom = (ms + eps)?.sqrt()?;
    x.broadcast_div(&denom)?.broadcast_mul(w)
}

/// Softmax over the last dim (max-subtracted, max detached).
pub fn softmax_last(x: &Tensor) -> candle_core::Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    let s = e.sum_keepdim(D::Minus1)?;
    e.broadcast_div(&s)
}

/// GELU, tanh approximation (GPT-2's `gelu_new`):
/// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
pub fn gelu_tanh(x: &Tensor) -> candle_core::Result<Tensor> {
    const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
    let x3 = x.sqr()?.mul(x)?;
    let inner = (x + x3.affine(0.044715, 0.0)?)?.affine(SQRT_2_OVER_PI, 0.0)?;
    let t = (inner.tanh()? + 1.0)?;
    x.mul(&t)?.affine(0.5, 0.0)
}

/// GELU with the exact erf: `0.5 x (1 + erf(x / sqrt 2))`.
pub fn gelu_erf(x: &Tensor) -> candle_core::Result<Tensor> {
    let e = (x.affine(std::f64::consts::FRAC_1_SQRT_2, 0.0)?.erf()? + 1.0)?;
    x.mul(&e)?.affine(0.5, 0.0)
}

/// Causal additive mask `[t, t]`: 0 where key <= query, -inf above.
pub fn causal_mask(t: usize, dtype: DType, device: &Device) -> candle_core::Result<Tensor> {
    let mut m = vec![0f32; t * t];
    for (i, row) in m.chunks_mut(t).enumerate() {
        for v in row.iter_mut().skip(i + 1) {
            *v = f32::NEG_INFINITY;
        }
    }
    Tensor::from_vec(m, (t, t), device)?.to_dtype(dtype)
}

/// Causal self-attention on `q [b, h, t, d]`, `k, v [b, h, t, d]`
/// (already head-split); returns `[b, h, t, d]`.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> candle_core::Result<Tensor> {
    let (_, _, t, d) = q.dims4()?;
    let scale = 1.0 / (d as f64).sqrt();
    let att = q.matmul(&k.t()?)?.affine(scale, 0.0)?;
    let mask = causal_mask(t, q.dtype(), q.device())?;
    let att = softmax_last(&att.broadcast_add(&mask)?)?;
    att.matmul(v)
}

/// Rotary tables `cos, sin` of shape `[t, head_dim]` in HF's "rotate_half"
/// layout (the frequency vector repeated twice), computed in f64 on the host.
pub fn rope_tables(
    t: usize,
    head_dim: usize,
    theta: f64,
    dtype: DType,
    device: &Device,
) -> candle_core::Result<(Tensor, Tensor)> {
    let half = head_dim / 2;
    let mut cos = Vec::with_capacity(t * head_dim);
    let mut sin = Vec::with_capacity(t * head_dim);
    for pos in 0..t {
        for _repeat in 0..2 {
            for i in 0..half {
                let inv_freq = theta.powf(-((2 * i) as f64) / head_dim as f64);
                let angle = pos as f64 * inv_freq;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
    }
    let cos = Tensor::from_vec(cos, (t, head_dim), device)?.to_dtype(dtype)?;
    let sin = Tensor::from_vec(sin, (t, head_dim), device)?.to_dtype(dtype)?;
    Ok((cos, sin))
}

/// Applies rotary embedding to `x [b, h, t, d]`: `x cos + rotate_half(x) sin`.
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let half = d / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?
}

/// Repeats key/value heads `[b, kv, t, d] -> [b, kv * n_rep, t, d]` (GQA).
pub fn repeat_kv(x: &Tensor, n_rep: usize) -> candle_core::Result<Tensor> {
    if n_rep == 1 {
        return Ok(x.clone());
    }
    let (b, kv, t, d) = x.dims4()?;
    x.unsqueeze(2)?
        .broadcast_as((b, kv, n_rep, t, d))?
        .reshape((b, kv * n_rep, t, d))
}

/// Mean cross-entropy of `logits [n, v]` against `targets [n]` (u32):
/// `-mean(logits[i, y_i] - logsumexp(logits[i]))`, log-softmax by max
/// subtraction (max detached, see module docs).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    let n = logits.dim(0)?;
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let shifted = logits.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let logp = shifted.broadcast_sub(&lse)?;
    let picked = logp.gather(&targets.reshape((n, 1))?.contiguous()?, 1)?;
    picked.sum_all()?.affine(-1.0 / n as f64, 0.0)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;
    use candle_core::Var;

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    }

    fn input(shape: (usize, usize, usize)) -> Tensor {
        let n = shape.0 * shape.1 * shape.2;
        let v: Vec<f64> = (0..n)
            .map(|i| ((i * 7919) % 23) as f64 / 7.0 - 1.3)
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// Forward agreement with candle_nn's fused ops (forward-only there;
    /// they support f32, not f64).
    #[test]
    fn forward_matches_candle_nn() {
        let f32_ = |t: Tensor| t.to_dtype(DType::F32).unwrap();
        let x = f32_(input((2, 3, 8)));
        let w = f32_(
            Tensor::arange(0f64, 8.0, &Device::Cpu)
                .unwrap()
                .affine(0.1, 0.5)
                .unwrap(),
        );
        let b = f32_(
            Tensor::arange(0f64, 8.0, &Device::Cpu)
                .unwrap()
                .affine(-0.05, 0.2)
                .unwrap(),
        );
        let close = |a: &Tensor, b: &Tensor| {
            let a = a.to_dtype(DType::F64).unwrap();
            let b = b.to_dtype(DType::F64).unwrap();
            max_abs_diff(&a, &b)
        };
        let ours = layer_norm(&x, &w, &b, 1e-5).unwrap();
        let theirs = candle_nn::ops::layer_norm(&x, &w, &b, 1e-5).unwrap();
        assert!(close(&ours, &theirs) < 1e-5);
        let ours = rms_norm(&x, &w, 1e-6).unwrap();
        let theirs = candle_nn::ops::rms_norm(&x, &w, 1e-6).unwrap();
        assert!(close(&ours, &theirs) < 1e-5);
        let ours = softmax_last(&x).unwrap();
        let theirs = candle_nn::ops::softmax_last_dim(&x).unwrap();
        assert!(close(&ours, &theirs) < 1e-6);
        // candle's gelu is the tanh approximation; its forward matches ours.
        let x = input((2, 3, 8));
        let ours = gelu_tanh(&x).unwrap();
        assert!(max_abs_diff(&ours, &x.gelu().unwrap()) < 1e-12);
        let ours = gelu_erf(&x).unwrap();
        assert!(max_abs_diff(&ours, &x.gelu_erf().unwrap()) < 1e-6);
    }

    /// The reason this module exists: the fused norm drops its gradient.
    /// If a future candle adds a backward, this test tells us to revisit.
    #[test]
    fn fused_layer_norm_drops_gradient_ours_does_not() {
        let x = input((1, 2, 4)).to_dtype(DType::F32).unwrap();
        let x = Var::from_tensor(&x).unwrap();
        let w = Var::from_tensor(&Tensor::ones(4, DType::F32, &Device::Cpu).unwrap()).unwrap();
        let b = Var::from_tensor(&Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap()).unwrap();
        // The fused op runs forward fine...
        let fused = candle_nn::ops::layer_norm(&x, &w, &b, 1e-5).unwrap();
        // ...but its backward gives nothing (or an error) for w.
        let fused_grad = fused
            .sqr()
            .and_then(|y| y.sum_all()?.backward())
            .map(|g| g.get(&w).is_some());
        assert!(
            !matches!(fused_grad, Ok(true)),
            "candle_nn layer_norm now has a backward: revisit src/model/ops.rs"
        );
        let ours = layer_norm(&x, &w, &b, 1e-5).unwrap();
        let g = ours.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        assert!(g.get(&w).is_some() && g.get(&b).is_some() && g.get(&x).is_some());
    }

    #[test]
    fn cross_entropy_of_uniform_logits_is_ln_v() {
        let logits = Tensor::zeros((3, 7), DType::F64, &Device::Cpu).unwrap();
        let targets = Tensor::new(&[0u32, 3, 6], &Device::Cpu).unwrap();
        let l = cross_entropy(&logits, &targets)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        assert!((l - 7f64.ln()).abs() < 1e-12);
    }

    #[test]
    fn rope_position_zero_is_identity_and_preserves_norm() {
        let x = input((1, 3, 4)).unsqueeze(0).unwrap(); // [1, 1, 3, 4]
        let (cos, sin) = rope_tables(3, 4, 10000.0, DType::F64, &Device::Cpu).unwrap();
        let y = apply_rope(&x, &cos, &sin).unwrap();
        let x0 = x.narrow(2, 0, 1).unwrap();
        let y0 = y.narrow(2, 0, 1).unwrap();
        assert!(max_abs_diff(&x0, &y0) < 1e-15);
        let nx = x.sqr().unwrap().sum(3).unwrap();
        let ny = y.sqr().unwrap().sum(3).unwrap();
        assert!(max_abs_diff(&nx, &ny) < 1e-12);
    }
}

//! Differentiable building blocks composed of candle primitives: the
//! reference the fused ops (`super::fused`, what training runs unless
//! `TIERZERO_PRIMITIVE_OPS=1`) are tested against, and the ops that have no
//! fused form. Where a fused op exists (`conv1d`, `linear`, the attention
//! window), the function here calls it; the primitive chain is then in
//! `super::fused`'s fallback.
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
//! check. The primitive functions here are therefore built from ops whose
//! backward is exact in candle's `backprop.rs`: matmul, broadcast add/sub/mul/div, affine,
//! sqr, sqrt, exp, log, tanh, erf, silu, sum, narrow, cat, reshape,
//! transpose, index_select, gather.
//!
//! The max subtracted for numerical stability in softmax and log-softmax is
//! `detach`ed: both functions are invariant to it, so its true gradient is
//! zero, and detaching avoids the max-reduction backward (an equality mask)
//! that would add terms that cancel only up to rounding.

use candle_core::{DType, Device, Tensor, D};

use super::config::{ModelConfig, RopeScaling};

/// `y = x W + b` with `W` in HF Conv1D layout `[in, out]`, over the last dim.
pub fn conv1d(x: &Tensor, w_in_out: &Tensor, b: Option<&Tensor>) -> candle_core::Result<Tensor> {
    super::fused::linear(x, w_in_out, b, super::fused::WeightLayout::InOut)
}

/// `y = x W^T + b` with `W` in `nn.Linear` layout `[out, in]`, over the last dim.
pub fn linear(x: &Tensor, w_out_in: &Tensor, b: Option<&Tensor>) -> candle_core::Result<Tensor> {
    super::fused::linear(x, w_out_in, b, super::fused::WeightLayout::OutIn)
}

/// `x [.., in] @ w [in, out]` as one 2-D GEMM over the flattened leading dims.
pub(super) fn matmul_last(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
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
    causal_mask_window(t, None, dtype, device)
}

/// Causal additive mask `[t, t]` with an optional sliding window `w`:
/// query `i` sees key `j` when `j <= i` and `i - j < w` (`w` keys, itself
/// included: transformers' `kv_idx > q_idx - sliding_window`), -inf
/// elsewhere. A window of `t` or more is the plain causal mask.
pub fn causal_mask_window(
    t: usize,
    window: Option<usize>,
    dtype: DType,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let mut m = vec![0f32; t * t];
    for (i, row) in m.chunks_mut(t).enumerate() {
        for (j, v) in row.iter_mut().enumerate() {
            if j > i || window.is_some_and(|w| i - j >= w) {
                *v = f32::NEG_INFINITY;
            }
        }
    }
    Tensor::from_vec(m, (t, t), device)?.to_dtype(dtype)
}

/// Causal self-attention on `q [b, h, t, d]`, `k, v [b, h, t, d]`
/// (already head-split); returns `[b, h, t, d]`.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> candle_core::Result<Tensor> {
    causal_attention_window(q, k, v, None)
}

/// [`causal_attention`] with an optional sliding window (see
/// [`causal_mask_window`]).
pub fn causal_attention_window(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    window: Option<usize>,
) -> candle_core::Result<Tensor> {
    let (_, _, _, d) = q.dims4()?;
    let scale = 1.0 / (d as f64).sqrt();
    let att = super::fused::causal_softmax(&q.matmul(&k.t()?)?, scale, window)?;
    att.matmul(v)
}

/// Rotary tables `cos, sin` of shape `[t, head_dim]` in HF's "rotate_half"
/// layout (the frequency vector repeated twice), computed in f64 on the
/// host, for plain RoPE of base `theta`.
pub fn rope_tables(
    t: usize,
    head_dim: usize,
    theta: f64,
    dtype: DType,
    device: &Device,
) -> candle_core::Result<(Tensor, Tensor)> {
    let inv_freq = default_inv_freq(head_dim, theta);
    rope_tables_from(t, &inv_freq, 1.0, dtype, device)
}

/// The rotary tables of a Llama-family config for sequences of `t`
/// ([`rope_inv_freq`], then [`rope_tables_from`]).
pub fn rope_tables_for(
    c: &ModelConfig,
    t: usize,
    dtype: DType,
    device: &Device,
) -> candle_core::Result<(Tensor, Tensor)> {
    let (inv_freq, scale) =
        rope_inv_freq(c.head_dim, c.rope_theta, &c.rope_scaling, c.max_seq_len, t);
    rope_tables_from(t, &inv_freq, scale, dtype, device)
}

/// `cos, sin` `[t, 2 * inv_freq.len()]` of angles `pos * inv_freq[i]`
/// (f64), each times `scale` (YaRN's attention factor; 1 leaves the bits
/// alone).
pub fn rope_tables_from(
    t: usize,
    inv_freq: &[f64],
    scale: f64,
    dtype: DType,
    device: &Device,
) -> candle_core::Result<(Tensor, Tensor)> {
    let d = 2 * inv_freq.len();
    let mut cos = Vec::with_capacity(t * d);
    let mut sin = Vec::with_capacity(t * d);
    for pos in 0..t {
        for _repeat in 0..2 {
            for &f in inv_freq {
                let angle = pos as f64 * f;
                if scale == 1.0 {
                    cos.push(angle.cos());
                    sin.push(angle.sin());
                } else {
                    cos.push(angle.cos() * scale);
                    sin.push(angle.sin() * scale);
                }
            }
        }
    }
    let cos = Tensor::from_vec(cos, (t, d), device)?.to_dtype(dtype)?;
    let sin = Tensor::from_vec(sin, (t, d), device)?.to_dtype(dtype)?;
    Ok((cos, sin))
}

/// Plain RoPE: `inv_freq[i] = theta^(-2i/d)` for `i < d/2`.
pub fn default_inv_freq(head_dim: usize, theta: f64) -> Vec<f64> {
    (0..head_dim / 2)
        .map(|i| theta.powf(-((2 * i) as f64) / head_dim as f64))
        .collect()
}

/// The inverse frequencies (`head_dim / 2` of them) and the factor on cos
/// and sin of a rotary variant, as transformers 5 computes them
/// (`modeling_rope_utils.py`), in f64 where transformers uses fp32:
///
/// - `default`: `theta^(-2i/d)`; factor 1.
/// - `linear`: `default / factor`.
/// - `dynamic`: `default` with base `theta * (factor * s / m - (factor -
///   1))^(d / (d - 2))`, `s = max(seq_len, m)`, `m =
///   max_position_embeddings`: the base changes only beyond `m`, so at
///   training lengths (never above `m`) it is plain RoPE.
/// - `llama3`: with `L = original_max_position_embeddings`, wavelength
///   `w = 2 pi / f`: `f` where `w < L / high_freq_factor`, `f / factor` where
///   `w > L / low_freq_factor`, in between `(1 - s) f / factor + s f` with
///   `s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor)`.
/// - `yarn`: dims below `low` keep `f`, above `high` take `f / factor`, a
///   linear ramp between (`low`, `high` from `beta_fast`, `beta_slow` by the
///   correction-dim formula, floored/ceiled unless `truncate` is false);
///   the factor on cos and sin is `attention_factor`, else `0.1 ln(factor)
///   + 1` (or the `mscale` / `mscale_all_dim` ratio).
pub fn rope_inv_freq(
    head_dim: usize,
    theta: f64,
    scaling: &RopeScaling,
    max_positions: usize,
    seq_len: usize,
) -> (Vec<f64>, f64) {
    let d = head_dim as f64;
    match scaling {
        RopeScaling::Default => (default_inv_freq(head_dim, theta), 1.0),
        RopeScaling::Linear { factor } => (
            default_inv_freq(head_dim, theta)
                .into_iter()
                .map(|f| f / factor)
                .collect(),
            1.0,
        ),
        RopeScaling::Dynamic { factor } => {
            let s = seq_len.max(max_positions) as f64;
            let m = max_positions as f64;
            if s == m {
                // The base factor is 1^(d/(d-2)) = 1 exactly.
                return (default_inv_freq(head_dim, theta), 1.0);
            }
            let base = theta * ((factor * s / m) - (factor - 1.0)).powf(d / (d - 2.0));
            (default_inv_freq(head_dim, base), 1.0)
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            let old = *original_max_position_embeddings as f64;
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            let inv = default_inv_freq(head_dim, theta)
                .into_iter()
                .map(|f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let s = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - s) * f / factor + s * f
                    }
                })
                .collect();
            (inv, 1.0)
        }
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            attention_factor,
            beta_fast,
            beta_slow,
            mscale,
            mscale_all_dim,
            truncate,
        } => {
            let get_mscale = |scale: f64, m: f64| {
                if scale <= 1.0 {
                    1.0
                } else {
                    0.1 * m * scale.ln() + 1.0
                }
            };
            let attention = match (attention_factor, mscale, mscale_all_dim) {
                (Some(a), _, _) => *a,
                // Python's truthiness: 0 or absent means "not given".
                (None, Some(m), Some(all)) if *m != 0.0 && *all != 0.0 => {
                    get_mscale(*factor, *m) / get_mscale(*factor, *all)
                }
                _ => get_mscale(*factor, 1.0),
            };
            let beta_fast = beta_fast.filter(|&b| b != 0.0).unwrap_or(32.0);
            let beta_slow = beta_slow.filter(|&b| b != 0.0).unwrap_or(1.0);
            let orig = *original_max_position_embeddings as f64;
            let correction_dim = |rotations: f64| {
                (d * (orig / (rotations * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * theta.ln())
            };
            let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
            if *truncate {
                low = low.floor();
                high = high.ceil();
            }
            let low = low.max(0.0);
            let mut high = high.min(d - 1.0);
            if low == high {
                high += 0.001;
            }
            let inv = default_inv_freq(head_dim, theta)
                .into_iter()
                .enumerate()
                .map(|(i, f)| {
                    let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    let extrapolation = 1.0 - ramp;
                    (f / factor) * (1.0 - extrapolation) + f * extrapolation
                })
                .collect();
            (inv, attention)
        }
    }
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

    /// Relative closeness of two frequency lists.
    fn assert_close(ours: &[f64], reference: &[f64], what: &str) {
        assert_eq!(ours.len(), reference.len(), "{what}");
        for (i, (a, b)) in ours.iter().zip(reference).enumerate() {
            assert!(
                (a - b).abs() <= 1e-12 * b.abs().max(1e-300),
                "{what}: inv_freq[{i}] = {a}, reference {b}"
            );
        }
    }

    /// inv_freq written the textbook way: 1 / theta^(2i / d).
    fn reference_default(d: usize, theta: f64) -> Vec<f64> {
        (0..d / 2)
            .map(|i| 1.0 / theta.powf(2.0 * i as f64 / d as f64))
            .collect()
    }

    #[test]
    fn rope_variants_match_scalar_references_at_awkward_sizes() {
        for (d, theta) in [
            (2usize, 10000.0),
            (6, 500000.0),
            (10, 1e4),
            (34, 1e6),
            (128, 5e5),
        ] {
            let base = reference_default(d, theta);
            let (f, s) = rope_inv_freq(d, theta, &RopeScaling::Default, 64, 7);
            assert_close(&f, &base, "default");
            assert_eq!(s, 1.0);
            let (f, _) = rope_inv_freq(d, theta, &RopeScaling::Linear { factor: 3.5 }, 64, 7);
            let r: Vec<f64> = base.iter().map(|x| x / 3.5).collect();
            assert_close(&f, &r, "linear");
            // Dynamic: plain up to max_position_embeddings, a larger base beyond.
            let dynamic = RopeScaling::Dynamic { factor: 2.0 };
            let (f, _) = rope_inv_freq(d, theta, &dynamic, 64, 64);
            assert_close(&f, &base, "dynamic within max positions");
            if d > 2 {
                let (f, _) = rope_inv_freq(d, theta, &dynamic, 64, 100);
                let grown = theta * (2.0f64 * 100.0 / 64.0 - 1.0).powf(d as f64 / (d as f64 - 2.0));
                assert_close(&f, &reference_default(d, grown), "dynamic beyond");
            }
            // Llama 3.1, classified by frequency instead of wavelength:
            // high band f > 2 pi hf / L, low band f < 2 pi lf / L.
            let (factor, lf, hf, l) = (8.0, 1.0, 4.0, 40usize);
            let l3 = RopeScaling::Llama3 {
                factor,
                low_freq_factor: lf,
                high_freq_factor: hf,
                original_max_position_embeddings: l,
            };
            let tau = 2.0 * std::f64::consts::PI;
            let r: Vec<f64> = base
                .iter()
                .map(|&x| {
                    let rotations = x * l as f64 / tau; // L / wavelength
                    if rotations > hf {
                        x
                    } else if rotations < lf {
                        x / factor
                    } else {
                        let smooth = (rotations - lf) / (hf - lf);
                        x * ((1.0 - smooth) / factor + smooth)
                    }
                })
                .collect();
            let (f, s) = rope_inv_freq(d, theta, &l3, 64, 7);
            assert_close(&f, &r, &format!("llama3 d={d}"));
            assert_eq!(s, 1.0);
        }
        // The three llama3 bands are all exercised at d = 34 (checked above):
        let l3 = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 40,
        };
        let (f, _) = rope_inv_freq(34, 1e6, &l3, 64, 7);
        let base = reference_default(34, 1e6);
        let ratios: Vec<f64> = f.iter().zip(&base).map(|(a, b)| a / b).collect();
        assert!(ratios.contains(&1.0));
        assert!(ratios.iter().any(|&r| (r - 0.125).abs() < 1e-15));
        assert!(ratios.iter().any(|&r| r > 0.13 && r < 0.99));
    }

    #[test]
    fn yarn_matches_its_formula() {
        // d = 10, theta 1e4, factor 4, original 32, beta 32 / 1, truncate:
        // correction dim(r) = d ln(32 / (2 pi r)) / (2 ln 1e4).
        let d = 10usize;
        let cd = |r: f64| {
            d as f64 * (32.0 / (r * 2.0 * std::f64::consts::PI)).ln() / (2.0 * 1e4f64.ln())
        };
        let low = cd(32.0).floor().max(0.0);
        let high = cd(1.0).ceil().min(d as f64 - 1.0);
        let y = RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 32,
            attention_factor: None,
            beta_fast: None,
            beta_slow: None,
            mscale: None,
            mscale_all_dim: None,
            truncate: true,
        };
        let (f, s) = rope_inv_freq(d, 1e4, &y, 128, 7);
        let r: Vec<f64> = reference_default(d, 1e4)
            .iter()
            .enumerate()
            .map(|(i, &x)| {
                let t = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                x * (1.0 - t) + x / 4.0 * t
            })
            .collect();
        assert_close(&f, &r, "yarn");
        assert!((s - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-15);
    }

    #[test]
    fn sliding_window_mask() {
        let m = causal_mask_window(5, Some(2), DType::F32, &Device::Cpu)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        for (i, row) in m.iter().enumerate() {
            for (j, &v) in row.iter().enumerate() {
                let visible = j <= i && i - j < 2;
                assert_eq!(v == 0.0, visible, "({i}, {j})");
            }
        }
        let full = causal_mask(5, DType::F32, &Device::Cpu).unwrap();
        let wide = causal_mask_window(5, Some(5), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(
            full.to_vec2::<f32>().unwrap(),
            wide.to_vec2::<f32>().unwrap()
        );
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

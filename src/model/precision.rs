//! The mixed-precision policy: which dtype each op of a unit computes in,
//! given the unit's **storage** dtype (the dtype of its params, its hidden
//! input and its hidden output: the 16-bit copy under `bf16` / `fp16`, fp32
//! otherwise). One table, for every backend: the CPU units of
//! [`super::Model`] follow it through [`Policy`], and device kernels
//! follow the same rows but one: the device's bf16 attention keeps the
//! scores and their gradients in bf16, as eager attention does under
//! autocast (see `exec_units`' bf16 section).
//!
//! # The rule
//!
//! As PyTorch's `torch.autocast` runs HF models (how HF Trainer, accelerate
//! and DeepSpeed users train in bf16): matmuls take 16-bit operands and
//! accumulate in fp32; normalisation, softmax, activations, rotary
//! embedding, the residual stream inside a unit, log-softmax /
//! cross-entropy and the loss run in fp32 (the **math** dtype); a unit's
//! hidden output is rounded back to the storage dtype once, where the
//! activation checkpoint is kept. With fp32 (or f64) storage every cast
//! below is the identity and the ops are the same ops in the same order as
//! before the policy existed, so fp32 runs keep their bits.
//!
//! # The table
//!
//! `S` is the storage dtype (bf16 or fp16), `M` the math dtype (fp32).
//! "autocast" is `torch.autocast("cpu", dtype=torch.bfloat16)` over a model
//! loaded in fp32, as transformers 5 runs GPT-2 and Llama under it (sdpa
//! attention); "HF" names what the modeling code itself casts.
//!
//! | op | tierzero | autocast / HF |
//! |---|---|---|
//! | matmul operands (activations, weights) | rounded to `S` | cast to `bf16` (`linear`, `matmul`, `bmm` are on autocast's lower-precision list) |
//! | matmul accumulation | `M` (exact products of `S` values, summed in fp32, see below) | fp32 (oneDNN / the CPU sdpa kernel accumulate in fp32) |
//! | linear / Conv1D output (bias added in `M`) | rounded to `S` once | `bf16` (addmm: bias added in fp32, one rounding) |
//! | attention scores `q kᵀ / √d` and the causal mask | `M`, not rounded | fp32 inside the CPU flash-attention kernel |
//! | softmax (max subtracted, detached) | `M` | fp32 inside sdpa; eager Llama: `softmax(..., dtype=float32)` |
//! | attention probabilities into `p v` | rounded to `S` | rounded to `bf16` before the `p v` gemm (CPU flash kernel) |
//! | attention output | rounded to `S` | `bf16` (sdpa's output) |
//! | LayerNorm / RMSNorm statistics, normalisation, scale and shift | `M` (norm weights read from `S`, upcast exactly) | fp32: the residual stream is fp32 (fp32 embeddings + `bf16` branch outputs promote), Llama's RMSNorm upcasts explicitly |
//! | GELU (tanh or erf), SiLU, SwiGLU's product | `M` on the `S` matmul output, rounded to `S` as the next matmul's operand | PyTorch's `bf16` kernels compute in fp32 and round once; HF's `gelu_new` composes several `bf16` ops |
//! | rotary embedding (tables built in f64, held in `M`) | `M` | fp32 (`cos`, `sin` in the fp32 hidden dtype; `q`, `k` promote) |
//! | residual adds inside a unit | `M` | fp32 |
//! | embedding lookup, GPT-2's `wte + wpe` | `M` sum of `S` rows | fp32 (embeddings are not autocast) |
//! | unit output (hidden state, the activation checkpoint) | rounded to `S` | fp32 under autocast: **the one place we differ** (see below) |
//! | logits | `S` (the head's matmul output), upcast exactly | `bf16` from the `lm_head` matmul, then `logits.float()` in the loss |
//! | log-softmax, cross-entropy, the mean, the loss | `M` | fp32 (`cross_entropy` is on autocast's fp32 list, and the logits are upcast first) |
//! | gradients | each cast's backward casts back (`S` where the forward rounded), unit input and param gradients leave the unit in `S`; accumulated in fp32 by the engine | the same casts' backward; `.grad` of fp32 params in fp32 |
//!
//! # Where we differ from autocast, and why
//!
//! - **Unit outputs in `S`.** The hidden state between units is the
//!   activation checkpoint of ZeRO-3's unit-granular recompute and what
//!   moves between units; keeping it in the 16-bit type halves that memory,
//!   as DeepSpeed's bf16 (`module.bfloat16()`) does. Inside a unit the
//!   residual stream is fp32, as under autocast, so the difference is one
//!   rounding of the residual stream per block.
//! - **Norm weights, biases and embeddings come from the 16-bit copy**
//!   (autocast reads the fp32 masters for non-matmul ops): the engine
//!   streams only the 16-bit copy to compute. Exporting the 16-bit weights
//!   and loading them as fp32 in transformers makes the two read the same
//!   values (`scripts/check_autocast_parity.py`).
//!
//! # candle's CPU matmul
//!
//! candle 0.11's CPU `matmul` has no bf16 kernel: it widens both operands
//! to f32, runs the f32 `gemm` (fp32 accumulation) and rounds the result to
//! bf16 once. Its fp16 `matmul` uses `gemm-f16`, which on x86 packs to f32
//! and accumulates in f32 within a k-block but rounds the partial sums to
//! fp16 between k-blocks, and on aarch64 with `fp16` accumulates in fp16.
//! [`Policy::operand`] therefore does the widening itself for both 16-bit
//! types: the operands are rounded to `S`, widened (exactly) to fp32 and
//! multiplied by the f32 `gemm`; products of two `S` values are exact in
//! fp32, so this is "16-bit inputs, fp32 accumulation" for bf16 and fp16
//! alike, on every CPU, and the caller adds the bias before the single
//! rounding.

use candle_core::{DType, Tensor};

use super::ops;

/// A stage of a unit's computation, for [`Policy::dtype`] (the table in the
/// module docs, row by row).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stage {
    /// The operands of a matmul (activations and weights).
    MatmulOperand,
    /// A matmul's accumulation, bias add, attention scores and mask.
    MatmulAccumulate,
    /// The output of a linear / Conv1D and of attention.
    MatmulOutput,
    /// LayerNorm / RMSNorm.
    Norm,
    /// Softmax.
    Softmax,
    /// GELU, SiLU and the SwiGLU product.
    Activation,
    /// Rotary embedding and its tables.
    Rope,
    /// The residual stream inside a unit (and the embedding sum).
    Residual,
    /// A unit's hidden output (the activation checkpoint).
    UnitOutput,
    /// Log-softmax, cross-entropy, the loss.
    Loss,
}

/// The policy of a unit whose params are in `storage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    storage: DType,
}

impl Policy {
    /// The policy of a unit stored in `storage`.
    pub fn new(storage: DType) -> Self {
        Policy { storage }
    }

    /// The storage dtype.
    pub fn storage(&self) -> DType {
        self.storage
    }

    /// Whether the storage is 16-bit (bf16 or fp16): the casts are real.
    pub fn is_mixed(&self) -> bool {
        matches!(self.storage, DType::BF16 | DType::F16)
    }

    /// The math dtype: fp32 under 16-bit storage, the storage dtype itself
    /// otherwise (fp32; f64 in the gradient checks).
    pub fn math(&self) -> DType {
        if self.is_mixed() {
            DType::F32
        } else {
            self.storage
        }
    }

    /// The dtype a stage computes in (the module docs' table).
    pub fn dtype(&self, stage: Stage) -> DType {
        match stage {
            Stage::MatmulOperand | Stage::MatmulOutput | Stage::UnitOutput => self.storage,
            Stage::MatmulAccumulate
            | Stage::Norm
            | Stage::Softmax
            | Stage::Activation
            | Stage::Rope
            | Stage::Residual
            | Stage::Loss => self.math(),
        }
    }

    /// `x` in the math dtype (exact from `S`; the identity without mixing).
    pub fn up(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.to_dtype(self.math())
    }

    /// `x` rounded to the storage dtype (round to nearest even).
    pub fn down(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.to_dtype(self.storage)
    }

    /// A matmul operand: rounded to `S`, then held in the math dtype for
    /// the fp32-accumulating gemm (see the module docs).
    pub fn operand(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.up(&self.down(x)?)
    }

    /// `y = x W + b` (HF Conv1D, `W [in, out]`): operands in `S`, fp32
    /// accumulation and bias, the output rounded to `S`.
    pub fn conv1d(
        &self,
        x: &Tensor,
        w_in_out: &Tensor,
        b: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
        let b = b.map(|b| self.up(b)).transpose()?;
        let y = ops::conv1d(&self.operand(x)?, &self.operand(w_in_out)?, b.as_ref())?;
        self.down(&y)
    }

    /// `gelu_tanh(x W + b)` (GPT-2's `c_fc` and `gelu_new`), the GELU in
    /// the math dtype on the linear's output as [`Policy::conv1d`] rounds
    /// it. Without 16-bit storage the casts are the identity, and the two
    /// are one fused op ([`super::fused::linear_gelu_tanh`], the same
    /// values).
    pub fn conv1d_gelu_tanh(
        &self,
        x: &Tensor,
        w_in_out: &Tensor,
        b: &Tensor,
    ) -> candle_core::Result<Tensor> {
        if self.is_mixed() {
            super::fused::gelu_tanh(&self.up(&self.conv1d(x, w_in_out, Some(b))?)?)
        } else {
            super::fused::linear_gelu_tanh(x, w_in_out, b, super::fused::WeightLayout::InOut)
        }
    }

    /// `y = x Wᵀ + b` (`nn.Linear`, `W [out, in]`): as [`Policy::conv1d`].
    pub fn linear(
        &self,
        x: &Tensor,
        w_out_in: &Tensor,
        b: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
        let b = b.map(|b| self.up(b)).transpose()?;
        let y = ops::linear(&self.operand(x)?, &self.operand(w_out_in)?, b.as_ref())?;
        self.down(&y)
    }

    /// LayerNorm in the math dtype (output in the math dtype).
    pub fn layer_norm(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        eps: f64,
    ) -> candle_core::Result<Tensor> {
        super::fused::layer_norm(&self.up(x)?, &self.up(w)?, &self.up(b)?, eps)
    }

    /// RMSNorm in the math dtype (output in the math dtype).
    pub fn rms_norm(&self, x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
        super::fused::rms_norm(&self.up(x)?, &self.up(w)?, eps)
    }

    /// Causal attention of `q, k [b, n, t, d]` (`nh` and `nkv` heads) and
    /// `v [b, t, nkv · d]` (its projection's output), to the merged `[b,
    /// t, nh · d]`; GQA: query head `h` reads key/value head `h / (nh /
    /// nkv)`. Operands in `S`, scores, mask and softmax in the math dtype,
    /// probabilities rounded to `S` for `p v`, the output rounded to `S`.
    /// Without mixing it is [`super::fused::attention`], which computes
    /// [`ops::causal_attention_window`] to rounding.
    pub fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        window: Option<usize>,
    ) -> candle_core::Result<Tensor> {
        let (b, nh, t, d) = q.dims4()?;
        let scale = 1.0 / (d as f64).sqrt();
        if !self.is_mixed() {
            // Every cast is the identity: the fused op (it falls back to
            // the same composition where it cannot run).
            return super::fused::attention(q, k, v, scale, window);
        }
        let nkv = k.dim(1)?;
        if nkv == 0 || nh % nkv != 0 {
            return Err(candle_core::Error::Msg(format!(
                "attention: {nh} query heads over {nkv} key/value heads"
            )));
        }
        // `v` as its projection gives it, `[b, t, nkv · d]`: a rank-4 `v`
        // of the same element count would reshape without error and be
        // read in the wrong order.
        if v.dims() != [b, t, nkv * d] {
            return Err(candle_core::Error::Msg(format!(
                "attention: v is {:?}, expected [{b}, {t}, {}] ([b, t, nkv * head_dim])",
                v.dims(),
                nkv * d
            )));
        }
        let v = v.reshape((b, t, nkv, d))?.transpose(1, 2)?.contiguous()?;
        let (k, v) = (
            super::fused::repeat_kv(k, nh / nkv)?,
            super::fused::repeat_kv(&v, nh / nkv)?,
        );
        let (q, k, v) = (self.operand(q)?, self.operand(&k)?, self.operand(&v)?);
        let p = super::fused::causal_softmax(&q.matmul(&k.t()?)?, scale, window)?;
        let y = self.down(&self.operand(&p)?.matmul(&v)?)?;
        y.transpose(1, 2)?.contiguous()?.reshape((b, t, nh * d))
    }

    /// GPT-2's attention of the packed `qkv [b, t, 3 · nh · d]` (`c_attn`'s
    /// output), to the merged `[b, t, nh · d]`, as [`Policy::attention`]
    /// (fused without mixing: [`super::fused::attention_packed`]).
    pub fn attention_packed(&self, qkv: &Tensor, nh: usize) -> candle_core::Result<Tensor> {
        if !self.is_mixed() {
            let d = qkv.dim(2)? / (3 * nh.max(1));
            let scale = 1.0 / (d.max(1) as f64).sqrt();
            return super::fused::attention_packed(qkv, nh, scale, None);
        }
        let (q, k, v) = super::fused::split_packed(qkv, nh)?;
        self.attention(&q, &k, &v, None)
    }

    /// Mean cross-entropy of `logits [n, v]` in the math dtype (a scalar in
    /// the math dtype).
    pub fn cross_entropy(&self, logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
        ops::cross_entropy(&self.up(logits)?, targets)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;
    use candle_core::Device;

    /// Awkward sizes: 1, odd, primes, one past a SIMD width, a long row.
    const SIZES: [usize; 7] = [1, 3, 7, 17, 33, 129, 1031];

    /// Deterministic values in [-4, 4) with a spread of magnitudes.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 11) as f64 / (1u64 << 53) as f64 * 8.0 - 4.0) as f32
            })
            .collect()
    }

    /// `rows x n` values rounded to `dtype`, as the policy's input, and the
    /// same values (exact) in f64 for the reference.
    fn input(rows: usize, n: usize, dtype: DType, seed: u64) -> (Tensor, Vec<Vec<f64>>) {
        let t = Tensor::from_vec(values(rows * n, seed), (rows, n), &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let exact = t.to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap();
        (t, exact)
    }

    /// Max relative error of `got` (any dtype) against `want`, scaled by
    /// the row's largest magnitude (so tiny entries do not dominate).
    fn max_rel(got: &Tensor, want: &[Vec<f64>]) -> f64 {
        let got = got.to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap();
        let mut worst = 0f64;
        for (g, w) in got.iter().zip(want) {
            let scale = w.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-30);
            for (a, b) in g.iter().zip(w) {
                worst = worst.max((a - b).abs() / scale);
            }
        }
        worst
    }

    fn softmax_ref(row: &[f64]) -> Vec<f64> {
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
        let e: Vec<f64> = row.iter().map(|x| (x - max).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|x| x / s).collect()
    }

    #[test]
    fn table_is_the_identity_without_mixing() {
        for d in [DType::F32, DType::F64] {
            let p = Policy::new(d);
            assert!(!p.is_mixed());
            for s in [
                Stage::MatmulOperand,
                Stage::MatmulAccumulate,
                Stage::MatmulOutput,
                Stage::Norm,
                Stage::Softmax,
                Stage::Activation,
                Stage::Rope,
                Stage::Residual,
                Stage::UnitOutput,
                Stage::Loss,
            ] {
                assert_eq!(p.dtype(s), d);
            }
        }
        for d in [DType::BF16, DType::F16] {
            let p = Policy::new(d);
            assert_eq!(p.dtype(Stage::Softmax), DType::F32);
            assert_eq!(p.dtype(Stage::Loss), DType::F32);
            assert_eq!(p.dtype(Stage::Norm), DType::F32);
            assert_eq!(p.dtype(Stage::MatmulOperand), d);
            assert_eq!(p.dtype(Stage::UnitOutput), d);
        }
    }

    /// Softmax of 16-bit scores is computed in fp32: its error against an
    /// f64 softmax of the same (16-bit) values is fp32 rounding, far below
    /// a 16-bit ulp; a softmax computed in the 16-bit type is not.
    #[test]
    fn softmax_and_log_softmax_in_fp32_on_16_bit_inputs() {
        for dtype in [DType::BF16, DType::F16] {
            let p = Policy::new(dtype);
            for (i, &n) in SIZES.iter().enumerate() {
                let (x, exact) = input(3, n, dtype, 10 + i as u64);
                let want: Vec<Vec<f64>> = exact.iter().map(|r| softmax_ref(r)).collect();
                let got = ops::softmax_last(&p.up(&x).unwrap()).unwrap();
                assert_eq!(got.dtype(), DType::F32);
                let e = max_rel(&got, &want);
                assert!(e < 1e-6, "{dtype:?} softmax n={n}: {e:e}");
                // Log-softmax as the cross-entropy takes it: the mean NLL
                // of every class against the f64 reference.
                for target in [0, n / 2, n - 1] {
                    let targets = Tensor::new(&[target as u32; 3], &Device::Cpu).unwrap();
                    let loss = p.cross_entropy(&x, &targets).unwrap();
                    assert_eq!(loss.dtype(), DType::F32);
                    let loss = f64::from(loss.to_scalar::<f32>().unwrap());
                    let want: f64 = exact
                        .iter()
                        .map(|r| -softmax_ref(r)[target].ln())
                        .sum::<f64>()
                        / 3.0;
                    assert!(
                        (loss - want).abs() <= 2e-6 * want.abs().max(1.0),
                        "{dtype:?} cross-entropy n={n} target {target}: {loss} vs {want}"
                    );
                }
            }
        }
        // The control: the same softmax in bf16 itself is off by about a
        // bf16 ulp (2^-8 relative), so the check above would catch it.
        let (x, exact) = input(3, 129, DType::BF16, 99);
        let want: Vec<Vec<f64>> = exact.iter().map(|r| softmax_ref(r)).collect();
        let in_bf16 = ops::softmax_last(&x).unwrap();
        assert!(max_rel(&in_bf16, &want) > 1e-3);
    }

    #[test]
    fn norms_in_fp32_on_16_bit_inputs() {
        for dtype in [DType::BF16, DType::F16] {
            let p = Policy::new(dtype);
            for (i, &n) in SIZES.iter().enumerate() {
                let (x, exact) = input(4, n, dtype, 40 + i as u64);
                let (w, we) = input(1, n, dtype, 70 + i as u64);
                let (b, be) = input(1, n, dtype, 90 + i as u64);
                let (w1, b1) = (w.squeeze(0).unwrap(), b.squeeze(0).unwrap());
                let eps = 1e-5;
                let ln_ref: Vec<Vec<f64>> = exact
                    .iter()
                    .map(|r| {
                        let mean = r.iter().sum::<f64>() / n as f64;
                        let var = r.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
                        let d = (var + eps).sqrt();
                        r.iter()
                            .zip(&we[0])
                            .zip(&be[0])
                            .map(|((x, w), b)| (x - mean) / d * w + b)
                            .collect()
                    })
                    .collect();
                let ln = p.layer_norm(&x, &w1, &b1, eps).unwrap();
                assert_eq!(ln.dtype(), DType::F32);
                let e = max_rel(&ln, &ln_ref);
                // n = 1 normalises to 0 exactly: the output is the bias.
                assert!(e < 2e-6, "{dtype:?} layer_norm n={n}: {e:e}");
                let rms_ref: Vec<Vec<f64>> = exact
                    .iter()
                    .map(|r| {
                        let ms = r.iter().map(|x| x * x).sum::<f64>() / n as f64;
                        let d = (ms + eps).sqrt();
                        r.iter().zip(&we[0]).map(|(x, w)| x / d * w).collect()
                    })
                    .collect();
                let rms = p.rms_norm(&x, &w1, eps).unwrap();
                let e = max_rel(&rms, &rms_ref);
                assert!(e < 2e-6, "{dtype:?} rms_norm n={n}: {e:e}");
            }
        }
    }

    /// The matmul: 16-bit operands, fp32 accumulation, one rounding to `S`
    /// after the bias: within half an `S` ulp (plus fp32 noise) of the f64
    /// product of the same 16-bit values.
    #[test]
    fn linear_rounds_once_after_fp32_accumulation() {
        for (dtype, half_ulp) in [(DType::BF16, 2f64.powi(-8)), (DType::F16, 2f64.powi(-11))] {
            let p = Policy::new(dtype);
            for (i, &k) in SIZES.iter().enumerate() {
                let (x, xe) = input(5, k, dtype, 200 + i as u64);
                let (w, we) = input(6, k, dtype, 300 + i as u64);
                let (b, be) = input(1, 6, dtype, 400 + i as u64);
                let y = p.linear(&x, &w, Some(&b.squeeze(0).unwrap())).unwrap();
                assert_eq!(y.dtype(), dtype);
                let y = y.to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap();
                for (r, xr) in xe.iter().enumerate() {
                    for (c, wr) in we.iter().enumerate() {
                        let want: f64 =
                            xr.iter().zip(wr).map(|(a, b)| a * b).sum::<f64>() + be[0][c];
                        // fp32 accumulation error bound plus the rounding.
                        let mag: f64 = xr.iter().zip(wr).map(|(a, b)| (a * b).abs()).sum::<f64>();
                        let bound = want.abs() * half_ulp * 1.0001 + mag * k as f64 * 6e-8;
                        let got = y[r][c];
                        assert!(
                            (got - want).abs() <= bound,
                            "{dtype:?} k={k} [{r},{c}]: {got} vs {want} (bound {bound:e})"
                        );
                    }
                }
            }
        }
    }

    /// Attention under the policy against an f64 reference on the same
    /// 16-bit q, k, v, with the probabilities rounded to `S` as the policy
    /// says: the output is within about one `S` rounding.
    #[test]
    fn attention_follows_the_table() {
        let dtype = DType::BF16;
        let p = Policy::new(dtype);
        for &t in &[1usize, 5, 17] {
            let d = 6;
            let mk = |seed| {
                Tensor::from_vec(values(t * d, seed), (1, 1, t, d), &Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
            };
            let (q, k, v) = (mk(1), mk(2), mk(3));
            // v as its projection's rows, one head: [1, t, d].
            let y = p
                .attention(&q, &k, &v.reshape((1, t, d)).unwrap(), None)
                .unwrap();
            assert_eq!(y.dtype(), dtype);
            assert_eq!(y.dims(), &[1, t, d]);
            let f = |x: &Tensor| {
                x.to_dtype(DType::F64)
                    .unwrap()
                    .reshape((t, d))
                    .unwrap()
                    .to_vec2::<f64>()
                    .unwrap()
            };
            let (qe, ke, ve, ye) = (f(&q), f(&k), f(&v), f(&y));
            for i in 0..t {
                let scores: Vec<f64> = (0..=i)
                    .map(|j| {
                        qe[i].iter().zip(&ke[j]).map(|(a, b)| a * b).sum::<f64>()
                            / (d as f64).sqrt()
                    })
                    .collect();
                let probs: Vec<f64> = softmax_ref(&scores)
                    .into_iter()
                    .map(|x| f64::from(half::bf16::from_f64(x).to_f32()))
                    .collect();
                for c in 0..d {
                    let want: f64 = probs.iter().zip(&ve).map(|(p, v)| p * v[c]).sum();
                    let mag: f64 = probs.iter().zip(&ve).map(|(p, v)| (p * v[c]).abs()).sum();
                    let got = ye[i][c];
                    // One rounding of the output to bf16 (unit roundoff
                    // 2^-8) and fp32 sums: scores or dS rounded to bf16
                    // before the softmax would be off by |score| 2^-8.
                    assert!(
                        (got - want).abs() <= want.abs() * 2f64.powi(-8) * 1.01 + mag * 1e-5,
                        "t={t} [{i},{c}]: {got} vs {want}"
                    );
                }
            }
            // v in the heads' layout [b, nkv, t, d] (the same count) is refused,
            // not read in the wrong order.
            let err = p.attention(&q, &k, &v, None).unwrap_err().to_string();
            assert!(err.contains("expected [1, "), "{err}");
        }
    }
}

//! Each unit kind's forward math: the embedding, a transformer block (GPT-2
//! or the Llama family) and the head's logits, under the precision policy
//! (`precision.rs`). `Model::run_unit` checks the inputs and calls these;
//! backward recomputes through them (see the module docs of `model`).

use super::*;

impl Model {
    /// Logits `[batch, seq, vocab]` of the head unit (for evaluation and
    /// generation; training uses the loss output).
    pub fn logits(&self, head_params: &[Tensor], hidden: &Tensor) -> Result<Tensor, ModelError> {
        let spec = self.units.last().ok_or_else(|| ModelError::Unsupported {
            what: "model without units".into(),
        })?;
        let dtype = self.check_params(spec, head_params)?;
        self.check_hidden(spec.id, hidden, dtype)?;
        self.logits_unchecked(head_params, hidden)
    }

    pub(super) fn embed(&self, p: &[Tensor], ids: &Tensor) -> Result<Tensor, ModelError> {
        let (b, t) = ids.dims2()?;
        let h = self.config.hidden_size;
        let x = p[0]
            .index_select(&ids.flatten_all()?, 0)?
            .reshape((b, t, h))?;
        Ok(match self.config.arch {
            // The sum in the math dtype, rounded to storage once.
            Arch::Gpt2 => {
                let pol = Policy::new(p[0].dtype());
                pol.down(
                    &pol.up(&x)?
                        .broadcast_add(&pol.up(&p[1].narrow(0, 0, t)?)?)?,
                )?
            }
            Arch::Llama => x,
        })
    }

    /// One block under the precision policy ([`precision`]): `x` and the
    /// params in the storage dtype, the residual stream, norms, softmax,
    /// activations and rotary embedding in the math dtype, matmuls on
    /// storage-dtype operands; the output rounded to storage once. With
    /// fp32 params every cast is the identity.
    pub(super) fn block(&self, p: &[Tensor], x: &Tensor) -> Result<Tensor, ModelError> {
        let c = &self.config;
        let pol = Policy::new(x.dtype());
        let (b, t, _) = x.dims3()?;
        let (nh, nkv, hd) = (c.n_head, c.n_kv_head, c.head_dim);
        // The residual stream, in the math dtype.
        let x = pol.up(x)?;
        let out = match c.arch {
            Arch::Gpt2 => {
                let a = pol.layer_norm(&x, &p[0], &p[1], c.norm_eps)?;
                let qkv = pol.conv1d(&a, &p[2], Some(&p[3]))?;
                let y = pol.attention_packed(&qkv, nh)?;
                let x = (x + pol.up(&pol.conv1d(&y, &p[4], Some(&p[5]))?)?)?;
                let m = pol.layer_norm(&x, &p[6], &p[7], c.norm_eps)?;
                let m = match c.activation {
                    Activation::GeluErf => {
                        ops::gelu_erf(&pol.up(&pol.conv1d(&m, &p[8], Some(&p[9]))?)?)?
                    }
                    _ => pol.conv1d_gelu_tanh(&m, &p[8], &p[9])?,
                };
                (x + pol.up(&pol.conv1d(&m, &p[10], Some(&p[11]))?)?)?
            }
            Arch::Llama => {
                // The params in declared order (see `Model::new`).
                let mut it = p.iter();
                let mut next = || {
                    it.next().ok_or_else(|| {
                        candle_core::Error::Msg("block has fewer params than declared".into())
                    })
                };
                let proj = |x: &Tensor, w: &Tensor, b: Option<&Tensor>| pol.linear(x, w, b);
                let a = pol.rms_norm(&x, next()?, c.norm_eps)?;
                let mut qkv = Vec::with_capacity(3);
                for _ in 0..3 {
                    let w = next()?;
                    let bias = if c.qkv_bias { Some(next()?) } else { None };
                    qkv.push(proj(&a, w, bias)?);
                }
                let o_w = next()?;
                let o_b = if c.o_bias { Some(next()?) } else { None };
                // q, k from the storage-dtype projections; norm and rotary
                // embedding in the math dtype, the heads split by the
                // rotation (`rope_heads`: rows in, `[b, n, t, hd]` out).
                let mut q = pol.up(&qkv[0])?;
                let mut k = pol.up(&qkv[1])?;
                // v as its projection wrote it, `[b, t, nkv · hd]`.
                let v = &qkv[2];
                if c.qk_norm {
                    // Per head: rows of `hd`.
                    q = pol.rms_norm(&q.reshape((b, t, nh, hd))?, next()?, c.norm_eps)?;
                    k = pol.rms_norm(&k.reshape((b, t, nkv, hd))?, next()?, c.norm_eps)?;
                }
                let (cos, sin) = ops::rope_tables_for(c, t, pol.math(), x.device())?;
                let q = super::fused::rope_heads(&q, nh, &cos, &sin)?;
                let k = super::fused::rope_heads(&k, nkv, &cos, &sin)?;
                // GQA: `attention` reads key/value head `h / (nh / nkv)`.
                let y = pol.attention(&q, &k, v, c.sliding_window)?;
                let x = (x + pol.up(&proj(&y, o_w, o_b)?)?)?;
                let m = pol.rms_norm(&x, next()?, c.norm_eps)?;
                let mut mlp = Vec::with_capacity(3);
                for _ in 0..3 {
                    let w = next()?;
                    let bias = if c.mlp_bias { Some(next()?) } else { None };
                    mlp.push((w, bias));
                }
                let gate = pol.up(&proj(&m, mlp[0].0, mlp[0].1)?)?;
                let up = pol.up(&proj(&m, mlp[1].0, mlp[1].1)?)?;
                let act = super::fused::swiglu(&gate, &up)?;
                (x + pol.up(&proj(&act, mlp[2].0, mlp[2].1)?)?)?
            }
        };
        Ok(pol.down(&out)?)
    }

    /// The head's logits under the policy: the final norm in the math
    /// dtype, the LM head's matmul output in the storage dtype (as
    /// autocast's `lm_head`; the loss upcasts them).
    pub(super) fn logits_unchecked(&self, p: &[Tensor], x: &Tensor) -> Result<Tensor, ModelError> {
        let c = &self.config;
        let pol = Policy::new(x.dtype());
        let (n, w) = match c.arch {
            Arch::Gpt2 => (pol.layer_norm(x, &p[0], &p[1], c.norm_eps)?, &p[2]),
            Arch::Llama => (pol.rms_norm(x, &p[0], c.norm_eps)?, &p[1]),
        };
        // Both the tied embedding [vocab, hidden] and lm_head (nn.Linear) are [out, in].
        Ok(pol.linear(&n, w, None)?)
    }
}

//! [`HostExec`]: every operation is its kernel's scalar reference.

use half::bf16;

use super::{attention_bwd_fp32, attention_fwd_fp32, check_ids, AttnShape, Exec, GemmDtype};
use crate::norm::NormGroup;
use crate::ops::MatmulShape;
use crate::reference::{self as r, AdamScalars, HeadsShape, KvShape, RopeShape};
use crate::Result;

/// The host executor: every operation is its kernel's scalar reference.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostExec {
    /// The GEMMs' operand dtype (bf16: operands rounded, as the device's
    /// casts round them, before the product).
    pub gemm: GemmDtype,
}

impl HostExec {
    /// fp32 GEMMs.
    pub const F32: HostExec = HostExec {
        gemm: GemmDtype::F32,
    };
    /// bf16 GEMM operands.
    pub const BF16: HostExec = HostExec {
        gemm: GemmDtype::Bf16,
    };
    /// fp16 GEMM operands.
    pub const F16: HostExec = HostExec {
        gemm: GemmDtype::F16,
    };
}

/// `v` rounded to bf16 (and back to f32).
fn bf16_rounded(v: &[f32]) -> Vec<f32> {
    v.iter()
        .map(|&x| half::bf16::from_f32(x).to_f32())
        .collect()
}

/// `v` rounded to fp16 (to nearest even, overflow to ±inf, as the cast
/// kernel) and widened back.
fn f16_rounded(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect()
}

/// Ids on the host, with their embedding runs.
#[derive(Debug, Clone)]
pub struct HostIds {
    ids: Vec<i32>,
}

impl Exec for HostExec {
    type Buf = Vec<f32>;
    type Ids = HostIds;

    fn rmsnorm_fwd(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        cols: usize,
        eps: f32,
    ) -> Result<[Vec<f32>; 2]> {
        let (y, rstd) = r::rmsnorm_fwd(x, w, cols, eps);
        Ok([y, rstd])
    }
    fn rmsnorm_bwd(
        &self,
        dy: &Vec<f32>,
        x: &Vec<f32>,
        w: &Vec<f32>,
        rstd: &Vec<f32>,
        dw: &mut Vec<f32>,
        cols: usize,
    ) -> Result<Vec<f32>> {
        r::rmsnorm_bwd_w(dw, dy, x, rstd, cols);
        Ok(r::rmsnorm_bwd_dx(dy, x, w, rstd, cols))
    }
    fn rope(
        &self,
        x: &Vec<f32>,
        cos: &Vec<f32>,
        sin: &Vec<f32>,
        s: RopeShape,
        sign: f32,
    ) -> Result<Vec<f32>> {
        Ok(r::rope(x, cos, sin, s, sign))
    }
    fn swiglu_fwd(&self, gate: &Vec<f32>, up: &Vec<f32>) -> Result<Vec<f32>> {
        Ok(r::swiglu_fwd(gate, up))
    }
    fn swiglu_bwd(&self, dy: &Vec<f32>, gate: &Vec<f32>, up: &Vec<f32>) -> Result<[Vec<f32>; 2]> {
        let (dg, du) = r::swiglu_bwd(dy, gate, up);
        Ok([dg, du])
    }
    fn repeat_kv(&self, x: &Vec<f32>, s: KvShape) -> Result<Vec<f32>> {
        Ok(r::repeat_kv(x, s))
    }
    fn sum_kv(&self, x: &Vec<f32>, s: KvShape) -> Result<Vec<f32>> {
        Ok(r::sum_kv(x, s))
    }
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

    fn norm_sq_sums(&self, groups: &[NormGroup<'_, Vec<f32>>]) -> Result<Vec<f64>> {
        r::norm_sq_sums(groups)
    }
    fn round_bf16(&self, dst: &mut Vec<f32>, src: &Vec<f32>) -> Result<()> {
        if dst.len() != src.len() {
            return Err(crate::GpuError::Shape {
                kernel: "round_bf16".into(),
                detail: format!("dst has {} elements, src {}", dst.len(), src.len()),
            });
        }
        // In place, as the device writes it (a param's buffer stays
        // where it is).
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = half::bf16::from_f32(x).to_f32();
        }
        Ok(())
    }
    fn zeros(&self, _: &str, n: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; n])
    }
    fn output(&self, _: &str, n: usize) -> Result<Vec<f32>> {
        // Poison: an element read before it is written spreads NaN into
        // the loss and the gradients the units' tests check.
        Ok(vec![f32::NAN; n])
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
        let shape = (s.m, s.n, s.k);
        let trans = (s.trans_a, s.trans_b);
        match self.gemm {
            GemmDtype::F32 => r::matmul(c, a, b, s.batch, shape, trans, 1.0, beta),
            GemmDtype::Bf16 => r::matmul(
                c,
                &bf16_rounded(a),
                &bf16_rounded(b),
                s.batch,
                shape,
                trans,
                1.0,
                beta,
            ),
            GemmDtype::F16 => r::matmul(
                c,
                &f16_rounded(a),
                &f16_rounded(b),
                s.batch,
                shape,
                trans,
                1.0,
                beta,
            ),
        }
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
    fn attention_fwd(
        &self,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        a: AttnShape,
    ) -> Result<[Vec<f32>; 2]> {
        if self.gemm != GemmDtype::Bf16 {
            return attention_fwd_fp32(self, q, k, v, a);
        }
        // The device's order: the scores a bf16 GEMM's output (rounded
        // once, at the store), the softmax from them in fp32 stored in
        // bf16, then the bf16 x bf16 -> fp32 GEMM with v.
        let (bh, seq, hd) = (a.bh, a.seq, a.head_dim);
        let (q16, k16): (Vec<bf16>, Vec<bf16>) = (r::cast(q), r::cast(k));
        let mut s16 = vec![bf16::ZERO; a.scores_numel()];
        r::matmul(
            &mut s16,
            &q16,
            &k16,
            bh,
            (seq, seq, hd),
            (false, true),
            1.0,
            0.0,
        );
        let p = r::cast::<bf16, f32>(&r::softmax_causal_fwd(&s16, seq, a.scale()));
        let mut o = vec![0f32; a.heads_numel()];
        let v = bf16_rounded(v);
        r::matmul(&mut o, &p, &v, bh, (seq, hd, seq), (false, false), 1.0, 0.0);
        Ok([o, p])
    }
    fn attention_bwd(
        &self,
        p: &Vec<f32>,
        [q, k, v]: [&Vec<f32>; 3],
        dout: &Vec<f32>,
        a: AttnShape,
    ) -> Result<[Vec<f32>; 3]> {
        if self.gemm != GemmDtype::Bf16 {
            return attention_bwd_fp32(self, p, [q, k, v], dout, a);
        }
        // `p` holds bf16 values (attention_fwd's), so it casts exactly.
        let (bh, seq, hd) = (a.bh, a.seq, a.head_dim);
        let p16: Vec<bf16> = r::cast(p);
        let (do16, v16): (Vec<bf16>, Vec<bf16>) = (r::cast(dout), r::cast(v));
        let mut dp16 = vec![bf16::ZERO; a.scores_numel()];
        r::matmul(
            &mut dp16,
            &do16,
            &v16,
            bh,
            (seq, seq, hd),
            (false, true),
            1.0,
            0.0,
        );
        let mut dv = vec![0f32; a.heads_numel()];
        let do_: Vec<f32> = r::cast(&do16);
        r::matmul(
            &mut dv,
            p,
            &do_,
            bh,
            (seq, hd, seq),
            (true, false),
            1.0,
            0.0,
        );
        let ds = r::cast::<bf16, f32>(&r::softmax_bwd(&p16, &dp16, seq, a.scale()));
        let (q, k) = (bf16_rounded(q), bf16_rounded(k));
        let mut dq = vec![0f32; a.heads_numel()];
        r::matmul(
            &mut dq,
            &ds,
            &k,
            bh,
            (seq, hd, seq),
            (false, false),
            1.0,
            0.0,
        );
        let mut dk = vec![0f32; a.heads_numel()];
        r::matmul(
            &mut dk,
            &ds,
            &q,
            bh,
            (seq, hd, seq),
            (true, false),
            1.0,
            0.0,
        );
        Ok([dq, dk, dv])
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
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let (rows, grad) = r::cross_entropy(logits, &targets.ids, vocab, -100, Some(grad_scale));
        Ok((vec![r::sum_f32(&rows)], grad.unwrap_or_default()))
    }
}

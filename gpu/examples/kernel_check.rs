//! The device check of every kernel: each against its CPU reference
//! (`tierzero_gpu::reference`) on fresh inputs at awkward sizes, in fp32
//! and bf16, with every output poisoned (NaN) before the launch. A result
//! passes when no output is NaN where the reference is not (every element
//! written) and the relative error ‖got − ref‖ / ‖ref‖ is at most 1e-5 in
//! fp32, 2e-2 in bf16. Prints one JSON object; exit 0 when all pass, 1
//! when one fails, 2 when the device cannot be opened (the error says why).
//! Checks that are not a tolerance are exact: the 16-bit params'
//! (`kernel_check/params16.rs`) and the gradients' reduce-scatter on the
//! device (`kernel_check/collective.rs`: `add_chunks` bit for bit, and
//! one rank's NCCL communicator through pack, reduce and download).
//!
//! `cargo run --release -p tierzero-gpu --example kernel_check [OUT.json]`
//! (`scripts/gpu_check.sh` runs it with PyTorch's CUDA libraries on
//! `LD_LIBRARY_PATH`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Instant;

use half::{bf16, f16};
use tierzero_gpu::cache::KernelCache;
use tierzero_gpu::device::{Device, DeviceBuffer, DeviceOptions};
use tierzero_gpu::ops::{self, AdamState, DeviceRuns, Elem, MatmulShape, NormOut, NormStats};
use tierzero_gpu::reference::{self as r, AdamScalars, HeadsShape, KvShape, RopeShape, Storage};
use tierzero_gpu::Result;

fn data(n: usize, seed: u64) -> Vec<f32> {
    tierzero_gpu::reference::test_values(n, seed)
}

fn typed<T: Storage>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::store(x)).collect()
}

struct Report {
    results: Vec<serde_json::Value>,
    failed: usize,
}

impl Report {
    /// `got` against `want` (NaN in `want`: not compared): the relative
    /// error over the compared elements at most `tol`, every compared
    /// output finite (the outputs start poisoned with NaN), and at least
    /// one element compared.
    fn compare<T: Storage>(&mut self, kernel: &str, size: &str, got: &[T], want: &[T], tol: f64) {
        let (mut d, mut n, mut unwritten, mut compared) = (0f64, 0f64, 0usize, 0usize);
        for (g, w) in got.iter().zip(want) {
            let (g, w) = (g.load() as f64, w.load() as f64);
            if w.is_nan() {
                continue;
            }
            compared += 1;
            if !g.is_finite() {
                unwritten += 1;
                continue;
            }
            d += (g - w).powi(2);
            n += w * w;
        }
        let rel = if n == 0.0 { d.sqrt() } else { (d / n).sqrt() };
        let ok = got.len() == want.len() && compared > 0 && unwritten == 0 && rel <= tol;
        if !ok {
            self.failed += 1;
        }
        // serde_json writes a non-finite number as null.
        self.results.push(serde_json::json!({
            "kernel": kernel, "size": size, "rel_err": rel, "tol": tol,
            "compared": compared, "non_finite": unwritten, "ok": ok,
        }));
    }

    /// A check that is not a tolerance: `ok` or not, and what was seen.
    fn check(&mut self, kernel: &str, size: &str, ok: bool, seen: &str) {
        if !ok {
            self.failed += 1;
        }
        self.results.push(serde_json::json!({
            "kernel": kernel, "size": size, "ok": ok, "seen": seen,
        }));
    }
}

fn poisoned<T: Elem>(dev: &Device, n: usize) -> Result<DeviceBuffer<T>> {
    dev.upload("output", &vec![T::store(f32::NAN); n])
}

fn up<T: Elem>(dev: &Device, v: &[f32]) -> Result<DeviceBuffer<T>> {
    dev.upload("input", &typed::<T>(v))
}

fn check_all<T: Elem>(dev: &Device, rep: &mut Report, tol: f64) -> Result<()>
where
    cudarc::cublas::CudaBlas: cudarc::cublas::Gemm<T>,
{
    let sfx = T::SUFFIX;
    let name = |k: &str| format!("{k}_{sfx}");
    // Norms and bias (over 128 rows, the column sums' chunks of ROW_CHUNK
    // rows: 129 is one full chunk and one row, 300 two and a part).
    for (rows, cols) in [
        (3usize, 1usize),
        (5, 255),
        (4, 257),
        (7, 1000),
        (2, 4096),
        (129, 7),
        (300, 257),
    ] {
        let size = format!("{rows}x{cols}");
        let n = rows * cols;
        let (x, w, b, dy) = (
            typed::<T>(&data(n, 1)),
            typed::<T>(&data(cols, 2)),
            typed::<T>(&data(cols, 3)),
            typed::<T>(&data(n, 4)),
        );
        let (dx_, dw_, db_) = (
            up::<T>(dev, &r::cast::<T, f32>(&x))?,
            up::<T>(dev, &r::cast::<T, f32>(&w))?,
            up::<T>(dev, &r::cast::<T, f32>(&b))?,
        );
        let ddy = up::<T>(dev, &r::cast::<T, f32>(&dy))?;
        let (y, mean, rstd) = r::layernorm_fwd(&x, &w, Some(&b), cols, 1e-5);
        let (mut gy, mut gm, mut gr) = (
            poisoned::<T>(dev, n)?,
            poisoned::<f32>(dev, rows)?,
            poisoned::<f32>(dev, rows)?,
        );
        ops::layernorm_fwd(
            dev,
            NormOut {
                y: &mut gy,
                mean: Some(&mut gm),
                rstd: &mut gr,
            },
            &dx_,
            &dw_,
            Some(&db_),
            cols,
            1e-5,
        )?;
        rep.compare(&name("layernorm_fwd"), &size, &dev.download(&gy)?, &y, tol);
        rep.compare(
            "layernorm_fwd.rstd",
            &size,
            &dev.download(&gr)?,
            &rstd,
            1e-5,
        );
        let dx = r::layernorm_bwd_dx(&dy, &x, &w, &mean, &rstd, cols);
        let mut gdx = poisoned::<T>(dev, n)?;
        let stats = NormStats {
            mean: Some(&gm),
            rstd: &gr,
        };
        ops::layernorm_bwd_dx(dev, &mut gdx, &ddy, &dx_, &dw_, stats, cols)?;
        rep.compare(
            &name("layernorm_bwd_dx"),
            &size,
            &dev.download(&gdx)?,
            &dx,
            tol,
        );
        let (mut dw, mut db) = (data(cols, 5), data(cols, 6));
        let (mut gdw, mut gdb) = (dev.upload("dw", &dw)?, dev.upload("db", &db)?);
        r::layernorm_bwd_wb(&mut dw, Some(&mut db), &dy, &x, &mean, &rstd, cols);
        ops::layernorm_bwd_wb(dev, &mut gdw, Some(&mut gdb), &ddy, &dx_, stats, cols)?;
        rep.compare(
            &name("layernorm_bwd_wb.dw"),
            &size,
            &dev.download(&gdw)?,
            &dw,
            1e-5,
        );
        rep.compare(
            &name("layernorm_bwd_wb.db"),
            &size,
            &dev.download(&gdb)?,
            &db,
            1e-5,
        );

        let (y, rstd) = r::rmsnorm_fwd(&x, &w, cols, 1e-6);
        let (mut gy, mut gr) = (poisoned::<T>(dev, n)?, poisoned::<f32>(dev, rows)?);
        ops::rmsnorm_fwd(
            dev,
            NormOut {
                y: &mut gy,
                mean: None,
                rstd: &mut gr,
            },
            &dx_,
            &dw_,
            cols,
            1e-6,
        )?;
        rep.compare(&name("rmsnorm_fwd"), &size, &dev.download(&gy)?, &y, tol);
        let dx = r::rmsnorm_bwd_dx(&dy, &x, &w, &rstd, cols);
        let mut gdx = poisoned::<T>(dev, n)?;
        ops::rmsnorm_bwd_dx(dev, &mut gdx, &ddy, &dx_, &dw_, &gr, cols)?;
        rep.compare(
            &name("rmsnorm_bwd_dx"),
            &size,
            &dev.download(&gdx)?,
            &dx,
            tol,
        );
        let mut dw = data(cols, 7);
        let mut gdw = dev.upload("dw", &dw)?;
        r::rmsnorm_bwd_w(&mut dw, &dy, &x, &rstd, cols);
        ops::rmsnorm_bwd_w(dev, &mut gdw, &ddy, &dx_, &gr, cols)?;
        rep.compare(
            &name("rmsnorm_bwd_w"),
            &size,
            &dev.download(&gdw)?,
            &dw,
            1e-5,
        );

        // Bias.
        let mut yb = x.clone();
        r::bias_add(&mut yb, &b);
        let mut gyb = up::<T>(dev, &r::cast::<T, f32>(&x))?;
        ops::bias_add(dev, &mut gyb, &db_)?;
        rep.compare(&name("bias_add"), &size, &dev.download(&gyb)?, &yb, tol);
        let mut dbb = data(cols, 8);
        let mut gdbb = dev.upload("db", &dbb)?;
        r::bias_grad(&mut dbb, &dy);
        ops::bias_grad(dev, &mut gdbb, &ddy)?;
        rep.compare(&name("bias_grad"), &size, &dev.download(&gdbb)?, &dbb, 1e-5);
    }
    // Rope.
    for head_dim in [2usize, 64, 130] {
        let s = RopeShape {
            batch: 2,
            seq: 33,
            heads: 3,
            head_dim,
        };
        let half = head_dim / 2;
        let n = s.batch * s.seq * s.heads * head_dim;
        let x = typed::<T>(&data(n, 9));
        let theta: Vec<f32> = (0..s.seq * half)
            .map(|i| (i / half) as f32 * 10000f32.powf(-((i % half) as f32) / half as f32))
            .collect();
        let (cos, sin): (Vec<f32>, Vec<f32>) = theta.iter().map(|t| (t.cos(), t.sin())).unzip();
        let (gx, gc, gs) = (
            up::<T>(dev, &r::cast::<T, f32>(&x))?,
            dev.upload("cos", &cos)?,
            dev.upload("sin", &sin)?,
        );
        for sign in [1.0f32, -1.0] {
            let want = r::rope(&x, &cos, &sin, s, sign);
            let mut gy = poisoned::<T>(dev, n)?;
            ops::rope(dev, &mut gy, &gx, &gc, &gs, s, sign)?;
            rep.compare(
                &name("rope"),
                &format!("d{head_dim} sign{sign}"),
                &dev.download(&gy)?,
                &want,
                tol,
            );
        }
    }
    // Causal softmax.
    for seq in [1usize, 7, 255, 257, 1024] {
        let rows = 2 * seq;
        let (s, dp) = (
            typed::<T>(&data(rows * seq, 10)),
            typed::<T>(&data(rows * seq, 11)),
        );
        let p = r::softmax_causal_fwd(&s, seq, 0.125);
        let (gsc, gdp) = (
            up::<T>(dev, &r::cast::<T, f32>(&s))?,
            up::<T>(dev, &r::cast::<T, f32>(&dp))?,
        );
        let mut gp = poisoned::<T>(dev, rows * seq)?;
        ops::softmax_causal_fwd(dev, &mut gp, &gsc, seq, 0.125)?;
        rep.compare(
            &name("softmax_causal_fwd"),
            &format!("seq{seq}"),
            &dev.download(&gp)?,
            &p,
            tol,
        );
        let ds = r::softmax_bwd(&p, &dp, seq, 0.125);
        let gp2 = up::<T>(dev, &r::cast::<T, f32>(&p))?;
        let mut gds = poisoned::<T>(dev, rows * seq)?;
        ops::softmax_bwd(dev, &mut gds, &gp2, &gdp, seq, 0.125)?;
        rep.compare(
            &name("softmax_bwd"),
            &format!("seq{seq}"),
            &dev.download(&gds)?,
            &ds,
            tol,
        );
    }
    // Pointwise.
    for n in [1usize, 7, 1000, 1 << 20] {
        let size = n.to_string();
        let x = typed::<T>(&data(n, 12).iter().map(|v| v * 3.0).collect::<Vec<_>>());
        let (u, dy) = (typed::<T>(&data(n, 13)), typed::<T>(&data(n, 14)));
        let (gx, gu, gdy) = (
            up::<T>(dev, &r::cast::<T, f32>(&x))?,
            up::<T>(dev, &r::cast::<T, f32>(&u))?,
            up::<T>(dev, &r::cast::<T, f32>(&dy))?,
        );
        let mut g = poisoned::<T>(dev, n)?;
        ops::gelu_tanh_fwd(dev, &mut g, &gx)?;
        rep.compare(
            &name("gelu_tanh_fwd"),
            &size,
            &dev.download(&g)?,
            &r::gelu_tanh_fwd(&x),
            tol,
        );
        // Poisoned again: `g` holds the forward's output.
        let mut g = poisoned::<T>(dev, n)?;
        ops::gelu_tanh_bwd(dev, &mut g, &gdy, &gx)?;
        rep.compare(
            &name("gelu_tanh_bwd"),
            &size,
            &dev.download(&g)?,
            &r::gelu_tanh_bwd(&dy, &x),
            tol,
        );
        let mut g = poisoned::<T>(dev, n)?;
        ops::swiglu_fwd(dev, &mut g, &gx, &gu)?;
        rep.compare(
            &name("swiglu_fwd"),
            &size,
            &dev.download(&g)?,
            &r::swiglu_fwd(&x, &u),
            tol,
        );
        let (dg, du) = r::swiglu_bwd(&dy, &x, &u);
        let (mut g1, mut g2) = (poisoned::<T>(dev, n)?, poisoned::<T>(dev, n)?);
        ops::swiglu_bwd(dev, &mut g1, &mut g2, &gdy, &gx, &gu)?;
        rep.compare(
            &name("swiglu_bwd.dgate"),
            &size,
            &dev.download(&g1)?,
            &dg,
            tol,
        );
        rep.compare(
            &name("swiglu_bwd.dup"),
            &size,
            &dev.download(&g2)?,
            &du,
            tol,
        );
    }
    // Cross-entropy and the loss sum.
    for vocab in [1usize, 257, 50257] {
        let rows = 9;
        let logits = typed::<T>(
            &data(rows * vocab, 15)
                .iter()
                .map(|v| v * 8.0)
                .collect::<Vec<_>>(),
        );
        let mut targets: Vec<i32> = (0..rows).map(|i| ((i * 7919) % vocab) as i32).collect();
        targets[4] = -100;
        let (loss, grad) = r::cross_entropy(&logits, &targets, vocab, -100, Some(1.0 / 8.0));
        let (gl, gt) = (
            up::<T>(dev, &r::cast::<T, f32>(&logits))?,
            dev.upload("targets", &targets)?,
        );
        let (mut glr, mut gd) = (
            poisoned::<f32>(dev, rows)?,
            poisoned::<T>(dev, rows * vocab)?,
        );
        ops::cross_entropy(
            dev,
            &mut glr,
            Some(&mut gd),
            &gl,
            &gt,
            vocab,
            -100,
            1.0 / 8.0,
        )?;
        let size = format!("vocab{vocab}");
        rep.compare(
            &name("cross_entropy.loss"),
            &size,
            &dev.download(&glr)?,
            &loss,
            1e-5,
        );
        rep.compare(
            &name("cross_entropy.dlogits"),
            &size,
            &dev.download(&gd)?,
            &grad.unwrap(),
            tol,
        );
        let mut gs = poisoned::<f32>(dev, 1)?;
        ops::sum_f32(dev, &mut gs, &glr)?;
        rep.compare(
            "sum_f32",
            &size,
            &dev.download(&gs)?,
            &[r::sum_f32(&loss)],
            1e-5,
        );
    }
    // Embedding.
    for hidden in [1usize, 257, 768] {
        let vocab = 50;
        let ids: Vec<i32> = (0..300).map(|i| ((i * 37) % vocab) as i32).collect();
        let table = typed::<T>(&data(vocab * hidden, 16));
        let dy = typed::<T>(&data(ids.len() * hidden, 17));
        let (gtab, gids) = (
            up::<T>(dev, &r::cast::<T, f32>(&table))?,
            dev.upload("ids", &ids)?,
        );
        let mut go = poisoned::<T>(dev, ids.len() * hidden)?;
        ops::embedding_fwd(dev, &mut go, &gtab, &gids, hidden)?;
        rep.compare(
            &name("embedding_fwd"),
            &format!("h{hidden}"),
            &dev.download(&go)?,
            &r::embedding_fwd(&table, &ids, hidden),
            0.0,
        );
        let druns = DeviceRuns::new(dev, &ids, vocab)?;
        let mut gt = data(vocab * hidden, 18);
        let mut ggt = dev.upload("grad_table", &gt)?;
        let gdy = up::<T>(dev, &r::cast::<T, f32>(&dy))?;
        r::embedding_bwd(&mut gt, &dy, &ids, hidden);
        ops::embedding_bwd(dev, &mut ggt, &gdy, &druns, vocab, hidden)?;
        rep.compare(
            &name("embedding_bwd"),
            &format!("h{hidden}"),
            &dev.download(&ggt)?,
            &gt,
            1e-5,
        );
    }
    // Layout moves and the residual add.
    let hs = HeadsShape {
        batch: 2,
        seq: 33,
        heads: 3,
        head_dim: 24,
        slots: 3,
    };
    let rows = typed::<T>(&data(hs.heads_numel() * 3, 23));
    let grows = up::<T>(dev, &r::cast::<T, f32>(&rows))?;
    let mut back = poisoned::<T>(dev, rows.len())?;
    for slot in 0..3 {
        let want = r::heads_from_rows(&rows, hs, slot);
        let mut gh = poisoned::<T>(dev, hs.heads_numel())?;
        ops::heads_from_rows(dev, &mut gh, &grows, hs, slot)?;
        rep.compare(
            &name("heads_from_rows"),
            &format!("slot{slot}"),
            &dev.download(&gh)?,
            &want,
            0.0,
        );
        ops::rows_from_heads(dev, &mut back, &gh, hs, slot)?;
    }
    rep.compare(
        &name("rows_from_heads"),
        "3 slots",
        &dev.download(&back)?,
        &rows,
        0.0,
    );
    let (xa, xb) = (
        typed::<T>(&data(100_001, 24)),
        typed::<T>(&data(100_001, 25)),
    );
    let (ga, gb) = (
        up::<T>(dev, &r::cast::<T, f32>(&xa))?,
        up::<T>(dev, &r::cast::<T, f32>(&xb))?,
    );
    let mut gy = poisoned::<T>(dev, xa.len())?;
    ops::add(dev, &mut gy, &ga, &gb)?;
    rep.compare(
        &name("add"),
        "100001",
        &dev.download(&gy)?,
        &r::add(&xa, &xb),
        tol,
    );
    // Grouped-query attention's repeat and its gradient's sum.
    let ks = KvShape {
        batch: 2,
        kv_heads: 3,
        group: 4,
        n: 33 * 24,
    };
    let kv = typed::<T>(&data(ks.batch * ks.kv_heads * ks.n, 26));
    let gkv = up::<T>(dev, &r::cast::<T, f32>(&kv))?;
    let mut grep = poisoned::<T>(dev, kv.len() * ks.group)?;
    ops::repeat_kv(dev, &mut grep, &gkv, ks)?;
    let rep_want = r::repeat_kv(&kv, ks);
    rep.compare(
        &name("repeat_kv"),
        "2x3x4",
        &dev.download(&grep)?,
        &rep_want,
        0.0,
    );
    let mut gsum = poisoned::<T>(dev, kv.len())?;
    ops::sum_kv(dev, &mut gsum, &grep, ks)?;
    rep.compare(
        &name("sum_kv"),
        "2x3x4",
        &dev.download(&gsum)?,
        &r::sum_kv(&rep_want, ks),
        tol,
    );
    // Matmul (cuBLAS), every transpose.
    for (m, n, k) in [(1usize, 1usize, 1usize), (33, 65, 17), (128, 256, 768)] {
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let batch = 3;
            let (a, b) = (
                typed::<T>(&data(batch * m * k, 20)),
                typed::<T>(&data(batch * k * n, 21)),
            );
            let mut c = typed::<T>(&data(batch * m * n, 22));
            let (ga, gb) = (
                up::<T>(dev, &r::cast::<T, f32>(&a))?,
                up::<T>(dev, &r::cast::<T, f32>(&b))?,
            );
            let mut gc = up::<T>(dev, &r::cast::<T, f32>(&c))?;
            let s = MatmulShape {
                batch,
                m,
                n,
                k,
                trans_a: ta,
                trans_b: tb,
            };
            r::matmul(&mut c, &a, &b, batch, (m, n, k), (ta, tb), 0.5, 1.0);
            ops::matmul(dev, &mut gc, &ga, &gb, s, 0.5, 1.0)?;
            rep.compare(
                &name("matmul"),
                &format!("{m}x{n}x{k} t{}{}", ta as u8, tb as u8),
                &dev.download(&gc)?,
                &c,
                tol.max(1e-5),
            );
            // β 0 into a poisoned C (the units' outputs are not zeroed:
            // Device::alloc_output): cuBLAS must not read it.
            let mut gc0 = poisoned::<T>(dev, c.len())?;
            r::matmul(&mut c, &a, &b, batch, (m, n, k), (ta, tb), 1.0, 0.0);
            ops::matmul(dev, &mut gc0, &ga, &gb, s, 1.0, 0.0)?;
            rep.compare(
                &name("matmul"),
                &format!("{m}x{n}x{k} t{}{} beta 0", ta as u8, tb as u8),
                &dev.download(&gc0)?,
                &c,
                tol.max(1e-5),
            );
        }
    }
    Ok(())
}

/// [`ops::matmul_16_f32`] with `T` operands against the reference on
/// the same operands widened, at awkward and model sizes.
fn check_gemm16<T: ops::Half16 + Storage>(dev: &Device, rep: &mut Report, seed: u64) -> Result<()> {
    for (m, n, k) in [(33usize, 65usize, 17usize), (256, 1024, 768)] {
        for (ta, tb) in [(false, false), (true, false), (false, true)] {
            let batch = 2;
            let a: Vec<T> = r::cast(&data(batch * m * k, seed));
            let b: Vec<T> = r::cast(&data(batch * k * n, seed + 1));
            let mut c = data(batch * m * n, seed + 2);
            let (ga, gb) = (dev.upload("a", &a)?, dev.upload("b", &b)?);
            let mut gc = dev.upload("c", &c)?;
            let (a32, b32) = (r::cast::<T, f32>(&a), r::cast::<T, f32>(&b));
            r::matmul(&mut c, &a32, &b32, batch, (m, n, k), (ta, tb), 1.0, 0.5);
            let s = MatmulShape {
                batch,
                m,
                n,
                k,
                trans_a: ta,
                trans_b: tb,
            };
            ops::matmul_16_f32(dev, &mut gc, &ga, &gb, s, 1.0, 0.5)?;
            rep.compare(
                T::KERNEL,
                &format!("{m}x{n}x{k} t{}{}", ta as u8, tb as u8),
                &dev.download(&gc)?,
                &c,
                // Exact 16-bit operands, so only the accumulation differs
                // from the f64 reference; tensor cores add in fp32 but not
                // in IEEE's order and rounding: 1e-4 at k = 768, still 200
                // times under the bf16 bound.
                1e-4,
            );
        }
    }
    Ok(())
}

fn check_f32_only(dev: &Device, rep: &mut Report) -> Result<()> {
    // The 16-bit x 16-bit -> fp32 GEMMs of the units' bf16 and fp16 modes.
    check_gemm16::<bf16>(dev, rep, 60)?;
    check_gemm16::<f16>(dev, rep, 63)?;
    // AdamW: the CPU kernel's arithmetic, so the bits should be equal; the
    // tolerance is the fp32 one, and the JSON says the error.
    let n = 1_000_003;
    let (mut p, mut m, mut v) = (data(n, 30), vec![0f32; n], vec![0f32; n]);
    let (mut gp, mut gm, mut gv) = (
        dev.upload("master", &p)?,
        dev.upload("m", &m)?,
        dev.upload("v", &v)?,
    );
    let mut out = vec![bf16::ZERO; n];
    let mut gout = poisoned::<bf16>(dev, n)?;
    for step in 1..=3u64 {
        let g = data(n, 40 + step);
        let gg = dev.upload("grad", &g)?;
        let t = step as f64;
        let s = AdamScalars {
            grad_scale: 0.5,
            beta1: 0.9,
            one_minus_beta1: (1.0f64 - 0.9) as f32,
            beta2: 0.999,
            one_minus_beta2: (1.0f64 - 0.999) as f32,
            eps: 1e-8,
            neg_step_size: (-1e-3 / (1.0 - 0.9f64.powf(t))) as f32,
            inv_sqrt_bc2: (1.0 / (1.0 - 0.999f64.powf(t)).sqrt()) as f32,
            neg_lr_wd: (-1e-3f64 * 0.1) as f32,
        };
        r::adamw(&mut p, &mut m, &mut v, &g, Some(&mut out), s);
        ops::adamw(
            dev,
            AdamState {
                master: &mut gp,
                m: &mut gm,
                v: &mut gv,
            },
            &gg,
            Some(&mut gout),
            s,
        )?;
    }
    let got = dev.download(&gp)?;
    let differ = got
        .iter()
        .zip(&p)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    rep.compare(
        "adamw_bf16.master",
        &format!("{n} x3 steps"),
        &got,
        &p,
        1e-5,
    );
    // The device optimizer's claim (src/engine/device/resident.rs): the
    // CPU kernel's bits (--fmad=false, IEEE division and square root).
    rep.check(
        "adamw_bf16.master_bits",
        &format!("{n} x3 steps"),
        differ == 0 && got.len() == p.len(),
        &format!("{differ} of {n} elements differ from the CPU kernel's bits"),
    );
    rep.compare(
        "adamw_bf16.out",
        &n.to_string(),
        &dev.download(&gout)?,
        &out,
        2e-2,
    );
    check_norm(dev, rep)?;
    // Casts.
    let x = data(100_001, 50);
    let gx = dev.upload("x", &x)?;
    let mut gb = poisoned::<bf16>(dev, x.len())?;
    ops::cast(dev, &mut gb, &gx)?;
    rep.compare(
        "cast_f32_bf16",
        "100001",
        &dev.download(&gb)?,
        &r::cast::<f32, bf16>(&x),
        0.0,
    );
    let mut gh = poisoned::<half::f16>(dev, x.len())?;
    ops::cast(dev, &mut gh, &gb)?;
    let bx: Vec<bf16> = r::cast(&x);
    rep.compare(
        "cast_bf16_f16",
        "100001",
        &dev.download(&gh)?,
        &r::cast::<bf16, half::f16>(&bx),
        0.0,
    );
    let mut gf = poisoned::<f32>(dev, x.len())?;
    ops::cast(dev, &mut gf, &gh)?;
    let hx: Vec<half::f16> = r::cast(&bx);
    rep.compare(
        "cast_f16_f32",
        "100001",
        &dev.download(&gf)?,
        &r::cast::<half::f16, f32>(&hx),
        0.0,
    );
    // Narrowing to fp16 and from fp16 to bf16, where every element needs
    // rounding (the bf16 values above fit fp16 exactly, so the check of
    // bf16 -> fp16 never rounds): magnitudes to 1000, exact ties between
    // two fp16 values (round half to even), fp16 subnormals, and values
    // just under fp16's largest.
    let mut y: Vec<f32> = data(50_000, 51).iter().map(|v| v * 1000.0).collect();
    y.extend((0..1000).map(|k| 1.0 + k as f32 * 2f32.powi(-10) + 2f32.powi(-11)));
    y.extend((0..1000).map(|k| -(k as f32) * 0.75 * 2f32.powi(-24)));
    y.extend([65504.0, 65519.0, -65519.0, 6.1e-5, 5.9e-8, 3.0e-8]);
    let gy = dev.upload("y", &y)?;
    let mut gyh = poisoned::<half::f16>(dev, y.len())?;
    ops::cast(dev, &mut gyh, &gy)?;
    let yh: Vec<half::f16> = r::cast(&y);
    let size = y.len().to_string();
    rep.compare("cast_f32_f16", &size, &dev.download(&gyh)?, &yh, 0.0);
    let mut gyb = poisoned::<bf16>(dev, y.len())?;
    ops::cast(dev, &mut gyb, &gyh)?;
    rep.compare(
        "cast_f16_bf16",
        &size,
        &dev.download(&gyb)?,
        &r::cast::<half::f16, bf16>(&yh),
        0.0,
    );
    // Past the grid's 65536 blocks of 256 threads: the grid-stride loop's
    // second pass (every pointwise kernel's), which the sizes above never
    // reach and the units' activations do (8 x 1024 x 3072 elements).
    let n = (1usize << 24) + 257;
    let z = data(n, 52);
    let gz = dev.upload("z", &z)?;
    let mut gzb = poisoned::<bf16>(dev, n)?;
    ops::cast(dev, &mut gzb, &gz)?;
    rep.compare(
        "cast_f32_bf16",
        &n.to_string(),
        &dev.download(&gzb)?,
        &r::cast::<f32, bf16>(&z),
        0.0,
    );
    Ok(())
}

/// The clipping norm's parts (`sumsq_parts`) bit for bit against the
/// reference: the host optimizer's order, so the device optimizer clips
/// on the host's bits. Segments of several buffers with a gap, runs
/// across part bounds, an empty group and one of zeros, and one group of
/// 3 million elements in parts of 8192 (the optimizer's).
fn check_norm(dev: &Device, rep: &mut Report) -> Result<()> {
    use tierzero_gpu::norm::{NormGroup, NormSegment};
    let host: Vec<Vec<f32>> = [1usize, 300, 5000, 40_000, 3_000_017]
        .iter()
        .enumerate()
        .map(|(i, &n)| data(n, 80 + i as u64))
        .collect();
    let gpu = host
        .iter()
        .map(|h| dev.upload("norm input", h))
        .collect::<Result<Vec<_>>>()?;
    fn groups<'a, B>(b: &'a [B], part_numel: usize, big: usize) -> Vec<NormGroup<'a, B>> {
        let seg = |buf, offset, numel, flat_start| NormSegment {
            buf,
            offset,
            numel,
            flat_start,
        };
        vec![
            NormGroup {
                numel: 0,
                part_numel,
                segments: vec![],
            },
            NormGroup {
                numel: 77,
                part_numel,
                segments: vec![],
            },
            NormGroup {
                numel: 46_000,
                part_numel,
                segments: vec![
                    seg(&b[1], 7, 293, 0),
                    seg(&b[0], 0, 1, 293),
                    seg(&b[3], 5, 39_995, 300),
                    seg(&b[2], 0, 5000, 40_995),
                ],
            },
            NormGroup {
                numel: big + 100,
                part_numel: 8192,
                segments: vec![seg(&b[4], 17, big, 100)],
            },
        ]
    }
    let big = 3_000_000;
    for part_numel in [100usize, 8192] {
        let want = r::sumsq_parts(&groups(&host, part_numel, big))?;
        let g = groups(&gpu, part_numel, big);
        let mut out = dev.upload("norm parts", &vec![f64::NAN; want.len()])?;
        ops::sumsq_parts(dev, &mut out, &g)?;
        let got = dev.download(&out)?;
        let differ = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        rep.check(
            "sumsq_parts",
            &format!("{} parts (of {part_numel} and 8192)", want.len()),
            differ == 0 && got.len() == want.len() && !want.is_empty(),
            &format!(
                "{differ} of {} parts differ from the reference's bits",
                want.len()
            ),
        );
    }
    Ok(())
}

#[path = "kernel_check/params16.rs"]
mod params16;

#[path = "kernel_check/collective.rs"]
mod collective;

fn main() {
    let out_path = std::env::args().nth(1);
    let t0 = Instant::now();
    let opts = DeviceOptions {
        budget_bytes: None,
        cache: KernelCache::in_default_dir(),
    };
    let emit = |json: String| {
        println!("{json}");
        if let Some(p) = &out_path {
            std::fs::write(p, format!("{json}\n")).expect("writing the JSON");
        }
    };
    let dev = match Device::open(0, &opts) {
        Ok(d) => std::sync::Arc::new(d),
        Err(e) => {
            emit(
                serde_json::json!({"ok": false, "step": "open", "error": e.to_string()})
                    .to_string(),
            );
            eprintln!("kernel_check: {e}");
            std::process::exit(2);
        }
    };
    let open_s = t0.elapsed().as_secs_f64();
    let mut rep = Report {
        results: Vec::new(),
        failed: 0,
    };
    let run = check_all::<f32>(&dev, &mut rep, 1e-5)
        .and_then(|_| check_all::<bf16>(&dev, &mut rep, 2e-2))
        .and_then(|_| check_f32_only(&dev, &mut rep))
        .and_then(|_| params16::check_params16(&dev, &mut rep))
        .and_then(|_| collective::check_collective(&dev, &mut rep));
    let error = match run {
        Ok(()) => None,
        Err(e) => {
            rep.failed += 1;
            Some(e.to_string())
        }
    };
    let ok = rep.failed == 0;
    emit(
        serde_json::json!({
            "ok": ok,
            "device": dev.name(),
            "arch": dev.arch(),
            "open_s": open_s,
            "total_s": t0.elapsed().as_secs_f64(),
            "checks": rep.results.len(),
            "failed": rep.failed,
            "error": error,
            "results": rep.results,
        })
        .to_string(),
    );
    std::process::exit(if ok { 0 } else { 1 });
}

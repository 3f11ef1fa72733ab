//! The kernels' scalar references (`tierzero_gpu::reference`) against
//! candle's autograd in f64, at awkward sizes: forward outputs and every
//! gradient within 1e-5 relative (fp32 storage), and the 16-bit storage
//! paths within their rounding.
#![allow(clippy::unwrap_used)]

use candle_core::{DType, Device, Tensor, Var};
use half::bf16;
use tierzero_gpu::norm::{NormGroup, NormSegment};
use tierzero_gpu::reference as r;

/// Columns that cross warp and block boundaries.
const COLS: [usize; 6] = [1, 7, 255, 256, 257, 1000];
const ROWS: usize = 3;

fn data(n: usize, seed: u64) -> Vec<f32> {
    tierzero_gpu::reference::test_values(n, seed)
}

fn var(v: &[f32], shape: &[usize]) -> Var {
    let v64: Vec<f64> = v.iter().map(|&x| x as f64).collect();
    Var::from_slice(&v64, shape, &Device::Cpu).unwrap()
}

fn tensor(v: &[f32], shape: &[usize]) -> Tensor {
    var(v, shape).as_tensor().clone()
}

fn vals(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// ‖got − want‖ / ‖want‖ (0 when both are 0).
fn rel(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let (mut d, mut n) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        assert!(g.is_finite(), "non-finite output {g}");
        d += (g as f64 - w).powi(2);
        n += w * w;
    }
    if n == 0.0 {
        d.sqrt()
    } else {
        (d / n).sqrt()
    }
}

fn close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    let e = rel(got, want);
    assert!(e <= tol, "{what}: relative error {e:e} > {tol:e}");
}

/// The gradients of `Σ y·dy` (`dy` laid out as `y`).
fn grads(y: &Tensor, dy: &[f32]) -> candle_core::backprop::GradStore {
    let dy = tensor(dy, y.dims());
    (y * dy).unwrap().sum_all().unwrap().backward().unwrap()
}

/// [`close`] at 1e-5 for the gradient of `v` in `g`.
fn close_grad(what: &str, got: &[f32], g: &candle_core::backprop::GradStore, v: &Var) {
    close(what, got, &vals(g.get(v).unwrap()), 1e-5);
}

#[test]
fn layernorm_forward_and_backward() {
    for cols in COLS {
        let n = ROWS * cols;
        let (x, w, b, dy) = (data(n, 1), data(cols, 2), data(cols, 3), data(n, 4));
        let eps = 1e-5;
        let (y, mean, rstd) = r::layernorm_fwd(&x, &w, Some(&b), cols, eps);
        let dx = r::layernorm_bwd_dx(&dy, &x, &w, &mean, &rstd, cols);
        let (mut dw, mut db) = (vec![0f32; cols], vec![0f32; cols]);
        r::layernorm_bwd_wb(&mut dw, Some(&mut db), &dy, &x, &mean, &rstd, cols);

        let (xv, wv, bv) = (var(&x, &[ROWS, cols]), var(&w, &[cols]), var(&b, &[cols]));
        let mu = xv.mean_keepdim(1).unwrap();
        let xc = xv.broadcast_sub(&mu).unwrap();
        let v = xc.sqr().unwrap().mean_keepdim(1).unwrap();
        let yh = xc
            .broadcast_div(&v.affine(1.0, eps as f64).unwrap().sqrt().unwrap())
            .unwrap();
        let yt = yh.broadcast_mul(&wv).unwrap().broadcast_add(&bv).unwrap();
        let g = grads(&yt, &dy);
        let what = format!("layernorm cols {cols}");
        close(&format!("{what} y"), &y, &vals(&yt), 1e-5);
        close_grad(&format!("{what} dx"), &dx, &g, &xv);
        close_grad(&format!("{what} dw"), &dw, &g, &wv);
        close_grad(&format!("{what} db"), &db, &g, &bv);
    }
}

#[test]
fn rmsnorm_forward_and_backward() {
    // Not 1 column: there dx = rstd·g·eps / (x² + eps), a difference of two
    // terms equal to f32 precision (in any formula that, like torch's
    // autograd, differentiates x·rstd), so no f32 result is within 1e-5.
    for cols in COLS.into_iter().skip(1) {
        let n = ROWS * cols;
        let (x, w, dy) = (data(n, 5), data(cols, 6), data(n, 7));
        let eps = 1e-6;
        let (y, rstd) = r::rmsnorm_fwd(&x, &w, cols, eps);
        let dx = r::rmsnorm_bwd_dx(&dy, &x, &w, &rstd, cols);
        let mut dw = vec![0f32; cols];
        r::rmsnorm_bwd_w(&mut dw, &dy, &x, &rstd, cols);

        let (xv, wv) = (var(&x, &[ROWS, cols]), var(&w, &[cols]));
        let ms = xv.sqr().unwrap().mean_keepdim(1).unwrap();
        let yh = xv
            .broadcast_div(&ms.affine(1.0, eps as f64).unwrap().sqrt().unwrap())
            .unwrap();
        let yt = yh.broadcast_mul(&wv).unwrap();
        let g = grads(&yt, &dy);
        let what = format!("rmsnorm cols {cols}");
        close(&format!("{what} y"), &y, &vals(&yt), 1e-5);
        close_grad(&format!("{what} dx"), &dx, &g, &xv);
        close_grad(&format!("{what} dw"), &dw, &g, &wv);
    }
}

#[test]
fn rope_and_its_inverse_are_the_rotation_and_its_gradient() {
    for head_dim in [2usize, 6, 64, 130] {
        let s = r::RopeShape {
            batch: 2,
            seq: 5,
            heads: 3,
            head_dim,
        };
        let half = head_dim / 2;
        let n = s.batch * s.seq * s.heads * head_dim;
        let (x, dy) = (data(n, 8), data(n, 9));
        let theta: Vec<f32> = (0..s.seq * half)
            .map(|i| (i / half) as f32 * 10000f32.powf(-((i % half) as f32) / half as f32))
            .collect();
        let (cos, sin): (Vec<f32>, Vec<f32>) = theta.iter().map(|t| (t.cos(), t.sin())).unzip();
        let y = r::rope(&x, &cos, &sin, s, 1.0);
        let dx = r::rope(&dy, &cos, &sin, s, -1.0);

        let shape = [s.batch, s.seq, s.heads, head_dim];
        let xv = var(&x, &shape);
        let c = tensor(&cos, &[1, s.seq, 1, half]);
        let sn = tensor(&sin, &[1, s.seq, 1, half]);
        let x1 = xv.narrow(3, 0, half).unwrap();
        let x2 = xv.narrow(3, half, half).unwrap();
        let y1 = (x1.broadcast_mul(&c).unwrap() - x2.broadcast_mul(&sn).unwrap()).unwrap();
        let y2 = (x2.broadcast_mul(&c).unwrap() + x1.broadcast_mul(&sn).unwrap()).unwrap();
        let yt = Tensor::cat(&[y1, y2], 3).unwrap();
        let g = grads(&yt, &dy);
        close(&format!("rope {head_dim} y"), &y, &vals(&yt), 1e-5);
        close_grad(&format!("rope {head_dim} dx"), &dx, &g, &xv);
    }
}

#[test]
fn causal_softmax_forward_and_backward() {
    for seq in [1usize, 7, 255, 257, 600] {
        let rows = 2 * seq; // two (batch, head) pairs of `seq` queries
        let (s, dp) = (data(rows * seq, 10), data(rows * seq, 11));
        let scale = 0.125;
        let p = r::softmax_causal_fwd(&s, seq, scale);
        let ds = r::softmax_bwd(&p, &dp, seq, scale);

        let sv = var(&s, &[rows, seq]);
        let mask: Vec<f32> = (0..rows * seq)
            .map(|i| {
                if i % seq <= (i / seq) % seq {
                    0.0
                } else {
                    -1e30
                }
            })
            .collect();
        let z = sv
            .affine(scale as f64, 0.0)
            .unwrap()
            .broadcast_add(&tensor(&mask, &[rows, seq]))
            .unwrap();
        let z = z
            .broadcast_sub(&z.max_keepdim(1).unwrap())
            .unwrap()
            .exp()
            .unwrap();
        let pt = z.broadcast_div(&z.sum_keepdim(1).unwrap()).unwrap();
        let g = grads(&pt, &dp);
        close(&format!("softmax {seq} p"), &p, &vals(&pt), 1e-5);
        close_grad(&format!("softmax {seq} ds"), &ds, &g, &sv);
    }
}

#[test]
fn gelu_and_swiglu_forward_and_backward() {
    for n in [1usize, 7, 1000, 4097] {
        let (x, u, dy) = (data(n, 12), data(n, 13), data(n, 14));
        let x3: Vec<f32> = x.iter().map(|v| v * 3.0).collect(); // into the tails
        let y = r::gelu_tanh_fwd(&x3);
        let dx = r::gelu_tanh_bwd(&dy, &x3);
        let xv = var(&x3, &[n]);
        let inner =
            (xv.as_tensor() + xv.powf(3.0).unwrap().affine(0.044715, 0.0).unwrap()).unwrap();
        let t = inner
            .affine((2.0 / std::f64::consts::PI).sqrt(), 0.0)
            .unwrap()
            .tanh()
            .unwrap();
        let yt = (xv.as_tensor() * t.affine(0.5, 0.5).unwrap()).unwrap();
        let g = grads(&yt, &dy);
        close(&format!("gelu {n} y"), &y, &vals(&yt), 1e-5);
        close_grad(&format!("gelu {n} dx"), &dx, &g, &xv);

        let y = r::swiglu_fwd(&x3, &u);
        let (dg, du) = r::swiglu_bwd(&dy, &x3, &u);
        let (gv, uv) = (var(&x3, &[n]), var(&u, &[n]));
        let sig = gv
            .neg()
            .unwrap()
            .exp()
            .unwrap()
            .affine(1.0, 1.0)
            .unwrap()
            .recip()
            .unwrap();
        let yt = ((gv.as_tensor() * sig).unwrap() * uv.as_tensor()).unwrap();
        let g = grads(&yt, &dy);
        close(&format!("swiglu {n} y"), &y, &vals(&yt), 1e-5);
        close_grad(&format!("swiglu {n} dgate"), &dg, &g, &gv);
        close_grad(&format!("swiglu {n} dup"), &du, &g, &uv);
    }
}

#[test]
fn bias_add_and_gradient() {
    for cols in COLS {
        let (x, b, dy) = (data(ROWS * cols, 15), data(cols, 16), data(ROWS * cols, 17));
        let mut y = x.clone();
        r::bias_add(&mut y, &b);
        let mut db = vec![0f32; cols];
        r::bias_grad(&mut db, &dy);
        let bv = var(&b, &[cols]);
        let yt = tensor(&x, &[ROWS, cols]).broadcast_add(&bv).unwrap();
        let g = grads(&yt, &dy);
        close(&format!("bias {cols} y"), &y, &vals(&yt), 1e-6);
        close_grad(&format!("bias {cols} db"), &db, &g, &bv);
    }
}

#[test]
fn cross_entropy_loss_and_logit_gradient() {
    for vocab in [1usize, 7, 257, 1000, 50257] {
        let rows = 4;
        let logits: Vec<f32> = data(rows * vocab, 18).iter().map(|v| v * 8.0).collect();
        let mut targets: Vec<i32> = (0..rows).map(|i| ((i * 7919) % vocab) as i32).collect();
        targets[2] = -100; // ignored
        let counted = 3.0f32;
        let (loss, grad) = r::cross_entropy(&logits, &targets, vocab, -100, Some(1.0 / counted));
        let total = r::sum_f32(&loss) / counted;

        let lv = var(&logits, &[rows, vocab]);
        let mx = lv.max_keepdim(1).unwrap();
        let lse = lv
            .broadcast_sub(&mx)
            .unwrap()
            .exp()
            .unwrap()
            .sum_keepdim(1)
            .unwrap()
            .log()
            .unwrap();
        let lse = (lse + mx).unwrap();
        let keep: Vec<u32> = vec![0, 1, 3];
        let keep_t = Tensor::new(keep.as_slice(), &Device::Cpu).unwrap();
        let idx: Vec<u32> = keep.iter().map(|&k| targets[k as usize] as u32).collect();
        let idx_t = Tensor::new(idx.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(1)
            .unwrap();
        let picked = lv
            .index_select(&keep_t, 0)
            .unwrap()
            .gather(&idx_t, 1)
            .unwrap();
        let per = (lse.index_select(&keep_t, 0).unwrap() - picked).unwrap();
        let mean = per.mean_all().unwrap();
        let g = mean.backward().unwrap();
        let want_total = vals(&mean)[0];
        let err = (total as f64 - want_total).abs() / want_total.abs().max(1e-30);
        assert!(
            err < 1e-5 || (total == 0.0 && want_total == 0.0),
            "vocab {vocab}: {total} vs {want_total}"
        );
        close(
            &format!("ce {vocab} dlogits"),
            &grad.unwrap(),
            &vals(g.get(&lv).unwrap()),
            1e-5,
        );
        assert_eq!(loss[2], 0.0);
    }
    // A target outside the vocabulary gives NaN, not a read past the row.
    let (loss, _) = r::cross_entropy(&[0.0f32; 4], &[4], 4, -100, None);
    assert!(loss[0].is_nan());
}

#[test]
fn embedding_forward_and_backward() {
    for hidden in [1usize, 7, 257] {
        let vocab = 11;
        let ids: Vec<i32> = vec![3, 0, 10, 3, 3, 7, 0];
        let (table, dy) = (data(vocab * hidden, 19), data(ids.len() * hidden, 20));
        let out = r::embedding_fwd(&table, &ids, hidden);
        let mut gt = vec![0f32; vocab * hidden];
        r::embedding_bwd(&mut gt, &dy, &ids, hidden);
        let tv = var(&table, &[vocab, hidden]);
        let idx: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
        let ot = tv
            .index_select(&Tensor::new(idx.as_slice(), &Device::Cpu).unwrap(), 0)
            .unwrap();
        let g = (&ot * tensor(&dy, &[ids.len(), hidden]))
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        close(&format!("embedding {hidden} out"), &out, &vals(&ot), 0.0);
        close(
            &format!("embedding {hidden} grad"),
            &gt,
            &vals(g.get(&tv).unwrap()),
            1e-6,
        );
    }
    let out = r::embedding_fwd(&[1.0f32, 2.0], &[2, -1], 1);
    assert!(out.iter().all(|v| v.is_nan()));
}

/// The column sums (bias and norm weight gradients) over more rows than one
/// chunk of `ROW_CHUNK`: their chunked order against candle's sums, and
/// against the plain f64 column sum.
#[test]
fn column_sums_over_several_chunks_of_rows() {
    use tierzero_gpu::kernels::ROW_CHUNK;
    for rows in [ROW_CHUNK - 1, ROW_CHUNK, ROW_CHUNK + 1, 2 * ROW_CHUNK + 44] {
        for cols in [1usize, 7, 257] {
            let n = rows * cols;
            let what = format!("{rows}x{cols}");
            let (x, w, b, dy) = (data(n, 31), data(cols, 32), data(cols, 33), data(n, 34));
            let want_db: Vec<f64> = (0..cols)
                .map(|c| (0..rows).map(|r| dy[r * cols + c] as f64).sum())
                .collect();
            // Accumulates: starts from a gradient already there.
            let start = data(cols, 35);
            let mut db = start.clone();
            r::bias_grad(&mut db, &dy);
            let got: Vec<f32> = db.iter().zip(&start).map(|(d, s)| d - s).collect();
            close(&format!("bias_grad {what}"), &got, &want_db, 1e-5);

            let (_, mean, rstd) = r::layernorm_fwd(&x, &w, Some(&b), cols, 1e-5);
            let (mut dw, mut db2) = (vec![0f32; cols], vec![0f32; cols]);
            r::layernorm_bwd_wb(&mut dw, Some(&mut db2), &dy, &x, &mean, &rstd, cols);
            let want_dw: Vec<f64> = (0..cols)
                .map(|c| {
                    (0..rows)
                        .map(|r| {
                            let xhat = (x[r * cols + c] as f64 - mean[r] as f64) * rstd[r] as f64;
                            dy[r * cols + c] as f64 * xhat
                        })
                        .sum()
                })
                .collect();
            close(&format!("layernorm dw {what}"), &dw, &want_dw, 1e-5);
            close(&format!("layernorm db {what}"), &db2, &want_db, 1e-5);

            let (_, rstd) = r::rmsnorm_fwd(&x, &w, cols, 1e-6);
            let mut dw = vec![0f32; cols];
            r::rmsnorm_bwd_w(&mut dw, &dy, &x, &rstd, cols);
            let want_dw: Vec<f64> = (0..cols)
                .map(|c| {
                    (0..rows)
                        .map(|r| {
                            dy[r * cols + c] as f64 * (x[r * cols + c] as f64 * rstd[r] as f64)
                        })
                        .sum()
                })
                .collect();
            close(&format!("rmsnorm dw {what}"), &dw, &want_dw, 1e-5);
        }
    }
}

/// The chunked order itself. Chunk 0 is 2^24 and then ones: in a running
/// f32 sum each one rounds away (2^24 + 1 ties to 2^24), so chunk 0 sums to
/// 2^24. Chunk 1 is `ROW_CHUNK` ones, which sum exactly, and 2^24 plus that
/// is exact too. One running sum over every row (the kernels' order before
/// the chunks) gives 2^24, so this fails unless each chunk is summed from
/// zero and the chunks are then added.
#[test]
fn column_sums_add_each_chunk_from_zero_then_the_chunks_in_order() {
    use tierzero_gpu::kernels::ROW_CHUNK;
    let big = 16_777_216f32; // 2^24
    let mut dy = vec![1f32; 2 * ROW_CHUNK];
    dy[0] = big;
    let mut db = vec![0f32];
    r::bias_grad(&mut db, &dy);
    assert_eq!(db[0], big + ROW_CHUNK as f32);
}

/// The flat elements of a group: its segments' values where they are,
/// zeros elsewhere.
fn flat_of(g: &NormGroup<'_, Vec<f32>>) -> Vec<f32> {
    let mut flat = vec![0f32; g.numel];
    for s in &g.segments {
        flat[s.flat_start..s.flat_start + s.numel]
            .copy_from_slice(&s.buf[s.offset..s.offset + s.numel]);
    }
    flat
}

/// The order of `tierzero_gpu::norm`, written over the flat elements:
/// each part's 8 lanes in index order, combined pairwise, the parts added
/// in order.
fn norm_by_definition(flat: &[f32], part_numel: usize) -> f64 {
    flat.chunks(part_numel).fold(0f64, |total, part| {
        let mut acc = [0f64; 8];
        for (i, &v) in part.iter().enumerate() {
            let g = f64::from(v);
            acc[i % 8] = g.mul_add(g, acc[i % 8]);
        }
        // Neighbours first: lane i + lane i + w, w = 1, 2, 4.
        for w in [1, 2, 4] {
            for i in (0..8).step_by(2 * w) {
                acc[i] += acc[i + w];
            }
        }
        total + acc[0]
    })
}

/// Pieces of several buffers, with gaps (zeros) and runs crossing part
/// bounds, give the bits of the same elements laid out flat; the sum is
/// Σ x² within f64 rounding.
#[test]
fn a_norm_over_segments_is_its_flat_elements_in_the_lane_order() {
    let bufs: Vec<Vec<f32>> = [1usize, 300, 5000, 40_000]
        .iter()
        .enumerate()
        .map(|(i, &n)| data(n, 60 + i as u64))
        .collect();
    for part_numel in [32usize, 100, 4096, 8192] {
        let groups = vec![
            // Nothing: no parts.
            NormGroup {
                numel: 0,
                part_numel,
                segments: vec![],
            },
            // No segment: zeros.
            NormGroup {
                numel: 77,
                part_numel,
                segments: vec![],
            },
            NormGroup {
                numel: 46_000,
                part_numel,
                segments: vec![
                    NormSegment {
                        buf: &bufs[1],
                        offset: 7,
                        numel: 293,
                        flat_start: 0,
                    },
                    NormSegment {
                        buf: &bufs[0],
                        offset: 0,
                        numel: 1,
                        flat_start: 293,
                    },
                    NormSegment {
                        buf: &bufs[1],
                        offset: 0,
                        numel: 0,
                        flat_start: 294,
                    },
                    // A gap of 6, then a long run across parts.
                    NormSegment {
                        buf: &bufs[3],
                        offset: 5,
                        numel: 39_995,
                        flat_start: 300,
                    },
                    NormSegment {
                        buf: &bufs[2],
                        offset: 0,
                        numel: 5000,
                        flat_start: 40_995,
                    },
                ],
            },
        ];
        // Every part, in plan order (group by group), is its own flat
        // elements' sum by the definition.
        let parts: Vec<u64> = r::sumsq_parts(&groups)
            .unwrap()
            .iter()
            .map(|p| p.to_bits())
            .collect();
        let want: Vec<u64> = groups
            .iter()
            .flat_map(|g| {
                flat_of(g)
                    .chunks(part_numel)
                    .map(|c| norm_by_definition(c, part_numel).to_bits())
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(parts, want, "parts of {part_numel}");
        let sums = r::norm_sq_sums(&groups).unwrap();
        assert_eq!(sums.len(), 3);
        assert_eq!(sums[0].to_bits(), 0f64.to_bits());
        assert_eq!(sums[1].to_bits(), 0f64.to_bits());
        for (g, &got) in groups.iter().zip(&sums) {
            let flat = flat_of(g);
            let want = norm_by_definition(&flat, part_numel);
            assert_eq!(got.to_bits(), want.to_bits(), "part length {part_numel}");
            // candle's Σ x² in f64 (its own order): within f64 rounding.
            let plain = Tensor::new(flat.as_slice(), &Device::Cpu)
                .and_then(|t| t.to_dtype(DType::F64))
                .and_then(|t| t.sqr())
                .and_then(|t| t.sum_all())
                .and_then(|t| t.to_scalar::<f64>())
                .unwrap();
            assert!((got - plain).abs() <= 1e-12 * plain.max(1e-300));
        }
    }
    // A square of f32::MAX is finite in f64; an inf or a NaN is not.
    let mut x = vec![f32::MAX; 100];
    let one = |x: &Vec<f32>| {
        r::norm_sq_sums(&[NormGroup {
            numel: x.len(),
            part_numel: 64,
            segments: vec![NormSegment {
                buf: x,
                offset: 0,
                numel: x.len(),
                flat_start: 0,
            }],
        }])
        .unwrap()[0]
    };
    assert!(one(&x).is_finite());
    x[99] = f32::NAN;
    assert!(one(&x).is_nan());
    x[99] = f32::NEG_INFINITY;
    assert_eq!(one(&x), f64::INFINITY);
}

/// A plan whose segments overlap, leave their group or their buffer, or
/// whose parts are empty, is an error that says which, never a panic or
/// a read outside a buffer.
#[test]
fn a_bad_norm_plan_is_refused_with_the_segment() {
    let buf = data(100, 70);
    let seg = |offset, numel, flat_start| NormSegment {
        buf: &buf,
        offset,
        numel,
        flat_start,
    };
    let cases = [
        (vec![seg(0, 10, 0), seg(0, 10, 5)], 50, 8, "overlaps"),
        (vec![seg(0, 10, 45)], 50, 8, "leaves the group"),
        (vec![seg(95, 10, 0)], 50, 8, "a buffer of 100"),
        (vec![seg(0, usize::MAX, 1)], 50, 8, "leaves the group"),
        (vec![seg(0, 10, 0)], 50, 0, "parts of 0 elements"),
    ];
    for (segments, numel, part_numel, says) in cases {
        let g = [NormGroup {
            numel,
            part_numel,
            segments,
        }];
        let e = r::norm_sq_sums(&g).unwrap_err().to_string();
        assert!(e.contains(says) && e.contains("sumsq_parts"), "{e}");
    }
}

#[test]
fn sixteen_bit_storage_rounds_once_at_the_store() {
    // bf16 in and out: the fp32 computation of the same (rounded) inputs,
    // rounded once.
    let cols = 257;
    let x32 = data(ROWS * cols, 22);
    let w32 = data(cols, 23);
    let x: Vec<bf16> = r::cast(&x32);
    let w: Vec<bf16> = r::cast(&w32);
    let (y16, _, _) = r::layernorm_fwd(&x, &w, None, cols, 1e-5);
    let (y32, _, _) = r::layernorm_fwd(
        &r::cast::<bf16, f32>(&x),
        &r::cast::<bf16, f32>(&w),
        None,
        cols,
        1e-5,
    );
    assert_eq!(y16, r::cast::<f32, bf16>(&y32));
    // The casts round to nearest even and keep NaN.
    let v = [
        1.0f32 + f32::EPSILON * 2f32.powi(15),
        f32::NAN,
        -0.0,
        65520.0,
    ];
    let b: Vec<bf16> = r::cast(&v);
    assert_eq!(b[0].to_bits(), 0x3f80);
    assert!(b[1].is_nan());
    assert_eq!(b[2].to_bits(), 0x8000);
    let h: Vec<half::f16> = r::cast(&v);
    assert!(h[3].is_infinite(), "65520 rounds to +inf in fp16");
}

#[test]
fn a_gemm_with_beta_0_never_reads_its_output_and_the_hosts_outputs_are_poisoned() {
    use tierzero_gpu::ops::MatmulShape;
    use tierzero_gpu::unit::{Exec, HostExec};
    let (m, n, k) = (3, 5, 7);
    let (a, b) = (data(m * k, 1), data(k * n, 2));
    let mut want = vec![0f32; m * n];
    r::matmul(&mut want, &a, &b, 1, (m, n, k), (false, false), 1.0, 0.0);
    assert!(want.iter().all(|x| x.is_finite()));
    // An output's first values are NaN on the host executor ...
    let e = HostExec::F32;
    let mut c = e.output("c", m * n).unwrap();
    assert!(c.iter().all(|x| x.is_nan()));
    let s = MatmulShape {
        batch: 1,
        m,
        n,
        k,
        trans_a: false,
        trans_b: false,
    };
    // ... which β = 1 would add in, and β = 0 never reads (BLAS's rule).
    let mut c1 = c.clone();
    e.matmul(&mut c1, &a, &b, s, 1.0).unwrap();
    assert!(c1.iter().all(|x| x.is_nan()));
    e.matmul(&mut c, &a, &b, s, 0.0).unwrap();
    assert_eq!(c, want);
}

#[test]
fn bf16_attention_keeps_bf16_probabilities_and_follows_the_fp32_one() {
    use tierzero_gpu::unit::{AttnShape, Exec, HostExec};
    let a = AttnShape {
        bh: 3,
        seq: 17,
        head_dim: 8,
    };
    let (q, k, v, dout) = (
        data(a.heads_numel(), 40),
        data(a.heads_numel(), 41),
        data(a.heads_numel(), 42),
        data(a.heads_numel(), 43),
    );
    let rel32 = |got: &[f32], want: &[f32]| {
        let want: Vec<f64> = want.iter().map(|&x| x as f64).collect();
        rel(got, &want)
    };
    let [o32, p32] = HostExec::F32.attention_fwd(&q, &k, &v, a).unwrap();
    let [o16, p16] = HostExec::BF16.attention_fwd(&q, &k, &v, a).unwrap();
    // The probabilities are bf16 values, 0 past each row's own column.
    for (i, &x) in p16.iter().enumerate() {
        assert_eq!(bf16::from_f32(x).to_f32(), x, "p[{i}] = {x} is not a bf16");
        let (t, j) = ((i / a.seq) % a.seq, i % a.seq);
        if j > t {
            assert_eq!(x, 0.0, "p[{i}] past the diagonal");
        }
    }
    assert!(rel32(&p16, &p32) < 1e-2, "{}", rel32(&p16, &p32));
    assert!(rel32(&o16, &o32) < 2e-2, "{}", rel32(&o16, &o32));
    let g32 = HostExec::F32
        .attention_bwd(&p32, [&q, &k, &v], &dout, a)
        .unwrap();
    let g16 = HostExec::BF16
        .attention_bwd(&p16, [&q, &k, &v], &dout, a)
        .unwrap();
    for (name, (x16, x32)) in ["dq", "dk", "dv"].iter().zip(g16.iter().zip(&g32)) {
        let e = rel32(x16, x32);
        // Within bf16's rounding, and not fp32's bits.
        assert!(e < 3e-2 && e > 1e-5, "{name}: {e:e}");
    }
}

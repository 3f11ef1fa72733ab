//! Criterion benchmark of a unit's gradient into the optimizer's fp32
//! accumulator (`cargo bench --bench grad_accumulate`): one block of
//! `scripts/gpu_check.sh`'s step 6h Llama (hidden 2048, 16 heads over 4
//! KV heads, intermediate 5632: 45.1M elements), its gradient in bf16 as a bf16
//! run's device brings it down, into a new zeroed sub-group sum, as the
//! first micro-batch of a step does.
//!
//! * `widen_copy_add`: the path before session 49, on the caller's
//!   thread: `vec![0.0; n]`, `to_dtype(F32)`, `to_vec1`, then `+=`.
//! * `in_place`: `tierzero::model::fused::zeros_f32` and `add_grad_into`
//!   on rayon's pool (here the global one; the trainer's host pool in
//!   training), reading the bf16 elements where they are.
//!
//! * `add_into_reused`: `add_grad_into` into a sum whose pages are in
//!   place (the trainer's spare sums, `SpareSums`; zeroing it is one more
//!   parallel write). A new sum's pages fault in as it is zeroed, which
//!   is most of `in_place`'s time here: 65 ms against 14 ms. In training
//!   the heap keeps blocks under 256 MB mapped
//!   (`tierzero::engine::host::heap`), so that cost is a sum of a
//!   sub-group larger than that (DeepSpeed's default `sub_group_size` of
//!   1e9 makes one of the whole model), every step, without spares.
//! * `zero_add_reused` and `set_into_reused`: a step's first gradient
//!   into a spare, zeroed then added (before) or set into its stale
//!   values (`set_grad_into`, the trainer's `GradSum`): a write where
//!   there were a write, a read and a write.
//! * `copy_bf16_reused`: the bf16 gradient copied as it is into a
//!   reused bf16 buffer (`copy_bf16_grad_into`), where each element gets
//!   one gradient a step and the trainer holds them as they came
//!   (`tierzero::engine::sizing::grad_sum_dtype`).
//! * `chain_f32_sums` and `chain_bf16_held`: a sub-group's host work from
//!   its gradient to its new bf16 params, as a step with clipping does
//!   it: into the (reused) sum, its Σg², then AdamW with the fused bf16
//!   copy on all threads; from fp32 sums, or from the bf16 gradients
//!   held as they came. Both give the same bits (`optim`'s and
//!   `engine_equivalence`'s tests).
//! * `copy_to_dtype_to_vec1` and `copy_grad_to_f32`: the widened fp32
//!   copy alone (several ranks' path, a tied param's first unit), before
//!   and after.
//! * `rank_chunks_widen_then_lay_out` and `rank_chunks_widened_in_place`:
//!   two ranks' host collective input (`full`) of the block's params,
//!   each widened to fp32 then laid out in rank chunks (before), or
//!   widened straight into its chunks (after).
//!
//! Each pair gives the same bits: the adds and the set against the scalar
//! loop, the copies against candle's widening
//! (`tierzero::model::fused::accumulate`'s unit tests). Throughput in
//! gradient elements per second.
#![allow(clippy::unwrap_used, clippy::expect_used)] // reason: benchmark harness

use candle_core::{DType, Device, Tensor};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::hint::black_box;
use std::time::Duration;
use tierzero::engine::comm::RankChunks;
use tierzero::model::exec_units::HostElems;
use tierzero::model::fused::{
    add_grad_into, copy_bf16_grad_into, elems_to_f32, fill_zeros, grad_to_f32, set_grad_into,
    widen_elems_into, zeros_bf16, zeros_f32,
};
use tierzero::optim::{AdamHyper, CpuAdam, GradIn, GradScale, LowPrecisionOut, Moments};

/// q and o 2048², k and v 2048 × 512, the MLP's three 2048 × 5632, two norms.
const NUMEL: usize = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 5632 + 2 * 2048;

/// [`NUMEL`]'s params, one by one.
const PARAM_NUMELS: [usize; 9] = [
    2048 * 2048,
    2048 * 512,
    2048 * 512,
    2048 * 2048,
    2048 * 5632,
    2048 * 5632,
    2048 * 5632,
    2048,
    2048,
];

/// The fp32 copy as it was made before: candle's `to_dtype`, then `to_vec1`.
fn widened_by_candle(grad: &Tensor) -> Vec<f32> {
    grad.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn bench_grad_accumulate(c: &mut Criterion) {
    let g: Vec<half::bf16> = (0..NUMEL)
        .map(|i| half::bf16::from_f32(((i % 1009) as f32 - 504.0) * 1e-3))
        .collect();
    let grad = Tensor::from_vec(g, NUMEL, &Device::Cpu).unwrap();
    let mut group = c.benchmark_group("grad_accumulate_45M_bf16");
    group.throughput(Throughput::Elements(NUMEL as u64));
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(5));
    group.warm_up_time(Duration::from_millis(500));
    group.bench_function("widen_copy_add", |b| {
        b.iter(|| {
            let mut acc = vec![0f32; NUMEL];
            let full = widened_by_candle(&grad);
            for (a, x) in acc.iter_mut().zip(&full) {
                *a += *x;
            }
            black_box(acc)
        })
    });
    group.bench_function("in_place", |b| {
        b.iter(|| {
            let mut acc = zeros_f32(NUMEL);
            add_grad_into(&mut acc, black_box(&grad), 0).unwrap();
            black_box(acc)
        })
    });
    let mut reused = zeros_f32(NUMEL);
    // The sum keeps growing: the adds are the same work whatever it holds.
    group.bench_function("add_into_reused", |b| {
        b.iter(|| {
            add_grad_into(&mut reused, black_box(&grad), 0).unwrap();
        })
    });
    // A spare as the first gradient of a step found it: zeroed, then
    // added (before), or the gradient set into its stale values (after).
    group.bench_function("zero_add_reused", |b| {
        b.iter(|| {
            fill_zeros(&mut reused);
            add_grad_into(&mut reused, black_box(&grad), 0).unwrap();
        })
    });
    group.bench_function("set_into_reused", |b| {
        b.iter(|| {
            set_grad_into(&mut reused, black_box(&grad), 0).unwrap();
        })
    });
    let mut held = zeros_bf16(NUMEL);
    group.bench_function("copy_bf16_reused", |b| {
        b.iter(|| {
            copy_bf16_grad_into(&mut held, black_box(&grad), 0).unwrap();
        })
    });
    let threads = std::thread::available_parallelism().unwrap_or(std::num::NonZeroUsize::MIN);
    let adam = CpuAdam::new(AdamHyper::default(), threads).unwrap();
    let mut master = vec![0.5f32; NUMEL];
    let (mut m, mut v) = (vec![0f32; NUMEL], vec![0f32; NUMEL]);
    let mut out = vec![half::bf16::ZERO; NUMEL];
    let mut t = 0u64;
    // Σg², then the clipped step from `sum`, the sub-group's gradient.
    let mut norm_and_step = |sum: GradIn<'_>| {
        let sq = adam.grad_sq_norm(sum);
        t += 1;
        let mo = Moments::F32 {
            m: &mut m,
            v: &mut v,
        };
        let o = Some(LowPrecisionOut::Bf16(&mut out));
        let scale = GradScale((1.0 / (sq.sqrt() + 1.0)) as f32);
        adam.step(t, &mut master, sum, mo, o, scale).unwrap();
    };
    group.bench_function("chain_f32_sums", |b| {
        b.iter(|| {
            set_grad_into(&mut reused, black_box(&grad), 0).unwrap();
            norm_and_step(GradIn::F32(&reused));
        })
    });
    group.bench_function("chain_bf16_held", |b| {
        b.iter(|| {
            copy_bf16_grad_into(&mut held, black_box(&grad), 0).unwrap();
            norm_and_step(GradIn::Bf16(&held));
        })
    });
    // The fp32 copy several ranks' host collective (or a tied param's sum)
    // starts from: before, `to_dtype` then `to_vec1`; after, one parallel
    // pass.
    group.bench_function("copy_to_dtype_to_vec1", |b| {
        b.iter(|| black_box(widened_by_candle(&grad)))
    });
    group.bench_function("copy_grad_to_f32", |b| {
        b.iter(|| black_box(grad_to_f32(black_box(&grad)).unwrap()))
    });
    // Two ranks' host collective of the block's nine params (each cut in
    // halves): its `full`, every rank's chunk of every param in rank
    // order. Before: each param widened into a new fp32 vector, then laid
    // out (`rank_chunks`); after: widened straight into its chunks
    // (`RankChunks`, `widen_elems_into`). The same values.
    let g16 = grad.flatten_all().unwrap().to_vec1::<half::bf16>().unwrap();
    let mut parts: Vec<&[half::bf16]> = Vec::new();
    let mut rest = &g16[..];
    for n in PARAM_NUMELS {
        let (part, tail) = rest.split_at(n);
        parts.push(part);
        rest = tail;
    }
    let counts: Vec<Vec<usize>> = PARAM_NUMELS
        .iter()
        .map(|&n| vec![n - n / 2, n / 2])
        .collect();
    group.bench_function("rank_chunks_widen_then_lay_out", |b| {
        b.iter(|| {
            let wide: Vec<Vec<f32>> = parts
                .iter()
                .map(|p| elems_to_f32(HostElems::Bf16(p)))
                .collect();
            let wide: Vec<&[f32]> = wide.iter().map(Vec::as_slice).collect();
            black_box(tierzero::engine::comm::rank_chunks(&wide, &counts).unwrap())
        })
    });
    group.bench_function("rank_chunks_widened_in_place", |b| {
        b.iter(|| {
            let chunks = RankChunks::new(&PARAM_NUMELS, &counts).unwrap();
            let mut full = vec![0f32; chunks.total_numel()];
            for (p, part) in parts.iter().enumerate() {
                for (to, from) in chunks.chunks(p) {
                    widen_elems_into(&mut full[to], HostElems::Bf16(part), from).unwrap();
                }
            }
            black_box(full)
        })
    });
    group.finish();
}

criterion_group!(benches, bench_grad_accumulate);
criterion_main!(benches);

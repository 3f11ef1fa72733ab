//! Criterion benchmarks of the CPU Adam kernels (`cargo bench --bench adam`).
//!
//! 16M parameters (448 MB of fp32 state, far beyond the caches) on all
//! threads: the rmw probe, fp32 AdamW, AdamW with the fused bf16 copy (from
//! fp32 gradients and from bf16 ones), the
//! two-pass baseline (AdamW then a conversion pass), bf16 moments, the fp32
//! kernel on every available ISA, and the f64 gradient-norm pass (over fp32
//! and bf16 gradients). Throughput
//! is reported in parameters (elements) per second. For the headline numbers
//! with GB/s and ratios use `tierzero bench-adam`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // reason: benchmark harness

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use half::bf16;
use std::hint::black_box;
use std::num::NonZeroUsize;
use std::time::Duration;
use tierzero::optim::{
    convert_f32_to_bf16, rmw_probe, AdamHyper, CpuAdam, GradScale, Isa, LowPrecisionOut, Moments,
    ProbeOrder,
};

const N: usize = 16 << 20;

fn bench_adam(c: &mut Criterion) {
    let threads = std::thread::available_parallelism().unwrap_or(NonZeroUsize::MIN);
    let isa = Isa::detect();
    let grad: Vec<f32> = (0..N).map(|i| ((i % 1031) as f32 - 515.0) * 1e-5).collect();
    let mut p: Vec<f32> = (0..N).map(|i| 0.5 + (i % 97) as f32 * 1e-3).collect();
    let mut m = vec![0.0f32; N];
    let mut v = vec![0.0f32; N];
    let mut m16 = vec![bf16::ZERO; N];
    let mut v16 = vec![bf16::ZERO; N];
    let mut out = vec![bf16::ZERO; N];

    let mut g = c.benchmark_group("adam_16M");
    g.throughput(Throughput::Elements(N as u64));
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(3));
    g.warm_up_time(Duration::from_millis(500));

    for (name, order) in [
        ("rmw_probe_grouped", ProbeOrder::Grouped),
        ("rmw_probe_interleaved", ProbeOrder::Interleaved),
    ] {
        g.bench_function(name, |b| {
            b.iter(|| rmw_probe(isa, order, threads, &mut p, &grad, &mut m, &mut v).unwrap())
        });
    }
    for each in Isa::available() {
        let opt = CpuAdam::with_isa(AdamHyper::default(), threads, each).unwrap();
        let mut t = 0u64;
        g.bench_function(format!("fp32_{}", each.name()), |b| {
            b.iter(|| {
                t += 1;
                let mo = Moments::F32 {
                    m: &mut m,
                    v: &mut v,
                };
                opt.step(t, &mut p, &grad, mo, None, GradScale::ONE)
                    .unwrap()
            })
        });
    }
    let opt = CpuAdam::with_isa(AdamHyper::default(), threads, isa).unwrap();
    let mut t = 0u64;
    g.bench_function("fused_bf16_out", |b| {
        b.iter(|| {
            t += 1;
            let mo = Moments::F32 {
                m: &mut m,
                v: &mut v,
            };
            let o = Some(LowPrecisionOut::Bf16(&mut out));
            opt.step(t, &mut p, &grad, mo, o, GradScale::ONE).unwrap()
        })
    });
    // The same step from bf16 gradients (`GradIn::Bf16`): 2 B/param read
    // instead of 4, what the engine steps a one-gradient sub-group with.
    let grad16: Vec<bf16> = grad.iter().map(|&x| bf16::from_f32(x)).collect();
    g.bench_function("fused_bf16_out_bf16_grads", |b| {
        b.iter(|| {
            t += 1;
            let mo = Moments::F32 {
                m: &mut m,
                v: &mut v,
            };
            let o = Some(LowPrecisionOut::Bf16(&mut out));
            opt.step(t, &mut p, &grad16, mo, o, GradScale::ONE).unwrap()
        })
    });
    g.bench_function("two_pass_baseline", |b| {
        b.iter(|| {
            t += 1;
            let mo = Moments::F32 {
                m: &mut m,
                v: &mut v,
            };
            opt.step(t, &mut p, &grad, mo, None, GradScale::ONE)
                .unwrap();
            convert_f32_to_bf16(isa, threads, &p, &mut out).unwrap()
        })
    });
    let mut t = 0u64;
    g.bench_function("bf16_moments", |b| {
        b.iter(|| {
            t += 1;
            let mo = Moments::Bf16 {
                m: &mut m16,
                v: &mut v16,
            };
            opt.step(t, &mut p, &grad, mo, None, GradScale::ONE)
                .unwrap()
        })
    });
    g.bench_function("grad_sq_norm_f64", |b| {
        b.iter(|| black_box(opt.grad_sq_norm(&grad)))
    });
    g.bench_function("grad_sq_norm_f64_bf16_grads", |b| {
        b.iter(|| black_box(opt.grad_sq_norm(&grad16)))
    });
    g.finish();
}

criterion_group!(benches, bench_adam);
criterion_main!(benches);

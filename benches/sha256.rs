//! Criterion benchmark of the weight hash (`cargo bench --bench sha256`):
//! `tierzero::sha256::Sha256` over 64 MiB, far beyond the caches, as the
//! end-of-run `weight_sha256` streams the fp32 masters (8 GB at 2B
//! params). Throughput in bytes per second.
#![allow(clippy::unwrap_used, clippy::expect_used)] // reason: benchmark harness

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::hint::black_box;
use std::time::Duration;
use tierzero::sha256::Sha256;

const BYTES: usize = 64 << 20;

fn bench_sha256(c: &mut Criterion) {
    let data: Vec<u8> = (0..BYTES).map(|i| (i * 7 % 251) as u8).collect();
    let mut g = c.benchmark_group("sha256_64MiB");
    g.throughput(Throughput::Bytes(BYTES as u64));
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(3));
    g.warm_up_time(Duration::from_millis(500));
    g.bench_function("weight_hash", |b| {
        b.iter(|| {
            let mut h = Sha256::new();
            // In 4 MiB slices, as the masters arrive sub-group by sub-group.
            for chunk in data.chunks(4 << 20) {
                h.update(black_box(chunk));
            }
            black_box(h.finish_hex())
        })
    });
    g.finish();
}

criterion_group!(benches, bench_sha256);
criterion_main!(benches);

//! Swap bandwidth: read and write throughput of `tierzero-swap` for block
//! sizes {128 KiB, 1 MiB, 8 MiB} x queue depths {1, 8, 32, 128}.
//!
//! The 2 GiB file lives under `TIERZERO_BENCH_DIR` (point it at the NVMe you
//! care about), or under `target/` when that is unset. It is written in full
//! once before any read, so reads touch the device. Each sample moves at
//! least 64 MiB (and at least 4 x block x queue depth) sequentially through
//! the file, wrapping around.
//!
//!     TIERZERO_BENCH_DIR=/mnt/nvme cargo bench --bench swap_bandwidth
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tierzero_swap::bench::BenchTarget;
use tierzero_swap::{BackendKind, DirectIo, IoOp};

const FILE_BYTES: u64 = 2 << 30;
const BLOCKS: [u64; 3] = [128 << 10, 1 << 20, 8 << 20];
const QDS: [usize; 4] = [1, 8, 32, 128];

fn bench_dir() -> PathBuf {
    match std::env::var_os("TIERZERO_BENCH_DIR") {
        Some(d) => PathBuf::from(d),
        None => {
            let d = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("target")
                .join("bench-swap");
            std::fs::create_dir_all(&d).unwrap();
            d
        }
    }
}

fn swap_bandwidth(c: &mut Criterion) {
    let dir = bench_dir();
    let target = BenchTarget::create(&dir, FILE_BYTES, DirectIo::Auto).unwrap();
    eprintln!(
        "swap_bandwidth: {} GiB file under {} (O_DIRECT {})",
        FILE_BYTES >> 30,
        dir.display(),
        target.is_direct()
    );
    target.fill(BackendKind::Auto).unwrap();
    for op in [IoOp::Write, IoOp::Read] {
        let mut group = c.benchmark_group(format!("swap_{op}"));
        group.sample_size(10);
        group.warm_up_time(Duration::from_millis(500));
        group.measurement_time(Duration::from_secs(3));
        for block in BLOCKS {
            for qd in QDS {
                let per_sample = (64u64 << 20).max(4 * block * qd as u64);
                group.throughput(Throughput::Bytes(per_sample));
                let id = BenchmarkId::new(format!("block_{}KiB", block >> 10), format!("qd_{qd}"));
                group.bench_function(id, |b| {
                    b.iter_custom(|iters| {
                        let mut total = Duration::ZERO;
                        for _ in 0..iters {
                            let r = target
                                .run(op, block, qd, per_sample, None, BackendKind::Auto)
                                .unwrap();
                            total += Duration::from_secs_f64(r.seconds);
                        }
                        total
                    })
                });
            }
        }
        group.finish();
    }
}

criterion_group!(benches, swap_bandwidth);
criterion_main!(benches);

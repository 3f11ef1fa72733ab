//! How fast a staging fill runs on this machine's cores: one thread's
//! `copy_from_slice` against `tierzero_gpu::host_copy::copy` (split over
//! threads), and a read-back's `to_vec` against `host_copy::to_vec`,
//! alternating, on one buffer of `MIB` MiB (default 256).
//!
//! ```text
//! cargo run --release -p tierzero-gpu --example host_copy -- [MIB] [ROUNDS]
//! ```
//!
//! It copies between ordinary pages; pinned staging memory is
//! write-combined for uploads, so on a GPU machine the fill's rate may
//! differ, but one core bounds it the same way.

fn main() {
    let arg = |i: usize, default: usize| {
        std::env::args()
            .nth(i)
            .and_then(|a| a.parse().ok())
            .unwrap_or(default)
    };
    let (mib, rounds) = (arg(1, 256), arg(2, 4));
    let n = mib << 18; // f32 elements
    let src: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let mut dst = vec![0f32; n];
    // Fault the destination's pages in before timing.
    dst.copy_from_slice(&src);
    let gb = (n * 4) as f64 / 1e9;
    let threads = tierzero_gpu::host_copy::threads_for(
        n * 4,
        std::thread::available_parallelism().map_or(1, |c| c.get()),
    );
    for round in 0..rounds {
        let t = std::time::Instant::now();
        dst.copy_from_slice(&src);
        let one = t.elapsed().as_secs_f64();
        let t = std::time::Instant::now();
        tierzero_gpu::host_copy::copy(&mut dst, &src);
        let split = t.elapsed().as_secs_f64();
        let t = std::time::Instant::now();
        let v = src.to_vec();
        let one_vec = t.elapsed().as_secs_f64();
        drop(v);
        let t = std::time::Instant::now();
        let v = tierzero_gpu::host_copy::to_vec(&src);
        let split_vec = t.elapsed().as_secs_f64();
        drop(v);
        println!(
            "round {round}: {mib} MiB, copy: one thread {:.1} GB/s, {threads} threads {:.1} GB/s; \
             to_vec: one thread {:.1} GB/s, {threads} threads {:.1} GB/s",
            gb / one,
            gb / split,
            gb / one_vec,
            gb / split_vec
        );
    }
}

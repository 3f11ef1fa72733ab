//! GFLOP/s of candle's CPU matmul (gemm) on one and on two threads, for
//! the shape of the embedded GPT-2's MLP (`[1024, 192] x [192, 768]`, and
//! the same with the weight transposed, as `nn.Linear` stores it). The
//! torch side: `scripts/compare_matmul.py`, which runs this too.
//!
//!     cargo run --release --example matmul_threads [THREADS...]
use candle_core::{Device, Tensor};
use std::time::Instant;

fn main() -> candle_core::Result<()> {
    let threads: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let threads = if threads.is_empty() {
        vec![1, 2, 1, 2]
    } else {
        threads
    };
    let (m, k, n) = (1024usize, 192usize, 768usize);
    let a = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu)?;
    let b = Tensor::randn(0f32, 1.0, (k, n), &Device::Cpu)?;
    let bt = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu)?.t()?;
    for th in threads {
        // candle reads the thread count of its matmuls from this variable.
        std::env::set_var("RAYON_NUM_THREADS", th.to_string());
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(th)
            .build()
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        pool.install(|| -> candle_core::Result<()> {
            for (name, rhs) in [("x @ w", &b), ("x @ w^T", &bt)] {
                for _ in 0..20 {
                    a.matmul(rhs)?;
                }
                let reps = 300;
                let t = Instant::now();
                for _ in 0..reps {
                    a.matmul(rhs)?;
                }
                let flops = 2.0 * (m * k * n) as f64 * f64::from(reps);
                println!(
                    "tierzero (candle gemm) threads {th} {name}: {:.1} GFLOP/s",
                    flops / t.elapsed().as_secs_f64() / 1e9
                );
            }
            Ok(())
        })?;
    }
    Ok(())
}

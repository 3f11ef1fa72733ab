//! Training throughput in GPU memory: a GPT-2 of about 350M params (GPT-2
//! medium's shape: 24 layers, hidden 1024, 16 heads, vocabulary 50257),
//! sequences of 1024, tied embeddings, on `Gpt2Trainer` over a `CudaExec`
//! with bf16 GEMM operands (autocast's matmuls; fp32 everything else),
//! AdamW on the GPU. Prints one JSON object: tokens/s and model TFLOPS
//! (6 · params + 12 · layers · hidden · seq FLOPs per token, the usual
//! count, without backward's recompute). Each block's forward is kept for
//! its backward, as PyTorch eager keeps its autograd graph (`RECOMPUTE=1`
//! recomputes it in backward instead, one more forward per step). `scripts/torch_gpt2_throughput.py`
//! measures PyTorch eager on the same shape; `scripts/gpu_check.sh` runs
//! both side by side.
//!
//! `cargo run --release -p tierzero-gpu --example throughput [OUT.json]`
//! (env: BATCH, default 4; STEPS, default 6; LAYERS, default 24;
//! GEMM=f32 for fp32 GEMMs; RECOMPUTE=1).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Instant;

use tierzero_gpu::device::{Device, DeviceOptions};
use tierzero_gpu::unit::{gpt2_init, AdamHyper, CudaExec, GemmDtype, Gpt2Dims, Gpt2Trainer};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let out_path = std::env::args().nth(1);
    let emit = |json: String| {
        println!("{json}");
        if let Some(p) = &out_path {
            std::fs::write(p, format!("{json}\n")).expect("writing the JSON");
        }
    };
    let (batch, steps, layers) = (env("BATCH", 4), env("STEPS", 6).max(2), env("LAYERS", 24));
    let gemm = match std::env::var("GEMM").as_deref() {
        Ok("f32") => GemmDtype::F32,
        _ => GemmDtype::Bf16,
    };
    let recompute = std::env::var("RECOMPUTE").is_ok_and(|v| v == "1");
    let d = Gpt2Dims {
        batch,
        seq: 1024,
        hidden: 1024,
        heads: 16,
        inner: 4096,
        vocab: 50257,
        eps: 1e-5,
    };
    let dev = match Device::open(0, &DeviceOptions::default()) {
        Ok(dv) => dv,
        Err(e) => {
            emit(
                serde_json::json!({"ok": false, "step": "open", "error": e.to_string()})
                    .to_string(),
            );
            eprintln!("throughput: {e}");
            std::process::exit(2);
        }
    };
    let t0 = Instant::now();
    let init = gpt2_init(&d, layers, d.seq, 1);
    let params: usize = init.iter().map(Vec::len).sum();
    let hyper = AdamHyper {
        lr: 1e-4,
        betas: (0.9, 0.999),
        eps: 1e-8,
        weight_decay: 0.01,
    };
    let cuda = CudaExec { dev: &dev, gemm };
    let result = (|| -> tierzero_gpu::Result<(bool, String)> {
        let mut t = Gpt2Trainer::new(&cuda, d, layers, &init, hyper)?;
        t.keep_activations(!recompute);
        drop(init);
        let setup_s = t0.elapsed().as_secs_f64();
        let mut x = 12345u64;
        let mut tokens = || {
            (0..d.batch * d.seq)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((x >> 33) % d.vocab as u64) as i32
                })
                .collect::<Vec<i32>>()
        };
        // The first step compiles nothing (kernels load at open) but
        // grows the allocator's pool: not timed.
        let (ids, targets) = (tokens(), tokens());
        let first = t.step(&ids, &targets)?;
        dev.synchronize()?;
        let t1 = Instant::now();
        let mut last = first;
        for _ in 1..steps {
            let (ids, targets) = (tokens(), tokens());
            last = t.step(&ids, &targets)?;
        }
        dev.synchronize()?;
        let secs = t1.elapsed().as_secs_f64();
        let timed = (steps - 1) as f64;
        let tok_s = timed * (d.batch * d.seq) as f64 / secs;
        let flops_per_token = 6.0 * params as f64 + 12.0 * (layers * d.hidden * d.seq) as f64;
        // serde_json writes a non-finite loss as null; a diverged run is
        // not a measurement.
        let ok = first.is_finite() && last.is_finite();
        let json = serde_json::json!({
            "ok": ok,
            "device": dev.name(),
            "gemm": format!("{gemm:?}"),
            "params": params,
            "layers": layers,
            "batch": d.batch,
            "seq": d.seq,
            "steps_timed": steps - 1,
            "recompute": recompute,
            "step_s": secs / timed,
            "tokens_per_s": tok_s,
            "model_tflops": tok_s * flops_per_token / 1e12,
            "setup_s": setup_s,
            "first_loss": first,
            "last_loss": last,
            "device_bytes_used": dev.budget().used_bytes(),
        });
        Ok((ok, json.to_string()))
    })();
    match result {
        Ok((ok, json)) => {
            emit(json);
            if !ok {
                std::process::exit(1);
            }
        }
        Err(e) => {
            emit(
                serde_json::json!({"ok": false, "step": "train", "error": e.to_string()})
                    .to_string(),
            );
            std::process::exit(1);
        }
    }
}

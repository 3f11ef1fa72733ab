//! The device check of training: a small GPT-2 (tied embeddings, fp32)
//! trained 20 steps on the GPU (`tierzero_gpu::unit::Gpt2Trainer` on a
//! `CudaExec`: the CUDA kernels, cuBLAS and the GPU AdamW) and on the host
//! executor (every kernel's CPU reference, which `tests/gpu_units.rs`
//! checks against the candle units), with fp32 GEMMs and again with bf16
//! and with fp16 GEMM operands. Passes when every step's loss agrees
//! within 1e-3 relative (1e-2 with 16-bit GEMMs) and a second GPU run gives the same
//! bits (losses and final params). Prints one JSON object; exit 0 pass, 1 fail, 2 when
//! the device cannot be opened.
//!
//! `cargo run --release -p tierzero-gpu --example train_check [OUT.json]`
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Instant;

use tierzero_gpu::device::{Device, DeviceOptions};
use tierzero_gpu::unit::{
    gpt2_init, AdamHyper, CudaExec, Exec, GemmDtype, Gpt2Dims, Gpt2Trainer, HostExec,
};
use tierzero_gpu::Result;

const STEPS: usize = 20;
const LAYERS: usize = 2;

fn dims() -> Gpt2Dims {
    Gpt2Dims {
        batch: 4,
        seq: 64,
        hidden: 128,
        heads: 4,
        inner: 512,
        vocab: 256,
        eps: 1e-5,
    }
}

/// Byte-level windows of a fixed text, step `s`.
fn batch(d: &Gpt2Dims, s: usize) -> (Vec<i32>, Vec<i32>) {
    let text = b"tierzero trains models that do not fit in device memory: it streams \
parameters, gradients and optimizer state between device memory, pinned host memory and NVMe, \
and overlaps that traffic with compute. ";
    let (mut ids, mut targets) = (Vec::new(), Vec::new());
    for b in 0..d.batch {
        let start = (s * 37 + b * 101) % text.len();
        for t in 0..d.seq {
            ids.push(text[(start + t) % text.len()] as i32);
            targets.push(text[(start + t + 1) % text.len()] as i32);
        }
    }
    (ids, targets)
}

fn train<E: Exec>(e: &E) -> Result<(Vec<f32>, Vec<Vec<f32>>, f64)> {
    let d = dims();
    let init = gpt2_init(&d, LAYERS, d.seq, 1);
    let hyper = AdamHyper {
        lr: 3e-3,
        betas: (0.9, 0.999),
        eps: 1e-8,
        weight_decay: 0.01,
    };
    let mut t = Gpt2Trainer::new(e, d, LAYERS, &init, hyper)?;
    let t0 = Instant::now();
    let mut losses = Vec::with_capacity(STEPS);
    for s in 0..STEPS {
        let (ids, targets) = batch(&d, s);
        losses.push(t.step(&ids, &targets)?);
    }
    let secs = t0.elapsed().as_secs_f64();
    Ok((losses, t.params()?, secs))
}

fn main() {
    let out_path = std::env::args().nth(1);
    let emit = |json: String| {
        println!("{json}");
        if let Some(p) = &out_path {
            std::fs::write(p, format!("{json}\n")).expect("writing the JSON");
        }
    };
    let dev = match Device::open(0, &DeviceOptions::default()) {
        Ok(d) => d,
        Err(e) => {
            emit(
                serde_json::json!({"ok": false, "step": "open", "error": e.to_string()})
                    .to_string(),
            );
            eprintln!("train_check: {e}");
            std::process::exit(2);
        }
    };
    let run = || -> Result<(bool, String)> {
        let mut parts = Vec::new();
        let mut all_ok = true;
        // fp32 GEMMs at the 1e-3; bf16 and fp16 GEMM operands
        // (autocast's rounding, on both sides) at 1e-2.
        for (gemm, tol) in [
            (GemmDtype::F32, 1e-3),
            (GemmDtype::Bf16, 1e-2),
            (GemmDtype::F16, 1e-2),
        ] {
            let cuda = CudaExec { dev: &dev, gemm };
            let (gpu, gpu_params, gpu_s) = train(&cuda)?;
            let (gpu2, gpu2_params, _) = train(&cuda)?;
            let (host, _, host_s) = train(&HostExec { gemm })?;
            // NaN anywhere makes `worst` NaN (f64::max would drop it), and
            // NaN fails the bound.
            let worst = gpu
                .iter()
                .zip(&host)
                .map(|(g, h)| ((g - h) / h).abs() as f64)
                .fold(0.0, |w: f64, x| {
                    if x.is_nan() || w.is_nan() {
                        f64::NAN
                    } else {
                        w.max(x)
                    }
                });
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let same = bits(&gpu) == bits(&gpu2)
                && gpu_params
                    .iter()
                    .zip(&gpu2_params)
                    .all(|(a, b)| bits(a) == bits(b));
            let finite = |v: &[f32]| v.len() == STEPS && v.iter().all(|l| l.is_finite());
            let ok = worst <= tol && same && finite(&gpu) && finite(&host);
            all_ok &= ok;
            // serde_json writes a non-finite loss as null.
            parts.push(serde_json::json!({
                "gemm": format!("{gemm:?}"), "ok": ok, "tol": tol,
                "max_rel_loss_diff": worst, "gpu_twice_same_bits": same,
                "gpu_s": gpu_s, "host_s": host_s,
                "gpu_losses": gpu, "host_losses": host,
            }));
        }
        let json = serde_json::json!({
            "ok": all_ok, "device": dev.name(), "steps": STEPS, "runs": parts,
        });
        Ok((all_ok, json.to_string()))
    };
    match run() {
        Ok((ok, json)) => {
            emit(json);
            std::process::exit(if ok { 0 } else { 1 });
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

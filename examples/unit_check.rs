//! The device check of the units (`scripts/gpu_check.sh`'s step 6u): the
//! GPT-2 and Llama-family units on the CUDA executor (the kernels, cuBLAS)
//! against the candle units the CPU trains with, one micro-batch's chain
//! (`tests/unit_chain`: forward unit by unit, backward by recompute, head
//! first). It compares the loss and every param's gradient, embedding to
//! head.
//!
//! The bounds are the issue's:
//! - fp32 GEMMs: 1e-4 relative for GPT-2 (tied and untied) and for the
//!   Llama family (Llama untied and tied, Qwen2, Qwen3).
//! - bf16 GEMM operands, against the candle units in bf16: at most 3e-2 for
//!   the mean over 4 seeds of the worst gradient, tied and untied, and
//!   none past 6e-2 (`tests/gpu_units.rs` says why it is a mean).
//! - fp16 GEMM operands: 3e-2.
//!
//! The same chains run on the host executor (every kernel's scalar
//! reference), whose errors the JSON reports beside the GPU's.
//!
//! It prints one JSON object (also written to the first argument's path).
//! Exit 0 when every chain passed, 1 when one failed, 2 when the device
//! cannot be opened.
//!
//! `cargo run --release --example unit_check [OUT.json]`; with
//! `UNIT_CHECK_HOST_ONLY=1` the host executor stands in for the GPU (a
//! dry run of the program where there is none).
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "a check binary")]

#[path = "../tests/model_support/mod.rs"]
mod model_support;
#[path = "../tests/unit_chain/mod.rs"]
mod unit_chain;

use candle_core::DType;
use serde_json::{json, Value};
use tierzero_gpu::device::{Device, DeviceOptions};
use tierzero_gpu::unit::{CudaExec, Exec, GemmDtype, HostExec};
use unit_chain::{gpt2_chain, llama_chain, llama_family, ChainReport};

/// One chain's JSON: the GPU's errors, the host executor's, and whether
/// the GPU's are within `tol`.
fn entry(
    model: &str,
    gemm: GemmDtype,
    tol: f64,
    gpu: Result<ChainReport, String>,
    host: Result<ChainReport, String>,
) -> (bool, Option<f64>, Value) {
    let summary = |r: &Result<ChainReport, String>| match r {
        Ok(r) => {
            let worst = r
                .grads
                .iter()
                .max_by(|a, b| a.1.total_cmp(&b.1))
                .map(|(n, _)| n.clone());
            json!({"loss": r.loss, "want_loss": r.want_loss, "loss_rel": r.loss_rel(),
                   "worst": r.worst(), "worst_param": worst, "grads": r.grads.len()})
        }
        Err(e) => json!({"error": e}),
    };
    let ok = gpu.as_ref().is_ok_and(|r| r.within(tol));
    let worst = gpu.as_ref().ok().map(ChainReport::worst);
    let v = json!({"model": model, "gemm": format!("{gemm:?}"), "tol": tol, "ok": ok,
                   "gpu": summary(&gpu), "host": summary(&host)});
    (ok, worst, v)
}

/// Every chain on the executor `gpu` makes (and on the host executor):
/// whether all passed, the bf16 mean of the worst and whether it passed,
/// and each chain's JSON.
fn run<G: Exec>(gpu: impl Fn(GemmDtype) -> G) -> (bool, f64, bool, Vec<Value>) {
    let mut runs = Vec::new();
    let mut all_ok = true;
    for (gemm, dtype, tol) in [
        (GemmDtype::F32, DType::F32, 1e-4),
        (GemmDtype::F16, DType::F16, 3e-2),
    ] {
        for tied in [true, false] {
            let cfg = || model_support::gpt2_config(tied);
            let label = format!("gpt2 {}", if tied { "tied" } else { "untied" });
            let (ok, _, v) = entry(
                &label,
                gemm,
                tol,
                gpt2_chain(&gpu(gemm), cfg(), dtype, (7, 2)),
                gpt2_chain(&HostExec { gemm }, cfg(), dtype, (7, 2)),
            );
            all_ok &= ok;
            runs.push(v);
        }
    }
    // bf16: each chain within 6e-2, the mean of the worst within 3e-2.
    let mut bf16_worst = Vec::new();
    for seed in 1..=4u64 {
        for tied in [true, false] {
            let cfg = || model_support::gpt2_config(tied);
            let seeds = (seed, seed as usize + 1);
            let label = format!("gpt2 {} seed {seed}", if tied { "tied" } else { "untied" });
            let gemm = GemmDtype::Bf16;
            let (ok, worst, v) = entry(
                &label,
                gemm,
                6e-2,
                gpt2_chain(&gpu(gemm), cfg(), DType::BF16, seeds),
                gpt2_chain(&HostExec { gemm }, cfg(), DType::BF16, seeds),
            );
            all_ok &= ok;
            bf16_worst.push(worst.unwrap_or(f64::NAN));
            runs.push(v);
        }
    }
    let bf16_mean = bf16_worst.iter().sum::<f64>() / bf16_worst.len() as f64;
    let bf16_ok = bf16_mean <= 3e-2;
    all_ok &= bf16_ok;
    match llama_family() {
        Ok(family) => {
            for (label, cfg) in family {
                let (ok, _, v) = entry(
                    label,
                    GemmDtype::F32,
                    1e-4,
                    llama_chain(&gpu(GemmDtype::F32), cfg.clone()),
                    llama_chain(&HostExec::F32, cfg),
                );
                all_ok &= ok;
                runs.push(v);
            }
        }
        Err(e) => {
            all_ok = false;
            runs.push(json!({"model": "llama family", "ok": false, "error": e}));
        }
    }
    (all_ok, bf16_mean, bf16_ok, runs)
}

fn main() {
    let out_path = std::env::args().nth(1);
    let emit = |v: Value| {
        let text = v.to_string();
        println!("{text}");
        if let Some(p) = &out_path {
            std::fs::write(p, format!("{text}\n")).expect("writing the JSON");
        }
    };
    if std::env::var("UNIT_CHECK_HOST_ONLY").as_deref() == Ok("1") {
        // A dry run of this program where there is no GPU: the host
        // executor on both sides (the errors are then the same).
        let (all_ok, bf16_mean, bf16_ok, runs) = run(|gemm| HostExec { gemm });
        emit(
            json!({"device": "host (UNIT_CHECK_HOST_ONLY=1)", "ok": all_ok,
                    "chains": runs.len(), "bf16_mean_worst": bf16_mean,
                    "bf16_mean_ok": bf16_ok, "runs": runs}),
        );
        std::process::exit(if all_ok { 0 } else { 1 });
    }
    let dev = match Device::open(0, &DeviceOptions::default()) {
        Ok(d) => d,
        Err(e) => {
            emit(json!({"ok": false, "step": "open", "error": e.to_string()}));
            eprintln!("unit_check: {e}");
            std::process::exit(2);
        }
    };
    let (all_ok, bf16_mean, bf16_ok, runs) = run(|gemm| CudaExec { dev: &dev, gemm });
    // serde_json writes a NaN mean as null, which is not a pass.
    emit(
        json!({"device": dev.name(), "ok": all_ok, "chains": runs.len(),
                "bf16_mean_worst": bf16_mean, "bf16_mean_ok": bf16_ok, "runs": runs}),
    );
    std::process::exit(if all_ok { 0 } else { 1 });
}

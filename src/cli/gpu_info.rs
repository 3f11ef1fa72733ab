//! `tierzero gpu-info`: what CUDA and NCCL this process can use, and with
//! `--nccl-test` a self-test of the NCCL collectives between the ranks.
//!
//! Design:
//! * **Probe.** [`tierzero::gpu::probe`]: devices (name, compute
//!   capability, total and free memory) and NCCL's version, or one line
//!   naming what is missing (exit 2): the binary built without `--features
//!   gpu`, no driver (`libcuda.so`), no GPU. NCCL missing is reported but is
//!   not an error for the probe (the GPUs are usable without it).
//! * **`--nccl-test`** builds this rank's NCCL communicator exactly as
//!   `train --device` does (`launch::rank_comm_on`: TCP rendezvous through
//!   `TIERZERO_NCCL_ADDR`, MPI under `mpirun`, or one rank) and runs
//!   [`tierzero::engine::comm::check::self_test`]: every collective the
//!   engine uses, checked bit for bit (reduce-scatter in rank order), then a
//!   timed all-gather. Every rank prints its own JSON line.
//! * **`--json`**: one JSON object on stdout, for scripts
//!   (`scripts/gpu_check.sh`).

use anyhow::anyhow;
use clap::Args;
use serde_json::json;
use tierzero::gpu::{self, GpuError};
use tierzero::units::format_bytes;

use super::train::number;
use super::{emit, Failure};

/// `tierzero gpu-info` options.
#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  tierzero gpu-info\n  tierzero gpu-info --json\n  tierzero gpu-info --nccl-test --json"
)]
pub struct GpuInfoArgs {
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Also run the NCCL self-test between the ranks (see `train --device`
    /// for how ranks meet: TIERZERO_NCCL_ADDR, TIERZERO_RANK,
    /// TIERZERO_WORLD_SIZE, or mpirun).
    #[arg(long)]
    nccl_test: bool,
    /// GPU for --nccl-test: cuda (one per local rank) or cuda:N.
    #[arg(long, value_name = "DEVICE", default_value = "cuda")]
    device: String,
    /// Bytes per rank of the timed all-gather of --nccl-test.
    #[arg(long, value_name = "BYTES", default_value = "64M")]
    test_bytes: String,
    /// Repetitions of the timed all-gather.
    #[arg(long, value_name = "N", default_value = "20")]
    test_iters: String,
}

fn probe_failure(e: GpuError) -> Failure {
    match e {
        GpuError::NotBuilt
        | GpuError::DriverMissing { .. }
        | GpuError::NoDevice
        | GpuError::DriverInit(_)
        | GpuError::LibraryTooOld { .. } => Failure::BadInput(anyhow!("{e}")),
        other => Failure::Internal(anyhow!("{other}")),
    }
}

/// Runs `tierzero gpu-info`.
pub fn run(args: GpuInfoArgs) -> Result<(), Failure> {
    // `--json` on a failure: the error object on stdout, as `train --json`
    // prints (the report is the only other thing it prints, at the end).
    super::json_object_on_failure(args.json && super::launch::env_rank_is_lead());
    let test = if args.nccl_test {
        let device = gpu::parse_device(&args.device)
            .map_err(|m| Failure::BadInput(anyhow!(m)))?
            .ok_or_else(|| {
                Failure::BadInput(anyhow!("--nccl-test needs --device cuda or cuda:N"))
            })?;
        let bytes = tierzero::units::parse_bytes(&args.test_bytes)
            .map_err(|e| Failure::BadInput(anyhow!("--test-bytes {}: {e}", args.test_bytes)))?;
        let bytes = usize::try_from(bytes)
            .ok()
            .filter(|&b| (1..=1 << 34).contains(&b))
            .ok_or_else(|| Failure::BadInput(anyhow!("--test-bytes: give 1 byte to 16G")))?;
        let iters = number("--test-iters", &args.test_iters, 1, 100_000)? as usize;
        Some((device, bytes, iters))
    } else {
        None
    };
    let info = gpu::probe().map_err(probe_failure)?;
    let nccl = match &info.nccl {
        Ok(v) => json!({"version": v.to_string()}),
        Err(e) => json!({"error": e.to_string()}),
    };
    let devices: Vec<_> = info
        .devices
        .iter()
        .map(|d| {
            json!({
                "ordinal": d.ordinal,
                "name": d.name,
                "compute_capability": format!("{}.{}", d.compute_capability.0, d.compute_capability.1),
                "total_bytes": d.total_bytes,
                "free_bytes": d.free_bytes,
            })
        })
        .collect();
    let report = match test {
        None => None,
        Some((device, bytes, iters)) => {
            let comm = super::launch::rank_comm_on(Some(device))?;
            let r = tierzero::engine::comm::check::self_test(comm.as_ref(), bytes, iters)
                .map_err(|e| Failure::Internal(anyhow!("NCCL self-test: {e}")))?;
            Some(r)
        }
    };
    let libs = gpu::compute_libraries();
    let libs_json: serde_json::Map<String, serde_json::Value> = libs
        .iter()
        .map(|(name, r)| {
            let v = match r {
                Ok(v) => json!({"version": v}),
                Err(e) => json!({"error": e}),
            };
            (name.to_string(), v)
        })
        .collect();
    if args.json {
        let obj = json!({
            "devices": devices,
            "nccl": nccl,
            "compute_libraries": libs_json,
            "compute": "the units on CUDA with --device cuda (tierzero-gpu: NVRTC kernels, cuBLAS), else candle on the CPU",
            "nccl_test": report,
        });
        return emit(&format!("{obj}\n"));
    }
    let mut text = String::new();
    for d in &info.devices {
        text.push_str(&format!(
            "cuda:{} {} (compute {}.{}): {} total, {} free\n",
            d.ordinal,
            d.name,
            d.compute_capability.0,
            d.compute_capability.1,
            format_bytes(d.total_bytes),
            format_bytes(d.free_bytes)
        ));
    }
    match &info.nccl {
        Ok(v) => text.push_str(&format!("NCCL {v}\n")),
        Err(e) => text.push_str(&format!("NCCL: {e}\n")),
    }
    for (name, r) in &libs {
        match r {
            Ok(v) => text.push_str(&format!("{name}: {v}\n")),
            Err(e) => text.push_str(&format!("{name}: {e}\n")),
        }
    }
    text.push_str("compute: --device cuda runs the units on the GPU (NVRTC kernels, cuBLAS) and the collectives over NCCL; otherwise candle on the CPU\n");
    if let Some(r) = report {
        text.push_str(&format!(
            "NCCL self-test, rank {} of {}: passed {}; all-gather of {} per rank: {:.3} ms, {:.2} GB/s\n",
            r.rank,
            r.world,
            r.passed.join("; "),
            format_bytes(r.gather_shard_bytes as u64),
            r.gather_mean_s * 1e3,
            r.gather_algbw_gb_s
        ));
    }
    emit(&text)
}

//! The device units `tierzero train` computes on: the CUDA units on a GPU
//! (`--device cuda[:N]`) or the simulated device (`--device sim`), each
//! through the device tier (`tierzero::engine::device`), after the checks
//! a user can act on.

use anyhow::anyhow;

use super::{bad, Failure};
use crate::cli::launch::comm_timeout;

/// The CUDA units on the GPU `--device` names (this rank's, for `cuda`),
/// after the checks a user can act on: the precision and the model
/// ([`unit_checks`]), then the device itself (driver, cuBLAS, NVRTC and
/// its architecture; see `tierzero_gpu::device::Device::open`).
pub(super) fn cuda_units(
    d: tierzero::gpu::DeviceChoice,
    cfg: &tierzero::config::Config,
    model: &tierzero::model::Model,
    seq_len: usize,
    comm: &dyn tierzero::engine::Comm,
) -> Result<std::sync::Arc<dyn tierzero::model::exec_units::UnitCompute>, Failure> {
    use tierzero_gpu::GpuError as G;
    let world = comm.world_size();
    let gemm = unit_checks(&format!("--device {d}"), cfg, model, seq_len)?;
    // Counted without a context on any device (another rank's GPU may be
    // in exclusive-process mode).
    let count = tierzero::gpu::device_count().map_err(|e| bad(format!("--device {d}: {e}")))?;
    let ordinal = d
        .resolve(count, tierzero::gpu::local_rank_from_env())
        .map_err(|e| bad(format!("--device {d}: {e}")))?;
    let opts = tierzero_gpu::device::DeviceOptions {
        budget_bytes: cfg.tierzero.device_budget_bytes.map(|b| b.0),
        ..Default::default()
    };
    let dev = tierzero_gpu::device::Device::open(ordinal, &opts).map_err(|e| {
        let user = matches!(
            e,
            G::LibraryMissing { .. }
                | G::BuiltinsMissing { .. }
                | G::DriverInit(_)
                | G::LibraryTooOld { .. }
                | G::DriverTooOld { .. }
                | G::UnsupportedArch { .. }
                | G::DeviceMemory { .. }
        );
        let err = anyhow!("--device {d}: {e}");
        if user {
            Failure::BadInput(err)
        } else {
            Failure::Internal(err)
        }
    })?;
    // The device tier: params staged a unit ahead on the copy stream,
    // kept between uses within `tierzero.device_cache_bytes` ("auto": as
    // many as the tier's share of the device budget holds).
    let dev = std::sync::Arc::new(dev);
    // With several ranks, the params are gathered and the gradients
    // reduce-scattered on the GPUs (NCCL on their buffers): each rank's
    // shards alone go up, its sums alone come down.
    let timeout = comm_timeout()?;
    let collectives = if world > 1 {
        tierzero::engine::device::cuda::device_collectives(&dev, comm, timeout)
            .map_err(|e| Failure::Internal(anyhow!("--device {d}: {e}")))?
    } else {
        None
    };
    let mut link = tierzero::engine::comm::agree(
        comm,
        "the GPU's device tier",
        tierzero::engine::device::cuda::CudaLink::new(dev, gemm).map_err(Into::into),
    )
    .map_err(|e| Failure::Internal(anyhow!("--device {d}: {e}")))?;
    if let Some(c) = collectives {
        // Every rank's tier takes the same decisions, so issues the same
        // gathers: one budget, the smallest GPU's.
        link = link
            .with_collectives(c, timeout)
            .with_budget_agreed(comm)
            .map_err(|e| Failure::Internal(anyhow!("--device {d}: {e}")))?;
    }
    on_link(&format!("--device {d}"), link, cfg, model, comm)
}

/// The units on `link` ([`tierzero::engine::device::units_on`]), its
/// refusals given as `flag`'s. Agreed among `comm`'s ranks: a rank whose
/// device refuses (the state does not fit what its GPU has left) fails
/// every rank at once, rather than leave them in the first collective.
fn on_link<L: tierzero::engine::device::DeviceLink + 'static>(
    flag: &str,
    link: L,
    cfg: &tierzero::config::Config,
    model: &tierzero::model::Model,
    comm: &dyn tierzero::engine::Comm,
) -> Result<std::sync::Arc<dyn tierzero::model::exec_units::UnitCompute>, Failure> {
    let local =
        tierzero::engine::device::units_on(link, cfg, model, comm.world_size()).map_err(Into::into);
    tierzero::engine::comm::agree(comm, "the device's units", local)
        .map_err(|e| bad(format!("{flag}: {e}")))
}

/// What the device units need of the run, as `flag` (`--device cuda:0`,
/// `--device sim`) names it: a precision they compute in (their GEMM
/// operands, [`tierzero::config::Precision::gemm_dtype`]) and a model they implement.
fn unit_checks(
    flag: &str,
    cfg: &tierzero::config::Config,
    model: &tierzero::model::Model,
    seq_len: usize,
) -> Result<tierzero_gpu::unit::GemmDtype, Failure> {
    let gemm = cfg.precision.gemm_dtype();
    if let Some(why) = tierzero::model::exec_units::supports(model.config(), seq_len) {
        return Err(bad(format!(
            "{flag}: the device units do not implement {why}; train on --device cpu"
        )));
    }
    Ok(gemm)
}

/// Device memory of `--device sim` when `tierzero.device_budget_bytes`
/// is not set.
const SIM_DEFAULT_BUDGET_BYTES: u64 = 1 << 30;

/// Staging buffers of `--device sim`.
const SIM_STAGING_SLOTS: usize = 4;

/// `--device sim`: the device tier on the simulated device, after the
/// checks `--device cuda` makes of the model and the precision.
pub(super) fn sim_units(
    sim_h2d_gbps: Option<&str>,
    sim_compute_ms: Option<&str>,
    cfg: &tierzero::config::Config,
    model: &tierzero::model::Model,
    seq_len: usize,
    comm: std::sync::Arc<dyn tierzero::engine::Comm>,
) -> Result<std::sync::Arc<dyn tierzero::model::exec_units::UnitCompute>, Failure> {
    use tierzero::engine::device::sim::{SimConfig, SimDevice};
    let gemm = unit_checks("--device sim", cfg, model, seq_len)?;
    let text = sim_h2d_gbps.unwrap_or("25");
    let gbps: f64 = text
        .trim()
        .parse()
        .ok()
        .filter(|g: &f64| (0.001..=10_000.0).contains(g))
        .ok_or_else(|| {
            bad(format!(
                "--sim-h2d-gbps {text}: give a bandwidth in GB/s from 0.001 to 10000 (25 is \
                 about PCIe 4.0 x16's)"
            ))
        })?;
    let text = sim_compute_ms.unwrap_or("0");
    let compute_ms: f64 = text
        .trim()
        .parse()
        .ok()
        .filter(|ms: &f64| ms.is_finite() && *ms >= 0.0 && *ms <= 60_000.0)
        .ok_or_else(|| {
            bad(format!(
                "--sim-compute-ms {text}: give the least milliseconds a unit computes, from 0 \
                 to 60000"
            ))
        })?;
    let dev = SimDevice::new(SimConfig {
        budget_bytes: cfg
            .tierzero
            .device_budget_bytes
            .map_or(SIM_DEFAULT_BUDGET_BYTES, |b| b.0),
        copy_delay: std::time::Duration::ZERO,
        h2d_bytes_per_s: Some(gbps * 1e9),
        staging_slots: SIM_STAGING_SLOTS,
        gemm,
        fail_upload: None,
        compute_delay: std::time::Duration::from_secs_f64(compute_ms / 1e3),
    })
    .map_err(|e| Failure::Internal(anyhow!("--device sim: {e}")))?
    // Collectives of its own over the ranks', as NCCL gives a GPU: with
    // several ranks the params are gathered and the gradients
    // reduce-scattered on the device.
    .with_collectives(comm.clone());
    on_link("--device sim", dev, cfg, model, &*comm)
}

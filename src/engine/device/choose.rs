//! Which units a run computes on a device link: everything resident with
//! Adam on the device when nothing is offloaded and one rank trains
//! ([`ResidentUnits`]), else the device tier with the optimizer on the
//! host ([`TieredUnits`]). `tierzero train --device` and the device
//! measurements (`examples/device_overlap.rs`) both call [`units_on`], so
//! a measurement computes what a run does.

use std::sync::Arc;

use super::{DeviceLink, ResidentUnits, TierLimits, TieredUnits};
use crate::config::{Config, OffloadDevice, Precision};
use crate::model::exec_units::UnitCompute;
use crate::model::{Model, ModelError};

/// The units on `link` for `cfg` on `world` ranks, each block's forward
/// kept within `tierzero.activation_budget_bytes`.
pub fn units_on<L: DeviceLink + 'static>(
    link: L,
    cfg: &Config,
    model: &Model,
    world: usize,
) -> Result<Arc<dyn UnitCompute>, ModelError> {
    match trains_resident(cfg, world) {
        Ok(()) => {
            let bf16 = cfg.precision == Precision::Bf16;
            let units =
                ResidentUnits::new(link, model, bf16)?.keep_forwards(cfg.tierzero.activations)?;
            Ok(Arc::new(units))
        }
        Err(why) => {
            tracing::info!("the optimizer runs on the host: {why}");
            let units = TieredUnits::new(link, TierLimits::of(cfg))?
                .keep_forwards(cfg.tierzero.activations)?;
            Ok(Arc::new(units))
        }
    }
}

/// Whether the run trains in device memory (Adam on the device: what
/// DeepSpeed does with nothing offloaded), or why not.
pub fn trains_resident(cfg: &Config, world: usize) -> Result<(), String> {
    let z = &cfg.zero;
    if z.offload_optimizer.device != OffloadDevice::None {
        return Err(format!(
            "zero_optimization.offload_optimizer.device is {:?}",
            z.offload_optimizer.device
        ));
    }
    if z.offload_param.device != OffloadDevice::None {
        return Err(format!(
            "zero_optimization.offload_param.device is {:?}",
            z.offload_param.device
        ));
    }
    if world > 1 {
        return Err(format!(
            "{world} ranks (the device optimizer holds whole params, one rank)"
        ));
    }
    if !cfg.optimizer.decoupled_weight_decay {
        return Err("adam_w_mode is false (the device kernel is AdamW's)".into());
    }
    Ok(())
}

impl TierLimits {
    /// The tier's bounds from the config: `stage3_prefetch_bucket_size`,
    /// `stage3_max_live_parameters`, `tierzero.device_cache_bytes`.
    pub fn of(cfg: &Config) -> Self {
        TierLimits {
            prefetch_numel: cfg.zero.prefetch_bucket_numel.0,
            max_live_numel: cfg.zero.max_live_parameters_numel.0,
            cache_bytes: cfg.tierzero.device_cache_bytes.0,
        }
    }
}

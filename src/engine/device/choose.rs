//! Which units a run computes on a device link: in device memory with
//! Adam on the device when nothing is offloaded and one rank trains, or
//! several whose devices have collectives of their own
//! ([`ResidentUnits`]; at stage 3 their params partitioned too), else
//! the device tier with the optimizer on the host ([`TieredUnits`]). `tierzero train --device` and the device
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
    match trains_resident(cfg, world, link.reduce_ranks()) {
        Ok(()) => {
            let bf16 = cfg.precision == Precision::Bf16;
            // Stage 3 partitions the params on the devices too.
            let partition = cfg.zero.stage == crate::config::Stage::Parameters;
            let units = ResidentUnits::with_partition(link, model, bf16, partition)?
                .keep_forwards(cfg.tierzero.activations)?;
            Ok(Arc::new(units))
        }
        Err(why) => {
            tracing::info!("the optimizer runs on the host: {why}");
            check_largest_unit_fits(&link, cfg, model)?;
            let units = TieredUnits::new(link, TierLimits::of(cfg))?
                .params_stored_as(cfg.precision.storage_dtype())
                .keep_forwards(cfg.tierzero.activations)?;
            Ok(Arc::new(units))
        }
    }
}

/// The device tier holds a unit's params all at once: a budget for
/// params below the largest unit's (at the storage dtype's bytes) is
/// refused here, naming the least that runs, rather than failing the
/// first step as the tier's error that no prefetch setting can mend. At
/// exactly that budget the tier runs (it uploads ahead only what fits).
fn check_largest_unit_fits<L: DeviceLink>(
    link: &L,
    cfg: &Config,
    model: &Model,
) -> Result<(), ModelError> {
    let need = super::param_device_bytes(model.largest_unit_numel(), cfg.precision.storage_dtype());
    let budget = link.budget_bytes();
    if need <= budget {
        return Ok(());
    }
    let whole = link.whole_budget_for(need);
    Err(ModelError::Gpu {
        what: format!(
            "device tier: the model's largest unit needs {need} bytes of params on the device at \
             once ({}), and the device's budget for params is {budget} bytes; set \
             tierzero.device_budget_bytes to at least {whole} ({}; more lets the next unit \
             upload ahead), on a device with that much free",
            crate::units::format_bytes(need),
            crate::units::format_bytes(whole)
        ),
    })
}

/// Whether the run on `world` ranks trains in device memory (Adam on the
/// device: what DeepSpeed does with nothing offloaded), or why not.
/// `device_ranks`: the ranks the link's own collectives span
/// ([`DeviceLink::reduce_ranks`]); several ranks need them all (NCCL).
pub fn trains_resident(cfg: &Config, world: usize, device_ranks: usize) -> Result<(), String> {
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
    if world > 1 && device_ranks != world {
        return Err(format!(
            "{world} ranks and no collectives among their devices (NCCL): the device \
             optimizer's gradients and weights move between the devices"
        ));
    }
    if !cfg.optimizer.decoupled_weight_decay {
        return Err("adam_w_mode is false (the device kernel is AdamW's)".into());
    }
    if matches!(cfg.precision, Precision::Fp16 { .. }) {
        // Its params are rounded to bf16 or kept in fp32, and its sums of
        // gradients are fp32: fp16's overflow of a loss-scaled gradient
        // (which skips the step) would not show there as on the host.
        return Err("fp16.enabled (the device optimizer keeps fp32 or bf16 params)".into());
    }
    Ok(())
}

impl TierLimits {
    /// The tier's bounds from the config: `stage3_prefetch_bucket_size`,
    /// `stage3_max_live_parameters`, `tierzero.device_cache_bytes`
    /// (`"auto"`: [`TierLimits::CACHE_AUTO`]).
    pub fn of(cfg: &Config) -> Self {
        TierLimits {
            prefetch_numel: cfg.zero.prefetch_bucket_numel.0,
            max_live_numel: cfg.zero.max_live_parameters_numel.0,
            cache_bytes: cfg
                .tierzero
                .device_cache_bytes
                // A byte count is never `"auto"`'s mark: u64::MAX given
                // was shown and run as "auto".
                .map_or(TierLimits::CACHE_AUTO, |b| {
                    b.0.min(TierLimits::CACHE_AUTO - 1)
                }),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::config::{load_str, RunContext};

    fn config(extra: &str) -> Config {
        let text = format!(r#"{{"train_micro_batch_size_per_gpu": 2, {extra}}}"#);
        load_str(&text, &RunContext::default()).unwrap().config
    }

    #[test]
    fn nothing_offloaded_trains_resident_unless_fp16_or_l2_adam_or_ranks_without_nccl() {
        let plain = config(r#""zero_optimization": {"stage": 0}"#);
        assert_eq!(trains_resident(&plain, 1, 1), Ok(()));
        assert!(trains_resident(&plain, 2, 1)
            .unwrap_err()
            .contains("2 ranks and no collectives"));
        assert_eq!(trains_resident(&plain, 2, 2), Ok(()));
        // Collectives among some of the ranks' devices only.
        assert!(trains_resident(&plain, 3, 2)
            .unwrap_err()
            .contains("3 ranks and no collectives"));
        let bf16 = config(r#""bf16": {"enabled": true}"#);
        assert_eq!(trains_resident(&bf16, 1, 1), Ok(()));
        let fp16 = config(r#""fp16": {"enabled": true}"#);
        assert!(trains_resident(&fp16, 1, 1)
            .unwrap_err()
            .contains("fp16.enabled"));
        let l2 = config(
            r#""optimizer": {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": false}}"#,
        );
        assert!(trains_resident(&l2, 1, 1)
            .unwrap_err()
            .contains("adam_w_mode"));
    }

    #[test]
    fn a_device_cache_of_any_byte_count_is_not_auto() {
        let cache = |v: &str| {
            TierLimits::of(&config(&format!(
                r#""tierzero": {{"device_cache_bytes": {v}}}"#
            )))
            .cache_bytes
        };
        assert_eq!(cache("\"auto\""), TierLimits::CACHE_AUTO);
        assert_eq!(cache("4096"), 4096);
        assert_eq!(cache(&u64::MAX.to_string()), u64::MAX - 1);
    }
}

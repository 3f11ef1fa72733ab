//! The tier's device memory as the start-up plan shows it: the bound on
//! the params it holds at once, and the plan's device rows.

use super::*;

/// The elements of the model's largest param.
fn largest_param_numel(model: &Model) -> u64 {
    model
        .params()
        .iter()
        .map(|p| p.numel as u64)
        .max()
        .unwrap_or(0)
}

impl<L: DeviceLink> TieredUnits<L> {
    /// The most device bytes the tier's params hold on `model`: the
    /// largest unit's params in use, plus what may upload ahead (the
    /// window, or the one larger param it always lets through), plus the
    /// cache, and never more than the whole model or the link's budget
    /// for them, at the storage dtype's device bytes
    /// ([`TieredUnits::params_stored_as`]). The plan prints it;
    /// `tests/device_tier.rs` checks the peaks against it.
    pub fn params_bound_bytes(&self, model: &Model) -> u64 {
        let largest_unit = model.largest_unit_numel();
        let largest_param = largest_param_numel(model);
        let ahead = self.limits.prefetch_numel.max(largest_param);
        let all: u64 = model.params().iter().map(|p| p.numel as u64).sum();
        let elem_bytes = super::super::param_device_bytes(1, self.storage);
        let bound = largest_unit
            .saturating_add(ahead)
            .saturating_mul(elem_bytes)
            .saturating_add(self.limits.cache_bytes);
        bound
            .min(all.saturating_mul(elem_bytes))
            .min(self.link.budget_bytes())
    }

    /// The device's rows of the start-up plan: the params on it at most,
    /// the upload staging, the kept forwards, the reduce-scatter's
    /// buffers, the temporaries and the start-up's workspaces.
    pub(super) fn device_memory_plan(&self, model: &Model) -> DeviceMemoryPlan {
        let mem = self.link.memory();
        let largest_param = largest_param_numel(model);
        let mut rows = vec![
            DeviceMemoryRow {
                what: "params on the device (at most)".into(),
                device_bytes: self.params_bound_bytes(model),
                pinned_bytes: 0,
            },
            DeviceMemoryRow {
                what: "upload staging buffers".into(),
                device_bytes: 0,
                pinned_bytes: mem.staging.bound_bytes(super::super::param_device_bytes(
                    largest_param,
                    self.storage,
                )),
            },
        ];
        if mem.download_idle_bytes > 0 {
            // The idle buffers kept for reuse, and two units' gradients
            // in flight (see `LinkMemory::download_idle_bytes`), at the
            // storage dtype's bytes (their wire, or less: fp32 sums of a
            // rank's share when several reduce on the device).
            let in_flight = super::super::param_device_bytes(
                model.largest_unit_numel().saturating_mul(2),
                self.storage,
            );
            rows.push(DeviceMemoryRow {
                what: "gradient download staging (at most)".into(),
                device_bytes: 0,
                pinned_bytes: mem.download_idle_bytes.saturating_add(in_flight),
            });
        }
        if let Some(t) = mem.temporaries_bytes {
            let kept = self.inputs.forward_budget_bytes().min(t);
            if kept > 0 {
                rows.push(DeviceMemoryRow {
                    what: "blocks' kept forwards (at most)".into(),
                    device_bytes: kept,
                    pinned_bytes: 0,
                });
            }
            // With several ranks, a unit's gradients' reduce-scatter on
            // the device takes its buffers from the same share.
            let reduce = super::super::grads_out::reduce_bytes_bound(
                model,
                self.link.reduce_ranks(),
                self.storage,
            )
            .min(t - kept);
            if reduce > 0 {
                rows.push(DeviceMemoryRow {
                    what: "gradients' reduce-scatter (at most)".into(),
                    device_bytes: reduce,
                    pinned_bytes: 0,
                });
            }
            rows.push(DeviceMemoryRow {
                what: "activations, grads, temporaries".into(),
                device_bytes: t - kept - reduce,
                pinned_bytes: 0,
            });
        }
        if mem.startup_bytes > 0 {
            rows.push(DeviceMemoryRow {
                what: "kernels and cuBLAS workspaces".into(),
                device_bytes: mem.startup_bytes,
                pinned_bytes: 0,
            });
        }
        DeviceMemoryPlan {
            budget_bytes: mem.device_budget_bytes,
            rows,
            optimizer_on_device: false,
        }
    }
}

impl TierLimits {
    /// What the plan says the tier keeps between uses, of a tier whose
    /// params' budget is `budget_bytes`: `"auto"`'s rule, or the bytes set,
    /// said capped where they exceed the budget (the cache lives in it).
    pub(super) fn kept_text(&self, budget_bytes: u64) -> String {
        if self.cache_bytes == TierLimits::CACHE_AUTO {
            format!(
                "params kept between uses while the tier's budget of {} holds them (tierzero.device_cache_bytes \"auto\")",
                crate::units::format_bytes(budget_bytes)
            )
        } else if self.cache_bytes > budget_bytes {
            // The cache lives in the tier's budget: it cannot hold more.
            format!(
                "{} kept between uses (tierzero.device_cache_bytes {}, capped by the tier's budget)",
                crate::units::format_bytes(budget_bytes),
                crate::units::format_bytes(self.cache_bytes)
            )
        } else {
            format!(
                "{} kept between uses",
                crate::units::format_bytes(self.cache_bytes)
            )
        }
    }
}

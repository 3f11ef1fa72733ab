//! Persistent params: the stage-3 params that stay whole in memory from
//! their first fetch to the end of the run, never released.
//!
//! DeepSpeed's rule (`DeepSpeedZeRoOffload.mark_persistent_parameters`),
//! in the model's param order: a param of at most
//! `stage3_param_persistence_threshold` elements is persistent while the
//! persistent elements so far plus its own stay within
//! `stage3_model_persistence_threshold`; one that would pass that bound is
//! skipped and the walk goes on (a smaller one after it may still fit).
//!
//! With CPU compute, a persistent param of the cpu or NVMe tier is a heap
//! tensor beside its home for the whole run: host memory that grows with
//! the model's small params (a GPT-2 of width 128 has every param under
//! the default 1e5, so the whole model stayed in the heap: 39 MiB at 2
//! blocks, 92 MiB at 64). The plan's params row and `tierzero estimate`
//! count these bytes ([`persistent_host_bytes`]);
//! `stage3_model_persistence_threshold` bounds them.

use crate::engine::params::store::Tier;

/// Per param (`numel`, whole params in `ParamId` order): whether it is
/// persistent under DeepSpeed's rule (module docs).
pub fn persistent_params(
    numel: impl IntoIterator<Item = u64>,
    threshold_numel: u64,
    model_threshold_numel: u64,
) -> Vec<bool> {
    let mut total = 0u64;
    numel
        .into_iter()
        .map(|n| {
            if n.saturating_add(total) > model_threshold_numel || n > threshold_numel {
                return false;
            }
            total += n;
            true
        })
        .collect()
}

/// Elements and count of the persistent params among `numel` (whole
/// params, `ParamId` order) whose `tiers` are offloaded (cpu or NVMe):
/// those held in the heap beside their homes for the run.
pub fn persistent_offloaded(
    numel: &[u64],
    tiers: &[Tier],
    threshold_numel: u64,
    model_threshold_numel: u64,
) -> (u64, usize) {
    persistent_params(
        numel.iter().copied(),
        threshold_numel,
        model_threshold_numel,
    )
    .into_iter()
    .zip(numel)
    .zip(tiers)
    .filter(|((persistent, _), tier)| *persistent && **tier != Tier::Device)
    .fold((0, 0), |(sum, count), ((_, &n), _)| {
        (sum.saturating_add(n), count + 1)
    })
}

/// Host bytes of the persistent offloaded params ([`persistent_offloaded`])
/// at `elem_bytes` each: the plan's params host row.
pub fn persistent_host_bytes(
    numel: &[u64],
    tiers: &[Tier],
    threshold_numel: u64,
    model_threshold_numel: u64,
    elem_bytes: u64,
) -> u64 {
    persistent_offloaded(numel, tiers, threshold_numel, model_threshold_numel)
        .0
        .saturating_mul(elem_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deepspeed_s_rule_at_and_past_the_bounds() {
        // At the threshold is persistent (DeepSpeed's `<=`), one past is not.
        assert_eq!(
            persistent_params([10, 11, 9, 0], 10, u64::MAX),
            [true, false, true, true]
        );
        // The model bound skips a param that would pass it, and a later,
        // smaller one still fits: 6 + 5 > 10 is skipped, 6 + 4 = 10 fits.
        assert_eq!(
            persistent_params([6, 5, 4, 1], 10, 10),
            [true, false, true, false]
        );
        assert_eq!(persistent_params([1, 1], 10, 0), [false, false]);
        assert!(persistent_params([], 10, 10).is_empty());
    }

    #[test]
    fn only_offloaded_params_count_in_host_bytes() {
        let numel = [4, 8, 100, 2];
        let tiers = [Tier::Nvme, Tier::Device, Tier::Nvme, Tier::Cpu];
        assert_eq!(persistent_offloaded(&numel, &tiers, 10, u64::MAX), (6, 2));
        assert_eq!(persistent_host_bytes(&numel, &tiers, 10, u64::MAX, 2), 12);
        // The device param still counts against the model bound: 4 + 8
        // leave no room for the 2.
        assert_eq!(persistent_offloaded(&numel, &tiers, 10, 12), (4, 1));
    }
}

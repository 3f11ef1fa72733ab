//! Persistent params: the stage-3 params that stay whole in memory from
//! their first fetch to the end of the run, never released.
//!
//! DeepSpeed's rule (`DeepSpeedZeRoOffload.mark_persistent_parameters`),
//! in HF's `named_parameters()` order ([`Model::params_in_hf_order`]): a param of at most
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
//! count these bytes ([`persistent_total`]);
//! `stage3_model_persistence_threshold` bounds them.
//!
//! `scripts/persistent_rss.sh` measures it (debug build, 2 steps, 2 and 64
//! blocks): peak RSS 39 and 92 MiB under the default threshold, the plan's
//! params row now 48.6 MiB in host memory at 64 blocks (it showed none);
//! 38 and 42 MiB with the threshold 0, and with
//! `stage3_model_persistence_threshold` 1e5 (50 params, 390.5 KiB).

use crate::engine::params::store::Tier;
use crate::model::Model;

/// Per param of `model` (`ParamId` order): whether it is persistent under
/// DeepSpeed's rule, walked in HF's `named_parameters()` order as
/// DeepSpeed walks it ([`Model::params_in_hf_order`]: within a Llama
/// layer its norms come last, so where the model threshold cuts, the set
/// is DeepSpeed's and the Python package's, not that of this model's
/// execution order).
pub fn persistent_params(
    model: &Model,
    threshold_numel: u64,
    model_threshold_numel: u64,
) -> Vec<bool> {
    let order = model.params_in_hf_order();
    let walked = persistent_in_order(
        order
            .iter()
            .map(|id| model.params().get(id.0).map_or(0, |p| p.numel as u64)),
        threshold_numel,
        model_threshold_numel,
    );
    let mut persistent = vec![false; model.params().len()];
    for (id, is) in order.iter().zip(walked) {
        if let Some(slot) = persistent.get_mut(id.0) {
            *slot = is;
        }
    }
    persistent
}

/// DeepSpeed's rule over `numel`, whole params in the order it walks them
/// (module docs): whether each is persistent.
pub fn persistent_in_order(
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

/// Elements and count of the params marked `persistent` (`ParamId`
/// order, as `model`'s), with `tiers` those offloaded alone (cpu or
/// NVMe: held whole in the heap beside their homes for the run, the
/// plan's params host row); without, all of them (`estimate`'s, whose
/// choices offload them all).
pub fn persistent_total(
    model: &Model,
    persistent: &[bool],
    tiers: Option<&[Tier]>,
) -> (u64, usize) {
    model
        .params()
        .iter()
        .zip(persistent)
        .enumerate()
        .filter(|(i, (_, persistent))| {
            **persistent && tiers.is_none_or(|t| t.get(*i).is_some_and(|t| *t != Tier::Device))
        })
        .fold((0, 0), |(sum, count), (_, (p, _))| {
            (sum.saturating_add(p.numel as u64), count + 1)
        })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failure is a panic
    use super::*;
    use crate::model::ModelConfig;

    #[test]
    fn deepspeed_s_rule_at_and_past_the_bounds() {
        // At the threshold is persistent (DeepSpeed's `<=`), one past is not.
        assert_eq!(
            persistent_in_order([10, 11, 9, 0], 10, u64::MAX),
            [true, false, true, true]
        );
        // The model bound skips a param that would pass it, and a later,
        // smaller one still fits: 6 + 5 > 10 is skipped, 6 + 4 = 10 fits.
        assert_eq!(
            persistent_in_order([6, 5, 4, 1], 10, 10),
            [true, false, true, false]
        );
        assert_eq!(persistent_in_order([1, 1], 10, 0), [false, false]);
        assert!(persistent_in_order([], 10, 10).is_empty());
    }

    fn model(json: serde_json::Value) -> Model {
        let (cfg, _) = ModelConfig::from_hf_json(&json.to_string()).unwrap();
        Model::new(cfg).unwrap()
    }

    /// A Llama layer is walked in HF's order, its norms last: with a model
    /// bound that cuts inside it, the set is DeepSpeed's (the embedding,
    /// q, k, v, o, gate, up and down, 4096 elements each, fill 32 768; the
    /// norms, 64 each, no longer fit). In this model's own order the
    /// norms came first and down_proj was left out.
    #[test]
    fn a_llama_layer_is_walked_in_hf_order() {
        let m = model(serde_json::json!({"model_type": "llama", "vocab_size": 64,
            "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 4,
            "max_position_embeddings": 32, "tie_word_embeddings": true}));
        let names: Vec<&str> = m
            .params_in_hf_order()
            .iter()
            .map(|id| m.params()[id.0].name.as_str())
            .collect();
        let layer = [
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
        ];
        let want: Vec<String> = std::iter::once("model.embed_tokens.weight".to_owned())
            .chain(layer.iter().map(|n| format!("model.layers.0.{n}")))
            .chain(std::iter::once("model.norm.weight".to_owned()))
            .collect();
        assert_eq!(names, want);
        let persistent = persistent_params(&m, 100_000, 8 * 4096);
        let kept: Vec<&str> = m
            .params()
            .iter()
            .zip(&persistent)
            .filter(|(_, k)| **k)
            .map(|(p, _)| p.name.as_str())
            .collect();
        assert_eq!(kept.len(), 8, "{kept:?}");
        assert!(kept.iter().all(|n| !n.contains("norm")), "{kept:?}");
        // GPT-2's order is HF's already.
        let g = model(serde_json::json!({"model_type": "gpt2", "vocab_size": 64,
            "n_positions": 32, "n_embd": 32, "n_layer": 2, "n_head": 2}));
        let ids: Vec<usize> = g.params_in_hf_order().iter().map(|i| i.0).collect();
        assert_eq!(ids, (0..g.params().len()).collect::<Vec<_>>());
    }

    #[test]
    fn only_offloaded_params_count_in_host_bytes() {
        let g = model(serde_json::json!({"model_type": "gpt2", "vocab_size": 64,
            "n_positions": 32, "n_embd": 32, "n_layer": 1, "n_head": 2}));
        let n = g.params().len();
        let all = vec![true; n];
        let mut tiers = vec![Tier::Nvme; n];
        let total: u64 = g.params().iter().map(|p| p.numel as u64).sum();
        assert_eq!(persistent_total(&g, &all, Some(&tiers)), (total, n));
        assert_eq!(persistent_total(&g, &all, None), (total, n));
        tiers[0] = Tier::Device;
        let first = g.params()[0].numel as u64;
        assert_eq!(
            persistent_total(&g, &all, Some(&tiers)),
            (total - first, n - 1)
        );
        assert_eq!(persistent_total(&g, &vec![false; n], Some(&tiers)), (0, 0));
    }
}

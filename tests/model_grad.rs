//! Gradient tests for the per-unit backward by recompute.
//!
//! 1. Per-unit backward (the engine's loop) against one full-graph backward
//!    of the whole model, in f32. Measured max relative differences (inf-norm
//!    of the difference over inf-norm of the full-graph grad, per tensor) are
//!    printed; every tensor must be within 1e-6, and every tensor that is not
//!    shared by two units must be bit-identical. A tied embedding gets its
//!    two contributions (head matmul, embedding index_add) summed in a
//!    different order: the full graph index_adds the embedding rows into the
//!    head's gradient, per-unit computes them from zero and adds the head's
//!    afterwards, so rows of tokens seen more than once round differently.
//! 2. Central finite differences in f64 on tiny models: a dropped gradient
//!    (an op without backward) would make the analytic gradient 0 or missing
//!    and fail here.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod model_support;

use candle_core::{DType, Device, Tensor};
use model_support::*;
use tierzero::model::{Model, ModelConfig};

/// (max |a - b|, max |a - b| / max |b|) over one tensor.
fn diffs(a: &Tensor, b: &Tensor) -> (f64, f64) {
    let a = to_f64_vec(a);
    let b = to_f64_vec(b);
    let max_abs = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    let scale = b.iter().map(|y| y.abs()).fold(0.0, f64::max);
    (
        max_abs,
        if scale > 0.0 {
            max_abs / scale
        } else {
            max_abs
        },
    )
}

fn check_against_full_graph(cfg: ModelConfig, label: &str) {
    let model = Model::new(cfg).unwrap();
    let params = random_params(&model, 11, DType::F32);
    let (ids, targets) = batch(model.config().vocab_size, 3, 5, 1);
    let (loss_u, grads_u) = per_unit_grads(&model, &params, &ids, &targets);
    let (loss_f, grads_f) = full_graph_grads(&model, &params, &ids, &targets);
    assert_eq!(
        loss_u.to_scalar::<f32>().unwrap().to_bits(),
        loss_f.to_scalar::<f32>().unwrap().to_bits(),
        "{label}: forward must be identical"
    );
    let mut worst: f64 = 0.0;
    let mut identical = 0;
    for spec in model.params() {
        let (abs, rel) = diffs(&grads_u[spec.id.0], &grads_f[spec.id.0]);
        let same = abs == 0.0;
        identical += usize::from(same);
        worst = worst.max(rel);
        println!(
            "{label}: {:40} units={} max_abs={abs:.3e} max_rel={rel:.3e}",
            spec.name,
            spec.units.len()
        );
        assert!(
            rel <= 1e-6,
            "{label}: {} differs by {rel:e} relative",
            spec.name
        );
        if spec.units.len() == 1 {
            assert!(
                same,
                "{label}: {} is used by one unit and must be bit-identical (max_abs {abs:e})",
                spec.name
            );
        }
    }
    println!(
        "{label}: {identical}/{} grads bit-identical, max relative difference {worst:.3e}",
        model.params().len()
    );
}

#[test]
fn per_unit_matches_full_graph_gpt2_tied() {
    check_against_full_graph(gpt2_config(true), "gpt2-tied");
}

#[test]
fn per_unit_matches_full_graph_gpt2_untied() {
    check_against_full_graph(gpt2_config(false), "gpt2-untied");
}

#[test]
fn per_unit_matches_full_graph_llama_untied() {
    check_against_full_graph(llama_config(false), "llama-untied");
}

#[test]
fn per_unit_matches_full_graph_llama_tied() {
    check_against_full_graph(llama_config(true), "llama-tied");
}

/// Finite differences in f64 against the per-unit grads, on a few entries of
/// every parameter.
fn finite_difference_check(cfg: ModelConfig, label: &str) {
    let model = Model::new(cfg).unwrap();
    let params = random_params(&model, 5, DType::F64);
    let (ids, targets) = batch(model.config().vocab_size, 2, 5, 2);
    let (_, grads) = per_unit_grads(&model, &params, &ids, &targets);
    let loss_at = |ps: &[Tensor]| -> f64 {
        model
            .forward_full(ps, &ids, &targets)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    };
    let eps = 1e-5;
    let mut worst: f64 = 0.0;
    for spec in model.params() {
        let base = to_f64_vec(&params[spec.id.0]);
        let analytic = to_f64_vec(&grads[spec.id.0]);
        // A few spread-out entries of each tensor (first, last, middle ones).
        let n = base.len();
        let mut picks = vec![0, n - 1, n / 2, (n * 3) / 7, (n * 5) / 11];
        picks.sort_unstable();
        picks.dedup();
        let mut largest: f64 = 0.0;
        for &k in &picks {
            let eval = |delta: f64| {
                let mut v = base.clone();
                v[k] += delta;
                let mut ps = params.clone();
                ps[spec.id.0] = Tensor::from_vec(v, spec.shape.as_slice(), &Device::Cpu).unwrap();
                loss_at(&ps)
            };
            let fd = (eval(eps) - eval(-eps)) / (2.0 * eps);
            let an = analytic[k];
            let err = (fd - an).abs() / fd.abs().max(an.abs()).max(1e-4);
            worst = worst.max(err);
            largest = largest.max(an.abs()).max(fd.abs());
            assert!(
                err < 1e-6,
                "{label}: {}[{k}] analytic {an:e} vs finite difference {fd:e} (rel {err:e})",
                spec.name
            );
        }
        // Guard against a vacuous pass: every tensor must have a visible gradient.
        assert!(
            largest > 1e-4,
            "{label}: {} has tiny gradients at all probes ({largest:e}); pick other probes",
            spec.name
        );
    }
    println!("{label}: finite differences agree to {worst:.3e} relative");
}

#[test]
fn finite_differences_gpt2() {
    finite_difference_check(gpt2_config(true), "gpt2-tied-f64");
}

#[test]
fn finite_differences_gpt2_erf() {
    let text = r#"{"model_type":"gpt2","vocab_size":7,"n_positions":6,"n_embd":4,"n_layer":1,
        "n_head":2,"activation_function":"gelu","tie_word_embeddings":false}"#;
    let cfg = ModelConfig::from_hf_json(text).unwrap().0;
    finite_difference_check(cfg, "gpt2-erf-f64");
}

#[test]
fn finite_differences_llama() {
    finite_difference_check(llama_config(false), "llama-untied-gqa-f64");
}

/// The loss scale passed to the head scales every gradient exactly linearly.
#[test]
fn loss_scale_scales_gradients() {
    let model = Model::new(gpt2_config(true)).unwrap();
    let params = random_params(&model, 3, DType::F32);
    let (_, targets) = batch(11, 2, 4, 0);
    let head = model.units().last().unwrap().id;
    let p = model.unit_params(head, &params).unwrap();
    let h = Tensor::from_vec(
        (0..64).map(|i| (i as f32 * 0.37).sin()).collect::<Vec<_>>(),
        (2, 4, 8),
        &Device::Cpu,
    )
    .unwrap();
    let input = tierzero::model::UnitInput::HiddenWithTargets {
        hidden: &h,
        targets: &targets,
    };
    let g1 = model
        .backward_unit(head, &p, input, tierzero::model::Upstream::LossScale(1.0))
        .unwrap();
    let g4 = model
        .backward_unit(head, &p, input, tierzero::model::Upstream::LossScale(0.25))
        .unwrap();
    assert_eq!(
        g1.loss.unwrap().to_scalar::<f32>().unwrap(),
        g4.loss.unwrap().to_scalar::<f32>().unwrap()
    );
    for ((_, a), (_, b)) in g1.params.iter().zip(&g4.params) {
        // 0.25 is a power of two: scaling is exact.
        let a4 = (a * 0.25).unwrap();
        assert_eq!(to_f64_vec(&a4), to_f64_vec(b));
    }
}

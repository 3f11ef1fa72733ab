//! Shared helpers for the `model_*` integration tests: tiny configs,
//! deterministic params and token batches, and the per-unit training chain
//! as the engine will run it.
#![allow(dead_code, reason = "each test binary uses a subset")]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test helpers")]

use candle_core::{DType, Device, Tensor, Var};
use tierzero::model::io::init_param;
use tierzero::model::{
    Init, Model, ModelConfig, ParamId, UnitInput, UnitKind, UnitOutput, Upstream,
};

pub fn gpt2_config(tied: bool) -> ModelConfig {
    let text = format!(
        r#"{{"model_type":"gpt2","vocab_size":11,"n_positions":6,"n_embd":8,"n_layer":2,
            "n_head":2,"n_inner":12,"tie_word_embeddings":{tied}}}"#
    );
    ModelConfig::from_hf_json(&text).unwrap().0
}

pub fn llama_config(tied: bool) -> ModelConfig {
    let text = format!(
        r#"{{"model_type":"llama","vocab_size":13,"hidden_size":8,"intermediate_size":12,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
            "max_position_embeddings":6,"rope_theta":100.0,"tie_word_embeddings":{tied}}}"#
    );
    ModelConfig::from_hf_json(&text).unwrap().0
}

/// Params far from the init's symmetric point (norm weights != 1, biases
/// != 0, weights with std 0.3) so every gradient is sizeable.
pub fn random_params(model: &Model, seed: u64, dtype: DType) -> Vec<Tensor> {
    model
        .params()
        .iter()
        .map(|p| {
            let mut noise_spec = p.clone();
            noise_spec.init = Init::Normal { std: 0.3 };
            let noise = init_param(&noise_spec, seed, DType::F64, &Device::Cpu).unwrap();
            let base = match p.init {
                Init::Ones => 1.0,
                _ => 0.0,
            };
            (noise + base).unwrap().to_dtype(dtype).unwrap()
        })
        .collect()
}

/// Tokens `[batch, seq + 1]` with repeats, split into inputs and targets.
pub fn batch(vocab: usize, b: usize, t: usize, salt: usize) -> (Tensor, Tensor) {
    let n = b * (t + 1);
    let toks: Vec<u32> = (0..n)
        .map(|i| ((i * 7 + salt * 3 + (i * i) % 5) % vocab) as u32)
        .collect();
    let all = Tensor::from_vec(toks, (b, t + 1), &Device::Cpu).unwrap();
    let ids = all.narrow(1, 0, t).unwrap().contiguous().unwrap();
    let targets = all.narrow(1, 1, t).unwrap().contiguous().unwrap();
    (ids, targets)
}

/// The engine's loop on one micro-batch: forward unit by unit saving each
/// unit's input, then backward unit by unit in reverse by recompute. Tied
/// params' grads are summed in backward order (head first). Returns the loss
/// and the grads indexed by ParamId.
pub fn per_unit_grads(
    model: &Model,
    params: &[Tensor],
    ids: &Tensor,
    targets: &Tensor,
) -> (Tensor, Vec<Tensor>) {
    let units = model.units();
    let mut saved: Vec<Option<Tensor>> = vec![None; units.len()];
    let mut hidden: Option<Tensor> = None;
    let mut loss = None;
    for u in units {
        let p = model.unit_params(u.id, params).unwrap();
        let out = match u.kind {
            UnitKind::Embedding => model.forward_unit(u.id, &p, UnitInput::Tokens(ids)),
            UnitKind::Block { .. } => {
                let h = hidden.clone().unwrap();
                let out = model.forward_unit(u.id, &p, UnitInput::Hidden(&h));
                saved[u.id.0] = Some(h);
                out
            }
            UnitKind::Head => {
                let h = hidden.clone().unwrap();
                let out = model.forward_unit(
                    u.id,
                    &p,
                    UnitInput::HiddenWithTargets {
                        hidden: &h,
                        targets,
                    },
                );
                saved[u.id.0] = Some(h);
                out
            }
        };
        match out.unwrap() {
            UnitOutput::Hidden(h) => hidden = Some(h),
            UnitOutput::Loss(l) => loss = Some(l),
        }
    }
    let mut grads: Vec<Option<Tensor>> = vec![None; model.params().len()];
    let mut upstream: Option<Tensor> = None;
    for u in units.iter().rev() {
        let p = model.unit_params(u.id, params).unwrap();
        let g = match u.kind {
            UnitKind::Head => {
                let h = saved[u.id.0].as_ref().unwrap();
                model.backward_unit(
                    u.id,
                    &p,
                    UnitInput::HiddenWithTargets { hidden: h, targets },
                    Upstream::LossScale(1.0),
                )
            }
            UnitKind::Block { .. } => {
                let h = saved[u.id.0].as_ref().unwrap();
                let up = upstream.as_ref().unwrap();
                model.backward_unit(u.id, &p, UnitInput::Hidden(h), Upstream::Grad(up))
            }
            UnitKind::Embedding => {
                let up = upstream.as_ref().unwrap();
                model.backward_unit(u.id, &p, UnitInput::Tokens(ids), Upstream::Grad(up))
            }
        }
        .unwrap();
        for (id, grad) in g.params {
            grads[id.0] = Some(match grads[id.0].take() {
                None => grad,
                Some(acc) => (acc + grad).unwrap(),
            });
        }
        upstream = g.input;
    }
    (
        loss.unwrap(),
        grads.into_iter().map(|g| g.unwrap()).collect(),
    )
}

/// One full graph over the whole model (all params as Vars), one backward.
pub fn full_graph_grads(
    model: &Model,
    params: &[Tensor],
    ids: &Tensor,
    targets: &Tensor,
) -> (Tensor, Vec<Tensor>) {
    let vars: Vec<Var> = params
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let loss = model.forward_full(&ts, ids, targets).unwrap();
    let store = loss.backward().unwrap();
    let grads = vars
        .iter()
        .map(|v| store.get(v.as_tensor()).expect("grad").clone())
        .collect();
    (loss.detach(), grads)
}

pub fn to_f64_vec(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

pub fn param_name(model: &Model, id: ParamId) -> String {
    model.param(id).unwrap().name.clone()
}

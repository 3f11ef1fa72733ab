//! The units written for the GPU (`tierzero_gpu::unit`) run as one
//! micro-batch's chain on any executor: forward unit by unit, saving each
//! block's input, then backward head first by recompute, as the engine
//! runs them. The same batch goes through the candle units the CPU trains
//! with (`model_support::per_unit_grads`), and every param's gradient is
//! compared with theirs.
//!
//! Two users: `tests/gpu_units.rs` on the host executor (every kernel's
//! scalar reference), and `examples/unit_check.rs` on the CUDA executor,
//! the device check's units step. The executor's errors come back as
//! text, so the device check can report them (the candle side's helpers,
//! `model_support`, unwrap: they run the CPU units, tested elsewhere).
#![allow(dead_code, reason = "each user takes a subset")]

use candle_core::{DType, Tensor};
use tierzero::model::{Model, ModelConfig, UnitKind, UnitSpec};
use tierzero_gpu::unit::{self, Exec, RopeTables};

use super::model_support::{batch, per_unit_grads, random_params};

/// What one chain gave against the candle units.
#[derive(Debug, Clone)]
pub struct ChainReport {
    /// The executor's mean loss.
    pub loss: f32,
    /// The candle units' loss.
    pub want_loss: f32,
    /// Each param's name and its gradient's relative error (the norm of
    /// the difference over the norm of candle's), in param order.
    pub grads: Vec<(String, f64)>,
}

impl ChainReport {
    /// The loss's relative error.
    pub fn loss_rel(&self) -> f64 {
        (((self.loss - self.want_loss) / self.want_loss).abs()) as f64
    }

    /// The worst gradient's relative error (NaN if any is NaN).
    pub fn worst(&self) -> f64 {
        self.grads.iter().fold(0.0, |w: f64, (_, e)| {
            if e.is_nan() || w.is_nan() {
                f64::NAN
            } else {
                w.max(*e)
            }
        })
    }

    /// Every relative error within `tol` (NaN never is).
    pub fn within(&self, tol: f64) -> bool {
        self.loss_rel() <= tol && self.grads.iter().all(|(_, e)| *e <= tol)
    }
}

fn flat(t: &Tensor) -> Result<Vec<f32>, String> {
    t.to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1())
        .map_err(|e| e.to_string())
}

fn ids_of(t: &Tensor) -> Result<Vec<i32>, String> {
    let v = t
        .flatten_all()
        .and_then(|t| t.to_vec1::<u32>())
        .map_err(|e| e.to_string())?;
    Ok(v.into_iter().map(|v| v as i32).collect())
}

/// The norm of the difference over the norm of `want` (the norm of
/// `got` when `want` is all zeros).
pub fn rel(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::NAN;
    }
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

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// The hidden state a unit takes: what the one before gave.
fn input<B>(h: &Option<B>) -> Result<&B, String> {
    h.as_ref()
        .ok_or_else(|| "a unit before the embedding".to_string())
}

/// What a unit's backward takes besides its params and grads: its saved
/// input (None for the embedding) and the gradient from the unit after it
/// (None for the head).
struct Stage<'a, B> {
    x: Option<&'a B>,
    up: Option<&'a B>,
}

impl<'a, B> Stage<'a, B> {
    fn x(&self) -> Result<&'a B, String> {
        self.x
            .ok_or_else(|| "a unit without its saved input".to_string())
    }
    fn up(&self) -> Result<&'a B, String> {
        self.up
            .ok_or_else(|| "a unit's backward before the head's".to_string())
    }
}

/// What a unit's backward gives: its loss (the head's) and its input's
/// gradient (None for the embedding).
struct Back<B> {
    loss: Option<f32>,
    dx: Option<B>,
}

fn unit_ids(u: &UnitSpec) -> Vec<usize> {
    u.params.iter().map(|id| id.0).collect()
}

/// The chain's state on the executor: the params on the host (uploaded per
/// unit), the gradients on the executor (taken out by unit, put back).
struct Chain<'a, E: Exec> {
    e: &'a E,
    params: Vec<Vec<f32>>,
    grads: Vec<Option<E::Buf>>,
}

impl<'a, E: Exec> Chain<'a, E> {
    fn new(e: &'a E, params: &[Tensor]) -> Result<Self, String> {
        let params: Vec<Vec<f32>> = params.iter().map(flat).collect::<Result<_, _>>()?;
        let grads = params
            .iter()
            .map(|p| e.zeros("grad", p.len()).map(Some).map_err(err))
            .collect::<Result<_, _>>()?;
        Ok(Chain { e, params, grads })
    }

    fn upload(&self, ids: &[usize]) -> Result<Vec<E::Buf>, String> {
        ids.iter()
            .map(|&i| self.e.upload("param", &self.params[i]).map_err(err))
            .collect()
    }

    fn take(&mut self, ids: &[usize]) -> Result<Vec<E::Buf>, String> {
        ids.iter()
            .map(|&i| {
                self.grads[i]
                    .take()
                    .ok_or_else(|| format!("param {i} twice in one unit"))
            })
            .collect()
    }

    fn put_back(&mut self, ids: &[usize], bufs: Vec<E::Buf>) {
        for (&i, b) in ids.iter().zip(bufs) {
            self.grads[i] = Some(b);
        }
    }

    /// One micro-batch through `model`'s units: forward unit by unit,
    /// each block's and the head's input saved on the host, then backward
    /// head first by recompute, as the engine runs them.
    /// `forward(unit, params, input)` gives a unit's output (the
    /// embedding's input is None; the head's forward is its input saved);
    /// `backward(unit, params, saved input, upstream gradient, grads)`
    /// adds into the unit's grads and gives its loss (the head's) and its
    /// input's gradient. Returns the loss.
    fn run(
        &mut self,
        model: &Model,
        mut forward: impl FnMut(&UnitSpec, &[E::Buf], Option<&E::Buf>) -> Result<E::Buf, String>,
        mut backward: impl FnMut(
            &UnitSpec,
            &[E::Buf],
            Stage<'_, E::Buf>,
            &mut [E::Buf],
        ) -> Result<Back<E::Buf>, String>,
    ) -> Result<f32, String> {
        let e = self.e;
        let units = model.units();
        let mut h: Option<E::Buf> = None;
        let mut saved: Vec<Vec<f32>> = vec![Vec::new(); units.len()];
        for u in units {
            if matches!(u.kind, UnitKind::Embedding) {
                h = Some(forward(u, &self.upload(&unit_ids(u))?, None)?);
                continue;
            }
            let x = input(&h)?;
            saved[u.id.0] = e.download(x).map_err(err)?;
            if matches!(u.kind, UnitKind::Block { .. }) {
                let out = forward(u, &self.upload(&unit_ids(u))?, Some(x))?;
                h = Some(out);
            }
        }
        let mut up: Option<E::Buf> = None;
        let mut loss = f32::NAN;
        for u in units.iter().rev() {
            let uid = unit_ids(u);
            let pu = self.upload(&uid)?;
            let mut g = self.take(&uid)?;
            let x = match u.kind {
                UnitKind::Embedding => None,
                _ => Some(e.upload("saved", &saved[u.id.0]).map_err(err)?),
            };
            let stage = Stage {
                x: x.as_ref(),
                up: up.as_ref(),
            };
            let back = backward(u, &pu, stage, &mut g)?;
            if let Some(l) = back.loss {
                loss = l;
            }
            up = back.dx;
            self.put_back(&uid, g);
        }
        Ok(loss)
    }

    /// Each param's gradient against `want`, by name.
    fn report(
        &self,
        model: &Model,
        loss: f32,
        want_loss: &Tensor,
        want: &[Tensor],
    ) -> Result<ChainReport, String> {
        let mut grads = Vec::new();
        for spec in model.params() {
            let g = self.grads[spec.id.0]
                .as_ref()
                .ok_or_else(|| format!("no gradient of {}", spec.name))?;
            let got = self.e.download(g).map_err(err)?;
            grads.push((spec.name.clone(), rel(&got, &flat(&want[spec.id.0])?)));
        }
        let want_loss = want_loss
            .to_dtype(DType::F32)
            .and_then(|t| t.to_scalar::<f32>())
            .map_err(err)?;
        Ok(ChainReport {
            loss,
            want_loss,
            grads,
        })
    }
}

/// A GPT-2 chain (`gpt2_config(tied)` of `model_support`, params of
/// `seeds.0` in `dtype`, the batch of salt `seeds.1`, 3 × 5 tokens) on `e`
/// against the candle units with the same params.
pub fn gpt2_chain<E: Exec>(
    e: &E,
    cfg: ModelConfig,
    dtype: DType,
    seeds: (u64, usize),
) -> Result<ChainReport, String> {
    let model = Model::new(cfg).map_err(err)?;
    let c = model.config().clone();
    let params = random_params(&model, seeds.0, dtype);
    let (b, t) = (3usize, 5usize);
    let (ids_t, targets_t) = batch(c.vocab_size, b, t, seeds.1);
    let (want_loss, want_grads) = per_unit_grads(&model, &params, &ids_t, &targets_t);

    let d = tierzero::model::exec_units::gpt2_dims(&c, (b, t));
    let mut ch = Chain::new(e, &params)?;
    let ids = e.ids(&ids_of(&ids_t)?, c.vocab_size).map_err(err)?;
    let targets = e.ids(&ids_of(&targets_t)?, c.vocab_size).map_err(err)?;
    let pos: Vec<i32> = (0..b * t).map(|i| (i % t) as i32).collect();
    let positions = e.ids(&pos, c.max_seq_len).map_err(err)?;

    let loss = ch.run(
        &model,
        |u, p, x| match (&u.kind, x) {
            (UnitKind::Embedding, _) => {
                unit::gpt2_embedding_forward(e, &d, p, &ids, &positions).map_err(err)
            }
            (_, Some(x)) => unit::gpt2_block_forward(e, &d, p, x).map_err(err),
            (_, None) => Err("a block without its input".into()),
        },
        |u, p, st, g| match u.kind {
            UnitKind::Head => {
                let ([p0, p1, p2], [g0, g1, g2]) = (p, g) else {
                    return Err(format!("the head has {} params, not 3", p.len()));
                };
                let (l, dx) =
                    unit::gpt2_head(e, &d, [p0, p1, p2], st.x()?, &targets, 1.0, [g0, g1, g2])
                        .map_err(err)?;
                let loss = Some(l.mean(e).map_err(err)?);
                Ok(Back { loss, dx: Some(dx) })
            }
            UnitKind::Block { .. } => {
                let dx = unit::gpt2_block_backward(e, &d, p, st.x()?, st.up()?, g).map_err(err)?;
                Ok(Back {
                    loss: None,
                    dx: Some(dx),
                })
            }
            UnitKind::Embedding => {
                unit::gpt2_embedding_backward(e, &d, st.up()?, &ids, &positions, g).map_err(err)?;
                Ok(Back {
                    loss: None,
                    dx: None,
                })
            }
        },
    )?;
    ch.report(&model, loss, &want_loss, &want_grads)
}

/// A Llama-family chain (`cfg`, fp32 params of seed 5, 2 × 5 tokens) on
/// `e` against the candle units.
pub fn llama_chain<E: Exec>(e: &E, cfg: ModelConfig) -> Result<ChainReport, String> {
    let model = Model::new(cfg).map_err(err)?;
    let c = model.config().clone();
    let params = random_params(&model, 5, DType::F32);
    let (b, t) = (2usize, 5usize);
    let (ids_t, targets_t) = batch(c.vocab_size, b, t, 1);
    let (want_loss, want_grads) = per_unit_grads(&model, &params, &ids_t, &targets_t);

    let d = tierzero::model::exec_units::llama_dims(&c, (b, t));
    // The CPU units' rotary tables are [t, head_dim] (both halves); the
    // kernel takes one half.
    let (cos, sin) =
        tierzero::model::ops::rope_tables_for(&c, t, DType::F32, &candle_core::Device::Cpu)
            .map_err(err)?;
    let half = |x: &Tensor| -> Result<Vec<f32>, String> {
        flat(
            &x.narrow(1, 0, c.head_dim / 2)
                .and_then(|x| x.contiguous())
                .map_err(err)?,
        )
    };
    let rope = RopeTables {
        cos: e.upload("rope cos", &half(&cos)?).map_err(err)?,
        sin: e.upload("rope sin", &half(&sin)?).map_err(err)?,
    };
    let mut ch = Chain::new(e, &params)?;
    let ids = e.ids(&ids_of(&ids_t)?, c.vocab_size).map_err(err)?;
    let targets = e.ids(&ids_of(&targets_t)?, c.vocab_size).map_err(err)?;
    let loss = ch.run(
        &model,
        |u, p, x| match (&u.kind, x) {
            (UnitKind::Embedding, _) => {
                let table = p.first().ok_or("the embedding has no params")?;
                unit::llama_embedding_forward(e, &d, table, &ids).map_err(err)
            }
            (_, Some(x)) => unit::llama_block_forward(e, &d, p, x, &rope).map_err(err),
            (_, None) => Err("a block without its input".into()),
        },
        |u, p, st, g| match u.kind {
            UnitKind::Head => {
                let ([p0, p1], [g0, g1]) = (p, g) else {
                    return Err(format!("the head has {} params, not 2", p.len()));
                };
                let (l, dx) = unit::llama_head(e, &d, [p0, p1], st.x()?, &targets, 1.0, [g0, g1])
                    .map_err(err)?;
                let loss = Some(l.mean(e).map_err(err)?);
                Ok(Back { loss, dx: Some(dx) })
            }
            UnitKind::Block { .. } => {
                let dx = unit::llama_block_backward(e, &d, p, st.x()?, st.up()?, g, &rope)
                    .map_err(err)?;
                Ok(Back {
                    loss: None,
                    dx: Some(dx),
                })
            }
            UnitKind::Embedding => {
                let g0 = g.first_mut().ok_or("the embedding has no params")?;
                unit::llama_embedding_backward(e, &d, st.up()?, &ids, g0).map_err(err)?;
                Ok(Back {
                    loss: None,
                    dx: None,
                })
            }
        },
    )?;
    ch.report(&model, loss, &want_loss, &want_grads)
}

/// The Llama-family configs the chain is checked on: Llama untied (GQA
/// 4/2) and tied, Qwen2 (q, k, v biases; MHA) and Qwen3 (q/k RMSNorm per
/// head, an explicit head_dim, GQA 4/1), by label.
pub fn llama_family() -> Result<Vec<(&'static str, ModelConfig)>, String> {
    let hf = |text: &str| ModelConfig::from_hf_json(text).map(|c| c.0).map_err(err);
    Ok(vec![
        (
            "llama untied (GQA 4/2)",
            super::model_support::llama_config(false),
        ),
        ("llama tied", super::model_support::llama_config(true)),
        (
            "qwen2 (qkv bias)",
            hf(
                r#"{"model_type":"qwen2","vocab_size":17,"hidden_size":16,"intermediate_size":24,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":4,
            "max_position_embeddings":8,"rope_theta":10000.0,"tie_word_embeddings":false}"#,
            )?,
        ),
        (
            "qwen3 (qk norm, GQA 4/1)",
            hf(
                r#"{"model_type":"qwen3","vocab_size":19,"hidden_size":16,"intermediate_size":24,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":1,"head_dim":6,
            "max_position_embeddings":8,"rope_theta":1000000.0,"tie_word_embeddings":true}"#,
            )?,
        ),
    ])
}

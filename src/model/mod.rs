//! Decoder-only transformer models (GPT-2 and the Llama family: Llama,
//! Mistral, Qwen2, Qwen3) cut into **units**, with
//! a per-unit backward by recompute. This is the compute side of ZeRO-3: the
//! engine owns every weight and hands each unit its parameters just before
//! the unit runs.
//!
//! # The unit contract
//!
//! A [`Model`] is a description, not a container: it holds the config, the
//! list of parameters ([`ParamSpec`]: HF name, shape, kind, init) and the list
//! of units ([`UnitSpec`]) in execution order:
//!
//! ```text
//! unit 0            : Embedding   params: wte (+ wpe for GPT-2)     in: token ids  out: hidden
//! unit 1 ..= n_layer: Block(i)    params: that layer's weights      in: hidden     out: hidden
//! unit n_layer + 1  : Head        params: final norm + lm head      in: hidden + targets  out: loss
//! ```
//!
//! No unit holds a weight. [`Model::forward_unit`] takes the unit's
//! parameters as a slice of candle `Tensor`s **in the order the unit
//! declares** ([`UnitSpec::params`]), checks count, shape, dtype and device,
//! and computes the output. The engine fetches those tensors from NVMe or
//! pinned memory just before the call and may drop them right after.
//!
//! A parameter can belong to several units: with tied embeddings the head
//! declares the token embedding again (`wte.weight` / `model.embed_tokens.weight`).
//! [`ParamSpec::units`] lists every unit that uses a parameter, so the engine
//! knows to keep it (or fetch it twice) and to sum its gradients over units.
//!
//! # Backward by recompute
//!
//! Forward keeps no graph: the engine saves only each unit's input (the
//! activation checkpoint at unit granularity). [`Model::backward_unit`] takes
//! the unit's params, the saved input and the upstream gradient, rebuilds the
//! params and the input as candle `Var`s (one copy each), recomputes the
//! forward, and backpropagates. The upstream gradient `g` of a unit output
//! `y` is injected as the scalar `sum(y * g)` (with `g` constant), whose
//! gradient with respect to `y` is exactly `g` (`1 * g` is exact in floating
//! point; [`fused::upstream_objective`] hands `g` on without computing the
//! products). The head starts from `d(loss) = loss_scale`, so the caller can fold
//! in micro-batch averaging (`1 / gradient_accumulation_steps`) or an fp16
//! loss scale. The result is the param grads (same order as declared) and the
//! input grad (none for the embedding, whose input is token ids).
//!
//! # Keep or recompute
//!
//! The engine may instead keep a unit's forward graph until its backward
//! (its activation policy, `crate::engine`): [`Model::record_unit`] runs
//! the forward on `Var` copies as the recompute would, returns the output
//! with its graph and says how many bytes that holds
//! ([`RecordedUnit::held_bytes`]); [`Model::backward_recorded`]
//! backpropagates from it. `backward_unit` is exactly `record_unit` then
//! `backward_recorded` on the saved input, so a kept unit's gradients are
//! the recomputed unit's, bit for bit (the forward is deterministic).
//!
//! Per-unit backward of the whole chain reproduces one full-graph backward:
//! `tests/model_grad.rs` measures the difference (see the report there; the
//! only non-identical tensor is a tied embedding, whose two contributions are
//! summed in a different order).
//!
//! # Why no candle_nn ops
//!
//! See [`ops`]: candle's fused norm and softmax kernels have no backward and
//! drop gradients silently. Training runs our own fused ops (`fused`), each
//! with a hand-written backward tested against the primitive composition
//! in [`ops`]; a finite-difference test in f64 guards the whole chain.
//!
//! # Weights on disk
//!
//! [`io`] reads HF-layout safetensors plus `config.json`, validates every
//! tensor's shape from the header before reading data, and initialises
//! deterministically from a seed when the directory has only `config.json`.
//! Canonical parameter names are the HF names (GPT-2 without the
//! `transformer.` prefix, which an untied GPT-2's file names carry:
//! [`Model::hf_file_name`]), and the canonical layout is the HF layout: GPT-2's
//! Conv1D weights stay `[in, out]` ([`ParamKind::Conv1dWeight`]), Llama's
//! `nn.Linear` weights stay `[out, in]`, so export writes tensors unchanged.
//!
//! # Devices and dtypes
//!
//! Every function takes tensors on whatever candle `Device` they live on;
//! nothing here assumes CPU. A unit's params, hidden input and hidden output
//! share one storage dtype; what each op computes in follows from it by the
//! policy of [`precision`] (with fp32 or f64 params, everything in that
//! dtype; with bf16 or fp16, 16-bit matmul operands and fp32 for the rest,
//! as `torch.autocast` does, and the head's loss in fp32). Small tables (causal
//! mask, rotary cos/sin) are built on the host and moved to the input's
//! device.

mod backward;
pub mod config;
mod error;
pub mod exec_units;
pub mod fused;
pub mod io;
pub mod ops;
pub mod precision;
mod units;

use candle_core::{DType, Device, Tensor};

use precision::Policy;

pub use backward::RecordedUnit;
pub use config::{Activation, Arch, Family, ModelConfig, RopeScaling, TokenIds, UnknownKeys};
pub use error::ModelError;
pub use io::{
    hf_config_text, hf_config_with_dtype, save_hf_dir, write_safetensors, ModelDir, ModelDirOptions,
};

/// Index of a parameter in [`Model::params`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ParamId(pub usize);

/// Index of a unit in [`Model::units`] (also its position in execution order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct UnitId(pub usize);

/// What a parameter is; decides its init and documents its layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParamKind {
    /// Token embedding `[vocab, hidden]`.
    TokenEmbedding,
    /// Learned position embedding `[max_seq_len, hidden]` (GPT-2).
    PositionEmbedding,
    /// HF Conv1D weight, layout `[in, out]`: `y = x W + b` (GPT-2).
    Conv1dWeight,
    /// `nn.Linear` weight, layout `[out, in]`: `y = x W^T` (Llama, untied lm_head).
    LinearWeight,
    /// A bias vector.
    Bias,
    /// A norm's scale (init 1).
    NormWeight,
    /// A norm's shift (init 0).
    NormBias,
}

/// How a parameter is initialised when there is no checkpoint.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Normal with mean 0 and this std.
    Normal {
        /// Standard deviation.
        std: f64,
    },
    /// All zeros.
    Zeros,
    /// All ones.
    Ones,
}

/// One parameter of the model.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    /// Its index in [`Model::params`].
    pub id: ParamId,
    /// HF name (GPT-2 without the `transformer.` prefix).
    pub name: String,
    /// Shape in HF layout.
    pub shape: Vec<usize>,
    /// Element count (checked product of `shape`).
    pub numel: usize,
    /// Kind (layout and init).
    pub kind: ParamKind,
    /// Init when there is no checkpoint.
    pub init: Init,
    /// Every unit that uses this parameter, in execution order (two units for
    /// a tied embedding).
    pub units: Vec<UnitId>,
}

/// The role of a unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UnitKind {
    /// Token (+ position) embedding; input token ids, output hidden.
    Embedding,
    /// Transformer block `layer`; hidden to hidden.
    Block {
        /// Layer index, from 0.
        layer: usize,
    },
    /// Final norm, LM head and loss; input hidden and targets, output loss.
    Head,
}

/// One unit of the model.
#[derive(Debug, Clone, PartialEq)]
pub struct UnitSpec {
    /// Its index (execution order).
    pub id: UnitId,
    /// Role.
    pub kind: UnitKind,
    /// Parameters in the order `forward_unit` / `backward_unit` expect them.
    pub params: Vec<ParamId>,
}

/// What a unit consumes.
#[derive(Debug, Clone, Copy)]
pub enum UnitInput<'a> {
    /// Embedding: token ids `[batch, seq]`, `u32`.
    Tokens(&'a Tensor),
    /// Block: hidden states `[batch, seq, hidden]`.
    Hidden(&'a Tensor),
    /// Head: hidden states and next-token targets `[batch, seq]`, `u32`.
    HiddenWithTargets {
        /// `[batch, seq, hidden]`.
        hidden: &'a Tensor,
        /// `[batch, seq]`, `u32`; `targets[b, s]` is the token after position `s`.
        targets: &'a Tensor,
    },
}

/// What a unit produces.
#[derive(Debug, Clone)]
pub enum UnitOutput {
    /// Embedding and blocks: `[batch, seq, hidden]`.
    Hidden(Tensor),
    /// Head: scalar mean next-token cross-entropy.
    Loss(Tensor),
}

impl UnitOutput {
    /// The tensor, whichever variant.
    pub fn tensor(&self) -> &Tensor {
        match self {
            UnitOutput::Hidden(t) | UnitOutput::Loss(t) => t,
        }
    }

    /// The tensor, whichever variant (by value).
    pub fn into_tensor(self) -> Tensor {
        match self {
            UnitOutput::Hidden(t) | UnitOutput::Loss(t) => t,
        }
    }
}

/// Where backward of a unit starts.
#[derive(Debug, Clone, Copy)]
pub enum Upstream<'a> {
    /// Gradient of the loss w.r.t. the unit's output (embedding, blocks).
    Grad(&'a Tensor),
    /// For the head: `d(loss)`; 1.0 for a plain gradient, `1/GAS` for
    /// micro-batch averaging, times the loss scale under fp16.
    LossScale(f64),
}

/// Gradients from [`Model::backward_unit`].
#[derive(Debug, Clone)]
pub struct UnitGrads {
    /// One gradient per declared parameter, in declared order.
    pub params: Vec<(ParamId, Tensor)>,
    /// Gradient w.r.t. the unit's hidden input; `None` for the embedding.
    pub input: Option<Tensor>,
    /// The recomputed loss (head only; unscaled), so the engine can run the
    /// head once per micro-batch instead of forward + backward.
    pub loss: Option<Tensor>,
}

/// A model description: config, parameters, units. Holds no weights.
#[derive(Debug, Clone)]
pub struct Model {
    config: ModelConfig,
    /// Special token ids, carried for the exported `config.json`.
    token_ids: TokenIds,
    params: Vec<ParamSpec>,
    units: Vec<UnitSpec>,
    by_name: std::collections::HashMap<String, ParamId>,
}

fn numel_of(name: &str, shape: &[usize]) -> Result<usize, ModelError> {
    shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| ModelError::SizeOverflow {
            what: format!("numel of `{name}` {shape:?}"),
        })
}

struct Builder {
    params: Vec<ParamSpec>,
    units: Vec<UnitSpec>,
    by_name: std::collections::HashMap<String, ParamId>,
}

impl Builder {
    fn unit(&mut self, kind: UnitKind) -> UnitId {
        let id = UnitId(self.units.len());
        self.units.push(UnitSpec {
            id,
            kind,
            params: Vec::new(),
        });
        id
    }

    /// Declares a new parameter used by `unit`.
    fn param(
        &mut self,
        unit: UnitId,
        name: String,
        shape: Vec<usize>,
        kind: ParamKind,
        init: Init,
    ) -> Result<(), ModelError> {
        let numel = numel_of(&name, &shape)?;
        let id = ParamId(self.params.len());
        self.by_name.insert(name.clone(), id);
        self.params.push(ParamSpec {
            id,
            name,
            shape,
            numel,
            kind,
            init,
            units: vec![unit],
        });
        self.units[unit.0].params.push(id);
        Ok(())
    }

    /// Declares that `unit` also uses the existing parameter `id`.
    fn share(&mut self, unit: UnitId, id: ParamId) {
        self.params[id.0].units.push(unit);
        self.units[unit.0].params.push(id);
    }
}

impl Model {
    /// Builds the description for `config` (validated again here).
    pub fn new(config: ModelConfig) -> Result<Self, ModelError> {
        config.validate()?;
        let mut b = Builder {
            params: Vec::new(),
            units: Vec::new(),
            by_name: std::collections::HashMap::new(),
        };
        let c = &config;
        let h = c.hidden_size;
        let std = c.initializer_range;
        // GPT-2 scales the init of residual output projections by
        // 1/sqrt(2 * n_layer) (two residual adds per block). We apply the
        // same to Llama's o_proj / down_proj (HF Llama does not).
        let resid_std = std / (2.0 * c.n_layer as f64).sqrt();
        let normal = Init::Normal { std };
        let resid = Init::Normal { std: resid_std };
        let q_out = c.n_head * c.head_dim;
        let kv_out = c.n_kv_head * c.head_dim;
        let inter = c.intermediate_size;
        let emb = b.unit(UnitKind::Embedding);
        let wte_name = match c.arch {
            Arch::Gpt2 => "wte.weight",
            Arch::Llama => "model.embed_tokens.weight",
        };
        b.param(
            emb,
            wte_name.into(),
            vec![c.vocab_size, h],
            ParamKind::TokenEmbedding,
            normal,
        )?;
        let wte = ParamId(0);
        if c.arch == Arch::Gpt2 {
            b.param(
                emb,
                "wpe.weight".into(),
                vec![c.max_seq_len, h],
                ParamKind::PositionEmbedding,
                normal,
            )?;
        }
        for layer in 0..c.n_layer {
            let u = b.unit(UnitKind::Block { layer });
            match c.arch {
                Arch::Gpt2 => {
                    let p = format!("h.{layer}.");
                    let list: [(&str, Vec<usize>, ParamKind, Init); 12] = [
                        ("ln_1.weight", vec![h], ParamKind::NormWeight, Init::Ones),
                        ("ln_1.bias", vec![h], ParamKind::NormBias, Init::Zeros),
                        (
                            "attn.c_attn.weight",
                            vec![h, 3 * h],
                            ParamKind::Conv1dWeight,
                            normal,
                        ),
                        (
                            "attn.c_attn.bias",
                            vec![3 * h],
                            ParamKind::Bias,
                            Init::Zeros,
                        ),
                        (
                            "attn.c_proj.weight",
                            vec![h, h],
                            ParamKind::Conv1dWeight,
                            resid,
                        ),
                        ("attn.c_proj.bias", vec![h], ParamKind::Bias, Init::Zeros),
                        ("ln_2.weight", vec![h], ParamKind::NormWeight, Init::Ones),
                        ("ln_2.bias", vec![h], ParamKind::NormBias, Init::Zeros),
                        (
                            "mlp.c_fc.weight",
                            vec![h, inter],
                            ParamKind::Conv1dWeight,
                            normal,
                        ),
                        ("mlp.c_fc.bias", vec![inter], ParamKind::Bias, Init::Zeros),
                        (
                            "mlp.c_proj.weight",
                            vec![inter, h],
                            ParamKind::Conv1dWeight,
                            resid,
                        ),
                        ("mlp.c_proj.bias", vec![h], ParamKind::Bias, Init::Zeros),
                    ];
                    for (n, shape, kind, init) in list {
                        b.param(u, format!("{p}{n}"), shape, kind, init)?;
                    }
                }
                Arch::Llama => {
                    // Declared order = the order `block` reads them; the
                    // optional tensors sit right after their weight, so a
                    // config without them keeps the plain Llama order.
                    let p = format!("model.layers.{layer}.");
                    let lin = ParamKind::LinearWeight;
                    let norm = |n: &str, d: usize| {
                        (n.to_owned(), vec![d], ParamKind::NormWeight, Init::Ones)
                    };
                    let bias =
                        |n: &str, d: usize| (n.to_owned(), vec![d], ParamKind::Bias, Init::Zeros);
                    let weight =
                        |n: &str, shape: Vec<usize>, init: Init| (n.to_owned(), shape, lin, init);
                    let mut list = vec![norm("input_layernorm.weight", h)];
                    for (n, out) in [("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)] {
                        list.push(weight(
                            &format!("self_attn.{n}.weight"),
                            vec![out, h],
                            normal,
                        ));
                        if c.qkv_bias {
                            list.push(bias(&format!("self_attn.{n}.bias"), out));
                        }
                    }
                    list.push(weight("self_attn.o_proj.weight", vec![h, q_out], resid));
                    if c.o_bias {
                        list.push(bias("self_attn.o_proj.bias", h));
                    }
                    if c.qk_norm {
                        list.push(norm("self_attn.q_norm.weight", c.head_dim));
                        list.push(norm("self_attn.k_norm.weight", c.head_dim));
                    }
                    list.push(norm("post_attention_layernorm.weight", h));
                    for (n, shape, init) in [
                        ("gate_proj", vec![inter, h], normal),
                        ("up_proj", vec![inter, h], normal),
                        ("down_proj", vec![h, inter], resid),
                    ] {
                        let out = shape[0];
                        list.push(weight(&format!("mlp.{n}.weight"), shape, init));
                        if c.mlp_bias {
                            list.push(bias(&format!("mlp.{n}.bias"), out));
                        }
                    }
                    for (n, shape, kind, init) in list {
                        b.param(u, format!("{p}{n}"), shape, kind, init)?;
                    }
                }
            }
        }
        let head = b.unit(UnitKind::Head);
        match c.arch {
            Arch::Gpt2 => {
                b.param(
                    head,
                    "ln_f.weight".into(),
                    vec![h],
                    ParamKind::NormWeight,
                    Init::Ones,
                )?;
                b.param(
                    head,
                    "ln_f.bias".into(),
                    vec![h],
                    ParamKind::NormBias,
                    Init::Zeros,
                )?;
            }
            Arch::Llama => {
                b.param(
                    head,
                    "model.norm.weight".into(),
                    vec![h],
                    ParamKind::NormWeight,
                    Init::Ones,
                )?;
            }
        }
        if c.tie_word_embeddings {
            b.share(head, wte);
        } else {
            b.param(
                head,
                "lm_head.weight".into(),
                vec![c.vocab_size, h],
                ParamKind::LinearWeight,
                normal,
            )?;
        }
        Ok(Model {
            config,
            token_ids: TokenIds::default(),
            params: b.params,
            units: b.units,
            by_name: b.by_name,
        })
    }

    /// The validated config.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// This model with the special token ids `ids` (see [`TokenIds`]).
    pub fn with_token_ids(mut self, ids: TokenIds) -> Self {
        self.token_ids = ids;
        self
    }

    /// The special token ids carried with the model.
    pub fn token_ids(&self) -> &TokenIds {
        &self.token_ids
    }

    /// The HF `config.json` object of this model: the config
    /// ([`ModelConfig::to_hf_value`]) and the special token ids.
    pub fn hf_config_value(&self) -> serde_json::Value {
        let mut v = self.config.to_hf_value();
        self.token_ids.add_to(&mut v);
        // GPT2Config fills an absent bos/eos_token_id with 50256 (GPT-2's
        // <|endoftext|>), which a smaller vocabulary lacks (transformers
        // warns, and generation stops at no token): null says there is none.
        const GPT2_END_OF_TEXT: usize = 50256;
        if let Some(obj) = v.as_object_mut() {
            if self.config.arch == Arch::Gpt2 && self.config.vocab_size <= GPT2_END_OF_TEXT {
                for key in ["bos_token_id", "eos_token_id"] {
                    obj.entry(key).or_insert(serde_json::Value::Null);
                }
            }
        }
        v
    }

    /// All parameters, each once, indexed by [`ParamId`].
    pub fn params(&self) -> &[ParamSpec] {
        &self.params
    }

    /// The params in HF's `named_parameters()` order (module registration
    /// order), the order DeepSpeed walks them in (its persistence rule):
    /// this model's own order, but in a Llama-family decoder layer, whose
    /// two norms HF registers after `self_attn` and `mlp` (here they come
    /// where the layer reads them, first and mid-way).
    pub fn params_in_hf_order(&self) -> Vec<ParamId> {
        const LAYER_NORMS: [&str; 2] =
            ["input_layernorm.weight", "post_attention_layernorm.weight"];
        let layer_of = |name: &str| -> Option<(usize, bool)> {
            let rest = name.strip_prefix("model.layers.")?;
            let (index, tail) = rest.split_once('.')?;
            Some((index.parse().ok()?, LAYER_NORMS.contains(&tail)))
        };
        let mut out = Vec::with_capacity(self.params.len());
        let mut norms: Vec<ParamId> = Vec::new();
        let mut current: Option<usize> = None;
        for p in &self.params {
            let layer = layer_of(&p.name);
            if layer.map(|l| l.0) != current {
                out.append(&mut norms);
                current = layer.map(|l| l.0);
            }
            match layer {
                Some((_, true)) => norms.push(p.id),
                _ => out.push(p.id),
            }
        }
        out.append(&mut norms);
        out
    }

    /// The name `p` is written under in an HF safetensors file: its
    /// canonical name, except for a GPT-2 with an untied head, whose body
    /// is written with the `transformer.` prefix (`GPT2LMHeadModel`'s
    /// state-dict names). transformers loads unprefixed names as a base
    /// model's file, and a base model's file that also holds
    /// `lm_head.weight` is refused as corrupted (transformers 4.x), so an
    /// untied file must name the body as the head model does. (A tied one
    /// holds no `lm_head.weight` and keeps the hub's unprefixed names.)
    pub fn hf_file_name<'a>(&self, p: &'a ParamSpec) -> std::borrow::Cow<'a, str> {
        let prefixed = self.config.arch == Arch::Gpt2
            && !self.config.tie_word_embeddings
            && p.name != "lm_head.weight";
        if prefixed {
            format!("transformer.{}", p.name).into()
        } else {
            p.name.as_str().into()
        }
    }

    /// One parameter.
    pub fn param(&self, id: ParamId) -> Option<&ParamSpec> {
        self.params.get(id.0)
    }

    /// Whether `id` belongs to one unit alone (not tied: a tied
    /// embedding's gradient spans two units). False for an unknown id.
    pub fn in_one_unit(&self, id: ParamId) -> bool {
        self.param(id).is_some_and(|p| p.units.len() == 1)
    }

    /// Looks a parameter up by its canonical (HF) name.
    pub fn param_by_name(&self, name: &str) -> Option<&ParamSpec> {
        self.by_name.get(name).and_then(|id| self.params.get(id.0))
    }

    /// Units in execution order.
    pub fn units(&self) -> &[UnitSpec] {
        &self.units
    }

    /// One unit.
    pub fn unit(&self, id: UnitId) -> Result<&UnitSpec, ModelError> {
        self.units.get(id.0).ok_or(ModelError::NoSuchUnit {
            unit: id,
            n_units: self.units.len(),
        })
    }

    /// Total parameter count (shared parameters counted once).
    pub fn numel(&self) -> usize {
        // Cannot overflow in practice (each numel fits and there are few);
        // saturate rather than panic.
        self.params
            .iter()
            .fold(0usize, |acc, p| acc.saturating_add(p.numel))
    }

    /// The most elements of one unit's params.
    pub fn largest_unit_numel(&self) -> u64 {
        self.units
            .iter()
            .map(|u| {
                u.params
                    .iter()
                    .filter_map(|id| self.params.get(id.0))
                    .map(|p| p.numel as u64)
                    .sum::<u64>()
            })
            .max()
            .unwrap_or(0)
    }

    /// Picks `unit`'s parameters, in declared order, out of a dense list
    /// indexed by [`ParamId`] (convenience for tests and stage 0).
    pub fn unit_params(&self, unit: UnitId, all: &[Tensor]) -> Result<Vec<Tensor>, ModelError> {
        let spec = self.unit(unit)?;
        spec.params
            .iter()
            .map(|id| {
                all.get(id.0).cloned().ok_or(ModelError::ParamCount {
                    unit,
                    expected: self.params.len(),
                    found: all.len(),
                })
            })
            .collect()
    }

    /// Checks a unit's params: count, shapes, one float dtype, one device.
    fn check_params(&self, unit: &UnitSpec, params: &[Tensor]) -> Result<DType, ModelError> {
        if params.len() != unit.params.len() {
            return Err(ModelError::ParamCount {
                unit: unit.id,
                expected: unit.params.len(),
                found: params.len(),
            });
        }
        let mut dtype = None;
        let mut device: Option<&Device> = None;
        for (id, t) in unit.params.iter().zip(params) {
            let spec = &self.params[id.0];
            if t.dims() != spec.shape.as_slice() {
                return Err(ModelError::ShapeMismatch {
                    name: spec.name.clone(),
                    expected: spec.shape.clone(),
                    found: t.dims().to_vec(),
                });
            }
            if !t.dtype().is_float() || dtype.is_some_and(|d| d != t.dtype()) {
                return Err(ModelError::BadInput {
                    unit: unit.id,
                    reason: format!(
                        "param `{}` has dtype {:?}; all params of a unit must share one float dtype",
                        spec.name,
                        t.dtype()
                    ),
                });
            }
            dtype = Some(t.dtype());
            if let Some(d) = device {
                if !d.same_device(t.device()) {
                    return Err(ModelError::BadInput {
                        unit: unit.id,
                        reason: format!("param `{}` is on another device", spec.name),
                    });
                }
            }
            device = Some(t.device());
        }
        dtype.ok_or_else(|| ModelError::BadInput {
            unit: unit.id,
            reason: "unit has no params".into(),
        })
    }

    fn check_tokens(&self, unit: UnitId, ids: &Tensor, what: &str) -> Result<(), ModelError> {
        let bad = |reason: String| ModelError::BadInput { unit, reason };
        if ids.dtype() != DType::U32 {
            return Err(bad(format!("{what} must be u32, got {:?}", ids.dtype())));
        }
        let (b, t) = ids
            .dims2()
            .map_err(|_| bad(format!("{what} must be [batch, seq], got {:?}", ids.dims())))?;
        if b == 0 || t == 0 {
            return Err(bad(format!("{what} is empty: {:?}", ids.dims())));
        }
        if t > self.config.max_seq_len {
            return Err(bad(format!(
                "sequence length {t} exceeds max_seq_len {}",
                self.config.max_seq_len
            )));
        }
        let max_id = ids.flatten_all()?.max(0)?.to_scalar::<u32>()?;
        if max_id as usize >= self.config.vocab_size {
            return Err(bad(format!(
                "{what} contain id {max_id} >= vocab_size {}",
                self.config.vocab_size
            )));
        }
        Ok(())
    }

    fn check_hidden(&self, unit: UnitId, x: &Tensor, dtype: DType) -> Result<(), ModelError> {
        let bad = |reason: String| ModelError::BadInput { unit, reason };
        let (b, t, h) = x.dims3().map_err(|_| {
            bad(format!(
                "hidden must be [batch, seq, hidden], got {:?}",
                x.dims()
            ))
        })?;
        if h != self.config.hidden_size || b == 0 || t == 0 {
            return Err(bad(format!(
                "hidden shape {:?}, expected [batch, seq, {}]",
                x.dims(),
                self.config.hidden_size
            )));
        }
        if t > self.config.max_seq_len {
            return Err(bad(format!(
                "sequence length {t} exceeds max_seq_len {}",
                self.config.max_seq_len
            )));
        }
        if x.dtype() != dtype {
            return Err(bad(format!(
                "hidden dtype {:?} differs from params dtype {dtype:?}",
                x.dtype()
            )));
        }
        Ok(())
    }

    /// Validates inputs and runs the unit's math (no validation inside).
    fn run_unit(
        &self,
        unit: &UnitSpec,
        params: &[Tensor],
        input: UnitInput<'_>,
    ) -> Result<UnitOutput, ModelError> {
        let dtype = self.check_params(unit, params)?;
        let wrong = |expected: &str| ModelError::BadInput {
            unit: unit.id,
            reason: format!("expected {expected} input"),
        };
        match (unit.kind, input) {
            (UnitKind::Embedding, UnitInput::Tokens(ids)) => {
                self.check_tokens(unit.id, ids, "token ids")?;
                Ok(UnitOutput::Hidden(self.embed(params, ids)?))
            }
            (UnitKind::Embedding, _) => Err(wrong("Tokens")),
            (UnitKind::Block { .. }, UnitInput::Hidden(x)) => {
                self.check_hidden(unit.id, x, dtype)?;
                Ok(UnitOutput::Hidden(self.block(params, x)?))
            }
            (UnitKind::Block { .. }, _) => Err(wrong("Hidden")),
            (UnitKind::Head, UnitInput::HiddenWithTargets { hidden, targets }) => {
                self.check_hidden(unit.id, hidden, dtype)?;
                self.check_tokens(unit.id, targets, "targets")?;
                let (b, t, _) = hidden.dims3()?;
                if targets.dims() != [b, t] {
                    return Err(ModelError::BadInput {
                        unit: unit.id,
                        reason: format!(
                            "targets shape {:?} must be [{b}, {t}] to match hidden",
                            targets.dims()
                        ),
                    });
                }
                let logits = self.logits_unchecked(params, hidden)?;
                let flat = logits.reshape((b * t, self.config.vocab_size))?;
                let loss = Policy::new(dtype).cross_entropy(&flat, &targets.flatten_all()?)?;
                Ok(UnitOutput::Loss(loss))
            }
            (UnitKind::Head, _) => Err(wrong("HiddenWithTargets")),
        }
    }

    /// Forward of one unit with its params (declared order). Keeps no graph
    /// unless the params are `Var`s.
    pub fn forward_unit(
        &self,
        unit: UnitId,
        params: &[Tensor],
        input: UnitInput<'_>,
    ) -> Result<UnitOutput, ModelError> {
        let spec = self.unit(unit)?;
        self.run_unit(spec, params, input)
    }

    /// Whole-model forward, unit by unit, with `all` indexed by [`ParamId`].
    /// With `Var` params this builds one full graph (used to check the
    /// per-unit backward); with plain tensors it is an inference pass.
    pub fn forward_full(
        &self,
        all: &[Tensor],
        ids: &Tensor,
        targets: &Tensor,
    ) -> Result<Tensor, ModelError> {
        let mut hidden: Option<Tensor> = None;
        for unit in &self.units {
            let params = self.unit_params(unit.id, all)?;
            let input = match (unit.kind, &hidden) {
                (UnitKind::Embedding, _) => UnitInput::Tokens(ids),
                (UnitKind::Block { .. }, Some(h)) => UnitInput::Hidden(h),
                (UnitKind::Head, Some(h)) => UnitInput::HiddenWithTargets { hidden: h, targets },
                (_, None) => {
                    return Err(ModelError::BadInput {
                        unit: unit.id,
                        reason: "no hidden state: model has no embedding unit".into(),
                    })
                }
            };
            match self.run_unit(unit, &params, input)? {
                UnitOutput::Hidden(h) => hidden = Some(h),
                UnitOutput::Loss(l) => return Ok(l),
            }
        }
        Err(ModelError::Unsupported {
            what: "model without a head unit".into(),
        })
    }
}

//! Loading and saving models in the HF layout: `config.json` plus
//! safetensors, or `config.json` alone for a model initialised from a seed.
//!
//! Design:
//! - **Header first, data on demand.** [`ModelDir::open`] reads only the
//!   safetensors headers (8-byte length + JSON), maps every tensor name to a
//!   canonical parameter, and checks dtype and shape against the config before
//!   any data is read. [`ModelDir::load_param`] then reads one tensor with a
//!   positioned read. The engine can thus stream a checkpoint larger than
//!   host memory into its tiers one parameter at a time. No mmap: the main
//!   crate denies `unsafe`.
//! - **Never panic on a bad file.** Header length, JSON, offsets (validated by
//!   the `safetensors` crate's `Metadata`, which checks contiguity and
//!   `numel * dtype_size` with checked arithmetic), total file size, dtypes
//!   and shapes are all checked and reported as [`ModelError`] naming the file
//!   or tensor, with expected and found shapes.
//! - **Names.** Canonical names are the HF names; GPT-2 checkpoints are
//!   accepted with or without the `transformer.` prefix. Known buffers that
//!   are not parameters (GPT-2 `attn.bias` / `attn.masked_bias`, Llama
//!   `rotary_emb.inv_freq`, and a redundant `lm_head.weight` next to tied
//!   embeddings) are skipped; other unknown tensors are warned about and
//!   listed by [`ModelDir::ignored_tensors`].
//! - **Layout.** Tensors keep the HF layout (GPT-2 Conv1D `[in, out]`), so
//!   [`save_hf_dir`] writes them back unchanged and a round trip is exact.
//! - **Deterministic init.** Without weights, each parameter is drawn from its
//!   own generator seeded by `(seed, parameter name)` (SplitMix64 + Box-Muller,
//!   sampled in f64, stored as f32, then cast), so a parameter's initial value
//!   does not depend on which other parameters were initialised first or on
//!   the device: the engine can initialise lazily, shard by shard. Values are
//!   as in GPT-2: normal(0, `initializer_range`) for matrices and embeddings,
//!   residual output projections scaled by `1/sqrt(2 n_layer)`, biases 0,
//!   norm weights 1.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use safetensors::tensor::Metadata;
use safetensors::Dtype as StDtype;

use super::{
    Arch, Init, Model, ModelConfig, ModelError, ParamId, ParamSpec, TokenIds, UnknownKeys,
};

/// Largest safetensors header we accept (the `safetensors` crate's limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

#[derive(Debug, Clone)]
struct TensorLoc {
    file: usize,
    /// Name as stored in the file.
    stored_name: String,
    dtype: DType,
    shape: Vec<usize>,
    offset_bytes: u64,
    len_bytes: usize,
}

#[derive(Debug)]
enum Source {
    /// Only `config.json`: parameters come from the seeded init.
    Init,
    /// Safetensors files; one location per parameter.
    Files {
        files: Vec<PathBuf>,
        locs: HashMap<ParamId, TensorLoc>,
        ignored: Vec<String>,
    },
}

/// An opened HF model directory (config + validated tensor index).
#[derive(Debug)]
pub struct ModelDir {
    path: PathBuf,
    model: Model,
    unknown_config_keys: Vec<String>,
    seed: u64,
    source: Source,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The text of a model directory's JSON file: a regular file of at most
/// [`MAX_JSON_BYTES`] (a link to `/dev/zero` was read until memory ran
/// out), UTF-8.
fn read_json_text(path: &Path) -> Result<String, ModelError> {
    crate::durable::read_regular_text(path, MAX_JSON_BYTES).map_err(io_err(path))
}

/// The largest model `config.json` or safetensors index read.
pub const MAX_JSON_BYTES: u64 = 64 << 20;

fn bad_file(path: &Path, reason: impl Into<String>) -> ModelError {
    ModelError::BadSafetensors {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Reads and validates a safetensors header. Returns the byte offset where
/// tensor data begins and the metadata.
fn read_header(path: &Path) -> Result<(u64, Metadata), ModelError> {
    let mut f = File::open(path).map_err(io_err(path))?;
    let file_len_bytes = f.metadata().map_err(io_err(path))?.len();
    if file_len_bytes < 8 {
        return Err(bad_file(
            path,
            format!("file is {file_len_bytes} bytes, shorter than the 8-byte header length"),
        ));
    }
    let mut len_buf = [0u8; 8];
    f.read_exact(&mut len_buf).map_err(io_err(path))?;
    let header_bytes = u64::from_le_bytes(len_buf);
    if header_bytes > MAX_HEADER_BYTES {
        return Err(bad_file(
            path,
            format!("header length {header_bytes} exceeds {MAX_HEADER_BYTES}"),
        ));
    }
    let data_start = 8 + header_bytes;
    if data_start > file_len_bytes {
        return Err(bad_file(
            path,
            format!(
                "header length {header_bytes} runs past the end of the {file_len_bytes}-byte file"
            ),
        ));
    }
    let mut header = vec![0u8; header_bytes as usize];
    f.read_exact(&mut header).map_err(io_err(path))?;
    let metadata: Metadata = serde_json::from_slice(&header)
        .map_err(|e| bad_file(path, format!("invalid header: {e}")))?;
    let data_len_bytes = metadata.data_len() as u64;
    let expected_len = data_start
        .checked_add(data_len_bytes)
        .ok_or_else(|| bad_file(path, "data length overflows"))?;
    if expected_len != file_len_bytes {
        return Err(bad_file(
            path,
            format!("header describes {expected_len} bytes but the file has {file_len_bytes}"),
        ));
    }
    Ok((data_start, metadata))
}

fn candle_dtype(name: &str, dt: StDtype) -> Result<DType, ModelError> {
    match dt {
        StDtype::F16 => Ok(DType::F16),
        StDtype::BF16 => Ok(DType::BF16),
        StDtype::F32 => Ok(DType::F32),
        StDtype::F64 => Ok(DType::F64),
        other => Err(ModelError::UnsupportedDtype {
            name: name.to_string(),
            dtype: format!("{other:?}"),
        }),
    }
}

/// A tied model (`tie_word_embeddings: true`) whose files also hold an
/// `lm_head.weight`: where its values differ from the token embedding's,
/// transformers does not tie them (it loads both, with a warning), so
/// tying here would train another model than the one `from_pretrained`
/// loads: refused, naming both fixes. (It was dropped without a word.)
/// Equal values, the usual case of a tied save that kept both, are the
/// tie. Stored in another dtype than the embedding, the values are
/// compared widened to f64 (exact for every float dtype a file holds):
/// a bf16 head of half the embedding was tied with a warning, where
/// transformers loads both. Another element count is refused too.
fn check_tied_head(
    model: &Model,
    files: &[PathBuf],
    locs: &HashMap<ParamId, TensorLoc>,
    head: &TensorLoc,
) -> Result<(), ModelError> {
    use std::os::unix::fs::FileExt as _;
    let Some(embed) = model
        .params()
        .iter()
        .find(|p| matches!(p.kind, crate::model::ParamKind::TokenEmbedding))
    else {
        return Ok(());
    };
    // The embedding read from the head itself (a tied pair stored as the
    // head alone): nothing to compare, and no second read of it.
    let Some(e) = locs
        .get(&embed.id)
        .filter(|e| (e.file, e.offset_bytes) != (head.file, head.offset_bytes))
    else {
        return Ok(());
    };
    let head_path = &files[head.file];
    let (head_dt, head_len, head_offset) = (head.dtype, head.len_bytes, head.offset_bytes);
    let (hsize, esize) = (head_dt.size_in_bytes(), e.dtype.size_in_bytes());
    let untied = |what: &str| {
        bad_file(
            head_path,
            format!(
                "holds an lm_head.weight with {what} than `{}`, and config.json says \
                 tie_word_embeddings: true; transformers then does not tie them (it loads \
                 both): set \"tie_word_embeddings\": false in config.json to train that \
                 model, or remove lm_head.weight from the file to tie the head to the \
                 embedding",
                e.stored_name
            ),
        )
    };
    if head_len / hsize != e.len_bytes / esize {
        return Err(untied("another number of elements"));
    }
    let open = |p: &Path| std::fs::File::open(p).map_err(io_err(p));
    let (hf, ef) = (open(head_path)?, open(&files[e.file])?);
    // Whole elements of both per chunk.
    let chunk_numel = (8usize << 20) / hsize.max(esize);
    let (mut a, mut b) = (
        vec![0u8; chunk_numel * hsize],
        vec![0u8; chunk_numel * esize],
    );
    let numel = head_len / hsize;
    let mut done = 0usize;
    while done < numel {
        let n = chunk_numel.min(numel - done);
        let (a, b) = (&mut a[..n * hsize], &mut b[..n * esize]);
        hf.read_exact_at(a, head_offset + (done * hsize) as u64)
            .map_err(io_err(head_path))?;
        ef.read_exact_at(b, e.offset_bytes + (done * esize) as u64)
            .map_err(io_err(&files[e.file]))?;
        let same = if head_dt == e.dtype {
            a == b
        } else {
            let (x, y) = (widened(a, head_dt), widened(b, e.dtype));
            // Equal as numbers; a NaN in both at one place is the same
            // (it equals nothing, itself included).
            x.iter()
                .zip(&y)
                .all(|(p, q)| p == q || (p.is_nan() && q.is_nan()))
        };
        if !same {
            return Err(untied("other values"));
        }
        done += n;
    }
    Ok(())
}

/// Little-endian floats of `dt` widened to f64 (exact for f16, bf16, f32).
fn widened(bytes: &[u8], dt: DType) -> Vec<f64> {
    match dt {
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
            .collect(),
        _ => bytes
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect(),
    }
}

/// Whether a stored tensor that is not a parameter is a known non-parameter.
fn is_known_buffer(arch: Arch, canonical: &str, tied: bool) -> bool {
    let layer_suffix = |s: &str, prefix: &str, suffix: &str| {
        s.strip_prefix(prefix)
            .and_then(|r| r.strip_suffix(suffix))
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    match arch {
        Arch::Gpt2 => {
            layer_suffix(canonical, "h.", ".attn.bias")
                || layer_suffix(canonical, "h.", ".attn.masked_bias")
                || (tied && canonical == "lm_head.weight")
        }
        Arch::Llama => {
            layer_suffix(canonical, "model.layers.", ".self_attn.rotary_emb.inv_freq")
                || (tied && canonical == "lm_head.weight")
        }
    }
}

/// The weight files of a directory, as `from_pretrained` picks them:
/// `model.safetensors` (beside it, another export or an adapter is not
/// the model's), else those named by `model.safetensors.index.json`, else
/// every `*.safetensors`, sorted.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = read_json_text(&index)?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| bad_file(&index, format!("invalid index JSON: {e}")))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| bad_file(&index, "no weight_map object"))?;
        let mut files: Vec<PathBuf> = Vec::new();
        for file in map.values() {
            let name = file
                .as_str()
                .ok_or_else(|| bad_file(&index, "weight_map value is not a string"))?;
            // Only plain file names inside the directory.
            if name.contains('/') || name.contains('\\') || name == ".." {
                return Err(bad_file(
                    &index,
                    format!("file name {name:?} leaves the directory"),
                ));
            }
            let p = dir.join(name);
            if !files.contains(&p) {
                files.push(p);
            }
        }
        if files.is_empty() {
            // Not "no weights, so a seeded init": the index says there are.
            return Err(bad_file(
                &index,
                "weight_map is empty: it names no weight file",
            ));
        }
        files.sort();
        return Ok(files);
    }
    let mut files = Vec::new();
    let mut foreign = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        let p = entry.path();
        if p.extension().is_some_and(|e| e == "safetensors") {
            files.push(p);
        } else if is_foreign_weight_file(&p) {
            foreign.push(p);
        }
    }
    if files.is_empty() && !foreign.is_empty() {
        // Without this, the directory would train from the seeded init
        // while transformers loads these weights.
        foreign.sort();
        let names: Vec<String> = foreign
            .iter()
            .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect();
        return Err(ModelError::ForeignWeights {
            dir: dir.to_path_buf(),
            files: names.join(", "),
        });
    }
    files.sort();
    Ok(files)
}

/// Whether `p` is a weight file of a format other than safetensors that a
/// HF directory may hold (PyTorch pickles, TensorFlow, Flax, and the
/// original Llama releases' `consolidated.*.pth`).
fn is_foreign_weight_file(p: &Path) -> bool {
    let Some(name) = p.file_name().and_then(|n| n.to_str()) else {
        return false;
    };
    let ext = p.extension().and_then(|e| e.to_str()).unwrap_or("");
    (name.starts_with("pytorch_model") && ext == "bin")
        || matches!(ext, "pt" | "pth" | "ckpt")
        || matches!(name, "tf_model.h5" | "flax_model.msgpack")
}

/// How [`ModelDir::open_with`] reads a model directory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelDirOptions {
    /// What to do with a `config.json` key that is neither read nor known
    /// to be harmless: refuse (the default) or warn and ignore
    /// (`--allow-unknown-model-keys`, at the user's risk).
    pub unknown_keys: UnknownKeys,
}

impl ModelDir {
    /// Opens `dir`: reads `config.json`, indexes and validates the safetensors
    /// headers (no tensor data read). `seed` is used only when the directory
    /// holds no weights. An unknown `config.json` key is an error
    /// ([`ModelDir::open_with`] can allow it).
    pub fn open(dir: impl AsRef<Path>, seed: u64) -> Result<Self, ModelError> {
        Self::open_with(dir, seed, ModelDirOptions::default())
    }

    /// [`ModelDir::open`] with options.
    pub fn open_with(
        dir: impl AsRef<Path>,
        seed: u64,
        options: ModelDirOptions,
    ) -> Result<Self, ModelError> {
        let dir = dir.as_ref();
        let cfg_path = dir.join("config.json");
        let text = read_json_text(&cfg_path)?;
        let value: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| ModelError::ConfigJson {
                reason: e.to_string(),
            })?;
        let (config, unknown_config_keys) =
            ModelConfig::from_hf_value_with(&value, options.unknown_keys)?;
        let model = Model::new(config)?.with_token_ids(TokenIds::from_hf_value(&value));
        let files = weight_files(dir)?;
        let source = if files.is_empty() {
            Source::Init
        } else {
            Self::index(&model, files)?
        };
        Ok(ModelDir {
            path: dir.to_path_buf(),
            model,
            unknown_config_keys,
            seed,
            source,
        })
    }

    fn index(model: &Model, files: Vec<PathBuf>) -> Result<Source, ModelError> {
        let arch = model.config().arch;
        let tied = model.config().tie_word_embeddings;
        let mut locs: HashMap<ParamId, TensorLoc> = HashMap::new();
        let mut ignored = Vec::new();
        // A tied model's stored `lm_head.weight` (see `check_tied_head`).
        let mut tied_head: Option<TensorLoc> = None;
        for (file_idx, path) in files.iter().enumerate() {
            let (data_start, metadata) = read_header(path)?;
            let mut names: Vec<(String, &safetensors::tensor::TensorInfo)> =
                metadata.tensors().into_iter().collect();
            names.sort_by_key(|(_, info)| info.data_offsets);
            for (stored_name, info) in names {
                // A base model's save (`GPT2Model`, `LlamaModel`) has its
                // names without the causal LM's prefix; transformers adds
                // it when loading, as here.
                let prefixed;
                let canonical = match arch {
                    Arch::Gpt2 => stored_name
                        .strip_prefix("transformer.")
                        .unwrap_or(&stored_name),
                    Arch::Llama if model.param_by_name(&stored_name).is_none() => {
                        prefixed = format!("model.{stored_name}");
                        if model.param_by_name(&prefixed).is_some() {
                            prefixed.as_str()
                        } else {
                            stored_name.as_str()
                        }
                    }
                    Arch::Llama => stored_name.as_str(),
                };
                let Some(spec) = model.param_by_name(canonical) else {
                    if tied && canonical == "lm_head.weight" {
                        let (start, end) = info.data_offsets;
                        let offset_bytes =
                            data_start.checked_add(start as u64).ok_or_else(|| {
                                bad_file(path, format!("offset of `{stored_name}` overflows"))
                            })?;
                        tied_head = Some(TensorLoc {
                            file: file_idx,
                            stored_name: stored_name.clone(),
                            dtype: candle_dtype(&stored_name, info.dtype)?,
                            shape: info.shape.clone(),
                            offset_bytes,
                            len_bytes: end - start,
                        });
                    }
                    if !is_known_buffer(arch, canonical, tied) {
                        tracing::warn!(tensor = %stored_name, file = %path.display(), "checkpoint tensor is not a model parameter; ignored");
                        ignored.push(stored_name.clone());
                    }
                    continue;
                };
                let dtype = candle_dtype(&stored_name, info.dtype)?;
                if info.shape != spec.shape {
                    return Err(ModelError::ShapeMismatch {
                        name: stored_name.clone(),
                        expected: spec.shape.clone(),
                        found: info.shape.clone(),
                    });
                }
                let (start, end) = info.data_offsets;
                let offset_bytes = data_start.checked_add(start as u64).ok_or_else(|| {
                    bad_file(path, format!("offset of `{stored_name}` overflows"))
                })?;
                // Metadata validated end - start == numel * dtype size.
                let len_bytes = end - start;
                let loc = TensorLoc {
                    file: file_idx,
                    stored_name: stored_name.clone(),
                    dtype,
                    shape: info.shape.clone(),
                    offset_bytes,
                    len_bytes,
                };
                if let Some(first) = locs.insert(spec.id, loc) {
                    return Err(ModelError::DuplicateTensor {
                        name: spec.name.clone(),
                        files: format!(
                            "as `{}` in {} and as `{stored_name}` in {}",
                            first.stored_name,
                            files[first.file].display(),
                            path.display()
                        ),
                    });
                }
            }
        }
        // A tied pair stored as `lm_head.weight` alone (transformers ties
        // in either direction, and loads it): the embedding is read from
        // it. It was refused as a missing embedding.
        if let Some(head) = &tied_head {
            let embed = model
                .params()
                .iter()
                .find(|p| matches!(p.kind, crate::model::ParamKind::TokenEmbedding));
            if let Some(embed) = embed.filter(|p| !locs.contains_key(&p.id)) {
                if head.shape != embed.shape {
                    return Err(ModelError::ShapeMismatch {
                        name: head.stored_name.clone(),
                        expected: embed.shape.clone(),
                        found: head.shape.clone(),
                    });
                }
                locs.insert(embed.id, head.clone());
            }
        }
        if let Some(missing) = model.params().iter().find(|p| !locs.contains_key(&p.id)) {
            return Err(ModelError::MissingTensor {
                name: missing.name.clone(),
                hint: match ignored.first() {
                    None => String::new(),
                    Some(first) => format!(
                        "; {} of its tensors are no parameter of this {} model (e.g. `{first}`): \
                         is it this model's checkpoint?",
                        ignored.len(),
                        model.config().family.name()
                    ),
                },
            });
        }
        if let Some(head) = &tied_head {
            check_tied_head(model, &files, &locs, head)?;
        }
        Ok(Source::Files {
            files,
            locs,
            ignored,
        })
    }

    /// The model description.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// This directory's model with the special token ids `ids` (see
    /// [`super::TokenIds`]): what its checkpoints and exports carry.
    pub fn with_token_ids(mut self, ids: super::TokenIds) -> Self {
        self.model = self.model.with_token_ids(ids);
        self
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The seed of the init of a directory without weights (given to
    /// [`ModelDir::open`]; unused where there are weights).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Whether parameters come from files (else from the seeded init).
    pub fn has_weights(&self) -> bool {
        matches!(self.source, Source::Files { .. })
    }

    /// Unknown `config.json` keys that were ignored (only with
    /// [`UnknownKeys::Allow`]).
    pub fn unknown_config_keys(&self) -> &[String] {
        &self.unknown_config_keys
    }

    /// Checkpoint tensors that are not parameters and not known buffers.
    pub fn ignored_tensors(&self) -> &[String] {
        match &self.source {
            Source::Init => &[],
            Source::Files { ignored, .. } => ignored,
        }
    }

    /// Loads (or initialises) one parameter as `dtype` on `device`.
    pub fn load_param(
        &self,
        id: ParamId,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor, ModelError> {
        let spec = self
            .model
            .param(id)
            .ok_or_else(|| ModelError::MissingTensor {
                hint: String::new(),
                name: format!("{id:?}"),
            })?;
        match &self.source {
            Source::Init => init_param(spec, self.seed, dtype, device),
            Source::Files { files, locs, .. } => {
                let loc = locs.get(&id).ok_or_else(|| ModelError::MissingTensor {
                    hint: String::new(),
                    name: spec.name.clone(),
                })?;
                let path = &files[loc.file];
                let f = File::open(path).map_err(io_err(path))?;
                let mut bytes = vec![0u8; loc.len_bytes];
                f.read_exact_at(&mut bytes, loc.offset_bytes)
                    .map_err(io_err(path))?;
                let t = Tensor::from_raw_buffer(&bytes, loc.dtype, &loc.shape, &Device::Cpu)
                    .map_err(|e| bad_file(path, format!("tensor `{}`: {e}", loc.stored_name)))?;
                Ok(t.to_dtype(dtype)?.to_device(device)?)
            }
        }
    }

    /// Loads every parameter, indexed by [`ParamId`] (small models, tests).
    pub fn load_all(&self, dtype: DType, device: &Device) -> Result<Vec<Tensor>, ModelError> {
        self.model
            .params()
            .iter()
            .map(|p| self.load_param(p.id, dtype, device))
            .collect()
    }
}

/// SplitMix64: a tiny, well-mixed, portable 64-bit generator (also the
/// crate's deterministic test-data source).
#[derive(Debug, Clone)]
pub(crate) struct SplitMix64(pub(crate) u64);

impl SplitMix64 {
    /// What each draw adds to the state.
    const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(Self::GAMMA);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1]: 53 random bits, never 0 (safe for `ln`).
    fn next_open01(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Pairs of [`normal_values`] a task draws.
const NORMAL_TASK_PAIRS: usize = 1 << 15;

/// `numel` normal values of standard deviation `std`, by Box-Muller over a
/// SplitMix64 stream from `state`: each pair of elements from the next two
/// draws, cosine then sine (the last element of an odd count: cosine
/// only).
///
/// In parallel, with the same values: a SplitMix64 stream's state after
/// `k` draws is `state + k × gamma`, so a task starting at pair `p` starts
/// its stream at `2p` draws in. An 850M-param Llama spent 42 s starting
/// on an H200 machine's host, most of it in this loop on one core.
fn normal_values(state: u64, std: f64, numel: usize) -> Vec<f32> {
    use rayon::prelude::*;
    let mut v = vec![0f32; numel];
    v.par_chunks_mut(2 * NORMAL_TASK_PAIRS)
        .enumerate()
        .for_each(|(task, out)| {
            let draws = (2 * task * NORMAL_TASK_PAIRS) as u64;
            let mut rng = SplitMix64(state.wrapping_add(draws.wrapping_mul(SplitMix64::GAMMA)));
            for pair in out.chunks_mut(2) {
                let r = (-2.0 * rng.next_open01().ln()).sqrt();
                let theta = std::f64::consts::TAU * rng.next_open01();
                pair[0] = (std * r * theta.cos()) as f32;
                if let Some(second) = pair.get_mut(1) {
                    *second = (std * r * theta.sin()) as f32;
                }
            }
        });
    v
}

fn fnv1a64(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

/// Initialises one parameter deterministically from `(seed, name)`.
pub fn init_param(
    spec: &ParamSpec,
    seed: u64,
    dtype: DType,
    device: &Device,
) -> Result<Tensor, ModelError> {
    let t = match spec.init {
        Init::Zeros => Tensor::zeros(spec.shape.as_slice(), dtype, device)?,
        Init::Ones => Tensor::ones(spec.shape.as_slice(), dtype, device)?,
        Init::Normal { std } => {
            let v = normal_values(seed ^ fnv1a64(&spec.name), std, spec.numel);
            Tensor::from_vec(v, spec.shape.as_slice(), &Device::Cpu)?
                .to_dtype(dtype)?
                .to_device(device)?
        }
    };
    Ok(t)
}

/// Writes `config.json` and `model.safetensors` in HF layout under `dir`.
/// Tensors come from `fetch` one at a time (in [`ParamId`] order), are
/// converted to `dtype` and streamed to the file, so the whole model never
/// needs to be in memory. Each file is written atomically
/// ([`crate::durable`]: a temporary file, fsync, rename, fsync of the
/// directory).
pub fn save_hf_dir(
    dir: impl AsRef<Path>,
    model: &Model,
    dtype: DType,
    fetch: impl FnMut(ParamId) -> Result<Tensor, ModelError>,
) -> Result<(), ModelError> {
    let dir = dir.as_ref();
    crate::durable::create_dir_all(dir)?;
    crate::durable::write_atomic(
        &dir.join("config.json"),
        hf_config_text(model, dtype)?.as_bytes(),
    )?;
    crate::durable::write_atomic_streamed(&dir.join("model.safetensors"), |file, tmp| {
        write_safetensors(file, tmp, model, dtype, fetch)
    })?;
    Ok(())
}

/// The HF `config.json` text of `model` beside its weights stored as
/// `dtype` (pretty JSON): [`Model::hf_config_value`] and `torch_dtype`,
/// which `save_pretrained` always writes and `from_pretrained(...,
/// torch_dtype="auto")`, vLLM and others read for the weights' dtype
/// (absent, they take float32).
pub fn hf_config_text(model: &Model, dtype: DType) -> Result<String, ModelError> {
    serde_json::to_string_pretty(&hf_config_with_dtype(model, dtype)).map_err(|e| {
        ModelError::ConfigJson {
            reason: e.to_string(),
        }
    })
}

/// [`Model::hf_config_value`] with `torch_dtype` set to `dtype`'s torch
/// name.
pub fn hf_config_with_dtype(model: &Model, dtype: DType) -> serde_json::Value {
    let mut v = model.hf_config_value();
    let name = match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::F64 => "float64",
        _ => "float32",
    };
    v["torch_dtype"] = serde_json::Value::from(name);
    v
}

/// Streams a safetensors file of every parameter of `model` (HF names and
/// layout, in [`ParamId`] order) as `dtype` into `file`, one tensor at a
/// time from `fetch`; returns the file (flushed, not synced). `path` names
/// the file in errors.
pub fn write_safetensors(
    file: File,
    path: &Path,
    model: &Model,
    dtype: DType,
    mut fetch: impl FnMut(ParamId) -> Result<Tensor, ModelError>,
) -> Result<File, ModelError> {
    let st_dtype = StDtype::from(dtype);
    let elem_bytes = dtype.size_in_bytes();
    let mut header = serde_json::Map::new();
    // torch's `save_file` writes this; transformers up to 4.46 reads
    // `metadata.get("format")` with no check for none (an AttributeError
    // on a file without it).
    header.insert(
        "__metadata__".to_owned(),
        serde_json::json!({ "format": "pt" }),
    );
    let mut offset_bytes = 0usize;
    for p in model.params() {
        let len = p
            .numel
            .checked_mul(elem_bytes)
            .ok_or_else(|| ModelError::SizeOverflow {
                what: format!("bytes of `{}`", p.name),
            })?;
        let end = offset_bytes
            .checked_add(len)
            .ok_or_else(|| ModelError::SizeOverflow {
                what: "safetensors data length".into(),
            })?;
        header.insert(
            model.hf_file_name(p).into_owned(),
            serde_json::json!({
                "dtype": st_dtype,
                "shape": p.shape,
                "data_offsets": [offset_bytes, end],
            }),
        );
        offset_bytes = end;
    }
    let mut header_bytes = serde_json::to_vec(&serde_json::Value::Object(header)).map_err(|e| {
        ModelError::ConfigJson {
            reason: e.to_string(),
        }
    })?;
    // Pad to 8 bytes (as the safetensors crate does) so data is aligned.
    while header_bytes.len() % 8 != 0 {
        header_bytes.push(b' ');
    }
    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
    w.write_all(&(header_bytes.len() as u64).to_le_bytes())
        .map_err(io_err(path))?;
    w.write_all(&header_bytes).map_err(io_err(path))?;
    for p in model.params() {
        let t = fetch(p.id)?;
        if t.dims() != p.shape.as_slice() {
            return Err(ModelError::ShapeMismatch {
                name: p.name.clone(),
                expected: p.shape.clone(),
                found: t.dims().to_vec(),
            });
        }
        let out = t.to_dtype(dtype)?;
        let data = safetensors::View::data(&out);
        if let Some(index) = first_non_finite(&data, dtype) {
            let value = t
                .flatten_all()?
                .get(index)?
                .to_dtype(DType::F32)?
                .to_scalar::<f32>()?;
            return Err(ModelError::NotRepresentable {
                name: model.hf_file_name(p).into_owned(),
                index,
                value,
                dtype: match dtype {
                    DType::F16 => "fp16",
                    DType::BF16 => "bf16",
                    _ => "fp32",
                },
            });
        }
        w.write_all(&data).map_err(io_err(path))?;
    }
    w.into_inner().map_err(|e| ModelError::Io {
        path: path.to_path_buf(),
        source: e.into_error(),
    })
}

/// The index of the first element of `data` (little-endian `dtype`
/// values) that is not finite: an infinity or a NaN, whose exponent bits
/// are all ones. Other dtypes: none.
fn first_non_finite(data: &[u8], dtype: DType) -> Option<usize> {
    match dtype {
        DType::F16 => data
            .chunks_exact(2)
            .position(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7c00 == 0x7c00),
        DType::BF16 => data
            .chunks_exact(2)
            .position(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7f80 == 0x7f80),
        DType::F32 => data.chunks_exact(4).position(|b| {
            u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & 0x7f80_0000 == 0x7f80_0000
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    /// Infinities and NaNs are found at their index in each float dtype;
    /// the largest finite values are not.
    #[test]
    fn non_finite_elements_are_found_in_each_dtype() {
        let bytes = |v: &[f32], dt: DType| {
            let t = Tensor::from_slice(v, v.len(), &candle_core::Device::Cpu).unwrap();
            safetensors::View::data(&t.to_dtype(dt).unwrap()).into_owned()
        };
        for dt in [DType::F16, DType::BF16, DType::F32] {
            assert_eq!(first_non_finite(&bytes(&[1.0, -2.0, 0.0], dt), dt), None);
            assert_eq!(
                first_non_finite(&bytes(&[1.0, f32::NAN, 0.0], dt), dt),
                Some(1)
            );
            assert_eq!(
                first_non_finite(&bytes(&[0.5, 1.0, f32::NEG_INFINITY], dt), dt),
                Some(2)
            );
        }
        assert_eq!(
            first_non_finite(&bytes(&[65504.0, -65504.0], DType::F16), DType::F16),
            None
        );
        assert_eq!(
            first_non_finite(&bytes(&[1.0, 70000.0], DType::F16), DType::F16),
            Some(1)
        );
        assert_eq!(
            first_non_finite(&bytes(&[3e38, 70000.0], DType::BF16), DType::BF16),
            None
        );
    }

    #[test]
    fn normal_values_in_parallel_are_the_one_stream_drawn_in_order() {
        // The values as one thread drew them before the split.
        let sequential = |state: u64, std: f64, numel: usize| {
            let mut rng = SplitMix64(state);
            let mut v: Vec<f32> = Vec::with_capacity(numel);
            while v.len() < numel {
                let r = (-2.0 * rng.next_open01().ln()).sqrt();
                let theta = std::f64::consts::TAU * rng.next_open01();
                v.push((std * r * theta.cos()) as f32);
                if v.len() < numel {
                    v.push((std * r * theta.sin()) as f32);
                }
            }
            v
        };
        let task = 2 * NORMAL_TASK_PAIRS;
        for (state, numel) in [
            (0u64, 0usize),
            (1, 1),
            (u64::MAX - 3, 7),
            (0x1234_5678, task),
            (42, task + 1),
            (7, 3 * task - 1),
            (9, 2 * task + 5),
        ] {
            let want: Vec<u32> = sequential(state, 0.02, numel)
                .iter()
                .map(|x| x.to_bits())
                .collect();
            let got: Vec<u32> = normal_values(state, 0.02, numel)
                .iter()
                .map(|x| x.to_bits())
                .collect();
            assert_eq!(got, want, "state {state}, {numel} elements");
        }
    }

    #[test]
    fn splitmix_normal_moments() {
        let spec = ParamSpec {
            id: ParamId(0),
            name: "x".into(),
            shape: vec![20001],
            numel: 20001,
            kind: super::super::ParamKind::LinearWeight,
            init: Init::Normal { std: 0.5 },
            units: vec![],
        };
        let t = init_param(&spec, 7, DType::F64, &Device::Cpu).unwrap();
        let v = t.to_vec1::<f64>().unwrap();
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.02, "{mean}");
        assert!((var.sqrt() - 0.5).abs() < 0.02, "{}", var.sqrt());
        let again = init_param(&spec, 7, DType::F64, &Device::Cpu).unwrap();
        assert_eq!(again.to_vec1::<f64>().unwrap(), v);
        let other = init_param(&spec, 8, DType::F64, &Device::Cpu).unwrap();
        assert_ne!(other.to_vec1::<f64>().unwrap(), v);
    }

    #[test]
    fn weights_tierzero_cannot_read_are_refused_not_replaced_by_an_init() {
        let d = tempfile::tempdir().unwrap();
        let cfg = r#"{"model_type": "gpt2", "vocab_size": 256, "n_embd": 16, "n_layer": 1,
            "n_head": 2, "n_positions": 32}"#;
        std::fs::write(d.path().join("config.json"), cfg).unwrap();
        // config.json alone: the seeded init.
        assert!(ModelDir::open(d.path(), 1).is_ok());
        std::fs::write(d.path().join("pytorch_model.bin"), b"not read").unwrap();
        match ModelDir::open(d.path(), 1) {
            Err(ModelError::ForeignWeights { files, .. }) => {
                assert_eq!(files, "pytorch_model.bin")
            }
            other => panic!("{other:?}"),
        }
        std::fs::write(
            d.path().join("model.safetensors.index.json"),
            r#"{"metadata": {}, "weight_map": {}}"#,
        )
        .unwrap();
        let e = ModelDir::open(d.path(), 1).unwrap_err().to_string();
        assert!(e.contains("weight_map is empty"), "{e}");
    }

    #[test]
    fn known_buffers() {
        assert!(is_known_buffer(Arch::Gpt2, "h.11.attn.bias", true));
        assert!(is_known_buffer(Arch::Gpt2, "h.0.attn.masked_bias", false));
        assert!(!is_known_buffer(Arch::Gpt2, "h..attn.bias", true));
        assert!(!is_known_buffer(Arch::Gpt2, "lm_head.weight", false));
        assert!(is_known_buffer(
            Arch::Llama,
            "model.layers.3.self_attn.rotary_emb.inv_freq",
            false
        ));
    }
}

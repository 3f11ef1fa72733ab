//! The manifest (`manifest.json`): types and the checks that run before any
//! data is read. See the module above for the format.

use std::collections::BTreeMap;
use std::path::{Component, Path};

use serde::{Deserialize, Serialize};

use super::CheckpointError;
use crate::model::{Model, ModelConfig};
use crate::optim::schedule::LossScalerState;

/// `format` of every manifest.
pub const FORMAT_NAME: &str = "tierzero-checkpoint";
/// The version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Name of the manifest in a step dir.
pub const MANIFEST_FILE: &str = "manifest.json";
/// Alignment of sub-group regions in the state files.
pub const STATE_ALIGN_BYTES: u64 = 4096;
/// Largest manifest we read (a manifest lists params, not data).
pub const MAX_MANIFEST_BYTES: u64 = 256 << 20;

/// One of the three per-element optimizer states.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StateKind {
    /// fp32 master weights.
    Master,
    /// Adam first moment (`exp_avg`).
    ExpAvg,
    /// Adam second moment (`exp_avg_sq`).
    ExpAvgSq,
}

impl StateKind {
    /// All three, in file order.
    pub const ALL: [StateKind; 3] = [StateKind::Master, StateKind::ExpAvg, StateKind::ExpAvgSq];

    /// The state's name (and its file's stem).
    pub fn name(self) -> &'static str {
        match self {
            StateKind::Master => "master",
            StateKind::ExpAvg => "exp_avg",
            StateKind::ExpAvgSq => "exp_avg_sq",
        }
    }

    /// Index in [`StateKind::ALL`] (and in the optimizer's extents).
    pub fn index(self) -> usize {
        match self {
            StateKind::Master => 0,
            StateKind::ExpAvg => 1,
            StateKind::ExpAvgSq => 2,
        }
    }
}

/// Where the data stream stood.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataPosition {
    /// Name of the data (a path or "embedded ...").
    pub source: String,
    /// Global samples consumed: where the data continue on resume
    /// (`steps × GAS × ranks × micro batch` while the global batch never
    /// changed; a resume with another adds its own steps' to the count it
    /// resumed from).
    pub samples_consumed: u64,
    /// Micro-batch size per rank (of the run that saved).
    pub micro_batch_size: u64,
    /// Gradient accumulation steps (of the run that saved).
    pub gradient_accumulation_steps: u64,
    /// Tokens of the data (of the run that saved): a resume on data of
    /// another length (the same path rewritten, another tokenizer or
    /// format) is warned about, since a sample's tokens move with it.
    /// Absent in checkpoints written before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    /// crc32c of the data's ids ([`crate::data::TokenData::ids_crc32c`]):
    /// a resume on data of the same length but other ids (the text edited
    /// in place) is warned about too. Absent in checkpoints written
    /// before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ids_crc32c: Option<u32>,
    /// The order each pass read its windows in. Absent in checkpoints
    /// written before the shuffle, which read them in file order
    /// ([`DataPosition::order_or_file`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order: Option<crate::data::DataOrder>,
}

impl DataPosition {
    /// The data order of the run that saved: file order where the
    /// checkpoint predates the record.
    pub fn order_or_file(&self) -> crate::data::DataOrder {
        self.order.unwrap_or(crate::data::DataOrder::Sequential)
    }
}

/// What the training config was, to warn when a resumed run differs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigFingerprint {
    /// The settings that change the numbers (batch, clipping, precision,
    /// optimizer, scheduler, sub-group size), each as text.
    pub numerics: BTreeMap<String, String>,
    /// sha256 of the whole resolved config's text (paths and I/O included).
    pub full_sha256: String,
}

/// One parameter's shard in a sub-group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamEntry {
    /// HF name.
    pub name: String,
    /// Elements of the whole parameter.
    pub numel: u64,
    /// First element of this shard in the whole parameter.
    pub shard_start: u64,
    /// Elements in this shard.
    pub shard_numel: u64,
    /// Offset of the shard in its sub-group, in elements.
    pub offset_in_group: u64,
}

/// One sub-group's region in the state files.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubGroupEntry {
    /// Elements.
    pub numel: u64,
    /// Start of the region in each state file (multiple of 4096).
    pub offset_bytes: u64,
    /// Length of the region (numel × 4 rounded up to 4096).
    pub len_bytes: u64,
    /// Shards in it.
    pub params: Vec<ParamEntry>,
}

/// One rank's files and layout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankLayout {
    /// The rank.
    pub rank: usize,
    /// Relative path of each state file, by [`StateKind::name`].
    pub states: BTreeMap<String, String>,
    /// Sub-groups in order.
    pub sub_groups: Vec<SubGroupEntry>,
}

/// crc32c of one region of a file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionCrc {
    /// Start.
    pub offset_bytes: u64,
    /// Length.
    pub len_bytes: u64,
    /// crc32c of the bytes.
    pub crc32c: u32,
}

/// One file of the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Relative to the step dir.
    pub path: String,
    /// Length.
    pub bytes: u64,
    /// crc32c of the whole file.
    pub crc32c: u32,
    /// Per sub-group crcs (state files), in order; empty for other files.
    #[serde(default)]
    pub regions: Vec<RegionCrc>,
}

/// The consolidated 16-bit HF weights, when saved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HfWeights {
    /// safetensors file.
    pub safetensors: String,
    /// config.json.
    pub config: String,
    /// "bf16", "fp16" or "fp32".
    pub dtype: String,
}

/// The largest step a manifest may hold (2^48: a step a microsecond
/// for nine years); a resume counts on from it without overflow.
const MAX_STEP: u64 = 1 << 48;

/// The largest `data.samples_consumed` (2^62): the data's sample indices
/// go on from it without overflow.
const MAX_SAMPLES: u64 = 1 << 62;

/// `manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT_NAME`].
    pub format: String,
    /// [`FORMAT_VERSION`] when written by this build.
    pub version: u32,
    /// Optimizer steps done (including skipped ones).
    pub step: u64,
    /// Adam steps taken (not skipped).
    pub adam_steps: u64,
    /// Steps skipped for gradients not finite (fp16's overflow, bf16's check).
    pub skipped_steps: u64,
    /// fp16 loss scaler; `null` for fp32/bf16.
    pub loss_scaler: Option<LossScalerState>,
    /// Seed of the model init.
    pub seed: u64,
    /// Tokens per sample.
    pub seq_len: usize,
    /// The step the run that saved was to end at (`tierzero train
    /// --steps`, or the config's `total_num_steps`): a resume that names no
    /// length runs to it. Absent for a trainer that did not say (the
    /// library, the Python package) and in checkpoints written before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_steps: Option<u64>,
    /// Data position.
    pub data: DataPosition,
    /// "fp32", "bf16" or "fp16".
    pub precision: String,
    /// Ranks that wrote it.
    pub world_size: usize,
    /// The model's HF `config.json`.
    pub model: serde_json::Value,
    /// The training config's fingerprint.
    pub config: ConfigFingerprint,
    /// Per rank, in rank order.
    pub ranks: Vec<RankLayout>,
    /// Consolidated 16-bit weights, if saved.
    #[serde(default)]
    pub hf_weights: Option<HfWeights>,
    /// Every file (not the manifest itself).
    pub files: Vec<FileEntry>,
    /// The runs whose steps led here, oldest first; the last saved it.
    /// Tells which older step dirs of a save dir are this checkpoint's
    /// history and which belong to a run abandoned when another resumed
    /// from an older step ([`Manifest::descends_from`]). Empty in
    /// checkpoints written before 2026-12-07.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lineage: Vec<LineageEntry>,
}

/// One run of a checkpoint's history ([`Manifest::lineage`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LineageEntry {
    /// The run's id (random, made when its trainer was built).
    pub run: String,
    /// The step it began at: 0, or the step of the checkpoint it resumed
    /// from.
    pub from_step: u64,
}

impl LineageEntry {
    /// A new run's entry, beginning at `from_step`, with a fresh id.
    pub fn new_run(from_step: u64) -> LineageEntry {
        use std::hash::{BuildHasher as _, Hasher as _};
        // std's per-process random keys, and the clock and pid besides.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        LineageEntry {
            run: format!("{:016x}", h.finish()),
            from_step,
        }
    }
}

fn bad(path: &Path, reason: impl Into<String>) -> CheckpointError {
    CheckpointError::Manifest {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Checks a relative path from the manifest before it is joined to the
/// checkpoint directory: relative, only normal components, UTF-8 already.
pub fn check_relative(path: &str) -> Result<(), CheckpointError> {
    let escape = |reason: &str| CheckpointError::PathEscape {
        path: path.to_owned(),
        reason: reason.to_owned(),
    };
    if path.is_empty() {
        return Err(escape("is empty"));
    }
    if path.contains('\0') {
        return Err(escape("contains a NUL byte"));
    }
    let p = Path::new(path);
    if p.is_absolute() {
        return Err(escape("is absolute"));
    }
    // Segment by segment on the text too: `components()` hides a `.` in
    // the middle and a doubled `/`; only plain names are allowed.
    for seg in path.split('/') {
        match seg {
            "" => return Err(escape("has an empty segment (`//` or a trailing `/`)")),
            "." => return Err(escape("contains `.`")),
            ".." => return Err(escape("contains `..`")),
            _ => {}
        }
    }
    for c in p.components() {
        match c {
            Component::Normal(_) => {}
            Component::ParentDir => return Err(escape("contains `..`")),
            Component::CurDir => return Err(escape("contains `.`")),
            Component::RootDir | Component::Prefix(_) => return Err(escape("is absolute")),
        }
    }
    Ok(())
}

/// Resolves `rel` under `dir` and checks that, with symlinks resolved, it is
/// still inside `dir` (which must be canonical).
pub fn resolve_inside(dir: &Path, rel: &str) -> Result<std::path::PathBuf, CheckpointError> {
    check_relative(rel)?;
    let joined = dir.join(rel);
    let real = joined
        .canonicalize()
        .map_err(super::io_err("resolving", &joined))?;
    if !real.starts_with(dir) {
        return Err(CheckpointError::PathEscape {
            path: rel.to_owned(),
            reason: format!(
                "resolves through a symlink to {}, outside the checkpoint directory",
                real.display()
            ),
        });
    }
    Ok(real)
}

/// The manifest's own checksum: a top-level string of 8 hex digits, the
/// crc32c of the file's bytes with those 8 digits replaced by `0`s. Over
/// the raw bytes (not a re-serialisation), so no float has to round-trip;
/// required, so a flip in the key itself is caught too.
pub const MANIFEST_CRC_KEY: &str = "manifest_crc32c";

/// Byte range of the crc's 8 hex digits in `text`, if the key occurs
/// exactly once as a key (`"manifest_crc32c"` followed by `:` and `"`).
fn crc_digits_range(text: &[u8]) -> Option<std::ops::Range<usize>> {
    let key = format!("\"{MANIFEST_CRC_KEY}\"");
    let key = key.as_bytes();
    let mut found = None;
    let mut i = 0;
    while let Some(at) = text[i..].windows(key.len()).position(|w| w == key) {
        let mut j = i + at + key.len();
        while text.get(j).is_some_and(u8::is_ascii_whitespace) {
            j += 1;
        }
        if text.get(j) == Some(&b':') {
            j += 1;
            while text.get(j).is_some_and(u8::is_ascii_whitespace) {
                j += 1;
            }
            if text.get(j) == Some(&b'"') {
                if found.is_some() {
                    return None;
                }
                found = Some(j + 1..j + 9);
            }
        }
        i += at + key.len();
    }
    found.filter(|r| r.end <= text.len())
}

/// Serialises a manifest value with its [`MANIFEST_CRC_KEY`] filled in (an
/// existing one is replaced). [`Manifest::to_json_bytes`] uses it; tests
/// use it to write a deliberately altered manifest that still verifies.
pub fn seal_manifest_value(mut v: serde_json::Value) -> Result<Vec<u8>, String> {
    let obj = v
        .as_object_mut()
        .ok_or_else(|| "a manifest is a JSON object".to_owned())?;
    obj.insert(MANIFEST_CRC_KEY.to_owned(), "00000000".into());
    let mut text = serde_json::to_vec_pretty(&v).map_err(|e| e.to_string())?;
    let r = crc_digits_range(&text).ok_or_else(|| "manifest crc field not found".to_owned())?;
    let crc = crc32c::crc32c(&text);
    text[r].copy_from_slice(format!("{crc:08x}").as_bytes());
    Ok(text)
}

impl Manifest {
    /// Whether `older`, a checkpoint of an earlier step, is in this one's
    /// history: the run that saved it is the one this lineage says made
    /// step `older.step` (the last run that began before it). `None` when
    /// either has no lineage (written before it was recorded).
    pub fn descends_from(&self, older: &Manifest) -> Option<bool> {
        let saver = older.lineage.last()?;
        let maker = self
            .lineage
            .iter()
            .rev()
            .find(|e| e.from_step < older.step)?;
        Some(maker.run == saver.run)
    }

    /// The manifest file's bytes (pretty JSON with its own crc32c).
    pub fn to_json_bytes(&self, path: &Path) -> Result<Vec<u8>, CheckpointError> {
        serde_json::to_value(self)
            .map_err(|e| e.to_string())
            .and_then(seal_manifest_value)
            .map_err(|e| bad(path, format!("serialising: {e}")))
    }

    /// Parses manifest text (`path` names it in errors), checking its
    /// crc32c ([`MANIFEST_CRC_KEY`]) before trusting any value in it.
    pub fn parse(text: &str, path: &Path) -> Result<Manifest, CheckpointError> {
        let mut v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| bad(path, format!("not valid JSON: {e}")))?;
        let format = v.get("format").and_then(|f| f.as_str()).unwrap_or("");
        if format != FORMAT_NAME {
            return Err(bad(
                path,
                format!("`format` is {format:?}, expected {FORMAT_NAME:?}"),
            ));
        }
        let version = v.get("version").and_then(|f| f.as_u64()).unwrap_or(0);
        if version != u64::from(FORMAT_VERSION) {
            return Err(CheckpointError::Version {
                path: path.to_path_buf(),
                version,
                reads: FORMAT_VERSION,
                by: if version > u64::from(FORMAT_VERSION) {
                    " (written by a newer tierzero)"
                } else {
                    ""
                },
            });
        }
        let recorded = v
            .as_object_mut()
            .and_then(|o| o.remove(MANIFEST_CRC_KEY))
            .ok_or_else(|| {
                bad(
                    path,
                    format!("has no `{MANIFEST_CRC_KEY}` (damaged, or written before it existed)"),
                )
            })?;
        let expected_crc = recorded
            .as_str()
            .filter(|h| h.len() == 8)
            .and_then(|h| u32::from_str_radix(h, 16).ok())
            .ok_or_else(|| {
                bad(
                    path,
                    format!("`{MANIFEST_CRC_KEY}` is {recorded}, not 8 hex digits"),
                )
            })?;
        let mut bytes = text.as_bytes().to_vec();
        let r = crc_digits_range(&bytes).ok_or_else(|| {
            bad(
                path,
                format!("`{MANIFEST_CRC_KEY}` must occur exactly once, as a key"),
            )
        })?;
        bytes[r].fill(b'0');
        let got_crc = crc32c::crc32c(&bytes);
        if got_crc != expected_crc {
            return Err(CheckpointError::Corrupt {
                part: "manifest".to_owned(),
                path: path.to_path_buf(),
                expected_crc,
                got_crc,
            });
        }
        serde_json::from_value(v).map_err(|e| bad(path, format!("{e}")))
    }

    /// The model described by the manifest.
    pub fn build_model(&self, path: &Path) -> Result<Model, CheckpointError> {
        let (cfg, _unknown) = ModelConfig::from_hf_value(&self.model)
            .map_err(|e| bad(path, format!("model config: {e}")))?;
        let token_ids = crate::model::TokenIds::from_hf_value(&self.model);
        // Every layer has parameters and every parameter is listed in the
        // manifest, so a model with more layers than the manifest has
        // parameter entries cannot be this checkpoint's; refusing it here
        // keeps a forged layer count from building a huge model.
        let entries: usize = self
            .ranks
            .iter()
            .flat_map(|r| &r.sub_groups)
            .map(|g| g.params.len())
            .sum();
        if cfg.n_layer > entries {
            return Err(bad(
                path,
                format!(
                    "model config: {} layers, but the manifest lists only {entries} parameter \
                     shards",
                    cfg.n_layer
                ),
            ));
        }
        Model::new(cfg)
            .map(|m| m.with_token_ids(token_ids))
            .map_err(|e| bad(path, format!("model config: {e}")))
    }

    /// The entry of file `rel`.
    pub fn file(&self, rel: &str) -> Option<&FileEntry> {
        self.files.iter().find(|f| f.path == rel)
    }

    /// Structural checks that need no file access: paths, region bounds
    /// (checked arithmetic), and that every parameter of `model` is covered
    /// exactly once by the shards of all ranks.
    pub fn validate(&self, model: &Model, path: &Path) -> Result<(), CheckpointError> {
        for f in &self.files {
            check_relative(&f.path)?;
        }
        // The counters a resume adds to: a forged or damaged value (whose
        // manifest crc was resealed) failed mid-run on an overflow, as an
        // internal error.
        if self.step > MAX_STEP || self.adam_steps > self.step || self.skipped_steps > self.step {
            return Err(bad(
                path,
                format!(
                    "step {}, adam_steps {}, skipped_steps {}: the step is at most {MAX_STEP} \
                     and counts the others",
                    self.step, self.adam_steps, self.skipped_steps
                ),
            ));
        }
        if self.data.samples_consumed > MAX_SAMPLES {
            return Err(bad(
                path,
                format!(
                    "data.samples_consumed {} is beyond {MAX_SAMPLES}",
                    self.data.samples_consumed
                ),
            ));
        }
        if self.world_size == 0 || self.ranks.len() != self.world_size {
            return Err(bad(
                path,
                format!(
                    "world_size {} but {} rank layouts",
                    self.world_size,
                    self.ranks.len()
                ),
            ));
        }
        // Each parameter's shards, as element ranges: they must tile it.
        let mut covered: Vec<Vec<(u64, u64)>> = vec![Vec::new(); model.params().len()];
        for (r, rank) in self.ranks.iter().enumerate() {
            if rank.rank != r {
                return Err(bad(
                    path,
                    format!("rank layout {r} says rank {}", rank.rank),
                ));
            }
            let mut files = Vec::new();
            for kind in StateKind::ALL {
                let rel = rank.states.get(kind.name()).ok_or_else(|| {
                    bad(path, format!("rank {r} has no {} state file", kind.name()))
                })?;
                check_relative(rel)?;
                let entry = self.file(rel).ok_or_else(|| {
                    bad(path, format!("state file {rel} is not in the file list"))
                })?;
                if entry.regions.len() != rank.sub_groups.len() {
                    return Err(bad(
                        path,
                        format!(
                            "{rel} has {} region crcs for {} sub-groups",
                            entry.regions.len(),
                            rank.sub_groups.len()
                        ),
                    ));
                }
                files.push(entry);
            }
            let mut next = 0u64;
            for (i, g) in rank.sub_groups.iter().enumerate() {
                let need = g
                    .numel
                    .checked_mul(4)
                    .and_then(super::align_state_bytes)
                    .ok_or_else(|| bad(path, format!("rank {r} sub-group {i}: size overflows")))?;
                if g.offset_bytes % STATE_ALIGN_BYTES != 0
                    || g.len_bytes != need
                    || g.offset_bytes < next
                {
                    return Err(bad(
                        path,
                        format!(
                            "rank {r} sub-group {i}: region {}+{} is misplaced (need a \
                             4096-aligned, non-overlapping region of {need} bytes)",
                            g.offset_bytes, g.len_bytes
                        ),
                    ));
                }
                let end = g
                    .offset_bytes
                    .checked_add(g.len_bytes)
                    .ok_or_else(|| bad(path, format!("rank {r} sub-group {i}: end overflows")))?;
                for f in &files {
                    let reg = &f.regions[i];
                    if reg.offset_bytes != g.offset_bytes || reg.len_bytes != g.len_bytes {
                        return Err(bad(
                            path,
                            format!("{}: region {i} does not match sub-group {i}", f.path),
                        ));
                    }
                    if end > f.bytes {
                        return Err(bad(
                            path,
                            format!(
                                "{}: sub-group {i} ends at {end}, past the file's {} bytes",
                                f.path, f.bytes
                            ),
                        ));
                    }
                }
                next = end;
                for p in &g.params {
                    let spec = model.param_by_name(&p.name).ok_or_else(|| {
                        bad(path, format!("parameter `{}` is not in the model", p.name))
                    })?;
                    let in_group_end = p.offset_in_group.checked_add(p.shard_numel);
                    let shard_end = p.shard_start.checked_add(p.shard_numel);
                    if p.numel != spec.numel as u64
                        || in_group_end.is_none_or(|e| e > g.numel)
                        || shard_end.is_none_or(|e| e > p.numel)
                    {
                        return Err(bad(
                            path,
                            format!(
                                "parameter `{}`: shard {}+{} of {} at {} in a sub-group of {} \
                                 does not fit (the model has {} elements)",
                                p.name,
                                p.shard_start,
                                p.shard_numel,
                                p.numel,
                                p.offset_in_group,
                                g.numel,
                                spec.numel
                            ),
                        ));
                    }
                    covered[spec.id.0].push((p.shard_start, p.shard_start + p.shard_numel));
                }
            }
        }
        for spec in model.params() {
            // Sorted, each must start where the last ended: no overlap (two
            // shards of one range summed like a whole and left the rest
            // zeros), no gap, and the last ends at the parameter's end.
            let ranges = &mut covered[spec.id.0];
            ranges.sort_unstable();
            let mut at = 0u64;
            for &(start, end) in ranges.iter() {
                if start != at {
                    let what = if start < at { "overlap" } else { "leave a gap" };
                    return Err(bad(
                        path,
                        format!(
                            "parameter `{}`: shards {what} at element {}",
                            spec.name,
                            start.min(at)
                        ),
                    ));
                }
                at = end;
            }
            if at != spec.numel as u64 {
                return Err(bad(
                    path,
                    format!(
                        "parameter `{}`: shards cover {at} of {} elements",
                        spec.name, spec.numel
                    ),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_only() {
        assert!(check_relative("rank0000/master.f32").is_ok());
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../../b",
            "./a",
            "a/./b",
            "a//b",
            "a/",
        ] {
            assert!(
                matches!(check_relative(bad), Err(CheckpointError::PathEscape { .. })),
                "{bad:?} accepted"
            );
        }
    }
}

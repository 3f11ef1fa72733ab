//! Opening and reading a checkpoint: [`Checkpoint`].
//!
//! [`Checkpoint::open`] resolves a save dir (via `latest`) or a step dir,
//! parses and validates the manifest and stats every file, reading no data.
//! Reads are by sub-group region: a region is read whole (past the page
//! cache where the file system allows it, [`read_region`]), its crc32c
//! checked against the manifest, and the elements wanted copied out. The
//! last region read **of each rank** is kept (behind a mutex), so loading
//! the parameters of a sub-group one after another reads it once, also
//! when every parameter is assembled from the shards of several ranks (a
//! checkpoint of N ranks read by M ranks, or by `export`): each rank's
//! sub-groups are visited in order. A reader holds at most one region per
//! rank whose shards it reads; [`Checkpoint::release_cache`] drops them.

use std::fs::File;
use std::io::Read as _;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::{Device, Tensor};
use serde::Serialize;

use super::manifest::{resolve_inside, Manifest, StateKind, MANIFEST_FILE, MAX_MANIFEST_BYTES};
use super::writer::{parse_step_dir_name, staging_owner_pid, step_dir_name, LATEST_FILE};
use super::{io_err, CheckpointError};
use crate::model::{Model, ParamId};

/// Which region of a rank: (state, sub-group).
type RegionKey = (StateKind, usize);

/// A region kept for the next read: its key and verified elements.
type CachedRegion = (RegionKey, Arc<Region>);

/// `len` bytes at `offset_bytes` of `path`, aligned for `f32`: past the page
/// cache where the file system allows it (a cached copy of the state would
/// sit beside the state being loaded; [`tierzero_swap::read_direct`]),
/// through it where not ([`read_buffered`]).
fn read_region(
    path: &Path,
    offset_bytes: u64,
    len: usize,
) -> Result<tierzero_swap::AlignedBytes, CheckpointError> {
    match tierzero_swap::read_direct(path, offset_bytes, len as u64) {
        Ok(Some(b)) => Ok(b),
        Ok(None) => read_buffered(path, offset_bytes, len),
        Err(e) => Err(swap_read_err(path, e)),
    }
}

/// A swap-layer read error as the checkpoint's: a file that would not open
/// gives its OS error (the path is named once); a failed read keeps the
/// swap layer's offset and length.
fn swap_read_err(path: &Path, e: tierzero_swap::SwapError) -> CheckpointError {
    CheckpointError::Io {
        op: "reading",
        path: path.to_path_buf(),
        source: match e {
            tierzero_swap::SwapError::Setup { source, .. } => source,
            other => std::io::Error::other(other),
        },
    }
}

/// [`read_region`] through the page cache.
fn read_buffered(
    path: &Path,
    offset_bytes: u64,
    len: usize,
) -> Result<tierzero_swap::AlignedBytes, CheckpointError> {
    let mut b = tierzero_swap::AlignedBytes::zeroed(len, 4096);
    File::open(path)
        .and_then(|f| f.read_exact_at(b.as_mut_slice(), offset_bytes))
        .map_err(io_err("reading", path))?;
    Ok(b)
}

/// A verified region's elements: its bytes as read, viewed in place as
/// little-endian `f32`s where the host is little-endian.
#[derive(Debug)]
enum Region {
    /// The region as read, aligned for `f32`, and its element count (the
    /// rest is padding).
    Read {
        bytes: tierzero_swap::AlignedBytes,
        numel: usize,
    },
    /// Converted (a big-endian host).
    Converted(Vec<f32>),
}

impl Region {
    /// Its first `numel` elements (at most the bytes' length / 4).
    fn from_bytes(bytes: tierzero_swap::AlignedBytes, numel: usize) -> Region {
        if cfg!(target_endian = "little") {
            Region::Read { bytes, numel }
        } else {
            Region::Converted(
                bytes.as_slice()[..numel * 4]
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            )
        }
    }

    /// The elements.
    fn f32s(&self) -> &[f32] {
        match self {
            Region::Read { bytes, numel } => bytemuck::cast_slice(&bytes.as_slice()[..numel * 4]),
            Region::Converted(v) => v,
        }
    }
}

/// An opened, validated checkpoint.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    manifest: Manifest,
    model: Model,
    /// Per rank: its last region read, (state, sub-group) → its verified
    /// elements.
    cache: Mutex<Vec<Option<CachedRegion>>>,
    /// Opened from a save dir whose `latest` was unusable: why (see
    /// [`Checkpoint::latest_unusable`]).
    latest_unusable: Option<String>,
}

/// The result of checking one file.
#[derive(Debug, Clone, Serialize)]
pub struct FileCheck {
    /// Relative path.
    pub path: String,
    /// Bytes.
    pub bytes: u64,
    /// `None` when it verified; else what is wrong.
    pub error: Option<String>,
}

/// The result of [`Checkpoint::verify`].
#[derive(Debug, Clone, Serialize)]
pub struct VerifyReport {
    /// Per file.
    pub files: Vec<FileCheck>,
}

impl VerifyReport {
    /// Whether every file verified.
    pub fn ok(&self) -> bool {
        self.files.iter().all(|f| f.error.is_none())
    }
}

/// The `step-<N>` dirs in `save_dir`, newest first, of steps below
/// `below` if given.
fn step_dirs_below(save_dir: &Path, below: Option<u64>) -> std::io::Result<Vec<PathBuf>> {
    let mut steps: Vec<(u64, PathBuf)> = std::fs::read_dir(save_dir)?
        .flatten()
        .filter_map(|e| {
            let step = parse_step_dir_name(e.file_name().to_str()?)?;
            below.is_none_or(|b| step < b).then(|| (step, e.path()))
        })
        .collect();
    steps.sort();
    Ok(steps.into_iter().rev().map(|(_, p)| p).collect())
}

/// The steps of the `step-<N>` dirs in `save_dir`, oldest first (none
/// when it cannot be read): what a run saved there.
pub fn saved_steps(save_dir: &Path) -> Vec<u64> {
    let mut steps: Vec<u64> = std::fs::read_dir(save_dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| parse_step_dir_name(e.file_name().to_str()?))
        .collect();
    steps.sort_unstable();
    steps
}

/// The checkpoint directory a file about to be written at `out` would
/// land in, if any: a step dir (`step-<N>` holding a manifest, or a
/// save's staging dir) at any depth above it, a step dir's name in a save
/// dir on the way to it (existing or not: a save of that step replaces
/// the dir, and the file with it), or the save dir itself when `out` is
/// one of its own entries (`latest`, the lock, a step or staging dir's
/// name). Looked up through the nearest existing directory above
/// `out`, resolved; `None` when none is found. Outputs of `train` and
/// `export` are refused there: replacing a file a manifest lists breaks
/// its checkpoint, replacing `latest` another run's resume.
pub fn checkpoint_holding(out: &Path) -> Option<PathBuf> {
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty());
    let dir = parent
        .unwrap_or(Path::new("."))
        .ancestors()
        .find(|a| !a.as_os_str().is_empty() && a.is_dir())
        .unwrap_or(Path::new("."))
        .canonicalize()
        .ok()?;
    let is_step_dir = |d: &Path| {
        d.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
            staging_owner_pid(n).is_some()
                || (parse_step_dir_name(n).is_some() && d.join(MANIFEST_FILE).is_file())
        })
    };
    if let Some(step) = dir.ancestors().find(|a| is_step_dir(a)) {
        return Some(step.to_path_buf());
    }
    // A save dir: `latest`, the lock, or a step dir holding a manifest (a
    // folder of `step-<N>` dirs alone, as per-step exports are named, is
    // not one).
    let is_save_dir = |d: &Path| {
        d.join(LATEST_FILE).is_file()
            || d.join(super::LOCK_FILE).exists()
            || std::fs::read_dir(d)
                .into_iter()
                .flatten()
                .flatten()
                .any(|e| {
                    e.file_name()
                        .to_str()
                        .is_some_and(|n| parse_step_dir_name(n).is_some())
                        && e.path().join(MANIFEST_FILE).is_file()
                })
    };
    // A step dir's name in a save dir, on the way to `out`, whether it
    // exists yet or holds a manifest: a later save of that step would
    // replace it, and the file with it.
    let in_step_name = out.ancestors().skip(1).find(|a| {
        a.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(is_save_dir_entry)
            && is_save_dir(
                a.parent()
                    .filter(|p| !p.as_os_str().is_empty())
                    .unwrap_or(Path::new(".")),
            )
    });
    if let Some(step) = in_step_name {
        return Some(step.to_path_buf());
    }
    let own_entry = is_save_dir_entry(out.file_name()?.to_str()?);
    (own_entry && is_save_dir(&dir)).then_some(dir)
}

/// The step `save_dir`'s `latest` names, when it is a readable regular
/// file holding a step dir's name (whether that step opens or not).
pub fn latest_step(save_dir: &Path) -> Option<u64> {
    let bytes = crate::durable::read_regular(&save_dir.join(LATEST_FILE), 4096).ok()?;
    parse_step_dir_name(String::from_utf8_lossy(&bytes).trim())
}

/// Whether save dir `dir` holds a save's staging dir and nothing else of
/// a save dir's but its lock: what a run killed in its first save leaves
/// (nothing to resume).
pub fn holds_only_staging(dir: &Path) -> bool {
    let names: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_owned))
        .filter(|n| is_save_dir_entry(n))
        .collect();
    let staging = |n: &String| staging_owner_pid(n).is_some();
    names.iter().any(staging) && names.iter().all(|n| staging(n) || n == super::LOCK_FILE)
}

/// Whether `name` is one a save dir's writer uses: `latest`, its lock, a
/// `step-<N>` dir or a save's staging dir.
pub fn is_save_dir_entry(name: &str) -> bool {
    name == LATEST_FILE
        || name == super::LOCK_FILE
        || parse_step_dir_name(name).is_some()
        || staging_owner_pid(name).is_some()
}

fn manifest_err(path: &Path, reason: impl Into<String>) -> CheckpointError {
    CheckpointError::Manifest {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// The manifest of the step dir `dir` (a regular file of at most
/// [`MAX_MANIFEST_BYTES`], its seal checked), and its path; its files are
/// not looked at. [`Checkpoint::open_step_dir`] validates the rest; the
/// fallback reads a damaged step's history with it.
fn read_manifest(dir: &Path) -> Result<(Manifest, PathBuf), CheckpointError> {
    let mpath = dir.join(MANIFEST_FILE);
    let f = crate::durable::open_regular(&mpath).map_err(io_err("opening", &mpath))?;
    let mut text = String::new();
    f.take(MAX_MANIFEST_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(io_err("reading", &mpath))?;
    if text.len() as u64 > MAX_MANIFEST_BYTES {
        return Err(manifest_err(&mpath, "larger than 256 MiB"));
    }
    Ok((Manifest::parse(&text, &mpath)?, mpath))
}

impl Checkpoint {
    /// Opens `dir`: a step dir (holding `manifest.json`), or a save dir, in
    /// which case `latest` is followed (or, when `latest` is missing or
    /// names a step dir that is damaged, the newest `step-*` dir that
    /// validates, below the damaged one, with a warning and
    /// [`Checkpoint::latest_unusable`] set). An error that is not damage (an I/O
    /// error other than "not found", a manifest version this build does
    /// not read: [`CheckpointError::is_damage`]) fails the open instead.
    /// Validates the manifest and file sizes; reads no data.
    pub fn open(dir: &Path) -> Result<Checkpoint, CheckpointError> {
        if let Some(name) = dir.file_name().and_then(|n| n.to_str()) {
            if staging_owner_pid(name).is_some() {
                return Err(manifest_err(
                    dir,
                    "is the staging directory of an unfinished (or replaced) save; it is never \
                     loaded: give the save dir or a step-<N> directory",
                ));
            }
        }
        if dir.join(MANIFEST_FILE).exists() {
            return Self::open_step_dir(dir);
        }
        let latest = dir.join(LATEST_FILE);
        let mut latest_err = None;
        // The step `latest` named, when it was damaged: the fallback takes
        // only steps below it (a step above it is from a run abandoned
        // for an older step, not this run's history), and of those, where
        // its manifest still reads, only its history's (one below it may
        // be an abandoned run's too: `Manifest::descends_from`).
        let mut below = None;
        let mut damaged: Option<Manifest> = None;
        // Read as bytes: a damaged `latest` (not UTF-8 included) means
        // falling back below, never failing the open.
        // A regular file of a few bytes: a FIFO or a link to a device
        // there is damage too (its read waited for ever, or did not end).
        match crate::durable::read_regular(&latest, 4096) {
            Ok(bytes) => {
                let text = String::from_utf8_lossy(&bytes);
                let written = text.trim();
                match parse_step_dir_name(written) {
                    // The step's own name (an edited `step-4` is step 4's
                    // `step-00000004`, not a missing dir that made the
                    // fallback skip step 4).
                    Some(step) => match Self::open_step_dir(&dir.join(step_dir_name(step))) {
                        Ok(c) => return Ok(c),
                        // Not damage: fail rather than resume from an
                        // older step (see `CheckpointError::is_damage`).
                        Err(e) if !e.is_damage() => return Err(e),
                        Err(e) => {
                            let name = step_dir_name(step);
                            if !dir.join(&name).exists() {
                                if let Some(c) = Self::open_moved_aside(dir, &name, step) {
                                    return Ok(c);
                                }
                            }
                            damaged = read_manifest(&dir.join(&name)).ok().map(|(m, _)| m);
                            latest_err = Some(e);
                            below = Some(step);
                        }
                    },
                    None => {
                        latest_err = Some(manifest_err(
                            &latest,
                            format!("`latest` holds {written:?}, not a step directory name"),
                        ))
                    }
                }
            }
            // A `latest` that is a link to nothing is damage, not an
            // absent `latest` (export and eval went on with a warning that
            // there was none).
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if latest.symlink_metadata().is_ok() {
                    latest_err = Some(manifest_err(
                        &latest,
                        "is a symbolic link to a file that does not exist",
                    ));
                }
            }
            // Not a regular file, far longer than a step dir's name, or a
            // link that loops: damage, as a name that does not parse is.
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::InvalidInput | std::io::ErrorKind::InvalidData
                ) || e.raw_os_error() == Some(libc::ELOOP) =>
            {
                latest_err = Some(manifest_err(&latest, e.to_string()));
            }
            Err(e) => return Err(io_err("reading", &latest)(e)),
        }
        // Fall back to the newest step dir that validates.
        for p in step_dirs_below(dir, below).map_err(io_err("listing", dir))? {
            match Self::open_step_dir(&p) {
                Ok(c)
                    if damaged.as_ref().and_then(|d| d.descends_from(&c.manifest))
                        == Some(false) =>
                {
                    tracing::warn!(dir = %p.display(), "skipping a step directory of a run abandoned for an older step (not in the history of the step `latest` names)");
                }
                Ok(mut c) => {
                    match &latest_err {
                        // Said by the caller: `train --resume` warns and
                        // goes on, `export` and `eval` refuse.
                        Some(e) => c.latest_unusable = Some(e.to_string()),
                        // A crash between the first save's rename and its
                        // `latest`, or a `latest` someone removed.
                        None => {
                            tracing::warn!(using = %p.display(), "no `latest` in the save dir; using its newest valid checkpoint");
                        }
                    }
                    return Ok(c);
                }
                Err(e) if !e.is_damage() => return Err(e),
                Err(e) => {
                    tracing::warn!(dir = %p.display(), error = %e, "skipping a step directory that does not validate");
                }
            }
        }
        // `latest` named a damaged (or missing) step with nothing valid
        // below it: steps above it are of a run abandoned for an older step
        // (or `latest` was edited), never taken on their own. Said, with
        // the way to take one anyway: it read only "opening
        // step-00000002: No such file or directory".
        if let (Some(b), Some(e)) = (below, &latest_err) {
            let above: Vec<u64> = saved_steps(dir).into_iter().filter(|&s| s > b).collect();
            if let (Some(first), Some(last)) = (above.first(), above.last()) {
                return Err(manifest_err(
                    &latest,
                    format!(
                        "`latest` names step {b}, which does not open ({e}), and no valid step \
                         is below it; the save dir's steps {first}..={last} are above it, so \
                         not of its history: give one of them (its step-<N> directory) to use \
                         it anyway"
                    ),
                ));
            }
        }
        Err(latest_err.unwrap_or_else(|| {
            manifest_err(
                dir,
                "not a checkpoint: no manifest.json, no `latest`, and no valid step-* directory",
            )
        }))
    }

    /// `latest` names `step-<N>`, which is not there: a save that replaces
    /// `step-<N>` moves it aside to `.step-<N>.old-<pid>` and renames its
    /// staging dir in its place, so a crash (or power loss) between the two
    /// renames leaves the checkpoint `latest` names only under that name.
    /// It is whole (its manifest and sizes validate here, its crcs at every
    /// read), so it is opened rather than going back to an older step.
    fn open_moved_aside(dir: &Path, name: &str, step: u64) -> Option<Checkpoint> {
        let prefix = format!(".{name}.old-");
        let mut aside: Vec<PathBuf> = std::fs::read_dir(dir)
            .ok()?
            .flatten()
            .filter(|e| {
                e.file_name()
                    .to_str()
                    .and_then(|n| n.strip_prefix(&prefix))
                    .is_some_and(|pid| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
            })
            .map(|e| e.path())
            .collect();
        aside.sort();
        aside.into_iter().find_map(|p| match Self::open_step_dir(&p) {
            Ok(c) if c.step() == step => {
                tracing::warn!(dir = %p.display(), "`latest` names {name}, which a save interrupted while replacing it had moved aside; using it");
                Some(c)
            }
            _ => None,
        })
    }

    pub(crate) fn open_step_dir(dir: &Path) -> Result<Checkpoint, CheckpointError> {
        let dir = dir.canonicalize().map_err(io_err("opening", dir))?;
        let (manifest, mpath) = read_manifest(&dir)?;
        let model = manifest.build_model(&mpath)?;
        manifest.validate(&model, &mpath)?;
        for f in &manifest.files {
            let p = resolve_inside(&dir, &f.path)?;
            let got = std::fs::metadata(&p).map_err(io_err("stat", &p))?.len();
            if got != f.bytes {
                return Err(CheckpointError::Size {
                    path: p,
                    expected_bytes: f.bytes,
                    got_bytes: got,
                });
            }
        }
        Ok(Checkpoint {
            dir,
            manifest,
            model,
            cache: Mutex::new(Vec::new()),
            latest_unusable: None,
        })
    }

    /// When this checkpoint was opened from a save dir whose `latest` was
    /// unusable (it named a damaged step, or no step): what was wrong. The
    /// checkpoint is then the newest valid one below the step `latest`
    /// named; `inspect --verify` fails on it, since the newest save is
    /// broken. The open does not log it: its caller says it, as a warning
    /// or an error.
    pub fn latest_unusable(&self) -> Option<&str> {
        self.latest_unusable.as_deref()
    }

    /// The step directory (canonical).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The model it was saved from.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Optimizer steps done when it was saved.
    pub fn step(&self) -> u64 {
        self.manifest.step
    }

    /// The newest step dir beside this one, of an earlier step, whose
    /// manifest and file sizes validate (its data is not read): where to
    /// resume from when this one's data turns out corrupt.
    pub fn older_valid(&self) -> Option<PathBuf> {
        step_dirs_below(self.dir.parent()?, Some(self.step()))
            .ok()?
            .into_iter()
            .find(|p| Self::open_step_dir(p).is_ok())
    }

    /// The verified elements of sub-group `sg` of `rank`'s `kind` file.
    fn region(
        &self,
        rank: usize,
        kind: StateKind,
        sg: usize,
    ) -> Result<Arc<Region>, CheckpointError> {
        let key = (kind, sg);
        {
            let mut c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            match c.get_mut(rank) {
                Some(Some((k, v))) if *k == key => return Ok(v.clone()),
                // Drop this rank's old region before reading the new one.
                Some(slot) => *slot = None,
                None => {}
            }
        }
        let mpath = self.dir.join(MANIFEST_FILE);
        let r = self
            .manifest
            .ranks
            .get(rank)
            .ok_or_else(|| manifest_err(&mpath, format!("no rank {rank}")))?;
        let g = r
            .sub_groups
            .get(sg)
            .ok_or_else(|| manifest_err(&mpath, format!("rank {rank}: no sub-group {sg}")))?;
        let rel = r
            .states
            .get(kind.name())
            .ok_or_else(|| manifest_err(&mpath, format!("no {} file", kind.name())))?;
        let entry = self
            .manifest
            .file(rel)
            .ok_or_else(|| manifest_err(&mpath, format!("{rel} not listed")))?;
        let path = resolve_inside(&self.dir, rel)?;
        let len = usize::try_from(g.len_bytes)
            .map_err(|_| manifest_err(&mpath, "region larger than memory"))?;
        let bytes = read_region(&path, g.offset_bytes, len)?;
        let got = crc32c::crc32c(bytes.as_slice());
        let expected = entry.regions[sg].crc32c;
        if got != expected {
            return Err(CheckpointError::Corrupt {
                part: format!("{} of rank {rank}, sub-group {sg}", kind.name()),
                path,
                expected_crc: expected,
                got_crc: got,
            });
        }
        let n = g.numel as usize;
        if bytes.as_slice().len() < n * 4 {
            return Err(manifest_err(
                &mpath,
                format!("rank {rank}: sub-group {sg} has {n} elements in {len} bytes"),
            ));
        }
        let values = Region::from_bytes(bytes, n);
        let values = Arc::new(values);
        {
            let mut c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            if c.len() <= rank {
                c.resize(rank + 1, None);
            }
            c[rank] = Some((key, values.clone()));
        }
        Ok(values)
    }

    /// Drops the regions kept for the next read (see the module docs).
    pub fn release_cache(&self) {
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// Elements `[start, start + numel)` of parameter `id`'s `kind` state,
    /// assembled from every rank's shard that overlaps them (so any rank
    /// count and sub-group size can read any checkpoint), crc-verified.
    pub fn load_param_state_range(
        &self,
        kind: StateKind,
        id: ParamId,
        start: usize,
        numel: usize,
    ) -> Result<Vec<f32>, CheckpointError> {
        let mut out = vec![0f32; numel];
        self.load_param_state_range_into(kind, id, start, &mut out)?;
        Ok(out)
    }

    /// [`Checkpoint::load_param_state_range`] of `out.len()` elements, into
    /// `out`.
    pub fn load_param_state_range_into(
        &self,
        kind: StateKind,
        id: ParamId,
        start: usize,
        out: &mut [f32],
    ) -> Result<(), CheckpointError> {
        let numel = out.len();
        let spec = self
            .model
            .param(id)
            .ok_or_else(|| CheckpointError::Mismatch {
                what: "parameter id".into(),
                checkpoint: format!("{} parameters", self.model.params().len()),
                run: format!("{id:?}"),
            })?;
        let end = start
            .checked_add(numel)
            .filter(|&e| e <= spec.numel)
            .ok_or_else(|| CheckpointError::Mismatch {
                what: format!("range of parameter `{}`", spec.name),
                checkpoint: format!("{} elements", spec.numel),
                run: format!("{start}+{numel}"),
            })?;
        let mut filled = 0usize;
        for (r, rank) in self.manifest.ranks.iter().enumerate() {
            for (i, g) in rank.sub_groups.iter().enumerate() {
                for p in g.params.iter().filter(|p| p.name == spec.name) {
                    let s0 = p.shard_start as usize;
                    let s1 = s0 + p.shard_numel as usize;
                    let lo = s0.max(start);
                    let hi = s1.min(end);
                    if lo >= hi {
                        continue;
                    }
                    let region = self.region(r, kind, i)?;
                    let from = p.offset_in_group as usize + (lo - s0);
                    out[lo - start..hi - start]
                        .copy_from_slice(&region.f32s()[from..from + (hi - lo)]);
                    filled += hi - lo;
                }
            }
        }
        if filled != numel {
            return Err(manifest_err(
                &self.dir.join(MANIFEST_FILE),
                format!(
                    "parameter `{}`: shards give {filled} of {numel} elements",
                    spec.name
                ),
            ));
        }
        Ok(())
    }

    /// The fp32 master weights of one whole parameter, in its HF shape and
    /// our internal layout (GPT-2 Conv1D `[in, out]`), crc-verified.
    pub fn load_param_f32(&self, id: ParamId) -> Result<Tensor, CheckpointError> {
        let spec = self
            .model
            .param(id)
            .ok_or_else(|| CheckpointError::Mismatch {
                what: "parameter id".into(),
                checkpoint: format!("{} parameters", self.model.params().len()),
                run: format!("{id:?}"),
            })?;
        let v = self.load_param_state_range(StateKind::Master, id, 0, spec.numel)?;
        Ok(Tensor::from_vec(v, spec.shape.as_slice(), &Device::Cpu)?)
    }

    /// Reads every file whole and checks its size and crc32c, and every
    /// state-file region's crc32c. Errors are collected per file.
    pub fn verify(&self) -> VerifyReport {
        let files = self
            .manifest
            .files
            .iter()
            .map(|f| {
                let error = self.verify_file(f).err().map(|e| e.to_string());
                FileCheck {
                    path: f.path.clone(),
                    bytes: f.bytes,
                    error,
                }
            })
            .collect();
        VerifyReport { files }
    }

    fn verify_file(&self, f: &super::FileEntry) -> Result<(), CheckpointError> {
        let path = resolve_inside(&self.dir, &f.path)?;
        // Past the page cache where it can: a checkpoint is as large as
        // the host's state, and a verify pass should not evict the memory
        // a run is using (`tierzero_swap::ChunkReader`).
        let swap_err = |e| swap_read_err(&path, e);
        let mut reader = tierzero_swap::ChunkReader::open(&path).map_err(swap_err)?;
        let mut crc = 0u32;
        let mut region = 0usize;
        let mut region_crc = 0u32;
        loop {
            let pos = reader.pos_bytes();
            let Some(chunk) = reader.next_chunk().map_err(swap_err)? else {
                break;
            };
            let n = chunk.len();
            crc = crc32c::crc32c_append(crc, chunk);
            // Region crcs: feed the part of the chunk inside each region.
            let mut off = 0usize;
            while off < n && region < f.regions.len() {
                let r = &f.regions[region];
                let abs = pos + off as u64;
                let r_end = r.offset_bytes + r.len_bytes;
                if abs < r.offset_bytes {
                    off += ((r.offset_bytes - abs) as usize).min(n - off);
                    continue;
                }
                let take = ((r_end - abs) as usize).min(n - off);
                region_crc = crc32c::crc32c_append(region_crc, &chunk[off..off + take]);
                off += take;
                if abs + take as u64 == r_end {
                    if region_crc != r.crc32c {
                        return Err(CheckpointError::Corrupt {
                            part: format!("{} sub-group {region}", f.path),
                            path,
                            expected_crc: r.crc32c,
                            got_crc: region_crc,
                        });
                    }
                    region += 1;
                    region_crc = 0;
                }
            }
        }
        let pos = reader.pos_bytes();
        if pos != f.bytes {
            return Err(CheckpointError::Size {
                path,
                expected_bytes: f.bytes,
                got_bytes: pos,
            });
        }
        if crc != f.crc32c {
            return Err(CheckpointError::Corrupt {
                part: f.path.clone(),
                path,
                expected_crc: f.crc32c,
                got_crc: crc,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failure is a panic

    use super::*;

    /// A region reads the same past the page cache (where the file system
    /// takes O_DIRECT) and through it, aligned for `f32` either way; one
    /// that runs past the end of the file is an error naming the file.
    #[test]
    fn a_region_reads_the_same_direct_and_buffered() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("master.f32");
        let bytes: Vec<u8> = (0..5 * 4096).map(|i| (i * 7 % 253) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        let direct = read_region(&path, 4096, 3 * 4096).unwrap();
        let buffered = read_buffered(&path, 4096, 3 * 4096).unwrap();
        for got in [&direct, &buffered] {
            assert_eq!(got.as_slice(), &bytes[4096..4 * 4096]);
            assert_eq!(got.as_slice().as_ptr() as usize % 4096, 0);
        }
        for r in [
            read_region(&path, 4 * 4096, 2 * 4096),
            read_buffered(&path, 4 * 4096, 2 * 4096),
        ] {
            match r {
                Err(CheckpointError::Io { path: p, .. }) => assert_eq!(p, path),
                other => panic!("{other:?}"),
            }
        }
    }
}

//! `tierzero inspect DIR`: summarise a checkpoint or a swap directory.
//!
//! A swap directory is what `tierzero-swap` creates under each NVMe path:
//! `<nvme_path>/tierzero/` holding `swap-<pid>-<space>-<path>.tzswap` files
//! (see `tierzero_swap::space`). `DIR` may be the `nvme_path` or the
//! `tierzero/` directory itself, or an `nvme_path` shared by several
//! ranks, whose swap directories are `rank<R>/tierzero/` (each is
//! reported, in rank order). For each of our files we show its size,
//! the space really allocated (swap files are preallocated, so a smaller
//! number means a sparse file), the owning pid, whether that process is
//! alive, and the mode bits. A file no live run owns is stale: the next
//! tierzero run on that path reclaims it, or it can be deleted by hand.
//! The directory's lock decides, as it does for the swap crate's reclaim
//! (`tierzero_swap::lock::lock_state`: the lock file opened read-only and
//! locked without waiting, then let go): free, every file is stale; held,
//! only the holder's. Only without a lock to look at do the owners' pids
//! (`swap_file_owner_pid`, `process_alive`) decide. The `lock` file is
//! reported with the pid written in it and whether it is held (a dead
//! holder's lock does not block: the kernel released it). Anything else in
//! the directory is counted and listed, never touched. (A run starting in
//! the instant `inspect` holds the lock to look is refused as by a
//! running one.)
//!
//! A checkpoint (a step dir with `manifest.json`, or a save dir with
//! `latest` / `step-*` dirs) is summarised from its manifest: step, model,
//! precision, ranks and sub-groups, and every file with its size and
//! crc32c. `--verify` reads every file and checks every crc (whole file and
//! per sub-group); a failed verification exits 2 after printing the report
//! (the checkpoint is bad input to any later command).
//!
//! [`classify`] decides what `DIR` is and returns a [`Target`]; each kind of
//! target has its own report. A directory that is neither is bad input
//! (exit 2).

use std::fmt::Write as _;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::anyhow;
use clap::Args;
use serde::Serialize;
use tierzero::units::format_bytes;
use tierzero_swap::lock::{LockState, LOCK_FILE};
use tierzero_swap::space::{process_alive, swap_file_owner_pid, SWAP_SUBDIR};

use super::Failure;

/// Arguments of `tierzero inspect`.
#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  tierzero inspect ckpt --verify\n  tierzero inspect ckpt/step-00000100 --json\n  tierzero inspect /mnt/nvme\n  tierzero inspect ./tierzero-swap/tierzero --json"
)]
pub struct InspectArgs {
    /// A checkpoint (a save dir or a step-<N> dir) or a swap directory (an
    /// offload nvme_path containing tierzero/, or that tierzero/ directory).
    #[arg(value_name = "DIR")]
    dir: PathBuf,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Checkpoints: read every file and check its crc32c (whole file and
    /// per sub-group).
    #[arg(long)]
    verify: bool,
}

/// What a directory given to `inspect` is.
#[derive(Debug)]
pub enum Target {
    /// A `tierzero/` swap directory.
    Swap {
        /// The `tierzero/` directory itself.
        dir: PathBuf,
    },
    /// An nvme_path shared by ranks: each rank's swap directory,
    /// `rank<R>/tierzero/` (where the engine puts them under several
    /// ranks), in rank order.
    RankSwaps {
        /// The `tierzero/` directories.
        dirs: Vec<PathBuf>,
    },
    /// A checkpoint: a step dir or a save dir.
    Checkpoint {
        /// As given.
        dir: PathBuf,
    },
}

fn looks_like_checkpoint(dir: &Path) -> bool {
    if dir.join(tierzero::checkpoint::MANIFEST_FILE).is_file()
        || dir.join(tierzero::checkpoint::LATEST_FILE).is_file()
    {
        return true;
    }
    std::fs::read_dir(dir).is_ok_and(|mut it| {
        it.any(|e| {
            e.is_ok_and(|e| {
                e.file_name()
                    .to_str()
                    .is_some_and(|n| n.starts_with("step-"))
                    && e.path().join(tierzero::checkpoint::MANIFEST_FILE).is_file()
            })
        })
    })
}

fn bad(msg: String) -> Failure {
    Failure::BadInput(anyhow!(msg))
}

/// `dir`'s `rank<R>/tierzero/` directories, in rank order.
fn rank_swap_dirs(dir: &Path) -> Vec<PathBuf> {
    let mut ranks: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .map(|it| {
            it.flatten()
                .filter_map(|e| {
                    let r = e.file_name().to_str()?.strip_prefix("rank")?.parse().ok()?;
                    let sub = e.path().join(SWAP_SUBDIR);
                    sub.is_dir().then_some((r, sub))
                })
                .collect()
        })
        .unwrap_or_default();
    ranks.sort();
    ranks.into_iter().map(|(_, d)| d).collect()
}

/// Decides what `dir` is.
pub fn classify(dir: &Path) -> Result<Target, Failure> {
    let meta = std::fs::metadata(dir).map_err(|e| bad(format!("{}: {e}", dir.display())))?;
    if !meta.is_dir() {
        return Err(bad(format!(
            "{} is not a directory; inspect takes a checkpoint or a swap directory (an nvme_path or its {SWAP_SUBDIR}/ directory)",
            dir.display()
        )));
    }
    if looks_like_checkpoint(dir) {
        return Ok(Target::Checkpoint {
            dir: dir.to_path_buf(),
        });
    }
    let sub = dir.join(SWAP_SUBDIR);
    if sub.is_dir() {
        return Ok(Target::Swap { dir: sub });
    }
    let ranks = rank_swap_dirs(dir);
    if !ranks.is_empty() {
        return Ok(Target::RankSwaps { dirs: ranks });
    }
    let named_like_ours = dir
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n == SWAP_SUBDIR))
        .unwrap_or(false);
    // An nvme_path after runs that ended: they removed their swap files
    // and the tierzero/ directory that held them (the help's own `inspect
    // /mnt/nvme` was refused there). Nothing of ours is in it.
    let empty = std::fs::read_dir(dir).is_ok_and(|mut it| it.next().is_none());
    if named_like_ours || empty {
        return Ok(Target::Swap {
            dir: dir.to_path_buf(),
        });
    }
    Err(bad(format!(
        "{} is not a checkpoint (no manifest.json, latest or step-* directory) and is not a swap directory (no {SWAP_SUBDIR}/ inside it); give a checkpoint, an offload nvme_path or its {SWAP_SUBDIR}/ directory",
        dir.display()
    )))
}

/// One of our swap files.
#[derive(Debug, Serialize)]
pub struct SwapFileEntry {
    /// File name.
    pub name: String,
    /// Length.
    pub size_bytes: u64,
    /// Space allocated on disk (`st_blocks × 512`).
    pub allocated_bytes: u64,
    /// Owning process, from the name.
    pub pid: u32,
    /// Whether that process exists.
    pub alive: bool,
    /// Permission bits, octal (`0600` when created by tierzero).
    pub mode: String,
    /// Owner uid.
    pub uid: u32,
}

/// Summary of a swap directory.
#[derive(Debug, Serialize)]
pub struct SwapReport {
    /// Always `"swap"`.
    pub kind: &'static str,
    /// The `tierzero/` directory.
    pub dir: String,
    /// Its permission bits (`0700` when created by tierzero).
    pub dir_mode: String,
    /// Our files, by name.
    pub files: Vec<SwapFileEntry>,
    /// Files whose owner is alive.
    pub live_files: u64,
    /// Files whose owner is gone (reclaimable).
    pub stale_files: u64,
    /// Sum of sizes.
    pub total_bytes: u64,
    /// Sum of sizes of live files.
    pub live_bytes: u64,
    /// Sum of sizes of stale files: what deleting them frees.
    pub stale_bytes: u64,
    /// Sum of allocated bytes.
    pub allocated_bytes: u64,
    /// The pid in the directory's lock file, if there is one.
    pub lock_pid: Option<u32>,
    /// Whether that process exists (if not, the lock is stale and does not
    /// block).
    pub lock_alive: Option<bool>,
    /// Entries that are not tierzero swap files (ignored).
    pub other_entries: u64,
    /// Their names.
    pub other_names: Vec<String>,
}

fn mode_text(mode: u32) -> String {
    format!("{:04o}", mode & 0o7777)
}

/// Lists the swap files in `dir` (a `tierzero/` directory).
pub fn scan_swap_dir(dir: &Path) -> Result<SwapReport, Failure> {
    let read_err = |e: std::io::Error| bad(format!("cannot read {}: {e}", dir.display()));
    let dir_meta = std::fs::metadata(dir).map_err(read_err)?;
    let mut report = SwapReport {
        kind: "swap",
        dir: dir.display().to_string(),
        dir_mode: mode_text(dir_meta.permissions().mode()),
        files: Vec::new(),
        live_files: 0,
        stale_files: 0,
        total_bytes: 0,
        live_bytes: 0,
        stale_bytes: 0,
        allocated_bytes: 0,
        lock_pid: None,
        lock_alive: None,
        other_entries: 0,
        other_names: Vec::new(),
    };
    let me = std::process::id();
    // The lock decides where it can: a run that made files here holds it
    // while they live, so with it free every file is stale, and with it
    // held only the holder's are live (pids alone are fooled by reuse and
    // zombies). Without a lock to look at, the owners' pids decide.
    let lock = tierzero_swap::lock::lock_state(dir);
    let owner_alive = |pid: u32| match lock {
        LockState::Free => false,
        LockState::Held {
            holder_pid: Some(holder),
        } => pid == holder,
        LockState::Held { holder_pid: None } | LockState::Unknown => {
            pid == me || process_alive(pid)
        }
    };
    for entry in std::fs::read_dir(dir).map_err(read_err)? {
        let entry = entry.map_err(read_err)?;
        let os_name = entry.file_name();
        let name = os_name.to_string_lossy().into_owned();
        let meta = match std::fs::symlink_metadata(entry.path()) {
            Ok(m) => m,
            Err(_) => {
                // Gone between the listing and the stat (a run ended).
                continue;
            }
        };
        if name == LOCK_FILE && meta.file_type().is_file() {
            let holder = std::fs::read_to_string(entry.path())
                .ok()
                .and_then(|t| t.trim().parse::<u32>().ok());
            report.lock_pid = holder;
            report.lock_alive = match lock {
                LockState::Free => Some(false),
                LockState::Held { .. } => Some(true),
                LockState::Unknown => holder.map(|p| p == me || process_alive(p)),
            };
            continue;
        }
        let pid = os_name
            .to_str()
            .and_then(swap_file_owner_pid)
            .filter(|_| meta.file_type().is_file());
        let Some(pid) = pid else {
            report.other_entries += 1;
            report.other_names.push(name);
            continue;
        };
        let alive = owner_alive(pid);
        let size = meta.len();
        report.total_bytes = report.total_bytes.saturating_add(size);
        if alive {
            report.live_files += 1;
            report.live_bytes = report.live_bytes.saturating_add(size);
        } else {
            report.stale_files += 1;
            report.stale_bytes = report.stale_bytes.saturating_add(size);
        }
        let allocated = meta.blocks().saturating_mul(512);
        report.allocated_bytes = report.allocated_bytes.saturating_add(allocated);
        report.files.push(SwapFileEntry {
            name,
            size_bytes: size,
            allocated_bytes: allocated,
            pid,
            alive,
            mode: mode_text(meta.permissions().mode()),
            uid: meta.uid(),
        });
    }
    report.files.sort_by(|a, b| a.name.cmp(&b.name));
    report.other_names.sort();
    Ok(report)
}

fn plural(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

fn render_swap(r: &SwapReport) -> Result<String, std::fmt::Error> {
    let mut out = String::new();
    writeln!(out, "swap directory {} (mode {})", r.dir, r.dir_mode)?;
    if r.files.is_empty() {
        writeln!(out, "no tierzero swap files")?;
    } else {
        writeln!(
            out,
            "{:>8}  {:<5}  {:<4}  {:>11}  {:>11}  file",
            "pid", "state", "mode", "size", "allocated"
        )?;
        for f in &r.files {
            writeln!(
                out,
                "{:>8}  {:<5}  {:<4}  {:>11}  {:>11}  {}",
                f.pid,
                if f.alive { "live" } else { "stale" },
                f.mode,
                format_bytes(f.size_bytes),
                format_bytes(f.allocated_bytes),
                f.name
            )?;
        }
    }
    writeln!(
        out,
        "total: {}, {} ({} allocated); live: {}, {}; stale: {}, {}{}",
        plural(r.files.len() as u64, "swap file", "swap files"),
        format_bytes(r.total_bytes),
        format_bytes(r.allocated_bytes),
        plural(r.live_files, "file", "files"),
        format_bytes(r.live_bytes),
        plural(r.stale_files, "file", "files"),
        format_bytes(r.stale_bytes),
        if r.stale_files > 0 {
            " reclaimable (their processes are gone; the next tierzero run on this path removes them)"
        } else {
            ""
        }
    )?;
    match (r.lock_pid, r.lock_alive) {
        (Some(pid), Some(true)) => writeln!(out, "lock: held by pid {pid}")?,
        (Some(pid), _) => writeln!(
            out,
            "lock: stale (pid {pid} is gone; it does not block the next run)"
        )?,
        (None, _) => {}
    }
    if r.other_entries > 0 {
        writeln!(
            out,
            "ignored: {} that {} not tierzero swap files: {}",
            plural(r.other_entries, "entry", "entries"),
            if r.other_entries == 1 { "is" } else { "are" },
            r.other_names.join(", ")
        )?;
    }
    Ok(out)
}

/// One file of a checkpoint report.
#[derive(Debug, Serialize)]
pub struct CheckpointFile {
    /// Relative path.
    pub path: String,
    /// Bytes.
    pub bytes: u64,
    /// crc32c recorded in the manifest.
    pub crc32c: String,
    /// Sub-group regions with their own crc.
    pub regions: usize,
    /// With `--verify`: "ok" or what is wrong.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verified: Option<String>,
}

/// Summary of a checkpoint.
#[derive(Debug, Serialize)]
pub struct CheckpointReport {
    /// Always `"checkpoint"`.
    pub kind: &'static str,
    /// The step dir.
    pub dir: String,
    /// Format version.
    pub version: u32,
    /// Optimizer steps done.
    pub step: u64,
    /// Adam steps taken.
    pub adam_steps: u64,
    /// Skipped steps (gradients not finite: fp16's overflow, bf16's check).
    pub skipped_steps: u64,
    /// Loss scale (fp16).
    pub loss_scale: Option<f64>,
    /// Model summary.
    pub model: String,
    /// Parameters.
    pub params: usize,
    /// Elements.
    pub numel: usize,
    /// Precision.
    pub precision: String,
    /// Ranks.
    pub world_size: usize,
    /// Sub-groups over all ranks.
    pub sub_groups: usize,
    /// Seed, seq_len, data source and samples consumed.
    pub seed: u64,
    /// Tokens per sample.
    pub seq_len: usize,
    /// Data source.
    pub data: String,
    /// Samples consumed.
    pub samples_consumed: u64,
    /// Consolidated 16-bit weights saved.
    pub hf_weights: Option<String>,
    /// Files.
    pub files: Vec<CheckpointFile>,
    /// Total bytes.
    pub total_bytes: u64,
    /// With `--verify`: whether everything verified.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verified_ok: Option<bool>,
    /// A save dir whose `latest` was unusable (it names a damaged step):
    /// why. This report is then of the newest valid step below it, and
    /// `--verify` fails.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latest_unusable: Option<String>,
}

fn checkpoint_report(dir: &Path, verify: bool) -> Result<CheckpointReport, Failure> {
    let c = tierzero::checkpoint::Checkpoint::open(dir)
        .map_err(|e| bad(format!("{}: {e}", dir.display())))?;
    let m = c.manifest();
    let mc = c.model().config();
    let checks = verify.then(|| c.verify());
    let files: Vec<CheckpointFile> = m
        .files
        .iter()
        .map(|f| CheckpointFile {
            path: f.path.clone(),
            bytes: f.bytes,
            crc32c: format!("{:08x}", f.crc32c),
            regions: f.regions.len(),
            verified: checks.as_ref().map(|r| {
                r.files
                    .iter()
                    .find(|x| x.path == f.path)
                    .and_then(|x| x.error.clone())
                    .unwrap_or_else(|| "ok".to_owned())
            }),
        })
        .collect();
    Ok(CheckpointReport {
        kind: "checkpoint",
        dir: c.dir().display().to_string(),
        version: m.version,
        step: m.step,
        adam_steps: m.adam_steps,
        skipped_steps: m.skipped_steps,
        loss_scale: m.loss_scaler.map(|s| f64::from_bits(s.cur_scale_bits)),
        model: format!(
            "{}, {} layers, hidden {}, vocab {}",
            mc.family.name(),
            mc.n_layer,
            mc.hidden_size,
            mc.vocab_size
        ),
        params: c.model().params().len(),
        numel: c.model().numel(),
        precision: m.precision.clone(),
        world_size: m.world_size,
        sub_groups: m.ranks.iter().map(|r| r.sub_groups.len()).sum(),
        seed: m.seed,
        seq_len: m.seq_len,
        data: m.data.source.clone(),
        samples_consumed: m.data.samples_consumed,
        hf_weights: m
            .hf_weights
            .as_ref()
            .map(|h| format!("{} ({})", h.safetensors, h.dtype)),
        total_bytes: files.iter().map(|f| f.bytes).sum(),
        files,
        verified_ok: checks.map(|r| r.ok()),
        latest_unusable: c.latest_unusable().map(str::to_owned),
    })
}

fn render_checkpoint(r: &CheckpointReport) -> Result<String, std::fmt::Error> {
    let mut out = String::new();
    if let Some(why) = &r.latest_unusable {
        writeln!(
            out,
            "warning: `latest` is unusable ({why}); this is the newest valid checkpoint below it"
        )?;
    }
    writeln!(out, "checkpoint {} (format v{})", r.dir, r.version)?;
    writeln!(
        out,
        "step {} ({} Adam steps, {} skipped){}",
        r.step,
        r.adam_steps,
        r.skipped_steps,
        r.loss_scale
            .map_or(String::new(), |s| format!(", loss scale {s}"))
    )?;
    writeln!(
        out,
        "model: {} ({} params, {} elements); precision {}; {} rank(s), {} sub-group(s)",
        r.model, r.params, r.numel, r.precision, r.world_size, r.sub_groups
    )?;
    writeln!(
        out,
        "data: {}, {} samples consumed, seq_len {}, seed {}",
        r.data, r.samples_consumed, r.seq_len, r.seed
    )?;
    if let Some(h) = &r.hf_weights {
        writeln!(out, "consolidated HF weights: {h}")?;
    }
    writeln!(out, "{:>11}  {:<8}  {:<7}  file", "size", "crc32c", "check")?;
    for f in &r.files {
        writeln!(
            out,
            "{:>11}  {:<8}  {:<7}  {}{}",
            format_bytes(f.bytes),
            f.crc32c,
            match &f.verified {
                None => "-",
                Some(v) if v == "ok" => "ok",
                Some(_) => "BAD",
            },
            f.path,
            match &f.verified {
                Some(v) if v != "ok" => format!(": {v}"),
                _ => String::new(),
            }
        )?;
    }
    writeln!(
        out,
        "total: {} in {} files{}",
        format_bytes(r.total_bytes),
        r.files.len(),
        match r.verified_ok {
            None => " (not verified; add --verify to check every crc32c)".to_owned(),
            Some(true) => "; every crc32c verified".to_owned(),
            Some(false) => "; VERIFICATION FAILED".to_owned(),
        }
    )?;
    Ok(out)
}

/// Runs `tierzero inspect`.
pub fn run(a: InspectArgs) -> Result<(), Failure> {
    // A failure before a report is out prints its object on stdout; one
    // after it (a failed verification) does not: the report is the object.
    super::json_object_on_failure(a.json);
    match classify(&a.dir)? {
        Target::Checkpoint { dir } => {
            let report = checkpoint_report(&dir, a.verify)?;
            if a.json {
                let text = serde_json::to_string_pretty(&report)
                    .map_err(|e| Failure::Internal(anyhow!("serialising the report: {e}")))?;
                super::emit(&format!("{text}\n"))?;
                super::json_object_on_failure(false);
            } else {
                let text = render_checkpoint(&report)
                    .map_err(|e| Failure::Internal(anyhow!("formatting the report: {e}")))?;
                super::emit(&text)?;
            }
            if report.verified_ok == Some(false) {
                let older = tierzero::checkpoint::Checkpoint::open(Path::new(&report.dir))
                    .map(|c| super::older_step_advice(&c, "--resume (or --checkpoint)"))
                    .unwrap_or_default();
                return Err(bad(format!(
                    "{}: verification failed (see the report above){older}",
                    report.dir
                )));
            }
            if let (true, Some(why)) = (a.verify, &report.latest_unusable) {
                // The newest save is broken, whatever an older one says.
                return Err(bad(format!(
                    "{}: `latest` names a checkpoint that does not validate ({why}); {} \
                     verified, but it is not the newest save",
                    a.dir.display(),
                    report.dir
                )));
            }
        }
        Target::Swap { .. } | Target::RankSwaps { .. } if a.verify => {
            return Err(bad(format!(
                "--verify checks a checkpoint's crc32c; {} is a swap directory (its files hold \
                 no checksums to check at rest); drop --verify",
                a.dir.display()
            )));
        }
        Target::RankSwaps { dirs } => {
            let reports = dirs
                .iter()
                .map(|d| scan_swap_dir(d))
                .collect::<Result<Vec<_>, _>>()?;
            if a.json {
                let v = serde_json::json!({"kind": "rank_swaps", "ranks": reports});
                let text = serde_json::to_string_pretty(&v)
                    .map_err(|e| Failure::Internal(anyhow!("serialising the report: {e}")))?;
                super::emit(&format!("{text}\n"))?;
            } else {
                for r in &reports {
                    let text = render_swap(r)
                        .map_err(|e| Failure::Internal(anyhow!("formatting the report: {e}")))?;
                    super::emit(&text)?;
                }
            }
        }
        Target::Swap { dir } => {
            let report = scan_swap_dir(&dir)?;
            if a.json {
                let text = serde_json::to_string_pretty(&report)
                    .map_err(|e| Failure::Internal(anyhow!("serialising the report: {e}")))?;
                super::emit(&format!("{text}\n"))?;
            } else {
                let text = render_swap(&report)
                    .map_err(|e| Failure::Internal(anyhow!("formatting the report: {e}")))?;
                super::emit(&text)?;
            }
        }
    }
    Ok(())
}

//! Checkpoints: save, validate, load and export training state.
//!
//! # Format v1 (design)
//!
//! ```text
//! <save_dir>/
//!   latest                      text: the name of the newest step dir ("step-00000004")
//!   step-00000004/              one checkpoint (8-digit optimizer step)
//!     manifest.json             written last; the checkpoint exists iff it validates
//!     rank0000/master.f32       fp32 master weights of rank 0's sub-groups
//!     rank0000/exp_avg.f32      Adam first moments
//!     rank0000/exp_avg_sq.f32   Adam second moments
//!     model.safetensors         only with stage3_gather_16bit_weights_on_model_save:
//!     config.json               consolidated 16-bit weights, HF names and layout
//!   .step-00000006.tmp-<pid>/   a checkpoint being written (never read)
//! ```
//!
//! **What is saved.** The fp32 masters and both Adam moments of every
//! sub-group, and the counters (optimizer steps done, Adam steps, skipped
//! steps, the fp16 loss scaler's state). That is the whole training state:
//! the 16-bit parameters are always `encode(master)` (the engine's central
//! invariant), the learning rate is a pure function of the Adam step count,
//! the data position is `samples_consumed` (a resume continues there, whatever
//! its global batch), and there is no RNG after the seeded init (no
//! dropout), so the manifest records the seed instead of an RNG state. A
//! resumed run rebuilds params from masters and continues bit-identically.
//!
//! **State files.** Raw little-endian f32. Sub-group `i` of a rank starts at
//! `offset_bytes` (a multiple of 4096) and takes `len_bytes =
//! align_up(numel × 4, 4096)`; the padding is not data. The same offsets are
//! used in all three files. The 4096 alignment lets state be written with
//! O_DIRECT, past the page cache: from host memory
//! (`tierzero_swap::DirectWriter`), or copied so from NVMe extents (or
//! reflinked by `copy_file_range` on XFS/btrfs).
//!
//! **Manifest** (`manifest.json`, [`Manifest`]): format name and version;
//! step, Adam steps, skipped steps, loss-scaler state; seed, seq_len, data
//! source and samples consumed; precision; world size and, per rank, its
//! sub-groups (numel, offset, length) and the params in them (name, whole
//! numel, shard range, offset in the sub-group); the model's HF config
//! (with its special token ids, which older readers ignore as harmless);
//! a fingerprint of the resolved training config (resuming with different
//! numerics is warned about, naming the settings); and every file with its
//! relative path, byte length and crc32c, plus a crc32c per sub-group
//! region for the state files (so one parameter can be loaded and verified
//! without reading the whole file); and the lineage, the runs that led to
//! it (a random run id and the step each began at: which older step dirs
//! are its history). The whole-file crc is combined from the
//! region crcs (`crc32c_combine`). The manifest checks itself too:
//! `manifest_crc32c` (required) is 8 hex digits, the crc32c of the file's
//! raw bytes with those digits read as `0`s, so a flipped byte anywhere in
//! it (a step count, a crc, a name, the key itself) is
//! [`CheckpointError::Corrupt`] with part `manifest` before any value in it
//! is trusted. Raw bytes rather than a re-serialisation, so no float has to
//! round-trip through JSON.
//!
//! **Where crcs come from.** Memory tiers: computed while writing. NVMe
//! tier: the swap space's recorded crc32c of the extent when checksums are
//! on (the crc of the data we submitted, so a disk that corrupts the copy
//! is caught at load); otherwise computed by reading the written file back
//! in 1 MiB chunks.
//!
//! **Atomicity.** Everything is written under `.step-<N>.tmp-<pid>/`; each
//! file is fsynced, the manifest is written last (atomically), the
//! directories are fsynced, then the directory is renamed to `step-<N>`,
//! the save dir is fsynced, and `latest` is atomically rewritten
//! ([`crate::durable`]). A crash at any point leaves either a `.tmp` dir
//! (never read; removed by the next save once its pid is dead) or a
//! complete step dir. A step dir that already exists (a run resumed from an
//! older checkpoint reaching the same step) is moved aside to
//! `.step-<N>.old-<pid>`, replaced, and then removed; a crash between the
//! two renames leaves `latest` naming a step dir that is only there under
//! its `.old` name, and opening the save dir uses it (it is whole: only
//! committed dirs are moved aside). Opening a save dir
//! follows `latest`; if `latest` is missing or names a dir that does not
//! validate, the newest `step-*` dir with a valid manifest is used (a
//! damaged `latest`, even one that is not UTF-8, is a pointer to fall back
//! from, not an error): below the step `latest` named, and where that
//! step's manifest still reads, only one in its lineage (a run that
//! resumed from an older step left the abandoned run's newer steps). The
//! caller says it: `train --resume` warns and goes on, `export` and `eval`
//! refuse and name the step ([`Checkpoint::latest_unusable`]). A directory without a valid manifest is
//! never taken as a checkpoint, and a staging dir is refused by name even
//! when opened directly. Leftovers of dead processes (`.tmp`/`.old` dirs,
//! `.latest.tmp-<pid>-*` files) are removed by the next save.
//!
//! **One writer per save dir.** A trainer holds `flock` on
//! `<save_dir>/.lock` while it owns the save dir ([`SaveDirLock`]; the CLI
//! takes it at start-up); a second process refuses, naming the lock file
//! and the holder's pid. The kernel drops the lock when its holder dies,
//! however it dies. Readers take no lock.
//!
//! **Crash safety, tested.** `tests/crash_resume.rs` SIGKILLs the binary at
//! seeded failpoints ([`crate::failpoint`]: mid-step, mid write-back, a
//! partly written state file, a half-written manifest, before the rename,
//! before `latest`, a half-written `latest`) and at timed moments, checks
//! every visible step dir verifies and the save dir never goes back, and
//! resumes to the end: the final state files equal a run never killed,
//! byte for byte (the NVMe extents are written with zero padding). Power
//! loss is tested too (`tests/power_loss.rs`): the file-system operations
//! of three saves are recorded ([`crate::durable::record`]) and every
//! prefix replayed on a model that drops what was not fsynced (file data
//! before its fsync, entries before their directory's fsync), with and
//! without the unsynced metadata; the save dir always opens at the last
//! returned save or later, or refuses while there is none.
//!
//! **Validation on load.** The manifest is parsed and checked before any
//! data is read: format and version, the model config, every path
//! (relative, only normal components, no `..`, not absolute, and after
//! resolving symlinks still inside the checkpoint directory), file sizes
//! against the manifest, region bounds with checked arithmetic, and that the
//! shards of every parameter cover it exactly once. Every read is verified
//! against its crc32c; a mismatch is [`CheckpointError::Corrupt`] naming
//! the part (file and sub-group).
//!
//! **Permissions.** Files 0600, directories 0700.
//!
//! **Several ranks.** A save is a collective ([`StagedCheckpoint`] and
//! `Trainer::save_checkpoint`); the race DeepSpeed#7549 describes (ranks
//! creating, renaming and pointing `latest` at one checkpoint dir on their
//! own) cannot happen because only rank 0 touches anything outside a rank
//! dir:
//!
//! 1. Every rank drains its optimizer and param writes; rank 0's pid is
//!    all-gathered, so every rank knows the staging name
//!    `.step-<N>.tmp-<pid of rank 0>`; rank 0 creates it
//!    ([`StagedCheckpoint::begin`]).
//! 2. After an agreement (below), which is also the barrier, every other
//!    rank joins the staging dir ([`StagedCheckpoint::join`]; it fails,
//!    naming the cause, when the save dir is not on a file system every
//!    rank shares). All ranks write their own `rank<RRRR>/` files in
//!    parallel and fsync them.
//! 3. Each rank's layout and file records (lengths, whole-file and region
//!    crcs) are serialised and all-gathered; rank 0 checks the other
//!    ranks' files are there with their recorded lengths
//!    ([`StagedCheckpoint::add_entries`]).
//! 4. With `stage3_gather_16bit_weights_on_model_save`, every param is
//!    gathered from all ranks in order and rank 0 streams the 16-bit
//!    weights into `model.safetensors`.
//! 5. Rank 0 commits: fsyncs, the manifest (every rank's layout, in rank
//!    order) last, rename, `latest`. A final agreement means no rank
//!    returns before the checkpoint is visible.
//!
//! After each phase the ranks agree on its outcome (each rank's error text
//! is all-gathered, `engine::comm::agree`): if any rank failed, every rank
//! fails (the others with an error naming that rank and its message), so
//! none waits for a collective that will never come, and rank 0 removes
//! the staging dir once every rank has stopped writing into it. A joined
//! rank never removes anything.
//!
//! **Resharding.** Loading is by parameter: a parameter's elements are
//! assembled from the shards of every rank in the manifest
//! ([`Checkpoint::load_param_state_range`]), so a checkpoint written by N
//! ranks is read by M ranks (each rank loads exactly its own range of each
//! parameter, one state at a time) or with another `sub_group_size`, and
//! `export` consolidates N shards one parameter at a time. The reader keeps
//! the last region read of each source rank, so each region is read about
//! once. With the same global batch (micro-batch size × accumulation ×
//! ranks) and micro-batch size, a resumed run on M ranks continues
//! bit-identically (`tests/mpi_checkpoint.rs`: 2 → 2, 2 → 1, 1 → 3).

mod export;
mod lock;
mod manifest;
mod reader;
mod writer;

use std::path::PathBuf;

pub use export::{export_safetensors, ConfigJsonAction, ExportReport};
pub use lock::{SaveDirLock, LOCK_FILE};
pub use manifest::{check_relative, seal_manifest_value, MANIFEST_CRC_KEY};
pub use manifest::{
    ConfigFingerprint, DataPosition, FileEntry, HfWeights, LineageEntry, Manifest, ParamEntry,
    RankLayout, RegionCrc, StateKind, SubGroupEntry, FORMAT_NAME, FORMAT_VERSION, MANIFEST_FILE,
    STATE_ALIGN_BYTES,
};
pub use reader::{
    checkpoint_holding, holds_only_staging, is_save_dir_entry, latest_step, saved_steps,
    Checkpoint, FileCheck, VerifyReport,
};
pub use writer::{step_dir_name, StagedCheckpoint, LATEST_FILE};

/// Everything that can go wrong with a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file-system operation failed.
    #[error("checkpoint: {op} {path}: {source}")]
    Io {
        /// What we were doing.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The manifest is missing, unreadable or inconsistent.
    #[error("checkpoint manifest {path}: {reason}")]
    Manifest {
        /// The manifest (or the directory that lacks one).
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A path in the manifest would leave the checkpoint directory.
    #[error("checkpoint manifest names the path `{path}`, which {reason}; refusing to read it")]
    PathEscape {
        /// The path as written in the manifest.
        path: String,
        /// Why it is refused.
        reason: String,
    },
    /// The manifest is of a format version this tierzero does not read.
    /// Never a reason to fall back to an older checkpoint: the newer one
    /// is whole, and a newer tierzero reads it.
    #[error("checkpoint manifest {path}: format version {version}{by}; this tierzero reads version {reads}")]
    Version {
        /// The manifest.
        path: PathBuf,
        /// Its version.
        version: u64,
        /// The version this build reads.
        reads: u32,
        /// " (written by a newer tierzero)" or "".
        by: &'static str,
    },
    /// Data does not match its recorded crc32c.
    #[error(
        "checkpoint {part} in {path} is corrupt: crc32c {got_crc:#010x}, the manifest says \
         {expected_crc:#010x}"
    )]
    Corrupt {
        /// Which part (file, state and sub-group).
        part: String,
        /// The file.
        path: PathBuf,
        /// crc32c recorded in the manifest.
        expected_crc: u32,
        /// crc32c of what was read.
        got_crc: u32,
    },
    /// A file is shorter or longer than the manifest says.
    #[error(
        "checkpoint file {path} has {got_bytes} bytes, the manifest says {expected_bytes} \
         (truncated or replaced?)"
    )]
    Size {
        /// The file.
        path: PathBuf,
        /// Bytes recorded.
        expected_bytes: u64,
        /// Bytes found.
        got_bytes: u64,
    },
    /// An export's output is inside a checkpoint (the one it reads, or
    /// another), or is a save dir's own entry.
    #[error(
        "export output {out} is inside the checkpoint directory {dir}: writing there could \
         replace a file the checkpoint lists; export into a directory outside it"
    )]
    ExportIntoCheckpoint {
        /// The output asked for.
        out: PathBuf,
        /// The checkpoint's directory.
        dir: PathBuf,
    },
    /// A `config.json` beside an export's output holds another model's
    /// config (or another dtype's).
    #[error(
        "{path} is already there with another config (another model, or another --dtype); \
         export into another directory, or remove it"
    )]
    ExportConfigConflict {
        /// The `config.json`.
        path: PathBuf,
    },
    /// The checkpoint does not fit the run.
    #[error(
        "checkpoint and run differ in {what}: the checkpoint has {checkpoint}, the run has {run}"
    )]
    Mismatch {
        /// What differs.
        what: String,
        /// The checkpoint's value.
        checkpoint: String,
        /// The run's value.
        run: String,
    },
    /// A save would replace a directory under a step's name that is not
    /// a checkpoint (no manifest, and an entry no checkpoint holds).
    #[error(
        "{dir} is in the way of this save: it has no manifest.json and holds {entry:?}, which \
         no checkpoint holds, so it is not a checkpoint tierzero wrote and replacing it would \
         delete it; move it out of the save dir, then continue with --resume"
    )]
    NotACheckpoint {
        /// The directory.
        dir: PathBuf,
        /// One entry no checkpoint holds.
        entry: String,
    },
    /// Another process owns the save dir.
    #[error(
        "save dir lock {path} is held by {holder}: another run is saving into this directory; \
         wait for it to finish or give a different --save-dir"
    )]
    Locked {
        /// The lock file.
        path: PathBuf,
        /// `process <pid>` (or `another process` when the pid is unknown).
        holder: String,
    },
    /// From the model area (config, safetensors writing).
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    /// From candle (building tensors).
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
}

impl From<crate::durable::DurableError> for CheckpointError {
    fn from(e: crate::durable::DurableError) -> Self {
        CheckpointError::Io {
            op: e.op,
            path: e.path,
            source: e.source,
        }
    }
}

impl CheckpointError {
    /// Whether the error says a step directory is damaged or incomplete:
    /// missing (or not a directory), a manifest that does not parse (bytes
    /// that are not UTF-8 included), validate or end where it should, a
    /// file of the wrong size or a bad crc. That is what a crash leaves, or
    /// bytes that rotted, and opening a save dir falls back to an older
    /// step from it. An error reading what is there (EIO, EACCES, ESTALE)
    /// or a manifest of a version this build does not read is not: it may
    /// pass, or a newer tierzero reads it, and falling back would resume
    /// from an older step whose next save replaces the newer one.
    pub fn is_damage(&self) -> bool {
        use std::io::ErrorKind;
        match self {
            CheckpointError::Io { source, .. } => matches!(
                source.kind(),
                ErrorKind::NotFound
                    | ErrorKind::NotADirectory
                    | ErrorKind::InvalidData
                    | ErrorKind::UnexpectedEof
                    // A file of the checkpoint that is not a regular file
                    // (`durable::open_regular`: a directory or a FIFO in
                    // the manifest's place blocked every open).
                    | ErrorKind::InvalidInput
                    | ErrorKind::IsADirectory
            ),
            CheckpointError::Manifest { .. }
            | CheckpointError::PathEscape { .. }
            | CheckpointError::Corrupt { .. }
            | CheckpointError::Size { .. }
            | CheckpointError::Model(_) => true,
            _ => false,
        }
    }
}

pub(crate) fn io_err<'a>(
    op: &'static str,
    path: &'a std::path::Path,
) -> impl FnOnce(std::io::Error) -> CheckpointError + 'a {
    move |source| CheckpointError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// The manifest's record of consolidated HF weights.
pub fn manifest_hf_weights(safetensors: &str, config: &str, dtype: &str) -> HfWeights {
    HfWeights {
        safetensors: safetensors.to_owned(),
        config: config.to_owned(),
        dtype: dtype.to_owned(),
    }
}

/// `x` rounded up to the state files' alignment (at least one block).
pub fn align_state_bytes(x: u64) -> Option<u64> {
    x.max(1)
        .checked_add(STATE_ALIGN_BYTES - 1)
        .map(|v| v / STATE_ALIGN_BYTES * STATE_ALIGN_BYTES)
}

//! Errors of the engine area: one enum with structured context. Errors from
//! the areas the engine drives (model, swap, optimizer, candle) are wrapped.

use std::path::PathBuf;

/// Everything that can go wrong in the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A config value the engine cannot run with.
    #[error("engine config: {reason}")]
    Config {
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// The pinned budget cannot hold the buffers the pipelines need.
    #[error(
        "pinned budget of {budget_bytes} bytes is too small: parameter swap buffers need \
         {param_buffers_bytes} bytes ({param_buffer_count} x {param_buffer_bytes}), the optimizer \
         pipeline needs {optimizer_buffers_needed} buffers of {optimizer_buffer_bytes} bytes \
         ({optimizer_stage_buffers} x {optimizer_stages} stages), the gradient park \
         {park_buffers_bytes} bytes; \
         raise tierzero.pinned_budget_bytes to at least {required_bytes} or lower {lower_keys}"
    )]
    PinnedBudget {
        /// The keys that shrink what does not fit.
        lower_keys: &'static str,
        /// The configured budget.
        budget_bytes: u64,
        /// Parameter swap-in buffer count.
        param_buffer_count: u64,
        /// Bytes of each parameter swap-in buffer.
        param_buffer_bytes: u64,
        /// Their total.
        param_buffers_bytes: u64,
        /// Optimizer buffers the pipeline needs.
        optimizer_buffers_needed: u64,
        /// Bytes of each optimizer buffer (largest sub-group, fp32).
        optimizer_buffer_bytes: u64,
        /// Pipeline stages that hold buffers at once.
        optimizer_stages: u64,
        /// What one stage holds: "3 states", or "3 states and the spilled
        /// gradient".
        optimizer_stage_buffers: &'static str,
        /// The gradient park's buffers (several micro-batches).
        park_buffers_bytes: u64,
        /// The smallest budget that works.
        required_bytes: u64,
    },
    /// What the run would page-lock exceeds `RLIMIT_MEMLOCK`, with
    /// `tierzero.memlock: "require"`: the numbers, and the fixes that work
    /// for what it locks.
    #[error(
        "the run page-locks {lock} ({what}) and RLIMIT_MEMLOCK allows {headroom} more \
         ({limit_bytes} bytes, {locked_bytes} locked already). Fix: raise it (`ulimit -l \
         unlimited`, `memlock` in /etc/security/limits.conf, `LimitMEMLOCK=infinity` for \
         systemd, `--ulimit memlock=-1` for docker); or run unlocked: tierzero.memlock \"auto\" \
         (warns and runs unlocked), or pin_memory false in the offload blocks; or lock less: \
         {lower}",
        lock = crate::units::format_bytes(*lock_bytes),
        what = match (lock_bytes.saturating_sub(*cpu_pages_bytes), *cpu_pages_bytes) {
            (_, 0) => "swap buffers".to_owned(),
            (0, _) => "the cpu tier's pages: the params themselves".to_owned(),
            (buffers, pages) => format!(
                "{} of swap buffers, {} of the cpu tier's pages",
                crate::units::format_bytes(buffers),
                crate::units::format_bytes(pages)
            ),
        },
        headroom = crate::units::format_bytes(limit_bytes.saturating_sub(*locked_bytes)),
        lower = [
            (lock_bytes > cpu_pages_bytes).then_some(
                "fewer or smaller swap buffers (zero_optimization.offload_param.buffer_count / \
                 buffer_size, offload_optimizer.buffer_count, sub_group_size; \
                 tierzero.pinned_budget_bytes caps them)"
            ),
            (*cpu_pages_bytes > 0).then_some(
                "the cpu tier's pages, the params, on NVMe instead (offload_param.device \
                 \"nvme\", max_in_cpu 0)"
            ),
        ]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join("; or "),
    )]
    Memlock {
        /// Bytes the run would page-lock (the plan's pinned total, less
        /// what `pin_memory: false` leaves pageable).
        lock_bytes: u64,
        /// Of those, the cpu tier's pages (the params with
        /// `offload_param: cpu`, or `max_in_cpu`'s).
        cpu_pages_bytes: u64,
        /// `RLIMIT_MEMLOCK`'s soft limit.
        limit_bytes: u64,
        /// Bytes this process has locked already.
        locked_bytes: u64,
    },
    /// What the run holds in host memory from its start (its pinned
    /// buffers and pages, its optimizer state in host memory) exceeds the
    /// memory available: the mapping or the allocation would fail, or
    /// the kernel would kill the run.
    #[error(
        "this rank needs {pinned} of pinned buffers and pages ({locked} of them page-locked) \
         and {state} of optimizer state in host memory from its start{working}, and {available} \
         of host memory is available ({swap} more as swap, for what is not page-locked); {fix}",
        pinned = crate::units::format_bytes(*pinned_bytes),
        locked = crate::units::format_bytes(*locked_bytes),
        state = crate::units::format_bytes(*state_bytes),
        working = match *working_bytes {
            0 => String::new(),
            w => format!(
                ", and up to {} more while it steps (the params it computes with, the gradients \
                 it holds, the optimizer's new values: the plan's host rows)",
                crate::units::format_bytes(w)
            ),
        },
        available = crate::units::format_bytes(*available_bytes),
        swap = crate::units::format_bytes(*swap_free_bytes),
    )]
    HostMemory {
        /// With CPU compute: the params in host memory, the gradients it
        /// holds at most and the new-values buffers (0 with a device).
        working_bytes: u64,
        /// What to do, for what this run offloads already.
        fix: String,
        /// The pinned swap buffers and cpu-tier pages
        /// (`Sizing::pinned_total_bytes`).
        pinned_bytes: u64,
        /// Of those, the page-locked (none when they run unlocked).
        locked_bytes: u64,
        /// The optimizer state kept in host memory
        /// (`Sizing::optimizer_host_bytes`).
        state_bytes: u64,
        /// `MemAvailable` when the trainer was built.
        available_bytes: u64,
        /// `SwapFree` then (0 if unknown).
        swap_free_bytes: u64,
    },
    /// A swap file does not fit the free space of its file system: the
    /// numbers, and what this rank's swap under that `nvme_path` comes to.
    #[error(
        "the swap file for {what} ({path}) needs {needed} and its file system has {available} \
         free; this rank's swap under {key} = {dir} needs {rank_total} in all{each}. Free \
         space there, point {key} at a drive with more room, or keep {what} in host memory \
         ({device_key} \"cpu\")",
        what = holds.what(),
        key = holds.path_key(),
        device_key = holds.device_key(),
        path = path.display(),
        dir = dir.display(),
        needed = crate::units::format_bytes_against(*needed_bytes, *available_bytes).0,
        available = crate::units::format_bytes_against(*needed_bytes, *available_bytes).1,
        rank_total = crate::units::format_bytes(*rank_total_bytes),
        each = if *ranks > 1 { format!(" (and each of the {ranks} ranks makes its own)") } else { String::new() },
    )]
    NvmeSpace {
        /// What the file holds.
        holds: crate::engine::sizing::SwapUse,
        /// The configured directory (`holds.path_key()`).
        dir: PathBuf,
        /// The swap file that was to be made.
        path: PathBuf,
        /// Its preallocated size.
        needed_bytes: u64,
        /// Every swap file this rank makes under `dir`
        /// ([`crate::engine::sizing::Sizing::swap_bytes_under`]).
        rank_total_bytes: u64,
        /// The file system's free space when it was checked.
        available_bytes: u64,
        /// The ranks of the run.
        ranks: usize,
    },
    /// A parameter larger than one swap-in buffer.
    #[error(
        "parameter `{name}`, the largest on NVMe, has {numel} elements but a param swap \
         buffer holds {buffer_numel} (offload_param.buffer_size, rounded up to whole 4 KiB \
         blocks); raise offload_param.buffer_size to at least {numel}"
    )]
    ParamTooLarge {
        /// The parameter.
        name: String,
        /// Its elements (this rank's shard).
        numel: u64,
        /// Elements one swap buffer holds (`buffer_size` rounded up to
        /// whole 4 KiB blocks).
        buffer_numel: u64,
    },
    /// An event that the state map does not allow in the current state.
    #[error("parameter `{param}`: event {event} is not valid in state {from}")]
    BadTransition {
        /// Parameter name.
        param: String,
        /// The state it was in.
        from: &'static str,
        /// The event.
        event: &'static str,
    },
    /// A `tokenizer.json` that cannot encode the data.
    #[error("tokenizer {path}: {reason}")]
    Tokenizer {
        /// File.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The token file is unusable.
    #[error("data {path}: {reason}")]
    Data {
        /// File.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// I/O on a file the engine writes (metrics).
    #[error("I/O error on {path}: {source}")]
    Io {
        /// File.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The compute threads could not be started.
    #[error("could not start {threads} compute thread(s): {reason}")]
    ComputeThreads {
        /// Threads asked for.
        threads: usize,
        /// rayon's reason.
        reason: String,
    },
    /// Something the engine does not implement yet.
    #[error("unsupported: {what}")]
    Unsupported {
        /// What.
        what: String,
    },
    /// A collective between ranks failed or timed out.
    #[error("rank {rank} of {world}: {op}: {reason}")]
    Comm {
        /// This rank.
        rank: usize,
        /// Ranks.
        world: usize,
        /// The collective.
        op: &'static str,
        /// What happened.
        reason: String,
    },
    /// The ranks were started with different settings (flags, config,
    /// model or data): their collectives would not match.
    #[error(
        "the ranks were started with different settings: {setting} is {values}; start every \
         rank with the same flags, ds_config.json, model and data (on every node)"
    )]
    RanksDisagree {
        /// The first setting that differs, e.g. "the run's steps (--steps)".
        setting: String,
        /// Each value and the ranks that have it, e.g. "3 on rank 0, 4 on rank 1".
        values: String,
    },
    /// A step failed earlier; the trainer's state is not trustworthy.
    #[error("training stopped after an earlier error (restart from the last checkpoint): {cause}")]
    Stopped {
        /// The first error, as text.
        cause: String,
    },
    /// A stop was requested ([`StopHandle`](crate::engine::StopHandle))
    /// while the trainer was being built: the build ended there, no step
    /// ran, and what it had made (its swap files) was removed.
    #[error(
        "stopped by {} while the trainer was being built ({stored_numel} of {total_numel} \
         elements of the initial state, the model's or the checkpoint's, stored in the tiers): \
         no step was trained, nothing was saved",
        .cause.describe()
    )]
    StoppedInBuild {
        /// Why.
        cause: crate::engine::StopCause,
        /// Elements of initial state (per sub-group numel) this rank had
        /// stored.
        stored_numel: u64,
        /// Elements of initial state this rank stores in all.
        total_numel: u64,
    },
    /// An internal invariant failed (a bug, reported instead of a panic).
    #[error("internal error: {what}")]
    Internal {
        /// What.
        what: String,
    },
    /// From the model.
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    /// From the swap engine.
    #[error("swap: {0}")]
    Swap(#[from] tierzero_swap::SwapError),
    /// From the optimizer.
    #[error("optimizer: {0}")]
    Optim(#[from] crate::optim::OptimError),
    /// From candle.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// From checkpoint saving or loading.
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    /// A durable write (the token cache, see [`crate::durable`]).
    #[error(transparent)]
    Durable(#[from] crate::durable::DurableError),
}

impl EngineError {
    /// Shorthand for [`EngineError::Internal`].
    pub(crate) fn internal(what: impl Into<String>) -> Self {
        EngineError::Internal { what: what.into() }
    }
    /// Shorthand for [`EngineError::Config`].
    pub(crate) fn config(reason: impl Into<String>) -> Self {
        EngineError::Config {
            reason: reason.into(),
        }
    }
}

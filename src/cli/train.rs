//! `tierzero train`: the main job.
//!
//! Design:
//! * **Embedded default.** With no options the run is self-contained: the
//!   embedded `ds_config` (stage 3, params and optimizer state on NVMe under
//!   `./tierzero-swap/`, created if missing), the embedded GPT-2-layout
//!   model config (seeded init) and the shipped corpus
//!   (`tierzero::run`). Each of `--config`, `--model` and `--data`
//!   replaces one of the three. The embedded model config is written to a
//!   private temporary directory only for [`ModelDir::open`] and removed
//!   right after (a seeded model never reads its directory again).
//! * **Steps.** `--steps` is the total number of optimizer steps. It also
//!   fills `scheduler.params.total_num_steps` when the config says
//!   `"auto"` (HF Trainer's rule); a concrete, different value is kept for
//!   the schedule, with a warning (the config layer's fill-only rule, as
//!   accelerate's; HF Trainer refuses the mismatch).
//!   Without `--steps`, a resumed run ends where the run that saved its
//!   checkpoint was to end (`run_steps` in the manifest), a user config
//!   with a concrete `total_num_steps` runs that many steps, anything else
//!   runs [`DEFAULT_STEPS`]; 0 and more than [`MAX_STEPS`] are errors.
//! * **HF Trainer's arguments.** `--micro-batch`, `--grad-accum` and `--lr`
//!   are HF Trainer's `per_device_train_batch_size`,
//!   `gradient_accumulation_steps` and `learning_rate`: they fill the
//!   config's `"auto"` (or absent) `train_micro_batch_size_per_gpu`,
//!   `gradient_accumulation_steps` and `optimizer.params.lr` through the
//!   `RunContext`, and a config that gives a different number is an error
//!   naming the key, both values and the flag (exit 2).
//! * **Errors.** Every number is parsed here, not by clap, so a bad value is
//!   one line naming the flag and the fix (exit 2), like every other user
//!   mistake: missing files, a bad config, a model or data the engine
//!   refuses at start-up. Failures after start-up are internal (exit 1),
//!   except an I/O error the user can fix (no space, permissions).
//! * **Output.** The plan and the summary go to stdout; progress goes to
//!   stderr, as an indicatif bar on a terminal and as plain lines every
//!   `steps_per_print` steps (and the first and last) otherwise. With
//!   `--json`, stdout is only the summary as one JSON object (the plan goes
//!   to stderr), for scripts; a failure's object is `{"error", "failure",
//!   "exit_code"}` (`json_object_on_failure`), printed by rank 0. (A failed
//!   rank other than 0 aborts the rest, rank 0 among them, before it
//!   prints: its stdout is then empty and stderr names the failure.)
//! * **Device.** `--device cuda[:N]` (feature `gpu`) computes the units on
//!   that GPU (`tierzero_gpu`'s CUDA units: the kernels compiled by NVRTC
//!   at start-up, cuBLAS GEMMs, through `TrainerOptions::compute`) and puts
//!   the collectives between ranks on NCCL (`launch::rank_comm_on`); the
//!   params, their tiers and the CPU optimizer stay as configured. The
//!   device tier (`engine::device`) stages each unit's params on the copy
//!   stream while the unit before it computes, and keeps them between
//!   uses within `tierzero.device_cache_bytes` (`"auto"`: while the
//!   tier's share of the device holds them), all within
//!   `tierzero.device_budget_bytes`. Activations and gradients cross per
//!   unit. fp32, bf16 or fp16 (16-bit GEMM operands, 16-bit params and
//!   unit outputs; fp16's loss scale as on the CPU, Adam then on the
//!   host). Without the
//!   feature, a driver, cuBLAS or NVRTC it is refused before anything
//!   loads (exit 2), naming the library and the fix.
//!   `--device sim` runs the same device tier on the simulated device
//!   (`engine::device::sim`): its memory is a budget of host memory, its
//!   copies take their bytes' time at `--sim-h2d-gbps` on a thread, it
//!   computes on the CUDA kernels' scalar references (each unit taking
//!   at least `--sim-compute-ms` on its own clock, asynchronously, as a
//!   GPU's compute is). It shows, with no
//!   GPU, what a config's device tier would hold and overlap: the plan's
//!   device rows, the `h2d_*` metrics and the timeline's device lanes.
//! * **Data.** Byte-level, or a HF `tokenizer.json` with `--tokenizer`
//!   (`cli::tokens`, shared with `eval`).
//! * **Checkpoints.** `--save-dir DIR` saves every `--save-every N` steps
//!   and at the end (`DIR/step-<N>/`, `DIR/latest`; see
//!   `tierzero::checkpoint`). `--resume DIR` (a save dir, meaning its
//!   `latest`, or one step dir) continues from a checkpoint: the model is
//!   the checkpoint's (a `--model` given too must have the same config),
//!   `--seq-len` defaults to the checkpoint's, and `--steps` is still the
//!   total, so the run does `steps - checkpoint step` more (none, with a
//!   message and exit 0, when it is already there). A checkpoint that does
//!   not validate or does not fit the run is bad input (exit 2). Several
//!   ranks: every rank saves its own shard into the same checkpoint (the
//!   save dir must be on a file system every rank sees), and a checkpoint
//!   of N ranks resumes on any number of ranks (each loads its shard).

use std::io::IsTerminal as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::anyhow;
use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use tierzero::checkpoint::{Checkpoint, CheckpointError};
use tierzero::config::{self, ConfigWarning};
use tierzero::data::{DataOrder, TokenData};
use tierzero::engine::{
    EngineError, StepMetrics, StopCause, StopHandle, StopSave, Summary, Timeline, Trainer,
    TrainerOptions,
};
use tierzero::model::{Model, ModelDir};
use tierzero::run::{
    Plan, DEFAULT_CORPUS, DEFAULT_CORPUS_NAME, DEFAULT_MODEL_CONFIG, DEFAULT_SEQ_LEN, DEFAULT_STEPS,
};
use tierzero::units::format_bytes;

use super::{emit, Failure};

mod data;
mod device;
mod failures;
mod flags;
mod model;
mod outputs;
mod report;
mod run_config;
mod steps;
mod timing;
use data::{data_order, load_data, other_data};
use device::{cuda_units, sim_units};
use failures::{corrupt_resume, run_failure, save_failure, startup_failure, stopped_in_build};
pub(super) use flags::number;
use flags::Flags;
pub use report::Ended;
use report::{banner, print_summary, size_and_time, Progress};
use run_config::load_config;
use steps::train_steps;
use timing::{Marks, Startup, Timing};

const EXAMPLES: &str = "\
Examples:
  tierzero train
      the embedded default: a small GPT-2 on the shipped corpus, ZeRO-3 with
      params and optimizer state on NVMe under ./tierzero-swap/
  tierzero train --steps 50 --metrics metrics.jsonl
  tierzero train --config ds_config.json --micro-batch 4 --grad-accum 8 --lr 2e-5
      fills the config's \"auto\" batch sizes and lr, as HF Trainer's arguments do
  tierzero train --config ds_config.json --model ./gpt2 --data corpus.txt --seq-len 256
  tierzero train --steps 100 --save-dir ckpt --save-every 25
      checkpoints in ckpt/step-00000025/ ... and ckpt/latest
  tierzero train --steps 200 --resume ckpt --save-dir ckpt
      continues from ckpt/latest up to step 200: bit-identical to one 200-step
      run when the config's scheduler total_num_steps is a number (\"auto\",
      the embedded config's, follows --steps: the first run decayed its lr to 0)
  TIERZERO_NCCL_ADDR=node0:29500 TIERZERO_RANK=1 TIERZERO_WORLD_SIZE=2 \\
    tierzero train --device cuda
      rank 1 of 2, collectives over NCCL (build with --features gpu)
  tierzero train --device sim --steps 5 --timeline tl.json
      the GPU tier on a simulated device: plan, copy metrics, timeline lanes
";

/// `tierzero train` options.
#[derive(Debug, Args)]
#[command(after_help = EXAMPLES)]
pub struct TrainArgs {
    /// DeepSpeed config (ds_config.json). Default: the embedded config
    /// (stage 3, NVMe offload of params and optimizer state into ./tierzero-swap/).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// HF model directory: config.json plus *.safetensors (GPT-2 or the Llama
    /// family: Llama, Mistral, Qwen2, Qwen3); config.json alone means a model initialised from --seed.
    /// Default: the embedded small GPT-2 (seeded init).
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// Training data: text (byte-level, or documents with --tokenizer),
    /// JSONL, or a token file (see --data-format). Default: the embedded
    /// corpus (data/corpus.txt), byte-level
    #[arg(long, value_name = "FILE")]
    data: Option<PathBuf>,
    /// HF tokenizer.json to turn --data's text into token ids, document by
    /// document, with its truncation and padding off (needs --data; every
    /// id must be below the model's vocab_size)
    #[arg(long, value_name = "tokenizer.json", requires = "data")]
    tokenizer: Option<PathBuf>,
    #[command(flatten)]
    data_options: super::tokens::DataOptions,
    /// Total optimizer steps (also fills scheduler total_num_steps "auto").
    /// Default: with --resume, the saving run's; else the config's
    /// total_num_steps if concrete, else 150.
    #[arg(long, value_name = "N")]
    steps: Option<String>,
    /// Seed of the model init (models without weights) and of the data
    /// shuffle. Default: 1 (with --resume, the checkpoint's shuffle)
    #[arg(long, value_name = "N")]
    seed: Option<String>,
    /// The order each pass over the data reads its windows in: shuffled (a
    /// permutation of --seed, another every pass, as HF Trainer shuffles)
    /// or sequential (file order). Default: with --resume, the
    /// checkpoint's; else shuffled
    #[arg(long, value_name = "ORDER", value_parser = ["shuffled", "sequential"])]
    data_order: Option<String>,
    /// Samples per rank per micro-step, as HF Trainer's
    /// --per_device_train_batch_size: fills train_micro_batch_size_per_gpu
    /// when the config says "auto" or leaves it out; a different number in
    /// the config is an error.
    #[arg(long, value_name = "N")]
    micro_batch: Option<String>,
    /// Gradient accumulation steps, as HF Trainer's
    /// --gradient_accumulation_steps: fills gradient_accumulation_steps
    /// "auto" or absent; a different number in the config is an error.
    #[arg(long, value_name = "N")]
    grad_accum: Option<String>,
    /// Learning rate, as HF Trainer's --learning_rate: fills
    /// optimizer.params.lr "auto" or absent (and so a scheduler's
    /// warmup_max_lr "auto"); a different number in the config is an error.
    #[arg(long, value_name = "X", allow_negative_numbers = true)]
    lr: Option<String>,
    /// Tokens per sample. Default: 128, or the model's maximum positions if
    /// smaller.
    #[arg(long, value_name = "N")]
    seq_len: Option<String>,
    /// Write one JSON line per step and a final summary line to FILE
    /// (with --resume, appended: the resumed run's lines follow the
    /// earlier run's; a step logged after the checkpoint appears again).
    #[arg(long, value_name = "FILE")]
    metrics: Option<PathBuf>,
    /// Write a timeline of a few steps to FILE, as a Chrome trace (open it
    /// in ui.perfetto.dev or chrome://tracing): compute, the waits for
    /// params, the storing of the optimizer's new params, the optimizer
    /// thread's sub-group steps and the disk's busy time (all engines, and
    /// each engine: params, state reads, state writes), one lane each. It
    /// covers --timeline-steps steps after the run's first.
    #[arg(long, value_name = "FILE")]
    timeline: Option<PathBuf>,
    /// How many steps --timeline covers.
    #[arg(long, value_name = "N", default_value = "3", requires = "timeline")]
    timeline_steps: String,
    /// Threads of the CPU Adam kernel, or auto: one when the compute is
    /// on the CPU (it has the cores), half the cores with --device.
    #[arg(long, value_name = "N|auto", default_value = "auto")]
    threads: String,
    /// Save checkpoints under DIR (DIR/step-<N>/ and DIR/latest), every
    /// --save-every steps and at the end of the run.
    #[arg(long, value_name = "DIR")]
    save_dir: Option<PathBuf>,
    /// Save a checkpoint every N steps (needs --save-dir). Default: only at
    /// the end.
    #[arg(long, value_name = "N")]
    save_every: Option<String>,
    /// On SIGINT, SIGTERM or SIGHUP, the run stops at the next step
    /// boundary, saves that step (with --save-dir), removes its swap files,
    /// prints the summary and exits 130 (SIGINT), 143 (SIGTERM) or 129
    /// (SIGHUP; ignored when started under nohup); a second signal
    /// aborts at once. This bounds that stop, from the signal to the exit,
    /// in seconds: a save that would not fit is skipped (and said so).
    /// Default: tierzero.stop_grace_s, else no bound.
    #[arg(long, value_name = "SECONDS")]
    stop_grace: Option<String>,
    /// Continue from a checkpoint: a save dir (its `latest`) or a step dir.
    /// --steps stays the total; without it, the run that saved the
    /// checkpoint is continued to its end. Give that run's --config and
    /// --data (the model, --seq-len, --seed and data order default to the
    /// checkpoint's).
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
    /// Print only the final summary on stdout, as one JSON object (the plan
    /// and progress go to stderr); a failure prints {"error", "failure",
    /// "exit_code"} instead.
    #[arg(long)]
    json: bool,
    /// Recompute every block's activations in backward instead of keeping
    /// them, as HF Trainer's --gradient_checkpointing (and DeepSpeed's
    /// activation_checkpointing block): the least memory, one more forward
    /// per step. Default: tierzero.activation_budget_bytes ("auto": blocks
    /// keep their forward graphs while half the available memory holds
    /// them).
    #[arg(long)]
    gradient_checkpointing: bool,
    /// cpu, or cuda / cuda:N: forward and backward run on that GPU (the
    /// CUDA units: fp32, bf16 or fp16, kernels compiled by NVRTC at start-up, cuBLAS) and
    /// the collectives between ranks over NCCL (build with --features gpu;
    /// the NVIDIA driver, cuBLAS, NVRTC and NCCL are needed to run). Params
    /// and the optimizer stay on their configured tiers (Adam on the CPU);
    /// with nothing offloaded, params, gradients and Adam stay on the
    /// device.
    /// sim: the device tier on a simulated device (no GPU; see
    /// --sim-h2d-gbps and tierzero.device_budget_bytes, 1 GiB if unset).
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    device: String,
    /// With --device sim: the simulated link's bandwidth, each way,
    /// in GB/s (default 25, about PCIe 4.0 x16's).
    #[arg(long, value_name = "GBPS")]
    sim_h2d_gbps: Option<String>,
    /// With --device sim: the least each unit's compute takes on the
    /// simulated device, in milliseconds; its compute is then
    /// asynchronous, as a GPU's is (default 0: as long as the reference
    /// kernels take, on the host).
    #[arg(long, value_name = "MS")]
    sim_compute_ms: Option<String>,
    /// Open --model even when its config.json has keys tierzero does not
    /// know (each is warned about and ignored): at your own risk, the model
    /// trained may not be the one the file describes.
    #[arg(long)]
    allow_unknown_model_keys: bool,
}

pub(super) fn bad(msg: impl Into<String>) -> Failure {
    Failure::BadInput(anyhow!(msg.into()))
}

pub(super) fn must_exist(flag: &str, path: &Path, dir: bool, fix: &str) -> Result<(), Failure> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() == dir => Ok(()),
        Ok(_) => Err(bad(format!(
            "{flag} {}: is {}; {fix}",
            path.display(),
            if dir {
                "not a directory"
            } else {
                "a directory"
            }
        ))),
        Err(e) => Err(bad(format!("{flag} {}: {e}; {fix}", path.display()))),
    }
}

/// Names the flag behind a run value the config contradicts
/// ([`config::ConfigError::RunMismatch`] names the `RunContext` field).
fn flag_names(e: config::ConfigError) -> config::ConfigError {
    match e {
        config::ConfigError::RunMismatch {
            key,
            config_value,
            run_value,
            run_source,
        } => {
            let flag = match run_source.as_str() {
                "micro_batch_size" => "--micro-batch",
                "gradient_accumulation_steps" => "--grad-accum",
                "learning_rate" => "--lr",
                other => other,
            };
            config::ConfigError::RunMismatch {
                key,
                config_value,
                run_value,
                run_source: flag.to_owned(),
            }
        }
        other => other,
    }
}

fn print_warning(w: &ConfigWarning) {
    errln!("warning: {w}");
}

/// What the start-up lines and the summary say about the run.
struct RunInfo<'a> {
    data_name: &'a str,
    config_name: &'a str,
    steps: u64,
    start_step: u64,
    seq_len: usize,
    tokens_per_step: u64,
    seed: u64,
    data_order: DataOrder,
    ranks: usize,
    /// Rank 0: it prints.
    lead: bool,
    /// Samples per optimizer step, all ranks.
    train_batch_size: u64,
    /// `steps_per_print`: the progress line interval.
    steps_per_print: u64,
    /// The step of the checkpoint resumed from, when it is in --save-dir.
    resumed_from: Option<u64>,
    /// The optimizer, schedule, clipping and precision, and what "auto" took.
    training: String,
}

/// How a run's steps ended.
struct Steps {
    first: StepMetrics,
    last: StepMetrics,
    /// Set when a signal stopped the run early.
    stop: Option<Stopped>,
    /// Seconds of the steps' time spent in checkpoint saves (their
    /// optimizer tails included).
    save_s: f64,
}

/// A run stopped early.
struct Stopped {
    cause: StopCause,
    /// With --save-dir: the step of the newest checkpoint of this run or
    /// the one it resumed from (`None`: none).
    checkpoint_step: Option<u64>,
}

/// An armed failpoint that never fired (the run was shorter than the
/// point): the counts of every site let a test pick points that exist.
fn report_unreached_failpoint() {
    if let Some(a) = tierzero::failpoint::check_env()
        .ok()
        .flatten()
        .filter(|a| tierzero::failpoint::hits(a.site) < a.nth)
    {
        errln!(
            "failpoint {}:{} was not reached; hits: {}",
            a.site.name(),
            a.nth,
            tierzero::failpoint::Site::ALL
                .map(|s| format!("{}={}", s.name(), tierzero::failpoint::hits(s)))
                .join(" ")
        );
    }
}

/// Runs `tierzero train`.
pub fn run(args: TrainArgs) -> Result<Ended, Failure> {
    // First: a signal during start-up (MPI's, the data's) is kept, not fatal.
    super::signals::register_early()?;
    // Until the ranks are known, the rank that prints is the one mpirun
    // numbers 0 (or the only one).
    super::json_object_on_failure(args.json && super::launch::env_rank_is_lead());
    let started = Instant::now();
    // Several ranks (under mpirun): rank 0 prints and writes --metrics, the
    // others only log (see launch.rs).
    let simulated = args.device.trim() == "sim";
    let device = match simulated {
        true => None,
        false => tierzero::gpu::parse_device(&args.device)
            .map_err(|e| bad(format!("{e}, or sim (a simulated device)")))?,
    };
    if args.sim_h2d_gbps.is_some() && !simulated {
        return Err(bad(format!(
            "--sim-h2d-gbps is the simulated device's bandwidth and --device is {}; add \
             --device sim, or drop --sim-h2d-gbps",
            args.device
        )));
    }
    if args.sim_compute_ms.is_some() && !simulated {
        return Err(bad(format!(
            "--sim-compute-ms is the simulated device's compute time and --device is {}; add \
             --device sim, or drop --sim-compute-ms",
            args.device
        )));
    }
    let comm = super::launch::rank_comm_on(device)?;
    let lead = comm.rank() == 0;
    super::json_object_on_failure(args.json && lead);
    let flags = Flags::parse(&args)?;
    // From here on SIGINT and SIGTERM end the start-up at once, and once
    // the trainer's build begins stop at a step boundary (see `signals`).
    let stop = StopHandle::new();
    if args.json && lead {
        super::signals::json_summary_at_startup_exit();
    }
    super::signals::install(stop.clone())?;
    if flags.save_every.is_some() && args.save_dir.is_none() {
        return Err(bad(
            "--save-every needs --save-dir DIR (where to put the checkpoints)",
        ));
    }
    if let Err(e) = tierzero::failpoint::check_env() {
        return Err(bad(e));
    }
    data::check_data_flags(&args)?;
    let save_lock = outputs::claim_save_dir(&args, lead)?;
    super::signals::at_startup_exit(save_lock.removal());
    let ckpt = match &args.resume {
        Some(d) => {
            let fix = "give a save dir (with `latest`) or a step-<N> directory";
            // A file (its manifest.json) or a path that is not there: said
            // as such, not as "reading .../manifest.json/latest: Not a
            // directory" or "listing ...".
            must_exist("--resume", d, true, fix)?;
            Some(Checkpoint::open(d).map_err(|e| {
                // A step dir given that is damaged: "give a step dir" was
                // the fix for what the user did.
                let step_dir = d.join(tierzero::checkpoint::MANIFEST_FILE).exists();
                match d.parent().filter(|p| !p.as_os_str().is_empty()) {
                    Some(save_dir) if step_dir && e.is_damage() => bad(format!(
                        "--resume {}: {e}; this checkpoint is damaged: resume from the save dir \
                         (--resume {}: its newest valid step) or an older step-<N> directory, \
                         after checking them with `tierzero inspect {} --verify`",
                        d.display(),
                        save_dir.display(),
                        save_dir.display()
                    )),
                    // Only a save's staging dir: the run was killed in
                    // its first save, and an auto-restart given the same
                    // --resume failed for good.
                    _ if tierzero::checkpoint::holds_only_staging(d) => bad(format!(
                        "--resume {}: {e}; it holds only the staging dir of a save that never \
                         completed (a run stopped in its first save): there is nothing to \
                         resume; run it again without --resume (the next save removes the \
                         staging dir)",
                        d.display()
                    )),
                    _ => bad(format!("--resume {}: {e}; {fix}", d.display())),
                }
            })?)
        }
        None => None,
    };
    if let Some((c, why)) = ckpt.as_ref().and_then(|c| Some((c, c.latest_unusable()?))) {
        // Resuming from the newest valid save is what a crash calls for.
        tracing::warn!(error = %why, using = %c.dir().display(), "`latest` is unusable; resuming from the newest valid checkpoint below it");
    }
    outputs::check_save_dir_is_this_runs(&args, ckpt.as_ref())?;
    // Each rank opened the save dir itself: the ranks agree on the step
    // (and on resuming at all) before any of them can end alone (already
    // at --steps) and leave the others waiting in a collective; and on the
    // compute's kind before the simulated device's own collectives (a rank
    // without it met them in another: a hang, or one's bytes read as the
    // other's message).
    let compute_kind = match (simulated, device.is_some()) {
        (true, _) => "sim",
        (false, true) => "cuda",
        (false, false) => "cpu",
    };
    tierzero::engine::comm::same_on_every_rank(
        &*comm,
        &[
            ("the compute device (--device)", compute_kind.to_owned()),
            (
                "the step resumed from (--resume)",
                ckpt.as_ref()
                    .map_or_else(|| "none".to_owned(), |c| format!("step {}", c.step())),
            ),
        ],
    )
    .map_err(|e| bad(e.to_string()))?;
    let (mut model_dir, mut model) = model::open_model(&args, flags.seed, ckpt.as_ref())?;
    let mc = model.config().clone();
    let seq_len = match (&args.seq_len, &ckpt) {
        (Some(s), _) => {
            let n = number("--seq-len", s, 1, u64::MAX)?;
            if n > mc.max_seq_len as u64 {
                return Err(bad(format!(
                    "--seq-len {n} is longer than the model's {} positions ({}'s {}); give \
                     --seq-len {} or less",
                    mc.max_seq_len,
                    ckpt.as_ref()
                        .map_or("its config.json", |_| "the checkpoint's model config"),
                    match mc.arch {
                        tierzero::model::Arch::Gpt2 => "n_positions",
                        tierzero::model::Arch::Llama => "max_position_embeddings",
                    },
                    mc.max_seq_len
                )));
            }
            n as usize
        }
        (None, Some(c)) => c.manifest().seq_len.min(mc.max_seq_len),
        (None, None) => DEFAULT_SEQ_LEN.min(mc.max_seq_len),
    };
    // The config and the output paths before the data: encoding a corpus
    // may take hours, and a typo in either is refused before it.
    let (loaded, config_name, steps, made_swap_dirs) =
        load_config(&args, &flags, &model, comm.world_size(), ckpt.as_ref())?;
    let cfg = &loaded.config;
    let data_order = data_order(&args, flags.seed, ckpt.as_ref());
    data::check_resumed_config(&args, cfg, data_order, ckpt.as_ref())?;
    data::check_resumed_data(&args, ckpt.as_ref())?;
    outputs::check_output_dirs(&args)?;
    let metrics_fifo = lead
        .then(|| outputs::metrics_fifo_held(&args))
        .transpose()?;
    let (data, data_name, data_line, eos) = load_data(&args, &model)?;
    // The EOS the documents end with, where the model's config names none
    // (a seeded model given a tokenizer's): recorded with the model, so
    // that its checkpoints and export say where generation stops (the
    // export named none, and transformers filled in its family's default,
    // Llama's 2, or GPT-2's 50256 past a small vocabulary).
    if let (Some(id), None) = (eos, model.token_ids().eos()) {
        let ids = model.token_ids().clone().with_eos_if_none(u64::from(id));
        model = model.with_token_ids(ids.clone());
        model_dir = model_dir.map(|md| md.with_token_ids(ids));
    }
    // One micro-batch's rows must be distinct windows of the corpus: a pass
    // holds a micro-batch. (One read across two passes may still hold a
    // window of both, as an epoch's last batch and the next one's first.)
    // (Saturating: the config's micro-batch is bounded only by its product
    // with the accumulation and the ranks; one that large fails here.)
    let micro_tokens = cfg
        .batch
        .micro_batch_size
        .saturating_mul(seq_len as u64)
        .saturating_add(1);
    if (data.len() as u64) < micro_tokens {
        // A product past u64 is the config's batch size, not the data's
        // fault (it printed the saturated number as the product).
        let needed = match micro_tokens {
            u64::MAX => "more than 2^64".to_owned(),
            n => n.to_string(),
        };
        return Err(bad(format!(
            "--data {data_name}: {} tokens are fewer than one micro-batch needs \
             (train_micro_batch_size_per_gpu {} × --seq-len {seq_len} + 1 = {needed}); \
             give more data, or a smaller micro-batch or --seq-len",
            data.len(),
            cfg.batch.micro_batch_size
        )));
    }
    let timeline_steps = number("--timeline-steps", &args.timeline_steps, 1, 1000)?;

    // With --json, stdout carries only the summary object; under several
    // ranks only rank 0 prints.
    let say = |text: &str| -> Result<(), Failure> {
        if !lead {
            Ok(())
        } else if args.json {
            err_text!("{text}");
            Ok(())
        } else {
            emit(text)
        }
    };

    // Engine.
    let start_step = ckpt.as_ref().map_or(0, |c| c.step());
    let timeline = args.timeline.as_ref().filter(|_| lead).map(|_| {
        let (first, last) = Timeline::window(start_step, steps, timeline_steps);
        Timeline::new(first, last)
    });
    // --device cuda: the units on that GPU (tierzero-gpu's CUDA units).
    let compute = match device {
        None if simulated => Some(sim_units(
            args.sim_h2d_gbps.as_deref(),
            args.sim_compute_ms.as_deref(),
            cfg,
            &model,
            seq_len,
            comm.clone(),
        )?),
        None => None,
        Some(d) => Some(cuda_units(d, cfg, &model, seq_len, &*comm)?),
    };
    let opts = TrainerOptions {
        compute: compute.clone(),
        adam_threads: flags.threads,
        metrics_path: args.metrics.clone().filter(|_| lead),
        metrics_append: args.resume.is_some(),
        run_steps: Some(steps),
        timeline: timeline.clone(),
        comm: comm.clone(),
        stop,
        stop_grace: flags.stop_grace,
        data_order,
        ..TrainerOptions::cpu(flags.seed, seq_len)
    };
    // A checkpoint resumed from in the save dir is the one a stop that
    // skips its save leaves newest.
    let resumed_from = match (&ckpt, &args.save_dir) {
        (Some(c), Some(d)) if outputs::resumes_from_save_dir(&args, Some(c), d) => Some(c.step()),
        _ => None,
    };
    let run = RunInfo {
        data_name: &data_name,
        config_name: &config_name,
        steps,
        start_step,
        seq_len,
        // Tokens of the global batch (every rank's micro-batches).
        tokens_per_step: cfg.batch.train_batch_size.saturating_mul(seq_len as u64),
        // A resumed run's model was initialised from the checkpoint's run's
        // seed (this run's initialises nothing).
        seed: ckpt.as_ref().map_or(flags.seed, |c| c.manifest().seed),
        data_order,
        ranks: comm.world_size(),
        lead,
        train_batch_size: cfg.batch.train_batch_size,
        steps_per_print: cfg.steps_per_print,
        resumed_from,
        training: tierzero::run::describe_training(cfg, steps, &loaded.resolved),
    };
    // What only this loop decides, agreed before any rank acts on it (the
    // trainer agrees on the rest as it is built): a rank with another
    // --steps or --save-every would meet the others in another collective.
    tierzero::engine::comm::same_on_every_rank(
        &*comm,
        &[
            ("the run's steps (--steps)", steps.to_string()),
            (
                "the step it resumes from (give every rank --resume of one step-<N> dir, on a \
                 file system they all see alike)",
                start_step.to_string(),
            ),
            (
                "--save-every (with --save-dir)",
                match (flags.save_every, &args.save_dir) {
                    (Some(n), Some(_)) => n.to_string(),
                    (None, Some(_)) => "only at the end".to_owned(),
                    (_, None) => "no saves (no --save-dir)".to_owned(),
                },
            ),
        ],
    )
    .map_err(startup_failure)?;
    let nvme_paths: Vec<&Path> = [
        &cfg.zero.offload_param.device,
        &cfg.zero.offload_optimizer.device,
    ]
    .into_iter()
    .filter_map(|d| d.nvme_path())
    .collect();
    // Swap files a run of another number of ranks left when it was killed
    // (in <nvme_path> itself, or rank<R> dirs beyond this run's), which no
    // run of this count would look at: reclaimed by rank 0, skipping a dir
    // a live run holds.
    if lead {
        let mut seen = Vec::new();
        for p in &nvme_paths {
            for dir in tierzero::engine::trainer::other_rank_counts_swap_dirs(p, comm.world_size())
            {
                if seen.contains(&dir) {
                    continue;
                }
                match tierzero_swap::space::reclaim_stale_files(&dir) {
                    Ok(()) | Err(tierzero_swap::SwapError::Locked { .. }) => {}
                    Err(e) => {
                        tracing::warn!(path = %dir.display(), error = %e, "could not reclaim stale swap files")
                    }
                }
                seen.push(dir);
            }
        }
    }
    if start_step >= steps {
        // A run killed after its last save left its swap files; reclaim
        // them as a run that builds its tiers would.
        for p in &nvme_paths {
            let base = tierzero::engine::trainer::rank_swap_dir(p, comm.rank(), comm.world_size());
            if let Err(e) = tierzero_swap::space::reclaim_stale_files(&base) {
                tracing::warn!(path = %base.display(), error = %e, "could not reclaim stale swap files");
            }
        }
        say(&report::nothing_to_do(
            &args,
            ckpt.as_ref(),
            start_step,
            steps,
        ))?;
        if args.json && lead {
            // stdout is the summary object with --json: one here too,
            // saying no step ran.
            emit(&format!(
                "{}\n",
                serde_json::json!({"steps": start_step, "steps_run": 0, "nothing_to_do": true})
            ))?;
        }
        return Ok(Ended::Done);
    }
    let built = Instant::now();
    super::signals::trainer_build_begins();
    let built_trainer = match (&ckpt, &model_dir) {
        (Some(c), _) => Trainer::resume(cfg, c, data, opts),
        (None, Some(md)) => Trainer::new(cfg, md, data, opts),
        (None, None) => return Err(Failure::Internal(anyhow!("no model"))),
    };
    let mut trainer = match built_trainer {
        Err(e @ EngineError::StoppedInBuild { .. }) => {
            return stopped_in_build(&e, &*comm, &args, start_step)
        }
        r => r.map_err(|e| match &ckpt {
            Some(c) => corrupt_resume(e, c),
            None => startup_failure(e),
        })?,
    };
    super::signals::trainer_built();
    drop(metrics_fifo);
    let build_s = built.elapsed().as_secs_f64();
    if let Some(c) = &ckpt {
        // The load: the checkpoint's state streamed into the tiers.
        say(&format!(
            "checkpoint: step {} loaded from {} ({})\n",
            c.step(),
            c.dir().display(),
            size_and_time(c.dir(), built.elapsed().as_secs_f64())
        ))?;
    }
    if let Some(c) = ckpt
        .as_ref()
        .filter(|c| other_data(&c.manifest().data.source, &data_name))
    {
        // The data position is a sample count: it carries over to other
        // data, which is what a user switching datasets may mean, but
        // should know.
        tracing::warn!(
            checkpoint = %c.manifest().data.source,
            run = %data_name,
            samples_consumed = c.manifest().data.samples_consumed,
            "the data differs from the checkpoint's: training continues at the same sample \
             count in the new data"
        );
    }
    trainer.set_data_name(data_name.clone());
    if let Some(lock) = save_lock.into_lock() {
        trainer.adopt_save_dir_lock(lock);
    }
    made_swap_dirs.keep();
    let threads_line = format!("{}; {}", trainer.compute_threads(), trainer.placement());
    let mut plan = Plan::new(
        cfg,
        trainer.model(),
        trainer.layout(),
        trainer.sizing(),
        match (device, &compute) {
            (Some(d), Some(c)) => format!(
                "{}; host side {threads_line} (collectives: NCCL on {d})",
                c.describe()
            ),
            (None, Some(c)) => format!("{}; host side {threads_line}", c.describe()),
            _ => format!("cpu, {threads_line}"),
        },
    );
    plan.activations = Some(trainer.activations_line());
    plan.pages_registered = trainer.pages_registered();
    plan.swap_buffers_registered = trainer.swap_buffers_registered();
    plan.comm_staging = comm.staging_bytes();
    plan.device_memory = compute
        .as_ref()
        .and_then(|c| c.memory_plan(trainer.model()));
    say(&banner(
        &args,
        ckpt.as_ref(),
        model_dir.as_ref(),
        &trainer,
        &plan,
        &run,
    ))?;
    if let Some(line) = &data_line {
        say(&format!("{line}\n"))?;
    }

    // Train.
    let train_started = Instant::now();
    if start_step > 0 {
        say(&format!(
            "resuming at step {start_step} of {steps} from {}\n",
            ckpt.as_ref()
                .map_or(String::new(), |c| c.dir().display().to_string())
        ))?;
    }
    let ran = match train_steps(&mut trainer, &args, &flags, &run, &say) {
        Ok(ran) => ran,
        Err(e) if comm.world_size() > 1 => {
            // The other ranks wait in their next collective until `main`
            // aborts them: not after this trainer's drop has run the
            // optimizer thread's queued steps and removed its swap files
            // (minutes, maybe past their timeout, whose error is not this
            // one). The files are reclaimed at the next start.
            std::mem::forget(trainer);
            return Err(e);
        }
        Err(e) => return Err(e),
    };
    let train_s = train_started.elapsed().as_secs_f64();
    let steps_ended = Instant::now();
    let build_times = trainer.build_times();
    // A metrics file that could not be written stopped the metrics, not
    // the run (a full disk under --metrics ended it with no checkpoint):
    // said after the summary, exit 2 as the disk is the user's.
    let metrics_failed = trainer.metrics_failure().map(str::to_owned);
    // Dropping the trainer (in `finish`) removes its swap files.
    let summary = trainer
        .finish()
        .map_err(|e| run_failure(e, "finishing the run"))?;
    if comm.world_size() > 1 {
        // No rank exits non-zero (a stop's code, or rank 0's failed
        // timeline or summary below: `main` then aborts the rest) before
        // every rank has removed its swap files.
        comm.barrier()
            .map_err(|e| run_failure(e, "finishing the run"))?;
    }
    let ended = match &ran.stop {
        None => Ended::Done,
        Some(s) => Ended::Stopped {
            exit_code: super::signals::exit_code(s.cause),
        },
    };
    // A timeline that cannot be written (the disk filled during the run)
    // does not cost the summary, nor a stop its exit code: it is said
    // once, as the error of a run that ended (after its summary: exit 2
    // where the disk, a limit or permissions refused it, as for
    // --metrics; it was exit 1, "internal error"), or logged after a stop.
    let timeline_failed = match (&timeline, &args.timeline) {
        (Some(tl), Some(path)) => tl.write(path).err().map(|e| {
            let users = super::user_fixable_io(&e.source);
            let e = anyhow!(
                "--timeline: writing {}: {e}{}",
                path.display(),
                if users {
                    "; the run went on to its end: free space there, or give --timeline a \
                     path on another disk"
                } else {
                    ""
                }
            );
            if users {
                Failure::BadInput(e)
            } else {
                Failure::Internal(e)
            }
        }),
        _ => None,
    };
    report_unreached_failpoint();
    if !lead {
        // (Only rank 0 writes a timeline.)
        return Ok(ended);
    }
    let timing = Timing::new(Marks {
        started,
        built,
        build_s,
        build_times,
        train_started,
        train_s,
        steps_ended,
    });
    let written = timeline.as_deref().filter(|_| timeline_failed.is_none());
    let metrics_failed = metrics_failed.map(|why| {
        Failure::BadInput(anyhow!(
            "--metrics: {why}; the metrics stopped there, the run went on to its end"
        ))
    });
    // A run that ends with one of these fails (after its summary): the
    // `--json` summary, stdout's one object, says so too (`error`,
    // `failure`, `exit_code`, as a failure's object), where it read as a
    // success under exit 2.
    let ending_failure = match &ended {
        Ended::Done => metrics_failed.as_ref().or(timeline_failed.as_ref()),
        Ended::Stopped { .. } => None,
    };
    print_summary(&args, &run, &summary, &ran, timing, written, ending_failure)?;
    if let Some(f) = metrics_failed {
        match &ended {
            Ended::Done => return Err(f),
            Ended::Stopped { .. } => tracing::error!("{:#}", f.error()),
        }
    }
    match (timeline_failed, &ended) {
        (Some(f), Ended::Done) => Err(f),
        (Some(f), Ended::Stopped { .. }) => {
            tracing::error!("{:#}", f.error());
            Ok(ended)
        }
        (None, _) => Ok(ended),
    }
}

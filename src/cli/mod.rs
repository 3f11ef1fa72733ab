//! The `tierzero` command line.
//!
//! Exit codes: 0 on success, 2 on bad input (clap usage errors, invalid
//! values, paths that do not exist, configurations that cannot work), 1 on
//! internal failure; `train` stopped by a signal at a step boundary: 130
//! (SIGINT) or 143 (SIGTERM) (see `signals`). A user's mistake is reported as one clear line, never
//! as a panic or a backtrace.

/// `println!` for the benches' reports: through [`emit`], so a closed
/// stdout (`tierzero bench-io ... | head`) ends the output rather than
/// panicking. (Defined before the modules that use it.)
macro_rules! outln {
    ($($t:tt)*) => {{
        $crate::cli::emit_noted(&format!("{}\n", format_args!($($t)*)));
    }};
}

/// `eprintln!` / `eprint!` that ignore a failed write: stderr may be a
/// pipe whose reader has gone (`tierzero train 2>&1 | head`), and the run
/// goes on to its saves and its summary (`eprintln!` panicked there: exit
/// 101 mid-run).
macro_rules! errln {
    () => {
        $crate::cli::to_stderr(format_args!("\n"))
    };
    ($($t:tt)*) => {
        $crate::cli::to_stderr(format_args!("{}\n", format_args!($($t)*)))
    };
}
macro_rules! err_text {
    ($($t:tt)*) => {
        $crate::cli::to_stderr(format_args!($($t)*))
    };
}

pub mod bench_adam;
pub mod bench_io;
pub mod estimate;
pub mod eval;
pub mod export;
pub mod gpu_info;
pub mod inspect;
pub mod launch;
pub mod signals;
mod tokens;
pub mod train;

use clap::{Parser, Subcommand};

/// tierzero: train models larger than GPU memory by streaming parameters,
/// gradients and optimizer state between device, pinned host memory and NVMe.
#[derive(Debug, Parser)]
#[command(name = "tierzero", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    // Boxed: `train` has by far the most flags (clippy::large_enum_variant).
    /// Train a model with ZeRO-3 offload (no options: the embedded default,
    /// a small GPT-2 with params and optimizer state on NVMe in ./tierzero-swap/).
    Train(Box<train::TrainArgs>),
    /// Measure NVMe read/write bandwidth across block sizes and queue depths.
    BenchIo(bench_io::BenchIoArgs),
    /// Sweep I/O settings and print a ready-to-paste ds_config "aio" block.
    Tune(bench_io::TuneArgs),
    /// Benchmark the CPU AdamW kernels against a memory-bandwidth probe and
    /// the two-pass (step, then convert) baseline.
    BenchAdam(bench_adam::BenchAdamArgs),
    /// Memory needs per ZeRO stage and offload choice (device, pinned and
    /// pageable host memory, NVMe), and what fits on this machine.
    Estimate(estimate::EstimateArgs),
    /// Mean next-token cross-entropy and perplexity of a model on a text
    /// (non-overlapping windows, HF's labels=input_ids convention).
    Eval(eval::EvalArgs),
    /// Consolidate a checkpoint into one safetensors file with HF tensor
    /// names (our zero_to_fp32), plus config.json beside it.
    Export(export::ExportArgs),
    /// Run N ranks of `tierzero train` as N processes through mpirun
    /// (build with `--features mpi`): `tierzero launch --nproc 2 -- train ...`.
    Launch(launch::LaunchArgs),
    /// Summarise a checkpoint (step, model, files, --verify crcs) or a swap
    /// directory (our swap files, their owners, and which are stale).
    Inspect(inspect::InspectArgs),
    /// CUDA devices and NCCL this process can use (build with `--features
    /// gpu`); `--nccl-test` checks the NCCL collectives between the ranks.
    GpuInfo(gpu_info::GpuInfoArgs),
}

/// A failure, classified for the exit code.
#[derive(Debug)]
pub enum Failure {
    /// The user's input cannot work (exit 2).
    BadInput(anyhow::Error),
    /// Something broke inside (exit 1).
    Internal(anyhow::Error),
}

/// The text of a `--config` file, for `train` and `estimate`: an
/// unreadable file or one that is not UTF-8 is the user's, named with the
/// fix (a UTF-16 file read "stream did not contain valid UTF-8").
pub(crate) fn read_config_text(p: &std::path::Path) -> Result<String, Failure> {
    // A regular file or a pipe (`--config <(jq ...)`), of a config's size:
    // `/dev/zero` was read until memory ran out.
    const MAX_CONFIG_BYTES: u64 = 64 << 20;
    let bytes = tierzero::durable::read_file_or_pipe(p, MAX_CONFIG_BYTES).map_err(|e| {
        Failure::BadInput(anyhow::anyhow!(
            "--config {}: cannot read it: {e}",
            p.display()
        ))
    })?;
    String::from_utf8(bytes).map_err(|_| {
        Failure::BadInput(anyhow::anyhow!(
            "--config {}: not UTF-8 text (saved as UTF-16 or Latin-1?); save it as UTF-8, as \
             DeepSpeed reads it",
            p.display()
        ))
    })
}

/// Whether an I/O error, met at a path the user gave, is theirs to fix
/// (exit 2): the path is missing, not allowed, read-only, a directory
/// where a file goes (or the reverse), a name too long, the disk or a
/// limit is full, or the open-file limit is reached. (Not `InvalidInput`:
/// `EINVAL` from an mmap or a ring's setup is ours.)
pub(crate) fn user_fixable_io(e: &std::io::Error) -> bool {
    use std::io::ErrorKind as K;
    matches!(
        e.kind(),
        K::NotFound
            | K::PermissionDenied
            | K::AlreadyExists
            | K::ReadOnlyFilesystem
            | K::NotADirectory
            | K::IsADirectory
            | K::InvalidFilename
            | K::StorageFull
            | K::QuotaExceeded
            | K::FileTooLarge
    ) || tierzero_swap::process::is_open_file_limit(e)
}

/// The fix for a failure whose cause is the open-file limit (`EMFILE`,
/// `ENFILE`, anywhere in its chain), with the limit's numbers: every
/// command's failure is looked at, so one that met the limit where no
/// caller expected it (a ring's setup, a checkpoint file, the data) is
/// exit 2 with the fix, not an internal error. `None` for other failures.
fn open_file_limit_fix(e: &anyhow::Error) -> Option<String> {
    let io = e
        .chain()
        .filter_map(|c| c.downcast_ref::<std::io::Error>())
        .find(|io| tierzero_swap::process::is_open_file_limit(io))?;
    if io.raw_os_error() == Some(libc::ENFILE) {
        return Some(
            "the system's table of open files is full (ENFILE): close other programs' files or \
             raise fs.file-max (sysctl), then run it again"
                .to_owned(),
        );
    }
    let shown = |v: Option<u64>| v.map_or("unlimited".to_owned(), |v| v.to_string());
    Some(match tierzero_swap::process::open_file_limit() {
        Ok(l) => format!(
            "the process's open-file limit is reached (ulimit -n: soft {}, hard {}; tierzero \
             raises the soft one to at most {} itself): raise the hard limit (`ulimit -Hn`, \
             `nofile` in /etc/security/limits.conf, `LimitNOFILE=` for systemd, `--ulimit \
             nofile=` for docker), then run it again",
            shown(l.soft),
            shown(l.hard),
            tierzero_swap::process::OPEN_FILES_WANTED,
        ),
        Err(_) => "the process's open-file limit is reached (EMFILE): raise it (ulimit -n), \
             then run it again"
            .to_owned(),
    })
}

/// The fix for a failure whose cause is the file-size limit (`EFBIG`
/// from `RLIMIT_FSIZE`, anywhere in its chain), where the text does not
/// say it already: "File too large" alone named no limit.
fn file_size_limit_fix(e: &anyhow::Error, text: &str) -> Option<&'static str> {
    let hit = e
        .chain()
        .filter_map(|c| c.downcast_ref::<std::io::Error>())
        .any(|io| io.kind() == std::io::ErrorKind::FileTooLarge);
    (hit && !text.contains("ulimit -f")).then_some(
        "a file would pass the process's file-size limit (ulimit -f) or the file system's \
         largest file: raise the limit (`ulimit -f unlimited`, `fsize` in \
         /etc/security/limits.conf, `LimitFSIZE=` for systemd), then run it again",
    )
}

impl Failure {
    /// Its class as the `--json` objects name it: `"bad_input"` or
    /// `"internal"`.
    pub fn kind(&self) -> &'static str {
        match self {
            Failure::BadInput(_) => "bad_input",
            Failure::Internal(_) => "internal",
        }
    }

    /// Its exit code: 2 or 1.
    pub fn exit_code(&self) -> i32 {
        match self {
            Failure::BadInput(_) => 2,
            Failure::Internal(_) => 1,
        }
    }

    /// The error it carries.
    pub fn error(&self) -> &anyhow::Error {
        match self {
            Failure::BadInput(e) | Failure::Internal(e) => e,
        }
    }

    /// Classifies a swap-layer error: problems the user can fix by changing
    /// input or limits are bad input, the rest internal.
    pub fn from_swap(e: tierzero_swap::SwapError, context: &str) -> Self {
        let bad = swap_error_is_users(&e) || swap_error_is_the_disks(&e);
        let err = anyhow::Error::new(e).context(context.to_string());
        if bad {
            Failure::BadInput(err)
        } else {
            Failure::Internal(err)
        }
    }
}

/// Whether a swap error is the user's to fix (exit 2,
/// [`Failure::from_swap`]): the config, the disk, its space or limits,
/// memlock, another holder of the directory.
pub(crate) fn swap_error_is_users(e: &tierzero_swap::SwapError) -> bool {
    {
        use tierzero_swap::SwapError as E;
        matches!(
            e,
            E::Config(_)
                | E::Misaligned { .. }
                | E::MemlockTooLow { .. }
                | E::DirectIoUnsupported { .. }
                | E::OutOfSpace { .. }
                | E::NoRoom { .. }
                | E::Locked { .. }
        ) || matches!(e, E::Setup { source, .. } if user_fixable_io(source))
            // A full disk or a file-size limit: the user frees space or
            // raises the limit; also when a later operation reports it on
            // the space the failed write poisoned (that was exit 1).
            || (matches!(e, E::Io { .. } | E::Poisoned { .. })
                && e.io_kind().is_some_and(|k| {
                    matches!(
                        k,
                        std::io::ErrorKind::StorageFull
                            | std::io::ErrorKind::FileTooLarge
                            | std::io::ErrorKind::QuotaExceeded
                            | std::io::ErrorKind::ReadOnlyFilesystem
                    )
                }))
    }
}

/// Whether a swap error is the disk's fault (exit 2, with the way on,
/// not "internal error"): data read back that is not what was written
/// (the device, or the file changed under the run), a read that came
/// back short (the file shrank), a read or write the device failed
/// (`EIO`).
pub(crate) fn swap_error_is_the_disks(e: &tierzero_swap::SwapError) -> bool {
    use tierzero_swap::SwapError as E;
    match e {
        // A read that came back short: the swap file shrank under the run.
        E::ChecksumMismatch { .. } | E::ShortIo { .. } => true,
        // Also when a later operation reports it on the space the failed
        // write poisoned.
        E::Io { .. } | E::Poisoned { .. } => e.raw_os_error() == Some(libc::EIO),
        _ => false,
    }
}

/// The options of `ModelDir::open_with` for `--allow-unknown-model-keys`
/// (`train` and `eval`).
pub(crate) fn model_dir_options(
    allow_unknown_model_keys: bool,
) -> tierzero::model::ModelDirOptions {
    tierzero::model::ModelDirOptions {
        unknown_keys: if allow_unknown_model_keys {
            tierzero::model::UnknownKeys::Allow
        } else {
            tierzero::model::UnknownKeys::Refuse
        },
    }
}

/// Whether a failure prints its `--json` object on stdout
/// ([`json_object_on_failure`]).
static JSON_ON_FAILURE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `train --json` on the rank that prints (and `--json` of eval, export,
/// estimate, bench-io and tune, which print their object at the end): a
/// failure prints
/// `{"error": .., "failure": "bad_input" | "internal", "exit_code": N}`
/// on stdout too (the line stays on stderr), so a script reads one object
/// in every ending. `false` once the summary is out: a failure after it
/// (the timeline's write) is said on stderr only, and stdout stays one
/// object.
pub fn json_object_on_failure(on: bool) {
    JSON_ON_FAILURE.store(on, std::sync::atomic::Ordering::SeqCst);
}

/// For a command ending on a signal (`signals::exit_on_signal` and
/// `exit_removing_writes_on_signal`): with `--json` and no object printed
/// yet, `{"stopped": "signal", "stop_signal", "exit_code"}` on stdout, as
/// `train` prints a stop's (stdout was empty).
pub(crate) fn json_object_on_signal(signal: Option<&str>, exit_code: i32) {
    if JSON_ON_FAILURE.swap(false, std::sync::atomic::Ordering::SeqCst) {
        let obj = serde_json::json!({
            "stopped": "signal",
            "stop_signal": signal,
            "exit_code": exit_code,
        });
        let _ = emit(&format!("{obj}\n"));
    }
}
/// clap's error as one line, for the `--json` failure object: its first
/// paragraph (a missing argument's names are on the lines under "the
/// following required arguments were not provided:"), without the usage
/// and the `--help` hint.
fn clap_error_line(e: &clap::Error) -> String {
    let text = e.to_string();
    text.lines()
        .take_while(|l| !l.trim().is_empty())
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(" ")
        .trim_start_matches("error: ")
        .to_owned()
}

/// The object [`json_object_on_failure`] asks for.
fn failure_object(failure: &str, message: &str, exit_code: i32) -> String {
    let obj = serde_json::json!({
        "error": message,
        "failure": failure,
        "exit_code": exit_code,
    });
    format!("{obj}\n")
}

/// A checkpoint read for its weights (`export`, `eval`) must be the one
/// `latest` names: when `latest` was unusable and the open fell back to an
/// older step, the command is refused, naming that step and how to use it
/// anyway (`train --resume` falls back, with a warning: resuming from the
/// newest valid save is what a crash calls for; an export of an older
/// step under the save dir's name would ship stale weights).
pub(crate) fn newest_save(
    ckpt: &tierzero::checkpoint::Checkpoint,
    given: &std::path::Path,
    flag: &str,
) -> Result<(), Failure> {
    match ckpt.latest_unusable() {
        None => Ok(()),
        Some(why) => Err(Failure::BadInput(anyhow::anyhow!(
            "{flag} {}: `latest` names a checkpoint that does not validate ({why}); the newest \
             valid one is step {} in {}: give {flag} {} to use it",
            given.display(),
            ckpt.step(),
            ckpt.dir().display(),
            ckpt.dir().display()
        ))),
    }
}

/// Where to turn when checkpoint `ckpt`'s files are damaged (a crc or a
/// size wrong), as advice ending a message: the newest older step of its
/// save dir that opens ([`tierzero::checkpoint::Checkpoint::older_valid`]),
/// to check and give with `flag`. Without it, `export` and `eval` named no
/// way forward, and `inspect --verify` checked only the damaged step.
pub(crate) fn older_step_advice(ckpt: &tierzero::checkpoint::Checkpoint, flag: &str) -> String {
    match ckpt.older_valid() {
        Some(p) => format!(
            "; the older step {} opens: check it with `tierzero inspect {} --verify`, then give \
             {flag} {}",
            p.display(),
            p.display(),
            p.display()
        ),
        None => "; no older step of its save dir opens".to_owned(),
    }
}

/// Writes a command's output to stdout. A closed pipe (`tierzero estimate
/// | head`) is not an error: the reader has what it wanted.
pub fn emit(text: &str) -> Result<(), Failure> {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        // stdout redirected to a full disk or a read-only file: the user's.
        Err(e) if user_fixable_io(&e) => Err(Failure::BadInput(anyhow::anyhow!(
            "writing to stdout: {e}; give the output room (or redirect it elsewhere)"
        ))),
        Err(e) => Err(Failure::Internal(anyhow::anyhow!("writing to stdout: {e}"))),
    }
}

/// The first failure of an [`outln!`] write (stdout on a full disk, a
/// read-only file): the command's result once it ends ([`main`]). The
/// benches' reports lost their output and exited 0.
static STDOUT_FAILURE: std::sync::Mutex<Option<Failure>> = std::sync::Mutex::new(None);

/// [`emit`] for [`outln!`]: a failure is kept for the end of the command
/// (the first one), and later lines are still tried.
pub fn emit_noted(text: &str) {
    if let Err(f) = emit(text) {
        if let Ok(mut first) = STDOUT_FAILURE.lock() {
            first.get_or_insert(f);
        }
    }
}

/// Writes to stderr, ignoring a failed write ([`errln!`]). The text is
/// formatted first and written with one `write` (stderr is unbuffered,
/// and `write_fmt` wrote each piece on its own): the lines of several
/// ranks sharing mpirun's stderr no longer run into each other
/// (`error: error: ...`). A pipe keeps writes of up to 4096 bytes whole.
pub fn to_stderr(args: std::fmt::Arguments) {
    use std::io::Write as _;
    let text = std::fmt::format(args);
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}

/// Runs the CLI; returns the process exit code.
pub fn main() -> i32 {
    init_tracing();
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            // --help and --version are not errors.
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            // A `--json` command with a flag clap refuses: the error object
            // too (every command that takes --json prints one on failure).
            // `args_os`: an argument that is not UTF-8 (a path) panicked
            // in `args()` here, after clap's message.
            let mut args = std::env::args_os().skip(1);
            let json = args.next().is_some_and(|c| {
                [
                    "train",
                    "eval",
                    "export",
                    "estimate",
                    "bench-io",
                    "tune",
                    "inspect",
                    "gpu-info",
                    "bench-adam",
                ]
                .iter()
                .any(|name| c == *name)
            }) && args.any(|a| a == "--json")
                && launch::env_rank_is_lead();
            if code == 2 && json {
                let _ = emit(&failure_object("bad_input", &clap_error_line(&e), code));
            }
            return code;
        }
    };
    // Ok: the exit code (0, or a stopped run's 130 / 143, which is no
    // failure: every rank stopped at the same step).
    let result: Result<i32, Failure> = match cli.command {
        Command::Train(a) => train::run(*a).map(train::Ended::exit_code),
        Command::Launch(a) => launch::run(a),
        other => run_other(other).map(|()| 0),
    };
    // A command that ended well but whose report could not be written.
    let result =
        result.and_then(
            |code| match STDOUT_FAILURE.lock().ok().and_then(|mut f| f.take()) {
                Some(f) => Err(f),
                None => Ok(code),
            },
        );
    let code = match result {
        Ok(code) => code,
        Err(failure) => {
            // A signal from here on (mpirun's SIGTERM after another rank's
            // abort) must not add a stop message or a second `--json`
            // object to this failure's.
            signals::failure_is_being_reported();
            let (kind, code, e) = (failure.kind(), failure.exit_code(), failure.error());
            // The open-file limit is the user's, wherever it was met.
            let (kind, code, text) = match open_file_limit_fix(e) {
                Some(fix) => ("bad_input", 2, format!("{}; {fix}", chain_text(e))),
                None => (kind, code, chain_text(e)),
            };
            let text = match file_size_limit_fix(e, &text) {
                Some(fix) => format!("{text}; {fix}"),
                None => text,
            };
            match kind {
                "bad_input" => errln!("error: {text}"),
                _ => errln!("internal error: {text}"),
            }
            if JSON_ON_FAILURE.load(std::sync::atomic::Ordering::SeqCst) {
                // Best effort: the exit code and stderr already say it.
                let _ = emit(&failure_object(kind, &text, code));
            }
            code
        }
    };
    // Several ranks: a failed rank stops the others (MPI_Abort); a finished
    // (or stopped) one finalises MPI before exiting.
    if code != 0 && !signals::is_stop_code(code) {
        launch::abort_ranks(code);
    }
    launch::finalize();
    code
}

/// The commands other than `train` and `launch`.
fn run_other(command: Command) -> Result<(), Failure> {
    match command {
        Command::Train(a) => train::run(*a).map(|_| ()),
        Command::BenchIo(a) => bench_io::run_bench_io(a),
        Command::Tune(a) => bench_io::run_tune(a),
        Command::BenchAdam(a) => bench_adam::run(a),
        Command::Estimate(a) => estimate::run(a),
        Command::Eval(a) => eval::run(a),
        Command::Export(a) => export::run(a),
        Command::Inspect(a) => inspect::run(a),
        Command::Launch(a) => launch::run(a).map(|_| ()),
        Command::GpuInfo(a) => gpu_info::run(a),
    }
}

/// The error and its causes on one line, `a: b: c`, leaving out a cause
/// whose text the line already holds (our error enums print their source
/// in their own message, so `{:#}` would repeat it).
fn chain_text(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.is_empty() {
            line = text;
        } else if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
    }
    line
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("TIERZERO_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // Colours only on a terminal: a log file or a pipe gets plain text.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        // A failed write of a log line (stderr a pipe whose reader has
        // gone) is dropped: tracing-subscriber would say it with
        // `eprintln!`, which panics on that pipe (see `errln!`).
        .log_internal_errors(false)
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::{chain_text, open_file_limit_fix, swap_error_is_users};

    /// The open-file limit, at any depth of a failure's chain, gets the
    /// fix with the limit's numbers; other I/O errors get none.
    #[test]
    fn the_open_file_limit_is_named_wherever_it_was_met() {
        let err = |code| {
            anyhow::Error::new(Outer {
                source: std::io::Error::from_raw_os_error(code),
            })
            .context("saving a checkpoint")
        };
        let fix = open_file_limit_fix(&err(libc::EMFILE)).unwrap_or_default();
        assert!(fix.contains("ulimit -n: soft "), "{fix}");
        let fix = open_file_limit_fix(&err(libc::ENFILE)).unwrap_or_default();
        assert!(fix.contains("fs.file-max"), "{fix}");
        assert!(open_file_limit_fix(&err(libc::ENOSPC)).is_none());
        assert!(open_file_limit_fix(&anyhow::anyhow!("no io error")).is_none());
    }

    /// A space poisoned by a write the disk or a limit refused is the
    /// user's (exit 2) when a later operation reports it; by an EIO it is
    /// the disk's (exit 2 too, with the disk's hint; it was exit 1); by
    /// anything else ours.
    #[test]
    fn a_poisoned_space_is_the_users_when_its_write_hit_a_limit() {
        use std::io::ErrorKind as K;
        let poisoned = |io_kind, os_error| tierzero_swap::SwapError::Poisoned {
            op: tierzero_swap::IoOp::Write,
            cause: "write failed".into(),
            io_kind,
            os_error,
        };
        for k in [K::StorageFull, K::FileTooLarge, K::QuotaExceeded] {
            assert!(swap_error_is_users(&poisoned(Some(k), None)), "{k:?}");
        }
        assert!(!swap_error_is_users(&poisoned(Some(K::Other), None)));
        assert!(!swap_error_is_users(&poisoned(None, None)));
        let eio = std::io::Error::from_raw_os_error(libc::EIO);
        let by_eio = poisoned(Some(eio.kind()), Some(libc::EIO));
        assert!(super::swap_error_is_the_disks(&by_eio) && !swap_error_is_users(&by_eio));
        assert!(matches!(
            super::Failure::from_swap(by_eio, "training step 3"),
            super::Failure::BadInput(_)
        ));
        assert!(!super::swap_error_is_the_disks(&poisoned(
            Some(K::Other),
            Some(libc::EINVAL)
        )));
    }

    #[derive(Debug, thiserror::Error)]
    #[error("creating x: {source}")]
    struct Outer {
        source: std::io::Error,
    }

    #[test]
    fn chain_text_keeps_new_causes_and_drops_repeated_ones() {
        let io = || std::io::Error::from(std::io::ErrorKind::NotFound);
        // The source is already in the message: said once.
        let e = anyhow::Error::new(Outer { source: io() });
        let t = chain_text(&e);
        assert_eq!(t.matches(&io().to_string()).count(), 1, "{t}");
        // Context above it adds text; causes not yet said are kept.
        let e = anyhow::Error::new(Outer { source: io() }).context("export");
        assert_eq!(chain_text(&e), format!("export: creating x: {}", io()));
    }
}

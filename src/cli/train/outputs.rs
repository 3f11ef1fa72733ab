//! Where `tierzero train` writes, checked or claimed before the run:
//! the save dir (created, and its lock taken by the rank that writes it)
//! and the `--metrics` / `--timeline` files.

use std::path::{Path, PathBuf};

use tierzero::checkpoint::{SaveDirLock, LOCK_FILE, MANIFEST_FILE};

use super::{bad, must_exist, Failure, TrainArgs};

/// The save dir is ours for the whole run (refused now, not at the first
/// save, when another run is saving into it). With several ranks rank 0
/// holds it: it writes everything outside the rank dirs.
///
/// A dir this call creates is removed again if start-up fails before the
/// trainer adopts the lock ([`SaveDirClaim::into_lock`]): a run refused
/// for its config or data leaves no empty save dir behind.
pub(super) fn claim_save_dir(args: &TrainArgs, lead: bool) -> Result<SaveDirClaim, Failure> {
    // Inside a checkpoint (a step dir, at any depth), the run's `latest`
    // and step dirs hide in a step of another save: that step's resume
    // reads its own manifest, not them. A step-named dir of a save dir,
    // there or not, is that save dir's own entry: its run's save of that
    // step replaces it.
    if let Some(d) = &args.save_dir {
        let holder = tierzero::checkpoint::checkpoint_holding(&d.join("x"))
            .or_else(|| tierzero::checkpoint::checkpoint_holding(d));
        if let Some(ckpt) = holder {
            return Err(bad(format!(
                "--save-dir {} is inside the checkpoint directory {}, where this run's saves \
                 would hide (or be replaced by that save dir's own); give a save dir outside \
                 it (the save dir it belongs to continues its run with --resume)",
                d.display(),
                ckpt.display(),
            )));
        }
    }
    match &args.save_dir {
        Some(d) if lead => {
            let created = tierzero::durable::create_dirs(d)
                .map_err(|e| bad(format!("--save-dir {}: {e}", d.display())))?;
            // Every save rewrites `latest` atomically, which a link there
            // refuses: said now, not at the first save hours from here.
            let latest = d.join(tierzero::checkpoint::LATEST_FILE);
            tierzero::durable::check_replaceable(&latest)
                .map_err(|e| bad(format!("--save-dir {}: {}", d.display(), e)))?;
            let mut claim = SaveDirClaim {
                lock: None,
                created,
            };
            claim.lock = Some(
                SaveDirLock::acquire(d)
                    .map_err(|e| bad(format!("--save-dir {}: {e}", d.display())))?,
            );
            Ok(claim)
        }
        _ => Ok(SaveDirClaim {
            lock: None,
            created: Vec::new(),
        }),
    }
}

/// The save dir's lock between start-up's claim and the trainer's
/// adoption; dropped before that (start-up failed), it removes the dirs
/// the claim created, if nothing but the lock file went into them.
#[derive(Debug)]
pub(super) struct SaveDirClaim {
    lock: Option<SaveDirLock>,
    /// Dirs the claim created, the deepest first.
    created: Vec<PathBuf>,
}

impl SaveDirClaim {
    /// The lock, for the trainer: the dir is the run's from here on.
    pub(super) fn into_lock(mut self) -> Option<SaveDirLock> {
        self.created.clear();
        self.lock.take()
    }
}

impl SaveDirClaim {
    /// What the drop removes, as a function for a start-up that ends
    /// without dropping anything (a signal: `signals::at_startup_exit`).
    pub(super) fn removal(&self) -> impl Fn() + Send + 'static {
        let lock_file = self.lock.as_ref().map(|l| l.dir().join(LOCK_FILE));
        let created = self.created.clone();
        move || remove_created(lock_file.as_deref(), &created)
    }
}

/// Removes a claim's `lock_file` and the dirs it `created` (the deepest
/// first), while they hold nothing else.
fn remove_created(lock_file: Option<&Path>, created: &[PathBuf]) {
    if created.is_empty() {
        return;
    }
    // Unlinked while the lock is still held: a process that opens
    // `.lock` before this is refused by the lock; one that opens it
    // after makes a new file, and the dir, no longer empty, stays.
    if let Some(f) = lock_file {
        let _ = std::fs::remove_file(f);
    }
    tierzero::durable::remove_empty_dirs(created);
}

impl Drop for SaveDirClaim {
    fn drop(&mut self) {
        let lock_file = self.lock.as_ref().map(|l| l.dir().join(LOCK_FILE));
        remove_created(lock_file.as_deref(), &self.created);
        drop(self.lock.take());
    }
}

/// The directories the embedded default's `nvme_path` needed (made before
/// its config is loaded, which would make them), removed again, while
/// empty, if start-up fails before the trainer is built: a refused first
/// run left an empty `./tierzero-swap/` behind.
#[derive(Debug, Default)]
pub(super) struct MadeSwapDirs {
    /// The deepest first.
    made: Vec<PathBuf>,
}

impl MadeSwapDirs {
    /// Makes each of `dirs` that is missing (with its missing parents).
    pub(super) fn make(dirs: &[&Path]) -> Result<MadeSwapDirs, tierzero::durable::DurableError> {
        let mut made = MadeSwapDirs::default();
        for d in dirs {
            let mut new = tierzero::durable::create_dirs(d)?;
            new.append(&mut made.made);
            made.made = new;
        }
        if !made.made.is_empty() {
            let undo = made.made.clone();
            super::super::signals::at_startup_exit(move || {
                tierzero::durable::remove_empty_dirs(&undo)
            });
        }
        Ok(made)
    }

    /// The trainer is built: the dirs are the run's.
    pub(super) fn keep(mut self) {
        self.made.clear();
    }
}

impl Drop for MadeSwapDirs {
    fn drop(&mut self) {
        tierzero::durable::remove_empty_dirs(&self.made);
    }
}

/// A save dir that holds another run's checkpoints is refused: a new
/// run (no `--resume`), or one resumed from a checkpoint outside it,
/// replaced that run's step dirs of the same numbers and its `latest`
/// without a word. Resuming from the save dir itself continues its run.
pub(super) fn check_save_dir_is_this_runs(
    args: &TrainArgs,
    resumed: Option<&tierzero::checkpoint::Checkpoint>,
) -> Result<(), Failure> {
    let Some(save_dir) = &args.save_dir else {
        return Ok(());
    };
    let steps = tierzero::checkpoint::saved_steps(save_dir);
    let (Some(first), Some(newest)) = (steps.first(), steps.last()) else {
        return Ok(());
    };
    if resumes_from_save_dir(args, resumed, save_dir) {
        return Ok(());
    }
    let held = if first == newest {
        format!("the checkpoint of step {newest}")
    } else {
        format!("{} checkpoints (steps {first} to {newest})", steps.len())
    };
    let d = save_dir.display();
    Err(bad(match &args.resume {
        None => format!(
            "--save-dir {d} holds {held} of an earlier run, which this run's saves would \
             replace; continue that run with --resume {d}, or give another --save-dir (or \
             remove those checkpoints first)"
        ),
        Some(r) => format!(
            "--save-dir {d} holds {held} of another run than --resume {} (whose checkpoints \
             are elsewhere), which this run's saves would replace or mix with; continue the run \
             saved there with --resume {d}, or give an empty --save-dir",
            r.display()
        ),
    }))
}

/// Whether the run resumes from a checkpoint in `save_dir`: its step dir
/// is there, resolved or as reached through the `--resume` given (a step
/// dir linked there from another disk resolves outside it, and the run
/// that continued its own save dir was refused as another run's).
pub(super) fn resumes_from_save_dir(
    args: &TrainArgs,
    resumed: Option<&tierzero::checkpoint::Checkpoint>,
    save_dir: &Path,
) -> bool {
    let Some(c) = resumed else {
        return false;
    };
    let parent = |p: &Path| {
        p.parent()
            .filter(|d| !d.as_os_str().is_empty())
            .map(Path::to_path_buf)
    };
    c.dir().parent().is_some_and(|p| same_file(p, save_dir))
        || args.resume.as_deref().is_some_and(|r| {
            // The save dir itself, or one of its step dirs.
            same_file(r, save_dir)
                || (r.join(MANIFEST_FILE).exists()
                    && parent(r).is_some_and(|p| same_file(&p, save_dir)))
        })
}

/// The resolved directory `p` is in (`.` for a bare name), if it exists.
fn resolved_dir_of(p: &Path) -> Option<PathBuf> {
    let d = p.parent().filter(|d| !d.as_os_str().is_empty());
    std::fs::canonicalize(d.unwrap_or(Path::new("."))).ok()
}

/// Whether `a` and `b` name one file: the same file when both exist
/// (through links), else the same name in the same directory.
fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    if let (Ok(x), Ok(y)) = (std::fs::metadata(a), std::fs::metadata(b)) {
        return (x.dev(), x.ino()) == (y.dev(), y.ino());
    }
    let dir = resolved_dir_of(a);
    a.file_name().is_some()
        && a.file_name() == b.file_name()
        && dir.is_some()
        && dir == resolved_dir_of(b)
}

/// Whether a file of a model directory by this name is one a model is
/// read from: its configs, weights and tokenizer files.
fn is_model_file(name: &str) -> bool {
    matches!(
        name,
        "config.json"
            | "generation_config.json"
            | "special_tokens_map.json"
            | "vocab.json"
            | "merges.txt"
    ) || name.starts_with("tokenizer")
        || name.ends_with(".safetensors")
        || name.ends_with(".safetensors.index.json")
}

/// `--metrics` and `--timeline` never overwrite the run's inputs (the
/// corpus, the ds_config, the tokenizer, a model file of the model's
/// directory), a checkpoint's files or the save dir's own entries, or
/// each other: `--metrics data.txt` replaced the corpus with metrics,
/// and with both on one path the summary named a file that held the
/// timeline.
fn check_outputs_spare_inputs(args: &TrainArgs) -> Result<(), Failure> {
    let outputs = [("--metrics", &args.metrics), ("--timeline", &args.timeline)];
    let inputs = [
        ("--data", &args.data),
        ("--config", &args.config),
        ("--tokenizer", &args.tokenizer),
    ];
    // The model's directory, resolved (`--model` names it, or a file in
    // it).
    let model_dir = args.model.as_deref().and_then(|m| {
        if m.is_dir() {
            std::fs::canonicalize(m).ok()
        } else {
            resolved_dir_of(m)
        }
    });
    let save_dir = args
        .save_dir
        .as_deref()
        .and_then(|d| std::fs::canonicalize(d).ok());
    for (flag, out) in outputs {
        let Some(out) = out else { continue };
        // A checkpoint's file (the one resumed from, or any other), or an
        // entry of the save dir this run writes (`latest`, a step dir).
        let save_dir_entry = save_dir.is_some()
            && resolved_dir_of(out) == save_dir
            && out
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(tierzero::checkpoint::is_save_dir_entry);
        if let Some(dir) = tierzero::checkpoint::checkpoint_holding(out)
            .or_else(|| save_dir_entry.then(|| save_dir.clone()).flatten())
        {
            return Err(bad(format!(
                "{flag} {}: is inside the checkpoint directory {} (a file there belongs to the \
                 checkpoints); write it elsewhere",
                out.display(),
                dir.display()
            )));
        }
        for (input, path) in inputs {
            if path.as_deref().is_some_and(|p| same_file(out, p)) {
                return Err(bad(format!(
                    "{flag} {}: is the {input} file; write it elsewhere",
                    out.display()
                )));
            }
        }
        // A file the model's directory is read for (its config.json,
        // weights, tokenizer); other files there (a metrics file a
        // previous run wrote) are not inputs.
        let in_model = out.exists()
            && out
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(is_model_file)
            && model_dir.is_some()
            && resolved_dir_of(out) == model_dir;
        if in_model {
            let dir = args.model.as_deref().unwrap_or(Path::new("."));
            return Err(bad(format!(
                "{flag} {}: is a model file of the --model directory {}; write it elsewhere",
                out.display(),
                dir.display()
            )));
        }
    }
    if let (Some(m), Some(t)) = (&args.metrics, &args.timeline) {
        if same_file(m, t) {
            return Err(bad(format!(
                "--metrics and --timeline name one file ({}); give each its own",
                m.display()
            )));
        }
    }
    Ok(())
}

/// `--metrics` naming this process's stdout (`/dev/stdout`, or the file
/// stdout is redirected to) is refused where it would break stdout: a pipe
/// or socket under `--json` (stdout is then the summary object alone),
/// and a regular file (the metrics writer opens it on its own, at offset
/// 0, and the two write over each other).
fn check_metrics_not_stdout(args: &TrainArgs) -> Result<(), Failure> {
    use std::os::fd::AsFd as _;
    use std::os::unix::fs::MetadataExt as _;
    let Some(path) = &args.metrics else {
        return Ok(());
    };
    let (Ok(m), Ok(out)) = (
        std::fs::metadata(path),
        std::io::stdout()
            .as_fd()
            .try_clone_to_owned()
            .and_then(|fd| std::fs::File::from(fd).metadata()),
    ) else {
        return Ok(());
    };
    use std::os::unix::fs::FileTypeExt as _;
    let t = m.file_type();
    // A regular file is written over; a pipe or socket mixes the lines
    // into --json's object. A device (/dev/null, a terminal) is harmless.
    let breaks = t.is_file() || (args.json && (t.is_fifo() || t.is_socket()));
    if (m.dev(), m.ino()) != (out.dev(), out.ino()) || !breaks {
        return Ok(());
    }
    Err(bad(format!(
        "--metrics {}: is this run's stdout, {}; give the metrics a file of their own",
        path.display(),
        match args.json {
            true => "which --json keeps for the summary object",
            false => "and opened again it would write over what stdout writes",
        }
    )))
}

/// `--metrics` on a FIFO is opened now, during start-up, where a signal
/// ends the run at once: the trainer's build opens it too, and that open
/// waits for a reader, where no signal could end it. The write end
/// returned is held until the trainer is built (it has its own then).
/// Only the rank that writes metrics calls it.
pub(super) fn metrics_fifo_held(args: &TrainArgs) -> Result<Option<std::fs::File>, Failure> {
    use std::os::unix::fs::{FileTypeExt as _, OpenOptionsExt as _};
    let Some(path) = &args.metrics else {
        return Ok(None);
    };
    if !std::fs::metadata(path).is_ok_and(|m| m.file_type().is_fifo()) {
        return Ok(None);
    }
    let open = |flags| {
        std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(flags)
            .open(path)
    };
    // Without waiting first (ENXIO: no reader yet); the handle is only held.
    if let Ok(f) = open(libc::O_NONBLOCK) {
        return Ok(Some(f));
    }
    errln!(
        "tierzero: --metrics {} is a FIFO: waiting for its reader",
        path.display()
    );
    open(0)
        .map(Some)
        .map_err(|e| bad(format!("--metrics {}: {e}", path.display())))
}

/// `--metrics` and `--timeline` go into a directory that must exist. The
/// timeline is written only after the last step (atomically: a temporary
/// file beside it, renamed over it), so what would fail then is checked
/// now: a path that is a directory or has no file name, and a directory
/// where no file can be made.
pub(super) fn check_output_dirs(args: &TrainArgs) -> Result<(), Failure> {
    check_outputs_spare_inputs(args)?;
    check_metrics_not_stdout(args)?;
    for (flag, file) in [("--metrics", &args.metrics), ("--timeline", &args.timeline)] {
        if let Some(parent) = file
            .as_ref()
            .and_then(|m| m.parent())
            .filter(|p| !p.as_os_str().is_empty())
        {
            must_exist(
                flag,
                parent,
                true,
                "create its directory first or choose another path",
            )?;
        }
    }
    if let Some(path) = args
        .metrics
        .as_ref()
        .filter(|p| p.file_name().is_none() || p.is_dir())
    {
        return Err(bad(format!(
            "--metrics {}: is a directory, not a file; give a file path for the metrics \
             (JSON lines), e.g. --metrics metrics.jsonl",
            path.display()
        )));
    }
    if let Some(path) = &args.timeline {
        let fix = "give a file path for the timeline (JSON), e.g. --timeline timeline.json";
        if path.file_name().is_none() || path.is_dir() {
            return Err(bad(format!(
                "--timeline {}: is a directory, not a file; {fix}",
                path.display()
            )));
        }
        tierzero::durable::check_replaceable(path)
            .map_err(|e| bad(format!("--timeline {}: {}", path.display(), e.source)))?;
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let probe = dir.join(format!(".tierzero-timeline-probe-{}", std::process::id()));
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&probe)
            .and_then(|_| std::fs::remove_file(&probe))
            .map_err(|e| {
                bad(format!(
                    "--timeline {}: cannot make a file in {}: {e}; choose a writable directory",
                    path.display(),
                    dir.display()
                ))
            })?;
    }
    Ok(())
}

//! How `tierzero train` classifies the engine's errors: bad input (exit 2,
//! the user's config, model, data or disk) or internal (exit 1), with the
//! way forward where there is one.

use super::*;

/// Classifies an engine error raised while starting up: everything the
/// user's config, model or data can cause is bad input.
pub(super) fn startup_failure(e: EngineError) -> Failure {
    match e {
        EngineError::Swap(s) => Failure::from_swap(s, "setting up NVMe swap"),
        EngineError::Config { .. }
        | EngineError::PinnedBudget { .. }
        | EngineError::Memlock { .. }
        | EngineError::HostMemory { .. }
        | EngineError::NvmeSpace { .. }
        | EngineError::ParamTooLarge { .. }
        | EngineError::Data { .. }
        | EngineError::Tokenizer { .. }
        | EngineError::Io { .. }
        | EngineError::Unsupported { .. }
        | EngineError::Checkpoint(_)
        | EngineError::RanksDisagree { .. }
        | EngineError::Model(_) => Failure::BadInput(anyhow::Error::new(e)),
        other => Failure::Internal(anyhow::Error::new(other)),
    }
}

/// A stop during the trainer's build (`e`, [`EngineError::StoppedInBuild`]):
/// said on stderr (and as the `--json` summary), with the stop's exit
/// code. The build removed what it made; no rank exits (under mpirun,
/// the first non-zero exit aborts the rest) before every rank's has.
pub(super) fn stopped_in_build(
    e: &EngineError,
    comm: &dyn tierzero::engine::comm::Comm,
    args: &TrainArgs,
    start_step: u64,
) -> Result<Ended, Failure> {
    let EngineError::StoppedInBuild { cause, .. } = e else {
        return Err(Failure::Internal(anyhow!("not a stop: {e}")));
    };
    if comm.world_size() > 1 {
        comm.barrier()
            .map_err(|e| run_failure(e, "ending the stopped build"))?;
    }
    if comm.rank() == 0 {
        errln!("tierzero: {e}");
        if args.json {
            emit(&format!(
                "{}\n",
                serde_json::json!({
                    "steps": start_step,
                    "steps_run": 0,
                    "stopped": cause.kind(),
                    "stop_signal": cause.signal_name(),
                    "stopped_in_build": true,
                })
            ))?;
        }
    }
    Ok(Ended::Stopped {
        exit_code: super::super::signals::exit_code(*cause),
    })
}

/// A resume that failed: a checkpoint whose data is corrupt (or cut
/// short) names the way forward, the newest older step that validates and
/// `inspect --verify`; an auto-restart with the same `--resume` would fail
/// the same way forever.
pub(super) fn corrupt_resume(e: EngineError, ckpt: &Checkpoint) -> Failure {
    if !matches!(
        e,
        EngineError::Checkpoint(CheckpointError::Corrupt { .. } | CheckpointError::Size { .. })
    ) {
        return startup_failure(e);
    }
    let older = match ckpt.older_valid() {
        Some(p) => format!(
            "resume from an older one with --resume {}, or ",
            p.display()
        ),
        None => String::new(),
    };
    bad(format!(
        "{e}; {older}check every file with `tierzero inspect {} --verify`",
        ckpt.dir().display()
    ))
}

/// Classifies an engine error raised while training.
pub(super) fn run_failure(e: EngineError, what: &str) -> Failure {
    classify_run(e, what, None)
}

/// [`run_failure`] of a save into `save_dir`, whose way back is what the
/// save dir holds: its newest whole checkpoint to resume, or none (the
/// run's first save failed: advising `--resume` then failed again, "not a
/// checkpoint").
pub(super) fn save_failure(e: EngineError, what: &str, save_dir: &Path) -> Failure {
    let fix = "fix the space, quota, file-size limit, permissions or what is in the way under \
               --save-dir";
    // "None" only where the save dir was read and holds neither `latest`
    // nor a step dir (a failure that also fails the open, the open-file
    // limit, says nothing it cannot know).
    let none = std::fs::read_dir(save_dir).is_ok()
        && tierzero::checkpoint::saved_steps(save_dir).is_empty()
        && !save_dir.join(tierzero::checkpoint::LATEST_FILE).exists();
    let back = match Checkpoint::open(save_dir) {
        Ok(c) => format!(
            "the checkpoints saved before are whole, the newest of step {}: {fix}, then \
             --resume {}",
            c.step(),
            save_dir.display()
        ),
        Err(_) if none => format!(
            "{} holds no checkpoint to resume: {fix}, then run it again as it was",
            save_dir.display()
        ),
        Err(_) => format!(
            "the checkpoints saved before are whole: {fix}, then --resume {}",
            save_dir.display()
        ),
    };
    classify_run(e, what, Some(back))
}

/// [`run_failure`], with a save's way back (`save_back`, said where the
/// failure is the user's to fix).
fn classify_run(e: EngineError, what: &str, save_back: Option<String>) -> Failure {
    // A failure the user can fix, with where to look and the way back: a
    // save's from what its save dir holds; a swap write the disk or a
    // limit refused while training is under the nvme_path.
    let users = |what: &str, swap_write: bool| {
        if let Some(back) = &save_back {
            format!("{what} ({back})")
        } else if swap_write {
            format!(
                "{what} (a swap write under the nvme_path failed: free space there, raise the \
                 quota or the file-size limit (ulimit -f), then --resume from the last \
                 checkpoint)"
            )
        } else {
            what.to_owned()
        }
    };
    match e {
        EngineError::Swap(s) => {
            let what = if crate::cli::swap_error_is_users(&s) {
                users(what, s.io_kind().is_some())
            } else if crate::cli::swap_error_is_the_disks(&s) {
                format!(
                    "{what} (a disk fault under the nvme_path: data read back that is not what \
                     was written, or a read or write the device failed; check the device \
                     (dmesg, smartctl) and that nothing else writes the swap files, then \
                     --resume from the last checkpoint)"
                )
            } else {
                what.to_owned()
            };
            Failure::from_swap(s, &what)
        }
        // fp16's scaler at its floor: the run's precision and
        // hyperparameters (the message names the fixes), not a fault.
        EngineError::Optim(tierzero::optim::OptimError::LossScaleAtMinimum { .. }) => {
            Failure::BadInput(anyhow::Error::new(e).context(what.to_owned()))
        }
        // A disk, quota or file-size limit, permissions (a save that hit
        // `ulimit -f` was an internal error), a directory in a save's way.
        EngineError::Io { ref source, .. }
        | EngineError::Checkpoint(CheckpointError::Io { ref source, .. })
            if crate::cli::user_fixable_io(source) =>
        {
            Failure::BadInput(anyhow::Error::new(e).context(users(what, false)))
        }
        // The run locked its save dir at start-up: locked by another at a
        // save, the dir at that path is no longer the one it locked (moved
        // or removed while the run lived, made again by the other run).
        // (Its own text, "wait for it to finish or give a different
        // --save-dir", is a start-up's advice: left out here.)
        EngineError::Checkpoint(CheckpointError::Locked { path, holder }) => {
            Failure::BadInput(anyhow!(
                "{what}: the save dir this run locked was moved or removed while it ran, and {holder} \
                 has made and locked a new one at its path ({}): this run cannot save into it, and \
                 stops; its checkpoints so far went with the dir it locked, wherever that was \
                 moved: --resume from there",
                path.display()
            ))
        }
        EngineError::Checkpoint(CheckpointError::NotACheckpoint { .. }) => {
            Failure::BadInput(anyhow::Error::new(e).context(users(what, false)))
        }
        other => Failure::Internal(anyhow::Error::new(other).context(what.to_owned())),
    }
}

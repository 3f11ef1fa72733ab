//! Where `tierzero train` writes, checked or claimed before the run:
//! the save dir (created, and its lock taken by the rank that writes it)
//! and the `--metrics` / `--timeline` files.

use std::path::Path;

use tierzero::checkpoint::SaveDirLock;

use super::{bad, must_exist, Failure, TrainArgs};

/// The save dir is ours for the whole run (refused now, not at the first
/// save, when another run is saving into it). With several ranks rank 0
/// holds it: it writes everything outside the rank dirs.
pub(super) fn claim_save_dir(args: &TrainArgs, lead: bool) -> Result<Option<SaveDirLock>, Failure> {
    match &args.save_dir {
        Some(d) if lead => {
            tierzero::durable::create_dir_all(d)
                .map_err(|e| bad(format!("--save-dir {}: {e}", d.display())))?;
            let lock = SaveDirLock::acquire(d)
                .map_err(|e| bad(format!("--save-dir {}: {e}", d.display())))?;
            Ok(Some(lock))
        }
        _ => Ok(None),
    }
}

/// `--metrics` and `--timeline` go into a directory that must exist. The
/// timeline is written only after the last step (atomically: a temporary
/// file beside it, renamed over it), so what would fail then is checked
/// now: a path that is a directory or has no file name, and a directory
/// where no file can be made.
pub(super) fn check_output_dirs(args: &TrainArgs) -> Result<(), Failure> {
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
    if let Some(path) = &args.timeline {
        let fix = "give a file path for the timeline (JSON), e.g. --timeline timeline.json";
        if path.file_name().is_none() || path.is_dir() {
            return Err(bad(format!(
                "--timeline {}: is a directory, not a file; {fix}",
                path.display()
            )));
        }
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

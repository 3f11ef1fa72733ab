//! Export: one consolidated safetensors file with HF names and layout from
//! a checkpoint's fp32 masters (our `zero_to_fp32`).
//!
//! * Tensors are read one at a time ([`Checkpoint::load_param_f32`], which
//!   assembles every rank's shard and verifies crcs), converted to the
//!   requested dtype (round to nearest even) and streamed out, so memory
//!   holds one parameter at a time.
//! * Names and layout are the HF ones ([`crate::model::write_safetensors`]):
//!   GPT-2 without the `transformer.` prefix and Conv1D `[in, out]` weights
//!   (as the hub's `gpt2` files, which `GPT2LMHeadModel` loads), Llama with
//!   `model.` names. A tied `lm_head` is not written (HF re-ties it); an
//!   untied GPT-2's body is written with the prefix beside its
//!   `lm_head.weight` ([`crate::model::Model::hf_file_name`]).
//! * The output is written to a temporary file beside it and renamed
//!   ([`crate::durable`]): an interrupted export never leaves a partial file
//!   under the output name.
//! * `config.json` is written beside the output so the directory loads with
//!   `from_pretrained`, with the source model's special token ids
//!   ([`crate::model::TokenIds`], kept in the checkpoint's manifest). If a `config.json` is already there with the same
//!   JSON content it is left alone; with different content the export is
//!   refused before anything is written (it would otherwise describe
//!   another model, or be silently overwritten).
//! * The exported files are `0644` and the directories it makes `0755`
//!   (readable by others, as `save_pretrained`'s under umask 022), where a
//!   checkpoint's are the run's alone.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use candle_core::DType;

use super::reader::Checkpoint;
use super::{io_err, CheckpointError};
use crate::durable;
use crate::model::{hf_config_text, hf_config_with_dtype, write_safetensors};

/// The exported files' mode: readable by others, as `save_pretrained`'s
/// under the usual umask 022 (a checkpoint's are `0600`: the run's).
const EXPORT_FILE_MODE: u32 = 0o644;
/// The mode of the directories an export makes.
const EXPORT_DIR_MODE: u32 = 0o755;

/// What happened to `config.json` beside the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigJsonAction {
    /// Written (there was none).
    Written,
    /// One with the same content was already there.
    AlreadyThere,
}

/// What [`export_safetensors`] wrote.
#[derive(Debug, Clone)]
pub struct ExportReport {
    /// The safetensors file.
    pub out: PathBuf,
    /// Its size.
    pub bytes: u64,
    /// Tensors in it.
    pub tensors: usize,
    /// `config.json` beside it.
    pub config_path: PathBuf,
    /// Whether it was written.
    pub config_action: ConfigJsonAction,
}

/// Writes `ckpt`'s weights to `out` as `dtype` (see the module doc).
pub fn export_safetensors(
    ckpt: &Checkpoint,
    out: &Path,
    dtype: DType,
) -> Result<ExportReport, CheckpointError> {
    let dir = match out.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    // Never into the checkpoint read from: replacing a file its manifest
    // lists (its 16-bit `model.safetensors`) would break it. Checked on
    // the nearest directory that exists, before creating any.
    let existing = dir
        .ancestors()
        .find(|a| !a.as_os_str().is_empty() && a.exists())
        .unwrap_or(Path::new("."));
    let canonical = existing
        .canonicalize()
        .map_err(io_err("resolving", existing))?;
    // Nor into any other checkpoint, or over a save dir's `latest`.
    let holding = if canonical.starts_with(ckpt.dir()) {
        Some(ckpt.dir().to_path_buf())
    } else {
        super::checkpoint_holding(out)
    };
    if let Some(dir) = holding {
        return Err(CheckpointError::ExportIntoCheckpoint {
            out: out.to_path_buf(),
            dir,
        });
    }
    // The output's directory is created if missing (like `--save-dir`),
    // durably, as every directory the project creates; an export that
    // fails removes the ones it made, while they are empty.
    let made = durable::create_dirs(&dir)?;
    // Readable by others, as `save_pretrained`'s under the usual umask
    // (the durable helpers make checkpoints' 0700: they are the run's),
    // from the start: set after a success, a dir an interrupted export
    // made stayed 0700, and a later export into it, which made nothing,
    // left it so.
    for d in &made {
        if let Err(e) =
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(EXPORT_DIR_MODE))
        {
            durable::remove_empty_dirs(&made);
            return Err(io_err("setting the mode of", d)(e));
        }
    }
    let written = write_export(ckpt, out, &dir, dtype);
    if written.is_err() {
        durable::remove_empty_dirs(&made);
    }
    written
}

/// [`export_safetensors`] once the output's directory `dir` is there.
fn write_export(
    ckpt: &Checkpoint,
    out: &Path,
    dir: &Path,
    dtype: DType,
) -> Result<ExportReport, CheckpointError> {
    let model = ckpt.model();
    let cfg_text = hf_config_text(model, dtype)?;
    let config_path = dir.join("config.json");
    // A regular file (a FIFO there waited for ever), of a config's size.
    let config_action = match durable::read_regular(&config_path, 64 << 20) {
        Ok(existing) => {
            let found = serde_json::from_slice::<serde_json::Value>(&existing).ok();
            let same = found
                .as_ref()
                .is_some_and(|v| *v == hf_config_with_dtype(model, dtype));
            // An older export's, without `torch_dtype`: rewritten with it.
            let older = found.is_some_and(|v| v == model.hf_config_value());
            if older {
                ConfigJsonAction::Written
            } else if !same {
                return Err(CheckpointError::ExportConfigConflict { path: config_path });
            } else {
                ConfigJsonAction::AlreadyThere
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => ConfigJsonAction::Written,
        Err(e) => return Err(io_err("reading", &config_path)(e)),
    };
    if config_action == ConfigJsonAction::Written {
        // Refused now (a link, a directory), not after the whole model.
        durable::check_replaceable(&config_path)?;
    }
    // A load error is kept whole (it names the corrupt part) and returned
    // instead of the model-area error it is carried as.
    let mut load_err: Option<CheckpointError> = None;
    // An export killed mid-write left its temporary file (as large as the
    // model) beside `out`.
    durable::remove_stale_tmp(out, false);
    let bytes = durable::write_atomic_streamed(out, |file, tmp| {
        crate::failpoint::kill_point(crate::failpoint::Site::ExportWrite);
        file.set_permissions(std::fs::Permissions::from_mode(EXPORT_FILE_MODE))
            .map_err(io_err("setting the mode of", tmp))?;
        let written = write_safetensors(file, tmp, model, dtype, |id| {
            ckpt.load_param_f32(id).map_err(|e| {
                let text = e.to_string();
                load_err = Some(e);
                crate::model::ModelError::Unsupported { what: text }
            })
        });
        match (written, load_err.take()) {
            (Ok(f), _) => Ok(f),
            (Err(_), Some(e)) => Err(e),
            (Err(e), None) => Err(e.into()),
        }
    })?;
    if config_action == ConfigJsonAction::Written {
        durable::write_atomic(&config_path, cfg_text.as_bytes())?;
        std::fs::set_permissions(
            &config_path,
            std::fs::Permissions::from_mode(EXPORT_FILE_MODE),
        )
        .map_err(io_err("setting the mode of", &config_path))?;
    }
    Ok(ExportReport {
        out: out.to_path_buf(),
        bytes,
        tensors: model.params().len(),
        config_path,
        config_action,
    })
}

//! `tierzero export`: consolidate a checkpoint into one safetensors file
//! with HF tensor names (our `zero_to_fp32`).
//!
//! The work is `tierzero::checkpoint::export_safetensors` (streaming, one
//! tensor at a time, crc-verified reads, atomic output). This command
//! parses the flags, maps errors to exit codes (a missing, invalid or
//! corrupt checkpoint and a conflicting `config.json` are bad input, exit
//! 2; failures writing the output are internal unless the user can fix
//! them: permissions, no space) and prints what it wrote (`--json` for a
//! machine-readable line).

use std::path::PathBuf;

use anyhow::anyhow;
use candle_core::DType;
use clap::{Args, ValueEnum};
use serde::Serialize;
use tierzero::checkpoint::{export_safetensors, Checkpoint, CheckpointError, ConfigJsonAction};

use super::{emit, Failure};

/// Output dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ExportDtype {
    /// fp32 (exactly the master weights).
    Fp32,
    /// bf16 (round to nearest even).
    Bf16,
    /// fp16 (round to nearest even).
    Fp16,
}

/// Arguments of `tierzero export`.
#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  tierzero export --checkpoint ckpt --out hf/model.safetensors\n      \
    consolidates ckpt/latest; writes hf/config.json too, so hf/ loads with from_pretrained\n  \
    tierzero export --checkpoint ckpt/step-00000100 --out model.safetensors --dtype bf16 --json"
)]
pub struct ExportArgs {
    /// A checkpoint: a save dir (its `latest`) or a step-<N> directory.
    #[arg(long, value_name = "DIR")]
    checkpoint: PathBuf,
    /// The safetensors file to write. config.json is written beside it
    /// unless one with the same content is there (a different one is an
    /// error).
    #[arg(long, value_name = "FILE.safetensors")]
    out: PathBuf,
    /// dtype of the exported tensors.
    #[arg(long, value_enum, default_value = "fp32")]
    dtype: ExportDtype,
    /// Print the result as one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    checkpoint: String,
    step: u64,
    out: String,
    bytes: u64,
    tensors: usize,
    dtype: &'static str,
    config_json: String,
    config_json_written: bool,
}

fn classify(e: CheckpointError, ckpt: &Checkpoint) -> Failure {
    if matches!(
        e,
        CheckpointError::Corrupt { .. } | CheckpointError::Size { .. }
    ) {
        let older = super::older_step_advice(ckpt, "--checkpoint");
        return Failure::BadInput(anyhow!("{e}{older}"));
    }
    let bad = match &e {
        // Every path export reads or writes is the user's: one that is not
        // a regular file (`durable::open_regular`'s `InvalidInput`) too.
        CheckpointError::Io { source, .. } => {
            super::user_fixable_io(source) || source.kind() == std::io::ErrorKind::InvalidInput
        }
        CheckpointError::Candle(_) => false,
        _ => true,
    };
    if bad {
        Failure::BadInput(anyhow::Error::new(e))
    } else {
        Failure::Internal(anyhow::Error::new(e))
    }
}

/// Runs `tierzero export`.
pub fn run(a: ExportArgs) -> Result<(), Failure> {
    super::json_object_on_failure(a.json);
    // A trailing `/` names a directory, there or not: refused now, not
    // after the whole model was written beside it (the rename failed).
    let names_dir = {
        use std::os::unix::ffi::OsStrExt as _;
        a.out.as_os_str().as_bytes().ends_with(b"/") || a.out.file_name().is_none()
    };
    if a.out.is_dir() || names_dir {
        let dir = a.out.display().to_string();
        return Err(Failure::BadInput(anyhow!(
            "--out {dir} is a directory; give a file name such as {}/model.safetensors",
            dir.trim_end_matches('/')
        )));
    }
    // Written under another name, the file is not the directory's model:
    // `--model DIR` (and eval) saw no weights and used a seeded init, and
    // from_pretrained reads `model.safetensors` (or a sharded index).
    if a.out.extension().is_none_or(|e| e != "safetensors") {
        return Err(Failure::BadInput(anyhow!(
            "--out {}: give a .safetensors file name, e.g. {}: a model directory's weights \
             are read from *.safetensors (from_pretrained: model.safetensors)",
            a.out.display(),
            a.out.with_file_name("model.safetensors").display()
        )));
    }
    if let Some(parent) = a.out.parent().filter(|p| !p.as_os_str().is_empty()) {
        if parent.exists() && !parent.is_dir() {
            return Err(Failure::BadInput(anyhow!(
                "--out {}: {} is not a directory; give a path in a directory",
                a.out.display(),
                parent.display()
            )));
        }
    }
    if a.out.file_name().is_some_and(|n| n != "model.safetensors") {
        errln!(
            "warning: --out {}: from_pretrained reads model.safetensors; name it so to load its \
             directory with transformers (tierzero's --model reads any *.safetensors there)",
            a.out.display()
        );
    }
    tierzero::durable::check_replaceable(&a.out)
        .map_err(|e| Failure::BadInput(anyhow!("--out {}: {}", a.out.display(), e.source)))?;
    if a.checkpoint.is_file() {
        return Err(Failure::BadInput(anyhow!(
            "--checkpoint {}: a file; give a save dir (the one holding `latest`) or a \
             step-<N> directory",
            a.checkpoint.display()
        )));
    }
    let ckpt = Checkpoint::open(&a.checkpoint)
        .map_err(|e| Failure::BadInput(anyhow!("--checkpoint {}: {e}", a.checkpoint.display())))?;
    super::newest_save(&ckpt, &a.checkpoint, "--checkpoint")?;
    let (dtype, name) = match a.dtype {
        ExportDtype::Fp32 => (DType::F32, "fp32"),
        ExportDtype::Bf16 => (DType::BF16, "bf16"),
        ExportDtype::Fp16 => (DType::F16, "fp16"),
    };
    // A signal removes the model file being written and the directories
    // the export would make (those missing now, while empty).
    let missing = a
        .out
        .parent()
        .map(tierzero::durable::missing_dirs)
        .unwrap_or_default();
    super::signals::exit_removing_writes_on_signal(missing)?;
    let r = export_safetensors(&ckpt, &a.out, dtype).map_err(|e| classify(e, &ckpt))?;
    let report = Report {
        checkpoint: ckpt.dir().display().to_string(),
        step: ckpt.step(),
        out: r.out.display().to_string(),
        bytes: r.bytes,
        tensors: r.tensors,
        dtype: name,
        config_json: r.config_path.display().to_string(),
        config_json_written: r.config_action == ConfigJsonAction::Written,
    };
    if a.json {
        let text = serde_json::to_string(&report)
            .map_err(|e| Failure::Internal(anyhow!("serialising the report: {e}")))?;
        emit(&format!("{text}\n"))
    } else {
        emit(&format!(
            "exported step {} of {} to {} ({} tensors, {}, {} bytes); {} {}\n",
            report.step,
            report.checkpoint,
            report.out,
            report.tensors,
            report.dtype,
            report.bytes,
            report.config_json,
            if report.config_json_written {
                "written"
            } else {
                "already there (same content)"
            }
        ))
    }
}

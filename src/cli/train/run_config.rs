//! The run's config: `--config` or the embedded default (its values the
//! flags set made `"auto"`), resolved with the run's flags.

use tierzero::checkpoint::Checkpoint;
use tierzero::config::{self, PathChecks, RunContext};
use tierzero::model::Model;

use super::flags::{Flags, MAX_STEPS};
use super::{
    bad, flag_names, must_exist, outputs, print_warning, Failure, TrainArgs, DEFAULT_STEPS,
};

/// The embedded default config, its values the flags set made `"auto"`
/// (the flag's value then): a run without `--config` has no file whose
/// key the flag's refusal could name ("make them equal"), so `--lr`,
/// `--micro-batch` and `--grad-accum` set the run's.
fn embedded_default_for(flags: &Flags) -> String {
    let text = config::default_embedded();
    let Ok(mut v) = serde_json::from_str::<serde_json::Value>(text) else {
        return text.to_owned();
    };
    let auto = || serde_json::Value::from("auto");
    if flags.lr.is_some() {
        v["optimizer"]["params"]["lr"] = auto();
        v["scheduler"]["params"]["warmup_max_lr"] = auto();
    }
    if flags.micro_batch.is_some() {
        v["train_micro_batch_size_per_gpu"] = auto();
    }
    if flags.grad_accum.is_some() {
        v["gradient_accumulation_steps"] = auto();
    }
    v.to_string()
}

/// The validated config (`--config`, or the embedded one) resolved with
/// the run's flags, its name, and the steps to run.
pub(super) fn load_config(
    args: &TrainArgs,
    flags: &Flags,
    model: &Model,
    ranks: usize,
    ckpt: Option<&Checkpoint>,
) -> Result<(config::Loaded, String, u64, outputs::MadeSwapDirs), Failure> {
    let mc = model.config();
    let numel = model.numel() as u64;
    let (text, config_name, path_checks) = match &args.config {
        Some(p) => {
            must_exist("--config", p, false, "give a ds_config.json file")?;
            let t = super::super::read_config_text(p)?;
            (t, p.display().to_string(), PathChecks::Check)
        }
        None => (
            embedded_default_for(flags),
            "embedded default".to_owned(),
            PathChecks::CreateMissing,
        ),
    };
    let cfg_err =
        |e: config::ConfigError| bad(format!("config ({config_name}): {}", flag_names(e)));
    let parsed = config::parse_str(&text).map_err(cfg_err)?;
    // The embedded default's swap dir is made here, to be removed again if
    // start-up fails (the config's load would make it for good).
    let made_dirs = match path_checks {
        PathChecks::CreateMissing => {
            let zero = &parsed.ds.zero_optimization;
            let dirs: Vec<&std::path::Path> = [
                zero.offload_param
                    .as_ref()
                    .and_then(|o| o.nvme_path.as_deref()),
                zero.offload_optimizer
                    .as_ref()
                    .and_then(|o| o.nvme_path.as_deref()),
            ]
            .into_iter()
            .flatten()
            .collect();
            outputs::MadeSwapDirs::make(&dirs).map_err(|e| {
                bad(format!(
                    "config ({config_name}): its nvme_path: {e}; run from a directory you can \
                     write to, or give --config with your nvme_path"
                ))
            })?
        }
        _ => outputs::MadeSwapDirs::default(),
    };
    // The run's length: --steps, else (resuming) the length of the run
    // that saved the checkpoint, else the config's concrete
    // total_num_steps, else the default.
    let steps = flags
        .steps
        .or(ckpt.and_then(|c| c.manifest().run_steps))
        .or(parsed.scheduler_total_steps())
        .unwrap_or(DEFAULT_STEPS);
    if steps > MAX_STEPS {
        // `--steps` is at most that (its parser), so this is the config's
        // or a checkpoint's.
        return Err(bad(format!(
            "config ({config_name}): the run's length, {steps} steps (scheduler.params.\
             total_num_steps, or the resumed run's), is over {MAX_STEPS}; give --steps with \
             the steps to run"
        )));
    }
    if steps == 0 {
        // `--steps` is at least 1 (its parser), so the 0 is the config's.
        return Err(bad(format!(
            "config ({config_name}): scheduler.params.total_num_steps is 0, and without --steps \
             it is the run's length: nothing would train; set it to the steps to run (or \
             \"auto\") or give --steps"
        )));
    }
    let run = RunContext {
        micro_batch_size: flags.micro_batch,
        gradient_accumulation_steps: flags.grad_accum,
        learning_rate: flags.lr,
        total_steps: Some(steps),
        hidden_size: Some(mc.hidden_size as u64),
        model_numel: Some(numel),
        largest_param_numel: model.params().iter().map(|p| p.numel as u64).max(),
        ranks: ranks as u64,
        path_checks,
        ..RunContext::default()
    };
    let mut loaded = parsed.resolve(&run).map_err(cfg_err)?;
    for w in &loaded.warnings {
        print_warning(w);
    }
    if args.gradient_checkpointing {
        if let config::ActivationBudget::Bytes(b) = loaded.config.tierzero.activations {
            if b > 0 {
                print_warning(&config::ConfigWarning::Note {
                    key: "tierzero.activation_budget_bytes".into(),
                    message: format!(
                        "--gradient-checkpointing recomputes every block; the budget {b} is not used"
                    ),
                });
            }
        }
        loaded.config.tierzero.activations = config::ActivationBudget::Checkpointing;
    }
    Ok((loaded, config_name, steps, made_dirs))
}

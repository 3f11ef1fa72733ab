//! The model `tierzero train` trains: `--model`'s directory, the
//! checkpoint's when resuming without it, or the embedded default; a
//! `--model` that is not the checkpoint's is refused naming the keys.

use super::*;

/// Opens the embedded default model through a private temporary directory.
pub(super) fn open_default_model(seed: u64) -> Result<ModelDir, Failure> {
    let dir = std::env::temp_dir().join(format!("tierzero-default-model-{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("config.json"), DEFAULT_MODEL_CONFIG)
    };
    let result = write()
        .map_err(|e| {
            Failure::Internal(anyhow!(
                "writing the embedded model config to {}: {e}",
                dir.display()
            ))
        })
        .and_then(|()| {
            ModelDir::open(&dir, seed)
                .map_err(|e| Failure::Internal(anyhow!("the embedded default model: {e}")))
        });
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// The model to train: its directory (none when resuming without
/// `--model`) and the model itself.
pub(super) fn open_model(
    args: &TrainArgs,
    seed: u64,
    ckpt: Option<&Checkpoint>,
) -> Result<(Option<ModelDir>, Model), Failure> {
    let model_dir = match &args.model {
        Some(dir) => {
            let fix = "give a HF model directory with config.json (and optionally *.safetensors)";
            must_exist("--model", dir, true, fix)?;
            must_exist("--model", &dir.join("config.json"), false, fix)?;
            let open_opts = super::super::model_dir_options(args.allow_unknown_model_keys);
            let md = ModelDir::open_with(dir, seed, open_opts)
                .map_err(|e| bad(format!("--model {}: {e}", dir.display())))?;
            if let Some(c) = &ckpt {
                if md.model().config() != c.model().config() {
                    return Err(bad(format!(
                        "--model {}: its config differs from the checkpoint's model ({}): {}; \
                         resume without --model to use the checkpoint's",
                        dir.display(),
                        c.dir().display(),
                        config_difference(md.model(), c.model())
                    )));
                }
            }
            Some(md)
        }
        None if ckpt.is_some() => None,
        None => Some(open_default_model(seed)?),
    };
    let model = match (&model_dir, &ckpt) {
        (Some(md), _) => md.model().clone(),
        (None, Some(c)) => c.model().clone(),
        (None, None) => return Err(Failure::Internal(anyhow!("no model"))),
    };
    Ok((model_dir, model))
}

/// The first keys (up to three) of the HF config where `given` and `saved`
/// differ, as `key: given` against `key: saved`.
fn config_difference(given: &Model, saved: &Model) -> String {
    let (a, b) = (given.hf_config_value(), saved.hf_config_value());
    let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else {
        return "a field differs".to_owned();
    };
    let null = serde_json::Value::Null;
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    let diffs: Vec<String> = keys
        .into_iter()
        .filter(|k| a.get(*k).unwrap_or(&null) != b.get(*k).unwrap_or(&null))
        .take(3)
        .map(|k| {
            format!(
                "{k}: {} against the checkpoint's {k}: {}",
                a.get(k).unwrap_or(&null),
                b.get(k).unwrap_or(&null)
            )
        })
        .collect();
    match diffs.is_empty() {
        true => "a field differs".to_owned(),
        false => diffs.join("; "),
    }
}

//! The training data of `tierzero train`: `--data` (or the embedded
//! corpus) loaded and checked against the run, and whether a resumed
//! checkpoint read other data.

use super::*;

/// Whether the data a checkpoint names (`was`, a path as given then, or
/// the embedded corpus's name) is not the run's (`now`): their resolved
/// paths differ, or where either does not resolve (another working
/// directory, moved), their file names.
pub(super) fn other_data(was: &str, now: &str) -> bool {
    match (std::fs::canonicalize(was), std::fs::canonicalize(now)) {
        (Ok(a), Ok(b)) => a != b,
        _ => Path::new(was).file_name() != Path::new(now).file_name(),
    }
}

/// The data order. Shuffled or in file order: `--data-order`, else a
/// resumed run's checkpoint's, else shuffled. The shuffle's seed: `--seed`,
/// else a resumed run's (the checkpoint's shuffle's; a file-order
/// checkpoint's run seed), else `seed`'s default.
pub(super) fn data_order(args: &TrainArgs, seed: u64, ckpt: Option<&Checkpoint>) -> DataOrder {
    let saved = ckpt.map(|c| c.manifest().data.order_or_file());
    let shuffled = match args.data_order.as_deref() {
        Some(o) => o == "shuffled",
        None => saved != Some(DataOrder::Sequential),
    };
    if !shuffled {
        return DataOrder::Sequential;
    }
    let seed = match (&args.seed, saved, ckpt) {
        (Some(_), ..) => seed,
        (None, Some(DataOrder::Shuffled { seed }), _) => seed,
        (None, _, Some(c)) => c.manifest().seed,
        (None, _, None) => seed,
    };
    DataOrder::Shuffled { seed }
}

/// The data flags that read `--data`'s file, refused without `--data`
/// (checked with the other flags, before the config and the data).
pub(super) fn check_data_flags(args: &TrainArgs) -> Result<(), Failure> {
    if args.data.is_some() {
        return Ok(());
    }
    let o = &args.data_options;
    let given: Vec<&str> = [
        (o.data_format != "auto", "--data-format"),
        (o.text_field != "text", "--text-field"),
        (o.eos_id.is_some(), "--eos-id"),
        (o.no_data_cache, "--no-data-cache"),
        (o.data_cache_dir.is_some(), "--data-cache-dir"),
    ]
    .into_iter()
    .filter_map(|(on, flag)| on.then_some(flag))
    .collect();
    if given.is_empty() {
        return Ok(());
    }
    Err(bad(format!(
        "{} without --data: the embedded corpus is read as bytes, so {} would change \
         nothing; give --data FILE",
        given.join(", "),
        if given.len() == 1 { "it" } else { "they" }
    )))
}

/// A resume names its data: without `--data` the run reads the embedded
/// corpus, so a checkpoint of a run on other data is refused naming it.
/// It was only a warning in the log, and the resumed run went on with
/// the embedded corpus at the checkpoint's sample count: weights unlike an
/// uninterrupted run's, exit 0.
pub(super) fn check_resumed_data(
    args: &TrainArgs,
    ckpt: Option<&Checkpoint>,
) -> Result<(), Failure> {
    let Some(c) = ckpt.filter(|_| args.data.is_none()) else {
        return Ok(());
    };
    let source = &c.manifest().data.source;
    if source == DEFAULT_CORPUS_NAME {
        return Ok(());
    }
    Err(bad(format!(
        "--resume {}: the checkpoint's run trained on {source}, and without --data this run \
         would read the embedded corpus; give --data {source} (with the --tokenizer and \
         --data-format it had) to continue it, or --data with other data to go on with that",
        c.dir().display()
    )))
}

/// A resume without `--config` runs the embedded default: a checkpoint
/// whose run had settings that change the numbers (batch, precision,
/// optimizer and lr, clipping, sub-group size) other than this run's is
/// refused naming them. It was only a warning in the log (a bf16 run
/// resumed as fp32, an lr of 1e-3 as 5e-5). The schedule and the data
/// order are left to their own rules (`--steps`, `--data-order`).
pub(super) fn check_resumed_config(
    args: &TrainArgs,
    config: &tierzero::config::Config,
    order: DataOrder,
    ckpt: Option<&Checkpoint>,
) -> Result<(), Failure> {
    let Some(c) = ckpt.filter(|_| args.config.is_none()) else {
        return Ok(());
    };
    let differ: Vec<String> =
        tierzero::engine::trainer::numerics_differing(config, order, c.manifest())
            .into_iter()
            .filter(|d| !matches!(d.key.as_str(), "scheduler" | "data_order"))
            .map(|d| d.to_string())
            .collect();
    if differ.is_empty() {
        return Ok(());
    }
    Err(bad(format!(
        "--resume {}: the checkpoint's run had other settings than this run's embedded default \
         config: {}; give that run's --config (and its --micro-batch, --grad-accum, --lr) to \
         continue it, or a --config with the new settings to change them",
        c.dir().display(),
        differ.join("; ")
    )))
}

/// The token data of `--data` (or the embedded corpus), its name, a line
/// on what was read (none for the embedded corpus), and the EOS id
/// appended to each document (with a tokenizer).
pub(super) fn load_data(
    args: &TrainArgs,
    model: &Model,
) -> Result<(TokenData, String, Option<String>, Option<u32>), Failure> {
    // Too few tokens are refused by the caller with the micro-batch's
    // need (`micro × seq_len + 1`), not `seq_len + 1` here: a corpus given
    // the first number was then refused with the second.
    match &args.data {
        Some(p) => {
            let (d, line, eos) = crate::cli::tokens::load_tokens(
                p,
                args.tokenizer.as_deref(),
                &args.data_options,
                model,
            )?;
            Ok((d, p.display().to_string(), Some(line), eos))
        }
        None => {
            check_data_flags(args)?;
            Ok((
                TokenData::from_bytes(DEFAULT_CORPUS, Path::new(DEFAULT_CORPUS_NAME)),
                DEFAULT_CORPUS_NAME.to_owned(),
                None,
                None,
            ))
        }
    }
}

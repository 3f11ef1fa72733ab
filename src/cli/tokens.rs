//! Reading `--data` for `train` and `eval`: one place that turns a file
//! into token ids (bytes, text documents or JSONL with `--tokenizer`, or a
//! token file), says what it did, and explains what is wrong in one line.

use std::io::IsTerminal as _;
use std::path::Path;

use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tierzero::data::{DataFormat, DataSpec, Loaded, Origin, TokenData};
use tierzero::engine::EngineError;
use tierzero::model::Model;
use tierzero::units::format_bytes;

use super::train::{bad, must_exist};
use super::Failure;

/// How `--data` is read (shared by `train` and `eval`).
#[derive(Debug, Clone, Args)]
pub struct DataOptions {
    /// What --data is: auto (by extension: .jsonl/.json JSONL, .u16/.u32 or
    /// .bin/.tokens token ids, else text documents with --tokenizer and
    /// bytes without), bytes, text (the whole file is one document),
    /// paragraphs (documents end at a blank line), lines (each line is a
    /// document), jsonl, u16 or u32 (flat little-endian token ids)
    #[arg(long, value_name = "FORMAT", default_value = "auto")]
    pub data_format: String,
    /// The JSONL field holding each document's text
    #[arg(long, value_name = "NAME", default_value = "text")]
    pub text_field: String,
    /// The id appended after each document, or none (no id: the stream
    /// HF's `tokenizer(text)` makes, as its perplexity recipe and run_clm
    /// encode). Default: eos_token_id from the model's config.json, else
    /// the tokenizer's end-of-text token
    #[arg(long, value_name = "ID|none")]
    pub eos_id: Option<String>,
    /// Do not keep the encoded corpus next to the data (it is cached as
    /// .<data>.tz-<key>.u16 by default, so the next run starts at once)
    #[arg(long)]
    pub no_data_cache: bool,
    /// Keep the encoded corpus in DIR instead. Default: next to the data,
    /// or where its directory is not writable (a read-only dataset mount)
    /// in $XDG_CACHE_HOME/tierzero/tokens, else ~/.cache/tierzero/tokens
    #[arg(long, value_name = "DIR", conflicts_with = "no_data_cache")]
    pub data_cache_dir: Option<std::path::PathBuf>,
}

/// End-of-text tokens of common tokenizers, in the order they are tried
/// when the model's config has no `eos_token_id`.
const EOS_TOKENS: [&str; 6] = [
    "<|endoftext|>",
    "</s>",
    "<|end_of_text|>",
    "<eos>",
    "<|im_end|>",
    "[SEP]",
];

/// The EOS id after each document: `--eos-id` (`none`: no id), else the
/// model config's `eos_token_id`, else the tokenizer's end-of-text token.
fn eos_id(opts: &DataOptions, model: &Model, tokenizer: &Path) -> Result<Option<u32>, Failure> {
    let vocab = model.config().vocab_size as u64;
    if let Some(s) = &opts.eos_id {
        let s = s.trim();
        if s.eq_ignore_ascii_case("none") {
            return Ok(None);
        }
        // A token id, not a count: "0.1K" was id 100.
        let id = s
            .parse::<u64>()
            .ok()
            .filter(|&id| id < vocab)
            .ok_or_else(|| {
                bad(format!(
                    "--eos-id {s}: give a token id below the model's vocab_size {vocab} (a whole \
                     number), or none to append no id"
                ))
            })?;
        return Ok(Some(id as u32));
    }
    eos_default(model, tokenizer, vocab).map(Some)
}

/// The EOS id when `--eos-id` is not given.
fn eos_default(model: &Model, tokenizer: &Path, vocab: u64) -> Result<u32, Failure> {
    if let Some(id) = model.token_ids().eos() {
        return u32::try_from(id)
            .ok()
            .filter(|&i| u64::from(i) < vocab)
            .ok_or_else(|| {
                bad(format!(
                    "the model's eos_token_id {id} is not below its vocab_size {vocab}; give \
                     --eos-id"
                ))
            });
    }
    let t = tierzero::data::encode::open_tokenizer(tokenizer).map_err(tokenizer_failure)?;
    if let Some((name, id)) = EOS_TOKENS
        .iter()
        .find_map(|name| Some((name, t.token_to_id(name)?)))
        .filter(|(_, id)| u64::from(*id) >= vocab)
    {
        return Err(bad(format!(
            "--tokenizer {}: its end-of-text token {name} is id {id}, not below the model's \
             vocab_size {vocab} (the model's config.json has no eos_token_id); give --eos-id \
             with the model's end-of-text id",
            tokenizer.display()
        )));
    }
    EOS_TOKENS
        .iter()
        .find_map(|name| t.token_to_id(name))
        .ok_or_else(|| {
            bad(format!(
                "--tokenizer {}: no end-of-text token to put after each document (the \
                 model's config.json has no eos_token_id, and the tokenizer has none of {}); \
                 give --eos-id ID",
                tokenizer.display(),
                EOS_TOKENS.join(", ")
            ))
        })
}

/// A tokenizer that cannot be used, named by its flag (not as "data").
fn tokenizer_failure(e: EngineError) -> Failure {
    match e {
        EngineError::Tokenizer { path, reason } => {
            bad(format!("--tokenizer {}: {reason}", path.display()))
        }
        e => bad(format!("--tokenizer: {e}")),
    }
}

/// `--data` may be a regular file or a pipe (`<(zcat corpus.gz)`), not a
/// device or a socket: `/dev/zero` was read without end.
fn check_data_file(data: &Path) -> Result<(), Failure> {
    use std::os::unix::fs::FileTypeExt as _;
    let Ok(t) = std::fs::metadata(data).map(|m| m.file_type()) else {
        return Ok(());
    };
    if !(t.is_char_device() || t.is_block_device() || t.is_socket()) {
        return Ok(());
    }
    Err(bad(format!(
        "--data {}: is a {}; give a file, or a pipe such as <(zcat corpus.txt.gz)",
        data.display(),
        tierzero::durable::kind_of(t)
    )))
}

/// Compressed data (text or bytes only: `token_ids` false) or a dataset
/// container read as training data trained on their encoding without a
/// word: the file's first bytes are checked for the common formats.
fn check_not_data(data: &Path, token_ids: bool) -> Result<(), Failure> {
    use std::io::Read as _;
    if !std::fs::metadata(data).is_ok_and(|m| m.is_file()) {
        return Ok(());
    }
    let mut head = Vec::new();
    let probe_bytes = tierzero::data::format::WIDE_TEXT_PROBE_BYTES as u64;
    let n = std::fs::File::open(data)
        .and_then(|f| f.take(probe_bytes).read_to_end(&mut head))
        .unwrap_or(0);
    let why = match token_ids {
        true => tierzero::data::format::container_of(&head[..n])
            .map(|(what, fix)| format!("it is a {what} file; {fix}")),
        false => tierzero::data::format::not_data_reason(&head[..n], data, false),
    };
    match why {
        None => Ok(()),
        Some(why) => Err(bad(format!("--data {}: {why}", data.display()))),
    }
}

/// A progress bar over the data's bytes while text is encoded (stderr,
/// when it is a terminal).
fn encode_bar(total_bytes: u64) -> Option<ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = ProgressBar::with_draw_target(Some(total_bytes), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(
        "encoding {bar:30} {binary_bytes}/{binary_total_bytes} ({binary_bytes_per_sec}, eta {eta})",
    ) {
        bar.set_style(style);
    }
    Some(bar)
}

/// Token ids of `data` as `opts` and `tokenizer` say, every id checked
/// against the model's `vocab_size`; a line saying what was read; and the
/// EOS id appended to each document, if any.
pub(super) fn load_tokens(
    data: &Path,
    tokenizer: Option<&Path>,
    opts: &DataOptions,
    model: &Model,
) -> Result<(TokenData, String, Option<u32>), Failure> {
    must_exist("--data", data, false, "give a text, JSONL or token file")?;
    check_data_file(data)?;
    if let Some(t) = tokenizer {
        must_exist("--tokenizer", t, false, "give a HF tokenizer.json file")?;
    }
    let format = DataFormat::detect(
        data,
        Some(opts.data_format.as_str()),
        tokenizer.is_some(),
        &opts.text_field,
    )
    .map_err(|e| bad(format!("--data: {e}")))?;
    // A data flag that would change nothing is refused, not ignored.
    let encodes = tokenizer.is_some() && format.needs_tokenizer();
    if opts.eos_id.is_some() && !encodes {
        return Err(bad(format!(
            "--eos-id: {} is read as {} without encoding, so no id is appended; give \
             --tokenizer with text or JSONL data, or drop --eos-id",
            data.display(),
            format.name()
        )));
    }
    if opts.text_field != "text" && !matches!(format, DataFormat::Jsonl { .. }) {
        return Err(bad(format!(
            "--text-field {}: {} is not read as JSONL ({}); give --data-format jsonl or drop \
             --text-field",
            opts.text_field,
            data.display(),
            format.name()
        )));
    }
    if !encodes && (opts.no_data_cache || opts.data_cache_dir.is_some()) {
        return Err(bad(format!(
            "{}: {} is read as {} without encoding, so nothing is cached; give --tokenizer \
             with text or JSONL data, or drop the flag",
            if opts.no_data_cache {
                "--no-data-cache"
            } else {
                "--data-cache-dir"
            },
            data.display(),
            format.name()
        )));
    }
    if let Some(d) = &opts.data_cache_dir {
        if d.exists() && !d.is_dir() {
            return Err(bad(format!(
                "--data-cache-dir {}: is not a directory; give a directory (it is created if \
                 missing)",
                d.display()
            )));
        }
    }
    // A token file's first ids may be anything (a compression magic
    // among them); a container's 4 to 8 magic bytes are not ids.
    check_not_data(data, matches!(format, DataFormat::Tokens(_)))?;
    let eos = match tokenizer {
        Some(t) if format.needs_tokenizer() => eos_id(opts, model, t)?,
        _ => None,
    };
    let spec = DataSpec {
        path: data.to_owned(),
        format: format.clone(),
        tokenizer: tokenizer.map(Path::to_path_buf),
        eos,
        cache: !opts.no_data_cache,
        cache_dir: opts.data_cache_dir.clone(),
    };
    let started = std::time::Instant::now();
    let total = std::fs::metadata(data).map_or(0, |m| m.len());
    let bar = if format.needs_tokenizer() {
        encode_bar(total)
    } else {
        None
    };
    let loaded = TokenData::load(&spec, model.config().vocab_size, &|done, _| {
        if let Some(b) = &bar {
            b.set_position(done);
        }
    });
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    let loaded = loaded.map_err(|e| match (tokenizer, e) {
        (_, e @ EngineError::Tokenizer { .. }) => tokenizer_failure(e),
        (Some(_), e) => bad(format!("--data with --tokenizer: {e}")),
        (None, e) => bad(format!("--data: {e}")),
    })?;
    let line = describe(
        &loaded,
        &format,
        eos,
        total,
        started.elapsed().as_secs_f64(),
    );
    Ok((loaded.data, line, eos))
}

/// One line on what was read: tokens, documents, and the cache.
fn describe(
    l: &Loaded,
    format: &DataFormat,
    eos: Option<u32>,
    total_bytes: u64,
    seconds: f64,
) -> String {
    let plural = |d: u64| if d == 1 { "document" } else { "documents" };
    let docs = match (l.documents, eos) {
        (Some(d), Some(e)) => format!(", {d} {}, each followed by EOS id {e}", plural(d)),
        (Some(d), None) => format!(", {d} {}", plural(d)),
        _ => String::new(),
    };
    let how = match &l.origin {
        Origin::Read if l.data.is_mapped() => "mapped".to_owned(),
        Origin::Read => "read".to_owned(),
        Origin::CacheHit(p) => format!("from the token cache {}", p.display()),
        Origin::Encoded {
            cached,
            no_cache,
            superseded,
        } => format!(
            "encoded in {seconds:.1} s ({}/s){}{}",
            format_bytes((total_bytes as f64 / seconds.max(1e-9)) as u64),
            match (cached, no_cache) {
                (Some(p), _) => format!(", cached in {}", p.display()),
                (None, Some(why)) => format!(", not cached: {why}"),
                (None, None) => String::new(),
            },
            match superseded.len() {
                0 => String::new(),
                n => format!(
                    "; removed {n} cache entr{} of an earlier content of the data ({})",
                    if n == 1 { "y" } else { "ies" },
                    format_bytes(superseded.iter().map(|(_, b)| b).sum())
                ),
            }
        ),
    };
    format!(
        "data: {} tokens ({}{docs}), {how}",
        l.data.len(),
        format.name()
    )
}

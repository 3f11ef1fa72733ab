//! `tierzero eval`: mean next-token cross-entropy and perplexity of a model
//! on a token file (the library side is `tierzero::eval`, which documents
//! the windows and the weighting).
//!
//! Design:
//! * **Weights.** `--model DIR` is a HF directory (`config.json` plus
//!   safetensors; `config.json` alone evaluates the seeded init of
//!   `--seed`, as `train` would start from). `--checkpoint DIR` is a
//!   tierzero checkpoint; both end in one `fetch` closure handed to
//!   `tierzero::eval::evaluate`, so a weight source is one match arm.
//! * **Data.** Byte-level like `train` unless `--tokenizer` names a HF
//!   `tokenizer.json`.
//! * **Output.** Plain text: a header line, `loss` and `perplexity`. With
//!   `--json`, stdout is exactly one object `{"loss", "perplexity",
//!   "tokens"}` (`tokens` = predicted tokens, the count the mean is over);
//!   the header goes to stderr.
//! * **Errors.** Every user mistake (seq_len < 2 or above the model's
//!   positions, data shorter than one window, token ids outside the
//!   vocabulary, missing files) is one line and exit 2.

use std::path::PathBuf;

use candle_core::{DType, Device};
use clap::Args;

use tierzero::eval::{evaluate, EvalError, EvalOptions, EvalResult, Windows};
use tierzero::model::{ModelConfig, ModelDir};

use super::tokens::load_tokens;
use super::train::{bad, must_exist, number};
use super::{emit, Failure};

const EXAMPLES: &str = "\
Examples:
  tierzero eval --model ./gpt2 --data valid.txt --seq-len 1024 --tokenizer ./gpt2/tokenizer.json
  tierzero eval --model ./my-model --data valid.txt --seq-len 128 --json
      prints {\"loss\": <mean nats>, \"perplexity\": <exp(loss)>, \"tokens\": <predicted>}

Windows of --seq-len L tokens do not overlap; in each, positions 1..L-1 are
predicted from the ones before (HF's labels=input_ids convention), and a
trailing partial window of 2 or more tokens counts. The loss is the mean over
all predicted tokens; \"tokens\" is their count.

With --tokenizer a .txt file is documents at blank lines, each followed by the
EOS id. HF's perplexity recipe (tokenizer(text) of the whole file, no EOS) is
--data-format text --eos-id none: the same ids, so the same loss.
";

/// `tierzero eval` options.
#[derive(Debug, Args)]
#[command(after_help = EXAMPLES)]
#[command(group(clap::ArgGroup::new("weights").required(true).args(["model", "checkpoint"])))]
pub struct EvalArgs {
    /// HF model directory: config.json plus *.safetensors (GPT-2 or the Llama
    /// family: Llama, Mistral, Qwen2, Qwen3); config.json alone means the seeded init of --seed.
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// A tierzero checkpoint directory (evaluates its fp32 master weights).
    #[arg(long, value_name = "DIR", conflicts_with = "model")]
    checkpoint: Option<PathBuf>,
    /// Text to evaluate on, byte-level unless --tokenizer is given.
    #[arg(long, value_name = "FILE")]
    data: PathBuf,
    /// Window length L in tokens (each window gives L-1 predictions);
    /// from 2 to the model's maximum positions.
    #[arg(long, value_name = "L")]
    seq_len: String,
    /// HF tokenizer.json to turn --data's text into token ids, document by
    /// document, with its truncation and padding off.
    #[arg(long, value_name = "tokenizer.json")]
    tokenizer: Option<PathBuf>,
    #[command(flatten)]
    data_options: super::tokens::DataOptions,
    /// Windows per forward pass (bounds memory: the logits take
    /// N x (L-1) x vocab_size x 4 bytes, 6 under bf16/fp16); does not change
    /// the result.
    #[arg(long, value_name = "N", default_value = "4")]
    batch: String,
    /// Seed of the init when --model has no weights (default 1); refused
    /// where there is no init to seed (weights, or --checkpoint).
    #[arg(long, value_name = "N", conflicts_with = "checkpoint")]
    seed: Option<String>,
    /// The dtype the model runs in: fp32, or bf16 / fp16 as training
    /// computes with bf16 / fp16 enabled (weights rounded to 16 bits,
    /// 16-bit matmuls with fp32 accumulation, fp32 norms, softmax and loss;
    /// the policy of tierzero::model::precision).
    #[arg(long, value_name = "fp32|bf16|fp16", default_value = "fp32")]
    precision: String,
    /// Print {"loss": ..., "perplexity": ..., "tokens": ...} on stdout.
    #[arg(long)]
    json: bool,
    /// Open --model even when its config.json has keys tierzero does not
    /// know (each is warned about and ignored): at your own risk, the model
    /// evaluated may not be the one the file describes.
    #[arg(long, conflicts_with = "checkpoint")]
    allow_unknown_model_keys: bool,
}

/// Classifies an evaluation error: input mistakes are exit 2, with the flag
/// they come from. A weight that does not load (a checkpoint file whose
/// crc fails, a truncated safetensors) is the weights' flag's: it was an
/// internal error, exit 1, where export and a resume said exit 2.
fn eval_failure(e: EvalError, args: &EvalArgs) -> Failure {
    let data = &args.data;
    let weights = || match (&args.checkpoint, &args.model) {
        (Some(d), _) => format!("--checkpoint {}", d.display()),
        (None, Some(d)) => format!("--model {}", d.display()),
        (None, None) => "the weights".to_owned(),
    };
    if let EvalError::Fetch { source, .. } = &e {
        let users = source
            .downcast_ref::<tierzero::checkpoint::CheckpointError>()
            .is_some_and(|c| !matches!(c, tierzero::checkpoint::CheckpointError::Candle(_)))
            || source
                .downcast_ref::<tierzero::model::ModelError>()
                .is_some_and(|m| !matches!(m, tierzero::model::ModelError::Candle(_)));
        if users {
            let fix = match &args.checkpoint {
                Some(d) => match tierzero::checkpoint::Checkpoint::open(d) {
                    Ok(c) => super::older_step_advice(&c, "--checkpoint"),
                    Err(_) => String::new(),
                },
                None => String::new(),
            };
            return bad(format!("{}: {e}{fix}", weights()));
        }
    }
    let flag = match e {
        EvalError::SeqLenTooSmall { .. } | EvalError::SeqLenTooLarge { .. } => {
            "--seq-len".to_owned()
        }
        EvalError::TooFewTokens { .. } | EvalError::TokenOutOfVocab { .. } => {
            format!("--data {}", data.display())
        }
        // One window in the batch: only a shorter one helps.
        EvalError::LogitsTooLarge { windows: 1, .. } => "--seq-len".to_owned(),
        EvalError::ZeroBatch | EvalError::LogitsTooLarge { .. } => "--batch".to_owned(),
        EvalError::NotFinite { .. } => weights(),
        other => return Failure::Internal(anyhow::Error::new(other)),
    };
    bad(format!("{flag}: {e}"))
}

/// Runs `tierzero eval`.
pub fn run(args: EvalArgs) -> Result<(), Failure> {
    super::json_object_on_failure(args.json);
    // A signal while a corpus is encoded into its token cache removes the
    // cache's temporary file (a corpus's tokens; it stayed for ever once
    // the corpus changed, its key with it).
    super::signals::exit_removing_writes_on_signal(Vec::new())?;
    let seq_len = number("--seq-len", &args.seq_len, 2, 1 << 30)? as usize;
    let batch = number("--batch", &args.batch, 1, 1 << 20)? as usize;
    let seed = number("--seed", args.seed.as_deref().unwrap_or("1"), 0, u64::MAX)?;
    let dtype = match args.precision.as_str() {
        "fp32" => DType::F32,
        "bf16" => DType::BF16,
        "fp16" => DType::F16,
        other => {
            return Err(bad(format!(
                "--precision {other:?}: give fp32, bf16 or fp16"
            )))
        }
    };
    let device = Device::Cpu;
    let opts = EvalOptions {
        seq_len,
        batch_windows: batch,
        device: device.clone(),
        pass_bytes: tierzero::eval::DEFAULT_PASS_BYTES,
        dtype,
    };
    // Each weight source gives the model and one fetch closure.
    if let Some(dir) = &args.checkpoint {
        must_exist(
            "--checkpoint",
            dir,
            true,
            "give a checkpoint directory written by tierzero train --save-dir",
        )?;
        let ck = tierzero::checkpoint::Checkpoint::open(dir)
            .map_err(|e| bad(format!("--checkpoint {}: {e}", dir.display())))?;
        super::newest_save(&ck, dir, "--checkpoint")?;
        let (data, data_line, _) = load_tokens(
            &args.data,
            args.tokenizer.as_deref(),
            &args.data_options,
            ck.model(),
        )?;
        let result = evaluate(ck.model(), |id| ck.load_param_f32(id), &data, &opts);
        return report(
            &args,
            &format!(
                "checkpoint {} (step {}, fp32 masters)",
                ck.dir().display(),
                ck.step()
            ),
            ck.model().config(),
            (data.len(), &data_line),
            result,
        );
    }
    let Some(dir) = &args.model else {
        return Err(bad("give --model DIR (a HF directory) or --checkpoint DIR"));
    };
    let fix = "give a HF model directory with config.json (and optionally *.safetensors)";
    must_exist("--model", dir, true, fix)?;
    must_exist("--model", &dir.join("config.json"), false, fix)?;
    let open_opts = super::model_dir_options(args.allow_unknown_model_keys);
    let md = ModelDir::open_with(dir, seed, open_opts)
        .map_err(|e| bad(format!("--model {}: {e}", dir.display())))?;
    if md.has_weights() && args.seed.is_some() {
        return Err(bad(format!(
            "--seed sets the init of a model without weights, and --model {} has weights: \
             drop --seed",
            dir.display()
        )));
    }
    let (data, data_line, _) = load_tokens(
        &args.data,
        args.tokenizer.as_deref(),
        &args.data_options,
        md.model(),
    )?;
    let result = evaluate(
        md.model(),
        |id| md.load_param(id, DType::F32, &device),
        &data,
        &opts,
    );
    let source = if md.has_weights() {
        "weights from safetensors".to_owned()
    } else {
        format!("seeded init, seed {seed}")
    };
    report(
        &args,
        &format!("{} ({source})", dir.display()),
        md.model().config(),
        (data.len(), &data_line),
        result,
    )
}

/// Prints the result of an evaluation (or classifies its error).
fn report(
    args: &EvalArgs,
    model_name: &str,
    mc: &ModelConfig,
    (n_tokens, data_line): (usize, &str),
    result: Result<EvalResult, EvalError>,
) -> Result<(), Failure> {
    let data_name = args.data.display();
    let r = result.map_err(|e| eval_failure(e, args))?;
    let seq_len = number("--seq-len", &args.seq_len, 2, 1 << 30)? as usize;
    let windows = Windows::new(n_tokens, seq_len).map_err(|e| eval_failure(e, args))?;
    // What was read goes to stderr; stdout carries the result.
    errln!("{data_line}");
    let header = format!(
        "tierzero eval: model {model_name}, {} layers, hidden {}, vocab {}; data {data_name}: \
         {n_tokens} tokens in {} windows of {seq_len} ({} full{}{}), {} predicted; precision {}",
        mc.n_layer,
        mc.hidden_size,
        mc.vocab_size,
        r.windows,
        windows.full,
        if windows.partial_len > 0 {
            format!(", 1 partial of {}", windows.partial_len)
        } else {
            String::new()
        },
        if windows.dropped > 0 {
            format!(", {} trailing token dropped", windows.dropped)
        } else {
            String::new()
        },
        r.tokens,
        args.precision
    );
    if args.json {
        errln!("{header}");
        let obj = serde_json::json!({
            "loss": r.loss,
            "perplexity": r.perplexity,
            "tokens": r.tokens,
        });
        emit(&format!("{obj}\n"))
    } else {
        emit(&format!(
            "{header}\nloss: {:.6}\nperplexity: {:.4}\n",
            r.loss, r.perplexity
        ))
    }
}

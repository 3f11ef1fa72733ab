//! Reading `--data` (with `--tokenizer` when given) for `train` and `eval`:
//! one place that turns a file into token ids and explains what is wrong
//! in one line.

use std::path::Path;

use tierzero::data::TokenData;
use tierzero::model::ModelConfig;

use super::train::{bad, must_exist};
use super::Failure;

/// Token ids of `data`: encoded with the HF `tokenizer.json` when one is
/// given, else byte-level. Every id is checked against the model's
/// `vocab_size`.
pub(super) fn load_tokens(
    data: &Path,
    tokenizer: Option<&Path>,
    model: &ModelConfig,
) -> Result<TokenData, Failure> {
    must_exist("--data", data, false, "give a text file")?;
    match tokenizer {
        Some(t) => {
            must_exist("--tokenizer", t, false, "give a HF tokenizer.json file")?;
            TokenData::from_tokenizer_file(data, t, model.vocab_size)
                .map_err(|e| bad(format!("--data with --tokenizer: {e}")))
        }
        None => {
            let d = TokenData::from_byte_file(data).map_err(|e| bad(format!("--data: {e}")))?;
            if d.vocab_needed() > model.vocab_size {
                return Err(bad(format!(
                    "--data {}: byte-level tokens go up to {} but the model's vocab_size is {}; \
                     use a model with vocab_size >= 256 or give --tokenizer",
                    data.display(),
                    d.vocab_needed() - 1,
                    model.vocab_size
                )));
            }
            Ok(d)
        }
    }
}

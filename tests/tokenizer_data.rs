//! `TokenData::from_tokenizer_file`: hand-written HF `tokenizer.json` files
//! (tests/fixtures/tokenizer) give the ids worked out by hand, and ids at or
//! above the model's vocab_size are refused with both numbers.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::path::{Path, PathBuf};

use tierzero::data::TokenData;
use tierzero::engine::EngineError;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizer")
        .join(name)
}

fn text_file(tag: &str, text: &[u8]) -> PathBuf {
    let p = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("tokenizer-data-{tag}-{}.txt", std::process::id()));
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn wordlevel_ids_are_the_vocabulary_entries() {
    let data = text_file("wl", b"The engine streams layers from NVMe. The GPU waits.");
    let t = TokenData::from_tokenizer_file(&data, &fixture("wordlevel.json"), 8).unwrap();
    // lowercase; `\w+|[^\w\s]+` splits the period off; gpu and waits are [UNK].
    assert_eq!(&*t.tokens(), &[1, 2, 3, 4, 6, 7, 5, 1, 0, 0, 5]);
    assert_eq!(t.len(), 11);
}

#[test]
fn byte_level_bpe_ids_follow_the_merges_and_gpt2_split() {
    // "hello hello!" splits (GPT-2 regex) into "hello", " hello", "!";
    // byte-level maps the space to Ġ; the merges build hello (8), Ġhello (9).
    let data = text_file("bpe1", b"hello hello!");
    let t = TokenData::from_tokenizer_file(&data, &fixture("bytelevel_bpe.json"), 11).unwrap();
    assert_eq!(&*t.tokens(), &[8, 9, 10]);
    // Two spaces: `\s+(?!\S)` (look-ahead) takes the first alone (Ġ = 4),
    // the second joins the word.
    let data = text_file("bpe2", b"hello  hello");
    let t = TokenData::from_tokenizer_file(&data, &fixture("bytelevel_bpe.json"), 11).unwrap();
    assert_eq!(&*t.tokens(), &[8, 4, 9]);
    // Partial merges: "hel" -> he, l.
    let data = text_file("bpe3", b"hel");
    let t = TokenData::from_tokenizer_file(&data, &fixture("bytelevel_bpe.json"), 11).unwrap();
    assert_eq!(&*t.tokens(), &[5, 2]);
}

#[test]
fn ids_at_or_above_vocab_size_name_both_numbers() {
    let data = text_file("oov", b"hello hello!");
    let e = TokenData::from_tokenizer_file(&data, &fixture("bytelevel_bpe.json"), 10).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, EngineError::Data { .. }), "{msg}");
    assert!(
        msg.contains("token id 10") && msg.contains("vocab_size is 10"),
        "{msg}"
    );
}

#[test]
fn unusable_files_are_data_errors() {
    let data = text_file("ok", b"the engine");
    let broken = text_file("broken-tok", b"{\"model\": ");
    let e = TokenData::from_tokenizer_file(&data, &broken, 8).unwrap_err();
    assert!(e.to_string().contains("tokenizer.json"), "{e}");
    let binary = text_file("binary", &[0x74, 0x68, 0xff, 0xfe]);
    let e = TokenData::from_tokenizer_file(&binary, &fixture("wordlevel.json"), 8).unwrap_err();
    assert!(e.to_string().contains("UTF-8"), "{e}");
    assert!(e.to_string().contains("offset 2"), "{e}");
}

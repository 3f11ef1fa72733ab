//! `tierzero eval`, run as the built binary: the JSON result equals the
//! library's `evaluate` on the same model, data and windows (seeded init and
//! safetensors weights), text output, `--batch` independence, a HF
//! tokenizer, and user mistakes (exit 2, one line).
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failure is a panic

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use serde_json::{json, Value};
use tierzero::data::TokenData;
use tierzero::eval::{evaluate, EvalOptions};
use tierzero::model::{save_hf_dir, ModelDir};

mod cli_support;
use cli_support::{assert_bad_input, run_tierzero, Out};

fn scratch(tag: &str) -> PathBuf {
    cli_support::scratch("cli-eval", tag)
}

fn eval(cwd: &Path, args: &[&str]) -> Out {
    let mut all = vec!["eval"];
    all.extend_from_slice(args);
    run_tierzero(Some(cwd), &all)
}

fn write_model(d: &Path, name: &str, vocab: usize) {
    std::fs::create_dir_all(d.join(name)).unwrap();
    let cfg = json!({"model_type": "gpt2", "vocab_size": vocab, "n_positions": 32,
        "n_embd": 16, "n_layer": 2, "n_head": 2, "tie_word_embeddings": true});
    std::fs::write(d.join(name).join("config.json"), cfg.to_string()).unwrap();
}

/// `model/` (seeded GPT-2, byte vocab) and `data.txt` (250 bytes).
fn setup(tag: &str) -> PathBuf {
    let d = scratch(tag);
    write_model(&d, "model", 256);
    let text = "tierzero streams each layer in just before it runs. ".repeat(5);
    assert_eq!(text.len(), 260);
    std::fs::write(d.join("data.txt"), &text[..250]).unwrap();
    d
}

fn library(model_dir: &Path, data: &TokenData, seq_len: usize, seed: u64) -> (f64, usize) {
    let md = ModelDir::open(model_dir, seed).unwrap();
    let r = evaluate(
        md.model(),
        |id| md.load_param(id, DType::F32, &Device::Cpu),
        data,
        &EvalOptions {
            seq_len,
            batch_windows: 1,
            device: Device::Cpu,
            pass_bytes: tierzero::eval::DEFAULT_PASS_BYTES,
            dtype: DType::F32,
        },
    )
    .unwrap();
    (r.loss, r.tokens)
}

fn json_result(out: &Out) -> (f64, f64, u64) {
    assert_eq!(out.code, 0, "stderr: {}", out.stderr);
    let v: Value = serde_json::from_str(out.stdout.trim())
        .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}): {}", out.stdout));
    let obj = v.as_object().unwrap();
    let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["loss", "perplexity", "tokens"]);
    (
        v["loss"].as_f64().unwrap(),
        v["perplexity"].as_f64().unwrap(),
        v["tokens"].as_u64().unwrap(),
    )
}

#[test]
fn json_result_is_the_library_result_on_the_same_windows() {
    let d = setup("json");
    let out = eval(
        &d,
        &[
            "--model",
            "model",
            "--data",
            "data.txt",
            "--seq-len",
            "16",
            "--json",
            "--batch",
            "1",
        ],
    );
    let (loss, ppl, tokens) = json_result(&out);
    // 250 = 15 * 16 + 10: 15 full windows and a partial one of 10 tokens.
    assert_eq!(tokens, 15 * 15 + 9);
    let data = TokenData::from_byte_file(&d.join("data.txt")).unwrap();
    let (lib_loss, lib_tokens) = library(&d.join("model"), &data, 16, 1);
    assert_eq!(tokens as usize, lib_tokens);
    // Same windows one at a time: the same computation, bit for bit.
    assert_eq!(loss, lib_loss, "CLI and library on the same seed and data");
    assert!((ppl - loss.exp()).abs() <= 1e-12 * ppl);
    // A near-uniform seeded init: close to ln(256).
    assert!((loss - 256f64.ln()).abs() < 0.5, "{loss}");
    // The header goes to stderr, stdout is only the object.
    assert!(out.stderr.contains("16 windows of 16"), "{}", out.stderr);

    // Another seed is another model.
    let out = eval(
        &d,
        &[
            "--model",
            "model",
            "--data",
            "data.txt",
            "--seq-len",
            "16",
            "--json",
            "--seed",
            "2",
        ],
    );
    assert_ne!(json_result(&out).0, loss);

    // Windows per forward do not change the result.
    for batch in ["1", "5", "64"] {
        let out = eval(
            &d,
            &[
                "--model",
                "model",
                "--data",
                "data.txt",
                "--seq-len",
                "16",
                "--json",
                "--batch",
                batch,
            ],
        );
        let (b_loss, _, b_tokens) = json_result(&out);
        assert_eq!(b_tokens, tokens);
        assert!((b_loss - loss).abs() <= 1e-6 * loss, "--batch {batch}");
    }
}

/// `--precision bf16|fp16` runs the model as training does under the
/// precision policy: close to fp32 (a near-uniform init), not the same
/// bits, and the loss is not a 16-bit number.
#[test]
fn precision_bf16_and_fp16() {
    let d = setup("precision");
    let run = |p: &str| {
        let out = eval(
            &d,
            &[
                "--model",
                "model",
                "--data",
                "data.txt",
                "--seq-len",
                "16",
                "--json",
                "--precision",
                p,
            ],
        );
        assert!(
            out.stderr.contains(&format!("precision {p}")),
            "{}",
            out.stderr
        );
        json_result(&out).0
    };
    let fp32 = run("fp32");
    for p in ["bf16", "fp16"] {
        let loss = run(p);
        assert_ne!(loss, fp32, "{p}");
        assert!(
            (loss - fp32).abs() <= 2e-3 * fp32,
            "{p}: {loss} vs fp32 {fp32}"
        );
        let rounded = f64::from(half::bf16::from_f64(loss).to_f32());
        assert_ne!(loss, rounded, "{p}: the loss is fp32, not bf16");
    }
}

#[test]
fn text_output_and_safetensors_weights() {
    let d = setup("text");
    // Weights on disk: the seeded init of seed 9, saved as bf16 safetensors.
    let seeded = ModelDir::open(d.join("model"), 9).unwrap();
    save_hf_dir(d.join("saved"), seeded.model(), DType::BF16, |id| {
        seeded.load_param(id, DType::F32, &Device::Cpu)
    })
    .unwrap();
    let out = eval(
        &d,
        &["--model", "saved", "--data", "data.txt", "--seq-len", "32"],
    );
    assert_eq!(out.code, 0, "stderr: {}", out.stderr);
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{}", out.stdout);
    assert!(
        lines[0].contains("weights from safetensors"),
        "{}",
        lines[0]
    );
    // 250 = 7 * 32 + 26.
    assert!(lines[0].contains("8 windows of 32 (7 full, 1 partial of 26), 242 predicted"));
    let loss: f64 = lines[1].strip_prefix("loss: ").unwrap().parse().unwrap();
    let data = TokenData::from_byte_file(&d.join("data.txt")).unwrap();
    let (lib_loss, _) = library(&d.join("saved"), &data, 32, 0);
    assert!((loss - lib_loss).abs() < 1e-6, "{loss} vs {lib_loss}");
    // bf16 weights differ from the fp32 init, so the loss does too (a
    // little): proves the file was read, not re-initialised.
    let (init_loss, _) = library(&d.join("model"), &data, 32, 9);
    assert_ne!(lib_loss, init_loss);
    assert!((lib_loss - init_loss).abs() < 1e-2);
    assert!(lines[2].starts_with("perplexity: "), "{}", lines[2]);
}

#[test]
fn hf_tokenizer_gives_the_ids() {
    let d = scratch("tok");
    write_model(&d, "model8", 8);
    write_model(&d, "model5", 5);
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer/wordlevel.json");
    let fixture = fixture.to_str().unwrap();
    std::fs::write(
        d.join("words.txt"),
        "the engine streams layers from nvme. ".repeat(4),
    )
    .unwrap();
    // 7 ids per sentence, 28 ids: 3 windows of 8 and a partial of 4 -> 3*7+3.
    // The whole file is one document; the tokenizer ends it with id 5,
    // given as the EOS, so no EOS is added after it.
    let words = |eos: &str| {
        eval(
            &d,
            &[
                "--model",
                "model8",
                "--data",
                "words.txt",
                "--tokenizer",
                fixture,
                "--data-format",
                "text",
                "--eos-id",
                eos,
                "--seq-len",
                "8",
                "--json",
                "--batch",
                "1",
                "--no-data-cache",
            ],
        )
    };
    let (loss, _, tokens) = json_result(&words("5"));
    assert_eq!(tokens, 24);
    let data = TokenData::from_tokenizer_file(&d.join("words.txt"), Path::new(fixture), 8).unwrap();
    assert_eq!(&data.tokens()[..7], &[1, 2, 3, 4, 6, 7, 5]);
    assert_eq!(library(&d.join("model8"), &data, 8, 1).0, loss);
    // `--eos-id none`: no id appended, the stream HF's tokenizer(text)
    // makes (its perplexity recipe's); there was no way to ask for it.
    // (The text's last id is 5, so `--eos-id 5` appended none either.)
    let (loss, _, _) = json_result(&words("none"));
    assert_eq!(library(&d.join("model8"), &data, 8, 1).0, loss);
    let (with_eos, _, _) = json_result(&words("3"));
    assert_ne!(with_eos, loss);
    // An id is a whole number ("0.1K" was read as a count, id 100).
    assert_bad_input(&words("0.1K"), "eos 0.1K", &["--eos-id 0.1K", "or none"]);

    // A model whose vocabulary is too small for the tokenizer's ids.
    let out = eval(
        &d,
        &[
            "--model",
            "model5",
            "--data",
            "words.txt",
            "--tokenizer",
            fixture,
            "--eos-id",
            "4",
            "--seq-len",
            "8",
        ],
    );
    assert_bad_input(
        &out,
        "vocab 5",
        &[
            "--tokenizer",
            "token id 6",
            "token 4 of the corpus",
            "vocab_size is 5",
        ],
    );
}

#[test]
fn user_mistakes_exit_2_with_one_line() {
    let d = setup("bad");
    let base = ["--model", "model", "--data", "data.txt"];
    let with = |extra: &[&str]| -> Out {
        let mut a = base.to_vec();
        a.extend_from_slice(extra);
        eval(&d, &a)
    };
    assert_bad_input(
        &with(&["--seq-len", "1"]),
        "seq-len 1",
        &["--seq-len", "1", "2"],
    );
    // With --json, stdout holds the failure's object, as train's does (it
    // was empty).
    let out = with(&["--seq-len", "1", "--json"]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    let v: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!(v["failure"], "bad_input", "{v}");
    assert_eq!(v["exit_code"], 2, "{v}");
    assert!(v["error"].as_str().unwrap().contains("--seq-len"), "{v}");
    // So does a command line clap refuses, for every command with --json
    // (only train's printed it).
    for args in [
        &["eval", "--json", "--bogus"][..],
        &["estimate", "--json"],
        &[
            "export",
            "--json",
            "--checkpoint",
            "c",
            "--out",
            "x",
            "--dtype",
            "fp8",
        ],
        &["bench-io", "--json", "--path", ".", "--rw", "sideways"],
        &["tune", "--json", "--bogus"],
        &["inspect", "--json"],
    ] {
        let out = run_tierzero(Some(&d), args);
        assert_eq!(out.code, 2, "{args:?}: {}", out.stderr);
        let v: serde_json::Value = serde_json::from_str(out.stdout.trim())
            .unwrap_or_else(|e| panic!("{args:?}: {e}: {:?}", out.stdout));
        assert_eq!(
            (v["failure"].as_str(), v["exit_code"].as_i64()),
            (Some("bad_input"), Some(2)),
            "{args:?}"
        );
    }
    // A missing argument is named in the object (it held clap's first
    // line alone: "the following required arguments were not provided:").
    let out = run_tierzero(Some(&d), &["eval", "--json", "--data", "x"]);
    let v: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    let error = v["error"].as_str().unwrap();
    assert!(
        error.contains("not provided: ") && error.contains("--seq-len") && !error.contains('\n'),
        "{v}"
    );
    assert!(!error.contains("Usage") && !error.contains("--help"), "{v}");
    assert_bad_input(&with(&["--seq-len", "0"]), "seq-len 0", &["--seq-len"]);
    assert_bad_input(&with(&["--seq-len", "x"]), "seq-len x", &["--seq-len", "x"]);
    assert_bad_input(
        &with(&["--seq-len", "33"]),
        "seq-len above positions",
        &["seq_len 33", "32"],
    );
    assert_bad_input(
        &with(&["--seq-len", "16", "--batch", "0"]),
        "batch 0",
        &["--batch"],
    );
    assert_bad_input(
        &with(&["--seq-len", "16", "--precision", "fp8"]),
        "precision fp8",
        &["--precision", "fp8", "bf16"],
    );
    // Data with nothing to predict (one token; shorter than a window is
    // one partial window).
    std::fs::write(d.join("short.txt"), "!").unwrap();
    let out = eval(
        &d,
        &["--model", "model", "--data", "short.txt", "--seq-len", "16"],
    );
    assert_bad_input(
        &out,
        "short data",
        &["short.txt", "1 token(s)", "seq_len 16"],
    );
    // Byte-level data with ids beyond the model's vocabulary.
    write_model(&d, "small", 100);
    let out = eval(
        &d,
        &["--model", "small", "--data", "data.txt", "--seq-len", "16"],
    );
    assert_bad_input(&out, "vocab 100", &["vocab_size is 100", "up to 1"]);
    // Files that are not there.
    let out = eval(
        &d,
        &["--model", "nope", "--data", "data.txt", "--seq-len", "16"],
    );
    assert_bad_input(&out, "no model", &["--model", "nope"]);
    let out = eval(
        &d,
        &["--model", "model", "--data", "nope.txt", "--seq-len", "16"],
    );
    assert_bad_input(&out, "no data", &["--data", "nope.txt"]);
    assert_bad_input(
        &with(&["--seq-len", "16", "--tokenizer", "nope.json"]),
        "no tokenizer",
        &["--tokenizer", "nope.json"],
    );
    // Not a tokenizer.json.
    std::fs::write(d.join("tok.json"), "{\"model\": 3}").unwrap();
    assert_bad_input(
        &with(&["--seq-len", "16", "--tokenizer", "tok.json"]),
        "bad tokenizer",
        &["tok.json", "tokenizer.json"],
    );
    // --checkpoint on a directory that holds no checkpoint.
    std::fs::create_dir_all(d.join("ckpt")).unwrap();
    let out = eval(
        &d,
        &[
            "--checkpoint",
            "ckpt",
            "--data",
            "data.txt",
            "--seq-len",
            "16",
        ],
    );
    assert_bad_input(&out, "checkpoint", &["--checkpoint", "ckpt"]);
    // Neither --model nor --checkpoint: clap's usage error, exit 2.
    let out = eval(&d, &["--data", "data.txt", "--seq-len", "16"]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(!out.stderr.contains("panicked"));
    // Flags with nothing to act on are refused, not ignored: --seed or
    // --allow-unknown-model-keys with --checkpoint, --seed with weights.
    for flag in [&["--seed", "5"][..], &["--allow-unknown-model-keys"][..]] {
        let mut args = vec!["--checkpoint", "ckpt", "--data", "data.txt"];
        args.extend_from_slice(flag);
        let out = eval(&d, &args);
        assert_eq!(out.code, 2, "{}", out.stderr);
        assert!(
            out.stderr.contains(flag[0]) && out.stderr.contains("--checkpoint"),
            "{}",
            out.stderr
        );
    }
    let seeded = ModelDir::open(d.join("model"), 9).unwrap();
    save_hf_dir(d.join("weighted"), seeded.model(), DType::F32, |id| {
        seeded.load_param(id, DType::F32, &Device::Cpu)
    })
    .unwrap();
    let out = eval(
        &d,
        &[
            "--model",
            "weighted",
            "--data",
            "data.txt",
            "--seq-len",
            "16",
            "--seed",
            "3",
        ],
    );
    assert_bad_input(
        &out,
        "seed with weights",
        &["--seed", "has weights", "drop --seed"],
    );
    let out = eval(
        &d,
        &[
            "--model",
            "weighted",
            "--data",
            "data.txt",
            "--seq-len",
            "16",
        ],
    );
    assert_eq!(out.code, 0, "{}", out.stderr);
}

//! An unknown key in a model's `config.json`, as the built binary sees it:
//! `tierzero eval` and `tierzero train` refuse it (exit 2, one line naming
//! the key and the flag), and `--allow-unknown-model-keys` proceeds with a
//! warning, giving what the model without the key gives. A transformers 5
//! `rope_parameters` is read, not ignored (the bug this policy came from).
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failure is a panic

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

mod cli_support;
use cli_support::{assert_bad_input, run_tierzero, Out};

fn scratch(tag: &str) -> PathBuf {
    cli_support::scratch("cli-model-keys", tag)
}

fn write_model(d: &Path, name: &str, cfg: &Value) -> String {
    std::fs::create_dir_all(d.join(name)).unwrap();
    std::fs::write(d.join(name).join("config.json"), cfg.to_string()).unwrap();
    d.join(name).to_str().unwrap().to_owned()
}

fn llama(extra: Value) -> Value {
    let mut v = json!({"model_type": "llama", "vocab_size": 256, "hidden_size": 16,
        "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 32});
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    v
}

fn setup(tag: &str) -> PathBuf {
    let d = scratch(tag);
    let text = "every key of a model config changes the math or is listed. ".repeat(4);
    std::fs::write(d.join("data.txt"), text).unwrap();
    d
}

fn eval(d: &Path, model: &str, extra: &[&str]) -> Out {
    let data = d.join("data.txt");
    let mut args = vec![
        "eval",
        "--model",
        model,
        "--data",
        data.to_str().unwrap(),
        "--seq-len",
        "16",
        "--json",
    ];
    args.extend_from_slice(extra);
    run_tierzero(Some(d), &args)
}

fn loss(out: &Out) -> f64 {
    assert_eq!(out.code, 0, "stderr: {}", out.stderr);
    let v: Value = serde_json::from_str(out.stdout.trim()).unwrap();
    v["loss"].as_f64().unwrap()
}

#[test]
fn eval_refuses_an_unknown_key_and_the_flag_proceeds() {
    let d = setup("eval");
    let plain = write_model(&d, "plain", &llama(json!({})));
    let odd = write_model(&d, "odd", &llama(json!({"attn_logit_softcapping": 30.0})));
    let out = eval(&d, &odd, &[]);
    assert_bad_input(
        &out,
        "unknown key",
        &["attn_logit_softcapping", "--allow-unknown-model-keys"],
    );
    let allowed = eval(&d, &odd, &["--allow-unknown-model-keys"]);
    assert!(
        allowed.stderr.contains("attn_logit_softcapping"),
        "the ignored key is warned about: {}",
        allowed.stderr
    );
    assert_eq!(
        loss(&allowed).to_bits(),
        loss(&eval(&d, &plain, &[])).to_bits()
    );
    // Inside the rotary dict as well.
    let odd_rope = write_model(
        &d,
        "odd-rope",
        &llama(json!({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "warp": 1}})),
    );
    assert_bad_input(
        &eval(&d, &odd_rope, &[]),
        "unknown rope key",
        &["rope_parameters.warp"],
    );
    // An unknown rope_type is an error naming it.
    let longrope = write_model(
        &d,
        "longrope",
        &llama(json!({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}})),
    );
    assert_bad_input(&eval(&d, &longrope, &[]), "rope_type", &["longrope"]);
}

#[test]
fn transformers_5_rope_parameters_are_read_not_ignored() {
    let d = setup("rope");
    let v4 = write_model(&d, "v4", &llama(json!({"rope_theta": 500000.0})));
    let v5 = write_model(
        &d,
        "v5",
        &llama(json!({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})),
    );
    let base = write_model(&d, "base", &llama(json!({})));
    let (a, b, c) = (
        loss(&eval(&d, &v4, &[])),
        loss(&eval(&d, &v5, &[])),
        loss(&eval(&d, &base, &[])),
    );
    assert_eq!(a.to_bits(), b.to_bits(), "v4 {a} vs v5 {b}");
    assert_ne!(a.to_bits(), c.to_bits(), "theta 5e5 must differ from 1e4");
}

#[test]
fn train_refuses_an_unknown_key_and_the_flag_proceeds() {
    let d = setup("train");
    let odd = write_model(&d, "odd", &llama(json!({"frobnicate": true})));
    let ds = json!({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3}});
    std::fs::write(d.join("ds.json"), ds.to_string()).unwrap();
    let args = |extra: &'static [&'static str]| {
        let mut a = vec![
            "train",
            "--model",
            odd.as_str(),
            "--config",
            "ds.json",
            "--data",
            "data.txt",
            "--seq-len",
            "16",
            "--steps",
            "1",
            "--json",
        ];
        a.extend_from_slice(extra);
        a
    };
    assert_bad_input(
        &run_tierzero(Some(&d), &args(&[])),
        "unknown key",
        &["frobnicate", "--allow-unknown-model-keys"],
    );
    let out = run_tierzero(Some(&d), &args(&["--allow-unknown-model-keys"]));
    assert_eq!(out.code, 0, "stderr: {}", out.stderr);
    assert!(out.stderr.contains("frobnicate"), "{}", out.stderr);
}

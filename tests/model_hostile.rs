//! Hostile model files: sizes and shapes read from `config.json` and from
//! safetensors headers can never overflow or make us allocate unbounded
//! memory. Each case must fail fast with an error naming the key or the
//! file, never panic or abort.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tierzero::model::ModelDir;

fn scratch(tag: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("hostile-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn tiny_config() -> Value {
    json!({"model_type": "gpt2", "vocab_size": 4, "n_positions": 2, "n_embd": 2,
           "n_layer": 1, "n_head": 1, "n_inner": 2, "tie_word_embeddings": true})
}

/// Opens a directory holding `config` (and `weights`, if any) and returns
/// the error text; fails the test if it opens, or takes long.
fn open_err(tag: &str, config: &Value, weights: Option<&[u8]>) -> String {
    let d = scratch(tag);
    std::fs::write(d.join("config.json"), config.to_string()).unwrap();
    if let Some(w) = weights {
        std::fs::write(d.join("model.safetensors"), w).unwrap();
    }
    let t0 = Instant::now();
    let r = ModelDir::open(&d, 0);
    assert!(t0.elapsed() < Duration::from_secs(5), "{tag}: slow");
    let _ = std::fs::remove_dir_all(&d);
    match r {
        Ok(_) => panic!("{tag}: accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn absurd_config_sizes_are_refused_before_allocation() {
    let cases: [(&str, &str, u64); 6] = [
        ("vocab", "vocab_size", 1 << 40),
        ("hidden", "n_embd", 1 << 31),
        ("layers", "n_layer", 1 << 31),
        ("heads", "n_head", 1 << 31),
        ("positions", "n_positions", 1 << 40),
        ("inner", "n_inner", 1 << 40),
    ];
    for (tag, key, v) in cases {
        let mut c = tiny_config();
        c[key] = json!(v);
        let e = open_err(tag, &c, None);
        // Refused by the bound, or by an earlier consistency check that
        // names the key.
        assert!(
            e.contains("larger than tierzero supports") || e.contains(key),
            "{tag}: {e}"
        );
    }
    // Each size under its bound, but the product is absurd.
    let mut c = tiny_config();
    c["vocab_size"] = json!(1u64 << 24);
    c["n_embd"] = json!(1u64 << 20);
    c["n_head"] = json!(1);
    let e = open_err("product", &c, None);
    assert!(e.contains("vocab_size * hidden_size"), "{e}");
    // Llama: huge intermediate size with a real width.
    let c = json!({"model_type": "llama", "vocab_size": 256, "hidden_size": 32,
                   "intermediate_size": 1u64 << 50, "num_hidden_layers": 1,
                   "num_attention_heads": 4, "max_position_embeddings": 32});
    let e = open_err("llama", &c, None);
    assert!(e.contains("intermediate_size"), "{e}");
    // The attention projections: every size and the checked products
    // within bounds, q_proj 2^46 elements (it was accepted, and the init
    // tried to allocate 256 TiB).
    let c = json!({"model_type": "llama", "vocab_size": 1024, "hidden_size": 65536,
                   "intermediate_size": 1, "num_hidden_layers": 1,
                   "num_attention_heads": 16384, "head_dim": 65536,
                   "num_key_value_heads": 16384, "max_position_embeddings": 32});
    let e = open_err("llama-q", &c, None);
    assert!(e.contains("n_head * head_dim * hidden_size"), "{e}");
    // GPT-2's fused qkv [n_embd, 3 * n_embd].
    let mut c = tiny_config();
    c["n_embd"] = json!(200_000);
    let e = open_err("gpt2-qkv", &c, None);
    assert!(e.contains("3 * hidden_size * hidden_size"), "{e}");
}

/// A bad size names the key the family's `config.json` spells (GPT-2's
/// `n_positions`, Llama's `num_key_value_heads`), not tierzero's field
/// (`max_seq_len`, `n_kv_head`): the user looks for that key in the file.
#[test]
fn a_bad_size_names_the_key_of_the_file() {
    let llama = || {
        json!({"model_type": "llama", "vocab_size": 256, "hidden_size": 32,
               "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "max_position_embeddings": 32, "rms_norm_eps": 1e-5})
    };
    let cases: [(Value, &str, Value, &str); 7] = [
        (tiny_config(), "n_positions", json!(0), "`max_seq_len`"),
        (tiny_config(), "n_embd", json!(0), "`hidden_size`"),
        (
            tiny_config(),
            "layer_norm_epsilon",
            json!(0.0),
            "`norm_eps`",
        ),
        (llama(), "num_key_value_heads", json!(0), "`n_kv_head`"),
        (llama(), "rms_norm_eps", json!(0.0), "`norm_eps`"),
        (
            llama(),
            "max_position_embeddings",
            json!(0),
            "`max_seq_len`",
        ),
        (llama(), "num_hidden_layers", json!(0), "`n_layer`"),
    ];
    for (mut c, key, v, internal) in cases {
        c[key] = v;
        let e = open_err(key, &c, None);
        assert!(e.contains(&format!("`{key}`")), "{key}: {e}");
        assert!(!e.contains(internal), "{key}: {e}");
    }
    // The divisibility rule names both keys of the file.
    let mut c = llama();
    c["num_key_value_heads"] = json!(3);
    let e = open_err("kv3", &c, None);
    assert!(
        e.contains("num_attention_heads 4 must be a multiple of num_key_value_heads 3"),
        "{e}"
    );
}

/// A safetensors file: 8-byte little-endian header length, header, data.
fn safetensors(header: &Value, data_bytes: usize, claimed_len: Option<u64>) -> Vec<u8> {
    let h = header.to_string().into_bytes();
    let mut out = claimed_len.unwrap_or(h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend(std::iter::repeat_n(0u8, data_bytes));
    out
}

#[test]
fn hostile_safetensors_headers_are_refused_without_allocating() {
    let cfg = tiny_config();
    let ok_header =
        json!({"wte.weight": {"dtype": "F32", "shape": [4, 2], "data_offsets": [0, 32]}});
    // Header length far beyond the file (and beyond memory).
    let e = open_err(
        "hdr-huge",
        &cfg,
        Some(&safetensors(&ok_header, 32, Some(u64::MAX))),
    );
    assert!(e.contains("header length"), "{e}");
    let e = open_err(
        "hdr-past-end",
        &cfg,
        Some(&safetensors(&ok_header, 32, Some(90_000_000))),
    );
    assert!(e.contains("past the end"), "{e}");
    // Shape whose element count overflows.
    let h = json!({"wte.weight": {"dtype": "F32", "shape": [1u64 << 32, 1u64 << 32, 1u64 << 32],
                                  "data_offsets": [0, 32]}});
    let e = open_err("shape-overflow", &cfg, Some(&safetensors(&h, 32, None)));
    assert!(e.contains("model.safetensors"), "{e}");
    // Shape and offsets that agree with each other but not with the file.
    let h = json!({"wte.weight": {"dtype": "F32", "shape": [1u64 << 30, 1u64 << 10],
                                  "data_offsets": [0, 1u64 << 42]}});
    let e = open_err("offsets-past-file", &cfg, Some(&safetensors(&h, 32, None)));
    assert!(e.contains("model.safetensors"), "{e}");
    // Offsets that run backwards, and that overflow.
    let h = json!({"wte.weight": {"dtype": "F32", "shape": [4, 2], "data_offsets": [32, 0]}});
    let e = open_err("offsets-backwards", &cfg, Some(&safetensors(&h, 32, None)));
    assert!(e.contains("model.safetensors"), "{e}");
    let h = json!({"wte.weight": {"dtype": "F32", "shape": [4, 2],
                                  "data_offsets": [u64::MAX - 8, u64::MAX]}});
    let e = open_err("offsets-overflow", &cfg, Some(&safetensors(&h, 32, None)));
    assert!(e.contains("model.safetensors"), "{e}");
    // A parameter with the wrong shape is named with both shapes.
    let h = json!({"wte.weight": {"dtype": "F32", "shape": [2, 4], "data_offsets": [0, 32]}});
    let e = open_err("wrong-shape", &cfg, Some(&safetensors(&h, 32, None)));
    assert!(e.contains("wte.weight"), "{e}");
    // Not JSON; and a header that is a JSON string, not an object.
    let body = b"\xff\xfe not json!!!!";
    let mut junk = (body.len() as u64).to_le_bytes().to_vec();
    junk.extend_from_slice(body);
    let e = open_err("junk", &cfg, Some(&junk));
    assert!(e.contains("invalid header"), "{e}");
    let e = open_err("string", &cfg, Some(&safetensors(&json!("x"), 0, None)));
    assert!(e.contains("invalid header"), "{e}");
    // Shorter than the length prefix.
    let e = open_err("tiny", &cfg, Some(b"\x01\x02"));
    assert!(e.contains("8-byte header length"), "{e}");
}

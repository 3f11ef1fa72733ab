//! `tierzero export` as the built binary, on a checkpoint written by the
//! library (tiny GPT-2 and Llama, stage 3 on NVMe): the output reopens as
//! an HF model dir whose tensors equal the checkpoint's masters (exactly
//! for fp32, rounded to nearest even for bf16); config.json handling; a
//! corrupt checkpoint is exit 2 naming the part.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failure is a panic

mod cli_support;
mod engine_support;

use candle_core::{DType, Device};
use cli_support::run_tierzero;
use engine_support::{build, scratch, tiny_gpt2_dir, tiny_llama_dir, Knobs};
use tierzero::checkpoint::Checkpoint;
use tierzero::model::ModelDir;

/// Trains 2 steps and saves; returns the save dir.
fn checkpoint_of(model_dir: &std::path::Path) -> std::path::PathBuf {
    let save = scratch("export-save");
    let mut t = build(model_dir, &Knobs::nvme(), 3, 16, 2);
    t.step().unwrap();
    t.step().unwrap();
    t.save_checkpoint(&save).unwrap();
    save
}

/// `tierzero export --checkpoint SAVE --out FILE` and `extra` arguments.
fn export(save: &std::path::Path, file: &std::path::Path, extra: &[&str]) -> cli_support::Out {
    let mut args = vec![
        "export",
        "--checkpoint",
        save.to_str().unwrap(),
        "--out",
        file.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    run_tierzero(None, &args)
}

fn assert_export_matches(save: &std::path::Path, dtype: &str) {
    let out = scratch("export-out");
    let file = out.join("model.safetensors");
    let r = export(save, &file, &["--dtype", dtype, "--json"]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    let report: serde_json::Value = serde_json::from_str(r.stdout.trim()).unwrap();
    assert_eq!(report["step"], 2);
    assert_eq!(report["config_json_written"], true);
    // The weights' dtype is in config.json, as save_pretrained writes it.
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    let torch_dtype = if dtype == "bf16" {
        "bfloat16"
    } else {
        "float32"
    };
    assert_eq!(cfg["torch_dtype"], torch_dtype);
    // Another dtype into the same directory would make it wrong: refused.
    let other = if dtype == "bf16" { "fp32" } else { "bf16" };
    let r = export(save, &out.join("other.safetensors"), &["--dtype", other]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("another --dtype"), "{}", r.stderr);
    assert!(
        r.stderr
            .contains("config.json is already there with another config"),
        "{}",
        r.stderr
    );
    let ckpt = Checkpoint::open(save).unwrap();
    let md = ModelDir::open(&out, 0).unwrap();
    assert!(md.has_weights());
    assert_eq!(md.model().config(), ckpt.model().config());
    assert!(md.ignored_tensors().is_empty());
    let want_dtype = if dtype == "bf16" {
        DType::BF16
    } else {
        DType::F32
    };
    for p in ckpt.model().params() {
        let master = ckpt.load_param_f32(p.id).unwrap();
        let got = md.load_param(p.id, want_dtype, &Device::Cpu).unwrap();
        assert_eq!(got.dims(), p.shape.as_slice(), "{}", p.name);
        let want = master
            .to_dtype(want_dtype)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let got = got.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
        let a: Vec<u32> = want
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect();
        let b: Vec<u32> = got
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert_eq!(a, b, "{} differs", p.name);
    }
    // Exporting again next to the same config.json is fine, and removes
    // what an export killed mid-write left (pid 4194305: above pid_max,
    // never alive).
    let stale = out.join(".model.safetensors.tmp-4194305-0");
    std::fs::write(&stale, b"half a model").unwrap();
    let again = export(save, &file, &["--dtype", dtype]);
    assert_eq!(again.code, 0, "{}", again.stderr);
    assert!(!stale.exists(), "a dead export's temporary file was left");
    assert!(again.stdout.contains("already there"), "{}", again.stdout);
    // ... a different one is refused, and nothing is written.
    std::fs::write(out.join("config.json"), "{\"model_type\": \"llama\"}").unwrap();
    std::fs::remove_file(&file).unwrap();
    let clash = export(save, &file, &[]);
    assert_eq!(clash.code, 2, "{}", clash.stderr);
    assert!(clash.stderr.contains("config.json"), "{}", clash.stderr);
    assert!(!file.exists());
}

#[test]
fn export_gpt2_fp32_is_exactly_the_masters() {
    let save = checkpoint_of(&tiny_gpt2_dir("export", 2, 32));
    assert_export_matches(&save, "fp32");
}

#[test]
fn export_llama_bf16_rounds_the_masters() {
    let save = checkpoint_of(&tiny_llama_dir("export"));
    assert_export_matches(&save, "bf16");
}

#[test]
fn export_of_a_corrupt_checkpoint_names_the_part() {
    let save = checkpoint_of(&tiny_gpt2_dir("export-bad", 2, 32));
    let ckpt = Checkpoint::open(&save).unwrap();
    let master = ckpt.dir().join("rank0000/master.f32");
    let mut bytes = std::fs::read(&master).unwrap();
    bytes[100] ^= 0x40;
    std::fs::write(&master, bytes).unwrap();
    let base = scratch("export-bad-out");
    let out = base.join("new/deeper/m.safetensors");
    let r = export(&save, &out, &[]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    // The directories it made for the output went with the failure.
    assert!(
        !base.join("new").exists(),
        "an empty output directory was left"
    );
    assert!(
        r.stderr.contains("master of rank 0, sub-group 0"),
        "{}",
        r.stderr
    );
    assert!(r.stderr.contains("corrupt"), "{}", r.stderr);
    assert!(!out.exists(), "a partial export was left behind");
}

/// `--out` naming a directory (a trailing `/`, there or not) is refused
/// before anything is written; it was written beside it, then failed at
/// the rename.
#[test]
fn export_to_a_directory_is_refused_at_once() {
    let save = checkpoint_of(&tiny_gpt2_dir("export-dir", 2, 32));
    let base = scratch("export-dir-out");
    for out in [base.join("new/"), base.clone()] {
        let mut arg = out.to_str().unwrap().to_owned();
        if !arg.ends_with('/') && out != base {
            arg.push('/');
        }
        let r = run_tierzero(
            None,
            &[
                "export",
                "--checkpoint",
                save.to_str().unwrap(),
                "--out",
                &arg,
            ],
        );
        assert_eq!(r.code, 2, "{}", r.stderr);
        assert!(r.stderr.contains("is a directory"), "{}", r.stderr);
        assert!(r.stderr.contains("/model.safetensors"), "{}", r.stderr);
    }
    assert!(!base.join("new").exists());
    let left: Vec<_> = std::fs::read_dir(&base).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
    // A FIFO (a device alike) is refused, and stays one: the rename put a
    // regular file in its place (as root, `--out /dev/null` replaced the
    // system's).
    let fifo = scratch("export-fifo").join("model.safetensors");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let r = export(&save, &fifo, &[]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr.contains("FIFO, not a regular file"),
        "{}",
        r.stderr
    );
    use std::os::unix::fs::FileTypeExt as _;
    assert!(std::fs::symlink_metadata(&fifo)
        .unwrap()
        .file_type()
        .is_fifo());
}

/// An `--out` whose directory would not read it as the model's weights
/// is refused (a `model.bin` was written, then `--model` saw no weights and
/// trained a seeded init); another `*.safetensors` name is written with a
/// warning (from_pretrained reads `model.safetensors`); a parent that is a
/// file, or a `--checkpoint` that is one (`ck/latest`), is named as such.
#[test]
fn export_names_what_a_model_directory_reads() {
    let save = checkpoint_of(&tiny_gpt2_dir("export-names", 2, 32));
    let base = scratch("export-names-out");
    for name in ["model.bin", "weights", "pytorch_model.bin"] {
        let r = export(&save, &base.join(name), &[]);
        assert_eq!(r.code, 2, "{name}: {}", r.stderr);
        assert!(
            r.stderr.contains("give a .safetensors file name"),
            "{}",
            r.stderr
        );
        assert!(!base.join(name).exists());
    }
    let r = export(&save, &base.join("other.safetensors"), &[]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stderr.contains("from_pretrained reads model.safetensors"),
        "{}",
        r.stderr
    );
    std::fs::write(base.join("plain"), b"x").unwrap();
    let r = export(&save, &base.join("plain/model.safetensors"), &[]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr.contains("plain is not a directory"),
        "{}",
        r.stderr
    );
    // A save dir's `latest` is a file: given as --checkpoint, it read
    // "reading ck/latest/latest: Not a directory".
    let r = export(&base.join("plain"), &base.join("model.safetensors"), &[]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("a file; give a save dir"), "{}", r.stderr);
}

/// The special token ids of the source `config.json` (which change nothing
/// we compute) reach the checkpoint and the exported `config.json`, as
/// written, so generation after export stops where the source model did.
#[test]
fn export_keeps_the_source_models_token_ids() {
    let dir = tiny_gpt2_dir("export-ids", 2, 32);
    let cfg_path = dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["bos_token_id"] = serde_json::json!(1);
    cfg["eos_token_id"] = serde_json::json!([2, 3]);
    cfg["pad_token_id"] = serde_json::Value::Null;
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let save = checkpoint_of(&dir);
    let out = scratch("export-ids-out");
    let file = out.join("model.safetensors");
    let r = export(&save, &file, &[]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    let exported: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(exported["bos_token_id"], 1);
    assert_eq!(exported["eos_token_id"], serde_json::json!([2, 3]));
    // A null is kept (transformers would fill in its family's default).
    assert_eq!(
        exported["pad_token_id"],
        serde_json::Value::Null,
        "{exported}"
    );
    // The exported directory reopens as the same model, ids included.
    let md = ModelDir::open(&out, 0).unwrap();
    let ckpt = Checkpoint::open(&save).unwrap();
    assert_eq!(md.model().config(), ckpt.model().config());
    assert_eq!(md.model().token_ids(), ckpt.model().token_ids());
    assert!(!md.model().token_ids().is_empty());
}

/// A GPT-2 whose config names no bos/eos_token_id, its vocabulary below
/// GPT-2's 50256: the export says null, where transformers filled in 50256
/// (outside the vocabulary: a warning, and generation never stopped).
#[test]
fn export_of_a_small_gpt2_without_token_ids_says_none() {
    let dir = tiny_gpt2_dir("export-no-ids", 2, 32);
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert!(cfg.get("eos_token_id").is_none() && cfg["vocab_size"].as_u64() < Some(50256));
    let save = checkpoint_of(&dir);
    let out = scratch("export-no-ids-out");
    let r = export(&save, &out.join("model.safetensors"), &[]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    let exported: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    for key in ["bos_token_id", "eos_token_id"] {
        assert_eq!(
            exported.get(key),
            Some(&serde_json::Value::Null),
            "{exported}"
        );
    }
    // Readable by others, as save_pretrained's (a checkpoint's are 0600).
    use std::os::unix::fs::PermissionsExt as _;
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&out.join("model.safetensors")), 0o644);
    assert_eq!(mode(&out.join("config.json")), 0o644);
    let nested = out.join("a/b/model.safetensors");
    let r = export(&save, &nested, &[]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert_eq!(mode(&out.join("a")), 0o755);
    assert_eq!(mode(&out.join("a/b")), 0o755);
}

//! The checkpoint format's guarantees, at the library level and through
//! `tierzero inspect`: layout and permissions, the consolidated 16-bit
//! weights, corruption named by part, manifest paths that try to escape,
//! truncation, `latest` fallbacks, and unfinished saves never taken for a
//! checkpoint.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failure is a panic

mod cli_support;
mod engine_support;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use cli_support::run_tierzero;
use engine_support::{ds_config, scratch, tiny_gpt2_dir, Knobs};
use tierzero::checkpoint::{Checkpoint, CheckpointError};
use tierzero::config::{load_str, PathChecks, RunContext};
use tierzero::engine::{Trainer, TrainerOptions};
use tierzero::model::ModelDir;

/// Two bf16 steps on NVMe with stage3_gather_16bit_weights_on_model_save;
/// returns the save dir and the step dir.
fn saved(tag: &str) -> (PathBuf, PathBuf) {
    let k = Knobs {
        precision: "bf16",
        ..Knobs::nvme()
    };
    let mut cfg = ds_config(&k, &scratch("fmt-swap"), 2);
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = true.into();
    let run = RunContext {
        path_checks: PathChecks::CreateMissing,
        ..RunContext::default()
    };
    let loaded = load_str(&cfg.to_string(), &run).unwrap();
    let md = ModelDir::open(tiny_gpt2_dir(tag, 2, 32), 5).unwrap();
    let mut t = Trainer::new(
        &loaded.config,
        &md,
        engine_support::corpus(),
        TrainerOptions::cpu(5, 16),
    )
    .unwrap();
    t.set_data_name("corpus");
    t.step().unwrap();
    t.step().unwrap();
    // A save dir that does not exist yet: created 0700.
    let save = scratch(&format!("fmt-{tag}")).join("ck");
    let step = t.save_checkpoint(&save).unwrap();
    (save, step)
}

fn open_err(dir: &Path) -> CheckpointError {
    match Checkpoint::open(dir) {
        Ok(_) => panic!("{dir:?} opened"),
        Err(e) => e,
    }
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

#[test]
fn layout_permissions_and_16bit_weights() {
    let (save, step) = saved("layout");
    assert_eq!(step, save.join("step-00000002"));
    assert_eq!(
        std::fs::read_to_string(save.join("latest")).unwrap(),
        "step-00000002\n"
    );
    for d in [&save, &step, &step.join("rank0000")] {
        assert_eq!(mode(d), 0o700, "{d:?}");
    }
    for f in [
        "manifest.json",
        "rank0000/master.f32",
        "rank0000/exp_avg.f32",
        "rank0000/exp_avg_sq.f32",
        "model.safetensors",
        "config.json",
    ] {
        assert_eq!(mode(&step.join(f)), 0o600, "{f}");
    }
    // Nothing left over from staging.
    let mut names: Vec<String> = std::fs::read_dir(&save)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, [".lock", "latest", "step-00000002"]);
    let c = Checkpoint::open(&save).unwrap();
    assert_eq!(c.step(), 2);
    assert_eq!(c.manifest().precision, "bf16");
    assert_eq!(c.manifest().data.source, "corpus");
    assert_eq!(c.manifest().data.samples_consumed, 4);
    assert!(c.verify().ok());
    // State regions are 4096-aligned.
    for g in &c.manifest().ranks[0].sub_groups {
        assert_eq!(g.offset_bytes % 4096, 0);
    }
    // The consolidated bf16 weights are the masters rounded: exactly the
    // params the run trains with.
    let md = ModelDir::open(&step, 0).unwrap();
    assert!(md.has_weights());
    for p in c.model().params() {
        let a = md.load_param(p.id, DType::BF16, &Device::Cpu).unwrap();
        let b = c
            .load_param_f32(p.id)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let a = a
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let b = b
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(a, b, "{}", p.name);
    }
    // inspect summarises and verifies it.
    let r = run_tierzero(
        None,
        &["inspect", save.to_str().unwrap(), "--verify", "--json"],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(v["kind"], "checkpoint");
    assert_eq!(v["step"], 2);
    assert_eq!(v["verified_ok"], true);
    assert_eq!(v["files"].as_array().unwrap().len(), 5);
    let text = run_tierzero(None, &["inspect", step.to_str().unwrap()]);
    assert_eq!(text.code, 0, "{}", text.stderr);
    assert!(
        text.stdout.contains("step 2 (2 Adam steps, 0 skipped)"),
        "{}",
        text.stdout
    );
}

#[test]
fn corruption_is_named_by_part() {
    for (file, needle) in [
        ("rank0000/exp_avg_sq.f32", "exp_avg_sq"),
        ("model.safetensors", "model.safetensors"),
    ] {
        let (save, step) = saved("corrupt");
        let p = step.join(file);
        let mut bytes = std::fs::read(&p).unwrap();
        let at = bytes.len() / 3;
        bytes[at] ^= 1;
        std::fs::write(&p, bytes).unwrap();
        let c = Checkpoint::open(&save).unwrap();
        let report = c.verify();
        assert!(!report.ok());
        let bad: Vec<_> = report.files.iter().filter(|f| f.error.is_some()).collect();
        assert_eq!(bad.len(), 1);
        assert!(bad[0].error.as_ref().unwrap().contains(needle), "{bad:?}");
        let r = run_tierzero(None, &["inspect", save.to_str().unwrap(), "--verify"]);
        assert_eq!(r.code, 2, "{}", r.stderr);
        assert!(r.stdout.contains("BAD"), "{}", r.stdout);
    }
    // A corrupt state region fails the load of a parameter in it.
    let (save, step) = saved("corrupt-load");
    let p = step.join("rank0000/master.f32");
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[8] ^= 0x80;
    std::fs::write(&p, bytes).unwrap();
    let c = Checkpoint::open(&save).unwrap();
    match c.load_param_f32(tierzero::model::ParamId(0)) {
        Err(CheckpointError::Corrupt { part, .. }) => {
            assert_eq!(part, "master of rank 0, sub-group 0")
        }
        other => panic!("{other:?}"),
    }
    // A corrupt manifest is a manifest error naming the file.
    std::fs::write(
        step.join("manifest.json"),
        "{\"format\": \"tierzero-checkpoint\", ",
    )
    .unwrap();
    let e = open_err(&step);
    assert!(matches!(e, CheckpointError::Manifest { .. }), "{e}");
    assert!(e.to_string().contains("manifest.json"), "{e}");
}

fn edit_manifest(step: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = step.join("manifest.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    // Re-sealed: the edit is deliberate, so its own crc must still match.
    std::fs::write(&p, tierzero::checkpoint::seal_manifest_value(v).unwrap()).unwrap();
}

#[test]
fn manifest_paths_cannot_escape() {
    for evil in ["../../etc/passwd", "/etc/passwd", "rank0000/../../x"] {
        let (_, step) = saved("escape");
        edit_manifest(&step, |v| {
            v["files"][0]["path"] = evil.into();
            v["ranks"][0]["states"]["master"] = evil.into();
        });
        match open_err(&step) {
            CheckpointError::PathEscape { path, .. } => assert_eq!(path, evil),
            other => panic!("{evil}: {other}"),
        }
    }
    // A symlink inside the checkpoint that points outside it.
    let (_, step) = saved("symlink");
    let outside = scratch("outside").join("master.f32");
    std::fs::copy(step.join("rank0000/master.f32"), &outside).unwrap();
    std::fs::remove_file(step.join("rank0000/master.f32")).unwrap();
    std::os::unix::fs::symlink(&outside, step.join("rank0000/master.f32")).unwrap();
    match open_err(&step) {
        CheckpointError::PathEscape { path, reason } => {
            assert_eq!(path, "rank0000/master.f32");
            assert!(reason.contains("symlink"), "{reason}");
        }
        other => panic!("{other}"),
    }
}

#[test]
fn truncation_latest_fallback_and_unfinished_saves() {
    // A truncated state file is refused at open, naming it.
    let (_, step) = saved("trunc");
    let p = step.join("rank0000/exp_avg.f32");
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(4096).unwrap();
    match open_err(&step) {
        CheckpointError::Size { path, .. } => assert!(path.ends_with("exp_avg.f32")),
        other => panic!("{other}"),
    }
    // `latest` naming a broken step dir: the newest valid one is used.
    let (save2, _) = saved("fallback");
    let older = save2.join("step-00000001");
    copy_dir(&save2.join("step-00000002"), &older);
    edit_manifest(&older, |v| v["step"] = 1.into());
    std::fs::remove_file(save2.join("step-00000002/manifest.json")).unwrap();
    let c = Checkpoint::open(&save2).unwrap();
    assert_eq!(c.step(), 1);
    // An unfinished save (staging dir of a dead process) is not a
    // checkpoint, and the next save removes it.
    let lone = scratch("lone");
    let staging = lone.join(".step-00000009.tmp-4194305");
    copy_dir(&save2.join("step-00000001"), &staging);
    assert!(matches!(open_err(&lone), CheckpointError::Manifest { .. }));
    let (save3, _) = saved("stale");
    let staging3 = save3.join(".step-00000009.tmp-4194305");
    std::fs::create_dir(&staging3).unwrap();
    let k = Knobs::cpu();
    let mut t = engine_support::build(&tiny_gpt2_dir("stale2", 2, 32), &k, 5, 16, 1);
    t.save_checkpoint(&save3).unwrap();
    assert!(!staging3.exists(), "stale staging dir not removed");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), dst).unwrap();
        }
    }
}

//! The checkpoint format's guarantees, at the library level and through
//! `tierzero inspect`: layout and permissions, the consolidated 16-bit
//! weights, corruption named by part (a table of byte flips in every file,
//! `latest` included), manifest paths that try to escape, manifests that
//! claim huge sizes, truncation, `latest` fallbacks, and unfinished saves
//! never taken for a checkpoint.
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

/// Makes a copy of a step dir's manifest say `step` (and as many Adam
/// steps, none skipped, as a real one of that step would).
fn set_step(v: &mut serde_json::Value, step: u64) {
    v["step"] = step.into();
    v["adam_steps"] = step.into();
    v["skipped_steps"] = 0.into();
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
    assert_eq!(Checkpoint::open(&save2).unwrap().latest_unusable(), None);
    let older = save2.join("step-00000001");
    copy_dir(&save2.join("step-00000002"), &older);
    edit_manifest(&older, |v| set_step(v, 1));
    // A step above the one `latest` names: a run abandoned for an older
    // step, never fallen back to (it was, as the newest that validates).
    let above = save2.join("step-00000003");
    copy_dir(&older, &above);
    edit_manifest(&above, |v| set_step(v, 3));
    std::fs::remove_file(save2.join("step-00000002/manifest.json")).unwrap();
    let c = Checkpoint::open(&save2).unwrap();
    assert_eq!(c.step(), 1);
    assert!(
        c.latest_unusable()
            .is_some_and(|w| w.contains("step-00000002")),
        "{:?}",
        c.latest_unusable()
    );
    // `inspect` says so; with `--verify` it fails: the newest save is
    // broken, whatever step 1 says (it exited 0, verifying step 1).
    let save2_arg = save2.to_str().unwrap();
    let r = run_tierzero(None, &["inspect", save2_arg]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout.contains("warning: `latest` is unusable"),
        "{}",
        r.stdout
    );
    let r = run_tierzero(None, &["inspect", save2_arg, "--verify"]);
    assert_eq!(r.code, 2, "{}{}", r.stdout, r.stderr);
    assert!(r.stderr.contains("does not validate"), "{}", r.stderr);
    // A `latest` edited to an unpadded name is that step's own dir (the
    // open fell back below it, skipping the step), a dangling symlink is
    // damage (it was taken for no `latest`), and so is a manifest that is
    // a directory (it blocked every open instead of falling back).
    let (save5, step5) = saved("latest-forms");
    copy_dir(&step5, &save5.join("step-00000001"));
    edit_manifest(&save5.join("step-00000001"), |v| set_step(v, 1));
    std::fs::write(save5.join("latest"), "step-2\n").unwrap();
    let c = Checkpoint::open(&save5).unwrap();
    assert_eq!((c.step(), c.latest_unusable()), (2, None));
    assert_eq!(tierzero::checkpoint::latest_step(&save5), Some(2));
    std::fs::remove_file(save5.join("latest")).unwrap();
    std::os::unix::fs::symlink("nowhere", save5.join("latest")).unwrap();
    let c = Checkpoint::open(&save5).unwrap();
    assert!(
        c.latest_unusable()
            .is_some_and(|w| w.contains("symbolic link to a file that does not exist")),
        "{:?}",
        c.latest_unusable()
    );
    // A link to itself (ELOOP) is damage too (it failed every open).
    std::fs::remove_file(save5.join("latest")).unwrap();
    std::os::unix::fs::symlink("latest", save5.join("latest")).unwrap();
    let c = Checkpoint::open(&save5).unwrap();
    assert!(c.latest_unusable().is_some(), "{:?}", c.step());
    std::fs::remove_file(save5.join("latest")).unwrap();
    std::fs::write(save5.join("latest"), "step-00000002\n").unwrap();
    std::fs::remove_file(step5.join("manifest.json")).unwrap();
    std::fs::create_dir(step5.join("manifest.json")).unwrap();
    let c = Checkpoint::open(&save5).unwrap();
    assert_eq!(c.step(), 1);
    assert!(c.latest_unusable().is_some());
    // `latest` naming a step of a format this build does not read is not
    // damage: the open fails, naming the version, rather than resuming
    // from step 1 (whose next save of step 2 would replace the newer one).
    let (save4, step4) = saved("newer");
    copy_dir(&step4, &save4.join("step-00000001"));
    edit_manifest(&save4.join("step-00000001"), |v| set_step(v, 1));
    edit_manifest(&step4, |v| v["version"] = 99.into());
    match open_err(&save4) {
        CheckpointError::Version { version, by, .. } => {
            assert_eq!((version, by), (99, " (written by a newer tierzero)"))
        }
        other => panic!("{other}"),
    }
    // Bytes that rotted into something that is not UTF-8 are damage: the
    // open falls back.
    std::fs::write(step4.join("manifest.json"), [b'{', 0xff, 0xfe, b'}']).unwrap();
    assert_eq!(Checkpoint::open(&save4).unwrap().step(), 1);
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
    // One named with a live process's pid (reused since the writer died,
    // or another user's): every writer holds the save dir's lock, which
    // this save holds, so it is removed too, and so is a `latest` half
    // written under that pid.
    let mut live = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let reused = save3.join(format!(".step-00000009.tmp-{}", live.id()));
    std::fs::create_dir(&reused).unwrap();
    std::fs::write(reused.join("exp_avg.f32"), [0u8; 64]).unwrap();
    let half_latest = save3.join(format!(".latest.tmp-{}-0", live.id()));
    std::fs::write(&half_latest, "step-0000").unwrap();
    t.save_checkpoint(&save3).unwrap();
    let _ = live.kill();
    let _ = live.wait();
    assert!(!reused.exists(), "a staging dir of a reused pid stays");
    assert!(
        !half_latest.exists(),
        "a half-written latest of a reused pid stays"
    );
}

#[test]
fn export_into_the_checkpoint_is_refused() {
    // Its 16-bit model.safetensors is listed in the manifest: an fp32
    // export over it would break the checkpoint.
    let (_, step) = saved("export-into");
    let c = Checkpoint::open(&step).unwrap();
    let listed = std::fs::read(step.join("model.safetensors")).unwrap();
    for out in [
        step.join("model.safetensors"),
        step.join("sub/model.safetensors"),
    ] {
        match tierzero::checkpoint::export_safetensors(&c, &out, candle_core::DType::F32) {
            Err(CheckpointError::ExportIntoCheckpoint { dir, .. }) => assert_eq!(dir, c.dir()),
            other => panic!("{out:?}: {other:?}"),
        }
    }
    assert_eq!(
        std::fs::read(step.join("model.safetensors")).unwrap(),
        listed
    );
    assert!(
        !step.join("sub").exists(),
        "a directory was created inside the checkpoint"
    );
    assert!(Checkpoint::open(&step).unwrap().verify().ok());
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

/// What loading a checkpoint with one flipped byte gave.
#[derive(Debug, PartialEq)]
enum Seen {
    /// `Checkpoint::open` refused it.
    Open(String),
    /// Opened, but reading a parameter's state (what resume does) failed.
    Load(String),
    /// Opened and loaded (the byte is not state), but `verify` flagged it.
    Verify(String),
    /// Nothing noticed it.
    Missed,
}

fn load_everything(c: &Checkpoint) -> Result<(), CheckpointError> {
    for p in c.model().params() {
        for kind in tierzero::checkpoint::StateKind::ALL {
            c.load_param_state_range(kind, p.id, 0, p.numel)?;
        }
    }
    Ok(())
}

fn check_flipped(step: &Path) -> Seen {
    let c = match Checkpoint::open(step) {
        Ok(c) => c,
        Err(e) => return Seen::Open(e.to_string()),
    };
    if let Err(e) = load_everything(&c) {
        return Seen::Load(e.to_string());
    }
    let r = c.verify();
    match r.files.iter().find_map(|f| f.error.clone()) {
        Some(e) => Seen::Verify(e),
        None => Seen::Missed,
    }
}

/// Offsets to flip in a file of `len` bytes: its ends, spread points, and
/// `extra` (say, inside a safetensors header).
fn offsets(len: usize, extra: &[usize]) -> Vec<usize> {
    let mut v = vec![
        0,
        1,
        len / 7,
        len / 3,
        len / 2,
        len * 5 / 7,
        len - 2,
        len - 1,
    ];
    v.extend(extra.iter().copied().filter(|&o| o < len));
    v.sort();
    v.dedup();
    v
}

/// Every part of a checkpoint, several offsets each, two bit patterns: every
/// flip is caught, with an error naming the part, and nothing panics.
#[test]
fn byte_flips_in_every_part_are_detected() {
    let (save, step) = saved("flips");
    let mut tally: Vec<(String, usize, String)> = Vec::new();
    for (rel, needle) in [
        ("manifest.json", "manifest"),
        ("rank0000/master.f32", "master.f32"),
        ("rank0000/exp_avg.f32", "exp_avg.f32"),
        ("rank0000/exp_avg_sq.f32", "exp_avg_sq.f32"),
        ("model.safetensors", "model.safetensors"),
        ("config.json", "config.json"),
    ] {
        let p = step.join(rel);
        let original = std::fs::read(&p).unwrap();
        // safetensors: the 8-byte header length, the JSON header, the data.
        let extra: Vec<usize> = if rel == "model.safetensors" {
            let hlen = u64::from_le_bytes(original[..8].try_into().unwrap()) as usize;
            vec![
                3,
                7,
                8,
                9,
                8 + hlen / 2,
                8 + hlen - 1,
                8 + hlen,
                8 + hlen + 1,
            ]
        } else if rel == "manifest.json" {
            // Inside the crc's own digits and key, and in a number.
            let text = String::from_utf8_lossy(&original);
            let k = text.find("manifest_crc32c").unwrap();
            let s = text.find("\"step\"").unwrap();
            vec![k, k + 5, k + 19, k + 22, s + 8]
        } else {
            Vec::new()
        };
        let mut caught = 0;
        for off in offsets(original.len(), &extra) {
            for mask in [0x01u8, 0x80] {
                let mut bytes = original.clone();
                bytes[off] ^= mask;
                std::fs::write(&p, &bytes).unwrap();
                let seen = check_flipped(&step);
                let text = match &seen {
                    Seen::Open(t) | Seen::Load(t) | Seen::Verify(t) => t.clone(),
                    Seen::Missed => panic!("{rel}: flip {mask:#04x} at {off} not detected"),
                };
                assert!(
                    text.contains(needle),
                    "{rel} at {off}: the error does not name the part: {text}"
                );
                // State bytes must be caught before any of them is used.
                if rel.ends_with(".f32") {
                    assert!(
                        matches!(seen, Seen::Open(_) | Seen::Load(_)),
                        "{rel} at {off}: only verify caught it: {seen:?}"
                    );
                }
                if rel == "manifest.json" {
                    assert!(matches!(seen, Seen::Open(_)), "{rel} at {off}: {seen:?}");
                }
                caught += 1;
            }
        }
        std::fs::write(&p, &original).unwrap();
        tally.push((rel.to_owned(), caught, needle.to_owned()));
    }
    // `latest` is a pointer, not data: a flip that breaks the name makes the
    // save dir fall back to the newest valid step dir; it never loads a
    // broken one and never panics.
    let latest = save.join("latest");
    let original = std::fs::read(&latest).unwrap();
    for off in 0..original.len() {
        for mask in [0x01u8, 0x80] {
            let mut bytes = original.clone();
            bytes[off] ^= mask;
            std::fs::write(&latest, &bytes).unwrap();
            let c = Checkpoint::open(&save)
                .unwrap_or_else(|e| panic!("latest flip at {off}: no fallback: {e}"));
            assert_eq!(c.step(), 2);
            assert!(c.verify().ok());
        }
    }
    std::fs::write(&latest, &original).unwrap();
    assert!(Checkpoint::open(&save).unwrap().verify().ok());
    std::fs::remove_dir_all(save.parent().unwrap()).unwrap();
    eprintln!(
        "byte flips detected, by file: {tally:?}; latest: {} flips fell back",
        original.len() * 2
    );
}

/// A manifest (re-sealed, so its crc is right) that claims huge sizes or
/// shapes is refused quickly, before anything of that size is allocated.
#[test]
fn huge_claims_are_refused_before_allocating() {
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "a trillion layers",
            Box::new(|v| v["model"]["n_layer"] = 1_000_000_000_000u64.into()),
            "n_layer",
        ),
        (
            "vocab × width overflows",
            Box::new(|v| {
                v["model"]["vocab_size"] = (1u64 << 40).into();
                v["model"]["n_embd"] = (1u64 << 40).into();
                v["model"]["n_head"] = 1.into();
            }),
            "model config",
        ),
        (
            "sub-group numel × 4 overflows",
            Box::new(|v| v["ranks"][0]["sub_groups"][0]["numel"] = (u64::MAX / 2).into()),
            "overflows",
        ),
        (
            "a region far past the file",
            Box::new(|v| {
                v["ranks"][0]["sub_groups"][0]["offset_bytes"] = (1u64 << 62).into();
                for f in v["files"].as_array_mut().unwrap() {
                    if let Some(r) = f["regions"].get_mut(0) {
                        r["offset_bytes"] = (1u64 << 62).into();
                    }
                }
            }),
            "past the file",
        ),
        (
            "files that claim 4 EiB",
            Box::new(|v| {
                for f in v["files"].as_array_mut().unwrap() {
                    f["bytes"] = (1u64 << 62).into();
                }
            }),
            "bytes",
        ),
        (
            "a shard past its parameter",
            Box::new(|v| {
                v["ranks"][0]["sub_groups"][0]["params"][0]["shard_numel"] = u64::MAX.into()
            }),
            "does not fit",
        ),
        (
            "a billion ranks",
            Box::new(|v| v["world_size"] = 1_000_000_000u64.into()),
            "world_size",
        ),
        (
            // Two shards from element 0 in place of one whole: the same
            // element count (the old check summed them), the end uncovered.
            "overlapping shards",
            Box::new(|v| {
                let params = v["ranks"][0]["sub_groups"][0]["params"]
                    .as_array_mut()
                    .unwrap();
                let n = params[0]["shard_numel"].as_u64().unwrap();
                assert!(n >= 2 && params[0]["shard_start"] == 0, "{}", params[0]);
                let half = n / 2;
                let mut again = params[0].clone();
                params[0]["shard_numel"] = half.into();
                again["shard_numel"] = (n - half).into();
                let off = again["offset_in_group"].as_u64().unwrap();
                again["offset_in_group"] = (off + half).into();
                params.insert(1, again);
            }),
            "overlap at element 0",
        ),
        // Counters a resume adds to: they failed mid-run, exit 1.
        (
            "adam steps beyond the step",
            Box::new(|v| {
                let step = v["step"].as_u64().unwrap();
                v["adam_steps"] = (step + 1).into();
            }),
            "adam_steps",
        ),
        (
            "a step of 2^64 - 1",
            Box::new(|v| v["step"] = u64::MAX.into()),
            "the step is at most",
        ),
        (
            "samples consumed near 2^64",
            Box::new(|v| v["data"]["samples_consumed"] = (u64::MAX - 3).into()),
            "samples_consumed",
        ),
    ];
    for (what, edit, needle) in cases {
        let (save, step) = saved("huge");
        edit_manifest(&step, |v| edit(v));
        let t0 = std::time::Instant::now();
        let e = open_err(&step).to_string();
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(2),
            "{what}: took {:?}",
            t0.elapsed()
        );
        assert!(e.contains(needle), "{what}: {e}");
        assert!(
            e.contains("manifest.json") || e.contains("step-"),
            "{what}: {e}"
        );
        eprintln!("{what}: {e}");
        std::fs::remove_dir_all(save.parent().unwrap()).unwrap();
    }
}

/// A save that died between moving `step-N` aside and renaming its
/// replacement in leaves `.step-N.old-<pid>` as step N's only copy, which
/// `latest` names and `Checkpoint::open` falls back to. The next save (a
/// resumed run's, of another step) must not remove it as a dead process's
/// leftover (a second crash during that save would leave `latest` naming
/// nothing): it renames it back to `step-N`.
#[test]
fn a_step_moved_aside_by_a_dead_save_survives_the_next_save() {
    let (save, step) = saved("aside");
    assert!(step.ends_with("step-00000002"), "{}", step.display());
    let aside = save.join(".step-00000002.old-4194305");
    std::fs::rename(&step, &aside).unwrap();
    assert_eq!(Checkpoint::open(&save).unwrap().step(), 2);
    let k = Knobs::cpu();
    let mut t = engine_support::build(&tiny_gpt2_dir("aside2", 2, 32), &k, 5, 16, 1);
    t.step().unwrap();
    // Step 1 of another run into the same dir: a save that is not step 2.
    t.save_checkpoint(&save).unwrap();
    assert!(!aside.exists(), "the moved-aside copy stays moved aside");
    let back = Checkpoint::open(&step).expect("step 2 renamed back");
    assert_eq!(back.step(), 2);
    assert!(back.verify().ok());
    // Where a step-2 exists again, a moved-aside copy is a leftover.
    copy_dir(&step, &aside);
    t.step().unwrap();
    t.save_checkpoint(&save).unwrap();
    assert!(
        !aside.exists(),
        "a moved-aside copy with its step back stays"
    );
    // A staging dir named with this process's pid that this process is
    // not writing is a dead incarnation's (pid 1 in a container after a
    // restart): removed by the next save.
    let own = save.join(format!(".step-00000009.tmp-{}", std::process::id()));
    std::fs::create_dir(&own).unwrap();
    t.step().unwrap();
    t.save_checkpoint(&save).unwrap();
    assert!(!own.exists(), "a dead incarnation's staging dir stays");
}

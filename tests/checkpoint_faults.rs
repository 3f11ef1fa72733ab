//! Faults while saving, and two processes on one save dir, on the built
//! binary (tiny GPT-2, stage 3, NVMe params and optimizer state, a save
//! every step):
//!
//! * an injected ENOSPC or EIO (`TIERZERO_FAILPOINT=<site>:<n>:enospc|eio`)
//!   in a state file, the manifest or `latest` of the second save fails the
//!   run with an error naming the operation and the file; the first
//!   checkpoint and `latest` stay whole and loadable, no staging dir or
//!   temporary file is left, and resuming from what is there ends with the
//!   weights of a run that never failed;
//! * a second run on a save dir that a live run holds refuses at start-up,
//!   naming `.lock` and the holder's pid; once the holder is SIGKILLed the
//!   lock is free (flock dies with its process).
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failure is a panic

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tierzero::checkpoint::{Checkpoint, SaveDirLock};

mod cli_support;

const TOTAL: u64 = 3;

fn scratch(tag: &str) -> PathBuf {
    cli_support::scratch("ckpt-faults", tag)
}

fn setup(d: &Path) {
    std::fs::create_dir_all(d.join("model")).unwrap();
    std::fs::create_dir_all(d.join("swap")).unwrap();
    let model = json!({"model_type": "gpt2", "vocab_size": 256, "n_positions": 32,
        "n_embd": 32, "n_layer": 2, "n_head": 2, "tie_word_embeddings": true});
    std::fs::write(d.join("model/config.json"), model.to_string()).unwrap();
    let text = "a failed save never costs the last good checkpoint. ".repeat(60);
    std::fs::write(d.join("data.txt"), text).unwrap();
    let swap = d.join("swap");
    let cfg = json!({
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.001, "warmup_num_steps": 1,
            "total_num_steps": TOTAL}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": swap, "buffer_count": 4,
                "buffer_size": 20000},
            "offload_optimizer": {"device": "nvme", "nvme_path": swap},
            "sub_group_size": 3000
        },
        "tierzero": {"pinned_budget_bytes": "16MiB", "checksums": true}
    });
    std::fs::write(d.join("ds.json"), cfg.to_string()).unwrap();
}

fn train(d: &Path, save: &str, resume: bool, metrics: &str, failpoint: Option<&str>) -> Command {
    let mut c = cli_support::train_saving(d, TOTAL, save, resume, metrics);
    if let Some(f) = failpoint {
        c.env("TIERZERO_FAILPOINT", f);
    }
    c
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn summary_hash(metrics: &Path) -> String {
    let text = std::fs::read_to_string(metrics).unwrap();
    let last: Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(last["summary"], json!(true));
    last["weight_sha256"].as_str().unwrap().to_owned()
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Hits of `ckpt.state_write` in one save: 3 state files × sub-groups.
fn state_writes_per_save(d: &Path) -> u64 {
    let o = train(
        d,
        "count",
        false,
        "count.jsonl",
        Some("ckpt.state_write:1000000"),
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let s = String::from_utf8_lossy(&o.stderr);
    let hits: u64 = s
        .split("ckpt.state_write=")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no counts in {s}"));
    assert_eq!(hits % TOTAL, 0, "{hits}");
    std::fs::remove_dir_all(d.join("count")).unwrap();
    hits / TOTAL
}

#[test]
fn a_failed_save_keeps_the_last_checkpoint() {
    let d = scratch("save");
    setup(&d);
    let reference = train(&d, "ref", false, "ref.jsonl", None).output().unwrap();
    assert!(reference.status.success(), "{}", text(&reference));
    let ref_hash = summary_hash(&d.join("ref.jsonl"));
    let per_save = state_writes_per_save(&d);
    // (failpoint in the second save, exit code, what the error must name)
    let cases: Vec<(String, i32, Vec<&str>)> = vec![
        (
            format!("ckpt.state_write:{}:enospc", per_save + 1),
            2,
            vec!["writing", "rank0000/master.f32", "No space left on device"],
        ),
        (
            format!("ckpt.state_write:{}:enospc", per_save + per_save / 3 + 2),
            2,
            vec!["writing", "rank0000/exp_avg.f32", "No space left on device"],
        ),
        (
            format!("ckpt.state_write:{}:eio", 2 * per_save),
            1,
            vec!["writing", "rank0000/exp_avg_sq.f32", "Input/output error"],
        ),
        (
            "ckpt.manifest_write:2:enospc".into(),
            2,
            vec!["writing", "manifest.json.tmp-", "No space left on device"],
        ),
        (
            "ckpt.manifest_write:2:eio".into(),
            1,
            vec!["writing", "manifest.json.tmp-", "Input/output error"],
        ),
        (
            "ckpt.latest_write:2:enospc".into(),
            2,
            vec!["writing", ".latest.tmp-", "No space left on device"],
        ),
    ];
    for (i, (fp, code, needles)) in cases.iter().enumerate() {
        let save = format!("ck{i}");
        let o = train(&d, &save, false, "x.jsonl", Some(fp))
            .output()
            .unwrap();
        let all = text(&o);
        assert_eq!(o.status.code(), Some(*code), "{fp}: {all}");
        assert!(all.contains("saving a checkpoint"), "{fp}: {all}");
        for n in needles {
            assert!(all.contains(n), "{fp}: {n:?} not in: {all}");
        }
        assert!(!all.contains("panicked"), "{fp}: {all}");
        if *code == 2 {
            // The way back names the checkpoint there is.
            assert!(
                all.contains("the newest of step 1: fix the space"),
                "{fp}: {all}"
            );
            assert!(all.contains(&format!("--resume {save}")), "{fp}: {all}");
        }
        let sd = d.join(&save);
        // The first checkpoint and `latest` are whole.
        assert_eq!(
            std::fs::read_to_string(sd.join("latest")).unwrap(),
            "step-00000001\n",
            "{fp}"
        );
        let c = Checkpoint::open(&sd).unwrap();
        assert_eq!(c.step(), 1, "{fp}");
        assert!(c.verify().ok(), "{fp}");
        // Nothing half-written is left; a step-2 dir exists only when the
        // failure came after its rename, and then it is whole.
        let left = names(&sd);
        assert!(
            left.iter()
                .all(|n| !n.starts_with(".step-") && !n.starts_with(".latest.tmp")),
            "{fp}: {left:?}"
        );
        if fp.starts_with("ckpt.latest_write") {
            assert!(left.contains(&"step-00000002".to_owned()), "{left:?}");
            assert!(Checkpoint::open(&sd.join("step-00000002"))
                .unwrap()
                .verify()
                .ok());
        } else {
            assert!(
                !left.contains(&"step-00000002".to_owned()),
                "{fp}: {left:?}"
            );
        }
        // Resuming from what is there ends where the unfailed run ends.
        let r = train(&d, &save, true, "r.jsonl", None).output().unwrap();
        assert!(r.status.success(), "{fp}: {}", text(&r));
        assert_eq!(summary_hash(&d.join("r.jsonl")), ref_hash, "{fp}");
        std::fs::remove_dir_all(&sd).unwrap();
    }
    // The run's first save failing: there is nothing to resume (the advice
    // to --resume then failed as "not a checkpoint").
    let o = train(
        &d,
        "first",
        false,
        "x.jsonl",
        Some("ckpt.state_write:1:enospc"),
    )
    .output()
    .unwrap();
    let all = text(&o);
    assert_eq!(o.status.code(), Some(2), "{all}");
    assert!(
        all.contains("holds no checkpoint to resume: fix the space")
            && all.contains("then run it again as it was"),
        "{all}"
    );
    // Killed in its first save, a run leaves only the staging dir: a
    // --resume of it says there is nothing to resume (it said "give a save
    // dir", and an auto-restart looped on exit 2).
    let o = train(
        &d,
        "killed",
        false,
        "x.jsonl",
        Some("ckpt.state_write:1:kill"),
    )
    .output()
    .unwrap();
    assert!(!o.status.success(), "{}", text(&o));
    let o = train(&d, "killed", true, "x.jsonl", None).output().unwrap();
    let all = text(&o);
    assert_eq!(o.status.code(), Some(2), "{all}");
    assert!(
        all.contains("it holds only the staging dir of a save that never completed")
            && all.contains("run it again without --resume"),
        "{all}"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

/// Waits until process `pid` is stopped (state `T` in /proc).
fn wait_stopped(pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let state = stat.rsplit(')').next().unwrap().split_whitespace().next();
        if state == Some("T") {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "process {pid} never stopped: {stat}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn one_run_per_save_dir() {
    let d = scratch("lock");
    setup(&d);
    // A: stops itself mid-step 2 (after saving step 1), holding the lock.
    let mut a = train(&d, "ck", false, "a.jsonl", Some("step.backward:6:stop"))
        .spawn()
        .unwrap();
    wait_stopped(a.id());
    let lock = d.join("ck").canonicalize().unwrap().join(".lock");
    let before = names(&d.join("ck"));
    // B refuses at start-up, naming the lock file and A.
    let b = train(&d, "ck", true, "b.jsonl", None).output().unwrap();
    let all = text(&b);
    assert_eq!(b.status.code(), Some(2), "{all}");
    assert!(all.contains(&lock.display().to_string()), "{all}");
    assert!(all.contains(&format!("process {}", a.id())), "{all}");
    assert_eq!(names(&d.join("ck")), before, "B touched the save dir");
    // A dies; its lock dies with it.
    a.kill().unwrap();
    let status = a.wait().unwrap();
    assert!(!status.success());
    let c = train(&d, "ck", true, "c.jsonl", None).output().unwrap();
    assert!(c.status.success(), "{}", text(&c));
    assert_eq!(Checkpoint::open(&d.join("ck")).unwrap().step(), TOTAL);
    // A lock held by another process through the library API.
    let held = SaveDirLock::acquire(&d.join("ck")).unwrap();
    let e = train(&d, "ck", true, "e.jsonl", None).output().unwrap();
    let all = text(&e);
    assert_eq!(e.status.code(), Some(2), "{all}");
    assert!(
        all.contains(&format!("process {}", std::process::id())),
        "{all}"
    );
    drop(held);
    std::fs::remove_dir_all(&d).unwrap();
}

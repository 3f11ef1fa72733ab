//! `tierzero train --save-dir / --save-every / --resume` as the built
//! binary: `train --steps 4 --save-every 2` then `--resume --steps 6` ends
//! with the same weight hash as `train --steps 6` (tiny GPT-2, stage 3,
//! params and optimizer state on NVMe); plus the messages and exit codes
//! of the edges (already at --steps, no checkpoint, --save-every alone,
//! a --model that is not the checkpoint's).
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failure is a panic

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

mod cli_support;
use cli_support::{run_tierzero, Out};

fn scratch(tag: &str) -> PathBuf {
    cli_support::scratch("ckpt-cli", tag)
}

/// Tiny GPT-2, a text file, a swap dir and a ds_config whose schedule has a
/// concrete total (6), so runs of different --steps share one lr schedule.
fn setup(tag: &str) -> PathBuf {
    let d = scratch(tag);
    std::fs::create_dir_all(d.join("model")).unwrap();
    std::fs::create_dir_all(d.join("swap")).unwrap();
    let model = json!({"model_type": "gpt2", "vocab_size": 256, "n_positions": 32,
        "n_embd": 32, "n_layer": 2, "n_head": 2, "tie_word_embeddings": true});
    std::fs::write(d.join("model/config.json"), model.to_string()).unwrap();
    let text = "checkpoints make long runs safe to stop and resume. ".repeat(60);
    std::fs::write(d.join("data.txt"), text).unwrap();
    let swap = d.join("swap");
    let cfg = json!({
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.001, "warmup_num_steps": 2,
            "total_num_steps": 6}},
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
    d
}

fn train(d: &Path, extra: &[&str]) -> Out {
    let mut args = vec![
        "train",
        "--config",
        "ds.json",
        "--model",
        "model",
        "--data",
        "data.txt",
        "--seq-len",
        "16",
    ];
    args.extend_from_slice(extra);
    run_tierzero(Some(d), &args)
}

/// [`setup`], and a run of 2 steps saving each in `ck`.
fn saved_two_steps(tag: &str) -> PathBuf {
    let d = setup(tag);
    let ok = train(
        &d,
        &["--steps", "2", "--save-every", "1", "--save-dir", "ck"],
    );
    assert_eq!(ok.code, 0, "{}", ok.stderr);
    d
}

fn summary_hash(metrics: &Path) -> String {
    let text = std::fs::read_to_string(metrics).unwrap();
    let last: Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(last["summary"], json!(true));
    last["weight_sha256"].as_str().unwrap().to_owned()
}

fn losses(metrics: &Path) -> Vec<(u64, u32)> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v.get("summary").is_none())
        .map(|v| {
            (
                v["step"].as_u64().unwrap(),
                (v["loss"].as_f64().unwrap() as f32).to_bits(),
            )
        })
        .collect()
}

#[test]
fn save_every_then_resume_matches_one_run() {
    let d = setup("resume");
    let a = train(
        &d,
        &[
            "--steps",
            "4",
            "--save-every",
            "2",
            "--save-dir",
            "ck",
            "--metrics",
            "a.jsonl",
        ],
    );
    assert_eq!(a.code, 0, "{}{}", a.stdout, a.stderr);
    assert!(
        a.stdout.contains("checkpoint: step 2 saved to"),
        "{}",
        a.stdout
    );
    assert!(
        a.stdout.contains("checkpoint: step 4 saved to"),
        "{}",
        a.stdout
    );
    assert!(d.join("ck/step-00000002/manifest.json").is_file());
    assert!(d.join("ck/step-00000004/manifest.json").is_file());
    assert_eq!(
        std::fs::read_to_string(d.join("ck/latest")).unwrap().trim(),
        "step-00000004"
    );
    // Without --steps, a resume runs to where the saving run was to end
    // (4, in the manifest; not the config's total_num_steps of 6, nor the
    // default 150), and --metrics appends: a's four steps and summary,
    // then steps 3 and 4 again, the same bits, and a second summary.
    let manifest: Value = serde_json::from_str(
        &std::fs::read_to_string(d.join("ck/step-00000002/manifest.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(manifest["run_steps"], json!(4));
    std::fs::copy(d.join("a.jsonl"), d.join("a2.jsonl")).unwrap();
    let r = train(
        &d,
        &["--resume", "ck/step-00000002", "--metrics", "a2.jsonl"],
    );
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("resuming at step 2 of 4"), "{}", r.stdout);
    let (la, la2) = (losses(&d.join("a.jsonl")), losses(&d.join("a2.jsonl")));
    assert_eq!(la.len(), 4);
    assert_eq!(la2[..4], la[..]);
    assert_eq!(la2[4..], la[2..]);
    let summaries = std::fs::read_to_string(d.join("a2.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| l.contains("\"summary\""))
        .count();
    assert_eq!(summaries, 2);
    assert_eq!(
        summary_hash(&d.join("a2.jsonl")),
        summary_hash(&d.join("a.jsonl"))
    );
    let b = train(
        &d,
        &[
            "--steps",
            "6",
            "--resume",
            "ck",
            "--save-dir",
            "ck",
            "--metrics",
            "b.jsonl",
        ],
    );
    assert_eq!(b.code, 0, "{}{}", b.stdout, b.stderr);
    assert!(b.stdout.contains("resuming at step 4 of 6"), "{}", b.stdout);
    // The save and the load say their size and time.
    let saved = a
        .stdout
        .lines()
        .find(|l| l.starts_with("checkpoint: step 4 saved to"))
        .unwrap();
    assert!(
        saved.contains(" in ")
            && saved.contains("/s; after ")
            && saved.ends_with("optimizer tail)"),
        "{saved}"
    );
    let loaded = b
        .stdout
        .lines()
        .find(|l| l.starts_with("checkpoint: step 4 loaded from"))
        .unwrap_or_else(|| panic!("{}", b.stdout));
    assert!(
        loaded.contains("step-00000004") && loaded.contains(" in "),
        "{loaded}"
    );
    let c = train(&d, &["--steps", "6", "--metrics", "c.jsonl"]);
    assert_eq!(c.code, 0, "{}{}", c.stdout, c.stderr);
    // Steps 5 and 6 of the resumed run are those of the single run.
    let lb = losses(&d.join("b.jsonl"));
    let lc = losses(&d.join("c.jsonl"));
    assert_eq!(lb.iter().map(|x| x.0).collect::<Vec<_>>(), vec![5, 6]);
    assert_eq!(lb[..], lc[4..]);
    assert_eq!(losses(&d.join("a.jsonl"))[..], lc[..4]);
    assert_eq!(
        summary_hash(&d.join("b.jsonl")),
        summary_hash(&d.join("c.jsonl"))
    );
    // The end-of-run save of the resumed run.
    assert_eq!(
        std::fs::read_to_string(d.join("ck/latest")).unwrap().trim(),
        "step-00000006"
    );
    // A specific step dir works too; already at --steps: nothing to do.
    let e = train(&d, &["--steps", "4", "--resume", "ck/step-00000004"]);
    assert_eq!(e.code, 0, "{}{}", e.stdout, e.stderr);
    assert!(e.stdout.contains("nothing to do"), "{}", e.stdout);
    // With --json, stdout is still one JSON object.
    let j = train(
        &d,
        &["--steps", "4", "--resume", "ck/step-00000004", "--json"],
    );
    assert_eq!(j.code, 0, "{}{}", j.stdout, j.stderr);
    let v: serde_json::Value = serde_json::from_str(j.stdout.trim()).unwrap();
    assert_eq!(
        (v["steps"].as_u64(), v["steps_run"].as_u64()),
        (Some(4), Some(0)),
        "{v}"
    );
    assert_eq!(v["nothing_to_do"], json!(true));
    // The same data resumes quietly; other data is named in a warning.
    let warning = "the data differs from the checkpoint's";
    assert!(!b.stderr.contains(warning), "{}", b.stderr);
    std::fs::copy(d.join("data.txt"), d.join("other.txt")).unwrap();
    let mut args = vec!["train", "--config", "ds.json", "--data", "other.txt"];
    args.extend_from_slice(&[
        "--seq-len",
        "16",
        "--steps",
        "5",
        "--resume",
        "ck/step-00000004",
    ]);
    let f = run_tierzero(Some(&d), &args);
    assert_eq!(f.code, 0, "{}{}", f.stdout, f.stderr);
    assert!(
        f.stderr.contains(warning) && f.stderr.contains("other.txt"),
        "{}",
        f.stderr
    );
    // Other text at the same path: the path matches, the token count
    // (in the manifest) does not, and the resume says so (it was silent).
    let tokens = |step: &str| -> Value {
        let text = std::fs::read_to_string(d.join("ck").join(step).join("manifest.json")).unwrap();
        serde_json::from_str::<Value>(&text).unwrap()["data"]["tokens"].clone()
    };
    let n = std::fs::metadata(d.join("data.txt")).unwrap().len();
    assert_eq!(
        tokens("step-00000004"),
        json!(n),
        "byte-level: a token a byte"
    );
    let moved = "the data has another number of tokens";
    assert!(!f.stderr.contains(moved), "{}", f.stderr);
    let text = "other text at the same path moves every sample. ".repeat(70);
    std::fs::write(d.join("data.txt"), text).unwrap();
    let g = train(&d, &["--steps", "5", "--resume", "ck/step-00000004"]);
    assert_eq!(g.code, 0, "{}{}", g.stdout, g.stderr);
    assert!(g.stderr.contains(moved), "{}", g.stderr);
}

/// A resumed run's checkpoints keep the seed the weights were initialised
/// with, not the resume's own `--seed` (its default, 1, was written).
#[test]
fn a_resume_keeps_the_checkpoint_s_seed() {
    let d = setup("seed");
    let a = train(&d, &["--steps", "1", "--seed", "7", "--save-dir", "ck"]);
    assert_eq!(a.code, 0, "{}", a.stderr);
    let b = train(&d, &["--steps", "2", "--resume", "ck", "--save-dir", "ck"]);
    assert_eq!(b.code, 0, "{}", b.stderr);
    let seed = |step: &str| -> Value {
        let text = std::fs::read_to_string(d.join("ck").join(step).join("manifest.json")).unwrap();
        serde_json::from_str::<Value>(&text).unwrap()["seed"].clone()
    };
    assert_eq!(seed("step-00000001"), json!(7));
    assert_eq!(seed("step-00000002"), json!(7));
}

/// A resume without `--seed` or `--data-order` reads the data in the
/// checkpoint's order: shuffled with the saving run's seed, file order for
/// a file-order run and for a checkpoint from before the order was
/// recorded (which read in file order). Steps 3 and 4 of each resume are
/// the uninterrupted run's, bit for bit.
#[test]
fn a_resume_reads_the_data_in_the_checkpoint_s_order() {
    let d = setup("order");
    for (tag, flags) in [
        ("shuffled", &["--seed", "7"][..]),
        ("sequential", &["--data-order", "sequential"][..]),
        ("unrecorded", &["--data-order", "sequential"][..]),
    ] {
        let whole = format!("{tag}-whole.jsonl");
        let mut args = vec!["--steps", "4", "--metrics", &whole];
        args.extend_from_slice(flags);
        let w = train(&d, &args);
        assert_eq!(w.code, 0, "{}", w.stderr);
        let ck = format!("ck-{tag}");
        let mut args = vec!["--steps", "2", "--save-dir", &ck];
        args.extend_from_slice(flags);
        let a = train(&d, &args);
        assert_eq!(a.code, 0, "{}", a.stderr);
        let manifest_path = d.join(&ck).join("step-00000002/manifest.json");
        let mut m: Value =
            serde_json::from_str(&std::fs::read_to_string(&manifest_path).unwrap()).unwrap();
        let want_order = match tag {
            "shuffled" => json!({"shuffled": {"seed": 7}}),
            _ => json!("sequential"),
        };
        assert_eq!(m["data"]["order"], want_order, "{tag}");
        if tag == "unrecorded" {
            m["data"].as_object_mut().unwrap().remove("order");
            let sealed = tierzero::checkpoint::seal_manifest_value(m).unwrap();
            std::fs::write(&manifest_path, sealed).unwrap();
        }
        let resumed = format!("{tag}-resumed.jsonl");
        let r = train(
            &d,
            &["--steps", "4", "--resume", &ck, "--metrics", &resumed],
        );
        assert_eq!(r.code, 0, "{}", r.stderr);
        assert!(
            !r.stderr.contains("differs from the checkpoint"),
            "{}",
            r.stderr
        );
        assert_eq!(
            losses(&d.join(&resumed)),
            losses(&d.join(&whole))[2..].to_vec(),
            "{tag}"
        );
    }
    // Steps 3 and 4 from the shuffled checkpoint, with `flag value`.
    let resume_shuffled = |flag: &str, value: &str, metrics: &str| {
        let args = ["--steps", "4", "--resume", "ck-shuffled", flag, value];
        train(&d, &[&args[..], &["--metrics", metrics]].concat())
    };
    // Restating the order without --seed keeps the checkpoint's seed, and
    // the banner says the run's seed and the order's.
    let r = resume_shuffled("--data-order", "shuffled", "s7.jsonl");
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout
            .contains("seed 7, data shuffled each pass (seed 7)"),
        "{}",
        r.stdout
    );
    assert_eq!(
        losses(&d.join("s7.jsonl")),
        losses(&d.join("shuffled-whole.jsonl"))[2..].to_vec()
    );
    // The orders differ: the first step's loss is another.
    let first = |tag: &str| losses(&d.join(format!("{tag}-whole.jsonl")))[0];
    assert_ne!(first("shuffled"), first("sequential"));
    // An explicit other seed on resume is this run's order, and warned of.
    let r = resume_shuffled("--seed", "8", "s8.jsonl");
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stderr.contains("data_order")
            && r.stderr.contains("(seed 7)")
            && r.stderr.contains("(seed 8)"),
        "{}",
        r.stderr
    );
    assert_ne!(
        losses(&d.join("s8.jsonl")),
        losses(&d.join("shuffled-whole.jsonl"))[2..].to_vec()
    );
}

/// A resume without `--data` or `--config` would read the embedded corpus
/// and config: a checkpoint of a run on other data, or with other
/// settings that change the numbers, is refused naming what to give (it
/// was a log warning and a resumed run unlike an uninterrupted one, exit
/// 0). Given them, it resumes.
#[test]
fn a_resume_without_its_run_s_data_or_config_is_refused() {
    let d = saved_two_steps("resume-needs-data");
    let resume = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "--model",
            "model",
            "--seq-len",
            "16",
            "--steps",
            "3",
        ];
        args.extend_from_slice(extra);
        args.extend(["--resume", "ck"]);
        run_tierzero(Some(&d), &args)
    };
    let o = resume(&["--config", "ds.json"]);
    assert_eq!(o.code, 2, "{}", o.stderr);
    assert!(
        o.stderr.contains("trained on data.txt") && o.stderr.contains("give --data data.txt"),
        "{}",
        o.stderr
    );
    let o = resume(&["--data", "data.txt"]);
    assert_eq!(o.code, 2, "{}", o.stderr);
    for want in [
        "embedded default config",
        "batch (train_batch_size: checkpoint ",
        "optimizer (lr: checkpoint ",
        "give that run's --config",
    ] {
        assert!(o.stderr.contains(want), "{want}: {}", o.stderr);
    }
    let o = resume(&["--config", "ds.json", "--data", "data.txt"]);
    assert_eq!(o.code, 0, "{}", o.stderr);
}

/// A resume on data edited to the same length is warned about (the
/// token count alone missed it); on the same data it is not.
#[test]
fn a_resume_on_edited_data_of_the_same_length_is_warned_about() {
    let d = saved_two_steps("resume-edited");
    let warned = |out: &Out| out.stderr.contains("other ids");
    let same = train(&d, &["--steps", "3", "--resume", "ck/step-00000001"]);
    assert_eq!(same.code, 0, "{}", same.stderr);
    assert!(!warned(&same), "{}", same.stderr);
    let text = std::fs::read_to_string(d.join("data.txt")).unwrap();
    std::fs::write(d.join("data.txt"), text.replacen("safe", "sure", 1)).unwrap();
    let edited = train(&d, &["--steps", "3", "--resume", "ck/step-00000001"]);
    assert_eq!(edited.code, 0, "{}", edited.stderr);
    assert!(warned(&edited), "{}", edited.stderr);
}

#[test]
fn resume_mistakes_are_bad_input() {
    let d = setup("bad");
    let no = train(&d, &["--steps", "2", "--resume", "nowhere"]);
    assert_eq!(no.code, 2, "{}", no.stderr);
    assert!(no.stderr.contains("--resume nowhere"), "{}", no.stderr);
    assert!(no.stderr.contains("No such file"), "{}", no.stderr);
    // A file (a step's manifest.json) is not a checkpoint: said so.
    let file = train(&d, &["--steps", "2", "--resume", "ds.json"]);
    cli_support::assert_bad_input(
        &file,
        "--resume a file",
        &[
            "--resume ds.json: is not a directory",
            "a step-<N> directory",
        ],
    );
    let alone = train(&d, &["--steps", "2", "--save-every", "1"]);
    assert_eq!(alone.code, 2, "{}", alone.stderr);
    assert!(
        alone.stderr.contains("--save-every needs --save-dir"),
        "{}",
        alone.stderr
    );
    // A save dir without a checkpoint in it.
    std::fs::create_dir_all(d.join("empty")).unwrap();
    let empty = train(&d, &["--steps", "2", "--resume", "empty"]);
    assert_eq!(empty.code, 2, "{}", empty.stderr);
    assert!(
        empty.stderr.contains("not a checkpoint"),
        "{}",
        empty.stderr
    );
    // A --model whose config is not the checkpoint's.
    let ok = train(&d, &["--steps", "1", "--save-dir", "ck"]);
    assert_eq!(ok.code, 0, "{}", ok.stderr);
    std::fs::create_dir_all(d.join("other")).unwrap();
    let other = json!({"model_type": "gpt2", "vocab_size": 256, "n_positions": 32,
        "n_embd": 32, "n_layer": 1, "n_head": 2, "tie_word_embeddings": true});
    std::fs::write(d.join("other/config.json"), other.to_string()).unwrap();
    let mut args = vec![
        "train", "--config", "ds.json", "--model", "other", "--data", "data.txt",
    ];
    args.extend_from_slice(&["--steps", "2", "--resume", "ck"]);
    let m = run_tierzero(Some(&d), &args);
    assert_eq!(m.code, 2, "{}", m.stderr);
    assert!(
        m.stderr.contains("differs from the checkpoint"),
        "{}",
        m.stderr
    );
    // Naming the field and both values.
    assert!(
        m.stderr
            .contains("n_layer: 1 against the checkpoint's n_layer: 2"),
        "{}",
        m.stderr
    );
}

/// Every file under `dir`, with its bytes, sorted by path; not the save
/// dir's `.lock`, which each run that takes it writes its pid into.
fn tree(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                todo.push(p);
            } else if p.file_name() != Some(std::ffi::OsStr::new(".lock")) {
                out.push((p.clone(), std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// A save never replaces a directory under its step's name that is not a
/// checkpoint (no manifest, a file no checkpoint holds): it deleted the
/// user's files there. The save fails (exit 2) naming the dir and the way
/// back, the files and the checkpoints before it stay; a damaged
/// checkpoint of that step (its manifest lost) is still replaced.
#[test]
fn a_save_does_not_replace_a_directory_that_is_not_a_checkpoint() {
    let d = saved_two_steps("foreign-step");
    let foreign = d.join("ck/step-00000003");
    std::fs::create_dir_all(&foreign).unwrap();
    std::fs::write(foreign.join("notes.txt"), "mine").unwrap();
    let o = train(&d, &["--steps", "3", "--resume", "ck", "--save-dir", "ck"]);
    assert_eq!(o.code, 2, "{}", o.stderr);
    assert!(
        o.stderr
            .contains("ck/step-00000003 is in the way of this save")
            && o.stderr.contains("\"notes.txt\"")
            && o.stderr.contains("--resume"),
        "{}",
        o.stderr
    );
    assert_eq!(
        std::fs::read_to_string(foreign.join("notes.txt")).unwrap(),
        "mine"
    );
    assert_eq!(tierzero::checkpoint::latest_step(&d.join("ck")), Some(2));
    // A step 3 checkpoint whose manifest was lost is the save's to replace.
    std::fs::remove_file(foreign.join("notes.txt")).unwrap();
    std::fs::create_dir_all(foreign.join("rank0000")).unwrap();
    std::fs::write(foreign.join("rank0000/master.f32"), [0u8; 8]).unwrap();
    let o = train(&d, &["--steps", "3", "--resume", "ck", "--save-dir", "ck"]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert_eq!(tierzero::checkpoint::latest_step(&d.join("ck")), Some(3));
    assert!(foreign.join("manifest.json").is_file());
    std::fs::remove_dir_all(&d).unwrap();
}

/// A step dir linked into the save dir from another disk is the save
/// dir's own: resuming the save dir into itself continues its run (it was
/// refused as "another run", advising the very command). And `inspect
/// --json` prints its failure object on stdout, as the other commands do.
#[test]
fn a_linked_step_dir_continues_its_save_dir() {
    let d = saved_two_steps("linked-step");
    std::fs::create_dir_all(d.join("other")).unwrap();
    std::fs::rename(d.join("ck/step-00000002"), d.join("other/step-00000002")).unwrap();
    std::os::unix::fs::symlink("../other/step-00000002", d.join("ck/step-00000002")).unwrap();
    let o = train(&d, &["--steps", "3", "--resume", "ck", "--save-dir", "ck"]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert_eq!(tierzero::checkpoint::latest_step(&d.join("ck")), Some(3));
    let o = run_tierzero(Some(&d), &["inspect", "missing", "--json"]);
    assert_eq!(o.code, 2, "{}", o.stderr);
    let v: Value = serde_json::from_str(o.stdout.trim()).unwrap();
    assert_eq!(
        (v["exit_code"].as_i64(), v["failure"].as_str()),
        (Some(2), Some("bad_input"))
    );
    std::fs::remove_dir_all(&d).unwrap();
}

/// Nothing a run or an export writes lands on another run's checkpoints:
/// a new run into a save dir that holds checkpoints (it replaced their
/// step dirs and `latest` without a word), a run resumed from elsewhere
/// into one, `--metrics` / `--timeline` inside a step dir or over
/// `latest`, an export into another step dir or over `latest` (each
/// exit 2, the checkpoints byte for byte as they were). A resume into its
/// own save dir, a metrics file beside the step dirs and an export into a
/// fresh directory of the save dir still work.
#[test]
fn no_output_lands_on_a_checkpoint() {
    let d = saved_two_steps("own-outputs");
    let before = tree(&d.join("ck"));
    let refused = |args: &[&str], want: &str| {
        let o = if args[0] == "export" {
            run_tierzero(Some(&d), args)
        } else {
            train(&d, args)
        };
        assert_eq!(o.code, 2, "{args:?}: {}", o.stderr);
        assert!(o.stderr.contains(want), "{args:?}: {want}: {}", o.stderr);
        assert!(
            tree(&d.join("ck")) == before,
            "{args:?} changed the checkpoints"
        );
    };
    refused(
        &["--steps", "2", "--seed", "9", "--save-dir", "ck"],
        "--save-dir ck holds 2 checkpoints (steps 1 to 2) of an earlier run, which this run's \
         saves would replace; continue that run with --resume ck",
    );
    std::fs::create_dir_all(d.join("elsewhere")).unwrap();
    let copy = d.join("elsewhere/step-00000001");
    std::fs::create_dir_all(copy.join("rank0000")).unwrap();
    for (p, bytes) in &before {
        if let Ok(rel) = p.strip_prefix(d.join("ck/step-00000001")) {
            std::fs::write(copy.join(rel), bytes).unwrap();
        }
    }
    refused(
        &["--steps", "3", "--resume", "elsewhere", "--save-dir", "ck"],
        "--save-dir ck holds 2 checkpoints (steps 1 to 2) of another run than --resume elsewhere",
    );
    // `flag out` on a run resumed from ck into ck.
    let refused_resuming_ck = |flag: &str, out: &str| {
        refused(
            &[
                "--steps",
                "3",
                "--resume",
                "ck",
                "--save-dir",
                "ck",
                flag,
                out,
            ],
            &format!("{flag} {out}: is inside the checkpoint directory"),
        )
    };
    for flag in ["--metrics", "--timeline"] {
        for out in [
            "ck/step-00000002/manifest.json",
            "ck/step-00000001/rank0000/master.f32",
        ] {
            refused(
                &["--steps", "3", "--resume", "ck", flag, out],
                &format!("{flag} {out}: is inside the checkpoint directory"),
            );
        }
        refused_resuming_ck(flag, "ck/latest");
    }
    for out in [
        "ck/step-00000002/model.safetensors",
        "ck/step-00000002/rank0000/m.safetensors",
    ] {
        refused(
            &["export", "--checkpoint", "ck/step-00000001", "--out", out],
            "is inside the checkpoint directory",
        );
    }
    // Under a step's name in the save dir, there or not yet (the run's
    // save of that step replaced the dir, and the outputs with it: an
    // export, metrics and notes were deleted at the next save).
    std::fs::create_dir_all(d.join("ck/step-00000007")).unwrap();
    for out in [
        "ck/step-00000005/model.safetensors",
        "ck/step-00000007/model.safetensors",
    ] {
        refused(
            &["export", "--checkpoint", "ck", "--out", out],
            "is inside the checkpoint directory ck/step-0000000",
        );
        for flag in ["--metrics", "--timeline"] {
            refused_resuming_ck(flag, out);
        }
    }
    std::fs::remove_dir(d.join("ck/step-00000007")).unwrap();
    // (Names a model directory would not read are refused first.)
    for out in [
        "ck/step-00000002/manifest.json",
        "ck/step-00000002/rank0000/exp_avg.f32",
        "ck/latest",
    ] {
        refused(
            &["export", "--checkpoint", "ck/step-00000001", "--out", out],
            "give a .safetensors file name",
        );
    }
    let exported = run_tierzero(
        Some(&d),
        &[
            "export",
            "--checkpoint",
            "ck/step-00000001",
            "--out",
            "ck/hf/model.safetensors",
        ],
    );
    assert_eq!(exported.code, 0, "{}", exported.stderr);
    // Exports named as the steps, each in its own dir: a folder of
    // `step-<N>` dirs without manifests is no save dir (the second export
    // was refused as "inside the checkpoint directory" it had made).
    for step in ["step-00000001", "step-00000002", "step-00000001"] {
        let out = format!("exports/{step}/model.safetensors");
        let o = run_tierzero(
            Some(&d),
            &[
                "export",
                "--checkpoint",
                &format!("ck/{step}"),
                "--out",
                &out,
            ],
        );
        assert_eq!(o.code, 0, "{out}: {}", o.stderr);
    }
    let resumed = train(
        &d,
        &[
            "--steps",
            "3",
            "--resume",
            "ck",
            "--save-dir",
            "ck",
            "--metrics",
            "ck/m.jsonl",
        ],
    );
    assert_eq!(resumed.code, 0, "{}", resumed.stderr);
    assert!(d.join("ck/step-00000003/manifest.json").is_file());
}

/// A resume from a checkpoint whose data is corrupt names the older step
/// to resume from and `inspect --verify`.
#[test]
fn a_corrupt_resume_names_the_older_checkpoint() {
    let d = saved_two_steps("corrupt-resume");
    let master = d.join("ck/step-00000002/rank0000/master.f32");
    let mut bytes = std::fs::read(&master).unwrap();
    bytes[100] ^= 0x40;
    std::fs::write(&master, bytes).unwrap();
    let out = train(&d, &["--steps", "3", "--resume", "ck"]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("corrupt"), "{}", out.stderr);
    assert!(
        out.stderr.contains("--resume") && out.stderr.contains("step-00000001"),
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains("--verify"), "{}", out.stderr);
    // eval of it is the user's to fix too (it was an internal error, 1).
    let out = run_tierzero(
        Some(&d),
        &[
            "eval",
            "--checkpoint",
            "ck/step-00000002",
            "--data",
            "data.txt",
            "--seq-len",
            "16",
        ],
    );
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr.contains("--checkpoint ck/step-00000002")
            && out.stderr.contains("corrupt")
            && out.stderr.contains("--verify"),
        "{}",
        out.stderr
    );
    // export, eval and inspect --verify name the older step that opens (they
    // named none, and inspect checked the damaged step alone).
    // (Paths as the checkpoint resolved them: absolute.)
    let older = [
        "the older step ",
        "ck/step-00000001 opens: check it with `tierzero inspect ",
        "ck/step-00000001 --verify`, then give ",
    ];
    for (args, flag) in [
        (
            &[
                "export",
                "--checkpoint",
                "ck",
                "--out",
                "hf/model.safetensors",
            ][..],
            "--checkpoint ",
        ),
        (
            &[
                "eval",
                "--checkpoint",
                "ck",
                "--data",
                "data.txt",
                "--seq-len",
                "16",
            ][..],
            "--checkpoint ",
        ),
        (
            &["inspect", "ck", "--verify"][..],
            "--resume (or --checkpoint) ",
        ),
    ] {
        let out = run_tierzero(Some(&d), args);
        assert_eq!(out.code, 2, "{args:?}: {}", out.stderr);
        let said = older.iter().all(|o| out.stderr.contains(o))
            && out.stderr.contains(&format!("{flag}/"))
            && out.stderr.trim_end().ends_with("ck/step-00000001");
        assert!(said, "{args:?}: {}", out.stderr);
    }
}

/// A run refused at start-up leaves no save dir it created (with its
/// parents); one that was there stays, with what was in it.
#[test]
fn a_refused_start_removes_the_save_dir_it_created() {
    let d = setup("refused-save-dir");
    let no = train(
        &d,
        &[
            "--steps",
            "2",
            "--resume",
            "nowhere",
            "--save-dir",
            "new/ck",
        ],
    );
    assert_eq!(no.code, 2, "{}", no.stderr);
    assert!(no.stderr.contains("--resume nowhere"), "{}", no.stderr);
    assert!(!d.join("new").exists(), "the save dir's parent was left");
    std::fs::create_dir_all(d.join("mine")).unwrap();
    std::fs::write(d.join("mine/notes.txt"), "kept").unwrap();
    let no = train(
        &d,
        &[
            "--steps",
            "2",
            "--resume",
            "nowhere",
            "--save-dir",
            "mine/ck",
        ],
    );
    assert_eq!(no.code, 2, "{}", no.stderr);
    assert!(!d.join("mine/ck").exists(), "the created save dir was left");
    assert!(d.join("mine/notes.txt").exists());
    // A run that starts keeps its save dir, as before.
    let ok = train(&d, &["--steps", "1", "--save-dir", "new/ck"]);
    assert_eq!(ok.code, 0, "{}", ok.stderr);
    assert!(d.join("new/ck/latest").exists());
}

/// A save dir inside a checkpoint is refused at start-up, naming the
/// step dir and its parent: its saves hid in that step, whose resume
/// reads its own manifest (the stop's advice then reloaded the old step).
#[test]
fn a_save_dir_inside_a_checkpoint_is_refused() {
    let d = saved_two_steps("save-dir-inside");
    // A step-named dir of the save dir that is not there yet: the save
    // dir's run replaces it when it saves that step.
    for inside in [
        "ck/step-00000002",
        "ck/step-00000002/more",
        "ck/step-00000009",
    ] {
        let out = train(
            &d,
            &[
                "--steps",
                "4",
                "--resume",
                "ck/step-00000002",
                "--save-dir",
                inside,
            ],
        );
        cli_support::assert_bad_input(
            &out,
            inside,
            &[
                "is inside the checkpoint directory",
                "give a save dir outside it",
            ],
        );
        assert!(!d.join("ck/step-00000002/latest").exists(), "{inside}");
        assert!(!d.join("ck/step-00000002/more").exists(), "{inside}");
        assert!(!d.join("ck/step-00000009").exists(), "{inside}");
    }
    // The save dir itself is fine.
    let out = train(&d, &["--steps", "3", "--resume", "ck", "--save-dir", "ck"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
}

/// `export` and `eval` of a save dir whose `latest` names a damaged
/// step are refused, naming the newest valid step and how to use it: they
/// exported the older step's weights under the save dir's name (exit 0).
#[test]
fn export_and_eval_refuse_a_save_dir_whose_latest_is_damaged() {
    let d = saved_two_steps("export-damaged-latest");
    let manifest: Value = serde_json::from_str(
        &std::fs::read_to_string(d.join("ck/step-00000002/manifest.json")).unwrap(),
    )
    .unwrap();
    let file = manifest["files"][0]["path"].as_str().unwrap();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(d.join("ck/step-00000002").join(file))
        .unwrap();
    f.set_len(100).unwrap();
    let export = |ckpt: &str| {
        run_tierzero(
            Some(&d),
            &[
                "export",
                "--checkpoint",
                ckpt,
                "--out",
                "hf/model.safetensors",
            ],
        )
    };
    let out = export("ck");
    cli_support::assert_bad_input(
        &out,
        "export",
        &[
            "`latest` names a checkpoint that does not validate",
            "step 1 in",
            "step-00000001",
        ],
    );
    assert!(!d.join("hf/model.safetensors").exists());
    let eval = run_tierzero(
        Some(&d),
        &[
            "eval",
            "--checkpoint",
            "ck",
            "--data",
            "data.txt",
            "--seq-len",
            "16",
        ],
    );
    cli_support::assert_bad_input(&eval, "eval", &["does not validate", "step 1 in"]);
    // Named, the older step exports.
    let out = export("ck/step-00000001");
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(d.join("hf/model.safetensors").exists());
    // `train --resume` goes on from it, saying so.
    let out = train(&d, &["--steps", "2", "--resume", "ck"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stderr
            .contains("`latest` is unusable; resuming from the newest valid checkpoint")
            && out.stderr.contains("step-00000001"),
        "{}",
        out.stderr
    );
}

/// A save dir holds two runs' steps when one resumed from an older step
/// (the abandoned run's newer steps stay until overwritten). When the
/// newest save is damaged, the fallback takes the newest step of its own
/// history, by the manifests' lineage, not the abandoned run's (it
/// resumed run A's step 4 for run B's step 6, B's step 3 being there).
#[test]
fn a_damaged_latest_falls_back_within_its_own_history() {
    let d = setup("lineage");
    let a = train(
        &d,
        &["--steps", "4", "--save-every", "2", "--save-dir", "ck"],
    );
    assert_eq!(a.code, 0, "{}", a.stderr);
    let b = train(
        &d,
        &[
            "--steps",
            "6",
            "--save-every",
            "3",
            "--save-dir",
            "ck",
            "--resume",
            "ck/step-00000002",
        ],
    );
    assert_eq!(b.code, 0, "{}", b.stderr);
    let steps: Vec<u64> = tierzero::checkpoint::saved_steps(&d.join("ck"));
    assert_eq!(steps, [2, 3, 4, 6]);
    let manifest: Value = serde_json::from_str(
        &std::fs::read_to_string(d.join("ck/step-00000006/manifest.json")).unwrap(),
    )
    .unwrap();
    let file = manifest["files"][0]["path"].as_str().unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(d.join("ck/step-00000006").join(file))
        .unwrap()
        .set_len(100)
        .unwrap();
    let c = tierzero::checkpoint::Checkpoint::open(&d.join("ck")).unwrap();
    assert_eq!(c.step(), 3, "{}", c.dir().display());
    let r = train(&d, &["--steps", "6", "--resume", "ck", "--save-dir", "ck"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stderr.contains("step-00000003"), "{}", r.stderr);
    assert!(r.stderr.contains("abandoned"), "{}", r.stderr);
    // `latest` naming a step below every one there (removed by a clean-up,
    // or edited): nothing of its history is left; the steps above it are
    // named with the way to take one (it said only "No such file").
    std::fs::write(d.join("ck/latest"), "step-00000001\n").unwrap();
    let e = tierzero::checkpoint::Checkpoint::open(&d.join("ck"))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        e.contains("names step 1") && e.contains("steps 2..=6 are above it"),
        "{e}"
    );
}

/// `eval --checkpoint` reads the checkpoint's fp32 masters; `export
/// --dtype fp32` writes the same values into a HF file: evaluating the
/// exported directory with `--model` gives the same loss, bit for bit.
#[test]
fn eval_of_a_checkpoint_equals_eval_of_its_fp32_export() {
    let d = setup("eval-export");
    // Three steps: under a warmup from 0, as DeepSpeed runs it, the first
    // two are at lr 0 (the lr the scheduler set when built, then its
    // iteration 0's).
    let out = train(&d, &["--steps", "3", "--save-dir", "ck"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let out = run_tierzero(
        Some(&d),
        &[
            "export",
            "--checkpoint",
            "ck",
            "--out",
            "hf/model.safetensors",
            "--dtype",
            "fp32",
        ],
    );
    assert_eq!(out.code, 0, "{}", out.stderr);
    let eval = |src: &[&str]| -> Value {
        let mut args = vec!["eval", "--data", "data.txt", "--seq-len", "16", "--json"];
        args.extend_from_slice(src);
        let out = run_tierzero(Some(&d), &args);
        assert_eq!(out.code, 0, "{}", out.stderr);
        serde_json::from_str(out.stdout.trim()).unwrap()
    };
    let from_ckpt = eval(&["--checkpoint", "ck"]);
    let from_export = eval(&["--model", "hf"]);
    assert_eq!(from_ckpt, from_export);
    let loss = from_ckpt["loss"].as_f64().unwrap();
    assert!(loss.is_finite() && loss > 0.0, "{from_ckpt}");
    // Trained: not the seeded init's loss.
    let init = eval(&["--model", "model"]);
    assert_ne!(init["loss"], from_ckpt["loss"]);
}

/// A signal while `export` writes removes its temporary file (as large as
/// the model) and the directories it made, and exits 128 + the signal: it
/// left both (the directory 0700, and a later export into it left it so).
/// A finished export's directories are 0755.
#[test]
fn a_signal_during_export_removes_what_it_was_writing() {
    use std::os::unix::fs::PermissionsExt;
    // A model whose export (50 MB) outlasts the signal watcher's poll
    // (20 ms) many times over: a tiny one's ended before the watcher
    // looked, whole (exit 0, as it should then).
    let d = scratch("export-signal");
    std::fs::create_dir_all(d.join("model")).unwrap();
    let model = json!({"model_type": "gpt2", "vocab_size": 256, "n_positions": 32,
        "n_embd": 512, "n_layer": 4, "n_head": 8, "tie_word_embeddings": true});
    std::fs::write(d.join("model/config.json"), model.to_string()).unwrap();
    std::fs::write(
        d.join("data.txt"),
        "an export stopped half way. ".repeat(20),
    )
    .unwrap();
    let cfg = json!({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}});
    std::fs::write(d.join("ds.json"), cfg.to_string()).unwrap();
    let ok = train(&d, &["--steps", "1", "--save-dir", "ck"]);
    assert_eq!(ok.code, 0, "{}", ok.stderr);
    let child = cli_support::spawn_frozen(
        &d,
        &[
            "export",
            "--checkpoint",
            "ck",
            "--out",
            "hf/a/model.safetensors",
            "--json",
        ],
        "export.write:1:stop",
    );
    let tmps: Vec<String> = std::fs::read_dir(d.join("hf/a"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        tmps.iter().any(|n| n.contains(".tmp-")),
        "its temporary file is made: {tmps:?}"
    );
    for sig in ["-INT", "-CONT"] {
        let sent = std::process::Command::new("kill")
            .args([sig, &child.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("SIGINT received: removing"), "{stderr}");
    assert!(!d.join("hf").exists(), "left behind: {stderr}");
    // --json: the stop's object, as train prints one (stdout was empty).
    let obj: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        obj,
        json!({"stopped": "signal", "stop_signal": "SIGINT", "exit_code": 130})
    );
    // Done whole, its directories are readable by others.
    let o = run_tierzero(
        Some(&d),
        &[
            "export",
            "--checkpoint",
            "ck",
            "--out",
            "hf/a/model.safetensors",
        ],
    );
    assert_eq!(o.code, 0, "{}", o.stderr);
    for dir in ["hf", "hf/a"] {
        let mode = std::fs::metadata(d.join(dir)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o755, "{dir}");
    }
}

//! `tierzero train`, run as the built binary: a tiny model with stage 3 and
//! NVMe offload into a scratch directory (metrics keys, finite loss,
//! determinism, the plan and the summary), user mistakes (exit 2 with one
//! line), and the embedded default for two steps.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failure is a panic

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

/// A fresh directory under the cargo target tmp dir.
fn scratch(tag: &str) -> PathBuf {
    cli_support::scratch("cli-train", tag)
}

mod cli_support;
use cli_support::Out;

fn train(cwd: &Path, args: &[&str]) -> Out {
    let mut all = vec!["train"];
    all.extend_from_slice(args);
    cli_support::run_tierzero(Some(cwd), &all)
}

/// A scratch dir with a tiny GPT-2 (`model/config.json`), a text file
/// (`data.txt`), a swap dir (`swap/`) and `ds_config.json` with stage 3 and
/// both offloads on NVMe.
fn tiny_setup(tag: &str) -> PathBuf {
    let d = scratch(tag);
    std::fs::create_dir_all(d.join("model")).unwrap();
    std::fs::create_dir_all(d.join("swap")).unwrap();
    let model = json!({"model_type": "gpt2", "vocab_size": 256, "n_positions": 32,
        "n_embd": 32, "n_layer": 2, "n_head": 2, "tie_word_embeddings": true});
    std::fs::write(d.join("model/config.json"), model.to_string()).unwrap();
    let text = "the engine streams every layer from nvme while adam steps on the cpu. ".repeat(60);
    std::fs::write(d.join("data.txt"), text).unwrap();
    write_config(&d, ds_config(&d));
    d
}

fn ds_config(d: &Path) -> Value {
    let swap = d.join("swap");
    let swap = swap.to_str().unwrap();
    json!({
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.001, "warmup_num_steps": 1,
            "total_num_steps": "auto"}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": swap, "buffer_count": 4,
                "buffer_size": 20000, "max_in_cpu": 0},
            "offload_optimizer": {"device": "nvme", "nvme_path": swap},
            "sub_group_size": 10000,
            "stage3_param_persistence_threshold": 0
        },
        "tierzero": {"checksums": true}
    })
}

fn write_config(d: &Path, cfg: Value) {
    std::fs::write(d.join("ds_config.json"), cfg.to_string()).unwrap();
}

const TINY: [&str; 10] = [
    "--config",
    "ds_config.json",
    "--model",
    "model",
    "--data",
    "data.txt",
    "--seq-len",
    "16",
    "--steps",
    "3",
];

fn metrics_lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

#[test]
fn tiny_run_writes_metrics_plan_and_summary_and_is_deterministic() {
    let d = tiny_setup("tiny");
    let mut args = TINY.to_vec();
    args.extend(["--metrics", "m1.jsonl"]);
    let out = train(&d, &args);
    assert_eq!(out.code, 0, "stderr: {}", out.stderr);
    assert!(!out.stderr.contains("panicked"), "{}", out.stderr);

    let lines = metrics_lines(&d.join("m1.jsonl"));
    assert_eq!(lines.len(), 4, "3 steps and a summary: {lines:?}");
    for (i, m) in lines[..3].iter().enumerate() {
        assert_eq!(m["step"], i as u64 + 1);
        for key in [
            "loss",
            "tokens_per_s",
            "compute_s",
            "io_wait_s",
            "optimizer_s",
            "idle_s",
            "peak_rss_bytes",
            "overlap_efficiency",
        ] {
            let v = m[key]
                .as_f64()
                .unwrap_or_else(|| panic!("`{key}` missing or not a number in {m}"));
            assert!(v.is_finite() && v >= 0.0, "`{key}` = {v} in {m}");
        }
        for key in ["bytes_read", "bytes_written"] {
            let per_tier = m[key].as_object().unwrap_or_else(|| panic!("{key}: {m}"));
            assert!(per_tier.contains_key("cpu") && per_tier.contains_key("nvme"));
        }
    }
    // Everything lives on NVMe: the first step reads every param from it
    // (on the compute thread, so inside its own line). Later steps keep
    // this tiny model's updated params resident, and their NVMe traffic is
    // the optimizer thread's, counted when it publishes: its tail overlaps
    // the next step, so a short step's line may show none. The summary
    // has the totals.
    assert!(
        lines[0]["bytes_read"]["nvme"].as_u64().unwrap() > 0,
        "{}",
        lines[0]
    );
    let summary = &lines[3];
    assert_eq!(summary["summary"], true);
    let written = summary["bytes_written"]["nvme"].as_u64().unwrap();
    let read = summary["bytes_read"]["nvme"].as_u64().unwrap();
    let per_steps: u64 = lines[..3]
        .iter()
        .map(|m| m["bytes_read"]["nvme"].as_u64().unwrap())
        .sum();
    assert!(written > 0, "{summary}");
    assert!(read >= per_steps, "{summary}");
    assert_eq!(summary["steps"], 3);
    let hash = summary["weight_sha256"].as_str().unwrap();
    assert_eq!(hash.len(), 64, "{hash}");
    assert!(hash.chars().all(|c| c.is_ascii_hexdigit()), "{hash}");

    // The plan names every tier and the pinned budget; the summary repeats
    // the hash and the losses of the metrics file.
    let s = &out.stdout;
    assert!(s.contains("plan: ZeRO stage 3"), "{s}");
    // 4 buffers of 20,000 fp32 elements (80 KiB each) cut into slots of
    // the largest shard, 8,192 elements (32 KiB): 2 a buffer.
    for word in [
        "device",
        "pinned host",
        "NVMe",
        "param swap buffers (8 x 32 KiB)",
    ] {
        assert!(s.contains(word), "`{word}` missing from the plan: {s}");
    }
    assert!(s.contains("pinned total"), "{s}");
    assert!(s.contains(&format!("weight_sha256: {hash}")), "{s}");
    let first = lines[0]["loss"].as_f64().unwrap() as f32;
    let last = lines[2]["loss"].as_f64().unwrap() as f32;
    assert!(
        s.contains(&format!(
            "loss: {first:.4} at step 1 -> {last:.4} at step 3"
        )),
        "{s}"
    );

    // Same inputs and seed: same losses and weights, bit for bit.
    let mut args = TINY.to_vec();
    args.extend(["--metrics", "m2.jsonl"]);
    let again = train(&d, &args);
    assert_eq!(again.code, 0, "stderr: {}", again.stderr);
    let lines2 = metrics_lines(&d.join("m2.jsonl"));
    for (a, b) in lines.iter().zip(&lines2).take(3) {
        assert_eq!(a["loss"], b["loss"]);
    }
    assert_eq!(lines2[3]["weight_sha256"], summary["weight_sha256"]);

    // Another seed gives other weights.
    let mut args = TINY.to_vec();
    args.extend(["--metrics", "m3.jsonl", "--seed", "7"]);
    let other = train(&d, &args);
    assert_eq!(other.code, 0, "stderr: {}", other.stderr);
    let lines3 = metrics_lines(&d.join("m3.jsonl"));
    assert_ne!(lines3[3]["weight_sha256"], summary["weight_sha256"]);
}

/// Exit code 2, and stderr is one line starting with `error:` that contains
/// every one of `words`.
fn assert_bad(d: &Path, args: &[&str], words: &[&str]) {
    let out = train(d, args);
    assert_eq!(
        out.code, 2,
        "{args:?}: stdout {} stderr {}",
        out.stdout, out.stderr
    );
    let lines: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| !l.trim().is_empty())
        .collect();
    assert_eq!(lines.len(), 1, "{args:?}: not one line: {}", out.stderr);
    assert!(lines[0].starts_with("error: "), "{args:?}: {}", lines[0]);
    assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
    for w in words {
        assert!(
            lines[0].contains(w),
            "{args:?}: `{w}` missing from: {}",
            lines[0]
        );
    }
}

/// `base` with each flag's value replaced, or the flag appended.
fn with<'a>(base: &[&'a str], replace: &[(&'a str, &'a str)]) -> Vec<&'a str> {
    let mut v = base.to_vec();
    for (flag, value) in replace {
        match v.iter().position(|a| a == flag) {
            Some(i) => v[i + 1] = value,
            None => v.extend([*flag, *value]),
        }
    }
    v
}

#[test]
fn user_mistakes_exit_2_with_one_line() {
    let d = tiny_setup("bad");
    // Files that are not there.
    assert_bad(
        &d,
        &with(&TINY, &[("--model", "nope")]),
        &["--model", "nope"],
    );
    std::fs::create_dir_all(d.join("empty")).unwrap();
    assert_bad(
        &d,
        &with(&TINY, &[("--model", "empty")]),
        &["--model", "config.json"],
    );
    assert_bad(
        &d,
        &with(&TINY, &[("--data", "nope.txt")]),
        &["--data", "nope.txt"],
    );
    assert_bad(
        &d,
        &with(&TINY, &[("--config", "nope.json")]),
        &["--config", "nope.json"],
    );
    // Bad numbers.
    assert_bad(&d, &with(&TINY, &[("--steps", "0")]), &["--steps", "0"]);
    // Past the model's positions (n_positions 32): the limit is named.
    assert_bad(
        &d,
        &with(&TINY, &[("--seq-len", "64")]),
        &[
            "--seq-len 64",
            "32 positions",
            "n_positions",
            "--seq-len 32 or less",
        ],
    );
    assert_bad(
        &d,
        &with(&TINY, &[("--steps", "many")]),
        &["--steps", "many"],
    );
    assert_bad(
        &d,
        &with(&TINY, &[("--seq-len", "33")]),
        &["--seq-len", "32"],
    );
    assert_bad(&d, &with(&TINY, &[("--threads", "0")]), &["--threads"]);
    // A tokenizer.json that is not there.
    assert_bad(
        &d,
        &with(&TINY, &[("--tokenizer", "tokenizer.json")]),
        &["--tokenizer", "tokenizer.json"],
    );
    // Data too short for the sequence length.
    std::fs::write(d.join("short.txt"), "too short").unwrap();
    assert_bad(
        &d,
        &with(&TINY, &[("--data", "short.txt")]),
        &["--data", "short.txt", "--seq-len"],
    );
    // A model whose config.json is wrong.
    std::fs::create_dir_all(d.join("badmodel")).unwrap();
    std::fs::write(
        d.join("badmodel/config.json"),
        "{\"model_type\": \"gpt2\", ",
    )
    .unwrap();
    assert_bad(&d, &with(&TINY, &[("--model", "badmodel")]), &["--model"]);

    // Bad configs: invalid JSON (line and column), a missing nvme_path
    // directory, a pinned budget too small for the buffers.
    std::fs::write(
        d.join("broken.json"),
        "{\n  \"train_micro_batch_size_per_gpu\": 2,\n  \"fp16\" {}\n}",
    )
    .unwrap();
    assert_bad(
        &d,
        &with(&TINY, &[("--config", "broken.json")]),
        &["broken.json", "line 3"],
    );
    let mut cfg = ds_config(&d);
    cfg["zero_optimization"]["offload_param"]["nvme_path"] = json!(d.join("no-such-dir"));
    std::fs::write(d.join("nopath.json"), cfg.to_string()).unwrap();
    assert_bad(
        &d,
        &with(&TINY, &[("--config", "nopath.json")]),
        &["nvme_path", "no-such-dir"],
    );
    let mut cfg = ds_config(&d);
    cfg["tierzero"]["pinned_budget_bytes"] = json!(4096);
    std::fs::write(d.join("budget.json"), cfg.to_string()).unwrap();
    assert_bad(
        &d,
        &with(&TINY, &[("--config", "budget.json")]),
        &["pinned_budget_bytes"],
    );
    // A metrics file in a directory that does not exist.
    let mut args = TINY.to_vec();
    args.extend(["--metrics", "no/such/dir/m.jsonl"]);
    assert_bad(&d, &args, &["--metrics", "no/such/dir"]);
    // The same for a timeline; and a timeline of no steps.
    let mut args = TINY.to_vec();
    args.extend(["--timeline", "no/such/dir/t.json"]);
    assert_bad(&d, &args, &["--timeline", "no/such/dir"]);
    let mut args = TINY.to_vec();
    args.extend(["--timeline", "t.json", "--timeline-steps", "0"]);
    assert_bad(&d, &args, &["--timeline-steps", "out of range"]);
    // Metrics on stdout under --json (stdout is the summary alone); a
    // timeline through a symbolic link (the rename replaced the link: run
    // as root, --timeline /dev/stdout replaced the system's).
    let mut args = TINY.to_vec();
    args.extend(["--metrics", "/dev/stdout", "--json"]);
    assert_bad(&d, &args, &["--metrics /dev/stdout", "stdout", "--json"]);
    std::os::unix::fs::symlink("elsewhere.json", d.join("tl-link.json")).unwrap();
    let mut args = TINY.to_vec();
    args.extend(["--timeline", "tl-link.json"]);
    assert_bad(&d, &args, &["--timeline tl-link.json", "symbolic link"]);
    assert!(std::fs::symlink_metadata(d.join("tl-link.json"))
        .unwrap()
        .file_type()
        .is_symlink());
    // Metrics on the file stdout is redirected to: the two wrote over
    // each other at offset 0.
    let out_file = std::fs::File::create(d.join("stdout.txt")).unwrap();
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_tierzero"))
        .current_dir(&d)
        .arg("train")
        .args(TINY)
        .args(["--metrics", "/dev/stdout"])
        .stdout(out_file)
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&status.stderr);
    assert_eq!(status.status.code(), Some(2), "{err}");
    assert!(err.contains("would write over what stdout writes"), "{err}");
    // A timeline path that is a directory: said at start-up, not after the
    // last step (it was exit 1 then, and the summary was lost).
    std::fs::create_dir_all(d.join("tl")).unwrap();
    let mut args = TINY.to_vec();
    args.extend(["--timeline", "tl"]);
    assert_bad(&d, &args, &["--timeline tl", "directory"]);
    // So is a metrics path (it read "I/O error on tl: Is a directory").
    let mut args = TINY.to_vec();
    args.extend(["--metrics", "tl"]);
    assert_bad(&d, &args, &["--metrics tl", "is a directory"]);
    // A FIFO (or a device): the timeline's rename would have replaced it
    // with a regular file after the last step.
    let made = std::process::Command::new("mkfifo")
        .arg(d.join("tl.fifo"))
        .status()
        .unwrap();
    assert!(made.success());
    let mut args = TINY.to_vec();
    args.extend(["--timeline", "tl.fifo"]);
    assert_bad(
        &d,
        &args,
        &["--timeline tl.fifo", "FIFO, not a regular file"],
    );
    // Outputs never overwrite the run's inputs or each other (the corpus
    // was replaced by metrics), and each input is as it was.
    let inputs = ["data.txt", "ds_config.json", "model/config.json"];
    let read_all = || -> Vec<Vec<u8>> {
        inputs
            .iter()
            .map(|f| std::fs::read(d.join(f)).unwrap())
            .collect()
    };
    let before = read_all();
    for (flag, path, words) in [
        ("--metrics", "data.txt", "is the --data file"),
        ("--timeline", "./ds_config.json", "is the --config file"),
        (
            "--metrics",
            "model/config.json",
            "a model file of the --model directory",
        ),
    ] {
        let mut args = TINY.to_vec();
        args.extend([flag, path]);
        assert_bad(&d, &args, &[flag, words]);
    }
    // Another file of the model's directory (a metrics file an earlier
    // run wrote there) is not an input: the run goes on (it stops at the
    // timeline's FIFO check, which comes after the inputs' check).
    std::fs::write(d.join("model/metrics.jsonl"), "{}\n").unwrap();
    let mut args = TINY.to_vec();
    args.extend(["--metrics", "model/metrics.jsonl", "--timeline", "tl.fifo"]);
    assert_bad(&d, &args, &["--timeline tl.fifo", "FIFO"]);
    let mut args = TINY.to_vec();
    args.extend(["--metrics", "out.json", "--timeline", "./out.json"]);
    assert_bad(&d, &args, &["--metrics and --timeline name one file"]);
    assert!(before == read_all(), "an input changed");
}

/// The embedded default has no file to edit: `--lr`, `--micro-batch` and
/// `--grad-accum` set the run's values (they were refused as differing
/// from its concrete ones, with a fix naming its keys).
#[test]
fn flags_set_the_embedded_default_s_values() {
    let d = scratch("default-flags");
    let args = [
        "--steps",
        "3",
        "--lr",
        "1e-4",
        "--micro-batch",
        "2",
        "--grad-accum",
        "2",
        "--seq-len",
        "16",
        "--metrics",
        "m.jsonl",
    ];
    let out = train(&d, &args);
    assert_eq!(out.code, 0, "stderr: {}", out.stderr);
    let lines = metrics_lines(&d.join("m.jsonl"));
    // Linear warmup over 20 steps from 0: step 3 runs at iteration 1's lr.
    let lr = lines[2]["lr"].as_f64().unwrap();
    assert!((lr - 1e-4 / 20.0).abs() < 1e-12, "{lr}: {}", lines[2]);
}

/// A run of the embedded default refused at start-up leaves no
/// `./tierzero-swap/` behind (its config's load made it for good); one
/// that exists already stays.
#[test]
fn a_refused_default_run_leaves_no_swap_dir() {
    let d = scratch("default-refused");
    let out = train(&d, &["--data", "missing.txt"]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("--data missing.txt"), "{}", out.stderr);
    assert!(!d.join("tierzero-swap").exists());
    std::fs::create_dir(d.join("tierzero-swap")).unwrap();
    let out = train(&d, &["--data", "missing.txt"]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(d.join("tierzero-swap").is_dir());
}

#[test]
fn embedded_default_runs_two_steps_with_nvme_offload_in_the_working_dir() {
    let d = scratch("default");
    let out = train(&d, &["--steps", "2", "--metrics", "m.jsonl"]);
    assert_eq!(out.code, 0, "stderr: {}", out.stderr);
    assert!(
        d.join("tierzero-swap").is_dir(),
        "./tierzero-swap/ not created"
    );
    let s = &out.stdout;
    assert!(s.contains("model embedded default"), "{s}");
    assert!(s.contains("data data/corpus.txt (embedded)"), "{s}");
    // Params and optimizer state (and, with the default's clipping, the
    // spilled final gradients) all go to ./tierzero-swap.
    assert!(s.contains("NVMe swap: params"), "{s}");
    assert!(s.contains("optimizer state in ./tierzero-swap"), "{s}");
    assert!(s.contains("of a budget of 256 MiB"), "{s}");
    // The run line says what became of malloc's thresholds.
    let user_malloc = std::env::var("GLIBC_TUNABLES").is_ok_and(|v| v.contains("glibc.malloc."));
    let malloc = if user_malloc {
        "host malloc: glibc malloc as GLIBC_TUNABLES sets it"
    } else {
        "host malloc: glibc heap kept mapped (M_MMAP_THRESHOLD 256 MiB, M_TRIM_THRESHOLD off: the heap's top is never returned, M_ARENA_MAX 1)"
    };
    assert!(s.contains(malloc), "{s}");
    let lines = metrics_lines(&d.join("m.jsonl"));
    assert_eq!(lines.len(), 3, "{lines:?}");
    for m in &lines[..2] {
        assert!(m["loss"].as_f64().unwrap().is_finite(), "{m}");
        assert!(m["bytes_read"]["nvme"].as_u64().unwrap() > 0, "{m}");
    }
    // The embedded model keeps every tensor within one 2e5-element swap
    // buffer: the largest is reported in the plan.
    let largest: u64 = s
        .split("largest tensor ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no largest tensor in the plan: {s}"));
    assert!(largest <= 200_000, "{largest}");
}

#[test]
fn help_has_examples_and_the_current_defaults() {
    let out = train(Path::new(env!("CARGO_TARGET_TMPDIR")), &["--help"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stdout.contains("Examples:"), "{}", out.stdout);
    let steps = format!("else {}", tierzero::run::DEFAULT_STEPS);
    assert!(
        out.stdout.contains(&steps),
        "`{steps}` missing: {}",
        out.stdout
    );
    let seq = format!("Default: {},", tierzero::run::DEFAULT_SEQ_LEN);
    assert!(out.stdout.contains(&seq), "`{seq}` missing: {}", out.stdout);
}

#[test]
fn steps_come_from_the_flag_or_a_concrete_total_num_steps() {
    let d = tiny_setup("steps");
    let mut cfg = ds_config(&d);
    cfg["scheduler"]["params"]["total_num_steps"] = json!(2);
    std::fs::write(d.join("two.json"), cfg.to_string()).unwrap();
    let base = [
        "--config",
        "two.json",
        "--model",
        "model",
        "--data",
        "data.txt",
        "--seq-len",
        "8",
        "--metrics",
        "m.jsonl",
    ];
    // Without --steps the config's concrete total_num_steps is the run length.
    let out = train(&d, &base);
    assert_eq!(out.code, 0, "stderr: {}", out.stderr);
    let lines = metrics_lines(&d.join("m.jsonl"));
    assert_eq!(lines.len(), 3, "2 steps and a summary: {lines:?}");
    assert_eq!(lines[2]["steps"], 2);
    // --steps decides the run length; the schedule keeps the config's
    // concrete value (fill-only, as accelerate; HF Trainer refuses the
    // mismatch) and the run says so.
    let mut args = base.to_vec();
    args.extend(["--steps", "3"]);
    let out = train(&d, &args);
    assert_eq!(out.code, 0, "stderr: {}", out.stderr);
    assert_eq!(metrics_lines(&d.join("m.jsonl"))[3]["steps"], 3);
    assert!(
        out.stderr
            .lines()
            .any(|l| l.starts_with("warning: ") && l.contains("total_num_steps")),
        "{}",
        out.stderr
    );
    // A total_num_steps of 0 without --steps would train nothing: exit 2
    // (it trained nothing and exited 0, saying a checkpoint was at step 0).
    cfg["scheduler"]["params"]["total_num_steps"] = json!(0);
    std::fs::write(d.join("zero.json"), cfg.to_string()).unwrap();
    assert_bad(
        &d,
        &with(&base, &[("--config", "zero.json")]),
        &["total_num_steps is 0", "--steps"],
    );
    // Nor may it exceed --steps' own bound (1e19 was an endless run).
    cfg["scheduler"]["params"]["total_num_steps"] = json!(1e19);
    std::fs::write(d.join("endless.json"), cfg.to_string()).unwrap();
    assert_bad(
        &d,
        &with(&base, &[("--config", "endless.json")]),
        &[
            "10000000000000000000 steps",
            "over 1099511627776",
            "--steps",
        ],
    );
}

/// A step the engine skipped under fp16's dynamic loss scale (its
/// gradients were not all finite) leaves the weights as they were and
/// lowers the scale, so a non-finite loss on it does not end the run, as
/// DeepSpeed's does not: it says so and goes on (it ended with exit 1,
/// "diverged"). An init of standard deviation 3000 overflows fp16's
/// forward at every step. (Without a dynamic scale nothing changes for
/// the next step: there it ends the run, the test below.)
#[test]
fn a_non_finite_loss_on_a_skipped_step_does_not_end_the_run() {
    let d = tiny_setup("skipped-nan");
    let model = json!({"model_type": "gpt2", "vocab_size": 256, "n_positions": 32,
        "n_embd": 32, "n_layer": 2, "n_head": 2, "tie_word_embeddings": true,
        "initializer_range": 3000.0});
    std::fs::write(d.join("model/config.json"), model.to_string()).unwrap();
    let mut cfg = ds_config(&d);
    cfg["fp16"] = json!({"enabled": true});
    write_config(&d, cfg);
    let mut args = TINY.to_vec();
    args.extend(["--metrics", "m.jsonl"]);
    let out = train(&d, &args);
    assert_eq!(out.code, 0, "stdout {} stderr {}", out.stdout, out.stderr);
    assert!(
        out.stderr
            .contains("step 1: the loss is NaN; the step was skipped"),
        "{}",
        out.stderr
    );
    let lines = metrics_lines(&d.join("m.jsonl"));
    assert_eq!(lines.len(), 4, "3 steps and a summary: {lines:?}");
    assert_eq!(lines[3]["skipped_steps"], json!(3), "{}", lines[3]);
    // The skips are said where the progress and the summary are (only the
    // metrics and --json counted them: "done: 3 steps" of no update).
    assert_eq!(
        out.stderr
            .matches(" skipped (gradients not all finite at loss scale ")
            .count(),
        3,
        "{}",
        out.stderr
    );
    assert!(
        out.stdout.contains("done: 3 steps (3 skipped in all"),
        "{}",
        out.stdout
    );
}

/// A loss that is not finite before any update was applied is the
/// weights' (or the data's), not a divergence: it said "(diverged); lower
/// the learning rate" at step 1, whose lr was 0.
#[test]
fn a_non_finite_loss_before_any_update_names_the_weights_not_the_lr() {
    let d = tiny_setup("nan-first");
    let model = json!({"model_type": "gpt2", "vocab_size": 256, "n_positions": 32,
        "n_embd": 32, "n_layer": 2, "n_head": 2, "tie_word_embeddings": true,
        "initializer_range": 1e25});
    std::fs::write(d.join("model/config.json"), model.to_string()).unwrap();
    // Its step applied (no clipping), or skipped (clipping skips a
    // non-finite norm's step) in fp32 or bf16, where no loss scale moves:
    // the run ends either way (skipped, it trained every step NaN and
    // exited 0).
    for (clip, bf16) in [(0.0, false), (1.0, false), (1.0, true)] {
        let mut cfg = ds_config(&d);
        cfg["gradient_clipping"] = json!(clip);
        if bf16 {
            cfg["bf16"] = json!({"enabled": true});
        }
        write_config(&d, cfg);
        let out = train(&d, &TINY);
        assert_eq!(
            out.code, 2,
            "clip {clip} bf16 {bf16}: stdout {} stderr {}",
            out.stdout, out.stderr
        );
        assert!(
            out.stderr
                .contains("step 1: the loss is NaN before any update was applied")
                && !out.stderr.contains("lower the learning rate"),
            "clip {clip} bf16 {bf16}: {}",
            out.stderr
        );
    }
    // A run that diverges (lr 1e30, constant): its first step applied, the
    // next's loss NaN and its step skipped by clipping; it went on,
    // skipping every step, and exited 0.
    std::fs::write(
        d.join("model/config.json"),
        json!({"model_type": "gpt2", "vocab_size": 256, "n_positions": 32,
            "n_embd": 32, "n_layer": 2, "n_head": 2, "tie_word_embeddings": true})
        .to_string(),
    )
    .unwrap();
    let mut cfg = ds_config(&d);
    cfg.as_object_mut().unwrap().remove("scheduler");
    cfg["optimizer"]["params"]["lr"] = json!(1e30);
    cfg["gradient_clipping"] = json!(1.0);
    write_config(&d, cfg);
    let out = train(&d, &with(&TINY, &[("--steps", "6")]));
    assert_eq!(out.code, 2, "stdout {} stderr {}", out.stdout, out.stderr);
    assert!(
        out.stderr.contains("(diverged); lower the learning rate"),
        "{}",
        out.stderr
    );
}

/// fp16's scaler ending the run at its minimum scale: the step that
/// overflowed there has its metrics line, and the error names it (the
/// record stopped at the step before, at twice the scale).
#[test]
fn the_step_that_overflows_at_the_minimum_scale_is_recorded() {
    let d = tiny_setup("min-scale");
    let model = json!({"model_type": "gpt2", "vocab_size": 256, "n_positions": 32,
        "n_embd": 32, "n_layer": 2, "n_head": 2, "tie_word_embeddings": true,
        "initializer_range": 500.0});
    std::fs::write(d.join("model/config.json"), model.to_string()).unwrap();
    let mut cfg = ds_config(&d);
    cfg["fp16"] = json!({"enabled": true, "loss_scale": 0, "initial_scale_power": 4,
        "loss_scale_window": 2, "hysteresis": 2, "min_loss_scale": 4});
    write_config(&d, cfg);
    let args = with(&TINY, &[("--steps", "10"), ("--metrics", "m.jsonl")]);
    let out = train(&d, &args);
    assert_eq!(out.code, 2, "stdout {} stderr {}", out.stdout, out.stderr);
    // Scales 16, 16 (hysteresis), 8, then the overflow at 4 ends it.
    assert!(out.stderr.contains("training step 4"), "{}", out.stderr);
    let lines = metrics_lines(&d.join("m.jsonl"));
    assert_eq!(lines.len(), 4, "{lines:?}");
    assert_eq!(lines[3]["loss_scale"], json!(4.0), "{}", lines[3]);
    assert_eq!(lines[3]["skipped"], json!(true), "{}", lines[3]);
}

/// The plan and progress lines go to stderr; a reader of it that has gone
/// (`tierzero train 2>&1 | head`) does not stop the run: it trains to the
/// end and writes its metrics (a write to the closed pipe panicked: exit
/// 101 at the first line).
#[test]
fn a_closed_stderr_does_not_stop_the_run() {
    let d = tiny_setup("stderr-pipe");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_tierzero"))
        .arg("train")
        .args(with(&TINY, &[("--steps", "3")]))
        .args(["--metrics", "m.jsonl"])
        .current_dir(&d)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run tierzero");
    drop(child.stderr.take());
    let status = child.wait().expect("wait");
    assert_eq!(status.code(), Some(0), "{status}");
    let lines = metrics_lines(&d.join("m.jsonl"));
    assert_eq!(lines.len(), 4, "3 steps and a summary: {lines:?}");
}

#[test]
fn tokenizer_json_feeds_the_run() {
    let d = tiny_setup("tokenizer");
    // A model with 8 token ids: byte-level data cannot fit it, the
    // WordLevel tokenizer's ids (0..=7) can.
    std::fs::create_dir_all(d.join("model8")).unwrap();
    let model = json!({"model_type": "gpt2", "vocab_size": 8, "n_positions": 32,
        "n_embd": 32, "n_layer": 2, "n_head": 2, "tie_word_embeddings": true});
    std::fs::write(d.join("model8/config.json"), model.to_string()).unwrap();
    std::fs::write(
        d.join("words.txt"),
        "the engine streams layers from nvme. ".repeat(20),
    )
    .unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizer/wordlevel.json")
        .to_str()
        .unwrap()
        .to_owned();
    let args = with(&TINY, &[("--model", "model8"), ("--data", "words.txt")]);
    assert_bad(&d, &args, &["vocab_size is 8", "--tokenizer"]);
    let mut args = with(&args, &[("--steps", "2")]);
    // The WordLevel fixture has no end-of-text token: id 5 (".") ends
    // each document instead.
    args.extend([
        "--tokenizer",
        fixture.as_str(),
        "--eos-id",
        "5",
        "--metrics",
        "m.jsonl",
    ]);
    let out = train(&d, &args);
    assert_eq!(out.code, 0, "stderr: {}", out.stderr);
    let lines = metrics_lines(&d.join("m.jsonl"));
    // Near ln(8) at a seeded init: the run saw 8-way ids, not bytes.
    let loss = lines[0]["loss"].as_f64().unwrap();
    assert!((loss - 8f64.ln()).abs() < 0.5, "{loss}");
    // --tokenizer without --data: a usage error.
    let out = train(&d, &["--tokenizer", fixture.as_str(), "--steps", "1"]);
    assert_eq!(out.code, 2, "{}", out.stderr);
}

/// The config and the output paths are checked before the corpus is
/// encoded (which may take hours): a refused config writes no token cache.
#[test]
fn a_bad_config_is_refused_before_the_corpus_is_encoded() {
    let d = tiny_setup("config-before-data");
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizer/wordlevel.json")
        .to_str()
        .unwrap()
        .to_owned();
    std::fs::write(
        d.join("bad.json"),
        r#"{"train_batch_size": 7, "zero_optimization": {"stage": 9}}"#,
    )
    .unwrap();
    let mut args = with(&TINY, &[("--config", "bad.json")]);
    args.extend(["--tokenizer", fixture.as_str(), "--eos-id", "5"]);
    let out = train(&d, &args);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("stage"), "{}", out.stderr);
    // So is a --metrics path in a directory that is not there.
    let mut args = with(&TINY, &[]);
    args.extend([
        "--tokenizer",
        fixture.as_str(),
        "--eos-id",
        "5",
        "--metrics",
        "nowhere/m.jsonl",
    ]);
    let out = train(&d, &args);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("--metrics"), "{}", out.stderr);
    let cached: Vec<String> = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tz-"))
        .collect();
    assert!(cached.is_empty(), "encoded before the refusal: {cached:?}");
}

#[test]
fn json_prints_only_the_summary_object_on_stdout() {
    let d = tiny_setup("json");
    let mut args = TINY.to_vec();
    args.extend(["--json", "--metrics", "m.jsonl"]);
    let out = train(&d, &args);
    assert_eq!(out.code, 0, "stderr: {}", out.stderr);
    let v: Value = serde_json::from_str(out.stdout.trim())
        .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}): {}", out.stdout));
    assert_eq!(out.stdout.trim().lines().count(), 1, "{}", out.stdout);
    // The plan and the progress went to stderr.
    assert!(out.stderr.contains("plan: ZeRO stage 3"), "{}", out.stderr);
    assert!(out.stderr.contains("step 3/3"), "{}", out.stderr);
    // The object agrees with the metrics file.
    let lines = metrics_lines(&d.join("m.jsonl"));
    assert_eq!(v["steps"], 3);
    assert_eq!(v["final_step"], 3);
    assert_eq!(v["weight_sha256"], lines[3]["weight_sha256"]);
    assert_eq!(v["first_loss"].as_f64(), lines[0]["loss"].as_f64());
    assert_eq!(v["final_loss"].as_f64(), lines[2]["loss"].as_f64());
    assert_eq!(v["tokens_per_step"], 2 * 16);
    assert_eq!(v["metrics"], "m.jsonl");
    for key in [
        "tokens_per_s",
        "train_s",
        "total_s",
        "nvme_read_bytes",
        "nvme_written_bytes",
        "peak_rss_bytes",
    ] {
        let x = v[key].as_f64().unwrap_or_else(|| panic!("`{key}` in {v}"));
        assert!(x > 0.0, "`{key}` = {x}");
    }
    // The seconds before the first step, by part, and after the last one:
    // parts within their wholes, and the three spans within the total.
    let st = &v["startup"];
    let secs = |x: &Value, key: &str| {
        let s = x[key].as_f64().unwrap_or_else(|| panic!("`{key}` in {v}"));
        assert!(s >= 0.0, "`{key}` = {s}");
        s
    };
    let within = |part: f64, whole: f64, what: &str| assert!(part <= whole + 1e-6, "{what}: {v}");
    let (startup, trainer) = (secs(st, "startup_s"), secs(st, "trainer_s"));
    within(
        secs(st, "tiers_s") + secs(st, "initial_s"),
        trainer,
        "tiers + initial",
    );
    within(
        secs(st, "before_trainer_s") + trainer,
        startup,
        "before + trainer",
    );
    within(
        startup + secs(&v, "train_s") + secs(&v, "finish_s"),
        secs(&v, "total_s"),
        "start-up + steps + finish",
    );
}

/// A failure under `--json` is one object on stdout too, naming the
/// error, its kind and the exit code, with the line on stderr as before;
/// a rank other than 0 (by mpirun's environment) prints none.
#[test]
fn a_failure_under_json_is_one_error_object_on_stdout() {
    let d = tiny_setup("json-failure");
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tierzero"))
            .arg("train")
            .args(args)
            .envs(env.iter().copied())
            .current_dir(&d)
            .output()
            .unwrap();
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (out.status.code(), text(&out.stdout), text(&out.stderr))
    };
    let object = |stdout: &str| -> Value {
        assert_eq!(stdout.lines().count(), 1, "{stdout}");
        serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
    };
    // A user's mistake (exit 2).
    let (code, stdout, stderr) = run(&["--config", "missing.json", "--json"], &[]);
    assert_eq!(code, Some(2), "{stderr}");
    let v = object(&stdout);
    assert_eq!(v["failure"], "bad_input", "{v}");
    assert_eq!(v["exit_code"], 2, "{v}");
    let error = v["error"].as_str().unwrap();
    assert!(error.contains("missing.json"), "{v}");
    assert!(stderr.contains(&format!("error: {error}")), "{stderr}");
    // A failure after start-up (exit 1): an injected EIO in a save.
    let mut args = TINY.to_vec();
    args.extend(["--json", "--save-dir", "ckpt", "--save-every", "1"]);
    let (code, stdout, stderr) = run(&args, &[("TIERZERO_FAILPOINT", "ckpt.state_write:1:eio")]);
    assert_eq!(code, Some(1), "{stderr}");
    let v = object(&stdout);
    assert_eq!(v["failure"], "internal", "{v}");
    assert_eq!(v["exit_code"], 1, "{v}");
    assert!(
        v["error"].as_str().unwrap().contains("ckpt.state_write"),
        "{v}"
    );
    // A flag clap refuses (before any of train's own checks) too.
    let (code, stdout, stderr) = run(&["--json", "--bogus"], &[]);
    assert_eq!(code, Some(2), "{stderr}");
    let v = object(&stdout);
    assert!(v["error"].as_str().unwrap().contains("--bogus"), "{v}");
    // Beside an argument that is not UTF-8 (a path), clap's refusal is
    // exit 2, not a panic in the look for --json after it.
    use std::os::unix::ffi::OsStrExt as _;
    let not_utf8 = std::ffi::OsStr::from_bytes(b"/tmp/\xff");
    for json in [false, true] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tierzero"))
            .arg("train")
            .args(["--data"])
            .arg(not_utf8)
            .args(json.then_some("--json"))
            .arg("--bogus")
            .current_dir(&d)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert_eq!(out.stdout.is_empty(), !json, "{stderr}");
    }
    // Without --json, stdout has no object; nor, for a mistake found
    // before the ranks are known, has mpirun's rank 1 (rank 0 prints it).
    let (code, stdout, _) = run(&["--config", "missing.json"], &[]);
    assert_eq!((code, stdout.as_str()), (Some(2), ""));
    let early = ["--sim-h2d-gbps", "3", "--json"];
    let (code, stdout, _) = run(&early, &[("OMPI_COMM_WORLD_RANK", "1")]);
    assert_eq!((code, stdout.as_str()), (Some(2), ""));
    let (code, stdout, _) = run(&early, &[("OMPI_COMM_WORLD_RANK", "0")]);
    assert_eq!(code, Some(2));
    assert!(object(&stdout)["error"]
        .as_str()
        .unwrap()
        .contains("--sim-h2d-gbps"));
}

/// Checkpoint saves are in `train_s` and in `save_s`, and out of
/// `tokens_per_s` (the steps' rate).
#[test]
fn tokens_per_s_leaves_out_the_saves() {
    let d = tiny_setup("json-saves");
    let mut args = TINY.to_vec();
    args.extend(["--json", "--save-dir", "ck", "--save-every", "1"]);
    let out = train(&d, &args);
    assert_eq!(out.code, 0, "stderr: {}", out.stderr);
    let v: Value = serde_json::from_str(out.stdout.trim()).unwrap();
    let (train_s, save_s) = (
        v["train_s"].as_f64().unwrap(),
        v["save_s"].as_f64().unwrap(),
    );
    assert!(save_s > 0.0 && save_s < train_s, "{v}");
    let steps = v["steps"].as_f64().unwrap();
    let want = v["tokens_per_step"].as_f64().unwrap() * steps / (train_s - save_s);
    let got = v["tokens_per_s"].as_f64().unwrap();
    assert!((got - want).abs() <= 1e-9 * want, "{got} vs {want}: {v}");
}

/// `tierzero.compute_threads`: the plan names the count and where it came
/// from: the config, `RAYON_NUM_THREADS`, or "auto" (every core).
#[test]
fn the_plan_names_the_compute_threads_and_their_source() {
    let d = tiny_setup("threads");
    let run = |env: Option<&str>| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_tierzero"));
        c.current_dir(&d)
            .arg("train")
            .args(TINY)
            .env_remove("RAYON_NUM_THREADS");
        if let Some(v) = env {
            c.env("RAYON_NUM_THREADS", v);
        }
        let out = c.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
            .lines()
            .find(|l| l.contains("compute on cpu, "))
            .unwrap_or_else(|| panic!("no compute line in {stdout}"))
            .to_owned()
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let auto = run(None);
    let want = cores;
    assert!(
        auto.contains(&format!("cpu, {want} compute thread")) && auto.contains("\"auto\""),
        "{auto}"
    );
    let from_env = run(Some("3"));
    assert!(
        from_env.contains("3 compute threads (RAYON_NUM_THREADS)"),
        "{from_env}"
    );
    let mut cfg = ds_config(&d);
    cfg["tierzero"]["compute_threads"] = json!(2);
    write_config(&d, cfg);
    let fixed = run(Some("3"));
    assert!(
        fixed.contains("2 compute threads (tierzero.compute_threads)"),
        "{fixed}"
    );
}

/// Logs written to a pipe or a file are plain text: no terminal colour
/// codes (tracing colours only a terminal).
#[test]
fn logs_to_a_pipe_carry_no_colour_codes() {
    let d = tiny_setup("plain-logs");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tierzero"))
        .current_dir(&d)
        .arg("train")
        .args(TINY)
        .env("TIERZERO_LOG", "info")
        .output()
        .unwrap();
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("INFO"), "no log lines: {stderr}");
    assert!(!stderr.contains('\x1b'), "colour codes in: {stderr:?}");
}

/// `--threads`: the run line names CPU Adam's threads and where the count
/// came from; auto (the default, or said) is one beside CPU compute.
#[test]
fn the_run_line_names_adam_s_threads_and_their_source() {
    let d = tiny_setup("adam-threads");
    let run_line = |extra: &[(&str, &str)]| {
        let out = train(&d, &with(&TINY, extra));
        assert_eq!(out.code, 0, "stdout {} stderr {}", out.stdout, out.stderr);
        out.stdout
            .lines()
            .find(|l| l.starts_with("run: "))
            .unwrap_or_else(|| panic!("no run line in {}", out.stdout))
            .to_owned()
    };
    let want_auto = "1 Adam thread (--threads auto: the compute threads have the cores)";
    for extra in [&[][..], &[("--threads", "auto")][..]] {
        let l = run_line(extra);
        assert!(l.contains(want_auto), "{extra:?}: {l}");
    }
    let l = run_line(&[("--threads", "3")]);
    assert!(l.contains("3 Adam threads (--threads)"), "{l}");
    assert_bad(&d, &with(&TINY, &[("--threads", "many")]), &["--threads"]);
}

/// `--timeline`: a Chrome trace of the steps after the first, with every
/// lane filled; each compute span lies inside a step span; the steps it
/// covers are the ones the plan of the flag says. The weights are those
/// of a run without it.
#[test]
fn timeline_traces_the_steps_after_the_first() {
    let d = tiny_setup("timeline");
    let mut args = TINY.to_vec();
    args[9] = "4";
    let plain = train(&d, &[&args[..], &["--json"]].concat());
    assert_eq!(plain.code, 0, "stderr: {}", plain.stderr);
    args.extend(["--timeline", "t.json", "--timeline-steps", "2"]);
    let out = train(&d, &args);
    assert_eq!(out.code, 0, "stderr: {}", out.stderr);
    assert!(
        out.stdout.contains("timeline of steps 2..=3 in t.json"),
        "{}",
        out.stdout
    );
    let plain: Value = serde_json::from_str(plain.stdout.trim()).unwrap();
    let hash = plain["weight_sha256"].as_str().unwrap();
    assert!(out.stdout.contains(hash), "same weights: {}", out.stdout);

    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("t.json")).unwrap()).unwrap();
    assert_eq!(v["otherData"]["steps"], json!([2, 3]));
    let events = v["traceEvents"].as_array().unwrap();
    let lanes: std::collections::BTreeMap<u64, String> = events
        .iter()
        .filter(|e| e["ph"] == "M")
        .map(|e| {
            (
                e["tid"].as_u64().unwrap(),
                e["args"]["name"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let spans = |lane: &str| -> Vec<(String, f64, f64)> {
        events
            .iter()
            .filter(|e| e["ph"] == "X" && lanes[&e["tid"].as_u64().unwrap()] == lane)
            .map(|e| {
                let ts = e["ts"].as_f64().unwrap();
                let dur = e["dur"].as_f64().unwrap();
                assert!(ts >= 0.0 && dur >= 0.0, "{e}");
                (e["name"].as_str().unwrap().to_string(), ts, ts + dur)
            })
            .collect()
    };
    let steps = spans("step");
    let names: Vec<&str> = steps.iter().map(|s| s.0.as_str()).collect();
    assert_eq!(names, ["step 2", "step 3"]);
    // 2 blocks + embedding forward, + head backward: per step 3 forward
    // and 4 backward spans, and as many waits for params but the backward
    // ones of the 2 blocks, which keep their forward graphs (the
    // activation policy's "auto" budget holds them) and fetch nothing.
    let compute = spans("compute");
    assert_eq!(compute.len(), 2 * 7, "{compute:?}");
    assert_eq!(spans("params").len(), 2 * (7 - 2));
    for (name, a, b) in &compute {
        assert!(
            steps.iter().any(|(_, s, e)| s <= a && b <= e),
            "{name} [{a}, {b}] outside every step: {steps:?}"
        );
    }
    let stepped = spans("optimizer");
    assert!(!stepped.is_empty(), "no sub-group step");
    // A sub-group's new params are stored after the optimizer thread
    // stepped it. The first stores of the window may be step 1's tail,
    // stepped before recording began, so check each sub-group's last.
    let stored = spans("store");
    assert!(!stored.is_empty(), "no store of new params");
    let mut last: std::collections::BTreeMap<&str, f64> = Default::default();
    for (name, a, _) in &stored {
        let t = last.entry(name.as_str()).or_insert(*a);
        *t = t.max(*a);
    }
    for (name, a) in &last {
        assert!(
            stepped.iter().any(|(n, _, b)| n == name && b <= a),
            "{name} last stored at {a} before any step of it: {stepped:?}"
        );
    }
    let disk = spans("disk");
    assert!(!disk.is_empty(), "no disk time");
    // The optimizer's state is on NVMe: its engines have lanes of their
    // own, each inside the union. (An engine's period closes a moment
    // before the union's: at the window's end the union's can fall
    // outside it, so the check stops at the last union span.)
    let union_end = disk.iter().map(|d| d.2).fold(f64::MIN, f64::max);
    for lane in ["disk: state reads", "disk: state writes"] {
        let own = spans(lane);
        assert!(!own.is_empty(), "no {lane} time");
        for (_, a, b) in own.iter().filter(|s| s.2 <= union_end) {
            assert!(
                disk.iter().any(|(_, s, e)| s <= a && b <= e),
                "{lane} [{a}, {b}] outside the union: {disk:?}"
            );
        }
    }
}

/// With several micro-batches and the optimizer on NVMe, gradient sums
/// park on NVMe between micro-batches through an engine of their own:
/// `--timeline` gives it a lane (it panicked on a missing clock), and the
/// weights are those of a run without the timeline.
#[test]
fn timeline_has_a_lane_for_the_grad_park() {
    let d = tiny_setup("timeline-park");
    let mut cfg = ds_config(&d);
    cfg["gradient_accumulation_steps"] = json!(3);
    write_config(&d, cfg);
    let args = with(&TINY, &[("--steps", "3")]);
    let plain = train(&d, &[&args[..], &["--json"]].concat());
    assert_eq!(plain.code, 0, "stderr: {}", plain.stderr);
    let timed = train(
        &d,
        &[&args[..], &["--json", "--timeline", "t.json"]].concat(),
    );
    assert_eq!(timed.code, 0, "stderr: {}", timed.stderr);
    let sha = |out: &Out| -> String {
        let v: Value = serde_json::from_str(out.stdout.trim()).unwrap();
        v["weight_sha256"].as_str().unwrap().to_owned()
    };
    assert_eq!(sha(&plain), sha(&timed));
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("t.json")).unwrap()).unwrap();
    let events = v["traceEvents"].as_array().unwrap();
    let tid = events
        .iter()
        .find(|e| e["ph"] == "M" && e["args"]["name"] == "disk: grad park")
        .map(|e| e["tid"].clone())
        .expect("a grad park lane");
    let parked = events
        .iter()
        .filter(|e| e["ph"] == "X" && e["tid"] == tid)
        .count();
    assert!(parked > 0, "no grad park busy period in the window");
}

/// The activation policy from the command line: by default (auto) both
/// blocks keep their forward graphs, said once; `--gradient-checkpointing`
/// (HF's switch) and DeepSpeed's `activation_checkpointing` block recompute
/// every block, say so in the plan, and measure nothing; all three give the
/// same weights, and the flag wins over an explicit budget with a warning.
#[test]
fn gradient_checkpointing_recomputes_every_block_with_the_same_weights() {
    let d = tiny_setup("act-cli");
    let sha = |out: &Out| -> String {
        let v: Value = serde_json::from_str(out.stdout.trim()).unwrap();
        v["weight_sha256"].as_str().unwrap().to_owned()
    };
    let json = [&TINY[..], &["--json"]].concat();
    let kept = train(&d, &json);
    assert_eq!(kept.code, 0, "{}", kept.stderr);
    assert!(
        kept.stderr
            .contains("activations: 2 of 2 blocks keep their forward graph"),
        "{}",
        kept.stderr
    );
    let ckpt = train(&d, &[&json[..], &["--gradient-checkpointing"]].concat());
    assert_eq!(ckpt.code, 0, "{}", ckpt.stderr);
    assert!(
        ckpt.stderr
            .contains("activations: every block recomputed in backward")
            && !ckpt.stderr.contains("blocks keep their forward graph"),
        "{}",
        ckpt.stderr
    );
    assert_eq!(sha(&kept), sha(&ckpt));
    // DeepSpeed's block, and the flag over an explicit budget.
    let mut cfg = ds_config(&d);
    cfg["activation_checkpointing"] = json!({"partition_activations": false});
    write_config(&d, cfg.clone());
    let block = train(&d, &json);
    assert_eq!(block.code, 0, "{}", block.stderr);
    assert!(
        block.stderr.contains("activation checkpointing on"),
        "{}",
        block.stderr
    );
    assert_eq!(sha(&block), sha(&kept));
    cfg["tierzero"]["activation_budget_bytes"] = json!("1GiB");
    write_config(&d, cfg);
    let both = train(&d, &[&json[..], &["--gradient-checkpointing"]].concat());
    assert_eq!(both.code, 0, "{}", both.stderr);
    assert!(
        both.stderr
            .contains("--gradient-checkpointing recomputes every block"),
        "{}",
        both.stderr
    );
    assert_eq!(sha(&both), sha(&kept));
}

/// `--device sim --gradient-checkpointing`: the device units recompute
/// every block, say so in the plan, count it in the metrics, and end with
/// the weights of the run that kept every block's forward.
#[test]
fn device_sim_gradient_checkpointing_recomputes_to_the_same_weights() {
    let d = tiny_setup("sim-ckpt");
    let sha = |out: &Out| -> String {
        let v: Value = serde_json::from_str(out.stdout.trim()).unwrap();
        v["weight_sha256"].as_str().unwrap().to_owned()
    };
    let args = with(&TINY, &[("--device", "sim"), ("--metrics", "m.jsonl")]);
    let args = [&args[..], &["--json"]].concat();
    let kept = train(&d, &args);
    assert_eq!(kept.code, 0, "{}", kept.stderr);
    let kept_m = metrics_lines(&d.join("m.jsonl"));
    let ckpt = train(&d, &[&args[..], &["--gradient-checkpointing"]].concat());
    assert_eq!(ckpt.code, 0, "{}", ckpt.stderr);
    assert!(
        ckpt.stderr.contains(
            "every block recomputed in backward from its input on the device \
             (activation checkpointing on"
        ),
        "{}",
        ckpt.stderr
    );
    let ckpt_m = metrics_lines(&d.join("m.jsonl"));
    assert_eq!(sha(&kept), sha(&ckpt));
    for (k, c) in kept_m.iter().zip(&ckpt_m).take(3) {
        assert_eq!(c["device_forwards_kept"].as_u64(), Some(0), "{c}");
        assert_eq!(
            c["device_forwards_recomputed"], k["device_forwards_kept"],
            "{c} {k}"
        );
        assert!(c["h2d_bytes"].as_u64() > k["h2d_bytes"].as_u64(), "{c} {k}");
    }
}

/// With a device and `offload_param: none`, the params' home is the param
/// store's host tensors (uploaded to the device, whose rows say what is
/// there): the plan shows them in the host column, as estimate counts
/// them, where it put them in the device column beside a smaller device
/// budget.
#[test]
fn a_device_s_params_home_is_shown_as_host_memory() {
    let d = tiny_setup("sim-params-none");
    let mut cfg = ds_config(&d);
    cfg["zero_optimization"]["offload_param"] = json!({"device": "none"});
    write_config(&d, cfg);
    let out = train(&d, &with(&TINY, &[("--device", "sim")]));
    assert_eq!(out.code, 0, "stdout {} stderr {}", out.stdout, out.stderr);
    let line = out
        .stdout
        .lines()
        .find(|l| {
            l.trim_start()
                .starts_with("params (home on the device: host copy)")
        })
        .unwrap_or_else(|| panic!("{}", out.stdout));
    let cells: Vec<&str> = line
        .split("copy)")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(cells.len(), 5, "{line}");
    assert_eq!((cells[0], cells[1], cells[4]), ("-", "-", "-"), "{line}");
    assert!(cells[2].parse::<f64>().is_ok(), "host bytes: {line}");
}

/// A `tierzero.device_cache_bytes` above the tier's budget is said as the
/// budget it is capped at (the plan said "64 MiB kept between uses" of an
/// 8 MiB budget).
#[test]
fn a_device_cache_above_the_budget_is_said_capped() {
    let d = tiny_setup("sim-cache-capped");
    let mut cfg = ds_config(&d);
    cfg["tierzero"]["device_budget_bytes"] = json!("8MiB");
    cfg["tierzero"]["device_cache_bytes"] = json!("64MiB");
    write_config(&d, cfg);
    let out = train(&d, &with(&TINY, &[("--device", "sim")]));
    assert_eq!(out.code, 0, "stdout {} stderr {}", out.stdout, out.stderr);
    assert!(
        out.stdout.contains(
            "8 MiB kept between uses (tierzero.device_cache_bytes 64 MiB, capped by the tier's budget)"
        ),
        "{}",
        out.stdout
    );
}

/// `--device sim`: the device tier on the simulated device, through the
/// binary. The plan shows the device's rows and total; the metrics count
/// the copies and both queues' busy time; the timeline has the device's
/// two lanes, and some copy ran while a unit computed (the upload of the
/// next unit's params overlaps this unit's compute).
#[test]
fn device_sim_shows_the_device_tier_in_the_plan_metrics_and_timeline() {
    let d = tiny_setup("sim");
    // Each unit computes at least 5 ms on the device's clock: the copies
    // of the next unit's params run inside it, where with the tiny units'
    // microseconds a loaded machine (CI's 2 cores) could order every copy
    // between two computes.
    let args = with(
        &TINY,
        &[
            ("--device", "sim"),
            ("--sim-h2d-gbps", "0.05"),
            ("--sim-compute-ms", "5"),
            ("--metrics", "m.jsonl"),
            ("--timeline", "tl.json"),
            ("--timeline-steps", "2"),
        ],
    );
    let out = train(&d, &args);
    assert_eq!(out.code, 0, "stdout {} stderr {}", out.stdout, out.stderr);
    for want in [
        "compute on simulated device",
        "at 0.05 GB/s",
        "params on the device (at most)",
        "upload staging buffers",
        "device total",
        "of a 1 GiB device budget",
        "each block's forward kept on the device for its backward",
        // A device's compute leaves candle idle, and CPU Adam's auto
        // count is half the cores.
        "host side compute not on the CPU; threads not pinned",
        &format!(
            "{} Adam thread",
            (std::thread::available_parallelism().map_or(1, |n| n.get()) / 2).max(1)
        ),
        "(--threads auto: half of",
    ] {
        assert!(out.stdout.contains(want), "{want:?} in: {}", out.stdout);
    }
    let m = metrics_lines(&d.join("m.jsonl"));
    assert_eq!(m.len(), 4, "3 steps and a summary: {m:?}");
    for s in &m[..3] {
        // auto on the simulated device: half the host's available memory,
        // which holds every block of the tiny model.
        assert!(s["device_forwards_kept"].as_u64().unwrap() > 0, "{s}");
        assert_eq!(s["device_forwards_recomputed"].as_u64(), Some(0), "{s}");
        for key in ["h2d_bytes", "d2h_bytes"] {
            assert!(s[key].as_u64().unwrap() > 0, "{key}: {s}");
        }
        for key in ["device_busy_s", "h2d_busy_s", "h2d_fill_busy_s"] {
            assert!(s[key].as_f64().unwrap() > 0.0, "{key}: {s}");
        }
    }
    metrics_summary_adds_up(&d.join("m.jsonl"), &m[..3]);
    let tl: Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("tl.json")).unwrap()).unwrap();
    let events = tl["traceEvents"].as_array().unwrap();
    let tid_of = |name: &str| {
        events
            .iter()
            .find(|e| e["ph"] == "M" && e["args"]["name"] == name)
            .map(|e| e["tid"].clone())
            .unwrap_or_else(|| panic!("no lane {name}"))
    };
    let spans = |name: &str| -> Vec<(f64, f64)> {
        let tid = tid_of(name);
        events
            .iter()
            .filter(|e| e["ph"] == "X" && e["tid"] == tid)
            .map(|e| {
                let ts = e["ts"].as_f64().unwrap();
                (ts, ts + e["dur"].as_f64().unwrap())
            })
            .collect()
    };
    let compute = spans("device: compute");
    let h2d = spans("device: h2d");
    assert!(!compute.is_empty() && !h2d.is_empty(), "{tl}");
    // The upload thread's fills have a lane of their own.
    assert!(!spans("device: staging fill (host)").is_empty(), "{tl}");
    let overlapped = h2d
        .iter()
        .any(|&(a, b)| compute.iter().any(|&(c, e)| a < e && c < b));
    assert!(
        overlapped,
        "no copy overlapped a unit's compute: {h2d:?} / {compute:?}"
    );
}

/// `scripts/metrics_summary.py --preset tier` (gpu_check's step 6f)
/// totals `steps`' device figures after the first, as summed here, and
/// `--preset offload` (step 6h) averages the third step on.
fn metrics_summary_adds_up(path: &Path, steps: &[Value]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/metrics_summary.py");
    let run = |args: &[&str]| -> Value {
        let out = std::process::Command::new("python3")
            .arg(&script)
            .arg(path)
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let tier = run(&["--preset", "tier"]);
    let sum = |key: &str| -> f64 { steps[1..].iter().map(|s| s[key].as_f64().unwrap()).sum() };
    for (name, key) in [
        ("h2d_bytes", "h2d_bytes"),
        ("d2h_bytes", "d2h_bytes"),
        ("h2d_at_use_bytes", "h2d_at_use_bytes"),
        ("device_busy_s", "device_busy_s"),
        ("h2d_busy_s", "h2d_busy_s"),
        ("wall_s", "wall_s"),
        ("forwards_ahead", "device_forwards_ahead"),
    ] {
        let got = tier[name].as_f64().unwrap();
        assert!(
            (got - sum(key)).abs() <= 1e-9 * sum(key).abs(),
            "{name}: {tier}"
        );
    }
    assert!(tier["h2d_bytes"].as_u64().unwrap() > 0, "{tier}");
    let busiest = ["device_busy_s", "h2d_busy_s", "d2h_busy_s"]
        .map(sum)
        .into_iter()
        .fold(0.0, f64::max);
    let ratio = tier["wall_over_busiest_queue"].as_f64().unwrap();
    assert!((ratio - sum("wall_s") / busiest).abs() <= 1e-3, "{tier}");
    let mean = run(&["--preset", "offload", "--steps", "3"]);
    assert_eq!(mean["steps"], json!([3]), "{mean}");
    assert_eq!(
        mean["h2d_bytes"].as_f64(),
        steps[2]["h2d_bytes"].as_f64(),
        "{mean}"
    );
}

/// `--device sim --sim-compute-ms`: the simulated device computes each
/// unit for at least that long, asynchronously, so the units launched
/// ahead show in the metrics and the plan says so.
#[test]
fn device_sim_with_a_compute_time_launches_units_ahead() {
    let d = tiny_setup("sim-compute");
    let args = with(
        &TINY,
        &[
            ("--device", "sim"),
            ("--sim-compute-ms", "10"),
            ("--metrics", "m.jsonl"),
        ],
    );
    let out = train(&d, &args);
    assert_eq!(out.code, 0, "stdout {} stderr {}", out.stdout, out.stderr);
    assert!(
        out.stdout
            .contains("each unit at least 10ms on its own clock"),
        "{}",
        out.stdout
    );
    let m = metrics_lines(&d.join("m.jsonl"));
    let steps: Vec<&Value> = m.iter().filter(|l| l.get("step").is_some()).collect();
    assert!(!steps.is_empty());
    let sum = |key: &str| -> u64 { steps.iter().map(|l| l[key].as_u64().unwrap()).sum() };
    let (fwd, bwd) = (sum("device_forwards_ahead"), sum("device_backwards_ahead"));
    println!(
        "{} steps: {fwd} forwards and {bwd} backwards launched ahead",
        m.len()
    );
    assert!(fwd > 0 && bwd > 0, "forwards {fwd}, backwards {bwd}");
}

/// `--device sim` with params in the cpu tier: the plan says their pinned
/// pages are registered with the device, and the metrics show their bytes
/// crossing in place (`h2d_direct_bytes`); with params on NVMe (no pages)
/// the plan says the swap buffers are registered instead, and params
/// cross from the buffers their reads landed in.
#[test]
fn device_sim_uploads_params_from_their_registered_pages_and_swap_buffers() {
    let d = tiny_setup("sim-pages");
    let mut cfg = ds_config(&d);
    cfg["zero_optimization"]["offload_param"] = json!({"device": "cpu"});
    write_config(&d, cfg);
    let args = with(&TINY, &[("--device", "sim"), ("--metrics", "m.jsonl")]);
    let out = train(&d, &args);
    assert_eq!(out.code, 0, "stdout {} stderr {}", out.stdout, out.stderr);
    assert!(
        out.stdout.contains("pinned pages") && out.stdout.contains("registered with the device"),
        "{}",
        out.stdout
    );
    let m = metrics_lines(&d.join("m.jsonl"));
    let steps: Vec<&Value> = m.iter().filter(|l| l.get("step").is_some()).collect();
    let sum = |key: &str| -> u64 { steps.iter().map(|l| l[key].as_u64().unwrap()).sum() };
    let (direct, h2d) = (sum("h2d_direct_bytes"), sum("h2d_bytes"));
    println!(
        "{} steps: {direct} of {h2d} bytes uploaded in place",
        steps.len()
    );
    // Every param lives in a page; the units' inputs here stay on the
    // device (the unit before's outputs), so nearly all that crosses is
    // in place.
    assert!(direct > 0 && direct <= h2d, "in place {direct} of {h2d}");

    assert!(
        !out.stdout
            .contains("registered with the device: a param crosses"),
        "{}",
        out.stdout
    );

    let d = tiny_setup("sim-pages-nvme");
    let out = train(&d, &args);
    assert_eq!(out.code, 0, "stdout {} stderr {}", out.stdout, out.stderr);
    assert!(!out.stdout.contains("pinned pages"), "{}", out.stdout);
    assert!(
        out.stdout.contains("the param swap buffers (")
            && out
                .stdout
                .contains("crosses from the buffer its read landed in"),
        "{}",
        out.stdout
    );
    let m = metrics_lines(&d.join("m.jsonl"));
    let steps: Vec<&Value> = m.iter().filter(|l| l.get("step").is_some()).collect();
    let sum = |key: &str| -> u64 { steps.iter().map(|l| l[key].as_u64().unwrap()).sum() };
    let (direct, h2d, let_go) = (
        sum("h2d_direct_bytes"),
        sum("h2d_bytes"),
        sum("param_buffers_let_go"),
    );
    println!(
        "nvme, {} steps: {direct} of {h2d} bytes uploaded in place, {let_go} kept buffers let go",
        steps.len()
    );
    assert!(direct > 0 && direct <= h2d, "in place {direct} of {h2d}");
    // Said once, at the first step that let most of its kept buffers go.
    let short = steps.iter().position(|l| {
        let (kept, let_go) = (
            l["param_buffers_kept"].as_u64().unwrap(),
            l["param_buffers_let_go"].as_u64().unwrap(),
        );
        kept >= 8 && let_go * 2 > kept
    });
    let said = out
        .stderr
        .matches("offload_param.buffer_count (now")
        .count();
    println!("buffers short at step {short:?}, said {said} time(s)");
    assert_eq!(said, usize::from(short.is_some()), "{}", out.stderr);
    if let Some(i) = short {
        let step = steps[i]["step"].as_u64().unwrap();
        assert!(
            out.stderr.contains(&format!("step {step}: ")),
            "{}",
            out.stderr
        );
    }
}

#[test]
fn device_sim_refuses_what_it_cannot_use() {
    let d = tiny_setup("sim-bad");
    assert_bad(
        &d,
        &with(&TINY, &[("--sim-h2d-gbps", "10")]),
        &["--sim-h2d-gbps", "--device sim"],
    );
    // 1e-300 GB/s passed a "> 0" check, then overflowed the copy's time
    // and panicked the copy thread: the run hung.
    for gbps in ["0", "1e-300", "0.0009", "10001"] {
        assert_bad(
            &d,
            &with(&TINY, &[("--device", "sim"), ("--sim-h2d-gbps", gbps)]),
            &[&format!("--sim-h2d-gbps {gbps}"), "GB/s from 0.001"],
        );
    }
    // A device budget below the largest unit's params: refused at
    // start-up with the least that runs (it failed the first step as an
    // internal error, exit 1, advising a prefetch setting).
    let mut cfg = ds_config(&d);
    cfg["tierzero"]["device_budget_bytes"] = json!(1024);
    std::fs::write(d.join("sim-budget.json"), cfg.to_string()).unwrap();
    assert_bad(
        &d,
        &with(
            &TINY,
            &[("--device", "sim"), ("--config", "sim-budget.json")],
        ),
        &[
            "largest unit needs",
            "budget for params is 1024 bytes",
            "at least",
        ],
    );
    assert_bad(
        &d,
        &with(&TINY, &[("--sim-compute-ms", "5")]),
        &["--sim-compute-ms", "--device sim"],
    );
    for ms in ["nan", "1e9", "fast"] {
        assert_bad(
            &d,
            &with(&TINY, &[("--device", "sim"), ("--sim-compute-ms", ms)]),
            &[&format!("--sim-compute-ms {ms}"), "milliseconds"],
        );
    }
    assert_bad(
        &d,
        &with(&TINY, &[("--device", "simulated")]),
        &["--device simulated", "or sim"],
    );
}

/// `--device sim` with `fp16.enabled` (refused before the device units had
/// fp16): it trains with fp16 GEMMs, the optimizer on the host, its
/// losses within 1e-3 of the CPU's fp16 run, skipping the same steps.
#[test]
fn device_sim_trains_fp16_with_the_optimizer_on_the_host() {
    let d = tiny_setup("sim-fp16");
    let mut cfg = ds_config(&d);
    cfg["fp16"] = json!({"enabled": true, "initial_scale_power": 14});
    write_config(&d, cfg);
    let losses = |device: &str, file: &str| -> Vec<(f64, bool)> {
        let args = with(&TINY, &[("--device", device), ("--metrics", file)]);
        let out = train(&d, &args);
        assert_eq!(out.code, 0, "stdout {} stderr {}", out.stdout, out.stderr);
        if device == "sim" {
            assert!(out.stdout.contains("F16 GEMMs"), "{}", out.stdout);
        }
        metrics_lines(&d.join(file))
            .iter()
            .filter(|l| l.get("step").is_some())
            .map(|l| (l["loss"].as_f64().unwrap(), l["skipped"].as_bool().unwrap()))
            .collect()
    };
    let sim = losses("sim", "sim.jsonl");
    let cpu = losses("cpu", "cpu.jsonl");
    println!("fp16 (loss, skipped): sim {sim:?}, cpu {cpu:?}");
    assert_eq!(sim.len(), cpu.len());
    assert!(sim.iter().any(|s| !s.1), "every step overflowed: {sim:?}");
    for ((a, sa), (b, sb)) in sim.iter().zip(&cpu) {
        assert_eq!(sa, sb, "skips differ: {sim:?} vs {cpu:?}");
        assert!(((a - b) / b).abs() < 1e-3, "{sim:?} vs {cpu:?}");
    }
}

/// `--device sim` with `bf16.enabled`: bf16 GEMMs on bf16 params, and a
/// loss within 1e-3 of the CPU's bf16 run.
#[test]
fn device_sim_trains_bf16() {
    let d = tiny_setup("sim-bf16");
    let mut cfg = ds_config(&d);
    cfg["bf16"] = json!({"enabled": true});
    write_config(&d, cfg);
    let mut loss = Vec::new();
    for dev in ["sim", "cpu"] {
        let args = with(&TINY, &[("--device", dev)]);
        let out = train(&d, &[&args[..], &["--json"]].concat());
        assert_eq!(
            out.code, 0,
            "{dev}: stdout {} stderr {}",
            out.stdout, out.stderr
        );
        if dev == "sim" {
            assert!(out.stderr.contains("Bf16 GEMMs"), "{}", out.stderr);
        }
        let v: Value = serde_json::from_str(out.stdout.trim()).unwrap();
        loss.push(v["final_loss"].as_f64().unwrap_or_else(|| panic!("{v}")));
    }
    let rel = ((loss[0] - loss[1]) / loss[1]).abs();
    assert!(rel < 1e-3, "sim {} vs cpu {}", loss[0], loss[1]);
}

/// `--device sim` with nothing offloaded trains in device memory: the
/// plan shows the device's state rows (params, moments, gradients), the
/// loss is within 1e-3 of the CPU's, and a device too small for the state
/// is refused with the fix.
#[test]
fn device_sim_with_nothing_offloaded_trains_in_device_memory() {
    let d = tiny_setup("sim-resident");
    let mut cfg = ds_config(&d);
    cfg["zero_optimization"] = json!({"stage": 2});
    write_config(&d, cfg.clone());
    let mut loss = Vec::new();
    for dev in ["sim", "cpu"] {
        let args = with(&TINY, &[("--device", dev)]);
        let out = train(&d, &args);
        assert_eq!(
            out.code, 0,
            "{dev}: stdout {} stderr {}",
            out.stdout, out.stderr
        );
        if dev == "sim" {
            for want in [
                "AdamW resident on the device",
                "params, resident",
                "Adam moments (m, v), fp32",
                "gradients (the step's sums)",
                "device total",
            ] {
                assert!(out.stdout.contains(want), "{want:?} in: {}", out.stdout);
            }
            // The host's grads row holds nothing: the device sums them.
            let row = out
                .stdout
                .lines()
                .find(|l| l.contains("grads (summed on the device, below)"))
                .unwrap_or_else(|| panic!("no device grads row in: {}", out.stdout));
            assert!(row.split_whitespace().skip(6).all(|c| c == "-"), "{row}");
        }
        let json_out = train(&d, &[&args[..], &["--json"]].concat());
        let v: Value = serde_json::from_str(json_out.stdout.trim()).unwrap();
        loss.push(v["final_loss"].as_f64().unwrap_or_else(|| panic!("{v}")));
    }
    let rel = ((loss[0] - loss[1]) / loss[1]).abs();
    assert!(rel < 1e-3, "sim {} vs cpu {}", loss[0], loss[1]);

    cfg["tierzero"] = json!({"device_budget_bytes": 65536});
    write_config(&d, cfg.clone());
    let args = with(&TINY, &[("--device", "sim")]);
    assert_bad(
        &d,
        &args,
        &[
            "--device sim",
            "are left after start-up",
            "offload_optimizer.device",
        ],
    );
    // The shortfall it names is exact: that much more trains, one byte
    // less is refused again.
    let err = train(&d, &args).stderr;
    let more: u64 = err
        .split("device_budget_bytes by at least ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no shortfall in: {err}"));
    cfg["tierzero"] = json!({"device_budget_bytes": 65536 + more - 1});
    write_config(&d, cfg.clone());
    assert_eq!(train(&d, &args).code, 2);
    cfg["tierzero"] = json!({"device_budget_bytes": 65536 + more});
    write_config(&d, cfg);
    let out = train(&d, &args);
    assert_eq!(out.code, 0, "{}", out.stderr);
}

/// A Mistral whose sliding window is at least the sequence never cuts a
/// key off: `--device sim` (the device units) trains it, to the bits of
/// the same model without a window; a window shorter than the sequence,
/// which the device units do not implement, is refused naming both and
/// the longest sequence that runs. (Mistral-7B-v0.1's window of 4096 was
/// refused at every `--seq-len`.)
#[test]
fn device_sim_trains_a_mistral_whose_window_spans_the_sequence() {
    let d = tiny_setup("sim-mistral");
    let model = |dir: &str, window: Option<u64>| {
        let mut cfg = json!({"model_type": "mistral", "vocab_size": 256, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "max_position_embeddings": 32, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": false});
        cfg["sliding_window"] = json!(window);
        std::fs::create_dir_all(d.join(dir)).unwrap();
        std::fs::write(d.join(dir).join("config.json"), cfg.to_string()).unwrap();
    };
    model("window16", Some(16));
    model("nowindow", None);
    model("window8", Some(8));
    let sha = |dir: &str| -> String {
        let args = with(&TINY, &[("--device", "sim"), ("--model", dir)]);
        let out = train(&d, &[&args[..], &["--json"]].concat());
        assert_eq!(out.code, 0, "{dir}: {}", out.stderr);
        let v: Value = serde_json::from_str(out.stdout.trim()).unwrap();
        v["weight_sha256"].as_str().unwrap().to_owned()
    };
    assert_eq!(sha("window16"), sha("nowindow"));
    assert_bad(
        &d,
        &with(&TINY, &[("--device", "sim"), ("--model", "window8")]),
        &[
            "a sliding attention window of 8 tokens shorter than the sequence (16",
            "a sequence of at most 8 tokens",
        ],
    );
}

/// fp16's loss scale at its floor with the gradients still overflowing
/// ends the run as DeepSpeed's does, as the user's to fix (exit 2, the
/// fixes named), not as an internal error (it was exit 1, "internal
/// error:"). An init of standard deviation 3000 overflows every step.
#[test]
fn the_loss_scale_at_its_minimum_is_exit_2_with_the_fixes() {
    let d = tiny_setup("min-scale");
    let model = json!({"model_type": "gpt2", "vocab_size": 256, "n_positions": 32,
        "n_embd": 32, "n_layer": 2, "n_head": 2, "tie_word_embeddings": true,
        "initializer_range": 3000.0});
    std::fs::write(d.join("model/config.json"), model.to_string()).unwrap();
    let mut cfg = ds_config(&d);
    cfg["fp16"] = json!({"enabled": true, "initial_scale_power": 1, "min_loss_scale": 1,
        "hysteresis": 1});
    write_config(&d, cfg);
    let out = train(&d, &with(&TINY, &[("--steps", "6")]));
    assert_eq!(out.code, 2, "stdout {} stderr {}", out.stdout, out.stderr);
    let last = out.stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: ") && last.contains("minimum loss scale 1"),
        "{}",
        out.stderr
    );
}

/// A metrics file that cannot be written (a full disk: /dev/full) stops
/// the metrics, not the run: it trains to its end and saves, then exits 2
/// naming the file (the first failed write ended the run with no
/// checkpoint, every step since the last save lost).
#[test]
fn a_metrics_file_that_cannot_be_written_does_not_end_the_run() {
    if !Path::new("/dev/full").exists() {
        cli_support::skipped("no /dev/full");
        return;
    }
    let d = tiny_setup("metrics-full");
    let mut args = TINY.to_vec();
    args.extend(["--metrics", "/dev/full", "--save-dir", "ck"]);
    let out = train(&d, &args);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr
            .contains("--metrics: writing /dev/full: No space left on device")
            && out.stderr.contains("the run went on to its end"),
        "{}",
        out.stderr
    );
    assert!(
        out.stdout.contains("checkpoint: step 3 saved"),
        "{}",
        out.stdout
    );
    assert_eq!(
        tierzero::checkpoint::latest_step(&d.join("ck")),
        Some(3),
        "{}",
        out.stderr
    );
}

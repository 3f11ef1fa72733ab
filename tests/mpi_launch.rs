//! `tierzero launch --nproc 2 -- train ...` (feature `mpi`; needs OpenMPI):
//! two ranks through mpirun; rank 0 alone prints the summary and writes the
//! metrics; each rank keeps its swap files under `<nvme_path>/rank<R>/`.
#![cfg(feature = "mpi")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: a failed unwrap is a failed test"
)]

mod cli_support;
mod engine_support;

use std::process::Command;

use engine_support::{ds_config, scratch, tierzero, Knobs};
use serde_json::{json, Value};

/// A 2-layer GPT-2 of width 32 (`tied` embeddings or not) in `dir/model`.
fn model_in(dir: &std::path::Path, tied: bool) -> std::path::PathBuf {
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    let cfg = json!({
        "model_type": "gpt2", "vocab_size": 256, "n_positions": 32, "n_embd": 32,
        "n_layer": 2, "n_head": 2, "n_inner": 64, "tie_word_embeddings": tied
    });
    std::fs::write(model.join("config.json"), cfg.to_string()).unwrap();
    model
}

/// The command `tierzero launch --nproc 2 -- train` of a 2-layer GPT-2 of
/// width 32 (`tied` embeddings or not) for `steps` steps (the config's
/// schedule too), stage 3 on NVMe, with `extra` arguments, set up in a
/// fresh dir `tag` (its working directory); also the dir, the metrics'
/// path and the swap folder.
fn launch_command(
    tag: &str,
    tied: bool,
    steps: u64,
    extra: &[&str],
) -> (
    Command,
    std::path::PathBuf,
    std::path::PathBuf,
    std::path::PathBuf,
) {
    let dir = scratch(tag);
    let model = model_in(&dir, tied);
    let swap = dir.join("swap");
    std::fs::create_dir_all(&swap).unwrap();
    let ds_path = dir.join("ds_config.json");
    std::fs::write(
        &ds_path,
        ds_config(&Knobs::nvme(), &swap, steps).to_string(),
    )
    .unwrap();
    let metrics = dir.join("metrics.jsonl");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tierzero"));
    cmd.args(["launch", "--nproc", "2", "--", "train", "--steps"])
        .arg(steps.to_string())
        .args(["--seq-len", "16"])
        .args(extra)
        .arg("--model")
        .arg(&model)
        .arg("--config")
        .arg(&ds_path)
        .arg("--metrics")
        .arg(&metrics)
        .current_dir(&dir);
    (cmd, dir, metrics, swap)
}

/// [`launch_command`] run to its end: its output, the metrics' path and
/// the swap folder.
fn launch(
    tag: &str,
    tied: bool,
    steps: u64,
    extra: &[&str],
) -> (std::process::Output, std::path::PathBuf, std::path::PathBuf) {
    let (mut cmd, _, metrics, swap) = launch_command(tag, tied, steps, extra);
    let out = cmd.output().expect("run tierzero launch");
    (out, metrics, swap)
}

#[test]
fn launch_runs_two_ranks_and_rank_0_writes_the_metrics() {
    let (out, metrics, swap) = launch("launch", true, 3, &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    // One summary (rank 0's), naming the ranks; 2 ranks x micro 2 = 4 sequences.
    assert_eq!(stdout.matches("weight_sha256:").count(), 1, "{stdout}");
    assert!(stdout.contains("2 ranks"), "{stdout}");
    assert!(stdout.contains("3 steps x 4 sequences"), "{stdout}");
    let lines: Vec<Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 4, "3 steps and the summary, written once");
    assert_eq!(lines[3]["summary"], json!(true));
    for r in 0..2 {
        let d = swap.join(format!("rank{r}"));
        assert!(d.is_dir(), "{} missing", d.display());
    }
}

#[test]
fn launch_with_the_simulated_device_gathers_and_reduces_on_it() {
    // `tierzero launch --nproc 2 -- train --device sim`: each rank's
    // simulated device gets the ranks' collectives, so the params cross as
    // shards and are gathered there and the gradients are reduce-scattered
    // there. The plan says so, and the metrics show its collectives busy
    // and params copied in place from the registered swap buffers.
    let (out, metrics, _) = launch("launch-sim", false, 2, &["--device", "sim"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        stdout.contains("params gathered and gradients reduce-scattered on the device"),
        "{stdout}"
    );
    let steps: Vec<Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|l| l.get("summary").is_none())
        .collect();
    assert_eq!(steps.len(), 2);
    for s in &steps {
        assert!(s["collective_busy_s"].as_f64().unwrap() > 0.0, "{s}");
        assert!(s["h2d_direct_bytes"].as_u64().unwrap() > 0, "{s}");
        assert_eq!(s["param_gathers"].as_u64().unwrap(), 0, "{s}");
    }
}

#[test]
fn nothing_offloaded_on_two_simulated_devices_trains_adam_there_and_resumes() {
    for (stage, says) in [
        (
            3u8,
            "params, AdamW's state and the gradients' sums sharded on 2 ranks' devices",
        ),
        (2, "params whole on each of 2 ranks' devices, AdamW's state"),
    ] {
        resident_launch_case(stage, says);
    }
}

/// [`nothing_offloaded_on_two_simulated_devices_trains_adam_there_and_resumes`]
/// at `stage`, whose plan `says` so.
fn resident_launch_case(stage: u8, says: &str) {
    // `tierzero launch --nproc 2 -- train --device sim` with nothing
    // offloaded: each rank's device holds its shard of Adam's state, and
    // at stage 3 of the params too, each unit's gathered there for it
    // (the plan says which). Three steps with a
    // checkpoint (the devices' state written back), then three more
    // resumed from it on two ranks (loaded into the devices again): the
    // weights of one rank's uninterrupted six steps on its simulated
    // device, with the same global batch.
    let dir = scratch(&format!("launch-resident-s{stage}"));
    let model = model_in(&dir, true);
    let write_cfg = |name: &str, gas: u64| {
        let k = Knobs {
            stage,
            gas,
            precision: "bf16",
            ..Knobs::default()
        };
        let p = dir.join(name);
        std::fs::write(&p, ds_config(&k, &dir.join("swap"), 6).to_string()).unwrap();
        p.to_str().unwrap().to_owned()
    };
    let (cfg2, cfg1) = (write_cfg("ds2.json", 1), write_cfg("ds1.json", 2));
    let save = dir.join("ckpt");
    let (model, save) = (model.to_str().unwrap(), save.to_str().unwrap());
    let common = ["--seq-len", "16", "--device", "sim", "--model", model];
    let mut first = vec!["launch", "--nproc", "2", "--", "train", "--steps", "3"];
    first.extend(common);
    first.extend(["--config", &cfg2, "--save-dir", save]);
    let planned = tierzero(&first);
    assert!(planned.contains(says), "{planned}");
    assert!(planned.contains("this rank's shard"), "{planned}");
    let sha = |stdout: &str| -> String {
        let v: Value = serde_json::from_str(stdout.trim()).unwrap();
        v["weight_sha256"].as_str().unwrap().to_owned()
    };
    let mut resumed = vec!["launch", "--nproc", "2", "--", "train", "--steps", "6"];
    resumed.extend(common);
    resumed.extend(["--config", &cfg2, "--resume", save]);
    let resumed = tierzero(&resumed);
    // The checkpoint's state went into the devices again, sharded.
    assert!(resumed.contains(says), "{resumed}");
    let resumed_sha = resumed
        .lines()
        .find_map(|l| l.strip_prefix("weight_sha256: "))
        .unwrap_or_else(|| panic!("no weight_sha256 line: {resumed}"))
        .trim()
        .to_owned();
    let mut whole = vec!["train", "--steps", "6", "--config", &cfg1, "--json"];
    whole.extend(common);
    let whole = tierzero(&whole);
    assert_eq!(
        resumed_sha,
        sha(&whole),
        "stage {stage}: 2 ranks with a checkpoint between -> 1 rank uninterrupted"
    );
}

/// A SIGINT to the launcher alone (a terminal's Ctrl-C reaches only it:
/// mpirun runs in its own process group) stops both ranks after a step
/// and saves it: the launcher passes it to mpirun as SIGUSR1, which mpirun
/// forwards. (Sent to mpirun as SIGINT, mpirun killed the ranks 1 s after
/// a SIGTERM, before any save; sent to the launcher as SIGTERM, nothing
/// reached the ranks.)
/// [`launch_command`] (tied) started with stdout and stderr piped,
/// returned once rank 0 has written `lines` steps' metrics; also its dir.
fn launched_until(
    tag: &str,
    steps: u64,
    extra: &[&str],
    lines: usize,
) -> (std::process::Child, std::path::PathBuf) {
    let (cmd, dir, metrics, _) = launch_command(tag, true, steps, extra);
    // (Under nohup, as a CI job may run, SIGHUP would stay ignored.)
    let mut cmd = cli_support::hup_at_default(&cmd);
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run tierzero launch");
    let t0 = std::time::Instant::now();
    while std::fs::read_to_string(&metrics).map_or(0, |t| t.lines().count()) < lines {
        assert!(child.try_wait().unwrap().is_none(), "{tag}: ended early");
        assert!(t0.elapsed().as_secs() < 120, "{tag}: no step");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    (child, dir)
}

#[test]
fn a_signal_to_the_launcher_stops_the_ranks_at_a_step_and_saves() {
    // A SIGHUP reaches the ranks as a SIGTERM (mpirun passes on two
    // signals), and the launcher exits with the code of what it got.
    for (sig, code, name) in [
        ("INT", 130, "SIGINT"),
        ("TERM", 143, "SIGTERM"),
        ("HUP", 129, "SIGTERM"),
    ] {
        let (child, dir) = launched_until(
            &format!("launch-stop-{sig}"),
            400,
            &["--json", "--save-dir", "ck"],
            2,
        );
        let ck = dir.join("ck");
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok);
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{sig}: {stderr}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout
            .lines()
            .find(|l| l.starts_with('{'))
            .unwrap_or_else(|| panic!("{stdout}\n{stderr}"));
        let s: Value = serde_json::from_str(line).unwrap();
        assert_eq!(s["stop_signal"], json!(name), "{sig}: {s}");
        let step = s["steps"].as_u64().unwrap();
        assert!((2..400).contains(&step), "{sig}: {step}");
        assert_eq!(s["checkpoint_step"].as_u64(), Some(step), "{sig}: {s}");
        let c = tierzero::checkpoint::Checkpoint::open(&ck).unwrap();
        assert_eq!((c.step(), c.manifest().world_size), (step, 2), "{sig}");
        assert!(c.verify().ok(), "{sig}");
        eprintln!("SIG{sig} to the launcher: exit {code}, both ranks saved step {step}");
    }
}

/// mpirun does not outlive a launcher killed outright (SIGKILL, the OOM
/// killer): it gets SIGINT, its abort, when the launcher dies
/// (PR_SET_PDEATHSIG), and its ranks go with it. mpirun runs in a process
/// group of its own, so nothing else would reach it.
#[test]
fn mpirun_goes_when_the_launcher_is_killed() {
    let (mut child, _) = launched_until("launch-killed", 1_000_000, &[], 1);
    // The launcher's children: mpirun.
    let launcher = child.id();
    let children: Vec<u32> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
                // pid (comm) state ppid ...: after the last ')'.
                s.rsplit_once(") ")
                    .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok())
                    == Some(launcher)
            })
        })
        .collect();
    assert!(!children.is_empty(), "no mpirun under the launcher");
    child.kill().unwrap();
    child.wait().unwrap();
    let gone = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
            s.rsplit_once(") ").is_some_and(|(_, r)| r.starts_with('Z'))
        })
    };
    let t0 = std::time::Instant::now();
    while !children.iter().all(|p| gone(*p)) {
        assert!(
            t0.elapsed().as_secs() < 30,
            "mpirun {children:?} outlived its launcher"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Two ranks started by hand with different flags (mpirun's `A : B`
/// form, as two nodes with different command lines or configs would be):
/// refused at start-up by every rank, naming the setting and each rank's
/// value, exit 2, no hang. A different `--steps` used to corrupt rank 0's
/// heap (its final gather met rank 1's param gather), a different
/// `--grad-accum` hung until the collective timeout, and a different
/// `--seed` trained a mix of two models and exited 0.
#[test]
fn ranks_started_with_different_settings_are_refused_naming_the_setting() {
    // (tag, rank 0's flags, rank 1's, what the refusal says)
    let cases: [(&str, &[&str], &[&str], &str); 7] = [
        (
            "steps",
            &["--steps", "3"],
            &["--steps", "4"],
            "the run's steps (--steps) is 3 on rank 0, 4 on rank 1",
        ),
        (
            "seed",
            &["--seed", "1"],
            &["--seed", "2"],
            "the init seed (--seed) is 1 on rank 0, 2 on rank 1",
        ),
        (
            "accum",
            &["--grad-accum", "1"],
            &["--grad-accum", "2"],
            "is train_batch_size 4 = micro-batch 2 x accumulation 1 x 2 ranks on rank 0, \
             train_batch_size 8 = micro-batch 2 x accumulation 2 x 2 ranks on rank 1",
        ),
        // --resume on one rank alone: it waited in a collective the other
        // never made, then blamed a dead rank.
        (
            "resume",
            &["--steps", "3", "--resume", "ck"],
            &["--steps", "3"],
            "the step resumed from (--resume) is step 1 on rank 0, none on rank 1",
        ),
        // The simulated device on one rank alone: its collectives met the
        // other's, whose settings' bytes it printed as a message.
        (
            "device",
            &["--steps", "3", "--device", "sim"],
            &["--steps", "3"],
            "the compute device (--device) is sim on rank 0, cpu on rank 1",
        ),
        // Two corpora of one length, and two models of one config.json (a
        // node's stale copy): each trained a mix and exited 0.
        (
            "data",
            &["--steps", "3", "--data", "a.txt"],
            &["--steps", "3", "--data", "b.txt"],
            "the data's token ids (their crc32c) is ",
        ),
        (
            "weights",
            &["--steps", "3"],
            &["--steps", "3", "--model", "trained"],
            "the weights of wte.weight (the crc32c of its values) is ",
        ),
    ];
    for (tag, a, b, says) in cases {
        let (_, dir, _, _) = launch_command(&format!("disagree-{tag}"), true, 4, &[]);
        let ds = json!({
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": "auto",
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3}
        });
        std::fs::write(dir.join("ds.json"), ds.to_string()).unwrap();
        let run = |args: &[&str]| {
            let out = Command::new(env!("CARGO_BIN_EXE_tierzero"))
                .args(args)
                .current_dir(&dir)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let one_step = [
            "train",
            "--seq-len",
            "16",
            "--config",
            "ds.json",
            "--model",
            "model",
            "--grad-accum",
            "2",
            "--steps",
            "1",
            "--save-dir",
            "ck",
        ];
        match tag {
            "resume" => run(&one_step),
            "data" => {
                let text = |seed: u32| -> Vec<u8> {
                    (0..4000u32)
                        .map(|i| b'a' + ((i * 7 + seed) % 26) as u8)
                        .collect()
                };
                std::fs::write(dir.join("a.txt"), text(0)).unwrap();
                std::fs::write(dir.join("b.txt"), text(1)).unwrap();
            }
            "weights" => {
                // The same config.json beside other weights.
                run(&one_step);
                run(&[
                    "export",
                    "--checkpoint",
                    "ck",
                    "--out",
                    "exported/model.safetensors",
                ]);
                std::fs::create_dir_all(dir.join("trained")).unwrap();
                std::fs::copy(
                    dir.join("exported/model.safetensors"),
                    dir.join("trained/model.safetensors"),
                )
                .unwrap();
                std::fs::copy(
                    dir.join("model/config.json"),
                    dir.join("trained/config.json"),
                )
                .unwrap();
            }
            _ => {}
        }
        let mut cmd = Command::new("mpirun");
        cmd.args(["--oversubscribe", "--bind-to", "none"])
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .env("TIERZERO_COMM_TIMEOUT_S", "60")
            .current_dir(&dir);
        for (i, flags) in [a, b].into_iter().enumerate() {
            if i > 0 {
                cmd.arg(":");
            }
            let model = if flags.contains(&"--model") {
                &[][..]
            } else {
                &["--model", "model"][..]
            };
            cmd.args(["-np", "1", env!("CARGO_BIN_EXE_tierzero"), "train"])
                .args(["--seq-len", "16", "--config", "ds.json"])
                .args(model)
                .args(flags);
        }
        let started = std::time::Instant::now();
        let out = cmd.output().expect("run mpirun");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{tag}: {stderr}");
        assert!(
            stderr.contains("the ranks were started with different settings: ")
                && stderr.contains(says),
            "{tag}: {stderr}"
        );
        assert!(
            started.elapsed() < std::time::Duration::from_secs(50),
            "{tag}: took {:?}, a collective waited",
            started.elapsed()
        );
        assert!(
            !stderr.contains("malloc") && !stderr.contains("exited on signal"),
            "{tag}: {stderr}"
        );
    }
}

/// `tierzero launch` exits with mpirun's code, whatever it is (a rank
/// killed by SIGKILL: mpirun's 137), with one line saying so; it was exit
/// 1 and "internal error" for every code but 0, 2, 130 and 143.
#[test]
fn launch_exits_with_mpirun_s_code() {
    let d = scratch("mpirun-code");
    let fake = d.join("mpirun");
    std::fs::write(&fake, "#!/bin/sh\nexit 137\n").unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tierzero"))
        .args(["launch", "--nproc", "2", "--mpirun"])
        .arg(&fake)
        .args(["--", "train", "--steps", "1"])
        .current_dir(&d)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(137), "{stderr}");
    assert!(
        stderr.contains("tierzero launch: mpirun exited with 137"),
        "{stderr}"
    );
    assert!(!stderr.contains("internal error"), "{stderr}");
}

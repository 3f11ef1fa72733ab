//! Checkpoints of several ranks (feature `mpi`; needs OpenMPI's `mpirun`):
//! every rank writes its own shard into one checkpoint, rank 0 the manifest
//! last; a checkpoint of N ranks resumes on M ranks (each loads its own
//! shard of every parameter) and `export` consolidates the shards.
//!
//! The reference is one rank in this process with the same global batch
//! (N ranks with accumulation G read the same rows as one rank with G·N and
//! do the same arithmetic, `tests/mpi_equivalence.rs`), so every comparison
//! here is bit-for-bit: no clipping, fp32, untied model.
//!
//! Each phase with several ranks starts `mpirun -np N` on this binary's
//! ignored [`rank_main`], which trains (from the model or from a
//! checkpoint) with an `MpiComm`, optionally saves mid-run and at the end,
//! and writes its losses and weight hash to a JSON file per rank.
#![cfg(feature = "mpi")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: a failed unwrap is a failed test"
)]

mod engine_support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use candle_core::DType;
use engine_support::{corpus, ds_config, scratch, tierzero, Knobs};
use serde_json::{json, Value};
use tierzero::checkpoint::{export_safetensors, Checkpoint};
use tierzero::config::{load_str, PathChecks, RunContext};
use tierzero::engine::comm::mpi::MpiComm;
use tierzero::engine::{Comm, SingleRank, Trainer, TrainerOptions};
use tierzero::model::ModelDir;

const SEQ: usize = 16;
const SEED: u64 = 5;
/// Steps of every run (the lr schedule's total).
const TOTAL: u64 = 6;
/// Where the runs are split.
const SPLIT: u64 = 3;

/// A GPT-2 with byte vocabulary, 2 layers of width 32, untied.
fn model_dir(tag: &str) -> PathBuf {
    let d = scratch(&format!("mck-model-{tag}"));
    let cfg = json!({
        "model_type": "gpt2", "vocab_size": 256, "n_positions": 32, "n_embd": 32,
        "n_layer": 2, "n_head": 2, "n_inner": 64, "tie_word_embeddings": false
    });
    std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
    d
}

/// Stage 3, params and optimizer state on NVMe, per-rank accumulation
/// `gas`; consolidated 16-bit weights saved with every checkpoint.
fn config(gas: u64, swap: &Path) -> Value {
    let knobs = Knobs {
        gas,
        ..Knobs::nvme()
    };
    let mut cfg = ds_config(&knobs, swap, TOTAL);
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = json!(true);
    cfg
}

/// What a run did: per-step losses (bits), final weight hash; or the
/// error of a save that failed (the run stops there).
#[derive(Debug, Clone, PartialEq)]
struct Out {
    losses: Vec<u32>,
    sha256: String,
    save_error: Option<String>,
}

/// What to run: from `resume` (a checkpoint) or the model, until step
/// `TOTAL`, saving into `save_dir` at `save_at` steps.
#[derive(Debug, Clone)]
struct Plan {
    cfg: Value,
    model: PathBuf,
    resume: Option<PathBuf>,
    save_dir: Option<PathBuf>,
    save_at: Vec<u64>,
}

fn run(plan: &Plan, comm: Arc<dyn Comm>) -> Out {
    let run = RunContext {
        ranks: comm.world_size() as u64,
        path_checks: PathChecks::CreateMissing,
        ..RunContext::default()
    };
    let loaded = load_str(&plan.cfg.to_string(), &run).unwrap();
    let mut opts = TrainerOptions::cpu(SEED, SEQ);
    opts.comm = comm;
    let mut t = match &plan.resume {
        Some(dir) => {
            let c = Checkpoint::open(dir).unwrap();
            Trainer::resume(&loaded.config, &c, corpus(), opts).unwrap()
        }
        None => {
            let md = ModelDir::open(&plan.model, SEED).unwrap();
            Trainer::new(&loaded.config, &md, corpus(), opts).unwrap()
        }
    };
    let mut losses = Vec::new();
    while t.steps_done() < TOTAL {
        losses.push(t.step().unwrap().metrics.loss.to_bits());
        if plan.save_at.contains(&t.steps_done()) {
            let dir = plan.save_dir.as_ref().unwrap();
            match t.save_checkpoint(dir) {
                Ok(step_dir) => {
                    assert!(step_dir.ends_with(format!("step-{:08}", t.steps_done())))
                }
                Err(e) => {
                    return Out {
                        losses,
                        sha256: String::new(),
                        save_error: Some(e.to_string()),
                    }
                }
            }
        }
    }
    let sha256 = t.finish().unwrap().weight_sha256;
    Out {
        losses,
        sha256,
        save_error: None,
    }
}

/// One rank of a case: run under `mpirun` by [`run_ranks`] (does nothing
/// without its spec).
#[test]
#[ignore = "a rank of the mpi tests; the other tests run it under mpirun"]
fn rank_main() {
    let Ok(spec) = std::env::var("TZ_MPI_SPEC") else {
        return;
    };
    let spec: Value = serde_json::from_str(&std::fs::read_to_string(spec).unwrap()).unwrap();
    let path = |k: &str| spec[k].as_str().map(PathBuf::from);
    let mut plan = Plan {
        cfg: spec["config"].clone(),
        model: path("model").unwrap(),
        resume: path("resume"),
        save_dir: path("save_dir"),
        save_at: spec["save_at"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_u64().unwrap())
            .collect(),
    };
    let comm = Arc::new(MpiComm::init(Duration::from_secs(120)).unwrap());
    let rank = comm.rank();
    // A save dir that only rank 0 sees (a file system the ranks do not
    // share): the other ranks get one of their own.
    if rank > 0 && spec["unshared"].as_bool() == Some(true) {
        let elsewhere = plan
            .save_dir
            .as_ref()
            .unwrap()
            .join(format!("rank{rank}-view"));
        std::fs::create_dir_all(&elsewhere).unwrap();
        plan.save_dir = Some(elsewhere);
    }
    let out = run(&plan, comm);
    let file = Path::new(spec["out"].as_str().unwrap()).join(format!("rank{rank}.json"));
    let v = json!({"losses": out.losses, "sha256": out.sha256, "save_error": out.save_error});
    std::fs::write(file, v.to_string()).unwrap();
}

/// `mpirun` with what a 2-core container and a root user need.
fn mpirun(n: usize) -> Command {
    let mut c = Command::new("mpirun");
    c.args([
        "-np",
        &n.to_string(),
        "--oversubscribe",
        "--bind-to",
        "none",
    ])
    .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
    .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    c
}

/// Runs `plan` on `n` ranks; every rank must report the same result.
fn run_ranks(n: usize, plan: &Plan) -> Out {
    let outs = run_ranks_each(n, plan, false);
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o, &outs[0], "rank {r} differs from rank 0");
    }
    outs[0].clone()
}

/// Runs `plan` on `n` ranks (with `unshared`, ranks other than 0 save into
/// a directory of their own); returns each rank's result.
fn run_ranks_each(n: usize, plan: &Plan, unshared: bool) -> Vec<Out> {
    let dir = scratch("mck-out");
    let p = |x: &Option<PathBuf>| x.as_ref().map(|d| d.to_str().unwrap().to_owned());
    let spec = json!({
        "config": plan.cfg, "model": plan.model.to_str().unwrap(), "resume": p(&plan.resume),
        "save_dir": p(&plan.save_dir), "save_at": plan.save_at, "out": dir.to_str().unwrap(),
        "unshared": unshared
    });
    let spec_path = dir.join("spec.json");
    std::fs::write(&spec_path, spec.to_string()).unwrap();
    let exe = std::env::current_exe().unwrap();
    let out = mpirun(n)
        .arg(exe)
        .args(["--exact", "rank_main", "--ignored", "--test-threads", "1"])
        .env("TZ_MPI_SPEC", &spec_path)
        .output()
        .expect("run mpirun (install openmpi-bin)");
    assert!(
        out.status.success(),
        "mpirun -np {n} failed: {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (0..n)
        .map(|r| {
            let text = std::fs::read_to_string(dir.join(format!("rank{r}.json"))).unwrap();
            let v: Value = serde_json::from_str(&text).unwrap();
            Out {
                losses: v["losses"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|b| b.as_u64().unwrap() as u32)
                    .collect(),
                sha256: v["sha256"].as_str().unwrap().to_owned(),
                save_error: v["save_error"].as_str().map(str::to_owned),
            }
        })
        .collect()
}

/// A complete checkpoint of `world` ranks: the manifest lists every rank's
/// three state files, every byte verifies, `latest` names it and no staging
/// dir is left behind.
fn check_complete(save_dir: &Path, step: u64, world: usize) -> Checkpoint {
    let step_dir = save_dir.join(format!("step-{step:08}"));
    let c = Checkpoint::open(&step_dir).unwrap();
    assert_eq!(c.step(), step);
    assert_eq!(c.manifest().world_size, world);
    assert_eq!(c.manifest().ranks.len(), world);
    for r in 0..world {
        for state in ["master", "exp_avg", "exp_avg_sq"] {
            let rel = format!("rank{r:04}/{state}.f32");
            assert!(
                c.manifest().file(&rel).is_some(),
                "{rel} not in the manifest"
            );
        }
    }
    let report = c.verify();
    assert!(report.ok(), "{report:?}");
    assert!(c.manifest().hf_weights.is_some());
    let leftovers: Vec<String> = std::fs::read_dir(save_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.') && n != tierzero::checkpoint::LOCK_FILE)
        .collect();
    assert!(leftovers.is_empty(), "left behind: {leftovers:?}");
    c
}

fn export_bytes(c: &Checkpoint, tag: &str) -> Vec<u8> {
    let out = scratch(tag).join("model.safetensors");
    let report = export_safetensors(c, &out, DType::F32).unwrap();
    assert!(report.tensors > 0);
    std::fs::read(out).unwrap()
}

#[test]
fn two_rank_checkpoint_resumes_on_two_and_one_ranks_and_exports_like_one_rank() {
    let model = model_dir("2");
    // One rank with accumulation 2 = two ranks with 1: the reference,
    // uninterrupted except for a checkpoint at the split.
    let save1 = scratch("mck-save1");
    let one = Plan {
        cfg: config(2, &scratch("mck-swap1")),
        model: model.clone(),
        resume: None,
        save_dir: Some(save1.clone()),
        save_at: vec![SPLIT],
    };
    let reference = run(&one, Arc::new(SingleRank));
    assert_eq!(reference.losses.len() as u64, TOTAL);
    assert!(f32::from_bits(reference.losses[5]) < f32::from_bits(reference.losses[0]));

    // (a) Two ranks: all the steps, saving at the split and at the end.
    let save2 = scratch("mck-save2");
    let two_cfg = config(1, &scratch("mck-swap2"));
    let whole = run_ranks(
        2,
        &Plan {
            cfg: two_cfg.clone(),
            model: model.clone(),
            resume: None,
            save_dir: Some(save2.clone()),
            save_at: vec![SPLIT, TOTAL],
        },
    );
    assert_eq!(whole, reference, "2 ranks (saving twice) vs 1 rank");
    let ck2 = check_complete(&save2, SPLIT, 2);
    check_complete(&save2, TOTAL, 2);
    assert_eq!(
        std::fs::read_to_string(save2.join("latest"))
            .unwrap()
            .trim(),
        format!("step-{TOTAL:08}")
    );

    // Resumed on two ranks from the split: the same remaining losses and
    // the same final weights.
    let resumed2 = run_ranks(
        2,
        &Plan {
            cfg: two_cfg,
            model: model.clone(),
            resume: Some(save2.join(format!("step-{SPLIT:08}"))),
            save_dir: None,
            save_at: vec![],
        },
    );
    assert_eq!(resumed2.losses, whole.losses[SPLIT as usize..]);
    assert_eq!(resumed2.sha256, whole.sha256, "2 ranks -> 2 ranks");

    // (b) Resumed on one rank (accumulation 2) from the 2-rank checkpoint.
    let resumed1 = run(
        &Plan {
            cfg: config(2, &scratch("mck-swap1r")),
            model: model.clone(),
            resume: Some(save2.join(format!("step-{SPLIT:08}"))),
            save_dir: None,
            save_at: vec![],
        },
        Arc::new(SingleRank),
    );
    assert_eq!(resumed1.losses, whole.losses[SPLIT as usize..]);
    assert_eq!(resumed1.sha256, whole.sha256, "2 ranks -> 1 rank");

    // (c) Export of the 2-rank checkpoint = export of the 1-rank one at the
    // same step (fp32, byte for byte); so are the consolidated 16-bit
    // weights each save gathered.
    let ck1 = check_complete(&save1, SPLIT, 1);
    let e2 = export_bytes(&ck2, "mck-export2");
    let e1 = export_bytes(&ck1, "mck-export1");
    assert!(
        e2 == e1,
        "exports differ ({} vs {} bytes)",
        e2.len(),
        e1.len()
    );
    let hf = |c: &Checkpoint| std::fs::read(c.dir().join("model.safetensors")).unwrap();
    assert!(hf(&ck2) == hf(&ck1), "consolidated 16-bit weights differ");
    eprintln!(
        "2-rank checkpoint: resumed on 2 and on 1 rank bit-identical to the uninterrupted run \
         (sha256 {}); export of {} bytes identical to the 1-rank checkpoint's",
        whole.sha256,
        e2.len()
    );
}

#[test]
fn one_rank_checkpoint_resumes_on_three_ranks() {
    let model = model_dir("3");
    // One rank with accumulation 3 = three ranks with 1.
    let save1 = scratch("mck-save13");
    let one = Plan {
        cfg: config(3, &scratch("mck-swap13")),
        model: model.clone(),
        resume: None,
        save_dir: Some(save1.clone()),
        save_at: vec![SPLIT],
    };
    let reference = run(&one, Arc::new(SingleRank));
    check_complete(&save1, SPLIT, 1);
    let resumed3 = run_ranks(
        3,
        &Plan {
            cfg: config(1, &scratch("mck-swap3")),
            model,
            resume: Some(save1.clone()),
            save_dir: None,
            save_at: vec![],
        },
    );
    assert_eq!(resumed3.losses, reference.losses[SPLIT as usize..]);
    assert_eq!(resumed3.sha256, reference.sha256, "1 rank -> 3 ranks");
    eprintln!(
        "1-rank checkpoint resumed on 3 ranks: {} losses and sha256 {} bit-identical",
        resumed3.losses.len(),
        resumed3.sha256
    );
}

#[test]
fn a_rank_that_cannot_write_fails_the_save_on_every_rank_and_leaves_nothing() {
    // Rank 1 sees another directory than rank 0 (as with a save dir on a
    // node-local disk): it cannot join rank 0's staging dir. Both ranks
    // must fail the save (none waits for the other), rank 1 naming the
    // cause and rank 0 naming rank 1, and nothing may become visible.
    let model = model_dir("unshared");
    let save = scratch("mck-unshared");
    let outs = run_ranks_each(
        2,
        &Plan {
            cfg: config(1, &scratch("mck-swapu")),
            model,
            resume: None,
            save_dir: Some(save.clone()),
            save_at: vec![1],
        },
        true,
    );
    let e0 = outs[0].save_error.as_deref().expect("rank 0 saved");
    let e1 = outs[1].save_error.as_deref().expect("rank 1 saved");
    assert!(e1.contains("every rank shares"), "rank 1: {e1}");
    assert!(
        e0.contains("rank 1 failed") && e0.contains("every rank shares"),
        "rank 0: {e0}"
    );
    eprintln!("rank 0: {e0}\nrank 1: {e1}");
    let mut left: Vec<String> = std::fs::read_dir(&save)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != tierzero::checkpoint::LOCK_FILE)
        .collect();
    left.sort();
    // Only rank 1's own (empty) view of the save dir (and rank 0's lock).
    assert_eq!(left, ["rank1-view"], "{left:?}");
}

/// `tierzero` with `args`; must succeed; returns stdout.
#[test]
fn cli_saves_with_two_ranks_then_resumes_and_exports_with_one() {
    // `tierzero launch --nproc 2 -- train --save-dir` (no longer refused),
    // then `tierzero train --resume` on one rank with the same global
    // batch: the same weights as one uninterrupted one-rank run.
    let dir = scratch("mck-cli");
    let model = model_dir("cli");
    std::fs::create_dir_all(dir.join("swap")).unwrap();
    let write_cfg = |name: &str, gas: u64| {
        let p = dir.join(name);
        std::fs::write(&p, config(gas, &dir.join("swap")).to_string()).unwrap();
        p.to_str().unwrap().to_owned()
    };
    let cfg2 = write_cfg("ds2.json", 1);
    let cfg1 = write_cfg("ds1.json", 2);
    let save = dir.join("ckpt");
    let (model, save) = (model.to_str().unwrap(), save.to_str().unwrap());
    let common = ["--seq-len", "16", "--model", model, "--json"];
    let mut launch = vec!["launch", "--nproc", "2", "--", "train", "--steps", "3"];
    launch.extend(common);
    launch.extend(["--config", &cfg2, "--save-dir", save]);
    tierzero(&launch);
    let sha = |stdout: &str| -> String {
        let v: Value = serde_json::from_str(stdout.trim()).unwrap();
        v["weight_sha256"].as_str().unwrap().to_owned()
    };
    let resumed = tierzero(&[
        "train",
        "--steps",
        "6",
        "--seq-len",
        "16",
        "--json",
        "--config",
        &cfg1,
        "--resume",
        save,
    ]);
    let mut whole = vec!["train", "--steps", "6", "--config", &cfg1];
    whole.extend(common);
    let whole = tierzero(&whole);
    assert_eq!(
        sha(&resumed),
        sha(&whole),
        "2 ranks -> 1 rank through the CLI"
    );
    let out = dir.join("hf").join("model.safetensors");
    tierzero(&[
        "export",
        "--checkpoint",
        save,
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(out.metadata().unwrap().len() > 0);
}

/// Ranks whose save dirs hold different steps (here each rank's working
/// directory has its own `ckpt`, as a stale network file system cache can
/// show one rank an older `latest`) are refused together, each rank's step
/// named, even where one of them would have nothing left to run: it used
/// to end alone while the other waited in the trainer's first collective.
#[test]
fn cli_ranks_that_see_different_steps_are_refused_together() {
    let dir = scratch("mck-cli-steps");
    let model = model_dir("cli-steps");
    let (model, swap) = (model.to_str().unwrap(), dir.join("swap"));
    std::fs::create_dir_all(&swap).unwrap();
    let cfg = dir.join("ds.json");
    std::fs::write(&cfg, config(1, &swap).to_string()).unwrap();
    let cfg = cfg.to_str().unwrap();
    let common = [
        "--seq-len",
        "16",
        "--model",
        model,
        "--config",
        cfg,
        "--json",
    ];
    for (rank, steps) in [("a", "2"), ("b", "1")] {
        let d = dir.join(rank);
        std::fs::create_dir_all(&d).unwrap();
        let save = d.join("ckpt");
        let mut args = vec![
            "train",
            "--steps",
            steps,
            "--save-dir",
            save.to_str().unwrap(),
        ];
        args.extend(common);
        tierzero(&args);
    }
    let bin = env!("CARGO_BIN_EXE_tierzero");
    let train = [
        bin,
        "train",
        "--steps",
        "2",
        "--resume",
        "ckpt",
        "--seq-len",
        "16",
        "--config",
        cfg,
        "--json",
    ];
    let (a, b) = (dir.join("a"), dir.join("b"));
    let t0 = std::time::Instant::now();
    let out = mpirun(1)
        .arg("--wdir")
        .arg(&a)
        .args(train)
        .arg(":")
        .args(["-np", "1", "--wdir"])
        .arg(&b)
        .args(train)
        .env("TIERZERO_COMM_TIMEOUT_S", "60")
        .output()
        .expect("run mpirun (install openmpi-bin)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("the step resumed from (--resume) is step 2 on rank 0, step 1 on rank 1"),
        "{stderr}"
    );
    assert!(t0.elapsed() < Duration::from_secs(50), "{:?}", t0.elapsed());
}

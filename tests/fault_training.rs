//! I/O faults and swap corruption through training, not just the swap
//! crate: every fault either is recovered transparently (short transfers:
//! the run ends with the fault-free weight hash) or stops training with an
//! error naming the file, the offset and the operation. Never a silent
//! continue on bad data, never a panic, never a hang (every run has a
//! deadline).
//!
//! Faults are placed by count: a fault-free run with counting injectors on
//! the four swap engines (parameters, optimizer-state reads, optimizer-state
//! writes, and the gradient park of two micro-batches a step) measures how
//! many completions each sees; each case then fires at
//! the first, a middle and the last of them. `cargo test --test
//! fault_training -- --nocapture` prints the table.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod engine_support;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use engine_support::{corpus, ds_config, scratch, tiny_gpt2_dir, Knobs};
use tierzero::config::{load_str, PathChecks, RunContext};
use tierzero::engine::{EngineError, FaultPlan, Trainer, TrainerOptions};
use tierzero::model::ModelDir;
use tierzero_swap::{FaultInjector, FaultKind, FaultRule, IoOp};

const SEED: u64 = 7;
const SEQ: usize = 16;
const STEPS: u64 = 2;
/// A run of this tiny model takes well under a second; anything near this
/// is a hang.
const DEADLINE: Duration = Duration::from_secs(60);

/// Two micro-batches a step, so the gradient park (NVMe optimizer state
/// with accumulation) has an engine to fault beside the other three.
fn knobs() -> Knobs {
    Knobs {
        gas: 2,
        ..Knobs::nvme()
    }
}

fn build(model: &Path, swap: &Path, faults: FaultPlan) -> Result<Trainer, EngineError> {
    build_with(&knobs(), model, swap, faults)
}

/// [`build`] with `knobs`.
fn build_with(
    knobs: &Knobs,
    model: &Path,
    swap: &Path,
    faults: FaultPlan,
) -> Result<Trainer, EngineError> {
    let cfg = ds_config(knobs, swap, STEPS);
    let run = RunContext {
        path_checks: PathChecks::CreateMissing,
        ..RunContext::default()
    };
    let loaded = load_str(&cfg.to_string(), &run).unwrap();
    let md = ModelDir::open(model, SEED).unwrap();
    let mut opts = TrainerOptions::cpu(SEED, SEQ);
    opts.faults = faults;
    Trainer::new(&loaded.config, &md, corpus(), opts)
}

/// How a run ended.
#[derive(Debug)]
enum Outcome {
    /// Finished; the final weight hash.
    Done(String),
    /// Stopped with this error. `poisoned`: a swap space was poisoned (the
    /// trainer existed); `after`: what the next call returned.
    Failed {
        error: String,
        poisoned: Option<bool>,
        after: Option<String>,
    },
}

/// Trains STEPS steps and finishes, on a thread with a deadline.
fn run(model: &Path, faults: FaultPlan) -> Outcome {
    let model = model.to_path_buf();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let swap = scratch("fault-swap");
        let out = (|| {
            let mut t = match build(&model, &swap, faults) {
                Ok(t) => t,
                Err(e) => {
                    return Outcome::Failed {
                        error: e.to_string(),
                        poisoned: None,
                        after: None,
                    }
                }
            };
            for _ in 0..STEPS {
                if let Err(e) = t.step() {
                    let poisoned = Some(t.swap_poisoned());
                    // The trainer must refuse to go on, at once.
                    let after = Some(match t.step() {
                        Ok(_) => "a later step succeeded".to_owned(),
                        Err(e) => e.to_string(),
                    });
                    return Outcome::Failed {
                        error: e.to_string(),
                        poisoned,
                        after,
                    };
                }
            }
            match t.finish() {
                Ok(s) => Outcome::Done(s.weight_sha256),
                Err(e) => Outcome::Failed {
                    error: e.to_string(),
                    poisoned: None,
                    after: None,
                },
            }
        })();
        let _ = std::fs::remove_dir_all(&swap);
        let _ = tx.send(out);
    });
    match rx.recv_timeout(DEADLINE) {
        Ok(o) => o,
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("training hung for {DEADLINE:?}"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("training panicked"),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Engine {
    Params,
    OptimRead,
    OptimWrite,
    GradPark,
}

fn plan_with(engine: Engine, inj: Arc<FaultInjector>) -> FaultPlan {
    let mut p = FaultPlan::default();
    match engine {
        Engine::Params => p.params = Some(inj),
        Engine::OptimRead => p.optim_read = Some(inj),
        Engine::OptimWrite => p.optim_write = Some(inj),
        Engine::GradPark => p.grad_park = Some(inj),
    }
    p
}

fn kind_name(k: FaultKind) -> String {
    match k {
        FaultKind::Errno(EIO) => "EIO".into(),
        FaultKind::Errno(ENOSPC) => "ENOSPC".into(),
        FaultKind::Errno(e) => format!("errno {e}"),
        FaultKind::Short => "short".into(),
        FaultKind::Eof => "EOF".into(),
    }
}

/// Linux errno values (the main crate has no libc dependency).
const EIO: i32 = 5;
const ENOSPC: i32 = 28;

/// Does an error message say which file, where, and which operation?
fn names_file_offset_op(msg: &str, op: IoOp) -> bool {
    msg.contains(".tzswap") && msg.contains("offset") && msg.contains(&op.to_string())
}

#[test]
fn faults_through_training_are_recovered_or_reported_never_silent() {
    let model = tiny_gpt2_dir("faults", 2, 32);

    // Fault-free reference with counting injectors.
    let counters: [Arc<FaultInjector>; 4] =
        std::array::from_fn(|_| Arc::new(FaultInjector::new(vec![])));
    let reference = FaultPlan {
        params: Some(counters[0].clone()),
        optim_read: Some(counters[1].clone()),
        optim_write: Some(counters[2].clone()),
        grad_park: Some(counters[3].clone()),
    };
    let Outcome::Done(ref_sha) = run(&model, reference) else {
        panic!("the fault-free run failed")
    };
    let count = |e: Engine, op: IoOp| {
        let i = match e {
            Engine::Params => 0,
            Engine::OptimRead => 1,
            Engine::OptimWrite => 2,
            Engine::GradPark => 3,
        };
        counters[i].completions(Some(op))
    };

    let (eio, enospc) = (EIO, ENOSPC);
    let cases: Vec<(Engine, IoOp, FaultKind)> = vec![
        (Engine::Params, IoOp::Read, FaultKind::Errno(eio)),
        (Engine::Params, IoOp::Read, FaultKind::Short),
        (Engine::Params, IoOp::Read, FaultKind::Eof),
        (Engine::Params, IoOp::Write, FaultKind::Errno(eio)),
        (Engine::Params, IoOp::Write, FaultKind::Errno(enospc)),
        (Engine::Params, IoOp::Write, FaultKind::Short),
        (Engine::Params, IoOp::Write, FaultKind::Eof),
        (Engine::OptimRead, IoOp::Read, FaultKind::Errno(eio)),
        (Engine::OptimRead, IoOp::Read, FaultKind::Short),
        (Engine::OptimRead, IoOp::Read, FaultKind::Eof),
        (Engine::OptimWrite, IoOp::Write, FaultKind::Errno(eio)),
        (Engine::OptimWrite, IoOp::Write, FaultKind::Errno(enospc)),
        (Engine::OptimWrite, IoOp::Write, FaultKind::Short),
        (Engine::OptimWrite, IoOp::Write, FaultKind::Eof),
        (Engine::GradPark, IoOp::Read, FaultKind::Errno(eio)),
        (Engine::GradPark, IoOp::Read, FaultKind::Short),
        (Engine::GradPark, IoOp::Read, FaultKind::Eof),
        (Engine::GradPark, IoOp::Write, FaultKind::Errno(eio)),
        (Engine::GradPark, IoOp::Write, FaultKind::Errno(enospc)),
        (Engine::GradPark, IoOp::Write, FaultKind::Short),
        (Engine::GradPark, IoOp::Write, FaultKind::Eof),
    ];

    let mut table: Vec<String> = Vec::new();
    let mut problems: Vec<String> = Vec::new();
    let (mut detected, mut recovered) = (0, 0);
    for (engine, op, kind) in cases {
        let total = count(engine, op);
        assert!(total >= 3, "{engine:?} saw only {total} {op}s");
        // A short transfer needs a piece of at least 8 KiB to cut; the last
        // ones may all be single 4 KiB blocks, so shorts aim earlier (the
        // rule then fires at the first piece it can cut).
        let points = match kind {
            FaultKind::Short => [1, total / 3, 2 * total / 3],
            _ => [1, total / 2, total],
        };
        let (mut d, mut r) = (0, 0);
        for nth in points {
            let inj = Arc::new(FaultInjector::new(vec![FaultRule {
                nth,
                op: Some(op),
                kind,
            }]));
            let out = run(&model, plan_with(engine, inj.clone()));
            let what = format!("{engine:?} {op} {} at #{nth}/{total}", kind_name(kind));
            if inj.injected() != 1 {
                problems.push(format!("{what}: the fault did not fire ({out:?})"));
                continue;
            }
            match (&out, kind) {
                (Outcome::Done(sha), FaultKind::Short) if *sha == ref_sha => r += 1,
                (Outcome::Done(sha), _) if *sha == ref_sha => {
                    problems.push(format!("{what}: fault swallowed (same hash, no error)"))
                }
                (Outcome::Done(_), _) => {
                    problems.push(format!("{what}: DATA LOST: finished with a different hash"))
                }
                (Outcome::Failed { error, .. }, FaultKind::Short) => {
                    problems.push(format!("{what}: short transfer not recovered: {error}"))
                }
                (
                    Outcome::Failed {
                        error,
                        poisoned,
                        after,
                    },
                    _,
                ) => {
                    if !names_file_offset_op(error, op) {
                        problems.push(format!("{what}: unclear error: {error}"));
                        continue;
                    }
                    if op == IoOp::Write && *poisoned == Some(false) {
                        problems.push(format!("{what}: write failed but no space is poisoned"));
                    }
                    if let Some(a) = after {
                        if !a.contains("training stopped after an earlier error") {
                            problems.push(format!("{what}: trainer went on after an error: {a}"));
                        }
                    }
                    d += 1;
                }
            }
        }
        table.push(format!(
            "| {:<10} | {:<5} | {:<6} | {} | {} | {} | 0 |",
            format!("{engine:?}"),
            op.to_string(),
            kind_name(kind),
            points.len(),
            d,
            r
        ));
        detected += d;
        recovered += r;
    }
    println!("| engine     | op    | fault  | cases | detected | recovered | data lost |");
    for row in &table {
        println!("{row}");
    }
    println!(
        "detected {detected}, recovered {recovered}, problems {}",
        problems.len()
    );
    assert!(problems.is_empty(), "{problems:#?}");
}

/// Our swap files in a trainer's swap directory, params' space first (it
/// is created first, so its space number is lower).
fn swap_files(swap: &Path) -> Vec<PathBuf> {
    let dir = swap.join("tierzero");
    let mut files: Vec<(u64, PathBuf)> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let rest = name.strip_prefix(&format!("swap-{}-", std::process::id()))?;
            let space: u64 = rest.split('-').next()?.parse().ok()?;
            Some((space, e.path()))
        })
        .collect();
    files.sort();
    files.into_iter().map(|(_, p)| p).collect()
}

/// Flips one byte in every 4 KiB block of `path`.
fn flip_every_block(path: &Path) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let len = f.metadata().unwrap().len();
    let mut off = 100;
    while off < len {
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, off).unwrap();
        b[0] ^= 0x5a;
        f.write_all_at(&b, off).unwrap();
        off += 4096;
    }
    f.sync_all().unwrap();
}

/// Trains one step, damages a swap file with `damage`, then expects the
/// next step to fail with an error containing every word of `expect` and
/// the damaged file's path. One micro-batch a step: two swap files, the
/// params' and the optimizer state's (no gradient park).
fn damage_between_steps(which: usize, damage: fn(&Path), expect: &[&str]) {
    let model = tiny_gpt2_dir("corrupt", 2, 32);
    let swap = scratch("corrupt-swap");
    let (tx, rx) = mpsc::channel();
    let sw = swap.clone();
    std::thread::spawn(move || {
        let mut t = build_with(&Knobs::nvme(), &model, &sw, FaultPlan::default()).unwrap();
        t.step().unwrap();
        // The step's optimizer tail may still be writing (it overlaps the
        // next step): let it land first, or it could overwrite the damage.
        t.settle_optimizer().unwrap();
        let files = swap_files(&sw);
        assert_eq!(files.len(), 2, "{files:?}");
        damage(&files[which]);
        let err = t.step().map(|_| ()).unwrap_err();
        let again = t.step().map(|_| ()).unwrap_err();
        let _ = tx.send((files[which].clone(), err.to_string(), again.to_string()));
    });
    let (file, err, again) = rx.recv_timeout(DEADLINE).expect("hung or panicked");
    assert!(err.contains(&file.display().to_string()), "{err}");
    for w in expect {
        assert!(err.contains(w), "{err}");
    }
    assert!(
        again.contains("training stopped after an earlier error"),
        "{again}"
    );
    let _ = std::fs::remove_dir_all(&swap);
}

#[test]
fn flipped_bytes_in_the_optimizer_swap_file_fail_the_next_step_naming_the_extent() {
    damage_between_steps(1, flip_every_block, &["checksum mismatch", "swap extent"]);
}

#[test]
fn flipped_bytes_in_the_parameter_swap_file_fail_the_next_step_naming_the_extent() {
    damage_between_steps(0, flip_every_block, &["checksum mismatch", "swap extent"]);
}

#[test]
fn a_truncated_swap_file_fails_the_next_step_naming_file_and_offset() {
    damage_between_steps(
        1,
        |p| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(p)
                .unwrap()
                .set_len(0)
                .unwrap()
        },
        &["short read", "offset", "truncated"],
    );
}

/// A failure in the optimizer's tail that a save finds (the step had
/// returned; its state writes failed after) is the trainer's, not the
/// save's: the save fails naming it, and so does every later call, the
/// cause kept (it was "optimizer thread stopped", the cause gone).
#[test]
fn a_tail_failure_found_by_a_save_stops_the_trainer_naming_the_cause() {
    let model = tiny_gpt2_dir("tail-save", 2, 32);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        // Count the optimizer's writes to the end of the first step's
        // tail: the last of them lands after the step returned.
        let swap = scratch("tail-save-count");
        let counter = Arc::new(FaultInjector::new(vec![]));
        let mut t = build(
            &model,
            &swap,
            plan_with(Engine::OptimWrite, counter.clone()),
        )
        .unwrap();
        t.step().unwrap();
        t.settle_optimizer().unwrap();
        let last_of_step = counter.completions(Some(IoOp::Write));
        drop(t);
        let _ = std::fs::remove_dir_all(&swap);

        let swap = scratch("tail-save");
        let inj = Arc::new(FaultInjector::new(vec![FaultRule {
            nth: last_of_step,
            op: Some(IoOp::Write),
            kind: FaultKind::Errno(EIO),
        }]));
        let mut t = build(&model, &swap, plan_with(Engine::OptimWrite, inj.clone())).unwrap();
        let stepped = t.step().map(|_| ()).map_err(|e| e.to_string());
        let saved = t
            .save_checkpoint(&swap.join("ckpt"))
            .map(|_| ())
            .map_err(|e| e.to_string());
        let after = t.step().map(|_| ()).map_err(|e| e.to_string());
        let _ = std::fs::remove_dir_all(&swap);
        let _ = tx.send((stepped, saved, after, inj.injected()));
    });
    let (stepped, saved, after, injected) = rx.recv_timeout(DEADLINE).expect("hung or panicked");
    assert_eq!(injected, 1);
    // The step's tail overlaps the next call: the step itself returns.
    assert!(stepped.is_ok(), "{stepped:?}");
    let saved = saved.unwrap_err();
    let after = after.unwrap_err();
    assert!(
        saved.contains("Input/output error")
            || saved.contains("EIO")
            || saved.contains("os error 5"),
        "{saved}"
    );
    assert!(
        after.contains("training stopped after an earlier error"),
        "{after}"
    );
    assert!(
        after.contains("os error 5") || after.contains("Input/output error"),
        "the cause is kept: {after}"
    );
}

/// An embedder's wrong argument is an error that leaves the trainer
/// usable: a sub-group this rank does not have (it ended the optimizer
/// thread, the trainer stopped for good), a sequence length the data is
/// too short for (it stopped the trainer at the next step), and a unit the
/// model does not have (it stopped the trainer in the fetch or release).
#[test]
fn an_embedders_wrong_argument_is_refused_and_the_trainer_trains_on() {
    use tierzero::data::TokenData;
    use tierzero::engine::SubGroupId;
    let model = tiny_gpt2_dir("wrong-args", 2, 32);
    let swap = scratch("wrong-args");
    let cfg = ds_config(&knobs(), &swap, STEPS);
    let run = RunContext {
        path_checks: PathChecks::CreateMissing,
        ..RunContext::default()
    };
    let loaded = load_str(&cfg.to_string(), &run).unwrap();
    let md = ModelDir::open(&model, SEED).unwrap();
    // 24 tokens: windows of SEQ + 1 = 17, not of 24 + 1 (the model has 32
    // positions).
    let data = TokenData::from_bytes(&[b'a'; 24], Path::new("<short>"));
    let mut t = Trainer::new(&loaded.config, &md, data, TrainerOptions::cpu(SEED, SEQ)).unwrap();
    let groups = t.layout().sub_groups.len();
    let e = t.master(SubGroupId(groups)).unwrap_err().to_string();
    assert!(
        e.contains(&format!("sub-group {groups} does not exist")),
        "{e}"
    );
    let e = t.set_seq_len(24).unwrap_err().to_string();
    assert!(
        e.contains("24 tokens cannot give windows of seq_len 24"),
        "{e}"
    );
    let units = t.model().units().len();
    let missing = tierzero::model::UnitId(units);
    for e in [
        t.fetch_unit(missing).map(|_| ()).unwrap_err(),
        t.release_unit(missing).unwrap_err(),
    ] {
        let e = e.to_string();
        assert!(e.contains(&format!("unit {units} does not exist")), "{e}");
    }
    t.step().unwrap();
    t.master(SubGroupId(0)).unwrap();
    t.finish().unwrap();
    let _ = std::fs::remove_dir_all(&swap);
}

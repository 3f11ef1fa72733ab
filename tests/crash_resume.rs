//! Kill-and-resume crash tests, sled style, on the built binary.
//!
//! A tiny GPT-2 trains `TOTAL` steps (stage 3, params and optimizer state on
//! NVMe, crc32c on, a checkpoint every step, `--metrics`). Each kill point
//! is either a failpoint (`TIERZERO_FAILPOINT=<site>:<n>`, the process
//! SIGKILLs itself the n-th time it reaches the site; see
//! `tierzero::failpoint`) or a SIGKILL from outside after a seeded delay.
//! After every kill the save dir is checked:
//!
//! * every `step-*` dir opens and verifies (every crc), and its manifest's
//!   step is its name's;
//! * staging dirs (`.step-*.tmp-*`, `.old-*`) are never opened;
//! * the save dir opens at `latest` (or, before the first `latest`, at the
//!   newest step dir), and the step it opens at never goes back (no
//!   checkpoint that was reachable is lost);
//! * the killed process's `swap-<pid>-*.tzswap` files are reclaimed by the
//!   next start, and files that are not ours in the same `tierzero/` dir
//!   are never touched.
//!
//! Then the run is resumed from the save dir (`--resume`, or from scratch
//! when no checkpoint exists yet), possibly killed again (seeded), until it
//! completes; its final weight hash (metrics summary) and its final
//! checkpoint's state files must equal those of a run never killed, byte
//! for byte. `crash_resume_30_points` runs in CI (`cargo test --workspace`):
//! every site and timed kills, a few seconds on 2 cores.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failure is a panic

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tierzero::checkpoint::{Checkpoint, StateKind};

mod cli_support;

const TOTAL: u64 = 5;
const SITES: [&str; 8] = [
    "step.backward",
    "optim.write_back",
    "ckpt.state_write",
    "ckpt.manifest_write",
    "ckpt.before_rename",
    "ckpt.before_latest",
    "ckpt.latest_write",
    // Speculative steps written to their shadow extents, not committed.
    "optim.before_commit",
];

/// splitmix64: the seeded choices.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

#[derive(Debug, Clone)]
enum Kill {
    /// The n-th hit of a failpoint site.
    At(&'static str, u64),
    /// SIGKILL from outside after this many milliseconds.
    After(u64),
}

impl std::fmt::Display for Kill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Kill::At(s, n) => write!(f, "{s}:{n}"),
            Kill::After(ms) => write!(f, "timed {ms} ms"),
        }
    }
}

fn scratch(tag: &str) -> PathBuf {
    cli_support::scratch("crash", tag)
}

/// Model, data, swap dir (with foreign files in its `tierzero/`) and
/// ds_config in `d`.
fn setup(d: &Path) {
    std::fs::create_dir_all(d.join("model")).unwrap();
    let model = json!({"model_type": "gpt2", "vocab_size": 256, "n_positions": 32,
        "n_embd": 32, "n_layer": 2, "n_head": 2, "tie_word_embeddings": true});
    std::fs::write(d.join("model/config.json"), model.to_string()).unwrap();
    let text = "a run killed at any moment resumes and ends the same. ".repeat(60);
    std::fs::write(d.join("data.txt"), text).unwrap();
    let swap = d.join("swap");
    std::fs::create_dir_all(swap.join("tierzero")).unwrap();
    std::fs::write(swap.join("tierzero").join(live_pid_file()), "reused pid").unwrap();
    for (name, body) in foreign_files() {
        std::fs::write(swap.join("tierzero").join(name), body).unwrap();
    }
    let cfg = json!({
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        // Above this model's gradient norms: the speculative steps commit.
        "gradient_clipping": 100.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.001, "warmup_num_steps": 2,
            "total_num_steps": TOTAL}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": swap, "buffer_count": 4,
                "buffer_size": 20000},
            "offload_optimizer": {"device": "nvme", "nvme_path": swap},
            "sub_group_size": 3000
        },
        // Clipping with NVMe state: sub-groups step speculatively (kept on
        // even when a step clips, so the commit is reached).
        "tierzero": {"pinned_budget_bytes": "16MiB", "checksums": true,
                     "speculative_step": true}
    });
    std::fs::write(d.join("ds.json"), cfg.to_string()).unwrap();
}

/// Files in `swap/tierzero/` that are not ours: never touched.
fn foreign_files() -> Vec<(String, String)> {
    vec![
        ("notes.txt".into(), "not tierzero's".into()),
        ("swap-x-0-0.tzswap".into(), "bad pid".into()),
        ("swap-1-0-0.tzswap.bak".into(), "other suffix".into()),
    ]
}

/// A swap file named with a live process's pid (the test's), which holds
/// no lock on the directory: stale, as a dead run's whose pid was reused,
/// and reclaimed by the first run (it was kept for good).
fn live_pid_file() -> String {
    format!("swap-{}-0-0.tzswap", std::process::id())
}

fn train_cmd(d: &Path, save: &str, resume: bool, metrics: &str) -> Command {
    cli_support::train_saving(d, TOTAL, save, resume, metrics)
}

enum Outcome {
    Killed,
    Done { stderr: String, nothing_to_do: bool },
}

fn run(mut c: Command, kill: Option<&Kill>) -> Outcome {
    if let Some(Kill::At(site, n)) = kill {
        c.env("TIERZERO_FAILPOINT", format!("{site}:{n}"));
    }
    let mut child = c.spawn().unwrap();
    if let Some(Kill::After(ms)) = kill {
        let deadline = Instant::now() + Duration::from_millis(*ms);
        while Instant::now() < deadline {
            if child.try_wait().unwrap().is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let _ = child.kill(); // SIGKILL; an error means it already exited
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    match (out.status.code(), out.status.signal()) {
        (Some(0), _) => Outcome::Done {
            stderr,
            nothing_to_do: String::from_utf8_lossy(&out.stdout).contains("nothing to do"),
        },
        (_, Some(9)) => Outcome::Killed,
        _ => panic!(
            "kill {kill:?}: the run failed ({:?}):\n{}\n{stderr}",
            out.status,
            String::from_utf8_lossy(&out.stdout)
        ),
    }
}

fn summary_hash(metrics: &Path) -> Option<String> {
    let text = std::fs::read_to_string(metrics).ok()?;
    let last: Value = serde_json::from_str(text.lines().last()?).ok()?;
    (last["summary"] == json!(true)).then(|| last["weight_sha256"].as_str().unwrap().to_owned())
}

/// The crash-safety checks on a save dir after a kill; returns the step the
/// save dir opens at (None: no checkpoint yet).
fn check_save_dir(save: &Path, what: &str) -> Option<u64> {
    let Ok(entries) = std::fs::read_dir(save) else {
        return None;
    };
    let mut newest_step_dir = None;
    for e in entries {
        let e = e.unwrap();
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(digits) = name.strip_prefix("step-") {
            let c = Checkpoint::open(&e.path())
                .unwrap_or_else(|err| panic!("{what}: visible {name} does not open: {err}"));
            let report = c.verify();
            assert!(report.ok(), "{what}: {name} does not verify: {report:?}");
            let step: u64 = digits.parse().unwrap();
            assert_eq!(c.step(), step, "{what}: {name}");
            newest_step_dir = newest_step_dir.max(Some(step));
        } else if name.starts_with(".step-") {
            assert!(
                Checkpoint::open(&e.path()).is_err(),
                "{what}: staging dir {name} was opened"
            );
        } else {
            assert!(
                name == "latest" || name == ".lock" || name.starts_with(".latest.tmp-"),
                "{what}: unexpected {name} in the save dir"
            );
        }
    }
    let latest = std::fs::read_to_string(save.join("latest")).ok();
    match Checkpoint::open(save) {
        Ok(c) => {
            let name = c.dir().file_name().unwrap().to_string_lossy().into_owned();
            match &latest {
                // `latest` is only ever a whole, valid name.
                Some(l) => assert_eq!(l, &format!("{name}\n"), "{what}: not opened at latest"),
                None => assert_eq!(Some(c.step()), newest_step_dir, "{what}"),
            }
            Some(c.step())
        }
        Err(e) => {
            assert!(
                latest.is_none() && newest_step_dir.is_none(),
                "{what}: save dir with a checkpoint does not open: {e}"
            );
            None
        }
    }
}

/// `swap-<pid>-*.tzswap` files in the swap dir whose pid is not ours.
fn swap_files_of_others(d: &Path) -> Vec<String> {
    let me = format!("swap-{}-", std::process::id());
    let mut v: Vec<String> = std::fs::read_dir(d.join("swap/tierzero"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("swap-") && n.ends_with(".tzswap") && !n.starts_with(&me))
        .filter(|n| n != "swap-x-0-0.tzswap")
        .collect();
    v.sort();
    v
}

/// Every element of every parameter's master, exp_avg and exp_avg_sq, as
/// bits (crc-verified reads; the padding between regions is not data).
fn state_files(step_dir: &Path) -> Vec<Vec<u32>> {
    let c = Checkpoint::open(step_dir).unwrap();
    let mut out = Vec::new();
    for p in c.model().params() {
        for kind in StateKind::ALL {
            let v = c.load_param_state_range(kind, p.id, 0, p.numel).unwrap();
            out.push(v.iter().map(|x| x.to_bits()).collect());
        }
    }
    out
}

/// Hits per site of one whole run, from the message of a failpoint armed
/// past the end.
fn parse_hits(stderr: &str) -> BTreeMap<String, u64> {
    let line = stderr
        .lines()
        .find(|l| l.contains("was not reached; hits:"))
        .unwrap_or_else(|| panic!("no hit counts in:\n{stderr}"));
    line.split("hits:")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap();
            (k.to_owned(), v.parse().unwrap())
        })
        .collect()
}

#[derive(Default)]
struct Tally {
    kills: u64,
    by_site: BTreeMap<String, u64>,
    not_reached: u64,
    stale_reclaimed: u64,
    checks: u64,
}

/// `kinds[i % kinds.len()]` is the kind of point `i`'s first kill: an
/// index into `SITES`, or `SITES.len()` for a timed kill.
fn crash_points(points: usize, seed: u64, kinds: &[usize]) {
    let t0 = Instant::now();
    let root = scratch(&format!("{points}"));
    setup(&root);
    // The run never killed; armed past its end, it also counts every
    // site's hits (and shows an armed failpoint changes nothing).
    let started = Instant::now();
    let mut c = train_cmd(&root, "ref-ck", false, "ref.jsonl");
    c.env("TIERZERO_FAILPOINT", "step.backward:1000000000");
    let Outcome::Done { stderr, .. } = run(c, None) else {
        panic!("reference run killed")
    };
    let ref_ms = started.elapsed().as_millis() as u64;
    let hits = parse_hits(&stderr);
    let ref_hash = summary_hash(&root.join("ref.jsonl")).unwrap();
    let ref_last = root.join(format!("ref-ck/step-{TOTAL:08}"));
    let ref_states = state_files(&ref_last);
    for s in SITES {
        assert!(hits[s] > 0, "{s} never reached: {hits:?}");
    }

    let mut rng = Rng(seed);
    let mut tally = Tally::default();
    let pick = |rng: &mut Rng, kind: u64| -> Kill {
        if (kind as usize) < SITES.len() {
            let s = SITES[kind as usize];
            Kill::At(s, 1 + rng.below(hits[s]))
        } else {
            Kill::After(rng.below(ref_ms))
        }
    };
    for i in 0..points {
        let save = format!("ck-{i}");
        // Round-robin over the sites and timed kills, seeded n / delay.
        let first = pick(&mut rng, kinds[i % kinds.len()] as u64);
        let mut kill = Some(first.clone());
        let mut attempt = 0;
        let mut opened_at: Option<u64> = None;
        loop {
            let what = format!("point {i} ({first}), run {attempt}");
            let resume = Checkpoint::open(&root.join(&save)).is_ok();
            let metrics = format!("m-{i}-{attempt}.jsonl");
            let stale_before = swap_files_of_others(&root);
            let outcome = run(train_cmd(&root, &save, resume, &metrics), kill.as_ref());
            // Files of processes killed before this run are gone (unless a
            // timed kill struck before this run set up its swap, or the
            // checkpoint was already at TOTAL so it set up nothing).
            let idle = matches!(
                outcome,
                Outcome::Done {
                    nothing_to_do: true,
                    ..
                }
            );
            if !idle && !matches!(kill, Some(Kill::After(_))) {
                let after = swap_files_of_others(&root);
                for f in &stale_before {
                    assert!(!after.contains(f), "{what}: stale {f} not reclaimed");
                }
                tally.stale_reclaimed += stale_before.len() as u64;
            }
            match outcome {
                Outcome::Killed => {
                    tally.kills += 1;
                    if let Some(k) = &kill {
                        let key = match k {
                            Kill::At(s, _) => (*s).to_owned(),
                            Kill::After(_) => "timed".to_owned(),
                        };
                        *tally.by_site.entry(key).or_default() += 1;
                    }
                    let now = check_save_dir(&root.join(&save), &what);
                    tally.checks += 1;
                    assert!(
                        now >= opened_at,
                        "{what}: went back from {opened_at:?} to {now:?}"
                    );
                    opened_at = now;
                }
                Outcome::Done { stderr, .. } => {
                    // A failpoint in the first run (from scratch, the
                    // reference's workload) always fires.
                    assert!(
                        !(attempt == 0 && matches!(first, Kill::At(..))),
                        "{what}: not killed:\n{stderr}"
                    );
                    if kill.is_some() && stderr.contains("was not reached") {
                        tally.not_reached += 1;
                    }
                    assert!(
                        !stderr.contains("panicked"),
                        "{what}: a panic in a run that completed:\n{stderr}"
                    );
                    let hash = summary_hash(&root.join(&metrics));
                    // `None`: the checkpoint was already at TOTAL ("nothing
                    // to do"); the state files decide below.
                    if let Some(h) = hash {
                        assert_eq!(h, ref_hash, "{what}: final weights differ");
                    }
                    break;
                }
            }
            attempt += 1;
            // Killed again on resume, seeded (at most 3 kills per point).
            kill = if attempt < 3 && rng.below(3) == 0 {
                let kind = rng.below(SITES.len() as u64 + 1);
                Some(pick(&mut rng, kind))
            } else {
                None
            };
            let _ = std::fs::remove_file(root.join(&metrics));
        }
        let last = root.join(&save).join(format!("step-{TOTAL:08}"));
        assert!(
            state_files(&last) == ref_states,
            "point {i} ({first}): final optimizer state differs"
        );
        // Byte for byte, padding included: a checkpoint depends only on
        // the training state.
        for k in ["master", "exp_avg", "exp_avg_sq"] {
            let rel = format!("rank0000/{k}.f32");
            assert!(
                std::fs::read(last.join(&rel)).unwrap()
                    == std::fs::read(ref_last.join(&rel)).unwrap(),
                "point {i} ({first}): {rel} differs from the reference's"
            );
        }
        check_save_dir(&root.join(&save), &format!("point {i}, end"));
        // The completed run's last save removed every leftover of the
        // killed ones.
        let leftovers: Vec<String> = std::fs::read_dir(root.join(&save))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".step-") || n.starts_with(".latest.tmp-"))
            .collect();
        assert!(leftovers.is_empty(), "point {i}: leftovers {leftovers:?}");
        std::fs::remove_dir_all(root.join(&save)).unwrap();
    }
    // Foreign files untouched; no stale swap file remains, the one named
    // with a live pid included.
    assert!(!root.join("swap/tierzero").join(live_pid_file()).exists());
    for (name, body) in foreign_files() {
        let p = root.join("swap/tierzero").join(&name);
        assert_eq!(std::fs::read_to_string(&p).unwrap(), body, "{name}");
    }
    assert_eq!(swap_files_of_others(&root), Vec::<String>::new());
    eprintln!(
        "crash_resume: {points} points, {} kills {:?}, {} armed points not reached, {} save-dir \
         checks, {} stale swap files reclaimed, reference run {ref_ms} ms, hits {hits:?}, total \
         {:.1} s",
        tally.kills,
        tally.by_site,
        tally.not_reached,
        tally.checks,
        tally.stale_reclaimed,
        t0.elapsed().as_secs_f64()
    );
    assert!(
        tally.stale_reclaimed > 0,
        "no stale swap file was ever left"
    );
    std::fs::remove_dir_all(&root).unwrap();
}

/// 30 seeded points: round-robin over the 8 sites (mid-step, mid
/// write-back, a partly written state file, a half-written manifest, before
/// the rename, before `latest`, a half-written `latest`, before a
/// speculative commit) and timed kills, each possibly killed again on
/// resume.
#[test]
fn crash_resume_30_points() {
    crash_points(30, 0x5eed_0030, &[0, 1, 2, 3, 4, 5, 6, 7, 8, 8]);
}

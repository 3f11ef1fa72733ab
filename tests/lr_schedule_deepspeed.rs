//! The learning rate of every optimizer step against DeepSpeed's own
//! schedulers (`tests/fixtures/deepspeed_lr_schedules.txt`, written by
//! `scripts/deepspeed_lr_reference.py` from DeepSpeed's
//! `lr_schedules.py`): each case's `scheduler` block read as a config
//! would be (so its defaults are the config reader's), then
//! `LrSchedule::lr_for_step`, the lr the trainer runs each step at.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: a failed unwrap is a failed test"
)]

use serde_json::{json, Value};
use tierzero::config::{load_str, PathChecks, RunContext};
use tierzero::optim::schedule::LrSchedule;

const FIXTURE: &str = include_str!("fixtures/deepspeed_lr_schedules.txt");

#[test]
fn every_steps_lr_is_deepspeeds() {
    let mut cases = 0;
    for line in FIXTURE
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (kind, rest) = line.split_once(' ').unwrap();
        let end = rest.find('}').unwrap() + 1;
        let params: Value = serde_json::from_str(&rest[..end]).unwrap();
        let want: Vec<f64> = rest[end..]
            .split_whitespace()
            .map(|v| v.parse().unwrap())
            .collect();
        let cfg = json!({
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
            "scheduler": {"type": kind, "params": params},
        });
        let run = RunContext {
            path_checks: PathChecks::Skip,
            ..RunContext::default()
        };
        let c = load_str(&cfg.to_string(), &run).unwrap().config;
        let s = LrSchedule {
            scheduler: c.scheduler,
            base_lr: c.optimizer.lr,
        };
        for (k, &w) in want.iter().enumerate() {
            let got = s.lr_for_step(k as u64);
            assert!(
                (got - w).abs() <= 1e-15 * w.abs(),
                "{kind} {params}: step {}: {got:?}, DeepSpeed {w:?}",
                k + 1
            );
        }
        cases += 1;
    }
    assert_eq!(cases, 24, "the fixture's cases");
}

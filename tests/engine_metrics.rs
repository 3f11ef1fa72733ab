//! The metrics file: one JSON object per step with the key names scripts
//! read, the loss with full f32 precision, and a summary line with
//! `weight_sha256`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: a failed unwrap is a failed test"
)]

mod engine_support;

use engine_support::{corpus, ds_config, scratch, tiny_gpt2_dir, Knobs};
use tierzero::config::{load_str, PathChecks, RunContext};
use tierzero::engine::{Trainer, TrainerOptions};
use tierzero::model::ModelDir;

#[test]
fn metrics_lines_have_the_documented_keys_and_exact_losses() {
    let dir = tiny_gpt2_dir("metrics", 2, 32);
    let swap = scratch("swap");
    let out = scratch("metrics").join("m.jsonl");
    let cfg = ds_config(&Knobs::nvme(), &swap, 3);
    let run = RunContext {
        path_checks: PathChecks::CreateMissing,
        ..RunContext::default()
    };
    let loaded = load_str(&cfg.to_string(), &run).unwrap();
    let md = ModelDir::open(&dir, 2).unwrap();
    let mut opts = TrainerOptions::cpu(2, 16);
    opts.metrics_path = Some(out.clone());
    let mut t = Trainer::new(&loaded.config, &md, corpus(), opts).unwrap();
    let losses: Vec<f32> = (0..3).map(|_| t.step().unwrap().metrics.loss).collect();
    let summary = t.finish().unwrap();
    let text = std::fs::read_to_string(&out).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 4);
    for (i, l) in lines[..3].iter().enumerate() {
        for key in [
            "step",
            "loss",
            "tokens_per_s",
            "compute_s",
            "io_wait_s",
            "optimizer_s",
            "idle_s",
            "bytes_read",
            "bytes_written",
            "peak_rss_bytes",
            "minor_faults",
            "overlap_efficiency",
        ] {
            assert!(l.get(key).is_some(), "line {i} lacks `{key}`: {l}");
        }
        assert_eq!(l["step"], (i + 1) as u64);
        // The f32 loss survives the text round trip bit for bit.
        let parsed = l["loss"].as_f64().unwrap() as f32;
        assert_eq!(parsed.to_bits(), losses[i].to_bits());
        assert!(l["bytes_read"]["nvme"].as_u64().unwrap() > 0);
        assert!(l["bytes_written"].get("cpu").is_some());
        assert!(l["peak_rss_bytes"].as_u64().unwrap() > 0);
    }
    let s = &lines[3];
    assert_eq!(s["summary"], true);
    assert_eq!(s["weight_sha256"], summary.weight_sha256.as_str());
    assert_eq!(s["steps"], 3);
}

/// The "I/O alone" mode of the overlap harness does the I/O of a real run
/// (same bytes read and written, per tier) without its compute, and I/O
/// busy time is a union over engines, so it never exceeds a step's wall
/// time. (Per-step bytes depend on timing, because the optimizer tail
/// overlaps the next step: the run totals are compared.)
#[test]
fn skip_compute_does_the_io_of_a_real_run_and_io_busy_fits_in_wall_time() {
    let dir = tiny_gpt2_dir("skip-compute", 2, 32);
    let run = |skip: bool| {
        let mut opts = TrainerOptions::cpu(3, 16);
        opts.skip_compute = skip;
        // Recomputing every block, as the I/O-alone arm of the harness
        // does (a kept block is not fetched again in backward, and without
        // compute no graph is measured).
        let k = Knobs {
            activation_budget: Some(0),
            ..Knobs::nvme()
        };
        let mut t = engine_support::build_with(&dir, &k, opts, 3);
        let m: Vec<_> = (0..3).map(|_| t.step().unwrap().metrics).collect();
        (m, t.finish().unwrap())
    };
    let (real, real_sum) = run(false);
    let (io_only, io_sum) = run(true);
    assert_eq!(real_sum.bytes_read, io_sum.bytes_read, "bytes read");
    assert_eq!(
        real_sum.bytes_written, io_sum.bytes_written,
        "bytes written"
    );
    assert!(real_sum.bytes_read["nvme"] > 0);
    for (i, (r, o)) in real.iter().zip(&io_only).enumerate() {
        assert!(
            o.compute_s < r.compute_s,
            "step {i}: compute was not skipped"
        );
        for m in [r, o] {
            assert!(
                m.io_busy_s <= m.wall_s,
                "step {i}: io_busy_s {} > wall_s {}",
                m.io_busy_s,
                m.wall_s
            );
        }
    }
}

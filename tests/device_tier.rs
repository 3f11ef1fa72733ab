//! The device tier (`tierzero::engine::device`) through the whole engine
//! on the simulated device: the same code a GPU runs through
//! `CudaLink`, with a memory budget, copies on a thread after a delay and
//! events that complete with the copy. The units compute on the CUDA
//! kernels' scalar references, so the in-memory path to compare with is
//! `ReferenceUnits`, the same arithmetic with no tier.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod engine_support;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use engine_support::*;
use tierzero::engine::device::sim::{SimConfig, SimDevice, SimProbe};
use tierzero::engine::device::{TierLimits, TierPeaks, TieredUnits};
use tierzero::engine::TrainerOptions;
use tierzero::model::exec_units::{DeviceMemoryPlan, ReferenceUnits};
use tierzero::model::ModelDir;
use tierzero_gpu::unit::GemmDtype;

/// What a run left.
struct Out {
    loss_bits: Vec<u32>,
    sha: String,
    h2d_bytes: u64,
    d2h_bytes: u64,
    h2d_wait_s: f64,
    device_busy_s: f64,
    h2d_busy_s: f64,
    h2d_kept_bytes: u64,
    /// Params' bytes copied in place from their registered pages.
    h2d_direct_bytes: u64,
    /// Params' bytes uploaded for the unit about to compute, not staged.
    h2d_at_use_bytes: u64,
    /// Kept swap buffers let go for a read ahead or a write-back.
    param_buffers_let_go: u64,
    /// The upload thread's busy time (its fills and issues).
    h2d_fill_busy_s: f64,
    /// Seconds of each step.
    wall_s: Vec<f64>,
    /// Forwards launched ahead and taken by their call.
    forwards_ahead: u64,
    /// Backwards launched ahead and taken by their call.
    backwards_ahead: u64,
    /// The compute's device rows for the plan (the tier's: what its
    /// params may hold, first).
    device_plan: Option<DeviceMemoryPlan>,
}

fn reference(model: &Path, k: &Knobs, steps: u64) -> Out {
    let mut opts = TrainerOptions::cpu(3, 16);
    opts.compute = Some(Arc::new(ReferenceUnits {
        gemm: GemmDtype::F32,
    }));
    run(model, k, opts, steps)
}

fn run(model: &Path, k: &Knobs, opts: TrainerOptions, steps: u64) -> Out {
    let compute = opts.compute.clone();
    let mut t = build_with(model, k, opts, steps);
    let mut out = Out {
        loss_bits: Vec::new(),
        sha: String::new(),
        h2d_bytes: 0,
        d2h_bytes: 0,
        h2d_wait_s: 0.0,
        device_busy_s: 0.0,
        h2d_busy_s: 0.0,
        h2d_kept_bytes: 0,
        h2d_direct_bytes: 0,
        h2d_at_use_bytes: 0,
        param_buffers_let_go: 0,
        h2d_fill_busy_s: 0.0,
        wall_s: Vec::new(),
        forwards_ahead: 0,
        backwards_ahead: 0,
        device_plan: compute.and_then(|c| c.memory_plan(t.model())),
    };
    for _ in 0..steps {
        let m = t.step().unwrap().metrics;
        out.loss_bits.push(m.loss.to_bits());
        out.h2d_bytes += m.h2d_bytes;
        out.d2h_bytes += m.d2h_bytes;
        out.h2d_wait_s += m.h2d_wait_s;
        out.device_busy_s += m.device_busy_s;
        out.h2d_busy_s += m.h2d_busy_s;
        out.h2d_kept_bytes += m.h2d_kept_bytes;
        out.h2d_direct_bytes += m.h2d_direct_bytes;
        out.h2d_at_use_bytes += m.h2d_at_use_bytes;
        out.param_buffers_let_go += m.param_buffers_let_go;
        out.h2d_fill_busy_s += m.h2d_fill_busy_s;
        out.wall_s.push(m.wall_s);
        out.forwards_ahead += m.device_forwards_ahead;
        out.backwards_ahead += m.device_backwards_ahead;
    }
    out.sha = t.finish().unwrap().weight_sha256;
    out
}

fn sim(budget_bytes: u64, delay_ms: u64, slots: usize) -> SimConfig {
    SimConfig {
        budget_bytes,
        copy_delay: Duration::from_millis(delay_ms),
        h2d_bytes_per_s: None,
        staging_slots: slots,
        gemm: GemmDtype::F32,
        fail_upload: None,
        compute_delay: std::time::Duration::ZERO,
    }
}

/// Trains on a tier over a simulated device; returns the run, the tier's
/// peaks, and the device's counters after the tier is dropped.
fn tiered(
    model: &Path,
    k: &Knobs,
    cfg: SimConfig,
    limits: TierLimits,
    steps: u64,
) -> (Out, TierPeaks, SimProbe) {
    tiered_with(model, k, cfg, limits, steps, true)
}

/// [`tiered`], launching units ahead or not.
fn tiered_with(
    model: &Path,
    k: &Knobs,
    cfg: SimConfig,
    limits: TierLimits,
    steps: u64,
    ahead: bool,
) -> (Out, TierPeaks, SimProbe) {
    tiered_on(model, k, SimDevice::new(cfg).unwrap(), limits, steps, ahead)
}

/// [`tiered_with`] on `dev`.
fn tiered_on(
    model: &Path,
    k: &Knobs,
    dev: SimDevice,
    limits: TierLimits,
    steps: u64,
    ahead: bool,
) -> (Out, TierPeaks, SimProbe) {
    let probe = dev.probe();
    let tier = Arc::new(TieredUnits::new(dev, limits).unwrap().launch_ahead(ahead));
    let mut opts = TrainerOptions::cpu(3, 16);
    opts.compute = Some(tier.clone());
    let out = run(model, k, opts, steps);
    let peaks = tier.peaks();
    drop(tier);
    (out, peaks, probe)
}

fn wide_open() -> TierLimits {
    TierLimits {
        prefetch_numel: u64::MAX,
        max_live_numel: u64::MAX,
        cache_bytes: 0,
    }
}

/// Everything went back: no device bytes, every staging buffer home, no
/// copy left, none that saw its buffer change.
fn assert_all_back(p: &SimProbe, what: &str) {
    if let Some(left) = sim_leftovers(p) {
        panic!("{what}: {left}");
    }
}

#[test]
fn the_device_tier_trains_bit_identical_to_the_in_memory_units() {
    let gpt2 = tiny_gpt2_dir("tier", 2, 32);
    let llama = tiny_llama_dir("tier");
    let knobs = [
        ("stage 0", Knobs::default()),
        (
            "stage 3 nvme, clipping, 2 micro-batches",
            Knobs {
                clip: 0.5,
                gas: 2,
                ..Knobs::nvme()
            },
        ),
    ];
    for (model, name) in [(&gpt2, "gpt2"), (&llama, "llama")] {
        for (what, k) in &knobs {
            let want = reference(model, k, 3);
            for cache_bytes in [0, 1 << 30, TierLimits::CACHE_AUTO] {
                let limits = TierLimits {
                    cache_bytes,
                    ..wide_open()
                };
                let (got, peaks, probe) = tiered(model, k, sim(64 << 20, 1, 3), limits, 3);
                let case = format!("{name}, {what}, cache {cache_bytes}");
                println!(
                    "{case}: h2d {} B ({} B kept on the device), d2h {} B, wait {:.3} s, peaks {peaks:?}",
                    got.h2d_bytes, got.h2d_kept_bytes, got.d2h_bytes, got.h2d_wait_s
                );
                // Blocks' inputs in forward and upstream gradients in
                // backward are the unit before's outputs, still there.
                assert!(got.h2d_kept_bytes > 0, "{case}: nothing kept");
                assert_eq!(got.loss_bits, want.loss_bits, "{case}: losses");
                assert_eq!(got.sha, want.sha, "{case}: weights");
                assert!(
                    got.h2d_bytes > 0 && got.d2h_bytes > 0,
                    "{case}: nothing moved"
                );
                assert!(peaks.ahead_numel > 0, "{case}: nothing was staged ahead");
                assert_all_back(&probe, &case);
            }
        }
    }
}

/// With copies faster than the compute (each unit takes at least 30 ms
/// on the simulated device's clock, launched asynchronously as on a GPU),
/// each unit's forward or backward is launched as the unit before it in
/// that pass comes down ("Units launched ahead" in
/// `tierzero::engine::device`) and taken by its call, with the same bits
/// as the in-memory units. A launch needs the unit's fills issued, which
/// on a loaded machine may come late: most are launched, not all. (With
/// the slow copies above, a unit's fills are often still queued then.)
#[test]
fn units_launched_ahead_train_bit_identical_to_the_in_memory_units() {
    let gpt2 = tiny_gpt2_dir("tier-ahead-train", 2, 32);
    let llama = tiny_llama_dir("tier-ahead-train");
    let nvme = Knobs {
        clip: 0.5,
        gas: 2,
        ..Knobs::nvme()
    };
    for (model, name) in [(&gpt2, "gpt2"), (&llama, "llama")] {
        for (what, k) in [
            ("stage 0", Knobs::default()),
            ("stage 3 nvme", nvme.clone()),
        ] {
            let case = format!("{name}, {what}");
            let want = reference(model, &k, 3);
            let cfg = SimConfig {
                compute_delay: Duration::from_millis(30),
                ..sim(64 << 20, 0, 64)
            };
            let (got, _, probe) = tiered(model, &k, cfg, wide_open(), 3);
            let blocks = blocks_in(model);
            // Per micro-batch: every block after the embedding in forward;
            // the head (forward and backward, as the last block's output
            // comes down), every block and the embedding in backward.
            let (fwd, bwd) = (3 * k.gas * blocks, 3 * k.gas * (blocks + 2));
            println!(
                "{case}: forwards launched ahead and taken {} of {fwd}, backwards {} of {bwd}",
                got.forwards_ahead, got.backwards_ahead
            );
            assert!(got.forwards_ahead * 2 > fwd, "{case}: forwards");
            assert!(got.backwards_ahead * 2 > bwd, "{case}: backwards");
            assert!(
                got.forwards_ahead <= fwd && got.backwards_ahead <= bwd,
                "{case}"
            );
            assert_eq!(got.loss_bits, want.loss_bits, "{case}: losses");
            assert_eq!(got.sha, want.sha, "{case}: weights");
            assert_all_back(&probe, &case);
        }
    }
}

/// The tier holds a staged unit's host params for a launch ahead only
/// until that unit's backward: after a step (its last backward is the
/// embedding's) it holds none, so the params the store released are
/// freed through the optimizer step, not kept until the next step's
/// start. Between micro-batches it may hold some.
#[test]
fn no_staged_host_params_are_held_past_a_steps_backward() {
    let model = tiny_gpt2_dir("tier-staged-held", 2, 32);
    let k = Knobs {
        gas: 2,
        ..Knobs::nvme()
    };
    let tier = Arc::new(
        TieredUnits::new(SimDevice::new(sim(64 << 20, 0, 64)).unwrap(), wide_open()).unwrap(),
    );
    let mut opts = TrainerOptions::cpu(3, 16);
    opts.compute = Some(tier.clone());
    let mut t = build_with(&model, &k, opts, 3);
    for step in 1..=3 {
        t.step().unwrap();
        assert_eq!(tier.staged_unit(), None, "after step {step}");
    }
    t.finish().unwrap();
}

/// What launching ahead gains on the simulated device, whose compute is
/// asynchronous with a `compute_delay` (each unit at least 20 ms on its
/// clock): stage 3 with params and optimizer state on NVMe, so the
/// engine's work between units includes its reads. Arms alternate; each
/// prints its steps' wall seconds (the first dropped) and the device's
/// busy share. The bits must match. A measurement, not a timed test:
/// `cargo test --release --test device_tier -- --ignored what_launching_ahead_gains --nocapture`.
#[test]
#[ignore = "a measurement: run it with --ignored --nocapture"]
fn what_launching_ahead_gains_on_the_simulated_device() {
    let model = tiny_gpt2_dir("tier-ahead-ab", 4, 64);
    let k = Knobs::nvme();
    let cfg = SimConfig {
        compute_delay: Duration::from_millis(20),
        h2d_bytes_per_s: Some(25e9),
        ..sim(64 << 20, 0, 64)
    };
    let mut sha = None;
    for round in 0..2 {
        for ahead in [true, false] {
            let (got, _, _) = tiered_with(&model, &k, cfg.clone(), wide_open(), 6, ahead);
            let walls = &got.wall_s[1..];
            let wall: f64 = walls.iter().sum::<f64>() / walls.len() as f64;
            println!(
                "round {round}, launch ahead {ahead}: {:.1} ms a step, device busy {:.0}% of the \
                 wall, {} forwards and {} backwards launched ahead",
                wall * 1e3,
                100.0 * got.device_busy_s / got.wall_s.iter().sum::<f64>(),
                got.forwards_ahead,
                got.backwards_ahead
            );
            assert_eq!(*sha.get_or_insert_with(|| got.sha.clone()), got.sha);
        }
    }
}

#[test]
fn the_device_cache_keeps_params_from_forward_to_backward() {
    let model = tiny_gpt2_dir("tier-cache", 2, 32);
    let k = Knobs::default();
    let run_with = |cache_bytes| {
        tiered(
            &model,
            &k,
            sim(64 << 20, 0, 2),
            TierLimits {
                cache_bytes,
                ..wide_open()
            },
            2,
        )
    };
    let (none, p0, _) = run_with(0);
    let (all, p1, probe) = run_with(1 << 30);
    println!(
        "h2d without a cache {} B, with {} B",
        none.h2d_bytes, all.h2d_bytes
    );
    assert_eq!(none.loss_bits, all.loss_bits);
    assert_eq!(p0.cached_bytes, 0);
    assert!(p1.cached_bytes > 0);
    // Every param crosses once per step instead of once per use: the
    // blocks' params are used twice (forward, backward), the embedding
    // table three times (tied: embedding forward, head, embedding
    // backward).
    assert!(
        all.h2d_bytes * 2 <= none.h2d_bytes + none.h2d_bytes / 4,
        "{} vs {}",
        all.h2d_bytes,
        none.h2d_bytes
    );
    assert_all_back(&probe, "cache");
}

#[test]
fn the_prefetch_window_live_params_and_device_budget_are_never_exceeded() {
    let model = tiny_gpt2_dir("tier-bounds", 2, 32);
    // A block of width 32: about 12 500 elements in 12 params, the
    // largest 3 072 (the MLP's matrices); the tied embedding table 8 192.
    let largest_param = 8192u64;
    for (prefetch_numel, max_live_numel, cache_bytes, budget_bytes) in [
        (1, u64::MAX, 0, 64 << 20),
        (4_000, 20_000, 0, 64 << 20),
        (10_000, 14_000, 40_000, 64 << 20),
        (u64::MAX, u64::MAX, 1 << 30, 80_000),
        (10_000, 14_000, TierLimits::CACHE_AUTO, 80_000),
        (4_000, u64::MAX, TierLimits::CACHE_AUTO, 64 << 20),
    ] {
        let limits = TierLimits {
            prefetch_numel,
            max_live_numel,
            cache_bytes,
        };
        let (out, peaks, probe) =
            tiered(&model, &Knobs::nvme(), sim(budget_bytes, 0, 2), limits, 2);
        println!(
            "{limits:?}, budget {budget_bytes}: {peaks:?}, h2d {} B",
            out.h2d_bytes
        );
        assert!(
            peaks.ahead_numel <= prefetch_numel.max(largest_param),
            "window {prefetch_numel}: {peaks:?}"
        );
        assert!(
            peaks.live_numel_at_stage <= max_live_numel,
            "live {max_live_numel}: {peaks:?}"
        );
        assert!(
            peaks.cached_bytes <= cache_bytes,
            "cache {cache_bytes}: {peaks:?}"
        );
        assert!(peaks.device_bytes <= budget_bytes, "budget: {peaks:?}");
        // The plan's bound on the tier's params holds, and is the
        // budget only when the budget is the tighter.
        let plan = out.device_plan.as_ref().unwrap();
        let bound = plan.rows[0].device_bytes;
        println!("  plan bound {bound} B, peak {} B", peaks.device_bytes);
        assert!(peaks.device_bytes <= bound, "plan {plan:?}: {peaks:?}");
        assert_eq!(plan.budget_bytes, budget_bytes);
        if budget_bytes > 1 << 20 {
            assert!(bound < 1 << 20, "the bound is not the budget: {plan:?}");
        }
        assert!(
            probe.peak_bytes() <= budget_bytes,
            "the device saw {}",
            probe.peak_bytes()
        );
        assert!(peaks.ahead_numel > 0, "nothing staged: {peaks:?}");
        assert_all_back(&probe, "bounds");
    }
}

/// `tierzero.device_cache_bytes: "auto"` under a budget smaller than the
/// model: the kept params fill what the budget leaves, fewer bytes cross
/// than without a cache, and they yield to the prefetch window, so no more
/// params upload at their unit's turn (unstaged) than without a cache (a
/// cache that filled the budget used to stop the staging).
#[test]
fn the_auto_cache_fills_the_budget_and_yields_to_the_prefetch_window() {
    let model = tiny_gpt2_dir("tier-auto-cache", 2, 32);
    // fp32: the tied table 32 KiB, a block about 50 KB, 133 KB in all.
    let budget_bytes = 90_000;
    let table_bytes = 8192 * 4;
    let run_with = |cache_bytes| {
        tiered(
            &model,
            &Knobs::nvme(),
            sim(budget_bytes, 0, 2),
            TierLimits {
                prefetch_numel: 10_000,
                max_live_numel: u64::MAX,
                cache_bytes,
            },
            3,
        )
    };
    let (none, p0, _) = run_with(0);
    let (auto, p1, probe) = run_with(TierLimits::CACHE_AUTO);
    println!(
        "without a cache: h2d {} B, {} B at use, peaks {p0:?}; auto: h2d {} B, {} B at use, \
         peaks {p1:?}",
        none.h2d_bytes, none.h2d_at_use_bytes, auto.h2d_bytes, auto.h2d_at_use_bytes
    );
    assert_eq!(none.loss_bits, auto.loss_bits);
    assert_eq!(none.sha, auto.sha);
    assert!(
        auto.h2d_bytes < none.h2d_bytes,
        "{} vs {}",
        auto.h2d_bytes,
        none.h2d_bytes
    );
    assert!(none.h2d_at_use_bytes > 0, "the budget held nothing back");
    assert!(
        auto.h2d_at_use_bytes <= none.h2d_at_use_bytes,
        "the cache held the window back: {} B uploaded at use, {} B without a cache",
        auto.h2d_at_use_bytes,
        none.h2d_at_use_bytes
    );
    // Filled: less room left than the largest param's.
    assert!(p1.device_bytes <= budget_bytes, "{p1:?}");
    assert!(p1.device_bytes + table_bytes > budget_bytes, "{p1:?}");
    assert_all_back(&probe, "auto cache");
}

#[test]
fn a_unit_larger_than_the_device_budget_is_an_error_with_the_numbers() {
    let model = tiny_gpt2_dir("tier-small", 2, 32);
    let dev = SimDevice::new(sim(20_000, 0, 2)).unwrap();
    let probe = dev.probe();
    let tier = Arc::new(TieredUnits::new(dev, wide_open()).unwrap());
    let mut opts = TrainerOptions::cpu(3, 16);
    opts.compute = Some(tier.clone());
    let mut t = build_with(&model, &Knobs::default(), opts, 1);
    let e = t.step().unwrap_err().to_string();
    assert!(
        e.contains("20000 byte device budget") && e.contains("tierzero.device_budget_bytes"),
        "{e}"
    );
    drop(t);
    drop(tier);
    assert_all_back(&probe, "too small");
}

#[test]
fn no_staging_buffer_is_reused_before_its_copy_completes() {
    let model = tiny_llama_dir("tier-slots");
    for slots in [1, 2] {
        // Every upload through staging: a device that registers nothing
        // (cpu-tier params would otherwise cross from their pages in
        // place, with no staging buffer).
        let dev = SimDevice::new(sim(64 << 20, 2, slots))
            .unwrap()
            .without_registration();
        let (out, _, probe) = tiered_on(&model, &Knobs::cpu(), dev, wide_open(), 2, true);
        assert!(out.h2d_bytes > 0);
        assert!(
            probe.peak_in_flight() <= slots as u64,
            "{} copies in flight on {slots} staging buffers",
            probe.peak_in_flight()
        );
        assert_eq!(probe.copies(), probe.uploads(), "every upload was copied");
        assert_all_back(&probe, "slots");
    }
}

#[test]
fn a_step_dropped_mid_copy_returns_every_buffer() {
    let model = tiny_gpt2_dir("tier-drop", 2, 32);
    // Fail uploads at several points of the step (staged ahead, or when
    // a unit runs) while other copies are in flight: params from NVMe
    // through staging, and params copied in place from their pages (the
    // trainer, and with it the pages, dropped before the tier).
    for (k, nth) in [2, 7, 15, 30]
        .into_iter()
        .flat_map(|n| [(Knobs::nvme(), n), (Knobs::cpu(), n)])
    {
        let dev = SimDevice::new(SimConfig {
            fail_upload: Some(nth),
            compute_delay: std::time::Duration::ZERO,
            ..sim(64 << 20, 5, 3)
        })
        .unwrap();
        let probe = dev.probe();
        let tier = Arc::new(TieredUnits::new(dev, wide_open()).unwrap());
        let mut opts = TrainerOptions::cpu(3, 16);
        opts.compute = Some(tier.clone());
        let mut t = build_with(&model, &k, opts, 2);
        let e = t.step().unwrap_err().to_string();
        assert!(e.contains(&format!("upload {nth}")), "{e}");
        drop(t);
        drop(tier);
        assert_all_back(&probe, &format!("{}: failed upload {nth}", k.param));
    }
}

#[test]
fn an_upload_slower_than_compute_makes_the_step_wait_not_race() {
    let model = tiny_gpt2_dir("tier-slow", 2, 32);
    let k = Knobs::default();
    let want = reference(&model, &k, 2);
    let (slow, _, probe) = tiered(&model, &k, sim(64 << 20, 25, 2), wide_open(), 2);
    println!("25 ms copies: waited {:.3} s", slow.h2d_wait_s);
    assert_eq!(slow.loss_bits, want.loss_bits);
    assert_eq!(slow.sha, want.sha);
    // Every upload's copy takes 25 ms on one copy thread, far longer than
    // the tiny units compute, so the compute thread waited for most of
    // the copies' time (for a staging buffer, or for a copy's event).
    let copies_s = probe.uploads() as f64 * 0.025;
    println!("{} uploads: {copies_s:.3} s of copies", probe.uploads());
    assert!(
        slow.h2d_wait_s > 0.5 * copies_s,
        "waited {:.3} s of {copies_s:.3} s of copies",
        slow.h2d_wait_s
    );
    assert_all_back(&probe, "slow");
}

/// The simulated device's spans: its copies run on their own queue while
/// units compute (the next unit's params upload during this unit's
/// compute), the metrics' busy times are theirs, and the bound the plan
/// prints for the staging buffers is what the device has.
#[test]
fn copies_overlap_compute_on_the_device_queues() {
    let model = tiny_gpt2_dir("tier-spans", 2, 32);
    let cfg = SimConfig {
        h2d_bytes_per_s: Some(20e6),
        ..sim(64 << 20, 0, 64)
    };
    let dev = SimDevice::new(cfg).unwrap();
    let probe = dev.probe();
    let tier = Arc::new(TieredUnits::new(dev, wide_open()).unwrap());
    let mut opts = TrainerOptions::cpu(3, 16);
    opts.compute = Some(tier.clone());
    let timeline = tierzero::engine::Timeline::new(1, 2);
    opts.timeline = Some(timeline.clone());
    let out = run(&model, &Knobs::default(), opts, 2);
    drop(tier);
    assert_all_back(&probe, "spans");
    println!(
        "compute busy {:.4} s, h2d busy {:.4} s, {} B up",
        out.device_busy_s, out.h2d_busy_s, out.h2d_bytes
    );
    assert!(out.device_busy_s > 0.0 && out.h2d_busy_s > 0.0);
    // 20 MB/s: the copies alone take at least their bytes' time.
    let copy_floor_s = out.h2d_bytes as f64 / 20e6;
    assert!(
        out.h2d_busy_s >= 0.9 * copy_floor_s,
        "{} s busy for {copy_floor_s} s of bytes",
        out.h2d_busy_s
    );
    let v = timeline.to_json();
    let ev = v["traceEvents"].as_array().unwrap();
    let lane = |name: &str| -> Vec<(f64, f64)> {
        let tid = ev
            .iter()
            .find(|e| e["ph"] == "M" && e["args"]["name"] == name)
            .unwrap()["tid"]
            .clone();
        ev.iter()
            .filter(|e| e["ph"] == "X" && e["tid"] == tid)
            .map(|e| {
                let ts = e["ts"].as_f64().unwrap();
                (ts, ts + e["dur"].as_f64().unwrap())
            })
            .collect()
    };
    let compute = lane("device: compute");
    let h2d = lane("device: h2d");
    // GPT-2 of 2 blocks: the embedding and 2 blocks forward, and 4
    // units backward (the head's forward and loss are its backward's),
    // in each of 2 steps.
    assert_eq!(compute.len(), 2 * 7, "{compute:?}");
    assert!(!h2d.is_empty());
    let overlap_us: f64 = h2d
        .iter()
        .flat_map(|&(a, b)| {
            compute
                .iter()
                .map(move |&(c, e)| (b.min(e) - a.max(c)).max(0.0))
        })
        .sum();
    println!("copies overlapping compute: {:.1} ms", overlap_us / 1e3);
    assert!(overlap_us > 0.0, "no copy ran while a unit computed");
    // The gradients download while the next unit computes: some d2h
    // span overlaps a compute span. A unit's gradients are issued after
    // its compute ended, so the compute they overlap is a later unit's
    // (launched ahead, it may start before the copy thread picks them).
    let d2h = lane("device: d2h");
    assert!(!d2h.is_empty());
    let down_overlap_us: f64 = d2h
        .iter()
        .flat_map(|&(a, b)| {
            compute
                .iter()
                .map(move |&(c, e)| (b.min(e) - a.max(c)).max(0.0))
        })
        .sum();
    println!(
        "gradient downloads overlapping a later unit's compute: {:.1} ms",
        down_overlap_us / 1e3
    );
    assert!(
        down_overlap_us > 0.0,
        "no download ran under the next unit's compute"
    );
    assert!(probe.downloads() > 0);
    let plan = out.device_plan.unwrap();
    let staging = plan
        .rows
        .iter()
        .find(|r| r.what.contains("staging"))
        .unwrap();
    assert_eq!(staging.pinned_bytes, 64 * 8192 * 4, "{plan:?}");
}

/// Params whose home is a cpu-tier page cross from the page itself: the
/// trainer maps the pages with the simulated device's registrar, and each
/// staged or loaded param's upload reads its pinned range in place at the
/// end of the copy's time, with no staging fill (`h2d_direct_bytes`). The
/// pin is held until the copy is done, so a write-back into the page
/// waits for it, and the simulated copy would read the new bytes if it
/// did not. The bits are the in-memory units', in fp32 and bf16. A device
/// that registers nothing sends the same params through staging, with the
/// same bits.
#[test]
fn cpu_tier_params_cross_from_their_registered_pages_in_place() {
    let gpt2 = tiny_gpt2_dir("tier-pinned", 2, 32);
    let llama = tiny_llama_dir("tier-pinned");
    for (model, name) in [(&gpt2, "gpt2"), (&llama, "llama")] {
        for precision in ["fp32", "bf16"] {
            let k = Knobs {
                precision,
                clip: 0.5,
                gas: 2,
                ..Knobs::cpu()
            };
            for registered in [true, false] {
                let case = format!("{name}, {precision}, registered {registered}");
                in_place_or_staged(model, &k, registered, &case);
            }
        }
    }
}

/// Trains 3 steps with `k` on the simulated device, its homes registered
/// or not, against the in-memory units; checks the bits, that params
/// crossed in place exactly when `registered` (and never all of what
/// crossed: the units' inputs go through staging), and that every pin and
/// buffer came back. The run.
fn in_place_or_staged(model: &Path, k: &Knobs, registered: bool, case: &str) -> Out {
    let gemm = k.gemm_dtype();
    let mut opts = TrainerOptions::cpu(3, 16);
    opts.compute = Some(Arc::new(ReferenceUnits { gemm }));
    let want = run(model, k, opts, 3);
    let mut dev = SimDevice::new(SimConfig {
        gemm,
        ..sim(64 << 20, 1, 3)
    })
    .unwrap();
    if !registered {
        dev = dev.without_registration();
    }
    let (got, _, probe) = tiered_on(model, k, dev, wide_open(), 3, true);
    println!(
        "{case}: h2d {} B, {} B of it in place in {} copies; {} kept swap buffers let go; \
         upload thread busy {:.3} s",
        got.h2d_bytes,
        got.h2d_direct_bytes,
        probe.direct_copies(),
        got.param_buffers_let_go,
        got.h2d_fill_busy_s
    );
    assert_eq!(got.loss_bits, want.loss_bits, "{case}: losses");
    assert_eq!(got.sha, want.sha, "{case}: weights");
    assert_eq!(got.h2d_direct_bytes, probe.direct_bytes(), "{case}");
    if registered {
        assert!(probe.direct_copies() > 0, "{case}: nothing in place");
        assert!(got.h2d_direct_bytes < got.h2d_bytes, "{case}");
    } else {
        assert_eq!(probe.direct_copies(), 0, "{case}");
        assert_eq!(got.param_buffers_let_go, 0, "{case}: nothing kept");
    }
    assert_all_back(&probe, case);
    got
}

/// NVMe-tier params cross from the swap buffer their read landed in:
/// the trainer maps the param swap buffers with the simulated device's
/// registrar, the store keeps each landed read's buffer with the tensor
/// built from it, and the staged or loaded param's upload reads the
/// buffer in place (`h2d_direct_bytes`), the buffer going back to the pool
/// when the copy is done. With two buffers, kept buffers yield to the
/// reads ahead (fewer params cross in place, none is read late). The bits
/// are the in-memory units' in fp32 and bf16, and a device that registers
/// nothing sends the same params through staging with the same bits.
#[test]
fn nvme_tier_params_cross_from_the_swap_buffers_their_reads_landed_in() {
    let gpt2 = tiny_gpt2_dir("tier-kept", 2, 32);
    let llama = tiny_llama_dir("tier-kept");
    for (model, name) in [(&gpt2, "gpt2"), (&llama, "llama")] {
        for precision in ["fp32", "bf16"] {
            // Bytes in place with 8 buffers, then with 2.
            let mut in_place = Vec::new();
            for buffers in [8, 2] {
                let k = Knobs {
                    precision,
                    clip: 0.5,
                    gas: 2,
                    param_buffer_count: buffers,
                    ..Knobs::nvme()
                };
                for registered in [true, false] {
                    let case =
                        format!("{name}, {precision}, {buffers} buffers, registered {registered}");
                    let got = in_place_or_staged(model, &k, registered, &case);
                    if registered {
                        in_place.push(got.h2d_direct_bytes);
                    }
                }
            }
            // Two buffers keep fewer: they yield to the reads ahead.
            assert!(
                in_place[1] < in_place[0],
                "{name}, {precision}: {in_place:?}"
            );
        }
    }
}

/// bf16 params through the tier: the same bits as the in-memory units
/// with bf16 params (the device keeps them in bf16, the GEMMs read them
/// as they are, other kernels widen them; the outputs are rounded back
/// once), with and without the cache, in half the device bytes.
#[test]
fn bf16_params_through_the_device_tier_are_bit_identical_too() {
    let model = tiny_llama_dir("tier-bf16");
    let k = Knobs {
        precision: "bf16",
        clip: 0.5,
        ..Knobs::nvme()
    };
    let mut opts = TrainerOptions::cpu(3, 16);
    opts.compute = Some(Arc::new(ReferenceUnits {
        gemm: GemmDtype::Bf16,
    }));
    let want = run(&model, &k, opts, 3);
    for cache_bytes in [0, 1 << 30] {
        let limits = TierLimits {
            cache_bytes,
            ..wide_open()
        };
        let cfg = SimConfig {
            gemm: GemmDtype::Bf16,
            ..sim(64 << 20, 0, 4)
        };
        let (got, peaks, probe) = tiered(&model, &k, cfg.clone(), limits, 3);
        assert_eq!(got.loss_bits, want.loss_bits, "cache {cache_bytes}");
        assert_eq!(got.sha, want.sha, "cache {cache_bytes}");
        // Every bf16 buffer's 2-byte count came back when it was freed.
        assert_all_back(&probe, "bf16");
        // Against the same run in fp32 (`assert_half_traffic`).
        let fp32 = Knobs {
            precision: "fp32",
            ..k.clone()
        };
        let (wide, wide_peaks, wide_probe) = tiered(&model, &fp32, cfg, limits, 3);
        // The params stay on the device as they crossed: the same
        // schedule (the windows count elements) in half the bytes, on
        // the tier's count and on the device's.
        println!(
            "cache {cache_bytes}: device peak {} B in bf16, {} B in fp32 (the device saw {} B, {} B)",
            peaks.device_bytes,
            wide_peaks.device_bytes,
            probe.peak_bytes(),
            wide_probe.peak_bytes()
        );
        assert_eq!(peaks.live_numel, wide_peaks.live_numel);
        assert_eq!(2 * peaks.device_bytes, wide_peaks.device_bytes);
        assert_eq!(2 * peaks.cached_bytes, wide_peaks.cached_bytes);
        assert_eq!(2 * probe.peak_bytes(), wide_probe.peak_bytes());
        assert_eq!(got.h2d_kept_bytes, 0);
        assert_half_traffic(&format!("cache {cache_bytes}, bf16"), &got, &wide);
    }
}

/// A 16-bit run's traffic against the same run in fp32 (`wide`): its
/// params and activations cross as 2-byte elements (the rotary tables
/// stay fp32), about half the fp32 run's uploads (and the outputs it kept
/// on the device; 16-bit outputs are not kept, their host copies are
/// rounded); its param gradients come back rounded on the device, 2
/// bytes each (the input gradients and the outputs stay fp32 on the way).
fn assert_half_traffic(case: &str, got: &Out, wide: &Out) {
    let wide_in = wide.h2d_bytes + wide.h2d_kept_bytes;
    println!(
        "{case}: h2d {} B against {wide_in} B in fp32, d2h {} B against {} B",
        got.h2d_bytes, got.d2h_bytes, wide.d2h_bytes
    );
    assert!(
        got.h2d_bytes * 100 <= wide_in * 55,
        "{case}: h2d {} B vs fp32 {wide_in} B",
        got.h2d_bytes,
    );
    assert!(
        got.d2h_bytes * 100 <= wide.d2h_bytes * 75,
        "{case}: d2h {} B vs fp32 {} B",
        got.d2h_bytes,
        wide.d2h_bytes
    );
}

/// fp16 params through the tier: the same bits as the in-memory units
/// with fp16 params, through steps that overflow at the initial loss
/// scale and are skipped (the head's gradient at the scale, each unit's
/// gradients rounded to fp16 once, on the device). fp16 crosses as it is,
/// 2 bytes an element (in place from registered pages), and params stay
/// fp16 on the device: half an fp32 run's upload bytes and device bytes.
#[test]
fn fp16_params_through_the_device_tier_are_bit_identical_and_skip_the_same_steps() {
    let model = tiny_llama_dir("tier-fp16");
    for base in [Knobs::nvme(), Knobs::cpu()] {
        let k = Knobs {
            precision: "fp16",
            initial_scale_power: 18,
            clip: 0.5,
            ..base
        };
        let mut opts = TrainerOptions::cpu(3, 16);
        opts.compute = Some(Arc::new(ReferenceUnits {
            gemm: GemmDtype::F16,
        }));
        let mut t = build_with(&model, &k, opts, 4);
        let skipped: Vec<bool> = (0..4).map(|_| t.step().unwrap().metrics.skipped).collect();
        t.finish().unwrap();
        assert!(
            skipped.iter().any(|&s| s),
            "{}: no step overflowed",
            k.param
        );
        let mut opts = TrainerOptions::cpu(3, 16);
        opts.compute = Some(Arc::new(ReferenceUnits {
            gemm: GemmDtype::F16,
        }));
        let want = run(&model, &k, opts, 4);
        for cache_bytes in [0, 1 << 30] {
            let case = format!("{}, cache {cache_bytes}", k.param);
            let limits = TierLimits {
                cache_bytes,
                ..wide_open()
            };
            let cfg = SimConfig {
                gemm: GemmDtype::F16,
                ..sim(64 << 20, 0, 4)
            };
            let (got, peaks, probe) = tiered(&model, &k, cfg.clone(), limits, 4);
            println!("{case}: skipped {skipped:?}, h2d {} B", got.h2d_bytes);
            assert_eq!(got.loss_bits, want.loss_bits, "{case}");
            assert_eq!(got.sha, want.sha, "{case}");
            assert!(
                probe.direct_copies() > 0,
                "{case}: nothing crossed in place"
            );
            assert_all_back(&probe, &case);
            let fp32 = Knobs {
                precision: "fp32",
                ..k.clone()
            };
            let (wide, wide_peaks, _) = tiered(&model, &fp32, cfg, limits, 4);
            println!(
                "{case}: device peak {} B in fp16, {} B in fp32",
                peaks.device_bytes, wide_peaks.device_bytes
            );
            assert_eq!(2 * peaks.device_bytes, wide_peaks.device_bytes, "{case}");
            // Gradients rounded to fp16 on the device: the same bits as
            // the host's rounding (above), 2 bytes each.
            assert_half_traffic(&format!("{case}, fp16"), &got, &wide);
        }
    }
}

/// The unit about to compute goes first: [`UnitCompute::load`] issues
/// its missing uploads before the next unit is staged, so the copy queue
/// carries them first, and what was staged for it leaves the prefetch
/// window, which the next unit then fills whole.
#[test]
fn the_unit_computing_uploads_before_the_next_one_is_staged() {
    use tierzero::model::exec_units::UnitCompute;
    use tierzero::model::UnitId;
    let dir = tiny_gpt2_dir("tier-first", 2, 32);
    let md = ModelDir::open(&dir, 1).unwrap();
    let m = md.model();
    let host = |u: usize| -> Vec<candle_core::Tensor> {
        m.units()[u]
            .params
            .iter()
            .map(|p| {
                let spec = &m.params()[p.0];
                candle_core::Tensor::zeros(
                    spec.shape.as_slice(),
                    candle_core::DType::F32,
                    &candle_core::Device::Cpu,
                )
                .unwrap()
            })
            .collect()
    };
    let numel = |u: usize| -> u64 {
        m.units()[u]
            .params
            .iter()
            .map(|p| m.params()[p.0].numel as u64)
            .sum()
    };
    let names = |u: usize| -> Vec<String> {
        m.units()[u]
            .params
            .iter()
            .map(|p| format!("param {}", p.0))
            .collect()
    };
    // A window of exactly one block (unit 1 and unit 2 are alike).
    assert_eq!(numel(1), numel(2));
    let dev = SimDevice::new(sim(64 << 20, 2, 64)).unwrap();
    let probe = dev.probe();
    let tier = TieredUnits::new(
        dev,
        TierLimits {
            prefetch_numel: numel(1),
            ..wide_open()
        },
    )
    .unwrap();
    tier.begin_step().unwrap();
    // The embedding computes next; block 0 is staged behind it.
    let (h0, h1, h2) = (host(0), host(1), host(2));
    tier.load(m, UnitId(0), &h0, Vec::new()).unwrap();
    tier.stage(m, UnitId(1), &h1, Vec::new()).unwrap();
    let c = tier.census();
    assert_eq!(c.get("loading"), Some(&h0.len()), "{c:?}");
    // The embedding's params are not ahead of use: block 0 fits whole.
    assert_eq!(c.get("uploading"), Some(&h1.len()), "{c:?}");
    // Block 0 computes next: its staged uploads leave the window, so
    // block 1 is staged whole too.
    tier.load(m, UnitId(1), &h1, Vec::new()).unwrap();
    tier.stage(m, UnitId(2), &h2, Vec::new()).unwrap();
    let c = tier.census();
    assert_eq!(c.get("loading"), Some(&(h0.len() + h1.len())), "{c:?}");
    assert_eq!(c.get("uploading"), Some(&h2.len()), "{c:?}");
    assert!(tier.peaks().ahead_numel <= numel(1));
    // The copies ran in the order issued: the embedding's, then block
    // 0's, then block 1's (the upload thread issues them as it fills).
    let want: Vec<String> = [names(0), names(1), names(2)].concat();
    let mut order: Vec<String> = Vec::new();
    let t0 = std::time::Instant::now();
    // (The copies' spans only: the upload thread's fills are spans of
    // the same names, on their own queue.)
    while order.len() < want.len() && t0.elapsed() < Duration::from_secs(20) {
        order.extend(
            tier.take_device_spans()
                .into_iter()
                .filter(|s| s.queue == tierzero::model::exec_units::DeviceQueue::H2d)
                .map(|s| s.name),
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(order, want);
    tier.begin_step().unwrap();
    drop(tier);
    assert_all_back(&probe, "after the step");
}

/// Staging the next unit does not fill its staging buffers on the
/// engine's thread: the tier's upload thread issues them, while this unit
/// would compute. With one staging buffer and slow copies, each upload
/// after the first waits for the copy before it; `stage` returns before
/// those waits, and dropping the staged params (a new step) waits for
/// every one and returns every buffer.
#[test]
fn staging_the_next_unit_returns_before_its_uploads_are_issued() {
    use tierzero::model::exec_units::UnitCompute;
    use tierzero::model::UnitId;
    let dir = tiny_gpt2_dir("tier-fill", 2, 32);
    let md = ModelDir::open(&dir, 1).unwrap();
    let m = md.model();
    let h1: Vec<candle_core::Tensor> = m.units()[1]
        .params
        .iter()
        .map(|p| {
            candle_core::Tensor::zeros(
                m.params()[p.0].shape.as_slice(),
                candle_core::DType::F32,
                &candle_core::Device::Cpu,
            )
            .unwrap()
        })
        .collect();
    assert!(h1.len() >= 4, "a block has {} params", h1.len());
    let delay_ms = 200u64;
    let dev = SimDevice::new(sim(64 << 20, delay_ms, 1)).unwrap();
    let probe = dev.probe();
    let tier = TieredUnits::new(dev, wide_open()).unwrap();
    tier.begin_step().unwrap();
    let t0 = std::time::Instant::now();
    tier.stage(m, UnitId(1), &h1, Vec::new()).unwrap();
    // Issuing them all on this thread would have waited for n - 1 copies
    // (each upload needs the one staging buffer back): all n issued by
    // its return. The upload thread issues one a copy. By the outcome,
    // not the clock (a bound on `stage`'s time was at the mercy of a
    // loaded machine): a stall of half the copies' time between the
    // return and this look would be needed to fail it.
    let issued = probe.uploads();
    let staged = t0.elapsed();
    assert_eq!(tier.census().get("uploading"), Some(&h1.len()));
    let serial = Duration::from_millis(delay_ms * (h1.len() as u64 - 1));
    println!("stage returned after {staged:?}, {issued} uploads issued; issuing in series takes {serial:?}");
    assert!(
        issued <= (h1.len() as u64 - 1) / 2,
        "{issued} of {} uploads issued when stage returned",
        h1.len()
    );
    tier.begin_step().unwrap();
    let dropped = t0.elapsed();
    assert!(
        dropped >= serial,
        "dropped after {dropped:?}, before the copies ({serial:?})"
    );
    assert_eq!(probe.uploads(), h1.len() as u64);
    drop(tier);
    assert_all_back(&probe, "after the staged params were dropped");
}

/// Waits (up to 20 s) until `n` uploads are done on the simulated device:
/// their fills were issued before.
fn uploads_done(probe: &SimProbe, n: u64) {
    let t0 = std::time::Instant::now();
    while probe.uploads() < n {
        assert!(t0.elapsed() < Duration::from_secs(20), "uploads not done");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Random host params of unit `u` (fp32), as the engine hands them over.
fn random_params(m: &tierzero::model::Model, u: usize, seed: u64) -> Vec<candle_core::Tensor> {
    m.units()[u]
        .params
        .iter()
        .enumerate()
        .map(|(k, p)| {
            let spec = &m.params()[p.0];
            let n = spec.numel;
            // A fixed pattern per (seed, param): small, varied values.
            let v: Vec<f32> = (0..n)
                .map(|i| {
                    let x = (i as u64).wrapping_mul(2654435761) ^ (seed * 97 + k as u64);
                    ((x % 2001) as f32 - 1000.0) * 2e-5
                })
                .collect();
            candle_core::Tensor::from_vec(v, spec.shape.as_slice(), &candle_core::Device::Cpu)
                .unwrap()
        })
        .collect()
}

fn hidden_bits(out: &tierzero::model::UnitOutput) -> Vec<u32> {
    match out {
        tierzero::model::UnitOutput::Hidden(t) | tierzero::model::UnitOutput::Loss(t) => t
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .into_iter()
            .map(f32::to_bits)
            .collect(),
    }
}

/// Once a unit's output came down, the staged next block's forward is
/// launched on it; the engine's call for that block takes it (no second
/// compute, the same bits as computing it then), and a call on another
/// input gives it back unused and computes afresh. A launched forward
/// left at a new step returns its params: nothing stays in use.
#[test]
fn the_next_block_s_forward_is_launched_ahead_and_taken_by_its_call() {
    use tierzero::model::exec_units::UnitCompute;
    use tierzero::model::{UnitId, UnitInput};
    let dir = tiny_gpt2_dir("tier-ahead", 2, 32);
    let md = ModelDir::open(&dir, 1).unwrap();
    let m = md.model();
    let (h0, h1, h2) = (
        random_params(m, 0, 1),
        random_params(m, 1, 2),
        random_params(m, 2, 3),
    );
    let ids = candle_core::Tensor::from_vec(
        vec![1u32, 5, 9, 3, 7, 2, 8, 4],
        (2, 4),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let reference = ReferenceUnits {
        gemm: GemmDtype::F32,
    };
    let want0 = reference
        .forward_unit(m, UnitId(0), &h0, UnitInput::Tokens(&ids))
        .unwrap();
    let tierzero::model::UnitOutput::Hidden(x0) = &want0 else {
        panic!("the embedding gave a loss")
    };
    let want1 = reference
        .forward_unit(m, UnitId(1), &h1, UnitInput::Hidden(x0))
        .unwrap();

    let dev = SimDevice::new(sim(64 << 20, 0, 64)).unwrap();
    let probe = dev.probe();
    let tier = TieredUnits::new(dev, wide_open()).unwrap();
    let ahead = |tier: &TieredUnits<SimDevice>| tier.take_traffic().unwrap().forwards_ahead;
    let copied = |n: u64| uploads_done(&probe, n);
    for round in 0..2 {
        tier.begin_step().unwrap();
        let base = probe.uploads();
        tier.load(m, UnitId(0), &h0, Vec::new()).unwrap();
        tier.stage(m, UnitId(1), &h1, Vec::new()).unwrap();
        copied(base + (h0.len() + h1.len()) as u64);
        let got0 = tier
            .forward_unit(m, UnitId(0), &h0, UnitInput::Tokens(&ids))
            .unwrap();
        assert_eq!(
            hidden_bits(&got0),
            hidden_bits(&want0),
            "round {round}: embedding"
        );
        let tierzero::model::UnitOutput::Hidden(y0) = &got0 else {
            panic!("the embedding gave a loss")
        };
        // Block 0's forward was launched on it: its params are in use.
        assert_eq!(
            tier.census().get("in use"),
            Some(&h1.len()),
            "round {round}: {:?}",
            tier.census()
        );
        assert_eq!(ahead(&tier), 0, "round {round}: counted before its call");
        tier.load(m, UnitId(1), &h1, Vec::new()).unwrap();
        let base = probe.uploads();
        tier.stage(m, UnitId(2), &h2, Vec::new()).unwrap();
        copied(base + h2.len() as u64);
        if round == 0 {
            // The call on that input takes it.
            let got1 = tier
                .forward_unit(m, UnitId(1), &h1, UnitInput::Hidden(y0))
                .unwrap();
            assert_eq!(
                hidden_bits(&got1),
                hidden_bits(&want1),
                "block 0 launched ahead"
            );
            assert_eq!(ahead(&tier), 1, "the launched forward was not taken");
        } else {
            // A call on another input (same values, another tensor)
            // gives it back and computes afresh, with the same bits.
            let other = y0.copy().unwrap();
            let got1 = tier
                .forward_unit(m, UnitId(1), &h1, UnitInput::Hidden(&other))
                .unwrap();
            assert_eq!(
                hidden_bits(&got1),
                hidden_bits(&want1),
                "block 0 computed afresh"
            );
            assert_eq!(ahead(&tier), 0, "a forward on another input was taken");
        }
        // Block 1's forward is launched in turn; the new step gives it
        // back.
        assert_eq!(tier.census().get("in use"), Some(&h2.len()));
    }
    tier.begin_step().unwrap();
    assert_eq!(tier.census().get("in use"), None);
    drop(tier);
    assert_all_back(&probe, "after the launched forwards were given back");
}

/// A staged block whose upload the upload thread has not issued yet (it
/// waits for the only staging buffer, held by a slow copy) is not
/// launched ahead: the tier never waits for a fill there.
#[test]
fn a_block_still_waiting_for_its_fills_is_not_launched_ahead() {
    use tierzero::model::exec_units::UnitCompute;
    use tierzero::model::{UnitId, UnitInput};
    let dir = tiny_gpt2_dir("tier-ahead-wait", 2, 32);
    let md = ModelDir::open(&dir, 1).unwrap();
    let m = md.model();
    let (h0, h1) = (random_params(m, 0, 1), random_params(m, 1, 2));
    let ids = candle_core::Tensor::from_vec(vec![1u32, 5, 9, 3], (1, 4), &candle_core::Device::Cpu)
        .unwrap();
    // One staging buffer, 300 ms a copy: block 0's second upload is not
    // issued until its first copy is done.
    let dev = SimDevice::new(sim(64 << 20, 300, 1)).unwrap();
    let probe = dev.probe();
    let tier = TieredUnits::new(dev, wide_open()).unwrap();
    tier.begin_step().unwrap();
    tier.load(m, UnitId(0), &h0, Vec::new()).unwrap();
    tier.stage(m, UnitId(1), &h1, Vec::new()).unwrap();
    let out = tier
        .forward_unit(m, UnitId(0), &h0, UnitInput::Tokens(&ids))
        .unwrap();
    assert!(matches!(out, tierzero::model::UnitOutput::Hidden(_)));
    assert_eq!(tier.census().get("in use"), None, "{:?}", tier.census());
    tier.begin_step().unwrap();
    drop(tier);
    assert_all_back(&probe, "after the step");
}

fn bits(t: &candle_core::Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// In backward, once a unit's input gradient came down, the staged unit
/// before it is launched on it and on its input in the last forward; the
/// engine's call takes it, with the same input and param gradients as
/// computing it then; a call with another upstream gradient gives it
/// back and computes afresh. A forward launched ahead that a backward
/// meets is given back.
#[test]
fn the_unit_before_s_backward_is_launched_ahead_and_taken_by_its_call() {
    use tierzero::model::exec_units::UnitCompute;
    use tierzero::model::{UnitGrads, UnitId, UnitInput, UnitOutput, Upstream};
    let dir = tiny_gpt2_dir("tier-ahead-bwd", 2, 32);
    let md = ModelDir::open(&dir, 1).unwrap();
    let m = md.model();
    let h: Vec<Vec<candle_core::Tensor>> =
        (0..3).map(|u| random_params(m, u, u as u64 + 1)).collect();
    let ids = candle_core::Tensor::from_vec(
        vec![1u32, 5, 9, 3, 7, 2, 8, 4],
        (2, 4),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let reference = ReferenceUnits {
        gemm: GemmDtype::F32,
    };
    let dev = SimDevice::new(sim(64 << 20, 0, 64)).unwrap();
    let probe = dev.probe();
    let tier = TieredUnits::new(dev, wide_open()).unwrap();
    let copied = |n: u64| uploads_done(&probe, n);
    // `load(now)`, `stage(next)`, as the engine calls them, then the
    // staged unit's fills done.
    let load_stage = |now: usize, next: usize| {
        tier.load(m, UnitId(now), &h[now], Vec::new()).unwrap();
        let base = probe.uploads();
        tier.stage(m, UnitId(next), &h[next], Vec::new()).unwrap();
        copied(base + h[next].len() as u64);
    };
    let hidden = |o: UnitOutput| match o {
        UnitOutput::Hidden(t) => t,
        UnitOutput::Loss(_) => panic!("a loss"),
    };
    // Their params' gradients from the tier, in declared order.
    let grads = |u: usize| -> Vec<Vec<u32>> {
        tier.take_grads(UnitId(u))
            .unwrap()
            .unwrap()
            .iter()
            .map(|(_, g)| bits(g))
            .collect()
    };
    let want_grads =
        |g: &UnitGrads| -> Vec<Vec<u32>> { g.params.iter().map(|(_, t)| bits(t)).collect() };

    tier.begin_step().unwrap();
    load_stage(0, 1);
    let y0 = hidden(
        tier.forward_unit(m, UnitId(0), &h[0], UnitInput::Tokens(&ids))
            .unwrap(),
    );
    load_stage(1, 2);
    let y1 = hidden(
        tier.forward_unit(m, UnitId(1), &h[1], UnitInput::Hidden(&y0))
            .unwrap(),
    );
    // Block 1's forward is launched ahead; its backward meets it first
    // and gives it back.
    assert_eq!(tier.census().get("in use"), Some(&h[2].len()));
    let dy = (y1.clone() * 0.5).unwrap();
    // The tier's backward of `u` and the reference's.
    let both = |u: usize, x: &candle_core::Tensor, up: &candle_core::Tensor| {
        let input = || UnitInput::Hidden(x);
        let got = tier
            .backward_unit(m, UnitId(u), &h[u], input(), Upstream::Grad(up))
            .unwrap();
        let want = reference
            .backward_unit(m, UnitId(u), &h[u], input(), Upstream::Grad(up))
            .unwrap();
        (got, want)
    };
    load_stage(2, 1);
    let (g2, want2) = both(2, &y1, &dy);
    let dx2 = g2.input.unwrap();
    assert_eq!(bits(&dx2), bits(want2.input.as_ref().unwrap()), "block 1");
    assert_eq!(grads(2), want_grads(&want2), "block 1's grads");
    // Block 0's backward was launched on dx2 and on y0.
    assert_eq!(tier.census().get("in use"), Some(&h[1].len()));
    let t = tier.take_traffic().unwrap();
    assert_eq!((t.forwards_ahead, t.backwards_ahead), (1, 0), "{t:?}");
    load_stage(1, 0);
    let (g1, want1) = both(1, &y0, &dx2);
    let dx1 = g1.input.unwrap();
    assert_eq!(
        bits(&dx1),
        bits(want1.input.as_ref().unwrap()),
        "block 0 launched ahead"
    );
    assert_eq!(
        grads(1),
        want_grads(&want1),
        "block 0's grads, launched ahead"
    );
    assert_eq!(tier.take_traffic().unwrap().backwards_ahead, 1);
    // The embedding's backward was launched on dx1; a call with another
    // upstream (the same values, another tensor) computes afresh.
    assert_eq!(tier.census().get("in use"), Some(&h[0].len()));
    let other = dx1.copy().unwrap();
    tier.load(m, UnitId(0), &h[0], Vec::new()).unwrap();
    let g0 = tier
        .backward_unit(
            m,
            UnitId(0),
            &h[0],
            UnitInput::Tokens(&ids),
            Upstream::Grad(&other),
        )
        .unwrap();
    assert!(g0.input.is_none());
    let want0 = reference
        .backward_unit(
            m,
            UnitId(0),
            &h[0],
            UnitInput::Tokens(&ids),
            Upstream::Grad(&other),
        )
        .unwrap();
    assert_eq!(
        grads(0),
        want_grads(&want0),
        "the embedding's grads, afresh"
    );
    assert_eq!(tier.take_traffic().unwrap().backwards_ahead, 0);
    assert_eq!(tier.census().get("in use"), None);
    tier.begin_step().unwrap();
    drop(tier);
    assert_all_back(&probe, "after the backward");
}

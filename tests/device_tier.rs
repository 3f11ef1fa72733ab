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
    let dev = SimDevice::new(cfg).unwrap();
    let probe = dev.probe();
    let tier = Arc::new(TieredUnits::new(dev, limits).unwrap());
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
    assert_eq!(p.used_bytes(), 0, "{what}: device bytes left");
    assert_eq!(p.in_flight(), 0, "{what}: copies left");
    assert_eq!(p.downloads_in_flight(), 0, "{what}: downloads left");
    assert_eq!(
        p.free_staging(),
        p.staging_slots(),
        "{what}: staging buffers lent"
    );
    assert_eq!(
        p.violations(),
        0,
        "{what}: a staging buffer changed mid-copy"
    );
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
            for cache_bytes in [0, 1 << 30] {
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
        let (out, _, probe) = tiered(
            &model,
            &Knobs::cpu(),
            sim(64 << 20, 2, slots),
            wide_open(),
            2,
        );
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
    // a unit runs) while other copies are in flight.
    for nth in [2, 7, 15, 30] {
        let dev = SimDevice::new(SimConfig {
            fail_upload: Some(nth),
            ..sim(64 << 20, 5, 3)
        })
        .unwrap();
        let probe = dev.probe();
        let tier = Arc::new(TieredUnits::new(dev, wide_open()).unwrap());
        let mut opts = TrainerOptions::cpu(3, 16);
        opts.compute = Some(tier.clone());
        let mut t = build_with(&model, &Knobs::nvme(), opts, 2);
        let e = t.step().unwrap_err().to_string();
        assert!(e.contains(&format!("upload {nth}")), "{e}");
        drop(t);
        drop(tier);
        assert_all_back(&probe, &format!("failed upload {nth}"));
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
    // span overlaps a compute span that started after it.
    let d2h = lane("device: d2h");
    assert!(!d2h.is_empty());
    let down_overlap_us: f64 = d2h
        .iter()
        .flat_map(|&(a, b)| {
            compute
                .iter()
                .filter(move |&&(c, _)| c >= a)
                .map(move |&(c, e)| (b.min(e) - c).max(0.0))
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

/// bf16 params through the tier: the same bits as the in-memory units
/// with bf16 params (both widen them to fp32 at the unit, round the
/// outputs back once), with and without the cache.
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
        let (got, _, probe) = tiered(&model, &k, cfg.clone(), limits, 3);
        assert_eq!(got.loss_bits, want.loss_bits, "cache {cache_bytes}");
        assert_eq!(got.sha, want.sha, "cache {cache_bytes}");
        assert_all_back(&probe, "bf16");
        // bf16 params and activations cross as 2-byte elements (only the
        // rotary tables are fp32): about half an fp32 run's traffic (its
        // uploads and the outputs it kept on the device; bf16 outputs are
        // not kept, their host copies are rounded).
        let fp32 = Knobs {
            precision: "fp32",
            ..k.clone()
        };
        let (wide, _, _) = tiered(&model, &fp32, cfg, limits, 3);
        println!(
            "cache {cache_bytes}: h2d {} B in bf16, {} B in fp32",
            got.h2d_bytes, wide.h2d_bytes
        );
        assert_eq!(got.h2d_kept_bytes, 0);
        let wide_in = wide.h2d_bytes + wide.h2d_kept_bytes;
        assert!(
            got.h2d_bytes * 100 <= wide_in * 55,
            "bf16 {} B vs fp32 {wide_in} B",
            got.h2d_bytes,
        );
        // Param gradients come back rounded on the device, 2 bytes each
        // (the input gradients and the outputs stay fp32 on the way).
        println!(
            "cache {cache_bytes}: d2h {} B in bf16, {} B in fp32",
            got.d2h_bytes, wide.d2h_bytes
        );
        assert!(
            got.d2h_bytes * 100 <= wide.d2h_bytes * 75,
            "bf16 {} B vs fp32 {} B",
            got.d2h_bytes,
            wide.d2h_bytes
        );
    }
}

/// The unit about to compute goes first: [`UnitCompute::load`] issues
/// its missing uploads before the next unit is staged, so the copy queue
/// carries them first, and what was staged for it leaves the prefetch
/// window, which the next unit then fills whole.
#[test]
fn the_unit_computing_uploads_before_the_next_one_is_staged() {
    use tierzero::model::exec_units::UnitCompute;
    use tierzero::model::{ModelDir, UnitId};
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
    tier.load(m, UnitId(0), &h0).unwrap();
    tier.stage(m, UnitId(1), &h1).unwrap();
    let c = tier.census();
    assert_eq!(c.get("loading"), Some(&h0.len()), "{c:?}");
    // The embedding's params are not ahead of use: block 0 fits whole.
    assert_eq!(c.get("uploading"), Some(&h1.len()), "{c:?}");
    // Block 0 computes next: its staged uploads leave the window, so
    // block 1 is staged whole too.
    tier.load(m, UnitId(1), &h1).unwrap();
    tier.stage(m, UnitId(2), &h2).unwrap();
    let c = tier.census();
    assert_eq!(c.get("loading"), Some(&(h0.len() + h1.len())), "{c:?}");
    assert_eq!(c.get("uploading"), Some(&h2.len()), "{c:?}");
    assert!(tier.peaks().ahead_numel <= numel(1));
    // The copies ran in the order issued: the embedding's, then block
    // 0's, then block 1's (the upload thread issues them as it fills).
    let want: Vec<String> = [names(0), names(1), names(2)].concat();
    let mut order: Vec<String> = Vec::new();
    let t0 = std::time::Instant::now();
    while order.len() < want.len() && t0.elapsed() < Duration::from_secs(20) {
        order.extend(tier.take_device_spans().into_iter().map(|s| s.name));
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
    use tierzero::model::{ModelDir, UnitId};
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
    let delay_ms = 60u64;
    let dev = SimDevice::new(sim(64 << 20, delay_ms, 1)).unwrap();
    let probe = dev.probe();
    let tier = TieredUnits::new(dev, wide_open()).unwrap();
    tier.begin_step().unwrap();
    let t0 = std::time::Instant::now();
    tier.stage(m, UnitId(1), &h1).unwrap();
    let staged = t0.elapsed();
    assert_eq!(tier.census().get("uploading"), Some(&h1.len()));
    // Issuing them all on this thread would have waited for n - 1 copies.
    let serial = Duration::from_millis(delay_ms * (h1.len() as u64 - 1));
    println!("stage returned after {staged:?}; issuing in series takes {serial:?}");
    assert!(staged < serial / 4, "stage took {staged:?} of {serial:?}");
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

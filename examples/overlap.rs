//! Overlap measurement (step ≤ 1.15 × the slowest phase alone, see
//! `docs/decisions/overlap.md`): runs each phase of a training step alone
//! and the whole step, side by side, and reports
//! `step time / max(compute alone, I/O alone, optimizer alone)`.
//!
//! ```text
//! cargo run --release --example overlap -- LAYERS HIDDEN STEPS ROUNDS [DIR]
//! ```
//!
//! Two methods (`MODE`):
//!
//! * **`interleaved`** (the default): the three trainers below live side
//!   by side in one process and take turns, a *block* of `STEPS` steps
//!   each, for `ROUNDS` blocks (the order rotates block by block). Each
//!   block starts from a settled optimizer (the previous block's tail
//!   waited for, untimed), and its first step is dropped, so every kept
//!   real step overlaps the previous step's optimizer tail as in a long
//!   run. The three timings of a block are taken within about a second of
//!   each other, so the VM's drift (here the I/O phase alone moved by
//!   ±30% from minute to minute) hits numerator and denominator alike;
//! * **`separate`**: each round builds four trainers one after another and
//!   runs each for `STEPS` steps (the first dropped), the first method
//!   used. I/O alone runs twice, before and after the stage-0
//!   run, and the faster is kept.
//!
//! The trainers, on the same model, data and seed:
//!
//! * **compute alone** and **optimizer alone**: stage 0, everything in
//!   memory. `compute_s` is forward + backward; `optimizer_s` is the Adam
//!   kernel (plus the norm) over in-memory state;
//! * **I/O alone**: stage 3 with params and optimizer state on NVMe and
//!   `TrainerOptions::skip_compute`: every param is fetched and released in
//!   trace order and the optimizer reads, steps (zero gradients) and writes
//!   its state, with no forward or backward. Its step wall time is the I/O
//!   phase;
//! * **full step**: the same NVMe configuration training for real; its
//!   step wall time is what the ratio compares.
//!
//! Per round (block) the medians over its kept steps give one ratio
//! `step / max(compute, I/O, optimizer)`; the summary gives the medians
//! over rounds and the median of the per-round ratios.
//!
//! Environment: `CLIP` (default 0 = off) sets `gradient_clipping`;
//! `OVERLAP=off` turns the optimizer overlap and pipelining off; `MICRO`
//! (default 4) and `SEQ_LEN` (default 64) set the tokens per step, which
//! move compute against I/O; `AIO_QD` sets `aio.queue_depth` (default 8);
//! `COMPUTE_THREADS` sets `tierzero.compute_threads` for all three runs
//! (default: what `"auto"` gives the offloaded run, so compute alone is
//! timed with the threads the real step computes with); `TIMELINE=FILE`
//! writes a timeline of three of the real run's steps (`separate`: steps
//! 2..=4 of the last round; `interleaved`: the first kept steps after the
//! warm-up; see `tierzero train --timeline`); `TIMELINE_STAGE0=FILE` the
//! same window of the compute-alone run (`interleaved` only), to compare
//! each unit's compute (`scripts/timeline_gaps.py TIMELINE --against
//! TIMELINE_STAGE0`); `OPT_BUFFERS` and
//! `PARAM_BUFFERS` set `offload_optimizer.buffer_count` and
//! `offload_param.buffer_count` (default 16 each); `BUCKET_H2`, `LIVE_H2`
//! and `REUSE_H2` set `stage3_prefetch_bucket_size`,
//! `stage3_max_live_parameters` and `stage3_max_reuse_distance` in units
//! of hidden² (a block is 12: default 24, 48 and 0); `OPT_RESIDENT` sets
//! `tierzero.optimizer_resident_bytes` (bytes, or "auto"); `SPEC_POOL` sets
//! `tierzero.speculation_pool_bytes` (bytes, or "auto"); `PIN=off` or
//! `PIN=on` sets `tierzero.pin_threads` (default "auto");
//! `ACT_BUDGET` sets `tierzero.activation_budget_bytes` (default 0: every
//! block recomputed, so the real step does the I/O-alone run's I/O);
//! `PRETRAIN=N` starts every trainer from weights pre-trained N steps
//! (stage 0, `PRETRAIN_LR`, default 1e-3, clipping 1.0; made once and
//! kept under DIR), so that with a fine-tuning `LR` such as 2e-5 the
//! gradient norms are mostly below `CLIP=1`, as when fine-tuning a
//! pretrained model (from the seeded init they stay at 2-27);
//! `LR` sets the AdamW learning rate (default 1e-3) and `WARMUP=N` a
//! linear warm-up to it over N steps (default none);
//! `SPECULATIVE=off` or `SPECULATIVE=on` sets `tierzero.speculative_step`
//! (default "auto"; a round's line gives the real trainer's
//! `speculation_hits`, `speculation_misses` and `speculation_pool_waits`
//! so far, and its kept steps' `grad_norms`); `MODE`
//! (above); `PER_STEP=1` prints every step's wall time to stderr. Output: one JSON line
//! per round, then a summary line with the medians over rounds and the
//! ratio. A round's line also gives the median NVMe bytes (read +
//! written) per step of the I/O-alone run and of the real step, to compare
//! the work behind the two timings (a step's count includes what the
//! previous step's optimizer tail did during it, so it moves a little
//! with timing; a run's total does not).

use std::error::Error;
use std::path::PathBuf;

use serde_json::json;
use tierzero::engine::host::threads;
use tierzero::engine::{StepMetrics, Timeline, Trainer, TrainerOptions};

mod measure;
use measure::{env_or, med, median, Setup, Tier};

/// Per-step metrics of `steps` steps, the first dropped.
fn run(setup: &Setup, steps: u64, skip_compute: bool) -> Result<Vec<StepMetrics>, Box<dyn Error>> {
    let (config, md, data) = setup.build()?;
    let mut opts = TrainerOptions::cpu(1, env_or("SEQ_LEN", 64));
    opts.skip_compute = skip_compute;
    // `TIMELINE=FILE`: a timeline of the real run's steps 2..=4 (the last
    // round's; see `tierzero train --timeline`).
    let timeline_path =
        std::env::var_os("TIMELINE").filter(|_| !skip_compute && setup.tier == Tier::Nvme);
    if timeline_path.is_some() {
        let (first, last) = Timeline::window(0, steps, 3);
        opts.timeline = Some(Timeline::new(first, last));
    }
    let timeline = opts.timeline.clone();
    let mut t = Trainer::new(&config, &md, data, opts)?;
    let out = kept_steps(&mut t, steps, skip_compute)?;
    t.finish()?;
    if let (Some(tl), Some(path)) = (timeline, timeline_path) {
        tl.write(std::path::Path::new(&path))?;
    }
    Ok(out)
}

/// `steps` steps of `t`, the first dropped. `PER_STEP=1` prints every
/// step's wall time to stderr (`io` or `compute` run), e.g. to see a fresh
/// trainer's first steps run faster than its later ones.
fn kept_steps(
    t: &mut Trainer,
    steps: u64,
    skip_compute: bool,
) -> Result<Vec<StepMetrics>, Box<dyn Error>> {
    let per_step = std::env::var_os("PER_STEP").is_some();
    let mut out = Vec::new();
    for i in 0..steps {
        let m = t.step()?.metrics;
        if per_step {
            let kind = if skip_compute { "io" } else { "compute" };
            eprintln!("step {kind} {} {:.1} ms", m.step, m.wall_s * 1e3);
        }
        if i > 0 {
            out.push(m);
        }
    }
    Ok(out)
}

/// Median NVMe bytes (read + written) per step.
fn nvme_bytes(ms: &[StepMetrics]) -> f64 {
    let get = |m: &std::collections::BTreeMap<String, u64>| m.get("nvme").copied().unwrap_or(0);
    med(ms, |m| (get(&m.bytes_read) + get(&m.bytes_written)) as f64)
}

/// One of the interleaved trainers.
struct Arm {
    trainer: Trainer,
    skip_compute: bool,
    /// Kept steps of the current block.
    block: Vec<StepMetrics>,
}

impl Arm {
    fn new(
        setup: &Setup,
        skip_compute: bool,
        timeline: Option<std::sync::Arc<Timeline>>,
    ) -> Result<Self, Box<dyn Error>> {
        let (config, md, data) = setup.build()?;
        let mut opts = TrainerOptions::cpu(1, env_or("SEQ_LEN", 64));
        opts.skip_compute = skip_compute;
        opts.timeline = timeline;
        let mut trainer = Trainer::new(&config, &md, data, opts)?;
        // Warm-up: the trace-recording step and one more, untimed.
        for _ in 0..2 {
            trainer.step()?;
        }
        trainer.settle_optimizer()?;
        Ok(Arm {
            trainer,
            skip_compute,
            block: Vec::new(),
        })
    }

    /// `steps` steps, the first dropped, then the tail settled (untimed).
    fn run_block(&mut self, steps: u64) -> Result<(), Box<dyn Error>> {
        self.block = kept_steps(&mut self.trainer, steps, self.skip_compute)?;
        self.trainer.settle_optimizer()?;
        Ok(())
    }
}

/// `MODE=interleaved`: see the module docs.
fn interleaved(
    base: &Setup,
    stage0: &Setup,
    steps: u64,
    rounds: usize,
) -> Result<Vec<Round>, Box<dyn Error>> {
    // Separate roots: two NVMe trainers are alive at once.
    let io_setup = Setup {
        root: base.root.join("io"),
        ..base.clone()
    };
    let real_setup = Setup {
        root: base.root.join("real"),
        ..base.clone()
    };
    let timeline_path = std::env::var_os("TIMELINE");
    // Steps 4..=6 of the real trainer: after the warm-up (1, 2) and the
    // first block's dropped step (3); within that block if STEPS >= 4.
    let timeline = timeline_path.as_ref().map(|_| Timeline::new(4, 6));
    // `TIMELINE_STAGE0=FILE`: the same window of the compute-alone trainer,
    // to compare each unit's compute with the real step's.
    let stage0_path = std::env::var_os("TIMELINE_STAGE0");
    let stage0_timeline = stage0_path.as_ref().map(|_| Timeline::new(4, 6));
    let mut arms = [
        Arm::new(&io_setup, true, None)?,
        Arm::new(stage0, false, stage0_timeline.clone())?,
        Arm::new(&real_setup, false, timeline.clone())?,
    ];
    let mut out = Vec::new();
    for round in 0..rounds {
        for k in 0..arms.len() {
            arms[(round + k) % arms.len()].run_block(steps)?;
        }
        let [io, s0, real] = &arms;
        // One I/O-alone block a round: it stands as both "before" and "after".
        out.push(Round::of(&io.block, &io.block, &s0.block, &real.block));
    }
    for arm in arms {
        arm.trainer.finish()?;
    }
    if let (Some(tl), Some(path)) = (timeline, timeline_path) {
        tl.write(std::path::Path::new(&path))?;
    }
    if let (Some(tl), Some(path)) = (stage0_timeline, stage0_path) {
        tl.write(std::path::Path::new(&path))?;
    }
    Ok(out)
}

/// The medians of one round (block).
struct Round {
    compute: f64,
    optimizer: f64,
    io: f64,
    step: f64,
    line: serde_json::Value,
}

impl Round {
    fn of(
        io_before: &[StepMetrics],
        io_after: &[StepMetrics],
        s0: &[StepMetrics],
        real: &[StepMetrics],
    ) -> Round {
        let c = med(s0, |m| m.compute_s);
        let o = med(s0, |m| m.optimizer_s);
        let i = med(io_before, |m| m.wall_s).min(med(io_after, |m| m.wall_s));
        let w = med(real, |m| m.wall_s);
        let line = json!({"compute_alone_s": c, "optimizer_alone_s": o,
               "io_alone_s": i, "io_alone_before_s": med(io_before, |m| m.wall_s),
               "io_alone_after_s": med(io_after, |m| m.wall_s), "step_s": w,
               "ratio": w / c.max(o).max(i),
               "overlap_efficiency": med(real, |m| m.overlap_efficiency),
               "step_compute_s": med(real, |m| m.compute_s),
               "step_io_wait_s": med(real, |m| m.io_wait_s),
               "step_param_write_wait_s": med(real, |m| m.param_write_wait_s),
               "step_idle_s": med(real, |m| m.idle_s),
               "step_io_busy_s": med(real, |m| m.io_busy_s),
               "io_alone_nvme_bytes": nvme_bytes(io_after), "step_nvme_bytes": nvme_bytes(real),
               // Cumulative counts of the real trainer at the block's end.
               "speculation_hits": real.last().map_or(0, |m| m.speculation_hits),
               "speculation_misses": real.last().map_or(0, |m| m.speculation_misses),
               "speculation_pool_waits": real.last().map_or(0, |m| m.speculation_pool_waits),
               // The real trainer's kept steps' global gradient norms
               // (clipping or fp16), to see whether `CLIP` clips.
               "grad_norms": real.iter().filter_map(|m| m.grad_norm).collect::<Vec<_>>()});
        Round {
            compute: c,
            optimizer: o,
            io: i,
            step: w,
            line,
        }
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 5 {
        return Err("usage: overlap LAYERS HIDDEN STEPS ROUNDS [DIR]".into());
    }
    let steps: u64 = a[3].parse()?;
    let rounds: usize = a[4].parse()?;
    if steps < 2 || rounds == 0 {
        return Err("STEPS must be at least 2 and ROUNDS at least 1".into());
    }
    // The same compute threads for all three runs, so "compute alone" is
    // the compute of the real step: `COMPUTE_THREADS`, or what "auto"
    // gives the offloaded run.
    let compute_threads: u32 = std::env::var("COMPUTE_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            let t = threads::resolve(None, threads::user_env().as_deref(), threads::cores(), true);
            u32::try_from(t.threads).unwrap_or(1)
        });
    let root = PathBuf::from(
        a.get(5)
            .cloned()
            .unwrap_or_else(|| "overlap-measure".into()),
    );
    let base = Setup {
        layers: a[1].parse()?,
        hidden: a[2].parse()?,
        tier: Tier::Nvme,
        overlap: std::env::var("OVERLAP").map_or(true, |v| v != "off"),
        clip: env_or("CLIP", 0.0),
        shared: root.clone(),
        root,
        micro_batch: env_or("MICRO", 4),
        compute_threads: Some(compute_threads),
    };
    let stage0 = Setup {
        tier: Tier::Stage0,
        ..base.clone()
    };
    let mode = std::env::var("MODE").unwrap_or_else(|_| "interleaved".into());
    let rounds_out = match mode.as_str() {
        "interleaved" => interleaved(&base, &stage0, steps, rounds)?,
        "separate" => {
            let mut v = Vec::new();
            for _ in 0..rounds {
                // I/O alone twice, before and after the compute-heavy
                // stage-0 run, and the faster one kept: on this VM the I/O
                // phase ran about 12% faster right after a run that kept
                // both cores busy than after one that kept one busy, so
                // one position alone would let the thread setting move the
                // denominator.
                let io_before = run(&base, steps, true)?;
                let s0 = run(&stage0, steps, false)?;
                let io_after = run(&base, steps, true)?;
                let real = run(&base, steps, false)?;
                v.push(Round::of(&io_before, &io_after, &s0, &real));
            }
            v
        }
        other => return Err(format!("MODE `{other}`: expected interleaved or separate").into()),
    };
    let (mut compute, mut optimizer, mut io, mut full, mut eff, mut ratios) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    for (round, r) in rounds_out.into_iter().enumerate() {
        let mut line = r.line;
        line["round"] = json!(round);
        println!("{line}");
        ratios.push(line["ratio"].as_f64().unwrap_or(f64::NAN));
        eff.push(line["overlap_efficiency"].as_f64().unwrap_or(f64::NAN));
        compute.push(r.compute);
        optimizer.push(r.optimizer);
        io.push(r.io);
        full.push(r.step);
    }
    let within = ratios.iter().filter(|r| **r <= 1.15).count();
    let median_ratio = median(ratios);
    let (c, o, i, w) = (median(compute), median(optimizer), median(io), median(full));
    println!(
        "{}",
        json!({"summary": true, "layers": base.layers, "hidden": base.hidden,
               "steps": steps, "rounds": rounds, "clip": base.clip, "overlap": base.overlap,
               "micro_batch": base.micro_batch, "seq_len": env_or("SEQ_LEN", 64usize),
               "compute_threads": compute_threads,
               "mode": mode, "compute_alone_s": c, "optimizer_alone_s": o, "io_alone_s": i,
               "step_s": w, "ratio": w / c.max(o).max(i), "median_round_ratio": median_ratio,
               "rounds_within_1_15": within, "overlap_efficiency": median(eff)})
    );
    Ok(())
}

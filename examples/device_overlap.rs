//! Overlap on a compute device (the device tier's second device check):
//! the step of a model whose params and optimizer state live on NVMe and
//! stream to the device, against each of its phases run alone in the same
//! process, taking turns block by block:
//!
//! ```text
//! DEVICE=cuda:0 cargo run --release --example device_overlap -- LAYERS HIDDEN STEPS ROUNDS [DIR]
//! ```
//!
//! It reports `step / max(compute alone, h2d alone, d2h alone, NVMe
//! alone, CPU Adam alone)`; the aim is at most 1.15. With `TIER=cpu` the
//! params and optimizer state live in pinned host memory instead of on
//! NVMe, and the NVMe-alone arm times that tier's fetches and optimizer
//! I/O instead (`tier_alone_s` either way).
//!
//! # The arms
//!
//! Each is built on the same model, data and seed (`examples/measure`),
//! warmed up two steps, then runs blocks of `STEPS` steps (the first of
//! each dropped, the optimizer's tail settled after it, untimed) in a
//! rotating order, `ROUNDS` times, as `examples/overlap.rs` does:
//!
//! * **step**: stage 3 with params and optimizer state on NVMe (`TIER`), the units
//!   on the device through the device tier
//!   ([`tierzero::engine::device::units_on`], as `tierzero train
//!   --device` builds them): NVMe reads, uploads, compute, gradient
//!   downloads and the CPU Adam, overlapped. Its `wall_s`;
//! * **compute alone**: stage 0 with nothing offloaded, on a link of its
//!   own: every param, gradient and Adam's state stay on the device, so a
//!   step moves only the units' inputs. Its `compute_s` (forward and
//!   backward; the device's Adam is not in it);
//! * **NVMe alone** (`tier_alone_s`): the step's config with
//!   `skip_compute`: every param
//!   fetched from NVMe and released in trace order, the optimizer's state
//!   read, stepped with zero gradients and written, no compute and no
//!   device. Its `wall_s`;
//! * **CPU Adam alone**: stage 0 in host memory with `skip_compute`: the
//!   SIMD Adam (and the norm, with `CLIP`) over in-memory state. Its
//!   `optimizer_s`;
//! * **h2d alone** and **d2h alone**: a link of their own. Per repetition
//!   the model's params cross to the device one by one, in order and
//!   again from the first, in the precision the step stores them in,
//!   until as many bytes crossed as the step's median `h2d_bytes`, every
//!   copy issued at once and waited for together; then as many bytes as
//!   the step's `d2h_bytes` come back. Each is timed from the first issue
//!   to the last completion, on the host's clock.
//!
//! Per round the medians give one ratio; the summary line gives the
//! medians over rounds. `TIMELINE=FILE` writes a timeline of three of the
//! step arm's steps (after the warm-up), with the device's compute and
//! copy lanes.
//!
//! # Environment
//!
//! `TIER` is `nvme` (the default) or `cpu`; `DEVICE` is `sim` (the default: the simulated device, which computes
//! on the kernels' scalar references and copies at `SIM_H2D_GBPS`, default
//! 25, through `SIM_STAGING` staging buffers, default 4 as `tierzero train
//! --device sim`) or `cuda:N`; `DEVICE_BUDGET` sets the GPU's byte budget (default:
//! its free memory less 5%); `ADAM_THREADS` the CPU Adam's threads
//! (default 1; `tierzero train --threads auto` takes half the cores with
//! `--device`); and the setup's own
//! (`examples/measure`): `MICRO`, `SEQ_LEN`, `PRECISION=bf16`, `CLIP`,
//! `ACT_BUDGET` (default 0: every block recomputed), `DEVICE_CACHE`
//! (`tierzero.device_cache_bytes`, default 0: every param crosses at each
//! use, the streaming this measures; `auto` or bytes), `BUCKET_H2`,
//! `LIVE_H2`, and so on.
//!
//! The example needs no GPU to build; with `DEVICE=cuda:N` and no driver
//! it fails at start-up with the device's message.

use std::error::Error;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use serde_json::json;
use tierzero::engine::device::sim::{SimConfig, SimDevice};
use tierzero::engine::device::{DeviceLink, Wire};
use tierzero::engine::{StepMetrics, Timeline, Trainer, TrainerOptions};
use tierzero::model::exec_units::{HostElems, HostVec};
use tierzero_gpu::unit::GemmDtype;

mod measure;
use measure::{env_or, med, median, Setup, Tier};

type Res<T> = Result<T, Box<dyn Error>>;

/// The phases timed alone, in the order of a round's `phases`.
const PHASES: [&str; 5] = [
    "compute_alone_s",
    "h2d_alone_s",
    "d2h_alone_s",
    "tier_alone_s",
    "cpu_adam_alone_s",
];

/// What the step's units move per step, measured in its warm-up.
#[derive(Debug, Clone, Copy)]
struct Traffic {
    h2d_bytes: u64,
    d2h_bytes: u64,
}

/// One of the trainers that take turns.
struct Arm {
    trainer: Trainer,
    /// Kept steps of the current block.
    block: Vec<StepMetrics>,
    /// The last warm-up step's metrics.
    warm: StepMetrics,
}

impl Arm {
    fn new<L: DeviceLink + 'static>(
        setup: &Setup,
        link: Option<L>,
        skip_compute: bool,
        timeline: Option<Arc<Timeline>>,
    ) -> Res<Self> {
        let (config, md, data) = setup.build()?;
        let mut opts = TrainerOptions::cpu(1, env_or("SEQ_LEN", 64));
        opts.skip_compute = skip_compute;
        opts.timeline = timeline;
        // One count for every arm (auto would differ between the device
        // arms and the CPU Adam alone).
        opts.adam_threads = Some(
            std::num::NonZeroUsize::new(env_or("ADAM_THREADS", 1usize))
                .unwrap_or(std::num::NonZeroUsize::MIN),
        );
        if let Some(link) = link {
            opts.compute = Some(tierzero::engine::device::units_on(
                link,
                &config,
                md.model(),
                1,
            )?);
        }
        let mut trainer = Trainer::new(&config, &md, data, opts)?;
        // Warm-up: the trace-recording step and one more, untimed.
        trainer.step()?;
        let warm = trainer.step()?.metrics;
        trainer.settle_optimizer()?;
        Ok(Arm {
            trainer,
            block: Vec::new(),
            warm,
        })
    }

    /// `steps` steps, the first dropped, then the tail settled (untimed).
    fn run_block(&mut self, steps: u64) -> Res<()> {
        self.block.clear();
        for i in 0..steps {
            let m = self.trainer.step()?.metrics;
            if i > 0 {
                self.block.push(m);
            }
        }
        self.trainer.settle_optimizer()?;
        Ok(())
    }
}

/// The h2d- and d2h-alone arm: the model's params crossing on a link of
/// its own.
struct Copies<L: DeviceLink> {
    link: L,
    /// The params' elements as the step stores them, in model order.
    params: Vec<(String, HostVec)>,
    /// The gradients' elements as they come down (16-bit ones rounded on
    /// the device, as the step's are).
    wire: Wire,
    /// Seconds of the current block's kept repetitions.
    h2d_s: Vec<f64>,
    d2h_s: Vec<f64>,
}

impl<L: DeviceLink> Copies<L> {
    fn new(link: L, setup: &Setup) -> Res<Self> {
        let (config, md, _) = setup.build()?;
        use tierzero::config::Precision;
        let wire = match config.precision {
            Precision::Bf16 => Wire::Bf16,
            Precision::Fp16 { .. } => Wire::F16,
            Precision::Fp32 => Wire::F32,
        };
        let params = md
            .model()
            .params()
            .iter()
            .map(|p| {
                let v: Vec<f32> = (0..p.numel).map(|i| (i % 251) as f32 * 1e-3).collect();
                let host = match wire {
                    Wire::Bf16 => HostVec::Bf16(v.into_iter().map(half::bf16::from_f32).collect()),
                    Wire::F16 => HostVec::F16(v.into_iter().map(half::f16::from_f32).collect()),
                    Wire::F32 => HostVec::F32(v),
                };
                (p.name.clone(), host)
            })
            .collect();
        Ok(Copies {
            link,
            params,
            wire,
            h2d_s: Vec::new(),
            d2h_s: Vec::new(),
        })
    }

    /// One repetition: `t.h2d_bytes` up, then `t.d2h_bytes` down; the
    /// seconds of each.
    fn once(&self, t: Traffic) -> Res<(f64, f64)> {
        let t0 = Instant::now();
        let mut sent = 0u64;
        let mut ups = Vec::new();
        for (name, host) in self.params.iter().cycle() {
            if sent >= t.h2d_bytes {
                break;
            }
            ups.push(self.link.upload(name, host.elems())?);
            sent += host.bytes();
        }
        let mut bufs = Vec::with_capacity(ups.len());
        for u in ups {
            bufs.push(self.link.finish(u)?);
        }
        // A one-element upload after them, downloaded: its download waits
        // on the compute queue, which waits on every copy before it.
        let fence = self
            .link
            .finish(self.link.upload("fence", HostElems::F32(&[0.0]))?)?;
        self.link
            .finish_download(self.link.download("fence", fence, Wire::F32)?)?;
        let h2d = t0.elapsed().as_secs_f64();

        let t1 = Instant::now();
        let mut got = 0u64;
        let mut downs = Vec::new();
        let mut rest = Vec::new();
        for (b, (name, host)) in bufs.into_iter().zip(self.params.iter().cycle()) {
            if got >= t.d2h_bytes {
                rest.push(b);
                continue;
            }
            // 16-bit params come down as they are: the bytes that went up.
            got += host.bytes();
            downs.push(self.link.download(name, b, self.wire)?);
        }
        for d in downs {
            self.link.finish_download(d)?;
        }
        let d2h = t1.elapsed().as_secs_f64();
        if got < t.d2h_bytes {
            eprintln!(
                "device_overlap: d2h alone moved {got} B of the step's {} B (it downloads what \
                 h2d alone uploaded)",
                t.d2h_bytes
            );
        }
        for b in rest {
            self.link.free(b);
        }
        Ok((h2d, d2h))
    }

    /// `steps` repetitions, the first dropped.
    fn run_block(&mut self, steps: u64, t: Traffic) -> Res<()> {
        self.h2d_s.clear();
        self.d2h_s.clear();
        for i in 0..steps {
            let (u, d) = self.once(t)?;
            if i > 0 {
                self.h2d_s.push(u);
                self.d2h_s.push(d);
            }
        }
        Ok(())
    }
}

/// Every arm on links from `make`, `rounds` rounds of `steps` steps: one
/// JSON line per round, and the summary.
fn measure<L: DeviceLink + 'static>(
    make: &dyn Fn() -> Res<L>,
    base: &Setup,
    steps: u64,
    rounds: usize,
    device: &str,
) -> Res<()> {
    let at = |dir: &str, tier: Tier| Setup {
        root: base.root.join(dir),
        tier,
        ..base.clone()
    };
    let timeline_path = std::env::var_os("TIMELINE");
    // Steps 4..=6: after the warm-up (1, 2) and the first block's dropped
    // step (3).
    let timeline = timeline_path.as_ref().map(|_| Timeline::new(4, 6));
    let mut step = Arm::new(
        &at("step", base.tier),
        Some(make()?),
        false,
        timeline.clone(),
    )?;
    let traffic = Traffic {
        h2d_bytes: step.warm.h2d_bytes,
        d2h_bytes: step.warm.d2h_bytes,
    };
    let mut compute = Arm::new(&at("compute", Tier::Stage0), Some(make()?), false, None)?;
    let mut store = Arm::new::<L>(&at("store", base.tier), None, true, None)?;
    let mut adam = Arm::new::<L>(&at("adam", Tier::Stage0), None, true, None)?;
    let mut copies = Copies::new(make()?, base)?;
    let mut all = Vec::new();
    for round in 0..rounds {
        for k in 0..5 {
            match (round + k) % 5 {
                0 => step.run_block(steps)?,
                1 => compute.run_block(steps)?,
                2 => store.run_block(steps)?,
                3 => adam.run_block(steps)?,
                _ => copies.run_block(steps, traffic)?,
            }
        }
        let phases = [
            med(&compute.block, |m| m.compute_s),
            median(copies.h2d_s.clone()),
            median(copies.d2h_s.clone()),
            med(&store.block, |m| m.wall_s),
            med(&adam.block, |m| m.optimizer_s),
        ];
        let slowest = phases.iter().copied().fold(0.0, f64::max);
        let w = med(&step.block, |m| m.wall_s);
        let mut line = json!({"round": round, "step_s": w, "ratio": w / slowest,
            "step_compute_s": med(&step.block, |m| m.compute_s),
            "step_device_busy_s": med(&step.block, |m| m.device_busy_s),
            "step_h2d_busy_s": med(&step.block, |m| m.h2d_busy_s),
            "step_d2h_busy_s": med(&step.block, |m| m.d2h_busy_s),
            "step_h2d_fill_busy_s": med(&step.block, |m| m.h2d_fill_busy_s),
            "step_forwards_ahead": med(&step.block, |m| m.device_forwards_ahead as f64),
            "step_backwards_ahead": med(&step.block, |m| m.device_backwards_ahead as f64),
            "step_h2d_wait_s": med(&step.block, |m| m.h2d_wait_s),
            "step_io_wait_s": med(&step.block, |m| m.io_wait_s),
            "step_optimizer_s": med(&step.block, |m| m.optimizer_s),
            "compute_alone_device_busy_s": med(&compute.block, |m| m.device_busy_s)});
        for (name, s) in PHASES.iter().zip(phases) {
            line[*name] = json!(s);
        }
        println!("{line}");
        all.push(line);
    }
    for arm in [step, compute, store, adam] {
        arm.trainer.finish()?;
    }
    if let (Some(tl), Some(path)) = (timeline, timeline_path) {
        tl.write(std::path::Path::new(&path))?;
    }
    let over = |k: &str| median(all.iter().filter_map(|l| l[k].as_f64()).collect());
    let ratios: Vec<f64> = all.iter().filter_map(|l| l["ratio"].as_f64()).collect();
    let tier = if base.tier == Tier::Cpu {
        "cpu"
    } else {
        "nvme"
    };
    let mut summary = json!({"summary": true, "device": device, "tier": tier, "layers": base.layers,
        "hidden": base.hidden, "steps": steps, "rounds": rounds, "clip": base.clip,
        "micro_batch": base.micro_batch, "seq_len": env_or("SEQ_LEN", 64usize),
        "precision": std::env::var("PRECISION").unwrap_or_else(|_| "fp32".into()),
        "h2d_bytes_per_step": traffic.h2d_bytes, "d2h_bytes_per_step": traffic.d2h_bytes,
        "rounds_within_1_15": ratios.iter().filter(|r| **r <= 1.15).count(),
        "median_round_ratio": median(ratios)});
    for k in std::iter::once("step_s").chain(PHASES) {
        summary[k] = json!(over(k));
    }
    let slowest = PHASES.iter().map(|k| over(k)).fold(0.0, f64::max);
    summary["ratio"] = json!(over("step_s") / slowest);
    println!("{summary}");
    Ok(())
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("device_overlap: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Res<()> {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 5 {
        return Err("usage: device_overlap LAYERS HIDDEN STEPS ROUNDS [DIR]".into());
    }
    let steps: u64 = a[3].parse()?;
    let rounds: usize = a[4].parse()?;
    if steps < 2 || rounds == 0 {
        return Err("STEPS must be at least 2 and ROUNDS at least 1".into());
    }
    let root = PathBuf::from(a.get(5).cloned().unwrap_or_else(|| "device-overlap".into()));
    let base = Setup {
        layers: a[1].parse()?,
        hidden: a[2].parse()?,
        tier: match std::env::var("TIER").as_deref() {
            Ok("cpu") => Tier::Cpu,
            Ok("nvme") | Err(_) => Tier::Nvme,
            Ok(other) => return Err(format!("TIER `{other}`: expected nvme or cpu").into()),
        },
        overlap: true,
        clip: env_or("CLIP", 0.0),
        shared: root.clone(),
        root,
        micro_batch: env_or("MICRO", 4),
        compute_threads: None,
    };
    let gemm = if std::env::var("PRECISION").as_deref() == Ok("bf16") {
        GemmDtype::Bf16
    } else {
        GemmDtype::F32
    };
    let device = std::env::var("DEVICE").unwrap_or_else(|_| "sim".into());
    if device == "sim" {
        let gbps: f64 = env_or("SIM_H2D_GBPS", 25.0);
        let make = || -> Res<SimDevice> {
            Ok(SimDevice::new(SimConfig {
                budget_bytes: env_or("DEVICE_BUDGET", 4u64 << 30),
                copy_delay: std::time::Duration::ZERO,
                h2d_bytes_per_s: Some(gbps * 1e9),
                staging_slots: env_or("SIM_STAGING", 4),
                gemm,
                fail_upload: None,
                compute_delay: std::time::Duration::ZERO,
            })?)
        };
        return measure(&make, &base, steps, rounds, &device);
    }
    let ordinal: usize = device
        .strip_prefix("cuda:")
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| format!("DEVICE `{device}`: expected sim or cuda:N"))?;
    let opts = tierzero_gpu::device::DeviceOptions {
        budget_bytes: std::env::var("DEVICE_BUDGET")
            .ok()
            .and_then(|v| v.parse().ok()),
        ..Default::default()
    };
    let dev = Arc::new(tierzero_gpu::device::Device::open(ordinal, &opts)?);
    let make = || -> Res<tierzero::engine::device::cuda::CudaLink> {
        Ok(tierzero::engine::device::cuda::CudaLink::new(
            dev.clone(),
            gemm,
        )?)
    };
    measure(&make, &base, steps, rounds, &device)
}

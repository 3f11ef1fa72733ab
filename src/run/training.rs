//! The training settings a run uses, as the start-up prints them: the
//! optimizer, the learning-rate schedule (the lr of the first step, its
//! peak and the last step's, as the engine will step it), clipping and
//! precision, and every value the config left to be filled (`"auto"`,
//! batch sizes DeepSpeed infers, absent keys whose default changed between
//! DeepSpeed versions) with what filled it. DeepSpeed logs its whole effective config at start-up; a
//! peak lr 50 times the one meant, or clipping from a newer default, shows
//! here before the first step, not in the loss curve.

use crate::config::{Config, LossScale, OptimizerKind, Precision, Resolved, Scheduler, WarmupType};
use crate::optim::schedule::LrSchedule;

/// The lr of a run's first step, its highest and its last step's (the
/// step numbers from 1), over `steps` optimizer steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrPoints {
    /// The first step's lr.
    pub first: f64,
    /// The highest lr and the first step that has it.
    pub peak: (f64, u64),
    /// The last step's lr.
    pub last: f64,
}

impl LrPoints {
    /// The points of `cfg`'s schedule over `steps` steps (at least one).
    pub fn of(cfg: &Config, steps: u64) -> LrPoints {
        let s = LrSchedule {
            scheduler: cfg.scheduler,
            base_lr: cfg.optimizer.lr,
        };
        let steps = steps.max(1);
        let first = s.lr_for_step(0);
        let mut peak = (first, 1);
        // A schedule rises through its warmup only: past it (and past a
        // run this long) nothing is higher.
        let warmup = match cfg.scheduler {
            Scheduler::Constant => 0,
            Scheduler::WarmupLr { warmup_steps, .. }
            | Scheduler::WarmupDecayLr { warmup_steps, .. }
            | Scheduler::WarmupCosineLr { warmup_steps, .. } => {
                crate::optim::schedule::warmup_len(warmup_steps)
            }
        };
        // Rising through the warmup, the highest is at its end (the step
        // after `warmup` applied, or the next with a linear warmup, whose
        // iteration w-1 is still below the peak): only those are looked
        // at (a loop over a warmup of 1e12 steps never ended).
        for applied in [warmup, warmup.saturating_add(1)] {
            let applied = applied.min(steps - 1);
            let lr = s.lr_for_step(applied);
            if applied > 0 && lr > peak.0 {
                peak = (lr, applied + 1);
            }
        }
        LrPoints {
            first,
            peak,
            last: s.lr_for_step(steps - 1),
        }
    }
}

/// The start-up's `training:` line (and, when the config left values to
/// fill, `"auto"` or absent with a default that changed between DeepSpeed
/// versions, its `filled in:` line) for a run of `steps` optimizer steps.
pub fn describe_training(cfg: &Config, steps: u64, resolved: &[Resolved]) -> String {
    let o = &cfg.optimizer;
    let decay = match (o.weight_decay, o.decoupled_weight_decay) {
        (0.0, _) => "no weight decay".to_owned(),
        (w, true) => format!("weight decay {w:?} (decoupled)"),
        (w, false) => format!("weight decay {w:?} (L2, in the gradient)"),
    };
    let kind = match o.kind {
        OptimizerKind::Adam => "Adam",
        OptimizerKind::AdamW => "AdamW",
    };
    let p = LrPoints::of(cfg, steps);
    let schedule = match cfg.scheduler {
        Scheduler::Constant => "constant (no scheduler)".to_owned(),
        Scheduler::WarmupLr {
            warmup_steps,
            warmup_type,
            ..
        } => format!("WarmupLR, {}", warmup(warmup_steps, warmup_type)),
        Scheduler::WarmupDecayLr {
            min_lr,
            warmup_steps,
            warmup_type,
            total_steps,
            ..
        } => format!(
            "WarmupDecayLR, {}, down to {} at iteration {total_steps}",
            warmup(warmup_steps, warmup_type),
            lr_text(min_lr)
        ),
        Scheduler::WarmupCosineLr {
            warmup_steps,
            warmup_type,
            total_steps,
            ..
        } => format!(
            "WarmupCosineLR, {}, cosine to step {total_steps}",
            warmup(warmup_steps, warmup_type)
        ),
    };
    let clipping = match cfg.gradient_clipping {
        Some(c) => format!("gradients clipped at norm {c:?}"),
        None => "no gradient clipping".to_owned(),
    };
    let precision = match cfg.precision {
        Precision::Fp32 => "fp32".to_owned(),
        Precision::Bf16 => "bf16 (fp32 masters)".to_owned(),
        Precision::Fp16 {
            loss_scale: LossScale::Static(s),
        } => format!("fp16 (fp32 masters), static loss scale {s:?}"),
        Precision::Fp16 {
            loss_scale:
                LossScale::Dynamic {
                    initial_scale_power,
                    window,
                    hysteresis,
                    min_scale,
                    ..
                },
        } => format!(
            "fp16 (fp32 masters), dynamic loss scale from 2^{initial_scale_power} (window \
             {window}, hysteresis {hysteresis}, min {min_scale:?})"
        ),
    };
    let mut text = format!(
        "training: {kind} lr {}, betas ({:?}, {:?}), eps {:?}, {decay}{}; lr schedule {schedule}: \
         {} at step 1, peak {} at step {}, {} at step {}; {clipping}; {precision}",
        lr_text(o.lr),
        o.betas[0],
        o.betas[1],
        o.eps,
        match o.bias_correction {
            true => "",
            false => ", no bias correction",
        },
        lr_text(p.first),
        lr_text(p.peak.0),
        p.peak.1,
        lr_text(p.last),
        steps.max(1),
    );
    if p.peak.0 == 0.0 {
        // The config's own peak is positive (checked at load), but this
        // run ends before the schedule leaves 0 (a short run on a long
        // warmup, as DeepSpeed's schedules start at warmup_min_lr).
        text.push_str(&format!(
            "\nwarning: the learning rate is 0 at every one of this run's {} steps (the \
             schedule has not risen from warmup_min_lr by then): the weights will not change; \
             run more steps, or lower scheduler.params.warmup_num_steps",
            steps.max(1)
        ));
    }
    if !resolved.is_empty() {
        let filled: Vec<String> = resolved
            .iter()
            .map(|r| format!("{} = {} ({})", r.key, r.value, r.source))
            .collect();
        text.push_str(&format!("\nfilled in: {}", filled.join("; ")));
    }
    text
}

/// A learning rate as configs write them, to 4 significant digits: `3e-4`,
/// `1.538e-5`, `0`.
fn lr_text(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    let s = format!("{v:.3e}");
    match s.split_once('e') {
        Some((m, e)) => format!("{}e{e}", m.trim_end_matches('0').trim_end_matches('.')),
        None => s,
    }
}

fn warmup(steps: u64, kind: WarmupType) -> String {
    format!(
        "{} warmup over {} steps",
        match kind {
            WarmupType::Log => "log",
            WarmupType::Linear => "linear",
        },
        crate::optim::schedule::warmup_len(steps)
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::config::{load_str, RunContext};

    fn config(text: &str, run: &RunContext) -> crate::config::Loaded {
        load_str(text, run).unwrap()
    }

    #[test]
    fn the_line_says_the_lr_each_schedule_steps_and_what_auto_took() {
        let run = RunContext {
            total_steps: Some(100),
            learning_rate: Some(2e-5),
            ..RunContext::default()
        };
        let l = config(
            r#"{"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
                "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.01}},
                "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10,
                  "warmup_max_lr": "auto", "warmup_type": "linear", "total_num_steps": "auto"}}}"#,
            &run,
        );
        let p = LrPoints::of(&l.config, 100);
        // DeepSpeed's linear warmup: step k runs iteration k-2's lr.
        assert_eq!(p.first, 0.0);
        assert_eq!(p.peak, (2e-5, 12));
        assert!(p.last > 0.0 && p.last < 1e-6, "{p:?}");
        assert_eq!(lr_text(1.5384615384615387e-5), "1.538e-5");
        assert_eq!(lr_text(0.001), "1e-3");
        // A warmup of 1e12 steps over 2^40 steps: answered at once, from
        // the warmup's end.
        let mut long = l.config.clone();
        if let Scheduler::WarmupDecayLr {
            warmup_steps,
            total_steps,
            ..
        } = &mut long.scheduler
        {
            *warmup_steps = 1_000_000_000_000;
            *total_steps = 1 << 40;
        }
        let p = LrPoints::of(&long, 1 << 40);
        assert_eq!(p.peak, (2e-5, 1_000_000_000_002));
        // The log warmup's iteration w-1 is its top up to rounding
        // (ln w / ln w), so the exact peak is the step after.
        let log = config(
            r#"{"train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}"#,
            &RunContext::default(),
        );
        assert_eq!(LrPoints::of(&log.config, 50).peak, (1e-3, 12));
        assert_eq!(LrPoints::of(&log.config, 5).peak.1, 5);
        // A run too short for the warmup to leave 0: said, not silent.
        let zero = "warning: the learning rate is 0 at every one of this run's 2 steps";
        assert!(describe_training(&log.config, 2, &[]).contains(zero));
        assert!(!describe_training(&log.config, 3, &[]).contains("warning:"));
        let text = describe_training(&l.config, 100, &l.resolved);
        for want in [
            "training: AdamW lr 2e-5",
            "weight decay 0.01 (decoupled)",
            "WarmupDecayLR, linear warmup over 10 steps, down to 0 at iteration 100",
            "peak 2e-5 at step 12",
            "gradients clipped at norm 1.0",
            "; fp32",
            "\nfilled in: ",
            "optimizer.params.lr = 2e-5 (run: learning_rate)",
        ] {
            assert!(text.contains(want), "{want:?} not in {text}");
        }
        // No scheduler: the optimizer's lr throughout.
        let c = config(
            r#"{"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0,
                "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "adam_w_mode": false,
                  "weight_decay": 0.1}}}"#,
            &RunContext::default(),
        );
        let text = describe_training(&c.config, 5, &c.resolved);
        for want in [
            "training: Adam lr 3e-4",
            "weight decay 0.1 (L2, in the gradient)",
            "constant (no scheduler): 3e-4 at step 1, peak 3e-4 at step 1, 3e-4 at step 5",
            "no gradient clipping",
        ] {
            assert!(text.contains(want), "{want:?} not in {text}");
        }
        // Only the batch sizes DeepSpeed infers were filled (clipping is
        // written).
        assert!(
            text.contains("\nfilled in: gradient_accumulation_steps = 1 (inferred"),
            "{text}"
        );
        assert!(!text.contains("optimizer.params"), "{text}");
        // Absent keys whose DeepSpeed default changed are said.
        let c = config(
            r#"{"train_micro_batch_size_per_gpu": 2,
                "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}}"#,
            &RunContext::default(),
        );
        let text = describe_training(&c.config, 5, &c.resolved);
        for want in [
            "gradients clipped at norm 1.0",
            "gradient_clipping = 1.0 (absent: DeepSpeed's default since 0.19.3; 0 (no clipping) \
             before, write it to choose)",
            "scheduler.params.warmup_max_lr = 5e-5 (absent: DeepSpeed's default since 0.17.2 \
             (the optimizer's lr); 0.001 before",
        ] {
            assert!(text.contains(want), "{want:?} not in {text}");
        }
    }
}

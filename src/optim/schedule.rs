//! Learning-rate schedules and the fp16 dynamic loss scaler, with
//! DeepSpeed's formulas (`deepspeed/runtime/lr_schedules.py`,
//! `deepspeed/runtime/fp16/loss_scaler.py`).
//!
//! DeepSpeed builds the scheduler before the first step, which sets the
//! lr of "iteration -1" (`last_batch_iteration = -1`: `warmup_min_lr`,
//! or 0.0 for `WarmupCosineLR`), and steps the scheduler after each
//! optimizer step that was not skipped. So the first optimizer step runs
//! at iteration -1's lr, the second at iteration 0's, and step `k` at
//! iteration `k - 2`'s. [`LrSchedule::lr`] is the lr of an iteration;
//! [`LrSchedule::lr_for_step`] the lr of the step after `applied` applied
//! steps, which the trainer uses. Skipped (overflow) steps advance
//! neither, nor Adam's step counter. `tests/lr_schedule_deepspeed.rs`
//! checks both against DeepSpeed's own classes' output.

use super::OptimError;
use crate::config::{LossScale, Scheduler, WarmupType};

/// A learning-rate schedule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    /// The configured schedule.
    pub scheduler: Scheduler,
    /// The optimizer's base lr (WarmupCosineLR multiplies it).
    pub base_lr: f64,
}

/// The warmup's length as DeepSpeed's schedules use it everywhere: the
/// configured `warmup_num_steps`, at least 2 (`max(2, warmup_num_steps)`
/// in `WarmupLR` and `WarmupCosineLR`). The config's notes about the
/// warmup read it too.
pub fn warmup_len(warmup_steps: u64) -> u64 {
    warmup_steps.max(2)
}

/// The warmup's factor at `iter` (`iter < w`, `w` from [`warmup_len`]).
fn warmup_gamma(iter: u64, w: u64, kind: WarmupType) -> f64 {
    match kind {
        WarmupType::Log => (1.0 / (w as f64).ln()) * ((iter + 1) as f64).ln(),
        WarmupType::Linear => iter as f64 / w as f64,
    }
}

impl LrSchedule {
    /// The lr of the optimizer step that follows `applied` applied steps,
    /// as DeepSpeed's engine runs it (see the module docs): iteration
    /// `applied - 1`'s, or the lr the scheduler set when it was built.
    pub fn lr_for_step(&self, applied: u64) -> f64 {
        match applied.checked_sub(1) {
            Some(iter) => self.lr(iter),
            None => self.lr_before_start(),
        }
    }

    /// The lr the scheduler sets when it is built (DeepSpeed's `get_lr`
    /// before its first `step`): the warmup's minimum, 0.0 for
    /// `WarmupCosineLR`, the base lr without a scheduler.
    fn lr_before_start(&self) -> f64 {
        match self.scheduler {
            Scheduler::Constant => self.base_lr,
            Scheduler::WarmupLr { min_lr, .. } | Scheduler::WarmupDecayLr { min_lr, .. } => min_lr,
            Scheduler::WarmupCosineLr { .. } => 0.0,
        }
    }

    /// The lr of 0-based scheduler iteration `iter` (DeepSpeed's
    /// `get_lr` at `last_batch_iteration = iter`).
    pub fn lr(&self, iter: u64) -> f64 {
        match self.scheduler {
            Scheduler::Constant => self.base_lr,
            Scheduler::WarmupLr {
                min_lr,
                max_lr,
                warmup_steps,
                warmup_type,
            } => {
                let w = warmup_len(warmup_steps);
                let gamma = if iter < w {
                    warmup_gamma(iter, w, warmup_type)
                } else {
                    1.0
                };
                min_lr + (max_lr - min_lr) * gamma
            }
            Scheduler::WarmupDecayLr {
                min_lr,
                max_lr,
                warmup_steps,
                warmup_type,
                total_steps,
            } => {
                let w = warmup_len(warmup_steps);
                let gamma = if iter < w {
                    warmup_gamma(iter, w, warmup_type)
                } else {
                    let left = total_steps as f64 - iter as f64;
                    let span = (total_steps as f64 - w as f64).max(1.0);
                    (left / span).max(0.0)
                };
                min_lr + (max_lr - min_lr) * gamma
            }
            Scheduler::WarmupCosineLr {
                total_steps,
                warmup_min_ratio,
                warmup_steps,
                cos_min_ratio,
                warmup_type,
            } => {
                let w = warmup_len(warmup_steps);
                let ratio = if iter < w {
                    let r = warmup_gamma(iter, w, warmup_type);
                    warmup_min_ratio + r * (1.0 - warmup_min_ratio)
                } else {
                    let real_last = (iter - w + 1) as f64;
                    let real_total = (total_steps as f64 - w as f64).max(1.0);
                    // Clamped, as DeepSpeed does: past the schedule's end
                    // the ratio stays at cos_min_ratio.
                    let progress = (real_last / real_total).min(1.0);
                    let c = (1.0 + (std::f64::consts::PI * progress).cos()) / 2.0;
                    (cos_min_ratio + (1.0 - cos_min_ratio) * c).max(0.0)
                };
                self.base_lr * ratio
            }
        }
    }
}

/// The changing part of a [`LossScaler`], as saved in a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LossScalerState {
    /// The scale, for people reading the manifest.
    pub cur_scale: f64,
    /// The scale's exact bits (what [`LossScaler::restore`] uses).
    pub cur_scale_bits: u64,
    /// Overflows left before the next halving.
    pub cur_hysteresis: u64,
    /// Steps seen.
    pub cur_iter: u64,
    /// Step of the last overflow (-1: none).
    pub last_overflow_iter: i64,
}

/// fp16 loss scaling: DeepSpeed's `DynamicLossScaler`
/// (`deepspeed/runtime/fp16/loss_scaler.py`, what ZeRO-3's
/// `_update_scale` calls) step for step, or a static scale.
#[derive(Debug, Clone, PartialEq)]
pub struct LossScaler {
    cur_scale: f64,
    dynamic: bool,
    window: u64,
    hysteresis: u64,
    cur_hysteresis: u64,
    min_scale: f64,
    consecutive_hysteresis: bool,
    cur_iter: u64,
    last_overflow_iter: i64,
}

impl LossScaler {
    /// No scaling (fp32, bf16).
    pub fn none() -> Self {
        LossScaler {
            cur_scale: 1.0,
            dynamic: false,
            window: 1,
            hysteresis: 1,
            cur_hysteresis: 1,
            min_scale: 1.0,
            consecutive_hysteresis: false,
            cur_iter: 0,
            last_overflow_iter: -1,
        }
    }

    /// Whether the scale moves with overflows (fp16's dynamic scaling): a
    /// skipped step then lowers it, and the next may succeed.
    pub fn is_dynamic(&self) -> bool {
        self.dynamic
    }

    /// From the config's fp16 loss-scale setting.
    pub fn from_config(ls: LossScale) -> Self {
        match ls {
            LossScale::Static(s) => LossScaler {
                cur_scale: s,
                ..Self::none()
            },
            LossScale::Dynamic {
                initial_scale_power,
                window,
                hysteresis,
                min_scale,
                consecutive_hysteresis,
            } => LossScaler {
                cur_scale: 2f64.powi(initial_scale_power as i32),
                dynamic: true,
                window: window.max(1),
                hysteresis: hysteresis.max(1),
                cur_hysteresis: hysteresis.max(1),
                min_scale,
                consecutive_hysteresis,
                cur_iter: 0,
                last_overflow_iter: -1,
            },
        }
    }

    /// The current scale.
    pub fn scale(&self) -> f64 {
        self.cur_scale
    }

    /// The state that changes while training (what a checkpoint saves; the
    /// settings come from the config).
    pub fn state(&self) -> LossScalerState {
        LossScalerState {
            cur_scale: self.cur_scale,
            cur_scale_bits: self.cur_scale.to_bits(),
            cur_hysteresis: self.cur_hysteresis,
            cur_iter: self.cur_iter,
            last_overflow_iter: self.last_overflow_iter,
        }
    }

    /// Continues from a saved state (bit-exact: the scale is restored from
    /// its bits, not from the decimal text). A static scaler keeps the
    /// config's scale: nothing of a static run changes while training, and
    /// a resumed run that sets `fp16.loss_scale` means that value (the
    /// resume warns that the precision settings differ).
    pub fn restore(&mut self, s: &LossScalerState) {
        if !self.dynamic {
            return;
        }
        self.cur_scale = f64::from_bits(s.cur_scale_bits);
        self.cur_hysteresis = s.cur_hysteresis;
        self.cur_iter = s.cur_iter;
        self.last_overflow_iter = s.last_overflow_iter;
    }

    /// Updates after a step, as DeepSpeed's `update_scale`: on overflow,
    /// halve (not below `min_scale`) once `hysteresis` overflows are
    /// spent; an overflow at `min_scale` then is
    /// [`OptimError::LossScaleAtMinimum`].
    /// Without one, double when the steps since the last overflow, less
    /// one, are a positive multiple of `window` (the first doubling comes
    /// `window` steps after the overflow's, or at step `window` of a run
    /// without any). The hysteresis is restored by a doubling, or by every
    /// step without overflow with `consecutive_hysteresis`.
    pub fn update(&mut self, overflow: bool) -> Result<(), OptimError> {
        if !self.dynamic {
            return Ok(());
        }
        if overflow {
            if self.hysteresis == 1 || self.cur_hysteresis == 1 {
                if self.cur_scale == self.min_scale {
                    return Err(OptimError::LossScaleAtMinimum {
                        min_scale: self.min_scale,
                    });
                }
                self.cur_scale = (self.cur_scale / 2.0).max(self.min_scale);
            } else {
                self.cur_hysteresis -= 1;
            }
            self.last_overflow_iter = self.cur_iter as i64;
        } else {
            if self.consecutive_hysteresis {
                self.cur_hysteresis = self.hysteresis;
            }
            let stable_interval = self.cur_iter as i64 - self.last_overflow_iter - 1;
            if stable_interval > 0 && stable_interval % self.window as i64 == 0 {
                if !self.consecutive_hysteresis {
                    self.cur_hysteresis = self.hysteresis;
                }
                self.cur_scale *= 2.0;
            }
        }
        self.cur_iter += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[test]
    fn warmup_decay_linear() {
        let s = LrSchedule {
            scheduler: Scheduler::WarmupDecayLr {
                min_lr: 0.0,
                max_lr: 1.0,
                warmup_steps: 4,
                warmup_type: WarmupType::Linear,
                total_steps: 8,
            },
            base_lr: 1.0,
        };
        let got: Vec<f64> = (0..9).map(|i| s.lr(i)).collect();
        assert_eq!(got, vec![0.0, 0.25, 0.5, 0.75, 1.0, 0.75, 0.5, 0.25, 0.0]);
    }

    #[test]
    fn warmup_log_and_cosine() {
        let s = LrSchedule {
            scheduler: Scheduler::WarmupLr {
                min_lr: 0.0,
                max_lr: 1.0,
                warmup_steps: 10,
                warmup_type: WarmupType::Log,
            },
            base_lr: 1.0,
        };
        assert_eq!(s.lr(0), 0.0);
        assert!((s.lr(9) - 1.0).abs() < 1e-12);
        assert_eq!(s.lr(50), 1.0);
        let c = LrSchedule {
            scheduler: Scheduler::WarmupCosineLr {
                total_steps: 10,
                warmup_min_ratio: 0.0,
                warmup_steps: 0,
                cos_min_ratio: 0.1,
                warmup_type: WarmupType::Linear,
            },
            base_lr: 2.0,
        };
        // A warmup of 0 steps is DeepSpeed's max(2, 0) = 2: iterations 0
        // and 1 warm up linearly, then real_last = iter - 1 of 8, at its
        // floor from iteration 9 on, and clamped there past the end.
        assert_eq!(c.lr(0), 0.0);
        assert_eq!(c.lr(1), 1.0);
        assert!(c.lr(2) < 2.0 && c.lr(2) > 1.9);
        assert!((c.lr(9) - 0.2).abs() < 1e-12);
        assert!((c.lr(30) - 0.2).abs() < 1e-12);
        // The first step runs at the lr the scheduler set when built.
        assert_eq!(c.lr_for_step(0), 0.0);
        assert_eq!(c.lr_for_step(3), c.lr(2));
    }

    #[test]
    fn dynamic_scaler_hysteresis_and_window() {
        let mut s = LossScaler::from_config(LossScale::Dynamic {
            initial_scale_power: 4,
            window: 2,
            hysteresis: 2,
            min_scale: 1.0,
            consecutive_hysteresis: false,
        });
        assert_eq!(s.scale(), 16.0);
        s.update(true).unwrap(); // hysteresis absorbs the first overflow
        assert_eq!(s.scale(), 16.0);
        s.update(true).unwrap();
        assert_eq!(s.scale(), 8.0);
        s.update(false).unwrap(); // iter 2, last overflow 1: stable 0
        assert_eq!(s.scale(), 8.0);
        s.update(false).unwrap(); // stable 1: not a multiple of 2
        assert_eq!(s.scale(), 8.0);
        s.update(false).unwrap(); // stable 2: double
        assert_eq!(s.scale(), 16.0);
    }

    /// The scale and hysteresis sequence of DeepSpeed's `DynamicLossScaler`
    /// (loss_scaler.py at DeepSpeed edaa72212), written out by hand from
    /// its `update_scale` for a fixed overflow pattern, in both hysteresis
    /// modes; and the error at the minimum.
    #[test]
    fn dynamic_scaler_follows_deepspeeds_update_scale() {
        // A transcription of DeepSpeed's update_scale, to compare with.
        fn deepspeed(
            overflows: &[bool],
            window: i64,
            delayed_shift: i64,
            consecutive: bool,
            min_scale: f64,
        ) -> Vec<(f64, i64)> {
            let (mut cur_scale, mut cur_iter, mut last_overflow_iter) = (16.0f64, 0i64, -1i64);
            let mut cur_hysteresis = delayed_shift;
            let mut out = Vec::new();
            for &overflow in overflows {
                if overflow {
                    if delayed_shift == 1 || cur_hysteresis == 1 {
                        assert!(cur_scale != min_scale, "the pattern reaches the minimum");
                        cur_scale = (cur_scale / 2.0).max(min_scale);
                    } else {
                        cur_hysteresis -= 1;
                    }
                    last_overflow_iter = cur_iter;
                } else {
                    if consecutive {
                        cur_hysteresis = delayed_shift;
                    }
                    let stable_interval = (cur_iter - last_overflow_iter) - 1;
                    if stable_interval > 0 && stable_interval % window == 0 {
                        if !consecutive {
                            cur_hysteresis = delayed_shift;
                        }
                        cur_scale *= 2.0;
                    }
                }
                cur_iter += 1;
                out.push((cur_scale, cur_hysteresis));
            }
            out
        }
        let pattern: Vec<bool> = [
            false, false, false, true, false, true, true, false, false, false, false, true, false,
            true, false, false, false, false, false, false, false,
        ]
        .to_vec();
        for window in [1u64, 2, 3] {
            for hysteresis in [1u64, 2, 3] {
                for consecutive in [false, true] {
                    let mut s = LossScaler::from_config(LossScale::Dynamic {
                        initial_scale_power: 4,
                        window,
                        hysteresis,
                        min_scale: 1.0,
                        consecutive_hysteresis: consecutive,
                    });
                    let got: Vec<(f64, i64)> = pattern
                        .iter()
                        .map(|&o| {
                            s.update(o).unwrap();
                            (s.scale(), s.state().cur_hysteresis as i64)
                        })
                        .collect();
                    let want =
                        deepspeed(&pattern, window as i64, hysteresis as i64, consecutive, 1.0);
                    assert_eq!(
                        got, want,
                        "window {window}, hysteresis {hysteresis}, consecutive {consecutive}"
                    );
                }
            }
        }
        // Window 1 without overflows: the first doubling after step 1, not
        // after step 0 (it came one step early before).
        let mut s = LossScaler::from_config(LossScale::Dynamic {
            initial_scale_power: 4,
            window: 1,
            hysteresis: 1,
            min_scale: 1.0,
            consecutive_hysteresis: false,
        });
        s.update(false).unwrap();
        assert_eq!(s.scale(), 16.0);
        s.update(false).unwrap();
        assert_eq!(s.scale(), 32.0);
        // At the minimum, an overflow is the end of the run.
        let mut s = LossScaler::from_config(LossScale::Dynamic {
            initial_scale_power: 1,
            window: 1000,
            hysteresis: 1,
            min_scale: 1.0,
            consecutive_hysteresis: false,
        });
        s.update(true).unwrap();
        assert_eq!(s.scale(), 1.0);
        let e = s.update(true).unwrap_err();
        assert!(matches!(e, OptimError::LossScaleAtMinimum { min_scale } if min_scale == 1.0));
        assert!(e.to_string().contains("fp16.min_loss_scale"), "{e}");
    }

    #[test]
    fn a_static_scale_is_the_configs_after_a_restore() {
        let mut dynamic = LossScaler::from_config(LossScale::Dynamic {
            initial_scale_power: 4,
            window: 2,
            hysteresis: 1,
            min_scale: 1.0,
            consecutive_hysteresis: false,
        });
        dynamic.update(true).unwrap();
        let saved = dynamic.state();
        let mut resumed = LossScaler::from_config(LossScale::Dynamic {
            initial_scale_power: 16,
            window: 2,
            hysteresis: 1,
            min_scale: 1.0,
            consecutive_hysteresis: false,
        });
        resumed.restore(&saved);
        assert_eq!(resumed.scale(), 8.0);
        let mut fixed = LossScaler::from_config(LossScale::Static(128.0));
        fixed.restore(&saved);
        assert_eq!(fixed.scale(), 128.0);
    }
}

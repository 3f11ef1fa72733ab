//! `tierzero train`'s number flags, checked into [`Flags`] once.

use std::num::NonZeroUsize;

use tierzero::config;
use tierzero::units::parse_count;

use super::{bad, Failure, TrainArgs};

/// The most steps a run may have: `--steps`' bound, and the config's or a
/// checkpoint's run length's (2^40; a `total_num_steps` of 1e19 was an
/// endless run).
pub(super) const MAX_STEPS: u64 = 1 << 40;

/// A whole number for `flag` in `min..=max` (counts may use K/M/B suffixes
/// or a float form such as 1e3).
pub(in crate::cli) fn number(flag: &str, text: &str, min: u64, max: u64) -> Result<u64, Failure> {
    let v = parse_count(text).map_err(|e| {
        bad(format!(
            "{flag}: {e}; give a whole number such as {flag} {min}"
        ))
    })?;
    if v < min || v > max {
        return Err(bad(format!(
            "{flag}: {v} is out of range; give a whole number from {min} to {max}"
        )));
    }
    Ok(v)
}

/// The number flags of `tierzero train`, checked.
pub(super) struct Flags {
    pub(super) seed: u64,
    /// `None`: auto.
    pub(super) threads: Option<NonZeroUsize>,
    pub(super) steps: Option<u64>,
    pub(super) micro_batch: Option<u64>,
    pub(super) grad_accum: Option<u64>,
    pub(super) lr: Option<f64>,
    pub(super) save_every: Option<u64>,
    pub(super) stop_grace: Option<std::time::Duration>,
}

impl Flags {
    pub(super) fn parse(args: &TrainArgs) -> Result<Flags, Failure> {
        let opt = |flag: &str, text: &Option<String>, max: u64| -> Result<Option<u64>, Failure> {
            text.as_deref().map(|s| number(flag, s, 1, max)).transpose()
        };
        let seed = match &args.seed {
            Some(s) => number("--seed", s, 0, u64::MAX)?,
            None => 1,
        };
        let threads = match args.threads.trim() {
            "auto" => None,
            t => NonZeroUsize::new(number("--threads", t, 1, 1024)? as usize),
        };
        let steps = opt("--steps", &args.steps, MAX_STEPS)?;
        let micro_batch = opt("--micro-batch", &args.micro_batch, 1 << 30)?;
        let grad_accum = opt("--grad-accum", &args.grad_accum, 1 << 30)?;
        let lr = match &args.lr {
            Some(s) => Some(
                s.parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite() && *v > 0.0)
                    .ok_or_else(|| {
                        bad(format!(
                            "--lr {s}: not a positive number; give a learning rate such as --lr 1e-4"
                        ))
                    })?,
            ),
            None => None,
        };
        Ok(Flags {
            seed,
            threads,
            steps,
            micro_batch,
            grad_accum,
            lr,
            save_every: opt("--save-every", &args.save_every, 1 << 40)?,
            stop_grace: match &args.stop_grace {
                None => None,
                Some(s) => Some(
                    s.parse::<f64>()
                        .ok()
                        .filter(|v| v.is_finite() && *v > 0.0 && *v <= config::MAX_STOP_GRACE_S)
                        .map(std::time::Duration::from_secs_f64)
                        .ok_or_else(|| {
                            bad(format!(
                                "--stop-grace {s}: not a number of seconds above 0 (at most \
                                 {}); give the grace period before SIGKILL, such as \
                                 --stop-grace 30",
                                config::MAX_STOP_GRACE_S
                            ))
                        })?,
                ),
            },
        })
    }
}

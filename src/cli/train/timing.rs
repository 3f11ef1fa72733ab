//! The seconds of a run: before the first step (by part), the steps, and
//! after the last step, for the done line and `--json`.

use std::time::Instant;

use tierzero::engine::BuildTimes;

/// When the run reached each point, as `train` saw it.
pub(super) struct Marks {
    /// The command began.
    pub started: Instant,
    /// The trainer's build began.
    pub built: Instant,
    /// The build's seconds.
    pub build_s: f64,
    /// The build's parts ([`tierzero::engine::Trainer::build_times`]).
    pub build_times: BuildTimes,
    /// The first step began.
    pub train_started: Instant,
    /// The steps' seconds.
    pub train_s: f64,
    /// The last step ended.
    pub steps_ended: Instant,
}

/// Seconds of a run: the steps alone, everything, what came before the
/// steps and what came after them.
#[derive(Debug, Clone, Copy)]
pub(super) struct Timing {
    pub train_s: f64,
    pub total_s: f64,
    pub startup: Startup,
    /// After the last step: the trainer's finish (its last optimizer tail,
    /// the weights' hash, its swap files removed), the timeline, and on a
    /// stopped run of several ranks their barrier.
    pub finish_s: f64,
}

/// Seconds before the first step, by part.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub(super) struct Startup {
    /// All of it.
    pub startup_s: f64,
    /// Before the trainer was built: the config, the data (tokenizing),
    /// the compute's device, the model or checkpoint opened.
    pub before_trainer_s: f64,
    /// Building the trainer: [`Startup::tiers_s`], [`Startup::initial_s`]
    /// and a little more.
    pub trainer_s: f64,
    /// Of `trainer_s`: the host's threads and the tiers
    /// ([`tierzero::engine::BuildTimes::tiers_s`]).
    pub tiers_s: f64,
    /// Of `trainer_s`: the initial weights and optimizer state, or the
    /// checkpoint's load ([`tierzero::engine::BuildTimes::initial_s`]).
    pub initial_s: f64,
}

impl Timing {
    /// The run's seconds, its end now: the total and the finish end at the
    /// same instant, so the start-up, the steps and the finish add up to
    /// at most the total.
    pub fn new(m: Marks) -> Timing {
        let end = Instant::now();
        Timing {
            train_s: m.train_s,
            total_s: (end - m.started).as_secs_f64(),
            startup: Startup {
                startup_s: (m.train_started - m.started).as_secs_f64(),
                before_trainer_s: (m.built - m.started).as_secs_f64(),
                trainer_s: m.build_s,
                tiers_s: m.build_times.tiers_s,
                initial_s: m.build_times.initial_s,
            },
            finish_s: (end - m.steps_ended).as_secs_f64(),
        }
    }
}

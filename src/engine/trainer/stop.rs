//! Stopping a run at a step boundary: [`StopHandle`], and what the trainer
//! does with it.
//!
//! # Design
//!
//! * **A request, not an interruption.** [`StopHandle::request`] only sets
//!   an atomic (and notes when). A step is never cut short: it cannot be
//!   undone half-way (invariant 7), so the trainer looks at the request at
//!   the end of every [`Trainer::step`] and reports it in
//!   [`StepReport::stop`](super::StepReport::stop); the caller's loop ends
//!   there, saves ([`Trainer::save_on_stop`]) and calls
//!   [`Trainer::finish`], which removes the swap files when the trainer
//!   drops.
//! * **No signal handler behind the embedder's back.** The library
//!   installs none; the CLI installs its own (it sets atomics only) and a
//!   watcher thread turns the signal into [`StopHandle::request_because`].
//! * **Several ranks stop at the same step.** At the end of every step
//!   each rank's request is all-gathered (a 4-byte collective, from the
//!   compute thread, at the same point on every rank: invariant 16), so a
//!   request on any rank stops every rank after the same step; the cause
//!   is the first requesting rank's, in rank order. The save after it stays
//!   a collective, and so does the grace decision (every rank's time left
//!   is gathered: the save runs only when it fits on every rank).
//! * **A grace period** (`tierzero.stop_grace_s`, or
//!   [`TrainerOptions::stop_grace`](super::TrainerOptions::stop_grace)) bounds
//!   the stop from the request to the end: when the time left after the
//!   step is less than a save is expected to take (the slowest save of this
//!   run, or the last step's wall time before the first save: a save moves
//!   the optimizer state once, as a step does), the save is skipped and
//!   [`StopSave::Skipped`] says by how much. The last checkpoint then stays
//!   the newest, whole.

use super::*;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

/// Why a run stops early.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopCause {
    /// [`StopHandle::request`] (an embedding program).
    Requested,
    /// A signal, by number (the CLI: SIGINT 2, SIGTERM 15).
    Signal(i32),
}

impl StopCause {
    /// What the summary's `"stopped"` says: `"signal"` or `"request"`.
    pub fn kind(self) -> &'static str {
        match self {
            StopCause::Requested => "request",
            StopCause::Signal(_) => "signal",
        }
    }

    /// The signal's name (`"SIGINT"`, `"SIGTERM"`, or `"signal N"`).
    pub fn signal_name(self) -> Option<String> {
        match self {
            StopCause::Requested => None,
            StopCause::Signal(2) => Some("SIGINT".to_owned()),
            StopCause::Signal(15) => Some("SIGTERM".to_owned()),
            StopCause::Signal(1) => Some("SIGHUP".to_owned()),
            StopCause::Signal(n) => Some(format!("signal {n}")),
        }
    }

    /// The wire form of the per-step agreement: 0 is no request.
    fn code(self) -> u32 {
        match self {
            StopCause::Requested => 1,
            StopCause::Signal(n) => 0x100 | (n as u32 & 0xff),
        }
    }

    fn from_code(code: u32) -> Option<StopCause> {
        match code {
            0 => None,
            c if c & 0x100 != 0 => Some(StopCause::Signal((c & 0xff) as i32)),
            _ => Some(StopCause::Requested),
        }
    }
}

#[derive(Debug, Default)]
struct StopState {
    /// [`StopCause::code`] of the first request; 0 = none.
    code: AtomicU32,
    /// When the first request was made.
    at: Mutex<Option<Instant>>,
}

/// Asks a [`Trainer`] to stop at the next step boundary. Cheap to clone;
/// every clone is the same request. [`Trainer::stop_handle`] gives the
/// trainer's, or [`TrainerOptions::stop`](super::TrainerOptions::stop) hands
/// one in before the trainer is built (a request made during start-up
/// stops after the first step).
#[derive(Debug, Clone, Default)]
pub struct StopHandle {
    state: Arc<StopState>,
}

impl StopHandle {
    /// A handle with no request.
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks the trainer to stop after the step in progress (or the next
    /// one). Later requests change nothing.
    pub fn request(&self) {
        self.request_because(StopCause::Requested);
    }

    /// [`request`](Self::request), naming the cause (the CLI: the signal).
    /// Not for a signal handler (it takes a lock): a handler sets an
    /// atomic, and a thread calls this.
    pub fn request_because(&self, cause: StopCause) {
        let mut at = self.state.at.lock().unwrap_or_else(|p| p.into_inner());
        if self
            .state
            .code
            .compare_exchange(0, cause.code(), Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            *at = Some(Instant::now());
        }
    }

    /// The first request's cause, if any (this process's only; the ranks'
    /// agreement is [`Trainer::stop_cause`]).
    pub fn requested(&self) -> Option<StopCause> {
        StopCause::from_code(self.state.code.load(Ordering::SeqCst))
    }

    /// When the first request was made.
    pub fn requested_at(&self) -> Option<Instant> {
        *self.state.at.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// What [`Trainer::save_on_stop`] did.
#[derive(Debug, Clone, PartialEq)]
pub enum StopSave {
    /// The checkpoint of the step the run stopped at, in this step dir.
    Saved(PathBuf),
    /// Not saved: the grace period had less time left than a save takes.
    Skipped {
        /// Seconds a save was expected to take.
        needed_s: f64,
        /// Seconds of the grace period left after the step (the least of
        /// every rank's).
        left_s: f64,
    },
}

impl Trainer {
    /// The trainer's stop handle: [`StopHandle::request`] from any thread
    /// makes the step in progress (or the next) report
    /// [`StepReport::stop`](super::StepReport::stop).
    pub fn stop_handle(&self) -> StopHandle {
        self.stop.clone()
    }

    /// The cause every rank agreed to stop for, once a step has reported
    /// it.
    pub fn stop_cause(&self) -> Option<StopCause> {
        self.stopped
    }

    /// End of a step: do the ranks stop? Every rank's request is
    /// all-gathered (every rank calls this at the end of every step); the
    /// first requesting rank in rank order gives the cause.
    pub(super) fn agree_stop(&mut self) -> Result<Option<StopCause>> {
        if self.stopped.is_some() {
            return Ok(self.stopped);
        }
        let mine = self.stop.requested().map_or(0, StopCause::code);
        let agreed = crate::engine::comm::all_gather_u64(&*self.opts.comm, mine.into())?
            .into_iter()
            .find_map(|c| u32::try_from(c).ok().and_then(StopCause::from_code));
        if agreed.is_some() {
            self.stopped = agreed;
            self.stop_seen_at = Some(self.stop.requested_at().unwrap_or_else(Instant::now));
        }
        Ok(agreed)
    }

    /// The grace period in force: [`TrainerOptions::stop_grace`], else
    /// `tierzero.stop_grace_s`.
    pub fn stop_grace(&self) -> Option<Duration> {
        self.opts.stop_grace.or(self.config.tierzero.stop_grace)
    }

    /// After a step that reported a stop: the checkpoint of this step into
    /// `save_dir`, if it fits in what is left of the grace period on every
    /// rank (a collective, like [`Trainer::save_checkpoint`]); otherwise
    /// nothing is written and [`StopSave::Skipped`] says why.
    pub fn save_on_stop(&mut self, save_dir: &std::path::Path) -> Result<StopSave> {
        self.check_usable()?;
        if let Some(grace) = self.stop_grace() {
            let since = self.stop_seen_at.unwrap_or_else(Instant::now);
            let left_s = grace.as_secs_f64() - since.elapsed().as_secs_f64();
            let needed_s = self
                .slowest_save
                .or(self.last_step_wall)
                .map_or(0.0, |d| d.as_secs_f64());
            let world = self.opts.comm.world_size();
            let mut all = vec![0f64; 2 * world];
            self.opts
                .comm
                .all_gather_f64(&[left_s - needed_s, left_s], &mut all)?;
            // The rank with the least margin decides for all.
            let (margin, left_s) = all.chunks_exact(2).map(|p| (p[0], p[1])).fold(
                (f64::INFINITY, f64::INFINITY),
                |a, b| {
                    if b.0 < a.0 {
                        b
                    } else {
                        a
                    }
                },
            );
            if margin < 0.0 {
                return Ok(StopSave::Skipped {
                    needed_s: left_s - margin,
                    left_s,
                });
            }
        }
        self.save_checkpoint(save_dir).map(StopSave::Saved)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_request_wins_and_codes_round_trip() {
        let h = StopHandle::new();
        assert_eq!(h.requested(), None);
        assert_eq!(h.requested_at(), None);
        h.clone().request_because(StopCause::Signal(15));
        h.request();
        assert_eq!(h.requested(), Some(StopCause::Signal(15)));
        assert!(h.requested_at().is_some());
        for c in [
            StopCause::Requested,
            StopCause::Signal(2),
            StopCause::Signal(15),
        ] {
            assert_eq!(StopCause::from_code(c.code()), Some(c));
        }
        assert_eq!(
            StopCause::Signal(2).signal_name().as_deref(),
            Some("SIGINT")
        );
        assert_eq!(StopCause::Signal(15).kind(), "signal");
    }
}

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
//! * **A stop during the build** ends it: the initial state's store (a
//!   model larger than memory takes minutes to write to its tiers) looks
//!   at the request before each sub-group, and the build returns
//!   [`EngineError::StoppedInBuild`]; what it made (swap files, arenas)
//!   drops with it. Several ranks agree at the build's end
//!   ([`agree_build_end`]): one gather, reached by every rank whether it
//!   stored everything or stopped early, so a request on any rank ends
//!   every rank's build, and none waits in a collective for a rank that
//!   left.
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

    /// The signal's name, or "a stop request" (an embedding program's).
    pub fn describe(self) -> String {
        self.signal_name()
            .unwrap_or_else(|| "a stop request".to_owned())
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
/// one in before the trainer is built (a request made while it is built
/// ends the build: [`EngineError::StoppedInBuild`]).
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
    /// all-gathered (every rank calls this at the end of every step, and
    /// may again after the save of a step, all at the same one: a stop
    /// asked for during a save then ends the run at the step saved); the
    /// first requesting rank in rank order gives the cause, and it stays
    /// the answer from then on.
    pub fn agree_stop(&mut self) -> Result<Option<StopCause>> {
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

/// [`EngineError::StoppedInBuild`] if a stop was requested, with this
/// rank's progress.
pub(super) fn check_build_stop(
    stop: &StopHandle,
    stored_numel: u64,
    total_numel: u64,
) -> Result<()> {
    match stop.requested() {
        Some(cause) => Err(EngineError::StoppedInBuild {
            cause,
            stored_numel,
            total_numel,
        }),
        None => Ok(()),
    }
}

/// The build's end on every rank (see "A stop during the build" above):
/// `local` is how this rank's tiers and its store of `total_numel`
/// elements ended (what it built, or why not); a stop requested since
/// counts too. Every rank gathers every rank's end:
/// an error on any rank fails every rank (its own first, else
/// [`EngineError::Comm`] naming the rank), else a stop on any rank stops
/// every rank (the first requesting rank's cause, in rank order).
pub(super) fn agree_build_end<T>(
    comm: &dyn crate::engine::comm::Comm,
    stop: &StopHandle,
    total_numel: u64,
    local: Result<T>,
) -> Result<T> {
    let local =
        local.and_then(|built| check_build_stop(stop, total_numel, total_numel).map(|()| built));
    if comm.world_size() == 1 {
        return local;
    }
    const STOPPED: u8 = b'S';
    const FAILED: u8 = b'!';
    let mine = match &local {
        Ok(_) => Vec::new(),
        Err(EngineError::StoppedInBuild { cause, .. }) => {
            let mut m = vec![STOPPED];
            m.extend_from_slice(&cause.code().to_le_bytes());
            m
        }
        Err(e) => format!("{}{e}", FAILED as char).into_bytes(),
    };
    let all = crate::engine::comm::all_gather_var(comm, &mine)?;
    let built = local?;
    if let Some((peer, msg)) = all
        .iter()
        .enumerate()
        .find(|(_, m)| m.first() == Some(&FAILED))
    {
        return Err(EngineError::Comm {
            rank: comm.rank(),
            world: comm.world_size(),
            op: "building the trainer",
            reason: format!(
                "rank {peer} failed: {}",
                String::from_utf8_lossy(msg.get(1..).unwrap_or_default())
            ),
        });
    }
    let peer_stop = all.iter().find_map(|m| match m.split_first() {
        Some((&STOPPED, code)) => <[u8; 4]>::try_from(code)
            .ok()
            .and_then(|c| StopCause::from_code(u32::from_le_bytes(c))),
        _ => None,
    });
    match peer_stop {
        Some(cause) => Err(EngineError::StoppedInBuild {
            cause,
            stored_numel: total_numel,
            total_numel,
        }),
        None => Ok(built),
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

    /// Rank 1's end of the build, as it gathers: stored all, stopped by
    /// SIGTERM, failed.
    const PEER_ENDS: [&[u8]; 3] = [b"", &[b'S', 15, 1, 0, 0], b"!disk gone"];

    fn peer_len<const P: usize>(own: &[f64], out: &mut [f64]) -> Result<()> {
        out.copy_from_slice(&[own[0], PEER_ENDS[P].len() as f64]);
        Ok(())
    }

    fn peer_bytes<const P: usize>(shard: &[u8], counts: &[usize], out: &mut [u8]) -> Result<()> {
        out[..counts[0]].copy_from_slice(shard);
        out[counts[0]..].copy_from_slice(PEER_ENDS[P]);
        Ok(())
    }

    fn rank_zero_with_peer(
        gather_f64: crate::engine::comm::scripted::GatherF64,
        gather_bytes: crate::engine::comm::scripted::GatherBytes,
    ) -> crate::engine::comm::scripted::Scripted {
        let mut c = crate::engine::comm::scripted::Scripted::rank_of(0, 2);
        c.gather_f64 = Some(gather_f64);
        c.gather_bytes = Some(gather_bytes);
        c
    }

    #[test]
    fn every_rank_ends_the_build_as_the_first_stop_or_failure_says() {
        let total = 100;
        let stored = rank_zero_with_peer(peer_len::<0>, peer_bytes::<0>);
        let stopped = rank_zero_with_peer(peer_len::<1>, peer_bytes::<1>);
        let failed = rank_zero_with_peer(peer_len::<2>, peer_bytes::<2>);
        let none = StopHandle::new();
        assert!(agree_build_end(&stored, &none, total, Ok(())).is_ok());
        // A peer's stop stops this rank, which stored everything.
        match agree_build_end(&stopped, &none, total, Ok(())) {
            Err(EngineError::StoppedInBuild {
                cause: StopCause::Signal(15),
                stored_numel: 100,
                total_numel: 100,
            }) => {}
            other => panic!("{other:?}"),
        }
        // A peer's failure fails this rank, naming the peer.
        match agree_build_end(&failed, &none, total, Ok(())) {
            Err(e @ EngineError::Comm { .. }) => {
                assert!(e.to_string().contains("rank 1 failed: disk gone"), "{e}")
            }
            other => panic!("{other:?}"),
        }
        // This rank's own stop, seen in its store or only at its end,
        // comes first.
        let own = StopHandle::new();
        own.request_because(StopCause::Signal(2));
        let mid_store = check_build_stop(&own, 40, total);
        for local in [mid_store, Ok(())] {
            match agree_build_end(&stopped, &own, total, local) {
                Err(EngineError::StoppedInBuild {
                    cause: StopCause::Signal(2),
                    ..
                }) => {}
                other => panic!("{other:?}"),
            }
        }
        // One rank alone: no collective (none is scripted).
        let alone = crate::engine::comm::scripted::Scripted::rank_of(0, 1);
        assert!(agree_build_end(&alone, &none, total, Ok(())).is_ok());
        assert!(matches!(
            agree_build_end(&alone, &own, total, Ok(())),
            Err(EngineError::StoppedInBuild {
                stored_numel: 100,
                ..
            })
        ));
    }
}

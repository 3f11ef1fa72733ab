//! How the speculative optimizer step has fared in a run
//! ([`Speculation`]), and `tierzero.speculative_step: "auto"`'s rule for
//! stopping and resuming it (see "Speculative step" in the trainer's
//! module docs).

/// How the speculative step has fared in this run.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Speculation {
    /// Steps whose speculation held.
    pub(super) hits: u64,
    /// Steps redone (clipping) or undone (gradients not finite).
    pub(super) misses: u64,
    /// NVMe sub-groups that waited for the decision while speculating
    /// because the speculation pool's slots were taken.
    pub(super) pool_waits: u64,
    /// Misses since the last hit.
    misses_in_a_row: u32,
    /// `"auto"` stopped speculating after [`SPECULATION_GIVE_UP`] misses
    /// in a row; it speculates again after as many steps in a row whose
    /// decision would have held.
    pub(super) given_up: bool,
    /// While stopped: steps in a row whose speculation would have held.
    would_hold_in_a_row: u32,
    /// The stop was said (once).
    said: bool,
}

/// What a step changed in [`Speculation`], worth saying.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SpeculationNews {
    /// `"auto"` stopped speculating (said once per run).
    Stopped { misses: u32 },
    /// `"auto"` speculates again.
    Resumed,
}

impl Speculation {
    /// Records a step: `speculated` whether it speculated, `held` whether
    /// its decision kept (or would have kept) the speculative multiplier,
    /// `auto` whether `tierzero.speculative_step` is `"auto"`.
    pub(super) fn record(
        &mut self,
        speculated: bool,
        held: bool,
        auto: bool,
    ) -> Option<SpeculationNews> {
        if !speculated {
            if !self.given_up {
                return None;
            }
            self.would_hold_in_a_row = if held {
                self.would_hold_in_a_row + 1
            } else {
                0
            };
            if self.would_hold_in_a_row < SPECULATION_GIVE_UP {
                return None;
            }
            self.given_up = false;
            self.misses_in_a_row = 0;
            return Some(SpeculationNews::Resumed);
        }
        if held {
            self.hits += 1;
            self.misses_in_a_row = 0;
            return None;
        }
        self.misses += 1;
        self.misses_in_a_row += 1;
        if !auto || self.given_up || self.misses_in_a_row < SPECULATION_GIVE_UP {
            return None;
        }
        self.given_up = true;
        self.would_hold_in_a_row = 0;
        if self.said {
            return None;
        }
        self.said = true;
        Some(SpeculationNews::Stopped {
            misses: self.misses_in_a_row,
        })
    }
}

/// With `tierzero.speculative_step: "auto"`, misses in a row after which
/// the run stops speculating (early fine-tuning steps often clip; when
/// every step does, speculation only costs the re-step), and steps in a
/// row that would have held after which it speculates again (later steps
/// rarely clip).
pub(super) const SPECULATION_GIVE_UP: u32 = 3;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_speculation_stops_after_misses_and_resumes_after_would_be_hits() {
        let mut s = Speculation::default();
        assert_eq!(s.record(true, false, true), None);
        assert_eq!(s.record(true, false, true), None);
        assert_eq!(
            s.record(true, false, true),
            Some(SpeculationNews::Stopped { misses: 3 })
        );
        assert!(s.given_up);
        // Two would-be hits and a clip: still stopped.
        assert_eq!(s.record(false, true, true), None);
        assert_eq!(s.record(false, true, true), None);
        assert_eq!(s.record(false, false, true), None);
        assert!(s.given_up);
        for _ in 0..2 {
            assert_eq!(s.record(false, true, true), None);
        }
        assert_eq!(s.record(false, true, true), Some(SpeculationNews::Resumed));
        assert!(!s.given_up);
        assert_eq!(s.record(true, true, true), None);
        assert_eq!((s.hits, s.misses), (1, 3));
        // A second stop is not said again.
        for _ in 0..3 {
            assert_eq!(s.record(true, false, true), None);
        }
        assert!(s.given_up);
        // `true` never stops.
        let mut t = Speculation::default();
        for _ in 0..10 {
            assert_eq!(t.record(true, false, false), None);
        }
        assert!(!t.given_up);
    }
}

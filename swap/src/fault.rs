//! Fault injection for tests: lie about the result of the Nth transfer.
//!
//! The injector sits between the kernel's answer and our completion check,
//! in both backends, so the same fault exercises the same recovery code
//! whichever backend runs. The transfer itself really happened; only its
//! reported result is replaced. That is enough to drive every path the
//! engine has for a bad result: resubmitting the rest of a short transfer,
//! reporting `ShortIo` at end of file, reporting an errno and poisoning the
//! space after a failed write.
//!
//! Each rule fires once: at the `nth` matching completion, or, for
//! [`FaultKind::Short`], at the first matching completion from the `nth` on
//! that is long enough to cut in half (an aligned 4096-byte piece cannot be
//! shortened). Counts are per operation kind when the rule names one, so a
//! test can aim at "the 3rd write" without counting reads; [`FaultInjector::completions`]
//! tells how many there were, so a test can first measure a clean run and
//! then place faults across it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::error::IoOp;

/// What an injected fault reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// Fail with this errno (`libc::EIO`, `libc::ENOSPC`, ...).
    Errno(i32),
    /// Report half of the bytes (rounded down to 4096): a short transfer the
    /// engine must finish by resubmitting the rest.
    Short,
    /// Report 0 bytes: end of file, which the engine reports as `ShortIo`.
    Eof,
}

/// One fault: the `nth` (1-based) piece completion of `op` (or of any op);
/// a `Short` waits for the first piece it can shorten from there on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultRule {
    /// Which completion, counting from 1, among those matching `op`.
    pub nth: u64,
    /// Only count reads or writes; `None` counts both.
    pub op: Option<IoOp>,
    /// What to report.
    pub kind: FaultKind,
}

/// A set of fault rules with their counters.
#[derive(Debug, Default)]
pub struct FaultInjector {
    rules: Vec<FaultRule>,
    fired: Vec<AtomicBool>,
    reads: AtomicU64,
    writes: AtomicU64,
    all: AtomicU64,
    injected: AtomicU64,
}

impl FaultInjector {
    /// An injector firing each rule once.
    pub fn new(rules: Vec<FaultRule>) -> Self {
        FaultInjector {
            fired: rules.iter().map(|_| AtomicBool::new(false)).collect(),
            rules,
            ..Default::default()
        }
    }

    /// Piece completions seen so far of `op`, or of both with `None`
    /// (resubmitted remainders of short transfers count again).
    pub fn completions(&self, op: Option<IoOp>) -> u64 {
        match op {
            None => self.all.load(Ordering::Relaxed),
            Some(IoOp::Read) => self.reads.load(Ordering::Relaxed),
            Some(IoOp::Write) => self.writes.load(Ordering::Relaxed),
        }
    }

    /// How many faults have fired.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }

    /// Applies the rules to one completion of `op` whose real result is
    /// `res` (bytes or `-errno`) for a transfer of `len_bytes`.
    pub(crate) fn apply(&self, op: IoOp, res: i64, len_bytes: u64) -> i64 {
        let n_all = self.all.fetch_add(1, Ordering::Relaxed) + 1;
        let n_op = match op {
            IoOp::Read => self.reads.fetch_add(1, Ordering::Relaxed) + 1,
            IoOp::Write => self.writes.fetch_add(1, Ordering::Relaxed) + 1,
        };
        for (r, fired) in self.rules.iter().zip(&self.fired) {
            if fired.load(Ordering::Relaxed) {
                continue;
            }
            let n = match r.op {
                None => n_all,
                Some(o) if o == op => n_op,
                Some(_) => continue,
            };
            let hit = match r.kind {
                FaultKind::Short => n >= r.nth,
                _ => n == r.nth,
            };
            if !hit {
                continue;
            }
            let out = match r.kind {
                FaultKind::Errno(e) => -(e as i64),
                FaultKind::Eof => 0,
                FaultKind::Short => {
                    let half = (len_bytes / 2) / 4096 * 4096;
                    if half == 0 || res < len_bytes as i64 {
                        continue;
                    }
                    half as i64
                }
            };
            if fired.swap(true, Ordering::Relaxed) {
                continue;
            }
            self.injected.fetch_add(1, Ordering::Relaxed);
            return out;
        }
        res
    }
}

//! SIGINT and SIGTERM for `tierzero train` (and `launch`): the first asks
//! the trainer to stop at the next step boundary, a second aborts at once.
//!
//! Design:
//! * **The handlers only set atomics.** They are signal-hook's
//!   (`signal_hook::flag`: registered with safe code, the main crate
//!   denies `unsafe`): per signal, in this order, (1) if `armed` is already
//!   set, the signal's default action (the process dies of it: the abort),
//!   (2) set `armed`, (3) store the signal's number in `last`. Nothing else
//!   runs in a handler: no allocation, no lock, no I/O.
//! * **A watcher thread** polls `last` every [`POLL`] and turns the first
//!   signal into [`StopHandle::request_because`] (which notes the time the
//!   grace period starts from) and one line on stderr. So a stop is seen
//!   within [`POLL`] of the signal; the trainer acts on it at the end of the
//!   step in progress.
//! * **A second signal aborts at once** (the default action, as if no
//!   handler were installed: exit status "killed by SIGINT/SIGTERM"). It
//!   is as safe as any kill (invariant 18): the last whole checkpoint stays,
//!   a save in progress leaves only a staging dir, and the next start
//!   reclaims the swap files. Two signals less than [`POLL`] apart are
//!   still two: `armed` is set by the first handler itself.
//! * **Exit codes** of a graceful stop: 128 + the signal's number, as a
//!   shell reports a process killed by it: [`EXIT_SIGINT`] (130),
//!   [`EXIT_SIGTERM`] (143).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::anyhow;
use signal_hook::consts::{SIGINT, SIGTERM};
use tierzero::engine::{StopCause, StopHandle};

use super::Failure;

/// Exit code of a run stopped by SIGINT at a step boundary.
pub const EXIT_SIGINT: i32 = 130;
/// Exit code of a run stopped by SIGTERM at a step boundary.
pub const EXIT_SIGTERM: i32 = 143;

/// How often the watcher looks at the handlers' flag.
pub const POLL: Duration = Duration::from_millis(20);

/// The exit code of a run that stopped for `cause`: 128 + the signal (0
/// for a stop that was not a signal's).
pub fn exit_code(cause: StopCause) -> i32 {
    match cause {
        StopCause::Signal(n) => 128 + n,
        StopCause::Requested => 0,
    }
}

/// Installs the handlers and the watcher: the first SIGINT or SIGTERM
/// requests a stop on `handle`, a second aborts.
pub fn install(handle: StopHandle) -> Result<(), Failure> {
    let (_armed, last) = register()?;
    std::thread::Builder::new()
        .name("tierzero-signals".into())
        .spawn(move || loop {
            let sig = last.load(Ordering::SeqCst);
            if sig != 0 {
                let cause = StopCause::Signal(sig as i32);
                handle.request_because(cause);
                eprintln!(
                    "tierzero: {} received: stopping after the step in progress (a second \
                     signal aborts at once)",
                    cause.signal_name().unwrap_or_default()
                );
                return;
            }
            std::thread::sleep(POLL);
        })
        .map_err(|e| Failure::Internal(anyhow!("starting the signal watcher: {e}")))?;
    Ok(())
}

/// `tierzero launch`: the first SIGINT or SIGTERM is left to the ranks
/// (mpirun passes it on), so the launcher waits for mpirun and returns its
/// exit code; a second aborts it at once.
#[cfg(feature = "mpi")]
pub fn install_for_launcher() -> Result<(), Failure> {
    register().map(|_| ())
}

/// The handlers: `armed` is set by the first signal (a second then runs
/// the default action), `last` holds the latest signal's number.
fn register() -> Result<(Arc<AtomicBool>, Arc<AtomicUsize>), Failure> {
    let armed = Arc::new(AtomicBool::new(false));
    let last = Arc::new(AtomicUsize::new(0));
    for sig in [SIGINT, SIGTERM] {
        let err = |e: std::io::Error| {
            Failure::Internal(anyhow!("installing the handler of signal {sig}: {e}"))
        };
        signal_hook::flag::register_conditional_default(sig, Arc::clone(&armed)).map_err(err)?;
        signal_hook::flag::register(sig, Arc::clone(&armed)).map_err(err)?;
        signal_hook::flag::register_usize(sig, Arc::clone(&last), sig as usize).map_err(err)?;
    }
    Ok((armed, last))
}

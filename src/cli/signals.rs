//! SIGINT, SIGTERM and SIGHUP for `tierzero train` (and `launch`): the
//! first asks the trainer to stop at the next step boundary, a second
//! aborts at once. SIGHUP (a closed terminal, a dropped ssh session) is
//! one like the others (its default action killed the run without its
//! save, and left the swap files until the next run), unless the process
//! started with it ignored (`nohup`): then it stays ignored.
//! Before that boundary exists, the first ends the start-up at once, or
//! the trainer's build where it is ([`trainer_build_begins`]).
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
//!   [`EXIT_SIGTERM`] (143), [`EXIT_SIGHUP`] (129).
//! * **Under mpirun** (`tierzero launch`, or mpirun by hand). OpenMPI's
//!   mpirun answers a SIGINT or SIGTERM by sending the ranks SIGTERM and,
//!   `odls_base_sigkill_timeout` (1 s) later, SIGKILL: too soon for a stop
//!   at a step boundary and its save. It passes SIGUSR1 and SIGUSR2 on to
//!   the ranks untouched, so a rank takes SIGUSR1 as a SIGINT and SIGUSR2
//!   as a SIGTERM ([`STOP_AS_SIGINT`], [`STOP_AS_SIGTERM`]; by hand: `kill
//!   -USR1 <mpirun's pid>`). `tierzero launch` runs mpirun in a process
//!   group of its own (a terminal's Ctrl-C reaches the launcher alone) and
//!   turns the first SIGINT, SIGTERM or SIGHUP it gets into one of those;
//!   a second into a SIGINT to mpirun, its abort. (Two signals carry three
//!   stops: the ranks take a SIGHUP as a SIGTERM, and the launcher exits
//!   with 129, the code of what it got: [`MpirunEnd::code`].)

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::anyhow;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM, SIGUSR1, SIGUSR2};
use tierzero::engine::{StopCause, StopHandle};

use super::Failure;

/// Exit code of a run stopped by SIGINT at a step boundary.
pub const EXIT_SIGINT: i32 = 130;
/// Exit code of a run stopped by SIGTERM at a step boundary.
pub const EXIT_SIGTERM: i32 = 143;
/// Exit code of a run stopped by SIGHUP at a step boundary.
pub const EXIT_SIGHUP: i32 = 129;

/// Whether `code` is a graceful stop's exit code (130, 143, 129): the
/// ranks stopped at a step boundary and saved, which is not a failure.
pub fn is_stop_code(code: i32) -> bool {
    matches!(code, EXIT_SIGINT | EXIT_SIGTERM | EXIT_SIGHUP)
}

/// The signal a rank takes as a SIGINT (mpirun passes it on).
pub const STOP_AS_SIGINT: i32 = SIGUSR1;
/// The signal a rank takes as a SIGTERM (mpirun passes it on).
pub const STOP_AS_SIGTERM: i32 = SIGUSR2;

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

/// The handlers' `last` signal, registered once per process
/// ([`register_early`]).
static HANDLERS: std::sync::OnceLock<Arc<AtomicUsize>> = std::sync::OnceLock::new();

fn handlers() -> Result<&'static Arc<AtomicUsize>, Failure> {
    if let Some(h) = HANDLERS.get() {
        return Ok(h);
    }
    let h = register()?;
    Ok(HANDLERS.get_or_init(|| h))
}

/// Registers the handlers now, first thing in `train` (and in bench-io
/// and tune before their file is made, which their watcher then removes):
/// a signal that
/// arrives before [`install`]'s watcher runs is kept for it (which ends
/// the start-up with the stop's exit code), rather than killing the
/// process (SIGUSR1/SIGUSR2's default action) without a word.
pub fn register_early() -> Result<(), Failure> {
    handlers().map(|_| ())
}

/// Where the run is: [`START_UP`] (a stop ends the process at once:
/// there is nothing to save or remove), [`BUILD`] (a stop ends the
/// trainer's build, [`trainer_build_begins`]) or [`TRAINING`] (a stop
/// comes at a step boundary, [`trainer_built`]).
static PHASE: AtomicU8 = AtomicU8::new(START_UP);
const START_UP: u8 = 0;
const BUILD: u8 = 1;
const TRAINING: u8 = 2;
/// The command failed and its error is being reported: a first signal is
/// left alone (a second still aborts).
const FAILING: u8 = 3;

/// What a start-up that a signal ends must undo first (the save dir it
/// created): run by the watcher before it exits.
type Undo = Box<dyn Fn() + Send>;
static AT_STARTUP_EXIT: std::sync::Mutex<Vec<Undo>> = std::sync::Mutex::new(Vec::new());

/// Whether a signal that ends the start-up prints the `--json` summary
/// ([`json_summary_at_startup_exit`]).
static STARTUP_JSON: AtomicBool = AtomicBool::new(false);

/// `train --json` on the rank that prints: a signal that ends the
/// start-up prints its summary object too (`"steps_run": 0` and the
/// stop), so stdout is one object in every ending that is not a failure.
pub fn json_summary_at_startup_exit() {
    STARTUP_JSON.store(true, Ordering::SeqCst);
}

/// Runs `undo` if a signal ends the start-up ([`trainer_build_begins`]).
pub fn at_startup_exit(undo: impl Fn() + Send + 'static) {
    if let Ok(mut v) = AT_STARTUP_EXIT.lock() {
        v.push(Box::new(undo));
    }
}

/// From here on a first signal is a stop request: it ends the trainer's
/// build (`EngineError::StoppedInBuild`: the build's swap files, as large
/// as the model's state, are removed as it unwinds), then, from
/// [`trainer_built`], stops at a step boundary. Before, during start-up
/// (reading the config, opening the model, loading or encoding the data),
/// it ends the process at once with the stop's exit code: there is
/// nothing to save, and the start-up may be blocked in a read (a FIFO with
/// no writer yet) or take minutes (encoding a corpus).
pub fn trainer_build_begins() {
    PHASE.store(BUILD, Ordering::SeqCst);
}

/// The trainer is built: a first signal stops at a step boundary.
pub fn trainer_built() {
    PHASE.store(TRAINING, Ordering::SeqCst);
}

/// The command failed and `main` reports it (then, with several ranks,
/// aborts them): the watcher leaves a first signal alone, so the output
/// is the failure's alone. Under mpirun another rank's abort sends this
/// rank SIGTERM, whose stop message and `--json` stop object used to
/// follow the error's own.
pub fn failure_is_being_reported() {
    PHASE.store(FAILING, Ordering::SeqCst);
}

/// For a command with no step boundary to stop at (`bench-io`, `tune`):
/// the first SIGINT, SIGTERM or SIGHUP removes `made` (files, and directories if
/// empty, in order: what the command made, `what` in the message; an
/// existing file given to it is not in `made`) and exits with 128 + the
/// signal; a second aborts. Without it the signal's default
/// action left the benchmark's file (4 GiB by default) behind.
pub fn exit_on_signal(what: &'static str, made: Vec<std::path::PathBuf>) -> Result<(), Failure> {
    watch(move |cause| {
        errln!(
            "tierzero: {} received: {} and exiting",
            cause.signal_name().unwrap_or_default(),
            match made.is_empty() {
                true => format!("leaving {what} as it is"),
                false => format!("removing {what}"),
            }
        );
        for p in &made {
            let _ = match p.is_dir() {
                true => std::fs::remove_dir(p),
                false => std::fs::remove_file(p),
            };
        }
        super::json_object_on_signal(cause.signal_name().as_deref(), exit_code(cause));
        std::process::exit(exit_code(cause));
    })
}

/// For a command that writes its output by atomic rewrites and has no
/// step boundary (`export`; `eval`, which may encode a corpus into its
/// token cache): the first SIGINT, SIGTERM or SIGHUP removes the temporary
/// files being written ([`tierzero::durable::remove_tmps_in_progress`]:
/// a model's or a corpus's size), then `made_dirs` (the deepest first)
/// while each is empty, and exits with 128 + the signal; a second
/// aborts. Without it the signal's default action left the temporary
/// file for ever (another key's cache entry never removes it).
pub fn exit_removing_writes_on_signal(made_dirs: Vec<std::path::PathBuf>) -> Result<(), Failure> {
    watch(move |cause| {
        errln!(
            "tierzero: {} received: removing the files being written and exiting",
            cause.signal_name().unwrap_or_default()
        );
        tierzero::durable::remove_tmps_in_progress();
        tierzero::durable::remove_empty_dirs(&made_dirs);
        super::json_object_on_signal(cause.signal_name().as_deref(), exit_code(cause));
        std::process::exit(exit_code(cause));
    })
}

/// A stop signal the handlers caught that the watcher has not handed on
/// yet (it looks every [`POLL`]), requested on `handle` now, once the
/// trainer is built: a decision taken at once (stop after a periodic
/// save, which may end a few milliseconds after the signal) sees it. The
/// watcher still says it was received.
pub fn request_caught(handle: &StopHandle) {
    if PHASE.load(Ordering::SeqCst) != TRAINING {
        return;
    }
    if let Some(sig) = HANDLERS
        .get()
        .map(|last| last.load(Ordering::SeqCst))
        .filter(|&s| s != 0)
    {
        handle.request_because(StopCause::Signal(sig as i32));
    }
}

/// Starts the watcher thread: it polls the handlers' `last` every
/// [`POLL`] and hands the first signal to `on_signal`, then ends.
fn watch(on_signal: impl FnOnce(StopCause) + Send + 'static) -> Result<(), Failure> {
    let last = Arc::clone(handlers()?);
    std::thread::Builder::new()
        .name("tierzero-signals".into())
        .spawn(move || loop {
            let sig = last.load(Ordering::SeqCst);
            if sig != 0 {
                on_signal(StopCause::Signal(sig as i32));
                return;
            }
            std::thread::sleep(POLL);
        })
        .map_err(|e| Failure::Internal(anyhow!("starting the signal watcher: {e}")))?;
    Ok(())
}

/// Installs the handlers (if [`register_early`] did not) and the watcher:
/// the first SIGINT or SIGTERM requests a stop on `handle` (during
/// start-up, it exits: [`trainer_build_begins`]), a second aborts.
pub fn install(handle: StopHandle) -> Result<(), Failure> {
    watch(move |cause| {
        let phase = PHASE.load(Ordering::SeqCst);
        if phase == FAILING {
            return;
        }
        if phase == START_UP {
            errln!(
                "tierzero: {} received during start-up: exiting (no step was trained, nothing \
                 to save)",
                cause.signal_name().unwrap_or_default()
            );
            // The main thread may be blocked in a read: what it made is
            // undone here, and the temporary files being written (a token
            // cache's, as large as the corpus's tokens) are removed.
            if let Ok(undo) = AT_STARTUP_EXIT.lock() {
                undo.iter().for_each(|u| u());
            }
            tierzero::durable::remove_tmps_in_progress();
            if STARTUP_JSON.load(Ordering::SeqCst) {
                let _ = super::emit(&format!(
                    "{}\n",
                    serde_json::json!({
                        "steps_run": 0,
                        "stopped": cause.kind(),
                        "stop_signal": cause.signal_name(),
                        "stopped_in_start_up": true,
                    })
                ));
            }
            std::process::exit(exit_code(cause));
        }
        handle.request_because(cause);
        errln!(
            "tierzero: {} received: stopping {} (a second signal aborts at once)",
            cause.signal_name().unwrap_or_default(),
            match phase {
                // (A build that has just ended stops after the first step.)
                BUILD => "the trainer's build, or after the first step if it has just ended",
                _ => "after the step in progress",
            }
        );
    })
}

/// `tierzero launch`: runs mpirun (`cmd`) in a process group of its own,
/// stdin closed (a background group reading the terminal would be
/// stopped), sent SIGINT (its abort) if this process dies first, and waits
/// for it. The first SIGINT (SIGTERM, SIGHUP) this process gets goes to
/// mpirun as [`STOP_AS_SIGINT`] ([`STOP_AS_SIGTERM`]), which mpirun passes
/// on: the ranks stop after the step in progress and save. It is sent
/// once mpirun has run [`MPIRUN_SETTLE`] (before its handlers are in, a
/// SIGUSR1 would kill it) and again every [`RESEND`] until mpirun exits
/// (one sent before the ranks existed is lost; a rank takes it again as
/// the same stop). A later signal goes to mpirun as SIGINT: it aborts the
/// ranks. A signal before mpirun starts: it is not started. See "Under
/// mpirun" in the module docs.
#[cfg(feature = "mpi")]
pub fn run_mpirun(mut cmd: std::process::Command) -> Result<std::io::Result<MpirunEnd>, Failure> {
    use std::os::unix::process::CommandExt as _;
    use std::time::Instant;
    // (A SIGHUP ignored from the start, `nohup`, stays ignored.)
    let hup_ignored = tierzero_swap::process::signal_ignored(SIGHUP);
    let flags: Vec<(i32, Arc<AtomicBool>)> = [SIGINT, SIGTERM, SIGHUP]
        .into_iter()
        .filter(|&sig| !(sig == SIGHUP && hup_ignored))
        .map(|sig| {
            let flag = Arc::new(AtomicBool::new(false));
            signal_hook::flag::register(sig, Arc::clone(&flag))
                .map(|_| (sig, flag))
                .map_err(|e| {
                    Failure::Internal(anyhow!("installing the handler of signal {sig}: {e}"))
                })
        })
        .collect::<Result<_, _>>()?;
    cmd.process_group(0).stdin(std::process::Stdio::null());
    tierzero_swap::process::signal_with_parent(&mut cmd, SIGINT);
    if let Some((sig, _)) = flags.iter().find(|(_, f)| f.load(Ordering::SeqCst)) {
        // Nothing started yet: stopped as a run stopped before its first step.
        return Ok(Ok(MpirunEnd {
            status: std::os::unix::process::ExitStatusExt::from_raw((128 + sig) << 8),
            stop: Some(*sig),
            aborted: false,
        }));
    }
    let started = Instant::now();
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return Ok(Err(e)),
    };
    // The stop asked for (the signal mpirun gets) and when it was last sent.
    let mut stop: Option<(i32, Option<Instant>)> = None;
    // The signal this process got first, and whether a second aborted.
    let mut first: Option<i32> = None;
    let mut aborted = false;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                return Ok(Ok(MpirunEnd {
                    status,
                    stop: first,
                    aborted,
                }))
            }
            Ok(None) => {}
            Err(e) => return Ok(Err(e)),
        }
        for (sig, flag) in &flags {
            if !flag.swap(false, Ordering::SeqCst) {
                continue;
            }
            let name = StopCause::Signal(*sig).signal_name().unwrap_or_default();
            if stop.is_some() {
                aborted = true;
                errln!("tierzero launch: {name} received: aborting the ranks");
                if let Err(e) = tierzero_swap::process::send_signal(child.id(), SIGINT) {
                    errln!("tierzero launch: signalling mpirun ({}): {e}", child.id());
                }
                continue;
            }
            errln!(
                "tierzero launch: {name} received: the ranks stop after the step in progress \
                 (a second signal aborts them)"
            );
            let as_stop = if *sig == SIGINT {
                STOP_AS_SIGINT
            } else {
                STOP_AS_SIGTERM
            };
            stop = Some((as_stop, None));
            first = Some(*sig);
        }
        if let Some((as_stop, sent)) = &mut stop {
            let due = match sent {
                None => started.elapsed() >= MPIRUN_SETTLE,
                Some(t) => t.elapsed() >= RESEND,
            };
            if due {
                *sent = Some(Instant::now());
                if let Err(e) = tierzero_swap::process::send_signal(child.id(), *as_stop) {
                    errln!("tierzero launch: signalling mpirun ({}): {e}", child.id());
                }
            }
        }
        std::thread::sleep(POLL);
    }
}

/// How mpirun ended under [`run_mpirun`].
#[cfg(feature = "mpi")]
#[derive(Debug)]
pub struct MpirunEnd {
    /// mpirun's own status.
    pub status: std::process::ExitStatus,
    /// The first SIGINT, SIGTERM or SIGHUP the launcher got: the stop it
    /// passed on.
    pub stop: Option<i32>,
    /// Whether a second signal aborted the ranks.
    pub aborted: bool,
}

#[cfg(feature = "mpi")]
impl MpirunEnd {
    /// The launcher's exit code where mpirun ended a graceful stop: 128 +
    /// the signal the launcher got (129 for a SIGHUP, which the ranks took
    /// as a SIGTERM and ended with 143), also where mpirun itself died of
    /// the stop's own signal, resent ([`RESEND`]) while it was tearing down
    /// after its ranks had exited, its handlers gone. `None`: not a
    /// graceful stop's ending (no stop, an abort, a failed rank).
    pub fn code(&self) -> Option<i32> {
        use std::os::unix::process::ExitStatusExt as _;
        let sig = self.stop.filter(|_| !self.aborted)?;
        let ended_stopped = match self.status.code() {
            Some(c) => is_stop_code(c),
            None => matches!(self.status.signal(), Some(STOP_AS_SIGINT | STOP_AS_SIGTERM)),
        };
        ended_stopped.then_some(128 + sig)
    }
}

/// How long mpirun runs before a stop is passed to it: its signal
/// handlers are in by then (a SIGUSR1 before them would kill it).
#[cfg(feature = "mpi")]
pub const MPIRUN_SETTLE: Duration = Duration::from_secs(1);

/// How often a stop is sent to mpirun again until it exits.
#[cfg(feature = "mpi")]
pub const RESEND: Duration = Duration::from_secs(2);

/// The handlers: `armed` (held by them alone) is set by the first SIGINT
/// or SIGTERM (a second then runs the default action); the returned `last`
/// holds the latest stop's signal number.
fn register() -> Result<Arc<AtomicUsize>, Failure> {
    let armed = Arc::new(AtomicBool::new(false));
    let last = Arc::new(AtomicUsize::new(0));
    // A SIGHUP that `nohup` (or a parent) set to be ignored stays so.
    let hup = !tierzero_swap::process::signal_ignored(SIGHUP);
    // (signal, the stop it stands for)
    for (sig, stands_for) in [
        (SIGINT, SIGINT),
        (SIGTERM, SIGTERM),
        (SIGHUP, SIGHUP),
        (STOP_AS_SIGINT, SIGINT),
        (STOP_AS_SIGTERM, SIGTERM),
    ] {
        if sig == SIGHUP && !hup {
            continue;
        }
        let err = |e: std::io::Error| {
            Failure::Internal(anyhow!("installing the handler of signal {sig}: {e}"))
        };
        // SIGUSR1/SIGUSR2 come from `tierzero launch`, which may send one
        // again (a stop sent before mpirun's ranks existed is lost): they
        // never abort; the launcher aborts with a SIGINT to mpirun.
        if sig == SIGINT || sig == SIGTERM || sig == SIGHUP {
            signal_hook::flag::register_conditional_default(sig, Arc::clone(&armed))
                .map_err(err)?;
            signal_hook::flag::register(sig, Arc::clone(&armed)).map_err(err)?;
        }
        signal_hook::flag::register_usize(sig, Arc::clone(&last), stands_for as usize)
            .map_err(err)?;
    }
    Ok(last)
}

#[cfg(all(test, feature = "mpi"))]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt as _;

    fn end(raw: i32, stop: Option<i32>, aborted: bool) -> MpirunEnd {
        MpirunEnd {
            status: std::process::ExitStatus::from_raw(raw),
            stop,
            aborted,
        }
    }

    /// The launcher's code after a stop is the signal it got: mpirun's 143
    /// after a SIGHUP (the ranks took it as a SIGTERM) is 129; mpirun killed
    /// by the resent stop signal in its teardown is the stop, not 138; an
    /// abort, a failed rank or no stop is not a stop's ending.
    #[test]
    fn a_stop_ends_with_the_code_of_the_signal_the_launcher_got() {
        let exited = |c: i32| c << 8;
        assert_eq!(end(exited(143), Some(SIGHUP), false).code(), Some(129));
        assert_eq!(end(exited(130), Some(SIGINT), false).code(), Some(130));
        assert_eq!(end(exited(143), Some(SIGTERM), false).code(), Some(143));
        assert_eq!(end(STOP_AS_SIGINT, Some(SIGINT), false).code(), Some(130));
        assert_eq!(end(STOP_AS_SIGTERM, Some(SIGHUP), false).code(), Some(129));
        assert_eq!(end(libc::SIGKILL, Some(SIGINT), false).code(), None);
        assert_eq!(end(exited(2), Some(SIGINT), false).code(), None);
        assert_eq!(end(exited(130), Some(SIGINT), true).code(), None);
        assert_eq!(end(exited(143), None, false).code(), None);
    }
}

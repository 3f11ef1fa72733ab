//! The thread that owns a communicator's handles.
//!
//! MPI and NCCL handles must not be used from several threads at once, and
//! the main crate forbids `unsafe`, so [`crate::engine::comm::mpi::MpiComm`] and
//! [`crate::engine::comm::nccl::NcclComm`] each give their handles to one thread
//! and talk to it over channels. This is that shared half: the channels
//! behind a lock (one operation at a time), a bound on every wait (a rank
//! that died or hangs makes the wait fail instead of hang), and a `broken`
//! flag: after a timeout or the thread's end the communicator is unusable,
//! because the owner thread may still sit inside a collective that will
//! never finish. Dropping it closes the channels, which ends the thread's
//! loop, and joins the thread unless it is broken (joining would hang the
//! exit). Each communicator maps [`CallFailure`] to its own error.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

/// Why an operation got no reply.
#[derive(Debug)]
pub(crate) enum CallFailure {
    /// An earlier call failed; the communicator is unusable.
    Broken,
    /// A caller panicked holding the channel lock.
    Poisoned,
    /// The communicator was shut down.
    ShutDown,
    /// The owner thread has ended (its handle, if not yet taken, is in
    /// [`OwnerThread::take_thread`]).
    Ended,
    /// No reply within the timeout; seconds waited.
    Timeout(f64),
}

/// Channels to the owner thread, its handle, the timeout (see module docs).
#[derive(Debug)]
pub(crate) struct OwnerThread<Op, Reply> {
    chan: Mutex<Option<(Sender<Op>, Receiver<Reply>)>>,
    broken: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
    timeout: Duration,
}

impl<Op, Reply> OwnerThread<Op, Reply> {
    /// Takes over the channels to a running owner thread.
    pub(crate) fn new(
        ops: Sender<Op>,
        replies: Receiver<Reply>,
        thread: Option<JoinHandle<()>>,
        timeout: Duration,
    ) -> Self {
        OwnerThread {
            chan: Mutex::new(Some((ops, replies))),
            broken: AtomicBool::new(false),
            thread: Mutex::new(thread),
            timeout,
        }
    }

    /// How long a call waits for its reply.
    #[cfg(feature = "mpi")]
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sends `op` to the owner thread and waits for its reply, at most the
    /// timeout. A timeout or the thread's end marks the communicator broken.
    pub(crate) fn call(&self, op: Op) -> Result<Reply, CallFailure> {
        if self.broken.load(Ordering::SeqCst) {
            return Err(CallFailure::Broken);
        }
        let guard = self.chan.lock().map_err(|_| CallFailure::Poisoned)?;
        // Again under the lock: a call that timed out while this one
        // waited for it left its late reply in the channel, which this one
        // would take for its own.
        if self.broken.load(Ordering::SeqCst) {
            return Err(CallFailure::Broken);
        }
        let (ops, replies) = guard.as_ref().ok_or(CallFailure::ShutDown)?;
        let t0 = Instant::now();
        if ops.send(op).is_err() {
            self.mark_broken();
            return Err(CallFailure::Ended);
        }
        match replies.recv_timeout(self.timeout) {
            Ok(r) => Ok(r),
            Err(RecvTimeoutError::Timeout) => {
                self.mark_broken();
                Err(CallFailure::Timeout(t0.elapsed().as_secs_f64()))
            }
            Err(RecvTimeoutError::Disconnected) => {
                self.mark_broken();
                Err(CallFailure::Ended)
            }
        }
    }

    /// Marks the communicator unusable (e.g. after a failed NCCL call).
    pub(crate) fn mark_broken(&self) {
        self.broken.store(true, Ordering::SeqCst);
    }

    /// The owner thread's handle, once (to learn how it ended).
    pub(crate) fn take_thread(&self) -> Option<JoinHandle<()>> {
        match self.thread.lock() {
            Ok(mut g) => g.take(),
            Err(p) => p.into_inner().take(),
        }
    }
}

impl<Op, Reply> Drop for OwnerThread<Op, Reply> {
    fn drop(&mut self) {
        // Closing the channels ends the owner thread's loop.
        let chan = match self.chan.lock() {
            Ok(mut g) => g.take(),
            Err(p) => p.into_inner().take(),
        };
        drop(chan);
        if self.broken.load(Ordering::SeqCst) {
            // Possibly stuck in a collective that will never finish.
            return;
        }
        if let Some(h) = self.take_thread() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    fn echo() -> OwnerThread<u32, u32> {
        let (op_tx, op_rx) = crossbeam_channel::unbounded::<u32>();
        let (re_tx, re_rx) = crossbeam_channel::unbounded::<u32>();
        let h = std::thread::spawn(move || {
            while let Ok(x) = op_rx.recv() {
                if x == 0 {
                    // Never answers: a hung collective.
                    std::thread::sleep(Duration::from_millis(300));
                    continue;
                }
                if x == 1 {
                    return;
                }
                let _ = re_tx.send(x * 2);
            }
        });
        OwnerThread::new(op_tx, re_rx, Some(h), Duration::from_millis(100))
    }

    #[test]
    fn replies_then_a_timeout_breaks_it() {
        let o = echo();
        assert_eq!(o.call(21).unwrap(), 42);
        assert!(matches!(o.call(0), Err(CallFailure::Timeout(s)) if s >= 0.1));
        assert!(matches!(o.call(21), Err(CallFailure::Broken)));
    }

    #[test]
    fn the_threads_end_is_reported_and_dropping_joins() {
        let o = echo();
        assert!(matches!(o.call(1), Err(CallFailure::Ended)));
        assert!(o.take_thread().is_some());
        let o = echo();
        drop(o); // joins: the loop ends when the channel closes
    }
}

//! Things held until the device is done with them ([`EventQueue`]): each
//! goes in with a CUDA event recorded after the last work that reads or
//! writes it, and comes out only once that event completed. The staging
//! pool's buffers after their copies, the link's buffers freed after the
//! compute, and the buffers a collective used all wait here.
//!
//! Oldest first: the events of one queue are recorded on one stream in
//! order, so an event not yet complete means none after it is; the checks
//! stop at the first.

use std::collections::VecDeque;

use cudarc::driver::{CudaEvent, DriverError};

/// Items, each with the event after which the device no longer touches
/// it, oldest first.
#[derive(Debug)]
pub(crate) struct EventQueue<T> {
    items: VecDeque<(CudaEvent, T)>,
}

impl<T> Default for EventQueue<T> {
    fn default() -> Self {
        EventQueue {
            items: VecDeque::new(),
        }
    }
}

impl<T> EventQueue<T> {
    /// Holds `item` until `done` completed.
    pub(crate) fn push(&mut self, done: CudaEvent, item: T) {
        self.items.push_back((done, item));
    }

    /// The oldest item, taken out if its event completed (`cuEventQuery`);
    /// None when there is none or its event has not.
    pub(crate) fn pop_done(&mut self) -> Result<Option<T>, DriverError> {
        match self.items.front() {
            Some((ev, _)) if ev.try_is_complete()? => Ok(self.items.pop_front().map(|(_, t)| t)),
            _ => Ok(None),
        }
    }

    /// Drops every item whose event completed, oldest first.
    pub(crate) fn drop_done(&mut self) -> Result<(), DriverError> {
        while self.pop_done()?.is_some() {}
        Ok(())
    }

    /// The oldest item with its event, taken out whether or not the event
    /// completed (the caller waits for it).
    pub(crate) fn pop_oldest(&mut self) -> Option<(CudaEvent, T)> {
        self.items.pop_front()
    }

    /// For a drop that cannot wait: every item whose event did not complete
    /// (or cannot be asked) is leaked, never freed under the device; the
    /// others are dropped.
    pub(crate) fn leak_unfinished(&mut self) {
        for (ev, item) in self.items.drain(..) {
            if !matches!(ev.try_is_complete(), Ok(true)) {
                std::mem::forget(item);
            }
        }
    }
}

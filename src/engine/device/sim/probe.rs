//! [`SimProbe`]: the simulated device's counters, readable after the
//! device is gone (the tests' view of what it did).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::Shared;

/// The simulated device's counters (see [`super::SimDevice::probe`]).
#[derive(Debug, Clone)]
pub struct SimProbe {
    pub(super) shared: Arc<Shared>,
    pub(super) slots: usize,
}

impl SimProbe {
    /// Device bytes held now.
    pub fn used_bytes(&self) -> u64 {
        self.shared.used_bytes.load(Ordering::Relaxed)
    }

    /// The most device bytes held at once.
    pub fn peak_bytes(&self) -> u64 {
        self.shared.peak_bytes.load(Ordering::Relaxed)
    }

    /// Staging buffers not lent to a copy.
    pub fn free_staging(&self) -> usize {
        self.shared
            .free_slabs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }

    /// Staging buffers in all.
    pub fn staging_slots(&self) -> usize {
        self.slots
    }

    /// Copies that found their staging buffer changed since the upload,
    /// and copies in place whose pinned bytes were not the upload's
    /// elements.
    pub fn violations(&self) -> u64 {
        self.shared.violations.load(Ordering::Relaxed)
    }

    /// Copies queued or running now.
    pub fn in_flight(&self) -> u64 {
        self.shared.in_flight.load(Ordering::Relaxed)
    }

    /// The most copies queued or running at once.
    pub fn peak_in_flight(&self) -> u64 {
        self.shared.peak_in_flight.load(Ordering::Relaxed)
    }

    /// Copies completed.
    pub fn copies(&self) -> u64 {
        self.shared.copies.load(Ordering::Relaxed)
    }

    /// Uploads asked for (refused ones included).
    pub fn uploads(&self) -> u64 {
        self.shared.uploads.load(Ordering::Relaxed)
    }

    /// Copies that read registered host memory in place (no staging
    /// fill).
    pub fn direct_copies(&self) -> u64 {
        self.shared.direct_copies.load(Ordering::Relaxed)
    }

    /// Bytes those copies moved.
    pub fn direct_bytes(&self) -> u64 {
        self.shared.direct_bytes.load(Ordering::Relaxed)
    }

    /// Pins (of pages or swap buffers) held by copies queued or running
    /// now.
    pub fn pins_held(&self) -> u64 {
        self.shared.pins_held.load(Ordering::Relaxed)
    }

    /// Downloads queued or running now.
    pub fn downloads_in_flight(&self) -> u64 {
        self.shared.downloads_in_flight.load(Ordering::Relaxed)
    }

    /// Downloads completed.
    pub fn downloads(&self) -> u64 {
        self.shared.downloads.load(Ordering::Relaxed)
    }

    /// Gradients reduce-scattered on the device: a unit's, or a param's
    /// kept there.
    pub fn reduces(&self) -> u64 {
        self.shared.reduces.load(Ordering::Relaxed)
    }

    /// Params gathered on the device.
    pub fn gathers(&self) -> u64 {
        self.shared.gathers.load(Ordering::Relaxed)
    }

    /// Gathers of the weights kept on the device after a step, every
    /// param's in one.
    pub fn kept_gathers(&self) -> u64 {
        self.shared.kept_gathers.load(Ordering::Relaxed)
    }
}

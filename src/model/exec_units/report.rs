//! What a compute device reports: the spans its queues were busy
//! ([`DeviceSpan`], [`busy_s`]), what it moved ([`DeviceTraffic`]) and
//! the device memory it holds, for the start-up plan
//! ([`DeviceMemoryPlan`]).

/// Which of a device's queues a [`DeviceSpan`] ran on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceQueue {
    /// The compute stream: a unit's kernels.
    Compute,
    /// The host-to-device copy stream.
    H2d,
    /// The device-to-host copy stream.
    D2h,
    /// The host's fills of upload staging buffers (the device tier's
    /// upload thread), before their copies are queued.
    Fill,
    /// The device's collectives (a unit's gradients' reduce-scatter
    /// among the ranks, on its own stream).
    Collective,
}

/// A period a device's queue was busy, on the host's clock.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceSpan {
    /// The queue.
    pub queue: DeviceQueue,
    /// What ran ("forward unit 3", "param 12").
    pub name: String,
    /// When it started.
    pub start: std::time::Instant,
    /// When it ended.
    pub end: std::time::Instant,
}

/// Seconds in the union of `spans` (overlaps counted once).
pub fn busy_s(spans: &[DeviceSpan], queue: DeviceQueue) -> f64 {
    let mut v: Vec<(std::time::Instant, std::time::Instant)> = spans
        .iter()
        .filter(|s| s.queue == queue)
        .map(|s| (s.start, s.end.max(s.start)))
        .collect();
    v.sort();
    let mut total = 0.0;
    let mut cur: Option<(std::time::Instant, std::time::Instant)> = None;
    for (a, b) in v {
        cur = match cur {
            Some((ca, cb)) if a <= cb => Some((ca, cb.max(b))),
            Some((ca, cb)) => {
                total += (cb - ca).as_secs_f64();
                Some((a, b))
            }
            None => Some((a, b)),
        };
    }
    if let Some((a, b)) = cur {
        total += (b - a).as_secs_f64();
    }
    total
}

/// A compute device's memory as the start-up plan shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceMemoryPlan {
    /// The whole device budget (`tierzero.device_budget_bytes`, or what
    /// the device had free).
    pub budget_bytes: u64,
    /// What holds it, each with its device and pinned host bytes.
    pub rows: Vec<DeviceMemoryRow>,
    /// Adam's state and the gradients are on the device
    /// ([`super::DeviceOptimizer`]), not in host memory.
    pub optimizer_on_device: bool,
}

/// One row of a [`DeviceMemoryPlan`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceMemoryRow {
    /// What it is.
    pub what: String,
    /// Device bytes (at most).
    pub device_bytes: u64,
    /// Pinned host bytes (at most).
    pub pinned_bytes: u64,
}

/// What a compute device's tier moved, for the step's metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DeviceTraffic {
    /// Bytes copied host to device: params staged or loaded, and the
    /// units' inputs (hidden states, upstream gradients, rotary tables).
    pub h2d_bytes: u64,
    /// Bytes copied device to host (outputs and gradients).
    pub d2h_bytes: u64,
    /// Seconds the compute thread waited for uploads: for a staging
    /// buffer to come back, or for a copy's event.
    pub h2d_wait_s: f64,
    /// Seconds the compute thread waited for gradients' downloads.
    pub d2h_wait_s: f64,
    /// Bytes of unit inputs not uploaded: the previous unit's output was
    /// still on the device.
    pub h2d_kept_bytes: u64,
    /// Of `h2d_bytes`, the params' bytes copied in place from their
    /// registered pinned pages, with no staging fill.
    pub h2d_direct_bytes: u64,
    /// Of `h2d_bytes`, the params' bytes uploaded for the unit about to
    /// compute, not staged ahead of it: its compute waits for them.
    pub h2d_at_use_bytes: u64,
    /// Blocks whose backward ran from their kept forward
    /// ([`super::KeptForward`]), with no recompute.
    pub forwards_kept: u64,
    /// Blocks whose backward computed their forward again from the input.
    pub forwards_recomputed: u64,
    /// Units whose forward was launched ahead of the engine's call, as
    /// soon as the unit before them had its output on the host, and then
    /// taken by that call.
    pub forwards_ahead: u64,
    /// Units whose backward was launched ahead of the engine's call, as
    /// soon as the unit after them had its input gradient on the host,
    /// and then taken by that call.
    pub backwards_ahead: u64,
}

impl DeviceTraffic {
    /// Adds `o`'s counts into these.
    pub fn add(&mut self, o: &DeviceTraffic) {
        self.h2d_bytes += o.h2d_bytes;
        self.d2h_bytes += o.d2h_bytes;
        self.h2d_wait_s += o.h2d_wait_s;
        self.d2h_wait_s += o.d2h_wait_s;
        self.h2d_kept_bytes += o.h2d_kept_bytes;
        self.h2d_direct_bytes += o.h2d_direct_bytes;
        self.h2d_at_use_bytes += o.h2d_at_use_bytes;
        self.forwards_kept += o.forwards_kept;
        self.forwards_recomputed += o.forwards_recomputed;
        self.forwards_ahead += o.forwards_ahead;
        self.backwards_ahead += o.backwards_ahead;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failure is a panic
    use std::time::{Duration, Instant};

    use super::*;

    #[test]
    fn busy_time_counts_overlapping_spans_once_and_only_its_queue() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let span = |queue, a, b| DeviceSpan {
            queue,
            name: String::new(),
            start: at(a),
            end: at(b),
        };
        let spans = [
            span(DeviceQueue::H2d, 10, 20),
            span(DeviceQueue::H2d, 15, 30), // overlaps the first
            span(DeviceQueue::H2d, 40, 45),
            span(DeviceQueue::Compute, 0, 100),
            span(DeviceQueue::H2d, 44, 44), // empty, inside the last
        ];
        assert!((busy_s(&spans, DeviceQueue::H2d) - 0.025).abs() < 1e-9);
        assert!((busy_s(&spans, DeviceQueue::Compute) - 0.1).abs() < 1e-9);
        assert_eq!(busy_s(&spans, DeviceQueue::D2h), 0.0);
    }
}

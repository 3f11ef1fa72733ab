//! A timeline of a few training steps: when the compute thread computed
//! and waited, when the optimizer thread stepped each sub-group, and when
//! the disk was busy (`tierzero train --timeline FILE`).
//!
//! The per-step metrics say *how much* overlap a step got
//! (`overlap_efficiency`, `io_wait_s`, `io_busy_s`); the timeline says
//! *where* it was lost: a disk that idles while backward computes its
//! first block, a forward that waits for the previous step's optimizer
//! tail. It is written as a Chrome trace (the Trace Event Format's JSON
//! object form), which `ui.perfetto.dev` and `chrome://tracing` open. One
//! lane per actor:
//!
//! | lane | spans |
//! |---|---|
//! | `step` | each optimizer step, from `Trainer::step` call to return |
//! | `compute` | a unit's forward or backward (recompute included) |
//! | `params` | the compute thread waiting for a unit's params (`fetch_unit`: reads, and updates still coming from the optimizer) |
//! | `store` | the compute thread storing a stepped sub-group's new params (copy, write-back to the home tier: it waits when no param swap buffer is free); inside a `params` wait when a fetch needed them |
//! | `optimizer` | one sub-group's step on the optimizer thread, its state read wait included |
//! | `disk` | the union of the swap engines' busy time ([`tierzero_swap::BusyClock`]) |
//! | `disk: params` | the param engine's busy time (fetch reads, write-backs of new params) |
//! | `disk: state reads` | the optimizer's read engine (master, m, v; spilled gradients) |
//! | `disk: state writes` | the optimizer's write engine (state write-backs, gradient spills) |
//! | `disk: grad park` | the grad-park engine (gradient sums parked on NVMe between micro-batches, with `gradient_accumulation_steps` > 1 and the optimizer on NVMe) |
//! | `device: compute` | a unit's kernels on the device's compute stream (CUDA events; the simulated device's compute) |
//! | `device: h2d` | a param's or a unit input's copy on the host-to-device stream (CUDA events; the simulated device's copy thread) |
//! | `device: d2h` | a gradient's copy on the device-to-host stream (CUDA events; the simulated device's download thread) |
//! | `device: staging fill (host)` | the host filling a device upload's staging buffer |
//! | `device: collective` | the device's collectives (the gradients' reduce-scatter) |
//!
//! Only a window of steps is kept ([`Timeline::new`]: by default the three
//! after the first, whose trace recording and cold caches make it
//! unlike the rest), so memory does not grow with the run. The spans of
//! the optimizer tail that runs into the first step after the window are
//! kept too. Recording costs a mutex and a push per span: a few hundred
//! per step.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde_json::json;

use crate::model::exec_units::{DeviceQueue, DeviceSpan};

/// Which actor a span belongs to (a lane of the trace).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// Whole optimizer steps.
    Step,
    /// Forward and backward of units.
    Compute,
    /// The compute thread waiting for params.
    Params,
    /// The compute thread storing a stepped sub-group's new params.
    Store,
    /// Sub-group steps on the optimizer thread.
    Optimizer,
    /// Disk busy periods (all engines).
    Disk,
    /// The param engine's busy periods.
    DiskParams,
    /// The optimizer read engine's busy periods.
    DiskStateReads,
    /// The optimizer write engine's busy periods.
    DiskStateWrites,
    /// The grad-park engine's busy periods (accumulated gradients parked
    /// on NVMe between micro-batches).
    DiskGradPark,
    /// Units on the device's compute queue.
    DeviceCompute,
    /// Copies on the device's host-to-device queue.
    DeviceH2d,
    /// Copies on the device's device-to-host queue.
    DeviceD2h,
    /// The host's fills of the device's upload staging buffers.
    DeviceFill,
    /// The device's collectives (gradients' reduce-scatter).
    DeviceCollective,
}

impl Lane {
    const ALL: [Lane; 15] = [
        Lane::Step,
        Lane::Compute,
        Lane::Params,
        Lane::Store,
        Lane::Optimizer,
        Lane::Disk,
        Lane::DiskParams,
        Lane::DiskStateReads,
        Lane::DiskStateWrites,
        Lane::DiskGradPark,
        Lane::DeviceCompute,
        Lane::DeviceH2d,
        Lane::DeviceD2h,
        Lane::DeviceFill,
        Lane::DeviceCollective,
    ];

    fn name(self) -> &'static str {
        match self {
            Lane::Step => "step",
            Lane::Compute => "compute",
            Lane::Params => "params",
            Lane::Store => "store",
            Lane::Optimizer => "optimizer",
            Lane::Disk => "disk",
            Lane::DiskParams => "disk: params",
            Lane::DiskStateReads => "disk: state reads",
            Lane::DiskStateWrites => "disk: state writes",
            Lane::DiskGradPark => "disk: grad park",
            Lane::DeviceCompute => "device: compute",
            Lane::DeviceH2d => "device: h2d",
            Lane::DeviceD2h => "device: d2h",
            Lane::DeviceFill => "device: staging fill (host)",
            Lane::DeviceCollective => "device: collective",
        }
    }

    fn tid(self) -> u32 {
        match self {
            Lane::Step => 1,
            Lane::Compute => 2,
            Lane::Params => 3,
            Lane::Optimizer => 4,
            Lane::Disk => 5,
            Lane::Store => 6,
            Lane::DiskParams => 7,
            Lane::DiskStateReads => 8,
            Lane::DiskStateWrites => 9,
            Lane::DeviceCompute => 10,
            Lane::DeviceH2d => 11,
            Lane::DeviceD2h => 12,
            Lane::DeviceFill => 13,
            Lane::DeviceCollective => 14,
            Lane::DiskGradPark => 15,
        }
    }
}

#[derive(Debug, Clone)]
struct Span {
    lane: Lane,
    name: String,
    start: Instant,
    end: Instant,
}

/// Spans of a window of steps, shared by the compute and optimizer
/// threads (see the module docs).
#[derive(Debug)]
pub struct Timeline {
    origin: Instant,
    first_step: u64,
    last_step: u64,
    /// The latest step of the window begun (0: none yet): a run stopped
    /// early recorded the window up to it.
    last_begun: std::sync::atomic::AtomicU64,
    recording: AtomicBool,
    spans: Mutex<Vec<Span>>,
}

impl Timeline {
    /// A timeline that keeps steps `first_step..=last_step` (1-based, as
    /// in the metrics' `step`).
    pub fn new(first_step: u64, last_step: u64) -> Arc<Self> {
        Arc::new(Timeline {
            origin: Instant::now(),
            first_step,
            last_step,
            last_begun: std::sync::atomic::AtomicU64::new(0),
            recording: AtomicBool::new(false),
            spans: Mutex::new(Vec::new()),
        })
    }

    /// The window for a run of `steps` steps starting after `done` steps:
    /// `count` steps after the run's first, or as many as there are.
    pub fn window(done: u64, steps: u64, count: u64) -> (u64, u64) {
        let first = if steps > done + 1 { done + 2 } else { done + 1 };
        (first, (first + count.max(1) - 1).min(steps.max(first)))
    }

    /// The steps it keeps.
    pub fn steps(&self) -> (u64, u64) {
        (self.first_step, self.last_step)
    }

    /// The steps of the window it recorded: up to the latest begun (a
    /// run stopped inside the window recorded fewer than [`Timeline::steps`]);
    /// None where none was.
    pub fn recorded_steps(&self) -> Option<(u64, u64)> {
        match self.last_begun.load(Ordering::Relaxed) {
            0 => None,
            last => Some((self.first_step, last)),
        }
    }

    /// Called as step `step` (1-based) begins: recording is on inside the
    /// window, and stays on for the step after it (the last step's
    /// optimizer tail), whose own compute spans are then not kept.
    pub fn begin_step(&self, step: u64) {
        let on = step >= self.first_step && step <= self.last_step + 1;
        if self.keeps(step) {
            self.last_begun.fetch_max(step, Ordering::Relaxed);
        }
        self.recording.store(on, Ordering::Relaxed);
    }

    /// Called as the run settles the optimizer tail of its last step,
    /// `step`: recorded only where that step is in the window (the step
    /// after the window records the window's last tail, not its own).
    pub fn finishing(&self, step: u64) {
        self.recording.store(self.keeps(step), Ordering::Relaxed);
    }

    /// Whether step `step`'s compute-thread spans are kept.
    pub fn keeps(&self, step: u64) -> bool {
        step >= self.first_step && step <= self.last_step
    }

    /// Whether spans are being kept now.
    pub fn is_recording(&self) -> bool {
        self.recording.load(Ordering::Relaxed)
    }

    /// Keeps a span if recording; `name` is only built then.
    pub fn span(&self, lane: Lane, name: impl FnOnce() -> String, start: Instant, end: Instant) {
        if !self.is_recording() {
            return;
        }
        let span = Span {
            lane,
            name: name(),
            start,
            end,
        };
        self.spans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(span);
    }

    /// Adds busy periods (from [`tierzero_swap::BusyClock::take_periods`])
    /// to a disk lane ([`Lane::Disk`] or one engine's).
    pub fn disk(&self, lane: Lane, periods: &[(Instant, Instant)]) {
        if !self.is_recording() {
            return;
        }
        let mut g = self.spans.lock().unwrap_or_else(|e| e.into_inner());
        g.extend(periods.iter().map(|&(start, end)| Span {
            lane,
            name: "busy".into(),
            start,
            end,
        }));
    }

    /// Adds a device's spans (from
    /// [`crate::model::exec_units::UnitCompute::take_device_spans`]) to
    /// its lanes.
    pub fn device(&self, spans: &[DeviceSpan]) {
        if !self.is_recording() {
            return;
        }
        let mut g = self.spans.lock().unwrap_or_else(|e| e.into_inner());
        g.extend(spans.iter().map(|s| Span {
            lane: match s.queue {
                DeviceQueue::Compute => Lane::DeviceCompute,
                DeviceQueue::H2d => Lane::DeviceH2d,
                DeviceQueue::D2h => Lane::DeviceD2h,
                DeviceQueue::Fill => Lane::DeviceFill,
                DeviceQueue::Collective => Lane::DeviceCollective,
            },
            name: s.name.clone(),
            start: s.start,
            end: s.end,
        }));
    }

    /// Number of spans kept in `lane`.
    #[cfg(test)]
    fn count(&self, lane: Lane) -> usize {
        self.spans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|s| s.lane == lane)
            .count()
    }

    /// The trace as a Chrome Trace Event Format object: lane names as
    /// metadata events, then one complete (`"ph": "X"`) event per span,
    /// in microseconds from the timeline's creation, sorted by start.
    pub fn to_json(&self) -> serde_json::Value {
        let mut spans = self.spans.lock().unwrap_or_else(|e| e.into_inner()).clone();
        spans.sort_by_key(|s| s.start);
        let us = |t: Instant| t.saturating_duration_since(self.origin).as_secs_f64() * 1e6;
        let mut events: Vec<serde_json::Value> = Lane::ALL
            .iter()
            .map(|l| {
                json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": l.tid(),
                       "args": {"name": l.name()}})
            })
            .collect();
        events.extend(spans.iter().map(|s| {
            json!({"name": s.name, "ph": "X", "pid": 1, "tid": s.lane.tid(),
                   "ts": us(s.start),
                   "dur": s.end.saturating_duration_since(s.start).as_secs_f64() * 1e6})
        }));
        json!({"traceEvents": events, "displayTimeUnit": "ms",
               "otherData": {"tool": "tierzero",
                             "steps": self.recorded_steps().map_or_else(Vec::new, |(a, b)| vec![a, b])}})
    }

    /// Writes [`Timeline::to_json`] to `path` (atomically: temp file,
    /// fsync, rename).
    pub fn write(&self, path: &Path) -> Result<(), crate::durable::DurableError> {
        crate::durable::write_atomic(path, self.to_json().to_string().as_bytes())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failure is a panic
    use std::time::Duration;

    use super::*;

    /// A run stopped inside the window recorded the steps up to the last
    /// begun, and says so (it said the whole window); the final tail is
    /// recorded only where the last step is in the window (the flush of a
    /// step after it appeared with no compute around it).
    #[test]
    fn it_says_the_steps_it_recorded_and_keeps_no_tail_past_them() {
        let t = Timeline::new(2, 101);
        assert_eq!(t.recorded_steps(), None);
        for step in 1..=40 {
            t.begin_step(step);
        }
        assert_eq!(t.recorded_steps(), Some((2, 40)));
        assert_eq!(t.to_json()["otherData"]["steps"], json!([2, 40]));
        t.finishing(40);
        assert!(t.is_recording(), "the tail of a step in the window");
        let t = Timeline::new(2, 3);
        for step in 1..=4 {
            t.begin_step(step);
        }
        assert_eq!(t.recorded_steps(), Some((2, 3)));
        assert!(t.is_recording(), "step 4 records step 3's tail");
        t.finishing(4);
        assert!(!t.is_recording(), "not step 4's own tail");
    }

    #[test]
    fn keeps_spans_only_inside_its_window_plus_the_tail_step() {
        let t = Timeline::new(2, 3);
        let at = |ms: u64| t.origin + Duration::from_millis(ms);
        for step in 1..=5u64 {
            t.begin_step(step);
            t.span(
                Lane::Optimizer,
                || format!("s{step}"),
                at(step * 10),
                at(step * 10 + 5),
            );
            if t.keeps(step) {
                t.span(
                    Lane::Compute,
                    || format!("c{step}"),
                    at(step * 10),
                    at(step * 10 + 3),
                );
            }
        }
        // Optimizer spans of steps 2, 3 and 4 (3's tail); compute of 2, 3.
        assert_eq!(t.count(Lane::Optimizer), 3);
        assert_eq!(t.count(Lane::Compute), 2);
        t.begin_step(3);
        t.disk(Lane::Disk, &[(at(31), at(32)), (at(33), at(35))]);
        let v = t.to_json();
        let ev = v["traceEvents"].as_array().unwrap();
        let names: Vec<&str> = ev
            .iter()
            .filter(|e| e["ph"] == "M")
            .map(|e| e["args"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "step",
                "compute",
                "params",
                "store",
                "optimizer",
                "disk",
                "disk: params",
                "disk: state reads",
                "disk: state writes",
                "disk: grad park",
                "device: compute",
                "device: h2d",
                "device: d2h",
                "device: staging fill (host)",
                "device: collective"
            ]
        );
        let xs: Vec<&serde_json::Value> = ev.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(xs.len(), 7);
        let ts: Vec<f64> = xs.iter().map(|e| e["ts"].as_f64().unwrap()).collect();
        assert!(ts.windows(2).all(|w| w[0] <= w[1]), "sorted: {ts:?}");
        let disk: Vec<f64> = xs
            .iter()
            .filter(|e| e["tid"] == Lane::Disk.tid())
            .map(|e| e["dur"].as_f64().unwrap())
            .collect();
        assert_eq!(disk.len(), 2);
        assert!((disk[1] - 2000.0).abs() < 1.0, "{disk:?}");
        assert_eq!(v["otherData"]["steps"], json!([2, 3]));
    }

    #[test]
    fn window_is_the_steps_after_the_first_or_what_there_is() {
        assert_eq!(Timeline::window(0, 150, 3), (2, 4));
        assert_eq!(Timeline::window(0, 3, 3), (2, 3));
        assert_eq!(Timeline::window(0, 1, 3), (1, 1));
        assert_eq!(Timeline::window(10, 20, 3), (12, 14));
        assert_eq!(Timeline::window(0, 150, 0), (2, 2));
    }
}

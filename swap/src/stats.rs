//! I/O statistics: bytes, operations, latency and busy time.
//!
//! Counters are relaxed atomics bumped once per request or piece, so they
//! cost nothing measurable next to a transfer. Request latency is from
//! submission to completion of a whole request (queueing in the engine
//! included); device latency is per piece, from the moment it is handed to
//! the kernel until its completion. Both are kept in a log-scale
//! histogram with four buckets per power of two (about 19% resolution),
//! from which p50 and p99 are read. Busy time is counted per worker: the
//! wall time during which that ring had at least one operation in flight.
//!
//! Several engines (a trainer has one for parameters and a read and a write
//! engine for optimizer state) can share one [`BusyClock`]: the wall time
//! during which *any* of their workers had I/O in flight. That union, not
//! the sum of per-worker busy times (which exceeds wall time as soon as two
//! rings overlap), is "I/O busy" in an overlap-efficiency figure. While
//! [`BusyClock::set_logging`] is on, the clock also keeps each busy period
//! (start, end) for [`BusyClock::take_periods`]: a timeline of when the
//! disk worked (the trainer's `--timeline`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::IoOp;

const BUCKETS: usize = 64 * 4;

/// Live counters, shared by the workers.
#[derive(Debug)]
pub struct Stats {
    read_bytes: AtomicU64,
    write_bytes: AtomicU64,
    read_ops: AtomicU64,
    write_ops: AtomicU64,
    errors: AtomicU64,
    latency: Vec<AtomicU64>,
    device_latency: Vec<AtomicU64>,
    busy_ns: Vec<AtomicU64>,
    /// The shared clock and the engine's own, where configured.
    clocks: Vec<Arc<BusyClock>>,
}

/// Wall time during which at least one of the workers sharing this clock
/// had I/O in flight (see the module docs). Workers call it only when
/// their own in-flight count goes 0 → 1 and 1 → 0.
#[derive(Debug, Default)]
pub struct BusyClock {
    inner: Mutex<BusyInner>,
}

#[derive(Debug, Default)]
struct BusyInner {
    active: usize,
    since: Option<Instant>,
    total: Duration,
    /// Finished busy periods, kept while logging is on.
    periods: Option<Vec<(Instant, Instant)>>,
}

impl BusyClock {
    /// A clock at zero, to share between engines' configs.
    pub fn new() -> Arc<Self> {
        Arc::new(BusyClock::default())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BusyInner> {
        // A poisoned lock only means a panicking worker held it; the
        // counters are still consistent integers.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn start(&self) {
        let mut g = self.lock();
        if g.active == 0 {
            g.since = Some(Instant::now());
        }
        g.active += 1;
    }

    pub(crate) fn stop(&self) {
        let mut g = self.lock();
        g.active = g.active.saturating_sub(1);
        if g.active == 0 {
            if let Some(t) = g.since.take() {
                let now = Instant::now();
                g.total += now.duration_since(t);
                if let Some(p) = g.periods.as_mut() {
                    p.push((t, now));
                }
            }
        }
    }

    /// Starts (or stops, dropping what was kept) keeping busy periods.
    pub fn set_logging(&self, on: bool) {
        let mut g = self.lock();
        g.periods = on.then(|| g.periods.take().unwrap_or_default());
    }

    /// The busy periods that ended since the last call, oldest first
    /// (empty unless logging is on). A period still open is not included.
    pub fn take_periods(&self) -> Vec<(Instant, Instant)> {
        let mut g = self.lock();
        g.periods.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Seconds of wall time with any sharing worker busy, so far (a busy
    /// period still open counts up to now).
    pub fn busy_s(&self) -> f64 {
        let g = self.lock();
        let open = g.since.map_or(Duration::ZERO, |t| t.elapsed());
        (g.total + open).as_secs_f64()
    }
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct StatsSnapshot {
    /// Bytes read by successful requests.
    pub read_bytes: u64,
    /// Bytes written by successful requests.
    pub write_bytes: u64,
    /// Read requests completed (ok or not).
    pub read_ops: u64,
    /// Write requests completed (ok or not).
    pub write_ops: u64,
    /// Requests that failed.
    pub errors: u64,
    /// Median request latency in microseconds.
    pub latency_p50_us: f64,
    /// 99th-percentile request latency in microseconds.
    pub latency_p99_us: f64,
    /// Median per-piece device latency (kernel submission to completion), µs.
    pub device_p50_us: f64,
    /// 99th-percentile per-piece device latency, µs.
    pub device_p99_us: f64,
    /// Seconds each worker had I/O in flight.
    pub busy_s: Vec<f64>,
}

fn bucket_of(ns: u64) -> usize {
    let ns = ns.max(1) as f64;
    ((ns.log2() * 4.0) as usize).min(BUCKETS - 1)
}

fn bucket_mid_ns(b: usize) -> f64 {
    2f64.powf((b as f64 + 0.5) / 4.0)
}

impl Stats {
    /// `clocks`: busy clocks the workers drive, outermost first (a clock
    /// shared with other engines, then this engine's own; see
    /// [`crate::EngineConfig`]). They are started in that order and stopped
    /// in reverse, so an inner clock's periods lie inside the outer's.
    pub(crate) fn new(workers: usize, clocks: Vec<Arc<BusyClock>>) -> Self {
        Stats {
            read_bytes: AtomicU64::new(0),
            write_bytes: AtomicU64::new(0),
            read_ops: AtomicU64::new(0),
            write_ops: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            latency: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            device_latency: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            busy_ns: (0..workers).map(|_| AtomicU64::new(0)).collect(),
            clocks,
        }
    }

    pub(crate) fn record(&self, op: IoOp, bytes: u64, ok: bool, latency: Duration) {
        let (b, o) = match op {
            IoOp::Read => (&self.read_bytes, &self.read_ops),
            IoOp::Write => (&self.write_bytes, &self.write_ops),
        };
        o.fetch_add(1, Ordering::Relaxed);
        if ok {
            b.fetch_add(bytes, Ordering::Relaxed);
        } else {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
        self.latency[bucket_of(latency.as_nanos() as u64)].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn record_piece(&self, latency: Duration) {
        self.device_latency[bucket_of(latency.as_nanos() as u64)].fetch_add(1, Ordering::Relaxed);
    }

    /// A worker's in-flight count went from 0 to 1.
    pub(crate) fn busy_start(&self) {
        for c in &self.clocks {
            c.start();
        }
    }

    /// A worker's in-flight count went back to 0 after `d` busy.
    pub(crate) fn busy_stop(&self, worker: usize, d: Duration) {
        for c in self.clocks.iter().rev() {
            c.stop();
        }
        self.add_busy(worker, d);
    }

    fn add_busy(&self, worker: usize, d: Duration) {
        if let Some(c) = self.busy_ns.get(worker) {
            c.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
        }
    }

    /// Reads all counters.
    pub fn snapshot(&self) -> StatsSnapshot {
        let (latency_p50_us, latency_p99_us) = quantiles_us(&self.latency);
        let (device_p50_us, device_p99_us) = quantiles_us(&self.device_latency);
        StatsSnapshot {
            read_bytes: self.read_bytes.load(Ordering::Relaxed),
            write_bytes: self.write_bytes.load(Ordering::Relaxed),
            read_ops: self.read_ops.load(Ordering::Relaxed),
            write_ops: self.write_ops.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            latency_p50_us,
            latency_p99_us,
            device_p50_us,
            device_p99_us,
            busy_s: self
                .busy_ns
                .iter()
                .map(|c| c.load(Ordering::Relaxed) as f64 / 1e9)
                .collect(),
        }
    }
}

/// p50 and p99 of a histogram, in microseconds (0 when empty).
fn quantiles_us(buckets: &[AtomicU64]) -> (f64, f64) {
    let hist: Vec<u64> = buckets.iter().map(|c| c.load(Ordering::Relaxed)).collect();
    let total: u64 = hist.iter().sum();
    let quantile = |q: f64| -> f64 {
        if total == 0 {
            return 0.0;
        }
        let target = ((total as f64) * q).ceil().max(1.0) as u64;
        let mut acc = 0;
        for (b, &n) in hist.iter().enumerate() {
            acc += n;
            if acc >= target {
                return bucket_mid_ns(b) / 1000.0;
            }
        }
        bucket_mid_ns(BUCKETS - 1) / 1000.0
    };
    (quantile(0.5), quantile(0.99))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_clock_counts_the_union_of_overlapping_workers() {
        let clock = BusyClock::new();
        let a = Stats::new(1, vec![clock.clone()]);
        let b = Stats::new(1, vec![clock.clone()]);
        let outer = Instant::now();
        a.busy_start();
        std::thread::sleep(Duration::from_millis(15));
        let inner = Instant::now();
        b.busy_start();
        std::thread::sleep(Duration::from_millis(15));
        b.busy_stop(0, inner.elapsed());
        std::thread::sleep(Duration::from_millis(15));
        a.busy_stop(0, outer.elapsed());
        let union_s = outer.elapsed().as_secs_f64();
        let sum_s: f64 = a.snapshot().busy_s[0] + b.snapshot().busy_s[0];
        let got = clock.busy_s();
        // B ran inside A: the union is A's length, the sum is ~1.33 of it.
        assert!(got <= union_s + 1e-9, "{got} > {union_s}");
        // A's period holds its three 15 ms sleeps (a bound that does not
        // depend on when this thread ran between the clocks' reads).
        assert!(got >= 0.045, "{got} vs {union_s}");
        assert!(sum_s > got + 0.014, "sum {sum_s} vs union {got}");
        // Idle time does not count; an open period counts up to now.
        std::thread::sleep(Duration::from_millis(5));
        assert!((clock.busy_s() - got).abs() < 1e-9);
        a.busy_start();
        std::thread::sleep(Duration::from_millis(5));
        assert!(clock.busy_s() >= got + 0.005);
        a.busy_stop(0, Duration::from_millis(5));
    }

    #[test]
    fn busy_clock_logs_the_union_periods_only_while_asked() {
        let clock = BusyClock::new();
        let a = Stats::new(1, vec![clock.clone()]);
        let b = Stats::new(1, vec![clock.clone()]);
        a.busy_start();
        a.busy_stop(0, Duration::ZERO);
        assert!(clock.take_periods().is_empty(), "logging is off");
        clock.set_logging(true);
        let t0 = Instant::now();
        a.busy_start();
        b.busy_start();
        a.busy_stop(0, Duration::ZERO);
        b.busy_stop(0, Duration::ZERO);
        b.busy_start();
        b.busy_stop(0, Duration::ZERO);
        let p = clock.take_periods();
        // Overlapping workers make one period; a later one is separate.
        assert_eq!(p.len(), 2, "{p:?}");
        assert!(
            p[0].0 >= t0 && p[0].1 >= p[0].0 && p[1].0 >= p[0].1,
            "{p:?}"
        );
        assert!(clock.take_periods().is_empty(), "taken");
        clock.set_logging(false);
        a.busy_start();
        a.busy_stop(0, Duration::ZERO);
        assert!(clock.take_periods().is_empty(), "logging is off again");
    }

    #[test]
    fn quantiles_follow_the_data() {
        let s = Stats::new(1, Vec::new());
        for _ in 0..98 {
            s.record(IoOp::Read, 10, true, Duration::from_micros(100));
        }
        for _ in 0..2 {
            s.record(IoOp::Write, 10, false, Duration::from_millis(10));
        }
        s.record_piece(Duration::from_micros(40));
        let snap = s.snapshot();
        assert!((32.0..50.0).contains(&snap.device_p50_us), "{snap:?}");
        assert!((80.0..125.0).contains(&snap.latency_p50_us), "{snap:?}");
        assert!((8000.0..12500.0).contains(&snap.latency_p99_us), "{snap:?}");
        assert_eq!(snap.read_bytes, 980);
        assert_eq!(snap.write_bytes, 0);
        assert_eq!(snap.errors, 2);
    }
}

//! The simulated device's copy threads: uploads in (a delay plus the
//! bytes at the link's rate, then the bytes read, so a buffer changed
//! under its copy is seen) and downloads out.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;

use super::*;

/// An order-sensitive hash of a buffer's bits.
pub(super) fn fingerprint(v: &[f32]) -> u64 {
    v.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, x| {
        (h ^ u64::from(x.to_bits())).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// How long the copy of `bytes` takes (saturating: a rate so low that the
/// time overflows a `Duration` panicked this thread, and the step waited
/// for its copies for good).
fn copy_time(cfg: &SimConfig, bytes: u64) -> Duration {
    let rate = cfg
        .h2d_bytes_per_s
        .filter(|r| r.is_finite() && *r > 0.0)
        .map_or(Duration::ZERO, |r| {
            Duration::try_from_secs_f64(bytes as f64 / r).unwrap_or(Duration::MAX)
        });
    cfg.copy_delay.saturating_add(rate)
}

pub(super) fn copy_thread(rx: Receiver<Job>, shared: Arc<Shared>, cfg: SimConfig) {
    for job in rx {
        let start = Instant::now();
        std::thread::sleep(copy_time(&cfg, job.bytes));
        // The bytes are read at the end of the copy's time: one that
        // changed under it (a staging buffer refilled, a page written
        // without waiting for the pin) is seen.
        let (dst, slab) = match job.src {
            Source::Staged { slab, sum } => {
                if fingerprint(&slab) != sum {
                    shared.violations.fetch_add(1, Ordering::Relaxed);
                }
                (slab.clone(), Some(slab))
            }
            Source::Pinned { pin, dtype } => {
                let dst = widen(pin.bytes(), dtype);
                shared.direct_copies.fetch_add(1, Ordering::Relaxed);
                shared
                    .direct_bytes
                    .fetch_add(pin.len_bytes() as u64, Ordering::Relaxed);
                // The copy is done: its pin goes.
                drop(pin);
                shared.pins_held.fetch_sub(1, Ordering::Relaxed);
                (dst, None)
            }
        };
        shared.push_span(DeviceSpan {
            queue: DeviceQueue::H2d,
            name: job.what,
            start,
            end: Instant::now(),
        });
        // The counters and the staging buffer first, then the event: who
        // waited on it sees the device with this copy done.
        shared.in_flight.fetch_sub(1, Ordering::Relaxed);
        shared.copies.fetch_add(1, Ordering::Relaxed);
        if let Some(slab) = slab {
            shared.give_slab(slab);
        }
        job.event.complete(dst);
    }
}

pub(super) fn download_thread(rx: Receiver<Down>, shared: Arc<Shared>, cfg: SimConfig) {
    for d in rx {
        if let Some(rest) = d
            .after
            .and_then(|t| t.checked_duration_since(Instant::now()))
        {
            std::thread::sleep(rest);
        }
        let start = Instant::now();
        // To 16 bits, rounded on the device: half the bytes.
        let out = match d.wire {
            Wire::Bf16 => HostVec::Bf16(d.data.iter().map(|&x| half::bf16::from_f32(x)).collect()),
            Wire::F16 => HostVec::F16(d.data.iter().map(|&x| half::f16::from_f32(x)).collect()),
            Wire::F32 => HostVec::F32(d.data),
        };
        std::thread::sleep(copy_time(&cfg, out.bytes()));
        shared.push_span(DeviceSpan {
            queue: DeviceQueue::D2h,
            name: d.what,
            start,
            end: Instant::now(),
        });
        d.event.complete(out);
        shared.downloads_in_flight.fetch_sub(1, Ordering::Relaxed);
        shared.downloads.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_time_beyond_a_duration_saturates() {
        let mut cfg = SimConfig::instant(1 << 20, 1);
        cfg.h2d_bytes_per_s = Some(1e9);
        assert_eq!(copy_time(&cfg, 1_000_000_000), Duration::from_secs(1));
        cfg.h2d_bytes_per_s = Some(1e-300);
        cfg.copy_delay = Duration::from_secs(1);
        assert_eq!(copy_time(&cfg, 1 << 20), Duration::MAX);
    }
}

//! Per-step metrics as JSON lines, and the final summary.
//!
//! Key names are an interface (scripts read them): `step`, `loss` (the mean
//! over the step's micro-batches as an f32, written by serde_json with the
//! shortest representation that round-trips the f32 exactly),
//! `tokens_per_s`, `compute_s`, `io_wait_s`, `optimizer_s`, `idle_s`,
//! `bytes_read` / `bytes_written` (objects keyed by tier: `cpu`, `nvme`),
//! `peak_rss_bytes`, `minor_faults`, `overlap_efficiency`. The summary line has
//! `"summary": true`, `weight_sha256` and the run's total `bytes_read` /
//! `bytes_written` per tier.
//!
//! A step's counters are the work done *during its wall time*: the
//! optimizer tail of step `n` overlaps the forward of step `n+1`
//! (see [`crate::engine::trainer`]), so its I/O and Adam time land partly in step
//! `n+1`'s line. Per-step figures therefore depend on timing; the summary's
//! totals do not, but for the re-steps of speculation misses (a speculative
//! step that already ran is read and written again, one not yet run is
//! replaced: timing decides which; see `docs/decisions/determinism.md`).
//!
//! Definitions:
//! * `compute_s`: wall time of unit forward/backward and gradient
//!   accumulation on the compute thread;
//! * `io_wait_s`: time the compute thread blocked on parameter I/O plus
//!   time the optimizer thread blocked on optimizer-state I/O (the two
//!   threads run concurrently, so this is a sum of waits, not of wall
//!   time); `param_write_wait_s` is the part spent freeing a swap buffer
//!   by waiting for a param write-back;
//! * `optimizer_s`: time in the Adam kernel (on the optimizer thread, so it
//!   overlaps `compute_s`) and the norm pass;
//! * `idle_s`: wall time of the compute thread not spent computing, taking
//!   the gradients' norms, waiting on param I/O, or waiting for the
//!   optimizer thread (for updated params of the last step's tail); that
//!   is bookkeeping and tensor building;
//! * `io_busy_s`: wall time during the step with any I/O engine (params,
//!   optimizer reads, optimizer writes) having a transfer in flight: the
//!   union over engines and rings, not their sum ([`tierzero_swap::BusyClock`]);
//! * `overlap_efficiency = max(compute_s, io_busy_s, optimizer_s) / wall_s`
//!   (1.0 means the step is as short as its busiest resource allows); with
//!   a device, its queues count as resources too (`device_busy_s`,
//!   `h2d_busy_s`, `d2h_busy_s`, `h2d_fill_busy_s`, `collective_busy_s`)
//!   and the compute thread's waits for its copies (`h2d_wait_s`,
//!   `d2h_wait_s`) are taken out of `compute_s`: a step spent waiting on a
//!   slow link is that link's, not a busy compute thread's
//!   ([`overlap_efficiency`]).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::engine::{EngineError, Result};

/// `max(host_compute_s, every busy time in resources) / wall_s`, 0 for a
/// step of no time: how close the step came to its busiest resource's
/// time. `host_compute_s` is the compute thread's own work (its waits for
/// a device's copies taken out: they are the link's time, counted in its
/// busy times).
pub fn overlap_efficiency(wall_s: f64, host_compute_s: f64, resources: &[f64]) -> f64 {
    if wall_s <= 0.0 {
        return 0.0;
    }
    resources
        .iter()
        .fold(host_compute_s.max(0.0), |m, &r| m.max(r))
        / wall_s
}

/// One optimizer step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepMetrics {
    /// 1-based step number.
    pub step: u64,
    /// Mean loss over the step's micro-batches.
    pub loss: f32,
    /// Tokens processed per second (all ranks).
    pub tokens_per_s: f64,
    /// Step wall time.
    pub wall_s: f64,
    /// Compute busy time.
    pub compute_s: f64,
    /// Time blocked on I/O.
    pub io_wait_s: f64,
    /// Optimizer busy time.
    pub optimizer_s: f64,
    /// The rest.
    pub idle_s: f64,
    /// I/O engines' busy time.
    pub io_busy_s: f64,
    /// Bytes read per tier.
    pub bytes_read: BTreeMap<String, u64>,
    /// Bytes written per tier.
    pub bytes_written: BTreeMap<String, u64>,
    /// Peak resident set size of the process.
    pub peak_rss_bytes: u64,
    /// Minor page faults of the whole process (every thread: compute,
    /// optimizer, I/O) from the step's start to its end
    /// (`minflt` of `/proc/self/stat`): memory the step touches for the first time,
    /// or again after it was given back; a step that frees and remaps
    /// its large buffers shows it here (0 where unknown).
    pub minor_faults: u64,
    /// max(compute, I/O, optimizer busy) / wall.
    pub overlap_efficiency: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Loss scale used (1 without fp16).
    pub loss_scale: f64,
    /// Whether the step was skipped (gradients not all finite: fp16's
    /// overflow, or bf16's with `bf16.check_grad_overflow`).
    pub skipped: bool,
    /// Global gradient norm, when it was computed (clipping, or an overflow
    /// check: fp16, and bf16 by default).
    pub grad_norm: Option<f64>,
    /// Sub-groups handed to the optimizer thread before backward ended.
    pub sub_groups_stepped_during_backward: u64,
    /// Part of `io_wait_s` spent waiting for param write-backs to free a
    /// swap buffer.
    pub param_write_wait_s: f64,
    /// Collectives this step gathered params in (several ranks: one per
    /// unit whose params were not all resident; 0 with one rank).
    pub param_gathers: u64,
    /// Reduce-scatters of gradients this step (several ranks: one per
    /// unit and micro-batch that had any; 0 with one rank).
    pub grad_reduces: u64,
    /// Speculative steps so far whose speculation held (committed as
    /// stepped; see "Speculative step" in the trainer docs).
    pub speculation_hits: u64,
    /// Speculative steps so far redone (clipping) or undone (fp16
    /// overflow).
    pub speculation_misses: u64,
    /// NVMe sub-groups so far that, in a speculative step, waited for the
    /// decision because the speculation pool's slots were all taken
    /// (`speculation_slots` in the plan).
    pub speculation_pool_waits: u64,
    /// Bytes copied host to device by the device tier (0 computing on the
    /// host).
    pub h2d_bytes: u64,
    /// Bytes copied device to host by the device tier.
    pub d2h_bytes: u64,
    /// Seconds the compute thread waited for the device tier's uploads
    /// (a staging buffer, or a copy's event).
    pub h2d_wait_s: f64,
    /// Seconds the compute thread waited for the device tier's gradient
    /// downloads (they run on the copy queue out while the next unit
    /// computes): the wait for their copies only, not the reads of their
    /// elements into the sums (since one rank reads them where they
    /// landed; before, it counted a copy out of the staging buffer too).
    pub d2h_wait_s: f64,
    /// Bytes of units' inputs the device tier did not upload: the
    /// previous unit's output was still on the device.
    pub h2d_kept_bytes: u64,
    /// Of `h2d_bytes`, the params' bytes the device tier copied in place
    /// from their pinned homes registered with the device (cpu-tier
    /// pages, or the swap buffers NVMe reads landed in), with no staging
    /// fill.
    pub h2d_direct_bytes: u64,
    /// Of `h2d_bytes`, the params' bytes the device tier uploaded for the
    /// unit about to compute instead of staging them ahead (the window,
    /// `stage3_max_live_parameters` or the budget held them back): the
    /// unit's compute waits for these copies.
    pub h2d_at_use_bytes: u64,
    /// Swap buffers kept for a param's copy in place that were let go
    /// before its unit was loaded, because a read ahead or a write-back
    /// wanted the buffer: those params crossed through staging. Many of
    /// them say `offload_param.buffer_count` is small for the read-ahead.
    pub param_buffers_let_go: u64,
    /// Swap buffers kept this step for the device's copies in place
    /// (landed reads and retired write-backs, with registered swap
    /// buffers); `param_buffers_let_go` of them, or of those kept before,
    /// were let go.
    pub param_buffers_kept: u64,
    /// Blocks whose backward on the device ran from their kept forward
    /// (no recompute; see "Kept forwards" in `crate::engine::device`).
    pub device_forwards_kept: u64,
    /// Blocks whose backward on the device computed their forward again.
    pub device_forwards_recomputed: u64,
    /// Units whose forward the device computes launched ahead, before
    /// the engine asked for it (see "Units launched ahead" in
    /// `crate::engine::device`).
    pub device_forwards_ahead: u64,
    /// Units whose backward they launched ahead.
    pub device_backwards_ahead: u64,
    /// Seconds the device's compute queue was busy with units (CUDA
    /// events on the compute stream; 0 without a device tier).
    pub device_busy_s: f64,
    /// Seconds the device's host-to-device copy queue was busy.
    pub h2d_busy_s: f64,
    /// Seconds the device's device-to-host copy queue was busy.
    pub d2h_busy_s: f64,
    /// Seconds the device tier's upload thread spent issuing the params'
    /// uploads (filling their staging buffers, waiting for one), beside
    /// the compute.
    pub h2d_fill_busy_s: f64,
    /// Seconds the device's collectives were busy (several ranks: the
    /// gradients' reduce-scatter on the device), beside the compute.
    pub collective_busy_s: f64,
}

/// The last line of a metrics file.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    /// Always true (marks the line).
    pub summary: bool,
    /// Optimizer steps run.
    pub steps: u64,
    /// Steps skipped for gradients not all finite (fp16 overflow, or bf16
    /// with `bf16.check_grad_overflow`).
    pub skipped_steps: u64,
    /// sha256 over all fp32 master weights in `ParamId` order (little-endian).
    pub weight_sha256: String,
    /// Peak resident set size.
    pub peak_rss_bytes: u64,
    /// Times the trace was re-recorded after a mismatch.
    pub trace_rerecords: u64,
    /// Speculative steps whose speculation held.
    pub speculation_hits: u64,
    /// Speculative steps redone or undone.
    pub speculation_misses: u64,
    /// NVMe sub-groups that waited for the decision because the
    /// speculation pool was taken.
    pub speculation_pool_waits: u64,
    /// Bytes read over the whole run, per tier (`cpu`, `nvme`).
    pub bytes_read: BTreeMap<String, u64>,
    /// Bytes written over the whole run, per tier (initial weights and
    /// state included).
    pub bytes_written: BTreeMap<String, u64>,
    /// Why the run ended early (`"signal"`, `"request"`); absent when it ran
    /// all its steps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped: Option<String>,
    /// The signal that stopped it (`"SIGINT"`, `"SIGTERM"`); absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_signal: Option<String>,
}

/// Peak RSS (`VmHWM`) of this process, 0 where unknown.
pub fn peak_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

/// Minor page faults of this process so far (`minflt` of
/// `/proc/self/stat`, every thread's), 0 where unknown.
pub fn minor_faults() -> u64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| stat_minor_faults(&s))
        .unwrap_or(0)
}

/// `minflt` of a `/proc/PID/stat` line: the 10th field, the 8th after the
/// command name, which is in parentheses and may hold spaces and
/// parentheses itself (so the fields start after the last `)`).
fn stat_minor_faults(stat: &str) -> Option<u64> {
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(7)?.parse().ok()
}

/// Whether the regular file `path` is not empty and does not end in a
/// newline.
fn ends_torn(path: &Path) -> bool {
    use std::io::{Read as _, Seek as _};
    let Ok(mut f) = std::fs::File::open(path) else {
        return false;
    };
    if !f.metadata().is_ok_and(|m| m.is_file() && m.len() > 0) {
        return false;
    }
    let mut last = [0u8; 1];
    f.seek(std::io::SeekFrom::End(-1)).is_ok() && f.read_exact(&mut last).is_ok() && last != *b"\n"
}

/// A JSON-lines writer. A line that cannot be written (a full disk, a
/// file-size limit) stops the metrics, not the run: it is said once and
/// kept ([`MetricsWriter::failure`]); ending the run for it lost every
/// step since the last checkpoint.
#[derive(Debug)]
pub struct MetricsWriter {
    path: PathBuf,
    file: std::io::BufWriter<std::fs::File>,
    failure: Option<String>,
}

impl MetricsWriter {
    /// Creates `path`: truncated, or appended to when `append`. A regular
    /// file is locked (`flock`, held while the writer lives) before it is
    /// truncated: a second run given the same file is refused, where the
    /// two wrote over each other's lines, both exiting 0 (41 lines left of
    /// two 40-step runs). A FIFO or a device (`/dev/stdout`) is not locked.
    pub fn create(path: &Path, append: bool) -> Result<Self> {
        let io_err = |source| EngineError::Io {
            path: path.to_owned(),
            source,
        };
        let f = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .open(path)
            .map_err(io_err)?;
        if f.metadata().map_err(io_err)?.is_file() {
            match f.try_lock() {
                Ok(()) => {}
                Err(std::fs::TryLockError::WouldBlock) => {
                    return Err(io_err(std::io::Error::new(
                        std::io::ErrorKind::WouldBlock,
                        "another run is writing its metrics to this file (it holds the file's \
                         lock): give each run its own --metrics file",
                    )))
                }
                // A file system without flock: written unlocked, as before.
                Err(std::fs::TryLockError::Error(_)) => {}
            }
            if !append {
                f.set_len(0).map_err(io_err)?;
            }
        }
        let mut w = MetricsWriter {
            path: path.to_owned(),
            file: std::io::BufWriter::new(f),
            failure: None,
        };
        if append && ends_torn(path) {
            // A kill or a full disk left half a line: the next line would
            // be glued to it, and lost with it. End it; it stays (as
            // written) for whoever wants its start.
            tracing::warn!(path = %path.display(), "the metrics file ends in half a line (a run killed mid-write?): ending it before appending");
            writeln!(w.file).map_err(|source| EngineError::Io {
                path: path.to_owned(),
                source,
            })?;
        }
        Ok(w)
    }

    /// Writes one object as a line and flushes; after a failed write,
    /// nothing (see the type's docs).
    pub fn write<T: Serialize>(&mut self, value: &T) -> Result<()> {
        if self.failure.is_some() {
            return Ok(());
        }
        let line = serde_json::to_string(value)
            .map_err(|e| EngineError::internal(format!("metrics JSON: {e}")))?;
        if let Err(e) = writeln!(self.file, "{line}").and_then(|()| self.file.flush()) {
            let why = format!("writing {}: {e}", self.path.display());
            tracing::warn!("{why}: the metrics stop here; the run goes on");
            self.failure = Some(why);
        }
        Ok(())
    }

    /// Why the metrics stopped, when a write failed.
    pub fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failure is a panic

    use super::*;

    /// A `--device sim --sim-h2d-gbps 0.005` step seen in review: the compute
    /// thread busy 3.24 s of 3.27, of which 2.73 s waiting for copies, the
    /// device computing 0.51 s, the copy queue out 1.55 s: the link bounds
    /// it, at 0.47 (it said 0.99, from the compute thread's waits).
    #[test]
    fn the_compute_thread_s_waits_for_copies_are_not_its_work() {
        let e = overlap_efficiency(3.27, 3.24 - 1.46 - 1.27, &[0.0, 0.0, 0.51, 1.46, 1.55]);
        assert!((e - 1.55 / 3.27).abs() < 1e-12, "{e}");
        // Without a device: max(compute, io, optimizer) / wall, as before.
        assert_eq!(overlap_efficiency(2.0, 1.5, &[1.0, 0.5]), 0.75);
        assert_eq!(overlap_efficiency(0.0, 1.0, &[]), 0.0);
        // More waits than work (clock skew) is no work, never negative.
        assert_eq!(overlap_efficiency(1.0, -0.1, &[]), 0.0);
    }

    /// `minflt` is found after the command name whatever it holds; a
    /// short or garbled line is `None`, not a panic; this process's count
    /// only grows, and grows when it touches new pages.
    #[test]
    fn minor_faults_come_from_the_stat_line() {
        let line = "4242 (tz (a) b) R 1 4242 4242 0 -1 4194560 123456 0 7 0 5 3 0 0 20 0 9";
        assert_eq!(stat_minor_faults(line), Some(123_456));
        assert_eq!(stat_minor_faults("4242 (x) R 1 2"), None);
        assert_eq!(stat_minor_faults("no parenthesis"), None);
        assert_eq!(stat_minor_faults("1 (x) R 1 2 3 4 5 6 many"), None);
        let before = minor_faults();
        assert!(before > 0);
        let touched: Vec<u8> = vec![1; 64 << 20];
        assert!(touched.iter().step_by(4096).all(|&b| b == 1));
        assert!(minor_faults() > before, "64 MiB touched without a fault");
    }

    /// A second writer of one metrics file is refused, and the first's
    /// lines stay (its truncation came before: two runs wrote over each
    /// other's lines); once the first is gone, the file is free.
    #[test]
    fn a_metrics_file_has_one_writer() {
        let dir = std::env::temp_dir().join(format!("tz-metrics-one-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.jsonl");
        let mut a = MetricsWriter::create(&path, false).unwrap();
        a.write(&serde_json::json!({"step": 1})).unwrap();
        for append in [false, true] {
            let e = MetricsWriter::create(&path, append)
                .unwrap_err()
                .to_string();
            assert!(e.contains("another run is writing its metrics"), "{e}");
        }
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"step\":1}\n");
        drop(a);
        let b = MetricsWriter::create(&path, false).unwrap();
        drop(b);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "");
        // Not a regular file: not locked (two writers of /dev/null).
        let n1 = MetricsWriter::create(Path::new("/dev/null"), false).unwrap();
        let n2 = MetricsWriter::create(Path::new("/dev/null"), false).unwrap();
        drop((n1, n2));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A resumed run appends after a torn last line (a kill mid-write)
    /// on a line of its own: its first line used to be glued to it, and
    /// lost as invalid JSON.
    #[test]
    fn appending_after_a_torn_line_starts_a_new_line() {
        let dir = std::env::temp_dir().join(format!("tz-metrics-torn-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.jsonl");
        for (before, after) in [
            (
                "{\"step\":1}\n{\"step\":2,\"lo",
                "{\"step\":1}\n{\"step\":2,\"lo\n{\"step\":2}\n",
            ),
            ("{\"step\":1}\n", "{\"step\":1}\n{\"step\":2}\n"),
            ("", "{\"step\":2}\n"),
        ] {
            std::fs::write(&path, before).unwrap();
            let mut w = MetricsWriter::create(&path, true).unwrap();
            w.write(&serde_json::json!({"step": 2})).unwrap();
            drop(w);
            assert_eq!(std::fs::read_to_string(&path).unwrap(), after);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

//! `tierzero bench-io` and `tierzero tune`.
//!
//! Both measure with `tierzero_swap::bench`: one ring, exactly
//! `queue_depth` requests of `block_size` in flight, O_DIRECT, walking the
//! file sequentially, like one fio job with `--direct=1 --ioengine=io_uring`.
//! The file is written once first, so reads hit the device rather than
//! unwritten (zero-filled) extents. Each setting runs for `--seconds` or
//! until `--size` bytes have moved, whichever comes first.
//!
//! `tune` picks the setting with the best harmonic mean of read and write
//! bandwidth, and among those within 3% of it, the one that needs the least
//! pinned memory (`block_size × queue_depth`): DeepSpeed's `ds_nvme_tune`
//! reports the fastest, but pinned memory is what users run out of.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::anyhow;
use clap::{Args, ValueEnum};
use serde::Serialize;
use tierzero::units::{format_bytes, parse_bytes};
use tierzero_swap::bench::{BenchResult, BenchTarget};
use tierzero_swap::{BackendKind, DirectIo, IoOp};

use super::Failure;

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Backend {
    /// io_uring, falling back to the portable pool if unavailable.
    Auto,
    /// io_uring only.
    Uring,
    /// pread/pwrite thread pool.
    Portable,
}

impl From<Backend> for BackendKind {
    fn from(b: Backend) -> Self {
        match b {
            Backend::Auto => BackendKind::Auto,
            Backend::Uring => BackendKind::Uring,
            Backend::Portable => BackendKind::Portable,
        }
    }
}

/// Options shared by bench-io and tune.
#[derive(Debug, Args)]
pub struct Target {
    /// Directory on the device to measure (a temporary swap file is created
    /// under DIR/tierzero/ and removed afterwards).
    #[arg(long, value_name = "DIR", required_unless_present = "file")]
    path: Option<PathBuf>,
    /// Measure on this existing file instead (its contents are OVERWRITTEN
    /// by the write tests; it is not removed).
    #[arg(long, value_name = "FILE", conflicts_with = "path")]
    file: Option<PathBuf>,
    /// Size of the temporary file (with --file, the file's own length is
    /// measured).
    #[arg(long, default_value = "4GiB", value_parser = parse_bytes_arg, conflicts_with = "file")]
    size: u64,
    /// Longest time per measurement, in seconds.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// I/O backend.
    #[arg(long, value_enum, default_value = "auto")]
    backend: Backend,
    /// Skip the initial write of --file (one written before, e.g. by fio;
    /// the new file under --path is always written first, since reads of
    /// unwritten extents return zeros without touching the device).
    // (`conflicts_with`, not `requires = "file"`: clap waives a required
    // argument that conflicts with one given, and --file conflicts with
    // --path.)
    #[arg(long, conflicts_with = "path")]
    no_fill: bool,
}

/// Arguments of `tierzero bench-io`.
#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  tierzero bench-io --path /mnt/nvme\n  tierzero bench-io --path /mnt/nvme --size 8GiB --block-size 1M --queue-depth 32 --json\n  tierzero bench-io --file /mnt/nvme/fio.dat --no-fill --block-size 1M --queue-depth 32"
)]
pub struct BenchIoArgs {
    #[command(flatten)]
    target: Target,
    /// Block sizes (bytes per request), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "128K,1M,8M", value_parser = parse_bytes_arg)]
    block_size: Vec<u64>,
    /// Queue depths (requests in flight), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,128")]
    queue_depth: Vec<usize>,
    /// Which directions to measure.
    #[arg(long, value_enum, default_value = "both")]
    rw: Rw,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Rw {
    /// Sequential reads only.
    Read,
    /// Sequential writes only.
    Write,
    /// Writes, then reads, at each setting.
    Both,
}

/// Arguments of `tierzero tune`.
#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  tierzero tune --path /mnt/nvme\n  tierzero tune --path /mnt/nvme --size 2GiB --seconds 1"
)]
pub struct TuneArgs {
    #[command(flatten)]
    target: Target,
    /// Print the result as JSON (the sweep and the chosen aio block).
    #[arg(long)]
    json: bool,
}

fn parse_bytes_arg(s: &str) -> Result<u64, String> {
    parse_bytes(s).map_err(|e| e.to_string())
}

/// One setting's numbers; a direction `--rw` left out is `None` (null in
/// the JSON, "-" in the table), not a measured zero.
#[derive(Debug, Serialize)]
struct Cell {
    block_bytes: u64,
    queue_depth: usize,
    read_gbps: Option<f64>,
    write_gbps: Option<f64>,
    read_p50_us: Option<f64>,
    read_p99_us: Option<f64>,
    write_p50_us: Option<f64>,
    write_p99_us: Option<f64>,
}

/// `v` in a table column of `width`, with `prec` decimals; "-" for none.
fn cell_text(v: Option<f64>, width: usize, prec: usize) -> String {
    match v {
        Some(v) => format!("{v:>width$.prec$}"),
        None => format!("{:>width$}", "-"),
    }
}

#[derive(Debug, Serialize)]
struct Best {
    block_bytes: u64,
    queue_depth: usize,
    gbps: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    file: String,
    direct_io: bool,
    size_bytes: u64,
    settings: Vec<Cell>,
    best_read: Option<Best>,
    best_write: Option<Best>,
    read_gbps: Option<f64>,
    write_gbps: Option<f64>,
}

/// The target of `t`, filled unless `--no-fill`. Its runs' buffers are
/// page-locked where `RLIMIT_MEMLOCK` holds the largest run's (the
/// fill's, or the sweep's deepest setting of `blocks` x `qds`), else all
/// pageable, said once: the fill alone asked 64 MiB, and the default 8 MiB
/// limit refused every run. A `--file` is opened read-write only where
/// the command `writes` (its fill, or write runs), and refused while a
/// running tierzero holds its directory's swap lock (its swap file).
fn open_target(
    t: &Target,
    blocks: &[u64],
    qds: &[usize],
    writes: bool,
) -> Result<BenchTarget, Failure> {
    // Checked before a fill that may take minutes.
    time_limit(t)?;
    // Handlers first: a signal while the file is made and preallocated is
    // kept for the watcher started below, which removes it (the signal's
    // default action left the whole --size file behind).
    super::signals::register_early()?;
    if t.file.is_none() && t.size == 0 {
        return Err(Failure::BadInput(anyhow!(
            "--size 0: give the benchmark file's size, e.g. 4GiB"
        )));
    }
    let bt = if let Some(file) = &t.file {
        if !file.is_file() {
            return Err(Failure::BadInput(anyhow!(
                "--file {}: {}; give a regular file on the device (or --path DIR for a new one)",
                file.display(),
                match std::fs::metadata(file) {
                    Ok(_) => "not a regular file",
                    Err(_) => "no such file",
                }
            )));
        }
        let dir = file.parent().filter(|d| !d.as_os_str().is_empty());
        // A checkpoint's file is never written by another command (a write
        // run overwrote a step's master weights, found only at the next
        // `inspect --verify` or resume).
        if writes {
            if let Some(step) = tierzero::checkpoint::checkpoint_holding(file) {
                return Err(Failure::BadInput(anyhow!(
                    "--file {}: is inside the checkpoint directory {} and the fill and write \
                     runs would overwrite it; measure another file, or reads alone with --rw \
                     read --no-fill",
                    file.display(),
                    step.display()
                )));
            }
        }
        // A sparse file's writes allocate its holes: where the disk lacks
        // the room, refused now with the numbers (the write runs filled the
        // disk and failed as a poisoned swap space).
        if writes {
            use std::os::unix::fs::MetadataExt as _;
            let m = std::fs::metadata(file)
                .map_err(|e| Failure::BadInput(anyhow!("--file {}: {e}", file.display())))?;
            let holes = m.len().saturating_sub(m.blocks().saturating_mul(512));
            let free = tierzero::engine::sizing::available_bytes_at(
                dir.unwrap_or(std::path::Path::new(".")),
            );
            if let Some(free) = free.filter(|f| holes > *f) {
                return Err(Failure::BadInput(anyhow!(
                    "--file {}: the file is sparse ({} of its {} not allocated) and its file \
                     system has {} free, which its writes would need; give a file written \
                     whole, free space, or measure reads alone with --rw read --no-fill",
                    file.display(),
                    format_bytes(holes),
                    format_bytes(m.len()),
                    format_bytes(free)
                )));
            }
        }
        // Reads alone of a file with holes or unwritten extents (a sparse
        // file, or one `fallocate` made): they read as zeros without
        // touching the device (34 GB/s "measured" on a 2 GB/s disk, 23 for
        // a fallocated file), said with the numbers.
        if !writes {
            let len = std::fs::metadata(file).map_or(0, |m| m.len());
            if let Ok(data) = tierzero_swap::bench::data_bytes(file) {
                let empty = len.saturating_sub(data);
                if empty > 0 {
                    errln!(
                        "warning: --file {}: {} of its {} hold no data (holes, or extents \
                         allocated but never written, as fallocate leaves them): reads of them \
                         return zeros without touching the device, so the read speed is not \
                         the disk's; write the file whole first (leave out --no-fill)",
                        file.display(),
                        format_bytes(empty),
                        format_bytes(len)
                    );
                }
            }
        }
        if let tierzero_swap::lock::LockState::Held { holder_pid } =
            tierzero_swap::lock::lock_state(dir.unwrap_or(std::path::Path::new(".")))
        {
            // Reading alone harms nothing, but it measures the disk shared
            // with the run's own I/O: neither number would mean anything.
            // (It was refused as an overwrite also with --rw read --no-fill.)
            return Err(Failure::BadInput(anyhow!(
                "--file {}: a running tierzero{} holds its directory's swap lock: this is its \
                 swap file, and bench-io would {}; measure another file, or after that run ends",
                file.display(),
                holder_pid.map_or_else(String::new, |p| format!(" (pid {p})")),
                if writes {
                    "overwrite it"
                } else {
                    "measure the disk while the run reads and writes it (both slowed, neither \
                     measured)"
                }
            )));
        }
        BenchTarget::existing(file, DirectIo::Auto, writes).map_err(|e| match e {
            tierzero_swap::SwapError::Setup { ref source, .. }
                if matches!(
                    source.kind(),
                    std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem
                ) || source.raw_os_error() == Some(libc::EPERM) =>
            {
                Failure::BadInput(anyhow!(
                    "--file {}: {source} (opened {}); {}",
                    file.display(),
                    if writes { "read-write" } else { "read-only" },
                    if writes {
                        "the fill and write runs write it: measure reads alone with --rw read \
                         --no-fill, or give a file you may write"
                    } else {
                        "give a file you may read"
                    }
                ))
            }
            e => Failure::from_swap(e, "opening the benchmark file"),
        })?
    } else {
        let dir = t
            .path
            .as_ref()
            .ok_or_else(|| Failure::BadInput(anyhow!("give --path DIR or --file FILE")))?;
        if !dir.is_dir() {
            return Err(Failure::BadInput(anyhow!(
                "--path {}: {}; give a directory on the device to measure",
                dir.display(),
                match std::fs::metadata(dir) {
                    Ok(_) => "not a directory",
                    Err(_) => "no such directory",
                }
            )));
        }
        // Its tierzero/ dir is not made inside a checkpoint's directory.
        if let Some(ck) = tierzero::checkpoint::checkpoint_holding(&dir.join("tierzero")) {
            return Err(Failure::BadInput(anyhow!(
                "--path {}: is inside the checkpoint directory {} (a file there belongs to the \
                 checkpoints); give bench-io another --path",
                dir.display(),
                ck.display()
            )));
        }
        // Whole O_DIRECT blocks, rounded up: a --size of 5000 measured a
        // 4 KiB file.
        let size = tierzero_swap::align::Alignment::new(tierzero_swap::align::MIN_ALIGNMENT_BYTES)
            .round_up(t.size);
        BenchTarget::create(dir, size, DirectIo::Auto).map_err(|e| match e {
            tierzero_swap::SwapError::NoRoom {
                needed_bytes,
                available_bytes,
                ..
            } => {
                // In bytes where the rounded sizes read the same ("needs
                // 100.0 MiB, has 100.0 MiB free").
                let (needed, free) =
                    match (format_bytes(needed_bytes), format_bytes(available_bytes)) {
                        (n, f) if n == f => (
                            format!("{needed_bytes} bytes"),
                            format!("{available_bytes} bytes"),
                        ),
                        nf => nf,
                    };
                Failure::BadInput(anyhow!(
                    "--size {}: the file takes {needed} (with its alignment room) and {} has \
                     {free} free; give a smaller --size or another --path",
                    format_bytes(t.size),
                    dir.display(),
                ))
            }
            tierzero_swap::SwapError::Locked { holder_pid, .. } => Failure::BadInput(anyhow!(
                "--path {}: another tierzero process ({}) is using its tierzero/ directory; \
                 give bench-io another --path, or wait for that process to finish",
                dir.display(),
                holder_pid.map_or_else(|| "pid unknown".to_owned(), |p| format!("pid {p}"))
            )),
            e => Failure::from_swap(e, "creating the benchmark file"),
        })?
    };
    let mut bt = bt;
    tierzero::failpoint::kill_point(tierzero::failpoint::Site::BenchFileMade);
    let largest_run_bytes = [
        (!t.no_fill).then_some((
            tierzero_swap::bench::FILL_BLOCK_BYTES,
            tierzero_swap::bench::FILL_QUEUE_DEPTH,
        )),
        blocks.iter().max().copied().zip(qds.iter().max().copied()),
    ]
    .into_iter()
    .flatten()
    .filter_map(|(b, q)| tierzero_swap::bench::run_arena_bytes(b, q))
    .max()
    .unwrap_or(0);
    let memlock = tierzero_swap::MemlockInfo::current();
    if memlock.check(largest_run_bytes).is_err() {
        errln!(
            "warning: RLIMIT_MEMLOCK lets this process lock {} and the largest run maps {} of \
             buffers: every run uses pageable buffers, which io_uring cannot register (as \
             train does with tierzero.memlock \"auto\"); raise `ulimit -l` to measure with \
             locked ones",
            format_bytes(memlock.limit_bytes.saturating_sub(memlock.locked_bytes)),
            format_bytes(largest_run_bytes)
        );
        bt.set_lock(tierzero_swap::LockPolicy::Off);
    }
    // A signal from here on (the fill may take minutes) removes the file
    // this run made, as its drop would.
    super::signals::exit_on_signal("the benchmark file", bt.made_paths())?;
    if !bt.is_direct() {
        errln!("warning: O_DIRECT is not available on this file system; numbers include the page cache");
    }
    if !t.no_fill {
        errln!(
            "writing {} once so reads touch the device...",
            format_bytes(bt.len_bytes())
        );
        bt.fill(t.backend.into())
            .map_err(|e| Failure::from_swap(e, "filling the benchmark file"))?;
    }
    Ok(bt)
}

fn measure(
    bt: &BenchTarget,
    t: &Target,
    op: IoOp,
    block: u64,
    qd: usize,
) -> Result<BenchResult, Failure> {
    let limit = Some(time_limit(t)?);
    bt.run(op, block, qd, bt.len_bytes(), limit, t.backend.into())
        .map_err(|e| {
            Failure::from_swap(e, &format!("{op} at block size {block}, queue depth {qd}"))
        })
}

/// `--seconds` as a duration: positive and finite.
fn time_limit(t: &Target) -> Result<Duration, Failure> {
    if t.seconds <= 0.0 || !t.seconds.is_finite() {
        return Err(Failure::BadInput(anyhow!(
            "--seconds {}: give a finite number of seconds > 0, e.g. 3",
            t.seconds
        )));
    }
    Duration::try_from_secs_f64(t.seconds).map_err(|_| {
        Failure::BadInput(anyhow!(
            "--seconds {}: too long for a duration; give at most about 1.8e19",
            t.seconds
        ))
    })
}

/// The sweep's settings, checked before the file is created and filled
/// (minutes): block sizes positive and whole 4 KiB (O_DIRECT's least
/// alignment; a device that needs more is refused at its first run),
/// queue depths at least 1, and each run's pinned buffers
/// ([`tierzero_swap::bench::run_arena_bytes`]) within the memory available
/// (`MemAvailable`; not checked when unknown): mapping them failed as an
/// internal error after the fill.
fn check_sweep(blocks: &[u64], qds: &[usize]) -> Result<(), Failure> {
    check_sweep_within(blocks, qds, tierzero::engine::sizing::mem_available_bytes())
}

fn check_sweep_within(
    blocks: &[u64],
    qds: &[usize],
    available_bytes: Option<u64>,
) -> Result<(), Failure> {
    if blocks.is_empty() || qds.is_empty() || qds.contains(&0) {
        return Err(Failure::BadInput(anyhow!(
            "give at least one block size and queue depths >= 1"
        )));
    }
    let align = tierzero_swap::align::MIN_ALIGNMENT_BYTES;
    if let Some(b) = blocks.iter().find(|b| **b == 0 || **b % align != 0) {
        return Err(Failure::BadInput(anyhow!(
            "--block-size {b}: give a positive multiple of {align} bytes (O_DIRECT's alignment), \
             e.g. 1M"
        )));
    }
    let (Some(&block), Some(&qd)) = (blocks.iter().max(), qds.iter().max()) else {
        return Ok(());
    };
    let most_qd = tierzero_swap::fileio::MAX_RING_ENTRIES as usize;
    if qd > most_qd {
        return Err(Failure::BadInput(anyhow!(
            "--queue-depth {qd}: a ring holds at most {most_qd} requests; give at most {most_qd} \
             (8 to 128 is typical)"
        )));
    }
    let most_block = tierzero_swap::engine::MAX_BLOCK_BYTES / align * align;
    if block > most_block {
        return Err(Failure::BadInput(anyhow!(
            "--block-size {}: one request moves less than 2 GiB; give at most {most_block} bytes",
            format_bytes(block)
        )));
    }
    let buffers = tierzero_swap::bench::outstanding_buffers(qd);
    let pinned = tierzero_swap::bench::run_arena_bytes(block, qd);
    let available = match (pinned, available_bytes) {
        (Some(p), Some(a)) if p > a => format_bytes(a),
        (None, a) => a.map_or_else(|| "far less".to_owned(), format_bytes),
        _ => return Ok(()),
    };
    Err(Failure::BadInput(anyhow!(
        "--block-size {} with --queue-depth {qd} pins {} ({buffers} buffers of the block: \
         twice the depth) and {available} of host memory is available; lower the largest block \
         size or queue depth",
        format_bytes(block),
        pinned.map_or_else(|| "more than 2^64 bytes".to_owned(), format_bytes),
    )))
}

fn sweep(
    bt: &BenchTarget,
    t: &Target,
    blocks: &[u64],
    qds: &[usize],
    rw: Rw,
    verbose: bool,
) -> Result<Vec<Cell>, Failure> {
    check_sweep(blocks, qds)?;
    let mut cells = Vec::new();
    for &block in blocks {
        for &qd in qds {
            let w = match rw {
                Rw::Read => None,
                _ => Some(measure(bt, t, IoOp::Write, block, qd)?),
            };
            let r = match rw {
                Rw::Write => None,
                _ => Some(measure(bt, t, IoOp::Read, block, qd)?),
            };
            let gbps = |x: &Option<BenchResult>| x.as_ref().map(BenchResult::gbps);
            if verbose {
                errln!(
                    "  block {:>9}  qd {:>3}: read {} GB/s  write {} GB/s",
                    format_bytes(block),
                    qd,
                    cell_text(gbps(&r), 6, 3),
                    cell_text(gbps(&w), 6, 3)
                );
            }
            cells.push(Cell {
                block_bytes: block,
                queue_depth: qd,
                read_gbps: gbps(&r),
                write_gbps: gbps(&w),
                read_p50_us: r.as_ref().map(|r| r.latency_p50_us),
                read_p99_us: r.as_ref().map(|r| r.latency_p99_us),
                write_p50_us: w.as_ref().map(|w| w.latency_p50_us),
                write_p99_us: w.as_ref().map(|w| w.latency_p99_us),
            });
        }
    }
    Ok(cells)
}

/// The fastest setting in `f`'s direction; `None` when it was not measured.
fn best(cells: &[Cell], f: impl Fn(&Cell) -> Option<f64>) -> Option<Best> {
    cells
        .iter()
        .filter_map(|c| f(c).map(|g| (c, g)))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(c, gbps)| Best {
            block_bytes: c.block_bytes,
            queue_depth: c.queue_depth,
            gbps,
        })
}

fn target_name(t: &Target) -> String {
    t.file
        .as_ref()
        .or(t.path.as_ref())
        .map(|p| p.display().to_string())
        .unwrap_or_default()
}

/// The settings whose queue depth a file of `len_bytes` cannot reach: a
/// run moves the file's length once at most, so at most
/// `ceil(len / block)` requests are ever in flight. (block, depth, the
/// most in flight) of each.
fn shallow_settings(len_bytes: u64, blocks: &[u64], qds: &[usize]) -> Vec<(u64, usize, u64)> {
    blocks
        .iter()
        .flat_map(|&b| {
            qds.iter()
                .map(move |&q| (b, q, len_bytes.div_ceil(b.max(1))))
        })
        .filter(|&(_, q, most)| q as u64 > most)
        .collect()
}

/// `tierzero bench-io`.
pub fn run_bench_io(a: BenchIoArgs) -> Result<(), Failure> {
    super::json_object_on_failure(a.json);
    check_sweep(&a.block_size, &a.queue_depth)?;
    let writes = !a.target.no_fill || a.rw != Rw::Read;
    let bt = open_target(&a.target, &a.block_size, &a.queue_depth, writes)?;
    let shallow = shallow_settings(bt.len_bytes(), &a.block_size, &a.queue_depth);
    if !shallow.is_empty() {
        let list: Vec<String> = shallow
            .iter()
            .map(|(b, q, most)| format!("block {} qd {q} (at most {most})", format_bytes(*b)))
            .collect();
        errln!(
            "warning: the file ({}) is too small for these settings' queue depth, which their \
             rows do not reach: {}; give a larger --size or --file",
            format_bytes(bt.len_bytes()),
            list.join(", ")
        );
    }
    let over: Vec<String> = a
        .block_size
        .iter()
        .filter(|&&b| b > bt.len_bytes())
        .map(|&b| format_bytes(b))
        .collect();
    if !over.is_empty() {
        errln!(
            "warning: block size {} is larger than the file ({}): those rows move requests of \
             the file's size, not of the block; give a larger --size or --file",
            over.join(", "),
            format_bytes(bt.len_bytes())
        );
    }
    let cells = sweep(&bt, &a.target, &a.block_size, &a.queue_depth, a.rw, !a.json)?;
    let best_read = best(&cells, |c| c.read_gbps);
    let best_write = best(&cells, |c| c.write_gbps);
    let report = Report {
        file: target_name(&a.target),
        direct_io: bt.is_direct(),
        size_bytes: bt.len_bytes(),
        read_gbps: best_read.as_ref().map(|b| b.gbps),
        write_gbps: best_write.as_ref().map(|b| b.gbps),
        settings: cells,
        best_read,
        best_write,
    };
    if a.json {
        let s = serde_json::to_string_pretty(&report).map_err(|e| Failure::Internal(e.into()))?;
        outln!("{s}");
        return Ok(());
    }
    outln!(
        "{} ({}, O_DIRECT {})",
        report.file,
        format_bytes(report.size_bytes),
        if report.direct_io { "on" } else { "off" }
    );
    outln!(
        "{:>10} {:>4} {:>10} {:>6} {:>10} {:>10} {:>10} {:>6} {:>10} {:>10}",
        "block",
        "qd",
        "read GB/s",
        "%best",
        "p50 us",
        "p99 us",
        "write GB/s",
        "%best",
        "p50 us",
        "p99 us"
    );
    let share = |v: Option<f64>, best: &Option<Best>| match v.zip(best.as_ref()) {
        Some((v, b)) => format!("{:>5.0}%", 100.0 * v / b.gbps.max(1e-12)),
        None => format!("{:>6}", "-"),
    };
    for c in &report.settings {
        outln!(
            "{:>10} {:>4} {} {} {} {} {} {} {} {}",
            format_bytes(c.block_bytes),
            c.queue_depth,
            cell_text(c.read_gbps, 10, 3),
            share(c.read_gbps, &report.best_read),
            cell_text(c.read_p50_us, 10, 0),
            cell_text(c.read_p99_us, 10, 0),
            cell_text(c.write_gbps, 10, 3),
            share(c.write_gbps, &report.best_write),
            cell_text(c.write_p50_us, 10, 0),
            cell_text(c.write_p99_us, 10, 0),
        );
    }
    for (what, b) in [
        ("read: ", &report.best_read),
        ("write:", &report.best_write),
    ] {
        match b {
            Some(b) => outln!(
                "best {what} {:.3} GB/s at block {} qd {}",
                b.gbps,
                format_bytes(b.block_bytes),
                b.queue_depth
            ),
            None => outln!("best {what} - (not measured: --rw)"),
        }
    }
    Ok(())
}

/// The tune sweep: block sizes and queue depths DeepSpeed users set.
const TUNE_BLOCKS: [u64; 4] = [256 << 10, 1 << 20, 4 << 20, 8 << 20];
const TUNE_QDS: [usize; 5] = [4, 8, 16, 32, 64];

fn harmonic(c: &Cell) -> f64 {
    match (c.read_gbps, c.write_gbps) {
        (Some(r), Some(w)) if r > 0.0 && w > 0.0 => 2.0 / (1.0 / r + 1.0 / w),
        _ => 0.0,
    }
}

/// Chooses the aio setting: best harmonic mean, then least pinned memory
/// within 3% of it.
fn choose(cells: &[Cell]) -> Option<&Cell> {
    let top = cells.iter().map(harmonic).fold(0.0, f64::max);
    cells
        .iter()
        .filter(|c| harmonic(c) >= 0.97 * top)
        .min_by_key(|c| (c.block_bytes * c.queue_depth as u64, c.queue_depth))
}

/// The block sizes and queue depths `tune` sweeps within `available_bytes`
/// of host memory (`None`: unknown, the whole grid): the deepest depths,
/// then the largest blocks, are left out while the largest run's pinned
/// buffers do not fit, and said; refused, before the file is written,
/// when even the least run does not fit. (It wrote the file and then
/// refused the sweep, advising flags tune does not take.)
fn tune_grid(available_bytes: Option<u64>) -> Result<(Vec<u64>, Vec<usize>), Failure> {
    let (mut blocks, mut qds) = (TUNE_BLOCKS.to_vec(), TUNE_QDS.to_vec());
    let Some(available) = available_bytes else {
        return Ok((blocks, qds));
    };
    let fits = |b: &[u64], q: &[usize]| {
        let (Some(&b), Some(&q)) = (b.iter().max(), q.iter().max()) else {
            return true;
        };
        tierzero_swap::bench::run_arena_bytes(b, q).is_some_and(|p| p <= available)
    };
    while !fits(&blocks, &qds) && qds.len() > 1 {
        qds.pop();
    }
    while !fits(&blocks, &qds) && blocks.len() > 1 {
        blocks.pop();
    }
    if !fits(&blocks, &qds) {
        return Err(Failure::BadInput(anyhow!(
            "tune's least setting ({} requests of {}) pins {} and {} of host memory is \
             available; free memory, or measure smaller settings with bench-io \
             (--block-size, --queue-depth)",
            qds[0],
            format_bytes(blocks[0]),
            tierzero_swap::bench::run_arena_bytes(blocks[0], qds[0])
                .map_or_else(|| "more than 2^64 bytes".to_owned(), format_bytes),
            format_bytes(available)
        )));
    }
    if blocks.len() < TUNE_BLOCKS.len() || qds.len() < TUNE_QDS.len() {
        errln!(
            "warning: {} of host memory is available: the sweep stops at {} requests of {} \
             (the settings above pin more than that)",
            format_bytes(available),
            qds.last().copied().unwrap_or(0),
            format_bytes(blocks.last().copied().unwrap_or(0))
        );
    }
    Ok((blocks, qds))
}

/// `tierzero tune`.
pub fn run_tune(a: TuneArgs) -> Result<(), Failure> {
    super::json_object_on_failure(a.json);
    // Its choice rests on every setting reaching its depth: a file too
    // small for them recommended a depth it never ran (checked before a
    // fill that may take minutes).
    let len_bytes = match &a.target.file {
        Some(f) => std::fs::metadata(f).map_or(u64::MAX, |m| m.len()),
        None => a.target.size,
    };
    let (blocks, qds) = tune_grid(tierzero::engine::sizing::mem_available_bytes())?;
    let (max_block, max_qd) = (
        blocks.iter().max().copied().unwrap_or(0),
        qds.iter().max().copied().unwrap_or(0),
    );
    if !shallow_settings(len_bytes, &blocks, &qds).is_empty() {
        let (flag, what) = match a.target.file {
            Some(_) => ("--file", "a file"),
            None => ("--size", "--size"),
        };
        let need = format_bytes(max_block * max_qd as u64);
        return Err(Failure::BadInput(anyhow!(
            "{flag}: {} holds fewer than the sweep's deepest setting moves at once ({max_qd} \
             requests of {}, {need}), so some settings would not reach their queue depth; give \
             {what} of at least {need}",
            format_bytes(len_bytes),
            format_bytes(max_block),
        )));
    }
    let bt = open_target(&a.target, &blocks, &qds, true)?;
    errln!(
        "sweeping {} settings, up to {:.1} s each for read and write...",
        blocks.len() * qds.len(),
        a.target.seconds
    );
    let cells = sweep(&bt, &a.target, &blocks, &qds, Rw::Both, true)?;
    let Some(c) = choose(&cells) else {
        return Err(Failure::Internal(anyhow!("no setting moved any data")));
    };
    let aio = serde_json::json!({
        "block_size": c.block_bytes,
        "queue_depth": c.queue_depth,
        "intra_op_parallelism": 1,
        "single_submit": false,
        "overlap_events": true,
        "use_gds": false
    });
    if a.json {
        let out = serde_json::json!({ "aio": aio, "read_gbps": c.read_gbps, "write_gbps": c.write_gbps, "settings": cells });
        outln!(
            "{}",
            serde_json::to_string_pretty(&out).map_err(|e| Failure::Internal(e.into()))?
        );
        return Ok(());
    }
    outln!(
        "# read {} GB/s, write {} GB/s; pinned per ring {} ({} x {})",
        cell_text(c.read_gbps, 0, 3),
        cell_text(c.write_gbps, 0, 3),
        format_bytes(c.block_bytes * c.queue_depth as u64),
        c.queue_depth,
        format_bytes(c.block_bytes)
    );
    let body = serde_json::to_string_pretty(&aio).map_err(|e| Failure::Internal(e.into()))?;
    outln!("\"aio\": {body}");
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failure is a panic
    use super::*;

    /// A file smaller than block × depth never has that many requests in
    /// flight: those settings are named (bench-io warns, tune refuses).
    #[test]
    fn settings_a_small_file_cannot_reach_are_named() {
        let mib = 1u64 << 20;
        assert_eq!(
            shallow_settings(16 * mib, &[8 * mib, mib], &[1, 2, 128]),
            vec![(8 * mib, 128, 2), (mib, 128, 16)]
        );
        assert!(shallow_settings(4 << 30, &TUNE_BLOCKS, &TUNE_QDS).is_empty());
        assert_eq!(
            shallow_settings(20_000, &[1 << 20], &[4]),
            vec![(1 << 20, 4, 1)]
        );
    }

    /// Under little memory tune sweeps the settings that fit, deepest
    /// depths left out first, and refuses before writing anything when
    /// none does.
    #[test]
    fn tune_sweeps_what_the_memory_holds() {
        let full = tune_grid(None).unwrap();
        assert_eq!(full, (TUNE_BLOCKS.to_vec(), TUNE_QDS.to_vec()));
        assert_eq!(tune_grid(Some(u64::MAX)).unwrap(), full);
        let least = tierzero_swap::bench::run_arena_bytes(TUNE_BLOCKS[0], TUNE_QDS[0]).unwrap();
        let most = tierzero_swap::bench::run_arena_bytes(8 << 20, 64).unwrap();
        let (b, q) = tune_grid(Some(most - 1)).unwrap();
        assert_eq!((b.len(), q.as_slice()), (TUNE_BLOCKS.len(), &TUNE_QDS[..4]));
        let (b, q) = tune_grid(Some(least)).unwrap();
        assert_eq!(
            (b.as_slice(), q.as_slice()),
            (&TUNE_BLOCKS[..1], &TUNE_QDS[..1])
        );
        let e = tune_grid(Some(least - 1)).map(|_| ()).unwrap_err();
        assert!(format!("{e:?}").contains("bench-io"), "{e:?}");
    }

    /// A direction `--rw` left out is no measurement: not a best of 0
    /// GB/s, and "-" in the table.
    #[test]
    fn a_direction_not_measured_has_no_numbers() {
        let read_only = |block_bytes, read: Option<f64>| Cell {
            block_bytes,
            queue_depth: 2,
            read_gbps: read,
            write_gbps: None,
            read_p50_us: read,
            read_p99_us: read,
            write_p50_us: None,
            write_p99_us: None,
        };
        let cells = [read_only(4096, Some(0.5)), read_only(1 << 20, Some(2.0))];
        let b = best(&cells, |c| c.read_gbps).unwrap();
        assert_eq!((b.block_bytes, b.gbps), (1 << 20, 2.0));
        assert!(best(&cells, |c| c.write_gbps).is_none());
        assert_eq!(cell_text(None, 6, 3), "     -");
        assert_eq!(cell_text(Some(2.0), 6, 3), " 2.000");
        let json = serde_json::to_value(&cells[0]).unwrap();
        assert!(json["write_gbps"].is_null(), "{json}");
    }

    /// A sweep whose largest block at its deepest queue (twice the depth
    /// in buffers) pins more than the memory available, or more than 64
    /// bits, is refused naming both; one within it is not.
    #[test]
    fn a_sweep_pinning_more_than_the_memory_available_is_refused() {
        let gib = 1u64 << 30;
        let msg = |r: Result<(), Failure>| match r {
            Err(Failure::BadInput(e)) => e.to_string(),
            Err(Failure::Internal(e)) => panic!("internal: {e}"),
            Ok(()) => String::new(),
        };
        let e = msg(check_sweep_within(
            &[1 << 20, gib / 2],
            &[4, 64],
            Some(20 * gib),
        ));
        assert!(
            e.contains("--block-size 512 MiB with --queue-depth 64 pins 64 GiB (128 buffers"),
            "{e}"
        );
        assert!(e.contains("and 20 GiB of host memory is available"), "{e}");
        assert_eq!(
            msg(check_sweep_within(
                &[1 << 20, gib / 2],
                &[4, 16],
                Some(20 * gib)
            )),
            ""
        );
        assert_eq!(msg(check_sweep_within(&[gib / 2], &[64], None)), "");
        // Past a request's or a ring's limits (so no run's buffers
        // overflow 64 bits).
        let e = msg(check_sweep_within(&[1 << 62], &[4], None));
        assert!(e.contains("give at most 2147479552 bytes"), "{e}");
        let e = msg(check_sweep_within(&[1 << 20], &[4097], None));
        assert!(e.contains("--queue-depth 4097"), "{e}");
        assert_eq!(msg(check_sweep_within(&[2147479552], &[4096], None)), "");
    }

    fn cell(block: u64, qd: usize, r: f64, w: f64) -> Cell {
        Cell {
            block_bytes: block,
            queue_depth: qd,
            read_gbps: Some(r),
            write_gbps: Some(w),
            read_p50_us: Some(0.0),
            read_p99_us: Some(0.0),
            write_p50_us: Some(0.0),
            write_p99_us: Some(0.0),
        }
    }

    #[test]
    fn tune_prefers_less_pinned_memory_within_3_percent() {
        let cells = vec![
            cell(8 << 20, 64, 1.50, 2.50),
            cell(1 << 20, 32, 1.48, 2.47),
            cell(1 << 20, 8, 1.0, 2.0),
        ];
        let c = choose(&cells).map(|c| (c.block_bytes, c.queue_depth));
        assert_eq!(c, Some((1 << 20, 32)));
        let cells = vec![cell(8 << 20, 64, 1.5, 2.5), cell(1 << 20, 32, 1.2, 2.0)];
        assert_eq!(choose(&cells).map(|c| c.queue_depth), Some(64));
    }
}

//! # `tierzero._native`: the extension module of the `tierzero` wheel
//!
//! The Python package (`python/tierzero/`) is thin Python over this module:
//! - [`AioHandle`] (`_AioHandle`): the I/O core of `tierzero.aio.aio_handle`,
//!   DeepSpeed's DeepNVMe handle, on [`tierzero_swap::fileio`]. It submits
//!   reads and writes of host tensors (taken through DLPack,
//!   [`dlpack`]) and waits for them; the DeepSpeed-shaped surface (return
//!   codes, sync and async variants, CUDA tensors, validation, locked
//!   tensors) is Python, in `tierzero/aio.py`.
//! - `mlock` / `munlock` for the locked tensors.
//!
//! ## The GIL
//! Released for every file open, submission and wait; taken back only to
//! drop the tensors whose ops completed (their owners are Python objects).
//!
//! ## Where the unsafe is
//! Only here and in `tierzero-swap`: [`dlpack`] reads the producer's
//! structs; `AioHandle::submit` hands the tensor's memory to the I/O
//! workers (`HostMemory::from_raw_parts`), holding the tensor and its
//! capsule until the op is done; `mlock` takes an address range.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use tierzero_swap::fault::{FaultInjector, FaultKind, FaultRule};
use tierzero_swap::fileio::{Access, FileIo, FileIoConfig, FileTicket, HostMemory, IoFile};
use tierzero_swap::{BackendKind, DirectIo, IoOp, SwapError};

pub mod dlpack;
pub mod optim;

pyo3::create_exception!(
    _native,
    AioError,
    PyOSError,
    "An I/O operation failed: `errno`, `strerror` and `filename` as for OSError, plus `offset` and `length` (bytes) of the failed transfer."
);

/// The errno, path, offset and length an error is about.
fn describe(e: &SwapError) -> (i32, Option<PathBuf>, Option<u64>, Option<u64>) {
    match e {
        SwapError::Io {
            path,
            offset_bytes,
            len_bytes,
            source,
            ..
        } => (
            source.raw_os_error().unwrap_or(libc::EIO),
            Some(path.clone()),
            Some(*offset_bytes),
            Some(*len_bytes),
        ),
        SwapError::ShortIo {
            path,
            offset_bytes,
            expected_bytes,
            ..
        } => (
            libc::EIO,
            Some(path.clone()),
            Some(*offset_bytes),
            Some(*expected_bytes),
        ),
        SwapError::ReadPastEnd {
            path,
            offset_bytes,
            len_bytes,
            ..
        } => (
            libc::EINVAL,
            Some(path.clone()),
            Some(*offset_bytes),
            Some(*len_bytes),
        ),
        SwapError::DirectIoUnsupported { path } => (libc::EINVAL, Some(path.clone()), None, None),
        SwapError::Setup { source, .. } => {
            (source.raw_os_error().unwrap_or(libc::EIO), None, None, None)
        }
        _ => (libc::EIO, None, None, None),
    }
}

/// `AioError(errno, message, filename)` with `offset` and `length` set.
fn aio_error(py: Python<'_>, e: &SwapError, fallback: Option<(&PathBuf, u64, u64)>) -> PyErr {
    let (errno, path, offset, len) = describe(e);
    let path = path.or_else(|| fallback.map(|f| f.0.clone()));
    let offset = offset.or(fallback.map(|f| f.1));
    let len = len.or(fallback.map(|f| f.2));
    let filename = path.map(|p| p.display().to_string());
    let err = AioError::new_err((errno, e.to_string(), filename));
    let value = err.value(py);
    let _ = value.setattr("offset", offset);
    let _ = value.setattr("length", len);
    err
}

/// An op in flight, and what to name in its error.
#[derive(Debug)]
struct Pending {
    ticket: FileTicket,
    path: PathBuf,
    offset_bytes: u64,
    len_bytes: u64,
}

/// The I/O core of `tierzero.aio.aio_handle`.
#[pyclass(name = "_AioHandle", module = "tierzero._native")]
#[derive(Debug)]
pub struct AioHandle {
    io: Arc<FileIo>,
    pending: Mutex<Vec<Pending>>,
}

fn parse_faults(faults: Option<Vec<(String, u64, i32)>>) -> PyResult<Option<Arc<FaultInjector>>> {
    let Some(list) = faults else {
        return Ok(None);
    };
    let mut rules = Vec::new();
    for (op, nth, what) in list {
        if nth == 0 {
            return Err(PyValueError::new_err("fault nth counts from 1"));
        }
        let op = match op.as_str() {
            "read" => Some(IoOp::Read),
            "write" => Some(IoOp::Write),
            "any" => None,
            other => {
                return Err(PyValueError::new_err(format!(
                    "fault op {other:?}: expected \"read\", \"write\" or \"any\""
                )))
            }
        };
        let kind = match what {
            -1 => FaultKind::Short,
            -2 => FaultKind::Eof,
            e if e > 0 => FaultKind::Errno(e),
            e => {
                return Err(PyValueError::new_err(format!(
                    "fault kind {e}: an errno > 0, -1 (short) or -2 (end of file)"
                )))
            }
        };
        rules.push(FaultRule { nth, op, kind });
    }
    Ok(Some(Arc::new(FaultInjector::new(rules))))
}

#[pymethods]
impl AioHandle {
    /// `backend`: "auto" (io_uring, else threads), "uring" or "portable".
    /// `faults`: test-only injected faults, `(op, nth, errno | -1 short | -2 eof)`.
    #[new]
    #[allow(
        clippy::too_many_arguments,
        reason = "DeepSpeed's constructor, keyword for keyword"
    )]
    #[pyo3(signature = (block_size=1048576, queue_depth=128, single_submit=false, overlap_events=false, intra_op_parallelism=1, backend="auto", faults=None))]
    fn new(
        py: Python<'_>,
        block_size: i64,
        queue_depth: i64,
        single_submit: bool,
        overlap_events: bool,
        intra_op_parallelism: i64,
        backend: &str,
        faults: Option<Vec<(String, u64, i32)>>,
    ) -> PyResult<Self> {
        let positive = |name: &str, v: i64| -> PyResult<u64> {
            u64::try_from(v).ok().filter(|&v| v > 0).ok_or_else(|| {
                PyValueError::new_err(format!("{name} must be a positive integer, got {v}"))
            })
        };
        let block_bytes = positive("block_size", block_size)?;
        let queue_depth = u32::try_from(positive("queue_depth", queue_depth)?)
            .map_err(|_| PyValueError::new_err("queue_depth is too large"))?;
        let threads = positive("intra_op_parallelism", intra_op_parallelism)? as usize;
        let backend = match backend {
            "auto" => BackendKind::Auto,
            "uring" => BackendKind::Uring,
            "portable" => BackendKind::Portable,
            other => {
                return Err(PyValueError::new_err(format!(
                    "backend {other:?}: expected \"auto\", \"uring\" or \"portable\""
                )))
            }
        };
        let config = FileIoConfig {
            backend,
            threads,
            queue_depth,
            block_bytes,
            single_submit,
            overlap_events,
            faults: parse_faults(faults)?,
        };
        // A setting the engine refuses (a queue depth over io_uring's
        // 4096) is the caller's ValueError, not an EIO AioError.
        let io = py.detach(|| FileIo::new(config)).map_err(|e| match e {
            SwapError::Config(msg) => PyValueError::new_err(msg),
            e => aio_error(py, &e, None),
        })?;
        Ok(AioHandle {
            io: Arc::new(io),
            pending: Mutex::new(Vec::new()),
        })
    }

    /// Submits `op` ("read" or "write") of all of `buffer` (a contiguous
    /// host tensor) at `file_offset` of `target` (a path, or an open file
    /// descriptor). Returns at once; `wait()` collects it.
    fn submit(
        &self,
        py: Python<'_>,
        op: &str,
        buffer: &Bound<'_, PyAny>,
        target: &Bound<'_, PyAny>,
        file_offset: i64,
    ) -> PyResult<()> {
        let op = match op {
            "read" => IoOp::Read,
            "write" => IoOp::Write,
            other => {
                return Err(PyValueError::new_err(format!(
                    "op {other:?}: expected \"read\" or \"write\""
                )))
            }
        };
        let offset_bytes = u64::try_from(file_offset).map_err(|_| {
            PyValueError::new_err(format!("file_offset must be >= 0, got {file_offset}"))
        })?;
        let tensor = dlpack::host_tensor(buffer)?;
        if op == IoOp::Read && tensor.read_only {
            return Err(PyValueError::new_err("cannot read into a read-only tensor"));
        }
        let access = match op {
            IoOp::Read => Access::Read,
            IoOp::Write => Access::Write,
        };
        enum Target {
            Fd(i32),
            Path(PathBuf),
        }
        let target = if let Ok(fd) = target.extract::<i32>() {
            Target::Fd(fd)
        } else {
            let os = py.import("os")?;
            Target::Path(PathBuf::from(
                os.call_method1("fspath", (target,))?.extract::<String>()?,
            ))
        };
        let label = match &target {
            Target::Fd(fd) => PathBuf::from(format!("<fd {fd}>")),
            Target::Path(p) => p.clone(),
        };
        let len_bytes = tensor.nbytes as u64;
        let (addr, nbytes) = (tensor.addr, tensor.nbytes);
        let owners = tensor.owners;
        // SAFETY: the tensor's `nbytes` bytes from `addr` stay valid while
        // the tensor and its unconsumed DLPack capsule live (`owners`, moved
        // into the HostMemory, dropped only after the op's last transfer).
        // Leaving the tensor alone until `wait()` is the caller's part, as
        // with DeepSpeed's handle (documented in tierzero/aio.py).
        let memory =
            unsafe { HostMemory::from_raw_parts(addr as *mut u8, nbytes, Box::new(owners)) };
        let io = self.io.clone();
        let res = py.detach(move || {
            let file = match &target {
                Target::Fd(fd) => IoFile::from_fd(*fd, access, DirectIo::Auto),
                Target::Path(p) => IoFile::open(p, access, DirectIo::Auto),
            };
            match file {
                Ok(f) => io
                    .submit(op, &f, offset_bytes, memory)
                    .map_err(|e| (e, None)),
                Err(e) => Err((e, Some(memory))),
            }
        });
        match res {
            Ok(ticket) => {
                self.pending
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(Pending {
                        ticket,
                        path: label,
                        offset_bytes,
                        len_bytes,
                    });
                Ok(())
            }
            Err((e, memory)) => {
                drop(memory);
                Err(aio_error(py, &e, Some((&label, offset_bytes, len_bytes))))
            }
        }
    }

    /// Waits for every op in flight; returns how many completed. If any
    /// failed, raises the first error, after all of them are done.
    fn wait(&self, py: Python<'_>) -> PyResult<usize> {
        let pending = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|e| e.into_inner()));
        let n = pending.len();
        let done = py.detach(move || {
            pending
                .into_iter()
                .map(|p| {
                    let c = p.ticket.wait();
                    (c, p.path, p.offset_bytes, p.len_bytes)
                })
                .collect::<Vec<_>>()
        });
        let mut first = None;
        for (c, path, off, len) in done {
            let err = match c {
                Ok(c) => c.result.err(),
                Err(e) => Some(e),
            };
            if let (None, Some(e)) = (&first, err) {
                first = Some(aio_error(py, &e, Some((&path, off, len))));
            }
        }
        match first {
            Some(e) => Err(e),
            None => Ok(n),
        }
    }

    /// Ops submitted and not yet waited for.
    fn pending(&self) -> usize {
        self.pending.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Threads × the O_DIRECT alignment: the size a tensor should be a
    /// multiple of for every thread's share to go straight to the disk.
    fn alignment(&self) -> u64 {
        self.io.config().threads as u64 * tierzero_swap::align::MIN_ALIGNMENT_BYTES
    }

    /// "uring" or "portable".
    fn backend(&self) -> &'static str {
        if self.io.is_uring() {
            "uring"
        } else {
            "portable"
        }
    }

    /// Whether a failed write has poisoned the handle.
    fn poisoned(&self) -> bool {
        self.io.is_poisoned()
    }

    /// Bytes moved each way: `{"direct": .., "bounce": .., "buffered": .., "ops": ..}`.
    fn counters(&self) -> std::collections::HashMap<&'static str, u64> {
        use std::sync::atomic::Ordering::Relaxed;
        let c = self.io.counters();
        [
            ("direct", c.direct_bytes.load(Relaxed)),
            ("bounce", c.bounce_bytes.load(Relaxed)),
            ("buffered", c.buffered_bytes.load(Relaxed)),
            ("ops", c.ops.load(Relaxed)),
        ]
        .into_iter()
        .collect()
    }
}

/// `mlock(2)` of `[addr, addr + length)`; returns whether it succeeded
/// (it fails when RLIMIT_MEMLOCK is too low; the memory is usable anyway).
/// Without the GIL: locking faults in every page, seconds for a large
/// buffer, while other Python threads run.
#[pyfunction]
fn mlock(py: Python<'_>, addr: usize, length: usize) -> bool {
    py.detach(|| {
        // SAFETY: mlock only changes the residency of pages; any address
        // range is memory-safe to pass (unmapped ranges fail with ENOMEM).
        unsafe { libc::mlock(addr as *const libc::c_void, length) == 0 }
    })
}

/// `munlock(2)` of `[addr, addr + length)`, without the GIL.
#[pyfunction]
fn munlock(py: Python<'_>, addr: usize, length: usize) -> bool {
    py.detach(|| {
        // SAFETY: as for `mlock`.
        unsafe { libc::munlock(addr as *const libc::c_void, length) == 0 }
    })
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<AioHandle>()?;
    m.add_class::<optim::OffloadAdam>()?;
    m.add("AioError", m.py().get_type::<AioError>())?;
    m.add_function(wrap_pyfunction!(optim::ds_offload_settings, m)?)?;
    m.add_function(wrap_pyfunction!(optim::adamw_step_inplace, m)?)?;
    m.add_class::<optim::InPlaceMoments>()?;
    m.add_function(wrap_pyfunction!(mlock, m)?)?;
    m.add_function(wrap_pyfunction!(munlock, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}

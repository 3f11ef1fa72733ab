//! CUDA discovery: which GPUs this process can use, and the one boundary
//! through which the crate calls `cudarc` without ever showing a user a
//! panic.
//!
//! # What runs on a GPU today
//!
//! With `--device cuda`, forward and backward: the CUDA units of crate
//! `tierzero-gpu` (kernels compiled by NVRTC, cuBLAS), which the engine
//! calls through `crate::model::exec_units::CudaUnits`; candle itself is
//! built without CUDA and runs on the CPU otherwise. With the `gpu`
//! feature this module adds [`probe`] (devices, names, memory, NCCL's
//! version; `tierzero gpu-info`) and the NCCL communicator
//! (`crate::engine::comm::nccl::NcclComm`), whose collectives stage host
//! buffers through device memory.
//! Without the feature every entry point here returns
//! [`GpuError::NotBuilt`] with the rebuild command, so the CLI needs no
//! `cfg`.
//!
//! # Loading CUDA without a panic
//!
//! `cudarc` is built with `fallback-dynamic-loading`: `libcuda.so` and
//! `libnccl.so` are `dlopen`ed on the first call into each, so the build
//! needs no toolkit and the binary starts on machines without a driver. But
//! when the library is missing, cudarc's loader **panics** (its
//! `culib()` has no error path), and so does a missing symbol (a library
//! older than the bindings). cudarc does offer `is_culib_present()`, but it
//! is an `unsafe fn` and this crate is `#![deny(unsafe_code)]` outside its
//! CPU kernels (the SIMD optimizer, the matmul, the wide loads), so we do
//! not call it. Instead every cudarc call runs on a
//! thread of ours whose name starts with [`GUARDED_THREAD_PREFIX`]:
//!
//! * a panic there ends only that thread; [`run_guarded`] (one call) and
//!   the NCCL communicator's owning thread turn it into a [`GpuError`]
//!   ([`classify_panic`]: "libcuda.so could not be loaded" → the driver is
//!   missing, "nccl" → NCCL is missing, "Missing symbol" → a library older
//!   than the bindings, anything else → [`GpuError::Panicked`] with the
//!   message);
//! * a process-wide panic hook, installed once, stays silent for those
//!   threads only (every other thread's panic reaches the previous hook
//!   unchanged), so the user sees one error line, not cudarc's message and
//!   a backtrace hint.
//!
//! This needs unwinding panics: a build with `panic = "abort"` cannot catch
//! them, and is refused at compile time with the `gpu` feature.

use std::fmt;

/// Names of the threads whose panics are turned into errors (and kept off
/// stderr by the hook): every cudarc call runs on one of them.
pub const GUARDED_THREAD_PREFIX: &str = "tierzero-cuda";

/// Why CUDA or NCCL cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// This binary was built without the `gpu` feature.
    #[error(
        "this tierzero was built without GPU support; rebuild with `cargo build --release \
         --features gpu` (no CUDA toolkit needed to build; the NVIDIA driver is needed to run)"
    )]
    NotBuilt,
    /// `libcuda.so` (installed by the NVIDIA driver) could not be loaded.
    #[error(
        "libcuda.so not found: install the NVIDIA driver (it provides libcuda.so.1), or add the \
         directory that holds libcuda.so.1 to LD_LIBRARY_PATH"
    )]
    DriverMissing {
        /// cudarc's message (the names it tried), for the debug log.
        detail: String,
    },
    /// `libnccl.so` could not be loaded.
    #[error("{}", nccl_missing_message(versioned.as_deref()))]
    NcclMissing {
        /// cudarc's message (the names it tried), for the debug log.
        detail: String,
        /// A `libnccl.so.N` found where the loader looks: cudarc asks for
        /// the unversioned `libnccl.so` (and `.so.1`, `.so.9`–`.so.12`),
        /// which only NCCL's development package and NVIDIA's tarball
        /// install; the runtime package `libnccl2` and the `nvidia-nccl`
        /// wheels ship `libnccl.so.2` alone.
        versioned: Option<std::path::PathBuf>,
    },
    /// The library loaded but lacks a function the bindings use.
    #[error("{library} is older than tierzero's bindings (CUDA 13.0, NCCL 2.30 headers): {detail}; update it")]
    LibraryTooOld {
        /// "libcuda.so" or "libnccl.so".
        library: &'static str,
        /// cudarc's message (the missing symbol).
        detail: String,
    },
    /// The driver loaded but `cuInit` or `cuDeviceGetCount` answered an
    /// error (a stub library, a driver/module mismatch, a container without
    /// the device files, or a code newer than the bindings), or a file of
    /// its name is there but does not load or is no driver.
    #[error("{0}")]
    DriverInit(tierzero_gpu::driver_init::CheckFailure),
    /// The driver loaded but reports no device.
    #[error("the NVIDIA driver is installed but sees no GPU (CUDA_ERROR_NO_DEVICE); check `nvidia-smi` and CUDA_VISIBLE_DEVICES")]
    NoDevice,
    /// `cuda:N` names a device that does not exist.
    #[error("cuda:{ordinal}: this machine has {count} CUDA device(s) (cuda:0 to cuda:{last}); check CUDA_VISIBLE_DEVICES", last = count.saturating_sub(1))]
    BadOrdinal {
        /// The device asked for.
        ordinal: usize,
        /// Devices the driver sees.
        count: usize,
    },
    /// A CUDA driver call failed.
    #[error("CUDA {op}: {reason}")]
    Driver {
        /// What was being done.
        op: &'static str,
        /// The driver's error.
        reason: String,
    },
    /// An NCCL call failed.
    #[error("NCCL {op}: {reason}")]
    Nccl {
        /// What was being done.
        op: &'static str,
        /// NCCL's result code.
        reason: String,
    },
    /// cudarc panicked for a reason other than a missing library.
    #[error("CUDA {op}: cudarc panicked: {message}")]
    Panicked {
        /// What was being done.
        op: &'static str,
        /// The panic's message.
        message: String,
    },
    /// The thread that makes the CUDA calls could not be started.
    #[error("starting the CUDA thread: {0}")]
    Thread(std::io::Error),
    /// The NCCL id could not be handed to every rank.
    #[error("{0}")]
    Rendezvous(#[source] crate::engine::EngineError),
    /// `ncclCommInitRank` answered `ncclInvalidUsage`: NCCL refuses a
    /// communicator in which two ranks share one GPU ("Duplicate GPU
    /// detected", printed only under `NCCL_DEBUG=WARN`), which is what a
    /// launch with the wrong devices gives.
    #[error(
        "NCCL refused to build the communicator on cuda:{ordinal} (ncclInvalidUsage). Most often \
         two ranks of this job use one GPU: give each rank its own (`--device cuda` takes \
         cuda:<local rank>; check CUDA_VISIBLE_DEVICES on each rank). Run with NCCL_DEBUG=WARN \
         to see NCCL's own reason"
    )]
    InitRefused {
        /// This rank's device.
        ordinal: usize,
    },
    /// Other ranks could not start CUDA or NCCL (their own messages say why).
    #[error("ranks {ranks:?} could not start CUDA/NCCL (see their messages); stopping")]
    PeerFailed {
        /// The ranks that failed.
        ranks: Vec<usize>,
    },
    /// A CUDA/NCCL call did not return in time.
    #[error(
        "CUDA {op}: no answer within {seconds:.0} s (set TIERZERO_COMM_TIMEOUT_S to wait longer)"
    )]
    Timeout {
        /// What was being done.
        op: &'static str,
        /// The wait.
        seconds: f64,
    },
}

/// One CUDA device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// `cuda:N`.
    pub ordinal: usize,
    /// The driver's name for it, e.g. "NVIDIA H200".
    pub name: String,
    /// (major, minor).
    pub compute_capability: (i32, i32),
    /// Device memory.
    pub total_bytes: u64,
    /// Free device memory when probed (after this process's context).
    pub free_bytes: u64,
}

/// NCCL's version, from `ncclGetVersion`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NcclVersion {
    /// e.g. 2.
    pub major: u32,
    /// e.g. 26.
    pub minor: u32,
    /// e.g. 5.
    pub patch: u32,
}

impl NcclVersion {
    /// Decodes `ncclGetVersion`'s integer (`major*10000 + minor*100 +
    /// patch` since NCCL 2.9, `major*1000 + minor*100 + patch` before).
    pub fn from_code(code: i32) -> NcclVersion {
        let c = code.max(0) as u32;
        if c >= 10_000 {
            NcclVersion {
                major: c / 10_000,
                minor: (c % 10_000) / 100,
                patch: c % 100,
            }
        } else {
            NcclVersion {
                major: c / 1000,
                minor: (c % 1000) / 100,
                patch: c % 100,
            }
        }
    }
}

impl fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// What [`probe`] found.
#[derive(Debug)]
pub struct GpuInfo {
    /// Every device the driver sees (after CUDA_VISIBLE_DEVICES).
    pub devices: Vec<DeviceInfo>,
    /// NCCL, or why it cannot be loaded (the devices are usable without it).
    pub nccl: Result<NcclVersion, GpuError>,
}

/// Which device a rank uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    /// `cuda:N`.
    Ordinal(usize),
    /// `cuda`: the node-local rank modulo the number of devices.
    Auto,
}

impl DeviceChoice {
    /// The ordinal for a machine with `count` devices, for the rank whose
    /// node-local index is `local_rank`.
    pub fn resolve(self, count: usize, local_rank: usize) -> Result<usize, GpuError> {
        if count == 0 {
            return Err(GpuError::NoDevice);
        }
        match self {
            DeviceChoice::Ordinal(o) if o < count => Ok(o),
            DeviceChoice::Ordinal(o) => Err(GpuError::BadOrdinal { ordinal: o, count }),
            DeviceChoice::Auto => Ok(local_rank % count),
        }
    }
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceChoice::Ordinal(o) => write!(f, "cuda:{o}"),
            DeviceChoice::Auto => write!(f, "cuda"),
        }
    }
}

/// This process's index among the ranks on its node, from the launcher
/// (`OMPI_COMM_WORLD_LOCAL_RANK`, `MPI_LOCALRANKID`, or tierzero's own
/// `TIERZERO_LOCAL_RANK`), else 0.
pub fn local_rank_from_env() -> usize {
    [
        "TIERZERO_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "MPI_LOCALRANKID",
    ]
    .iter()
    .find_map(|k| std::env::var(k).ok()?.trim().parse().ok())
    .unwrap_or(0)
}

/// Parses `--device`: `cpu`, `cuda` or `cuda:N`. `None` means CPU.
pub fn parse_device(text: &str) -> Result<Option<DeviceChoice>, String> {
    let t = text.trim();
    match t {
        "cpu" => Ok(None),
        "cuda" | "gpu" => Ok(Some(DeviceChoice::Auto)),
        _ => match t.strip_prefix("cuda:").map(|n| n.parse::<usize>()) {
            Some(Ok(n)) => Ok(Some(DeviceChoice::Ordinal(n))),
            _ => Err(format!(
                "--device {text}: give cpu, cuda (one GPU per local rank) or cuda:N"
            )),
        },
    }
}

/// Sorts a panic message from cudarc into a [`GpuError`] (see the module
/// docs). `op` names the call that panicked.
pub fn classify_panic(op: &'static str, message: String) -> GpuError {
    let missing_lib = message.contains("Unable to dynamically load");
    if missing_lib && message.contains("\"nccl\"") {
        GpuError::NcclMissing {
            detail: message,
            versioned: find_versioned_nccl(&nccl_search_dirs()),
        }
    } else if missing_lib {
        GpuError::DriverMissing { detail: message }
    } else if message.starts_with("Missing symbol nccl") {
        GpuError::LibraryTooOld {
            library: "libnccl.so",
            detail: message,
        }
    } else if message.starts_with("Missing symbol cu") {
        GpuError::LibraryTooOld {
            library: "libcuda.so",
            detail: message,
        }
    } else {
        GpuError::Panicked { op, message }
    }
}

/// The error text for a missing `libnccl.so`: with a versioned library
/// found, the symlink that makes it loadable; else how to install NCCL.
fn nccl_missing_message(versioned: Option<&std::path::Path>) -> String {
    match versioned {
        Some(path) => format!(
            "libnccl.so not found, but {path} is: tierzero's CUDA bindings load the unversioned \
             name, which only NCCL's development files provide. Link it: `mkdir -p \
             ~/.local/lib/tierzero && ln -sf {path} ~/.local/lib/tierzero/libnccl.so` and add \
             ~/.local/lib/tierzero to LD_LIBRARY_PATH",
            path = path.display()
        ),
        None => "libnccl.so not found: install NCCL 2 (libnccl2 and libnccl-dev from NVIDIA's \
                 CUDA repository, or the nvidia-nccl-cu12 wheel and a libnccl.so link to its \
                 libnccl.so.2), or add the directory that holds libnccl.so to LD_LIBRARY_PATH"
            .to_owned(),
    }
}

/// Where the dynamic loader looks, in its order: `LD_LIBRARY_PATH`, then
/// the usual system directories (those of `ld.so.conf` on Debian, Ubuntu
/// and RHEL, and CUDA's).
fn nccl_search_dirs() -> Vec<std::path::PathBuf> {
    let mut dirs: Vec<std::path::PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    for d in [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/usr/local/lib",
        "/usr/local/cuda/lib64",
        "/usr/local/nvidia/lib64",
    ] {
        dirs.push(d.into());
    }
    dirs
}

/// The first `libnccl.so.N` (N a number, as `libnccl.so.2` or
/// `libnccl.so.2.27.3`) in `dirs`.
fn find_versioned_nccl(dirs: &[std::path::PathBuf]) -> Option<std::path::PathBuf> {
    dirs.iter().find_map(|dir| {
        let mut names: Vec<std::path::PathBuf> = std::fs::read_dir(dir)
            .ok()?
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.strip_prefix("libnccl.so."))
                    .is_some_and(|v| v.split('.').all(|part| part.parse::<u32>().is_ok()))
            })
            .collect();
        // The shortest name is the soname (`libnccl.so.2`), the one the
        // package keeps stable across updates.
        names.sort_by_key(|p| (p.as_os_str().len(), p.clone()));
        names.into_iter().next()
    })
}

/// The text of a panic payload.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".to_owned()
    }
}

/// Installs (once) the panic hook that keeps guarded threads' panics off
/// stderr (logged at debug level instead); other threads' panics go to the
/// previous hook.
pub fn install_quiet_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let guarded = std::thread::current()
                .name()
                .is_some_and(|n| n.starts_with(GUARDED_THREAD_PREFIX));
            if guarded {
                tracing::debug!("panic in a CUDA thread (turned into an error): {info}");
            } else {
                previous(info);
            }
        }));
    });
}

/// Spawns a guarded thread (see the module docs): `name` gets the
/// [`GUARDED_THREAD_PREFIX`].
pub fn spawn_guarded<T, F>(name: &str, f: F) -> Result<std::thread::JoinHandle<T>, GpuError>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    install_quiet_hook();
    std::thread::Builder::new()
        .name(format!("{GUARDED_THREAD_PREFIX}-{name}"))
        .spawn(f)
        .map_err(GpuError::Thread)
}

/// Runs `f` on a guarded thread and waits for it: a panic becomes the
/// [`GpuError`] [`classify_panic`] gives.
pub fn run_guarded<T, F>(op: &'static str, f: F) -> Result<T, GpuError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, GpuError> + Send + 'static,
{
    let handle = spawn_guarded(op, f)?;
    match handle.join() {
        Ok(r) => r,
        Err(payload) => Err(classify_panic(op, panic_message(payload.as_ref()))),
    }
}

/// Devices, their memory, and NCCL. Without a driver: [`GpuError::DriverMissing`]
/// (never a panic). Without the `gpu` feature: [`GpuError::NotBuilt`].
/// It opens a context on every device (for their memory): a rank that
/// wants its own device counts them with [`device_count`] instead.
pub fn probe() -> Result<GpuInfo, GpuError> {
    imp::probe()
}

/// How many devices the driver sees (`cuDeviceGetCount`), opening no
/// context on any of them: on a node whose GPUs are in exclusive-process
/// mode, a context on another rank's GPU fails, and in any mode it takes
/// memory there. Errors as [`probe`]'s.
pub fn device_count() -> Result<usize, GpuError> {
    #[cfg(feature = "gpu")]
    {
        let n = run_guarded("device-count", imp::device_count)?;
        if n == 0 {
            return Err(GpuError::NoDevice);
        }
        Ok(n)
    }
    #[cfg(not(feature = "gpu"))]
    {
        Err(GpuError::NotBuilt)
    }
}

/// The compute libraries the CUDA units need (crate `tierzero-gpu`), each
/// with its version or why it does not load: the driver (the CUDA it
/// supports, refused below 13.0), NVRTC (the kernels, compiled at run
/// time; with the architectures it targets) and cuBLAS. Empty without the
/// `gpu` feature.
pub fn compute_libraries() -> Vec<(&'static str, Result<String, String>)> {
    #[cfg(feature = "gpu")]
    {
        let nvrtc = tierzero_gpu::nvrtc::version()
            .and_then(|(major, minor)| {
                let archs = tierzero_gpu::nvrtc::supported_archs()?;
                let archs: Vec<String> = archs.iter().map(|a| format!("sm_{a}")).collect();
                Ok(format!("{major}.{minor} (targets {})", archs.join(", ")))
            })
            .map_err(|e| e.to_string());
        let cublas = tierzero_gpu::device::cublas_available()
            .map(|()| "loads".to_string())
            .map_err(|e| e.to_string());
        let driver = tierzero_gpu::device::driver_cuda_version()
            .map(|v| format!("supports CUDA {v}"))
            .map_err(|e| e.to_string());
        vec![("driver", driver), ("nvrtc", nvrtc), ("cublas", cublas)]
    }
    #[cfg(not(feature = "gpu"))]
    {
        Vec::new()
    }
}

#[cfg(all(feature = "gpu", panic = "abort"))]
compile_error!(
    "the `gpu` feature needs unwinding panics: cudarc panics when libcuda.so is missing and \
     tierzero turns that into an error (see src/gpu.rs)"
);

#[cfg(feature = "gpu")]
pub(crate) mod imp {
    use super::{run_guarded, DeviceInfo, GpuError, GpuInfo, NcclVersion};
    use cudarc::driver::{sys::CUresult, CudaContext, DriverError};

    /// A driver error, with CUDA_ERROR_NO_DEVICE singled out.
    pub(crate) fn driver_error(op: &'static str, e: &DriverError) -> GpuError {
        if e.0 == CUresult::CUDA_ERROR_NO_DEVICE {
            GpuError::NoDevice
        } else {
            GpuError::Driver {
                op,
                reason: e.to_string(),
            }
        }
    }

    /// An NCCL error (cudarc's `NcclError` prints no detail: use the code).
    pub(crate) fn nccl_error(op: &'static str, e: &cudarc::nccl::result::NcclError) -> GpuError {
        GpuError::Nccl {
            op,
            reason: format!("{:?}", e.0),
        }
    }

    /// Number of devices. Call on a guarded thread. The driver's first
    /// calls go through `tierzero_gpu::driver_init`, whose result codes
    /// are ints: a code cudarc's enum lacks must never reach it.
    pub(crate) fn device_count() -> Result<usize, GpuError> {
        match tierzero_gpu::driver_init::check() {
            Ok(_) | Err(None) => {}
            Err(Some(tierzero_gpu::driver_init::CheckFailure::Init(f)))
                if f.code == tierzero_gpu::driver_init::NO_DEVICE =>
            {
                return Err(GpuError::NoDevice)
            }
            Err(Some(f)) => return Err(GpuError::DriverInit(f)),
        }
        let n = CudaContext::device_count().map_err(|e| driver_error("cuDeviceGetCount", &e))?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// NCCL's version; loads libnccl. Call on a guarded thread.
    pub(crate) fn nccl_version() -> Result<NcclVersion, GpuError> {
        cudarc::nccl::result::get_nccl_version()
            .map(NcclVersion::from_code)
            .map_err(|e| nccl_error("ncclGetVersion", &e))
    }

    fn device(ordinal: usize) -> Result<DeviceInfo, GpuError> {
        let ctx = CudaContext::new(ordinal).map_err(|e| driver_error("context", &e))?;
        let name = ctx.name().map_err(|e| driver_error("device name", &e))?;
        let compute_capability = ctx
            .compute_capability()
            .map_err(|e| driver_error("compute capability", &e))?;
        let (free, total) = ctx
            .mem_get_info()
            .map_err(|e| driver_error("cuMemGetInfo", &e))?;
        Ok(DeviceInfo {
            ordinal,
            name,
            compute_capability,
            total_bytes: total as u64,
            free_bytes: free as u64,
        })
    }

    pub(super) fn probe() -> Result<GpuInfo, GpuError> {
        let devices = run_guarded("probe", || {
            let count = device_count()?;
            if count == 0 {
                return Err(GpuError::NoDevice);
            }
            (0..count).map(device).collect::<Result<Vec<_>, _>>()
        })?;
        // Separately: a panic loading libnccl must not hide the devices.
        let nccl = run_guarded("nccl-version", nccl_version);
        Ok(GpuInfo { devices, nccl })
    }
}

#[cfg(not(feature = "gpu"))]
mod imp {
    use super::{GpuError, GpuInfo};

    pub(super) fn probe() -> Result<GpuInfo, GpuError> {
        Err(GpuError::NotBuilt)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[test]
    fn devices_parse() {
        assert_eq!(parse_device("cpu").unwrap(), None);
        assert_eq!(parse_device("cuda").unwrap(), Some(DeviceChoice::Auto));
        assert_eq!(
            parse_device("cuda:3").unwrap(),
            Some(DeviceChoice::Ordinal(3))
        );
        for bad in ["cuda:", "cuda:-1", "cuda:x", "tpu", ""] {
            assert!(parse_device(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn device_choice_resolves_against_the_count() {
        assert_eq!(DeviceChoice::Auto.resolve(2, 5).unwrap(), 1);
        assert_eq!(DeviceChoice::Ordinal(1).resolve(2, 0).unwrap(), 1);
        assert!(matches!(
            DeviceChoice::Ordinal(2).resolve(2, 0),
            Err(GpuError::BadOrdinal {
                ordinal: 2,
                count: 2
            })
        ));
        assert!(matches!(
            DeviceChoice::Auto.resolve(0, 0),
            Err(GpuError::NoDevice)
        ));
    }

    #[test]
    fn nccl_versions_decode_both_encodings() {
        assert_eq!(NcclVersion::from_code(22605).to_string(), "2.26.5");
        assert_eq!(NcclVersion::from_code(2708).to_string(), "2.7.8");
    }

    #[test]
    fn cudarc_panics_are_classified() {
        // The texts of cudarc 0.19's loader (lib.rs panic_no_lib_found, and
        // `load` in each sys module).
        let lib = |name: &str| {
            format!(
                "Unable to dynamically load the \"{name}\" shared library - searched for \
                 library names: [\"libcuda.so\"]. Ensure that `LD_LIBRARY_PATH` has ..."
            )
        };
        assert!(matches!(
            classify_panic("x", lib("cuda")),
            GpuError::DriverMissing { .. }
        ));
        assert!(matches!(
            classify_panic("x", lib("nccl")),
            GpuError::NcclMissing { .. }
        ));
        assert!(matches!(
            classify_panic("x", "Missing symbol ncclCommInitRank: x".into()),
            GpuError::LibraryTooOld {
                library: "libnccl.so",
                ..
            }
        ));
        assert!(matches!(
            classify_panic("x", "index out of bounds".into()),
            GpuError::Panicked { op: "x", .. }
        ));
        assert!(GpuError::DriverMissing {
            detail: String::new()
        }
        .to_string()
        .starts_with("libcuda.so not found: install the NVIDIA driver"));
    }

    #[test]
    fn a_versioned_nccl_alone_is_found_and_named_in_the_fix() {
        let root = std::env::temp_dir().join(format!("tz-nccl-{}", std::process::id()));
        let (empty, wheel) = (root.join("empty"), root.join("wheel"));
        std::fs::create_dir_all(&empty).unwrap();
        std::fs::create_dir_all(&wheel).unwrap();
        for name in [
            "libnccl.so.2.27.3",
            "libnccl.so.2",
            "libnccl.so.2.bak",
            "libnccl-net.so",
        ] {
            std::fs::write(wheel.join(name), b"").unwrap();
        }
        let dirs = [root.join("absent"), empty.clone(), wheel.clone()];
        let found = find_versioned_nccl(&dirs);
        assert_eq!(found.as_deref(), Some(wheel.join("libnccl.so.2").as_path()));
        assert_eq!(find_versioned_nccl(&dirs[..2]), None);
        let with = nccl_missing_message(found.as_deref());
        assert!(
            with.contains(&format!("ln -sf {} ", wheel.join("libnccl.so.2").display())),
            "{with}"
        );
        assert!(nccl_missing_message(None).starts_with("libnccl.so not found: install NCCL 2"));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_panic_on_a_guarded_thread_is_an_error() {
        let r: Result<(), GpuError> = run_guarded("test", || {
            panic!("Unable to dynamically load the \"cuda\" shared library - searched ...")
        });
        assert!(matches!(r, Err(GpuError::DriverMissing { .. })), "{r:?}");
        let r = run_guarded("test", || Ok(7));
        assert_eq!(r.unwrap(), 7);
    }
}

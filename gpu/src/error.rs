//! The crate's one error type.

use std::path::PathBuf;

/// Why a CUDA library or a kernel cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// A CUDA library could not be loaded.
    #[error("{library} could not be loaded (tried {tried}); {fix}")]
    LibraryMissing {
        /// The library, e.g. `libnvrtc.so.13`.
        library: &'static str,
        /// The file names the loader tried.
        tried: String,
        /// What to install or set.
        fix: &'static str,
    },
    /// The library loaded but lacks a function the bindings use.
    #[error("{library} is older than tierzero's bindings (CUDA 13.0): {detail}; install CUDA 13's {library}")]
    LibraryTooOld {
        /// The library.
        library: &'static str,
        /// What cudarc said.
        detail: String,
    },
    /// The driver loaded but did not initialise, or a file of its name is
    /// there but does not load or is no driver (see [`crate::driver_init`]).
    #[error("{0}")]
    DriverInit(crate::driver_init::CheckFailure),
    /// The driver is older than the CUDA the libraries and bindings need.
    #[error(
        "the NVIDIA driver supports CUDA {found}, older than the CUDA {needed} that \
         tierzero's GPU code needs (its CUDA 13 cuBLAS and NVRTC, and calls such as \
         cuEventElapsedTime_v2); update the driver to R580 or newer"
    )]
    DriverTooOld {
        /// What `cuDriverGetVersion` reported, e.g. "12.4".
        found: String,
        /// The oldest that works, e.g. "13.0".
        needed: String,
    },
    /// NVRTC cannot compile for this architecture.
    #[error("NVRTC {version} cannot target sm_{arch} (it targets {supported}); use an NVRTC that supports this GPU")]
    UnsupportedArch {
        /// The compute capability, e.g. 90.
        arch: u32,
        /// NVRTC's version, e.g. "13.0".
        version: String,
        /// The architectures it lists.
        supported: String,
    },
    /// NVRTC loaded but could not load its builtins library
    /// (`libnvrtc-builtins.so.13.*`, which it opens at the first compile).
    #[error(
        "NVRTC could not load its builtins library (libnvrtc-builtins.so.13.*): {log}; put \
         the directory holding it (beside libnvrtc.so.13 in the nvidia-cuda-nvrtc wheel) on \
         LD_LIBRARY_PATH"
    )]
    BuiltinsMissing {
        /// NVRTC's log, on one line.
        log: String,
    },
    /// A kernel module did not compile.
    #[error("kernel module {module} did not compile for {target}: {log}")]
    Compile {
        /// The module's name.
        module: &'static str,
        /// The target, e.g. "sm_90".
        target: String,
        /// NVRTC's log.
        log: String,
    },
    /// An NVRTC call failed.
    #[error("{call} failed: {code}")]
    Nvrtc {
        /// The function.
        call: &'static str,
        /// NVRTC's result code.
        code: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA {call} failed: {detail}")]
    Driver {
        /// What was called.
        call: &'static str,
        /// The driver's error.
        detail: String,
    },
    /// A cuBLAS call failed.
    #[error("cuBLAS {call} failed: {detail}")]
    Blas {
        /// What was called.
        call: &'static str,
        /// cuBLAS's status.
        detail: String,
    },
    /// The device budget is larger than the device's free memory.
    #[error(
        "device budget {budget_bytes} bytes is more than cuda:{ordinal}'s free memory ({free_bytes} of \
         {total_bytes} bytes); lower tierzero.device_budget_bytes or free the GPU"
    )]
    DeviceMemory {
        /// The device.
        ordinal: usize,
        /// The budget asked for.
        budget_bytes: u64,
        /// Free device memory at start-up.
        free_bytes: u64,
        /// The device's memory.
        total_bytes: u64,
    },
    /// An allocation would pass the device budget.
    #[error(
        "{what}: {want_bytes} bytes would pass the device budget ({used_bytes} of {budget_bytes} bytes in use)"
    )]
    OutOfBudget {
        /// What was being allocated.
        what: String,
        /// Its bytes.
        want_bytes: u64,
        /// Bytes allocated already.
        used_bytes: u64,
        /// The budget.
        budget_bytes: u64,
    },
    /// A kernel was called with buffers that do not fit its shape.
    #[error("{kernel}: {detail}")]
    Shape {
        /// The kernel.
        kernel: String,
        /// Which buffer, its length and the length the shape needs.
        detail: String,
    },
    /// The kernel cache could not be read or written.
    #[error("kernel cache {path}: {source}")]
    Cache {
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// The crate's result.
pub type Result<T, E = GpuError> = std::result::Result<T, E>;

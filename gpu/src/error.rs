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

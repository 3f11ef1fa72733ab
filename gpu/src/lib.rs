//! tierzero's CUDA side, in a crate of its own as the swap engine is: the
//! kernels, compiled at run time by NVRTC, their scalar CPU references, and
//! every `unsafe` call into CUDA.
//!
//! # What is here
//!
//! * [`kernels`]: the CUDA C sources (`src/kernels/*.cu`) of every kernel
//!   the units and the optimizer need, and the entry points each module
//!   exports. They are header-free: no CUDA toolkit header is needed, 16-bit
//!   types convert through inline PTX (`cvt.rn.bf16.f32`), so NVRTC alone
//!   compiles them, from the PyPI wheel or PyTorch's own copy.
//! * [`nvrtc`]: compiling a module to a CUBIN for one architecture (or to
//!   PTX), with ptxas's resource report (registers, spills) parsed from the
//!   program log.
//! * [`cache`]: compiled images on disk, keyed by a hash of the source, the
//!   options, the target and NVRTC's version, so a module compiles once per
//!   device architecture.
//! * [`mod@reference`]: for every kernel a scalar Rust function with the same
//!   arithmetic in the same order (the same block-sum tree, the same fused
//!   multiply-adds and no others: kernels compile with `--fmad=false`).
//!   They are checked here against candle's autograd; the device check
//!   compares each kernel against its reference.
//!
//! # Loading CUDA without a panic
//!
//! cudarc is built with `fallback-dynamic-loading`: `libnvrtc.so.13` (and
//! later `libcuda`, `libcublas`) are `dlopen`ed on first use, so building
//! needs no toolkit. cudarc panics when a library is missing; every entry
//! point here first asks whether the library loads
//! ([`nvrtc::available`]) and returns [`GpuError::LibraryMissing`] with the
//! fix, and runs the calls under `catch_unwind`, so a missing symbol (a
//! library older than the bindings) is [`GpuError::LibraryTooOld`], never a
//! panic that reaches the user.
//!
//! # Determinism
//!
//! No kernel uses atomics on floats. Every reduction has one fixed order
//! (see `src/kernels/prelude.cu`), so the same inputs give the same bits on
//! the same GPU; the launch contract (blocks of [`kernels::BLOCK_THREADS`]
//! threads) is part of that order.

pub mod cache;
pub mod collective;
pub mod device;
pub mod driver_init;
mod error;
mod event_queue;
pub mod host_copy;
pub mod host_register;
pub mod kernels;
pub mod link;
pub mod norm;
pub mod nvrtc;
pub mod ops;
pub mod reference;
pub mod unit;

pub use error::{GpuError, Result};

/// The file names cudarc's loader tries for `lib` on Linux (its list also
/// holds Windows-style `lib{lib}64_*` names, left out of messages).
pub(crate) fn tried_names(lib: &str) -> String {
    cudarc::get_lib_name_candidates(lib)
        .into_iter()
        .filter(|n| !n.contains("64"))
        .collect::<Vec<_>>()
        .join(", ")
}

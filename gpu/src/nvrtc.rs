//! Compiling a kernel module with NVRTC, through cudarc's raw bindings
//! (its safe wrapper returns PTX only, and panics where we want errors).
//!
//! * [`available`] says whether `libnvrtc` loads, without a panic.
//! * [`compile`] turns a [`Module`] into a CUBIN for one architecture or
//!   into PTX, with the options every kernel is built with ([`OPTIONS`]),
//!   and returns ptxas's report ([`Resources`] per entry point) from the
//!   program log.
//!
//! A program handle lives inside [`compile`] only, destroyed on every path
//! (`Program`'s `Drop`); nothing NVRTC returns outlives it except the
//! bytes copied out.

use std::ffi::{c_char, c_int, CStr, CString};
use std::fmt;

use cudarc::nvrtc::sys;

use crate::kernels::Module;
use crate::{GpuError, Result};

/// The options of every compile: no contraction of `a * b + c` into fused
/// multiply-adds beyond the `fmaf` the sources write (so the CPU
/// references have the same arithmetic), C++17, and ptxas's resource
/// report in the log.
pub const OPTIONS: [&str; 3] = ["--fmad=false", "--std=c++17", "-Xptxas=-v"];

const LIBRARY: &str = "libnvrtc.so.13";
const FIX: &str = "install NVRTC 13 (the `nvidia-cuda-nvrtc` wheel, or the one PyTorch's cu13 wheels bring) \
                   and put the directory holding libnvrtc.so.13 and libnvrtc-builtins.so.13.* on LD_LIBRARY_PATH";

/// What to compile to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    /// Machine code for compute capability `sm_N` (e.g. 90).
    Cubin(u32),
    /// PTX for `compute_N`, which the driver compiles for later GPUs.
    Ptx(u32),
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Cubin(a) => write!(f, "sm_{a}"),
            Target::Ptx(a) => write!(f, "compute_{a}"),
        }
    }
}

impl Target {
    /// The compute capability.
    pub fn arch(self) -> u32 {
        match self {
            Target::Cubin(a) | Target::Ptx(a) => a,
        }
    }
}

/// ptxas's report on one entry point (CUBIN targets only).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resources {
    /// The entry point.
    pub entry: String,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of spill stores.
    pub spill_store_bytes: u32,
    /// Bytes of spill loads.
    pub spill_load_bytes: u32,
    /// Bytes of stack frame.
    pub stack_bytes: u32,
    /// Bytes of static shared memory.
    pub smem_bytes: u32,
}

/// A compiled module.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// The target.
    pub target: Target,
    /// The CUBIN, or the PTX text (NUL-terminated, as the driver takes it).
    pub image: Vec<u8>,
    /// NVRTC's log (ptxas's report for CUBINs).
    pub log: String,
}

impl Compiled {
    /// ptxas's report per entry point, parsed from the log.
    pub fn resources(&self) -> Vec<Resources> {
        parse_resources(&self.log)
    }
}

/// Parses ptxas `-v` output: "Compiling entry function 'NAME' for 'sm_90'",
/// then "N bytes stack frame, N bytes spill stores, N bytes spill loads"
/// and "Used N registers, ... N bytes smem".
pub fn parse_resources(log: &str) -> Vec<Resources> {
    let mut out: Vec<Resources> = Vec::new();
    let num_before = |line: &str, word: &str| -> u32 {
        line.split(',')
            .find(|part| part.contains(word))
            .and_then(|part| {
                part.split_whitespace()
                    .take_while(|w| !w.starts_with(word))
                    .filter_map(|w| w.parse::<u32>().ok())
                    .last()
            })
            .unwrap_or(0)
    };
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            if let Some(name) = rest.split('\'').next() {
                out.push(Resources {
                    entry: name.to_string(),
                    ..Resources::default()
                });
            }
        } else if let Some(r) = out.last_mut() {
            if line.contains("bytes stack frame") {
                r.stack_bytes = num_before(line, "bytes stack frame");
                r.spill_store_bytes = num_before(line, "bytes spill stores");
                r.spill_load_bytes = num_before(line, "bytes spill loads");
            } else if line.contains("Used") && line.contains("registers") {
                r.registers = line
                    .split("Used ")
                    .nth(1)
                    .and_then(|s| s.split_whitespace().next())
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0);
                r.smem_bytes = num_before(line, "bytes smem");
            }
        }
    }
    out
}

/// Runs `f` (NVRTC calls) with cudarc's panics (a missing symbol) turned
/// into [`GpuError::LibraryTooOld`].
fn guarded<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let detail = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic without a message".into());
        Err(GpuError::LibraryTooOld {
            library: LIBRARY,
            detail,
        })
    })
}

/// Whether `libnvrtc` loads; if not, the error names the names tried and
/// the fix.
pub fn available() -> Result<()> {
    // SAFETY: `is_culib_present` only tries `dlopen` on each candidate name
    // and closes what it opened; it touches no other state.
    if unsafe { sys::is_culib_present() } {
        return Ok(());
    }
    Err(GpuError::LibraryMissing {
        library: LIBRARY,
        tried: crate::tried_names("nvrtc"),
        fix: FIX,
    })
}

fn check(call: &'static str, r: sys::nvrtcResult) -> Result<()> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(GpuError::Nvrtc {
            call,
            code: format!("{r:?}"),
        })
    }
}

/// NVRTC's version, e.g. `(13, 0)`.
pub fn version() -> Result<(i32, i32)> {
    available()?;
    guarded(|| {
        let (mut major, mut minor): (c_int, c_int) = (0, 0);
        // SAFETY: two valid out-pointers to c_int locals.
        check("nvrtcVersion", unsafe {
            sys::nvrtcVersion(&mut major, &mut minor)
        })?;
        Ok((major, minor))
    })
}

/// The compute capabilities NVRTC can target (e.g. 75, 80, ..., 120).
pub fn supported_archs() -> Result<Vec<u32>> {
    available()?;
    guarded(|| {
        let mut n: c_int = 0;
        // SAFETY: a valid out-pointer.
        check("nvrtcGetNumSupportedArchs", unsafe {
            sys::nvrtcGetNumSupportedArchs(&mut n)
        })?;
        let mut archs = vec![0 as c_int; n.max(0) as usize];
        // SAFETY: `archs` holds the `n` ints NVRTC said it writes.
        check("nvrtcGetSupportedArchs", unsafe {
            sys::nvrtcGetSupportedArchs(archs.as_mut_ptr())
        })?;
        Ok(archs.into_iter().map(|a| a as u32).collect())
    })
}

/// An NVRTC program, destroyed on drop.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: `self.0` came from a successful nvrtcCreateProgram and is
        // destroyed once, here; the result is ignored (nothing to do).
        let _ = unsafe { sys::nvrtcDestroyProgram(&mut self.0) };
    }
}

impl Program {
    /// The bytes a `get_size` / `get` pair returns.
    fn bytes(
        &self,
        what: &'static str,
        get_size: unsafe fn(sys::nvrtcProgram, *mut usize) -> sys::nvrtcResult,
        get: unsafe fn(sys::nvrtcProgram, *mut c_char) -> sys::nvrtcResult,
    ) -> Result<Vec<u8>> {
        let mut n = 0usize;
        // SAFETY: a live program and a valid out-pointer.
        check(what, unsafe { get_size(self.0, &mut n) })?;
        let mut buf = vec![0u8; n];
        // SAFETY: `buf` holds the `n` bytes NVRTC said it writes.
        check(what, unsafe { get(self.0, buf.as_mut_ptr().cast()) })?;
        Ok(buf)
    }

    fn log(&self) -> String {
        let bytes = self
            .bytes(
                "nvrtcGetProgramLog",
                sys::nvrtcGetProgramLogSize,
                sys::nvrtcGetProgramLog,
            )
            .unwrap_or_default();
        CStr::from_bytes_until_nul(&bytes)
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned())
    }
}

/// Compiles `module` for `target` with [`OPTIONS`].
pub fn compile(module: &Module, target: Target) -> Result<Compiled> {
    available()?;
    let supported = supported_archs()?;
    if !supported.contains(&target.arch()) {
        let (major, minor) = version()?;
        return Err(GpuError::UnsupportedArch {
            arch: target.arch(),
            version: format!("{major}.{minor}"),
            supported: supported
                .iter()
                .map(|a| format!("sm_{a}"))
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    let internal = |what: &str| GpuError::Compile {
        module: module.name,
        target: target.to_string(),
        log: what.to_string(),
    };
    let src = CString::new(module.source()).map_err(|_| internal("NUL byte in the source"))?;
    let name =
        CString::new(format!("{}.cu", module.name)).map_err(|_| internal("NUL in the name"))?;
    let arch = match target {
        Target::Cubin(a) => format!("--gpu-architecture=sm_{a}"),
        Target::Ptx(a) => format!("--gpu-architecture=compute_{a}"),
    };
    let opts: Vec<CString> = std::iter::once(arch.as_str())
        .chain(OPTIONS)
        .map(|o| CString::new(o).map_err(|_| internal("NUL in an option")))
        .collect::<Result<_>>()?;
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    guarded(|| {
        let mut raw: sys::nvrtcProgram = std::ptr::null_mut();
        // SAFETY: `src` and `name` are NUL-terminated and outlive the call
        // (NVRTC copies them); no headers (0, null arrays).
        check("nvrtcCreateProgram", unsafe {
            sys::nvrtcCreateProgram(
                &mut raw,
                src.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        })?;
        let prog = Program(raw);
        // SAFETY: a live program; `opt_ptrs` points at `opts`' NUL-terminated
        // strings, alive for the call.
        let r =
            unsafe { sys::nvrtcCompileProgram(prog.0, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
        let log = prog.log();
        if r != sys::nvrtcResult::NVRTC_SUCCESS {
            // A setup problem, not the kernel's: said as one (one line).
            if log.contains("libnvrtc-builtins") {
                return Err(GpuError::BuiltinsMissing {
                    log: log.split_whitespace().collect::<Vec<_>>().join(" "),
                });
            }
            return Err(GpuError::Compile {
                module: module.name,
                target: target.to_string(),
                log: if log.trim().is_empty() {
                    format!("{r:?}")
                } else {
                    log
                },
            });
        }
        let image = match target {
            Target::Cubin(_) => {
                prog.bytes("nvrtcGetCUBIN", sys::nvrtcGetCUBINSize, sys::nvrtcGetCUBIN)?
            }
            Target::Ptx(_) => prog.bytes("nvrtcGetPTX", sys::nvrtcGetPTXSize, sys::nvrtcGetPTX)?,
        };
        Ok(Compiled { target, image, log })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptxas_reports_parse() {
        let log = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'rope_f32' for 'sm_90'\n\
ptxas info    : Function properties for rope_f32\n\
ptxas         .     8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads\n\
ptxas info    : Used 30 registers, used 1 barriers, 128 bytes smem\n\
ptxas info    : Compiling entry function 'sum_f32' for 'sm_90'\n\
ptxas info    : Function properties for sum_f32\n\
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 13 registers, used 1 barriers, 128 bytes smem, 372 bytes cmem[0]\n";
        let r = parse_resources(log);
        assert_eq!(
            r,
            vec![
                Resources {
                    entry: "rope_f32".into(),
                    registers: 30,
                    spill_store_bytes: 12,
                    spill_load_bytes: 16,
                    stack_bytes: 8,
                    smem_bytes: 128,
                },
                Resources {
                    entry: "sum_f32".into(),
                    registers: 13,
                    smem_bytes: 128,
                    ..Resources::default()
                },
            ]
        );
    }
}

//! The driver's first calls, `cuInit` and `cuDeviceGetCount`, made through
//! our own `dlsym` with the result read as a plain integer.
//!
//! # Why not through cudarc
//!
//! cudarc's bindings (`cuda-13000`) declare `CUresult` as a Rust enum.
//! A driver newer than the bindings can return a code the enum has no
//! variant for (CUDA 13.1's `CUDA_ERROR_STREAM_DETACHED`, 917, and
//! others), and an enum holding a value outside its variants is undefined
//! behaviour: formatting it for the error message ended the process with
//! `SIGILL`, no message, no exit code the CLI chose. The codes a user's
//! machine most often answers with come from these two calls (a stub
//! library first on `LD_LIBRARY_PATH`, a driver upgraded without a reboot,
//! a container without the device files), so [`check`] makes them first,
//! here, and names the cause and the fix for each; only a driver that
//! initialised is then handed to cudarc.
//!
//! # What it loads
//!
//! The same file cudarc's loader will: the first of
//! `cudarc::get_lib_name_candidates("cuda")` that `dlopen` accepts. The
//! handle is kept open for the life of the process (the driver is loaded
//! once; cudarc's own `dlopen` then finds it already mapped).

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};

/// Why the driver did not initialise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitFailure {
    /// The call that failed: `cuInit` or `cuDeviceGetCount`.
    pub call: &'static str,
    /// Its result, as the driver returned it.
    pub code: i32,
    /// The library that answered (its path as the loader resolved it).
    pub library: String,
}

impl InitFailure {
    /// The code's name in `cuda.h`, where it is one a user meets here.
    pub fn name(&self) -> Option<&'static str> {
        code_info(self.code).map(|(name, _)| name)
    }

    /// What to do about it.
    pub fn fix(&self) -> String {
        match code_info(self.code) {
            Some((_, fix)) => fix.replace("{library}", &self.library),
            None => "a code tierzero's CUDA 13.0 bindings do not know (a newer driver's): check \
                     `nvidia-smi`, and the driver's release notes for the code"
                .to_owned(),
        }
    }
}

impl std::fmt::Display for InitFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = self.name().unwrap_or("CUDA error");
        write!(
            f,
            "the NVIDIA driver ({}) did not initialise: {} returned {name} ({}); {}",
            self.library,
            self.call,
            self.code,
            self.fix()
        )
    }
}

/// Why the driver cannot be used, as [`check`] finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckFailure {
    /// It loaded and answered an error code.
    Init(InitFailure),
    /// A file of a candidate's name is where the loader looks, and
    /// `dlopen` refused it (a library of its own missing, a damaged file,
    /// another architecture's): `reason` is the loader's.
    Unloadable {
        /// The name asked for (`libcuda.so.1`).
        name: String,
        /// `dlerror()`'s text.
        reason: String,
    },
    /// It loaded but is not the driver: it has no `cuInit`.
    NotADriver {
        /// The file, as the loader resolved it.
        path: String,
    },
}

impl std::fmt::Display for CheckFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CheckFailure::Init(i) => i.fmt(f),
            CheckFailure::Unloadable { name, reason } => write!(
                f,
                "{name} is there but does not load: {}; fix what the loader names (a \
                 library of the driver's own missing or of another version: reinstall the \
                 NVIDIA driver), or take the directory holding that {name} out of \
                 LD_LIBRARY_PATH",
                reason.replace('\n', " ")
            ),
            CheckFailure::NotADriver { path } => write!(
                f,
                "{path} is not the NVIDIA driver's libcuda (it has no cuInit): take its \
                 directory out of LD_LIBRARY_PATH so that the driver's libcuda.so.1 loads"
            ),
        }
    }
}

/// `CUDA_ERROR_NO_DEVICE`: the driver works and sees no GPU.
pub const NO_DEVICE: i32 = 100;

/// The codes `cuInit` and `cuDeviceGetCount` give for a machine's setup,
/// with their `cuda.h` names and the fix (`{library}`: the loaded file).
fn code_info(code: i32) -> Option<(&'static str, &'static str)> {
    Some(match code {
        2 => (
            "CUDA_ERROR_OUT_OF_MEMORY",
            "the driver could not allocate host or device memory to start: free memory, check \
             `nvidia-smi` for other processes",
        ),
        34 => (
            "CUDA_ERROR_STUB_LIBRARY",
            "{library} is the CUDA toolkit's stub, which only links programs: take its directory \
             (…/lib64/stubs) out of LD_LIBRARY_PATH so that the driver's libcuda.so.1 loads",
        ),
        46 => (
            "CUDA_ERROR_DEVICE_UNAVAILABLE",
            "the GPUs are unavailable (in use by another process in exclusive-process mode, or \
             being reset): check `nvidia-smi`",
        ),
        100 => (
            "CUDA_ERROR_NO_DEVICE",
            "the driver sees no GPU: check `nvidia-smi` and CUDA_VISIBLE_DEVICES",
        ),
        101 => (
            "CUDA_ERROR_INVALID_DEVICE",
            "CUDA_VISIBLE_DEVICES names a GPU that does not exist: check it against `nvidia-smi -L`",
        ),
        102 => (
            "CUDA_ERROR_DEVICE_NOT_LICENSED",
            "the GPU is not licensed for compute (a vGPU without its licence): check the licence \
             server",
        ),
        304 => (
            "CUDA_ERROR_OPERATING_SYSTEM",
            "a system call in the driver failed (in a container: the /dev/nvidia* device files \
             not passed in): run `nvidia-smi` in the same environment",
        ),
        802 => (
            "CUDA_ERROR_SYSTEM_NOT_READY",
            "the system is not ready (on NVSwitch machines the fabric manager is not running): \
             start nvidia-fabricmanager",
        ),
        803 => (
            "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
            "{library} and the loaded nvidia kernel module are different versions (a driver \
             upgraded without a reboot): reboot, or reload the nvidia kernel module",
        ),
        804 => (
            "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
            "{library} is a forward-compatibility driver this GPU does not support: take the \
             compat directory out of LD_LIBRARY_PATH",
        ),
        999 => (
            "CUDA_ERROR_UNKNOWN",
            "the driver failed for a reason it does not name: check `nvidia-smi` and the kernel \
             log (`dmesg`)",
        ),
        _ => return None,
    })
}

/// A loaded driver's entry points.
struct Driver {
    path: String,
    cu_init: unsafe extern "C" fn(c_uint) -> c_int,
    cu_device_get_count: unsafe extern "C" fn(*mut c_int) -> c_int,
}

/// Loads the driver as cudarc will and makes its first two calls. `Ok`
/// with the device count (0 included: the caller says what that means);
/// `Err(None)` when no file of the driver's names is where the loader
/// looks, or one lacks `cuDeviceGetCount` alone (cudarc's loader then
/// reports it, with the names it tried or the symbol); `Err(Some(_))` when
/// one is there but does not load or is no driver, or the driver answered
/// with an error code.
pub fn check() -> std::result::Result<usize, Option<CheckFailure>> {
    let driver = load()?;
    let fail = |call, code| {
        Err(Some(CheckFailure::Init(InitFailure {
            call,
            code,
            library: driver.path.clone(),
        })))
    };
    // SAFETY: `cuInit`'s C signature is `CUresult cuInit(unsigned int)`;
    // `CUresult` is a C enum, an `int` in the ABI, read here as one (every
    // value is a valid `c_int`). Flags must be 0.
    let code = unsafe { (driver.cu_init)(0) };
    if code != 0 {
        return fail("cuInit", code);
    }
    let mut count: c_int = 0;
    // SAFETY: `CUresult cuDeviceGetCount(int *count)`: `count` is a live,
    // writable int for the whole call, the one the driver writes.
    let code = unsafe { (driver.cu_device_get_count)(&mut count) };
    if code != 0 {
        return fail("cuDeviceGetCount", code);
    }
    Ok(usize::try_from(count).unwrap_or(0))
}

/// The first candidate name that loads, with both symbols; the handle is
/// never closed (see the module docs). Where none loads, the first that is
/// there but was refused, with the loader's reason (`Err(None)`: none is
/// there).
fn load() -> std::result::Result<Driver, Option<CheckFailure>> {
    let mut refused = None;
    for name in cudarc::get_lib_name_candidates("cuda") {
        let Ok(c_name) = CString::new(name.as_str()) else {
            continue;
        };
        // SAFETY: `c_name` is a NUL-terminated string that outlives the
        // call. Loading the driver runs its initialisers, as cudarc's own
        // `dlopen` of the same name would.
        let handle = unsafe { libc::dlopen(c_name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            let reason = last_dl_error();
            // "libcuda.so: cannot open shared object file": not there. A
            // missing library of its own is named by that library's name.
            let absent = reason.starts_with(&format!("{name}: cannot open shared object file"));
            if !absent && refused.is_none() {
                refused = Some(CheckFailure::Unloadable { name, reason });
            }
            continue;
        }
        let init = symbol(handle, c"cuInit");
        let count = symbol(handle, c"cuDeviceGetCount");
        let (Some(init), Some(count)) = (init, count) else {
            // Without cuInit it is no driver at all (every driver has it):
            // named with its path. With cuInit alone (a very old one):
            // left to cudarc, whose message names the missing symbol.
            let not_a_driver = match init {
                None => Some(CheckFailure::NotADriver {
                    path: loaded_path(handle, &name).unwrap_or(name),
                }),
                Some(_) => None,
            };
            // SAFETY: `handle` came from `dlopen` above and nothing from it
            // is in use.
            unsafe { libc::dlclose(handle) };
            return Err(not_a_driver);
        };
        let path = library_path(init).unwrap_or(name);
        // SAFETY: both symbols are the driver's, whose C signatures are
        // `CUresult cuInit(unsigned int)` and `CUresult
        // cuDeviceGetCount(int *)` (`CUresult` an `int` in the ABI); the
        // handle is never closed, so the pointers stay valid.
        let (cu_init, cu_device_get_count) = unsafe {
            (
                std::mem::transmute::<*mut c_void, unsafe extern "C" fn(c_uint) -> c_int>(init),
                std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut c_int) -> c_int>(
                    count,
                ),
            )
        };
        return Ok(Driver {
            path,
            cu_init,
            cu_device_get_count,
        });
    }
    Err(refused)
}

/// `dlerror()`'s text (the last `dlopen`/`dlsym` failure of this thread).
fn last_dl_error() -> String {
    // SAFETY: `dlerror` returns null or a NUL-terminated string that stays
    // valid until the thread's next dl* call; it is copied out at once.
    let p = unsafe { libc::dlerror() };
    if p.is_null() {
        return "the loader gave no reason".to_owned();
    }
    // SAFETY: non-null and NUL-terminated (above).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The path of `name`, loaded as `handle` (a live `dlopen` handle): the
/// directory the loader found it in (`RTLD_DI_ORIGIN`) joined with it.
fn loaded_path(handle: *mut c_void, name: &str) -> Option<String> {
    let mut origin = vec![0 as c_char; libc::PATH_MAX as usize + 1];
    // SAFETY: `handle` is a live `dlopen` handle; RTLD_DI_ORIGIN copies a
    // NUL-terminated directory name of at most PATH_MAX bytes into
    // `origin`, which has room for it and the NUL.
    let rc = unsafe {
        libc::dlinfo(
            handle,
            libc::RTLD_DI_ORIGIN,
            origin.as_mut_ptr().cast::<c_void>(),
        )
    };
    if rc != 0 {
        return None;
    }
    // SAFETY: the call wrote a NUL-terminated string into `origin` (the
    // buffer was zeroed, so it ends in a NUL either way).
    let dir = unsafe { CStr::from_ptr(origin.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    let file = std::path::Path::new(name)
        .file_name()?
        .to_string_lossy()
        .into_owned();
    (!dir.is_empty()).then(|| format!("{dir}/{file}"))
}

/// `name` in the library `handle`, if present.
fn symbol(handle: *mut c_void, name: &CStr) -> Option<*mut c_void> {
    // SAFETY: `handle` is a live `dlopen` handle and `name` NUL-terminated.
    let p = unsafe { libc::dlsym(handle, name.as_ptr()) };
    (!p.is_null()).then_some(p)
}

/// The path of the file that holds `addr`, as the loader resolved it.
fn library_path(addr: *mut c_void) -> Option<String> {
    // SAFETY: `Dl_info` is plain data; all-zero is a valid value for it.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: `addr` is a symbol's address from `dlsym`, `info` a live,
    // writable `Dl_info` the call fills.
    if unsafe { libc::dladdr(addr, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    let name: *const c_char = info.dli_fname;
    // SAFETY: `dli_fname` is a NUL-terminated string owned by the loader,
    // valid while the library stays loaded (it is never closed).
    let name = unsafe { CStr::from_ptr(name) };
    Some(name.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_known_code_has_a_name_and_a_fix_naming_the_library_where_it_matters() {
        for code in [2, 34, 46, 100, 101, 102, 304, 802, 803, 804, 999] {
            let f = InitFailure {
                call: "cuInit",
                code,
                library: "/x/libcuda.so".into(),
            };
            let text = f.to_string();
            assert!(f.name().is_some(), "{code}");
            assert!(text.contains(&format!("({code})")), "{text}");
            assert!(!text.contains("{library}"), "{text}");
            assert!(!text.contains('\n'), "{text}");
        }
        let stub = InitFailure {
            call: "cuInit",
            code: 34,
            library: "/usr/local/cuda/lib64/stubs/libcuda.so".into(),
        };
        assert!(stub
            .to_string()
            .contains("/usr/local/cuda/lib64/stubs/libcuda.so is the CUDA toolkit's stub"));
    }

    #[test]
    fn a_code_newer_than_the_bindings_is_named_by_number() {
        let f = InitFailure {
            call: "cuDeviceGetCount",
            code: 917,
            library: "libcuda.so".into(),
        };
        assert_eq!(f.name(), None);
        let text = f.to_string();
        assert!(
            text.contains("cuDeviceGetCount returned CUDA error (917)"),
            "{text}"
        );
        assert!(text.contains("do not know"), "{text}");
    }
}

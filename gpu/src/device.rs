//! One GPU: its context, its streams, its kernels and cuBLAS, and the
//! device memory it may use.
//!
//! # Streams
//!
//! Three per device: `compute` (kernels and GEMMs, in issue order), `h2d`
//! and `d2h` (copies to and from the device, so they overlap compute). The
//! compute stream waits on a copy's event, never on the host; the host
//! waits only to read results back ([`Device::download`]).
//!
//! # Memory
//!
//! Every device buffer is a [`DeviceBuffer`], counted against the byte
//! budget the device was opened with ([`DeviceOptions::budget_bytes`],
//! checked against the free memory at start-up, [`GpuError::DeviceMemory`]);
//! an allocation past it is [`GpuError::OutOfBudget`] with the numbers.
//! A buffer returns its bytes when dropped; cudarc frees it on its stream
//! (stream-ordered), so memory a queued kernel still uses is not reused
//! before that kernel has run. The driver's pool keeps up to the budget of
//! freed memory mapped across synchronisations (`keep_pool_reserved`),
//! as a caching allocator does. An output that a kernel writes in full is
//! not zeroed first ([`Device::alloc_output`]).
//!
//! # Kernels and cuBLAS
//!
//! Every module of [`crate::kernels`] is compiled for the device's
//! architecture (a CUBIN, from the [`KernelCache`] when it has one) and
//! loaded at open; a missing entry point is an error then, not at the first
//! launch. cuBLAS runs on the compute stream with one fixed workspace
//! ([`BLAS_WORKSPACE_BYTES`]), so its choice of algorithm, and so the
//! bits of a GEMM, do not depend on what else is allocated.
//!
//! # Failing cleanly
//!
//! [`Device::open`] checks, in order, that the driver loads and supports
//! CUDA 13.0 ([`MIN_DRIVER_VERSION`]), that a device of that ordinal
//! exists, that cuBLAS and NVRTC load and that NVRTC can target the
//! device; each failure is one error naming the library and the fix.
//! cudarc's panics (a missing library or symbol) are caught
//! ([`guarded`]). The version check comes first because an older driver
//! loads, and opens a device, and lacks calls that are only made later
//! (`cuEventElapsedTime_v2`, CUDA 12.8, at the first step's timings): the
//! panic would come from there, outside any guard.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits,
};

use crate::cache::KernelCache;
use crate::kernels::MODULES;
use crate::nvrtc::{self, Target};
use crate::{GpuError, Result};

/// cuBLAS's workspace per handle (NVIDIA's recommendation for Hopper).
pub const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// How to open a device.
#[derive(Debug, Clone)]
pub struct DeviceOptions {
    /// Bytes of device memory this process may allocate (None: the free
    /// memory at open, less 5% for the driver and cuBLAS).
    pub budget_bytes: Option<u64>,
    /// Where compiled kernels are kept.
    pub cache: KernelCache,
}

impl Default for DeviceOptions {
    fn default() -> Self {
        DeviceOptions {
            budget_bytes: None,
            cache: KernelCache::in_default_dir(),
        }
    }
}

/// Runs `f` with cudarc's panics (a library or symbol that does not load)
/// turned into errors naming `library`.
pub fn guarded<T>(library: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let detail = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic without a message".into());
        Err(GpuError::LibraryTooOld { library, detail })
    })
}

pub(crate) fn driver_err(call: &'static str) -> impl Fn(cudarc::driver::DriverError) -> GpuError {
    move |e| GpuError::Driver {
        call,
        detail: e.to_string(),
    }
}

/// Whether `libcuda` (the driver) loads and initialises: `cuInit` and
/// `cuDeviceGetCount` answer success, asked through
/// [`crate::driver_init`] (their codes read as ints, so one newer than the
/// bindings is an error, not an invalid enum) before cudarc calls them.
pub fn driver_available() -> Result<()> {
    if let Err(Some(f)) = crate::driver_init::check() {
        return Err(GpuError::DriverInit(f));
    }
    // SAFETY: only `dlopen`s the candidate names and closes them.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        return Ok(());
    }
    Err(GpuError::LibraryMissing {
        library: "libcuda.so.1",
        tried: crate::tried_names("cuda"),
        fix: "install the NVIDIA driver (it provides libcuda.so.1), or add the directory holding it to LD_LIBRARY_PATH",
    })
}

/// The oldest driver this crate runs on, as `cuDriverGetVersion` reports
/// it (1000 x major + 10 x minor): CUDA 13.0, what its bindings
/// (cudarc's `cuda-13000`) and its libraries (`libcublas.so.13`,
/// `libnvrtc.so.13`) are built for.
pub const MIN_DRIVER_VERSION: i32 = 13_000;

/// `version` (1000 x major + 10 x minor) as "major.minor".
fn cuda_version_text(version: i32) -> String {
    format!("{}.{}", version / 1000, (version % 1000) / 10)
}

/// Refuses a driver older than [`MIN_DRIVER_VERSION`].
pub fn check_driver_version(version: i32) -> Result<()> {
    if version >= MIN_DRIVER_VERSION {
        return Ok(());
    }
    Err(GpuError::DriverTooOld {
        found: cuda_version_text(version),
        needed: cuda_version_text(MIN_DRIVER_VERSION),
    })
}

/// The CUDA version the loaded driver supports (`cuDriverGetVersion`).
fn driver_version() -> Result<i32> {
    let mut version: std::ffi::c_int = 0;
    // SAFETY: `version` is a live, writable int for the whole call, the
    // one the driver writes; the call needs no context. (cudarc panics if
    // the symbol is missing: callers are within `guarded`.)
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(driver_err("cuDriverGetVersion"))?;
    Ok(version)
}

/// The CUDA version the loaded driver supports, "major.minor"; an error
/// when the driver does not load or is older than
/// [`MIN_DRIVER_VERSION`] (naming both versions).
pub fn driver_cuda_version() -> Result<String> {
    driver_available()?;
    guarded("libcuda.so.1", || {
        let version = driver_version()?;
        check_driver_version(version)?;
        Ok(cuda_version_text(version))
    })
}

/// Whether `libcublas` and `libcublasLt` load.
pub fn cublas_available() -> Result<()> {
    // SAFETY: as in `driver_available`.
    let present = unsafe { cudarc::cublas::sys::is_culib_present() }
        // SAFETY: as above.
        && unsafe { cudarc::cublaslt::sys::is_culib_present() };
    if present {
        return Ok(());
    }
    Err(GpuError::LibraryMissing {
        library: "libcublas.so.13",
        tried: crate::tried_names("cublas"),
        fix: "install CUDA 13's cuBLAS (the nvidia-cublas wheel, or PyTorch's cu13 wheels: their nvidia/cu13/lib) \
              and add its directory to LD_LIBRARY_PATH",
    })
}

/// Lets the device's memory pool (the one `cuMemAllocAsync`, and so every
/// [`DeviceBuffer`], allocates from) keep up to `bytes` of freed memory
/// reserved across synchronisations. Its default threshold is 0: at each
/// synchronisation (a loss read back, a download) the pool hands its free
/// memory back to the driver, and the next step maps it again, allocation
/// by allocation, as PyTorch's caching allocator never does. The budget
/// still bounds what is allocated at once; this bounds what the pool
/// holds besides.
///
/// It also keeps the pool from adding dependencies between streams of its
/// own (`CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES` off): memory
/// freed on the compute stream and not yet free there is then not handed
/// to an allocation on a copy stream by making that stream wait for
/// compute, which would serialise the uploads behind the kernels they
/// should overlap; the pool maps more instead. Memory whose free
/// completed, or that an event already orders, is still reused.
///
/// Nothing to do without stream-ordered allocation (cudarc then allocates
/// with `cuMemAlloc`).
fn keep_pool_reserved(ctx: &Arc<CudaContext>, bytes: u64) -> Result<()> {
    use cudarc::driver::{result, sys};
    if !ctx.has_async_alloc() {
        return Ok(());
    }
    ctx.bind_to_thread()
        .map_err(driver_err("cuCtxSetCurrent"))?;
    // SAFETY: `cu_device()` is the device `ctx` was created on, so the
    // pool is that device's current pool; each value has the type its
    // attribute takes (a cuuint64_t for the release threshold, an int for
    // the reuse flag) and lives through its call.
    unsafe {
        let pool = result::device::get_mem_pool(ctx.cu_device())
            .map_err(driver_err("cuDeviceGetMemPool"))?;
        let mut value: u64 = bytes;
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut value as *mut u64).cast(),
        )
        .map_err(driver_err("cuMemPoolSetAttribute"))?;
        // An int (0 or 1), as the attribute takes.
        let mut allow: std::ffi::c_int = 0;
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
            (&mut allow as *mut std::ffi::c_int).cast(),
        )
        .map_err(driver_err("cuMemPoolSetAttribute"))
    }
}

/// The device's byte budget and what is allocated against it.
#[derive(Debug)]
pub struct Budget {
    budget_bytes: u64,
    used_bytes: AtomicU64,
}

impl Budget {
    /// A budget of `budget_bytes`.
    pub fn new(budget_bytes: u64) -> Self {
        Budget {
            budget_bytes,
            used_bytes: AtomicU64::new(0),
        }
    }

    /// Takes `bytes` for `what`, or says why not.
    pub fn take(&self, what: &str, bytes: u64) -> Result<()> {
        let mut used = self.used_bytes.load(Ordering::Relaxed);
        loop {
            let next = used.saturating_add(bytes);
            if next > self.budget_bytes {
                return Err(GpuError::OutOfBudget {
                    what: what.to_string(),
                    want_bytes: bytes,
                    used_bytes: used,
                    budget_bytes: self.budget_bytes,
                });
            }
            match self
                .used_bytes
                .compare_exchange(used, next, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return Ok(()),
                Err(now) => used = now,
            }
        }
    }

    /// Returns `bytes`.
    pub fn give(&self, bytes: u64) {
        self.used_bytes.fetch_sub(bytes, Ordering::AcqRel);
    }

    /// Bytes in use.
    pub fn used_bytes(&self) -> u64 {
        self.used_bytes.load(Ordering::Relaxed)
    }

    /// The budget.
    pub fn budget_bytes(&self) -> u64 {
        self.budget_bytes
    }
}

/// Device memory of `len` elements of `T`, counted against its device's
/// [`Budget`] until dropped.
#[derive(Debug)]
pub struct DeviceBuffer<T> {
    slice: CudaSlice<T>,
    bytes: u64,
    budget: Arc<Budget>,
}

impl<T> DeviceBuffer<T> {
    /// The cudarc slice (for kernel arguments and copies).
    pub fn slice(&self) -> &CudaSlice<T> {
        &self.slice
    }

    /// The cudarc slice, mutably.
    pub fn slice_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.slice.len()
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.slice.is_empty()
    }

    /// Gives its bytes back to the budget now, before it is dropped: for
    /// a buffer let go that only waits for its last use on a stream to end
    /// ([`crate::link::Uploads::free_after_compute`]). Its memory is then
    /// counted as a freed buffer's is: free once that use ends.
    pub(crate) fn uncount(&mut self) {
        self.budget.give(std::mem::take(&mut self.bytes));
    }
}

impl<T> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        self.budget.give(self.bytes);
    }
}

/// One GPU, opened.
pub struct Device {
    ordinal: usize,
    name: String,
    arch: u32,
    ctx: Arc<CudaContext>,
    /// Kernels and GEMMs.
    pub compute: Arc<CudaStream>,
    /// Copies to the device.
    pub h2d: Arc<CudaStream>,
    /// Copies from the device.
    pub d2h: Arc<CudaStream>,
    blas: CudaBlas,
    _blas_workspace: CudaSlice<u8>,
    functions: HashMap<String, CudaFunction>,
    budget: Arc<Budget>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("arch", &self.arch)
            .field("budget", &self.budget)
            .finish_non_exhaustive()
    }
}

impl Device {
    /// Opens `cuda:{ordinal}` (see "Failing cleanly" in the module docs).
    pub fn open(ordinal: usize, opts: &DeviceOptions) -> Result<Device> {
        driver_available()?;
        guarded("libcuda.so.1", || Device::open_inner(ordinal, opts))
    }

    fn open_inner(ordinal: usize, opts: &DeviceOptions) -> Result<Device> {
        check_driver_version(driver_version()?)?;
        let count = CudaContext::device_count().map_err(driver_err("cuDeviceGetCount"))?;
        if ordinal >= count.max(0) as usize {
            return Err(GpuError::Driver {
                call: "cuDeviceGet",
                detail: format!(
                    "cuda:{ordinal} does not exist: this machine has {count} CUDA devices"
                ),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(driver_err("cuCtxCreate"))?;
        let name = ctx.name().map_err(driver_err("cuDeviceGetName"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver_err("cuDeviceGetAttribute"))?;
        let arch = (major * 10 + minor) as u32;
        let (free, total) = ctx.mem_get_info().map_err(driver_err("cuMemGetInfo"))?;
        let (free, total) = (free as u64, total as u64);
        let budget_bytes = match opts.budget_bytes {
            Some(b) if b > free => {
                return Err(GpuError::DeviceMemory {
                    ordinal,
                    budget_bytes: b,
                    free_bytes: free,
                    total_bytes: total,
                })
            }
            Some(b) => b,
            None => free - free / 20,
        };
        keep_pool_reserved(&ctx, budget_bytes)?;
        cublas_available()?;
        nvrtc::available()?;
        // The kernels, for this architecture.
        let mut functions = HashMap::new();
        for m in MODULES {
            let (image, _) = opts.cache.get(m, Target::Cubin(arch))?;
            let module = ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(image))
                .map_err(driver_err("cuModuleLoadData"))?;
            for e in m.entries() {
                let f = module
                    .load_function(&e)
                    .map_err(driver_err("cuModuleGetFunction"))?;
                functions.insert(e, f);
            }
        }
        let compute = ctx.new_stream().map_err(driver_err("cuStreamCreate"))?;
        let h2d = ctx.new_stream().map_err(driver_err("cuStreamCreate"))?;
        let d2h = ctx.new_stream().map_err(driver_err("cuStreamCreate"))?;
        let budget = Arc::new(Budget::new(budget_bytes));
        budget.take("cuBLAS workspace", BLAS_WORKSPACE_BYTES as u64)?;
        let workspace = compute
            .alloc_zeros::<u8>(BLAS_WORKSPACE_BYTES)
            .map_err(driver_err("cuMemAlloc"))?;
        let blas = CudaBlas::new(compute.clone()).map_err(|e| GpuError::Blas {
            call: "cublasCreate",
            detail: e.to_string(),
        })?;
        {
            use cudarc::driver::DevicePtr;
            let (ptr, _sync) = workspace.device_ptr(&compute);
            // SAFETY: `blas.handle()` is a live handle; `ptr` is a device
            // allocation of BLAS_WORKSPACE_BYTES kept alive in `Device`
            // beside the handle (dropped after it: field order), and only
            // cuBLAS uses it, on the compute stream it was allocated on.
            let st = unsafe {
                cudarc::cublas::sys::cublasSetWorkspace_v2(
                    *blas.handle(),
                    ptr as *mut std::ffi::c_void,
                    BLAS_WORKSPACE_BYTES,
                )
            };
            if st != cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Err(GpuError::Blas {
                    call: "cublasSetWorkspace",
                    detail: format!("{st:?}"),
                });
            }
        }
        Ok(Device {
            ordinal,
            name,
            arch,
            ctx,
            compute,
            h2d,
            d2h,
            blas,
            _blas_workspace: workspace,
            functions,
            budget,
        })
    }

    /// `cuda:N`.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Compute capability as `major * 10 + minor` (90 for an H100/H200).
    pub fn arch(&self) -> u32 {
        self.arch
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// cuBLAS on the compute stream.
    pub fn blas(&self) -> &CudaBlas {
        &self.blas
    }

    /// The byte budget.
    pub fn budget(&self) -> &Budget {
        &self.budget
    }

    /// A loaded kernel entry point.
    pub fn function(&self, entry: &str) -> Result<&CudaFunction> {
        self.functions.get(entry).ok_or_else(|| GpuError::Shape {
            kernel: entry.to_string(),
            detail: "no such entry point in the loaded modules".into(),
        })
    }

    /// The bytes of `len` elements of `T` from the budget for `what`, kept
    /// by the buffer `alloc` makes (given back if it fails with the driver
    /// error of `call`).
    fn counted<T>(
        &self,
        what: &str,
        len: usize,
        call: &'static str,
        alloc: impl FnOnce() -> std::result::Result<CudaSlice<T>, cudarc::driver::DriverError>,
    ) -> Result<DeviceBuffer<T>> {
        let bytes = (len as u64).saturating_mul(std::mem::size_of::<T>() as u64);
        self.budget.take(what, bytes)?;
        match alloc() {
            Ok(slice) => Ok(DeviceBuffer {
                slice,
                bytes,
                budget: self.budget.clone(),
            }),
            Err(e) => {
                self.budget.give(bytes);
                Err(driver_err(call)(e))
            }
        }
    }

    /// `len` zeroed elements for `what`, on the compute stream.
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        what: &str,
        len: usize,
    ) -> Result<DeviceBuffer<T>> {
        self.counted(what, len, "cuMemAlloc", || {
            self.compute.alloc_zeros::<T>(len)
        })
    }

    /// `len` elements for `what` on the compute stream, **not zeroed**:
    /// for a kernel's or a GEMM's output that the next operation on that
    /// stream writes in full (every entry point writes every element of
    /// its outputs, which `examples/kernel_check` checks on poisoned
    /// buffers; cuBLAS does not read C when β is 0). Saves the memset pass
    /// [`Self::alloc_zeros`] makes: for the attention's [batch · heads,
    /// seq, seq] buffers, a write of hundreds of MB per block. Its values
    /// before that write are whatever the pool held: any bits, all valid
    /// for the [`crate::ops::Elem`] types.
    pub fn alloc_output<T: crate::ops::Elem>(
        &self,
        what: &str,
        len: usize,
    ) -> Result<DeviceBuffer<T>> {
        self.counted(what, len, "cuMemAlloc", || {
            // SAFETY: the memory is device memory, never read on the host
            // as `T` before a download, and every bit pattern is a valid
            // f32, bf16 or f16 (`Elem`'s types), so unset contents are
            // only unspecified values, never undefined behaviour. It is
            // allocated on the compute stream, so kernels there see it
            // allocated, and cudarc orders its uses on other streams.
            unsafe { self.compute.alloc::<T>(len) }
        })
    }

    /// [`Self::alloc_output`] on `stream` (a collective's own stream):
    /// for an output the next operation on that stream writes in full.
    pub(crate) fn alloc_output_on<T: crate::ops::Elem>(
        &self,
        stream: &Arc<CudaStream>,
        what: &str,
        len: usize,
    ) -> Result<DeviceBuffer<T>> {
        self.counted(what, len, "cuMemAlloc", || {
            // SAFETY: as in `alloc_output`: device memory whose every bit
            // pattern is a valid `T`, written in full on `stream` before
            // it is read, and cudarc orders its uses on other streams.
            unsafe { stream.alloc::<T>(len) }
        })
    }

    /// `len` elements for `what` allocated on the host-to-device stream,
    /// not initialised: only for a copy that overwrites all of them on
    /// that stream next ([`crate::link::Uploads::start`]).
    pub(crate) fn alloc_uninit_on_h2d<T: DeviceRepr>(
        &self,
        what: &str,
        len: usize,
    ) -> Result<DeviceBuffer<T>> {
        self.counted(what, len, "cuMemAlloc", || {
            // SAFETY: the memory is uninitialised; the caller's copy on
            // the same stream writes every element before any kernel
            // reads it (the compute stream waits on that copy's event),
            // and cudarc orders the slice's later uses on other streams
            // after it.
            unsafe { self.h2d.alloc::<T>(len) }
        })
    }

    /// A copy of `host` on the device, for `what` (queued on the compute
    /// stream: later kernels there see it).
    pub fn upload<T: DeviceRepr>(&self, what: &str, host: &[T]) -> Result<DeviceBuffer<T>> {
        self.counted(what, host.len(), "cuMemcpyHtoD", || {
            self.compute.clone_htod(host)
        })
    }

    /// Overwrites `dst` with `host` (same length), on the compute stream.
    pub fn write<T: DeviceRepr>(&self, dst: &mut DeviceBuffer<T>, host: &[T]) -> Result<()> {
        if host.len() != dst.len() {
            return Err(GpuError::Shape {
                kernel: "write".into(),
                detail: format!(
                    "{} host elements into a buffer of {}",
                    host.len(),
                    dst.len()
                ),
            });
        }
        self.compute
            .memcpy_htod(host, dst.slice_mut())
            .map_err(driver_err("cuMemcpyHtoD"))
    }

    /// Zeroes `buf` (queued on the compute stream).
    pub fn zero<T: DeviceRepr + ValidAsZeroBits>(&self, buf: &mut DeviceBuffer<T>) -> Result<()> {
        self.compute
            .memset_zeros(buf.slice_mut())
            .map_err(driver_err("cuMemsetD8Async"))
    }

    /// `buf`'s contents, after everything queued on the compute stream.
    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        buf: &DeviceBuffer<T>,
    ) -> Result<Vec<T>> {
        let out = self
            .compute
            .clone_dtoh(buf.slice())
            .map_err(driver_err("cuMemcpyDtoH"))?;
        self.compute
            .synchronize()
            .map_err(driver_err("cuStreamSynchronize"))?;
        Ok(out)
    }

    /// Waits for everything queued on the compute stream.
    pub fn synchronize(&self) -> Result<()> {
        self.compute
            .synchronize()
            .map_err(driver_err("cuStreamSynchronize"))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_budget_refuses_with_the_numbers_and_takes_back() {
        let b = Budget::new(1000);
        b.take("a", 600).unwrap_or_else(|e| panic!("{e}"));
        let e = b.take("params of unit 3", 500).unwrap_err().to_string();
        assert!(
            e.contains("params of unit 3: 500 bytes") && e.contains("600 of 1000"),
            "{e}"
        );
        b.give(600);
        assert_eq!(b.used_bytes(), 0);
        b.take("b", 1000).unwrap_or_else(|e| panic!("{e}"));
    }

    #[test]
    fn a_driver_older_than_cuda_13_is_refused_with_both_versions_and_the_fix() {
        for ok in [13_000, 13_010, 14_020] {
            check_driver_version(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for (old, text) in [(12_080, "12.8"), (12_040, "12.4"), (11_080, "11.8")] {
            let e = check_driver_version(old).unwrap_err();
            assert!(matches!(e, GpuError::DriverTooOld { .. }), "{e:?}");
            let m = e.to_string();
            assert!(
                m.contains(&format!("supports CUDA {text},")) && m.contains("CUDA 13.0"),
                "{m}"
            );
            assert!(m.contains("update the driver to R580"), "{m}");
        }
    }

    #[test]
    fn without_a_driver_open_names_the_library_and_the_fix() {
        // This test only means something where no driver is installed (CI,
        // the developers' machines); where one is, opening must work.
        match driver_available() {
            Err(e) => {
                let msg = e.to_string();
                assert!(
                    msg.contains("libcuda.so.1") && msg.contains("install the NVIDIA driver"),
                    "{msg}"
                );
                let e = Device::open(0, &DeviceOptions::default())
                    .unwrap_err()
                    .to_string();
                assert_eq!(e, msg);
            }
            Ok(()) => {
                Device::open(0, &DeviceOptions::default()).unwrap_or_else(|e| panic!("{e}"));
            }
        }
    }
}

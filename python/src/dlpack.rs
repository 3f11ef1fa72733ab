//! Host tensors through DLPack, without libtorch.
//!
//! A tensor crosses into Rust as the capsule its `__dlpack__()` returns: the
//! versioned `dltensor_versioned` (asked for with `max_version=(1, 0)`)
//! first, the legacy `dltensor` for producers that refuse the keyword. We
//! read the data pointer, device, dtype, shape and strides, check that the
//! tensor lives in host memory (`kDLCPU`, or `kDLCUDAHost`: pinned) and is
//! contiguous, and keep **both the tensor and the capsule** alive for as long
//! as Rust uses the memory.
//!
//! The capsule is never renamed to `used_dltensor`: we do not take the
//! managed tensor over, so when the last reference to the capsule goes, the
//! producer's own capsule destructor calls its deleter. That keeps the only
//! memory-ownership code on the producer's side.

use std::ffi::{c_void, CStr};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// `kDLCPU`.
pub const DEVICE_CPU: i32 = 1;
/// `kDLCUDA`.
pub const DEVICE_CUDA: i32 = 2;
/// `kDLCUDAHost`: page-locked host memory.
pub const DEVICE_CUDA_HOST: i32 = 3;
/// DLPack dtype of float32.
pub const DTYPE_F32: (u8, u8, u16) = (2, 32, 1);
/// DLPack dtype of bfloat16.
pub const DTYPE_BF16: (u8, u8, u16) = (4, 16, 1);
/// DLPack's float16: `(kDLFloat, 16, 1)`.
pub const DTYPE_F16: (u8, u8, u16) = (2, 16, 1);
/// `DLPACK_FLAG_BITMASK_READ_ONLY`.
const FLAG_READ_ONLY: u64 = 1;
/// `DLPACK_FLAG_BITMASK_IS_COPIED`: the producer exported a copy, so a
/// write through it would not reach the tensor.
const FLAG_IS_COPIED: u64 = 1 << 1;

#[repr(C)]
#[derive(Clone, Copy)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

#[repr(C)]
struct DlPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DlManagedTensorVersioned {
    version: DlPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DlTensor,
}

const NAME_VERSIONED: &CStr = c"dltensor_versioned";
const NAME_LEGACY: &CStr = c"dltensor";

/// A contiguous host tensor's bytes, and the Python objects that own them.
#[derive(Debug)]
pub struct HostTensor {
    /// First byte.
    pub addr: usize,
    /// `numel × itemsize`.
    pub nbytes: usize,
    /// The DLPack device type (1 CPU, 3 pinned).
    pub device_type: i32,
    /// Read-only per the producer's flags.
    pub read_only: bool,
    /// DLPack `(code, bits, lanes)`: `(2, 32, 1)` float32, `(4, 16, 1)`
    /// bfloat16.
    pub dtype: (u8, u8, u16),
    /// The tensor and its capsule: dropping them releases the memory.
    pub owners: (Py<PyAny>, Py<PyAny>),
}

/// The `(device_type, device_id)` of anything with `__dlpack_device__`.
pub fn device_of(obj: &Bound<'_, PyAny>) -> PyResult<(i32, i32)> {
    obj.call_method0("__dlpack_device__")?.extract()
}

/// Exports `obj` through DLPack and checks that it is a contiguous host tensor.
pub fn host_tensor(obj: &Bound<'_, PyAny>) -> PyResult<HostTensor> {
    let py = obj.py();
    if !obj.hasattr("__dlpack__")? {
        return Err(PyTypeError::new_err(format!(
            "expected a tensor supporting DLPack (__dlpack__), got {}",
            obj.get_type().name()?
        )));
    }
    let (dev, _) = device_of(obj)?;
    if dev != DEVICE_CPU && dev != DEVICE_CUDA_HOST {
        return Err(PyValueError::new_err(format!(
            "tensor is on DLPack device type {dev}, not host memory (CPU or pinned); copy it to the host first"
        )));
    }
    let kwargs = PyDict::new(py);
    kwargs.set_item("max_version", (1, 0))?;
    let capsule = match obj.call_method("__dlpack__", (), Some(&kwargs)) {
        Ok(c) => c,
        Err(e) if e.is_instance_of::<PyTypeError>(py) => obj.call_method0("__dlpack__")?,
        Err(e) => return Err(e),
    };
    let ptr = capsule.as_ptr();
    // SAFETY: `ptr` is a live object (held by `capsule`); PyCapsule_IsValid
    // accepts any object and only compares the name.
    let versioned = unsafe { pyo3::ffi::PyCapsule_IsValid(ptr, NAME_VERSIONED.as_ptr()) } == 1;
    // SAFETY: as above.
    let legacy = unsafe { pyo3::ffi::PyCapsule_IsValid(ptr, NAME_LEGACY.as_ptr()) } == 1;
    let (t, flags): (&DlTensor, u64) = if versioned {
        // SAFETY: the capsule is valid under this name; the DLPack standard
        // says its pointer is a DLManagedTensorVersioned that lives at least
        // as long as the (unconsumed) capsule, which we hold.
        let m = unsafe {
            &*(pyo3::ffi::PyCapsule_GetPointer(ptr, NAME_VERSIONED.as_ptr())
                as *const DlManagedTensorVersioned)
        };
        if m.version.major != 1 {
            return Err(PyValueError::new_err(format!(
                "DLPack version {}.{} is not supported (want 1.x)",
                m.version.major, m.version.minor
            )));
        }
        (&m.dl_tensor, m.flags)
    } else if legacy {
        // SAFETY: as above, for the legacy DLManagedTensor layout.
        let m = unsafe {
            &*(pyo3::ffi::PyCapsule_GetPointer(ptr, NAME_LEGACY.as_ptr()) as *const DlManagedTensor)
        };
        (&m.dl_tensor, 0)
    } else {
        return Err(PyTypeError::new_err(
            "__dlpack__() did not return a DLPack capsule (dltensor_versioned or dltensor)",
        ));
    };
    let ndim = usize::try_from(t.ndim).map_err(|_| PyValueError::new_err("negative ndim"))?;
    let shape: &[i64] = if ndim == 0 {
        &[]
    } else {
        // SAFETY: DLPack: `shape` points at `ndim` int64s owned by the
        // managed tensor (alive with the capsule).
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }
    };
    let strides: Option<&[i64]> = if t.strides.is_null() || ndim == 0 {
        None
    } else {
        // SAFETY: as for `shape`; a non-null `strides` has `ndim` entries.
        Some(unsafe { std::slice::from_raw_parts(t.strides, ndim) })
    };
    let mut numel: u64 = 1;
    for &d in shape {
        numel = numel
            .checked_mul(u64::try_from(d).map_err(|_| PyValueError::new_err("negative dimension"))?)
            .ok_or_else(|| PyValueError::new_err("tensor size overflows"))?;
    }
    if let Some(strides) = strides {
        let mut expect: i64 = 1;
        for (&d, &s) in shape.iter().zip(strides).rev() {
            if d > 1 && s != expect {
                return Err(PyValueError::new_err(format!(
                    "tensor is not contiguous (shape {shape:?}, strides {strides:?}); call .contiguous() first"
                )));
            }
            expect = expect.saturating_mul(d.max(1));
        }
    }
    let bits = u64::from(t.dtype.bits) * u64::from(t.dtype.lanes);
    if bits % 8 != 0 {
        return Err(PyValueError::new_err(format!(
            "dtype of {bits} bits per element is not a whole number of bytes"
        )));
    }
    // The capsule's own device, not only `__dlpack_device__`'s answer
    // (a producer may differ between the two).
    if t.device.device_type != DEVICE_CPU && t.device.device_type != DEVICE_CUDA_HOST {
        return Err(PyValueError::new_err(format!(
            "the tensor's DLPack export is on device type {}, not host memory (CPU or pinned); \
             copy it to the host first",
            t.device.device_type
        )));
    }
    let nbytes = numel
        .checked_mul(bits / 8)
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| PyValueError::new_err("tensor size overflows"))?;
    let addr = (t.data as usize)
        .checked_add(t.byte_offset as usize)
        .ok_or_else(|| PyValueError::new_err("bad data pointer"))?;
    Ok(HostTensor {
        addr,
        nbytes,
        device_type: t.device.device_type,
        // A copy is as good as read-only: what is written into it is lost.
        read_only: flags & (FLAG_READ_ONLY | FLAG_IS_COPIED) != 0,
        dtype: (t.dtype.code, t.dtype.bits, t.dtype.lanes),
        owners: (obj.clone().unbind(), capsule.unbind()),
    })
}

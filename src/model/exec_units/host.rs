//! A host tensor's elements as they cross to an executor and back:
//! fp32 in place, bf16 as its 2-byte elements ([`HostElems`]), and what
//! a download brings back ([`HostVec`]).

use candle_core::{DType, Device, Tensor};

use super::{tensor_as, F32_BYTES};
use crate::model::ModelError;

pub(super) fn host_f32(t: &Tensor) -> Result<Vec<f32>, ModelError> {
    with_host_f32(t, |v| Ok(v.to_vec()))
}

/// Runs `f` on a host tensor's elements as fp32: an fp32 one in place (a
/// contiguous one is not copied), a bf16 or fp16 one widened (exactly)
/// into a copy. The units compute in fp32 on the device, so a 16-bit
/// param or hidden state crosses as its fp32 value.
pub(super) fn with_host_f32<R>(
    t: &Tensor,
    f: impl FnOnce(&[f32]) -> Result<R, ModelError>,
) -> Result<R, ModelError> {
    match t.dtype() {
        DType::F32 => crate::model::fused::with_f32(t, |v| Ok(f(v)))?,
        DType::BF16 | DType::F16 => {
            let wide = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            f(&wide)
        }
        other => Err(ModelError::Unsupported {
            what: format!(
                "{other:?} params or activations on the CUDA units (they store fp32, bf16 or fp16)"
            ),
        }),
    }
}

/// A host tensor's elements as a device tier uploads them: fp32, or bf16
/// or fp16 as they are (2 bytes each: a param stays so on the device, an
/// input is widened there).
#[derive(Debug, Clone, Copy)]
pub enum HostElems<'a> {
    /// fp32 elements.
    F32(&'a [f32]),
    /// bf16 elements.
    Bf16(&'a [half::bf16]),
    /// fp16 elements.
    F16(&'a [half::f16]),
}

impl HostElems<'_> {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            HostElems::F32(v) => v.len(),
            HostElems::Bf16(v) => v.len(),
            HostElems::F16(v) => v.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type they cross as.
    pub fn wire(&self) -> tierzero_gpu::link::Wire {
        use tierzero_gpu::link::Wire;
        match self {
            HostElems::F32(_) => Wire::F32,
            HostElems::Bf16(_) => Wire::Bf16,
            HostElems::F16(_) => Wire::F16,
        }
    }

    /// Bytes on the host (what the copy moves).
    pub fn bytes(&self) -> u64 {
        match self {
            HostElems::F32(v) => std::mem::size_of_val(*v) as u64,
            HostElems::Bf16(v) => std::mem::size_of_val(*v) as u64,
            HostElems::F16(v) => std::mem::size_of_val(*v) as u64,
        }
    }
}

/// Elements a device tier downloaded: fp32, or bf16 or fp16 rounded on
/// the device (to nearest even, fp16 overflowing to infinity, as candle's
/// `to_dtype` rounds on the host). Also a stepped sub-group's new param
/// values in their storage dtype
/// ([`crate::engine::optimizer::worker::StepValues`]).
#[derive(Debug, Clone, PartialEq)]
pub enum HostVec {
    /// fp32 elements.
    F32(Vec<f32>),
    /// bf16 elements.
    Bf16(Vec<half::bf16>),
    /// fp16 elements.
    F16(Vec<half::f16>),
}

impl HostVec {
    /// Its elements as an upload takes them.
    pub fn elems(&self) -> HostElems<'_> {
        match self {
            HostVec::F32(v) => HostElems::F32(v),
            HostVec::Bf16(v) => HostElems::Bf16(v),
            HostVec::F16(v) => HostElems::F16(v),
        }
    }

    /// Bytes that crossed.
    pub fn bytes(&self) -> u64 {
        match self {
            HostVec::F32(v) => std::mem::size_of_val(v.as_slice()) as u64,
            HostVec::Bf16(v) => std::mem::size_of_val(v.as_slice()) as u64,
            HostVec::F16(v) => std::mem::size_of_val(v.as_slice()) as u64,
        }
    }

    /// A host tensor of `dims` in `dtype` (fp32 elements rounded once if
    /// `dtype` is narrower; 16-bit ones taken as they are, or converted).
    pub fn into_tensor(self, dims: &[usize], dtype: DType) -> Result<Tensor, ModelError> {
        let t = match self {
            HostVec::F32(v) => return tensor_as(v, dims, dtype),
            HostVec::Bf16(v) => Tensor::from_vec(v, dims, &Device::Cpu)?,
            HostVec::F16(v) => Tensor::from_vec(v, dims, &Device::Cpu)?,
        };
        Ok(if t.dtype() == dtype {
            t
        } else {
            t.to_dtype(dtype)?
        })
    }
}

/// Bytes an upload of `t` moves: bf16 crosses as it is, every other dtype
/// as fp32 (what [`with_host_elems`] hands the link).
pub(crate) fn host_elems_bytes(t: &Tensor) -> u64 {
    t.elem_count() as u64 * elem_bytes_crossing(t.dtype())
}

/// Bytes of an element of a host tensor of `dtype` as it crosses to a
/// device ([`with_host_elems`]): bf16 and fp16 as they are, anything else
/// as fp32.
pub(crate) fn elem_bytes_crossing(dtype: DType) -> u64 {
    match dtype {
        DType::BF16 | DType::F16 => 2,
        _ => F32_BYTES,
    }
}

/// Runs `f` on a host tensor's elements as they are stored (fp32, bf16 or
/// fp16, a contiguous one not copied), for an upload that crosses in that
/// type ([`host_elems_bytes`] of them).
pub(crate) fn with_host_elems<R>(
    t: &Tensor,
    f: impl FnOnce(HostElems<'_>) -> Result<R, ModelError>,
) -> Result<R, ModelError> {
    match t.dtype() {
        DType::BF16 => crate::model::fused::with_bf16(t, |v| Ok(f(HostElems::Bf16(v))))?,
        DType::F16 => crate::model::fused::with_f16(t, |v| Ok(f(HostElems::F16(v))))?,
        _ => with_host_f32(t, |v| f(HostElems::F32(v))),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failure is a panic

    use super::*;

    #[test]
    fn bf16_elements_cross_as_they_are_and_come_back_as_the_host_rounds() {
        let v: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 0.1234567).collect();
        let t = Tensor::from_vec(v.clone(), 37, &Device::Cpu).unwrap();
        let b = t.to_dtype(DType::BF16).unwrap();
        // An fp32 tensor crosses as fp32, a bf16 one as its 2-byte bits.
        with_host_elems(&t, |h| {
            assert!(matches!(h, HostElems::F32(_)));
            assert_eq!(h.bytes(), 37 * 4);
            Ok(())
        })
        .unwrap();
        let want: Vec<half::bf16> = b.to_vec1().unwrap();
        with_host_elems(&b, |h| {
            match h {
                HostElems::Bf16(x) => assert_eq!(x, want.as_slice()),
                other => panic!("bf16 crossed as {other:?}"),
            }
            assert_eq!(h.bytes(), 37 * 2);
            Ok(())
        })
        .unwrap();
        // An fp16 one as its 2-byte bits too.
        let h16 = t.to_dtype(DType::F16).unwrap();
        let want16: Vec<half::f16> = h16.to_vec1().unwrap();
        with_host_elems(&h16, |h| {
            match h {
                HostElems::F16(x) => assert_eq!(x, want16.as_slice()),
                other => panic!("fp16 crossed as {other:?}"),
            }
            assert_eq!(h.bytes(), 37 * 2);
            Ok(())
        })
        .unwrap();
        assert_eq!(host_elems_bytes(&h16), 37 * 2);
        // Rounded on the device (from_f32) is what to_dtype gives.
        let narrowed = HostVec::Bf16(v.iter().map(|&x| half::bf16::from_f32(x)).collect());
        assert_eq!(narrowed.bytes(), 37 * 2);
        let got: Vec<half::bf16> = narrowed
            .into_tensor(&[37], DType::BF16)
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(got, want);
        let wide: Vec<half::bf16> = HostVec::F32(v)
            .into_tensor(&[37], DType::BF16)
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(wide, want);
    }
}

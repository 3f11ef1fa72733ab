//! Param bytes to and from CPU tensors: [`cpu_tensor`], the one place a
//! param tensor is built from its stored bytes, and [`tensor_bytes`].

use candle_core::{DType, Device, Tensor};

use crate::engine::{EngineError, Result};

/// A CPU tensor of `shape` from the first `numel × dtype size` bytes of
/// `bytes` (`Tensor::from_raw_buffer`). Every param tensor is built from its
/// stored bytes here, whichever thread builds it (the store, the param copy
/// thread, the optimizer thread), so they all give the same bits.
///
/// A long one (at least `tierzero_gpu::host_copy::PARALLEL_MIN_BYTES`)
/// whose bytes are aligned for its elements (swap buffers and the cpu
/// tier's homes are) is copied over several threads
/// (`tierzero_gpu::host_copy`): one core's copy, about 9 GB/s here, is the
/// whole cost of a cpu-tier fetch, on the engine thread's path. The
/// elements are the same either way: both copy the native-endian bytes.
pub fn cpu_tensor(bytes: &[u8], dtype: DType, shape: &[usize]) -> Result<Tensor> {
    use tierzero_gpu::host_copy;
    let need = shape.iter().product::<usize>() * dtype.size_in_bytes();
    let src = bytes.get(..need).ok_or_else(|| {
        EngineError::internal(format!(
            "{} bytes for a tensor of {need} bytes ({shape:?} {dtype:?})",
            bytes.len()
        ))
    })?;
    if need >= host_copy::PARALLEL_MIN_BYTES {
        fn split<T: bytemuck::Pod + Send + Sync + candle_core::WithDType>(
            src: &[u8],
            shape: &[usize],
        ) -> Option<candle_core::Result<Tensor>> {
            let elems = bytemuck::try_cast_slice::<u8, T>(src).ok()?;
            Some(Tensor::from_vec(
                host_copy::to_vec(elems),
                shape,
                &Device::Cpu,
            ))
        }
        let t = match dtype {
            DType::F32 => split::<f32>(src, shape),
            DType::BF16 => split::<half::bf16>(src, shape),
            DType::F16 => split::<half::f16>(src, shape),
            _ => None,
        };
        if let Some(t) = t {
            return Ok(t?);
        }
    }
    Ok(Tensor::from_raw_buffer(src, dtype, shape, &Device::Cpu)?)
}

/// Little-endian bytes of a tensor (bf16/f16/f32), in row-major order.
pub fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let flat = t.flatten_all()?.to_device(&Device::Cpu)?;
    // One copy of the elements' memory on a little-endian host
    // (`crate::le::bytes`), not a byte vector built element by element.
    Ok(match flat.dtype() {
        DType::F32 => crate::le::bytes(&flat.to_vec1::<f32>()?).into_owned(),
        DType::BF16 => crate::le::bytes(&flat.to_vec1::<half::bf16>()?).into_owned(),
        DType::F16 => crate::le::bytes(&flat.to_vec1::<half::f16>()?).into_owned(),
        other => {
            return Err(EngineError::internal(format!(
                "tensor_bytes of dtype {other:?}"
            )))
        }
    })
}

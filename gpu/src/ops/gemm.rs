//! The GEMMs: cuBLAS's strided batched products, fp32 and 16-bit operands
//! with fp32 accumulation (see the [`super`] docs: every length checked
//! before the call).

use super::*;

/// A batched row-major matrix product `C = α·op(A)·op(B) + β·C`: `op(A)`
/// is [m, k] (A stored [k, m] when `trans_a`), `op(B)` [k, n], C [m, n],
/// `batch` of each, contiguous.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatmulShape {
    /// Matrices per operand.
    pub batch: usize,
    /// Rows of C.
    pub m: usize,
    /// Columns of C.
    pub n: usize,
    /// The contracted dimension.
    pub k: usize,
    /// A is stored transposed.
    pub trans_a: bool,
    /// B is stored transposed.
    pub trans_b: bool,
}

/// [`MatmulShape`]'s product by cuBLAS on the compute stream (fp32
/// accumulation; 16-bit storage through `cublasGemmStridedBatchedEx`).
pub fn matmul<T: Elem>(
    dev: &Device,
    c: &mut DeviceBuffer<T>,
    a: &DeviceBuffer<T>,
    b: &DeviceBuffer<T>,
    s: MatmulShape,
    alpha: f32,
    beta: f32,
) -> Result<()>
where
    cudarc::cublas::CudaBlas: cudarc::cublas::Gemm<T>,
{
    use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
    use cudarc::cublas::{Gemm, GemmConfig, StridedBatchedConfig};
    let kname = format!("matmul_{}", T::SUFFIX);
    let (mk, kn, mn) = (
        product(&kname, s.m, s.k)?,
        product(&kname, s.k, s.n)?,
        product(&kname, s.m, s.n)?,
    );
    need(&kname, "A", a.len(), product(&kname, s.batch, mk)?)?;
    need(&kname, "B", b.len(), product(&kname, s.batch, kn)?)?;
    need(&kname, "C", c.len(), product(&kname, s.batch, mn)?)?;
    let i = |what: &str, v: usize| int(&kname, what, v);
    // cuBLAS takes α and β in T for T's own GEMM: refuse what T would
    // round rather than compute with another value.
    for (what, x) in [("alpha", alpha), ("beta", beta)] {
        if T::store(x).load() != x {
            return Err(shape_err(
                &kname,
                format!("{what} = {x} is not exact in {}", T::SUFFIX),
            ));
        }
    }
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T.
    let cfg = StridedBatchedConfig {
        gemm: GemmConfig {
            transa: if s.trans_b { CUBLAS_OP_T } else { CUBLAS_OP_N },
            transb: if s.trans_a { CUBLAS_OP_T } else { CUBLAS_OP_N },
            m: i("n", s.n)?,
            n: i("m", s.m)?,
            k: i("k", s.k)?,
            alpha: T::store(alpha),
            lda: i("ldb", ld(if s.trans_b { s.k } else { s.n }))?,
            ldb: i("lda", ld(if s.trans_a { s.m } else { s.k }))?,
            beta: T::store(beta),
            ldc: i("n", ld(s.n))?,
        },
        batch_size: i("batch", s.batch)?,
        stride_a: kn as i64,
        stride_b: mk as i64,
        stride_c: mn as i64,
    };
    // SAFETY: every operand holds `batch` matrices of its shape (checked
    // above), so cuBLAS reads and writes only inside them; all three live
    // on this device and the handle runs on its compute stream.
    unsafe {
        dev.blas()
            .gemm_strided_batched(cfg, b.slice(), a.slice(), c.slice_mut())
    }
    .map_err(|e| GpuError::Blas {
        call: "cublasGemmStridedBatched",
        detail: format!("{kname} {s:?}: {e}"),
    })
}

/// A leading dimension: cuBLAS wants at least 1 even for an empty
/// matrix (a GEMM with k = 0 is C = βC, with m or n = 0 nothing).
fn ld(rows: usize) -> usize {
    rows.max(1)
}

/// A 16-bit GEMM operand type: its cuBLAS data type and its name in
/// errors.
pub trait Half16: Elem {
    /// `CUDA_R_16BF` or `CUDA_R_16F`.
    const CUDA: cudarc::cublas::sys::cudaDataType_t;
    /// `matmul_bf16_f32` or `matmul_f16_f32`.
    const KERNEL: &'static str;
}

impl Half16 for bf16 {
    const CUDA: cudarc::cublas::sys::cudaDataType_t =
        cudarc::cublas::sys::cudaDataType_t::CUDA_R_16BF;
    const KERNEL: &'static str = "matmul_bf16_f32";
}

impl Half16 for f16 {
    const CUDA: cudarc::cublas::sys::cudaDataType_t =
        cudarc::cublas::sys::cudaDataType_t::CUDA_R_16F;
    const KERNEL: &'static str = "matmul_f16_f32";
}

/// [`matmul`] with 16-bit operands (bf16, or fp16 under `fp16.enabled`)
/// and an fp32 result (`C = α·op(A)·op(B) + β·C`, fp32 accumulation):
/// autocast's GEMM, whose output stays fp32. Products of two 16-bit
/// values are exact in fp32, as the host reference assumes.
pub fn matmul_16_f32<T: Half16>(
    dev: &Device,
    c: &mut DeviceBuffer<f32>,
    a: &DeviceBuffer<T>,
    b: &DeviceBuffer<T>,
    s: MatmulShape,
    alpha: f32,
    beta: f32,
) -> Result<()> {
    use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
    use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cudaDataType_t};
    use cudarc::driver::{DevicePtr, DevicePtrMut};
    let kname = T::KERNEL;
    let (mk, kn, mn) = (
        product(kname, s.m, s.k)?,
        product(kname, s.k, s.n)?,
        product(kname, s.m, s.n)?,
    );
    need(kname, "A", a.len(), product(kname, s.batch, mk)?)?;
    need(kname, "B", b.len(), product(kname, s.batch, kn)?)?;
    need(kname, "C", c.len(), product(kname, s.batch, mn)?)?;
    let i = |what: &str, v: usize| int(kname, what, v);
    let (m, n, k) = (i("n", s.n)?, i("m", s.m)?, i("k", s.k)?);
    let lda = i("ldb", ld(if s.trans_b { s.k } else { s.n }))?;
    let ldb = i("lda", ld(if s.trans_a { s.m } else { s.k }))?;
    let ldc = i("n", ld(s.n))?;
    let batch = i("batch", s.batch)?;
    let stream = &dev.compute;
    let (pa, _ga) = b.slice().device_ptr(stream);
    let (pb, _gb) = a.slice().device_ptr(stream);
    let (pc, _gc) = c.slice_mut().device_ptr_mut(stream);
    // SAFETY: every operand holds `batch` matrices of its shape (checked
    // above), the pointers are live device allocations of this context
    // held by the guards for the call, the scalars are host f32s (the
    // handle's default pointer mode), and the handle runs on the compute
    // stream the guards record on. Row-major C = op(A) op(B) is
    // column-major Cᵀ = op(B)ᵀ op(A)ᵀ, as in `matmul`.
    unsafe {
        cudarc::cublas::result::gemm_strided_batched_ex(
            *dev.blas().handle(),
            if s.trans_b { CUBLAS_OP_T } else { CUBLAS_OP_N },
            if s.trans_a { CUBLAS_OP_T } else { CUBLAS_OP_N },
            m,
            n,
            k,
            (&alpha) as *const f32 as *const _,
            pa as *const _,
            T::CUDA,
            lda,
            kn as i64,
            pb as *const _,
            T::CUDA,
            ldb,
            mk as i64,
            (&beta) as *const f32 as *const _,
            pc as *mut _,
            cudaDataType_t::CUDA_R_32F,
            ldc,
            mn as i64,
            batch,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| GpuError::Blas {
        call: "cublasGemmStridedBatchedEx",
        detail: format!("{kname} {s:?}: {e}"),
    })
}

// The optimizer's kernels.
//
// sumsq_parts: the clipping norm's parts in the host optimizer's order
// (src/norm.rs): 8 lanes per part, 4 parts per warp; lane j adds in f64
// with fma the squares of its part's elements j, j + 8, ... in order,
// then the part's lanes are added by an xor butterfly over them, 1, 2,
// then 4: ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)). Part p is flat
// elements parts[4p] .. parts[4p + 1] of its group, held by the segments
// parts[4p + 2] .. parts[4p + 3]; segment s is segs[3s + 1] f32 elements
// at address segs[3s], flat elements segs[3s + 2] .. of the group. An
// element no segment holds is a zero, which adds nothing.
//
// adamw: one element per thread, the arithmetic of the CPU kernel
// (src/optim/scalar.rs `update`) with the same fused multiply-adds and no
// others (kernels compile with --fmad=false), on the host's f32 constants,
// so it gives the CPU's bits. `out` (nullable) gets the new param rounded
// to T.

extern "C" __global__ void sumsq_parts(double* out, const long long* parts, long long n_parts,
                                       const long long* segs) {
    const long long thread = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = ((long long)gridDim.x * blockDim.x) >> 3;
    const int lane = threadIdx.x & 7;
    // Every thread of a warp takes as many turns (the butterfly needs all
    // 32): a part index past the end adds nothing.
    for (long long base = (thread >> 5) << 2; base < n_parts; base += stride) {
        const long long p = base + ((threadIdx.x & 31) >> 3);
        double acc = 0.0;
        if (p < n_parts) {
            const long long end = parts[4 * p + 1];
            long long s = parts[4 * p + 2];
            const long long s_end = parts[4 * p + 3];
            const float* x = nullptr;
            long long lo = 0, hi = 0;
            if (s < s_end) {
                x = (const float*)(unsigned long long)segs[3 * s];
                lo = segs[3 * s + 2];
                hi = lo + segs[3 * s + 1];
            }
            for (long long f = parts[4 * p] + lane; f < end && s < s_end; f += 8) {
                while (f >= hi) {
                    if (++s == s_end) break;
                    x = (const float*)(unsigned long long)segs[3 * s];
                    lo = segs[3 * s + 2];
                    hi = lo + segs[3 * s + 1];
                }
                if (s < s_end && f >= lo) {
                    const double v = (double)x[f - lo];
                    acc = fma(v, v, acc);
                }
            }
        }
        for (int o = 1; o < 8; o <<= 1) acc += __shfl_xor_sync(TZ_FULL_MASK, acc, o);
        if (p < n_parts && lane == 0) out[p] = acc;
    }
}

template <typename T>
__device__ void adamw(float* master, float* m, float* v, const float* grad, T* out, long long n,
                      float grad_scale, float beta1, float one_minus_beta1, float beta2,
                      float one_minus_beta2, float eps, float neg_step_size, float inv_sqrt_bc2,
                      float neg_lr_wd) {
    TZ_FOR_EACH(i, n) {
        const float g = grad[i] * grad_scale;
        const float m2 = fmaf(beta1, m[i], one_minus_beta1 * g);
        const float v2 = fmaf(beta2, v[i], (one_minus_beta2 * g) * g);
        const float den = fmaf(sqrtf(v2), inv_sqrt_bc2, eps);
        const float upd = m2 / den;
        const float p = master[i];
        const float p2 = fmaf(neg_step_size, upd, fmaf(neg_lr_wd, p, p));
        master[i] = p2;
        m[i] = m2;
        v[i] = v2;
        if (out) tz_store(&out[i], p2);
    }
}

#define TZ_OPTIM(SUF, T)                                                                         \
    extern "C" __global__ void adamw_##SUF(float* master, float* m, float* v, const float* grad, \
                                           T* out, long long n, float grad_scale, float beta1,   \
                                           float one_minus_beta1, float beta2,                   \
                                           float one_minus_beta2, float eps, float neg_step_size, \
                                           float inv_sqrt_bc2, float neg_lr_wd) {                \
        adamw<T>(master, m, v, grad, out, n, grad_scale, beta1, one_minus_beta1, beta2,           \
                 one_minus_beta2, eps, neg_step_size, inv_sqrt_bc2, neg_lr_wd);                  \
    }
TZ_DTYPES(TZ_OPTIM)

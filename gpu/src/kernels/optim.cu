// The optimizer's kernels.
//
// sumsq_groups: per sub-group g, out[g] = the sum of x^2 over elements
// offsets[g] .. offsets[g + 1] (one block per group, tz_block_sum), for the
// clipping norm: the host adds the groups' sums in order.
//
// adamw: one element per thread, the arithmetic of the CPU kernel
// (src/optim/scalar.rs `update`) with the same fused multiply-adds and no
// others (kernels compile with --fmad=false), on the host's f32 constants,
// so it gives the CPU's bits. `out` (nullable) gets the new param rounded
// to T.

template <typename T>
__device__ void sumsq_groups(float* out, const T* x, const long long* offsets) {
    __shared__ float shm[32];
    const int g = blockIdx.x;
    float s = 0.0f;
    for (long long i = offsets[g] + threadIdx.x; i < offsets[g + 1]; i += blockDim.x) {
        const float v = tz_load(&x[i]);
        s += v * v;
    }
    s = tz_block_sum(s, shm);
    if (threadIdx.x == 0) out[g] = s;
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
    extern "C" __global__ void sumsq_groups_##SUF(float* out, const T* x,                        \
                                                  const long long* offsets) {                    \
        sumsq_groups<T>(out, x, offsets);                                                        \
    }                                                                                            \
    extern "C" __global__ void adamw_##SUF(float* master, float* m, float* v, const float* grad, \
                                           T* out, long long n, float grad_scale, float beta1,   \
                                           float one_minus_beta1, float beta2,                   \
                                           float one_minus_beta2, float eps, float neg_step_size, \
                                           float inv_sqrt_bc2, float neg_lr_wd) {                \
        adamw<T>(master, m, v, grad, out, n, grad_scale, beta1, one_minus_beta1, beta2,           \
                 one_minus_beta2, eps, neg_step_size, inv_sqrt_bc2, neg_lr_wd);                  \
    }
TZ_DTYPES(TZ_OPTIM)

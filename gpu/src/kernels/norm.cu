// LayerNorm and RMSNorm over the last axis: one block of TZ_BLOCK threads
// per row (gridDim.x = rows), statistics in fp32 through tz_block_sum.
// Thread j takes columns j, j + TZ_BLOCK, ... in order. Forward keeps each
// row's mean and 1/std (fp32) for backward. The weight (and bias)
// gradients are column sums over rows in two passes (prelude.cu, "Column
// sums"): `*_bwd_w*` write each chunk's sums, col_sums_finish (bias.cu)
// adds them into the fp32 gradients (+=).

template <typename T>
__device__ void layernorm_fwd(T* y, float* mean, float* rstd, const T* x, const T* w,
                              const T* b, int cols, float eps) {
    __shared__ float shm[32];
    const long long row = blockIdx.x;
    const T* xr = x + row * cols;
    T* yr = y + row * cols;
    float s = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) s += tz_load(&xr[c]);
    const float mu = tz_block_sum(s, shm) / (float)cols;
    float q = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float d = tz_load(&xr[c]) - mu;
        q += d * d;
    }
    const float r = 1.0f / sqrtf(tz_block_sum(q, shm) / (float)cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float bias = b ? tz_load(&b[c]) : 0.0f;
        tz_store(&yr[c], (tz_load(&xr[c]) - mu) * r * tz_load(&w[c]) + bias);
    }
    if (threadIdx.x == 0) {
        mean[row] = mu;
        rstd[row] = r;
    }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w.
template <typename T>
__device__ void layernorm_bwd_dx(T* dx, const T* dy, const T* x, const T* w, const float* mean,
                                 const float* rstd, int cols) {
    __shared__ float shm[32];
    const long long row = blockIdx.x;
    const T* xr = x + row * cols;
    const T* dyr = dy + row * cols;
    const float mu = mean[row], r = rstd[row];
    float sg = 0.0f, sgx = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float g = tz_load(&dyr[c]) * tz_load(&w[c]);
        sg += g;
        sgx += g * ((tz_load(&xr[c]) - mu) * r);
    }
    const float mg = tz_block_sum(sg, shm) / (float)cols;
    const float mgx = tz_block_sum(sgx, shm) / (float)cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float g = tz_load(&dyr[c]) * tz_load(&w[c]);
        const float xhat = (tz_load(&xr[c]) - mu) * r;
        tz_store(&dx[row * cols + c], r * (g - mg - xhat * mgx));
    }
}

// Chunk k's sums of dy * xhat into part_w[k * cols + c] and of dy into
// part_b (part_b may be null).
template <typename T>
__device__ void layernorm_bwd_wb(float* part_w, float* part_b, const T* dy, const T* x,
                                 const float* mean, const float* rstd, long long rows, int cols,
                                 int chunk_rows) {
    const long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    TZ_FOR_EACH_CHUNK(k, r0, r1, rows, chunk_rows) {
        float sw = 0.0f, sb = 0.0f;
        for (long long row = r0; row < r1; ++row) {
            const float g = tz_load(&dy[row * cols + c]);
            sw += g * ((tz_load(&x[row * cols + c]) - mean[row]) * rstd[row]);
            sb += g;
        }
        part_w[k * cols + c] = sw;
        if (part_b) part_b[k * cols + c] = sb;
    }
}

template <typename T>
__device__ void rmsnorm_fwd(T* y, float* rstd, const T* x, const T* w, int cols, float eps) {
    __shared__ float shm[32];
    const long long row = blockIdx.x;
    const T* xr = x + row * cols;
    float q = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = tz_load(&xr[c]);
        q += v * v;
    }
    const float r = 1.0f / sqrtf(tz_block_sum(q, shm) / (float)cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        tz_store(&y[row * cols + c], tz_load(&xr[c]) * r * tz_load(&w[c]));
    }
    if (threadIdx.x == 0) rstd[row] = r;
}

// dx = rstd * (g - xhat * mean(g * xhat)), g = dy * w, xhat = x * rstd.
template <typename T>
__device__ void rmsnorm_bwd_dx(T* dx, const T* dy, const T* x, const T* w, const float* rstd,
                               int cols) {
    __shared__ float shm[32];
    const long long row = blockIdx.x;
    const T* xr = x + row * cols;
    const T* dyr = dy + row * cols;
    const float r = rstd[row];
    float sgx = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        sgx += tz_load(&dyr[c]) * tz_load(&w[c]) * (tz_load(&xr[c]) * r);
    }
    const float mgx = tz_block_sum(sgx, shm) / (float)cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float g = tz_load(&dyr[c]) * tz_load(&w[c]);
        tz_store(&dx[row * cols + c], r * (g - (tz_load(&xr[c]) * r) * mgx));
    }
}

// Chunk k's sums of dy * xhat into part_w[k * cols + c].
template <typename T>
__device__ void rmsnorm_bwd_w(float* part_w, const T* dy, const T* x, const float* rstd,
                              long long rows, int cols, int chunk_rows) {
    const long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    TZ_FOR_EACH_CHUNK(k, r0, r1, rows, chunk_rows) {
        float sw = 0.0f;
        for (long long row = r0; row < r1; ++row) {
            sw += tz_load(&dy[row * cols + c]) * (tz_load(&x[row * cols + c]) * rstd[row]);
        }
        part_w[k * cols + c] = sw;
    }
}

#define TZ_NORM(SUF, T)                                                                          \
    extern "C" __global__ void layernorm_fwd_##SUF(T* y, float* mean, float* rstd, const T* x,    \
                                                   const T* w, const T* b, int cols, float eps) { \
        layernorm_fwd<T>(y, mean, rstd, x, w, b, cols, eps);                                      \
    }                                                                                            \
    extern "C" __global__ void layernorm_bwd_dx_##SUF(T* dx, const T* dy, const T* x, const T* w, \
                                                      const float* mean, const float* rstd,       \
                                                      int cols) {                                 \
        layernorm_bwd_dx<T>(dx, dy, x, w, mean, rstd, cols);                                      \
    }                                                                                            \
    extern "C" __global__ void layernorm_bwd_wb_##SUF(float* part_w, float* part_b, const T* dy,  \
                                                      const T* x, const float* mean,              \
                                                      const float* rstd, long long rows, int cols, \
                                                      int chunk_rows) {                           \
        layernorm_bwd_wb<T>(part_w, part_b, dy, x, mean, rstd, rows, cols, chunk_rows);           \
    }                                                                                            \
    extern "C" __global__ void rmsnorm_fwd_##SUF(T* y, float* rstd, const T* x, const T* w,       \
                                                 int cols, float eps) {                           \
        rmsnorm_fwd<T>(y, rstd, x, w, cols, eps);                                                 \
    }                                                                                            \
    extern "C" __global__ void rmsnorm_bwd_dx_##SUF(T* dx, const T* dy, const T* x, const T* w,   \
                                                    const float* rstd, int cols) {                \
        rmsnorm_bwd_dx<T>(dx, dy, x, w, rstd, cols);                                              \
    }                                                                                            \
    extern "C" __global__ void rmsnorm_bwd_w_##SUF(float* part_w, const T* dy, const T* x,        \
                                                   const float* rstd, long long rows, int cols,   \
                                                   int chunk_rows) {                              \
        rmsnorm_bwd_w<T>(part_w, dy, x, rstd, rows, cols, chunk_rows);                            \
    }
TZ_DTYPES(TZ_NORM)

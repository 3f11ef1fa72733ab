// Bias add (in place, y[r, c] += b[c], in fp32 then stored in T) and the
// bias gradient db[c] += sum over rows of dy[r, c], a column sum in two
// passes (prelude.cu, "Column sums"): bias_grad writes the chunk sums,
// col_sums_finish adds them into db.

template <typename T>
__device__ void bias_add(T* y, const T* b, long long rows, int cols) {
    TZ_FOR_EACH(i, rows * cols) tz_store(&y[i], tz_load(&y[i]) + tz_load(&b[i % cols]));
}

// part[k * cols + c] = the sum of dy[r, c] over chunk k's rows, in order.
template <typename T>
__device__ void bias_grad(float* part, const T* dy, long long rows, int cols, int chunk_rows) {
    const long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    TZ_FOR_EACH_CHUNK(k, r0, r1, rows, chunk_rows) {
        float s = 0.0f;
        for (long long r = r0; r < r1; ++r) s += tz_load(&dy[r * cols + c]);
        part[k * cols + c] = s;
    }
}

// acc[c] += part[0, c] + part[1, c] + ... + part[chunks - 1, c], added
// left to right (chunks >= 1; the host launches nothing for no rows).
extern "C" __global__ void col_sums_finish(float* acc, const float* part, long long chunks,
                                           int cols) {
    TZ_FOR_EACH(c, cols) {
        float s = part[c];
        for (long long k = 1; k < chunks; ++k) s += part[k * cols + c];
        acc[c] += s;
    }
}

#define TZ_BIAS(SUF, T)                                                                          \
    extern "C" __global__ void bias_add_##SUF(T* y, const T* b, long long rows, int cols) {      \
        bias_add<T>(y, b, rows, cols);                                                           \
    }                                                                                            \
    extern "C" __global__ void bias_grad_##SUF(float* part, const T* dy, long long rows, int cols, \
                                               int chunk_rows) {                                 \
        bias_grad<T>(part, dy, rows, cols, chunk_rows);                                          \
    }
TZ_DTYPES(TZ_BIAS)

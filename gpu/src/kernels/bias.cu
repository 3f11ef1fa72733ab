// Bias add (in place, y[r, c] += b[c], in fp32 then stored in T) and the
// bias gradient: db[c] += sum over rows of dy[r, c], one thread per column
// adding the rows in order (no atomics).

template <typename T>
__device__ void bias_add(T* y, const T* b, long long rows, int cols) {
    TZ_FOR_EACH(i, rows * cols) tz_store(&y[i], tz_load(&y[i]) + tz_load(&b[i % cols]));
}

template <typename T>
__device__ void bias_grad(float* db, const T* dy, long long rows, int cols) {
    TZ_FOR_EACH(c, cols) {
        float s = 0.0f;
        for (long long r = 0; r < rows; ++r) s += tz_load(&dy[r * cols + c]);
        db[c] += s;
    }
}

#define TZ_BIAS(SUF, T)                                                                          \
    extern "C" __global__ void bias_add_##SUF(T* y, const T* b, long long rows, int cols) {      \
        bias_add<T>(y, b, rows, cols);                                                           \
    }                                                                                            \
    extern "C" __global__ void bias_grad_##SUF(float* db, const T* dy, long long rows, int cols) { \
        bias_grad<T>(db, dy, rows, cols);                                                        \
    }
TZ_DTYPES(TZ_BIAS)

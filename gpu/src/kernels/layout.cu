// Layout moves and the residual add.
//
// heads_from_rows: rows [batch, seq, slots * heads * head_dim] (GPT-2's
// packed q | k | v has 3 slots) to heads [batch, heads, seq, head_dim],
// taking slot `slot`. rows_from_heads: the inverse, writing that slot of
// the rows (the other slots untouched). Pure copies: no arithmetic.
// add: y = a + b elementwise (y may be a or b).

// The rows index of heads element i (slot `slot`).
__device__ __forceinline__ long long tz_row_index(long long i, int seq, int heads, int head_dim,
                                                  int slots, int slot) {
    const long long d = i % head_dim;
    const long long t = (i / head_dim) % seq;
    const long long h = (i / ((long long)head_dim * seq)) % heads;
    const long long b = i / ((long long)head_dim * seq * heads);
    return ((b * seq + t) * slots + slot) * heads * head_dim + h * head_dim + d;
}

template <typename T>
__device__ void heads_from_rows(T* out, const T* x, int batch, int seq, int heads, int head_dim,
                                int slots, int slot) {
    TZ_FOR_EACH(i, (long long)batch * heads * seq * head_dim) {
        out[i] = x[tz_row_index(i, seq, heads, head_dim, slots, slot)];
    }
}

template <typename T>
__device__ void rows_from_heads(T* out, const T* x, int batch, int seq, int heads, int head_dim,
                                int slots, int slot) {
    TZ_FOR_EACH(i, (long long)batch * heads * seq * head_dim) {
        out[tz_row_index(i, seq, heads, head_dim, slots, slot)] = x[i];
    }
}

template <typename T>
__device__ void add(T* y, const T* a, const T* b, long long n) {
    TZ_FOR_EACH(i, n) tz_store(&y[i], tz_load(&a[i]) + tz_load(&b[i]));
}

// add_chunks: a reduce-scatter's sums, in rank order. `chunks` holds
// `world` chunks of n elements of T one after the other (rank r's at r ·
// n); out[i] = acc[i] (+0.0 when acc is null) + chunk 0[i] + chunk 1[i] +
// ..., each chunk element widened exactly to fp32, added one after the
// other in chunk order, as the host's collective adds them.
template <typename T>
__device__ void add_chunks(float* out, const float* acc, const T* chunks, long long n,
                           int world) {
    TZ_FOR_EACH(i, n) {
        float s = acc ? acc[i] : 0.0f;
        for (int r = 0; r < world; ++r) s = s + tz_load(&chunks[(long long)r * n + i]);
        out[i] = s;
    }
}

#define TZ_LAYOUT(SUF, T)                                                                        \
    extern "C" __global__ void heads_from_rows_##SUF(T* out, const T* x, int batch, int seq,      \
                                                     int heads, int head_dim, int slots,         \
                                                     int slot) {                                 \
        heads_from_rows<T>(out, x, batch, seq, heads, head_dim, slots, slot);                    \
    }                                                                                            \
    extern "C" __global__ void rows_from_heads_##SUF(T* out, const T* x, int batch, int seq,      \
                                                     int heads, int head_dim, int slots,         \
                                                     int slot) {                                 \
        rows_from_heads<T>(out, x, batch, seq, heads, head_dim, slots, slot);                    \
    }                                                                                            \
    extern "C" __global__ void add_##SUF(T* y, const T* a, const T* b, long long n) {            \
        add<T>(y, a, b, n);                                                                      \
    }                                                                                            \
    extern "C" __global__ void add_chunks_##SUF(float* out, const float* acc, const T* chunks, \
                                                long long n, int world) {                        \
        add_chunks<T>(out, acc, chunks, n, world);                                               \
    }
TZ_DTYPES(TZ_LAYOUT)

// Grouped-query attention: heads [batch, kv_heads · group, n] from
// [batch, kv_heads, n] (each key/value head repeated for its `group` query
// heads), and the gradient's way back: out[b, k] = the sum over g of
// x[b, k · group + g], added in g order (no atomics).
template <typename T>
__device__ void repeat_kv(T* out, const T* x, int batch, int kv_heads, int group, long long n) {
    TZ_FOR_EACH(i, (long long)batch * kv_heads * group * n) {
        const long long j = i % n;
        const long long h = (i / n) % ((long long)kv_heads * group);
        const long long b = i / (n * kv_heads * group);
        out[i] = x[(b * kv_heads + h / group) * n + j];
    }
}

template <typename T>
__device__ void sum_kv(T* out, const T* x, int batch, int kv_heads, int group, long long n) {
    TZ_FOR_EACH(i, (long long)batch * kv_heads * n) {
        const long long j = i % n;
        const long long k = (i / n) % kv_heads;
        const long long b = i / (n * kv_heads);
        float s = 0.0f;
        for (int g = 0; g < group; ++g) s += tz_load(&x[((b * kv_heads + k) * group + g) * n + j]);
        tz_store(&out[i], s);
    }
}

#define TZ_GQA(SUF, T)                                                                           \
    extern "C" __global__ void repeat_kv_##SUF(T* out, const T* x, int batch, int kv_heads,      \
                                               int group, long long n) {                         \
        repeat_kv<T>(out, x, batch, kv_heads, group, n);                                         \
    }                                                                                            \
    extern "C" __global__ void sum_kv_##SUF(T* out, const T* x, int batch, int kv_heads,         \
                                            int group, long long n) {                            \
        sum_kv<T>(out, x, batch, kv_heads, group, n);                                            \
    }
TZ_DTYPES(TZ_GQA)

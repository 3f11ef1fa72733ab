// Rotary embeddings, HF's rotate_half layout: x is [batch, seq, heads,
// head_dim] and each head's halves (i, i + head_dim / 2) rotate by the
// angle of position t and frequency i; cos and sin are fp32 tables
// [seq, head_dim / 2]. `sign` +1 is the forward rotation, -1 its inverse
// (the backward: the gradient rotates back). One thread per pair; y may be
// x (each thread reads its pair before writing it).

template <typename T>
__device__ void rope(T* y, const T* x, const float* cos_t, const float* sin_t, int batch, int seq,
                     int heads, int head_dim, float sign) {
    const int half = head_dim / 2;
    TZ_FOR_EACH(i, (long long)batch * seq * heads * half) {
        const long long row = i / half;  // (b, t, h)
        const int j = (int)(i % half);
        const int t = (int)((row / heads) % seq);
        const float c = cos_t[(long long)t * half + j];
        const float s = sign * sin_t[(long long)t * half + j];
        const long long a = row * head_dim + j;
        const float x1 = tz_load(&x[a]), x2 = tz_load(&x[a + half]);
        tz_store(&y[a], x1 * c - x2 * s);
        tz_store(&y[a + half], x2 * c + x1 * s);
    }
}

#define TZ_ROPE(SUF, T)                                                                          \
    extern "C" __global__ void rope_##SUF(T* y, const T* x, const float* cos_t,                  \
                                          const float* sin_t, int batch, int seq, int heads,     \
                                          int head_dim, float sign) {                            \
        rope<T>(y, x, cos_t, sin_t, batch, seq, heads, head_dim, sign);                          \
    }
TZ_DTYPES(TZ_ROPE)

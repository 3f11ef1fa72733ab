// Pointwise activations, computed in fp32 and stored in T.
// GELU (tanh approximation, GPT-2's gelu_new):
//   y = 0.5 x (1 + tanh(k (x + 0.044715 x^3))), k = sqrt(2 / pi).
// SwiGLU (Llama's MLP): y = silu(gate) * up, silu(g) = g / (1 + exp(-g)).

#define TZ_GELU_K 0.7978845608028654f
#define TZ_GELU_C 0.044715f

template <typename T>
__device__ void gelu_tanh_fwd(T* y, const T* x, long long n) {
    TZ_FOR_EACH(i, n) {
        const float v = tz_load(&x[i]);
        const float u = TZ_GELU_K * (v + TZ_GELU_C * v * v * v);
        tz_store(&y[i], 0.5f * v * (1.0f + tanhf(u)));
    }
}

template <typename T>
__device__ void gelu_tanh_bwd(T* dx, const T* dy, const T* x, long long n) {
    TZ_FOR_EACH(i, n) {
        const float v = tz_load(&x[i]);
        const float u = TZ_GELU_K * (v + TZ_GELU_C * v * v * v);
        const float th = tanhf(u);
        const float du = TZ_GELU_K * (1.0f + 3.0f * TZ_GELU_C * v * v);
        const float d = 0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * du;
        tz_store(&dx[i], tz_load(&dy[i]) * d);
    }
}

template <typename T>
__device__ void swiglu_fwd(T* y, const T* gate, const T* up, long long n) {
    TZ_FOR_EACH(i, n) {
        const float g = tz_load(&gate[i]);
        tz_store(&y[i], g / (1.0f + expf(-g)) * tz_load(&up[i]));
    }
}

// dup = dy * silu(g); dgate = dy * up * sig * (1 + g (1 - sig)).
template <typename T>
__device__ void swiglu_bwd(T* dgate, T* dup, const T* dy, const T* gate, const T* up,
                           long long n) {
    TZ_FOR_EACH(i, n) {
        const float g = tz_load(&gate[i]), u = tz_load(&up[i]), d = tz_load(&dy[i]);
        const float sig = 1.0f / (1.0f + expf(-g));
        tz_store(&dup[i], d * (g * sig));
        tz_store(&dgate[i], d * u * sig * (1.0f + g * (1.0f - sig)));
    }
}

#define TZ_ACTIVATION(SUF, T)                                                                    \
    extern "C" __global__ void gelu_tanh_fwd_##SUF(T* y, const T* x, long long n) {              \
        gelu_tanh_fwd<T>(y, x, n);                                                               \
    }                                                                                            \
    extern "C" __global__ void gelu_tanh_bwd_##SUF(T* dx, const T* dy, const T* x, long long n) { \
        gelu_tanh_bwd<T>(dx, dy, x, n);                                                          \
    }                                                                                            \
    extern "C" __global__ void swiglu_fwd_##SUF(T* y, const T* gate, const T* up, long long n) { \
        swiglu_fwd<T>(y, gate, up, n);                                                           \
    }                                                                                            \
    extern "C" __global__ void swiglu_bwd_##SUF(T* dgate, T* dup, const T* dy, const T* gate,    \
                                                const T* up, long long n) {                      \
        swiglu_bwd<T>(dgate, dup, dy, gate, up, n);                                              \
    }
TZ_DTYPES(TZ_ACTIVATION)

// Causal attention probabilities between the two cuBLAS products (scores
// = Q K^T, out = P V): one block per score row (batch, head, query t of
// seq), columns j <= t kept. Forward: p = exp(s * scale - max) / sum, the
// masked columns 0. Backward: ds = p * (dp - sum_j p * dp) * scale (the
// masked columns come out 0 as their p is 0).

template <typename T>
__device__ void softmax_causal_fwd(T* p, const T* s, int seq, float scale) {
    __shared__ float shm[32];
    const long long row = blockIdx.x;
    const int t = (int)(row % seq);
    const T* sr = s + row * seq;
    T* pr = p + row * seq;
    float mx = TZ_NEG_INF;
    for (int j = threadIdx.x; j <= t; j += blockDim.x) mx = fmaxf(mx, tz_load(&sr[j]) * scale);
    mx = tz_block_max(mx, shm);
    float sum = 0.0f;
    for (int j = threadIdx.x; j <= t; j += blockDim.x) sum += expf(tz_load(&sr[j]) * scale - mx);
    const float inv = 1.0f / tz_block_sum(sum, shm);
    for (int j = threadIdx.x; j < seq; j += blockDim.x) {
        tz_store(&pr[j], j <= t ? expf(tz_load(&sr[j]) * scale - mx) * inv : 0.0f);
    }
}

template <typename T>
__device__ void softmax_bwd(T* ds, const T* p, const T* dp, int seq, float scale) {
    __shared__ float shm[32];
    const long long row = blockIdx.x;
    const T* pr = p + row * seq;
    const T* dpr = dp + row * seq;
    float dot = 0.0f;
    for (int j = threadIdx.x; j < seq; j += blockDim.x) dot += tz_load(&pr[j]) * tz_load(&dpr[j]);
    dot = tz_block_sum(dot, shm);
    for (int j = threadIdx.x; j < seq; j += blockDim.x) {
        tz_store(&ds[row * seq + j], tz_load(&pr[j]) * (tz_load(&dpr[j]) - dot) * scale);
    }
}

#define TZ_SOFTMAX(SUF, T)                                                                       \
    extern "C" __global__ void softmax_causal_fwd_##SUF(T* p, const T* s, int seq, float scale) { \
        softmax_causal_fwd<T>(p, s, seq, scale);                                                 \
    }                                                                                            \
    extern "C" __global__ void softmax_bwd_##SUF(T* ds, const T* p, const T* dp, int seq,         \
                                                 float scale) {                                  \
        softmax_bwd<T>(ds, p, dp, seq, scale);                                                   \
    }
TZ_DTYPES(TZ_SOFTMAX)

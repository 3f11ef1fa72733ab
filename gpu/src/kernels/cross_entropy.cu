// Cross-entropy fused with its softmax: one block per row of logits
// [rows, vocab]. loss_rows[r] = logsumexp(l) - l[target] (0 for
// ignore_index, NaN for a target outside the vocabulary); with dlogits,
// dlogits = (softmax(l) - onehot(target)) * grad_scale (grad_scale: 1 /
// the number of counted targets, for the mean), 0 rows for ignore_index.
// The total is `sum_f32` over loss_rows: one block, a fixed order.

template <typename T>
__device__ void cross_entropy(float* loss_rows, T* dlogits, const T* logits, const int* targets,
                              int vocab, int ignore_index, float grad_scale) {
    __shared__ float shm[32];
    const long long row = blockIdx.x;
    const T* lr = logits + row * vocab;
    const int target = targets[row];
    if (target == ignore_index) {
        if (dlogits)
            for (int j = threadIdx.x; j < vocab; j += blockDim.x) tz_store(&dlogits[row * vocab + j], 0.0f);
        if (threadIdx.x == 0) loss_rows[row] = 0.0f;
        return;
    }
    float mx = TZ_NEG_INF;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) mx = fmaxf(mx, tz_load(&lr[j]));
    mx = tz_block_max(mx, shm);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) sum += expf(tz_load(&lr[j]) - mx);
    const float lse = mx + logf(tz_block_sum(sum, shm));
    if (threadIdx.x == 0) {
        loss_rows[row] = (target >= 0 && target < vocab) ? lse - tz_load(&lr[target]) : TZ_NAN;
    }
    if (dlogits) {
        for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
            const float pj = expf(tz_load(&lr[j]) - lse);
            tz_store(&dlogits[row * vocab + j], (pj - (j == target ? 1.0f : 0.0f)) * grad_scale);
        }
    }
}

#define TZ_CE(SUF, T)                                                                            \
    extern "C" __global__ void cross_entropy_##SUF(float* loss_rows, T* dlogits, const T* logits, \
                                                   const int* targets, int vocab,                \
                                                   int ignore_index, float grad_scale) {         \
        cross_entropy<T>(loss_rows, dlogits, logits, targets, vocab, ignore_index, grad_scale);  \
    }
TZ_DTYPES(TZ_CE)

// out[0] = the sum of x[0 .. n] (one block; thread j adds j, j + TZ_BLOCK,
// ... then tz_block_sum).
extern "C" __global__ void sum_f32(float* out, const float* x, long long n) {
    __shared__ float shm[32];
    float s = 0.0f;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) s += x[i];
    s = tz_block_sum(s, shm);
    if (threadIdx.x == 0) out[0] = s;
}

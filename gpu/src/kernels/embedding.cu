// Token embedding. Forward: out[t, :] = table[ids[t], :] (a copy, no
// arithmetic; an id outside [0, vocab) gives a NaN row, never a read out
// of bounds: the host checks ids first and says which). Backward, row-owned
// and without atomics: the host sorts the token positions by (id,
// position) into `order` and lists the distinct ids in `uniq` with their
// runs `starts[u] .. starts[u + 1]`; one thread owns one element of one
// distinct row and adds that row's gradients in position order.

template <typename T>
__device__ void embedding_fwd(T* out, const T* table, const int* ids, int tokens, int hidden,
                              int vocab) {
    TZ_FOR_EACH(i, (long long)tokens * hidden) {
        const long long t = i / hidden, h = i % hidden;
        const int id = ids[t];
        if (id < 0 || id >= vocab) {
            tz_store(&out[i], TZ_NAN);
        } else {
            out[i] = table[(long long)id * hidden + h];
        }
    }
}

template <typename T>
__device__ void embedding_bwd(float* grad_table, const T* grad_out, const int* uniq,
                              const int* starts, const int* order, int n_uniq, int hidden) {
    TZ_FOR_EACH(i, (long long)n_uniq * hidden) {
        const long long u = i / hidden, h = i % hidden;
        float s = 0.0f;
        for (int k = starts[u]; k < starts[u + 1]; ++k) {
            s += tz_load(&grad_out[(long long)order[k] * hidden + h]);
        }
        grad_table[(long long)uniq[u] * hidden + h] += s;
    }
}

#define TZ_EMBEDDING(SUF, T)                                                                    \
    extern "C" __global__ void embedding_fwd_##SUF(T* out, const T* table, const int* ids,       \
                                                   int tokens, int hidden, int vocab) {          \
        embedding_fwd<T>(out, table, ids, tokens, hidden, vocab);                                \
    }                                                                                           \
    extern "C" __global__ void embedding_bwd_##SUF(float* grad_table, const T* grad_out,         \
                                                   const int* uniq, const int* starts,           \
                                                   const int* order, int n_uniq, int hidden) {   \
        embedding_bwd<T>(grad_table, grad_out, uniq, starts, order, n_uniq, hidden);             \
    }
TZ_DTYPES(TZ_EMBEDDING)

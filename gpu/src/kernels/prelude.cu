// tierzero's CUDA prelude: prepended to every kernel source. Header-free
// (NVRTC needs no CUDA headers): 16-bit types are plain structs, converted
// with inline PTX (`cvt.rn.*`, round to nearest even, sm_80 and later).
//
// Launch contract shared by every kernel: blocks of TZ_BLOCK threads (the
// host wrappers launch exactly that; the reductions depend on it). Sums
// over a block run in one fixed order (tz_block_sum), never with atomics,
// so the same inputs give the same bits on the same GPU. The scalar Rust
// references (gpu/src/reference.rs) follow the same order.

typedef unsigned short tz_u16;
struct tz_bf16 { tz_u16 bits; };
struct tz_f16 { tz_u16 bits; };

#define TZ_BLOCK 256
#define TZ_FULL_MASK 0xffffffffu
#define TZ_NEG_INF __int_as_float(0xff800000)
#define TZ_NAN __int_as_float(0x7fc00000)

__device__ __forceinline__ float tz_load(const float* p) { return *p; }
__device__ __forceinline__ float tz_load(const tz_bf16* p) {
    return __uint_as_float(((unsigned)p->bits) << 16);
}
__device__ __forceinline__ float tz_load(const tz_f16* p) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(p->bits));
    return f;
}
__device__ __forceinline__ void tz_store(float* p, float x) { *p = x; }
__device__ __forceinline__ void tz_store(tz_bf16* p, float x) {
    tz_u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    p->bits = r;
}
__device__ __forceinline__ void tz_store(tz_f16* p, float x) {
    tz_u16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
    p->bits = r;
}

// Butterfly over a warp: after the steps xor 16, 8, 4, 2, 1 every lane
// holds the same sum (a + b == b + a in IEEE arithmetic).
__device__ __forceinline__ float tz_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(TZ_FULL_MASK, v, o);
    return v;
}
__device__ __forceinline__ float tz_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(TZ_FULL_MASK, v, o));
    return v;
}

// The sum of `v` over the block, in every thread: each warp's butterfly,
// the warp sums through `shm` (32 floats), then the same butterfly over
// them (lanes past the last warp add 0) in every warp.
__device__ __forceinline__ float tz_block_sum(float v, float* shm) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = tz_warp_sum(v);
    __syncthreads();  // shm may still be read by a previous call
    if (lane == 0) shm[warp] = v;
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    return tz_warp_sum(lane < warps ? shm[lane] : 0.0f);
}
__device__ __forceinline__ float tz_block_max(float v, float* shm) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = tz_warp_max(v);
    __syncthreads();
    if (lane == 0) shm[warp] = v;
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    return tz_warp_max(lane < warps ? shm[lane] : TZ_NEG_INF);
}

// Grid-stride loop over `n` elements.
#define TZ_FOR_EACH(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (long long)(n); \
         i += (long long)gridDim.x * blockDim.x)

// Column sums over rows (the bias and norm weight gradients), in parallel
// and in one order, without atomics. The rows are cut into chunks of
// `chunk_rows` (the host's ROW_CHUNK: a constant, so the order depends on
// the shape alone, never on the GPU). Pass 1 gives each (chunk, column)
// one thread (grid x over tiles of TZ_BLOCK columns, grid y over chunks,
// striding by gridDim.y), which adds its chunk's rows in order from 0.0
// into part[chunk * cols + column]. Pass 2 (col_sums_finish) adds a
// column's chunk sums in chunk order into the accumulator.
__device__ __forceinline__ long long tz_min_ll(long long a, long long b) { return a < b ? a : b; }
#define TZ_FOR_EACH_CHUNK(k, r0, r1, rows, chunk_rows)                                          \
    for (long long k = blockIdx.y, r0, r1;                                                      \
         r0 = k * (long long)(chunk_rows),                                                      \
         r1 = tz_min_ll(r0 + (long long)(chunk_rows), (long long)(rows)), r0 < (long long)(rows); \
         k += gridDim.y)

// extern "C" entry points of a kernel template, one per storage dtype:
// MAKE(suffix, type) for f32, bf16 and f16 (NAME_f32, NAME_bf16, NAME_f16).
#define TZ_DTYPES(MAKE) MAKE(f32, float) MAKE(bf16, tz_bf16) MAKE(f16, tz_f16)

// Casts between fp32, bf16 and fp16 (round to nearest even; NaN stays NaN).

template <typename S, typename D>
__device__ void cast(D* dst, const S* src, long long n) {
    TZ_FOR_EACH(i, n) tz_store(&dst[i], tz_load(&src[i]));
}

#define TZ_CAST(NAME, S, D) \
    extern "C" __global__ void NAME(D* dst, const S* src, long long n) { cast<S, D>(dst, src, n); }
TZ_CAST(cast_f32_bf16, float, tz_bf16)
TZ_CAST(cast_f32_f16, float, tz_f16)
TZ_CAST(cast_bf16_f32, tz_bf16, float)
TZ_CAST(cast_f16_f32, tz_f16, float)
TZ_CAST(cast_bf16_f16, tz_bf16, tz_f16)
TZ_CAST(cast_f16_bf16, tz_f16, tz_bf16)

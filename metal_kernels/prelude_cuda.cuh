// moeflux-mlx expert kernels: CUDA dialect prelude (goes into mx.fast.cuda_kernel's `header`).
// Everything the shared kernel text needs from the dialect is defined here under an MF_ name;
// prelude_metal.h defines the same names for Metal. Keep the two files in lockstep.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define MF_INLINE __device__ __forceinline__
#define MF_TG                              /* address space of threadgroup (shared) pointers */
#define MF_THREAD                          /* address space of thread-private pointers */
#define MF_SHARED __shared__               /* declares a threadgroup array in the body */
#define MF_BARRIER() __syncthreads()
#define MF_SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
#define MF_AS_FLOAT(u) __uint_as_float(u)
#define MF_FMA(a, b, c) fmaf((a), (b), (c))
#define MF_EXP(v) __expf(v)
#define MF_FLOAT4(a, b, c, d) make_float4((a), (b), (c), (d))
#define MF_UINT4(a, b, c, d) make_uint4((a), (b), (c), (d))
#define MF_UNROLL _Pragma("unroll")
#define MF_NOUNROLL _Pragma("unroll 1")
// 16-byte load of packed weights: read-only path, streamed (each weight is read once per token).
#define MF_LOAD16(p) __ldg(reinterpret_cast<const uint4*>(p))

MF_INLINE float mf_tof(float v) { return v; }
MF_INLINE float mf_tof(__half v) { return __half2float(v); }
MF_INLINE float mf_tof(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename U> MF_INLINE U mf_cvt(float v);
template <> MF_INLINE float mf_cvt<float>(float v) { return v; }
template <> MF_INLINE __half mf_cvt<__half>(float v) { return __float2half_rn(v); }
template <> MF_INLINE __nv_bfloat16 mf_cvt<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename P> MF_INLINE bool mf_aligned16(P p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// a slot naming an expert outside the pool (top bit set: IN_PLACE_BIT of cache.pool), whether
// the slots come as uint32 or int32
MF_INLINE bool mf_in_place(long slot) { return slot < 0 || slot >= 0x80000000L; }

// moeflux-mlx expert kernels: Metal dialect prelude (goes into mx.fast.metal_kernel's `header`).
// Defines the same MF_ names as prelude_cuda.cuh. Keep the two files in lockstep.
#include <metal_stdlib>
using namespace metal;

#define MF_INLINE inline __attribute__((always_inline))
#define MF_TG threadgroup
#define MF_THREAD thread
#define MF_SHARED threadgroup
#define MF_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define MF_SHFL_XOR(v, m) simd_shuffle_xor((v), (ushort)(m))
#define MF_AS_FLOAT(u) as_type<float>(u)
#define MF_FMA(a, b, c) metal::fma((a), (b), (c))
#define MF_EXP(v) metal::exp(v)
#define MF_FLOAT4(a, b, c, d) float4((a), (b), (c), (d))
#define MF_UINT4(a, b, c, d) uint4((a), (b), (c), (d))
#define MF_UNROLL _Pragma("clang loop unroll(full)")
#define MF_NOUNROLL _Pragma("clang loop unroll(disable)")
#define MF_LOAD16(p) (*reinterpret_cast<const device uint4*>(p))

template <typename U> MF_INLINE float mf_tof(U v) { return static_cast<float>(v); }
template <typename U> MF_INLINE U mf_cvt(float v) { return static_cast<U>(v); }

// MSL cannot turn a device pointer into an integer: alignment of the packed weights is assumed
// (MLX buffers are page aligned and moeflux blobs align every component to 64 bytes).
template <typename P> MF_INLINE bool mf_aligned16(P p) { return true; }

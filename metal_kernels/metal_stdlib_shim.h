// A stand-in for Metal's <metal_stdlib>, for a front-end check of the Metal kernels with clang
// (moeflux_mlx/compute/metal_frontend.py). Not Metal: it declares, with Metal's names, types and
// address spaces, what the kernels and MLX's generated signature use, so that clang, in C++ for
// OpenCL mode with the generic address space and program-scope globals turned off, rejects what
// Metal's compiler would reject for syntax, types, templates and address spaces. No function here
// has a body that computes anything: nothing is run, only compiled.
//
// Metal address space -> C++ for OpenCL: device -> __global, threadgroup -> __local,
// thread -> __private, constant -> __constant (already a keyword there). Like Metal, a pointer
// into one address space does not convert to another, and a static data member or other
// program-scope variable must be `constant`.
#pragma once
#pragma OPENCL EXTENSION cl_khr_fp16 : enable

#define device __global
#define threadgroup __local
#define thread __private

typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long int64_t;
typedef uchar uint8_t;
typedef ushort uint16_t;
typedef uint uint32_t;
typedef ulong uint64_t;
typedef __SIZE_TYPE__ size_t;
typedef __PTRDIFF_TYPE__ ptrdiff_t;
typedef __bf16 bfloat;  // Metal 3.1's bfloat: a scalar type of its own (not a struct)

// Vector types: clang's ext_vector_type has Metal's .x/.y/.z/.w/.xy... access. Metal's
// constructor syntax float4(a, b, c, d) becomes OpenCL's vector literal (float4)(a, b, c, d);
// the function-like macro leaves the bare type name alone.
#define MF_SHIM_VECTORS(T)                                  \
  typedef T T##2 __attribute__((ext_vector_type(2)));       \
  typedef T T##3 __attribute__((ext_vector_type(3)));       \
  typedef T T##4 __attribute__((ext_vector_type(4)));
MF_SHIM_VECTORS(float)
MF_SHIM_VECTORS(half)
MF_SHIM_VECTORS(bfloat)
MF_SHIM_VECTORS(int)
MF_SHIM_VECTORS(uint)
MF_SHIM_VECTORS(short)
MF_SHIM_VECTORS(ushort)
MF_SHIM_VECTORS(char)
MF_SHIM_VECTORS(uchar)
#undef MF_SHIM_VECTORS
#define float2(...) ((float2)(__VA_ARGS__))
#define float3(...) ((float3)(__VA_ARGS__))
#define float4(...) ((float4)(__VA_ARGS__))
#define half2(...) ((half2)(__VA_ARGS__))
#define half4(...) ((half4)(__VA_ARGS__))
#define int2(...) ((int2)(__VA_ARGS__))
#define int4(...) ((int4)(__VA_ARGS__))
#define uint2(...) ((uint2)(__VA_ARGS__))
#define uint3(...) ((uint3)(__VA_ARGS__))
#define uint4(...) ((uint4)(__VA_ARGS__))

namespace metal {

template <typename T> struct mf_shim_is_simd { static constexpr constant bool value = false; };
#define MF_SHIM_SIMD(T)                                                              \
  template <> struct mf_shim_is_simd<T> { static constexpr constant bool value = true; };  \
  template <> struct mf_shim_is_simd<T##2> { static constexpr constant bool value = true; }; \
  template <> struct mf_shim_is_simd<T##3> { static constexpr constant bool value = true; }; \
  template <> struct mf_shim_is_simd<T##4> { static constexpr constant bool value = true; };
// the types Metal's simd_* functions take (scalars and vectors; MLX adds bfloat overloads of its
// own in bf16_math.h, which this shim does not: the kernels shuffle only float)
MF_SHIM_SIMD(float)
MF_SHIM_SIMD(half)
MF_SHIM_SIMD(int)
MF_SHIM_SIMD(uint)
MF_SHIM_SIMD(short)
MF_SHIM_SIMD(ushort)
MF_SHIM_SIMD(char)
MF_SHIM_SIMD(uchar)
#undef MF_SHIM_SIMD

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
void threadgroup_barrier(mem_flags flags);
void simdgroup_barrier(mem_flags flags);

template <typename T> T simd_shuffle_xor(T data, ushort mask) {
  static_assert(mf_shim_is_simd<T>::value, "simd_shuffle_xor: not a type Metal shuffles");
  return data;
}
template <typename T> T simd_shuffle_down(T data, ushort delta) {
  static_assert(mf_shim_is_simd<T>::value, "simd_shuffle_down: not a type Metal shuffles");
  return data;
}
template <typename T> T simd_shuffle_up(T data, ushort delta) {
  static_assert(mf_shim_is_simd<T>::value, "simd_shuffle_up: not a type Metal shuffles");
  return data;
}
template <typename T> T simd_shuffle(T data, ushort lane) {
  static_assert(mf_shim_is_simd<T>::value, "simd_shuffle: not a type Metal shuffles");
  return data;
}
template <typename T> T simd_sum(T data) {
  static_assert(mf_shim_is_simd<T>::value, "simd_sum: not a type Metal reduces");
  return data;
}
template <typename T> T simd_max(T data) {
  static_assert(mf_shim_is_simd<T>::value, "simd_max: not a type Metal reduces");
  return data;
}

// as_type<T>(x): a bit cast between types of the same size
template <typename To, typename From> To as_type(From x) {
  static_assert(sizeof(To) == sizeof(From), "as_type: the two types differ in size");
  return __builtin_bit_cast(To, x);
}

// math (float and half overloads, as Metal's; no double on Metal)
#define MF_SHIM_MATH1(name)  \
  float name(float x);       \
  half name(half x);         \
  float2 name(float2 x);     \
  float4 name(float4 x);     \
  half2 name(half2 x);       \
  half4 name(half4 x);
MF_SHIM_MATH1(exp)
MF_SHIM_MATH1(exp2)
MF_SHIM_MATH1(log)
MF_SHIM_MATH1(log2)
MF_SHIM_MATH1(sqrt)
MF_SHIM_MATH1(rsqrt)
MF_SHIM_MATH1(abs)
MF_SHIM_MATH1(fabs)
MF_SHIM_MATH1(tanh)
MF_SHIM_MATH1(floor)
MF_SHIM_MATH1(ceil)
#undef MF_SHIM_MATH1
float fma(float a, float b, float c);
half fma(half a, half b, half c);
float4 fma(float4 a, float4 b, float4 c);
float max(float a, float b);
float min(float a, float b);
int max(int a, int b);
int min(int a, int b);
uint max(uint a, uint b);
uint min(uint a, uint b);
float clamp(float x, float lo, float hi);
namespace fast {
float exp(float x);
float exp2(float x);
}  // namespace fast
namespace precise {
float exp(float x);
float exp2(float x);
}  // namespace precise

template <typename T> struct numeric_limits;
template <> struct numeric_limits<float> {
  static constexpr float max() { return 3.40282347e+38f; }
  static constexpr float infinity() { return __builtin_huge_valf(); }
};

}  // namespace metal

// moeflux-mlx expert kernels: helpers shared by the Metal and CUDA dialects.
// Dialect-neutral: written only against the MF_ names of prelude_metal.h / prelude_cuda.cuh.
//
// Dequantization trick (no shifts per element, no int->float conversion):
// a b-bit value q sitting at bit position b*m of a 16-bit half word is OR-ed into the mantissa
// of 1.0f, giving f = 1 + q * 2^(b*m - 23) exactly; f - 1 is exact, and the staged activation
// holds x * 2^(23 - b*m), so x' * (f - 1) == x * q with a single rounding in the FMA.
// Per element: one LOP3 (and+or), one FADD, one FFMA; per 32-bit word one extra shift.
// The affine part is folded per 16-byte chunk (which lies inside one quantization group):
//   sum_i (s*q_i + b) * x_i = s * sum_i q_i x_i + b * sum_i x_i,
// with sum_i x_i precomputed once per block and chunk.

// 2^e as a float (e in the normal range)
MF_INLINE float mf_exp2i(int e) { return MF_AS_FLOAT(uint32_t(127 + e) << 23); }

MF_INLINE float mf_q(uint32_t u, uint32_t mask) {
  return MF_AS_FLOAT(0x3F800000u | (u & mask)) - 1.0f;
}

template <typename U> MF_INLINE float mf_round(float v) { return mf_tof(mf_cvt<U>(v)); }

// Four 32-bit words at p, p + st, p + 2 st, p + 3 st (unaligned or strided packed weights).
template <typename P> MF_INLINE uint4 mf_load_words(P p, long st) {
  return MF_UINT4(uint32_t(p[0]), uint32_t(p[st]), uint32_t(p[2 * st]), uint32_t(p[3 * st]));
}

// One 16-byte chunk of packed weights dotted with its staged activations.
// dot() returns sum_i q_i * x_i over the chunk's 128 / BITS elements (xv: their staged float4s).
// (No static data members here: Metal wants those in the constant address space.)
template <int BITS> struct MfChunk;

template <> struct MfChunk<4> {
  static MF_INLINE void word(uint32_t u, float4 xl, float4 xh, MF_THREAD float& a, MF_THREAD float& b) {
    const uint32_t v = u >> 16;
    a = MF_FMA(xl.x, mf_q(u, 0x000Fu), a);
    a = MF_FMA(xl.y, mf_q(u, 0x00F0u), a);
    a = MF_FMA(xl.z, mf_q(u, 0x0F00u), a);
    a = MF_FMA(xl.w, mf_q(u, 0xF000u), a);
    b = MF_FMA(xh.x, mf_q(v, 0x000Fu), b);
    b = MF_FMA(xh.y, mf_q(v, 0x00F0u), b);
    b = MF_FMA(xh.z, mf_q(v, 0x0F00u), b);
    b = MF_FMA(xh.w, mf_q(v, 0xF000u), b);
  }
  static MF_INLINE float dot(uint4 w, MF_THREAD const float4* xv) {
    float a = 0.0f, b = 0.0f;
    word(w.x, xv[0], xv[1], a, b);
    word(w.y, xv[2], xv[3], a, b);
    word(w.z, xv[4], xv[5], a, b);
    word(w.w, xv[6], xv[7], a, b);
    return a + b;
  }
};

template <> struct MfChunk<8> {
  static MF_INLINE void word(uint32_t u, float4 xq, MF_THREAD float& a, MF_THREAD float& b) {
    const uint32_t v = u >> 16;
    a = MF_FMA(xq.x, mf_q(u, 0x00FFu), a);
    a = MF_FMA(xq.y, mf_q(u, 0xFF00u), a);
    b = MF_FMA(xq.z, mf_q(v, 0x00FFu), b);
    b = MF_FMA(xq.w, mf_q(v, 0xFF00u), b);
  }
  static MF_INLINE float dot(uint4 w, MF_THREAD const float4* xv) {
    float a = 0.0f, b = 0.0f;
    word(w.x, xv[0], a, b);
    word(w.y, xv[1], a, b);
    word(w.z, xv[2], a, b);
    word(w.w, xv[3], a, b);
    return a + b;
  }
};

// Where logical element `idx` (row-major over `shape`) of an input lies, in elements. MLX passes
// <name>_shape / _strides / _ndim for inputs the body names them for, so the wrappers hand over
// x and the router's slots as they are (a strided slice, any leading dims): no copy or reshape
// node is added to the graph, and each node costs host time at every decode step.
template <typename S, typename St>
MF_INLINE long mf_loc(long idx, S shape, St strides, int ndim) {
  long loc = 0;
  for (int d = ndim - 1; d >= 0; --d) {
    loc += (idx % long(shape[d])) * long(strides[d]);
    idx /= long(shape[d]);
  }
  return loc;
}

// Stage one activation vector of IN_DIM elements (element stride st) into threadgroup memory, converted to fp32 and
// pre-scaled for the trick above, laid out so that the lanes of a warp reading consecutive chunks
// c hit consecutive float4 (conflict-free 16-byte reads): xs[v * NCH + c] holds elements
// 4v..4v+3 of chunk c. xsum[c] is the plain sum of chunk c. All NT threads must call this
// (it uses warp shuffles); the caller places the barrier.
template <int BITS, int IN_DIM, int NT, typename P>
MF_INLINE void mf_stage(P src, long st, MF_TG float4* xs, MF_TG float* xsum, int tid) {
  constexpr int EPC = 128 / BITS;  // elements per 16-byte chunk
  constexpr int NCH = IN_DIM / EPC;
  constexpr int PER = 16 / BITS;   // elements per 16-bit half word
  constexpr int NQ = IN_DIM / 4;
  constexpr int ITER = (NQ + NT - 1) / NT;
  MF_UNROLL
  for (int it = 0; it < ITER; ++it) {
    const int q = tid + it * NT;
    const bool in = q < NQ;
    float v0 = 0.0f, v1 = 0.0f, v2 = 0.0f, v3 = 0.0f;
    if (in) {
      v0 = mf_tof(src[4 * q * st]);
      v1 = mf_tof(src[(4 * q + 1) * st]);
      v2 = mf_tof(src[(4 * q + 2) * st]);
      v3 = mf_tof(src[(4 * q + 3) * st]);
    }
    float s = (v0 + v1) + (v2 + v3);
    MF_UNROLL
    for (int m = 1; m < EPC / 4; m <<= 1) {
      s += MF_SHFL_XOR(s, m);
    }
    if (in) {
      const int e = 4 * q;
      const int c = e / EPC;
      const int v = (e % EPC) / 4;
      xs[v * NCH + c] = MF_FLOAT4(v0 * mf_exp2i(23 - BITS * (0 % PER)),
                                  v1 * mf_exp2i(23 - BITS * (1 % PER)),
                                  v2 * mf_exp2i(23 - BITS * (2 % PER)),
                                  v3 * mf_exp2i(23 - BITS * (3 % PER)));
      if (v == 0) {
        xsum[c] = s;
      }
    }
  }
}

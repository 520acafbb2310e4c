  // ==== combine: out[t, i] = res[t, i] + sum_k wts[t, k] * y[t, k, i]  (+ [sigmoid(sgate[t]) *] shr[t, i])
  // template: T (output dtype), DIM (hidden H), TOPK, NT (threads per threadgroup)
  // defines: MF_HAS_SHARED, MF_GATED.  grid: x = DIM rounded up to NT, y = tokens.
  const int i = MF_BX * NT + MF_TID;
  const long t = MF_BY;
  if (i < DIM) {
    float acc = 0.0f;
    MF_UNROLL
    for (int k = 0; k < TOPK; ++k) {
      acc = MF_FMA(mf_tof(wts[t * TOPK + k]), mf_tof(y[(t * TOPK + k) * DIM + i]), acc);
    }
#if MF_HAS_SHARED
    float sh = mf_tof(shr[t * DIM + i]);
#if MF_GATED
    sh = sh / (1.0f + MF_EXP(-mf_tof(sgate[t])));
#endif
    acc += sh;
#endif
    out[t * DIM + i] = mf_cvt<T>(mf_tof(res[t * DIM + i]) + acc);
  }

  MF_NOUNROLL
  for (int it = 0; it < RPW; ++it) {
    const int row0 = MF_BX * RPB + it * RPI;
    if (row0 >= OUT_DIM) {
      break;  // uniform over the threadgroup
    }
    uint4 q[NR][NJ];
    MF_UNROLL
    for (int k = 0; k < NR; ++k) {
      const int row = row0 + k * RGB + rg;
      const long r = row < OUT_DIM ? row : OUT_DIM - 1;
      auto g = wa_p + r * wa_r;
      MF_UNROLL
      for (int j = 0; j < NJ; ++j) {
        const long c = sub + j * LPR;
        q[k][j] = MF_LD(g + 4 * c * MF_WS_A, MF_WS_A);
      }
    }
    float acc[NR];
    MF_UNROLL
    for (int k = 0; k < NR; ++k) {
      acc[k] = 0.0f;
    }
    MF_UNROLL
    for (int j = 0; j < NJ; ++j) {
      const int c = sub + j * LPR;
      const long grp = (c * EPC) / GSZ;
      float4 xv[NXV];
      MF_UNROLL
      for (int v = 0; v < NXV; ++v) {
        xv[v] = mf_xs[v * NCH + c];
      }
      const float xsum = mf_xsum[c];
      MF_UNROLL
      for (int k = 0; k < NR; ++k) {
        const int row = row0 + k * RGB + rg;
        const long r = row < OUT_DIM ? row : OUT_DIM - 1;
        acc[k] += mf_tof(sa_p[r * sa_r + grp * sa_c]) * MfChunk<BITS>::dot(q[k][j], xv) +
                  mf_tof(ba_p[r * ba_r + grp * ba_c]) * xsum;
      }
    }
    MF_UNROLL
    for (int k = 0; k < NR; ++k) {
      MF_UNROLL
      for (int m = LPR / 2; m > 0; m >>= 1) {
        acc[k] += MF_SHFL_XOR(acc[k], m);
      }
      const int row = row0 + k * RGB + rg;
      if (row < OUT_DIM && sub == 0) {
        y[long(pair) * OUT_DIM + row] = mf_cvt<T>(acc[k]);
      }
    }
  }

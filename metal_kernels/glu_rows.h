  MF_NOUNROLL
  for (int it = 0; it < RPW; ++it) {
    const int row0 = MF_BX * RPB + it * RPI;
    if (row0 >= OUT_DIM) {
      break;  // uniform over the threadgroup
    }
    const int row = row0 + rg;
    const bool valid = row < OUT_DIM;
    const long r = valid ? row : OUT_DIM - 1;  // keep every lane in the shuffles below
    auto ga = wa_p + r * wa_r;
    auto gb = wb_p + r * wb_r;
    uint4 qa[NJ];
    uint4 qb[NJ];
    MF_UNROLL
    for (int j = 0; j < NJ; ++j) {
      const long c = sub + j * LPR;
      qa[j] = MF_LD(ga + 4 * c * MF_WS_A, MF_WS_A);
      qb[j] = MF_LD(gb + 4 * c * MF_WS_B, MF_WS_B);
    }
    auto psa = sa_p + r * sa_r;
    auto psb = sb_p + r * sb_r;
    auto pba = ba_p + r * ba_r;
    auto pbb = bb_p + r * bb_r;
    float aa = 0.0f, ab = 0.0f;
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
      aa += mf_tof(psa[grp * sa_c]) * MfChunk<BITS>::dot(qa[j], xv) + mf_tof(pba[grp * ba_c]) * xsum;
      ab += mf_tof(psb[grp * sb_c]) * MfChunk<BITS>::dot(qb[j], xv) + mf_tof(pbb[grp * bb_c]) * xsum;
    }
    MF_UNROLL
    for (int m = LPR / 2; m > 0; m >>= 1) {
      aa += MF_SHFL_XOR(aa, m);
      ab += MF_SHFL_XOR(ab, m);
    }
    if (valid && sub == 0) {
      // mlx-lm's SwitchGLU rounds x_gate, x_up and each step of silu(gate) * up to the
      // activation dtype; do the same so the result tracks stock mlx-lm.
      const float g = mf_round<T>(aa);
      const float u = mf_round<T>(ab);
      const float sig = mf_round<T>(1.0f / (1.0f + MF_EXP(-g)));
      const float act = mf_round<T>(g * sig);
      h[long(pair) * OUT_DIM + row] = mf_cvt<T>(act * u);
    }
  }

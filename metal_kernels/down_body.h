  // ==== down: y[p, r] = Wd[s] . h[p] for pair p = t * TOPK + k, s = slots[p]
  // (hin [..., TOPK, IN_DIM] and slots [..., TOPK] may be strided; y is [..., TOPK, OUT_DIM])
  // template: T, BITS, GSZ, IN_DIM (intermediate I), OUT_DIM (hidden H), TOPK, LPR, NW, RPW,
  //           NR (rows per row group and iteration, loaded together)
  // grid: x = threadgroups over rows (NW*32 threads each), y = T * TOPK pairs.
  constexpr int NT = NW * 32;
  constexpr int EPC = 128 / BITS;
  constexpr int NCH = IN_DIM / EPC;
  constexpr int NJ = NCH / LPR;
  constexpr int NXV = EPC / 4;
  constexpr int RGW = 32 / LPR;
  constexpr int RGB = NW * RGW;            // row groups per threadgroup
  constexpr int RPI = RGB * NR;            // rows per iteration
  constexpr int RPB = RPI * RPW;
  static_assert(NCH % LPR == 0, "LPR must divide the chunks of a row");
  static_assert(GSZ % EPC == 0, "a 16-byte chunk must lie inside one quantization group");

  MF_SHARED float4 mf_xs[NCH * NXV];
  MF_SHARED float mf_xsum[NCH];

  const int pair = MF_BY;
  const long slot = long(slots[mf_loc(pair, slots_shape, slots_strides, slots_ndim)]);
  mf_stage<BITS, IN_DIM, NT>(hin + mf_loc(long(pair) * IN_DIM, hin_shape, hin_strides, hin_ndim),
                             long(hin_strides[hin_ndim - 1]), mf_xs, mf_xsum, MF_TID);
  MF_BARRIER();

  const int sub = MF_LANE % LPR;
  const int rg = MF_WARP * RGW + MF_LANE / LPR;
  auto wa_p = MF_EXPERT(wd, wd_strides, 0);
  auto sa_p = MF_EXPERT(sd, sd_strides, 1);
  auto ba_p = MF_EXPERT(bd, bd_strides, 2);
  const long wa_r = wd_strides[1], sa_r = sd_strides[1], ba_r = bd_strides[1];
  const long mf_wsa = wd_strides[2], sa_c = sd_strides[2], ba_c = bd_strides[2];
  const bool mf_vec = mf_wsa == 1 && (wa_r % 4) == 0 && mf_aligned16(wa_p);

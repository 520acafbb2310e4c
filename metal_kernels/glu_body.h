  // ==== glu: h[p, r] = swiglu(Wg[s] . x[t], Wu[s] . x[t]) for pair p = t * TOPK + k, s = slots[p]
  // (x [..., IN_DIM] and slots [..., TOPK] may be strided; h is [..., TOPK, OUT_DIM], contiguous)
  // template: T (activation dtype), BITS, GSZ (group size), IN_DIM (hidden H), OUT_DIM (intermediate I),
  //           TOPK, LPR (lanes per row), NW (warps per threadgroup), RPW (row iterations per threadgroup)
  // grid: x = threadgroups over rows (NW*32 threads each), y = T * TOPK pairs.
  constexpr int NT = NW * 32;
  constexpr int EPC = 128 / BITS;          // elements per 16-byte chunk
  constexpr int NCH = IN_DIM / EPC;        // chunks per weight row
  constexpr int NJ = NCH / LPR;            // chunks per lane per row
  constexpr int NXV = EPC / 4;             // staged float4 per chunk
  constexpr int RGW = 32 / LPR;            // row groups per warp
  constexpr int RPI = NW * RGW;            // rows per iteration of a threadgroup
  constexpr int RPB = RPI * RPW;           // rows per threadgroup
  static_assert(NCH % LPR == 0, "LPR must divide the chunks of a row");
  static_assert(GSZ % EPC == 0, "a 16-byte chunk must lie inside one quantization group");

  MF_SHARED float4 mf_xs[NCH * NXV];
  MF_SHARED float mf_xsum[NCH];

  const int pair = MF_BY;
  const int tok = pair / TOPK;
  const long slot = long(slots[mf_loc(pair, slots_shape, slots_strides, slots_ndim)]);
  mf_stage<BITS, IN_DIM, NT>(x + mf_loc(long(tok) * IN_DIM, x_shape, x_strides, x_ndim),
                             long(x_strides[x_ndim - 1]), mf_xs, mf_xsum, MF_TID);
  MF_BARRIER();

  const int sub = MF_LANE % LPR;
  const int rg = MF_WARP * RGW + MF_LANE / LPR;
  auto wa_p = MF_EXPERT(wg, wg_strides, 0);
  auto wb_p = MF_EXPERT(wu, wu_strides, 3);
  auto sa_p = MF_EXPERT(sg, sg_strides, 1);
  auto sb_p = MF_EXPERT(su, su_strides, 4);
  auto ba_p = MF_EXPERT(bg, bg_strides, 2);
  auto bb_p = MF_EXPERT(bu, bu_strides, 5);
  const long wa_r = wg_strides[1], wb_r = wu_strides[1];
  const long sa_r = sg_strides[1], sb_r = su_strides[1], ba_r = bg_strides[1], bb_r = bu_strides[1];
  const long mf_wsa = wg_strides[2], mf_wsb = wu_strides[2];
  const long sa_c = sg_strides[2], sb_c = su_strides[2], ba_c = bg_strides[2], bb_c = bu_strides[2];
  // 16-byte loads need unit inner stride and 16-byte aligned rows; else the word-by-word path runs.
  const bool mf_vec = mf_wsa == 1 && mf_wsb == 1 && (wa_r % 4) == 0 && (wb_r % 4) == 0 &&
                      mf_aligned16(wa_p) && mf_aligned16(wb_p);

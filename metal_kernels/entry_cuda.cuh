  // ---- CUDA entry: thread coordinates under the names the shared body uses
  const int MF_TID = int(threadIdx.x);
  const int MF_LANE = MF_TID & 31;
  const int MF_WARP = MF_TID >> 5;
  const int MF_BX = int(blockIdx.x);
  const int MF_BY = int(blockIdx.y);
  // an expert's weights: its slot of the pool, or, for an id with the top bit set, the expert
  // where it lies outside the pool (a speculative pass larger than the slots, read from the
  // pinned expert files: cache.pool.InPlaceExperts). in_place holds each pool input's
  // (address of expert 0, stride in bytes), in the order the pool inputs come.
#define MF_EXPERT(a, strides, k)                                                        \
  (mf_in_place(slot) ? reinterpret_cast<decltype(a)>(in_place[2 * (k)] +              \
                                                    uint64_t(slot & 0x7fffffffL) *     \
                                                        in_place[2 * (k) + 1])        \
                     : (a) + slot * (strides)[0])

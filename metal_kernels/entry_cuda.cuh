  // ---- CUDA entry: thread coordinates under the names the shared body uses
  const int MF_TID = int(threadIdx.x);
  const int MF_LANE = MF_TID & 31;
  const int MF_WARP = MF_TID >> 5;
  const int MF_BX = int(blockIdx.x);
  const int MF_BY = int(blockIdx.y);

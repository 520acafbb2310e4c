  // ---- Metal entry: thread coordinates under the names the shared body uses
  // (MLX adds these attributes to the generated signature because the body names them)
  const int MF_TID = int(thread_position_in_threadgroup.x);
  const int MF_LANE = int(thread_index_in_simdgroup);
  const int MF_WARP = int(simdgroup_index_in_threadgroup);
  const int MF_BX = int(threadgroup_position_in_grid.x);
  const int MF_BY = int(threadgroup_position_in_grid.y);
  // an expert's weights: its slot of the pool (CUDA may also read one outside the pool)
#define MF_EXPERT(a, strides, k) ((a) + slot * (strides)[0])

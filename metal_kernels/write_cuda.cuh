  // ---- write: the synced path's slot writes on a table layer, in place. A scatter may copy the
  // pool to a new buffer when a pending graph still holds it, and a pending table lookup (which
  // picks its slots when it runs) would then read the old buffer. Here the pool arrays are the
  // very buffers every graph holds, and stream order keeps their contents right.
  // Inputs: blobs [n, MF_BLOB] (host staging), dst [n] slots, then one uint8 pool array per expert
  // component (the copy lines below are generated). Output: done [1].
  const int n = int(dst_shape[0]);
  const size_t gtid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t gsize = size_t(gridDim.x) * blockDim.x;
  const int poison = 0;
  for (int k = 0; k < n; ++k) {
    const uint8_t* s = blobs + size_t(k) * MF_BLOB;
    const size_t d = size_t(dst[k]);
    MF_COPY_COMPONENTS
  }
  if (gtid == 0) done[0] = 1u;

  // ---- layer copy: a prefill's whole layer, from mapped host staging into one device array per
  // expert component, on a few blocks (the caller's grid: LAYER_COPY_BLOCKS in
  // cuda/layer_copy.py). MLX's copy kernel takes every SM for the few milliseconds the bytes
  // take to cross PCIe, and the previous layer's computation beside it waits for them; a few
  // blocks keep enough loads in flight to fill the link and leave the rest to the computation.
  // Inputs: blobs [n, MF_BLOB] (host staging, every component 16-byte aligned and sized).
  // Outputs: o0, o1 ... [n, bytes of that component] (the store lines below are generated).
  const size_t words = size_t(blobs_shape[0]) * (MF_BLOB / 16);
  const size_t gtid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t gsize = size_t(gridDim.x) * blockDim.x;
  const uint4* src = reinterpret_cast<const uint4*>(blobs);
  for (size_t base = gtid; base < words; base += gsize * MF_DEPTH) {
    uint4 v[MF_DEPTH];
    // all loads first: MF_DEPTH round trips over PCIe in flight per thread, not one
#pragma unroll
    for (int u = 0; u < MF_DEPTH; ++u) {
      const size_t i = base + size_t(u) * gsize;
      // __ldcv: fetched again, never from a cache (the host rewrote this staging since)
      if (i < words) v[u] = __ldcv(src + i);
    }
#pragma unroll
    for (int u = 0; u < MF_DEPTH; ++u) {
      const size_t i = base + size_t(u) * gsize;
      if (i >= words) break;
      const size_t e = i / (MF_BLOB / 16), r = i - e * (MF_BLOB / 16);
      MF_STORE_COMPONENTS
    }
  }

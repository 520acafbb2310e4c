  // ---- pinned copy: one expert component of a prefill's whole layer, straight out of the
  // page-locked expert file (cuda/pinned_files.py) into a device array, on a few blocks as the
  // layer copy (layer_copy_cuda.cuh says why a few), with no host read before it.
  // Inputs: meta: the address of expert 0's component (lo, hi words). Template: N experts of NB
  // bytes each, STRIDE bytes apart in the file (both 16-byte multiples, the address too).
  // Output: out [N, NB].
  const unsigned long long lo = (unsigned int)meta[0], hi = (unsigned int)meta[1];
  const uint8_t* base = reinterpret_cast<const uint8_t*>(lo | (hi << 32));
  const size_t row = size_t(NB) / 16, words = size_t(N) * row;
  const size_t gtid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t gsize = size_t(gridDim.x) * blockDim.x;
  uint4* dst = reinterpret_cast<uint4*>(out);
  for (size_t b = gtid; b < words; b += gsize * MF_DEPTH) {
    uint4 v[MF_DEPTH];
    // all loads first: MF_DEPTH round trips over PCIe in flight per thread, not one
#pragma unroll
    for (int u = 0; u < MF_DEPTH; ++u) {
      const size_t i = b + size_t(u) * gsize;
      if (i < words) {
        const size_t e = i / row, r = i - e * row;
        v[u] = *(reinterpret_cast<const uint4*>(base + e * size_t(STRIDE)) + r);
      }
    }
#pragma unroll
    for (int u = 0; u < MF_DEPTH; ++u) {
      const size_t i = b + size_t(u) * gsize;
      if (i >= words) break;
      dst[i] = v[u];
    }
  }

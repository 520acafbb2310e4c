  // ---- pinned copy: one expert component of a prefill's whole layer, out of page-locked host
  // memory (the page-locked expert files of cuda/pinned_files.py, or the prefill's page-locked
  // staging) into a device array, on a few blocks (LAYER_COPY_BLOCKS in cuda/layer_copy.py),
  // leaving the other SMs to the computation beside it.
  // Inputs: meta: the address of expert 0's component (lo, hi words). Template: N experts of NB
  // bytes each, STRIDE bytes apart. MF_WORD (MF_WORD_BYTES bytes) is the widest load the
  // address, NB and STRIDE are all multiples of. Output: out [N, NB].
  const unsigned long long lo = (unsigned int)meta[0], hi = (unsigned int)meta[1];
  const uint8_t* base = reinterpret_cast<const uint8_t*>(lo | (hi << 32));
  const size_t row = size_t(NB) / MF_WORD_BYTES, words = size_t(N) * row;
  const size_t gtid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t gsize = size_t(gridDim.x) * blockDim.x;
  MF_WORD* dst = reinterpret_cast<MF_WORD*>(out);
  for (size_t b = gtid; b < words; b += gsize * MF_DEPTH) {
    MF_WORD v[MF_DEPTH];
    // all loads first: MF_DEPTH round trips over PCIe in flight per thread, not one
#pragma unroll
    for (int u = 0; u < MF_DEPTH; ++u) {
      const size_t i = b + size_t(u) * gsize;
      if (i < words) {
        const size_t e = i / row, r = i - e * row;
        // __ldcv: fetched again, never from a cache (the host rewrites staging between layers)
        v[u] = __ldcv(reinterpret_cast<const MF_WORD*>(base + e * size_t(STRIDE)) + r);
      }
    }
#pragma unroll
    for (int u = 0; u < MF_DEPTH; ++u) {
      const size_t i = b + size_t(u) * gsize;
      if (i >= words) break;
      dst[i] = v[u];
    }
  }

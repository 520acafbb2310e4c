  // ---- fill: copy the experts the miss server just read (pinned staging) into their slots.
  // Runs after resolve (it consumes resolve's slots and passes them on, so the expert kernels
  // that follow depend on it). It copies only when resolve made a request in this very call
  // (slots[N] != 0): the copy list is then the server's answer to it. After a failed read the
  // server flags it and the slots are filled with NaN bytes.
  // Inputs: slots [N + 1], meta, then one uint8 pool array [n_slots, bytes] per expert component
  // (the copy lines below are generated); the staging [rows, MF_BLOB] comes by address.
  // Output: out_slots [N].
  int* c = mf_ptr<int>(meta, MF_META_CTRL);
  const uint8_t* staging = mf_ptr<const uint8_t>(meta, MF_META_STAGING);
  const int base = meta[2], csrc = meta[6], cdst = meta[7];
  __shared__ int n, poison, src[MF_MAXN], dst[MF_MAXN];
  if (threadIdx.x == 0) {
    const bool mine = slots[N] != 0u;
    n = mine ? mf_ld_acquire(c + base + MF_H_NCOPY) : 0;
    poison = mine ? int(mf_ld_relaxed(c + base + MF_H_ERR) != 0) : 0;
  }
  __syncthreads();
  for (int i = int(threadIdx.x); i < n; i += int(blockDim.x)) {
    src[i] = mf_ld_relaxed(c + csrc + i);
    dst[i] = mf_ld_relaxed(c + cdst + i);
  }
  __syncthreads();
  if (blockIdx.x == 0 && threadIdx.x < N) out_slots[threadIdx.x] = slots[threadIdx.x];
  const size_t gtid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t gsize = size_t(gridDim.x) * blockDim.x;
  for (int k = 0; k < n; ++k) {
    const uint8_t* s = staging + size_t(src[k]) * MF_BLOB;
    const size_t d = size_t(dst[k]);
    MF_COPY_COMPONENTS
  }

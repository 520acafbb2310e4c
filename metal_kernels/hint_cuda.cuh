  // ---- hint: publish the experts the next MoE layer's router is predicted to pick (prefetch).
  // Runs in this layer's call, before its resolve (which consumes what it passes on), so the miss
  // server can start reading the next layer's absent experts while this layer waits or computes.
  // A hint is advice: nothing waits for it. Thread 0 writes every word, then releases the
  // sequence number (the GPU is the only writer of both).
  // Inputs: inds [N] (this layer's router indices, passed on), pred [K] (the prediction),
  // meta (the NEXT layer's, see device_table.py). Output: out [N] = inds.
  int* c = mf_ptr<int>(meta, MF_META_CTRL);
  const int base = meta[2], hseq = meta[MF_META_HINT], hint = meta[MF_META_HINT + 1];
  const int t = int(threadIdx.x);
  if (t < N) out[t] = inds[t];
  if (t == 0) {
    for (int i = 0; i < K; ++i) mf_st_relaxed(c + hint + i, int(pred[i]));
    mf_st_relaxed(c + base + MF_H_HINT_N, K);
    mf_st_release(c + hseq, mf_ld_relaxed(c + hseq) + 1);
  }

  // ---- hint: publish the experts a table layer's next calls will route to, for the miss
  // server to read ahead. Prefetch: the next MoE layer's predicted experts, published in this
  // layer's call. A speculative pass served a token at a time: every token's experts, published
  // before the layer's first token is looked up. Enqueued before the resolve that consumes what
  // it passes on. A hint is advice: nothing waits for it. Thread 0 writes every word, with the
  // layer's GPU calls done so far (what the hint's calls follow), then releases the sequence
  // number (the GPU is the only writer of these words).
  // Inputs: inds [N] (the router indices of the call it runs in, passed on), pred [K] (the
  // experts; K from its shape, not compiled in: a pass's length varies from step to step),
  // meta (the hinted layer's, see device_table.py). Output: out [N] = inds.
  int* c = mf_ptr<int>(meta, MF_META_CTRL);
  const int base = meta[2], tick_at = meta[10], hseq = meta[MF_META_HINT],
            hint = meta[MF_META_HINT + 1];
  const int t = int(threadIdx.x), K = int(pred_shape[0]);
  if (t < N) out[t] = inds[t];
  if (t == 0) {
    for (int i = 0; i < K; ++i) mf_st_relaxed(c + hint + i, int(pred[i]));
    mf_st_relaxed(c + base + MF_H_HINT_N, K);
    mf_st_relaxed(c + base + MF_H_HINT_TICK, mf_ld_relaxed(c + tick_at));
    mf_st_release(c + hseq, mf_ld_relaxed(c + hseq) + 1);
  }

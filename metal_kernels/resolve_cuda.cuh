  // ---- resolve: router indices -> pool slots through the device-side table.
  // One block; thread t < N looks up expert inds[t]. When every expert is resident the host is
  // not involved at all. Otherwise thread 0 publishes the request and waits for the miss server
  // (another process) to read the missing experts and update the table (the GPU idles, the
  // rest of the graph stays enqueued), then every thread reads its slot again.
  // Inputs: inds [..., K] (N in all; uint32 or int32, read through its strides: the router's
  // slice as it is), meta (offsets and addresses, see device_table.py), after (unread, any
  // dtype: the previous table call's output, an edge that orders this call after it).
  // Template: N, IN_PLACE (0, 1 or 2, see below), and the input dtypes.
  // Output: slots [N + 1]; slots[N] is this call's request number, 0 when nothing was missed
  // (fill copies only for a request of its own call). The GPU never writes a word the server
  // writes (control_block.py), except last_used.
  int* c = mf_ptr<int>(meta, MF_META_CTRL);
  const int req_at = meta[0], done_at = meta[1], base = meta[2], tab = meta[3], last = meta[4],
            reqi = meta[5], n_experts = meta[8], fault_at = meta[9], tick_at = meta[10];
  __shared__ int miss, bad, calls, tick, seq, ncopy;
  __shared__ int ids[MF_MAXN], absent[MF_MAXN], first[MF_MAXN];  // IN_PLACE == 2
  const int t = int(threadIdx.x);
  if (t == 0) { miss = 0; bad = 0; seq = 0; ncopy = 0; }
  __syncthreads();
  int e = -1;
  if (t < N) {
    e = int(inds[mf_loc(t, inds_shape, inds_strides, inds_ndim)]);
    if (e < 0 || e >= n_experts) atomicOr(&bad, 1);
    else if (mf_ld_relaxed(c + tab + e) < 0) atomicOr(&miss, 1);
  }
  __syncthreads();
  if (t == 0) {
    calls = mf_ld_relaxed(c + tick_at) + 1;  // GPU calls of this layer, this one included
    tick = calls + mf_ld_relaxed(c + base + MF_H_HOST_TICKS);  // the LRU clock: every call
    if (bad) {
      mf_st_relaxed(c + fault_at, MF_FAULT_INDEX);
    } else if (miss) {
      for (int i = 0; i < N; ++i)
        mf_st_relaxed(c + reqi + i, int(inds[mf_loc(i, inds_shape, inds_strides, inds_ndim)]));
      mf_st_relaxed(c + base + MF_H_NREQ, N);
      seq = mf_ld_relaxed(c + done_at) + 1;
      mf_st_release(c + req_at, seq);  // publishes the request words above
      __threadfence_system();
      // %globaltimer may be stepped by the driver, even backwards: sum only forward steps
      unsigned long long prev = mf_clock_ns(), waited = 0;
      while (mf_ld_acquire(c + done_at) != seq) {
        __nanosleep(256);
        const unsigned long long now = mf_clock_ns();
        if (now > prev && now - prev < 1000000000ull) waited += now - prev;
        prev = now;
        if (waited > MF_WAIT_TIMEOUT_NS) {
          mf_st_relaxed(c + fault_at, MF_FAULT_TIMEOUT);
          break;
        }
      }
      ncopy = mf_ld_acquire(c + base + MF_H_NCOPY);
      mf_st_relaxed(c + base + MF_H_WAITS, mf_ld_relaxed(c + base + MF_H_WAITS) + 1);
      const int us = int(waited / 1000ull);
      mf_st_relaxed(c + base + MF_H_WAIT_US, mf_ld_relaxed(c + base + MF_H_WAIT_US) + us);
    }
  }
  __syncthreads();
  int s = -1;
  if (t < N) {
    s = bad ? -1 : mf_ld_acquire(c + tab + e);
    if (IN_PLACE == 2) { ids[t] = e; absent[t] = int(s < 0 && !bad); }
  }
  if (IN_PLACE == 2) {  // each expert's first selection in the call
    __syncthreads();
    if (t < N) {
      int f = 1;
      for (int j = 0; j < t; ++j) f &= int(ids[j] != e);
      first[t] = f;
    }
    __syncthreads();
  }
  if (t < N) {
    // absent only after a fault (flagged above), or in a call that asked nothing, for a failed
    // read's slot freed since it looked (that read's error is flagged): the host raises either.
    // With IN_PLACE (a pass larger than the slots) an expert the server left out of them is
    // read where it lies, named with the top bit (cache.pool.IN_PLACE_BIT): 1, in the pinned
    // expert files, by its id; 2, in the staging, where the server read the experts it left
    // out after the call's misses, by id (miss_server.Server.answer_gpu): row ncopy + rank.
    if (s < 0 && IN_PLACE == 1 && !bad) {
      slots[t] = 0x80000000u | uint32_t(e);
    } else if (s < 0 && IN_PLACE == 2 && !bad) {
      int rank = 0;
      for (int i = 0; i < N; ++i) rank += first[i] & absent[i] & int(ids[i] < e);
      slots[t] = 0x80000000u | uint32_t(ncopy + rank);
    } else {
      if (s < 0) s = 0;
      slots[t] = uint32_t(s);
      mf_st_relaxed(c + last + s, tick);
    }
  }
  if (t == 0) slots[N] = uint32_t(seq);
  __syncthreads();
  if (t == 0) {
    mf_st_release(c + tick_at, calls);  // the call is done (the host's in-flight count)
    __threadfence_system();
  }

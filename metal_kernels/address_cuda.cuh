  // ---- address: where MLX put a new array, for the copy engine (cuda/layer_copy.py).
  // MLX hands a kernel its outputs' device addresses; asking MLX for an address from the host
  // (the buffer protocol) would first move the array to managed memory and synchronize the
  // device. This kernel writes nothing into `out` (the copy engine fills it next) and stores its
  // address in `addr`, an 8-byte array MLX keeps in host-readable memory.
  // Inputs: tick (unused: a kernel takes at least one input). Outputs: out [N, NB] uint8,
  // addr [1] uint64.
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    addr[0] = (unsigned long long)(const void*)out;
  }

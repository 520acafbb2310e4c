// moeflux-mlx device-side slot table: helpers shared by resolve_cuda.cuh and fill_cuda.cuh
// (CUDA only; goes into mx.fast.cuda_kernel's `header`). See moeflux_mlx/device_table.py for the
// control block these kernels share with the host thread that serves misses.
//
// The control block and the staging are page-locked host memory mapped for the GPU
// (cudaHostRegister), outside MLX's allocator; kernels get their addresses through `meta`. The
// GPU and a host thread talk through them while a graph runs. Loads and stores are system-scope: the host writes a
// slot table and a copy list, then releases `done`; the GPU acquires `done` before it reads them.

MF_INLINE int mf_ld_relaxed(const int* p) {
  int v;
  asm volatile("ld.relaxed.sys.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
MF_INLINE int mf_ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.sys.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
MF_INLINE void mf_st_relaxed(int* p, int v) {
  asm volatile("st.relaxed.sys.b32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
MF_INLINE void mf_st_release(int* p, int v) {
  asm volatile("st.release.sys.b32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
template <typename T> MF_INLINE T* mf_ptr(const int32_t* meta, int at) {
  const unsigned long long lo = (unsigned int)meta[at], hi = (unsigned int)meta[at + 1];
  return reinterpret_cast<T*>(lo | (hi << 32));
}
MF_INLINE unsigned long long mf_clock_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Copy one expert component (NB bytes) from host staging into its pool slot with the whole grid;
// NaN bytes instead when the host could not read it (poison).
template <long long NB>
MF_INLINE void mf_copy_component(const uint8_t* s, uint8_t* d, int poison, size_t gtid, size_t gsize) {
  if (NB % 16 == 0) {
    const uint4* s4 = reinterpret_cast<const uint4*>(s);
    uint4* d4 = reinterpret_cast<uint4*>(d);
    const uint4 nan4 = make_uint4(~0u, ~0u, ~0u, ~0u);
    // __ldcv: fetch again, never from a cache (the host wrote these bytes while the graph ran)
    for (size_t i = gtid; i < size_t(NB / 16); i += gsize) d4[i] = poison ? nan4 : __ldcv(s4 + i);
  } else {
    const volatile uint8_t* sv = s;
    for (size_t i = gtid; i < size_t(NB); i += gsize) d[i] = poison ? uint8_t(0xFF) : sv[i];
  }
}

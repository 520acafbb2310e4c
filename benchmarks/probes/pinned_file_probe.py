"""Can the GPU copy experts straight out of the page cache? (CUDA only)

Maps an expert-sized file read-only, page-locks the mapping for the GPU (``cudaHostRegister``,
mapped + read-only) and times a kernel that copies N experts from it into device memory, against
the miss server's way: read the N experts into page-locked staging (``pread`` on 4 threads,
as ``warm_read_threads``), then the same kernel from the staging. Checks the bytes too.

    python benchmarks/probes/pinned_file_probe.py --file-mb 1024 --blob-bytes 1769472
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

from moeflux_mlx.cuda.runtime import PinnedBuffer, _cudart

SOURCE = """
  const unsigned long long lo = (unsigned int)meta[0], hi = (unsigned int)meta[1];
  const uint8_t* base = reinterpret_cast<const uint8_t*>(lo | (hi << 32));
  const size_t gtid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t gsize = size_t(gridDim.x) * blockDim.x;
  for (int k = 0; k < N; ++k) {
    const uint4* s = reinterpret_cast<const uint4*>(base + size_t(ids[k]) * BLOB);
    uint4* d = reinterpret_cast<uint4*>(out + size_t(k) * BLOB);
    for (size_t i = gtid; i < size_t(BLOB / 16); i += gsize) d[i] = __ldcv(s + i);
  }
"""


def _kernel():
    return mx.fast.cuda_kernel(
        name="pinned_file_probe_copy",
        input_names=["ids", "meta"],
        output_names=["out"],
        source=SOURCE,
    )


def _meta(ptr: int) -> mx.array:
    return mx.array(np.array([ptr & 0xFFFFFFFF, ptr >> 32], np.uint32).view(np.int32))


def _copy(kernel, ids: np.ndarray, ptr: int, blob: int, blocks: int) -> mx.array:
    return kernel(
        inputs=[mx.array(ids.astype(np.int32)), _meta(ptr)],
        template=[("N", int(ids.size)), ("BLOB", blob)],
        grid=(blocks * 256, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(int(ids.size) * blob,)],
        output_dtypes=[mx.uint8],
    )[0]


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", default="/tmp/pinned_file_probe.bin")
    ap.add_argument("--file-mb", type=int, default=1024)
    ap.add_argument("--blob-bytes", type=int, default=1769472)
    ap.add_argument("--counts", default="1,4,8,40")
    ap.add_argument("--blocks", default="132,264,528")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    rt = _cudart()
    if rt is None:
        print("no CUDA runtime: nothing to probe")
        return 1
    lib = rt[0]
    blob = args.blob_bytes // 16 * 16
    n_blobs = args.file_mb * 2**20 // blob
    data = np.random.default_rng(0).integers(0, 256, n_blobs * blob, dtype=np.uint8)
    with open(args.file, "wb") as f:
        f.write(data.tobytes())
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(args.file, os.O_RDONLY)
    mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    view = np.frombuffer(mm, np.uint8)
    host = view.ctypes.data
    dev_ptr = None
    for flags, what in ((0x02 | 0x08, "mapped|read-only"), (0x02, "mapped"), (0x0B, "all")):
        t0 = time.perf_counter()
        err = lib.cudaHostRegister(ctypes.c_void_p(host), ctypes.c_size_t(len(mm)), flags)
        dt = time.perf_counter() - t0
        print(f"cudaHostRegister({what}) of {len(mm) / 2**20:.0f} MiB: error {err}, {dt:.3f} s")
        if err == 0:
            dev = ctypes.c_void_p()
            err = lib.cudaHostGetDevicePointer(ctypes.byref(dev), ctypes.c_void_p(host), 0)
            print(f"  cudaHostGetDevicePointer: error {err}, device {dev.value:#x}, host {host:#x}")
            if err == 0:
                dev_ptr = int(dev.value)
                break
    if dev_ptr is None:
        print("the file mapping could not be registered")
        return 1
    kernel = _kernel()
    staging = PinnedBuffer(max(int(c) for c in args.counts.split(",")) * blob)
    rows = staging.array.reshape(-1, blob)
    pool = ThreadPoolExecutor(4)
    rng = np.random.default_rng(1)
    ok = True
    print(f"\nblob {blob} bytes, {n_blobs} experts in the file, median of {args.reps}")
    print("| experts | blocks | in place ms (GB/s) | pread 4 thr + copy ms | of which pread ms |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for n in (int(c) for c in args.counts.split(",")):
        ids = rng.choice(n_blobs, n, replace=False)
        for blocks in (int(b) for b in args.blocks.split(",")):
            got = _copy(kernel, ids, dev_ptr, blob, blocks)
            mx.eval(got)
            if not (np.array(got).reshape(n, blob) == view.reshape(-1, blob)[ids]).all():
                print(f"  MISMATCH in place, {n} experts")
                ok = False

            def in_place():
                mx.eval(_copy(kernel, ids, dev_ptr, blob, blocks))

            def read_one(k):
                os.preadv(fd, [memoryview(rows[k])], int(ids[k]) * blob)

            def pread():
                list(pool.map(read_one, range(n)))

            def served():
                pread()
                mx.eval(_copy(kernel, np.arange(n), staging.device_ptr, blob, blocks))

            a = _median_ms(in_place, args.reps)
            b = _median_ms(served, args.reps)
            c = _median_ms(pread, args.reps)
            print(f"| {n} | {blocks} | {a:.3f} ({n * blob / a / 1e6:.1f}) | {b:.3f} | {c:.3f} |")
    lib.cudaHostUnregister(ctypes.c_void_p(host))
    del view
    mm.close()
    os.close(fd)
    staging.close()
    os.unlink(args.file)
    print("bytes", "match" if ok else "DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

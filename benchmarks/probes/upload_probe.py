"""How fast can expert bytes in host memory reach MLX arrays the GPU reads? (MLX CUDA backend)

MLX's CUDA allocator hands out managed memory, so a host write places pages on the host and the
GPU migrates them on fault. This times the candidate paths for one layer's worth of misses.
Prints a table; run on the GPU machine: python3 benchmarks/probes/upload_probe.py
"""

import ctypes
import statistics
import time

import mlx.core as mx
import numpy as np

from moeflux_mlx.cache.pool import host_view
from moeflux_mlx.cuda.runtime import _cudart, _MemLocation, cuda_runtime_available, host_staging

MB = 1 << 20


def prefetch_to_device(view: np.ndarray) -> bool:
    """cudaMemPrefetchAsync of the managed pages under ``view`` to the GPU (a hint)."""
    lib, major = _cudart()
    dev = ctypes.c_int(0)
    lib.cudaGetDevice(ctypes.byref(dev))
    ptr, n = ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(view.nbytes)
    if major == "12":
        return lib.cudaMemPrefetchAsync(ptr, n, dev, ctypes.c_void_p(0)) == 0
    return (
        lib.cudaMemPrefetchAsync(
            ptr, n, _MemLocation(1, dev.value), ctypes.c_uint(0), ctypes.c_void_p(0)
        )
        == 0
    )


def upload(arr):
    if cuda_runtime_available():
        prefetch_to_device(host_view(arr))
    return arr


def consume(a):
    # a GPU op that reads every byte
    return mx.sum(a.view(mx.uint32).astype(mx.uint64))


def timeit(fn, reps=7):
    fn()
    times = []
    for _ in range(reps):
        mx.synchronize()
        t = time.perf_counter()
        fn()
        mx.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    print("device", mx.default_device(), "CUDA runtime reachable", cuda_runtime_available())
    rows = []
    for size in (8 * MB, 64 * MB, 256 * MB):
        src = np.random.randint(0, 255, size, dtype=np.uint8)
        want = int(np.sum(src.view(np.uint32).astype(np.uint64)))

        def a():  # baseline: mx.array(numpy), then the GPU reads it
            x = mx.array(src)
            r = consume(x)
            mx.eval(r)
            assert r.item() == want

        pool = mx.zeros((4, size), mx.uint8)
        mx.eval(pool)

        def c():
            pool[1] = mx.array(src)
            r = consume(pool[1])
            mx.eval(r)
            assert r.item() == want

        buf = mx.zeros((1, size), mx.uint8)
        mx.eval(buf)

        def d():  # write straight into MLX-owned memory (host view), prefetch to the GPU, read
            np.copyto(host_view(buf)[0], src)
            r = consume(upload(buf))
            mx.eval(r)
            assert r.item() == want

        def e():  # the same without the prefetch hint: the GPU faults pages over
            np.copyto(host_view(buf)[0], src)
            r = consume(buf)
            mx.eval(r)
            assert r.item() == want

        staging = host_staging((1, size))
        gpu_pool = mx.zeros((4, size), mx.uint8)
        mx.eval(gpu_pool)
        slot = mx.array([2], mx.uint32)

        def f():  # what the cache does on CUDA: host-resident staging, scatter into the pool
            np.copyto(host_view(staging)[0], src)
            gpu_pool[slot] = staging
            r = consume(gpu_pool[2])
            mx.eval(r)
            assert r.item() == want

        def g():  # the scatter alone: bytes already in host staging (pread writes them there)
            gpu_pool[slot] = staging
            mx.eval(gpu_pool)

        paths = [
            ("mx.array(numpy)", a),
            ("pool[i] = mx.array(numpy)", c),
            ("host view + prefetch", d),
            ("host view, page faults", e),
        ]
        if staging is not None:
            np.copyto(host_view(staging)[0], src)
            paths += [("host staging + GPU scatter", f), ("GPU scatter from host staging", g)]
        for name, fn in paths:
            try:
                t = timeit(fn)
                rows.append((name, size // MB, t * 1e3, size / t / 1e9))
            except Exception as e:  # noqa: BLE001 - report and go on: this is a probe
                rows.append((name, size // MB, float("nan"), float("nan")))
                print(name, "failed:", type(e).__name__, e)
        t = timeit(lambda: mx.eval(consume(buf)))
        rows.append(("GPU read only (resident)", size // MB, t * 1e3, size / t / 1e9))
    print(f"{'path':32s} {'MB':>6s} {'ms':>9s} {'GB/s':>8s}")
    for r in rows:
        print(f"{r[0]:32s} {r[1]:6d} {r[2]:9.3f} {r[3]:8.2f}")


if __name__ == "__main__":
    main()

"""Do host-to-device copies on the copy engines wait for the GPU's computation? (MLX CUDA)

Times one 170 MB ``cudaMemcpyAsync`` from page-locked memory on a stream of its own, alone and
while MLX computes (a chain of matmuls of about 50 ms queued just before), into MLX's managed
memory and into memory from ``cudaMalloc``; and MLX's copy kernel out of mapped host staging
alone and beside the same computation. Run on the GPU machine:
python3 benchmarks/probes/copy_overlap_probe.py
"""

from __future__ import annotations

import ctypes
import time

import mlx.core as mx
import numpy as np

from moeflux_mlx.cache.pool import host_view
from moeflux_mlx.cuda.runtime import _cudart, host_staging

NBYTES = 170 << 20


def main() -> None:
    lib = _cudart()[0]
    for fn in (
        "cudaMemcpyAsync",
        "cudaStreamSynchronize",
        "cudaStreamCreateWithFlags",
        "cudaMalloc",
    ):
        getattr(lib, fn).restype = ctypes.c_int
    stream = ctypes.c_void_p()
    assert lib.cudaStreamCreateWithFlags(ctypes.byref(stream), 1) == 0
    src = np.ones(NBYTES, np.uint8)
    assert lib.cudaHostRegister(ctypes.c_void_p(src.ctypes.data), ctypes.c_size_t(NBYTES), 3) == 0
    managed = mx.zeros((NBYTES,), mx.uint8)
    mx.eval(managed)
    managed_ptr = host_view(managed.reshape(1, -1)).ctypes.data
    plain = ctypes.c_void_p()
    assert lib.cudaMalloc(ctypes.byref(plain), ctypes.c_size_t(NBYTES)) == 0
    a = mx.random.normal((8192, 8192)).astype(mx.bfloat16)
    mx.eval(a)

    def busy(n):
        y = a
        for _ in range(n):
            y = (y @ a) * 1e-4
        return y

    t = time.perf_counter()
    mx.eval(busy(40))
    compute = time.perf_counter() - t
    print(f"computation alone: {compute * 1e3:.1f} ms")

    def dma(dst):
        t = time.perf_counter()
        err = lib.cudaMemcpyAsync(
            ctypes.c_void_p(dst),
            ctypes.c_void_p(src.ctypes.data),
            ctypes.c_size_t(NBYTES),
            4,
            stream,
        )
        returned = time.perf_counter() - t
        assert err == 0, err
        assert lib.cudaStreamSynchronize(stream) == 0
        return returned, time.perf_counter() - t

    staged = host_staging((NBYTES,))
    copy_stream = mx.new_stream(mx.gpu)

    def kernel_copy():
        t = time.perf_counter()
        with mx.stream(copy_stream):
            # strided, as a component of a blob: a contiguous slice would be a view, no copy
            out = mx.contiguous(staged.reshape(64, -1)[:, : NBYTES // 64 - 4096])
        mx.eval(out)
        return 0.0, time.perf_counter() - t

    for name, go in (
        ("copy engines into managed", lambda: dma(managed_ptr)),
        ("copy engines into cudaMalloc", lambda: dma(plain.value)),
        ("copy kernel out of mapped staging", kernel_copy),
    ):
        go()
        alone = min(go()[1] for _ in range(3))
        y = busy(40)
        mx.async_eval(y)
        time.sleep(0.002)  # the computation has started
        returned, beside = go()
        t = time.perf_counter()
        mx.eval(y)
        rest = time.perf_counter() - t
        print(
            f"{name}: alone {alone * 1e3:.1f} ms; beside the computation {beside * 1e3:.1f} ms "
            f"(the call returned after {returned * 1e3:.1f} ms; the computation then needed "
            f"{rest * 1e3:.1f} ms more)"
        )


if __name__ == "__main__":
    main()

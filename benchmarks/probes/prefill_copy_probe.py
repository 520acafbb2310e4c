"""Where does a prefill's whole-layer upload spend its time? (MLX CUDA backend)

A prefill at a small budget reads each layer's every expert (1.36 GB for the 8-layer
Qwen3-30B-A3B-sized model) from a warm page cache, then the GPU copies it out of host staging.
This times, per 170 MB layer (64 experts of 2.65 MB, split in the 9 components of a 4-bit expert):

- the read: pread from the page cache into managed host staging (today's), into page-locked
  memory, and into plain memory, with 8 and 16 threads;
- the copy to the GPU: today's copy kernel reading mapped host staging, against the copy engines
  (``cudaMemcpy2DAsync``, one call per component) from page-locked memory and from managed
  staging;
- no read at all: the page cache's own pages page-locked in place (``cudaHostRegister`` of a
  read-only file mapping), then copied by the copy engines; the cost of locking and unlocking.

Prints one table. Run on the GPU machine: python3 benchmarks/probes/prefill_copy_probe.py
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
from upload_probe import timeit  # this folder is on the path when run as a script

from moeflux_mlx.cache.pool import host_view
from moeflux_mlx.cuda.runtime import _cudart, host_staging

MB = 1 << 20
# a 4-bit Qwen3-30B-A3B expert: gate, up, down as (weight, scales, biases)
COMPONENTS = [786432, 49152, 49152] * 3
BLOB = sum(COMPONENTS)
HOST_REGISTER_MAPPED, HOST_REGISTER_READ_ONLY = 2, 8
MEMCPY_DEFAULT = 4


def lib():
    rt = _cudart()
    if rt is None:
        raise SystemExit("no CUDA runtime: run this on the GPU machine")
    cuda = rt[0]
    for fn in ("cudaMemcpy2DAsync", "cudaStreamSynchronize", "cudaStreamCreateWithFlags"):
        getattr(cuda, fn).restype = ctypes.c_int
    return cuda


def write_file(path: str, layers: int, experts: int) -> None:
    block = np.random.default_rng(0).integers(0, 256, 16 * MB, dtype=np.uint8).tobytes()
    total = layers * experts * BLOB
    with open(path, "wb") as f:
        done = 0
        while done < total:
            n = min(len(block), total - done)
            f.write(block[:n])
            done += n
    with open(path, "rb") as f:  # warm the page cache
        while f.read(64 * MB):
            pass


def read_layer(fd: int, layer: int, experts: int, into: np.ndarray, pool: ThreadPoolExecutor):
    """``experts`` blobs of ``layer`` into ``into`` ([experts, BLOB]), one pread an expert."""
    base = layer * experts * BLOB

    def one(e: int) -> None:
        view = memoryview(into[e])
        got = os.preadv(fd, [view], base + e * BLOB)
        assert got == BLOB, got

    list(pool.map(one, range(experts)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--file", default="/tmp/prefill_probe_experts.bin")
    args = ap.parse_args()
    cuda = lib()
    n, L = args.experts, args.layers
    nbytes = n * BLOB
    if not os.path.exists(args.file) or os.path.getsize(args.file) != L * nbytes:
        write_file(args.file, L, n)
    fd = os.open(args.file, os.O_RDONLY)
    stream = ctypes.c_void_p()
    assert cuda.cudaStreamCreateWithFlags(ctypes.byref(stream), 1) == 0  # non-blocking
    rows = []

    def row(name: str, seconds: float, note: str = "") -> None:
        rows.append((name, seconds * 1e3, nbytes / seconds / 1e9, note))
        print(f"{name}: {seconds * 1e3:.1f} ms a layer, {nbytes / seconds / 1e9:.1f} GB/s {note}")

    # destinations: today's managed staging, page-locked, plain
    managed = host_staging((n, BLOB))
    managed_view = host_view(managed).reshape(n, BLOB)
    plain = np.empty((n, BLOB), np.uint8)
    plain[:] = 1
    locked = np.empty((n, BLOB), np.uint8)
    locked[:] = 1
    assert (
        cuda.cudaHostRegister(ctypes.c_void_p(locked.ctypes.data), ctypes.c_size_t(nbytes), 1 | 2)
        == 0
    )

    for threads in (8, 16):
        with ThreadPoolExecutor(threads) as pool:
            for name, into in (
                ("managed", managed_view),
                ("page-locked", locked),
                ("plain", plain),
            ):
                layer = [0]

                def go(into=into, pool=pool, layer=layer):
                    read_layer(fd, layer[0] % L, n, into, pool)
                    layer[0] += 1

                row(f"read {threads} threads into {name}", timeit(go, args.reps * L))
    row("memcpy, one thread (numpy)", timeit(lambda: np.copyto(plain, locked), args.reps))

    # the copy to the GPU
    dst = [mx.zeros((n, c), mx.uint8) for c in COMPONENTS]
    mx.eval(dst)
    dst_ptr = [host_view(d).ctypes.data for d in dst]
    offsets = np.cumsum([0] + COMPONENTS[:-1])

    def kernel_copy():
        staged = managed
        outs = [mx.contiguous(staged[:, o : o + c]) for o, c in zip(offsets, COMPONENTS)]
        mx.eval(outs)

    def engine_copy(src_ptr: int):
        def go():
            for d, o, c in zip(dst_ptr, offsets, COMPONENTS):
                err = cuda.cudaMemcpy2DAsync(
                    ctypes.c_void_p(d),
                    ctypes.c_size_t(c),
                    ctypes.c_void_p(src_ptr + int(o)),
                    ctypes.c_size_t(BLOB),
                    ctypes.c_size_t(c),
                    ctypes.c_size_t(n),
                    MEMCPY_DEFAULT,
                    stream,
                )
                assert err == 0, err
            assert cuda.cudaStreamSynchronize(stream) == 0

        return go

    def consume():  # a kernel reading every byte: are the copies' pages on the GPU?
        mx.eval([mx.sum(d.view(mx.uint32).astype(mx.uint64)) for d in dst])

    row("sum on the GPU, fresh arrays", timeit(consume, args.reps), "(the baseline for the next)")
    row("copy kernel from managed staging (today)", timeit(kernel_copy, args.reps))
    row("copy engines from page-locked", timeit(engine_copy(locked.ctypes.data), args.reps))
    pinned_copy = engine_copy(locked.ctypes.data)
    row(
        "copy engines from page-locked, then the sum",
        timeit(lambda: (pinned_copy(), consume()), args.reps),
        "(more than copy + sum: pages moved off the GPU)",
    )
    row(
        "copy engines from managed staging",
        timeit(engine_copy(managed_view.ctypes.data), args.reps),
    )
    ok = all(
        np.array_equal(np.asarray(dst[i]), managed_view[:, o : o + c])
        for i, (o, c) in enumerate(zip(offsets, COMPONENTS))
    )
    print("engine copy bytes exact:", ok)

    # the page cache's own pages, locked in place
    mm = mmap.mmap(fd, L * nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
    base = np.frombuffer(mm, np.uint8).ctypes.data
    for flags, fname in (
        (HOST_REGISTER_MAPPED | HOST_REGISTER_READ_ONLY, "mapped|read-only"),
        (HOST_REGISTER_READ_ONLY, "read-only"),
        (0, "default"),
    ):
        ptr = ctypes.c_void_p(base)
        t = time.perf_counter()
        err = cuda.cudaHostRegister(ptr, ctypes.c_size_t(nbytes), flags)
        reg = time.perf_counter() - t
        if err:
            print(f"cudaHostRegister of the file mapping ({fname}) failed: error {err}")
            continue
        row(f"lock a layer of page cache ({fname})", reg)
        row("copy engines from the locked page cache", timeit(engine_copy(base), args.reps))
        t = time.perf_counter()
        cuda.cudaHostUnregister(ptr)
        row("unlock it", time.perf_counter() - t)
        times = []
        for layer in range(L):
            p = ctypes.c_void_p(base + layer * nbytes)
            t = time.perf_counter()
            assert cuda.cudaHostRegister(p, ctypes.c_size_t(nbytes), flags) == 0
            engine_copy(base + layer * nbytes)()
            cuda.cudaHostUnregister(p)
            times.append(time.perf_counter() - t)
        row(f"lock + copy + unlock, {L} layers ({fname})", statistics.median(times))
        break
    print()
    print("| step | ms a layer | GB/s | note |")
    print("| --- | --- | --- | --- |")
    for name, ms, gbs, note in rows:
        print(f"| {name} | {ms:.1f} | {gbs:.1f} | {note} |")


if __name__ == "__main__":
    main()

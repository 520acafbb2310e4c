"""How fast can one MoE layer's handful of missed experts come off a cold disk?

A decode-time miss reads 1-4 experts at once, not the 8-deep stream of whole experts that
``bench.read_bandwidth`` measures. This reads ``n`` random expert-sized blobs of a file, split
into pieces of ``piece`` bytes spread over ``threads`` threads, the page cache dropped before
each batch (``posix_fadvise DONTNEED``), and prints the median GB/s of each combination.

    python benchmarks/read_probe.py [--file F] [--size-gb 2] [--blob 1769472] [--trials 24]
"""

import argparse
import os
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor


def read_batch(pool, fd, offsets, blob, piece, bufs):
    jobs = []
    for i, off in enumerate(offsets):
        for at in range(0, blob, piece):
            n = min(piece, blob - at)
            jobs.append((off + at, memoryview(bufs[i])[at:at + n]))
    t = time.perf_counter()
    got = sum(pool.map(lambda j: os.preadv(fd, [j[1]], j[0]), jobs))
    dt = time.perf_counter() - t
    assert got == blob * len(offsets)
    return dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", default=None)
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--blob", type=int, default=1769472)  # Qwen3-30B-A3B, 4-bit group 64
    ap.add_argument("--trials", type=int, default=24)
    args = ap.parse_args()
    path = args.file
    if path is None:
        path = os.path.join(tempfile.gettempdir(), "read_probe.bin")
        size = int(args.size_gb * 1e9)
        if not os.path.exists(path) or os.path.getsize(path) < size:
            with open(path, "wb") as f:
                chunk = os.urandom(64 << 20)
                for _ in range(0, size, len(chunk)):
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    rng = random.Random(0)
    bufs = [bytearray(args.blob) for _ in range(8)]
    print(f"file {path} {size / 1e9:.2f} GB, blob {args.blob} bytes, {args.trials} trials each")
    print("| experts | piece KiB | threads | median ms | GB/s |")
    print("|---|---|---|---|---|")
    for n in (1, 2, 4, 8):
        for piece in (128 << 10, 256 << 10, 512 << 10, args.blob):
            for threads in (8, 16, 32):
                with ThreadPoolExecutor(threads) as pool:
                    times = []
                    for _ in range(args.trials):
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                        offs = [rng.randrange(0, size - args.blob) // 4096 * 4096 for _ in range(n)]
                        times.append(read_batch(pool, fd, offs, args.blob, piece, bufs))
                ms = statistics.median(times) * 1e3
                print(f"| {n} | {piece >> 10} | {threads} | {ms:.2f} | "
                      f"{n * args.blob / ms / 1e6:.2f} |", flush=True)
    os.close(fd)


if __name__ == "__main__":
    main()

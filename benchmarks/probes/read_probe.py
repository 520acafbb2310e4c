"""How fast can one MoE layer's handful of missed experts come off a cold disk?

A decode-time miss reads 1-4 experts at once, not the 8-deep stream of whole experts that
``moeflux_mlx.benchmark.pagecache.read_bandwidth`` measures. This reads ``n`` random
expert-sized blobs of a file, split into pieces of ``piece`` bytes spread over ``threads``
threads, the page cache dropped before each batch (``posix_fadvise DONTNEED``), and prints the
median GB/s of each combination.

    python benchmarks/probes/read_probe.py [--file F] [--size-gb 2] [--blob 1769472] [--trials 24]

``--advice-ab`` instead compares the kernel's default readahead with ``POSIX_FADV_RANDOM`` on
batches of whole experts at expert boundaries (a layer file's layout), and prints how many bytes
the disk actually delivered per byte asked for (``/sys/block/<dev>/stat``): readahead that
takes parallel reads of neighbouring experts for a sequential stream reads past them.
"""

import argparse
import os
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def read_batch(pool, fd, offsets, blob, piece, bufs):
    jobs = []
    for i, off in enumerate(offsets):
        for at in range(0, blob, piece):
            n = min(piece, blob - at)
            jobs.append((off + at, memoryview(bufs[i])[at : at + n]))
    t = time.perf_counter()
    got = sum(pool.map(lambda j: os.preadv(fd, [j[1]], j[0]), jobs))
    dt = time.perf_counter() - t
    assert got == blob * len(offsets)
    return dt


def block_device_stat(path):
    """The ``stat`` file of the block device holding ``path`` (partitions: their own)."""
    dev = os.stat(path).st_dev
    sys_dev = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    stat = sys_dev / "stat"
    return stat if stat.exists() else None


def sectors_read(stat):
    return int(stat.read_text().split()[2]) if stat is not None else 0


def advice_ab(fd, path, size, blob, trials, rng):
    stat = block_device_stat(path)
    n_experts = size // blob
    print(
        f"device stat: {stat or 'not found (no amplification column)'}; readahead "
        f"{_read_ahead_kb(stat)} KiB"
    )
    print("| advice | experts | piece KiB | median ms | GB/s | disk bytes / bytes asked |")
    print("|---|---|---|---|---|---|")
    bufs = [bytearray(blob) for _ in range(8)]
    for advice in ("normal", "random"):
        os.posix_fadvise(fd, 0, 0, getattr(os, f"POSIX_FADV_{advice.upper()}"))
        for n in (2, 4, 8):
            for piece in (blob, 512 << 10):  # 512 KiB: the store's READ_PIECE_BYTES
                with ThreadPoolExecutor(8) as pool:
                    times, asked, got = [], 0, 0
                    for _ in range(trials):
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                        experts = sorted(rng.sample(range(n_experts), n))
                        s0 = sectors_read(stat)
                        times.append(
                            read_batch(pool, fd, [e * blob for e in experts], blob, piece, bufs)
                        )
                        got += (sectors_read(stat) - s0) * 512
                        asked += n * blob
                ms = statistics.median(times) * 1e3
                amp = f"{got / asked:.2f}" if stat is not None else "-"
                print(
                    f"| {advice} | {n} | {piece >> 10} | {ms:.2f} | {n * blob / ms / 1e6:.2f} "
                    f"| {amp} |",
                    flush=True,
                )


def _read_ahead_kb(stat):
    if stat is None:
        return "?"
    for q in (stat.parent / "queue", stat.parent.parent / "queue"):
        if (q / "read_ahead_kb").exists():
            return (q / "read_ahead_kb").read_text().strip()
    return "?"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", default=None)
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--blob", type=int, default=1769472)  # Qwen3-30B-A3B, 4-bit group 64
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--advice-ab", action="store_true")
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
    if args.advice_ab:
        advice_ab(fd, path, size, args.blob, args.trials, rng)
        os.close(fd)
        return
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
                print(
                    f"| {n} | {piece >> 10} | {threads} | {ms:.2f} | "
                    f"{n * args.blob / ms / 1e6:.2f} |",
                    flush=True,
                )
    os.close(fd)


if __name__ == "__main__":
    main()

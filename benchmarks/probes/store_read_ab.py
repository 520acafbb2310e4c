"""The store's cold pread of decode-sized miss batches, with the kernel's readahead off
(``moeflux_mlx.format.readers.advise_random_reads``, what pread stores do) and on (the kernel's
default), taking turns in rounds.

It builds a 2-layer Qwen3-30B-A3B-shaped random checkpoint once, converts it, then reads batches
of 1, 2, 4 and 8 random experts of one layer through ``ExpertStore.read`` (8 threads, pieces
of ``READ_PIECE_BYTES``), the page cache dropped before each batch, and prints the median time per
batch and how many bytes the disk delivered per byte asked for (``/sys/block/<dev>/stat``).
``--sweep`` then reads the same batches with readahead off at other piece sizes and thread
counts (decode misses ~1 expert per layer at a time: latency, not throughput). ``--dropper`` adds
a third mode: readahead off while the decode benchmark's ``PageCacheDropper`` drops the files
every millisecond beside the reads, as it does during cold runs (does the dropping slow them?).
``--shares-ab`` instead compares, batch by batch in turn, the store's reads (a call's bytes in
equal shares, one per thread) with the queue of pieces it used before, and prints both beside the
decode benchmark's cold bandwidth (the I/O bound's rate) measured before and after. Since the
store reads in equal shares (2026-11-27), ``--sweep``'s piece size no longer sets how many
reads run at once (the thread count does), so its rows are not comparable with earlier sweeps.

    python benchmarks/probes/store_read_ab.py [--dir /tmp/moeflux-read-ab] [--rounds 3] [--batches 20]
                                       [--sweep 256:8,512:16,1024:8,2048:8] [--dropper]
"""

import argparse
import contextlib
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from moeflux_mlx.benchmark.pagecache import PageCacheDropper, expert_files  # noqa: E402
from moeflux_mlx.format import readers  # noqa: E402
from moeflux_mlx.format.convert import convert  # noqa: E402
from moeflux_mlx.io import store as st  # noqa: E402
from moeflux_mlx.testing import synth  # noqa: E402

MODES = ("off (pread stores)", "kernel default")
DROPPER = "off, 1 ms dropper running"


def set_readahead_advice(advise):
    """Installs ``advise(fd, what)`` as what a pread store calls on each file it opens, in every
    module that looks it up by name (the readers define it; the store may import it)."""
    for module in (readers, st):
        if hasattr(module, "advise_random_reads"):
            module.advise_random_reads = advise


def sectors_read(stat):
    return int(stat.read_text().split()[2]) if stat is not None else 0


def read_in_pieces(store, layer, experts, out):
    """The store's pread before equal shares: one job per piece of at most
    ``READ_PIECE_BYTES`` on the read threads, taken as they come."""
    src, pool = store.layers[layer], store._executor()
    futures = [
        pool.submit(*job)
        for i, e in enumerate(experts)
        for fd, start, at, n, what in src.pieces(e)
        for job in st._chunks(fd, start, out[i, at : at + n], what)
    ]
    for f in futures:
        f.result()


def direct_reader(store, layer):
    """Equal shares through a second descriptor opened with ``O_DIRECT`` (no page cache; needs
    page-aligned offsets, lengths and buffers): is bypassing the cache worth building?
    ``(read, fd)``, or ``(None, why)`` where it cannot run here."""
    src = store.layers[layer]
    if src.layout.blob_size % st.PAGE_BYTES:
        return None, f"experts of {src.layout.blob_size} bytes are not whole pages"
    try:
        fd = os.open(src.path, os.O_RDONLY | os.O_DIRECT)
    except (AttributeError, OSError) as e:  # no O_DIRECT (macOS), or a file system without it
        return None, f"cannot open with O_DIRECT: {e}"

    def read(store, layer, experts, out):
        reads = [(fd, int(e) * out.shape[1], out[i], "direct") for i, e in enumerate(experts)]
        pool = store._executor()
        for f in [pool.submit(st._run_jobs, s) for s in st.balanced_shares(reads, store.threads)]:
            f.result()

    return read, fd


def shares_ab(packed, batches, sizes=(2, 4, 5, 6, 8), threads=8):
    """Cold batches of ``sizes`` random experts, each read by every scheme in turn."""
    import mmap

    from moeflux_mlx.benchmark.pagecache import read_bandwidth

    before = read_bandwidth(packed)[0] / 1e9
    store, layout = st.open_store(packed, "pread", threads=threads)
    layer = sorted(layout.layers)[0]
    lay = layout.layers[layer]
    rng = random.Random(1)
    direct, direct_fd = direct_reader(store, layer)
    schemes = {"equal shares (the store)": None, "queue of pieces (before)": read_in_pieces}
    if direct is None:
        print(f"O_DIRECT left out: {direct_fd}")
    else:
        schemes["equal shares, O_DIRECT"] = direct
    times = {(name, k): [] for k in sizes for name in schemes}
    buf = mmap.mmap(-1, max(sizes) * lay.blob_size)  # page-aligned, for O_DIRECT
    with store:
        fds = [fd for s in store.layers.values() for fd in s.file_descriptors().values()]
        out = np.frombuffer(buf, np.uint8).reshape(max(sizes), lay.blob_size)
        for b in range(batches):
            for k in sizes:
                experts = np.array(sorted(rng.sample(range(lay.num_experts), k)))
                turn = b % len(schemes)
                names = list(schemes)[turn:] + list(schemes)[:turn]  # who goes first turns
                for name in names:
                    for fd in fds:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    t = time.perf_counter()
                    if schemes[name] is None:
                        store.read(layer, experts, out[:k])
                    else:
                        schemes[name](store, layer, experts, out[:k])
                    times[(name, k)].append(time.perf_counter() - t)
        del out
    if direct is not None:
        os.close(direct_fd)
    buf.close()
    after = read_bandwidth(packed)[0] / 1e9
    bound = (before + after) / 2
    print(
        f"blob {lay.blob_size} bytes, {threads} threads, {batches} batches each, page cache "
        f"dropped before each read; cold bandwidth (read_bandwidth: distinct whole experts, 8 threads) "
        f"{before:.2f} before, {after:.2f} GB/s after"
    )
    print("| experts | scheme | median ms | GB/s | of the cold bandwidth |")
    print("|---|---|---|---|---|")
    for (name, k), v in times.items():
        ms = statistics.median(v) * 1e3
        rate = k * lay.blob_size / ms / 1e6
        print(f"| {k} | {name} | {ms:.2f} | {rate:.2f} | {rate / bound:.0%} |", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, default=Path("/tmp/moeflux-read-ab"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--sweep", default="", help="KIB:THREADS,... (readahead off)")
    ap.add_argument(
        "--dropper",
        action="store_true",
        help="also read beside the decode benchmark's page-cache dropper",
    )
    ap.add_argument("--shares-ab", action="store_true", help="equal shares vs a queue of pieces")
    args = ap.parse_args()
    src, packed = args.dir / "plain", args.dir / "packed"
    if not src.exists():
        synth.build_checkpoint(src, "qwen3_moe", "full", overrides={"num_hidden_layers": 2})
    if not packed.exists():
        convert(src, packed)
    if args.shares_ab:
        shares_ab(packed, args.batches * args.rounds)
        return
    dev = os.stat(packed).st_dev
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    stat = stat if stat.exists() else None
    advise = readers.advise_random_reads
    rng = random.Random(0)
    sizes = (1, 2, 4, 8)

    def batches(threads, dropper=False):
        """{k: (median ms per batch, disk bytes / bytes asked)} through a fresh store."""
        store, layout = st.open_store(packed, "pread", threads=threads)
        layer = sorted(layout.layers)[0]
        lay = layout.layers[layer]
        out = {}
        with store, PageCacheDropper(expert_files(packed)) if dropper else contextlib.nullcontext():
            fds = [fd for src_ in store.layers.values() for fd in src_.file_descriptors().values()]
            for k in sizes:
                times, asked, got = [], 0, 0
                for _ in range(args.batches):
                    for fd in fds:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    experts = np.array(sorted(rng.sample(range(lay.num_experts), k)))
                    s0, t = sectors_read(stat), time.perf_counter()
                    store.read(layer, experts)
                    times.append(time.perf_counter() - t)
                    got += (sectors_read(stat) - s0) * 512
                    asked += k * lay.blob_size
                out[k] = (statistics.median(times) * 1e3, got / asked)
        return out, lay.blob_size

    rows = {}
    for _ in range(args.rounds):
        for mode in MODES + ((DROPPER,) if args.dropper else ()):
            set_readahead_advice(advise if mode != MODES[1] else (lambda fd, what: None))
            got, blob = batches(8, dropper=mode == DROPPER)
            for k, v in got.items():
                rows.setdefault((mode, k), []).append(v)
    set_readahead_advice(advise)
    print(
        f"blob {blob} bytes, pieces of {st.READ_PIECE_BYTES >> 10} KiB, 8 threads, "
        f"{args.rounds} rounds x {args.batches} batches, page cache dropped before each batch"
    )
    print(
        "| readahead | experts | median ms per round | GB/s (median round) | "
        "disk bytes / bytes asked |"
    )
    print("|---|---|---|---|---|")
    for (mode, k), v in rows.items():
        ms = [m for m, _ in v]
        amp = f"{statistics.mean(a for _, a in v):.2f}" if stat is not None else "-"
        print(
            f"| {mode} | {k} | {' / '.join(f'{m:.1f}' for m in ms)} | "
            f"{k * blob / statistics.median(ms) / 1e6:.2f} | {amp} |"
        )
    if args.sweep:
        default_piece = st.READ_PIECE_BYTES
        print("\nreadahead off, other pieces and threads (one round each):")
        print(
            "| piece KiB | threads | " + " | ".join(f"{k} experts ms (GB/s)" for k in sizes) + " |"
        )
        print("|---|---|" + "---|" * len(sizes))
        for spec in args.sweep.split(","):
            kib, threads = (int(v) for v in spec.split(":"))
            st.READ_PIECE_BYTES = kib << 10
            got, blob = batches(threads)
            print(
                f"| {kib} | {threads} | "
                + " | ".join(f"{ms:.1f} ({k * blob / ms / 1e6:.2f})" for k, (ms, _) in got.items())
                + " |"
            )
        st.READ_PIECE_BYTES = default_piece


if __name__ == "__main__":
    main()

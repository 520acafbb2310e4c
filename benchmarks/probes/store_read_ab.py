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
equal shares, one per thread; through the page cache and, ``expert_io=direct``, bypassing it)
with the queue of pieces it used before, with and without ``O_DIRECT`` and at other piece sizes
and thread counts, and prints them beside the decode benchmark's cold bandwidth (the I/O bound's
rate) measured before and after. Since the store reads in equal shares (2026-11-27), ``--sweep``'s
piece size no longer sets how many reads run at once (the thread count does), so its rows are not
comparable with earlier sweeps.

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


def scheme_reader(store, layer, piece_kib=512, threads=8, shares=False, direct=False):
    """A way to read a miss batch besides the store's own: a queue of pieces of ``piece_kib``
    taken as they come (what the store did before equal shares), or equal shares; on
    ``threads`` threads; through a second descriptor opened with ``O_DIRECT`` (no page cache;
    needs page-aligned offsets, lengths and buffers). ``(read, close)``, or ``(None, why)``
    where it cannot run here."""
    from concurrent.futures import ThreadPoolExecutor

    src = store.layers[layer]
    fd = src.fd
    if direct:
        if src.layout.blob_size % st.PAGE_BYTES:
            return None, f"experts of {src.layout.blob_size} bytes are not whole pages"
        try:
            fd = os.open(src.path, os.O_RDONLY | os.O_DIRECT)
        except (AttributeError, OSError) as e:  # no O_DIRECT (macOS), or a file system without it
            return None, f"cannot open with O_DIRECT: {e}"
    pool = ThreadPoolExecutor(threads)

    def read(store, layer, experts, out):
        piece = st.READ_PIECE_BYTES
        st.READ_PIECE_BYTES = piece_kib << 10
        try:
            reads = [(fd, int(e) * out.shape[1], out[i], "ab") for i, e in enumerate(experts)]
            if shares:
                jobs = [(st._run_jobs, s) for s in st.balanced_shares(reads, threads)]
            else:
                jobs = [j for r in reads for j in st._chunks(*r)]
        finally:
            st.READ_PIECE_BYTES = piece
        for f in [pool.submit(*j) for j in jobs]:
            f.result()

    def close():
        pool.shutdown()
        if direct:
            os.close(fd)

    return read, close


SCHEMES = {  # name: scheme_reader's arguments (None: a store's own read)
    "equal shares (the store, pread)": None,
    "equal shares, uncached (the store, direct)": None,
    "queue of pieces (before)": {},
    "queue of pieces, O_DIRECT": {"direct": True},
    "queue, 256 KiB pieces, 16 threads": {"piece_kib": 256, "threads": 16},
}


def shares_ab(packed, batches, sizes=(2, 4, 6, 8), threads=8):
    """Cold batches of ``sizes`` random experts, each read by every scheme in turn."""
    import mmap

    from moeflux_mlx.benchmark.pagecache import cold_bandwidth

    before = cold_bandwidth(packed) / 1e9
    store, layout = st.open_store(packed, "pread", threads=threads)
    layer = sorted(layout.layers)[0]
    lay = layout.layers[layer]
    rng = random.Random(1)
    direct, _ = st.open_store(packed, "direct", threads=threads)
    schemes, closers = {}, [direct.close]
    for name, kw in SCHEMES.items():
        if kw is None:
            schemes[name] = store.read if "pread" in name else direct.read
            continue
        read, close = scheme_reader(store, layer, **kw)
        if read is None:
            print(f"{name} left out: {close}")
            continue
        schemes[name] = read
        closers.append(close)
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
                    if SCHEMES[name] is None:
                        schemes[name](layer, experts, out[:k])
                    else:
                        schemes[name](store, layer, experts, out[:k])
                    times[(name, k)].append(time.perf_counter() - t)
        del out
    for close in closers:
        close()
    buf.close()
    after = cold_bandwidth(packed) / 1e9
    bound = (before + after) / 2
    print(
        f"blob {lay.blob_size} bytes, {batches} batches each, page cache dropped before each "
        f"read; cold bandwidth (cold_bandwidth: the store's calls of up to 32 distinct experts, "
        f"the faster of pread and direct) "
        f"{before:.2f} before, {after:.2f} GB/s after"
    )
    print("| experts | scheme | median ms | GB/s | of the cold bandwidth |")
    print("|---|---|---|---|---|")
    for (name, k), v in sorted(times.items(), key=lambda kv: kv[0][1]):
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

"""How fast the store reads decode-sized miss batches out of a warm page cache, by thread count
and smallest share.

The device-side table's miss server reads each call's missed experts with ``ExpertStore.read``
(equal shares over the read threads, ``MIN_SHARE_BYTES`` at least, tuned for a cold disk). From
the page cache a batch costs mostly its calls and its threads' wake-ups, not its bytes: this
probe reads random batches of 1-16 experts of one layer of a converted checkpoint, the files read
once first, at each ``--threads`` and ``--min-share-kib``, in alternating rounds, and prints the
median ms per batch and GB/s, beside one whole layer read the same way.

    python benchmarks/probes/warm_read_probe.py /tmp/bench-models/qwen3_moe-full-num_experts64-8l-packed \
        --threads 4,8,16 --min-share-kib 256,1024,4096
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: prefill.py

import numpy as np  # noqa: E402
from prefill import warm_page_cache  # noqa: E402

from moeflux_mlx.benchmark.pagecache import expert_files  # noqa: E402
from moeflux_mlx.io import store as st  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("model", type=Path, help="a converted checkpoint (or a plain one)")
    ap.add_argument("--threads", default="4,8,16")
    ap.add_argument("--min-share-kib", default="256,1024,4096")
    ap.add_argument("--batches", default="1,2,4,6,8,16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reads", type=int, default=40, help="batches per size and round")
    args = ap.parse_args()
    warm_page_cache(expert_files(args.model))
    threads = [int(v) for v in args.threads.split(",")]
    shares = [int(v) << 10 for v in args.min_share_kib.split(",")]
    sizes = [int(v) for v in args.batches.split(",")]
    # every thread on every call: the probe measures what a thread count gives, not the store's
    # choice of fewer threads for small calls from the page cache (warm_read_threads)
    stores = {t: st.open_store(args.model, "pread", threads=t, warm_threads=0)[0] for t in threads}
    layer = sorted(next(iter(stores.values())).layers)[0]
    layout = next(iter(stores.values())).layout(layer)
    out = np.empty((layout.num_experts, layout.blob_size), np.uint8)
    rng = np.random.default_rng(0)
    times = {(t, m, n): [] for t in threads for m in shares for n in sizes + [layout.num_experts]}
    for _ in range(args.rounds):
        for (t, m, n), ts in times.items():
            st.MIN_SHARE_BYTES = m
            store = stores[t]
            reads = args.reads if n < layout.num_experts else 3
            batches = [
                np.sort(rng.choice(layout.num_experts, n, replace=False)) for _ in range(reads)
            ]
            t0 = time.perf_counter()
            for b in batches:
                store.read(layer, b, out[: len(b)])
            ts.append((time.perf_counter() - t0) / reads)
    blob_mb = layout.blob_size / 1e6
    print(f"layer {layer}: {layout.num_experts} experts of {blob_mb:.2f} MB; warm page cache")
    print("\n| threads | min share KiB | experts | ms / batch | GB/s |")
    print("| --- | --- | --- | --- | --- |")
    for (t, m, n), ts in times.items():
        s = statistics.median(ts)
        print(f"| {t} | {m >> 10} | {n} | {s * 1e3:.3f} | {n * layout.blob_size / s / 1e9:.1f} |")
    for store in stores.values():
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

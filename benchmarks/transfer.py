"""How fast one layer's experts reach the device here, each way a prefill could move them: the
reads out of the page cache into host memory, and the copies from host memory to the device.

    python benchmarks/transfer.py PATH                     # a converted or plain checkpoint
    python benchmarks/transfer.py --arch qwen3_moe --size full --layers 4

A prefill at a small budget moves every expert of a layer, one layer after another
(``cache.whole_layer``); its bound is the slower of the read and the copy. Each way is timed on
one layer's bytes, page cache warm, best of ``--rounds`` after a warm-up:

- reads: the store's parallel preads with 1..16 threads into plain and into page-locked memory,
  and one thread copying out of a mapping (what ``expert_io=mmap`` did);
- copies (CUDA): the copy engine (``cuda.layer_copy.copy_layer``, what a prefill uses) out of
  page-locked staging and out of the page-locked expert files (``pin_experts``), and
  ``mx.array(numpy)`` from pageable memory;
- overlap (CUDA): a matmul load on the default stream alone, the copy engine alone, and both.

Prints a table and writes ``DATE-MACHINE-transfer.{md,json}`` to ``--out``.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import datetime  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.lib.cli import add_model_args, benchmark_model  # noqa: E402
from moeflux_mlx.commands.common import main_for  # noqa: E402
from moeflux_mlx.io.store import open_store  # noqa: E402
from moeflux_mlx.measure import free_stem, machine_name, machine_tag  # noqa: E402


def _best(fn, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _cuda() -> bool:
    return hasattr(mx, "cuda") and mx.cuda.is_available() and mx.default_device() == mx.gpu


def reads(store_path: Path, layer: int, threads_list, rounds: int, pinned) -> list:
    rows = []
    for io_mode in ("pread", "mmap"):
        for threads in threads_list if io_mode == "pread" else [1]:
            store, _ = open_store(store_path, io_mode=io_mode, threads=threads)
            try:
                lay = store.layout(layer)
                n, size = lay.num_experts, lay.blob_size
                experts = np.arange(n)
                targets = [("plain", np.empty((n, size), np.uint8))]
                if pinned is not None:
                    targets.append(("page-locked", pinned.array[: n * size].reshape(n, size)))
                for where, out in targets:
                    s = _best(lambda o=out: store.read(layer, experts, o), rounds)  # noqa: B023
                    rows.append(
                        {
                            "kind": "read",
                            "way": f"{io_mode} x{threads} -> {where}",
                            "bytes": n * size,
                            "s": s,
                        }
                    )
            finally:
                store.close()
    return rows


def copies(store_path: Path, layer: int, rounds: int, pinned) -> list:
    from moeflux_mlx.cuda import layer_copy
    from moeflux_mlx.cuda.pinned_files import LayerSources, PinnedExperts

    store, _ = open_store(store_path, io_mode="pread", threads=8)
    rows = []
    try:
        lay = store.layout(layer)
        n, size = lay.num_experts, lay.blob_size
        nbytes = n * size
        store.read(layer, np.arange(n), pinned.array[:nbytes].reshape(n, size))

        def row(way, s, note=""):
            rows.append({"kind": "copy", "way": way, "bytes": nbytes, "s": s, "note": note})

        staging = LayerSources(
            [pinned.device_ptr + c.offset for c in lay.components],
            [size] * len(lay.components),
            [
                pinned.array[:nbytes].reshape(n, size)[:, c.offset : c.offset + c.nbytes]
                for c in lay.components
            ],
        )
        files = PinnedExperts(store, [layer])
        try:
            for name, src in (
                ("page-locked staging", staging),
                ("pinned files", files.sources[layer]),
            ):
                s = _best(lambda s=src: layer_copy.copy_layer(s, lay, "layer"), rounds)
                row(f"copy engine from {name}", s)
            got = layer_copy.copy_layer(staging, lay, "layer")
            same = all(
                np.array_equal(np.array(got[c.name]), rows_)
                for c, rows_ in zip(lay.components, staging.rows)
            )
            t = _best(lambda: mx.eval([a.sum() for a in got.values()]), rounds)
            row("device reads the engine's arrays after (sum)", t, f"bytes equal: {same}")
        finally:
            files.close()
        ref = mx.ones((nbytes,), mx.uint8)
        mx.eval(ref)
        row("device reads a device array (sum)", _best(lambda: mx.eval(ref.sum()), rounds))
        plain = np.array(pinned.array[:nbytes])
        row("mx.array(numpy), pageable", _best(lambda: mx.eval(mx.array(plain) + 0), rounds))

        # overlap: a matmul load on the default stream, then the copy engine beside it
        a = mx.random.normal((8192, 8192)).astype(mx.bfloat16)
        mx.eval(a)

        def both():
            out = [a @ a for _ in range(6)]
            mx.async_eval(out)
            layer_copy.copy_layer(staging, lay, "layer")
            mx.eval(out)

        row("overlap: compute alone", _best(lambda: mx.eval([a @ a for _ in range(6)]), rounds))
        row(
            "overlap: copy engine alone",
            _best(lambda: layer_copy.copy_layer(staging, lay, "layer"), rounds),
        )
        row("overlap: both", _best(both, rounds))
    finally:
        store.close()
    return rows


def run(args) -> dict:
    args.convert = True  # a packed layer: one contiguous run, as convert writes it
    path, _ = benchmark_model(args)
    pinned = None
    if _cuda():
        from moeflux_mlx.cuda.runtime import PinnedBuffer

        store, _ = open_store(Path(path), io_mode="pread")
        lay = store.layout(args.layer)
        store.close()
        pinned = PinnedBuffer(lay.num_experts * lay.blob_size)
    rows = reads(Path(path), args.layer, args.threads, args.rounds, pinned)
    if pinned is not None:
        rows += copies(Path(path), args.layer, args.rounds, pinned)
    for r in rows:
        r["gb_s"] = r["bytes"] / r["s"] / 1e9
    return {
        "machine": args.machine or machine_name(),
        "model": str(path),
        "layer": args.layer,
        "rows": rows,
    }


def format_table(result: dict) -> str:
    lines = [
        f"{result['machine']}: layer {result['layer']} of {result['model']}",
        "",
        "| kind | way | MB | ms | GB/s | note |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['kind']} | {r['way']} | {r['bytes'] / 1e6:.0f} | {r['s'] * 1e3:.1f} | "
            f"{r['gb_s']:.1f} | {r.get('note', '')} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser)
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument(
        "--threads", type=lambda t: [int(v) for v in t.split(",")], default=[1, 4, 8, 16]
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--machine", default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")

    def go(args) -> int:
        result = run(args)
        table = format_table(result)
        print(table)
        args.out.mkdir(parents=True, exist_ok=True)
        day = datetime.date.today().isoformat()
        stem = free_stem(args.out, f"{day}-{machine_tag(result['machine'])}-transfer")
        (args.out / f"{stem}.md").write_text(table + "\n")
        (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
        return 0

    return main_for(parser, go, argv)


if __name__ == "__main__":
    sys.exit(main())

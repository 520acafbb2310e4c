"""How fast one layer's experts reach the device here, each way a prefill could move them: the
reads out of the page cache into host memory, and the copies from host memory to the device.

    python benchmarks/transfer.py PATH                     # a converted or plain checkpoint
    python benchmarks/transfer.py --arch qwen3_moe --size full --layers 4

A prefill at a small budget moves every expert of a layer, one layer after another
(``cache.whole_layer``); its bound is the slower of the read and the copy. Each way is timed on
one layer's bytes, page cache warm, best of ``--rounds`` after a warm-up:

- reads: the store's parallel preads with 1..16 threads into plain and into page-locked memory,
  and one thread copying out of a mapping (what ``expert_io=mmap`` did);
- copies (CUDA): the copy kernel out of page-locked staging and out of the page-locked expert
  files (``pin_experts``) with several block counts, out of host-advised managed memory
  (``host_array``), the copy engine (``cudaMemcpyAsync``) into a device-resident MLX array, and
  ``mx.array(numpy)``;
- overlap (CUDA): a matmul load on the default stream alone, the kernel copy alone, and both.

Prints a table and writes ``DATE-MACHINE-transfer.{md,json}`` to ``--out``.
"""

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import datetime  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.lib.cli import add_model_args, benchmark_model  # noqa: E402
from moeflux_mlx.cache.pool import host_view  # noqa: E402
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


class _Dma:
    """The copy engine through ctypes: a stream of its own and ``cudaMemcpyAsync``."""

    def __init__(self):
        from moeflux_mlx.cuda.runtime import _cudart

        self.lib, self.major = _cudart()
        self.stream = ctypes.c_void_p()
        err = self.lib.cudaStreamCreateWithFlags(ctypes.byref(self.stream), 1)
        assert not err, f"cudaStreamCreateWithFlags: {err}"

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        err = self.lib.cudaMemcpyAsync(
            ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes), 4, self.stream
        )
        assert not err, f"cudaMemcpyAsync: {err}"

    def sync(self) -> None:
        err = self.lib.cudaStreamSynchronize(self.stream)
        assert not err, f"cudaStreamSynchronize: {err}"

    def to_device(self, ptr: int, nbytes: int) -> int:
        """Advise managed memory to live on device 0 and move it there; the error code."""
        from moeflux_mlx.cuda.runtime import _location

        p, n = ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes)
        if self.major == "12":
            a = self.lib.cudaMemAdvise(p, n, 3, ctypes.c_int(0))
            b = self.lib.cudaMemPrefetchAsync(p, n, ctypes.c_int(0), self.stream)
        else:
            a = self.lib.cudaMemAdvise(p, n, 3, _location(False, 0))
            b = self.lib.cudaMemPrefetchAsync(p, n, _location(False, 0), 0, self.stream)
        self.sync()
        return a or b


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


def copies(store_path: Path, layer: int, blocks_list, rounds: int, pinned) -> list:
    from moeflux_mlx.cuda import layer_copy
    from moeflux_mlx.cuda.pinned_files import LayerSources, PinnedExperts
    from moeflux_mlx.cuda.runtime import host_array

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
            for blocks in blocks_list:
                layer_copy.LAYER_COPY_BLOCKS = blocks
                for name, src in (
                    ("page-locked staging", staging),
                    ("pinned files", files.sources[layer]),
                ):
                    s = _best(
                        lambda s=src: mx.eval(list(layer_copy.copy_pinned(s, lay).values())), rounds
                    )
                    row(f"kernel from {name}, {blocks} blocks", s)
                managed = host_array((nbytes,))
                host_view(managed).reshape(-1)[:] = pinned.array[:nbytes]
                staged = managed.reshape(n, size)
                s = _best(
                    lambda s=staged: mx.eval(list(layer_copy.copy_layer(s, lay).values())), rounds
                )
                row(f"kernel from host_array (managed), {blocks} blocks", s)
        finally:
            files.close()
            layer_copy.LAYER_COPY_BLOCKS = 16

        dma = _Dma()
        dst = mx.zeros((nbytes,), mx.uint8)
        mx.eval(dst)
        ptr = host_view(dst.reshape(1, -1)).ctypes.data  # managed from here on
        err = dma.to_device(ptr, nbytes)

        def engine():
            dma.copy(ptr, pinned.device_ptr, nbytes)
            dma.sync()

        row("copy engine, page-locked -> managed MLX array", _best(engine, rounds), f"advise {err}")
        check = np.frombuffer(memoryview(dst[:4096]), np.uint8)
        same = bool(np.array_equal(check, pinned.array[:4096]))
        t = _best(lambda: mx.eval(dst.sum()), rounds)
        row("device reads the engine's array after (sum)", t, f"bytes equal: {same}")
        ref = mx.ones((nbytes,), mx.uint8)
        mx.eval(ref)
        row("device reads a device array (sum)", _best(lambda: mx.eval(ref.sum()), rounds))
        plain = np.array(pinned.array[:nbytes])
        row("mx.array(numpy), pageable", _best(lambda: mx.eval(mx.array(plain) + 0), rounds))

        # overlap: a compute load on the default stream beside the kernel copy on another stream
        a = mx.random.normal((8192, 8192)).astype(mx.bfloat16)
        mx.eval(a)
        copy_stream = mx.new_stream(mx.default_device())

        def compute():
            return [a @ a for _ in range(6)]

        def kernel():
            with mx.stream(copy_stream):
                return list(layer_copy.copy_pinned(staging, lay).values())

        row("overlap: compute alone", _best(lambda: mx.eval(compute()), rounds))
        row("overlap: kernel copy alone", _best(lambda: mx.eval(kernel()), rounds))
        row("overlap: both", _best(lambda: mx.eval(compute() + kernel()), rounds))
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
        rows += copies(Path(path), args.layer, args.blocks, args.rounds, pinned)
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
    parser.add_argument(
        "--blocks", type=lambda t: [int(v) for v in t.split(",")], default=[16, 64, 264]
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

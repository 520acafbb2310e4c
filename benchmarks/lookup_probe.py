"""Where does the device-side table's per-layer cost go? (CUDA)

Every expert of one layer resident in the table (no miss server needed: nothing misses), then:

- host: microseconds to build one layer's ``resolve`` + ``fill`` calls (graph building only);
- GPU: a chain of ``L`` layers' worth of calls evaluated at once (each call's indices depend on
  the previous call's slots, so they run one after another), per call, against the same chain
  of a trivial custom kernel (the launch floor) and of ``resolve`` or ``fill`` alone.

    python benchmarks/lookup_probe.py [--calls 400] [--top-k 8]
"""

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from moeflux_mlx import device_table  # noqa: E402
from moeflux_mlx.upload import PinnedBuffer  # noqa: E402

COPY = mx.fast.cuda_kernel(
    name="probe_copy", input_names=["inds"], output_names=["out"],
    source="if (threadIdx.x < inds_shape[0]) out[threadIdx.x] = inds[threadIdx.x];")


def layout_like_qwen3_30b():
    comps = []
    at = 0
    for name, nbytes in (("gate_w", 786432), ("gate_s", 49152), ("gate_b", 49152),
                         ("up_w", 786432), ("up_s", 49152), ("up_b", 49152),
                         ("down_w", 786432), ("down_s", 49152), ("down_b", 49152)):
        comps.append(SimpleNamespace(name=name, offset=at, nbytes=nbytes))
        at += nbytes
    return SimpleNamespace(components=comps, blob_size=at)


def timed(fn, reps=5):
    best = float("inf")
    for _ in range(reps):
        mx.synchronize()
        t = time.perf_counter()
        fn()
        mx.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    args = ap.parse_args()
    n_exp, k, calls = args.experts, args.top_k, args.calls
    layout = layout_like_qwen3_30b()
    control = device_table.make_control({0: (n_exp, n_exp)})
    t = control.layers[0]
    t.slot_of[:] = np.arange(n_exp)  # every expert resident, slot = a permutation
    staging = PinnedBuffer(k * layout.blob_size)
    pools = {c.name: mx.zeros((n_exp, c.nbytes), mx.uint8) for c in layout.components}
    mx.eval(list(pools.values()))
    inds0 = mx.array(np.random.default_rng(0).choice(n_exp, k, replace=False).astype(np.uint32))

    def resolve_fill(inds):
        return device_table.resolve(control, staging, 0, inds, pools, layout)

    launch = t.launches.get(k) or device_table._Launches.make(control, staging, 0, layout, k)
    t.launches[k] = launch

    def resolve_only(inds):
        return device_table._resolve_kernel()(inputs=[inds, launch.meta],
                                              **launch.resolve_kwargs)[0][:k]

    def fill_only(inds):
        slots = mx.concatenate([inds, mx.zeros((1,), mx.uint32)])
        return launch.fill(inputs=[slots, launch.meta, *[pools[c.name] for c in layout.components]],
                           **launch.fill_kwargs)[0]

    def trivial(inds):
        return COPY(inputs=[inds], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                    output_shapes=[(k,)], output_dtypes=[mx.uint32])[0]

    rows = []
    for name, fn in (("trivial kernel", trivial), ("resolve + fill", resolve_fill),
                     ("resolve alone", resolve_only), ("fill alone", fill_only)):
        mx.eval(fn(inds0))  # compile
        # host: building the calls only
        t0 = time.perf_counter()
        outs = [fn(inds0) for _ in range(calls)]
        host_us = (time.perf_counter() - t0) / calls * 1e6
        mx.eval(outs)
        del outs

        def chain():
            x = inds0
            for _ in range(calls):
                x = fn(x)
            mx.eval(x)
        total_us = timed(chain) / calls * 1e6
        rows.append((name, host_us, total_us))
    print(f"{calls} calls, top-{k}, {n_exp} experts, device {mx.default_device()}, "
          f"ticks {int(control.ticks[0])}")
    print("| call | host build us/call | chained, built + run, us/call |")
    print("|---|---|---|")
    for name, h, tot in rows:
        print(f"| {name} | {h:.1f} | {tot:.1f} |")
    staging.close()
    control.close()


if __name__ == "__main__":
    main()

"""What one host sync per MoE layer costs on this MLX device, piece by piece.

Times the pieces of the synced path in isolation: a round trip to read a small result back to
the host (the sync itself), uploading a few slot indices, an async_eval dispatch, and the host
bookkeeping (np.unique and the slot lookup). Prints a table (microseconds, medians).
"""

import statistics
import time

import mlx.core as mx
import numpy as np


def med(fn, n=200):
    for _ in range(10):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e6 * statistics.median(ts)


def main():
    logits = mx.random.normal((1, 1, 128))
    mx.eval(logits)
    slot_of = np.arange(128)

    def sync():  # a router-sized op evaluated and read back
        np.array(mx.argpartition(-logits, kth=7, axis=-1)[..., :8])

    def upload():
        mx.eval(mx.array(slot_of[:8].astype(np.uint32)) + 1)

    def async_eval():
        mx.async_eval(logits * 2)

    idx = np.random.randint(0, 128, (1, 1, 8))

    def bookkeeping():
        experts, inverse = np.unique(idx, return_inverse=True)
        slot_of[experts]
        slot_of[experts][inverse].reshape(idx.shape)

    rows = [
        ("sync: eval + read back router indices", med(sync)),
        ("upload 8 slot indices (mx.array + eval)", med(upload)),
        ("async_eval dispatch", med(async_eval)),
        ("host bookkeeping (unique, slot lookup)", med(bookkeeping)),
    ]
    mx.synchronize()
    print(f"device {mx.default_device()}")
    for name, us in rows:
        print(f"{name:45s} {us:8.1f} us")


if __name__ == "__main__":
    main()

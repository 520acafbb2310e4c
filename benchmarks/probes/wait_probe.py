"""Can the GPU wait for the host mid-graph, and what does one round trip cost? (CUDA only)

A per-layer host sync (read the router's choice back, then build the rest of the graph) makes
the GPU idle while Python builds each layer. The alternative probed here: a one-thread kernel
publishes a request into host-resident memory and spins until a host thread answers, so the
whole token's graph is built and enqueued at once, as stock mlx-lm does, and only the GPU waits.

Prints per-"layer" times (microseconds) of a chain of LAYERS small matvecs, four ways:
no waiting; a host sync per layer (np.array of a small result); a device wait answered by a
Python thread per layer; the device wait with no request (what a hit costs). Each both with the
next chain built while the GPU runs this one (as mlx-lm's generate does) and without.
"""

import statistics
import sys
import threading
import time

import mlx.core as mx
import numpy as np

sys.path.insert(0, ".")  # run from the repository root
from moeflux_mlx.cache.pool import host_view  # noqa: E402
from moeflux_mlx.cuda.runtime import host_staging  # noqa: E402

LAYERS = 48
REQ, DONE, TIMEOUTS = 0, 256, 512

SOURCE = """
    int* c = const_cast<int*>(reinterpret_cast<const int*>(ctrl));
    volatile int* vc = c;
    __shared__ int ok;
    if (threadIdx.x == 0) {
      ok = 1;
      if (NEED) {
        int seq = vc[DONE + L] + 1;
        vc[REQ + L] = seq;
        __threadfence_system();
        unsigned long long t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        while (vc[DONE + L] != seq) {
          __nanosleep(200);
          asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
          if (t - t0 > 2000000000ull) { vc[TIMEOUTS + L] += 1; ok = 0; break; }
        }
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < x_shape[0]; i += blockDim.x) y[i] = x[i];
"""

_kernel = mx.fast.cuda_kernel(
    name="wait_probe",
    input_names=["x", "ctrl"],
    output_names=["y"],
    source=SOURCE.replace("REQ", str(REQ))
    .replace("DONE", str(DONE))
    .replace("TIMEOUTS", str(TIMEOUTS)),
)


def wait(x, ctrl, layer, need):
    return _kernel(
        inputs=[x, ctrl],
        template=[("L", layer), ("NEED", int(need))],
        grid=(256, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[x.shape],
        output_dtypes=[x.dtype],
    )[0]


class Service(threading.Thread):
    def __init__(self, words):
        super().__init__(daemon=True)
        self.words, self.stop, self.served = words, False, 0

    def run(self):
        req, done = self.words[REQ : REQ + LAYERS], self.words[DONE : DONE + LAYERS]
        while not self.stop:
            pending = np.nonzero(req != done)[0]
            if pending.size:
                done[pending] = req[pending]
                self.served += pending.size
            else:
                time.sleep(0)


def chain(x, w, mode, ctrl):
    for layer in range(LAYERS):
        x = (w @ x) * 0.01 + x
        if mode == "sync":
            np.array(x[:8])
        elif mode in ("wait", "hit"):
            x = wait(x, ctrl, layer, mode == "wait")
    return x


def timed(mode, pipelined, w, x0, ctrl, reps=30):
    ts = []
    x = x0
    if pipelined:
        y = chain(x, w, mode, ctrl)
        mx.async_eval(y)
        for _ in range(reps):
            t = time.perf_counter()
            nxt = chain(y, w, mode, ctrl)
            mx.async_eval(nxt)
            mx.eval(y)
            ts.append(time.perf_counter() - t)
            y = nxt
        mx.eval(y)
    else:
        for _ in range(reps):
            t = time.perf_counter()
            mx.eval(chain(x, w, mode, ctrl))
            ts.append(time.perf_counter() - t)
    return 1e6 * statistics.median(ts[3:]) / LAYERS


def main():
    print(f"device {mx.default_device()}")
    ctrl = host_staging((4096,))
    if ctrl is None:
        print("no CUDA runtime: nothing to probe")
        return 1
    words = host_view(ctrl).reshape(-1).view(np.int32)
    svc = Service(words)
    svc.start()
    w = mx.random.normal((2048, 2048)).astype(mx.float16)
    x0 = mx.random.normal((2048,)).astype(mx.float16)
    mx.eval(w, x0)
    rows = []
    for mode in ("none", "sync", "wait", "hit"):
        for pipelined in (False, True):
            rows.append((mode, pipelined, timed(mode, pipelined, w, x0, ctrl)))
    svc.stop = True
    base = {p: us for m, p, us in rows if m == "none"}
    print(f"{'mode':6s} {'pipelined':9s} {'us/layer':>9s} {'over none':>10s}")
    for mode, p, us in rows:
        print(f"{mode:6s} {str(p):9s} {us:9.1f} {us - base[p]:10.1f}")
    print(
        f"requests served {svc.served}, timeouts {int(words[TIMEOUTS : TIMEOUTS + LAYERS].sum())}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

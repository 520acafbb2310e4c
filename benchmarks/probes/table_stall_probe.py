"""Does the device-side table stall, and how long does the GPU wait per miss? (CUDA)

Decodes a random-weight model through the device-side table (the flow of the tests and the
benchmark: a short warm-up generation, then a longer prompt and decode) with a short GPU wait
timeout, with faulthandler dumps of every thread's stack every 2 s (a C watchdog: no GIL needed)
and a timestamped log of the main thread's streaming-module calls. Prints the GPU's waits per
layer (count and mean) and, on a stall, where the main thread was.

History: with the miss service as a thread of the model's process (before the miss server
process), this probe showed why requests went unanswered: for the whole GPU wait no poll ran,
while the main thread sat in ``mx.async_eval`` (mlx-lm's generate loop) holding the GIL
(benchmarks/results/2026-11-23-h200-notes.md). Later its second generation seemed to hang in
the prefill; ``hang_probe.sh`` (this probe under a watchdog, native stacks by py-spy) showed MLX
compiling kernels for the new prompt size with NVRTC, with or without the table
(benchmarks/results/2026-11-23-h100-notes.md): give a fresh machine minutes.

    python benchmarks/probes/table_stall_probe.py [--size tiny] [--budget 0.3] [--tokens 24]
"""

import argparse
import faulthandler
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("MOEFLUX_WAIT_TIMEOUT_S", "3")
os.environ.setdefault("MOEFLUX_DEVICE_TABLE", "1")  # 0: the same flow with host syncs
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

import moeflux_mlx  # noqa: E402
from moeflux_mlx.format.checkpoint import expert_layout  # noqa: E402
from moeflux_mlx.format.convert import convert  # noqa: E402
from moeflux_mlx.model import switch as mod  # noqa: E402
from moeflux_mlx.testing import synth  # noqa: E402

T0 = time.perf_counter()
EVENTS = []  # (t, thread, what)


def note(what):
    EVENTS.append((time.perf_counter() - T0, threading.current_thread().name, what))


MONITOR = r"""
import json, sys, time
from moeflux_mlx.cuda.control_block import ControlBlock
spec = json.loads(sys.argv[1])
c = ControlBlock({int(k): v for k, v in spec.items()}, fd=int(sys.argv[2]))
t0 = time.time()
while True:
    waits = [int(c.layers[l].header["waits"]) for l in c.order]
    print(f"monitor {time.time() - t0:6.1f}s requests {c.requests.tolist()} answers "
          f"{c.answers.tolist()} ticks {c.ticks.tolist()} expected {c.expected.tolist()} "
          f"faults {c.faults.tolist()} waits {waits}", file=sys.stderr, flush=True)
    time.sleep(1.0)
"""


def start_monitor(control):
    """Prints the control block every second from another process (no GIL of ours needed)."""
    return subprocess.Popen(
        [sys.executable, "-c", MONITOR, json.dumps(control.spec), str(control.fd)],
        pass_fds=(control.fd,),
    )


def instrument():
    call = mod.StreamingSwitchGLU.__call__

    def traced_call(self, x, indices):
        note(f"module layer {self.layer} tokens {indices.size // indices.shape[-1]}")
        return call(self, x, indices)

    mod.StreamingSwitchGLU.__call__ = traced_call


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--budget", type=float, default=0.3)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=64)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp())
    over = {"num_hidden_layers": args.layers} if args.layers else None
    src = synth.build_checkpoint(root / "m", "qwen3_moe", args.size, seed=1, overrides=over)
    packed = convert(src, root / "p", progress=False)
    total = expert_layout(packed).total_expert_bytes
    instrument()
    model, _ = moeflux_mlx.load(packed, cache_budget=int(args.budget * total), expert_io="pread")
    rt = model.moeflux
    control = getattr(rt.cache, "control", None)  # only the device-side table has one
    print("table layers", control.order if control is not None else None)
    monitor = start_monitor(control) if control is not None else None
    faulthandler.dump_traceback_later(5, repeat=True)
    ok = True
    try:
        for label, n_prompt, n in (("warm-up", 8, 4), ("run", args.prompt, args.tokens)):
            prompt = mx.random.randint(0, 256, (n_prompt,)).astype(mx.uint32)
            note(f"--- {label} start")
            t = time.perf_counter()
            toks = [
                int(y) for (y, _), _ in zip(generate_step(prompt, model, max_tokens=n), range(n))
            ]
            mx.synchronize()
            note(f"--- {label} end")
            print(f"{label}: {len(toks)} tokens in {time.perf_counter() - t:.2f} s")
    except Exception as e:  # noqa: BLE001
        ok = False
        print("FAILED", type(e).__name__, str(e)[:400])
    finally:
        faulthandler.cancel_dump_traceback_later()
        if monitor is not None:
            monitor.kill()
    c = control
    if c is None:
        print("no device-side table here (needs CUDA)")
        return
    print(
        "requests",
        c.requests.tolist(),
        "answers",
        c.answers.tolist(),
        "ticks",
        c.ticks.tolist(),
        "expected",
        c.expected.tolist(),
        "faults",
        c.faults.tolist(),
    )
    for layer in c.order:
        n, us = rt.cache.server.waits(layer)
        print(f"layer {layer}: GPU waits {n}, {us / max(n, 1):.0f} us each on average")
    print("stats", rt.stats_dict()["total"])
    if not ok:
        for e in EVENTS[-20:]:
            print(f"  {e[0]:9.4f} {e[1]:24s} {e[2]}")
    rt.close()
    print("RESULT", "ok" if ok else "STALLED")


if __name__ == "__main__":
    main()

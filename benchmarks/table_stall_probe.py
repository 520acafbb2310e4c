"""Where are the threads when a device-table wait stalls? (CUDA; diagnostics for README's known
problem.) Decodes a tiny model through the table with a short GPU wait timeout while
faulthandler dumps every thread's Python stack every 3 s, and a heartbeat thread records the
longest time it could not run (the GIL held elsewhere)."""

import faulthandler
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("MOEFLUX_WAIT_TIMEOUT_S", "6")
os.environ["MOEFLUX_DEVICE_TABLE"] = "1"
sys.path.insert(0, ".")

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

import moeflux_mlx  # noqa: E402
from moeflux_mlx import synth  # noqa: E402
from moeflux_mlx.checkpoint import expert_layout  # noqa: E402
from moeflux_mlx.convert import convert  # noqa: E402

root = Path(tempfile.mkdtemp())
src = synth.build_checkpoint(root / "m", "qwen3_moe", "tiny", seed=1)
packed = convert(src, root / "p", progress=False)
total = expert_layout(packed).total_expert_bytes
gaps = [0.0]
stop = False


def heartbeat():
    last = time.perf_counter()
    while not stop:
        time.sleep(0.001)
        now = time.perf_counter()
        gaps[0] = max(gaps[0], now - last)
        last = now


threading.Thread(target=heartbeat, daemon=True).start()
model, _ = moeflux_mlx.load(packed, cache_budget=int(0.6 * total), expert_io="pread")
prompt = mx.array([5, 9, 13, 200, 77, 31, 8])
faulthandler.dump_traceback_later(3, repeat=True)
t = time.perf_counter()
try:
    toks = [int(y) for (y, _), _ in zip(generate_step(prompt, model, max_tokens=24), range(24))]
    print("tokens", toks)
except Exception as e:
    print("FAILED", type(e).__name__, e)
finally:
    faulthandler.cancel_dump_traceback_later()
    stop = True
print(f"decode {time.perf_counter() - t:.1f} s; longest heartbeat gap {gaps[0] * 1e3:.1f} ms")
print("stats", model.moeflux.stats.total())

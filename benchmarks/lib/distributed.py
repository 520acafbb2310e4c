"""Streaming over several processes, measured against one process: a pipeline (each rank its
layers) and tensor parallelism (each rank a part of every expert), each rank on a GPU of its own
where there are enough, under the same per-process cache budget as one process.

A *job* is one launch: one process alone, or ``n`` ranks joined by MLX's ring backend (every
collective through the CPU and TCP, ``send`` / ``recv`` included: what carries a pipeline on
CUDA, whose NCCL backend has no ``send``) or by NCCL (collectives on the GPU; tensor parallelism).
Every process of a job runs the same *steps*, each a model loaded, its routers replaying a routing
trace where one is given, and greedy decodes from one prompt:

- ``stock``: stock mlx-lm (``mlx_lm.load``, or ``mlx_lm.utils.sharded_load`` with the job's
  group): the tokens and log-probs to match;
- ``moeflux``: ``moeflux_mlx.load`` / ``sharded_load`` at a cache budget, decoding with a warm
  page cache and then (``cold``) with the experts' files dropped from it throughout, as if they
  were many times RAM; each rank counts its own reads.

Each process writes what it saw (tokens, a digest and the chosen token's value of every step's
log-probs, decode rate, its reads) as JSON; the script ``benchmarks/distributed.py`` joins the
ranks and the jobs, and compares them.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import mlx_lm
import numpy as np

from benchmarks.lib.trace_routing import drive_routing, load_trace
from moeflux_mlx.io.bandwidth import PageCacheDropper, expert_files
from moeflux_mlx.measure import timed_greedy
from moeflux_mlx.model.load import load
from moeflux_mlx.model.sharded import sharded_load
from moeflux_mlx.options import LoadOptions, Tuning

# what mlx.launch sets for a rank; a launch sets its own, never inherits them
_LAUNCH_VARS = ("MLX_RANK", "MLX_HOSTFILE", "MLX_WORLD_SIZE", "NCCL_HOST_IP", "NCCL_PORT")


def free_ports(n: int) -> List[int]:
    """``n`` TCP ports free on 127.0.0.1 now."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def rank_env(rank: int, n: int, backend: str, where: Path, gpus: int = 0, base=None) -> dict:
    """The environment of rank ``rank`` of ``n`` on this machine, as ``mlx.launch`` sets it.

    Args:
        rank, n: the rank and the group's size.
        backend: ``ring`` (a hostfile of one 127.0.0.1 port per rank, written into ``where``) or
            ``nccl`` (``MLX_WORLD_SIZE``, and rank 0's address and a port).
        where: a folder for the hostfile; ranks of one launch must be given the same.
        gpus: GPUs on this machine; with at least ``n``, rank ``r`` sees only GPU ``r``
            (``mlx.launch`` does so for NCCL only: ring ranks would all compute on GPU 0).
        base: the environment to start from (default: this process's).

    Returns:
        The environment.

    Raises:
        ValueError: another backend.
    """
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in _LAUNCH_VARS}
    env.update(MLX_RANK=str(rank), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if backend == "ring":
        hostfile = Path(where) / "hosts.json"
        if rank == 0 or not hostfile.exists():
            hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
        env["MLX_HOSTFILE"] = str(hostfile)
    elif backend == "nccl":
        port = Path(where) / "nccl-port"
        if rank == 0 or not port.exists():
            port.write_text(str(free_ports(1)[0]))
        env.update(MLX_WORLD_SIZE=str(n), NCCL_HOST_IP="127.0.0.1", NCCL_PORT=port.read_text())
        env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared hosts
    else:
        raise ValueError(f"no launch for the {backend!r} backend (ring, nccl)")
    if gpus >= n:
        env["CUDA_VISIBLE_DEVICES"] = str(rank)
    return env


def start_ranks(argv, n: int, backend: str, where: Path, gpus: int = 0, outputs=None) -> list:
    """``argv(rank)`` in ``n`` processes on this machine joined by ``backend`` (``rank_env``).

    Args:
        outputs: a file per rank for its standard output and error (default: pipes, read
            with ``communicate``).

    Returns:
        The ``subprocess.Popen`` of each rank, in rank order.
    """
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return [
        subprocess.Popen(
            argv(r),
            env=rank_env(r, n, backend, where, gpus),
            stdin=subprocess.DEVNULL,
            **(pipes if outputs is None else dict(stdout=outputs[r], stderr=subprocess.STDOUT)),
        )
        for r in range(n)
    ]


def gpu_count() -> int:
    """CUDA GPUs MLX can use here (0 without a CUDA build)."""
    if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        return 0
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return 1
    return max(1, sum(line.startswith("GPU ") for line in out.splitlines()))


# --------------------------------------------------------------------------- one process's steps


def _decode(model, prompt, tokens: int, on_first=None) -> dict:
    """Greedy decode of ``tokens`` tokens after ``prompt``: tokens, per-step log-prob digests and
    the chosen token's log-prob, seconds of prefill and of decode (timed from the first token;
    ``on_first`` runs before that)."""
    out, lps, prefill_s, decode_s = timed_greedy(model, prompt, tokens, on_first)
    rows = [np.array(lp.astype(mx.float32)).reshape(-1) for lp in lps]
    return {
        "tokens": out,
        "logprob_sha1": [hashlib.sha1(r.tobytes()).hexdigest()[:16] for r in rows],
        "logprob": [float(r[t]) for r, t in zip(rows, out)],
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "decode_tps": (len(out) - 1) / decode_s,
    }


def _counters(rt, n: int) -> dict:
    rt.stats_dict()  # folds in what the miss server read, if any
    t = rt.stats.total()
    return {
        "experts_read_per_token": t.experts_read / n,
        "mb_read_per_token": t.bytes_read / n / 1e6,
        "hit_rate": rt.stats.hit_rate if t.experts_routed else None,
        # the device-side table serves decode without a host sync; every other cache syncs
        "lookup": "device table" if rt.cache.name == "table" else "host",
        "cache": rt.cache.name,
        "io_ms_per_token": 1e3 * t.io_s / n,
        "gpu_wait_ms_per_token": 1e3 * t.gpu_wait_s / n,
    }


@contextlib.contextmanager
def _barrier_on_group_stream(backend: str):
    """mlx-lm 0.32's ``sharded_load`` ends with an ``all_sum`` on ``stream=mx.cpu``, which MLX
    0.32's NCCL backend cannot run ("There is no Stream(gpu, 1) in current thread"): under NCCL,
    while stock loads, ``all_sum`` ignores the stream it is given (the group's own is the GPU's)."""
    if backend != "nccl":
        yield
        return
    all_sum = mx.distributed.all_sum

    def on_group_stream(x, *args, stream=None, **kwargs):
        return all_sum(x, *args, **kwargs)

    mx.distributed.all_sum = on_group_stream
    try:
        yield
    finally:
        mx.distributed.all_sum = all_sum


def run_step(step: dict, spec: dict, group) -> dict:
    """One step of a job in this process (``spec``: the job's; ``group``: its group or None).

    Returns:
        ``{phase: decode results}`` (``_decode``'s, and the reads of a moeflux model), plus
        ``share``: the MB of experts this process holds of the whole model's.
    """
    layout = spec["layout"]
    groups = {}
    if group is not None:
        groups = {"pipeline_group" if layout == "pipeline" else "tensor_group": group}
    prompt = mx.array(spec["prompt"], dtype=mx.uint32)
    tokens = spec["decode_tokens"]
    if step["kind"] == "stock":
        if groups:
            with _barrier_on_group_stream(spec["backend"]):
                model, _ = mlx_lm.utils.sharded_load(spec["stock_model"], **groups)
        else:
            model, _ = mlx_lm.load(spec["stock_model"])
        rt = None
    else:
        opts = dict(
            expert_io=spec.get("expert_io", "pread"),
            cache_budget=step["budget"],
            backend=step.get("backend"),
            # the slot lookup, the machine's choice for a user: a step may set it
            options=LoadOptions(tuning=Tuning(device_table=step.get("device_table"))),
        )
        if groups:
            model, _ = sharded_load(spec["model"], **groups, **opts)
        else:
            model, _ = load(spec["model"], **opts)
        rt = model.moeflux
    out: Dict[str, dict] = {}
    try:
        if spec.get("trace"):
            drive_routing(
                model, load_trace(spec["trace"]), spec["trace"], moe_layers=spec["moe_layers"]
            )
        _decode(model, prompt, 4)  # warm-up: kernels of these shapes, allocator, page cache
        for phase in step.get("phases", ["warm"]):
            cold = phase == "cold" and rt is not None
            # pread: dropped throughout, as if the experts were many times RAM (docs/benchmarks.md)
            dropping = (
                PageCacheDropper(expert_files(Path(spec["model"])))
                if cold
                else contextlib.nullcontext()
            )
            with dropping:  # the counters start at the first decoded token (on_first)
                run = _decode(model, prompt, tokens, rt.reset_stats if rt is not None else None)
            if rt is not None:
                run.update(_counters(rt, max(len(run["tokens"]) - 1, 1)))
            out[phase] = run
        if rt is not None:
            out["share"] = {
                "mb": rt.layout.total_expert_bytes / 1e6,
                "layers": sorted(rt.layout.layers),
                # the budget this process was given (its slots hold what fits in it)
                "budget_mb": rt.budget.bytes / 1e6,
            }
    finally:
        if rt is not None:
            rt.close()
        del model
        gc.collect()
        mx.clear_cache()
    return out


def run_job(spec: dict) -> dict:
    """Every step of ``spec`` in this process, which is one rank of the job's group (or alone).

    Returns:
        ``{"rank", "size", "device", "steps": {name: run_step's}}``; an error in a step is kept
        as ``{"error": "..."}`` and the next steps still run (so one failure leaves the others'
        figures), except in a group, where the other ranks would wait: there it is raised.
    """
    group = None
    if spec["layout"] != "single":
        group = mx.distributed.init(strict=True, backend=spec["backend"])
    result: Dict[str, object] = {
        "rank": group.rank() if group is not None else 0,
        "size": group.size() if group is not None else 1,
        "device": str(mx.default_device()),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    steps: Dict[str, dict] = {}
    for step in spec["steps"]:
        try:
            steps[step["name"]] = run_step(step, spec, group)
        except Exception as e:  # noqa: BLE001 - reported per step, as the benchmark's row
            if group is not None:
                raise
            steps[step["name"]] = {"error": f"{type(e).__name__}: {e}"}
    result["steps"] = steps
    return result


def worker_main(spec_path: str) -> int:
    """Entry point of a job's process: run the job of ``spec_path`` (JSON) and write this rank's
    results next to it (``rank{R}.json``)."""
    spec = json.loads(Path(spec_path).read_text())
    result = run_job(spec)
    out = Path(spec_path).with_name(f"rank{result['rank']}.json")
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)  # a reader never sees half a file
    return 0


# the repository's root (benchmarks/lib/..), and what a job's process runs: worker_main, imported
# from there whatever the process's working directory
_ROOT = Path(__file__).resolve().parents[2]
_WORKER = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from benchmarks.lib.distributed import worker_main; sys.exit(worker_main(sys.argv[2]))"
)


def launch_job(spec: dict, where: Path, ranks: int, timeout: float, gpus: int = 0) -> dict:
    """Run ``spec`` as a job: one process (``ranks`` 1) or ``ranks`` joined by
    ``spec["backend"]``, in a fresh folder ``where``; returns ``{"ranks": [each rank's results],
    "rc": [...], "log": ...}`` (a rank that wrote nothing is missing from ``ranks``)."""
    where = Path(where)
    where.mkdir(parents=True, exist_ok=True)
    for old in where.glob("rank*.json"):
        old.unlink()
    spec_path = where / "spec.json"
    spec_path.write_text(json.dumps(spec))
    argv = [sys.executable, "-c", _WORKER, str(_ROOT), str(spec_path)]
    logs = [open(where / f"log{r}.txt", "w") for r in range(ranks)]
    t0 = time.perf_counter()
    try:
        if ranks == 1:
            env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = "0"
            procs = [
                subprocess.Popen(
                    argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=logs[0],
                    stderr=subprocess.STDOUT,
                )
            ]
        else:
            procs = start_ranks(lambda r: argv, ranks, spec["backend"], where, gpus, logs)
        rcs = _wait_all(procs, timeout)
    finally:
        for f in logs:
            f.close()
    found = [json.loads(f.read_text()) for f in sorted(where.glob("rank*.json"))]
    tail = "".join(
        f"-- rank {r}\n" + "".join((where / f"log{r}.txt").read_text().splitlines(True)[-15:])
        for r in range(ranks)
    )
    return {"ranks": found, "rc": rcs, "seconds": time.perf_counter() - t0, "log": tail}


def _wait_all(procs: Sequence[subprocess.Popen], timeout: float) -> List[Optional[int]]:
    """Each process's exit status; one still running after ``timeout`` s, or a few seconds after
    another failed (it would wait in a collective), is killed and gets None."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            end = min(end, time.monotonic() + 5)  # let the others exit by themselves first
        time.sleep(0.2)
    killed = [p.poll() is None for p in procs]
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    return [None if k else p.returncode for p, k in zip(procs, killed)]

"""Distributed streaming against one process: a pipeline and tensor parallelism over two (or
``--ranks``) processes, each on a GPU of its own where the machine has enough, each rank under the
same cache budget as one process (``--budget``, a fraction of the *whole* model's expert bytes).

    python benchmarks/distributed.py                       # tiny model, CPU, ring backend
    python benchmarks/distributed.py --size full --layers 8 --set num_experts=64 \\
        --routing-trace benchmarks/results/traces/2026-11-25-trained-text.npz   # on two GPUs

Three jobs, one after the other in this one run (``benchmarks/lib/distributed.py``):

- ``single``: one process: stock mlx-lm, moeflux at the budget (warm page cache, then cold:
  the experts' files dropped from it throughout), on CUDA also with the host-synced lookup (as
  tensor parallelism uses), and every expert resident;
- ``pipeline``: the ranks over MLX's ring backend (MLX's NCCL has no ``send`` / ``recv``): moeflux
  at the budget, warm and cold, and every expert resident (the transport's cost per token);
- ``tensor``: the ranks over NCCL on two GPUs, else ring: stock ``mlx_lm.utils.sharded_load``,
  moeflux with the ops backend at the budget (to match stock's bits), with the default backend
  at the budget, warm and cold, and every expert resident.

Checks (a failure prints MISMATCH and exits 1): the pipeline's greedy tokens and log-probs equal
one process's bit for bit, phase by phase; tensor parallelism's with the ops backend equal stock
``sharded_load``'s with the same group. Reports decode tok/s and its ratio to one process, each
rank's MB read and hit rate per token, and the I/O bound of one shared disk (its cold random-read
bandwidth over all ranks' bytes per token). Writes ``DATE-MACHINE-distributed.{md,json}`` to
``--out`` (never overwriting).
"""

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.lib.cli import add_model_args, benchmark_model  # noqa: E402
from benchmarks.lib.distributed import gpu_count, launch_job  # noqa: E402
from benchmarks.lib.trace_routing import REPLAYED_ROUTING  # noqa: E402
from moeflux_mlx.commands.common import UsageError, main_for  # noqa: E402
from moeflux_mlx.format.checkpoint import expert_layout  # noqa: E402
from moeflux_mlx.io.bandwidth import read_bandwidth  # noqa: E402
from moeflux_mlx.measure import free_stem, machine_name, machine_tag  # noqa: E402
from moeflux_mlx.options import user_cache_dir  # noqa: E402

JOBS = ("single", "pipeline", "tensor")


def job_steps(job: str, budget: int, cuda: bool) -> List[dict]:
    """What each process of ``job`` runs (``run_step``'s steps)."""
    at = dict(kind="moeflux", budget=budget, phases=["warm", "cold"])
    resident = dict(name="moeflux resident", kind="moeflux", budget="all", phases=["warm"])
    if job == "single":
        steps = [dict(name="stock", kind="stock"), dict(at, name="moeflux")]
        if cuda:  # the lookup tensor parallelism uses (its ranks read parts, not whole experts)
            steps.append(dict(at, name="moeflux host lookup", device_table=False))
        return steps + [resident]
    if job == "pipeline":
        return [dict(at, name="moeflux"), resident]
    return [
        dict(name="stock", kind="stock"),
        dict(at, name="moeflux ops", backend="ops", phases=["warm"]),
        dict(at, name="moeflux"),
        resident,
    ]


def _same(a: dict, b: dict) -> bool:
    return a["tokens"] == b["tokens"] and a["logprob_sha1"] == b["logprob_sha1"]


def _first_difference(a: dict, b: dict) -> Optional[int]:
    diff = [i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y]
    return diff[0] if diff else None


def checks(jobs: Dict[str, dict]) -> List[dict]:
    """The exactness checks between the jobs' rank-0 results that ran: each ``{what, ok,
    detail}``."""
    out = []

    def steps(job):
        ranks = jobs.get(job, {}).get("ranks") or []
        return ranks[0]["steps"] if ranks else {}

    single, pipe, tensor = steps("single"), steps("pipeline"), steps("tensor")
    for name in ("moeflux", "moeflux resident"):
        for phase in ("warm", "cold"):
            a, b = single.get(name, {}).get(phase), pipe.get(name, {}).get(phase)
            if a and b:
                ok = _same(a, b)
                lp = max(abs(x - y) for x, y in zip(a["logprob"], b["logprob"]))
                out.append(
                    dict(
                        what=f"pipeline {name}, {phase}: tokens and log-probs = one process",
                        ok=ok,
                        detail=f"{len(b['tokens'])} tokens, first difference "
                        f"{_first_difference(a, b)}, max |d log-prob of the token| {lp:.3g}",
                    )
                )
    stock = tensor.get("stock", {}).get("warm")
    for name, must in (("moeflux ops", True), ("moeflux", False)):
        got = tensor.get(name, {}).get("warm")
        if stock and got:
            same = sum(x == y for x, y in zip(stock["tokens"], got["tokens"]))
            lp = max(abs(x - y) for x, y in zip(stock["logprob"], got["logprob"]))
            out.append(
                dict(
                    what=f"tensor parallel {name}: tokens and log-probs = stock sharded_load"
                    + ("" if must else " (fused kernels: rounding may differ; not required)"),
                    ok=_same(stock, got) if must else None,
                    detail=f"{same}/{len(stock['tokens'])} tokens equal, first difference "
                    f"{_first_difference(stock, got)}, max |d log-prob of the token| {lp:.3g}",
                )
            )
    return out


def rows(jobs: Dict[str, dict], bandwidth: Optional[float]) -> List[dict]:
    """One row per job, step and phase: rank 0's decode rate, every rank's reads."""
    single = (jobs.get("single", {}).get("ranks") or [{}])[0].get("steps", {})
    out = []
    for job, res in jobs.items():
        ranks = res.get("ranks") or []
        if not ranks:
            continue
        for name, step in ranks[0]["steps"].items():
            if "error" in step:
                out.append(dict(job=job, step=name, error=step["error"]))
                continue
            for phase in ("warm", "cold"):
                run = step.get(phase)
                if run is None:
                    continue
                per_rank = [r["steps"].get(name, {}).get(phase, {}) for r in ranks]
                mb = [r.get("mb_read_per_token") for r in per_rank]
                row = dict(
                    job=job,
                    ranks=len(ranks),
                    step=name,
                    phase=phase,
                    decode_tps=run["decode_tps"],
                    mb_read_per_token=mb,
                    hit_rate=[r.get("hit_rate") for r in per_rank],
                    # every expert resident: nothing is looked up
                    lookup=run.get("lookup", "-") if run.get("hit_rate") is not None else "-",
                    share_mb=[r["steps"].get(name, {}).get("share", {}).get("mb") for r in ranks],
                )
                base = single.get(name, {}).get(phase)
                if job != "single" and base and name != "stock":
                    row["x_one_process"] = run["decode_tps"] / base["decode_tps"]
                    row["extra_ms_per_token"] = 1e3 * (
                        1 / run["decode_tps"] - 1 / base["decode_tps"]
                    )
                host = single.get("moeflux host lookup", {}).get(phase)
                if job == "tensor" and name == "moeflux" and host:
                    row["x_one_process_host_lookup"] = run["decode_tps"] / host["decode_tps"]
                total = sum(m for m in mb if m)
                if bandwidth and total and phase == "cold":
                    row["io_bound_tps"] = bandwidth / (total * 1e6)
                    row["of_io_bound"] = run["decode_tps"] / row["io_bound_tps"]
                out.append(row)
    return out


def _f(v, fmt):
    return "-" if v is None else fmt.format(v)


def format_table(result: dict) -> str:
    lines = [
        "| job | ranks | config | page cache | lookup | decode tok/s | x one process "
        "| ms/token over one process | MB read/token, each rank | hit, each rank "
        "| I/O bound tok/s | of bound |",
        "|" + " --- |" * 12,
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['job']} | | {r['step']} | ERROR: {r['error'][:120]} |" + " |" * 8)
            continue
        mb = " / ".join(_f(m, "{:.2f}") for m in r["mb_read_per_token"])
        ratio = _f(r.get("x_one_process"), "{:.2f}")
        if "x_one_process_host_lookup" in r:  # the lookup tensor parallelism itself uses
            ratio += f" (host lookup: {r['x_one_process_host_lookup']:.2f})"
        hit = " / ".join(_f(h, "{:.0%}") for h in r["hit_rate"])
        lines.append(
            f"| {r['job']} | {r['ranks']} | {r['step']} | {r['phase']} | {r['lookup']} "
            f"| {r['decode_tps']:.2f} | {ratio} "
            f"| {_f(r.get('extra_ms_per_token'), '{:+.1f}')} | {mb} | {hit} "
            f"| {_f(r.get('io_bound_tps'), '{:.1f}')} | {_f(r.get('of_io_bound'), '{:.0%}')} |"
        )
    return "\n".join(lines)


def format_checks(result: dict) -> List[str]:
    marks = {True: "identical", False: "MISMATCH", None: "(reported)"}
    return [f"- {marks[c['ok']]}: {c['what']}: {c['detail']}" for c in result["checks"]]


def write(result: dict, out: Path, stem: str) -> List[Path]:
    out.mkdir(parents=True, exist_ok=True)
    stem = free_stem(out, stem)
    js, md = out / f"{stem}.json", out / f"{stem}.md"
    js.write_text(json.dumps(result, indent=1))
    bw = result["bandwidth_gbps"]
    md.write_text(
        "\n".join(
            [
                f"# Distributed streaming: {Path(result['model']).name}",
                "",
                f"Machine: {result['machine']}; {result['gpus']} GPU(s) seen; MLX "
                f"{result['mlx']}. Per-process budget {result['budget_mb']:.0f} MB "
                f"({result['budget']:.0%} of the whole model's {result['experts_mb']:.0f} MB of "
                f"experts); {result['prompt_tokens']}-token prompt, {result['decode_tokens']} "
                f"decode tokens; pipeline over {result['backends']['pipeline']}, tensor "
                f"parallelism over {result['backends']['tensor']}; routing: "
                f"{result['routing_trace'] or 'the model’s own'}"
                + (f" (replayed: {REPLAYED_ROUTING})." if result["routing_trace"] else "."),
                f"Disk: cold random reads at expert size {_f(bw[0], '{:.2f}')} GB/s, page cache "
                f"{_f(bw[1], '{:.2f}')} GB/s. One run of each row.",
                "",
                "MB read/token: each rank's (tensor parallel: the part it keeps; the other "
                "ranks' columns of down that its reads pass over are not counted). I/O bound: "
                "the cold bandwidth over all ranks' bytes per token (the ranks share one disk). "
                "x one process: decode against the same configuration in one process, in the same "
                "run (tensor parallelism, whose parts go through the host-synced lookup, also "
                "against one process's host lookup).",
                "",
                format_table(result),
                "",
                "Checks:",
                "",
                *format_checks(result),
                "",
                "Jobs: "
                + "; ".join(
                    f"{k} {v['seconds']:.0f} s, exit {v['rc']}" for k, v in result["jobs"].items()
                ),
                "",
            ]
        )
    )
    return [js, md]


def run(args) -> int:
    path, stock_path = benchmark_model(args)
    stock_path = stock_path or path
    layout = expert_layout(path)
    total = layout.total_expert_bytes
    budget = int(args.budget * total)
    gpus = gpu_count()
    tensor_backend = args.tensor_backend or ("nccl" if gpus >= args.ranks else "ring")
    rng = np.random.default_rng(args.seed)
    spec = dict(
        model=str(path),
        stock_model=str(stock_path),
        trace=str(args.routing_trace) if args.routing_trace else None,
        moe_layers=sorted(layout.layers),
        prompt=rng.integers(0, 256, args.prompt_tokens).tolist(),
        decode_tokens=args.decode_tokens,
        expert_io=args.io,
    )
    bandwidth = read_bandwidth(path) if not args.no_bandwidth else (None, None)
    jobs: Dict[str, dict] = {}
    work = Path(args.work_dir)
    for job in args.jobs:
        backend = {"single": "none", "pipeline": "ring", "tensor": tensor_backend}[job]
        s = dict(
            spec,
            layout=job,
            backend=backend,
            steps=job_steps(job, budget, gpus > 0),
        )
        ranks = 1 if job == "single" else args.ranks
        print(f"== {job}: {ranks} process(es), backend {backend}", flush=True)
        jobs[job] = launch_job(s, work / job, ranks, args.timeout, gpus)
        jobs[job]["backend"] = backend
        if any(rc != 0 for rc in jobs[job]["rc"]):
            print(f"{job}: exit {jobs[job]['rc']}\n{jobs[job]['log']}", flush=True)
    result = dict(
        model=str(path),
        machine=machine_name(),
        gpus=gpus,
        mlx=mx.__version__,
        budget=args.budget,
        budget_mb=budget / 1e6,
        experts_mb=total / 1e6,
        prompt_tokens=args.prompt_tokens,
        decode_tokens=args.decode_tokens,
        routing_trace=spec["trace"],
        backends=dict(pipeline="ring", tensor=tensor_backend),
        bandwidth_gbps=[b / 1e9 if b else None for b in bandwidth],
        jobs={
            k: dict(rc=v["rc"], seconds=v["seconds"], backend=v["backend"]) for k, v in jobs.items()
        },
        rows=rows(jobs, bandwidth[0]),
        checks=checks(jobs),
        raw={k: v["ranks"] for k, v in jobs.items()},
    )
    print(format_table(result))
    print("\n".join(format_checks(result)))
    machine = args.machine or machine_tag(result["machine"])
    for f in write(result, args.out, f"{datetime.date.today()}-{machine}-distributed"):
        print("wrote", f)
    failed = any(rc != 0 for v in jobs.values() for rc in v["rc"])
    mismatch = any(c["ok"] is False for c in result["checks"])
    if mismatch:
        print("MISMATCH: see the checks above")
    return 1 if failed or mismatch else 0


def _jobs(text: str) -> List[str]:
    jobs = [j.strip() for j in text.split(",") if j.strip()]
    bad = [j for j in jobs if j not in JOBS]
    if bad or not jobs:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a list of {', '.join(JOBS)}")
    return jobs


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not a fraction in (0, 1]")
    return v


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(p, size="tiny")
    p.add_argument(
        "--plain",
        dest="convert",
        action="store_false",
        help="stream from the plain checkpoint (default: a converted copy, made once)",
    )
    p.add_argument("--routing-trace", type=Path, default=None, metavar="TRACE")
    p.add_argument("--budget", type=_fraction, default=0.25, help="per process (default 0.25)")
    p.add_argument("--io", default="pread", choices=("pread", "mmap"))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--jobs", type=_jobs, default=list(JOBS), help="single,pipeline,tensor")
    p.add_argument(
        "--tensor-backend",
        choices=("ring", "nccl"),
        default=None,
        help="default: nccl with a GPU per rank, else ring",
    )
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600, help="seconds per job")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the disk's read bandwidth")
    p.add_argument("--work-dir", type=Path, default=user_cache_dir() / "distributed-bench")
    p.add_argument("--machine", default=None, help="machine label for the results file name")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return p


def main(argv=None) -> int:
    def checked(args):
        if args.ranks < 2:
            raise UsageError("--ranks: at least 2")
        if args.routing_trace is not None and not args.routing_trace.is_file():
            raise UsageError(f"--routing-trace {args.routing_trace}: no such file")
        return run(args)

    return main_for(parser(), checked, argv)


if __name__ == "__main__":
    sys.exit(main())

"""MLX's process-wide settings, A/B, on the decode benchmark's cold rows.

MLX reads some settings from the environment once per process (``MLX_MAX_OPS_PER_BUFFER`` and
``MLX_MAX_MB_PER_BUFFER``: how much work a stream gathers before committing it;
``MLX_USE_CUDA_GRAPHS``), so each setting runs ``benchmarks/decode.py`` in a process of its own,
the settings alternating round by round, each reading the same (cached) model.

Written to ask why a cold token through the device-side table took GPU wait + host time rather
than the larger of the two (benchmarks/results/2026-11-25-h100-notes.md): committing less often
changed nothing, CUDA graphs off took about 1 ms off each token; ``benchmarks/probes/overlap_probe.py``
then showed the host is not blocked at all and the rest is the GPU's own work.

    python benchmarks/probes/commit_ab.py --layers 8 --rounds 2 \
        --setting default: --setting "nographs:MLX_USE_CUDA_GRAPHS=0"

Prints, per run: decode tok/s of stock mlx-lm, of every expert resident (fused kernels), and at
the cold budget through the device table and with host syncs, with the GPU's wait and the rest
of each token; writes ``<out>/<date>-<machine>-commit-ab.{json,md}``.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def parse_setting(text: str):
    """``name:VAR=VAL,VAR=VAL`` -> (name, {VAR: VAL}); ``default:`` changes nothing."""
    name, _, assigns = text.partition(":")
    env = {}
    for item in filter(None, (a.strip() for a in assigns.split(","))):
        var, eq, val = (part.strip() for part in item.partition("="))
        if not eq or not var.startswith("MLX_"):
            raise ValueError(f"setting {text!r}: expected name:MLX_VAR=VALUE,...")
        env[var] = val
    return name or "default", env


def summarize(result: dict, cold_budget: str) -> dict:
    """The rows this A/B compares, from one decode benchmark's JSON."""

    def run(name=None, budget=None, lookup=None):
        return next(
            (
                r
                for r in result["runs"]
                if (name is None or r["name"] == name)
                and (budget is None or r["budget"] == budget)
                and (lookup is None or r["lookup"] == lookup)
            ),
            None,
        )

    stock, resident = run(name="stock mlx-lm"), run(budget="100%", lookup="-")
    out = {
        "stock_tps": stock and stock["decode_tps"],
        "resident_tps": resident and resident["decode_tps"],
        "cold_read_gb_s": result.get("cold_read_gb_s"),
    }
    for lookup in ("device", "host"):
        r = run(budget=cold_budget, lookup=lookup)
        if r is not None:
            out[lookup] = {
                k: r[k]
                for k in (
                    "decode_tps",
                    "gpu_wait_ms_per_token",
                    "io_ms_per_token",
                    "other_ms_per_token",
                    "fraction_of_io_bound",
                    "mb_read_per_token",
                )
            }
    return out


def format_rows(rows: list) -> str:
    lines = [
        "| round | setting | stock tok/s | resident tok/s | table tok/s | table GPU wait ms/tok "
        "| table rest ms/tok | table of bound | host-sync tok/s | host-sync of bound |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        s, d, h = row["summary"], row["summary"].get("device", {}), row["summary"].get("host", {})

        def f(v, fmt):
            return format(v, fmt) if isinstance(v, (int, float)) else "-"

        lines.append(
            f"| {row['round']} | {row['setting']} | {f(s['stock_tps'], '.1f')} | "
            f"{f(s['resident_tps'], '.1f')} | {f(d.get('decode_tps'), '.1f')} | "
            f"{f(d.get('gpu_wait_ms_per_token'), '.2f')} | {f(d.get('other_ms_per_token'), '.2f')} | "
            f"{f(d.get('fraction_of_io_bound'), '.0%')} | {f(h.get('decode_tps'), '.1f')} | "
            f"{f(h.get('fraction_of_io_bound'), '.0%')} |"
        )
    return "\n".join(lines)


def main():
    from moeflux_mlx.benchmark import report

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--setting",
        action="append",
        default=[],
        help="name:MLX_VAR=VALUE,... (repeatable; 'default:' sets nothing)",
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--size", default="full", help="size of the built random model (synth.SIZES)")
    ap.add_argument("--budget", default="0.25", help="the cold budget")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--build-dir", type=Path, default=Path("/tmp/bench-models"))
    ap.add_argument("--timeout", type=float, default=400, help="seconds per benchmark process")
    ap.add_argument("--machine", default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    settings = [parse_setting(s) for s in args.setting or ["default:"]]
    cold_budget = f"{float(args.budget):.0%}"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(1, args.rounds + 1):
            order = settings if rnd % 2 else settings[::-1]  # alternate: drift cancels
            for name, env in order:
                out = Path(tmp) / f"r{rnd}-{name}"
                cmd = [
                    sys.executable,
                    str(ROOT / "benchmarks" / "decode.py"),
                    "--arch",
                    "qwen3_moe",
                    "--size",
                    args.size,
                    "--layers",
                    str(args.layers),
                    "--convert",
                    "--io",
                    "pread",
                    "--prefetch",
                    "off",
                    "--budgets",
                    f"1,{args.budget}",
                    "--prompt-tokens",
                    "128",
                    "--decode-tokens",
                    str(args.decode_tokens),
                    "--build-dir",
                    str(args.build_dir),
                    "--machine",
                    "ab",
                    "--out",
                    str(out),
                ]
                print(f"round {rnd}, {name} {env or ''}", flush=True)
                proc = subprocess.run(
                    cmd,
                    env={**os.environ, **env},
                    capture_output=True,
                    text=True,
                    timeout=args.timeout,
                )
                found = sorted(out.glob("*-decode.json"))
                if proc.returncode or not found:
                    print(proc.stdout[-2000:], proc.stderr[-2000:], sep="\n")
                    raise SystemExit(f"round {rnd}, {name}: decode.py failed ({proc.returncode})")
                result = json.loads(found[-1].read_text())
                rows.append(
                    {
                        "round": rnd,
                        "setting": name,
                        "env": env,
                        "summary": summarize(result, cold_budget),
                        "machine": result["machine"],
                    }
                )
                print(format_rows(rows[-1:]).splitlines()[-1], flush=True)
    machine = rows[0]["machine"] if rows else report.machine_name()
    head = (
        f"# MLX commit settings: does the host encode the next token while the GPU waits?\n\n"
        f"Machine: {machine}. qwen3_moe ({args.size}) random 4-bit, {args.layers} layers, converted "
        f"experts, pread; {args.decode_tokens} decode tokens; cold budget {cold_budget} (page "
        f"cache dropped throughout). Settings alternate round by round.\n\n"
        + "\n".join(
            f"- {n}: {', '.join(f'{k}={v}' for k, v in e.items()) or 'MLX defaults'}"
            for n, e in settings
        )
        + "\n"
    )
    table = format_rows(rows)
    print("\n" + head + "\n" + table)
    tag = args.machine or report.machine_tag(machine)
    stem = f"{datetime.date.today().isoformat()}-{tag}-commit-ab"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps({"settings": dict(settings), "rows": rows}))
    (args.out / f"{stem}.md").write_text(head + "\n" + table + "\n")
    print(f"wrote {args.out / stem}.{{json,md}}")


if __name__ == "__main__":
    main()

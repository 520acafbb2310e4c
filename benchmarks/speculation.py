"""Prompt-lookup speculation against plain decoding, on a repetitive prompt.

For each cache budget (a fraction of the experts' bytes; 1 keeps every expert resident) it loads
the model once, prefills the prompt, then decodes ``--decode-tokens`` tokens greedily: plainly
(``mlx_lm.generate.generate_step``) and by prompt lookup (``moeflux_mlx.model.lookup_decoding``)
drafting up to K tokens a step for each K of ``--k``. The runs take turns, ``--repeats`` times
in one process (the order rotates each round), and the table gives medians: decode tok/s, the
median of each round's lookup ÷ plain ratio, the draft tokens accepted, tokens per forward pass,
MB read and hit rate per token, host syncs (MoE calls answered by one) per pass, and whether the
tokens are identical to plain decoding (they must be: a mismatch is printed as MISMATCH and the
script exits 1).

Only the decode is timed: every run prefills the prompt but its last token the same way first,
then decodes from that token, so both count the same tokens and passes from the same state.
With ``--cold`` the expert files are dropped from the page cache before each decode and, in
``pread`` mode, kept dropped throughout it by a helper process (mapped pages cannot be dropped:
``mmap`` decodes are cold only at their start).

    python benchmarks/speculation.py [MODEL] [--convert DIR] [--budgets 0.25,1] [--k 2,4,6]
        [--decode-tokens 128] [--repeats 3] [--cold] [--expert-io pread] [--backend auto]
        [--prompt code|quote] [--prompt-file FILE] [--machine NAME] [--out benchmarks/results]
        [--quick]

Without MODEL it uses the built-in demo model. Writes ``DATE-MACHINE-speculation.{md,json}`` to
``--out``, never over an existing result (``-2``, ``-3``, ... is added).
"""

import argparse
import contextlib
import copy
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.utils import load_tokenizer  # noqa: E402

from moeflux_mlx import demo_model  # noqa: E402
from moeflux_mlx.errors import MoefluxError  # noqa: E402
from moeflux_mlx.format.checkpoint import expert_layout, is_packed  # noqa: E402
from moeflux_mlx.format.convert import convert  # noqa: E402
from moeflux_mlx.io.bandwidth import (  # noqa: E402
    PageCacheDropper,
    drop_page_cache,
    expert_files,
)
from moeflux_mlx.measure import free_stem, machine_name, machine_tag  # noqa: E402
from moeflux_mlx.model.load import load  # noqa: E402
from moeflux_mlx.model.lookup_decoding import LookupStats, lookup_generate_step  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

CODE = '''def summarize(orders, tax_rate=0.2):
    """Totals per customer, with tax, sorted by amount."""
    totals = {}
    for order in orders:
        customer = order["customer"]
        amount = order["quantity"] * order["price"]
        totals[customer] = totals.get(customer, 0) + amount
    result = []
    for customer, amount in totals.items():
        result.append({"customer": customer, "amount": amount * (1 + tax_rate)})
    result.sort(key=lambda row: row["amount"], reverse=True)
    return result


def print_summary(orders):
    for row in summarize(orders):
        print(f"{row['customer']:20} {row['amount']:10.2f}")
'''

PASSAGE = (
    "It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife. However little known the feelings or views of such a "
    "man may be on his first entering a neighbourhood, this truth is so well fixed in the minds "
    "of the surrounding families, that he is considered the rightful property of some one or "
    "other of their daughters."
)

PROMPTS = {
    # a code edit: the reply repeats the snippet with one change
    "code": "Here is a Python function:\n\n"
    + CODE
    + "\nRename the variable `totals` to `by_customer` and repeat the code exactly as it is "
    "otherwise:\n\n",
    # quoting: the reply repeats a passage
    "quote": f"{PASSAGE}\n\nQuote the passage above word for word, twice:\n\n",
}


def _list(kind):
    def parse(text: str):
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected numbers separated by commas, got {text!r}"
            ) from None
        if not values:
            raise argparse.ArgumentTypeError("expected at least one value")
        return values

    return parse


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="prompt-lookup speculation against plain decoding, on a repetitive prompt"
    )
    p.add_argument("model", nargs="?", help="a checkpoint (default: the built-in demo model)")
    p.add_argument(
        "--convert",
        type=Path,
        default=None,
        metavar="DIR",
        help="stream the experts from a converted copy of the model (one contiguous blob per "
        "expert, as for a model larger than RAM), made once in DIR",
    )
    p.add_argument(
        "--budgets",
        type=_list(float),
        default=[0.25, 1.0],
        help="cache budgets, fractions of the experts' bytes; 1: all resident (default: 0.25,1)",
    )
    p.add_argument(
        "--k", type=_list(int), default=[2, 4, 6], help="draft lengths to try (default: 2,4,6)"
    )
    p.add_argument("--ngram", type=_positive, default=3, help="longest n-gram matched (default: 3)")
    p.add_argument(
        "--decode-tokens", type=_positive, default=128, help="tokens decoded per run (default: 128)"
    )
    p.add_argument(
        "--repeats",
        type=_positive,
        default=3,
        help="rounds of plain and lookup runs, taking turns (default: 3)",
    )
    p.add_argument(
        "--cold",
        action="store_true",
        help="drop the expert files from the page cache before (pread: throughout) each decode",
    )
    p.add_argument(
        "--expert-io",
        choices=["auto", "mmap", "pread"],
        default="auto",
        help="how experts are read (default: auto, the RAM gate)",
    )
    p.add_argument(
        "--backend",
        choices=["auto", "ops", "cuda", "metal"],
        default="auto",
        help="expert computation (default: auto)",
    )
    p.add_argument(
        "--prompt",
        choices=sorted(PROMPTS),
        default="code",
        help="the built-in prompt (default: code, a code edit)",
    )
    p.add_argument(
        "--prompt-file", type=Path, default=None, help="a text file to use as the prompt instead"
    )
    p.add_argument(
        "--no-chat-template",
        action="store_true",
        help="the raw prompt, without the tokenizer's chat template",
    )
    p.add_argument(
        "--machine",
        default=None,
        help="machine label of the result files (default: from the hardware)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=ROOT / "benchmarks" / "results",
        help="result directory (default: benchmarks/results)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a short run: 48 tokens, 2 rounds, K 2 and 4 (unless given)",
    )
    args = p.parse_args(argv)
    if args.quick:
        given = set(argv if argv is not None else sys.argv[1:])
        if "--decode-tokens" not in given:
            args.decode_tokens = 48
        if "--repeats" not in given:
            args.repeats = 2
        if "--k" not in given:
            args.k = [2, 4]
    if any(b <= 0 for b in args.budgets):
        p.error("--budgets: each must be above 0 (1: every expert resident)")
    if any(k < 1 for k in args.k):
        p.error("--k: each draft length must be at least 1")
    return args


def prompt_ids(tokenizer, text: str, chat_template: bool) -> List[int]:
    """Token ids of ``text``, through the tokenizer's chat template if asked and it has one."""
    if chat_template and tokenizer.has_chat_template:
        messages = [{"role": "user", "content": text}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return list(tokenizer.encode(text))


def prefill(model, ids: List[int], step: int = 512):
    """A prompt cache holding ``ids`` (fed in chunks, as mlx-lm prefills)."""
    cache = make_prompt_cache(model)
    for i in range(0, len(ids), step):
        model(mx.array(ids[i : i + step], mx.uint32)[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def decode(
    model, prefilled, files: List[Path], ids: List[int], n: int, k: int, ngram: int, cold: bool
):
    """One timed greedy decode of ``n`` tokens after ``ids`` (k 0: plain ``generate_step``),
    from a copy of ``prefilled`` (the cache holding ``ids`` but its last token).

    Returns:
        A dict: tok/s, tokens, MB read and hit rate per token, and for lookup the drafts.
    """
    rt = model.moeflux
    cache = copy.deepcopy(prefilled)  # every run starts from the same state
    last = mx.array(ids[-1:], mx.uint32)
    dropping = (
        PageCacheDropper(files) if cold and rt.store.io_mode != "mmap" else contextlib.nullcontext()
    )
    if cold:
        drop_page_cache(files)
    stats = LookupStats()
    rt.reset_stats()
    with dropping:
        mx.synchronize()
        t0 = time.perf_counter()
        if k == 0:
            steps = (
                (int(t), lp, False)
                for t, lp in generate_step(last, model, max_tokens=n, prompt_cache=cache)
            )
        else:
            steps = lookup_generate_step(
                last,
                model,
                num_draft_tokens=k,
                ngram_max=ngram,
                context=ids[:-1],
                max_tokens=n,
                prompt_cache=cache,
                stats=stats,
            )
        tokens = [int(t) for t, _, _ in steps]
        mx.synchronize()
        seconds = time.perf_counter() - t0
    rt.stats_dict()  # counts what a miss server read, if any
    t = rt.stats.total()
    return {
        "tps": len(tokens) / seconds,
        "tokens": tokens,
        "mb_read_per_token": t.bytes_read / len(tokens) / 1e6,
        "hit_rate": rt.stats.hit_rate if t.experts_routed else None,
        "proposed": stats.proposed,
        "accepted": stats.accepted,
        "passes": stats.steps if k else len(tokens),
        "synced_calls": t.calls - t.unsynced_calls,
        "seconds": seconds,
        "build_s": stats.build_s,
        "eval_s": stats.eval_s,
        "table_calls": t.unsynced_calls,
        "gpu_waits": t.gpu_waits,
        "gpu_wait_s": t.gpu_wait_s,
        "io_s": t.io_s,
        "read_ahead": t.prefetch_issued,
        "read_ahead_used": t.prefetch_hits,
        "misses": t.experts_missed,
    }


def run_budget(path: Path, fraction: float, ids: List[int], args) -> List[Dict]:
    """Load ``path`` at one budget, prefill once, then plain and lookup runs taking turns.

    Returns:
        One row per configuration (plain first, then each K): medians and the first run's tokens.
    """
    total = expert_layout(path).total_expert_bytes
    budget = "all" if fraction >= 1 else int(fraction * total)
    model, _ = load(path, cache_budget=budget, backend=args.backend, expert_io=args.expert_io)
    rt = model.moeflux
    configs = [0] + list(args.k)
    files = expert_files(path)
    t0 = time.perf_counter()
    prefilled = prefill(model, ids[:-1])  # once: a CPU takes seconds per hundred tokens
    print(f"  budget {fraction:g}: prefilled in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    runs: Dict[int, List[Dict]] = {k: [] for k in configs}
    try:
        # warm-up: the timed runs themselves once (greedy: the same tokens, so the same passes),
        # since each pass length and draft count met for the first time compiles kernels of its
        # own (a 32-token warm-up left seconds of NVRTC in the first timed K=2 run on an H200);
        # also the allocator and the cache's fill
        for k in configs:
            decode(model, prefilled, files, ids, args.decode_tokens, k, args.ngram, False)
        for r in range(args.repeats):
            order = configs[r % len(configs) :] + configs[: r % len(configs)]
            for k in order:
                run = decode(
                    model, prefilled, files, ids, args.decode_tokens, k, args.ngram, args.cold
                )
                runs[k].append(run)
                print(
                    f"  budget {fraction:g}, round {r + 1}: {_name(k)} {run['tps']:.2f} tok/s",
                    file=sys.stderr,
                    flush=True,
                )
        io_mode, backend = rt.store.io_mode, rt.backend.name
    finally:
        rt.close()
        del model
        gc.collect()
        mx.clear_cache()
    plain = runs[0]
    rows = []
    for k in configs:
        rs = runs[k]
        proposed = sum(x["proposed"] for x in rs)
        hits = [x["hit_rate"] for x in rs if x["hit_rate"] is not None]
        rows.append(
            {
                "budget": fraction,
                "io": io_mode,
                "backend": backend,
                "k": k,
                "decode_tps": statistics.median(x["tps"] for x in rs),
                "tps_runs": [x["tps"] for x in rs],
                "ratio": None
                if k == 0
                else statistics.median(x["tps"] / p["tps"] for x, p in zip(rs, plain)),
                "acceptance": sum(x["accepted"] for x in rs) / proposed if proposed else None,
                "tokens_per_pass": statistics.median(len(x["tokens"]) / x["passes"] for x in rs),
                "mb_read_per_token": statistics.median(x["mb_read_per_token"] for x in rs),
                "hit_rate": statistics.median(hits) if hits else None,
                "syncs_per_pass": statistics.median(x["synced_calls"] / x["passes"] for x in rs),
                "per_pass": {  # where a pass's time goes (medians): see waits_table
                    key: statistics.median(x[key] / x["passes"] for x in rs) for key in PER_PASS
                },
                "identical": all(x["tokens"] == plain[0]["tokens"] for x in rs),
                "tokens": rs[0]["tokens"],
            }
        )
    return rows


PER_PASS = (
    "seconds",
    "build_s",
    "eval_s",
    "table_calls",
    "gpu_waits",
    "gpu_wait_s",
    "io_s",
    "misses",
    "read_ahead",
    "read_ahead_used",
)


def waits_table(rows: List[Dict]) -> str:
    """Per forward pass: its time; for lookup, the host's building of its graph and the wait
    for its evaluation (plain decoding overlaps the two: ``generate_step`` builds a token while
    the one before it computes); its calls through the device-side table, the GPU's waits for
    the miss server and their time, the server's reading time, the experts missed and those
    read ahead (used)."""
    head = (
        "| cache | decode | ms/pass | build ms/pass | eval ms/pass | table calls/pass "
        "| GPU waits/pass | GPU wait ms/pass | read ms/pass | missed/pass | read ahead/pass (used) |"
    )
    out = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        p = r["per_pass"]
        budget = "100%" if r["budget"] >= 1 else f"{r['budget']:.0%}"
        out.append(
            f"| {budget} | {_name(r['k'])} | {1e3 * p['seconds']:.2f} "
            f"| {_fmt(1e3 * p['build_s'] if r['k'] else None, '.2f')} "
            f"| {_fmt(1e3 * p['eval_s'] if r['k'] else None, '.2f')} "
            f"| {p['table_calls']:.1f} | {p['gpu_waits']:.1f} "
            f"| {1e3 * p['gpu_wait_s']:.2f} | {1e3 * p['io_s']:.2f} | {p['misses']:.1f} "
            f"| {p['read_ahead']:.1f} ({p['read_ahead_used']:.1f}) |"
        )
    return "\n".join(out)


def _name(k: int) -> str:
    return "plain" if k == 0 else f"lookup K={k}"


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: List[Dict]) -> str:
    """The rows as a markdown table."""
    head = (
        "| cache | io | decode | decode tok/s | x plain | accepted | tokens/pass "
        "| MB read/tok | hit | host syncs/pass | tokens identical |"
    )
    out = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        budget = "100%" if r["budget"] >= 1 else f"{r['budget']:.0%}"
        out.append(
            f"| {budget} | {r['io']} | {_name(r['k'])} "
            f"| {r['decode_tps']:.2f} | {_fmt(r['ratio'], '.2f')} "
            f"| {_fmt(r['acceptance'], '.0%')} | {r['tokens_per_pass']:.2f} "
            f"| {r['mb_read_per_token']:.2f} | {_fmt(r['hit_rate'], '.0%')} "
            f"| {r['syncs_per_pass']:.1f} | {'yes' if r['identical'] else 'MISMATCH'} |"
        )
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        path = Path(args.model).expanduser() if args.model else demo_model.checkpoint_path()
        if args.prompt_file is not None:
            text = args.prompt_file.read_text()
            prompt_name = str(args.prompt_file)
        else:
            text, prompt_name = PROMPTS[args.prompt], args.prompt
        ids = prompt_ids(load_tokenizer(path), text, not args.no_chat_template)
        if args.convert is not None and not is_packed(path):
            packed = args.convert.expanduser() / (path.name + "-packed")
            convert(path, packed, progress=False)  # nothing to do once made
            path = packed
        if len(ids) < 2:
            print("speculation.py: error: the prompt needs at least 2 tokens", file=sys.stderr)
            return 2
        machine = machine_name()
        label = args.machine or machine_tag(machine)
        print(
            f"{path}: prompt {prompt_name!r}, {len(ids)} tokens; decoding {args.decode_tokens} "
            f"tokens, {args.repeats} rounds",
            file=sys.stderr,
        )
        rows: List[Dict] = []
        for fraction in args.budgets:
            rows += run_budget(path, fraction, ids, args)
    except (MoefluxError, OSError) as e:
        print(f"speculation.py: error: {e}", file=sys.stderr)
        return 2
    md_table = table(rows)
    print(md_table)
    print(waits_table(rows))
    mismatched = [r for r in rows if not r["identical"]]
    result = {
        "model": str(path),
        "machine": machine,
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "date": datetime.date.today().isoformat(),
        "prompt": prompt_name,
        "prompt_tokens": len(ids),
        "chat_template": not args.no_chat_template,
        "decode_tokens": args.decode_tokens,
        "repeats": args.repeats,
        "ngram": args.ngram,
        "cold": args.cold,
        "expert_io": args.expert_io,
        "backend": args.backend,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = free_stem(out, f"{result['date']}-{label}-speculation")
    md = [
        f"# Prompt-lookup speculation: {path.name}",
        "",
        f"Machine: {machine}; MLX {result['mlx']} ({result['device']}). Prompt: {prompt_name} "
        f"({len(ids)} tokens{', chat template' if result['chat_template'] else ''}); greedy "
        f"decode of {args.decode_tokens} tokens; n-grams up to {args.ngram}; "
        f"{'cold' if args.cold else 'warm'} page cache; medians of {args.repeats} rounds in "
        "one process, plain and lookup taking turns (x plain: the median of each round's ratio).",
        "",
        md_table,
        "",
        "Where a pass's time goes (medians per forward pass; the GPU's waits are the "
        "device-side table's, the reads the miss server's or the host-synced path's):",
        "",
        waits_table(rows),
        "",
    ]
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{stem}.md").write_text("\n".join(md))
    for suffix in (".md", ".json"):
        print(f"wrote {out / (stem + suffix)}", file=sys.stderr)
    if mismatched:
        for r in mismatched:
            print(
                f"MISMATCH: budget {r['budget']:g}, K={r['k']}: tokens differ from plain decoding",
                file=sys.stderr,
            )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

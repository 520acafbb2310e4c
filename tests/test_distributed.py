"""Past one machine: ``moeflux_mlx.sharded_load`` and the commands under ``mlx.launch``.

In one process, with a stand-in group (``model.shard`` only asks it for its rank and size): the
parts a tensor-parallel rank reads are byte for byte the weights stock mlx-lm's ``shard`` gives
that rank, from either source and by either I/O mode. Then two processes on 127.0.0.1 with MLX's
ring backend: a pipeline gives the tokens and log-probs of one process bit for bit, tensor
parallelism what stock ``mlx_lm.utils.sharded_load`` gives with the same group, and each rank's
counters show its own share only; ``moeflux-mlx generate --pipeline`` under ``mlx.launch``,
``chat`` and ``server`` print once, from rank 0.
"""

import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.switch_layers import SwitchLinear
from mlx_lm.utils import load_model

import moeflux_mlx
from benchmarks.lib.distributed import free_ports, start_ranks
from moeflux_mlx import cli
from moeflux_mlx.errors import CheckpointError, LayoutError, UnsupportedQuantizationError
from moeflux_mlx.format.checkpoint import PACKED_DIR
from moeflux_mlx.format.convert import convert
from moeflux_mlx.format.layout import ExpertLayout, Quantization, layer_file_name
from moeflux_mlx.io.store import read_runs
from moeflux_mlx.model.experts import find_experts
from moeflux_mlx.model.sharded import _split_of
from moeflux_mlx.options import LoadOptions, Tuning
from tests.support import synth

BIN = Path(sys.executable).parent
CLI = [sys.executable, "-m", "moeflux_mlx.cli"]
# seconds for two ranks to finish; a fresh GPU compiles kernels for minutes first
LAUNCH_TIMEOUT = int(os.environ.get("MOEFLUX_TEST_LAUNCH_TIMEOUT", "120"))
MAX_TOKENS = 12
NP_DTYPES = {"U32": np.uint32, "BF16": np.uint16, "F16": np.uint16, "F32": np.float32}


class Group:
    """What ``model.shard`` asks of a group: its rank and size (no process behind it)."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """kind -> a tiny qwen3_moe (4-bit, and bf16 unquantized) checkpoint; ``packed``: converted."""
    root = tmp_path_factory.mktemp("distributed")
    q4 = synth.build_checkpoint(root / "q4", "qwen3_moe", "tiny", seed=1)
    bf16 = synth.build_checkpoint(root / "bf16", "qwen3_moe", "tiny", seed=2, quantize=False)
    return {"q4": q4, "packed": convert(q4, root / "q4-packed", progress=False), "bf16": bf16}


# --------------------------------------------------------------------------- byte ranges


def test_a_part_is_rows_or_columns_of_every_expert():
    q = Quantization(4, 64)
    full = ExpertLayout.from_tensors(
        {
            "down_proj.weight": ("U32", (4, 8, 32)),  # 8 rows of 256 4-bit columns
            "down_proj.scales": ("BF16", (4, 8, 4)),
            "down_proj.biases": ("BF16", (4, 8, 4)),
            "gate_proj.weight": ("U32", (4, 16, 8)),
            "gate_proj.scales": ("BF16", (4, 16, 1)),
            "gate_proj.biases": ("BF16", (4, 16, 1)),
            "up_proj.weight": ("U32", (4, 16, 8)),
            "up_proj.scales": ("BF16", (4, 16, 1)),
            "up_proj.biases": ("BF16", (4, 16, 1)),
        },
        q,
    )
    cuts = {c.name: (0 if c.projection != "down_proj" else -1, 1, 2) for c in full.components}
    part = full.shard(cuts)
    assert part.layout.component("gate_proj.weight").shape == (8, 8)
    assert part.layout.component("down_proj.weight").shape == (8, 16)
    assert part.layout.component("down_proj.scales").shape == (8, 2)
    blob = np.arange(full.blob_size, dtype=np.int64) % 251  # a full expert's bytes, each told
    got = np.zeros(part.layout.blob_size, np.int64)
    for s in part.spans:
        rows = [
            blob[s.src + k * s.stride : s.src + k * s.stride + s.nbytes] for k in range(s.count)
        ]
        got[s.dst : s.dst + s.count * s.nbytes] = np.concatenate(rows)
    for c in full.components:  # the part of each component is numpy's slice of it
        whole = blob[c.offset : c.offset + c.nbytes].reshape(c.shape[0], -1)
        half = c.shape[0] // 2
        want = whole[half:] if c.projection != "down_proj" else whole[:, whole.shape[1] // 2 :]
        p = part.layout.component(c.name)
        assert (got[p.offset : p.offset + p.nbytes] == want.reshape(-1)).all(), c.name
    # down's 256 columns in 8 parts of 32 would cut its groups of 64: each scale must go along
    with pytest.raises(UnsupportedQuantizationError, match="group boundaries"):
        full.shard({"down_proj.weight": (-1, 0, 8), "down_proj.scales": (-1, 0, 8)})
    with pytest.raises(LayoutError, match="equal parts"):
        full.shard({"gate_proj.weight": (0, 0, 3)})


@pytest.mark.parametrize("gap, count", [(16, 1500), (40 << 10, 40)])  # read as one span / skipped
def test_read_runs_reads_every_row_of_a_part(tmp_path, gap, count):
    run = 48  # 1500 rows: more than one preadv takes
    data = np.random.default_rng(0).integers(0, 255, (count, run + gap), np.uint8)
    path = tmp_path / "f"
    path.write_bytes(b"xx" + data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        into = np.zeros((count, run), np.uint8)
        read_runs(fd, 2, run + gap, into, "f")
        assert (into == data[:, :run]).all()
        with pytest.raises(moeflux_mlx.ExpertReadError, match="short read"):
            read_runs(fd, 2 + run + gap, run + gap, into, "f")
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    "kind, expert_io, threads", [("q4", "pread", 4), ("packed", "pread", 1), ("packed", "mmap", 1)]
)
@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_rank_reads_what_stock_shard_keeps(ckpts, kind, expert_io, threads, rank):
    """The bytes of each expert a rank reads are the weights ``model.shard`` leaves that rank in
    stock mlx-lm: rows of gate / up, input columns of down (with their scales and biases)."""
    model, _ = moeflux_mlx.sharded_load(
        ckpts[kind],
        tensor_group=Group(rank, 2),
        expert_io=expert_io,
        options=LoadOptions(tuning=Tuning(threads=threads)),
    )
    stock, _ = load_model(ckpts["q4"], lazy=True)
    stock.shard(Group(rank, 2))
    with model.moeflux as rt:
        assert rt.store.io_mode == expert_io
        for layer, path in rt.layout.module_paths.items():
            layout = rt.layout.layers[layer]
            blobs = rt.store.read(layer, np.arange(layout.num_experts)).copy()
            switch = find_experts(stock)[path].module
            for c in layout.components:
                proj, param = c.name.split(".")
                want = getattr(getattr(switch, proj), param)
                want = np.array(want.view(mx.uint16) if want.dtype == mx.bfloat16 else want)
                got = blobs[:, c.offset : c.offset + c.nbytes].view(NP_DTYPES[c.dtype])
                assert (got.reshape(want.shape) == want).all(), (layer, c.name)


def test_unquantized_experts_split_too(ckpts):
    model, _ = moeflux_mlx.sharded_load(ckpts["bf16"], tensor_group=Group(1, 2))
    stock, _ = load_model(ckpts["bf16"], lazy=True)
    stock.shard(Group(1, 2))
    with model.moeflux as rt:
        layer, path = min(rt.layout.module_paths.items())
        blobs = rt.store.read(layer, np.arange(16)).copy()
        down = rt.layout.layers[layer].component("down_proj.weight")
        want = np.array(find_experts(stock)[path].module.down_proj.weight.view(mx.uint16))
        got = blobs[:, down.offset : down.offset + down.nbytes].view(np.uint16)
        assert got.reshape(want.shape).tolist() == want.tolist()


def test_what_streaming_cannot_follow_is_refused(ckpts):
    lin = SwitchLinear(8, 4, 2, bias=True)
    lin.bias = mx.arange(8, dtype=mx.float32).reshape(2, 4)  # as _code_biases codes them
    assert _split_of((2, 4, 8), lin, (2, 4), 2, 0, "here") is None
    lin.bias /= 2  # what gpt-oss's shard() does to the down projection's biases, in place
    with pytest.raises(CheckpointError, match="changes the values"):
        _split_of((2, 4, 8), lin, (2, 4), 2, 0, "here")
    lin.weight = mx.zeros((2, 4, 3))
    with pytest.raises(CheckpointError, match="equal parts only"):
        _split_of((2, 4, 8), lin, None, 2, 0, "here")
    # four processes would cut tiny's quantized attention inside its groups (stock fails too)
    with pytest.raises(CheckpointError, match="cannot split it 4 ways"):
        moeflux_mlx.sharded_load(ckpts["q4"], tensor_group=Group(0, 4))
    with pytest.raises(CheckpointError, match="pipeline"):
        moeflux_mlx.sharded_load(ckpts["q4"], pipeline_group=Group(0, 3))


def test_a_pipeline_stage_opens_only_its_layers(ckpts, tmp_path):
    """Rank 0 runs the last layers (mlx-lm's order), and its budget is its share's; a machine
    needs only its own layers' expert files."""
    assert "sharded_load" in moeflux_mlx.__all__
    for rank, layers in ((0, [1]), (1, [0])):
        mine = shutil.copytree(ckpts["packed"], tmp_path / f"rank{rank}")
        (mine / PACKED_DIR / layer_file_name(rank)).unlink()  # the other stage's layer
        model, _ = moeflux_mlx.sharded_load(mine, pipeline_group=Group(rank, 2), cache_budget="all")
        with model.moeflux as rt:
            assert sorted(rt.layout.layers) == sorted(rt.store.layers) == layers
            assert rt.cache.capacity_bytes == rt.layout.total_expert_bytes == 16 * 27648


# --------------------------------------------------------------------------- two processes

WORKER = textwrap.dedent(
    """
    import json, sys
    import mlx.core as mx, numpy as np
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import sharded_load as stock_sharded_load
    import moeflux_mlx
    from moeflux_mlx.options import LoadOptions, Tuning

    packed, plain, out = sys.argv[1:4]
    group = mx.distributed.init(strict=True, backend="ring")
    prompts = json.loads(sys.argv[4])

    def decode(model):
        runs = []
        for prompt in prompts:
            cache = make_prompt_cache(model)
            steps = zip(generate_step(mx.array(prompt), model, max_tokens={n},
                                      prompt_cache=cache), range({n}))
            toks, lps = zip(*[(int(t), np.array(lp.astype(mx.float32))) for (t, lp), _ in steps])
            runs.append((list(toks), np.stack(lps)))
        return runs

    def share(model):
        s = model.moeflux.stats_dict()
        lay = model.moeflux.layout.layers
        return {{str(i): [v["experts_read"], v["bytes_read"], lay[int(i)].blob_size]
                for i, v in s["layers"].items()}}

    result = {{}}
    model, _ = moeflux_mlx.sharded_load(packed, pipeline_group=group, cache_budget=0,
                                        expert_io="mmap", backend="ops")
    result["pipeline"], result["pipeline_share"] = decode(model), share(model)
    model.moeflux.close()
    stock, _ = stock_sharded_load(plain, tensor_group=group)
    result["stock_tp"] = decode(stock)
    del stock
    model, _ = moeflux_mlx.sharded_load(plain, tensor_group=group, cache_budget=222000,
                                        expert_io="pread", backend="ops",
                                        options=LoadOptions(tuning=Tuning(threads=4)))
    result["tp"], result["tp_share"] = decode(model), share(model)
    model.moeflux.close()
    arrays = {{f"{{k}}_{{i}}": lp for k in ("pipeline", "stock_tp", "tp")
              for i, (_, lp) in enumerate(result[k])}}
    tokens = {{k: [t for t, _ in result[k]] for k in ("pipeline", "stock_tp", "tp")}}
    np.savez(out, **arrays)
    with open(out + ".json", "w") as f:
        json.dump(dict(tokens=tokens, pipeline_share=result["pipeline_share"],
                       tp_share=result["tp_share"]), f)
    """
).format(n=MAX_TOKENS)


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    return dict(env, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **extra)


def _start_ranks(tmp_path, argv, n=2):
    """``argv(rank)`` in ``n`` processes joined by MLX's ring backend on 127.0.0.1, as
    ``mlx.launch`` starts them (``MLX_HOSTFILE``, ``MLX_RANK``)."""
    return start_ranks(argv, n, "ring", tmp_path)


def _run_ranks(tmp_path, argv, n=2):
    """``_start_ranks``, to the end; returns each rank's (rc, stdout, stderr)."""
    procs = _start_ranks(tmp_path, argv, n)
    try:
        outputs = [p.communicate(timeout=LAUNCH_TIMEOUT) for p in procs]
        return [(p.returncode, *out) for p, out in zip(procs, outputs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _prompts(tokenizer):
    long = " ".join(["the quick brown fox jumps over the lazy dog"] * 4)  # >= 64 pairs: sorted
    return [tokenizer.encode("hi"), tokenizer.encode(long)]


@pytest.fixture(scope="module")
def two_ranks(ckpts, tmp_path_factory):
    """Both ranks' tokens, log-probs and counters: a pipeline on the converted checkpoint,
    stock and moeflux tensor parallelism on the plain one (one launch)."""
    tmp = tmp_path_factory.mktemp("ranks")
    worker = tmp / "worker.py"
    worker.write_text(WORKER)
    _, tokenizer = moeflux_mlx.load(ckpts["packed"], backend="ops")
    prompts = _prompts(tokenizer)

    def argv(rank):
        out = str(tmp / f"rank{rank}.npz")
        return [sys.executable, str(worker), str(ckpts["packed"]), str(ckpts["q4"]), out]

    done = _run_ranks(tmp, lambda r: argv(r) + [json.dumps(prompts)])
    for rank, (rc, out, err) in enumerate(done):
        assert rc == 0, f"rank {rank}:\n{out}\n{err}"
    results = []
    for rank in range(2):
        npz = np.load(tmp / f"rank{rank}.npz")
        meta = json.loads((tmp / f"rank{rank}.npz.json").read_text())
        results.append((meta, {k: npz[k] for k in npz.files}))
    return prompts, results


def _decode(model, prompts):
    runs = []
    for prompt in prompts:
        steps = zip(
            generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS), range(MAX_TOKENS)
        )
        toks, lps = zip(*[(int(t), np.array(lp.astype(mx.float32))) for (t, lp), _ in steps])
        runs.append((list(toks), np.stack(lps)))
    return runs


def test_a_pipeline_gives_one_process_bit_for_bit(ckpts, two_ranks):
    prompts, results = two_ranks
    model, _ = moeflux_mlx.load(ckpts["packed"], backend="ops", cache_budget=0, expert_io="mmap")
    with model.moeflux:
        want = _decode(model, prompts)
        alone = model.moeflux.stats_dict()["layers"]
    for meta, arrays in results:
        assert meta["tokens"]["pipeline"] == [t for t, _ in want]
        for i, (_, lp) in enumerate(want):
            assert np.array_equal(arrays[f"pipeline_{i}"], lp)
    # each rank read its own layers' experts only: exactly what one process read for them
    for rank, layers in ((0, ["1"]), (1, ["0"])):
        share = results[rank][0]["pipeline_share"]
        assert sorted(share) == layers
        for layer, (experts, nbytes, blob) in share.items():
            assert experts == alone[int(layer)]["experts_read"] > 0
            assert nbytes == alone[int(layer)]["bytes_read"] == experts * blob == experts * 27648


def test_tensor_parallel_gives_stock_sharded_load_bit_for_bit(two_ranks):
    _, results = two_ranks
    for meta, arrays in results:
        assert meta["tokens"]["tp"] == meta["tokens"]["stock_tp"]
        for i in range(2):
            assert np.array_equal(arrays[f"tp_{i}"], arrays[f"stock_tp_{i}"])
    # every rank streams its half of each expert: 13824 of the 27648 bytes, nothing more
    shares = [meta["tp_share"] for meta, _ in results]
    assert sorted(shares[0]) == sorted(shares[1]) == ["0", "1"]
    for layer in ("0", "1"):
        counts = [share[layer] for share in shares]
        assert counts[0] == counts[1]  # one router, replicated: the same experts on both
        experts, nbytes, blob = counts[0]
        assert experts > 0 and blob == 27648 // 2 and nbytes == experts * blob


@pytest.fixture(scope="module")
def alone(ckpts):
    """``moeflux-mlx generate``'s reply on one process (greedy, the chat template applied)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["generate", *_flags(ckpts)]) == 0
    return out.getvalue()


def _flags(ckpts):
    return ["--model", str(ckpts["packed"]), "--prompt", "hi", "--max-tokens", "8"]


def _stats_lines(err: str):
    return [line for line in err.splitlines() if line.startswith("[prompt:")]


def test_generate_under_mlx_launch_prints_once(ckpts, alone):
    launch = BIN / "mlx.launch"
    if not (launch.exists() and (BIN / "moeflux-mlx").exists()):
        pytest.skip("mlx.launch and moeflux-mlx are not installed next to this Python")
    flags = _flags(ckpts)
    port = free_ports(1)[0]
    cmd = [str(launch), "-n", "2", "--backend", "ring", "--starting-port", str(port), "--"]
    run = subprocess.run(
        [*cmd, str(BIN / "moeflux-mlx"), "generate", "--pipeline", *flags],
        env=_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout == alone  # the reply, once: rank 1's went nowhere
    assert run.stderr.count("Loading ") == 1 and "pipeline over 2 processes" in run.stderr
    stats = _stats_lines(run.stderr)
    assert len(stats) == 1 and "rank 0: " in stats[0] and "rank 1: " in stats[0]
    assert "Traceback" not in run.stderr


def test_chat_tensor_parallel_answers_from_rank_0(ckpts, tmp_path):
    cmd = [*CLI, "chat", *_flags(ckpts), "--expert-io", "pread"]
    (rc0, out0, err0), (rc1, out1, err1) = _run_ranks(tmp_path, lambda rank: cmd)
    assert rc0 == rc1 == 0, err0 + err1
    assert out0.strip() and out1 == err1 == ""  # rank 1 says nothing
    assert "tensor parallel over 2 processes" in err0
    (stats,) = _stats_lines(err0)
    assert re.search(r"rank 0: [\d.]+ kB read.*; rank 1: [\d.]+ kB read", stats)


def test_server_pipeline_serves_from_rank_0(ckpts, tmp_path, alone):
    port = free_ports(1)[0]
    cmd = [*CLI, "server", "--model", str(ckpts["packed"]), "--pipeline"]
    procs = _start_ranks(tmp_path, lambda rank: [*cmd, "--port", str(port)])
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        body = json.dumps(
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
        ).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        while True:
            assert all(p.poll() is None for p in procs), "a rank exited early"
            try:
                with urllib.request.urlopen(request, timeout=30) as r:
                    reply = json.loads(r.read())
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, "the server did not answer"
                time.sleep(0.3)
        assert reply["choices"][0]["message"]["content"] == alone.strip()
        procs[0].send_signal(signal.SIGTERM)  # rank 0 stops: rank 1's loop ends with it
        outputs = [p.communicate(timeout=LAUNCH_TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert outputs[1] == ("", "")  # rank 1: no output, no traceback when rank 0 goes away

"""Routing replayed from a trace (``benchmarks/lib/trace_routing.py``): the routers of a stock or a
streamed model pick exactly the traced experts, position after position, so the decode benchmark
sees a trained model's I/O pattern at another model's expert sizes."""

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.generate import generate_step
from mlx_lm.models.switch_layers import SwitchGLU

import moeflux_mlx
from benchmarks.lib.report import summary_lines
from benchmarks.lib.routing import RoutingTrace
from benchmarks.lib.trace_routing import TraceRoutingError, drive_routing, rewind_routing
from moeflux_mlx.format.checkpoint import expert_layout
from moeflux_mlx.options import share_of_experts
from tests.support import synth

EXPERTS, TOP_K, LAYERS = 16, 4, 2  # synth's tiny qwen3_moe


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return synth.build_checkpoint(tmp_path_factory.mktemp("trace") / "m", "qwen3_moe", "tiny")


def _trace(tokens=40, layers=LAYERS, experts=EXPERTS, top_k=TOP_K, seed=0):
    rng = np.random.default_rng(seed)
    routed = np.stack(
        [
            np.stack([rng.choice(experts, top_k, replace=False) for _ in range(layers)])
            for _ in range(tokens)
        ]
    )
    return RoutingTrace(
        routed=routed,
        layers=list(range(layers)),
        num_experts=[experts] * layers,
        tokens=np.full(tokens, -1),
    )


def _decode(model, n=6):
    prompt = mx.array([1, 2, 3, 4, 5])
    return [int(t) for (t, _), _ in zip(generate_step(prompt, model, max_tokens=n), range(n))]


def test_stock_routers_pick_the_traced_experts_in_order(ckpt, monkeypatch):
    trace = _trace()
    model, _ = mlx_load(str(ckpt))
    assert drive_routing(model, trace) == LAYERS
    seen = {}
    call = SwitchGLU.__call__

    def record(self, x, indices):
        seen.setdefault(id(self), []).append(np.array(indices).reshape(-1, TOP_K))
        return call(self, x, indices)

    monkeypatch.setattr(SwitchGLU, "__call__", record)
    _decode(model)  # 5 prompt positions, then the decode steps (mlx-lm runs one ahead)
    layers = [np.concatenate(v) for v in seen.values()]
    assert len(layers) == LAYERS
    for j, got in enumerate(layers):
        want = trace.routed[: len(got), j]
        assert len(got) >= 10
        assert (np.sort(got, 1) == np.sort(want, 1)).all()


def test_streamed_model_replays_the_same_and_decodes_as_stock(ckpt):
    trace = _trace()
    stock, _ = mlx_load(str(ckpt))
    streamed, _ = moeflux_mlx.load(ckpt, cache_budget=share_of_experts(0.25))
    drive_routing(stock, trace)
    drive_routing(streamed, trace)
    assert _decode(streamed) == _decode(stock)
    # both replayed the same positions of the trace
    positions = [[layer.mlp.gate._pos for layer in m.model.layers] for m in (stock, streamed)]
    assert positions[0] == positions[1] and min(positions[0]) >= 10
    streamed.moeflux.close()


def test_rewound_routers_replay_from_where_they_started_plus_the_shift(ckpt):
    """A benchmark's rounds rewind the replay: shift 0 routes as the first pass did, a shift
    moves every router by that many positions (wrapping), and a model without a trace has
    nothing to rewind."""
    trace = _trace()
    model, _ = mlx_load(str(ckpt))
    plain, _ = mlx_load(str(ckpt))
    assert rewind_routing(plain, 3) == 0
    drive_routing(model, trace)
    first = _decode(model)
    gates = [layer.mlp.gate for layer in model.model.layers]
    starts = [g._start for g in gates]
    assert [g._pos for g in gates] != starts
    assert rewind_routing(model) == LAYERS
    assert [g._pos for g in gates] == starts
    assert _decode(model) == first
    rewind_routing(model, 45)  # the trace has 40 positions
    assert [g._pos for g in gates] == [(s + 45) % 40 for s in starts]


def test_more_layers_than_the_trace_reuse_it_from_elsewhere(ckpt):
    trace = _trace(tokens=40, layers=1)
    model, _ = mlx_load(str(ckpt))
    drive_routing(model, trace)
    routers = [layer.mlp.gate for layer in model.model.layers]
    assert [r._pos for r in routers] == [0, 20]


class _Stage:
    """What ``model.model.pipeline`` leaves a process: rank 0 of 2 keeps the last layer."""

    def __init__(self, group_rank: int):
        self._rank = group_rank

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return 2


def test_a_pipeline_stage_replays_what_its_layers_replay_in_the_whole_model(ckpt):
    trace = _trace()
    whole, _ = mlx_load(str(ckpt))
    drive_routing(whole, trace)
    stage, _ = mlx_load(str(ckpt))
    stage.model.pipeline(_Stage(0))  # layer 1 only
    layers = sorted(expert_layout(ckpt).layers)
    drive_routing(stage, trace, moe_layers=layers)
    (kept,) = [layer for layer in stage.model.layers if layer is not None]
    assert np.array_equal(kept.mlp.gate._rows, whole.model.layers[1].mlp.gate._rows)
    assert kept.mlp.gate._pos == whole.model.layers[1].mlp.gate._pos
    # without the whole model's layers, the stage's one layer would replay trace layer 0
    other, _ = mlx_load(str(ckpt))
    other.model.pipeline(_Stage(0))
    drive_routing(other, trace)
    (alone,) = [layer for layer in other.model.layers if layer is not None]
    assert np.array_equal(alone.mlp.gate._rows, whole.model.layers[0].mlp.gate._rows)
    with pytest.raises(TraceRoutingError, match=r"MoE layers \[1\] are not among \[0\]"):
        drive_routing(stage, trace, moe_layers=[0])


@pytest.mark.parametrize(
    "trace, message",
    [
        (_trace(experts=32), "no router onto 32 experts"),
        (_trace(top_k=2), "top-2, the model's layer 0 routes top-4"),
    ],
)
def test_a_trace_of_another_shape_is_refused(ckpt, trace, message):
    model, _ = mlx_load(str(ckpt))
    with pytest.raises(TraceRoutingError, match=message):
        drive_routing(model, trace)


def test_decode_benchmark_refuses_removed_flags_and_bad_files_in_one_line(ckpt, tmp_path):
    """A bad trace, and the flags that went with prefetch (``--prefetch``, and
    ``--trace-predictor``, which only fed it), are refused in one line, not ignored."""
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a trace")
    good = _trace().save(tmp_path / "t.npz")
    for trace, flags, words in (
        (bad, [], "not a readable routing trace"),
        (good, ["--prefetch", "on"], "unrecognized arguments: --prefetch"),
        (good, ["--trace-predictor", "ridge"], "unrecognized arguments: --trace-predictor"),
    ):
        r = subprocess.run(
            [
                sys.executable,
                str(Path(__file__).resolve().parents[1] / "benchmarks" / "decode.py"),
                str(ckpt),
                "--routing-trace",
                str(trace),
                "--out",
                str(tmp_path),
                *flags,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2, r.stderr
        lines = [ln for ln in r.stderr.splitlines() if "error" in ln]
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in r.stderr


def test_the_report_says_the_tokens_are_meaningless_when_routing_is_replayed():
    replayed = " ".join(summary_lines({"routing_trace": "t.npz", "runs": []}))
    assert "Routing replayed from t.npz" in replayed and "meaningless by design" in replayed
    assert "meaningless" not in " ".join(summary_lines({"routing_trace": None, "runs": []}))

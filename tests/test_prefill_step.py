"""The prompt tokens a prefill's forward pass takes: stock's 2048 where every expert is resident,
more where experts stream (each step reads every partly cached layer whole), bounded by memory;
and a prompt prefilled in such steps gives stock's tokens."""

from collections import namedtuple

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

import moeflux_mlx
from moeflux_mlx.model import runtime as rt_module
from moeflux_mlx.options import share_of_experts
from tests.support import synth

Memory = namedtuple("Memory", "available total")


@pytest.fixture(scope="module")
def long_context(tmp_path_factory):
    """A tiny qwen3_moe whose context holds prompts longer than stock's 2048-token step."""
    root = tmp_path_factory.mktemp("step")
    return synth.build_checkpoint(
        root / "qwen3_moe", "qwen3_moe", "tiny", seed=3, overrides={"max_position_embeddings": 8192}
    )


def _greedy(model, prompt, step, n=6):
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=n, prefill_step_size=step):
        out.append(int(token))
    return out


def test_resident_keeps_stock_step_streaming_takes_larger(long_context, monkeypatch):
    model, _ = moeflux_mlx.load(long_context, cache_budget="all")
    with model.moeflux:
        assert model.moeflux.prefill_step_size == rt_module.MLX_LM_PREFILL_STEP
    model, _ = moeflux_mlx.load(long_context, cache_budget=share_of_experts(0.25))
    with model.moeflux:
        step = model.moeflux.prefill_step_size
        assert step in rt_module.STREAMED_PREFILL_STEPS
        # memory decides: where little is free, stock's step; where much is, the largest
        args = model.args
        for free, want in ((1 << 20, rt_module.MLX_LM_PREFILL_STEP), (1 << 50, 16384)):
            monkeypatch.setattr(rt_module.psutil, "virtual_memory", lambda f=free: Memory(f, f))
            assert rt_module.prefill_step(model, model.moeflux) == want, (free, args)


def test_larger_step_gives_stock_tokens(long_context):
    stock, tokenizer = mlx_lm.load(str(long_context))
    prompt = tokenizer.encode(" ".join(["a long prompt of many words"] * 700))[:3000]
    assert len(prompt) > rt_module.MLX_LM_PREFILL_STEP  # more than one of stock's steps
    want = _greedy(stock, prompt, rt_module.MLX_LM_PREFILL_STEP)
    model, _ = moeflux_mlx.load(long_context, cache_budget=share_of_experts(0.25), backend="ops")
    with model.moeflux:
        step = model.moeflux.prefill_step_size
        assert step > len(prompt)  # one pass over the experts for the whole prompt
        assert _greedy(model, prompt, step) == _greedy(stock, prompt, step)
        # and stock's own chunking gives its tokens too (the step changes no token here)
        assert _greedy(model, prompt, step) == want

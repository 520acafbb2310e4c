"""Record a model's routing on a short text and turn it into its hit-rate curve
(``cache.curve``): what ``cache_budget="auto"`` picks from.

The routing is the router's own indices, as each streamed MoE layer receives them
(``StreamingRuntime.routing_sink``): the prompt's prefill (one row per token) then a greedy
decode, in token order per layer. Routing does not depend on the cache budget (the cache serves
the same experts whatever it holds), so the model may be loaded at any budget.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.utils import load_tokenizer

from ..cache.curve import SHARES, HitCurve, Timing, read_curve, simulate, write_curve
from ..cache.policy import POLICIES
from ..format.checkpoint import read_config

# a built-in text for a calibration without a prompt of the user's: plain prose on no one
# topic, so that the routing is an ordinary text's rather than one domain's
CALIBRATION_TEXT = (
    "The river ran low that autumn, and the mill stood quiet for the first time in years. "
    "In the town, people argued about the bridge, the price of bread, a letter from the "
    "capital, and whether the new school would open before winter. Maria kept the accounts "
    "for her uncle's shop: she wrote each sale in a narrow book, added the columns twice, and "
    "walked to the bank on Fridays. One evening a stranger asked her the way to the station, "
    "then how far it was to the sea, and whether the trains still ran at night. She drew him a "
    "map on the back of a receipt. Years later, teaching mathematics in a city she had never "
    "expected to see, she would remember that map, and the question he asked last: how do you "
    "know when a number is right? You check it another way, she had said."
)
# greedy decode tokens after the prompt: the decode rows the cache serves one token at a time
CALIBRATION_DECODE = 64


def record_routing(
    model: nn.Module, prompt: Sequence[int], decode: int = CALIBRATION_DECODE
) -> Dict[int, np.ndarray]:
    """Run ``model`` on ``prompt``, then ``decode`` greedy tokens, recording every MoE layer's
    routed experts.

    Args:
        model: a model ``moeflux_mlx.load`` returned.
        prompt: token ids.
        decode: tokens to generate after the prompt.

    Returns:
        layer -> ``[tokens, k]`` routed experts, in token order.
    """
    from mlx_lm.generate import generate_step

    rt = model.moeflux
    calls: Dict[int, List[np.ndarray]] = {i: [] for i in rt.layout.layers}

    def sink(layer: int, indices: mx.array) -> None:
        calls[layer].append(np.array(indices).reshape(-1, indices.shape[-1]))

    rt.routing_sink = sink
    try:
        steps = generate_step(
            mx.array(list(prompt)),
            model,
            max_tokens=decode,
            prefill_step_size=rt.prefill_step_size,
        )
        for _ in steps:
            pass
    finally:
        rt.routing_sink = None
    return {i: np.concatenate(c) for i, c in calls.items() if c}


def calibration_prompt(tokenizer, vocab_size: Optional[int] = None) -> List[int]:
    """``CALIBRATION_TEXT`` as token ids (ids past ``vocab_size`` wrapped into it: a synthetic
    model's tokenizer may be larger than its vocabulary)."""
    ids = list(tokenizer.encode(CALIBRATION_TEXT))
    return [i % vocab_size for i in ids] if vocab_size else ids


def calibration_ids(model_dir: Path) -> List[int]:
    """``CALIBRATION_TEXT`` as ``model_dir``'s token ids (its tokenizer, its vocabulary), the
    model not loaded: a decode measured on it routes as the curve's tokens did."""
    config = read_config(model_dir)
    vocab = config.get("text_config", config).get("vocab_size")
    return calibration_prompt(load_tokenizer(model_dir), vocab)


def curve_of(
    model: nn.Module,
    routing: Dict[int, np.ndarray],
    policies: Sequence[str],
    timing: Optional[Timing] = None,
) -> HitCurve:
    """The hit-rate curve of ``routing`` through each of ``policies``.

    Args:
        model: the model the routing was recorded on (its layout).
        routing: ``record_routing``'s.
        policies: eviction policy names (``cache.policy.POLICIES``).
        timing: the bandwidth and compute time measured, to record with it.

    Returns:
        The curve (not stored).
    """
    layout = model.moeflux.layout
    k = max(int(r.shape[-1]) for r in routing.values())
    return HitCurve(
        shares=SHARES,
        hit_rates={p: simulate(layout, routing, POLICIES[p]) for p in policies},
        num_experts=[lay.num_experts for _, lay in sorted(layout.layers.items())],
        top_k=k,
        total_expert_bytes=layout.total_expert_bytes,
        tokens=min(len(r) for r in routing.values()),
        timing=timing,
    )


def calibrate(
    model: nn.Module,
    tokenizer,
    model_dir: Path,
    prompt: Optional[Sequence[int]] = None,
    timing: Optional[Timing] = None,
    decode: int = CALIBRATION_DECODE,
) -> HitCurve:
    """Record ``model``'s routing on ``prompt`` (default: ``CALIBRATION_TEXT``), simulate it
    through the model's eviction policy, and record the curve for ``model_dir``.

    Args:
        model: a model ``moeflux_mlx.load`` returned.
        tokenizer: its tokenizer (for the built-in text).
        model_dir: the model directory the curve is recorded for.
        prompt: token ids (None: the built-in text).
        timing: the measured bandwidth and compute time, recorded with the curve (None: those
            recorded before are kept).
        decode: greedy decode tokens after the prompt.

    Returns:
        The curve, with the file it was written to.

    Raises:
        OSError: the curve could be written neither beside the model nor in the user cache.
    """
    if prompt is None:
        vocab = getattr(getattr(model, "args", None), "vocab_size", None)
        prompt = calibration_prompt(tokenizer, vocab)
    routing = record_routing(model, prompt, decode)
    curve = curve_of(model, routing, [model.moeflux.options.eviction], timing)
    return read_curve(write_curve(model_dir, curve))  # with the policies recorded before

"""Synthetic random-weight MoE checkpoints that are real mlx-lm checkpoints.

Tests, demos and benchmarks need MoE checkpoints without downloading one. This module
writes them: the model is built with mlx-lm's own classes (``_get_classes``), filled
with deterministic random weights, quantized with ``quantize_model`` (so the model's
own ``quant_predicate`` applies, exactly like ``mlx_lm.convert``) and saved with
``save_model``/``save_config``, next to a small byte-level BPE tokenizer with a ChatML
chat template. Plain ``mlx_lm.load(path)`` loads the result and ``mlx_lm.generate``
runs on it, fully offline.

Sizes: ``tiny`` (unit tests, builds in well under a second), ``small`` (the chat demo,
tens of MB), ``medium`` (experts of roughly 400-450 MB at 4 bits, for memory tests) and
``full`` (the real model's shapes, for GPU benchmarks; usually with
``overrides={"num_hidden_layers": 4}``).

The same seed gives byte-identical safetensors: every parameter draws from its own
key, derived from the seed and the parameter's name.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import io
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from tqdm import tqdm

from tests.support.architectures import MOE_ARCHITECTURES, SEPARATE_EXPERTS, tiny_config

logger = logging.getLogger(__name__)

# Bump when a change to this module changes what a given (arch, size, seed) writes;
# it keys the demo checkpoint cache.
SYNTH_VERSION = 1

ARCHITECTURES = ("qwen3_moe", "qwen3_5_moe", "deepseek_v3", "mixtral")
SIZES = ("tiny", "small", "medium", "full")
# affine bits and group sizes mx.quantize takes; each float mode takes one (bits, group) pair
QUANT_BITS = (1, 2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
QUANT_MODES = {"affine": None, "mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}

DEMO_ARCH = "qwen3_moe"
DEMO_SIZE = "small"

# --------------------------------------------------------------------------- tokenizer

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
# The trainer puts the special tokens first, in this order.
EOS_TOKEN_ID = SPECIAL_TOKENS.index(EOS_TOKEN)
PAD_TOKEN_ID = SPECIAL_TOKENS.index(PAD_TOKEN)
# Trained BPE vocabulary (special tokens + 256 bytes + merges). Larger config
# vocabularies are padded with filler tokens so every id the model emits decodes.
TOKENIZER_VOCAB_SIZE = 512
_MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- else %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Original text, written for this module, to train the tokenizer on.
_CORPUS = """\
The lighthouse stood at the end of a long stone pier, and every evening the keeper
climbed the one hundred and twelve steps to light the lamp. She kept a notebook in
which she wrote the weather, the ships that passed, and the names of the birds that
rested on the rail. On calm nights the sea was so quiet that she could hear the
harbour bell from across the bay. On stormy nights the waves broke over the pier and
the whole tower seemed to hum with the wind.

A mixture of experts is a model in which many small networks share the work. For each
word, a router looks at the input and chooses a few experts to run. Only the chosen
experts do any work, so the model can be very large while each step stays cheap. The
hard part is memory: all of the experts must live somewhere, even if only a few of
them are used at a time. When the experts do not fit in memory, they can be read from
a fast disk when the router asks for them, and the most popular ones can be kept in a
cache.

To make bread, mix four cups of flour with a spoon of salt and a little yeast. Add
warm water slowly and stir until the dough comes together. Knead it on a floured
table for ten minutes, until it is smooth and springs back when you press it. Let it
rise in a warm place for an hour, shape it into a loaf, and bake it in a hot oven
until the crust is brown and the bottom sounds hollow when you tap it.

The train left the city at seven in the morning. Through the window the houses gave
way to fields, the fields to forests, and the forests to mountains covered in snow.
A child in the next seat counted the tunnels out loud: one, two, three, four, five.
By noon the train had crossed the river twice and stopped at a small station where a
man sold hot tea and apples from a wooden cart.

Question: What is the capital of France?
Answer: The capital of France is Paris.
Question: How many days are there in a week?
Answer: There are seven days in a week.
Question: Why is the sky blue?
Answer: Sunlight is scattered by the air, and blue light is scattered the most, so
the sky looks blue during the day.
Question: Can you help me write a short poem about the sea?
Answer: Of course. Here is a short poem: The grey sea turns and turns again, it keeps
no record of the rain; it sings the same old song to me, and I sing back to the sea.

Good software is written for people first and for computers second. Choose clear
names, keep functions small, and write tests that can fail. When something breaks,
read the error message slowly, make the smallest change that could fix it, and run
the tests again. A good log tells you what happened, when it happened, and why.

In the spring the garden wakes up. The first green shoots push through the cold
earth, the apple tree is covered in white flowers, and the bees return to work from
morning until evening. By summer there are beans, tomatoes, peppers and more
courgettes than anyone could eat. In autumn the leaves turn red and gold, and in
winter the garden sleeps under a blanket of frost.

Numbers help us describe the world. There are 24 hours in a day, 60 minutes in an
hour, and 365 days in most years. Water freezes at 0 degrees and boils at 100 degrees
at sea level. A dozen is 12, a score is 20, and a gross is 144. If you save 5 coins
every day for 30 days, you will have 150 coins at the end of the month.

Hello! How are you today? I am fine, thank you. What would you like to talk about?
Let us talk about books, music, travel, science, or anything else you find
interesting. I will do my best to give a helpful and honest answer.
"""


@functools.lru_cache(maxsize=8)
def _tokenizer_json(vocab_size: int) -> str:
    """A byte-level BPE trained on ``_CORPUS``, padded to ``vocab_size`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < _MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be at least {_MIN_VOCAB_SIZE} "
            f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens), got {vocab_size}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, TOKENIZER_VOCAB_SIZE),
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)

    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    # Unreachable by encoding, but the model may emit them; they decode to " #<id>".
    next_id = len(vocab)
    while next_id < vocab_size:
        filler = f"\u0120#{next_id}"  # \u0120 is the byte-level form of a space
        if filler not in vocab:
            vocab[filler] = next_id
            next_id += 1
    return json.dumps(data, ensure_ascii=False)


def _tokenizer_config() -> Dict[str, Any]:
    added = {
        str(i): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, tok in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "chat_template": CHAT_TEMPLATE,
    }


def build_tokenizer(path: Union[str, Path], vocab_size: int = TOKENIZER_VOCAB_SIZE) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``path``.

    A byte-level BPE with ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (ids 0, 1,
    2) and a ChatML chat template; exactly ``vocab_size`` tokens. Deterministic, and
    trained once per process.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(_tokenizer_json(vocab_size), encoding="utf-8")
    config = json.dumps(_tokenizer_config(), indent=2, ensure_ascii=False)
    (path / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")
    special = {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    (path / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


# --------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class _Shape:
    """The scaled-down shape shared by the non-full sizes of every architecture."""

    hidden: int
    layers: int
    experts: int
    top_k: int
    moe_intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int = TOKENIZER_VOCAB_SIZE
    max_positions: int = 32768


# Every dimension an expert reads (hidden, moe_intermediate) is a multiple of 128, so
# each of the group sizes 32/64/128 quantizes every expert.
_SHAPES = {
    "tiny": _Shape(
        hidden=128,
        layers=2,
        experts=16,
        top_k=4,
        moe_intermediate=128,
        heads=4,
        kv_heads=2,
        head_dim=32,
    ),
    "small": _Shape(
        hidden=512,
        layers=4,
        experts=32,
        top_k=4,
        moe_intermediate=256,
        heads=8,
        kv_heads=2,
        head_dim=64,
    ),
    "medium": _Shape(
        hidden=1024,
        layers=8,
        experts=64,
        top_k=8,
        moe_intermediate=512,
        heads=16,
        kv_heads=4,
        head_dim=64,
    ),
}


def _qwen3_moe_config(size: str) -> Dict[str, Any]:
    if size == "full":  # Qwen3-30B-A3B
        s = _Shape(
            hidden=2048,
            layers=48,
            experts=128,
            top_k=8,
            moe_intermediate=768,
            heads=32,
            kv_heads=4,
            head_dim=128,
            vocab=151936,
            max_positions=40960,
        )
    else:
        s = _SHAPES[size]
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": s.hidden,
        "num_hidden_layers": s.layers,
        "intermediate_size": 3 * s.hidden,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "num_experts": s.experts,
        "num_experts_per_tok": s.top_k,
        "moe_intermediate_size": s.moe_intermediate,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "max_position_embeddings": s.max_positions,
        "attention_bias": False,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "vocab_size": s.vocab,
    }


def _qwen3_5_moe_config(size: str) -> Dict[str, Any]:
    if size == "full":  # Qwen3.5-397B-A17B
        s = _Shape(
            hidden=4096,
            layers=60,
            experts=512,
            top_k=10,
            moe_intermediate=1024,
            heads=32,
            kv_heads=2,
            head_dim=256,
            vocab=248320,
            max_positions=262144,
        )
        linear = {"v_heads": 64, "k_heads": 16, "k_dim": 128, "v_dim": 128}
        rope_theta = 10000000.0
    else:
        s = _SHAPES[size]
        s = replace(s, layers=max(s.layers, 4))  # room for one full-attention layer
        scale = {"tiny": 1, "small": 2, "medium": 4}[size]
        linear = {"v_heads": 4 * scale, "k_heads": 2 * scale, "k_dim": 32, "v_dim": 32}
        rope_theta = 10000000.0
    text = {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": s.hidden,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "attn_output_gate": True,
        "attention_bias": False,
        "full_attention_interval": 4,
        "linear_num_value_heads": linear["v_heads"],
        "linear_num_key_heads": linear["k_heads"],
        "linear_key_head_dim": linear["k_dim"],
        "linear_value_head_dim": linear["v_dim"],
        "linear_conv_kernel_dim": 4,
        "num_experts": s.experts,
        "num_experts_per_tok": s.top_k,
        "moe_intermediate_size": s.moe_intermediate,
        "shared_expert_intermediate_size": s.moe_intermediate,
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "max_position_embeddings": s.max_positions,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": rope_theta,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": False,
        "vocab_size": s.vocab,
    }
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "text_config": text,
    }


def _deepseek_v3_config(size: str) -> Dict[str, Any]:
    if size == "full":  # DeepSeek-V3
        s = _Shape(
            hidden=7168,
            layers=61,
            experts=256,
            top_k=8,
            moe_intermediate=2048,
            heads=128,
            kv_heads=128,
            head_dim=128,
            vocab=129280,
            max_positions=163840,
        )
        mla = {
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128,
            "v_head_dim": 128,
        }
        dense, n_group, topk_group, intermediate = 3, 8, 4, 18432
        rope_scaling = {
            "type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        }
    else:
        s = _SHAPES[size]
        s = replace(s, layers=s.layers + 1)  # + the dense first layer
        mla = {
            "q_lora_rank": s.hidden // 2,
            "kv_lora_rank": s.hidden // 4,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": s.head_dim,
            "v_head_dim": s.head_dim,
        }
        dense, n_group, topk_group, intermediate = 1, 4, 2, 3 * s.hidden
        rope_scaling = None
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": s.hidden,
        "num_hidden_layers": s.layers,
        "intermediate_size": intermediate,
        "moe_intermediate_size": s.moe_intermediate,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.heads,
        **mla,
        "n_routed_experts": s.experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": s.top_k,
        "n_group": n_group,
        "topk_group": topk_group,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": dense,
        "moe_layer_freq": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": s.max_positions,
        "attention_bias": False,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "vocab_size": s.vocab,
    }


def _mixtral_config(size: str) -> Dict[str, Any]:
    if size == "full":  # Mixtral-8x7B
        hidden, layers, heads, kv, intermediate, vocab = 4096, 32, 32, 8, 14336, 32000
    else:
        s = _SHAPES[size]
        hidden, layers, heads, kv, vocab = s.hidden, s.layers, s.heads, s.kv_heads, s.vocab
        # Mixtral has few, wide experts: 8 of them hold what the others spread wider.
        intermediate = s.moe_intermediate * s.experts // 8
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "vocab_size": vocab,
    }


_CONFIGS = {
    "qwen3_moe": _qwen3_moe_config,
    "qwen3_5_moe": _qwen3_5_moe_config,
    "deepseek_v3": _deepseek_v3_config,
    "mixtral": _mixtral_config,
}


def text_config(config: Dict[str, Any]) -> Dict[str, Any]:
    """The dict holding the language model's keys (``text_config`` where nested)."""
    return config.get("text_config", config)


def _apply_overrides(config: Dict[str, Any], overrides: Dict[str, Any]) -> None:
    """Set each override where the model reads it; nested configs take text keys."""
    nested = config.get("text_config")
    for key, value in overrides.items():
        if nested is None:
            config[key] = value
        elif key == "text_config":
            nested.update(copy.deepcopy(value))
        elif key in nested or key not in config:
            nested[key] = value
            if key in config:  # mirrored at both levels, e.g. tie_word_embeddings
                config[key] = value
        else:
            config[key] = value


def _validate(arch: str, config: Dict[str, Any]) -> None:
    tc = text_config(config)
    layers = tc["num_hidden_layers"]
    if layers < 1:
        raise ValueError(f"num_hidden_layers must be at least 1, got {layers}")
    if arch == "qwen3_moe":
        moe = [
            i
            for i in range(layers)
            if i not in tc["mlp_only_layers"] and (i + 1) % tc["decoder_sparse_step"] == 0
        ]
        n_experts = tc["num_experts"]
    elif arch == "qwen3_5_moe":
        interval = tc["full_attention_interval"]
        # mlx-lm indexes the cache of layer interval - 1 for the attention mask.
        if layers < interval:
            raise ValueError(
                f"qwen3_5_moe needs num_hidden_layers >= full_attention_interval "
                f"({layers} < {interval}); lower full_attention_interval as well"
            )
        moe = list(range(layers))
        n_experts = tc["num_experts"]
    elif arch == "deepseek_v3":
        # DeepSeek-V3's sanitize drops every "model.layers.61*" tensor (the MTP layer).
        if layers > 61:
            raise ValueError(f"deepseek_v3 supports at most 61 layers, got {layers}")
        moe = [
            i
            for i in range(layers)
            if i >= tc["first_k_dense_replace"] and i % tc["moe_layer_freq"] == 0
        ]
        n_experts = tc["n_routed_experts"]
        if n_experts % tc["n_group"] or n_experts // tc["n_group"] < 2:
            raise ValueError(
                f"n_routed_experts ({n_experts}) must split into n_group ({tc['n_group']}) "
                "groups of at least 2 experts"
            )
        if tc["topk_group"] * (n_experts // tc["n_group"]) < tc["num_experts_per_tok"]:
            raise ValueError("topk_group groups hold fewer experts than num_experts_per_tok")
    else:
        moe = list(range(layers))
        n_experts = tc["num_local_experts"]
    if not moe:
        raise ValueError(f"{arch} config with {layers} layers has no MoE layer")
    if not 1 <= tc["num_experts_per_tok"] <= n_experts:
        raise ValueError(
            f"num_experts_per_tok ({tc['num_experts_per_tok']}) must be in [1, {n_experts}]"
        )
    if _vocab_size(tc) < _MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {_MIN_VOCAB_SIZE}")


def model_config(arch: str, size: str = "tiny", **overrides: Any) -> Dict[str, Any]:
    """An HF-style ``config.json`` dict (with ``model_type``) for ``arch`` at ``size``.

    ``overrides`` set any key; for ``qwen3_5_moe`` they go into ``text_config``
    (where mlx-lm reads them) unless the key only exists at the top level.
    """
    if arch not in _CONFIGS and arch not in MOE_ARCHITECTURES and arch not in SEPARATE_EXPERTS:
        raise ValueError(
            f"Unknown architecture {arch!r}; choose from {ARCHITECTURES} "
            f"(any size) or {sorted(MOE_ARCHITECTURES)} (tiny)"
        )
    if size not in SIZES:
        raise ValueError(f"Unknown size {size!r}; choose from {SIZES}")
    if arch not in _CONFIGS:  # testing/architectures.py: every other mlx-lm MoE, tiny only
        if size != "tiny":
            raise ValueError(f"{arch} is only built at size 'tiny'")
        config = tiny_config(arch)
        tc = text_config(config)
        tc.update(eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID, bos_token_id=None)
        if tc is not config:
            config["eos_token_id"] = EOS_TOKEN_ID
        _apply_overrides(config, overrides)
        return config
    config = _CONFIGS[arch](size)
    tc = text_config(config)
    tc.update(eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID, bos_token_id=None)
    if tc is not config:
        config["eos_token_id"] = EOS_TOKEN_ID
    _apply_overrides(config, overrides)
    if arch == "qwen3_5_moe" and "layer_types" not in overrides:
        interval = tc["full_attention_interval"]
        tc["layer_types"] = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(tc["num_hidden_layers"])
        ]
    _validate(arch, config)
    return config


# --------------------------------------------------------------------------- weights

# Elements drawn per random call. A big tensor is drawn (and quantized) in chunks of
# rows, one after the other, so no float32 or full-size float copy of it ever exists.
_CHUNK_ELEMENTS = 1 << 24

# Draws float32 values for rows [lo, hi) of a parameter: (lo, hi, shape, key) -> array.
_Sampler = Callable[[int, int, Tuple[int, ...], mx.array], mx.array]


def _readable_rows(lo: int, hi: int) -> mx.array:
    """Row scales for the output head that favour the tokenizer's merged tokens.

    Special tokens, single bytes (many are control characters or half a UTF-8
    character) and padding fillers get smaller logits, so greedy text from the random
    model reads as word fragments and rarely stops on an early ``<|im_end|>``.
    """
    ids = mx.arange(lo, hi)
    merged = (ids >= _MIN_VOCAB_SIZE) & (ids < TOKENIZER_VOCAB_SIZE)
    return mx.where(merged, 1.0, 0.25)[:, None]


def _sampler(name: str, shape: Tuple[int, ...], hidden: int) -> _Sampler:
    """How to draw one parameter, by what the parameter is.

    Matrices get a fan-in scaled uniform (unit-variance outputs), so activations stay
    O(1) through the layers and bf16 logits stay finite; routers therefore give O(1)
    logits that pick different experts for different tokens.
    """

    def uniform(std: float, center: float = 0.0) -> _Sampler:
        a = std * math.sqrt(3.0)
        return lambda lo, hi, shp, key: mx.random.uniform(center - a, center + a, shp, key=key)

    if name.endswith("A_log"):
        # GatedDeltaNet decay rates, as HF initializes them: log(U(1, 16)).
        return lambda lo, hi, shp, key: mx.log(mx.random.uniform(1.0, 16.0, shp, key=key))
    if name.endswith("e_score_correction_bias"):
        return uniform(0.05)
    if name.endswith("dt_bias"):
        return uniform(0.05, center=1.0)
    if len(shape) == 1:
        # Norm scales near one; any other vector (a bias) near zero.
        return uniform(0.05, center=1.0) if name.endswith("weight") else uniform(0.02)
    if "conv1d" in name:
        return uniform(1.0 / math.sqrt(shape[1]))  # depthwise: fan-in is the kernel size
    if name.endswith("embed_tokens.weight"):
        return uniform(1.0)
    if name.endswith("lm_head.weight"):
        # Logits of std ~3 over the vocabulary: peaked enough for confident greedy
        # choices, spread enough that they change from token to token.
        head = uniform(3.0 / math.sqrt(hidden))
        return lambda lo, hi, shp, key: head(lo, hi, shp, key) * _readable_rows(lo, hi)
    return uniform(1.0 / math.sqrt(shape[-1]))


@dataclass
class _Draw:
    """One parameter's random value, produced in chunks of rows."""

    sample: _Sampler
    shape: Tuple[int, ...]
    key: mx.array
    dtype: mx.Dtype

    @property
    def bounds(self) -> List[Tuple[int, int]]:
        rows = self.shape[0] if self.shape else 1
        n = min(rows, max(1, -(-math.prod(self.shape) // _CHUNK_ELEMENTS)))
        cuts = [rows * i // n for i in range(n + 1)]
        return list(zip(cuts[:-1], cuts[1:]))

    def chunks(self, consume: Callable[[mx.array], List[mx.array]]) -> List[List[mx.array]]:
        """``consume(chunk)`` for every chunk of rows, in order.

        Chunk i is drawn only once ``consume(chunk i-1)`` is computed, so the chunks run
        one after the other rather than all at once, and each can be freed in turn.
        """
        bounds = self.bounds
        keys = mx.random.split(self.key, len(bounds)) if len(bounds) > 1 else [self.key]
        outs: List[List[mx.array]] = []
        for (lo, hi), key in zip(bounds, keys):
            if outs:
                key = mx.depends(key, outs[-1])
            shape = (hi - lo, *self.shape[1:]) if len(bounds) > 1 else self.shape
            part = self.sample(lo, hi, shape, key).astype(self.dtype)
            outs.append(consume(part))
        return outs

    def value(self) -> mx.array:
        parts = [p for (p,) in self.chunks(lambda part: [part])]
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)

    def quantized(self, group_size: int, bits: int, mode: str) -> List[mx.array]:
        """``mx.quantize`` of the value, chunk by chunk (groups never cross rows)."""
        outs = self.chunks(lambda part: list(mx.quantize(part, group_size, bits, mode=mode)))
        return [mx.concatenate(list(t), axis=0) for t in zip(*outs)]


def _param_key(seed: int, name: str) -> mx.array:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return mx.random.key(int.from_bytes(digest[:8], "little"))


def _randomize(model: nn.Module, seed: int, hidden: int, dtype: mx.Dtype) -> Dict[str, _Draw]:
    """Replace every parameter with a lazy draw from its own (seed, name) key."""
    cast = getattr(model, "cast_predicate", lambda _: True)
    draws = {}
    for name, value in tree_flatten(model.parameters()):
        # mlx-lm keeps some parameters in float32 (cast_predicate), as convert does.
        target = dtype if cast(name) else mx.float32
        draws[name] = _Draw(
            _sampler(name, value.shape, hidden), value.shape, _param_key(seed, name), target
        )
    model.update(tree_unflatten([(name, d.value()) for name, d in draws.items()]))
    return draws


def _quantize_in_chunks(model: nn.Module, draws: Dict[str, _Draw]) -> None:
    """Rebuild big quantized weights from their chunks; the bytes are the same.

    ``quantize_model`` decided which modules to quantize and how; this only swaps the
    lazy graph ``quantize(concatenate(chunks))`` for ``concatenate(quantize(chunk))``,
    which never materializes the whole float tensor.
    """
    for path, module in model.named_modules():
        draw = draws.get(f"{path}.weight")
        if draw is None or "scales" not in module or len(draw.bounds) == 1:
            continue
        if module.get("global_scale") is not None:  # one scale per whole expert: not by rows
            continue
        weight, scales, *biases = draw.quantized(module.group_size, module.bits, module.mode)
        module.weight, module.scales = weight, scales
        if biases:
            module.biases = biases[0]


def _eval_groups(model: nn.Module) -> OrderedDict[str, List[mx.array]]:
    """Parameters grouped by decoder layer (or top-level module), in model order."""
    groups: OrderedDict[str, List[mx.array]] = OrderedDict()
    for name, value in tree_flatten(model.parameters()):
        parts = name.split(".")
        if "layers" in parts and parts.index("layers") + 1 < len(parts):
            head = ".".join(parts[: parts.index("layers") + 2])
        else:
            head = ".".join(parts[:-1])
        groups.setdefault(head, []).append(value)
    return groups


def _check_quant_args(bits: int, group_size: int, mode: str = "affine") -> None:
    if mode not in QUANT_MODES:
        raise ValueError(f"mode must be one of {tuple(QUANT_MODES)}, got {mode!r}")
    if QUANT_MODES[mode] is not None:
        if (bits, group_size) != QUANT_MODES[mode]:
            raise ValueError(f"{mode} takes (bits, group_size) {QUANT_MODES[mode]}")
        return
    if bits not in QUANT_BITS:
        raise ValueError(f"bits must be one of {QUANT_BITS}, got {bits}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")


def _hidden_size(tc: Dict[str, Any]) -> int:
    return int(tc.get("hidden_size") or tc.get("model_dim") or tc.get("d_model"))


def _vocab_size(tc: Dict[str, Any]) -> int:
    return int(tc.get("vocab_size") or tc.get("num_vocab"))


# mlx_lm.convert's mixed-precision recipes (--quant-predicate)
RECIPES = ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")


def _quantize(
    model: nn.Module,
    config: Dict[str, Any],
    bits: int,
    group_size: int,
    mode: str = "affine",
    recipe: Optional[str] = None,
    quant_predicate: Optional[Callable[[str, nn.Module], Any]] = None,
    global_scale: bool = False,
) -> Dict[str, Any]:
    """``quantize_model`` as ``mlx_lm.convert`` calls it (a recipe's predicate, else the model's
    own), or with ``quant_predicate`` (e.g. experts left unquantized)."""
    from mlx_lm.models.switch_layers import SwitchLinear
    from mlx_lm.utils import quantize_model

    if recipe is not None:
        from mlx_lm.convert import mixed_quant_predicate_builder

        if recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
        quant_predicate = mixed_quant_predicate_builder(recipe, model, group_size)
    # quantize_model reports bits per weight with print(); route it to the log.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _, config = quantize_model(
            model,
            config,
            group_size,
            bits,
            mode=mode,
            global_scale=global_scale,
            quant_predicate=quant_predicate,
        )
    if msg := out.getvalue().strip():
        logger.debug("%s", msg)
    left = [
        n
        for n, m in model.named_modules()
        if isinstance(m, SwitchLinear) and m.weight.shape[-1] % group_size
    ]
    if left:
        raise ValueError(
            f"group_size {group_size} does not divide the input dims of {left[0]} "
            f"(and {len(left) - 1} more expert projections); they would stay unquantized"
        )
    return config


def build_model(
    arch: str = "qwen3_moe",
    size: str = "tiny",
    *,
    bits: int = 4,
    group_size: int = 64,
    seed: int = 0,
    dtype: str = "bfloat16",
    overrides: Optional[Dict[str, Any]] = None,
    quantize: bool = True,
    progress: Optional[bool] = None,
    mode: str = "affine",
    recipe: Optional[str] = None,
    quant_predicate: Optional[Callable[[str, nn.Module], Any]] = None,
    global_scale: bool = False,
) -> Tuple[nn.Module, Dict[str, Any]]:
    """Build the random-weight mlx-lm model in memory; returns ``(model, config)``.

    ``config`` is what ``build_checkpoint`` saves as ``config.json`` (with the
    ``quantization`` entries when quantized). Parameters are evaluated one decoder layer
    at a time after quantization, so a full-shaped layer's float weights never all exist
    at once. ``mode``, ``recipe``, ``quant_predicate`` and ``global_scale`` are
    ``quantize_model``'s (see ``build_checkpoint``).
    """
    from mlx_lm.utils import _get_classes

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    if quantize:
        _check_quant_args(bits, group_size, mode)
    config = model_config(arch, size, **(overrides or {}))
    config["torch_dtype"] = dtype
    if "text_config" in config:
        config["text_config"]["dtype"] = dtype
    if progress is None:
        progress = size in ("medium", "full")

    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(copy.deepcopy(config)))
    draws = _randomize(model, seed, _hidden_size(text_config(config)), DTYPES[dtype])
    if quantize:
        config = _quantize(
            model, config, bits, group_size, mode, recipe, quant_predicate, global_scale
        )
        _quantize_in_chunks(model, draws)
    del draws  # the chunk graphs now hang off the model's parameters only
    model.eval()

    groups = _eval_groups(model)
    for arrays in tqdm(
        groups.values(), desc=f"building {arch}/{size}", unit="module", disable=not progress
    ):
        mx.eval(arrays)
    return model, config


def build_checkpoint(
    path: Union[str, Path],
    arch: str = "qwen3_moe",
    size: str = "tiny",
    *,
    bits: int = 4,
    group_size: int = 64,
    seed: int = 0,
    dtype: str = "bfloat16",
    overrides: Optional[Dict[str, Any]] = None,
    quantize: bool = True,
    mode: str = "affine",
    recipe: Optional[str] = None,
    quant_predicate: Optional[Callable[[str, nn.Module], Any]] = None,
    global_scale: bool = False,
) -> Path:
    """Write a random-weight mlx-lm MoE checkpoint (weights, config, tokenizer) to ``path``.

    ``arch``: one of ``ARCHITECTURES`` (every size), or any architecture of
    ``architectures.MOE_ARCHITECTURES`` (size ``tiny``). Quantized as ``mlx_lm.convert``
    does: ``mode`` ``affine`` with ``bits`` in {1, 2, 3, 4, 5, 6, 8} and ``group_size`` in
    {32, 64, 128}, or ``mxfp4`` (4, 32), ``nvfp4`` (4, 16), ``mxfp8`` (8, 32); these apply
    where the model's ``quant_predicate`` does not choose otherwise (Qwen routers stay 8-bit,
    group 64). ``recipe``: one of mlx-lm's mixed recipes (``mixed_3_6``, ...: per layer and per
    projection); ``quant_predicate``: any other (``(path, module) -> bool | dict``);
    ``global_scale``: nvfp4's per-expert tensor scale. ``quantize=False`` keeps every weight
    in ``dtype``. The same arguments write byte-identical safetensors.
    """
    from mlx_lm.utils import save_config, save_model

    path = Path(path)
    start = time.perf_counter()
    model, config = build_model(
        arch,
        size,
        bits=bits,
        group_size=group_size,
        seed=seed,
        dtype=dtype,
        overrides=overrides,
        quantize=quantize,
        mode=mode,
        recipe=recipe,
        quant_predicate=quant_predicate,
        global_scale=global_scale,
    )
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model, donate_model=True)
    del model
    save_config(copy.deepcopy(config), path / "config.json")
    build_tokenizer(path, vocab_size=_vocab_size(text_config(config)))
    logger.info(
        "Wrote %s/%s checkpoint to %s in %.1f s", arch, size, path, time.perf_counter() - start
    )
    return path


# --------------------------------------------------------------------------- demo


def _demo_version() -> str:
    import mlx_lm

    spec = {
        "synth": SYNTH_VERSION,
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "config": model_config(DEMO_ARCH, DEMO_SIZE),
        "corpus": hashlib.sha256(_CORPUS.encode()).hexdigest(),
        "chat_template": CHAT_TEMPLATE,
    }
    blob = json.dumps(spec, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "moeflux-mlx"


def _remove_stale_builds(cache_dir: Path, name: str, max_age_s: float = 3600.0) -> None:
    """Remove temp dirs left by builds that crashed (old enough to not be running)."""
    now = time.time()
    for stale in cache_dir.glob(f".{name}.tmp-*"):
        try:
            if now - stale.stat().st_mtime > max_age_s:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass


def demo_checkpoint(cache_dir: Union[str, Path, None] = None) -> Path:
    """The demo checkpoint (``qwen3_moe``, ``small``, 4-bit), built once and cached.

    Lives in ``<cache_dir>/demo-<version-hash>`` (``cache_dir`` defaults to
    ``~/.cache/moeflux-mlx``). Built in a temp dir beside it and renamed into place,
    so concurrent or crashed builds never leave a partial checkpoint at that path.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    name = f"demo-{_demo_version()}"
    target = cache_dir / name
    if (target / "config.json").is_file():
        return target

    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(cache_dir, name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=cache_dir))
    try:
        logger.info("Building the demo checkpoint in %s", target)
        build_checkpoint(tmp, DEMO_ARCH, DEMO_SIZE)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished first; its checkpoint is the same.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target

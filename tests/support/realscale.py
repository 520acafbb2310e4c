"""Checkpoints with the real models' shapes and no weights: sparse files.

``write_sparse_checkpoint(path, name)`` writes what ``mlx_lm.convert`` would write for one of
``REAL_MODELS`` (Qwen3-30B-A3B, Qwen3.5-397B-A17B, DeepSeek-V3 / Cogito-V2 671B, Kimi-K2 1T,
gpt-oss-120b, Llama-4-Maverick): ``config.json`` with its ``quantization`` entries,
``model-NNNNN-of-NNNNN.safetensors`` shards of at most 5 GB with the real tensor names, shapes,
dtypes and offsets, and ``model.safetensors.index.json``; but every shard is only its header,
then ``truncate``d to its full size. The weight bytes are holes: they cost no disk and read as
zeros. A small tokenizer goes beside (mlx-lm never checks its size against the model's).

The tensors are those of the model mlx-lm builds from the config (its own classes, lazily:
nothing is ever evaluated), cast and quantized by ``quantize_model`` as ``mlx_lm.convert``
does, with the model's own ``quant_predicate`` or the recipe the published checkpoint used.
So every layout, offset and size bug that only shows at real scale shows here, in seconds.

The configs are those mlx-community publishes (``config.json`` of the repos named in
``RealModel.repo``), written down here; docs/architectures.md says where each came from.
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from tests.support.synth import _quantize, build_tokenizer

SHARD_BYTES = 5 * 1024**3  # mlx-lm's MAX_FILE_SIZE_GB
SAFETENSORS_DTYPES = {
    mx.bool_: "BOOL",
    mx.uint8: "U8",
    mx.int8: "I8",
    mx.uint16: "U16",
    mx.int16: "I16",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.uint32: "U32",
    mx.int32: "I32",
    mx.float32: "F32",
    mx.uint64: "U64",
    mx.int64: "I64",
}


@dataclass(frozen=True)
class RealModel:
    """One published checkpoint: its config and how it was quantized."""

    repo: str  # where the config comes from (mlx-community's conversion)
    config: Dict[str, Any]
    bits: int = 4
    group_size: int = 64
    mode: str = "affine"
    # (path, module) -> bool | dict, as mlx_lm.convert's quant_predicate; None: the model's own
    predicate: Optional[Callable[[str, nn.Module], Any]] = field(default=None, compare=False)
    approx_bytes: float = 0.0  # the repo's weights, roughly, as listed on its page (GB, 1e9)


def _qwen3_30b() -> Dict[str, Any]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "intermediate_size": 6144,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "max_position_embeddings": 40960,
        "attention_bias": False,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "vocab_size": 151936,
        "torch_dtype": "bfloat16",
    }


def _qwen3_5_397b() -> Dict[str, Any]:
    text = {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 4096,
        "num_hidden_layers": 60,
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "attn_output_gate": True,
        "attention_bias": False,
        "full_attention_interval": 4,
        "layer_types": [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(60)
        ],
        "linear_num_value_heads": 64,
        "linear_num_key_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 1024,
        "shared_expert_intermediate_size": 1024,
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "max_position_embeddings": 262144,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": False,
        "vocab_size": 248320,
        "dtype": "bfloat16",
    }
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "text_config": text,
        "torch_dtype": "bfloat16",
    }


def _deepseek_v3_671b(**changes: Any) -> Dict[str, Any]:
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "max_position_embeddings": 163840,
        "attention_bias": False,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "vocab_size": 129280,
        "torch_dtype": "bfloat16",
    }
    config.update(changes)
    return config


def _kimi_k2() -> Dict[str, Any]:
    return _deepseek_v3_671b(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="kimi_k2",
        num_attention_heads=64,
        num_key_value_heads=64,
        n_routed_experts=384,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.827,
        first_k_dense_replace=1,
        rope_theta=50000.0,
        rope_scaling={
            "type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        max_position_embeddings=131072,
        vocab_size=163840,
    )


def _gpt_oss_120b() -> Dict[str, Any]:
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "num_hidden_layers": 36,
        "intermediate_size": 2880,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "sliding_window": 128,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(36)],
        "rope_theta": 150000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "vocab_size": 201088,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def _gpt_oss_mxfp4_q8(path: str, module: nn.Module) -> Any:
    """gpt-oss as mlx-community ships it (MXFP4-Q8): experts in mxfp4 (as OpenAI trained
    them), every other linear map 8-bit affine."""
    if ".experts." in path:
        return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    return {"group_size": 64, "bits": 8, "mode": "affine"}


def _llama4_maverick() -> Dict[str, Any]:
    text = {
        "model_type": "llama4_text",
        "attention_bias": False,
        "attention_chunk_size": 8192,
        "head_dim": 128,
        "hidden_size": 5120,
        "interleave_moe_layer_step": 2,
        "intermediate_size": 8192,
        "intermediate_size_mlp": 16384,
        "max_position_embeddings": 1048576,
        "num_attention_heads": 40,
        "num_experts_per_tok": 1,
        "num_hidden_layers": 48,
        "num_key_value_heads": 8,
        "num_local_experts": 128,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": 500000.0,
        "use_qk_norm": False,
        "vocab_size": 202048,
        "torch_dtype": "bfloat16",
    }
    return {
        "architectures": ["Llama4ForConditionalGeneration"],
        "model_type": "llama4",
        "text_config": text,
        "torch_dtype": "bfloat16",
    }


REAL_MODELS: Dict[str, RealModel] = {
    "Qwen3-30B-A3B": RealModel(
        "mlx-community/Qwen3-30B-A3B-4bit", _qwen3_30b(), approx_bytes=17.2e9
    ),
    "Qwen3.5-397B-A17B": RealModel(
        "mlx-community/Qwen3.5-397B-A17B-4bit", _qwen3_5_397b(), approx_bytes=224e9
    ),
    "DeepSeek-V3": RealModel(  # Cogito-V2 671B (deepcogito) has the same architecture
        "mlx-community/DeepSeek-V3-0324-4bit", _deepseek_v3_671b(), approx_bytes=378e9
    ),
    "Kimi-K2": RealModel("mlx-community/Kimi-K2-Instruct-4bit", _kimi_k2(), approx_bytes=578e9),
    # the same at 8 bits (mlx_lm.convert -q --q-bits 8): over a terabyte of experts
    "Kimi-K2-8bit": RealModel("mlx-community/Kimi-K2-Instruct-8bit", _kimi_k2(), bits=8),
    "gpt-oss-120b": RealModel(
        "mlx-community/gpt-oss-120b-MXFP4-Q8",
        _gpt_oss_120b(),
        bits=8,
        group_size=64,
        predicate=_gpt_oss_mxfp4_q8,
        approx_bytes=65e9,
    ),
    "Llama-4-Maverick": RealModel(
        "mlx-community/Llama-4-Maverick-17B-128E-Instruct-4bit",
        _llama4_maverick(),
        approx_bytes=226e9,
    ),
}


def lazy_parameters(name: str) -> Tuple[Dict[str, mx.array], Dict[str, Any]]:
    """``(parameters, config)`` of ``REAL_MODELS[name]`` as ``mlx_lm.convert`` would save them:
    built by mlx-lm's classes, cast to the config's dtype, quantized. Lazy: nothing evaluated."""
    from mlx_lm.utils import _get_classes

    spec = REAL_MODELS[name]
    config = copy.deepcopy(spec.config)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(copy.deepcopy(config)))
    dtype = getattr(mx, config.get("torch_dtype", "bfloat16"))
    cast = getattr(model, "cast_predicate", lambda _: True)
    model.update(
        tree_map_with_path(
            lambda k, v: v.astype(dtype) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v,
            model.parameters(),
        )
    )
    config = _quantize(
        model, config, spec.bits, spec.group_size, spec.mode, quant_predicate=spec.predicate
    )
    return dict(tree_flatten(model.parameters())), config


def _write_header(path: Path, tensors: Dict[str, Tuple[str, tuple, int]]) -> int:
    """A safetensors file of ``{name: (dtype, shape, nbytes)}`` whose data are holes."""
    header: Dict[str, Any] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for n, (dtype, shape, nbytes) in tensors.items():
        header[n] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)
    return offset


def write_sparse_checkpoint(path: Union[str, Path], name: str) -> Path:
    """Write ``REAL_MODELS[name]`` as a sparse mlx-lm checkpoint into ``path`` (see above).

    Returns ``path``. Disk used: the headers and a small tokenizer (well under 10 MB)."""
    from mlx_lm.utils import save_config

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    params, config = lazy_parameters(name)
    tensors = {
        n: (SAFETENSORS_DTYPES[a.dtype], tuple(a.shape), a.nbytes) for n, a in params.items()
    }
    shards, size = [[]], 0  # mlx-lm's make_shards: in parameter order, at most 5 GB each
    for n, (_, _, nbytes) in tensors.items():
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += _write_header(path / file, {n: tensors[n] for n in names})
        weight_map.update({n: file for n in names})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    save_config(config, path / "config.json")
    build_tokenizer(path)
    return path


def apparent_bytes(path: Union[str, Path]) -> int:
    """The checkpoint's size as listed (what the holes stand for)."""
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def disk_bytes(path: Union[str, Path]) -> int:
    """What the checkpoint really occupies on disk."""
    return sum(os.stat(f).st_blocks * 512 for f in Path(path).iterdir() if f.is_file())


def expected_expert_bytes(name: str) -> Tuple[int, int]:
    """``(MoE layers, bytes of one expert blob)`` computed from the config alone, as a check of
    what the scan finds: each projection's weight, scales, biases (affine) and bias (gpt-oss),
    each started on a 64-byte boundary."""
    spec = REAL_MODELS[name]
    tc = spec.config.get("text_config", spec.config)
    hidden = tc["hidden_size"]
    if spec.config["model_type"] == "gpt_oss":
        inter, layers, bits, group, mode = (
            tc["intermediate_size"],
            tc["num_hidden_layers"],
            4,
            32,
            "mxfp4",
        )
        bias = True
    else:
        inter = (
            tc["moe_intermediate_size"]
            if "moe_intermediate_size" in tc
            else tc["intermediate_size"]
        )
        n = tc["num_hidden_layers"]
        if "first_k_dense_replace" in tc:
            layers = n - tc["first_k_dense_replace"]
        elif "interleave_moe_layer_step" in tc:
            layers = n // tc["interleave_moe_layer_step"]
        else:
            layers = n
        bits, group, mode, bias = spec.bits, spec.group_size, spec.mode, False

    def align(x: int) -> int:
        return (x + 63) // 64 * 64

    def projection(out_dims: int, in_dims: int) -> list:
        parts = [out_dims * in_dims * bits // 8]  # weight
        scale_bytes = 2 if mode == "affine" else 1  # bf16 / uint8 (float modes)
        parts.append(out_dims * (in_dims // group) * scale_bytes)  # scales
        if mode == "affine":
            parts.append(out_dims * (in_dims // group) * 2)  # biases
        if bias:
            parts.append(out_dims * 2)
        return parts

    parts = projection(inter, hidden) * 2 + projection(hidden, inter)
    return layers, align(sum(align(p) for p in parts[:-1]) + parts[-1])


def expert_count(name: str) -> int:
    tc = REAL_MODELS[name].config.get("text_config", REAL_MODELS[name].config)
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):
        if key in tc:
            return int(tc[key])
    raise KeyError(name)


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n < 1e12 else f"{n / 1e12:.2f} TB"


__all__ = [
    "REAL_MODELS",
    "RealModel",
    "apparent_bytes",
    "disk_bytes",
    "expected_expert_bytes",
    "expert_count",
    "lazy_parameters",
    "write_sparse_checkpoint",
    "math",
]

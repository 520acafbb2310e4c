"""Tiny ``config.json`` dicts for every MoE architecture of mlx-lm's ``models/`` folder.

``synth.build_checkpoint(path, arch, "tiny")`` builds any of them with mlx-lm's own classes, so a
test can check, architecture by architecture, that streaming computes what stock mlx-lm does.
Every config is as small as the architecture allows (hidden 64, 8 experts of 64, 2 or 3
layers, a dense first layer where the architecture has one), and keeps what matters for the
experts: the module's name, shared experts, biases, activation, top-k (top-1 for llama4).

``MOE_ARCHITECTURES``: the tiny configs, by the name mlx-lm loads them under (``model_type``,
or one of mlx-lm's remapped names, e.g. ``kimi_k2``). For the four architectures of
``synth.ARCHITECTURES`` synth's own configs (which come in every size) take precedence.
``NOT_ON_CPU``: architectures whose mlx-lm model does not run on MLX's CPU backend (built and
converted, not generated from, on the CPU).
``SEPARATE_EXPERTS``: MoE architectures whose mlx-lm model has no stacked experts at all.
"""

from __future__ import annotations

import copy
from typing import Any, Dict

HIDDEN, INTERMEDIATE, MOE_INTERMEDIATE, EXPERTS, TOP_K = 64, 128, 64, 8, 2
VOCAB = 512  # synth's tokenizer

# keys most architectures read (unknown keys are ignored by mlx-lm's ModelArgs.from_dict)
_BASE: Dict[str, Any] = dict(
    hidden_size=HIDDEN,
    intermediate_size=INTERMEDIATE,
    moe_intermediate_size=MOE_INTERMEDIATE,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    attention_bias=False,
    norm_topk_prob=True,
    num_experts_per_tok=TOP_K,
    rope_scaling=None,
    hidden_act="silu",
)
_EXPERTS = dict(num_experts=EXPERTS)
# DeepSeek-V3-like: MLA attention, a dense first layer, shared expert, grouped routing
_MLA = dict(
    n_routed_experts=EXPERTS,
    n_shared_experts=1,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    num_hidden_layers=3,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    kv_lora_rank=32,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    num_key_value_heads=4,
)
_YARN = {
    "type": "yarn",
    "factor": 1.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
_SLIDING = ["sliding_attention", "full_attention"]


def _flat(model_type: str, **keys: Any) -> Dict[str, Any]:
    config = dict(copy.deepcopy(_BASE), model_type=model_type)
    config.update(copy.deepcopy(keys))
    return config


def _nested(model_type: str, text: Dict[str, Any], **keys: Any) -> Dict[str, Any]:
    return dict(model_type=model_type, text_config=copy.deepcopy(text), **keys)


_QWEN_NEXT = dict(
    _EXPERTS,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    decoder_sparse_step=1,
    shared_expert_intermediate_size=MOE_INTERMEDIATE,
    mlp_only_layers=[],
    partial_rotary_factor=0.25,
    full_attention_interval=2,
)
_KIMI_LINEAR_ATTN = {
    "kda_layers": [1],
    "full_attn_layers": [2],
    "head_dim": 16,
    "num_heads": 4,
    "short_conv_kernel_size": 4,
}
_LONGCAT = dict(
    attention_method="MLA",
    zero_expert_type="identity",
    ffn_hidden_size=INTERMEDIATE,
    moe_topk=TOP_K,
    expert_ffn_hidden_size=MOE_INTERMEDIATE,
    n_routed_experts=EXPERTS,
    zero_expert_num=2,
    num_layers=2,
    kv_lora_rank=32,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    routed_scaling_factor=1.0,
    mla_scale_q_lora=True,
    mla_scale_kv_lora=True,
)
_MISTRAL4_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 1.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "llama_4_scaling_beta": 0.1,
}
_GEMMA4 = dict(
    enable_moe_block=True,
    num_experts=EXPERTS,
    top_k_experts=TOP_K,
    num_kv_shared_layers=0,
    hidden_size_per_layer_input=0,
    global_head_dim=32,
    sliding_window=16,
    layer_types=_SLIDING,
    vocab_size_per_layer_input=VOCAB,
)

MOE_ARCHITECTURES: Dict[str, Dict[str, Any]] = {
    "afmoe": _flat(
        "afmoe",
        **_EXPERTS,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        num_hidden_layers=3,
        num_dense_layers=1,
        num_shared_experts=1,
        sliding_window=16,
    ),
    "bailing_hybrid": _flat(
        "bailing_hybrid",
        **_EXPERTS,
        num_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        layer_group_size=2,
        group_norm_size=1,
        routed_scaling_factor=1.0,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        num_hidden_layers=3,
    ),
    "bailing_moe": _flat(
        "bailing_moe",
        **_EXPERTS,
        num_shared_experts=1,
        first_k_dense_replace=1,
        num_hidden_layers=3,
    ),
    "bailing_moe_linear": _flat(
        "bailing_moe_linear",
        **_EXPERTS,
        num_shared_experts=1,
        first_k_dense_replace=1,
        num_hidden_layers=3,
        layer_group_size=2,
        group_norm_size=1,
    ),
    "bailing_moe_v3": _flat(
        "bailing_hybrid",
        architectures=["BailingMoeV3ForCausalLM"],
        **_EXPERTS,
        num_shared_experts=1,
        moe_shared_expert_intermediate_size=MOE_INTERMEDIATE,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        layer_group_size=2,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_hidden_layers=3,
    ),
    "deepseek": _flat(
        "deepseek",
        n_routed_experts=EXPERTS,
        n_shared_experts=1,
        first_k_dense_replace=1,
        num_hidden_layers=3,
    ),
    "deepseek_v2": _flat(
        "deepseek_v2", **dict(_MLA, topk_method="greedy", n_group=1), rope_scaling=_YARN
    ),
    "deepseek_v3": _flat("deepseek_v3", **_MLA),
    "deepseek_v32": _flat("deepseek_v32", **_MLA, index_head_dim=16, index_n_heads=2, index_topk=8),
    "deepseek_v41": _flat(
        "deepseek_v41",
        n_routed_experts=EXPERTS,
        head_dim=32,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        o_groups=2,
        o_lora_rank=16,
        hc_mult=2,
        sliding_window=16,
        index_n_heads=2,
        index_head_dim=16,
    ),
    "dots1": _flat(
        "dots1",
        n_routed_experts=EXPERTS,
        n_shared_experts=1,
        first_k_dense_replace=1,
        num_hidden_layers=3,
        routed_scaling_factor=1.0,
    ),
    "ernie4_5_moe": _flat(
        "ernie4_5_moe",
        use_bias=False,
        moe_num_experts=EXPERTS,
        moe_k=TOP_K,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
        num_hidden_layers=3,
    ),
    "exaone_moe": _flat(
        "exaone_moe",
        **_EXPERTS,
        num_shared_experts=1,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        is_moe_layer=[False, True, True],
        num_hidden_layers=3,
    ),
    "gemma4": _nested("gemma4", _flat("gemma4_text", **_GEMMA4), vocab_size=VOCAB),
    "gemma4_text": _flat("gemma4_text", **_GEMMA4),
    "glm4_moe": _flat("glm4_moe", **_MLA, use_qk_norm=True, partial_rotary_factor=0.5),
    "glm4_moe_lite": _flat("glm4_moe_lite", **_MLA),
    "glm_moe_dsa": _flat(
        "glm_moe_dsa",
        **_MLA,
        index_head_dim=16,
        index_n_heads=2,
        index_topk=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "gpt_oss": _flat(
        "gpt_oss",
        num_local_experts=EXPERTS,
        sliding_window=16,
        layer_types=_SLIDING,
        intermediate_size=MOE_INTERMEDIATE,
    ),
    "granitemoe": _flat(
        "granitemoe",
        num_local_experts=EXPERTS,
        logits_scaling=1.0,
        attention_multiplier=0.25,
        embedding_multiplier=1.0,
        residual_multiplier=1.0,
    ),
    "granitemoehybrid": _flat(
        "granitemoehybrid",
        num_local_experts=EXPERTS,
        logits_scaling=1.0,
        attention_multiplier=0.25,
        embedding_multiplier=1.0,
        residual_multiplier=1.0,
        layer_types=["mamba", "attention"],
        shared_intermediate_size=MOE_INTERMEDIATE,
        mamba_n_heads=8,  # x mamba_d_head = 2 x hidden (transformers checks it)
        mamba_d_head=16,
        mamba_proj_bias=False,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_n_groups=1,
        mamba_conv_bias=True,
    ),
    "hunyuan": _flat(
        "hunyuan",
        **_EXPERTS,
        moe_topk=TOP_K,
        num_shared_expert=1,
        use_mixed_mlp_moe=True,
        use_qk_norm=True,
        use_cla=False,
        cla_share_factor=1,
        rope_scaling={"alpha": 1.0, "factor": 1.0, "type": "dynamic"},
    ),
    "jamba": _flat(
        "jamba",
        **_EXPERTS,
        attn_layer_offset=1,
        attn_layer_period=2,
        expert_layer_offset=0,
        expert_layer_period=1,
        mamba_d_conv=4,
        mamba_d_state=8,
        mamba_expand=2,
    ),
    "Klear": _flat(
        "Klear", **_EXPERTS, mlp_only_layers=[], decoder_sparse_step=1, n_shared_experts=1
    ),
    "kimi_k2": _flat("kimi_k2", **_MLA),  # mlx-lm remaps it to deepseek_v3
    "kimi_k25": _nested("kimi_k25", _flat("deepseek_v3", **_MLA)),
    "kimi_k3": _nested(
        "kimi_k3",
        _flat(
            "kimi_linear",
            num_experts=EXPERTS,
            num_experts_per_token=TOP_K,
            linear_attn_config=_KIMI_LINEAR_ATTN,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            num_shared_experts=1,
            hidden_act="situ",
        ),
    ),
    "kimi_linear": _flat(
        "kimi_linear",
        **_EXPERTS,
        linear_attn_config=_KIMI_LINEAR_ATTN,
        model_max_length=4096,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts_per_token=TOP_K,
        num_shared_experts=1,
    ),
    "kimi_vl": _nested("kimi_vl", _flat("deepseek_v3", **_MLA)),
    "laguna": _flat("laguna", **_EXPERTS, shared_expert_intermediate_size=MOE_INTERMEDIATE),
    "lfm2_moe": _flat(
        "lfm2_moe",
        **_EXPERTS,
        use_expert_bias=True,
        num_dense_layers=1,
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        num_hidden_layers=3,
        full_attn_idxs=[1],
    ),
    "llama4": _nested(
        "llama4",
        _flat(
            "llama4_text",
            attention_chunk_size=16,
            interleave_moe_layer_step=2,
            intermediate_size=MOE_INTERMEDIATE,
            intermediate_size_mlp=INTERMEDIATE,
            num_local_experts=EXPERTS,
            num_experts_per_tok=1,
            use_qk_norm=True,
            num_hidden_layers=4,
        ),
    ),
    "longcat_flash": _flat("longcat_flash", **_LONGCAT),
    "longcat_flash_ngram": _flat(
        "longcat_flash_ngram",
        **_LONGCAT,
        ngram_vocab_size_ratio=2,
        emb_neighbor_num=2,
        emb_split_num=2,
    ),
    "mellum": _flat(
        "mellum",
        **_EXPERTS,
        sliding_window=16,
        layer_types=_SLIDING,
        rope_parameters={
            "sliding_attention": {"rope_theta": 10000.0},
            "full_attention": {"rope_theta": 10000.0},
        },
    ),
    "mimo_v2_flash": _flat(
        "mimo_v2_flash",
        n_routed_experts=EXPERTS,
        n_shared_experts=None,
        hybrid_layer_pattern=[0, 1],
        moe_layer_freq=[1, 1],
        add_swa_attention_sink_bias=True,
        add_full_attention_sink_bias=False,
        sliding_window_size=16,
        routed_scaling_factor=1.0,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        n_group=1,
        topk_group=1,
        layernorm_epsilon=1e-5,
        swa_rope_theta=10000.0,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        v_head_dim=16,
        swa_head_dim=16,
        swa_v_head_dim=16,
        partial_rotary_factor=0.5,
    ),
    "minimax": _flat(
        "minimax", num_local_experts=EXPERTS, shared_intermediate_size=0, rotary_dim=8
    ),
    "minimax_m3_vl": _nested(
        "minimax_m3_vl",
        _flat(
            "minimax_m3",
            num_local_experts=EXPERTS,
            shared_intermediate_size=MOE_INTERMEDIATE,
            dense_intermediate_size=INTERMEDIATE,
            intermediate_size=MOE_INTERMEDIATE,
            partial_rotary_factor=0.5,
        ),
    ),
    "mistral3": _nested("mistral3", _flat("mistral4", **_MLA, rope_parameters=_MISTRAL4_ROPE)),
    "mistral4": _flat("mistral4", **_MLA, rope_parameters=_MISTRAL4_ROPE),
    "mixtral": _flat("mixtral", num_local_experts=EXPERTS),
    "muse_spark": _nested(
        "muse_spark",
        _flat(
            "muse_spark_text",
            post_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            num_hidden_layers=4,  # its own quant_predicate leaves the first and last unquantized
            layer_rope_theta=[10000.0] * 4,
            layer_types=_SLIDING * 2,
            sliding_window=16,
            final_logit_softcapping=30.0,
            output_multiplier=1.0,
            num_local_experts=EXPERTS,
            moe_hidden_size=MOE_INTERMEDIATE,
        ),
    ),
    "nemotron_h": _flat(
        "nemotron_h",
        hybrid_override_pattern=["M", "E", "*", "E"],
        mamba_num_heads=4,
        mamba_head_dim=16,
        mamba_proj_bias=False,
        ssm_state_size=8,
        conv_kernel=4,
        n_groups=1,
        mlp_bias=False,
        layer_norm_epsilon=1e-5,
        use_bias=False,
        use_conv_bias=True,
        n_routed_experts=EXPERTS,
        n_shared_experts=1,
        moe_shared_expert_intermediate_size=MOE_INTERMEDIATE,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        time_step_limit=[0.0, 1e9],
    ),
    "olmoe": _flat("olmoe", **_EXPERTS),
    "phimoe": _flat("phimoe", num_local_experts=EXPERTS),
    "phixtral": dict(
        model_type="phixtral",
        num_vocab=VOCAB,
        model_dim=HIDDEN,
        num_heads=4,
        num_layers=2,
        rotary_dim=8,
        num_local_experts=4,
        num_experts_per_tok=TOP_K,
    ),
    "qwen2_moe": _flat("qwen2_moe", **_EXPERTS, shared_expert_intermediate_size=MOE_INTERMEDIATE),
    "qwen3_5_moe": _nested(
        "qwen3_5_moe",
        _flat(
            "qwen3_5_moe_text",
            **dict(
                _QWEN_NEXT,
                layer_types=["linear_attention", "full_attention"],
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.25,
                    "mrope_section": [1, 1, 0],
                    "mrope_interleaved": True,
                },
                attn_output_gate=True,
            ),
        ),
    ),
    "qwen3_moe": _flat("qwen3_moe", **_EXPERTS, decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen3_next": _flat("qwen3_next", **_QWEN_NEXT),
    "qwen3_vl_moe": _nested(
        "qwen3_vl_moe",
        _flat("qwen3_vl_moe_text", **_EXPERTS, decoder_sparse_step=1, mlp_only_layers=[]),
    ),
    "solar_open": _flat(
        "solar_open",
        n_routed_experts=EXPERTS,
        n_shared_experts=1,
        routed_scaling_factor=1.0,
        first_k_dense_replace=1,
        num_hidden_layers=3,
        partial_rotary_factor=1.0,
    ),
    "step3p5": _flat(
        "step3p5",
        num_attention_groups=2,
        moe_num_experts=EXPERTS,
        moe_top_k=TOP_K,
        share_expert_dim=MOE_INTERMEDIATE,
        moe_layers_enum="1,2",
        num_hidden_layers=3,
    ),
}

# mlx-lm's model calls a Metal-only kernel (mlx_lm.kernels.qk_norm_rope) in its attention
NOT_ON_CPU = {"muse_spark": "its attention calls a Metal-only kernel (qk_norm_rope)"}

# MoE architectures whose mlx-lm model keeps each expert a module of its own
SEPARATE_EXPERTS: Dict[str, Dict[str, Any]] = {
    "dbrx": dict(
        model_type="dbrx",
        vocab_size=VOCAB,
        d_model=HIDDEN,
        n_layers=2,
        n_heads=4,
        ffn_config={"ffn_hidden_size": INTERMEDIATE, "moe_num_experts": 4, "moe_top_k": 2},
        attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
    ),
}


def tiny_config(arch: str) -> Dict[str, Any]:
    """A fresh copy of ``arch``'s tiny config (``MOE_ARCHITECTURES`` or ``SEPARATE_EXPERTS``)."""
    table = MOE_ARCHITECTURES if arch in MOE_ARCHITECTURES else SEPARATE_EXPERTS
    if arch not in table:
        raise ValueError(f"no tiny config for {arch!r}; choose from {sorted(MOE_ARCHITECTURES)}")
    return copy.deepcopy(table[arch])


def text_keys(config: Dict[str, Any]) -> Dict[str, Any]:
    """The dict holding the language model's keys (``text_config`` where nested)."""
    return config.get("text_config", config)

"""Synthetic checkpoints are real mlx-lm checkpoints: they load, generate and round-trip."""

import json
import math
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
from mlx_lm.utils import _get_classes

from tests.support import synth

PROMPT_TOKENS = [5, 300, 42, 7, 400, 11, 260, 3, 301, 302]
MESSAGES = [{"role": "user", "content": "Hello! How are you today?"}]


def _layers(model):
    return model.layers


def _moe_block(layer):
    """The layer's MoE block, or None for a dense layer."""
    block = getattr(layer, "block_sparse_moe", None) or layer.mlp
    return block if hasattr(block, "switch_mlp") else None


def _expert_count(config):
    tc = synth.text_config(config)
    return tc.get("num_experts") or tc.get("n_routed_experts") or tc["num_local_experts"]


def _router_topk(block, x, k):
    """The experts the block's router picks for each row of x."""
    if hasattr(block.gate, "e_score_correction_bias"):
        inds, _ = block.gate(x)  # DeepSeek's grouped noaux_tc selection
        return inds
    logits = block.gate(x)
    return mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth")
    return {arch: synth.build_checkpoint(root / arch, arch, "tiny") for arch in synth.ARCHITECTURES}


@pytest.mark.parametrize("arch", synth.ARCHITECTURES)
def test_tiny_checkpoint_loads_and_generates(arch, tiny_checkpoints):
    path = tiny_checkpoints[arch]
    model, tokenizer, config = mlx_lm.load(str(path), return_config=True)
    assert config["model_type"] == arch
    tc = synth.text_config(config)

    # Every MoE layer holds quantized SwitchGLU experts at the requested bits / group.
    blocks = [_moe_block(layer) for layer in _layers(model)]
    moe = [b for b in blocks if b is not None]
    assert moe, "no MoE layer"
    for block in moe:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            linear = getattr(block.switch_mlp, proj)
            assert isinstance(linear, QuantizedSwitchLinear)
            assert (linear.bits, linear.group_size, linear.mode) == (4, 64, "affine")
            assert linear.num_experts == _expert_count(config)
    if arch == "deepseek_v3":
        dense = tc["first_k_dense_replace"]
        assert dense >= 1 and all(b is None for b in blocks[:dense])
        assert len(moe) == tc["num_hidden_layers"] - dense
        bias = moe[0].gate.e_score_correction_bias
        assert bias.dtype == mx.float32 and mx.abs(bias).max().item() > 0
    else:
        assert len(moe) == tc["num_hidden_layers"]
    if arch in ("qwen3_moe", "qwen3_5_moe"):  # the model's quant_predicate: 8-bit routers
        assert (moe[0].gate.bits, moe[0].gate.group_size) == (8, 64)
    if arch == "qwen3_5_moe":
        kinds = [layer.is_linear for layer in _layers(model)]
        assert any(kinds) and not all(kinds)  # GatedDeltaNet and full attention layers

    # The router sends different tokens to different experts.
    k = tc["num_experts_per_tok"]
    x = mx.fast.rms_norm(model.model.embed_tokens(mx.arange(3, 67)), None, 1e-6)
    picks = _router_topk(moe[0], x, k).tolist()
    assert len({frozenset(p) for p in picks}) >= 16
    assert len({e for p in picks for e in p}) > _expert_count(config) // 2

    # Exactly the logits of the in-memory model: save -> load round-trips (sanitize included).
    built, _ = synth.build_model(arch, "tiny")
    inputs = mx.array([PROMPT_TOKENS])
    logits = model(inputs)
    assert mx.isfinite(logits).all().item()
    assert mx.array_equal(logits, built(inputs)).item()

    # Greedy generation gives varied tokens, not one token over and over.
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=30)
    tokens = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=30)]
    assert len(tokens) >= 20
    assert len(set(tokens)) >= 8, tokens
    assert text == tokenizer.decode(tokens).lstrip()  # the detokenizer drops a leading space
    assert len(set(text.split())) >= 4, text


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    a = synth.build_checkpoint(tmp_path / "a", "qwen3_5_moe", "tiny", seed=7)
    b = synth.build_checkpoint(tmp_path / "b", "qwen3_5_moe", "tiny", seed=7)
    c = synth.build_checkpoint(tmp_path / "c", "qwen3_5_moe", "tiny", seed=8)
    files = sorted(p.name for p in a.iterdir())
    assert "model.safetensors" in files and "tokenizer.json" in files
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("bits,group_size", [(8, 32), (2, 128)])
def test_bits_and_group_size(tmp_path, bits, group_size):
    path = synth.build_checkpoint(tmp_path, "qwen3_moe", "tiny", bits=bits, group_size=group_size)
    config = json.loads((path / "config.json").read_text())
    assert config["quantization"]["bits"] == bits
    assert config["quantization"]["group_size"] == group_size
    assert config["quantization"]["model.layers.0.mlp.gate"] == {"group_size": 64, "bits": 8}

    model, _ = mlx_lm.load(str(path))
    block = _moe_block(model.layers[0])
    for proj in ("gate_proj", "up_proj", "down_proj"):
        linear = getattr(block.switch_mlp, proj)
        assert isinstance(linear, QuantizedSwitchLinear)
        assert (linear.bits, linear.group_size) == (bits, group_size)
        # Packed width: in_dims * bits / 32 uint32 words per row.
        assert linear.weight.shape[-1] == linear.input_dims * bits // 32
    assert (block.gate.bits, block.gate.group_size) == (8, 64)
    assert (model.model.embed_tokens.bits, model.model.embed_tokens.group_size) == (
        bits,
        group_size,
    )
    assert mx.isfinite(model(mx.array([PROMPT_TOKENS]))).all().item()


def test_unquantized_checkpoint(tmp_path):
    path = synth.build_checkpoint(tmp_path, "mixtral", "tiny", quantize=False, dtype="float32")
    config = json.loads((path / "config.json").read_text())
    assert "quantization" not in config
    model, _ = mlx_lm.load(str(path))
    linear = model.layers[0].block_sparse_moe.switch_mlp.gate_proj
    assert isinstance(linear, SwitchLinear)
    assert linear.weight.dtype == mx.float32
    built, _ = synth.build_model("mixtral", "tiny", quantize=False, dtype="float32")
    inputs = mx.array([PROMPT_TOKENS])
    assert mx.array_equal(model(inputs), built(inputs)).item()

    bf16, _ = synth.build_model("mixtral", "tiny", quantize=False)
    assert bf16.layers[0].block_sparse_moe.switch_mlp.gate_proj.weight.dtype == mx.bfloat16


def test_chat_template_and_eos(tiny_checkpoints):
    _, tokenizer, config = mlx_lm.load(str(tiny_checkpoints["qwen3_moe"]), return_config=True)
    assert tokenizer.has_chat_template
    messages = [{"role": "system", "content": "Be brief."}] + MESSAGES
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHello! How are you today?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tokenizer.decode(ids) == expected
    im_start, im_end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>"))
    assert ids[0] == im_start and ids.count(im_end) == 2
    assert config["eos_token_id"] == im_end
    assert im_end in tokenizer.eos_token_ids
    assert len(tokenizer.vocab) == config["vocab_size"]
    text = "The keeper climbed the steps to light the lamp."
    encoded = tokenizer.encode(text, add_special_tokens=False)
    assert len(encoded) < len(text) // 2  # the BPE merged words
    assert tokenizer.decode(encoded) == text


def test_tokenizer_is_padded_to_the_config_vocab(tmp_path):
    path = synth.build_checkpoint(tmp_path, "qwen3_moe", "tiny", overrides={"vocab_size": 1000})
    model, tokenizer = mlx_lm.load(str(path))
    assert model.model.embed_tokens.weight.shape[0] == 1000
    assert len(tokenizer.vocab) == 1000
    # Ids past the trained vocabulary still decode, so any sampled token is printable.
    assert tokenizer.decode([999]) == " #999"
    detok = tokenizer.detokenizer
    detok.reset()
    for token in (300, 999, 600):
        detok.add_token(token)
    detok.finalize()
    assert "#999" in detok.text


def test_full_configs_have_the_real_shapes():
    expected = {
        "qwen3_moe": (
            dict(
                hidden_size=2048,
                num_hidden_layers=48,
                num_experts=128,
                num_experts_per_tok=8,
                moe_intermediate_size=768,
                num_attention_heads=32,
                num_key_value_heads=4,
                head_dim=128,
                vocab_size=151936,
            ),
            30.5e9,
        ),
        "qwen3_5_moe": (
            dict(
                hidden_size=4096,
                num_hidden_layers=60,
                num_experts=512,
                num_experts_per_tok=10,
                moe_intermediate_size=1024,
                shared_expert_intermediate_size=1024,
                full_attention_interval=4,
            ),
            396e9,
        ),
        "deepseek_v3": (
            dict(
                hidden_size=7168,
                num_hidden_layers=61,
                n_routed_experts=256,
                num_experts_per_tok=8,
                moe_intermediate_size=2048,
                n_group=8,
                topk_group=4,
                first_k_dense_replace=3,
                n_shared_experts=1,
                kv_lora_rank=512,
                q_lora_rank=1536,
                qk_rope_head_dim=64,
                qk_nope_head_dim=128,
                v_head_dim=128,
            ),
            671e9,
        ),
        "mixtral": (
            dict(
                hidden_size=4096,
                num_hidden_layers=32,
                num_local_experts=8,
                num_experts_per_tok=2,
                intermediate_size=14336,
            ),
            46.7e9,
        ),
    }
    for arch, (keys, n_params) in expected.items():
        config = synth.model_config(arch, "full")
        tc = synth.text_config(config)
        assert {k: tc[k] for k in keys} == keys, arch
        # Parameter count of the (lazy, never evaluated) mlx-lm model.
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
        total = sum(math.prod(v.shape) for _, v in tree_flatten(model.parameters()))
        assert abs(total - n_params) / n_params < 0.01, (arch, total)


def test_overrides_reach_the_model_config():
    config = synth.model_config("qwen3_5_moe", "full", num_hidden_layers=4, num_experts=64)
    tc = config["text_config"]
    assert (tc["num_hidden_layers"], tc["num_experts"]) == (4, 64)
    assert "num_hidden_layers" not in config
    assert tc["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    config = synth.model_config("deepseek_v3", "tiny", first_k_dense_replace=2, rope_theta=5e5)
    assert (config["first_k_dense_replace"], config["rope_theta"]) == (2, 5e5)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(arch="gpt2"),
        dict(size="huge"),
        dict(bits=7),
        dict(mode="mxfp4", bits=8),
        dict(group_size=16),
        dict(dtype="int8"),
        dict(arch="qwen3_5_moe", overrides={"num_hidden_layers": 2}),
        dict(arch="deepseek_v3", overrides={"first_k_dense_replace": 3}),
        dict(arch="deepseek_v3", overrides={"n_group": 3}),
        dict(arch="mixtral", overrides={"num_experts_per_tok": 9}),
    ],
)
def test_invalid_arguments_are_refused(tmp_path, kwargs):
    with pytest.raises(ValueError):
        synth.build_checkpoint(tmp_path, **kwargs)
    assert not (tmp_path / "model.safetensors").exists()


def test_demo_checkpoint_builds_once(tmp_path, monkeypatch):
    calls = []
    build = synth.build_checkpoint

    def counting_build(*args, **kwargs):
        calls.append(args)
        return build(*args, **kwargs)

    monkeypatch.setattr(synth, "build_checkpoint", counting_build)
    stale = tmp_path / f"demo-{synth._demo_version()}"
    stale = stale.with_name(f".{stale.name}.tmp-crashed")
    stale.mkdir()
    os.utime(stale, (time.time() - 7200, time.time() - 7200))

    first = synth.demo_checkpoint(tmp_path)
    assert len(calls) == 1
    assert first.parent == tmp_path and first.name.startswith("demo-")
    config = json.loads((first / "config.json").read_text())
    assert config["model_type"] == synth.DEMO_ARCH
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temp dirs left

    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert synth.demo_checkpoint(tmp_path) == first
    assert len(calls) == 1
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime

    model, tokenizer = mlx_lm.load(str(first))
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert mlx_lm.generate(model, tokenizer, prompt, max_tokens=5)

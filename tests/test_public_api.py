"""A streamed model is an mlx-lm model in every way a user touches: the package's public names,
dtypes, copies, and where a model comes from."""

import copy
import gc
import os
import pickle
import shutil
import subprocess
import sys
import textwrap

import mlx.core as mx
import mlx_lm
import pytest
from huggingface_hub import constants as hf_constants
from mlx.utils import tree_flatten, tree_map
from mlx_lm.generate import generate_step

import moeflux_mlx
from moeflux_mlx.format.convert import convert
from moeflux_mlx.model.switch import _OPS
from tests.support import synth


def test_public_names_survive_importing_every_submodule():
    """A submodule named like a public function would replace it on the package once imported
    (``moeflux_mlx.stats`` the module, not the function); none may share a public name."""
    code = textwrap.dedent(
        """
        import importlib, pkgutil, types
        import moeflux_mlx
        for info in pkgutil.walk_packages(moeflux_mlx.__path__, "moeflux_mlx."):
            importlib.import_module(info.name)
        # each name as a fresh `moeflux_mlx.NAME` would find it (looking one name up binds
        # its lazy siblings, which would hide a shadowed one)
        bad = [n for n in moeflux_mlx.__all__
               if isinstance(vars(moeflux_mlx).get(n), types.ModuleType)]
        bad += [n for n in moeflux_mlx.__all__
                if isinstance(getattr(moeflux_mlx, n), types.ModuleType)]
        assert not bad, f"public names shadowed by submodules: {bad}"
        from moeflux_mlx.model import load, runtime, sharded
        assert moeflux_mlx.stats is load.stats and moeflux_mlx.load is load.load
        assert moeflux_mlx.sharded_load is sharded.sharded_load
        assert moeflux_mlx.StreamingRuntime is runtime.StreamingRuntime
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A quantized (4-bit, bf16 scales) and an unquantized (bf16) tiny checkpoint."""
    root = tmp_path_factory.mktemp("api")
    return {
        "quantized": synth.build_checkpoint(root / "q", "qwen3_moe", "tiny", seed=1),
        "unquantized": synth.build_checkpoint(
            root / "u", "qwen3_moe", "tiny", seed=1, quantize=False
        ),
    }


def _cast_all(model, dtype):
    """mlx-lm's model tests' way: every parameter through ``model.update``."""
    model.update(tree_map(lambda p: p.astype(dtype), model.parameters()))


@pytest.mark.parametrize(
    "kind, dtype, how",
    [
        ("quantized", mx.float16, "set_dtype"),
        ("quantized", mx.float32, "set_dtype"),
        # the CPU's gather_mm computes float32 only: bf16 unquantized experts run there once cast
        ("unquantized", mx.float32, "set_dtype"),
        ("unquantized", mx.float32, "update"),
    ],
)
def test_a_dtype_set_on_the_model_reaches_the_streamed_experts(checkpoints, kind, dtype, how):
    src = checkpoints[kind]
    stock, tokenizer = mlx_lm.load(str(src))
    ours, _ = moeflux_mlx.load(src, backend="ops")
    for model in (stock, ours):
        model.set_dtype(dtype) if how == "set_dtype" else _cast_all(model, dtype)
    # one token (the experts it names are cast) and a long prompt (the whole pool is cast)
    for prompt in ([5], tokenizer.encode(" ".join(["the quick brown fox"] * 12))):
        want, got = stock(mx.array([prompt])), ours(mx.array([prompt]))
        assert got.dtype == want.dtype == dtype
        assert mx.array_equal(got, want).item()
    layers = len(ours.moeflux.layout.layers)
    assert moeflux_mlx.stats(ours)["served"] == {f"ops (fallback: {_OPS.why})": 2 * layers}
    ours.moeflux.close()


def test_a_dtype_set_between_calls_is_the_one_computed(checkpoints):
    """The streamed layers work out which components to cast once per change of their dtype
    markers: a dtype set after calls, and set back, computes as stock's each time."""
    src = checkpoints["quantized"]
    stock, _ = mlx_lm.load(str(src))
    ours, _ = moeflux_mlx.load(src, backend="ops")
    with ours.moeflux:
        for dtype in (None, mx.float32, mx.bfloat16):  # bf16 -> f32 -> bf16 is lossless
            for model in (stock, ours):
                if dtype is not None:
                    model.set_dtype(dtype)
            want, got = stock(mx.array([[5]])), ours(mx.array([[5]]))
            assert got.dtype == want.dtype == (dtype or mx.bfloat16)
            assert mx.array_equal(got, want).item()
        layers = len(ours.moeflux.layout.layers)
        assert moeflux_mlx.stats(ours)["served"] == {
            "ops": 2 * layers,
            f"ops (fallback: {_OPS.why})": layers,
        }


def test_the_files_dtype_computes_as_before(checkpoints):
    ours, _ = moeflux_mlx.load(checkpoints["quantized"], backend="ops")
    with ours.moeflux:
        assert ours(mx.array([[5]])).dtype == mx.bfloat16
        assert moeflux_mlx.stats(ours)["served"] == {"ops": len(ours.moeflux.layout.layers)}
        # the markers hold no element: nothing is added to the model's size
        flat = dict(tree_flatten(ours.parameters()))
        markers = [k for k in flat if ".expert_dtypes." in k]
        assert markers and all(flat[k].size == 0 for k in markers)


def _greedy(model, tokenizer, n=12):
    prompt = mx.array(tokenizer.encode("the quick brown fox"))
    return [int(t) for (t, _), _ in zip(generate_step(prompt, model, max_tokens=n), range(n))]


def test_a_deep_copy_shares_the_runtime_and_generates_the_same(checkpoints):
    model, tokenizer = moeflux_mlx.load(checkpoints["quantized"], backend="ops")
    want = _greedy(model, tokenizer)
    twin = copy.deepcopy(model)
    assert twin.moeflux is model.moeflux and twin is not model
    assert twin.model.embed_tokens is not model.model.embed_tokens  # dense weights copied
    del model
    gc.collect()  # the runtime stays open while a copy lives
    assert _greedy(twin, tokenizer) == want
    runtime = twin.moeflux
    del twin
    gc.collect()
    assert runtime.closed  # closed with the last copy


def test_pickling_a_streamed_model_says_what_to_do_instead(checkpoints):
    model, _ = moeflux_mlx.load(checkpoints["quantized"], backend="ops")
    with model.moeflux:
        for obj in (model, model.moeflux):
            with pytest.raises(TypeError, match=r"cannot be pickled.*moeflux_mlx\.load\(path\)"):
                pickle.dumps(obj)


HASH = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, checkpoints):
    """An offline Hugging Face cache holding ``org/tiny-moe`` (main) and ``org/tiny-packed``
    (a converted one), laid out as huggingface_hub lays it out."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    for name, src in (
        ("tiny-moe", checkpoints["quantized"]),
        ("tiny-packed", convert(checkpoints["quantized"], cache.parent / "p", progress=False)),
    ):
        repo = cache / f"models--org--{name}"
        shutil.copytree(src, repo / "snapshots" / HASH)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(HASH)
    return cache


@pytest.fixture
def offline_hub(hub_cache, monkeypatch):
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    return hub_cache


def test_a_repo_id_loads_from_the_hub_cache_as_mlx_lm_finds_it(offline_hub, checkpoints):
    stock, tokenizer = mlx_lm.load("org/tiny-moe")
    want = stock(mx.array([[5, 6]]))
    for kwargs in ({}, {"revision": "main"}, {"revision": HASH}):
        model, _ = moeflux_mlx.load("org/tiny-moe", backend="ops", **kwargs)
        with model.moeflux:
            assert mx.array_equal(model(mx.array([[5, 6]])), want).item()
    packed, _ = moeflux_mlx.load("org/tiny-packed", backend="ops")  # packed_experts/ fetched too
    with packed.moeflux:
        assert mx.array_equal(packed(mx.array([[5, 6]])), want).item()
    lazy, _ = mlx_lm.load("org/tiny-moe", lazy=True)
    with moeflux_mlx.patch_model(lazy, "org/tiny-packed", backend="ops").moeflux:
        assert mx.array_equal(lazy(mx.array([[5, 6]])), want).item()


@pytest.mark.parametrize(
    "call, why",
    [
        (lambda: moeflux_mlx.load("org/no-such-model"), r"org/no-such-model: not a local"),
        (lambda: moeflux_mlx.load("org/tiny-moe", revision="v9"), r"at revision v9"),
        (lambda: moeflux_mlx.load("/no/such/dir"), r"^/no/such/dir: no such directory$"),
        (lambda: moeflux_mlx.sharded_load("org/no-such-model"), r"org/no-such-model: not a"),
        (lambda: moeflux_mlx.patch_model(None, "org/no-such-model"), r"org/no-such-model: not"),
    ],
)
def test_a_missing_model_is_one_checkpoint_error_line(offline_hub, call, why):
    with pytest.raises(moeflux_mlx.CheckpointError, match=why) as e:
        call()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("command", ["info", "doctor --no-bench", "convert"])
def test_every_command_takes_a_repo_id(hub_cache, tmp_path, command):
    argv = [*command.split(), "org/tiny-moe"] + (
        [str(tmp_path / "out")] if command == "convert" else []
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub_cache), PYTHONPATH=".")
    out = subprocess.run(
        [sys.executable, "-m", "moeflux_mlx.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "models--org--tiny-moe" in out.stdout


def test_info_shows_a_budget_larger_than_the_experts_as_their_size():
    out = subprocess.run(
        [sys.executable, "-m", "moeflux_mlx.cli", "info", "--cache-budget", "2TB"],
        capture_output=True,
        text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH="."),
        timeout=300,
    )
    line = next(x for x in out.stdout.splitlines() if x.startswith("expert cache"))
    assert "28.31 MB of MLX memory" in line and "0 TB" not in line, line

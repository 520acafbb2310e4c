"""The built-in demo model: a small ``qwen3_moe`` trained for this project, shipped in the package.

It is an ordinary mlx-lm checkpoint (53.1 M parameters, 8 MoE layers of 64 experts, top-8, 4-bit
affine experts, 30 MB) trained on English text from Debian packages by ``training/train.py``;
``docs/training.md`` says how, and ``training/SOURCES.md`` lists the texts and their licenses.
Its routing is that of a trained model, which is what the cache and prefetch are designed
against; the random-weight builder in ``tests/support/synth.py`` stays for architecture coverage.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError

__all__ = ["checkpoint_path"]

_CHECKPOINT = Path(__file__).resolve().parent / "checkpoint"
# What mlx-lm needs to load it; a partial copy must fail here, not inside mlx-lm.
_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def checkpoint_path() -> Path:
    """The directory of the built-in demo checkpoint (installed with the package).

    Returns:
        The checkpoint's directory, loadable by ``mlx_lm.load`` and ``moeflux_mlx.load``.

    Raises:
        CheckpointError: The installed package lacks one of the checkpoint's files (a source
            tree or wheel built without its package data).
    """
    missing = [name for name in _FILES if not (_CHECKPOINT / name).is_file()]
    if missing:
        raise CheckpointError(
            f"{_CHECKPOINT}: the built-in demo model is incomplete (missing {', '.join(missing)}); "
            "reinstall moeflux-mlx"
        )
    return _CHECKPOINT

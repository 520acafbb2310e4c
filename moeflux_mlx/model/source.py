"""Where a model comes from: a local directory or a Hugging Face repo id, resolved as mlx-lm
resolves one (``mlx_lm.utils._download``: the hub cache's snapshot, downloaded if missing), for
the Python API and every command alike."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Union

from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS, _download

from ..errors import CheckpointError, MissingTokenizerError

HUB_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# a converted repo's expert files besides what mlx-lm fetches (its layout.json is a *.json)
ALLOW_PATTERNS = [*DEFAULT_ALLOW_PATTERNS, "packed_experts/*"]
# the files a Hugging Face tokenizer is built from (transformers' AutoTokenizer, as mlx-lm calls
# it); a directory with none of them gets an empty tokenizer that encodes every prompt as []
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)
TOKENIZER_GLOBS = ("*.tiktoken", "*.model")


def resolve_model_path(model: Union[str, Path], revision: Optional[str] = None) -> Path:
    """The local directory of a model argument, as ``mlx_lm.load`` takes one.

    Args:
        model: a directory (``~`` is expanded), or a Hugging Face repo id (``org/name``),
            found in the hub cache or downloaded (``HF_HUB_OFFLINE=1``: the cache only).
        revision: for a repo id, a branch, tag or commit (default: ``main``); ignored for a
            directory, as in mlx-lm.

    Returns:
        The directory.

    Raises:
        CheckpointError: ``model`` is a file, neither a directory nor a repo id, or a repo id
            that could not be fetched; one line saying which.
    """
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{model}: not a directory (give the model's directory)")
        return path
    if isinstance(model, Path) or not HUB_REPO.fullmatch(model):
        raise CheckpointError(f"{model}: no such directory")
    try:
        return Path(_download(model, revision=revision, allow_patterns=ALLOW_PATTERNS))
    except Exception as e:  # the hub client raises many types; all mean "could not get it"
        why = str(e).strip().splitlines()[0] if str(e).strip() else ""
        at = f" at revision {revision}" if revision else ""
        raise CheckpointError(
            f"{model}: not a local directory, and fetching it{at} from the Hugging Face Hub "
            f"failed ({type(e).__name__}{': ' + why if why else ''})"
        ) from e


def require_tokenizer(path: Path, tokenizer_config: Optional[dict] = None) -> None:
    """Refuse a model directory that holds no tokenizer files.

    Without them mlx-lm (through transformers) quietly builds an empty tokenizer: every prompt
    becomes no tokens, and the commands fail far from the cause. A ``tokenizer_config`` naming
    a file of its own (``tokenizer_file``, ``vocab_file``, ...) is trusted.

    Args:
        path: the model's local directory (``resolve_model_path``).
        tokenizer_config: the extra tokenizer arguments, as ``mlx_lm.load`` takes them.

    Raises:
        MissingTokenizerError: ``path`` has none of ``TOKENIZER_FILES`` (nor a ``*.tiktoken`` or
            ``*.model`` file); one line naming the files looked for and what to do.
    """
    if any(k.endswith("_file") for k in tokenizer_config or {}):
        return
    if any((path / name).is_file() for name in TOKENIZER_FILES):
        return
    if any(any(path.glob(g)) for g in TOKENIZER_GLOBS):
        return
    raise MissingTokenizerError(
        f"{path}: no tokenizer (mlx-lm looks for tokenizer.json, tokenizer_config.json, "
        "tokenizer.model or vocab.json); copy the tokenizer files from the original checkpoint "
        "into it (mlx_lm.convert's output includes them)"
    )

"""The kernel texts of ``metal_kernels/``: read from the installed package data, else from the
source checkout. Shared by the fused expert kernels (``compute.kernels``) and the CUDA-only
device-side table (``cuda.table_kernels``)."""

from __future__ import annotations

import hashlib
import importlib.resources
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, List, Protocol, Sequence, cast

if TYPE_CHECKING:  # no MLX at run time: the text alone
    import mlx.core as mx

_PACKAGE = "moeflux_mlx.metal_kernels"
_CHECKOUT_DIR = Path(__file__).resolve().parents[2] / "metal_kernels"
PRELUDE = {"metal": "prelude_metal.h", "cuda": "prelude_cuda.cuh"}
ENTRY = {"metal": "entry_metal.h", "cuda": "entry_cuda.cuh"}
COMMON = "moe_common.h"
# stand-ins for Metal's standard library and MLX's preamble: the front-end check of the Metal
# dialect with clang (tests/support/metal_frontend.py), never handed to MLX
METAL_SHIMS = ("metal_stdlib_shim.h", "mlx_preamble_shim.h")
SOURCE_FILES = (
    COMMON,
    "glu_body.h",
    "glu_rows.h",
    "down_body.h",
    "down_rows.h",
    "combine_body.h",
    "table_cuda.cuh",
    "resolve_cuda.cuh",
    "fill_cuda.cuh",
    "write_cuda.cuh",
    "hint_cuda.cuh",
    "address_cuda.cuh",
    *PRELUDE.values(),
    *ENTRY.values(),
    *METAL_SHIMS,
)


class Kernel(Protocol):
    """A compiled custom kernel, as ``mx.fast.metal_kernel``/``cuda_kernel`` make it: called
    with its ``inputs`` and the launch's keywords, it returns its outputs."""

    def __call__(self, *, inputs: Sequence[Any], **launch: Any) -> List[mx.array]: ...


def as_kernel(made: object) -> Kernel:
    """``made`` (what ``mx.fast.metal_kernel``/``cuda_kernel`` returned) as a ``Kernel``: MLX's
    stubs declare those factories to return ``object``, though they return a callable."""
    if not callable(made):
        raise TypeError(f"not a kernel: {made!r}")
    return cast(Kernel, made)


# a string or character literal (kept), a // comment, a /* */ comment
_TOKENS = re.compile(
    r'"(?:\\.|[^"\\\n])*"' r"|'(?:\\.|[^'\\\n])*'" r"|//[^\n]*|/\*.*?\*/", re.DOTALL
)


def compact(text: str) -> str:
    """``text`` without its comments, indentation and blank lines: what MLX is handed. MLX
    rebuilds a custom kernel's whole text and hashes it at every launch, a host cost that
    decode pays per kernel, MoE layer and token; a shorter text costs less. As a C preprocessor
    reads it: continued lines (a backslash before the newline) are joined first, then comments
    go (each as a space), string and character literals stay as they are; every other line
    stays a line (preprocessor directives need theirs).

    Args:
        text: CUDA or Metal source.

    Returns:
        The same tokens in fewer characters.
    """

    def blank(match: re.Match) -> str:
        token = match.group(0)
        return token if token[0] in "\"'" else " "

    spliced = text.replace("\\\n", "")
    lines = (line.strip() for line in _TOKENS.sub(blank, spliced).split("\n"))
    return "".join(line + "\n" for line in lines if line)


def custom_kernel(make: Callable[..., object], *, source: str, header: str = "", **kw) -> Kernel:
    """``make(**kw)`` (``mx.fast.metal_kernel`` or ``cuda_kernel``) with ``source`` and
    ``header`` compacted (``compact``), as a ``Kernel``."""
    return as_kernel(make(source=compact(source), header=compact(header), **kw))


def text_digest(header: str, body: str) -> str:
    """Ten hex digits of a kernel's text as MLX is handed it (``compact``), for its name: MLX
    caches compiled kernels by name (on disk, for CUDA), so a changed text must change the
    name (an edited comment need not)."""
    return hashlib.sha1((compact(header) + "\0" + compact(body)).encode()).hexdigest()[:10]


def load_source(name: str) -> str:
    """A kernel source file: from the installed package data, else from the source checkout."""
    if name not in SOURCE_FILES:
        raise KeyError(f"unknown kernel source {name!r}")
    try:
        return importlib.resources.files(_PACKAGE).joinpath(name).read_text()
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError):
        return (_CHECKOUT_DIR / name).read_text()

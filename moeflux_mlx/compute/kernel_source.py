"""The kernel texts of ``metal_kernels/``: read from the installed package data, else from the
source checkout. Shared by the fused expert kernels (``compute.kernels``) and the CUDA-only
device-side table (``cuda.table_kernels``)."""

from __future__ import annotations

import hashlib
import importlib.resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, List, Protocol, Sequence, cast

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


def text_digest(header: str, body: str) -> str:
    """Ten hex digits of a kernel's text, for its name: MLX caches compiled kernels by name (on
    disk, for CUDA), so a changed text must change the name."""
    return hashlib.sha1((header + "\0" + body).encode()).hexdigest()[:10]


def load_source(name: str) -> str:
    """A kernel source file: from the installed package data, else from the source checkout."""
    if name not in SOURCE_FILES:
        raise KeyError(f"unknown kernel source {name!r}")
    try:
        return importlib.resources.files(_PACKAGE).joinpath(name).read_text()
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError):
        return (_CHECKOUT_DIR / name).read_text()

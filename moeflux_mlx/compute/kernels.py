"""Fused expert kernels for decode: one text, two dialects (Metal and CUDA).

Three kernels, each written once in ``metal_kernels/*.h`` against a handful of ``MF_*`` names that a
small per-dialect prelude defines (thread indices, SIMD/warp shuffles, barriers, address spaces,
fp16/bf16 conversions), so the CUDA run exercises the very algorithm that ships for Metal:

``glu_matvec``   ``h[t,k,:] = silu(Wg[s] @ x[t]) * (Wu[s] @ x[t])`` for ``s = slots[t,k]``, gate and up in
                 one pass over the weights; one dispatch for every token and expert.
``down_matvec``  ``y[t,k,:] = Wd[s] @ h[t,k,:]``.
``combine``      ``out = residual + sum_k w[t,k] * y[t,k,:]  (+ sigmoid(g[t]) * shared[t,:])``.

Weights are MLX affine-quantized (4- or 8-bit, groups of 32/64/128) expert pools ``[n_slots, out, in]``
(packed ``uint32``), read in place: pool arrays may be strided views (e.g. ``ExpertPool.from_blobs``)
and are never copied. Accumulation is fp32; ``h`` and ``y`` are stored in the activation dtype, with
the same roundings as mlx-lm's ``SwitchGLU`` (see docs/kernels.md).

``KernelBackend`` plugs the kernels into ``compute.backend.select_backend``; shapes they do not cover go to
the fallback (``compute.ops.OpsBackend``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Tuple, Union

import mlx.core as mx
from mlx_lm.models.switch_layers import SwiGLU

from ..cache.pool import MX_DTYPES, ExpertPool, InPlaceExperts
from ..format.layout import ExpertLayout, Quantization
from . import selfcheck
from .kernel_source import (
    COMMON,
    ENTRY,
    PRELUDE,
    Kernel,
    custom_kernel,
    load_source,
    text_digest,
)
from .ops import is_plain_swiglu

log = logging.getLogger(__name__)
_UNPLANNED = object()

DIALECTS = ("metal", "cuda")
SUPPORTED_BITS = (4, 8)
SUPPORTED_GROUPS = (32, 64, 128)
FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
MAX_TOKENS = 8  # decode and speculative verification; prefill goes to gather_qmm
# an expert array's (dtype, per-expert shape): an MLX dtype, or its name where MLX has none
ComponentSpec = Tuple[Union[mx.Dtype, str], Tuple[int, ...]]
# Threadgroup memory for the staged activation (fp32, IN_DIM floats + one sum per chunk).
SHARED_LIMIT = {"metal": 32 * 1024, "cuda": 48 * 1024}

_INPUTS = {
    "glu": ("x", "slots", "wg", "sg", "bg", "wu", "su", "bu"),
    "down": ("hin", "slots", "wd", "sd", "bd"),
}
# CUDA's kernels also read experts outside the pool (entry_cuda.cuh's MF_EXPERT): ``in_place``
# holds their addresses (cache.pool.InPlaceExperts.words)
_CUDA_EXTRA = ("in_place",)
_OUTPUTS = {"glu": ("h",), "down": ("y",), "combine": ("out",)}
_COMBINE_VARIANTS = {  # variant -> (inputs, MF_HAS_SHARED, MF_GATED)
    "plain": (("res", "y", "wts"), 0, 0),
    "shared": (("res", "y", "wts", "shr"), 1, 0),
    "gated": (("res", "y", "wts", "shr", "sgate"), 1, 1),
}
_POOL_KEYS = {
    "glu": (
        "gate_proj.weight",
        "gate_proj.scales",
        "gate_proj.biases",
        "up_proj.weight",
        "up_proj.scales",
        "up_proj.biases",
    ),
    "down": ("down_proj.weight", "down_proj.scales", "down_proj.biases"),
}


# ---------------------------------------------------------------------------------------------
# Sources


def _check_dialect(dialect: str) -> None:
    if dialect not in DIALECTS:
        raise ValueError(f"unknown kernel dialect {dialect!r}; choose one of {', '.join(DIALECTS)}")


def shared_body(kind: str, variant: str = "plain") -> str:
    """The dialect-neutral kernel body (identical text for Metal and CUDA)."""
    if kind in ("glu", "down"):
        rows = load_source(f"{kind}_rows.h")
        ws_b = "#define MF_WS_B 1\n" if kind == "glu" else ""
        ws_b_var = "#define MF_WS_B mf_wsb\n" if kind == "glu" else ""
        undef_b = "#undef MF_WS_B\n" if kind == "glu" else ""
        return (
            load_source(f"{kind}_body.h") + "  if (mf_vec) {\n"
            "#define MF_LD(p, st) MF_LOAD16(p)\n#define MF_WS_A 1\n"
            + ws_b
            + rows
            + "#undef MF_LD\n#undef MF_WS_A\n"
            + undef_b
            + "  } else {\n"
            "#define MF_LD(p, st) mf_load_words((p), (st))\n#define MF_WS_A mf_wsa\n"
            + ws_b_var
            + rows
            + "#undef MF_LD\n#undef MF_WS_A\n"
            + undef_b
            + "  }\n"
        )
    if kind == "combine":
        _, has_shared, gated = _COMBINE_VARIANTS[variant]
        return (
            f"#define MF_HAS_SHARED {has_shared}\n#define MF_GATED {gated}\n"
            + load_source("combine_body.h")
            + "#undef MF_HAS_SHARED\n#undef MF_GATED\n"
        )
    raise ValueError(f"unknown kernel kind {kind!r}")


def kernel_text(kind: str, dialect: str, variant: str = "plain") -> Tuple[str, str]:
    """``(header, body)`` as handed to ``mx.fast.{metal,cuda}_kernel``:
    header = dialect prelude + shared helpers, body = dialect entry + shared body."""
    _check_dialect(dialect)
    header = load_source(PRELUDE[dialect]) + "\n" + load_source(COMMON)
    body = load_source(ENTRY[dialect]) + shared_body(kind, variant)
    return header, body


def kernel_name(kind: str, dialect: str, variant: str = "plain") -> str:
    """Names carry a hash of the text: MLX caches compiled kernels by name (on disk, for CUDA)."""
    header, body = kernel_text(kind, dialect, variant)
    digest = text_digest(header, body)
    return f"moeflux_{kind}_{variant}_{digest}" if kind == "combine" else f"moeflux_{kind}_{digest}"


_KERNELS: Dict[tuple, Kernel] = {}


def _kernel(
    kind: str, dialect: str, variant: str = "plain", broken: Optional[str] = None
) -> Kernel:
    key = (kind, dialect, variant, broken)
    k = _KERNELS.get(key)
    if k is None:
        header, body = kernel_text(kind, dialect, variant)
        name = kernel_name(kind, dialect, variant)
        if broken:
            header, body = _break_text(broken, header, body)
            name = f"moeflux_{kind}_broken_{broken}_{text_digest(header, body)}"
        inputs = _COMBINE_VARIANTS[variant][0] if kind == "combine" else _INPUTS[kind]
        if kind != "combine" and dialect == "cuda":
            inputs = inputs + _CUDA_EXTRA
        # glu/down read every input through its strides: pools in place (no copy of a strided
        # pool), x and slots as the router hands them over (no node). combine wants row-contiguous.
        contiguous = kind == "combine"
        make = mx.fast.metal_kernel if dialect == "metal" else mx.fast.cuda_kernel
        k = custom_kernel(
            make,
            name=name,
            input_names=list(inputs),
            output_names=list(_OUTPUTS[kind]),
            source=body,
            header=header,
            ensure_row_contiguous=contiguous,
        )
        _KERNELS[key] = k
    return k


# ---------------------------------------------------------------------------------------------
# Test-only: deliberately broken variants (tests/test_selfcheck.py; the self-check must catch
# them and fall back to plain ops). Off unless a test turns it on.

BREAK_MODES = ("compile", "wrong", "raise")
_BREAK: Dict[str, object] = {}


def break_variants(
    mode: Optional[str], match: Optional[Callable[[str, str, dict], bool]] = None
) -> None:
    """Test-only switch: from now on, launches of the variants ``match(kind, dialect, template)``
    selects (every variant: ``match=None``) fail in ``mode``: ``"compile"`` (a kernel text that
    does not compile), ``"wrong"`` (compiles and runs, computes wrong numbers) or ``"raise"`` (the
    launch raises). ``mode=None`` turns it off. Launch plans already made keep their kernels."""
    if mode is not None and mode not in BREAK_MODES:
        raise ValueError(f"unknown break mode {mode!r}; choose one of {', '.join(BREAK_MODES)}")
    _BREAK.clear()
    if mode is not None:
        _BREAK.update(mode=mode, match=match)


def _broken_mode(kind: str, dialect: str, template: dict) -> Optional[str]:
    if not _BREAK:
        return None
    match = _BREAK["match"]
    if match is None or match(kind, dialect, template):  # type: ignore[operator]
        return _BREAK["mode"]  # type: ignore[return-value]
    return None


def _break_text(mode: str, header: str, body: str) -> Tuple[str, str]:
    if mode == "compile":
        return header, body + "\n  mf_this_is_not_a_statement;\n"
    if mode == "wrong":
        # Every accumulation subtracts instead of adds. The prelude's definition itself is
        # replaced: the shared dot products in the header expand MF_FMA where they are defined,
        # so a redefinition after them would leave the GLU and down kernels right.
        wrong = "#define MF_FMA(a, b, c) ((a) * (b) - (c))"
        broken = re.sub(r"#define MF_FMA\(a, b, c\) .*", wrong, header, count=1)
        if broken == header:
            raise AssertionError("the prelude defines no MF_FMA to break")
        return broken, body
    return header, body


# ---------------------------------------------------------------------------------------------
# Launch configurations


def _chunks(in_dim: int, bits: int) -> int:
    return in_dim * bits // 128


def _pow2_divisor(n: int, cap: int = 32) -> int:
    d = 1
    while d < cap and n % (d * 2) == 0:
        d *= 2
    return d


def default_config(kind: str, in_dim: int, out_dim: int, bits: int, pairs: int) -> dict:
    """Launch shape: lanes per row (lpr), warps per threadgroup (nw), row iterations (rpw),
    rows loaded together per row group (nr, down only). From the H100 sweep (docs/kernels.md):
    GLU rows are long (H), one warp per row; down rows are short (I), a few lanes per row with
    at least 4 chunks (16-byte loads) per lane and 2 rows in flight, staying clear of spills."""
    nch = _chunks(in_dim, bits)
    if kind == "glu":
        lpr = _pow2_divisor(nch)
        nw = 4
        rows_per_iter = nw * 32 // lpr
        iters = max(1, out_dim // rows_per_iter)
        # enough threadgroups to cover the GPU a few times over, without re-staging x too often
        rpw = max(1, min(4, iters * pairs // 512))
        return {"lpr": lpr, "nw": nw, "rpw": rpw}
    lpr = _pow2_divisor(nch, 8)
    while lpr > 1 and nch // lpr < 4:
        lpr //= 2
    nw, nr = 4, 2
    while lpr < 32 and nch // lpr * nr > 16:  # more 16-byte loads per lane spill registers
        lpr *= 2
    rows_per_iter = nw * 32 // lpr * nr
    iters = max(1, out_dim // rows_per_iter)
    rpw = 2 if iters * pairs >= 1024 else 1
    return {"lpr": lpr, "nw": nw, "rpw": rpw, "nr": nr}


def _check_config(kind: str, cfg: dict, in_dim: int, bits: int) -> None:
    nch = _chunks(in_dim, bits)
    lpr = cfg["lpr"]
    if lpr not in (1, 2, 4, 8, 16, 32) or nch % lpr:
        raise ValueError(
            f"{kind}: lanes per row {lpr} must be a power of two dividing {nch} chunks"
        )
    if cfg["nw"] < 1 or cfg["nw"] > 32 or cfg["rpw"] < 1 or cfg.get("nr", 1) < 1:
        raise ValueError(f"{kind}: bad launch config {cfg}")


# ---------------------------------------------------------------------------------------------
# Wrappers


def _check_quant(bits: int, group_size: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"kernels support {SUPPORTED_BITS}-bit weights, not {bits}-bit")
    if group_size not in SUPPORTED_GROUPS:
        raise ValueError(f"kernels support group sizes {SUPPORTED_GROUPS}, not {group_size}")


def _check_proj_spec(
    shapes: Mapping[str, ComponentSpec],
    proj: str,
    out_dim: int,
    in_dim: int,
    bits: int,
    group_size: int,
) -> None:
    """``shapes``: component name -> (dtype, per-expert shape), as ``ExpertSpec.shapes``."""
    (wd, ws), (sd, ss), (bd, bs) = (shapes[f"{proj}.{p}"] for p in ("weight", "scales", "biases"))
    want_w = (out_dim, in_dim * bits // 32)
    want_s = (out_dim, in_dim // group_size)
    if wd != mx.uint32 or tuple(ws) != want_w:
        raise ValueError(f"{proj}.weight is {wd}{tuple(ws)} per expert, expected uint32{want_w}")
    for name, dtype, shape in (("scales", sd, ss), ("biases", bd, bs)):
        if tuple(shape) != want_s or dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"{proj}.{name} is {dtype}{tuple(shape)} per expert, expected float{want_s}"
            )


def _check_proj(
    a: Dict[str, mx.array], proj: str, out_dim: int, in_dim: int, bits: int, group_size: int
) -> int:
    keys = [f"{proj}.{p}" for p in ("weight", "scales", "biases")]
    _check_proj_spec(
        {k: (a[k].dtype, tuple(a[k].shape[1:])) for k in keys},
        proj,
        out_dim,
        in_dim,
        bits,
        group_size,
    )
    n = a[keys[0]].shape[0]
    if any(a[k].shape[0] != n for k in keys):
        raise ValueError(f"{proj}: weight, scales and biases hold different numbers of experts")
    return n


SLOT_DTYPES = (mx.int32, mx.uint32)  # the kernels read either as a slot number


def _slots(slots: mx.array) -> mx.array:
    return slots if slots.dtype in SLOT_DTYPES else slots.astype(mx.int32)


@dataclass
class Launch:
    """One kernel launch with everything but its two varying inputs worked out and checked:
    call it with the activations (``x [..., in]`` for glu, ``h [..., K, in]`` for down) and
    ``slots [..., K]`` (int32/uint32), strided or not: the kernels read them through their
    strides, so no copy or reshape node enters the graph (decode is host-bound: every node
    costs host time per layer and token, see docs/kernels.md)."""

    kernel: Kernel
    arrays: List[mx.array]
    kwargs: dict
    raises: bool = False  # test-only: a deliberately broken variant (``break_variants``)

    def __call__(
        self, x: mx.array, slots: mx.array, init_value: Optional[float] = None
    ) -> mx.array:
        if self.raises:
            raise RuntimeError("test-only: the launch of a deliberately broken kernel variant")
        return self.kernel(inputs=[x, slots, *self.arrays], init_value=init_value, **self.kwargs)[0]


def launch_shape(
    kind: str,
    dtype,
    bits: int,
    group_size: int,
    in_dim: int,
    out_dim: int,
    topk: int,
    pairs: int,
    dialect: str,
    config: Optional[dict] = None,
) -> Tuple[list, Tuple[int, int, int], Tuple[int, int, int]]:
    """``(template, grid, threadgroup)`` of one glu/down launch, checked: what ``_prepare`` hands
    to the kernel, and what ``tests/support/metal_frontend.py`` rebuilds the Metal source from.

    Raises:
        ValueError: a shape, dtype or launch configuration the kernels do not cover."""
    _check_dialect(dialect)
    _check_quant(bits, group_size)
    if in_dim % group_size or in_dim % (128 // bits):
        raise ValueError(f"{kind}: input dim {in_dim} is not whole groups of {group_size}")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{kind}: activations must be float16/bfloat16/float32, not {dtype}")
    if 4 * (in_dim + _chunks(in_dim, bits)) > SHARED_LIMIT[dialect]:
        raise ValueError(f"{kind}: input dim {in_dim} too large for threadgroup memory")
    cfg = dict(default_config(kind, in_dim, out_dim, bits, pairs), **(config or {}))
    _check_config(kind, cfg, in_dim, bits)
    rows_per_iter = cfg["nw"] * 32 // cfg["lpr"] * cfg.get("nr", 1)
    rows_per_group = rows_per_iter * cfg["rpw"]
    n_groups = math.ceil(out_dim / rows_per_group)
    nt = cfg["nw"] * 32
    template = [
        ("T", dtype),
        ("BITS", bits),
        ("GSZ", group_size),
        ("IN_DIM", in_dim),
        ("OUT_DIM", out_dim),
        ("TOPK", topk),
        ("LPR", cfg["lpr"]),
        ("NW", cfg["nw"]),
        ("RPW", cfg["rpw"]),
    ]
    if kind == "down":
        template.append(("NR", cfg["nr"]))
    return template, (n_groups * nt, pairs, 1), (nt, 1, 1)


def _prepare(
    kind: str,
    dtype,
    pool_arrays,
    lead: Tuple[int, ...],
    topk: int,
    bits,
    group_size,
    dialect,
    config,
    in_dim,
    out_dim,
    in_place: Optional[InPlaceExperts] = None,
) -> Launch:
    """``lead``: the leading (token) dims of x and slots; the output is ``[*lead, topk, out_dim]``.
    ``in_place``: where the experts outside the pool lie (CUDA; None: slots name none)."""
    pairs = math.prod(lead) * topk
    template, grid, threadgroup = launch_shape(
        kind, dtype, bits, group_size, in_dim, out_dim, topk, pairs, dialect, config
    )
    broken = _broken_mode(kind, dialect, dict(template))
    return Launch(
        _kernel(kind, dialect, "plain", broken) if broken else _kernel(kind, dialect),
        [pool_arrays[k] for k in _POOL_KEYS[kind]] + _in_place_input(kind, dialect, in_place),
        dict(
            template=template,
            grid=grid,
            threadgroup=threadgroup,
            output_shapes=[(*lead, topk, out_dim)],
            output_dtypes=[dtype],
        ),
        raises=broken == "raise",
    )


def _in_place_input(kind: str, dialect: str, in_place: Optional[InPlaceExperts]) -> list:
    if dialect != "cuda":
        return []
    if in_place is not None:
        return [in_place.words(_POOL_KEYS[kind])]
    return [mx.zeros((2 * len(_POOL_KEYS[kind]),), mx.uint64)]  # never read: no slot is outside


def glu_matvec(
    x: mx.array,
    pool_arrays: Dict[str, mx.array],
    slots: mx.array,
    *,
    bits: int,
    group_size: int,
    dialect: str,
    config: Optional[dict] = None,
    init_value: Optional[float] = None,
    in_place: Optional[InPlaceExperts] = None,
) -> mx.array:
    """``h[t,k,:] = silu(Wg[s] @ x[t]) * (Wu[s] @ x[t])``, ``s = slots[t,k]``.

    x ``[..., H]`` (float16/bfloat16/float32), slots ``[..., K]`` (int) -> h ``[..., K, I]`` in
    x.dtype; x and slots may be strided. ``config`` overrides the launch shape (see
    ``default_config``); ``init_value`` fills the output before the kernel runs (tests poison it
    with NaN); ``in_place``: where experts outside the pool lie, for slots with
    ``cache.pool.IN_PLACE_BIT`` (CUDA only)."""
    a = pool_arrays
    in_dim = x.shape[-1]
    out_dim = a["gate_proj.weight"].shape[1]
    if x.ndim < 2 or tuple(slots.shape[:-1]) != tuple(x.shape[:-1]):
        raise ValueError(
            f"expected x [..., D] and slots [..., K] with the same leading dims, "
            f"got {x.shape} and {slots.shape}"
        )
    _check_quant(bits, group_size)
    _check_proj(a, "gate_proj", out_dim, in_dim, bits, group_size)
    _check_proj(a, "up_proj", out_dim, in_dim, bits, group_size)
    launch = _prepare(
        "glu",
        x.dtype,
        a,
        tuple(x.shape[:-1]),
        slots.shape[-1],
        bits,
        group_size,
        dialect,
        config,
        in_dim,
        out_dim,
        in_place,
    )
    return launch(x, _slots(slots), init_value)


def down_matvec(
    h: mx.array,
    pool_arrays: Dict[str, mx.array],
    slots: mx.array,
    *,
    bits: int,
    group_size: int,
    dialect: str,
    config: Optional[dict] = None,
    init_value: Optional[float] = None,
    in_place: Optional[InPlaceExperts] = None,
) -> mx.array:
    """``y[t,k,:] = Wd[s] @ h[t,k,:]``: h ``[..., K, I]``, slots ``[..., K]`` -> y ``[..., K, H]`` in
    h.dtype; h and slots may be strided. ``in_place``: as ``glu_matvec``'s."""
    a = pool_arrays
    if h.ndim < 2 or tuple(h.shape[:-1]) != tuple(slots.shape):
        raise ValueError(
            f"expected h [..., K, I] matching slots [..., K], got {h.shape}, {slots.shape}"
        )
    in_dim = h.shape[-1]
    out_dim = a["down_proj.weight"].shape[1]
    _check_quant(bits, group_size)
    _check_proj(a, "down_proj", out_dim, in_dim, bits, group_size)
    launch = _prepare(
        "down",
        h.dtype,
        a,
        tuple(slots.shape[:-1]),
        slots.shape[-1],
        bits,
        group_size,
        dialect,
        config,
        in_dim,
        out_dim,
        in_place,
    )
    return launch(h, _slots(slots), init_value)


def combine(
    residual: mx.array,
    y: mx.array,
    weights: mx.array,
    shared: Optional[mx.array] = None,
    shared_gate: Optional[mx.array] = None,
    *,
    dialect: str,
    init_value: Optional[float] = None,
) -> mx.array:
    """``residual + sum_k weights[...,k] * y[...,k,:]``, plus ``sigmoid(shared_gate) * shared``
    (Qwen3-Next/3.5) or, with ``shared_gate=None``, plain ``shared`` (DeepSeek). fp32 accumulation,
    one rounding to ``residual.dtype``. residual ``[..., H]``, y ``[..., K, H]``, weights ``[..., K]``,
    shared ``[..., H]``, shared_gate ``[...]`` or ``[..., 1]``."""
    _check_dialect(dialect)
    dim = residual.shape[-1]
    lead = tuple(residual.shape[:-1])
    n_tok = math.prod(lead)
    topk = y.shape[-2]
    if tuple(y.shape) != lead + (topk, dim) or tuple(weights.shape) != lead + (topk,):
        raise ValueError(
            f"combine: residual {residual.shape}, y {y.shape}, weights {weights.shape}"
        )
    if shared_gate is not None and shared is None:
        raise ValueError("combine: shared_gate without shared")
    inputs = [
        residual.reshape(n_tok, dim),
        y.reshape(n_tok * topk, dim),
        weights.reshape(n_tok, topk),
    ]
    variant = "plain"
    if shared is not None:
        if tuple(shared.shape) != lead + (dim,):
            raise ValueError(
                f"combine: shared {shared.shape} does not match residual {residual.shape}"
            )
        inputs.append(shared.reshape(n_tok, dim))
        variant = "shared"
        if shared_gate is not None:
            if shared_gate.size != n_tok:
                raise ValueError(f"combine: shared_gate {shared_gate.shape} is not one per token")
            inputs.append(shared_gate.reshape(n_tok))
            variant = "gated"
    nt = 256
    out = _kernel("combine", dialect, variant)(
        inputs=inputs,
        template=[("T", residual.dtype), ("DIM", dim), ("TOPK", topk), ("NT", nt)],
        grid=(math.ceil(dim / nt) * nt, n_tok, 1),
        threadgroup=(nt, 1, 1),
        output_shapes=[(n_tok, dim)],
        output_dtypes=[residual.dtype],
        init_value=init_value,
    )[0]
    return out.reshape(residual.shape)


# ---------------------------------------------------------------------------------------------
# Backend


def dialect_available(dialect: str) -> bool:
    _check_dialect(dialect)
    if mx.default_device() != mx.gpu:
        return False
    if dialect == "metal":
        return mx.metal.is_available()
    return mx.cuda.is_available()


@dataclass
class ExpertSpec:
    """What decides whether the fused kernels can take a layer's experts, known before any
    weight is read: each expert array's dtype and per-expert shape, and the quantization. Built
    from a resident pool (the runtime) or from a layout read from headers (``moeflux-mlx info``),
    so both ask ``expert_route`` the same question."""

    shapes: Mapping[str, ComponentSpec]  # "gate_proj.weight" -> (mx dtype, shape)
    quantization: Optional[Quantization]  # of gate/up (fc1)
    overrides: Dict[str, Optional[Quantization]] = field(default_factory=dict)

    @classmethod
    def of_pool(cls, pool: ExpertPool) -> ExpertSpec:
        """The spec of a resident pool.

        Args:
            pool: the layer's pool (arrays ``[n_slots, *shape]``).

        Returns:
            Its ``ExpertSpec``.
        """
        shapes = {k: (a.dtype, tuple(a.shape[1:])) for k, a in pool.arrays.items()}
        return cls(shapes, pool.quantization, dict(pool.overrides))

    @classmethod
    def of_layout(cls, layout: ExpertLayout) -> ExpertSpec:
        """The spec of a layer's expert blobs, as ``ExpertPool.from_blobs`` will view them.

        Args:
            layout: the layer's expert layout (from headers or ``layout.json``).

        Returns:
            Its ``ExpertSpec``.
        """
        shapes = {c.name: (MX_DTYPES.get(c.dtype, c.dtype), c.shape) for c in layout.components}
        return cls(shapes, layout.quantization, dict(layout.overrides))

    def quant(self, projection: str) -> Optional[Quantization]:
        return self.overrides.get(projection, self.quantization)

    @property
    def is_glu(self) -> bool:
        return "gate_proj.weight" in self.shapes

    @property
    def dims(self) -> Tuple[int, int]:
        """``(hidden, intermediate)`` of a quantized gated layer, from gate_proj's weight."""
        q = self.quantization
        _, (out_dim, packed) = self.shapes["gate_proj.weight"]
        return (packed * 32 // q.bits if q else packed), out_dim


def _covered_quantizations() -> str:
    bits = "/".join(map(str, SUPPORTED_BITS))
    groups = "/".join(map(str, SUPPORTED_GROUPS))
    return f"they take affine {bits}-bit, groups {groups}"


def expert_route(dialect: str, spec: ExpertSpec, activation) -> Optional[str]:
    """Why the fused kernels cannot take a layer's experts, whatever the call; None when they
    can. The one decision the runtime (``KernelBackend.route``) and ``moeflux-mlx info`` share.

    Args:
        dialect: ``metal`` or ``cuda`` (their threadgroup memory differs).
        spec: the layer's experts (``ExpertSpec.of_pool`` / ``of_layout``).
        activation: the model's activation object for the layer.

    Returns:
        None, or one line saying why (e.g. ``"mxfp4 quantization: no fused kernel (...)"``).

    Raises:
        ValueError: an unknown dialect.
    """
    _check_dialect(dialect)
    if not spec.is_glu:
        return "not a gated (SwitchGLU) expert pool"
    # the quantization first: of every reason, the one a model cannot be without (gpt-oss's
    # experts are mxfp4 before they have biases or a clamped SwiGLU)
    q = spec.quantization
    if q is None:
        return "experts are not quantized"
    if q.mode != "affine":
        return f"{q.mode}: no fused kernel ({_covered_quantizations()})"
    if q.bits not in SUPPORTED_BITS or q.group_size not in SUPPORTED_GROUPS:
        return (
            f"{q.bits}-bit affine quantization, group {q.group_size}: no fused kernel "
            f"({_covered_quantizations()})"
        )
    differ = [p for p in ("gate_proj", "up_proj", "down_proj") if spec.quant(p) != q]
    if differ:
        return f"projections {', '.join(differ)} are quantized otherwise (a mixed recipe)"
    if not is_plain_swiglu(activation):
        return f"activation {type(activation).__name__} is not plain SwiGLU"
    if any(k.endswith(".bias") for k in spec.shapes):
        return "experts have bias vectors"
    if any(k.endswith(".global_scale") for k in spec.shapes):
        return "experts have a global scale (nvfp4)"
    try:
        hid, inter = spec.dims
        _check_proj_spec(spec.shapes, "gate_proj", inter, hid, q.bits, q.group_size)
        _check_proj_spec(spec.shapes, "up_proj", inter, hid, q.bits, q.group_size)
        _check_proj_spec(spec.shapes, "down_proj", hid, inter, q.bits, q.group_size)
    except (KeyError, ValueError) as e:
        return f"pool arrays not covered ({e})"
    for d in (hid, inter):
        if d % q.group_size or 4 * (d + _chunks(d, q.bits)) > SHARED_LIMIT[dialect]:
            return f"dimension {d} not covered"
    # the launch shape depends on the row length only (not on the tokens): a row whose 16-byte
    # chunks no launch shape divides would fail to launch, so it is refused here
    for kind, in_dim, out_dim in (("glu", hid, inter), ("down", inter, hid)):
        try:
            _check_config(kind, default_config(kind, in_dim, out_dim, q.bits, 1), in_dim, q.bits)
        except ValueError as e:
            return f"{kind} rows of {in_dim} weights have no launch shape ({e})"
    return None


def failed_check(variant: selfcheck.Variant, verdict: selfcheck.Verdict) -> str:
    """Why a variant whose self-check failed runs on plain ops, in one line.

    Args:
        variant: the kernel variant.
        verdict: its failed verdict.

    Returns:
        ``"self-check failed for <variant>: <first line of the error>"``.
    """
    short = verdict.error.splitlines()[0][:200] if verdict.error else "failed"
    return f"self-check failed for {variant.label}: {short}"


@dataclass
class Plan:
    """What ``KernelBackend`` worked out for one pool and call shape: the two launches, or None
    (the fallback computes those calls), and what serves them, as stats report it."""

    launches: Optional[Tuple[Launch, Launch]]
    served: str  # "metal" / "cuda", or "ops (fallback: <why>)"
    # the slots' dtype is in the plan's key: whether the launches take them cast (``_slots``)
    cast_slots: bool = False


def source_digest(dialect: str) -> str:
    """A hash of every kernel text of ``dialect``: the self-check's verdicts are kept per hash."""
    h = hashlib.sha1()
    for kind, variant in (("glu", "plain"), ("down", "plain")):
        h.update(kernel_name(kind, dialect, variant).encode())  # the text as MLX gets it
    if _BREAK:  # broken texts are other kernels: their verdicts must not meet the real ones'
        h.update(f"broken:{_BREAK['mode']}".encode())
    return h.hexdigest()[:12]


class KernelBackend:
    """Expert computation through the fused kernels; same call as ``compute.ops.OpsBackend``.

    ``x [..., H]``, ``slots [..., K]`` -> ``[..., K, H]`` in ``x.dtype``, like ``SwitchGLU``. Whatever
    the kernels do not cover (see ``route``) goes to ``fallback(x, slots, pool, activation)``, and
    so does every variant that fails its self-check (``compute.selfcheck``: before the kernels
    serve a new variant, they run once on random inputs of its shape against the fallback).
    ``last_served`` names what computed the last call (``"metal"``, ``"ops (fallback: ...)"``)."""

    def __init__(self, dialect: str, fallback, selfcheck: bool = True):
        _check_dialect(dialect)
        self.dialect = dialect
        self.name = dialect
        self.fallback = fallback
        self.selfcheck = selfcheck
        self.last_served = dialect
        self._available: Optional[bool] = None
        self._why_unavailable: Optional[str] = None

    @property
    def available(self) -> bool:
        if self._available is None:
            self._available = dialect_available(self.dialect)
        return self._available

    def unavailable_reason(self) -> Optional[str]:
        if self.available:
            return None
        if self._why_unavailable is None:  # worded once, as availability is decided once
            self._why_unavailable = (
                f"{self.dialect} kernels not available: MLX's default device is the CPU"
                if mx.default_device() != mx.gpu
                else f"{self.dialect} backend not available on this device"
            )
        return self._why_unavailable

    def report(self) -> str:
        """What will compute the experts, before any call: the dialect, or ops and why."""
        why = self.unavailable_reason()
        return self.dialect if why is None else f"ops (fallback: {why})"

    def route(
        self, x: mx.array, slots: mx.array, pool, activation, *, assume_available: bool = False
    ) -> Optional[str]:
        """None when the fused kernels take this call, else why it falls back."""
        if not (assume_available or self.available):
            return self.unavailable_reason()
        spec = ExpertSpec.of_pool(pool)
        why = expert_route(self.dialect, spec, activation)
        if why is not None:
            return why
        if x.dtype not in FLOAT_DTYPES:
            return f"activation dtype {x.dtype} not covered"
        if x.ndim < 1 or slots.ndim != x.ndim or tuple(slots.shape[:-1]) != tuple(x.shape[:-1]):
            return f"x {x.shape} and slots {slots.shape} do not pair up token for token"
        n_tok = math.prod(x.shape[:-1])
        if not 1 <= n_tok <= MAX_TOKENS:
            return f"{n_tok} tokens (kernels cover 1..{MAX_TOKENS})"
        if x.shape[-1] != spec.dims[0]:
            return f"x has {x.shape[-1]} features, the experts take {spec.dims[0]}"
        return None

    def __call__(self, x: mx.array, slots: mx.array, pool, activation) -> mx.array:
        # decode calls this once per MoE layer and token: the checks and launch shapes are worked
        # out once per pool and call shape (``pool.plans``), so only the launches remain here
        key = (self.dialect, x.shape, x.dtype, slots.shape, slots.dtype, type(activation))
        plan = pool.plans.get(key, _UNPLANNED)
        if plan is _UNPLANNED:
            plan = pool.plans[key] = self._plan(x, slots, pool, activation)
        self.last_served = plan.served
        if plan.launches is None:
            return self.fallback(x, slots, pool, activation)
        glu, down = plan.launches
        if plan.cast_slots:
            slots = _slots(slots)
        return down(glu(x, slots), slots)  # two graph nodes per layer, nothing else

    def _plan(self, x, slots, pool, activation) -> Plan:
        """The two launches for calls shaped like this one, or none: the fallback takes them."""
        why = self.route(x, slots, pool, activation)
        if why is not None:
            log.debug(
                "%s kernels not used for x %s, slots %s: %s",
                self.dialect,
                x.shape,
                slots.shape,
                why,
            )
            n_tok = math.prod(x.shape[:-1]) if x.ndim else 0
            if n_tok > MAX_TOKENS and why.endswith(f"(kernels cover 1..{MAX_TOKENS})"):
                return Plan(None, f"ops (prefill: more than {MAX_TOKENS} tokens)")
            return Plan(None, f"ops (fallback: {why})")
        launches = self._launches(pool, x, slots)
        if self.selfcheck:
            variant = self.variant(x, slots, pool)
            check = selfcheck.checker(self.dialect, source_digest(self.dialect))
            verdict = check.verdict(variant, lambda: self._check(variant, x, slots, pool))
            if not verdict.ok:
                return Plan(None, f"ops (fallback: {failed_check(variant, verdict)})")
        return Plan(launches, self.dialect, cast_slots=slots.dtype not in SLOT_DTYPES)

    def _launches(self, pool, x, slots) -> Tuple[Launch, Launch]:
        q = pool.quantization
        hid, topk, lead = x.shape[-1], slots.shape[-1], tuple(x.shape[:-1])
        inter = pool.arrays["gate_proj.weight"].shape[1]
        glu = _prepare(
            "glu",
            x.dtype,
            pool.arrays,
            lead,
            topk,
            q.bits,
            q.group_size,
            self.dialect,
            None,
            hid,
            inter,
            pool.in_place,
        )
        down = _prepare(
            "down",
            x.dtype,
            pool.arrays,
            lead,
            topk,
            q.bits,
            q.group_size,
            self.dialect,
            None,
            inter,
            hid,
            pool.in_place,
        )
        return glu, down

    def variant(self, x: mx.array, slots: mx.array, pool) -> selfcheck.Variant:
        """The kernel variant that calls shaped like this one launch (the self-check's key)."""
        return self.variant_of(
            ExpertSpec.of_pool(pool),
            x.dtype,
            _slots(slots).dtype,
            slots.shape[-1],
            math.prod(x.shape[:-1]),
        )

    def variant_of(
        self, spec: ExpertSpec, dtype, slot_dtype, topk: int, tokens: int
    ) -> selfcheck.Variant:
        """The kernel variant of calls on a layer the kernels take (``expert_route``: None).

        Args:
            spec: the layer's experts.
            dtype: the activation dtype.
            slot_dtype: the slot indices' dtype (``mx.uint32`` from the caches).
            topk: experts per token.
            tokens: tokens per call.

        Returns:
            The ``selfcheck.Variant`` (its label is the self-check's key).
        """
        q = spec.quantization
        assert q is not None, "the kernels take quantized experts only"
        hidden, inter = spec.dims
        return selfcheck.Variant(
            dialect=self.dialect,
            dtype=selfcheck.dtype_name(dtype),
            scales=selfcheck.dtype_name(spec.shapes["gate_proj.scales"][0]),
            slots=selfcheck.dtype_name(slot_dtype),
            bits=q.bits,
            group_size=q.group_size,
            hidden=hidden,
            inter=inter,
            topk=topk,
            tokens=tokens,
        )

    def recorded_verdict(self, variant: selfcheck.Variant) -> Optional[selfcheck.Verdict]:
        """The self-check's verdict on ``variant`` on this machine, without running it.

        Args:
            variant: from ``variant`` / ``variant_of``.

        Returns:
            The verdict this process or the disk keeps, or None when it has not run.
        """
        return selfcheck.checker(self.dialect, source_digest(self.dialect)).recorded(variant)

    def _check(self, variant: selfcheck.Variant, x: mx.array, slots: mx.array, pool) -> float:
        """Run the launches of this variant once on random experts and inputs of the layer's
        shape, outputs poisoned with NaN, and compare with the fallback on the same: the
        relative error, or ``SelfCheckMismatch`` / whatever the kernels raised."""
        test_pool = selfcheck.random_pool_like(pool, variant)
        xs, ss = selfcheck.random_inputs(
            variant, tuple(x.shape), tuple(slots.shape), selfcheck.CHECK_SLOTS
        )
        glu, down = self._launches(test_pool, xs, ss)
        nan = float("nan")
        out = down(glu(xs, ss, nan), ss, nan)
        ref = self.fallback(xs, ss, test_pool, SwiGLU())
        return selfcheck.relative_error(out, ref, variant.dtype)

"""The Metal kernels through a compiler's front end, without a Mac.

``mx.fast.metal_kernel`` hands Metal's compiler a source it builds around our body: MLX's own
preamble (``metal::utils()``), our header, a signature it generates from the inputs (their
dtypes, sizes and which of ``<name>_shape`` / ``_strides`` / ``_ndim`` the body names), the
thread-position attributes the body names, the body, and an explicit template instantiation.
``generated_source`` rebuilds that text exactly as MLX 0.32's ``mlx/backend/common/
metal_kernel.cpp`` (``write_signature``, ``write_template``, ``make_template_hash``) writes it,
for every kernel variant the backend can launch (``variants``).

``check`` then compiles it with clang (the ``libclang`` wheel from PyPI: pure front end, no
Apple toolchain) in C++ for OpenCL mode, against a small stand-in for Metal's standard library
(``metal_kernels/metal_stdlib_shim.h``) and for MLX's preamble (``mlx_preamble_shim.h``):

* Metal's address spaces map onto OpenCL's (device -> __global, threadgroup -> __local,
  thread -> __private, constant -> __constant) with the generic address space turned off, so a
  pointer never converts between address spaces, as in Metal;
* program-scope variables (static data members too) must be ``constant``, as in Metal;
* the template kernel becomes an ordinary kernel with the template arguments bound at the top of
  its body (OpenCL kernels cannot be templates; the body is the same text, so every use of the
  template parameters is checked with their values, ``static_assert`` included);
* MLX's ``[[kernel]]`` / ``[[buffer(i)]]`` / ``[[host_name(...)]]`` and thread-position
  attributes are checked here (known names, the types MLX declares, buffer indices 0..30 in
  order, the instantiation naming the kernel with its template arguments) and then dropped.

What it catches: syntax errors, unknown names, type and overload errors, template errors,
address-space errors, static asserts, too much threadgroup memory (> 32 KB), more than 31 buffer
arguments. What it cannot see: anything that happens when the kernel runs (SIMD-group semantics,
the values of shuffles, races, out-of-bounds reads), Metal-specific compiler limits beyond these,
and speed. That is what the self-check at first use (``compute.selfcheck``) is for.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from moeflux_mlx.compute import kernels as K
from moeflux_mlx.compute.kernel_source import compact, load_source

# mlx/backend/common/metal_kernel.cpp
MAX_CONSTANT_ARRAY_SIZE = 8  # inputs with fewer elements are passed in the constant space
METAL_ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)
# mlx/backend/common/compiled.cpp: get_type_string
MLX_TYPE = {
    "float32": "float",
    "float16": "float16_t",
    "bfloat16": "bfloat16_t",
    "float64": "double",
    "complex64": "complex64_t",
    "bool": "bool",
    "int8": "int8_t",
    "int16": "int16_t",
    "int32": "int32_t",
    "int64": "int64_t",
    "uint8": "uint8_t",
    "uint16": "uint16_t",
    "uint32": "uint32_t",
    "uint64": "uint64_t",
}
MAX_BUFFERS = 31  # Metal's buffer argument table
THREADGROUP_MEMORY = 32 * 1024  # bytes, every Apple GPU
SHIM_FILES = {
    "metal_stdlib": "metal_stdlib_shim.h",
    "mlx_preamble.h": "mlx_preamble_shim.h",
}
CLANG_ARGS = (
    "-x",
    "cl",
    "-cl-std=clc++2021",
    "-cl-no-stdinc",
    # no generic address space, no program-scope globals: Metal has neither
    "-Xclang",
    "-cl-ext=-all,+cl_khr_fp16",
    # a 64-bit target whose front end knows __bf16 (Metal 3.1's bfloat)
    "-target",
    "aarch64-linux-gnu",
    "-Wall",
    "-Wno-unused-variable",
    "-Wno-unused-function",
    "-ferror-limit=50",
)

TemplateArg = Union[int, bool, str, mx.Dtype]
_LOCK = threading.Lock()  # file descriptor 1 is redirected while MLX prints a source


def _type_name(dtype) -> str:
    name = dtype if isinstance(dtype, str) else str(dtype).rsplit(".", 1)[-1]
    return MLX_TYPE[name]


@dataclass(frozen=True)
class Input:
    """An input as ``write_signature`` sees it: its dtype, number of dims and of elements."""

    dtype: str  # "float16", "uint32", ...
    ndim: int
    size: int


# ---------------------------------------------------------------------------------------------
# MLX's source generation, rewritten line for line


def shape_infos(source: str, input_names: Sequence[str]) -> List[Tuple[bool, bool, bool]]:
    return [
        (f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source)
        for n in input_names
    ]


def attributes(source: str) -> List[str]:
    """The thread-position parameters MLX adds: those whose name appears in the body."""
    return [f"  {t} {a} [[{a}]]" for a, t in METAL_ATTRIBUTES if a in source]


def _template_value(arg: TemplateArg) -> str:
    if isinstance(arg, bool):
        return str(int(arg))  # an ostream without boolalpha
    if isinstance(arg, int):
        return str(arg)
    return _type_name(arg)


def _template_type(arg: TemplateArg) -> str:
    if isinstance(arg, bool):
        return "bool"
    if isinstance(arg, int):
        return "int"
    return "typename"


def write_template(template_args: Sequence[Tuple[str, TemplateArg]]) -> str:
    return "<" + ", ".join(_template_value(a) for _, a in template_args) + ">"


def make_template_hash(template_def: str) -> str:
    out, i = [], 0
    while i < len(template_def):
        c = template_def[i]
        if c in "<>":
            out.append("_")
        elif c == "," and i + 1 < len(template_def) and template_def[i + 1] == " ":
            out.append("_")
            i += 1
        else:
            out.append(c)
        i += 1
    return "".join(out)[:-1]  # pop_back


def kernel_function_name(
    name: str,
    template_args: Sequence[Tuple[str, TemplateArg]],
    inputs: Sequence[Input],
    output_dtypes: Sequence[str],
) -> str:
    kname = "custom_kernel_" + name
    if template_args:
        kname += "_" + make_template_hash(write_template(template_args))
    for inp in inputs:
        kname += "_" + _type_name(inp.dtype)
        if inp.ndim == 0:
            kname += "s"
        elif inp.size < MAX_CONSTANT_ARRAY_SIZE:
            kname += "c"
    for d in output_dtypes:
        kname += "_" + _type_name(d)
    return kname


def write_signature(
    func_name: str,
    header: str,
    source: str,
    input_names: Sequence[str],
    inputs: Sequence[Input],
    output_names: Sequence[str],
    output_dtypes: Sequence[str],
    template_args: Sequence[Tuple[str, TemplateArg]],
    attrs: Sequence[str],
    infos: Sequence[Tuple[bool, bool, bool]],
    atomic_outputs: bool = False,
) -> str:
    out = header
    if template_args:
        out += (
            "template <" + ", ".join(f"{_template_type(a)} {n}" for n, a in template_args) + ">\n"
        )
    out += f"[[kernel]] void {func_name}(\n"
    index = 0
    for name, inp, info in zip(input_names, inputs, infos):
        location = "constant" if inp.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if inp.ndim == 0 else "*"
        out += f"  const {location} {_type_name(inp.dtype)}{ref} {name} [[buffer({index})]],\n"
        index += 1
        if inp.ndim > 0:
            if info[0]:
                out += f"  const constant int* {name}_shape [[buffer({index})]],\n"
                index += 1
            if info[1]:
                out += f"  const constant int64_t* {name}_strides [[buffer({index})]],\n"
                index += 1
            if info[2]:
                out += f"  const constant int& {name}_ndim [[buffer({index})]],\n"
                index += 1
    for name, dtype in zip(output_names, output_dtypes):
        t = _type_name(dtype)
        t = f"atomic<{t}>" if atomic_outputs else t
        out += f"  device {t}* {name} [[buffer({index})]]"
        # MLX's test: index < inputs.size() + outputs.size() - 1 || attributes.size() > 0
        out += ",\n" if index < len(inputs) + len(output_names) - 1 or attrs else ") {\n"
        index += 1
    for i, attr in enumerate(attrs):
        out += attr + (",\n" if i < len(attrs) - 1 else ") {\n")
    out += source + "\n}\n"
    return out


def generated_source(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str,
    inputs: Sequence[Input],
    output_dtypes: Sequence[str],
    template_args: Sequence[Tuple[str, TemplateArg]],
    atomic_outputs: bool = False,
) -> Tuple[str, str]:
    """``(kernel function name, source)``: what ``mx.fast.metal_kernel(name, input_names,
    output_names, source, header)(inputs=..., template=template_args, ...)`` compiles, after
    MLX's own preamble."""
    func = kernel_function_name(name, template_args, inputs, output_dtypes)
    text = write_signature(
        func,
        header,
        source,
        input_names,
        inputs,
        output_names,
        output_dtypes,
        template_args,
        attributes(source),
        shape_infos(source, input_names),
        atomic_outputs,
    )
    if template_args:
        tdef = func + write_template(template_args)
        text += f'\ntemplate [[host_name("{func}")]] [[kernel]] decltype({tdef}) {tdef};\n'
    return func, text


# ---------------------------------------------------------------------------------------------
# Every variant the backend can launch


@dataclass(frozen=True)
class Variant:
    """One kernel variant: a kind, its dtypes and its template's values."""

    kind: str  # glu | down | combine
    dtype: str  # activations (and outputs)
    template: Tuple[Tuple[str, TemplateArg], ...]
    inputs: Tuple[Input, ...]
    combine_variant: str = "plain"
    label: str = ""

    def source(self, header: Optional[str] = None, body: Optional[str] = None) -> Tuple[str, str]:
        """``(function name, exact source)``; ``header``/``body`` replace the kernel's own."""
        h, b = K.kernel_text(self.kind, "metal", self.combine_variant)
        names = (
            K._COMBINE_VARIANTS[self.combine_variant][0]
            if self.kind == "combine"
            else K._INPUTS[self.kind]
        )
        return generated_source(
            K.kernel_name(self.kind, "metal", self.combine_variant),
            names,
            K._OUTPUTS[self.kind],
            compact(b if body is None else body),  # what the product hands MLX
            compact(h if header is None else header),
            self.inputs,
            [self.dtype],
            self.template,
        )


def _capture_stdout(fn) -> str:
    """What ``fn()`` writes to file descriptor 1 (MLX prints from C++)."""
    sys.stdout.flush()
    r, w = os.pipe()
    saved = os.dup(1)
    os.dup2(w, 1)
    os.close(w)
    chunks = []
    try:
        with ThreadPoolExecutor(1) as reader:  # drain the pipe while MLX writes into it
            fut = reader.submit(
                lambda: [chunks.append(b) for b in iter(lambda: os.read(r, 65536), b"")]
            )
            try:
                fn()
            finally:
                os.dup2(saved, 1)
            fut.result()
    finally:
        os.close(saved)
        os.close(r)
    return b"".join(chunks).decode()


def mlx_source(
    v: Variant, header: Optional[str] = None, body: Optional[str] = None
) -> Optional[str]:
    """The source MLX itself generates for ``v`` (``verbose=True`` prints it), or None where
    this MLX cannot build a Metal kernel's source without Metal. MLX >= 0.32 can while exporting
    a function (``mx.export_function``), which records a custom kernel without running it."""
    h, b = K.kernel_text(v.kind, "metal", v.combine_variant)
    names = K._COMBINE_VARIANTS[v.combine_variant][0] if v.kind == "combine" else K._INPUTS[v.kind]
    try:
        kernel = mx.fast.metal_kernel(
            name=K.kernel_name(v.kind, "metal", v.combine_variant),
            input_names=list(names),
            output_names=list(K._OUTPUTS[v.kind]),
            source=compact(b if body is None else body),
            header=compact(h if header is None else header),
            ensure_row_contiguous=v.kind == "combine",
        )
        arrays = [mx.zeros((i.size,) + (1,) * (i.ndim - 1), getattr(mx, i.dtype)) for i in v.inputs]
        tmpl = [(n, getattr(mx, a) if isinstance(a, str) else a) for n, a in v.template]

        def launch(*xs):
            return kernel(
                inputs=list(xs),
                template=tmpl,
                grid=(32, 1, 1),
                threadgroup=(32, 1, 1),
                output_shapes=[(1,)],
                output_dtypes=[getattr(mx, v.dtype)],
                verbose=True,
            )

        with _LOCK, tempfile.TemporaryDirectory(prefix="moeflux-export-") as d:
            out = _capture_stdout(
                lambda: mx.export_function(os.path.join(d, "k.mlxfn"), launch, *arrays)
            )
    except Exception:  # noqa: BLE001 - an MLX that cannot: the port's text is used
        return None
    if "```\n" not in out:
        return None
    return out.split("```\n", 1)[1].rsplit("\n```", 1)[0]


# (hidden H, intermediate I, experts per token K) the backend meets
SHAPES = {
    "synth-tiny": (128, 128, 4),
    "synth-small": (512, 256, 4),
    "qwen3-30b-a3b": (2048, 768, 8),
    "qwen3.5-397b-a17b": (4096, 1024, 10),
    "deepseek-v3": (7168, 2048, 8),
}
DTYPES = ("float16", "bfloat16", "float32")


def _glu_down(
    kind: str,
    dtype: str,
    scales: str,
    slots: str,
    bits: int,
    gs: int,
    hid: int,
    inter: int,
    topk: int,
    n_tok: int,
    config: Optional[dict] = None,
    label: str = "",
) -> Variant:
    in_dim, out_dim = (hid, inter) if kind == "glu" else (inter, hid)
    template, _, _ = K.launch_shape(
        kind, getattr(mx, dtype), bits, gs, in_dim, out_dim, topk, n_tok * topk, "metal", config
    )
    act = Input(dtype, 3 if kind == "down" else 2, n_tok * (topk if kind == "down" else 1) * in_dim)
    w = Input("uint32", 3, 2 * out_dim * in_dim * bits // 32)  # >= 8 elements: device memory
    s = Input(scales, 3, 2 * out_dim * in_dim // gs)
    pool = (w, s, s) * (2 if kind == "glu" else 1)
    inputs = (act, Input(slots, 2, n_tok * topk), *pool)
    tmpl = tuple((n, dtype if n == "T" else v) for n, v in template)
    return Variant(kind, dtype, tmpl, inputs, label=label)


def variants(full: bool = True) -> List[Variant]:
    """Every glu/down variant the backend launches for the shapes in ``SHAPES`` (both bit widths,
    the three group sizes, the three activation dtypes, 1 and 8 tokens: the slot indices of one
    token with K < 8 experts are passed in the constant space, of 8 tokens in device memory),
    scale dtypes other than the activations', int32 slots, the launch shapes of the kernel
    tests, and the three combine variants. ``full=False``: one of each dtype, bit width and
    kind (a quick subset)."""
    out: List[Variant] = []
    shapes = SHAPES if full else {"synth-small": SHAPES["synth-small"]}
    for shape, (hid, inter, topk) in shapes.items():
        for dtype in DTYPES:
            for bits in K.SUPPORTED_BITS:
                for gs in K.SUPPORTED_GROUPS if full else (64,):
                    for n_tok in (1, 8) if full else (1,):
                        for kind in ("glu", "down"):
                            label = f"{kind} {dtype} {bits}-bit g{gs} {shape} T{n_tok}"
                            out.append(
                                _glu_down(
                                    kind, dtype, dtype, "uint32", bits, gs, hid, inter, topk,
                                    n_tok, label=label,
                                )
                            )  # fmt: skip
    if not full:
        return out
    hid, inter, topk = SHAPES["synth-small"]
    for dtype in DTYPES:
        for scales in DTYPES:
            if scales != dtype:
                for kind in ("glu", "down"):
                    label = f"{kind} {dtype} scales {scales} 8-bit g64 synth-small T3"
                    out.append(
                        _glu_down(kind, dtype, scales, "uint32", 8, 64, hid, inter, topk, 3,
                                  label=label)
                    )  # fmt: skip
        for kind in ("glu", "down"):
            out.append(
                _glu_down(kind, dtype, dtype, "int32", 4, 32, hid, inter, topk, 2,
                          label=f"{kind} {dtype} 4-bit g32 synth-small T2 int32 slots")
            )  # fmt: skip
    hid, inter, topk = SHAPES["qwen3-30b-a3b"]
    for bits in K.SUPPORTED_BITS:  # the launch shapes tests/test_kernels.py sweeps
        for lpr in (1, 2, 4, 8, 16, 32):
            for nw, rpw in ((1, 1), (2, 3), (8, 2)):
                for kind, in_dim in (("glu", hid), ("down", inter)):
                    if (in_dim * bits // 128) % lpr:
                        continue
                    cfg = dict(lpr=lpr, nw=nw, rpw=rpw, **({"nr": 3} if kind == "down" else {}))
                    label = f"{kind} bfloat16 {bits}-bit g64 qwen3-30b-a3b T1 config {cfg}"
                    out.append(
                        _glu_down(kind, "bfloat16", "bfloat16", "uint32", bits, 64, hid, inter,
                                  topk, 1, cfg, label)
                    )  # fmt: skip
    for dtype in DTYPES:
        for cv in ("plain", "shared", "gated"):
            for n_tok, (hid, topk) in ((1, (4096, 10)), (3, (200, 3)), (8, (7168, 8))):
                ins = [Input(dtype, 2, n_tok * hid), Input(dtype, 2, n_tok * topk * hid)]
                ins.append(Input(dtype, 2, n_tok * topk))
                if cv != "plain":
                    ins.append(Input(dtype, 2, n_tok * hid))
                if cv == "gated":
                    ins.append(Input(dtype, 1, n_tok))
                tmpl = (("T", dtype), ("DIM", hid), ("TOPK", topk), ("NT", 256))
                label = f"combine {cv} {dtype} H{hid} K{topk} T{n_tok}"
                out.append(Variant("combine", dtype, tmpl, tuple(ins), cv, label))
    return out


# ---------------------------------------------------------------------------------------------
# clang


class FrontendError(RuntimeError):
    """The generated source is not what this check understands (an attribute, an index)."""


@dataclass
class Diagnostic:
    severity: str  # "error" | "warning"
    line: int  # in the kernel's source (what ``generated_source`` returned), 0: elsewhere
    file: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where}: {self.severity}: {self.message}"


@dataclass
class Result:
    variant: str
    function: str
    errors: List[Diagnostic] = field(default_factory=list)
    warnings: List[Diagnostic] = field(default_factory=list)
    threadgroup_bytes: Optional[int] = None
    buffers: int = 0
    source_from: str = "port"  # "mlx": the text MLX generated; "port": generated_source's

    @property
    def ok(self) -> bool:
        return not self.errors


_ATTR = re.compile(r"\[\[(.*?)\]\]")


def for_clang(
    function: str, source: str, template: Sequence[Tuple[str, TemplateArg]]
) -> Tuple[str, int]:
    """The exact source, made a C++ for OpenCL translation unit with the same lines: the
    attributes checked and dropped, the template kernel made an ordinary kernel with its
    template arguments bound at the top of the body, the explicit instantiation checked and
    dropped. Returns ``(text, number of buffer arguments)``.

    Raises:
        FrontendError: an unknown attribute, a thread-position attribute of another type than
            MLX's, buffer indices not 0, 1, 2 ... or more than Metal's 31, an instantiation
            that does not name this kernel with these arguments."""
    known = dict(METAL_ATTRIBUTES)
    tdef = function + write_template(template)
    inst = f'template [[host_name("{function}")]] [[kernel]] decltype({tdef}) {tdef};'
    if template:
        if source.count(inst) != 1 or not source.rstrip().endswith(inst):
            raise FrontendError(f"{function}: no explicit instantiation {inst!r} at the end")
        source = source[: source.rindex(inst)] + source[source.rindex(inst) + len(inst) :]
    tparams = "template <" + ", ".join(f"{_template_type(a)} {n}" for n, a in template) + ">\n"
    head = (tparams if template else "") + f"[[kernel]] void {function}(\n"
    if source.count(head) != 1:
        raise FrontendError(f"{function}: no kernel declaration {head!r}")
    start = source.index(head)
    sig_end = source.index(") {\n", start)
    sig = source[start + len(head) : sig_end]
    buffers = []
    params = []
    for line in sig.split(",\n"):
        attrs = _ATTR.findall(line)
        if len(attrs) != 1:
            raise FrontendError(f"{function}: parameter {line.strip()!r}: one attribute expected")
        a = attrs[0]
        m = re.fullmatch(r"buffer\((\d+)\)", a)
        if m:
            buffers.append(int(m[1]))
        elif a in known:
            want = f"  {known[a]} {a} "
            if not line.startswith(want):
                raise FrontendError(f"{function}: {line.strip()!r} is not MLX's {want.strip()}")
        else:
            raise FrontendError(f"{function}: unknown attribute [[{a}]]")
        params.append(_ATTR.sub("", line).rstrip())
    if buffers != list(range(len(buffers))):
        raise FrontendError(f"{function}: buffer indices {buffers} are not 0, 1, 2, ...")
    if len(buffers) > MAX_BUFFERS:
        raise FrontendError(
            f"{function}: {len(buffers)} buffer arguments, Metal allows {MAX_BUFFERS}"
        )
    bind = " ".join(
        f"typedef {_template_value(v)} {n};"
        if _template_type(v) == "typename"
        else f"constexpr {_template_type(v)} {n} = {_template_value(v)};"
        for n, v in template
    )
    # same line count: the template line becomes empty, "[[kernel]] void" becomes "__kernel void"
    new_head = ("\n" if template else "") + f"__kernel void {function}(\n"
    text = source[:start] + new_head + ",\n".join(params) + ") { " + bind + "\n"
    text += source[sig_end + len(") {\n") :]
    if _ATTR.search(text):
        raise FrontendError(
            f"{function}: attribute left outside the signature: {_ATTR.search(text)[0]}"
        )
    return text, len(buffers)


def clang_available() -> Optional[str]:
    """None when the front end can run here, else why not."""
    try:
        import clang.cindex as ci  # noqa: F401 - the ``libclang`` wheel (``pip install libclang``)

        ci.Index.create()
    except Exception as e:  # noqa: BLE001 - missing module or shared library
        return f"libclang is not usable here ({type(e).__name__}: {e}); pip install libclang"
    return None


def _shim_dir(root: Path, overrides: Optional[Dict[str, str]] = None) -> Path:
    for name, src in SHIM_FILES.items():
        text = (overrides or {}).get(src) or load_source(src)
        (root / name).write_text(text)
    (root / "metal_math").write_text("#include <metal_stdlib>\n")
    return root


def compile_source(
    label: str,
    function: str,
    source: str,
    template: Sequence[Tuple[str, TemplateArg]],
    include_dir: Path,
) -> Result:
    """Compile one kernel's exact source (``generated_source``) with libclang."""
    import clang.cindex as ci

    res = Result(label, function)
    try:
        text, res.buffers = for_clang(function, source, template)
    except FrontendError as e:
        res.errors.append(Diagnostic("error", 0, function, str(e)))
        return res
    fname = str(include_dir / f"{function}.metal")
    unit = '#include "mlx_preamble.h"\n' + text  # lines of the source: the unit's minus one
    index = ci.Index.create()
    tu = index.parse(
        fname,
        args=[*CLANG_ARGS, "-I", str(include_dir)],
        unsaved_files=[(fname, unit)],
        options=0,
    )
    for d in tu.diagnostics:
        if d.severity < ci.Diagnostic.Warning:
            continue
        f = d.location.file.name if d.location.file else ""
        line = d.location.line - 1 if f == fname else 0
        msg = d.spelling
        if f != fname and f:
            msg = f"{msg} [{Path(f).name}:{d.location.line}]"
        item = Diagnostic(
            "error" if d.severity >= ci.Diagnostic.Error else "warning",
            line,
            Path(f).name or function,
            msg,
        )
        (res.errors if item.severity == "error" else res.warnings).append(item)
    if not res.errors:
        res.threadgroup_bytes = _threadgroup_bytes(tu, function)
        if res.threadgroup_bytes > THREADGROUP_MEMORY:
            res.errors.append(
                Diagnostic(
                    "error",
                    0,
                    function,
                    f"{res.threadgroup_bytes} bytes of threadgroup memory; Metal allows {THREADGROUP_MEMORY}",
                )  # fmt: skip
            )
    return res


def _threadgroup_bytes(tu, function: str) -> int:
    import clang.cindex as ci

    total = 0
    for cur in tu.cursor.walk_preorder():
        if cur.kind == ci.CursorKind.FUNCTION_DECL and cur.spelling == function:
            for c in cur.walk_preorder():
                if c.kind == ci.CursorKind.VAR_DECL and "__local" in c.type.spelling:
                    total += max(c.type.get_size(), 0)
    return total


def check(
    items: Optional[Iterable[Variant]] = None,
    *,
    jobs: int = 2,
    source: str = "mlx",
    shim_overrides: Optional[Dict[str, str]] = None,
    text_overrides: Optional[Dict[str, str]] = None,
) -> List[Result]:
    """Compile every variant's exact Metal source (``variants()`` unless ``items``).

    ``source``: ``"mlx"``: the text MLX itself generates (``mlx_source``), where this MLX can,
    else the port's (``generated_source``); ``"port"``: the port's. ``shim_overrides``: replace a
    shim file's text (tests); ``text_overrides``: ``{"header": ..., "body": ...}`` replace the
    kernels' own text (tests: a deliberately broken prelude; ``{header}`` in it stands for the
    kernel's own header)."""
    why = clang_available()
    if why is not None:
        raise RuntimeError(why)
    items = list(variants() if items is None else items)
    over = text_overrides or {}
    jobs_in = []
    for v in items:
        header = over.get("header")
        if header is not None and "{header}" in header:
            header = header.replace(
                "{header}", K.kernel_text(v.kind, "metal", v.combine_variant)[0]
            )
        body = over.get("body")
        function, text = v.source(header, body)
        origin = "port"
        if source == "mlx":
            generated = mlx_source(v, header, body)
            if generated is not None:
                text, origin = generated, "mlx"
        jobs_in.append((v, function, text, origin))
    with tempfile.TemporaryDirectory(prefix="moeflux-metal-") as tmp:
        inc = _shim_dir(Path(tmp), shim_overrides)

        def one(job) -> Result:
            v, function, text, origin = job
            r = compile_source(v.label, function, text, v.template, inc)
            r.source_from = origin
            return r

        with ThreadPoolExecutor(max(1, jobs)) as pool:
            return list(pool.map(one, jobs_in))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m tests.support.metal_frontend [--quick] [--show LABEL]``: compile every
    Metal kernel variant, print a line per failure and a summary."""
    import argparse
    import time

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one variant per dtype, bit width and kind")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument(
        "--show",
        metavar="SUBSTRING",
        help="print the exact source of the first variant whose label contains it",
    )
    a = p.parse_args(argv)
    items = variants(full=not a.quick)
    if a.show:
        v = next(v for v in items if a.show in v.label)
        print(v.source()[1])
        return 0
    t0 = time.perf_counter()
    results = check(items, jobs=a.jobs)
    bad = [r for r in results if not r.ok]
    for r in bad:
        print(f"FAIL {r.variant} ({r.function})")
        for d in r.errors[:10]:
            print(f"    {d}")
    warned = sum(bool(r.warnings) for r in results)
    tg = max((r.threadgroup_bytes or 0) for r in results)
    from_mlx = sum(r.source_from == "mlx" for r in results)
    print(
        f"{len(results) - len(bad)} of {len(results)} Metal kernel variants compile "
        f"({from_mlx} from the source MLX {mx.__version__} generated, the rest from the port; "
        f"{warned} with warnings; at most {tg} bytes of threadgroup memory) "
        f"in {time.perf_counter() - t0:.1f} s"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

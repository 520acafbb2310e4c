"""The Metal kernels through clang's front end, on any machine (tests/support/metal_frontend.py).

No Apple compiler runs here; clang (the ``libclang`` wheel, in the ``test`` extra) compiles, for
every kernel variant, the exact source ``mx.fast.metal_kernel`` hands Metal's compiler, against a
stand-in for Metal's standard library. These tests check that the rebuilt source is MLX's own,
that every variant compiles, and that the check fails on a deliberately broken prelude.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from moeflux_mlx.compute import kernel_source
from moeflux_mlx.compute import kernels as K
from tests.support import metal_frontend as F


def _clang():
    why = F.clang_available()
    if why is not None:  # the test extra has it; elsewhere try to get it, else say why not
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "libclang"],
            check=False,
            capture_output=True,
            timeout=300,
        )
        why = F.clang_available()
    return why


CLANG_MISSING = _clang()
needs_clang = pytest.mark.skipif(
    CLANG_MISSING is not None, reason=f"no clang front end: {CLANG_MISSING}"
)
PRELUDE = K.load_source("prelude_metal.h")
COMMON = K.load_source("moe_common.h")
QUICK = F.variants(full=False)  # one glu and one down per dtype and bit width


def _errors(results):
    return [str(d) for r in results for d in r.errors]


def test_variants_cover_the_backend():
    items = F.variants()
    labels = [v.label for v in items]
    assert len(labels) == len(set(labels)) > 400
    kinds = {(v.kind, v.dtype) for v in items}
    assert kinds == {(k, d) for k in ("glu", "down", "combine") for d in F.DTYPES}
    bits_groups = {
        (dict(v.template)["BITS"], dict(v.template)["GSZ"]) for v in items if v.kind == "glu"
    }
    assert bits_groups == {(b, g) for b in K.SUPPORTED_BITS for g in K.SUPPORTED_GROUPS}
    # slot indices of one token with K < 8 experts are passed in Metal's constant space
    one = next(v for v in items if v.label == "glu bfloat16 4-bit g64 synth-small T1")
    _, text = one.source()
    assert "  const constant uint32_t* slots [[buffer(4)]],\n" in text
    eight = next(v for v in items if v.label == "glu bfloat16 4-bit g64 synth-small T8")
    assert "  const device uint32_t* slots [[buffer(4)]],\n" in eight.source()[1]


def test_generated_source_is_mlx_layout():
    """The port writes what MLX's write_signature writes (checked against MLX itself below)."""
    v = next(v for v in F.variants() if v.label == "down float16 8-bit g128 qwen3-30b-a3b T1")
    func, text = v.source()
    header, body = map(
        kernel_source.compact, K.kernel_text("down", "metal")
    )  # as the product hands them
    assert text.startswith(header)
    assert func.startswith("custom_kernel_" + K.kernel_name("down", "metal") + "__float16_t_8_128_")
    sig = text[len(header) :].split(") {\n", 1)[0]
    assert sig.startswith("template <typename T, int BITS, int GSZ, int IN_DIM, int OUT_DIM")
    # every input, then its shape/strides/ndim when the body names them, then the output, then
    # the thread-position attributes the body names, in MLX's order
    names = re.findall(r"\s(\w+) \[\[(?:buffer\((\d+)\)|(\w+))\]\]", sig)
    params = [n for n, _, _ in names]
    assert params[:4] == ["hin", "hin_shape", "hin_strides", "hin_ndim"]
    assert params[-5:] == [
        "y",
        "simdgroup_index_in_threadgroup",
        "thread_index_in_simdgroup",
        "thread_position_in_threadgroup",
        "threadgroup_position_in_grid",
    ]
    assert [int(b) for _, b, _ in names if b] == list(range(len(params) - 4))
    assert "const constant int64_t* wd_strides" in sig and "wd_shape" not in sig
    assert text.endswith(f"decltype({func}<float16_t, 8, 128, 768, 2048, 8, 8, 4, 1, 2>) "
                         f"{func}<float16_t, 8, 128, 768, 2048, 8, 8, 4, 1, 2>;\n")  # fmt: skip
    assert body in text


def test_port_matches_what_mlx_generates():
    """MLX >= 0.32 builds a Metal kernel's source without Metal while exporting a function;
    with ``verbose=True`` it prints it. The port must write the very same text, every variant."""
    items = F.variants()
    first = F.mlx_source(items[0])
    if first is None:
        pytest.skip(f"MLX {mx.__version__} cannot build a Metal kernel's source here")
    differ = [v.label for v in items if F.mlx_source(v) != v.source()[1]]
    assert not differ, f"{len(differ)} variants differ from MLX's text, e.g. {differ[:3]}"


@needs_clang
def test_every_variant_compiles():
    results = F.check(F.variants())
    assert _errors(results) == []
    assert [str(d) for r in results for d in r.warnings] == []
    assert all(0 <= r.threadgroup_bytes <= F.THREADGROUP_MEMORY for r in results)
    assert all(r.threadgroup_bytes > 0 for r in results if not r.variant.startswith("combine"))
    assert all(r.buffers <= F.MAX_BUFFERS for r in results)
    # DeepSeek-V3 at 8 bits stages 7168 fp32 values + one sum per 16-byte chunk: 30464 bytes
    assert max(r.threadgroup_bytes for r in results) == 4 * (7168 + 7168 * 8 // 128)
    if F.mlx_source(QUICK[0]) is not None:
        assert all(r.source_from == "mlx" for r in results)


BROKEN = {
    # (what is broken, the header, the body, a fragment clang's message must contain)
    "a macro the body needs is missing": (
        PRELUDE.replace("#define MF_FMA(a, b, c) metal::fma((a), (b), (c))\n", "") + COMMON,
        None,
        "undeclared identifier 'MF_FMA'",
    ),
    "a static data member outside the constant space (the bug this check found)": (
        PRELUDE
        + COMMON.replace(
            "template <> struct MfChunk<4> {",
            "template <> struct MfChunk<4> {\n  static constexpr int NX = 8;",
        ),
        None,
        "program scope variable must reside in constant address space",
    ),
    "threadgroup memory handed over as thread memory": (
        PRELUDE.replace("#define MF_TG threadgroup", "#define MF_TG thread") + COMMON,
        None,
        "no matching function for call to 'mf_stage'",
    ),
    "a 16-byte load from the wrong address space": (
        PRELUDE.replace("const device uint4*", "const threadgroup uint4*") + COMMON,
        None,
        "reinterpret_cast from",
    ),
    "a syntax error": (
        PRELUDE.replace("using namespace metal;", "using namespace metal") + COMMON,
        None,
        "expected ';'",
    ),
    "a template error": (
        PRELUDE + COMMON.replace("return mf_tof(mf_cvt<U>(v));", "return mf_tof(mf_cvt<U, U>(v));"),
        None,
        "no matching function for call to 'mf_cvt'",
    ),
    "as_type between types of different sizes": (
        PRELUDE.replace("as_type<float>(u)", "as_type<half>(u)") + COMMON,
        None,
        "as_type: the two types differ in size",
    ),
    "a shuffle of a type Metal does not shuffle": (
        PRELUDE.replace("simd_shuffle_xor((v), (ushort)(m))", "simd_shuffle_xor((long)(v), (ushort)(m))") + COMMON,
        None,
        "not a type Metal shuffles",
    ),
    "a CUDA name in the Metal dialect": (
        PRELUDE.replace("threadgroup_barrier(mem_flags::mem_threadgroup)", "__syncthreads()") + COMMON,
        None,
        "__syncthreads",
    ),
    "an entry naming an attribute MLX does not declare": (
        None,
        K.kernel_text("glu", "metal")[1].replace("int(thread_index_in_simdgroup)", "int(thread_lane_in_simdgroup)"),
        "thread_lane_in_simdgroup",
    ),
}  # fmt: skip


@needs_clang
@pytest.mark.parametrize("what", list(BROKEN))
def test_a_broken_prelude_fails(what):
    header, body, fragment = BROKEN[what]
    items = [v for v in QUICK if v.kind == "glu"][:2]
    over = {k: v for k, v in (("header", header), ("body", body)) if v is not None}
    results = F.check(items, text_overrides=over)
    assert all(not r.ok for r in results), what
    assert any(fragment in e for e in _errors(results)), (what, _errors(results)[:5])


@needs_clang
def test_errors_point_at_the_exact_source():
    v = QUICK[0]
    body = K.kernel_text(v.kind, "metal")[1] + "  float4 mf_oops = 1; int mf_bad = mf_oops;\n"
    (r,) = F.check([v], text_overrides={"body": body})
    (err,) = r.errors
    _, text = v.source(body=body)
    assert "mf_bad = mf_oops" in text.splitlines()[err.line - 1]


def test_signature_checks():
    v = QUICK[0]
    func, text = v.source()
    out, buffers = F.for_clang(func, text, v.template)
    assert out.count("\n") == text.count("\n") and "[[" not in out and buffers == 21
    assert (
        "__kernel void " + func + "(" in out
        and "typedef float16_t T; constexpr int BITS = 4;" in out
    )
    with pytest.raises(F.FrontendError, match="unknown attribute"):
        F.for_clang(
            func, text.replace("[[simdgroup_index_in_threadgroup]]", "[[lane_id]]"), v.template
        )
    with pytest.raises(F.FrontendError, match="not MLX's"):
        F.for_clang(
            func,
            text.replace(
                "  uint3 thread_position_in_threadgroup ", "  uint thread_position_in_threadgroup "
            ),
            v.template,
        )
    with pytest.raises(F.FrontendError, match="buffer indices"):
        F.for_clang(func, text.replace("[[buffer(3)]]", "[[buffer(33)]]"), v.template)
    with pytest.raises(F.FrontendError, match="explicit instantiation"):
        F.for_clang(func, text, (*v.template[:-1], ("RPW", 99)))
    many = "".join(f"  const device float* b{i} [[buffer({i})]],\n" for i in range(32))
    fake = f"[[kernel]] void k(\n{many}  device float* o [[buffer(32)]]) {{\n}}\n"
    with pytest.raises(F.FrontendError, match="Metal allows 31"):
        F.for_clang("k", fake, ())


MLX_METAL = Path(mx.__file__).parent / "include" / "mlx" / "backend" / "metal" / "kernels"


@pytest.mark.skipif(
    not (MLX_METAL / "utils.h").is_file(), reason="MLX's Metal headers not installed"
)
def test_preamble_shim_matches_installed_mlx():
    """The preamble shim says what MLX's own preamble says about the 16-bit types, and nothing
    the kernels define is also defined in MLX's preamble (it comes before our header)."""
    assert "typedef bfloat bfloat16_t;" in (MLX_METAL / "bf16.h").read_text()
    assert "typedef half float16_t;" in (MLX_METAL / "utils.h").read_text()
    shim = K.load_source("mlx_preamble_shim.h")
    assert "typedef bfloat bfloat16_t;" in shim and "typedef half float16_t;" in shim
    ours = set()
    for kind, variant in (("glu", "plain"), ("down", "plain"), ("combine", "gated")):
        header, body = K.kernel_text(kind, "metal", variant)
        ours |= set(re.findall(r"\b(MF_\w+|mf_\w+|Mf\w+)\b", header + body))
    preamble = "".join(
        (MLX_METAL / f).read_text()
        for f in ("utils.h", "bf16.h", "bf16_math.h", "complex.h", "defines.h", "logging.h")
    )
    theirs = set(re.findall(r"\b\w+\b", preamble))
    assert not ours & theirs


def test_shims_ship_as_kernel_sources():
    for name in kernel_source.METAL_SHIMS:
        assert name in kernel_source.SOURCE_FILES and len(K.load_source(name)) > 100

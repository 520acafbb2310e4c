"""The byte layout of one expert blob, derived from a checkpoint's own tensors.

An MoE layer's experts are stored stacked, e.g. ``switch_mlp.gate_proj.weight`` of shape
``[E, out, in_packed]``. One expert's slice of every such tensor, laid end to end in a fixed
order, is the expert's *blob*; ``packed_experts/layer_NN.bin`` holds blob ``e`` at ``e * blob_size``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..errors import CheckpointError, LayoutError, UnsupportedQuantizationError

FORMAT_VERSION = 1
ALIGNMENT = 64  # bytes; every component starts aligned, so typed views and vector loads are legal

# Projection order inside a blob: SwitchGLU's, then SwitchMLP's.
GLU_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
MLP_PROJECTIONS = ("fc1", "fc2")
PROJECTIONS = GLU_PROJECTIONS + MLP_PROJECTIONS
# weight; quantization scales and biases; the linear bias (gpt-oss); nvfp4's per-expert scale
PARAMS = ("weight", "scales", "biases", "bias", "global_scale")

# safetensors dtype name -> numpy dtype name (bf16 has no numpy dtype; it travels as raw bytes)
DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}
# what mx.quantize accepts (MLX 0.32): affine bits and group sizes; each float mode has one pair
SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 8)
SUPPORTED_GROUPS = (32, 64, 128)
SUPPORTED_MODES = ("affine", "mxfp4", "mxfp8", "nvfp4")
FLOAT_MODES = {"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}  # mode -> (bits, group)


@dataclass(frozen=True)
class Component:
    """One expert's slice of one stacked tensor, e.g. ``gate_proj.weight``."""

    name: str  # "<projection>.<param>"
    dtype: str  # safetensors dtype name: "U32", "BF16", ...
    shape: Tuple[int, ...]  # per-expert shape (the stacked tensor's shape without the E axis)
    offset: int  # byte offset inside the blob
    nbytes: int

    @property
    def projection(self) -> str:
        return self.name.split(".")[0]

    @property
    def param(self) -> str:
        return self.name.split(".")[1]


@dataclass(frozen=True)
class Quantization:
    bits: int
    group_size: int
    mode: str = "affine"


@dataclass(frozen=True)
class ExpertLayout:
    """Everything needed to find and interpret one expert inside a layer file."""

    num_experts: int
    components: Tuple[Component, ...]
    blob_size: int
    quantization: Optional[Quantization]  # of gate/up (fc1); None: experts are not quantized
    # projections quantized otherwise: a Quantization, or None where that projection is not
    # quantized
    overrides: Dict[str, Optional[Quantization]] = field(default_factory=dict)

    def quant(self, projection: str) -> Optional[Quantization]:
        return self.overrides.get(projection, self.quantization)

    def component(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(name)

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(c.name for c in self.components)

    @property
    def projections(self) -> Tuple[str, ...]:
        seen = []
        for c in self.components:
            if c.projection not in seen:
                seen.append(c.projection)
        return tuple(seen)

    @property
    def layer_bytes(self) -> int:
        return self.num_experts * self.blob_size

    @classmethod
    def from_tensors(
        cls,
        tensors: Dict[str, Tuple[str, Sequence[int]]],
        quantization: Optional[Quantization],
        overrides: Optional[Dict[str, Optional[Quantization]]] = None,
        where: str = "",
    ) -> ExpertLayout:
        """Build from ``{"gate_proj.weight": (dtype, stacked_shape), ...}`` of one layer."""
        unknown = [n for n in tensors if _sort_key(n) is None]
        if unknown:
            raise LayoutError(f"{where}: unexpected expert tensors {sorted(unknown)}")
        names = sorted(tensors, key=_sort_key)
        num_experts = {int(tensors[n][1][0]) for n in names}
        if len(num_experts) != 1:
            raise LayoutError(
                f"{where}: expert tensors disagree on the number of experts: "
                f"{ {n: tuple(tensors[n][1]) for n in names} }"
            )
        comps, offset = [], 0
        for n in names:
            dtype, shape = tensors[n]
            if dtype not in DTYPE_SIZES:
                raise LayoutError(f"{where}: tensor {n} has unsupported dtype {dtype}")
            per_expert = tuple(int(s) for s in shape[1:])
            nbytes = DTYPE_SIZES[dtype] * math.prod(per_expert)
            offset = _align(offset)
            comps.append(Component(n, dtype, per_expert, offset, nbytes))
            offset += nbytes
        layout = cls(
            num_experts.pop(), tuple(comps), _align(offset), quantization, dict(overrides or {})
        )
        layout.validate(where)
        return layout

    def validate(self, where: str = "") -> None:
        if self.num_experts < 1 or self.blob_size < 1:
            raise LayoutError(f"{where}: {self.num_experts} experts of {self.blob_size} bytes")
        names = self.names
        if len(set(names)) != len(names):
            raise LayoutError(f"{where}: duplicate expert components {sorted(names)}")
        for c in self.components:
            if _sort_key(c.name) is None or c.dtype not in DTYPE_SIZES:
                raise LayoutError(f"{where}: unknown expert component {c.name} ({c.dtype})")
            if c.nbytes != DTYPE_SIZES[c.dtype] * math.prod(c.shape) or c.offset < 0:
                raise LayoutError(
                    f"{where}: component {c.name} has {c.nbytes} bytes at offset "
                    f"{c.offset}, which does not match {c.dtype}{list(c.shape)}"
                )
        projs = set(self.projections)
        if projs not in (set(GLU_PROJECTIONS), set(MLP_PROJECTIONS)):
            raise LayoutError(
                f"{where}: expert projections {sorted(projs)} are neither "
                "SwitchGLU's (gate/up/down) nor SwitchMLP's (fc1/fc2)"
            )
        unknown = set(self.overrides) - projs
        if unknown:
            raise LayoutError(f"{where}: quantization given for unknown projections {unknown}")
        for p in self.projections:
            if f"{p}.weight" not in self.names:
                raise LayoutError(f"{where}: {p} has no weight")
            self._validate_quantization(p, where)
        for c in self.components:
            if c.offset % ALIGNMENT or c.offset + c.nbytes > self.blob_size:
                raise LayoutError(f"{where}: component {c.name} lies outside its blob")

    def _validate_quantization(self, p: str, where: str) -> None:
        q = self.quant(p)
        w = self.component(f"{p}.weight")
        has_scales = f"{p}.scales" in self.names
        if f"{p}.global_scale" in self.names and (q is None or q.mode != "nvfp4"):
            raise UnsupportedQuantizationError(
                f"{where}: {p} has a global_scale, which only nvfp4 quantization uses"
            )
        if q is None:
            if has_scales or f"{p}.biases" in self.names:
                raise UnsupportedQuantizationError(
                    f"{where}: {p} has scales but no quantization is configured"
                )
            return
        if q.mode not in SUPPORTED_MODES:
            raise UnsupportedQuantizationError(
                f"{where}: {p}: unsupported quantization mode {q.mode!r} "
                f"(supported: {', '.join(SUPPORTED_MODES)})"
            )
        if q.mode in FLOAT_MODES and (q.bits, q.group_size) != FLOAT_MODES[q.mode]:
            bits, group = FLOAT_MODES[q.mode]
            raise UnsupportedQuantizationError(
                f"{where}: {p}: {q.mode} takes {bits} bits in groups of {group}, "
                f"not bits {q.bits} group size {q.group_size}"
            )
        if q.bits not in SUPPORTED_BITS:
            raise UnsupportedQuantizationError(
                f"{where}: {p}: unsupported quantization bits {q.bits} (supported: {SUPPORTED_BITS})"
            )
        if q.mode == "affine" and q.group_size not in SUPPORTED_GROUPS:
            raise UnsupportedQuantizationError(
                f"{where}: {p}: unsupported quantization group size {q.group_size}"
            )
        if not has_scales or w.dtype != "U32":
            raise UnsupportedQuantizationError(
                f"{where}: {p} is not quantized like the config says ({q.bits}-bit, group {q.group_size})"
            )
        s = self.component(f"{p}.scales")
        if s.shape[-1] * q.group_size != w.shape[-1] * 32 // q.bits or s.shape[:-1] != w.shape[:-1]:
            raise UnsupportedQuantizationError(
                f"{where}: {p} weight/scales shapes {w.shape}/{s.shape} do not match "
                f"{q.bits}-bit group {q.group_size} quantization"
            )
        if (q.mode == "affine") != (f"{p}.biases" in self.names):
            raise UnsupportedQuantizationError(
                f"{where}: {p}: {q.mode} quantization "
                f"{'needs' if q.mode == 'affine' else 'has no'} biases"
            )

    def to_dict(self) -> dict:
        d = asdict(self)
        if not self.overrides:
            d.pop("overrides")
        d["components"] = [dict(asdict(c), shape=list(c.shape)) for c in self.components]
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "") -> ExpertLayout:
        try:

            def quant(q):
                return Quantization(
                    int(q["bits"]), int(q["group_size"]), str(q.get("mode", "affine"))
                )

            q = d.get("quantization")
            layout = cls(
                num_experts=int(d["num_experts"]),
                components=tuple(
                    Component(
                        str(c["name"]),
                        str(c["dtype"]),
                        tuple(int(s) for s in c["shape"]),
                        int(c["offset"]),
                        int(c["nbytes"]),
                    )
                    for c in d["components"]
                ),
                blob_size=int(d["blob_size"]),
                quantization=quant(q) if q else None,
                overrides={p: quant(o) if o else None for p, o in d.get("overrides", {}).items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise LayoutError(f"{where}: malformed expert layout ({type(e).__name__}: {e})") from e
        layout.validate(where)
        return layout

    def split_blobs(self, blobs: np.ndarray) -> Dict[str, np.ndarray]:
        """View ``[n, blob_size]`` uint8 as per-component ``[n, *shape]`` byte arrays."""
        return {c.name: blobs[:, c.offset : c.offset + c.nbytes] for c in self.components}

    def shard(self, cuts: Mapping[str, Tuple[int, int, int]], where: str = "") -> ExpertShard:
        """One part of every expert: what one process of a tensor-parallel group keeps.

        Args:
            cuts: component name -> ``(axis, part, parts)``: keep part ``part`` of ``parts``
                equal parts along ``axis`` of the component's per-expert shape, 0 (rows) or -1
                (the last axis: a weight's input columns); components not named stay whole.
            where: for messages.

        Returns:
            The part's layout and where its bytes lie in the full blob.

        Raises:
            LayoutError: an axis that does not split into ``parts`` equal parts, or another
                axis than the first or the last.
            UnsupportedQuantizationError: a quantized projection cut inside a quantization group.
        """
        tensors: Dict[str, Tuple[str, Sequence[int]]] = {}
        runs: Dict[str, Tuple[int, int, int, int]] = {}
        for c in self.components:
            shape, size = list(c.shape), DTYPE_SIZES[c.dtype]
            runs[c.name] = (c.offset, c.nbytes, 1, 0)
            if c.name in cuts:
                axis, part, parts = cuts[c.name]
                ax = axis % len(shape) if shape else None
                if ax not in (0, len(shape) - 1) or not 0 <= part < parts or shape[ax] % parts:
                    raise LayoutError(
                        f"{where}: {c.name} {shape} cannot be cut into {parts} equal parts "
                        f"along axis {axis} (part {part})"
                    )
                n = shape[ax] // parts
                if ax == 0:
                    row = size * math.prod(shape[1:])
                    runs[c.name] = (c.offset + part * n * row, n * row, 1, 0)
                else:  # the last axis: one run per row, a row apart
                    runs[c.name] = (
                        c.offset + part * n * size,
                        n * size,
                        math.prod(shape[:-1]),
                        shape[-1] * size,
                    )
                    self._check_groups(c, n, parts, where)
                shape[ax] = n
            tensors[c.name] = (c.dtype, (self.num_experts, *shape))
        layout = ExpertLayout.from_tensors(tensors, self.quantization, self.overrides, where)
        spans = tuple(
            Span(src, layout.component(name).offset, nbytes, count, stride)
            for name, (src, nbytes, count, stride) in runs.items()
        )
        return ExpertShard(layout, spans)

    def _check_groups(self, c: Component, n: int, parts: int, where: str) -> None:
        """A quantized weight cut along its input columns must be cut between groups: each
        group's scale and bias then belong to the part that holds its columns."""
        q = self.quant(c.projection)
        if q is None or c.param != "weight" or (n * 32) % (q.bits * q.group_size) == 0:
            return
        raise UnsupportedQuantizationError(
            f"{where}: {c.projection}'s {c.shape[-1] * 32 // q.bits} input columns "
            f"({q.bits}-bit, groups of {q.group_size}) cannot be cut into {parts} parts "
            "at quantization group boundaries"
        )


@dataclass(frozen=True)
class Span:
    """Bytes of a full expert blob that a part keeps: ``count`` runs of ``nbytes`` bytes, the
    first at blob offset ``src`` and each ``stride`` bytes after the one before, laid end to
    end from offset ``dst`` of the part's blob."""

    src: int
    dst: int
    nbytes: int
    count: int = 1
    stride: int = 0

    @property
    def end(self) -> int:
        """One past the last byte of the full blob the span reads."""
        return self.src + (self.count - 1) * self.stride + self.nbytes


@dataclass(frozen=True)
class ExpertShard:
    """One part of every expert of a layer (``ExpertLayout.shard``): its layout, and the
    spans of the full blob its bytes come from, in component order."""

    layout: ExpertLayout
    spans: Tuple[Span, ...]


@dataclass(frozen=True)
class ModelLayout:
    """The layouts of every MoE layer of a model, keyed by decoder-layer index."""

    layers: Dict[int, ExpertLayout]
    module_paths: Dict[int, str]  # layer -> the SwitchGLU's path in the mlx-lm model

    @property
    def total_expert_bytes(self) -> int:
        return sum(lay.layer_bytes for lay in self.layers.values())

    def to_dict(self) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "layers": {
                str(i): dict(lay.to_dict(), module_path=self.module_paths[i])
                for i, lay in sorted(self.layers.items())
            },
        }

    @classmethod
    def from_dict(cls, d: dict, where: str = "layout") -> ModelLayout:
        if not isinstance(d, dict) or d.get("format_version") != FORMAT_VERSION:
            got = d.get("format_version") if isinstance(d, dict) else type(d).__name__
            raise LayoutError(
                f"{where}: format_version {got!r} is not {FORMAT_VERSION} "
                "(converted by another moeflux-mlx version? convert again)"
            )
        try:
            items = d["layers"].items()
            layers = {int(k): ExpertLayout.from_dict(v, f"{where}: layer {k}") for k, v in items}
            paths = {int(k): str(v["module_path"]) for k, v in items}
        except CheckpointError:  # LayoutError, UnsupportedQuantizationError of one layer
            raise
        except (KeyError, AttributeError, ValueError, TypeError) as e:
            raise LayoutError(f"{where}: malformed layout ({type(e).__name__}: {e})") from e
        if not layers:
            raise LayoutError(f"{where}: no MoE layers")
        return cls(layers, paths)

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: Path) -> ModelLayout:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise LayoutError(
                f"{path}: missing; the directory is not a complete conversion (convert it again)"
            ) from e
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
            raise LayoutError(f"{path}: unreadable layout ({e})") from e
        return cls.from_dict(d, str(path))


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _sort_key(name: str):
    parts = name.split(".")
    if len(parts) != 2 or parts[0] not in PROJECTIONS or parts[1] not in PARAMS:
        return None
    return PROJECTIONS.index(parts[0]), PARAMS.index(parts[1])


def layer_file_name(layer: int) -> str:
    return f"layer_{layer:02d}.bin"

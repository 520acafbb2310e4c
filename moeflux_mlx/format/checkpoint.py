"""Find the routed experts of an mlx-lm checkpoint (from safetensors headers only) or of a
converted (packed) directory, and describe them with one ``ExpertLayout`` per MoE layer.

Experts are found by what they are, not by what a model calls them: mlx-lm stores each MoE
layer's routed experts as a ``SwitchGLU`` (``gate_proj`` / ``up_proj`` / ``down_proj``) or a
``SwitchMLP`` (``fc1`` / ``fc2``) whose weights are stacked, ``[num_experts, out, in]``, under
whatever name the architecture gives the module (``switch_mlp``, ``experts``, ``switch_glu``,
...). ``find_stacked_experts`` finds every such module in a header; ``model/experts.py`` finds
the same modules in the model mlx-lm builds, and the loader checks that both agree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Mapping, Optional, Sequence

from ..errors import CheckpointError, LayoutError, UnsupportedQuantizationError
from .layout import (
    FORMAT_VERSION,
    GLU_PROJECTIONS,
    MLP_PROJECTIONS,
    ExpertLayout,
    ModelLayout,
    Quantization,
    layer_file_name,
)
from .safetensors import TensorRange, index_directory

# A tensor of a SwitchGLU / SwitchMLP projection, by name only: "<module>.<projection>.<param>".
# Whether it is a routed expert is decided by its shape (stacked: 3-D weights) in
# find_stacked_experts; a dense MLP's gate_proj.weight matches this too.
EXPERT_KEY = re.compile(
    r"^(?P<module>.+)\.(?P<component>(?P<projection>gate_proj|up_proj|down_proj|fc1|fc2)\."
    r"(?P<param>weight|scales|biases|bias|global_scale))$"
)
# One tensor per expert, as Hugging Face checkpoints store them (mlx-lm stacks them at load)
UNSTACKED_KEY = re.compile(r"(?:^|\.)experts\.\d+\.")
# Hugging Face's fused expert tensors (gpt-oss, Llama 4), which mlx-lm's sanitize splits
FUSED_KEY = re.compile(r"(?:^|\.)experts\.gate_up_proj(?:_blocks|_scales|_bias)?$")
# Architectures whose mlx-lm model keeps every expert a module of its own (no SwitchGLU):
# nothing is stacked, in the files or in the model (tests/test_architectures.py checks this
# against mlx-lm's classes).
SEPARATE_EXPERTS = ("dbrx",)
LAYER_NUMBER = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")
PACKED_DIR = "packed_experts"
LAYOUT_FILE = "layout.json"
MOEFLUX_CONFIG_KEY = "moeflux"


@dataclass
class CheckpointExperts:
    """Where the experts of a plain mlx-lm checkpoint lie, tensor by tensor."""

    path: Path
    config: dict
    layout: ModelLayout
    ranges: Dict[int, Dict[str, TensorRange]]  # layer -> component name -> stacked tensor
    dense: Dict[str, TensorRange]  # every tensor that is not a routed expert


def read_config(path: Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(
            f"{path}: {'not a directory' if path.exists() else 'no such directory'}"
        )
    try:
        from mlx_lm.utils import load_config  # here: the miss server process never needs it

        config = load_config(path)
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: no config.json; not an mlx-lm checkpoint") from e
    except PermissionError as e:
        raise CheckpointError(f"{path / 'config.json'}: not readable ({e.strerror})") from e
    except (OSError, ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{path / 'config.json'}: unreadable ({e})") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{path / 'config.json'}: not a JSON object")
    return config


def is_packed(path: Path) -> bool:
    return (Path(path) / PACKED_DIR / LAYOUT_FILE).exists()


def looks_converted(path: Path, config: Optional[dict] = None) -> bool:
    """A converted directory, even one whose ``layout.json`` was lost."""
    path = Path(path)
    if is_packed(path) or (path / PACKED_DIR).is_dir():
        return True
    return isinstance(config, dict) and MOEFLUX_CONFIG_KEY in config


def layer_of(module_path: str) -> Optional[int]:
    """The decoder layer of a module path: its last number (``model.layers.3.mlp.experts`` -> 3,
    ``transformer.h.0.moe.switch_mlp`` -> 0); None where it has none."""
    numbers = LAYER_NUMBER.findall(module_path)
    return int(numbers[-1]) if numbers else None


def find_stacked_experts(shapes: Mapping[str, Sequence[int]]) -> Dict[str, Dict[str, str]]:
    """The stacked expert modules among tensors ``{name: shape}``: ``{module path: {component:
    tensor name}}``. A module is one when its projections are exactly SwitchGLU's or SwitchMLP's
    and every one of its tensors is stacked over the same number of experts (weights 3-D)."""
    groups: Dict[str, Dict[str, str]] = {}
    for name in shapes:
        m = EXPERT_KEY.match(name)
        if m is not None:
            groups.setdefault(m["module"], {})[m["component"]] = name
    out = {}
    for module, comps in groups.items():
        projections = {c.split(".")[0] for c in comps}
        if projections not in (set(GLU_PROJECTIONS), set(MLP_PROJECTIONS)):
            continue
        weights = [shapes[comps[f"{p}.weight"]] for p in projections if f"{p}.weight" in comps]
        if len(weights) != len(projections) or any(len(w) != 3 for w in weights):
            continue  # a dense MLP (2-D weights), or not a whole expert module
        experts = {int(shapes[n][0]) if len(shapes[n]) else -1 for n in comps.values()}
        if len(experts) == 1:
            out[module] = comps
    return out


def _legacy_quantization(config: dict) -> Optional[dict]:
    """The ``quantization`` dict mlx-lm's ``load_model`` uses: ``config["quantization"]``, else
    what it derives from a ``quantization_config`` (its own or its ``text_config``'s)."""
    q = config.get("quantization")
    if q is not None:
        return q if isinstance(q, dict) else None
    qc = config.get("quantization_config")
    if qc is None:
        qc = (config.get("text_config") or {}).get("quantization_config")
    if not isinstance(qc, dict):
        return None
    method = qc.get("quant_method")
    if method is None and "bits" in qc:  # mlx-lm writes both keys; be lenient with one
        return qc
    if method == "mxfp4":
        return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    if method == "mxfp8" or (
        method == "fp8"
        and qc.get("scale_fmt") == "ue8m0"
        and list(qc.get("weight_block_size", ())) == [32, 32]
    ):
        return {"group_size": 32, "bits": 8, "mode": "mxfp8"}
    if method == "compressed-tensors":
        fmt = qc.get("format")
        table = {
            "nvfp4-pack-quantized": {"group_size": 16, "bits": 4, "mode": "nvfp4"},
            "mxfp4-pack-quantized": {"group_size": 32, "bits": 4, "mode": "mxfp4"},
            "pack-quantized": {"group_size": 32, "bits": 4, "mode": "affine"},
        }
        return table.get(fmt) if isinstance(fmt, str) else None
    if method == "modelopt":
        settings = qc.get("quantization", qc)
        if settings.get("quant_algo") == "NVFP4":
            return {"group_size": settings.get("group_size", 16), "bits": 4, "mode": "nvfp4"}
    return None


def _infer_quantization(
    comps: Dict[str, TensorRange], proj: str, in_dims: int, where: str
) -> Quantization:
    """mlx-lm's ``infer_quant_config``: group size and bits from the shapes, the mode from the
    scales' dtype (only affine keeps them in the weights' float type)."""
    w, s = comps[f"{proj}.weight"], comps[f"{proj}.scales"]
    if in_dims <= 0 or not s.shape or s.shape[-1] <= 0:
        raise UnsupportedQuantizationError(f"{where}: {proj} has malformed scales {s.shape}")
    group_size = in_dims // s.shape[-1]
    bits = w.shape[-1] * 32 // in_dims
    if s.dtype != "U8":
        return Quantization(bits, group_size, "affine")
    modes = {(4, 16): "nvfp4", (4, 32): "mxfp4", (8, 32): "mxfp8"}
    if (bits, group_size) not in modes:
        raise UnsupportedQuantizationError(
            f"{where}: cannot tell the quantization mode of {proj}: {bits} bits with group "
            f"size {group_size} and uint8 scales"
        )
    return Quantization(bits, group_size, modes[(bits, group_size)])


def _quantization_for(
    q: Optional[dict],
    module_path: str,
    proj: str,
    comps: Dict[str, TensorRange],
    in_dims: int,
    where: str,
) -> Optional[Quantization]:
    """The quantization mlx-lm's loader gives ``module_path.proj``: its own entry in the
    config's ``quantization`` (a dict, or True for the top-level values), else, where the
    tensor has scales, what its shapes say (mlx-lm's ``infer_quant_config``)."""
    has_scales = f"{proj}.scales" in comps
    if q is None:
        if has_scales:
            raise UnsupportedQuantizationError(
                f"{where}: {proj} has scales but config.json has no quantization for it"
            )
        return None
    path = f"{module_path}.{proj}"
    if path in q:
        entry = q[path]
        if not entry:
            if has_scales:
                raise UnsupportedQuantizationError(
                    f"{where}: {proj} has scales but config.json says {path} is not quantized"
                )
            return None
        try:
            if isinstance(entry, dict):  # what SwitchLinear.to_quantized gets: its defaults
                return Quantization(
                    int(entry.get("bits", 4)),
                    int(entry.get("group_size", 64)),
                    str(entry.get("mode", "affine")),
                )
            return Quantization(int(q["bits"]), int(q["group_size"]), str(q.get("mode", "affine")))
        except (TypeError, ValueError, KeyError) as e:
            raise UnsupportedQuantizationError(
                f"{where}: config.json: quantization of {path} is not understood ({entry!r})"
            ) from e
    if not has_scales:
        return None  # the config's default does not apply to an unquantized tensor
    return _infer_quantization(comps, proj, in_dims, where)


def _in_dims(comps: Dict[str, TensorRange], proj: str) -> int:
    """A projection's input size, from the other projection's output size: gate/up read what
    down writes (hidden), down reads what gate writes (intermediate); likewise fc1 / fc2."""
    other = {"gate_proj": "down_proj", "up_proj": "down_proj", "down_proj": "gate_proj"}.get(
        proj, "fc2" if proj == "fc1" else "fc1"
    )
    return int(comps[f"{other}.weight"].shape[1])


def check_architecture(config: dict, where: object) -> None:
    """Refuse, in one line, a ``model_type`` that this mlx-lm cannot build."""
    from mlx_lm.utils import MODEL_ARCHITECTURE_REMAPPING, MODEL_REMAPPING  # see read_config

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise CheckpointError(f"{where}: config.json has no model_type; not an mlx-lm checkpoint")
    if config.get("model_file"):
        return  # custom model code: mlx-lm builds it (with trust_remote_code)
    archs = config.get("architectures") or ()
    archs = (archs,) if isinstance(archs, str) else archs
    remapped = next(
        (
            MODEL_ARCHITECTURE_REMAPPING[(model_type, a)]
            for a in archs
            if (model_type, a) in MODEL_ARCHITECTURE_REMAPPING
        ),
        MODEL_REMAPPING.get(model_type, model_type),
    )
    import importlib.util

    try:
        found = importlib.util.find_spec(f"mlx_lm.models.{remapped}") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        import mlx_lm

        raise CheckpointError(
            f"{where}: model_type {model_type!r} is an architecture mlx-lm "
            f"{getattr(mlx_lm, '__version__', '')} cannot load (no mlx_lm.models.{remapped}); "
            "upgrade mlx-lm, or use a model it supports"
        )


def _no_experts(path: Path, config: dict, tensors: Mapping[str, TensorRange]) -> CheckpointError:
    """Why a checkpoint has no stacked experts, in one line, with what to do."""
    model_type = config.get("model_type")
    unstacked = next((n for n in tensors if UNSTACKED_KEY.search(n)), None)
    if model_type in SEPARATE_EXPERTS:
        return CheckpointError(
            f"{path}: mlx-lm's {model_type} keeps every expert a module of its own (no stacked "
            "SwitchGLU), so there is nothing to stream; use mlx_lm.load"
        )
    if unstacked is not None:
        return CheckpointError(
            f"{path}: experts are stored one tensor per expert ({unstacked}), as in Hugging "
            "Face checkpoints; mlx-lm stacks them only when it loads. Convert the checkpoint "
            "once with mlx_lm.convert (--hf-path SRC --mlx-path DST, -q to quantize)"
        )
    fused = next((n for n in tensors if FUSED_KEY.search(n)), None)
    if fused is not None:
        return CheckpointError(
            f"{path}: experts are stored in the Hugging Face layout ({fused}), which mlx-lm "
            "rearranges only when it loads. Convert the checkpoint once with mlx_lm.convert "
            "(--hf-path SRC --mlx-path DST)"
        )
    return CheckpointError(
        f"{path}: no routed experts (no stacked SwitchGLU / SwitchMLP tensors); model_type "
        f"{model_type!r} is not an MoE checkpoint (a dense model: use mlx_lm.load)"
    )


def scan_checkpoint(path: Path) -> CheckpointExperts:
    """Index a plain mlx-lm checkpoint directory. Reads headers only.

    Raises:
        CheckpointError: not an mlx-lm MoE checkpoint with stacked experts (each case says
            which: no MoE layer, experts unstacked or in Hugging Face's layout, an architecture
            mlx-lm cannot load), or a converted directory without its layout (``LayoutError``).
        UnsupportedQuantizationError: expert quantization that mlx-lm would not load.
    """
    path = Path(path)
    config = read_config(path)
    if looks_converted(path, config):
        # a converted directory that lost its layout.json would otherwise read as "not MoE"
        raise LayoutError(
            f"{path / PACKED_DIR / LAYOUT_FILE}: missing; {path} is a converted "
            "moeflux directory without its layout (convert it again)"
        )
    check_architecture(config, path)
    tensors = index_directory(path)
    stacked = find_stacked_experts({n: r.shape for n, r in tensors.items()})
    if not stacked:
        raise _no_experts(path, config, tensors)
    modules: Dict[int, str] = {}
    found: Dict[int, Dict[str, TensorRange]] = {}
    for module, comps in sorted(stacked.items()):
        layer = layer_of(module)
        if layer is None:
            raise CheckpointError(f"{path}: cannot tell the decoder layer of experts {module}")
        if layer in modules:
            raise CheckpointError(
                f"{path}: layer {layer} has two expert modules ({modules[layer]}, {module})"
            )
        modules[layer] = module
        found[layer] = {c: tensors[n] for c, n in comps.items()}
    expert_names = {n for comps in stacked.values() for n in comps.values()}
    dense = {n: r for n, r in tensors.items() if n not in expert_names}
    q = _legacy_quantization(config)
    layers = {}
    for layer, ranges in sorted(found.items()):
        where = f"{path}: layer {layer}"
        projections = sorted({c.split(".")[0] for c in ranges})
        quant = {
            p: _quantization_for(q, modules[layer], p, ranges, _in_dims(ranges, p), where)
            for p in projections
        }
        main = quant.get("gate_proj", quant.get("fc1"))
        overrides = {p: qp for p, qp in quant.items() if qp != main}  # None: unquantized
        layers[layer] = ExpertLayout.from_tensors(
            {c: (r.dtype, r.shape) for c, r in ranges.items()}, main, overrides, where
        )
    return CheckpointExperts(path, config, ModelLayout(layers, modules), found, dense)


def packed_layout(path: Path) -> ModelLayout:
    return ModelLayout.load(Path(path) / PACKED_DIR / LAYOUT_FILE)


def expert_layout(path: Path) -> ModelLayout:
    """The expert layout of a converted directory or of a plain mlx-lm checkpoint."""
    return packed_layout(path) if is_packed(path) else scan_checkpoint(path).layout


def check_packed(path: Path) -> ModelLayout:
    """Open-time checks of a converted directory, headers and sizes only: config.json readable,
    its ``moeflux`` section consistent with ``layout.json``, the dense safetensors intact.

    Returns the layout. (The layer files are checked when the store opens them, the model's
    shapes against the layout when the loader builds the model.)"""
    path = Path(path)
    config = read_config(path)
    layout = packed_layout(path)
    where = path / PACKED_DIR / LAYOUT_FILE
    section = config.get(MOEFLUX_CONFIG_KEY)
    if section is not None:
        if not isinstance(section, dict):
            raise LayoutError(f"{path / 'config.json'}: malformed {MOEFLUX_CONFIG_KEY!r} section")
        version = section.get("format_version")
        if version != FORMAT_VERSION:
            raise LayoutError(
                f"{path / 'config.json'}: converted with format_version {version!r}, "
                f"this moeflux-mlx reads {FORMAT_VERSION}; convert again"
            )
        layers = section.get("moe_layers")
        try:
            layers = None if layers is None else sorted(int(x) for x in layers)
        except (TypeError, ValueError) as e:
            raise LayoutError(f"{path / 'config.json'}: malformed moe_layers {layers!r}") from e
        if layers is not None and layers != sorted(layout.layers):
            raise LayoutError(
                f"{where}: MoE layers {sorted(layout.layers)} do not match config.json's "
                f"{sorted(layers)}; layout and config come from different conversions"
            )
        total = section.get("total_expert_bytes")
        if total is not None and total != layout.total_expert_bytes:
            raise LayoutError(
                f"{where}: {layout.total_expert_bytes} expert bytes, config.json says "
                f"{total}; layout and config come from different conversions"
            )
    index_directory(path)  # damaged headers, missing shards of the dense weights
    return layout


def packed_file(path: Path, layer: int) -> Path:
    return Path(path) / PACKED_DIR / layer_file_name(layer)

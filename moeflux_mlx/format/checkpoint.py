"""Find the routed experts of an mlx-lm checkpoint (from safetensors headers only) or of a
converted (packed) directory, and describe them with one ``ExpertLayout`` per MoE layer."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

from ..errors import CheckpointError, LayoutError, UnsupportedQuantizationError
from .layout import FORMAT_VERSION, ExpertLayout, ModelLayout, Quantization, layer_file_name
from .safetensors import TensorRange, index_directory

# mlx-lm stacks each MoE layer's experts under a `switch_mlp` module; the key's layer number is
# the decoder layer index, whatever the model nests it in (model., language_model.model., ...).
EXPERT_KEY = re.compile(
    r"^(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:.*\.)?switch_mlp)\."
    r"(?P<component>(?:gate_proj|up_proj|down_proj|fc1|fc2)\.(?:weight|scales|biases|bias))$"
)
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


def _quantization_for(config: dict, module_path: str) -> Optional[Quantization]:
    """The quantization mlx-lm's loader would give ``module_path`` (per-path entries first)."""
    q = config.get("quantization") or config.get("quantization_config")
    if not isinstance(q, dict) or "bits" not in q:
        return None
    per_path = q.get(module_path)
    if per_path is False:
        return None
    src = per_path if isinstance(per_path, dict) else q
    try:
        return Quantization(
            int(src.get("bits", q["bits"])),
            int(src.get("group_size", q.get("group_size", 64))),
            str(src.get("mode", q.get("mode", "affine"))),
        )
    except (TypeError, ValueError) as e:
        raise UnsupportedQuantizationError(
            f"config.json: quantization of {module_path} is not understood ({src!r})"
        ) from e


def scan_checkpoint(path: Path) -> CheckpointExperts:
    """Index a plain mlx-lm checkpoint directory. Reads headers only."""
    path = Path(path)
    config = read_config(path)
    if looks_converted(path, config):
        # a converted directory that lost its layout.json would otherwise read as "not MoE"
        raise LayoutError(
            f"{path / PACKED_DIR / LAYOUT_FILE}: missing; {path} is a converted "
            "moeflux directory without its layout (convert it again)"
        )
    tensors = index_directory(path)
    found: Dict[int, Dict[str, TensorRange]] = {}
    modules: Dict[int, str] = {}
    dense = {}
    for name, rng in tensors.items():
        m = EXPERT_KEY.match(name)
        if m is None:
            dense[name] = rng
            continue
        layer = int(m["layer"])
        if modules.setdefault(layer, m["module"]) != m["module"]:
            raise CheckpointError(
                f"{path}: layer {layer} has two expert modules ({modules[layer]}, {m['module']})"
            )
        found.setdefault(layer, {})[m["component"]] = rng
    if not found:
        if any(".experts." in n for n in tensors):
            raise CheckpointError(
                f"{path}: experts are not stacked mlx-lm style (switch_mlp); "
                "convert the model with mlx_lm.convert first"
            )
        raise CheckpointError(
            f"{path}: no routed experts (switch_mlp tensors) found; "
            f"model_type {config.get('model_type')!r} is not an MoE checkpoint"
        )
    layers = {}
    for layer, comps in sorted(found.items()):
        where = f"{path}: layer {layer}"
        quant = {}
        for proj in {c.split(".")[0] for c in comps}:
            quant[proj] = _quantization_for(config, f"{modules[layer]}.{proj}")
            if quant[proj] is None and f"{proj}.scales" in comps:
                raise UnsupportedQuantizationError(
                    f"{where}: {proj} has scales but config.json has no quantization for it"
                )
            if quant[proj] is not None and f"{proj}.scales" not in comps:
                quant[proj] = None  # the config's default does not apply to an unquantized tensor
        main = quant.get("gate_proj", quant.get("fc1"))
        overrides = {p: q for p, q in quant.items() if q != main}
        layers[layer] = ExpertLayout.from_tensors(
            {c: (r.dtype, r.shape) for c, r in comps.items()}, main, overrides, where
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

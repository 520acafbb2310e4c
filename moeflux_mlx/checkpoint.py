"""Find the routed experts of an mlx-lm checkpoint (from safetensors headers only) or of a
converted (packed) directory, and describe them with one ``ExpertLayout`` per MoE layer."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

from mlx_lm.utils import load_config

from .errors import CheckpointError, UnsupportedQuantizationError
from .layout import ExpertLayout, ModelLayout, Quantization, layer_file_name
from .safetensors_index import TensorRange, index_directory

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
        raise CheckpointError(f"{path}: not a directory")
    try:
        return load_config(path)
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: no config.json; not an mlx-lm checkpoint") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path / 'config.json'}: unreadable ({e})") from e


def is_packed(path: Path) -> bool:
    return (Path(path) / PACKED_DIR / LAYOUT_FILE).exists()


def _quantization_for(config: dict, module_path: str) -> Optional[Quantization]:
    """The quantization mlx-lm's loader would give ``module_path`` (per-path entries first)."""
    q = config.get("quantization") or config.get("quantization_config")
    if not q or "bits" not in q:
        return None
    per_path = q.get(module_path)
    if per_path is False:
        return None
    src = per_path if isinstance(per_path, dict) else q
    return Quantization(int(src.get("bits", q["bits"])), int(src.get("group_size", q["group_size"])),
                        src.get("mode", q.get("mode", "affine")))


def scan_checkpoint(path: Path) -> CheckpointExperts:
    """Index a plain mlx-lm checkpoint directory. Reads headers only."""
    path = Path(path)
    config = read_config(path)
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
            raise CheckpointError(f"{path}: layer {layer} has two expert modules "
                                  f"({modules[layer]}, {m['module']})")
        found.setdefault(layer, {})[m["component"]] = rng
    if not found:
        if any(".experts." in n for n in tensors):
            raise CheckpointError(f"{path}: experts are not stacked mlx-lm style (switch_mlp); "
                                  "convert the model with mlx_lm.convert first")
        raise CheckpointError(f"{path}: no routed experts (switch_mlp tensors) found; "
                              f"model_type {config.get('model_type')!r} is not an MoE checkpoint")
    layers = {}
    for layer, comps in sorted(found.items()):
        where = f"{path}: layer {layer}"
        quant = {}
        for proj in {c.split(".")[0] for c in comps}:
            quant[proj] = _quantization_for(config, f"{modules[layer]}.{proj}")
            if quant[proj] is None and f"{proj}.scales" in comps:
                raise UnsupportedQuantizationError(
                    f"{where}: {proj} has scales but config.json has no quantization for it")
            if quant[proj] is not None and f"{proj}.scales" not in comps:
                quant[proj] = None  # the config's default does not apply to an unquantized tensor
        main = quant.get("gate_proj", quant.get("fc1"))
        overrides = {p: q for p, q in quant.items() if q != main}
        layers[layer] = ExpertLayout.from_tensors(
            {c: (r.dtype, r.shape) for c, r in comps.items()}, main, overrides, where)
    return CheckpointExperts(path, config, ModelLayout(layers, modules), found, dense)


def packed_layout(path: Path) -> ModelLayout:
    return ModelLayout.load(Path(path) / PACKED_DIR / LAYOUT_FILE)


def packed_file(path: Path, layer: int) -> Path:
    return Path(path) / PACKED_DIR / layer_file_name(layer)

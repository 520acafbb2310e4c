"""Where a model's routed experts are, found in the model mlx-lm builds, by what they are.

Every ``SwitchGLU`` / ``SwitchMLP`` of the model, and every module with their interface (stacked
``SwitchLinear`` projections ``gate_proj`` / ``up_proj`` / ``down_proj`` or ``fc1`` / ``fc2``, an
``activation``, called as ``module(x, indices)``), is a set of routed experts, whatever the
architecture names it (``switch_mlp``, ``experts``, ``switch_glu``, ...). Shared experts are plain
MLPs and stay dense. The router of each expert module (what predicts the next layer's experts
for prefetch) is found the same way: the linear map onto that module's experts next to it.

``format.checkpoint`` finds the same modules in the files (stacked tensors with those
projections); the loader checks that the two agree, so neither names nor a table decide.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear, SwitchMLP

from ..errors import CheckpointError
from ..format.checkpoint import SEPARATE_EXPERTS, check_architecture, layer_of
from ..format.layout import GLU_PROJECTIONS, MLP_PROJECTIONS

STACKED_LINEARS = (SwitchLinear, QuantizedSwitchLinear)


@dataclass(eq=False)
class ExpertModule:
    """One set of routed experts in a model."""

    path: str  # the module's path in the model (= its tensors' prefix in an mlx-lm checkpoint)
    layer: int  # the decoder layer (format.checkpoint.layer_of)
    projections: Tuple[str, ...]  # GLU_PROJECTIONS or MLP_PROJECTIONS
    num_experts: int
    input_dims: int  # what the module reads: the hidden size, or a latent size (nemotron_h)
    hidden_dims: int  # each expert's intermediate size
    module: nn.Module = field(repr=False)

    @property
    def is_glu(self) -> bool:
        return self.projections == GLU_PROJECTIONS

    @property
    def extras(self) -> Dict[str, object]:
        """Children and parameters of the module that are not its experts (e.g. a norm a model
        hangs on it): they stay in the model, dense, next to the streaming module."""
        skip = set(self.projections) | {"activation"}
        return {k: v for k, v in self.module.items() if k not in skip}


def _linear_dims(lin: nn.Module) -> Tuple[int, int, int]:
    return int(lin.num_experts), int(lin.output_dims), int(lin.input_dims)


def expert_projections(module: nn.Module) -> Optional[Tuple[str, ...]]:
    """SwitchGLU's or SwitchMLP's projections when ``module`` is one, or has their interface."""
    if isinstance(module, SwitchGLU):
        return GLU_PROJECTIONS
    if isinstance(module, SwitchMLP):
        return MLP_PROJECTIONS
    if not (callable(module) and hasattr(module, "activation")):
        return None
    for projections in (GLU_PROJECTIONS, MLP_PROJECTIONS):
        if all(isinstance(getattr(module, p, None), STACKED_LINEARS) for p in projections):
            return projections
    return None


def find_experts(model: nn.Module) -> Dict[str, ExpertModule]:
    """Every routed-experts module of ``model``: ``{path: ExpertModule}``, in model order.

    Raises:
        CheckpointError: a module's projections disagree on the number of experts, or its
            path names no decoder layer.
    """
    out = {}
    for path, module in model.named_modules():
        projections = expert_projections(module)
        if projections is None:
            continue
        dims = [_linear_dims(getattr(module, p)) for p in projections]
        if len({d[0] for d in dims}) != 1:
            raise CheckpointError(f"{path}: its projections disagree on the number of experts")
        layer = layer_of(path)
        if layer is None:
            raise CheckpointError(f"{path}: routed experts outside any numbered decoder layer")
        experts, hidden, inputs = dims[0]  # gate_proj / fc1: [experts, hidden, inputs]
        out[path] = ExpertModule(path, layer, projections, experts, inputs, hidden, module)
    return dict(reversed(list(out.items())))  # named_modules() lists the last layer first


def model_classes(config: dict, where: object = "config.json"):
    """``(Model, ModelArgs)`` for ``config`` from mlx-lm's own table, or one line saying why not."""
    from mlx_lm.utils import _get_classes

    check_architecture(config, where)
    try:
        return _get_classes(config)
    except (ValueError, ImportError) as e:
        raise CheckpointError(
            f"{where}: mlx-lm cannot build model_type {config.get('model_type')!r} ({e})"
        ) from e


def build_model(config: dict, where: object = "config.json") -> nn.Module:
    """The model mlx-lm builds for ``config``, lazily: its random initial weights are never
    evaluated, so this costs no memory for the weights, whatever the model's size."""
    model_class, args_class = model_classes(config, where)
    return model_class(args_class.from_dict(copy.deepcopy(config)))


# what mlx-lm's model args call the experts a token routes, by architecture
TOP_K_NAMES = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k")


def top_k_of(config: Optional[dict] = None, model: Optional[nn.Module] = None) -> Optional[int]:
    """The experts a token routes (top-k): from ``model.args`` (with mlx-lm's defaults filled
    in), else from ``config`` (its ``text_config`` first).

    Args:
        config: the model's ``config.json``.
        model: the mlx-lm model built from it.

    Returns:
        The top-k (the largest, where it differs by layer), or None where neither names it.
    """
    args = getattr(model, "args", None)
    sources = [vars(args) if args is not None and hasattr(args, "__dict__") else {}]
    if config:
        sources += [config.get("text_config") or {}, config]
    for source in sources:
        for name in TOP_K_NAMES:
            value = source.get(name)
            if isinstance(value, (list, tuple)) and value:
                value = max(value)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def no_experts_error(config: dict, where: object) -> CheckpointError:
    """The one-line refusal for a model mlx-lm builds without routed experts."""
    model_type = config.get("model_type")
    if model_type in SEPARATE_EXPERTS:
        return CheckpointError(
            f"{where}: mlx-lm's {model_type} keeps every expert a module of its own (no stacked "
            "SwitchGLU), so there is nothing to stream; use mlx_lm.load"
        )
    return CheckpointError(
        f"{where}: mlx-lm's {model_type!r} model has no routed experts (no SwitchGLU / "
        "SwitchMLP); not an MoE checkpoint (a dense model: use mlx_lm.load)"
    )


def _decoder_layer_prefix(path: str, layer: int) -> str:
    """``model.layers.3`` of ``model.layers.3.mlp.experts``."""
    parts = path.split(".")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] == str(layer):
            return ".".join(parts[: i + 1])
    return path.rsplit(".", 1)[0]


def _router_dims(module: nn.Module) -> Optional[Tuple[int, int]]:
    """(inputs, outputs) of a linear map: ``nn.Linear`` / ``nn.QuantizedLinear``, or a module
    holding a 2-D ``weight`` [outputs, inputs] itself (DeepSeek's ``MoEGate``)."""
    if isinstance(module, STACKED_LINEARS):
        return None
    weight = module.get("weight")
    if weight is None or getattr(weight, "ndim", 0) != 2:
        return None
    if isinstance(module, nn.QuantizedLinear):
        return int(module.scales.shape[-1] * module.group_size), int(weight.shape[0])
    return int(weight.shape[1]), int(weight.shape[0])


def router_input_dims(router: nn.Module) -> Optional[int]:
    dims = _router_dims(router)
    return None if dims is None else dims[0]


def _shared_depth(a: str, b: str) -> int:
    pa, pb = a.split("."), b.split(".")
    n = 0
    while n < min(len(pa), len(pb)) and pa[n] == pb[n]:
        n += 1
    return n


def find_router(
    model: nn.Module, path: str, layer: int, num_experts: int
) -> Optional[Tuple[str, nn.Module]]:
    """The router of the experts at ``path``: the linear map onto its ``num_experts`` experts
    in the same decoder layer, nearest to the expert module (``gate``, ``router``,
    ``router.proj``, ...); None where there is none (a router of another kind)."""
    prefix = _decoder_layer_prefix(path, layer) + "."
    parent = path.rsplit(".", 1)[0]
    best: Optional[Tuple[Tuple[int, int, int], str, nn.Module]] = None
    for p, module in model.named_modules():
        if not p.startswith(prefix) or p == path or p.startswith(path + "."):
            continue
        if not isinstance(module, nn.Module):
            continue
        dims = _router_dims(module)
        if dims is None or dims[1] != num_experts:
            continue
        named = any(n in ("gate", "router") for n in p[len(prefix) :].split("."))
        rank = (-_shared_depth(p, parent), 0 if named else 1, len(p))
        if best is None or rank < best[0]:
            best = (rank, p, module)
    return None if best is None else (best[1], best[2])

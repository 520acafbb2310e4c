"""``load`` and ``patch_model``: an ordinary mlx-lm model whose experts stream from disk.

The model is built by mlx-lm's own ``load_model``; before any weight is materialized every
``SwitchGLU`` / ``SwitchMLP`` named in the expert layout is replaced by a ``StreamingSwitchGLU``,
and the expert tensors are dropped from the (lazy) weight dict, so they are never read at load.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
from mlx_lm.utils import _get_classes, load_model, load_tokenizer

from ..errors import CheckpointError, LayoutError
from ..format.checkpoint import EXPERT_KEY
from ..format.layout import ExpertLayout
from ..io.store import open_store
from ..options import Budget, LoadOptions
from .predict import NextLayerPredictor, next_gates
from .runtime import StreamingRuntime
from .switch import StreamingSwitchGLU

log = logging.getLogger(__name__)


def _check_shapes(switch: nn.Module, layout: ExpertLayout, where: str) -> None:
    """The model's SwitchGLU (unquantized and lazy from load, or quantized) must match the layout."""
    for proj in layout.projections:
        lin = getattr(switch, proj, None)
        if lin is None:
            raise LayoutError(f"{where}: the model's {type(switch).__name__} has no {proj}")
        e, out_dims, in_dims = lin.num_experts, lin.output_dims, lin.input_dims
        w = layout.component(f"{proj}.weight")
        q = layout.quant(proj)
        got_in = w.shape[-1] * 32 // q.bits if q else w.shape[-1]
        if (e, out_dims, in_dims) != (layout.num_experts, w.shape[0], got_in):
            raise LayoutError(
                f"{where}: {proj} is [{layout.num_experts}, {w.shape[0]}, {got_in}] "
                f"in the expert files but [{e}, {out_dims}, {in_dims}] in the model "
                "config; the files do not belong to this config"
            )


def _replace_switch_modules(model: nn.Module, runtime: StreamingRuntime) -> None:
    modules = dict(model.named_modules())
    for layer, path in sorted(runtime.layout.module_paths.items()):
        where = f"layer {layer} ({path})"
        switch = modules.get(path)
        if not isinstance(switch, (SwitchGLU, SwitchMLP, StreamingSwitchGLU)):
            raise LayoutError(
                f"{where}: the model has no SwitchGLU there "
                f"(found {type(switch).__name__}); wrong config for these experts?"
            )
        if isinstance(switch, StreamingSwitchGLU):
            raise CheckpointError(f"{where}: the model is already patched")
        _check_shapes(switch, runtime.layout.layers[layer], where)
        parent_path, name = path.rsplit(".", 1)
        setattr(modules[parent_path], name, StreamingSwitchGLU(layer, runtime, switch.activation))
    if runtime.options.prefetch:
        runtime.cache.predictor = NextLayerPredictor(next_gates(model, runtime.layout.module_paths))
    left = [p for p, m in model.named_modules() if isinstance(m, (SwitchGLU, SwitchMLP))]
    if left:
        raise CheckpointError(
            f"the model has experts at {left} but the checkpoint has none for them"
        )


def _make_runtime(source, options: LoadOptions) -> StreamingRuntime:
    store, layout = open_store(Path(source).expanduser(), options.expert_io, options.threads)
    try:
        return StreamingRuntime(store, layout, options)
    except Exception:
        store.close()
        raise


def _options(options: Optional[LoadOptions], given: dict) -> LoadOptions:
    """``options`` with the keyword arguments that were given applied, else resolved from them
    and the environment."""
    given = {k: v for k, v in given.items() if v is not None}
    if options is None:
        return LoadOptions.resolve(**given)
    return dataclasses.replace(options, **given)


def patch_model(
    model: nn.Module,
    source,
    *,
    expert_io: Optional[str] = None,
    backend: Optional[str] = None,
    cache_budget: Budget = None,
    prefetch: Optional[bool] = None,
    threads: Optional[int] = None,
    device_table: Optional[bool] = None,
    options: Optional[LoadOptions] = None,
) -> nn.Module:
    """Replace the routed experts of an mlx-lm ``model`` by streaming modules.

    Args:
        model: an mlx-lm model built by the user, e.g. ``mlx_lm.load(path, lazy=True)[0]`` (the
            experts' weights are then never read).
        source: a converted directory or the plain mlx-lm checkpoint the experts are read from.
        expert_io, backend, cache_budget, prefetch, threads, device_table: see ``LoadOptions``
            (None: from ``options``, else the ``MOEFLUX_*`` variables, else the default).
        options: all of them at once.

    Returns:
        ``model``, patched in place; ``model.moeflux`` is its ``StreamingRuntime``.

    Raises:
        CheckpointError: ``source`` is not a usable MoE checkpoint, or does not fit the model
            (``LayoutError``), or the model is already patched.
        ExpertFileError: an expert file is missing, unreadable or of the wrong size.
        ValueError: a bad option (budget, backend).
    """
    opts = _options(
        options,
        dict(
            expert_io=expert_io,
            backend=backend,
            cache_budget=cache_budget,
            prefetch=prefetch,
            threads=threads,
            device_table=device_table,
        ),
    )
    runtime = _make_runtime(source, opts)
    try:
        _replace_switch_modules(model, runtime)
    except Exception:
        runtime.close()
        raise
    model.moeflux = runtime
    return model


def load(
    path,
    *,
    expert_io: Optional[str] = None,
    backend: Optional[str] = None,
    cache_budget: Budget = None,
    prefetch: Optional[bool] = None,
    threads: Optional[int] = None,
    device_table: Optional[bool] = None,
    model_config: Optional[dict] = None,
    tokenizer_config: Optional[dict] = None,
    options: Optional[LoadOptions] = None,
) -> Tuple[nn.Module, object]:
    """Load a converted directory or a plain mlx-lm checkpoint with experts streamed from disk.

    Args:
        path: the model directory (``~`` is expanded).
        expert_io: ``auto`` (the RAM gate), ``mmap`` or ``pread``.
        backend: ``auto``, ``ops``, ``metal`` or ``cuda``.
        cache_budget: MLX memory for resident experts: bytes, ``"8GB"``, a fraction of RAM,
            ``"all"``, or 0 for none (default: all experts if they fit in 0.4 x RAM).
        prefetch: read the experts the next layer's router predicts in the background.
        threads: parallel reads of the ``pread`` store.
        device_table: CUDA: decode looks slots up on the GPU, and only the GPU waits, only on
            misses, for a helper process that reads them (default: on where CUDA is).
        model_config, tokenizer_config: as for ``mlx_lm.load``.
        options: every load option at once (``LoadOptions``); keyword arguments given override it.

    Returns:
        ``(model, tokenizer)`` like ``mlx_lm.load``; ``model.moeflux`` is the runtime
        (``stats_dict()``, ``reset_stats()``, ``close()``, or ``with model.moeflux: ...``).

    Raises:
        CheckpointError: not a usable MoE checkpoint (not MoE, missing shards, damaged headers,
            a converted directory that does not match its config: ``LayoutError``).
        ExpertFileError: an expert file is missing, unreadable or of the wrong size.
        ValueError: a bad option (budget, backend).
    """
    path = Path(path).expanduser()
    opts = _options(
        options,
        dict(
            expert_io=expert_io,
            backend=backend,
            cache_budget=cache_budget,
            prefetch=prefetch,
            threads=threads,
            device_table=device_table,
        ),
    )
    runtime = _make_runtime(path, opts)

    def get_classes(config):
        model_class, args_class = _get_classes(config)

        def build(args):
            model = model_class(args)
            _replace_switch_modules(model, runtime)
            sanitize = getattr(model, "sanitize", None)

            def drop_experts(weights):
                weights = sanitize(weights) if sanitize else weights
                return {k: v for k, v in weights.items() if not EXPERT_KEY.match(k)}

            model.sanitize = drop_experts
            return model

        return build, args_class

    try:
        model, config = load_model(path, model_config=model_config, get_model_classes=get_classes)
        # the random initial weights of the replaced experts were never evaluated; evaluate the
        # global key so it does not keep their lazy graph (about 75 KB per load) alive
        mx.eval(mx.random.state)
        tokenizer = load_tokenizer(
            path, tokenizer_config, eos_token_ids=config.get("eos_token_id", None)
        )
    except Exception:
        runtime.close()
        raise
    model.moeflux = runtime
    weakref.finalize(model, runtime.close)  # e.g. mlx-lm's server dropping a model it swapped out
    return model, tokenizer


def stats(model: nn.Module) -> dict:
    """Streaming counters of a model from ``load`` / ``patch_model``.

    Args:
        model: a model ``load`` or ``patch_model`` returned.

    Returns:
        ``{"total": {...}, "layers": {layer: {...}}, "io_mode", "cache", "backend", ...}``:
        experts and bytes read, hit rate, time in sync / I/O / upload / building the computation.
    """
    return model.moeflux.stats_dict()


def reset_stats(model: nn.Module) -> None:
    """Zero the streaming counters of ``model`` (what was read so far is counted first)."""
    model.moeflux.reset_stats()

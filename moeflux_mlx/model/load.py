"""``load`` and ``patch_model``: an ordinary mlx-lm model whose experts stream from disk.

The model is built by mlx-lm's own ``load_model``; before any weight is materialized every
routed-experts module (``SwitchGLU`` / ``SwitchMLP`` or one with their interface, found by
``model.experts``, whatever its name) is replaced by a ``StreamingSwitchGLU``, and the expert
tensors are dropped from the (lazy) weight dict after mlx-lm's ``sanitize``, so they are never
read at load. The experts the model has and the ones the files hold (``format.checkpoint``) must
be the same modules, and mlx-lm's ``sanitize`` must hand the files' expert tensors to the model
unchanged (else the bytes streamed would not be the ones mlx-lm computes with).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import load_model, load_tokenizer

from ..errors import CheckpointError, LayoutError
from ..format.checkpoint import EXPERT_KEY
from ..format.layout import ExpertLayout
from ..io.store import open_store
from ..options import Budget, LoadOptions
from .experts import find_experts, model_classes, no_experts_error, top_k_of
from .runtime import StreamingRuntime, prefill_step
from .source import require_tokenizer, resolve_model_path
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


def _replace_switch_modules(
    model: nn.Module,
    runtime: StreamingRuntime,
    config: Optional[dict] = None,
    where: object = "",
    track_dtypes: bool = True,
) -> None:
    """Swap every routed-experts module of ``model`` for a ``StreamingSwitchGLU`` reading the
    experts ``runtime`` streams; the two sets of modules must be the same. ``track_dtypes``:
    give them their dtype markers now (not before mlx-lm loads the weights: ``_track_dtypes``)."""
    if any(isinstance(m, StreamingSwitchGLU) for _, m in model.named_modules()):
        raise CheckpointError(f"{where or 'the model'}: the model is already patched")
    experts = find_experts(model)
    if not experts:
        raise no_experts_error(
            config or {"model_type": type(model).__module__.rsplit(".", 1)[-1]}, where
        )
    modules = dict(model.named_modules())
    for layer, path in sorted(runtime.layout.module_paths.items()):
        where_layer = f"layer {layer} ({path})"
        found = experts.get(path)
        if found is None:
            raise LayoutError(
                f"{where_layer}: the model has no SwitchGLU there "
                f"(found {type(modules.get(path)).__name__}); wrong config for these experts?"
            )
        switch = found.module
        _check_shapes(switch, runtime.layout.layers[layer], where_layer)
        streaming = StreamingSwitchGLU(layer, runtime, switch.activation)
        if track_dtypes:
            streaming.track_dtypes()
        for name, extra in found.extras.items():  # e.g. a norm the model hangs on the module
            setattr(streaming, name, extra)
        parent_path, name = path.rsplit(".", 1)
        setattr(modules[parent_path], name, streaming)
    left = [p for p in experts if p not in set(runtime.layout.module_paths.values())]
    if left:
        raise CheckpointError(
            f"the model has experts at {left} but the checkpoint has none for them"
        )


def _track_dtypes(model: nn.Module) -> None:
    for _, m in model.named_modules():
        if isinstance(m, StreamingSwitchGLU):
            m.track_dtypes()


def _expert_keys_dropper(sanitize, module_paths, where: object):
    """``sanitize`` followed by dropping the streamed experts' tensors. mlx-lm's sanitize must
    hand each of them on unchanged (the very array it was given, under the same name): the bytes
    streamed from the files are then the bytes mlx-lm would compute with."""
    streamed = set(module_paths)

    def drop_experts(weights):
        given = weights
        weights = sanitize(dict(weights)) if sanitize else weights
        kept = {}
        for k, v in weights.items():
            m = EXPERT_KEY.match(k)
            if m is None or m["module"] not in streamed:
                kept[k] = v
            elif given.get(k) is not v:
                raise CheckpointError(
                    f"{where}: mlx-lm rewrites the expert tensor {k} when it loads this "
                    "checkpoint (its sanitize), so the files do not hold what the model "
                    "computes with; convert it once with mlx_lm.convert, which saves the "
                    "experts as the model uses them"
                )
        return kept

    return drop_experts


def _make_runtime(source, options: LoadOptions) -> StreamingRuntime:
    source = Path(source).expanduser()
    store, layout = open_store(
        source,
        options.expert_io,
        options.tuning.threads,
        warm_threads=options.tuning.warm_read_threads,
    )
    try:
        return StreamingRuntime(store, layout, options, source)
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
    eviction: Optional[str] = None,
    pin_experts: Optional[bool] = None,
    options: Optional[LoadOptions] = None,
) -> nn.Module:
    """Replace the routed experts of an mlx-lm ``model`` by streaming modules.

    Args:
        model: an mlx-lm model built by the user, e.g. ``mlx_lm.load(path, lazy=True)[0]`` (the
            experts' weights are then never read).
        source: a converted directory or the plain mlx-lm checkpoint the experts are read from,
            or its Hugging Face repo id (``model.source.resolve_model_path``).
        expert_io, backend, cache_budget, eviction, pin_experts: see ``LoadOptions``
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
            eviction=eviction,
            pin_experts=pin_experts,
        ),
    )
    runtime = _make_runtime(resolve_model_path(source), opts)
    try:
        _replace_switch_modules(model, runtime, where=source)
        runtime.prefill_step_size = prefill_step(model, runtime)
        runtime.warn_small_budget(top_k_of(model=model))
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
    eviction: Optional[str] = None,
    pin_experts: Optional[bool] = None,
    model_config: Optional[dict] = None,
    tokenizer_config: Optional[dict] = None,
    options: Optional[LoadOptions] = None,
    lazy: bool = False,
    revision: Optional[str] = None,
) -> Tuple[nn.Module, object]:
    """Load a converted directory or a plain mlx-lm checkpoint with experts streamed from disk.

    Args:
        path: the model directory (``~`` is expanded), or a Hugging Face repo id, found in the
            hub cache or downloaded as ``mlx_lm.load`` does (``model.source``).
        expert_io: ``auto`` (the RAM gate), ``mmap``, ``pread`` or ``direct`` (uncached).
        backend: ``auto``, ``ops``, ``metal`` or ``cuda``.
        cache_budget: MLX memory for resident experts: a size (``"8GB"``, an int of bytes), a
            share naming its base (``"25% experts"``, ``"40% RAM"``), ``"all"``, or 0 for none
            (default: all experts if they fit in 40% of RAM, else 40% of RAM).
        eviction: which resident expert a miss replaces: ``transition`` (default) or ``lru``
            (``cache.policy``).
        pin_experts: CUDA: the GPU copies missed experts out of the expert files, page-locked
            in RAM, instead of a helper process reading them (default: off).
        model_config, tokenizer_config: as for ``mlx_lm.load``.
        lazy: as for ``mlx_lm.load``: the dense weights are read when first used, not now.
        revision: as for ``mlx_lm.load``: the repo's branch, tag or commit.
        options: every load option at once (``LoadOptions``); keyword arguments given override it.

    Returns:
        ``(model, tokenizer)`` like ``mlx_lm.load``; ``model.moeflux`` is the runtime
        (``stats_dict()``, ``reset_stats()``, ``close()``, or ``with model.moeflux: ...``),
        closed when the model and its copies are collected. ``model.set_dtype`` reaches the
        streamed experts as it reaches stock's; ``copy.deepcopy(model)`` copies the dense
        weights and shares the runtime; pickling the model raises ``TypeError``.

    Raises:
        CheckpointError: no such directory or repo, or not a usable MoE checkpoint (not MoE,
            missing shards, damaged headers,
            a converted directory that does not match its config: ``LayoutError``; no
            tokenizer files: ``MissingTokenizerError``).
        ExpertFileError: an expert file is missing, unreadable or of the wrong size.
        ValueError: a bad option (budget, backend).
        DeviceSetupError: ``pin_experts`` could not page-lock the expert files (too large for
            RAM, or refused by CUDA).
    """
    path = resolve_model_path(path, revision)
    opts = _options(
        options,
        dict(
            expert_io=expert_io,
            backend=backend,
            cache_budget=cache_budget,
            eviction=eviction,
            pin_experts=pin_experts,
        ),
    )
    runtime = _make_runtime(path, opts)

    def get_classes(config):
        model_class, args_class = model_classes(config, path)

        def build(args):
            model = model_class(args)
            _replace_switch_modules(model, runtime, config, path, track_dtypes=False)
            model.sanitize = _expert_keys_dropper(
                getattr(model, "sanitize", None), runtime.layout.module_paths.values(), path
            )
            return model

        return build, args_class

    try:
        require_tokenizer(path, tokenizer_config)  # after the checkpoint's own checks
        model, config = load_model(
            path, lazy=lazy, model_config=model_config, get_model_classes=get_classes
        )
        runtime.prefill_step_size = prefill_step(model, runtime)
        runtime.warn_small_budget(top_k_of(config, model))
        _track_dtypes(model)
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
    runtime.close_with(model)
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

"""``load`` and ``patch_model``: an ordinary mlx-lm model whose experts stream from disk.

The model is built by mlx-lm's own ``load_model``; before any weight is materialized every
``SwitchGLU`` / ``SwitchMLP`` named in the expert layout is replaced by a ``StreamingSwitchGLU``,
and the expert tensors are dropped from the (lazy) weight dict, so they are never read at load.
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
from mlx_lm.utils import _get_classes, load_model, load_tokenizer

from .backends import select_backend
from .cache import make_cache
from .checkpoint import EXPERT_KEY
from .errors import CheckpointError, LayoutError, ModelClosedError
from .layout import ExpertLayout, ModelLayout
from .module import StreamingSwitchGLU
from .prefetch import Prefetcher, next_gates
from .counters import Stats
from .store import ExpertStore, open_store

log = logging.getLogger(__name__)


class StreamingRuntime:
    """What the streaming modules of one model share: store, cache, backend and counters.

    Reached as ``model.moeflux``; ``close()`` (or ``with``) releases files, maps and threads."""

    def __init__(self, store: ExpertStore, layout: ModelLayout, backend, cache_budget=None,
                 prefetch: bool = False, device_table=None):
        self.store, self.layout, self.backend = store, layout, backend
        self._stats = Stats()
        self.prefetcher = Prefetcher(store, self._stats) if prefetch else None
        self.cache = make_cache(self.prefetcher or store, layout, cache_budget, device_table,
                                prefetch)
        self.next_gate = {}  # layer -> (next MoE layer, its router); set when the model is patched
        # where each forward pass checks what the miss server or the GPU ran into (once per pass:
        # decode is host-bound, and the per-layer check cost more than the lookup)
        self.first_layer = min(layout.layers) if layout.layers else None
        self.closed = False

    @property
    def stats(self) -> Stats:
        return self._stats

    def stats_dict(self) -> dict:
        self.cache.settle(self._stats)  # what the miss server read is counted when it is asked
        d = self._stats.to_dict()
        d.update(io_mode=self.store.io_mode, cache=self.cache.name, backend=self.backend.name,
                 prefetch=self.prefetcher is not None,
                 device_table=getattr(self.cache, "control", None) is not None)
        return d

    def reset_stats(self) -> None:
        self.cache.settle(self._stats)  # what was read so far counts before the reset
        self._stats.reset()

    def check_open(self) -> None:
        if self.closed:
            raise ModelClosedError("this moeflux model was closed; load it again")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.prefetcher is not None:
                self.prefetcher.close()
            self.cache.close()
            self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


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
            raise LayoutError(f"{where}: {proj} is [{layout.num_experts}, {w.shape[0]}, {got_in}] "
                              f"in the expert files but [{e}, {out_dims}, {in_dims}] in the model "
                              "config; the files do not belong to this config")


def _replace_switch_modules(model: nn.Module, runtime: StreamingRuntime) -> None:
    modules = dict(model.named_modules())
    for layer, path in sorted(runtime.layout.module_paths.items()):
        where = f"layer {layer} ({path})"
        switch = modules.get(path)
        if not isinstance(switch, (SwitchGLU, SwitchMLP, StreamingSwitchGLU)):
            raise LayoutError(f"{where}: the model has no SwitchGLU there "
                              f"(found {type(switch).__name__}); wrong config for these experts?")
        if isinstance(switch, StreamingSwitchGLU):
            raise CheckpointError(f"{where}: the model is already patched")
        _check_shapes(switch, runtime.layout.layers[layer], where)
        parent_path, name = path.rsplit(".", 1)
        setattr(modules[parent_path], name,
                StreamingSwitchGLU(layer, runtime, switch.activation))
    runtime.next_gate = next_gates(model, runtime.layout.module_paths)
    left = [p for p, m in model.named_modules() if isinstance(m, (SwitchGLU, SwitchMLP))]
    if left:
        raise CheckpointError(f"the model has experts at {left} but the checkpoint has none "
                              "for them")


def _make_runtime(source, expert_io, backend, threads, cache_budget, prefetch,
                  device_table) -> StreamingRuntime:
    store, layout = open_store(Path(source), expert_io, threads)
    try:
        return StreamingRuntime(store, layout, select_backend(backend), cache_budget, prefetch,
                                device_table)
    except Exception:
        store.close()
        raise


def patch_model(model: nn.Module, source, *, expert_io: Optional[str] = None,
                backend: Optional[str] = None, cache_budget=None, prefetch: bool = False,
                threads: int = 8, device_table=None) -> nn.Module:
    """Replace the experts of an mlx-lm ``model`` (built by the user, e.g. ``mlx_lm.load(...,
    lazy=True)``) by streaming modules reading from ``source`` (converted or plain checkpoint)."""
    runtime = _make_runtime(source, expert_io, backend, threads, cache_budget, prefetch,
                            device_table)
    try:
        _replace_switch_modules(model, runtime)
    except Exception:
        runtime.close()
        raise
    model.moeflux = runtime
    return model


def load(path, *, expert_io: Optional[str] = None, backend: Optional[str] = None,
         cache_budget=None, prefetch: bool = False, threads: int = 8, model_config: Optional[dict] = None,
         tokenizer_config: Optional[dict] = None,
         device_table=None) -> Tuple[nn.Module, object]:
    """Load a converted directory or a plain mlx-lm checkpoint with experts streamed from disk.

    ``expert_io``: ``auto`` (the RAM gate), ``mmap`` or ``pread``. ``backend``: ``auto``, ``ops``,
    ``metal`` or ``cuda``. ``cache_budget``: MLX memory for resident experts: bytes, ``"8GB"``,
    a fraction of RAM, ``"all"``, or 0 for none (default: all experts if they fit in 0.4 x RAM).
    ``prefetch``: read the experts the next layer's router would pick for this layer's input
    in the background (see ``prefetch.py``). ``device_table``: on CUDA, decode looks slots up
    on the GPU and only the GPU waits, only on misses, for a helper process that reads them
    (default: on where CUDA is; see ``device_table.py``; ``MOEFLUX_DEVICE_TABLE=0|1``); ``"all"``
    also looks up the experts of fully cached layers that way (to measure the lookup's cost).
    Returns ``(model, tokenizer)`` like ``mlx_lm.load``; ``model.moeflux`` is the runtime
    (``stats_dict()``, ``reset_stats()``, ``close()``)."""
    path = Path(path)
    runtime = _make_runtime(path, expert_io, backend, threads, cache_budget, prefetch, device_table)

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
        tokenizer = load_tokenizer(path, tokenizer_config,
                                   eos_token_ids=config.get("eos_token_id", None))
    except Exception:
        runtime.close()
        raise
    model.moeflux = runtime
    weakref.finalize(model, runtime.close)  # e.g. mlx-lm's server dropping a model it swapped out
    return model, tokenizer


def stats(model: nn.Module) -> dict:
    """Streaming counters of a model from ``load``/``patch_model``: per layer and in total,
    experts and bytes read, hit rate, time in sync / I/O / upload / building the computation."""
    return model.moeflux.stats_dict()


def reset_stats(model: nn.Module) -> None:
    model.moeflux.reset_stats()

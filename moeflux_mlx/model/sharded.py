"""``sharded_load``: one process's share of a model spread over several by MLX's distributed
layer (``mx.distributed``, processes started by ``mlx.launch``), as ``mlx_lm.utils.sharded_load``
spreads a stock model, with the routed experts streamed and each process reading only its share.

The model is built as mlx-lm's ``sharded_load`` builds it: loaded lazily (the routed experts'
tensors dropped after sanitize, as ``load`` drops them, so they are never read), then split by
its own hooks, ``model.shard(tensor_group)`` (tensor parallelism: every process computes a part
of every layer and the parts are summed over the group) and ``model.model.pipeline(
pipeline_group)`` (each process runs a range of layers). What the hooks did to each
routed-experts module is the share: the layers left in the model, and per projection the part it
keeps. mlx's ``shard_inplace`` cuts a stacked weight ``[E, out, in]`` into ``N`` equal parts and
keeps part ``rank``: its output rows (``all-to-sharded``: gate / up, and their biases) or its input
columns (``sharded-to-all``: down, with the quantization scales and biases of those columns; its
bias stays whole). The store opens only the share's layers and reads only those parts
(``ExpertLayout.shard``), the cache's budget is computed on the share's bytes, and the modules
are then swapped for streaming ones as ``patch_model`` swaps them. See docs/distributed.md.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model, load_tokenizer

from ..errors import CheckpointError
from ..format.checkpoint import expert_layout
from ..format.layout import ExpertLayout, ExpertShard, ModelLayout
from ..io.store import open_store
from ..options import LoadOptions
from .experts import ExpertModule, find_experts, model_classes, top_k_of
from .load import _expert_keys_dropper, _options, _replace_switch_modules
from .runtime import StreamingRuntime, prefill_step
from .source import require_tokenizer, resolve_model_path

log = logging.getLogger(__name__)

Cuts = Dict[str, Tuple[int, int, int]]  # component -> (axis, part, parts): ExpertLayout.shard


def _load_lazily(path: Path, layout: ModelLayout, model_config: Optional[dict]):
    """mlx-lm's model of ``path``, lazy, its routed experts' tensors dropped (their modules keep
    unevaluated initial weights, for the model's own ``shard`` to cut). As mlx-lm's
    ``sharded_load`` it loads with ``strict=False``; every other weight must be in the files."""
    loaded: set = set()

    def get_classes(config):
        model_class, args_class = model_classes(config, path)

        def build(args):
            model = model_class(args)
            drop = _expert_keys_dropper(
                getattr(model, "sanitize", None), layout.module_paths.values(), path
            )

            def sanitize(weights):
                kept = drop(weights)
                loaded.update(kept)
                return kept

            model.sanitize = sanitize
            return model

        return build, args_class

    model, config = load_model(
        path, lazy=True, strict=False, model_config=model_config, get_model_classes=get_classes
    )
    streamed = tuple(f"{p}." for p in layout.module_paths.values())
    params = dict(tree_flatten(model.parameters()))
    missing = [k for k in params if k not in loaded and not k.startswith(streamed)]
    if missing:
        raise CheckpointError(f"{path}: the weight files lack {', '.join(missing[:5])}")
    return model, config


def _code(shape: Tuple[int, ...]) -> mx.array:
    return mx.arange(math.prod(shape), dtype=mx.float32).reshape(shape)


def _code_biases(experts: Dict[str, ExpertModule]) -> Dict[Tuple[str, str], Tuple[int, ...]]:
    """Give each projection's expert biases values that say where they came from (``_code``),
    so that what ``shard`` did to them can be checked: a model's shard may rescale them in place
    (gpt-oss divides the down projection's). Returns their shapes."""
    shapes = {}
    for path, em in experts.items():
        for proj in em.projections:
            lin = getattr(em.module, proj)
            if "bias" in lin:
                shapes[(path, proj)] = tuple(lin.bias.shape)
                lin.bias = _code(lin.bias.shape)
    return shapes


def _split_of(
    before: tuple,
    lin: nn.Module,
    bias: Optional[Tuple[int, ...]],
    parts: int,
    part: int,
    where: str,
) -> Optional[int]:
    """How ``shard`` cut one projection: None (whole), 0 (output rows) or -1 (input columns).

    Raises:
        CheckpointError: another cut than rows or input columns in ``parts`` equal parts, or
            expert biases whose values were changed.
    """
    after = tuple(lin.weight.shape)
    cut: Optional[int] = None
    if after != before:
        e, rows, cols = before
        if after == (e, rows // parts, cols) and rows % parts == 0:
            cut = 0
        elif after == (e, rows, cols // parts) and cols % parts == 0:
            cut = -1
        else:
            raise CheckpointError(
                f"{where}: the model's shard() cuts the experts' {list(before)} weights to "
                f"{list(after)}; streamed experts follow cuts of the output rows or the input "
                f"columns into {parts} equal parts only"
            )
    if bias is not None:  # coded by _code_biases: the values a plain cut leaves
        code = _code(bias)
        n = code.shape[-1] // parts
        want = code[..., part * n : (part + 1) * n] if cut == 0 else code
        if lin.bias.shape != want.shape or not mx.array_equal(lin.bias, want).item():
            raise CheckpointError(
                f"{where}: the model's shard() changes the values of the experts' biases (not "
                "only which part a process keeps), which streamed experts do not follow"
            )
    return cut


def _cuts(
    layout: ExpertLayout, proj: str, cut: Optional[int], part: int, parts: int, where: str
) -> Cuts:
    """The components of ``proj`` cut as mlx's ``shard_inplace`` cuts a stacked linear: rows
    cut every parameter (bias too); input columns cut the weight and its quantization scales and
    biases, and leave the bias whole."""
    if cut is None:
        return {}
    out = {}
    for c in layout.components:
        if c.projection != proj or (cut == -1 and c.param == "bias"):
            continue
        if c.param == "global_scale":
            raise CheckpointError(
                f"{where}: {proj}: nvfp4 experts with a global scale are not split by tensor "
                "parallelism"
            )
        out[c.name] = (cut, part, parts)
    return out


def _tensor_shard(model: nn.Module, layout: ModelLayout, group, where: str) -> Dict[int, Cuts]:
    """``model.shard(group)``, and the cuts it made to each layer's experts."""
    experts = find_experts(model)
    before = {
        (p, proj): tuple(getattr(em.module, proj).weight.shape)
        for p, em in experts.items()
        for proj in em.projections
    }
    codes = _code_biases(experts)
    part, parts = group.rank(), group.size()
    try:
        model.shard(group)
    except ValueError as e:  # e.g. a quantized attention projection cut inside its groups
        raise CheckpointError(f"{where}: mlx-lm's shard() cannot split it {parts} ways: {e}") from e
    cuts: Dict[int, Cuts] = {}
    layer_of = {p: i for i, p in layout.module_paths.items()}
    for p, em in find_experts(model).items():
        i = layer_of.get(p)
        if i is None:  # not in the files: _replace_switch_modules says so
            continue
        cuts[i] = {}
        for proj in em.projections:
            lin = getattr(em.module, proj)
            cut = _split_of(
                before[(p, proj)], lin, codes.get((p, proj)), parts, part, f"{where}: {p}"
            )
            cuts[i].update(_cuts(layout.layers[i], proj, cut, part, parts, f"{where}: {p}"))
    return cuts


def sharded_load(
    path,
    pipeline_group: Optional[mx.distributed.Group] = None,
    tensor_group: Optional[mx.distributed.Group] = None,
    *,
    model_config: Optional[dict] = None,
    tokenizer_config: Optional[dict] = None,
    options: Optional[LoadOptions] = None,
    **load_options,
) -> Tuple[nn.Module, object]:
    """This process's share of a model spread over the processes of ``mx.distributed`` groups,
    its routed experts streamed from disk: what ``mlx_lm.utils.sharded_load`` gives, and only
    this share's experts read.

    Args:
        path: a converted directory or a plain mlx-lm checkpoint (``~`` is expanded), or a
            Hugging Face repo id (``model.source``); every process reads its own copy (on its
            own machine) or a shared one.
        pipeline_group: split the layers over this group (``model.model.pipeline``): each
            process opens and caches only the experts of its own layers.
        tensor_group: split every layer over this group (``model.shard``): each process reads
            only its part of every expert. Neither group: tensor parallelism over
            ``mx.distributed.init()`` where the model has ``shard``, else a pipeline (as mlx-lm).
        model_config, tokenizer_config: as for ``load``.
        options: every load option at once (``LoadOptions``).
        **load_options: ``expert_io``, ``backend``, ``cache_budget`` (for this process's share),
            ``eviction``, ``pin_experts``: as for ``load``; they override ``options``.

    Returns:
        ``(model, tokenizer)``; ``model.moeflux`` is the runtime of this share, and its
        ``stats_dict()`` counts this process's reads only.

    Raises:
        CheckpointError: not a usable MoE checkpoint, or a model that does not split the way
            asked (no ``shard`` / ``pipeline``, a cut streamed experts do not follow:
            ``LayoutError``, ``UnsupportedQuantizationError`` for a cut inside a quantization
            group); no tokenizer files: ``MissingTokenizerError``.
        ExpertFileError: an expert file is missing, unreadable or of the wrong size.
        OptionError: a bad option; TypeError: an unknown one.
    """
    path = resolve_model_path(path)
    opts = _options(options, load_options)
    full = expert_layout(path)
    require_tokenizer(path, tokenizer_config)  # after the checkpoint's own checks
    model, config = _load_lazily(path, full, model_config)
    has_pipeline = hasattr(model, "model") and hasattr(model.model, "pipeline")
    has_shard = hasattr(model, "shard")
    kind = config.get("model_type")
    if pipeline_group is not None and not has_pipeline:
        raise CheckpointError(f"{path}: mlx-lm's {kind} model does not support pipelining")
    if tensor_group is not None and not has_shard:
        raise CheckpointError(f"{path}: mlx-lm's {kind} model does not support tensor parallelism")
    if pipeline_group is None and tensor_group is None:
        if not (has_shard or has_pipeline):
            raise CheckpointError(f"{path}: mlx-lm's {kind} model does not support any sharding")
        if has_shard:
            tensor_group = mx.distributed.init()
        else:
            pipeline_group = mx.distributed.init()
    cuts: Dict[int, Cuts] = {}
    if tensor_group is not None:
        cuts = _tensor_shard(model, full, tensor_group, str(path))
        if any(cuts.values()) and opts.tuning.device_table is not False:
            # the device-side table's miss server reads whole experts, in a process of its own
            if opts.tuning.device_table:
                log.warning("tensor parallelism: the device-side slot table is not used")
            opts = dataclasses.replace(
                opts, tuning=dataclasses.replace(opts.tuning, device_table=False)
            )
    if pipeline_group is not None:
        try:
            model.model.pipeline(pipeline_group)
        except ValueError as e:  # more processes than layers
            raise CheckpointError(f"{path}: mlx-lm's pipeline() cannot split it: {e}") from e
    layer_of = {p: i for i, p in full.module_paths.items()}
    shards: Dict[int, Optional[ExpertShard]] = {}
    experts = find_experts(model)
    for p in experts:
        i = layer_of.get(p)
        if i is not None:
            shards[i] = full.layers[i].shard(cuts[i], f"{path}: layer {i}") if cuts.get(i) else None
    store, share = open_store(
        path,
        opts.expert_io,
        opts.tuning.threads,
        shards,
        warm_threads=opts.tuning.warm_read_threads,
    )
    try:
        runtime = StreamingRuntime(store, share, opts, Path(path))
    except Exception:
        store.close()
        raise
    try:
        if experts:  # a stage of dense layers only streams nothing
            _replace_switch_modules(model, runtime, config, path)
            runtime.prefill_step_size = prefill_step(model, runtime)
            runtime.warn_small_budget(top_k_of(config, model))
        mx.eval(model.parameters(), mx.random.state)
        # as mlx-lm: every process has loaded before the first collective of a forward pass;
        # on the group's own stream (mlx-lm's stream=mx.cpu fails under MLX 0.32's NCCL)
        mx.eval(mx.distributed.all_sum(mx.array(1.0)))
        tokenizer = load_tokenizer(
            path, tokenizer_config, eos_token_ids=config.get("eos_token_id", None)
        )
    except Exception:
        runtime.close()
        raise
    log.info(
        "this process's share: MoE layers %s, %.2f MB of %.2f MB of experts",
        sorted(share.layers),
        share.total_expert_bytes / 1e6,
        full.total_expert_bytes / 1e6,
    )
    model.moeflux = runtime
    runtime.close_with(model)
    return model, tokenizer

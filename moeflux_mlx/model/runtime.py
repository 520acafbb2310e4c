"""What the streaming modules of one model share: ``StreamingRuntime`` (``model.moeflux``), and
the factory that picks its cache (``make_cache``: the one place outside ``cuda/`` that knows the
device-side table exists)."""

from __future__ import annotations

import contextlib
import logging
import weakref
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import psutil

from ..cache import wired
from ..cache.curve import BudgetChoice, resolve_budget
from ..cache.expert_cache import ExpertCache
from ..cache.policy import POLICIES
from ..cache.pool import DeviceStaging
from ..cache.slots import SlotCache, TooSmall, too_small
from ..cache.whole_layer import WholeLayerPrefill
from ..compute.backend import (
    Backend,
    backend_report,
    layer_choice,
    select_backend,
    served_summary,
)
from ..compute.kernels import MAX_TOKENS, ExpertSpec, KernelBackend
from ..counters import Stats
from ..cuda import layer_copy
from ..cuda import runtime as cuda_runtime
from ..cuda.table_cache import DeviceTable, table_layers
from ..errors import ModelClosedError
from ..format.layout import ModelLayout
from ..io.store import ExpertStore
from ..options import LoadOptions, Tuning

log = logging.getLogger(__name__)


def use_table(tuning: Tuning) -> bool:
    """Whether decode uses the device-side table: wherever it can run (MLX's CUDA backend and
    libcudart), unless ``tuning.device_table`` says otherwise."""
    available = cuda_runtime.table_available()
    if tuning.device_table and not available:
        log.warning(
            "device-side slot table requested, but it needs MLX's CUDA backend and "
            "libcudart: using a host sync per layer"
        )
    return available if tuning.device_table is None else bool(tuning.device_table) and available


def machine_choices(tuning: Tuning, layer_bytes: int = 0) -> List[Tuple[str, str]]:
    """What the machine decided rather than an option (``Tuning``), for ``doctor`` and ``info``.

    Args:
        tuning: the load options' ``tuning`` (the defaults: this machine's choices).
        layer_bytes: the largest MoE layer's expert bytes, where a model is known (0: none):
            the page-locked staging a prefill holds is two of them.

    Returns:
        ``(what, the choice and why)`` rows.
    """
    table = use_table(tuning)
    device_writes = cuda_runtime.device_slot_writes(tuning.slot_writes)
    warm = tuning.warm_read_threads
    return [
        (
            "read threads",
            f"{tuning.threads} (the cores, 8 to 16)"
            + (f"; {warm} for a few experts the page cache holds" if warm else ""),
        ),
        (
            "device-side table",
            "on: decode looks slots up on the GPU, a miss server reads misses"
            if table
            else "off: one host sync per call (it needs MLX's CUDA backend and libcudart)",
        ),
        (
            "slot writes",
            "device: host staging, then a GPU scatter"
            if device_writes
            else "host: straight into the slots' memory",
        ),
        (
            "whole-layer prefill",
            f"from {tuning.prefill_whole_layer:g} routed rows per expert, on every read thread, "
            "the next layer read ahead" + (_staging_note(layer_bytes) if device_writes else "")
            if tuning.prefill_whole_layer > 0
            else "never",
        ),
    ] + (
        [
            (
                "miss server",
                f"polls every {tuning.server_poll_us:g}-{tuning.server_poll_max_us:g} us; the GPU "
                f"waits for it at most {tuning.wait_timeout_s:g} s",
            )
        ]
        if table
        else []
    )


def _staging_note(layer_bytes: int) -> str:
    n = layer_copy.PinnedStaging.BUFFERS
    held = f" ({n} x {layer_bytes / 1e6:,.0f} MB)" if layer_bytes else ""
    return (
        f" into {n} page-locked layer buffers{held}, or straight out of the pinned expert files,"
        " moved to the GPU by its copy engine"
    )


# what stock mlx-lm prefills in one forward pass (generate_step's ``prefill_step_size``)
MLX_LM_PREFILL_STEP = 2048
# larger steps a prompt may take where experts stream, largest first
STREAMED_PREFILL_STEPS = (16384, 8192, 4096)
# of the memory available at load, what one step's transient arrays may take
PREFILL_MEMORY_SHARE = 0.1


def prefill_step(model: nn.Module, runtime: StreamingRuntime) -> int:
    """The prompt tokens a forward pass should take while prefilling (mlx-lm's
    ``prefill_step_size``). Where every expert is resident, stock's 2048. Where experts stream,
    every step of a prompt reads each partly cached layer whole, so fewer, larger steps read less:
    the largest of ``STREAMED_PREFILL_STEPS`` whose transient arrays fit ``PREFILL_MEMORY_SHARE``
    of the memory available, counting the attention scores of a step against itself (heads x
    step^2 x 4 bytes, the worst case, where attention is not fused) and each token's hidden
    states.

    Args:
        model: the mlx-lm model (its ``args`` give the attention heads and the hidden size).
        runtime: its ``StreamingRuntime``.

    Returns:
        The step.
    """
    slots = runtime.cache.slots
    if all(slots.n_slots[i] >= lay.num_experts for i, lay in runtime.layout.layers.items()):
        return MLX_LM_PREFILL_STEP
    args = getattr(model, "args", None)
    hidden = int(getattr(args, "hidden_size", 0) or 4096)
    heads = int(getattr(args, "num_attention_heads", 0) or max(1, hidden // 128))
    room = PREFILL_MEMORY_SHARE * psutil.virtual_memory().available
    for step in STREAMED_PREFILL_STEPS:
        if heads * step * step * 4 + step * hidden * 64 <= room:
            return step
    return MLX_LM_PREFILL_STEP


def make_cache(
    store: ExpertStore,
    layout: ModelLayout,
    options: LoadOptions,
    budget: BudgetChoice,
) -> ExpertCache:
    """The cache for ``options``: slots under the budget (none at budget 0, or one too small
    for one expert per layer), the whole-layer prefill path, and, on CUDA, the device-side table
    for partly cached layers.

    Args:
        store: the model's expert store.
        layout: its expert layout.
        options: the load options (budget, eviction, pinning, tuning).
        budget: the budget resolved (``cache.curve.resolve_budget``: ``"auto"`` needs the
            model directory, which the runtime knows and this factory does not).

    Returns:
        The model's ``ExpertCache``.

    Raises:
        OptionError: the budget is not one.
        DeviceWaitError: the device-side table's miss server did not start.
        DeviceSetupError: ``pin_experts`` could not page-lock the expert files.
    """
    budget_bytes = budget.bytes
    # on Metal: pools + staging within the recommended working set, else macOS may page them out
    budget_bytes, note = wired.fit_budget(
        budget_bytes, wired.staging_bytes_estimate(layout), wired.MetalMemory().working_set()
    )
    if note:
        log.warning("expert cache budget %s", note)
    device_writes = cuda_runtime.device_slot_writes(options.tuning.slot_writes)
    staging = DeviceStaging(cuda_runtime.host_array) if device_writes else None
    slots = SlotCache(store, layout, budget_bytes, staging, POLICIES[options.eviction])
    layer_staging = layer_copy.PinnedStaging() if device_writes else None
    whole = WholeLayerPrefill(
        store,
        layer_staging,
        slots.slot_count,
        slots.observe,
        options.tuning.prefill_whole_layer,
    )
    table: Optional[DeviceTable] = None
    if use_table(options.tuning) and table_layers(layout, slots.n_slots):
        table = DeviceTable(store, layout, slots, options)
        whole.reads.pinned.update(table.whole_layer_copies())
    elif options.pin_experts:  # asked for (None: the machine's choice, nothing to warn of)
        log.warning(
            "pin_experts: no layer is looked up by the device-side table (CUDA, a partial "
            "budget), so nothing is pinned"
        )
    capacity = slots.capacity_bytes
    log.info(
        "expert cache: %.2f GB budget, %.2f GB in slots (%.0f%% of the experts)",
        budget_bytes / 1e9,
        capacity / 1e9,
        100 * capacity / max(layout.total_expert_bytes, 1),
    )
    return ExpertCache(store, slots, whole, table, staging)


def _si_bytes(n: float) -> str:
    """``n`` bytes in SI units (``2.62 MB``), as the commands write them."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError


NOT_PICKLED = (
    "a model whose experts stream from disk cannot be pickled: its runtime (model.moeflux) "
    "holds open expert files, threads and the expert cache; in the other process, load it "
    "again with moeflux_mlx.load(path)"
)


class _Lifetime:
    """Held by a model and every copy of it (``copy.deepcopy`` shares it); its runtime closes
    when the last of them is collected (``StreamingRuntime.close_with``)."""

    __slots__ = ("__weakref__",)

    def __deepcopy__(self, memo) -> _Lifetime:
        return self

    def __reduce_ex__(self, protocol):
        raise TypeError(NOT_PICKLED)


class StreamingRuntime:
    """What the streaming modules of one model share: store, cache, backend and counters.

    Reached as ``model.moeflux``; ``close()`` (or ``with``) releases files, maps, threads and
    the miss server. ``copy.deepcopy(model)`` copies the dense weights and shares this runtime
    (one store, one expert cache, one set of counters: use the copies from one thread at a
    time; closing it closes it for all). Pickling raises ``TypeError``: an open runtime cannot
    travel; load the model again where it is needed."""

    def __init__(
        self,
        store: ExpertStore,
        layout: ModelLayout,
        options: LoadOptions,
        model_dir: Optional[Path] = None,
    ):
        self.store, self.layout, self.options = store, layout, options
        self.model_dir = model_dir
        self._stats = Stats()
        self.backend: Backend = select_backend(options.backend)
        # the budget in bytes and why (``"auto"`` read from the model's curve here, once)
        self.budget = resolve_budget(options.cache_budget, layout, model_dir, options.eviction)
        if self.budget.auto:
            log.info("cache budget %s", self.budget.why)
        self.cache = make_cache(store, layout, options, self.budget)
        # layer, router indices of each call, while a calibration records them (else None)
        self.routing_sink: Optional[Callable[[int, mx.array], None]] = None
        # Metal: the slots and staging stay resident (wired) while the model is open
        self.wiring = wired.Wiring(self.cache.capacity_bytes + wired.staging_bytes_estimate(layout))
        # where each forward pass checks what the miss server or the GPU ran into (once per pass:
        # decode is host-bound, and the per-layer check cost more than the lookup)
        self.first_layer = min(layout.layers) if layout.layers else None
        self.closed = False
        self.verifying = False  # see verifying_drafts
        # the prompt tokens a prefill's forward pass should take (``prefill_step``), set by the
        # loader once the model is built; give it to mlx-lm's generate functions
        self.prefill_step_size = MLX_LM_PREFILL_STEP
        self._reads_outside: Dict[tuple, bool] = {}  # see reads_outside

    @contextlib.contextmanager
    def verifying_drafts(self) -> Iterator[None]:
        """Forward passes built within it verify draft tokens (speculation), so the cache may
        serve them as one table call or a lookup per token (``ExpertCache.verify_pass``: the
        device-side table, with no host sync). Elsewhere a multi-token call is computed whole,
        as stock mlx-lm computes it."""
        before, self.verifying = self.verifying, True
        try:
            yield
        finally:
            self.verifying = before

    def reads_outside(self, layer: int, x: mx.array, indices: mx.array, activation) -> bool:
        """Whether the expert computation of ``layer`` takes a call shaped like this one, its
        slots naming experts outside the pool (``cache.pool.IN_PLACE_BIT``), without a host
        sync: the fused CUDA kernels, where they cover the layer. Plain ops read such experts
        too, but only after a host sync; the cache then serves a speculative pass larger than
        the slots a token at a time instead."""
        key = (layer, x.dtype, tuple(indices.shape), type(activation))
        known = self._reads_outside.get(key)
        if known is None:
            b = self.backend
            known = self._reads_outside[key] = (
                isinstance(b, KernelBackend)
                and b.dialect == "cuda"
                and indices.size // indices.shape[-1] <= MAX_TOKENS
                and layer_choice(
                    b,
                    ExpertSpec.of_layout(self.store.layout(layer)),
                    activation,
                    dtype=x.dtype,
                    topk=indices.shape[-1],
                ).backend
                == "cuda"
            )
        return known

    @property
    def stats(self) -> Stats:
        return self._stats

    def stats_dict(self) -> dict:
        """The counters (``Stats.to_dict``) and what served them: I/O mode, cache, backend.

        ``backend`` is what actually computed the experts: before any call, what will
        (``"metal"``, ``"ops"``, ``"ops (fallback: <why>)"``); after calls, the backend that
        served them all, else each with its share (kernels for decode, ops for prefill, or ops
        for a variant that failed its self-check). ``layers[i]["backend"]`` counts calls per
        backend for layer ``i``; ``backend_requested`` is the option's value resolved."""
        self.cache.settle(self._stats)  # what the miss server read is counted when it is asked
        d = self._stats.to_dict()
        d.update(
            io_mode=self.store.io_mode,
            cache=self.cache.name,
            backend=served_summary(d["served"], backend_report(self.backend)),
            backend_requested=self.backend.name,
            device_table=self.cache.table is not None,
        )
        return d

    def warn_small_budget(self, top_k: Optional[int]) -> Optional[TooSmall]:
        """Warn (one line, at load) when the cache budget gives some layer fewer slots than the
        experts one token routes: every call there is then served from staging, as with a budget
        of 0, whatever the budget and the policy say.

        Args:
            top_k: the experts a token routes (``model.experts.top_k_of``; None: unknown).

        Returns:
            What falls short (``cache.slots.TooSmall``), or None.
        """
        slots = self.cache.slots
        short = too_small(self.layout, slots.budget_bytes, top_k)
        if short is not None:
            given = self.options.cache_budget
            shown = _si_bytes(slots.budget_bytes)
            budget = shown if given is None or str(given) == shown else f"{given} ({shown})"
            log.warning("cache budget %s: %s", budget, short.describe(_si_bytes))
        return short

    def reset_stats(self) -> None:
        self.cache.settle(self._stats)  # what was read so far counts before the reset
        self._stats.reset()

    def check_open(self) -> None:
        if self.closed:
            raise ModelClosedError("this moeflux model was closed; load it again")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.cache.close()
                self.store.close()
            finally:
                self.wiring.close()

    def close_with(self, model) -> None:
        """Close when ``model`` and every deep copy of it are collected (e.g. mlx-lm's server
        dropping a model it swapped out)."""
        lifetime = model._moeflux_lifetime = _Lifetime()
        weakref.finalize(lifetime, self.close)

    def __deepcopy__(self, memo) -> StreamingRuntime:
        return self  # the files, threads and cache are shared, not copied

    def __reduce_ex__(self, protocol):
        raise TypeError(NOT_PICKLED)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

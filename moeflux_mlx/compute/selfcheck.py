"""The fused kernels check themselves before they serve a layer.

Each kernel variant (dialect, activation and scale dtypes, bits, group size, and the layer's
shape class: hidden and intermediate size, experts per token, tokens per call) runs once on a
small random input of the layer's real shape, and its output is compared with the plain-ops
path (``compute.ops.OpsBackend``, mlx-lm's own ``gather_qmm`` calls) on the same pool and slots,
within ``TOLERANCE`` (docs/kernels.md). A variant that does not compile, raises, leaves output
unwritten or non-finite, or differs by more than the tolerance, falls back to plain ops, with one
warning naming the variant and the error.

Verdicts are kept per process and on disk, in ``<cache>/moeflux-mlx/selfcheck/`` (``<cache>``:
``$XDG_CACHE_HOME``, else ``~/.cache``), one file per dialect, machine, MLX version and hash of the
kernel text: the check runs once per machine and kernel version. Delete the folder to check again.

The caller (``compute.kernels.KernelBackend``) hands over the check itself as a function: this
module knows how to build the random pool, compare and remember, not how kernels launch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..cache.pool import ExpertPool
from ..options import user_cache_dir

log = logging.getLogger(__name__)

# ||kernel - ops|| / ||ops|| over the whole output, per activation dtype: two fp32-accumulating
# implementations that both round gate, up and h to the activation dtype (docs/kernels.md).
# the MLX whose kernels a verdict is for (its stubs omit ``__version__``, the module has it)
MLX_VERSION: str = mx.__version__  # type: ignore[attr-defined]
TOLERANCE = {"bfloat16": 2e-2, "float16": 3e-3, "float32": 1e-5}
ERROR_CHARS = 4000  # of an error message kept on disk (MLX's compile logs can be long)
WARN_CHARS = 600  # ... and shown in the warning
CHECK_SLOTS = 2  # distinct random experts in the check's pool (of the layer's real shape)

# Tests point this at a temporary folder (None: the user's cache folder).
CACHE_DIR: Optional[Path] = None


class SelfCheckMismatch(RuntimeError):
    """The kernels ran but their output is not the plain-ops path's."""


def dtype_name(dtype) -> str:
    """``mx.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).rsplit(".", 1)[-1]


@dataclass(frozen=True)
class Variant:
    """What decides a kernel variant: the source MLX compiles (dtypes, bits, group size, the
    template's shape constants) and the launch (tokens x experts per token)."""

    dialect: str
    dtype: str  # activation dtype
    scales: str  # dtype of the scales and biases
    slots: str  # dtype of the slot indices
    bits: int
    group_size: int
    hidden: int
    inter: int
    topk: int
    tokens: int

    @property
    def label(self) -> str:
        scales = "" if self.scales == self.dtype else f" (scales {self.scales})"
        return (
            f"{self.dialect} glu+down {self.dtype}{scales} {self.bits}-bit g{self.group_size} "
            f"H{self.hidden} I{self.inter} K{self.topk} T{self.tokens}"
            + ("" if self.slots == "uint32" else f" slots {self.slots}")
        )


@dataclass
class Verdict:
    ok: bool
    error: str = ""  # why the variant failed ("" when it passed)
    rel_err: Optional[float] = None  # ||kernel - ops|| / ||ops||, when it ran
    seconds: float = 0.0  # the check's wall time when it ran
    checked: str = ""  # when (UTC, ISO 8601)
    cached: bool = False  # read from the disk cache: this process did not run it


def cache_root() -> Path:
    if CACHE_DIR is not None:
        return Path(CACHE_DIR)
    return user_cache_dir() / "selfcheck"


def device_description() -> str:
    """The GPU as MLX names it (``mx.device_info``), else the CPU."""
    try:
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        return str(info.get("device_name") or info.get("architecture") or "")
    except Exception:  # noqa: BLE001 - no GPU backend: the CPU build has no device info
        return ""


def machine_id() -> str:
    """This machine, as far as a kernel's behaviour goes: host, OS, architecture, GPU."""
    parts = (
        platform.node(),
        platform.system(),
        platform.release(),
        platform.machine(),
        device_description(),
    )
    return hashlib.sha1("\0".join(parts).encode()).hexdigest()[:12]


def cache_file(dialect: str, source_digest: str) -> Path:
    return cache_root() / f"{dialect}-{machine_id()}-mlx{MLX_VERSION}-{source_digest}.json"


class SelfCheck:
    """The verdicts of one dialect's kernels (one kernel-text hash): this process's, then the
    disk's, else the check is run and its verdict stored."""

    def __init__(self, dialect: str, source_digest: str):
        self.dialect, self.source_digest = dialect, source_digest
        self.path = cache_file(dialect, source_digest)
        self.verdicts: Dict[str, Verdict] = {}
        self._disk: Optional[Dict[str, dict]] = None
        self.runs = 0  # checks this process ran (tests count them)

    def _load(self) -> Dict[str, dict]:
        if self._disk is None:
            try:
                self._disk = json.loads(self.path.read_text()).get("variants", {})
            except (OSError, ValueError, AttributeError):
                self._disk = {}
        return self._disk

    def _store(self, label: str, verdict: Verdict) -> None:
        disk = self._load()
        disk[label] = {k: v for k, v in asdict(verdict).items() if k != "cached"}
        doc = {
            "dialect": self.dialect,
            "mlx": MLX_VERSION,
            "kernel_source": self.source_digest,
            "machine": {
                "node": platform.node(),
                "system": f"{platform.system()} {platform.release()}",
                "machine": platform.machine(),
                "device": device_description(),
            },
            "variants": disk,
        }
        try:  # written whole and renamed: concurrent processes never see half a file
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".selfcheck-")
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as e:
            log.info("could not store the kernel self-check in %s: %s", self.path, e)

    def verdict(self, variant: Variant, run: Callable[[], float]) -> Verdict:
        """The verdict on ``variant``: remembered, else ``run()`` (which returns the relative
        error, or raises) is run once and its verdict stored. A failed variant is warned about
        once per process."""
        label = variant.label
        v = self.verdicts.get(label)
        if v is not None:
            return v
        v = self.recorded(variant)
        if v is None:
            v = self._run(variant, run)
            self._store(label, v)
        self.verdicts[label] = v
        if not v.ok:
            short = v.error if len(v.error) <= WARN_CHARS else v.error[:WARN_CHARS] + " ..."
            log.warning(
                "%s kernels failed their self-check for %s: %s. This variant runs on plain MLX "
                "ops instead (the results are the ops path's). Verdict kept in %s.",
                self.dialect,
                label,
                short,
                self.path,
            )
        return v

    def recorded(self, variant: Variant) -> Optional[Verdict]:
        """The verdict on ``variant`` this process reached or the disk keeps, without running
        the check (``moeflux-mlx info`` asks this).

        Args:
            variant: the kernel variant.

        Returns:
            The verdict, or None when neither has one.
        """
        v = self.verdicts.get(variant.label)
        if v is not None:
            return v
        known = self._load().get(variant.label)
        if known is None:
            return None
        fields = {k: known[k] for k in ("ok", "error", "rel_err", "seconds", "checked")}
        return Verdict(**fields, cached=True)

    def _run(self, variant: Variant, run: Callable[[], float]) -> Verdict:
        self.runs += 1
        t0 = time.perf_counter()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        try:
            err = float(run())
        except Exception as e:  # noqa: BLE001 - a compile error, a launch error, a mismatch
            kind = "mismatch" if isinstance(e, SelfCheckMismatch) else type(e).__name__
            text = f"{kind}: {e}".strip()
            return Verdict(False, text[:ERROR_CHARS], None, time.perf_counter() - t0, stamp)
        log.info("%s self-check passed for %s (rel. error %.2e)", self.dialect, variant.label, err)
        return Verdict(True, "", err, time.perf_counter() - t0, stamp)


_CHECKS: Dict[Tuple[str, str, Path], SelfCheck] = {}


def checker(dialect: str, source_digest: str) -> SelfCheck:
    """The process-wide ``SelfCheck`` of a dialect's kernel text (shared by every model)."""
    key = (dialect, source_digest, cache_root())
    c = _CHECKS.get(key)
    if c is None:
        c = _CHECKS[key] = SelfCheck(dialect, source_digest)
    return c


def forget() -> None:
    """Drop this process's verdicts (as a new process would start; the disk cache stays)."""
    _CHECKS.clear()


# ---------------------------------------------------------------------------------------------
# the check's inputs and comparison


def _seed(variant: Variant) -> int:
    return int(hashlib.sha1(variant.label.encode()).hexdigest()[:8], 16)


def random_pool_like(pool: ExpertPool, variant: Variant, n_slots: int = CHECK_SLOTS) -> ExpertPool:
    """``n_slots`` random experts with ``pool``'s arrays' shapes and dtypes, laid out as a pool
    of expert blobs is (``ExpertPool.from_blobs``: one uint8 buffer per slot, each component at a
    64-byte aligned offset, typed strided views), so the kernels read them as they read the real
    pool. Packed weights are random bits; scales and biases keep every dequantized weight of a
    row near ``1/sqrt(in)`` in size, so outputs stay O(1) in every dtype."""
    rng = np.random.default_rng(_seed(variant))
    qmax = (1 << variant.bits) - 1
    comps: Dict[str, np.ndarray] = {}
    for name, arr in pool.arrays.items():
        shape = (n_slots, *arr.shape[1:])
        if name.endswith(".weight") and arr.dtype == mx.uint32:
            comps[name] = rng.integers(0, 1 << 32, size=shape, dtype=np.uint64).astype(np.uint32)
            continue
        proj = name.rsplit(".", 1)[0]
        w = pool.arrays.get(f"{proj}.weight")
        in_dim = w.shape[-1] * 32 // variant.bits if w is not None else arr.shape[-1]
        if name.endswith(".scales"):
            mag = rng.uniform(0.5, 1.5, size=shape) * 2.0 / (qmax * math.sqrt(in_dim))
            comps[name] = mag * rng.choice([-1.0, 1.0], size=shape)
        elif name.endswith(".biases"):
            s = comps.get(f"{proj}.scales")
            base = -0.5 * qmax * s if s is not None and s.shape == shape else 0.0
            comps[name] = base + rng.normal(0.0, 0.1 / math.sqrt(in_dim), size=shape)
        else:
            comps[name] = rng.normal(0.0, 1.0 / math.sqrt(in_dim), size=shape)
    offsets, total = {}, 0
    for name in pool.arrays:
        nbytes = int(np.prod(pool.arrays[name].shape[1:])) * pool.arrays[name].dtype.size
        offsets[name] = (total, nbytes)
        total += -(-nbytes // 64) * 64
    blob = mx.zeros((n_slots, max(total, 64)), mx.uint8)
    parts = []
    for name, arr in pool.arrays.items():
        off, nbytes = offsets[name]
        typed = mx.array(comps[name]).astype(arr.dtype) if arr.dtype != mx.uint32 else None
        raw = (
            mx.array(comps[name]).view(mx.uint8)
            if typed is None
            else typed.view(mx.uint8).reshape(n_slots, -1)
        )
        parts.append((off, nbytes, raw.reshape(n_slots, nbytes)))
    for off, nbytes, raw in parts:
        blob[:, off : off + nbytes] = raw
    arrays = {}
    for name, arr in pool.arrays.items():
        off, nbytes = offsets[name]
        arrays[name] = blob[:, off : off + nbytes].view(arr.dtype).reshape(n_slots, *arr.shape[1:])
    mx.eval(list(arrays.values()))
    return ExpertPool(arrays, pool.quantization, dict(pool.overrides))


def random_inputs(
    variant: Variant, x_shape: Tuple[int, ...], slots_shape: Tuple[int, ...], n_slots: int
) -> Tuple[mx.array, mx.array]:
    """Activations ~ N(0, 1) in the variant's dtype and slot indices into ``n_slots`` experts,
    shaped like the real call's."""
    rng = np.random.default_rng(_seed(variant) + 1)
    x = mx.array(rng.normal(size=x_shape).astype(np.float32)).astype(getattr(mx, variant.dtype))
    slots = rng.integers(0, n_slots, size=slots_shape)
    return x, mx.array(slots).astype(getattr(mx, variant.slots))


def relative_error(out: mx.array, ref: mx.array, dtype: str) -> float:
    """``||out - ref|| / ||ref||``; raises ``SelfCheckMismatch`` above ``TOLERANCE[dtype]``,
    for a shape or dtype that is not the reference's, or for output that is not finite (the
    check poisons kernel outputs with NaN first: unwritten output shows here)."""
    mx.eval(out, ref)
    if tuple(out.shape) != tuple(ref.shape) or out.dtype != ref.dtype:
        raise SelfCheckMismatch(
            f"output {out.dtype}{tuple(out.shape)}, expected {ref.dtype}{tuple(ref.shape)}"
        )
    o = np.array(out.astype(mx.float32)).astype(np.float64)
    r = np.array(ref.astype(mx.float32)).astype(np.float64)
    if not np.isfinite(o).all():
        bad = int((~np.isfinite(o)).sum())
        raise SelfCheckMismatch(f"{bad} of {o.size} outputs not written or not finite")
    denom = float(np.linalg.norm(r)) or 1.0
    err = float(np.linalg.norm(o - r)) / denom
    tol = TOLERANCE[dtype]
    if not err <= tol:
        raise SelfCheckMismatch(f"||kernel - ops|| / ||ops|| = {err:.3g} > {tol:g}")
    return err

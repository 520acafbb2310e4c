"""Convert an mlx-lm checkpoint directory into a streaming directory:

    DST/packed_experts/layer_NN.bin   expert e of layer NN at byte e * blob_size
    DST/packed_experts/layout.json    the ExpertLayout of every MoE layer
    DST/model*.safetensors            every non-expert tensor, byte for byte
    DST/config.json                   the source config plus a "moeflux" section
    DST/<tokenizer and other files>

Only byte ranges found in the safetensors headers are read, in chunks, so peak memory stays
bounded whatever the model size. Everything is written into ``DST.partial`` (files under
temporary names, renamed when complete) and ``DST.partial`` becomes ``DST`` in one rename at the
end; a rerun after an interruption resumes from the files already completed there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np
from tqdm import tqdm

from ..errors import CheckpointError, ConvertError, ExpertFileError, ExpertReadError, MoefluxError
from . import checksums
from .checkpoint import (
    LAYOUT_FILE,
    MOEFLUX_CONFIG_KEY,
    PACKED_DIR,
    CheckpointExperts,
    is_packed,
    packed_file,
    packed_layout,
    scan_checkpoint,
)
from .layout import FORMAT_VERSION, ExpertLayout
from .readers import PackedLayer, SafetensorsLayer, read_exact
from .safetensors import TensorRange, index_directory

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 1024 * 1024  # the most bytes held in memory at once while copying
SHARD_BYTES = 5 * 1024**3  # like mlx-lm's MAX_FILE_SIZE_GB
SKIP_FILES = {"config.json", "model.safetensors.index.json"}
STATE_FILE = ".moeflux-convert.json"


def convert(
    src,
    dst,
    *,
    verify: bool = False,
    progress: bool = True,
    notify: Optional[Callable[[str], None]] = None,
) -> Path:
    """Convert the mlx-lm checkpoint ``src`` into a streaming directory ``dst``.

    ``src`` is only read. ``dst`` appears in one rename once everything is written (and verified,
    with ``verify=True``), so it never exists half-written. A failed or killed conversion leaves
    ``dst.partial``; a rerun with the same, unchanged source resumes there (files completed before
    the interruption are kept), otherwise it starts afresh. An existing ``dst`` is checked: a
    finished conversion of this same source has its layer files' sizes and recorded checksums
    verified, and those that are wrong are rewritten from ``src`` (``notify`` names them; nothing
    else is touched); an empty directory is replaced by the result; anything else is refused.

    Args:
        src: an mlx-lm MoE checkpoint directory (experts stacked, as mlx-lm saves them).
        dst: the directory to write: dense safetensors, ``packed_experts/layer_NN.bin`` (one
            contiguous blob per expert) and ``packed_experts/layout.json``.
        verify: re-read everything written and compare it with ``src`` byte for byte.
        progress: show a progress bar.
        notify: called with a sentence for the user when there is nothing to do, when damaged
            layer files of a finished conversion were rewritten, when an interrupted conversion
            is resumed, or when a stale ``dst.partial`` is discarded.

    Returns:
        ``dst``.

    Raises:
        CheckpointError: ``src`` is not a usable MoE checkpoint.
        ConvertError: ``dst`` exists and is neither empty nor a finished conversion of this
            source, is ``src`` itself, writing failed (disk full, read-only) or the result does
            not verify. The message says whether ``dst.partial`` was kept.
    """
    src, dst = Path(src), Path(dst)
    say = notify or (lambda message: log.info("%s", message))
    if is_packed(src):
        raise CheckpointError(f"{src}: already a converted moeflux directory")
    ckpt = scan_checkpoint(src)  # every header checked before anything is written
    state = _fingerprint(ckpt)
    if _same_path(src, dst):
        raise ConvertError(f"{dst}: is SRC itself; choose another destination")
    if dst.exists() or dst.is_symlink():
        if _finished_from(dst, state):
            _repair(ckpt, dst, say, progress)
            return dst
        if not _empty_dir(dst):
            raise ConvertError(
                f"{dst}: already exists (and is not a conversion of {src}); remove it or "
                "choose another destination"
            )
    work = dst.with_name(dst.name + ".partial")
    try:
        _prepare_workdir(work, state, say)
        total = sum(r.nbytes for r in ckpt.dense.values()) + ckpt.layout.total_expert_bytes
        with tqdm(
            total=total, unit="B", unit_scale=True, desc="convert", disable=not progress
        ) as bar:
            _write_dense(ckpt, work, bar)
            (work / PACKED_DIR).mkdir(exist_ok=True)
            sums = {
                layer: _write_layer(ckpt, layer, layout, packed_file(work, layer), bar)
                for layer, layout in sorted(ckpt.layout.layers.items())
            }
        _write_layout(work, ckpt, sums)
        _copy_side_files(src, work)
        config = dict(ckpt.config)
        config[MOEFLUX_CONFIG_KEY] = {
            "format_version": FORMAT_VERSION,
            "layout": f"{PACKED_DIR}/{LAYOUT_FILE}",
            "moe_layers": sorted(ckpt.layout.layers),
            "total_expert_bytes": ckpt.layout.total_expert_bytes,
            "source": state,
        }
        _atomic_write_text(work / "config.json", json.dumps(config, indent=4))
        for tmp in list(work.glob("*.tmp")) + list((work / PACKED_DIR).glob("*.tmp")):
            if tmp.with_name(tmp.name[: -len(".tmp")]).exists():
                tmp.unlink()  # left by an interrupted earlier run, completed since
        if verify:
            try:
                verify_conversion(src, work, progress=progress)
            except ConvertError:
                shutil.rmtree(work, ignore_errors=True)  # wrong bytes: nothing worth resuming
                raise
        (work / STATE_FILE).unlink()  # a rerun still recognizes the work dir by its config.json
        _fsync_tree(work)
        os.rename(work, dst)
        _fsync_dir(dst.parent)
    except (ExpertReadError, ExpertFileError) as e:  # the source failed to read mid-way
        raise type(e)(
            f"{e}; {dst} was not created, the completed part is kept in {work} and a "
            "rerun resumes there"
        ) from e
    except MoefluxError:
        raise
    except OSError as e:  # disk full, permission denied on DST, ...
        if _empty_dir(work):
            try:
                work.rmdir()
            except OSError:
                pass
        if work.is_dir():
            kept = f"the completed part is kept in {work} and a rerun resumes there"
        else:  # e.g. a read-only destination: the work directory could not even be made
            kept = "nothing was written"
        raise ConvertError(f"{dst}: conversion failed: {e}; {dst} was not created, {kept}") from e
    log.info(
        "converted %s -> %s (%d MoE layers, %.2f GB of experts)",
        src,
        dst,
        len(ckpt.layout.layers),
        ckpt.layout.total_expert_bytes / 1e9,
    )
    return dst


def _fingerprint(ckpt: CheckpointExperts) -> dict:
    files = sorted(
        {r.file for r in ckpt.dense.values()}
        | {r.file for comps in ckpt.ranges.values() for r in comps.values()}
    )
    stats = {f.name: f.stat() for f in files}
    return {
        "format_version": FORMAT_VERSION,
        "source": str(ckpt.path.resolve()),
        "files": {n: [st.st_size, st.st_mtime_ns] for n, st in stats.items()},
    }


def _finished_from(dst: Path, state: dict) -> bool:
    """``dst`` is a finished conversion of the source ``state`` describes."""
    try:
        config = json.loads((dst / "config.json").read_text())
        return is_packed(dst) and config[MOEFLUX_CONFIG_KEY]["source"] == state
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _same_path(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def _empty_dir(path: Path) -> bool:
    try:
        return path.is_dir() and not path.is_symlink() and not any(path.iterdir())
    except OSError:
        return False


def _prepare_workdir(work: Path, state: dict, say: Callable[[str], None]) -> None:
    """Resume in ``work`` if it was left by a conversion of the same source, else start afresh."""
    try:
        if json.loads((work / STATE_FILE).read_text()) == state:
            done = sum(1 for f in work.rglob("*") if f.is_file() and f.suffix != ".tmp") - 1
            say(
                f"Resuming the interrupted conversion in {work} "
                f"({max(done, 0)} files already written are kept)."
            )
            return
    except (OSError, ValueError):
        pass
    if _finished_from(work, state):  # killed between the last write and the rename
        say(f"Resuming in {work}: it holds a complete conversion, only the final rename is left.")
        _atomic_write_text(work / STATE_FILE, json.dumps(state))
        return
    if work.exists() or work.is_symlink():
        say(f"Discarding {work}: it was left by a conversion of another or a changed source.")
        if work.is_dir() and not work.is_symlink():
            shutil.rmtree(work)
        else:
            work.unlink()
    work.mkdir(parents=True)
    _atomic_write_text(work / STATE_FILE, json.dumps(state))


def _shards(dense: Dict[str, TensorRange]) -> List[List[str]]:
    shards: List[List[str]] = [[]]
    size = 0
    for name in sorted(dense):
        if shards[-1] and size + dense[name].nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += dense[name].nbytes
    return shards


def _write_dense(ckpt: CheckpointExperts, work: Path, bar) -> None:
    shards = _shards(ckpt.dense)
    fmt = "model-{:05d}-of-{:05d}.safetensors" if len(shards) > 1 else "model.safetensors"
    weight_map = {}
    for i, names in enumerate(shards):
        out = work / fmt.format(i + 1, len(shards))
        weight_map.update({n: out.name for n in names})
        if out.exists():  # completed by an interrupted run of the same source
            bar.update(sum(ckpt.dense[n].nbytes for n in names))
            continue
        _write_safetensors(out, {n: ckpt.dense[n] for n in names}, bar)
    index = {
        "metadata": {"total_size": sum(r.nbytes for r in ckpt.dense.values())},
        "weight_map": dict(sorted(weight_map.items())),
    }
    _atomic_write_text(work / "model.safetensors.index.json", json.dumps(index, indent=4))


def _write_safetensors(out: Path, tensors: Dict[str, TensorRange], bar) -> None:
    """Write a safetensors file by copying each tensor's bytes in bounded chunks."""
    header: Dict[str, object] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for name, r in tensors.items():
        header[name] = {
            "dtype": r.dtype,
            "shape": list(r.shape),
            "data_offsets": [offset, offset + r.nbytes],
        }
        offset += r.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        buf = bytearray(min(CHUNK_BYTES, max((r.nbytes for r in tensors.values()), default=1)))
        for name, r in tensors.items():
            with open(r.file, "rb", buffering=0) as src:
                for start in range(0, r.nbytes, len(buf)):
                    n = min(len(buf), r.nbytes - start)
                    view = memoryview(buf)[:n]
                    read_exact(src.fileno(), r.start + start, view, f"{r.file} (tensor {name})")
                    f.write(view)
                    bar.update(n)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)


def _write_layout(work: Path, ckpt: CheckpointExperts, sums: Dict[int, np.ndarray]) -> None:
    """layout.json: the experts' layout and the checksum of every blob written."""
    d = ckpt.layout.to_dict()
    d[checksums.CHECKSUMS_KEY] = checksums.to_json(sums)
    _atomic_write_text(work / PACKED_DIR / LAYOUT_FILE, json.dumps(d, indent=1))


def _damage(path: Path, layer: int, layout: ExpertLayout, want: Optional[np.ndarray]) -> str:
    """What is wrong with a finished conversion's layer file ("" when nothing is)."""
    try:
        size = path.stat().st_size
    except OSError as e:
        return e.strerror or str(e)
    if size != layout.layer_bytes:
        return f"{size} bytes, {layout.layer_bytes} expected"
    if want is None:
        return ""
    try:
        got = checksums.file_checksums(path, layout, layer)
    except ExpertFileError as e:
        return str(e)
    bad = np.flatnonzero(got != want)
    if not bad.size:
        return ""
    return f"{bad.size} expert{'s' * (bad.size != 1)} not as written (expert {int(bad[0])} first)"


def _repair(ckpt: CheckpointExperts, dst: Path, say: Callable[[str], None], progress: bool) -> None:
    """Check a finished conversion's layer files (sizes, and the checksums recorded at
    conversion) and rewrite from the source those that are wrong, saying which."""
    layout_file = dst / PACKED_DIR / LAYOUT_FILE
    recorded = checksums.read_recorded(layout_file, packed_layout(dst))
    bad = {}
    total = ckpt.layout.total_expert_bytes
    with tqdm(total=total, unit="B", unit_scale=True, desc="check", disable=not progress) as bar:
        for layer, layout in sorted(ckpt.layout.layers.items()):
            want = None if recorded is None else recorded.get(layer)
            why = _damage(packed_file(dst, layer), layer, layout, want)
            if why:
                bad[layer] = why
            bar.update(layout.layer_bytes)
    checked = "sizes and checksums" if recorded is not None else "sizes only: no checksums recorded"
    if not bad:
        say(
            f"Nothing to do: {dst} is already a finished conversion of {ckpt.path} "
            f"({len(ckpt.layout.layers)} layer files checked, {checked})."
        )
        return
    try:
        with tqdm(
            total=sum(ckpt.layout.layers[i].layer_bytes for i in bad),
            unit="B",
            unit_scale=True,
            desc="rewrite",
            disable=not progress,
        ) as bar:
            sums = {}
            for layer in sorted(bad):
                path = packed_file(dst, layer)
                sums[layer] = _write_layer(ckpt, layer, ckpt.layout.layers[layer], path, bar, True)
        if recorded is None or any((sums[i] != recorded[i]).any() for i in sums):
            everything = dict(recorded or {})
            for layer, layout in ckpt.layout.layers.items():
                if layer not in everything:
                    everything[layer] = checksums.file_checksums(
                        packed_file(dst, layer), layout, layer
                    )
            everything.update(sums)
            _write_layout(dst, ckpt, everything)
        _fsync_dir(dst / PACKED_DIR)
    except MoefluxError:
        raise
    except OSError as e:
        raise ConvertError(f"{dst}: rewriting damaged layer files failed: {e}") from e
    listed = "; ".join(f"{packed_file(dst, i).name} (layer {i}: {why})" for i, why in bad.items())
    say(f"Repaired {dst}: rewrote {len(bad)} damaged layer file{'s' * (len(bad) != 1)}: {listed}.")


def _write_layer(
    ckpt: CheckpointExperts,
    layer: int,
    layout: ExpertLayout,
    out: Path,
    bar,
    rewrite: bool = False,
) -> np.ndarray:
    """Write one layer file from the source (kept when a resumed run finds it complete, unless
    ``rewrite``); return the CRC-32 of each blob in it."""
    if not rewrite and out.exists() and out.stat().st_size == layout.layer_bytes:
        bar.update(layout.layer_bytes)  # written, fsynced and renamed by an interrupted run
        return checksums.file_checksums(out, layout, layer)
    sums = np.empty(layout.num_experts, np.uint32)
    ranges = ckpt.ranges[layer]
    per_chunk = max(1, CHUNK_BYTES // layout.blob_size)
    blobs = np.zeros((per_chunk, layout.blob_size), np.uint8)  # zeros: alignment padding stays 0
    fds = {}
    tmp = out.with_name(out.name + ".tmp")
    try:
        for r in ranges.values():
            if r.file not in fds:  # one descriptor per file (setdefault would open one per tensor)
                fds[r.file] = os.open(r.file, os.O_RDONLY)
        with open(tmp, "wb") as f:
            for e0 in range(0, layout.num_experts, per_chunk):
                n = min(per_chunk, layout.num_experts - e0)
                for c in layout.components:
                    r = ranges[c.name]
                    # experts e0..e0+n of a stacked tensor are one contiguous range
                    part = np.empty((n, c.nbytes), np.uint8)
                    read_exact(
                        fds[r.file],
                        r.start + e0 * c.nbytes,
                        memoryview(part).cast("B"),
                        f"{r.file} (layer {layer}, {c.name})",
                    )
                    blobs[:n, c.offset : c.offset + c.nbytes] = part
                sums[e0 : e0 + n] = checksums.blob_checksums(blobs[:n])
                f.write(memoryview(blobs[:n]).cast("B"))
                bar.update(n * layout.blob_size)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        for fd in fds.values():
            os.close(fd)
    return sums


def _copy_side_files(src: Path, work: Path) -> None:
    """Tokenizer, generation config, chat template, custom model code: all but weights."""
    for f in src.iterdir():
        if f.is_file() and f.name not in SKIP_FILES and not f.name.endswith(".safetensors"):
            shutil.copy2(f, work / f.name)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_tree(work: Path) -> None:
    for d in (work / PACKED_DIR, work):
        if d.is_dir():
            _fsync_dir(d)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify_conversion(src, dst, *, progress: bool = True) -> None:
    """Re-read every expert of ``dst`` and compare it byte for byte with ``src``.

    Dense tensors are compared too (by SHA-256 of their bytes).

    Args:
        src: the mlx-lm checkpoint that was converted.
        dst: the converted directory.
        progress: show a progress bar.

    Raises:
        ConvertError: a layout, tensor or expert differs from the source's.
        ExpertFileError: a packed layer file is missing.
    """
    src, dst = Path(src), Path(dst)
    ckpt = scan_checkpoint(src)
    layout = packed_layout(dst)
    if layout.to_dict() != ckpt.layout.to_dict():
        raise ConvertError(f"{dst}: layout does not match the source {src}")
    dense_dst = index_directory(dst)
    if sorted(dense_dst) != sorted(ckpt.dense):
        raise ConvertError(f"{dst}: dense tensors differ from the source's")
    total = layout.total_expert_bytes + sum(r.nbytes for r in ckpt.dense.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=not progress) as bar:
        for name, r in ckpt.dense.items():
            if _digest(r) != _digest(dense_dst[name]):
                raise ConvertError(f"{dst}: tensor {name} differs from the source")
            bar.update(r.nbytes)
        for layer, lay in sorted(layout.layers.items()):
            path = packed_file(dst, layer)
            try:
                size = path.stat().st_size
            except OSError as e:
                raise ExpertFileError(f"{path}: {e.strerror} (layer {layer})") from e
            if size != lay.layer_bytes:
                raise ConvertError(f"{path}: {size} bytes, expected {lay.layer_bytes}")
            want = SafetensorsLayer(layer, lay, ckpt.ranges[layer])
            got = PackedLayer(layer, lay, path)
            try:
                step = max(1, CHUNK_BYTES // lay.blob_size)
                for e0 in range(0, lay.num_experts, step):
                    experts = np.arange(e0, min(e0 + step, lay.num_experts))
                    a = np.empty((len(experts), lay.blob_size), np.uint8)
                    b = np.empty_like(a)
                    want.read_pread(experts, a)
                    got.read_pread(experts, b)
                    for c in lay.components:  # padding is not compared: the source has none
                        sl = slice(c.offset, c.offset + c.nbytes)
                        bad = np.flatnonzero((a[:, sl] != b[:, sl]).any(axis=1))
                        if bad.size:
                            raise ConvertError(
                                f"{path}: expert {int(experts[bad[0]])} ({c.name}) "
                                f"differs from the source"
                            )
                    bar.update(len(experts) * lay.blob_size)
            finally:
                want.close()
                got.close()
    log.info("verified %s against %s", dst, src)


def _digest(r: TensorRange) -> bytes:
    h = hashlib.sha256()
    buf = bytearray(min(CHUNK_BYTES, max(r.nbytes, 1)))
    with open(r.file, "rb", buffering=0) as f:
        for start in range(0, r.nbytes, len(buf)):
            n = min(len(buf), r.nbytes - start)
            view = memoryview(buf)[:n]
            read_exact(f.fileno(), r.start + start, view, str(r.file))
            h.update(view)
    return h.digest()

"""Where each tensor's bytes lie inside a directory of safetensors files, read from headers only."""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict

from ..errors import CheckpointError, ExpertFileError, SafetensorsHeaderError
from .layout import DTYPE_SIZES

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit


@dataclass(frozen=True)
class TensorRange:
    file: Path
    dtype: str
    shape: tuple
    start: int  # absolute byte offset in the file
    nbytes: int


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def open_readonly(path: Path, what: str) -> int:
    """``os.open`` for reading, with errors that name the file and what it holds."""
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError as e:
        raise ExpertFileError(f"{path}: missing ({what})") from e
    except PermissionError as e:
        raise ExpertFileError(f"{path}: not readable ({what}): {e.strerror}") from e
    except OSError as e:
        raise ExpertFileError(f"{path}: cannot open ({what}): {e}") from e


def read_header(path: Path) -> Dict[str, TensorRange]:
    """Parse one safetensors header; validate every range against the file size."""
    path = Path(path)
    f = os.fdopen(open_readonly(path, "safetensors file"), "rb")
    with f:
        try:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) < 8:
                raise SafetensorsHeaderError(
                    f"{path}: too short to be a safetensors file ({size} bytes)"
                )
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise SafetensorsHeaderError(
                    f"{path}: header length {n} is past the end of the "
                    f"file ({size} bytes); damaged or truncated download?"
                )
            text = f.read(n)
        except OSError as e:
            raise ExpertFileError(f"{path}: cannot read the safetensors header ({e})") from e
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise SafetensorsHeaderError(f"{path}: damaged safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise SafetensorsHeaderError(f"{path}: safetensors header is not a JSON object")
    data_start = 8 + n
    out: Dict[str, TensorRange] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
            start, end = offsets
        except (KeyError, TypeError, ValueError) as err:
            raise SafetensorsHeaderError(f"{path}: damaged entry for tensor {name!r}") from err
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise SafetensorsHeaderError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_count(s) for s in shape):
            raise SafetensorsHeaderError(f"{path}: tensor {name!r} has a damaged shape {shape!r}")
        if not (_is_count(start) and _is_count(end)):
            raise SafetensorsHeaderError(f"{path}: tensor {name!r} has damaged offsets {offsets!r}")
        shape = tuple(shape)
        nbytes = DTYPE_SIZES[dtype] * math.prod(shape)
        if not start <= end or end - start != nbytes:
            raise SafetensorsHeaderError(
                f"{path}: tensor {name!r} offsets {start}..{end} do not match "
                f"its shape {list(shape)} {dtype}"
            )
        if data_start + end > size:
            raise SafetensorsHeaderError(
                f"{path}: tensor {name!r} ends at byte {data_start + end}, "
                f"past the end of the file ({size} bytes); truncated?"
            )
        out[name] = TensorRange(path, dtype, shape, data_start + start, nbytes)
    return out


def index_directory(path: Path) -> Dict[str, TensorRange]:
    """Every tensor of ``model*.safetensors`` in ``path``; checks the shard index if present:
    every shard it lists must exist and hold the tensors it lists for it."""
    path = Path(path)
    files = sorted(path.glob("model*.safetensors"))
    index_file = path / "model.safetensors.index.json"
    weight_map = None
    if index_file.exists():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) for v in weight_map.values()
            ):
                raise ValueError("weight_map is not a {tensor: file} object")
        except PermissionError as e:
            raise CheckpointError(f"{index_file}: not readable ({e.strerror})") from e
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_file}: unreadable shard index ({e})") from e
        missing = sorted({f for f in weight_map.values() if not (path / f).exists()})
        if missing:
            raise CheckpointError(
                f"{path}: missing shards {missing} (listed in {index_file.name}); "
                "incomplete download?"
            )
    if not files:
        raise CheckpointError(f"{path}: no model*.safetensors files; not an mlx-lm checkpoint")
    tensors: Dict[str, TensorRange] = {}
    for f in files:
        tensors.update(read_header(f))
    if weight_map is not None:
        for name, shard in weight_map.items():
            r = tensors.get(name)
            if r is None or r.file.name != Path(shard).name:
                raise CheckpointError(
                    f"{path / shard}: does not hold tensor {name!r}, which "
                    f"{index_file.name} places there; mismatched shards?"
                )
    return tensors

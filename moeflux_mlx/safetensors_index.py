"""Where each tensor's bytes lie inside a directory of safetensors files, read from headers only."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict

from .errors import CheckpointError, SafetensorsHeaderError
from .layout import DTYPE_SIZES

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit


@dataclass(frozen=True)
class TensorRange:
    file: Path
    dtype: str
    shape: tuple
    start: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: Path) -> Dict[str, TensorRange]:
    """Parse one safetensors header; validate every range against the file size."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise SafetensorsHeaderError(f"{path}: too short to be a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise SafetensorsHeaderError(f"{path}: header length {n} is past the end of the "
                                         f"file ({size} bytes); damaged or truncated download?")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsHeaderError(f"{path}: damaged safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise SafetensorsHeaderError(f"{path}: safetensors header is not a JSON object")
    data_start = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as err:
            raise SafetensorsHeaderError(f"{path}: damaged entry for tensor {name!r}") from err
        if dtype not in DTYPE_SIZES:
            raise SafetensorsHeaderError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        nbytes = DTYPE_SIZES[dtype] * math.prod(shape)
        if not (0 <= b <= e) or e - b != nbytes:
            raise SafetensorsHeaderError(f"{path}: tensor {name!r} offsets {b}..{e} do not match "
                                         f"its shape {list(shape)} {dtype}")
        if data_start + e > size:
            raise SafetensorsHeaderError(f"{path}: tensor {name!r} ends at byte {data_start + e}, "
                                         f"past the end of the file ({size} bytes); truncated?")
        out[name] = TensorRange(path, dtype, shape, data_start + b, nbytes)
    return out


def index_directory(path: Path) -> Dict[str, TensorRange]:
    """Every tensor of ``model*.safetensors`` in ``path``; checks the shard index if present."""
    path = Path(path)
    files = sorted(path.glob("model*.safetensors"))
    index_file = path / "model.safetensors.index.json"
    if index_file.exists():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{index_file}: unreadable shard index ({e})") from e
        missing = sorted({f for f in weight_map.values() if not (path / f).exists()})
        if missing:
            raise CheckpointError(f"{path}: missing shards {missing} (listed in {index_file.name}); "
                                  "incomplete download?")
    if not files:
        raise CheckpointError(f"{path}: no model*.safetensors files; not an mlx-lm checkpoint")
    tensors: Dict[str, TensorRange] = {}
    for f in files:
        try:
            tensors.update(read_header(f))
        except PermissionError as e:
            raise CheckpointError(f"{f}: not readable ({e.strerror})") from e
    return tensors


"""Exception types. Every message names the file, layer or expert concerned."""


class MoefluxError(Exception):
    """Base class for moeflux-mlx errors."""


class CheckpointError(MoefluxError, ValueError):
    """The directory is not a usable mlx-lm MoE checkpoint (not MoE, missing shards, ...)."""


class SafetensorsHeaderError(CheckpointError):
    """A safetensors file has a damaged header or offsets past the end of the file."""


class UnsupportedQuantizationError(CheckpointError):
    """The experts use a quantization mode, bit width or group size that is not supported."""


class LayoutError(CheckpointError):
    """layout.json is corrupt, of another format version, or does not match the files."""


class ExpertFileError(MoefluxError, OSError):
    """A packed layer file or expert shard is missing, unreadable, truncated or of the wrong size."""


class ExpertReadError(MoefluxError, OSError):
    """Reading an expert failed mid-generation (disk error, short read)."""


class ExpertIndexError(MoefluxError, IndexError):
    """The router asked for an expert that does not exist in the layer."""


class ModelClosedError(MoefluxError, RuntimeError):
    """The streaming model was closed; load it again."""

"""Exception types. Every message names the file, layer or expert concerned.

``docs/errors.md`` lists every bad input and fault, and which of these each one raises.

    MoefluxError
    ├── CheckpointError (ValueError)        not a usable MoE checkpoint: no experts, missing shards,
    │   ├── SafetensorsHeaderError            damaged header, offsets past the end of the file
    │   ├── UnsupportedQuantizationError      quantization mode / bits / group size
    │   ├── LayoutError                       layout.json corrupt / other version / not the files'
    │   └── MissingTokenizerError             no tokenizer files beside the weights
    ├── ExpertFileError (OSError)           a weight file is missing, unreadable, truncated, wrong size
    │   └── ExpertChecksumError               an expert's bytes are not those convert wrote
    ├── ExpertReadError (OSError)           a read failed during generation (EIO, short read, truncated)
    ├── ExpertIndexError (IndexError)       the router asked for an expert the layer does not have
    ├── ModelClosedError (RuntimeError)     the model was closed
    ├── DeviceWaitError (RuntimeError)      the GPU gave up waiting for the miss server, or it died
    ├── DeviceSetupError (RuntimeError)     CUDA's runtime refused pinned, mapped memory
    ├── DeviceCopyError (RuntimeError)      the GPU's copy of a prefill's layer failed
    ├── OptionError (ValueError)            a load option or its MOEFLUX_* variable is not one it takes
    ├── CurveError (ValueError)             a hit-rate curve file is unreadable or another model's
    └── ConvertError                        convert could not finish (DST exists, write failed, verify)
"""


class MoefluxError(Exception):
    """Base class for moeflux-mlx errors."""


class CheckpointError(MoefluxError, ValueError):
    """The directory is not a usable mlx-lm MoE checkpoint (not MoE, missing shards, ...)."""


class SafetensorsHeaderError(CheckpointError):
    """A safetensors file has a damaged header or offsets past the end of the file."""


class UnsupportedQuantizationError(CheckpointError):
    """The experts use a quantization mode, bit width or group size that is not supported."""


class LayoutError(CheckpointError):
    """layout.json is missing, corrupt, of another format version, or does not match the files
    or the model config."""


class MissingTokenizerError(CheckpointError):
    """The model directory holds no tokenizer files (``tokenizer.json``,
    ``tokenizer_config.json``, ...): mlx-lm would build an empty tokenizer that turns every
    prompt into no tokens. Raised by ``load`` before anything is read."""


class ExpertFileError(MoefluxError, OSError):
    """A weight file (packed layer file or safetensors shard) is missing, unreadable, truncated or
    of the wrong size. Raised when the model is opened, before any generation (its subclass
    ``ExpertChecksumError`` by the first read of a damaged expert)."""


class ExpertChecksumError(ExpertFileError):
    """A converted expert's bytes differ from the checksum ``convert`` recorded for it: the layer
    file was damaged after conversion (same size, other bytes). Raised by the read that first
    meets that expert, before anything is computed from it; the message names the file, layer
    and expert. ``moeflux-mlx convert`` over the conversion rewrites the damaged layer file."""


class ExpertReadError(MoefluxError, OSError):
    """Reading an expert failed mid-generation (disk error, short read, file truncated or replaced
    after it was opened). The call that needed the expert raises it; nothing is returned for that
    call. The model stays usable: the next call reads again."""


class ExpertIndexError(MoefluxError, IndexError):
    """The router asked for an expert that does not exist in the layer."""


class ModelClosedError(MoefluxError, RuntimeError):
    """The streaming model was closed; load it again."""


class DeviceWaitError(MoefluxError, RuntimeError):
    """With the device-side slot table (CUDA), the GPU waited longer than its timeout for the
    miss server process that reads missed experts, was handed an expert index out of range, or
    the miss server died. The model's state is no longer trusted: load it again."""


class DeviceSetupError(MoefluxError, RuntimeError):
    """CUDA's runtime refused to page-lock or map memory for the GPU (the device-side table's
    control block and staging, or the expert files with ``pin_experts``), or the files to pin
    do not fit in RAM."""


class DeviceCopyError(MoefluxError, RuntimeError):
    """CUDA's copy engine failed to move a prefill's layer to the device (``cudaMemcpy*`` or the
    wait for it returned an error). A CUDA error of this kind usually stays with the process:
    load the model again, or restart."""


class OptionError(MoefluxError, ValueError):
    """A load option's value (an argument, or its ``MOEFLUX_*`` variable) is not one it takes.
    The message names the option or the variable and what it expects."""


class CurveError(MoefluxError, ValueError):
    """A hit-rate curve file (``cache.curve``) is unreadable, truncated, of another format or
    out of range. The message names the file; ``moeflux-mlx doctor MODEL`` records it anew.
    ``cache_budget="auto"`` does not raise it: it warns and uses the default budget."""


class ConvertError(MoefluxError):
    """``convert`` could not finish: the destination exists, writing failed (disk full, ...) or the
    written files do not verify. The destination is never left half-written."""

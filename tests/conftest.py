import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from moeflux_mlx.format.convert import convert  # noqa: E402
from tests.support import synth  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """arch -> (plain mlx-lm checkpoint dir, converted dir), built once per session."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for arch in synth.ARCHITECTURES:
        src = synth.build_checkpoint(root / arch, arch, "tiny", seed=1)
        out[arch] = (src, convert(src, root / f"{arch}-packed", progress=False))
    return out

"""A streamed model is an mlx-lm model in every way a user touches: the package's public names,
dtypes, copies, and where a model comes from."""

import subprocess
import sys
import textwrap


def test_public_names_survive_importing_every_submodule():
    """A submodule named like a public function would replace it on the package once imported
    (``moeflux_mlx.stats`` the module, not the function); none may share a public name."""
    code = textwrap.dedent(
        """
        import importlib, pkgutil, types
        import moeflux_mlx
        for info in pkgutil.walk_packages(moeflux_mlx.__path__, "moeflux_mlx."):
            importlib.import_module(info.name)
        # each name as a fresh `moeflux_mlx.NAME` would find it (looking one name up binds
        # its lazy siblings, which would hide a shadowed one)
        bad = [n for n in moeflux_mlx.__all__
               if isinstance(vars(moeflux_mlx).get(n), types.ModuleType)]
        bad += [n for n in moeflux_mlx.__all__
                if isinstance(getattr(moeflux_mlx, n), types.ModuleType)]
        assert not bad, f"public names shadowed by submodules: {bad}"
        from moeflux_mlx.model import load, runtime, sharded
        assert moeflux_mlx.stats is load.stats and moeflux_mlx.load is load.load
        assert moeflux_mlx.sharded_load is sharded.sharded_load
        assert moeflux_mlx.StreamingRuntime is runtime.StreamingRuntime
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]

"""What the tests and the benchmarks build and check, kept out of the wheel: random-weight MoE
checkpoints built with mlx-lm's own classes (``synth``, ``architectures``, ``realscale``) and the
Metal kernels through clang's front end (``metal_frontend``). Import it as ``tests.support`` from
the repository root."""

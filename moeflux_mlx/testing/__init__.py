"""Test support: random-weight MoE checkpoints built with mlx-lm's own classes (``synth``), for
the tests, the demo and the benchmarks."""

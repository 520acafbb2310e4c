"""The tests of moeflux-mlx; ``tests.support`` holds what they and the benchmarks build."""

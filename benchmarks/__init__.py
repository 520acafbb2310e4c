"""The benchmarks of moeflux-mlx: scripts run from the repository root, and their library
(``benchmarks.lib``)."""

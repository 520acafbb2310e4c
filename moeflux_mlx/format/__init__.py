"""Expert files on disk, with no MLX: safetensors headers (``safetensors``), the byte layout of
one expert blob (``layout``), where the experts of an mlx-lm checkpoint or a converted directory
lie (``checkpoint``), reading one layer's blobs exactly (``readers``), and the converter to packed
per-layer files (``convert``)."""

"""The expert computation on resident experts: plain MLX ops (``ops``, exact against mlx-lm), the
fused Metal / CUDA kernels of ``metal_kernels/`` (``kernels``, texts read by ``kernel_source``),
and the choice between them (``backend``)."""

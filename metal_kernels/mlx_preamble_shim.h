// A stand-in for what MLX puts before every mx.fast.metal_kernel source (metal::utils(): its
// kernels/utils.h with bf16.h, bf16_math.h, complex.h, defines.h, logging.h), for the front-end
// check of moeflux_mlx/compute/metal_frontend.py. Only what a custom kernel's generated signature
// and moeflux's kernels rely on: <metal_stdlib>, `using namespace metal`, and MLX's names of the
// 16-bit float types (bf16.h: `typedef bfloat bfloat16_t`; utils.h: `typedef half float16_t`).
// tests/test_metal_frontend.py checks the installed MLX's headers still say so, and that no name
// moeflux's kernel text defines is also defined there.
#pragma once
#include <metal_stdlib>
using namespace metal;

typedef bfloat bfloat16_t;
typedef half float16_t;

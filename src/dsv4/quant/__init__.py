"""Quantized weight formats: e8m0 scale bytes, block-scaled FP8 (e4m3fn) and MXFP4-style e2m1.

See the architecture notes, sections 10.4-10.7.
"""

from .e8m0 import (
    E8M0_BIAS,
    E8M0_MIN_NORMAL_SCALE,
    E8M0_NAN_BYTE,
    as_e8m0_bytes,
    e8m0_ceil_pow2,
    e8m0_to_float32,
    float32_to_e8m0,
)
from .fp4 import (
    E2M1_MAX,
    E2M1_VALUES,
    FP4_GROUP_SIZE,
    dequantize_fp4,
    pack_e2m1,
    quantize_fp4,
    unpack_e2m1,
)
from .fp8 import (
    DEFAULT_FP8_BLOCK,
    E4M3_MAX,
    FLOAT_SCALE_FLOOR,
    FP8_SCALE_FMTS,
    dequantize_fp8_blockwise,
    e4m3_to_float32,
    fp8_scale_grid_shape,
    quantize_fp8_blockwise,
)

__all__ = [
    "DEFAULT_FP8_BLOCK",
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "E8M0_BIAS",
    "E8M0_MIN_NORMAL_SCALE",
    "E8M0_NAN_BYTE",
    "FLOAT_SCALE_FLOOR",
    "FP4_GROUP_SIZE",
    "FP8_SCALE_FMTS",
    "as_e8m0_bytes",
    "dequantize_fp4",
    "dequantize_fp8_blockwise",
    "e4m3_to_float32",
    "e8m0_ceil_pow2",
    "e8m0_to_float32",
    "float32_to_e8m0",
    "fp8_scale_grid_shape",
    "pack_e2m1",
    "quantize_fp4",
    "quantize_fp8_blockwise",
    "unpack_e2m1",
]

"""E8M0 ("ue8m0") power-of-two scales as raw bytes.

An e8m0 value is a single unsigned byte ``b`` meaning ``2^(b - 127)``: an fp32 exponent field with no sign and no
mantissa. Checkpoints store these scales as ``float8_e8m0fnu`` (safetensors ``F8_E8M0``) or as plain ``uint8``.

The one rule that matters (architecture notes, section 10.7): e8m0 data are *raw bits*. They are reinterpreted with
``.view(torch.uint8)``, never converted with ``.to()``/``copy_``. A numeric cast from ``float8_e8m0fnu`` to an integer
type converts the *value* (2^-7 becomes 0), which destroys the exponent.

Decoding deliberately differs from torch's own ``float8_e8m0fnu -> float32`` cast in one place: byte 0 decodes to 0.0
here (the shift trick below yields fp32 bits 0), whereas torch yields 2^-127. Byte 255 is NaN in both (OCP MX spec).
"""

from __future__ import annotations

import torch

__all__ = [
    "E8M0_BIAS",
    "E8M0_MIN_NORMAL_SCALE",
    "E8M0_NAN_BYTE",
    "as_e8m0_bytes",
    "e8m0_ceil_pow2",
    "e8m0_to_float32",
    "float32_to_e8m0",
]

# Exponent bias shared with the fp32 exponent field, which is what makes the bit-shift decode exact.
E8M0_BIAS = 127
# OCP MX: the all-ones byte is NaN (there is no infinity in e8m0).
E8M0_NAN_BYTE = 255
# Smallest scale the quantizers produce: the smallest *normal* fp32 power of two (byte 1). Flooring the scale here
# keeps every scale a normal fp32 number, so that encode and decode stay exact inverses.
E8M0_MIN_NORMAL_SCALE = 2.0**-126

# fp32 layout: 1 sign bit, 8 exponent bits, 23 mantissa bits.
_FP32_MANTISSA_BITS = 23
_FP32_MANTISSA_MASK = (1 << _FP32_MANTISSA_BITS) - 1
_FP32_EXPONENT_MASK = 0xFF

# Dtypes whose storage we accept as e8m0 bytes. int8 is included because some writers store byte tensors as I8.
_E8M0_BYTE_DTYPES = (torch.float8_e8m0fnu, torch.uint8, torch.int8)


def as_e8m0_bytes(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret an e8m0 tensor's storage as ``uint8`` bytes (same shape, shares memory).

    Args:
        t: any shape, dtype ``float8_e8m0fnu``, ``uint8`` or ``int8``.

    Returns:
        ``uint8`` view of ``t`` with identical bits.

    Raises:
        TypeError: for any other dtype. In particular float32 is refused: a float tensor holds decoded *values*, and
            guessing whether to re-encode it is exactly the kind of silent conversion that loses exponents.
    """
    if t.dtype not in _E8M0_BYTE_DTYPES:
        raise TypeError(
            f"e8m0 scales must be float8_e8m0fnu, uint8 or int8 raw bytes; got dtype {t.dtype}. "
            "Use float32_to_e8m0() to encode decoded power-of-two values."
        )
    return t.view(torch.uint8)


def e8m0_to_float32(bytes_u8: torch.Tensor) -> torch.Tensor:
    """Decode e8m0 bytes to float32 values ``2^(b - 127)``.

    Args:
        bytes_u8: any shape; ``uint8``, ``int8`` or ``float8_e8m0fnu`` (reinterpreted via :func:`as_e8m0_bytes`).

    Returns:
        float32 tensor of the same shape. Byte 0 -> 0.0 (not 2^-127), byte 255 -> NaN, otherwise exact.
    """
    b = as_e8m0_bytes(bytes_u8)
    # Placing the byte in the fp32 exponent field with a zero mantissa gives 2^(b-127) exactly, with no libm call.
    values = (b.to(torch.int32) << _FP32_MANTISSA_BITS).view(torch.float32)
    # The same trick turns 255 into +inf; the OCP MX spec says NaN.
    return values.masked_fill(b == E8M0_NAN_BYTE, float("nan"))


def float32_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Encode exact power-of-two scales as e8m0 bytes; the inverse of :func:`e8m0_to_float32` on bytes 1..254.

    Args:
        scale: any shape, a floating dtype; every element must be a normal fp32 power of two in [2^-126, 2^127].

    Returns:
        ``uint8`` tensor of the same shape.

    Raises:
        TypeError: if ``scale`` is not floating point (integer tensors are probably already bytes).
        ValueError: if any element is not an exact positive normal power of two (0, negatives, NaN/inf,
            subnormals and values like 3.0 are all refused rather than rounded).
    """
    if not scale.is_floating_point():
        raise TypeError(f"float32_to_e8m0 expects decoded floating-point scales; got dtype {scale.dtype}")
    if scale.dtype == torch.float8_e8m0fnu:
        return as_e8m0_bytes(scale).clone()
    s = scale.to(torch.float32)
    bits = s.view(torch.int32)
    exponent = (bits >> _FP32_MANTISSA_BITS) & _FP32_EXPONENT_MASK
    # Positive, zero mantissa, exponent field neither 0 (zero/subnormal) nor 255 (inf/NaN).
    ok = (bits >= 0) & ((bits & _FP32_MANTISSA_MASK) == 0) & (exponent > 0) & (exponent < E8M0_NAN_BYTE)
    if not bool(ok.all()):
        bad = s[~ok].flatten()[:4].tolist()
        raise ValueError(f"float32_to_e8m0: scales must be exact positive normal powers of two; got e.g. {bad}")
    return exponent.to(torch.uint8)


def e8m0_ceil_pow2(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two ``>= max(x, 2^-126)``, as e8m0 bytes: ``2^ceil(log2(max(x, 2^-126)))``.

    Computed from the fp32 bit pattern rather than ``ceil(log2(x))``: ``log2`` is not exact near powers of two, and
    an off-by-one exponent here would push a block's maximum past the format's max and into saturation.

    Args:
        x: any shape, floating dtype, finite and ``>= 0`` (e.g. ``amax / 448``).

    Returns:
        ``uint8`` tensor of the same shape with values in [1, 254].

    Raises:
        ValueError: if the required scale exceeds 2^127 (cannot be represented; byte 255 is NaN).
    """
    xf = x.to(torch.float32).clamp_min(E8M0_MIN_NORMAL_SCALE)
    bits = xf.view(torch.int32)
    exponent = bits >> _FP32_MANTISSA_BITS  # sign bit is 0 after the clamp
    round_up = ((bits & _FP32_MANTISSA_MASK) != 0).to(torch.int32)
    b = exponent + round_up
    if bool((b >= E8M0_NAN_BYTE).any()):
        raise ValueError("e8m0_ceil_pow2: a scale above 2^127 is required (input too large or not finite)")
    return b.to(torch.uint8)

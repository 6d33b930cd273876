"""Triton helpers shared by the Triton kernels: exact number-format conversions and a dtype-switched dot.

Every kernel takes a constexpr `NATIVE`: True on a GPU, False under the Triton interpreter
(TRITON_INTERPRET=1, CPU CI). The interpreter cannot be trusted with narrow formats:
- bfloat16 is kept as raw uint16, so bf16 arithmetic, dots and fp32 -> bf16 casts are wrong;
- fp32 -> fp8 e4m3 casts round half up and drop the carry into the exponent (127.2 -> 64, seen
  with triton 3.9), although e4m3 -> fp32 widening and fp8 loads are exact.
Reductions go through `rmax`/`rsum`: triton's own `tl.max`/`tl.sum` are jit functions built at
triton import, which cannot run inside the interpreted twins that `kernels._launch.for_device` builds.
So in interpreter mode a value that a GPU holds in bf16 or e4m3 is held as its exact fp32 value,
rounded here with integer bit arithmetic (ties to even, as the hardware casts do), and every dot
runs in fp32 with `input_precision="ieee"`. Products of bf16/e4m3 values are exact in fp32 and both
paths accumulate in fp32, so the two modes compute the same numbers up to summation order.
bf16 tensors always travel as int16 views (`bits16` turns them into values).

Dot operand kinds (constexpr, chosen by the launcher):
  OP_F32  fp32 operands, ieee (interpreter)
  OP_BF16 bf16 MMA (bf16 query / P against the latent)
  OP_FP16 fp16 MMA of e4m3 values: exact products, fp32 accumulation (the GPU default for fp8 x fp8)
  OP_FP8  native e4m3 MMA, promoted to fp32 every 32 products (opt-in: Hopper's FP8 MMA keeps ~14
          bits inside each K = 32 step, so it is not the reference's arithmetic)
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from ... import constants

OP_F32 = 0
OP_BF16 = 1
OP_FP8 = 2
OP_FP16 = 3

# Globals read inside kernels must be constexpr; the values are snapquant.constants' (the reference's).
E4M3_MAX = tl.constexpr(constants.E4M3_MAX)
BF16_MAX = tl.constexpr(constants.BF16_MAX)
SCALE_FLOOR = tl.constexpr(constants.SCALE_FLOOR)
FLASHMLA_SCALE_MIN = tl.constexpr(constants.FLASHMLA_SCALE_MIN)
FLT_MIN = tl.constexpr(constants.FLT_MIN)
POW2_MAX = tl.constexpr(2.0**127)  # the largest power-of-two scale (pow2_ceil_log2f's clamp)
# The cache scale rules (`cache_scale`'s RULE), numbered as the kernels' launcher passes them.
SCALE_RULE_ID = {"snapquant": 0, "flashmla": 1, "vllm": 2}
PI_REL_FLOOR = tl.constexpr(constants.PI_REL_FLOOR)
PI_ABS_FLOOR = tl.constexpr(constants.PI_ABS_FLOOR)
LN2 = tl.constexpr(math.log(2.0))
# fp8 x fp8 dots on sm_90 accumulate in ~22 bits unless promoted to fp32 every N products.
FP8_PROMOTE_EVERY = tl.constexpr(32)


@triton.jit
def rmax(x, axis: tl.constexpr, NATIVE: tl.constexpr):
    """Max along `axis`. The interpreter branch names the combine function the interpreter runs in numpy."""
    if NATIVE:
        return tl.max(x, axis)
    else:
        return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def rsum(x, axis: tl.constexpr, NATIVE: tl.constexpr):
    """Sum along `axis` (see `rmax`)."""
    if NATIVE:
        return tl.sum(x, axis)
    else:
        return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def bf16_bits_to_f32(bits):
    """int16 bit pattern of a bf16 -> its exact fp32 value."""
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16_bits(x):
    """fp32 -> int16 bit pattern of the nearest bf16 (ties to even; finite inputs)."""
    u = x.to(tl.uint32, bitcast=True)
    u = u + 0x7FFF + ((u >> 16) & 1)
    return (u >> 16).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def f32_to_e4m3_bits(x):
    """fp32 already clamped to [-448, 448] -> uint8 e4m3 code, ties to even (exact, integer ops).

    Normal range: round the fp32 mantissa to 3 bits in the integer domain (a carry moves into the
    exponent, as it must) and rebias 127 -> 7. Subnormal range (|x| < 2^-6): the code is
    round_half_even(|x| * 2^9), computed with the 2^23 magic constant in fp32.
    """
    u = x.to(tl.uint32, bitcast=True)
    sign = u >> 31
    a = u & 0x7FFFFFFF
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960  # 960 = (127 - 7) << 3
    y = a.to(tl.float32, bitcast=True) * 512.0
    sub = ((y + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(a.to(tl.float32, bitcast=True) < 0.015625, sub, normal)
    return (code | (sign << 7)).to(tl.uint8)


@triton.jit
def bits16(bits, NATIVE: tl.constexpr):
    """bf16 stored as int16 bits -> a value tensor: bf16 on GPU (a free bitcast), exact fp32 otherwise."""
    if NATIVE:
        return bits.to(tl.bfloat16, bitcast=True)
    else:
        return bf16_bits_to_f32(bits)


@triton.jit
def round_bf16(x, NATIVE: tl.constexpr):
    """fp32 -> nearest bf16 (ties to even): bf16 on GPU, its exact fp32 value in the interpreter."""
    if NATIVE:
        return x.to(tl.bfloat16)
    else:
        return bf16_bits_to_f32(f32_to_bf16_bits(x))


@triton.jit
def round_e4m3(x, NATIVE: tl.constexpr):
    """fp32 in [-448, 448] -> nearest e4m3 (ties to even): fp8 on GPU, its exact fp32 value otherwise."""
    if NATIVE:
        return x.to(tl.float8e4nv)
    else:
        return f32_to_e4m3_bits(x).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def store_bf16_bits(x, NATIVE: tl.constexpr):
    """fp32 -> int16 bits of the nearest bf16, for a store into an int16 view of a bf16 tensor."""
    if NATIVE:
        return x.to(tl.bfloat16).to(tl.int16, bitcast=True)
    else:
        return f32_to_bf16_bits(x)


@triton.jit
def store_e4m3(x, NATIVE: tl.constexpr):
    """fp32 in [-448, 448] -> what to store into the fp8 cache (fp8 on GPU, uint8 codes for a uint8 view)."""
    if NATIVE:
        return x.to(tl.float8e4nv)
    else:
        return f32_to_e4m3_bits(x)


@triton.jit
def operand(x, KIND: tl.constexpr):
    """A value tensor whose values are exact in the target type -> the dot operand of that kind."""
    if KIND == 0:
        return x.to(tl.float32)
    elif KIND == 1:
        return x.to(tl.bfloat16)
    elif KIND == 2:
        return x.to(tl.float8e4nv)
    else:
        return x.to(tl.float16)


@triton.jit
def mma(a, b, acc, KIND: tl.constexpr):
    """acc + a @ b with fp32 accumulation, for operands made by `operand(..., KIND)`."""
    if KIND == 0:
        return tl.dot(a, b, acc, input_precision="ieee")
    elif KIND == 2:
        return tl.dot(a, b, acc, max_num_imprecise_acc=FP8_PROMOTE_EVERY)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def cache_scale(amax, POW2: tl.constexpr, RULE: tl.constexpr, DIV: tl.constexpr):
    """A cache part's scale by the config's rule (`snapquant.quant.scales.rule_scale`), amax / DIV in fp32
    (correctly rounded): RULE 0 snapquant (`scale_rule`), 1 flashmla (max(s, fl32(1e-4)), then
    2^ceil(RN_fp32(log2 s)) by the integer rule of `pow2_ceil_log2f`), 2 vllm (max(s, FLT_MIN))."""
    s = tl.math.div_rn(amax, DIV)
    if RULE == 0:
        s = tl.where(amax == 0, 1.0, tl.maximum(s, SCALE_FLOOR))
        if POW2:
            u = s.to(tl.uint32, bitcast=True)
            s = ((u + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
    elif RULE == 1:
        s = tl.maximum(s, FLASHMLA_SCALE_MIN)  # a normal number from here on
        u = s.to(tl.uint32, bitcast=True)
        k = ((u >> 23) & 0xFF).to(tl.int32) - 127  # floor(log2 s)
        big_k = tl.abs(k).to(tl.float32)
        kb = big_k.to(tl.uint32, bitcast=True)
        j = ((kb >> 23) & 0xFF).to(tl.int32) - 127  # floor(log2 |k|) for k != 0
        j = tl.where((k < 0) & ((kb & 0x7FFFFF) == 0), j - 1, j)  # the fp32 spacing halves below 2^j
        # log2 s rounds to the integer k while the mantissa steps stay <= floor(2^(j - 1) ln 2)
        half_step = (tl.maximum(j - 1 + 127, 1) << 23).to(tl.float32, bitcast=True)  # 2^(j - 1), exact
        limit = tl.where(k == 0, 0, tl.floor(half_step * LN2).to(tl.int32))
        down = u & 0x7F800000  # 2^k
        up = ((u & 0x7FFFFF) > limit.to(tl.uint32)).to(tl.uint32)
        s = tl.minimum((down + (up << 23)).to(tl.float32, bitcast=True), POW2_MAX)
    else:
        s = tl.maximum(s, FLT_MIN)
    return s


@triton.jit
def scale_rule(amax, POW2: tl.constexpr):
    """snapquant's scale rule in fp32: s = amax / 448 (correctly rounded), 1 if amax == 0, floored;
    with POW2 rounded up to a power of two (normal fp32 only, which the floor guarantees)."""
    s = tl.math.div_rn(amax, E4M3_MAX)
    s = tl.where(amax == 0, 1.0, tl.maximum(s, SCALE_FLOOR))
    if POW2:
        u = s.to(tl.uint32, bitcast=True)
        s = ((u + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
    return s

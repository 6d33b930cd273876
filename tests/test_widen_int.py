"""The integer e4m3 -> fp16 widening of the Gluon kernels (`E4M3_TO_F16_INT_PTX`), run on CPU.

The PTX string the kernels inline is executed here by a small emulator of the four instructions it uses
(mov, prmt in its default mode, and, add, shl on 32-bit registers), over every pair of codes in every byte
position, and compared bit for bit with torch's e4m3 -> fp16 conversion scaled by 2^-8 (exact: every e4m3
value times 2^-8 is an fp16 number). The NaN codes are the one documented difference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from snapquant.kernels.gluon.common import E4M3_TO_F16_CVT_PTX, E4M3_TO_F16_INT_PTX, WIDEN_INT_SCALE

MASK = 0xFFFFFFFF


def _prmt(a: np.ndarray, b: np.ndarray, sel: int) -> np.ndarray:
    """prmt.b32 (default mode): byte i of the result is byte (sel >> 4i) & 7 of the 8-byte {b, a}."""
    src = [(a >> (8 * k)) & 0xFF for k in range(4)] + [(b >> (8 * k)) & 0xFF for k in range(4)]
    out = np.zeros_like(a)
    for i in range(4):
        out |= src[(sel >> (4 * i)) & 0x7] << (8 * i)
    return out


def run_ptx(ptx: str, operands: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Execute the instructions of an inline-asm string on uint64 arrays holding 32-bit values."""
    regs = dict(operands)

    def val(tok: str) -> np.ndarray:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return np.full_like(next(iter(operands.values())), int(tok, 0))

    body = ptx.strip()[1:-1]  # the { } scope
    for stmt in filter(None, (s.strip() for s in body.split(";"))):
        op, _, args = stmt.partition(" ")
        if op == ".reg":
            continue
        a = [t.strip() for t in args.split(",")]
        if op == "mov.b32":
            regs[a[0]] = val(a[1])
        elif op == "prmt.b32":
            regs[a[0]] = _prmt(val(a[1]), val(a[2]), int(a[3], 0))
        elif op == "and.b32":
            regs[a[0]] = val(a[1]) & val(a[2])
        elif op == "add.u32":
            regs[a[0]] = (val(a[1]) + val(a[2])) & MASK
        elif op == "shl.b32":
            regs[a[0]] = (val(a[1]) << int(a[2], 0)) & MASK
        else:
            raise AssertionError(f"the emulator does not know {op!r}; extend it with the PTX semantics")
    return regs


def _f16_bits(codes: np.ndarray) -> np.ndarray:
    """torch's e4m3 -> fp16 of byte codes, as uint16 bits."""
    t = torch.from_numpy(codes.astype(np.uint8)).view(torch.float8_e4m3fn).to(torch.float16)
    return t.view(torch.int16).numpy().astype(np.uint16)


def test_int_widening_is_the_exact_value_times_2_pow_minus_8_for_every_code():
    """Every (byte 0, byte 1) pair and, with a random partner, every code in bytes 2 and 3: each 16-bit half
    of $0 / $1 is fp16(e4m3 value) * 2^-8 bit for bit; NaN codes come out as +-1.875 (480 * 2^-8)."""
    codes = np.arange(256, dtype=np.uint64)
    b0, b1 = np.meshgrid(codes, codes, indexing="ij")
    rng = np.random.default_rng(7)
    b2 = rng.integers(0, 256, b0.shape, dtype=np.uint64)
    b3 = rng.integers(0, 256, b0.shape, dtype=np.uint64)
    x = (b0 | b1 << 8 | b2 << 16 | b3 << 24).ravel()
    regs = run_ptx(E4M3_TO_F16_INT_PTX.replace("$2", "x"), {"x": x})
    lo, hi = regs["$0"], regs["$1"]
    got = {0: lo & 0xFFFF, 1: lo >> 16, 2: hi & 0xFFFF, 3: hi >> 16}
    for k, b in enumerate((b0, b1, b2, b3)):
        byte = b.ravel()
        want = torch.from_numpy(_f16_bits(byte).view(np.float16).astype(np.float32) / WIDEN_INT_SCALE)
        want_bits = want.to(torch.float16).view(torch.int16).numpy().astype(np.uint16)
        nan = (byte & 0x7F) == 0x7F
        assert np.array_equal(got[k][~nan].astype(np.uint16), want_bits[~nan]), f"byte {k}"
        # the NaN codes: s.1111.111 -> s.01111.1110000000 = +-1.875
        nan_bits = np.where(byte[nan] & 0x80, 0xBF80, 0x3F80)
        assert np.array_equal(got[k][nan].astype(np.uint16), nan_bits), f"byte {k} NaN codes"


def test_int_widening_scale_is_exact_on_every_value():
    """WIDEN_INT_SCALE undoes the 2^-8 exactly: fp16(v * 2^-8) * 256 == v for every finite e4m3 value, and the
    smallest (subnormal, 2^-9) stays nonzero as an fp16 subnormal."""
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    v = v[torch.isfinite(v)]
    scaled = (v / WIDEN_INT_SCALE).to(torch.float16)
    assert torch.equal(scaled.to(torch.float32) * WIDEN_INT_SCALE, v)
    assert scaled[v > 0].min().item() == 2.0 ** -17


def test_the_emulator_refuses_what_it_does_not_model():
    """A changed PTX string cannot pass by being half-executed: an instruction outside the emulator's five
    (here the cvt the integer path replaces) is an error."""
    with pytest.raises(AssertionError, match="does not know"):
        run_ptx("{ .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, x; }", {"x": np.zeros(1, dtype=np.uint64)})
    assert "cvt.rn.f16x2.e4m3x2" in E4M3_TO_F16_CVT_PTX and "cvt" not in E4M3_TO_F16_INT_PTX

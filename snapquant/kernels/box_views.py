"""Register-operand views of a TMA page box: which physical channel each logical MMA index reads.

Pure Python (no Gluon), so the maps and the layouts built from them are tested on any machine;
`gluon_regs.py` is their user, the module docstring there says why they exist.
"""

from __future__ import annotations

PAGE_ROWS = 64  # tokens per page: the TMA box's rows
BOX_BYTES = 128  # e4m3 codes per box row (the 128-byte swizzle)


def _swizzled_position(offset: int) -> tuple[int, int, int]:
    """Byte offset into consecutive [64, 128] e4m3 TMA boxes with the 128-byte swizzle -> (box, token
    row, channel): 16-byte chunk c of row t lives at chunk position c ^ (t % 8)."""
    box, offset = divmod(offset, PAGE_ROWS * BOX_BYTES)
    t = offset // BOX_BYTES
    pos = (offset // 16) % 8
    return box, t, ((pos ^ (t % 8)) * 16) | (offset % 16)


def box_view_bases(kind: str) -> list[list[int]]:
    """The SharedLinearLayout offset bases that reinterpret TMA boxes as wgmma's A operand: `kind`
    "qk" gives one box as the logical [64 tokens, 128 k] view (k -> channel `qk_channel`), "pv" one box
    as the logical [128 m, 64 tokens] view (m -> channel `pv_channel`: 4 warps), "pv256" two adjacent
    boxes as [256 m, 64 tokens] (m -> channel `pv256_channel`: 8 warps along M). Every map is a bit
    permutation and the swizzle an XOR, so the view is linear over GF(2): basis i is the logical
    coordinate of byte offset 2^i."""
    if kind not in VIEWS:
        raise ValueError(f"kind must be one of {sorted(VIEWS)}, got {kind!r}")
    to_channel, boxes = VIEWS[kind]
    logical_of = {to_channel(j): j for j in range(BOX_BYTES * boxes)}
    bases = []
    for i in range((PAGE_ROWS * BOX_BYTES * boxes).bit_length() - 1):
        box, t, c = _swizzled_position(1 << i)
        c += box * BOX_BYTES
        bases.append([t, logical_of[c]] if kind == "qk" else [logical_of[c], t])
    return bases


def qk_channel(k):  # ints or Gluon int tensors alike
    """Logical QK channel k (K order of the MMA) -> physical channel, within each 128-channel box:
    k = 16 s + 8 h + 2 q + e -> 32 q + 4 s + 2 h + e."""
    kl = k & 127
    return (k - kl) | (((kl >> 1) & 3) << 5) | ((kl >> 4) << 2) | (((kl >> 3) & 1) << 1) | (kl & 1)


def pv_channel(m):
    """Logical PV row m of a box (M order of the MMA) -> physical channel of the box: a thread's four
    rows (m bits 3 and 6) are four contiguous bytes; lanes (m bits 0-2) and warps (bits 4-5) above."""
    return ((m >> 3) & 1) | (((m >> 6) & 1) << 1) | ((m & 7) << 2) | (((m >> 4) & 3) << 5)


def pv256_channel(m):
    """Logical PV row m of two adjacent boxes (M order of the MMA, 8 warps along M) -> physical channel
    of the pair: a thread's four rows (m bits 3 and 7) are four contiguous bytes; lanes (m bits 0-2) and
    warps (bits 4-6; bit 6 picks the box) above."""
    return ((m >> 3) & 1) | (((m >> 7) & 1) << 1) | ((m & 7) << 2) | (((m >> 4) & 7) << 5)


VIEWS = {"qk": (qk_channel, 1), "pv": (pv_channel, 1), "pv256": (pv256_channel, 2)}

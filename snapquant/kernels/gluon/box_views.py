"""Register-operand views of a TMA page box: which physical channel each logical MMA index reads.

Pure Python (no Gluon), so the maps and the layouts built from them are tested on any machine;
`narrow.py` (exact fp16 operands: `box_view_bases`) and `experimental/narrow8.py`, `wide8.py` (e4m3
operands: `slot_view_bases`, `v_load_bases`, `vt_store_bases`) are their users; the module docstrings
there say why they exist.
"""

from __future__ import annotations

from ...constants import PAGE_SIZE  # tokens per page: the TMA box's rows

BOX_BYTES = 128  # e4m3 codes per box row (the 128-byte swizzle)


def _swizzled_position(offset: int) -> tuple[int, int]:
    """Byte offset inside a [64, 128] e4m3 TMA box with the 128-byte swizzle -> (token row, channel):
    16-byte chunk c of row t lives at chunk position c ^ (t % 8)."""
    t = offset // BOX_BYTES
    pos = (offset // 16) % 8
    return t, ((pos ^ (t % 8)) * 16) | (offset % 16)


def box_view_bases(kind: str) -> list[list[int]]:
    """The SharedLinearLayout offset bases that reinterpret one TMA box as wgmma's A operand: `kind`
    "qk" gives the logical [64 tokens, 128 k] view (k -> channel `_qk_channel`), "pv" the logical
    [128 m, 64 tokens] view (m -> channel `_pv_channel`). Both maps are bit permutations and the swizzle
    is an XOR, so the view is linear over GF(2): basis i is the logical coordinate of byte offset 2^i."""
    if kind not in ("qk", "pv"):
        raise ValueError(f"kind must be 'qk' or 'pv', got {kind!r}")
    to_channel = qk_channel if kind == "qk" else pv_channel
    logical_of = {to_channel(j): j for j in range(BOX_BYTES)}
    bases = []
    for i in range((PAGE_SIZE * BOX_BYTES).bit_length() - 1):
        t, c = _swizzled_position(1 << i)
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


def pv_channel_pair(m):
    """`pv_channel` over two boxes for `narrow_halves.py`'s eight warps: logical row m of the [256, 64] PV
    operand of boxes 2j, 2j + 1 -> channel of the pair (box 2j + 1's channels from 128). wgmma gives a thread
    rows m with bits 0-2 = lane group, bit 3 = the +8 half, bits 4-5 = its warp in the warpgroup, bit 6 = its
    warpgroup, bit 7 = the second 128-row repeat: m bits 3 and 7 -> channel bits 0, 1 (four contiguous bytes
    per thread, as `pv_channel`), lanes -> bits 2-4, warps -> bits 5-6, the warpgroup -> the box."""
    return (((m >> 3) & 1) | (((m >> 7) & 1) << 1) | ((m & 7) << 2) | (((m >> 4) & 3) << 5)
            | (((m >> 6) & 1) << 7))


def pair_view_bases(kind: str) -> list[list[int]]:
    """SharedLinearLayout offset bases of two consecutive TMA boxes read as one A operand of `narrow_halves.py`
    (eight warps; rows 64-127 of each 128 are the second warpgroup's): "qk" the [128 rows, 128 k] view whose
    rows 0-63 are the first box's tokens and 64-127 the second's (k -> channel `qk_channel`, as
    `box_view_bases("qk")`); "pv" the [256 m, 64 tokens] view with m -> `pv_channel_pair(m)`."""
    if kind == "qk":
        return [*box_view_bases("qk"), [PAGE_SIZE, 0]]  # byte offset 8192: the next box, rows + 64
    if kind != "pv":
        raise ValueError(f"kind must be 'qk' or 'pv', got {kind!r}")
    box_bytes = PAGE_SIZE * BOX_BYTES
    logical_of = {pv_channel_pair(j): j for j in range(2 * BOX_BYTES)}
    bases = []
    for i in range((2 * box_bytes).bit_length() - 1):
        box, within = divmod(1 << i, box_bytes)
        t, c = _swizzled_position(within)
        bases.append([logical_of[box * BOX_BYTES + c], t])
    return bases


def rope_halves_bases(d: int = 64) -> list[list[int]]:
    """SharedLinearLayout offset bases (in bf16 elements) that read a [64 tokens, d] bf16 RoPE tile (TMA's
    128-byte swizzle: d = 64) as `narrow_halves.py`'s [128, d / 2] A operand: row t + 64 h, column k is
    token t, channel h d / 2 + k (each warpgroup multiplies half of the RoPE channels)."""
    if d != 64:
        raise ValueError(f"the RoPE halves view is written for rope_dim 64 (128-byte rows), got {d}")
    bases = []
    for i in range((PAGE_SIZE * d).bit_length() - 1):
        t, c = _swizzled_position(2 << i)  # byte offset of element 2^i; 128-byte rows of 64 bf16
        col = c // 2
        bases.append([t + PAGE_SIZE * (col // (d // 2)), col % (d // 2)])
    return bases


SLOT_BOXES = 4  # a page slot of r = 512: four boxes, 32 KB


def pv8_channel(m, warp_bits: int = 3):
    """Logical row m of a native FP8 PV (O^T = V^T P^T, warps along M, e4m3 A operand from registers) ->
    physical channel. wgmma's 8-bit A fragment gives a thread rows m with bits 0-2 = its lane group g,
    bit 3 = the +8 half e, the next `warp_bits` bits = its warp w, the rest = the 16 x 2^warp_bits-row
    repeat j (two bits); e and j map to channel bits 0-2, so a thread's eight rows are eight contiguous
    bytes of a token row (one 8-byte `ld.shared`): channel = e + 2 j + 8 g + 64 w. warp_bits 3: the
    64-row kernel's 512 rows (8 warps); 2: one 256-row half of the 32-row kernel (4 warps)."""
    w_mask = (1 << warp_bits) - 1
    return ((m >> 3) & 1) | (((m >> (4 + warp_bits)) & 3) << 1) | ((m & 7) << 3) | (((m >> 4) & w_mask) << 6)


def slot_view_bases(transposed: bool = False, boxes: int = SLOT_BOXES, warp_bits: int = 3) -> list[list[int]]:
    """SharedLinearLayout offset bases reading `boxes` stacked TMA boxes (a page slot: 4, 32 KB; half a
    slot: 2) as the logical [128 boxes m, 64 tokens] V^T of `pv8_channel(m, warp_bits)`: basis i is the
    (m, token) of byte offset 2^i. transposed: rows m bits 3, 4 + warp_bits (e and j's low bit) and tokens
    bits 0, 1 trade places, so that a load labels four tokens' four channels transposed and a 4 x 4 byte
    transpose in registers (`experimental/native8._transpose4x4`) puts every byte at its true (m, token)."""
    box_bytes = PAGE_SIZE * BOX_BYTES
    j0 = 1 << (4 + warp_bits)
    logical_of = {pv8_channel(j, warp_bits): j for j in range(boxes * BOX_BYTES)}
    bases = []
    for i in range((boxes * box_bytes).bit_length() - 1):
        box, within = divmod(1 << i, box_bytes)
        t, c = _swizzled_position(within)
        m = logical_of[box * BOX_BYTES + c]
        if transposed:
            m, t = ((m & ~(8 | j0)) | ((t & 1) << 3) | (j0 if t & 2 else 0),
                    (t & ~3) | ((m >> 3) & 1) | (2 if m & j0 else 0))
        bases.append([m, t])
    return bases


def mma_a_bases(warp_bits: int = 3) -> tuple[list, list, list]:
    """wgmma's 8-bit A-operand register layout for [16 x 2^warp_bits x 4 rows m, 64 tokens] with the warps
    along M (k_width 4: a 32-bit register holds four consecutive tokens of one row), as linear-layout
    (register, lane, warp) bases of (m, token): what Triton's DotOperandLayout(0, NVMMA v3, k_width=4) is."""
    reps = [[16 << warp_bits, 0], [32 << warp_bits, 0]]
    return ([[0, 1], [0, 2], [8, 0], [0, 16], [0, 32], *reps],
            [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]], [[16 << i, 0] for i in range(warp_bits)])


def v_load_bases(warp_bits: int = 3) -> tuple[list, list, list]:
    """`mma_a_bases` with the registers reordered for the load through `slot_view_bases(True, ...)`:
    bytes (tokens bits 0-1), then m's top bit (channel bit 2: with the bytes, 8 contiguous bytes per
    load), then m bits 3 and 4 + warp_bits (the registers the 4 x 4 byte transpose trades with the
    bytes), then the tokens' bits 4, 5. Lanes and warps as the MMA's, so the kernels' conversion back
    to the MMA's layout renames whole registers."""
    _, lanes, warps = mma_a_bases(warp_bits)
    top, e, j0 = [32 << warp_bits, 0], [8, 0], [16 << warp_bits, 0]
    return [[0, 1], [0, 2], top, e, j0, [0, 16], [0, 32]], lanes, warps


def transposed_register(reg: int) -> int:
    """Where `experimental/native8._transpose4x4` puts the byte in register slot `reg` (element index in register
    order): bits 0-1 (byte) and 3-4 (register of the four transposed) trade places."""
    return (reg & ~0b11011) | ((reg >> 3) & 3) | ((reg & 3) << 3)


def vt_store_bases(warp_bits: int, n_rows: int) -> tuple[list, list, list]:
    """The PV accumulator O^T [16 x 2^warp_bits x 4 channels, n_rows] (an NVMMA v3 layout, warps along M)
    after the epilogue's reshape to physical channel order, registers reordered so that each thread's 8
    contiguous channels of a row come first (16-byte stores)."""
    cols = [[0, 8 << i] for i in range((n_rows // 8).bit_length() - 1)]
    return ([[1, 0], [2, 0], [4, 0], [0, 1], *cols], [[0, 2], [0, 4], [8, 0], [16, 0], [32, 0]],
            [[64 << i, 0] for i in range(warp_bits)])

"""The benchmark's decode shapes (the targets' shapes, and tiny ones for CPU runs) and their parsing.

Each shape is (B, H, L): B requests of L cached tokens, H query heads, one query token each
(DeepSeek dims r = 512, d = 64). `mixed` is one batch of mixed lengths: 64 requests whose lengths
spread geometrically from 128 to 32768 tokens (a deterministic shuffle), the case where a uniform
split leaves short requests' programs idle.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ..errors import ConfigError

MIXED_SEED = 7


@dataclass(frozen=True)
class DecodeShape:
    name: str
    batch: int
    heads: int
    lengths: tuple[int, ...]  # one per request
    q_tokens: int = 1

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def max_len(self) -> int:
        return max(self.lengths)

    @property
    def uniform(self) -> bool:
        return len(set(self.lengths)) == 1

    @property
    def label(self) -> str:
        if self.uniform:
            return f"B={self.batch} H={self.heads} L={self.max_len}"
        return f"B={self.batch} H={self.heads} L={min(self.lengths)}..{self.max_len} (mixed, sum {self.tokens})"


def uniform_shape(batch: int, heads: int, length: int, q_tokens: int = 1) -> DecodeShape:
    for k, v in (("batch", batch), ("heads", heads), ("length", length), ("q_tokens", q_tokens)):
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"shape {k} must be a positive int, got {v!r}")
    return DecodeShape(f"{batch}x{heads}x{length}", batch, heads, (length,) * batch, q_tokens)


def mixed_shape(batch: int = 64, heads: int = 16, lo: int = 128, hi: int = 32768, seed: int = MIXED_SEED) -> DecodeShape:
    """Lengths lo * (hi / lo)^(i / (batch - 1)), rounded, shuffled deterministically."""
    if batch < 2 or not 1 <= lo <= hi:
        raise ConfigError(f"mixed shape needs batch >= 2 and 1 <= lo <= hi, got {batch}, {lo}, {hi}")
    lengths = [round(lo * (hi / lo) ** (i / (batch - 1))) for i in range(batch)]
    random.Random(seed).shuffle(lengths)
    return DecodeShape(f"mixed{batch}x{heads}", batch, heads, tuple(lengths))


BENCH_SHAPES: tuple[DecodeShape, ...] = (
    uniform_shape(128, 16, 4096),
    uniform_shape(32, 16, 16384),
    uniform_shape(8, 16, 32768),
    uniform_shape(32, 64, 8192),
    uniform_shape(4, 64, 8192),
    uniform_shape(128, 128, 4096),
    uniform_shape(64, 128, 8192),
    uniform_shape(1, 128, 32768),
    mixed_shape(),
)
# Shapes with a performance target (and the mixed batch), in the order the harness visits them.
HEADLINE = ("128x16x4096", "32x64x8192", "128x128x4096", "1x128x32768", "64x128x8192", "mixed64x16")
QUICK = ("128x16x4096", "32x64x8192", "128x128x4096", "1x128x32768")


# CPU runs execute the kernels in the Triton interpreter (thousands of times slower than a GPU): one
# tiny uniform batch and one tiny mixed batch whose lengths cross page boundaries (5, 130, 64 tokens).
CPU_SHAPES: tuple[DecodeShape, ...] = (uniform_shape(2, 4, 64), DecodeShape("mixed3x4", 3, 4, (5, 130, 64)))


def ordered_shapes(shapes: tuple[DecodeShape, ...] = BENCH_SHAPES) -> list[DecodeShape]:
    """Headline shapes first (a budget cut loses the least important ones), then the rest."""
    rank = {n: i for i, n in enumerate(HEADLINE)}
    return sorted(shapes, key=lambda s: rank.get(s.name, len(rank)))


def parse_shapes(spec: str | None, quick: bool = False, cpu: bool = False) -> list[DecodeShape]:
    """`None` -> every target shape (headline first), `quick` -> QUICK, `cpu` -> CPU_SHAPES; otherwise
    a comma list of names ("128x16x4096", "mixed64x16") or new BxHxL triples."""
    by_name = {s.name: s for s in (*BENCH_SHAPES, *CPU_SHAPES)}
    if not spec:
        if cpu:
            return list(CPU_SHAPES)
        return ordered_shapes(tuple(s for s in BENCH_SHAPES if not quick or s.name in QUICK))
    out = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        if item in by_name:
            out.append(by_name[item])
            continue
        parts = item.lower().split("x")
        try:
            b, h, length = (int(p) for p in parts)
        except ValueError:
            raise ConfigError(f"shape {item!r} is not a known name ({', '.join(by_name)}) nor BxHxL") from None
        out.append(uniform_shape(b, h, length))
    return out


def pages(length: int, page: int = 64) -> int:
    return math.ceil(length / page)

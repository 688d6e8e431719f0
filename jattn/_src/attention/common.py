"""What every attention implementation gets: the static problem description and its mods."""

from __future__ import annotations

import dataclasses
from typing import Any

from jattn._src.attention.config import AttentionConfig
from jattn._src.user_functions import TracedFunction


@dataclasses.dataclass(frozen=True)
class Mods:
    """score_mod and mask_mod traced at the shapes of one implementation's tiles.

    score: (score f32, b, h, q_idx, kv_idx) -> score. score_vjp: (score, b, h, q_idx, kv_idx,
    d_out) -> d_score. mask: (b, h, q_idx, kv_idx) -> bool. None where absent. Each reads its
    captured arrays from the call's `score_captures` / `mask_captures` lists.
    """

    score: TracedFunction | None = None
    score_vjp: TracedFunction | None = None
    mask: TracedFunction | None = None


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: a custom_vjp static option
class Problem:
    """Static description of one flex_attention call.

    Shapes: q [B, Hq, L, E], k [Bk, Hkv, S, E], v [Bk, Hkv, S, Ev], Bk in {B, 1}; the BlockMask
    lists have batch Bm in {B, 1} and heads Hm in {Hq, 1}, blocks of mask_block.
    """

    B: int
    Hq: int
    Hkv: int
    L: int
    S: int
    E: int
    Ev: int
    kv_batch: int
    mask_batch: int
    mask_heads: int
    mask_block: tuple[int, int]
    scale: float
    implementation: str
    config: AttentionConfig | None
    fwd: Mods          # kernel forward tile, or the XLA block
    bwd: Mods          # kernel dQ tile [queries, keys], or the XLA block
    dkdv: Mods         # kernel dK/dV tile, transposed: [keys, queries]; or the XLA block
    xla: Mods          # XLA block: the XLA path, and gradients of captured arrays
    decode: Any = None  # a decoding DecodeProblem when the forward runs the decode kernel

    @property
    def groups(self) -> int:
        return self.Hq // self.Hkv

"""What a backend of each GEMM op provides: its registry `Implementation.module`.

Every backend module of an op has the op's entry points with one signature, so that the op's
code calls `implementation.module.<entry point>` and never asks which backend it has. Whether
the op chooses a tile config is `Implementation.tunable` (a backend with a config class).
Adding a backend to an op is a module with these entry points and a registry line.

Arguments every entry point takes, used or not by a backend:
  config: the op's tile config (None on a backend without tunables);
  interpret: run Pallas kernels in the interpreter;
  epilogue_tile / epilogue_full: the user's epilogue traced at the config's tile and at the
    whole output (a backend uses the one it needs; None: no epilogue).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import jax

from jattn._src.user_functions import TracedFunction


class MatmulBackend(Protocol):
    """matmul and bmm, and the products of every GEMM backward."""

    def matmul_product(self, a: jax.Array, b: jax.Array, bias: jax.Array | None,
                       captures: Sequence[Any], *, config: Any, out_dtype,
                       transpose_a: bool, transpose_b: bool,
                       epilogue_tile: TracedFunction | None,
                       epilogue_full: TracedFunction | None, save_preact: bool,
                       interpret: bool):
        """op(a) @ op(b) (+ bias) then the epilogue, on 2-D operands: out [M, N] of
        out_dtype, or (out, the float32 values before the epilogue) if save_preact."""


class MmPlusMmBackend(Protocol):
    """mm_plus_mm."""

    def mm_plus_mm_product(self, a: jax.Array, b: jax.Array, c: jax.Array, d: jax.Array,
                           bias: jax.Array | None, captures: Sequence[Any], *, config: Any,
                           out_dtype, epilogue_tile: TracedFunction | None,
                           epilogue_full: TracedFunction | None, save_preact: bool,
                           interpret: bool):
        """a @ b + c @ d (+ bias) then the epilogue; returns as matmul_product."""


class ScaledBackend(Protocol):
    """scaled_matmul."""

    def scaled_product(self, a: jax.Array, b: jax.Array, scale_a: jax.Array,
                       scale_b: jax.Array, bias: jax.Array | None, *, config: Any, out_dtype,
                       use_fast_accum: bool, interpret: bool) -> jax.Array:
        """(a @ b) · scale_a · scale_b (+ bias) of fp8 operands, float32 accumulation."""


class B2BBackend(Protocol):
    """b2b_matmul."""

    def holds(self, held_size: int) -> bool:
        """Whether one program can hold an output side of `held_size` whole (else the op runs
        as two matmuls)."""

    def b2b_product(self, a: jax.Array, b: jax.Array, c: jax.Array, captures: Sequence[Any], *,
                    side: str, config: Any, fn_tile: TracedFunction | None,
                    fn_full: TracedFunction | None, interpret: bool) -> jax.Array:
        """fn(a @ b) @ c (side "left") or a @ fn(b @ c) ("right"), the intermediate rounded
        to the inputs' dtype before the second product."""


class MixedBackend(Protocol):
    """mixed_matmul."""

    def mixed_product(self, a: jax.Array, qweight: jax.Array, scales: jax.Array, *, bits: int,
                      group_size: int | None, config: Any, out_dtype,
                      interpret: bool) -> jax.Array:
        """a @ dequantise(qweight, scales): [M, N] of out_dtype."""

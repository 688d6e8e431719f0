"""Building BlockMasks and dense masks from a mask_mod, on the device and memory-bounded."""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jattn._src import guards, index_bounds
from jattn._src.compat import jaxpr_and_consts
from jattn._src.masks.block_mask import BlockMask, MaskMod, _pair
from jattn._src.masks.fitting import legal_block
from jattn._src.mod_errors import MASK_PARAMETERS, check_parameters, traced_values_explained
from jattn._src.programs import ProgramCache
from jattn._src.tiling import cdiv
from jattn._src.user_functions import CaptureSet, TracedFunction


def _chunk_elements() -> int:
    """Mask elements evaluated per step of create_block_mask. On GPUs XLA fuses the evaluation
    into the per-block count (a few MiB at 128k); the CPU backend materialises a step's int32
    counts input, so it takes smaller steps."""
    return 1 << 27 if jax.default_backend() == "gpu" else 1 << 23


def _unrolled_steps() -> int:
    """Steps of create_block_mask unrolled into one stretch of kernels. A loop on the GPU waits
    on the host for each iteration's condition (L 32k: 0.56 ms in a loop of 8 steps, 0.37 in
    one step, H100); the CPU backend would hold every unrolled step's counts input at once."""
    return 8 if jax.default_backend() == "gpu" else 1


def _index_grids(B: int, H: int):
    b = jnp.arange(B, dtype=jnp.int32)[:, None, None, None]
    h = jnp.arange(H, dtype=jnp.int32)[None, :, None, None]
    return b, h


def _evaluate(fn: str, mask_mod: MaskMod, b, h, q_idx, kv_idx, shape) -> jax.Array:
    with traced_values_explained(fn, "mask_mod", mask_mod):
        out = mask_mod(b, h, q_idx, kv_idx)
    if not hasattr(out, "dtype") or out.dtype != jnp.bool_:
        raise TypeError(f"mask_mod must return a bool array, got "
                        f"{getattr(out, 'dtype', type(out).__name__)}; compare instead "
                        "(e.g. `q_idx >= kv_idx`).")
    return jnp.broadcast_to(out, shape)


@dataclasses.dataclass(frozen=True)
class _Sizes:
    B: int
    H: int
    q_len: int
    kv_len: int
    block_q: int
    block_kv: int

    def signature(self) -> list[jax.ShapeDtypeStruct]:
        """mask_mod's argument shapes in the builder: one block, [B, H, block_q, block_kv]."""
        return [jax.ShapeDtypeStruct(shape, jnp.int32) for shape in (
            (self.B, 1, 1, 1), (1, self.H, 1, 1), (1, 1, self.block_q, 1),
            (1, 1, 1, self.block_kv))]


def _build(mask_mod: TracedFunction, sizes: _Sizes, captures) -> BlockMask:
    """Counts the attending pairs of every block, a few query-block rows per step, then lists
    the partial (some pairs) and full (all pairs) blocks. mask_mod: traced at
    `sizes.signature()`, reading `captures`."""
    B, H, q_len, kv_len = sizes.B, sizes.H, sizes.q_len, sizes.kv_len
    block_q, block_kv = sizes.block_q, sizes.block_kv
    n_q, n_kv = cdiv(q_len, block_q), cdiv(kv_len, block_kv)
    rows = max(1, min(n_q, _chunk_elements() // (B * H * block_q * n_kv * block_kv)))
    b, h = _index_grids(B, H)
    q_in_block = jnp.arange(block_q, dtype=jnp.int32)[None, None, :, None]
    kv_in_block = jnp.arange(block_kv, dtype=jnp.int32)[None, None, None, :]
    kv_starts = jnp.arange(n_kv, dtype=jnp.int32) * block_kv
    ragged = bool(q_len % block_q or kv_len % block_kv)
    shape = (B, H, block_q, block_kv)

    def attends(q, kv):
        return jnp.broadcast_to(mask_mod(captures, b, h, q, kv)[0], shape)

    def block(q0, kv0):
        """Attending pairs of the block at (q0, kv0): mask_mod on the usual [B, H, q, kv]
        shapes, vmapped over blocks so the count reduces contiguous elements."""
        q, kv = q0 + q_in_block, kv0 + kv_in_block
        if not ragged:
            return attends(q, kv).sum((-2, -1), dtype=jnp.int32)
        # Positions past the ends are evaluated at the last valid index (a captured array
        # never sees an index past its end) and not counted.
        pairs = attends(jnp.minimum(q, q_len - 1), jnp.minimum(kv, kv_len - 1))
        return (pairs & (q < q_len) & (kv < kv_len)).sum((-2, -1), dtype=jnp.int32)

    row_of_blocks = jax.vmap(block, in_axes=(None, 0))  # [n_kv, B, H]

    def step(first_row):
        q_starts = (first_row + jnp.arange(rows, dtype=jnp.int32)) * block_q
        return jax.vmap(row_of_blocks, in_axes=(0, None))(q_starts, kv_starts)

    starts = jnp.arange(0, n_q, rows, dtype=jnp.int32)
    _, counts = lax.scan(lambda _, first_row: (None, step(first_row)), None, starts,
                         unroll=min(len(starts), _unrolled_steps()))  # [steps, rows, nKV, B, H]
    counts = jnp.moveaxis(counts.reshape(-1, n_kv, B, H)[:n_q], (0, 1), (2, 3))
    # A block reaching past an end is partial, as torch lists it (its padding does not
    # attend), so that the mask_mod still decides there when the mask is adjusted longer.
    full = counts == block_q * block_kv
    return BlockMask.from_dense_blocks((counts > 0) & ~full, full,
                                       block_size=(block_q, block_kv),
                                       seq_lengths=(q_len, kv_len), mask_mod=None)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """A mask_mod's builder: the compiled program and where its captured arrays come from
    (`guards.fetch`)."""
    program: Callable[[Any], BlockMask]
    sources: tuple


# The builders, by what their mask_mod computes (its jaxpr) and the sizes: new values of the
# arrays it reads are arguments, so they reuse the compiled builder.
_BUILDERS: ProgramCache[Callable] = ProgramCache("create_block_mask.builders")
# The plans of mask_mods by what they read (guards.read_state) and the sizes: a call whose
# mask_mod reads the same Python values neither traces nor compiles.
_PLANS: ProgramCache[_Plan] = ProgramCache("create_block_mask.plans")


def _plan(mask_mod: MaskMod, sizes: _Sizes, state: guards.State) -> _Plan:
    """Traces mask_mod at the builder's block, checks it, and finds (or compiles) its
    builder; the plan is stored under the guards' record where they made one."""
    fn = "create_block_mask"
    with traced_values_explained(fn, "mask_mod", mask_mod):
        traced = CaptureSet().trace(mask_mod, sizes.signature())
    out = traced.out_avals
    if len(out) != 1 or out[0].dtype != jnp.bool_:
        raise TypeError(f"{fn}: `mask_mod` must return a bool array, got "
                        f"{', '.join(str(a.dtype) for a in out)}; compare instead (e.g. "
                        "`q_idx >= kv_idx`).")
    index_bounds.check_mods(fn, [("mask_mod", mask_mod, traced.key)], dict(
        b=sizes.B, h=sizes.H, q_idx=sizes.q_len, kv_idx=sizes.kv_len))
    key = (traced.key, sizes)
    program = _BUILDERS.get(key)
    if program is None:
        program = _BUILDERS.put(key, jax.jit(functools.partial(
            _build, traced.without_captures(), sizes)))
    captures = jaxpr_and_consts(traced.closed_jaxpr)[1]
    sources = guards.sources_of(list(captures), state.arrays)
    plan = _Plan(program, sources if sources is not None else tuple(
        ("value", c) for c in captures))
    if state.record is not None and sources is not None:
        plan = _PLANS.put((state.record, sizes, jax.default_backend()), plan)
    return plan


def builder(mask_mod: MaskMod, B: int, H: int, Q_LEN: int, KV_LEN: int,
            block_size: tuple[int, int]) -> tuple[Callable, list]:
    """The compiled builder of a create_block_mask call and the arrays it takes (for memory
    analysis: `program.lower(arrays).compile()`)."""
    sizes = _built_sizes(B, H, Q_LEN, KV_LEN, block_size)
    state = guards.read_state(mask_mod)
    plan = _plan(mask_mod, sizes, state)
    return plan.program, guards.fetch(plan.sources, state.arrays)


def _built_sizes(B: int, H: int, Q_LEN: int, KV_LEN: int,
                 block_size: tuple[int, int]) -> _Sizes:
    """The builder's sizes. A block past the sequence's end holds it whole: it is built at the
    shortest such block (the same lists) and reported at the size asked for, as torch does."""
    return _Sizes(B, H, Q_LEN, KV_LEN, *(legal_block(b, n) if b >= n else b
                                         for b, n in zip(block_size, (Q_LEN, KV_LEN))))


def _check_sizes(fn: str, B, H, Q_LEN, KV_LEN) -> tuple[int, int, int, int]:
    sizes = []
    for name, value, optional in (("B", B, True), ("H", H, True), ("Q_LEN", Q_LEN, False),
                                  ("KV_LEN", KV_LEN, False)):
        if value is None and optional:
            value = 1
        # any integer (numpy's too), never a bool or a float; a plain int checked first (the
        # ABC check costs microseconds, on every step of a training loop)
        integer = type(value) is int or (isinstance(value, numbers.Integral)
                                         and not isinstance(value, bool))
        if not integer or value < 1:
            raise ValueError(f"{fn}: `{name}` must be a positive int"
                             f"{' or None' if optional else ''}, got {value!r}.")
        sizes.append(int(value))
    return tuple(sizes)


def create_block_mask(mask_mod: MaskMod, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,
                      *, block_size: int | tuple[int, int] = 128) -> BlockMask:
    """The BlockMask of `mask_mod(b, h, q_idx, kv_idx) -> bool` for a [B, H, Q_LEN, KV_LEN] score.

    Each block_size[0] x block_size[1] block of the score is classified once: full (every pair
    attends; the kernels skip mask_mod there), partial (mask_mod decides per pair) or empty
    (never visited), so the attention's cost follows the mask's density.

    Args:
      mask_mod: `f(b, h, q_idx, kv_idx) -> bool` on int32 index arrays that broadcast to
        [B, H, q, kv]; True where the query may attend to the key. Arrays it closes over
        (document ids, ...) are read when the mask is built and again, as kernel inputs, when
        flex_attention applies it to partial blocks. See `jattn.masks` for ready-made ones.
      B, H: batch and heads, or None (1) to share one mask across them.
      Q_LEN, KV_LEN: the query and key lengths of the attention it is for.
      block_size: int or (q, kv) pair, 128 as torch. Any size works: the kernels use blocks
        that are multiples of 16, and flex_attention fits other masks to them with the same
        attention (a block past the sequence holds it whole; smaller ones are grouped).

    Returns:
      A BlockMask (int32 block lists shaped [B, H, nQ, nKV] and the like; `repr` draws it).

    mask_mod is evaluated on the default device in steps of a few query blocks, never holding
    the dense Q_LEN x KV_LEN mask.

    Example::

        mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 256, 256)
        q = k = v = jnp.ones((1, 2, 256, 32), jnp.bfloat16)  # q, k, v [B, H, 256, E]
        out = jattn.flex_attention(q, k, v, block_mask=mask)
        print(mask.num_blocks, out.shape)  # (2, 2) (1, 2, 256, 32)
    """
    B, H, Q_LEN, KV_LEN = _check_sizes("create_block_mask", B, H, Q_LEN, KV_LEN)
    block_size = _pair("block_size", block_size, minimum=1)
    if not callable(mask_mod):
        raise TypeError(f"create_block_mask: `mask_mod` must be callable, got {mask_mod!r}.")
    check_parameters("create_block_mask", "mask_mod", mask_mod, MASK_PARAMETERS)
    sizes = _built_sizes(B, H, Q_LEN, KV_LEN, block_size)
    state = guards.read_state(mask_mod)
    plan = None
    if state.record is not None:
        plan = _PLANS.get((state.record, sizes, jax.default_backend()))
    if plan is None:
        plan = _plan(mask_mod, sizes, state)
    mask = plan.program(guards.fetch(plan.sources, state.arrays))
    return dataclasses.replace(mask, block_size=block_size, mask_mod=mask_mod)


def create_mask(mask_mod: MaskMod, B: int | None, H: int | None, Q_LEN: int,
                KV_LEN: int) -> jax.Array:
    """The dense [B, H, Q_LEN, KV_LEN] bool mask of `mask_mod` (B or H None: 1), for tests
    and debugging: it takes O(Q_LEN · KV_LEN) memory, which `create_block_mask` never does.

    Args:
      mask_mod: `f(b, h, q_idx, kv_idx) -> bool` on broadcastable int32 index arrays.
      B, H: batch and heads (ints), or None for 1. Q_LEN, KV_LEN: ints >= 1.

    Returns:
      bool [B, H, Q_LEN, KV_LEN], True where the query attends to the key.

    Example::

        dense = jattn.create_mask(jattn.masks.sliding_window(4), None, None, 8, 8)  # [1,1,8,8]
        print(dense.shape, dense.dtype)  # (1, 1, 8, 8) bool
    """
    B, H, Q_LEN, KV_LEN = _check_sizes("create_mask", B, H, Q_LEN, KV_LEN)
    b, h = _index_grids(B, H)
    q = jnp.arange(Q_LEN, dtype=jnp.int32)[None, None, :, None]
    kv = jnp.arange(KV_LEN, dtype=jnp.int32)[None, None, None, :]
    check_parameters("create_mask", "mask_mod", mask_mod, MASK_PARAMETERS)
    return _evaluate("create_mask", mask_mod, b, h, q, kv, (B, H, Q_LEN, KV_LEN))

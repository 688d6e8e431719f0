"""flex_decode on the split-KV Pallas kernels (pallas_triton, and the interpreter): programs
made once per problem, and plans of eager calls that skip tracing the mods again. Query blocks
longer than the kernel takes (MAX_DECODE_QUERIES) run flex_attention over the cache on the same
backend's kernels (decoding/xla.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jattn._src import guards
from jattn._src.attention import pallas_triton_split_kv
from jattn._src.attention.common import checked_mask_mod, checked_score_mod, without_captures
from jattn._src.attention.split_kv import MAX_DECODE_QUERIES, DecodeProblem, make_problem
from jattn._src.decoding import xla
from jattn._src.decoding.call import CacheDims, DecodeCall, bad_lengths, no_gradient
from jattn._src.precision import applied as precision_applied
from jattn._src.programs import ProgramCache
from jattn._src.user_functions import CaptureSet

_OP = "flex_decode"


def decode(call: DecodeCall):
    """(out, lse) of the split-KV kernels. The kernels clip the lengths and write NaN rows for
    bad sequences themselves (where the host has not checked them): under jit each XLA op
    here would be a kernel launch of its own per call."""
    if call.q.shape[2] > MAX_DECODE_QUERIES:
        return xla.decode(call)
    q, k, v, table = call.q, call.k, call.v, None
    if call.cache is not None:
        k, v, table = call.cache.k_pages, call.cache.v_pages, call.cache.page_table
    program, score_caps, mask_caps = _kernel_plan(
        q, k, v, table, call.score_mod, call.block_mask, call.dims, call.static_length,
        not call.checked, call.scale, call.config, call.implementation, call.precision,
        call.state)
    lists = [] if call.block_mask is None else call.block_mask.lists().major("kv")
    kv_len = None if call.static_length else call.kv_len
    return program(q, k, v, kv_len, table, lists, score_caps, mask_caps)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """A decode kernel call's program and where its mods' captured arrays come from."""

    program: Callable
    score_sources: tuple
    mask_sources: tuple


# Plans of eager calls, by the mods' guards record, shapes and options.
_PLANS: ProgramCache[_Plan] = ProgramCache("flex_decode.plans")


def _kernel_plan(q, k, v, table, score_mod, block_mask, dims: CacheDims, static_length, check,
                 scale, config, implementation, precision, state: guards.State):
    """(program, score captures, mask captures) of a call on the split-KV kernel: an eager
    call whose mods read what an earlier one's read reuses its plan; otherwise the mods are
    traced at the kernel's tiles."""
    B, Hq, Lq, _ = q.shape
    eager = not any(isinstance(x, jax.core.Tracer) for x in (q, k, v, table))
    key = None
    if eager and state.record is not None:
        key = (state.record, q.shape, q.dtype, dims, None if table is None else table.shape,
               static_length, check, scale, config, implementation.name, precision,
               None if block_mask is None else (
                   block_mask.block_size, block_mask.kv_num_blocks.shape,
                   block_mask.full_kv_num_blocks is None))
        plan = _PLANS.get(key)
        if plan is not None:
            return (plan.program, tuple(guards.fetch(plan.score_sources, state.arrays)),
                    tuple(guards.fetch(plan.mask_sources, state.arrays)))
    score_set, mask_set = CaptureSet(), CaptureSet()
    mask_mod = None if block_mask is None else block_mask.mask_mod
    problem = make_problem(
        B=B, Hq=Hq, Hkv=dims.Hkv, Lq=Lq, S=dims.S, E=dims.E, Ev=dims.Ev,
        kv_batch=dims.kv_batch, page_size=dims.page_size, num_pages=dims.num_pages,
        block_mask=block_mask,
        score_mod=None if score_mod is None else checked_score_mod(
            score_mod, _OP, (B, Hq, Lq, dims.S)),
        mask_mod=None if mask_mod is None else checked_mask_mod(mask_mod, _OP),
        score_set=score_set, mask_set=mask_set, static_length=static_length,
        queries_last=True, scale=scale, interpret=implementation.backend.interpret,
        config=config)
    program = _kernel_program(problem, precision, check)
    score_caps, mask_caps = tuple(score_set.captures), tuple(mask_set.captures)
    if key is not None:
        sources = [guards.sources_of(list(caps), state.arrays) for caps in (score_caps,
                                                                           mask_caps)]
        if None not in sources:
            _PLANS.put(key, _Plan(program, *sources))
    return program, score_caps, mask_caps


# Kernel programs, one per problem.
_PROGRAMS: ProgramCache[Callable] = ProgramCache("flex_decode.programs")


def _problem_key(p: DecodeProblem) -> tuple:
    """Everything the kernels' program depends on: the problem's fields, its mods by what they
    compute (not the arrays they captured)."""
    fields = tuple(getattr(p, f.name) for f in dataclasses.fields(p) if f.name != "mods")
    return fields + tuple(None if f is None else f.key for f in (p.mods.score, p.mods.mask))


def _kernel_program(p: DecodeProblem, precision: str | None, check: bool) -> Callable:
    """The jitted split-KV decode of p at `precision` (made once per problem key); with
    `check`, it finds the bad sequences of kv_len (`bad_lengths`) itself."""
    key = (_problem_key(p), precision, check)
    program = _PROGRAMS.get(key)
    if program is None:
        stripped = dataclasses.replace(p, mods=without_captures(p.mods))

        def run(q, k, v, kv_len, table, lists, score_caps, mask_caps):
            bad = None
            if check:
                lengths = jnp.full((p.B,), p.S, jnp.int32) if kv_len is None else kv_len
                bad = bad_lengths(jnp, lengths, p.S, p.page_size, p.num_pages, table)
            q, k, v, score_caps = no_gradient((q, k, v, score_caps))
            with precision_applied(precision):
                return pallas_triton_split_kv.forward(stripped, q, k, v, kv_len, table, lists,
                                                      score_caps, mask_caps, bad=bad)

        program = _PROGRAMS.put(key, jax.jit(run))
    return program

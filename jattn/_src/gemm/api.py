"""Public GEMM entry points: validation, config choice and the custom_vjp."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jattn._src import backends, guards, hardware
from jattn._src.backends import Implementation
from jattn._src.gemm import pallas_mosaic_gpu, pallas_triton, xla
from jattn._src.gemm.config import (MatmulConfig, MosaicMatmulConfig, heuristic_config,
                                    heuristic_mosaic_config, mosaic_search_space,
                                    search_space)
from jattn._src.precision import applied as precision_applied
from jattn._src.precision import canonical as canonical_precision
from jattn._src.programs import ProgramCache, jitted
from jattn._src.tiling import next_power_of_two
from jattn._src.tuning import autotune, cache
from jattn._src.user_functions import TracedFunction, trace_with_captures

_INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _triton_unsupported(*, config=None, **facts) -> str | None:
    if isinstance(config, MosaicMatmulConfig):
        return ("a MosaicMatmulConfig gives pallas_mosaic_gpu's tiles; pass a MatmulConfig for "
                "these kernels.")
    return None


# The GEMM family: XLA's dot, or jattn's Pallas kernels (MatmulConfig tiles); matmul, bmm and
# scaled_matmul also on Mosaic GPU (MosaicMatmulConfig tiles). The backward products run
# matmul's implementation.
for _op in ("matmul", "bmm", "mm_plus_mm", "scaled_matmul"):
    backends.register_xla_and_kernels(_op, xla, pallas_triton, config_class=MatmulConfig,
                                      heuristic=heuristic_config, search_space=search_space,
                                      unsupported=_triton_unsupported)
for _op in ("matmul", "bmm", "scaled_matmul"):
    backends.register(Implementation(
        _op, backends.PALLAS_MOSAIC_GPU, pallas_mosaic_gpu,
        unsupported=pallas_mosaic_gpu.unsupported, slower=pallas_mosaic_gpu.slower,
        config_class=MosaicMatmulConfig, heuristic=heuristic_mosaic_config,
        search_space=mosaic_search_space))

Config = MatmulConfig | MosaicMatmulConfig

Epilogue = Callable[..., jax.Array]


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------

def check_operands(op: str, a: jax.Array, b: jax.Array, b_max_ndim: int | None,
                   names: tuple[str, str] = ("a", "b")) -> None:
    """Rank, dtype and inner-dimension checks of one product `a @ b`, named as the caller's."""
    a_name, b_name = names
    for name, x in ((a_name, a), (b_name, b)):
        if x.ndim < 2:
            raise ValueError(f"{op}: `{name}` must have rank >= 2, got shape {x.shape}.")
        if x.dtype not in _INPUT_DTYPES:
            raise TypeError(f"{op}: `{name}` has dtype {x.dtype}; supported input dtypes are "
                            "bfloat16, float16 and float32 (cast integers first).")
    if b_max_ndim is not None and b.ndim > b_max_ndim:
        raise ValueError(f"{op}: `{b_name}` must be a [K, N] matrix, got shape {b.shape}; use "
                         "jattn.bmm for batched right-hand sides.")
    if a.dtype != b.dtype:
        raise TypeError(f"{op}: `{a_name}` and `{b_name}` must have the same dtype, got "
                        f"{a.dtype} and {b.dtype}; cast one of them.")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"{op}: inner dimensions differ: {a_name} {a.shape} has "
                         f"K={a.shape[-1]} but {b_name} {b.shape} has K={b.shape[-2]}.")


def _check_bias(op: str, bias: jax.Array | None, n: int) -> None:
    if bias is None:
        return
    if bias.shape != (n,):
        raise ValueError(f"{op}: `bias` must have shape ({n},) (one value per output column), "
                         f"got {bias.shape}.")
    if not jnp.issubdtype(bias.dtype, jnp.floating):
        raise TypeError(f"{op}: `bias` must be floating point, got {bias.dtype}.")


def _out_dtype(op: str, out_dtype: Any, in_dtype: jnp.dtype) -> jnp.dtype:
    if out_dtype is None:
        return in_dtype
    dtype = jnp.dtype(out_dtype)
    if dtype not in _INPUT_DTYPES:
        raise TypeError(f"{op}: `out_dtype`={dtype} is not supported; use bfloat16, float16 or "
                        "float32.")
    return dtype


def _with_indices(op: str, epilogue: Epilogue) -> Callable[..., jax.Array]:
    """The epilogue as f(x, rows, cols), whether the user's takes (x) or (x, rows, cols)."""
    if not callable(epilogue):
        raise TypeError(f"{op}: `epilogue` must be callable, got {type(epilogue).__name__}.")
    try:
        parameters = inspect.signature(epilogue).parameters.values()
    except (TypeError, ValueError):  # no signature to read: assume f(x)
        return lambda x, rows, cols: epilogue(x)
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in parameters if p.kind in positional and p.default is p.empty]
    if len(required) == 3:
        return epilogue
    if len(required) == 1:
        return lambda x, rows, cols: epilogue(x)
    raise TypeError(f"{op}: `epilogue` must take (x) or (x, rows, cols); "
                    f"{getattr(epilogue, '__name__', epilogue)} requires {len(required)} "
                    "positional arguments.")


def _trace_epilogue(op: str, epilogue: Epilogue, tile: tuple[int, int], full: tuple[int, int]):
    """Traces the epilogue at the kernel tile and at the whole [M, N] output."""
    fn = _with_indices(op, epilogue)

    def signature(m: int, n: int):
        return (jax.ShapeDtypeStruct((m, n), jnp.float32),
                jax.ShapeDtypeStruct((m, 1), jnp.int32), jax.ShapeDtypeStruct((1, n), jnp.int32))

    (on_tile, on_full), captures = trace_with_captures(fn, signature(*tile), signature(*full))
    outs = on_full.out_avals
    if len(outs) != 1 or outs[0].shape != full or not jnp.issubdtype(outs[0].dtype, jnp.floating):
        seen = ", ".join(f"{o.dtype}{list(o.shape)}" for o in outs)
        raise ValueError(f"{op}: `epilogue` must return one floating array shaped like its input "
                         f"{list(full)}; it returned {seen}.")
    return on_tile, on_full, captures


# ------------------------------------------------------------------------------------------------
# Config choice
# ------------------------------------------------------------------------------------------------

# Makes, for a candidate config, a zero-argument function that runs the op once on fixed inputs
# of the tuned shape (what the autotuner times).
RunMaker = Callable[[Config], Callable[[], Any]]


def _cache_key(implementation: Implementation, m: int, n: int, k: int, dtype: jnp.dtype,
               fast_accum: bool = False, batch: int = 1) -> str:
    bucket = "x".join(str(next_power_of_two(d)) for d in (m, n, k))
    return (f"{implementation.name}|{hardware.device_kind()}|{bucket}|"
            f"{jnp.dtype(dtype).name}" + ("|fast_accum" if fast_accum else "")
            + (f"|batch{next_power_of_two(batch)}" if batch > 1 else ""))


def random_operand(shape: tuple[int, ...], dtype, seed: int) -> jax.Array:
    """A standard-normal operand for timing candidate configs."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _matmul_runs(implementation: Implementation, m: int, n: int, k: int, dtype,
                 batch: int = 1) -> RunMaker:
    """`batch` products in one launch (bmm: vmapped) where batch > 1."""
    lead = (batch,) if batch > 1 else ()
    a, b = random_operand((*lead, m, k), dtype, 0), random_operand((*lead, k, n), dtype, 1)

    def make_run(config: Config):
        product = functools.partial(_product, implementation, config, dtype)
        run = jax.jit(jax.vmap(product) if lead else product)
        return lambda: run(a, b)

    return make_run


def _check_config_type(op: str, config: Any) -> None:
    if not (config is None or isinstance(config, Config) or config == "autotune"):
        raise TypeError(f"{op}: `config` must be a MatmulConfig (pallas_triton), a "
                        f"MosaicMatmulConfig (pallas_mosaic_gpu), None or 'autotune', got "
                        f"{config!r}.")


def choose_config(op: str, implementation: Implementation, config: Config | str | None,
                  m: int, n: int, k: int, dtype: jnp.dtype, *, runs: RunMaker | None = None,
                  split_k: bool = True, fast_accum: bool = False, batch: int = 1) -> Config:
    """The config of one `op` product on a kernel implementation: the caller's as given; else
    the op's cached tuning result; else (config="autotune") the search space timed now on
    this device with `runs` (default: matmul's, the whole batch in one launch) and the winner
    cached under (op, implementation, device, shape bucket, dtype, fast_accum, batch bucket);
    else the heuristic.
    split_k=False: the op's kernel cannot split K (a cached or heuristic config runs with
    split_k = 1). fast_accum: fp8 accumulated by the tensor cores throughout (tiles that
    promote partial sums need not fit). batch: products of this shape in one launch (bmm).
    """
    if isinstance(config, implementation.config_class):
        return config
    key = _cache_key(implementation, m, n, k, dtype, fast_accum, batch)
    cached = cache.lookup(op, key)
    if cached is not None:
        chosen = implementation.config_class(**cached)
    elif config == "autotune":
        candidates = implementation.search_space(m, n, k, dtype, fast_accum=fast_accum,
                                                 batch=batch)
        if not split_k:
            candidates = list(dict.fromkeys(dataclasses.replace(c, split_k=1)
                                            for c in candidates))
        make_run = runs or _matmul_runs(implementation, m, n, k, dtype, batch)
        chosen, _ = autotune.autotune(
            candidates, make_run,
            desc=f"jattn: tuning {op} {m}x{n}x{k} {jnp.dtype(dtype).name}")
        cache.store(op, key, dataclasses.asdict(chosen))
    else:
        chosen = implementation.heuristic(m, n, k, dtype, fast_accum=fast_accum, batch=batch)
    if split_k or not hasattr(chosen, "split_k"):
        return chosen
    return dataclasses.replace(chosen, split_k=1)


# ------------------------------------------------------------------------------------------------
# One product on 2-D operands, by implementation
# ------------------------------------------------------------------------------------------------

def _product(implementation: Implementation, config: MatmulConfig | None, out_dtype, a, b,
             bias=None, captures: Sequence[Any] = (), *, transpose_a=False, transpose_b=False,
             epilogue_tile: TracedFunction | None = None,
             epilogue_full: TracedFunction | None = None, save_preact=False):
    return implementation.module.matmul_product(
        a, b, bias, captures, config=config, out_dtype=out_dtype, transpose_a=transpose_a,
        transpose_b=transpose_b, epilogue_tile=epilogue_tile, epilogue_full=epilogue_full,
        save_preact=save_preact, interpret=implementation.backend.interpret)


def product_for_shape(implementation: Implementation, a, b, out_dtype, batch: int = 1,
                      **transposes):
    """A plain product (no bias, no epilogue) with matmul's config for its own shape, one of
    `batch` such products in one launch (bmm's backward under its vmap).

    The products of every GEMM backward; `transposes` are transpose_a / transpose_b. They run
    on matmul's implementation on the call's backend, or where that cannot run this product
    or was measured slower at it (the Mosaic kernel at shapes it does not tile or at small
    outputs), on matmul's default choice for it.
    """
    config = None
    m = a.shape[1] if transposes.get("transpose_a") else a.shape[0]
    k = a.shape[0] if transposes.get("transpose_a") else a.shape[1]
    n = b.shape[0] if transposes.get("transpose_b") else b.shape[1]
    facts = dict(dtype=a.dtype, m=m, n=n, k=k, batch=batch)
    implementation = backends.on_backend_of("matmul", implementation)
    if (implementation.unsupported(**facts) or implementation.slower(**facts)) is not None:
        implementation = backends.resolve("matmul", **facts)
    if implementation.tunable:
        config = choose_config("matmul", implementation, None, m, n, k, a.dtype, batch=batch)
    return _product(implementation, config, out_dtype, a, b, **transposes)


@dataclasses.dataclass(frozen=True)
class Options:
    """Everything static about one matmul call (the custom_vjp's non-differentiable argument)."""

    implementation: Implementation
    config: MatmulConfig | None
    out_dtype: jnp.dtype
    epilogue_tile: TracedFunction | None
    epilogue_full: TracedFunction | None
    precision: str | None = None  # float32 products (jattn._src.precision)
    batch: int = 1  # products of this shape in one launch (bmm)

    def product(self, a, b, bias=None, captures=(), *, save_preact=False):
        with precision_applied(self.precision):
            return _product(self.implementation, self.config, self.out_dtype, a, b, bias,
                            captures, epilogue_tile=self.epilogue_tile,
                            epilogue_full=self.epilogue_full, save_preact=save_preact)

    def backward_product(self, a, b, out_dtype, **transposes):
        """A plain product of the backward pass, with its own config for its own shape."""
        with precision_applied(self.precision):
            return product_for_shape(self.implementation, a, b, out_dtype, self.batch,
                                     **transposes)

    def preact_cotangent(self, preact, captures, d_out):
        """(d_preact in fp32, d_captures): d_out pulled back through the epilogue."""
        if self.epilogue_full is None:
            return d_out.astype(jnp.float32), ()
        m, n = d_out.shape
        rows = jax.lax.broadcasted_iota(jnp.int32, (m, 1), 0)
        cols = jax.lax.broadcasted_iota(jnp.int32, (1, n), 1)

        def epilogue(preact, captures):
            return self.epilogue_full(captures, preact, rows, cols)[0]

        _, epilogue_vjp = jax.vjp(epilogue, preact, captures)
        return epilogue_vjp(d_out.astype(jnp.float32))


class _Residuals(NamedTuple):
    a: jax.Array
    b: jax.Array
    bias: jax.Array | None
    captures: tuple[Any, ...]
    preact: jax.Array | None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _matmul(options: Options, a, b, bias, captures):
    return options.product(a, b, bias, captures)


def _matmul_fwd(options: Options, a, b, bias, captures):
    if options.epilogue_full is None:
        return options.product(a, b, bias, captures), _Residuals(a, b, bias, captures, None)
    out, preact = options.product(a, b, bias, captures, save_preact=True)
    return out, _Residuals(a, b, bias, captures, preact)


def _matmul_bwd(options: Options, res: _Residuals, d_out):
    d_preact, d_captures = options.preact_cotangent(res.preact, res.captures, d_out)
    d_operand = d_preact.astype(res.a.dtype)
    d_a = options.backward_product(d_operand, res.b, res.a.dtype, transpose_b=True)
    d_b = options.backward_product(res.a, d_operand, res.b.dtype, transpose_a=True)
    d_bias = None if res.bias is None else d_preact.sum(axis=0).astype(res.bias.dtype)
    return d_a, d_b, d_bias, d_captures


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


# ------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------

def make_options(op: str, m: int, n: int, k: int, dtype, bias, epilogue, out_dtype, config,
                 implementation, *, split_k: bool = True, runs: Callable | None = None,
                 precision=None, fast_accum: bool = False,
                 batch: int = 1) -> tuple[Options, tuple[Any, ...]]:
    """Validated static options of an [m, k] @ [k, n] product, and the epilogue's captures.

    split_k=False (fused variants that cannot split K): a caller's config with split_k > 1 is
    rejected, and a cached or heuristic one runs with split_k = 1. runs(implementation): the
    op's RunMaker for config="autotune" (default: a plain matmul of the shape). fast_accum,
    batch: as `choose_config`'s.
    """
    _check_bias(op, bias, n)
    out_dtype = _out_dtype(op, out_dtype, dtype)
    _check_config_type(op, config)
    precision = canonical_precision(op, precision)
    # An epilogue that reads what an earlier call's read reuses that call's options (no trace).
    state = guards.read_state(epilogue)
    key = None
    if state.record is not None and not backends.explaining() and not any(
            isinstance(x, jax.core.Tracer) for x in state.arrays):
        key = (op, m, n, k, jnp.dtype(dtype), out_dtype, config, implementation, split_k,
               fast_accum, batch, precision, state.record, backends.requested_implementation(),
               hardware.default_platform())
        plan = _PLANS.get(key) if runs is None else None
        if plan is not None:
            return plan[0], tuple(guards.fetch(plan[1], state.arrays))
    options, captures = _traced_options(op, m, n, k, dtype, epilogue, out_dtype, config,
                                        implementation, split_k, runs, precision, fast_accum,
                                        batch)
    sources = None if key is None else guards.sources_of(list(captures), state.arrays)
    if sources is not None and runs is None:
        _PLANS.put(key, (options, sources))
    return options, captures


# Options of eager calls by their epilogue's guards record, shapes and arguments.
_PLANS: ProgramCache[tuple] = ProgramCache("gemm.plans")


def _traced_options(op, m, n, k, dtype, epilogue, out_dtype, config, implementation, split_k,
                    runs, precision, fast_accum, batch) -> tuple[Options, tuple[Any, ...]]:
    """make_options' slow path: the implementation and config chosen, the epilogue traced."""
    implementation = backends.resolve(op, implementation, dtype=dtype, m=m, n=n, k=k,
                                      epilogue=epilogue is not None, config=config,
                                      batch=batch)
    if 0 in (m, n, k):
        implementation = backends.for_empty(op)
    if not split_k and isinstance(config, MatmulConfig) and config.split_k != 1:
        raise ValueError(f"{op}: config.split_k={config.split_k} is not supported (the kernel "
                         "runs one program per output tile); use split_k=1.")
    if not implementation.tunable:  # XLA picks its own tiles: a config goes unused
        resolved, tile = None, (m, n)
    else:
        resolved = choose_config(op, implementation, config, m, n, k, dtype, split_k=split_k,
                                 runs=None if runs is None else runs(implementation),
                                 fast_accum=fast_accum, batch=batch)
        tile = (resolved.block_m, resolved.block_n)
    epilogue_tile = epilogue_full = None
    captures: Sequence[Any] = ()
    if epilogue is not None:
        epilogue_tile, epilogue_full, captures = _trace_epilogue(op, epilogue, tile, (m, n))
    options = Options(implementation, resolved, out_dtype, epilogue_tile, epilogue_full,
                      precision, batch)
    return options, tuple(captures)


def matmul(a: jax.Array, b: jax.Array, *, bias: jax.Array | None = None,
           epilogue: Epilogue | None = None, out_dtype=None,
           config: Config | str | None = None,
           implementation: str | None = None, precision: str | None = None) -> jax.Array:
    """epilogue(a @ b + bias), accumulated in float32, in one kernel.

    Args:
      a: [..., M, K] bfloat16, float16 or float32; leading dims are flattened into M.
      b: [K, N], same dtype as `a`.
      bias: optional [N], any float dtype, added to every row before the epilogue.
      epilogue: optional elementwise function applied to the float32 tile inside the kernel,
        `f(x)` or `f(x, rows, cols)` with int32 global row [.., 1] and column [1, ..] indices
        (e.g. `jax.nn.gelu`; exact-erf gelu does not lower to Triton, the tanh form does). It must
        return an array shaped like x. Arrays it closes over become kernel inputs and receive
        gradients; index them element-wise (`scale[cols]`) — in the kernel each lookup is a
        gather-load, and an array used whole must have a power-of-two size.
      out_dtype: output dtype (default a.dtype).
      config: a MatmulConfig (pallas_triton) or MosaicMatmulConfig (pallas_mosaic_gpu), used
        as given; None (cached tuning result, else heuristic) or "autotune" (time the search
        space on this device once and cache the winner). Backward products pick their own
        configs for their own shapes.
      implementation: "pallas_mosaic_gpu" (Hopper: bf16/fp16, M and N multiples of its tile, K
        of 64, no epilogue), "pallas_triton", "xla" or "interpret"; default
        $JATTN_IMPLEMENTATION, else on Hopper "pallas_mosaic_gpu" where it runs the call and
        was measured faster (from 256 rows and 2**20 outputs), "pallas_triton" on a CUDA GPU,
        "xla" elsewhere (`jattn.explain` says why).
      precision: float32 products, by `jax.default_matmul_precision`'s names: None keeps the
        caller's setting (JAX's default: TF32 on the GPU); "highest" gives full float32 products.

    Returns:
      [..., M, N] of out_dtype. Differentiable in a, b, bias and captured arrays (custom_vjp:
      dA = dZ·Bᵀ and dB = Aᵀ·dZ through the same kernel, dZ from `jax.vjp` of the epilogue).

    Example::

        x = jnp.ones((4, 32, 64), jnp.bfloat16)  # [..., M, K]
        w, b = jnp.ones((64, 128), jnp.bfloat16), jnp.zeros((128,), jnp.float32)  # [K, N], [N]
        y = jattn.matmul(x, w, bias=b, epilogue=lambda t: jax.nn.gelu(t, approximate=True))
        print(y.shape, y.dtype)  # (4, 32, 128) bfloat16
    """
    a, b = (x if isinstance(x, jax.Array) else jnp.asarray(x) for x in (a, b))
    check_operands("matmul", a, b, b_max_ndim=2)
    return _product_of_rows("matmul", a, b, bias, epilogue, out_dtype, config, implementation,
                            precision)


def _product_of_rows(op: str, a, b, bias, epilogue, out_dtype, config, implementation,
                     precision):
    """a [..., M, K] @ b [K, N] as one product of all of a's rows (`op` names the call in
    errors and `explain`)."""
    *lead, k = a.shape
    options, captures = make_options(op, math.prod(lead), b.shape[1], k, a.dtype, bias,
                                     epilogue, out_dtype, config, implementation,
                                     precision=precision)
    return jitted(_matmul_flattened, options)(a, b, bias, captures)


def _matmul_flattened(options: Options, a, b, bias, captures):
    """_matmul of a [..., M, K], its leading dims flattened into M inside the program (eager
    reshapes would each be a dispatch of their own)."""
    *lead, k = a.shape
    m = math.prod(lead)
    return _matmul(options, a.reshape(m, k), b, bias, captures).reshape(*lead, b.shape[1])


def _broadcast_batch(fn, a, b, batch_ndim: int):
    """fn over the leading batch dims of a and b with numpy broadcasting, copying nothing."""
    if batch_ndim == 0:
        return fn(a, b)
    a_mapped, b_mapped = a.shape[0] != 1, b.shape[0] != 1
    inner = functools.partial(_broadcast_batch, fn, batch_ndim=batch_ndim - 1)
    if not (a_mapped or b_mapped):
        return inner(a[0], b[0])[None]
    return jax.vmap(inner, in_axes=(0 if a_mapped else None, 0 if b_mapped else None))(
        a if a_mapped else a[0], b if b_mapped else b[0])


def bmm(a: jax.Array, b: jax.Array, *, bias: jax.Array | None = None,
        epilogue: Epilogue | None = None, out_dtype=None, config: Config | str | None = None,
        implementation: str | None = None, precision: str | None = None) -> jax.Array:
    """Batched `matmul`: a [..., M, K] @ b [..., K, N] -> [..., M, N].

    Leading (batch) dims broadcast as in numpy; an operand with batch size 1 is shared, not
    copied; on Mosaic GPU the whole batch is one launch, and one b shared by every matrix
    (without an epilogue) makes one product of all of a's rows. bias [N], epilogue (indices
    are within each matrix), out_dtype, config, implementation and precision are as in
    `matmul`. a and b: bfloat16, float16 or float32, one dtype. Returns [broadcast batch...,
    M, N] of out_dtype (default a's dtype); differentiable as `matmul`. The gradient of an
    operand shared along a batch dim where the other is not (a [2, 1, M, K] @ b [3, K, N])
    sums per-matrix gradients, each in the operand's dtype, as torch's.

    Example::

        a = jnp.ones((4, 64, 32), jnp.float32)  # [batch, M, K]
        b = jnp.ones((1, 32, 16), jnp.float32)  # [1, K, N]: shared by the batch
        print(jattn.bmm(a, b).shape)  # (4, 64, 16)
    """
    a, b = (x if isinstance(x, jax.Array) else jnp.asarray(x) for x in (a, b))
    check_operands("bmm", a, b, b_max_ndim=None)
    try:
        batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])  # (jax.export: symbolic dims)
    except ValueError:
        raise ValueError(f"bmm: batch dims of a {a.shape} and b {b.shape} do not broadcast.")
    (m, k), n = a.shape[-2:], b.shape[-1]
    if epilogue is None and math.prod(b.shape[:-2]) == 1:
        # One b for every matrix: one product of all of a's rows (b's gradient accumulated
        # over them in float32, not summed from per-matrix gradients rounded to its dtype).
        out = _product_of_rows("bmm", a, b if b.ndim == 2 else b.reshape(k, n), bias, None,
                               out_dtype, config, implementation, precision)
        return out if out.shape == (*batch, m, n) else out.reshape(*batch, m, n)
    options, captures = make_options("bmm", m, n, k, a.dtype, bias, epilogue, out_dtype,
                                     config, implementation, precision=precision,
                                     batch=math.prod(batch))
    a = a.reshape((1,) * (len(batch) + 2 - a.ndim) + a.shape)
    b = b.reshape((1,) * (len(batch) + 2 - b.ndim) + b.shape)
    program = jitted(_matmul, options)
    product = lambda x, y: program(x, y, bias, captures)
    return _broadcast_batch(product, a, b, len(batch))

"""jattn's GEMMs as torch custom ops: jattn::matmul, bmm, mm_plus_mm, b2b_matmul, scaled_matmul
and mixed_matmul, each with a jattn::<name>_backward op running `jax.vjp` of the same jattn
function (so torch gradients equal JAX's bit for bit), a fake for torch.compile and, for eager
mode, an autograd.Function twin (`run_op`). On CUDA a forward that is one kernel compiled by the
`triton` package is launched on torch's stream without JAX (`_direct`).

Every op is described once (`GemmOp`: the jattn function, its tensor arguments, its static
options, the tensors it is differentiable in, its output's fake) and registered by one function.
An op's arguments are its tensors, then its options, then `implementation`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, Optional

import jax
import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

import jattn
from ._direct import DirectProgram
from ._dlpack import DTYPES, run, to_torch
from ._ops import float32_precision, implementation_for, needs_autograd, ready_views
from jattn._src import bridge

# Outside torch.compile each op runs as an autograd.Function with the same implementation and
# gradient formula (the custom-op dispatcher costs ~75 us per call on top, measured on the
# H100), or as that implementation alone when nothing needs a gradient: op -> (autograd
# twin, implementation).
_EAGER: dict[str, tuple[Callable[..., Tensor], Callable[..., Tensor]]] = {}


def run_op(op: str, *args):
    """jattn::<op>(*args): a custom-op node under torch.compile, else its eager twin, or its
    implementation when autograd has nothing to record."""
    if torch.compiler.is_compiling():
        return getattr(torch.ops.jattn, op)(*args)
    with_autograd, forward = _EAGER[op]
    return with_autograd(*args) if needs_autograd(args) else forward(*args)


@dataclasses.dataclass(frozen=True)
class GemmOp:
    """One jattn GEMM function as jattn::<name> (tensors, options, implementation) -> Tensor.

    tensors, options: schema entries ("Tensor a", "Tensor? bias"; "str side"), passed to `fn` by
    keyword under their names, with `implementation`; a torch.dtype option reaches `fn` as the
    JAX dtype. grads: the tensors autograd gets gradients for (from `jax.vjp` of `fn`).
    no_gradient: for a forward-only op, the error its backward raises (when backward runs, also
    in compiled code: the backward op's fake lets torch.compile trace a forward whose inputs
    require grad). facts(*tensors): what the op's implementations judge support by, as jattn's
    own call passes them (the implementation is chosen here, then named to `fn`).
    """

    name: str
    fn: Callable[..., jax.Array]
    tensors: tuple[str, ...]
    fake: Callable[..., Tensor]
    options: tuple[str, ...] = ()
    grads: tuple[str, ...] = ()
    no_gradient: Optional[str] = None
    facts: Callable[..., dict] = lambda *tensors: {}

    def __post_init__(self):
        if self.grads != tuple(name for name in self.tensor_names if name in self.grads):
            raise ValueError(f"GemmOp {self.name}: grads {self.grads} must be tensor names, in "
                             f"the order of {self.tensor_names} (backward's list follows it).")

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(entry.split()[-1] for entry in self.tensors)

    @property
    def option_names(self) -> tuple[str, ...]:
        return tuple(entry.split()[-1] for entry in self.options)

    def schema(self, first: tuple[str, ...] = (), returns: str = "Tensor") -> str:
        arguments = ", ".join((*first, *self.tensors, *self.options, "str? implementation"))
        return f"({arguments}) -> {returns}"


def _jax_option(op: str, name: str, value: Any) -> Any:
    """A torch.dtype option as the JAX dtype (jattn then checks it); other values unchanged."""
    if not isinstance(value, torch.dtype):
        return value
    if value not in DTYPES:
        raise TypeError(f"{op}: `{name}`={value} is not supported (no JAX dtype for it here); "
                        f"pass one of the dtypes jattn.torch.{op} documents.")
    return DTYPES[value]


def register(spec: GemmOp):
    """Registers jattn::<name> and jattn::<name>_backward (fakes, autograd) and the eager twin
    that `run_op` calls; returns the two ops."""
    names, n, option_names = spec.tensor_names, len(spec.tensors), spec.option_names
    grad_set = set(spec.grads)
    dtype_options = any(entry.startswith("ScalarType") for entry in spec.options)
    # float32 products as torch's flags say, for the ops that multiply float32 operands
    takes_precision = "precision" in inspect.signature(spec.fn).parameters

    def keywords(arrays, options, implementation, precision) -> dict:  # at trace time only
        return {**dict(zip(names, arrays)), **dict(zip(option_names, options)),
                "implementation": implementation,
                **({"precision": precision} if takes_precision else {})}

    @functools.lru_cache(maxsize=64)
    def forward_program(options, implementation, precision) -> Callable[..., jax.Array]:
        """The jitted forward for one set of options: bound, as dispatching static arguments
        on every call costs more."""
        return jax.jit(lambda *arrays: spec.fn(**keywords(arrays, options, implementation,
                                                          precision)))

    @functools.partial(jax.jit, static_argnames=("options", "implementation", "precision"))
    def vjp_jit(grad, *arrays, options, implementation, precision):
        fixed = keywords(arrays, options, implementation, precision)

        def differentiable(*xs):
            return spec.fn(**{**fixed, **dict(zip(spec.grads, xs))})
        return jax.vjp(differentiable, *(fixed[name] for name in spec.grads))[1](grad)

    def static(args, device) -> tuple:
        """(options, implementation, precision) of a call on tensors on `device`, as the
        programs take them; precision follows torch's TF32 flag for float32 operands."""
        options = args[n:-1]
        if dtype_options:
            options = tuple(_jax_option(spec.name, k, v) for k, v in zip(option_names, options))
        precision = float32_precision(args[0].dtype) if takes_precision else None
        facts = spec.facts(*args[:n]) if device.type == "cuda" else {}  # (CPU: xla decides)
        return options, implementation_for(spec.name, device, args[-1], **facts), precision

    @functools.lru_cache(maxsize=64)
    def direct_program(options, implementation, precision,
                       present: tuple[bool, ...]) -> DirectProgram:
        """The forward as a DirectProgram on the tensors that are not None (present: which
        of the op's tensor arguments are)."""
        def pack(tensors):
            given = iter(tensors)
            return tuple(next(given) if p else None for p in present)
        return DirectProgram(forward_program(options, implementation, precision), pack)

    def run_forward(*args) -> Tensor:
        tensors, options = args[:n], None
        first = tensors[0]
        if isinstance(first, Tensor) and first.is_cuda:
            options = static(args, first.device)  # the device ready_views finds, or it raises
            if bridge.launches_directly(options[1]):  # one kernel: launched without JAX
                program = direct_program(*options, tuple(t is not None for t in tensors))
                result = program([t for t in tensors if t is not None])
                if result is not None:
                    return result[0]
        device, arrays = ready_views(spec.name, tensors, names)
        program = forward_program(*(options or static(args, device)))
        return to_torch(run(program, device, *arrays), device)

    def run_backward(grad, *args) -> list[Tensor]:
        """[a gradient for each tensor of spec.grads that is not None]"""
        if spec.no_gradient is not None:
            raise NotImplementedError(spec.no_gradient)
        device, arrays = ready_views(spec.name, (grad, *args[:n]), ("grad", *names))
        options, implementation, precision = static(args, device)
        grads = run(functools.partial(vjp_jit, options=options, implementation=implementation,
                                      precision=precision), device, *arrays)
        return [to_torch(g, device) for g in grads if g is not None]

    def backward_fake(grad, *args):  # (contiguous, as run_backward's come back from JAX)
        return [t.new_empty(t.shape) for name, t in zip(names, args[:n])
                if name in grad_set and t is not None]

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:n])
        ctx.options = inputs[n:]

    def input_grads(tensors, grads) -> tuple:
        """run_backward's list spread over the op's arguments (None where no gradient)."""
        grads = iter(grads)
        return (*(next(grads) if name in grad_set and t is not None else None
                  for name, t in zip(names, tensors)), *[None] * (len(spec.options) + 1))

    op = torch.library.custom_op(f"jattn::{spec.name}", run_forward, mutates_args=(),
                                 schema=spec.schema())
    backward_op = torch.library.custom_op(f"jattn::{spec.name}_backward", run_backward,
                                          mutates_args=(),
                                          schema=spec.schema(("Tensor grad",), "Tensor[]"))

    def backward(ctx, grad):
        tensors = ctx.saved_tensors
        return input_grads(tensors, backward_op(grad, *tensors, *ctx.options))

    op.register_fake(spec.fake)
    backward_op.register_fake(backward_fake)
    op.register_autograd(backward, setup_context=setup_context)

    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            output = run_forward(*args)
            setup_context(ctx, args, output)
            return output

        @staticmethod
        @once_differentiable  # (no double backward: differentiating the gradients raises)
        def backward(ctx, grad):
            tensors = ctx.saved_tensors
            return input_grads(tensors, run_backward(grad, *tensors, *ctx.options))

    _EAGER[spec.name] = Eager.apply, run_forward
    for cache in (forward_program, direct_program):
        bridge.register_cache(f"torch.{spec.name}.{cache.__name__}", cache.cache_clear)
    return op, backward_op


# ------------------------------------------------------------------------------------------------
# The ops
# ------------------------------------------------------------------------------------------------


def _facts(dtype: torch.dtype, m: int, n: int, k: int, batch: int = 1) -> dict:
    """`batch` [M, K] times [K, N] products of `dtype` in one call, and their work (2·M·N·K
    each) where pallas_triton's kernel would be launched without JAX."""
    return dict(dtype=DTYPES.get(dtype), m=m, n=n, k=k, batch=batch,
                **bridge.torch_eager_facts(2 * batch * m * n * k))


def _product_facts(a, b, *rest) -> dict:
    """A matmul's facts: a [..., M, K] times b [K, N] (none for other ranks, which jattn's own
    checks then reject by name)."""
    if a.dim() < 2 or b.dim() < 2:
        return {}
    return _facts(a.dtype, math.prod(a.shape[:-1]), b.shape[-1], a.shape[-1])


def _bmm_facts(a, b, *rest) -> dict:
    """A bmm's facts: each of its [M, K] times [K, N] products, and the batch's size."""
    if a.dim() < 2 or b.dim() < 2:
        return {}
    (m, k), n = a.shape[-2:], b.shape[-1]
    return _facts(a.dtype, m, n, k, math.prod(torch.broadcast_shapes(a.shape[:-2],
                                                                     b.shape[:-2])))


def _matmul_fake(a, b, *rest):  # matmul and mm_plus_mm: a [..., M, K] times b [K, N]
    return a.new_empty((*a.shape[:-1], b.shape[-1]))


def _bmm_fake(a, b, *rest):
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return a.new_empty((*batch, a.shape[-2], b.shape[-1]))


def _b2b_fake(a, b, c, *rest):
    return a.new_empty((*a.shape[:-1], c.shape[-1]))


def _scaled_matmul_fake(a, b, scale_a, scale_b, bias, out_dtype, *rest):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _mixed_matmul_fake(a, qweight, scales, *rest):
    """qweight is [N, K] or [N, K/2], output channels first (jattn.quantize_weight)."""
    return a.new_empty((*a.shape[:-1], qweight.shape[0]))


_BIAS = ("Tensor? bias",)
_SCALED_MATMUL_NO_GRADIENT = (
    "scaled_matmul is a forward (inference) op and has no gradient (as jattn.scaled_matmul). "
    "To train through an fp8 product, differentiate jattn.torch.matmul on the dequantised "
    "operands instead, e.g. jt.matmul(a.to(torch.bfloat16) * scale_a.reshape(-1, 1), "
    "b.to(torch.bfloat16) * scale_b.reshape(1, -1)).")

matmul, matmul_backward = register(GemmOp(
    "matmul", jattn.matmul, ("Tensor a", "Tensor b", *_BIAS), _matmul_fake,
    grads=("a", "b", "bias"), facts=_product_facts))
bmm, bmm_backward = register(GemmOp(
    "bmm", jattn.bmm, ("Tensor a", "Tensor b", *_BIAS), _bmm_fake, grads=("a", "b", "bias"),
    facts=_bmm_facts))
mm_plus_mm, mm_plus_mm_backward = register(GemmOp(
    "mm_plus_mm", jattn.mm_plus_mm, ("Tensor a", "Tensor b", "Tensor c", "Tensor d", *_BIAS),
    _matmul_fake, grads=("a", "b", "c", "d", "bias")))
b2b_matmul, b2b_matmul_backward = register(GemmOp(
    "b2b_matmul", jattn.b2b_matmul, ("Tensor a", "Tensor b", "Tensor c"), _b2b_fake,
    options=("str side",), grads=("a", "b", "c")))
scaled_matmul, scaled_matmul_backward = register(GemmOp(
    "scaled_matmul", jattn.scaled_matmul,
    ("Tensor a", "Tensor b", "Tensor scale_a", "Tensor scale_b", *_BIAS), _scaled_matmul_fake,
    options=("ScalarType out_dtype", "bool use_fast_accum"),
    grads=("a", "b", "scale_a", "scale_b", "bias"), no_gradient=_SCALED_MATMUL_NO_GRADIENT,
    facts=_product_facts))
mixed_matmul, mixed_matmul_backward = register(GemmOp(
    "mixed_matmul", jattn.mixed_matmul, ("Tensor a", "Tensor qweight", "Tensor scales"),
    _mixed_matmul_fake, options=("int bits", "int? group_size"), grads=("a", "scales")))


@functools.partial(jax.jit, static_argnames=("bits", "group_size"))
def _quantize(w, *, bits, group_size):
    return jattn.quantize_weight(w, bits, group_size)


def quantize_weight(w: Tensor, bits: int, group_size: Optional[int]) -> tuple[Tensor, Tensor]:
    """jattn.quantize_weight on a torch weight: (qweight, scales) on w's device."""
    device, (array,) = ready_views("quantize_weight", (w,), ("w",))  # after torch's writes
    qweight, scales = _quantize(array, bits=bits, group_size=group_size)
    return to_torch(qweight, device), to_torch(scales, device)

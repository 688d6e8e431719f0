"""Every private or version-dependent JAX and torch API jattn uses, in one place.

jattn supports jax >= 0.10.2, < 0.13 and torch >= 2.11 (pyproject.toml). What moves between
those versions, or is not public API at all, is reached through the functions here, so that a
new release is fixed in one module, whose tests (tests/test_compat.py) say which of them the
installed versions take. torch is imported only by the functions that name it (the torch
bridge calls them); jattn itself never imports torch.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Sequence
from typing import Any

import jax

# ------------------------------------------------------------------------------------------------
# Python: the environment
# ------------------------------------------------------------------------------------------------

# CPython's os.environ keeps its variables in `_data` (bytes names on POSIX), which its own
# reads and writes go through; os.environ.get of an unset name raises and catches a KeyError
# inside (~2 us, on every eager call's path).
_ENVIRON_DATA = getattr(os.environ, "_data", None)
_ENVIRON_BYTES = os.name == "posix" and isinstance(_ENVIRON_DATA, dict)


def environment_variable(name: str) -> str | None:
    """os.environ.get(name), cheaper where the variable is unset."""
    if _ENVIRON_BYTES:
        value = _ENVIRON_DATA.get(os.fsencode(name))
        return None if value is None else os.fsdecode(value)
    return os.environ.get(name)


# ------------------------------------------------------------------------------------------------
# JAX: jaxprs
# ------------------------------------------------------------------------------------------------


def jaxpr_and_consts(closed: Any) -> tuple[Any, Sequence[Any]]:
    """(jaxpr, consts) of a traced function (or of an open jaxpr: no consts). jax 0.11 merged
    ClosedJaxpr into Jaxpr; 0.10 keeps the consts beside `.jaxpr`."""
    return getattr(closed, "jaxpr", closed), getattr(closed, "consts", ())


def with_consts(closed: Any, consts: Sequence[Any]) -> Any:
    """The traced function with other constants (values of the same types, or stand-ins that
    an evaluation with a rewrite reads). jax 0.11 has `with_consts`; 0.10 `replace`."""
    if hasattr(closed, "with_consts"):
        return closed.with_consts(list(consts))
    return closed.replace(consts=list(consts))


def bind_equation(primitive, operands: Sequence[Any], params: dict[str, Any]) -> Any:
    """primitive.bind for an equation's params: `get_bind_params` turns them into bind's
    (a tuple (subfunctions, params) in older jax, the params alone in newer)."""
    bind_params, subfunctions = primitive.get_bind_params(params), ()
    if isinstance(bind_params, tuple):
        subfunctions, bind_params = bind_params
    return primitive.bind(*subfunctions, *operands, **bind_params)


# ------------------------------------------------------------------------------------------------
# JAX: mesh axes (shard_map's varying-axes types)
# ------------------------------------------------------------------------------------------------


def varying_axes_of(aval: Any) -> frozenset:
    """The mesh axes an abstract value varies over: jax 0.10's `manual_axis_type.varying`,
    later versions' `vma`."""
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))


def without_varying_axes(aval: Any) -> Any:
    """The abstract value typed as varying over no mesh axis."""
    update = getattr(aval, "update_manual_axis_type", None)
    if update is not None:
        from jax._src import core

        return update(core.empty_mat)
    return aval.update(vma=frozenset())


# The ShapeDtypeStruct keyword that types a value's varying axes (None: this jax has none).
VARYING_STRUCT_FIELD = next(
    (name for name in ("manual_axis_type", "vma")
     if name in inspect.signature(jax.ShapeDtypeStruct).parameters), None)


# ------------------------------------------------------------------------------------------------
# JAX: private modules
# ------------------------------------------------------------------------------------------------


def backends_started() -> bool:
    """Whether JAX has created its backends (after which XLA_PYTHON_CLIENT_* settings no longer
    take effect)."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def mosaic_gpu_interpreted() -> bool:
    """Whether Mosaic GPU kernels traced now run in JAX's GPU interpreter
    (`force_gpu_interpret_mode`, which the CPU tests of those kernels use)."""
    from jax._src import config

    manager = getattr(config, "pallas_tpu_interpret_mode_context_manager", None)
    return manager is not None and manager.value is not None


def dlpack_capsule_functions():
    """(import, export): jaxlib's DLPack capsule calls that `jax.dlpack.from_dlpack` and
    `__dlpack__` wrap, without their per-tensor host synchronisation; (None, None) where this
    jaxlib lays them out otherwise (the public path is then used)."""
    try:
        from jax._src.lib import _jax as jaxlib
        return jaxlib.dlpack_managed_tensor_to_buffer, jaxlib.buffer_to_dlpack_managed_tensor
    except (ImportError, AttributeError):  # pragma: no cover - other jaxlib layouts
        return None, None


def pallas_triton_internals():
    """The private modules the `triton`-package compile path of Pallas-Triton kernels hooks
    into, as a namespace (pallas_core, lowering, pallas_call_registration, gpu_triton, mlir,
    ir); None where one is missing (jaxlib built without Triton support)."""
    import types
    try:
        from jax._src.interpreters import mlir
        from jax._src.lib import gpu_triton
        from jax._src.lib.mlir import ir
        from jax._src.pallas import core as pallas_core
        from jax._src.pallas.triton import lowering
        from jax._src.pallas.triton import pallas_call_registration
    except ImportError:
        return None
    return types.SimpleNamespace(pallas_core=pallas_core, lowering=lowering,
                                 pallas_call_registration=pallas_call_registration,
                                 gpu_triton=gpu_triton, mlir=mlir, ir=ir)


# ------------------------------------------------------------------------------------------------
# JAX: jax.custom_derivatives.linear_call under vmap and second derivatives
# ------------------------------------------------------------------------------------------------

def linear_call_with_batching(fun, fun_transpose, residual_args, linear_args):
    """jax.custom_derivatives.linear_call, also under vmap and differentiated in its residual
    arguments. JAX has no batching rule for it: the one registered here batches the function
    and its transpose alike, every linear argument and output at axis 0, so that the batched
    call stays transposable. And JAX's JVP rule asserts that the residuals have no tangent:
    where they have one (a second derivative through a transposed call), the rule registered
    here differentiates the function as it is (its transpose then JAX's)."""
    from jax._src.custom_derivatives import linear_call_p
    from jax._src.interpreters import ad, batching

    if linear_call_p not in batching.fancy_primitive_batchers:
        batching.fancy_primitive_batchers[linear_call_p] = _batched_linear_call
        ad.primitive_jvps[linear_call_p] = functools.partial(
            _linear_call_jvp, ad.primitive_jvps[linear_call_p])
    return jax.custom_derivatives.linear_call(fun, fun_transpose, residual_args, linear_args)


def _linear_call_jvp(jax_rule, primals, tangents, *, callee, num_callee_consts, num_res,
                     **params):
    from jax._src import core
    from jax._src.interpreters import ad

    if all(type(t) is ad.Zero for t in tangents[:num_callee_consts + num_res]):
        return jax_rule(primals, tangents, callee=callee, num_callee_consts=num_callee_consts,
                        num_res=num_res, **params)
    return jax.jvp(core.jaxpr_as_fun(callee), list(primals),
                   [ad.instantiate_zeros(t) for t in tangents])


def _batched_linear_call(axis_data, args, dims, *, callee, transpose_thunk, num_callee_consts,
                         num_res):
    from jax._src.custom_derivatives import linear_call_p
    from jax._src.interpreters import batching
    from jax._src.interpreters import partial_eval as pe

    args = [batching.moveaxis(x, d, 0) if d not in (None, 0) else x
            for x, d in zip(args, dims)]
    n_fixed = num_callee_consts + num_res
    fixed_batched = [d is not None for d in dims[:n_fixed]]
    linear = [x if d is not None else batching.broadcast(
        x, axis_data.size, 0, axis_data.explicit_mesh_axis)
        for x, d in zip(args[n_fixed:], dims[n_fixed:])]
    batched, _ = batching.batch_jaxpr(callee, axis_data,
                                      fixed_batched + [True] * len(linear), True)
    callee_consts = batched.consts
    batched_callee = pe.close_jaxpr(pe.convert_constvars_jaxpr(batched.jaxpr))
    res_batched = fixed_batched[num_callee_consts:]

    @pe._memoize
    def batched_transpose():
        transpose, t_consts = transpose_thunk()
        done, _ = batching.batch_jaxpr(
            transpose, axis_data,
            [False] * len(t_consts) + res_batched + [True] * len(callee.out_avals), True)
        return (pe.close_jaxpr(pe.convert_constvars_jaxpr(done.jaxpr)),
                [*done.consts, *t_consts])

    outs = linear_call_p.bind(*callee_consts, *args[:n_fixed], *linear, callee=batched_callee,
                              transpose_thunk=batched_transpose,
                              num_callee_consts=len(callee_consts) + num_callee_consts,
                              num_res=num_res)
    return outs, [0] * len(outs)


# ------------------------------------------------------------------------------------------------
# torch (for the bridge; imported on first use)
# ------------------------------------------------------------------------------------------------


def torch_cuda_device_and_stream():
    """(current device index, current raw stream of a device index): torch's C++ bindings,
    a fraction of a microsecond against several for torch.cuda's Python wrappers (the ops
    call them on every eager call)."""
    import torch
    try:
        return torch._C._cuda_getDevice, torch._C._cuda_getCurrentRawStream
    except AttributeError:  # a CPU build of torch: no CUDA tensor reaches the callers
        return _torch_without_cuda, _torch_without_cuda


def _torch_without_cuda(*args):
    raise RuntimeError("This torch was built without CUDA.")


def torch_from_dlpack_capsule():
    """torch's import of a DLPack capsule, the core of torch.from_dlpack without its
    protocol checks."""
    import torch
    return torch._C._from_dlpack


def torch_assume_constant_result(fn):
    """fn, run at torch.compile trace time and its result taken as a constant (Dynamo guards
    on its arguments)."""
    import torch._dynamo
    return torch._dynamo.assume_constant_result(fn)


def torch_tracing_context():
    """torch.compile's tracing context, None outside a compile (its fake mode tells fake
    tensors apart from real ones)."""
    import torch._guards
    return torch._guards.TracingContext.try_get()


def torch_getitem_to_index():
    """The mode under which torch's own flex_attention traces mods (`tensor[index]` as
    torch.ops.aten.index), so that a translated mod reads tensors as torch's would."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    return TransformGetItemToIndex


def torch_read_closures_while_tracing() -> bool:
    """Lets Dynamo read `fn.__closure__[i].cell_contents` of a function made inside the
    compiled region, as Python does (torch 2.13's Dynamo raises AttributeError there; it reads
    the closure of a function made outside): a mod that closes over a local tensor hands
    Dynamo its tensors that way. Installed once, on Dynamo's classes; False where this torch
    lays them out otherwise (such mods then fail to trace)."""
    try:
        from torch._dynamo.side_effects import SideEffects
        from torch._dynamo.variables import functions, misc
        from torch._dynamo.variables.constant import ConstantVariable
        nested, cell = functions.NestedUserFunctionVariable, misc.CellVariable
    except (ImportError, AttributeError):  # pragma: no cover - other torch layouts
        return False
    if getattr(nested.var_getattr, "_jattn_reads_closures", False):
        return True
    if ("closure" not in inspect.signature(nested.__init__).parameters
            or not hasattr(SideEffects, "load_cell")):
        return False  # pragma: no cover - other torch layouts
    nested_getattr, cell_getattr = nested.var_getattr, cell.var_getattr

    def function_getattr(self, tx, name):
        if name == "__closure__":
            return ConstantVariable.create(None) if self.closure is None else self.closure
        return nested_getattr(self, tx, name)

    def cell_contents_getattr(self, tx, name):
        if name == "cell_contents":  # a cell's current contents, its writes in the trace seen
            return tx.output.side_effects.load_cell(self)
        return cell_getattr(self, tx, name)

    function_getattr._jattn_reads_closures = True
    nested.var_getattr, cell.var_getattr = function_getattr, cell_contents_getattr
    return True


def torch_guard_scalar():
    """guard_scalar(x): a Python scalar as itself, a symbolic one (an unspecialised float
    argument of a compiled function) as its value, Dynamo guarding on it."""
    from torch.fx.experimental.symbolic_shapes import guard_scalar
    return guard_scalar


def torch_made_while_tracing(fn) -> bool:
    """Under torch.compile, whether Dynamo made the function `fn` in the trace (its closure may
    hold values of the trace, so it is no constant): torch 2.13's Dynamo does not read the
    globals of such a function. Outside torch.compile: False."""
    try:
        fn.__globals__  # noqa: B018  (the read is the test; the value stays unrealised)
    except AttributeError:
        return True
    return False

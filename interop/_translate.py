"""Torch-written score_mod / mask_mod -> JAX functions.

The mod is traced once with `make_fx` on small index tensors (b, h [1, 1], q_idx [2, 1],
kv_idx [1, 2], score [2, 2]) to a graph of aten ops; each op maps to its jnp counterpart, so the
JAX function works at any broadcastable shape (the kernels' tiles). Tensors the mod closes over
(bias tables, slopes, document ids) become inputs of the translated function, so they can be
handed to the kernels as captured arrays and receive gradients.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import torch
from torch.fx.experimental.proxy_tensor import make_fx

aten = torch.ops.aten

_DTYPES = {torch.float32: jnp.float32, torch.float16: jnp.float16, torch.bfloat16: jnp.bfloat16,
           torch.float64: jnp.float32, torch.int32: jnp.int32, torch.int64: jnp.int32,
           torch.bool: jnp.bool_}


def _div_mode(a, b, rounding_mode=None):
    if rounding_mode == "floor":
        return jnp.floor_divide(a, b)
    if rounding_mode == "trunc":
        return jnp.trunc(jnp.true_divide(a, b)).astype(jnp.result_type(a, b))
    return jnp.true_divide(a, b)


def _clamp(x, min=None, max=None):  # noqa: A002  (aten's argument names)
    if min is not None:
        x = jnp.maximum(x, min)
    return x if max is None else jnp.minimum(x, max)


def _index(x, indices):
    return x[tuple(slice(None) if i is None else i for i in indices)]


def _scalar_tensor(value, dtype=None, **_):
    return jnp.asarray(value, _DTYPES.get(dtype, jnp.float32))


def _to_copy(x, dtype=None, **_):
    return x if dtype is None else x.astype(_DTYPES[dtype])


def _identity(x, *_, **__):
    return x


# aten op -> jnp function, for the ops a mod is made of.
_OPS: dict = {
    aten.add.Tensor: operator.add, aten.add.Scalar: operator.add,
    aten.sub.Tensor: operator.sub, aten.sub.Scalar: operator.sub,
    aten.rsub.Scalar: lambda a, b: b - a,
    aten.mul.Tensor: operator.mul, aten.mul.Scalar: operator.mul,
    aten.div.Tensor: jnp.true_divide, aten.div.Scalar: jnp.true_divide,
    aten.div.Tensor_mode: _div_mode, aten.div.Scalar_mode: _div_mode,
    aten.floor_divide.default: jnp.floor_divide,
    aten.floor_divide.Scalar: jnp.floor_divide,
    aten.remainder.Tensor: jnp.remainder, aten.remainder.Scalar: jnp.remainder,
    aten.neg.default: jnp.negative, aten.abs.default: jnp.abs, aten.sign.default: jnp.sign,
    aten.exp.default: jnp.exp, aten.exp2.default: jnp.exp2, aten.log.default: jnp.log,
    aten.log2.default: jnp.log2, aten.tanh.default: jnp.tanh,
    aten.sigmoid.default: jax.nn.sigmoid, aten.sqrt.default: jnp.sqrt,
    aten.rsqrt.default: jax.lax.rsqrt, aten.sin.default: jnp.sin, aten.cos.default: jnp.cos,
    aten.pow.Tensor_Scalar: jnp.power, aten.pow.Tensor_Tensor: jnp.power,
    aten.minimum.default: jnp.minimum, aten.maximum.default: jnp.maximum,
    aten.clamp.default: _clamp, aten.clamp.Tensor: _clamp,
    aten.clamp_min.default: jnp.maximum, aten.clamp_max.default: jnp.minimum,
    aten.where.self: jnp.where, aten.where.ScalarSelf: jnp.where,
    aten.where.ScalarOther: jnp.where, aten.where.Scalar: jnp.where,
    aten.ge.Tensor: operator.ge, aten.ge.Scalar: operator.ge,
    aten.gt.Tensor: operator.gt, aten.gt.Scalar: operator.gt,
    aten.le.Tensor: operator.le, aten.le.Scalar: operator.le,
    aten.lt.Tensor: operator.lt, aten.lt.Scalar: operator.lt,
    aten.eq.Tensor: operator.eq, aten.eq.Scalar: operator.eq,
    aten.ne.Tensor: operator.ne, aten.ne.Scalar: operator.ne,
    aten.logical_and.default: jnp.logical_and, aten.logical_or.default: jnp.logical_or,
    aten.logical_not.default: jnp.logical_not, aten.logical_xor.default: jnp.logical_xor,
    aten.bitwise_and.Tensor: operator.and_, aten.bitwise_or.Tensor: operator.or_,
    aten.bitwise_xor.Tensor: operator.xor, aten.bitwise_not.default: jnp.invert,
    aten.bitwise_and.Scalar: operator.and_, aten.bitwise_or.Scalar: operator.or_,
    aten.index.Tensor: _index, aten.scalar_tensor.default: _scalar_tensor,
    aten._to_copy.default: _to_copy, aten.clone.default: _identity,
    aten.alias.default: _identity, aten.lift_fresh_copy.default: _identity,
    aten.detach.default: _identity,
}


@dataclasses.dataclass(frozen=True, eq=False)
class TranslatedMod:
    """A torch mod as a JAX function `fn(captures, *args)`; `captures` are the torch tensors it
    closes over, in the order `fn` takes them."""

    fn: Callable
    captures: tuple[torch.Tensor, ...]

    def bind(self, arrays: Sequence[jax.Array]) -> Callable:
        """The JAX mod reading `arrays` (JAX views of `captures`) as its captured arrays."""
        return lambda *args: self.fn(arrays, *args)


def _example_args(mod: Callable, kind: str):
    """Small index tensors (and a score tile) to trace `mod` with, on the device of the first
    tensor it closes over: a mod over CUDA tables cannot mix them with CPU tiles."""
    cells = [cell.cell_contents for cell in getattr(mod, "__closure__", None) or ()]
    device = next((x.device for x in cells if isinstance(x, torch.Tensor)), "cpu")
    index = lambda *shape: torch.zeros(shape, dtype=torch.int32, device=device)  # noqa: E731
    args = (index(1, 1), index(1, 1), index(2, 1), index(1, 2))
    return (torch.zeros(2, 2, device=device), *args) if kind == "score" else args


def translate(mod: Callable, kind: str) -> TranslatedMod:
    """A torch-written mod ('score' or 'mask') as a JAX function. Raises NotImplementedError
    naming any aten op without a translation; other tracing errors propagate."""
    with torch.no_grad():
        graph_module = make_fx(mod)(*_example_args(mod, kind))
    names, captures = [], []
    for node in graph_module.graph.nodes:
        if node.op == "get_attr" and node.target not in names:
            names.append(node.target)
            captures.append(getattr(graph_module, node.target))
        elif node.op == "call_function" and node.target not in _OPS:
            raise NotImplementedError(
                f"{kind}_mod uses {node.target}, which jattn cannot translate to JAX; write the "
                "mod with arithmetic, comparisons, torch.where, exp/log/tanh/abs/sigmoid/"
                "minimum/maximum/clamp, // and %, and indexing of captured tensors.")
    nodes = list(graph_module.graph.nodes)

    def fn(capture_arrays, *args):
        env = {}
        placeholders = iter(args)
        lookup = lambda a: env[a] if isinstance(a, torch.fx.Node) else a  # noqa: E731

        def load(a):
            if isinstance(a, (list, tuple)):
                return type(a)(load(x) for x in a)
            return lookup(a)

        for node in nodes:
            if node.op == "placeholder":
                env[node] = next(placeholders)
            elif node.op == "get_attr":
                env[node] = capture_arrays[names.index(node.target)]
            elif node.op == "call_function":
                env[node] = _OPS[node.target](*load(node.args),
                                              **{k: load(v) for k, v in node.kwargs.items()})
            elif node.op == "output":
                return load(node.args[0])
        raise AssertionError("graph without output")

    return TranslatedMod(fn, tuple(captures))


def is_torch_mod(mod: Callable, kind: str) -> bool:
    """Whether `mod` runs on torch tensors (a JAX mod such as `jattn.mods.softcap` does not)."""
    try:
        with torch.no_grad():
            out = mod(*_example_args(mod, kind))
    except Exception:  # noqa: BLE001  (any failure on torch tensors means "not a torch mod")
        return False
    return isinstance(out, torch.Tensor)  # jnp functions may accept tensors but return arrays

"""interop.torch.mm_plus_mm / b2b_matmul / scaled_matmul / mixed_matmul (+ quantize_weight):
bitwise equal to jattn (outputs and autograd gradients), opcheck, torch.compile(fullgraph=True),
scaled_matmul's missing gradient, bad input.

Quantised weights come from quantize_weight and their shapes are read from it: the qweight
layout is jattn's."""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn

torch = pytest.importorskip("torch")
import interop.torch as jt  # noqa: E402


@dataclasses.dataclass
class Case:
    """One call of jattn::<op>: its tensors and options (schema order), the tensors it is
    differentiable in. The same names are the keywords of interop.torch.<op> and jattn.<op>."""

    op: str
    tensors: dict[str, Any]
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    grads: tuple[str, ...] = ()

    def ours(self, implementation, **tensors):
        return getattr(jt, self.op)(**tensors, **self.options, implementation=implementation)

    def theirs(self, implementation, **arrays):
        options = {k: jnp.dtype(str(v).removeprefix("torch.")) if isinstance(v, torch.dtype)
                   else v for k, v in self.options.items()}
        return getattr(jattn, self.op)(**arrays, **options, implementation=implementation)

    def op_args(self, implementation):
        return (*self.tensors.values(), *self.options.values(), implementation)


def _random(shapes, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
            for name, shape in shapes.items()}


def _mm_plus_mm(dtype, device):
    shapes = dict(a=(2, 19, 32), b=(32, 24), c=(2, 19, 48), d=(48, 24), bias=(24,))
    return Case("mm_plus_mm", _random(shapes, dtype, device), grads=("a", "b", "c", "d", "bias"))


def _b2b(side):
    # left: a [.., M, K] b [K, P] c [P, N]; right: a [.., M, P] b [P, K] c [K, N]
    shapes = (dict(a=(2, 19, 32), b=(32, 40), c=(40, 24)) if side == "left"
              else dict(a=(2, 19, 40), b=(40, 32), c=(32, 24)))
    return lambda dtype, device: Case("b2b_matmul", _random(shapes, dtype, device),
                                      dict(side=side), grads=("a", "b", "c"))


def _mixed(bits, group_size):
    def make(dtype, device):
        w = _random(dict(w=(64, 24)), dtype, device, seed=1)["w"]  # [K, N]; scales of w's dtype
        qweight, scales = jt.quantize_weight(w, bits, group_size)
        a = _random(dict(a=(2, 9, 64)), dtype, device)["a"]
        return Case("mixed_matmul", dict(a=a, qweight=qweight, scales=scales),
                    dict(bits=bits, group_size=group_size), grads=("a", "scales"))
    return make


def _scaled(fp8, row_wise, with_bias):
    def make(out_dtype, device):  # forward only
        gen = torch.Generator().manual_seed(0)
        m, k, n = 40, 64, 24
        a, b = (torch.randn(shape, generator=gen).to(device=device, dtype=fp8)
                for shape in ((m, k), (k, n)))
        scale_a, scale_b = (torch.rand(shape, generator=gen).to(device) + 0.5
                            for shape in (((m,), (n,)) if row_wise else ((), ())))
        bias = torch.randn(n, generator=gen).to(device) if with_bias else None
        return Case("scaled_matmul", dict(a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias),
                    dict(out_dtype=out_dtype, use_fast_accum=False))
    return make


CASES = {
    "mm_plus_mm": _mm_plus_mm,
    "b2b_left": _b2b("left"),
    "b2b_right": _b2b("right"),
    "mixed_int8": _mixed(8, None),
    "mixed_int8_group16": _mixed(8, 16),
    "mixed_int4_group32": _mixed(4, 32),
    "mixed_int4": _mixed(4, None),
    "scaled_e4m3_tensorwise": _scaled(torch.float8_e4m3fn, False, True),
    "scaled_e5m2_rowwise": _scaled(torch.float8_e5m2, True, False),
}
# (case, dtype): the inputs' dtype; scaled_matmul's out_dtype.
BITWISE = [("mm_plus_mm", torch.float32), ("mm_plus_mm", torch.bfloat16),
           ("b2b_left", torch.float32), ("b2b_left", torch.bfloat16),
           ("b2b_right", torch.bfloat16), ("mixed_int8", torch.bfloat16),
           ("mixed_int8_group16", torch.float16), ("mixed_int4_group32", torch.bfloat16),
           ("mixed_int4", torch.float16), ("scaled_e4m3_tensorwise", torch.bfloat16),
           ("scaled_e5m2_rowwise", torch.float32)]
BITWISE_IDS = [f"{name}-{str(dtype).removeprefix('torch.')}" for name, dtype in BITWISE]


def _numpy(x):
    return np.asarray(x.detach().float().cpu().numpy() if isinstance(x, torch.Tensor)
                      else x.astype(jnp.float32))


def _check_bitwise(name, dtype, device, implementation):
    case = CASES[name](dtype, device)
    tensors = {k: t.requires_grad_() if k in case.grads else t for k, t in case.tensors.items()}
    out = case.ours(implementation, **tensors)
    arrays = {k: None if t is None else jax.dlpack.from_dlpack(t.detach())
              for k, t in tensors.items()}
    expected = jax.jit(lambda arrays: case.theirs(implementation, **arrays))(arrays)
    assert out.dtype == getattr(torch, str(expected.dtype)) and out.shape == expected.shape
    np.testing.assert_array_equal(_numpy(out), _numpy(expected))
    if not case.grads:
        return
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    out.backward(grad)

    def vjp(arrays, g):
        def fn(*xs):
            return case.theirs(implementation, **{**arrays, **dict(zip(case.grads, xs))})
        return jax.vjp(fn, *(arrays[k] for k in case.grads))[1](g)

    grads = jax.jit(vjp)(arrays, jax.dlpack.from_dlpack(grad))
    for k, g in zip(case.grads, grads):
        np.testing.assert_array_equal(_numpy(tensors[k].grad), _numpy(g), err_msg=f"d{k}")


@pytest.mark.parametrize("name,dtype", BITWISE, ids=BITWISE_IDS)
def test_bitwise_equal_to_jattn(name, dtype):
    _check_bitwise(name, dtype, "cpu", "xla")


@pytest.mark.gpu
@pytest.mark.parametrize("name,dtype", BITWISE, ids=BITWISE_IDS)
def test_bitwise_equal_to_jattn_on_cuda(name, dtype):
    _check_bitwise(name, dtype, "cuda", "pallas_triton")


@pytest.mark.parametrize("bits,group_size", [(8, None), (4, 32)])
def test_quantize_weight_equals_jattn(bits, group_size):
    w = torch.randn(64, 24, dtype=torch.bfloat16)
    ours = jt.quantize_weight(w, bits, group_size)
    theirs = jattn.quantize_weight(jax.dlpack.from_dlpack(w), bits, group_size)
    for x, y in zip(ours, theirs):
        assert x.shape == y.shape and x.dtype == getattr(torch, str(y.dtype))
        np.testing.assert_array_equal(_numpy(x), _numpy(y))


@pytest.mark.parametrize("name", ["mm_plus_mm", "b2b_right", "mixed_int4_group32"])
def test_eager_path_matches_the_registered_op(name):
    """Outside torch.compile the public functions run an autograd.Function twin of
    jattn::<op>: same outputs and gradients, bit for bit."""
    case = CASES[name](torch.bfloat16, "cpu")
    wanted = [case.tensors[k].requires_grad_() for k in case.grads]
    results = []
    for run in (lambda: case.ours("xla", **case.tensors),
                lambda: getattr(torch.ops.jattn, case.op)(*case.op_args("xla"))):
        out = run()
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out)
        results.append((out.detach(), *torch.autograd.grad(out, wanted, grad)))
    for eager, registered in zip(*results):
        assert torch.equal(eager, registered)


@pytest.mark.parametrize("name", ["mm_plus_mm", "b2b_left", "mixed_int8_group16",
                                  "scaled_e4m3_tensorwise"])
def test_opcheck(name):
    case = CASES[name](torch.float32 if name.startswith("scaled") else torch.bfloat16, "cpu")
    op = getattr(torch.ops.jattn, case.op).default
    args = case.op_args(None)
    if not case.grads:
        # test_schema compares inputs before and after with torch.allclose, which has no CPU
        # kernel for fp8 ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn').
        torch.library.opcheck(op, args, test_utils=("test_autograd_registration",
                                                    "test_faketensor",
                                                    "test_aot_dispatch_dynamic"))
        return
    torch.library.opcheck(op, args)
    grad = torch.randn(op(*args).shape).to(torch.bfloat16)
    backward = getattr(torch.ops.jattn, f"{case.op}_backward").default
    torch.library.opcheck(backward, (grad, *args))


def test_compiles_without_graph_breaks():
    """The four ops in one compiled function, forward and backward, as in eager mode."""
    gen = torch.Generator().manual_seed(5)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(shape, generator=gen).to(dtype)

    params = dict(w1=randn(32, 48), w2=randn(16, 48), bias=randn(48), p=randn(48, 40),
                  q=randn(40, 64))
    qweight, scales = jt.quantize_weight(randn(64, 24), 4, 32)
    fa, fb = randn(8, 32).to(torch.float8_e4m3fn), randn(32, 24).to(torch.float8_e4m3fn)
    scale_a, scale_b = torch.tensor(0.5), torch.rand(24, generator=gen) + 0.5

    def model(x, h, params, scales):
        y = torch.relu(jt.mm_plus_mm(x, params["w1"], h, params["w2"], params["bias"]))
        z = jt.b2b_matmul(y, params["p"], params["q"], side="left")
        return (jt.mixed_matmul(z, qweight, scales, bits=4, group_size=32)
                + jt.scaled_matmul(fa, fb, scale_a, scale_b, out_dtype=torch.bfloat16))

    x, h = randn(8, 32), randn(8, 16)
    compiled = torch.compile(model, fullgraph=True)  # raises on a graph break
    results = []
    for fn in (model, compiled):
        leaves = [t.clone().requires_grad_() for t in (x, h, *params.values(), scales)]
        out = fn(*leaves[:2], dict(zip(params, leaves[2:-1])), leaves[-1])
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(6)).to(out)
        results.append((out, *torch.autograd.grad(out, leaves, grad)))
    for eager, compiled_result in zip(*results):
        torch.testing.assert_close(compiled_result, eager)


def test_scaled_matmul_backward_raises():
    """Inputs may require grad (the forward runs, also compiled); backward raises."""
    a = torch.randn(16, 32).to(torch.float8_e4m3fn)
    b = torch.randn(32, 8).to(torch.float8_e4m3fn)
    scale_a = torch.tensor(0.5, requires_grad=True)
    compiled = torch.compile(lambda a, b, s: jt.scaled_matmul(a, b, s, torch.tensor(2.0)) * 2,
                             fullgraph=True)
    for fn in (lambda a, b, s: jt.scaled_matmul(a, b, s, torch.tensor(2.0)) * 2, compiled):
        out = fn(a, b, scale_a)
        assert out.requires_grad
        with pytest.raises(NotImplementedError, match="scaled_matmul .* has no gradient"):
            out.float().sum().backward()


def test_bad_input_raises():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    c, d = torch.randn(8, 12), torch.randn(12, 4)
    meta = torch.randn(12, 4, device="meta")
    one_device = "all tensors must be on one device"
    with pytest.raises(ValueError, match=f"mm_plus_mm: {one_device}.*d on meta"):
        jt.mm_plus_mm(a, b, c, meta)
    with pytest.raises(ValueError, match=f"b2b_matmul: {one_device}"):
        jt.b2b_matmul(a, b, meta.T)
    with pytest.raises(TypeError, match="mm_plus_mm: .* must have the same dtype"):
        jt.mm_plus_mm(a, b, c.to(torch.bfloat16), d)
    with pytest.raises(TypeError, match="b2b_matmul: `a` and `b` must have the same dtype"):
        jt.b2b_matmul(a, b.to(torch.bfloat16), torch.randn(4, 8))
    with pytest.raises(ValueError, match="b2b_matmul: inner dimensions differ"):
        jt.b2b_matmul(a, b, torch.randn(5, 8))
    with pytest.raises(ValueError, match="`side` must be 'left' or 'right'"):
        jt.b2b_matmul(a, b, torch.randn(4, 8), side="middle")
    with pytest.raises(TypeError, match="float64"):
        jt.mm_plus_mm(a.double(), b, c, d)
    with pytest.raises(ValueError, match="implementation='pallas_triton' cannot run this call.*runs on CUDA tensors needs them moved with .cuda()"):
        jt.mm_plus_mm(a, b, c, d, implementation="pallas_triton")

    fa, fb = (torch.randn(shape).to(torch.float8_e4m3fn) for shape in ((8, 16), (16, 4)))
    one = torch.tensor(1.0)
    with pytest.raises(TypeError, match="same fp8 dtype"):
        jt.scaled_matmul(fa, fb.to(torch.float8_e5m2), one, one)
    with pytest.raises(TypeError, match="float8_e4m3fn or float8_e5m2"):
        jt.scaled_matmul(fa.float(), fb.float(), one, one)
    with pytest.raises(ValueError, match=f"scaled_matmul: {one_device}"):
        jt.scaled_matmul(fa, fb, one, one.to("meta"))
    with pytest.raises(TypeError, match="`out_dtype`=(torch.)?float64 is not supported"):
        jt.scaled_matmul(fa, fb, one, one, out_dtype=torch.float64)
    with pytest.raises(TypeError, match="scaled_matmul: `out_dtype`=int32 is not supported"):
        jt.scaled_matmul(fa, fb, one, one, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="`scale_b` has shape"):
        jt.scaled_matmul(fa, fb, one, torch.ones(3))

    qweight, scales = jt.quantize_weight(torch.randn(16, 4), 8)
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        jt.mixed_matmul(x.float(), qweight, scales, bits=8)
    with pytest.raises(TypeError, match="bits=4 takes `qweight`"):
        jt.mixed_matmul(x, qweight, scales, bits=4)
    with pytest.raises(ValueError, match=f"mixed_matmul: {one_device}"):
        jt.mixed_matmul(x, qweight, scales.to("meta"), bits=8)
    with pytest.raises(ValueError, match="`bits` must be 8 or 4"):
        jt.quantize_weight(torch.randn(16, 4), 3)
    with pytest.raises(TypeError, match="`w` must be a torch.Tensor"):
        jt.quantize_weight(np.ones((16, 4)))

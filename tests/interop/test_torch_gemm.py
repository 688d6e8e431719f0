"""interop.torch.matmul / bmm: bitwise equal to jattn (outputs and autograd gradients), torch's
TF32 flag, opcheck, torch.compile(fullgraph=True), bad input."""

import jax
import numpy as np
import pytest

import jattn

torch = pytest.importorskip("torch")
import interop.torch as jt  # noqa: E402
from interop import _gemm_ops  # noqa: E402

CASES = {
    "matmul": dict(a=(3, 37, 64), b=(64, 48), bias=(48,)),
    "bmm": dict(a=(2, 1, 37, 64), b=(3, 64, 48), bias=(48,)),
}


def _tensors(kind, dtype, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen).to(dtype=dtype, device=device).requires_grad_()
            for shape in CASES[kind].values()]


def _jattn(kind, a, b, bias, implementation):
    fn = jattn.matmul if kind == "matmul" else jattn.bmm
    return fn(a, b, bias=bias, implementation=implementation)


def _check_bitwise(kind, dtype, device, implementation):
    a, b, bias = _tensors(kind, dtype, device)
    out = getattr(jt, kind)(a, b, bias)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    out.backward(grad)

    arrays = [jax.dlpack.from_dlpack(x.detach()) for x in (a, b, bias, grad)]
    ours = jax.jit(lambda a, b, bias: _jattn(kind, a, b, bias, implementation))(*arrays[:3])

    def vjp(a, b, bias, g):
        return jax.vjp(lambda *x: _jattn(kind, *x, implementation), a, b, bias)[1](g)

    grads = jax.jit(vjp)(*arrays)
    np.testing.assert_array_equal(out.detach().float().cpu().numpy(),
                                  np.asarray(ours, np.float32))
    for name, tensor, g in zip("a b bias".split(), (a, b, bias), grads):
        np.testing.assert_array_equal(tensor.grad.float().cpu().numpy(), np.asarray(g, np.float32),
                                      err_msg=f"d{name}")


@pytest.mark.parametrize("kind", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bitwise_equal_to_jattn(kind, dtype):
    _check_bitwise(kind, dtype, "cpu", "xla")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", CASES)
def test_bitwise_equal_to_jattn_on_cuda(kind):
    _check_bitwise(kind, torch.bfloat16, "cuda", "pallas_triton")


@pytest.mark.gpu
def test_float32_follows_torchs_tf32_flag():
    """float32 on CUDA: full float32 products unless torch.backends.cuda.matmul.allow_tf32
    (or torch.set_float32_matmul_precision("high")), as torch.mm."""
    generator = torch.Generator("cuda").manual_seed(0)
    a = torch.randn(256, 512, device="cuda", generator=generator)
    b = torch.randn(512, 128, device="cuda", generator=generator)
    expected = (a.double() @ b.double()).float()
    flag = torch.backends.cuda.matmul.allow_tf32
    try:
        errors = {}
        for allow_tf32 in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = allow_tf32
            errors[allow_tf32] = (jt.matmul(a, b) - expected).abs().max().item()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = flag
    assert errors[False] < 2e-3 < errors[True], errors


@pytest.mark.parametrize("kind", CASES)
def test_opcheck(kind):
    a, b, bias = _tensors(kind, torch.float32)
    op = getattr(torch.ops.jattn, kind).default
    torch.library.opcheck(op, (a, b, bias, None))
    torch.library.opcheck(op, (a, b, None, None))
    grad = torch.randn(op(a, b, bias, None).shape)
    backward = getattr(torch.ops.jattn, f"{kind}_backward").default
    torch.library.opcheck(backward, (grad, a.detach(), b.detach(), bias.detach(), None))


def test_compiles_without_graph_breaks():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(32, 16))
            self.bias = torch.nn.Parameter(torch.randn(16))

        def forward(self, x):
            return torch.relu(jt.matmul(x, self.weight, self.bias)) * 2

    block = Block()
    compiled = torch.compile(block, fullgraph=True)  # raises on a graph break
    x = torch.randn(8, 32, requires_grad=True)
    out = compiled(x)
    torch.testing.assert_close(out, block(x))
    out.sum().backward()
    assert x.grad is not None and block.weight.grad is not None


def test_bad_input_raises():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with pytest.raises(ValueError, match="implementation='pallas_triton' cannot run this call.*runs on CUDA tensors needs them moved with .cuda()"):
        jt.matmul(a, b, implementation="pallas_triton")
    with pytest.raises(TypeError, match="dtype"):
        jt.matmul(a, b.to(torch.bfloat16))
    with pytest.raises(ValueError, match="a \\[8, 16\\] and b \\[12, 4\\]|inner"):
        jt.matmul(a, torch.randn(12, 4))
    with pytest.raises(ValueError, match="`a` must have rank >= 2"):
        jt.matmul(torch.ones(()), b)
    with pytest.raises(ValueError, match="`b`"):
        jt.matmul(a, torch.ones(16))


def _through_jax_only(*args, **kwargs):
    raise AssertionError("this call was expected to launch its kernel without JAX")


@pytest.mark.gpu
@pytest.mark.parametrize("with_bias", [False, True])
def test_direct_launch_gives_jattn_bits(monkeypatch, with_bias):
    """On CUDA a 2-D matmul (one kernel, compiled by `triton`) is launched without JAX (JAX's
    path raises here) and equals jattn.matmul run by JAX bit for bit."""
    a, b, bias = (x.detach() for x in _tensors("matmul", torch.bfloat16, "cuda"))
    a, bias = a[0], bias if with_bias else None
    expected = jax.jit(lambda a, b, bias: jattn.matmul(a, b, bias=bias))(
        *(None if x is None else jax.dlpack.from_dlpack(x) for x in (a, b, bias)))
    with monkeypatch.context() as patched:
        patched.setattr(_gemm_ops, "ready_views", _through_jax_only)
        out = jt.matmul(a, b, bias)
    np.testing.assert_array_equal(out.float().cpu().numpy(), np.asarray(expected, np.float32))


@pytest.mark.gpu
def test_ordered_with_torch_work_on_a_side_stream():
    """Inputs written by torch kernels queued (behind a GPU sleep) on a non-default stream just
    before the op are read after they finish; torch work after the op sees its result."""
    n = 2048
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        a = torch.zeros(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.zeros(n, n, device="cuda", dtype=torch.bfloat16)
        jt.matmul(a, b)  # compiled now, so the call below is not slower than the sleep
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the producers run
        a.fill_(1.0)
        b.fill_(0.5)
        out = jt.matmul(a, b)
        doubled = out * 2  # consumer on the same stream
    torch.cuda.synchronize()
    assert torch.all(out == n * 0.5) and torch.all(doubled == n)


def test_eager_path_matches_the_registered_op():
    """Outside torch.compile jt.matmul runs an autograd.Function twin of jattn::matmul: same
    outputs and gradients, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    a, b, bias = (torch.randn(s, generator=gen, requires_grad=True)
                  for s in ((5, 24, 40), (40, 12), (12,)))
    grad = torch.randn(5, 24, 12, generator=gen)
    results = []
    for run in (lambda: jt.matmul(a, b, bias), lambda: torch.ops.jattn.matmul(a, b, bias, None)):
        out = run()
        results.append((out.detach(), *torch.autograd.grad(out, (a, b, bias), grad)))
    for eager, registered in zip(*results):
        assert torch.equal(eager, registered)


def test_calls_without_a_gradient_skip_autograd(monkeypatch):
    """When nothing needs a gradient (no input requires grad, or grad mode off) the op runs
    without its autograd.Function: the same result, bit for bit, and no graph recorded."""
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(24, 40, generator=gen), torch.randn(40, 12, generator=gen)
    recorded = jt.matmul(a.clone().requires_grad_(), b)
    assert recorded.grad_fn is not None
    _, forward = _gemm_ops._EAGER["matmul"]
    monkeypatch.setitem(_gemm_ops._EAGER, "matmul", (None, forward))  # the Function unused
    with torch.no_grad():
        no_grad = jt.matmul(a.clone().requires_grad_(), b)
    plain = jt.matmul(a, b)
    for out in (no_grad, plain):
        assert out.grad_fn is None and not out.requires_grad
        assert torch.equal(out, recorded.detach())


@pytest.mark.parametrize("op, dtype, shapes, chosen", [
    ("matmul", torch.bfloat16, ((4, 512, 256), (256, 1024)), "pallas_mosaic_gpu"),
    ("matmul", torch.bfloat16, ((1000, 256), (256, 512)), "pallas_triton"),  # ragged M
    ("matmul", torch.bfloat16, ((512, 256), (256, 1024)), "pallas_triton"),  # few outputs
    ("scaled_matmul", torch.float8_e4m3fn, ((2048, 1024), (1024, 2048)), "pallas_mosaic_gpu"),
    ("scaled_matmul", torch.float8_e4m3fn, ((2048, 1000), (1000, 2048)), "pallas_triton"),
    ("bmm", torch.bfloat16, ((8, 1024, 512), (1, 512, 1024)), "pallas_mosaic_gpu"),
    ("bmm", torch.bfloat16, ((64, 512, 128), (64, 128, 512)), "pallas_mosaic_gpu"),
    ("bmm", torch.bfloat16, ((2, 512, 128), (2, 128, 512)), "pallas_triton"),  # few outputs
    ("bmm", torch.bfloat16, ((8, 1000, 512), (512, 1024)), "pallas_triton"),  # ragged M
    ("bmm", torch.float32, ((8, 1024, 512), (8, 512, 1024)), "pallas_triton"),
])
@pytest.mark.parametrize("launches_triton", [False, True])
def test_cuda_ops_choose_as_jattn_does_on_hopper(as_if_on_hopper, monkeypatch, op, dtype,
                                                 shapes, chosen, launches_triton):
    """The torch GEMM ops pass jattn's facts (dtype, M, N, K) to the same default choice; where
    the op would launch pallas_triton's kernel itself (the `triton` package present), that
    kernel stays the choice below 4·10^12 FLOPs of work (host time saved)."""
    from jattn._src import bridge

    monkeypatch.setattr(bridge, "triton_compiler_available", lambda: launches_triton)
    facts = _gemm_ops._bmm_facts if op == "bmm" else _gemm_ops._product_facts
    a, b = (torch.empty(shape, device="meta", dtype=dtype) for shape in shapes)
    expected = "pallas_triton" if launches_triton else chosen
    assert bridge.resolve(op, None, on_cuda=True, **facts(a, b)) == expected
    if dtype == torch.float32:
        return
    large = [torch.empty(shape, device="meta", dtype=dtype) for shape in ((16384, 8192),
                                                                           (8192, 16384))]
    assert bridge.resolve(op, None, on_cuda=True, **facts(*large)) == "pallas_mosaic_gpu"


def test_compiled_backward_takes_transposed_operands():
    """nn.Linear's layout (x @ weight.T): the compiled gradients are the eager ones."""
    x = torch.randn(8, 32, requires_grad=True)
    weight = torch.randn(16, 32, requires_grad=True)

    def loss(x, weight):
        return jt.matmul(x, weight.t()).square().sum()

    eager = torch.autograd.grad(loss(x, weight), (x, weight))
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True)(x, weight), (x, weight))
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want)

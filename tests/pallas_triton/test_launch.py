"""Finding a program's Pallas kernels (CPU: tracing only) and launching them (GPU)."""

import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src.attention.api import flex_attention_backward
from jattn._src.pallas_triton import launch
from jattn._src import hardware

L, D = 256, 64


def _flex_program(*, extra_op: bool = False):
    """The shape of interop's forward program: jit around jattn's custom_vjp, the kv-major
    lists as arguments and zero q-major lists that the forward kernel never reads (every
    block partial: the causal mask_mod applies to all)."""
    mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, L)

    @jax.jit
    def program(q, k, v, kv_num_blocks, kv_indices):
        n_kv = kv_num_blocks.shape[-1]
        block_mask = jattn.BlockMask(
            kv_num_blocks=kv_num_blocks, kv_indices=kv_indices,
            q_num_blocks=jnp.zeros((1, 1, n_kv), jnp.int32),
            q_indices=jnp.zeros((1, 1, n_kv, n_kv), jnp.int32), full_kv_num_blocks=None,
            full_kv_indices=None, full_q_num_blocks=None, full_q_indices=None,
            block_size=mask.block_size, seq_lengths=mask.seq_lengths,
            mask_mod=mask.mask_mod)
        out = jattn.flex_attention(q, k, v, block_mask=block_mask,
                                   implementation="pallas_triton")
        return out * 2 if extra_op else out

    qkv = [jax.ShapeDtypeStruct((1, 2, L, D), jnp.bfloat16)] * 3
    lists = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (mask.kv_num_blocks,
                                                              mask.kv_indices)]
    return program, (*qkv, *lists), (mask.kv_num_blocks, mask.kv_indices)


@pytest.fixture
def pallas_traceable(monkeypatch):
    """Tracing (not running) implementation='pallas_triton' on a machine without a GPU."""
    monkeypatch.setattr(hardware, "has_cuda", lambda: True)


def test_wrappers_inline_to_the_one_kernel_on_the_arguments(pallas_traceable):
    program, args, _ = _flex_program()
    closed = jax.make_jaxpr(program)(*args)
    equations, results = launch._inlined(closed)
    assert [e.primitive.name for e in equations] == ["pallas_call"]  # placeholders dropped
    [call] = equations
    assert call.invars == closed.jaxpr.invars  # q, k, v and the two lists, in order
    assert results == [call.outvars[0]]  # out; the kernel's LSE output is not returned


class _FakeKernel:
    """What KernelLaunch reads of a Triton CompiledKernel; `run` records its launches."""

    def __init__(self):
        self.asm, self.function, self.packed_metadata = {"ttir": ""}, "function", "metadata"
        self.launches = []

    def run(self, *args):
        self.launches.append(args)


@pytest.fixture
def kernels_found(monkeypatch):
    """Every pallas_call counts as compiled by `triton` (found with a fake kernel), as on a
    GPU machine; records the calls' kernel names."""
    names = []

    def found(call):
        names.append(call.params["name"])
        return launch.KernelLaunch(tuple(launch._shape_dtype(v) for v in call.outvars),
                                   _FakeKernel(), (1, 1, 1))

    monkeypatch.setattr(launch, "_kernel_launch", found)
    return names


def test_a_program_with_more_than_its_kernels_needs_the_caller_to_evaluate_the_rest(
        pallas_traceable, kernels_found):
    program, args, _ = _flex_program(extra_op=True)
    equations, _ = launch._inlined(jax.make_jaxpr(program)(*args))
    assert [e.primitive.name for e in equations] == ["pallas_call", "mul"]
    assert launch.kernel_program(program, *args) is None  # by default nothing is evaluable
    found = launch.kernel_program(program, *args, evaluable=lambda name, *_: name == "mul")
    kernel, mul = found.steps
    assert kernel.launch is not None and kernel.inputs == (0, 1, 2, 3, 4)
    assert kernel.outputs == (5, 6)  # out and the LSE
    assert mul.launch is None and mul.name == "mul"
    assert mul.inputs == (5, launch.Constant(2)) and mul.avals == (((1, 2, L, D), jnp.bfloat16),)
    assert found.results == mul.outputs == (7,) and found.slots == 8


def test_the_flex_backward_is_kernels_alone(pallas_traceable, kernels_found):
    """The backward of a causal flex_attention from its saved output and LSE (its BlockMask an
    argument, as in interop's programs) is its kernels on the program's values, with an LSE
    cotangent and without one (then no zeros are made for it)."""
    mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, L)
    mask = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), mask)
    qkv = [jax.ShapeDtypeStruct((1, 2, L, D), jnp.bfloat16)] * 5  # q, k, v, out, d_out
    lse = jax.ShapeDtypeStruct((1, 2, L), jnp.float32)

    def backward(mask, q, k, v, out, lse, d_out, *d_lse):
        return flex_attention_backward(q, k, v, out, lse, d_out, *(d_lse or [None]),
                                       block_mask=mask, implementation="pallas_triton")[:3]

    for d_lse in ([lse], []):
        kernels_found.clear()
        found = launch.kernel_program(backward, mask, *qkv[:4], lse, qkv[4], *d_lse)
        assert [step.launch is not None for step in found.steps] == [True] * 3
        assert kernels_found == ["jattn_flex_bwd_delta", "jattn_flex_bwd_dq",
                                 "jattn_flex_bwd_dkdv"]


def test_a_dense_calls_lists_are_constants_of_its_program(pallas_traceable, kernels_found):
    """Without a BlockMask the forward's lists are made in the program: constants it holds,
    handed to the caller with their values."""
    qkv = [jax.ShapeDtypeStruct((1, 2, L, D), jnp.bfloat16)] * 3
    found = launch.kernel_program(
        jax.jit(functools.partial(jattn.flex_attention, implementation="pallas_triton")), *qkv)
    [step] = found.steps
    assert step.inputs[:3] == (0, 1, 2) and found.results == (step.outputs[0],)
    constants = step.inputs[3:]
    assert constants and all(isinstance(x, launch.ConstantArray) for x in constants)
    assert constants[0].value.dtype == np.int32 and constants[0].value.shape == (1, 1, L // 128)


def test_a_kernel_launches_only_on_the_gpu_it_was_loaded_on():
    kernel = _FakeKernel()
    first, second = (launch.KernelLaunch((((4,), np.float32),), kernel, (2, 1, 1))
                     for _ in range(2))
    assert first([16], [32], 7, device=1)
    assert kernel.launches == [(2, 1, 1, 7, "function", "metadata", None, None, None, 16, 32)]
    assert not first([16], [32], 7, device=0)
    assert not second([16], [32], 7, device=0)  # the same compiled kernel, another launch
    assert second([16], [32], 7, device=1) and len(kernel.launches) == 2
    assert first.alignment == 1  # no tt.divisibility in the IR: no assumption


@pytest.mark.gpu
def test_direct_launch_writes_what_jax_computes():
    """The launch's kernel on JAX-owned buffers (stream 0, after JAX has finished) gives the
    output of the JAX program bit for bit."""
    from jattn._src.pallas_triton.compile import triton_compiler_available
    if not triton_compiler_available():
        pytest.skip("needs the `triton` package")
    program, args, lists = _flex_program()
    found = launch.kernel_program(program, *args)
    [step] = found.steps
    assert step.inputs == (0, 1, 2, 3, 4) and found.results == (step.outputs[0],)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (1, 2, L, D), jnp.bfloat16) for key in keys)
    expected = program(q, k, v, *lists)
    operands = [q, k, v, *lists]
    outputs = [jnp.full(shape, np.nan, dtype) for shape, dtype in step.launch.outputs]
    jax.block_until_ready((expected, operands, outputs))
    assert step.launch([x.unsafe_buffer_pointer() for x in operands],
                       [x.unsafe_buffer_pointer() for x in outputs], 0,
                       jax.devices()[0].local_hardware_id)
    assert ctypes.CDLL("libcuda.so.1").cuStreamSynchronize(None) == 0  # JAX does not know
    np.testing.assert_array_equal(np.asarray(outputs[0], np.float32),
                                  np.asarray(expected, np.float32))


@pytest.mark.gpu
def test_a_kernel_compiled_by_xla_is_not_launched_directly():
    """A GEMM with a user epilogue is compiled by XLA's Triton: only JAX can launch it."""
    a = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)

    def with_gelu(a, b):
        return jattn.matmul(a, b, epilogue=lambda x, rows, cols: jax.nn.gelu(x))

    assert launch.kernel_program(jax.jit(jattn.matmul), a, a) is not None
    assert launch.kernel_program(jax.jit(with_gelu), a, a) is None

"""Tensors cross torch <-> JAX without copies, for every supported dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
from interop import _dlpack  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8, torch.int32,
          torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]


def _pointer(array: jax.Array) -> int:
    return array.unsafe_buffer_pointer()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_copy_both_ways(dtype):
    tensor = (torch.arange(96 * 32) % 7).reshape(96, 32).to(dtype)
    array = _dlpack.to_jax(tensor, "x")
    assert _pointer(array) == tensor.data_ptr()
    assert array.dtype == _dlpack.DTYPES[dtype]
    back = _dlpack.to_torch(array)
    assert back.data_ptr() == tensor.data_ptr() and back.dtype == dtype
    np.testing.assert_array_equal(back.float().numpy(), tensor.float().numpy())


def test_int64_is_zero_copy_with_x64():
    """JAX's default integer is 32-bit: int64 shares memory only with x64 enabled."""
    tensor = torch.arange(64, dtype=torch.int64)
    with jax.enable_x64(True):
        array = _dlpack.to_jax(tensor, "ids")
        assert _pointer(array) == tensor.data_ptr() and array.dtype == np.int64
        assert _dlpack.to_torch(array).data_ptr() == tensor.data_ptr()


def test_non_contiguous_is_copied_once_and_correct():
    tensor = torch.randn(64, 48).t()
    array = _dlpack.to_jax(tensor, "x")
    assert _pointer(array) != tensor.data_ptr()
    np.testing.assert_array_equal(np.asarray(array), tensor.numpy())


def test_views_are_cached_per_tensor_and_see_in_place_updates():
    tensor = torch.zeros(64)
    first = _dlpack.to_jax(tensor, "w")
    assert _dlpack.to_jax(tensor, "w") is first  # the second crossing is free
    total = jax.jit(lambda x: x.sum())
    tensor.add_(1.0)  # e.g. an optimizer step: the cached view shares the memory
    assert float(total(_dlpack.to_jax(tensor, "w"))) == 64.0
    tensor.resize_(32)  # new shape: a new view
    resized = _dlpack.to_jax(tensor, "w")
    assert resized is not first and resized.shape == (32,)
    key = id(tensor)
    del tensor
    assert key not in _dlpack._VIEWS  # the entry dies with its tensor


def test_copies_are_not_cached():
    tensor = torch.randn(8, 6).t()
    copied = _dlpack.to_jax(tensor, "x")
    tensor.mul_(2.0)
    again = _dlpack.to_jax(tensor, "x")
    assert again is not copied
    np.testing.assert_array_equal(np.asarray(again), tensor.numpy())


def test_bad_tensors_raise():
    with pytest.raises(TypeError, match="`q` has dtype torch.float64; supported: bfloat16"):
        _dlpack.to_jax(torch.zeros(4, dtype=torch.float64), "q")
    with pytest.raises(TypeError, match="`k` must be a torch.Tensor, got ndarray"):
        _dlpack.to_jax(np.zeros(4), "k")
    # meta tensors cross as their shapes (ops then evaluate abstractly)
    assert _dlpack.to_jax(torch.zeros(4, device="meta"), "v") == jax.ShapeDtypeStruct(
        (4,), jnp.float32)
    with pytest.raises(ValueError, match="all tensors must be on one device, got a on cpu, "
                                         "b on meta"):
        _dlpack.same_device("matmul", a=torch.zeros(1), b=torch.zeros(1, device="meta"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_copy_on_cuda(dtype):
    tensor = (torch.arange(96 * 32, device="cuda") % 7).reshape(96, 32).to(dtype)
    array = _dlpack.to_jax(tensor, "x")
    assert _pointer(array) == tensor.data_ptr()
    assert _dlpack.to_torch(array).data_ptr() == tensor.data_ptr()


@pytest.mark.gpu
def test_jax_programs_run_on_the_stream_wait_for_torch_reads_once():
    """wait_for_torch queues its wait on the compute stream it read from one program; the
    programs after it (other executables too) must run on that stream."""
    from jax.experimental.buffer_callback import buffer_callback

    seen = []
    record = buffer_callback(lambda ctx, out: seen.append(ctx.stream),
                             jax.ShapeDtypeStruct((), jnp.int8))
    first = jax.jit(record)
    second = jax.jit(lambda x: (x * 2, record()))
    for _ in range(3):
        jax.block_until_ready((first(), second(jnp.ones(8))))
    assert set(seen) == {_dlpack._jax_compute_stream(0)}

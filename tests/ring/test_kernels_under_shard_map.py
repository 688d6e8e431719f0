"""The Pallas kernels under shard_map's type checks, lowered for CUDA (on the CPU too): mods
closing over values that vary over a mesh axis (the ring's device index, a per-device array)
become kernel inputs, and no mesh-axis cast reaches a kernel body."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jattn
from jattn._src import hardware
from tests.helpers import lower_for_cuda

# lower_for_cuda lowers on a CPU inside an abstract mesh of GPUs along axis "x"; shard_map
# then takes that mesh (mesh=None). On a GPU, a mesh of its first device.
SEQ = P(None, None, "x")
GPU_PRESENT = hardware.has_cuda()


@pytest.fixture(autouse=True)
def as_if_on_gpu(monkeypatch):
    """Selects the GPU paths without a GPU (only lowering runs, nothing executes)."""
    monkeypatch.setattr(hardware, "has_cuda", lambda: True)


def _grad_of(attention):
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",)) if GPU_PRESENT else None
    # In replicated, then cast to vary over the axis as sequence shards do (the abstract
    # mesh's explicit axis would need the inputs resharded otherwise).
    def local(q, k, v, table):
        q, k, v = (jax.lax.pcast(x, ("x",), to="varying") for x in (q, k, v))
        return attention(q, k, v, table)

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P(),) * 4, out_specs=SEQ)
    return jax.grad(lambda *x: sharded(*x).astype(jnp.float32).sum(), argnums=(0, 1, 2, 3))


def test_ring_forward_and_backward_lower_for_cuda():
    def attention(q, k, v, table):
        return jattn.ring_flex_attention(
            q, k, v, lambda s, b, h, qi, ki: s + table[h, (qi - ki) % 64],
            jattn.masks.causal_mask, axis_name="x", implementation="pallas_triton")

    q = jnp.ones((1, 2, 256, 64), jnp.bfloat16)
    # Two devices on the CPU: on one, the ring's device index is a constant.
    text = lower_for_cuda(_grad_of(attention), q, q, q, jnp.zeros((2, 64), jnp.float32),
                          devices=2)
    assert "triton" in text.lower()


def test_flex_attention_with_a_mod_reading_the_device_index_lowers_for_cuda():
    def attention(q, k, v, table):
        shift = jax.lax.axis_index("x") * q.shape[2]  # varies over the mesh axis
        return jattn.flex_attention(
            q, k, v, lambda s, b, h, qi, ki: s + table[h, (qi + shift - ki) % 64],
            implementation="pallas_triton")

    q = jnp.ones((1, 2, 256, 64), jnp.bfloat16)
    text = lower_for_cuda(_grad_of(attention), q, q, q, jnp.zeros((2, 64), jnp.float32))
    assert "triton" in text.lower()


# documents of 300, 400 and 324 tokens over two shards of 512: the ring's second step
# attends the second shard's first two query blocks to the first shard's last two key blocks
_PACKED = jattn.create_block_mask(jattn.masks.and_masks(
    jattn.masks.causal_mask,
    jattn.masks.document_mask(jnp.asarray(np.repeat(np.arange(3), [300, 400, 324])))),
    None, None, 1024, 1024)


@pytest.mark.parametrize("devices, strategy, block_mask", [
    (1, "ring", None), (2, "ring", None), (2, "all_gather", None), (2, "heads", None),
    (2, "ring", _PACKED)])
def test_on_hopper_every_strategy_runs_the_mosaic_kernels(monkeypatch, devices, strategy,
                                                          block_mask):
    """The pairs' lists, the device index and the per-device heads and rows vary over the mesh
    axis; the Mosaic GPU kernels take them (their bodies see them as pallas_call's do), so the
    forward and both backward kernels are Mosaic's on one device and on several, and on the
    rows of a step that attends some of the queries."""
    if GPU_PRESENT and devices > 1:
        pytest.skip("lowers over abstract devices on the CPU only")
    pytest.importorskip("absl")
    monkeypatch.setattr(hardware, "is_hopper", lambda: True)

    def attention(q, k, v, table):
        return jattn.ring_flex_attention(
            q, k, v, lambda s, b, h, qi, ki: s + table[h],
            jattn.masks.causal_mask if block_mask is None else None, axis_name="x",
            strategy=strategy, block_mask=block_mask)

    q = jnp.ones((1, 2, 512, 64), jnp.bfloat16)
    text = lower_for_cuda(_grad_of(attention), q, q, q, jnp.zeros((2,), jnp.float32),
                          devices=devices)
    for kernel in ("mosaic_gpu", "jattn_mosaic_bwd_dq", "jattn_mosaic_bwd_dkdv"):
        assert kernel in text, kernel

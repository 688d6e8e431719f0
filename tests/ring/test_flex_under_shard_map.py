"""flex_attention inside a user's shard_map (batch sharded, a replicated learnable table): the
values and the gradients equal the unsharded call's; a replicated array's gradient is the sum
of the devices' parts, taken once."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jattn
from tests.helpers import random


# The Pallas interpreter cannot run under shard_map's type checks (its kernel body mixes the
# operands' mesh axes with unvarying program ids), so it runs with check_vma=False.
@pytest.mark.parametrize("implementation, check_vma", [("xla", True), ("interpret", False)])
def test_gradients_of_a_replicated_table_are_summed_once(implementation, check_vma):
    mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("batch",))
    rng = np.random.default_rng(0)
    q, k, v = (random(rng, (4, 2, 64, 16), jnp.float32) for _ in range(3))
    table = jnp.asarray(rng.standard_normal((2, 127)) * 0.1, jnp.float32)
    cotangent = random(rng, q.shape, jnp.float32)
    mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 64, 64, block_size=32)

    def attention(q, k, v, table):
        return jattn.flex_attention(
            q, k, v, lambda s, b, h, qi, ki: s + table[h, qi - ki + 63], mask,
            implementation=implementation)

    sharded = jax.shard_map(attention, mesh=mesh, in_specs=(P("batch"),) * 3 + (P(),),
                            out_specs=P("batch"), check_vma=check_vma)

    def loss(fn):
        return lambda *args: jnp.vdot(fn(*args), cotangent)

    ours = jax.jit(jax.value_and_grad(loss(sharded), argnums=(0, 1, 2, 3)))(q, k, v, table)
    whole = jax.jit(jax.value_and_grad(loss(attention), argnums=(0, 1, 2, 3)))(q, k, v, table)
    np.testing.assert_allclose(ours[0], whole[0], rtol=1e-5)
    for name, g, g_whole in zip(["q", "k", "v", "table"], ours[1], whole[1]):
        np.testing.assert_allclose(g, g_whole, rtol=2e-5, atol=2e-6, err_msg=f"d{name}")


def test_one_call_under_meshes_of_two_sizes():
    """The same per-device call under a mesh of 2 and then of 4 devices, its mods reading a
    value that varies over the axis, its BlockMask built there: what was traced and compiled
    under one mesh is not reused under the other (the traces' types name the mesh)."""
    q = jnp.ones((1, 2, 64, 16))
    for n in (2, 4):
        mesh = Mesh(np.array(jax.devices("cpu")[:n]), ("seq",))

        def attention(q, k, v):
            shift = jax.lax.axis_index("seq") * q.shape[2]
            block_mask = jattn.create_block_mask(
                lambda b, h, qi, ki: qi + shift >= ki, None, None, 64, 64, block_size=32)
            return jattn.flex_attention(
                q, k, v, lambda s, b, h, qi, ki: jnp.where(qi + shift >= ki, s, s - 1.0),
                block_mask, implementation="xla")

        sharded = jax.jit(jax.shard_map(attention, mesh=mesh,
                                        in_specs=(P(None, None, "seq"),) * 3,
                                        out_specs=P(None, None, "seq")))
        out = sharded(*(jnp.tile(q, (1, 1, n, 1)),) * 3)
        assert out.shape == (1, 2, 64 * n, 16)

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

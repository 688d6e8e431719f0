"""sharded_flex_attention on global arrays: batch, head and sequence splits over a mesh give
flex_attention's result on the unsplit arrays; the mods see global indices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jattn
from jattn._src.attention.reference import attention_reference
from tests.helpers import assert_close, assert_gradients_close, golden, low_precision, random

B, Hq, Hkv, L, E = 4, 4, 2, 256, 16
PER_BATCH_WINDOW = jnp.asarray([16, 32, 64, 128], jnp.int32)


def _window_by_batch(b, h, q_idx, kv_idx):  # reads the global batch index
    return (q_idx >= kv_idx) & (q_idx - kv_idx < PER_BATCH_WINDOW[b])


def _bias_by_head(score, b, h, q_idx, kv_idx):  # reads the global head index
    return score - 0.05 * (h + 1) * jnp.abs(q_idx - kv_idx)


def _mesh(shape, names):
    devices = np.array(jax.devices("cpu")[:int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, names)


SPLITS = {
    "batch": ((4,), ("data",), dict(batch_axis="data")),
    "heads": ((2,), ("model",), dict(head_axis="model")),
    "sequence": ((4,), ("seq",), dict(sequence_axis="seq")),
    "batch and sequence": ((2, 4), ("data", "seq"), dict(batch_axis="data",
                                                          sequence_axis="seq")),
}


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("given", ["mask_mod", "block_mask"])
def test_equals_flex_attention_on_the_whole_arrays(split, given):
    shape, names, axes = SPLITS[split]
    rng = np.random.default_rng(len(split))
    q = random(rng, (B, Hq, L, E), jnp.float32)
    k, v = (random(rng, (B, Hkv, L, E), jnp.float32) for _ in range(2))
    mesh = _mesh(shape, names)
    # Per batch row (and head): each device takes its own rows of a whole-arrays BlockMask.
    block_mask = jattn.create_block_mask(_window_by_batch, B, Hq, L, L, block_size=32)
    mask = {"mask_mod": _window_by_batch} if given == "mask_mod" else {"block_mask": block_mask}
    def attention(q, k, v):
        return jattn.sharded_flex_attention(
            q, k, v, _bias_by_head, mesh=mesh, enable_gqa=True, return_lse=True,
            implementation="xla", block_size=32, **mask, **axes)

    out, lse = jax.jit(attention)(q, k, v)
    if given == "block_mask" and "sequence_axis" in axes:
        # the ring's last step (keys 3 shards of 64 back, past every window) is skipped:
        # K/V travel twice, not three times
        assert str(jax.make_jaxpr(attention)(q, k, v)).count("ppermute[") == 2 * 2

    def whole(q, k, v):
        return attention_reference(q, k, v, _bias_by_head, block_mask)

    gold_out, gold_lse = golden(whole, q, k, v)
    low_out, low_lse = low_precision(whole, q, k, v)
    assert_close(out, gold_out, low_out, what="out")
    assert_close(lse, gold_lse, low_lse, what="lse")


def test_bad_axes_name_the_axis_and_the_shapes():
    mesh = _mesh((4,), ("data",))
    q = jnp.ones((2, 4, 64, 16))
    with pytest.raises(ValueError, match="'model' is not an axis of the mesh"):
        jattn.sharded_flex_attention(q, q, q, mesh=mesh, head_axis="model")
    with pytest.raises(ValueError, match=r"q's batch \(2, shape \(2, 4, 64, 16\)\) must divide "
                                         "evenly over the 4 devices of mesh axis 'data'"):
        jattn.sharded_flex_attention(q, q, q, mesh=mesh, batch_axis="data")
    with pytest.raises(ValueError, match="ring_flex_attention: `axis_name` 'seq' is not an "
                                         "axis.*inside jax.shard_map"):
        jattn.ring_flex_attention(q, q, q, axis_name="seq")  # outside shard_map


@pytest.mark.parametrize("split", ["batch", "sequence", "batch and sequence"])
def test_document_ids_as_token_arrays(split):
    shape, names, axes = SPLITS[split]
    rng = np.random.default_rng(5)
    q, k, v = (random(rng, (B, Hq, L, E), jnp.float32) for _ in range(3))
    documents = jnp.asarray(np.sort(rng.integers(0, 6, L)), jnp.int32)

    def same_document(b, h, q_idx, kv_idx, doc):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    out = jax.jit(lambda q, k, v, doc: jattn.sharded_flex_attention(
        q, k, v, mask_mod=same_document, mesh=_mesh(shape, names), implementation="xla",
        block_size=32, token_arrays=(doc,), **axes))(q, k, v, documents)
    block_mask = jattn.create_block_mask(
        lambda b, h, q_idx, kv_idx: same_document(b, h, q_idx, kv_idx, documents),
        None, None, L, L, block_size=32)

    def whole(q, k, v):
        return attention_reference(q, k, v, None, block_mask)[0]

    assert_close(out, golden(whole, q, k, v), low_precision(whole, q, k, v), what="out")


def test_bad_token_arrays_name_the_fix():
    mesh = _mesh((2,), ("seq",))
    q = jnp.ones((1, 2, 64, 16))
    with pytest.raises(ValueError, match=r"token_arrays\[0\] has shape \(32,\).*sequence "
                                         r"\(64 positions\)"):
        jattn.sharded_flex_attention(q, q, q, mesh=mesh, sequence_axis="seq",
                                     token_arrays=(jnp.zeros(32, jnp.int32),))


def test_gradients_with_batch_and_sequence_split():
    """dq, dk, dv and a replicated learnable table's gradient (summed over both mesh axes
    once, after the ring) equal flex_attention's on the whole arrays."""
    shape, names, axes = SPLITS["batch and sequence"]
    rng = np.random.default_rng(9)
    q = random(rng, (B, Hq, L, E), jnp.float32)
    k, v = (random(rng, (B, Hkv, L, E), jnp.float32) for _ in range(2))
    table = random(rng, (Hq, 2 * L - 1), jnp.float32) * 0.1
    mesh = _mesh(shape, names)

    def bias(table):
        return lambda s, b, h, q_idx, kv_idx: s + table[h, q_idx - kv_idx + L - 1]

    def ours(q, k, v, table):
        return jattn.sharded_flex_attention(q, k, v, bias(table), jattn.masks.causal_mask,
                                            mesh=mesh, enable_gqa=True, implementation="xla",
                                            block_size=32, **axes)

    block_mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, L,
                                         block_size=32)

    def whole(q, k, v, table):
        return attention_reference(q, k, v, bias(table), block_mask)[0]

    assert_gradients_close(ours, whole, (q, k, v, table), random(rng, q.shape, jnp.float32),
                           ["q", "k", "v", "table"])

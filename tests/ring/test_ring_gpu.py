"""ring_flex_attention on GPUs: the Pallas kernels under shard_map's type checking, against a
float64 golden of flex_attention on the whole sequence (output, LSE and the gradients of q, k,
v and a learnable table), each strategy. One GPU: a one-device mesh, whose ring forward equals
flex_attention's bitwise. Rings of 2, 4 and 8 GPUs run where that many are present."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jattn
from jattn._src.attention.reference import attention_reference
from tests.helpers import assert_close, golden, low_precision, random, random_cotangent_vjp

SEQ = P(None, None, "seq")
B, Hq, Hkv, L, E = 1, 8, 2, 2048, 128


def _gpus(n):
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < n:
        pytest.skip(f"needs {n} GPUs, {len(gpus)} present")
    return gpus[:n]


def _alibi_and_table(table, read=None):
    """ALiBi, plus a learnable table [Hq, L] read by head and key position where `read` is
    "by_position" (on a Hopper GPU, the Mosaic GPU kernels read it with vector loads, at the
    ring's pairs' global positions too)."""
    def score_mod(score, b, h, q_idx, kv_idx):
        alibi = score - jnp.exp2(-(h + 1.0) / 2) * jnp.abs(q_idx - kv_idx)
        return alibi if read is None else alibi + table[h, kv_idx]
    return score_mod


# documents of 300, 700, 150, 500 and 398 tokens, causal inside: they cross the shard
# boundaries of 2, 4 and 8 devices, inside BlockMask blocks
_PACKED = jattn.masks.and_masks(jattn.masks.causal_mask, jattn.masks.document_mask(
    jnp.asarray(np.repeat(np.arange(5), [300, 700, 150, 500, 398]), jnp.int32)))


def _ring(mesh, layout, strategy="ring", read=None, block_mask=None):
    """The ring under a causal mask_mod, or the whole sequence's `block_mask` (known while
    the ring is traced: the steps and query blocks without work are left out)."""
    n = mesh.shape["seq"]

    def local(q, k, v, table):
        return jattn.ring_flex_attention(
            q, k, v, _alibi_and_table(table, read),
            jattn.masks.causal_mask if block_mask is None else None, axis_name="seq",
            layout=layout, enable_gqa=True, return_lse=True, strategy=strategy,
            block_mask=block_mask)

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(SEQ,) * 3 + (P(),),
                            out_specs=(SEQ, SEQ))

    def ring(q, k, v, table):
        reorder = (lambda x: x) if layout == "contiguous" else functools.partial(
            jattn.to_zigzag, num_devices=n)
        restore = (lambda x: x) if layout == "contiguous" else functools.partial(
            jattn.from_zigzag, num_devices=n)
        placed = [jax.device_put(reorder(x), NamedSharding(mesh, SEQ)) for x in (q, k, v)]
        out, lse = sharded(*placed, table)
        return restore(out), restore(lse[..., None])[..., 0]

    return ring


def _whole(q, k, v, table, read=None, mask=jattn.masks.causal_mask):
    block_mask = jattn.create_block_mask(mask, None, None, L, L)
    return attention_reference(q, k, v, _alibi_and_table(table, read), block_mask)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("strategy", ["ring", "all_gather", "heads"])
@pytest.mark.parametrize("read", ["by_position", None])
def test_ring_of_gpus_equals_flex_attention_on_the_whole_sequence(n, layout, strategy, read):
    if read is None and (strategy, layout) != ("ring", "zigzag"):
        pytest.skip("ALiBi alone (no captured table) in one layout")
    _check_against_golden(n, layout, strategy, read)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_of_gpus_with_packed_documents(n, layout):
    """Packed documents given as the whole sequence's BlockMask: the ring leaves out the
    steps and query blocks without work (ALiBi: the Mosaic GPU kernels on Hopper)."""
    _check_against_golden(n, layout, "ring", None, mask=_PACKED)


def _check_against_golden(n, layout, strategy, read, mask=None):
    if strategy == "heads" and Hkv % n:
        pytest.skip(f"strategy='heads' splits the {Hkv} kv heads over the devices")
    mesh = Mesh(np.array(_gpus(n)), ("seq",))
    rng = np.random.default_rng(n)
    q = random(rng, (B, Hq, L, E), jnp.bfloat16)
    k, v = (random(rng, (B, Hkv, L, E), jnp.bfloat16) for _ in range(2))
    table = random(rng, (Hq, L), jnp.float32) * 0.1
    cotangents = random(rng, q.shape, jnp.bfloat16), random(rng, q.shape[:3], jnp.float32)
    block_mask = None if mask is None else jattn.create_block_mask(mask, None, None, L, L)
    ring = _ring(mesh, layout, strategy, read, block_mask)
    out, lse = jax.jit(ring)(q, k, v, table)
    grads = jax.jit(lambda *x: random_cotangent_vjp(ring, x, cotangents))(q, k, v, table)

    whole = functools.partial(_whole, read=read, mask=mask or jattn.masks.causal_mask)

    def pulled_back(*x):
        return (*whole(*x[:4]), *random_cotangent_vjp(whole, x[:4], x[4:]))

    gold = golden(pulled_back, q, k, v, table, *cotangents)
    low = low_precision(pulled_back, q, k, v, table, *cotangents)
    for name, got, g64, g_low in zip(["out", "lse", "dq", "dk", "dv", "dtable"],
                                     (out, lse, *grads), gold, low):
        assert_close(got, g64, g_low, what=name)


@pytest.mark.gpu
def test_one_gpu_ring_forward_equals_flex_attention_bitwise():
    mesh = Mesh(np.array(_gpus(1)), ("seq",))
    rng = np.random.default_rng(0)
    q = random(rng, (B, Hq, L, E), jnp.bfloat16)
    k, v = (random(rng, (B, Hkv, L, E), jnp.bfloat16) for _ in range(2))
    table = random(rng, (Hq, L), jnp.float32) * 0.1
    out, lse = jax.jit(_ring(mesh, "contiguous"))(q, k, v, table)
    block_mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, L)
    ref_out, ref_lse = jax.jit(lambda q, k, v, table: jattn.flex_attention(
        q, k, v, _alibi_and_table(table), block_mask, enable_gqa=True,
        return_lse=True))(q, k, v, table)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref_out, np.float32))
    np.testing.assert_array_equal(lse, ref_lse)

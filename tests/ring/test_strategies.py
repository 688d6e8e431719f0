"""ring_flex_attention's strategies besides the ring, "all_gather" and "heads", across forced
CPU devices: flex_attention on the whole sequence (output, LSE, gradients of q, k, v and a
learnable table), both layouts, the collectives each runs, and what "auto" runs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jattn
from jattn._src.attention.reference import attention_reference
from tests.helpers import assert_close, golden, low_precision, random, random_cotangent_vjp

SEQ = P(None, None, "seq")
L, E, HQ, HKV = 256, 16, 16, 8  # GQA; the heads split over 8 devices
TABLE = jnp.asarray(np.random.default_rng(0).standard_normal((HQ, 2 * L - 1)) * 0.1,
                    jnp.float32)
DOCUMENTS = jnp.asarray(np.repeat(np.arange(8), np.diff([0, 20, 50, 64, 100, 150, 160, 230,
                                                         L])), jnp.int32)


def _mesh(n):
    if len(jax.devices("cpu")) < n:
        pytest.fail(f"needs {n} CPU devices: tests/conftest.py forces 8 host devices")
    return Mesh(np.array(jax.devices("cpu")[:n]), ("seq",))


def _reorder(x, n, layout, axis=2):
    return x if layout == "contiguous" else jattn.to_zigzag(x, n, axis)


def _restore(x, n, layout, axis=2):
    return x if layout == "contiguous" else jattn.from_zigzag(x, n, axis)


def _same_document(b, h, q_idx, kv_idx, doc):
    return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)


def _relative_bias(table):
    return lambda s, b, h, q_idx, kv_idx, *tokens: s + table[h, q_idx - kv_idx + L - 1]


MASKS = {"causal": jattn.masks.causal_mask, "sliding": jattn.masks.sliding_window(40),
         "document": _same_document, "full": None}


def _sharded(n, strategy, layout, table, mask):
    """The strategy over n devices on global (out, lse), the layout undone. Documents come
    as token_arrays (sharded like q); the window as a whole-sequence BlockMask."""
    tokens = (DOCUMENTS,) if mask == "document" else ()
    whole_mask = (jattn.create_block_mask(MASKS[mask], None, None, L, L, block_size=16)
                  if mask == "sliding" else None)
    mask_mod = None if whole_mask is not None else MASKS[mask]

    def local(q, k, v, *tokens):
        return jattn.ring_flex_attention(q, k, v, _relative_bias(table), mask_mod,
                                         axis_name="seq", layout=layout, return_lse=True,
                                         implementation="xla", block_size=16,
                                         token_arrays=tokens, enable_gqa=True,
                                         block_mask=whole_mask, strategy=strategy)

    sharded = jax.shard_map(local, mesh=_mesh(n),
                            in_specs=(SEQ,) * 3 + (P("seq"),) * len(tokens),
                            out_specs=(SEQ, SEQ))

    def run(q, k, v):
        out, lse = sharded(*(_reorder(x, n, layout) for x in (q, k, v)),
                           *(_reorder(t, n, layout, 0) for t in tokens))
        return _restore(out, n, layout), _restore(lse[..., None], n, layout)[..., 0]

    return run


def _whole(table, mask):
    mask_mod = MASKS[mask]
    if mask == "document":
        mask_mod = lambda b, h, q_idx, kv_idx: _same_document(  # noqa: E731
            b, h, q_idx, kv_idx, DOCUMENTS)
    block_mask = None if mask_mod is None else jattn.create_block_mask(mask_mod, None, None,
                                                                       L, L, block_size=16)

    def run(q, k, v):
        return attention_reference(q, k, v, _relative_bias(table), block_mask)

    return run


# Every mask; zigzag (slow to compile on the CPU) with the whole-sequence BlockMask, whose rows
# it reorders; 8 devices for one.
@pytest.mark.parametrize("strategy", ["all_gather", "heads"])
@pytest.mark.parametrize("n, layout, mask", [(8, "contiguous", "causal"), (4, "zigzag", "sliding"),
                                             (4, "contiguous", "document"),
                                             (4, "contiguous", "full")])
def test_output_lse_and_gradients_equal_flex_attention_on_the_whole_sequence(strategy, n, layout,
                                                                             mask):
    rng = np.random.default_rng(3)
    q = random(rng, (1, HQ, L, E), jnp.float32)
    k, v = (random(rng, (1, HKV, L, E), jnp.float32) for _ in range(2))
    cotangents = random(rng, q.shape, jnp.float32), random(rng, q.shape[:3], jnp.float32)

    def ours_fn(q, k, v, table):
        return _sharded(n, strategy, layout, table, mask)(q, k, v)

    def whole_fn(q, k, v, table):
        return _whole(table, mask)(q, k, v)

    ours = jax.jit(lambda *x: (*ours_fn(*x), *random_cotangent_vjp(ours_fn, x, cotangents)))(
        q, k, v, TABLE)
    pulled = lambda *x: (*whole_fn(*x[:4]),  # noqa: E731
                         *random_cotangent_vjp(whole_fn, x[:4], x[4:]))
    gold = golden(pulled, q, k, v, TABLE, *cotangents)
    low = low_precision(pulled, q, k, v, TABLE, *cotangents)
    for name, g, g64, g_low in zip(["out", "lse", "dq", "dk", "dv", "dtable"], ours, gold, low):
        assert_close(g, g64, g_low, what=name)


def _collectives(fn, *args):
    text = str(jax.make_jaxpr(fn)(*args))
    names = ("ppermute", "all_gather", "reduce_scatter", "all_to_all")
    return {name: len(re.findall(rf"\b{name}\[", text)) for name in names}


def _causal_then_documents(b, h, q_idx, kv_idx):  # documents of 64 tokens from 128 on
    return (q_idx >= kv_idx) & ((q_idx < 128) | (q_idx // 64 == kv_idx // 64))


@pytest.mark.parametrize("n, heads, layout, mask, given_as, runs", [
    (4, 8, "contiguous", "causal", "block_mask", "heads"),  # the last device: 1.75x the mean
    (2, 8, "zigzag", "causal", "block_mask", "ring"),  # equal work
    (4, 8, "zigzag", "causal", "block_mask", "heads"),  # equal work, dense, four devices
    (4, 8, "contiguous", "documents", "block_mask", "ring"),  # equal work, 1/8 of the blocks
    (4, 8, "contiguous", "skewed", "block_mask", "heads"),  # causal on one shard, documents on one
    (2, 8, "zigzag", "causal", "mask_mod", "heads"),  # the balance is not known
    (2, 8, "contiguous", None, None, "ring"),  # no mask: equal work
    (4, 8, "contiguous", None, None, "heads"),  # no mask: dense, four devices
    (4, 4, "contiguous", "causal", "block_mask", "ring"),  # Hkv=2 does not divide by 4 devices
])
def test_auto_runs_the_ring_where_work_is_balanced_and_the_heads_elsewhere(
        n, heads, layout, mask, given_as, runs):
    mask_mod = {"causal": jattn.masks.causal_mask, "documents": jattn.masks.document_mask(
        jnp.arange(L) // 32), "skewed": _causal_then_documents, None: None}[mask]
    whole_mask = (jattn.create_block_mask(mask_mod, None, None, L, L, block_size=16)
                  if given_as == "block_mask" else None)

    def local(q, k, v):
        return jattn.ring_flex_attention(
            q, k, v, mask_mod=mask_mod if given_as == "mask_mod" else None, axis_name="seq",
            layout=layout, implementation="xla", block_size=16, enable_gqa=True,
            block_mask=whole_mask)

    sharded = jax.shard_map(local, mesh=_mesh(n), in_specs=(SEQ,) * 3, out_specs=SEQ)
    q, kv = jnp.ones((1, heads, L, E)), jnp.ones((1, heads // 2, L, E))
    seen = _collectives(sharded, q, kv, kv)
    assert (seen["all_to_all"] > 0, seen["ppermute"] > 0 or seen == dict.fromkeys(seen, 0)) == (
        runs == "heads", runs == "ring"), seen
    # sharded_flex_attention judges the same from the global BlockMask
    if given_as == "block_mask":
        seen = _collectives(lambda q, k, v: jattn.sharded_flex_attention(
            q, k, v, mesh=_mesh(n), sequence_axis="seq", layout=layout, block_mask=whole_mask,
            block_size=16, implementation="xla", enable_gqa=True), q, kv, kv)
        assert (seen["all_to_all"] > 0) == (runs == "heads"), seen


@pytest.mark.parametrize("strategy, forward, backward", [
    ("all_gather", {"all_gather": 2}, {"reduce_scatter": 2}),  # K, V; dK, dV
    ("heads", {"all_to_all": 5}, {"all_to_all": 10}),  # q, k, v in, out and LSE back
])
def test_each_strategy_runs_its_collectives_and_no_ring(strategy, forward, backward):
    n = 4
    q = jnp.ones((1, 8, L, E))
    k = v = jnp.ones((1, 4, L, E))
    run = _sharded(n, strategy, "contiguous", TABLE[:8], "causal")

    seen = _collectives(run, q, k, v)
    assert seen == {"ppermute": 0, "all_gather": 0, "reduce_scatter": 0, "all_to_all": 0,
                    **forward}
    seen = _collectives(lambda q, k, v: jax.vjp(run, q, k, v)[1]((q, q[..., 0])), q, k, v)
    assert seen["ppermute"] == 0
    assert all(seen[name] == count for name, count in backward.items()), seen


def test_heads_must_divide_by_the_devices():
    q = jnp.ones((1, 4, L, E))
    with pytest.raises(ValueError, match=r"strategy='heads'.*Hq=4 and Hkv=4 \(per device.*"
                                         r"must both divide by it; use strategy='ring' or "
                                         r"'all_gather'"):
        _sharded(8, "heads", "contiguous", TABLE[:4], "causal")(q, q, q)


def test_unknown_strategy():
    q = jnp.ones((1, 8, L, E))
    with pytest.raises(ValueError, match=r"`strategy` must be one of \('auto', 'ring', "
                                         r"'all_gather', 'heads'\), got 'ulysses'"):
        _sharded(2, "ulysses", "contiguous", TABLE[:8], "causal")(q, q, q)
    mesh = _mesh(2)
    with pytest.raises(ValueError, match="sharded_flex_attention: `strategy` must be one of"):
        jattn.sharded_flex_attention(q, q, q, mesh=mesh, sequence_axis="seq",
                                     strategy="ulysses")


def test_sharded_flex_attention_takes_a_strategy():
    """Global arrays, the sequence over 4 devices, a whole-sequence BlockMask: the heads
    strategy's output equals the ring's."""
    strategy = "heads"
    rng = np.random.default_rng(5)
    q, k, v = (random(rng, (2, 8, L, E), jnp.float32) for _ in range(3))
    block_mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, L,
                                         block_size=16)
    mesh = _mesh(4)
    outs = [jax.jit(lambda q, k, v, s=s: jattn.sharded_flex_attention(
        q, k, v, mesh=mesh, sequence_axis="seq", block_mask=block_mask, block_size=16,
        implementation="xla", strategy=s))(q, k, v) for s in ("ring", strategy)]
    np.testing.assert_allclose(np.asarray(outs[1]), np.asarray(outs[0]), rtol=1e-5, atol=1e-5)

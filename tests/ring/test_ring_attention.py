"""ring_flex_attention across forced CPU devices: exactly flex_attention on the whole sequence
(output, LSE, gradients of q, k, v and a learnable table), both layouts, skipped pairs counted."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jattn
from jattn._src.attention.reference import attention_reference
from jattn._src.ring.attention import ring_steps
from jattn._src.ring.schedule import ring_schedule, work_balance
from tests.helpers import (assert_close, assert_gradients_close, golden, low_precision, random,
                           random_cotangent_vjp)

SEQ = P(None, None, "seq")
L, E = 256, 16


def _mesh(n):
    if len(jax.devices("cpu")) < n:
        pytest.fail(f"needs {n} CPU devices: tests/conftest.py forces 8 host devices")
    return Mesh(np.array(jax.devices("cpu")[:n]), ("seq",))


def _documents(b, h, q_idx, kv_idx):  # four documents of 64 positions, causal inside
    return (q_idx // 64 == kv_idx // 64) & (q_idx >= kv_idx)


MASKS = {"causal": jattn.masks.causal_mask, "sliding": jattn.masks.sliding_window(40),
         "document": _documents, "full": None}
TABLE = jnp.asarray(np.random.default_rng(0).standard_normal((4, 2 * L - 1)) * 0.1, jnp.float32)


def _alibi_softcap(score, b, h, q_idx, kv_idx):
    return 10.0 * jnp.tanh(score / 10.0) - jnp.exp2(-(h + 1.0)) * jnp.abs(q_idx - kv_idx)


def _ring(n, mask_mod, score_mod, layout, *, enable_gqa=False):
    def local(q, k, v):
        out, lse, launched = ring_steps(q, k, v, score_mod, mask_mod, axis_name="seq",
                                        layout=layout, scale=None, enable_gqa=enable_gqa,
                                        implementation="xla", block_size=16)
        return out, lse, launched[None]

    return jax.jit(jax.shard_map(local, mesh=_mesh(n), in_specs=(SEQ,) * 3,
                                 out_specs=(SEQ, SEQ, P("seq"))))


def _block_mask(mask_mod):
    return None if mask_mod is None else jattn.create_block_mask(mask_mod, None, None, L, L,
                                                                 block_size=16)


def _whole(mask_mod, score_mod):
    """The float64-capable reference of flex_attention on the whole sequence: (out, lse)."""
    return functools.partial(attention_reference, score_mod=score_mod,
                             block_mask=_block_mask(mask_mod))


def _reorder(x, n, layout):
    return x if layout == "contiguous" else jattn.to_zigzag(x, n)


def _restore(x, n, layout):
    return x if layout == "contiguous" else jattn.from_zigzag(x, n)


# every mask under zigzag on 8 devices, causal and full contiguous (the sliding window and
# documents contiguous: the skipped-steps and strategy tests), and causal (pairs skipped, work
# unequal) on 2; 4 devices: the block-mask and gradient tests below
@pytest.mark.parametrize("n, layout, mask", [
    *((8, "zigzag", mask) for mask in MASKS), (8, "contiguous", "causal"),
    (8, "contiguous", "full"), (2, "contiguous", "causal")])
def test_output_and_lse_equal_flex_attention_on_the_whole_sequence(n, layout, mask):
    rng = np.random.default_rng(n)
    Hq, Hkv = 4, 2
    q, k, v = (random(rng, (2, H, L, E), jnp.float32) for H in (Hq, Hkv, Hkv))
    score_mod = _alibi_softcap if mask in ("causal", "full") else None
    out, lse, _ = _ring(n, MASKS[mask], score_mod, layout, enable_gqa=True)(
        *(_reorder(x, n, layout) for x in (q, k, v)))
    out, lse = (_restore(x, n, layout) for x in (out, lse[..., None]))
    whole = _whole(MASKS[mask], score_mod)
    gold_out, gold_lse = golden(whole, q, k, v)
    low_out, low_lse = low_precision(whole, q, k, v)
    assert_close(out, gold_out, low_out, what="out")
    assert_close(lse[..., 0], gold_lse, low_lse, what="lse")


def _differentiable_ring(n, mask_mod, score_mod, layout, *, token_arrays=(), enable_gqa=False,
                         block_mask=None):
    """ring_flex_attention over n devices on global (out, lse), the layout undone."""
    specs = tuple(P(*(None,) * (x.ndim - 1), "seq") for x in token_arrays)

    def local(q, k, v, *tokens):
        return jattn.ring_flex_attention(q, k, v, score_mod, mask_mod, axis_name="seq",
                                         layout=layout, return_lse=True, implementation="xla",
                                         block_size=16, token_arrays=tokens,
                                         enable_gqa=enable_gqa, block_mask=block_mask)

    sharded = jax.shard_map(local, mesh=_mesh(n), in_specs=(SEQ,) * 3 + specs,
                            out_specs=(SEQ, SEQ))

    def ring(q, k, v):
        tokens = [_reorder(x[None, None, ..., None], n, layout)[0, 0, ..., 0]
                  for x in token_arrays]
        out, lse = sharded(*(_reorder(x, n, layout) for x in (q, k, v)), *tokens)
        return _restore(out, n, layout), _restore(lse[..., None], n, layout)[..., 0]

    return ring


def _score_mod_of(table):
    return lambda s, b, h, q_idx, kv_idx: s + table[h, q_idx - kv_idx + L - 1]


# Causal (the most pairs skipped and cut) in both layouts, a window and no mask; documents:
# test_document_ids_sharded_with_q_and_travelling_with_k.
@pytest.mark.parametrize("mask, layout", [("causal", "contiguous"), ("causal", "zigzag"),
                                          ("sliding", "contiguous"), ("full", "zigzag")])
def test_gradients_of_q_k_v_and_a_learnable_table(layout, mask):
    n = 4
    rng = np.random.default_rng(7)
    q = random(rng, (1, 4, L, E), jnp.float32)
    k, v = (random(rng, (1, 2, L, E), jnp.float32) for _ in range(2))  # GQA: 2 kv heads
    cotangents = random(rng, q.shape, jnp.float32), random(rng, q.shape[:3], jnp.float32)

    def ring(q, k, v, table):
        return _differentiable_ring(n, MASKS[mask], _score_mod_of(table), layout,
                                    enable_gqa=True)(q, k, v)

    def whole(q, k, v, table):
        return _whole(MASKS[mask], _score_mod_of(table))(q, k, v)

    # The LSE gets a cotangent too: its gradient flows through the same pairs.
    ours = jax.jit(lambda *x: random_cotangent_vjp(ring, x, cotangents))(q, k, v, TABLE)
    pulled_back = lambda *x: random_cotangent_vjp(whole, x[:-2], x[-2:])  # noqa: E731
    gold = golden(pulled_back, q, k, v, TABLE, *cotangents)
    low = low_precision(pulled_back, q, k, v, TABLE, *cotangents)
    for name, g, g64, g_low in zip(["q", "k", "v", "table"], ours, gold, low):
        assert_close(g, g64, g_low, what=f"d{name}")


def test_backward_is_a_ring_sending_dk_dv_parts_home():
    """The backward sends K/V on n − 1 times, and each device its part of the dK/dV of the
    n − 1 shards not its own straight back; autodiff of the forward would transpose its
    2(n − 1) sends instead."""
    n = 4
    q = jnp.ones((1, 2, L, E))

    def loss(q, k, v):
        return _differentiable_ring(n, jattn.masks.causal_mask, None, "zigzag")(q, k, v)[0].sum()

    text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, q, q))
    assert text.count("ppermute[") == 2 * (n - 1) + 2 * (n - 1) + 2 * (n - 1)


def _previous_shard(b, h, q_idx, kv_idx):  # each shard of 64 sees only the one before
    return kv_idx // 64 == q_idx // 64 - 1


_PACKED = jattn.masks.and_masks(jattn.masks.causal_mask, jattn.masks.document_mask(
    jnp.asarray(np.repeat(np.arange(4), [50, 90, 30, 86]), jnp.int32)))


# (mask, layout, the ring steps with work on 4 devices, those with work on every device, the
# key blocks (of 16) sent at each, the query blocks attended at each, sends of the forward
# and backward: K, V and the token array per step fetched, dK and dV per step returned)
@pytest.mark.parametrize("mask, layout, steps, everywhere, kept, rows, sends", [
    # documents within shards (the library's masks: their arrays are pytree leaves): none
    (jattn.masks.and_masks(jattn.masks.causal_mask,
                           jattn.masks.document_mask(jnp.arange(L) // 64)), "contiguous",
     (0,), {0}, (None,), (None,), 0),
    # the last 40 keys of the previous shard: 3 of its 4 blocks go, their dK/dV come back;
    # the first 40 queries (3 blocks) attend them
    (jattn.masks.sliding_window(40), "contiguous", (0, 1), {0}, (None, (1, 2, 3)),
     (None, (0, 1, 2)), 3 + 5),
    (_previous_shard, "contiguous", (1,), set(), (None,), (None,), 3 + 5),  # no diagonal
    # documents of random lengths across shard boundaries, in both halves of zigzag shards
    (_PACKED, "zigzag", (0, 1, 2, 3), {0}, (None, (0, 1), (1, 2, 3), (2, 3)),
     (None, (0, 1, 2), None, (2, 3)), 9 + 15)])
def test_steps_without_work_send_nothing(mask, layout, steps, everywhere, kept, rows, sends):
    """A whole-sequence BlockMask known while the ring is traced: steps whose pairs are empty
    on every device are left out (no kernel, no transfer), and of the others only the key
    blocks some pair visits travel and only the query blocks some pair visits attend; the
    results (forward and gradients) are those of the ring that runs every step on whole
    shards (a mask_mod's), to float32 rounding (the merges of fewer rows round apart)."""
    n = 4
    whole_mask = _block_mask(mask)
    schedule = ring_schedule(whole_mask, n, layout)
    assert (schedule.steps, schedule.everywhere, schedule.kept, schedule.rows) == (
        steps, everywhere, kept, rows)
    rng = np.random.default_rng(17)
    q, k, v = (random(rng, (1, 2, L, E), jnp.float32) for _ in range(3))
    cotangents = random(rng, q.shape, jnp.float32), random(rng, q.shape[:3], jnp.float32)

    def by_tokens(score, b, h, q_idx, kv_idx, position):  # reads the keys' tokens in hand
        return score + 0.01 * (position[q_idx] - position[kv_idx])

    def results(block_mask, mask_mod):  # (out, lse) and the gradients of q, k, v
        ring = _differentiable_ring(n, mask_mod, by_tokens, layout, block_mask=block_mask,
                                    token_arrays=(jnp.arange(L, dtype=jnp.int32),))

        def pulled_back(*x):
            out, vjp = jax.vjp(ring, *x)
            return out, vjp(cotangents)
        return pulled_back

    with_tokens = lambda b, h, q_idx, kv_idx, _: mask(b, h, q_idx, kv_idx)  # noqa: E731
    skipping = results(dataclasses.replace(whole_mask, mask_mod=with_tokens), None)
    # compared where a step takes some of a shard's blocks (keys sent, queries attended);
    # steps on whole shards run as the every-step ring's do
    if any(blocks is not None for blocks in kept + rows):
        for ours, every_step in zip(
                jax.tree.leaves(jax.jit(skipping)(q, k, v)),
                jax.tree.leaves(jax.jit(results(None, with_tokens))(q, k, v))):
            np.testing.assert_allclose(ours, every_step, rtol=1e-5, atol=1e-6)
    text = str(jax.make_jaxpr(skipping)(q, k, v))
    assert text.count("ppermute[") == sends
    # the keys sent: the kept blocks' positions (16 each) where a step needs some, whole
    # shards of 64 where it needs all
    sent = {int(length) for length in re.findall(
        r"f32\[1,2,(\d+),16\](?:\{[^}]*\})? = ppermute\[", text)}
    assert sent == {64 if blocks is None else 16 * len(blocks)
                    for step, blocks in zip(steps, kept) if step}


def test_bfloat16_dk_dv_parts_travel_in_bfloat16():
    """The kernels give each pair's dK/dV in k's dtype, so the parts go home in it (half the
    bytes of float32, nothing lost) and are summed there in float32."""
    x = jax.ShapeDtypeStruct((1, 2, L, E), jnp.bfloat16)
    ring = _differentiable_ring(4, None, None, "contiguous",
                                block_mask=_block_mask(MASKS["sliding"]))
    text = str(jax.make_jaxpr(lambda *args: random_cotangent_vjp(
        lambda *y: ring(*y)[0], args[:3], args[3]))(x, x, x, x))
    # K/V there (forward, backward) and dK/dV back: the window's 3 blocks of 16 of the
    # previous shard, all in bf16
    sent = re.findall(r"(\w+)\[1,2,48,16\](?:\{[^}]*\})? = ppermute\[", text)
    assert sent == ["bf16"] * 6


def test_packed_documents_under_x64():
    """With 64-bit types enabled (Python ints int64), the ring's device arithmetic and the
    pairs' stated ranges keep to the device index's int32."""
    with jax.enable_x64(True):
        whole_mask = _block_mask(_PACKED)
        q = random(np.random.default_rng(3), (1, 2, L, E), jnp.float32)
        out, _ = jax.jit(_differentiable_ring(2, None, None, "zigzag",
                                              block_mask=whole_mask))(q, q, q)
        expected = jattn.flex_attention(q, q, q, block_mask=whole_mask, implementation="xla")
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_float64_rings_equal_flex_attention_in_float64():
    """float64 inputs (x64, the xla implementation): out, LSE and gradients as flex_attention's
    in float64, through the steps' emptiness conditionals (a mask_mod) and without them (a
    whole-sequence BlockMask whose second step attends a few rows)."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(11)
        q, k, v = (random(rng, (1, 2, L, E), jnp.float64) for _ in range(3))
        cotangents = random(rng, q.shape, jnp.float64), random(rng, q.shape[:3], jnp.float64)
        window = MASKS["sliding"]
        whole = _block_mask(window)
        for ring in (_differentiable_ring(2, window, None, "contiguous"),
                     _differentiable_ring(2, None, None, "contiguous", block_mask=whole)):
            (out, lse), vjp = jax.vjp(jax.jit(ring), q, k, v)
            (expected_out, expected_lse), expected_vjp = jax.vjp(
                lambda q, k, v: jattn.flex_attention(q, k, v, block_mask=whole, return_lse=True,
                                                     implementation="xla"), q, k, v)
            assert out.dtype == lse.dtype == jnp.float64
            for ours, theirs in zip((out, lse, *vjp(cotangents)),
                                    (expected_out, expected_lse, *expected_vjp(cotangents))):
                np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-12)


def test_the_schedule_is_read_inside_an_eager_shard_map():
    """shard_map called without jit runs its body's jax ops as the map's own: the schedule of
    a whole-sequence BlockMask (what strategy="auto" and the ring read) is computed by numpy
    there as under jit."""
    whole = _block_mask(MASKS["sliding"])
    expected = ring_schedule(whole, 2, "zigzag"), work_balance(whole, 2, "zigzag")
    seen = []

    def local(x):
        seen.append((ring_schedule(whole, 2, "zigzag"), work_balance(whole, 2, "zigzag")))
        return x

    jax.shard_map(local, mesh=_mesh(2), in_specs=SEQ, out_specs=SEQ)(jnp.zeros((1, 1, L, 1)))
    assert seen == [expected]


def test_document_ids_sharded_with_q_and_travelling_with_k():
    """A per-token array (document ids, as token_arrays) read by both mods: out, LSE and
    gradients equal flex_attention reading the whole array (two devices: each holds two
    zigzag chunks, so the ids travel and are read out of order as with more)."""
    n, layout = 2, "zigzag"
    rng = np.random.default_rng(11)
    q, k, v = (random(rng, (1, 2, L, E), jnp.float32) for _ in range(3))
    documents = jnp.asarray(np.repeat(np.arange(8), np.diff([0, 20, 50, 64, 100, 150, 160,
                                                             230, L])), jnp.int32)

    def same_document(b, h, q_idx, kv_idx, doc):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    def bias_by_document(score, b, h, q_idx, kv_idx, doc):
        return score + 0.1 * doc[kv_idx]

    ring = _differentiable_ring(n, same_document, bias_by_document, layout,
                                token_arrays=(documents,))
    block_mask = jattn.create_block_mask(
        lambda b, h, q_idx, kv_idx: same_document(b, h, q_idx, kv_idx, documents),
        None, None, L, L, block_size=16)

    def whole(q, k, v):
        return attention_reference(
            q, k, v, lambda s, b, h, qi, ki: bias_by_document(s, b, h, qi, ki, documents),
            block_mask)

    cotangents = random(rng, q.shape, jnp.float32), random(rng, q.shape[:3], jnp.float32)
    ours = jax.jit(lambda *x: (*ring(*x), *random_cotangent_vjp(ring, x, cotangents)))(q, k, v)
    pulled = lambda *x: (*whole(*x[:3]), *random_cotangent_vjp(whole, x[:3], x[3:]))  # noqa
    gold = golden(pulled, q, k, v, *cotangents)
    low = low_precision(pulled, q, k, v, *cotangents)
    for name, g, g64, g_low in zip(["out", "lse", "dq", "dk", "dv"], ours, gold, low):
        assert_close(g, g64, g_low, what=name)


def test_token_arrays_errors():
    ring = _differentiable_ring(2, None, None, "contiguous",
                                token_arrays=(jnp.zeros((L,), jnp.float32),))
    with pytest.raises(TypeError, match=r"token_arrays\[0\] is float32.*integer or bool"):
        ring(*(jnp.ones((1, 1, L, E)),) * 3)

    def local(q, k, v):
        return jattn.ring_flex_attention(q, k, v, axis_name="seq",
                                         token_arrays=(jnp.zeros((L,), jnp.int32),))

    with pytest.raises(ValueError, match=r"token_arrays\[0\] has shape \(256,\).*this "
                                         r"device's 128 positions"):
        jax.shard_map(local, mesh=_mesh(2), in_specs=(SEQ,) * 3, out_specs=SEQ)(
            *(jnp.ones((1, 1, L, E)),) * 3)


def test_causal_pairs_without_keys_launch_nothing():
    n = 8
    q = jnp.ones((1, 1, L, E))
    contiguous = np.asarray(_ring(n, jattn.masks.causal_mask, None, "contiguous")(q, q, q)[2])
    # Device i sees the shards of devices i, i-1, ..., 0: i + 1 of the n pairs.
    assert contiguous.tolist() == [i + 1 for i in range(n)]
    zigzag = np.asarray(_ring(n, jattn.masks.causal_mask, None, "zigzag")(q, q, q)[2])
    assert zigzag.tolist() == [n] * n  # every pair holds an early chunk below a late one
    everything = np.asarray(_ring(n, None, None, "contiguous")(q, q, q)[2])
    assert everything.tolist() == [n] * n
    # A learnable table's gradient is summed across devices after the ring, so a score_mod
    # reading one skips empty pairs too.
    learnable = np.asarray(_ring(n, jattn.masks.causal_mask, _score_mod_of(TABLE),
                                 "contiguous")(q, q, q)[2])
    assert learnable.tolist() == [i + 1 for i in range(n)]


def test_zigzag_gives_every_device_equal_causal_work():
    """Attended (query, key) pairs per device under a causal mask: equal with zigzag within
    one chunk's worth, while the contiguous layout's last device does n times the first's."""
    n, chunk = 4, L // 4
    positions = np.arange(L)
    for layout, balanced in (("zigzag", True), ("contiguous", False)):
        order = np.asarray(_reorder(positions[None, None, :, None], n, layout))[0, 0, :, 0]
        work = [int((order[d * chunk:(d + 1) * chunk, None] >= positions[None, :]).sum())
                for d in range(n)]
        assert (max(work) - min(work) <= chunk * chunk // 2) == balanced, (layout, work)


def test_zigzag_round_trip_and_errors():
    x = jnp.arange(2 * 3 * 24 * 2).reshape(2, 3, 24, 2)
    np.testing.assert_array_equal(jattn.from_zigzag(jattn.to_zigzag(x, 3), 3), x)
    assert jattn.to_zigzag(jnp.arange(8)[None, None, :, None], 2)[0, 0, :, 0].tolist() == [
        0, 1, 6, 7, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="2 x num_devices = 6 equal chunks"):
        jattn.to_zigzag(jnp.ones((1, 1, 10, 1)), 3)
    with pytest.raises(ValueError, match="layout"):
        _ring(2, None, None, "spiral")(*(jnp.ones((1, 1, L, E)),) * 3)
    with pytest.raises(ValueError, match=r"q's shard has 128 positions and k/v's 64.*"
                                         r"\(q \(1, 1, 128, 16\), k \(1, 1, 64, 16\)\)"):
        _ring(2, None, None, "contiguous")(jnp.ones((1, 1, L, E)), *(jnp.ones((1, 1, 128, E)),) * 2)


# one device (the pair is the whole sequence); on 4 devices, in both layouts, the pairs cut
# from the BlockMask give the mask_mod's results bitwise: test_steps_without_work_send_nothing
@pytest.mark.parametrize("n, layout, mask", [(1, "contiguous", "document")])
def test_a_whole_sequence_block_mask_equals_its_mask_mod(n, layout, mask):
    """Pairs cut from a BlockMask of the whole sequence (on one device, the whole of it): the
    mask_mod's result, bitwise, the same pairs skipped; gradients against the float64 golden."""
    rng = np.random.default_rng(13)
    q, k, v = (random(rng, (1, 2, L, E), jnp.float32) for _ in range(3))
    whole_mask = _block_mask(MASKS[mask])

    def by_block_mask(q, k, v):
        out, lse, launched = ring_steps(q, k, v, _alibi_softcap, axis_name="seq",
                                        layout=layout, scale=None, enable_gqa=False,
                                        implementation="xla", block_size=16,
                                        block_mask=whole_mask)
        return out, lse, launched[None]

    cut = jax.jit(jax.shard_map(by_block_mask, mesh=_mesh(n), in_specs=(SEQ,) * 3,
                                out_specs=(SEQ, SEQ, P("seq"))))
    args = [_reorder(x, n, layout) for x in (q, k, v)]
    for ours, built in zip(cut(*args), _ring(n, MASKS[mask], _alibi_softcap, layout)(*args)):
        np.testing.assert_array_equal(ours, built)

    def ring(q, k, v):
        def local(q, k, v):
            return jattn.ring_flex_attention(q, k, v, _alibi_softcap, axis_name="seq",
                                             layout=layout, implementation="xla",
                                             block_mask=whole_mask)

        sharded = jax.shard_map(local, mesh=_mesh(n), in_specs=(SEQ,) * 3, out_specs=SEQ)
        return _restore(sharded(*(_reorder(x, n, layout) for x in (q, k, v))), n, layout)

    assert_gradients_close(ring, lambda *x: _whole(MASKS[mask], _alibi_softcap)(*x)[0],
                           (q, k, v), random(rng, q.shape, jnp.float32), ["q", "k", "v"])


def test_whole_sequence_block_mask_errors():
    def call(block_mask, mask_mod=None, layout="contiguous"):
        def local(q, k, v):
            return jattn.ring_flex_attention(q, k, v, mask_mod=mask_mod, axis_name="seq",
                                             layout=layout, block_mask=block_mask)

        q = jnp.ones((1, 1, L, E))
        return jax.shard_map(local, mesh=_mesh(4), in_specs=(SEQ,) * 3, out_specs=SEQ)(q, q, q)

    causal = jattn.masks.causal_mask
    with pytest.raises(ValueError, match="mask_mod or block_mask, not both"):
        call(_block_mask(causal), causal)
    with pytest.raises(ValueError, match=r"whole sequence, .* \(1\|1, 1\|1, 256, 256\) over "
                                         r"4 shards of 64; it has shape \(1, 1, 64, 64\)"):
        call(jattn.create_block_mask(causal, None, None, 64, 64, block_size=16))
    with pytest.raises(ValueError, match=r"blocks \(64, 64\) must tile each zigzag chunk of "
                                         r"32 positions"):
        call(jattn.create_block_mask(causal, None, None, L, L, block_size=64), layout="zigzag")


def test_one_device_mesh_equals_flex_attention_bitwise():
    rng = np.random.default_rng(3)
    q, k, v = (random(rng, (1, 2, L, E), jnp.float32) for _ in range(3))
    out, lse, launched = _ring(1, _documents, _alibi_softcap, "contiguous")(q, k, v)
    ref_out, ref_lse = jax.jit(functools.partial(
        jattn.flex_attention, score_mod=_alibi_softcap, block_mask=_block_mask(_documents),
        return_lse=True, implementation="xla"))(q, k, v)
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_array_equal(lse, ref_lse)
    assert launched.tolist() == [1]

"""Attention sinks: a per-head logit in every row's softmax denominator, against a float64
reference that softmaxes over the scores and the sink as one more column, forward and
gradients (the sinks' included), in flex_attention, flex_decode and across devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jattn
from jattn._src.attention.reference import element_mask
from tests.helpers import (assert_close, assert_gradients_close, golden, low_precision,
                           random)

B, Hq, Hkv, L, S, E = 2, 4, 2, 48, 80, 16


def _tilt(score, b, h, q_idx, kv_idx):
    return score + 0.02 * (kv_idx - q_idx)


def sinks_reference(q, k, v, sinks, score_mod=None, block_mask=None):
    """softmax over [scores, sink] with the sink's column dropped, times v; its LSE."""
    acc = jnp.promote_types(q.dtype, jnp.float32)
    groups = q.shape[1] // k.shape[1]
    k, v = (jnp.repeat(x, groups, axis=1) for x in (k, v))
    s = jnp.einsum("bhle,bhse->bhls", q, k, preferred_element_type=acc) * q.shape[-1] ** -0.5
    if score_mod is not None:
        index = [jnp.arange(n, dtype=jnp.int32).reshape(shape) for n, shape in zip(
            s.shape, [(-1, 1, 1, 1), (1, -1, 1, 1), (1, 1, -1, 1), (1, 1, 1, -1)])]
        s = score_mod(s, *index).astype(acc)
    if block_mask is not None:
        s = jnp.where(element_mask(block_mask, *q.shape[:2]), s, -jnp.inf)
    sink = jnp.broadcast_to(sinks.astype(acc)[None, :, None, None], (*s.shape[:3], 1))
    lse = jax.nn.logsumexp(jnp.concatenate([s, sink], axis=-1), axis=-1)
    p = jnp.exp(s - lse[..., None])
    out = jnp.einsum("bhls,bhse->bhle", p.astype(v.dtype), v, preferred_element_type=acc)
    return out.astype(q.dtype), lse


def _inputs(seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = random(rng, (B, Hq, L, E), dtype)
    k, v = (random(rng, (B, Hkv, S, E), dtype) for _ in range(2))
    sinks = jnp.asarray(rng.normal(size=Hq) * 2, jnp.float32)
    return rng, q, k, v, sinks


# a window that leaves the first rows' blocks without keys: those rows are the sink alone
def _late_window(b, h, q_idx, kv_idx):
    return (kv_idx >= q_idx + 20) & (kv_idx < q_idx + 40)


def test_a_row_without_keys_gives_zero_and_the_sink_as_its_lse():
    _, q, k, v, sinks = _inputs(1)
    nothing = jattn.create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx < 0, None, None, L, S,
                                      block_size=16)
    out, lse = jattn.flex_attention(q, k, v, block_mask=nothing, enable_gqa=True,
                                    return_lse=True, sinks=sinks)
    np.testing.assert_array_equal(out, 0)
    np.testing.assert_array_equal(lse, jnp.broadcast_to(sinks[:, None], lse.shape))


def test_low_precision_inputs_keep_their_dtype():
    rng, q, k, v, sinks = _inputs(2, jnp.bfloat16)
    out = jax.jit(lambda q, k, v, s: jattn.flex_attention(q, k, v, enable_gqa=True, sinks=s))(
        q, k, v, sinks)
    gold = golden(lambda *x: sinks_reference(*x)[0], q, k, v, sinks)
    low = sinks_reference(q, k, v, sinks)[0]
    assert out.dtype == jnp.bfloat16
    assert_close(out, gold, low)


@pytest.mark.parametrize("impl", ["interpret"])
def test_decoding_equals_flex_attention_over_each_sequences_keys(impl):
    _, _, k, v, sinks = _inputs(3)
    q = random(np.random.default_rng(4), (B, Hq, 2, E), jnp.float32)
    lengths = jnp.asarray([S, 37], jnp.int32)
    out, lse = jattn.flex_decode(q, k, v, kv_len=lengths, return_lse=True, sinks=sinks,
                                 implementation=impl)
    for b, n in enumerate(np.asarray(lengths)):
        whole, whole_lse = jattn.flex_attention(  # every query reads the first n keys
            q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], enable_gqa=True,
            return_lse=True, sinks=sinks)
        np.testing.assert_allclose(out[b:b + 1], whole, rtol=2e-6, atol=2e-6)
        np.testing.assert_allclose(lse[b:b + 1], whole_lse, rtol=2e-6, atol=2e-6)


def test_across_devices_the_sink_counts_once_and_its_gradient_is_summed_once():
    rng = np.random.default_rng(5)
    q, k, v = (random(rng, (1, Hq, 64, E), jnp.float32) for _ in range(3))
    sinks = jnp.asarray(rng.normal(size=Hq), jnp.float32)
    mesh = Mesh(np.array(jax.devices("cpu")[:4]).reshape(2, 2), ("model", "seq"))
    causal = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 64, 64,
                                     block_size=16)

    def ours(q, k, v, sinks):
        return jattn.sharded_flex_attention(q, k, v, mask_mod=jattn.masks.causal_mask,
                                            mesh=mesh, head_axis="model", sequence_axis="seq",
                                            block_size=16, implementation="xla", sinks=sinks)

    def reference(q, k, v, sinks):
        return sinks_reference(q, k, v, sinks, block_mask=causal)[0]

    assert_gradients_close(ours, reference, (q, k, v, sinks),
                           random(rng, q.shape, jnp.float32), "qkvs")


def test_bad_sinks_name_the_argument():
    _, q, k, v, _ = _inputs(6)
    with pytest.raises(ValueError, match=r"`sinks` must hold one logit per query head, shape "
                                         r"\(4,\); got \(2,\)"):
        jattn.flex_attention(q, k, v, enable_gqa=True, sinks=jnp.zeros(2))
    with pytest.raises(TypeError, match="`sinks` must be floating point"):
        jattn.flex_decode(q[:, :, :1], k, v, sinks=jnp.zeros(Hq, jnp.int32))


class SinksBackendTests:
    """What every `flex_attention` backend must do with sinks: each backend's class below names it,
    and a new backend is one more class."""

    implementation: str

    def skip_in_the_interpreter(self):
        """Wide matrices run on the compiled backends; the interpreter (slow on the CPU) runs
        a representative subset in the other tests."""
        if self.implementation == "interpret":
            pytest.skip("a wide matrix: compiled backends only")

    # The sinks apply to any implementation's (out, lse), composed outside the kernels: xla and
    # the compiled kernels here (the interpreter adds only time), xla across devices below.
    def test_output_lse_and_gradients_match_a_softmax_with_the_sink_as_a_column(self):
        self.skip_in_the_interpreter()
        impl = self.implementation
        rng, q, k, v, sinks = _inputs(0)
        mask = jattn.create_block_mask(_late_window, None, None, L, S, block_size=16)

        def ours(q, k, v, sinks):
            return jattn.flex_attention(q, k, v, _tilt, mask, enable_gqa=True, return_lse=True,
                                        implementation=impl, sinks=sinks)

        def reference(q, k, v, sinks):
            return sinks_reference(q, k, v, sinks, _tilt, mask)

        out, lse = jax.jit(ours)(q, k, v, sinks)
        gold_out, gold_lse = golden(reference, q, k, v, sinks)
        low_out, low_lse = low_precision(reference, q, k, v, sinks)
        assert_close(out, gold_out, low_out, what="out")
        assert_close(lse, gold_lse, low_lse, what="lse")
        cotangent = (random(rng, out.shape, out.dtype), random(rng, lse.shape, jnp.float32))
        assert_gradients_close(ours, reference, (q, k, v, sinks), cotangent, "qkvs")


class TestXla(SinksBackendTests):
    implementation = "xla"


class TestInterpret(SinksBackendTests):
    implementation = "interpret"


@pytest.mark.gpu
class TestPallasTriton(SinksBackendTests):
    implementation = "pallas_triton"

"""Forward-mode differentiation of flex_attention: jax.jvp and jax.jacfwd against the float64
reference's JVP (tangents of q, k, v and a learnable table), with jax.grad still running the
backward's kernels, and both under vmap in either order."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src.attention.reference import attention_reference
from tests.helpers import assert_close, golden, low_precision, map_reference, random

B, Hq, Hkv, L, S, E = 1, 4, 2, 40, 72, 16  # GQA; lengths not multiples of the blocks


def _mods(table):
    """A score_mod reading a learnable [Hq, S] table, and a sliding-window BlockMask."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, kv_idx]

    window = jattn.create_block_mask(lambda b, h, q_idx, kv_idx: jnp.abs(q_idx - kv_idx) < 24,
                                     None, None, L, S, block_size=16)
    return score_mod, window


def _attention(impl):
    def attention(q, k, v, table):
        score_mod, window = _mods(table)
        return jattn.flex_attention(q, k, v, score_mod, window, enable_gqa=True,
                                    return_lse=True, implementation=impl)
    return attention


def _reference(q, k, v, table):
    score_mod, window = _mods(table)
    return attention_reference(q, k, v, score_mod, window)


def _inputs(seed):
    rng = np.random.default_rng(seed)
    q = random(rng, (B, Hq, L, E))
    k, v = (random(rng, (B, Hkv, S, E)) for _ in range(2))
    table = random(rng, (Hq, S), scale=0.3)
    tangents = tuple(random(rng, x.shape) for x in (q, k, v, table))
    return rng, (q, k, v, table), tangents


def test_jvp_of_some_inputs_only_and_of_an_integer_capture():
    """Tangents of k alone; a score_mod that also reads an int array (no tangent)."""
    _, (q, k, v, table), (_, dk, _, _) = _inputs(1)
    shift = jnp.arange(S, dtype=jnp.int32) % 3

    def attention(k):
        return jattn.flex_attention(q, k, v, lambda s, b, h, qi, ki: s + 0.1 * shift[ki],
                                    enable_gqa=True)

    def reference(k):
        return attention_reference(q, k, v, lambda s, b, h, qi, ki: s + 0.1 * shift[ki])[0]

    got = jax.jvp(attention, (k,), (dk,))[1]
    gold = golden(lambda k, dk: jax.jvp(reference, (k,), (dk,))[1], k, dk)
    assert_close(got, gold, jax.jvp(reference, (k,), (dk,))[1], what="out tangent")


def test_jacfwd_equals_jacrev():
    _, (q, k, v, table), _ = _inputs(2)

    def rows(table):  # a few outputs, as a function of the table
        return _attention("xla")(q, k, v, table)[0][0, :, :3].astype(jnp.float32)

    forward, reverse = jax.jacfwd(rows)(table), jax.jacrev(rows)(table)
    np.testing.assert_allclose(forward, reverse, rtol=1e-4, atol=1e-5)


def test_grad_runs_the_forward_and_backward_kernels():
    """jax.grad transposes the tangents into the backward's kernels: the interpreter's program
    holds its forward kernel and its dQ and dK/dV kernels, each as often as the others."""
    _, args, tangents = _inputs(3)
    attention = _attention("interpret")

    def loss(*args):
        return jnp.vdot(attention(*args)[0], tangents[0])

    text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args))
    seen = {kernel: len(re.findall(rf"\b{kernel}\b", text))
            for kernel in ("jattn_flex_fwd", "jattn_flex_bwd_dq", "jattn_flex_bwd_dkdv")}
    assert min(seen.values()) > 0 and len(set(seen.values())) == 1, seen


def test_vmap_of_grad_and_grad_of_vmap_equal_the_reference():
    rng, (q, k, v, table), (cotangent, *_) = _inputs(4)
    qs = jnp.stack([q, random(rng, q.shape)])

    def loss(attention):
        return lambda q, k, v, table: jnp.vdot(attention(q, k, v, table)[0], cotangent)

    grads = jax.vmap(jax.grad(loss(_attention("xla")), argnums=(0, 3)),
                     (0, None, None, None))(qs, k, v, table)
    summed = jax.grad(lambda qs, table: jax.vmap(
        lambda q: loss(_attention("xla"))(q, k, v, table))(qs).sum(), argnums=(0, 1))(qs, table)
    expected = jax.vmap(jax.grad(loss(_reference), argnums=(0, 3)),
                        (0, None, None, None))(qs, k, v, table)
    for got in (grads, (summed[0], summed[1][None])):
        np.testing.assert_allclose(got[0], expected[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got[1].sum(0), expected[1].sum(0), rtol=1e-4, atol=1e-5)


def test_second_derivatives_on_xla_equal_the_references():
    """jax.hessian (forward over reverse) of a loss through the xla implementation, whose
    backward is differentiable, in q and a learnable table."""
    rng = np.random.default_rng(5)
    q = random(rng, (1, 2, 12, 4))
    table = random(rng, (2, 12), scale=0.3)

    def loss(attention):
        return lambda q, table: (attention(q, q, q, lambda s, b, h, i, j: s + table[h, j])
                                 ** 2).sum()

    def flex(q, k, v, score_mod):
        return jattn.flex_attention(q, k, v, score_mod, implementation="xla")

    def reference(q, k, v, score_mod):
        return attention_reference(q, k, v, score_mod)[0]

    got = jax.hessian(loss(flex), (0, 1))(q, table)
    expected = jax.hessian(loss(reference), (0, 1))
    for x, g, r in zip(jax.tree.leaves(got), jax.tree.leaves(golden(expected, q, table)),
                       jax.tree.leaves(low_precision(expected, q, table))):
        assert_close(x, g, r, what="hessian")


@pytest.mark.parametrize("order", ["hessian", "grad of grad"])
def test_second_derivatives_on_a_kernel_implementation_name_the_fix(order):
    q = random(np.random.default_rng(6), (1, 2, 16, 8))
    table = jnp.ones(2)

    def loss(table):
        return (jattn.flex_attention(q, q, q, lambda s, b, h, i, j: s + table[h] * (j - i),
                                     implementation="interpret") ** 2).sum()

    twice = (jax.hessian(loss) if order == "hessian"
             else jax.grad(lambda t: jax.grad(loss)(t).sum()))
    with pytest.raises(NotImplementedError, match="second derivatives .* implementation='xla'"):
        twice(table)


class ForwardModeBackendTests:
    """What every `flex_attention` backend must do in forward mode: each backend's class below
    names it, and a new backend is one more class."""

    implementation: str

    def test_jvp_of_output_and_lse_equals_the_references(self):
        impl = self.implementation
        _, args, tangents = _inputs(0)
        got = jax.jit(lambda a, t: jax.jvp(_attention(impl), a, t))(args, tangents)

        def reference_jvp(*at):
            return jax.jvp(_reference, at[:4], at[4:])

        gold = golden(reference_jvp, *args, *tangents)
        low = low_precision(reference_jvp, *args, *tangents)
        for name, x, g, r in zip(["out", "lse", "out tangent", "lse tangent"],
                                 jax.tree.leaves(got), jax.tree.leaves(gold), jax.tree.leaves(low)):
            assert_close(x, g, r, what=name)

    @pytest.mark.parametrize("moving", ["qkv", "q", "kv"])
    def test_tangent_kernel_equals_the_references(self, moving):
        """No captured array moves, so the kernel implementations take the tangents in their own
        kernel (`pallas_triton_jvp`): a softcap over a fixed table's bias (the mod's derivative
        in the kernel), the window's partial and full blocks, GQA, ragged lengths, and a row that
        attends to nothing (its tangents zero)."""
        impl = self.implementation
        _, (q, k, v, table), tangents = _inputs(6)

        def score_mod(score, b, h, q_idx, kv_idx):
            return 8.0 * jnp.tanh((score + table[h, kv_idx]) / 8.0)

        def window(b, h, q_idx, kv_idx):  # row 5 attends to nothing
            return (jnp.abs(q_idx - kv_idx) < 24) & (q_idx != 5)

        block_mask = jattn.create_block_mask(window, None, None, L, S, block_size=16)
        which = ["qkv".index(name) for name in moving]

        def call(attention):  # (inputs as arguments: low_precision cuts them to TF32 on GPUs)
            def jvp(q, k, v, *moving_tangents):
                def f(*moved):
                    args = [q, k, v]
                    for i, x in zip(which, moved):
                        args[i] = x
                    return attention(*args, score_mod, block_mask)
                return jax.jvp(f, tuple((q, k, v)[i] for i in which), moving_tangents)
            return jvp

        inputs = (q, k, v, *(tangents[i] for i in which))
        ours = call(lambda *a: jattn.flex_attention(*a, enable_gqa=True, return_lse=True,
                                                    implementation=impl))
        got = jax.jit(ours)(*inputs)
        if impl != "xla":
            assert "jattn_flex_jvp" in str(jax.make_jaxpr(ours)(*inputs))
        reference = call(attention_reference)
        gold, low = golden(reference, *inputs), low_precision(reference, *inputs)
        attended = np.arange(L) != 5  # (row 5's LSE is -inf, its tangents zero)
        for name, x, g, r in zip(["out", "lse", "out tangent", "lse tangent"],
                                 jax.tree.leaves(got), jax.tree.leaves(gold), jax.tree.leaves(low)):
            assert_close(x[:, :, attended], g[:, :, attended],
                         map_reference(lambda y: y[:, :, attended], r), what=name)
        for tangent in got[1]:
            assert np.all(np.asarray(tangent)[:, :, 5] == 0)


class TestXla(ForwardModeBackendTests):
    implementation = "xla"


class TestInterpret(ForwardModeBackendTests):
    implementation = "interpret"


@pytest.mark.gpu
class TestPallasTriton(ForwardModeBackendTests):
    implementation = "pallas_triton"

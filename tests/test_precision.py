"""`precision=`: full float32 products when asked, in the kernels and XLA alike, backward too."""

import jax
import numpy as np
import pytest

import jattn
from tests.helpers import random

L, E = 200, 64


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    return [random(rng, (1, 4, L, E)) for _ in range(3)]


def _max_error(x, golden):
    return float(np.max(np.abs(np.asarray(x, np.float64) - golden)))


def test_bad_precision_names_the_argument():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="flex_attention: `precision`='fp32' is not one of"):
        jattn.flex_attention(q, k, v, precision="fp32")
    with pytest.raises(ValueError, match="matmul: `precision`=3 is not one of"):
        jattn.matmul(q[0, 0], k[0, 0].T, precision=3)


@pytest.mark.gpu
def test_highest_gives_float32_products_on_the_gpu():
    q, k, v = _inputs(1)
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    scores = np.einsum("bhle,bhse->bhls", q64, k64) / np.sqrt(E)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    golden = np.einsum("bhls,bhse->bhle", weights / weights.sum(-1, keepdims=True), v64)
    errors = {}
    for precision in (None, "highest"):
        errors[precision] = _max_error(jattn.flex_attention(
            q, k, v, precision=precision, implementation="pallas_triton"), golden)
        decode = jattn.flex_decode(q[:, :, -1:], k, v, precision=precision,
                                   implementation="pallas_triton")
        assert _max_error(decode, golden[:, :, -1:]) <= 10 * errors[precision] + 1e-6
    assert errors["highest"] < 2e-6 < errors[None]  # TF32 (10-bit mantissa) by default

    a, b = q[0, 0], k[0, 0].T
    golden = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    tf32, full = (_max_error(jattn.matmul(a, b, precision=p, implementation="pallas_triton"),
                             golden) for p in (None, "highest"))
    assert full < 1e-4 < tf32

    def loss(q, precision):
        return jattn.flex_attention(q, k, v, precision=precision,
                                    implementation="pallas_triton").sum()

    golden_grad = jax.grad(loss)(q, None)  # only to show the backward differs as well
    grad = jax.grad(loss)(q, "highest")
    expected = jax.grad(lambda q: jattn.flex_attention(q, k, v, implementation="xla",
                                                       precision="highest").sum())(q)
    assert _max_error(grad, np.asarray(expected, np.float64)) < _max_error(
        golden_grad, np.asarray(expected, np.float64))


class PrecisionBackendTests:
    """What every backend of every op must do with `precision`: each backend's class below names
    it, and a new backend is one more class."""

    implementation: str

    def test_every_op_takes_precision(self):
        impl = self.implementation
        q, k, v = _inputs()
        for precision in ("tensorfloat32", jax.lax.Precision.HIGHEST):  # a name, an enum
            jattn.flex_attention(q, k, v, precision=precision, implementation=impl)
            jattn.flex_decode(q[:, :, :2], k, v, precision=precision, implementation=impl)
            jattn.matmul(q[0, 0], k[0, 0].T, precision=precision, implementation=impl)
            jattn.mm_plus_mm(q[0, 0], k[0, 0].T, v[0, 0], q[0, 0].T, precision=precision,
                             implementation=impl)
            jattn.b2b_matmul(q[0, 0], k[0, 0].T, v[0, 0], precision=precision,
                             implementation=impl)


class TestXla(PrecisionBackendTests):
    implementation = "xla"


class TestInterpret(PrecisionBackendTests):
    implementation = "interpret"


@pytest.mark.gpu
class TestPallasTriton(PrecisionBackendTests):
    implementation = "pallas_triton"

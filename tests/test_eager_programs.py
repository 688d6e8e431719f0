"""Eager calls reuse compiled programs, and the reuse never gives a stale result."""

import resource
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src import user_functions
from jattn._src.attention import xla as attention_xla
from jattn._src.hardware import has_cuda
from tests.helpers import random

L, E = 256, 16


@pytest.fixture
def compiles():
    """A list that gains an entry for every XLA compilation while the test runs."""
    seen = []

    def listener(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield seen
    jax.monitoring.unregister_event_duration_listener(listener)


@pytest.fixture
def kernel_traces(monkeypatch):
    """Counts traces of the XLA attention forward (once per program made)."""
    calls = []
    forward = attention_xla.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    monkeypatch.setattr(attention_xla, "forward", counted)
    return calls


def _inputs(seed=0, B=1, H=2):
    rng = np.random.default_rng(seed)
    return [random(rng, (B, H, L, E)) for _ in range(3)]


def test_second_eager_call_neither_traces_nor_compiles(compiles, kernel_traces):
    q, k, v = _inputs()
    mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, L, block_size=64)
    bias = jnp.arange(2.0)

    def call(q):
        return jattn.flex_attention(q, k, v, lambda s, b, h, qi, ki: s + bias[h], mask,
                                    implementation="xla")

    call(q).block_until_ready()
    traced, compiled = len(kernel_traces), len(compiles)
    assert traced == 1 and compiled >= 1
    for seed in range(3):  # a fresh closure of the same computation, new q values
        call(_inputs(seed + 1)[0]).block_until_ready()
    assert (len(kernel_traces), len(compiles)) == (traced, compiled)


def test_captured_arrays_are_read_on_every_call(kernel_traces):
    q, k, v = _inputs()
    table = jnp.zeros((2,))

    def mod(s, b, h, qi, ki):
        return s + table[h] * (qi - ki)

    outputs = []
    for step in range(3):
        table = jnp.full((2,), 0.1 * step)  # rebinds the global the mod reads
        outputs.append(jattn.flex_attention(q, k, v, mod, implementation="xla"))
        expected = jattn.flex_attention(q, k, v, lambda s, b, h, qi, ki: s + 0.1 * step * (
            qi - ki), implementation="xla")
        np.testing.assert_allclose(outputs[-1], expected, rtol=1e-5, atol=1e-5)
    assert not np.allclose(outputs[0], outputs[2])
    # One program for `mod` (its table is an argument), one per scalar baked into `expected`.
    assert len(kernel_traces) == 1 + 3


def test_a_changed_python_scalar_is_never_stale():
    q, k, v = _inputs()
    cap = 30.0

    def softcap(s, b, h, qi, ki):
        return cap * jnp.tanh(s / cap)

    first = jattn.flex_attention(q, k, v, softcap, implementation="xla")
    cap = 0.5
    second = jattn.flex_attention(q, k, v, softcap, implementation="xla")
    expected = jattn.flex_attention(q, k, v, lambda s, *_: 0.5 * jnp.tanh(s / 0.5),
                                    implementation="xla")
    np.testing.assert_array_equal(second, expected)
    assert not np.allclose(first, second)


def test_eager_gradients_reuse_their_program(compiles):
    q, k, v = _inputs()
    bias, other_bias = (jnp.asarray(np.full(2, x, np.float32)) for x in (1.0, 2.0))
    grad = jax.grad(lambda q, bias: jattn.flex_attention(
        q, k, v, lambda s, b, h, qi, ki: s * bias[h]).sum(), argnums=(0, 1))
    first = grad(q, bias)
    compiled = len(compiles)
    second = grad(q, other_bias)
    assert len(compiles) == compiled
    assert not np.allclose(first[1], second[1])


def test_decode_and_matmul_eager_calls_reuse_programs(compiles):
    rng = np.random.default_rng(0)
    q, k, v = (random(rng, (2, 4, n, E)) for n in (1, L, L))
    a, b = random(rng, (64, 32)), random(rng, (32, 48))
    for _ in range(2):  # (jax 0.11's first Pallas interpreter call changes its trace context)
        for implementation in ("xla", "interpret"):
            jattn.flex_decode(q, k, v, kv_len=jnp.array([100, 200]),
                              implementation=implementation)
            jattn.matmul(a, b, implementation=implementation)
    compiled = len(compiles)
    for implementation in ("xla", "interpret"):
        out = jattn.flex_decode(q, k, v, kv_len=jnp.array([10, 20]),
                                implementation=implementation)
        jattn.matmul(a, b, implementation=implementation)
    assert len(compiles) == compiled
    expected = jattn.flex_attention(q, k[:, :, :10], v[:, :, :10], implementation="xla")
    tolerance = 5e-3 if has_cuda() else 2e-5  # float32 products are TF32 on the GPU
    np.testing.assert_allclose(out[:1], expected[:1], rtol=tolerance, atol=tolerance)


def test_eager_decode_with_mods_neither_traces_nor_compiles_again(compiles, monkeypatch):
    """flex_decode on xla wraps the user's score_mod in jattn's own closures (its clear
    errors, the decode positions): they are recorded as a plain closure is, so the second
    call with new lengths and a new bias reuses the plan, tracing nothing."""
    mod_traces = []
    trace = user_functions.CaptureSet.trace
    monkeypatch.setattr(user_functions.CaptureSet, "trace", lambda self, fn, signature: (
        mod_traces.append(fn), trace(self, fn, signature))[1])
    rng = np.random.default_rng(1)
    q, k, v = (random(rng, (2, 4, n, E)) for n in (1, L, L))

    def call(bias, lengths):
        return jattn.flex_decode(q, k, v, lambda s, b, h, qi, ki: s + bias[h],
                                 kv_len=lengths, implementation="xla")

    bias, lengths = jnp.arange(4.0), jnp.array([10, 20])
    call(jnp.zeros(4), jnp.array([100, 200])).block_until_ready()
    traced, compiled = len(mod_traces), len(compiles)
    out = call(bias, lengths)
    assert (len(mod_traces), len(compiles)) == (traced, compiled)
    expected = jattn.flex_attention(q, k[:, :, :10], v[:, :, :10],
                                    lambda s, b, h, qi, ki: s + bias[h], implementation="xla")
    np.testing.assert_allclose(out[:1], expected[:1], rtol=2e-5, atol=2e-5)


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_memory_stays_flat_over_many_eager_calls():
    q, k, v = _inputs()
    mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, L, block_size=64)

    def step(i):
        offset = jnp.float32(i)  # a new captured array every step
        return jattn.flex_attention(q, k, v, lambda s, b, h, qi, ki: s + offset * 0, mask,
                                    implementation="xla").block_until_ready()

    for i in range(200):
        step(i)
    before = _rss_mib()
    for i in range(1500):
        step(i)
    assert _rss_mib() - before < 30  # it grew 2.2 MB a call when each call compiled


def test_programs_evicted_from_the_cache_are_freed(monkeypatch):
    """A Python scalar changing every call (a schedule) makes a program per value; those the
    bounded cache drops must not stay alive in JAX's trace caches."""
    import gc

    from jattn._src.attention import api
    from jattn._src.attention.common import Problem
    monkeypatch.setattr(api._PROGRAMS, "_maxsize", 4)
    monkeypatch.setattr(api._PLANS, "_maxsize", 4)
    def alive():
        gc.collect()
        return sum(type(x) is Problem for x in gc.get_objects())

    q, k, v = _inputs()
    before = alive()  # (other tests' problems, in other caches)
    for step in range(12):
        temperature = 1.0 + step / 8
        jattn.flex_attention(q, k, v, lambda s, b, h, qi, ki: s / temperature,
                             implementation="xla")
    assert alive() - before <= 4


def test_first_calls_from_two_threads():
    q, k, v = _inputs(5)
    scale = jnp.asarray(np.float32(0.7))
    results = [None, None]

    def call(i):
        results[i] = jattn.flex_attention(q, k, v, lambda s, *_: s * scale + i * 0,
                                          implementation="xla")

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    expected = jattn.flex_attention(q, k, v, lambda s, *_: s * 0.7, implementation="xla")
    for result in results:
        np.testing.assert_allclose(result, expected, rtol=1e-6, atol=1e-6)


def test_the_torch_ops_backward_reuses_the_forwards_program(monkeypatch):
    """The bridge's backward finds the program its forward made (no second specialisation),
    and returns the captured arrays' gradients in the caller's order."""
    from jattn._src import bridge

    made = []
    specialise = attention_xla.specialise
    monkeypatch.setattr(attention_xla, "specialise", lambda p, **kw: made.append(p) or
                        specialise(p, **kw))
    q, k, v = _inputs(6)
    scale, shift = jnp.asarray(np.float32(0.5)), jnp.asarray(np.float32(0.25))

    def mod(s, b, h, qi, ki):
        return s * scale + shift  # reads shift first by position in `captures` below

    captures = (shift, scale)
    out, lse = bridge.flex_attention(q, k, v, mod, score_captures=captures, return_lse=True,
                                     implementation="xla")
    d_out = jnp.ones_like(out)
    *_, d_captures = bridge.flex_attention_backward(
        q, k, v, out, lse, d_out, jnp.zeros_like(lse), mod, score_captures=captures,
        implementation="xla")
    assert len(made) == 1
    expected = jax.grad(lambda shift, scale: jattn.flex_attention(
        q, k, v, lambda s, *_: s * scale + shift, implementation="xla").sum(),
        argnums=(0, 1))(shift, scale)
    np.testing.assert_allclose(d_captures[0], expected[0], atol=1e-4)
    np.testing.assert_allclose(d_captures[1], expected[1], rtol=1e-4, atol=1e-4)

"""Guards: what a mod reads, recorded so that equal records compute the same thing. Every
kind of state a user changes between calls changes the record (or leaves none); eager calls
skip tracing only when it is equal, and stay correct when state changes."""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src import guards, user_functions

SCALE = 2.0


def _global_mod(s, b, h, q_idx, kv_idx):
    return s * SCALE


def _closure(value):
    return lambda s, b, h, q_idx, kv_idx: s * value


def _record(fn):
    return guards.read_state(fn).record


def test_equal_state_gives_equal_records_and_collects_arrays():
    table = jnp.ones(4)
    first, second = (lambda s, b, h, q, kv: s + table[h] for _ in range(2))
    assert _record(first) == _record(second) is not None
    assert guards.read_state(first).arrays[0] is table
    # a new array of the same shape: the same record; another shape or code: another one
    assert _record(_closure(jnp.zeros(4))) == _record(_closure(jnp.ones(4)))
    assert _record(_closure(jnp.ones(5))) != _record(_closure(jnp.ones(4)))
    assert _record(lambda s, b, h, q, kv: s * table[h]) != _record(first)


@pytest.mark.parametrize("change", ["closure", "global", "default", "partial", "method",
                                    "module attribute", "submodule attribute", "dict entry",
                                    "-0.0", "class attribute", "function attribute",
                                    "dataclass class value"])
def test_every_kind_of_changed_value_changes_the_record(change):
    global SCALE
    module, package = types.ModuleType("user_config"), types.ModuleType("user_package")
    module.CAP, package.config = 1.0, module
    namespace = {"config": module, "package": package, "jnp": jnp}
    exec("def reads_module(s, b, h, q_idx, kv_idx):\n    return s * config.CAP\n"
         "def reads_submodule(s, b, h, q_idx, kv_idx):\n    return s * package.config.CAP",
         namespace)

    class Settings:
        FACTOR = 1.0

    def reads_itself(s, b, h, q_idx, kv_idx):
        return s * reads_itself.factor

    @dataclasses.dataclass
    class Scaler:
        factor: float
        OFFSET = 0.0  # a class value its methods read

        def apply(self, s, b, h, q_idx, kv_idx):
            return s * self.factor + self.OFFSET

    state = {"factor": 1.0}
    makers = {
        "closure": lambda x: _closure(x),
        "global": lambda x: _global_mod,
        "default": lambda x: (lambda s, b, h, q, kv, f=x: s * f),
        "partial": lambda x: functools.partial(lambda s, b, h, q, kv, f: s * f, f=x),
        "method": lambda x: Scaler(x).apply,
        "module attribute": lambda x: namespace["reads_module"],
        "submodule attribute": lambda x: namespace["reads_submodule"],
        "dict entry": lambda x: (lambda s, b, h, q, kv: s * state["factor"]),
        "-0.0": lambda x: _closure(x),
        "class attribute": lambda x: (lambda s, b, h, q, kv: s * Settings.FACTOR),
        "function attribute": lambda x: reads_itself,
        "dataclass class value": lambda x: Scaler(1.0).apply,
    }
    values = (0.0, -0.0) if change == "-0.0" else (1.0, 3.0)
    records = []
    for value in values:
        SCALE, module.CAP, state["factor"] = value, value, value
        Settings.FACTOR = reads_itself.factor = Scaler.OFFSET = value
        records.append(_record(makers[change](value)))
    SCALE = 2.0
    assert None not in records and records[0] != records[1]


def test_objects_of_unknown_structure_leave_no_record():
    class Holder:
        scale = 2.0

    holder = Holder()
    assert _record(lambda s, b, h, q, kv: s * holder.scale) is None
    huge = list(range(guards.MAX_VALUES + 1))
    assert _record(lambda s, b, h, q, kv: s + huge[0]) is None


def test_library_mods_are_pytrees_recorded_by_their_arrays():
    mask = jattn.masks.and_masks(jattn.masks.causal_mask,
                                 jattn.masks.document_mask(jnp.zeros(8, jnp.int32)))
    state = guards.read_state(mask)
    assert state.record is not None and len(state.arrays) == 1
    again = jattn.masks.and_masks(jattn.masks.causal_mask,
                                  jattn.masks.document_mask(jnp.ones(8, jnp.int32)))
    assert _record(again) == state.record
    window = jattn.masks.sliding_window(4)
    assert _record(window) != _record(jattn.masks.sliding_window(5))


def test_numpy_arrays_map_to_their_trace_constants():
    ids = np.arange(8, dtype=np.int32)

    def mod(b, h, q_idx, kv_idx):
        return jnp.asarray(ids)[q_idx] == kv_idx

    state = guards.read_state(mod)
    closed = jax.make_jaxpr(mod)(*[jax.ShapeDtypeStruct((1,), jnp.int32)] * 4)
    assert guards.sources_of(list(closed.consts), state.arrays) == (("array", 0),)


# ---- eager calls ---------------------------------------------------------------------------

@pytest.fixture
def traces(monkeypatch):
    """Counts user-function traces (the slow path)."""
    seen = []
    trace = user_functions.CaptureSet.trace

    def counted(self, fn, signature):
        seen.append(fn)
        return trace(self, fn, signature)

    monkeypatch.setattr(user_functions.CaptureSet, "trace", counted)
    return seen


def _qkv():
    rng = np.random.default_rng(0)
    return [jnp.asarray(rng.standard_normal((1, 2, 64, 16)), jnp.float32) for _ in range(3)]


def test_a_warm_eager_call_traces_nothing_and_reads_new_arrays(traces):
    q, k, v = _qkv()
    expected = [jattn.flex_attention(q, k, v, lambda s, b, h, qi, ki: s + step * ki,
                                     implementation="xla") for step in range(3)]
    for step in range(3):
        bias = jnp.full((2,), float(step))  # a fresh closure over a new array
        if step == 1:
            traced = len(traces)
        out = jattn.flex_attention(q, k, v, lambda s, b, h, qi, ki: s + bias[h] * ki,
                                   implementation="xla")
        np.testing.assert_allclose(out, expected[step], rtol=1e-6, atol=1e-6)
    assert len(traces) == traced


def test_unrecordable_and_edited_state_is_never_stale():
    q, k, v = _qkv()

    class Config:
        cap = 30.0

    config = Config()
    ids = np.zeros(64, np.int32)

    def mod(s, b, h, qi, ki):
        return config.cap * jnp.tanh(s / config.cap) + jnp.asarray(ids)[ki]

    outputs = []
    for cap in (30.0, 0.5):
        config.cap = cap
        ids[:] = int(cap)  # edited in place
        outputs.append(jattn.flex_attention(q, k, v, mod, implementation="xla"))
        expected = jattn.flex_attention(
            q, k, v, lambda s, *_: cap * jnp.tanh(s / cap) + int(cap), implementation="xla")
        np.testing.assert_allclose(outputs[-1], expected, rtol=1e-5, atol=1e-5)
    assert not np.allclose(outputs[0], outputs[1])


def test_one_array_under_two_names_then_two_arrays_reads_both():
    """Two parameters made from one zeros array: the first call reads one array twice."""
    q, k, v = _qkv()

    def call(a, c):
        return jattn.flex_attention(q, k, v, lambda s, b, h, qi, ki: s + (3 * a[h] - 2 * c[h]) * ki,
                                    implementation="xla")

    zeros = jnp.zeros(2)
    call(zeros, zeros)
    a, c = jnp.array([1.0, -2.0]), jnp.array([4.0, 0.5])
    expected = jattn.flex_attention(q, k, v, lambda s, b, h, qi, ki: s + jnp.array(
        [-5.0, -7.0])[h] * ki, implementation="xla")
    np.testing.assert_allclose(call(a, c), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("derive", [lambda t: t.T, lambda t: t[1:, :-1], lambda t: t * 2,
                                    lambda t: t[::-1]], ids=["transpose", "slice", "product",
                                                             "reversed"])
def test_what_a_mod_computes_from_numpy_arrays_is_computed_again(derive):
    q, k, v = _qkv()
    rng = np.random.default_rng(2)
    for _ in range(2):
        table = rng.standard_normal((65, 65)).astype(np.float32)
        out = jattn.flex_attention(q, k, v, lambda s, b, h, qi, ki: s + jnp.asarray(
            derive(table))[qi, ki], implementation="xla")
        fixed = jnp.asarray(derive(table))
        expected = jattn.flex_attention(q, k, v, lambda s, b, h, qi, ki: s + fixed[qi, ki],
                                        implementation="xla")
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


TEMPERATURE = np.array([1.0], np.float32)
SOFTCAP = None


def _tempered(s, b, h, q_idx, kv_idx):
    return s / TEMPERATURE[0]  # a NumPy scalar: a constant of the trace


def _maybe_capped(s, b, h, q_idx, kv_idx):
    return s if SOFTCAP is None else SOFTCAP * jnp.tanh(s / SOFTCAP)


def test_values_read_from_numpy_arrays_in_python_are_read_again():
    """Rebinding a global NumPy array or editing it in place changes what the mod computes,
    for flex_attention, a matmul epilogue and create_block_mask."""
    global TEMPERATURE
    q, k, v = _qkv()
    for rebind, value in ((True, 0.25), (False, 4.0)):
        jattn.flex_attention(q, k, v, _tempered, implementation="xla")
        if rebind:
            TEMPERATURE = np.array([value], np.float32)
        else:
            TEMPERATURE[0] = value
        expected = jattn.flex_attention(q, k, v, lambda s, *_: s / value, implementation="xla")
        np.testing.assert_allclose(jattn.flex_attention(q, k, v, _tempered,
                                                        implementation="xla"), expected)
    gain = np.array([1.0], np.float32)
    a, b = q[0, 0], k[0, 0].T
    jattn.matmul(a, b, epilogue=lambda t: t * gain[0], implementation="xla")
    gain[0] = 3.0
    np.testing.assert_allclose(jattn.matmul(a, b, epilogue=lambda t: t * gain[0],
                                            implementation="xla"), 3 * (a @ b), rtol=1e-5)
    window = np.array([16])
    windowed = lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < window[0])  # noqa: E731
    jattn.create_block_mask(windowed, None, None, 256, 256, block_size=16)
    window[0] = 128
    want = jattn.create_block_mask(lambda b, h, i, j: (i >= j) & (i - j < 128), None, None,
                                   256, 256, block_size=16)
    got = jattn.create_block_mask(windowed, None, None, 256, 256, block_size=16)
    np.testing.assert_array_equal(got.kv_num_blocks, want.kv_num_blocks)


def test_a_mod_that_once_returned_its_score_is_applied_when_it_no_longer_does():
    """A module-level mod gated by a global: the check that drops a do-nothing mod must not
    keep its first answer (JAX caches make_jaxpr by the function's identity)."""
    global SOFTCAP
    q, k, v = _qkv()
    SOFTCAP = None
    try:
        for implementation in ("xla", "interpret"):
            jattn.flex_attention(q, k, v, _maybe_capped, implementation=implementation)
        SOFTCAP = 0.5
        expected = jattn.flex_attention(q, k, v, lambda s, *_: 0.5 * jnp.tanh(s / 0.5),
                                        implementation="xla")
        np.testing.assert_allclose(jattn.flex_attention(q, k, v, _maybe_capped,
                                                        implementation="xla"), expected,
                                   rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(jax.jit(lambda q: jattn.flex_attention(
            q, k, v, _maybe_capped, implementation="xla"))(q), expected, rtol=1e-6, atol=1e-6)
    finally:
        SOFTCAP = None


def test_create_block_mask_with_new_ids_each_step_neither_traces_nor_compiles(traces):
    compiles = []

    def listener(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    L, block = 256, 32
    rng = np.random.default_rng(1)
    for step in range(4):
        ids = jnp.asarray(np.sort(rng.integers(0, 4, L)), jnp.int32)
        mask_mod = jattn.masks.and_masks(jattn.masks.causal_mask,
                                         jattn.masks.document_mask(ids))
        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            mask = jattn.create_block_mask(mask_mod, None, None, L, L, block_size=block)
            jax.block_until_ready(mask.kv_indices)
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
        if step == 0:
            first_compiles, first_traces = len(compiles), len(traces)
        per_block = np.asarray(jattn.create_mask(mask_mod, None, None, L, L)).reshape(
            1, 1, L // block, block, L // block, block)
        np.testing.assert_array_equal(mask.full_blocks(), per_block.all(axis=(3, 5)))
        np.testing.assert_array_equal(mask.partial_blocks() | mask.full_blocks(),
                                      per_block.any(axis=(3, 5)))
    assert first_compiles >= 1
    assert (len(compiles), len(traces)) == (first_compiles, first_traces)


WINDOW = 4


def test_a_rebound_global_is_seen_by_create_block_mask():
    """JAX caches traces by function: each plan's trace is of a fresh function."""
    global WINDOW

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)

    try:
        counts = []
        for WINDOW in (4, 40):
            mask = jattn.create_block_mask(window, None, None, 64, 64, block_size=16)
            counts.append(int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()))
    finally:
        WINDOW = 4
    assert counts[0] < counts[1]


def test_values_of_a_trace_are_never_stored():
    """A call inside another function's trace (closing over concrete arrays) leaves nothing
    the next eager call could trip over."""
    q, k, v = _qkv()
    odd = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 64, 64, block_size=24)
    inside = jax.jit(lambda x: jattn.flex_attention(q, k, v, block_mask=odd) + x)(0.0)
    dense = jax.jit(lambda x: jattn.flex_attention(q, k, v) + x)(0.0)
    np.testing.assert_allclose(jattn.flex_attention(q, k, v, block_mask=odd), inside, atol=1e-6)
    np.testing.assert_allclose(jattn.flex_attention(q, k, v), dense, atol=1e-6)


TABLE = jnp.arange(4.0)


def _reads_global_table(s, b, h, q_idx, kv_idx):
    return s + TABLE[h]


def test_with_arrays_substitutes_where_the_walk_found_each_array():
    """Closures, defaults, globals, containers and nested functions take the new arrays in
    read_state's order (an array read twice stays one); arrays it cannot put elsewhere, a
    function reading itself, or a wrong count raise."""
    shared, bias = jnp.ones(4), jnp.full(4, 3.0)

    def outer(s, b, h, q_idx, kv_idx, scale=jnp.array(2.0)):
        return inner(s, h) * scale + shared[h] + {"bias": bias}["bias"][h] + _reads_global_table(
            s, b, h, q_idx, kv_idx)

    def inner(s, h):
        return s * shared[h]

    arrays = guards.read_state(outer).arrays
    assert len(arrays) == 4  # scale, shared (once), bias, TABLE
    new = [a + 1 for a in arrays]
    rebuilt = guards.with_arrays(outer, new)
    args = (jnp.float32(0.5), 0, 2, 0, 0)
    assert guards.read_state(rebuilt).arrays == new
    assert guards.read_state(rebuilt).record == guards.read_state(outer).record
    assert TABLE[0] == 0.0  # the module's global is left as it is
    expected = (0.5 * 2.0) * 3.0 + 2.0 + 4.0 + (0.5 + 3.0)
    np.testing.assert_allclose(rebuilt(*args), expected)

    @dataclasses.dataclass
    class Holder:
        table: jax.Array

    held = Holder(jnp.ones(2))
    with pytest.raises(ValueError, match="Holder"):
        guards.with_arrays(lambda s, b, h, q, kv: s + held.table[h], [jnp.ones(2)])

    def recursive(s, b, h, q_idx, kv_idx, depth=jnp.array(1)):
        return s if depth is None else recursive(s, b, h, q_idx, kv_idx, None)

    with pytest.raises(ValueError, match="reads itself"):
        guards.with_arrays(recursive, [jnp.array(2)])
    with pytest.raises(ValueError, match="too few"):
        guards.with_arrays(outer, new[:3])
    with pytest.raises(ValueError, match="left over"):
        guards.with_arrays(outer, new + [jnp.ones(1)])

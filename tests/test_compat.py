"""The version-dependent JAX and torch APIs jattn reaches through `compat`: each works on the
installed versions, and the jaxpr and mesh-axes helpers also on objects shaped like the other
supported jax versions' (fakes)."""

import contextlib
import inspect
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn._src import compat


def _closed():
    constant = jnp.array([1.0, 2.0, 3.0])
    return jax.make_jaxpr(lambda x: x * constant)(jnp.ones(3)), constant


def test_jaxpr_and_consts_of_a_traced_function_and_of_an_open_jaxpr():
    closed, constant = _closed()
    jaxpr, consts = compat.jaxpr_and_consts(closed)
    assert [e.primitive.name for e in jaxpr.eqns] == ["mul"]
    assert len(consts) == 1 and consts[0] is constant
    assert len(jaxpr.constvars) == 1 and len(jaxpr.invars) == 1
    open_jaxpr, no_consts = compat.jaxpr_and_consts(jaxpr)
    assert open_jaxpr is jaxpr and tuple(no_consts) in ((), tuple(consts))


def test_with_consts_on_the_installed_jax_swaps_the_constants():
    closed, constant = _closed()
    other = compat.with_consts(closed, (jnp.full(3, 10.0),))
    assert compat.jaxpr_and_consts(closed)[1][0] is constant  # the original is unchanged
    [out] = jax.core.eval_jaxpr(*compat.jaxpr_and_consts(other), jnp.ones(3))
    np.testing.assert_array_equal(out, [10.0, 10.0, 10.0])
    placeholders = compat.with_consts(closed, [None])  # stand-ins of any type
    assert list(compat.jaxpr_and_consts(placeholders)[1]) == [None]


def test_jaxpr_helpers_on_objects_shaped_like_either_jax_version():
    class Closed:  # jax 0.10: a ClosedJaxpr, the consts beside `.jaxpr`, `replace`
        def __init__(self, jaxpr, consts):
            self.jaxpr, self.consts = jaxpr, consts

        def replace(self, consts):
            return Closed(self.jaxpr, consts)

    class Merged:  # jax 0.11: one Jaxpr with its consts and `with_consts`
        def __init__(self, consts):
            self.consts = consts

        def with_consts(self, consts):
            return Merged(consts)

    old = Closed("the jaxpr", ("a",))
    assert compat.jaxpr_and_consts(old) == ("the jaxpr", ("a",))
    replaced = compat.with_consts(old, ("b", "c"))
    assert (replaced.jaxpr, replaced.consts, old.consts) == ("the jaxpr", ["b", "c"], ("a",))
    new = Merged(("a",))
    assert compat.jaxpr_and_consts(new) == (new, ("a",))
    swapped = compat.with_consts(new, ("b",))
    assert isinstance(swapped, Merged) and swapped.consts == ["b"]
    plain = types.SimpleNamespace()  # an open jaxpr without consts
    assert compat.jaxpr_and_consts(plain) == (plain, ())


def test_bind_equation_on_the_installed_jax():
    assert float(compat.bind_equation(jax.lax.add_p, [jnp.float32(1), jnp.float32(2)], {})) == 3
    closed = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x))(jnp.float32(0.5))
    [eqn] = compat.jaxpr_and_consts(closed)[0].eqns
    [out] = compat.bind_equation(eqn.primitive, [jnp.float32(0.5)], eqn.params)
    np.testing.assert_allclose(out, np.sin(0.5), rtol=1e-6)


@pytest.mark.parametrize("older", [True, False], ids=["tuple", "params"])
def test_bind_equation_with_either_get_bind_params_convention(older):
    calls = []

    class Primitive:
        def get_bind_params(self, params):
            bind_params = {**params, "converted": True}
            return (["subfunction"], bind_params) if older else bind_params

        def bind(self, *args, **params):
            calls.append((args, params))
            return "outputs"

    assert compat.bind_equation(Primitive(), ["x", "y"], {"axis": 0}) == "outputs"
    args = ("subfunction", "x", "y") if older else ("x", "y")
    assert calls == [(args, {"axis": 0, "converted": True})]


def test_varying_axes_of_either_aval_layout():
    old = types.SimpleNamespace(manual_axis_type=types.SimpleNamespace(varying={"data"}),
                                vma={"ignored"})
    new = types.SimpleNamespace(vma=("model", "data"))
    assert compat.varying_axes_of(old) == frozenset({"data"})
    assert compat.varying_axes_of(new) == frozenset({"model", "data"})
    assert compat.varying_axes_of(types.SimpleNamespace()) == frozenset()
    assert compat.varying_axes_of(jax.typeof(jnp.ones(2))) == frozenset()


def test_varying_struct_field_is_a_shape_dtype_struct_keyword_or_none():
    field = compat.VARYING_STRUCT_FIELD
    assert field in ("manual_axis_type", "vma", None)
    if field is not None:
        assert field in inspect.signature(jax.ShapeDtypeStruct).parameters
        value = getattr(jax.typeof(jnp.ones(2)), field)
        struct = jax.ShapeDtypeStruct((2,), jnp.float32, **{field: value})
        assert compat.varying_axes_of(struct) == frozenset()


def test_jax_private_modules_are_found_or_reported_missing():
    import_capsule, export_capsule = compat.dlpack_capsule_functions()
    assert (callable(import_capsule) and callable(export_capsule)) or (
        import_capsule is None and export_capsule is None)
    internals = compat.pallas_triton_internals()
    if internals is not None:
        for name in ("pallas_core", "lowering", "pallas_call_registration", "gpu_triton", "mlir",
                     "ir"):
            assert isinstance(getattr(internals, name), types.ModuleType), name
    jnp.zeros(1).block_until_ready()  # backends exist now
    assert compat.backends_started() is True


def test_torch_functions_on_the_installed_torch():
    torch = pytest.importorskip("torch")
    device, stream = compat.torch_cuda_device_and_stream()
    assert callable(device) and callable(stream)
    if not torch.cuda.is_available():
        if not hasattr(torch._C, "_cuda_getDevice"):  # a CPU build: no CUDA tensor gets here
            with pytest.raises(RuntimeError, match="without CUDA"):
                device()
            with pytest.raises(RuntimeError, match="without CUDA"):
                stream(0)
    else:
        assert device() == torch.cuda.current_device()
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    from_capsule = compat.torch_from_dlpack_capsule()
    imported = from_capsule(torch.utils.dlpack.to_dlpack(tensor))
    assert torch.equal(imported, tensor) and imported.data_ptr() == tensor.data_ptr()
    assert compat.torch_tracing_context() is None  # outside torch.compile


def test_torch_compile_helpers_on_the_installed_torch():
    torch = pytest.importorskip("torch")
    constant = compat.torch_assume_constant_result(lambda n: n * 2)
    assert callable(constant) and constant(21) == 42
    mode = compat.torch_getitem_to_index()
    assert isinstance(mode, type) and issubclass(mode, torch.overrides.TorchFunctionMode)
    assert issubclass(mode, contextlib.AbstractContextManager)  # __enter__ and __exit__
    with mode():  # indexing still reads the same values under it
        values = torch.arange(5.0)[torch.tensor([4, 0])]
    assert values.tolist() == [4.0, 0.0]


def test_torch_closure_helpers_on_the_installed_torch():
    """Under torch.compile, a function made in the trace is told from one made outside, and
    its closure reads as Python reads it (what the bridge's mods made in a compiled region
    rely on); a symbolic float argument comes out as its value."""
    torch = pytest.importorskip("torch")
    assert compat.torch_read_closures_while_tracing() is True  # installed once, then kept
    outside_table = torch.ones(2)

    def outside(i):
        return outside_table[i]

    def traced(x, scale):
        local = x * 2

        def inside(i):
            return local[i] * scale

        return (inside.__closure__[0].cell_contents + inside.__closure__[1].cell_contents,
                compat.torch_made_while_tracing(inside), compat.torch_made_while_tracing(outside),
                compat.torch_guard_scalar()(scale))

    compiled = torch.compile(traced, backend="eager", fullgraph=True)
    for scale in (3.0, 5.0):  # the second value is a symbolic float to Dynamo
        contents, made_inside, made_outside, value = compiled(torch.arange(2.0), scale)
        assert torch.equal(contents, torch.tensor([scale, scale + 2]))
        assert (made_inside, made_outside, value) == (True, False, scale)
    assert compat.torch_made_while_tracing(outside) is False


def test_environment_variable_reads_what_os_environ_holds(monkeypatch):
    name = "JATTN_TEST_COMPAT_VARIABLE"
    monkeypatch.delenv(name, raising=False)
    assert compat.environment_variable(name) is None
    monkeypatch.setenv(name, "pallas_triton")
    assert compat.environment_variable(name) == "pallas_triton"
    monkeypatch.setenv(name, "")
    assert compat.environment_variable(name) == ""


def test_mosaic_gpu_interpreted_follows_jaxs_interpret_mode():
    assert not compat.mosaic_gpu_interpreted()
    params = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.params")
    with params.force_gpu_interpret_mode(params.InterpretGPUParams()):
        assert compat.mosaic_gpu_interpreted()
    assert not compat.mosaic_gpu_interpreted()

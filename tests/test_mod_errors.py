"""Errors for the commonest mistakes in user functions (mods): a parameter list jattn cannot
call, and Python control flow on traced arguments, each turned into a TypeError that names the
API, the role, the mod and the fix; other errors pass through unchanged."""

import functools
import inspect

import jax
import jax.numpy as jnp
import pytest

import jattn
from jattn._src import mod_errors
from jattn._src.mod_errors import MASK_PARAMETERS, SCORE_PARAMETERS


def my_score_mod(score, b, h, q_idx, kv_idx):
    return score


def test_parameter_lists_are_how_jattn_calls_mods():
    assert SCORE_PARAMETERS == ("score", "b", "h", "q_idx", "kv_idx")
    assert MASK_PARAMETERS == ("b", "h", "q_idx", "kv_idx")


def test_name_of_prefers_the_function_name_then_a_library_mod_name_then_the_type():
    class Callable:
        def __call__(self, *args):
            return args

    assert mod_errors.name_of(my_score_mod) == "my_score_mod"
    assert mod_errors.name_of(lambda *a: a) == "<lambda>"
    assert mod_errors.name_of(Callable()) == "Callable"
    named = Callable()
    named.mod_name = "jattn.mods.custom"
    assert mod_errors.name_of(named) == "jattn.mods.custom"
    assert mod_errors.name_of(jattn.mods.alibi(jnp.ones(2))) == "jattn.mods.alibi"
    assert mod_errors.name_of(functools.partial(my_score_mod, b=0)) == "partial"


@pytest.mark.parametrize("mod", [my_score_mod, lambda s, *_: s, lambda *args: args[0],
                                 lambda score, b, h, q_idx, kv_idx, extra=1: score])
def test_mods_that_take_the_parameters_pass(mod):
    mod_errors.check_parameters("flex_attention", "score_mod", mod, SCORE_PARAMETERS)


def test_a_mod_with_the_wrong_parameters_raises_naming_the_call_and_the_fix():
    def my_mask(b, h, q_idx):
        return q_idx >= 0

    with pytest.raises(TypeError) as info:
        mod_errors.check_parameters("create_block_mask", "mask_mod", my_mask, MASK_PARAMETERS)
    message = str(info.value)
    assert message.startswith("create_block_mask: `mask_mod` is called as "
                              "mask_mod(b, h, q_idx, kv_idx), but my_mask(b, h, q_idx) cannot "
                              "take these 4 arguments")
    assert "`*_`" in message
    assert info.value.__cause__ is None and info.value.__suppress_context__
    with pytest.raises(TypeError, match=r"flex_attention: `score_mod` .* 5 arguments"):
        mod_errors.check_parameters("flex_attention", "score_mod", lambda s, b, h, q, k, x: s,
                                    SCORE_PARAMETERS)


def test_a_callable_without_a_signature_is_left_to_the_call():
    with pytest.raises(ValueError):  # (what check_parameters catches)
        inspect.signature(max)
    mod_errors.check_parameters("flex_attention", "score_mod", max, SCORE_PARAMETERS)


def _traced(mod, *args):
    return jax.jit(mod)(*args)


def test_python_if_on_a_traced_scalar_becomes_a_type_error_naming_jnp_where():
    def branching(b, h, q_idx, kv_idx):
        return True if q_idx > kv_idx else False

    with pytest.raises(TypeError) as info:
        with mod_errors.traced_values_explained("create_mask", "mask_mod", branching):
            _traced(branching, 0, 0, jnp.int32(1), jnp.int32(0))
    message = str(info.value)
    assert message.startswith("create_mask: `mask_mod` branching uses a Python `if`")
    assert "jnp.where(condition, x, y)" in message
    assert isinstance(info.value.__cause__, jax.errors.ConcretizationTypeError)


def test_truth_value_of_an_array_becomes_the_same_type_error():
    def ambiguous(score, b, h, q_idx, kv_idx):
        return score if score else -score

    with pytest.raises(TypeError, match="flex_attention: `score_mod` ambiguous uses a Python"):
        with mod_errors.traced_values_explained("flex_attention", "score_mod", ambiguous):
            ambiguous(jnp.ones(3), 0, 0, 0, 0)  # a concrete array: NumPy's ValueError


def test_other_errors_pass_through_unchanged():
    other = ValueError("shapes do not match")
    with pytest.raises(ValueError) as info:
        with mod_errors.traced_values_explained("flex_attention", "score_mod", my_score_mod):
            raise other
    assert info.value is other
    with pytest.raises(KeyError):
        with mod_errors.traced_values_explained("flex_attention", "score_mod", my_score_mod):
            raise KeyError("h")


def test_no_error_leaves_the_block_alone():
    with mod_errors.traced_values_explained("flex_attention", "score_mod", my_score_mod):
        result = _traced(lambda x: jnp.where(x > 0, x, -x), jnp.float32(-2.0))
    assert float(result) == 2.0

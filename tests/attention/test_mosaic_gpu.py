"""flex_attention's forward on Mosaic GPU (implementation="pallas_mosaic_gpu").

On the CPU: the registry's reasons for the calls it cannot run, and the forward and the Triton
backward behind it lowered for CUDA. The Mosaic GPU interpreter cannot run this kernel (it has
no wgmma, no transposed shared-memory refs and no register layouts), so its numerics are checked
on the GPU: output, LSE and gradients against a float64 golden, and bitwise repeatability.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src import backends, bridge, hardware
from tests.attention.golden import check_against_golden
from tests.helpers import assert_bitwise_equal_runs, lower_for_cuda, random

MOSAIC = "pallas_mosaic_gpu"
gpu = pytest.mark.gpu


@pytest.fixture
def as_if_on_hopper(monkeypatch):
    """Selects the GPU paths without a GPU (only lowering runs, nothing executes)."""
    monkeypatch.setattr(hardware, "has_cuda", lambda: True)
    monkeypatch.setattr(hardware, "is_hopper", lambda: True)


def _facts(**changes):
    facts = dict(dtype=jnp.bfloat16, head_dim=128, value_dim=128, seq_lengths=(1024, 1024),
                 block_size=(128, 128), captures=0)
    return {**facts, **changes}


@pytest.mark.parametrize("change, reason", [
    ({"dtype": jnp.float32}, "bfloat16 or float16"),
    ({"head_dim": 96, "value_dim": 96}, "head dims 64 or 128"),
    ({"value_dim": 64}, "equal q/k and v head dims"),
    ({"seq_lengths": (1000, 1024)}, "multiples of 128"),
    ({"block_size": (64, 64)}, r"\(128, 128\) blocks"),
    ({"captures": 1}, "captured arrays"),
])
def test_registry_names_what_the_mosaic_forward_cannot_run(as_if_on_hopper, change, reason):
    assert backends.resolve("flex_attention", MOSAIC, platform="gpu", **_facts()).name == MOSAIC
    with pytest.raises(ValueError, match=reason):
        backends.resolve("flex_attention", MOSAIC, platform="gpu", **_facts(**change))


def test_it_needs_a_hopper_gpu(monkeypatch):
    monkeypatch.setattr(hardware, "has_cuda", lambda: True)
    monkeypatch.setattr(hardware, "is_hopper", lambda: False)
    with pytest.raises(ValueError, match="Hopper"):
        backends.resolve("flex_attention", MOSAIC, platform="gpu", **_facts())
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        backends.resolve("flex_attention", MOSAIC, platform="cpu", **_facts())


@pytest.mark.parametrize("captures, chosen", [(0, MOSAIC), (1, "pallas_triton")])
def test_the_environment_variable_applies_where_the_call_is_supported(
        as_if_on_hopper, monkeypatch, captures, chosen):
    """As jattn's own calls and the torch ops resolve (the bridge passes the same facts)."""
    monkeypatch.setenv("JATTN_IMPLEMENTATION", MOSAIC)
    assert bridge.resolve("flex_attention", None, on_cuda=True,
                          **_facts(captures=captures)) == chosen


@pytest.mark.parametrize("facts, chosen", [
    (dict(), MOSAIC),
    (dict(head_dim=64, value_dim=64, seq_lengths=(4096, 4096)), MOSAIC),
    (dict(head_dim=64, value_dim=64, seq_lengths=(1024, 1024), score_mod=True), MOSAIC),
    (dict(head_dim=64, value_dim=64, seq_lengths=(1024, 1024)), "pallas_triton"),
    (dict(captures=1), "pallas_triton"),
])
def test_hopper_defaults_to_mosaic_where_measured_faster(as_if_on_hopper, facts, chosen):
    """The default choice (jattn's calls and the torch ops alike) takes the Mosaic forward
    except where it cannot run the call or pallas_triton's was measured faster."""
    assert bridge.resolve("flex_attention", None, on_cuda=True, **_facts(**facts)) == chosen
    with backends.recording() as seen:
        backends.resolve("flex_attention", platform="gpu", **_facts(**facts))
    if chosen != MOSAIC:
        assert "skipped pallas_mosaic_gpu" in str(seen[0])


def test_other_gpus_and_other_ops_default_to_pallas_triton(monkeypatch):
    monkeypatch.setattr(hardware, "has_cuda", lambda: True)
    monkeypatch.setattr(hardware, "is_hopper", lambda: False)
    assert backends.resolve("flex_attention", platform="gpu", **_facts()).name == "pallas_triton"
    with backends.recording() as seen:  # ops without a Mosaic implementation skip it quietly
        assert backends.resolve("matmul", platform="gpu").name == "pallas_triton"
    assert not seen[0].skipped


def test_other_ops_say_they_have_no_mosaic_implementation():
    with pytest.raises(ValueError, match="matmul has no pallas_mosaic_gpu implementation"):
        backends.resolve("matmul", MOSAIC, platform="gpu")


def test_a_mod_reading_an_array_is_refused_with_the_alternative(as_if_on_hopper):
    q = jax.ShapeDtypeStruct((1, 2, 256, 64), jnp.bfloat16)
    slopes = jnp.ones((2,))
    with pytest.raises(ValueError, match="captured arrays"):
        jax.eval_shape(lambda q: jattn.flex_attention(q, q, q, jattn.mods.alibi(slopes),
                                                      implementation=MOSAIC), q)


def _spec(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("dtype, E, Hkv, mask", [
    (jnp.bfloat16, 128, 4, "causal"), (jnp.float16, 64, 2, "window"), (jnp.bfloat16, 64, 4, None),
])
def test_forward_and_triton_backward_lower_for_cuda(as_if_on_hopper, dtype, E, Hkv, mask):
    pytest.importorskip("absl")  # JAX's Mosaic GPU modules import it
    B, Hq, L = 2, 4, 512
    mask_mod = {"causal": jattn.masks.causal_mask, "window": jattn.masks.sliding_window(200),
                None: None}[mask]
    block_mask = None if mask_mod is None else jattn.create_block_mask(mask_mod, None, None, L,
                                                                       L)

    def softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * jnp.tanh(score / 30.0) - 0.01 * (h + 1) * (q_idx - kv_idx)

    def attention(q, k, v):
        return jattn.flex_attention(q, k, v, softcap, block_mask, enable_gqa=True,
                                    return_lse=True, implementation=MOSAIC)

    def gradients(q, k, v):
        cotangent = (jnp.ones((B, Hq, L, E), dtype), jnp.ones((B, Hq, L)))
        return jax.vjp(attention, q, k, v)[1](cotangent)

    args = (_spec(B, Hq, L, E, dtype=dtype), _spec(B, Hkv, L, E, dtype=dtype),
            _spec(B, Hkv, L, E, dtype=dtype))
    assert "mosaic_gpu" in lower_for_cuda(attention, *args)
    text = lower_for_cuda(gradients, *args)
    assert "mosaic_gpu" in text and "jattn_flex_bwd" in text


# ------------------------------------------------------------------------------------------------
# On the GPU
# ------------------------------------------------------------------------------------------------


def _inputs(B, Hq, Hkv, L, E, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return (random(rng, (B, Hq, L, E), dtype), random(rng, (B, Hkv, L, E), dtype),
            random(rng, (B, Hkv, L, E), dtype))


def _softcap(score, b, h, q_idx, kv_idx):
    return 20.0 * jnp.tanh(score / 20.0)


def _head_bias(score, b, h, q_idx, kv_idx):  # ALiBi-like, slope from the head index
    return score - jnp.exp2(-(h + 1.0)) * jnp.abs(q_idx - kv_idx)


def _documents_of_256(b, h, q_idx, kv_idx):  # no captured ids: documents from the position
    return (q_idx // 256 == kv_idx // 256) & (q_idx >= kv_idx)


def _first_block_row_empty(b, h, q_idx, kv_idx):
    return (q_idx >= 128) & (kv_idx <= q_idx)


CASES = {
    "full bf16 d128": (1, 4, 4, 512, 128, jnp.bfloat16, None, None),
    "causal fp16 d64 gqa": (2, 4, 2, 512, 64, jnp.float16, None, jattn.masks.causal_mask),
    "window softcap": (1, 2, 1, 768, 128, jnp.bfloat16, _softcap, jattn.masks.sliding_window(200)),
    "documents head bias": (2, 4, 4, 1024, 64, jnp.bfloat16, _head_bias, _documents_of_256),
    "empty rows": (1, 2, 2, 384, 64, jnp.float16, None, _first_block_row_empty),
}


@gpu
@pytest.mark.parametrize("name", CASES)
def test_output_lse_and_gradients_match_a_float64_golden(name):
    B, Hq, Hkv, L, E, dtype, score_mod, mask_mod = CASES[name]
    q, k, v = _inputs(B, Hq, Hkv, L, E, dtype)
    block_mask = None if mask_mod is None else jattn.create_block_mask(mask_mod, None, None, L, L)
    check_against_golden(MOSAIC, q, k, v, score_mod, block_mask)
    if name == "empty rows":
        out = jattn.flex_attention(q, k, v, score_mod, block_mask, implementation=MOSAIC)
        assert np.all(np.asarray(out)[:, :, :128] == 0)


@gpu
def test_is_bitwise_repeatable():
    q, k, v = _inputs(2, 8, 2, 1024, 128, jnp.bfloat16, seed=3)
    mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 1024, 1024)
    attention = jax.jit(lambda q, k, v: jattn.flex_attention(
        q, k, v, _softcap, mask, enable_gqa=True, implementation=MOSAIC))
    assert_bitwise_equal_runs(lambda: attention(q, k, v))

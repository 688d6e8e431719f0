"""Agreement with torch.nn.attention.flex_attention (eager, float64) on the same mods: outputs
and LSE on the CPU; gradients for q, k, v and a captured bias table on the GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")
from tests.torch_mods import torch_mask, torch_score_mod  # noqa: E402

B, H, L, S, E = 1, 4, 160, 224, 32
RADIUS = 40
SEGMENTS = np.repeat(np.arange(5), -(-S // 5))[:S]
SLOPES = np.exp2(-8.0 * np.arange(1, H + 1) / H)

JATTN_MASKS = {
    "causal": jattn.masks.causal_mask,
    "sliding": jattn.masks.sliding_window(48),
    "prefix": jattn.masks.prefix_lm(64),
    "document": jattn.masks.document_mask(jnp.asarray(SEGMENTS, jnp.int32)),
}


def _jattn_mod(name, table):
    if name == "alibi":
        return jattn.mods.alibi(jnp.asarray(SLOPES, jnp.float32))
    if name == "softcap":
        return jattn.mods.softcap(20.0)
    if name == "relative":
        return jattn.mods.relative_position_bias(table)
    return None


def _compare(mask, mod, device, grads):
    rng = np.random.default_rng(len(mask) + len(mod))
    q = rng.standard_normal((B, H, L, E))
    k, v = (rng.standard_normal((B, H, S, E)) for _ in range(2))
    table = 0.5 * rng.standard_normal((H, 2 * RADIUS + 1))
    d_out = rng.standard_normal((B, H, L, E))
    d_lse = rng.standard_normal((B, H, L))

    # torch, float64 eager
    tq, tk, tv, ttable = (torch.tensor(x, device=device, requires_grad=grads)
                          for x in (q, k, v, table))
    t_mask = flex.create_block_mask(torch_mask(mask, torch.tensor(SEGMENTS, device=device)),
                                    None, None, L, S, device=device)
    score_mod = torch_score_mod(mod, torch.tensor(SLOPES, device=device), ttable, RADIUS)
    t_out, t_lse = flex.flex_attention(tq, tk, tv, score_mod=score_mod,
                                       block_mask=t_mask, return_lse=True)

    # jattn, float32 through the XLA implementation on the CPU (exact f32 dots)
    def run(q, k, v, table):
        block_mask = jattn.create_block_mask(JATTN_MASKS[mask], None, None, L, S)
        return jattn.flex_attention(q, k, v, _jattn_mod(mod, table), block_mask,
                                    return_lse=True, implementation="xla")

    with jax.default_device(jax.devices("cpu")[0]):
        args = [jnp.asarray(x, jnp.float32) for x in (q, k, v, table)]
        (out, lse), vjp = jax.vjp(run, *args)
        ours = vjp((jnp.asarray(d_out, jnp.float32), jnp.asarray(d_lse, jnp.float32)))

    tol = dict(rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(out), t_out.detach().cpu().numpy(), **tol)
    np.testing.assert_allclose(np.asarray(lse), t_lse.detach().cpu().numpy(), **tol)
    if not grads:
        return
    torch.autograd.backward((t_out, t_lse), (torch.tensor(d_out, device=device),
                                             torch.tensor(d_lse, device=device)))
    theirs = (tq, tk, tv) + ((ttable,) if mod == "relative" else ())
    for name, g, t in zip(("q", "k", "v", "bias table"), ours, theirs):
        np.testing.assert_allclose(np.asarray(g), t.grad.cpu().numpy(), **tol, err_msg=name)


CASES = [("causal", "alibi"), ("sliding", "none"), ("prefix", "softcap"),
         ("document", "relative")]


@pytest.mark.parametrize("mask,mod", CASES)
def test_matches_torch_flex_attention(mask, mod):
    """Outputs and LSE (torch's CPU flex attention has no backward)."""
    _compare(mask, mod, "cpu", grads=False)


@pytest.mark.gpu
@pytest.mark.parametrize("mask,mod", CASES)
def test_gradients_match_torch_flex_attention(mask, mod):
    """Gradients for q, k, v and the captured bias table, against torch on CUDA."""
    _compare(mask, mod, "cuda", grads=True)

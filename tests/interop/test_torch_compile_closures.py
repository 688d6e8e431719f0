"""Mods made inside torch.compile(fullgraph=True) that close over its local values, as
transformers builds its score_mod and mask_mod in a model's forward: results and gradients
equal to the eager call's, a changed float re-traces, a new tensor reaches the op as a graph
input (never a stale constant)."""

import pytest

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")
import interop.torch as jt  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402

torch_flex_attention = flex.flex_attention

# torch 2.11's Dynamo hands no closure made in the trace to trace-time code (docs/torch.md)
pytestmark = pytest.mark.skipif(
    tuple(int(n) for n in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13),
    reason="needs torch >= 2.13")

B, H, L, E, BLOCK = 1, 2, 64, 16, 32
GEN = torch.Generator().manual_seed(0)


def _q(requires_grad=False):
    return torch.randn(B, H, L, E, generator=GEN).requires_grad_(requires_grad)


def _compiled(fn):
    """fn compiled whole (a graph break raises), through AOTAutograd as a training step is,
    and the counter of its compiles."""
    counter = CompileCounterWithBackend("aot_eager")
    return torch.compile(fn, backend=counter, fullgraph=True), counter


def _exact(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


CAUSAL = jt.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, L, L,
                              "cpu", BLOCK)


def _relative_bias(q, table):
    """Attention with a score_mod made here, reading a local learnable table."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, torch.clamp(kv_idx - q_idx, -4, 4) + 4]
    return jt.flex_attention(q, q, q, score_mod, CAUSAL)


def test_a_local_learnable_tensor_gets_the_eager_output_and_gradients():
    q, table = _q(requires_grad=True), torch.randn(H, 9, generator=GEN, requires_grad=True)
    compiled, _ = _compiled(_relative_bias)
    out, expected = compiled(q, table), _relative_bias(q, table)
    _exact(out, expected)
    d_out = torch.randn(out.shape, generator=GEN)
    grads = torch.autograd.grad(out, (q, table), d_out)
    expected_grads = torch.autograd.grad(expected, (q, table), d_out)
    assert grads[1].abs().sum() > 0
    for grad, expected_grad in zip(grads, expected_grads):
        _exact(grad, expected_grad)


def test_a_new_tensor_each_call_is_read_without_recompiling():
    q = _q()
    compiled, counter = _compiled(_relative_bias)
    for _ in range(3):
        table = torch.randn(H, 9, generator=GEN)
        _exact(compiled(q, table), _relative_bias(q, table))
    assert counter.frame_count == 1


class _PaddedAttention(torch.nn.Module):
    """transformers' shape: forward makes a score_mod over `self` (a learnable per-head scale)
    and a padding bias computed in the graph from its input."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(H, generator=GEN))

    def forward(self, q, padding):
        bias = padding.float() * -5.0

        def score_mod(score, b, h, q_idx, kv_idx):
            return score * self.scale[h] + bias[b, kv_idx]
        return jt.flex_attention(q, q, q, score_mod, CAUSAL)


def test_a_mod_over_self_and_a_value_computed_in_the_graph_gets_the_eager_gradients():
    module, q = _PaddedAttention(), _q(requires_grad=True)
    padding = torch.arange(L).expand(B, L) >= L - 5
    compiled, _ = _compiled(module)
    out, expected = compiled(q, padding), module(q, padding)
    _exact(out, expected)
    d_out = torch.randn(out.shape, generator=GEN)
    for grad, expected_grad in zip(torch.autograd.grad(out, (q, module.scale), d_out),
                                   torch.autograd.grad(expected, (q, module.scale), d_out)):
        _exact(grad, expected_grad)


def _every_block(n_blocks):
    """(kv_num_blocks, kv_indices) listing every kv block as partial for every q block: the
    mask_mod alone decides what is attended."""
    counts = torch.full((1, 1, n_blocks), n_blocks, dtype=torch.int32)
    indices = torch.arange(n_blocks, dtype=torch.int32).expand(1, 1, n_blocks, n_blocks)
    return counts, indices.contiguous()


EVERY_BLOCK = _every_block(L // BLOCK)


def _documents(q, document_ids):
    """Attention within documents: a mask_mod made here, reading local document ids."""
    def same_document(b, h, q_idx, kv_idx):
        return document_ids[q_idx] == document_ids[kv_idx]
    block_mask = flex.BlockMask.from_kv_blocks(*EVERY_BLOCK, BLOCK_SIZE=BLOCK,
                                               mask_mod=same_document, seq_lengths=(L, L))
    return jt.flex_attention(q, q, q, None, block_mask)


def test_a_mask_mod_over_local_document_ids_follows_each_calls_ids():
    q = _q()
    compiled, counter = _compiled(_documents)
    for length in (20, 7):
        document_ids = torch.arange(L) // length
        out = compiled(q, document_ids)
        _exact(out, _documents(q, document_ids))
        within = document_ids[:, None] == document_ids[None, :]
        weights = torch.softmax((q @ q.transpose(-1, -2) / E**0.5).masked_fill(~within,
                                                                                 -torch.inf), -1)
        torch.testing.assert_close(out, weights @ q, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


def _softcapped(q, softcap, head_bias):
    """A score_mod made here over a float argument of the compiled function (a symbolic
    float to Dynamo) and a local tensor, with a mask_mod that combines two made here."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap) + head_bias[h]

    def not_first(b, h, q_idx, kv_idx):
        return kv_idx >= first[h]

    first = torch.zeros(H, dtype=torch.int64) + 3
    mask_mod = flex.and_masks(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, not_first)
    block_mask = flex.BlockMask.from_kv_blocks(*EVERY_BLOCK, BLOCK_SIZE=BLOCK,
                                               mask_mod=mask_mod, seq_lengths=(L, L))
    return jt.flex_attention(q, q, q, score_mod, block_mask)


def test_a_changed_local_float_re_traces_and_is_followed():
    q, head_bias = _q(), torch.randn(H, generator=GEN)
    compiled, counter = _compiled(_softcapped)
    outs, compiles = {}, []
    for softcap in (20.0, 0.5, 20.0):
        outs[softcap] = compiled(q, softcap, head_bias)
        _exact(outs[softcap], _softcapped(q, softcap, head_bias))
        compiles.append(counter.frame_count)
    assert not torch.equal(outs[20.0], outs[0.5])
    assert compiles[0] < compiles[1] == compiles[2]  # 0.5 re-traces; 20.0 again reuses


def _with_offsets(mask_mod, q_offset):
    """transformers' add_offsets_to_mask_function: one code object for every mod it wraps."""
    def inner_mask(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx + q_offset, kv_idx)
    return inner_mask


def test_a_block_mask_whose_mod_wraps_another_function_re_traces():
    """Masks made outside the compiled region by one factory over different functions (a
    causal mask, then causal and padding) share their mod's code: the second call must see the
    padding, as torch's compiled flex_attention does."""
    q, padding = _q(), torch.arange(L) >= 5

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def causal_unpadded(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & padding[kv_idx]

    compiled, counter = _compiled(lambda q, block_mask: jt.flex_attention(
        q, q, q, block_mask=block_mask))
    for mask_mod in (causal, causal_unpadded, causal):
        block_mask = jt.create_block_mask(_with_offsets(mask_mod, 0), None, None, L, L, "cpu",
                                          BLOCK)
        _exact(compiled(q, block_mask), jt.flex_attention(q, q, q, block_mask=block_mask))
    assert counter.frame_count == 2


CONFIG = {"scale": 1.0}


def _scaled_by_config(score, b, h, q_idx, kv_idx):
    return score * CONFIG["scale"]


def test_a_global_dicts_item_is_read_on_every_call():
    """A global whose name ends in G (CONFIG["scale"]): its item is state, eagerly and
    compiled."""
    q = _q()
    compiled, _ = _compiled(lambda q: jt.flex_attention(q, q, q, _scaled_by_config))
    for scale in (1.0, 4.0):
        CONFIG["scale"] = scale
        expected = torch_flex_attention(q, q, q, _scaled_by_config)
        torch.testing.assert_close(jt.flex_attention(q, q, q, _scaled_by_config), expected,
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(compiled(q), expected, rtol=1e-5, atol=1e-5)


def test_two_calls_with_new_mods_compile_in_one_graph():
    """Two layers with mods never called before: the second call's translation is found."""
    def alibi(score, b, h, q_idx, kv_idx):
        return score - 0.1 * (q_idx - kv_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return 5.0 * torch.tanh(score / 5.0)

    def two_layers(q):
        return jt.flex_attention(jt.flex_attention(q, q, q, alibi), q, q, softcap)

    q = _q()
    expected = torch_flex_attention(torch_flex_attention(q, q, q, alibi), q, q, softcap)
    torch.testing.assert_close(_compiled(two_layers)[0](q), expected, rtol=1e-5, atol=1e-5)


def test_what_a_mod_reads_to_return_its_score_or_not_is_guarded():
    """A mod that returns its score in one state (no bias, no key, no attribute) and
    computes in another: the compiled function follows the state."""
    q, bias = _q(), torch.randn(H, L, generator=GEN)
    options, holder = {}, type("Holder", (), {})()

    def with_bias(bias):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score if bias is None else score + bias[h, kv_idx]
        return score_mod

    def keyed(score, b, h, q_idx, kv_idx):
        return score - 1.5 * q_idx if "shift" in options else score

    def attribute(score, b, h, q_idx, kv_idx):
        return score * holder.scale if hasattr(holder, "scale") else score

    compiled, _ = _compiled(lambda q, mod: jt.flex_attention(q, q, q, mod))
    for mod, change in ((with_bias(None), lambda: with_bias(bias)),
                        (keyed, lambda: options.update(shift=1) or keyed),
                        (attribute, lambda: setattr(holder, "scale", 3.0) or attribute)):
        _exact(compiled(q, mod), jt.flex_attention(q, q, q, mod))
        mod = change()
        out = compiled(q, mod)
        _exact(out, jt.flex_attention(q, q, q, mod))
        torch.testing.assert_close(out, torch_flex_attention(q, q, q, mod), rtol=1e-5,
                                   atol=1e-5)


def test_a_mod_made_here_over_a_float_argument_follows_each_value():
    q = _q()

    def tempered(q, temperature):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score / temperature
        return jt.flex_attention(q, q, q, score_mod)

    compiled, _ = _compiled(tempered)
    for temperature in (1.0, 2.0, 3.0):
        _exact(compiled(q, temperature), tempered(q, temperature))

"""interop.torch as a drop-in for torch.nn.attention.flex_attention: torch's signatures,
defaults, outputs, dtype handling and stride order, BlockMasks as torch builds them, and
torch.compile(fullgraph=True) of a module that uses the op."""

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")
import interop.torch as jt  # noqa: E402
from interop import _ops  # noqa: E402
from tests.interop.torch_reference import dense, torch_flex  # noqa: E402

B, HQ, HKV, L, E = 2, 4, 2, 96, 16
GEN = torch.Generator().manual_seed(1)


def _qkv(dtype=torch.float32, requires_grad=False):
    shapes = [(B, HQ, L, E), (B, HKV, L, E), (B, HKV, L, E)]
    return [torch.randn(s, generator=GEN).to(dtype).requires_grad_(requires_grad)
            for s in shapes]


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _close(actual, expected, tol=1e-5):
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def test_positional_arguments_in_torchs_order():
    q, k, v = _qkv()
    mask = jt.create_block_mask(_causal, None, None, L, L, "cpu", 32)
    out, lse = jt.flex_attention(q, k, v, None, mask, 0.5, True, True, {"PRESCALE_QK": False})
    expected, expected_lse = torch_flex(q, k, v, None, _causal, scale=0.5, return_lse=True)
    _close(out, expected)
    _close(lse, expected_lse)


def test_max_scores_agree_with_torchs_and_leave_gradients_alone():
    """AuxRequest(max_scores=True) with a score_mod and a mask, eagerly and compiled: the
    largest modded scores in float64 (-inf for rows attending to nothing; torch's CPU flex
    does not return them), torch's LSE, and out's gradients unchanged."""
    q, k, v = _qkv(requires_grad=True)
    late = lambda b, h, q_idx, kv_idx: (q_idx >= 8) & (kv_idx <= q_idx)  # noqa: E731
    mask = jt.create_block_mask(late, None, None, L, L, "cpu", 32)
    bias = lambda score, b, h, q_idx, kv_idx: score - 0.01 * (q_idx - kv_idx)  # noqa: E731
    request = flex.AuxRequest(lse=True, max_scores=True)
    _, expected_lse = torch_flex(q.double(), k.double(), v.double(), bias, late,
                                 return_lse=True)
    positions = torch.arange(L)
    scores = bias(q.double() @ k.double().repeat_interleave(HQ // HKV, 1).transpose(-1, -2)
                  / E ** 0.5, None, None, positions[:, None], positions[None, :])
    expected_max = scores.masked_fill(~late(None, None, positions[:, None], positions[None, :]),
                                      -torch.inf).amax(-1).detach()
    cotangent = torch.randn(B, HQ, L, E)
    grads = {}
    for name, call in (("eager", jt.flex_attention),
                       ("compiled", torch.compile(jt.flex_attention, fullgraph=True))):
        out, aux = call(q, k, v, bias, mask, enable_gqa=True, return_aux=request)
        assert not aux.max_scores.requires_grad and aux.max_scores.dtype == torch.float32
        assert torch.isneginf(aux.max_scores[:, :, :8]).all()
        _close(aux.max_scores[:, :, 8:], expected_max[:, :, 8:].float())
        _close(aux.lse[:, :, 8:], expected_lse[:, :, 8:].float())
        grads[name] = torch.autograd.grad(out, (q, k, v), cotangent)
    plain = jt.flex_attention(q, k, v, bias, mask, enable_gqa=True)
    for want, got_eager, got_compiled in zip(torch.autograd.grad(plain, (q, k, v), cotangent),
                                             grads["eager"], grads["compiled"]):
        assert torch.equal(got_eager, want) and torch.equal(got_compiled, want)


def test_return_aux_gives_torchs_aux_output():
    q, k, v = _qkv()
    out, aux = jt.flex_attention(q, k, v, enable_gqa=True,
                                 return_aux=flex.AuxRequest(lse=True))
    assert isinstance(aux, flex.AuxOutput) and aux.max_scores is None
    expected, expected_aux = torch_flex(q, k, v, return_aux=flex.AuxRequest(lse=True))
    _close(out, expected)
    _close(aux.lse, expected_aux.lse)
    _, empty = jt.flex_attention(q, k, v, enable_gqa=True, return_aux=flex.AuxRequest())
    assert empty.lse is None
    with pytest.raises(ValueError, match="return_lse or return_aux, not both"):
        jt.flex_attention(q, k, v, enable_gqa=True, return_lse=True,
                          return_aux=flex.AuxRequest(lse=True))
    with pytest.raises(TypeError, match="kernel_options"):
        jt.flex_attention(q, k, v, enable_gqa=True, kernel_options=64)


@pytest.mark.parametrize("options, error", [
    ({"BACKEND": "CUDNN"}, ValueError),
    ({"BACKEND": "FLASH", "FORCE_USE_FLEX_ATTENTION": True}, RuntimeError)])
def test_kernel_options_torch_rejects_raise_as_in_torch(options, error):
    q, k, v = _qkv()
    with pytest.raises(error, match="BACKEND"):
        torch_flex(q, k, v, kernel_options=options)
    with pytest.raises(error, match="BACKEND"):
        jt.flex_attention(q, k, v, enable_gqa=True, kernel_options=options)


def test_nested_tensors_raise_as_in_torch():
    jagged = torch.nested.nested_tensor([torch.randn(HQ, 10, E), torch.randn(HQ, 12, E)],
                                        layout=torch.jagged)
    # (torch raises NotImplementedError on the CPU; on CUDA Dynamo's Unsupported, a
    # RuntimeError, with the same words)
    with pytest.raises((NotImplementedError, RuntimeError), match="NestedTensor"):
        torch_flex(jagged, jagged, jagged)
    with pytest.raises(NotImplementedError, match="NestedTensor .* dense"):
        jt.flex_attention(jagged, jagged, jagged)


def test_kernel_options_become_jattns_config():
    """BLOCK_M/BLOCK_N and warps/stages reach the kernels (here through the Pallas
    interpreter) as the AttentionConfig they name; keys without a jattn counterpart are
    ignored; an invalid tile raises."""
    import jax
    import jattn

    q, k, v = (x[:, :, :64] for x in _qkv())
    options = {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 2, "BLOCK_M1": 16, "BLOCK_M2": 16,
               "PRESCALE_QK": True, "BACKEND": "TRITON"}
    ours = jt.flex_attention(q, k, v, enable_gqa=True, kernel_options=options,
                             implementation="interpret")
    config = jattn.AttentionConfig(block_q=32, block_k=16, num_warps=2, bwd_num_warps=2,
                                   bwd_block_q=16)
    with jax.default_device(jax.devices("cpu")[0]):
        expected = jattn.flex_attention(*(jax.numpy.asarray(x.numpy()) for x in (q, k, v)),
                                        enable_gqa=True, config=config,
                                        implementation="interpret")
    assert torch.equal(ours, torch.from_dlpack(expected))
    # torch's usual backward tiles (M1, N1, M2, N2) = (32, 64, 64, 32), also bwd_-prefixed:
    # jattn's two backward kernels share the dK/dV kernel's (M1, N1)
    for prefix in ("", "bwd_"):
        tiles = dict(zip((prefix + name for name in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2",
                                                     "BLOCK_N2")), (16, 32, 32, 16)))
        assert _ops.decode_config(jt._config(tiles, torch.float32))[0] == \
            jattn.AttentionConfig(bwd_block_q=16, bwd_block_k=32)
    with pytest.raises(ValueError, match="kernel_options .* invalid jattn config.*block_q=48"):
        jt.flex_attention(q, k, v, enable_gqa=True, kernel_options={"BLOCK_M": 48})


def test_create_block_mask_takes_torchs_arguments():
    torch_mask = flex.create_block_mask(_causal, B, None, L, L, "cpu", (16, 32))
    for mask in (jt.create_block_mask(_causal, B, None, L, L, "cpu", (16, 32)),
                 jt.create_block_mask(_causal, B, None, L, L, device="cpu",
                                      BLOCK_SIZE=(16, 32), _compile=True)):
        assert tuple(mask.BLOCK_SIZE) == (16, 32) and mask.kv_num_blocks.device.type == "cpu"
        for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks"):
            assert torch.equal(getattr(mask, name).long(), getattr(torch_mask, name).long())
    default = jt.create_block_mask(_causal, None, None, L, L)
    assert default.kv_num_blocks.device == flex.create_block_mask(
        _causal, None, None, L, L).kv_num_blocks.device  # torch's default device
    assert tuple(default.BLOCK_SIZE) == (128, 128)
    with pytest.raises(ValueError, match="BLOCK_SIZE must be a positive int"):
        jt.create_block_mask(_causal, None, None, L, L, "cpu", 0)
    compiled = torch.compile(jt.create_block_mask)(_causal, None, None, L, L, "cpu", 32)
    assert torch.equal(compiled.kv_indices, jt.create_block_mask(
        _causal, None, None, L, L, "cpu", 32).kv_indices)
    merged = jt.create_block_mask(_causal, B, None, L, L, "cpu", 32, separate_full_blocks=False,
                                  compute_dq_write_order=True, dq_kv_order=False)
    # (compared with torch's separate lists: torch before 2.13 lacks the keywords)
    separate = flex.create_block_mask(_causal, B, None, L, L, "cpu", 32)
    assert merged.full_kv_num_blocks is None
    assert torch.equal(merged.kv_num_blocks.long(), separate.kv_num_blocks.long()
                       + separate.full_kv_num_blocks.long())
    q, k, v = _qkv()
    _close(jt.flex_attention(q, k, v, block_mask=merged, enable_gqa=True),
           torch_flex(q, k, v, None, _causal))


def test_a_block_mask_without_q_major_lists_trains():
    """torch's BlockMask.from_kv_blocks(compute_q_blocks=False): the forward needs only the
    kv-major lists; the backward derives the q-major ones. Same results as the full mask."""
    full = flex.create_block_mask(_causal, None, None, L, L, "cpu", 32)
    kv_only = flex.BlockMask.from_kv_blocks(
        full.kv_num_blocks, full.kv_indices, full.full_kv_num_blocks, full.full_kv_indices,
        BLOCK_SIZE=32, mask_mod=_causal, seq_lengths=(L, L), compute_q_blocks=False)
    assert kv_only.q_num_blocks is None
    q, k, v = _qkv(requires_grad=True)
    d_out = torch.randn(B, HQ, L, E, generator=GEN)
    results = []
    for mask in (full, kv_only):
        out = jt.flex_attention(q, k, v, None, mask, enable_gqa=True)
        results.append((out, *torch.autograd.grad(out, (q, k, v), d_out)))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    _close(results[1][0], torch_flex(q, k, v, None, _causal))


@pytest.mark.parametrize("k_dtype", [torch.float16, torch.bfloat16])
def test_a_float32_query_with_lower_precision_keys(k_dtype):
    q, k, v = _qkv()
    k, v = k.to(k_dtype), v.to(k_dtype)
    out = jt.flex_attention(q, k, v, enable_gqa=True)
    assert out.dtype == torch.float32
    _close(out, torch_flex(q, k, v))


def test_float64_is_computed_in_float64_forward_and_backward():
    """As torch's own float64 (CPU: jattn's xla implementation in JAX's x64 mode), eagerly
    and under torch.compile(fullgraph=True)."""
    q, k, v = _qkv(torch.float64, requires_grad=True)
    bias = torch.randn(HQ, dtype=torch.float64, generator=GEN, requires_grad=True)

    def mod(score, b, h, q_idx, kv_idx):
        return score + bias[h] * (kv_idx - q_idx)

    mask = jt.create_block_mask(_causal, None, None, L, L, "cpu", 32)
    out, lse = jt.flex_attention(q, k, v, mod, mask, enable_gqa=True, return_lse=True)
    assert out.dtype == lse.dtype == torch.float64
    expected, expected_lse = torch_flex(q, k, v, lambda s, b, h, qi, ki: s + bias.detach()[h] * (
        ki - qi), _causal, return_lse=True)
    _close(out, expected, 1e-12)
    _close(lse, expected_lse, 1e-12)
    compiled = torch.compile(lambda q, k, v: jt.flex_attention(
        q, k, v, mod, mask, enable_gqa=True, return_lse=True), fullgraph=True)
    for ours, theirs in zip(compiled(q, k, v), (out, lse)):
        assert ours.dtype == torch.float64
        _close(ours, theirs, 1e-12)
    cotangent = torch.randn(out.shape, dtype=torch.float64, generator=GEN)
    grads = torch.autograd.grad(out, (q, k, v, bias), cotangent)
    gold = torch.autograd.grad(dense(q, k, v, mod, _causal), (q, k, v, bias), cotangent)
    for ours, theirs in zip(grads, gold):
        _close(ours, theirs, 1e-11)


def test_a_float64_call_computes_a_mod_reading_no_tensor_in_float64():
    """Mods are traced on float32 scores; a float64 call's mod must not round to them."""
    q, k, v = _qkv(torch.float64)
    for mod in (lambda s, b, h, qi, ki: s * 2, lambda s, b, h, qi, ki: s * 0.3 + (qi - ki),
                # torch's int * float is float32(i) * float32(0.3), not the rounded product
                lambda s, b, h, qi, ki: s + (qi + ki) * 0.3):
        expected = torch_flex(q, k, v, mod, None)
        _close(jt.flex_attention(q, k, v, mod, enable_gqa=True), expected, 1e-12)


def test_an_integer_score_is_promoted_as_torchs_is():
    q, k, v = _qkv()
    for mod in (lambda s, b, h, qi, ki: qi - ki,
                lambda s, b, h, qi, ki: torch.where(qi >= ki, 1, 0)):
        _close(jt.flex_attention(q, k, v, mod, enable_gqa=True),
               torch_flex(q, k, v, mod, None), 1e-6)


def test_differentiating_the_gradients_raises_as_torchs_backward_does():
    """A gradient penalty through attention must not silently lose its second-order term."""
    q, k, v = _qkv(requires_grad=True)
    for op in (lambda: jt.flex_attention(q, k, v, enable_gqa=True),
               lambda: jt.matmul(q[0, 0], k[0, 0].T)):
        out = op()
        dq, = torch.autograd.grad((out ** 2).sum(), q, create_graph=True)
        with pytest.raises(RuntimeError, match="differentiate twice"):
            (dq ** 2).sum().backward()


def test_a_mod_used_in_the_wrong_role_after_its_right_one_names_the_mistake():
    q, k, v = _qkv()

    def bias(score, b, h, q_idx, kv_idx):
        return score + 0.1 * (q_idx - kv_idx)

    jt.flex_attention(q, k, v, bias, enable_gqa=True)
    with pytest.raises(TypeError, match="mask_mod .*bias must take 4 arguments"):
        jt.create_block_mask(bias, None, None, L, L, "cpu")
    jt.create_block_mask(_causal, None, None, L, L, "cpu")
    with pytest.raises(TypeError, match="score_mod .*_causal must take 5 arguments"):
        jt.flex_attention(q, k, v, _causal, enable_gqa=True)


def test_meta_tensors_give_meta_results_as_torchs_ops_do():
    """Shape inference on meta tensors (how torch users size a model): every op returns meta
    tensors of the right shape and dtype, its checks included, and gradients flow."""
    q, k, v = (x.to("meta").requires_grad_() for x in _qkv(torch.bfloat16))
    mask = jt.create_block_mask(_causal, B, None, L, L, "meta", 32)
    assert mask.kv_indices.device.type == "meta" and mask.kv_indices.shape == (B, 1, 3, 3)
    assert mask.full_q_indices.device.type == "meta"
    out, lse = jt.flex_attention(q, k, v, lambda s, b, h, qi, ki: s + (qi - ki) * 0.1, mask,
                                 enable_gqa=True, return_lse=True)
    assert (out.device.type, out.shape, out.dtype) == ("meta", (B, HQ, L, E), torch.bfloat16)
    assert (lse.shape, lse.dtype) == ((B, HQ, L), torch.float32)
    out.sum().backward()
    assert q.grad.device.type == "meta" and k.grad.shape == k.shape
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        jt.flex_attention(q, k, v)
    with torch.no_grad():
        decoded = jt.flex_decode(q[:, :, :1], k, v)
    assert decoded.device.type == "meta" and decoded.shape == (B, HQ, 1, E)
    product = jt.matmul(q[0, 0], torch.empty(E, 8, device="meta", dtype=torch.bfloat16))
    assert product.device.type == "meta" and product.shape == (L, 8)
    with pytest.raises(ValueError, match="inner dimensions differ"):
        jt.matmul(q[0, 0], q[0, 0])


def test_a_scale_that_is_not_a_float_names_the_argument():
    with pytest.raises(TypeError, match="`scale` must be a Python float"):
        jt.flex_attention(*_qkv(), scale="a", enable_gqa=True)


def test_the_output_follows_the_querys_stride_order():
    q = torch.randn(B, L, HQ, E, generator=GEN).transpose(1, 2)  # [B, H, L, E] over BLHE
    k, v = (torch.randn(B, L, HKV, E, generator=GEN).transpose(1, 2) for _ in range(2))
    out = jt.flex_attention(q, k, v, enable_gqa=True)
    expected = torch_flex(q, k, v)
    assert out.stride() == expected.stride() == q.stride()
    _close(out, expected)


# ------------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True) of a module using the op
# ------------------------------------------------------------------------------------------------

SETTINGS = {"softcap": 20.0}


class _Attention(torch.nn.Module):
    """A module whose score_mod reads a parameter and a global dict: a function closing over
    the module (`as_method=False`) or the module's bound method."""

    def __init__(self, as_method: bool):
        super().__init__()
        self.head_bias = torch.nn.Parameter(torch.randn(HQ, generator=GEN))
        self.score_mod = self.score if as_method else self._closure()

    def _closure(self):
        def score(score, b, h, q_idx, kv_idx):
            cap = SETTINGS["softcap"]
            return cap * torch.tanh(score / cap) + self.head_bias[h]
        return score

    def score(self, score, b, h, q_idx, kv_idx):
        cap = SETTINGS["softcap"]
        return cap * torch.tanh(score / cap) + self.head_bias[h]

    def forward(self, q, k, v, mask):
        return jt.flex_attention(q, k, v, self.score_mod, mask, enable_gqa=True)


# torch < 2.13 hands assume_constant_result only tensors and constants, not a module (README)
_METHODS_COMPILE = torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)


@pytest.mark.parametrize("as_method", [
    False, pytest.param(True, marks=pytest.mark.skipif(
        not _METHODS_COMPILE, reason="a module's bound method compiles from torch 2.13"))])
def test_a_compiled_module_sees_changed_mod_state_without_warnings(as_method):
    from torch._dynamo.testing import CompileCounter

    q, k, v = _qkv(requires_grad=True)
    module, counter = _Attention(as_method), CompileCounter()
    mask = jt.create_block_mask(_causal, None, None, L, L, "cpu", 32)
    compiled = torch.compile(module, backend=counter, fullgraph=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _close(compiled(q, k, v, mask), module(q, k, v, mask))
            SETTINGS["softcap"] = 2.0  # a changed scalar: one re-trace
            _close(compiled(q, k, v, mask), module(q, k, v, mask))
            with torch.no_grad():
                module.head_bias.mul_(3.0)  # an in-place edit: no re-trace
            _close(compiled(q, k, v, mask), module(q, k, v, mask))
            module.head_bias = torch.nn.Parameter(torch.randn(HQ, generator=GEN))
            out = compiled(q, k, v, mask)  # a new tensor of the same shape: no re-trace
            _close(out, module(q, k, v, mask))
        assert counter.frame_count == 2
        dynamo = [w for w in caught if "_dynamo" in w.filename or "Dynamo" in str(w.message)]
        assert not dynamo, [str(w.message) for w in dynamo]
        out.sum().backward()
        assert module.head_bias.grad is not None and q.grad is not None
    finally:
        SETTINGS["softcap"] = 20.0


def test_compiled_calls_with_a_fresh_closure_each_step_do_not_recompile():
    from torch._dynamo.testing import CompileCounter

    q, k, v = _qkv()
    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def attend(q, k, v, score_mod):
        return jt.flex_attention(q, k, v, score_mod, enable_gqa=True)

    for _ in range(3):
        bias = torch.randn(HQ, generator=GEN)

        def add_bias(score, b, h, q_idx, kv_idx):
            return score + bias[h]

        _close(attend(q, k, v, add_bias), torch_flex(q, k, v, add_bias))
    assert counter.frame_count == 1


@pytest.mark.parametrize("mask_batch, mask_heads", [(1, 2), (2, 2)])
def test_a_mask_with_fewer_heads_serves_query_heads_as_torchs_kernels_read_it(mask_batch,
                                                                            mask_heads):
    """torch's kernels read a BlockMask's lists at (b % its batch, h % its heads); a head
    parity mask built for 2 heads serves 4 query heads, eagerly and compiled, with gradients."""
    q, k, v = _qkv(requires_grad=True)

    def parity(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & ((h % 2 == 0) | (q_idx - kv_idx < 20))

    mask = jt.create_block_mask(parity, mask_batch, mask_heads, L, L, "cpu", 32)
    gold = dense(*(x.double() for x in (q, k, v)), mask_mod=parity)
    cotangent = torch.randn(B, HQ, L, E, generator=GEN)
    want = torch.autograd.grad(gold, (q, k, v), cotangent.double())
    for call in (jt.flex_attention, torch.compile(jt.flex_attention, fullgraph=True)):
        out = call(q, k, v, block_mask=mask, enable_gqa=True)
        _close(out, gold.float())
        for got, expected in zip(torch.autograd.grad(out, (q, k, v), cotangent), want):
            _close(got, expected.float(), tol=2e-5)


def test_int64_values_beyond_int32_raise_rather_than_wrap():
    """Timestamps in a captured int64 tensor: narrowed to int32 they would compare wrongly;
    after subtracting a base they fit and the mask is torch's."""
    stamps = 1_720_000_000_000 + 1000 * torch.arange(L, dtype=torch.int64)

    def by_time(b, h, q_idx, kv_idx):
        return stamps[kv_idx] <= stamps[q_idx]

    with pytest.raises(ValueError, match=r"int64 values in \[1720000000000, .* beyond int32"):
        jt.create_block_mask(by_time, None, None, L, L, "cpu", 32)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="Subtract a base first"):
        jt.flex_attention(q, k, v, lambda s, b, h, qi, ki: s - 1e-3 * (stamps[qi] > 0),
                          enable_gqa=True)
    stamps = stamps - stamps.min()
    mask = jt.create_block_mask(by_time, None, None, L, L, "cpu", 32)
    assert torch.equal(mask.to_dense(), flex.create_block_mask(_causal, None, None, L, L, "cpu",
                                                               32).to_dense())


def test_float64_and_int16_tensors_a_mod_reads_serve_a_float32_call():
    """ALiBi slopes made by NumPy (float64) on float32 q, k, v, with their gradient in float64;
    int16 document ids in a mask: as in torch."""
    q, k, v = _qkv(requires_grad=True)
    slopes = torch.from_numpy(2.0 ** (-np.arange(1, HQ + 1))).requires_grad_(True)
    ids = (torch.arange(L) // 24).to(torch.int16)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def documents(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]

    mask = jt.create_block_mask(documents, None, None, L, L, "cpu", 32)
    out = jt.flex_attention(q, k, v, alibi, mask, enable_gqa=True)
    expected = torch_flex(q, k, v, alibi, documents)
    _close(out, expected, tol=2e-5)
    (grad,) = torch.autograd.grad(out.sum(), slopes)
    assert grad.dtype == torch.float64 and torch.isfinite(grad).all()
    gold = dense(*(x.detach().double() for x in (q, k, v)), alibi, documents)
    assert torch.allclose(out.double(), gold, atol=2e-5)


def test_a_sliced_block_masks_mask_mod_raises_as_in_torch():
    mask = jt.create_block_mask(_causal, None, None, L, L, "cpu", 32)
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match="sliced BlockMask"):
        jt.flex_attention(q, k, v, block_mask=mask[:, :, 1:], enable_gqa=True)


def test_compiled_backward_takes_permuted_views():
    """q, k, v as `proj(x).view(B, L, H, E).transpose(1, 2)` (and k, v halves of one fused
    projection): the compiled gradients are the eager ones."""
    x = torch.randn(B, L, 3 * HQ * E, generator=GEN, requires_grad=True)

    def attention(x):
        q, kv = x.view(B, L, 3 * HQ, E).split([HQ, 2 * HQ], dim=2)
        k, v = kv.transpose(1, 2).chunk(2, dim=1)
        return jt.flex_attention(q.transpose(1, 2), k, v).square().sum()

    (eager,) = torch.autograd.grad(attention(x), x)
    (compiled,) = torch.autograd.grad(torch.compile(attention, fullgraph=True)(x), x)
    _close(compiled, eager)


@pytest.mark.parametrize("compiled", [False, True])
def test_an_empty_batch_has_zero_gradients(compiled):
    q, k, v = (torch.zeros(0, HQ, L, E, requires_grad=True) for _ in range(3))
    bias = torch.randn(HQ, requires_grad=True)
    call = torch.compile(jt.flex_attention, fullgraph=True) if compiled else jt.flex_attention
    mask = jt.create_block_mask(_causal, None, None, L, L, "cpu", 32)
    out = call(q, k, v, lambda s, b, h, qi, ki: s + bias[h], mask)
    assert out.shape == (0, HQ, L, E)
    grads = torch.autograd.grad(out.sum(), (q, k, v, bias))
    assert [g.shape for g in grads] == [x.shape for x in (q, k, v, bias)]
    assert not any(g.any() for g in grads)


@pytest.mark.parametrize("shape, block, kwargs", [
    ((2, 2, 512, 512), 64, {}),                                  # two pairs of (batch, head)
    ((1, 3, 1000, 700), 32, {"grid_size": -1}),                  # a block a cell, ragged ends
    ((3, 2, 4096, 4096), 128, {"grid_size": (5, 7), "limit": 2}),  # cells of several blocks
])
def test_jax_block_masks_draw_and_count_as_torchs(shape, block, kwargs):
    import jattn

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx // 96 == kv_idx // 96) | (h == 1)

    ours = jattn.create_block_mask(mask_mod, *shape, block_size=block)
    theirs = flex.create_block_mask(mask_mod, *shape, device="cpu", BLOCK_SIZE=block)
    assert ours.to_string(**kwargs) == theirs.to_string(**kwargs)
    assert ours.numel() == theirs.numel()
    assert [tuple(x.shape) for x in (ours[0, 1].kv_num_blocks, ours[:, 0, 1].kv_indices)] == \
        [tuple(x.shape) for x in (theirs[0, 1].kv_num_blocks, theirs[:, 0, 1].kv_indices)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_casts_query_key_and_value_as_torch_does(dtype):
    """Under torch.autocast torch's flex_attention casts q, k and v to the autocast dtype
    (float64 excepted) and returns that dtype; gradients reach the float32 inputs."""
    q, k, v = (x.requires_grad_() for x in _qkv())
    with torch.autocast("cpu", dtype=dtype):
        out = jt.flex_attention(q, k, v, enable_gqa=True)
        expected = torch_flex(q, k, v)
    assert out.dtype == expected.dtype == dtype
    torch.testing.assert_close(out, jt.flex_attention(
        *(x.detach().to(dtype) for x in (q, k, v)), enable_gqa=True), rtol=0, atol=0)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert all(g.dtype == torch.float32 and g.shape == x.shape for g, x in zip(grads, (q, k, v)))
    with torch.autocast("cpu", dtype=dtype):
        assert jt.flex_attention(*(x.detach().double() for x in (q, k, v)),
                                 enable_gqa=True).dtype == torch.float64


def test_torchs_mask_helpers_and_types_import_from_the_bridge():
    """`from jattn.torch import ...` replaces `from torch.nn.attention.flex_attention import
    ...` for the helpers and types a training script imports with flex_attention."""
    for name in ("AuxOutput", "AuxRequest", "BlockMask", "FlexKernelOptions", "and_masks",
                 "create_mask", "noop_mask", "or_masks"):
        assert getattr(jt, name) is getattr(flex, name) and name in jt.__all__


def test_a_float64_calls_mods_see_a_float64_score():
    """torch calls a float64 call's score_mod on a float64 score, so `x.to(score.dtype)` is
    float64 there: values and gradcheck at float64 accuracy."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.float64, generator=gen) for _ in range(3))
    bias = torch.randn(2, dtype=torch.float64, generator=gen, requires_grad=True)

    def call(bias, q=q):
        def mod(score, b, h, q_idx, kv_idx):
            return score + bias[h].to(score.dtype) * torch.log1p(
                (q_idx - kv_idx).abs().to(score.dtype))
        return jt.flex_attention(q, k, v, mod)

    expected = torch_flex(q, k, v, lambda s, b, h, qi, ki: s + bias.detach()[h] * torch.log1p(
        (qi - ki).abs().to(s.dtype)))
    torch.testing.assert_close(call(bias), expected, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(call, (bias,))
    # the float32 call of the same mod keeps its own translation
    assert call(bias.detach().float(), q.float()).dtype == torch.float32


def test_return_lse_warns_once_as_torchs_deprecation_does():
    import interop.torch as bridge

    q, k, v = _qkv()
    bridge._RETURN_LSE_WARNED.clear()
    with pytest.warns(FutureWarning, match="return_aux=AuxRequest"):
        jt.flex_attention(q, k, v, enable_gqa=True, return_lse=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jt.flex_attention(q, k, v, enable_gqa=True, return_lse=True)  # (once a process)

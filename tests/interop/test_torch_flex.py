"""interop.torch.flex_attention: bitwise equal to jattn (outputs, LSE, autograd gradients),
agreement with torch's flex_attention on a torch-built BlockMask, opcheck, torch.compile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")
import interop.torch as jt  # noqa: E402
from interop import _ops  # noqa: E402
from tests.torch_mods import torch_mask, torch_score_mod  # noqa: E402

B, HQ, HKV, L, E = 2, 4, 2, 200, 32


def _qkv(dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    shapes = [(B, HQ, L, E), (B, HKV, L, E), (B, HKV, L, E)]
    return [torch.randn(s, generator=gen).to(dtype=dtype, device=device).requires_grad_()
            for s in shapes]


def _check_bitwise(dtype, device, implementation, *, length=L, head_dim=E, block=64):
    """The torch op (out, LSE, autograd gradients of random cotangents) against jattn run on
    the same arrays by `implementation`, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=gen).to(dtype=dtype, device=device).requires_grad_()
               for s in [(B, HQ, length, head_dim), (B, HKV, length, head_dim),
                         (B, HKV, length, head_dim)])
    score_mod = jattn.mods.alibi(jattn.mods.alibi_slopes(HQ))
    block_mask = jt.create_block_mask(jattn.masks.sliding_window(90), None, None, length,
                                      length, BLOCK_SIZE=block, device=device)
    out, lse = jt.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True,
                                 return_lse=True, implementation=implementation)
    gen = torch.Generator().manual_seed(1)
    d_out = torch.randn(out.shape, generator=gen).to(out)
    d_lse = torch.randn(lse.shape, generator=gen).to(lse)
    torch.autograd.backward((out, lse), (d_out, d_lse))

    jmask = jattn.create_block_mask(jattn.masks.sliding_window(90), None, None, length, length,
                                    block_size=block)

    def run(q, k, v):
        return jattn.flex_attention(q, k, v, score_mod, jmask, enable_gqa=True,
                                    return_lse=True, implementation=implementation)

    arrays = [jax.dlpack.from_dlpack(x.detach()) for x in (q, k, v, d_out, d_lse)]
    ours = jax.jit(run)(*arrays[:3])
    grads = jax.jit(lambda q, k, v, do, dl: jax.vjp(run, q, k, v)[1]((do, dl)))(*arrays)
    for name, tensor, array in (("out", out, ours[0]), ("lse", lse, ours[1])):
        np.testing.assert_array_equal(tensor.detach().float().cpu().numpy(),
                                      np.asarray(array, np.float32), err_msg=name)
    for name, tensor, g in zip("qkv", (q, k, v), grads):
        np.testing.assert_array_equal(tensor.grad.float().cpu().numpy(),
                                      np.asarray(g, np.float32), err_msg=f"d{name}")


@pytest.mark.gpu
def test_dropout_p_on_cuda_is_jattns_dropout_bit_for_bit():
    """On CUDA the seed comes from the GPU's generator; out, LSE and gradients equal jattn's
    dropout on the same seed (pallas_triton's kernels: Mosaic GPU's lack dropout)."""
    from jattn._src import bridge

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=gen).to(dtype=torch.bfloat16, device="cuda")
               .requires_grad_() for s in [(B, HQ, 512, 64), (B, HKV, 512, 64),
                                           (B, HKV, 512, 64)])
    block_mask = jt.create_block_mask(jattn.masks.causal_mask, None, None, 512, 512,
                                      device="cuda")
    torch.manual_seed(3)
    out, lse = jt.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True,
                                 return_lse=True, dropout_p=0.2)
    d_out = torch.randn(out.shape, generator=gen).to(out)
    torch.autograd.backward(out, d_out)
    torch.manual_seed(3)
    seed = torch.randint(-2 ** 31, 2 ** 31 - 1, (2,), dtype=torch.int32, device="cuda")
    jmask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 512, 512)

    def run(q, k, v):
        return bridge.flex_attention(q, k, v, None, jmask, enable_gqa=True, return_lse=True,
                                     dropout=bridge.Dropout(0.2, jax.dlpack.from_dlpack(seed)))

    arrays = [jax.dlpack.from_dlpack(x.detach()) for x in (q, k, v, d_out)]
    expected = jax.jit(run)(*arrays[:3])
    grads = jax.jit(lambda q, k, v, do: jax.vjp(run, q, k, v)[1](
        (do, jnp.zeros(expected[1].shape, expected[1].dtype))))(*arrays)
    for name, tensor, array in (("out", out, expected[0]), ("lse", lse, expected[1]),
                                ("dq", q.grad, grads[0]), ("dk", k.grad, grads[1]),
                                ("dv", v.grad, grads[2])):
        np.testing.assert_array_equal(tensor.detach().float().cpu().numpy(),
                                      np.asarray(array, np.float32), err_msg=name)
    assert (out != 0).any() and not torch.equal(out, jt.flex_attention(
        q, k, v, block_mask=block_mask, enable_gqa=True))


def test_bitwise_equal_to_jattn():
    _check_bitwise(torch.float32, "cpu", "xla")


@pytest.mark.gpu
def test_bitwise_equal_to_jattn_on_cuda():
    _check_bitwise(torch.bfloat16, "cuda", "pallas_triton")


@pytest.mark.gpu
def test_bitwise_equal_to_jattn_on_mosaic_gpu():
    """Hopper: the Mosaic forward and backward, the backward through JAX's dispatch."""
    from jattn._src import hardware

    if not hardware.is_hopper():
        pytest.skip("the Mosaic GPU kernels need a Hopper GPU")
    _check_bitwise(torch.bfloat16, "cuda", "pallas_mosaic_gpu", length=512, head_dim=64,
                   block=128)


@pytest.mark.gpu
def test_ordered_with_torch_work_on_a_side_stream():
    """q/k/v written by torch kernels queued behind a GPU sleep on a non-default stream just
    before the op are read after they finish; torch work after the op sees its output."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        q = torch.zeros(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16)
        v = torch.zeros(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16)
        jt.flex_attention(q, q, v)  # compiled now, so the call below is not slower
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the producers run
        q.fill_(0.5)
        v.fill_(2.0)
        out = jt.flex_attention(q, q, v)
        doubled = out * 2  # consumer on the same stream
    torch.cuda.synchronize()
    assert torch.all(out == 2.0) and torch.all(doubled == 4.0)


def test_torch_block_mask_agrees_with_torch_flex_attention():
    """A BlockMask from torch's own builder (the mod is plain arithmetic, valid for torch and
    JAX) drives our op; outputs and LSE agree with torch's flex_attention."""
    q, k, v = (x.detach() for x in _qkv())
    block_mask = flex.create_block_mask(jattn.masks.causal_mask, None, None, L, L,
                                        device="cpu", BLOCK_SIZE=64)
    out, lse = jt.flex_attention(q, k, v, None, block_mask, enable_gqa=True, return_lse=True)
    expected, expected_lse = flex.flex_attention(q, k, v, block_mask=block_mask,
                                                 enable_gqa=True, return_lse=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-5, atol=1e-5)


def test_opcheck():
    q, k, v = _qkv()
    block_mask = jt.create_block_mask(jattn.masks.causal_mask, None, None, L, L, device="cpu")
    lists, block_size = jt._mask_tensors(block_mask, L, L)
    table = torch.randn(HQ, 9, requires_grad=True)
    mods, captures = _ops.capture_mods(lambda s, b, h, qi, ki: s + table[h, (qi - ki) % 9],
                                       jattn.masks.causal_mask)
    assert len(captures) == 1 and captures[0] is table
    captures = list(captures)
    static = (mods, block_size, [L, L], None, True, None, None)
    torch.library.opcheck(torch.ops.jattn.flex_attention.default,
                          (q, k, v, lists, captures, *static))
    out, lse = torch.ops.jattn.flex_attention(q, k, v, lists, captures, *static)
    torch.library.opcheck(torch.ops.jattn.flex_attention_backward.default,
                          (torch.randn_like(out), torch.randn_like(lse), q.detach(),
                           k.detach(), v.detach(), out.detach(), lse.detach(), lists,
                           [table.detach()], *static))


def test_on_hopper_torch_mods_choose_as_jattn_does(as_if_on_hopper):
    """The facts the ops pass on CUDA tensors: mods reading captured tensors one element per
    head (ALiBi slopes) or by position (document ids) keep the Mosaic GPU forward; one reading
    a table by relative position falls back to pallas_triton."""
    from jattn._src import bridge
    slopes, doc_ids = torch.linspace(0.1, 1.0, HQ), torch.arange(4096) // 512
    relative = torch.randn(2 * 4096)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def same_document(b, h, q_idx, kv_idx):
        return doc_ids[q_idx] == doc_ids[kv_idx]

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + relative[q_idx - kv_idx + 4096]

    q = torch.zeros(B, HQ, 4096, 128, dtype=torch.bfloat16)
    for (score_mod, mask_mod), chosen in (((alibi, None), "pallas_mosaic_gpu"),
                                          ((alibi, same_document), "pallas_mosaic_gpu"),
                                          ((relative_bias, same_document), "pallas_triton")):
        mods, captures = _ops.capture_mods(score_mod, mask_mod)
        facts = _ops.flex_facts(q, q, mods, captures)
        assert bridge.resolve("flex_attention", None, on_cuda=True, seq_lengths=(4096, 4096),
                              block_size=(128, 128), score_mod=True, **facts) == chosen


@pytest.mark.parametrize("return_lse", [False, True])
def test_eager_path_matches_the_registered_op(return_lse):
    """Outside torch.compile flex_attention runs an autograd.Function twin of the registered
    ops (the LSE kept on the JAX side unless returned): same outputs and gradients, bit for
    bit, for q, k, v and a captured table."""
    q, k, v = _qkv()
    block_mask = jt.create_block_mask(jattn.masks.causal_mask, None, None, L, L, device="cpu")
    table = torch.randn(HQ, 9, requires_grad=True)
    score_mod = lambda s, b, h, qi, ki: s + table[h, (qi - ki) % 9]  # noqa: E731
    mods, _ = _ops.capture_mods(score_mod, jattn.masks.causal_mask)
    lists, block_size = jt._mask_tensors(block_mask, L, L)
    static = (mods, block_size, [L, L], None, True, None, None)
    gen = torch.Generator().manual_seed(4)
    d_out = torch.randn(B, HQ, L, E, generator=gen)
    d_lse = torch.randn(B, HQ, L, generator=gen) if return_lse else torch.zeros(B, HQ, L)

    def eager():
        result = jt.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True,
                                   return_lse=return_lse)
        return result if return_lse else (result, None)

    def registered():
        return torch.ops.jattn.flex_attention(q, k, v, lists, [table], *static)

    results = []
    for run in (eager, registered):
        out, lse = run()
        outputs = (out, lse) if return_lse else (out,)
        grads = torch.autograd.grad(outputs, (q, k, v, table), (d_out, d_lse)[:len(outputs)])
        results.append((out.detach(), *grads))
    for eager_result, registered_result in zip(*results):
        assert torch.equal(eager_result, registered_result)


def test_calls_without_a_gradient_skip_autograd(monkeypatch):
    """No input or captured table requiring grad (or grad mode off): the op runs without its
    autograd.Function, with the same outputs bit for bit and no graph recorded."""
    q, k, v = (t.detach() for t in _qkv())
    block_mask = jt.create_block_mask(jattn.masks.causal_mask, None, None, L, L, device="cpu")
    table = torch.randn(HQ, 9, generator=torch.Generator().manual_seed(6))
    score_mod = lambda s, b, h, qi, ki: s + table[h, (qi - ki) % 9]  # noqa: E731

    def run():
        return jt.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True,
                                 return_lse=True)

    table.requires_grad_()
    recorded = run()
    assert recorded[0].grad_fn is not None
    monkeypatch.setattr(_ops._EagerFlex, "apply", None)  # the Function unused from here
    with torch.no_grad():
        no_grad = run()
    table.requires_grad_(False)
    for outputs in (no_grad, run()):
        for out, expected in zip(outputs, recorded):
            assert out.grad_fn is None and torch.equal(out, expected.detach())
    without_lse = jt.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True)
    assert torch.equal(without_lse, recorded[0].detach())  # its own program, same output


def test_block_masks_of_one_layout_share_a_plan_and_keep_their_lists():
    """Eager calls find their plan by mods and mask layout, not by BlockMask: two masks with
    the same mask_mod (none) and sizes but different blocks share one plan, and each call
    still reads its own lists. Reference: dense float64 attention over the allowed blocks
    (torch's uncompiled flex_attention applies mask_mod only, not the block lists)."""
    q, k, v = (x.detach() for x in _qkv())
    n = -(-L // 64)
    rows = torch.arange(n)
    causal_blocks = (rows[:, None] >= rows[None, :]).int()
    diagonal_blocks = torch.eye(n, dtype=torch.int32)
    block_of = torch.arange(L) // 64
    scores = q.double() @ k.double().repeat_interleave(HQ // HKV, 1).transpose(-1, -2)
    plans_before = len(_ops.FLEX_PLANS)
    for blocks in (causal_blocks, diagonal_blocks):
        counts = blocks.sum(1).int()[None, None]
        indices = torch.argsort(-blocks, dim=1, stable=True).int()[None, None]
        block_mask = flex.BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=64,
                                                   seq_lengths=(L, L))
        out = jt.flex_attention(q, k, v, None, block_mask, enable_gqa=True)
        allowed = blocks.bool()[block_of[:, None], block_of[None, :]]
        weights = torch.softmax((scores / E**0.5).masked_fill(~allowed, -torch.inf), -1)
        expected = weights @ v.double().repeat_interleave(HQ // HKV, 1)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert len(_ops.FLEX_PLANS) == plans_before + 1


def test_compiles_without_graph_breaks():
    q, k, v = _qkv()
    block_mask = jt.create_block_mask(jattn.masks.causal_mask, None, None, L, L, device="cpu")
    score_mod = jattn.mods.softcap(20.0)

    def attend(q, k, v):
        return torch.relu(jt.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True))

    out = torch.compile(attend, fullgraph=True)(q, k, v)  # raises on a graph break
    torch.testing.assert_close(out, attend(q, k, v), rtol=0, atol=0)
    out.sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None


def test_bad_input_raises():
    q, k, v = (x.detach() for x in _qkv())
    with pytest.raises(TypeError, match="`block_mask` must be a torch BlockMask"):
        jt.flex_attention(q, k, v, None, jattn.create_block_mask(jattn.masks.causal_mask,
                                                                  None, None, L, L))
    other = jt.create_block_mask(jattn.masks.causal_mask, None, None, 2 * L, L, device="cpu")
    with pytest.raises(ValueError, match="built for \\(Q_LEN, KV_LEN\\) = \\(400, 200\\)"):
        jt.flex_attention(q, k, v, None, other, enable_gqa=True)
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        jt.flex_attention(q, k, v)
    with pytest.raises(ValueError, match="implementation='pallas_triton' cannot run this call.*runs on CUDA tensors needs them moved with .cuda()"):
        jt.flex_attention(q, k, v, enable_gqa=True, implementation="pallas_triton")


# ------------------------------------------------------------------------------------------------
# torch-written mods
# ------------------------------------------------------------------------------------------------

SEGMENTS = torch.arange(L) // 37
SLOPES = torch.exp2(-8.0 * torch.arange(1, HQ + 1) / HQ)
RADIUS = 30

@pytest.mark.parametrize("mask,mod", [("causal", "alibi"), ("sliding", "none"),
                                      ("prefix", "softcap"), ("document", "relative")])
def test_torch_written_mods_agree_with_torch_flex_attention(mask, mod):
    q, k, v = (x.detach() for x in _qkv())
    table = torch.randn(HQ, 2 * RADIUS + 1)
    score_mod = torch_score_mod(mod, SLOPES, table, RADIUS)
    ours_mask = jt.create_block_mask(torch_mask(mask, SEGMENTS), None, None, L, L,
                                     BLOCK_SIZE=64, device="cpu")
    torch_block_mask = flex.create_block_mask(torch_mask(mask, SEGMENTS), None, None, L, L,
                                              device="cpu", BLOCK_SIZE=64)
    out, lse = jt.flex_attention(q, k, v, score_mod, ours_mask, enable_gqa=True,
                                 return_lse=True)
    expected, expected_lse = flex.flex_attention(q, k, v, score_mod, torch_block_mask,
                                                 enable_gqa=True, return_lse=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-5, atol=1e-5)


def test_captured_table_gets_the_gradient_jattn_gives():
    """A torch-written relative bias reading a learnable table: torch autograd's gradient for
    the table equals JAX's for the same table through jattn.mods.relative_position_bias."""
    q, k, v = _qkv()
    table = torch.randn(HQ, 2 * RADIUS + 1, requires_grad=True)
    block_mask = jt.create_block_mask(torch_mask("causal", SEGMENTS), None, None, L, L,
                                      device="cpu")
    out = jt.flex_attention(q, k, v, torch_score_mod("relative", SLOPES, table, RADIUS),
                            block_mask, enable_gqa=True)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    out.backward(d_out)

    def run(q, k, v, table):
        jmask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, L)
        return jattn.flex_attention(q, k, v, jattn.mods.relative_position_bias(table), jmask,
                                    enable_gqa=True, implementation="xla")

    with jax.default_device(jax.devices("cpu")[0]):  # as the op on CPU tensors (no TF32)
        arrays = [jnp.asarray(x.detach().numpy()) for x in (q, k, v, table)]
        grads = jax.vjp(run, *arrays)[1](jnp.asarray(d_out.numpy()))
    for name, tensor, g in zip(("q", "k", "v", "table"), (q, k, v, table), grads):
        np.testing.assert_allclose(tensor.grad.numpy(), np.asarray(g), rtol=1e-5, atol=1e-5,
                                   err_msg=name)


@pytest.mark.parametrize("compiled", [False, True])
def test_only_captures_that_require_grad_are_differentiated(monkeypatch, compiled):
    """A score_mod reading a learnable table and fixed alibi slopes, eagerly and compiled: the
    table gets its gradient, the slopes none, and the backward's pass over captured arrays
    differentiates the table alone."""
    from jattn._src.attention import xla
    seen = []
    gradients = xla.gradients
    monkeypatch.setattr(xla, "gradients",
                        lambda *args, **kwargs: seen.append(args[11]) or gradients(*args,
                                                                                   **kwargs))
    q, k, v = _qkv()
    table = torch.randn(HQ, 2 * RADIUS + 1, requires_grad=True)
    slopes = SLOPES.clone()
    relative = torch_score_mod("relative", None, table, RADIUS)
    alibi = torch_score_mod("alibi", slopes, None, RADIUS)
    # a block size of its own: programs not made by other tests, so the trace is seen here
    block_mask = jt.create_block_mask(torch_mask("causal", SEGMENTS), None, None, L, L,
                                      BLOCK_SIZE=32 if compiled else 16, device="cpu")

    def both(s, b, h, qi, ki):
        return alibi(relative(s, b, h, qi, ki), b, h, qi, ki)

    def attend(q, k, v):
        return jt.flex_attention(q, k, v, both, block_mask, enable_gqa=True)

    out = (torch.compile(attend, fullgraph=True) if compiled else attend)(q, k, v)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3)))
    assert table.grad is not None and torch.isfinite(table.grad).all()
    assert table.grad.abs().sum() > 0 and slopes.grad is None and q.grad is not None
    assert seen and all(tuple(map(bool, pattern)) == (True, False) for pattern in seen)


def test_untranslatable_op_names_the_op_and_the_mod():
    q, k, v = (x.detach() for x in _qkv())

    def zeta_mod(s, b, h, qi, ki):
        return torch.special.zeta(s, s)

    with pytest.raises(NotImplementedError,
                       match="score_mod .*zeta_mod uses aten.special_zeta.default"):
        jt.flex_attention(q, k, v, zeta_mod, enable_gqa=True)


def test_a_lambda_recreated_per_call_is_translated_once():
    """A fresh closure per call over a tensor of the same shape reuses one translation, and
    each call hands over the tensor it closes over now."""
    tables = [torch.randn(HQ, 3) for _ in range(3)]
    captured = [_ops.capture_mods(lambda s, b, h, qi, ki: s + t[h, qi % 3], None)
                for t in tables]
    assert len({key for key, _ in captured}) == 1
    assert all(tensors[0] is t for (_, tensors), t in zip(captured, tables))


def _run_with_and_without_direct_launch(monkeypatch, call):
    """(call()'s results with the direct launch, the programs it still ran through JAX), then
    call()'s results with the direct launch turned off."""
    from interop._direct import DirectProgram
    through_jax = []
    run = _ops.run
    with monkeypatch.context() as patched:
        patched.setattr(_ops, "run", lambda program, *a: through_jax.append(program)
                        or run(program, *a))
        direct = call()
    with monkeypatch.context() as patched:
        patched.setattr(DirectProgram, "__call__", lambda self, tensors: None)
        return direct, through_jax, call()


@pytest.mark.gpu
@pytest.mark.parametrize("mask,mod", [("causal", "none"), ("document", "relative"),
                                      ("sliding", "alibi")])
def test_direct_launch_gives_the_bits_of_the_jax_path(monkeypatch, mask, mod):
    """On CUDA a forward that is one kernel compiled by `triton` (here E=32) is launched
    without JAX, with or without autograd, and so is a backward that is kernels alone, all
    compiled by `triton` (no score_mod); out, LSE and the gradients for q, k, v (random
    cotangents) equal the JAX path's bit for bit, a captured bias table's gradient to float32
    rounding."""
    q, k, v = _qkv(torch.bfloat16, "cuda")
    table = torch.randn(HQ, 2 * RADIUS + 1, device="cuda", requires_grad=True)
    score_mod = torch_score_mod(mod, SLOPES.cuda(), table, RADIUS)
    block_mask = jt.create_block_mask(torch_mask(mask, SEGMENTS.to(torch.int32).cuda()), None,
                                      None, L, L, BLOCK_SIZE=64, device="cuda")
    cotangents = [torch.randn(s, device="cuda", generator=torch.Generator("cuda").manual_seed(i))
                  for i, s in enumerate([(B, HQ, L, E), (B, HQ, L)])]

    def call():
        with torch.no_grad():
            inference = jt.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True,
                                          return_lse=True)
        out, lse = jt.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True,
                                     return_lse=True)
        inputs = [q, k, v, table] if mod == "relative" else [q, k, v]  # what the op reads
        grads = torch.autograd.grad((out, lse), inputs,
                                    (cotangents[0].to(out.dtype), cotangents[1]))
        # a strided cotangent (as after a transpose) and no LSE cotangent
        out = jt.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True)
        strided = cotangents[0].to(out.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        grads_strided = torch.autograd.grad(out, inputs[:3], strided)
        return [*inference, out.detach(), lse.detach(), *grads, *grads_strided]

    direct, through_jax, expected = _run_with_and_without_direct_launch(monkeypatch, call)
    forwards = {f for plan in _ops.FLEX_PLANS.values() for f in (plan.forward, plan.forward_lse)}
    assert not forwards.intersection(through_jax)
    if mod == "none":
        assert not through_jax
    else:  # with a score_mod the backward's kernels are compiled by XLA (faster there)
        assert through_jax
    assert len(direct) == len(expected)
    for index, (got, want) in enumerate(zip(direct, expected)):
        if mod == "relative" and index == 7:  # summed by XLA's scatter-add in no fixed order:
            # two runs of the same JAX program differ by up to ~4e-5 here (H100), not bitwise
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        else:
            assert torch.equal(got, want), index


@pytest.mark.gpu
def test_tensors_the_kernel_cannot_take_in_place_are_copied_for_it(monkeypatch):
    """A non-contiguous q and a q at an odd address are copied (as JAX's path copies them:
    XLA's GPU runtime rejects unaligned buffers) and launched directly, with the same bits."""
    q, k, v = (x.detach() for x in _qkv(torch.bfloat16, "cuda"))
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")[1:].view(q.shape)
    shifted.copy_(q)
    expected = jt.flex_attention(q, k, v, enable_gqa=True)
    monkeypatch.setattr(_ops, "_run_plan", _through_jax_only)
    for odd in (strided, shifted):
        assert torch.equal(jt.flex_attention(odd, k, v, enable_gqa=True), expected)


def _through_jax_only(*args, **kwargs):
    raise AssertionError("this call was expected to launch its kernel without JAX")


@pytest.mark.gpu
def test_float32_follows_torchs_tf32_flag():
    """float32 on CUDA: full float32 products unless torch.backends.cuda.matmul.allow_tf32,
    as torch's own flex_attention (here its eager path, which runs torch matmuls)."""
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    generator = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 4, 256, 64, device="cuda", generator=generator)
               for _ in range(3))
    flag = torch.backends.cuda.matmul.allow_tf32
    try:
        errors = {}
        for allow_tf32 in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = False
            expected = torch_flex(q.double(), k.double(), v.double()).float()
            torch.backends.cuda.matmul.allow_tf32 = allow_tf32
            errors[allow_tf32] = (jt.flex_attention(q, k, v) - expected).abs().max().item()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = flag
    assert errors[False] < 2e-6 < errors[True]


def test_sinks_agree_with_torch_flex_attention_patched_through_its_lse():
    """jattn's sinks keyword against what torch users write today: torch's flex_attention's
    output rescaled through its LSE, in float64; gradients of q, k, v and the sinks against
    torch autograd through a softmax with the sink as one more column (torch's flex has no
    CPU backward)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, HQ, 64, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(HQ, generator=gen, dtype=torch.float64)
    causal = jattn.masks.causal_mask
    ours_mask = jt.create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    torch_mask = flex.create_block_mask(causal, None, None, 64, 64, device="cpu",
                                        BLOCK_SIZE=32)

    def ours(q, k, v, sinks):
        return jt.flex_attention(q, k, v, block_mask=ours_mask, sinks=sinks, return_lse=True)

    out, lse = flex.flex_attention(q, k, v, block_mask=torch_mask, return_lse=True)
    patched_lse = torch.logaddexp(lse, sinks[:, None])
    patched = out * torch.exp(lse - patched_lse)[..., None]
    for got, expected in zip(ours(q, k, v, sinks), (patched, patched_lse)):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)

    def softmax_with_a_sink_column(q, k, v, sinks):
        scores = (q @ k.transpose(-1, -2)) * 16 ** -0.5
        scores = scores.masked_fill(~torch.ones(64, 64, dtype=torch.bool).tril(), -torch.inf)
        column = sinks[None, :, None, None].expand(*scores.shape[:3], 1)
        full = torch.cat([scores, column], dim=-1)
        return torch.softmax(full, dim=-1)[..., :-1] @ v, torch.logsumexp(full, dim=-1)

    cotangents = [torch.randn(1, HQ, 64, 16, generator=gen, dtype=torch.float64),
                  torch.randn(1, HQ, 64, generator=gen, dtype=torch.float64)]
    grads = []
    for attend in (ours, softmax_with_a_sink_column):
        inputs = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
        torch.autograd.backward(attend(*inputs), cotangents)
        grads.append([x.grad for x in inputs])
    for got, expected, name in zip(*grads, ["dq", "dk", "dv", "dsinks"]):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10, msg=name)
    with pytest.raises(ValueError, match=r"`sinks` must hold one logit per query head"):
        jt.flex_attention(q, k, v, sinks=torch.zeros(2, dtype=torch.float64))


def test_dropout_p_is_jattns_dropout_with_the_seed_torchs_generator_drew():
    """dropout_p (a jattn addition): out, LSE and autograd gradients equal jattn's dropout
    given the seed torch's generator drew (the same mask); torch.manual_seed repeats a call,
    eager or compiled, another seed draws another mask; bad values raise."""
    from jattn._src import bridge

    q, k, v = _qkv()
    score_mod = jattn.mods.alibi(jattn.mods.alibi_slopes(HQ))
    block_mask = jt.create_block_mask(jattn.masks.causal_mask, None, None, L, L, BLOCK_SIZE=64,
                                      device="cpu")

    def ours(seed):
        torch.manual_seed(seed)
        return jt.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True,
                                 return_lse=True, dropout_p=0.25)

    out, lse = ours(5)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    d_lse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(2))
    torch.autograd.backward((out, lse), (d_out, d_lse))
    torch.manual_seed(5)
    seed = jnp.asarray(torch.randint(-2 ** 31, 2 ** 31 - 1, (2,), dtype=torch.int32).numpy())
    jmask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, L, block_size=64)

    def run(q, k, v):
        return bridge.flex_attention(q, k, v, score_mod, jmask, enable_gqa=True, return_lse=True,
                                     dropout=bridge.Dropout(0.25, seed))

    arrays = [jnp.asarray(x.detach().numpy()) for x in (q, k, v, d_out, d_lse)]
    expected, vjp = jax.vjp(run, *arrays[:3])
    for got, want in zip((out, lse), expected):
        np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-6, atol=1e-6)
    for x, want in zip((q, k, v), vjp(tuple(arrays[3:]))):
        np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert torch.equal(ours(5)[0], out.detach())
        assert not torch.allclose(ours(6)[0], out.detach())
        # under torch.compile: a graph break around the eager call, the same mask
        compiled = torch.compile(lambda q, k, v: jt.flex_attention(
            q, k, v, score_mod, block_mask, enable_gqa=True, dropout_p=0.25))
        torch.manual_seed(5)
        assert torch.equal(compiled(q, k, v), out.detach())
    with pytest.raises(ValueError, match=r"`dropout_p` must be in \[0, 1\), got 1.0"):
        jt.flex_attention(q, k, v, dropout_p=1.0)
    with pytest.raises(TypeError, match="`dropout_p` must be a float"):
        jt.flex_attention(q, k, v, dropout_p="0.1")


def test_dropout_p_with_max_scores_gives_the_scores_before_dropout():
    """AuxRequest(max_scores=True) with dropout_p: the same largest scores as without dropout
    (dropout acts on the weights), beside dropout's output and LSE, and gradients flow."""
    q, k, v = _qkv()
    block_mask = jt.create_block_mask(jattn.masks.causal_mask, None, None, L, L, BLOCK_SIZE=64,
                                      device="cpu")
    request = flex.AuxRequest(lse=True, max_scores=True)
    torch.manual_seed(3)
    out, aux = jt.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True,
                                 return_aux=request, dropout_p=0.25)
    torch.manual_seed(3)
    dropped, lse = jt.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True,
                                     return_lse=True, dropout_p=0.25)
    _, plain = jt.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True,
                                 return_aux=request)
    assert torch.equal(out, dropped) and torch.equal(aux.lse, lse)
    assert torch.equal(aux.max_scores, plain.max_scores)
    assert not aux.max_scores.requires_grad
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()

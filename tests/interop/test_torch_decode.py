"""interop.torch.flex_decode and PagedKVCache: bitwise equal to jattn.flex_decode (contiguous and
paged caches, GQA, per-sequence kv_len, a torch-written score_mod and mask), assign against
jattn.PagedKVCache.assign, opcheck, torch.compile, inference-only, bad inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn

torch = pytest.importorskip("torch")
import interop.torch as jt  # noqa: E402
from interop import _ops  # noqa: E402

B, HQ, HKV, LQ, S, E, PAGE = 3, 8, 2, 2, 160, 16, 32
KV_LEN = [160, 70, 3]  # a full cache, a length inside a page, one barely above Lq
WINDOW = 48


def _qkv(dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    shapes = [(B, HQ, LQ, E), (B, HKV, S, E), (B, HKV, S, E)]
    return [torch.randn(s, generator=gen).to(dtype=dtype, device=device) for s in shapes]


def _mods(device):
    """(torch score_mod, its JAX twin, torch mask_mod, its JAX twin): ALiBi over slopes on
    `device`, a sliding window."""
    slopes = torch.exp2(-8.0 * torch.arange(1, HQ + 1) / HQ).to(device)
    slopes_jax = jnp.asarray(slopes.cpu().numpy())

    def torch_alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def jax_alibi(score, b, h, q_idx, kv_idx):
        return score + slopes_jax[h] * (kv_idx - q_idx)

    def sliding(b, h, q_idx, kv_idx):  # plain arithmetic: valid for torch and JAX alike
        return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)

    return torch_alibi, jax_alibi, sliding, sliding


def _paged_cache(k, v, kv_len, num_pages=20):
    """A torch PagedKVCache holding k/v's first kv_len[b] positions of each sequence on
    scattered pages (written with assign); pages past a length stay unassigned."""
    table = torch.randperm(num_pages, generator=torch.Generator().manual_seed(2))
    table = table[:B * (S // PAGE)].reshape(B, S // PAGE).to(torch.int32)
    for b, length in enumerate(kv_len):
        table[b, -(-length // PAGE):] = -1
    cache = jt.PagedKVCache.create(num_pages, PAGE, HKV, E, table, dtype=k.dtype,
                                   device=k.device)
    for b, length in enumerate(kv_len):
        cache.assign(k[b:b + 1, :, :length], v[b:b + 1, :, :length], [0], batch_idx=[b])
    return cache


def _to_jax(x):
    return jax.dlpack.from_dlpack(x.detach().contiguous())


def _check_bitwise(dtype, device, implementation, paged, mods, kv_len):
    """Our op against jax.jit(jattn.flex_decode) on the same memory."""
    q, k, v = _qkv(dtype, device)
    score_mod = mask_mod = jax_score_mod = jax_mask_mod = None
    if mods:
        score_mod, jax_score_mod, mask_mod, jax_mask_mod = _mods(device)
    block_mask = None if mask_mod is None else jt.create_block_mask(
        mask_mod, None, None, S, S, BLOCK_SIZE=PAGE, device=device)
    jax_mask = None if mask_mod is None else jattn.create_block_mask(
        jax_mask_mod, None, None, S, S, block_size=PAGE)
    lengths = None if kv_len is None else torch.tensor(kv_len, device=device)
    cache = _paged_cache(k, v, kv_len) if paged else None  # pages past kv_len unassigned
    out, lse = jt.flex_decode(q, cache if paged else k, None if paged else v, score_mod,
                              block_mask, kv_len=lengths, return_lse=True,
                              implementation=implementation)

    def run(q, k, v, kv_len):
        return jattn.flex_decode(q, k, v, jax_score_mod, jax_mask, kv_len=kv_len,
                                 return_lse=True, implementation=implementation)

    if paged:
        k = jattn.PagedKVCache(*map(_to_jax, (cache.k_pages, cache.v_pages, cache.page_table)))
        v = None
    else:
        k, v = _to_jax(k), _to_jax(v)
    expected = jax.jit(run)(_to_jax(q), k, v, None if lengths is None else _to_jax(lengths))
    for name, tensor, array in (("out", out, expected[0]), ("lse", lse, expected[1])):
        np.testing.assert_array_equal(tensor.float().cpu().numpy(),
                                      np.asarray(array, np.float32), err_msg=name)


@pytest.mark.parametrize("paged,mods,kv_len", [
    (False, False, None),
    (False, True, KV_LEN),
    (True, True, KV_LEN),
    (True, False, [100, 64, 1]),
])
def test_bitwise_equal_to_jattn(paged, mods, kv_len):
    _check_bitwise(torch.float32, "cpu", "xla", paged, mods, kv_len)


def test_bitwise_equal_to_jattn_interpreted_kernel():
    """The Pallas decode kernel (interpreted) through the op, paged, with both mods."""
    _check_bitwise(torch.float32, "cpu", "interpret", True, True, KV_LEN)


def test_decode_loop_reads_tokens_written_in_place():
    """Tokens assigned (paged) or written (contiguous) in place after a call are read by the
    next one, though the JAX views of the pools and of k/v are cached; int kv_len."""
    q, k, v = _qkv()
    cache = _paged_cache(k, v, [S] * B)
    gen = torch.Generator().manual_seed(3)
    for length in (100, 101, 102):
        expected = jt.flex_decode(q, k.clone(), v.clone(), kv_len=length)  # fresh tensors
        paged = jt.flex_decode(q, cache, None, kv_len=length)
        contiguous = jt.flex_decode(q, k, v, kv_len=torch.full((B,), length))
        torch.testing.assert_close(paged, expected, rtol=0, atol=0)
        torch.testing.assert_close(contiguous, expected, rtol=0, atol=0)
        new_k, new_v = (torch.randn(B, HKV, 1, E, generator=gen) for _ in range(2))
        cache.assign(new_k, new_v, torch.full((B,), length))
        k[:, :, length], v[:, :, length] = new_k[:, :, 0], new_v[:, :, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_bitwise_equal_to_jattn_on_cuda(paged):
    _check_bitwise(torch.bfloat16, "cuda", "pallas_triton", paged, True, KV_LEN)


@pytest.mark.gpu
def test_bad_lengths_on_cuda_give_nan_rows():
    """CUDA values are not read back: as jattn under jit, the rows of a sequence whose kv_len
    is out of range or reaches an unassigned page are NaN, the others unaffected."""
    q, k, v = _qkv(torch.bfloat16, "cuda")
    cache = _paged_cache(k, v, KV_LEN)
    good = jt.flex_decode(q, cache, None, kv_len=torch.tensor(KV_LEN, device="cuda"))
    bad = jt.flex_decode(q, cache, None, kv_len=torch.tensor([161, 100, 3], device="cuda"))
    assert bad[:2].isnan().all() and torch.equal(bad[2], good[2])


# ------------------------------------------------------------------------------------------------
# PagedKVCache.assign
# ------------------------------------------------------------------------------------------------

TABLE = [[3, 5, -1], [0, 7, 1]]


def test_assign_matches_jattn_in_place():
    gen = torch.Generator().manual_seed(1)
    prompt_k, prompt_v = (torch.randn(2, 2, 6, 8, generator=gen) for _ in range(2))
    token_k, token_v = (torch.randn(1, 2, 2, 8, generator=gen) for _ in range(2))
    cache = jt.PagedKVCache.create(8, 4, 2, 8, TABLE, dtype=torch.bfloat16)
    pointers = cache.k_pages.data_ptr(), cache.v_pages.data_ptr()
    assert cache.assign(prompt_k, prompt_v, [0, 2]) is cache
    cache.assign(token_k, token_v, [[9, 3]], batch_idx=[1])

    expected = jattn.PagedKVCache.create(8, 4, 2, 8, jnp.asarray(TABLE), dtype=jnp.bfloat16)
    expected = expected.assign(_to_jax(prompt_k), _to_jax(prompt_v), jnp.asarray([0, 2]))
    expected = expected.assign(_to_jax(token_k), _to_jax(token_v), jnp.asarray([[9, 3]]),
                               batch_idx=jnp.asarray([1]))
    assert (cache.k_pages.data_ptr(), cache.v_pages.data_ptr()) == pointers
    for ours, theirs in ((cache.k_pages, expected.k_pages), (cache.v_pages, expected.v_pages)):
        np.testing.assert_array_equal(ours.float().numpy(), np.asarray(theirs, np.float32))


def test_assign_rejects_bad_positions_and_shapes():
    cache = jt.PagedKVCache.create(8, 4, 2, 8, TABLE, dtype=torch.float32)
    k = torch.ones(2, 2, 1, 8)
    with pytest.raises(ValueError, match="token 0 of sequence 0 goes to position 8, outside the "
                                         "capacity 12 or on an unassigned page"):
        cache.assign(k, k, [8, 0])
    with pytest.raises(ValueError, match="goes to position 12, outside the capacity 12"):
        cache.assign(k, k, [0, 12])
    with pytest.raises(ValueError, match="goes to position -1"):
        cache.assign(k, k, [0, -1])
    assert not cache.k_pages.any()  # nothing written by a call that raised
    with pytest.raises(ValueError, match="must be \\[Bn, 2, Ln, dim\\]"):
        cache.assign(torch.ones(2, 3, 1, 8), torch.ones(2, 3, 1, 8), [0, 0])
    with pytest.raises(ValueError, match="1 sequences of new tokens but 2 page-table rows"):
        cache.assign(k[:1], k[:1], [0])
    with pytest.raises(ValueError, match="page_table\\[0, 1\\] = 8 is outside the pool of 8"):
        jt.PagedKVCache.create(8, 4, 2, 8, [[0, 8]])
    with pytest.raises(ValueError, match="`page_size` must be a positive int"):
        jt.PagedKVCache.create(8, 0, 2, 8, TABLE)


# ------------------------------------------------------------------------------------------------
# opcheck, torch.compile, inference only
# ------------------------------------------------------------------------------------------------


def test_opcheck():
    q, k, v = _qkv()
    score_mod, _, mask_mod, _ = _mods("cpu")
    block_mask = jt.create_block_mask(mask_mod, None, None, S, S, BLOCK_SIZE=PAGE, device="cpu")
    lists, block_size = jt._mask_tensors(block_mask, S, S)
    mods, captures = _ops.capture_mods(score_mod, mask_mod)
    captures = list(captures)
    assert len(captures) == 1  # the slopes
    static = (mods, block_size, [S, S], None, None)
    kv_len = torch.tensor(KV_LEN)
    torch.library.opcheck(torch.ops.jattn.flex_decode.default,
                          (q, k, v, None, kv_len, lists, captures, *static))
    cache = _paged_cache(k, v, KV_LEN)
    torch.library.opcheck(torch.ops.jattn.flex_decode.default,
                          (q, cache.k_pages, cache.v_pages, cache.page_table, kv_len, lists,
                           captures, *static))


def test_compiles_without_graph_breaks():
    q, k, v = _qkv()
    score_mod, _, mask_mod, _ = _mods("cpu")
    block_mask = jt.create_block_mask(mask_mod, None, None, S, S, BLOCK_SIZE=PAGE, device="cpu")
    cache = _paged_cache(k, v, KV_LEN)

    def step(q, cache, kv_len):
        return torch.relu(jt.flex_decode(q, cache, None, score_mod, block_mask, kv_len=kv_len))

    def contiguous_step(q, k, v):
        return jt.flex_decode(q, k, v, kv_len=64) * 2

    kv_len = torch.tensor(KV_LEN)
    out = torch.compile(step, fullgraph=True)(q, cache, kv_len)  # raises on a graph break
    torch.testing.assert_close(out, step(q, cache, kv_len), rtol=0, atol=0)
    out = torch.compile(contiguous_step, fullgraph=True)(q, k, v)
    torch.testing.assert_close(out, contiguous_step(q, k, v), rtol=0, atol=0)


def test_gradients_raise_inference_only():
    q, k, v = _qkv()
    message = "flex_decode is inference-only .* use jattn.torch.flex_attention"
    with pytest.raises(NotImplementedError, match=message):
        jt.flex_decode(q.requires_grad_(), k, v)
    table = torch.zeros(HQ, requires_grad=True)
    with pytest.raises(NotImplementedError, match="require grad: captured tensor 0"):
        jt.flex_decode(q.detach(), k, v, lambda s, b, h, qi, ki: s + table[h])
    with pytest.raises(NotImplementedError, match=message):  # the same check when compiled
        torch.compile(jt.flex_decode)(q, k, v)
    with torch.no_grad():  # the same calls are fine for inference
        jt.flex_decode(q, k, v)
        jt.flex_decode(q, k, v, lambda s, b, h, qi, ki: s + table[h])


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------


def test_bad_input_raises():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="all tensors must be on one device, got q on cpu, k on "
                                         "meta"):
        jt.flex_decode(q, k.to("meta"), v)
    with pytest.raises(TypeError, match="q \\(float32\\) and k/v \\(bfloat16\\) must share"):
        jt.flex_decode(q, k.bfloat16(), v.bfloat16())
    with pytest.raises(ValueError, match="kv_len\\[1\\] = 161 is outside \\[0, 160\\]"):
        jt.flex_decode(q, k, v, kv_len=torch.tensor([3, 161, 5]))
    with pytest.raises(ValueError, match="kv_len = 200 is outside \\[0, 160\\]"):
        jt.flex_decode(q, k, v, kv_len=200)
    with pytest.raises(ValueError, match="`kv_len` must be an int, or an int32/int64 tensor"):
        jt.flex_decode(q, k, v, kv_len=torch.tensor([3.0, 4.0, 5.0]))
    with pytest.raises(ValueError, match="query heads 3 must be a multiple of kv heads 2"):
        jt.flex_decode(q[:, :3], k, v)
    with pytest.raises(ValueError, match="implementation='pallas_triton' cannot run this call.*runs on CUDA tensors needs them moved with .cuda()"):
        jt.flex_decode(q, k, v, implementation="pallas_triton")


def test_bad_paged_input_raises():
    q, k, v = _qkv()
    cache = _paged_cache(k, v, KV_LEN)
    with pytest.raises(ValueError, match="kv_len\\[1\\] = 100 reaches logical page 3 \\(page "
                                         "size 32\\), which page_table\\[1\\] leaves unassigned"):
        jt.flex_decode(q, cache, None, kv_len=torch.tensor([160, 100, 3]))
    with pytest.raises(ValueError, match="kv_len = 161 is outside \\[0, 160\\]"):
        jt.flex_decode(q, cache, None, kv_len=161)
    with pytest.raises(ValueError, match="kv_len\\[2\\] = 33 reaches logical page 1"):
        jt.flex_decode(q, cache, None, kv_len=torch.tensor([160, 70, 33]))
    with pytest.raises(ValueError, match="kv_len\\[1\\] = 160 reaches logical page 3"):
        jt.flex_decode(q, cache, None)  # kv_len None: every page is read
    with pytest.raises(ValueError, match="pass v=None"):
        jt.flex_decode(q, cache, v)
    with pytest.raises(TypeError, match="must share one of"):
        jt.flex_decode(q.bfloat16(), cache, None, kv_len=torch.tensor(KV_LEN))


def test_bad_block_mask_raises():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="`block_mask` must be a torch BlockMask"):
        jt.flex_decode(q, k, v, None, jattn.create_block_mask(jattn.masks.causal_mask, None,
                                                              None, S, S))
    short = jt.create_block_mask(jattn.masks.causal_mask, None, None, S, S // 2, device="cpu")
    with pytest.raises(ValueError, match="covers \\(Q_LEN=160, KV_LEN=80\\).*build it for "
                                         "\\(160, 160\\)"):
        jt.flex_decode(q, k, v, None, short)

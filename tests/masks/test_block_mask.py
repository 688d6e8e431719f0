"""BlockMask construction, classification of partial/full blocks, conversions and errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._src.masks.create import builder
from tests.helpers import assert_close


def _dense_blocks(mask, block):
    """Per-block (any, all) of a dense [B, H, L, S] mask, padding counted as not attending (a
    block reaching past an end is never full, as torch lists it)."""
    B, H, L, S = mask.shape
    nq, nk = -(-L // block), -(-S // block)
    padded = np.zeros((B, H, nq * block, nk * block), bool)
    padded[:, :, :L, :S] = mask
    shape = (B, H, nq, block, nk, block)
    return padded.reshape(shape).any((3, 5)), padded.reshape(shape).all((3, 5))


@pytest.mark.parametrize("name,mask_mod,B,H,L,S", [
    ("causal", jattn.masks.causal_mask, None, None, 100, 100),
    ("sliding", jattn.masks.sliding_window(40), 1, 1, 200, 150),
    ("prefix", jattn.masks.prefix_lm(50), None, None, 130, 130),
    ("document", jattn.masks.document_mask(
        jnp.asarray([[0] * 60 + [1] * 60, [0] * 10 + [1] * 110])), 2, None, 120, 120),
    ("per-head", lambda b, h, q, kv: (q - kv) < 16 * (h + 1), None, 3, 96, 96),
])
def test_create_block_mask_classifies_blocks(name, mask_mod, B, H, L, S):
    block_mask = jattn.create_block_mask(mask_mod, B, H, L, S, block_size=32)
    dense = np.asarray(jattn.create_mask(mask_mod, B, H, L, S))
    any_, all_ = _dense_blocks(dense, 32)
    np.testing.assert_array_equal(block_mask.full_blocks(), all_)
    np.testing.assert_array_equal(block_mask.partial_blocks(), any_ & ~all_)
    np.testing.assert_array_equal(block_mask.to_dense(), any_)
    # The q-major lists are the transpose of the kv-major ones.
    q_major = jattn.BlockMask.from_kv_blocks(block_mask.q_num_blocks, block_mask.q_indices,
                                             block_size=32)
    np.testing.assert_array_equal(np.swapaxes(q_major.partial_blocks(), -1, -2),
                                  block_mask.partial_blocks())
    assert 0 <= block_mask.sparsity() < 100


def test_from_kv_blocks_round_trip_and_repr():
    rng = np.random.default_rng(0)
    table = rng.random((2, 3, 4, 5)) < 0.5
    full = table & (rng.random(table.shape) < 0.5)
    num, idx = (table & ~full).sum(-1), np.argsort(~(table & ~full), -1, kind="stable")
    fnum, fidx = full.sum(-1), np.argsort(~full, -1, kind="stable")
    mask = jattn.BlockMask.from_kv_blocks(num, idx, fnum, fidx, block_size=16)
    np.testing.assert_array_equal(mask.partial_blocks(), table & ~full)
    np.testing.assert_array_equal(mask.full_blocks(), full)
    assert mask.shape == (2, 3, 64, 80)
    text = repr(mask)
    assert "sparsity=" in text and ("█" in text or "░" in text)


def test_bad_masks_raise():
    with pytest.raises(TypeError, match="`mask_mod` must return a bool array, got int32"):
        jattn.create_block_mask(lambda b, h, q, kv: q - kv, None, None, 64, 64)
    with pytest.raises(ValueError, match="`Q_LEN` must be a positive int"):
        jattn.create_block_mask(jattn.masks.causal_mask, None, None, 0, 64)
    with pytest.raises(ValueError, match="`block_size` must be an int >= 1"):
        jattn.create_block_mask(jattn.masks.causal_mask, None, None, 64, 64, block_size=0)
    with pytest.raises(ValueError, match="seq_lengths \\(100, 64\\) with block_size"):
        jattn.BlockMask.from_kv_blocks(jnp.ones((1, 1, 2), jnp.int32),
                                       jnp.zeros((1, 1, 2, 2), jnp.int32), block_size=32,
                                       seq_lengths=(100, 64))
    with pytest.raises(TypeError, match="block lists must be integers"):
        jattn.BlockMask.from_kv_blocks(jnp.ones((1, 1, 2)), jnp.zeros((1, 1, 2, 2)))


def test_library_mods_check_their_arguments():
    for make, match in [
            (lambda: jattn.masks.prefix_lm(-3), "`prefix_length` must be an int >= 0"),
            (lambda: jattn.masks.prefix_lm(2.5), "`prefix_length` must be an int >= 0"),
            (lambda: jattn.masks.sliding_window(0), "`window` must be a positive int"),
            (lambda: jattn.masks.sliding_window(jnp.ones(2, jnp.int32)), "0-d integer array"),
            (lambda: jattn.mods.alibi(jnp.ones((2, 2))), r"`slopes` .* shape \[H\]"),
            (lambda: jattn.mods.relative_position_bias(jnp.ones(5)), r"\[H, 2R\+1\]"),
            (lambda: jattn.mods.relative_position_bias(jnp.ones((2, 4))), "an odd width")]:
        with pytest.raises(ValueError, match=match):
            make()
    window = jattn.create_mask(jattn.masks.sliding_window(np.int64(2)), None, None, 4, 4)
    np.testing.assert_array_equal(window, jattn.create_mask(jattn.masks.sliding_window(2),
                                                            None, None, 4, 4))
    # a window per layer, scanned over (Gemma's alternating local and global layers)
    per_layer = jax.lax.map(lambda w: jattn.create_mask(jattn.masks.sliding_window(w), None,
                                                        None, 4, 4), jnp.array([2, 4]))
    np.testing.assert_array_equal(per_layer[0], window)
    np.testing.assert_array_equal(per_layer[1], jattn.create_mask(jattn.masks.causal_mask,
                                                                  None, None, 4, 4))


@pytest.mark.parametrize("counts,indices,match", [
    ([3, 1], [[0, 1], [1, 0]], r"kv_num_blocks\[0, 0, 0\] = 3 is outside \[0, 2\]"),
    ([1, -1], [[0, 1], [1, 0]], r"kv_num_blocks\[0, 0, 1\] = -1 is outside"),
    ([2, 1], [[0, 2], [1, 0]], r"kv_indices\[0, 0, 0, 1\] = 2 is outside \[0, 2\)"),
    ([2, 1], [[0, 1], [-1, 0]], r"kv_indices\[0, 0, 1, 0\] = -1 is outside"),
])
def test_from_kv_blocks_checks_its_values(counts, indices, match):
    """Bad counts or listed indices raise with eager values; under jit they are not read, and
    an index outside the mask lists no block (entries past a row's count are never read)."""
    counts = jnp.asarray(counts, jnp.int32)[None, None]
    indices = jnp.asarray(indices, jnp.int32)[None, None]
    with pytest.raises(ValueError, match=match):
        jattn.BlockMask.from_kv_blocks(counts, indices, block_size=16)
    traced = jax.jit(lambda c, i: jattn.BlockMask.from_kv_blocks(
        c, i, block_size=16).partial_blocks())(counts, indices)
    listed = (jnp.arange(2) < jnp.clip(counts, 0, 2)[..., None]) & (indices >= 0) & (indices < 2)
    expected = np.zeros((1, 1, 2, 2), bool)
    for row in range(2):
        for j in range(2):
            if listed[0, 0, row, j]:
                expected[0, 0, row, int(indices[0, 0, row, j])] = True
    np.testing.assert_array_equal(np.asarray(traced), expected)
    padded = jnp.asarray([[[[0, 7], [1, -3]]]], jnp.int32)  # past each row's count: not read
    jattn.BlockMask.from_kv_blocks(jnp.ones((1, 1, 2), jnp.int32), padded, block_size=16)


def test_create_block_mask_is_memory_bounded_in_steps():
    """At 16k x 16k the builder never materialises the dense mask (it would be 256 MiB)."""
    program, arrays = builder(jattn.masks.causal_mask, 1, 1, 16384, 16384, (128, 128))
    compiled = program.lower(arrays).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 64 * 2**20
    block_mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 16384, 16384)
    assert block_mask.num_blocks == (128, 128)
    assert int(block_mask.kv_num_blocks.sum()) == 128          # one diagonal block per row
    assert int(block_mask.full_kv_num_blocks.sum()) == 128 * 127 // 2


def test_mask_mod_mistakes_name_the_fix():
    with pytest.raises(TypeError, match=r"create_block_mask: `mask_mod` is called as "
                                        r"mask_mod\(b, h, q_idx, kv_idx\), but causal\(q, kv\)"):
        def causal(q, kv):
            return q >= kv
        jattn.create_block_mask(causal, None, None, 64, 64)
    with pytest.raises(TypeError, match="create_mask: `mask_mod` branchy uses a Python `if`"):
        def branchy(b, h, q, kv):
            return q >= kv if q > 3 else q < kv
        jattn.create_mask(branchy, None, None, 64, 64)


IDS = None  # rebound per batch by the test below


def _document_ids(seed, B=2, L=128):
    return jnp.asarray(np.sort(np.random.default_rng(seed).integers(0, 4, (B, L)), 1), jnp.int32)


def _documents_from_global(b, h, q_idx, kv_idx):
    return IDS[b, q_idx] == IDS[b, kv_idx]


@pytest.mark.parametrize("source", ["closure", "container", "global", "numpy"])
def test_a_users_mask_mod_passes_through_jit_without_recompiling(source):
    """attention-gym's way: a fresh closure over the batch's document ids (or over a dict
    holding them, or a global rebound per batch), its BlockMask an argument of the jitted
    step: one compile, each batch's ids."""
    global IDS
    B, H, L, E = 2, 2, 128, 16
    x = jax.random.normal(jax.random.key(0), (B, H, L, E))
    step = jax.jit(lambda x, mask: jattn.flex_attention(x, x, x, block_mask=mask))

    def documents_of(ids):
        def documents(b, h, q_idx, kv_idx):
            return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)
        return documents

    def in_batch(batch):
        return lambda b, h, q_idx, kv_idx: batch["ids"][b, q_idx] == batch["ids"][b, kv_idx]

    for seed in range(3):
        IDS = _document_ids(seed, B, L)
        numpy_ids = np.asarray(IDS)
        mask_mod = {"closure": documents_of(IDS), "container": in_batch({"ids": IDS}),
                    "global": _documents_from_global,
                    "numpy": lambda b, h, q_idx, kv_idx: jnp.asarray(numpy_ids)[b, q_idx]
                    == jnp.asarray(numpy_ids)[b, kv_idx]}[source]
        mask = jattn.create_block_mask(mask_mod, B, None, L, L, block_size=32)
        dense = jattn.create_mask(mask_mod, B, None, L, L)
        scores = jnp.where(dense, jnp.einsum("bhqd,bhkd->bhqk", x, x, precision="highest")
                           / E ** 0.5, -jnp.inf)
        expected = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, -1), x,
                              precision="highest")
        np.testing.assert_allclose(step(x, mask), expected, rtol=2e-5, atol=2e-5)
    assert step._cache_size() == 1


def test_a_mask_mod_reading_array_values_in_python_still_passes_through_jit():
    """Such a mod needs the values while traced, so its function stays static data."""
    L = 128
    x = jax.random.normal(jax.random.key(0), (1, 2, L, 16))
    step = jax.jit(lambda x, mask: jattn.flex_attention(x, x, x, block_mask=mask))
    lengths, prefix = np.array([40, 50, 38]), jnp.array(17)

    def numpy_documents(b, h, q_idx, kv_idx):
        ids = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths))
        return ids[q_idx] == ids[kv_idx]

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < int(prefix)) | (q_idx >= kv_idx)

    for mask_mod in (numpy_documents, prefix_lm):
        mask = jattn.create_block_mask(mask_mod, None, None, L, L, block_size=32)
        np.testing.assert_allclose(step(x, mask), jattn.flex_attention(x, x, x, block_mask=mask),
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("source", ["closure", "library"])
def test_a_block_mask_keeps_its_tree_structure_under_tree_map(source):
    """jax.tree.map to any leaves (True, None: equinox's partition) keeps the structure, and
    mapping back to arrays gives a mask that attends as the original."""
    ids = _document_ids(0, 1, 64)[0]
    mask_mod = (jattn.masks.document_mask(ids) if source == "library"
                else lambda b, h, q_idx, kv_idx: ids[q_idx] == ids[kv_idx])
    mask = jattn.create_block_mask(mask_mod, None, None, 64, 64, block_size=16)
    structure = jax.tree.structure(mask)
    assert jax.tree.structure(jax.tree.map(lambda x: True, mask)) == structure
    jax.tree.map(lambda x: None, mask)
    arrays = [x for x in jax.tree.leaves(mask) if isinstance(x, jax.Array)]
    partitioned = jax.tree.map(lambda x: x if isinstance(x, jax.Array) else None, mask)
    again = jax.tree.unflatten(structure, [x + 0 for x in jax.tree.leaves(partitioned)])
    assert len(arrays) == structure.num_leaves
    x = jax.random.normal(jax.random.key(0), (1, 2, 64, 16))
    np.testing.assert_allclose(jattn.flex_attention(x, x, x, block_mask=again),
                               jattn.flex_attention(x, x, x, block_mask=mask), rtol=1e-6)


@pytest.mark.parametrize("index, kv_shape", [
    (0, (1, 2, 4)), ((0, 1), (1, 1, 4)), ((slice(0, 2), slice(1, 2)), (2, 1, 4)),
    ((slice(0, 2), slice(1, 2), np.array([1, 3])), (2, 1, 2)), (-1, (1, 2, 4)),
    ((slice(None), slice(None), 2), (4, 2, 1))])
def test_slicing_a_block_mask_keeps_the_selected_rows_as_torch_does(index, kv_shape):
    ids = jnp.arange(4)[:, None] * 100 + jnp.arange(512)  # batch-dependent partial blocks
    mask = jattn.create_block_mask(lambda b, h, q, kv: (q >= kv) & (ids[b, kv] % 7 != h), 4,
                                   2, 512, 512)
    sliced = mask[index]
    assert sliced.kv_num_blocks.shape == kv_shape and sliced.kv_indices.shape == (*kv_shape, 4)
    assert sliced.shape == (*kv_shape[:2], 512, 512)  # seq_lengths kept, as torch keeps them
    torch_index = tuple(slice(i % n, i % n + 1) if isinstance(i, int) else i
                        for i, n in zip(index if isinstance(index, tuple) else (index,),
                                        (4, 2, 4)))
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        np.testing.assert_array_equal(getattr(sliced, name),
                                      np.asarray(getattr(mask, name))[torch_index])
    # The q-major lists describe the same blocks as the kv-major ones.
    np.testing.assert_array_equal(
        np.swapaxes(jattn.BlockMask.from_kv_blocks(
            sliced.q_num_blocks, sliced.q_indices, sliced.full_q_num_blocks,
            sliced.full_q_indices).to_dense(), -1, -2), sliced.to_dense())


def test_a_sliced_block_mask_decodes_one_query_once_given_its_mask_mod_and_lengths():
    mask = jattn.create_block_mask(jattn.masks.causal_mask, 2, 1, 512, 512)
    keys = jax.random.normal(jax.random.key(0), (2, 2, 512, 64))
    values = jax.random.normal(jax.random.key(1), (2, 2, 512, 64))
    q = jax.random.normal(jax.random.key(2), (2, 2, 512, 64))
    position = 300
    row = mask[:, :, position // 128]
    with pytest.raises(ValueError, match="A slice .* keeps the original's seq_lengths"):
        jattn.flex_attention(q, keys, values, block_mask=row)
    with pytest.raises(RuntimeError, match="mask_mod of a sliced BlockMask"):
        jattn.flex_attention(q[:, :, :1], keys, values,
                             block_mask=dataclasses.replace(row, seq_lengths=(1, 512)))
    decode = dataclasses.replace(
        row, seq_lengths=(1, 512),
        mask_mod=lambda b, h, q_idx, kv_idx: mask.mask_mod(b, h, q_idx + position, kv_idx))
    out = jax.jit(jattn.flex_attention)(q[:, :, position:position + 1], keys, values,
                                        block_mask=decode)
    whole = jattn.flex_attention(q, keys, values, block_mask=mask)
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q[:, :, position], keys, values))
    scores = np.einsum("bhd,bhkd->bhk", q64, k64) / 8.0
    scores[..., position + 1:] = -np.inf
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    gold = np.einsum("bhk,bhkd->bhd", weights / weights.sum(-1, keepdims=True), v64)
    assert_close(out[:, :, 0], gold, whole[:, :, position])
    with pytest.raises(IndexError, match="out of range for dim 0 of size 2"):
        mask[2]
    with pytest.raises(IndexError, match="at most 3 indices"):
        mask[0, 0, 0, 0]


WINDOW = 10


def _window_from_global(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)


def test_a_mask_mod_reading_python_scalars_passes_through_jit_by_their_values():
    """A fresh closure over a Python int compiles once; a global changed between two masks
    (a widening window) is the new mask_mod inside partial blocks, not the first trace's."""
    global WINDOW
    B, H, L, E = 1, 2, 128, 16
    x = jax.random.normal(jax.random.key(0), (B, H, L, E))
    traces = []
    step = jax.jit(lambda x, mask: traces.append(1) or
                   jattn.flex_attention(x, x, x, block_mask=mask))

    def window_of(size):
        return lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < size)

    for _ in range(3):
        step(x, jattn.create_block_mask(window_of(64), None, None, L, L, block_size=32))
    assert len(traces) == 1
    for WINDOW in (10, 37):
        mask = jattn.create_block_mask(_window_from_global, None, None, L, L, block_size=32)
        np.testing.assert_array_equal(step(x, mask), jattn.flex_attention(x, x, x,
                                                                          block_mask=mask))


def test_a_block_mask_slices_at_a_traced_position_and_survives_host_round_trips():
    ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), 64)
    mask = jattn.create_block_mask(lambda b, h, q_idx, kv_idx: ids[q_idx] == ids[kv_idx],
                                   None, 2, 256, 256, block_size=64)
    rows = jax.jit(lambda i: mask[:, :, i].kv_num_blocks)(jnp.int32(2))
    assert rows.shape == (1, 2, 1)
    np.testing.assert_array_equal(rows, mask[:, :, 2].kv_num_blocks)
    # jax.device_get (saving a train state) leaves NumPy arrays the mod indexes with tracers
    x = jax.random.normal(jax.random.key(0), (1, 2, 256, 16))
    np.testing.assert_array_equal(
        jattn.flex_attention(x, x, x, block_mask=jax.device_get(mask)),
        jattn.flex_attention(x, x, x, block_mask=mask))
    abstract = jax.eval_shape(lambda: mask)
    assert repr(abstract).startswith("BlockMask(shape=(1, 2, 256, 256)")

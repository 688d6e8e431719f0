"""flex_attention's forward on Mosaic GPU (implementation="pallas_mosaic_gpu").

On the CPU: the registry's reasons for the calls it cannot run (captured arrays read other than
by element or by position among them), and the forward and the Triton backward behind it
lowered for CUDA. The Mosaic GPU interpreter cannot run this kernel (it has
no wgmma, no transposed shared-memory refs and no register layouts), so its numerics are checked
on the GPU: output, LSE and gradients against a float64 golden, and bitwise repeatability.
"""

import re

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


def _facts(**changes):
    facts = dict(dtype=jnp.bfloat16, head_dim=128, value_dim=128, seq_lengths=(1024, 1024),
                 block_size=(128, 128), unreadable_capture=None)
    return {**facts, **changes}


@pytest.mark.parametrize("change, reason", [
    ({"dtype": jnp.float32}, "bfloat16 or float16"),
    ({"head_dim": 96, "value_dim": 96}, "head dims 64 or 128"),
    ({"value_dim": 64}, "equal q/k and v head dims"),
    ({"seq_lengths": (1000, 1024)}, "multiples of 128"),
    ({"block_size": (64, 64)}, r"\(128, 128\) blocks"),
    ({"unreadable_capture": "mask_mod reads a captured int32[512] array through a gather"},
     r"by element .* or by position .* mask_mod reads a captured int32\[512\]"),
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


@pytest.mark.parametrize("unreadable, chosen", [(None, MOSAIC), ("a gather", "pallas_triton")])
def test_the_environment_variable_applies_where_the_call_is_supported(
        as_if_on_hopper, monkeypatch, unreadable, chosen):
    """As jattn's own calls and the torch ops resolve (the bridge passes the same facts)."""
    monkeypatch.setenv("JATTN_IMPLEMENTATION", MOSAIC)
    assert bridge.resolve("flex_attention", None, on_cuda=True,
                          **_facts(unreadable_capture=unreadable)) == chosen


@pytest.mark.parametrize("facts, chosen", [
    (dict(), MOSAIC),
    (dict(head_dim=64, value_dim=64, seq_lengths=(4096, 4096)), MOSAIC),
    (dict(head_dim=64, value_dim=64, seq_lengths=(1024, 1024), score_mod=True), MOSAIC),
    (dict(head_dim=64, value_dim=64, seq_lengths=(1024, 1024)), "pallas_triton"),
    (dict(unreadable_capture="a gather"), "pallas_triton"),
    # an eager torch call launches pallas_triton's forward itself: worth it on small work
    (dict(torch_eager_work=10**11), "pallas_triton"),
    (dict(torch_eager_work=10**13), MOSAIC),
    (dict(head_dim=64, value_dim=64, seq_lengths=(4096, 4096), score_mod=True,
          torch_eager_work=5 * 10**11), MOSAIC),  # where Mosaic leads by 1.4-1.5x
])
def test_hopper_defaults_to_mosaic_where_measured_faster(as_if_on_hopper, facts, chosen):
    """The default choice (jattn's calls and the torch ops alike) takes the Mosaic forward
    except where it cannot run the call or pallas_triton's was measured faster (or, for an
    eager torch call, would be launched directly at less cost)."""
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
        assert backends.resolve("flex_decode", platform="gpu").name == "pallas_triton"
    assert not seen[0].skipped


def test_other_ops_say_they_have_no_mosaic_implementation():
    with pytest.raises(ValueError, match="flex_decode has no pallas_mosaic_gpu implementation"):
        backends.resolve("flex_decode", MOSAIC, platform="gpu")


# Captured arrays: elements and runs along q_idx / kv_idx are read, anything else goes to
# pallas_triton.
_SLOPES = jnp.linspace(0.1, 1.0, 4)
_TABLE = jnp.ones((2, 4), jnp.bfloat16)
_FLAGS = jnp.array([True, False, True, True])
_DOC_IDS = jnp.arange(4096, dtype=jnp.int32) // 128
_TEMPERATURE = jnp.float32(2.0)

_BATCH_DOC_IDS = jnp.stack([_DOC_IDS, _DOC_IDS // 3])
_POSITION_BIAS = jnp.linspace(-1.0, 1.0, 8192, dtype=jnp.float32)

READABLE = {
    "slopes[h]": (jattn.mods.alibi(_SLOPES), None),
    "table[b, h]": (lambda s, b, h, q_idx, kv_idx: s + _TABLE[b, h], None),
    "0-d temperature": (lambda s, b, h, q_idx, kv_idx: s / _TEMPERATURE, None),
    "bool flags[h]": (None, lambda b, h, q_idx, kv_idx: _FLAGS[h] | (q_idx >= kv_idx)),
    "ids[q_idx]": (None, jattn.masks.document_mask(_DOC_IDS)),
    "ids[b, kv_idx]": (None, jattn.masks.and_masks(jattn.masks.causal_mask,
                                                   jattn.masks.document_mask(_BATCH_DOC_IDS))),
    "bias[kv_idx + 8]": (lambda s, b, h, q_idx, kv_idx: s + _POSITION_BIAS[kv_idx + 8], None),
}
# A context-parallel ring's global positions (4 devices, shards of 4096): the device index a
# captured scalar, its range stated by a clamp; zigzag shards' two halves chosen per tile;
# keys taken a few blocks of 128 at a time, each block's shift read from a table.
_DEVICE = jnp.int32(2)
_BLOCK_SHIFTS = jnp.asarray(np.minimum(np.arange(32) % 5, 31 - np.arange(32)), jnp.int32)
_LONG_IDS = jnp.arange(16384, dtype=jnp.int32) // 300
_LONG_BIAS = jnp.linspace(-1.0, 1.0, 16384, dtype=jnp.float32)


def _zigzag_position(local):
    device = jax.lax.clamp(np.int32(0), _DEVICE, np.int32(3))
    return jnp.where(local < 2048, local + device * 2048, local - 2048 + (7 - device) * 2048)


def _taken_key_position(kv_idx):
    block = np.dtype(kv_idx.dtype).type(128)  # (int64 in the float64 golden)
    shift = jax.lax.clamp(np.int32(0), _BLOCK_SHIFTS[jax.lax.div(kv_idx, block)], np.int32(4))
    return kv_idx + shift * 128


_TRICKY = {  # reads and index arithmetic the kernel's evaluation keeps symbolic or decides
    "shifted and compared": (
        lambda s, b, h, q_idx, kv_idx: s + _POSITION_BIAS[kv_idx + 8]
        * jnp.where(q_idx >= 0, 1.0, 2.0) - (kv_idx < 300) * _SLOPES[h],
        lambda b, h, q_idx, kv_idx: (_BATCH_DOC_IDS[b, q_idx] >= _BATCH_DOC_IDS[b, kv_idx])
        & (q_idx + 64 > kv_idx)),
    "negative indices": (
        lambda s, b, h, q_idx, kv_idx: s + _TABLE[b - 2, -1 - h % 4].astype(jnp.float32),
        lambda b, h, q_idx, kv_idx: _DOC_IDS[q_idx - 4096] != _DOC_IDS[-4096 + kv_idx]),
    "a ring's global positions": (
        lambda s, b, h, q_idx, kv_idx: s + _LONG_BIAS[_zigzag_position(kv_idx)]
        - _LONG_BIAS[q_idx + jax.lax.clamp(np.int32(0), _DEVICE, np.int32(3)) * 4096],
        lambda b, h, q_idx, kv_idx: (
            _LONG_IDS[_zigzag_position(q_idx)] == _LONG_IDS[_taken_key_position(kv_idx)])
        & (_zigzag_position(q_idx) >= _taken_key_position(kv_idx))),
}
UNREADABLE = {
    "bias[q_idx - kv_idx]": (
        lambda s, b, h, q_idx, kv_idx: s + _POSITION_BIAS[q_idx - kv_idx], None,
        r"score_mod reads a captured float32\[8192\] array through a gather with an index "
        r"per score"),
    "ids[kv_idx, b]": (None, lambda b, h, q_idx, kv_idx: _BATCH_DOC_IDS.T[kv_idx, b] > 0,
                       r"mask_mod reads a captured int32\[2,4096\] array whole"),
    "bias[q_idx + 1]": (lambda s, b, h, q_idx, kv_idx: s + _POSITION_BIAS[q_idx + 1], None,
                        r"float32\[8192\] array through a gather at an offset .* multiple of 8"),
    "an array built in the mod": (
        lambda s, b, h, q_idx, kv_idx: s + jnp.arange(4096.0)[q_idx], None,
        r"score_mod reads q_idx or kv_idx as an index vector \(64, 128, 1\) \(in `gather`\)"),
    "a row": (lambda s, b, h, q_idx, kv_idx: s + jnp.sum(_TABLE[b]), None,
              r"score_mod reads a captured bfloat16\[2,4\] array a slice at a time"),
    "jnp.take": (lambda s, b, h, q_idx, kv_idx: s * jnp.take(_SLOPES, h), None,
                 r"score_mod reads a captured float32\[4\] array through a gather that fills "
                 r"out-of-bounds reads"),
}


def _captured_reads(score, b, h, q_idx, kv_idx):  # B 2, Hq 4: every readable kind of read
    return jattn.mods.alibi(_SLOPES)(score, b, h, q_idx, kv_idx) / _TEMPERATURE + _TABLE[b, h]


def _ragged_ids(*boundaries_per_row, length=512):
    """Document ids [B, length] from each batch row's document starts (ragged, unaligned)."""
    return jnp.stack([jnp.cumsum(jnp.zeros(length, jnp.int32).at[jnp.array(starts)].set(1))
                      for starts in boundaries_per_row])


# B 2, L 512: runs along q_idx and kv_idx of int32, bool (as int32), f32 and bf16 arrays.
_RAGGED_DOC_IDS = _ragged_ids([37, 200, 333], [130, 131, 400])
_KEEP_KEY = jnp.arange(512) % 7 != 3
_KEY_BIAS = jnp.linspace(-1.0, 1.0, 512, dtype=jnp.float32)
_QUERY_BIAS = jnp.linspace(0.5, -0.5, 512).astype(jnp.bfloat16)


def _ragged_documents(b, h, q_idx, kv_idx):
    same = _RAGGED_DOC_IDS[b, q_idx] == _RAGGED_DOC_IDS[b, kv_idx]
    return same & (q_idx >= kv_idx) & (_KEEP_KEY[kv_idx] | (q_idx == kv_idx))


def _position_biases(score, b, h, q_idx, kv_idx):
    return score + _KEY_BIAS[kv_idx] - _QUERY_BIAS[q_idx]


def _resolved(score_mod, mask_mod, implementation=None):
    """The resolution record of a flex_attention call on Hopper (B 2, H 4, L 4096, D 64: a
    shape where the default takes the Mosaic forward)."""
    q = jax.ShapeDtypeStruct((2, 4, 4096, 64), jnp.bfloat16)
    block_mask = None if mask_mod is None else jattn.create_block_mask(mask_mod, 2, 4, 4096,
                                                                       4096)
    with backends.recording() as seen:
        jax.eval_shape(lambda q: jattn.flex_attention(q, q, q, score_mod, block_mask,
                                                      implementation=implementation), q)
    return seen[0]


@pytest.mark.parametrize("name", [*READABLE, *_TRICKY])
def test_mods_reading_by_element_or_position_run_on_mosaic(as_if_on_hopper, name):
    assert _resolved(*(READABLE | _TRICKY)[name]).chosen == MOSAIC


@pytest.mark.parametrize("name", UNREADABLE)
def test_other_captured_reads_fall_back_with_the_reason(as_if_on_hopper, name):
    score_mod, mask_mod, reason = UNREADABLE[name]
    seen = _resolved(score_mod, mask_mod)
    assert seen.chosen == "pallas_triton"
    assert re.search(reason, str(seen))
    with pytest.raises(ValueError, match=f"pallas_mosaic_gpu.*{reason}.*pallas_triton's read"):
        _resolved(score_mod, mask_mod, implementation=MOSAIC)


@pytest.mark.parametrize("score_mod,mask_mod,reach", [
    (None, lambda b, h, q_idx, kv_idx: _DOC_IDS[q_idx + 1] == 0, "4096"),
    (lambda s, b, h, q_idx, kv_idx: s + _POSITION_BIAS[kv_idx + 4104], None, "8199")])
def test_reads_past_an_arrays_end_raise_before_any_choice(as_if_on_hopper, score_mod, mask_mod,
                                                         reach):
    with pytest.raises(ValueError, match=f"which reaches {reach} in this call"):
        _resolved(score_mod, mask_mod)


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


def test_captured_reads_lower_for_cuda(as_if_on_hopper):
    """Every readable kind of read in one call: scalar loads of f32, bf16, bool (as int32) and
    a 0-d array, with GQA and a BlockMask."""
    pytest.importorskip("absl")
    B, Hq, L, E = 2, 4, 512, 64

    block_mask = jattn.create_block_mask(READABLE["bool flags[h]"][1], B, Hq, L, L)

    def attention(q, k, v):
        return jattn.flex_attention(q, k, v, _captured_reads, block_mask, enable_gqa=True,
                                    implementation=MOSAIC)

    assert "mosaic_gpu" in lower_for_cuda(attention, _spec(B, Hq, L, E), _spec(B, 2, L, E),
                                          _spec(B, 2, L, E))


@pytest.mark.parametrize("mods", [(_position_biases, _ragged_documents),
                                  _TRICKY["shifted and compared"],
                                  _TRICKY["a ring's global positions"]])
def test_runs_by_position_lower_for_cuda(as_if_on_hopper, mods):
    """Vector loads along q_idx and kv_idx of int32, bool, f32 and bf16 captured arrays (each
    tile's 64 rows or 128 columns), with the document ids per batch row; comparisons that the
    positions' bounds decide."""
    pytest.importorskip("absl")
    B, Hq, L, E = 2, 4, 512, 128
    score_mod, mask_mod = mods
    block_mask = jattn.create_block_mask(mask_mod, B, None, L, L)

    def attention(q, k, v):
        return jattn.flex_attention(q, k, v, score_mod, block_mask, implementation=MOSAIC)

    assert "mosaic_gpu" in lower_for_cuda(attention, _spec(B, Hq, L, E), _spec(B, Hq, L, E),
                                          _spec(B, Hq, L, E))


def _packed_documents(length, seed=0):
    sizes = np.random.default_rng(seed).integers(1024, 7169, length // 1024)
    ids = jnp.asarray(np.repeat(np.arange(sizes.size), sizes)[:length], jnp.int32)
    return jattn.masks.and_masks(jattn.masks.causal_mask, jattn.masks.document_mask(ids))


def _one_long_document(length: int):
    """Causal documents: one of half the sequence, then documents of one block each."""
    ids = np.r_[np.zeros(length // 2), np.arange(1, length // 256 + 1).repeat(128)]
    return jattn.masks.and_masks(jattn.masks.causal_mask,
                                 jattn.masks.document_mask(jnp.asarray(ids, jnp.int32)))


@pytest.mark.parametrize("B, H, L, mask, order", [
    # H100 (TFLOP/s): paired 598 against 566 with rows in order, heads in turn
    (1, 16, 16384, jattn.masks.causal_mask, "paired"),
    (1, 16, 16384, lambda b, h, q_idx, kv_idx: (q_idx // 4096 == kv_idx // 4096)
     & (q_idx >= kv_idx), "paired"),  # documents of 4k: 522 against 495
    (1, 16, 16384, _packed_documents(16384), "paired"),  # 1k-7k tokens: 471 against 427 dealt
    (4, 16, 2048, jattn.masks.causal_mask, "paired"),  # one wave: 472 against 434 dealt
    (1, 16, 16384, _one_long_document(16384), "dealt"),  # a few rows hold most of the work
    (1, 16, 16384, lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < 1024),
     "consecutive"),  # a sliding window's equal rows: 482 against 463 paired
    (1, 16, 4096, lambda b, h, q_idx, kv_idx: q_idx >= 0, "consecutive"),
])
def test_the_forward_orders_tiles_by_the_rows_work(B, H, L, mask, order):
    """The Mosaic forward's choice, per call from the BlockMask's counts, between programs of
    consecutive tiles (rows in order, heads in turn), of paired rows, and tiles dealt round
    the programs, on 132 SMs."""
    from jattn._src.attention import pallas_mosaic_gpu_fwd as fwd
    from jattn._src.attention import pallas_mosaic_gpu_tiles as tiles
    lists = jattn.create_block_mask(mask, None, None, L, L).lists()
    arrays = (lists.kv_num_blocks, lists.kv_indices, lists.full_kv_num_blocks,
              lists.full_kv_indices)
    groups = tuple(fwd._tiles_per_program(B * H * L // 128, most) for most in (
        fwd.MAX_TILES_PER_PROGRAM_PAIRED, fwd.MAX_TILES_PER_PROGRAM))
    chosen = tiles.tile_order(arrays, True, tiles.heaviest_first(arrays, True),
                              tiles.paired(arrays, True), batch_heads=(B, H), groups=groups,
                              sms=132)
    assert int(chosen[0]) == getattr(tiles, order.upper())


@pytest.mark.parametrize("sms, order", [(5, "paired"), (10, "dealt")])
def test_the_order_costs_each_mask_heads_rows(sms, order):
    """Per-head masks (a window of 128 (h + 1) keys): each mask batch and head's paired rows
    are costed with their own blocks (at 10 SMs, 1.05x dealing beats pairing by those, not by
    the first head's)."""
    from jattn._src.attention import pallas_mosaic_gpu_tiles as tiles
    lists = jattn.create_block_mask(_window_by_head, 2, 4, 640, 640).lists()
    arrays = (lists.kv_num_blocks, lists.kv_indices, lists.full_kv_num_blocks,
              lists.full_kv_indices)
    groups = {5: (4, 8), 10: (4, 4)}[sms]  # `_tiles_per_program` of 40 tiles on those SMs
    chosen = tiles.tile_order(arrays, True, tiles.heaviest_first(arrays, True),
                              tiles.paired(arrays, True), batch_heads=(2, 4), groups=groups,
                              sms=sms)
    assert int(chosen[0]) == getattr(tiles, order.upper())


@pytest.mark.parametrize("mask_batch, mask_heads", [(1, 1), (2, 1), (1, 3), (2, 3)])
def test_paired_tiles_visit_every_batch_head_and_row_once(mask_batch, mask_heads):
    """The forward's paired order: tile t is (b, h, row) with batch and head slowest and each
    mask line's rows in `paired`'s order; every tile is visited once."""
    import types
    from jattn._src.attention.pallas_mosaic_gpu_tiles import paired, paired_tile_of
    B, Hq, rows = 2, 3, 5
    counts = jnp.asarray(np.random.default_rng(0).integers(0, 9, (mask_batch, mask_heads, rows)),
                         jnp.int32)
    order = paired((counts, None), has_full=False)
    p = types.SimpleNamespace(B=B, Hq=Hq, mask_batch=mask_batch, mask_heads=mask_heads)
    tiles = [tuple(int(x) for x in paired_tile_of(p, order, jnp.int32(t), rows))
             for t in range(B * Hq * rows)]
    assert sorted(tiles) == [(b, h, r) for b in range(B) for h in range(Hq) for r in range(rows)]
    lines = np.asarray(order).reshape(mask_batch, mask_heads, rows)
    for b in range(B):
        for h in range(Hq):
            visited = [r for (tb, th, r) in tiles if (tb, th) == (b, h)]
            expected = lines[b if mask_batch > 1 else 0, h if mask_heads > 1 else 0]
            np.testing.assert_array_equal(visited, expected)


def test_paired_rows_alternate_heaviest_and_lightest():
    """Each mask head's rows by work, heaviest with lightest: a causal mask's pairs sum
    equally."""
    from jattn._src.attention.pallas_mosaic_gpu_tiles import paired
    counts = jnp.asarray([[[1, 2, 3, 4, 5, 6], [6, 6, 6, 1, 1, 1]]], jnp.int32)
    order = np.asarray(paired((counts, None), has_full=False)).reshape(2, 6)
    np.testing.assert_array_equal(order[0], [5, 0, 4, 1, 3, 2])
    np.testing.assert_array_equal(order[1], [0, 5, 1, 4, 2, 3])


@pytest.mark.parametrize("transposed", [False, True])  # the dK/dV kernel's [keys, queries]
@pytest.mark.parametrize("name", [*READABLE, *_TRICKY])
def test_mods_evaluated_as_in_the_kernel_equal_them_evaluated_plainly(name, transposed):
    """The kernels' evaluation of mods and of score_mod's gradient (q_idx and kv_idx as a
    tile's first position plus an iota, reads as scalar and vector loads) computes what they
    compute on index tiles, on the forward's and dQ's tile and on dK/dV's transposed one. The
    loads are done here on the CPU from the flattened arrays the kernel gets, at tiles placed
    at several batch rows, heads and positions of a B 2, H 4, L 4096 call."""
    from jattn._src.attention import pallas_mosaic_gpu as mosaic
    from jattn._src.attention import pallas_mosaic_gpu_mods as in_kernel
    from jattn._src.attention.common import trace_mods
    from jattn._src.user_functions import CaptureSet

    class LoadsOnTheCpu(in_kernel._Abstract):
        def element(self, ref, flat, dtype):
            return ref[flat]

        def run(self, ref, start, tile, axis, dtype):
            run = jax.lax.dynamic_slice(ref, (start,), (tile[axis],))
            return jax.lax.broadcast_in_dim(run, tile, [axis])

    score_mod, mask_mod = (READABLE | _TRICKY)[name][:2]
    score_set, mask_set = CaptureSet(), CaptureSet()
    tile = mosaic.DKDV_TILE if transposed else mosaic.TILE
    mods = trace_mods(score_mod, mask_mod, score_set, mask_set, *mosaic._tile_signature(tile))
    rng = np.random.default_rng(0)
    score, cotangent = (jnp.asarray(rng.standard_normal(tile), jnp.float32) for _ in range(2))

    def score_vjp(s, b, h, q_idx, kv_idx, d_out):
        return jax.vjp(lambda x: score_mod(x, b, h, q_idx, kv_idx), s)[1](d_out)[0]

    for b, h, q0, kv0 in ((0, 0, 0, 0), (1, 3, 4032, 128), (1, 2, 320, 3968)):
        q_idx = q0 + jax.lax.broadcasted_iota(jnp.int32, tile, int(transposed))
        kv_idx = kv0 + jax.lax.broadcasted_iota(jnp.int32, tile, 1 - int(transposed))
        index = [jnp.int32(b), jnp.int32(h)]
        for fn, captures, leading, trailing, plain in (
                (mods.score, score_set.captures, [score, *index], [], score_mod),
                (mods.score_vjp, score_set.captures, [score, *index], [cotangent], score_vjp),
                (mods.mask, mask_set.captures, index, [], mask_mod)):
            if fn is None:
                continue
            refs = [mosaic._kernel_operand(c) for c in captures]
            avals = [jax.typeof(c) for c in captures]
            [ours] = in_kernel._evaluate(fn, LoadsOnTheCpu(), refs, avals, leading,
                                         (jnp.int32(q0), jnp.int32(kv0)), (4096, 4096), tile,
                                         transposed, trailing)
            np.testing.assert_array_equal(ours, plain(*leading, q_idx, kv_idx, *trailing))


def test_tanh_in_mods_avoids_the_approximate_instruction():
    """The kernel compiles with approximate math; a mod's tanh is computed through exp2
    instead of tanh.approx (off by up to 2**-11). Evaluated here on the CPU, where exp2 is
    exact, it stays within 5e-7 (a few float32 ulps), saturating at +-inf."""
    from jattn._src.attention import pallas_mosaic_gpu_mods
    from jattn._src.user_functions import CaptureSet

    score = jnp.concatenate([jnp.linspace(-2000.0, 2000.0, 40001, dtype=jnp.float32),
                             jnp.array([0.0, 1e-8, -1e-8, jnp.inf, -jnp.inf])])
    index = jnp.zeros((), jnp.int32)
    traced = CaptureSet().trace(jattn.mods.softcap(30.0),
                                (score, index, index, score.astype(jnp.int32), index))
    assert "tanh" in str(traced.closed_jaxpr)
    def in_kernel(score):
        return pallas_mosaic_gpu_mods.call_in_kernel(traced, [], [], (score, index, index),
                                                     (index, index), (128, 128), (64, 128))[0]

    evaluated = str(jax.make_jaxpr(in_kernel)(score))
    assert "tanh" not in evaluated and "exp2" in evaluated
    capped = in_kernel(score)
    np.testing.assert_allclose(capped, 30.0 * np.tanh(np.float64(score) / 30.0), rtol=0,
                               atol=30 * 5e-7)


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
    "captured arrays gqa": (2, 4, 2, 512, 128, jnp.bfloat16, _captured_reads,
                            READABLE["bool flags[h]"][1]),
    "ragged documents by captured ids": (2, 4, 2, 512, 64, jnp.bfloat16, _position_biases,
                                         _ragged_documents),
    "shifted reads, decided comparisons": (2, 4, 4, 512, 128, jnp.float16,
                                           *_TRICKY["shifted and compared"]),
    "a ring's global positions": (1, 2, 2, 4096, 64, jnp.bfloat16,
                                  *_TRICKY["a ring's global positions"]),
}


@gpu
@pytest.mark.parametrize("name", CASES)
def test_output_lse_and_gradients_match_a_float64_golden(name):
    _check_case(name)


@gpu
@pytest.mark.parametrize("name", ["full bf16 d128", "causal fp16 d64 gqa", "window softcap",
                                  "documents head bias"])
def test_dq_reduce_added_by_the_dkdv_kernel_matches_the_golden(monkeypatch, request, name):
    """deterministic=False: dQ reduce-added by the dK/dV kernel, split over the consumers by
    keys at head dim 64 and (reached by REDUCE_ADD_HEAD_DIMS alone) by head dims at 128."""
    from jattn._src.attention import pallas_mosaic_gpu_bwd

    monkeypatch.setattr(pallas_mosaic_gpu_bwd, "REDUCE_ADD_HEAD_DIMS", (64, 128))
    jattn.clear_caches()  # programs planned under the other setting
    request.addfinalizer(jattn.clear_caches)
    _check_case(name, deterministic=False)


def _check_case(name, deterministic=True):
    B, Hq, Hkv, L, E, dtype, score_mod, mask_mod = CASES[name]
    q, k, v = _inputs(B, Hq, Hkv, L, E, dtype)
    # Per batch row: some masks differ between rows (document ids of each).
    block_mask = None if mask_mod is None else jattn.create_block_mask(mask_mod, B, None, L, L)
    check_against_golden(MOSAIC, q, k, v, score_mod, block_mask, deterministic=deterministic)
    if name == "empty rows":
        out = jattn.flex_attention(q, k, v, score_mod, block_mask, implementation=MOSAIC)
        assert np.all(np.asarray(out)[:, :, :128] == 0)


def _window_by_head(b, h, q_idx, kv_idx):  # causal, 128 (h + 1) keys back: work varies by head
    return (kv_idx <= q_idx) & (q_idx - kv_idx < 128 * (h + 1))


@gpu
@pytest.mark.parametrize("B, Hq, Hkv, E, dtype, score_mod, mask_mod, heads, sms", [
    # The order and tiles a program; a grid sized for the paired order's tiles a program
    # leaves programs idle in the others.
    (2, 4, 2, 64, jnp.float16, None, jattn.masks.causal_mask, None, 3),  # dealt, 7 (14 idle)
    (2, 4, 2, 64, jnp.float16, None, jattn.masks.causal_mask, None, 7),  # paired, 3
    (1, 4, 4, 128, jnp.bfloat16, _softcap, _first_block_row_empty, None, 3),  # paired, 1
    (2, 4, 4, 64, jnp.float16, None, _window_by_head, 4, 5),  # paired by batch and head, 4
    (2, 4, 2, 64, jnp.float16, None, lambda b, h, q_idx, kv_idx: q_idx >= 0, None,
     3),  # rows in order, heads in turn, 7 (14 idle)
    (2, 8, 4, 128, jnp.bfloat16, None, None, None, 3),  # no BlockMask: up to 16 tiles, 9 here
])
def test_programs_walking_several_tiles_match_the_golden(monkeypatch, B, Hq, Hkv, E, dtype,
                                                         score_mod, mask_mod, heads, sms):
    """With few SMs for the tiles (3 to 10 here, 20-80 tiles of 640 queries), each program
    walks up to seven tiles (nine without a BlockMask), the last program fewer: its K/V ring
    and query buffers run on from one tile into the next. `tile_order` decides per call how
    the programs take them (the comments say which it picks): dealt round the programs,
    paired (per mask batch and head where the mask has them), or rows in order, heads in
    turn."""
    monkeypatch.setattr(hardware, "num_sms", lambda: sms)
    q, k, v = _inputs(B, Hq, Hkv, 640, E, dtype, seed=7)
    block_mask = None if mask_mod is None else jattn.create_block_mask(mask_mod, B, heads, 640,
                                                                       640)
    check_against_golden(MOSAIC, q, k, v, score_mod, block_mask, grads=False)


@gpu
def test_is_bitwise_repeatable():
    """Forward and backward: no atomics, so two runs agree to the bit."""
    q, k, v = _inputs(2, 8, 2, 1024, 128, jnp.bfloat16, seed=3)
    mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 1024, 1024)
    cotangent = random(np.random.default_rng(4), q.shape, q.dtype)

    @jax.jit
    def attention_and_gradients(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: jattn.flex_attention(
            q, k, v, _softcap, mask, enable_gqa=True, implementation=MOSAIC), q, k, v)
        return out, vjp(cotangent)

    assert_bitwise_equal_runs(lambda: attention_and_gradients(q, k, v))


@gpu
def test_captured_arrays_are_read_at_each_call():
    """Captured arrays are kernel inputs: new slopes and new document ids between two calls
    (mods of one trace, so one cached program) give each call's own result."""
    q, k, v = _inputs(2, 4, 4, 512, 64, jnp.bfloat16, seed=5)
    for slopes, ids in ((jnp.linspace(0.1, 1.0, 4), _ragged_ids([100, 300], [64, 65])),
                        (jnp.linspace(2.0, 0.5, 4), _ragged_ids([256], [9, 500]))):
        def score_mod(score, b, h, q_idx, kv_idx, slopes=slopes):
            return score + slopes[h] * (kv_idx - q_idx) / 64

        block_mask = jattn.create_block_mask(jattn.masks.document_mask(ids), 2, None, 512, 512)
        check_against_golden(MOSAIC, q, k, v, score_mod, block_mask)


@pytest.mark.parametrize("kv_batch, score_mod, deterministic, head_dims, mosaic_kernels, E", [
    (2, None, True, (64,), 3, 128),
    (2, jattn.mods.alibi(_SLOPES), True, (64,), 3, 128),  # its gradient reads the slopes too
    # deterministic=False: dQ reduce-added by the dK/dV kernel, by keys at 64
    (2, None, False, (64,), 2, 64),
    (2, None, True, (64,), 3, 64),
    (2, jattn.mods.alibi(_SLOPES), False, (64,), 3, 128),  # not at 128 by default
    (2, jattn.mods.alibi(_SLOPES), False, (64, 128), 2, 128),  # split by head dims there
    (1, None, False, (64,), 1, 128),  # a broadcast k/v batch: pallas_triton's backward
])
def test_backward_lowers_to_the_mosaic_kernels_where_it_runs(as_if_on_hopper, monkeypatch,
                                                             request, kv_batch, score_mod,
                                                             deterministic, head_dims,
                                                             mosaic_kernels, E):
    pytest.importorskip("absl")
    from jattn._src.attention import pallas_mosaic_gpu_bwd

    monkeypatch.setattr(pallas_mosaic_gpu_bwd, "REDUCE_ADD_HEAD_DIMS", head_dims)
    jattn.clear_caches()  # programs planned under the other setting
    request.addfinalizer(jattn.clear_caches)
    B, Hq, L = 2, 4, 512
    block_mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, L)

    def gradients(q, k, v):
        def attention(q, k, v):
            return jattn.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True,
                                        implementation=MOSAIC, deterministic=deterministic)
        return jax.vjp(attention, q, k, v)[1](jnp.ones((B, Hq, L, E), jnp.bfloat16))

    text = lower_for_cuda(gradients, _spec(B, Hq, L, E), _spec(kv_batch, 2, L, E),
                          _spec(kv_batch, 2, L, E))
    assert ("jattn_flex_bwd_dq" in text) == (mosaic_kernels == 1)
    assert text.count("custom_call @mosaic_gpu") == mosaic_kernels


@pytest.mark.parametrize("E, deterministic, mosaic_kernels", [(128, True, 3), (64, False, 2)])
def test_dropout_lowers_to_the_mosaic_kernels(as_if_on_hopper, E, deterministic,
                                              mosaic_kernels):
    """The forward and both backward kernels (or the dK/dV kernel reduce-adding dQ) drop the
    weights by the word tables they load; a score_mod and a mask_mod beside them."""
    pytest.importorskip("absl")
    B, Hq, L = 2, 4, 512
    block_mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, L)

    def gradients(q, k, v, key):
        def attention(q, k, v):
            return jattn.flex_attention(q, k, v, jattn.mods.softcap(20.0), block_mask,
                                        enable_gqa=True, implementation=MOSAIC,
                                        dropout_rate=0.1, dropout_key=key,
                                        deterministic=deterministic)
        return jax.vjp(attention, q, k, v)[1](jnp.ones((B, Hq, L, E), jnp.bfloat16))

    text = lower_for_cuda(gradients, _spec(B, Hq, L, E), _spec(B, 2, L, E), _spec(B, 2, L, E),
                          jax.random.key(0))
    assert text.count("custom_call @mosaic_gpu") == mosaic_kernels


def test_dropout_runs_on_the_mosaic_kernels_by_default(as_if_on_hopper):
    """Measured faster than pallas_triton's dropout (bench_features: 1.02-1.08x, H100)."""
    q = jnp.zeros((1, 2, 512, 128), jnp.bfloat16)

    def attention(q):
        return jattn.flex_attention(q, q, q, dropout_rate=0.1, dropout_key=jax.random.key(0))

    text = jattn.explain(attention, q)
    assert text.startswith("flex_attention: pallas_mosaic_gpu"), text


@gpu
@pytest.mark.parametrize("name, deterministic", [("full bf16 d128", True),
                                                 ("causal fp16 d64 gqa", True),
                                                 ("causal fp16 d64 gqa", False),
                                                 ("documents head bias", True)])
def test_dropout_matches_the_golden_with_the_same_mask(name, deterministic):
    """The Mosaic kernels drop the weights every implementation drops for the key: output,
    LSE and gradients against the float64 golden of that mask."""
    B, Hq, Hkv, L, E, dtype, score_mod, mask_mod = CASES[name]
    q, k, v = _inputs(B, Hq, Hkv, L, E, dtype)
    block_mask = None if mask_mod is None else jattn.create_block_mask(mask_mod, B, None, L, L)
    check_against_golden(MOSAIC, q, k, v, score_mod, block_mask, deterministic=deterministic,
                         dropout_rate=0.2, dropout_key=jax.random.key(4))


def test_explain_names_the_backward_that_runs_elsewhere(as_if_on_hopper):
    B, Hq, L, E = 2, 4, 512, 128
    mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, L)

    def attention(q, k, v):
        return jattn.flex_attention(q, k, v, block_mask=mask, enable_gqa=True)

    q = jnp.zeros((B, Hq, L, E), jnp.bfloat16)
    for kv_batch, note in ((2, None), (1, "backward on pallas_triton (pallas_mosaic_gpu's "
                                          "backward: it takes k/v with q's batch (2), not a "
                                          "broadcast batch of 1.)")):
        kv = jnp.zeros((kv_batch, 2, L, E), jnp.bfloat16)
        text = jattn.explain(attention, q, kv, kv)
        assert text.startswith("flex_attention: pallas_mosaic_gpu")
        assert (note in text) if note else ("backward" not in text), text

"""Torch-written mods through interop.torch.flex_attention, used as training scripts use them:
state that changes between calls, a fresh closure each step, in-place edits, long loops, two
threads; torch's mod language (PyTorch's FlexAttention tests and attention-gym); clear errors.
Each result is compared with torch's own flex_attention, gradients with a float64 reference."""

import functools
import gc
import logging
import resource
import threading
import weakref

import pytest

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")
import interop.torch as jt  # noqa: E402
from interop import _capture, _ops  # noqa: E402
from tests.interop.torch_reference import (  # noqa: E402
    as64, assert_like_torch, dense, torch_flex)

B, H, L, E = 2, 4, 80, 16
GEN = torch.Generator().manual_seed(0)


def _qkv(requires_grad=False):
    return [torch.randn(B, H, L, E, generator=GEN).requires_grad_(requires_grad)
            for _ in range(3)]


def _check(q, k, v, score_mod=None, mask_mod=None):
    """Our output against torch's flex_attention (float32) and the float64 reference."""
    block_mask = None if mask_mod is None else jt.create_block_mask(
        mask_mod, None, None, L, L, "cpu", 32)
    out = jt.flex_attention(q, k, v, score_mod, block_mask)
    assert_like_torch(out, dense(*as64(q, k, v), score_mod, mask_mod),
                      torch_flex(q, k, v, score_mod, mask_mod))
    return out


# ------------------------------------------------------------------------------------------------
# State that changes between calls
# ------------------------------------------------------------------------------------------------

SOFTCAP = 20.0
TABLE = torch.randn(H, 2 * L, generator=GEN)


def _global_softcap(score, b, h, q_idx, kv_idx):
    return SOFTCAP * torch.tanh(score / SOFTCAP)


def _global_table(score, b, h, q_idx, kv_idx):
    return score + TABLE[h, q_idx - kv_idx + L]


def test_a_changed_closure_value_is_seen():
    q, k, v = _qkv()
    state = {"scale": 1.0}

    def mod(score, b, h, q_idx, kv_idx):
        return score * state["scale"]

    first = _check(q, k, v, mod)
    state["scale"] = 3.0
    second = _check(q, k, v, mod)
    assert not torch.allclose(first, second)


def test_a_rebound_global_scalar_and_tensor_are_seen():
    global SOFTCAP, TABLE
    q, k, v = _qkv()
    saved = SOFTCAP, TABLE
    try:
        for SOFTCAP in (20.0, 2.0, 0.5):
            _check(q, k, v, _global_softcap)
        for TABLE in (torch.randn(H, 2 * L, generator=GEN) for _ in range(3)):
            _check(q, k, v, _global_table)
    finally:
        SOFTCAP, TABLE = saved


def test_a_reassigned_attribute_and_a_flag_are_seen():
    q, k, v = _qkv()

    class Bias:
        def __init__(self):
            self.weight, self.add = torch.randn(H, generator=GEN), True

        def mod(self, score, b, h, q_idx, kv_idx):
            return score + self.weight[h] if self.add else score * self.weight[h]

    bias = Bias()
    outputs = [_check(q, k, v, bias.mod)]
    bias.weight = torch.randn(H, generator=GEN)
    outputs.append(_check(q, k, v, bias.mod))
    bias.add = False
    outputs.append(_check(q, k, v, bias.mod))
    assert not torch.allclose(outputs[0], outputs[1])
    assert not torch.allclose(outputs[1], outputs[2])


def test_unchanged_state_reuses_the_translation():
    q, k, v = _qkv()
    table = torch.randn(H, 2 * L, generator=GEN)

    def mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + L]

    keys = {_ops.capture_mods(mod, None)[0] for _ in range(3)}
    _check(q, k, v, mod)
    before = len(_capture._TRANSLATIONS)
    _check(q, k, v, mod)
    assert len(keys) == 1 and len(_capture._TRANSLATIONS) == before


def test_a_mod_over_a_growing_tensor_finds_its_translations_again(caplog):
    """transformers' generation loop: a mask_mod over a padding mask one longer each step and
    an int offset. Past Dynamo's recompile limit for the mod, a state seen before gets its
    translation again (and so the ops' compiled programs), and Dynamo's recompile-limit
    warning (which would name jattn's trampoline) is never printed."""
    def mask_for(length):
        padding, offset = torch.ones(length, dtype=torch.bool), length - 1

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx + offset) & padding[kv_idx]
        return mask_mod

    lengths = range(8, 20)  # more states than Dynamo's recompile limit (8)
    with caplog.at_level(logging.WARNING):
        first = [_capture.capture(mask_for(n), "mask")[0].key for n in lengths]
        again = [_capture.capture(mask_for(n), "mask")[0].key for n in lengths]
    assert again == first and len(set(first)) == len(lengths)
    assert "recompile_limit" not in caplog.text


def test_transformers_padding_mask_skips_dynamo_once_seen(monkeypatch):
    """transformers' mask in generation (add_offsets over and_masks of a causal mask and a
    padding mask, `.to(result.device)` inside): once a state is translated, a fresh mask of
    that state is checked by the replayed guards, not by Dynamo (whose guards reach `torch`
    through torch's own modules too)."""
    def and_masks(*mods):
        def and_mask(b, h, q_idx, kv_idx):
            result = q_idx.new_ones((), dtype=torch.bool)
            for mod in mods:
                result = result & mod(b, h, q_idx, kv_idx).to(result.device)
            return result
        return and_mask

    def padding(padding_mask):
        def inner_mask(b, h, q_idx, kv_idx):
            return padding_mask[b, kv_idx]
        return inner_mask

    def with_offset(mod, q_offset):
        def inner_mask(b, h, q_idx, kv_idx):
            return mod(b, h, q_idx + q_offset, kv_idx)
        return inner_mask

    def mask_for(step):
        causal = lambda b, h, q_idx, kv_idx: kv_idx <= q_idx  # noqa: E731
        return with_offset(and_masks(causal, padding(torch.ones(2, 20 + step, dtype=bool))),
                           19 + step)

    for step in range(3):
        _capture.capture(mask_for(step), "mask")
    dynamo_calls = []
    original = _capture._call
    monkeypatch.setattr(_capture, "_call", lambda *a, **k: dynamo_calls.append(1) or original(
        *a, **k))
    for step in range(3):
        _capture.capture(mask_for(step), "mask")
    assert not dynamo_calls


def test_what_dynamo_guards_is_checked_on_every_call():
    """The guards replayed in Python catch each change Dynamo's would: a captured tensor of a
    new shape, a mask swapped inside a list the mod iterates, a flag, a dict key."""
    q, k, v = _qkv()
    table = {"t": torch.randn(H, generator=GEN)}
    masks = [lambda b, h, qi, ki: qi >= ki, lambda b, h, qi, ki: qi - ki < 40]
    options = {"add": True}

    def score_mod(score, b, h, q_idx, kv_idx):
        bias = table["t"][h % table["t"].shape[0]]
        return score + bias if options["add"] else score - bias

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = b.new_ones((), dtype=torch.bool)
        for mask in masks:
            allowed = allowed & mask(b, h, q_idx, kv_idx)
        return allowed

    outputs = [_check(q, k, v, score_mod, mask_mod)]
    table["t"] = torch.randn(2, generator=GEN)  # a new shape
    outputs.append(_check(q, k, v, score_mod, mask_mod))
    masks[1] = lambda b, h, qi, ki: qi - ki < 8  # another function in the list
    outputs.append(_check(q, k, v, score_mod, mask_mod))
    options["add"] = False
    outputs.append(_check(q, k, v, score_mod, mask_mod))
    masks.append(lambda b, h, qi, ki: ki % 2 == 0)  # a longer list
    outputs.append(_check(q, k, v, score_mod, mask_mod))
    for before, after in zip(outputs, outputs[1:]):
        assert not torch.allclose(before, after)


def test_in_place_edits_of_a_captured_tensor_and_of_q_are_seen():
    q, k, v = _qkv()
    table = torch.randn(H, 2 * L, generator=GEN)

    def mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + L]

    first = _check(q, k, v, mod)
    table.mul_(-2.0)
    assert not torch.allclose(first, _check(q, k, v, mod))
    square = torch.randn(B, H, E, E, generator=GEN)  # transpose_ keeps the shape
    out = jt.flex_attention(square, square, square)
    square.transpose_(2, 3)
    flipped = jt.flex_attention(square, square, square)
    assert not torch.allclose(out, flipped)
    torch.testing.assert_close(flipped, torch_flex(square, square, square), rtol=1e-5,
                               atol=1e-5)


def test_a_fresh_closure_each_step_reuses_one_program_and_frees_its_tensors():
    """The way a per-step tensor reaches a mod: a new closure over it every step. One
    translation and one compiled program serve every step; each step reads its own tensor,
    and dropped closures and tensors are freed."""
    q, k, v = _qkv()
    mask = jt.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, L, L, "cpu", 32)

    def step():
        documents = torch.randint(0, 3, (L,), generator=GEN).sort().values

        def same_document(score, b, h, q_idx, kv_idx):
            return torch.where(documents[q_idx] == documents[kv_idx], score, -torch.inf)

        out = jt.flex_attention(q, k, v, same_document, mask)
        expected = torch_flex(q, k, v, same_document, lambda b, h, qi, ki: qi >= ki)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        return _ops.capture_mods(same_document, mask.mask_mod)[0], weakref.ref(documents)

    key, first = step()
    plans = len(_ops.FLEX_PLANS)
    keys, dead = zip(*(step() for _ in range(5)))
    assert set(keys) == {key} and len(_ops.FLEX_PLANS) == plans
    gc.collect()
    assert first() is None and all(ref() is None for ref in dead)


def test_memory_stays_flat_over_many_steps_with_a_fresh_closure_each():
    q, k, v = (x[:, :, :32] for x in _qkv())

    def step():
        bias = torch.randn(H, generator=GEN)
        jt.flex_attention(q, k, v, lambda s, b, h, qi, ki: s + bias[h])

    for _ in range(300):  # warm: compiles, caches, allocator pools
        step()
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(3000):
        step()
    gc.collect()
    growth_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert growth_kib < 8 * 1024, f"RSS grew by {growth_kib} KiB over 3000 steps"


def test_the_returned_lse_is_the_callers_to_edit():
    """Normalising the returned LSE in place (as an LSE merge does) leaves the gradients
    alone."""
    q, k, v = _qkv(requires_grad=True)
    d_out = torch.randn(B, H, L, E, generator=GEN)

    def grads(edit):
        out, lse = jt.flex_attention(q, k, v, return_lse=True)
        if edit:
            lse.sub_(lse.max())
        return torch.autograd.grad(out, (q, k, v), d_out)

    for clean, edited in zip(grads(False), grads(True)):
        assert torch.equal(clean, edited)


def test_first_calls_from_two_threads_are_correct():
    q, k, v = _qkv()
    barrier = threading.Barrier(2)
    results, errors = {}, []

    def run(i):
        slopes = torch.exp2(-torch.arange(1, H + 1, dtype=torch.float32) * (i + 1))

        def mod(score, b, h, q_idx, kv_idx):  # a new code object per thread and trial
            return score + slopes[h] * (kv_idx - q_idx)

        try:
            barrier.wait()
            results[i] = jt.flex_attention(q, k, v, mod), mod
        except Exception as error:  # noqa: BLE001  (reported below)
            errors.append(error)

    for _ in range(3):
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for out, mod in results.values():
            torch.testing.assert_close(out, torch_flex(q, k, v, mod), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# torch's mod language
# ------------------------------------------------------------------------------------------------

BIAS = torch.randn(B, H, L, L, generator=GEN)
ROWS = torch.randn(L, 3, generator=GEN)
DOCS = torch.arange(L) // 23
OFFSETS = torch.tensor([0, 23, 46, 69])
HEAD = torch.randn(H, generator=GEN)


class _Alibi(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("slopes", torch.exp2(-torch.arange(1, H + 1.0)))

    def forward(self, score, b, h, q_idx, kv_idx):
        return score + self.slopes[h] * (kv_idx - q_idx)


def _partial_bias(score, b, h, q_idx, kv_idx, table):
    return score + table[h]


SCORE_MODS = {
    "tan_silu_gelu": lambda s, b, h, q, kv: torch.tan(s / 8) + torch.nn.functional.silu(s)
    + torch.nn.functional.gelu(s) + torch.nn.functional.gelu(s, approximate="tanh"),
    "trig": lambda s, b, h, q, kv: torch.sin(torch.cos(s)) + torch.tan(b.float()),
    "activations": lambda s, b, h, q, kv: torch.nn.functional.leaky_relu(s, 0.2)
    + torch.nn.functional.elu(s) + torch.nn.functional.selu(s) + torch.nn.functional.celu(s, 0.5)
    + torch.nn.functional.relu6(s * 4) + torch.nn.functional.hardtanh(s, -0.5, 0.25)
    + torch.where(torch.signbit(s), 1.0, 0.5) + torch.i0(s / 4),
    "exp2_log1p": lambda s, b, h, q, kv: s + torch.log1p(torch.exp2(-(h + 1) * 0.5)),
    "full_like": lambda s, b, h, q, kv: torch.where(q >= kv, s, torch.full_like(s, -1e4)),
    "shifts": lambda s, b, h, q, kv: s + ((q >> 2) & 3) - (kv << 1) % 7,
    "int_division": lambda s, b, h, q, kv: s - q // (1 + kv) + (q / 7).floor(),
    "reductions": lambda s, b, h, q, kv: s + HEAD.sum() + HEAD.max() + ROWS.mean(),
    "dot_of_rows": lambda s, b, h, q, kv: s + torch.dot(ROWS[q], ROWS[kv]),
    "chained_index": lambda s, b, h, q, kv: s + BIAS[b][h][q][kv],
    "chained_mixed": lambda s, b, h, q, kv: s + BIAS[None][0][b, h][q, kv],
    "zero_d_index": lambda s, b, h, q, kv: s + BIAS[b, h, q, h.new_zeros(h.shape)],
    "nested_gather": lambda s, b, h, q, kv: s + (q - OFFSETS[DOCS[q]]) * 0.01,
    "clamp_positional": lambda s, b, h, q, kv: s * (q - kv).abs().clamp(1, 9).to(s.dtype),
    "to_dtype": lambda s, b, h, q, kv: s * (q >= kv).to(torch.float32),
    "default_argument": lambda s, b, h, q, kv, t=HEAD: s + t[h],
    "partial": functools.partial(_partial_bias, table=HEAD * 2),
    "module": _Alibi(),
    "bound_method": _Alibi().forward,
    # torch calls a mod on 0-d tensors: a reduction reduces one element
    "sum_of_one": lambda s, b, h, q, kv: s.sum(),
    "reductions_of_one": lambda s, b, h, q, kv: s.mean() + s.amax() * 0.5 + (q - kv).sum() * 0.01,
    "indices_of_one": lambda s, b, h, q, kv: s.max(0)[0] + s.argmax() + s.min(dim=0).indices,
}

MASK_MODS = {
    "noop": flex.noop_mask,
    "and_masks": flex.and_masks(lambda b, h, q, kv: q >= kv,
                                lambda b, h, q, kv: q - kv <= 24),
    "or_masks": flex.or_masks(lambda b, h, q, kv: kv < 8, lambda b, h, q, kv: q >= kv),
    "document": lambda b, h, q, kv: DOCS[q] == DOCS[kv],
    "bits": lambda b, h, q, kv: ((q ^ kv) & 1 == 0) | (q == kv),
    "natten_like": lambda b, h, q, kv: ((q // 8 - kv // 8).abs() <= 2) & (
        (q % 8 - kv % 8).abs() <= 3),
    "not": lambda b, h, q, kv: ~(kv > q),
    "reduction of one element": lambda b, h, q, kv: (q >= kv).any() & (q - kv <= 40).all(),
    # float quotients that are exact integers: a division one ulp off moves floor / ceil
    "exact quotients": lambda b, h, q, kv: (q >= kv) & (torch.ceil((q - kv) / 7.0) <= 3)
    | (torch.floor(q / 15.0) == torch.floor(kv / 15.0)),
}


@pytest.mark.parametrize("name", sorted(SCORE_MODS))
def test_score_mods_agree_with_torch(name):
    _check(*_qkv(), SCORE_MODS[name])


@pytest.mark.parametrize("name", sorted(MASK_MODS))
def test_mask_mods_agree_with_torch(name):
    _check(*_qkv(), None, MASK_MODS[name])


@pytest.mark.parametrize("indexing", ["table[h, q, kv]", "chained", "gate"])
def test_captured_tensor_gradients_match_float64(indexing):
    q, k, v = _qkv(requires_grad=True)
    table = torch.randn(H, L, L, generator=GEN, requires_grad=True)
    mods = {"table[h, q, kv]": lambda s, b, h, qi, ki, t: s + t[h, qi, ki],
            "chained": lambda s, b, h, qi, ki, t: s + t[h][qi][ki],
            "gate": lambda s, b, h, qi, ki, t: s * torch.sigmoid(t[h, 0, 0])}
    body = mods[indexing]
    d_out = torch.randn(B, H, L, E, generator=GEN)

    def grads(q, k, v, table, run):
        out = run(q, k, v, lambda s, b, h, qi, ki: body(s, b, h, qi, ki, table))
        return torch.autograd.grad(out, (q, k, v, table), d_out.to(out.dtype))

    ours = grads(q, k, v, table, jt.flex_attention)
    gold = grads(*as64(q, k, v, table), dense)
    reference = grads(q, k, v, table, dense)
    for name, a, g, r in zip(("dq", "dk", "dv", "d_table"), ours, gold, reference):
        assert_like_torch(a, g, r, what=name)


# ------------------------------------------------------------------------------------------------
# Errors that name the mod and the fix
# ------------------------------------------------------------------------------------------------

def test_a_python_branch_on_a_tensor_points_to_torch_where():
    def branching(score, b, h, q_idx, kv_idx):
        return score if q_idx >= kv_idx else -score

    with pytest.raises(ValueError, match="branching.*torch.where"):
        jt.flex_attention(*_qkv(), branching)


def test_a_mod_with_the_wrong_parameters_says_so():
    with pytest.raises(TypeError, match=r"score_mod .* must take 5 arguments .*\(s, b\)"):
        jt.flex_attention(*_qkv(), lambda s, b: s)
    with pytest.raises(TypeError, match=r"mask_mod .* must take 4 arguments"):
        jt.create_block_mask(lambda b, h, q: q > 0, None, None, L, L, "cpu")


def test_a_result_that_is_not_one_value_names_the_mod_and_its_shape():
    def stacked(score, b, h, q_idx, kv_idx):
        return torch.stack([score, score])

    with pytest.raises(TypeError, match=r"score_mod .*stacked must return a 0-d tensor.*returns "
                                        r"shape \[2\]"):
        jt.flex_attention(*_qkv(), stacked)


def test_a_read_past_a_captured_tensors_end_names_it():
    short = torch.zeros(H - 1)

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + short[h]

    with pytest.raises(ValueError, match=r"score_mod .*head_bias reads `short`, a float32\[3\] "
                                         r"array, along axis 0 at the index h, which reaches 3"):
        jt.flex_attention(*_qkv(), head_bias)
    docs = torch.zeros(L // 2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"mask_mod .* reads `docs`, an int32\[40\]"):
        jt.create_block_mask(lambda b, h, q, kv: docs[q] == docs[kv], None, None, L, L, "cpu")


def test_an_untranslatable_op_names_itself_and_the_mod():
    def zeta(score, b, h, q_idx, kv_idx):
        return torch.special.zeta(score, score)

    with pytest.raises(NotImplementedError, match="score_mod .*zeta uses aten.special_zeta"):
        jt.flex_attention(*_qkv(), zeta)


# ------------------------------------------------------------------------------------------------
# On the GPU: the Pallas kernels, against torch's own (compiled) flex_attention
# ------------------------------------------------------------------------------------------------

def _cuda_score_mods() -> dict:
    """Some of SCORE_MODS, over CUDA copies of the tensors they read."""
    bias, docs, offsets, head = (t.cuda() for t in (BIAS, DOCS, OFFSETS, HEAD))
    return {
        "chained_index": lambda s, b, h, q, kv: s + bias[b][h][q][kv],
        "nested_gather": lambda s, b, h, q, kv: s + (q - offsets[docs[q]]) * 0.01,
        "shifts": SCORE_MODS["shifts"],
        "full_like": SCORE_MODS["full_like"],
        "module": _Alibi().cuda(),
        "partial": functools.partial(_partial_bias, table=head * 2),
    }


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["chained_index", "nested_gather", "shifts", "full_like",
                                  "module", "partial"])
def test_on_cuda_mods_and_changed_state_agree_with_torch(name):
    """bf16 on CUDA: a torch mod and a document mask rebuilt over new per-step ids, three
    steps with the mod's state changed in between; each step against the float64 reference,
    with torch's bf16 flex_attention as the low-precision reference."""
    q, k, v = (x.to("cuda", torch.bfloat16) for x in _qkv())
    mod = _cuda_score_mods()[name]
    scale = {"value": 1.0}
    for step in range(3):
        documents = (torch.arange(L, device="cuda") + 7 * step) // 29

        def same_document(b, h, q_idx, kv_idx):
            return documents[q_idx] == documents[kv_idx]

        def score_mod(score, b, h, q_idx, kv_idx):
            return mod(score, b, h, q_idx, kv_idx) * scale["value"]

        mask = jt.create_block_mask(same_document, None, None, L, L, "cuda", 32)
        out = jt.flex_attention(q, k, v, score_mod, mask)
        assert_like_torch(out, dense(*as64(q, k, v), score_mod, same_document),
                          torch_flex(q, k, v, score_mod, same_document))
        scale["value"] *= 0.5


@pytest.mark.gpu
def test_on_hopper_document_ids_read_by_position_agree_with_torch():
    """bf16 on an H100, the Mosaic GPU forward: torch mods reading captured document ids
    (int64, per batch row) and per-key biases by position, both replaced in place between
    three steps; each step's output against the float64 reference."""
    length, dim = 512, 64
    q, k, v = (torch.randn(B, H, length, dim, generator=GEN).to("cuda", torch.bfloat16)
               for _ in range(3))
    documents = torch.zeros(B, length, dtype=torch.int64, device="cuda")
    key_bias = torch.zeros(length, device="cuda")

    def same_document(b, h, q_idx, kv_idx):
        return (documents[b, q_idx] == documents[b, kv_idx]) & (q_idx >= kv_idx)

    def biased(score, b, h, q_idx, kv_idx):
        return score + key_bias[kv_idx]

    for step in range(3):
        shifts = torch.tensor([[7 * step], [100 + 13 * step]], device="cuda")
        documents.copy_((torch.arange(length, device="cuda") + shifts) // (61 + 20 * step))
        key_bias.copy_(torch.linspace(-1.0, 1.0, length, device="cuda") * (step - 1))
        mask = jt.create_block_mask(same_document, B, None, length, length, "cuda", 128)
        out = jt.flex_attention(q, k, v, biased, mask, implementation="pallas_mosaic_gpu")
        assert_like_torch(out, dense(*as64(q, k, v), biased, same_document),
                          torch_flex(q, k, v, biased, same_document, block_size=128))

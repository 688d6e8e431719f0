"""Torch-written masks and score mods shared by the tests that compare with torch FlexAttention
(import only after `pytest.importorskip("torch")`)."""

import torch


def torch_mask(name: str, segments: torch.Tensor):
    """causal, sliding (window 48), prefix (64) or document (over `segments`)."""
    if name == "causal":
        return lambda b, h, q, kv: q >= kv
    if name == "sliding":
        return lambda b, h, q, kv: (q >= kv) & (q - kv < 48)
    if name == "prefix":
        return lambda b, h, q, kv: (kv < 64) | (q >= kv)
    return lambda b, h, q, kv: segments[q] == segments[kv]


def torch_score_mod(name: str, slopes: torch.Tensor, table: torch.Tensor | None, radius: int):
    """alibi (`slopes`), softcap 20, relative (`table` [H, 2·radius+1]) or None."""
    if name == "alibi":
        return lambda s, b, h, q, kv: s + slopes[h] * (kv - q)
    if name == "softcap":
        return lambda s, b, h, q, kv: 20.0 * torch.tanh(s / 20.0)
    if name == "relative":
        return lambda s, b, h, q, kv: s + table[h, torch.clamp(kv - q, -radius, radius) + radius]
    return None

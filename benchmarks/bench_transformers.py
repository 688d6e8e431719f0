"""A transformers Llama train step with attention through interop.torch.flex_attention, against
SDPA and torch's FlexAttention in the same run.

    python -m benchmarks.bench_transformers [--steps 20] [--rounds 5] [--json out.json]

"jattn" is transformers' own flex_attention integration with its call of torch's (compiled)
flex_attention swapped for `interop.torch.flex_attention`, nothing else changed: the drop-in as
a user would make it. Each step builds transformers' BlockMask and a fresh score_mod closure per
layer, as transformers does. Model: 4 layers, hidden 2048, 16 query / 4 kv heads, B4 L2048,
bf16, on CUDA (needs `transformers`). Prints each round's median step time and first loss of
each implementation (they agree to bf16 rounding), then each one's best round.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import interop.torch as jt
from benchmarks import record
from benchmarks.timing import warm_up

B, L, VOCAB = 4, 2048, 32000


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                         num_attention_heads=16, num_key_value_heads=4, vocab_size=VOCAB,
                         max_position_embeddings=L, attention_dropout=0.0)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16)


def _use(model, implementation: str) -> None:
    import transformers.integrations.flex_attention as integration

    if not hasattr(integration, "_torch_flex_call"):
        integration._torch_flex_call = integration.compile_friendly_flex_attention
    if implementation == "jattn":
        integration.compile_friendly_flex_attention = (
            lambda query, key, value, training=False, **kwargs: jt.flex_attention(
                query, key, value, **kwargs))
        implementation = "flex_attention"
    else:
        integration.compile_friendly_flex_attention = integration._torch_flex_call
    model.set_attn_implementation(implementation)


def _time_steps(model, ids, steps: int) -> tuple[float, float]:
    """(median seconds per train step, the first step's loss)."""
    times, first_loss = [], None
    for i in range(steps + 3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if first_loss is None:
            first_loss = loss.item()
        if i >= 3:  # warm-up: compiles
            times.append(time.perf_counter() - start)
    return statistics.median(times), first_loss


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    model = _model()
    ids = torch.randint(0, VOCAB, (B, L), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    warm_up()
    # Rounds alternate the implementations and each keeps its best round: a step's time moves
    # by a few percent with what the host does meanwhile, as much as the sides differ.
    rows = {}
    for round_ in range(args.rounds):
        for implementation in ("sdpa", "flex_attention", "jattn"):
            _use(model, implementation)
            seconds, loss = _time_steps(model, ids, args.steps)
            rows.setdefault(implementation, []).append({"step_ms": seconds * 1e3, "loss": loss})
            print(f"round {round_} {implementation}: {seconds * 1e3:.2f} ms per train step, "
                  f"first loss {loss:.5f}", flush=True)
    best = {name: min(r["step_ms"] for r in runs) for name, runs in rows.items()}
    print(f"best of {args.rounds} rounds: sdpa {best['sdpa']:.2f} ms, torch flex "
          f"{best['flex_attention']:.2f} ms, jattn {best['jattn']:.2f} ms: "
          f"{best['jattn'] / best['flex_attention']:.3f}x torch flex, "
          f"{best['jattn'] / best['sdpa']:.3f}x SDPA")
    record.write(args.json, rows, best_ms=best)


if __name__ == "__main__":
    main()

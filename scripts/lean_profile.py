"""Where a draft step's time goes, through transformers' forward and through lean.py's.

Loads a draft model (default: the Qwen2.5-Coder 0.5B GGUF of scripts/fetch_qwen_pair.py's
cache) in bfloat16 with `#int8` products (`--int4`: its layers in 4 bits), feeds a
200-token random context, then times one-row and four-row steps (median of 12) both ways,
with the time inside the int8 (and int4) products and the modules of transformers' forward
summed separately (nested: a layer holds its attention, its MLP and its norms). Not a
test: run it by hand.

    python scripts/lean_profile.py [--model PATH] [--threads 2] [--int4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from transformers import DynamicCache

from specmtp import int4, int8
from specmtp.lean import lean_forward
from specmtp.models import load_model

DEFAULT = "~/.cache/specmtp/qwen2.5-coder/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def timed_methods(totals: dict[str, float], model: nn.Module) -> None:
    """Sum the seconds spent in int8 products and in each module kind of `model` into
    `totals` (patching their classes: this process only)."""

    def wrap(owner: type, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)

        def timed(self: object, *args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            result = original(self, *args, **kwargs)
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - start
            return result

        setattr(owner, attribute, timed)

    wrap(int8.Int8Product, "into", "int8 products")  # __call__ goes through into
    wrap(int4.Int4Product, "into", "int4 products")
    layer = model.model.layers[0]
    for module, name in [
        (layer, "decoder layers"),
        (layer.self_attn, "attention modules"),
        (layer.mlp, "MLP modules"),
        (layer.input_layernorm, "norms"),
    ]:
        wrap(type(module), "forward", name)


def median_ms(step: Callable[[torch.Tensor, torch.Tensor], object], cache: DynamicCache,
              rows: int, past: int, vocab: int, totals: dict[str, float]) -> float:  # fmt: skip
    times = []
    totals.clear()
    for _ in range(12):
        tokens = torch.randint(0, vocab, (1, rows))
        positions = torch.arange(past, past + rows)[None]
        start = time.perf_counter()
        step(tokens, positions)
        times.append(time.perf_counter() - start)
        cache.crop(-rows)
    for name in totals:
        totals[name] *= 1000 / len(times)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.path.expanduser(DEFAULT))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--int4", action="store_true", help="the decoder layers in 4 bits")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=torch.bfloat16).model
    if args.int4:
        int4.use_int4_products(model)
    int8.use_int8_products(model)
    lean = lean_forward(model)
    if lean is None:
        raise SystemExit("the lean forward does not take this model here")
    totals: dict[str, float] = {}
    timed_methods(totals, model)
    vocab, past = model.config.vocab_size, 200
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.randint(0, vocab, (1, past)), cache=cache)

        def transformers_step(tokens: torch.Tensor, positions: torch.Tensor) -> object:
            return model(input_ids=tokens, position_ids=positions, cache=cache, logits_to_keep=1)

        def lean_step(tokens: torch.Tensor, positions: torch.Tensor) -> object:
            return lean(tokens, cache, position_ids=positions, last_only=True)

        ways = {"transformers": transformers_step, "lean.py": lean_step}
        for rows in (1, 4):
            for name, step in ways.items():
                ms = median_ms(step, cache, rows, past, vocab, totals)
                parts = ", ".join(f"{part} {value:.1f}" for part, value in totals.items())
                print(f"{rows} row(s), {name}: {ms:.1f} ms a step (mean ms a step: {parts})")


if __name__ == "__main__":
    main()

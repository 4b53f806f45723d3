"""What `#int8` drafters gain and lose: (1) the time of one product of 1-17 rows with the
weights out of cache, bfloat16 F.linear against the int8 products (specmtp/int8.py):
fbgemm's with 8- and 7-bit inputs, int8.c's where this CPU has it, and torch's weight-only
int8 product; (2) how often the default model's full-vocabulary argmax over its own final
hidden states (held-out training prompts) is the float32 one, in bfloat16 and in int8.
docs/mtp-heads.md ("Drafts in int8") and docs/draft-models.md ("A native int8 product")
have figures.

    python scripts/int8_products.py [--prompts FILE] [--shape 8192x576 ...] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from specmtp import int8, native
from specmtp.models import load_model

HELD_OUT = Path.home() / ".cache/specmtp/runs/heldout7/prompts.jsonl"


def cold_ms(
    product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, flush: torch.Tensor
) -> float:
    """Median over 21 calls of product(x), a 64 MB buffer written before each."""
    product(x)
    times = []
    for _ in range(21):
        flush.add_(1.0)
        start = time.perf_counter()
        product(x)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def timings(out_features: int, in_features: int) -> None:
    weight = torch.randn(out_features, in_features)
    flush = torch.empty(64 * 1024 * 1024)  # 256 MB, written between calls
    bf16 = weight.bfloat16()
    quantized = int8.Int8Product(weight, None, kernel=None)
    kernel = native.int8_kernel()
    natively = None if kernel is None else int8.Int8Product(weight, None, kernel=kernel)
    print(f"{out_features} x {in_features}, ms per product (weights out of cache)")
    # weight-only int8 (bfloat16 inputs), the kernel tried first and not used
    weight_only = quantized.weight
    scales = quantized.scale.bfloat16()
    print("rows  bfloat16  fbgemm 8-bit  fbgemm 7-bit  int8.c  weight-only int8")
    for rows in (1, 2, 3, 4, 5, 8, 17):
        x = torch.randn(rows, in_features).bfloat16()
        cells = [cold_ms(lambda rows: F.linear(rows, bf16), x, flush)]
        for reduce in (False, True):
            quantized.reduce_range = reduce
            cells.append(cold_ms(quantized, x, flush))
        cells.append(float("nan") if natively is None else cold_ms(natively, x, flush))
        product = lambda rows: torch._weight_int8pack_mm(rows, weight_only, scales)  # noqa: E731
        cells.append(cold_ms(product, x, flush))
        print(f"{rows:4d}  " + "  ".join(f"{c:8.3f}" for c in cells))


def agreement(prompts: Path, limit: int) -> None:
    loaded = load_model("default", dtype=torch.bfloat16)
    model, tokenizer = loaded.model, loaded.tokenizer
    weight = model.get_output_embeddings().weight.detach()
    quantized = int8.Int8Product(weight.float(), None, kernel=None)
    texts = [json.loads(line)["turns"][0] for line in prompts.read_text().splitlines()[:limit]]
    same = {"bfloat16": 0, "int8 8-bit": 0, "int8 7-bit": 0}
    positions = 0
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt").input_ids[:, :200]
            hidden = model(ids, output_hidden_states=True).hidden_states[-1][0]  # [T, H]
            best = (hidden.float() @ weight.float().T).argmax(-1)
            same["bfloat16"] += int((F.linear(hidden, weight).argmax(-1) == best).sum())
            for name, reduce in (("int8 8-bit", False), ("int8 7-bit", True)):
                quantized.reduce_range = reduce
                same[name] += int((quantized(hidden.float()).argmax(-1) == best).sum())
            positions += len(best)
    print(f"argmax as in float32, {positions} positions of {len(texts)} prompts:")
    for name, count in same.items():
        print(f"  {name}: {count / positions:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=Path, default=HELD_OUT)
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--shape", action="append", help="OUTxIN (default 8192x576)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for shape in args.shape or ["8192x576"]:
        out_features, in_features = (int(n) for n in shape.split("x"))
        timings(out_features, in_features)
    if args.prompts.exists():
        agreement(args.prompts, args.limit)


if __name__ == "__main__":
    main()

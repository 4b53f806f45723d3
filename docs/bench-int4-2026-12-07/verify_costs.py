"""T(1..16) of the Qwen2.5-Coder 1.5B target (bfloat16, row-invariant, 2 threads) after a
200-token context, medians of 3 (costmodel.measure_verify_costs), with its padded shapes in
blocks of 8 rows (`--narrow`: invariant._widened turned off) or as use_row_invariant
chooses (past 8 rows blocks of 16 where that passes the probe). verify_costs.txt: the
first four runs at 7cc451b, where the wide choice ran every row count in blocks of 16; the
last two at the next commit. Run from the repository root:
python docs/bench-int4-2026-12-07/verify_costs.py [--narrow]"""
import os
import sys

import torch

from specmtp import invariant
from specmtp.cache import CachedModel
from specmtp.costmodel import measure_verify_costs
from specmtp.kernels import kernel_plan
from specmtp.models import load_model

torch.set_num_threads(2)
if "--narrow" in sys.argv:
    invariant._widened = lambda products, layers: products
Q = os.path.expanduser("~/.cache/specmtp/qwen2.5-coder/")
model = load_model(Q + "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", dtype=torch.bfloat16).model
print(kernel_plan(model).row_invariant)
runner = CachedModel(model, vocab_size=model.config.vocab_size)
costs = measure_verify_costs(runner, list(range(1000, 1200)), max_tokens=16, repeats=3)
print(" ".join(f"T({n})={1000 * c:.0f}" for n, c in enumerate(costs, 1)), "ms")

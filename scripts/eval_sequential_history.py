"""Held-out top-1 of sequential MTP heads with each depth attending over the history (as in
training, and as the drafter now drafts) against one position only (how it drafted before
`specmtp/mtp_cache.py`). Usage:

    python scripts/eval_sequential_history.py HEADS_DIR DATA_CACHE [--dtype bfloat16]

DATA_CACHE is the train-mtp/distill data cache the heads were trained on (same held-out split).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from specmtp import heads as heads_module
from specmtp.data import DistillCache
from specmtp.heads_io import load_heads
from specmtp.models import DTYPES, load_model
from specmtp.train import TrainConfig, evaluate


def one_position(block: torch.nn.Module, x: torch.Tensor, past: object = None) -> tuple:
    """The block run on every position as a sequence of its own (no history)."""
    b, n, h = x.shape
    out, _ = history(block, x.reshape(b * n, 1, h))
    return out.reshape(b, n, h), None


history = heads_module._Block.forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heads", type=Path)
    parser.add_argument("cache", type=Path)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = load_model("default", dtype=DTYPES[args.dtype])
    heads, config = load_heads(args.heads, target_model=target.model)
    heads = heads.float().eval()
    cache = DistillCache.open(args.cache)
    train = TrainConfig(sources=(args.cache,), out=Path("unused"), kind=config.kind,
                        num_heads=config.num_heads, batch_size=8, seq_len=256)  # fmt: skip
    with torch.no_grad():
        print("history      ", [round(a, 3) for a in evaluate(heads, cache, train)])
        heads_module._Block.forward = one_position
        print("one position ", [round(a, 3) for a in evaluate(heads, cache, train)])


if __name__ == "__main__":
    main()

"""Held-out top-1 per depth of heads on a cache's cached hidden states, on whole samples
only (the joint run's held-out set) and on windows cut to --seq-len (the frozen run's)."""

import sys
from dataclasses import replace
from pathlib import Path

import torch

from specmtp.data import DistillCache
from specmtp.heads_io import load_heads
from specmtp.models import load_model
from specmtp.train import TrainConfig, evaluate

torch.set_num_threads(2)
heads_dir, cache_dir = Path(sys.argv[1]), Path(sys.argv[2])
target = load_model("default", dtype=torch.bfloat16)
heads, _ = load_heads(heads_dir, target_model=target.model)
cache = DistillCache.open(cache_dir)
config = TrainConfig(
    sources=(Path("x"),), out=Path("/tmp/x"), kind="sequential", num_heads=3, batch_size=8,
    seq_len=320, heldout_fraction=0.1, objective="kl", feature_layers=(2, 15, 30),
)
print("cut windows", evaluate(heads.float(), cache, config))
print("whole samples", evaluate(heads.float(), cache, replace(config, joint=True)))
